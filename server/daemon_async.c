/* Asynchronous mode (--mode async, README "Asynchronous mode"): what the daemon keeps beside the round
 * for it (d->async).  The round (core/round.c) takes each delta with its staleness and weight and
 * closes an update after the grace window; here: the Delayed Nesterov parameters of the next update
 * (from the committed step's phase k and the update's deltas), each node's speed and the local steps
 * recommended to it (Dynamic Local Updates), the staleness histogram, and their parts of /status and
 * /metrics.  Nothing here runs in sync mode. */
#include "daemon_internal.h"
#include "daemon_parts.h"

#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <xxhash.h>

#include "dl_log.h"
#include "hub.h"
#include "round.h"
#include "strbuf.h"

/* The bucket of a staleness: 0, 1, 2, 3, 4-7, 8-15, 16-31, 32-63, 64 and more. */
static size_t tau_bucket(uint64_t tau)
{
    size_t b = 0;

    if (tau < 4)
        return (size_t)tau;
    for (b = 4; b < ASYNC_TAU_BUCKETS - 1 && tau >= (4u << (b - 3)); b++)
        ;
    return b;
}

static const char *const tau_le[ASYNC_TAU_BUCKETS] = {"0", "1", "2", "3", "7", "15", "31", "63", "+Inf"};

/* The node's record, made when first seen; NULL when the table is full of nodes seen more recently
 * (the least recently seen one goes for a new node, so an attacker's many ids cannot pin it). */
static async_node *node_of(dilocod *d, const char *node_id, double now)
{
    daemon_async *a = &d->async;
    size_t oldest = 0;

    for (size_t i = 0; i < a->n; i++) {
        if (strcmp(a->nodes[i].node_id, node_id) == 0)
            return &a->nodes[i];
        if (a->nodes[i].last_at < a->nodes[oldest].last_at)
            oldest = i;
    }
    if (a->n == a->cap && a->cap < ASYNC_NODES_MAX) {
        size_t nc = a->cap ? a->cap * 2 : 16;
        async_node *nn = realloc(a->nodes, nc * sizeof(*nn));
        if (nn != NULL) {
            a->nodes = nn;
            a->cap = nc;
        }
    }
    async_node *e;
    if (a->n < a->cap) {
        e = &a->nodes[a->n++];
    } else if (a->n > 0 && a->nodes[oldest].last_at < now) {
        e = &a->nodes[oldest];
    } else {
        return NULL;
    }
    memset(e, 0, sizeof(*e));
    snprintf(e->node_id, sizeof(e->node_id), "%s", node_id);
    e->last_at = -1;
    return e;
}

/* Dynamic Local Updates from bounded evidence (README "Asynchronous mode"): one worker's claim (its
 * local_step, when it sends) must not set the others' recommendations.  A node's measured jump is
 * clamped by --dylu-base-steps, or else by DYLU_CLAMP times the median node's; its speed by DYLU_CLAMP
 * times the median node's speed; a measure counts for DYLU_TTL_FACTOR times its own interval (at least
 * DYLU_TTL_MIN seconds) after its delta; and a recommendation lies in [max(1, H_base / DYLU_MIN_DIV),
 * H_base]. */
#define DYLU_CLAMP 2.0
#define DYLU_TTL_FACTOR 16.0
#define DYLU_TTL_MIN 300.0
#define DYLU_MIN_DIV 16

