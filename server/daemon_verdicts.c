/* Verdicts a worker can read (README, "Verdicts"): every verdict a delta gets, at its arrival and at
 * its round's close, counted (stats.h) and recorded for its node (core/verdicts.h) in the same call, so
 * that /status, /metrics and GET /nodes/<id> agree; the table's file <state>/verdicts.json, replaced
 * atomically on the pool after each change (one write out at a time, the changes made meanwhile
 * written by the next) and read back at startup; its /status and /metrics provider.
 *
 * Counting rules (what makes the numbers agree): a refusal at arrival is counted once, where it is
 * recorded (daemon_verdict_refused, daemon_verdict_rejected); a quarantine at the close is robust's
 * count (daemon_robust.c) and recorded here from the same call; the verdicts of a committed round come
 * from its record, which a restart replays for what the file had not caught up with. */
#include "daemon_internal.h"
#include "daemon_parts.h"

#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "dl_log.h"
#include "fsutil.h"
#include "stats.h"
#include "store.h"
#include "strbuf.h"

static double now_unix(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (double)ts.tv_sec + ts.tv_nsec / 1e9;
}

/* ---- the file ----------------------------------------------------------------------------------- */

typedef struct verdicts_write {
    char *path, *text;
    size_t len;
    uint64_t changes;           /* the table's changes the text holds */
} verdicts_write;

static void write_work(job *j)
{
    verdicts_write *w = j->arg;
    j->rc = fsu_write_atomic(w->path, w->text, w->len, &j->err);
}

static void persist(dilocod *d);

static void write_done(job *j)
{
    dilocod *d = daemon__of_job(j);
    verdicts_write *w = j->arg;

    d->verdicts.writing = 0;
    if (j->rc == 0) {
        d->verdicts.written = w->changes;
    } else if (!j->cancelled) {
        /* the next change tries again; the table in memory is whole meanwhile */
        if (d->verdicts.write_failures++ == 0)
            daemon__log_error("verdicts", "cannot write verdicts.json (retried at the next verdict)", &j->err);
    }
    free(w->path);
    free(w->text);
    free(w);
    if (j->rc == 0)
        persist(d);             /* what changed while it was written */
}

/* The table as its file's text, with the changes it holds. */
static verdicts_write *snapshot(const dilocod *d)
{
    verdicts_write *w = calloc(1, sizeof(*w));
    sbuf b = {0};

    if (w == NULL)
        return NULL;
    verdicts_json(&d->verdicts.table, &b);
    w->len = b.len;
    w->changes = d->verdicts.table.changes;
    if ((w->text = sb_take(&b)) == NULL || (w->path = store_path_verdicts(d->st.dir)) == NULL) {
        free(w->text);
        free(w);
        return NULL;
    }
    return w;
}

/* Writes the table's file unless it holds every change or a write is out (its end comes back here). */
static void persist(dilocod *d)
{
    verdicts_write *w;

    if (!d->verdicts.loaded || d->verdicts.writing || d->verdicts.written == d->verdicts.table.changes ||
        d->st.dir == NULL)
        return;
    if ((w = snapshot(d)) == NULL) {
        d->verdicts.write_failures++;
        return;                 /* out of memory: the next verdict tries again */
    }
    if (daemon__queue(d, write_work, write_done, w) != 0) {
        free(w->path);
        free(w->text);
        free(w);
        return;
    }
    d->verdicts.writing = 1;
}

void daemon__verdicts_load(dilocod *d)
{
    char *path, *text = NULL;
    size_t len = 0;
    dl_error err;
    int rc;

    if (!d->verdicts.loaded) {
        if (verdicts_init(&d->verdicts.table) != 0) {
            dl_log(DL_LOG_ERROR, "verdicts", "out of memory: no verdicts are recorded", "%s", "");
            return;
        }
        d->verdicts.loaded = 1;
    }
    dl_error_clear(&err);
    if ((rc = store_read_verdicts(d->st.dir, VERDICTS_FILE_MAX, &text, &len, &err)) == 1)
        return;                 /* none yet */
    if ((path = store_path_verdicts(d->st.dir)) == NULL) {
        free(text);
        return;
    }
    if (rc == 0)
        rc = verdicts_parse(&d->verdicts.table, text, len, &err);
    if (rc == 0) {
        d->verdicts.written = d->verdicts.table.changes;
        dl_log(DL_LOG_INFO, "verdicts", "loaded", "nodes=%zu", d->verdicts.table.n);
    } else {
        /* ours, but damaged or planted: never believed in part; set aside for whoever wants to look,
         * and replaced by the next verdict */
        char aside[4200];
        snprintf(aside, sizeof(aside), "%s.refused", path);
        (void)rename(path, aside);
        daemon__log_error("verdicts", "verdicts.json refused: the nodes' verdicts start empty (the file is kept as "
                          "verdicts.json.refused)", &err);
    }
    free(text);
    free(path);
}

