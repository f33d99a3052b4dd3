/* outer: one outer step as a streaming, chunked pass over the flat parameter space.
 *
 * For every floating tensor of the global model, chunk by chunk: read the chunk of every delta (in
 * ascending node id order), accumulate in F32, divide by the count, compute per-node statistics,
 * apply the outer optimizer (exactly torch.optim.SGD, nesterov or not, dampening 0, weight decay 0)
 * and write the new parameters (rounded to the global's dtype) and momentum at precomputed offsets.
 * Non-floating tensors are copied unchanged.  Memory is a fixed budget per thread, whatever the model
 * size and node count.  Several threads may call outer_run() on the same pass at once: work items
 * are handed out through an atomic counter.  No libuv here: the server schedules the calls. */
#ifndef OUTER_H
#define OUTER_H

#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#include "checksum.h"
#include "compress.h"
#include "dl_error.h"
#include "safetensors.h"

/* Tests set this to run the portable fmaf() loops where the CPU has AVX2 and FMA (same bits, slower). */
extern int outer_force_portable;

typedef enum outer_rule { OUTER_RULE_MEAN = 0, OUTER_RULE_WEIGHTED, OUTER_RULE_CLIPPED, OUTER_RULE_TRIMMED, OUTER_RULE_MEDIAN } outer_rule;

typedef struct outer_params {
    outer_rule rule;
    unsigned trim_k;
    int nesterov;
    float lr;
    float momentum;             /* 0: plain SGD, no momentum buffers */
    /* Delayed Nesterov (async mode, README "Asynchronous mode"); dn_period 0: the synchronous step.
     * With g the mean of the deltas, per update (every alpha rounded once from double to F32, as torch
     * rounds a Scalar):
     *   "forgather" (dn_paper 0):
     *     a = fma(w, g, a)                          a.add_(g, alpha=w)   (a: the accumulator, 0 if none)
     *     k + 1 < N:  p = fma(plain_alpha, g, p)    p.add_(g, alpha=-lr*w), the momentum unchanged
     *     else:       grad = a / N, the SGD step above on grad, a = 0
     *   "paper" (dn_paper 1, Liu et al. Algorithm 3 with momentum activation c):
     *     a = fma(w, g, a);  p = fma(plain_alpha, g, p)            p.add_(g, alpha=-lr*w/N)
     *     k + 1 < N:  p = fma(c_alpha, m, p) when c > 0 and m exists   p.add_(m, alpha=-lr*c*mu)
     *     else:       m = mu*m + a/N (m = a/N the first time);  p = fma(m_alpha, m, p);  a = 0
     *                                                              p.add_(m, alpha=-lr*(1-c*N+c)*mu) */
    unsigned dn_period;         /* N */
    unsigned dn_k;              /* updates since the last Nesterov step, before this one */
    float dn_weight;            /* w */
    float dn_plain_alpha;       /* forgather: -lr*w; paper: -lr*w/N */
    int dn_paper;
    float dn_c_alpha, dn_m_alpha;       /* paper: -lr*c*mu, -lr*(1-c*N+c)*mu */
} outer_params;

/* Whether this update is a Nesterov step (dn_period 0: every step is). */
#define OUTER_DN_TICK(pp) ((pp)->dn_period == 0 || (pp)->dn_k + 1 >= (pp)->dn_period)

typedef struct outer_node_stats {
    double sumsq;               /* sum of squares of the node's delta */
    double dot;                 /* dot product of the node's delta with the mean */
} outer_node_stats;

typedef struct outer_item {
    size_t tensor;              /* index into the global header's tensors */
    uint64_t begin, end;        /* element range */
} outer_item;

