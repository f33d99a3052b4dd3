/* downlink: the view and the update of a step (downlink.h).  The work is cut into units (a chunk of a
 * floating key, or of a non-floating key's bytes) that any number of threads take in turn, each writing
 * its part of both files at its offsets; the view is block-hashed once whole, then the hash goes into
 * the update's header. */
#include "downlink.h"

#include <errno.h>
#include <inttypes.h>
#include <fcntl.h>
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "blockhash.h"
#include "convert.h"
#include "fsutil.h"
#include "safetensors.h"

#define HASH_RESERVED "0000000000000000000000000000000000000000000000000000000000000000"

int downlink_encoding_ok(cz_encoding enc)
{
    return enc == CZ_MXFP8 || enc == CZ_MXFP4;
}

/* How a floating key goes into the update: compressed (codes and scales), or plain. */
typedef struct dl_key {
    const st_tensor *vt;        /* the view's tensor */
    const st_tensor *gt;        /* the global's */
    int plain;
    size_t code_spec, scale_spec;       /* the update's specs (plain: code_spec only) */
} dl_key;

/* A unit of work: values [first, first + n) of key (a floating key's index in keys), or, key SIZE_MAX,
 * bytes [first, first + n) of the non-floating tensor t, copied. */
typedef struct dl_unit {
    const st_tensor *t;
    size_t key;
    uint64_t first, n;
} dl_unit;

struct downlink_pass {
    downlink_args a;
    cz_spec cz;
    st_file *view, *global;
    dl_key *keys;
    size_t nkeys;
    st_spec *specs;
    char **names;               /* the scales' names, owned */
    size_t nspecs;
    st_writer *w;
    char *vtmp;                 /* the view's temporary file */
    int vfd;
    uint64_t hash_at;           /* the update's file offset of its view_hash value */
    dl_unit *units;
    size_t nunits;
    atomic_size_t next;
    atomic_int abort;
    pthread_mutex_t lock;       /* guards rc, err and max_gap */
    int rc;
    dl_error err;
    double max_gap;
};
typedef struct downlink_pass dl_work;

/* One thread's buffers. */
typedef struct dl_bufs {
    unsigned char *raw_v, *raw_g, *codes, *scales;
    float *v, *g, *d, *x;
    double max_gap;
} dl_bufs;

/* Whether the update holds the key compressed: its dtype has F32 lanes of one value each, and mxfp4's
 * nibbles fill whole bytes. */
static int key_compressible(const dl_work *w, const st_tensor *t)
{
    if (t->dtype == ST_C64)
        return 0;
    return w->cz.enc != CZ_MXFP4 || t->nelem % 2 == 0;
}

