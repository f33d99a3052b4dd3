/* s3_cluster: see s3_cluster.h.  One thread runs the protocol as plain sequential code: read the
 * bucket's step, collect the next round from the listing (headers only), agree on its manifest, then
 * claim, compute and complete shards until every shard is done (s3_cluster_shard.c), publish once, collect
 * garbage.  The bucket's requests, object names and the global are in s3_cluster_bucket.c. */
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
#include <xxhash.h>

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

static const char *const shard_state_name[] = {"unclaimed", "ours", "foreign", "done"};

/* ---- the round ---------------------------------------------------------------------------------- */

static void round_forget(cluster *c)
{
    for (size_t i = 0; i < c->nnd; i++)
        cl_source_free(&c->nd[i].s);
    free(c->nd);
    c->nd = NULL;
    c->nnd = 0;
    for (size_t i = 0; i < c->nm; i++)
        cl_source_free(&c->m[i].s);
    free(c->m);
    c->m = NULL;
    c->nm = 0;
}

static node_delta *nd_find(cluster *c, const char *node)
{
    for (size_t i = 0; i < c->nnd; i++)
        if (strcmp(c->nd[i].node, node) == 0)
            return &c->nd[i];
    return NULL;
}

/* Checks one delta's header against the global and the round's step (rel, etag from the listing):
 * 0 with s's header read, -1 refused (why), -2 not of this round yet (a later one), -3 not read (no answer,
 * or not that version any more: nothing to remember it by), -4 of an earlier one. */
