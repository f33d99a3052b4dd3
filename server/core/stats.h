/* stats: the one owner of dilocod's counters.  /status, /metrics and the dashboard all read them
 * from here, so they cannot disagree; every module that has something to count calls a stats_
 * function instead of touching a field.
 *
 * Deltas are counted the same way whatever brought them (an HTTP upload, the file:// tree, the Hub):
 * a delta is either accepted (first of its node in the round), replaced (a newer one of the same
 * node), rejected (invalid: by error code) or refused (valid, but the round cannot take it: by
 * reason).  HTTP responses are counted by route and exact status code as the engine sends them
 * (http_server_on_response), the engine's own 400/408/413/431 and the 401/403 of auth included. */
#ifndef STATS_H
#define STATS_H

#include <stdint.h>

#include "dl_error.h"
#include "round.h"

typedef enum stats_route {
    ROUTE_STATUS, ROUTE_HEALTHZ, ROUTE_METRICS, ROUTE_ROUNDS, ROUTE_GLOBAL, ROUTE_STEPFILE, ROUTE_UPLOAD,
    ROUTE_DASHBOARD, ROUTE_NODE, ROUTE_OTHER, ROUTE__COUNT
} stats_route;

typedef enum stats_refusal {
    REFUSED_STALE, REFUSED_FUTURE, REFUSED_NOT_NEWER, REFUSED_UNKNOWN_NODE, REFUSED_FULL, REFUSED_BUSY, REFUSED_OUTLIER, REFUSED_NO_WEIGHT, REFUSED__COUNT
} stats_refusal;

#define STATS_AGG_BUCKETS 12
#define STATS_HTTP_CODES 24     /* the statuses the server sends (stats_http_codes) and "other" */

typedef struct stats {
    uint64_t deltas_accepted, deltas_replaced;
    uint64_t rounds_all_quarantined;                /* rounds whose every delta was quarantined: not committed */
    uint64_t rounds_overflowed;                     /* rounds discarded: no subset of their deltas made a finite step */
    uint64_t deltas_rewritten;                      /* taken in, then rewritten in place: dropped, taken again */
    uint64_t rejected[DL_E__COUNT];                 /* by error code */
    uint64_t refused[REFUSED__COUNT];
    uint64_t upload_bytes;
    uint64_t rounds;
    double agg_seconds_sum;
    uint64_t agg_count;
    uint64_t agg_buckets[STATS_AGG_BUCKETS];        /* cumulative counts for stats_agg_bounds */
    uint64_t http[ROUTE__COUNT][STATS_HTTP_CODES];  /* [route][index of the status in stats_http_codes] */
    uint64_t publish_errors;
    uint64_t index_parses;                          /* sharded deltas' indexes intake read and parsed */
} stats;

extern const char *const stats_route_names[ROUTE__COUNT];
extern const char *const stats_refusal_names[REFUSED__COUNT];
extern const double stats_agg_bounds[STATS_AGG_BUCKETS];
/* The status codes counted one by one (0 ends the list; index STATS_HTTP_CODES - 1 is "other"). */
extern const int stats_http_codes[STATS_HTTP_CODES];

void stats_http_response(stats *s, int route, int status);
void stats_delta_taken(stats *s, round_verdict v);          /* ROUND_ACCEPTED or ROUND_REPLACED */
void stats_delta_rejected(stats *s, dl_code code);
/* A verdict other than accepted/replaced; returns its refusal (REFUSED__COUNT if it was not one). */
stats_refusal stats_delta_refused(stats *s, round_verdict v);
void stats_round_committed(stats *s, double seconds);
void stats_upload_received(stats *s, uint64_t bytes);      /* delta bytes an HTTP upload received */
void stats_index_parsed(stats *s);
uint64_t stats_rejected_total(const stats *s);

#endif