void daemon__verdicts_close(dilocod *d)
{
    verdicts_write *w;
    dl_error err;

    if (!d->verdicts.loaded)
        return;
    if (d->verdicts.written != d->verdicts.table.changes && d->st.dir != NULL && (w = snapshot(d)) != NULL) {
        if (fsu_write_atomic(w->path, w->text, w->len, &err) != 0)
            daemon__log_error("verdicts", "cannot write verdicts.json at shutdown", &err);
        free(w->path);
        free(w->text);
        free(w);
    }
    verdicts_free(&d->verdicts.table);
    d->verdicts.loaded = 0;
}

/* ---- recording ---------------------------------------------------------------------------------- */

/* Whose verdict: node_id (the authorized URL's, the transport's path) when given, never what the
 * delta's metadata claims against it (a token holder would write into another node's records); the
 * steps from the metadata only when it names the same node. */
static verdict_delta about(const dilocod *d, const char *node_id, const delta_info *info)
{
    verdict_delta v = {node_id, 0, 0, 0, d->rnd.step};
    if (info != NULL && info->node_id[0] != '\0' && (node_id == NULL || strcmp(info->node_id, node_id) == 0)) {
        v.node_id = info->node_id;
        v.has_steps = 1;
        v.local_step = info->local_step;
        v.base_outer_step = info->base_outer_step;
    }
    return v;
}

static void arrive(dilocod *d, const verdict_delta *v, verdict_kind kind, const char *reason, int status,
                   const char *message)
{
    if (!d->verdicts.loaded || v->node_id == NULL)
        return;
    verdicts_arrive(&d->verdicts.table, v, kind, reason, status, message, now_unix());
    persist(d);
}

void daemon_verdict_rejected(dilocod *d, const char *node_id, const delta_info *info, dl_code code, int status,
                             const char *message, const char *tensor)
{
    verdict_delta v = about(d, node_id, info);
    char msg[VERDICT_MESSAGE_MAX + 1];

    stats_delta_rejected(&d->m, code);
    if (tensor != NULL && tensor[0] != '\0')
        snprintf(msg, sizeof(msg), "%s (tensor %.80s)", message, tensor);
    else
        snprintf(msg, sizeof(msg), "%s", message);
    arrive(d, &v, VERDICT_REFUSED, dl_error_name(code), status, msg);
}

void daemon_verdict_refused(dilocod *d, const char *node_id, const delta_info *info, round_verdict rv, int status,
                            const char *message)
{
    verdict_delta v = about(d, node_id, info);

    if (stats_delta_refused(&d->m, rv) == REFUSED__COUNT)
        return;                 /* not a refusal */
    /* the open round's record lists them: a stale delta, and one the norm screen quarantined at arrival */
    if (rv == ROUND_STALE) {
        daemon__sign_refused(d, node_id, info, "refused", round_verdict_name(rv));
    } else if (rv == ROUND_OUTLIER) {
        const robust_event *ev = daemon__robust_last(d, node_id);
        daemon__sign_refused(d, node_id, info, "quarantined", ev != NULL ? ev->reason : "outlier");
    }
    /* the norm screen at arrival is a quarantine (robust counts it too): reason "outlier" */
    arrive(d, &v, rv == ROUND_OUTLIER ? VERDICT_QUARANTINED : VERDICT_REFUSED, round_verdict_name(rv), status,
           message);
}

void daemon__verdict_taken(dilocod *d, const delta_info *info, round_verdict rv, int status, int recovered,
                           int had_prev, uint64_t prev_local, uint64_t prev_base)
{
    verdict_delta v = about(d, NULL, info);
    char msg[160];

    if (!d->verdicts.loaded)
        return;
    if (recovered && verdicts_pending(&d->verdicts.table, &v))
        return;                 /* a restart offers its cached deltas again: each has its record */
    if (rv == ROUND_REPLACED && had_prev) {
        verdict_delta old = v;
        old.local_step = prev_local;
        old.base_outer_step = prev_base;
        snprintf(msg, sizeof(msg), "replaced in the round by local_step %" PRIu64, info->local_step);
        (void)verdicts_settle(&d->verdicts.table, &old, VERDICT_REPLACED, NULL, msg, now_unix(), 1);
    }
    snprintf(msg, sizeof(msg), "%s", daemon__async(d) ? "taken for an update: the update decides"
                                                  : "in the round: its close decides (screens, overflow)");
    verdicts_arrive(&d->verdicts.table, &v, rv == ROUND_QUEUED ? VERDICT_QUEUED : VERDICT_ACCEPTED,
                    round_verdict_name(rv), status, msg, now_unix());
    persist(d);
}

