/* delta_compute_encoded (delta.h): a worker's compressed delta with error feedback (README, "Compressed
 * deltas"), chunk by chunk: memory is a few chunks whatever the model's size. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "convert.h"
#include "delta.h"

#define ENC_CHUNK (256u * 1024u)        /* values: a multiple of CZ_BLOCK_MAX, even */

/* One floating key of the output: where its values go. */
typedef struct enc_key {
    const st_tensor *base;      /* the baseline's tensor */
    uint32_t base_file;
    int compressed;             /* codes (spec index `spec`) and scales (spec + 1), else plain F32/C64 */
    size_t spec, rspec;         /* its index among out's specs, and among the residual's */
    char *scales_name;
} enc_key;

typedef struct enc_state {
    const cz_spec *cz;
    st_set *fb, *fc;
    st_file *residual;          /* the last call's, or NULL */
    enc_key *keys;
    size_t nkeys;
    st_spec *specs, *rspecs;
    unsigned char *glue;        /* [spec]: a scales spec, glued to its codes' shard */
    size_t nspecs;
    uint64_t *scale_shape;      /* [nkeys]: the scales' shapes */
    unsigned char *raw, *codes, *scales;
    float *a, *b, *dec;
} enc_state;

static int encodable(const cz_spec *cz, const st_tensor *t)
{
    return t->dtype != ST_C64 && (cz->enc != CZ_MXFP4 || t->nelem % 2 == 0);
}

/* The previous residual: the model's floating keys, in F32 (C64 for C64), written by the same encoding. */
static int open_residual(enc_state *s, const char *path, dl_error *err)
{
    cz_spec was;
    int rc;

    if (path == NULL)
        return 0;
    /* the first call: R = 0; a residual that exists but cannot be read is an error, not a zero */
    if (access(path, F_OK) != 0 && errno == ENOENT)
        return 0;
    if ((rc = st_open(path, &s->residual, err)) != 0)
        return rc;
    if ((rc = cz_spec_from_meta(s->residual->h->meta, s->residual->h->nmeta, &was, err)) != 0)
        return rc;
    if (was.enc != s->cz->enc || was.block != s->cz->block)
        return dl_fail(err, DL_E_INVALID_ARGUMENT, NULL, 0,
                       "residual %s was left by --encode %s --block %u, not %s --block %u: remove it to start over",
                       path, cz_encoding_name(was.enc), was.block, cz_encoding_name(s->cz->enc), s->cz->block);
    for (size_t i = 0; i < s->nkeys; i++) {
        const st_tensor *t = s->keys[i].base;
        const st_tensor *r = st_header_find(s->residual->h, t->name, t->name_len);
        if (r == NULL || r->dtype != delta_dtype_for(t->dtype) || r->ndim != t->ndim ||
            (t->ndim > 0 && memcmp(r->shape, t->shape, t->ndim * sizeof(*t->shape)) != 0))
            return dl_fail(err, DL_E_KEY_MISMATCH, t->name, t->name_len, "residual %s does not match the model", path);
    }
    if (s->residual->h->ntensors != s->nkeys)
        return dl_fail(err, DL_E_KEY_MISMATCH, NULL, 0, "residual %s has %zu tensors, the model %zu floating ones", path,
                       s->residual->h->ntensors, s->nkeys);
    return 0;
}

/* The output's tensors, in the baseline's save order: each floating key's codes and scales, or the
 * key in plain F32; the residual's, one F32 (C64) tensor per floating key. */
static int plan(enc_state *s, dl_error *err)
{
    size_t n = s->fb->ntensors ? s->fb->ntensors : 1;

    s->keys = calloc(n, sizeof(*s->keys));
    s->specs = calloc(2 * n, sizeof(*s->specs));
    s->glue = calloc(2 * n, 1);
    s->rspecs = calloc(n, sizeof(*s->rspecs));
    s->scale_shape = calloc(n, sizeof(*s->scale_shape));
    if (s->keys == NULL || s->specs == NULL || s->glue == NULL || s->rspecs == NULL || s->scale_shape == NULL)
        return dl_fail(err, DL_E_NO_MEMORY, NULL, 0, "out of memory");
    for (size_t i = 0; i < s->fb->ntensors; i++) {
        const st_tensor *t = s->fb->order[i];
        if (cz_is_scales_name(t->name, t->name_len))
            return dl_fail(err, DL_E_KEY_MISMATCH, t->name, t->name_len,
                           "the model's key ends in %s, which compressed deltas reserve for scales", CZ_SCALES_SUFFIX);
        if (!st_dtype_is_floating(t->dtype))
            continue;
        enc_key *k = &s->keys[s->nkeys];
        k->base = t;
        k->base_file = s->fb->order_file[i];
        k->compressed = encodable(s->cz, t);
        k->spec = s->nspecs;
        k->rspec = s->nkeys;
        s->rspecs[s->nkeys] = (st_spec){t->name, t->name_len, delta_dtype_for(t->dtype), t->ndim, t->shape};
        if (!k->compressed) {
            s->specs[s->nspecs++] = (st_spec){t->name, t->name_len, delta_dtype_for(t->dtype), t->ndim, t->shape};
        } else {
            if ((k->scales_name = cz_scales_name(t->name, t->name_len)) == NULL)
                return dl_fail(err, DL_E_NO_MEMORY, NULL, 0, "out of memory");
            s->scale_shape[s->nkeys] = cz_nscales(t->nelem, s->cz->block);
            s->specs[s->nspecs++] = (st_spec){t->name, t->name_len, cz_code_dtype(s->cz->enc), t->ndim, t->shape};
            s->glue[s->nspecs] = 1;
            s->specs[s->nspecs++] = (st_spec){k->scales_name, t->name_len + CZ_SCALES_SUFFIX_LEN,
                                              cz_scale_dtype(s->cz->enc), 1, &s->scale_shape[s->nkeys]};
        }
        s->nkeys++;
    }
    return 0;
}

