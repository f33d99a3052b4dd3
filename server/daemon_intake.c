/* Deltas in and the open round: a delta the transport found (or the cache holds at a restart) queued
 * and taken in on the pool (core/intake.c), offered to the round (core/round.c) and logged, the
 * transport told the outcome (and, with --prune-consumed, which of its files no step needs again);
 * the round's timer, its close (which starts the pass) and its opening on the model.  The
 * transport's delta_ready callback lands here, and the HTTP uploads offer through daemon__offer. */
#include "daemon_internal.h"
#include "daemon_parts.h"

#include <errno.h>
#include <math.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <uv.h>

#include "delta.h"
#include "dl_log.h"
#include "fsutil.h"
#include "hub.h"
#include "index_parse.h"
#include "intake.h"
#include "pipeline.h"
#include "round.h"
#include "safetensors.h"
#include "st_index.h"
#include "stats.h"
#include "store.h"

/* ---- intake ---------------------------------------------------------------------------------- */

static void intake_work(job *j)
{
    intake_run(j->arg);
}

static intake_req *enqueue_intake(dilocod *d, const char *path, const char *rel, int in_cache, int remove_src)
{
    intake_req *r = calloc(1, sizeof(*r));

    if (r == NULL || (r->src_path = strdup(path)) == NULL || (rel && (r->rel_path = strdup(rel)) == NULL) ||
        (r->state_dir = strdup(d->st.dir)) == NULL) {
        if (r)
            intake_req_free(r);
        dl_log(DL_LOG_ERROR, "intake", "out of memory", "path=%s", path);
        return NULL;
    }
    r->in_cache = in_cache;
    r->remove_src = remove_src;
    r->ck = &d->st.key;         /* never changes after store_open: the pool reads it */
    /* one header cap whatever brought the delta in (an upload, the shared tree, the Hub) */
    r->max_header = (uint64_t)d->cfg->max_delta_header_mib << 20;
    if (d->intake.n == d->intake.cap) {
        size_t nc = d->intake.cap ? d->intake.cap * 2 : 16;
        intake_req **nq = realloc(d->intake.queue, nc * sizeof(*nq));
        if (nq == NULL) {
            intake_req_free(r);
            dl_log(DL_LOG_ERROR, "intake", "out of memory", "path=%s", path);
            return NULL;
        }
        d->intake.queue = nq;
        d->intake.cap = nc;
    }
    d->intake.queue[d->intake.n++] = r;
    return r;
}

/* A delta the transport found: queued for intake.  A file of a shared tree (root set) is reached
 * from the root, never through a link; a download (owned) is removed after intake.  A set's index the
 * transport already parsed goes along (intake uses it while the file is that version). */
void daemon__on_delta_ready(void *app, const hub_delta *hd)
{
    dilocod *d = app;
    intake_req *r = enqueue_intake(d, hd->path, hd->rel, 0, hd->owned);

    if (r != NULL)
        r->index = index_parse_ref(hd->index);      /* released with the request */
    if (r != NULL && hd->root != NULL && (r->hub_root = strdup(hd->root)) == NULL) {
        d->intake.queue[--d->intake.n] = NULL;
        intake_req_free(r);
        r = NULL;
    }
    if (r == NULL) {
        if (hd->owned)
            daemon__discard_local(d, hd->path, 1);
        hub_mark_done(d->hub, hd->rel, HUB_RETRY, NULL);
        return;
    }
    daemon__dispatch_intake(d);
}

static void round_timer_cb(uv_timer_t *t);

void daemon__arm_round_timer(dilocod *d)
{
    double deadline = round_deadline(&d->rnd), wait;

    if (deadline < 0 || d->stopping)
        return;
    wait = deadline - daemon__now(d);
    /* rounded up, and a millisecond more: the loop's clock is in milliseconds, and a timer that fired on
     * the deadline itself could find now - first_at a rounding below the window, and never fire again */
    uv_timer_start(&d->round_timer, round_timer_cb, wait > 0 ? (uint64_t)ceil(wait * 1000) + 1 : 0, 0);
}

