#include "st_reshard.h"

#include <stdlib.h>
#include <string.h>

#include "st_index.h"

#define RESHARD_CHUNK (8u << 20)

/* One tensor of the source and the file that holds it. */
typedef struct src_tensor {
    const st_tensor *t;
    uint32_t file;
} src_tensor;

/* The source's tensors in data order: file by file, each file's in offset order (st_header's). */
static src_tensor *data_order(const st_set *s, st_spec **specs, dl_error *err)
{
    src_tensor *o = malloc((s->ntensors ? s->ntensors : 1) * sizeof(*o));
    size_t k = 0;

    *specs = malloc((s->ntensors ? s->ntensors : 1) * sizeof(**specs));
    if (o == NULL || *specs == NULL) {
        free(o);
        free(*specs);
        *specs = NULL;
        dl_fail(err, DL_E_NO_MEMORY, NULL, 0, "out of memory");
        return NULL;
    }
    for (uint32_t f = 0; f < s->nfiles; f++) {
        const st_header *h = s->files[f]->h;
        for (size_t i = 0; i < h->ntensors; i++, k++) {
            const st_tensor *t = &h->tensors[i];
            o[k] = (src_tensor){t, f};
            (*specs)[k] = (st_spec){t->name, t->name_len, t->dtype, t->ndim, t->shape};
        }
    }
    return o;
}

static int copy_tensors(const st_set *s, const src_tensor *o, st_set_writer *w, dl_error *err)
{
    unsigned char *buf = malloc(RESHARD_CHUNK);
    int rc = 0;

    if (buf == NULL)
        return dl_fail(err, DL_E_NO_MEMORY, NULL, 0, "out of memory for the copy buffer");
    for (size_t i = 0; i < s->ntensors && rc == 0; i++) {
        uint64_t bytes = st_tensor_bytes(o[i].t);
        for (uint64_t off = 0; off < bytes && rc == 0; off += RESHARD_CHUNK) {
            size_t n = bytes - off < RESHARD_CHUNK ? (size_t)(bytes - off) : RESHARD_CHUNK;
            if ((rc = st_set_read(s, o[i].file, o[i].t, off, buf, n, err)) == 0)
                rc = st_set_writer_write(w, i, off, buf, n, err);
        }
    }
    free(buf);
    return rc;
}

/* The source's metadata as the output carries it (see st_reshard.h): "format" is the layout's own. */
static st_kv *carried_meta(const st_set *s, int single, size_t *n, dl_error *err)
{
    const st_meta *m;
    size_t nm, k = 0;
    st_kv *kv;

    st_set_metadata(s, &m, &nm);
    if ((kv = malloc((nm + 1) * sizeof(*kv))) == NULL) {
        dl_fail(err, DL_E_NO_MEMORY, NULL, 0, "out of memory");
        return NULL;
    }
    if (single)
        kv[k++] = (st_kv){"format", "pt"};
    for (size_t i = 0; i < nm; i++)
        if (strcmp(m[i].key, "format") != 0 && strcmp(m[i].key, "total_size") != 0)
            kv[k++] = (st_kv){m[i].key, m[i].value};
    *n = k;
    return kv;
}

int st_reshard(const char *src, uint64_t src_max_header, const char *dst, uint64_t max_shard_size, const st_kv *meta,
               size_t nmeta, uint32_t *nshards, dl_error *err)
{
    st_set *s = NULL;
    st_set_writer *w = NULL;
    st_spec *specs = NULL;
    src_tensor *o = NULL;
    st_kv *own_meta = NULL;
    int rc;

    if ((rc = st_set_open_capped(src, src_max_header, &s, err)) != 0)
        return rc;
    if ((o = data_order(s, &specs, err)) == NULL) {
        rc = -DL_E_NO_MEMORY;
        goto out;
    }
    if (meta == NULL) {
        uint32_t *plan = malloc((s->ntensors ? s->ntensors : 1) * sizeof(*plan)), n = 1;
        if (plan == NULL) {
            rc = dl_fail(err, DL_E_NO_MEMORY, NULL, 0, "out of memory");
            goto out;
        }
        rc = st_index_plan(specs, s->ntensors, max_shard_size, plan, &n, err);
        free(plan);
        if (rc != 0 || (own_meta = carried_meta(s, n <= 1, &nmeta, err)) == NULL) {
            rc = rc ? rc : -DL_E_NO_MEMORY;
            goto out;
        }
        meta = own_meta;
    }
    if ((rc = st_set_writer_open(dst, specs, s->ntensors, meta, nmeta, max_shard_size, &w, err)) != 0)
        goto out;
    if (nshards != NULL)
        *nshards = st_set_writer_nshards(w);
    if ((rc = copy_tensors(s, o, w, err)) != 0) {
        st_set_writer_abort(w);
        goto out;
    }
    rc = st_set_writer_commit(w, err);
out:
    free(own_meta);
    free(o);
    free(specs);
    st_set_close(s);
    return rc;
}
