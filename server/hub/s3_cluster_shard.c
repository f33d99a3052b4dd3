/* s3_cluster_shard: one shard of a step: its claim (lease, renewal, takeover, fencing), its inputs read
 * into slices with ranged GETs, the pass over them, its outputs written once, its done marker.  See
 * s3_cluster_internal.h. */
#include "s3_cluster_internal.h"

#include <errno.h>
#include <fcntl.h>
#include <float.h>
#include <inttypes.h>
#include <math.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <cJSON.h>

#include "delta.h"
#include "dl_log.h"
#include "fsutil.h"
#include "remote_fetch.h"
#include "round.h"
#include "s3_sync.h"
#include "st_index.h"
#include "stepcount.h"
#include "store.h"
#include "weights.h"

/* ---- claims --------------------------------------------------------------------------------------- */

static int claim_body(cluster *c, uint64_t step, uint32_t i, unsigned epoch, char *out, size_t size)
{
    int n = snprintf(out, size, "{\"outer_step\": %" PRIu64 ", \"shard\": %" PRIu32 ", \"instance\": \"%s\", "
                     "\"epoch\": %u, \"renewal\": %u}\n", step, i, c->instance, epoch, c->claim_renewal);
    return n > 0 && (size_t)n < size ? n : -1;
}


/* Claims shard i: a new claim, or an expired one taken over.  CLAIM_OURS with c->claim_etag and *epoch. */
claim_result cl_claim_try(cluster *c, uint64_t step, uint32_t i, unsigned *epoch)
{
    char *rel = cl_claim_rel(step, c->gen, i);
    char body[512], why[300];
    s3s_resp r;
    claim_result out = CLAIM_FAILED;
    int len;

    memset(&r, 0, sizeof(r));
    if (rel == NULL)
        return CLAIM_FAILED;
    c->claim_renewal = 0;
    *epoch = 1;
    if ((len = claim_body(c, step, i, 1, body, sizeof(body))) < 0)
        goto out;
    s3_lease_put put = s3_lease_after_put(cl_put_small(c, rel, body, (size_t)len, NULL, 1, &r, why, sizeof(why)));
    if (put == S3_LEASE_PUT_WRITTEN) {
        snprintf(c->claim_etag, sizeof(c->claim_etag), "%s", r.etag);
        out = CLAIM_OURS;
        goto out;
    }
    s3s_resp_free(&r);
    if (put != S3_LEASE_PUT_READ_BACK)
        goto out;
    /* it exists: ours (an earlier attempt whose answer was lost), live, or expired */
    int got = cl_get_small(c, rel, CLAIM_CAP, &r, why, sizeof(why));
    if (got != 1) {
        out = got == 0 ? CLAIM_BUSY : CLAIM_FAILED;   /* gone meanwhile: the next sweep claims it afresh */
        goto out;
    }
    shard_view *sv = &c->sv[i];
    double age = s3_lease_age(&sv->foreign, r.etag, r.last_modified, r.date, cl_mono());
    s3_lease_verdict v = s3_lease_judge(r.body.p, r.body.len, body, (size_t)len, 0, age, c->cfg.lease, r.etag);
    if (v == S3_LEASE_OURS) {
        snprintf(c->claim_etag, sizeof(c->claim_etag), "%s", r.etag);
        out = CLAIM_OURS;
        goto out;
    }
    cJSON *j = cJSON_ParseWithLength(r.body.p, r.body.len);
    uint64_t theirs = 0;
    if (cl_json_u64(j, "epoch", &theirs) != 0 || theirs > 1000000000u)
        theirs = 0;
    cJSON_Delete(j);
    cl_shard_set(c, i, SH_FOREIGN, (unsigned)theirs, age);
    if (v == S3_LEASE_LIVE) {
        out = CLAIM_BUSY;
        goto out;
    }
    /* expired: taken over with If-Match on the stale claim's ETag, so of several takers one wins */
    char stale[80];
    snprintf(stale, sizeof(stale), "%s", r.etag);
    s3s_resp_free(&r);
    *epoch = (unsigned)theirs + 1;
    if ((len = claim_body(c, step, i, *epoch, body, sizeof(body))) < 0)
        goto out;
    put = s3_lease_after_put(cl_put_small(c, rel, body, (size_t)len, stale, 0, &r, why, sizeof(why)));
    if (put == S3_LEASE_PUT_READ_BACK) {
        /* an ambiguous 412: a retried takeover meets its own first attempt; read back and compare */
        s3s_resp_free(&r);
        if (cl_get_small(c, rel, CLAIM_CAP, &r, why, sizeof(why)) == 1 &&
            s3_lease_judge(r.body.p, r.body.len, body, (size_t)len, 0, 0, c->cfg.lease, NULL) == S3_LEASE_OURS)
            put = S3_LEASE_PUT_WRITTEN;
    }
    if (put == S3_LEASE_PUT_WRITTEN) {
        dl_log(DL_LOG_WARN, "cluster", "took over an expired shard claim", "step=%" PRIu64 " shard=%" PRIu32
               " epoch=%u age_s=%.1f", step, i, *epoch, age);
        snprintf(c->claim_etag, sizeof(c->claim_etag), "%s", r.etag);
        cl_count(c, &c->takeovers, 1);
        out = CLAIM_OURS;
    } else {
        out = CLAIM_BUSY;
    }
out:
    s3s_resp_free(&r);
    free(rel);
    return out;
}

