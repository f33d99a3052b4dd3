/* The daemon's parts of /status and /metrics (daemon.h, "the providers"): the registry the routes
 * walk, and one provider per subsystem whose state is the daemon's: the process and the committed
 * step, the step pipeline, the open round, the pass, the history, the optimizer, the model, the
 * transport and publishing, the commit, the counters, adoptions, index parses and the HTTP server.
 * daemon__status_register adds them, and the front's (daemon.h's daemon_front: the uploads', wired by
 * main) before the cluster's, in the order /status has always shown its members.  Each writes only what it reads, on the loop thread. */
#include "daemon.h"
#include "daemon_internal.h"
#include "s3_cluster.h"
#include "daemon_parts.h"

#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

#include "history.h"
#include "http.h"
#include "hub.h"
#include "index_parse.h"
#include "pipeline.h"
#include "round.h"
#include "stats.h"
#include "strbuf.h"
#include "workers.h"

/* ---- the registry ------------------------------------------------------------------------------ */

int daemon_provide(dilocod *d, const daemon_provider *p)
{
    if (d->nproviders >= DAEMON_PROVIDERS_MAX)
        return -ENOSPC;
    d->providers[d->nproviders++] = p;
    return 0;
}

const daemon_provider *const *daemon_providers(const dilocod *d, size_t *n)
{
    *n = d->nproviders;
    return d->providers;
}

void daemon_metric_family(sbuf *b, const char *name, const char *type, const char *help)
{
    sb_printf(b, "# HELP dilocod_%s %s\n# TYPE dilocod_%s %s\n", name, help, name, type);
}

void daemon_json_num(sbuf *b, double v)
{
    if (isfinite(v))
        sb_printf(b, "%.9g", v);
    else
        sb_str(b, "null");
}

void daemon_json_num_exact(sbuf *b, double v)
{
    if (isfinite(v))
        sb_printf(b, "%.17g", v);
    else
        sb_str(b, "null");
}

void daemon_json_time(sbuf *b, time_t t)
{
    char out[48];
    struct tm tm;

    if (t == 0) {
        sb_str(b, "null");
        return;
    }
    gmtime_r(&t, &tm);
    strftime(out, sizeof(out), "\"%Y-%m-%dT%H:%M:%S+00:00\"", &tm);
    sb_str(b, out);
}

#define metric daemon_metric_family

/* A family of one unlabelled sample. */
typedef struct family_u64 {
    const char *name, *type, *help;
    uint64_t value;
} family_u64;

static void families_u64(sbuf *b, const family_u64 *f, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        metric(b, f[i].name, f[i].type, f[i].help);
        sb_printf(b, "dilocod_%s %" PRIu64 "\n", f[i].name, f[i].value);
    }
}

#define NFAMILIES(a) (sizeof(a) / sizeof((a)[0]))

/* ---- the process and the committed step ------------------------------------------------------- */

static void process_status(const dilocod *d, sbuf *b)
{
    sb_printf(b, ",\"uptime_seconds\":%ld,\"started_at\":", (long)(time(NULL) - d->started_at));
    daemon_json_time(b, d->started_at);     /* what the counters count since (the dashboard says so) */
    sb_printf(b, ",\"algorithm\":\"%s\",\"outer_step\":", DELTA_ALGORITHM);
    if (d->cluster != NULL) {
        /* a cluster's step is the bucket's, and its state the cluster's (README, Scaling out) */
        int64_t step;
        const char *state = cluster_state(d->cluster, &step);
        if (step >= 0)
            sb_printf(b, "%" PRId64, step);
        else
            sb_str(b, "null");
        sb_printf(b, ",\"state\":\"%s\"", d->stopping ? "stopping" : state);
        const char *problem = cluster_problem(d->cluster);      /* a static name, no escaping needed */
        if (problem != NULL)
            sb_printf(b, ",\"problem\":\"%s\"", problem);
        else
            sb_str(b, ",\"problem\":null");
        return;
    }
    if (d->st.committed)
        sb_printf(b, "%" PRIu64, d->st.step);
    else
        sb_str(b, "null");
    sb_printf(b, ",\"state\":\"%s\"", d->stopping ? "stopping" : daemon__state_name(daemon__state(d)));
    /* a lasting condition the operator must look at, as a stable name (README, "Robust aggregation") */
    sb_printf(b, ",\"problem\":%s", d->agg.overflow_problem ? "\"output_overflow\"" : "null");
}

