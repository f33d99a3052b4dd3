/* The commit of a round and what follows it.  The commit point is the round's redo record made
 * durable (commit_work, a few ms); the step is then served, published, and settled in the background
 * (its files fsynced, outer_metadata.json naming it, its round record in rounds.jsonl, the redo record
 * gone), and only then are the files before it cleaned up.  Commits are serial: one waits for the
 * previous step's settle and for its round's deltas to be durable (daemon__try_commit).  At startup a
 * redo record left by a crash is recomputed from its inputs, bit for bit (daemon__recover_redo). */
#include "daemon_internal.h"
#include "daemon_parts.h"

#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "dl_log.h"
#include "fsutil.h"
#include "history.h"
#include "manifest.h"
#include "hub.h"
#include "outer.h"
#include "pipeline.h"
#include "round.h"
#include "store.h"
#include "util.h"

/* What the closing round commits: the same on the pool (which writes it) and on the loop (which
 * records it in d->st once it is durable).  after: where the update's phase after it goes (async). */
static store_commit_info round_commit_info(const dilocod *d, store_dn *after)
{
    *after = daemon__async_after(&d->agg.dn);
    store_commit_info info = {
        .step = d->rnd.step + 1,
        .global_path = d->agg.pass->out_global_path,
        .momentum_path = d->agg.pass->out_momentum_path,
        .optimizer = config_optimizer_name(d->cfg->optimizer),
        .lr = d->cfg->lr,
        .momentum = d->cfg->momentum,
        .bootstrap = 0,
        .origin = "round",
        .round_json = d->pending_round,
        .global_sum = &d->agg.pass->out_global_sum,
        .momentum_sum = d->agg.pass->out_momentum_path != NULL ? &d->agg.pass->out_momentum_sum : NULL,
        .accum_path = d->agg.pass->out_accum_path,
        .accum_sum = d->agg.pass->out_accum_path != NULL ? &d->agg.pass->out_accum_sum : NULL,
        .dn = daemon__async(d) ? after : NULL,
        .view = daemon__downlink_made(d, d->rnd.step + 1),
    };
    return info;
}

#define MAX_RECORD_OUTPUTS 8

/* The commit point of a round: its redo record (the step, its inputs, the optimizer and the round's
 * record) made durable.  The outputs are already written but not durable; they are served and
 * published from now on, and made durable in the background (settle_work).  A crash before that
 * finds the redo record at the restart, which recomputes the step from its inputs, bit for bit. */
typedef struct commit_args {
    store_redo redo;            /* owned: copied from the loop's round when the commit is queued */
    char *global_path;          /* the pass's new global, opened for downloads */
    char *momentum_path, *accum_path;   /* --signing-key: the other outputs the record names (or NULL) */
    char *view_path, *update_path;      /* --signing-key with --downlink: the step's view and update (or NULL) */
    int download_fd;            /* result: its descriptor for downloads, or a negative errno */
    char manifest_hash[65];     /* result: the step's record's block hash (redo.manifest set) */
    char out_hex[3][65];        /* result: its global's, momentum's, accumulator's block hashes ("": none) */
} commit_args;

static void commit_args_free(commit_args *a)
{
    if (a != NULL) {
        store_redo_free(&a->redo);
        free(a->global_path);
        free(a->momentum_path);
        free(a->accum_path);
        free(a->view_path);
        free(a->update_path);
        free(a);
    }
}

/* The files a step's record names besides its global (NULL: none). */
typedef struct record_files {
    const char *momentum, *accum;
    const char *view, *update;  /* --downlink: the step's view and update (README, "The downlink") */
} record_files;

/* The outputs a step's record names, in its order: the published global, the momentum, the async
 * accumulator, the downlink's view (no fixed tree path: served as /global/view.safetensors, a tree
 * holds a checkpoint every keep/2 steps) and update (update_tree: its tree path's buffer).  Returns how
 * many. */
static size_t record_outputs(manifest_output out[MAX_RECORD_OUTPUTS], uint64_t step, const char *global,
                             const record_files *f, char update_tree[64])
{
    size_t n = 0;

    out[n++] = (manifest_output){"global", "global/latest.safetensors", global};
    if (f->momentum != NULL)
        out[n++] = (manifest_output){"momentum", NULL, f->momentum};
    if (f->accum != NULL)
        out[n++] = (manifest_output){"accumulator", NULL, f->accum};
    if (f->view != NULL)
        out[n++] = (manifest_output){"view", NULL, f->view};
    if (f->update != NULL) {
        snprintf(update_tree, 64, "global/updates/%" PRIu64 ".safetensors", step);
        out[n++] = (manifest_output){"update", update_tree, f->update};
    }
    return n;
}

/* The redo record's inputs, copied on the loop: the job reads nothing the loop owns (d->st.dir
 * excepted, which never changes).  NULL when out of memory. */
