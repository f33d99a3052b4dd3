/* s3_cluster_bucket: the cluster's requests to the bucket, the names of its objects, and the published
 * global it builds on (its headers and the shard plan).  See s3_cluster_internal.h. */
#include "s3_cluster_internal.h"

#include <errno.h>
#include <fcntl.h>
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

/* ---- small things ----------------------------------------------------------------------------- */

double cl_mono(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec / 1e9;
}

int cl_stopping(cluster *c) { return atomic_load(&c->stop) != 0; }

void cl_nap(cluster *c, double seconds)
{
    for (double t0 = cl_mono(); !cl_stopping(c) && cl_mono() - t0 < seconds;) {
        struct timespec ts = {0, 20 * 1000 * 1000};
        nanosleep(&ts, NULL);
    }
}

/* The pipeline's phase of a state the view shows (s3_cluster.h, cluster_phase), -1 for none. */
static int phase_of(const char *state)
{
    return strcmp(state, "collecting") == 0    ? CLUSTER_PHASE_COLLECTING
           : strcmp(state, "aggregating") == 0 ? CLUSTER_PHASE_SHARDS
           : strcmp(state, "publishing") == 0  ? CLUSTER_PHASE_PUBLISH
           : strcmp(state, "refused") == 0     ? CLUSTER_PHASE_REFUSED
                                               : -1;
}

void cl_set_state(cluster *c, const char *state)
{
    int phase = phase_of(state);

    pthread_mutex_lock(&c->mu);
    c->state = state;
    pthread_mutex_unlock(&c->mu);
    /* c->step is the thread's to write: read here without the lock */
    if (phase >= 0 && c->step > 0)
        cl_phase(c, (uint64_t)c->step, (cluster_phase)phase);
}

void cl_fail_view(cluster *c, const char *fmt, ...)
{
    va_list ap;
    pthread_mutex_lock(&c->mu);
    va_start(ap, fmt);
    vsnprintf(c->last_error, sizeof(c->last_error), fmt, ap);
    va_end(ap);
    pthread_mutex_unlock(&c->mu);
}

void cl_count(cluster *c, uint64_t *field, uint64_t n)
{
    pthread_mutex_lock(&c->mu);
    *field += n;
    pthread_mutex_unlock(&c->mu);
}

void cl_shard_set(cluster *c, uint32_t i, int state, unsigned epoch, double age)
{
    pthread_mutex_lock(&c->mu);
    c->sv[i].state = state;
    c->sv[i].epoch = epoch;
    c->sv[i].lease_age = age;
    pthread_mutex_unlock(&c->mu);
}

void cl_source_free(source *s)
{
    free(s->rel);
    st_header_free(s->h);
    memset(s, 0, sizeof(*s));
}

void cl_gmodel_free(gmodel *g)
{
    for (size_t i = 0; i < g->nsrc; i++)
        cl_source_free(&g->src[i]);
    free(g->src);
    st_header_free(g->h);
    free(g->src_of);
    free(g->src_off);
    free(g->shard_of);
    memset(g, 0, sizeof(*g));
}

char *cl_rel_printf(const char *fmt, ...)
{
    char buf[512];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(buf, sizeof(buf), fmt, ap);
    va_end(ap);
    return n > 0 && (size_t)n < sizeof(buf) ? strdup(buf) : NULL;
}

int cl_sha256_hex(const void *p, size_t n, char out[65])
{
    return remote_hash_mem(p, n, REMOTE_SHA256, NULL, 0, out, 65);
}

/* ---- names ------------------------------------------------------------------------------------- */

/* global/steps/<step>/<stem>[.g<gen>]<suffix>: every object of a generation after the first has its own
 * name, so that nothing of a manifest a refusal replaced is taken for the new one's */
static char *step_rel(uint64_t step, const char *stem, unsigned gen, const char *suffix)
{
    if (gen == 0)
        return cl_rel_printf("global/steps/%" PRIu64 "/%s%s", step, stem, suffix);
    return cl_rel_printf("global/steps/%" PRIu64 "/%s.g%u%s", step, stem, gen, suffix);
}