static void process_metrics(const dilocod *d, sbuf *b)
{
    metric(b, "outer_step", "gauge", "The committed outer step (-1: no global model yet).");
    sb_printf(b, "dilocod_outer_step %" PRId64 "\n", d->st.committed ? (int64_t)d->st.step : -1);
}

static const daemon_provider process_provider = {"process", process_status, process_metrics};

/* ---- the step pipeline --------------------------------------------------------------------------- */

/* A record's activities in one of its sets (busy, failed): ["pass","sync"]. */
static void activity_list(sbuf *b, const char *key, unsigned set)
{
    sb_printf(b, ",\"%s\":[", key);
    for (unsigned a = 0, n = 0; a < STEP_NACTS; a++)
        if (set & (1u << a))
            sb_printf(b, "%s\"%s\"", n++ ? "," : "", step_activity_name((step_activity)a));
    sb_str(b, "]");
}

/* "pipeline": the steps in flight (and the last ones done), by step, each with its state, the Unix
 * time it entered it, what runs for it and what failed: what tests and operators wait on instead of
 * files. */
static void pipeline_status(const dilocod *d, sbuf *b)
{
    sb_str(b, ",\"pipeline\":[");
    for (size_t i = 0; i < d->pipe.n; i++) {
        const step_record *r = &d->pipe.rec[i];
        sb_printf(b, "%s{\"step\":%" PRIu64 ",\"state\":\"%s\",\"since\":", i ? "," : "", r->step,
                  step_state_name(r->state));
        daemon_json_num(b, r->since_wall);
        sb_printf(b, ",\"published\":%s,\"attempts\":%u", r->published ? "true" : "false", r->attempts);
        activity_list(b, "busy", r->busy);
        activity_list(b, "failed", r->failed);
        sb_str(b, "}");
    }
    sb_str(b, "]");
}

static void pipeline_metrics(const dilocod *d, sbuf *b)
{
    metric(b, "pipeline_state_seconds", "histogram", "Time a step spent in each pipeline state, by its moves out.");
    for (int s = 0; s < STEP_NSTATES; s++) {
        if (s == STEP_CLEANED || s == STEP_FAILED)
            continue;                   /* no step ever leaves these */
        const state_histogram *h = &d->pipe.seconds[s];
        const char *name = step_state_name((step_state)s);
        for (int i = 0; i < PIPELINE_NBUCKETS - 1; i++)
            sb_printf(b, "dilocod_pipeline_state_seconds_bucket{state=\"%s\",le=\"%g\"} %" PRIu64 "\n", name,
                      PIPELINE_BUCKETS[i], h->buckets[i]);
        sb_printf(b, "dilocod_pipeline_state_seconds_bucket{state=\"%s\",le=\"+Inf\"} %" PRIu64 "\n", name,
                  h->buckets[PIPELINE_NBUCKETS - 1]);
        sb_printf(b, "dilocod_pipeline_state_seconds_sum{state=\"%s\"} %.6f\n", name, h->sum);
        sb_printf(b, "dilocod_pipeline_state_seconds_count{state=\"%s\"} %" PRIu64 "\n", name, h->count);
    }
    metric(b, "pipeline_illegal_transitions_total", "counter", "Pipeline moves the state table refused (a bug).");
    sb_printf(b, "dilocod_pipeline_illegal_transitions_total %" PRIu64 "\n", d->pipe.illegal);
}

static const daemon_provider pipeline_provider = {"pipeline", pipeline_status, pipeline_metrics};

/* ---- the open round -------------------------------------------------------------------------------- */

