/* s3_cluster: see s3_cluster.h.  One thread runs the protocol as plain sequential code: read the
 * bucket's step, collect the next round from the listing (headers only), agree on its manifest, then
 * claim, compute and complete shards until every shard is done, publish once, collect garbage. */
#include "s3_cluster.h"

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

#define PEEK_BYTES 65536u
#define STEPFILE_CAP (64u << 10)
#define CLAIM_CAP 4096u
#define LIST_PAGES_MAX 1000u
#define NODES_MAX 4096u

enum shard_state { SH_UNCLAIMED, SH_OURS, SH_FOREIGN, SH_DONE };
static const char *const shard_state_name[] = {"unclaimed", "ours", "foreign", "done"};

typedef struct shard_view {
    int state;
    unsigned epoch;
    double lease_age;           /* < 0: unknown */
    uint64_t bytes_read;
    /* the thread's own: a foreign claim's version and since when we have seen it (monotonic s) */
    char foreign_etag[80];
    double foreign_since;
} shard_view;

/* One object a tensor is read from: the previous global's file or shard, or a delta. */
typedef struct source {
    char *rel;
    char etag[80];
    uint64_t size;
    st_header *h;
    uint64_t data_start;        /* 8 + N */
    char header_sha[65];        /* of its first 8 + N bytes */
    long status;                /* the last header read's answer (404, 412: not the version asked for) */
} source;

/* The published global the next round builds on. */
typedef struct gmodel {
    int loaded;
    uint64_t step;
    char stepfile_etag[80];
    char model_file[160];
    int ours;                   /* a cluster's per-step index: the momentum is in the bucket */
    unsigned gen;               /* ours: the generation of the manifest it was computed from */
    source *src;
    size_t nsrc;
    st_header *h;               /* every tensor, in the sources' order (a synthetic header) */
    uint32_t *src_of;           /* [tensor of h]: its source */
    uint64_t *src_off;          /* [tensor of h]: its offset in the source */
    uint32_t *shard_of;         /* [tensor of h]: the plan */
    char plan_sha[65];
} gmodel;

/* A node's delta in the round: its listing and its header. */
typedef struct node_delta {
    char node[DELTA_NODE_ID_MAX + 1];
    uint64_t local_step;
    source s;
    int gone;                   /* a manifest's delta the bucket no longer holds in that version (s.h NULL) */
} node_delta;

struct cluster {
    cluster_config cfg;
    char **allow;
    char *scratch;
    char instance[96];
    s3_access a;
    uv_loop_t *loop;
    uv_async_t done_async;
    void (*stopped)(void *);
    void *stopped_arg;
    pthread_t thread;
    atomic_int stop;
    s3s_client s3;
    const char *stall_env;
    long stall_shard, stall_after_pass;

    /* the view, under mu */
    pthread_mutex_t mu;
    const char *state;
    int64_t step, published_step;
    const char *manifest;       /* NULL, "written", "adopted" */
    shard_view *sv;
    uint64_t bytes_read, bytes_written, shards_done, takeovers, publishes, refusals, fenced;
    double read_s, pass_s, write_s;     /* the shards' time reading, in the pass, writing back (all steps) */
    char last_error[300];

    /* the thread's */
    gmodel g;
    round_state rnd;
    node_delta *nd;
    size_t nnd;
    char **refused;             /* "key|etag" of deltas refused this step */
    size_t nrefused;
    node_delta *m;              /* the manifest's nodes, in its order */
    size_t nm;
    unsigned gen;               /* the manifest's generation: 0, then one more per delta refused for its values */
    char refusal_ignored[80];   /* the ETag of a refusal found unfounded (not verified again) */
    double last_renew;
    char claim_etag[80];
    unsigned claim_renewal;
};

/* ---- small things ----------------------------------------------------------------------------- */

static double mono(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec / 1e9;
}

static int stopping(cluster *c) { return atomic_load(&c->stop) != 0; }

static void nap(cluster *c, double seconds)
{
    for (double t0 = mono(); !stopping(c) && mono() - t0 < seconds;) {
        struct timespec ts = {0, 20 * 1000 * 1000};
        nanosleep(&ts, NULL);
    }
}

static void set_state(cluster *c, const char *state)
{
    pthread_mutex_lock(&c->mu);
    c->state = state;
    pthread_mutex_unlock(&c->mu);
}

