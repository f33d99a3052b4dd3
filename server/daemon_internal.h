/* The daemon's state, shared by the files that act on it: server/daemon*.c only (the pipeline, one
 * concern per file, calling each other through daemon_parts.h).  The rest of server/ (api/: the
 * routes, uploads) sees it through daemon.h.  Everything here runs on the loop thread. */
#ifndef DAEMON_INTERNAL_H
#define DAEMON_INTERNAL_H

#include <stdatomic.h>
#include <stdint.h>
#include <time.h>

#include <uv.h>

#include "config.h"
#include "daemon.h"
#include "delta.h"
#include "history.h"
#include "http.h"
#include "hub.h"
#include "intake.h"
#include "jobs.h"
#include "outer.h"
#include "pipeline.h"
#include "round.h"
#include "safetensors.h"
#include "sign.h"
#include "stats.h"
#include "store.h"
#include "verdicts.h"
#include "workers.h"

#include "util.h"

/* What the daemon does, as /status names it: derived from the pipeline (daemon__state), never stored.
 * Waiting for a global: nothing committed and no model to open a round on.  Otherwise the open round's
 * step says it: collecting, aggregating (computed, its inputs made durable, committed), retry_wait. */
typedef enum dstate { S_WAITING_GLOBAL, S_COLLECTING, S_AGGREGATING, S_RETRY_WAIT } dstate;



/* Each file of the daemon owns a part of its state (the other files call that file's functions). */

/* daemon_pass.c: the pass of the closing round and its retries.  The pass jobs get `pass` as their
 * argument (it stays until the pass is released, and the loop does not touch it while they run). */
typedef struct daemon_aggregation {
    outer_pass *pass;
    char **paths;
    node_stat *nodes;
    uint64_t *sums;             /* [n]: the checksums intake validated (linked deltas), where summed */
    unsigned char *summed;
    size_t n;
    int jobs;                   /* run jobs still out */
    atomic_int *writeback_stop; /* the new global's write-back job (set to 1 to stop it), NULL when none */
    double started;
    double retry_delay;
    uint64_t last_bytes;        /* progress: bytes and time at the last report */
    double last_time;
    char reason[16];            /* why the round closed */
    store_dn dn;                /* async mode: the update's Delayed Nesterov parameters (dn.on 0: sync) */
    size_t *entry;              /* [round entries]: the aggregated ones' indexes in the round, in order */
    float *scales;              /* [n]: weighted_mean's and clipped_mean's per-delta scales (daemon_robust.c) */
    int screening;              /* the pass out is the cosine screen's first (stats only) */
    uint64_t screened_step;     /* the step whose round the cosine screen judged (0: none) */
    int overflow_problem;       /* the last round was discarded: no subset of its deltas made a finite step */
} daemon_aggregation;

/* daemon_intake.c: what waits for an intake job (at most MAX_INTAKE_IN_FLIGHT run). */
typedef struct daemon_intake_queue {
    intake_req **queue;
    size_t n, cap;
    int in_flight;
    int link_refused_said;      /* zero-copy intake fell back to copying: said once */
} daemon_intake_queue;

/* daemon_pass.c: the next pass's output files, warmed while its round collects (daemon__start_warm). */
typedef struct daemon_warm {
    struct warm_args *job;      /* the warm thread's job, NULL when none runs */
    uv_thread_t thread;
    uv_async_t async;           /* the warm thread ended */
    uv_check_t busy_check;      /* while it runs: tells it whether deltas are arriving */
    char *tmp[2];               /* global, momentum: warmed for the pass of step `step`, not yet given */
    uint64_t step;
    char *given[2];             /* the ones given to the current pass (it takes them over, or they go) */
    int failure_said;           /* a warm job failed: logged at warn level once */
} daemon_warm;

/* daemon_publish.c: the publish's retry state (whether one runs is the pipeline's: STEP_ACT_PUBLISH). */
typedef struct daemon_publishing {
    int bootstrap;              /* the publish in flight is the bootstrap's step 0 (the state may have moved on
                                   by the time it is done: a round can close as soon as step 0 is committed) */
    double backoff;             /* seconds before the next publish retry (0: the last one succeeded) */
    double last_started;        /* when the last publish started (daemon__now; < 0: none yet), for
                                   --publish-interval */
    uint64_t coalesced;         /* committed steps never published: a newer one went out instead */
    char last_error[256];
} daemon_publishing;

