#include "round.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

void round_init(round_state *r, uint64_t step, unsigned expected_nodes, char **allow, size_t nallow, unsigned min_nodes,
                double timeout)
{
    memset(r, 0, sizeof(*r));
    r->step = step;
    r->first_at = -1;
    r->expected_nodes = expected_nodes;
    r->allow = allow;
    r->nallow = nallow;
    r->min_nodes = min_nodes ? min_nodes : 1;
    r->timeout = timeout;
}

void round_init_async(round_state *r, uint64_t max_staleness, int poly_weight, double grace, size_t queue_max)
{
    r->async = 1;
    r->max_staleness = max_staleness;
    r->poly_weight = poly_weight;
    r->grace = grace;
    r->queue_max = queue_max ? queue_max : 1;
    r->timeout = 0;
    r->min_nodes = 1;
}

double round_staleness_weight(int poly, uint64_t tau)
{
    return poly ? 1.0 / sqrt(1.0 + (double)tau) : 1.0;
}

static void entries_free(round_state *r)
{
    for (size_t i = 0; i < r->n; i++)
        free(r->entries[i].path);
    free(r->entries);
    r->entries = NULL;
    r->n = r->cap = 0;
}

static int grow(round_entry **v, size_t n, size_t *cap)
{
    if (n < *cap)
        return 0;
    size_t nc = *cap ? *cap * 2 : 8;
    round_entry *ne = realloc(*v, nc * sizeof(*ne));
    if (ne == NULL)
        return -1;
    *v = ne;
    *cap = nc;
    return 0;
}

static long find_index(const round_state *r, const char *node_id, uint64_t base, uint64_t local_step);

/* Inserts e in the entries' order (its key is not there: a queued delta is never in the round). */
static int insert_entry(round_state *r, const round_entry *e, long i)
{
    if (grow(&r->entries, r->n, &r->cap) != 0)
        return -1;
    size_t at = (size_t)(-i - 1);
    memmove(&r->entries[at + 1], &r->entries[at], (r->n - at) * sizeof(*r->entries));
    r->entries[at] = *e;
    r->n++;
    if (r->first_at < 0 || e->received_at < r->first_at)
        r->first_at = e->received_at;
    return 0;
}

/* Async: the queued deltas accepted within grace of the first queued one join the new update; the
 * others stay queued, in order. */
static void take_queued(round_state *r)
{
    size_t moved = 0;

    if (r->nqueue == 0)
        return;
    double cut = r->queue[0].received_at + r->grace;
    while (moved < r->nqueue && r->queue[moved].received_at <= cut) {
        const round_entry *e = &r->queue[moved];
        if (insert_entry(r, e, find_index(r, e->node_id, e->base, e->local_step)) != 0)
            break;              /* no memory: the rest waits for the next update */
        moved++;
    }
    memmove(r->queue, r->queue + moved, (r->nqueue - moved) * sizeof(*r->queue));
    r->nqueue -= moved;
}

void round_reset(round_state *r, uint64_t step)
{
    entries_free(r);
    r->step = step;
    r->first_at = -1;
    r->closed = 0;
    if (r->async)
        take_queued(r);
}

void round_free(round_state *r)
{
    entries_free(r);
    for (size_t i = 0; i < r->nqueue; i++)
        free(r->queue[i].path);
    free(r->queue);
    r->queue = NULL;
    r->nqueue = r->qcap = 0;
}

size_t round_pending(const round_state *r)
{
    return (r->closed ? 0 : r->n) + r->nqueue;
}

/* The entries' order: sync, by node_id (one entry per node); async, by node_id, base, local_step. */
static int entry_cmp(const round_state *r, const round_entry *e, const char *node_id, uint64_t base,
                     uint64_t local_step)
{
    int c = strcmp(e->node_id, node_id);
    if (c != 0 || !r->async)
        return c;
    if (e->base != base)
        return e->base < base ? -1 : 1;
    return e->local_step < local_step ? -1 : e->local_step > local_step;
}

/* Index of the key in the sorted entries, or -(insertion point) - 1. */
static long find_index(const round_state *r, const char *node_id, uint64_t base, uint64_t local_step)
{
    size_t lo = 0, hi = r->n;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        int c = entry_cmp(r, &r->entries[mid], node_id, base, local_step);
        if (c == 0)
            return (long)mid;
        if (c < 0)
            lo = mid + 1;
        else
            hi = mid;
    }
    return -(long)lo - 1;
}

const round_entry *round_find(const round_state *r, const delta_info *info)
{
    long i = find_index(r, info->node_id, info->base_outer_step, info->local_step);
    return i >= 0 ? &r->entries[i] : NULL;
}

