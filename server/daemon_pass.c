/* The aggregation of a closed round: the pass (common/outer.c) prepared, run on the pool's threads
 * and finished, its progress logged and its new global's write-back started while it writes; the next
 * pass's output files warmed by an idle thread of its own while the round collects; and the round's
 * inputs, checked before the pass and before the commit for a delta rewritten in place (which reopens
 * the round) and made durable beside the pass (sync_inputs), since the redo record names them. */
#include "daemon_internal.h"
#include "daemon_parts.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "delta.h"
#include "dl_log.h"
#include "fsutil.h"
#include "outer.h"
#include "pipeline.h"
#include "round.h"
#include "safetensors.h"
#include "stepcount.h"
#include "store.h"

#define PROGRESS_SECONDS 2.0

static void stop_writeback(dilocod *d);
static int start_sync_inputs(dilocod *d);
static int reopen_round(dilocod *d);
static void begin_pass(dilocod *d);
static void screen_done(dilocod *d);
static void discard_overflowed_round(dilocod *d);

/* ---- the pass: its end, its failure, its release, its write-back --------------------------------- */

/* The pass's per-delta inputs (fill_inputs). */
static void free_inputs(dilocod *d)
{
    free(d->agg.paths);
    d->agg.paths = NULL;
    free(d->agg.nodes);
    d->agg.nodes = NULL;
    free(d->agg.sums);
    d->agg.sums = NULL;
    free(d->agg.summed);
    d->agg.summed = NULL;
    free(d->agg.scales);
    d->agg.scales = NULL;
}

/* The pass (finished or never started) and its per-delta inputs, freed; the step's records stay. */
static void free_pass(dilocod *d)
{
    stop_writeback(d);
    daemon__drop_warm(d, d->warm.given);         /* taken over by the pass's writers (gone already), or unused */
    if (d->agg.pass != NULL) {
        outer_free(d->agg.pass);
        free((void *)d->agg.pass->out_global_path);
        free((void *)d->agg.pass->out_momentum_path);
        free((void *)d->agg.pass->out_accum_path);
        free(d->agg.pass);
        d->agg.pass = NULL;
    }
    free_inputs(d);
}

void daemon__pass_release(dilocod *d)
{
    if (pipeline_busy(&d->pipe, d->rnd.step + 1, STEP_ACT_PASS))
        pipeline_end(&d->pipe, d->rnd.step + 1, STEP_ACT_PASS, 0);     /* given up before its outputs */
    free_pass(d);
    free(d->agg.entry);
    d->agg.entry = NULL;
    d->agg.screening = 0;
    free(d->pending_round);
    d->pending_round = NULL;
    history_record_free(&d->pending_record);
}

static void retry_cb(uv_timer_t *t)
{
    dilocod *d = container_of(t, dilocod, retry_timer);
    if (!d->stopping && daemon__state(d) == S_RETRY_WAIT)
        daemon__start_aggregation(d);
}

void daemon__aggregation_failed(dilocod *d, const dl_error *err)
{
    uv_timer_stop(&d->progress_timer);
    daemon__pass_release(d);
    daemon__log_error("aggregate", "outer step failed, not committed", err);
    if (d->stopping)
        return;
    pipeline_move(&d->pipe, d->rnd.step + 1, STEP_RETRY_WAIT);
    dl_log(DL_LOG_WARN, "aggregate", "will retry", "step=%" PRIu64 " in_seconds=%.1f", d->rnd.step, d->agg.retry_delay);
    uv_timer_start(&d->retry_timer, retry_cb, (uint64_t)(d->agg.retry_delay * 1000), 0);
    d->agg.retry_delay = fmin(d->agg.retry_delay * 2, MAX_RETRY_SECONDS);
}

static void finish_work(job *j)
{
    j->rc = outer_finish(j->arg, &j->err);
}

/* The pass read bytes other than the ones validated or committed (outer_finish: checksum_mismatch).  A
 * linked delta rewritten in place, even with its mtime put back, is dropped and taken in again (if its
 * writer still has it in the tree); the committed global or momentum written by someone else cannot be
 * made good again, so the daemon stops (exit 1) rather than make a step from it. */
static void inputs_changed(dilocod *d, const dl_error *err)
{
    outer_pass *p = d->agg.pass;
    char qn[160];
    size_t dropped = 0;

    if (outer_input_changed(p, OUTER_INPUT_GLOBAL(p)) || outer_input_changed(p, OUTER_INPUT_MOMENTUM(p))) {
        dl_error e;
        dl_fail(&e, DL_E_CHECKSUM_MISMATCH, NULL, 0, "the committed step %" PRIu64 "'s %s was written in place since "
                "it was committed (file:// links it into the tree as global/latest.safetensors: a writer of the tree "
                "with dilocod's uid); no step is made from it. Restore the state from a backup, or start again from "
                "a fresh state directory and --init-model", d->st.step,
                outer_input_changed(p, OUTER_INPUT_GLOBAL(p)) ? "global" : "momentum");
        daemon__pass_release(d);
        pipeline_move(&d->pipe, d->rnd.step + 1, STEP_FAILED);
        daemon__fatal(d, "store", "cannot aggregate", &e);
        return;
    }
    daemon__log_error("aggregate", "a linked delta's content changed after it was validated", err);
    /* the pass's deltas are the round's aggregated entries, in order: dropped from the last, the indices
     * hold */
    for (size_t i = d->agg.n < p->ndeltas ? d->agg.n : p->ndeltas; i-- > 0;) {
        char *path;
        if (!outer_input_changed(p, i) || d->agg.entry[i] >= d->rnd.n)
            continue;
        dl_log(DL_LOG_WARN, "round", "delta rewritten in place after it was taken in (checksum): dropped, it is "
               "taken in again", "step=%" PRIu64 " node=%s", d->rnd.step,
               dl_log_q(qn, sizeof(qn), d->agg.nodes[i].node_id));
        round_drop_at(&d->rnd, d->agg.entry[i], &path);
        daemon__discard_local(d, path, 0);
        free(path);
        d->m.deltas_rewritten++;
        dropped++;
    }
    if (dropped == 0) {
        daemon__aggregation_failed(d, err);
        return;
    }
    reopen_round(d);
}

