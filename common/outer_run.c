/* outer_run: the pass itself (outer.h): each thread's items read in place or with pread, the checksums of
 * what it read, the mean (or the robust rule), the statistics and the optimizer's kernels over sub-blocks,
 * the new values written out.  A kernel object (the Makefile's KERNEL_OBJ): its loops are built with the
 * flags that keep the outer step's bits identical to torch's. */
#include "outer.h"

#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "convert.h"
#include "delta.h"
#include "kernel_clones.h"
#include "mapread.h"

static int fail_locked(outer_pass *p, const dl_error *e)
{
    pthread_mutex_lock(&p->lock);
    if (p->rc == 0) {
        p->err = *e;
        p->rc = -(int)e->code;
    }
    pthread_mutex_unlock(&p->lock);
    atomic_store(&p->abort, 1);
    return -(int)e->code;
}

/* Elements per sub-block.  An item's inputs are processed a sub-block at a time, so the deltas' lanes and
 * the mean (9 x 64 KiB for 8 F32 deltas) stay in the core's L2 cache through the sum, the statistics and
 * the optimizer.
 *
 * F32 and C64 deltas are read in place: each run of items' range of each delta is mapped read-only, in whole
 * 2 MiB units, each item's pages populated as it comes to them and the units read dropped (see RUN_BYTES), so
 * RSS stays flat (threads x deltas x a few MiB); other dtypes, and data at an offset that is not 4-byte
 * aligned, are read with pread and decoded.  The previous global and momentum (F32, C64) are mapped the same
 * way and read by the optimizer's loops themselves (outer_io); the new values go to the item's buffers and
 * out with pwrite (writing through shared mappings was 6.6x slower: ext4 dirties every buffer of a 2 MiB
 * folio on each 4 KiB write fault).  The mean then adds LANE_W lanes of every delta at a time, so that all
 * the deltas' streams advance together, and the statistics re-read each L1-sized block (STAT_BLOCK) while it
 * is still in cache.  The copy out of the page cache (pread's, 40% of the pass's CPU) is gone.  bench-outer,
 * 8 x 256 MiB F32 from the page cache, 2 threads: 1.6x the pread pass (README, Performance).  Mapping alone did
 * not pay: with 4 KiB page-table entries, one delta at a time per block, and the statistics in double, it
 * measured the same as pread or up to 80% more CPU.
 * A mapped delta that someone truncates while the pass reads it raises SIGBUS; the pass's threads catch
 * it (mapread_guarded) and fail the pass, as pread's short read did. */
enum { SUB_ELEMS = 16384 };

/* An input's window (a delta's, the previous global's or the momentum's): the bytes [from, to) of file
 * mapped read-only at at, for the items of a run (see RUN_BYTES); base == NULL: none, the item reads
 * with pread (tensor: whose data it covers).  lanes is the current item's first lane; the mapping's first
 * dropped bytes (from base) are out of RSS, done with. */
typedef struct outer_map {
    void *base;
    size_t len;
    const float *lanes;
    const st_file *file;
    const st_tensor *tensor;
    uint64_t from, to;
    const char *at;
    size_t dropped;
} outer_map;

/* Per-thread buffers. */
typedef struct outer_bufs {
    unsigned char *raw;         /* 8 bytes per element of an item: the encoded output */
    unsigned char *sub_raw;     /* 8 bytes per element of a sub-block: an input as stored */
    /* the compressed deltas' codes and scales of the item, read once per item (one pread each, not one
     * per sub-block): delta k's at zcodes + k * chunk_elems, zscales + k * zscale_room; NULL when no
     * delta of the pass is compressed */
    unsigned char *zcodes, *zscales;
    size_t zscale_room;
    float *param, *buf, *acc;   /* 2 lanes per element of an item: new parameters, momentum, accumulator */
    float *g;                   /* 2 lanes per element of a sub-block: the mean */
    int32_t *keys;              /* ndeltas: a lane's values as sorted totalOrder keys (trimmed_mean, median) */
    float *d;                   /* ndeltas x 2 lanes per element of a sub-block: the deltas read with pread */
    const float **dk;           /* ndeltas: where delta k's lanes of the current sub-block are */
    outer_map *maps;            /* ndeltas: delta k's window over the current run, or none */
    outer_map gmap, mmap, amap; /* the previous global's / momentum's / accumulator's window, or none */
    int map_units;              /* windows of whole MAPREAD_UNITs (see map_lanes), else of pages */
    outer_node_stats *stats;
    double mean_sumsq;
    uint64_t *in_sums;          /* OUTER_NINPUTS: the checksum terms of what this thread read */
    uint64_t out_sums[3];       /* of what it wrote: the global's, the momentum's, the accumulator's */
    /* The first non-finite output this thread made.  The pass goes on to the end (nothing of it is
     * committed), so that every input's checksum is complete: a delta rewritten after it was validated
     * is then named as the cause (outer_finish prefers the mismatch), not a step retried forever. */
    int bad_output;
    dl_error bad_err;
} outer_bufs;

/* Records a non-finite output (the first one) without stopping the pass. */
static void bad_output(outer_bufs *b, const st_tensor *t, const char *what, uint64_t elem)
{
    if (b->bad_output)
        return;
    b->bad_output = 1;
    dl_fail(&b->bad_err, DL_E_NON_FINITE, t->name, t->name_len, "the outer step made %s at element %" PRIu64
            ": it is not committed", what, elem);
}

/* Adds to *sum the checksum terms of elements [e, e + n) of the model's tensor ti as stored (dtype) in
 * data: a no-op without a key, or with sum NULL (an input nobody verifies). */
static inline void sum_in(const outer_pass *p, size_t ti, st_dtype dtype, uint64_t e, const void *data, size_t n,
                          uint64_t *sum)
{
    if (p->ck != NULL && sum != NULL)
        *sum += ck_blocks(p->ck, (uint32_t)ti, dtype, e, data, n, st_dtype_bits(dtype) / 8);
}

/* n elements of tensor t (the model's tensor ti) from element e on, as F32 lanes in out (F32 and C64 are
 * read straight into it, other dtypes decoded exactly); their checksum terms added to *sum. */