typedef struct outer_pass {
    /* inputs, set by the caller before outer_prepare */
    const char *global_path;
    const char *momentum_path;  /* NULL: no momentum yet (first step, or adopted model) */
    const char *const *delta_paths;     /* in aggregation order (ascending node id); each a single file or
                                           the index of a set (st_index.h) */
    size_t ndeltas;
    const float *delta_scale;
    int stats_only;             /* no output: each delta's norm and its dot product with the center, the
                                   rule's aggregate (params.rule: the plain mean, or the coordinate median) */
    const char *out_global_path;
    const char *out_momentum_path;      /* NULL when params.momentum == 0; with Delayed Nesterov NULL when no
                                           momentum is written (a plain step before the first Nesterov step) */
    int carry_momentum;         /* a plain Delayed Nesterov step that does not read the momentum: momentum_path
                                   is linked as out_momentum_path when the outputs are committed, unread
                                   (its checksum carried over as out_momentum_sum) */
    const char *accum_path;     /* Delayed Nesterov: the accumulator (F32 like the momentum), NULL: zero */
    const char *out_accum_path; /* the new one, NULL when this update is a Nesterov step (a = 0) */
    const st_kv *momentum_meta;         /* metadata for the momentum file */
    size_t momentum_nmeta;
    outer_params params;
    size_t budget_bytes;        /* per thread */
    int defer_sync;             /* outer_finish renames the outputs without fsync: the caller makes them
                                   durable later (its redo record can recompute them after a crash) */
    const char *warm_global_tmp;        /* NULL, or a file of st_writer_warm_create for out_global_path */
    const char *warm_momentum_tmp;      /* the same for out_momentum_path */

    /* state */
    st_file *global, *momentum, *accum;
    struct st_set **deltas;     /* one file or a set each */
    const st_tensor **delta_t;  /* [item tensor][node]: the delta tensor for each global tensor */
    const st_file **delta_f;    /* [item tensor][node]: the file (of its set) that holds it */
    const st_tensor **delta_s;  /* [item tensor][node]: a compressed key's scales (in the same file), or NULL */
    cz_spec *delta_cz;          /* [node]: each delta's encoding, from its own metadata (compress.h) */
    const st_tensor **mom_t;    /* [tensor]: momentum tensor or NULL */
    size_t *mom_spec;           /* [tensor]: index into the momentum writer's specs (the accumulator's too) */
    const st_tensor **acc_t;    /* [tensor]: accumulator tensor or NULL */
    st_writer *w_global, *w_momentum, *w_accum;
    int write_momentum;         /* outputs a momentum file (set by outer_prepare) */
    outer_item *items;
    size_t nitems;
    uint64_t chunk_elems;
    size_t run_items;           /* items a thread takes at a time (RUN_BYTES) */
    atomic_size_t next_item;
    atomic_int abort;
    atomic_uint_fast64_t bytes_done;    /* bytes read + written so far (progress) */
    uint64_t bytes_total;
    pthread_mutex_t lock;       /* guards err and stats merges */
    int rc;
    dl_error err;
    outer_node_stats *stats;    /* [ndeltas] */
    double mean_sumsq;          /* of the aggregate (the mean, or the rule's) */

    /* Content checksums (checksum.h).  The pass computes the checksum of the inputs it reads (each
     * delta, the previous global, the momentum) and of both outputs; outer_finish commits only if every
     * input given a checksum below still has it; an input given none is not checksummed (a copy in our
     * state, which no one else writes).  ck NULL: none computed nor verified. */
    const ck_key *ck;
    const uint64_t *delta_sums;         /* [ndeltas]: the checksum intake validated, where delta_summed[k] */
    const unsigned char *delta_summed;  /* NULL: no delta's is known */
    int global_summed, momentum_summed, accum_summed;   /* the previous global's, momentum's, accumulator's: */
    uint64_t global_sum, momentum_sum, accum_sum;
    uint64_t out_global_sum, out_momentum_sum, out_accum_sum;   /* the outputs', after outer_finish returned 0 */
    int sum_every_input;        /* also the inputs nobody gave a checksum for (tests, benchmarks) */
    uint64_t *in_sums;          /* [ndeltas + 3]: what the pass read (the deltas, the global, the momentum, the
                                   accumulator) */
    unsigned char *summing;     /* [ndeltas + 3]: the inputs whose checksum the pass computes */
} outer_pass;

/* Input numbers for outer_input_changed beside the deltas' 0 .. ndeltas - 1. */
#define OUTER_INPUT_GLOBAL(p) ((p)->ndeltas)
#define OUTER_INPUT_MOMENTUM(p) ((p)->ndeltas + 1)
#define OUTER_INPUT_ACCUM(p) ((p)->ndeltas + 2)
#define OUTER_NINPUTS(p) ((p)->ndeltas + 3)

/* Opens inputs, checks that every delta matches the global's floating keys and shapes, plans the
 * work items and opens the writers (reserving the output space: a full disk fails here).  Whatever
 * it returns, outer_finish must follow (it releases what was opened). */
int outer_prepare(outer_pass *p, dl_error *err);
/* Processes work items until none is left, an error occurs or outer_abort() was called.  Call from
 * any number of threads.  Returns 0 or the pass's first error. */
int outer_run(outer_pass *p);
/* Commits the output files (fsync, rename, fsync of the directory; rename only with defer_sync) if every item succeeded, else
 * removes them.  Frees everything but the stats and the error.  */
int outer_finish(outer_pass *p, dl_error *err);
void outer_abort(outer_pass *p);
/* The new global's descriptor while the pass writes it (after outer_prepare, before outer_finish), or -1. */
int outer_global_fd(const outer_pass *p);
/* After outer_finish failed with DL_E_CHECKSUM_MISMATCH: whether input i (a delta's index, or
 * OUTER_INPUT_GLOBAL / OUTER_INPUT_MOMENTUM) is one whose bytes were not those given a checksum. */
int outer_input_changed(const outer_pass *p, size_t i);
/* Releases what outer_finish left (stats). */
void outer_free(outer_pass *p);

#endif
