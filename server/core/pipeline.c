#include "pipeline.h"

#include <errno.h>
#include <inttypes.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <uv.h>

#include "dl_log.h"

/* from a commit's few milliseconds to a round that collects for minutes */
const double PIPELINE_BUCKETS[PIPELINE_NBUCKETS - 1] = {0.01, 0.1, 1, 10, 60, 600};

static const char *const state_names[STEP_NSTATES] = {
    [STEP_COLLECTING] = "collecting",
    [STEP_COMPUTING] = "computing",
    [STEP_INPUTS_DURABLE] = "inputs_durable",
    [STEP_COMMITTED] = "committed",
    [STEP_SERVED] = "served",
    [STEP_PUBLISHED] = "published",
    [STEP_DURABLE] = "durable",
    [STEP_CLEANED] = "cleaned",
    [STEP_RETRY_WAIT] = "retry_wait",
    [STEP_FAILED] = "failed",
    [STEP_CLUSTER_MANIFEST] = "cluster_manifest",
    [STEP_CLUSTER_SHARDS] = "cluster_shards",
    [STEP_CLUSTER_PUBLISH] = "cluster_publish",
};

/* legal[from] is the set of states a step computed locally may move to from `from` (bit i: state i);
 * legal_cluster[from] the same for a cluster's step (pipeline.h, step_strategy).  Together: the one table
 * of what happens after a state, one column per way of computing a step. */
#define TO(s) (1u << (s))
static const unsigned legal[STEP_NSTATES] = {
    /* the round closes */
    [STEP_COLLECTING] = TO(STEP_COMPUTING),
    /* the outputs are written and the inputs durable; the pass failed (or a bound the step cannot
     * pass, stepcount.h, stopped it before it ran); a rewritten input reopened the round; the committed
     * global was rewritten (the daemon stops) */
    [STEP_COMPUTING] = TO(STEP_INPUTS_DURABLE) | TO(STEP_RETRY_WAIT) | TO(STEP_COLLECTING) | TO(STEP_FAILED),
    /* the redo record is durable; writing it failed */
    [STEP_INPUTS_DURABLE] = TO(STEP_COMMITTED) | TO(STEP_RETRY_WAIT),
    [STEP_COMMITTED] = TO(STEP_SERVED),
    /* published; durable when it will not be published */
    [STEP_SERVED] = TO(STEP_PUBLISHED) | TO(STEP_DURABLE),
    [STEP_PUBLISHED] = TO(STEP_DURABLE),
    [STEP_DURABLE] = TO(STEP_CLEANED),
    [STEP_CLEANED] = 0,
    /* computed again */
    [STEP_RETRY_WAIT] = TO(STEP_COMPUTING),
    [STEP_FAILED] = 0,
};

/* Another member may publish the step at any point before this one does (the bucket's step file names it):
 * published is reachable from every state before it. */
#define CLUSTER_OUT (TO(STEP_PUBLISHED) | TO(STEP_FAILED))
static const unsigned legal_cluster[STEP_NSTATES] = {
    /* the round closes: its manifest is written or adopted */
    [STEP_COLLECTING] = TO(STEP_CLUSTER_MANIFEST) | CLUSTER_OUT,
    /* agreed; or not (another manifest won, the round collects again) */
    [STEP_CLUSTER_MANIFEST] = TO(STEP_CLUSTER_SHARDS) | TO(STEP_COLLECTING) | CLUSTER_OUT,
    /* every shard done; or a refusal reopens the round */
    [STEP_CLUSTER_SHARDS] = TO(STEP_CLUSTER_PUBLISH) | TO(STEP_COLLECTING) | CLUSTER_OUT,
    /* written; an overflow found at the publish sends the step to its next generation's shards */
    [STEP_CLUSTER_PUBLISH] = TO(STEP_CLUSTER_SHARDS) | TO(STEP_COLLECTING) | CLUSTER_OUT,
    /* this member's record of it is in rounds.jsonl */
    [STEP_PUBLISHED] = TO(STEP_DURABLE),
    /* the member moved on to the next step */
    [STEP_DURABLE] = TO(STEP_CLEANED),
    [STEP_CLEANED] = 0,
    /* a refusal holds this member until the bucket moves on; the round may be collected again meanwhile,
     * and the others may publish the step */
    [STEP_FAILED] = TO(STEP_COLLECTING) | TO(STEP_CLUSTER_MANIFEST) | TO(STEP_CLUSTER_SHARDS) | TO(STEP_PUBLISHED),
};

