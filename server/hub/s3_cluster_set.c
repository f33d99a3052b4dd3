/* s3_cluster_set: a node's sharded delta set in a cluster (README, "Scaling out"): the Hugging Face index +
 * shards convention (common/st_index.h) under nodes/<id>/, one delta of its node.  It is taken only when its
 * index and every shard the index names are listed, and it is checked as the single aggregator checks one
 * (server/README.md, "Sharded checkpoints in full"): the index strictly parsed under the cap a delta index of
 * this model can need, the set's metadata rules on the index's metadata, each shard's header against the
 * global's tensors it holds (headers together within one header's cap), the set's consistency
 * (st_index_check_set), then the union of its tensors as one delta's.  The manifest names the index and
 * each part (key, ETag, size, header hash); a shard's slice reads each tensor from the part that holds it
 * (s3_cluster_shard.c, with the parts' ETags), and a part gone or rewritten after the manifest is refused as a
 * single delta is (s3_cluster_refusal.c). */
#include "s3_cluster_internal.h"

#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cJSON.h>

#include "delta.h"
#include "dl_log.h"
#include "hub_set.h"
#include "s3_sync.h"
#include "st_index.h"

/* A node's directory holds its shards of every set it left there: the stash keeps a set's worth and more
 * (a set has at most one shard per tensor of the model), and past that the node's sets wait, said once. */
#define STASH_MIN 1024u

void cl_delta_free(node_delta *d)
{
    cl_source_free(&d->s);
    for (size_t i = 0; i < d->nparts; i++)
        cl_source_free(&d->parts[i]);
    free(d->parts);
    free(d->part_of);
    d->parts = NULL;
    d->nparts = 0;
    d->part_of = NULL;
    d->ver[0] = '\0';
}

uint64_t cl_delta_bytes(const node_delta *d)
{
    uint64_t size = 0;
    if (d->parts == NULL)
        return d->s.size;
    for (size_t i = 0; i < d->nparts; i++)
        size = size + d->parts[i].size < size ? UINT64_MAX : size + d->parts[i].size;
    return size;
}

const char *cl_delta_version(const node_delta *d)
{
    return d->parts != NULL ? d->ver : d->s.etag;
}

void cl_stash_free(set_stash *st)
{
    for (size_t i = 0; i < st->n; i++)
        free(st->e[i].rel);
    free(st->e);
    st->e = NULL;
    st->n = 0;
    st->capped = 0;
    st->node[0] = '\0';
}

void cl_stash_shard(cluster *c, set_stash *st, const char *node, const char *rel, const char *etag, uint64_t size)
{
    if (strcmp(st->node, node) != 0) {
        /* a node's keys are listed together: the previous node's shards are of no more use */
        cl_stash_free(st);
        snprintf(st->node, sizeof(st->node), "%s", node);
    }
    size_t cap = STASH_MIN + 2 * (c->g.h != NULL ? c->g.h->ntensors : 0);
    if (st->n >= cap) {
        if (!st->capped)
            dl_log(c->stash_full_warned ? DL_LOG_DEBUG : DL_LOG_WARN, "cluster", "too many shard files in a node's "
                   "directory: its sets past them wait", "node=%s max=%zu", node, cap);
        st->capped = 1;
        c->stash_full_warned = 1;
        return;
    }
    if (st->n == 0 || (st->n >= 16 && (st->n & (st->n - 1)) == 0)) {
        set_stash_entry *grown = realloc(st->e, (st->n ? 2 * st->n : 16) * sizeof(*grown));
        if (grown == NULL)
            return;
        st->e = grown;
    }
    set_stash_entry *e = &st->e[st->n];
    if ((e->rel = strdup(rel)) == NULL)
        return;
    snprintf(e->etag, sizeof(e->etag), "%s", etag);
    e->size = size;
    st->n++;
}

static const set_stash_entry *stash_find(const set_stash *st, const char *rel)
{
    for (size_t i = 0; i < st->n; i++)
        if (strcmp(st->e[i].rel, rel) == 0)
            return &st->e[i];
    return NULL;
}

/* The directory part of rel, with its slash ("nodes/a/"). */
static size_t dir_len(const char *rel)
{
    const char *slash = strrchr(rel, '/');
    return slash ? (size_t)(slash - rel) + 1 : 0;
}

