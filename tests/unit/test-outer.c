#include "test.h"

#include <math.h>
#include <pthread.h>
#include <stdlib.h>

#include "convert.h"
#include "outer.h"

/* A model of one F32 weight "w" (n elements), one BF16 weight "h" (n), a C64 "z" (3) and an I64 "k". */
enum { N = 10007 };

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

typedef struct run_cfg {
    size_t budget;
    int threads;
    const char *out;
    const char *mom_in;
    const char *mom_out;
} run_cfg;

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
        char n[8];
        snprintf(n, sizeof(n), "d%d", k);
        snprintf(names[k], sizeof(names[k]), "%s", test_path(n));
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
    p->params = (outer_params){1, 0.7f, 0.9f};
    p->budget_bytes = c->budget;
    if (outer_prepare(p, &err) != 0) {
        fprintf(stderr, "  prepare: %s\n", err.message);
        outer_finish(p, &err);
        return -1;
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

TEST(outer_matches_naive_nesterov_and_is_chunking_independent)
{
    outer_pass p;
    make_files();
    run_cfg big = {64 << 20, 1, "out1", NULL, "mom1"};
    run_cfg tiny = {1, 2, "out2", NULL, "mom2"};        /* 4096-element chunks, two threads */
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
    CHECK(fabs(p.stats[0].sumsq - s0) <= 1e-9 * s0);
    outer_free(&p);
    char a[512], b[512];
    snprintf(a, sizeof(a), "%s", test_path("out1"));
    snprintf(b, sizeof(b), "%s", test_path("out2"));
    CHECK(same_file(a, b));
    snprintf(a, sizeof(a), "%s", test_path("mom1"));
    snprintf(b, sizeof(b), "%s", test_path("mom2"));
    CHECK(same_file(a, b));

    /* first step by hand, in the same float operations torch performs */
    st_file *f;
    dl_error err;
    CHECK_EQ(st_open(test_path("out1"), &f, &err), 0);
    static float w1[N];
    static uint16_t h1[N];
    float z1[6];
    int64_t k1[2];
    CHECK_EQ(st_read(f, st_header_find(f->h, "w", 1), 0, w1, sizeof(w1), &err), 0);
    CHECK_EQ(st_read(f, st_header_find(f->h, "h", 1), 0, h1, sizeof(h1), &err), 0);
    CHECK_EQ(st_read(f, st_header_find(f->h, "z", 1), 0, z1, sizeof(z1), &err), 0);
    CHECK_EQ(st_read(f, st_header_find(f->h, "k", 1), 0, k1, sizeof(k1), &err), 0);
    st_close(f);
    CHECK(k1[0] == 41 && k1[1] == -7);
    for (int i = 0; i < N; i++) {
        float g = dlt[0][i];
        g += dlt[1][i];
        g += dlt[2][i];
        g /= 3.0f;
        float buf = g, scaled = 0.9f * buf, d = g + scaled, step = 0.7f * d;
        float want = w0[i] - step;
        CHECK_HEX(bits(w1[i]), bits(want));
        float hg = dlt[1][i];
        hg += dlt[2][i];
        hg += dlt[0][i];
        hg /= 3.0f;
        float hf;
        cv_bf16_to_f32(&h0[i], &hf, 1);
        float hs = 0.9f * hg, hd = hg + hs, hstep = 0.7f * hd, hw = hf - hstep;
        uint16_t hb;
        cv_f32_to_bf16(&hw, &hb, 1);
        CHECK_HEX(h1[i], hb);
    }
    for (int i = 0; i < 6; i++) {
        float g = dz[0][i];
        g += dz[1][i];
        g += dz[2][i];
        g /= 3.0f;
        float scaled = 0.9f * g, d = g + scaled, step = 0.7f * d, want = z0[i] - step;
        CHECK_HEX(bits(z1[i]), bits(want));   /* both complex parts updated */
    }
}

TEST(outer_second_step_uses_momentum_file)
{
    outer_pass p;
    make_files();
    run_cfg first = {64 << 20, 1, "out1", NULL, "mom1"};
    CHECK_EQ(run_pass(&first, &p), 0);
    outer_free(&p);
    run_cfg second = {64 << 20, 1, "out2", "mom1", "mom2"};
    CHECK_EQ(run_pass(&second, &p), 0);
    outer_free(&p);
    st_file *f;
    dl_error err;
    static float m1[N], m2[N];
    CHECK_EQ(st_open(test_path("mom1"), &f, &err), 0);
    CHECK_EQ(st_read(f, st_header_find(f->h, "w", 1), 0, m1, sizeof(m1), &err), 0);
    st_close(f);
    CHECK_EQ(st_open(test_path("mom2"), &f, &err), 0);
    CHECK_EQ(st_read(f, st_header_find(f->h, "w", 1), 0, m2, sizeof(m2), &err), 0);
    st_close(f);
    for (int i = 0; i < N; i++) {
        float scaled = 0.9f * m1[i], want = scaled + m1[i];     /* same deltas: g == first buffer */
        CHECK_HEX(bits(m2[i]), bits(want));
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
    run_cfg c = {1 << 20, 1, "out", NULL, "mom"};
    CHECK(run_pass(&c, &p) != 0);
    CHECK_EQ(p.err.code, DL_E_SHAPE_MISMATCH);
    outer_free(&p);
    char cmd[600];
    snprintf(cmd, sizeof(cmd), "test $(ls -A '%s' | grep -c -e out -e mom -e tmp) -eq 0", test_dir());
    CHECK_EQ(system(cmd), 0);
}