static int read_lanes(const outer_pass *p, size_t ti, const st_file *f, const st_tensor *t, uint64_t e, size_t n,
                      unsigned char *raw, float *out, uint64_t *sum, dl_error *err)
{
    size_t esize = st_dtype_bits(t->dtype) / 8;
    int rc;

    if (t->dtype == ST_F32 || t->dtype == ST_C64) {
        if ((rc = st_read(f, t, e * esize, out, n * esize, err)) == 0)
            sum_in(p, ti, t->dtype, e, out, n, sum);
        return rc;
    }
    if ((rc = st_read(f, t, e * esize, raw, n * esize, err)) != 0)
        return rc;
    sum_in(p, ti, t->dtype, e, raw, n, sum);
    if (cv_decode(t->dtype, raw, out, n) != 0)
        return dl_fail(err, DL_E_UNSUPPORTED_DTYPE, t->name, t->name_len, "cannot decode %s", st_dtype_name(t->dtype));
    return 0;
}

/* Delta k's compressed key (the model's tensor ti) for the item it: its codes and scales into the item's
 * buffers, one read each. */
static int read_item_codes(const outer_pass *p, const outer_item *it, size_t k, outer_bufs *b, dl_error *err)
{
    const size_t at = it->tensor * p->ndeltas + k;
    const cz_spec *cz = &p->delta_cz[k];
    const uint64_t n = it->end - it->begin;
    uint64_t soff, slen;
    int rc;

    delta_scales_range(cz, it->begin, n, &soff, &slen);
    if ((rc = st_read(p->delta_f[at], p->delta_t[at], cz_code_bytes(cz->enc, it->begin), b->zcodes + k * p->chunk_elems,
                      (size_t)cz_code_bytes(cz->enc, n), err)) != 0)
        return rc;
    return st_read(p->delta_f[at], p->delta_s[at], soff, b->zscales + k * b->zscale_room, (size_t)slen, err);
}

/* n values of delta k's compressed key from value e on (s values into the item it), decoded into out
 * from the item's buffers; the checksum terms of its codes and scales added to *sum.  A value that
 * decodes to NaN or Inf (the file changed since its intake checked it) goes into the step, whose output
 * check refuses it, while the checksum names the change. */
static void decode_codes(const outer_pass *p, size_t ti, size_t k, const outer_bufs *b, size_t s, uint64_t e, size_t n,
                         float *out, uint64_t *sum)
{
    const cz_spec *cz = &p->delta_cz[k];
    const unsigned char *codes = b->zcodes + k * p->chunk_elems + cz_code_bytes(cz->enc, s);
    uint64_t soff, slen;

    delta_scales_range(cz, s, n, &soff, &slen);         /* s: a multiple of the block, as e */
    const unsigned char *scales = b->zscales + k * b->zscale_room + soff;
    if (p->ck != NULL && sum != NULL)
        *sum += delta_ck_compressed(p->ck, (uint32_t)ti, cz, e, codes, scales, n);
    (void)cz_decode(cz, codes, scales, e, out, n);
}

/* The bytes read for n values of delta k's tensor of the model's tensor ti. */
static uint64_t delta_bytes_of(const outer_pass *p, size_t ti, size_t k, size_t n)
{
    const size_t at = ti * p->ndeltas + k;
    const cz_spec *cz = &p->delta_cz[k];
    uint64_t soff, slen;

    if (p->delta_s[at] == NULL)
        return (uint64_t)n * (st_dtype_bits(p->delta_t[at]->dtype) / 8);
    delta_scales_range(cz, 0, n, &soff, &slen);
    return cz_code_bytes(cz->enc, n) + slen;
}

/* Sums in double over 8 independent lanes, so the compiler vectorises them without reassociating a
 * single sum; an AVX-512 or AVX2 clone is picked at load time where the CPU has it.  step_sub is cloned
 * too: its loops are elementwise IEEE operations (and -ffp-contract=off fuses nothing), so the vector
 * width changes the speed, not the bits; measured 4% less CPU per pass with AVX-512 here. */
/* The statistics' loops only: products added with fused multiply-adds (the file is built with
 * -ffp-contract=off for the optimizer's bits; see sumsq_dot). */
#if defined(__GNUC__) && !defined(__clang__)
#define STATS_CONTRACT __attribute__((optimize("fp-contract=fast")))
#else
#define STATS_CONTRACT
#endif

/* The outer optimizer's elementwise loops, one per torch operation that fuses.
 *
 * torch.optim.SGD (dampening 0, no weight decay) runs, per parameter:
 *     buf.mul_(mu).add_(g)           two ops, two roundings: buf = (mu*buf) + g   (first step: buf = g)
 *     d = g.add(buf, alpha=mu)       one op:  d = fma(mu, buf, g)                 (nesterov; else d = buf)
 *     param.add_(d, alpha=-lr)       one op:  param = fma(-lr, d, param)
 * add(x, alpha=a) is a single kernel computing self + a*x, and torch's AVX2 and AVX-512 kernels (the ones
 * it runs on every x86-64 CPU with AVX2 and FMA) round that once: the vector body uses fmadd and its
 * scalar tail is contracted by the compiler.  So the two add-with-alpha steps are fmaf() here, and the
 * momentum update is a separate multiply and add.  The kernel objects are built with -ffp-contract=off
 * so that the compiler fuses nothing else: fusing buf's update, or not fusing the others, is a one-ulp
 * difference from torch in a few percent of the elements, and it grows over rounds.
 *
 * fmaf() is exact on every CPU (glibc computes it in software without FMA, much slower), so the result
 * does not depend on the machine.  On x86-64 the loops are compiled a second time for AVX2+FMA, where
 * fmaf is one vfmadd and the loops vectorise, and that copy is chosen at run time (not by target_clones,
 * whose ifunc resolvers ThreadSanitizer cannot run). */
int outer_force_portable;

/* out and in: the new and the previous parameters, either the same buffer (read with pread, updated in
 * place) or the previous global mapped in place and the buffer written out (no restrict between them:
 * the compiler checks the overlap at run time). */
static inline __attribute__((always_inline)) void sgd_axpy_body(float *out, const float *in, const float *restrict x,
                                                                 float alpha, size_t m)
{
    for (size_t j = 0; j < m; j++)
        out[j] = fmaf(alpha, x[j], in[j]);
}

