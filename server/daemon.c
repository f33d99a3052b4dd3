/* dilocod: the wiring and the lifecycle.  Startup (the HTTP listener, the transport, the state and a
 * redo record's recovery), the handles, the signals and shutdown live here, and the pool's small
 * jobs every part queues; each concern of the step pipeline has a file of its own, and
 * daemon_parts.h is the calls between them:
 *
 *   daemon_intake.c   deltas in (the transport's, the cache's at a restart), the open round, its close
 *   daemon_pass.c     the aggregation on the pool, the warmed outputs, the round's inputs made durable
 *   daemon_commit.c   the commit (the redo record), settling, cleanup, round records, recovery
 *   daemon_publish.c  the served global, the published layout (sets), publishing
 *   daemon_adopt.c    a global adopted from the transport, or bootstrapped from --init-model
 */
#include "daemon.h"
#include "daemon_internal.h"
#include "daemon_parts.h"

#include <inttypes.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <errno.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <uv.h>

#include "dl_log.h"
#include "history.h"
#include "http.h"
#include "hub.h"
#include "intake.h"
#include "outer.h"
#include "pipeline.h"
#include "round.h"
#include "safetensors.h"
#include "st_index.h"
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

dstate daemon__state(const dilocod *d)
{
    if (!d->st.committed && d->model == NULL)
        return S_WAITING_GLOBAL;
    switch (pipeline_state(&d->pipe, d->rnd.step + 1)) {
    case STEP_COMPUTING:
    case STEP_INPUTS_DURABLE:
    case STEP_COMMITTED:        /* the commit's own callback, before the next round opens */
    case STEP_SERVED:
    case STEP_PUBLISHED:
    case STEP_DURABLE:
        return S_AGGREGATING;
    case STEP_RETRY_WAIT:
        return S_RETRY_WAIT;
    default:                    /* collecting, failed (the daemon stops), or the round about to open */
        return S_COLLECTING;
    }
}

/* ---- small pool jobs, and removing our files off the loop ---------------------------------------- */

static void jobs_drained(job_owner *o)
{
    daemon__maybe_finish_shutdown(container_of(o, dilocod, jobs));
}

int daemon__queue(dilocod *d, pool_job_fn work, pool_job_fn done, void *arg)
{
    return job_queue(&d->jobs, work, done, arg);
}

