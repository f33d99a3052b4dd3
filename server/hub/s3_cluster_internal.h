/* s3_cluster_internal: what the cluster's files share (s3_cluster.h has the protocol): the
 * cluster's state and the calls between s3_cluster_bucket.c (requests, names, the published global),
 * s3_cluster_shard.c (claims, a shard's inputs, its pass and outputs), s3_cluster_intake.c (the round's
 * intake from the listing), s3_cluster_set.c (a node's sharded delta set), s3_cluster_refusal.c,
 * s3_cluster_history.c and s3_cluster.c (the round, the manifest, the publish, the step, the thread, the
 * view).  Private to those files. */
#ifndef S3_CLUSTER_INTERNAL_H
#define S3_CLUSTER_INTERNAL_H

#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#include <cJSON.h>
#include <uv.h>

#include "delta.h"
#include "round.h"
#include "s3_cluster.h"
#include "s3_lease.h"
#include "seen.h"
#include "s3_sync.h"
#include "strbuf.h"

/* phases waiting for the loop: far more than a step makes between two turns of the loop */
#define CL_PHASES_MAX 64

#define PEEK_BYTES 65536u
#define STEPFILE_CAP (64u << 10)
#define CLAIM_CAP 4096u
#define LIST_PAGES_MAX 1000u
#define NODES_MAX 4096u
/* a manifest's cap, whatever its sets' parts (a bucket writer's manifest is hostile too) */
#define MANIFEST_CAP (64u << 20)

enum shard_state { SH_UNCLAIMED, SH_OURS, SH_FOREIGN, SH_DONE };

typedef struct shard_view {
    int state;
    unsigned epoch;
    double lease_age;           /* < 0: unknown */
    uint64_t bytes_read;
    /* the thread's own: a foreign claim's version and since when we have seen it (monotonic s) */
    s3_lease_seen foreign;
} shard_view;

/* One object a tensor is read from: the previous global's file or shard, or a delta. */
typedef struct source {
    char *rel;
    char etag[80];
    uint64_t size;
    st_header *h;
    uint64_t data_start;        /* 8 + N */
    char header_sha[65];        /* of its first 8 + N bytes */
    long status;                /* the last header read's answer (404, 412: not the version asked for) */
} source;

/* The published global the next round builds on. */
typedef struct gmodel {
    int loaded;
    uint64_t step;
    char stepfile_etag[80];
    char model_file[160];
    int ours;                   /* a cluster's per-step index: the momentum is in the bucket */
    unsigned gen;               /* ours: the generation of the manifest it was computed from */
    source *src;
    size_t nsrc;
    st_header *h;               /* every tensor, in the sources' order (a synthetic header) */
    uint32_t *src_of;           /* [tensor of h]: its source */
    uint64_t *src_off;          /* [tensor of h]: its offset in the source */
    uint32_t *shard_of;         /* [tensor of h]: the plan */
    char plan_sha[65];
} gmodel;

/* A node's delta in the round: its listing and its header.  A sharded set (s3_cluster_set.c) is one delta:
 * s is its index (key, ETag, size; header_sha the sha256 of its text; h the set's tensors as one header with
 * the index's metadata), parts its shards in shard order, each read as a single delta's header is. */
typedef struct node_delta {
    char node[DELTA_NODE_ID_MAX + 1];
    uint64_t local_step;
    source s;
    int gone;                   /* a manifest's delta the bucket no longer holds in that version (s.h NULL) */
    double weight;              /* weighted_mean's w_k, read from its header (core/weights.h) */
    source *parts;              /* a set's shards (NULL: a single file) */
    size_t nparts;
    uint32_t *part_of;          /* [tensor of s.h]: the part that holds it */
    char ver[40];               /* a set's version (hub_set_version: every file's key, ETag, size) */
} node_delta;

struct cluster {
    cluster_config cfg;
    char **allow;
    char *scratch;
    char instance[96];
    s3_access a;
    uv_loop_t *loop;
    uv_async_t done_async;
    void (*stopped)(void *);
    void *stopped_arg;
    pthread_t thread;
    atomic_int stop;
    s3s_client s3;
    const char *stall_env;
    long stall_shard, stall_after_pass;

