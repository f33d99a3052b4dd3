/* One outer step over existing files, timed by phase: bench-outer THREADS GLOBAL OUT_DIR DELTA...
 * (a profiling aid for the aggregation kernel; make bench runs the end-to-end comparison).
 * Nesterov SGD, lr 0.7, momentum 0.9.  MOMENTUM=FILE reads that momentum file (a later step: the
 * momentum update and both fused multiply-adds run), else it is a first step (buf = mean).
 * BUDGET_MIB sets the per-thread chunk budget (16 MiB).  PORTABLE=1 runs the portable fmaf() loops
 * (what a CPU without AVX2+FMA runs) where this one has the AVX2+FMA copies.  DEFER=1 sets defer_sync (the
 * outputs are renamed without fsync, as the daemon's redo-record commit does).  WARM=1 warms the output files
 * first (st_writer_warm_*, untimed: the daemon does it while the round collects) and the pass writes into
 * them.  CHECKSUM=0 leaves out the content checksums of every input and output (checksum.h), which the daemon
 * computes.  RULE=mean|weighted_mean|clipped_mean|trimmed_mean|median (TRIM_K=K, 1 by default) aggregates by
 * that rule (the scales of weighted_mean and clipped_mean all 1/N and 1: the same arithmetic as any other
 * scales); STATS_ONLY=1 runs the cosine screen's first pass (the plain mean and the statistics, no output).
 * Prints the peak RSS (VmHWM) at the end. */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "outer.h"

static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* CPU seconds (user + system) of every thread so far: on a shared machine the pass's CPU cost varies
 * less than its wall time. */
static double cpu_s(void)
{
    struct rusage ru;
    if (getrusage(RUSAGE_SELF, &ru) != 0)
        return -1;
    return (double)(ru.ru_utime.tv_sec + ru.ru_stime.tv_sec) + (double)(ru.ru_utime.tv_usec + ru.ru_stime.tv_usec) * 1e-6;
}

/* Peak resident set in MiB (VmHWM): mapped page-cache pages count while they are mapped. */
static double peak_rss_mib(void)
{
    char line[256];
    double kb = -1;
    FILE *f = fopen("/proc/self/status", "r");

    if (f == NULL)
        return -1;
    while (fgets(line, sizeof(line), f) != NULL) {
        if (strncmp(line, "VmHWM:", 6) == 0)
            kb = atof(line + 6);
    }
    fclose(f);
    return kb / 1024;
}

static void *run(void *p)
{
    outer_run(p);
    return NULL;
}

int main(int argc, char **argv)
{
    outer_pass p = {0};
    dl_error err;
    char out[4096], mom[4096];
    pthread_t th[64];

    if (argc < 5) {
        fprintf(stderr, "usage: bench-outer THREADS GLOBAL OUT_DIR DELTA...\n");
        return 2;
    }
    int threads = atoi(argv[1]);
    snprintf(out, sizeof(out), "%s/out.safetensors", argv[3]);
    snprintf(mom, sizeof(mom), "%s/mom.safetensors", argv[3]);
    p.global_path = argv[2];
    p.delta_paths = (const char *const *)argv + 4;
    p.ndeltas = (size_t)(argc - 4);
    p.out_global_path = out;
    p.out_momentum_path = mom;
    p.params = (outer_params){.nesterov = 1, .lr = 0.7f, .momentum = 0.9f};
    if (argc - 4 > 64) {
        fprintf(stderr, "bench-outer: at most 64 deltas\n");
        return 2;
    }
    p.momentum_path = getenv("MOMENTUM");
    static const char *const rules[] = {"mean", "weighted_mean", "clipped_mean", "trimmed_mean", "median"};
    const char *rule = getenv("RULE");
    static float scales[64];
    for (int r = 0; rule != NULL && r < 5; r++)
        if (strcmp(rule, rules[r]) == 0)
            p.params.rule = (outer_rule)r;
    p.params.trim_k = getenv("TRIM_K") ? (unsigned)atoi(getenv("TRIM_K")) : 1;
    for (size_t k = 0; k < p.ndeltas && k < 64; k++)
        scales[k] = p.params.rule == OUTER_RULE_WEIGHTED ? 1.0f / (float)p.ndeltas : 1.0f;
    if (p.params.rule == OUTER_RULE_WEIGHTED || p.params.rule == OUTER_RULE_CLIPPED)
        p.delta_scale = scales;
    if (getenv("STATS_ONLY") != NULL && atoi(getenv("STATS_ONLY")) != 0) {
        p.stats_only = 1;
        p.params = (outer_params){0};
        p.momentum_path = NULL;
    }
    p.defer_sync = getenv("DEFER") != NULL && strcmp(getenv("DEFER"), "0") != 0;
    outer_force_portable = getenv("PORTABLE") != NULL && atoi(getenv("PORTABLE")) != 0;
    p.budget_bytes = getenv("BUDGET_MIB") ? (size_t)atoi(getenv("BUDGET_MIB")) << 20 : 16 << 20;
    /* CHECKSUM=0 computes no content checksums (the daemon always does: checksum.h) */
    static ck_key key;
    if (getenv("CHECKSUM") == NULL || atoi(getenv("CHECKSUM")) != 0) {
        if (ck_key_random(&key, NULL) != 0)
            return 1;
        p.ck = &key;
        p.sum_every_input = 1;  /* as for linked deltas (file://) */
    }
    char *warm[2] = {NULL, NULL};
    double warm_s = 0;
    if (getenv("WARM") != NULL && atoi(getenv("WARM")) != 0) {
        struct stat sb;
        const char *outs[2] = {out, mom};
        double w0 = now();
        if (stat(p.global_path, &sb) != 0) {
            perror(p.global_path);
            return 1;
        }
        for (int i = 0; i < 2; i++) {
            int fd;
            atomic_int go = 0;
            /* an F32 model's momentum is the size of the model, give or take the header */
            if (st_writer_warm_create(outs[i], (uint64_t)sb.st_size, &warm[i], &fd, &err) != 0) {
                fprintf(stderr, "warm: %s\n", err.message);
                return 1;
            }
            st_writer_warm_fill(fd, (uint64_t)sb.st_size, &go, NULL);
            close(fd);
        }
        p.warm_global_tmp = warm[0];
        p.warm_momentum_tmp = warm[1];
        warm_s = now() - w0;
    }
    double t0 = now();
    if (outer_prepare(&p, &err) != 0) {
        fprintf(stderr, "prepare: %s\n", err.message);
        return 1;
    }
    double t1 = now(), c1 = cpu_s();
    for (int i = 0; i < threads; i++)
        pthread_create(&th[i], NULL, run, &p);
    for (int i = 0; i < threads; i++)
        pthread_join(th[i], NULL);
    double t2 = now(), c2 = cpu_s();
    uint64_t total = p.bytes_total;
    if (outer_finish(&p, &err) != 0) {
        fprintf(stderr, "finish: %s\n", err.message);
        return 1;
    }
    double t3 = now();
    if (warm[0] != NULL)
        printf("warm %.3f s (untimed), ", warm_s);
    free(warm[0]);
    free(warm[1]);
    printf("prepare %.3f s, compute %.3f s (%.2f GB/s; %.3f CPU s), finish %.3f s; total %.2f GB/s; peak RSS %.0f MiB\n",
           t1 - t0, t2 - t1, (double)total / (t2 - t1) / 1e9, c2 - c1, t3 - t2, (double)total / (t3 - t0) / 1e9,
           peak_rss_mib());
    outer_free(&p);
    return 0;
}