/* The index, among the pass's deltas, of the one of largest norm (the first of equals).  The pass's
 * statistics are finite for finite inputs (outer.c, sumsq_dot), and cover every delta: a pass that makes
 * a non-finite value still runs to its end. */
static size_t largest_delta(const outer_pass *p, size_t n)
{
    size_t worst = 0;

    for (size_t k = 1; k < n; k++)
        if (p->stats[k].sumsq > p->stats[worst].sumsq)
            worst = k;
    return worst;
}

/* The pass made a non-finite value from finite deltas: their sum, the momentum or the stored dtype
 * overflowed.  The same inputs overflow again, so the step is never retried on them: it is computed
 * again without the delta of largest norm (quarantined, reason `overflow`) while at least the round's
 * floor remains (--min-nodes; 1 in async mode).  Below it, no subset made a finite step: the state
 * itself is near its dtype's limit (an F16 global at 65504), and the round is discarded. */
static void output_overflowed(dilocod *d, const dl_error *err)
{
    const outer_pass *p = d->agg.pass;
    size_t n = d->agg.n < p->ndeltas ? d->agg.n : p->ndeltas;
    unsigned floor = daemon__async(d) ? 1 : d->cfg->min_nodes;

    uv_timer_stop(&d->progress_timer);
    daemon__log_error("aggregate", "the outer step overflowed: not committed, and never computed again from the "
                      "same deltas", err);
    if (n == 0) {
        discard_overflowed_round(d);
        return;
    }
    size_t worst = largest_delta(p, n);
    round_entry *e = &d->rnd.entries[d->agg.entry[worst]];
    daemon__robust_overflow(d, e, sqrt(p->stats[worst].sumsq));
    /* async: the settle removes consumed deltas only; this one goes now, or a restart offers it again */
    if (daemon__async(d))
        daemon__discard_local(d, e->path, 0);
    if (n - 1 < floor) {
        discard_overflowed_round(d);
        return;
    }
    free_pass(d);
    begin_pass(d);      /* the pass activity still runs: the step is computed again, not retried */
}

static void finish_done(job *j)
{
    dilocod *d = daemon__of_job(j);

    if (j->rc != 0 && j->err.code == DL_E_CHECKSUM_MISMATCH && !d->stopping) {
        inputs_changed(d, &j->err);
        return;
    }
    if (j->rc != 0 && j->err.code == DL_E_NON_FINITE && !d->agg.screening && !d->stopping) {
        output_overflowed(d, &j->err);
        return;
    }
    if (j->rc != 0) {
        daemon__aggregation_failed(d, &j->err);
        return;
    }
    if (d->agg.screening) {
        screen_done(d);
        return;
    }
    dl_log(DL_LOG_DEBUG, "aggregate", "files written", "step=%" PRIu64 " seconds=%.3f", d->rnd.step + 1,
           daemon__clock() - d->agg.started);
    if (d->agg.overflow_problem) {
        d->agg.overflow_problem = 0;
        dl_log(DL_LOG_INFO, "aggregate", "a step is finite again: problem output_overflow is over", "step=%" PRIu64,
               d->rnd.step + 1);
    }
    if (daemon__prepare_round_record(d, daemon__clock() - d->agg.started) != 0) {
        dl_error e;
        dl_fail(&e, DL_E_NO_MEMORY, NULL, 0, "out of memory for the round's record");
        daemon__aggregation_failed(d, &e);
        return;
    }
    if (d->cfg->downlink != 0) {
        daemon__downlink_make(d);       /* the step's view and update, then the pass activity ends */
        return;
    }
    /* the outputs are written: the commit waits in computing for the inputs and the previous settle */
    pipeline_end(&d->pipe, d->rnd.step + 1, STEP_ACT_PASS, 1);
    daemon__try_commit(d);
}

static void run_work(job *j)
{
    outer_run(j->arg);
}

/* Ends the pass on the pool (commit, or release of what was opened).  If the pool cannot take the
 * job, the pass is abandoned here: with abort set, outer_finish only closes and unlinks (no fsync),
 * so no temporary file or descriptor outlives the attempt. */
static void queue_finish(dilocod *d)
{
    dl_error e;

    if (daemon__queue(d, finish_work, finish_done, d->agg.pass) == 0)
        return;
    outer_abort(d->agg.pass);
    outer_finish(d->agg.pass, &e);
    dl_fail(&e, DL_E_NO_MEMORY, NULL, 0, "cannot queue the end of the outer step");
    daemon__aggregation_failed(d, &e);
}

static void run_done(job *j)
{
    dilocod *d = daemon__of_job(j);

    if (--d->agg.jobs > 0)
        return;
    stop_writeback(d);
    dl_log(DL_LOG_DEBUG, "aggregate", "computed", "step=%" PRIu64 " seconds=%.3f", d->rnd.step + 1,
           daemon__clock() - d->agg.started);
    queue_finish(d);
}

/* The settle makes the new global durable after the commit, and the next step's commit waits for it:
 * its write-back starts while the pass writes it, from a side thread (sync_file_range in the pass
 * threads made them wait for a congested disk), so the settle's fsync finds little left.  The job holds
 * its own descriptor; it stops when the pass ends. */
typedef struct writeback_args {
    atomic_int stop;            /* set by the loop (stop_writeback) when the pass ends */
    int fd;                     /* the job's own descriptor of the new global */
} writeback_args;

static void writeback_work(job *j)
{
    writeback_args *a = j->arg;

    while (!atomic_load(&a->stop)) {
        (void)sync_file_range(a->fd, 0, 0, SYNC_FILE_RANGE_WRITE);
        usleep(20000);
    }
    (void)sync_file_range(a->fd, 0, 0, SYNC_FILE_RANGE_WRITE);
    close(a->fd);
}

static void writeback_done(job *j)
{
    free(j->arg);
}