/* Whether e's measure still counts at now. */
static int measure_live(const async_node *e, double now)
{
    if (e->speed <= 0)
        return 0;
    double ttl = DYLU_TTL_FACTOR * e->interval;
    return now - e->last_at <= (ttl > DYLU_TTL_MIN ? ttl : DYLU_TTL_MIN);
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* The lower median of the live measures' jumps (jumps = 1) or speeds (jumps = 0); 0 when none.  The
 * lower one: a minority of high claims never moves it up. */
static double median_of(const dilocod *d, int jumps, double now)
{
    const daemon_async *a = &d->async;
    double *v = a->n > 0 ? malloc(a->n * sizeof(*v)) : NULL;
    size_t k = 0;
    double m = 0;

    if (v == NULL)
        return 0;               /* none, or no memory: no clamp by the median this time */
    for (size_t i = 0; i < a->n; i++)
        if (measure_live(&a->nodes[i], now))
            v[k++] = jumps ? (double)a->nodes[i].steps_per_delta : a->nodes[i].speed;
    if (k > 0) {
        qsort(v, k, sizeof(*v), cmp_double);
        m = v[(k - 1) / 2];
    }
    free(v);
    return m;
}

void daemon__async_accepted(dilocod *d, const delta_info *info, uint64_t tau, double now)
{
    daemon_async *a = &d->async;
    async_node *e = node_of(d, info->node_id, now);

    a->tau_hist[tau_bucket(tau)]++;
    a->tau_sum += (double)tau;
    a->accepted++;
    if (e == NULL)
        return;
    /* speed: local steps per second between its last two deltas (a worker that started again from a
     * lower local_step starts a new measure); the jump clamped by --dylu-base-steps before it makes a
     * speed (by the median node when the recommendations are computed: dylu_of) */
    if (e->last_at >= 0 && info->local_step > e->last_local_step && now > e->last_at) {
        uint64_t jump = info->local_step - e->last_local_step;
        if (d->cfg->dylu_base_steps != 0 && jump > d->cfg->dylu_base_steps)
            jump = d->cfg->dylu_base_steps;     /* no node is told more: more is a claim, not evidence */
        e->steps_per_delta = jump;
        e->interval = now - e->last_at;
        e->speed = (double)jump / e->interval;
    } else if (e->last_at >= 0 && info->local_step <= e->last_local_step) {
        e->speed = 0;
        e->steps_per_delta = 0;
    }
    e->last_local_step = info->local_step;
    e->last_at = now;
    e->last_tau = tau;
    e->deltas++;
}

/* What the recommendations are computed from, once per call: the speed cap, the fastest live speed
 * under it, and H_base (a jump counts up to DYLU_CLAMP times the median node's). */
typedef struct dylu_view {
    double now, cap, top;       /* top 0: no live measure */
    uint64_t base;
} dylu_view;

/* A live measure's speed under the cap (0: none). */
static double capped_speed(const dylu_view *v, const async_node *e)
{
    if (!measure_live(e, v->now))
        return 0;
    return v->cap > 0 && e->speed > v->cap ? v->cap : e->speed;
}

/* H_base: --dylu-base-steps, or the most local steps per delta a live measure ran (its jump clamped:
 * above).  Not the fastest node's own: with workers that follow the recommendation, the node that is
 * fastest by the noise of one measure may be one told fewer steps, and the base would only shrink. */
static dylu_view dylu_of(const dilocod *d)
{
    dylu_view v = {.now = daemon__now((dilocod *)d)};
    double jump_cap = DYLU_CLAMP * median_of(d, 1, v.now);

    v.cap = DYLU_CLAMP * median_of(d, 0, v.now);
    for (size_t i = 0; i < d->async.n; i++) {
        const async_node *e = &d->async.nodes[i];
        double s = capped_speed(&v, e);
        uint64_t jump = (double)e->steps_per_delta > jump_cap ? (uint64_t)jump_cap : e->steps_per_delta;
        if (s > v.top)
            v.top = s;
        if (s > 0 && jump > v.base)
            v.base = jump;
    }
    if (d->cfg->dylu_base_steps != 0)
        v.base = d->cfg->dylu_base_steps;
    return v;
}

/* H_w = floor(v_w / v_max * H_base) within [max(1, H_base / DYLU_MIN_DIV), H_base]; a node without a
 * live measure gets H_base. */
static uint64_t recommend(const dylu_view *v, const async_node *e)
{
    uint64_t h = v->base, lo = v->base / DYLU_MIN_DIV > 1 ? v->base / DYLU_MIN_DIV : 1;
    double s = e != NULL ? capped_speed(v, e) : 0;

    if (h == 0)
        return 0;
    if (s <= 0 || v->top <= 0)
        return h;
    double r = floor(s / v->top * (double)h);
    return r < (double)lo ? lo : r > (double)h ? h : (uint64_t)r;
}

uint64_t daemon__async_recommended(const dilocod *d, const char *node_id)
{
    const async_node *e = NULL;

    if (!daemon__async(d))
        return 0;
    for (size_t i = 0; i < d->async.n && e == NULL; i++)
        if (strcmp(d->async.nodes[i].node_id, node_id) == 0)
            e = &d->async.nodes[i];
    dylu_view v = dylu_of(d);
    return recommend(&v, e);
}

/* The update the closing round makes: its weight is the mean of its deltas' (in double, in the round's
 * order), its phase the committed step's (a sync step's is 0). */
void daemon__async_update(const dilocod *d, store_dn *dn)
{
    double sum = 0;

    memset(dn, 0, sizeof(*dn));
    if (!daemon__async(d))
        return;
    for (size_t i = 0; i < d->rnd.n; i++)
        sum += d->rnd.entries[i].weight;
    dn->on = 1;
    dn->period = d->cfg->dn_period;
    dn->k = d->st.dn.on ? d->st.dn.k : 0;
    dn->paper = d->cfg->dn_paper;
    dn->c = d->cfg->dn_c;
    dn->weight = d->rnd.n > 0 ? sum / (double)d->rnd.n : 1.0;
}

/* The DN state a step is committed with: the phase after the update dn made. */
store_dn daemon__async_after(const store_dn *dn)
{
    store_dn after = *dn;

    after.k = dn->k + 1 >= dn->period ? 0 : dn->k + 1;
    after.weight = 0;
    return after;
}

void daemon__async_committed(dilocod *d, const store_dn *dn)
{
    if (!dn->on)
        return;
    d->async.updates++;
    if (dn->k + 1 >= dn->period)
        d->async.nesterov_steps++;
}

/* ---- the deltas applied ---------------------------------------------------------------------- */

static uint64_t delta_key(const char *node_id, uint64_t base, uint64_t local_step)
{
    char buf[DELTA_NODE_ID_MAX + 1 + 16];
    size_t n = strlen(node_id);

    memcpy(buf, node_id, n + 1);
    memcpy(buf + n + 1, &base, 8);
    memcpy(buf + n + 9, &local_step, 8);
    uint64_t h = XXH64(buf, n + 17, 0x646c7461u);
    return h != 0 ? h : 1;
}

static size_t slot_of(const applied_set *s, uint64_t key)
{
    size_t i = (size_t)key & (s->cap - 1);
    while (s->keys[i] != 0 && s->keys[i] != key)
        i = (i + 1) & (s->cap - 1);
    return i;
}

/* Rebuilt at cap, without the entries of a base below floor.  0, or -1 out of memory (unchanged). */
static int applied_rebuild(applied_set *s, size_t cap, uint64_t floor)
{
    applied_set t = {NULL, NULL, 0, cap};

    if ((t.keys = calloc(cap, sizeof(uint64_t))) == NULL || (t.bases = calloc(cap, sizeof(uint64_t))) == NULL) {
        free(t.keys);
        free(t.bases);
        return -1;
    }
    for (size_t i = 0; i < s->cap; i++) {
        if (s->keys[i] == 0 || s->bases[i] < floor)
            continue;
        size_t j = slot_of(&t, s->keys[i]);
        t.keys[j] = s->keys[i];
        t.bases[j] = s->bases[i];
        t.n++;
    }
    free(s->keys);
    free(s->bases);
    *s = t;
    return 0;
}

static void applied_add(dilocod *d, const char *node_id, uint64_t base, uint64_t local_step)
{
    applied_set *s = &d->async.applied;
    uint64_t key = delta_key(node_id, base, local_step);

    if ((s->n + 1) * 2 > s->cap && applied_rebuild(s, s->cap ? s->cap * 2 : 1024, 0) != 0) {
        /* no memory: not remembered, so a repeat of it would be taken again; said, not fatal */
        dl_log(DL_LOG_ERROR, "round", "out of memory remembering an applied delta", "node=%s", node_id);
        return;
    }
    size_t i = slot_of(s, key);
    if (s->keys[i] == 0) {
        s->keys[i] = key;
        s->bases[i] = base;
        s->n++;
    }
}

int daemon__async_applied(const dilocod *d, const delta_info *info)
{
    const applied_set *s = &d->async.applied;

    if (s->cap == 0)
        return 0;
    uint64_t key = delta_key(info->node_id, info->base_outer_step, info->local_step);
    return s->keys[slot_of(s, key)] == key;
}

void daemon__async_record_applied(dilocod *d, const round_record *r)
{
    if (!r->async)
        return;
    for (size_t i = 0; i < r->n; i++)
        applied_add(d, r->nodes[i].node_id, r->nodes[i].base_outer_step, r->nodes[i].local_step);
    /* with a staleness bound, a delta more than it behind is refused as stale anyway: forgotten once the
     * set would grow */
    applied_set *s = &d->async.applied;
    uint64_t step = r->step + 1, bound = d->cfg->max_staleness;
    if (bound != CONFIG_NO_STALENESS_BOUND && step > bound + 1 && (s->n + 1) * 2 > s->cap)
        (void)applied_rebuild(s, s->cap, step - bound - 1);
}

void daemon__async_load_record(void *arg, const round_record *r)
{
    dilocod *d = arg;
    daemon_async *a = &d->async;

    /* the run of async records, unbroken, that the floor comes from: a sync record (the mode was
     * switched) or a gap (compaction, a lost append) starts it over */
    if (!r->async) {
        a->run_on = 0;
    } else {
        if (!a->run_on || r->step != a->run_next)
            a->run_start = r->step;
        a->run_on = 1;
        a->run_next = r->step + 1;
    }
    daemon__async_record_applied(d, r);
}

void daemon__async_loaded(dilocod *d)
{
    daemon_async *a = &d->async;

    /* the run must reach the committed step: records that stop before it (the last ones lost, or a
     * state adopted after them) tell nothing of the steps since, and the floor is then the step the
     * state starts from (daemon__async_round_opened) */
    if (d->st.committed && a->run_on && a->run_next == d->st.step) {
        a->floor = a->run_start;
        a->floor_known = 1;
    }
}

void daemon__async_round_opened(dilocod *d)
{
    daemon_async *a = &d->async;

    if (!daemon__async(d))
        return;
    /* nothing before this step was applied by this state, as far as it knows: a tree of an older run's
     * deltas is stale below it, and after an adoption (a later open) so are the deltas the global's
     * writer may have applied */
    if (!a->floor_known || a->opened) {
        a->floor = d->st.step;
        a->floor_known = 1;
    }
    a->opened = 1;
}

uint64_t daemon__async_bound(dilocod *d)
{
    const daemon_async *a = &d->async;
    uint64_t bound = d->cfg->max_staleness == CONFIG_NO_STALENESS_BOUND ? ROUND_NO_STALENESS_BOUND
                                                                        : d->cfg->max_staleness;

    if (!daemon__async(d))
        return 0;
    if (a->floor_known && d->rnd.step >= a->floor && d->rnd.step - a->floor < bound)
        bound = d->rnd.step - a->floor;
    d->rnd.max_staleness = bound;
    return bound;
}

int daemon__async_below_floor(dilocod *d, const delta_info *info, int count)
{
    daemon_async *a = &d->async;
    char qn[160];

    if (!daemon__async(d) || !a->floor_known || info->base_outer_step >= a->floor)
        return 0;
    if (!count)
        return 1;
    /* a restart meets every old file of a tree: the first one says why, the others are counted */
    dl_log(a->below_floor == 0 ? DL_LOG_WARN : DL_LOG_DEBUG, "round",
           "delta refused: based before the oldest update whose deltas are known (rounds.jsonl keeps "
           "--history-keep records), it may have been applied already",
           "node=%s local_step=%" PRIu64 " base_outer_step=%" PRIu64 " floor=%" PRIu64,
           dl_log_q(qn, sizeof(qn), info->node_id), info->local_step, info->base_outer_step, a->floor);
    a->below_floor++;
    return 1;
}

void daemon__async_free(dilocod *d)
{
    free(d->async.nodes);
    free(d->async.applied.keys);
    free(d->async.applied.bases);
    memset(&d->async, 0, sizeof(d->async));
}

/* ---- /status and /metrics ---------------------------------------------------------------------- */

static void async_status(const dilocod *d, sbuf *b)
{
    const daemon_async *a = &d->async;
    const store_dn *dn = &d->st.dn;
    const hub_status *hs = d->hub != NULL ? hub_get_status(d->hub) : NULL;
    double now = daemon__now((dilocod *)d);

    sb_printf(b, ",\"mode\":\"%s\"", daemon__async(d) ? "async" : "sync");
    if (!daemon__async(d))
        return;
    sb_str(b, ",\"async\":{\"max_staleness\":");
    if (d->cfg->max_staleness == CONFIG_NO_STALENESS_BOUND)
        sb_str(b, "null");
    else
        sb_printf(b, "%u", d->cfg->max_staleness);
    sb_printf(b, ",\"staleness_weight\":\"%s\",\"grace_ms\":", config_weight_name(d->cfg->staleness_weight));
    daemon_json_num(b, d->cfg->grace_ms);
    sb_printf(b, ",\"dn\":{\"variant\":\"%s\",\"period\":%u,\"k\":%u,\"c\":", d->cfg->dn_paper ? "paper" : "forgather",
              d->cfg->dn_period, dn->on ? dn->k : 0);
    daemon_json_num(b, d->cfg->dn_c);
    sb_printf(b, "},\"queue\":{\"pending\":%zu,\"queued\":%zu,\"max\":%u},\"updates\":%" PRIu64
                 ",\"nesterov_steps\":%" PRIu64 ",\"accepted\":%" PRIu64 ",\"applied_floor\":%" PRIu64
                 ",\"refused_below_floor\":%" PRIu64 ",\"listing\":{\"waiting\":%" PRIu64
                 ",\"deferred\":%" PRIu64 "},\"staleness\":{\"mean\":",
              round_pending(&d->rnd), d->rnd.nqueue, d->cfg->async_queue, a->updates, a->nesterov_steps, a->accepted,
              a->floor, a->below_floor, hs != NULL ? hs->deltas_waiting : 0, hs != NULL ? hs->deltas_deferred : 0);
    daemon_json_num(b, a->accepted ? a->tau_sum / (double)a->accepted : 0);
    sb_str(b, ",\"histogram\":{");
    for (size_t i = 0; i < ASYNC_TAU_BUCKETS; i++)
        sb_printf(b, "%s\"%s\":%" PRIu64, i ? "," : "", tau_le[i], a->tau_hist[i]);
    dylu_view v = dylu_of(d);
    sb_printf(b, "}},\"dylu_base_steps\":%" PRIu64 ",\"nodes\":[", v.base);
    for (size_t i = 0; i < a->n; i++) {
        const async_node *e = &a->nodes[i];
        sb_printf(b, "%s{\"node_id\":\"%s\",\"deltas\":%" PRIu64 ",\"last_local_step\":%" PRIu64
                     ",\"last_tau\":%" PRIu64 ",\"steps_per_delta\":%" PRIu64 ",\"speed\":",
                  i ? "," : "", e->node_id, e->deltas, e->last_local_step, e->last_tau, e->steps_per_delta);
        daemon_json_num(b, e->speed);
        sb_printf(b, ",\"live\":%s,\"recommended_local_steps\":%" PRIu64 ",\"age_seconds\":",
                  measure_live(e, v.now) ? "true" : "false", recommend(&v, e));
        daemon_json_num(b, now - e->last_at);
        sb_str(b, "}");
    }
    sb_str(b, "]}");
}

static void async_metrics(const dilocod *d, sbuf *b)
{
    const daemon_async *a = &d->async;
    uint64_t cum = 0;

    daemon_metric_family(b, "async_mode", "gauge", "1 in async mode (--mode async), 0 in sync mode");
    sb_printf(b, "dilocod_async_mode %d\n", daemon__async(d) ? 1 : 0);
    if (!daemon__async(d))
        return;
    daemon_metric_family(b, "async_updates_total", "counter", "Updates committed since the start (async mode)");
    sb_printf(b, "dilocod_async_updates_total %" PRIu64 "\n", a->updates);
    daemon_metric_family(b, "async_nesterov_steps_total", "counter", "Delayed Nesterov steps among them");
    sb_printf(b, "dilocod_async_nesterov_steps_total %" PRIu64 "\n", a->nesterov_steps);
    daemon_metric_family(b, "async_dn_phase", "gauge", "Updates since the last Nesterov step (k of dn_period)");
    sb_printf(b, "dilocod_async_dn_phase %u\n", d->st.dn.on ? d->st.dn.k : 0);
    daemon_metric_family(b, "async_dn_period", "gauge", "Delayed Nesterov period N");
    sb_printf(b, "dilocod_async_dn_period %u\n", d->cfg->dn_period);
    daemon_metric_family(b, "async_refused_below_floor_total", "counter",
                         "Deltas refused as stale for a base below the oldest update whose deltas are known");
    sb_printf(b, "dilocod_async_refused_below_floor_total %" PRIu64 "\n", a->below_floor);
    const hub_status *hs = d->hub != NULL ? hub_get_status(d->hub) : NULL;
    daemon_metric_family(b, "async_listing_waiting", "gauge",
                         "Deltas the transport's last listing left for a later one (a node's beyond its per-poll cap)");
    sb_printf(b, "dilocod_async_listing_waiting %" PRIu64 "\n", hs != NULL ? hs->deltas_waiting : 0);
    daemon_metric_family(b, "async_listing_deferred_total", "counter",
                         "Times a listing left a delta for a later one (each is handed over in a later poll)");
    sb_printf(b, "dilocod_async_listing_deferred_total %" PRIu64 "\n", hs != NULL ? hs->deltas_deferred : 0);
    daemon_metric_family(b, "async_queue_depth", "gauge", "Deltas waiting for an update (the open one's and the queue's)");
    sb_printf(b, "dilocod_async_queue_depth %zu\n", round_pending(&d->rnd));
    daemon_metric_family(b, "async_staleness", "histogram", "Staleness (updates behind) of accepted deltas");
    for (size_t i = 0; i < ASYNC_TAU_BUCKETS; i++) {
        cum += a->tau_hist[i];
        sb_printf(b, "dilocod_async_staleness_bucket{le=\"%s\"} %" PRIu64 "\n", tau_le[i], cum);
    }
    sb_printf(b, "dilocod_async_staleness_sum %.17g\ndilocod_async_staleness_count %" PRIu64 "\n", a->tau_sum,
              a->accepted);
    /* per node: bounded by ASYNC_NODES_MAX (the table replaces the least recently seen) */
    daemon_metric_family(b, "node_speed_steps_per_second", "gauge", "A node's local steps per second (DyLU)");
    for (size_t i = 0; i < a->n; i++)
        sb_printf(b, "dilocod_node_speed_steps_per_second{node=\"%s\"} %.9g\n", a->nodes[i].node_id,
                  a->nodes[i].speed);
    daemon_metric_family(b, "node_recommended_local_steps", "gauge", "Local steps recommended to a node (DyLU)");
    dylu_view v = dylu_of(d);
    for (size_t i = 0; i < a->n; i++)
        sb_printf(b, "dilocod_node_recommended_local_steps{node=\"%s\"} %" PRIu64 "\n", a->nodes[i].node_id,
                  recommend(&v, &a->nodes[i]));
}

const daemon_provider daemon__async_provider = {"async", async_status, async_metrics};