static void fail_view(cluster *c, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void fail_view(cluster *c, const char *fmt, ...)
{
    va_list ap;
    pthread_mutex_lock(&c->mu);
    va_start(ap, fmt);
    vsnprintf(c->last_error, sizeof(c->last_error), fmt, ap);
    va_end(ap);
    pthread_mutex_unlock(&c->mu);
}

static void count(cluster *c, uint64_t *field, uint64_t n)
{
    pthread_mutex_lock(&c->mu);
    *field += n;
    pthread_mutex_unlock(&c->mu);
}

static void shard_set(cluster *c, uint32_t i, int state, unsigned epoch, double age)
{
    pthread_mutex_lock(&c->mu);
    c->sv[i].state = state;
    c->sv[i].epoch = epoch;
    c->sv[i].lease_age = age;
    pthread_mutex_unlock(&c->mu);
}

static void source_free(source *s)
{
    free(s->rel);
    st_header_free(s->h);
    memset(s, 0, sizeof(*s));
}

static void gmodel_free(gmodel *g)
{
    for (size_t i = 0; i < g->nsrc; i++)
        source_free(&g->src[i]);
    free(g->src);
    st_header_free(g->h);
    free(g->src_of);
    free(g->src_off);
    free(g->shard_of);
    memset(g, 0, sizeof(*g));
}

static char *rel_printf(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static char *rel_printf(const char *fmt, ...)
{
    char buf[512];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(buf, sizeof(buf), fmt, ap);
    va_end(ap);
    return n > 0 && (size_t)n < sizeof(buf) ? strdup(buf) : NULL;
}

static int hex_sha256(const void *p, size_t n, char out[65])
{
    return remote_hash_mem(p, n, REMOTE_SHA256, NULL, 0, out, 65);
}

/* ---- names ------------------------------------------------------------------------------------- */

/* global/steps/<step>/<stem>[.g<gen>]<suffix>: every object of a generation after the first has its own
 * name, so that nothing of a manifest a refusal replaced is taken for the new one's */
static char *step_rel(uint64_t step, const char *stem, unsigned gen, const char *suffix)
{
    if (gen == 0)
        return rel_printf("global/steps/%" PRIu64 "/%s%s", step, stem, suffix);
    return rel_printf("global/steps/%" PRIu64 "/%s.g%u%s", step, stem, gen, suffix);
}

static char *shard_rel(uint64_t step, unsigned gen, uint32_t i, const char *suffix)
{
    char stem[32];
    snprintf(stem, sizeof(stem), "shard-%" PRIu32, i);
    return step_rel(step, stem, gen, suffix);
}

static char *claim_rel(uint64_t step, unsigned gen, uint32_t i) { return shard_rel(step, gen, i, ".claim"); }
static char *manifest_rel(uint64_t step, unsigned gen) { return step_rel(step, "manifest", gen, ".json"); }
static char *refusal_rel(uint64_t step, unsigned gen) { return step_rel(step, "refused", gen, ".json"); }
static char *index_rel(uint64_t step, unsigned gen) { return step_rel(step, "model", gen, ST_INDEX_SUFFIX); }

static char *done_rel(uint64_t step, unsigned gen, uint32_t i) { return shard_rel(step, gen, i, ".done"); }

static int gen_base(const char *stem, unsigned gen, char *out, size_t size)
{
    int n = gen ? snprintf(out, size, "%s.g%u", stem, gen) : snprintf(out, size, "%s", stem);
    return n > 0 && (size_t)n < size ? 0 : -1;
}

static char *output_rel(uint64_t step, unsigned gen, uint32_t i, uint32_t n)
{
    char base[32], name[96];
    if (gen_base("model", gen, base, sizeof(base)) != 0 || st_index_shard_name(base, i, n, name, sizeof(name)) != 0)
        return NULL;
    return rel_printf("global/steps/%" PRIu64 "/%s", step, name);
}

static char *momentum_rel(uint64_t step, unsigned gen, uint32_t i, uint32_t n)
{
    char base[32], name[96];
    if (gen_base("shard", gen, base, sizeof(base)) != 0 || st_index_shard_name(base, i, n, name, sizeof(name)) != 0)
        return NULL;
    return rel_printf("state/momentum/%" PRIu64 "/%s", step, name);
}

/* ---- requests --------------------------------------------------------------------------------- */

/* A GET of rel into memory (at most cap bytes).  1: found (r filled), 0: 404, -1: failed (why). */
static int get_small(cluster *c, const char *rel, size_t cap, s3s_resp *r, char *why, size_t why_size)
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
static long put_small(cluster *c, const char *rel, const char *body, size_t len, const char *if_match, int if_none,
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
static int read_header(cluster *c, source *s, const char *etag, char *why, size_t why_size)
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
    if (hex_sha256(buf, (size_t)(8 + n), s->header_sha) != 0) {
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
static int list_keys(cluster *c, const char *rel_prefix, char ***keys, size_t *n, char *why, size_t why_size)
{
    char *token = NULL, *full = NULL;
    size_t pl = strlen(c->a.prefix);
    int rc = -1;

    *keys = NULL;
    *n = 0;
    full = pl ? rel_printf("%s/%s", c->a.prefix, rel_prefix) : strdup(rel_prefix);
    if (full == NULL)
        return -1;
    for (unsigned page = 0; page < LIST_PAGES_MAX; page++) {
        char *query = s3_list_query(full, token, NULL, 1000);
        s3s_req q = S3S_REQ_INIT;
        s3s_resp r;
        s3_listing l = {0};
        dl_error err;
        if (query == NULL)
            goto out;
        q.method = "GET";
        q.query = query;
        q.body_cap = S3_LIST_PAGE_CAP;
        int got = s3s_do(&c->s3, &q, &r, why, why_size);
        free(query);
        if (got != 0 || r.status != 200) {
            if (got == 0)
                s3s_describe(&r, why, why_size);
            s3s_resp_free(&r);
            goto out;
        }
        if (s3_parse_listing(r.body.p, r.body.len, &l, &err) != 0) {
            snprintf(why, why_size, "listing: %.300s", err.message);
            s3s_resp_free(&r);
            goto out;
        }
        s3s_resp_free(&r);
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

static void keys_free(char **k, size_t n)
{
    for (size_t i = 0; i < n; i++)
        free(k[i]);
    free(k);
}

static void delete_key(cluster *c, const char *rel)
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
static st_spec *header_specs(const st_header *h)
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
    st_spec *specs = header_specs(g->h);
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
    if (b.oom || hex_sha256(b.p ? b.p : "", b.len, g->plan_sha) != 0) {
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
        return read_header(c, &g->src[0], NULL, why, why_size);
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
    int got = get_small(c, g->model_file, ST_INDEX_MAX_BYTES, &r, why, why_size);
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
            (g->src[i].rel = rel_printf("%s%s", dir, name)) == NULL)
            goto out;
        if (read_header(c, &g->src[i], NULL, why, why_size) != 0)
            goto out;
    }
    rc = 0;
out:
    st_index_free(ix);
    s3s_resp_free(&r);
    return rc;
}

/* Reads global/step_count.json: 1 when it names a step other than the one loaded (g replaced), 0 when
 * unchanged, -1 on failure (why). */
static int sync_global(cluster *c, char *why, size_t why_size)
{
    s3s_resp r;
    uint64_t step;
    int bootstrap, kind;
    char model_file[160];
    dl_error err;

    int got = get_small(c, "global/step_count.json", STEPFILE_CAP, &r, why, why_size);
    if (got <= 0) {
        if (got == 0)
            snprintf(why, why_size, "the bucket holds no global/step_count.json yet");
        s3s_resp_free(&r);
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
        gmodel_free(&g);
        return -1;
    }
    g.loaded = 1;
    gmodel_free(&c->g);
    c->g = g;
    pthread_mutex_lock(&c->mu);
    c->published_step = (int64_t)step;
    pthread_mutex_unlock(&c->mu);
    dl_log(DL_LOG_INFO, "cluster", "global", "step=%" PRIu64 " model_file=%s tensors=%zu shards=%u", step, model_file,
           c->g.h->ntensors, c->cfg.shards);
    return 1;
}

/* The bucket's step now (-1: unknown), without reloading the model. */
static int64_t bucket_step(cluster *c, char *etag, size_t etag_size)
{
    s3s_resp r;
    char why[200];
    uint64_t step;
    int64_t out = -1;
    if (get_small(c, "global/step_count.json", STEPFILE_CAP, &r, why, sizeof(why)) == 1 &&
        stepcount_parse_file(r.body.p, r.body.len, &step, NULL, NULL, NULL, 0, NULL) == 0) {
        out = (int64_t)step;
        if (etag != NULL)
            snprintf(etag, etag_size, "%s", r.etag);
    }
    s3s_resp_free(&r);
    return out;
}

/* ---- the round ---------------------------------------------------------------------------------- */

static void round_forget(cluster *c)
{
    for (size_t i = 0; i < c->nnd; i++)
        source_free(&c->nd[i].s);
    free(c->nd);
    c->nd = NULL;
    c->nnd = 0;
    keys_free(c->refused, c->nrefused);
    c->refused = NULL;
    c->nrefused = 0;
    for (size_t i = 0; i < c->nm; i++)
        source_free(&c->m[i].s);
    free(c->m);
    c->m = NULL;
    c->nm = 0;
}

static int is_refused(const cluster *c, const char *key, const char *etag)
{
    for (size_t i = 0; i < c->nrefused; i++) {
        size_t kl = strlen(key);
        if (strncmp(c->refused[i], key, kl) == 0 && c->refused[i][kl] == '|' && strcmp(c->refused[i] + kl + 1, etag) == 0)
            return 1;
    }
    return 0;
}

/* A delta not to look at again this step: refused (counted, at warn level), or stale (a previous round's). */
static void refuse(cluster *c, const char *key, const char *etag, const char *why, int stale)
{
    char *e = rel_printf("%s|%s", key, etag);
    char **grown = e ? realloc(c->refused, (c->nrefused + 1) * sizeof(*grown)) : NULL;
    dl_log(stale ? DL_LOG_DEBUG : DL_LOG_WARN, "cluster", stale ? "delta of an earlier round" : "delta refused",
           "key=%s why=%s", key, why);
    if (grown == NULL) {
        free(e);
        return;
    }
    c->refused = grown;
    c->refused[c->nrefused++] = e;
    if (!stale)
        count(c, &c->refusals, 1);
}

static node_delta *nd_find(cluster *c, const char *node)
{
    for (size_t i = 0; i < c->nnd; i++)
        if (strcmp(c->nd[i].node, node) == 0)
            return &c->nd[i];
    return NULL;
}

/* Checks one delta's header against the global and the round's step (rel, etag from the listing):
 * 0 with s's header read, -1 refused (why), -2 not of this round yet (a later one), -4 of an earlier one. */
static int check_delta(cluster *c, uint64_t step, source *s, const char *etag, delta_info *info, char *why,
                       size_t why_size)
{
    dl_error err;
    if (read_header(c, s, etag, why, why_size) != 0)
        return -1;
    if (delta_check_header(s->h, c->g.h, s->rel, info, &err) != 0) {
        snprintf(why, why_size, "%.300s%.300s%.300s", err.message, err.tensor[0] ? " tensor=" : "", err.tensor);
        return -1;
    }
    /* the round of step s takes the deltas based on the published step s - 1 */
    if (info->base_outer_step > step - 1)
        return -2;
    if (info->base_outer_step < step - 1) {
        snprintf(why, why_size, "based on step %" PRIu64 ", the round builds on %" PRIu64, info->base_outer_step,
                 step - 1);
        return -4;
    }
    return 0;
}

/* One listing of nodes/: each node's newest single-file delta offered to the round. */
static void poll_deltas(cluster *c, uint64_t step)
{
    char why[1024];
    size_t pl = strlen(c->a.prefix);
    /* the listing's ETags are wanted here (list_keys keeps only the names) */
    char *token = NULL;
    char *full = pl ? rel_printf("%s/nodes/", c->a.prefix) : strdup("nodes/");
    if (full == NULL)
        return;
    for (unsigned page = 0; page < LIST_PAGES_MAX && !stopping(c); page++) {
        char *query = s3_list_query(full, token, NULL, 1000);
        s3s_req q = S3S_REQ_INIT;
        s3s_resp r;
        s3_listing l = {0};
        dl_error err;
        if (query == NULL)
            break;
        q.method = "GET";
        q.query = query;
        q.body_cap = S3_LIST_PAGE_CAP;
        int got = s3s_do(&c->s3, &q, &r, why, sizeof(why));
        free(query);
        if (got != 0 || r.status != 200 || s3_parse_listing(r.body.p, r.body.len, &l, &err) != 0) {
            if (got == 0 && r.status != 200)
                s3s_describe(&r, why, sizeof(why));
            dl_log(DL_LOG_WARN, "cluster", "listing nodes/ failed", "why=%s", why);
            s3s_resp_free(&r);
            break;
        }
        s3s_resp_free(&r);
        for (size_t i = 0; i < l.n && !stopping(c); i++) {
            const s3_object *o = &l.objs[i];
            const char *rel = pl ? o->key + pl + 1 : o->key;
            char node[DELTA_NODE_ID_MAX + 1];
            uint64_t local;
            if (pl && (strncmp(o->key, c->a.prefix, pl) != 0 || o->key[pl] != '/'))
                continue;
            if (is_refused(c, rel, o->etag))
                continue;
            if (delta_parse_path(rel, node, &local, NULL) != 0) {
                delta_path dp;
                if (delta_parse_any_path(rel, &dp, NULL) == 0 && dp.kind == DELTA_PATH_INDEX)
                    refuse(c, rel, o->etag, "a cluster takes single-file deltas, not sets", 0);
                continue;
            }
            node_delta *have = nd_find(c, node);
            if (have != NULL && (have->local_step > local ||
                                 (have->local_step == local && strcmp(have->s.etag, o->etag) == 0)))
                continue;
            if (have != NULL && have->local_step == local) {
                /* the same delta uploaded again with other bytes before the round closed: the round keeps
                 * its entry, the manifest will name this version */
                source again = {0};
                delta_info ai;
                memset(&ai, 0, sizeof(ai));
                if ((again.rel = strdup(rel)) == NULL)
                    continue;
                int v = check_delta(c, step, &again, o->etag, &ai, why, sizeof(why));
                if (v == 0 && strcmp(again.etag, o->etag) == 0 && ai.local_step == local) {
                    source_free(&have->s);
                    have->s = again;
                    dl_log(DL_LOG_INFO, "cluster", "delta rewritten before the round closed: its new version taken",
                           "key=%s", rel);
                } else {
                    if (v == -1)
                        refuse(c, rel, o->etag, why, 0);
                    source_free(&again);
                }
                continue;
            }
            if (have == NULL && c->nnd >= NODES_MAX)
                continue;
            source s = {0};
            delta_info info;
            memset(&info, 0, sizeof(info));
            if ((s.rel = strdup(rel)) == NULL)
                continue;
            int v = check_delta(c, step, &s, o->etag, &info, why, sizeof(why));
            if (v == -1 || v == -4)
                refuse(c, rel, o->etag, why, v == -4);
            if (v != 0 || strcmp(s.etag, o->etag) != 0) {
                source_free(&s);
                continue;
            }
            char *path = strdup(rel), *replaced = NULL;
            if (path == NULL) {
                source_free(&s);
                continue;
            }
            round_verdict verdict = round_offer(&c->rnd, &info, path, o->size, mono(), 0, &replaced);
            free(replaced);
            if (!round_verdict_taken(verdict)) {
                free(path);
                source_free(&s);
                if (verdict != ROUND_NOT_NEWER)
                    refuse(c, rel, o->etag, round_verdict_name(verdict), 0);
                continue;
            }
            dl_log(DL_LOG_INFO, "cluster", "delta taken", "step=%" PRIu64 " node=%s local_step=%" PRIu64 " verdict=%s",
                   step, node, local, round_verdict_name(verdict));
            if (have == NULL) {
                node_delta *grown = realloc(c->nd, (c->nnd + 1) * sizeof(*grown));
                if (grown == NULL) {
                    source_free(&s);
                    continue;
                }
                c->nd = grown;
                have = &c->nd[c->nnd++];
                memset(have, 0, sizeof(*have));
                snprintf(have->node, sizeof(have->node), "%s", node);
            }
            source_free(&have->s);
            have->s = s;
            have->local_step = local;
        }
        free(token);
        token = l.truncated && l.next_token ? strdup(l.next_token) : NULL;
        s3_listing_free(&l);
        if (token == NULL)
            break;
    }
    free(token);
    free(full);
}

/* ---- the manifest --------------------------------------------------------------------------------- */

/* A manifest's text from its nodes (in node order): the same bytes from every aggregator that derives it */
static char *manifest_text(const cluster *c, uint64_t step, unsigned gen, const node_delta *const *nodes, size_t n)
{
    sbuf b = {0};
    sb_printf(&b, "{\n  \"outer_step\": %" PRIu64 ",\n  \"base_step\": %" PRIu64 ",\n  \"generation\": %u,\n"
              "  \"shards\": %u,\n  \"plan\": \"%s\",\n  \"nodes\": [", step, c->g.step, gen, c->cfg.shards, c->g.plan_sha);
    for (size_t i = 0; i < n; i++) {
        const node_delta *d = nodes[i];
        sb_str(&b, i ? ",\n    {\"node\": " : "\n    {\"node\": ");
        sb_json_string(&b, d->node, strlen(d->node));
        sb_str(&b, ", \"key\": ");
        sb_json_string(&b, d->s.rel, strlen(d->s.rel));
        sb_printf(&b, ", \"etag\": \"%s\", \"size\": %" PRIu64 ", \"local_step\": %" PRIu64 ", \"header_sha256\": \"%s\"}",
                  d->s.etag, d->s.size, d->local_step, d->s.header_sha);
    }
    sb_str(&b, "\n  ]\n}\n");
    return sb_take(&b);
}

/* The closed round's manifest (generation 0). */
static char *manifest_build(cluster *c, uint64_t step)
{
    const node_delta **nodes = calloc(c->rnd.n ? c->rnd.n : 1, sizeof(*nodes));
    size_t n = 0;
    if (nodes == NULL)
        return NULL;
    for (size_t i = 0; i < c->rnd.n; i++) {
        const node_delta *d = nd_find(c, c->rnd.entries[i].node_id);
        if (d != NULL)
            nodes[n++] = d;
    }
    char *text = manifest_text(c, step, 0, nodes, n);
    free(nodes);
    return text;
}

static int json_u64(const cJSON *o, const char *k, uint64_t *out)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, k);
    if (!cJSON_IsNumber(v) || !(v->valuedouble >= 0) || v->valuedouble > 9007199254740991.0 ||
        floor(v->valuedouble) != v->valuedouble)
        return -1;
    *out = (uint64_t)v->valuedouble;
    return 0;
}

static const char *json_str(const cJSON *o, const char *k)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, k);
    return cJSON_IsString(v) ? v->valuestring : NULL;
}