static void start_writeback(dilocod *d)
{
    int fd = outer_global_fd(d->agg.pass);
    writeback_args *a;

    if (fd < 0 || (fd = fcntl(fd, F_DUPFD_CLOEXEC, 0)) < 0)
        return;
    if ((a = calloc(1, sizeof(*a))) == NULL) {
        close(fd);
        return;
    }
    a->fd = fd;
    if (daemon__queue(d, writeback_work, writeback_done, a) != 0) {
        free(a);
        close(fd);
        return;
    }
    d->agg.writeback_stop = &a->stop;
}

static void stop_writeback(dilocod *d)
{
    if (d->agg.writeback_stop != NULL)
        atomic_store(d->agg.writeback_stop, 1);    /* the job frees it when it ends */
    d->agg.writeback_stop = NULL;
}

/* ---- the next pass's output pages, made while its round collects -------------------------------
 *
 * A pass writes 2 x the model size of new page cache (the new global and momentum).  Each new page
 * costs an allocation, and on a VM whose balloon hands free pages back to the host (free page
 * reporting), a fault in the host too: 1.35 s of system time per GiB here after the machine idled,
 * against 0.09 s to overwrite cached pages.  So when a round opens, a thread creates the pass's output
 * files early with their space reserved and reads them once (st_writer_warm_*: zero pages of unwritten
 * space, no disk I/O), and the pass's writers take them over.  The cost moves from the critical path to
 * the time the round waits for workers, and to idle CPU only: the thread runs under SCHED_IDLE (its own
 * thread, not the pool's: an unprivileged thread cannot leave SCHED_IDLE again), so a burst of uploads
 * is not slowed by it (run at normal priority beside 8 concurrent 1 GiB uploads it made them 3 s slower).
 *
 * Nothing waits for it.  A file is handed to the loop once its space is reserved (ready[i]); when the
 * round closes, the pass takes every ready file as it is, warm or not yet, and the thread stops at its
 * next 1 MiB read (reading a file the pass writes is harmless: the page cache is coherent, and what the
 * pass already wrote is not replaced).  The loop removes the files nobody took when the thread has
 * ended; a killed process's are temporary files the startup sweep removes.  The pages are clean page
 * cache: under memory pressure the kernel drops them and the pass allocates, as without warming. */

typedef struct warm_args {
    dilocod *d;
    atomic_int stop;
    atomic_int ready[2];        /* tmp[i] exists with its space reserved (set by the thread) */
    atomic_int finished;        /* the thread is about to return */
    atomic_int busy;            /* deltas are arriving (uploads, intake): the fill waits (busy_check_cb) */
    int taken[2];               /* the loop gave tmp[i] to a pass (loop only) */
    uint64_t step;              /* the pass's new step */
    char *src[2];               /* the committed global and momentum (NULL: none yet): the sizes to make */
    char *out[2];               /* the pass's outputs (out[1] NULL without momentum) */
    uint64_t momentum_guess;    /* the momentum file's size when there is none yet (the writer resizes) */
    char *tmp[2];
    uint64_t filled;
    double seconds;
    int rc;
    dl_error err;
} warm_args;

static uint64_t regular_file_size(const char *path)
{
    struct stat sb;
    return path != NULL && stat(path, &sb) == 0 && S_ISREG(sb.st_mode) ? (uint64_t)sb.st_size : 0;
}

static void warm_thread_main(void *arg)
{
    warm_args *a = arg;
    struct sched_param idle = {0};
    double t0 = daemon__clock();
    int fd[2] = {-1, -1};

    /* only CPU time nothing else wants; failing that (no SCHED_IDLE), it runs at normal priority */
    (void)pthread_setschedparam(pthread_self(), SCHED_IDLE, &idle);
    for (int i = 0; i < 2 && !atomic_load(&a->stop); i++) {
        uint64_t size = a->src[i] != NULL ? regular_file_size(a->src[i]) : 0;
        if (a->out[i] == NULL)
            continue;
        if (size == 0 && i == 1)
            size = a->momentum_guess;
        if (size == 0)
            continue;
        if (st_writer_warm_create(a->out[i], size, &a->tmp[i], &fd[i], &a->err) != 0) {
            a->rc = -1;
            continue;
        }
        atomic_store(&a->ready[i], 1);
    }
    /* reserved first, both: a round that closes early still gets the files, cold */
    for (int i = 0; i < 2; i++) {
        if (fd[i] >= 0) {
            a->filled += st_writer_warm_fill(fd[i], regular_file_size(a->tmp[i]), &a->stop, &a->busy);
            close(fd[i]);
        }
    }
    a->seconds = daemon__clock() - t0;
    atomic_store(&a->finished, 1);
    uv_async_send(&a->d->warm.async);
}

static void warm_args_free(warm_args *a)
{
    for (int i = 0; i < 2; i++) {
        free(a->src[i]);
        free(a->out[i]);
        free(a->tmp[i]);
    }
    free(a);
}

/* Removes warm files that will not be used and forgets them. */
void daemon__drop_warm(dilocod *d, char **tmp)
{
    for (int i = 0; i < 2; i++) {
        if (tmp[i] == NULL)
            continue;
        if (d->stopping)
            unlink(tmp[i]);     /* the loop may not run again to finish an asynchronous one */
        else
            daemon__unlink_async(d, tmp[i]);
        free(tmp[i]);
        tmp[i] = NULL;
    }
}

/* Before the loop sleeps: tells the warm thread whether deltas are arriving.  SCHED_IDLE alone did not
 * keep it out of their way: beside 8 concurrent uploads it still made the round 15% slower (256 MiB and
 * 1 GiB), as both fault in new pages from the host at once.  It fills the pages between arrivals. */
static void busy_check_cb(uv_check_t *h)
{
    dilocod *d = container_of(h, dilocod, warm.busy_check);
    if (d->warm.job != NULL)
        atomic_store_explicit(&d->warm.job->busy, daemon__front_busy(d) || d->intake.in_flight > 0,
                              memory_order_relaxed);
}

