#include "daemon.h"
#include "daemon_internal.h"
#include "daemon_parts.h"

#include <errno.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <inttypes.h>
#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <uv.h>

#include "delta.h"
#include "dl_log.h"
#include "fsutil.h"
#include "hub.h"
#include "intake.h"
#include "outer.h"
#include "round.h"
#include "safetensors.h"
#include "st_index.h"
#include "st_reshard.h"
#include "stepcount.h"
#include "store.h"

const char *daemon__state_name(dstate s)
{
    switch (s) {
    case S_WAITING_GLOBAL: return "waiting_for_global";
    case S_COLLECTING: return "collecting";
    case S_AGGREGATING: return "aggregating";
    case S_RETRY_WAIT: return "retry_wait";
    }
    return "?";
}

static double now_s(dilocod *d)
{
    return (double)uv_now(&d->loop) / 1000.0;
}

/* ---- small pool jobs -------------------------------------------------------------------------- */

static void job_work_cb(uv_work_t *req)
{
    job *j = container_of(req, job, req);
    j->work(j);
}

static void job_after_cb(uv_work_t *req, int status)
{
    job *j = container_of(req, job, req);
    dilocod *d = j->d;
    if (status == UV_ECANCELED) {
        j->rc = -DL_E_IO;
        dl_fail(&j->err, DL_E_IO, NULL, 0, "cancelled");
    }
    d->jobs_in_flight--;
    j->done(j);
    free(j);
    daemon__maybe_finish_shutdown(d);
}

int daemon__queue(dilocod *d, daemon_job_fn work, daemon_job_fn done, void *arg, uint64_t u, int flag)
{
    job *j = calloc(1, sizeof(*j));
    int rc;

    if (j == NULL)
        return UV_ENOMEM;
    j->d = d;
    j->work = work;
    j->done = done;
    j->arg = arg;
    j->u = u;
    j->flag = flag;
    dl_error_clear(&j->err);
    if ((rc = uv_queue_work(&d->loop, &j->req, job_work_cb, job_after_cb)) != 0) {
        free(j);
        return rc;
    }
    d->jobs_in_flight++;
    return 0;
}

void daemon__log_error(const char *component, const char *msg, const dl_error *e)
{
    char m[600], t[300];
    dl_log(DL_LOG_ERROR, component, msg, "code=%s error=%s%s%s", dl_error_name(e->code),
           dl_log_q(m, sizeof(m), e->message), e->tensor[0] ? " tensor=" : "",
           e->tensor[0] ? dl_log_q(t, sizeof(t), e->tensor) : "");
}

/* ---- deltas from the transport ---------------------------------------------------------------- */

/* ---- intake ---------------------------------------------------------------------------------- */

static void intake_work(job *j)
{
    intake_run(j->arg);
}

static void unlink_cb(uv_fs_t *req)
{
    uv_fs_req_cleanup(req);
    free(req);
}

/* Deletes a file without blocking the loop (libuv runs the unlink on its pool). */
void daemon__unlink_async(dilocod *d, const char *path)
{
    uv_fs_t *req = malloc(sizeof(*req));
    if (req == NULL || uv_fs_unlink(&d->loop, req, path, unlink_cb) != 0)
        free(req);
}

static void remove_work(job *j)
{
    j->rc = j->flag ? store_remove_tree(j->arg) : store_remove_delta(j->arg);
}

static void remove_done(job *j)
{
    free(j->arg);
}

/* Deletes a delta or a global of ours without blocking the loop: a file, or a set.  A set in the
 * cache goes as its index and shards; a transport's download (download = 1) as the directory that
 * holds only that set (hub.h). */