static int alloc_bufs(enc_state *s, dl_error *err)
{
    s->raw = malloc((size_t)ENC_CHUNK * 8);
    s->codes = malloc(ENC_CHUNK);
    s->scales = malloc(ENC_CHUNK / CZ_BLOCK_MIN * 4 + 4);
    s->a = malloc((size_t)ENC_CHUNK * 2 * sizeof(float));
    s->b = malloc((size_t)ENC_CHUNK * 2 * sizeof(float));
    s->dec = malloc((size_t)ENC_CHUNK * sizeof(float));
    if (!s->raw || !s->codes || !s->scales || !s->a || !s->b || !s->dec)
        return dl_fail(err, DL_E_NO_MEMORY, NULL, 0, "out of memory");
    return 0;
}

/* e = (baseline - current) + R for n elements of key k from element e0, into s->a (F32 lanes). */
static int error_chunk(enc_state *s, const enc_key *k, uint64_t e0, size_t n, dl_error *err)
{
    const st_tensor *t = k->base;
    const size_t lanes = cv_lanes(t->dtype);
    uint32_t cfile;
    const st_tensor *c = st_set_find(s->fc, t->name, t->name_len, &cfile);
    int rc;

    if ((rc = delta_read_f32(s->fb, k->base_file, t, e0, n, s->raw, s->a, err)) != 0 ||
        (rc = delta_read_f32(s->fc, cfile, c, e0, n, s->raw, s->b, err)) != 0)
        return rc;
    for (size_t j = 0; j < n * lanes; j++)
        s->a[j] -= s->b[j];
    if (s->residual != NULL) {
        const st_tensor *r = st_header_find(s->residual->h, t->name, t->name_len);
        if ((rc = st_read(s->residual, r, e0 * lanes * 4, s->b, n * lanes * 4, err)) != 0)
            return rc;
        for (size_t j = 0; j < n * lanes; j++)
            s->a[j] += s->b[j];
    }
    int64_t bad = delta_find_bad_value(ST_F32, s->a, n * lanes);
    if (bad >= 0)
        return dl_fail(err, DL_E_NON_FINITE, t->name, t->name_len,
                       "the delta (with the residual) holds " DELTA_BAD_VALUE_TEXT " at element %llu",
                       (unsigned long long)(e0 + (uint64_t)bad / lanes));
    return 0;
}

/* Key k chunk by chunk: its codes and scales (or plain values) into w, its new residual into rw. */
static int encode_key(enc_state *s, const enc_key *k, st_set_writer *w, st_writer *rw, dl_error *err)
{
    const st_tensor *t = k->base;
    const size_t lanes = cv_lanes(t->dtype);
    const cz_spec *cz = s->cz;
    int rc;

    for (uint64_t e0 = 0; e0 < t->nelem; e0 += ENC_CHUNK) {
        size_t n = (size_t)(t->nelem - e0 < ENC_CHUNK ? t->nelem - e0 : ENC_CHUNK);
        if ((rc = error_chunk(s, k, e0, n, err)) != 0)
            return rc;
        if (!k->compressed) {
            /* stored as it is: nothing left over */
            memset(s->b, 0, n * lanes * 4);
            if ((rc = st_set_writer_write(w, k->spec, e0 * lanes * 4, s->a, n * lanes * 4, err)) != 0 ||
                (rw != NULL && (rc = st_writer_write(rw, k->rspec, e0 * lanes * 4, s->b, n * lanes * 4, err)) != 0))
                return rc;
            continue;
        }
        uint64_t soff, slen;
        delta_scales_range(cz, e0, n, &soff, &slen);
        cz_encode(cz, s->a, n, s->codes, s->scales);
        (void)cz_decode(cz, s->codes, s->scales, e0, s->dec, n);
        for (size_t j = 0; j < n; j++)
            s->b[j] = s->a[j] - s->dec[j];
        if ((rc = st_set_writer_write(w, k->spec, cz_code_bytes(cz->enc, e0), s->codes,
                                      (size_t)cz_code_bytes(cz->enc, n), err)) != 0 ||
            (rc = st_set_writer_write(w, k->spec + 1, soff, s->scales, (size_t)slen, err)) != 0 ||
            (rw != NULL && (rc = st_writer_write(rw, k->rspec, e0 * 4, s->b, n * 4, err)) != 0))
            return rc;
    }
    return 0;
}