int round_has_node(const round_state *r, const char *node_id)
{
    for (size_t i = 0; i < r->n; i++)
        if (strcmp(r->entries[i].node_id, node_id) == 0)
            return 1;
    return 0;
}

static long find_queued(const round_state *r, const delta_info *info)
{
    for (size_t i = 0; i < r->nqueue; i++)
        if (strcmp(r->queue[i].node_id, info->node_id) == 0 && r->queue[i].base == info->base_outer_step &&
            r->queue[i].local_step == info->local_step)
            return (long)i;
    return -1;
}

static int allowed(const round_state *r, const char *node_id)
{
    if (r->nallow == 0)
        return 1;
    for (size_t i = 0; i < r->nallow; i++) {
        if (strcmp(r->allow[i], node_id) == 0)
            return 1;
    }
    return 0;
}

/* The round's rules, in one place: what a delta of info would get now (*at: its entry's index if the
 * node has one, else -(insertion point) - 1).  Changes nothing. */
static round_verdict judge_async(const round_state *r, const delta_info *info, int recovered, long *at)
{
    *at = -1;
    if (info->base_outer_step > r->step)
        return ROUND_FUTURE;
    if (!recovered && r->max_staleness != ROUND_NO_STALENESS_BOUND && r->step - info->base_outer_step > r->max_staleness)
        return ROUND_STALE;
    if (!allowed(r, info->node_id))
        return ROUND_UNKNOWN_NODE;
    *at = find_index(r, info->node_id, info->base_outer_step, info->local_step);
    if (*at >= 0 || find_queued(r, info) >= 0)
        return ROUND_NOT_NEWER;         /* this very delta is taken already */
    /* a restart's cached deltas were acknowledged before it: never refused for room */
    if (!recovered && round_pending(r) >= r->queue_max)
        return ROUND_BUSY;
    return r->closed ? ROUND_QUEUED : ROUND_ACCEPTED;
}

static round_verdict judge(const round_state *r, const delta_info *info, long *at)
{
    *at = -1;
    if (r->async)
        return judge_async(r, info, 0, at);
    if (info->base_outer_step < r->step || (info->base_outer_step == r->step && r->closed))
        return ROUND_STALE;
    if (info->base_outer_step > r->step)
        return ROUND_FUTURE;
    if (!allowed(r, info->node_id))
        return ROUND_UNKNOWN_NODE;
    *at = find_index(r, info->node_id, 0, 0);
    if (*at >= 0)
        return info->local_step <= r->entries[*at].local_step ? ROUND_NOT_NEWER : ROUND_REPLACED;
    if (r->expected_nodes != 0 && r->n >= r->expected_nodes)
        return ROUND_FULL;
    return ROUND_ACCEPTED;
}

round_verdict round_peek(const round_state *r, const delta_info *info)
{
    long at;
    return judge(r, info, &at);
}

static void count(round_state *r, round_verdict v)
{
    switch (v) {
    case ROUND_STALE: r->counters.stale++; break;
    case ROUND_FUTURE: r->counters.future++; break;
    case ROUND_UNKNOWN_NODE: r->counters.unknown_node++; break;
    case ROUND_NOT_NEWER: r->counters.not_newer++; break;
    case ROUND_REPLACED: r->counters.replaced++; break;
    case ROUND_FULL: r->counters.full++; break;
    case ROUND_ACCEPTED: r->counters.accepted++; break;
    case ROUND_QUEUED: r->counters.queued++; break;
    case ROUND_BUSY: r->counters.busy++; break;
    case ROUND_OUTLIER: r->counters.outlier++; break;
    case ROUND_NO_WEIGHT: r->counters.no_weight++; break;
    }
}

void round_count_refused(round_state *r, round_verdict v)
{
    count(r, v);
}

void round_count_rejected(round_state *r)
{
    r->counters.rejected++;
}

