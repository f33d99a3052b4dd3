#include "round.h"

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

static void entries_free(round_state *r)
{
    for (size_t i = 0; i < r->n; i++)
        free(r->entries[i].path);
    free(r->entries);
    r->entries = NULL;
    r->n = r->cap = 0;
}

void round_reset(round_state *r, uint64_t step)
{
    entries_free(r);
    r->step = step;
    r->first_at = -1;
    r->closed = 0;
}

void round_free(round_state *r)
{
    entries_free(r);
}

/* Index of node_id in the sorted entries, or -(insertion point) - 1. */
static long find_index(const round_state *r, const char *node_id)
{
    size_t lo = 0, hi = r->n;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        int c = strcmp(r->entries[mid].node_id, node_id);
        if (c == 0)
            return (long)mid;
        if (c < 0)
            lo = mid + 1;
        else
            hi = mid;
    }
    return -(long)lo - 1;
}

const round_entry *round_find(const round_state *r, const char *node_id)
{
    long i = find_index(r, node_id);
    return i >= 0 ? &r->entries[i] : NULL;
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
static round_verdict judge(const round_state *r, const delta_info *info, long *at)
{
    *at = -1;
    if (info->base_outer_step < r->step || (info->base_outer_step == r->step && r->closed))
        return ROUND_STALE;
    if (info->base_outer_step > r->step)
        return ROUND_FUTURE;
    if (!allowed(r, info->node_id))
        return ROUND_UNKNOWN_NODE;
    *at = find_index(r, info->node_id);
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

round_verdict round_offer(round_state *r, const delta_info *info, char *path, uint64_t size, double now,
                          char **replaced_path)
{
    long i;
    round_verdict v = judge(r, info, &i);

    *replaced_path = NULL;
    if (v == ROUND_REPLACED) {
        round_entry *e = &r->entries[i];
        *replaced_path = e->path;
        e->path = path;
        e->guarded = 0;
        e->local_step = info->local_step;
        e->size = size;
        e->received_at = now;
    }
    if (v != ROUND_ACCEPTED) {
        count(r, v);
        return v;
    }
    if (r->n == r->cap) {
        size_t nc = r->cap ? r->cap * 2 : 8;
        round_entry *ne = realloc(r->entries, nc * sizeof(*ne));
        if (ne == NULL) {
            r->counters.full++;         /* cannot hold it: refuse rather than lose state */
            return ROUND_FULL;
        }
        r->entries = ne;
        r->cap = nc;
    }
    size_t at = (size_t)(-i - 1);
    memmove(&r->entries[at + 1], &r->entries[at], (r->n - at) * sizeof(*r->entries));
    round_entry *e = &r->entries[at];
    memset(e, 0, sizeof(*e));
    memcpy(e->node_id, info->node_id, sizeof(e->node_id));
    e->local_step = info->local_step;
    e->size = size;
    e->received_at = now;
    e->path = path;
    r->n++;
    if (r->first_at < 0)
        r->first_at = now;
    r->counters.accepted++;
    return ROUND_ACCEPTED;
}

void round_guard(round_state *r, const char *node_id, const fsu_ident *id)
{
    long i = find_index(r, node_id);
    if (i >= 0) {
        r->entries[i].guarded = 1;
        r->entries[i].ident = *id;
    }
}

int round_drop(round_state *r, const char *node_id, char **path)
{
    long i = find_index(r, node_id);

    *path = NULL;
    if (i < 0)
        return -1;
    *path = r->entries[i].path;
    memmove(&r->entries[i], &r->entries[i + 1], (r->n - (size_t)i - 1) * sizeof(*r->entries));
    r->n--;
    r->closed = 0;
    if (r->n == 0)
        r->first_at = -1;
    return 0;
}

int round_should_close(const round_state *r, double now, round_close_reason *reason)
{
    *reason = ROUND_OPEN;
    if (r->closed || r->n == 0)
        return 0;
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
    if (r->timeout <= 0 || r->first_at < 0)
        return -1;
    return r->first_at + r->timeout;
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
    }
    return "?";
}

const char *round_close_reason_name(round_close_reason r)
{
    switch (r) {
    case ROUND_ALL_NODES: return "all_nodes";
    case ROUND_TIMEOUT: return "timeout";
    default: return "open";
    }
}
