#include "workers.h"

#include <stdio.h>
#include <string.h>

void workers_init(workers *w)
{
    memset(w, 0, sizeof(*w));
}

/* Where node_id is, or would be sorted in; whether it is there. */
static int locate(const workers *w, const char *node_id, size_t *at)
{
    int c = 1;

    *at = 0;
    while (*at < w->n && (c = strcmp(w->w[*at].node_id, node_id)) < 0)
        (*at)++;
    return *at < w->n && c == 0;
}

/* The entry of node_id, made (sorted in, the least recent forgotten when full) when create. */
static worker_report *entry(workers *w, const char *node_id, int create)
{
    size_t at;

    if (locate(w, node_id, &at))
        return &w->w[at];
    if (!create)
        return NULL;
    if (w->n == WORKERS_MAX) {
        size_t old = 0;
        for (size_t i = 1; i < w->n; i++)
            if (w->w[i].seen < w->w[old].seen)
                old = i;
        memmove(&w->w[old], &w->w[old + 1], (w->n - old - 1) * sizeof(w->w[0]));
        w->n--;
        w->dropped_nodes++;
        if (old < at)
            at--;
    }
    memmove(&w->w[at + 1], &w->w[at], (w->n - at) * sizeof(w->w[0]));
    memset(&w->w[at], 0, sizeof(w->w[at]));
    snprintf(w->w[at].node_id, sizeof(w->w[at].node_id), "%s", node_id);
    w->n++;
    return &w->w[at];
}

/* Whether name is one of the table's names, registering it while there is room. */
static int name_kept(workers *w, const char *name)
{
    for (size_t i = 0; i < w->nnames; i++)
        if (strcmp(w->names[i], name) == 0)
            return 1;
    if (w->nnames == WORKERS_NAMES_MAX)
        return 0;
    snprintf(w->names[w->nnames++], sizeof(w->names[0]), "%s", name);
    return 1;
}

static void set_latest(workers *w, worker_report *e, uint64_t base, uint64_t local_step, time_t at,
                       const delta_metrics *m, const cz_spec *cz, uint64_t bytes)
{
    e->cz = *cz;
    e->bytes = bytes;
    e->base_outer_step = base;
    e->local_step = local_step;
    e->at = at;
    e->seen = ++w->clock;
    e->metrics = *m;
    e->metrics.nnamed = 0;
    for (size_t i = 0; i < m->nnamed; i++) {
        if (name_kept(w, m->name[i]))
            (void)delta_metrics_add(&e->metrics, m->name[i], strlen(m->name[i]), m->value[i]);
        else
            w->dropped_names++;
    }
}

void workers_report(workers *w, const char *node_id, uint64_t base, uint64_t local_step, time_t at,
                    const delta_metrics *m, const cz_spec *cz, uint64_t bytes)
{
    set_latest(w, entry(w, node_id, 1), base, local_step, at, m, cz, bytes);
    if ((unsigned)cz->enc <= CZ_MXFP4) {
        w->wire_bytes[cz->enc] += bytes;
        w->wire_deltas[cz->enc]++;
    }
}

void workers_committed(workers *w, const round_record *r, int latest)
{
    for (size_t i = 0; i < r->n; i++) {
        const node_stat *s = &r->nodes[i];
        worker_report *e = entry(w, s->node_id, latest);
        if (e == NULL)
            continue;           /* forgotten since its delta was taken: its tokens stay in the history */
        if (latest)
            set_latest(w, e, r->async ? s->base_outer_step : r->step, s->local_step, r->closed_at, &s->metrics, &s->cz,
                       s->bytes);
        /* saturating: a worker reports any num_tokens up to 2^64 - 1, and a wrapped sum made the
         * counter dilocod_node_tokens_total go down (a Prometheus counter never does) */
        if ((s->metrics.have & DELTA_M_NUM_TOKENS) &&
            __builtin_add_overflow(e->tokens_total, s->metrics.num_tokens, &e->tokens_total))
            e->tokens_total = UINT64_MAX;
    }
}

const worker_report *workers_find(const workers *w, const char *node_id)
{
    size_t at;
    return locate(w, node_id, &at) ? &w->w[at] : NULL;
}