/* Renews our claim (If-Match on our ETag): 0 still ours, -1 fenced out (another holds it now). */
static int claim_renew(cluster *c, uint64_t step, uint32_t i, unsigned epoch)
{
    char *rel = cl_claim_rel(step, c->gen, i);
    char body[512], why[300];
    s3s_resp r;
    int rc = -1, len;

    if (rel == NULL)
        return -1;
    c->claim_renewal++;
    if ((len = claim_body(c, step, i, epoch, body, sizeof(body))) < 0)
        goto out;
    long st = cl_put_small(c, rel, body, (size_t)len, c->claim_etag, 0, &r, why, sizeof(why));
    s3_lease_put put = s3_lease_after_put(st);
    if (put == S3_LEASE_PUT_WRITTEN) {
        snprintf(c->claim_etag, sizeof(c->claim_etag), "%s", r.etag);
        c->last_renew = cl_mono();
        cl_shard_set(c, i, SH_OURS, epoch, 0);
        rc = 0;
        goto out;
    }
    if (put == S3_LEASE_PUT_READ_BACK) {
        /* an ambiguous 412: our retried renewal may have gone through; read back and compare */
        s3s_resp_free(&r);
        if (cl_get_small(c, rel, CLAIM_CAP, &r, why, sizeof(why)) == 1 &&
            s3_lease_judge(r.body.p, r.body.len, body, (size_t)len, 0, 0, c->cfg.lease, NULL) == S3_LEASE_OURS) {
            snprintf(c->claim_etag, sizeof(c->claim_etag), "%s", r.etag);
            c->last_renew = cl_mono();
            rc = 0;
        }
        goto out;
    }
    /* no answer: the lease is not over yet, and the next renewal tries again */
    rc = st == 0 && cl_mono() - c->last_renew < c->cfg.lease ? 0 : -1;
out:
    s3s_resp_free(&r);
    free(rel);
    return rc;
}

/* epoch 0: no claim of ours (a refusal verified) */
static void renew_if_due(cluster *c, uint64_t step, uint32_t i, unsigned epoch, int *fenced)
{
    if (epoch != 0 && !*fenced && cl_mono() - c->last_renew >= c->cfg.lease / 3 && claim_renew(c, step, i, epoch) != 0)
        *fenced = 1;
}

/* ---- a shard's inputs ----------------------------------------------------------------------------- */

typedef struct range {
    const source *s;
    uint64_t src, dst, len;
} range;

/* by source object, then offset (the sort is only for coalescing: any order reads the same bytes) */
static int range_cmp(const void *a, const void *b)
{
    const range *x = a, *y = b;
    int k = strcmp(x->s->rel, y->s->rel);
    if (k != 0)
        return k;
    return x->src < y->src ? -1 : x->src > y->src;
}

/* Writes path: a safetensors file of tensors ts (specs in that order), ts[k] read from the object srcs[k]
 * holds it in (at data_start + begin: ts[k] is of that object's header), with metadata meta; the reads
 * coalesced where they are contiguous, each a ranged GET with If-Match on the object's ETag, straight into
 * the file (no buffer but curl's).  Counted in the shard's bytes read.  0, -1 (why), or -3 when an object
 * is no longer the version listed (412, 404). */
static int build_slice(cluster *c, const char *path, const source *const *srcs, const st_tensor *const *ts, size_t n,
                       const st_kv *meta, size_t nmeta, uint32_t shard, int *fenced, uint64_t step, unsigned epoch,
                       char *why, size_t why_size)
{
    st_spec *specs = calloc(n ? n : 1, sizeof(*specs));
    range *rg = calloc(n ? n : 1, sizeof(*rg));
    st_writer *w = NULL;
    dl_error err;
    int rc = -1;
    size_t nr = 0;

    if (specs == NULL || rg == NULL) {
        snprintf(why, why_size, "out of memory");
        goto out;
    }
    for (size_t k = 0; k < n; k++)
        specs[k] = (st_spec){ts[k]->name, ts[k]->name_len, ts[k]->dtype, ts[k]->ndim, ts[k]->shape};
    if (st_writer_open(path, specs, n, meta, nmeta, &w, &err) != 0) {
        snprintf(why, why_size, "%.300s", err.message);
        goto out;
    }
    st_writer_set_durable(w, 0);
    for (size_t k = 0; k < n; k++) {
        range x = {srcs[k], srcs[k]->data_start + ts[k]->begin, st_writer_data_offset(w, k), st_tensor_bytes(ts[k])};
        if (x.len > 0)
            rg[nr++] = x;
    }
    qsort(rg, nr, sizeof(*rg), range_cmp);
    size_t m = 0;
    for (size_t k = 0; k < nr; k++) {
        if (m > 0 && rg[m - 1].s == rg[k].s && rg[m - 1].src + rg[m - 1].len == rg[k].src &&
            rg[m - 1].dst + rg[m - 1].len == rg[k].dst)
            rg[m - 1].len += rg[k].len;
        else
            rg[m++] = rg[k];
    }
    for (size_t k = 0; k < m; k++) {
        s3s_req q = S3S_REQ_INIT;
        s3s_resp r;
        renew_if_due(c, step, shard, epoch, fenced);
        if (*fenced || cl_stopping(c)) {
            snprintf(why, why_size, *fenced ? "fenced out" : "stopping");
            goto out;
        }
        q.method = "GET";
        q.rel = rg[k].s->rel;
        q.if_match = rg[k].s->etag[0] ? rg[k].s->etag : NULL;
        q.range_off = rg[k].src;
        q.range_len = rg[k].len;
        q.dst_fd = st_writer_fd(w);
        q.dst_off = rg[k].dst;
        int got = s3s_do(&c->s3, &q, &r, why, why_size);
        if (got == 0 && r.status != 206 && r.status != 200) {
            s3s_describe(&r, why, why_size);
            /* the object is not the one listed any more (rewritten, removed): no retry brings it back */
            got = r.status == 412 || r.status == 404 ? -3 : -1;
        }
        s3s_resp_free(&r);
        if (got != 0) {
            char inner[200];
            snprintf(inner, sizeof(inner), "%s", why);
            snprintf(why, why_size, "reading %s: %s%s", rg[k].s->rel, inner,
                     got == -3 ? " (it changed since the manifest listed it)" : "");
            rc = got;
            goto out;
        }
        pthread_mutex_lock(&c->mu);
        c->sv[shard].bytes_read += rg[k].len;
        c->bytes_read += rg[k].len;
        pthread_mutex_unlock(&c->mu);
    }
    rc = st_writer_commit(w, &err);
    w = NULL;
    if (rc != 0)
        snprintf(why, why_size, "%.300s", err.message);
out:
    if (w != NULL)
        st_writer_abort(w);
    free(specs);
    free(rg);
    return rc;
}