void daemon__discard_local(dilocod *d, const char *path, int download)
{
    char *p;

    if (!st_index_is_index_path(path)) {
        daemon__unlink_async(d, path);
        return;
    }
    p = download ? strndup(path, (size_t)(strrchr(path, '/') - path)) : strdup(path);
    if (p == NULL || daemon__queue(d, remove_work, remove_done, p, 0, download) != 0)
        free(p);
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
    if (d->nqueue == d->cap_queue) {
        size_t nc = d->cap_queue ? d->cap_queue * 2 : 16;
        intake_req **nq = realloc(d->queue, nc * sizeof(*nq));
        if (nq == NULL) {
            intake_req_free(r);
            dl_log(DL_LOG_ERROR, "intake", "out of memory", "path=%s", path);
            return NULL;
        }
        d->queue = nq;
        d->cap_queue = nc;
    }
    d->queue[d->nqueue++] = r;
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
        d->queue[--d->nqueue] = NULL;
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
    wait = deadline - now_s(d);
    uv_timer_start(&d->round_timer, round_timer_cb, wait > 0 ? (uint64_t)(wait * 1000) + 1 : 0, 0);
}

static void count_refusal(dilocod *d, round_verdict v)
{
    stats_delta_refused(&d->m, v);
}

round_verdict daemon__peek(dilocod *d, const delta_info *info)
{
    /* no global yet: nothing can be based on a step we do not have */
    return d->state == S_WAITING_GLOBAL ? ROUND_FUTURE : round_peek(&d->rnd, info);
}

/* daemon__offer, for a delta linked from a shared tree when guard is non-NULL: the version validated,
 * which the round checks again before and after its pass. */
static round_verdict offer(dilocod *d, const delta_info *info, char *cache_path, uint64_t size,
                           const fsu_ident *guard)
{
    char *replaced = NULL, qn[160];
    round_verdict v = round_offer(&d->rnd, info, cache_path, size, now_s(d), &replaced);
    int first = d->rnd.n == 1 && v == ROUND_ACCEPTED;

    if ((v == ROUND_ACCEPTED || v == ROUND_REPLACED) && guard != NULL)
        round_guard(&d->rnd, info->node_id, guard);
    if (v == ROUND_ACCEPTED || v == ROUND_REPLACED) {
        dl_log(DL_LOG_INFO, "round", v == ROUND_ACCEPTED ? "delta accepted" : "delta replaced",
               "step=%" PRIu64 " node=%s local_step=%" PRIu64 " bytes=%" PRIu64 " nodes=%zu expected=%u",
               d->rnd.step, dl_log_q(qn, sizeof(qn), info->node_id), info->local_step, size, d->rnd.n,
               d->cfg->expected_nodes);
        stats_delta_taken(&d->m, v);
        if (replaced != NULL) {
            daemon__discard_local(d, replaced, 0);
            free(replaced);
        }
        if (first && d->rnd.timeout > 0)
            daemon__arm_round_timer(d);
        daemon__maybe_close_round(d);
        return v;
    }
    count_refusal(d, v);
    dl_log(v == ROUND_NOT_NEWER ? DL_LOG_INFO : DL_LOG_WARN, "round", "delta refused",
           "step=%" PRIu64 " node=%s local_step=%" PRIu64 " base_outer_step=%" PRIu64 " reason=%s", d->rnd.step,
           dl_log_q(qn, sizeof(qn), info->node_id), info->local_step, info->base_outer_step, round_verdict_name(v));
    daemon__discard_local(d, cache_path, 0);    /* refused: its cached copy has no use */
    free(cache_path);
    return v;
}

round_verdict daemon__offer(dilocod *d, const delta_info *info, char *cache_path, uint64_t size)
{
    return offer(d, info, cache_path, size, NULL);
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
    if ((e = round_find(&d->rnd, r->info.node_id)) == NULL) {
        /* the cached copy it met is on its way out (a rewritten entry dropped while this ran) or in
         * (a restart's cached delta not offered yet): the transport hands it over again later */
        *retry = 1;
        return 0;
    }
    if (!e->guarded || e->local_step != r->info.local_step || fsu_ident_check(e->path, &e->ident) == 1)
        return 0;
    if (d->state != S_COLLECTING) {
        *retry = 1;             /* the pass's checks drop it; the new version comes back after */
        return 0;
    }
    dl_log(DL_LOG_WARN, "round", "delta rewritten in place after it was taken in: dropped, it is taken in again",
           "step=%" PRIu64 " local_step=%" PRIu64, d->rnd.step, e->local_step);
    round_drop(&d->rnd, r->info.node_id, &path);
    (void)unlink(path);         /* our link only (the tree keeps its own name): no data is freed here */
    free(path);
    d->m.deltas_rewritten++;
    r->status = INTAKE_IO;
    r->linked = 0;
    r->link_errno = 0;
    memset(&r->info, 0, sizeof(r->info));
    dl_error_clear(&r->err);
    if (d->nqueue == d->cap_queue)
        return 0;               /* no room to run it again now: the transport hands it over later */
    d->queue[d->nqueue++] = r;
    return 1;
}