    /* the view, under mu */
    pthread_mutex_t mu;
    const char *state;
    int64_t step, published_step;
    const char *manifest;       /* NULL, "written", "adopted" */
    shard_view *sv;
    uint64_t bytes_read, bytes_written, shards_done, takeovers, publishes, refusals, fenced;
    double read_s, pass_s, write_s;     /* the shards' time reading, in the pass, writing back (all steps) */
    char last_error[300];
    const char *problem;        /* NULL, or "output_overflow": no subset of a round made a finite step */
    size_t refused_count;       /* deltas remembered as refused (the thread's refused map) */
    /* history records (cluster_config.record) the thread made, for the loop (record_async) */
    uv_async_t record_async;
    int record_async_open;
    char **records;
    size_t nrecords;
    /* the phases the steps entered (cluster_config.phase), for the loop, in order (the same async) */
    struct cl_phase_event {
        uint64_t step;
        cluster_phase phase;
    } phases[CL_PHASES_MAX];
    size_t nphases;
    cluster_phase last_phase;   /* the thread's: the last one told, of last_phase_step */
    int64_t last_phase_step;

    /* the thread's */
    gmodel g;
    round_state rnd;
    node_delta *nd;
    size_t nnd;
    seen_map refused;           /* the deltas not to look at again, across steps (refused_*, s3_cluster.c) */
    uint64_t refused_seed;      /* this start's: a worker cannot aim its key names at one probe chain */
    uint64_t polls;             /* listings of nodes/ so far: an entry's last listing (seen_entry.listed) */
    int refused_full_warned;
    int stash_full_warned;      /* a node's directory held more shard files than a poll keeps (said once) */
    uint64_t problem_step;      /* the step whose rounds made problem output_overflow */
    node_delta *m;              /* the manifest's nodes, in its order */
    size_t nm;
    unsigned gen;               /* the manifest's generation: 0, then one more per refusal (a delta refused for its
                                   values or dropped for an overflow: the manifest without it; or, when too few
                                   nodes would be left, the round collected again) */
    char refusal_ignored[80];   /* the ETag of a refusal found unfounded (not verified again) */
    double last_renew;
    char claim_etag[80];
    unsigned claim_renewal;
    char *pending_record;       /* the record of pending_step as this aggregator saw it complete, until published */
    uint64_t pending_step;
};

/* One page of ListObjectsV2 under full (a bucket key prefix), after token (NULL: the first): 0 with l
 * (s3_listing_free it), or -1 (why).  The one listing request of the cluster's walks. */