/* rel's directory + shard i of n's name into out.  0 or -1. */
static int part_rel(const char *index_rel, const char *base, uint32_t i, uint32_t n, char *out, size_t size)
{
    char name[ST_INDEX_BASE_MAX + 64];
    size_t dl = dir_len(index_rel);
    if (st_index_shard_name(base, i, n, name, sizeof(name)) != 0)
        return -1;
    int w = snprintf(out, size, "%.*s%s", (int)dl, index_rel, name);
    return w > 0 && (size_t)w < size ? 0 : -1;
}

static int uint_cmp(const void *a, const void *b)
{
    uint32_t x = *(const uint32_t *)a, y = *(const uint32_t *)b;
    return x < y ? -1 : x > y;
}

/* The shard count n of base for which the stash lists every shard 1..n (the largest such), or 0. */
static uint32_t listed_count(const set_stash *st, const char *index_rel, const char *base)
{
    uint32_t *ns = calloc(st->n ? st->n : 1, sizeof(*ns)), best = 0;
    size_t k = 0, dl = dir_len(index_rel);
    if (ns == NULL)
        return 0;
    for (size_t x = 0; x < st->n; x++) {
        const char *rel = st->e[x].rel;
        uint32_t i, n;
        if (strncmp(rel, index_rel, dl) == 0 && strchr(rel + dl, '/') == NULL &&
            st_index_parse_shard_name(rel + dl, strlen(rel + dl), base, &i, &n) == 0)
            ns[k++] = n;
    }
    /* keys are unique: n entries of count n are shards 1..n */
    qsort(ns, k, sizeof(*ns), uint_cmp);
    for (size_t x = 0; x < k;) {
        size_t run = 1;
        while (x + run < k && ns[x + run] == ns[x])
            run++;
        if (run == ns[x])
            best = ns[x];
        x += run;
    }
    free(ns);
    return best;
}

/* A set's version: its index's ETag, each part's key, ETag and size, in shard order. */
static int set_version(const char *index_etag, const source *parts, size_t n, const uint64_t *sizes, char *out,
                       size_t size)
{
    hub_set_version v;
    hub_set_version_start(&v, index_etag);
    for (size_t i = 0; i < n; i++)
        hub_set_version_add(&v, parts[i].rel, parts[i].etag, sizes[i]);
    return hub_set_version_end(&v, out, size);
}

/* GET of the index (If-Match etag, at most cap bytes) into d->s (its ETag, size, the sha256 of its text,
 * status) and parsed strictly.  0 with *ix; -1 refused (why); -3 not read now (no answer, gone, rewritten). */
static int read_index(cluster *c, node_delta *d, const char *etag, size_t cap, st_index **ix, char *why,
                      size_t why_size)
{
    s3s_req q = S3S_REQ_INIT;
    s3s_resp r;
    char base[ST_INDEX_BASE_MAX + 1];
    dl_error err;
    int rc = -3;

    q.method = "GET";
    q.rel = d->s.rel;
    q.if_match = etag;
    q.body_cap = cap;
    d->s.status = 0;
    if (s3s_do(&c->s3, &q, &r, why, why_size) != 0)
        goto out;
    d->s.status = r.status;
    if (r.status != 200) {
        s3s_describe(&r, why, why_size);
        long st = r.status;
        rc = st == 403 || st == 404 || st == 408 || st == 412 || st == 429 || st >= 500 ? -3 : -1;
        goto out;
    }
    rc = -1;
    snprintf(d->s.etag, sizeof(d->s.etag), "%s", r.etag);
    d->s.size = r.body.len;
    if (cl_sha256_hex(r.body.p ? r.body.p : "", r.body.len, d->s.header_sha) != 0) {
        snprintf(why, why_size, "hashing failed");
        goto out;
    }
    hub_set_index_base(d->s.rel, base, sizeof(base));
    if (st_index_parse_capped(r.body.p ? r.body.p : "", r.body.len, base, cap, ix, &err) != 0) {
        snprintf(why, why_size, "its index: %.300s%s%.200s", err.message, err.tensor[0] ? " tensor=" : "", err.tensor);
        goto out;
    }
    rc = 0;
out:
    s3s_resp_free(&r);
    return rc;
}

