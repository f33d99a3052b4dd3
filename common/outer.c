/* outer: the outer step's pass (outer.h) prepared and finished: the deltas, the momentum and the accumulator
 * bound to the global's tensors, the writers opened, the items planned; after outer_run (outer_run.c), the
 * inputs verified against their checksums and the outputs committed. */
#include "outer.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "convert.h"
#include "delta.h"
#include "fsutil.h"

static int delta_dtype_ok(st_dtype global, st_dtype d)
{
    if (global == ST_C64)
        return d == ST_C64;
    return d == ST_F32 || d == ST_F16 || d == ST_BF16;
}

static int same_shape(const st_tensor *a, const st_tensor *b)
{
    return a->ndim == b->ndim && (a->ndim == 0 || memcmp(a->shape, b->shape, a->ndim * sizeof(uint64_t)) == 0);
}

static int bind_deltas(outer_pass *p, size_t *nscales, dl_error *err);

/* Matches every delta (and the momentum file) against the global's floating tensors. */
static int bind_tensors(outer_pass *p, dl_error *err)
{
    const st_header *g = p->global->h;

    p->delta_t = calloc(g->ntensors * p->ndeltas + 1, sizeof(*p->delta_t));
    p->delta_f = calloc(g->ntensors * p->ndeltas + 1, sizeof(*p->delta_f));
    p->delta_s = calloc(g->ntensors * p->ndeltas + 1, sizeof(*p->delta_s));
    p->delta_cz = calloc(p->ndeltas + 1, sizeof(*p->delta_cz));
    size_t *nscales = calloc(p->ndeltas + 1, sizeof(*nscales));
    p->mom_t = calloc(g->ntensors + 1, sizeof(*p->mom_t));
    p->mom_spec = calloc(g->ntensors + 1, sizeof(*p->mom_spec));
    p->acc_t = calloc(g->ntensors + 1, sizeof(*p->acc_t));
    if (p->delta_t == NULL || p->delta_f == NULL || p->delta_s == NULL || p->delta_cz == NULL || nscales == NULL ||
        p->mom_t == NULL || p->mom_spec == NULL || p->acc_t == NULL) {
        free(nscales);
        return dl_fail(err, DL_E_NO_MEMORY, NULL, 0, "out of memory");
    }
    int rc = bind_deltas(p, nscales, err);
    free(nscales);
    return rc;
}