static inline __attribute__((always_inline)) void sgd_nesterov_body(float *out, const float *in,
                                                                     const float *restrict buf,
                                                                     const float *restrict g, float mu, float alpha,
                                                                     size_t m)
{
    for (size_t j = 0; j < m; j++)
        out[j] = fmaf(alpha, fmaf(mu, buf[j], g[j]), in[j]);
}

/* Delayed Nesterov's accumulator: out = fma(alpha, x, in), a.add_(g, alpha=w), from a zero one when in is NULL
 * (torch adds to +0: fma(w, g, +0), which is not w * g for a -0 product) */
static inline __attribute__((always_inline)) void dn_accumulate_body(float *out, const float *in,
                                                                      const float *restrict x, float alpha, size_t m)
{
    if (in == NULL) {
        for (size_t j = 0; j < m; j++)
            out[j] = fmaf(alpha, x[j], 0.0f);
        return;
    }
    for (size_t j = 0; j < m; j++)
        out[j] = fmaf(alpha, x[j], in[j]);
}

/* Delayed Nesterov's gradient in place of the mean: g = fma(w, g, a) / N (the accumulator's last add, then
 * p.grad = a / N: a true division, rounded once more) */
static inline __attribute__((always_inline)) void dn_grad_body(float *restrict g, const float *acc, float w, float n,
                                                                size_t m)
{
    if (acc == NULL) {
        for (size_t j = 0; j < m; j++)
            g[j] = fmaf(w, g[j], 0.0f) / n;
        return;
    }
    for (size_t j = 0; j < m; j++)
        g[j] = fmaf(w, g[j], acc[j]) / n;
}

#if defined(__x86_64__) && defined(__GNUC__)
#define HAVE_FMA_PATH 1

__attribute__((target("avx2,fma"))) static void dn_accumulate_fma(float *out, const float *in,
                                                                   const float *restrict x, float alpha, size_t m)
{
    dn_accumulate_body(out, in, x, alpha, m);
}

__attribute__((target("avx2,fma"))) static void dn_grad_fma(float *restrict g, const float *acc, float w, float n,
                                                             size_t m)
{
    dn_grad_body(g, acc, w, n, m);
}

__attribute__((target("avx2,fma"))) static void sgd_axpy_fma(float *out, const float *in, const float *restrict x,
                                                              float alpha, size_t m)
{
    sgd_axpy_body(out, in, x, alpha, m);
}

__attribute__((target("avx2,fma"))) static void sgd_nesterov_fma(float *out, const float *in,
                                                                  const float *restrict buf,
                                                                  const float *restrict g, float mu, float alpha,
                                                                  size_t m)
{
    sgd_nesterov_body(out, in, buf, g, mu, alpha, m);
}

static int have_fma(void)
{
    static _Atomic int cached = -1;     /* every thread computes the same value */
    int v = atomic_load_explicit(&cached, memory_order_relaxed);
    if (v < 0) {
        /* libgcc reports AVX2 and FMA only when the OS also saves the YMM registers */
        __builtin_cpu_init();
        v = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
        atomic_store_explicit(&cached, v, memory_order_relaxed);
    }
    return v;
}
#endif

/* out = fma(alpha, x, in): torch's param.add_(x, alpha=alpha) */
/* The AVX2+FMA copy of a loop where the CPU runs it (and outer_force_portable is off), else the portable one:
 * the same bits either way. */
#ifdef HAVE_FMA_PATH
#define FMA_OR_PORTABLE(loop, ...)                                                                              \
    do {                                                                                                        \
        if (!outer_force_portable && have_fma())                                                               \
            loop##_fma(__VA_ARGS__);                                                                            \
        else                                                                                                    \
            loop##_body(__VA_ARGS__);                                                                           \
    } while (0)
#else
#define FMA_OR_PORTABLE(loop, ...) loop##_body(__VA_ARGS__)
#endif

static void sgd_axpy(float *out, const float *in, const float *restrict x, float alpha, size_t m)
{
    FMA_OR_PORTABLE(sgd_axpy, out, in, x, alpha, m);
}

/* out = fma(alpha, fma(mu, buf, g), in): torch's d = g.add(buf, alpha=mu); param.add_(d, alpha=alpha) */
static void sgd_nesterov(float *out, const float *in, const float *restrict buf, const float *restrict g, float mu,
                         float alpha, size_t m)
{
    FMA_OR_PORTABLE(sgd_nesterov, out, in, buf, g, mu, alpha, m);
}

static void dn_accumulate(float *out, const float *in, const float *restrict x, float alpha, size_t m)
{
    FMA_OR_PORTABLE(dn_accumulate, out, in, x, alpha, m);
}

static void dn_grad(float *restrict g, const float *acc, float w, float n, size_t m)
{
    FMA_OR_PORTABLE(dn_grad, g, acc, w, n, m);
}

/* Lanes per block of the mean and the statistics: the block's mean (8 KiB) stays in L1 while every delta's
 * lanes are added to it, and each delta's block is still in L1 or L2 when its statistics read it again. */
enum { STAT_BLOCK = 2048, LANE_W = 16 };
/* LANE_W F32 lanes are held as two half_vecs of 8 (one AVX2 register each; the AVX-512 clone uses them as
 * they are).  One 16-float vector type was lowered by GCC's AVX2 clone through the stack (each operation
 * stored, reloaded by 16-byte halves, reassembled with vpinsrq): on a CPU without AVX-512 the mean and the
 * statistics took 66% of the pass's samples, most on those moves (perf annotate; issue 39).  Their + and /
 * are elementwise IEEE operations, the same bits as the scalar ones, and the statistics keep the same 16
 * lanes in the same order. */
typedef float half_vec __attribute__((vector_size(LANE_W / 2 * sizeof(float))));
enum { HALF_W = LANE_W / 2 };

/* *ss += sum x[i]^2 and *dot += sum x[i]*y[i] over m <= STAT_BLOCK lanes, reading x once.  Products and
 * sums in F32 vectors, two per sum, each lane adding at most STAT_BLOCK / (2 * LANE_W) = 64 terms; the
 * block's sums then go into the pass's doubles.  That is blocked summation (numpy's float32 sum adds
 * 128-term blocks the same way): a sum of squares is within 66 F32 roundings (< 4e-6 relative).
 * The statistics are reported, not part of the step's bytes, so unlike the optimizer's loops they may
 * fuse: each += of a product is one fused multiply-add (STATS_CONTRACT), one rounding instead of two
 * (the bound above counts two) and half the instructions: bench-outer, 8 x 1 GiB, medians of 7,
 * 1.734 -> 1.593 s and 1.616 -> 1.525 s (the statistics cost 0.29 s: 1.447 s without them); four
 * accumulators per sum instead of two measured no better (1.589 s).  (In double throughout, the
 * conversions made this a quarter of the pass's CPU.) */