/* A refusal at the offer: counted and recorded for its node (daemon_verdicts.c); an upload's answer
 * (api/upload.c) words it at length, the record says why in short. */
static void count_refusal(dilocod *d, const delta_info *info, round_verdict v, int http)
{
    char msg[200];
    double norm = 0, bound = 0;
    const char *reason = "norm_ratio", *basis = "round";

    if (v == ROUND_OUTLIER) {
        (void)daemon_quarantine_detail(d, info->node_id, &norm, &bound, &reason, &basis);
        snprintf(msg, sizeof(msg), "quarantined at arrival: L2 norm %.9g above the bound %.9g (%s, %s)", norm, bound,
                 reason, basis);
    } else {
        snprintf(msg, sizeof(msg), "refused at the round's offer: %s (step %" PRIu64 ")", round_verdict_name(v),
                 d->rnd.step);
    }
    daemon_verdict_refused(d, info->node_id, info, v, http ? round_verdict_http_status(v) : 0, msg);
}

round_verdict daemon__peek(dilocod *d, const delta_info *info)
{
    /* no global yet: nothing can be based on a step we do not have */
    if (daemon__state(d) == S_WAITING_GLOBAL)
        return ROUND_FUTURE;
    if (daemon__async(d) && daemon__async_applied(d, info))
        return ROUND_NOT_NEWER;         /* applied already */
    if (daemon__async(d))
        (void)daemon__async_bound(d);   /* no base below the applied set's floor: stale */
    if (!daemon__robust_weighable(d, info))
        return ROUND_NO_WEIGHT;
    return round_peek(&d->rnd, info);
}

/* daemon__offer, for a delta linked from a shared tree when guard is non-NULL: the version validated,
 * which the round checks again before and after its pass. */