/* bind_tensors for the deltas, the momentum and the accumulator; nscales[k]: delta k's scales tensors. */
static int bind_deltas(outer_pass *p, size_t *nscales, dl_error *err)
{
    const st_header *g = p->global->h;
    size_t nfloat = 0;

    /* each delta's encoding, read from the metadata of the file the pass opened (its intake checked it) */
    for (size_t k = 0; k < p->ndeltas; k++) {
        const st_meta *meta;
        size_t nmeta;
        st_set_metadata(p->deltas[k], &meta, &nmeta);
        int rc = cz_spec_from_meta(meta, nmeta, &p->delta_cz[k], err);
        if (rc != 0)
            return rc;
    }
    for (size_t ti = 0; ti < g->ntensors; ti++) {
        const st_tensor *t = &g->tensors[ti];
        if (!st_dtype_is_floating(t->dtype))
            continue;
        if (!cv_can_decode(t->dtype) || !cv_can_encode(t->dtype))
            return dl_fail(err, DL_E_UNSUPPORTED_DTYPE, t->name, t->name_len,
                           "outer updates of %s weights are not supported (F16, BF16, F32, F64, C64 are)",
                           st_dtype_name(t->dtype));
        p->mom_spec[ti] = nfloat++;
        for (size_t k = 0; k < p->ndeltas; k++) {
            uint32_t file = 0;
            const st_tensor *d = st_set_find(p->deltas[k], t->name, t->name_len, &file);
            if (d == NULL)
                return dl_fail(err, DL_E_KEY_MISMATCH, t->name, t->name_len, "%s lacks this key", p->delta_paths[k]);
            const cz_spec *cz = &p->delta_cz[k];
            const st_tensor *sc = NULL;
            if (cz->enc != CZ_NONE && t->dtype != ST_C64 && d->dtype == cz_code_dtype(cz->enc)) {
                sc = delta_scales_of(p->deltas[k]->files[file]->h, d);
                if (sc == NULL || sc->dtype != cz_scale_dtype(cz->enc) || sc->ndim != 1 ||
                    sc->shape[0] != cz_nscales(d->nelem, cz->block))
                    return dl_fail(err, DL_E_KEY_MISMATCH, t->name, t->name_len, "%s: the key's scales do not match it",
                                   p->delta_paths[k]);
                nscales[k]++;
            }
            if (!same_shape(t, d) || (sc == NULL && !delta_dtype_ok(t->dtype, d->dtype)))
                return dl_fail(err, DL_E_SHAPE_MISMATCH, t->name, t->name_len,
                               "%s: tensor does not match the global model", p->delta_paths[k]);
            p->delta_t[ti * p->ndeltas + k] = d;
            p->delta_f[ti * p->ndeltas + k] = p->deltas[k]->files[file];
            p->delta_s[ti * p->ndeltas + k] = sc;
        }
        if (p->momentum != NULL) {
            const st_tensor *m = st_header_find(p->momentum->h, t->name, t->name_len);
            if (m == NULL || !same_shape(t, m) || m->dtype != delta_dtype_for(t->dtype))
                return dl_fail(err, DL_E_KEY_MISMATCH, t->name, t->name_len,
                               "momentum file %s does not match the global model", p->momentum_path);
            p->mom_t[ti] = m;
        }
        if (p->accum != NULL) {
            const st_tensor *a = st_header_find(p->accum->h, t->name, t->name_len);
            if (a == NULL || !same_shape(t, a) || a->dtype != delta_dtype_for(t->dtype))
                return dl_fail(err, DL_E_KEY_MISMATCH, t->name, t->name_len,
                               "accumulator file %s does not match the global model", p->accum_path);
            p->acc_t[ti] = a;
        }
    }
    for (size_t k = 0; k < p->ndeltas; k++) {
        if (p->deltas[k]->ntensors != nfloat + nscales[k])
            return dl_fail(err, DL_E_KEY_MISMATCH, NULL, 0,
                           "%s has %zu tensors, the global model %zu floating ones (and %zu compressed keys' scales)",
                           p->delta_paths[k], p->deltas[k]->ntensors, nfloat, nscales[k]);
    }
    if (p->momentum != NULL && p->momentum->h->ntensors != nfloat)
        return dl_fail(err, DL_E_KEY_MISMATCH, NULL, 0, "momentum file %s has %zu tensors, expected %zu",
                       p->momentum_path, p->momentum->h->ntensors, nfloat);
    if (p->accum != NULL && p->accum->h->ntensors != nfloat)
        return dl_fail(err, DL_E_KEY_MISMATCH, NULL, 0, "accumulator file %s has %zu tensors, expected %zu",
                       p->accum_path, p->accum->h->ntensors, nfloat);
    return 0;
}