/* The set's tensors as one header (the index's metadata), and the part of each. */
static int set_combine(node_delta *d, const st_index *ix, char *why, size_t why_size)
{
    size_t n = 0, k = 0;
    for (size_t i = 0; i < d->nparts; i++)
        n += d->parts[i].h->ntensors;
    st_spec *specs = calloc(n ? n : 1, sizeof(*specs));
    st_kv *kv = calloc(ix->nmeta ? ix->nmeta : 1, sizeof(*kv));
    uint64_t *offs = calloc((n ? n : 1) * 2, sizeof(*offs)), dlen;
    char *json = NULL;
    size_t jl = 0;
    dl_error err;
    int rc = -1;

    if (specs == NULL || kv == NULL || offs == NULL) {
        snprintf(why, why_size, "out of memory");
        goto out;
    }
    for (size_t i = 0; i < d->nparts; i++)
        for (size_t t = 0; t < d->parts[i].h->ntensors; t++, k++) {
            const st_tensor *x = &d->parts[i].h->tensors[t];
            specs[k] = (st_spec){x->name, x->name_len, x->dtype, x->ndim, x->shape};
        }
    for (size_t m = 0; m < ix->nmeta; m++)
        kv[m] = (st_kv){ix->meta[m].key, ix->meta[m].value};
    if (st_header_build(specs, n, kv, ix->nmeta, &json, &jl, offs, &dlen, &err) != 0 ||
        st_header_parse_unsized(json, jl, &d->s.h, &err) != 0) {
        snprintf(why, why_size, "the set's tensors: %.300s", err.message);
        goto out;
    }
    if (d->s.h->ntensors != n || (d->part_of = calloc(n ? n : 1, sizeof(*d->part_of))) == NULL) {
        snprintf(why, why_size, "the set's shards hold the same tensor twice");
        goto out;
    }
    for (size_t t = 0; t < n; t++) {
        const st_tensor *x = &d->s.h->tensors[t];
        const st_index_entry *e = st_index_find(ix, x->name, x->name_len);
        if (e == NULL || e->shard >= d->nparts) {
            snprintf(why, why_size, "the set's tensors do not add up");
            goto out;
        }
        d->part_of[t] = e->shard;
    }
    rc = 0;
out:
    free(specs);
    free(kv);
    free(offs);
    free(json);
    return rc;
}

/* Reads and checks the parts (rel and the ETag to read set in each) of the set whose index is ix, then the
 * whole set: check_delta's codes (-3 with d->parts[i].status the failed read's answer). */
static int set_load(cluster *c, uint64_t step, node_delta *d, const st_index *ix, delta_info *info, char *why,
                    size_t why_size)
{
    const st_header **hs = calloc(d->nparts ? d->nparts : 1, sizeof(*hs));
    const st_tensor **gby = NULL;
    dl_error err;
    uint64_t headers = 0;
    int rc = -1;

    if (hs == NULL) {
        snprintf(why, why_size, "out of memory");
        goto out;
    }
    /* the set's metadata rules, and its agreement with the index's path (node, local step) */
    if (delta_check_meta(ix->meta, ix->nmeta, d->s.rel, info, &err) != 0 ||
        delta_header_by_name(c->g.h, &gby, &err) != 0) {
        snprintf(why, why_size, "%.300s%s%.200s", err.message, err.tensor[0] ? " tensor=" : "", err.tensor);
        goto out;
    }
    for (size_t i = 0; i < d->nparts; i++) {
        source *p = &d->parts[i];
        char etag[80];
        snprintf(etag, sizeof(etag), "%s", p->etag);
        if (cl_read_header(c, p, etag, why, why_size) != 0) {
            long st = p->status;
            rc = st == 0 || st == 403 || st == 404 || st == 408 || st == 412 || st == 429 || st >= 500 ? -3 : -1;
            goto out;
        }
        rc = -1;
        /* the set's headers together within one delta header's cap, as the single aggregator holds them */
        headers += p->data_start - 8;
        if (headers > c->cfg.max_header) {
            snprintf(why, why_size, "the set's headers come to more than %" PRIu64 " bytes (at %s)", c->cfg.max_header,
                     p->rel);
            goto out;
        }
        if (delta_check_shard_header(p->h, gby, c->g.h->ntensors, &info->cz, &err) != 0) {
            snprintf(why, why_size, "%.300s: %.300s%s%.200s", p->rel, err.message, err.tensor[0] ? " tensor=" : "",
                     err.tensor);
            goto out;
        }
        hs[i] = p->h;
    }
    if (st_index_check_set(ix, hs, &err) != 0 || set_combine(d, ix, why, why_size) != 0 ||
        delta_check_header(d->s.h, c->g.h, NULL, info, &err) != 0) {
        if (err.message[0])
            snprintf(why, why_size, "%.300s%s%.200s", err.message, err.tensor[0] ? " tensor=" : "", err.tensor);
        goto out;
    }
    rc = cl_check_round(c, step, info, why, why_size);
out:
    free(hs);
    free(gby);
    return rc;
}

