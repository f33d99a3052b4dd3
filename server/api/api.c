/* api: the HTTP routes of dilocod (README.md, HTTP API).  Every error is JSON:
 * {"error":{"code":...,"message":...,"tensor"?:...}}. */
#include <errno.h>
#include <stdarg.h>
#include <fcntl.h>
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <cJSON.h>

#include "daemon_internal.h"
#include "dl_log.h"
#include "fsutil.h"
#include "stepcount.h"
#include "st_index.h"
#include "strbuf.h"



/* server/api/dashboard.html, compiled in by the Makefile */
extern const unsigned char dashboard_html[];
extern const size_t dashboard_html_len;

void api_count_response(int route, int status, void *app)
{
    dilocod *d = app;
    stats_http_response(&d->m, route, status);
}

static void iso_time(char *out, size_t size, time_t t)
{
    struct tm tm;
    if (t == 0) {
        snprintf(out, size, "null");
        return;
    }
    gmtime_r(&t, &tm);
    strftime(out, size, "\"%Y-%m-%dT%H:%M:%S+00:00\"", &tm);
}

static void sb_fmt(sbuf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void sb_fmt(sbuf *b, const char *fmt, ...)
{
    char tmp[512];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(tmp, sizeof(tmp), fmt, ap);
    va_end(ap);
    if (n > 0)
        sb_add(b, tmp, (size_t)n < sizeof(tmp) ? (size_t)n : sizeof(tmp) - 1);
}

/* JSON numbers for doubles: finite values only (JSON has no NaN). */
static void sb_num(sbuf *b, double v)
{
    if (isfinite(v))
        sb_fmt(b, "%.9g", v);
    else
        sb_str(b, "null");
}

/* ---- GET /status, /rounds, /metrics, /healthz ------------------------------------------------ */

/* The open round, as /status shows it. */
static void round_json(dilocod *d, sbuf *b, time_t now)
{
    char t1[48];
    const round_state *r = &d->rnd;

    sb_fmt(b, ",\"round\":{\"step\":%" PRIu64 ",\"expected\":%u,\"min_nodes\":%u,\"timeout_seconds\":", r->step,
           d->cfg->expected_nodes, d->cfg->min_nodes);
    sb_num(b, d->cfg->round_timeout);
    double deadline = round_deadline(r);
    if (deadline >= 0) {
        time_t wall = now + (time_t)ceil(deadline - daemon__now(d));
        iso_time(t1, sizeof(t1), wall);
        sb_fmt(b, ",\"deadline\":%s", t1);
    } else {
        sb_str(b, ",\"deadline\":null");
    }
    sb_fmt(b, ",\"closed\":%s,\"received\":[", r->closed ? "true" : "false");
    for (size_t i = 0; i < r->n; i++) {
        const round_entry *e = &r->entries[i];
        sb_fmt(b, "%s{\"node_id\":\"%s\",\"local_step\":%" PRIu64 ",\"bytes\":%" PRIu64 ",\"age_seconds\":", i ? "," : "",
               e->node_id, e->local_step, e->size);
        sb_num(b, daemon__now(d) - e->received_at);
        sb_str(b, "}");
    }
    sb_str(b, "],\"missing\":[");
    for (size_t i = 0, k = 0; i < d->cfg->nnodes; i++) {
        if (round_find(r, d->cfg->nodes[i]) == NULL)
            sb_fmt(b, "%s\"%s\"", k++ ? "," : "", d->cfg->nodes[i]);
    }
    sb_str(b, "]}");
}

/* The transport, the same fields whatever it is (a field a transport has no use for stays 0/null). */
static void hub_json(dilocod *d, sbuf *b)
{
    char t1[48], t2[48];
    const hub_status *hs = d->hub ? hub_get_status(d->hub) : NULL;

    iso_time(t1, sizeof(t1), hs ? hs->last_poll : 0);
    iso_time(t2, sizeof(t2), hs ? hs->last_publish : 0);
    sb_fmt(b, ",\"hub\":{\"kind\":\"%s\",\"url\":", d->hub ? hub_kind(d->hub) : "none");
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
        sb_fmt(b, ",\"head\":\"%s\",\"api_calls\":%" PRIu64 ",\"resolver_calls\":%" PRIu64 ",\"downloads\":%" PRIu64
                  ",\"publishing\":%s,\"transport_errors\":%" PRIu64 ",\"last_transport_error\":",
               hs->head, hs->api_calls, hs->resolver_calls, hs->downloads, hs->publishing ? "true" : "false",
               hs->errors);
        if (hs->last_error[0])
            sb_json_string(b, hs->last_error, strlen(hs->last_error));
        else
            sb_str(b, "null");
        /* a lasting failure only the operator can fix (a wrong token, a missing repo), as a stable name */
        sb_str(b, ",\"problem\":");
        if (hs->problem[0])
            sb_json_string(b, hs->problem, strlen(hs->problem));
        else
            sb_str(b, "null");
    }
    sb_fmt(b, ",\"last_poll\":%s,\"last_publish\":%s,\"published_step\":", t1, t2);
    if (d->published_step >= 0)
        sb_fmt(b, "%" PRId64, d->published_step);
    else
        sb_str(b, "null");
    sb_fmt(b, ",\"publish_pending\":%s,\"errors\":%" PRIu64 ",\"last_error\":",
           d->hub != NULL && d->st.committed && d->published_step != (int64_t)d->st.step ? "true" : "false",
           d->m.publish_errors);
    if (hs != NULL && hs->last_error[0])
        sb_json_string(b, hs->last_error, strlen(hs->last_error));
    else
        sb_str(b, "null");
}