static commit_args *commit_args_new(dilocod *d)
{
    commit_args *a = calloc(1, sizeof(*a));
    size_t n = d->agg.n;

    if (a == NULL)
        return NULL;
    a->redo.step = d->rnd.step + 1;
    a->redo.base = d->rnd.step;
    a->redo.lr = d->cfg->lr;
    a->redo.momentum = d->cfg->momentum;
    a->redo.dn = d->agg.dn;
    a->redo.rule = (int)d->cfg->aggregate;
    a->redo.trim_k = d->cfg->trim_k;
    /* a restart makes the view and update again as they were served */
    const store_view *view = daemon__downlink_made(d, a->redo.step);
    a->redo.downlink = view != NULL ? view->enc : 0;
    if (d->agg.pass->delta_scale != NULL && (a->redo.scales = malloc((n ? n : 1) * sizeof(float))) != NULL)
        memcpy(a->redo.scales, d->agg.pass->delta_scale, n * sizeof(float));
    int no_scales = d->agg.pass->delta_scale != NULL && a->redo.scales == NULL;
    a->redo.ndeltas = n;
    a->redo.deltas = calloc(n ? n : 1, sizeof(char *));
    a->redo.guarded = calloc(n ? n : 1, 1);
    a->redo.versions = calloc(n ? n : 1, sizeof(fsu_ident));
    a->redo.optimizer = strdup(config_optimizer_name(d->cfg->optimizer));
    a->global_path = strdup(d->agg.pass->out_global_path);
    int bad = no_scales || a->redo.deltas == NULL || a->redo.guarded == NULL || a->redo.versions == NULL ||
              a->redo.optimizer == NULL || a->global_path == NULL ||
              (d->pending_round != NULL && (a->redo.round_json = strdup(d->pending_round)) == NULL);
    for (size_t i = 0; !bad && i < n; i++) {
        bad = (a->redo.deltas[i] = strdup(d->agg.paths[i])) == NULL;
        if (i < d->rnd.n) {     /* the versions of linked deltas, as the pass aggregated them */
            a->redo.guarded[i] = (unsigned char)d->rnd.entries[d->agg.entry[i]].guarded;
            a->redo.versions[i] = d->rnd.entries[d->agg.entry[i]].ident;
        }
    }
    /* --signing-key: the step's record without its outputs, and the outputs it names */
    if (!bad && d->sign.on)
        bad = (a->redo.manifest = daemon__sign_skeleton(d)) == NULL ||
              (d->agg.pass->out_momentum_path != NULL && (a->momentum_path = strdup(d->agg.pass->out_momentum_path)) == NULL) ||
              (d->agg.pass->out_accum_path != NULL && (a->accum_path = strdup(d->agg.pass->out_accum_path)) == NULL) ||
              (view != NULL && ((a->view_path = store_view_path(&d->st, a->redo.step)) == NULL ||
                                (a->update_path = store_update_path(&d->st, a->redo.step)) == NULL));
    if (bad) {
        commit_args_free(a);
        return NULL;
    }
    return a;
}

/* The commit point of a round: its redo record (the step, its inputs, the optimizer and the round's
 * record) made durable.  The outputs are already written but not durable; they are served and
 * published from now on, and made durable in the background (settle_work).  A crash before that
 * finds the redo record at the restart, which recomputes the step from its inputs, bit for bit. */
static void commit_work(job *j)
{
    commit_args *a = j->arg;
    const dilocod *d = daemon__of_job(j);

    /* --signing-key: the step's record first, so that no committed step lacks it (one written for a step
     * that then fails to commit is never served: its step is not, and the next commit replaces it) */
    if (a->redo.manifest != NULL) {
        manifest_output out[MAX_RECORD_OUTPUTS];
        char hex[MAX_RECORD_OUTPUTS][65], update_tree[64];
        record_files f = {a->momentum_path, a->accum_path, a->view_path, a->update_path};
        size_t n = record_outputs(out, a->redo.step, a->global_path, &f, update_tree);
        if ((j->rc = manifest_write_hashes(d->st.dir, a->redo.step, a->redo.manifest, out, n, &d->sign.key,
                                           a->manifest_hash, hex, &j->err)) != 0)
            return;
        static const char *const base_names[3] = {"global", "momentum", "accumulator"};
        for (size_t i = 0; i < n; i++)      /* by name: the next record's base */
            for (int k = 0; k < 3; k++)
                if (strcmp(out[i].name, base_names[k]) == 0)
                    memcpy(a->out_hex[k], hex[i], sizeof(hex[i]));
    }
    j->rc = store_redo_write(&d->st, &a->redo, &j->err);
    /* opened here, off the loop: downloads of the new global start from this descriptor */
    a->download_fd = j->rc == 0 ? daemon__open_for_download(a->global_path) : -EINVAL;
}

/* ---- settling: the committed step's outputs made durable, then outer_metadata.json --------------- */

typedef struct settle_args {
    uint64_t step;
    uint64_t global_sum, momentum_sum, accum_sum;       /* the outputs' checksums, as the pass computed them */
    char *global_path, *momentum_path, *accum_path, *round_json;
    store_dn dn;                /* async: the phase after the step (dn.on 0: sync) */
    char **consumed;            /* async: the round's cached deltas, removed before the redo record goes */
    size_t nconsumed;
    int history_failed;
    char *unappended;           /* earlier records not yet in rounds.jsonl: carried in from the loop, and
                                   what is still not appended carried back (settle_done) */
    char **rels;                /* the transport's files of the round's deltas (--prune-consumed) */
    size_t nrels;
    int signed_step;            /* --signing-key: the step's record is made durable with it */
    unsigned keep;              /* --verify-keep: steps whose files are kept for verifiers (0: none) */
    char **kept, **kept_nodes;  /* the round's deltas (cache paths) and their nodes, kept with the step */
    size_t nkept;
    int keep_failed;            /* result: the step's files could not be kept (keep_err says why) */
    dl_error keep_err;
    store_view view;            /* the downlink's view of the step (has_view), made durable with the global */
    int has_view;
    char *view_path, *update_path;
} settle_args;

void daemon__settle_free(settle_args *a)
{
    if (a != NULL) {
        daemon__free_rels(a->rels, a->nrels);
        daemon__free_rels(a->consumed, a->nconsumed);
        daemon__free_rels(a->kept, a->nkept);
        daemon__free_rels(a->kept_nodes, a->nkept);
        free(a->global_path);
        free(a->momentum_path);
        free(a->accum_path);
        free(a->view_path);
        free(a->update_path);
        free(a->round_json);
        free(a->unappended);
        free(a);
    }
}