/* The block again in double, when an F32 square or sum overflowed (finite values of magnitude above
 * about 1.8e19 do): a square of any finite F32 fits a double, so the statistics stay finite for every
 * finite input, and a screen or a done marker never meets an inf the deltas did not hold.  Rare, so
 * plain scalar code. */
static void sumsq_dot_double(const float *x, const float *y, size_t m, double *ss, double *dot)
{
    double a = 0, b = 0;
    for (size_t j = 0; j < m; j++) {
        a += (double)x[j] * x[j];
        b += (double)x[j] * y[j];
    }
    *ss = a;
    *dot = b;
}

KERNEL_CLONES STATS_CONTRACT static void sumsq_dot(const float *restrict x, const float *restrict y, size_t m,
                                                   double *ss, double *dot)
{
    /* two sums of LANE_W lanes each (s0, s1 and d0, d1), each held as its low and high half */
    half_vec s0l = {0}, s0h = {0}, s1l = {0}, s1h = {0}, d0l = {0}, d0h = {0}, d1l = {0}, d1h = {0};
    half_vec xl, xh, yl, yh;
    float st = 0, dt = 0;
    size_t j = 0;

    for (; j + 2 * LANE_W <= m; j += 2 * LANE_W) {
        memcpy(&xl, x + j, sizeof(xl));
        memcpy(&xh, x + j + HALF_W, sizeof(xh));
        memcpy(&yl, y + j, sizeof(yl));
        memcpy(&yh, y + j + HALF_W, sizeof(yh));
        s0l += xl * xl;
        s0h += xh * xh;
        d0l += xl * yl;
        d0h += xh * yh;
        memcpy(&xl, x + j + LANE_W, sizeof(xl));
        memcpy(&xh, x + j + LANE_W + HALF_W, sizeof(xh));
        memcpy(&yl, y + j + LANE_W, sizeof(yl));
        memcpy(&yh, y + j + LANE_W + HALF_W, sizeof(yh));
        s1l += xl * xl;
        s1h += xh * xh;
        d1l += xl * yl;
        d1h += xh * yh;
    }
    for (; j < m; j++) {
        st += x[j] * x[j];
        dt += x[j] * y[j];
    }
    s0l += s1l;
    s0h += s1h;
    d0l += d1l;
    d0h += d1h;
    double a = st, b = dt;
    for (int l = 0; l < HALF_W; l++) {
        a += s0l[l];
        b += d0l[l];
    }
    for (int l = 0; l < HALF_W; l++) {
        a += s0h[l];
        b += d0h[l];
    }
    if (!isfinite(a) || !isfinite(b))
        sumsq_dot_double(x, y, m, &a, &b);
    *ss += a;
    *dot += b;
}

/* IEEE-754 totalOrder as a signed integer order (finite values: -0 before +0); its own inverse. */
static inline int32_t total_order_key(int32_t i)
{
    return i ^ (int32_t)((uint32_t)(i >> 31) >> 1);
}

/* The sorted keys of the N values of lane j (insertion sort: N is a round's node count). */
static void sorted_keys(const float *const *dk, size_t j, size_t nd, int32_t *keys)
{
    for (size_t k = 0; k < nd; k++) {
        int32_t bits, key;
        memcpy(&bits, dk[k] + j, sizeof(bits));
        key = total_order_key(bits);
        size_t i = k;
        for (; i > 0 && keys[i - 1] > key; i--)
            keys[i] = keys[i - 1];
        keys[i] = key;
    }
}

static inline float key_value(int32_t key)
{
    int32_t bits = total_order_key(key);
    float v;
    memcpy(&v, &bits, sizeof(v));
    return v;
}

/* The rules other than the mean over m lanes (README, "Robust aggregation"; every operation in F32, in
 * node order for the sums, the file built with -ffp-contract=off so no product is fused). */
static void rule_block(const outer_pass *p, const float *const *dk, size_t j0, float *restrict g, size_t m,
                       outer_bufs *b)
{
    const size_t nd = p->ndeltas;
    const float *s = p->delta_scale;

    switch (p->params.rule) {
    case OUTER_RULE_WEIGHTED:
    case OUTER_RULE_CLIPPED: {
        /* g = ((+0 + s0*d0) + s1*d1) + ...; clipped_mean then / N */
        const int divide = p->params.rule == OUTER_RULE_CLIPPED;
        const float count = (float)nd;
        for (size_t j = 0; j < m; j++) {
            float acc = 0.0f + s[0] * dk[0][j0 + j];
            for (size_t k = 1; k < nd; k++)
                acc = acc + s[k] * dk[k][j0 + j];
            g[j] = divide ? acc / count : acc;
        }
        return;
    }
    case OUTER_RULE_MEDIAN:
        for (size_t j = 0; j < m; j++) {
            sorted_keys(dk, j0 + j, nd, b->keys);
            g[j] = key_value(b->keys[(nd - 1) / 2]);
        }
        return;
    case OUTER_RULE_TRIMMED: {
        const size_t k = p->params.trim_k < (nd - 1) / 2 ? p->params.trim_k : (nd - 1) / 2;
        const float kept = (float)(nd - 2 * k);
        for (size_t j = 0; j < m; j++) {
            sorted_keys(dk, j0 + j, nd, b->keys);
            float acc = 0.0f + key_value(b->keys[k]);
            for (size_t i = k + 1; i < nd - k; i++)
                acc = acc + key_value(b->keys[i]);
            g[j] = acc / kept;
        }
        return;
    }
    case OUTER_RULE_MEAN:
        return;
    }
}

/* The mean (or the rule's aggregate) and the statistics over m lanes (m <= STAT_BLOCK): delta k's lanes
 * at dk[k] + j0. */
