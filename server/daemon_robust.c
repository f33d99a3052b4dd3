/* Robust aggregation beside the round (README, "Robust aggregation"): the norm screen that quarantines
 * a delta whose L2 norm (intake's, delta_norm.h) is above --max-norm, or above --max-norm-ratio times
 * the median norm of its round; the per-delta scales of weighted_mean (weights capped by
 * --max-weight-ratio) and clipped_mean; the cosine screen's verdicts after its first pass; the
 * quarantined deltas' record, and their /status and /metrics provider.
 *
 * Every median here is taken over a set that holds the judged delta's own figure.  The median of
 * the *others* (what this file once took) hands a minority the screen: with 3 nodes an honest delta's
 * others are one honest and one faulty norm, half of them the attacker's, and their lower median is
 * the attacker's 2e-20, so both honest deltas were quarantined and the attacker's aggregated alone.
 * With its own figure in, the set has N values of which fewer than half are a minority's, and its
 * median lies between two honest values whichever way the minority lies (the median's breakdown point
 * of 1/2; robust rules that compare an update with a reference it is part of: Karimireddy, He & Jaggi,
 * "Learning from History for Byzantine Robust Optimization" (centered clipping, ICML 2021); Andrew et
 * al., "Differentially Private Learning with Adaptive Clipping" (the clipping bound a quantile of every
 * update's norm, NeurIPS 2021)).  Only large norms are bounded: a small one moves the global little,
 * and an honest node that ran fewer local steps (async mode's DyLU recommends it) sends one.
 *
 * The median of an even count is the lower one, as torch.median's and the median rule's.  That choice
 * only matters when exactly half the nodes lie: then the lower median lets tiny norms stall a step
 * (the honest deltas quarantined or clipped down), where the upper one would let huge norms through
 * unbounded, which a step cannot take back.
 *
 * The norm screen's set, in this order of preference:
 *   - "round": the deltas of the open round, the judged one's in place of its node's (sync; at the
 *     close over all of them), or in async mode each other node's last aggregated norm and the judged
 *     one.  At an arrival, each expected node not in yet counts as a norm above every other, so that
 *     the deltas in first (the attacker's, when it hurries) never make the median: a delta refused at
 *     its arrival is one the full round would have quarantined too, whatever the others send (a sync
 *     round without --expected-nodes is judged at its close only);
 *   - "trailing": the node's own last ROBUST_TRAIL aggregated norms and the judged one, when there are
 *     no others;
 *   - none: only --max-norm applies (the first delta of the first round). */
#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "daemon_internal.h"
#include "daemon_parts.h"
#include "dl_log.h"
#include "weights.h"

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* The lower median of v[0 .. n) and `unknown` more values above all of them (n + unknown > 0): +inf
 * when it falls among the unknown ones.  v is sorted in place. */
static double lower_median_of(double *v, size_t n, size_t unknown)
{
    size_t at = (n + unknown - 1) / 2;

    qsort(v, n, sizeof(*v), cmp_double);
    return at < n ? v[at] : INFINITY;
}

static double lower_median(double *v, size_t n)
{
    return lower_median_of(v, n, 0);
}

static robust_node *find_node(const daemon_robust *r, const char *node_id)
{
    for (size_t i = 0; i < r->n; i++)
        if (strcmp(r->nodes[i].node_id, node_id) == 0)
            return &r->nodes[i];
    return NULL;
}

/* The node's record, made (the least recently seen replaced when the table is full); NULL without memory. */
static robust_node *node_for(daemon_robust *r, const char *node_id, double now)
{
    robust_node *e = find_node(r, node_id);

    if (e == NULL) {
        if (r->n == r->cap && r->cap < ROBUST_NODES_MAX) {
            size_t cap = r->cap ? r->cap * 2 : 16;
            robust_node *v = realloc(r->nodes, cap * sizeof(*v));
            if (v == NULL)
                return NULL;
            r->nodes = v;
            r->cap = cap;
        }
        if (r->n < r->cap) {
            e = &r->nodes[r->n++];
        } else {
            e = &r->nodes[0];
            for (size_t i = 1; i < r->n; i++)
                if (r->nodes[i].seen_at < e->seen_at)
                    e = &r->nodes[i];
        }
        memset(e, 0, sizeof(*e));
        snprintf(e->node_id, sizeof(e->node_id), "%s", node_id);
    }
    e->seen_at = now;
    return e;
}