/* The open round: none before there is a global to start from (nothing yet, not "round 0"). */
static void round_status(const dilocod *d, sbuf *b)
{
    const round_state *r = &d->rnd;
    double now = (double)uv_now(&d->loop) / 1000.0;     /* daemon__now's clock */

    if (!d->st.committed) {
        sb_str(b, ",\"round\":null");
        return;
    }
    sb_printf(b, ",\"round\":{\"step\":%" PRIu64 ",\"expected\":%u,\"min_nodes\":%u,\"timeout_seconds\":", r->step,
              d->cfg->expected_nodes, d->cfg->min_nodes);
    daemon_json_num(b, d->cfg->round_timeout);
    double deadline = round_deadline(r);
    sb_str(b, ",\"deadline\":");
    if (deadline >= 0)
        daemon_json_time(b, time(NULL) + (time_t)ceil(deadline - now));
    else
        sb_str(b, "null");
    sb_printf(b, ",\"closed\":%s,\"received\":[", r->closed ? "true" : "false");
    for (size_t i = 0; i < r->n; i++) {
        const round_entry *e = &r->entries[i];
        sb_printf(b, "%s{\"node_id\":\"%s\",\"local_step\":%" PRIu64 ",\"bytes\":%" PRIu64 ",\"age_seconds\":",
                  i ? "," : "", e->node_id, e->local_step, e->size);
        daemon_json_num(b, now - e->received_at);
        sb_str(b, "}");
    }
    sb_str(b, "],\"missing\":[");
    for (size_t i = 0, k = 0; i < d->cfg->nnodes; i++) {
        if (!round_has_node(r, d->cfg->nodes[i]))
            sb_printf(b, "%s\"%s\"", k++ ? "," : "", d->cfg->nodes[i]);
    }
    sb_str(b, "]}");
}

static void round_metrics(const dilocod *d, sbuf *b)
{
    metric(b, "round_nodes", "gauge", "Nodes that delivered a delta to the open round.");
    sb_printf(b, "dilocod_round_nodes %zu\n", d->rnd.n);
    metric(b, "round_expected_nodes", "gauge", "Nodes a round waits for (0: closes by timeout).");
    sb_printf(b, "dilocod_round_expected_nodes %u\n", d->cfg->expected_nodes);
}

static const daemon_provider round_provider = {"round", round_status, round_metrics};

/* ---- the pass, the history, the optimizer, the model ------------------------------------------------- */

/* The aggregation in progress. */
static void pass_status(const dilocod *d, sbuf *b)
{
    if (d->agg.pass == NULL || d->agg.pass->bytes_total == 0) {
        sb_str(b, ",\"aggregation\":null");
        return;
    }
    uint64_t done = atomic_load(&d->agg.pass->bytes_done);
    sb_str(b, ",\"aggregation\":{\"percent\":");
    daemon_json_num(b, 100.0 * (double)done / (double)d->agg.pass->bytes_total);
    sb_str(b, ",\"seconds\":");
    daemon_json_num(b, daemon__clock() - d->agg.started);
    sb_printf(b, ",\"nodes\":%zu}", d->agg.n);
}

static const daemon_provider pass_provider = {"pass", pass_status, NULL};

static void history_status(const dilocod *d, sbuf *b)
{
    sb_str(b, ",\"last_round\":");
    if (history_last(&d->history) != NULL)
        history_record_json(b, history_last(&d->history));
    else
        sb_str(b, "null");
}

static const daemon_provider history_provider = {"history", history_status, NULL};

static void optimizer_status(const dilocod *d, sbuf *b)
{
    sb_printf(b, ",\"optimizer\":{\"name\":\"%s\",\"lr\":", config_optimizer_name(d->cfg->optimizer));
    daemon_json_num(b, d->cfg->lr);
    sb_str(b, ",\"momentum\":");
    daemon_json_num(b, d->cfg->momentum);
    sb_str(b, "}");
}

static const daemon_provider optimizer_provider = {"optimizer", optimizer_status, NULL};

static void model_status(const dilocod *d, sbuf *b)
{
    sb_str(b, ",\"model\":");
    if (d->model != NULL)
        sb_printf(b, "{\"tensors\":%zu,\"parameters\":%" PRIu64 ",\"bytes\":%" PRIu64 ",\"delta_bytes\":%" PRIu64 "}",
                  d->model->ntensors, d->model_params, d->model_bytes, d->delta_bytes);
    else
        sb_str(b, "null");
}

static const daemon_provider model_provider = {"model", model_status, NULL};

/* ---- the transport and publishing ---------------------------------------------------------------- */

static void json_string_or_null(sbuf *b, const char *s)
{
    if (s != NULL && s[0])
        sb_json_string(b, s, strlen(s));
    else
        sb_str(b, "null");
}