static char *shard_rel(uint64_t step, unsigned gen, uint32_t i, const char *suffix)
{
    char stem[32];
    snprintf(stem, sizeof(stem), "shard-%" PRIu32, i);
    return step_rel(step, stem, gen, suffix);
}

char *cl_claim_rel(uint64_t step, unsigned gen, uint32_t i) { return shard_rel(step, gen, i, ".claim"); }
char *cl_manifest_rel(uint64_t step, unsigned gen) { return step_rel(step, "manifest", gen, ".json"); }
char *cl_refusal_rel(uint64_t step, unsigned gen) { return step_rel(step, "refused", gen, ".json"); }
char *cl_index_rel(uint64_t step, unsigned gen) { return step_rel(step, "model", gen, ST_INDEX_SUFFIX); }

char *cl_done_rel(uint64_t step, unsigned gen, uint32_t i) { return shard_rel(step, gen, i, ".done"); }

int cl_gen_base(const char *stem, unsigned gen, char *out, size_t size)
{
    int n = gen ? snprintf(out, size, "%s.g%u", stem, gen) : snprintf(out, size, "%s", stem);
    return n > 0 && (size_t)n < size ? 0 : -1;
}

char *cl_output_rel(uint64_t step, unsigned gen, uint32_t i, uint32_t n)
{
    char base[32], name[96];
    if (cl_gen_base("model", gen, base, sizeof(base)) != 0 || st_index_shard_name(base, i, n, name, sizeof(name)) != 0)
        return NULL;
    return cl_rel_printf("global/steps/%" PRIu64 "/%s", step, name);
}

char *cl_momentum_rel(uint64_t step, unsigned gen, uint32_t i, uint32_t n)
{
    char base[32], name[96];
    if (cl_gen_base("shard", gen, base, sizeof(base)) != 0 || st_index_shard_name(base, i, n, name, sizeof(name)) != 0)
        return NULL;
    return cl_rel_printf("state/momentum/%" PRIu64 "/%s", step, name);
}

/* ---- requests --------------------------------------------------------------------------------- */

/* A GET of rel into memory (at most cap bytes).  1: found (r filled), 0: 404, -1: failed (why). */
int cl_get_small(cluster *c, const char *rel, size_t cap, s3s_resp *r, char *why, size_t why_size)
{
    s3s_req q = S3S_REQ_INIT;
    q.method = "GET";
    q.rel = rel;
    q.body_cap = cap;
    if (s3s_do(&c->s3, &q, r, why, why_size) != 0)
        return -1;
    if (r->status == 404)
        return 0;
    if (r->status != 200) {
        s3s_describe(r, why, why_size);
        return -1;
    }
    return 1;
}

/* A PUT of a small body: the answer's status (0: none), r filled. */
long cl_put_small(cluster *c, const char *rel, const char *body, size_t len, const char *if_match, int if_none,
                      s3s_resp *r, char *why, size_t why_size)
{
    s3s_req q = S3S_REQ_INIT;
    q.method = "PUT";
    q.rel = rel;
    q.body = body;
    q.body_len = len;
    q.if_match = if_match;
    q.if_none_match = if_none;
    if (s3s_do(&c->s3, &q, r, why, why_size) != 0)
        return 0;
    return r->status;
}

/* Reads a safetensors header from rel (If-Match etag when given): the peek, then what it did not hold.
 * The object must be exactly 8 + N + the data the header describes.  0 or -1 (why). */
