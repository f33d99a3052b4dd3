/* st_set: one file or a whole set (an index and its shards) opened as one logical safetensors (st_index.h),
 * the shards' headers within one budget. */
#include "st_index.h"
#include "st_index_internal.h"
#include "fsutil.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* ---- the set view ---------------------------------------------------------------------------- */

typedef struct name_ref {
    const st_tensor *t;
    uint32_t file;
} name_ref;

static int ref_cmp(const void *a, const void *b)
{
    const name_ref *x = a, *y = b;
    return bytes_cmp(x->t->name, x->t->name_len, y->t->name, y->t->name_len);
}

void st_set_close(st_set *s)
{
    if (s == NULL)
        return;
    for (size_t i = 0; i < s->nfiles; i++)
        st_close(s->files[i]);
    free(s->files);
    st_index_free(s->index);
    free(s->by_name);
    free(s->by_name_file);
    free(s->order);
    free(s->order_file);
    free(s->path);
    free(s);
}

/* Fills by_name from every file, and order from the index (or name order). */
static int set_tables(st_set *s, dl_error *err)
{
    name_ref *refs;
    size_t n = 0, k = 0;

    for (size_t f = 0; f < s->nfiles; f++)
        n += s->files[f]->h->ntensors;
    s->ntensors = n;
    refs = malloc((n ? n : 1) * sizeof(*refs));
    s->by_name = malloc((n ? n : 1) * sizeof(*s->by_name));
    s->by_name_file = malloc((n ? n : 1) * sizeof(*s->by_name_file));
    s->order = malloc((n ? n : 1) * sizeof(*s->order));
    s->order_file = malloc((n ? n : 1) * sizeof(*s->order_file));
    if (refs == NULL || s->by_name == NULL || s->by_name_file == NULL || s->order == NULL || s->order_file == NULL) {
        free(refs);
        return dl_fail(err, DL_E_NO_MEMORY, NULL, 0, "out of memory");
    }
    for (size_t f = 0; f < s->nfiles; f++) {
        const st_header *h = s->files[f]->h;
        for (size_t i = 0; i < h->ntensors; i++) {
            refs[k++] = (name_ref){&h->tensors[i], (uint32_t)f};
            s->data_bytes += st_tensor_bytes(&h->tensors[i]);  /* bounded by the files' sizes */
        }
    }
    qsort(refs, n, sizeof(*refs), ref_cmp);
    for (size_t i = 0; i < n; i++) {
        s->by_name[i] = refs[i].t;
        s->by_name_file[i] = refs[i].file;
    }
    free(refs);
    if (s->index == NULL) {
        memcpy(s->order, s->by_name, n * sizeof(*s->order));
        memcpy(s->order_file, s->by_name_file, n * sizeof(*s->order_file));
        return 0;
    }
    /* the index was checked against the shards: every entry names exactly one tensor */
    for (size_t i = 0; i < s->index->nentries; i++) {
        const st_index_entry *e = &s->index->entries[i];
        s->order[i] = st_header_find(s->files[e->shard]->h, e->name, e->name_len);
        s->order_file[i] = e->shard;
    }
    return 0;
}

int st_set_assemble(const char *path, st_index *ix, st_file **files, st_set **out, dl_error *err)
{
    const st_header **headers = NULL;
    st_set *s = calloc(1, sizeof(*s));
    int rc;

    *out = NULL;
    if (s == NULL) {
        for (uint32_t i = 0; i < ix->nshards; i++)
            st_close(files[i]);
        free(files);
        st_index_free(ix);
        return dl_fail(err, DL_E_NO_MEMORY, NULL, 0, "out of memory");
    }
    s->index = ix;
    s->files = files;
    s->nfiles = ix->nshards;
    if ((s->path = strdup(path)) == NULL ||
        (headers = malloc(s->nfiles * sizeof(*headers))) == NULL) {
        rc = dl_fail(err, DL_E_NO_MEMORY, NULL, 0, "out of memory");
        goto fail;
    }
    for (size_t i = 0; i < s->nfiles; i++)
        headers[i] = files[i]->h;
    if ((rc = st_index_check_set(ix, headers, err)) != 0 || (rc = set_tables(s, err)) != 0)
        goto fail;
    free(headers);
    *out = s;
    return 0;
fail:
    free(headers);
    st_set_close(s);
    return rc;
}

