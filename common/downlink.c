/* downlink: the view and the update of a step (downlink.h).  One thread, chunk by chunk in the view's
 * data order, so the view's file is written front to back and its block hash computed as it goes. */
#include "downlink.h"

#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "blockhash.h"
#include "convert.h"
#include "fsutil.h"
#include "safetensors.h"

#define HASH_PLACEHOLDER "0000000000000000000000000000000000000000000000000000000000000000"

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

typedef struct dl_work {
    const downlink_args *a;
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
    uint64_t voff;              /* where the view's next byte goes */
    uint64_t hash_at;           /* the update's file offset of its view_hash value */
    blockhash_ctx hash;
    int hashing;
    /* chunk buffers */
    unsigned char *raw_v, *raw_g, *codes, *scales;
    float *v, *g, *d, *x;
    double max_gap;
} dl_work;

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
                           "(the model's structure changed: the view starts again from the global)", w->a->step);
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

/* Opens the update's writer with a placeholder hash of the same length as the real one: the view is
 * hashed only once it is written, and the update's codes are written meanwhile, so the hash is put in
 * its place in the header at the end (patch_hash).  The header is built once more here, as the writer
 * builds it (the reference's bytes: one function makes both), to find where the placeholder lies. */
static int open_update(dl_work *w, dl_error *err)
{
    static const char key[] = "\"view_hash\":\"" HASH_PLACEHOLDER "\"";
    char step[24], base[24], block[16], *json = NULL;
    size_t json_len;
    uint64_t data_len, *offsets = malloc(2 * (w->nspecs + 1) * sizeof(uint64_t));
    int rc;

    snprintf(step, sizeof(step), "%" PRIu64, w->a->step);
    snprintf(base, sizeof(base), "%" PRIu64, w->a->base_step);
    snprintf(block, sizeof(block), "%u", w->cz.block);
    st_kv meta[] = {{"base_step", base}, {"block", block}, {"encoding", cz_encoding_name(w->cz.enc)},
                    {"step", step}, {"view_hash", HASH_PLACEHOLDER}};
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
        return dl_fail(err, DL_E_INTERNAL, NULL, 0, "the update's header lacks its view_hash placeholder");
    return st_writer_open(w->a->out_update_path, w->specs, w->nspecs, meta, nmeta, &w->w, err);
}

static int patch_hash(dl_work *w, const char hex[65], dl_error *err)
{
    int rc = fsu_pwrite_all(st_writer_fd(w->w), hex, 64, w->hash_at);
    return rc != 0 ? dl_fail_errno(err, -rc, "cannot write the update's view_hash") : 0;
}

/* Appends len bytes to the view's file and its hash. */
static int view_append(dl_work *w, const void *p, size_t len, dl_error *err)
{
    int rc = fsu_pwrite_all(w->vfd, p, len, w->voff);
    if (rc != 0)
        return dl_fail_errno(err, -rc, "cannot write %s", w->vtmp);
    w->voff += len;
    return blockhash_update(&w->hash, p, len, err);
}

/* The view's header, copied byte for byte from the previous view. */
static int copy_header(dl_work *w, dl_error *err)
{
    uint64_t n = w->view->data_start;
    unsigned char *buf = malloc(n);
    int rc;

    if (buf == NULL)
        return dl_fail(err, DL_E_NO_MEMORY, NULL, 0, "out of memory copying the view's header");
    if ((rc = fsu_pread_all(w->view->fd, buf, n, 0)) != 0)
        rc = dl_fail_errno(err, -rc, "cannot read %s", w->a->view_path);
    else
        rc = view_append(w, buf, n, err);
    free(buf);
    return rc;
}

/* A non-floating key: its bytes, as they are. */
static int copy_tensor(dl_work *w, const st_tensor *t, dl_error *err)
{
    uint64_t size = st_tensor_bytes(t), cap = DOWNLINK_CHUNK * 8;
    int rc = 0;

    for (uint64_t off = 0; rc == 0 && off < size; off += cap) {
        size_t len = (size_t)(size - off < cap ? size - off : cap);
        if ((rc = st_read(w->view, t, off, w->raw_v, len, err)) == 0)
            rc = view_append(w, w->raw_v, len, err);
    }
    return rc;
}