void daemon__log_error(const char *component, const char *msg, const dl_error *e)
{
    char m[600], t[300];
    dl_log(DL_LOG_ERROR, component, msg, "code=%s error=%s%s%s", dl_error_name(e->code),
           dl_log_q(m, sizeof(m), e->message), e->tensor[0] ? " tensor=" : "",
           e->tensor[0] ? dl_log_q(t, sizeof(t), e->tensor) : "");
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

typedef struct remove_args {
    char *path;
    int tree;                   /* a directory of ours (a download's set), else a cached delta */
} remove_args;

static void remove_work(job *j)
{
    remove_args *a = j->arg;
    j->rc = a->tree ? store_remove_tree(a->path) : store_remove_delta(a->path);
}

static void remove_done(job *j)
{
    remove_args *a = j->arg;
    free(a->path);
    free(a);
}

/* Deletes a delta or a global of ours without blocking the loop: a file, or a set.  A set in the
 * cache goes as its index and shards; a transport's download (download = 1) as the directory that
 * holds only that set (hub.h). */
void daemon__discard_local(dilocod *d, const char *path, int download)
{
    remove_args *a;

    if (!st_index_is_index_path(path)) {
        daemon__unlink_async(d, path);
        return;
    }
    if ((a = calloc(1, sizeof(*a))) == NULL)
        return;
    a->tree = download;
    a->path = download ? strndup(path, (size_t)(strrchr(path, '/') - path)) : strdup(path);
    if (a->path == NULL || daemon__queue(d, remove_work, remove_done, a) != 0) {
        free(a->path);
        free(a);
    }
}

/* ---- a committed global: collecting on it -------------------------------------------------------- */

/* d->st.step's global is committed (at startup, or adopted, or bootstrapped): served and published. */
void daemon__global_committed(dilocod *d)
{
    if (pipeline_find(&d->pipe, d->st.step) == NULL)             /* committed whole: adopted, bootstrapped */
        pipeline_begin(&d->pipe, d->st.step, STEP_DURABLE);
    /* one open of the committed global for downloads (a sharded layout once its set is written, which
     * a restart finds already there) */
    daemon__serve_step(d, -1, d->st.step);
    daemon__downlink_serve(d);
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

/* ---- shutdown ------------------------------------------------------------------------------------ */

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
    if (!d->stopping || d->jobs.in_flight > 0 || d->warm.job != NULL || d->http != NULL || d->hub != NULL ||
        d->cluster != NULL)
        return;
    uv_walk(&d->loop, close_walk_cb, NULL);
}

static void http_stopped(void *app)
{
    dilocod *d = app;
    d->http = NULL;
    daemon__maybe_finish_shutdown(d);
}

static void hub_closed(void *app)
{
    dilocod *d = app;
    d->hub = NULL;
    daemon__maybe_finish_shutdown(d);
}

void daemon__close_hub(dilocod *d)
{
    hub_close(d->hub, hub_closed, d);
}

/* The shutdown a signal starts, or a fatal error (daemon__fatal): what runs is stopped or left to finish,
 * and the loop ends once every part has closed (daemon__maybe_finish_shutdown). */
static void begin_shutdown(dilocod *d, const char *why)
{
    d->stopping = 1;
    dl_log(DL_LOG_INFO, "main", "shutting down", "%s state=%s jobs=%d", why, daemon__state_name(daemon__state(d)),
           d->jobs.in_flight);
    uv_timer_stop(&d->round_timer);
    uv_timer_stop(&d->retry_timer);
    uv_timer_stop(&d->publish_timer);
    uv_timer_stop(&d->settle_timer);
    uv_timer_stop(&d->set_timer);
    if (d->agg.pass != NULL && daemon__state(d) == S_AGGREGATING)
        outer_abort(d->agg.pass);       /* unfinished: abandoned without a trace (temporary files removed) */
    daemon__stop_warm(d);
    if (d->http != NULL)
        http_server_stop(d->http, http_stopped);    /* uploads in progress are dropped, nothing kept */
    daemon__release_settle(d);          /* a closing transport reports no publish_done: settle now */
    if (d->cluster != NULL)
        daemon__cluster_stop(d);        /* its end closes the transport it borrows */
    else if (d->hub != NULL)
        hub_close(d->hub, hub_closed, d);           /* a download resumes from its .part next time */
    daemon__maybe_finish_shutdown(d);
}

static void signal_cb(uv_signal_t *s, int signum)
{
    dilocod *d = s->data;

    if (d->stopping) {
        dl_log(DL_LOG_WARN, "main", "second signal: exiting now", "signal=%d", signum);
        _exit(1);
    }
    begin_shutdown(d, signum == SIGINT ? "signal=SIGINT" : "signal=SIGTERM");
}

static void fatal_cb(uv_async_t *h)
{
    dilocod *d = h->data;
    if (!d->stopping)
        begin_shutdown(d, "reason=fatal_error");
}

/* A move the pipeline's table refused (pipeline_on_illegal): the daemon's guards and its table
 * disagree, so what it would do next for the step is unknown.  It stops rather than guess; the state
 * on disk is crash-safe, and a restart recovers the step from it (server/README.md, Crash safety). */
static void pipeline_refused(void *arg, uint64_t step, const char *what)
{
    dilocod *d = arg;
    dl_error e;
    dl_fail(&e, DL_E_INTERNAL, NULL, 0, "the step pipeline refused a move of step %" PRIu64 " (%s): a bug; "
            "restarting is safe (the state on disk is crash-safe)", step, what);
    daemon__fatal(d, "pipeline", "cannot go on", &e);
}

void daemon__fatal(dilocod *d, const char *component, const char *msg, const dl_error *e)
{
    daemon__log_error(component, msg, e);
    d->exit_code = 1;
    /* on the loop's next turn, as a signal's shutdown: the callback that found it returns first (the
     * handle is closed only once a shutdown has ended: then there is nothing left to stop) */
    if (!d->stopping && uv_async_send(&d->fatal_async) != 0)
        begin_shutdown(d, "reason=fatal_error");
}

static void sighup_cb(uv_signal_t *s, int signum)
{
    dilocod *d = s->data;
    dl_error err;
    size_t entries = 0;
    (void)signum;
    if (d->cfg->token_file == NULL) {
        dl_log(DL_LOG_INFO, "main", "SIGHUP: no token file to reload", "%s", "");
        return;
    }
    /* a small file of our own: read on the loop thread, between events */
    if (d->front->load_credentials(d->cfg->token_file, &entries, &err) != 0)
        daemon__log_error("auth", "token file not reloaded, the previous tokens stay in force", &err);
    else
        dl_log(DL_LOG_INFO, "auth", "tokens reloaded", "file=%s entries=%zu", d->cfg->token_file, entries);
}

/* ---- startup ------------------------------------------------------------------------------------- */

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
    size_t entries = 0;
    int rc;

    if (d->cfg->listen_host == NULL)
        return 0;
    if (d->cfg->token_file != NULL && d->front->load_credentials(d->cfg->token_file, &entries, err) != 0)
        return -DL_E_INVALID_ARGUMENT;
    if ((rc = daemon__status_register(d)) != 0)
        return dl_fail(err, DL_E_NO_MEMORY, NULL, 0, "too many status providers");
    rc = http_server_start(&d->http, &d->loop, d->cfg->listen_host, d->cfg->listen_port, &lim, d->front->on_request, d);
    if (rc != 0)
        return dl_fail(err, DL_E_IO, NULL, 0, "cannot listen on %s: %s", d->cfg->listen, strerror(-rc));
    http_server_on_response(d->http, d->front->on_response);
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

/* Each record rounds.jsonl holds, at startup: the workers' last reports and tokens come back; async,
 * its deltas join the applied set. */
static void load_record(void *arg, const round_record *r)
{
    dilocod *d = arg;

    workers_committed(&d->workers, r, 1);
    daemon__verdicts_committed(d, r, 1);        /* what verdicts.json had not caught up with */
    if (daemon__async(d))
        daemon__async_load_record(d, r);
}

static int startup(dilocod *d, dl_error *err)
{
    int rc;

    if ((rc = store_open(&d->st, d->cfg->state_root, d->cfg->id, err)) != 0) {
        /* the default state root is root's: a user's first start should say what to give instead */
        size_t used = strlen(err->message);
        if (err->code == DL_E_IO && (err->sys_errno == EACCES || err->sys_errno == EPERM || err->sys_errno == EROFS))
            snprintf(err->message + used, sizeof(err->message) - used,
                     " (give --state-root DIR, or state_root in the config file: a directory this user may write; "
                     "the default, /var/lib/dilocod, is the service user's)");
        return rc;
    }
    /* the key before the recovery: a recomputed step is signed again, the same bytes */
    if ((rc = daemon__sign_open(d, err)) != 0 || (rc = daemon__recover_redo(d, err)) != 0)
        return rc;
    daemon__sign_chain(d);
    d->st.async_cache = daemon__async(d);  /* async: every cached delta is one acknowledged, offered again */
    d->st.updates_keep = d->cfg->updates_keep;
    if (d->st.committed && (rc = store_cleanup(&d->st, 1, err)) != 0)
        return rc;
    if (d->st.committed) {      /* found (or recovered) durable, and the files before it are gone */
        pipeline_begin(&d->pipe, d->st.step, STEP_DURABLE);
        pipeline_cleaned(&d->pipe, d->st.step);
    }
    if ((rc = history_compact(d->st.dir, d->cfg->history_keep, err)) != 0)
        daemon__log_error("store", "cannot compact rounds.jsonl (it keeps growing)", err);
    daemon__verdicts_load(d);   /* before the history's replay, which settles what the file missed */
    /* async: the deltas the history lists were applied; one that comes again is refused */
    if ((rc = history_load_each(&d->history, d->st.dir, d->st.committed ? d->st.step : UINT64_MAX, d->st.round_json,
                                load_record, d, err)) != 0)
        return rc;
    if (daemon__async(d))
        daemon__async_loaded(d);
    daemon__robust_load(d);     /* the nodes' trailing norms, from the records kept */
    if (d->st.committed) {
        dl_log(DL_LOG_INFO, "store", "resuming", "step=%" PRIu64 " dir=%s", d->st.step, d->st.dir);
        if (d->cfg->init_model != NULL)
            dl_log(DL_LOG_INFO, "store", "state exists, --init-model ignored", "init_model=%s", d->cfg->init_model);
        return 0;               /* the transport's first poll tells whether our step is published */
    }
    if (d->hub != NULL) {
        /* the first poll tells whether the transport holds a global (adopt it) or not (bootstrap): till
         * then nothing is committed and there is no model, which daemon__state calls waiting */
        return 0;
    }
    if (d->cfg->init_model == NULL)
        return dl_fail(err, DL_E_INVALID_ARGUMENT, NULL, 0,
                       "no state in %s and no --init-model: nothing to start from", d->st.dir);
    adopt_result r;
    rc = daemon__adopt_prepare(d, d->cfg->init_model, 0, 1, NULL, &r, err);
    if (rc == 0 && daemon__adopt_apply(d, &r) != 0)
        rc = dl_fail(err, DL_E_NO_MEMORY, NULL, 0, "out of memory");
    if (rc == 0) {
        daemon__log_bootstrapped(d, d->cfg->init_model, &r.mi);
        daemon__sign_chain(d);
    }
    daemon__adopt_result_free(&r);
    return rc;
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
    if ((rc = uv_async_init(&d->loop, &d->warm.async, daemon__warm_async_cb)) != 0 ||
        (rc = uv_async_init(&d->loop, &d->fatal_async, fatal_cb)) != 0)
        return rc;
    d->fatal_async.data = d;
    uv_check_init(&d->loop, &d->warm.busy_check);
    uv_signal_start(&d->sigint, signal_cb, SIGINT);
    uv_signal_start(&d->sigterm, signal_cb, SIGTERM);
    uv_signal_start(&d->sighup, sighup_cb, SIGHUP);
    return 0;
}

static void start_watching(dilocod *d)
{
    if (d->hub == NULL)
        return;
    hub_set_step(d->hub, d->st.step, daemon__state(d) == S_WAITING_GLOBAL);
    hub_start(d->hub);
}

/* The transport's callbacks into the daemon (hub.h): each lands in the file of its concern. */
static const hub_callbacks hub_cbs = {daemon__on_delta_ready, daemon__on_published_seen, daemon__on_global_ready,
                                      daemon__on_publish_done};

/* The transport of --hub (none: no transport). */
static int open_hub(dilocod *d, dl_error *err)
{
    char *dir = NULL;
    int rc;

    if (hub_find(d->cfg->hub) == NULL)
        return 0;
    if ((dir = store_path_state_dir(d->cfg->state_root, d->cfg->id)) == NULL)
        return dl_fail(err, DL_E_NO_MEMORY, NULL, 0, "out of memory");
    hub_config hc = {
        .url = d->cfg->hub,
        .state_dir = dir,
        .poll_interval = d->cfg->poll_interval,
        .max_downloads = d->cfg->max_downloads,
        .max_header_bytes = (uint64_t)d->cfg->max_delta_header_mib << 20,
        .options = config_hub_options(d->cfg),    /* the transport's own, read through its table */
    };
    rc = hub_open(&d->hub, &d->loop, &hc, &hub_cbs, d, err);
    free(dir);
    return rc;
}

int daemon__front_busy(const dilocod *d)
{
    return d->front != NULL && d->front->busy != NULL ? d->front->busy() : 0;
}

int daemon_run(config *cfg, const daemon_front *front)
{
    dilocod *d = calloc(1, sizeof(*d));
    char *state_dir = NULL;
    dl_error err;
    int rc;
    char threads[16];

    if (d == NULL)
        return 1;
    d->cfg = cfg;
    d->front = front;
    d->started_at = time(NULL);
    d->published_step = -1;
    d->publish.last_started = -1;
    d->adopt_refused_step = -1;
    d->layout.step = -1;
    d->layout.nshards = 1;
    d->agg.retry_delay = cfg->retry_interval;
    pipeline_init(&d->pipe, NULL, NULL);
    pipeline_on_illegal(&d->pipe, pipeline_refused, d);
    job_owner_init(&d->jobs, &d->loop, jobs_drained);
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
    state_dir = store_path_state_dir(cfg->state_root, cfg->id);
    int state_existed = state_dir == NULL || access(state_dir, F_OK) == 0;
    if ((rc = start_http(d, &err)) != 0 || (rc = open_hub(d, &err)) != 0 ||
        (rc = cfg->cluster_shards ? daemon__cluster_start(d, &err) : startup(d, &err)) != 0) {
        daemon__log_error("main", "cannot start", &err);
        d->exit_code = 1;
        d->stopping = 1;
        if (d->hub != NULL)
            hub_close(d->hub, hub_closed, d);
        if (d->http != NULL)
            http_server_stop(d->http, http_stopped);
        daemon__maybe_finish_shutdown(d);
    } else if (cfg->cluster_shards) {
        announce_http(d);       /* the cluster's thread runs: no local pipeline, the transport never starts */
    } else {
        announce_http(d);
        start_watching(d);
        if (daemon__state(d) != S_WAITING_GLOBAL)
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
    if (d->exit_code != 0 && !state_existed && !d->st.committed && access(state_dir, F_OK) == 0) {
        store_remove_tree(state_dir);   /* this start made it and committed nothing: leave no skeleton */
        dl_log(DL_LOG_INFO, "main", "removed the state directory this failed start created", "dir=%s", state_dir);
    }
    free(state_dir);
    dl_log(DL_LOG_INFO, "main", "stopped", "step=%" PRIu64 " exit_code=%d", d->st.step, d->exit_code);
    int code = d->exit_code;
    for (size_t i = 0; i < d->intake.n; i++)
        intake_req_free(d->intake.queue[i]);
    free(d->intake.queue);
    daemon__pass_release(d);
    daemon__drop_warm(d, d->warm.tmp);
    round_free(&d->rnd);
    st_header_free(d->model);
    daemon__verdicts_close(d);  /* the loop is gone: its last changes written here */
    store_free(&d->st);
    d->front->free_credentials();
    daemon__served_clear(&d->global);
    daemon__downlink_free(d);
    history_free(&d->history);
    free(d->cluster_dir);
    free(d->cluster_unappended.p);
    daemon__async_free(d);
    daemon__robust_free(d);
    daemon__sign_free(d);
    history_record_free(&d->pending_record);
    free(d->pending_round);
    free(d->settle.unappended);
    daemon__settle_free(d->settle.retry);
    daemon__settle_free(d->settle.after_publish);
    daemon__free_rels(d->round_rels, d->nround_rels);
    free(d);
    return code;
}