int st_set_wrap(st_file *f, st_set **out, dl_error *err)
{
    st_set *s = calloc(1, sizeof(*s));
    int rc;

    *out = NULL;
    if (s == NULL || (s->files = malloc(sizeof(*s->files))) == NULL) {
        free(s);
        st_close(f);
        return dl_fail(err, DL_E_NO_MEMORY, NULL, 0, "out of memory");
    }
    s->files[0] = f;
    s->nfiles = 1;
    if ((s->path = strdup(f->path)) == NULL) {
        st_set_close(s);
        return dl_fail(err, DL_E_NO_MEMORY, NULL, 0, "out of memory");
    }
    if ((rc = set_tables(s, err)) != 0) {
        st_set_close(s);
        return rc;
    }
    *out = s;
    return 0;
}

/* What the headers of a set may cost together (st_set_open_capped): a shard's header is read only
 * once its 8-byte prefix fits what the shards before it left of the cap. */
typedef struct header_budget {
    uint64_t cap;           /* 0: no cap of ours (each file the format's own) */
    uint64_t left;
} header_budget;

/* An index names each tensor once, the shards' headers each with its dtype, shape and offsets: per
 * tensor, at most 6 index bytes per name byte (json.dump's \u00XX) and st_index_cap_for's 244 of
 * punctuation and shard name, against at least 1 header byte per name byte and 49 for
 * "":{"dtype":"U8","shape":[],"data_offsets":[0,0]}.  So the index of a set whose headers fit
 * max_header is at most 6 x max_header, plus 64 KiB for its metadata; at most ST_INDEX_MAX_BYTES. */
static size_t index_cap_for_headers(uint64_t max_header)
{
    uint64_t cap;

    if (max_header > ST_INDEX_MAX_BYTES)        /* past the cap either way; 6 x it could overflow */
        return ST_INDEX_MAX_BYTES;
    cap = 6 * max_header + 64u * 1024u;
    return cap < ST_INDEX_MAX_BYTES ? (size_t)cap : ST_INDEX_MAX_BYTES;
}

/* The header length an 8-byte prefix gives, for a refusal's message (0 when it cannot be read). */
static uint64_t prefix_header_len(const char *path)
{
    unsigned char b[8];
    uint64_t n = 0;
    int fd = open(path, O_RDONLY | O_NONBLOCK | O_CLOEXEC);

    if (fd < 0)
        return 0;
    if (fsu_pread_all(fd, b, 8, 0) == 0) {
        for (int i = 7; i >= 0; i--)
            n = (n << 8) | b[i];
    }
    close(fd);
    return n;
}

/* Shard i of ix, next to the index at path, its header within the budget; the budget is then what
 * is left after it. */
