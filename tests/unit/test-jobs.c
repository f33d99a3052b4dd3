/* The pool-job API (server/core/jobs.h) on a real loop: work runs on the pool and done on the loop
 * with the job's own typed arguments, and the owner counts its jobs and is told once when the last is
 * done. */
#include "test.h"

#include <stdlib.h>

#include <uv.h>

#include "jobs.h"

typedef struct square_args {
    int in, out;
    uv_thread_t worker;
} square_args;

static uv_thread_t loop_thread;
static int done_count, drained_count;
static unsigned in_flight_seen[8];

static void square_work(pool_job *j)
{
    square_args *a = j->arg;
    a->out = a->in * a->in;
    a->worker = uv_thread_self();
}

static void square_done(pool_job *j)
{
    square_args *a = j->arg;
    uv_thread_t self = uv_thread_self();
    CHECK(uv_thread_equal(&self, &loop_thread));
    CHECK(!uv_thread_equal(&a->worker, &loop_thread));
    CHECK_EQ(a->out, a->in * a->in);
    CHECK_EQ(j->rc, 0);
    CHECK(!j->cancelled);
    in_flight_seen[done_count++ % 8] = j->owner->in_flight;
    free(a);
}

static void drained(job_owner *o)
{
    CHECK_EQ(o->in_flight, 0);
    drained_count++;
}

TEST(jobs_run_on_the_pool_and_finish_on_the_loop)
{
    uv_loop_t loop;
    job_owner o;

    loop_thread = uv_thread_self();
    CHECK_EQ(uv_loop_init(&loop), 0);
    job_owner_init(&o, &loop, drained);
    for (int i = 1; i <= 5; i++) {
        square_args *a = calloc(1, sizeof(*a));
        a->in = i;
        CHECK_EQ(job_queue(&o, square_work, square_done, a), 0);
    }
    CHECK_EQ(o.in_flight, 5);
    CHECK_EQ(uv_run(&loop, UV_RUN_DEFAULT), 0);
    CHECK_EQ(done_count, 5);
    CHECK_EQ(drained_count, 1);                 /* once, when the last one is done */
    for (int i = 0; i < 5; i++)
        CHECK(in_flight_seen[i] < 5);           /* each done runs after its own job left the count */
    CHECK_EQ(o.in_flight, 0);
    CHECK_EQ(uv_loop_close(&loop), 0);
}
