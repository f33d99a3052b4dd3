/* s3_cluster_refusal: see s3_cluster_internal.h.  The deltas a cluster does not take: the memory of those
 * not to look at again, across steps, and the verdicts on a manifest's deltas once its shards are read (a
 * value intake would refuse, a version gone from the bucket, an overflow), which every aggregator checks
 * for itself before it derives the next generation's manifest.  The step's protocol is in s3_cluster.c. */
#include "s3_cluster_internal.h"

#include <inttypes.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cJSON.h>
#include <xxhash.h>

#include "dl_log.h"
#include "fsutil.h"
#include "store.h"

/* ---- deltas not to look at again -------------------------------------------------------------------
 * A delta refused (its header, a set, its values, an overflow) or stale is not peeked at again in that
 * version, across steps: a nodes/ writer's junk, or a worker's own old deltas, cost their entry in the
 * listing and nothing more, and are logged once.  The entries are seen.h's map (the one the s3://
 * transport's seen list is), keyed by a seeded XXH3-128 of "key\tETag" in hex: 33 bytes whatever a key's
 * length, and a writer who picks key names cannot aim them at one probe chain (the seed is this start's).
 * The map follows the bucket (an entry that a complete listing no longer holds is dropped) and holds at
 * most REFUSED_MAX entries (about 10 MiB); past that a refusal is not remembered, and its delta is peeked
 * at in every poll (logged at debug level), which a warning says once. */
#define REFUSED_MAX 100000u

static int refused_id(const cluster *c, const char *key, const char *etag, char out[33])
{
    char *s = cl_rel_printf("%s\t%s", key, etag);
    if (s == NULL)
        return -1;
    XXH128_hash_t h = XXH3_128bits_withSeed(s, strlen(s), c->refused_seed);
    free(s);
    snprintf(out, 33, "%016" PRIx64 "%016" PRIx64, (uint64_t)h.high64, (uint64_t)h.low64);
    return 0;
}

/* Whether (key, etag) is remembered; one that is stays for as long as listings hold it. */
int cl_is_refused(cluster *c, const char *key, const char *etag)
{
    char id[33];
    seen_entry *e = refused_id(c, key, etag, id) == 0 ? seen_find(&c->refused, id) : NULL;
    if (e == NULL)
        return 0;
    e->listed = c->polls;
    return 1;
}

/* The view's count of remembered deltas (the map is the thread's). */
void cl_refused_view(cluster *c)
{
    pthread_mutex_lock(&c->mu);
    c->refused_count = c->refused.count;
    pthread_mutex_unlock(&c->mu);
}

/* Remembers (key, etag): 1 newly, 0 already, -1 not (the map is full, or out of memory). */
int cl_remember(cluster *c, const char *key, const char *etag, enum refusal_kind kind)
{
    char id[33];
    int created = 0;
    seen_entry *e = NULL;

    if (refused_id(c, key, etag, id) != 0)
        return -1;
    if ((e = seen_find(&c->refused, id)) == NULL) {
        if (c->refused.count >= REFUSED_MAX) {
            if (!c->refused_full_warned)
                dl_log(DL_LOG_WARN, "cluster", "too many refused deltas to remember: the others are looked at again "
                       "at every poll", "max=%u", REFUSED_MAX);
            c->refused_full_warned = 1;
            return -1;
        }
        if ((e = seen_get(&c->refused, id, &created)) == NULL)
            return -1;
    }
    /* a refusal for good outranks one for this round */
    if (created || kind == REFUSED_FOR_GOOD)
        e->state = (seen_state)kind;
    e->listed = c->polls;
    if (created)
        cl_refused_view(c);
    return created;
}

/* A delta not to look at again: refused (counted, at warn level, once), or stale (a previous round's). */
void cl_refuse(cluster *c, const char *key, const char *etag, const char *why, enum refusal_kind kind)
{
    int fresh = cl_remember(c, key, etag, kind);
    if (fresh == 0)
        return;
    /* one not remembered would be logged at every poll */
    dl_log(kind == REFUSED_STALE || fresh < 0 ? DL_LOG_DEBUG : DL_LOG_WARN, "cluster",
           kind == REFUSED_STALE ? "delta of an earlier round" : "delta refused", "key=%s why=%s", key, why);
    if (kind != REFUSED_STALE)
        cl_count(c, &c->refusals, 1);
}