KERNEL_CLONES static void mean_block(const outer_pass *p, const float *const *dk, size_t j0, float *restrict g,
                                     size_t m, outer_bufs *b)
{
    const float count = (float)p->ndeltas;
    const float *restrict d0 = dk[0] + j0;

    if (p->params.rule != OUTER_RULE_MEAN) {
        rule_block(p, dk, j0, g, m, b);
        goto stats;
    }

    /* mean: sum(deltas) / len(deltas) in torch, F32, in node order.  Python's sum() starts from the
     * integer 0, and 0 + -0.0 is +0.0: the first term is added to +0, not copied.  The division is a
     * true division (torch divides by the count; a reciprocal multiply would differ). */
    size_t j = 0;
    /* LANE_W lanes of every delta at a time, in registers: all the deltas' streams advance together (a
     * delta at a time, the hardware prefetcher restarted at each 4 KiB page of each delta) */
    for (; j + LANE_W <= m; j += LANE_W) {
        half_vec lo, hi, xl, xh;
        memcpy(&lo, d0 + j, sizeof(lo));
        memcpy(&hi, d0 + j + HALF_W, sizeof(hi));
        lo = 0.0f + lo;
        hi = 0.0f + hi;
        for (size_t k = 1; k < p->ndeltas; k++) {
            memcpy(&xl, dk[k] + j0 + j, sizeof(xl));
            memcpy(&xh, dk[k] + j0 + j + HALF_W, sizeof(xh));
            lo += xl;
            hi += xh;
        }
        lo /= count;
        hi /= count;
        memcpy(g + j, &lo, sizeof(lo));
        memcpy(g + j + HALF_W, &hi, sizeof(hi));
    }
    for (; j < m; j++) {
        float acc = 0.0f + d0[j];
        for (size_t k = 1; k < p->ndeltas; k++)
            acc += dk[k][j0 + j];
        g[j] = acc / count;
    }
stats:
    for (size_t k = 0; k < p->ndeltas; k++)
        sumsq_dot(dk[k] + j0, g, m, &b->stats[k].sumsq, &b->stats[k].dot);
    double unused = 0;
    sumsq_dot(g, g, m, &b->mean_sumsq, &unused);
}

/* A sub-block's parameters and momentum: the new ones are written to param and buf; the previous ones
 * are read from param_in and buf_in, which are either the same buffers (read there with pread) or the
 * previous files mapped in place. */
typedef struct outer_io {
    float *param, *buf, *acc;
    const float *param_in, *buf_in, *acc_in;    /* acc_in NULL: a zero accumulator */
} outer_io;

/* The mean, the statistics and the optimizer over m lanes of one sub-block: delta k's lanes are at dk[k];
 * io says where the previous parameters and momentum (when momentum is on and have_buf) are and where the
 * new ones go. */
KERNEL_CLONES static void step_sub(const outer_pass *p, const float *const *dk, const outer_io *io, int have_buf,
                                   size_t m, outer_bufs *b)
{
    const float lr = p->params.lr, mu = p->params.momentum;
    float *restrict g = b->g;
    float *buf = io->buf;
    const float *buf_in = io->buf_in;

    for (size_t j0 = 0; j0 < m; j0 += STAT_BLOCK)
        mean_block(p, dk, j0, g + j0, m - j0 < STAT_BLOCK ? m - j0 : STAT_BLOCK, b);
    if (p->stats_only)
        return;
    if (p->params.dn_period != 0) {
        /* Delayed Nesterov (outer.h): a plain step between Nesterov steps, the momentum carried over */
        const outer_params *pp = &p->params;
        if (!OUTER_DN_TICK(pp)) {
            dn_accumulate(io->acc, io->acc_in, g, pp->dn_weight, m);
            sgd_axpy(io->param, io->param_in, g, pp->dn_plain_alpha, m);
            if (pp->dn_paper && pp->dn_c_alpha != 0.0f && have_buf && mu != 0.0f)
                sgd_axpy(io->param, io->param, buf_in, pp->dn_c_alpha, m);
            if (p->write_momentum && have_buf && buf != buf_in)
                memcpy(buf, buf_in, m * sizeof(float));
            return;
        }
        if (pp->dn_paper) {
            /* the direct step on this update's g first (g becomes a / N below) */
            sgd_axpy(io->param, io->param_in, g, pp->dn_plain_alpha, m);
            dn_grad(g, io->acc_in, pp->dn_weight, (float)pp->dn_period, m);
            if (mu == 0.0f)
                return;
            if (have_buf) {
                for (size_t j = 0; j < m; j++)
                    buf[j] = mu * buf_in[j] + g[j];         /* mul_ then add_: not fused */
            } else {
                memcpy(buf, g, m * sizeof(float));
            }
            sgd_axpy(io->param, io->param, buf, pp->dn_m_alpha, m);
            return;
        }
        dn_grad(g, io->acc_in, pp->dn_weight, (float)pp->dn_period, m);
    }
    /* torch.optim.SGD, as described above the sgd_* loops */
    if (mu == 0.0f) {
        sgd_axpy(io->param, io->param_in, g, -lr, m);
        return;
    }
    if (have_buf) {
        for (size_t j = 0; j < m; j++)
            buf[j] = mu * buf_in[j] + g[j];         /* mul_ then add_: not fused */
    } else {
        memcpy(buf, g, m * sizeof(float));
    }
    if (p->params.nesterov)
        sgd_nesterov(io->param, io->param_in, buf, g, mu, -lr, m);
    else
        sgd_axpy(io->param, io->param_in, buf, -lr, m);
}

/* ---- reading deltas in place ----------------------------------------------------------------------
 * A pass thread reads mapped deltas under mapread's SIGBUS guard (common/mapread.h): a delta truncated
 * under the mapping, or a page the disk failed to read, fails the item as a short pread would. */

static void unmap_window(outer_map *m)
{
    mapread_unmap(m->base, m->len);
    m->base = NULL;
    m->file = NULL;
    m->tensor = NULL;
}

/* Points m->lanes at the F32 lanes [first, first + n) of tensor t of f (its F32 or C64 data, at an
 * aligned offset), populated, the window's whole units (pages) before them dropped; when the window does not
 * cover them, a new one covers them and the next ahead lanes of the run.  Otherwise (another dtype, or
 * mmap failed) leaves m->base NULL and the item reads them with pread. */