int cl_read_header(cluster *c, source *s, const char *etag, char *why, size_t why_size)
{
    s3s_req q = S3S_REQ_INIT;
    s3s_resp r;
    unsigned char *buf = NULL;
    uint64_t n, total;
    int rc = -1;
    dl_error err;

    q.method = "GET";
    q.rel = s->rel;
    q.if_match = etag && etag[0] ? etag : NULL;
    q.range_off = 0;
    q.range_len = PEEK_BYTES;
    q.body_cap = PEEK_BYTES;
    s->status = 0;
    if (s3s_do(&c->s3, &q, &r, why, why_size) != 0)
        goto out;
    s->status = r.status;
    if (r.status != 206 && r.status != 200) {
        s3s_describe(&r, why, why_size);
        goto out;
    }
    total = r.status == 200 ? r.got : r.total;
    if ((r.status == 206 && !r.has_total) || r.got < 8) {
        snprintf(why, why_size, "the object is too short for a safetensors header");
        goto out;
    }
    snprintf(s->etag, sizeof(s->etag), "%s", r.etag);
    s->size = total;
    memcpy(&n, r.body.p, 8);    /* little-endian hosts only, as the rest of dilocod */
    if (n > c->cfg.max_header || n > total - 8) {
        snprintf(why, why_size, "its header length %" PRIu64 " is over the cap or the object", n);
        goto out;
    }
    if ((buf = malloc(8 + n)) == NULL) {
        snprintf(why, why_size, "out of memory");
        goto out;
    }
    size_t have = r.got < 8 + n ? (size_t)r.got : (size_t)(8 + n);
    memcpy(buf, r.body.p, have);
    if (have < 8 + n) {
        s3s_resp r2;
        s3s_req q2 = S3S_REQ_INIT;
        q2.method = "GET";
        q2.rel = s->rel;
        q2.if_match = s->etag[0] ? s->etag : NULL;
        q2.range_off = have;
        q2.range_len = 8 + n - have;
        q2.body_cap = (size_t)q2.range_len;
        int got2 = s3s_do(&c->s3, &q2, &r2, why, why_size);
        s->status = r2.status;
        if (got2 != 0 || r2.status != 206 || r2.got != q2.range_len) {
            if (r2.status != 0)
                s3s_describe(&r2, why, why_size);
            s3s_resp_free(&r2);
            goto out;
        }
        memcpy(buf + have, r2.body.p, (size_t)r2.got);
        s3s_resp_free(&r2);
    }
    if (st_header_parse((const char *)buf + 8, (size_t)n, total, &s->h, &err) != 0) {
        snprintf(why, why_size, "%.300s", err.message);
        goto out;
    }
    s->data_start = 8 + n;
    if (cl_sha256_hex(buf, (size_t)(8 + n), s->header_sha) != 0) {
        snprintf(why, why_size, "hashing failed");
        goto out;
    }
    rc = 0;
out:
    free(buf);
    s3s_resp_free(&r);
    return rc;
}

/* The keys under rel_prefix (each relative to the transport's prefix), every page.  0 or -1. */
int cl_list_page(cluster *c, const char *full, const char *token, s3_listing *l, char *why, size_t why_size)
{
    char *query = s3_list_query(full, token, NULL, 1000);
    s3s_req q = S3S_REQ_INIT;
    s3s_resp r;
    dl_error err;

    memset(l, 0, sizeof(*l));
    if (query == NULL) {
        snprintf(why, why_size, "out of memory");
        return -1;
    }
    q.method = "GET";
    q.query = query;
    q.body_cap = S3_LIST_PAGE_CAP;
    int got = s3s_do(&c->s3, &q, &r, why, why_size);
    free(query);
    if (got != 0 || r.status != 200) {
        if (got == 0)
            s3s_describe(&r, why, why_size);
        s3s_resp_free(&r);
        return -1;
    }
    int rc = s3_parse_listing(r.body.p, r.body.len, l, &err);
    if (rc != 0)
        snprintf(why, why_size, "listing: %.300s", err.message);
    s3s_resp_free(&r);
    return rc != 0 ? -1 : 0;
}

int cl_list_keys(cluster *c, const char *rel_prefix, char ***keys, size_t *n, char *why, size_t why_size)
{
    char *token = NULL, *full = NULL;
    size_t pl = strlen(c->a.prefix);
    int rc = -1;

    *keys = NULL;
    *n = 0;
    full = pl ? cl_rel_printf("%s/%s", c->a.prefix, rel_prefix) : strdup(rel_prefix);
    if (full == NULL)
        return -1;
    for (unsigned page = 0; page < LIST_PAGES_MAX; page++) {
        s3_listing l;
        if (cl_list_page(c, full, token, &l, why, why_size) != 0)
            goto out;
        char **grown = realloc(*keys, (*n + l.n + 1) * sizeof(**keys));
        if (grown == NULL) {
            s3_listing_free(&l);
            goto out;
        }
        *keys = grown;
        for (size_t i = 0; i < l.n; i++) {
            const char *k = l.objs[i].key;
            if (pl && (strncmp(k, c->a.prefix, pl) != 0 || k[pl] != '/'))
                continue;
            char *rel = strdup(pl ? k + pl + 1 : k);
            if (rel == NULL)
                continue;
            (*keys)[(*n)++] = rel;
        }
        free(token);
        token = l.truncated && l.next_token ? strdup(l.next_token) : NULL;
        s3_listing_free(&l);
        if (token == NULL) {
            rc = 0;
            goto out;
        }
    }
    snprintf(why, why_size, "the listing of %s is longer than %u pages", rel_prefix, LIST_PAGES_MAX);
out:
    free(token);
    free(full);
    return rc;
}