static int keep_not_this_round(const seen_entry *e, void *arg)
{
    (void)arg;
    return e->state != (seen_state)REFUSED_THIS_ROUND;
}

static int keep_listed(const seen_entry *e, void *arg)
{
    return e->listed == *(const uint64_t *)arg;
}

void cl_forget_this_round(cluster *c)
{
    seen_prune(&c->refused, keep_not_this_round, NULL);
    cl_refused_view(c);
}

void cl_forget_unlisted(cluster *c)
{
    seen_prune(&c->refused, keep_listed, &c->polls);
    cl_refused_view(c);
}

/* ---- a delta refused for its values ----------------------------------------------------------------
 * Its values are only read shard by shard, after the manifest is fixed: whoever finds a value intake would
 * refuse writes refused[.g<g>].json once, naming the node and the shard; every aggregator checks it by
 * reading that node's slice of that shard itself (a refusal a bucket writer planted names a valid slice, and
 * is ignored), then the next generation's manifest is the same one without that node, the same bytes from
 * whoever derives it, written once.  Every shard is computed again under the new generation's names. */

void cl_write_refusal(cluster *c, uint64_t step, uint32_t i, size_t k)
{
    char *rel = cl_refusal_rel(step, c->gen);
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
        long st = cl_put_small(c, rel, b.p, b.len, NULL, 1, &r, why, sizeof(why));
        if (st == 200)
            dl_log(DL_LOG_WARN, "cluster", "refusal written", "step=%" PRIu64 " generation=%u shard=%" PRIu32
                   " node=%s", step, c->gen, i, c->m[k].node);
        s3s_resp_free(&r);
    }
    free(b.p);
    free(rel);
}

/* The delta of largest norm by the markers' sums (the first of equals in the manifest's, node id, order: the
 * single aggregator's choice). */
static size_t largest_delta(const double *sumsq, size_t n)
{
    size_t worst = 0;
    for (size_t k = 1; k < n; k++)
        if (sumsq[k] > sumsq[worst])
            worst = k;
    return worst;
}

/* Every shard has its marker and at least one pass overflowed: the step is computed again without the delta
 * of largest norm, which refused[.g<g>].json names (reason "overflow"), written once; every aggregator checks
 * it against the markers itself (verify_overflow), so all agree on the verdict. */
void cl_write_overflow_refusal(cluster *c, uint64_t step, const double *sumsq, uint32_t overflowed)
{
    char *rel = cl_refusal_rel(step, c->gen);
    size_t k = largest_delta(sumsq, c->nm);
    sbuf b = {0};
    s3s_resp r;
    char why[1024];
    if (rel == NULL || c->nm == 0) {
        free(rel);
        return;
    }
    sb_printf(&b, "{\"outer_step\": %" PRIu64 ", \"generation\": %u, \"reason\": \"overflow\", \"node\": ", step,
              c->gen);
    sb_json_string(&b, c->m[k].node, strlen(c->m[k].node));
    sb_str(&b, "}\n");
    if (!b.oom) {
        long st = cl_put_small(c, rel, b.p, b.len, NULL, 1, &r, why, sizeof(why));
        if (st == 200)
            dl_log(DL_LOG_WARN, "cluster", "the step overflowed: refusal of the delta of largest norm written",
                   "step=%" PRIu64 " generation=%u shards_overflowed=%" PRIu32 " node=%s norm=%.6g", step, c->gen,
                   overflowed, c->m[k].node, sqrt(sumsq[k]));
        s3s_resp_free(&r);
    }
    free(b.p);
    free(rel);
}

/* An overflow's refusal naming node k holds when every shard of this generation has its marker, at least one
 * of them an overflow, and k's delta is the one of largest norm by the markers' sums: 1 it holds, 0 it does
 * not, -1 unknown for now (a marker missing or unreadable). */
static int verify_overflow(cluster *c, uint64_t step, size_t k)
{
    double *sumsq = calloc(c->nm ? c->nm : 1, sizeof(*sumsq));
    uint32_t overflowed = 0;
    char why[1024];
    int rc = -1;

    if (sumsq != NULL && cl_check_outputs(c, step, sumsq, &overflowed, why, sizeof(why)) == 0)
        rc = overflowed > 0 && largest_delta(sumsq, c->nm) == k;
    free(sumsq);
    return rc;
}