/* Names d's parts after the index (n of them in rel's directory), with no ETag yet.  0 or -1. */
static int parts_new(node_delta *d, const char *base, uint32_t n)
{
    char rel[700];
    if ((d->parts = calloc(n, sizeof(*d->parts))) == NULL)
        return -1;
    d->nparts = n;
    for (uint32_t i = 0; i < n; i++)
        if (part_rel(d->s.rel, base, i, n, rel, sizeof(rel)) != 0 || (d->parts[i].rel = strdup(rel)) == NULL)
            return -1;
    return 0;
}

/* The listed parts' ETags and sizes, and the version: -5 when one is not listed. */
static int parts_listed(const set_stash *st, node_delta *d, const char *etag, char *why, size_t why_size)
{
    uint64_t *sizes = calloc(d->nparts ? d->nparts : 1, sizeof(*sizes));
    int rc = -1;
    if (sizes == NULL)
        return -1;
    for (size_t i = 0; i < d->nparts; i++) {
        const set_stash_entry *e = stash_find(st, d->parts[i].rel);
        if (e == NULL) {
            snprintf(why, why_size, "%s is not listed", d->parts[i].rel);
            rc = -5;
            goto out;
        }
        snprintf(d->parts[i].etag, sizeof(d->parts[i].etag), "%s", e->etag);
        sizes[i] = e->size;
        d->parts[i].size = e->size;
    }
    rc = set_version(etag, d->parts, d->nparts, sizes, d->ver, sizeof(d->ver)) == 0 ? 0 : -1;
out:
    free(sizes);
    return rc;
}

int cl_set_candidate(cluster *c, uint64_t step, const set_stash *st, const char *rel, const char *etag,
                     uint64_t size, const char *node, uint64_t local, node_delta *d, delta_info *info, char *why,
                     size_t why_size)
{
    char base[ST_INDEX_BASE_MAX + 1];
    st_index *ix = NULL;
    int rc = -1;

    snprintf(d->node, sizeof(d->node), "%s", node);
    d->local_step = local;
    why[0] = '\0';
    if ((d->s.rel = strdup(rel)) == NULL)
        return -3;
    hub_set_index_base(rel, base, sizeof(base));
    /* the count whose every shard is listed (normally the index's): the version is known before a request */
    uint32_t n = strcmp(st->node, node) == 0 ? listed_count(st, rel, base) : 0;
    if (n == 0) {
        snprintf(why, why_size, "not every shard of it is listed");
        return -5;
    }
    if (parts_new(d, base, n) != 0 || (rc = parts_listed(st, d, etag, why, why_size)) != 0)
        return rc == -5 ? -5 : -3;
    /* remembered as refused, or taken already in this version: not read again */
    if (cl_is_refused(c, rel, d->ver) || cl_have_delta(c, node, local, d->ver))
        return -7;
    size_t cap = st_index_cap_for(c->g.h);
    if (size > cap) {
        snprintf(why, why_size, "its index is %" PRIu64 " bytes, over the %zu a delta index of this model can need",
                 size, cap);
        return -1;
    }
    if ((rc = read_index(c, d, etag, cap, &ix, why, why_size)) != 0)
        return rc;
    if (ix->nshards != n) {
        /* shards of another count listed beside it: the index says which are the set's */
        char ver[40];
        snprintf(ver, sizeof(ver), "%s", d->ver);
        for (size_t i = 0; i < d->nparts; i++)
            cl_source_free(&d->parts[i]);
        free(d->parts);
        d->parts = NULL;
        d->nparts = 0;
        if (parts_new(d, base, ix->nshards) != 0) {
            rc = -3;
            goto out;
        }
        if ((rc = parts_listed(st, d, etag, why, why_size)) != 0)
            goto out;
        if (cl_is_refused(c, rel, d->ver) || cl_have_delta(c, node, local, d->ver)) {
            rc = -7;
            goto out;
        }
    }
    rc = set_load(c, step, d, ix, info, why, why_size);
out:
    st_index_free(ix);
    return rc;
}