static round_verdict offer(dilocod *d, const delta_info *info, char *cache_path, uint64_t size,
                           const fsu_ident *guard, int recovered, int http)
{
    char *replaced = NULL, qn[160];
    double now = daemon__now(d);
    const round_entry *e;

    if (daemon__async(d)) {
        /* a base below the applied set's floor is stale (the round's bound says so; said here why),
         * unless the cache held the delta at a restart: acknowledged and never applied */
        (void)daemon__async_bound(d);
        if (!recovered && !daemon__async_applied(d, info))
            (void)daemon__async_below_floor(d, info, 1);
    }
    /* async: a delta applied already (an upload retried, a tree handed over again) is not newer */
    round_verdict v = daemon__async(d) && daemon__async_applied(d, info) ? ROUND_NOT_NEWER : round_peek(&d->rnd, info);
    /* sync: the node's delta this one may replace, whose record then says so */
    const round_entry *prev = daemon__async(d) ? NULL : round_find(&d->rnd, info);
    int had_prev = prev != NULL;
    uint64_t prev_local = prev != NULL ? prev->local_step : 0, prev_base = prev != NULL ? prev->base : 0;
    /* the norm screen judges a delta the round would take (one taken before a restart was judged then) */
    if (round_verdict_taken(v) && !daemon__robust_weighable(d, info))
        v = ROUND_NO_WEIGHT;
    else if (round_verdict_taken(v) && !recovered && daemon__robust_screen_offer(d, info))
        v = ROUND_OUTLIER;
    else if (v != ROUND_NOT_NEWER || !daemon__async(d))
        v = round_offer(&d->rnd, info, cache_path, size, now, recovered, &replaced);
    if ((v == ROUND_NOT_NEWER && daemon__async(d)) || v == ROUND_OUTLIER || v == ROUND_NO_WEIGHT)
        round_count_refused(&d->rnd, v);
    int first = d->rnd.n == 1 && v == ROUND_ACCEPTED;

    if (round_verdict_taken(v) && guard != NULL)
        round_guard(&d->rnd, info, guard);
    if (round_verdict_taken(v)) {
        if (daemon__async(d))
            dl_log(DL_LOG_INFO, "round", v == ROUND_QUEUED ? "delta queued for the next update" : "delta accepted",
                   "step=%" PRIu64 " node=%s local_step=%" PRIu64 " base_outer_step=%" PRIu64 " tau=%" PRIu64
                   " bytes=%" PRIu64 " pending=%zu",
                   d->rnd.step, dl_log_q(qn, sizeof(qn), info->node_id), info->local_step, info->base_outer_step,
                   d->rnd.step - info->base_outer_step, size, round_pending(&d->rnd));
        else
            dl_log(DL_LOG_INFO, "round", v == ROUND_ACCEPTED ? "delta accepted" : "delta replaced",
                   "step=%" PRIu64 " node=%s local_step=%" PRIu64 " bytes=%" PRIu64 " nodes=%zu expected=%u",
                   d->rnd.step, dl_log_q(qn, sizeof(qn), info->node_id), info->local_step, size, d->rnd.n,
                   d->cfg->expected_nodes);
        stats_delta_taken(&d->m, v);
        if (d->sign.on) {       /* its block hash, for the step's record, while the round collects */
            e = round_find(&d->rnd, info);
            for (size_t q = 0; e == NULL && q < d->rnd.nqueue; q++) {     /* async: queued for the next update */
                const round_entry *qe = &d->rnd.queue[q];
                if (strcmp(qe->node_id, info->node_id) == 0 && qe->base == info->base_outer_step &&
                    qe->local_step == info->local_step)
                    e = qe;
            }
            if (e != NULL)
                daemon__sign_hash_taken(d, e->path);
        }
        daemon__verdict_taken(d, info, v, http ? 201 : 0, recovered, had_prev, prev_local, prev_base);
        workers_report(&d->workers, info->node_id, info->base_outer_step, info->local_step, time(NULL), &info->metrics,
                       &info->cz, size);
        if (daemon__async(d))
            daemon__async_accepted(d, info, d->rnd.step - info->base_outer_step, now);
        if (replaced != NULL) {
            daemon__discard_local(d, replaced, 0);
            free(replaced);
        }
        if (first)
            daemon__arm_round_timer(d);     /* the timeout (sync) or the grace window (async), if any */
        daemon__maybe_close_round(d);
        return v;
    }
    count_refusal(d, info, v, http);
    dl_log(v == ROUND_NOT_NEWER ? DL_LOG_INFO : DL_LOG_WARN, "round", "delta refused",
           "step=%" PRIu64 " node=%s local_step=%" PRIu64 " base_outer_step=%" PRIu64 " reason=%s", d->rnd.step,
           dl_log_q(qn, sizeof(qn), info->node_id), info->local_step, info->base_outer_step, round_verdict_name(v));
    daemon__discard_local(d, cache_path, 0);    /* refused: its cached copy has no use */
    free(cache_path);
    return v;
}

round_verdict daemon__offer(dilocod *d, const delta_info *info, char *cache_path, uint64_t size)
{
    return offer(d, info, cache_path, size, NULL, 0, 1);
}

/* A shared tree's file answered DUPLICATE while the round holds a guarded link to it whose version
 * changed: the worker rewrote the delta in place after it was taken in.  Collecting, the old entry
 * goes and the request runs again (1); aggregating, or when the round holds no entry for the node
 * (the cached copy is being dropped or not offered yet), the transport hands it over later
 * (HUB_RETRY: 0 with *retry set); else 0. */
static int rewritten_in_round(dilocod *d, intake_req *r, int *retry)
{
    const round_entry *e;
    char *path;

    *retry = 0;
    if (r->status != INTAKE_DUPLICATE || r->hub_root == NULL || d->stopping)
        return 0;
    if ((e = round_find(&d->rnd, &r->info)) == NULL) {
        /* the cached copy it met is on its way out (a rewritten entry dropped while this ran) or in
         * (a restart's cached delta not offered yet): the transport hands it over again later */
        *retry = 1;
        return 0;
    }
    if (!e->guarded || e->local_step != r->info.local_step || fsu_ident_check(e->path, &e->ident) == 1)
        return 0;
    if (daemon__state(d) != S_COLLECTING) {
        *retry = 1;             /* the pass's checks drop it; the new version comes back after */
        return 0;
    }
    dl_log(DL_LOG_WARN, "round", "delta rewritten in place after it was taken in: dropped, it is taken in again",
           "step=%" PRIu64 " local_step=%" PRIu64, d->rnd.step, e->local_step);
    round_drop_at(&d->rnd, (size_t)(e - d->rnd.entries), &path);
    (void)unlink(path);         /* our link only (the tree keeps its own name): no data is freed here */
    free(path);
    d->m.deltas_rewritten++;
    r->status = INTAKE_IO;
    r->linked = 0;
    r->link_errno = 0;
    memset(&r->info, 0, sizeof(r->info));
    dl_error_clear(&r->err);
    if (d->intake.n == d->intake.cap)
        return 0;               /* no room to run it again now: the transport hands it over later */
    d->intake.queue[d->intake.n++] = r;
    return 1;
}