/* Reads node k's slice of shard i again: 1 its values are refused, 0 they are not, -1 unknown. */
static int verify_refusal(cluster *c, uint64_t step, uint32_t i, size_t k)
{
    char dir[600], gpath[700], dpath[700], why[1024];
    st_file *gf = NULL;
    dl_error err;
    int fenced = 0, rc = -1;

    if (c->m[k].gone)
        /* confirmed by the bucket itself: the manifest's version of it (a set: of one of its files) is still not
         * there */
        return cl_delta_gone(c, &c->m[k]);
    snprintf(dir, sizeof(dir), "%s/%" PRIu64 "-%" PRIu32 "-verify", c->scratch, step, i);
    store_remove_tree(dir);
    if (fsu_mkdirs(dir, &err) != 0)
        return -1;
    snprintf(gpath, sizeof(gpath), "%s/global.safetensors", dir);
    snprintf(dpath, sizeof(dpath), "%s/delta.safetensors", dir);
    if (cl_fetch_global_slice(c, i, gpath, &fenced, step, 0, why, sizeof(why)) == 0 && st_open(gpath, &gf, &err) == 0) {
        int v = cl_slice_and_check(c, dpath, gf->h, k, i, step, 0, &fenced, why, sizeof(why));
        rc = v == -3 ? 1 : v == 0 ? 0 : -1;
        if (v == -3)
            dl_log(DL_LOG_ERROR, "cluster", "delta refused for its values", "step=%" PRIu64 " shard=%" PRIu32 " why=%s",
                   step, i, why);
    }
    st_close(gf);
    store_remove_tree(dir);
    return rc;
}

/* No subset of the round's deltas down to --min-nodes made a finite step: the round is discarded (every one
 * of its deltas remembered, so the same inputs never run again), the published step stays, and /status says
 * output_overflow until a later step is published.  Logged at warning level once per episode. */
static void round_overflowed(cluster *c, uint64_t step)
{
    for (size_t x = 0; x < c->nm; x++)
        cl_remember(c, c->m[x].s.rel, cl_delta_version(&c->m[x]), REFUSED_FOR_GOOD);
    pthread_mutex_lock(&c->mu);
    int again = c->problem != NULL;
    c->problem = "output_overflow";
    pthread_mutex_unlock(&c->mu);
    c->problem_step = step;
    dl_log(again ? DL_LOG_DEBUG : DL_LOG_WARN, "cluster", "no subset of the round's deltas makes a finite step (the "
           "published state is near its dtype's limit): the round is discarded, the published step stays; "
           "problem=output_overflow", "step=%" PRIu64 " generation=%u nodes=%zu", step, c->gen, c->nm);
    cl_fail_view(c, "step %" PRIu64 ": no subset of the round's deltas makes a finite step", step);
}

/* A refusal of this generation: 1 verified, and the next generation (the manifest without the refused
 * delta) adopted; 2 verified, but fewer than --min-nodes would be left: the step goes back to collecting
 * (the next generation's manifest is a new round's, written by whoever closes it), the refused delta (for
 * an overflow, the whole round) remembered so that only new uploads are taken, as a single dilocod keeps
 * collecting; 0 none (or an unfounded one, ignored); -1 the step cannot go on (a next manifest that is not
 * the one derived). */
