#include "stats.h"

#include <stddef.h>

#include "util.h"

const char *const stats_route_names[ROUTE__COUNT] = {
    [ROUTE_STATUS] = "status",     [ROUTE_HEALTHZ] = "healthz", [ROUTE_METRICS] = "metrics",
    [ROUTE_ROUNDS] = "rounds",     [ROUTE_GLOBAL] = "global",   [ROUTE_STEPFILE] = "step_count",
    [ROUTE_UPLOAD] = "upload",     [ROUTE_DASHBOARD] = "dashboard", [ROUTE_NODE] = "node", [ROUTE_OTHER] = "other",
};

const char *const stats_refusal_names[REFUSED__COUNT] = {
    [REFUSED_STALE] = "stale", [REFUSED_FUTURE] = "future", [REFUSED_NOT_NEWER] = "not_newer",
    [REFUSED_UNKNOWN_NODE] = "unknown_node", [REFUSED_FULL] = "round_full", [REFUSED_BUSY] = "busy", [REFUSED_OUTLIER] = "outlier", [REFUSED_NO_WEIGHT] = "missing_weight",
};

const double stats_agg_bounds[STATS_AGG_BUCKETS] = {0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300};

const int stats_http_codes[STATS_HTTP_CODES] = {200, 201, 204, 206, 304, 400, 401, 403, 404, 405, 408, 409,
                                                411, 413, 414, 416, 417, 422, 431, 500, 503, 507, 0, 0};

_Static_assert(COUNT_OF(stats_route_names) == ROUTE__COUNT, "a route without a name");
_Static_assert(COUNT_OF(stats_refusal_names) == REFUSED__COUNT, "a refusal without a name");

static int code_index(int status)
{
    for (int i = 0; i < STATS_HTTP_CODES - 1 && stats_http_codes[i] != 0; i++)
        if (stats_http_codes[i] == status)
            return i;
    return STATS_HTTP_CODES - 1;
}

void stats_http_response(stats *s, int route, int status)
{
    if (route < 0 || route >= ROUTE__COUNT)
        route = ROUTE_OTHER;
    s->http[route][code_index(status)]++;
}

void stats_delta_taken(stats *s, round_verdict v)
{
    if (v == ROUND_REPLACED)
        s->deltas_replaced++;
    else
        s->deltas_accepted++;
}

void stats_delta_rejected(stats *s, dl_code code)
{
    if ((unsigned)code < DL_E__COUNT)
        s->rejected[code]++;
}

stats_refusal stats_delta_refused(stats *s, round_verdict v)
{
    stats_refusal r;
    switch (v) {
    case ROUND_STALE: r = REFUSED_STALE; break;
    case ROUND_FUTURE: r = REFUSED_FUTURE; break;
    case ROUND_NOT_NEWER: r = REFUSED_NOT_NEWER; break;
    case ROUND_UNKNOWN_NODE: r = REFUSED_UNKNOWN_NODE; break;
    case ROUND_FULL: r = REFUSED_FULL; break;
    case ROUND_BUSY: r = REFUSED_BUSY; break;
    case ROUND_OUTLIER: r = REFUSED_OUTLIER; break;
    case ROUND_NO_WEIGHT: r = REFUSED_NO_WEIGHT; break;
    default: return REFUSED__COUNT;
    }
    s->refused[r]++;
    return r;
}

void stats_round_committed(stats *s, double seconds)
{
    s->rounds++;
    s->agg_seconds_sum += seconds;
    s->agg_count++;
    for (int i = 0; i < STATS_AGG_BUCKETS; i++)
        s->agg_buckets[i] += seconds <= stats_agg_bounds[i];
}

void stats_index_parsed(stats *s)
{
    s->index_parses++;
}

uint64_t stats_rejected_total(const stats *s)
{
    uint64_t t = 0;
    for (int c = 0; c < DL_E__COUNT; c++)
        t += s->rejected[c];
    return t;
}

void stats_upload_received(stats *s, uint64_t bytes)
{
    s->upload_bytes += bytes;
}