/* daemon_publish.c: the published layout.  A global above --shard-size is published and served as
 * an index and shards, written from the step's single file into global/set-<step>/ after each commit. */
typedef struct daemon_layout {
    uint32_t nshards;           /* 1: the plain file */
    int64_t step;               /* the step whose set is written (-1: none yet) */
} daemon_layout;

/* daemon_commit.c: the settles that wait (whether a step settles is the pipeline's: pipeline_unsettled). */
typedef struct daemon_settle {
    struct settle_args *retry;          /* a failed settle, retried by settle_timer */
    struct settle_args *after_publish;  /* a settle waiting for the publish (daemon__release_settle) */
    char *unappended;           /* records committed but not yet in rounds.jsonl: lent to each settle job */
} daemon_settle;

/* daemon_async.c: asynchronous mode's nodes (speeds, recommendations) and counts. */
#define ASYNC_NODES_MAX CONFIG_MAX_NODES
#define ASYNC_TAU_BUCKETS 9
typedef struct async_node {
    char node_id[DELTA_NODE_ID_MAX + 1];
    uint64_t last_local_step;
    double last_at;             /* when its last delta was accepted (daemon__now); < 0: never */
    uint64_t steps_per_delta;   /* local steps between its last two deltas, clamped (0: not measured) */
    double speed;               /* local steps per second between them (0: not measured) */
    double interval;            /* seconds between them: how long the measure counts (DYLU_TTL_*) */
    uint64_t last_tau;
    uint64_t deltas;
} async_node;

/* The deltas applied, by a 64-bit hash of (node, base, local_step), with their base: an open-addressing
 * set (0 is an empty slot), for refusing one that comes again (an upload retried after its answer was
 * lost, a file:// tree handed over again at a restart).  Filled at startup from rounds.jsonl. */
typedef struct applied_set {
    uint64_t *keys, *bases;
    size_t n, cap;              /* cap: a power of two, or 0 */
} applied_set;

typedef struct daemon_async {
    async_node *nodes;
    size_t n, cap;
    applied_set applied;
    /* The lowest base the applied set knows every applied delta of (README "Asynchronous mode"): the
     * first step of the unbroken run of async records rounds.jsonl holds up to the committed step, or
     * the step the state started from.  A delta based below it may have gone into an update that
     * compaction forgot, so it is refused as stale (unless the cache held it: acknowledged, not
     * applied).  floor_known 0: set when the first round opens; an adoption sets it again. */
    uint64_t floor;
    int floor_known;
    int opened;                         /* a round was opened on a committed step (a later open is an adoption) */
    uint64_t run_start, run_next;       /* startup: the run of async records loaded so far */
    int run_on;
    uint64_t below_floor;               /* deltas refused for a base below the floor */
    uint64_t tau_hist[ASYNC_TAU_BUCKETS];
    double tau_sum;
    uint64_t accepted, updates, nesterov_steps;
} daemon_async;

/* daemon_robust.c: the norm screen's memory of each node (its trailing aggregated norms, and its latest
 * one for async mode's comparison) and the quarantined deltas, newest last. */
#define ROBUST_TRAIL 8
#define ROBUST_NODES_MAX 4096
#define ROBUST_RECENT 32
typedef struct robust_node {
    char node_id[DELTA_NODE_ID_MAX + 1];
    double trail[ROBUST_TRAIL]; /* ring of its last aggregated norms */
    unsigned ntrail, head;
    double seen_at;             /* loop clock, for replacing the least recently seen */
} robust_node;

typedef struct robust_event {
    char node_id[DELTA_NODE_ID_MAX + 1];
    uint64_t step, local_step;
    double norm, bound;
    char reason[16];            /* max_norm | norm_ratio | cosine */
    char basis[16];             /* what the bound compared with: round | trailing | absolute | mean */
    double at;                  /* Unix seconds (fractional) */
} robust_event;