/* The warm thread ended: its files go to the round still waiting for them, or away. */
void daemon__warm_async_cb(uv_async_t *h)
{
    dilocod *d = container_of(h, dilocod, warm.async);
    warm_args *a = d->warm.job;

    if (a == NULL || !atomic_load(&a->finished))
        return;
    uv_thread_join(&d->warm.thread);
    uv_check_stop(&d->warm.busy_check);
    d->warm.job = NULL;         /* shutdown waited for the thread (daemon__maybe_finish_shutdown) */
    if (a->rc != 0) {
        char m[600];
        /* a full disk or a filesystem without fallocate: said once, then at debug level */
        dl_log(d->warm.failure_said ? DL_LOG_DEBUG : DL_LOG_WARN, "aggregate",
               "cannot warm the next pass's outputs: it will write new pages", "step=%" PRIu64 " error=%s", a->step,
               dl_log_q(m, sizeof(m), a->err.message));
        d->warm.failure_said = 1;
    }
    dl_log(DL_LOG_DEBUG, "aggregate", "outputs warmed", "step=%" PRIu64 " bytes=%" PRIu64 " seconds=%.3f stopped=%d",
           a->step, a->filled, a->seconds, atomic_load(&a->stop));
    for (int i = 0; i < 2; i++) {
        if (a->taken[i]) {
            free(a->tmp[i]);            /* the pass's now */
            a->tmp[i] = NULL;
        }
    }
    if (!d->stopping && daemon__state(d) == S_COLLECTING && a->step == d->rnd.step + 1 && !a->taken[0] && !a->taken[1] &&
        d->warm.tmp[0] == NULL && d->warm.tmp[1] == NULL) {
        for (int i = 0; i < 2; i++) {
            d->warm.tmp[i] = a->tmp[i];
            a->tmp[i] = NULL;
        }
        d->warm.step = a->step;
    }
    daemon__drop_warm(d, a->tmp);       /* a round that moved on meanwhile */
    warm_args_free(a);
    daemon__maybe_finish_shutdown(d);
}

/* When a round opens: warms the files its pass will write (the sizes of the committed step's). */
void daemon__start_warm(dilocod *d)
{
    uint64_t step = d->rnd.step + 1;
    warm_args *a;

    if (d->warm.step != step)
        daemon__drop_warm(d, d->warm.tmp);
    if (!d->cfg->warm_outputs || d->stopping || d->warm.job != NULL || d->warm.tmp[0] != NULL ||
        daemon__state(d) != S_COLLECTING || !d->st.committed || (a = calloc(1, sizeof(*a))) == NULL)
        return;
    a->d = d;
    atomic_init(&a->stop, 0);
    atomic_init(&a->finished, 0);
    atomic_init(&a->ready[0], 0);
    atomic_init(&a->ready[1], 0);
    atomic_init(&a->busy, daemon__front_busy(d) || d->intake.in_flight > 0);
    dl_error_clear(&a->err);
    a->step = step;
    a->src[0] = strdup(d->st.global_path);
    a->src[1] = d->st.momentum_path != NULL ? strdup(d->st.momentum_path) : NULL;
    a->out[0] = store_global_path(&d->st, step);
    a->out[1] = d->cfg->momentum != 0 ? store_momentum_path(&d->st, step) : NULL;
    /* the momentum's header is about the global's (the same names and shapes) plus its metadata */
    a->momentum_guess = d->delta_bytes + 4096;
    if (a->src[0] == NULL || (d->st.momentum_path != NULL && a->src[1] == NULL) || a->out[0] == NULL ||
        (d->cfg->momentum != 0 && a->out[1] == NULL) || uv_thread_create(&d->warm.thread, warm_thread_main, a) != 0) {
        warm_args_free(a);
        return;
    }
    d->warm.job = a;            /* shutdown waits for the thread while it is set */
    uv_check_start(&d->warm.busy_check, busy_check_cb);
}

void daemon__stop_warm(dilocod *d)
{
    if (d->warm.job != NULL)
        atomic_store(&d->warm.job->stop, 1);
}

/* Gives the pass the files warmed for it: the finished job's, or the running one's that are ready
 * (which then stops). */
static void take_warm(dilocod *d)
{
    warm_args *a = d->warm.job;

    if (a != NULL) {
        atomic_store(&a->stop, 1);
        for (int i = 0; i < 2; i++) {
            if (a->step == d->rnd.step + 1 && atomic_load(&a->ready[i]) && (d->warm.given[i] = strdup(a->tmp[i])))
                a->taken[i] = 1;
        }
    } else if (d->warm.step == d->rnd.step + 1) {
        for (int i = 0; i < 2; i++) {
            d->warm.given[i] = d->warm.tmp[i];
            d->warm.tmp[i] = NULL;
        }
    }
    d->agg.pass->warm_global_tmp = d->warm.given[0];
    d->agg.pass->warm_momentum_tmp = d->warm.given[1];
}

/* ---- the pass on the pool: prepared, run by every thread, its progress --------------------------- */

static void prepare_work(job *j)
{
    j->rc = outer_prepare(j->arg, &j->err);
}

static void prepare_done(job *j)
{
    dilocod *d = daemon__of_job(j);

    if (j->rc != 0 || d->stopping) {
        if (j->rc == 0)
            outer_abort(d->agg.pass);
        queue_finish(d);        /* releases what prepare opened */
        return;
    }
    dl_log(DL_LOG_DEBUG, "aggregate", "prepared", "step=%" PRIu64 " seconds=%.3f items=%zu chunk_elems=%" PRIu64,
           d->rnd.step + 1, daemon__clock() - d->agg.started, d->agg.pass->nitems, d->agg.pass->chunk_elems);
    d->agg.jobs = 0;
    for (unsigned i = 0; i < d->cfg->threads; i++) {
        if (daemon__queue(d, run_work, run_done, d->agg.pass) == 0)
            d->agg.jobs++;
    }
    if (d->agg.jobs == 0) {
        outer_abort(d->agg.pass);
        queue_finish(d);
        return;
    }
    start_writeback(d);
}