/* Adopts a manifest's text: its schema, our step and plan, the round's rules, and every node's delta
 * as the bucket holds it now (its header read again with If-Match on the manifest's ETag, and its
 * hash compared).  0, or -1 with why. */
static int manifest_adopt(cluster *c, uint64_t step, const char *text, size_t len, char *why, size_t why_size)
{
    cJSON *j = cJSON_ParseWithLength(text, len);
    const cJSON *nodes = cJSON_GetObjectItemCaseSensitive(j, "nodes");
    uint64_t ms, shards, gen;
    const char *plan = json_str(j, "plan");
    int rc = -1;

    if (!cJSON_IsObject(j) || json_u64(j, "outer_step", &ms) != 0 || json_u64(j, "shards", &shards) != 0 ||
        plan == NULL || !cJSON_IsArray(nodes)) {
        snprintf(why, why_size, "the manifest is not one (outer_step, shards, plan, nodes)");
        goto out;
    }
    if (json_u64(j, "generation", &gen) != 0 || gen != 0) {
        snprintf(why, why_size, "the manifest is not of the round's first generation");
        goto out;
    }
    if (ms != step || shards != c->cfg.shards || strcmp(plan, c->g.plan_sha) != 0) {
        snprintf(why, why_size, "the manifest is for step %" PRIu64 " in %" PRIu64 " shards of another plan, not step %"
                 PRIu64 " in %u shards of ours", ms, shards, step, c->cfg.shards);
        goto out;
    }
    int n = cJSON_GetArraySize(nodes);
    if (n <= 0 || (unsigned)n > NODES_MAX || (c->cfg.expected_nodes && (unsigned)n > c->cfg.expected_nodes) ||
        (unsigned)n < (c->cfg.min_nodes ? c->cfg.min_nodes : 1)) {
        snprintf(why, why_size, "the manifest lists %d nodes, which the round's rules do not allow", n);
        goto out;
    }
    if ((c->m = calloc((size_t)n, sizeof(*c->m))) == NULL) {
        snprintf(why, why_size, "out of memory");
        goto out;
    }
    for (int i = 0; i < n; i++) {
        const cJSON *e = cJSON_GetArrayItem(nodes, i);
        const char *node = json_str(e, "node"), *key = json_str(e, "key"), *etag = json_str(e, "etag"),
                   *hs = json_str(e, "header_sha256");
        uint64_t local, pl_local;
        char pnode[DELTA_NODE_ID_MAX + 1];
        delta_info info;
        node_delta *d = &c->m[c->nm];
        if (node == NULL || key == NULL || etag == NULL || hs == NULL || json_u64(e, "local_step", &local) != 0 ||
            delta_parse_path(key, pnode, &pl_local, NULL) != 0 || strcmp(pnode, node) != 0 || pl_local != local ||
            strlen(etag) >= sizeof(d->s.etag) || (c->nm > 0 && strcmp(c->m[c->nm - 1].node, node) >= 0)) {
            snprintf(why, why_size, "the manifest's node entry %d is not a delta of ours (node, key, etag, order)", i);
            goto out;
        }
        if (c->cfg.nallow) {
            int allowed = 0;
            for (size_t k = 0; k < c->cfg.nallow; k++)
                allowed |= strcmp(c->cfg.allow[k], node) == 0;
            if (!allowed) {
                snprintf(why, why_size, "the manifest lists node %s, which --nodes does not", node);
                goto out;
            }
        }
        snprintf(d->node, sizeof(d->node), "%s", node);
        d->local_step = local;
        if ((d->s.rel = strdup(key)) == NULL)
            goto out;
        c->nm++;
        memset(&info, 0, sizeof(info));
        uint64_t size = 0;
        if (json_u64(e, "size", &size) != 0 || strlen(hs) != 64) {
            snprintf(why, why_size, "the manifest's node entry %d has no size or header hash", i);
            goto out;
        }
        if (check_delta(c, step, &d->s, etag, &info, why, why_size) != 0) {
            if (d->s.status == 404 || d->s.status == 412) {
                /* rewritten or removed since the manifest was written: the manifest holds, and that node's
                 * delta is refused once the step is aggregated (check_refusal), as a rewrite found later is */
                dl_log(DL_LOG_WARN, "cluster", "a delta of the manifest is gone from the bucket", "key=%s status=%ld",
                       key, d->s.status);
                st_header_free(d->s.h);
                d->s.h = NULL;
                d->gone = 1;
            } else {
                char inner[200];
                snprintf(inner, sizeof(inner), "%s", why);
                snprintf(why, why_size, "the manifest's delta %s: %s", key, inner);
                goto out;
            }
        } else if (strcmp(d->s.etag, etag) != 0 || strcmp(d->s.header_sha, hs) != 0) {
            snprintf(why, why_size, "the manifest's delta %s is not the one the bucket holds (ETag or header)", key);
            goto out;
        }
        /* the manifest's own values, so that a manifest derived from this one has the same bytes anywhere */
        snprintf(d->s.etag, sizeof(d->s.etag), "%s", etag);
        snprintf(d->s.header_sha, sizeof(d->s.header_sha), "%s", hs);
        d->s.size = size;
    }
    rc = 0;
out:
    cJSON_Delete(j);
    return rc;
}

/* The manifest of step: 1 adopted, 0 none yet, -1 refused or unreadable (why). */
static int manifest_read(cluster *c, uint64_t step, char *why, size_t why_size)
{
    char *rel = manifest_rel(step, 0);
    s3s_resp r;
    /* an entry is at most ~450 bytes (a 64-byte id, its key, an ETag, a sha256): the text, and its cJSON tree,
     * stay within a few MB whatever a bucket writer puts there */
    size_t cap = 4096 + (size_t)640 * (c->cfg.expected_nodes ? c->cfg.expected_nodes : NODES_MAX);
    int got = rel ? get_small(c, rel, cap, &r, why, why_size) : -1;
    free(rel);
    if (got == 1)
        got = manifest_adopt(c, step, r.body.p, r.body.len, why, why_size) == 0 ? 1 : -1;
    s3s_resp_free(&r);
    return got;
}