/* One chunk of a floating key: values [first, first + n). */
static int key_chunk(dl_work *w, const dl_key *k, uint64_t first, size_t n, dl_error *err)
{
    const st_tensor *t = k->vt;
    const size_t lanes = cv_lanes(t->dtype), esize = st_dtype_bits(t->dtype) / 8, nl = n * lanes;
    const uint64_t boff = first * esize;
    int rc;

    if ((rc = st_read(w->view, t, boff, w->raw_v, n * esize, err)) != 0 ||
        (rc = st_read(w->global, k->gt, boff, w->raw_g, n * esize, err)) != 0)
        return rc;
    cv_decode(t->dtype, w->raw_v, w->v, n);
    cv_decode(t->dtype, w->raw_g, w->g, n);
    for (size_t i = 0; i < nl; i++)
        w->d[i] = w->g[i] - w->v[i];
    if (k->plain) {
        if ((rc = st_writer_write(w->w, k->code_spec, first * lanes * 4, w->d, nl * 4, err)) != 0)
            return rc;
        memcpy(w->x, w->d, nl * sizeof(float));
    } else {
        const uint64_t nsc = cz_nscales(n, w->cz.block);
        cz_encode(&w->cz, w->d, n, w->codes, w->scales);
        if ((rc = st_writer_write(w->w, k->code_spec, cz_code_bytes(w->cz.enc, first), w->codes,
                                  cz_code_bytes(w->cz.enc, n), err)) != 0 ||
            (rc = st_writer_write(w->w, k->scale_spec, first / w->cz.block, w->scales, nsc, err)) != 0)
            return rc;
        if (cz_decode(&w->cz, w->codes, w->scales, first, w->x, n) >= 0)
            return dl_fail(err, DL_E_NON_FINITE, t->name, t->name_len,
                           "the update of step %" PRIu64 " decodes to a value that is not finite", w->a->step);
    }
    for (size_t i = 0; i < nl; i++)
        w->v[i] += w->x[i];
    cv_encode(t->dtype, w->v, w->raw_v, n);
    /* the value the view holds, as its dtype rounded it: finite, and how far from the global */
    cv_decode(t->dtype, w->raw_v, w->v, n);
    for (size_t i = 0; i < nl; i++) {
        float gap = fabsf(w->g[i] - w->v[i]);
        if (!isfinite(w->v[i]))
            return dl_fail(err, DL_E_NON_FINITE, t->name, t->name_len,
                           "the view of step %" PRIu64 " overflows its dtype %s", w->a->step, st_dtype_name(t->dtype));
        if (gap > w->max_gap)
            w->max_gap = gap;
    }
    return view_append(w, w->raw_v, n * esize, err);
}

static int make_key(dl_work *w, const dl_key *k, dl_error *err)
{
    int rc = 0;
    for (uint64_t first = 0; rc == 0 && first < k->vt->nelem; first += DOWNLINK_CHUNK) {
        uint64_t left = k->vt->nelem - first;
        rc = key_chunk(w, k, first, (size_t)(left < DOWNLINK_CHUNK ? left : DOWNLINK_CHUNK), err);
    }
    return rc;
}

static int alloc_buffers(dl_work *w, dl_error *err)
{
    const size_t c = (size_t)DOWNLINK_CHUNK;
    w->raw_v = malloc(c * 8);
    w->raw_g = malloc(c * 8);
    w->codes = malloc(c);
    w->scales = malloc(c / CZ_MX_BLOCK + 1);
    w->v = malloc(2 * c * sizeof(float));
    w->g = malloc(2 * c * sizeof(float));
    w->d = malloc(2 * c * sizeof(float));
    w->x = malloc(2 * c * sizeof(float));
    if (!w->raw_v || !w->raw_g || !w->codes || !w->scales || !w->v || !w->g || !w->d || !w->x)
        return dl_fail(err, DL_E_NO_MEMORY, NULL, 0, "out of memory for the downlink's buffers");
    return 0;
}

