/* STREAM triad (a[i] = b[i] + s * c[i]) on arrays far larger than the caches, one thread per CPU:
 * the memory bandwidth the aggregation is measured against.  Prints "triad_gbps <value>". */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
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

int main(void)
{
    pthread_t th[64];
    double best = 1e30;

    nthreads = sysconf(_SC_NPROCESSORS_ONLN);
    if (nthreads < 1 || nthreads > 64)
        nthreads = 1;
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