/* The transport, the same fields whatever it is (a field a transport has no use for stays 0/null). */
static void hub_status_json(const dilocod *d, sbuf *b)
{
    const hub_status *hs = d->hub ? hub_get_status(d->hub) : NULL;

    sb_printf(b, ",\"hub\":{\"kind\":\"%s\",\"url\":", d->hub ? hub_kind(d->hub) : "none");
    sb_json_string(b, d->cfg->hub, strlen(d->cfg->hub));
    const char *endpoint;
    if (hs != NULL && config_hub_value(d->cfg, "hub_endpoint", &endpoint)) {
        sb_str(b, ",\"endpoint\":");
        if (endpoint != NULL)
            sb_json_string(b, endpoint, strlen(endpoint));
        else
            sb_str(b, "null");      /* unset: the transport derives its own (from the region, say) */
    }
    if (hs != NULL) {
        sb_printf(b, ",\"head\":\"%s\",\"api_calls\":%" PRIu64 ",\"resolver_calls\":%" PRIu64 ",\"downloads\":%" PRIu64
                     ",\"publishing\":%s,\"transport_errors\":%" PRIu64 ",\"last_transport_error\":",
                  hs->head, hs->api_calls, hs->resolver_calls, hs->downloads, hs->publishing ? "true" : "false",
                  hs->errors);
        json_string_or_null(b, hs->last_error);
        /* a lasting failure only the operator can fix (a wrong token, a missing repo), as a stable name */
        sb_str(b, ",\"problem\":");
        json_string_or_null(b, hs->problem);
    }
    sb_str(b, ",\"last_poll\":");
    daemon_json_time(b, hs ? hs->last_poll : 0);
    sb_str(b, ",\"last_publish\":");
    daemon_json_time(b, hs ? hs->last_publish : 0);
    sb_str(b, ",\"published_step\":");
    if (d->published_step >= 0)
        sb_printf(b, "%" PRId64, d->published_step);
    else
        sb_str(b, "null");
    sb_printf(b, ",\"publish_pending\":%s,\"publish_interval\":%.9g,\"coalesced\":%" PRIu64 ",\"errors\":%" PRIu64
                 ",\"last_error\":",
              d->hub != NULL && d->st.committed && d->published_step != (int64_t)d->st.step ? "true" : "false",
              d->cfg->publish_interval, d->publish.coalesced, d->m.publish_errors);
    json_string_or_null(b, hs != NULL ? hs->last_error : NULL);
    sb_str(b, "}");
}