static double last_trail(const robust_node *e)
{
    return e->trail[(e->head + ROBUST_TRAIL - 1) % ROBUST_TRAIL];
}

/* The norms of the other nodes the ratio compares a delta of node_id with (module comment), into v (at
 * least max(round entries, nodes, ROBUST_TRAIL) + 1 long); *basis names them. */
static size_t other_norms(const dilocod *d, const char *node_id, double *v, const char **basis)
{
    size_t n = 0;

    if (!daemon__async(d)) {
        for (size_t i = 0; i < d->rnd.n; i++) {
            const round_entry *e = &d->rnd.entries[i];
            if (e->has_norm && strcmp(e->node_id, node_id) != 0)
                v[n++] = e->norm;
        }
    } else {
        for (size_t i = 0; i < d->robust.n; i++) {
            const robust_node *e = &d->robust.nodes[i];
            if (e->ntrail > 0 && strcmp(e->node_id, node_id) != 0)
                v[n++] = last_trail(e);
        }
    }
    *basis = "round";
    if (n > 0)
        return n;
    const robust_node *self = find_node(&d->robust, node_id);
    *basis = "trailing";
    for (unsigned i = 0; self != NULL && i < self->ntrail; i++)
        v[n++] = self->trail[i];
    return n;
}

/* The median the ratio multiplies for a delta of norm from node_id, its own norm among the set
 * (module comment); +inf when there is nothing to compare with yet.  closing: the sync close's
 * verdict over the whole round, where no node is still to come. */
static int reference_median(const dilocod *d, const char *node_id, double norm, int closing, double *median,
                            const char **basis)
{
    size_t cap = d->rnd.n + d->robust.n + ROBUST_TRAIL + 1, unknown = 0;
    double *v = malloc(cap * sizeof(*v));

    if (v == NULL)
        return -ENOMEM;
    size_t n = other_norms(d, node_id, v, basis);
    if (n == 0) {
        free(v);
        *median = INFINITY;
        return 0;
    }
    v[n++] = norm;
    /* the expected nodes not in yet, at an arrival: neither a trailing basis (the node's own past) nor
     * a set larger than the expected count has any.  A sync round without an expected count could be
     * outvoted by any number still to come: its close alone judges (async mode requires the count,
     * config.c) */
    if (!closing && strcmp(*basis, "round") == 0) {
        if (d->cfg->expected_nodes == 0 && !daemon__async(d)) {
            free(v);
            *median = INFINITY;
            return 0;
        }
        if (d->cfg->expected_nodes > n)
            unknown = d->cfg->expected_nodes - n;
    }
    *median = lower_median_of(v, n, unknown);
    free(v);
    return 0;
}

/* Whether a delta of norm from node_id is quarantined; fills reason, bound and basis. */
static int judge(const dilocod *d, const char *node_id, double norm, int closing, const char **reason,
                 double *bound, const char **basis)
{
    const config *c = d->cfg;
    double median;

    if (c->max_norm > 0 && norm > c->max_norm) {
        *reason = "max_norm";
        *bound = c->max_norm;
        *basis = "absolute";
        return 1;
    }
    if (c->max_norm_ratio <= 0)
        return 0;
    if (reference_median(d, node_id, norm, closing, &median, basis) != 0 || !isfinite(median))
        return 0;               /* nothing to compare with (or no memory for it): the absolute bound stood */
    *bound = c->max_norm_ratio * median;
    *reason = "norm_ratio";
    return norm > *bound;
}

static int reason_index(const char *reason)
{
    return strcmp(reason, "max_norm") == 0   ? ROBUST_MAX_NORM
           : strcmp(reason, "cosine") == 0   ? ROBUST_COSINE
           : strcmp(reason, "overflow") == 0 ? ROBUST_OVERFLOW
                                             : ROBUST_NORM_RATIO;
}