/* "pipeline": the steps in flight (and the last ones done), by step, each with its state and the
 * Unix time it entered it: what tests and operators wait on instead of files. */
static void pipeline_json(const dilocod *d, sbuf *b)
{
    sb_str(b, ",\"pipeline\":[");
    for (size_t i = 0; i < d->pipe.n; i++) {
        const step_record *r = &d->pipe.rec[i];
        sb_fmt(b, "%s{\"step\":%" PRIu64 ",\"state\":\"%s\",\"since\":", i ? "," : "", r->step,
               step_state_name(r->state));
        sb_num(b, r->since_wall);
        sb_fmt(b, ",\"published\":%s}", r->published ? "true" : "false");
    }
    sb_str(b, "]");
}

static void status_json(dilocod *d, sbuf *b)
{
    char t3[48];
    time_t now = time(NULL);

    sb_fmt(b, "{\"version\":\"%s\",\"uptime_seconds\":%ld,\"algorithm\":\"%s\",\"outer_step\":", DILOCOD_VERSION,
           (long)(now - d->started_at), DELTA_ALGORITHM);
    if (d->st.committed)
        sb_fmt(b, "%" PRIu64, d->st.step);
    else
        sb_str(b, "null");
    sb_fmt(b, ",\"state\":\"%s\"", d->stopping ? "stopping" : daemon__state_name(daemon__state(d)));
    pipeline_json(d, b);
    /* the open round: none before there is a global to start from (nothing yet, not "round 0") */
    if (d->st.committed)
        round_json(d, b, now);
    else
        sb_str(b, ",\"round\":null");
    /* the aggregation in progress */
    if (d->pass != NULL && d->pass->bytes_total > 0) {
        uint64_t done = atomic_load(&d->pass->bytes_done);
        sb_str(b, ",\"aggregation\":{\"percent\":");
        sb_num(b, 100.0 * (double)done / (double)d->pass->bytes_total);
        sb_str(b, ",\"seconds\":");
        sb_num(b, daemon__clock() - d->pass_started);
        sb_fmt(b, ",\"nodes\":%zu}", d->pass_n);
    } else {
        sb_str(b, ",\"aggregation\":null");
    }
    sb_str(b, ",\"last_round\":");
    if (history_last(&d->history) != NULL)
        history_record_json(b, history_last(&d->history));
    else
        sb_str(b, "null");
    sb_fmt(b, ",\"optimizer\":{\"name\":\"%s\",\"lr\":", config_optimizer_name(d->cfg->optimizer));
    sb_num(b, d->cfg->lr);
    sb_str(b, ",\"momentum\":");
    sb_num(b, d->cfg->momentum);
    sb_str(b, "},\"model\":");
    if (d->model != NULL)
        sb_fmt(b, "{\"tensors\":%zu,\"parameters\":%" PRIu64 ",\"bytes\":%" PRIu64 ",\"delta_bytes\":%" PRIu64 "}",
               d->model->ntensors, d->model_params, d->model_bytes, d->delta_bytes);
    else
        sb_str(b, "null");
    hub_json(d, b);
    iso_time(t3, sizeof(t3), d->committed_at);
    sb_fmt(b, "},\"committed_at\":%s", t3);
    sb_fmt(b, ",\"counters\":{\"accepted\":%" PRIu64 ",\"replaced\":%" PRIu64 ",\"stale\":%" PRIu64
              ",\"future\":%" PRIu64 ",\"not_newer\":%" PRIu64 ",\"unknown_node\":%" PRIu64 ",\"rejected\":%" PRIu64
              ",\"rounds\":%" PRIu64 "}",
           d->m.deltas_accepted, d->m.deltas_replaced, d->m.refused[REFUSED_STALE], d->m.refused[REFUSED_FUTURE],
           d->m.refused[REFUSED_NOT_NEWER], d->m.refused[REFUSED_UNKNOWN_NODE], stats_rejected_total(&d->m),
           d->m.rounds);
    sb_fmt(b, ",\"uploads_in_progress\":%d}\n", d->uploads_in_flight);
}