static const char *const activity_names[STEP_NACTS] = {
    [STEP_ACT_PASS] = "pass",
    [STEP_ACT_SYNC] = "sync",
    [STEP_ACT_PUBLISH] = "publish",
    [STEP_ACT_SET] = "set",
    [STEP_ACT_CLEANUP] = "cleanup",
};

const char *step_activity_name(step_activity a)
{
    return (unsigned)a < STEP_NACTS ? activity_names[a] : "unknown";
}

const char *step_state_name(step_state s)
{
    return (unsigned)s < STEP_NSTATES ? state_names[s] : "unknown";
}

int step_move_legal_as(step_strategy strategy, step_state from, step_state to)
{
    const unsigned *table = strategy == STEP_CLUSTER ? legal_cluster : legal;
    return (unsigned)from < STEP_NSTATES && (unsigned)to < STEP_NSTATES && (table[from] & TO(to)) != 0;
}

int step_move_legal(step_state from, step_state to)
{
    return step_move_legal_as(STEP_LOCAL, from, to);
}

static double monotonic_seconds(void)
{
    return (double)uv_hrtime() / 1e9;
}

static double unix_seconds(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

/* The test hook (pipeline.h): DILOCOD_TEST_CRASH_AT=<state>[:<step>] into crash_at and crash_step;
 * anything else is logged and ignored. */
static void read_crash_hook(pipeline *p)
{
    const char *v = getenv("DILOCOD_TEST_CRASH_AT"), *colon;
    char *end, q[160];
    unsigned long long step = 0;
    size_t len;

    p->crash_at = STEP_NSTATES;
    p->crash_step = -1;
    if (v == NULL || *v == '\0')
        return;
    colon = strchr(v, ':');
    len = colon != NULL ? (size_t)(colon - v) : strlen(v);
    if (colon != NULL) {
        errno = 0;
        step = strtoull(colon + 1, &end, 10);
        if (colon[1] < '0' || colon[1] > '9' || *end != '\0' || errno != 0 || step > INT64_MAX)
            goto bad;
    }
    for (int s = 0; s < STEP_NSTATES; s++) {
        if (strlen(state_names[s]) == len && strncmp(state_names[s], v, len) == 0) {
            p->crash_at = (step_state)s;
            p->crash_step = colon != NULL ? (int64_t)step : -1;
            dl_log(DL_LOG_WARN, "pipeline", "test hook: the process kills itself when a step enters a state",
                   "state=%s step=%s", state_names[s], colon != NULL ? colon + 1 : "any");
            return;
        }
    }
bad:
    dl_log(DL_LOG_ERROR, "pipeline", "DILOCOD_TEST_CRASH_AT ignored: not <state>[:<step>]", "value=%s",
           dl_log_q(q, sizeof(q), v));
}

void pipeline_init(pipeline *p, double (*clock)(void), double (*wall)(void))
{
    memset(p, 0, sizeof(*p));
    p->clock = clock != NULL ? clock : monotonic_seconds;
    p->wall = wall != NULL ? wall : unix_seconds;
    read_crash_hook(p);
    const char *strict = getenv("DILOCOD_TEST_STRICT_PIPELINE");
    p->strict = strict != NULL && strcmp(strict, "1") == 0;
}

void pipeline_on_illegal(pipeline *p, void (*fn)(void *arg, uint64_t step, const char *what), void *arg)
{
    p->on_illegal = fn;
    p->illegal_arg = arg;
}

/* Every refusal of the table (a move, a step entered, an activity started or ended): a guard let a
 * caller ask for what the table does not allow, which is a bug.  Counted and logged at error level;
 * then, under DILOCOD_TEST_STRICT_PIPELINE=1 (the integration tests' daemons), the process aborts at
 * once, where the bug is; else the owner's handler stops the step safely (the daemon: daemon__fatal,
 * its state on disk is crash-safe).  -1, for the caller to return. */
static int refused(pipeline *p, uint64_t step, const char *what)
{
    dl_log(DL_LOG_ERROR, "pipeline", "illegal pipeline transition, not made", "step=%" PRIu64 " %s", step, what);
    p->illegal++;
    if (p->strict)
        abort();        /* lint-errors: allow exit: the tests' fail-fast on a pipeline bug (DILOCOD_TEST_STRICT_PIPELINE) */
    if (p->on_illegal != NULL)
        p->on_illegal(p->illegal_arg, step, what);
    return -1;
}

static step_record *find(pipeline *p, uint64_t step)
{
    for (size_t i = 0; i < p->n; i++)
        if (p->rec[i].step == step)
            return &p->rec[i];
    return NULL;
}

const step_record *pipeline_find(const pipeline *p, uint64_t step)
{
    return find((pipeline *)p, step);
}

static int done(step_state s)
{
    return s == STEP_CLEANED || s == STEP_FAILED;
}

/* Room for one more record: the oldest that is done (and runs nothing) goes.  0, or -1 when every one is in flight. */
static void drop_record(pipeline *p, size_t i)
{
    memmove(&p->rec[i], &p->rec[i + 1], (p->n - i - 1) * sizeof(p->rec[0]));
    p->n--;
}

static int make_room(pipeline *p)
{
    if (p->n < PIPELINE_MAX)
        return 0;
    for (size_t i = 0; i < p->n; i++) {
        if (done(p->rec[i].state) && p->rec[i].busy == 0) {
            drop_record(p, i);
            return 0;
        }
    }
    /* Else the oldest durable step that runs nothing, when a later step is in the table: all it still
     * waits for is a cleanup, and the cleanup behind the later step removes its files too (async updates
     * can outrun the cleanups, and a full table must never stop a step from being entered). */
    for (size_t i = 0; i + 1 < p->n; i++) {
        if (p->rec[i].state == STEP_DURABLE && p->rec[i].busy == 0) {
            drop_record(p, i);
            return 0;
        }
    }
    return -1;
}

int pipeline_begin(pipeline *p, uint64_t step, step_state state)
{
    return pipeline_begin_as(p, step, state, STEP_LOCAL);
}

int pipeline_begin_as(pipeline *p, uint64_t step, step_state state, step_strategy strategy)
{
    size_t at = 0;

    if (find(p, step) != NULL || (unsigned)state >= STEP_NSTATES || make_room(p) != 0) {
        char what[96];
        snprintf(what, sizeof(what), "from=none to=%s (not entered: %s) in_flight=%zu", step_state_name(state),
                 find(p, step) != NULL ? "there already" : (unsigned)state >= STEP_NSTATES ? "no such state" : "no room",
                 p->n);
        return refused(p, step, what);
    }
    while (at < p->n && p->rec[at].step < step)
        at++;
    memmove(&p->rec[at + 1], &p->rec[at], (p->n - at) * sizeof(p->rec[0]));
    p->n++;
    memset(&p->rec[at], 0, sizeof(p->rec[at]));
    p->rec[at].step = step;
    p->rec[at].strategy = strategy;
    p->rec[at].state = state;
    p->rec[at].since = p->clock();
    p->rec[at].since_wall = p->wall();
    dl_log(DL_LOG_DEBUG, "pipeline", "step entered", "step=%" PRIu64 " state=%s", step, step_state_name(state));
    return 0;
}

static void observe(state_histogram *h, double seconds)
{
    for (size_t i = 0; i < PIPELINE_NBUCKETS; i++)
        if (i == PIPELINE_NBUCKETS - 1 || seconds <= PIPELINE_BUCKETS[i])
            h->buckets[i]++;
    h->count++;
    h->sum += seconds;
}

static int move(pipeline *p, step_record *r, step_state to)
{
    if (!step_move_legal_as(r->strategy, r->state, to)) {
        char what[64];
        snprintf(what, sizeof(what), "from=%s to=%s", step_state_name(r->state), step_state_name(to));
        return refused(p, r->step, what);
    }
    double now = p->clock(), spent = now - r->since;
    if (spent < 0)
        spent = 0;
    observe(&p->seconds[r->state], spent);
    dl_log(DL_LOG_DEBUG, "pipeline", "step moved", "step=%" PRIu64 " from=%s to=%s seconds=%.6f", r->step,
           step_state_name(r->state), step_state_name(to), spent);
    r->state = to;
    r->since = now;
    r->since_wall = p->wall();
    if (to == STEP_COMPUTING)
        r->attempts++;
    if (to == p->crash_at && (p->crash_step < 0 || (uint64_t)p->crash_step == r->step)) {
        dl_log(DL_LOG_WARN, "pipeline", "test hook: killed", "step=%" PRIu64 " state=%s", r->step,
               step_state_name(to));
        raise(SIGKILL);         /* lint-errors: allow exit: the crash tests' kill -9 at a state, by their hook only */
    }
    return 0;
}

int pipeline_move(pipeline *p, uint64_t step, step_state to)
{
    step_record *r = find(p, step);

    if (r == NULL) {
        char what[64];
        snprintf(what, sizeof(what), "from=none to=%s", step_state_name(to));
        return refused(p, step, what);
    }
    return move(p, r, to);
}

void pipeline_published(pipeline *p, uint64_t step)
{
    step_record *r = find(p, step);

    if (r == NULL)
        return;
    r->published = 1;
    if (r->state == STEP_SERVED)
        move(p, r, STEP_PUBLISHED);
}

void pipeline_durable(pipeline *p, uint64_t step)
{
    step_record *r = find(p, step);

    /* from served or published; one a later settle made durable with it (below) is durable already */
    if (r != NULL && r->state != STEP_DURABLE && r->state != STEP_CLEANED)
        move(p, r, STEP_DURABLE);       /* the table refuses any other: a bug */
    /* The steps before it that were served but never settled on their own (async updates faster than the
     * settles: each settle names the newest committed step) are durable with it: outer_metadata.json names a
     * later step.  Left served, they held their records for ever, and once PIPELINE_MAX of them were in
     * flight no step could be entered. */
    for (size_t i = 0; i < p->n; i++)
        if (p->rec[i].step < step && (p->rec[i].state == STEP_SERVED || p->rec[i].state == STEP_PUBLISHED))
            move(p, &p->rec[i], STEP_DURABLE);
}

void pipeline_cleaned(pipeline *p, uint64_t step)
{
    for (size_t i = 0; i < p->n; i++)
        if (p->rec[i].step <= step && p->rec[i].state == STEP_DURABLE)
            move(p, &p->rec[i], STEP_CLEANED);
}

/* An activity started twice or ended while not running: a guard is wrong (a bug, like an illegal move). */
static int activity_refused(pipeline *p, uint64_t step, step_activity a, const char *why)
{
    char what[96];
    snprintf(what, sizeof(what), "activity=%s why=%s", step_activity_name(a), why);
    return refused(p, step, what);
}

int pipeline_start(pipeline *p, uint64_t step, step_activity a)
{
    step_record *r = find(p, step);

    if ((unsigned)a >= STEP_NACTS || r == NULL)
        return activity_refused(p, step, a, "no such step");
    if (r->busy & (1u << a))
        return activity_refused(p, step, a, "already running");
    r->busy |= 1u << a;
    r->failed &= ~(1u << a);
    dl_log(DL_LOG_DEBUG, "pipeline", "activity started", "step=%" PRIu64 " activity=%s", step, step_activity_name(a));
    return 0;
}

int pipeline_end(pipeline *p, uint64_t step, step_activity a, int ok)
{
    step_record *r = find(p, step);

    if ((unsigned)a >= STEP_NACTS || r == NULL)
        return activity_refused(p, step, a, "no such step");
    if (!(r->busy & (1u << a)))
        return activity_refused(p, step, a, "not running");
    r->busy &= ~(1u << a);
    if (!ok)
        r->failed |= 1u << a;
    dl_log(DL_LOG_DEBUG, "pipeline", "activity ended", "step=%" PRIu64 " activity=%s ok=%d", step,
           step_activity_name(a), ok);
    return 0;
}

int pipeline_busy(const pipeline *p, uint64_t step, step_activity a)
{
    const step_record *r = pipeline_find(p, step);
    return r != NULL && (unsigned)a < STEP_NACTS && (r->busy & (1u << a)) != 0;
}

int pipeline_failed(const pipeline *p, uint64_t step, step_activity a)
{
    const step_record *r = pipeline_find(p, step);
    return r != NULL && (unsigned)a < STEP_NACTS && (r->failed & (1u << a)) != 0;
}

int pipeline_any_busy(const pipeline *p, step_activity a)
{
    for (size_t i = 0; i < p->n; i++)
        if ((unsigned)a < STEP_NACTS && (p->rec[i].busy & (1u << a)))
            return 1;
    return 0;
}

int pipeline_unsettled(const pipeline *p)
{
    for (size_t i = 0; i < p->n; i++) {
        step_state s = p->rec[i].state;
        if (s == STEP_COMMITTED || s == STEP_SERVED || s == STEP_PUBLISHED)
            return 1;
    }
    return 0;
}

step_state pipeline_state(const pipeline *p, uint64_t step)
{
    const step_record *r = pipeline_find(p, step);
    return r != NULL ? r->state : STEP_NSTATES;
}

int pipeline_outputs_written(const pipeline *p, uint64_t step)
{
    return pipeline_state(p, step) == STEP_COMPUTING && !pipeline_busy(p, step, STEP_ACT_PASS);
}

int pipeline_commit_ready(const pipeline *p, uint64_t step)
{
    return pipeline_outputs_written(p, step) && !pipeline_busy(p, step, STEP_ACT_SYNC) && !pipeline_unsettled(p);
}

int pipeline_cleanup_ready(const pipeline *p, uint64_t open_step)
{
    return !pipeline_any_busy(p, STEP_ACT_CLEANUP) && !pipeline_any_busy(p, STEP_ACT_PUBLISH) &&
           !pipeline_unsettled(p) && !pipeline_outputs_written(p, open_step);
}
