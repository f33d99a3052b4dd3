/* pipeline: the steps in flight, each with one lifecycle state, as data (curl's multistate()/mstate()
 * idea applied to dilocod's step).  A step is made by a round: it collects deltas, is computed, its
 * inputs are made durable, its redo record commits it, downloads serve it, the transport publishes it,
 * it becomes durable (outer_metadata.json names it) and the files before it are cleaned.  Several
 * steps are in flight at once: step n settles while n+1 collects.
 *
 * The state of a record says how far the step has come, in this order:
 *
 *   collecting -> computing -> inputs_durable -> committed -> served -> published -> durable -> cleaned
 *
 * with retry_wait (the pass or the commit failed; computed again after a backoff) and failed (given
 * up for good).  Publishing and settling run side by side (file:// settles after its publish), so a
 * step goes from served to published when the publish ends first, or straight to durable when the
 * settle does; the publish is then recorded in the record (published) without a move, as it is for
 * a step that entered whole.  A step may never be published (no transport; a later step committed
 * before its publish began: the newest is the one published).
 *
 * Work runs for a step beside its state: its pass, the sync of its inputs, its publish, its sharded
 * set, the cleanup behind it.  Each is an activity of the step's record (pipeline_start/_end), so a
 * guard asks the pipeline "is step n's publish running?" or "is any step not durable yet?" instead
 * of reading loose flags, and /status shows what each step is waiting on.  An activity ends ok or
 * failed; the failure is kept on the record until the activity starts again (pipeline_failed).
 *
 * pipeline_move is the only writer of a state: it checks the move against the table of legal ones
 * (an illegal move is logged at error level and not made), logs each move at debug level with the
 * time spent in the state it leaves, and adds that time to the state's histogram (/metrics).
 * Everything here runs on the loop thread.
 *
 * Test hook: DILOCOD_TEST_CRASH_AT=<state>[:<step>] in the environment, read once by pipeline_init,
 * makes the process raise SIGKILL right after a move enters that state (after its log line, before
 * the move returns), for any step or only that one: tests/integration/test_crash_states.py crashes
 * the daemon exactly in each state and checks the restart's recovery.  An unknown state or a bad step
 * is logged at error level and ignored.  Unset, it costs one comparison per move. */
#ifndef PIPELINE_H
#define PIPELINE_H

#include <stddef.h>
#include <stdint.h>

typedef enum step_state {
    STEP_COLLECTING,
    STEP_COMPUTING,
    STEP_INPUTS_DURABLE,
    STEP_COMMITTED,
    STEP_SERVED,
    STEP_PUBLISHED,
    STEP_DURABLE,
    STEP_CLEANED,
    STEP_RETRY_WAIT,
    STEP_FAILED,
    /* a cluster's step (--cluster-shards: the bucket's shards compute it, hub/s3_cluster.h) */
    STEP_CLUSTER_MANIFEST,              /* the round closed: the members agree its manifest */
    STEP_CLUSTER_SHARDS,                /* the manifest agreed: the shards are computed */
    STEP_CLUSTER_PUBLISH,               /* every shard done: the index and the step file are written */
    STEP_NSTATES
} step_state;

/* How a step is computed: the local pass, or a cluster's shards.  Each has its column of the one table of
 * moves (pipeline.c): a cluster's step is
 *
 *   collecting -> cluster_manifest -> cluster_shards -> cluster_publish -> published -> durable -> cleaned
 *
 * going back to collecting when a refusal reopens the round, from cluster_publish to cluster_shards when the
 * publish finds an overflow, to failed while a refusal holds this member (the others may still publish
 * it), and to published from any of these when another member published it first.  Published: the bucket's
 * step file names it; durable: this member's round record of it is in its rounds.jsonl; cleaned: the
 * member moved on to the next step. */
typedef enum step_strategy {
    STEP_LOCAL,
    STEP_CLUSTER,
} step_strategy;

/* What runs for a step beside its state (a bit each in step_record.busy and .failed). */
typedef enum step_activity {
    STEP_ACT_PASS,              /* the outer step's pass: prepare, run, finish (outputs written) */
    STEP_ACT_SYNC,              /* the round's deltas fsynced: they are the redo record's inputs */
    STEP_ACT_PUBLISH,           /* the transport publishes the step */
    STEP_ACT_SET,               /* the sharded layout of the step's global written */
    STEP_ACT_CLEANUP,           /* the files before the step removed */
    STEP_NACTS
} step_activity;

#define PIPELINE_MAX 8                  /* records kept: the steps in flight and the last ones done */
#define PIPELINE_NBUCKETS 7             /* histogram bounds: PIPELINE_BUCKETS below, then +Inf */

typedef struct step_record {
    uint64_t step;                      /* the step the round makes */
    step_strategy strategy;             /* how it is computed: which column of the table its moves obey */
    step_state state;
    double since;                       /* when it entered state (the pipeline's clock, seconds) */
    double since_wall;                  /* the same moment, Unix time (for /status) */
    int published;                      /* the transport holds this step */
    unsigned busy;                      /* activities running (bit i: step_activity i) */
    unsigned failed;                    /* activities whose last run failed (cleared when one starts again) */
    unsigned attempts;                  /* times the step entered computing */
} step_record;