static void rounds_json(dilocod *d, sbuf *b)
{
    sb_str(b, "{\"rounds\":[");
    for (size_t i = 0; i < history_count(&d->history); i++) {
        if (i > 0)
            sb_add(b, ",", 1);
        history_record_json(b, history_get(&d->history, i));
    }
    sb_str(b, "]}\n");
}

static void metric(sbuf *b, const char *name, const char *type, const char *help)
{
    sb_fmt(b, "# HELP dilocod_%s %s\n# TYPE dilocod_%s %s\n", name, help, name, type);
}

/* The transport's families: present for every hub (zeros where a transport has no such thing). */
static void hub_metrics(dilocod *d, sbuf *b)
{
    static const hub_status none;
    const hub_status *hs = d->hub ? hub_get_status(d->hub) : &none;

    metric(b, "hub_last_poll_timestamp_seconds", "gauge", "When the hub was last listed (Unix time; 0: never).");
    sb_fmt(b, "dilocod_hub_last_poll_timestamp_seconds %lld\n", (long long)hs->last_poll);
    metric(b, "hub_last_publish_timestamp_seconds", "gauge", "When a step was last published (Unix time; 0: never).");
    sb_fmt(b, "dilocod_hub_last_publish_timestamp_seconds %lld\n", (long long)hs->last_publish);
    metric(b, "hub_api_calls_total", "counter", "Requests to the hub's API (hf://: the Hub API).");
    sb_fmt(b, "dilocod_hub_api_calls_total %" PRIu64 "\n", hs->api_calls);
    metric(b, "hub_resolver_calls_total", "counter", "File requests through the hub's resolver (hf://).");
    sb_fmt(b, "dilocod_hub_resolver_calls_total %" PRIu64 "\n", hs->resolver_calls);
    metric(b, "hub_requests_total", "counter",
           "Requests to the hub by route and HTTP status code (code 0: no answer, a network error).");
    for (unsigned i = 0; i < hs->ncalls; i++)
        sb_fmt(b, "dilocod_hub_requests_total{route=\"%s\",code=\"%d\"} %" PRIu64 "\n", hs->calls[i].route,
               hs->calls[i].code, hs->calls[i].count);
    metric(b, "hub_downloads_total", "counter", "Delta and global files downloaded from the hub.");
    sb_fmt(b, "dilocod_hub_downloads_total %" PRIu64 "\n", hs->downloads);
    metric(b, "hub_download_bytes_total", "counter", "Bytes of the files downloaded from the hub.");
    sb_fmt(b, "dilocod_hub_download_bytes_total %" PRIu64 "\n", hs->download_bytes);
    metric(b, "hub_transport_errors_total", "counter", "Failed hub operations (requests, scans, publishes), retried.");
    sb_fmt(b, "dilocod_hub_transport_errors_total %" PRIu64 "\n", hs->errors);
    metric(b, "hub_problem", "gauge",
           "1 while the hub refuses us for a reason only the operator can fix (unauthorized, forbidden, gated, "
           "repo_not_found, revision_not_found).");
    if (hs->problem[0])
        sb_fmt(b, "dilocod_hub_problem{problem=\"%s\"} 1\n", hs->problem);
    metric(b, "hub_rate_limit_reset_seconds", "gauge",
           "Seconds until the hub's rate budget resets, when it said so (0: not limited or unknown).");
    time_t now = time(NULL);
    sb_fmt(b, "dilocod_hub_rate_limit_reset_seconds %lld\n",
           (long long)(hs->rate_reset_at > now ? hs->rate_reset_at - now : 0));
}