/* Counts, remembers and logs (once: each delta is judged once) a quarantined delta. */
static void record(dilocod *d, const char *node_id, uint64_t local_step, double norm, double bound,
                   const char *reason, const char *basis)
{
    daemon_robust *r = &d->robust;
    robust_event *e = &r->recent[(r->head + r->nrecent) % ROBUST_RECENT];
    char qn[160];

    if (r->nrecent == ROBUST_RECENT)
        r->head = (r->head + 1) % ROBUST_RECENT;
    else
        r->nrecent++;
    memset(e, 0, sizeof(*e));
    snprintf(e->node_id, sizeof(e->node_id), "%s", node_id);
    e->step = d->rnd.step;
    e->local_step = local_step;
    e->norm = norm;
    e->bound = bound;
    snprintf(e->reason, sizeof(e->reason), "%s", reason);
    snprintf(e->basis, sizeof(e->basis), "%s", basis);
    e->at = daemon__wall_of(daemon__clock());     /* to the ms: a round record keeps it as the arrival */
    r->quarantined[reason_index(reason)]++;
    dl_log(DL_LOG_WARN, "robust", "delta quarantined: not aggregated",
           "step=%" PRIu64 " node=%s local_step=%" PRIu64 " reason=%s %s=%.9g bound=%.9g basis=%s", d->rnd.step,
           dl_log_q(qn, sizeof(qn), node_id), local_step, reason, strcmp(reason, "cosine") == 0 ? "cosine" : "norm",
           norm, bound, basis);
}

int daemon__robust_screen_offer(dilocod *d, const delta_info *info)
{
    const char *reason = NULL, *basis = NULL;
    double bound = 0;

    if (!info->has_norm || !judge(d, info->node_id, info->norm, 0, &reason, &bound, &basis))
        return 0;
    record(d, info->node_id, info->local_step, info->norm, bound, reason, basis);
    return 1;
}

static void quarantine_entry(dilocod *d, round_entry *e, double value, double bound, const char *reason,
                             const char *basis)
{
    e->quarantined = 1;
    e->quarantine_bound = bound;
    snprintf(e->quarantine_reason, sizeof(e->quarantine_reason), "%s", reason);
    record(d, e->node_id, e->local_step, value, bound, reason, basis);
    char msg[200];
    if (strcmp(reason, "cosine") == 0)
        snprintf(msg, sizeof(msg), "quarantined at the round's close: cosine %.6g to the median below %.6g", value,
                 bound);
    else if (strcmp(reason, "overflow") == 0)
        snprintf(msg, sizeof(msg), "quarantined at the round's close: the largest norm (%.9g) of a step that "
                 "overflowed", value);
    else
        snprintf(msg, sizeof(msg), "quarantined at the round's close: L2 norm %.9g above the bound %.9g (%s, %s)",
                 value, bound, reason, basis);
    daemon__verdict_quarantined(d, e, reason, msg);
}

void daemon__robust_screen_close(dilocod *d)
{
    const char *reason = NULL, *basis = NULL;
    double bound = 0;
    int *bad;

    if (daemon__async(d) || (d->cfg->max_norm <= 0 && d->cfg->max_norm_ratio <= 0) || d->rnd.n == 0)
        return;
    /* every verdict against the same round, then applied: independent of the order */
    if ((bad = calloc(d->rnd.n, sizeof(*bad))) == NULL)
        return;
    double *bounds = calloc(d->rnd.n, sizeof(*bounds));
    const char **reasons = calloc(d->rnd.n, sizeof(*reasons)), **bases = calloc(d->rnd.n, sizeof(*bases));
    for (size_t i = 0; bounds != NULL && reasons != NULL && bases != NULL && i < d->rnd.n; i++) {
        const round_entry *e = &d->rnd.entries[i];
        if (e->quarantined || !e->has_norm)
            continue;
        bad[i] = judge(d, e->node_id, e->norm, 1, &reason, &bound, &basis);
        bounds[i] = bound;
        reasons[i] = reason;
        bases[i] = basis;
    }
    for (size_t i = 0; bounds != NULL && reasons != NULL && bases != NULL && i < d->rnd.n; i++)
        if (bad[i])
            quarantine_entry(d, &d->rnd.entries[i], d->rnd.entries[i].norm, bounds[i], reasons[i], bases[i]);
    free(bad);
    free(bounds);
    free((void *)reasons);
    free((void *)bases);
}