static int open_writers(outer_pass *p, dl_error *err)
{
    const st_header *g = p->global->h;
    st_spec *specs;
    size_t nm = 0;
    int rc;

    if (p->stats_only)
        return 0;               /* the cosine screen's first pass writes nothing */
    if ((specs = calloc(g->ntensors + 1, sizeof(*specs))) == NULL)
        return dl_fail(err, DL_E_NO_MEMORY, NULL, 0, "out of memory");
    for (size_t ti = 0; ti < g->ntensors; ti++) {
        const st_tensor *t = &g->tensors[ti];
        specs[ti] = (st_spec){t->name, t->name_len, t->dtype, t->ndim, t->shape};
    }
    /* Writeback during the pass only pays when outer_finish fsyncs right after it.  With defer_sync the
     * fsync happens later, off the critical path, and sync_file_range here would make the pass wait for
     * a congested disk: bench-outer (8 x 256 MiB, outputs on this disk) computed in 0.28-0.50 s without
     * it against 0.31-4.67 s with it. */
    rc = st_writer_open_warm(p->out_global_path, specs, g->ntensors, NULL, 0, p->warm_global_tmp, &p->w_global, err);
    if (rc == 0)
        st_writer_set_writeback(p->w_global, !p->defer_sync);
    if (rc == 0)
        st_writer_set_durable(p->w_global, !p->defer_sync);
    for (size_t ti = 0; ti < g->ntensors; ti++) {
        const st_tensor *t = &g->tensors[ti];
        if (st_dtype_is_floating(t->dtype))
            specs[nm++] = (st_spec){t->name, t->name_len, delta_dtype_for(t->dtype), t->ndim, t->shape};
    }
    if (rc == 0 && p->write_momentum) {
        rc = st_writer_open_warm(p->out_momentum_path, specs, nm, p->momentum_meta, p->momentum_nmeta,
                                 p->warm_momentum_tmp, &p->w_momentum, err);
        if (rc == 0)
            st_writer_set_writeback(p->w_momentum, !p->defer_sync);
        if (rc == 0)
            st_writer_set_durable(p->w_momentum, !p->defer_sync);
    }
    /* the accumulator has the momentum's layout (and its metadata) */
    if (rc == 0 && p->params.dn_period != 0 && !OUTER_DN_TICK(&p->params)) {
        rc = st_writer_open_warm(p->out_accum_path, specs, nm, p->momentum_meta, p->momentum_nmeta, NULL,
                                 &p->w_accum, err);
        if (rc == 0)
            st_writer_set_writeback(p->w_accum, !p->defer_sync);
        if (rc == 0)
            st_writer_set_durable(p->w_accum, !p->defer_sync);
    }
    free(specs);
    return rc;
}

/* A pass thread takes consecutive items by runs of about RUN_BYTES of each F32 input (twice that of a C64
 * one), and maps each input once per run (a window, reserved without page tables), populating each item's
 * pages as it comes to them and dropping the units (or pages) it has read.  Every page is then populated
 * once (and by one call for all its item's pages), where an item-sized mapping of whole 2 MiB units
 * populated each unit about four times (once per item touching it, ~0.6 MiB items at the default
 * budget), and paid an mmap and an munmap per input and item.  RSS stays what it was (the item's pages,
 * and a unit's); the threads' last runs end at most about RUN_BYTES x inputs of work apart.  bench-outer,
 * 8 x 1 GiB on files cached partly in 2 MiB folios, alternated: 1.12-1.45 s (2.06-2.62 CPU s) item by
 * item, 0.81-1.15 s (1.52-2.14 CPU s) by runs (runs of 16 to 128 items, and this RUN_BYTES, ~26 items at
 * the default budget, measured alike). */
enum { RUN_BYTES = 16 << 20 };