/* Sharded deltas' indexes: the parses, by where they were made, and what the kept ones hold. */
static void index_metrics(dilocod *d, sbuf *b)
{
    uint64_t by_hub = d->hub ? hub_get_status(d->hub)->index_parses : 0;
    char help[256];

    metric(b, "index_parses_total", "counter",
           "Sharded deltas' indexes read and parsed: by the transport (by=\"hub\": file:// scans) and by intake "
           "(by=\"intake\", whatever brought the set).");
    sb_fmt(b, "dilocod_index_parses_total{by=\"hub\"} %" PRIu64 "\n", by_hub);
    sb_fmt(b, "dilocod_index_parses_total{by=\"intake\"} %" PRIu64 "\n", d->m.index_parses);
    snprintf(help, sizeof(help),
             "Memory the kept parses of sharded deltas' indexes hold (file://: one per node directory, at most %zu "
             "MiB in all): a set handed over again does not cost its index again.", INDEX_PARSE_KEPT_MAX >> 20);
    metric(b, "index_parses_kept_bytes", "gauge", help);
    sb_fmt(b, "dilocod_index_parses_kept_bytes %zu\n", index_parse_kept_bytes());
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
            sb_fmt(b, "dilocod_pipeline_state_seconds_bucket{state=\"%s\",le=\"%g\"} %" PRIu64 "\n", name,
                   PIPELINE_BUCKETS[i], h->buckets[i]);
        sb_fmt(b, "dilocod_pipeline_state_seconds_bucket{state=\"%s\",le=\"+Inf\"} %" PRIu64 "\n", name,
               h->buckets[PIPELINE_NBUCKETS - 1]);
        sb_fmt(b, "dilocod_pipeline_state_seconds_sum{state=\"%s\"} %.6f\n", name, h->sum);
        sb_fmt(b, "dilocod_pipeline_state_seconds_count{state=\"%s\"} %" PRIu64 "\n", name, h->count);
    }
    metric(b, "pipeline_illegal_transitions_total", "counter", "Pipeline moves the state table refused (a bug).");
    sb_fmt(b, "dilocod_pipeline_illegal_transitions_total %" PRIu64 "\n", d->pipe.illegal);
}

