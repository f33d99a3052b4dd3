/* The daemon's side of a cluster (--cluster-shards; README, "Scaling out"; hub/s3_cluster.h): the bucket is
 * the state and the cluster's shards compute each step, one strategy of the one pipeline: the phases the
 * thread reports move the step's record through the table's cluster column (core/pipeline.h), so /status
 * pipeline[] and the per-state histogram show a cluster's steps as they show local ones.  The s3://
 * transport is opened for its access (endpoint, credentials) and never started; the cluster's thread does
 * the rest; /status and /metrics show its view. */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "daemon_internal.h"
#include "daemon_parts.h"
#include "dl_log.h"
#include "fsutil.h"
#include "history.h"
#include "hub_s3.h"
#include "pipeline.h"
#include "s3_cluster.h"
#include "store.h"

static void cluster_stopped(void *arg)
{
    dilocod *d = arg;
    cluster_free(d->cluster);
    d->cluster = NULL;
    /* the transport's access strings were the cluster's: close it only now */
    if (d->hub != NULL)
        daemon__close_hub(d);
    daemon__maybe_finish_shutdown(d);
}

static void cluster_append_next(dilocod *d);

static void cluster_append_work(job *j)
{
    dilocod *d = daemon__of_job(j);
    j->rc = history_append(d->cluster_dir, j->arg, &j->err);
}

static void cluster_append_done(job *j)
{
    dilocod *d = daemon__of_job(j);
    if (j->rc != 0)
        daemon__log_error("cluster", "cannot append to rounds.jsonl: /rounds keeps the steps until a restart", &j->err);
    free(j->arg);
    d->cluster_appending = 0;
    cluster_append_next(d);
}

/* The records waiting go to rounds.jsonl in one pool job (each record on its own line), one job out at
 * a time: the loop never waits on the disk, and the file keeps the steps' order. */
static void cluster_append_next(dilocod *d)
{
    if (d->cluster_appending || d->cluster_unappended.len == 0 || d->cluster_dir == NULL)
        return;
    char *text = sb_take(&d->cluster_unappended);
    if (text == NULL)
        return;
    if (daemon__queue(d, cluster_append_work, cluster_append_done, text) != 0) {
        dl_log(DL_LOG_ERROR, "cluster", "cannot queue an append to rounds.jsonl: /rounds keeps the steps until a restart",
               "%s", "");
        free(text);
        return;
    }
    d->cluster_appending = 1;
}

/* A step the cluster saw published: into rounds.jsonl and /rounds, as a local round's record (a step
 * already there, from before a restart, is not recorded twice). */
static void cluster_record(void *arg, const char *json)
{
    dilocod *d = arg;
    const round_record *last = history_last(&d->history);
    round_record r;

    if (history_record_parse(&r, json) != 0) {
        dl_log(DL_LOG_ERROR, "cluster", "a step's history record does not parse (a bug): not kept", "%s", "");
        return;
    }
    if (last != NULL && r.step <= last->step) {
        history_record_free(&r);
        return;
    }
    sb_str(&d->cluster_unappended, json);
    sb_str(&d->cluster_unappended, "\n");       /* a record is one line; several go in one append */
    if (d->cluster_unappended.oom) {
        dl_log(DL_LOG_ERROR, "cluster", "out of memory: a step's record is not appended to rounds.jsonl",
               "step=%" PRIu64, r.step);
        free(sb_take(&d->cluster_unappended));
    }
    cluster_append_next(d);
    history_push(&d->history, &r);
    history_record_free(&r);
}

static step_state state_of_phase(cluster_phase phase)
{
    switch (phase) {
    case CLUSTER_PHASE_MANIFEST:
        return STEP_CLUSTER_MANIFEST;
    case CLUSTER_PHASE_SHARDS:
        return STEP_CLUSTER_SHARDS;
    case CLUSTER_PHASE_PUBLISH:
        return STEP_CLUSTER_PUBLISH;
    case CLUSTER_PHASE_PUBLISHED:
        return STEP_PUBLISHED;
    case CLUSTER_PHASE_REFUSED:
        return STEP_FAILED;
    case CLUSTER_PHASE_COLLECTING:
    default:
        return STEP_COLLECTING;
    }
}

/* The steps before step this member has left behind: their records are kept (published -> durable), and
 * it has moved on (durable -> cleaned).  A step it never saw published (its thread stopped, a restart) is
 * left as it was: the table has no move for it, and its record goes when room is needed. */