void cl_keys_free(char **k, size_t n)
{
    for (size_t i = 0; i < n; i++)
        free(k[i]);
    free(k);
}

void cl_delete_key(cluster *c, const char *rel)
{
    s3s_req q = S3S_REQ_INIT;
    s3s_resp r;
    char why[200];
    q.method = "DELETE";
    q.rel = rel;
    if (s3s_do(&c->s3, &q, &r, why, sizeof(why)) != 0 || (r.status != 204 && r.status != 200 && r.status != 404))
        dl_log(DL_LOG_WARN, "cluster", "garbage collection: delete failed", "key=%s why=%s", rel, why);
    s3s_resp_free(&r);
}

/* ---- the published global ----------------------------------------------------------------------- */

/* The tensors of every source as one header (names unique across them), with where each comes from.  The
 * header is laid out as the reference writer lays out a file of these tensors (by alignment, then name),
 * so its order, and the plan cut from it, depend on the tensors alone, not on how they were sharded. */
static int gmodel_combine(gmodel *g, char *why, size_t why_size)
{
    size_t n = 0, k = 0;
    for (size_t i = 0; i < g->nsrc; i++)
        n += g->src[i].h->ntensors;
    st_spec *specs = calloc(n ? n : 1, sizeof(*specs));
    uint32_t *src_of = calloc(n ? n : 1, sizeof(*src_of));
    uint64_t *src_off = calloc(n ? n : 1, sizeof(*src_off));
    char *json = NULL;
    size_t jl = 0;
    dl_error err;
    int rc = -1;

    if (specs == NULL || src_of == NULL || src_off == NULL) {
        snprintf(why, why_size, "out of memory");
        goto out;
    }
    for (size_t i = 0; i < g->nsrc; i++) {
        const st_header *h = g->src[i].h;
        for (size_t t = 0; t < h->ntensors; t++, k++) {
            const st_tensor *x = &h->tensors[t];
            specs[k] = (st_spec){x->name, x->name_len, x->dtype, x->ndim, x->shape};
        }
    }
    uint64_t *offs = malloc((n ? n : 1) * 2 * sizeof(*offs)), dlen;
    if (offs == NULL) {
        snprintf(why, why_size, "out of memory");
        goto out;
    }
    int brc = st_header_build(specs, n, NULL, 0, &json, &jl, offs, &dlen, &err);
    free(offs);
    if (brc != 0 || st_header_parse_unsized(json, jl, &g->h, &err) != 0) {
        snprintf(why, why_size, "the global's tensors: %.300s", err.message);
        goto out;
    }
    if (g->h->ntensors != n) {
        snprintf(why, why_size, "the global's shards hold the same tensor twice");
        goto out;
    }
    for (size_t t = 0; t < n; t++) {
        const st_tensor *x = &g->h->tensors[t];
        const st_tensor *y = NULL;
        uint32_t i = 0;
        for (; i < g->nsrc && (y = st_header_find(g->src[i].h, x->name, x->name_len)) == NULL; i++)
            ;
        if (y == NULL) {
            snprintf(why, why_size, "the global's tensors do not add up");
            goto out;
        }
        src_of[t] = i;
        src_off[t] = g->src[i].data_start + y->begin;
    }
    g->src_of = src_of;
    g->src_off = src_off;
    src_of = NULL;
    src_off = NULL;
    rc = 0;
out:
    free(specs);
    free(src_of);
    free(src_off);
    free(json);
    return rc;
}