static void metrics_text(dilocod *d, sbuf *b)
{
    const http_stats *hs = d->http ? http_server_stats(d->http) : NULL;

    metric(b, "outer_step", "gauge", "The committed outer step (-1: no global model yet).");
    sb_fmt(b, "dilocod_outer_step %" PRId64 "\n", d->st.committed ? (int64_t)d->st.step : -1);
    metric(b, "published_step", "gauge", "The last step published to the hub (-1: none).");
    sb_fmt(b, "dilocod_published_step %" PRId64 "\n", d->published_step);
    metric(b, "rounds_total", "counter", "Rounds aggregated and committed since start.");
    sb_fmt(b, "dilocod_rounds_total %" PRIu64 "\n", d->m.rounds);
    metric(b, "round_nodes", "gauge", "Nodes that delivered a delta to the open round.");
    sb_fmt(b, "dilocod_round_nodes %zu\n", d->rnd.n);
    metric(b, "round_expected_nodes", "gauge", "Nodes a round waits for (0: closes by timeout).");
    sb_fmt(b, "dilocod_round_expected_nodes %u\n", d->cfg->expected_nodes);
    metric(b, "deltas_accepted_total", "counter", "Deltas accepted into a round (first of their node).");
    sb_fmt(b, "dilocod_deltas_accepted_total %" PRIu64 "\n", d->m.deltas_accepted);
    metric(b, "deltas_replaced_total", "counter", "Deltas that replaced an older one of the same node.");
    sb_fmt(b, "dilocod_deltas_replaced_total %" PRIu64 "\n", d->m.deltas_replaced);
    metric(b, "deltas_rewritten_total", "counter",
           "Deltas of a shared tree rewritten in place after they were taken in (dropped from their round and "
           "taken in again).");
    sb_fmt(b, "dilocod_deltas_rewritten_total %" PRIu64 "\n", d->m.deltas_rewritten);
    metric(b, "adoptions_refused_total", "counter",
           "Published globals refused for adoption (a step past the bound, a header over max_delta_header_mib, "
           "a damaged file).");
    sb_fmt(b, "dilocod_adoptions_refused_total %" PRIu64 "\n", d->adoptions_refused);
    metric(b, "deltas_rejected_total", "counter", "Invalid deltas (uploads, file:// and the Hub alike), by error code.");
    for (int c = 1; c < DL_E__COUNT; c++)
        sb_fmt(b, "dilocod_deltas_rejected_total{code=\"%s\"} %" PRIu64 "\n", dl_error_name((dl_code)c),
               d->m.rejected[c]);
    metric(b, "deltas_refused_total", "counter", "Valid deltas the round could not take, by reason.");
    for (int r = 0; r < REFUSED__COUNT; r++)
        sb_fmt(b, "dilocod_deltas_refused_total{reason=\"%s\"} %" PRIu64 "\n", stats_refusal_names[r],
               d->m.refused[r]);
    metric(b, "upload_bytes_total", "counter", "Delta bytes received by HTTP uploads.");
    sb_fmt(b, "dilocod_upload_bytes_total %" PRIu64 "\n", d->m.upload_bytes);
    metric(b, "uploads_in_progress", "gauge", "HTTP uploads being received.");
    sb_fmt(b, "dilocod_uploads_in_progress %d\n", d->uploads_in_flight);
    metric(b, "aggregation_seconds", "histogram", "Duration of a round's aggregation, inputs to durable commit.");
    for (int i = 0; i < STATS_AGG_BUCKETS; i++)
        sb_fmt(b, "dilocod_aggregation_seconds_bucket{le=\"%g\"} %" PRIu64 "\n", stats_agg_bounds[i],
               d->m.agg_buckets[i]);
    sb_fmt(b, "dilocod_aggregation_seconds_bucket{le=\"+Inf\"} %" PRIu64 "\n", d->m.agg_count);
    sb_fmt(b, "dilocod_aggregation_seconds_sum %.6f\ndilocod_aggregation_seconds_count %" PRIu64 "\n",
           d->m.agg_seconds_sum, d->m.agg_count);
    pipeline_metrics(d, b);
    metric(b, "publish_errors_total", "counter", "Failed publish attempts (retried).");
    sb_fmt(b, "dilocod_publish_errors_total %" PRIu64 "\n", d->m.publish_errors);
    /* the transport: the same families whatever the hub (zeros where a transport has no such thing) */
    hub_metrics(d, b);
    index_metrics(d, b);
    metric(b, "http_requests_total", "counter", "HTTP responses by route and status code.");
    for (int r = 0; r < ROUTE__COUNT; r++)
        for (int c = 0; c < STATS_HTTP_CODES; c++)
            if (d->m.http[r][c] > 0 || (c == 0 && r != ROUTE_OTHER)) {
                char code[16];
                if (c == STATS_HTTP_CODES - 1 || stats_http_codes[c] == 0)
                    snprintf(code, sizeof(code), "other");
                else
                    snprintf(code, sizeof(code), "%d", stats_http_codes[c]);
                sb_fmt(b, "dilocod_http_requests_total{route=\"%s\",code=\"%s\"} %" PRIu64 "\n",
                       stats_route_names[r], code, d->m.http[r][c]);
            }
    if (hs != NULL) {
        /* not dilocod_http_connections: a gauge of that name collides with the counter
         * dilocod_http_connections_total in one family (prometheus_client, OpenMetrics) */
        metric(b, "http_open_connections", "gauge", "Open HTTP connections.");
        sb_fmt(b, "dilocod_http_open_connections %" PRIu64 "\n", hs->connections_open);
        metric(b, "http_connections_total", "counter", "HTTP connections accepted.");
        sb_fmt(b, "dilocod_http_connections_total %" PRIu64 "\n", hs->connections_total);
        metric(b, "http_connections_rejected_total", "counter", "Connections refused at the connection limit.");
        sb_fmt(b, "dilocod_http_connections_rejected_total %" PRIu64 "\n", hs->rejected_conns);
        metric(b, "http_timeouts_total", "counter", "Connections closed for a timeout (slow head, stalled transfer).");
        sb_fmt(b, "dilocod_http_timeouts_total %" PRIu64 "\n", hs->timeouts);
        metric(b, "http_evicted_idle_total", "counter",
               "Idle connections closed at the connection limit to make room for a new one.");
        sb_fmt(b, "dilocod_http_evicted_idle_total %" PRIu64 "\n", hs->evicted_idle);
        metric(b, "http_accept_errors_total", "counter",
               "accept() failures for want of descriptors or memory (the listener backed off).");
        sb_fmt(b, "dilocod_http_accept_errors_total %" PRIu64 "\n", hs->accept_errors);
        metric(b, "http_received_bytes_total", "counter", "Bytes read from HTTP clients.");
        sb_fmt(b, "dilocod_http_received_bytes_total %" PRIu64 "\n", hs->bytes_received);
        metric(b, "http_sent_bytes_total", "counter", "Bytes sent to HTTP clients.");
        sb_fmt(b, "dilocod_http_sent_bytes_total %" PRIu64 "\n", hs->bytes_sent);
    }
}