static int open_shard(const char *path, const st_index *ix, uint32_t i, header_budget *b, st_file **out,
                      dl_error *err)
{
    size_t dir_len = (size_t)(file_name_of(path) - path);
    char name[ST_INDEX_BASE_MAX + 40], *p = NULL;
    int rc;

    *out = NULL;
    st_index_shard_name(ix->base, i, ix->nshards, name, sizeof(name));
    /* a valid header is never empty: nothing left means this shard cannot fit (and a cap of 0 would
     * mean none to st_open_capped) */
    if (b->cap != 0 && b->left == 0)
        return dl_fail(err, DL_E_HEADER_TOO_LARGE, NULL, 0,
                       "%s: the %u shards before %s hold the whole %" PRIu64 "-byte cap on a set's headers together "
                       "(max_delta_header_mib)", path, i, name, b->cap);
    if (asprintf(&p, "%.*s%s", (int)dir_len, path, name) < 0)
        return dl_fail(err, DL_E_NO_MEMORY, NULL, 0, "out of memory");
    rc = st_open_capped(p, b->left, out, err);
    if (rc != 0 && err != NULL && err->code == DL_E_IO && err->sys_errno == ENOENT) {
        rc = dl_fail(err, DL_E_KEY_MISMATCH, NULL, 0, "shard %s of the set is missing (the index lists %u shards)",
                     name, ix->nshards);
    } else if (rc != 0 && err != NULL && err->code == DL_E_HEADER_TOO_LARGE && b->left < b->cap) {
        /* refused against what the shards before it left: say which cap it is over */
        uint64_t n = prefix_header_len(p);
        if (n > b->cap)
            rc = dl_fail(err, DL_E_HEADER_TOO_LARGE, NULL, 0, "%s: a header of %" PRIu64 " bytes, the cap is %" PRIu64
                         " (max_delta_header_mib)", p, n, b->cap);
        else
            rc = dl_fail(err, DL_E_HEADER_TOO_LARGE, NULL, 0,
                         "%s: the header of %s (%" PRIu64 " bytes) is over the %" PRIu64 " bytes the %u shards before "
                         "it left of the %" PRIu64 "-byte cap on a set's headers together (max_delta_header_mib)",
                         path, name, n, b->left, i, b->cap);
    }
    free(p);
    if (rc != 0)
        return rc;
    if (b->cap != 0)
        b->left -= (*out)->data_start - 8;
    /* a shard's descriptor is opened as its tensors are read: sets of many shards from many nodes
     * would otherwise hold nodes x shards descriptors at once */
    if ((rc = st_file_lazy(*out, err)) != 0) {
        st_close(*out);
        *out = NULL;
    }
    return rc;
}

int st_set_open(const char *path, st_set **out, dl_error *err)
{
    return st_set_open_capped(path, 0, out, err);
}

int st_set_open_capped(const char *path, uint64_t max_header, st_set **out, dl_error *err)
{
    size_t plen = strlen(path), stem;
    header_budget budget = {max_header, max_header};
    st_index *ix = NULL;
    st_file **files, *f;
    int rc;

    *out = NULL;
    if (!ends_with(path, plen, ST_INDEX_SUFFIX, &stem)) {
        if ((rc = st_open_capped(path, max_header, &f, err)) != 0)
            return rc;
        return st_set_wrap(f, out, err);
    }
    rc = max_header != 0 ? st_index_load_capped(path, index_cap_for_headers(max_header), &ix, err)
                         : st_index_load(path, &ix, err);
    if (rc != 0)
        return rc;
    if ((files = calloc(ix->nshards, sizeof(*files))) == NULL) {
        st_index_free(ix);
        return dl_fail(err, DL_E_NO_MEMORY, NULL, 0, "out of memory");
    }
    for (uint32_t i = 0; i < ix->nshards; i++) {
        if ((rc = open_shard(path, ix, i, &budget, &files[i], err)) != 0)
            goto fail;
    }
    return st_set_assemble(path, ix, files, out, err);
fail:
    for (uint32_t i = 0; i < ix->nshards; i++)
        st_close(files[i]);
    free(files);
    st_index_free(ix);
    return rc;
}

const st_tensor *st_set_find(const st_set *s, const char *name, size_t name_len, uint32_t *file)
{
    size_t lo = 0, hi = s->ntensors;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        const st_tensor *t = s->by_name[mid];
        int c = bytes_cmp(t->name, t->name_len, name, name_len);
        if (c == 0) {
            if (file != NULL)
                *file = s->by_name_file[mid];
            return t;
        }
        if (c < 0)
            lo = mid + 1;
        else
            hi = mid;
    }
    return NULL;
}

int st_set_read(const st_set *s, uint32_t file, const st_tensor *t, uint64_t off, void *buf, size_t len,
                dl_error *err)
{
    if (file >= s->nfiles)
        return dl_fail(err, DL_E_INVALID_ARGUMENT, t->name, t->name_len, "no file %u in the set", file);
    return st_read(s->files[file], t, off, buf, len, err);
}

void st_set_metadata(const st_set *s, const st_meta **meta, size_t *n)
{
    if (s->index != NULL) {
        *meta = s->index->meta;
        *n = s->index->nmeta;
    } else {
        *meta = s->files[0]->h->meta;
        *n = s->files[0]->h->nmeta;
    }
}