/* The specs of h's tensors in its order (malloc'd), or NULL when out of memory. */
st_spec *cl_header_specs(const st_header *h)
{
    st_spec *specs = calloc(h->ntensors ? h->ntensors : 1, sizeof(*specs));
    for (size_t t = 0; specs != NULL && t < h->ntensors; t++) {
        const st_tensor *x = &h->tensors[t];
        specs[t] = (st_spec){x->name, x->name_len, x->dtype, x->ndim, x->shape};
    }
    return specs;
}

static int gmodel_plan(cluster *c, gmodel *g, char *why, size_t why_size)
{
    size_t n = g->h->ntensors;
    st_spec *specs = cl_header_specs(g->h);
    sbuf b = {0};
    dl_error err;
    int rc = -1;

    g->shard_of = calloc(n ? n : 1, sizeof(*g->shard_of));
    if (specs == NULL || g->shard_of == NULL) {
        snprintf(why, why_size, "out of memory");
        goto out;
    }
    if (st_index_plan_even(specs, n, c->cfg.shards, g->shard_of, &err) != 0) {
        snprintf(why, why_size, "--cluster-shards %u: %.300s", c->cfg.shards, err.message);
        goto out;
    }
    /* each shard's outputs are single PUTs: S3 takes at most 5 GiB in one */
    uint64_t *shard_bytes = calloc(c->cfg.shards, sizeof(*shard_bytes));
    if (shard_bytes == NULL) {
        snprintf(why, why_size, "out of memory");
        goto out;
    }
    for (size_t t = 0; t < n; t++)
        shard_bytes[g->shard_of[t]] += st_tensor_bytes(&g->h->tensors[t]);
    for (uint32_t i = 0; i < c->cfg.shards; i++)
        if (shard_bytes[i] > S3_MAX_PART_SIZE) {
            snprintf(why, why_size, "--cluster-shards %u: shard %" PRIu32 " holds %" PRIu64 " bytes, over the 5 GiB "
                     "of one PUT: give more shards", c->cfg.shards, i, shard_bytes[i]);
            free(shard_bytes);
            goto out;
        }
    free(shard_bytes);
    /* the plan's fingerprint, which the manifest carries: every aggregator must cut the same shards */
    for (size_t t = 0; t < n; t++) {
        sb_add(&b, g->h->tensors[t].name, g->h->tensors[t].name_len);
        sb_printf(&b, "%c%" PRIu32 "\n", 0, g->shard_of[t]);
    }
    if (b.oom || cl_sha256_hex(b.p ? b.p : "", b.len, g->plan_sha) != 0) {
        snprintf(why, why_size, "out of memory");
        goto out;
    }
    rc = 0;
out:
    free(specs);
    free(b.p);
    return rc;
}

/* The model file's directory ("global/steps/7/") and the index's base ("model"). */
static int index_parts(const char *model_file, char *dir, size_t dir_size, char *base, size_t base_size)
{
    const char *slash = strrchr(model_file, '/');
    size_t dl = slash ? (size_t)(slash - model_file + 1) : 0;
    size_t fl = strlen(model_file + dl), sl = strlen(ST_INDEX_SUFFIX);
    if (dl >= dir_size || fl <= sl || fl - sl >= base_size)
        return -1;
    memcpy(dir, model_file, dl);
    dir[dl] = '\0';
    memcpy(base, model_file + dl, fl - sl);
    base[fl - sl] = '\0';
    return 0;
}

