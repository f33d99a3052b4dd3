#include "test.h"

#include <fcntl.h>
#include <math.h>
#include <pthread.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "checksum.h"
#include "convert.h"
#include "fsutil.h"
#include "outer.h"
#include "st_index.h"

/* Files: a global with an F32 weight "w" (n elements), a BF16 weight "h" (n), a C64 "z" (3) and an
 * I64 "k"; three F32 deltas. */
enum { N = 40009 };     /* more than two of the pass's 16 Ki-element sub-blocks, and not a multiple of one */

static uint32_t bits(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

static float w0[N], dlt[3][N];
static uint16_t h0[N];
static float z0[6], dz[3][6];
static int64_t k0[2] = {41, -7};

/* Elements where the weight and every delta are -0.0: the sign of the result shows whether the mean
 * starts from +0 as Python's sum() does (see zero_sign_checks). */
static int neg_zero_elem(int i)
{
    return i % 1000 == 5;
}

static void make_files(void)
{
    uint64_t sn[] = {N}, s3[] = {3}, s2[] = {2};
    uint32_t seed = 7;
    for (int i = 0; i < N; i++) {
        seed = seed * 1664525u + 1013904223u;
        w0[i] = (float)((int)(seed >> 8) % 2000 - 1000) / 997.0f;
        for (int k = 0; k < 3; k++) {
            seed = seed * 1664525u + 1013904223u;
            dlt[k][i] = (float)((int)(seed >> 8) % 2000 - 1000) / 50021.0f;
        }
        if (neg_zero_elem(i))
            w0[i] = dlt[0][i] = dlt[1][i] = dlt[2][i] = -0.0f;
    }
    cv_f32_to_bf16(w0, h0, N);
    for (int i = 0; i < 6; i++) {
        z0[i] = (float)i - 2.5f;
        for (int k = 0; k < 3; k++)
            dz[k][i] = 0.01f * (float)(i + k);
    }
    st_spec g[] = {{"w", 1, ST_F32, 1, sn}, {"h", 1, ST_BF16, 1, sn}, {"z", 1, ST_C64, 1, s3}, {"k", 1, ST_I64, 1, s2}};
    const void *gd[] = {w0, h0, z0, k0};
    dl_error err;
    if (st_save(test_path("g"), g, gd, 4, NULL, 0, &err) != 0)
        fprintf(stderr, "  %s\n", err.message);
    st_spec d[] = {{"w", 1, ST_F32, 1, sn}, {"h", 1, ST_F32, 1, sn}, {"z", 1, ST_C64, 1, s3}};
    for (int k = 0; k < 3; k++) {
        const void *dd[] = {dlt[k], dlt[(k + 1) % 3], dz[k]};
        char name[8];
        snprintf(name, sizeof(name), "d%d", k);
        st_save(test_path(name), d, dd, 3, NULL, 0, &err);
    }
}

/* ---- what torch computes, one operation at a time ----------------------------------------------
 * Each torch op rounds once.  volatile keeps the compiler from fusing a multiply into the add that
 * follows it (that fusion is what these tests exist to catch); fmaf() is libm's exact fused op. */
static float t_mul(float a, float b)
{
    volatile float r = a * b;
    return r;
}

static float t_add(float a, float b)
{
    volatile float r = a + b;
    return r;
}

/* sum([a, b, c]) / 3: Python's sum starts from the integer 0 */
static float t_mean3(float a, float b, float c)
{
    volatile float r = t_add(t_add(t_add(0.0f, a), b), c) / 3.0f;
    return r;
}

/* One torch.optim.SGD step of one element; *buf is the momentum buffer (have_buf: not the first step).
 * *unfused gets what rounding every product separately would give (to show the test can tell). */
static float t_sgd(outer_params pr, float w, float g, float *buf, int have_buf, float *unfused)
{
    float d;
    if (pr.momentum != 0.0f) {
        *buf = have_buf ? t_add(t_mul(pr.momentum, *buf), g) : g;     /* buf.mul_(mu).add_(g) */
        d = pr.nesterov ? fmaf(pr.momentum, *buf, g) : *buf;            /* g.add(buf, alpha=mu) */
        float d2 = pr.nesterov ? t_add(g, t_mul(pr.momentum, *buf)) : *buf;
        *unfused = t_add(w, t_mul(-pr.lr, d2));
    } else {
        d = g;
        *unfused = t_add(w, t_mul(-pr.lr, g));
    }
    return fmaf(-pr.lr, d, w);                                          /* param.add_(d, alpha=-lr) */
}

static const outer_params NESTEROV = {.nesterov = 1, .lr = 0.7f, .momentum = 0.9f},
                          HEAVY_BALL = {.nesterov = 0, .lr = 0.7f, .momentum = 0.9f},
                          PLAIN = {.nesterov = 0, .lr = 0.7f, .momentum = 0.0f};

typedef struct run_cfg {
    size_t budget;
    int threads;
    const char *out;
    const char *mom_in;
    const char *mom_out;
    outer_params params;
    const char *const *deltas;  /* test_dir() names of the three deltas (NULL: d0, d1, d2) */
} run_cfg;

/* Checksums for run_pass's next passes (checksum tests): the key, and what the inputs must hash to. */
static const ck_key *run_ck;
static const uint64_t *run_sums;
static const unsigned char *run_summed;
static int run_global_summed;
static uint64_t run_global_sum;

/* When set, run_pass calls it once after outer_prepare opened the files, before the threads run. */
static void (*before_run_once)(void);

static void *run_thread(void *p)
{
    outer_run(p);
    return NULL;
}

static int run_pass(const run_cfg *c, outer_pass *p)
{
    char *paths[3];
    static char names[3][512];
    dl_error err;
    for (int k = 0; k < 3; k++) {
        char n[64];
        snprintf(n, sizeof(n), "d%d", k);
        snprintf(names[k], sizeof(names[k]), "%s", test_path(c->deltas ? c->deltas[k] : n));
        paths[k] = names[k];
    }
    static char g[512], out[512], mi[512], mo[512];
    snprintf(g, sizeof(g), "%s", test_path("g"));
    snprintf(out, sizeof(out), "%s", test_path(c->out));
    snprintf(mo, sizeof(mo), "%s", test_path(c->mom_out));
    if (c->mom_in)
        snprintf(mi, sizeof(mi), "%s", test_path(c->mom_in));
    memset(p, 0, sizeof(*p));
    p->global_path = g;
    p->momentum_path = c->mom_in ? mi : NULL;
    p->delta_paths = (const char *const *)paths;
    p->ndeltas = 3;
    p->out_global_path = out;
    p->out_momentum_path = mo;
    p->params = c->params;
    p->budget_bytes = c->budget;
    p->ck = run_ck;
    p->sum_every_input = run_ck != NULL;
    p->delta_sums = run_sums;
    p->delta_summed = run_summed;
    p->global_summed = run_global_summed;
    p->global_sum = run_global_sum;
    if (outer_prepare(p, &err) != 0) {
        fprintf(stderr, "  prepare: %s\n", err.message);
        outer_finish(p, &err);
        return -1;
    }
    if (before_run_once != NULL) {
        before_run_once();
        before_run_once = NULL;
    }
    pthread_t t[4];
    for (int i = 0; i < c->threads; i++)
        pthread_create(&t[i], NULL, run_thread, p);
    for (int i = 0; i < c->threads; i++)
        pthread_join(t[i], NULL);
    int rc = outer_finish(p, &err);
    if (rc != 0)
        fprintf(stderr, "  finish: %s\n", err.message);
    return rc;
}

static int same_file(const char *a, const char *b)
{
    char cmd[1200];
    snprintf(cmd, sizeof(cmd), "cmp -s '%s' '%s'", a, b);
    return system(cmd) == 0;
}

static int read_tensor(const char *name, const char *key, void *out, size_t len)
{
    st_file *f;
    dl_error err;
    int rc = st_open(test_path(name), &f, &err);
    if (rc == 0) {
        const st_tensor *t = st_header_find(f->h, key, strlen(key));
        rc = t == NULL ? -1 : st_read(f, t, 0, out, len, &err);
        st_close(f);
    }
    if (rc != 0)
        fprintf(stderr, "  %s/%s: %s\n", name, key, err.message);
    return rc;
}

/* Checks "out" (and "mom_out") of a pass against t_sgd, from momentum "mom_in" (NULL: first step).
 * Returns 0, or -1 after reporting the first difference. */
static int check_against_torch(const run_cfg *c, int *fused_mattered)
{
    static float w1[N], mom_in[N], mom_out[N], hmom_in[N], hmom_out[N];
    static uint16_t h1[N];
    float z1[6], zmom_in[6] = {0}, zmom_out[6];
    int64_t k1[2];
    int have = c->mom_in != NULL, mom = c->params.momentum != 0.0f;

    if (read_tensor(c->out, "w", w1, sizeof(w1)) || read_tensor(c->out, "h", h1, sizeof(h1)) ||
        read_tensor(c->out, "z", z1, sizeof(z1)) || read_tensor(c->out, "k", k1, sizeof(k1)))
        return -1;
    if (have && (read_tensor(c->mom_in, "w", mom_in, sizeof(mom_in)) ||
                 read_tensor(c->mom_in, "h", hmom_in, sizeof(hmom_in)) ||
                 read_tensor(c->mom_in, "z", zmom_in, sizeof(zmom_in))))
        return -1;
    if (mom && (read_tensor(c->mom_out, "w", mom_out, sizeof(mom_out)) ||
                read_tensor(c->mom_out, "h", hmom_out, sizeof(hmom_out)) ||
                read_tensor(c->mom_out, "z", zmom_out, sizeof(zmom_out))))
        return -1;
    if (k1[0] != 41 || k1[1] != -7) {
        fprintf(stderr, "  integer tensor changed\n");
        return -1;
    }
    for (int i = 0; i < N; i++) {
        float unfused, buf = mom_in[i];
        float want = t_sgd(c->params, w0[i], t_mean3(dlt[0][i], dlt[1][i], dlt[2][i]), &buf, have, &unfused);
        *fused_mattered += bits(want) != bits(unfused);
        if (bits(w1[i]) != bits(want) || (mom && bits(mom_out[i]) != bits(buf))) {
            fprintf(stderr, "  w[%d]: got 0x%x (momentum 0x%x), torch 0x%x (momentum 0x%x)\n", i, bits(w1[i]),
                    mom ? bits(mom_out[i]) : 0, bits(want), bits(buf));
            return -1;
        }
        float hf, hbuf = hmom_in[i];
        uint16_t hb;
        cv_bf16_to_f32(&h0[i], &hf, 1);
        float hw = t_sgd(c->params, hf, t_mean3(dlt[1][i], dlt[2][i], dlt[0][i]), &hbuf, have, &unfused);
        cv_f32_to_bf16(&hw, &hb, 1);
        if (h1[i] != hb || (mom && bits(hmom_out[i]) != bits(hbuf))) {
            fprintf(stderr, "  h[%d]: got 0x%x, torch 0x%x\n", i, h1[i], hb);
            return -1;
        }
    }
    for (int i = 0; i < 6; i++) {       /* C64: both parts, each as an F32 parameter */
        float unfused, buf = zmom_in[i];
        float want = t_sgd(c->params, z0[i], t_mean3(dz[0][i], dz[1][i], dz[2][i]), &buf, have, &unfused);
        if (bits(z1[i]) != bits(want) || (mom && bits(zmom_out[i]) != bits(buf))) {
            fprintf(stderr, "  z[%d]: got 0x%x, torch 0x%x\n", i, bits(z1[i]), bits(want));
            return -1;
        }
    }
    return 0;
}

TEST(outer_first_step_is_torch_sgd_and_chunking_independent)
{
    outer_pass p;
    make_files();
    run_cfg big = {64 << 20, 1, "out1", NULL, "mom1", NESTEROV, NULL};
    run_cfg tiny = {1, 2, "out2", NULL, "mom2", NESTEROV, NULL};      /* 4096-element chunks, two threads */
    CHECK_EQ(run_pass(&big, &p), 0);
    outer_free(&p);
    CHECK_EQ(run_pass(&tiny, &p), 0);
    CHECK(p.chunk_elems == 4096);
    /* statistics: norm of each delta against a double reference */
    double s0 = 0;
    for (int i = 0; i < N; i++)
        s0 += (double)dlt[0][i] * dlt[0][i] + (double)dlt[1][i] * dlt[1][i];
    for (int i = 0; i < 6; i++)
        s0 += (double)dz[0][i] * dz[0][i];
    /* F32 blocked sums (outer.c sumsq_dot): each lane adds at most 64 products, each rounded once, before
     * its two partial sums are added and the block's sum goes into a double, so the relative error of a
     * sum of squares is within 66 F32 roundings, 66 * 2^-24 < 4e-6 */
    CHECK(fabs(p.stats[0].sumsq - s0) <= 4e-6 * s0);
    outer_free(&p);
    char a[512], b[512];
    snprintf(a, sizeof(a), "%s", test_path("out1"));
    snprintf(b, sizeof(b), "%s", test_path("out2"));
    CHECK(same_file(a, b));
    snprintf(a, sizeof(a), "%s", test_path("mom1"));
    snprintf(b, sizeof(b), "%s", test_path("mom2"));
    CHECK(same_file(a, b));
    int fused = 0;
    CHECK_EQ(check_against_torch(&big, &fused), 0);
    CHECK(fused > N / 100);    /* else this data could not tell fused from separately rounded steps */
}

TEST(outer_second_step_uses_momentum_file)
{
    outer_pass p;
    make_files();
    run_cfg first = {64 << 20, 1, "out1", NULL, "mom1", NESTEROV, NULL};
    CHECK_EQ(run_pass(&first, &p), 0);
    outer_free(&p);
    run_cfg second = {64 << 20, 1, "out2", "mom1", "mom2", NESTEROV, NULL};
    CHECK_EQ(run_pass(&second, &p), 0);
    outer_free(&p);
    int fused = 0;
    CHECK_EQ(check_against_torch(&second, &fused), 0);
    CHECK(fused > N / 100);
}

TEST(outer_heavy_ball_and_plain_sgd_are_torch_sgd)
{
    outer_pass p;
    make_files();
    int fused = 0;
    run_cfg first = {1 << 20, 2, "out1", NULL, "mom1", HEAVY_BALL, NULL};
    CHECK_EQ(run_pass(&first, &p), 0);
    outer_free(&p);
    CHECK_EQ(check_against_torch(&first, &fused), 0);
    run_cfg second = {1 << 20, 2, "out2", "mom1", "mom2", HEAVY_BALL, NULL};
    CHECK_EQ(run_pass(&second, &p), 0);
    outer_free(&p);
    CHECK_EQ(check_against_torch(&second, &fused), 0);
    run_cfg plain = {1 << 20, 2, "out3", NULL, "mom3", PLAIN, NULL};
    CHECK_EQ(run_pass(&plain, &p), 0);
    outer_free(&p);
    CHECK_EQ(check_against_torch(&plain, &fused), 0);
    CHECK(fused > N / 100);
    CHECK(access(test_path("mom3"), F_OK) != 0);       /* no momentum without momentum */
}

/* The AVX2+FMA loops and the portable fmaf() loops give the same bits (where the CPU has FMA, this
 * compares two implementations; elsewhere it runs the portable one twice). */
TEST(outer_fma_and_portable_paths_agree)
{
    outer_pass p;
    make_files();
    static const outer_params all[] = {NESTEROV, HEAVY_BALL, PLAIN};
    for (int k = 0; k < 3; k++) {
        char a[512], b[512];
        outer_force_portable = 0;
        run_cfg fast = {1 << 20, 2, "out1", NULL, "mom1", all[k], NULL};
        CHECK_EQ(run_pass(&fast, &p), 0);
        outer_free(&p);
        run_cfg fast2 = {1 << 20, 2, "out2", "mom1", "mom2", all[k], NULL};
        CHECK_EQ(run_pass(&fast2, &p), 0);
        outer_free(&p);
        outer_force_portable = 1;
        run_cfg port = {1 << 20, 2, "out3", NULL, "mom3", all[k], NULL};
        CHECK_EQ(run_pass(&port, &p), 0);
        outer_free(&p);
        run_cfg port2 = {1 << 20, 2, "out4", "mom3", "mom4", all[k], NULL};
        CHECK_EQ(run_pass(&port2, &p), 0);
        outer_free(&p);
        outer_force_portable = 0;
        snprintf(a, sizeof(a), "%s", test_path("out2"));
        snprintf(b, sizeof(b), "%s", test_path("out4"));
        CHECK(same_file(a, b));
        if (all[k].momentum != 0.0f) {
            snprintf(a, sizeof(a), "%s", test_path("mom2"));
            snprintf(b, sizeof(b), "%s", test_path("mom4"));
            CHECK(same_file(a, b));
        }
        int fused = 0;
        CHECK_EQ(check_against_torch(&port2, &fused), 0);
    }
}

/* A weight of -0.0 whose deltas are all -0.0: torch's mean is 0 + -0.0 + ... = +0.0, so buf = +0,
 * d = +0 and param = fma(-lr, +0, -0) = -0.  Copying the first delta into the sum would give
 * buf = -0 and param = +0. */
TEST(outer_mean_starts_from_positive_zero)
{
    outer_pass p;
    make_files();
    run_cfg c = {1 << 20, 1, "out1", NULL, "mom1", NESTEROV, NULL};
    CHECK_EQ(run_pass(&c, &p), 0);
    outer_free(&p);
    static float w1[N], m1[N];
    CHECK_EQ(read_tensor("out1", "w", w1, sizeof(w1)), 0);
    CHECK_EQ(read_tensor("mom1", "w", m1, sizeof(m1)), 0);
    for (int i = 0; i < N; i++) {
        if (neg_zero_elem(i)) {
            CHECK_HEX(bits(m1[i]), 0x00000000u);
            CHECK_HEX(bits(w1[i]), 0x80000000u);
        }
    }
}

TEST(outer_mismatched_delta_refused_and_nothing_left)
{
    outer_pass p;
    make_files();
    uint64_t s5[] = {5}, sn[] = {N}, s3[] = {3};
    float x[5] = {0};
    st_spec bad[] = {{"w", 1, ST_F32, 1, s5}, {"h", 1, ST_F32, 1, sn}, {"z", 1, ST_C64, 1, s3}};
    const void *bd[] = {x, dlt[0], dz[0]};
    dl_error err;
    CHECK_EQ(st_save(test_path("d1"), bad, bd, 3, NULL, 0, &err), 0);
    run_cfg c = {1 << 20, 1, "out", NULL, "mom", NESTEROV, NULL};
    CHECK(run_pass(&c, &p) != 0);
    CHECK_EQ(p.err.code, DL_E_SHAPE_MISMATCH);
    outer_free(&p);
    char cmd[600];
    snprintf(cmd, sizeof(cmd), "test $(ls -A '%s' | grep -c -e out -e mom -e tmp) -eq 0", test_dir());
    CHECK_EQ(system(cmd), 0);
}

/* Delta k saved again as a set split at shard_size (huggingface_hub's split, in the order w, h, z)
 * under test_dir()/name/: returns how many files it has. */
static uint32_t save_delta_set(int k, const char *name, uint64_t shard_size)
{
    uint64_t sn[] = {N}, s3[] = {3};
    st_spec d[] = {{"w", 1, ST_F32, 1, sn}, {"h", 1, ST_F32, 1, sn}, {"z", 1, ST_C64, 1, s3}};
    const void *dd[] = {dlt[k], dlt[(k + 1) % 3], dz[k]};
    const uint64_t bytes[] = {4 * (uint64_t)N, 4 * (uint64_t)N, 24};
    char dir[600], path[700];
    st_set_writer *w = NULL;
    dl_error err;
    uint32_t n = 0;

    snprintf(dir, sizeof(dir), "%s", test_path(name));
    if (fsu_mkdirs(dir, &err) != 0)
        return 0;
    snprintf(path, sizeof(path), "%s/delta.safetensors", dir);
    if (st_set_writer_open(path, d, 3, NULL, 0, shard_size, &w, &err) != 0)
        return 0;
    for (size_t i = 0; i < 3; i++) {
        if (st_set_writer_write(w, i, 0, dd[i], bytes[i], &err) != 0) {
            st_set_writer_abort(w);
            return 0;
        }
    }
    n = st_set_writer_nshards(w);
    return st_set_writer_commit(w, &err) == 0 ? n : 0;
}

TEST(outer_sharded_deltas_bit_identical_to_single_files)
{
    outer_pass p;
    int fused = 0;
    make_files();
    /* one tensor per shard (w | h | z), mixed (w | h + z), each tensor larger than the shard size
     * (w | h | z, over 100000 bytes each) */
    CHECK_EQ(save_delta_set(0, "one", 4 * (uint64_t)N), 3);
    CHECK_EQ(save_delta_set(1, "mixed", 4 * (uint64_t)N + 24), 2);
    CHECK_EQ(save_delta_set(2, "large", 100000), 3);
    CHECK_EQ(save_delta_set(0, "mixed0", 4 * (uint64_t)N + 24), 2);
    CHECK_EQ(save_delta_set(1, "large1", 100000), 3);
    CHECK_EQ(save_delta_set(2, "one2", 4 * (uint64_t)N), 3);
    run_cfg single = {1 << 20, 2, "out", NULL, "mom", NESTEROV, NULL};
    CHECK_EQ(run_pass(&single, &p), 0);
    outer_free(&p);
    CHECK_EQ(check_against_torch(&single, &fused), 0);
    static const char *const all_sets[] = {"one/delta.safetensors.index.json", "mixed/delta.safetensors.index.json",
                                           "large/delta.safetensors.index.json"};
    static const char *const other_sets[] = {"mixed0/delta.safetensors.index.json",
                                             "large1/delta.safetensors.index.json",
                                             "one2/delta.safetensors.index.json"};
    static const char *const mixed_nodes[] = {"d0", "mixed/delta.safetensors.index.json", "d2"};
    static const char *const *const cases[] = {all_sets, other_sets, mixed_nodes};
    for (size_t c = 0; c < 3; c++) {
        /* small budget and 3 threads: items cross tensors' shard boundaries in every order */
        run_cfg sharded = {64 << 10, 3, "out_s", NULL, "mom_s", NESTEROV, cases[c]};
        CHECK_EQ(run_pass(&sharded, &p), 0);
        outer_free(&p);
        CHECK(same_file(test_path("out"), test_path("out_s")));
        CHECK(same_file(test_path("mom"), test_path("mom_s")));
    }
    /* a later step (momentum read) over sets, against the same step over single files */
    run_cfg second = {1 << 20, 2, "out2", "mom", "mom2", NESTEROV, NULL};
    CHECK_EQ(run_pass(&second, &p), 0);
    outer_free(&p);
    run_cfg second_s = {1 << 20, 2, "out2_s", "mom", "mom2_s", NESTEROV, mixed_nodes};
    CHECK_EQ(run_pass(&second_s, &p), 0);
    outer_free(&p);
    CHECK(same_file(test_path("out2"), test_path("out2_s")));
    CHECK(same_file(test_path("mom2"), test_path("mom2_s")));
}

TEST(outer_set_missing_a_tensor_refused)
{
    outer_pass p;
    make_files();
    CHECK_EQ(save_delta_set(1, "mixed", 4 * (uint64_t)N + 24), 2);
    /* the set's second shard (h and z) gone: the set does not open, the pass names the shard */
    char path[700];
    snprintf(path, sizeof(path), "%s", test_path("mixed/delta-00002-of-00002.safetensors"));
    CHECK_EQ(unlink(path), 0);
    static const char *const nodes[] = {"d0", "mixed/delta.safetensors.index.json", "d2"};
    run_cfg c = {1 << 20, 1, "out", NULL, "mom", NESTEROV, nodes};
    CHECK(run_pass(&c, &p) != 0);
    outer_free(&p);
    CHECK(access(test_path("out"), F_OK) != 0);
}

/* test_dir()/to: test_dir()/from with its header one space longer, so that its data starts at an offset
 * that is not a multiple of 4 (the reference accepts any header length) */
static int copy_with_odd_header(const char *from, const char *to)
{
    char src[600], dst[600];
    struct stat sb;
    int rc = -1;

    snprintf(src, sizeof(src), "%s", test_path(from));
    snprintf(dst, sizeof(dst), "%s", test_path(to));
    int fd = open(src, O_RDONLY);
    if (fd < 0)
        return -1;
    size_t len = fstat(fd, &sb) == 0 ? (size_t)sb.st_size : 0;
    unsigned char *buf = len >= 8 ? malloc(len) : NULL;
    if (buf == NULL || fsu_pread_all(fd, buf, len, 0) != 0) {
        close(fd);
        free(buf);
        return -1;
    }
    close(fd);
    uint64_t n = 0;
    for (int i = 7; i >= 0; i--)
        n = n << 8 | buf[i];
    FILE *f = fopen(dst, "wb");
    if (f != NULL) {
        unsigned char le[8];
        for (int i = 0; i < 8; i++)
            le[i] = (unsigned char)((n + 1) >> (8 * i));
        int ok = fwrite(le, 1, 8, f) == 8 && fwrite(buf + 8, 1, n, f) == n && fputc(' ', f) == ' ' &&
                 fwrite(buf + 8 + n, 1, len - 8 - n, f) == len - 8 - n;
        rc = fclose(f) == 0 && ok ? 0 : -1;
    }
    free(buf);
    return rc;
}

TEST(outer_deltas_read_in_place_or_with_pread_give_the_same_bytes)
{
    outer_pass p;
    make_files();
    /* d1 with its data at an odd offset is read with pread; d0 and d2 are mapped, in whole 2 MiB units
     * with a 64 MiB budget, page by page with a 1 MiB one (outer_run's map_units) */
    CHECK_EQ(copy_with_odd_header("d1", "d1_odd"), 0);
    static const char *const odd[] = {"d0", "d1_odd", "d2"};
    run_cfg units = {64 << 20, 2, "out_u", NULL, "mom_u", NESTEROV, NULL};
    run_cfg pages = {1 << 20, 2, "out_p", NULL, "mom_p", NESTEROV, NULL};
    run_cfg mixed = {1 << 20, 2, "out_o", NULL, "mom_o", NESTEROV, odd};
    CHECK_EQ(run_pass(&units, &p), 0);
    double ss_units = p.stats[1].sumsq;
    outer_free(&p);
    CHECK_EQ(run_pass(&pages, &p), 0);
    /* the same blocks' sums, added in the order the threads took the items */
    CHECK(fabs(p.stats[1].sumsq - ss_units) <= 1e-12 * ss_units);
    outer_free(&p);
    CHECK_EQ(run_pass(&mixed, &p), 0);
    CHECK(fabs(p.stats[1].sumsq - ss_units) <= 1e-12 * ss_units);
    outer_free(&p);
    CHECK(same_file(test_path("out_u"), test_path("out_p")));
    CHECK(same_file(test_path("mom_u"), test_path("mom_p")));
    CHECK(same_file(test_path("out_u"), test_path("out_o")));
    CHECK(same_file(test_path("mom_u"), test_path("mom_o")));
    int fused = 0;
    CHECK_EQ(check_against_torch(&mixed, &fused), 0);
}

static void truncate_d1(void)
{
    if (truncate(test_path("d1"), 64) != 0)
        perror("truncate");
}

TEST(outer_delta_truncated_under_its_mapping_fails_the_pass)
{
    outer_pass p;
    make_files();
    /* the pass opened d1 at its full size; it shrinks before the threads read it in place: the read
     * raises SIGBUS, which fails the pass like a short read, and the process goes on */
    run_cfg c = {1 << 20, 2, "out", NULL, "mom", NESTEROV, NULL};
    before_run_once = truncate_d1;
    CHECK(run_pass(&c, &p) != 0);
    CHECK_EQ(p.err.code, DL_E_IO);
    CHECK(strstr(p.err.message, "SIGBUS") != NULL);
    outer_free(&p);
    CHECK(access(test_path("out"), F_OK) != 0);
    CHECK(access(test_path("mom"), F_OK) != 0);
    /* a SIGBUS outside a pass's reads is not swallowed: it ends the process as it would without the
     * pass's handler (by the signal, or by a sanitizer's report), rather than looping or going on */
    pid_t pid = fork();
    if (pid == 0) {
        alarm(10);
        int null = open("/dev/null", O_WRONLY);     /* a sanitizer's report of this expected fault */
        if (null >= 0)
            dup2(null, 2);
        int fd = open(test_path("d1"), O_RDONLY);
        volatile const char *m = mmap(NULL, 1 << 16, PROT_READ, MAP_SHARED, fd, 0);
        if (fd < 0 || m == MAP_FAILED)
            _exit(0);
        (void)m[1 << 15];       /* beyond the 64 bytes left: SIGBUS */
        _exit(0);
    }
    int st = 0;
    CHECK(pid > 0 && waitpid(pid, &st, 0) == pid);
    CHECK(!(WIFEXITED(st) && WEXITSTATUS(st) == 0));
    CHECK(!(WIFSIGNALED(st) && WTERMSIG(st) == SIGALRM));
}

/* ---- content checksums ------------------------------------------------------------------------- */

/* The checksum of file name as checksum.h defines it, computed here whole tensor by whole tensor (the
 * pass adds sub-blocks on threads): each tensor keyed by its index in the global g. */
static uint64_t file_sum(const ck_key *key, const char *name)
{
    st_file *f, *g;
    dl_error err;
    uint64_t sum = 0;
    char path[512];

    snprintf(path, sizeof(path), "%s", test_path(name));
    if (st_open(path, &f, &err) != 0 || st_open(test_path("g"), &g, &err) != 0)
        return 0;
    for (size_t i = 0; i < f->h->ntensors; i++) {
        const st_tensor *t = &f->h->tensors[i];
        const st_tensor *gt = st_header_find(g->h, t->name, t->name_len);
        void *buf = malloc(st_tensor_bytes(t) + 1);
        if (buf != NULL && gt != NULL && st_read(f, t, 0, buf, st_tensor_bytes(t), &err) == 0)
            sum += ck_blocks(key, (uint32_t)(gt - g->h->tensors), t->dtype, 0, buf, t->nelem, st_dtype_bits(t->dtype) / 8);
        free(buf);
    }
    st_close(f);
    st_close(g);
    return sum;
}

/* Rewrites one value of d1 in place (same size), and puts its mtime back: what a worker can do. */
static void rewrite_d1_keep_mtime(void)
{
    struct stat sb;
    const char *path = test_path("d1");
    float v = 0.5f;
    int fd = open(path, O_WRONLY);
    if (fd < 0 || fstat(fd, &sb) != 0 || pwrite(fd, &v, 4, sb.st_size - 4096) != 4)
        perror("rewrite d1");
    struct timespec ts[2] = {sb.st_atim, sb.st_mtim};
    if (fd >= 0 && futimens(fd, ts) != 0)
        perror("futimens");
    if (fd >= 0)
        close(fd);
}

TEST(outer_checksums_describe_inputs_and_outputs_whatever_the_threads)
{
    outer_pass p;
    ck_key key;
    make_files();
    CHECK_EQ(ck_key_random(&key, NULL), 0);
    run_ck = &key;
    /* 4096-element items on two threads, and one item per tensor on one: the same sums */
    run_cfg tiny = {1, 2, "out1", NULL, "mom1", NESTEROV, NULL};
    run_cfg big = {64 << 20, 1, "out2", NULL, "mom2", NESTEROV, NULL};
    CHECK_EQ(run_pass(&tiny, &p), 0);
    uint64_t g1 = p.out_global_sum, m1 = p.out_momentum_sum, in1[5];
    memcpy(in1, p.in_sums, sizeof(in1));
    outer_free(&p);
    CHECK_EQ(run_pass(&big, &p), 0);
    CHECK(p.out_global_sum == g1 && p.out_momentum_sum == m1);
    CHECK(memcmp(p.in_sums, in1, sizeof(in1)) == 0);
    outer_free(&p);
    CHECK(g1 == file_sum(&key, "out1"));
    CHECK(m1 == file_sum(&key, "mom1"));
    CHECK(in1[0] == file_sum(&key, "d0") && in1[1] == file_sum(&key, "d1") && in1[2] == file_sum(&key, "d2"));
    CHECK(in1[3] == file_sum(&key, "g"));
    /* another key, other sums */
    ck_key other;
    CHECK_EQ(ck_key_random(&other, NULL), 0);
    CHECK(file_sum(&other, "d1") != in1[1]);
    run_ck = NULL;
}

TEST(outer_rewritten_delta_or_global_is_never_committed)
{
    outer_pass p;
    ck_key key;
    make_files();
    CHECK_EQ(ck_key_random(&key, NULL), 0);
    uint64_t sums[3] = {file_sum(&key, "d0"), file_sum(&key, "d1"), file_sum(&key, "d2")};
    unsigned char summed[3] = {1, 1, 1};
    run_ck = &key;
    run_sums = sums;
    run_summed = summed;
    run_cfg c = {1 << 20, 2, "out", NULL, "mom", NESTEROV, NULL};
    CHECK_EQ(run_pass(&c, &p), 0);
    outer_free(&p);
    CHECK(access(test_path("out"), F_OK) == 0);
    unlink(test_path("out"));
    unlink(test_path("mom"));
    /* d1 rewritten in place with its size and mtime put back, after the pass opened it */
    before_run_once = rewrite_d1_keep_mtime;
    CHECK(run_pass(&c, &p) != 0);
    CHECK_EQ(p.err.code, DL_E_CHECKSUM_MISMATCH);
    CHECK(outer_input_changed(&p, 1));
    CHECK(!outer_input_changed(&p, 0) && !outer_input_changed(&p, 2));
    CHECK(!outer_input_changed(&p, OUTER_INPUT_GLOBAL(&p)));
    outer_free(&p);
    CHECK(access(test_path("out"), F_OK) != 0);
    CHECK(access(test_path("mom"), F_OK) != 0);
    /* the global is not the one committed */
    make_files();
    run_global_summed = 1;
    run_global_sum = file_sum(&key, "g") + 1;
    CHECK(run_pass(&c, &p) != 0);
    CHECK_EQ(p.err.code, DL_E_CHECKSUM_MISMATCH);
    CHECK(outer_input_changed(&p, OUTER_INPUT_GLOBAL(&p)));
    CHECK(!outer_input_changed(&p, 1));
    outer_free(&p);
    CHECK(access(test_path("out"), F_OK) != 0);
    run_global_summed = 0;
    run_ck = NULL;
    run_sums = NULL;
    run_summed = NULL;
}

TEST(outer_non_finite_result_is_never_committed)
{
    outer_pass p;
    make_files();
    /* finite deltas whose mean overflows F32 at one element */
    uint64_t sn[] = {N}, s3[] = {3};
    st_spec d[] = {{"w", 1, ST_F32, 1, sn}, {"h", 1, ST_F32, 1, sn}, {"z", 1, ST_C64, 1, s3}};
    for (int k = 0; k < 3; k++) {
        dlt[k][N - 3] = 3.0e38f;
        const void *dd[] = {dlt[k], dlt[(k + 1) % 3], dz[k]};
        char name[8];
        snprintf(name, sizeof(name), "d%d", k);
        CHECK_EQ(st_save(test_path(name), d, dd, 3, NULL, 0, NULL), 0);
    }
    run_cfg c = {1 << 20, 2, "out", NULL, "mom", NESTEROV, NULL};
    CHECK(run_pass(&c, &p) != 0);
    CHECK_EQ(p.err.code, DL_E_NON_FINITE);
    CHECK(strstr(p.err.message, "not committed") != NULL);
    outer_free(&p);
    CHECK(access(test_path("out"), F_OK) != 0);
    CHECK(access(test_path("mom"), F_OK) != 0);
}