static verdict_delta about_entry(const dilocod *d, const round_entry *e)
{
    verdict_delta v = {e->node_id, 1, e->local_step, e->base, d->rnd.step};
    return v;
}

void daemon__verdict_quarantined(dilocod *d, const round_entry *e, const char *reason, const char *message)
{
    verdict_delta v = about_entry(d, e);

    if (!d->verdicts.loaded)
        return;
    (void)verdicts_settle(&d->verdicts.table, &v, VERDICT_QUARANTINED, reason, message, now_unix(), 0);
    persist(d);
}

void daemon__verdict_discarded(dilocod *d, const round_entry *e, const char *reason)
{
    verdict_delta v = about_entry(d, e);

    if (!d->verdicts.loaded || e->quarantined)
        return;                 /* a quarantined one has its verdict */
    (void)verdicts_settle(&d->verdicts.table, &v, VERDICT_REFUSED, reason,
                          "the round was discarded: send a delta for the step it collects again", now_unix(), 0);
    persist(d);
}

void daemon__verdicts_committed(dilocod *d, const round_record *r, int replay)
{
    char msg[96];

    if (!d->verdicts.loaded)
        return;
    for (size_t i = 0; i < r->n; i++) {
        const node_stat *s = &r->nodes[i];
        verdict_delta v = {s->node_id, 1, s->local_step, r->async ? s->base_outer_step : r->step, r->step + 1};
        snprintf(msg, sizeof(msg), "aggregated into step %" PRIu64, r->step + 1);
        (void)verdicts_settle(&d->verdicts.table, &v, VERDICT_AGGREGATED, NULL, msg, (double)r->closed_at, replay);
    }
    /* a quarantine is recorded when it is made; a restart replays it only where the file missed it */
    for (size_t i = 0; replay && i < r->nquarantined; i++) {
        const node_stat *s = &r->quarantined[i];
        verdict_delta v = {s->node_id, 1, s->local_step, r->async ? s->base_outer_step : r->step, r->step};
        (void)verdicts_settle(&d->verdicts.table, &v, VERDICT_QUARANTINED, s->quarantine_reason,
                              "quarantined at the round's close", (double)r->closed_at, 1);
    }
    persist(d);
}

/* ---- GET /nodes/<id>, /status, /metrics ---------------------------------------------------------- */

int daemon_node_verdicts_json(const dilocod *d, const char *node_id, sbuf *b)
{
    const verdict_node *e = d->verdicts.loaded ? verdicts_find(&d->verdicts.table, node_id) : NULL;

    if (e == NULL)
        return -1;
    verdicts_node_json(e, b);
    sb_str(b, "\n");
    return 0;
}

static void verdicts_status(const dilocod *d, sbuf *b)
{
    const verdicts *v = &d->verdicts.table;

    sb_printf(b, ",\"verdicts\":{\"nodes\":%zu,\"nodes_max\":%d,\"per_node\":%d,\"dropped_nodes\":%" PRIu64
                 ",\"changes\":%" PRIu64 ",\"persisted\":%" PRIu64 ",\"write_failures\":%" PRIu64 "}",
              d->verdicts.loaded ? v->n : 0, VERDICTS_NODES_MAX, VERDICTS_PER_NODE,
              d->verdicts.loaded ? v->dropped_nodes : 0, d->verdicts.loaded ? v->changes : 0, d->verdicts.written,
              d->verdicts.write_failures);
}

static void verdicts_metrics(const dilocod *d, sbuf *b)
{
    daemon_metric_family(b, "verdict_nodes", "gauge",
                         "Nodes whose last deltas' verdicts GET /nodes/<id> serves (at most 64: the least recently "
                         "judged is forgotten).");
    sb_printf(b, "dilocod_verdict_nodes %zu\n", d->verdicts.loaded ? d->verdicts.table.n : 0);
    daemon_metric_family(b, "verdict_nodes_dropped_total", "counter",
                         "Nodes forgotten by the verdicts table for more recent ones.");
    sb_printf(b, "dilocod_verdict_nodes_dropped_total %" PRIu64 "\n",
              d->verdicts.loaded ? d->verdicts.table.dropped_nodes : 0);
    daemon_metric_family(b, "verdicts_write_failures_total", "counter", "Failed writes of verdicts.json.");
    sb_printf(b, "dilocod_verdicts_write_failures_total %" PRIu64 "\n", d->verdicts.write_failures);
}

const daemon_provider daemon__verdicts_provider = {"verdicts", verdicts_status, verdicts_metrics};