/* The transport's families: present for every hub (zeros where a transport has no such thing). */
static void hub_metrics(const dilocod *d, sbuf *b)
{
    static const hub_status none;
    const hub_status *hs = d->hub ? hub_get_status(d->hub) : &none;

    metric(b, "published_step", "gauge", "The last step published to the hub (-1: none).");
    sb_printf(b, "dilocod_published_step %" PRId64 "\n", d->published_step);
    metric(b, "publish_errors_total", "counter", "Failed publish attempts (retried).");
    sb_printf(b, "dilocod_publish_errors_total %" PRIu64 "\n", d->m.publish_errors);
    metric(b, "publish_coalesced_total", "counter", "Committed steps never published: a newer one went out instead "
           "(--publish-interval).");
    sb_printf(b, "dilocod_publish_coalesced_total %" PRIu64 "\n", d->publish.coalesced);
    metric(b, "hub_last_poll_timestamp_seconds", "gauge", "When the hub was last listed (Unix time; 0: never).");
    sb_printf(b, "dilocod_hub_last_poll_timestamp_seconds %lld\n", (long long)hs->last_poll);
    metric(b, "hub_last_publish_timestamp_seconds", "gauge", "When a step was last published (Unix time; 0: never).");
    sb_printf(b, "dilocod_hub_last_publish_timestamp_seconds %lld\n", (long long)hs->last_publish);
    metric(b, "hub_api_calls_total", "counter", "Requests to the hub's API (hf://: the Hub API).");
    sb_printf(b, "dilocod_hub_api_calls_total %" PRIu64 "\n", hs->api_calls);
    metric(b, "hub_resolver_calls_total", "counter", "File requests through the hub's resolver (hf://).");
    sb_printf(b, "dilocod_hub_resolver_calls_total %" PRIu64 "\n", hs->resolver_calls);
    metric(b, "hub_requests_total", "counter",
           "Requests to the hub by route and HTTP status code (code 0: no answer, a network error).");
    for (unsigned i = 0; i < hs->ncalls; i++)
        sb_printf(b, "dilocod_hub_requests_total{route=\"%s\",code=\"%d\"} %" PRIu64 "\n", hs->calls[i].route,
                  hs->calls[i].code, hs->calls[i].count);
    metric(b, "hub_downloads_total", "counter", "Delta and global files downloaded from the hub.");
    sb_printf(b, "dilocod_hub_downloads_total %" PRIu64 "\n", hs->downloads);
    metric(b, "hub_download_bytes_total", "counter", "Bytes of the files downloaded from the hub.");
    sb_printf(b, "dilocod_hub_download_bytes_total %" PRIu64 "\n", hs->download_bytes);
    metric(b, "hub_transport_errors_total", "counter", "Failed hub operations (requests, scans, publishes), retried.");
    sb_printf(b, "dilocod_hub_transport_errors_total %" PRIu64 "\n", hs->errors);
    metric(b, "hub_problem", "gauge",
           "1 while the hub refuses us for a reason only the operator can fix (unauthorized, forbidden, gated, "
           "repo_not_found, revision_not_found).");
    if (hs->problem[0])
        sb_printf(b, "dilocod_hub_problem{problem=\"%s\"} 1\n", hs->problem);
    metric(b, "hub_rate_limit_reset_seconds", "gauge",
           "Seconds until the hub's rate budget resets, when it said so (0: not limited or unknown).");
    time_t now = time(NULL);
    sb_printf(b, "dilocod_hub_rate_limit_reset_seconds %lld\n",
              (long long)(hs->rate_reset_at > now ? hs->rate_reset_at - now : 0));
}

static const daemon_provider hub_provider = {"transport", hub_status_json, hub_metrics};

/* ---- the workers' reports ----------------------------------------------------------------------- */

/* "workers": each worker's last report (workers.h: the WORKERS_MAX seen most recently), by node_id. */
static void workers_status(const dilocod *d, sbuf *b)
{
    const workers *w = &d->workers;

    sb_str(b, ",\"workers\":[");
    for (size_t i = 0; i < w->n; i++) {
        const worker_report *e = &w->w[i];
        sb_printf(b, "%s{\"node_id\":\"%s\",\"base_outer_step\":%" PRIu64 ",\"local_step\":%" PRIu64
                     ",\"tokens_total\":%" PRIu64 ",\"encoding\":\"%s\",\"block\":%u,\"bytes\":%" PRIu64 ",\"at\":",
                  i ? "," : "", e->node_id, e->base_outer_step, e->local_step, e->tokens_total,
                  cz_encoding_name(e->cz.enc), e->cz.block, e->bytes);
        daemon_json_time(b, e->at);
        sb_str(b, ",\"metrics\":");
        history_metrics_json(b, &e->metrics);
        sb_str(b, "}");
    }
    sb_str(b, "]");
}

/* One gauge per worker that reported the key. */
static void worker_gauge(const workers *w, sbuf *b, const char *name, unsigned bit, const char *help)
{
    metric(b, name, "gauge", help);
    for (size_t i = 0; i < w->n; i++) {
        const delta_metrics *m = &w->w[i].metrics;
        if (!(m->have & bit))
            continue;
        double v = bit == DELTA_M_LOSS ? m->loss : bit == DELTA_M_TOKENS_PER_SECOND ? m->tokens_per_second
                                                                                  : (double)m->inner_steps;
        sb_printf(b, "dilocod_%s{node=\"%s\"} %.17g\n", name, w->w[i].node_id, v);
    }
}