static void respond_sbuf(http_conn *c, int status, const char *type, sbuf *b)
{
    size_t len = b->len;
    char *text = sb_take(b);
    if (text == NULL) {
        http_respond_error(c, 500, "out_of_memory", "out of memory", NULL);
        return;
    }
    http_respond(c, status, type, "Cache-Control: no-store\r\n", text, len);
    free(text);
}

/* ---- the global model ------------------------------------------------------------------------ */

/* "bytes=a-b" | "bytes=a-" | "bytes=-n" (one range).  1: range set; 0: ignore the header (absent,
 * malformed or several ranges: the whole file is sent, as RFC 9110 allows); -1: unsatisfiable. */
int api_parse_range(const char *h, uint64_t size, uint64_t *from, uint64_t *len)
{
    const char *p;
    char *end;
    uint64_t a, b;

    if (h == NULL || strncasecmp(h, "bytes=", 6) != 0 || strchr(h, ',') != NULL)
        return 0;
    p = h + 6;
    while (*p == ' ')
        p++;
    if (*p == '-') {
        errno = 0;
        b = strtoull(p + 1, &end, 10);
        if (p[1] < '0' || p[1] > '9' || errno != 0 || (*end != '\0' && *end != ' '))
            return 0;
        if (b == 0 || size == 0)
            return -1;
        if (b > size)
            b = size;
        *from = size - b;
        *len = b;
        return 1;
    }
    if (*p < '0' || *p > '9')
        return 0;
    errno = 0;
    a = strtoull(p, &end, 10);
    if (errno != 0 || *end != '-')
        return 0;
    p = end + 1;
    if (*p == '\0' || *p == ' ') {
        b = size ? size - 1 : 0;
    } else {
        if (*p < '0' || *p > '9')
            return 0;
        b = strtoull(p, &end, 10);
        if (errno != 0 || (*end != '\0' && *end != ' ') || b < a)
            return 0;
    }
    if (a >= size)
        return -1;
    if (b >= size)
        b = size - 1;
    *from = a;
    *len = b - a + 1;
    return 1;
}

/* If-None-Match: "*" or a list of (possibly weak, W/"...") tags; ours is unique per committed file. */
static int etag_matches(const char *inm, const char *etag)
{
    if (inm == NULL || etag[0] == '\0')
        return 0;
    return strcmp(inm, "*") == 0 || strstr(inm, etag) != NULL;
}