/* Every tensor of the view in its data order: floating keys made anew, the others copied. */
static int write_view(dl_work *w, dl_error *err)
{
    const st_header *vh = w->view->h;
    size_t ki = 0;
    int rc = copy_header(w, err);

    for (size_t i = 0; rc == 0 && i < vh->ntensors; i++) {
        const st_tensor *t = &vh->tensors[i];
        if (ki < w->nkeys && w->keys[ki].vt == t)
            rc = make_key(w, &w->keys[ki++], err);
        else
            rc = copy_tensor(w, t, err);
    }
    return rc;
}

static void work_free(dl_work *w)
{
    if (w->w != NULL)
        st_writer_abort(w->w);
    if (w->vtmp != NULL) {
        close(w->vfd);
        unlink(w->vtmp);
        free(w->vtmp);
    }
    if (w->hashing)
        blockhash_free(&w->hash);
    for (size_t i = 0; w->keys != NULL && i < w->nkeys; i++) {
        free(w->names[i]);
        if (!w->keys[i].plain)
            free((void *)w->specs[w->keys[i].scale_spec].shape);
    }
    free(w->keys);
    free(w->names);
    free(w->specs);
    st_close(w->view);
    st_close(w->global);
    free(w->raw_v);
    free(w->raw_g);
    free(w->codes);
    free(w->scales);
    free(w->v);
    free(w->g);
    free(w->d);
    free(w->x);
}

static int commit_outputs(dl_work *w, downlink_out *out, dl_error *err)
{
    char hex[65];
    int rc;

    if ((rc = blockhash_final(&w->hash, out->view_hash, err)) != 0)
        return rc;
    blockhash_hex(out->view_hash, hex);
    if ((rc = patch_hash(w, hex, err)) != 0)
        return rc;
    out->view_bytes = w->voff;
    st_writer_set_durable(w->w, w->a->durable);
    rc = st_writer_commit(w->w, err);
    w->w = NULL;
    if (rc != 0)
        return rc;
    int fd = w->vfd;
    char *tmp = w->vtmp;
    w->vtmp = NULL;
    rc = w->a->durable ? fsu_commit_tmp(fd, tmp, w->a->out_view_path, err)
                       : fsu_rename_tmp(fd, tmp, w->a->out_view_path, err);
    free(tmp);
    if (rc != 0)
        unlink(w->a->out_update_path);
    return rc;
}

int downlink_make(const downlink_args *a, downlink_out *out, dl_error *err)
{
    dl_work w = {.a = a, .cz = {a->enc, CZ_MX_BLOCK}, .vfd = -1};
    int rc;
    struct stat sb;

    memset(out, 0, sizeof(*out));
    if (!downlink_encoding_ok(a->enc))
        return dl_fail(err, DL_E_INVALID_ARGUMENT, NULL, 0, "the downlink takes mxfp8 or mxfp4, not %s",
                       cz_encoding_name(a->enc));
    if ((rc = st_open(a->view_path, &w.view, err)) != 0 || (rc = st_open(a->global_path, &w.global, err)) != 0 ||
        (rc = plan_keys(&w, err)) != 0 || (rc = alloc_buffers(&w, err)) != 0 ||
        (rc = blockhash_init(&w.hash, err)) != 0)
        goto out;
    w.hashing = 1;
    if ((rc = open_update(&w, err)) != 0 || (rc = fsu_tmp_create(a->out_view_path, &w.vtmp, &w.vfd, err)) != 0)
        goto out;
    if ((rc = write_view(&w, err)) != 0 || (rc = commit_outputs(&w, out, err)) != 0)
        goto out;
    w.hashing = 0;
    out->max_gap = w.max_gap;
    if (stat(a->out_update_path, &sb) == 0)
        out->update_bytes = (uint64_t)sb.st_size;
out:
    work_free(&w);
    return rc;
}
