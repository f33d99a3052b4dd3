/* s3_cluster_intake: the round's intake from the listing of nodes/ (see s3_cluster_internal.h): each node's
 * newest delta, a single file or a sharded set (s3_cluster_set.c), its header checked as a single dilocod
 * checks one, offered to the round (core/round.c).  The manifest, the shards and the publish are in
 * s3_cluster.c and s3_cluster_shard.c. */
#include "s3_cluster_internal.h"

#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "delta.h"
#include "dl_log.h"
#include "round.h"
#include "s3_sync.h"
#include "weights.h"

node_delta *cl_nd_find(cluster *c, const char *node)
{
    for (size_t i = 0; i < c->nnd; i++)
        if (strcmp(c->nd[i].node, node) == 0)
            return &c->nd[i];
    return NULL;
}

int cl_check_round(cluster *c, uint64_t step, const delta_info *info, char *why, size_t why_size)
{
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

int cl_check_delta(cluster *c, uint64_t step, source *s, const char *etag, delta_info *info, char *why,
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
    return cl_check_round(c, step, info, why, why_size);
}

/* Offers d (its header checked, a delta of this round) to the round: taken, or a newer version of the node's
 * delta already taken (a rewrite before the round closed), or refused by the round's rules.  Takes d. */
static void offer(cluster *c, uint64_t step, node_delta *d, const delta_info *info, uint64_t size)
{
    node_delta *have = cl_nd_find(c, d->node);
    if (have != NULL && have->local_step == d->local_step) {
        /* the same delta uploaded again with other bytes before the round closed: the round keeps its entry,
         * the manifest will name this version */
        char node[DELTA_NODE_ID_MAX + 1];
        snprintf(node, sizeof(node), "%s", have->node);
        cl_delta_free(have);
        *have = *d;
        snprintf(have->node, sizeof(have->node), "%s", node);
        dl_log(DL_LOG_INFO, "cluster", "delta rewritten before the round closed: its new version taken", "key=%s",
               have->s.rel);
        return;
    }
    if (have == NULL && c->nnd >= NODES_MAX) {
        cl_delta_free(d);
        return;
    }
    char *path = strdup(d->s.rel), *replaced = NULL;
    if (path == NULL) {
        cl_delta_free(d);
        return;
    }
    round_verdict verdict = round_offer(&c->rnd, info, path, size, cl_mono(), 0, &replaced);
    free(replaced);
    if (!round_verdict_taken(verdict)) {
        free(path);
        if (verdict != ROUND_NOT_NEWER)
            cl_refuse(c, d->s.rel, cl_delta_version(d), round_verdict_name(verdict), REFUSED_THIS_ROUND);
        cl_delta_free(d);
        return;
    }
    dl_log(DL_LOG_INFO, "cluster", "delta taken", "step=%" PRIu64 " node=%s local_step=%" PRIu64 " parts=%zu verdict=%s",
           step, d->node, d->local_step, d->nparts, round_verdict_name(verdict));
    if (have == NULL) {
        node_delta *grown = realloc(c->nd, (c->nnd + 1) * sizeof(*grown));
        if (grown == NULL) {
            cl_delta_free(d);
            return;
        }
        c->nd = grown;
        have = &c->nd[c->nnd++];
        memset(have, 0, sizeof(*have));
    } else {
        cl_delta_free(have);
    }
    *have = *d;
}

int cl_have_delta(cluster *c, const char *node, uint64_t local, const char *ver)
{
    const node_delta *have = cl_nd_find(c, node);
    return have != NULL && (have->local_step > local ||
                            (have->local_step == local && strcmp(cl_delta_version(have), ver) == 0));
}

/* A single file's listing entry. */
static void single_entry(cluster *c, uint64_t step, const char *rel, const s3_object *o, const char *node,
                         uint64_t local)
{
    char why[1024];
    node_delta d;
    delta_info info;

    if (cl_have_delta(c, node, local, o->etag))
        return;
    memset(&d, 0, sizeof(d));
    memset(&info, 0, sizeof(info));
    snprintf(d.node, sizeof(d.node), "%s", node);
    d.local_step = local;
    if ((d.s.rel = strdup(rel)) == NULL)
        return;
    int v = cl_check_delta(c, step, &d.s, o->etag, &info, why, sizeof(why));
    if (v == -1 || v == -4)
        cl_refuse(c, rel, o->etag, why, v == -4 ? REFUSED_STALE : REFUSED_FOR_GOOD);
    if (v != 0 || strcmp(d.s.etag, o->etag) != 0 || info.local_step != local) {
        cl_delta_free(&d);
        return;
    }
    offer(c, step, &d, &info, o->size);
}

/* A set's index in the listing (its shards, listed before it, are in st). */
static void set_entry(cluster *c, uint64_t step, const set_stash *st, const char *rel, const s3_object *o,
                      const delta_path *dp)
{
    char why[1024];
    node_delta d;
    delta_info info;

    memset(&d, 0, sizeof(d));
    memset(&info, 0, sizeof(info));
    int v = cl_set_candidate(c, step, st, rel, o->etag, o->size, dp->node_id, dp->local_step, &d, &info, why,
                             sizeof(why));
    if (v == -1 || v == -4)
        cl_refuse(c, rel, d.ver, why, v == -4 ? REFUSED_STALE : REFUSED_FOR_GOOD);
    if (v == -5)
        dl_log(DL_LOG_DEBUG, "cluster", "a set waits for its shards", "key=%s why=%s", rel, why);
    if (v != 0) {
        cl_delta_free(&d);
        return;
    }
    offer(c, step, &d, &info, cl_delta_bytes(&d));
}

/* One listing of nodes/: each node's newest delta (a single file or a set) offered to the round. */
void cl_poll_deltas(cluster *c, uint64_t step)
{
    char why[1024];
    size_t pl = strlen(c->a.prefix);
    /* the listing's ETags are wanted here (list_keys keeps only the names) */
    char *token = NULL;
    char *full = pl ? cl_rel_printf("%s/nodes/", c->a.prefix) : strdup("nodes/");
    int complete = 0;
    set_stash stash;

    memset(&stash, 0, sizeof(stash));
    if (full == NULL)
        return;
    c->polls++;
    for (unsigned page = 0; page < LIST_PAGES_MAX && !cl_stopping(c); page++) {
        s3_listing l;
        if (cl_list_page(c, full, token, &l, why, sizeof(why)) != 0) {
            dl_log(DL_LOG_WARN, "cluster", "listing nodes/ failed", "why=%s", why);
            break;
        }
        for (size_t i = 0; i < l.n && !cl_stopping(c); i++) {
            const s3_object *o = &l.objs[i];
            const char *rel = pl ? o->key + pl + 1 : o->key;
            char node[DELTA_NODE_ID_MAX + 1];
            uint64_t local;
            delta_path dp;
            if (pl && (strncmp(o->key, c->a.prefix, pl) != 0 || o->key[pl] != '/'))
                continue;
            if (cl_is_refused(c, rel, o->etag))
                continue;
            if (delta_parse_path(rel, node, &local, NULL) == 0) {
                single_entry(c, step, rel, o, node, local);
                continue;
            }
            if (delta_parse_any_path(rel, &dp, NULL) != 0)
                continue;
            if (dp.kind == DELTA_PATH_SHARD)
                cl_stash_shard(c, &stash, dp.node_id, rel, o->etag, o->size);
            else if (dp.kind == DELTA_PATH_INDEX)
                set_entry(c, step, &stash, rel, o, &dp);
        }
        free(token);
        token = l.truncated && l.next_token ? strdup(l.next_token) : NULL;
        s3_listing_free(&l);
        if (token == NULL) {
            complete = !cl_stopping(c);
            break;
        }
    }
    cl_stash_free(&stash);
    free(token);
    free(full);
    /* what the whole listing no longer holds is forgotten: the map follows the bucket */
    if (complete)
        cl_forget_unlisted(c);
}
