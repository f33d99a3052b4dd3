/* s3_cluster_history.c: the cluster's part of the history (README, "Scaling out": /rounds on any member)
 * and of the pipeline.  The thread makes a round record of each step whose outputs it checked, keeps it
 * until the step is seen published, then hands it to the loop (record_async), which gives it to
 * cluster_config.record; and it tells the loop each phase a step enters (cl_phase), which the daemon makes
 * the step's pipeline moves. */
#include "s3_cluster_internal.h"

#include <inttypes.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "delta.h"
#include "dl_log.h"
#include "history.h"

/* The record of step as this aggregator saw it complete (README, "Scaling out": /rounds on any member):
 * the manifest's nodes in its order, their bytes, what they reported (the header's metadata) and their
 * whole norms (the done markers' per-shard sums of squares).  NULL when out of memory. */
static char *step_record_json(const cluster *c, uint64_t step, const double *sumsq)
{
    round_record r;
    struct timespec now;
    sbuf b = {0};
    double norms = 0;

    memset(&r, 0, sizeof(r));
    if ((r.nodes = calloc(c->nm ? c->nm : 1, sizeof(*r.nodes))) == NULL)
        return NULL;
    clock_gettime(CLOCK_REALTIME, &now);
    r.step = step - 1;
    snprintf(r.reason, sizeof(r.reason), "cluster");
    snprintf(r.aggregate, sizeof(r.aggregate), "%s", c->cfg.rule_name != NULL ? c->cfg.rule_name : "");
    r.closed_at = now.tv_sec;
    r.closed_wall = (double)now.tv_sec + (double)now.tv_nsec / 1e9;
    r.seconds = r.gbps = NAN;           /* the pass ran in shards, on several aggregators */
    for (size_t k = 0; k < c->nm; k++) {
        const node_delta *m = &c->m[k];
        node_stat *n = &r.nodes[r.n++];
        delta_info info;
        dl_error err;
        snprintf(n->node_id, sizeof(n->node_id), "%s", m->node);
        n->local_step = m->local_step;
        n->bytes = m->s.size;
        n->norm = sqrt(sumsq[k]);
        n->cosine = n->intake_norm = NAN;
        n->scale = 1;
        memset(&info, 0, sizeof(info));
        if (m->s.h != NULL && delta_check_meta(m->s.h->meta, m->s.h->nmeta, NULL, &info, &err) == 0) {
            n->metrics = info.metrics;
            n->cz = info.cz;
        }
        r.bytes += n->bytes;
        norms += n->norm;
    }
    r.mean_norm = r.n ? norms / (double)r.n : NAN;
    history_record_json(&b, &r);
    free(r.nodes);
    return sb_take(&b);
}

void cl_phase(cluster *c, uint64_t step, cluster_phase phase)
{
    if (c->cfg.phase == NULL || (c->last_phase_step == (int64_t)step && c->last_phase == phase))
        return;
    c->last_phase_step = (int64_t)step;
    c->last_phase = phase;
    pthread_mutex_lock(&c->mu);
    /* a loop that does not take them is stopping: what it would not read anyway is not kept */
    if (c->nphases < CL_PHASES_MAX)
        c->phases[c->nphases++] = (struct cl_phase_event){step, phase};
    pthread_mutex_unlock(&c->mu);
    uv_async_send(&c->record_async);
}

/* The loop's side: the phases in order to cfg.phase, then each record the thread made to cfg.record. */
void cl_records_cb(uv_async_t *a)
{
    cluster *c = a->data;
    struct cl_phase_event phases[CL_PHASES_MAX];
    size_t nphases;
    char **recs;
    size_t n;

    pthread_mutex_lock(&c->mu);
    recs = c->records;
    n = c->nrecords;
    c->records = NULL;
    c->nrecords = 0;
    nphases = c->nphases;
    memcpy(phases, c->phases, nphases * sizeof(phases[0]));
    c->nphases = 0;
    pthread_mutex_unlock(&c->mu);
    for (size_t i = 0; i < nphases; i++)
        c->cfg.phase(c->cfg.record_arg, phases[i].step, phases[i].phase);
    for (size_t i = 0; i < n; i++) {
        if (c->cfg.record != NULL)
            c->cfg.record(c->cfg.record_arg, recs[i]);
        free(recs[i]);
    }
    free(recs);
}

/* Step is published (by us or another): its pending record, if it is that step's, goes to the loop.  A loop
 * that does not take them (stopping) holds at most 256: the oldest go. */
void cl_record_hand_over(cluster *c, uint64_t step)
{
    if (c->pending_record == NULL || c->pending_step != step || c->cfg.record == NULL)
        return;
    pthread_mutex_lock(&c->mu);
    if (c->nrecords >= 256) {
        free(c->records[0]);
        memmove(c->records, c->records + 1, (c->nrecords - 1) * sizeof(*c->records));
        c->nrecords--;
    }
    char **grown = realloc(c->records, (c->nrecords + 1) * sizeof(*grown));
    if (grown != NULL) {
        c->records = grown;
        c->records[c->nrecords++] = c->pending_record;
        c->pending_record = NULL;
    }
    pthread_mutex_unlock(&c->mu);
    if (c->pending_record != NULL) {    /* out of memory: this step's record is lost, and said */
        dl_log(DL_LOG_WARN, "cluster", "a step's history record was lost: out of memory", "step=%" PRIu64, step);
        free(c->pending_record);
        c->pending_record = NULL;
    }
    uv_async_send(&c->record_async);
}

/* Another aggregator published step before this one reached its publish: the record of the manifest this
 * one worked on, with the norms from the bucket's done markers (none when they are not this generation's:
 * the step is then another's record, which this aggregator did not see whole). */
void cl_record_seen(cluster *c, uint64_t step)
{
    double *sumsq;
    uint32_t overflowed = 0;
    char why[1024] = "overflowed";

    if ((c->pending_record != NULL && c->pending_step == step) || c->cfg.record == NULL ||
        (sumsq = calloc(c->nm ? c->nm : 1, sizeof(*sumsq))) == NULL)
        return;
    if (cl_check_outputs(c, step, sumsq, &overflowed, why, sizeof(why)) == 0 && overflowed == 0) {
        free(c->pending_record);
        c->pending_record = step_record_json(c, step, sumsq);
        c->pending_step = step;
    } else {
        dl_log(DL_LOG_DEBUG, "cluster", "a step published by another is not in this history", "step=%" PRIu64
               " why=%s", step, why);
    }
    free(sumsq);
}

void cl_record_pending(cluster *c, uint64_t step, const double *sumsq)
{
    free(c->pending_record);
    c->pending_record = step_record_json(c, step, sumsq);
    c->pending_step = step;
}
