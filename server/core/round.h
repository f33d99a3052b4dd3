/* round: membership of the current outer round.  Pure state, no I/O, so it is unit-tested directly.
 *
 * A delta belongs to round s iff its base_outer_step == s; one delta per node, a higher local_step
 * replaces a lower one until the round closes; stale (< s) and future (> s) deltas are refused and
 * counted.  The round closes when every expected node delivered, or when round_timeout has passed
 * since the first accepted delta and at least min_nodes are present. */
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
} round_verdict;

typedef enum round_close_reason { ROUND_OPEN = 0, ROUND_ALL_NODES, ROUND_TIMEOUT } round_close_reason;

typedef struct round_counters {
    uint64_t accepted, replaced, not_newer, stale, future, unknown_node, full, rejected;
} round_counters;

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
} round_state;

void round_init(round_state *r, uint64_t step, unsigned expected_nodes, char **allow, size_t nallow, unsigned min_nodes,
                double timeout);
/* Offers a validated delta.  On ROUND_ACCEPTED/ROUND_REPLACED the round takes ownership of path
 * (and *replaced_path receives the path it drops, for the caller to delete; else NULL). */
round_verdict round_offer(round_state *r, const delta_info *info, char *path, uint64_t size, double now,
                          char **replaced_path);
/* Marks node's entry as guarded: a link to a file others may rewrite, validated as version id. */
void round_guard(round_state *r, const char *node_id, const fsu_ident *id);
/* Removes node's entry (a delta rewritten in place since it was taken in) and opens the round again;
 * *path receives the entry's path for the caller to delete.  0, or -1 when the node has none. */
int round_drop(round_state *r, const char *node_id, char **path);
/* Counts a delta refused before it reached the round: by intake's base check (ROUND_STALE or
 * ROUND_FUTURE), or rejected by validation (round_count_rejected). */
void round_count_refused(round_state *r, round_verdict v);
void round_count_rejected(round_state *r);
/* What round_offer would answer for a delta of info now, changing nothing (uploads ask before the
 * body arrives, so a refused delta costs its header only). */
round_verdict round_peek(const round_state *r, const delta_info *info);
const char *round_verdict_name(round_verdict v);
/* Whether the round should close now; fills *reason. */
int round_should_close(const round_state *r, double now, round_close_reason *reason);
/* Seconds until the timeout rule could close the round (<0: no deadline yet or none). */
double round_deadline(const round_state *r);
const char *round_close_reason_name(round_close_reason r);
const round_entry *round_find(const round_state *r, const char *node_id);
/* Frees the entries (not the allow-list), then starts round step with the same rules and counters. */
void round_reset(round_state *r, uint64_t step);
void round_free(round_state *r);

#endif