void cl_set_manifest_parts(sbuf *b, const node_delta *d)
{
    if (d->parts == NULL)
        return;
    sb_str(b, ", \"parts\": [");
    for (size_t i = 0; i < d->nparts; i++) {
        const source *p = &d->parts[i];
        sb_str(b, i ? ", {\"key\": " : "{\"key\": ");
        sb_json_string(b, p->rel, strlen(p->rel));
        sb_printf(b, ", \"etag\": \"%s\", \"size\": %" PRIu64 ", \"header_sha256\": \"%s\"}", p->etag, p->size,
                  p->header_sha);
    }
    sb_str(b, "]");
}

/* The manifest's part entry x of set d (its key the one the index's base names): its ETag, size, hash. */
static int adopt_part(const cJSON *x, source *p, uint64_t *size, char hs[65])
{
    const char *key = cl_json_str(x, "key"), *etag = cl_json_str(x, "etag"), *h = cl_json_str(x, "header_sha256");
    if (key == NULL || etag == NULL || h == NULL || strcmp(key, p->rel) != 0 || strlen(etag) >= sizeof(p->etag) ||
        strlen(h) != 64 || cl_json_u64(x, "size", size) != 0)
        return -1;
    snprintf(p->etag, sizeof(p->etag), "%s", etag);
    snprintf(hs, 65, "%s", h);
    return 0;
}