/* GET of a whole object into path.  1 read, 0 absent, -1 failed (why). */
static int fetch_whole(cluster *c, const char *rel, const char *path, uint32_t shard, char *why, size_t why_size)
{
    s3s_req q = S3S_REQ_INIT;
    s3s_resp r;
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    int rc = -1;

    if (fd < 0) {
        snprintf(why, why_size, "%.300s: %.300s", path, strerror(errno));
        return -1;
    }
    /* the size first: a file body must be exactly as long as asked */
    q.method = "HEAD";
    q.rel = rel;
    if (s3s_do(&c->s3, &q, &r, why, why_size) != 0)
        goto out;
    if (r.status == 404) {
        rc = 0;
        goto out;
    }
    if (r.status != 200 || r.total == 0) {
        s3s_describe(&r, why, why_size);
        goto out;
    }
    char etag[80];
    snprintf(etag, sizeof(etag), "%s", r.etag);
    q.method = "GET";
    q.if_match = etag[0] ? etag : NULL;
    q.range_off = 0;
    q.range_len = r.total;
    q.dst_fd = fd;
    s3s_resp_free(&r);
    if (s3s_do(&c->s3, &q, &r, why, why_size) != 0)
        goto out;
    if (r.status != 206 && r.status != 200) {
        s3s_describe(&r, why, why_size);
        goto out;
    }
    pthread_mutex_lock(&c->mu);
    c->sv[shard].bytes_read += r.got;
    c->bytes_read += r.got;
    pthread_mutex_unlock(&c->mu);
    rc = 1;
out:
    s3s_resp_free(&r);
    close(fd);
    return rc;
}

/* ---- a shard -------------------------------------------------------------------------------------- */

typedef struct shard_io {
    char dir[600];
    char global[700], momentum[700], out_global[700], out_momentum[700];
    char **deltas;
    size_t ndeltas;
} shard_io;

static void shard_io_free(shard_io *io)
{
    for (size_t k = 0; k < io->ndeltas; k++)
        free(io->deltas[k]);
    free(io->deltas);
    if (io->dir[0])
        store_remove_tree(io->dir);
}

/* Delta d's tensors of shard i: its floating keys (and their scales) in the global's order. */
static size_t delta_tensors(const gmodel *g, uint32_t i, const st_header *dh, const cz_spec *cz, const st_tensor **out)
{
    size_t n = 0;
    for (size_t t = 0; t < g->h->ntensors; t++) {
        const st_tensor *gt = &g->h->tensors[t];
        if (g->shard_of[t] != i || !st_dtype_is_floating(gt->dtype))
            continue;
        const st_tensor *x = st_header_find(dh, gt->name, gt->name_len);
        if (x == NULL)
            continue;
        out[n++] = x;
        const st_tensor *sc = cz->enc != CZ_NONE ? delta_scales_of(dh, x) : NULL;
        if (sc != NULL)
            out[n++] = sc;
    }
    return n;
}

/* The previous global's shard i: its tensors from whichever of its files hold them (one file when the
 * previous global was published in this plan; a plain file or a layout of another plan otherwise). */
int cl_fetch_global_slice(cluster *c, uint32_t i, const char *path, int *fenced, uint64_t step, unsigned epoch,
                              char *why, size_t why_size)
{
    gmodel *g = &c->g;
    size_t n = g->h->ntensors, k = 0;
    const st_tensor **ts = calloc(n ? n : 1, sizeof(*ts));
    const source **srcs = calloc(n ? n : 1, sizeof(*srcs));
    int rc = -1;

    if (ts != NULL && srcs != NULL) {
        for (size_t t = 0; t < n; t++) {
            if (g->shard_of[t] != i)
                continue;
            const st_tensor *gt = &g->h->tensors[t];
            srcs[k] = &g->src[g->src_of[t]];
            ts[k] = st_header_find(srcs[k]->h, gt->name, gt->name_len);
            k++;
        }
        rc = build_slice(c, path, srcs, ts, k, NULL, 0, i, fenced, step, epoch, why, why_size);
    }
    free(ts);
    free(srcs);
    return rc;
}