static void settle_work(job *j)
{
    dilocod *d = daemon__of_job(j);
    settle_args *a = j->arg;
    store_commit_info info = {
        .step = a->step,
        .global_path = a->global_path,
        .momentum_path = a->momentum_path,
        .optimizer = config_optimizer_name(d->cfg->optimizer),
        .lr = d->cfg->lr,
        .momentum = d->cfg->momentum,
        .origin = "round",
        .round_json = a->round_json,
        .global_sum = &a->global_sum,
        .momentum_sum = a->momentum_path != NULL ? &a->momentum_sum : NULL,
        .accum_path = a->accum_path,
        .accum_sum = a->accum_path != NULL ? &a->accum_sum : NULL,
        .dn = a->dn.on ? &a->dn : NULL,
        .view = a->has_view ? &a->view : NULL,
    };
    dl_error herr;

    /* 1. the outputs durable (their directories too: the renames must survive) */
    if ((j->rc = fsu_fsync_path(a->global_path, &j->err)) != 0 ||
        (j->rc = fsu_fsync_parent(a->global_path, &j->err)) != 0)
        return;
    if (a->momentum_path != NULL && ((j->rc = fsu_fsync_path(a->momentum_path, &j->err)) != 0 ||
                                     (j->rc = fsu_fsync_parent(a->momentum_path, &j->err)) != 0))
        return;
    if (a->accum_path != NULL && ((j->rc = fsu_fsync_path(a->accum_path, &j->err)) != 0 ||
                                  (j->rc = fsu_fsync_parent(a->accum_path, &j->err)) != 0))
        return;
    if (a->has_view && ((j->rc = fsu_fsync_path(a->view_path, &j->err)) != 0 ||
                        (j->rc = fsu_fsync_path(a->update_path, &j->err)) != 0 ||
                        (j->rc = fsu_fsync_parent(a->view_path, &j->err)) != 0))
        return;
    if (a->signed_step && (j->rc = manifest_sync(d->st.dir, a->step, &j->err)) != 0)
        return;
    /* 2. outer_metadata.json names the step: from here the redo record is not needed */
    if ((j->rc = store_commit_write(&d->st, &info, &j->err)) != 0)
        return;
    /* --verify-keep: the durable step's files linked for verifiers (a failure costs verifiers this step only) */
    if (a->keep > 0 && manifest_keep(d->st.dir, a->step, a->keep, a->global_path, a->momentum_path, a->accum_path,
                                     a->kept, a->kept_nodes, a->nkept, &a->keep_err) != 0)
        a->keep_failed = 1;
    /* 3. the history, in commit order: a record whose append failed last time goes first.  A kill
     * before the append is replayed at startup from outer_metadata.json (history_load). */
    if (a->unappended != NULL && history_append(d->st.dir, a->unappended, &herr) == 0) {
        free(a->unappended);
        a->unappended = NULL;
    }
    if (a->round_json != NULL) {
        if (a->unappended == NULL && history_append(d->st.dir, a->round_json, &herr) != 0) {
            a->unappended = a->round_json;      /* kept for the next settle (nothing reads round_json after) */
            a->round_json = NULL;
            a->history_failed = 1;
        } else if (a->unappended != NULL) {
            char *both = NULL;
            if (asprintf(&both, "%s%s", a->unappended, a->round_json) >= 0) {
                free(a->unappended);
                a->unappended = both;
            }
            a->history_failed = 1;
        }
    }
    /* 4. async: the round's deltas are consumed (the redo record says so until they are gone) */
    if (a->nconsumed > 0 && (j->rc = store_remove_consumed(a->consumed, a->nconsumed, &j->err)) != 0)
        return;
    /* 5. the redo record goes (a kill before: the restart finds it older than the committed step) */
    j->rc = store_redo_remove(&d->st, &j->err);
}

static void queue_commit(dilocod *d);
static void queue_settle(dilocod *d, settle_args *a);

static void settle_retry_cb(uv_timer_t *t)
{
    dilocod *d = container_of(t, dilocod, settle_timer);
    settle_args *a = d->settle.retry;

    d->settle.retry = NULL;
    if (a != NULL)
        queue_settle(d, a);
}

static void settle_done(job *j)
{
    dilocod *d = daemon__of_job(j);
    settle_args *a = j->arg;

    if (a->history_failed)
        dl_log(DL_LOG_ERROR, "store", "could not append the round to rounds.jsonl; retried at the next commit",
               "step=%" PRIu64, a->step);
    if (a->keep_failed)
        daemon__log_error("sign", "cannot keep the step's files for verifiers (--verify-keep)", &a->keep_err);
    if (j->rc != 0) {
        /* the step stays committed by its redo record; its durability is retried (the next commit waits) */
        daemon__log_error("store", "cannot make the committed step durable, will retry", &j->err);
        if (!d->stopping) {
            d->settle.retry = a;
            uv_timer_start(&d->settle_timer, settle_retry_cb, (uint64_t)(d->cfg->retry_interval * 1000), 0);
            return;
        }
        daemon__settle_free(a);
        return;
    }
    d->settle.unappended = a->unappended;      /* the records still to append go with the next settle */
    a->unappended = NULL;
    pipeline_durable(&d->pipe, a->step);
    dl_log(DL_LOG_DEBUG, "store", "durable", "step=%" PRIu64, a->step);
    for (size_t i = 0; i < a->nrels && !d->stopping; i++)
        daemon__prune_now(d, a->rels[i]);       /* the step they went into is durable: no restart needs them */
    daemon__settle_free(a);
    if (d->stopping)
        return;
    daemon__try_commit(d);
    daemon__schedule_cleanup(d);
}