/* Whose a transport's delta is: the node of its path (nodes/<id>/...), into dp; NULL without one (a
 * cached copy: its metadata says, when it was read). */
static const char *node_of_rel(const char *rel, delta_path *dp)
{
    dl_error err;
    return rel != NULL && delta_parse_any_path(rel, dp, &err) == 0 ? dp->node_id : NULL;
}

void daemon__rejected(dilocod *d, const char *what, const char *rel, const delta_info *info, const dl_error *err)
{
    char m[600], t[300];
    delta_path dp;

    daemon_verdict_rejected(d, node_of_rel(rel, &dp), info, err->code, 0, err->message, err->tensor);
    round_count_rejected(&d->rnd);
    dl_log(DL_LOG_WARN, "intake", "delta rejected", "path=%s code=%s error=%s%s%s", what, dl_error_name(err->code),
           dl_log_q(m, sizeof(m), err->message), err->tensor[0] ? " tensor=" : "",
           err->tensor[0] ? dl_log_q(t, sizeof(t), err->tensor) : "");
}

/* ---- pruning the transport's consumed deltas (--prune-consumed) -------------------------------------- */

static int pruning(const dilocod *d)
{
    return d->cfg->prune_consumed && d->hub != NULL && hub_can_prune(d->hub);
}

void daemon__prune_now(dilocod *d, const char *rel)
{
    if (pruning(d))
        hub_prune(d->hub, rel);
}

/* A delta of the open round: pruned when the step it went into is durable. */
static void remember_consumed(dilocod *d, const char *rel)
{
    char **nv;

    if (!pruning(d))
        return;
    if ((nv = realloc(d->round_rels, (d->nround_rels + 1) * sizeof(*nv))) == NULL)
        return;                 /* not pruned: the file stays, nothing else is lost */
    d->round_rels = nv;
    if ((d->round_rels[d->nround_rels] = strdup(rel)) != NULL)
        d->nround_rels++;
}

void daemon__free_rels(char **rels, size_t n)
{
    for (size_t i = 0; i < n; i++)
        free(rels[i]);
    free(rels);
}

/* What the transport learns of a delta it handed over. */
static hub_outcome hub_outcome_of(intake_status s)
{
    switch (s) {
    case INTAKE_INVALID: return HUB_INVALID;
    case INTAKE_INCOMPLETE: return HUB_INCOMPLETE;
    case INTAKE_IO: return HUB_RETRY;
    default: return HUB_TAKEN;
    }
}