static void map_lanes(const st_file *f, const st_tensor *t, uint64_t first, uint64_t n, uint64_t ahead, int units,
                      outer_map *m)
{
    const uint64_t off = f->data_start + t->begin + first * 4, len = n * 4;

    if (m->base == NULL || m->file != f || m->tensor != t || off < m->from || off + len > m->to) {
        unmap_window(m);
        if ((t->dtype != ST_F32 && t->dtype != ST_C64) || off % 4 != 0)
            return;
        /* With units, the window covers whole 2 MiB units of the file (within its size): where the page
         * cache holds the data in 2 MiB folios, the kernel maps them with one page-table entry each, and
         * the pass's loads miss the TLB 512 times less often than through 4 KiB entries (bench-outer,
         * 8 x 256 MiB: 0.29 s against 0.35-0.39 s with page-sized windows). */
        /* a shard of a set is lazy (st_file_lazy): its descriptor is held for the mmap only, the mapping
         * keeps the file; one that cannot be opened leaves the pread path to report it */
        int fd;
        if (st_file_acquire(f, &fd, NULL) != 0)
            return;
        m->at = mapread_reserve(fd, f->file_size, off, len + ahead * 4, units, &m->base, &m->len);
        st_file_release(f);
        if (m->at == NULL)
            return;
        m->file = f;
        m->tensor = t;
        m->from = off;
        m->to = off + len + ahead * 4;
        m->dropped = 0;
    }
    m->lanes = (const float *)(m->at + (off - m->from));
    /* the window starts on a unit (or page) of the file: the whole units (pages) before this item are
     * done with */
    const size_t grain = units ? MAPREAD_UNIT : (size_t)sysconf(_SC_PAGESIZE);
    size_t done = (size_t)((const char *)m->lanes - (const char *)m->base);
    done -= done % grain;
    if (done > m->dropped) {
        mapread_drop(m->base, m->dropped, done);
        m->dropped = done;
    }
    mapread_populate(m->lanes, (size_t)len);
}

/* Item it's lanes of tensor t (the global's, or a delta's, whose tensor has the same elements) mapped. */
static void map_item(const st_file *f, const st_tensor *t, const outer_item *it, uint64_t run_end, int units,
                     outer_map *m)
{
    const size_t lanes = cv_lanes(t->dtype);
    map_lanes(f, t, it->begin * lanes, (it->end - it->begin) * lanes, (run_end - it->end) * lanes, units, m);
}

static void unmap_inputs(outer_map *maps, size_t n)
{
    for (size_t k = 0; k < n; k++)
        unmap_window(&maps[k]);
}

/* A state file's F32 lanes (the momentum's or the accumulator's, t of f) for sub-block s of the item at
 * element e: in place from its window m, or read into buf; *in points at them, their checksum terms
 * added to *sum. */
static int state_lanes(const outer_pass *p, size_t ti, const st_file *f, const st_tensor *t, const outer_map *m,
                       size_t s, uint64_t e, size_t sn, float *buf, uint64_t *sum, const float **in, dl_error *err)
{
    const size_t lanes = cv_lanes(p->global->h->tensors[ti].dtype);
    int rc;

    if (m->base != NULL) {
        *in = m->lanes + s * lanes;
    } else {
        if ((rc = st_read(f, t, e * lanes * 4, buf, sn * lanes * 4, err)) != 0)
            return rc;
        *in = buf;
    }
    sum_in(p, ti, t->dtype, e, *in, sn, sum);
    return 0;
}

/* The sub-blocks of item it: the global's and the momentum's lanes in place or into param and buf, the
 * deltas' in place or into b->d, and the step over them into param and buf.  Adds the bytes it read to
 * *bytes. */
static __attribute__((noinline)) int step_item(outer_pass *p, const outer_item *it, outer_bufs *b, uint64_t *bytes,
                                               dl_error *err)
{
    const size_t ti = it->tensor;
    const st_tensor *t = &p->global->h->tensors[ti], *mt = p->mom_t[ti];
    const size_t n = (size_t)(it->end - it->begin), lanes = cv_lanes(t->dtype);
    const size_t nd = p->ndeltas, sub = SUB_ELEMS;
    const int mom = p->params.momentum != 0.0f;     /* the previous momentum is read */
    /* the inputs whose checksum someone verifies: the others' terms are not computed */
    uint64_t *const gsum = p->summing[nd] ? &b->in_sums[nd] : NULL;
    uint64_t *const msum = p->summing[nd + 1] ? &b->in_sums[nd + 1] : NULL;
    uint64_t *const asum = p->summing[nd + 2] ? &b->in_sums[nd + 2] : NULL;
    const st_tensor *at = p->acc_t[ti];
    int rc;

    for (size_t k = 0; k < nd; k++)
        if (p->delta_s[ti * nd + k] != NULL && (rc = read_item_codes(p, it, k, b, err)) != 0)
            return rc;
    for (size_t s = 0; s < n; s += sub) {
        const size_t sn = n - s < sub ? n - s : sub;
        const uint64_t e = it->begin + s;
        outer_io io = {b->param + s * lanes, b->buf + s * lanes, b->acc + s * lanes, NULL, NULL, NULL};
        if (p->stats_only) {
            io.param_in = io.param;     /* the previous global is not read: no step */
        } else if (b->gmap.base != NULL) {
            io.param_in = b->gmap.lanes + s * lanes;
            sum_in(p, ti, t->dtype, e, io.param_in, sn, gsum);
        } else {
            if ((rc = read_lanes(p, ti, p->global, t, e, sn, b->sub_raw, io.param, gsum, err)) != 0)
                return rc;
            io.param_in = io.param;
        }
        for (size_t k = 0; k < nd; k++) {
            const st_tensor *dt = p->delta_t[ti * nd + k];
            const st_file *df = p->delta_f[ti * nd + k];
            uint64_t *dsum = p->summing[k] ? &b->in_sums[k] : NULL;
            if (b->maps[k].base != NULL) {
                b->dk[k] = b->maps[k].lanes + s * lanes;
                sum_in(p, ti, dt->dtype, e, b->dk[k], sn, dsum);
            } else if (p->delta_s[ti * nd + k] != NULL) {
                decode_codes(p, ti, k, b, s, e, sn, b->d + k * sub * 2, dsum);
                b->dk[k] = b->d + k * sub * 2;
            } else {
                if ((rc = read_lanes(p, ti, df, dt, e, sn, b->sub_raw, b->d + k * sub * 2, dsum, err)) != 0)
                    return rc;
                b->dk[k] = b->d + k * sub * 2;
            }
            *bytes += delta_bytes_of(p, ti, k, sn);
        }
        if (mom && mt != NULL &&
            (rc = state_lanes(p, ti, p->momentum, mt, &b->mmap, s, e, sn, io.buf, msum, &io.buf_in, err)) != 0)
            return rc;
        if (at != NULL && (rc = state_lanes(p, ti, p->accum, at, &b->amap, s, e, sn, io.acc, asum, &io.acc_in, err)) != 0)
            return rc;
        if (mom && mt != NULL)
            *bytes += sn * lanes * 4;
        if (at != NULL)
            *bytes += sn * lanes * 4;
        step_sub(p, b->dk, &io, mt != NULL, sn * lanes, b);
        if (p->stats_only)
            continue;
        /* never a non-finite output: the inputs are finite, but a sum or a step can overflow */
        int64_t bad = delta_find_non_finite(ST_F32, io.param, sn * lanes);
        if (bad < 0 && p->write_momentum)
            bad = delta_find_non_finite(ST_F32, io.buf, sn * lanes);
        if (bad < 0 && p->w_accum != NULL)
            bad = delta_find_non_finite(ST_F32, io.acc, sn * lanes);
        if (bad >= 0)
            bad_output(b, t, "a non-finite value (the deltas' mean or the step overflowed)", e + (uint64_t)bad / lanes);
    }
    return 0;
}