enum { ROBUST_MAX_NORM, ROBUST_NORM_RATIO, ROBUST_COSINE, ROBUST_OVERFLOW, ROBUST_REASONS };

typedef struct daemon_robust {
    robust_node *nodes;
    size_t n, cap;
    robust_event recent[ROBUST_RECENT];         /* ring */
    size_t nrecent, head;
    uint64_t quarantined[ROBUST_REASONS];
} daemon_robust;

struct cluster;

/* Each node's last deltas and their verdicts (core/verdicts.h), and their file <state>/verdicts.json,
 * replaced on the pool after every change (one write at a time; changes meanwhile are written next). */
typedef struct daemon_verdicts {
    verdicts table;
    int loaded;                 /* the table exists (verdicts_init succeeded) */
    int writing;                /* a write of the file is out */
    uint64_t written;           /* table.changes that the file holds */
    uint64_t write_failures;
} daemon_verdicts;

/* daemon_sign.c: --signing-key (README "Verifiable rounds"). */
#define SIGN_REFUSED_MAX 256
typedef struct sign_refusal {
    char node_id[DELTA_NODE_ID_MAX + 1];
    uint64_t local_step, base;
    char verdict[16];           /* refused | quarantined */
    char reason[32];
} sign_refusal;

#define SIGN_KNOWN_MAX 4096
typedef struct sign_known {
    char *path;
    char hex[65];
} sign_known;

typedef struct daemon_sign {
    int on;
    sign_key key;
    char prev_hash[65];         /* the block hash of the record of step prev_step (the next one's "previous") */
    int64_t prev_step;          /* -1: none known (the next record's previous is null) */
    char prev_out[3][65];       /* that record's outputs' block hashes: global, momentum, accumulator ("": none),
                                   the next record's "base" */
    char (*hash)[65];           /* [nhash]: the open round's entries' block hashes, by the job that syncs them
                                   ("" where not computed), for step hash_step */
    size_t nhash;
    uint64_t hash_step;
    sign_refusal *refused;      /* the open round's deltas refused at arrival (stale), for its record */
    size_t nrefused;
    /* the block hashes of deltas taken into the round, computed as each arrives (by cache path), so that
     * only the last to arrive is hashed beside the pass */
    struct sign_known *known;
    size_t nknown;
} daemon_sign;
/* The downlink (daemon_downlink.c; README, "The downlink"): the view and update the finished pass's step
 * commits with, the committed view and the chain's last updates served, and what was sent. */
typedef struct daemon_downlink {
    store_view pending;         /* the view of step made_step, made after its pass (valid while made) */
    int made;
    uint64_t made_step;
    served_file view;           /* GET /global/view.safetensors: the committed step's view */
    uint64_t view_step;
    int view_hashed;
    unsigned char view_hash[32];
    served_file *updates;       /* GET /global/updates/<s>.safetensors: ring of nring (--updates-keep) slots */
    uint64_t *update_step;      /* [nring]: the step each slot serves */
    unsigned nring;
    uint64_t last_update_bytes, view_bytes;
    double last_seconds, last_gap;
    uint64_t updates_sent, update_bytes_sent, views_sent, view_bytes_sent;
} daemon_downlink;