typedef struct state_histogram {
    uint64_t buckets[PIPELINE_NBUCKETS];        /* cumulative counts, as Prometheus wants them */
    uint64_t count;
    double sum;
} state_histogram;

typedef struct pipeline {
    step_record rec[PIPELINE_MAX];      /* by step, ascending */
    size_t n;
    state_histogram seconds[STEP_NSTATES];      /* time spent in each state, by the moves out of it */
    uint64_t illegal;                   /* moves refused by the table */
    double (*clock)(void);              /* monotonic seconds */
    double (*wall)(void);               /* Unix time */
    step_state crash_at;                /* the test hook's state (STEP_NSTATES: none), see above */
    int64_t crash_step;                 /* and its step, -1: any */
    int strict;                         /* DILOCOD_TEST_STRICT_PIPELINE=1: a refusal aborts (tests) */
    void (*on_illegal)(void *arg, uint64_t step, const char *what);     /* else after a refusal, if set */
    void *illegal_arg;
} pipeline;

extern const double PIPELINE_BUCKETS[PIPELINE_NBUCKETS - 1];

const char *step_state_name(step_state s);
const char *step_activity_name(step_activity a);
/* Whether the table allows from -> to for a step computed locally (step_move_legal_as: by strategy). */
int step_move_legal(step_state from, step_state to);
int step_move_legal_as(step_strategy strategy, step_state from, step_state to);

/* clock and wall NULL: the process's monotonic clock and time().  Reads DILOCOD_TEST_CRASH_AT and
 * DILOCOD_TEST_STRICT_PIPELINE. */
void pipeline_init(pipeline *p, double (*clock)(void), double (*wall)(void));
/* A refusal of the table (an illegal move, a step not entered, an activity started twice or ended while
 * not running) is a bug: counted, logged at error level, then fn(arg, step, what) (the daemon stops the
 * step safely: it stops, and a restart recovers from its crash-safe state) unless
 * DILOCOD_TEST_STRICT_PIPELINE=1 made it abort first. */
void pipeline_on_illegal(pipeline *p, void (*fn)(void *arg, uint64_t step, const char *what), void *arg);
/* A step enters the pipeline at state (collecting for a new round; durable for a step committed
 * whole: adopted, bootstrapped, recovered or found at startup).  An older record that is done
 * (cleaned or failed) makes room when the table is full.  0, or -1 when the step is there already or
 * no room can be made. */
int pipeline_begin(pipeline *p, uint64_t step, step_state state);
/* The same for a step computed by strategy (pipeline_begin: STEP_LOCAL). */
int pipeline_begin_as(pipeline *p, uint64_t step, step_state state, step_strategy strategy);
/* Moves step to state.  0; -1 when the step is not in the pipeline or the move is illegal (logged at
 * error level, nothing changes). */
int pipeline_move(pipeline *p, uint64_t step, step_state to);
/* The record of step, or NULL. */
const step_record *pipeline_find(const pipeline *p, uint64_t step);

/* An activity of step starts: 0; -1 when the step is not in the pipeline or the activity runs already
 * (logged at error level and counted with the illegal moves: a guard let it start twice). */
int pipeline_start(pipeline *p, uint64_t step, step_activity a);
/* It ends, ok or not.  Ending one that is not running is refused the same way. */
int pipeline_end(pipeline *p, uint64_t step, step_activity a, int ok);
/* Whether step's activity runs now / failed the last time it ran (0 when the step is not there). */
int pipeline_busy(const pipeline *p, uint64_t step, step_activity a);
int pipeline_failed(const pipeline *p, uint64_t step, step_activity a);
/* Whether any step's activity runs now. */
int pipeline_any_busy(const pipeline *p, step_activity a);
/* Whether a committed step is not durable yet (committed, served or published): it settles. */
int pipeline_unsettled(const pipeline *p);
/* The state of step, or STEP_NSTATES when it is not in the pipeline. */
step_state pipeline_state(const pipeline *p, uint64_t step);

/* The daemon's guards, as questions about the records (server/README.md, "Activities and guards"). */
/* step's outputs are written and its commit waits: computing, its pass done. */
int pipeline_outputs_written(const pipeline *p, uint64_t step);
/* step's commit may start: its outputs written, its sync done, and no committed step settling (the
 * redo record's inputs are durable files).  Whether the sync failed is the caller's to check. */
int pipeline_commit_ready(const pipeline *p, uint64_t step);
/* The cleanup behind the committed step may start while open_step collects: none runs, no publish
 * reads the files, no committed step settles and open_step's commit does not wait. */
int pipeline_cleanup_ready(const pipeline *p, uint64_t open_step);

/* The events the daemon reports; each makes the moves they imply. */
/* The transport holds step: recorded, and served -> published. */
void pipeline_published(pipeline *p, uint64_t step);
/* step's outputs are durable (outer_metadata.json names it): served or published -> durable. */
void pipeline_durable(pipeline *p, uint64_t step);
/* The files before step were removed: every durable record up to step -> cleaned. */
void pipeline_cleaned(pipeline *p, uint64_t step);

#endif