static void workers_metrics(const dilocod *d, sbuf *b)
{
    const workers *w = &d->workers;

    worker_gauge(w, b, "node_loss", DELTA_M_LOSS, "The loss a worker last reported (delta metadata \"loss\").");
    metric(b, "node_tokens_total", "counter",
           "Tokens a worker trained into committed rounds (the num_tokens of its aggregated deltas).");
    for (size_t i = 0; i < w->n; i++)
        sb_printf(b, "dilocod_node_tokens_total{node=\"%s\"} %" PRIu64 "\n", w->w[i].node_id, w->w[i].tokens_total);
    worker_gauge(w, b, "node_tokens_per_second", DELTA_M_TOKENS_PER_SECOND,
                 "The training speed a worker last reported (delta metadata \"tokens_per_second\").");
    worker_gauge(w, b, "node_inner_steps", DELTA_M_INNER_STEPS,
                 "The inner steps a worker last reported for its round (delta metadata \"inner_steps\").");
    metric(b, "node_metric", "gauge",
           "The metric.<name> values a worker last reported, under the first 16 names the process saw.");
    for (size_t i = 0; i < w->n; i++) {
        const delta_metrics *m = &w->w[i].metrics;
        for (size_t k = 0; k < m->nnamed; k++)
            sb_printf(b, "dilocod_node_metric{node=\"%s\",name=\"%s\"} %.17g\n", w->w[i].node_id, m->name[k],
                      m->value[k]);
    }
    metric(b, "node_delta_bytes", "gauge",
           "The bytes on the wire of a worker's last delta taken, with its encoding (none: F32/F16/BF16).");
    for (size_t i = 0; i < w->n; i++)
        sb_printf(b, "dilocod_node_delta_bytes{node=\"%s\",encoding=\"%s\"} %" PRIu64 "\n", w->w[i].node_id,
                  cz_encoding_name(w->w[i].cz.enc), w->w[i].bytes);
    metric(b, "delta_wire_bytes_total", "counter", "Bytes of the deltas taken, by encoding.");
    for (unsigned k = 0; k <= CZ_MXFP4; k++)
        sb_printf(b, "dilocod_delta_wire_bytes_total{encoding=\"%s\"} %" PRIu64 "\n", cz_encoding_name((cz_encoding)k),
                  w->wire_bytes[k]);
    metric(b, "deltas_by_encoding_total", "counter", "Deltas taken, by encoding.");
    for (unsigned k = 0; k <= CZ_MXFP4; k++)
        sb_printf(b, "dilocod_deltas_by_encoding_total{encoding=\"%s\"} %" PRIu64 "\n", cz_encoding_name((cz_encoding)k),
                  w->wire_deltas[k]);
    metric(b, "node_metrics_dropped_total", "counter",
           "Worker reports not shown, to bound the labels: metric.<name> values past the first 16 names "
           "(reason=\"name\"), workers forgotten past the 64 seen most recently (reason=\"node\").");
    sb_printf(b, "dilocod_node_metrics_dropped_total{reason=\"name\"} %" PRIu64 "\n", w->dropped_names);
    sb_printf(b, "dilocod_node_metrics_dropped_total{reason=\"node\"} %" PRIu64 "\n", w->dropped_nodes);
}

static const daemon_provider workers_provider = {"workers", workers_status, workers_metrics};

/* ---- the commit, the counters, adoptions -------------------------------------------------------- */

static void commit_status(const dilocod *d, sbuf *b)
{
    sb_str(b, ",\"committed_at\":");
    daemon_json_time(b, d->committed_at);
}

static const daemon_provider commit_provider = {"commit", commit_status, NULL};

/* Stale deltas: the round's and intake's, and those a transport skipped from their header. */
static uint64_t stale_total(const dilocod *d)
{
    const hub_status *hs = d->hub != NULL ? hub_get_status(d->hub) : NULL;
    return d->m.refused[REFUSED_STALE] + (hs != NULL ? hs->stale_skipped : 0);
}

/* Every refusal by its reason (stats_refusal_names: the dashboard and the tests read them all) and their
 * sum "refused": the dashboard once summed four reasons of eight, and showed 0 after three 422s (outliers). */
static void stats_status(const dilocod *d, sbuf *b)
{
    uint64_t refused = 0;

    sb_printf(b, ",\"counters\":{\"accepted\":%" PRIu64 ",\"replaced\":%" PRIu64, d->m.deltas_accepted,
              d->m.deltas_replaced);
    for (int r = 0; r < REFUSED__COUNT; r++) {
        uint64_t n = r == REFUSED_STALE ? stale_total(d) : d->m.refused[r];
        refused += n;
        sb_printf(b, ",\"%s\":%" PRIu64, stats_refusal_names[r], n);
    }
    sb_printf(b, ",\"refused\":%" PRIu64 ",\"rejected\":%" PRIu64 ",\"rounds\":%" PRIu64 "}", refused,
              stats_rejected_total(&d->m), d->m.rounds);
}