void daemon__robust_cosine(dilocod *d, round_entry *e, double cosine)
{
    if (cosine < d->cfg->screen_cosine)
        quarantine_entry(d, e, cosine, d->cfg->screen_cosine, "cosine", "median");
}

void daemon__robust_overflow(dilocod *d, round_entry *e, double norm)
{
    quarantine_entry(d, e, norm, 0, "overflow", "largest");
}

int daemon__robust_weighable(const dilocod *d, const delta_info *info)
{
    return d->cfg->aggregate != RULE_WEIGHTED || weights_of(&info->metrics) > 0;
}

/* weighted_mean's a_k (README): core/weights.c's definition, over the round's deltas in node order. */
static int weighted_scales(const dilocod *d, const round_entry *const *e, size_t n, float *scale)
{
    double *w = malloc((n ? n : 1) * sizeof(*w));

    if (w == NULL)
        return -ENOMEM;
    for (size_t k = 0; k < n; k++)
        w[k] = weights_of(&e[k]->metrics);
    int rc = weights_scales(w, n, d->cfg->max_weight_ratio, scale);
    free(w);
    return rc;
}

/* clipped_mean's s_k = min(1, m / n_k) (README), m the lower median of the update's norms (each delta's
 * own among them, as the norm screen's).  An async update holds one delta (or a grace batch): its own
 * norm alone would clip nothing, so the set also has each other node's last aggregated norm, the norm
 * screen's reference in async mode. */
static int clipped_scales(const dilocod *d, const round_entry *const *e, size_t n, float *scale)
{
    size_t cap = n + (daemon__async(d) ? d->robust.n : 0), nv = 0;
    double *v = malloc((cap ? cap : 1) * sizeof(*v)), m;

    if (v == NULL)
        return -ENOMEM;
    for (size_t k = 0; k < n; k++)
        if (e[k]->has_norm)
            v[nv++] = e[k]->norm;
    for (size_t i = 0; daemon__async(d) && i < d->robust.n; i++) {
        const robust_node *r = &d->robust.nodes[i];
        size_t k = 0;
        while (k < n && strcmp(e[k]->node_id, r->node_id) != 0)
            k++;
        if (k == n && r->ntrail > 0)
            v[nv++] = last_trail(r);
    }
    m = nv > 0 ? lower_median(v, nv) : 0;
    free(v);
    for (size_t k = 0; k < n; k++)
        scale[k] = e[k]->has_norm && e[k]->norm > 0 ? (float)fmin(1.0, m / e[k]->norm) : 1.0f;
    return 0;
}

int daemon__robust_scales(const dilocod *d, const round_entry *const *e, size_t n, float *scale)
{
    if (d->cfg->aggregate == RULE_WEIGHTED)
        return weighted_scales(d, e, n, scale);
    if (d->cfg->aggregate == RULE_CLIPPED)
        return clipped_scales(d, e, n, scale);
    for (size_t k = 0; k < n; k++)
        scale[k] = 1.0f;
    return 0;
}

void daemon__robust_aggregated(dilocod *d, const node_stat *nodes, size_t n)
{
    double now = daemon__now(d);

    for (size_t k = 0; k < n; k++) {
        if (!(nodes[k].intake_norm >= 0))
            continue;           /* not known (NaN): a set taken back from the cache at a restart */
        robust_node *e = node_for(&d->robust, nodes[k].node_id, now);
        if (e == NULL)
            return;
        e->trail[e->head] = nodes[k].intake_norm;
        e->head = (e->head + 1) % ROBUST_TRAIL;
        if (e->ntrail < ROBUST_TRAIL)
            e->ntrail++;
    }
}