typedef struct pass_thread {
    outer_pass *p;
    atomic_int *left;
} pass_thread;

static void *pass_main(void *arg)
{
    pass_thread *t = arg;
    outer_run(t->p);
    atomic_fetch_sub(t->left, 1);
    return NULL;
}

/* The pass over the slices on cfg.threads threads, our claim renewed meanwhile.  0, -DL_E_NON_FINITE (the
 * step overflowed: stats still set), or another failure (why). */
static int run_pass(cluster *c, shard_io *io, int have_momentum, uint64_t step, uint32_t i, unsigned epoch,
                    int *fenced, outer_node_stats *stats, char *why, size_t why_size)
{
    outer_pass p;
    dl_error err;
    char step_text[32];
    st_kv meta[2];
    unsigned nt = c->cfg.threads ? c->cfg.threads : 1;
    pthread_t *th = calloc(nt, sizeof(*th));
    pass_thread pt;
    atomic_int left;
    float *scales = NULL;
    int rc;

    if (th == NULL)
        return -1;
    memset(&p, 0, sizeof(p));
    snprintf(step_text, sizeof(step_text), "%" PRIu64, step);
    meta[0] = (st_kv){"optimizer", c->cfg.optimizer};
    meta[1] = (st_kv){"outer_step", step_text};
    p.global_path = io->global;
    p.momentum_path = have_momentum ? io->momentum : NULL;
    p.delta_paths = (const char *const *)io->deltas;
    p.ndeltas = io->ndeltas;
    p.out_global_path = io->out_global;
    p.out_momentum_path = c->cfg.momentum != 0 ? io->out_momentum : NULL;
    p.momentum_meta = meta;
    p.momentum_nmeta = 2;
    p.params.rule = c->cfg.rule;
    p.params.trim_k = c->cfg.trim_k;
    /* weighted_mean's a_k from the manifest's deltas (their headers, which every aggregator read and the
     * manifest pins by hash): every shard, on any aggregator, scales by the same bits */
    if (c->cfg.rule == OUTER_RULE_WEIGHTED) {
        double *w = malloc((io->ndeltas ? io->ndeltas : 1) * sizeof(*w));
        if (w == NULL || (scales = malloc((io->ndeltas ? io->ndeltas : 1) * sizeof(*scales))) == NULL) {
            free(w);
            free(th);
            snprintf(why, why_size, "out of memory");
            return -1;
        }
        for (size_t k = 0; k < io->ndeltas; k++)
            w[k] = c->m[k].weight;
        int wrc = weights_scales(w, io->ndeltas, c->cfg.max_weight_ratio, scales);
        free(w);
        if (wrc != 0) {
            free(scales);
            free(th);
            snprintf(why, why_size, "out of memory");
            return -1;
        }
        p.delta_scale = scales;
    }
    p.params.nesterov = strcmp(c->cfg.optimizer, "nesterov_sgd") == 0;
    p.params.lr = (float)c->cfg.lr;
    p.params.momentum = (float)c->cfg.momentum;
    p.budget_bytes = c->cfg.budget_bytes;
    p.defer_sync = 1;
    rc = outer_prepare(&p, &err);
    if (rc == 0) {
        atomic_init(&left, (int)nt);
        pt = (pass_thread){&p, &left};
        unsigned started = 0;
        for (; started < nt; started++)
            if (pthread_create(&th[started], NULL, pass_main, &pt) != 0)
                break;
        atomic_fetch_sub(&left, (int)(nt - started));
        if (started == 0)
            outer_run(&p);
        while (atomic_load(&left) > 0) {
            renew_if_due(c, step, i, epoch, fenced);
            if (*fenced || cl_stopping(c))
                outer_abort(&p);
            struct timespec ts = {0, 20 * 1000 * 1000};
            nanosleep(&ts, NULL);
        }
        for (unsigned k = 0; k < started; k++)
            pthread_join(th[k], NULL);
    }
    dl_error ferr;
    int frc = outer_finish(&p, &ferr);
    if (rc == 0 && frc != 0) {
        rc = frc;
        err = ferr;
    }
    /* a non-finite output still read every element: its statistics are whole (the overflow's verdict) */
    if ((rc == 0 || (rc == -DL_E_NON_FINITE && !*fenced && !cl_stopping(c))) && stats != NULL && p.stats != NULL)
        memcpy(stats, p.stats, io->ndeltas * sizeof(*stats));
    if (rc != 0)
        snprintf(why, why_size, "%.300s%.300s", *fenced ? "fenced out: " : "", err.message[0] ? err.message : "the pass failed");
    outer_free(&p);
    free(scales);
    free(th);
    return rc;
}

/* Uploads path as rel, written once: 0 when rel holds exactly our bytes (ours, or an identical earlier
 * writer's), -1 failed, -2 rel holds other bytes (a conflict no retry mends). */
