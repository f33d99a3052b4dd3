/* STREAM triad (a[i] = b[i] + s * c[i]) on arrays far larger than the caches, one thread per CPU:
 * the memory bandwidth the aggregation is measured against.  Prints "triad_gbps <value>".
 *
 * "stream pass MIB": one memory pass over an async update's arrays of MIB MiB of F32 each (delta,
 * global, momentum, accumulator): the four read, the global, momentum and accumulator written in place
 * (g -= lr * d; m = mu * m + d; a += d), one thread per CPU, best of 5.  Prints "pass_seconds <s> gbps <GB/s
 * read + written> bytes <read + written>": the plain streaming read + write of those bytes an update's
 * pass is compared with (bench_async.py). */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

enum { N = 1 << 25 };   /* 3 arrays x 256 MiB */
static double *a, *b, *c;
static long nthreads;

static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static void *triad(void *arg)
{
    long t = (long)arg;
    size_t lo = (size_t)N * (size_t)t / (size_t)nthreads, hi = (size_t)N * (size_t)(t + 1) / (size_t)nthreads;
    for (size_t i = lo; i < hi; i++)
        a[i] = b[i] + 3.0 * c[i];
    return NULL;
}

static float *pd, *pg, *pm, *pa;
static size_t pn;

static void *pass(void *arg)
{
    long t = (long)arg;
    size_t lo = pn * (size_t)t / (size_t)nthreads, hi = pn * (size_t)(t + 1) / (size_t)nthreads;
    for (size_t i = lo; i < hi; i++) {
        float d = pd[i];
        pg[i] -= 0.7f * d;
        pm[i] = 0.9f * pm[i] + d;
        pa[i] += d;
    }
    return NULL;
}

static int pass_main(long mib)
{
    pthread_t th[64];
    double best = 1e30;

    pn = (size_t)mib << 18;     /* F32 elements in MIB MiB */
    pd = malloc(pn * 4);
    pg = malloc(pn * 4);
    pm = malloc(pn * 4);
    pa = malloc(pn * 4);
    if (!pd || !pg || !pm || !pa)
        return 1;
    for (size_t i = 0; i < pn; i++) {
        pd[i] = 0.001f;
        pg[i] = 1;
        pm[i] = 2;
        pa[i] = 0;
    }
    for (int rep = 0; rep < 5; rep++) {
        double t0 = now();
        for (long t = 0; t < nthreads; t++)
            pthread_create(&th[t], NULL, pass, (void *)t);
        for (long t = 0; t < nthreads; t++)
            pthread_join(th[t], NULL);
        double dt = now() - t0;
        if (dt < best)
            best = dt;
    }
    double bytes = 7.0 * (double)pn * 4;    /* 4 arrays read, 3 written */
    printf("pass_seconds %.4f gbps %.3f bytes %.0f threads %ld check %.3f\n", best, bytes / best / 1e9, bytes, nthreads,
           pa[pn / 2] + pg[pn / 3] + pm[pn / 4]);
    free(pd);
    free(pg);
    free(pm);
    free(pa);
    return 0;
}

int main(int argc, char **argv)
{
    pthread_t th[64];
    double best = 1e30;

    nthreads = sysconf(_SC_NPROCESSORS_ONLN);
    if (nthreads < 1 || nthreads > 64)
        nthreads = 1;
    if (argc == 3 && strcmp(argv[1], "pass") == 0 && atol(argv[2]) > 0)
        return pass_main(atol(argv[2]));
    if (argc != 1) {
        fprintf(stderr, "usage: stream [pass MIB]\n");
        return 2;
    }
    a = malloc(N * sizeof(double));
    b = malloc(N * sizeof(double));
    c = malloc(N * sizeof(double));
    if (!a || !b || !c)
        return 1;
    for (size_t i = 0; i < N; i++) {
        a[i] = 0;
        b[i] = 1;
        c[i] = 2;
    }
    for (int rep = 0; rep < 5; rep++) {
        double t0 = now();
        for (long t = 0; t < nthreads; t++)
            pthread_create(&th[t], NULL, triad, (void *)t);
        for (long t = 0; t < nthreads; t++)
            pthread_join(th[t], NULL);
        double dt = now() - t0;
        if (dt < best)
            best = dt;
    }
    printf("triad_gbps %.3f threads %ld check %.1f\n", 3.0 * N * sizeof(double) / best / 1e9, nthreads, a[N / 2]);
    free(a);
    free(b);
    free(c);
    return 0;
}