static int check_delta(cluster *c, uint64_t step, source *s, const char *etag, delta_info *info, char *why,
                       size_t why_size)
{
    dl_error err;
    if (cl_read_header(c, s, etag, why, why_size) != 0) {
        /* no answer, or one that may change (gone, rewritten, throttled, the server's): looked at again; any
         * other is this version's for good (its bytes, an empty object's 416) */
        long st = s->status;
        int again = st == 0 || st == 403 || st == 404 || st == 408 || st == 412 || st == 429 || st >= 500;
        return again ? -3 : -1;
    }
    if (delta_check_header(s->h, c->g.h, s->rel, info, &err) != 0) {
        snprintf(why, why_size, "%.300s%.300s%.300s", err.message, err.tensor[0] ? " tensor=" : "", err.tensor);
        return -1;
    }
    /* weighted_mean takes only deltas that report their weight, as a single dilocod (no_weight) */
    if (c->cfg.rule == OUTER_RULE_WEIGHTED && !(weights_of(&info->metrics) > 0)) {
        snprintf(why, why_size, "missing_weight: --aggregate weighted_mean weighs each delta by its \"weight\" or "
                 "\"num_tokens\" metadata, and this delta has neither (or num_tokens 0)");
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
    char *full = pl ? cl_rel_printf("%s/nodes/", c->a.prefix) : strdup("nodes/");
    int complete = 0;
    if (full == NULL)
        return;
    c->polls++;
    for (unsigned page = 0; page < LIST_PAGES_MAX && !cl_stopping(c); page++) {
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
        for (size_t i = 0; i < l.n && !cl_stopping(c); i++) {
            const s3_object *o = &l.objs[i];
            const char *rel = pl ? o->key + pl + 1 : o->key;
            char node[DELTA_NODE_ID_MAX + 1];
            uint64_t local;
            if (pl && (strncmp(o->key, c->a.prefix, pl) != 0 || o->key[pl] != '/'))
                continue;
            if (cl_is_refused(c, rel, o->etag))
                continue;
            if (delta_parse_path(rel, node, &local, NULL) != 0) {
                delta_path dp;
                if (delta_parse_any_path(rel, &dp, NULL) == 0 && dp.kind == DELTA_PATH_INDEX)
                    cl_refuse(c, rel, o->etag, "a cluster takes single-file deltas, not sets", REFUSED_FOR_GOOD);
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
                    cl_source_free(&have->s);
                    have->s = again;
                    dl_log(DL_LOG_INFO, "cluster", "delta rewritten before the round closed: its new version taken",
                           "key=%s", rel);
                } else {
                    if (v == -1)
                        cl_refuse(c, rel, o->etag, why, REFUSED_FOR_GOOD);
                    cl_source_free(&again);
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
                cl_refuse(c, rel, o->etag, why, v == -4 ? REFUSED_STALE : REFUSED_FOR_GOOD);
            if (v != 0 || strcmp(s.etag, o->etag) != 0) {
                cl_source_free(&s);
                continue;
            }
            char *path = strdup(rel), *replaced = NULL;
            if (path == NULL) {
                cl_source_free(&s);
                continue;
            }
            round_verdict verdict = round_offer(&c->rnd, &info, path, o->size, cl_mono(), 0, &replaced);
            free(replaced);
            if (!round_verdict_taken(verdict)) {
                free(path);
                cl_source_free(&s);
                if (verdict != ROUND_NOT_NEWER)
                    cl_refuse(c, rel, o->etag, round_verdict_name(verdict), REFUSED_THIS_ROUND);
                continue;
            }
            dl_log(DL_LOG_INFO, "cluster", "delta taken", "step=%" PRIu64 " node=%s local_step=%" PRIu64 " verdict=%s",
                   step, node, local, round_verdict_name(verdict));
            if (have == NULL) {
                node_delta *grown = realloc(c->nd, (c->nnd + 1) * sizeof(*grown));
                if (grown == NULL) {
                    cl_source_free(&s);
                    continue;
                }
                c->nd = grown;
                have = &c->nd[c->nnd++];
                memset(have, 0, sizeof(*have));
                snprintf(have->node, sizeof(have->node), "%s", node);
            }
            cl_source_free(&have->s);
            have->s = s;
            have->local_step = local;
        }
        free(token);
        token = l.truncated && l.next_token ? strdup(l.next_token) : NULL;
        s3_listing_free(&l);
        if (token == NULL) {
            complete = !cl_stopping(c);
            break;
        }
    }
    free(token);
    free(full);
    /* what the whole listing no longer holds is forgotten: the map follows the bucket */
    if (complete) {
        cl_forget_unlisted(c);
    }
}

/* ---- the manifest --------------------------------------------------------------------------------- */

/* A manifest's text from its nodes (in node order): the same bytes from every aggregator that derives it */
char *cl_manifest_text(const cluster *c, uint64_t step, unsigned gen, const node_delta *const *nodes, size_t n)
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

/* The closed round's manifest (generation 0, or the one after a refusal that sent the step back to
 * collecting). */
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
    char *text = cl_manifest_text(c, step, c->gen, nodes, n);
    free(nodes);
    return text;
}

int cl_json_u64(const cJSON *o, const char *k, uint64_t *out)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, k);
    if (!cJSON_IsNumber(v) || !(v->valuedouble >= 0) || v->valuedouble > 9007199254740991.0 ||
        floor(v->valuedouble) != v->valuedouble)
        return -1;
    *out = (uint64_t)v->valuedouble;
    return 0;
}