int cl_put_once(cluster *c, const char *rel, const char *path, char md5[33], uint64_t *size, char *why,
                size_t why_size)
{
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    struct stat sb;
    s3s_req q = S3S_REQ_INIT;
    s3s_resp r;
    int rc = -1;

    memset(&r, 0, sizeof(r));
    if (fd < 0 || fstat(fd, &sb) != 0) {
        snprintf(why, why_size, "%.300s: %.300s", path, strerror(errno));
        if (fd >= 0)
            close(fd);
        return -1;
    }
    if (remote_hash_fd(fd, REMOTE_MD5, NULL, 0, md5, 33) != 0) {
        snprintf(why, why_size, "hashing %s failed", path);
        goto out;
    }
    *size = (uint64_t)sb.st_size;
    q.method = "PUT";
    q.rel = rel;
    q.src_fd = fd;
    q.src_len = (uint64_t)sb.st_size;
    q.if_none_match = 1;
    if (s3s_do(&c->s3, &q, &r, why, why_size) != 0)
        goto out;
    if (r.status == 200 && strcmp(r.etag, md5) == 0) {
        cl_count(c, &c->bytes_written, (uint64_t)sb.st_size);
        rc = 0;
        goto out;
    }
    if (r.status != 412 && r.status != 200) {
        s3s_describe(&r, why, why_size);
        goto out;
    }
    /* it exists: the same bytes (MD5 = a single PUT's ETag) are as good as ours */
    s3s_resp_free(&r);
    q = (s3s_req)S3S_REQ_INIT;
    q.method = "HEAD";
    q.rel = rel;
    if (s3s_do(&c->s3, &q, &r, why, why_size) != 0)
        goto out;
    if (r.status == 200 && strcmp(r.etag, md5) == 0 && r.total == (uint64_t)sb.st_size) {
        rc = 0;
        goto out;
    }
    snprintf(why, why_size, "%s already holds other bytes (ETag %s, ours %s)", rel, r.etag, md5);
    rc = -2;
out:
    s3s_resp_free(&r);
    close(fd);
    return rc;
}

long cl_test_hook(const char *name)
{
    const char *v = getenv(name);
    char *end;
    if (v == NULL || *v == '\0')
        return -1;
    long x = strtol(v, &end, 10);
    return *end == '\0' && x >= 0 ? x : -1;
}

static int read_done(cluster *c, uint64_t step, uint32_t i, double *sumsq, char *etag, size_t etag_size, char *why,
                     size_t why_size);

/* A statistic as JSON: never inf nor nan, which are not JSON (a marker holding one was refused by every
 * reader, and the step stalled).  A sum of squares that overflowed saturates at the largest double, the
 * order the overflow's verdict needs; a dot product that did is null (nothing reads it). */
static void sb_stat(sbuf *b, double v, int saturate)
{
    if (isfinite(v))
        sb_printf(b, "%.17g", v);
    else if (saturate)
        sb_str(b, "1.7976931348623157e308");
    else
        sb_str(b, "null");
}

/* Ends the marker b (its fields up to "stats": ) with the per-node statistics and writes it as drel, once: a
 * marker already there is ours or another's of the same shard (either is the shard), or one that does not
 * hold (a writer's, or of a build that wrote inf), which is replaced, If-Match on its ETag.  0 or -1 (why). */
static int write_marker(cluster *c, uint64_t step, uint32_t i, const char *drel, sbuf *b, const outer_node_stats *stats,
                        char *why, size_t why_size)
{
    s3s_resp r;
    sb_str(b, "[");
    for (size_t k = 0; k < c->nm; k++) {
        sb_str(b, k ? ", [" : "[");
        sb_stat(b, stats[k].sumsq, 1);
        sb_str(b, ", ");
        sb_stat(b, stats[k].dot, 0);
        sb_str(b, "]");
    }
    sb_str(b, "]}\n");
    if (b->oom) {
        snprintf(why, why_size, "out of memory");
        return -1;
    }
    long st = cl_put_small(c, drel, b->p, b->len, NULL, 1, &r, why, why_size);
    s3s_resp_free(&r);
    if (st == 412) {
        char etag[80] = "";
        int d = read_done(c, step, i, NULL, etag, sizeof(etag), why, why_size);
        if (d == -1 && etag[0]) {
            dl_log(DL_LOG_WARN, "cluster", "replacing a done marker that does not hold", "step=%" PRIu64
                   " shard=%" PRIu32 " why=%s", step, i, why);
            st = cl_put_small(c, drel, b->p, b->len, etag, 0, &r, why, why_size);
            s3s_resp_free(&r);
        } else if (d != 1 && d != 2) {
            return -1;
        }
    }
    return st == 200 || st == 412 ? 0 : -1;
}

/* The pass over shard i made a non-finite value from finite deltas (their mean, the momentum or the step
 * overflowed): nothing is written but the shard's marker, which says so and carries the per-node sums of
 * squares, so that once every shard has its marker anyone can name the delta of largest norm (the
 * overflow's refusal, s3_cluster.c) from the same numbers.  0 or -1 (why). */
static int shard_overflowed(cluster *c, uint64_t step, uint32_t i, unsigned epoch, const outer_node_stats *stats,
                            char *why, size_t why_size)
{
    char *drel = NULL;
    sbuf b = {0};
    int rc = -1;

    dl_log(DL_LOG_WARN, "cluster", "the shard's step overflowed: no output, the round's verdict waits for every shard",
           "step=%" PRIu64 " shard=%" PRIu32 " why=%s", step, i, why);
    if ((drel = cl_done_rel(step, c->gen, i)) == NULL)
        goto out;
    sb_printf(&b, "{\"outer_step\": %" PRIu64 ", \"shard\": %" PRIu32 ", \"instance\": \"%s\", \"epoch\": %u, "
              "\"overflow\": true, \"stats\": ", step, i, c->instance, epoch);
    if (write_marker(c, step, i, drel, &b, stats, why, why_size) != 0)
        goto out;
    cl_shard_set(c, i, SH_DONE, epoch, -1);
    rc = 0;
out:
    free(drel);
    free(b.p);
    return rc;
}

