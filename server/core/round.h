/* round: membership of the current outer round.  Pure state, no I/O, so it is unit-tested directly.
 *
 * A delta belongs to round s iff its base_outer_step == s; one delta per node, a higher local_step
 * replaces a lower one until the round closes; stale (< s) and future (> s) deltas are refused and
 * counted.  The round closes when every expected node delivered, or when round_timeout has passed
 * since the first accepted delta and at least min_nodes are present.
 *
 * Asynchronous mode (round_init_async): the round is the next update.  A delta based on any committed
 * step within max_staleness of the current one is taken (tau = step - base_outer_step, fixed at
 * acceptance with its weight), several of one node alike, never replaced: in (node_id, base, local_step)
 * order.  The update closes grace seconds after its first delta.  A delta that arrives while the update
 * is closed (its pass runs) is queued, in arrival order, for the next one: round_reset moves the queued
 * deltas within grace of the first of them into the new update.  Beyond queue_max deltas waiting (the
 * open update's and the queue's) a delta is refused ROUND_BUSY, to be sent again later. */
#ifndef ROUND_H
#define ROUND_H

#include <stddef.h>
#include <stdint.h>

#include "delta.h"
#include "fsutil.h"

typedef struct round_entry {
    char node_id[DELTA_NODE_ID_MAX + 1];
    uint64_t local_step;
    uint64_t size;
    double received_at;         /* seconds, caller's clock */
    char *path;                 /* the validated copy in the cache (owned) */
    uint64_t base;              /* base_outer_step */
    uint64_t tau;               /* async: staleness at acceptance (the committed step - base) */
    double weight;              /* async: its staleness weight */
    double norm;                /* the delta's L2 norm as intake read it (delta_norm.h), when has_norm */
    int has_norm;
    /* robust aggregation: set when the round closed (daemon_robust.c), the entry then not aggregated */
    int quarantined;
    char quarantine_reason[16];
    double quarantine_bound;
    delta_metrics metrics;      /* what the worker reported in the delta's metadata */
    cz_spec cz;                 /* its encoding (compress.h): CZ_NONE for a plain delta */
    int guarded;                /* path is a link to a file others may rewrite in place: ident is the version
                                   that was validated, checked again before and after the pass */
    fsu_ident ident;
} round_entry;

typedef enum round_verdict {
    ROUND_ACCEPTED,             /* first delta of this node in the round */
    ROUND_REPLACED,             /* a higher local_step replaced the node's delta */
    ROUND_NOT_NEWER,            /* the node already delivered this or a higher local_step */
    ROUND_STALE,                /* base_outer_step < current step, or the round already closed */
    ROUND_FUTURE,               /* base_outer_step > current step */
    ROUND_UNKNOWN_NODE,         /* not in the --nodes allow-list */
    ROUND_FULL,                 /* expected_nodes distinct nodes already delivered */
    ROUND_QUEUED,               /* async: taken, for the update after the one being computed */
    ROUND_BUSY,                 /* async: queue_max deltas already wait: send it again later */
    ROUND_OUTLIER,              /* quarantined by the norm screen (daemon_robust.c): never offered to the round */
    ROUND_NO_WEIGHT,            /* --aggregate weighted_mean and the delta reports neither weight nor num_tokens */
} round_verdict;

typedef enum round_close_reason { ROUND_OPEN = 0, ROUND_ALL_NODES, ROUND_TIMEOUT, ROUND_GRACE } round_close_reason;

typedef struct round_counters {
    uint64_t accepted, replaced, not_newer, stale, future, unknown_node, full, rejected, queued, busy, outlier, no_weight;
} round_counters;

/* A taken delta: the round (or the queue) owns its path. */
static inline int round_verdict_taken(round_verdict v)
{
    return v == ROUND_ACCEPTED || v == ROUND_REPLACED || v == ROUND_QUEUED;
}

/* Asynchronous mode's staleness weight of tau: 1 (constant) or (1 + tau)^-1/2 (poly). */
double round_staleness_weight(int poly, uint64_t tau);
#define ROUND_NO_STALENESS_BOUND UINT64_MAX

typedef struct round_state {
    uint64_t step;
    round_entry *entries;       /* sorted by node_id (ascending bytes): the aggregation order */
    size_t n, cap;
    double first_at;            /* when the first delta was accepted; < 0 when none */
    int closed;
    /* rules */
    unsigned expected_nodes;    /* 0: no count (close by timeout) */
    char **allow;               /* borrowed allow-list, may be NULL */
    size_t nallow;
    unsigned min_nodes;
    double timeout;             /* 0: none */
    round_counters counters;    /* since the process started, across rounds */
    /* asynchronous mode (round_init_async) */
    int async;
    uint64_t max_staleness;     /* ROUND_NO_STALENESS_BOUND: none */
    int poly_weight;
    double grace;               /* seconds */
    size_t queue_max;
    round_entry *queue;         /* arrival order */
    size_t nqueue, qcap;
} round_state;

void round_init(round_state *r, uint64_t step, unsigned expected_nodes, char **allow, size_t nallow, unsigned min_nodes,
                double timeout);
/* Asynchronous mode, after round_init (whose timeout and min_nodes it replaces). */
void round_init_async(round_state *r, uint64_t max_staleness, int poly_weight, double grace, size_t queue_max);
/* Deltas waiting for an update: the open update's (not while it is computed) and the queue's. */
size_t round_pending(const round_state *r);
/* Offers a validated delta.  When round_verdict_taken the round takes ownership of path (and
 * *replaced_path receives the path it drops, for the caller to delete; else NULL).  recovered: a delta
 * the cache held at a restart, taken before it (async: its staleness is not bounded again). */
round_verdict round_offer(round_state *r, const delta_info *info, char *path, uint64_t size, double now, int recovered,
                          char **replaced_path);
/* Marks info's entry (in the round or the queue) as guarded: a link to a file others may rewrite,
 * validated as version id. */
void round_guard(round_state *r, const delta_info *info, const fsu_ident *id);
/* Removes entry i (a delta rewritten in place since it was taken in) and opens the round again;
 * *path receives the entry's path for the caller to delete. */
void round_drop_at(round_state *r, size_t i, char **path);
/* Counts a delta refused before it reached the round: by intake's base check (ROUND_STALE or
 * ROUND_FUTURE), or rejected by validation (round_count_rejected). */
void round_count_refused(round_state *r, round_verdict v);
void round_count_rejected(round_state *r);
/* What round_offer would answer for a delta of info now, changing nothing (uploads ask before the
 * body arrives, so a refused delta costs its header only). */
round_verdict round_peek(const round_state *r, const delta_info *info);
const char *round_verdict_name(round_verdict v);
/* The HTTP status an upload refused with v is answered (0 for a verdict that takes the delta). */
int round_verdict_http_status(round_verdict v);
/* Whether the round should close now; fills *reason. */
int round_should_close(const round_state *r, double now, round_close_reason *reason);
/* Seconds until the timeout rule could close the round (<0: no deadline yet or none). */
double round_deadline(const round_state *r);
const char *round_close_reason_name(round_close_reason r);
/* Whether node_id has a delta in the round. */
int round_has_node(const round_state *r, const char *node_id);
/* The entry of info's delta (sync: of its node) in the round, or NULL. */
const round_entry *round_find(const round_state *r, const delta_info *info);
/* Frees the entries (not the allow-list), then starts round step with the same rules and counters;
 * async: the queued deltas within grace of the first of them join it. */
void round_reset(round_state *r, uint64_t step);
void round_free(round_state *r);

#endif