static void plan_items(outer_pass *p)
{
    const st_header *g = p->global->h;
    /* Per element of a chunk, at most: 8 raw bytes in, (ndeltas + 3) F32 buffers of 2 lanes, 8 raw out. */
    uint64_t per_elem = 16 + 8 * ((uint64_t)p->ndeltas + 3);
    uint64_t ce = p->budget_bytes / per_elem;
    size_t n = 0;

    /* items begin on checksum blocks (checksum.h): each item adds whole blocks' terms */
    ce = ce < CK_BLOCK_ELEMS ? CK_BLOCK_ELEMS : ce - ce % CK_BLOCK_ELEMS;
    p->chunk_elems = ce;
    p->run_items = RUN_BYTES / (ce * 4) > 1 ? (size_t)(RUN_BYTES / (ce * 4)) : 1;
    for (size_t ti = 0; ti < g->ntensors; ti++)
        n += (size_t)((g->tensors[ti].nelem + ce - 1) / ce);
    p->items = calloc(n + 1, sizeof(*p->items));
    if (p->items == NULL)
        return;
    p->bytes_total = 0;
    for (size_t ti = 0; ti < g->ntensors; ti++) {
        const st_tensor *t = &g->tensors[ti];
        for (uint64_t b = 0; b < t->nelem; b += ce)
            p->items[p->nitems++] = (outer_item){ti, b, b + ce < t->nelem ? b + ce : t->nelem};
        uint64_t gb = st_tensor_bytes(t);
        p->bytes_total += 2 * gb;      /* global read + written */
        if (st_dtype_is_floating(t->dtype)) {
            uint64_t mb = t->nelem * cv_lanes(t->dtype) * 4;
            for (size_t k = 0; k < p->ndeltas; k++)
                p->bytes_total += st_tensor_bytes(p->delta_t[ti * p->ndeltas + k]) +
                                  (p->delta_s[ti * p->ndeltas + k] ? st_tensor_bytes(p->delta_s[ti * p->ndeltas + k]) : 0);
            if (p->mom_t[ti] != NULL)
                p->bytes_total += mb;
            if (p->w_momentum != NULL)
                p->bytes_total += mb;
            if (p->acc_t[ti] != NULL)
                p->bytes_total += mb;
            if (p->w_accum != NULL)
                p->bytes_total += mb;
        }
    }
}

static int prepare(outer_pass *p, dl_error *err);

int outer_prepare(outer_pass *p, dl_error *err)
{
    int rc;

    pthread_mutex_init(&p->lock, NULL);
    atomic_init(&p->next_item, 0);
    atomic_init(&p->abort, 0);
    atomic_init(&p->bytes_done, 0);
    p->rc = 0;
    /* a failed prepare must make outer_finish discard whatever writer it opened */
    if ((rc = prepare(p, err)) != 0) {
        p->rc = rc;
        if (err != NULL)
            p->err = *err;
    }
    return rc;
}