/* Node k's delta's slice of shard i into path, its values checked against the global's slice header gh as
 * intake checks a whole delta (finite, decodable).  0, -1 failed (why), -3 its values are refused, or it
 * is not the version the manifest names any more (why). */
int cl_slice_and_check(cluster *c, const char *path, const st_header *gh, size_t k, uint32_t i, uint64_t step,
                           unsigned epoch, int *fenced, char *why, size_t why_size)
{
    node_delta *d = &c->m[k];
    if (d->gone) {
        snprintf(why, why_size, "node %.100s's delta %.300s is not the version the manifest names (HTTP %ld)", d->node,
                 d->s.rel, d->s.status);
        return -3;
    }
    delta_info info;
    dl_error err;
    const st_meta *mm = d->s.h->meta;
    st_kv *kv = calloc(d->s.h->nmeta ? d->s.h->nmeta : 1, sizeof(*kv));
    const st_tensor **ts = calloc(d->s.h->ntensors ? d->s.h->ntensors : 1, sizeof(*ts));
    const source **srcs = calloc(d->s.h->ntensors ? d->s.h->ntensors : 1, sizeof(*srcs));
    st_file *df = NULL;
    int rc = -1;

    if (kv == NULL || ts == NULL || srcs == NULL) {
        snprintf(why, why_size, "out of memory");
        goto out;
    }
    memset(&info, 0, sizeof(info));
    for (size_t x = 0; x < d->s.h->nmeta; x++)
        kv[x] = (st_kv){mm[x].key, mm[x].value};
    cz_spec cz = {0};
    if (st_header_meta(d->s.h, "encoding", NULL) != NULL &&
        delta_check_meta(d->s.h->meta, d->s.h->nmeta, NULL, &info, &err) == 0)
        cz = info.cz;
    size_t nt = delta_tensors(&c->g, i, d->s.h, &cz, ts);
    for (size_t x = 0; x < nt; x++)
        srcs[x] = &d->s;
    /* a delta rewritten or removed since the manifest is refused like one whose values are */
    if ((rc = build_slice(c, path, srcs, ts, nt, kv, d->s.h->nmeta, i, fenced, step, epoch, why, why_size)) != 0) {
        rc = rc == -3 ? -3 : -1;
        goto out;
    }
    rc = -1;
    if (st_open(path, &df, &err) != 0) {
        snprintf(why, why_size, "%.300s", err.message);
        goto out;
    }
    if (delta_validate(df, gh, NULL, &info, &err) != 0) {
        snprintf(why, why_size, "node %.100s's delta %.300s: %.300s%.20s%.200s", d->node, d->s.rel, err.message,
                 err.tensor[0] ? " tensor=" : "", err.tensor);
        rc = -3;
        goto out;
    }
    rc = 0;
out:
    st_close(df);
    free(kv);
    free(ts);
    free(srcs);
    return rc;
}

/* Computes and completes shard i, whose claim we hold.  0 done (by us or, meanwhile, another), -1 failed
 * for now (the claim expires and anyone tries again), -2 refused for good (a conflict, a missing momentum),
 * -3 the values of the manifest's delta *bad are refused (aggregate() writes the refusal). */
