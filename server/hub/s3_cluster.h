/* s3_cluster: K aggregators sharing one round over one bucket (README, "Scaling out"; --cluster-shards).
 * The bucket is the shared state and the only coordination; every write that decides something is a
 * conditional PUT (If-None-Match: * to create, If-Match to renew or take over):
 *
 *   global/steps/<s>/manifest.json     the round's delta set, written by the first aggregator to close the
 *                                      round (today's rules: expected nodes, timeout and quorum) and adopted
 *                                      by the others after they checked every node's header against it
 *   global/steps/<s>/shard-<i>.claim   a shard's claim with a lease, renewed by its holder; another takes it
 *                                      over only once the lease is over by the object's Last-Modified
 *   global/steps/<s>/model-<i>-of-<S>.safetensors   the new global's shard i (written once; its content is
 *   state/momentum/<s>/shard-<i>-of-<S>.safetensors the same whoever computes it, checked by MD5)
 *   global/steps/<s>/shard-<i>.done    written once, naming the outputs' MD5s and the shard's statistics
 *   global/steps/<s>/published         written once: the step's one publisher, who then writes
 *   global/steps/<s>/model.safetensors.index.json and global/step_count.json (If-Match on the one it read)
 *
 * A shard's inputs are read with ranged GETs (If-Match on the manifest's ETags) into a slice of each delta
 * holding only the shard's tensors, beside the previous global's and the momentum's shard, and the
 * unchanged pass (common/outer.c) runs over them: the per-element arithmetic is the single aggregator's.
 *
 * Everything blocking runs on the cluster's own thread; the loop only reads its view (cluster_status_json,
 * cluster_metrics) under its mutex. */
#ifndef S3_CLUSTER_H
#define S3_CLUSTER_H

#include <stddef.h>
#include <stdint.h>

#include <uv.h>

#include "dl_error.h"
#include "hub_s3.h"
#include "outer.h"
#include "strbuf.h"

/* Where a step stands on this aggregator, told to the loop in order (cluster_config.phase): the daemon moves
 * the step's pipeline record through the table's cluster column (core/pipeline.h, step_strategy). */
typedef enum cluster_phase {
    CLUSTER_PHASE_COLLECTING,   /* the round collects (again, after a refusal reopened it) */
    CLUSTER_PHASE_MANIFEST,     /* the round closed: its manifest is written or adopted */
    CLUSTER_PHASE_SHARDS,       /* the manifest agreed: the shards are computed */
    CLUSTER_PHASE_PUBLISH,      /* every shard done: the index and the step file are written */
    CLUSTER_PHASE_PUBLISHED,    /* the bucket's step file names the step (this aggregator's or another's) */
    CLUSTER_PHASE_REFUSED,      /* a refusal holds this aggregator until the bucket moves on */
} cluster_phase;

typedef struct cluster_config {
    uint32_t shards;            /* S */
    double lease;               /* seconds */
    double poll_interval;
    unsigned expected_nodes;
    char **allow;               /* borrowed */
    size_t nallow;
    unsigned min_nodes;
    double round_timeout;
    const char *optimizer;      /* "nesterov_sgd" | "sgd" */
    double lr, momentum;
    outer_rule rule;
    unsigned trim_k;
    double max_weight_ratio;    /* weighted_mean's cap on a weight, in medians of the round's (core/weights.h) */
    unsigned threads;
    size_t budget_bytes;        /* per pass thread */
    uint64_t max_header;        /* a delta's header cap */
    const char *scratch_dir;    /* local slices: <state>/cache/cluster */
    const char *id;             /* the aggregator's id (its instance adds a random part) */
    const char *init_model;     /* NULL, or a safetensors file published as step 0 into a bucket with no
                                   step_count.json (written once: whoever is first, the others check the bytes) */
    const char *rule_name;      /* --aggregate's name, for the history records */
    /* Called on the loop for each step this aggregator saw published (one JSON round record, as
     * history_record_json writes it: the manifest's nodes, their norms); NULL: none kept */
    void (*record)(void *arg, const char *json);
    void *record_arg;
    /* Called on the loop for each phase a step enters here, in order (with record_arg); NULL: not told */
    void (*phase)(void *arg, uint64_t step, cluster_phase phase);
} cluster_config;

typedef struct cluster cluster;

/* Starts the cluster's thread on a copy of cfg and of the transport's access a (which must stay open
 * while the cluster runs).  stopped(arg) runs on loop once the thread ended after cluster_stop. */
int cluster_start(cluster **out, uv_loop_t *loop, const cluster_config *cfg, const s3_access *a,
                  void (*stopped)(void *), void *arg, dl_error *err);
/* Asks the thread to stop (requests in flight are aborted); stopped() follows. */
void cluster_stop(cluster *c);
/* After stopped(): frees it. */
void cluster_free(cluster *c);
/* The cluster's state (a static name: waiting_for_global, collecting, aggregating, publishing, refused) and
 * the bucket's step it last read (-1: none), for /status's top level. */
const char *cluster_state(cluster *c, int64_t *published_step);
/* A lasting condition the operator must look at, as a static name ("output_overflow"), or NULL: /status's
 * top-level "problem", as a single dilocod reports it. */
const char *cluster_problem(cluster *c);
/* /status's "cluster" member (the value only) and /metrics' families. */
void cluster_status_json(cluster *c, sbuf *b);
void cluster_metrics(cluster *c, sbuf *b);

#endif