/* Sends one file of the served global (whole, a Range of it, or 304 for a matching ETag). */
static void serve_file(http_conn *c, http_request *req, uint64_t step, const served_file *f, const char *type)
{
    char extra[256];
    uint64_t from = 0, len;
    int r;

    if (etag_matches(http_header_get(req, "if-none-match"), f->etag)) {
        snprintf(extra, sizeof(extra), "ETag: %s\r\nX-Outer-Step: %" PRIu64 "\r\n", f->etag, step);
        http_respond(c, 304, NULL, extra, NULL, 0);
        return;
    }
    len = f->size;
    r = api_parse_range(http_header_get(req, "range"), f->size, &from, &len);
    if (r < 0) {
        snprintf(extra, sizeof(extra), "Content-Range: bytes */%" PRIu64 "\r\n", f->size);
        static const char body[] =
            "{\"error\":{\"code\":\"range_not_satisfiable\",\"message\":\"range outside the file\"}}\n";
        http_respond(c, 416, "application/json", extra, body, sizeof(body) - 1);
        return;
    }
    if (r == 1)
        snprintf(extra, sizeof(extra),
                 "ETag: %s\r\nAccept-Ranges: bytes\r\nX-Outer-Step: %" PRIu64 "\r\nContent-Range: bytes %" PRIu64
                 "-%" PRIu64 "/%" PRIu64 "\r\n",
                 f->etag, step, from, from + len - 1, f->size);
    else
        snprintf(extra, sizeof(extra), "ETag: %s\r\nAccept-Ranges: bytes\r\nX-Outer-Step: %" PRIu64 "\r\n", f->etag,
                 step);
    /* the response holds its own reference: a commit that replaces d->global does not cut it short */
    http_respond_file(c, r == 1 ? 206 : 200, type, extra, f->file, from, len);
}

/* GET /global/<file>: the plain latest.safetensors, or (a global above --shard-size) the index and
 * its shards, named as the transports publish them. */
static void serve_global(dilocod *d, http_conn *c, http_request *req)
{
    const served_global *g = daemon__global(d);
    const char *name = req->path + strlen("/global/");
    char base[ST_INDEX_BASE_MAX + 1];
    uint32_t i = 0, n = 0;
    st_name_kind kind = st_index_classify(name, strlen(name), base, &i, &n);

    if (kind == ST_NAME_OTHER || strcmp(base, "latest") != 0) {
        http_respond_error(c, 404, "not_found",
                           "the global is /global/latest.safetensors, or above the shard size "
                           "/global/latest.safetensors.index.json and the shards it lists",
                           NULL);
        return;
    }
    if (!g->available) {
        http_respond_error(c, 503, "no_global", "no global model yet", NULL);
        return;
    }
    if (g->single.file != NULL && kind == ST_NAME_SINGLE)
        return serve_file(c, req, g->step, &g->single, "application/octet-stream");
    if (g->index.file != NULL && kind == ST_NAME_INDEX)
        return serve_file(c, req, g->step, &g->index, "application/json");
    if (g->index.file != NULL && kind == ST_NAME_SHARD && n == g->nshards && i < n)
        return serve_file(c, req, g->step, &g->shards[i], "application/octet-stream");
    http_respond_error(c, 404, "not_found",
                       g->single.file != NULL ? "the global is not sharded: GET /global/latest.safetensors"
                       : kind == ST_NAME_SINGLE
                           ? "the global is sharded (above the shard size): GET /global/latest.safetensors.index.json "
                             "and the shards it lists"
                           : "no such shard of the global: its index lists them",
                       NULL);
}

static void serve_stepfile(dilocod *d, http_conn *c)
{
    /* the step whose files GET /global/ sends (a sharded step is served once its set is written) */
    const served_global *g = daemon__global(d);
    char when[48], *text;
    struct tm tm;
    time_t t = d->committed_at;

    if (!d->st.committed || !g->available) {
        http_respond_error(c, 503, "no_global", "no global model yet", NULL);
        return;
    }
    gmtime_r(&t, &tm);
    strftime(when, sizeof(when), "%Y-%m-%dT%H:%M:%S+00:00", &tm);
    text = stepcount_build(g->step, config_optimizer_name(d->cfg->optimizer), d->st.bootstrap && g->step == 0,
                           g->index.file != NULL, when);
    if (text == NULL) {
        http_respond_error(c, 500, "out_of_memory", "out of memory", NULL);
        return;
    }
    http_respond(c, 200, "application/json", "Cache-Control: no-cache\r\n", text, strlen(text));
    free(text);
}

/* ---- routing ----------------------------------------------------------------------------------- */

static int method_is(const http_request *r, const char *m)
{
    return strcmp(r->method_name, m) == 0;
}