int cl_shard_work(cluster *c, uint64_t step, uint32_t i, unsigned epoch, size_t *bad)
{
    shard_io io;
    char why[1024];
    int fenced = 0, rc = -1, have_momentum = 0;
    outer_node_stats *stats = calloc(c->nm ? c->nm : 1, sizeof(*stats));
    char gmd5[33] = "", mmd5[33] = "";
    uint64_t gsize = 0, msize = 0;
    char *out_rel = NULL, *mom_rel = NULL, *prev_mom = NULL, *drel = NULL;
    sbuf b = {0};
    st_file *gf = NULL;
    dl_error err;

    memset(&io, 0, sizeof(io));
    c->last_renew = cl_mono();
    double t0 = c->last_renew, t_read = 0, t_pass = 0;
    cl_shard_set(c, i, SH_OURS, epoch, 0);
    why[0] = '\0';
    if (stats == NULL)
        goto out;
    if (c->stall_shard == (long)i) {
        dl_log(DL_LOG_WARN, "cluster", "test hook: stalling while holding the claim", "shard=%" PRIu32, i);
        cl_nap(c, 3600);
        goto out;
    }
    snprintf(io.dir, sizeof(io.dir), "%s/%" PRIu64 "-%" PRIu32, c->scratch, step, i);
    store_remove_tree(io.dir);
    if (fsu_mkdirs(io.dir, &err) != 0) {
        snprintf(why, sizeof(why), "%.300s", err.message);
        goto out;
    }
    snprintf(io.global, sizeof(io.global), "%s/global.safetensors", io.dir);
    snprintf(io.momentum, sizeof(io.momentum), "%s/momentum.safetensors", io.dir);
    snprintf(io.out_global, sizeof(io.out_global), "%s/out-global.safetensors", io.dir);
    snprintf(io.out_momentum, sizeof(io.out_momentum), "%s/out-momentum.safetensors", io.dir);
    if (cl_fetch_global_slice(c, i, io.global, &fenced, step, epoch, why, sizeof(why)) != 0)
        goto out;
    if (c->g.ours && c->cfg.momentum != 0) {
        /* the previous step's momentum shard: a cluster always writes it */
        if ((prev_mom = cl_momentum_rel(c->g.step, c->g.gen, i, c->cfg.shards)) == NULL)
            goto out;
        int got = fetch_whole(c, prev_mom, io.momentum, i, why, sizeof(why));
        if (got < 0)
            goto out;
        if (got == 0) {
            snprintf(why, sizeof(why), "the momentum of step %" PRIu64 " (%s) is missing", c->g.step, prev_mom);
            rc = -2;
            goto out;
        }
        have_momentum = 1;
    }
    if (st_open(io.global, &gf, &err) != 0) {
        snprintf(why, sizeof(why), "%.300s", err.message);
        goto out;
    }
    if ((io.deltas = calloc(c->nm ? c->nm : 1, sizeof(*io.deltas))) == NULL)
        goto out;
    for (size_t k = 0; k < c->nm; k++) {
        if ((io.deltas[k] = cl_rel_printf("%s/delta-%zu.safetensors", io.dir, k)) == NULL)
            goto out;
        io.ndeltas = k + 1;
        int v = cl_slice_and_check(c, io.deltas[k], gf->h, k, i, step, epoch, &fenced, why, sizeof(why));
        if (v == -3) {
            *bad = k;
            rc = -3;
        }
        if (v != 0)
            goto out;
    }
    st_close(gf);
    gf = NULL;
    t_read = cl_mono();
    int pass = run_pass(c, &io, have_momentum, step, i, epoch, &fenced, stats, why, sizeof(why));
    if (pass == -DL_E_NON_FINITE && !fenced && !cl_stopping(c)) {
        if (claim_renew(c, step, i, epoch) != 0) {
            fenced = 1;
            snprintf(why, sizeof(why), "fenced out: the claim is another's now");
            goto out;
        }
        rc = shard_overflowed(c, step, i, epoch, stats, why, sizeof(why));
        goto out;
    }
    if (pass != 0)
        goto out;
    t_pass = cl_mono();
    if (c->stall_after_pass == (long)i) {
        dl_log(DL_LOG_WARN, "cluster", "test hook: pausing after the pass", "shard=%" PRIu32, i);
        cl_nap(c, 2);
    }
    /* fencing: our claim must still be ours right before anything is written */
    if (claim_renew(c, step, i, epoch) != 0) {
        fenced = 1;
        snprintf(why, sizeof(why), "fenced out: the claim is another's now");
        goto out;
    }
    if ((out_rel = cl_output_rel(step, c->gen, i, c->cfg.shards)) == NULL || (mom_rel = cl_momentum_rel(step, c->gen, i, c->cfg.shards)) == NULL ||
        (drel = cl_done_rel(step, c->gen, i)) == NULL)
        goto out;
    int prc = cl_put_once(c, out_rel, io.out_global, gmd5, &gsize, why, sizeof(why));
    if (prc == 0 && c->cfg.momentum != 0)
        prc = cl_put_once(c, mom_rel, io.out_momentum, mmd5, &msize, why, sizeof(why));
    if (prc != 0) {
        rc = prc;
        goto out;
    }
    sb_printf(&b, "{\"outer_step\": %" PRIu64 ", \"shard\": %" PRIu32 ", \"instance\": \"%s\", \"epoch\": %u, "
              "\"global_md5\": \"%s\", \"global_size\": %" PRIu64 ", \"momentum_md5\": \"%s\", \"stats\": ",
              step, i, c->instance, epoch, gmd5, gsize, mmd5);
    if (write_marker(c, step, i, drel, &b, stats, why, sizeof(why)) != 0)
        goto out;
    cl_count(c, &c->shards_done, 1);
    double t_end = cl_mono();
    dl_log(DL_LOG_INFO, "cluster", "shard done", "step=%" PRIu64 " shard=%" PRIu32 " epoch=%u bytes_read=%" PRIu64
           " read_s=%.3f pass_s=%.3f write_s=%.3f", step, i, epoch, c->sv[i].bytes_read, t_read - t0, t_pass - t_read,
           t_end - t_pass);
    pthread_mutex_lock(&c->mu);
    c->read_s += t_read - t0;
    c->pass_s += t_pass - t_read;
    c->write_s += t_end - t_pass;
    pthread_mutex_unlock(&c->mu);
    cl_shard_set(c, i, SH_DONE, epoch, -1);
    rc = 0;
out:
    if (rc != 0 && !cl_stopping(c)) {
        if (fenced) {
            cl_count(c, &c->fenced, 1);
            dl_log(DL_LOG_WARN, "cluster", "fenced out of a shard: its late work is dropped", "step=%" PRIu64
                   " shard=%" PRIu32 " epoch=%u", step, i, epoch);
            cl_shard_set(c, i, SH_FOREIGN, epoch, -1);
        } else {
            cl_shard_set(c, i, SH_UNCLAIMED, epoch, -1);
        }
        if (!fenced && why[0]) {
            dl_log(rc <= -2 ? DL_LOG_ERROR : DL_LOG_WARN, "cluster", rc <= -2 ? "shard refused" : "shard failed",
                   "step=%" PRIu64 " shard=%" PRIu32 " why=%s", step, i, why);
            cl_fail_view(c, "step %" PRIu64 " shard %" PRIu32 ": %s", step, i, why);
        }
    }
    st_close(gf);
    free(stats);
    free(out_rel);
    free(mom_rel);
    free(prev_mom);
    free(drel);
    free(b.p);
    shard_io_free(&io);
    return rc;
}