int cl_list_page(cluster *c, const char *full, const char *token, s3_listing *l, char *why, size_t why_size);
double cl_mono(void);
int cl_stopping(cluster *c);
void cl_nap(cluster *c, double seconds);
void cl_set_state(cluster *c, const char *state);
void cl_fail_view(cluster *c, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
void cl_count(cluster *c, uint64_t *field, uint64_t n);
void cl_shard_set(cluster *c, uint32_t i, int state, unsigned epoch, double age);
void cl_source_free(source *s);
void cl_gmodel_free(gmodel *g);
char *cl_rel_printf(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
char *cl_claim_rel(uint64_t step, unsigned gen, uint32_t i);
char *cl_manifest_rel(uint64_t step, unsigned gen);
char *cl_refusal_rel(uint64_t step, unsigned gen);
char *cl_index_rel(uint64_t step, unsigned gen);
char *cl_done_rel(uint64_t step, unsigned gen, uint32_t i);
int cl_gen_base(const char *stem, unsigned gen, char *out, size_t size);
char *cl_output_rel(uint64_t step, unsigned gen, uint32_t i, uint32_t n);
char *cl_momentum_rel(uint64_t step, unsigned gen, uint32_t i, uint32_t n);
int cl_get_small(cluster *c, const char *rel, size_t cap, s3s_resp *r, char *why, size_t why_size);
long cl_put_small(cluster *c, const char *rel, const char *body, size_t len, const char *if_match, int if_none,
    s3s_resp *r, char *why, size_t why_size);
int cl_read_header(cluster *c, source *s, const char *etag, char *why, size_t why_size);
int cl_list_keys(cluster *c, const char *rel_prefix, char ***keys, size_t *n, char *why, size_t why_size);
void cl_keys_free(char **k, size_t n);
void cl_delete_key(cluster *c, const char *rel);
st_spec *cl_header_specs(const st_header *h);
/* 1 a new step loaded, 0 unchanged, -2 no step file in the bucket, -1 failed (why). */
int cl_sync_global(cluster *c, char *why, size_t why_size);
int64_t cl_bucket_step(cluster *c, char *etag, size_t etag_size);
/* claims (s3_cluster_shard.c) */
typedef enum claim_result { CLAIM_OURS, CLAIM_BUSY, CLAIM_FAILED } claim_result;
claim_result cl_claim_try(cluster *c, uint64_t step, uint32_t i, unsigned *epoch);
int cl_fetch_global_slice(cluster *c, uint32_t i, const char *path, int *fenced, uint64_t step, unsigned epoch,
    char *why, size_t why_size);
long cl_test_hook(const char *name);
int cl_slice_and_check(cluster *c, const char *path, const st_header *gh, size_t k, uint32_t i, uint64_t step,
    unsigned epoch, int *fenced, char *why, size_t why_size);
int cl_shard_work(cluster *c, uint64_t step, uint32_t i, unsigned epoch, size_t *bad);
int cl_shard_is_done(cluster *c, uint64_t step, uint32_t i);
int cl_check_outputs(cluster *c, uint64_t step, double *sumsq, uint32_t *overflowed, char *why, size_t why_size);
int cl_json_u64(const cJSON *o, const char *k, uint64_t *out);
const char *cl_json_str(const cJSON *o, const char *k);

/* s3_cluster_refusal.c: the deltas not taken.  A refusal's kind, as the refused map's entry state. */
enum refusal_kind {
    REFUSED_FOR_GOOD = SEEN_REJECTED,   /* its header, a set, its values, an overflow: warn, counted */
    REFUSED_STALE = SEEN_DONE,          /* an earlier round's: debug */
    REFUSED_THIS_ROUND = SEEN_PENDING,  /* the round's rules (full, not allowed): until the round collects again */
};
/* Whether (key, etag) is remembered as not to look at again (its entry stays while listings hold it). */
int cl_is_refused(cluster *c, const char *key, const char *etag);
/* Remembers (key, etag): 1 newly, 0 already, -1 not (the map is full, or out of memory). */
int cl_remember(cluster *c, const char *key, const char *etag, enum refusal_kind kind);
/* Remembers a delta not to look at again, logged once (refused: warn and counted; stale: debug). */
void cl_refuse(cluster *c, const char *key, const char *etag, const char *why, enum refusal_kind kind);
/* The view's count of remembered deltas. */
void cl_refused_view(cluster *c);
/* Forgets the refusals for this round's rules only (the round collects again). */
void cl_forget_this_round(cluster *c);
/* Forgets what the last complete listing no longer holds. */
void cl_forget_unlisted(cluster *c);
/* Node k's values in shard i are refused: writes refused[.g<gen>].json once. */
void cl_write_refusal(cluster *c, uint64_t step, uint32_t i, size_t k);
/* Every shard's marker is in and one overflowed: writes the refusal of the delta of largest norm. */
void cl_write_overflow_refusal(cluster *c, uint64_t step, const double *sumsq, uint32_t overflowed);
/* A refusal of this generation, checked: 1 verified, the next generation adopted; 2 verified, the step
 * collects again; 0 none (or an unfounded one, ignored); -1 the step cannot go on. */
int cl_check_refusal(cluster *c, uint64_t step);

/* Uploads the file at path as rel, written once (If-None-Match): 0 when rel holds exactly our bytes (ours,
 * or an identical earlier writer's), -1 failed, -2 rel holds other bytes (a conflict no retry mends). */
int cl_put_once(cluster *c, const char *rel, const char *path, char md5[33], uint64_t *size, char *why,
                size_t why_size);

/* s3_cluster_bootstrap.c: step 0 from --init-model (a file or a set) into an empty bucket.  0 published (by
 * us or another), -1 not yet (why; tried again), -2 never (the bucket holds another model: why). */
int cl_bootstrap(cluster *c, char *why, size_t why_size);

/* s3_cluster_history.c: step's record (the manifest's nodes, their norms from sumsq) kept until the step is
 * published; made from the bucket's done markers when another published it first; handed to the loop once
 * the step is published (by us or another); the loop's side of record_async. */
void cl_record_pending(cluster *c, uint64_t step, const double *sumsq);
void cl_record_seen(cluster *c, uint64_t step);
void cl_record_hand_over(cluster *c, uint64_t step);
void cl_records_cb(uv_async_t *a);
/* Step entered phase on this aggregator: told to the loop (cluster_config.phase), once per change. */
void cl_phase(cluster *c, uint64_t step, cluster_phase phase);

/* s3_cluster_intake.c: the round's intake from the listing of nodes/ (single deltas and sets). */
void cl_poll_deltas(cluster *c, uint64_t step);
/* Checks one delta's header against the global and the round's step (rel, etag from the listing):
 * 0 with s's header read, -1 refused (why), -2 not of this round yet (a later one), -3 not read (no answer,
 * or not that version any more: nothing to remember it by), -4 of an earlier one. */
int cl_check_delta(cluster *c, uint64_t step, source *s, const char *etag, delta_info *info, char *why,
                   size_t why_size);
/* The round's rules on a delta whose header holds (its weight, its base step): check_delta's codes. */
int cl_check_round(cluster *c, uint64_t step, const delta_info *info, char *why, size_t why_size);
node_delta *cl_nd_find(cluster *c, const char *node);
int cl_sha256_hex(const void *p, size_t n, char out[65]);

/* s3_cluster_set.c: a node's sharded delta set.  The shards of one node's directory seen in a listing so
 * far (a set's shards are listed before its index: '-' sorts before '.'), kept until the next node's. */
typedef struct set_stash_entry {
    char *rel;
    char etag[80];
    uint64_t size;
} set_stash_entry;
typedef struct set_stash {
    char node[DELTA_NODE_ID_MAX + 1];
    set_stash_entry *e;
    size_t n;
    int capped;                 /* this node's past the cap: said once */
} set_stash;
/* A shard's listing entry (rel in node's directory). */
void cl_stash_shard(cluster *c, set_stash *st, const char *node, const char *rel, const char *etag, uint64_t size);
void cl_stash_free(set_stash *st);
/* The set whose index is rel (listed with etag, size) as d, checked as the single aggregator checks one:
 * check_delta's codes, -5 when a shard it names is not listed yet (it waits), -7 when this version is
 * remembered as refused or taken already (nothing read); d->ver is set for -1 and -4 (the refusals' key).
 * d is the caller's to cl_delta_free. */
int cl_set_candidate(cluster *c, uint64_t step, const set_stash *st, const char *rel, const char *etag,
                     uint64_t size, const char *node, uint64_t local, node_delta *d, delta_info *info, char *why,
                     size_t why_size);
/* The manifest entry e of a set (its key, etag, size, header_sha256 and parts) read again into d (its node,
 * local step set) as the bucket holds it now, with If-Match on the manifest's ETags: 0 (d->gone set when
 * the index or a part is gone or rewritten), -1 not the manifest's or refused (why). */
int cl_set_adopt(cluster *c, uint64_t step, const cJSON *e, node_delta *d, delta_info *info, char *why,
                 size_t why_size);
/* A set's "parts" member of its manifest entry (nothing for a single file: its entry keeps its bytes). */
void cl_set_manifest_parts(sbuf *b, const node_delta *d);
/* The objects ts (of d->s.h) are read from: d's file, or the part that holds each (ts remapped to the
 * part's own header, whose offsets a slice reads). */
void cl_delta_sources(const node_delta *d, const st_tensor **ts, const source **srcs, size_t n);
/* Whether the manifest's version of d is gone from the bucket (its file, or any of a set's): 1, or -1 unknown. */
int cl_delta_gone(cluster *c, const node_delta *d);
/* d's bytes: its file's, or its set's parts' together (saturating; not its index's). */
uint64_t cl_delta_bytes(const node_delta *d);
/* Whether the round has node's delta of local step local in version ver (cl_delta_version), or a later one. */
int cl_have_delta(cluster *c, const char *node, uint64_t local, const char *ver);
/* The refusals' key for d: its ETag, a set's version. */
const char *cl_delta_version(const node_delta *d);
void cl_delta_free(node_delta *d);

/* s3_cluster.c, for the verdicts: a manifest's text, and the view reset for a new generation. */
char *cl_manifest_text(const cluster *c, uint64_t step, unsigned gen, const node_delta *const *nodes, size_t n);
void cl_step_reset_view(cluster *c, uint64_t step);

#endif