static void intake_done(job *j)
{
    dilocod *d = daemon__of_job(j);
    intake_req *r = j->arg;
    const char *name = r->rel_path ? r->rel_path : r->src_path;
    char qn[160], qp[600];
    hub_version v = {r->size, r->mtime_ns, r->ino};
    int retry, final;

    d->intake.in_flight--;
    if (r->index_parsed)
        stats_index_parsed(&d->m);
    r->index_parsed = 0;        /* a request run again (below) counts its own parse */
    if (rewritten_in_round(d, r, &retry)) {
        daemon__dispatch_intake(d);     /* taken in again, as the version it is now */
        return;
    }
    if (retry) {
        r->status = INTAKE_IO;
        dl_log(DL_LOG_DEBUG, "intake", "delta met a cached copy that is changing, taken in again later",
               "path=%s", name);
    }
    if (r->link_errno != 0 && !d->intake.link_refused_said) {
        char qe[200];
        d->intake.link_refused_said = 1;
        dl_log(DL_LOG_WARN, "intake", "deltas are copied into the state, not linked: slower",
               "reason=%s hint=%s", dl_log_q(qe, sizeof(qe), strerror(r->link_errno)),
               r->link_errno == EXDEV ? "put --state-root on the shared tree's filesystem for zero-copy intake"
                                      : "links to the tree's files are refused (protected_hardlinks: run as the files' owner)");
    }
    /* when stopping, the cached copy stays: the restart offers it again.  A cached delta offered at a
     * restart was taken before it (async: its staleness is not bounded again). */
    round_verdict verdict = ROUND_ACCEPTED;
    int offered = r->status == INTAKE_OK && !d->stopping;
    if (offered) {
        verdict = offer(d, &r->info, r->cache_path, r->size, r->linked ? &r->ident : NULL, r->in_cache, 0);
        r->cache_path = NULL;
    }
    /* a transport's file: it learns the outcome (and says whether a short file is short for good); one the
     * async queue had no room for is handed over again later */
    hub_outcome outcome = offered && verdict == ROUND_BUSY ? HUB_RETRY : hub_outcome_of(r->status);
    final = r->rel_path != NULL && d->hub != NULL ? hub_mark_done(d->hub, r->rel_path, outcome, &v) : 1;
    switch (r->status) {
    case INTAKE_OK:
        if (offered) {
            if (r->rel_path != NULL && round_verdict_taken(verdict))
                remember_consumed(d, r->rel_path);      /* pruned once its step is durable */
            else if (r->rel_path != NULL && (verdict == ROUND_STALE || verdict == ROUND_NOT_NEWER))
                daemon__prune_now(d, r->rel_path);              /* can never count: superseded or too old */
        }
        break;
    case INTAKE_STALE:
    case INTAKE_FUTURE:
        round_count_refused(&d->rnd, r->status == INTAKE_STALE ? ROUND_STALE : ROUND_FUTURE);
        if (r->status == INTAKE_STALE && r->info.base_outer_step + 1 < d->rnd.step) {
            /* a leftover of the tree, two or more steps old: counted, not recorded for its node (a restart
             * meets every one of them, and they would push the node's real verdicts out of its 32) */
            stats_delta_refused(&d->m, ROUND_STALE);
        } else {
            char msg[160];
            delta_path dp;
            snprintf(msg, sizeof(msg), "base_outer_step %" PRIu64 " is %s: the step is %" PRIu64,
                     r->info.base_outer_step, r->status == INTAKE_STALE ? "stale" : "ahead", d->rnd.step);
            daemon_verdict_refused(d, node_of_rel(r->rel_path, &dp), &r->info,
                                   r->status == INTAKE_STALE ? ROUND_STALE : ROUND_FUTURE, 0, msg);
        }
        /* a delta that just missed its round is worth a line; older leftovers in a hub (a restart meets
         * every one of them) only at debug level: they are counted in dilocod_deltas_refused_total */
        dl_log(r->status == INTAKE_FUTURE                      ? DL_LOG_WARN
               : r->info.base_outer_step + 1 >= d->rnd.step    ? DL_LOG_INFO
                                                               : DL_LOG_DEBUG,
               "intake", "delta refused",
               "path=%s node=%s base_outer_step=%" PRIu64 " step=%" PRIu64 " reason=%s", dl_log_q(qp, sizeof(qp), name),
               dl_log_q(qn, sizeof(qn), r->info.node_id),
               r->info.base_outer_step, d->rnd.step, intake_status_name(r->status));
        if (r->in_cache)
            daemon__discard_local(d, r->src_path, 0);
        if (r->status == INTAKE_STALE && r->rel_path != NULL)
            daemon__prune_now(d, r->rel_path);
        if (r->status == INTAKE_STALE && daemon__async(d))
            (void)daemon__async_below_floor(d, &r->info, 1);    /* counted and said when that is why */
        break;
    case INTAKE_DUPLICATE:
        dl_log(DL_LOG_DEBUG, "intake", "delta already taken in", "path=%s", name);
        break;
    case INTAKE_INCOMPLETE:
        if (final)      /* it stopped changing and is still short (or cannot grow: a download) */
            daemon__rejected(d, name, r->rel_path, &r->info, &r->err);
        else
            dl_log(DL_LOG_DEBUG, "intake", "delta incomplete, will retry", "path=%s bytes=%" PRIu64, name, r->size);
        break;
    case INTAKE_INVALID:
        daemon__rejected(d, name, r->rel_path, &r->info, &r->err);
        if (r->in_cache)
            daemon__discard_local(d, r->src_path, 0);
        break;
    case INTAKE_IO:
        if (!retry)
            daemon__log_error("intake", "cannot take in a delta", &r->err);
        break;
    }
    if (r->remove_src)
        daemon__discard_local(d, r->src_path, 1);   /* a download: its validated copy is in the cache */
    intake_req_free(r);
    daemon__dispatch_intake(d);
}