/* Writes our manifest of the closed round, or adopts the one already there.  0 or -1 (why). */
static int manifest_write(cluster *c, uint64_t step, char *why, size_t why_size)
{
    char *text = manifest_build(c, step);
    char *rel = manifest_rel(step, 0);
    s3s_resp r;
    int rc = -1;

    if (text == NULL || rel == NULL) {
        snprintf(why, why_size, "out of memory");
        goto out;
    }
    long st = put_small(c, rel, text, strlen(text), NULL, 1, &r, why, why_size);
    if (st != 0 && st != 200 && st != 412)
        s3s_describe(&r, why, why_size);
    s3s_resp_free(&r);
    if (st == 200) {
        /* ours: the entries are the round's, checked as they were taken */
        rc = manifest_adopt(c, step, text, strlen(text), why, why_size);
        if (rc == 0) {
            pthread_mutex_lock(&c->mu);
            c->manifest = "written";
            pthread_mutex_unlock(&c->mu);
            dl_log(DL_LOG_INFO, "cluster", "manifest written", "step=%" PRIu64 " nodes=%zu", step, c->nm);
        }
        goto out;
    }
    if (st != 412)
        goto out;
    /* another's (or our own earlier attempt's: then it is the same text) */
    rc = manifest_read(c, step, why, why_size) == 1 ? 0 : -1;
    if (rc == 0) {
        pthread_mutex_lock(&c->mu);
        c->manifest = "adopted";
        pthread_mutex_unlock(&c->mu);
        dl_log(DL_LOG_INFO, "cluster", "manifest adopted", "step=%" PRIu64 " nodes=%zu", step, c->nm);
    }
out:
    free(text);
    free(rel);
    return rc;
}

/* ---- claims --------------------------------------------------------------------------------------- */

static int claim_body(cluster *c, uint64_t step, uint32_t i, unsigned epoch, char *out, size_t size)
{
    int n = snprintf(out, size, "{\"outer_step\": %" PRIu64 ", \"shard\": %" PRIu32 ", \"instance\": \"%s\", "
                     "\"epoch\": %u, \"renewal\": %u}\n", step, i, c->instance, epoch, c->claim_renewal);
    return n > 0 && (size_t)n < size ? n : -1;
}

typedef enum claim_result { CLAIM_OURS, CLAIM_BUSY, CLAIM_FAILED } claim_result;