void api_not_allowed(http_conn *c, const char *allow)
{
    char extra[64], msg[96];
    snprintf(extra, sizeof(extra), "Allow: %s\r\n", allow);
    snprintf(msg, sizeof(msg), "{\"error\":{\"code\":\"method_not_allowed\",\"message\":\"allowed: %s\"}}\n", allow);
    http_respond(c, 405, "application/json", extra, msg, strlen(msg));
}

/* ---- handlers (one per route) ------------------------------------------------------------------ */

static void get_dashboard(dilocod *d, http_conn *c, http_request *req)
{
    (void)d;
    (void)req;
    /* self-contained: the page talks to this server only */
    http_respond_static(c, 200, "text/html; charset=utf-8",
                        "Cache-Control: no-cache\r\nX-Content-Type-Options: nosniff\r\n"
                        "Content-Security-Policy: default-src 'self'; style-src 'self' 'unsafe-inline'; "
                        "script-src 'self' 'unsafe-inline'; img-src 'self' data:\r\n",
                        (const char *)dashboard_html, dashboard_html_len);
}

static void healthz_json(dilocod *d, sbuf *b)
{
    sb_fmt(b, "{\"status\":\"ok\",\"state\":\"%s\"}\n", d->stopping ? "stopping" : daemon__state_name(daemon__state(d)));
}

static void get_stepfile(dilocod *d, http_conn *c, http_request *req)
{
    (void)req;
    serve_stepfile(d, c);
}

/* ---- the route table --------------------------------------------------------------------------- */

typedef void (*route_handler)(dilocod *d, http_conn *c, http_request *req);
typedef void (*document_builder)(dilocod *d, sbuf *b);

/* A row: the path, how it is counted, and either a handler or a document built fresh per request
 * (sent 200, Cache-Control: no-store). */
typedef struct route {
    const char *path;           /* exact path, or a prefix when it ends with '/' (and is not "/") */
    stats_route id;             /* what /metrics counts it as */
    int read_only;              /* GET and HEAD only (else the handler checks methods itself) */
    route_handler handler;
    document_builder document;
    const char *type;           /* the document's Content-Type */
} route;

#define JSON "application/json"
static const route routes[] = {
    {"/", ROUTE_DASHBOARD, 1, get_dashboard, NULL, NULL},
    {"/index.html", ROUTE_DASHBOARD, 1, get_dashboard, NULL, NULL},
    {"/status", ROUTE_STATUS, 1, NULL, status_json, JSON},
    {"/healthz", ROUTE_HEALTHZ, 1, NULL, healthz_json, JSON},
    {"/metrics", ROUTE_METRICS, 1, NULL, metrics_text, "text/plain; version=0.0.4; charset=utf-8"},
    {"/rounds", ROUTE_ROUNDS, 1, NULL, rounds_json, JSON},
    {"/global/step_count.json", ROUTE_STEPFILE, 1, get_stepfile, NULL, NULL},
    {"/global/", ROUTE_GLOBAL, 1, serve_global, NULL, NULL},
    {"/nodes/", ROUTE_UPLOAD, 0, upload_route, NULL, NULL},
};
#undef JSON

static const route *route_find(const char *path)
{
    for (size_t i = 0; i < sizeof(routes) / sizeof(routes[0]); i++) {
        const route *r = &routes[i];
        size_t n = strlen(r->path);
        int prefix = n > 1 && r->path[n - 1] == '/';
        if (prefix ? strncmp(path, r->path, n) == 0 : strcmp(path, r->path) == 0)
            return r;
    }
    return NULL;
}

void api_on_request(http_conn *c, http_request *req, void *app)
{
    dilocod *d = app;
    const route *r = route_find(req->path);

    if (r == NULL) {
        http_conn_set_route(c, ROUTE_OTHER);
        http_respond_error(c, 404, "not_found", "no such resource", NULL);
        return;
    }
    http_conn_set_route(c, r->id);
    if (r->read_only && !method_is(req, "GET") && !method_is(req, "HEAD"))
        return api_not_allowed(c, "GET, HEAD");
    if (r->document != NULL) {
        sbuf b = {0};
        r->document(d, &b);
        respond_sbuf(c, 200, r->type, &b);
        return;
    }
    r->handler(d, c, req);
}