void daemon__dispatch_intake(dilocod *d)
{
    while (!d->stopping && d->intake.in_flight < MAX_INTAKE_IN_FLIGHT && d->intake.n > 0 &&
           daemon__state(d) != S_WAITING_GLOBAL) {
        intake_req *r = d->intake.queue[0];
        memmove(d->intake.queue, d->intake.queue + 1, (d->intake.n - 1) * sizeof(*d->intake.queue));
        d->intake.n--;
        r->global = d->model;
        r->step = d->rnd.step;
        /* sync: this step's deltas only; async: within the staleness bound, and any base for a delta the
         * cache held at a restart (taken before it) */
        r->max_staleness = !daemon__async(d) ? 0 : r->in_cache ? UINT64_MAX : daemon__async_bound(d);
        if (daemon__queue(d, intake_work, intake_done, r) != 0) {
            intake_req_free(r);
            continue;
        }
        d->intake.in_flight++;
    }
}

/* ---- the round: its timer, its close, its opening ------------------------------------------------ */

static void round_timer_cb(uv_timer_t *t)
{
    daemon__maybe_close_round(container_of(t, dilocod, round_timer));
}

void daemon__maybe_close_round(dilocod *d)
{
    round_close_reason why;

    /* a bootstrap still copying --init-model: the round takes deltas in, and closes once step 0 is
     * committed (adopt_done) */
    if (daemon__state(d) != S_COLLECTING || d->stopping || d->bootstrap_in_flight ||
        !round_should_close(&d->rnd, daemon__now(d), &why))
        return;
    d->rnd.closed = 1;
    uv_timer_stop(&d->round_timer);
    dl_log(DL_LOG_INFO, "round", "closed", "step=%" PRIu64 " nodes=%zu expected=%u reason=%s", d->rnd.step, d->rnd.n,
           d->cfg->expected_nodes, round_close_reason_name(why));
    snprintf(d->agg.reason, sizeof(d->agg.reason), "%s", round_close_reason_name(why));
    d->agg.retry_delay = d->cfg->retry_interval;
    daemon__start_aggregation(d);
}

static void requeue_cache_dir(dilocod *d, uint64_t step);

/* Runs when collecting starts (startup, or right after adopting a global): the cached deltas are
 * offered again.  Sync: the open round's; async: those of every base up to the committed step (each
 * one there was taken and not consumed: a consumed one goes before its redo record). */
static void requeue_cache(dilocod *d)
{
    if (!daemon__async(d)) {
        requeue_cache_dir(d, d->st.step);
        return;
    }
    char *top = store_cache_root(&d->st);
    uv_fs_t req;
    uv_dirent_t ent;

    if (top == NULL)
        return;
    if (uv_fs_scandir(&d->loop, &req, top, 0, NULL) >= 0) {
        while (uv_fs_scandir_next(&req, &ent) != UV_EOF) {
            uint64_t base;
            if (ent.name[0] == 's' && delta_parse_int(ent.name + 1, strlen(ent.name + 1), &base) == 0 &&
                base <= d->st.step)
                requeue_cache_dir(d, base);
        }
    }
    uv_fs_req_cleanup(&req);
    free(top);
}