static void progress_cb(uv_timer_t *t)
{
    dilocod *d = container_of(t, dilocod, progress_timer);
    if (d->agg.pass == NULL || d->agg.pass->bytes_total == 0)
        return;
    uint64_t done = atomic_load(&d->agg.pass->bytes_done);
    double now = daemon__clock();
    double rate = now > d->agg.last_time ? (double)(done - d->agg.last_bytes) / (now - d->agg.last_time) : 0;
    d->agg.last_bytes = done;
    d->agg.last_time = now;
    dl_log(DL_LOG_INFO, "aggregate", "progress", "step=%" PRIu64 " percent=%.1f gbps=%.2f", d->rnd.step + 1,
           100.0 * (double)done / (double)d->agg.pass->bytes_total, rate / 1e9);
}

/* The pass of step new_step from the committed step's files: the same settings for a round and for
 * its recomputation at a restart (optimizer, lr and momentum from the redo record then), so both make
 * the same bytes.  meta and step_text must outlive the pass. */
/* Delayed Nesterov's part of the pass (outer.h): the accumulator in and out, the momentum written only
 * once it exists or at a Nesterov step, and the alphas rounded once from double as torch rounds them. */
static int setup_dn(dilocod *d, outer_pass *p, uint64_t new_step, double lr, double momentum, const store_dn *dn)
{
    const int tick = dn->k + 1 >= dn->period;
    const double n = (double)dn->period, w = dn->weight;

    p->params.dn_period = dn->period;
    p->params.dn_k = dn->k;
    p->params.dn_weight = (float)w;
    p->params.dn_paper = dn->paper;
    p->params.dn_plain_alpha = (float)(dn->paper ? -lr * w / n : -lr * w);
    p->params.dn_c_alpha = (float)(-lr * dn->c * momentum);
    p->params.dn_m_alpha = (float)(-lr * (1.0 - dn->c * n + dn->c) * momentum);
    /* the committed step's accumulator, when its phase is one this update continues */
    p->accum_path = d->st.dn.on && d->st.dn.k > 0 ? d->st.accum_path : NULL;
    p->accum_summed = p->accum_path != NULL && d->st.accum_summed;
    p->accum_sum = d->st.accum_sum;
    p->out_accum_path = tick ? NULL : store_accum_path(&d->st, new_step);
    if (momentum != 0 && !tick && d->st.momentum_path == NULL) {
        free((void *)p->out_momentum_path);     /* no momentum before the first Nesterov step */
        p->out_momentum_path = NULL;
    }
    /* a plain step that does not read the momentum links it over, unread and unwritten: its checksum
     * (which the next Nesterov step verifies) is the committed one */
    p->carry_momentum = momentum != 0 && !tick && d->st.momentum_path != NULL && d->st.momentum_summed &&
                        !(dn->paper && dn->c > 0);
    return !tick && p->out_accum_path == NULL ? -ENOMEM : 0;
}

int daemon__setup_pass(dilocod *d, outer_pass *p, uint64_t new_step, const char *optimizer, double lr,
                      double momentum, const store_dn *dn, st_kv meta[2], char *step_text, size_t step_text_size)
{
    snprintf(step_text, step_text_size, "%" PRIu64, new_step);
    meta[0] = (st_kv){"optimizer", optimizer};
    meta[1] = (st_kv){"outer_step", step_text};
    p->global_path = d->st.global_path;
    p->momentum_path = d->st.momentum_path;
    p->out_global_path = store_global_path(&d->st, new_step);
    p->out_momentum_path = momentum != 0 ? store_momentum_path(&d->st, new_step) : NULL;
    p->momentum_meta = meta;
    p->momentum_nmeta = 2;
    p->params.nesterov = strcmp(optimizer, "nesterov_sgd") == 0;
    p->params.lr = (float)lr;
    p->params.momentum = (float)momentum;
    p->budget_bytes = (size_t)d->cfg->agg_memory_mib << 20;
    /* the committed step's files are verified against the checksums the pass that made them computed */
    p->ck = &d->st.key;
    p->global_summed = d->st.global_summed;
    p->global_sum = d->st.global_sum;
    p->momentum_summed = d->st.momentum_summed;
    p->momentum_sum = d->st.momentum_sum;
    if (p->out_global_path == NULL || (momentum != 0 && p->out_momentum_path == NULL))
        return -ENOMEM;
    return dn != NULL && dn->on ? setup_dn(d, p, new_step, lr, momentum, dn) : 0;
}

/* ---- the round's inputs: deltas linked from a shared tree, and their durability ------------------- */

/* Drops from the round every guarded delta whose file changed since it was validated (a worker rewrote
 * it in place): the transport hands the new version over again.  Before a pass (before_pass), a file
 * whose only change is its ctime stays, its version moved on: the worker renamed a new file over its name
 * (the old inode lost a link), chmod'ed it, or rewrote it with its mtime put back, and the pass tells
 * which by its checksum, over exactly the bytes it aggregates.  Before the commit every ctime change
 * drops it: a write during the pass, even between a block's checksum and its use, moves ctime.
 * Returns how many went. */
static size_t drop_rewritten(dilocod *d, int before_pass)
{
    size_t dropped = 0;
    char node[DELTA_NODE_ID_MAX + 1], qn[160], *path;

    for (size_t i = 0; i < d->rnd.n;) {
        const round_entry *e = &d->rnd.entries[i];
        int same = e->guarded ? fsu_ident_check(e->path, &e->ident) : FSU_IDENT_SAME;
        struct stat sb;
        if (same == FSU_IDENT_CTIME_MOVED && before_pass && e->ident.has_sum && lstat(e->path, &sb) == 0) {
            fsu_ident now = e->ident;           /* the checksum validated stays what the pass verifies */
            fsu_ident_of(&sb, &now);
            d->rnd.entries[i].ident = now;
            same = FSU_IDENT_SAME;
        }
        if (same == FSU_IDENT_SAME) {
            i++;
            continue;
        }
        memcpy(node, e->node_id, sizeof(node));
        dl_log(DL_LOG_WARN, "round", "delta rewritten in place after it was taken in: dropped, it is taken in again",
               "step=%" PRIu64 " node=%s local_step=%" PRIu64, d->rnd.step, dl_log_q(qn, sizeof(qn), node),
               e->local_step);
        round_drop_at(&d->rnd, i, &path);
        daemon__discard_local(d, path, 0);
        free(path);
        d->m.deltas_rewritten++;
        dropped++;
    }
    return dropped;
}