void daemon__robust_load(dilocod *d)
{
    for (size_t i = 0; i < history_count(&d->history); i++) {
        const round_record *r = history_get(&d->history, i);
        daemon__robust_aggregated(d, r->nodes, r->n);
    }
}

const robust_event *daemon__robust_last(const dilocod *d, const char *node_id)
{
    const daemon_robust *r = &d->robust;
    for (size_t i = r->nrecent; i > 0; i--) {
        const robust_event *e = &r->recent[(r->head + i - 1) % ROBUST_RECENT];
        if (strcmp(e->node_id, node_id) == 0)
            return e;
    }
    return NULL;
}

void daemon__robust_free(dilocod *d)
{
    free(d->robust.nodes);
    memset(&d->robust, 0, sizeof(d->robust));
}

/* ---- /status and /metrics ------------------------------------------------------------------------ */

static void opt_num(sbuf *b, const char *key, double v)
{
    sb_printf(b, ",\"%s\":", key);
    if (v > 0)
        daemon_json_num(b, v);
    else
        sb_str(b, "null");
}

static void robust_status(const dilocod *d, sbuf *b)
{
    const daemon_robust *r = &d->robust;
    const config *c = d->cfg;
    uint64_t total = 0;

    for (int i = 0; i < ROBUST_REASONS; i++)
        total += r->quarantined[i];
    if (c->aggregate == RULE_TRIMMED)
        sb_printf(b, ",\"robust\":{\"aggregate\":\"trimmed_mean:%u\"", c->trim_k);
    else
        sb_printf(b, ",\"robust\":{\"aggregate\":\"%s\"", config_rule_name(c->aggregate));
    if (c->screen) {
        sb_str(b, ",\"screen\":\"cosine:");
        sb_printf(b, "%.17g\"", c->screen_cosine);
    } else {
        sb_str(b, ",\"screen\":null");
    }
    opt_num(b, "max_norm_ratio", c->max_norm_ratio);
    opt_num(b, "max_norm", c->max_norm);
    opt_num(b, "max_weight_ratio", c->max_weight_ratio);
    sb_printf(b, ",\"quarantined_total\":%" PRIu64 ",\"quarantined_by_reason\":{\"max_norm\":%" PRIu64
                 ",\"norm_ratio\":%" PRIu64 ",\"cosine\":%" PRIu64 ",\"overflow\":%" PRIu64 "},\"quarantined\":[",
              total, r->quarantined[ROBUST_MAX_NORM], r->quarantined[ROBUST_NORM_RATIO], r->quarantined[ROBUST_COSINE],
              r->quarantined[ROBUST_OVERFLOW]);
    for (size_t i = 0; i < r->nrecent; i++) {
        const robust_event *e = &r->recent[(r->head + i) % ROBUST_RECENT];
        /* a cosine quarantine's figure is its cosine, "norm" null */
        sb_printf(b, "%s{\"node_id\":\"%s\",\"step\":%" PRIu64 ",\"local_step\":%" PRIu64 ",\"%s\":", i ? "," : "",
                  e->node_id, e->step, e->local_step, strcmp(e->reason, "cosine") == 0 ? "norm\":null,\"cosine" : "norm");
        daemon_json_num_exact(b, e->norm);
        sb_str(b, ",\"bound\":");
        daemon_json_num_exact(b, e->bound);
        sb_printf(b, ",\"reason\":\"%s\",\"basis\":\"%s\",\"at\":%.0f}", e->reason, e->basis, e->at);
    }
    sb_str(b, "]}");
}

static void robust_metrics(const dilocod *d, sbuf *b)
{
    static const char *const names[ROBUST_REASONS] = {"max_norm", "norm_ratio", "cosine", "overflow"};

    daemon_metric_family(b, "deltas_quarantined_total", "counter",
                         "Deltas quarantined (not aggregated) by the norm or cosine screen or an overflowed step, by reason");
    for (int i = 0; i < ROBUST_REASONS; i++)
        sb_printf(b, "dilocod_deltas_quarantined_total{reason=\"%s\"} %" PRIu64 "\n", names[i],
                  d->robust.quarantined[i]);
}

const daemon_provider daemon__robust_provider = {"robust", robust_status, robust_metrics};