static void http_requests_metrics(const stats *m, sbuf *b)
{
    metric(b, "http_requests_total", "counter", "HTTP responses by route and status code.");
    for (int r = 0; r < ROUTE__COUNT; r++)
        for (int c = 0; c < STATS_HTTP_CODES; c++)
            if (m->http[r][c] > 0 || (c == 0 && r != ROUTE_OTHER)) {
                char code[16];
                if (c == STATS_HTTP_CODES - 1 || stats_http_codes[c] == 0)
                    snprintf(code, sizeof(code), "other");
                else
                    snprintf(code, sizeof(code), "%d", stats_http_codes[c]);
                sb_printf(b, "dilocod_http_requests_total{route=\"%s\",code=\"%s\"} %" PRIu64 "\n",
                          stats_route_names[r], code, m->http[r][c]);
            }
}

static void stats_metrics(const dilocod *d, sbuf *b)
{
    const stats *m = &d->m;

    const family_u64 f[] = {
        {"rounds_total", "counter", "Rounds aggregated and committed since start.", m->rounds},
        {"deltas_accepted_total", "counter", "Deltas accepted into a round (first of their node).",
         m->deltas_accepted},
        {"deltas_replaced_total", "counter", "Deltas that replaced an older one of the same node.",
         m->deltas_replaced},
        {"deltas_rewritten_total", "counter",
         "Deltas of a shared tree rewritten in place after they were taken in (dropped from their round and "
         "taken in again).",
         m->deltas_rewritten},
        {"rounds_all_quarantined_total", "counter",
         "Rounds whose every delta the cosine screen quarantined: nothing committed, the round collected again.",
         m->rounds_all_quarantined},
        {"rounds_overflowed_total", "counter",
         "Rounds discarded because no subset of their deltas made a finite step (the state is near its dtype's "
         "limit): nothing committed, the round collected again.",
         m->rounds_overflowed},
    };
    families_u64(b, f, NFAMILIES(f));
    metric(b, "deltas_rejected_total", "counter", "Invalid deltas (uploads, file:// and the Hub alike), by error code.");
    for (int c = 1; c < DL_E__COUNT; c++)
        sb_printf(b, "dilocod_deltas_rejected_total{code=\"%s\"} %" PRIu64 "\n", dl_error_name((dl_code)c),
                  m->rejected[c]);
    metric(b, "deltas_refused_total", "counter", "Valid deltas the round could not take, by reason.");
    for (int r = 0; r < REFUSED__COUNT; r++)
        sb_printf(b, "dilocod_deltas_refused_total{reason=\"%s\"} %" PRIu64 "\n", stats_refusal_names[r],
                  r == REFUSED_STALE ? stale_total(d) : m->refused[r]);
    const family_u64 uploaded = {"upload_bytes_total", "counter", "Delta bytes received by HTTP uploads.",
                                 m->upload_bytes};
    families_u64(b, &uploaded, 1);
    metric(b, "aggregation_seconds", "histogram", "Duration of a round's aggregation, inputs to durable commit.");
    for (int i = 0; i < STATS_AGG_BUCKETS; i++)
        sb_printf(b, "dilocod_aggregation_seconds_bucket{le=\"%g\"} %" PRIu64 "\n", stats_agg_bounds[i],
                  m->agg_buckets[i]);
    sb_printf(b, "dilocod_aggregation_seconds_bucket{le=\"+Inf\"} %" PRIu64 "\n", m->agg_count);
    sb_printf(b, "dilocod_aggregation_seconds_sum %.6f\ndilocod_aggregation_seconds_count %" PRIu64 "\n",
              m->agg_seconds_sum, m->agg_count);
    http_requests_metrics(m, b);
}

static const daemon_provider stats_provider = {"stats", stats_status, stats_metrics};