const char *daemon__global_change(int rc)
{
    return rc == 0 ? "that is no longer the version linked at the bootstrap (rewritten in place, or the state "
                     "directory was copied to another filesystem)"
                   : "whose version cannot be checked";
}

/* A committed global linked from --init-model (a bootstrap, until step 1 is durable) that the operator
 * rewrote in place: the step cannot be made from the version published, nor from another.  Logs it and
 * stops the daemon (exit 1) rather than mix versions.  1 when it did. */
static int global_rewritten(dilocod *d)
{
    int rc = store_global_intact(&d->st);

    if (rc == 1)
        return 0;
    dl_error e;
    dl_fail(&e, DL_E_IO, NULL, 0, "the committed global of step %" PRIu64 " (%s) is a link to --init-model %s; "
            GLOBAL_CHANGED_HELP, d->st.step, d->st.global_path, daemon__global_change(rc));
    daemon__fatal(d, "store", "cannot aggregate", &e);
    return 1;
}

/* Before a pass and before its commit: a round that lost a rewritten delta is open again (a pass never
 * mixes versions of a file, and never commits one that changed under it).  1 when it reopened, or when
 * the global itself changed (global_rewritten: the daemon stops). */
int daemon__reopen_if_rewritten(dilocod *d, int before_pass)
{
    if (global_rewritten(d)) {
        daemon__pass_release(d);
        pipeline_move(&d->pipe, d->rnd.step + 1, STEP_FAILED);
        return 1;
    }
    if (drop_rewritten(d, before_pass) == 0)
        return 0;
    return reopen_round(d);
}

/* A round that lost a rewritten delta collects again: the pass that gave up is released.  Returns 1. */
static int reopen_round(dilocod *d)
{
    d->agg.screened_step = 0;           /* the round changes: the cosine screen runs again */
    uv_timer_stop(&d->progress_timer);
    daemon__pass_release(d);
    pipeline_move(&d->pipe, d->rnd.step + 1, STEP_COLLECTING);
    if (d->rnd.n > 0)
        daemon__arm_round_timer(d);     /* the timeout (sync) or the grace window (async), if any */
    daemon__start_warm(d);              /* the pass that gave up took the warm files with it */
    daemon__dispatch_intake(d);
    daemon__maybe_close_round(d);
    return 1;
}

typedef struct sync_args {
    uint64_t step;
    unsigned attempt;           /* the step's attempt whose round this syncs (step_record.attempts) */
    char **paths;
    size_t n;
    char (*hash)[65];           /* --signing-key: each delta's block hash, for the step's record (else NULL) */
} sync_args;

static void sync_args_free(sync_args *a)
{
    for (size_t i = 0; a != NULL && i < a->n; i++)
        free(a->paths[i]);
    if (a != NULL) {
        free(a->paths);
        free(a->hash);
    }
    free(a);
}

/* Beside the pass: each delta made durable and, when steps are signed, its block hash computed (its
 * bytes are in the page cache: intake or the upload just read them), off the critical path. */
static void sync_inputs_work(job *j)
{
    sync_args *a = j->arg;
    for (size_t i = 0; i < a->n && j->rc == 0; i++) {
        j->rc = store_sync_delta(a->paths[i], &j->err);
        if (j->rc == 0 && a->hash != NULL && a->hash[i][0] == '\0')     /* not hashed at its arrival */
            j->rc = daemon__sign_hash_delta(a->paths[i], a->hash[i], &j->err);
    }
}

static void sync_inputs_done(job *j)
{
    dilocod *d = daemon__of_job(j);
    sync_args *a = j->arg;
    const step_record *r = pipeline_find(&d->pipe, a->step);
    int recomputed = r != NULL && r->attempts != a->attempt;

    pipeline_end(&d->pipe, a->step, STEP_ACT_SYNC, j->rc == 0);
    if (j->rc == 0 && !recomputed && a->hash != NULL) {
        daemon__sign_inputs_hashed(d, a->step, a->hash, a->n);
        a->hash = NULL;
    }
    sync_args_free(a);
    if (recomputed && j->rc == 0 && !d->stopping) {
        /* the round changed while this ran (a pass restarted): sync what it holds now */
        if (start_sync_inputs(d) != 0) {
            dl_fail(&j->err, DL_E_NO_MEMORY, NULL, 0, "out of memory");
            daemon__log_error("store", "cannot make the round's deltas durable", &j->err);
            daemon__try_commit(d);
        }
        return;
    }
    if (j->rc != 0)
        daemon__log_error("store", "cannot make the round's deltas durable", &j->err);
    daemon__try_commit(d);
}

/* The round's deltas are the redo record's inputs: durable before the commit.  Intake leaves a linked
 * delta (and a copy it need not fsync) to this job, which runs beside the pass, off the critical path;
 * an fsync of a file already on disk costs next to nothing. */
static int start_sync_inputs(dilocod *d)
{
    uint64_t step = d->rnd.step + 1;
    const step_record *r = pipeline_find(&d->pipe, step);
    sync_args *a;

    if (r == NULL || pipeline_start(&d->pipe, step, STEP_ACT_SYNC) != 0)
        return -1;
    if ((a = calloc(1, sizeof(*a))) == NULL || (a->paths = calloc(d->rnd.n ? d->rnd.n : 1, sizeof(*a->paths))) == NULL) {
        free(a);
        pipeline_end(&d->pipe, step, STEP_ACT_SYNC, 0);
        return -1;
    }
    a->step = step;
    a->attempt = r->attempts;
    if (d->sign.on && (a->hash = calloc(d->rnd.n ? d->rnd.n : 1, sizeof(*a->hash))) == NULL) {
        sync_args_free(a);
        pipeline_end(&d->pipe, step, STEP_ACT_SYNC, 0);
        return -1;
    }
    for (; a->n < d->rnd.n; a->n++) {
        if ((a->paths[a->n] = strdup(d->rnd.entries[a->n].path)) == NULL)
            break;
        const char *known = a->hash != NULL ? daemon__sign_known(d, a->paths[a->n]) : NULL;
        if (known != NULL)
            memcpy(a->hash[a->n], known, sizeof(a->hash[a->n]));
    }
    if (a->n < d->rnd.n || daemon__queue(d, sync_inputs_work, sync_inputs_done, a) != 0) {
        sync_args_free(a);
        pipeline_end(&d->pipe, step, STEP_ACT_SYNC, 0);      /* the commit fails on it (daemon__try_commit) */
        return -1;
    }
    return 0;
}

