/* jobs: work on libuv's thread pool, one API for the daemon, the transports and uploads.
 *
 * A job runs work(j) on the pool, then done(j) on the loop, which applies the result.  Its
 * arguments and results are its own (arg: a struct of the caller's, with typed fields): work reads
 * and fills them and nothing the loop owns, and done frees them.  Each owner counts its jobs in flight
 * (job_owner.in_flight), so its close waits for them, and is told when the last one is done
 * (drained).  A job the loop cancels before it ran (uv_cancel, or a loop going away) comes back with
 * cancelled set, rc -DL_E_IO and err "cancelled": cancellation is handled here, once. */
#ifndef JOBS_H
#define JOBS_H

#include <uv.h>

#include "dl_error.h"

typedef struct job_owner job_owner;
typedef struct pool_job pool_job;
typedef void (*pool_job_fn)(pool_job *j);

struct job_owner {
    uv_loop_t *loop;
    unsigned in_flight;                 /* queued, and their done not yet returned */
    void (*drained)(job_owner *o);      /* optional: after a done() that left none in flight */
};

struct pool_job {
    uv_work_t req;
    job_owner *owner;
    pool_job_fn work, done;
    void *arg;                          /* the caller's arguments and results (done frees them) */
    int rc;                             /* what work says (0: done) */
    int cancelled;
    dl_error err;
};

void job_owner_init(job_owner *o, uv_loop_t *loop, void (*drained)(job_owner *o));
/* Queues work, then done on the loop; the job is freed after done returns.  0, or a negative errno
 * (nothing queued: arg is still the caller's). */
int job_queue(job_owner *o, pool_job_fn work, pool_job_fn done, void *arg);

#endif