int cl_check_refusal(cluster *c, uint64_t step)
{
    char *rel = cl_refusal_rel(step, c->gen), *next = NULL, *text = NULL;
    char why[1024];
    s3s_resp r;
    const node_delta **keep = NULL;
    int rc = 0, overflow = 0;

    memset(&r, 0, sizeof(r));
    if (rel == NULL || cl_get_small(c, rel, CLAIM_CAP, &r, why, sizeof(why)) != 1 ||
        strcmp(r.etag, c->refusal_ignored) == 0)
        goto out;
    cJSON *j = cJSON_ParseWithLength(r.body.p, r.body.len);
    const char *node = cl_json_str(j, "node"), *reason = cl_json_str(j, "reason");
    uint64_t s = 0, g = 0, shard = 0;
    size_t k = c->nm;
    overflow = reason != NULL && strcmp(reason, "overflow") == 0;
    if (node != NULL && cl_json_u64(j, "outer_step", &s) == 0 && cl_json_u64(j, "generation", &g) == 0 &&
        (overflow || (cl_json_u64(j, "shard", &shard) == 0 && shard < c->cfg.shards)) && s == step && g == c->gen)
        for (k = 0; k < c->nm && strcmp(c->m[k].node, node) != 0; k++)
            ;
    cJSON_Delete(j);
    int v = k >= c->nm ? 0 : overflow ? verify_overflow(c, step, k) : verify_refusal(c, step, (uint32_t)shard, k);
    if (v <= 0) {
        if (v == 0) {
            dl_log(DL_LOG_ERROR, "cluster", "a refusal names a delta whose values are valid: ignored", "key=%s", rel);
            snprintf(c->refusal_ignored, sizeof(c->refusal_ignored), "%s", r.etag);
        }
        goto out;
    }
    /* that version of the delta is never taken again, whatever comes next */
    cl_remember(c, c->m[k].s.rel, cl_delta_version(&c->m[k]), REFUSED_FOR_GOOD);
    size_t left = c->nm - 1, min = c->cfg.min_nodes ? c->cfg.min_nodes : 1;
    if (left < min) {
        if (overflow) {
            round_overflowed(c, step);
        } else {
            dl_log(DL_LOG_WARN, "cluster", "too few nodes are left without the refused delta: the step collects again",
                   "step=%" PRIu64 " node=%s nodes_left=%zu min_nodes=%zu generation=%u", step, c->m[k].node, left, min,
                   c->gen + 1);
            cl_fail_view(c, "step %" PRIu64 ": node %s's delta refused, %zu nodes left (min_nodes %zu): collecting "
                         "again", step, c->m[k].node, left, min);
        }
        cl_count(c, &c->refusals, 1);
        c->gen++;
        rc = 2;
        goto out;
    }
    if ((keep = calloc(left ? left : 1, sizeof(*keep))) == NULL)
        goto out;
    for (size_t x = 0, n = 0; x < c->nm; x++)
        if (x != k)
            keep[n++] = &c->m[x];
    if ((text = cl_manifest_text(c, step, c->gen + 1, keep, left)) == NULL || (next = cl_manifest_rel(step, c->gen + 1)) == NULL)
        goto out;
    s3s_resp_free(&r);
    long st = cl_put_small(c, next, text, strlen(text), NULL, 1, &r, why, sizeof(why));
    if (st == 412) {
        s3s_resp_free(&r);
        if (cl_get_small(c, next, strlen(text) + 1, &r, why, sizeof(why)) != 1 || r.body.len != strlen(text) ||
            memcmp(r.body.p, text, r.body.len) != 0) {
            dl_log(DL_LOG_ERROR, "cluster", "the next generation's manifest is not the one derived: step refused",
                   "key=%s", next);
            cl_fail_view(c, "step %" PRIu64 ": %s is not the manifest derived from the refusal", step, next);
            rc = -1;
            goto out;
        }
    } else if (st != 200) {
        goto out;
    }
    /* a delta gone from the bucket in the manifest's version (removed, rewritten, or a manifest naming
     * versions that never were) is not a verdict on its values: the log says which it was */
    dl_log(DL_LOG_WARN, "cluster", overflow ? "the step overflowed: the round goes on without the delta of largest norm"
           : c->m[k].gone ? "a delta of the manifest is not in the bucket in its version: the round goes on without it"
           : "a delta refused for its values: the round goes on without it",
           "step=%" PRIu64 " node=%s generation=%u nodes=%zu reason=%s", step, c->m[k].node, c->gen + 1, left,
           overflow ? "overflow" : c->m[k].gone ? "changed" : "values");
    cl_delta_free(&c->m[k]);
    memmove(&c->m[k], &c->m[k + 1], (c->nm - k - 1) * sizeof(*c->m));
    c->nm--;
    c->gen++;
    cl_count(c, &c->refusals, 1);
    cl_step_reset_view(c, step);
    cl_set_state(c, "aggregating");
    rc = 1;
out:
    s3s_resp_free(&r);
    free(rel);
    free(next);
    free(text);
    free(keep);
    return rc;
}