/* ---- the pass of a closed round, started --------------------------------------------------------- */

/* The round's entries that are aggregated (not quarantined), in aggregation order, into d->agg.entry. */
static size_t select_entries(dilocod *d)
{
    size_t n = 0;

    for (size_t i = 0; i < d->rnd.n; i++)
        if (!d->rnd.entries[i].quarantined)
            d->agg.entry[n++] = i;
    return n;
}

/* The round's deltas go, and it collects again (its workers may send better ones).  Async: the deltas
 * queued while it was computed join the update now (round_reset on the same step), as a commit would
 * have them join the next: no commit comes to do it. */
static void discard_round(dilocod *d)
{
    char *path;

    while (d->rnd.n > 0) {
        daemon__verdict_discarded(d, &d->rnd.entries[d->rnd.n - 1], d->agg.overflow_problem ? "round_overflowed"
                                                                                            : "round_discarded");
        round_drop_at(&d->rnd, d->rnd.n - 1, &path);
        daemon__discard_local(d, path, 0);
        free(path);
    }
    if (daemon__async(d))
        round_reset(&d->rnd, d->rnd.step);
    reopen_round(d);
}

/* Every delta of the round was quarantined: nothing is committed; /status says why
 * (robust.quarantined). */
static void all_quarantined(dilocod *d)
{
    dl_log(DL_LOG_WARN, "aggregate", "every delta of the round was quarantined: nothing committed, the round collects again",
           "step=%" PRIu64 " quarantined=%zu", d->rnd.step, d->rnd.n);
    d->m.rounds_all_quarantined++;
    discard_round(d);
}

/* No subset of the round's deltas down to its floor made a finite step (output_overflowed): the round
 * is discarded, the committed step stays served, and /status says output_overflow until a step is
 * finite again.  Logged at warning level once per episode: the same state overflows every round. */
static void discard_overflowed_round(dilocod *d)
{
    d->m.rounds_overflowed++;
    dl_log(d->agg.overflow_problem ? DL_LOG_DEBUG : DL_LOG_WARN, "aggregate",
           "no subset of the round's deltas makes a finite step (the committed state is near its dtype's limit): "
           "the round is discarded, the committed step stays served; problem=output_overflow",
           "step=%" PRIu64 " deltas=%zu", d->rnd.step, d->rnd.n);
    d->agg.overflow_problem = 1;
    free_pass(d);
    discard_round(d);
}

/* The cosine screen's first pass (--screen cosine:MIN): the coordinate median of the aggregated
 * deltas and each one's dot product with it, no output; its end (screen_done) quarantines the ones
 * below MIN and starts the pass.  The center is the median, not the mean: a minority's delta of
 * -1000x the honest ones dominated the mean, so that every honest cosine was -1 and the outlier's +1;
 * each coordinate's median is one of the majority's values (the robust center of the literature,
 * Yin et al. 2018, "Byzantine-robust distributed learning": coordinate-wise median). */
static void screen_done(dilocod *d)
{
    outer_pass *p = d->agg.pass;
    double center_norm = sqrt(p->mean_sumsq);

    for (size_t k = 0; k < p->ndeltas; k++) {
        double norm = sqrt(p->stats[k].sumsq);
        double cosine = norm > 0 && center_norm > 0 ? p->stats[k].dot / (norm * center_norm) : 0.0;
        round_entry *e = &d->rnd.entries[d->agg.entry[k]];
        daemon__robust_cosine(d, e, cosine);
        /* async: the settle removes the consumed deltas only; a quarantined one goes now, or a restart
         * would offer it again (sync: the round's cache directory goes with its step) */
        if (e->quarantined && daemon__async(d))
            daemon__discard_local(d, e->path, 0);
    }
    d->agg.screened_step = d->rnd.step + 1;
    dl_log(DL_LOG_INFO, "aggregate", "cosine screen done", "step=%" PRIu64 " seconds=%.3f", d->rnd.step + 1,
           daemon__clock() - d->agg.started);
    outer_free(p);
    free(p);
    d->agg.pass = NULL;
    free_inputs(d);             /* fill_inputs makes them again for the pass */
    begin_pass(d);
}

/* The inputs of the pass over the selected entries (paths, checksums, the record's node list). */
static int fill_inputs(dilocod *d, size_t n)
{
    d->agg.paths = calloc(n ? n : 1, sizeof(*d->agg.paths));
    d->agg.nodes = calloc(n ? n : 1, sizeof(*d->agg.nodes));
    d->agg.sums = calloc(n ? n : 1, sizeof(*d->agg.sums));
    d->agg.summed = calloc(n ? n : 1, sizeof(*d->agg.summed));
    d->agg.scales = calloc(n ? n : 1, sizeof(*d->agg.scales));
    if (d->agg.paths == NULL || d->agg.nodes == NULL || d->agg.sums == NULL || d->agg.summed == NULL ||
        d->agg.scales == NULL)
        return -ENOMEM;
    const round_entry **sel = calloc(n ? n : 1, sizeof(*sel));
    if (sel == NULL)
        return -ENOMEM;
    for (size_t k = 0; k < n; k++) {
        const round_entry *e = &d->rnd.entries[d->agg.entry[k]];
        sel[k] = e;
        d->agg.paths[k] = e->path;
        memcpy(d->agg.nodes[k].node_id, e->node_id, sizeof(d->agg.nodes[k].node_id));
        d->agg.nodes[k].local_step = e->local_step;
        d->agg.nodes[k].bytes = e->size;
        d->agg.nodes[k].base_outer_step = e->base;
        d->agg.nodes[k].tau = e->tau;
        d->agg.nodes[k].weight = e->weight;
        d->agg.nodes[k].intake_norm = e->has_norm ? e->norm : NAN;
        d->agg.nodes[k].metrics = e->metrics;
        d->agg.nodes[k].cz = e->cz;
        d->agg.nodes[k].received_at = daemon__wall_of(e->received_at);
        /* a linked delta is its writer's file: the pass verifies the bytes intake validated */
        d->agg.summed[k] = e->guarded && e->ident.has_sum;
        d->agg.sums[k] = e->ident.sum;
    }
    int rc = daemon__robust_scales(d, sel, n, d->agg.scales);
    free(sel);
    for (size_t k = 0; rc == 0 && k < n; k++)
        d->agg.nodes[k].scale = d->agg.scales[k];
    return rc;
}