void daemon__rejected(dilocod *d, const char *what, const dl_error *err)
{
    char m[600], t[300];

    stats_delta_rejected(&d->m, err->code);
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
    dilocod *d = j->d;
    intake_req *r = j->arg;
    const char *name = r->rel_path ? r->rel_path : r->src_path;
    char qn[160], qp[600];
    hub_version v = {r->size, r->mtime_ns, r->ino};
    int retry, final;

    d->intake_in_flight--;
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
    if (r->link_errno != 0 && !d->link_refused_said) {
        char qe[200];
        d->link_refused_said = 1;
        dl_log(DL_LOG_WARN, "intake", "deltas are copied into the state, not linked: slower",
               "reason=%s hint=%s", dl_log_q(qe, sizeof(qe), strerror(r->link_errno)),
               r->link_errno == EXDEV ? "put --state-root on the shared tree's filesystem for zero-copy intake"
                                      : "links to the tree's files are refused (protected_hardlinks: run as the files' owner)");
    }
    /* a transport's file: it learns the outcome (and says whether a short file is short for good) */
    final = r->rel_path != NULL && d->hub != NULL ? hub_mark_done(d->hub, r->rel_path, hub_outcome_of(r->status), &v) : 1;
    switch (r->status) {
    case INTAKE_OK:
        /* when stopping, the cached copy stays: the restart offers it again */
        if (!d->stopping) {
            round_verdict verdict = offer(d, &r->info, r->cache_path, r->size, r->linked ? &r->ident : NULL);
            r->cache_path = NULL;
            if (r->rel_path != NULL && (verdict == ROUND_ACCEPTED || verdict == ROUND_REPLACED))
                remember_consumed(d, r->rel_path);      /* pruned once its step is durable */
            else if (r->rel_path != NULL && (verdict == ROUND_STALE || verdict == ROUND_NOT_NEWER))
                daemon__prune_now(d, r->rel_path);              /* can never count: superseded or too old */
        }
        break;
    case INTAKE_STALE:
    case INTAKE_FUTURE:
        round_count_refused(&d->rnd, r->status == INTAKE_STALE ? ROUND_STALE : ROUND_FUTURE);
        stats_delta_refused(&d->m, r->status == INTAKE_STALE ? ROUND_STALE : ROUND_FUTURE);
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
        break;
    case INTAKE_DUPLICATE:
        dl_log(DL_LOG_DEBUG, "intake", "delta already taken in", "path=%s", name);
        break;
    case INTAKE_INCOMPLETE:
        if (final)      /* it stopped changing and is still short (or cannot grow: a download) */
            daemon__rejected(d, name, &r->err);
        else
            dl_log(DL_LOG_DEBUG, "intake", "delta incomplete, will retry", "path=%s bytes=%" PRIu64, name, r->size);
        break;
    case INTAKE_INVALID:
        daemon__rejected(d, name, &r->err);
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
    while (!d->stopping && d->intake_in_flight < MAX_INTAKE_IN_FLIGHT && d->nqueue > 0 &&
           d->state != S_WAITING_GLOBAL) {
        intake_req *r = d->queue[0];
        memmove(d->queue, d->queue + 1, (d->nqueue - 1) * sizeof(*d->queue));
        d->nqueue--;
        r->global = d->model;
        r->step = d->rnd.step;
        if (daemon__queue(d, intake_work, intake_done, r, 0, 0) != 0) {
            intake_req_free(r);
            continue;
        }
        d->intake_in_flight++;
    }
}

/* ---- rounds and aggregation ------------------------------------------------------------------ */

static void round_timer_cb(uv_timer_t *t)
{
    daemon__maybe_close_round(container_of(t, dilocod, round_timer));
}

void daemon__maybe_close_round(dilocod *d)
{
    round_close_reason why;

    /* a bootstrap still copying --init-model: the round takes deltas in, and closes once step 0 is
     * committed (adopt_done) */
    if (d->state != S_COLLECTING || d->stopping || d->bootstrap_in_flight ||
        !round_should_close(&d->rnd, now_s(d), &why))
        return;
    d->rnd.closed = 1;
    uv_timer_stop(&d->round_timer);
    dl_log(DL_LOG_INFO, "round", "closed", "step=%" PRIu64 " nodes=%zu expected=%u reason=%s", d->rnd.step, d->rnd.n,
           d->cfg->expected_nodes, round_close_reason_name(why));
    snprintf(d->pass_reason, sizeof(d->pass_reason), "%s", round_close_reason_name(why));
    d->retry_delay = d->cfg->retry_interval;
    daemon__start_aggregation(d);
}

static const hub_callbacks hub_cbs = {daemon__on_delta_ready, daemon__on_published_seen, daemon__on_global_ready,
                                      daemon__on_publish_done};

static void hub_closed(void *app)
{
    dilocod *d = app;
    d->hub = NULL;
    daemon__maybe_finish_shutdown(d);
}

/* ---- startup and shutdown -------------------------------------------------------------------- */

static void requeue_cache(dilocod *d)
{
    char *dir = store_cache_dir(&d->st, d->st.step);
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
    d->state = S_COLLECTING;
    pipeline_begin(&d->pipe, d->st.step + 1, STEP_COLLECTING);
    model_facts(d);
    if (d->hub != NULL) {
        hub_limits lim = {
            .delta_index_bytes = st_index_cap_for(d->model),
            .delta_set_bytes = intake_set_budget(d->delta_bytes, (uint64_t)d->cfg->max_delta_header_mib << 20),
        };
        hub_set_limits(d->hub, &lim);
        hub_set_step(d->hub, d->st.step, 0);
    }
    daemon__plan_layout(d);
    dl_log(DL_LOG_INFO, "round", "opened", "step=%" PRIu64 " expected=%u min_nodes=%u tensors=%zu", d->rnd.step,
           d->cfg->expected_nodes, d->cfg->min_nodes, d->model->ntensors);
    requeue_cache(d);
    daemon__dispatch_intake(d);
}

/* d->st.step's global is committed (at startup, or adopted, or bootstrapped): served and published. */
void daemon__global_committed(dilocod *d)
{
    if (pipeline_find(&d->pipe, d->st.step) == NULL)             /* committed whole: adopted, bootstrapped */
        pipeline_begin(&d->pipe, d->st.step, STEP_DURABLE);
    /* one open of the committed global for downloads (a sharded layout once its set is written, which
     * a restart finds already there) */
    daemon__serve_step(d, -1, d->st.step);
    daemon__ensure_set(d);
    struct stat sb;
    if (stat(d->st.global_path, &sb) == 0)
        d->committed_at = sb.st_mtime;      /* the step's file was written when it was committed */
    daemon__start_warm(d);
    daemon__maybe_publish(d);
}

void daemon__collecting_start(dilocod *d)
{
    dl_error err;

    if (d->model == NULL && daemon__open_model(d, d->st.global_path, 0, &err) != 0) {
        daemon__log_error("store", "cannot open the committed global", &err);
        d->exit_code = 1;
        uv_stop(&d->loop);
        return;
    }
    daemon__round_open(d);
    daemon__global_committed(d);
}

static void close_cb(uv_handle_t *h)
{
    (void)h;
}

static void close_walk_cb(uv_handle_t *h, void *arg)
{
    (void)arg;
    if (!uv_is_closing(h))
        uv_close(h, close_cb);
}

void daemon__maybe_finish_shutdown(dilocod *d)
{
    if (!d->stopping || d->jobs_in_flight > 0 || d->http != NULL || d->hub != NULL)
        return;
    uv_walk(&d->loop, close_walk_cb, NULL);
}

static void http_stopped(void *app)
{
    dilocod *d = app;
    d->http = NULL;
    daemon__maybe_finish_shutdown(d);
}

static void signal_cb(uv_signal_t *s, int signum)
{
    dilocod *d = s->data;

    if (d->stopping) {
        dl_log(DL_LOG_WARN, "main", "second signal: exiting now", "signal=%d", signum);
        _exit(1);
    }
    d->stopping = 1;
    dl_log(DL_LOG_INFO, "main", "shutting down", "signal=%s state=%s jobs=%d", signum == SIGINT ? "SIGINT" : "SIGTERM",
           daemon__state_name(d->state), d->jobs_in_flight);
    uv_timer_stop(&d->round_timer);
    uv_timer_stop(&d->retry_timer);
    uv_timer_stop(&d->publish_timer);
    uv_timer_stop(&d->settle_timer);
    uv_timer_stop(&d->set_timer);
    if (d->pass != NULL && d->state == S_AGGREGATING)
        outer_abort(d->pass);       /* unfinished: abandoned without a trace (temporary files removed) */
    daemon__stop_warm(d);
    if (d->http != NULL)
        http_server_stop(d->http, http_stopped);    /* uploads in progress are dropped, nothing kept */
    daemon__release_settle(d);          /* a closing transport reports no publish_done: settle now */
    if (d->hub != NULL)
        hub_close(d->hub, hub_closed, d);           /* a download resumes from its .part next time */
    daemon__maybe_finish_shutdown(d);
}

static void sighup_cb(uv_signal_t *s, int signum)
{
    dilocod *d = s->data;
    dl_error err;
    (void)signum;
    if (d->cfg->token_file == NULL) {
        dl_log(DL_LOG_INFO, "main", "SIGHUP: no token file to reload", "%s", "");
        return;
    }
    /* a small file of our own: read on the loop thread, between events */
    if (auth_load(&d->auth, d->cfg->token_file, &err) != 0)
        daemon__log_error("auth", "token file not reloaded, the previous tokens stay in force", &err);
    else
        dl_log(DL_LOG_INFO, "auth", "tokens reloaded", "file=%s entries=%zu", d->cfg->token_file, d->auth.n);
}

static int start_http(dilocod *d, dl_error *err)
{
    http_limits lim = {
        .max_url = 8192,
        .max_header_bytes = d->cfg->max_header_bytes,
        .max_headers = d->cfg->max_headers,
        .header_timeout = d->cfg->header_timeout,
        .idle_timeout = d->cfg->idle_timeout,
        .max_conns = d->cfg->max_connections,
    };
    int rc;

    if (d->cfg->listen_host == NULL)
        return 0;
    if (d->cfg->token_file != NULL && auth_load(&d->auth, d->cfg->token_file, err) != 0)
        return -DL_E_INVALID_ARGUMENT;
    rc = http_server_start(&d->http, &d->loop, d->cfg->listen_host, d->cfg->listen_port, &lim, api_on_request, d);
    if (rc != 0)
        return dl_fail(err, DL_E_IO, NULL, 0, "cannot listen on %s: %s", d->cfg->listen, strerror(-rc));
    http_server_on_response(d->http, api_count_response);
    d->http_port = http_server_port(d->http);
    return 0;
}

/* Said once startup is done: the socket is bound before (a busy port fails the start before anything
 * touches the state), but nothing is served until the loop runs. */
static void announce_http(dilocod *d)
{
    if (d->http != NULL)
        dl_log(DL_LOG_INFO, "http", "listening", "addr=%s port=%d auth=%s", d->cfg->listen, d->http_port,
               d->cfg->token_file ? "tokens" : "loopback-only");
}

static int startup(dilocod *d, dl_error *err)
{
    int rc;

    if ((rc = store_open(&d->st, d->cfg->state_root, d->cfg->id, err)) != 0)
        return rc;
    if ((rc = daemon__recover_redo(d, err)) != 0)
        return rc;
    if (d->st.committed && (rc = store_cleanup(&d->st, 1, err)) != 0)
        return rc;
    if (d->st.committed) {      /* found (or recovered) durable, and the files before it are gone */
        pipeline_begin(&d->pipe, d->st.step, STEP_DURABLE);
        pipeline_cleaned(&d->pipe, d->st.step);
    }
    if ((rc = history_compact(d->st.dir, d->cfg->history_keep, err)) != 0)
        daemon__log_error("store", "cannot compact rounds.jsonl (it keeps growing)", err);
    if ((rc = history_load(&d->history, d->st.dir, d->st.committed ? d->st.step : UINT64_MAX, d->st.round_json,
                           err)) != 0)
        return rc;
    if (d->st.committed) {
        dl_log(DL_LOG_INFO, "store", "resuming", "step=%" PRIu64 " dir=%s", d->st.step, d->st.dir);
        if (d->cfg->init_model != NULL)
            dl_log(DL_LOG_INFO, "store", "state exists, --init-model ignored", "init_model=%s", d->cfg->init_model);
        return 0;               /* the transport's first poll tells whether our step is published */
    }
    if (d->hub != NULL) {
        /* the first poll tells whether the transport holds a global (adopt it) or not (bootstrap) */
        d->state = S_WAITING_GLOBAL;
        return 0;
    }
    if (d->cfg->init_model == NULL)
        return dl_fail(err, DL_E_INVALID_ARGUMENT, NULL, 0,
                       "no state in %s and no --init-model: nothing to start from", d->st.dir);
    model_intake mi;
    if ((rc = daemon__adopt_sync(d, d->cfg->init_model, 0, 1, 0, &mi, err)) != 0)
        return rc;
    daemon__log_bootstrapped(d, d->cfg->init_model, &mi);
    return 0;
}

static int init_handles(dilocod *d)
{
    int rc;

    if ((rc = uv_loop_init(&d->loop)) != 0)
        return rc;
    uv_signal_init(&d->loop, &d->sigint);
    uv_signal_init(&d->loop, &d->sigterm);
    d->sigint.data = d->sigterm.data = d;
    uv_timer_init(&d->loop, &d->round_timer);
    uv_timer_init(&d->loop, &d->retry_timer);
    uv_timer_init(&d->loop, &d->progress_timer);
    uv_timer_init(&d->loop, &d->publish_timer);
    uv_timer_init(&d->loop, &d->settle_timer);
    uv_timer_init(&d->loop, &d->set_timer);
    uv_signal_init(&d->loop, &d->sighup);
    d->sighup.data = d;
    if ((rc = uv_async_init(&d->loop, &d->warm_async, daemon__warm_async_cb)) != 0)
        return rc;
    uv_check_init(&d->loop, &d->busy_check);
    uv_signal_start(&d->sigint, signal_cb, SIGINT);
    uv_signal_start(&d->sigterm, signal_cb, SIGTERM);
    uv_signal_start(&d->sighup, sighup_cb, SIGHUP);
    return 0;
}

static void start_watching(dilocod *d)
{
    if (d->hub == NULL)
        return;
    hub_set_step(d->hub, d->st.step, d->state == S_WAITING_GLOBAL);
    hub_start(d->hub);
}

/* The transport of --hub (none: no transport). */
static int open_hub(dilocod *d, dl_error *err)
{
    char *dir = NULL;
    int rc;

    if (hub_find(d->cfg->hub) == NULL)
        return 0;
    if (asprintf(&dir, "%s/%s", d->cfg->state_root, d->cfg->id) < 0)
        return dl_fail(err, DL_E_NO_MEMORY, NULL, 0, "out of memory");
    hub_config hc = {
        .url = d->cfg->hub,
        .state_dir = dir,
        .endpoint = d->cfg->hub_endpoint,
        .token = d->cfg->hub_token,
        .poll_interval = d->cfg->poll_interval,
        .max_downloads = d->cfg->max_downloads,
        .max_header_bytes = (uint64_t)d->cfg->max_delta_header_mib << 20,
        .region = d->cfg->s3_region,
        .addressing = d->cfg->s3_addressing,
        .part_size = (uint64_t)d->cfg->s3_part_mib << 20,
        .claim_lease = d->cfg->s3_claim_lease,
        .credentials_file = d->cfg->s3_credentials_file,
    };
    rc = hub_open(&d->hub, &d->loop, &hc, &hub_cbs, d, err);
    free(dir);
    return rc;
}

int daemon_run(config *cfg)
{
    dilocod *d = calloc(1, sizeof(*d));
    char *state_dir = NULL;
    dl_error err;
    int rc;
    char threads[16];

    if (d == NULL)
        return 1;
    d->cfg = cfg;
    d->started_at = time(NULL);
    d->published_step = -1;
    d->adopt_refused_step = -1;
    d->set_step = -1;
    d->set_nshards = 1;
    d->state = S_COLLECTING;            /* startup() switches to S_WAITING_GLOBAL when it must */
    d->retry_delay = cfg->retry_interval;
    pipeline_init(&d->pipe, NULL, NULL);
    /* the pool size is read once, at the first uv_queue_work: set it before anything queues */
    snprintf(threads, sizeof(threads), "%u", cfg->threads + MAX_INTAKE_IN_FLIGHT + 2);
    setenv("UV_THREADPOOL_SIZE", threads, 1);
    if ((rc = init_handles(d)) != 0) {
        fprintf(stderr, "dilocod: cannot start the event loop: %s\n", uv_strerror(rc));
        free(d);
        return 1;
    }
    dl_error_clear(&err);
    dl_log(DL_LOG_INFO, "main", "starting", "id=%s state_root=%s hub=%s optimizer=%s lr=%g momentum=%g threads=%u",
           cfg->id, cfg->state_root, cfg->hub, config_optimizer_name(cfg->optimizer), cfg->lr, cfg->momentum,
           cfg->threads);
    /* A start that fails changes nothing on disk: what can fail without touching the state comes first
     * (the listening socket; no request is served before the loop runs), and a state directory this
     * start created is removed again if nothing was committed in it. */
    if (asprintf(&state_dir, "%s/%s", cfg->state_root, cfg->id) < 0)
        state_dir = NULL;
    int state_existed = state_dir == NULL || access(state_dir, F_OK) == 0;
    if ((rc = start_http(d, &err)) != 0 || (rc = open_hub(d, &err)) != 0 || (rc = startup(d, &err)) != 0) {
        daemon__log_error("main", "cannot start", &err);
        d->exit_code = 1;
        d->stopping = 1;
        if (d->hub != NULL)
            hub_close(d->hub, hub_closed, d);
        if (d->http != NULL)
            http_server_stop(d->http, http_stopped);
        daemon__maybe_finish_shutdown(d);
    } else {
        announce_http(d);
        start_watching(d);
        if (d->state != S_WAITING_GLOBAL)
            daemon__collecting_start(d);
    }
    uv_run(&d->loop, UV_RUN_DEFAULT);
    /* uv_stop (fatal error) may leave handles open: close them and run the loop dry */
    d->stopping = 1;
    uv_walk(&d->loop, close_walk_cb, NULL);
    uv_run(&d->loop, UV_RUN_DEFAULT);
    rc = uv_loop_close(&d->loop);
    if (rc != 0) {
        dl_log(DL_LOG_ERROR, "main", "event loop did not close cleanly", "error=%s", uv_strerror(rc));
        d->exit_code = d->exit_code ? d->exit_code : 1;
    }
    if (d->exit_code != 0 && !state_existed && !d->st.committed) {
        store_remove_tree(state_dir);   /* this start made it and committed nothing: leave no skeleton */
        dl_log(DL_LOG_INFO, "main", "removed the state directory this failed start created", "dir=%s", state_dir);
    }
    free(state_dir);
    dl_log(DL_LOG_INFO, "main", "stopped", "step=%" PRIu64 " exit_code=%d", d->st.step, d->exit_code);
    int code = d->exit_code;
    for (size_t i = 0; i < d->nqueue; i++)
        intake_req_free(d->queue[i]);
    free(d->queue);
    daemon__pass_release(d);
    daemon__drop_warm(d, d->warm_tmp);
    round_free(&d->rnd);
    st_header_free(d->model);
    store_free(&d->st);
    auth_free(&d->auth);
    daemon__served_clear(&d->global);
    history_free(&d->history);
    history_record_free(&d->pending_record);
    free(d->pending_round);
    free(d->unappended);
    daemon__settle_free(d->settle_retry);
    daemon__settle_free(d->settle_after_publish);
    daemon__free_rels(d->round_rels, d->nround_rels);
    free(d);
    return code;
}