static int plan_keys(dl_work *w, dl_error *err)
{
    const st_header *vh = w->view->h;
    size_t nfloat = 0;

    for (size_t i = 0; i < vh->ntensors; i++)
        nfloat += st_dtype_is_floating(vh->tensors[i].dtype) != 0;
    w->keys = calloc(nfloat ? nfloat : 1, sizeof(*w->keys));
    w->specs = calloc(2 * nfloat + 1, sizeof(*w->specs));
    w->names = calloc(nfloat ? nfloat : 1, sizeof(char *));
    if (w->keys == NULL || w->specs == NULL || w->names == NULL)
        return dl_fail(err, DL_E_NO_MEMORY, NULL, 0, "out of memory planning the update");
    for (size_t i = 0; i < vh->ntensors; i++) {
        const st_tensor *t = &vh->tensors[i];
        if (!st_dtype_is_floating(t->dtype))
            continue;
        const st_tensor *gt = st_header_find(w->global->h, t->name, t->name_len);
        if (gt == NULL || gt->dtype != t->dtype || gt->nelem != t->nelem || gt->ndim != t->ndim ||
            (t->ndim > 0 && memcmp(gt->shape, t->shape, t->ndim * sizeof(uint64_t)) != 0))
            return dl_fail(err, DL_E_KEY_MISMATCH, t->name, t->name_len,
                           "the global of step %" PRIu64 " does not hold the view's key with its dtype and shape "
                           "(the model's structure changed: the view starts again from the global)", w->a.step);
        if (!cv_can_decode(t->dtype) || !cv_can_encode(t->dtype))
            return dl_fail(err, DL_E_UNSUPPORTED_DTYPE, t->name, t->name_len,
                           "the downlink cannot round to %s (F32, BF16, F16, F64 and C64 keys only)",
                           st_dtype_name(t->dtype));
        dl_key *k = &w->keys[w->nkeys++];
        k->vt = t;
        k->gt = gt;
        k->plain = !key_compressible(w, t);
        k->code_spec = w->nspecs;
        w->specs[w->nspecs++] = (st_spec){t->name, t->name_len,
                                          k->plain ? (t->dtype == ST_C64 ? ST_C64 : ST_F32) : cz_code_dtype(w->cz.enc),
                                          t->ndim, t->shape};
        if (k->plain)
            continue;
        char *sn = cz_scales_name(t->name, t->name_len);
        if (sn == NULL)
            return dl_fail(err, DL_E_NO_MEMORY, NULL, 0, "out of memory planning the update");
        w->names[w->nkeys - 1] = sn;
        k->scale_spec = w->nspecs;
        /* the shape lives in the key: one dimension, the scales' count, kept beside the name */
        uint64_t *shape = malloc(sizeof(uint64_t));
        if (shape == NULL)
            return dl_fail(err, DL_E_NO_MEMORY, NULL, 0, "out of memory planning the update");
        *shape = cz_nscales(t->nelem, w->cz.block);
        w->specs[w->nspecs++] = (st_spec){sn, t->name_len + CZ_SCALES_SUFFIX_LEN, cz_scale_dtype(w->cz.enc), 1, shape};
    }
    return 0;
}

/* Opens the update's writer with a reserved hash field of the same length as the real one: the view is
 * hashed only once it is written, and the update's codes are written meanwhile, so the hash is put in
 * its place in the header at the end (patch_hash).  The header is built once more here, as the writer
 * builds it (the reference's bytes: one function makes both), to find where the reserved field lies. */
static int open_update(dl_work *w, dl_error *err)
{
    static const char key[] = "\"view_hash\":\"" HASH_RESERVED "\"";
    char step[24], base[24], block[16], *json = NULL;
    size_t json_len;
    uint64_t data_len, *offsets = malloc(2 * (w->nspecs + 1) * sizeof(uint64_t));
    int rc;

    snprintf(step, sizeof(step), "%" PRIu64, w->a.step);
    snprintf(base, sizeof(base), "%" PRIu64, w->a.base_step);
    snprintf(block, sizeof(block), "%u", w->cz.block);
    st_kv meta[] = {{"base_step", base}, {"block", block}, {"encoding", cz_encoding_name(w->cz.enc)},
                    {"step", step}, {"view_hash", HASH_RESERVED}};
    const size_t nmeta = sizeof(meta) / sizeof(meta[0]);
    if (offsets == NULL)
        return dl_fail(err, DL_E_NO_MEMORY, NULL, 0, "out of memory planning the update");
    rc = st_header_build(w->specs, w->nspecs, meta, nmeta, &json, &json_len, offsets, &data_len, err);
    free(offsets);
    if (rc != 0)
        return rc;
    /* the writer escapes no byte of this ASCII key and value, and a tensor name's quotes are escaped:
     * the match is the metadata's own */
    char *at = memmem(json, json_len, key, sizeof(key) - 1);
    w->hash_at = at != NULL ? 8 + (uint64_t)(at - json) + strlen("\"view_hash\":\"") : 0;
    free(json);
    if (at == NULL)
        return dl_fail(err, DL_E_INTERNAL, NULL, 0, "the update's header lacks its reserved view_hash field");
    return st_writer_open(w->a.out_update_path, w->specs, w->nspecs, meta, nmeta, &w->w, err);
}

static int patch_hash(dl_work *w, const char hex[65], dl_error *err)
{
    int rc = fsu_pwrite_all(st_writer_fd(w->w), hex, 64, w->hash_at);
    return rc != 0 ? dl_fail_errno(err, -rc, "cannot write the update's view_hash") : 0;
}