static void queue_settle(dilocod *d, settle_args *a)
{
    if (a->unappended == NULL) {        /* a retried settle carries them already */
        a->unappended = d->settle.unappended;
        d->settle.unappended = NULL;
    }
    if (daemon__queue(d, settle_work, settle_done, a) != 0) {
        /* no memory for a job: try again in a moment (the redo record keeps the step safe meanwhile) */
        d->settle.retry = a;
        uv_timer_start(&d->settle_timer, settle_retry_cb, (uint64_t)(d->cfg->retry_interval * 1000), 0);
    }
}

/* Test hook (server/README.md, "Test hooks"): DILOCOD_TEST_SETTLE_AFTER_PUBLISH=1 orders the settle
 * after the publish on every transport, as on file://, so that a test can crash a step of s3:// in
 * published: there a small step's settle ends before its publish.  Read once. */
static int settle_after_publish_forced(void)
{
    static int forced = -1;

    if (forced < 0) {
        const char *v = getenv("DILOCOD_TEST_SETTLE_AFTER_PUBLISH");
        forced = v != NULL && strcmp(v, "1") == 0;
        if (forced)
            dl_log(DL_LOG_WARN, "store", "test hook: every settle follows its publish", "%s", "");
    }
    return forced;
}

/* The redo record is durable: a restart settles the step; stop rather than run unsettled. */
static void settle_out_of_memory(dilocod *d, uint64_t step)
{
    dl_error e;
    dl_fail(&e, DL_E_NO_MEMORY, NULL, 0, "out of memory settling the commit of step %" PRIu64
            "; restarting is safe (its redo record is durable)", step);
    daemon__fatal(d, "store", "cannot go on", &e);
}

/* After the commit point: the outputs of step become durable in the background. */
static void start_settle(dilocod *d, uint64_t step)
{
    settle_args *a = calloc(1, sizeof(*a));

    if (a == NULL || (a->global_path = strdup(d->agg.pass->out_global_path)) == NULL ||
        (d->agg.pass->out_momentum_path != NULL && (a->momentum_path = strdup(d->agg.pass->out_momentum_path)) == NULL) ||
        (d->pending_round != NULL && (a->round_json = strdup(d->pending_round)) == NULL)) {
        daemon__settle_free(a);
        settle_out_of_memory(d, step);
        return;
    }
    a->step = step;
    a->signed_step = d->sign.on;
    a->keep = (unsigned)d->cfg->verify_keep;
    if (a->keep > 0) {
        if ((a->kept = calloc(d->agg.n ? d->agg.n : 1, sizeof(char *))) == NULL ||
            (a->kept_nodes = calloc(d->agg.n ? d->agg.n : 1, sizeof(char *))) == NULL) {
            daemon__settle_free(a);
            settle_out_of_memory(d, step);
            return;
        }
        for (; a->nkept < d->agg.n; a->nkept++)
            if ((a->kept[a->nkept] = strdup(d->agg.paths[a->nkept])) == NULL ||
                (a->kept_nodes[a->nkept] = strdup(d->agg.nodes[a->nkept].node_id)) == NULL)
                break;
        if (a->nkept < d->agg.n) {
            a->nkept++;         /* the one half made is freed too */
            daemon__settle_free(a);
            settle_out_of_memory(d, step);
            return;
        }
    }
    const store_view *view = daemon__downlink_made(d, step);
    if (view != NULL) {
        a->has_view = 1;
        a->view = *view;
        if ((a->view_path = store_view_path(&d->st, step)) == NULL ||
            (a->update_path = store_update_path(&d->st, step)) == NULL) {
            daemon__settle_free(a);
            settle_out_of_memory(d, step);
            return;
        }
    }
    a->global_sum = d->agg.pass->out_global_sum;
    a->momentum_sum = d->agg.pass->out_momentum_sum;
    a->accum_sum = d->agg.pass->out_accum_sum;
    if (daemon__async(d)) {
        a->dn = daemon__async_after(&d->agg.dn);
        if ((d->agg.pass->out_accum_path != NULL && (a->accum_path = strdup(d->agg.pass->out_accum_path)) == NULL) ||
            (a->consumed = calloc(d->agg.n ? d->agg.n : 1, sizeof(char *))) == NULL) {
            daemon__settle_free(a);
            settle_out_of_memory(d, step);
            return;
        }
        for (; a->nconsumed < d->agg.n; a->nconsumed++)
            if ((a->consumed[a->nconsumed] = strdup(d->agg.paths[a->nconsumed])) == NULL)
                break;
        if (a->nconsumed < d->agg.n) {  /* one left behind would be taken again after a restart */
            daemon__settle_free(a);
            settle_out_of_memory(d, step);
            return;
        }
    }
    a->rels = d->round_rels;
    a->nrels = d->nround_rels;
    d->round_rels = NULL;
    d->nround_rels = 0;
    if (d->hub != NULL && (hub_publish_writes_locally(d->hub) || settle_after_publish_forced()) && !d->stopping) {
        /* file://: the publish's small durable writes (step_count.json, the directory) queue at the disk
         * behind the settle's (twice the model size): 0.07-0.2 s after a 256 MiB step when they ran
         * side by side.  The settle follows the publish (daemon__release_settle); the redo record keeps the step
         * safe meanwhile, and the next commit waits for it as for any settle. */
        d->settle.after_publish = a;
        return;
    }
    queue_settle(d, a);
}

/* Starts the settle that waited for the publish (the publish ended, none started, or shutdown). */
void daemon__release_settle(dilocod *d)
{
    settle_args *a = d->settle.after_publish;

    if (a == NULL)
        return;
    d->settle.after_publish = NULL;
    queue_settle(d, a);
}

/* ---- the round's record, cleanup, and the commit on the loop ------------------------------------- */

/* The closing round's record, built before its commit (the commit makes it durable with the step):
 * per-node norms and cosines against the mean delta, and the aggregation's time so far.  One JSON
 * line, ready for outer_metadata.json and rounds.jsonl. */