static void start_screen(dilocod *d, size_t n)
{
    outer_pass *p = calloc(1, sizeof(*p));
    dl_error e;

    if (p == NULL || fill_inputs(d, n) != 0) {
        free(p);
        dl_fail(&e, DL_E_NO_MEMORY, NULL, 0, "out of memory");
        daemon__aggregation_failed(d, &e);
        return;
    }
    p->stats_only = 1;
    p->params.rule = OUTER_RULE_MEDIAN;
    p->global_path = d->st.global_path;
    p->delta_paths = (const char *const *)d->agg.paths;
    p->ndeltas = n;
    p->delta_sums = d->agg.sums;
    p->delta_summed = d->agg.summed;
    p->ck = &d->st.key;
    p->budget_bytes = (size_t)d->cfg->agg_memory_mib << 20;
    d->agg.pass = p;
    d->agg.n = n;
    d->agg.screening = 1;
    d->agg.started = daemon__clock();
    if (daemon__queue(d, prepare_work, prepare_done, d->agg.pass) != 0) {
        dl_fail(&e, DL_E_NO_MEMORY, NULL, 0, "cannot start the cosine screen");
        daemon__aggregation_failed(d, &e);
        return;
    }
    dl_log(DL_LOG_INFO, "aggregate", "cosine screen started", "step=%" PRIu64 " nodes=%zu", d->rnd.step + 1, n);
}

void daemon__start_aggregation(dilocod *d)
{
    pipeline_move(&d->pipe, d->rnd.step + 1, STEP_COMPUTING);
    pipeline_start(&d->pipe, d->rnd.step + 1, STEP_ACT_PASS);   /* ends when its outputs are written */

    dl_error be;
    if (stepcount_check(d->rnd.step + 1, "step", &be) != 0) {
        /* never computed, never committed: the step would brick the state (stepcount.h) */
        daemon__aggregation_failed(d, &be);
        return;
    }

    if (daemon__reopen_if_rewritten(d, 1))
        return;
    free(d->agg.entry);
    if ((d->agg.entry = calloc(d->rnd.n ? d->rnd.n : 1, sizeof(*d->agg.entry))) == NULL) {
        dl_fail(&be, DL_E_NO_MEMORY, NULL, 0, "out of memory");
        daemon__aggregation_failed(d, &be);
        return;
    }
    daemon__robust_screen_close(d);     /* the norm screen over the whole round (sync) */
    size_t n = select_entries(d);
    if (n == 0) {
        all_quarantined(d);
        return;
    }
    if (d->cfg->screen && d->agg.screened_step != d->rnd.step + 1) {
        start_screen(d, n);
        return;
    }
    begin_pass(d);
}

/* The pass itself, over the round's entries the screens kept. */
static void begin_pass(dilocod *d)
{
    outer_pass *p;
    size_t n = select_entries(d);
    static st_kv meta[2];
    static char step_text[24];
    dl_error e;

    if (n == 0) {
        all_quarantined(d);     /* the cosine screen dropped every one */
        return;
    }
    d->agg.screening = 0;
    p = calloc(1, sizeof(*p));
    if (p == NULL || fill_inputs(d, n) != 0) {
        free(p);
        dl_fail(&e, DL_E_NO_MEMORY, NULL, 0, "out of memory");
        daemon__aggregation_failed(d, &e);
        return;
    }
    daemon__async_update(d, &d->agg.dn);
    int rc = daemon__setup_pass(d, p, d->rnd.step + 1, config_optimizer_name(d->cfg->optimizer), d->cfg->lr,
                        d->cfg->momentum, &d->agg.dn, meta, step_text, sizeof(step_text));
    p->delta_paths = (const char *const *)d->agg.paths;
    p->ndeltas = n;
    p->delta_sums = d->agg.sums;
    p->delta_summed = d->agg.summed;
    p->params.rule = (outer_rule)d->cfg->aggregate;
    p->params.trim_k = d->cfg->trim_k;
    p->delta_scale = d->cfg->aggregate == RULE_WEIGHTED || d->cfg->aggregate == RULE_CLIPPED ? d->agg.scales : NULL;
    /* durability comes after the commit point (the redo record): off the critical path */
    p->defer_sync = 1;
    d->agg.pass = p;
    d->agg.n = n;
    d->agg.started = daemon__clock();
    d->agg.last_bytes = 0;
    d->agg.last_time = d->agg.started;
    if (rc == 0)
        take_warm(d);
    /* an earlier attempt's sync still out syncs again when done: it sees this attempt (sync_inputs_done) */
    if (rc != 0 || (!pipeline_busy(&d->pipe, d->rnd.step + 1, STEP_ACT_SYNC) && start_sync_inputs(d) != 0) ||
        daemon__queue(d, prepare_work, prepare_done, d->agg.pass) != 0) {
        dl_fail(&e, DL_E_NO_MEMORY, NULL, 0, "cannot start the aggregation");
        daemon__aggregation_failed(d, &e);
        return;
    }
    uv_timer_start(&d->progress_timer, progress_cb, (uint64_t)(PROGRESS_SECONDS * 1000),
                   (uint64_t)(PROGRESS_SECONDS * 1000));
    dl_log(DL_LOG_INFO, "aggregate", "started", "step=%" PRIu64 " nodes=%zu threads=%u rule=%s", d->rnd.step + 1, n,
           d->cfg->threads, config_rule_name(d->cfg->aggregate));
}
