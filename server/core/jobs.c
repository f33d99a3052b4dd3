#include "jobs.h"

#include <errno.h>
#include <stdlib.h>

#include "util.h"

void job_owner_init(job_owner *o, uv_loop_t *loop, void (*drained)(job_owner *o))
{
    o->loop = loop;
    o->in_flight = 0;
    o->drained = drained;
}

static void work_cb(uv_work_t *req)
{
    pool_job *j = container_of(req, pool_job, req);
    j->work(j);
}

static void after_cb(uv_work_t *req, int status)
{
    pool_job *j = container_of(req, pool_job, req);
    job_owner *o = j->owner;

    if (status == UV_ECANCELED) {
        j->cancelled = 1;
        j->rc = -DL_E_IO;
        dl_fail(&j->err, DL_E_IO, NULL, 0, "cancelled");
    }
    o->in_flight--;
    j->done(j);
    free(j);
    if (o->in_flight == 0 && o->drained != NULL)
        o->drained(o);
}

int job_queue(job_owner *o, pool_job_fn work, pool_job_fn done, void *arg)
{
    pool_job *j = calloc(1, sizeof(*j));
    int rc;

    if (j == NULL)
        return -ENOMEM;
    j->owner = o;
    j->work = work;
    j->done = done;
    j->arg = arg;
    dl_error_clear(&j->err);
    if ((rc = uv_queue_work(o->loop, &j->req, work_cb, after_cb)) != 0) {
        free(j);
        return rc;
    }
    o->in_flight++;
    return 0;
}