/* Claims shard i: a new claim, or an expired one taken over.  CLAIM_OURS with c->claim_etag and *epoch. */
static claim_result claim_try(cluster *c, uint64_t step, uint32_t i, unsigned *epoch)
{
    char *rel = claim_rel(step, c->gen, i);
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
    long st = put_small(c, rel, body, (size_t)len, NULL, 1, &r, why, sizeof(why));
    if (st == 200) {
        snprintf(c->claim_etag, sizeof(c->claim_etag), "%s", r.etag);
        out = CLAIM_OURS;
        goto out;
    }
    s3s_resp_free(&r);
    if (st != 412)
        goto out;
    /* it exists: ours (an earlier attempt whose answer was lost), live, or expired */
    int got = get_small(c, rel, CLAIM_CAP, &r, why, sizeof(why));
    if (got != 1) {
        out = got == 0 ? CLAIM_BUSY : CLAIM_FAILED;   /* gone meanwhile: the next sweep claims it afresh */
        goto out;
    }
    if (r.body.len == (size_t)len && memcmp(r.body.p, body, (size_t)len) == 0) {
        snprintf(c->claim_etag, sizeof(c->claim_etag), "%s", r.etag);
        out = CLAIM_OURS;
        goto out;
    }
    cJSON *j = cJSON_ParseWithLength(r.body.p, r.body.len);
    uint64_t theirs = 0;
    if (json_u64(j, "epoch", &theirs) != 0 || theirs > 1000000000u)
        theirs = 0;
    cJSON_Delete(j);
    shard_view *sv = &c->sv[i];
    double now = mono(), age = s3s_age(&r);
    if (strcmp(sv->foreign_etag, r.etag) != 0) {
        snprintf(sv->foreign_etag, sizeof(sv->foreign_etag), "%s", r.etag);
        sv->foreign_since = now;
    }
    if (now - sv->foreign_since > age)
        age = now - sv->foreign_since;
    shard_set(c, i, SH_FOREIGN, (unsigned)theirs, age);
    if (age < c->cfg.lease || !r.etag[0]) {
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
    st = put_small(c, rel, body, (size_t)len, stale, 0, &r, why, sizeof(why));
    if (st == 412) {
        /* an ambiguous 412: a retried takeover meets its own first attempt; read back and compare */
        s3s_resp_free(&r);
        if (get_small(c, rel, CLAIM_CAP, &r, why, sizeof(why)) == 1 && r.body.len == (size_t)len &&
            memcmp(r.body.p, body, (size_t)len) == 0)
            st = 200;
    }
    if (st == 200) {
        dl_log(DL_LOG_WARN, "cluster", "took over an expired shard claim", "step=%" PRIu64 " shard=%" PRIu32
               " epoch=%u age_s=%.1f", step, i, *epoch, age);
        snprintf(c->claim_etag, sizeof(c->claim_etag), "%s", r.etag);
        count(c, &c->takeovers, 1);
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
    char *rel = claim_rel(step, c->gen, i);
    char body[512], why[300];
    s3s_resp r;
    int rc = -1, len;

    if (rel == NULL)
        return -1;
    c->claim_renewal++;
    if ((len = claim_body(c, step, i, epoch, body, sizeof(body))) < 0)
        goto out;
    long st = put_small(c, rel, body, (size_t)len, c->claim_etag, 0, &r, why, sizeof(why));
    if (st == 200) {
        snprintf(c->claim_etag, sizeof(c->claim_etag), "%s", r.etag);
        c->last_renew = mono();
        shard_set(c, i, SH_OURS, epoch, 0);
        rc = 0;
        goto out;
    }
    if (st == 412) {
        /* an ambiguous 412: our retried renewal may have gone through; read back and compare */
        s3s_resp_free(&r);
        if (get_small(c, rel, CLAIM_CAP, &r, why, sizeof(why)) == 1 && r.body.len == (size_t)len &&
            memcmp(r.body.p, body, (size_t)len) == 0) {
            snprintf(c->claim_etag, sizeof(c->claim_etag), "%s", r.etag);
            c->last_renew = mono();
            rc = 0;
        }
        goto out;
    }
    /* no answer: the lease is not over yet, and the next renewal tries again */
    rc = st == 0 && mono() - c->last_renew < c->cfg.lease ? 0 : -1;
out:
    s3s_resp_free(&r);
    free(rel);
    return rc;
}

/* epoch 0: no claim of ours (a refusal verified) */
static void renew_if_due(cluster *c, uint64_t step, uint32_t i, unsigned epoch, int *fenced)
{
    if (epoch != 0 && !*fenced && mono() - c->last_renew >= c->cfg.lease / 3 && claim_renew(c, step, i, epoch) != 0)
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
        if (*fenced || stopping(c)) {
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
static int fetch_global_slice(cluster *c, uint32_t i, const char *path, int *fenced, uint64_t step, unsigned epoch,
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

/* The pass over the slices on cfg.threads threads, our claim renewed meanwhile.  0 or -1 (why). */
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
            if (*fenced || stopping(c))
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
    if (rc == 0 && stats != NULL && p.stats != NULL)
        memcpy(stats, p.stats, io->ndeltas * sizeof(*stats));
    if (rc != 0)
        snprintf(why, why_size, "%.300s%.300s", *fenced ? "fenced out: " : "", err.message[0] ? err.message : "the pass failed");
    outer_free(&p);
    free(th);
    return rc;
}

/* Uploads path as rel, written once: 0 when rel holds exactly our bytes (ours, or an identical earlier
 * writer's), -1 failed, -2 rel holds other bytes (a conflict no retry mends). */
static int put_once(cluster *c, const char *rel, const char *path, char md5[33], uint64_t *size, char *why,
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
        count(c, &c->bytes_written, (uint64_t)sb.st_size);
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

static long test_hook(const char *name)
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

/* Node k's delta's slice of shard i into path, its values checked against the global's slice header gh as
 * intake checks a whole delta (finite, decodable).  0, -1 failed (why), -3 its values are refused, or it
 * is not the version the manifest names any more (why). */
static int slice_and_check(cluster *c, const char *path, const st_header *gh, size_t k, uint32_t i, uint64_t step,
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
static int shard_work(cluster *c, uint64_t step, uint32_t i, unsigned epoch, size_t *bad)
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
    c->last_renew = mono();
    double t0 = c->last_renew, t_read = 0, t_pass = 0;
    shard_set(c, i, SH_OURS, epoch, 0);
    why[0] = '\0';
    if (stats == NULL)
        goto out;
    if (c->stall_shard == (long)i) {
        dl_log(DL_LOG_WARN, "cluster", "test hook: stalling while holding the claim", "shard=%" PRIu32, i);
        nap(c, 3600);
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
    if (fetch_global_slice(c, i, io.global, &fenced, step, epoch, why, sizeof(why)) != 0)
        goto out;
    if (c->g.ours && c->cfg.momentum != 0) {
        /* the previous step's momentum shard: a cluster always writes it */
        if ((prev_mom = momentum_rel(c->g.step, c->g.gen, i, c->cfg.shards)) == NULL)
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
        if ((io.deltas[k] = rel_printf("%s/delta-%zu.safetensors", io.dir, k)) == NULL)
            goto out;
        io.ndeltas = k + 1;
        int v = slice_and_check(c, io.deltas[k], gf->h, k, i, step, epoch, &fenced, why, sizeof(why));
        if (v == -3) {
            *bad = k;
            rc = -3;
        }
        if (v != 0)
            goto out;
    }
    st_close(gf);
    gf = NULL;
    t_read = mono();
    if (run_pass(c, &io, have_momentum, step, i, epoch, &fenced, stats, why, sizeof(why)) != 0)
        goto out;
    t_pass = mono();
    if (c->stall_after_pass == (long)i) {
        dl_log(DL_LOG_WARN, "cluster", "test hook: pausing after the pass", "shard=%" PRIu32, i);
        nap(c, 2);
    }
    /* fencing: our claim must still be ours right before anything is written */
    if (claim_renew(c, step, i, epoch) != 0) {
        fenced = 1;
        snprintf(why, sizeof(why), "fenced out: the claim is another's now");
        goto out;
    }
    if ((out_rel = output_rel(step, c->gen, i, c->cfg.shards)) == NULL || (mom_rel = momentum_rel(step, c->gen, i, c->cfg.shards)) == NULL ||
        (drel = done_rel(step, c->gen, i)) == NULL)
        goto out;
    int prc = put_once(c, out_rel, io.out_global, gmd5, &gsize, why, sizeof(why));
    if (prc == 0 && c->cfg.momentum != 0)
        prc = put_once(c, mom_rel, io.out_momentum, mmd5, &msize, why, sizeof(why));
    if (prc != 0) {
        rc = prc;
        goto out;
    }
    sb_printf(&b, "{\"outer_step\": %" PRIu64 ", \"shard\": %" PRIu32 ", \"instance\": \"%s\", \"epoch\": %u, "
              "\"global_md5\": \"%s\", \"global_size\": %" PRIu64 ", \"momentum_md5\": \"%s\", \"stats\": [",
              step, i, c->instance, epoch, gmd5, gsize, mmd5);
    for (size_t k = 0; k < c->nm; k++)
        sb_printf(&b, "%s[%.17g, %.17g]", k ? ", " : "", stats[k].sumsq, stats[k].dot);
    sb_str(&b, "]}\n");
    if (b.oom)
        goto out;
    s3s_resp r;
    long st = put_small(c, drel, b.p, b.len, NULL, 1, &r, why, sizeof(why));
    s3s_resp_free(&r);
    if (st == 412) {
        /* done already (another finished it meanwhile, or our own first attempt): either is the shard; a
         * marker that does not hold (a writer's) is replaced, If-Match on its ETag */
        char etag[80] = "";
        int d = read_done(c, step, i, NULL, etag, sizeof(etag), why, sizeof(why));
        if (d == -1 && etag[0]) {
            dl_log(DL_LOG_WARN, "cluster", "replacing a done marker that does not hold", "step=%" PRIu64
                   " shard=%" PRIu32 " why=%s", step, i, why);
            st = put_small(c, drel, b.p, b.len, etag, 0, &r, why, sizeof(why));
            s3s_resp_free(&r);
        } else if (d != 1) {
            goto out;
        }
    }
    if (st != 200 && st != 412)
        goto out;
    count(c, &c->shards_done, 1);
    double t_end = mono();
    dl_log(DL_LOG_INFO, "cluster", "shard done", "step=%" PRIu64 " shard=%" PRIu32 " epoch=%u bytes_read=%" PRIu64
           " read_s=%.3f pass_s=%.3f write_s=%.3f", step, i, epoch, c->sv[i].bytes_read, t_read - t0, t_pass - t_read,
           t_end - t_pass);
    pthread_mutex_lock(&c->mu);
    c->read_s += t_read - t0;
    c->pass_s += t_pass - t_read;
    c->write_s += t_end - t_pass;
    pthread_mutex_unlock(&c->mu);
    shard_set(c, i, SH_DONE, epoch, -1);
    rc = 0;
out:
    if (rc != 0 && !stopping(c)) {
        if (fenced) {
            count(c, &c->fenced, 1);
            dl_log(DL_LOG_WARN, "cluster", "fenced out of a shard: its late work is dropped", "step=%" PRIu64
                   " shard=%" PRIu32 " epoch=%u", step, i, epoch);
            shard_set(c, i, SH_FOREIGN, epoch, -1);
        } else {
            shard_set(c, i, SH_UNCLAIMED, epoch, -1);
        }
        if (!fenced && why[0]) {
            dl_log(rc <= -2 ? DL_LOG_ERROR : DL_LOG_WARN, "cluster", rc <= -2 ? "shard refused" : "shard failed",
                   "step=%" PRIu64 " shard=%" PRIu32 " why=%s", step, i, why);
            fail_view(c, "step %" PRIu64 " shard %" PRIu32 ": %s", step, i, why);
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

/* Shard i's done marker: 1 a valid one, its output there as it names it (its per-node sums added to sumsq
 * when not NULL), 0 none, -1 one that does not hold (etag set: a writer's garbage, replaced by whoever
 * completes the shard), -2 unknown for now (why). */
static int read_done(cluster *c, uint64_t step, uint32_t i, double *sumsq, char *etag, size_t etag_size, char *why,
                     size_t why_size)
{
    char *drel = done_rel(step, c->gen, i), *orel = output_rel(step, c->gen, i, c->cfg.shards);
    s3s_resp r;
    int rc = -2;

    memset(&r, 0, sizeof(r));
    if (drel == NULL || orel == NULL)
        goto out;
    int got = get_small(c, drel, 1024 + 96 * c->nm, &r, why, why_size);
    if (etag != NULL)
        snprintf(etag, etag_size, "%s", r.etag);
    if (got <= 0) {
        /* absent, or unreadable: over its cap (an answer 200) is a writer's garbage, else a failure for now */
        rc = got == 0 ? 0 : r.status == 200 ? -1 : -2;
        goto out;
    }
    rc = -1;
    cJSON *j = cJSON_ParseWithLength(r.body.p, r.body.len);
    const char *md5 = json_str(j, "global_md5");
    const cJSON *stats = cJSON_GetObjectItemCaseSensitive(j, "stats");
    uint64_t size = 0, st = 0, sh = 0;
    char want[33];
    if (md5 == NULL || json_u64(j, "global_size", &size) != 0 || json_u64(j, "outer_step", &st) != 0 ||
        json_u64(j, "shard", &sh) != 0 || st != step || sh != i || strlen(md5) != 32 || !cJSON_IsArray(stats) ||
        cJSON_GetArraySize(stats) != (int)c->nm) {
        snprintf(why, why_size, "%s is not a done marker of this step and manifest", drel);
        cJSON_Delete(j);
        goto out;
    }
    /* the marker's statistics are indexed by the manifest's nodes: its count was checked above */
    for (size_t k = 0; sumsq != NULL && k < c->nm; k++) {
        const cJSON *x = cJSON_GetArrayItem(cJSON_GetArrayItem(stats, (int)k), 0);
        if (cJSON_IsNumber(x))
            sumsq[k] += x->valuedouble;
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

/* Whether shard i is done: 1 yes, 0 no (no marker, or one that does not hold: the shard is computed
 * again), -1 unknown. */
static int shard_is_done(cluster *c, uint64_t step, uint32_t i)
{
    char why[1024];
    int d = read_done(c, step, i, NULL, NULL, 0, why, sizeof(why));
    return d == 1 ? 1 : d == -2 ? -1 : 0;
}

/* Checks every done marker against its output and sums the per-node statistics in shard order.  0 or -1. */
static int check_outputs(cluster *c, uint64_t step, double *sumsq, char *why, size_t why_size)
{
    for (uint32_t i = 0; i < c->cfg.shards; i++)
        if (read_done(c, step, i, sumsq, NULL, 0, why, why_size) != 1)
            return -1;
    return 0;
}

/* ---- the publish ---------------------------------------------------------------------------------- */

static int write_index(cluster *c, uint64_t step, char *why, size_t why_size)
{
    size_t n = c->g.h->ntensors, len = 0;
    st_spec *specs = header_specs(c->g.h);
    char *text = NULL, *rel = index_rel(step, c->gen);
    char base[32];
    s3s_resp r;
    int rc = -1;

    memset(&r, 0, sizeof(r));
    if (specs == NULL || rel == NULL)
        goto out;
    if (gen_base("model", c->gen, base, sizeof(base)) != 0 ||
        (text = st_index_build_json(base, specs, n, c->g.shard_of, c->cfg.shards, NULL, 0, &len)) == NULL)
        goto out;
    long st = put_small(c, rel, text, len, NULL, 0, &r, why, why_size);
    if (st == 200)
        rc = 0;
    else if (st != 0)
        s3s_describe(&r, why, why_size);
out:
    s3s_resp_free(&r);
    free(specs);
    free(text);
    free(rel);
    return rc;
}

/* step_count.json last, If-Match on the one the step was built on: it never moves back.  1 published by
 * us, 0 meanwhile by another (a completer of the same publish), -1 failed. */
static int write_stepfile(cluster *c, uint64_t step, char *why, size_t why_size)
{
    char *model_file = index_rel(step, c->gen), etag[80];
    if (model_file == NULL)
        return -1;
    snprintf(etag, sizeof(etag), "%s", c->g.stepfile_etag);
    for (int attempt = 0; attempt < 5; attempt++) {
        char *text = stepcount_build_file(step, c->cfg.optimizer, 0, model_file, NULL);
        s3s_resp r;
        if (text == NULL)
            break;
        long st = put_small(c, "global/step_count.json", text, strlen(text), etag, 0, &r, why, why_size);
        free(text);
        s3s_resp_free(&r);
        int64_t now = st == 200 ? (int64_t)step : bucket_step(c, etag, sizeof(etag));
        if (now >= (int64_t)step) {
            free(model_file);
            return st == 200 ? 1 : 0;
        }
        if (now != (int64_t)step - 1) {
            snprintf(why, why_size, "the bucket's step is %" PRId64 ", not %" PRIu64, now, step - 1);
            break;
        }
        if (attempt == 4)
            snprintf(why, why_size, "step_count.json keeps changing");
    }
    free(model_file);
    return -1;
}

static void collect_garbage(cluster *c, uint64_t step)
{
    char kept[32];              /* the base of step - 1's published files: model, or model.g<n> */
    if (gen_base("model", c->g.gen, kept, sizeof(kept)) != 0)
        return;
    char *prefixes[3] = {
        step >= 2 ? rel_printf("global/steps/%" PRIu64 "/", step - 2) : NULL,
        step >= 1 ? rel_printf("state/momentum/%" PRIu64 "/", step - 1) : NULL,
        step >= 1 ? rel_printf("global/steps/%" PRIu64 "/", step - 1) : NULL,
    };
    for (int p = 0; p < 3; p++) {
        char **keys;
        size_t n;
        char why[1024];
        if (prefixes[p] == NULL || list_keys(c, prefixes[p], &keys, &n, why, sizeof(why)) != 0) {
            free(prefixes[p]);
            continue;
        }
        for (size_t k = 0; k < n && !stopping(c); k++) {
            /* of the previous step, only its published model stays (a reader may still be fetching it) */
            const char *name = strrchr(keys[k], '/');
            name = name ? name + 1 : keys[k];
            size_t bl = strlen(kept);
            int del = p < 2 || strncmp(name, kept, bl) != 0 || (name[bl] != '-' && name[bl] != '.') ||
                      (c->g.gen == 0 && strncmp(name + bl, ".g", 2) == 0);
            if (del)
                delete_key(c, keys[k]);
        }
        keys_free(keys, n);
        free(prefixes[p]);
    }
}

/* Every shard is done: publish once.  0 published (by anyone), -1 not yet. */
static int publish(cluster *c, uint64_t step)
{
    char why[1024] = "";
    double *sumsq = calloc(c->nm ? c->nm : 1, sizeof(*sumsq));
    char *rel = rel_printf("global/steps/%" PRIu64 "/published", step);
    char body[256];
    s3s_resp r;
    int rc = -1;

    memset(&r, 0, sizeof(r));
    if (sumsq == NULL || rel == NULL)
        goto out;
    set_state(c, "publishing");
    if (check_outputs(c, step, sumsq, why, sizeof(why)) != 0)
        goto out;
    snprintf(body, sizeof(body), "{\"outer_step\": %" PRIu64 ", \"generation\": %u, \"instance\": \"%s\"}\n", step,
             c->gen, c->instance);
    long st = put_small(c, rel, body, strlen(body), NULL, 1, &r, why, sizeof(why));
    if (st == 412) {
        s3s_resp_free(&r);
        if (get_small(c, rel, CLAIM_CAP, &r, why, sizeof(why)) != 1)
            goto out;
        int ours = r.body.len == strlen(body) && memcmp(r.body.p, body, r.body.len) == 0;
        double age = s3s_age(&r);
        if (!ours && !(age >= c->cfg.lease)) {
            /* another publishes it: wait for its step file (the caller polls the bucket's step) */
            goto out;
        }
        if (!ours)
            dl_log(DL_LOG_WARN, "cluster", "completing a publish its winner did not finish", "step=%" PRIu64
                   " age_s=%.0f", step, age);
    } else if (st != 200) {
        goto out;
    }
    int wrote;
    if (write_index(c, step, why, sizeof(why)) != 0 || (wrote = write_stepfile(c, step, why, sizeof(why))) < 0)
        goto out;
    if (wrote == 0) {
        rc = 0;                 /* another completed this same publish first */
        goto out;
    }
    count(c, &c->publishes, 1);
    sbuf nb = {0};
    for (size_t k = 0; k < c->nm; k++)
        sb_printf(&nb, "%s%s:%.6g", k ? "," : "", c->m[k].node, sqrt(sumsq[k]));
    char *norms = sb_take(&nb);
    dl_log(DL_LOG_INFO, "cluster", "published", "step=%" PRIu64 " generation=%u nodes=%zu shards=%u norms=%s", step,
           c->gen, c->nm, c->cfg.shards, norms ? norms : "");
    free(norms);
    collect_garbage(c, step);
    rc = 0;
out:
    if (rc != 0 && why[0]) {
        dl_log(DL_LOG_WARN, "cluster", "publish not done", "step=%" PRIu64 " why=%s", step, why);
        fail_view(c, "publishing step %" PRIu64 ": %s", step, why);
    }
    s3s_resp_free(&r);
    free(sumsq);
    free(rel);
    return rc;
}

/* ---- the step ------------------------------------------------------------------------------------- */

static void step_reset_view(cluster *c, uint64_t step);

/* ---- a delta refused for its values ----------------------------------------------------------------
 * Its values are only read shard by shard, after the manifest is fixed: whoever finds a value intake would
 * refuse writes refused[.g<g>].json once, naming the node and the shard; every aggregator checks it by
 * reading that node's slice of that shard itself (a refusal a bucket writer planted names a valid slice, and
 * is ignored), then the next generation's manifest is the same one without that node, the same bytes from
 * whoever derives it, written once.  Every shard is computed again under the new generation's names. */

static void write_refusal(cluster *c, uint64_t step, uint32_t i, size_t k)
{
    char *rel = refusal_rel(step, c->gen);
    sbuf b = {0};
    s3s_resp r;
    char why[1024];
    if (rel == NULL)
        return;
    sb_printf(&b, "{\"outer_step\": %" PRIu64 ", \"generation\": %u, \"shard\": %" PRIu32 ", \"node\": ", step,
              c->gen, i);
    sb_json_string(&b, c->m[k].node, strlen(c->m[k].node));
    sb_str(&b, "}\n");
    if (!b.oom) {
        long st = put_small(c, rel, b.p, b.len, NULL, 1, &r, why, sizeof(why));
        if (st == 200)
            dl_log(DL_LOG_WARN, "cluster", "refusal written", "step=%" PRIu64 " generation=%u shard=%" PRIu32
                   " node=%s", step, c->gen, i, c->m[k].node);
        s3s_resp_free(&r);
    }
    free(b.p);
    free(rel);
}

/* Reads node k's slice of shard i again: 1 its values are refused, 0 they are not, -1 unknown. */
static int verify_refusal(cluster *c, uint64_t step, uint32_t i, size_t k)
{
    char dir[600], gpath[700], dpath[700], why[1024];
    st_file *gf = NULL;
    dl_error err;
    int fenced = 0, rc = -1;

    if (c->m[k].gone) {
        /* confirmed by the bucket itself: the manifest's version of it is still not there */
        source probe = {0};
        char etag[80];
        snprintf(etag, sizeof(etag), "%s", c->m[k].s.etag);
        if ((probe.rel = strdup(c->m[k].s.rel)) == NULL)
            return -1;
        int r = read_header(c, &probe, etag, why, sizeof(why));
        long status = probe.status;
        source_free(&probe);
        return r != 0 && (status == 404 || status == 412) ? 1 : -1;
    }
    snprintf(dir, sizeof(dir), "%s/%" PRIu64 "-%" PRIu32 "-verify", c->scratch, step, i);
    store_remove_tree(dir);
    if (fsu_mkdirs(dir, &err) != 0)
        return -1;
    snprintf(gpath, sizeof(gpath), "%s/global.safetensors", dir);
    snprintf(dpath, sizeof(dpath), "%s/delta.safetensors", dir);
    if (fetch_global_slice(c, i, gpath, &fenced, step, 0, why, sizeof(why)) == 0 && st_open(gpath, &gf, &err) == 0) {
        int v = slice_and_check(c, dpath, gf->h, k, i, step, 0, &fenced, why, sizeof(why));
        rc = v == -3 ? 1 : v == 0 ? 0 : -1;
        if (v == -3)
            dl_log(DL_LOG_ERROR, "cluster", "delta refused for its values", "step=%" PRIu64 " shard=%" PRIu32 " why=%s",
                   step, i, why);
    }
    st_close(gf);
    store_remove_tree(dir);
    return rc;
}

/* 1: a refusal of this generation was verified and the next generation adopted; 0: none (or an unfounded
 * one, ignored); -1: the step cannot go on (too few nodes left, or a next manifest that is not ours). */
static int check_refusal(cluster *c, uint64_t step)
{
    char *rel = refusal_rel(step, c->gen), *next = NULL, *text = NULL;
    char why[1024];
    s3s_resp r;
    const node_delta **keep = NULL;
    int rc = 0;

    memset(&r, 0, sizeof(r));
    if (rel == NULL || get_small(c, rel, CLAIM_CAP, &r, why, sizeof(why)) != 1 ||
        strcmp(r.etag, c->refusal_ignored) == 0)
        goto out;
    cJSON *j = cJSON_ParseWithLength(r.body.p, r.body.len);
    const char *node = json_str(j, "node");
    uint64_t s = 0, g = 0, shard = 0;
    size_t k = c->nm;
    if (node != NULL && json_u64(j, "outer_step", &s) == 0 && json_u64(j, "generation", &g) == 0 &&
        json_u64(j, "shard", &shard) == 0 && s == step && g == c->gen && shard < c->cfg.shards)
        for (k = 0; k < c->nm && strcmp(c->m[k].node, node) != 0; k++)
            ;
    cJSON_Delete(j);
    int v = k < c->nm ? verify_refusal(c, step, (uint32_t)shard, k) : 0;
    if (v <= 0) {
        if (v == 0) {
            dl_log(DL_LOG_ERROR, "cluster", "a refusal names a delta whose values are valid: ignored", "key=%s", rel);
            snprintf(c->refusal_ignored, sizeof(c->refusal_ignored), "%s", r.etag);
        }
        goto out;
    }
    size_t left = c->nm - 1, min = c->cfg.min_nodes ? c->cfg.min_nodes : 1;
    if (left < min) {
        dl_log(DL_LOG_ERROR, "cluster", "step refused: too few nodes are left without the refused delta",
               "step=%" PRIu64 " nodes_left=%zu min_nodes=%zu", step, left, min);
        fail_view(c, "step %" PRIu64 ": node %s's delta refused, %zu nodes left (min_nodes %zu)", step, c->m[k].node,
                  left, min);
        rc = -1;
        goto out;
    }
    if ((keep = calloc(left ? left : 1, sizeof(*keep))) == NULL)
        goto out;
    for (size_t x = 0, n = 0; x < c->nm; x++)
        if (x != k)
            keep[n++] = &c->m[x];
    if ((text = manifest_text(c, step, c->gen + 1, keep, left)) == NULL || (next = manifest_rel(step, c->gen + 1)) == NULL)
        goto out;
    s3s_resp_free(&r);
    long st = put_small(c, next, text, strlen(text), NULL, 1, &r, why, sizeof(why));
    if (st == 412) {
        s3s_resp_free(&r);
        if (get_small(c, next, strlen(text) + 1, &r, why, sizeof(why)) != 1 || r.body.len != strlen(text) ||
            memcmp(r.body.p, text, r.body.len) != 0) {
            dl_log(DL_LOG_ERROR, "cluster", "the next generation's manifest is not the one derived: step refused",
                   "key=%s", next);
            fail_view(c, "step %" PRIu64 ": %s is not the manifest derived from the refusal", step, next);
            rc = -1;
            goto out;
        }
    } else if (st != 200) {
        goto out;
    }
    dl_log(DL_LOG_WARN, "cluster", "a delta refused for its values: the round goes on without it",
           "step=%" PRIu64 " node=%s generation=%u nodes=%zu", step, c->m[k].node, c->gen + 1, left);
    source_free(&c->m[k].s);
    memmove(&c->m[k], &c->m[k + 1], (c->nm - k - 1) * sizeof(*c->m));
    c->nm--;
    c->gen++;
    count(c, &c->refusals, 1);
    step_reset_view(c, step);
    set_state(c, "aggregating");
    rc = 1;
out:
    s3s_resp_free(&r);
    free(rel);
    free(next);
    free(text);
    free(keep);
    return rc;
}

/* Who takes part in step: each aggregator that agreed on the manifest announces itself
 * (global/steps/<s>/join-<instance>), waits a window of four polls, and reads who did: K and its rank among
 * them decide which shards it takes first (i % K == rank), so that the work is shared evenly instead of
 * going to whoever saw the manifest first.  Only a preference: the others' shards are taken too once
 * they are still unclaimed a moment later (a member that died, or joined late), and claims decide. */
static void join_step(cluster *c, uint64_t step, unsigned *k, unsigned *rank)
{
    char *rel = rel_printf("global/steps/%" PRIu64 "/join-%s", step, c->instance);
    char *dir = rel_printf("global/steps/%" PRIu64 "/", step);
    char why[1024], **keys = NULL;
    size_t n = 0;
    s3s_resp r;

    *k = 1;
    *rank = 0;
    if (rel == NULL || dir == NULL)
        goto out;
    if (put_small(c, rel, "{}\n", 3, NULL, 0, &r, why, sizeof(why)) != 200) {
        s3s_resp_free(&r);
        goto out;
    }
    s3s_resp_free(&r);
    /* the last to adopt the manifest may be a poll behind the others, and a poll more if it was still
     * seeing the previous step published */
    double window = 4 * c->cfg.poll_interval + 0.2;
    nap(c, window < c->cfg.lease / 4 ? window : c->cfg.lease / 4);
    if (list_keys(c, dir, &keys, &n, why, sizeof(why)) != 0)
        goto out;
    unsigned members = 0, mine = 0;
    const char *me = strrchr(rel, '/') + 1;
    for (size_t x = 0; x < n; x++) {
        const char *name = strrchr(keys[x], '/');
        name = name ? name + 1 : keys[x];
        if (strncmp(name, "join-", 5) != 0)
            continue;
        if (strcmp(name, me) < 0)
            mine++;
        members++;
    }
    if (members > 0 && mine < members) {
        *k = members;
        *rank = mine;
    }
out:
    keys_free(keys, n);
    free(rel);
    free(dir);
}

/* Shards until every one is done, then the publish; returns once the bucket's step reached step, or a
 * refusal stops the step (then it waits for the bucket to move on). */
static void aggregate(cluster *c, uint64_t step)
{
    uint32_t S = c->cfg.shards;
    unsigned char *done = calloc(S, 1);
    uint32_t *order = calloc(S, sizeof(*order));
    unsigned members, rank;
    int refused = 0;

    if (done == NULL || order == NULL) {
        free(done);
        free(order);
        return;
    }
    join_step(c, step, &members, &rank);
    /* our shards first (a test hook's shard before them), then everyone else's, each from our rank on */
    long hooked = c->stall_shard >= 0 ? c->stall_shard : c->stall_after_pass;
    uint32_t no = 0;
    if (hooked >= 0 && (uint64_t)hooked < S)
        order[no++] = (uint32_t)hooked;
    for (int pass = 0; pass < 2; pass++)
        for (uint32_t x = 0; x < S; x++) {
            uint32_t i = (x + rank) % S;
            if ((i % members == rank) == (pass == 0) && (long)i != hooked)
                order[no++] = i;
        }
    double steal_at = mono() + 1.0;
    dl_log(DL_LOG_DEBUG, "cluster", "joined the step", "step=%" PRIu64 " members=%u rank=%u", step, members, rank);
    set_state(c, "aggregating");
    while (!stopping(c)) {
        int progressed = 0;
        uint32_t ndone = 0;
        for (uint32_t k = 0; k < S && !stopping(c) && !refused; k++) {
            uint32_t i = order[k];
            if (done[i]) {
                ndone++;
                continue;
            }
            /* another member's shard: its own first, ours only once it is still left a moment later */
            if (i % members != rank && (long)i != hooked && mono() < steal_at)
                continue;
            int d = shard_is_done(c, step, i);
            if (d == 1) {
                done[i] = 1;
                ndone++;
                shard_set(c, i, SH_DONE, c->sv[i].epoch, -1);
                continue;
            }
            if (d < 0)
                continue;
            unsigned epoch;
            size_t bad = 0;
            if (claim_try(c, step, i, &epoch) != CLAIM_OURS)
                continue;
            int w = shard_work(c, step, i, epoch, &bad);
            if (w == 0) {
                done[i] = 1;
                ndone++;
                progressed = 1;
            } else if (w == -2) {
                refused = 1;
            } else if (w == -3) {
                write_refusal(c, step, i, bad);
                break;
            }
        }
        if (!refused) {
            /* a delta refused in any shard (by us or another) starts the next generation without it */
            int r = check_refusal(c, step);
            if (r > 0) {
                memset(done, 0, S);
                continue;
            }
            if (r < 0)
                refused = 1;
        }
        if (refused) {
            set_state(c, "refused");
            break;
        }
        if (ndone == S) {
            if (publish(c, step) == 0)
                break;
        }
        int64_t now = bucket_step(c, NULL, 0);
        if (now >= (int64_t)step)
            break;
        if (!progressed)
            nap(c, c->cfg.poll_interval < c->cfg.lease / 4 ? c->cfg.poll_interval : c->cfg.lease / 4);
    }
    free(done);
    free(order);
    if (refused) {
        /* a clear refusal: nothing more is done for this step until the bucket moves on */
        while (!stopping(c) && bucket_step(c, NULL, 0) < (int64_t)step)
            nap(c, c->cfg.poll_interval > 1 ? c->cfg.poll_interval : 1);
    }
}

static void step_reset_view(cluster *c, uint64_t step)
{
    pthread_mutex_lock(&c->mu);
    c->step = (int64_t)step;
    c->manifest = NULL;
    for (uint32_t i = 0; i < c->cfg.shards; i++) {
        c->sv[i].state = SH_UNCLAIMED;
        c->sv[i].epoch = 0;
        c->sv[i].lease_age = -1;
        c->sv[i].bytes_read = 0;
        c->sv[i].foreign_etag[0] = '\0';
    }
    pthread_mutex_unlock(&c->mu);
}

/* Collects round step until its manifest is agreed, then aggregates it. */
static void run_step(cluster *c, uint64_t step)
{
    char why[1024];
    int warned = 0;

    round_forget(c);
    c->gen = 0;
    c->refusal_ignored[0] = '\0';
    round_reset(&c->rnd, step - 1);   /* round.c's step: the base its deltas name */
    step_reset_view(c, step);
    set_state(c, "collecting");
    while (!stopping(c)) {
        int m = manifest_read(c, step, why, sizeof(why));
        if (m == 1) {
            pthread_mutex_lock(&c->mu);
            c->manifest = "adopted";
            pthread_mutex_unlock(&c->mu);
            dl_log(DL_LOG_INFO, "cluster", "manifest adopted", "step=%" PRIu64 " nodes=%zu", step, c->nm);
            break;
        }
        if (m < 0) {
            if (!warned)
                dl_log(DL_LOG_ERROR, "cluster", "manifest refused: the step waits for the bucket to move on",
                       "step=%" PRIu64 " why=%s", step, why);
            warned = 1;
            fail_view(c, "step %" PRIu64 ": manifest refused: %s", step, why);
            set_state(c, "refused");
            for (size_t i = 0; i < c->nm; i++)
                source_free(&c->m[i].s);
            free(c->m);
            c->m = NULL;
            c->nm = 0;
            nap(c, c->cfg.poll_interval > 1 ? c->cfg.poll_interval : 1);
            if (bucket_step(c, NULL, 0) >= (int64_t)step)
                return;
            continue;
        }
        poll_deltas(c, step);
        round_close_reason reason;
        if (round_should_close(&c->rnd, mono(), &reason)) {
            dl_log(DL_LOG_INFO, "cluster", "round closed", "step=%" PRIu64 " nodes=%zu reason=%s", step, c->rnd.n,
                   round_close_reason_name(reason));
            if (manifest_write(c, step, why, sizeof(why)) == 0)
                break;
            dl_log(DL_LOG_WARN, "cluster", "manifest not agreed", "step=%" PRIu64 " why=%s", step, why);
            for (size_t i = 0; i < c->nm; i++)
                source_free(&c->m[i].s);
            free(c->m);
            c->m = NULL;
            c->nm = 0;
        }
        if (bucket_step(c, NULL, 0) >= (int64_t)step)
            return;
        nap(c, c->cfg.poll_interval);
    }
    if (!stopping(c))
        aggregate(c, step);
}

static void *cluster_main(void *arg)
{
    cluster *c = arg;
    char why[1024];
    int warned = 0;

    while (!stopping(c)) {
        int g = sync_global(c, why, sizeof(why));
        if (g < 0) {
            if (!warned)
                dl_log(DL_LOG_WARN, "cluster", "no usable global in the bucket yet", "why=%s", why);
            warned = 1;
            fail_view(c, "%s", why);
            if (!c->g.loaded)
                set_state(c, "waiting_for_global");
            nap(c, c->cfg.poll_interval > 0.5 ? c->cfg.poll_interval : 0.5);
            continue;
        }
        warned = 0;
        if (!stepcount_step_ok(c->g.step)) {
            fail_view(c, "the bucket's step %" PRIu64 " is past the largest", c->g.step);
            nap(c, 5);
            continue;
        }
        run_step(c, c->g.step + 1);
    }
    uv_async_send(&c->done_async);
    return NULL;
}

/* ---- lifecycle and view ----------------------------------------------------------------------------- */

static void async_closed(uv_handle_t *h)
{
    cluster *c = h->data;
    if (c->stopped != NULL)
        c->stopped(c->stopped_arg);
}

static void thread_ended(uv_async_t *a)
{
    cluster *c = a->data;
    pthread_join(c->thread, NULL);
    uv_close((uv_handle_t *)&c->done_async, async_closed);
}

int cluster_start(cluster **out, uv_loop_t *loop, const cluster_config *cfg, const s3_access *a,
                  void (*stopped)(void *), void *arg, dl_error *err)
{
    cluster *c = calloc(1, sizeof(*c));
    unsigned char rnd[6];

    *out = NULL;
    if (c == NULL)
        return dl_fail(err, DL_E_NO_MEMORY, NULL, 0, "out of memory");
    c->cfg = *cfg;
    c->a = *a;
    c->loop = loop;
    c->stopped = stopped;
    c->stopped_arg = arg;
    c->step = -1;
    c->published_step = -1;
    c->state = "waiting_for_global";
    c->stall_shard = test_hook("DILOCOD_TEST_CLUSTER_STALL");
    c->stall_after_pass = test_hook("DILOCOD_TEST_CLUSTER_STALL_AFTER_PASS");
    pthread_mutex_init(&c->mu, NULL);
    round_init(&c->rnd, 0, cfg->expected_nodes, cfg->allow, cfg->nallow, cfg->min_nodes, cfg->round_timeout);
    if ((c->scratch = strdup(cfg->scratch_dir)) == NULL || (c->sv = calloc(cfg->shards, sizeof(*c->sv))) == NULL ||
        s3s_init(&c->s3, a, &c->stop) != 0) {
        cluster_free(c);
        return dl_fail(err, DL_E_NO_MEMORY, NULL, 0, "out of memory");
    }
    c->cfg.scratch_dir = c->scratch;
    /* an instance id of this start: a restarted aggregator waits out its own old claims like any other's */
    int fd = open("/dev/urandom", O_RDONLY | O_CLOEXEC);
    if (fd < 0 || read(fd, rnd, sizeof(rnd)) != (ssize_t)sizeof(rnd)) {
        if (fd >= 0)
            close(fd);
        cluster_free(c);
        return dl_fail_errno(err, errno ? errno : EIO, "reading /dev/urandom");
    }
    close(fd);
    snprintf(c->instance, sizeof(c->instance), "%.64s-%02x%02x%02x%02x%02x%02x", cfg->id, rnd[0], rnd[1], rnd[2],
             rnd[3], rnd[4], rnd[5]);
    /* what a killed run left there is of no use: every slice is read again from the bucket */
    store_remove_tree(c->scratch);
    if (fsu_mkdirs(c->scratch, err) != 0) {
        cluster_free(c);
        return -err->code;
    }
    int rc = uv_async_init(loop, &c->done_async, thread_ended);
    if (rc != 0) {
        cluster_free(c);
        return dl_fail(err, DL_E_IO, NULL, 0, "uv_async_init: %s", uv_strerror(rc));
    }
    c->done_async.data = c;
    if (pthread_create(&c->thread, NULL, cluster_main, c) != 0) {
        c->stopped = NULL;
        uv_close((uv_handle_t *)&c->done_async, NULL);
        return dl_fail(err, DL_E_IO, NULL, 0, "cannot start the cluster's thread");
    }
    dl_log(DL_LOG_INFO, "cluster", "started", "instance=%s shards=%u lease_s=%g", c->instance, cfg->shards, cfg->lease);
    *out = c;
    return 0;
}

void cluster_stop(cluster *c)
{
    atomic_store(&c->stop, 1);
}

void cluster_free(cluster *c)
{
    if (c == NULL)
        return;
    round_forget(c);
    round_free(&c->rnd);
    gmodel_free(&c->g);
    s3s_free(&c->s3);
    pthread_mutex_destroy(&c->mu);
    free(c->sv);
    free(c->scratch);
    free(c);
}

const char *cluster_state(cluster *c, int64_t *published_step)
{
    pthread_mutex_lock(&c->mu);
    const char *s = c->state;
    *published_step = c->published_step;
    pthread_mutex_unlock(&c->mu);
    return s;
}

void cluster_status_json(cluster *c, sbuf *b)
{
    pthread_mutex_lock(&c->mu);
    sb_printf(b, "{\"shards\": %u, \"instance\": ", c->cfg.shards);
    sb_json_string(b, c->instance, strlen(c->instance));
    sb_printf(b, ", \"lease_s\": %g, \"state\": \"%s\", \"step\": %" PRId64 ", \"published_step\": %" PRId64
              ", \"manifest\": ", c->cfg.lease, c->state, c->step, c->published_step);
    if (c->manifest)
        sb_printf(b, "\"%s\"", c->manifest);
    else
        sb_str(b, "null");
    sb_str(b, ", \"held\": [");
    int first = 1;
    for (uint32_t i = 0; i < c->cfg.shards; i++)
        if (c->sv[i].state == SH_OURS) {
            sb_printf(b, "%s%" PRIu32, first ? "" : ", ", i);
            first = 0;
        }
    sb_str(b, "], \"per_shard\": [");
    for (uint32_t i = 0; i < c->cfg.shards; i++) {
        const shard_view *s = &c->sv[i];
        sb_printf(b, "%s{\"shard\": %" PRIu32 ", \"state\": \"%s\", \"epoch\": %u, \"lease_age_s\": ", i ? ", " : "", i,
                  shard_state_name[s->state], s->epoch);
        if (s->lease_age >= 0)
            sb_printf(b, "%.3f", s->lease_age);
        else
            sb_str(b, "null");
        sb_printf(b, ", \"bytes_read\": %" PRIu64 "}", s->bytes_read);
    }
    sb_printf(b, "], \"bytes_read\": %" PRIu64 ", \"bytes_written\": %" PRIu64 ", \"shards_done\": %" PRIu64
              ", \"takeovers\": %" PRIu64 ", \"fenced\": %" PRIu64 ", \"publishes\": %" PRIu64 ", \"refusals\": %" PRIu64
              ", \"requests\": %" PRIu64 ", \"retries\": %" PRIu64 ", \"seconds\": {\"read\": %.3f, \"pass\": %.3f, "
              "\"write\": %.3f}, \"last_error\": ",
              c->bytes_read, c->bytes_written, c->shards_done, c->takeovers, c->fenced, c->publishes, c->refusals,
              (uint64_t)atomic_load(&c->s3.requests), (uint64_t)atomic_load(&c->s3.retries), c->read_s, c->pass_s,
              c->write_s);
    sb_json_string(b, c->last_error, strlen(c->last_error));
    sb_str(b, "}");
    pthread_mutex_unlock(&c->mu);
}

void cluster_metrics(cluster *c, sbuf *b)
{
    unsigned held = 0;
    pthread_mutex_lock(&c->mu);
    for (uint32_t i = 0; i < c->cfg.shards; i++)
        held += c->sv[i].state == SH_OURS;
    sb_printf(b, "# HELP dilocod_cluster_bytes_read_total Bytes read from the bucket for shards (delta ranges, the previous global, the momentum).\n"
              "# TYPE dilocod_cluster_bytes_read_total counter\ndilocod_cluster_bytes_read_total %" PRIu64 "\n"
              "# HELP dilocod_cluster_bytes_written_total Shard outputs written to the bucket.\n"
              "# TYPE dilocod_cluster_bytes_written_total counter\ndilocod_cluster_bytes_written_total %" PRIu64 "\n"
              "# HELP dilocod_cluster_shards_done_total Shards this aggregator completed.\n"
              "# TYPE dilocod_cluster_shards_done_total counter\ndilocod_cluster_shards_done_total %" PRIu64 "\n"
              "# HELP dilocod_cluster_takeovers_total Expired shard claims this aggregator took over.\n"
              "# TYPE dilocod_cluster_takeovers_total counter\ndilocod_cluster_takeovers_total %" PRIu64 "\n"
              "# HELP dilocod_cluster_fenced_total Shards this aggregator lost to a taker before writing.\n"
              "# TYPE dilocod_cluster_fenced_total counter\ndilocod_cluster_fenced_total %" PRIu64 "\n"
              "# HELP dilocod_cluster_publishes_total Steps this aggregator published.\n"
              "# TYPE dilocod_cluster_publishes_total counter\ndilocod_cluster_publishes_total %" PRIu64 "\n"
              "# HELP dilocod_cluster_shards_held Shard claims this aggregator holds now.\n"
              "# TYPE dilocod_cluster_shards_held gauge\ndilocod_cluster_shards_held %u\n"
              "# HELP dilocod_cluster_lease_age_seconds Age of each shard's claim as last seen (ours: since its renewal).\n"
              "# TYPE dilocod_cluster_lease_age_seconds gauge\n",
              c->bytes_read, c->bytes_written, c->shards_done, c->takeovers, c->fenced, c->publishes, held);
    for (uint32_t i = 0; i < c->cfg.shards; i++)
        if (c->sv[i].lease_age >= 0)
            sb_printf(b, "dilocod_cluster_lease_age_seconds{shard=\"%" PRIu32 "\"} %.3f\n", i, c->sv[i].lease_age);
    pthread_mutex_unlock(&c->mu);
}