/* A delta the norm screen refused at its offer (422 outlier, never in the round) of this round's step,
 * from the robust ring; NULL when e is not one (a quarantine of the round's own entries). */
static const robust_event *offer_outlier(const dilocod *d, size_t i)
{
    const daemon_robust *rb = &d->robust;
    const robust_event *e = &rb->recent[(rb->head + i) % ROBUST_RECENT];

    /* the norm screen's reasons; a cosine or overflow verdict is always about one of the round's entries */
    if (e->step != d->rnd.step || (strcmp(e->reason, "norm_ratio") != 0 && strcmp(e->reason, "max_norm") != 0))
        return NULL;
    for (size_t k = 0; k < d->rnd.n; k++)
        if (strcmp(d->rnd.entries[k].node_id, e->node_id) == 0 && d->rnd.entries[k].local_step == e->local_step)
            return NULL;
    return e;
}

/* The deltas refused at their offer for this round into its record ("refused": not its quarantines),
 * so the history (the dashboard after a restart) still shows the worker. */
static int record_refused(const dilocod *d, round_record *r)
{
    size_t n = 0;

    for (size_t i = 0; i < d->robust.nrecent; i++)
        n += offer_outlier(d, i) != NULL;
    if (n == 0)
        return 0;
    if ((r->refused = calloc(n, sizeof(*r->refused))) == NULL)
        return -1;
    for (size_t i = 0; i < d->robust.nrecent; i++) {
        const robust_event *ev = offer_outlier(d, i);
        if (ev == NULL)
            continue;
        node_stat *q = &r->refused[r->nrefused++];
        memcpy(q->node_id, ev->node_id, sizeof(q->node_id));
        q->local_step = ev->local_step;
        snprintf(q->quarantine_reason, sizeof(q->quarantine_reason), "%s", ev->reason);
        q->norm = ev->norm;
        q->bound = ev->bound;
        q->received_at = ev->at;
    }
    return 0;
}

/* The round's quarantined entries (at its close, or by the cosine screen) into its record. */
static int record_quarantined(const dilocod *d, round_record *r)
{
    size_t nq = 0;

    for (size_t i = 0; i < d->rnd.n; i++)
        nq += d->rnd.entries[i].quarantined != 0;
    if (nq == 0)
        return 0;
    if ((r->quarantined = calloc(nq, sizeof(*r->quarantined))) == NULL)
        return -1;
    for (size_t i = 0; i < d->rnd.n; i++) {
        const round_entry *e = &d->rnd.entries[i];
        if (!e->quarantined)
            continue;
        node_stat *q = &r->quarantined[r->nquarantined++];
        memcpy(q->node_id, e->node_id, sizeof(q->node_id));
        q->local_step = e->local_step;
        snprintf(q->quarantine_reason, sizeof(q->quarantine_reason), "%s", e->quarantine_reason);
        const robust_event *ev = strcmp(e->quarantine_reason, "cosine") == 0 ? daemon__robust_last(d, e->node_id) : NULL;
        q->norm = ev != NULL ? ev->norm : e->norm;
        q->bound = e->quarantine_bound;
        q->received_at = daemon__wall_of(e->received_at);
        q->metrics = e->metrics;
    }
    return 0;
}

int daemon__prepare_round_record(dilocod *d, double seconds)
{
    outer_pass *p = d->agg.pass;
    round_record *r = &d->pending_record;
    double mean_norm = sqrt(p->mean_sumsq);
    sbuf b = {0};

    for (size_t k = 0; k < p->ndeltas; k++) {
        double norm = sqrt(p->stats[k].sumsq);
        d->agg.nodes[k].norm = norm;
        d->agg.nodes[k].cosine = norm > 0 && mean_norm > 0 ? p->stats[k].dot / (norm * mean_norm) : 0.0;
    }
    history_record_free(r);
    memset(r, 0, sizeof(*r));
    r->step = d->rnd.step;
    snprintf(r->reason, sizeof(r->reason), "%s", d->agg.reason);
    r->seconds = seconds;
    r->bytes = p->bytes_total;
    r->gbps = seconds > 0 ? (double)p->bytes_total / seconds / 1e9 : 0;
    r->mean_norm = mean_norm;
    r->closed_at = time(NULL);
    r->opened_at = d->round_opened_wall;
    r->closed_wall = daemon__wall_of(daemon__clock());
    if (d->agg.n > 0 && (r->nodes = malloc(d->agg.n * sizeof(*r->nodes))) == NULL)
        return -ENOMEM;
    if (d->agg.n > 0)
        memcpy(r->nodes, d->agg.nodes, d->agg.n * sizeof(*r->nodes));
    r->n = d->agg.n;
    if (d->cfg->aggregate == RULE_TRIMMED)
        snprintf(r->aggregate, sizeof(r->aggregate), "trimmed_mean:%u", d->cfg->trim_k);
    else
        snprintf(r->aggregate, sizeof(r->aggregate), "%s", config_rule_name(d->cfg->aggregate));
    if (record_quarantined(d, r) != 0 || record_refused(d, r) != 0)
        return -ENOMEM;
    if (daemon__async(d)) {
        store_dn after = daemon__async_after(&d->agg.dn);
        r->async = 1;
        r->weight = d->agg.dn.weight;
        r->dn_k = after.k;
        r->dn_period = d->agg.dn.period;
        r->dn_tick = d->agg.dn.k + 1 >= d->agg.dn.period;
    }
    history_record_json(&b, r);
    sb_add(&b, "\n", 1);
    free(d->pending_round);
    d->pending_round = sb_take(&b);
    return d->pending_round != NULL ? 0 : -ENOMEM;
}