static void adopt_metrics(const dilocod *d, sbuf *b)
{
    metric(b, "adoptions_refused_total", "counter",
           "Published globals refused for adoption (a step past the bound, a header over max_delta_header_mib, "
           "a damaged file).");
    sb_printf(b, "dilocod_adoptions_refused_total %" PRIu64 "\n", d->adoptions_refused);
}

static const daemon_provider adopt_provider = {"adoption", NULL, adopt_metrics};

/* ---- index parses, the HTTP server ------------------------------------------------------------ */

/* Sharded deltas' indexes: the parses, by where they were made, and what the kept ones hold. */
static void index_metrics(const dilocod *d, sbuf *b)
{
    uint64_t by_hub = d->hub ? hub_get_status(d->hub)->index_parses : 0;
    char help[256];

    metric(b, "index_parses_total", "counter",
           "Sharded deltas' indexes read and parsed: by the transport (by=\"hub\": file:// scans) and by intake "
           "(by=\"intake\", whatever brought the set).");
    sb_printf(b, "dilocod_index_parses_total{by=\"hub\"} %" PRIu64 "\n", by_hub);
    sb_printf(b, "dilocod_index_parses_total{by=\"intake\"} %" PRIu64 "\n", d->m.index_parses);
    snprintf(help, sizeof(help),
             "Memory the kept parses of sharded deltas' indexes hold (file://: one per node directory, at most %zu "
             "MiB in all): a set handed over again does not cost its index again.", INDEX_PARSE_KEPT_MAX >> 20);
    metric(b, "index_parses_kept_bytes", "gauge", help);
    sb_printf(b, "dilocod_index_parses_kept_bytes %zu\n", index_parse_kept_bytes());
}

static const daemon_provider index_provider = {"index_parses", NULL, index_metrics};

static void http_server_metrics(const dilocod *d, sbuf *b)
{
    const http_stats *hs = d->http ? http_server_stats(d->http) : NULL;

    if (hs == NULL)
        return;
    /* not dilocod_http_connections: a gauge of that name collides with the counter
     * dilocod_http_connections_total in one family (prometheus_client, OpenMetrics) */
    const family_u64 f[] = {
        {"http_open_connections", "gauge", "Open HTTP connections.", hs->connections_open},
        {"http_connections_total", "counter", "HTTP connections accepted.", hs->connections_total},
        {"http_connections_rejected_total", "counter", "Connections refused at the connection limit.",
         hs->rejected_conns},
        {"http_timeouts_total", "counter", "Connections closed for a timeout (slow head, stalled transfer).",
         hs->timeouts},
        {"http_evicted_idle_total", "counter",
         "Idle connections closed at the connection limit to make room for a new one.", hs->evicted_idle},
        {"http_accept_errors_total", "counter",
         "accept() failures for want of descriptors or memory (the listener backed off).", hs->accept_errors},
        {"http_received_bytes_total", "counter", "Bytes read from HTTP clients.", hs->bytes_received},
        {"http_sent_bytes_total", "counter", "Bytes sent to HTTP clients.", hs->bytes_sent},
    };
    families_u64(b, f, NFAMILIES(f));
}

static const daemon_provider http_server_provider = {"http_server", NULL, http_server_metrics};

/* ---- registration ---------------------------------------------------------------------------------- */

int daemon__status_register(dilocod *d)
{
    /* the order of /status's members (the dashboard and the tests read them by name; operators by eye) */
    static const daemon_provider *const order[] = {
        &process_provider, &pipeline_provider, &round_provider, &pass_provider,  &history_provider,
        &optimizer_provider, &model_provider, &hub_provider,    &commit_provider, &stats_provider,
        &adopt_provider,   &index_provider,  &http_server_provider, &daemon__async_provider, &daemon__robust_provider,
        &workers_provider, &daemon__verdicts_provider, &daemon__downlink_provider, NULL /* the front's: the uploads' (daemon.h) */, &daemon__cluster_provider,
    };
    for (size_t i = 0; i < sizeof(order) / sizeof(order[0]); i++) {
        const daemon_provider *p = order[i] != NULL ? order[i] : d->front != NULL ? d->front->provider : NULL;
        if (p == NULL)
            continue;
        int rc = daemon_provide(d, p);
        if (rc != 0)
            return rc;
    }
    return 0;
}