const char *cl_json_str(const cJSON *o, const char *k)
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
    const char *plan = cl_json_str(j, "plan");
    int rc = -1;

    if (!cJSON_IsObject(j) || cl_json_u64(j, "outer_step", &ms) != 0 || cl_json_u64(j, "shards", &shards) != 0 ||
        plan == NULL || !cJSON_IsArray(nodes)) {
        snprintf(why, why_size, "the manifest is not one (outer_step, shards, plan, nodes)");
        goto out;
    }
    if (cl_json_u64(j, "generation", &gen) != 0 || gen != c->gen) {
        snprintf(why, why_size, "the manifest is not of generation %u", c->gen);
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
        const char *node = cl_json_str(e, "node"), *key = cl_json_str(e, "key"), *etag = cl_json_str(e, "etag"),
                   *hs = cl_json_str(e, "header_sha256");
        uint64_t local, pl_local;
        char pnode[DELTA_NODE_ID_MAX + 1];
        delta_info info;
        node_delta *d = &c->m[c->nm];
        if (node == NULL || key == NULL || etag == NULL || hs == NULL || cl_json_u64(e, "local_step", &local) != 0 ||
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
        if (cl_json_u64(e, "size", &size) != 0 || strlen(hs) != 64) {
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
        } else {
            d->weight = weights_of(&info.metrics);
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
    char *rel = cl_manifest_rel(step, c->gen);
    s3s_resp r;
    /* an entry is at most ~450 bytes (a 64-byte id, its key, an ETag, a sha256): the text, and its cJSON tree,
     * stay within a few MB whatever a bucket writer puts there */
    size_t cap = 4096 + (size_t)640 * (c->cfg.expected_nodes ? c->cfg.expected_nodes : NODES_MAX);
    int got = rel ? cl_get_small(c, rel, cap, &r, why, why_size) : -1;
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
    char *rel = cl_manifest_rel(step, c->gen);
    s3s_resp r;
    int rc = -1;

    if (text == NULL || rel == NULL) {
        snprintf(why, why_size, "out of memory");
        goto out;
    }
    long st = cl_put_small(c, rel, text, strlen(text), NULL, 1, &r, why, why_size);
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
            dl_log(DL_LOG_INFO, "cluster", "manifest written", "step=%" PRIu64 " generation=%u nodes=%zu", step, c->gen,
                   c->nm);
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
        dl_log(DL_LOG_INFO, "cluster", "manifest adopted", "step=%" PRIu64 " generation=%u nodes=%zu", step, c->gen,
                       c->nm);
    }
out:
    free(text);
    free(rel);
    return rc;
}

/* ---- the publish ---------------------------------------------------------------------------------- */

static int write_index(cluster *c, uint64_t step, char *why, size_t why_size)
{
    size_t n = c->g.h->ntensors, len = 0;
    st_spec *specs = cl_header_specs(c->g.h);
    char *text = NULL, *rel = cl_index_rel(step, c->gen);
    char base[32];
    s3s_resp r;
    int rc = -1;

    memset(&r, 0, sizeof(r));
    if (specs == NULL || rel == NULL)
        goto out;
    if (cl_gen_base("model", c->gen, base, sizeof(base)) != 0 ||
        (text = st_index_build_json(base, specs, n, c->g.shard_of, c->cfg.shards, NULL, 0, &len)) == NULL)
        goto out;
    long st = cl_put_small(c, rel, text, len, NULL, 0, &r, why, why_size);
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
    char *model_file = cl_index_rel(step, c->gen), etag[80];
    if (model_file == NULL)
        return -1;
    snprintf(etag, sizeof(etag), "%s", c->g.stepfile_etag);
    for (int attempt = 0; attempt < 5; attempt++) {
        char *text = stepcount_build_file(step, c->cfg.optimizer, 0, model_file, NULL);
        s3s_resp r;
        if (text == NULL)
            break;
        long st = cl_put_small(c, "global/step_count.json", text, strlen(text), etag, 0, &r, why, why_size);
        free(text);
        s3s_resp_free(&r);
        int64_t now = st == 200 ? (int64_t)step : cl_bucket_step(c, etag, sizeof(etag));
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
    if (cl_gen_base("model", c->g.gen, kept, sizeof(kept)) != 0)
        return;
    char *prefixes[3] = {
        step >= 2 ? cl_rel_printf("global/steps/%" PRIu64 "/", step - 2) : NULL,
        step >= 1 ? cl_rel_printf("state/momentum/%" PRIu64 "/", step - 1) : NULL,
        step >= 1 ? cl_rel_printf("global/steps/%" PRIu64 "/", step - 1) : NULL,
    };
    for (int p = 0; p < 3; p++) {
        char **keys;
        size_t n;
        char why[1024];
        if (prefixes[p] == NULL || cl_list_keys(c, prefixes[p], &keys, &n, why, sizeof(why)) != 0) {
            free(prefixes[p]);
            continue;
        }
        for (size_t k = 0; k < n && !cl_stopping(c); k++) {
            /* of the previous step, only its published model stays (a reader may still be fetching it) */
            const char *name = strrchr(keys[k], '/');
            name = name ? name + 1 : keys[k];
            size_t bl = strlen(kept);
            int del = p < 2 || strncmp(name, kept, bl) != 0 || (name[bl] != '-' && name[bl] != '.') ||
                      (c->g.gen == 0 && strncmp(name + bl, ".g", 2) == 0);
            if (del)
                cl_delete_key(c, keys[k]);
        }
        cl_keys_free(keys, n);
        free(prefixes[p]);
    }
}


/* Every shard is done: publish once.  0 published (by anyone), -1 not yet, 1 a shard's step overflowed
 * (nothing to publish: the overflow's refusal is written, and the next check_refusal takes it). */
static int publish(cluster *c, uint64_t step)
{
    char why[1024] = "";
    double *sumsq = calloc(c->nm ? c->nm : 1, sizeof(*sumsq));
    char *rel = cl_rel_printf("global/steps/%" PRIu64 "/published", step);
    char body[256];
    s3s_resp r;
    uint32_t overflowed = 0;
    int rc = -1;

    memset(&r, 0, sizeof(r));
    if (sumsq == NULL || rel == NULL)
        goto out;
    cl_set_state(c, "publishing");
    if (cl_check_outputs(c, step, sumsq, &overflowed, why, sizeof(why)) != 0)
        goto out;
    if (overflowed > 0) {
        cl_write_overflow_refusal(c, step, sumsq, overflowed);
        cl_set_state(c, "aggregating");
        rc = 1;
        goto out;
    }
    /* what this generation's step is, should it be the one published (by us below, or by another) */
    cl_record_pending(c, step, sumsq);
    snprintf(body, sizeof(body), "{\"outer_step\": %" PRIu64 ", \"generation\": %u, \"instance\": \"%s\"}\n", step,
             c->gen, c->instance);
    s3_lease_put put = s3_lease_after_put(cl_put_small(c, rel, body, strlen(body), NULL, 1, &r, why, sizeof(why)));
    if (put == S3_LEASE_PUT_READ_BACK) {
        s3s_resp_free(&r);
        if (cl_get_small(c, rel, CLAIM_CAP, &r, why, sizeof(why)) != 1)
            goto out;
        /* the publish's outputs are written once and the same whoever writes them: an expired claim is
         * completed rather than taken over, so no If-Match is needed (s3_lease.h) */
        double age = s3_lease_server_age(r.last_modified, r.date);
        s3_lease_verdict v = s3_lease_judge(r.body.p, r.body.len, body, strlen(body), 0, age, c->cfg.lease, r.etag);
        if (v == S3_LEASE_LIVE) {
            /* another publishes it: wait for its step file (the caller polls the bucket's step) */
            goto out;
        }
        if (v == S3_LEASE_EXPIRED)
            dl_log(DL_LOG_WARN, "cluster", "completing a publish its winner did not finish", "step=%" PRIu64
                   " age_s=%.0f", step, age);
    } else if (put != S3_LEASE_PUT_WRITTEN) {
        goto out;
    }
    int wrote;
    if (write_index(c, step, why, sizeof(why)) != 0 || (wrote = write_stepfile(c, step, why, sizeof(why))) < 0)
        goto out;
    cl_record_hand_over(c, step);
    cl_phase(c, step, CLUSTER_PHASE_PUBLISHED);
    if (wrote == 0) {
        rc = 0;                 /* another completed this same publish first */
        goto out;
    }
    cl_count(c, &c->publishes, 1);
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
        cl_fail_view(c, "publishing step %" PRIu64 ": %s", step, why);
    }
    s3s_resp_free(&r);
    free(sumsq);
    free(rel);
    return rc;
}

/* ---- the step ------------------------------------------------------------------------------------- */

/* Who takes part in step: each aggregator that agreed on the manifest announces itself
 * (global/steps/<s>/join-<instance>), waits a window of four polls, and reads who did: K and its rank among
 * them decide which shards it takes first (i % K == rank), so that the work is shared evenly instead of
 * going to whoever saw the manifest first.  Only a preference: the others' shards are taken too once
 * they are still unclaimed a moment later (a member that died, or joined late), and claims decide. */
static void join_step(cluster *c, uint64_t step, unsigned *k, unsigned *rank)
{
    char *rel = cl_rel_printf("global/steps/%" PRIu64 "/join-%s", step, c->instance);
    char *dir = cl_rel_printf("global/steps/%" PRIu64 "/", step);
    char why[1024], **keys = NULL;
    size_t n = 0;
    s3s_resp r;

    *k = 1;
    *rank = 0;
    if (rel == NULL || dir == NULL)
        goto out;
    if (cl_put_small(c, rel, "{}\n", 3, NULL, 0, &r, why, sizeof(why)) != 200) {
        s3s_resp_free(&r);
        goto out;
    }
    s3s_resp_free(&r);
    /* the last to adopt the manifest may be a poll behind the others, and a poll more if it was still
     * seeing the previous step published */
    double window = 4 * c->cfg.poll_interval + 0.2;
    cl_nap(c, window < c->cfg.lease / 4 ? window : c->cfg.lease / 4);
    if (cl_list_keys(c, dir, &keys, &n, why, sizeof(why)) != 0)
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
    cl_keys_free(keys, n);
    free(rel);
    free(dir);
}

/* Shards until every one is done, then the publish; returns 0 once the bucket's step reached step (or a
 * refusal stopped the step: then once the bucket moved on), 1 when a refusal sends the step back to
 * collecting (c->gen is the next generation's). */
static int aggregate(cluster *c, uint64_t step)
{
    uint32_t S = c->cfg.shards;
    unsigned char *done = calloc(S, 1);
    uint32_t *order = calloc(S, sizeof(*order));
    unsigned members, rank;
    int refused = 0, reopen = 0;

    if (done == NULL || order == NULL) {
        free(done);
        free(order);
        return 0;
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
    double steal_at = cl_mono() + 1.0;
    dl_log(DL_LOG_DEBUG, "cluster", "joined the step", "step=%" PRIu64 " members=%u rank=%u", step, members, rank);
    cl_set_state(c, "aggregating");
    while (!cl_stopping(c)) {
        int progressed = 0;
        uint32_t ndone = 0;
        for (uint32_t k = 0; k < S && !cl_stopping(c) && !refused; k++) {
            uint32_t i = order[k];
            if (done[i]) {
                ndone++;
                continue;
            }
            /* another member's shard: its own first, ours only once it is still left a moment later */
            if (i % members != rank && (long)i != hooked && cl_mono() < steal_at)
                continue;
            int d = cl_shard_is_done(c, step, i);
            if (d == 1) {
                done[i] = 1;
                ndone++;
                cl_shard_set(c, i, SH_DONE, c->sv[i].epoch, -1);
                continue;
            }
            if (d < 0)
                continue;
            unsigned epoch;
            size_t bad = 0;
            if (cl_claim_try(c, step, i, &epoch) != CLAIM_OURS)
                continue;
            int w = cl_shard_work(c, step, i, epoch, &bad);
            if (w == 0) {
                done[i] = 1;
                ndone++;
                progressed = 1;
            } else if (w == -2) {
                refused = 1;
            } else if (w == -3) {
                cl_write_refusal(c, step, i, bad);
                break;
            }
        }
        if (!refused) {
            /* a delta refused in any shard (by us or another) starts the next generation without it */
            int r = cl_check_refusal(c, step);
            if (r == 1) {
                memset(done, 0, S);
                continue;
            }
            if (r == 2) {
                reopen = 1;
                break;
            }
            if (r < 0)
                refused = 1;
        }
        if (refused) {
            cl_set_state(c, "refused");
            break;
        }
        if (ndone == S) {
            if (publish(c, step) == 0)
                break;
        }
        int64_t now = cl_bucket_step(c, NULL, 0);
        if (now >= (int64_t)step) {
            cl_record_seen(c, step);
            cl_phase(c, step, CLUSTER_PHASE_PUBLISHED);
            break;
        }
        if (!progressed)
            cl_nap(c, c->cfg.poll_interval < c->cfg.lease / 4 ? c->cfg.poll_interval : c->cfg.lease / 4);
    }
    free(done);
    free(order);
    if (refused) {
        /* a clear refusal: nothing more is done for this step until the bucket moves on */
        while (!cl_stopping(c) && cl_bucket_step(c, NULL, 0) < (int64_t)step)
            cl_nap(c, c->cfg.poll_interval > 1 ? c->cfg.poll_interval : 1);
        if (!cl_stopping(c))
            cl_phase(c, step, CLUSTER_PHASE_PUBLISHED);
    }
    return reopen;
}

void cl_step_reset_view(cluster *c, uint64_t step)
{
    pthread_mutex_lock(&c->mu);
    c->step = (int64_t)step;
    c->manifest = NULL;
    for (uint32_t i = 0; i < c->cfg.shards; i++) {
        c->sv[i].state = SH_UNCLAIMED;
        c->sv[i].epoch = 0;
        c->sv[i].lease_age = -1;
        c->sv[i].bytes_read = 0;
        c->sv[i].foreign.version[0] = '\0';
    }
    pthread_mutex_unlock(&c->mu);
}

/* Collects round step (generation c->gen) until its manifest is agreed: 0, or -1 when the bucket's step
 * reached step meanwhile or the thread stops. */
static int collect(cluster *c, uint64_t step)
{
    char why[1024];
    int warned = 0;

    round_forget(c);
    /* what the round's rules refused is looked at again by a new round */
    cl_forget_this_round(c);
    round_reset(&c->rnd, step - 1);   /* round.c's step: the base its deltas name */
    cl_step_reset_view(c, step);
    cl_set_state(c, "collecting");
    while (!cl_stopping(c)) {
        int m = manifest_read(c, step, why, sizeof(why));
        if (m == 1) {
            pthread_mutex_lock(&c->mu);
            c->manifest = "adopted";
            pthread_mutex_unlock(&c->mu);
            cl_phase(c, step, CLUSTER_PHASE_MANIFEST);
            dl_log(DL_LOG_INFO, "cluster", "manifest adopted", "step=%" PRIu64 " generation=%u nodes=%zu", step, c->gen,
                       c->nm);
            break;
        }
        if (m < 0) {
            if (!warned)
                dl_log(DL_LOG_ERROR, "cluster", "manifest refused: the step waits for the bucket to move on",
                       "step=%" PRIu64 " why=%s", step, why);
            warned = 1;
            cl_fail_view(c, "step %" PRIu64 ": manifest refused: %s", step, why);
            cl_set_state(c, "refused");
            for (size_t i = 0; i < c->nm; i++)
                cl_source_free(&c->m[i].s);
            free(c->m);
            c->m = NULL;
            c->nm = 0;
            cl_nap(c, c->cfg.poll_interval > 1 ? c->cfg.poll_interval : 1);
            if (cl_bucket_step(c, NULL, 0) >= (int64_t)step) {
                cl_phase(c, step, CLUSTER_PHASE_PUBLISHED);
                return -1;
            }
            continue;
        }
        poll_deltas(c, step);
        round_close_reason reason;
        if (round_should_close(&c->rnd, cl_mono(), &reason)) {
            dl_log(DL_LOG_INFO, "cluster", "round closed", "step=%" PRIu64 " nodes=%zu reason=%s", step, c->rnd.n,
                   round_close_reason_name(reason));
            cl_phase(c, step, CLUSTER_PHASE_MANIFEST);
            if (manifest_write(c, step, why, sizeof(why)) == 0)
                break;
            dl_log(DL_LOG_WARN, "cluster", "manifest not agreed", "step=%" PRIu64 " why=%s", step, why);
            cl_phase(c, step, CLUSTER_PHASE_COLLECTING);
            for (size_t i = 0; i < c->nm; i++)
                cl_source_free(&c->m[i].s);
            free(c->m);
            c->m = NULL;
            c->nm = 0;
        }
        if (cl_bucket_step(c, NULL, 0) >= (int64_t)step) {
            cl_phase(c, step, CLUSTER_PHASE_PUBLISHED);
            return -1;
        }
        cl_nap(c, c->cfg.poll_interval);
    }
    return cl_stopping(c) ? -1 : 0;
}

/* Step's rounds: collected, aggregated, and collected again while a refusal sends it back. */
static void run_step(cluster *c, uint64_t step)
{
    c->gen = 0;
    c->refusal_ignored[0] = '\0';
    if (c->problem_step < step) {
        pthread_mutex_lock(&c->mu);
        if (c->problem != NULL)
            dl_log(DL_LOG_INFO, "cluster", "a step was published: problem output_overflow is over", "step=%" PRIu64,
                   step - 1);
        c->problem = NULL;
        pthread_mutex_unlock(&c->mu);
    }
    while (collect(c, step) == 0 && aggregate(c, step) == 1)
        ;
}

static void *cluster_main(void *arg)
{
    cluster *c = arg;
    char why[1024];
    int warned = 0, boot_failed = 0, init_noted = 0;

    while (!cl_stopping(c)) {
        int g = cl_sync_global(c, why, sizeof(why));
        if (g == 1)
            cl_record_hand_over(c, c->g.step);     /* another published the step this one computed a part of */
        if (g == -2 && c->cfg.init_model != NULL && !boot_failed) {
            /* an empty bucket: publish step 0, then read it as any aggregator does */
            int b = cl_bootstrap(c, why, sizeof(why));
            if (b == 0)
                continue;
            dl_log(DL_LOG_ERROR, "cluster", "cannot bootstrap the bucket", "why=%s", why);
            boot_failed = b == -2;      /* retried unless it never can succeed */
        }
        if (g < 0) {
            if (!warned)
                dl_log(DL_LOG_WARN, "cluster", "no usable global in the bucket yet", "why=%s", why);
            warned = 1;
            cl_fail_view(c, "%s", why);
            if (!c->g.loaded)
                cl_set_state(c, "waiting_for_global");
            cl_nap(c, c->cfg.poll_interval > 0.5 ? c->cfg.poll_interval : 0.5);
            continue;
        }
        warned = 0;
        if (c->cfg.init_model != NULL && !init_noted) {
            /* as a single dilocod with state: the option is for an empty bucket only */
            dl_log(DL_LOG_INFO, "cluster", "the bucket holds a global: --init-model is not used", "step=%" PRIu64
                   " init_model=%s", c->g.step, c->cfg.init_model);
            init_noted = 1;
        }
        if (!stepcount_step_ok(c->g.step)) {
            cl_fail_view(c, "the bucket's step %" PRIu64 " is past the largest", c->g.step);
            cl_nap(c, 5);
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
    cl_records_cb(&c->record_async);       /* the last ones the thread made */
    if (c->record_async_open)
        uv_close((uv_handle_t *)&c->record_async, NULL);
    c->record_async_open = 0;
    uv_close((uv_handle_t *)&c->done_async, async_closed);
}

int cluster_start(cluster **out, uv_loop_t *loop, const cluster_config *cfg, const s3_access *a,
                  void (*stopped)(void *), void *arg, dl_error *err)
{
    cluster *c = calloc(1, sizeof(*c));
    unsigned char rnd[14];

    *out = NULL;
    if (c == NULL)
        return dl_fail(err, DL_E_NO_MEMORY, NULL, 0, "out of memory");
    c->cfg = *cfg;
    c->last_phase_step = -1;
    c->a = *a;
    c->loop = loop;
    c->stopped = stopped;
    c->stopped_arg = arg;
    c->step = -1;
    c->published_step = -1;
    c->state = "waiting_for_global";
    c->stall_shard = cl_test_hook("DILOCOD_TEST_CLUSTER_STALL");
    c->stall_after_pass = cl_test_hook("DILOCOD_TEST_CLUSTER_STALL_AFTER_PASS");
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
    memcpy(&c->refused_seed, rnd + 6, sizeof(c->refused_seed));
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
    if ((rc = uv_async_init(loop, &c->record_async, cl_records_cb)) != 0) {
        c->stopped = NULL;
        uv_close((uv_handle_t *)&c->done_async, NULL);
        return dl_fail(err, DL_E_IO, NULL, 0, "uv_async_init: %s", uv_strerror(rc));
    }
    c->record_async.data = c;
    c->record_async_open = 1;
    if (pthread_create(&c->thread, NULL, cluster_main, c) != 0) {
        c->stopped = NULL;
        uv_close((uv_handle_t *)&c->record_async, NULL);
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
    seen_free(&c->refused);
    round_free(&c->rnd);
    cl_gmodel_free(&c->g);
    s3s_free(&c->s3);
    pthread_mutex_destroy(&c->mu);
    for (size_t i = 0; i < c->nrecords; i++)
        free(c->records[i]);
    free(c->records);
    free(c->pending_record);
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

const char *cluster_problem(cluster *c)
{
    pthread_mutex_lock(&c->mu);
    const char *p = c->problem;
    pthread_mutex_unlock(&c->mu);
    return p;
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
    sb_str(b, ", \"problem\": ");
    if (c->problem != NULL)
        sb_printf(b, "\"%s\"", c->problem);
    else
        sb_str(b, "null");
    sb_printf(b, ", \"refused_remembered\": %zu}", c->refused_count);
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