/* The view's header, copied byte for byte from the previous view: the view keeps its layout. */
static int copy_header(dl_work *w, dl_error *err)
{
    uint64_t n = w->view->data_start;
    unsigned char *buf = malloc(n);
    int rc;

    if (buf == NULL)
        return dl_fail(err, DL_E_NO_MEMORY, NULL, 0, "out of memory copying the view's header");
    if ((rc = fsu_pread_all(w->view->fd, buf, n, 0)) != 0)
        rc = dl_fail_errno(err, -rc, "cannot read %s", w->a.view_path);
    else if ((rc = fsu_pwrite_all(w->vfd, buf, n, 0)) != 0)
        rc = dl_fail_errno(err, -rc, "cannot write %s", w->vtmp);
    free(buf);
    return rc;
}

static int view_write(dl_work *w, const st_tensor *t, uint64_t off, const void *p, size_t len, dl_error *err)
{
    int rc = fsu_pwrite_all(w->vfd, p, len, w->view->data_start + t->begin + off);
    return rc != 0 ? dl_fail_errno(err, -rc, "cannot write %s", w->vtmp) : 0;
}

/* A unit of a non-floating key: its bytes, as they are. */
static int copy_unit(dl_work *w, dl_bufs *b, const dl_unit *u, dl_error *err)
{
    int rc = st_read(w->view, u->t, u->first, b->raw_v, (size_t)u->n, err);
    return rc != 0 ? rc : view_write(w, u->t, u->first, b->raw_v, (size_t)u->n, err);
}

/* A unit of a floating key: values [first, first + n). */
static int key_unit(dl_work *w, dl_bufs *b, const dl_unit *u, dl_error *err)
{
    const dl_key *k = &w->keys[u->key];
    const st_tensor *t = k->vt;
    const uint64_t first = u->first;
    const size_t n = (size_t)u->n, lanes = cv_lanes(t->dtype), esize = st_dtype_bits(t->dtype) / 8, nl = n * lanes;
    const uint64_t boff = first * esize;
    int rc;

    if ((rc = st_read(w->view, t, boff, b->raw_v, n * esize, err)) != 0 ||
        (rc = st_read(w->global, k->gt, boff, b->raw_g, n * esize, err)) != 0)
        return rc;
    cv_decode(t->dtype, b->raw_v, b->v, n);
    cv_decode(t->dtype, b->raw_g, b->g, n);
    for (size_t i = 0; i < nl; i++)
        b->d[i] = b->g[i] - b->v[i];
    if (k->plain) {
        if ((rc = st_writer_write(w->w, k->code_spec, first * lanes * 4, b->d, nl * 4, err)) != 0)
            return rc;
        memcpy(b->x, b->d, nl * sizeof(float));
    } else {
        const uint64_t nsc = cz_nscales(n, w->cz.block);
        cz_encode(&w->cz, b->d, n, b->codes, b->scales);
        if ((rc = st_writer_write(w->w, k->code_spec, cz_code_bytes(w->cz.enc, first), b->codes,
                                  cz_code_bytes(w->cz.enc, n), err)) != 0 ||
            (rc = st_writer_write(w->w, k->scale_spec, first / w->cz.block, b->scales, nsc, err)) != 0)
            return rc;
        if (cz_decode(&w->cz, b->codes, b->scales, first, b->x, n) >= 0)
            return dl_fail(err, DL_E_NON_FINITE, t->name, t->name_len,
                           "the update of step %" PRIu64 " decodes to a value that is not finite", w->a.step);
    }
    for (size_t i = 0; i < nl; i++)
        b->v[i] += b->x[i];
    cv_encode(t->dtype, b->v, b->raw_v, n);
    /* the value the view holds, as its dtype rounded it: finite, and how far from the global */
    cv_decode(t->dtype, b->raw_v, b->v, n);
    for (size_t i = 0; i < nl; i++) {
        float gap = fabsf(b->g[i] - b->v[i]);
        if (!isfinite(b->v[i]))
            return dl_fail(err, DL_E_NON_FINITE, t->name, t->name_len,
                           "the view of step %" PRIu64 " overflows its dtype %s", w->a.step, st_dtype_name(t->dtype));
        if (gap > b->max_gap)
            b->max_gap = gap;
    }
    return view_write(w, t, boff, b->raw_v, n * esize, err);
}