static int gmodel_load_sources(cluster *c, gmodel *g, char *why, size_t why_size)
{
    if (!st_index_is_index_path(g->model_file)) {
        if ((g->src = calloc(1, sizeof(*g->src))) == NULL || (g->src[0].rel = strdup(g->model_file)) == NULL)
            return -1;
        g->nsrc = 1;
        return cl_read_header(c, &g->src[0], NULL, why, why_size);
    }
    char dir[200], base[ST_INDEX_BASE_MAX + 1];
    s3s_resp r;
    st_index *ix = NULL;
    dl_error err;
    int rc = -1;
    if (index_parts(g->model_file, dir, sizeof(dir), base, sizeof(base)) != 0) {
        snprintf(why, why_size, "model_file %s is not an index path we read", g->model_file);
        return -1;
    }
    int got = cl_get_small(c, g->model_file, ST_INDEX_MAX_BYTES, &r, why, why_size);
    if (got <= 0) {
        if (got == 0)
            snprintf(why, why_size, "%s is missing", g->model_file);
        s3s_resp_free(&r);
        return -1;
    }
    if (st_index_parse(r.body.p, r.body.len, base, &ix, &err) != 0) {
        snprintf(why, why_size, "%.300s: %.300s", g->model_file, err.message);
        goto out;
    }
    if ((g->src = calloc(ix->nshards, sizeof(*g->src))) == NULL)
        goto out;
    g->nsrc = ix->nshards;
    for (uint32_t i = 0; i < ix->nshards; i++) {
        char name[ST_INDEX_BASE_MAX + 64];
        if (st_index_shard_name(base, i, ix->nshards, name, sizeof(name)) != 0 ||
            (g->src[i].rel = cl_rel_printf("%s%s", dir, name)) == NULL)
            goto out;
        if (cl_read_header(c, &g->src[i], NULL, why, why_size) != 0)
            goto out;
    }
    rc = 0;
out:
    st_index_free(ix);
    s3s_resp_free(&r);
    return rc;
}

/* Reads global/step_count.json: 1 when it names a step other than the one loaded (g replaced), 0 when
 * unchanged, -2 when the bucket holds no step file (an empty bucket), -1 on another failure (why). */
int cl_sync_global(cluster *c, char *why, size_t why_size)
{
    s3s_resp r;
    uint64_t step;
    int bootstrap, kind;
    char model_file[160];
    dl_error err;

    int got = cl_get_small(c, "global/step_count.json", STEPFILE_CAP, &r, why, why_size);
    if (got <= 0) {
        s3s_resp_free(&r);
        if (got == 0) {
            snprintf(why, why_size, "the bucket holds no global/step_count.json yet");
            return -2;
        }
        return -1;
    }
    if (stepcount_parse_file(r.body.p, r.body.len, &step, &bootstrap, &kind, model_file, sizeof(model_file), &err) != 0) {
        snprintf(why, why_size, "global/step_count.json: %.300s", err.message);
        s3s_resp_free(&r);
        return -1;
    }
    if (c->g.loaded && c->g.step == step && strcmp(c->g.stepfile_etag, r.etag) == 0) {
        s3s_resp_free(&r);
        return 0;
    }
    gmodel g = {0};
    g.step = step;
    g.ours = kind == 2;
    if (g.ours) {
        /* model[.g<n>]: the generation whose momentum shards the next step reads */
        const char *b = strrchr(model_file, '/');
        g.gen = b && strncmp(b, "/model.g", 8) == 0 ? (unsigned)strtoul(b + 8, NULL, 10) : 0;
    }
    snprintf(g.stepfile_etag, sizeof(g.stepfile_etag), "%s", r.etag);
    snprintf(g.model_file, sizeof(g.model_file), "%s", model_file);
    s3s_resp_free(&r);
    if (gmodel_load_sources(c, &g, why, why_size) != 0 || gmodel_combine(&g, why, why_size) != 0 ||
        gmodel_plan(c, &g, why, why_size) != 0) {
        cl_gmodel_free(&g);
        return -1;
    }
    g.loaded = 1;
    cl_gmodel_free(&c->g);
    c->g = g;
    pthread_mutex_lock(&c->mu);
    c->published_step = (int64_t)step;
    pthread_mutex_unlock(&c->mu);
    dl_log(DL_LOG_INFO, "cluster", "global", "step=%" PRIu64 " model_file=%s tensors=%zu shards=%u", step, model_file,
           c->g.h->ntensors, c->cfg.shards);
    return 1;
}

/* The bucket's step now (-1: unknown), without reloading the model. */
int64_t cl_bucket_step(cluster *c, char *etag, size_t etag_size)
{
    s3s_resp r;
    char why[200];
    uint64_t step;
    int64_t out = -1;
    if (cl_get_small(c, "global/step_count.json", STEPFILE_CAP, &r, why, sizeof(why)) == 1 &&
        stepcount_parse_file(r.body.p, r.body.len, &step, NULL, NULL, NULL, 0, NULL) == 0) {
        out = (int64_t)step;
        if (etag != NULL)
            snprintf(etag, etag_size, "%s", r.etag);
    }
    s3s_resp_free(&r);
    return out;
}