int cl_set_adopt(cluster *c, uint64_t step, const cJSON *e, node_delta *d, delta_info *info, char *why,
                 size_t why_size)
{
    const char *etag = cl_json_str(e, "etag"), *hs = cl_json_str(e, "header_sha256");
    const cJSON *parts = cJSON_GetObjectItemCaseSensitive(e, "parts");
    char base[ST_INDEX_BASE_MAX + 1];
    char (*want)[65] = NULL, (*metag)[80] = NULL;
    uint64_t *sizes = NULL, size = 0;
    st_index *ix = NULL;
    int n = cJSON_IsArray(parts) ? cJSON_GetArraySize(parts) : 0, rc = -1;

    if (etag == NULL || hs == NULL || n <= 0 || (size_t)n > c->g.h->ntensors || cl_json_u64(e, "size", &size) != 0) {
        snprintf(why, why_size, "the manifest's set %.300s has no parts, or more than the model's tensors", d->s.rel);
        return -1;
    }
    hub_set_index_base(d->s.rel, base, sizeof(base));
    if (parts_new(d, base, (uint32_t)n) != 0 || (want = calloc((size_t)n, sizeof(*want))) == NULL ||
        (sizes = calloc((size_t)n, sizeof(*sizes))) == NULL || (metag = calloc((size_t)n, sizeof(*metag))) == NULL) {
        snprintf(why, why_size, "out of memory");
        goto out;
    }
    for (int i = 0; i < n; i++)
        if (adopt_part(cJSON_GetArrayItem(parts, i), &d->parts[i], &sizes[i], want[i]) != 0) {
            snprintf(why, why_size, "the manifest's set %.300s: its part %d is not the index's shard %d", d->s.rel, i,
                     i + 1);
            goto out;
        } else {
            snprintf(metag[i], sizeof(metag[i]), "%s", d->parts[i].etag);
        }
    if (set_version(etag, d->parts, d->nparts, sizes, d->ver, sizeof(d->ver)) != 0)
        goto out;
    size_t cap = st_index_cap_for(c->g.h);
    int v = -1;
    if (size > cap)
        snprintf(why, why_size, "its index is %" PRIu64 " bytes, over the %zu a delta index of this model can need",
                 size, cap);
    else
        v = read_index(c, d, etag, cap, &ix, why, why_size);
    if (v == 0 && (strcmp(d->s.etag, etag) != 0 || strcmp(d->s.header_sha, hs) != 0 || ix->nshards != (uint32_t)n)) {
        snprintf(why, why_size, "the manifest's set %.300s is not the one the bucket holds (ETag, index or parts)",
                 d->s.rel);
        v = -1;
    }
    if (v == 0)
        v = set_load(c, step, d, ix, info, why, why_size);
    for (int i = 0; v == 0 && i < n; i++)
        if (strcmp(d->parts[i].etag, metag[i]) != 0 ||
            strcmp(d->parts[i].header_sha, want[i]) != 0 || d->parts[i].size != sizes[i]) {
            snprintf(why, why_size, "the manifest's part %.300s is not the one the bucket holds", d->parts[i].rel);
            v = -1;
        }
    long st = d->s.status;
    for (size_t i = 0; st != 404 && st != 412 && i < d->nparts; i++)
        st = d->parts[i].status;
    if (v == -3 && (st == 404 || st == 412)) {
        /* rewritten or removed since the manifest was written: the manifest holds, and that node's delta is
         * refused once the step is aggregated (check_refusal), as a single delta found so */
        dl_log(DL_LOG_WARN, "cluster", "a delta set of the manifest is gone from the bucket", "key=%s status=%ld",
               d->s.rel, st);
        st_header_free(d->s.h);
        d->s.h = NULL;
        d->gone = 1;
        v = 0;
    } else if (v != 0) {
        char inner[600];
        snprintf(inner, sizeof(inner), "%.590s", why);
        snprintf(why, why_size, "the manifest's set %.300s: %.600s", d->s.rel, inner);
        goto out;
    }
    /* the manifest's own values (as a single entry's, manifest_adopt): a manifest derived from this one has the
     * same bytes anywhere, and a gone part's probe asks for the version the manifest names */
    for (int i = 0; i < n; i++) {
        snprintf(d->parts[i].etag, sizeof(d->parts[i].etag), "%s", metag[i]);
        snprintf(d->parts[i].header_sha, sizeof(d->parts[i].header_sha), "%s", want[i]);
        d->parts[i].size = sizes[i];
    }
    snprintf(d->s.etag, sizeof(d->s.etag), "%s", etag);
    rc = 0;
out:
    st_index_free(ix);
    free(want);
    free(metag);
    free(sizes);
    return rc;
}

void cl_delta_sources(const node_delta *d, const st_tensor **ts, const source **srcs, size_t n)
{
    for (size_t x = 0; x < n; x++) {
        if (d->parts == NULL) {
            srcs[x] = &d->s;
            continue;
        }
        /* the synthetic header's tensor -> the part that holds it, and its own entry there (its offsets) */
        size_t t = (size_t)(ts[x] - d->s.h->tensors);
        const source *p = &d->parts[d->part_of[t]];
        srcs[x] = p;
        ts[x] = st_header_find(p->h, ts[x]->name, ts[x]->name_len);
    }
}

int cl_delta_gone(cluster *c, const node_delta *d)
{
    char why[1024];
    size_t n = d->parts != NULL ? d->nparts + 1 : 1;
    for (size_t i = 0; i < n; i++) {
        /* read as a header is, with If-Match on the manifest's ETag: only the answer's status is wanted (an
         * index is no safetensors header, and any answer but 404 or 412 says nothing here) */
        const source *want = i == 0 ? &d->s : &d->parts[i - 1];
        source probe = {0};
        char etag[80];
        snprintf(etag, sizeof(etag), "%s", want->etag);
        if ((probe.rel = strdup(want->rel)) == NULL)
            return -1;
        int r = cl_read_header(c, &probe, etag, why, sizeof(why));
        long status = probe.status;
        cl_source_free(&probe);
        if (r != 0 && (status == 404 || status == 412))
            return 1;
    }
    return -1;
}