static int prepare(outer_pass *p, dl_error *err)
{
    int rc;

    if (p->ndeltas == 0)
        return dl_fail(err, DL_E_EMPTY_INPUT, NULL, 0, "an outer step needs at least one delta");
    if ((p->params.rule == OUTER_RULE_WEIGHTED || p->params.rule == OUTER_RULE_CLIPPED) && p->delta_scale == NULL)
        return dl_fail(err, DL_E_INVALID_ARGUMENT, NULL, 0, "weighted_mean and clipped_mean need each delta's scale");
    if (p->params.rule > OUTER_RULE_MEDIAN)
        return dl_fail(err, DL_E_INVALID_ARGUMENT, NULL, 0, "unknown aggregation rule %d", (int)p->params.rule);
    if (p->stats_only && ((p->params.rule != OUTER_RULE_MEAN && p->params.rule != OUTER_RULE_MEDIAN) ||
                          p->params.momentum != 0.0f || p->params.dn_period != 0))
        return dl_fail(err, DL_E_INVALID_ARGUMENT, NULL, 0,
                       "a statistics-only pass takes the plain mean or the coordinate median, no step");
    p->stats = calloc(p->ndeltas, sizeof(*p->stats));
    p->deltas = calloc(p->ndeltas, sizeof(*p->deltas));
    p->in_sums = calloc(OUTER_NINPUTS(p), sizeof(*p->in_sums));
    p->summing = calloc(OUTER_NINPUTS(p), 1);
    p->out_global_sum = p->out_momentum_sum = p->out_accum_sum = 0;
    if (p->stats == NULL || p->deltas == NULL || p->in_sums == NULL || p->summing == NULL)
        return dl_fail(err, DL_E_NO_MEMORY, NULL, 0, "out of memory");
    for (size_t k = 0; p->ck != NULL && k < OUTER_NINPUTS(p); k++)
        p->summing[k] = p->sum_every_input ||
                        (k < p->ndeltas ? p->delta_summed != NULL && p->delta_summed[k]
                         : k == OUTER_INPUT_GLOBAL(p)   ? p->global_summed
                         : k == OUTER_INPUT_MOMENTUM(p) ? p->momentum_summed
                                                        : p->accum_summed);
    /* synchronous: a momentum file whenever there is momentum; Delayed Nesterov: the caller says (none
     * before the first Nesterov step, and a link of the previous one when it is carried) */
    if (p->carry_momentum && (p->params.dn_period == 0 || OUTER_DN_TICK(&p->params) || p->momentum_path == NULL ||
                              p->out_momentum_path == NULL))
        return dl_fail(err, DL_E_INVALID_ARGUMENT, NULL, 0, "only a plain Delayed Nesterov step carries the momentum");
    if (p->carry_momentum && p->summing != NULL)
        p->summing[OUTER_INPUT_MOMENTUM(p)] = 0;        /* not read */
    p->write_momentum = !p->carry_momentum && p->params.momentum != 0.0f &&
                        (p->params.dn_period == 0 || p->out_momentum_path != NULL);
    if (p->params.dn_period != 0 && !OUTER_DN_TICK(&p->params) && p->out_accum_path == NULL)
        return dl_fail(err, DL_E_INVALID_ARGUMENT, NULL, 0, "Delayed Nesterov: update %u of %u has no accumulator",
                       p->params.dn_k + 1, p->params.dn_period);
    if ((rc = st_open(p->global_path, &p->global, err)) != 0)
        return rc;
    if (p->momentum_path != NULL && p->params.momentum != 0.0f && !p->carry_momentum &&
        (rc = st_open(p->momentum_path, &p->momentum, err)) != 0)
        return rc;
    if (p->accum_path != NULL && p->params.dn_period != 0 && (rc = st_open(p->accum_path, &p->accum, err)) != 0)
        return rc;
    /* a delta is one file or a set (its index): the pass reads each tensor from the file that holds it */
    for (size_t k = 0; k < p->ndeltas; k++) {
        if ((rc = st_set_open(p->delta_paths[k], &p->deltas[k], err)) != 0)
            return rc;
    }
    if ((rc = bind_tensors(p, err)) != 0 || (rc = open_writers(p, err)) != 0)
        return rc;
    plan_items(p);
    if (p->items == NULL)
        return dl_fail(err, DL_E_NO_MEMORY, NULL, 0, "out of memory");
    return 0;
}
int outer_global_fd(const outer_pass *p)
{
    return p->w_global != NULL ? st_writer_fd(p->w_global) : -1;
}

void outer_abort(outer_pass *p)
{
    atomic_store(&p->abort, 1);
}

int outer_input_changed(const outer_pass *p, size_t i)
{
    if (p->ck == NULL || p->in_sums == NULL)
        return 0;
    if (i < p->ndeltas)
        return p->delta_summed != NULL && p->delta_summed[i] && p->delta_sums[i] != p->in_sums[i];
    if (i == OUTER_INPUT_GLOBAL(p))
        return p->global_summed && p->global_sum != p->in_sums[i];
    if (i == OUTER_INPUT_MOMENTUM(p))
        return p->momentum_summed && p->momentum_path != NULL && p->params.momentum != 0.0f && !p->carry_momentum &&
               p->momentum_sum != p->in_sums[i];
    if (i == OUTER_INPUT_ACCUM(p))
        return p->accum_summed && p->accum != NULL && p->accum_sum != p->in_sums[i];
    return 0;
}

/* After every item succeeded: every input the pass read is the one given a checksum, else nothing is
 * committed (the first changed input named; outer_input_changed tells them all). */