typedef struct step_item_args {
    outer_pass *p;
    const outer_item *it;
    outer_bufs *b;
    uint64_t *bytes;
    dl_error *err;
} step_item_args;

static int step_item_call(void *arg)
{
    step_item_args *a = arg;
    return step_item(a->p, a->it, a->b, a->bytes, a->err);
}

/* step_item under the SIGBUS guard, with the item's inputs (deltas, previous global and momentum) read
 * in place where they can be: in the run's windows, which cover the tensor up to run_end. */
static int step_item_guarded(outer_pass *p, const outer_item *it, uint64_t run_end, outer_bufs *b, uint64_t *bytes,
                             dl_error *err)
{
    const size_t nd = p->ndeltas;
    const st_tensor *t = &p->global->h->tensors[it->tensor], *mt = p->mom_t[it->tensor];
    step_item_args args = {p, it, b, bytes, err};
    int rc;

    for (size_t k = 0; k < nd; k++)
        map_item(p->delta_f[it->tensor * nd + k], p->delta_t[it->tensor * nd + k], it, run_end, b->map_units,
                 &b->maps[k]);
    /* the previous global and momentum read in place too, into the step's loops (the same windows) */
    if (!p->stats_only)
        map_item(p->global, t, it, run_end, b->map_units, &b->gmap);
    if (p->params.momentum != 0.0f && mt != NULL)
        map_item(p->momentum, mt, it, run_end, b->map_units, &b->mmap);     /* mt: as many lanes as t */
    else
        unmap_window(&b->mmap);
    if (p->acc_t[it->tensor] != NULL)
        map_item(p->accum, p->acc_t[it->tensor], it, run_end, b->map_units, &b->amap);
    else
        unmap_window(&b->amap);
    if ((rc = mapread_guarded(step_item_call, &args)) == MAPREAD_BUS)
        rc = dl_fail_errno(err, EIO, "tensor %.*s could not be read in place (SIGBUS: a delta shrank, or a page "
                           "could not be read)", (int)t->name_len, t->name);
    return rc;
}

/* One work item, a sub-block at a time; the new parameters and momentum are written with one pwrite each. */
static int process_floating(outer_pass *p, const outer_item *it, uint64_t run_end, outer_bufs *b, dl_error *err)
{
    const st_tensor *t = &p->global->h->tensors[it->tensor];
    const size_t n = (size_t)(it->end - it->begin), lanes = cv_lanes(t->dtype), esize = st_dtype_bits(t->dtype) / 8;
    const int mom = p->write_momentum;
    uint64_t bytes = 0;
    int rc;

    if ((rc = step_item_guarded(p, it, run_end, b, &bytes, err)) != 0)
        return rc;
    if (p->stats_only) {
        atomic_fetch_add(&p->bytes_done, bytes);
        return 0;
    }
    bytes += 2 * (uint64_t)n * esize;
    if (mom) {
        sum_in(p, it->tensor, delta_dtype_for(t->dtype), it->begin, b->buf, n, &b->out_sums[1]);
        if ((rc = st_writer_write(p->w_momentum, p->mom_spec[it->tensor], it->begin * lanes * 4, b->buf,
                                  n * lanes * 4, err)) != 0)
            return rc;
        bytes += (uint64_t)n * lanes * 4;
    }
    if (p->w_accum != NULL) {
        sum_in(p, it->tensor, delta_dtype_for(t->dtype), it->begin, b->acc, n, &b->out_sums[2]);
        if ((rc = st_writer_write(p->w_accum, p->mom_spec[it->tensor], it->begin * lanes * 4, b->acc, n * lanes * 4,
                                  err)) != 0)
            return rc;
        bytes += (uint64_t)n * lanes * 4;
    }
    const void *out = b->param;
    if (t->dtype != ST_F32 && t->dtype != ST_C64) {
        cv_encode(t->dtype, b->param, b->raw, n);
        out = b->raw;
        /* a finite F32 value can round to infinity in F16 */
        int64_t bad = delta_find_non_finite(t->dtype, b->raw, n);
        if (bad >= 0)
            bad_output(b, t, t->dtype == ST_F16 ? "a value beyond F16's range" : "a value beyond BF16's range",
                       it->begin + (uint64_t)bad);
    }
    sum_in(p, it->tensor, t->dtype, it->begin, out, n, &b->out_sums[0]);
    if ((rc = st_writer_write(p->w_global, it->tensor, it->begin * esize, out, n * esize, err)) != 0)
        return rc;
    atomic_fetch_add(&p->bytes_done, bytes);
    return 0;
}

