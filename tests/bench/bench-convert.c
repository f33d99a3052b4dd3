/* Conversion throughput next to memcpy of the same bytes, measured in the same run (ratios, since the
 * machine is shared and absolute times drift).  Usage: bench-convert [MiB] */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "convert.h"

static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

typedef struct bufs {
    float *f, *g;
    uint16_t *h;
    double *d;
    size_t n;
} bufs;

typedef void (*bench_fn)(bufs *);

static void run_copy(bufs *b) { memcpy(b->g, b->f, b->n * 4); }
static void run_f16_f32(bufs *b) { cv_f16_to_f32(b->h, b->g, b->n); }
static void run_bf16_f32(bufs *b) { cv_bf16_to_f32(b->h, b->g, b->n); }
static void run_f32_f16(bufs *b) { cv_f32_to_f16(b->f, b->h, b->n); }
static void run_f32_bf16(bufs *b) { cv_f32_to_bf16(b->f, b->h, b->n); }
static void run_f64_f32(bufs *b) { cv_f64_to_f32(b->d, b->g, b->n); }
static void run_f32_f64(bufs *b) { cv_f32_to_f64(b->f, b->d, b->n); }

/* Best of reps runs, in seconds. */
static double best_of(int reps, bench_fn fn, bufs *b)
{
    double best = 1e30;
    for (int r = 0; r < reps; r++) {
        double t0 = now();
        fn(b);
        double t = now() - t0;
        if (t < best)
            best = t;
    }
    return best;
}

int main(int argc, char **argv)
{
    size_t mib = argc > 1 ? (size_t)strtoul(argv[1], NULL, 10) : 64;
    size_t n = mib * 1024 * 1024 / 4;                   /* F32 elements */
    bufs b = {malloc(n * 4), malloc(n * 4), malloc(n * 2), malloc(n * 8), n};
    if (!b.f || !b.g || !b.h || !b.d)
        return 1;
    for (size_t i = 0; i < n; i++)
        b.f[i] = (float)((double)(i % 1000003) * 1.37e-3 - 600.0);
    cv_f32_to_f64(b.f, b.d, n);
    cv_f32_to_f16(b.f, b.h, n);
    double t_copy = best_of(5, run_copy, &b);
    struct { const char *name; double t; double bytes; } r[] = {
        {"f16->f32", best_of(5, run_f16_f32, &b), n * 6.0},
        {"bf16->f32", best_of(5, run_bf16_f32, &b), n * 6.0},
        {"f32->f16", best_of(5, run_f32_f16, &b), n * 6.0},
        {"f32->bf16", best_of(5, run_f32_bf16, &b), n * 6.0},
        {"f64->f32", best_of(5, run_f64_f32, &b), n * 12.0},
        {"f32->f64", best_of(5, run_f32_f64, &b), n * 12.0},
    };
    double copy_gbs = n * 8.0 / t_copy / 1e9;
    printf("conversion throughput, %zu Mi elements (best of 5); memcpy of F32: %.2f GB/s (read+write)\n",
           n >> 20, copy_gbs);
    for (size_t i = 0; i < sizeof(r) / sizeof(r[0]); i++) {
        double gbs = r[i].bytes / r[i].t / 1e9;
        printf("  %-10s %6.2f GB/s  %.2fx memcpy\n", r[i].name, gbs, gbs / copy_gbs);
    }
    free(b.f);
    free(b.g);
    free(b.h);
    free(b.d);
    return 0;
}