static void cluster_steps_behind(dilocod *d, uint64_t step)
{
    for (size_t i = 0; i < d->pipe.n; i++) {
        const step_record *r = &d->pipe.rec[i];
        if (r->strategy != STEP_CLUSTER || r->step >= step)
            continue;
        if (r->state == STEP_PUBLISHED)
            pipeline_move(&d->pipe, r->step, STEP_DURABLE);
        if (r->state == STEP_DURABLE)
            pipeline_move(&d->pipe, r->step, STEP_CLEANED);
    }
}

/* A phase a step entered on the cluster's thread (in order): the move it makes in the pipeline.  A step the
 * pipeline does not hold yet enters collecting (every step's first phase). */
static void cluster_phase_cb(void *arg, uint64_t step, cluster_phase phase)
{
    dilocod *d = arg;
    step_state to = state_of_phase(phase);
    const step_record *r = pipeline_find(&d->pipe, step);

    if (r == NULL) {
        cluster_steps_behind(d, step);
        if (pipeline_begin_as(&d->pipe, step, STEP_COLLECTING, STEP_CLUSTER) != 0)
            return;
        r = pipeline_find(&d->pipe, step);
    }
    if (r != NULL && r->state != to)
        pipeline_move(&d->pipe, step, to);      /* the table refuses what it has no row for: a bug */
}

int daemon__cluster_start(dilocod *d, dl_error *err)
{
    const config *cfg = d->cfg;
    s3_access a;
    char *state = store_path_state_dir(cfg->state_root, cfg->id);
    size_t scratch_size = state ? strlen(state) + 32 : 0;
    char *scratch = state ? malloc(scratch_size) : NULL;
    int rc;

    if (scratch == NULL) {
        free(state);
        return dl_fail(err, DL_E_NO_MEMORY, NULL, 0, "out of memory");
    }
    if (d->hub == NULL || hub_s3_access(d->hub, &a) != 0) {
        free(state);
        free(scratch);
        return dl_fail(err, DL_E_INVALID_ARGUMENT, NULL, 0, "--cluster-shards needs an s3:// transport");
    }
    snprintf(scratch, scratch_size, "%s/cache/cluster", state);
    /* the history of the steps this aggregator saw published, kept in its state directory */
    if (fsu_mkdirs(state, err) != 0 || history_compact(state, cfg->history_keep, err) != 0 ||
        history_load(&d->history, state, UINT64_MAX, NULL, err) != 0) {
        free(state);
        free(scratch);
        return -err->code;
    }
    cluster_config cc = {
        .shards = cfg->cluster_shards,
        .lease = cfg->cluster_lease,
        .poll_interval = cfg->poll_interval,
        .expected_nodes = cfg->expected_nodes,
        .allow = cfg->nodes,
        .nallow = cfg->nnodes,
        .min_nodes = cfg->min_nodes,
        .round_timeout = cfg->round_timeout,
        .optimizer = config_optimizer_name(cfg->optimizer),
        .lr = cfg->lr,
        .momentum = cfg->momentum,
        .rule = (outer_rule)cfg->aggregate,
        .trim_k = cfg->trim_k,
        .max_weight_ratio = cfg->max_weight_ratio,
        .threads = cfg->threads,
        .budget_bytes = (size_t)cfg->agg_memory_mib << 20,
        .max_header = (uint64_t)cfg->max_delta_header_mib << 20,
        .scratch_dir = scratch,
        .id = cfg->id,
        .init_model = cfg->init_model,
        .rule_name = config_rule_name(cfg->aggregate),
        .record = cluster_record,
        .record_arg = d,
        .phase = cluster_phase_cb,
    };
    rc = cluster_start(&d->cluster, &d->loop, &cc, &a, cluster_stopped, d, err);
    free(scratch);
    if (rc != 0)
        free(state);
    else
        d->cluster_dir = state;         /* freed with the daemon */
    return rc;
}

/* Shutdown: the thread stops (its requests aborted), then the transport closes (cluster_stopped). */
void daemon__cluster_stop(dilocod *d)
{
    if (d->cluster != NULL)
        cluster_stop(d->cluster);
}

static void cluster_status(const dilocod *d, sbuf *b)
{
    if (d->cluster == NULL)
        return;
    sb_str(b, ",\"cluster\":");
    cluster_status_json(d->cluster, b);
}

static void cluster_metrics_cb(const dilocod *d, sbuf *b)
{
    if (d->cluster != NULL)
        cluster_metrics(d->cluster, b);
}

const daemon_provider daemon__cluster_provider = {"cluster", cluster_status, cluster_metrics_cb};