round_verdict round_offer(round_state *r, const delta_info *info, char *path, uint64_t size, double now, int recovered,
                          char **replaced_path)
{
    long i;
    round_verdict v = r->async ? judge_async(r, info, recovered, &i) : judge(r, info, &i);

    *replaced_path = NULL;
    if (v == ROUND_REPLACED) {
        round_entry *e = &r->entries[i];
        *replaced_path = e->path;
        e->path = path;
        e->guarded = 0;
        e->local_step = info->local_step;
        e->size = size;
        e->received_at = now;
        e->norm = info->norm;
        e->has_norm = info->has_norm;
        e->metrics = info->metrics;
        e->cz = info->cz;
    }
    if (v != ROUND_ACCEPTED && v != ROUND_QUEUED) {
        count(r, v);
        return v;
    }
    round_entry e;
    memset(&e, 0, sizeof(e));
    memcpy(e.node_id, info->node_id, sizeof(e.node_id));
    e.local_step = info->local_step;
    e.base = info->base_outer_step;
    e.tau = r->step - info->base_outer_step;
    e.weight = round_staleness_weight(r->poly_weight, e.tau);
    e.size = size;
    e.received_at = now;
    e.metrics = info->metrics;
    e.cz = info->cz;
    e.path = path;
    e.norm = info->norm;
    e.has_norm = info->has_norm;
    if (v == ROUND_QUEUED) {
        if (grow(&r->queue, r->nqueue, &r->qcap) != 0) {
            r->counters.busy++;         /* cannot hold it: refuse rather than lose state */
            return ROUND_BUSY;
        }
        r->queue[r->nqueue++] = e;
        r->counters.queued++;
        return ROUND_QUEUED;
    }
    if (insert_entry(r, &e, i) != 0) {
        r->counters.full++;             /* cannot hold it: refuse rather than lose state */
        return r->async ? ROUND_BUSY : ROUND_FULL;
    }
    r->counters.accepted++;
    return ROUND_ACCEPTED;
}

void round_guard(round_state *r, const delta_info *info, const fsu_ident *id)
{
    long i = find_index(r, info->node_id, info->base_outer_step, info->local_step);
    round_entry *e = i >= 0 ? &r->entries[i] : NULL;

    if (e == NULL && r->async && (i = find_queued(r, info)) >= 0)
        e = &r->queue[i];
    if (e != NULL) {
        e->guarded = 1;
        e->ident = *id;
    }
}

void round_drop_at(round_state *r, size_t i, char **path)
{
    *path = r->entries[i].path;
    memmove(&r->entries[i], &r->entries[i + 1], (r->n - (size_t)i - 1) * sizeof(*r->entries));
    r->n--;
    r->closed = 0;
    if (r->n == 0 || r->async)
        r->first_at = -1;
    for (size_t k = 0; r->async && k < r->n; k++)       /* async: grace runs from the first one left */
        if (r->first_at < 0 || r->entries[k].received_at < r->first_at)
            r->first_at = r->entries[k].received_at;
}

int round_should_close(const round_state *r, double now, round_close_reason *reason)
{
    *reason = ROUND_OPEN;
    if (r->closed || r->n == 0)
        return 0;
    if (r->async) {
        if (now - r->first_at < r->grace)
            return 0;
        *reason = ROUND_GRACE;
        return 1;
    }
    if (r->expected_nodes != 0 && r->n >= r->expected_nodes) {
        *reason = ROUND_ALL_NODES;
        return 1;
    }
    if (r->timeout > 0 && now - r->first_at >= r->timeout && r->n >= r->min_nodes) {
        *reason = ROUND_TIMEOUT;
        return 1;
    }
    return 0;
}

double round_deadline(const round_state *r)
{
    if (r->async)
        return r->first_at < 0 ? -1 : r->first_at + r->grace;
    if (r->timeout <= 0 || r->first_at < 0)
        return -1;
    return r->first_at + r->timeout;
}

int round_verdict_http_status(round_verdict v)
{
    switch (v) {
    case ROUND_ACCEPTED:
    case ROUND_REPLACED:
    case ROUND_QUEUED:
        return 0;
    case ROUND_UNKNOWN_NODE:
        return 403;
    case ROUND_OUTLIER:
    case ROUND_NO_WEIGHT:
        return 422;
    case ROUND_BUSY:
        return 503;
    default:
        return 409;
    }
}

const char *round_verdict_name(round_verdict v)
{
    switch (v) {
    case ROUND_ACCEPTED: return "accepted";
    case ROUND_REPLACED: return "replaced";
    case ROUND_NOT_NEWER: return "not_newer";
    case ROUND_STALE: return "stale";
    case ROUND_FUTURE: return "future";
    case ROUND_UNKNOWN_NODE: return "unknown_node";
    case ROUND_FULL: return "round_full";
    case ROUND_QUEUED: return "queued";
    case ROUND_BUSY: return "busy";
    case ROUND_OUTLIER: return "outlier";
    case ROUND_NO_WEIGHT: return "missing_weight";
    }
    return "?";
}

const char *round_close_reason_name(round_close_reason r)
{
    switch (r) {
    case ROUND_ALL_NODES: return "all_nodes";
    case ROUND_TIMEOUT: return "timeout";
    case ROUND_GRACE: return "grace";
    default: return "open";
    }
}