static void requeue_cache_dir(dilocod *d, uint64_t step)
{
    char *dir = store_cache_dir(&d->st, step);
    uv_fs_t req;
    uv_dirent_t ent;

    if (dir == NULL)
        return;
    /* Runs when collecting starts (startup, or right after adopting a global, when the cache of the
     * new step is empty): a synchronous scandir of one small directory. */
    if (uv_fs_scandir(&d->loop, &req, dir, 0, NULL) >= 0) {
        while (uv_fs_scandir_next(&req, &ent) != UV_EOF) {
            if (!delta_valid_node_id(ent.name, strlen(ent.name)))
                continue;
            char *sub = NULL;
            uv_fs_t sreq;
            uv_dirent_t f;
            if (asprintf(&sub, "%s/%s", dir, ent.name) < 0)
                continue;
            if (uv_fs_scandir(&d->loop, &sreq, sub, 0, NULL) >= 0) {
                while (uv_fs_scandir_next(&sreq, &f) != UV_EOF) {
                    char *abs = NULL;
                    char base[ST_INDEX_BASE_MAX + 1];
                    uint32_t si, sn;
                    st_name_kind kind = st_index_classify(f.name, strlen(f.name), base, &si, &sn);
                    /* a set is taken in through its index (its shards go with it) */
                    if (strncmp(f.name, "delta_", 6) != 0 || (kind != ST_NAME_SINGLE && kind != ST_NAME_INDEX) ||
                        asprintf(&abs, "%s/%s", sub, f.name) < 0)
                        continue;
                    enqueue_intake(d, abs, NULL, 1, 0);
                    free(abs);
                }
            }
            uv_fs_req_cleanup(&sreq);
            free(sub);
        }
    }
    uv_fs_req_cleanup(&req);
    free(dir);
}

/* Sizes the /status model section and the default upload limit report. */
static void model_facts(dilocod *d)
{
    d->model_params = d->model_bytes = d->delta_bytes = 0;
    for (size_t i = 0; i < d->model->ntensors; i++) {
        const st_tensor *t = &d->model->tensors[i];
        d->model_params += t->nelem;
        d->model_bytes += st_tensor_bytes(t);
        if (st_dtype_is_floating(t->dtype))
            d->delta_bytes += t->nelem * (t->dtype == ST_C64 ? 8 : 4);
    }
}

/* The round of d->st.step opens on d->model: deltas are taken in from here on. */
void daemon__round_open(dilocod *d)
{
    round_init(&d->rnd, d->st.step, d->cfg->expected_nodes, d->cfg->nodes, d->cfg->nnodes, d->cfg->min_nodes,
               d->cfg->round_timeout);
    if (daemon__async(d))
        round_init_async(&d->rnd, d->cfg->max_staleness == CONFIG_NO_STALENESS_BOUND ? ROUND_NO_STALENESS_BOUND
                                                                                      : d->cfg->max_staleness,
                         d->cfg->staleness_weight == WEIGHT_POLY, d->cfg->grace_ms / 1000.0, d->cfg->async_queue);
    if (daemon__async(d))
        daemon__async_round_opened(d);
    pipeline_begin(&d->pipe, d->st.step + 1, STEP_COLLECTING);
    model_facts(d);
    if (d->hub != NULL) {
        hub_limits lim = {
            .delta_index_bytes = st_index_cap_for(d->model),
            .delta_set_bytes = intake_set_budget(d->delta_bytes, (uint64_t)d->cfg->max_delta_header_mib << 20),
            .max_staleness = daemon__async(d) ? d->rnd.max_staleness : 0,
            .async = daemon__async(d),
            .min_base = daemon__async(d) ? d->async.floor : 0,
        };
        hub_set_limits(d->hub, &lim);
        hub_set_step(d->hub, d->st.step, 0);
    }
    if (daemon__async(d))
        (void)daemon__async_bound(d);
    daemon__plan_layout(d);
    dl_log(DL_LOG_INFO, "round", "opened", "step=%" PRIu64 " expected=%u min_nodes=%u tensors=%zu", d->rnd.step,
           d->cfg->expected_nodes, d->cfg->min_nodes, d->model->ntensors);
    requeue_cache(d);
    daemon__dispatch_intake(d);
}