typedef struct dilocod {
    uv_loop_t loop;
    config *cfg;
    struct cluster *cluster;    /* --cluster-shards (daemon_cluster.c): the bucket is the state, no pipeline runs */
    char *cluster_dir;          /* its state directory: rounds.jsonl of the steps it saw published */
    sbuf cluster_unappended;    /* records for that rounds.jsonl not handed to the pool yet (in order) */
    int cluster_appending;      /* one append job out at a time, so the file keeps their order */
    store st;
    int stopping;
    int exit_code;
    time_t started_at;

    uv_signal_t sigint, sigterm, sighup;
    uv_async_t fatal_async;     /* daemon__fatal: the shutdown starts on the loop's next turn */
    uv_timer_t round_timer, retry_timer, progress_timer, publish_timer, settle_timer, set_timer;

    st_header *model;           /* structure of the global model (same for every step) */
    uint64_t model_params, model_bytes, delta_bytes;
    round_state rnd;
    pipeline pipe;              /* the steps in flight and their lifecycle states (pipeline.h) */

    daemon_intake_queue intake; /* daemon_intake.c */

    daemon_aggregation agg;     /* daemon_pass.c */
    daemon_async async;         /* daemon_async.c */
    daemon_robust robust;       /* daemon_robust.c */
    daemon_sign sign;           /* daemon_sign.c */
    daemon_warm warm;           /* daemon_pass.c */

    /* publish */
    int64_t published_step;     /* -1: nothing published by us or unknown */
    daemon_publishing publish;  /* daemon_publish.c */
    daemon_settle settle;       /* daemon_commit.c */
    char **round_rels;          /* the transport's files of the open round's deltas (--prune-consumed) */
    size_t nround_rels;
    job_owner jobs;             /* every pool job out (jobs.h), for shutdown */
    time_t committed_at;
    double round_opened_wall;   /* Unix seconds the open round opened (the commit before it); 0: not known */

    hub *hub;                   /* the transport (hub.h), NULL for --hub none */
    int bootstrap_in_flight;    /* an adoption or a bootstrap */
    int published_known;        /* the transport has told which step it holds (its first poll) */
    int republish;              /* the committed step was recovered from its redo record: publish it again even
                                   where the transport holds that step (its copy may be what a crash cut short) */

    /* HTTP */
    http_server *http;
    int http_port;
    const daemon_front *front;  /* main's: the routes, the credentials, the uploads (daemon.h) */
    served_global global;       /* what GET /global/... sends (read it with daemon__global) */
    daemon_layout layout;       /* daemon_publish.c */
    int global_stale;           /* the committed global could not be opened yet: an older one is served */

    history history;            /* committed rounds (the last HISTORY_MAX) */
    char *pending_round;        /* the closing round's record, committed with its step (a JSON line) */
    round_record pending_record;
    stats m;                    /* every counter (stats.h) */
    workers workers;            /* what each worker last reported with its deltas (workers.h) */
    daemon_verdicts verdicts;   /* daemon_verdicts.c */
    daemon_downlink down;       /* daemon_downlink.c */
    /* adoptions of a published global refused (its step out of bounds, its header over the cap, ...):
     * counted each time, logged once per step offered */
    uint64_t adoptions_refused;
    int64_t adopt_refused_step; /* the step last refused (-1: none) */

    /* the parts of /status and /metrics, in their order (daemon.h, daemon_status.c) */
    const daemon_provider *providers[DAEMON_PROVIDERS_MAX];
    size_t nproviders;
} dilocod;

static inline double daemon__now(dilocod *d)
{
    return (double)uv_now(&d->loop) / 1000.0;
}

/* The same clock as daemon__now (libuv's monotonic one) read now, not at the start of the loop's
 * iteration, and finer than its milliseconds: for durations (a small pass takes less than one). */
static inline double daemon__clock(void)
{
    return (double)uv_hrtime() / 1e9;
}

/* A time of daemon__now's clock as Unix seconds (the round records' arrival times: wall clock, to
 * read beside closed_at and across restarts). */
static inline double daemon__wall_of(double mono)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9 - (daemon__clock() - mono);
}

/* The one answer to "is this daemon in async mode?".  It was read five ways (cfg->async, rnd.async,
 * agg.dn.on, st.async_cache, the transport's max_staleness); the modules the daemon configures at startup
 * (round, store, the pass's Delayed Nesterov parameters) are given it from here, and the daemon's files
 * ask only this (make lint-layers holds it). */
static inline int daemon__async(const dilocod *d)
{
    return d->cfg->async;
}

const char *daemon__state_name(dstate s);
dstate daemon__state(const dilocod *d);
/* The daemon a job of daemon__queue's belongs to (daemon.h's daemon_of_job, inline for its own files). */
static inline dilocod *daemon__of_job(const pool_job *j)
{
    return container_of(j->owner, dilocod, jobs);
}

#endif