static int process_copy(outer_pass *p, const outer_item *it, outer_bufs *b, dl_error *err)
{
    const st_tensor *t = &p->global->h->tensors[it->tensor];
    size_t esize = st_dtype_bits(t->dtype) / 8;
    size_t len = (size_t)(it->end - it->begin) * esize;
    int rc;

    if (p->stats_only)
        return 0;               /* nothing written: nothing to copy */
    if ((rc = st_read(p->global, t, it->begin * esize, b->raw, len, err)) != 0)
        return rc;
    /* the same bytes in and out: the same terms */
    uint64_t terms = 0;
    sum_in(p, it->tensor, t->dtype, it->begin, b->raw, (size_t)(it->end - it->begin), &terms);
    if (p->summing[p->ndeltas])
        b->in_sums[p->ndeltas] += terms;
    b->out_sums[0] += terms;
    if ((rc = st_writer_write(p->w_global, it->tensor, it->begin * esize, b->raw, len, err)) != 0)
        return rc;
    atomic_fetch_add(&p->bytes_done, 2 * (uint64_t)len);
    return 0;
}

/* Items [i0, i1), a run: the inputs' windows cover each tensor's part of the run from its first item on. */
static int process_run(outer_pass *p, size_t i0, size_t i1, outer_bufs *b, dl_error *err)
{
    for (size_t i = i0, last = i0; i < i1 && !atomic_load(&p->abort); i++) {
        const outer_item *it = &p->items[i];
        int rc;

        if (last < i)
            last = i;
        while (last + 1 < i1 && p->items[last + 1].tensor == it->tensor)
            last++;
        if (st_dtype_is_floating(p->global->h->tensors[it->tensor].dtype))
            rc = process_floating(p, it, p->items[last].end, b, err);
        else
            rc = process_copy(p, it, b, err);
        if (rc != 0)
            return rc;
    }
    return 0;
}

int outer_run(outer_pass *p)
{
    outer_bufs b = {0};
    size_t ce = (size_t)p->chunk_elems;
    dl_error err;
    int rc = 0;

    dl_error_clear(&err);
    b.raw = malloc(ce * 8);
    b.sub_raw = malloc(SUB_ELEMS * 8);
    b.param = malloc(ce * 2 * sizeof(float));
    b.buf = malloc(ce * 2 * sizeof(float));
    b.acc = malloc(ce * 2 * sizeof(float));
    b.g = malloc(SUB_ELEMS * 2 * sizeof(float));
    b.d = malloc(SUB_ELEMS * 2 * sizeof(float) * p->ndeltas);
    b.dk = calloc(p->ndeltas, sizeof(*b.dk));
    b.maps = calloc(p->ndeltas, sizeof(*b.maps));
    b.stats = calloc(p->ndeltas, sizeof(*b.stats));
    b.in_sums = calloc(OUTER_NINPUTS(p), sizeof(*b.in_sums));
    b.keys = calloc(p->ndeltas, sizeof(*b.keys));
    if (!b.raw || !b.sub_raw || !b.param || !b.buf || !b.acc || !b.g || !b.d || !b.dk || !b.maps || !b.stats || !b.in_sums ||
        !b.keys) {
        dl_fail(&err, DL_E_NO_MEMORY, NULL, 0, "out of memory for aggregation buffers");
        rc = fail_locked(p, &err);
        goto out;
    }
    for (size_t k = 0; k < p->ndeltas && b.zcodes == NULL; k++) {
        if (p->delta_cz[k].enc == CZ_NONE)
            continue;
        b.zscale_room = (size_t)(ce / CZ_BLOCK_MIN * 4 + 4);
        if ((b.zcodes = malloc(ce * p->ndeltas)) == NULL || (b.zscales = malloc(b.zscale_room * p->ndeltas)) == NULL) {
            dl_fail(&err, DL_E_NO_MEMORY, NULL, 0, "out of memory for the compressed deltas' buffers");
            rc = fail_locked(p, &err);
            goto out;
        }
    }
    /* Mapped pages count in RSS while they are mapped: whole units only while one item's windows stay
     * within 4 budgets (8 deltas, the global and the momentum at the default 16 MiB: 55 MiB), else
     * windows of pages, which keep just the item's pages (within one budget, as the items are sized) */
    b.map_units = (p->ndeltas + 2) * (p->chunk_elems * 8 + 2 * MAPREAD_UNIT) <= 4 * (uint64_t)p->budget_bytes;
    while (!atomic_load(&p->abort)) {
        size_t i0 = atomic_fetch_add(&p->next_item, p->run_items);
        if (i0 >= p->nitems)
            break;
        rc = process_run(p, i0, i0 + p->run_items < p->nitems ? i0 + p->run_items : p->nitems, &b, &err);
        unmap_inputs(b.maps, p->ndeltas);
        unmap_inputs(&b.gmap, 1);
        unmap_inputs(&b.mmap, 1);
        unmap_inputs(&b.amap, 1);
        if (rc != 0) {
            fail_locked(p, &err);
            goto out;
        }
    }
    pthread_mutex_lock(&p->lock);
    for (size_t k = 0; k < p->ndeltas; k++) {
        p->stats[k].sumsq += b.stats[k].sumsq;
        p->stats[k].dot += b.stats[k].dot;
    }
    p->mean_sumsq += b.mean_sumsq;
    for (size_t k = 0; k < OUTER_NINPUTS(p); k++)
        p->in_sums[k] += b.in_sums[k];
    p->out_global_sum += b.out_sums[0];
    p->out_momentum_sum += b.out_sums[1];
    p->out_accum_sum += b.out_sums[2];
    if (b.bad_output && p->rc == 0) {
        p->rc = -DL_E_NON_FINITE;
        p->err = b.bad_err;
    }
    rc = p->rc;
    pthread_mutex_unlock(&p->lock);
out:
    if (b.maps != NULL)
        unmap_inputs(b.maps, p->ndeltas);
    unmap_inputs(&b.gmap, 1);
    unmap_inputs(&b.mmap, 1);
    unmap_inputs(&b.amap, 1);
    free(b.raw);
    free(b.sub_raw);
    free(b.zcodes);
    free(b.zscales);
    free(b.param);
    free(b.buf);
    free(b.acc);
    free(b.g);
    free(b.d);
    free(b.dk);
    free(b.maps);
    free(b.stats);
    free(b.in_sums);
    free(b.keys);
    return rc;
}