static void state_free(enc_state *s)
{
    for (size_t i = 0; s->keys != NULL && i < s->nkeys; i++)
        free(s->keys[i].scales_name);
    free(s->keys);
    free(s->specs);
    free(s->glue);
    free(s->rspecs);
    free(s->scale_shape);
    free(s->raw);
    free(s->codes);
    free(s->scales);
    free(s->a);
    free(s->b);
    free(s->dec);
    st_close(s->residual);
    st_set_close(s->fb);
    st_set_close(s->fc);
}

/* The metadata as dilocod will judge it (delta_check_meta): no key twice, the worker metrics' values. */
static int check_extra(const st_kv *meta, size_t n, dl_error *err)
{
    st_meta *m = calloc(n + 1, sizeof(*m));
    delta_info info;
    int rc;

    if (m == NULL)
        return dl_fail(err, DL_E_NO_MEMORY, NULL, 0, "out of memory");
    for (size_t i = 0; i < n; i++) {
        for (size_t j = 0; j < i; j++)
            if (strcmp(meta[i].key, meta[j].key) == 0) {
                free(m);
                return dl_fail(err, DL_E_INVALID_ARGUMENT, NULL, 0, "metadata key \"%.48s\" given twice", meta[i].key);
            }
        m[i] = (st_meta){(char *)meta[i].key, strlen(meta[i].key), (char *)meta[i].value, strlen(meta[i].value)};
    }
    rc = delta_check_meta(m, n, NULL, &info, err);
    free(m);
    return rc;
}

int delta_compute_encoded(const char *baseline, const char *current, const char *out, const char *node_id,
                          uint64_t base_outer_step, uint64_t local_step, const cz_spec *cz, const char *residual,
                          const st_kv *extra, size_t nextra, uint64_t shard_size, dl_error *err)
{
    enc_state s = {.cz = cz};
    st_set_writer *w = NULL;
    st_writer *rw = NULL;
    char bstep[24], lstep[24], block[16];
    int rc;

    if (cz->enc == CZ_NONE || !cz_spec_valid(cz))
        return dl_fail(err, DL_E_INVALID_ARGUMENT, NULL, 0,
                       "invalid encoding: int8_block takes --block 32..4096 (a power of two), mxfp8 and mxfp4 32");
    if (!delta_valid_node_id(node_id, strlen(node_id)))
        return dl_fail(err, DL_E_INVALID_ARGUMENT, NULL, 0, "invalid node id \"%.64s\"", node_id);
    if (base_outer_step > DELTA_INT_MAX || local_step > DELTA_INT_MAX)
        return dl_fail(err, DL_E_INVALID_ARGUMENT, NULL, 0, "step out of range");
    snprintf(bstep, sizeof(bstep), "%llu", (unsigned long long)base_outer_step);
    snprintf(lstep, sizeof(lstep), "%llu", (unsigned long long)local_step);
    snprintf(block, sizeof(block), "%u", cz->block);
    st_kv own[] = {{"algorithm", DELTA_ALGORITHM}, {"base_outer_step", bstep}, {"block", block},
                   {"encoding", cz_encoding_name(cz->enc)}, {"local_step", lstep}, {"node_id", node_id}};
    const size_t nown = sizeof(own) / sizeof(own[0]);
    st_kv rmeta[] = {{"block", block}, {"encoding", cz_encoding_name(cz->enc)}};
    st_kv *meta = calloc(nown + nextra, sizeof(*meta));
    if (meta == NULL)
        return dl_fail(err, DL_E_NO_MEMORY, NULL, 0, "out of memory");
    memcpy(meta, own, sizeof(own));
    for (size_t i = 0; i < nextra; i++)
        meta[nown + i] = extra[i];
    if ((rc = check_extra(meta, nown + nextra, err)) != 0)
        goto out;
    if ((rc = st_set_open(baseline, &s.fb, err)) != 0 || (rc = st_set_open(current, &s.fc, err)) != 0 ||
        (rc = delta_check_pair(s.fb, s.fc, err)) != 0 || (rc = plan(&s, err)) != 0 ||
        (rc = open_residual(&s, residual, err)) != 0 || (rc = alloc_bufs(&s, err)) != 0)
        goto out;
    if ((rc = st_set_writer_open_glued(out, s.specs, s.nspecs, s.glue, meta, nown + nextra, shard_size, &w, err)) != 0 ||
        (residual != NULL && (rc = st_writer_open(residual, s.rspecs, s.nkeys, rmeta, 2, &rw, err)) != 0))
        goto out;
    for (size_t i = 0; i < s.nkeys && rc == 0; i++)
        rc = encode_key(&s, &s.keys[i], w, rw, err);
    /* a commit frees its writer, whatever it returns; a failure before it leaves both to abort below */
    if (rc == 0) {
        rc = st_set_writer_commit(w, err);
        w = NULL;
    }
    if (rc == 0 && rw != NULL) {
        rc = st_writer_commit(rw, err);
        rw = NULL;
    }
out:
    st_set_writer_abort(w);
    st_writer_abort(rw);
    state_free(&s);
    free(meta);
    return rc;
}