/* The round is committed: its record joins the in-memory history and the metrics. */
static void record_round(dilocod *d)
{
    double seconds = d->pending_record.seconds;

    workers_committed(&d->workers, &d->pending_record, 0);
    daemon__verdicts_committed(d, &d->pending_record, 0);
    history_push(&d->history, &d->pending_record);
    stats_round_committed(&d->m, seconds);
}

/* Cleanup works on a copy of the store's names: the loop may commit meanwhile. */
static void cleanup_work(job *j)
{
    j->rc = store_cleanup(j->arg, 0, &j->err);
}

static void cleanup_done(job *j)
{
    store *snap = j->arg;
    pipeline *p = &daemon__of_job(j)->pipe;

    pipeline_end(p, snap->step, STEP_ACT_CLEANUP, j->rc == 0);
    if (j->rc != 0)
        daemon__log_error("store", "cleanup failed", &j->err);
    else
        pipeline_cleaned(p, snap->step);
    store_free(snap);
    free(snap);
}

void daemon__schedule_cleanup(dilocod *d)
{
    store *snap;

    /* the inputs of a committed step stay until it is durable (its redo record names them), and the
     * files a publish reads stay until it ends */
    if (!d->st.committed || !pipeline_cleanup_ready(&d->pipe, d->rnd.step + 1))
        return;
    /* cleaned already (by its own cleanup, or by the startup sweep of a step found durable): a second one
     * would find nothing to remove, and would hold an activity on a record that is done */
    if (pipeline_state(&d->pipe, d->st.step) == STEP_CLEANED)
        return;
    if ((snap = calloc(1, sizeof(*snap))) == NULL)
        return;
    snap->committed = 1;
    snap->step = d->st.step;
    snap->async_cache = daemon__async(d);
    snap->view = d->st.view;
    snap->updates_keep = d->cfg->updates_keep;
    if ((snap->dir = strdup(d->st.dir)) == NULL || (snap->global_path = strdup(d->st.global_path)) == NULL ||
        (d->st.momentum_path != NULL && (snap->momentum_path = strdup(d->st.momentum_path)) == NULL) ||
        pipeline_start(&d->pipe, snap->step, STEP_ACT_CLEANUP) != 0) {
        store_free(snap);
        free(snap);
        return;
    }
    if (daemon__queue(d, cleanup_work, cleanup_done, snap) != 0) {
        pipeline_end(&d->pipe, snap->step, STEP_ACT_CLEANUP, 0);
        store_free(snap);
        free(snap);
    }
}

static void log_round_stats(dilocod *d)
{
    const round_record *r = &d->pending_record;
    char qn[160];

    dl_log(DL_LOG_INFO, "aggregate", "done",
           "step=%" PRIu64 " nodes=%zu seconds=%.3f gbps=%.2f bytes=%" PRIu64 " mean_norm=%.6g", d->rnd.step + 1,
           r->n, r->seconds, r->gbps, r->bytes, r->mean_norm);
    for (size_t k = 0; k < r->n; k++)
        dl_log(DL_LOG_INFO, "aggregate", "node statistics",
               "step=%" PRIu64 " node=%s local_step=%" PRIu64 " norm=%.6g cosine=%.6f", d->rnd.step + 1,
               dl_log_q(qn, sizeof(qn), r->nodes[k].node_id), r->nodes[k].local_step, r->nodes[k].norm,
               r->nodes[k].cosine);
}

static void commit_done(job *j)
{
    dilocod *d = daemon__of_job(j);
    commit_args *a = j->arg;
    int fd = a->download_fd;

    if (j->rc == 0 && a->redo.manifest != NULL) {
        daemon__sign_recorded(d, a->redo.step, a->manifest_hash, (const char (*)[65])a->out_hex);
        daemon__sign_round_committed(d);
    }
    commit_args_free(a);
    if (j->rc != 0) {
        daemon__aggregation_failed(d, &j->err);
        return;
    }
    uv_timer_stop(&d->progress_timer);
    store_dn after;
    store_commit_info info = round_commit_info(d, &after);
    if (store_commit_apply(&d->st, &info) != 0) {
        /* durable on disk, unknown in memory: a restart reads it back; stop rather than serve a lie */
        dl_error e;
        dl_fail(&e, DL_E_NO_MEMORY, NULL, 0, "out of memory recording the commit of step %" PRIu64
                "; restarting is safe (the step is durable)", info.step);
        daemon__fatal(d, "store", "cannot go on", &e);
        daemon__pass_release(d);
        if (fd >= 0)
            close(fd);
        return;
    }
    pipeline_move(&d->pipe, d->st.step, STEP_COMMITTED);
    log_round_stats(d);
    daemon__async_record_applied(d, &d->pending_record);
    daemon__robust_aggregated(d, d->pending_record.nodes, d->pending_record.n);
    record_round(d);
    daemon__async_committed(d, &d->agg.dn);
    daemon__serve_step(d, fd, d->st.step);
    daemon__downlink_serve(d);
    pipeline_move(&d->pipe, d->st.step, STEP_SERVED);
    daemon__ensure_set(d);
    d->committed_at = time(NULL);
    dl_log(DL_LOG_INFO, "store", "committed", "step=%" PRIu64 " global=%s", d->st.step, d->st.global_path);
    start_settle(d, d->st.step);
    d->down.made = 0;
    daemon__pass_release(d);
    round_reset(&d->rnd, d->st.step);
    d->round_opened_wall = daemon__wall_of(daemon__clock());
    pipeline_begin(&d->pipe, d->st.step + 1, STEP_COLLECTING);
    if (d->hub != NULL)
        hub_set_step(d->hub, d->st.step, 0);      /* the transport looks for the new round's deltas */
    dl_log(DL_LOG_INFO, "round", "opened", "step=%" PRIu64 " expected=%u min_nodes=%u", d->rnd.step,
           d->cfg->expected_nodes, d->cfg->min_nodes);
    if (d->stopping) {
        daemon__release_settle(d);
        return;
    }
    daemon__start_warm(d);
    daemon__maybe_publish(d);
    if (!pipeline_any_busy(&d->pipe, STEP_ACT_PUBLISH))
        daemon__release_settle(d);      /* nothing to wait for */
    daemon__dispatch_intake(d);
    if (d->rnd.n > 0) {                 /* async: the deltas queued during the pass make the next update */
        daemon__arm_round_timer(d);
        daemon__maybe_close_round(d);
    }
}