static int verify_inputs(outer_pass *p, dl_error *err)
{
    for (size_t i = 0; i < OUTER_NINPUTS(p); i++) {
        if (!outer_input_changed(p, i))
            continue;
        const char *what = i < p->ndeltas                 ? p->delta_paths[i]
                           : i == OUTER_INPUT_GLOBAL(p)   ? p->global_path
                           : i == OUTER_INPUT_MOMENTUM(p) ? p->momentum_path
                                                          : p->accum_path;
        return dl_fail(err, DL_E_CHECKSUM_MISMATCH, NULL, 0, "%s is not the file that was %s: its content changed "
                       "(rewritten in place); the step is not committed", what,
                       i < p->ndeltas ? "validated" : "committed");
    }
    return 0;
}

/* The previous momentum linked under the new step's name (a temporary name, then rename: a crash leaves
 * the name whole or absent), unread: its checksum is the committed one. */
static int carry_momentum(outer_pass *p, dl_error *err)
{
    char tmp[4096];

    if (snprintf(tmp, sizeof(tmp), "%s.link", p->out_momentum_path) >= (int)sizeof(tmp))
        return dl_fail(err, DL_E_INVALID_ARGUMENT, NULL, 0, "momentum path too long");
    (void)unlink(tmp);
    if (link(p->momentum_path, tmp) != 0)
        return dl_fail_errno(err, errno, "linking the momentum %s", p->momentum_path);
    if (rename(tmp, p->out_momentum_path) != 0) {
        int e = errno;
        (void)unlink(tmp);
        return dl_fail_errno(err, e, "renaming the momentum to %s", p->out_momentum_path);
    }
    p->out_momentum_sum = p->momentum_sum;
    return p->defer_sync ? 0 : fsu_fsync_parent(p->out_momentum_path, err);
}

int outer_finish(outer_pass *p, dl_error *err)
{
    int rc = p->rc;

    if (rc == 0 && atomic_load(&p->abort))
        rc = dl_fail(err, DL_E_INVALID_ARGUMENT, NULL, 0, "outer step abandoned");
    else if (rc != 0 && err != NULL)
        *err = p->err;
    /* a non-finite result from a pass that read every input: a changed input explains it */
    if ((rc == 0 || (rc == -DL_E_NON_FINITE && !atomic_load(&p->abort))) && verify_inputs(p, &p->err) != 0) {
        rc = p->rc = -DL_E_CHECKSUM_MISMATCH;
        if (err != NULL)
            *err = p->err;
    }
    if (rc == 0 && p->w_global != NULL) {
        rc = st_writer_commit(p->w_global, err);
        p->w_global = NULL;
    }
    if (rc == 0 && p->w_momentum != NULL) {
        rc = st_writer_commit(p->w_momentum, err);
        p->w_momentum = NULL;
    }
    if (rc == 0 && p->w_accum != NULL) {
        rc = st_writer_commit(p->w_accum, err);
        p->w_accum = NULL;
    }
    if (rc == 0 && p->carry_momentum)
        rc = carry_momentum(p, err);
    st_writer_abort(p->w_global);
    st_writer_abort(p->w_momentum);
    st_writer_abort(p->w_accum);
    p->w_global = p->w_momentum = p->w_accum = NULL;
    st_close(p->global);
    st_close(p->momentum);
    st_close(p->accum);
    p->accum = NULL;
    free(p->acc_t);
    p->acc_t = NULL;
    for (size_t k = 0; p->deltas != NULL && k < p->ndeltas; k++)
        st_set_close(p->deltas[k]);
    free(p->deltas);
    free(p->delta_t);
    free(p->delta_f);
    free(p->delta_s);
    free(p->delta_cz);
    p->delta_s = NULL;
    p->delta_cz = NULL;
    free(p->mom_t);
    free(p->mom_spec);
    free(p->items);
    p->global = p->momentum = NULL;
    p->deltas = NULL;
    p->delta_t = p->mom_t = NULL;
    p->delta_f = NULL;
    p->mom_spec = NULL;
    p->items = NULL;
    pthread_mutex_destroy(&p->lock);
    return rc;
}

void outer_free(outer_pass *p)
{
    free(p->stats);
    p->stats = NULL;
    free(p->in_sums);
    p->in_sums = NULL;
    free(p->summing);
    p->summing = NULL;
}