static void bufs_free(dl_bufs *b)
{
    free(b->raw_v);
    free(b->raw_g);
    free(b->codes);
    free(b->scales);
    free(b->v);
    free(b->g);
    free(b->d);
    free(b->x);
}

static int bufs_alloc(dl_bufs *b)
{
    const size_t c = (size_t)DOWNLINK_CHUNK;
    memset(b, 0, sizeof(*b));
    b->raw_v = malloc(c * 8);
    b->raw_g = malloc(c * 8);
    b->codes = malloc(c);
    b->scales = malloc(c / CZ_MX_BLOCK + 1);
    b->v = malloc(2 * c * sizeof(float));
    b->g = malloc(2 * c * sizeof(float));
    b->d = malloc(2 * c * sizeof(float));
    b->x = malloc(2 * c * sizeof(float));
    if (!b->raw_v || !b->raw_g || !b->codes || !b->scales || !b->v || !b->g || !b->d || !b->x) {
        bufs_free(b);
        return -1;
    }
    return 0;
}

/* The units of every tensor of the view, in its data order. */
static int plan_units(dl_work *w, dl_error *err)
{
    const st_header *vh = w->view->h;
    size_t n = 0, ki = 0;

    for (int pass = 0; pass < 2; pass++) {
        ki = 0;
        for (size_t i = 0; i < vh->ntensors; i++) {
            const st_tensor *t = &vh->tensors[i];
            int floating = ki < w->nkeys && w->keys[ki].vt == t;
            uint64_t total = floating ? t->nelem : st_tensor_bytes(t), step = floating ? DOWNLINK_CHUNK : DOWNLINK_CHUNK * 8;
            for (uint64_t first = 0; first < total; first += step) {
                if (pass == 1)
                    w->units[w->nunits++] = (dl_unit){t, floating ? ki : SIZE_MAX, first,
                                                      total - first < step ? total - first : step};
                else
                    n++;
            }
            ki += floating;
        }
        if (pass == 0 && (w->units = calloc(n ? n : 1, sizeof(*w->units))) == NULL)
            return dl_fail(err, DL_E_NO_MEMORY, NULL, 0, "out of memory planning the downlink");
    }
    return 0;
}

static void fail_pass(dl_work *w, int rc, const dl_error *e)
{
    pthread_mutex_lock(&w->lock);
    if (w->rc == 0) {
        w->rc = rc;
        w->err = *e;
    }
    pthread_mutex_unlock(&w->lock);
    atomic_store(&w->abort, 1);
}

int downlink_run(downlink_pass *w)
{
    dl_bufs b;
    dl_error e = {0};
    size_t i;

    if (bufs_alloc(&b) != 0) {
        dl_fail(&e, DL_E_NO_MEMORY, NULL, 0, "out of memory for the downlink's buffers");
        fail_pass(w, -DL_E_NO_MEMORY, &e);
        return -DL_E_NO_MEMORY;
    }
    while (!atomic_load(&w->abort) && (i = atomic_fetch_add(&w->next, 1)) < w->nunits) {
        const dl_unit *u = &w->units[i];
        int rc = u->key == SIZE_MAX ? copy_unit(w, &b, u, &e) : key_unit(w, &b, u, &e);
        if (rc != 0) {
            fail_pass(w, rc, &e);
            break;
        }
    }
    pthread_mutex_lock(&w->lock);
    if (b.max_gap > w->max_gap)
        w->max_gap = b.max_gap;
    int rc = w->rc;
    pthread_mutex_unlock(&w->lock);
    bufs_free(&b);
    return rc;
}

void downlink_abort(downlink_pass *w)
{
    atomic_store(&w->abort, 1);
}