/* The commit of a finished pass (its step in computing, the pass done) waits for the previous step
 * to be durable (this one's redo record names its files as inputs) and for the round's deltas to be
 * durable (they are the other inputs: fsynced by sync_inputs while the pass ran); a delta rewritten in
 * place meanwhile reopens the round.  Moving to inputs_durable is what makes it start only once. */
void daemon__try_commit(dilocod *d)
{
    uint64_t step = d->rnd.step + 1;

    if (d->stopping || !pipeline_commit_ready(&d->pipe, step))
        return;
    if (pipeline_failed(&d->pipe, step, STEP_ACT_SYNC)) {
        dl_error e;
        dl_fail(&e, DL_E_IO, NULL, 0, "the round's deltas could not be made durable");
        daemon__aggregation_failed(d, &e);
        return;
    }
    if (daemon__reopen_if_rewritten(d, 0))
        return;
    pipeline_move(&d->pipe, d->rnd.step + 1, STEP_INPUTS_DURABLE);
    queue_commit(d);
}

static void queue_commit(dilocod *d)
{
    commit_args *a = commit_args_new(d);

    if (a == NULL || daemon__queue(d, commit_work, commit_done, a) != 0) {
        dl_error e;
        commit_args_free(a);
        dl_fail(&e, DL_E_NO_MEMORY, NULL, 0, "cannot queue the commit");
        daemon__aggregation_failed(d, &e);
    }
}

/* ---- recovery: a committed round whose outputs were not durable ------------------------------------ */

/* At startup, before anything else reads the state: a redo record naming the step after the committed
 * one is recomputed from its inputs (kept until the outputs were durable), made durable and committed;
 * an older one (its step already named by outer_metadata.json) is only removed. */