/* Shard i's done marker: 1 a valid one, its output there as it names it, 2 a valid one of a pass that
 * overflowed (no output), either with its per-node sums of squares added to sumsq when not NULL; 0 none, -1
 * one that does not hold (etag set: a writer's garbage, replaced by whoever completes the shard), -2 unknown
 * for now (why). */
/* The marker's per-node sums of squares (indexed by the manifest's nodes: the caller checked the count),
 * each a finite number >= 0, added to sumsq when not NULL, saturating: 0, or -1 when one is not. */
static int marker_sums(const cluster *c, const cJSON *stats, double *sumsq)
{
    for (size_t k = 0; k < c->nm; k++) {
        const cJSON *x = cJSON_GetArrayItem(cJSON_GetArrayItem(stats, (int)k), 0);
        if (!cJSON_IsNumber(x) || !(x->valuedouble >= 0) || !isfinite(x->valuedouble))
            return -1;
    }
    for (size_t k = 0; sumsq != NULL && k < c->nm; k++) {
        double v = sumsq[k] + cJSON_GetArrayItem(cJSON_GetArrayItem(stats, (int)k), 0)->valuedouble;
        sumsq[k] = isfinite(v) ? v : DBL_MAX;
    }
    return 0;
}

static int read_done(cluster *c, uint64_t step, uint32_t i, double *sumsq, char *etag, size_t etag_size, char *why,
                     size_t why_size)
{
    char *drel = cl_done_rel(step, c->gen, i), *orel = cl_output_rel(step, c->gen, i, c->cfg.shards);
    s3s_resp r;
    int rc = -2;

    memset(&r, 0, sizeof(r));
    if (drel == NULL || orel == NULL)
        goto out;
    int got = cl_get_small(c, drel, 1024 + 96 * c->nm, &r, why, why_size);
    if (etag != NULL)
        snprintf(etag, etag_size, "%s", r.etag);
    if (got <= 0) {
        /* absent, or unreadable: over its cap (an answer 200) is a writer's garbage, else a failure for now */
        rc = got == 0 ? 0 : r.status == 200 ? -1 : -2;
        goto out;
    }
    rc = -1;
    cJSON *j = cJSON_ParseWithLength(r.body.p, r.body.len);
    const char *md5 = cl_json_str(j, "global_md5");
    const cJSON *stats = cJSON_GetObjectItemCaseSensitive(j, "stats");
    int overflow = cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(j, "overflow"));
    uint64_t size = 0, st = 0, sh = 0;
    char want[33];
    if ((!overflow && (md5 == NULL || cl_json_u64(j, "global_size", &size) != 0 || strlen(md5) != 32)) ||
        cl_json_u64(j, "outer_step", &st) != 0 || cl_json_u64(j, "shard", &sh) != 0 || st != step || sh != i ||
        !cJSON_IsArray(stats) || cJSON_GetArraySize(stats) != (int)c->nm || marker_sums(c, stats, sumsq) != 0) {
        snprintf(why, why_size, "%s is not a done marker of this step and manifest", drel);
        cJSON_Delete(j);
        goto out;
    }
    if (overflow) {
        cJSON_Delete(j);
        rc = 2;
        goto out;
    }
    snprintf(want, sizeof(want), "%s", md5);
    cJSON_Delete(j);
    s3s_resp_free(&r);
    s3s_req q = S3S_REQ_INIT;
    q.method = "HEAD";
    q.rel = orel;
    if (s3s_do(&c->s3, &q, &r, why, why_size) != 0) {
        rc = -2;
        goto out;
    }
    if (r.status != 200 || strcmp(r.etag, want) != 0 || r.total != size) {
        snprintf(why, why_size, "%s is not the output its done marker names", orel);
        rc = r.status == 200 || r.status == 404 ? -1 : -2;
        goto out;
    }
    rc = 1;
out:
    s3s_resp_free(&r);
    free(drel);
    free(orel);
    return rc;
}

/* Whether shard i is done (its output, or its overflow, marked): 1 yes, 0 no (no marker, or one that does not
 * hold: the shard is computed again), -1 unknown. */
int cl_shard_is_done(cluster *c, uint64_t step, uint32_t i)
{
    char why[1024];
    int d = read_done(c, step, i, NULL, NULL, 0, why, sizeof(why));
    return d == 1 || d == 2 ? 1 : d == -2 ? -1 : 0;
}

/* Checks every done marker against its output and sums the per-node statistics in shard order.  0, with
 * *overflowed the number of shards whose pass overflowed (then the step has no output to publish), or -1. */
int cl_check_outputs(cluster *c, uint64_t step, double *sumsq, uint32_t *overflowed, char *why, size_t why_size)
{
    *overflowed = 0;
    for (uint32_t i = 0; i < c->cfg.shards; i++) {
        int d = read_done(c, step, i, sumsq, NULL, 0, why, why_size);
        if (d != 1 && d != 2)
            return -1;
        *overflowed += d == 2;
    }
    return 0;
}