static void pass_free(dl_work *w)
{
    if (w->w != NULL)
        st_writer_abort(w->w);
    if (w->vtmp != NULL) {
        close(w->vfd);
        unlink(w->vtmp);
        free(w->vtmp);
    }
    for (size_t i = 0; w->keys != NULL && i < w->nkeys; i++) {
        free(w->names[i]);
        if (!w->keys[i].plain)
            free((void *)w->specs[w->keys[i].scale_spec].shape);
    }
    free(w->keys);
    free(w->names);
    free(w->specs);
    free(w->units);
    st_close(w->view);
    st_close(w->global);
    pthread_mutex_destroy(&w->lock);
    free(w);
}

/* The view whole, block-hashed (its file read back: the page cache holds it), the hash put into the
 * update's header, then both renamed into place. */
static int commit_outputs(dl_work *w, downlink_out *out, dl_error *err)
{
    char hex[65];
    int rc, fd = open(w->vtmp, O_RDONLY | O_CLOEXEC);

    if (fd < 0)
        return dl_fail_errno(err, errno, "cannot read back %s", w->vtmp);
    rc = blockhash_fd(fd, out->view_hash, err);
    close(fd);
    if (rc != 0)
        return rc;
    blockhash_hex(out->view_hash, hex);
    if ((rc = patch_hash(w, hex, err)) != 0)
        return rc;
    out->view_bytes = w->view->file_size;
    st_writer_set_durable(w->w, w->a.durable);
    rc = st_writer_commit(w->w, err);
    w->w = NULL;
    if (rc != 0)
        return rc;
    int vfd = w->vfd;
    char *tmp = w->vtmp;
    w->vtmp = NULL;
    rc = w->a.durable ? fsu_commit_tmp(vfd, tmp, w->a.out_view_path, err)
                      : fsu_rename_tmp(vfd, tmp, w->a.out_view_path, err);
    free(tmp);
    if (rc != 0)
        unlink(w->a.out_update_path);
    return rc;
}

int downlink_prepare(const downlink_args *a, downlink_pass **out, dl_error *err)
{
    dl_work *w = calloc(1, sizeof(*w));
    int rc;

    *out = NULL;
    if (w == NULL)
        return dl_fail(err, DL_E_NO_MEMORY, NULL, 0, "out of memory");
    w->a = *a;
    w->cz = (cz_spec){a->enc, CZ_MX_BLOCK};
    w->vfd = -1;
    pthread_mutex_init(&w->lock, NULL);
    if (!downlink_encoding_ok(a->enc))
        rc = dl_fail(err, DL_E_INVALID_ARGUMENT, NULL, 0, "the downlink takes mxfp8 or mxfp4, not %s",
                     cz_encoding_name(a->enc));
    else if ((rc = st_open(a->view_path, &w->view, err)) == 0 && (rc = st_open(a->global_path, &w->global, err)) == 0 &&
             (rc = plan_keys(w, err)) == 0 && (rc = plan_units(w, err)) == 0 && (rc = open_update(w, err)) == 0 &&
             (rc = fsu_tmp_create(a->out_view_path, &w->vtmp, &w->vfd, err)) == 0)
        rc = copy_header(w, err);
    if (rc != 0) {
        pass_free(w);
        return rc;
    }
    *out = w;
    return 0;
}

int downlink_finish(downlink_pass *w, downlink_out *out, dl_error *err)
{
    int rc = w->rc;

    memset(out, 0, sizeof(*out));
    if (rc != 0 && err != NULL)
        *err = w->err;
    if (rc == 0 && atomic_load(&w->next) < w->nunits)
        rc = dl_fail(err, DL_E_INTERNAL, NULL, 0, "the downlink was abandoned before its end");
    if (rc == 0 && (rc = commit_outputs(w, out, err)) == 0) {
        out->max_gap = w->max_gap;
        struct stat sb;
        if (stat(w->a.out_update_path, &sb) == 0)
            out->update_bytes = (uint64_t)sb.st_size;
    }
    pass_free(w);
    return rc;
}

int downlink_make(const downlink_args *a, downlink_out *out, dl_error *err)
{
    downlink_pass *p;
    int rc = downlink_prepare(a, &p, err);

    if (rc != 0) {
        memset(out, 0, sizeof(*out));
        return rc;
    }
    downlink_run(p);
    return downlink_finish(p, out, err);
}