int daemon__recover_redo(dilocod *d, dl_error *err)
{
    store_redo r;
    int present, rc;
    st_kv meta[2];
    char step_text[24];
    outer_pass p = {0};
    uint64_t *sums = NULL;
    unsigned char *summed = NULL;
    char *view_path = NULL, *update_path = NULL;    /* a signed step's view and update (--downlink) */

    if ((rc = store_redo_read(&d->st, &r, &present, err)) != 0 || !present)
        return rc;
    if (d->st.committed && r.step <= d->st.step) {
        /* its step is durable; async: its deltas are consumed, and go before the record that says so */
        rc = r.dn.on ? store_remove_consumed(r.deltas, r.ndeltas, err) : 0;
        store_redo_free(&r);
        return rc != 0 ? rc : store_redo_remove(&d->st, err);
    }
    if (r.dn.on && d->st.committed && r.dn.k != (d->st.dn.on ? d->st.dn.k : 0)) {
        rc = dl_fail(err, DL_E_METADATA_INVALID, NULL, 0,
                     "redo.json in %s continues Delayed Nesterov phase %u, but the committed step %" PRIu64 " is at %u",
                     d->st.dir, r.dn.k, d->st.step, d->st.dn.on ? d->st.dn.k : 0);
        store_redo_free(&r);
        return rc;
    }
    if (!d->st.committed || r.base != d->st.step) {
        rc = dl_fail(err, DL_E_METADATA_INVALID, NULL, 0,
                     "redo.json in %s makes step %" PRIu64 " from step %" PRIu64 ", but the committed step is %s%"
                     PRIu64, d->st.dir, r.step, r.base, d->st.committed ? "" : "none ", d->st.step);
        store_redo_free(&r);
        return rc;
    }
    for (size_t i = 0; r.guarded != NULL && i < r.ndeltas; i++) {
        if (r.guarded[i] && fsu_ident_check(r.deltas[i], &r.versions[i]) != 1) {
            /* a worker rewrote a linked delta in place after the commit: the step cannot be made again bit
             * for bit.  It is given up (the round is aggregated again from what the tree holds now)
             * rather than recomputed from other bytes than the ones served. */
            dl_log(DL_LOG_ERROR, "store",
                   "a delta of the committed round was rewritten in place before its step was durable: the step "
                   "is aggregated again",
                   "step=%" PRIu64 " delta=%s", r.step, r.deltas[i]);
            store_redo_free(&r);
            return store_redo_remove(&d->st, err);
        }
    }
    if ((rc = store_global_intact(&d->st)) != 1) {
        rc = dl_fail(err, DL_E_IO, NULL, 0, "cannot recompute step %" PRIu64 ": its base, the global of step %" PRIu64
                     " (%s), is a link to --init-model %s; " GLOBAL_CHANGED_HELP, r.step, r.base, d->st.global_path,
                     daemon__global_change(rc));
        store_redo_free(&r);
        return rc;
    }
    dl_log(DL_LOG_WARN, "store", "recovering a committed step whose files were not durable",
           "step=%" PRIu64 " nodes=%zu", r.step, r.ndeltas);
    if ((rc = daemon__setup_pass(d, &p, r.step, r.optimizer, r.lr, r.momentum, &r.dn, meta, step_text,
                                 sizeof(step_text))) != 0) {
        rc = dl_fail(err, DL_E_NO_MEMORY, NULL, 0, "out of memory");
        goto out;
    }
    p.delta_paths = (const char *const *)r.deltas;
    p.ndeltas = r.ndeltas;
    /* the round's rule and scales as the pass used them (the screens' verdicts are in the inputs) */
    p.params.rule = (outer_rule)r.rule;
    p.params.trim_k = r.trim_k;
    p.delta_scale = r.scales;
    /* the linked deltas' bytes must be the ones aggregated before the crash */
    sums = calloc(r.ndeltas ? r.ndeltas : 1, sizeof(*sums));
    summed = calloc(r.ndeltas ? r.ndeltas : 1, 1);
    if (sums == NULL || summed == NULL) {
        rc = dl_fail(err, DL_E_NO_MEMORY, NULL, 0, "out of memory");
        goto out;
    }
    for (size_t i = 0; r.guarded != NULL && i < r.ndeltas; i++) {
        summed[i] = r.guarded[i] && r.versions[i].has_sum;
        sums[i] = r.versions[i].sum;
    }
    p.delta_sums = sums;
    p.delta_summed = summed;
    /* one thread, before the loop runs: the same items, so the same bytes, as the pool made them */
    rc = outer_prepare(&p, err);
    if (rc == 0 && (rc = outer_run(&p)) != 0 && err != NULL)
        *err = p.err;
    if (rc != 0)
        outer_abort(&p);
    int frc = outer_finish(&p, rc == 0 ? err : NULL);
    if (rc == 0)
        rc = frc;
    if (rc != 0 && p.in_sums != NULL && err->code == DL_E_CHECKSUM_MISMATCH &&
        !outer_input_changed(&p, OUTER_INPUT_GLOBAL(&p)) && !outer_input_changed(&p, OUTER_INPUT_MOMENTUM(&p))) {
        /* a linked delta rewritten in place (its mtime put back) before the step was durable: as above */
        daemon__log_error("store", "a delta of the committed round was rewritten in place before its step was durable: "
                  "the step is aggregated again", err);
        rc = store_redo_remove(&d->st, err);
        goto out;
    }
    store_view view;
    if (rc == 0 && r.downlink != 0)
        rc = daemon__downlink_recover(d, r.downlink, r.step, p.out_global_path, &view, err);
    if (rc == 0) {
        store_dn after = daemon__async_after(&r.dn);
        store_commit_info info = {
            .step = r.step,
            .global_path = p.out_global_path,
            .momentum_path = p.out_momentum_path,
            .optimizer = r.optimizer,
            .lr = r.lr,
            .momentum = r.momentum,
            .origin = "round",
            .round_json = r.round_json,
            .global_sum = &p.out_global_sum,
            .momentum_sum = p.out_momentum_path != NULL ? &p.out_momentum_sum : NULL,
            .accum_path = p.out_accum_path,
            .accum_sum = p.out_accum_path != NULL ? &p.out_accum_sum : NULL,
            .dn = r.dn.on ? &after : NULL,
            .view = r.downlink != 0 ? &view : NULL,
        };
        /* --signing-key: the record again, the same bytes (the outputs are), and durable before the commit */
        manifest_output out[MAX_RECORD_OUTPUTS];
        char hash[65], update_tree[64];
        if (r.downlink != 0 && r.manifest != NULL && d->sign.on &&
            ((view_path = store_view_path(&d->st, r.step)) == NULL ||
             (update_path = store_update_path(&d->st, r.step)) == NULL)) {
            rc = dl_fail(err, DL_E_NO_MEMORY, NULL, 0, "out of memory");
            goto out;
        }
        record_files f = {p.out_momentum_path, p.out_accum_path, view_path, update_path};
        size_t nout = record_outputs(out, r.step, p.out_global_path, &f, update_tree);
        if (r.manifest != NULL && !d->sign.on)
            dl_log(DL_LOG_WARN, "sign", "the recovered step was signed, but --signing-key is not given: its record is "
                   "not written again", "step=%" PRIu64, r.step);
        if (r.manifest != NULL && d->sign.on && strstr(r.manifest, d->sign.key.fingerprint) == NULL) {
            /* its record names the key it was committed under: another key would sign a record that says so */
            rc = dl_fail(err, DL_E_INVALID_ARGUMENT, NULL, 0, "step %" PRIu64 " was committed under another signing "
                         "key than %s (fingerprint %s): restart with the key it was signed with, then change keys",
                         r.step, d->cfg->signing_key, d->sign.key.fingerprint);
            goto out;
        }
        if (r.manifest != NULL && d->sign.on &&
            ((rc = manifest_write(d->st.dir, r.step, r.manifest, out, nout, &d->sign.key, hash, err)) != 0 ||
             (rc = manifest_sync(d->st.dir, r.step, err)) != 0))
            goto out;
        /* outer_finish made the outputs durable (no defer_sync here) */
        if ((rc = store_commit(&d->st, &info, err)) == 0 &&
            (rc = r.dn.on ? store_remove_consumed(r.deltas, r.ndeltas, err) : 0) == 0 &&
            (rc = store_redo_remove(&d->st, err)) == 0) {
            dl_log(DL_LOG_WARN, "store", "recovered", "step=%" PRIu64 " global=%s", r.step, d->st.global_path);
            /* it may have been published before its files were durable (file:// links them): the same
             * bytes go out again */
            d->republish = 1;
        }
    }
out:
    outer_free(&p);
    free(sums);
    free(summed);
    free(view_path);
    free(update_path);
    free((void *)p.out_global_path);
    free((void *)p.out_momentum_path);
    free((void *)p.out_accum_path);
    store_redo_free(&r);
    if (rc != 0)
        dl_log(DL_LOG_ERROR, "store", "cannot recompute the committed step from its redo record", "code=%s",
               dl_error_name(err->code));
    return rc;
}
