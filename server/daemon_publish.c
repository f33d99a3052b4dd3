/* The served global and the published layout: what GET /global/... sends (served_global, swapped as a
 * whole per step), the set a global above --shard-size is published and served as (written once per
 * step, on the pool), and publishing the committed step through the transport, with its backoff.  The
 * transport's publish_done callback lands here. */
#include "daemon_internal.h"
#include "daemon_parts.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "dl_log.h"
#include "fsutil.h"
#include "http.h"
#include "hub.h"
#include "pipeline.h"
#include "st_index.h"
#include "st_reshard.h"
#include "store.h"

/* ---- the served and published layout ------------------------------------------------------------ */

/* A descriptor for serving path, or a negative errno. */
int daemon__open_for_download(const char *path)
{
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    return fd >= 0 ? fd : -errno;
}

/* The index of step's published set (global/set-<step>/latest.safetensors.index.json), malloc'd. */
static char *set_index_path(dilocod *d, uint64_t step)
{
    char *dir = store_set_dir(&d->st, step), *p = NULL;
    if (dir != NULL && asprintf(&p, "%s/latest" ST_INDEX_SUFFIX, dir) < 0)
        p = NULL;
    free(dir);
    return p;
}

void daemon__served_file_clear(served_file *f)
{
    if (f->file != NULL)
        http_file_unref(f->file);
    memset(f, 0, sizeof(*f));
}

void daemon__served_clear(served_global *g)
{
    daemon__served_file_clear(&g->single);
    daemon__served_file_clear(&g->index);
    for (uint32_t i = 0; i < g->nshards; i++)
        daemon__served_file_clear(&g->shards[i]);
    free(g->shards);
    memset(g, 0, sizeof(*g));
}

int daemon__served_file_set(served_file *f, int fd, uint64_t step)
{
    struct stat sb;

    if (fd < 0)
        return fd;
    if (fstat(fd, &sb) != 0) {
        int e = -errno;
        close(fd);
        return e;
    }
    if ((f->file = http_file_new(fd)) == NULL)
        return -ENOMEM;
    f->size = (uint64_t)sb.st_size;
    snprintf(f->etag, sizeof(f->etag), "\"s%" PRIu64 "-%" PRIx64 "-%" PRIx64 "\"", step, (uint64_t)sb.st_ino,
             (uint64_t)sb.st_size);
    return 0;
}

/* Opens step's published set (the index and every shard) into g.  0 or a negative errno. */
static int served_open_set(dilocod *d, served_global *g, uint64_t step)
{
    char *index = set_index_path(d, step), *dir = store_set_dir(&d->st, step), name[ST_INDEX_BASE_MAX + 40];
    char *path = NULL;
    int rc = index != NULL && dir != NULL ? 0 : -ENOMEM;

    if (rc == 0)
        rc = daemon__served_file_set(&g->index, daemon__open_for_download(index), step);
    if (rc == 0 && (g->shards = calloc(d->layout.nshards, sizeof(*g->shards))) == NULL)
        rc = -ENOMEM;
    for (uint32_t i = 0; rc == 0 && i < d->layout.nshards; i++) {
        g->nshards = i + 1;
        if (st_index_shard_name("latest", i, d->layout.nshards, name, sizeof(name)) != 0 ||
            asprintf(&path, "%s/%s", dir, name) < 0) {
            path = NULL;
            rc = -ENOMEM;
            break;
        }
        rc = daemon__served_file_set(&g->shards[i], daemon__open_for_download(path), step);
        free(path);
        path = NULL;
    }
    free(index);
    free(dir);
    return rc;
}

/* Serves the committed step's global in its published layout.  fd: the step's single file already
 * opened (a commit opens it off the loop), or a negative errno to open it here.  A failure (EMFILE,
 * say) keeps the previous step served, a consistent older step rather than a 503, and
 * daemon__global() tries again.  A sharded layout is served once its set is written. */
void daemon__serve_step(dilocod *d, int fd, uint64_t step)
{
    served_global g = {.step = step};
    int rc;

    if (d->layout.nshards > 1) {
        if (fd >= 0)
            close(fd);
        if (d->layout.step != (int64_t)step) {
            d->global_stale = 1;        /* until the set is written: the previous step stays served */
            return;
        }
        rc = served_open_set(d, &g, step);
    } else {
        rc = daemon__served_file_set(&g.single, fd >= 0 ? fd : daemon__open_for_download(d->st.global_path), step);
    }
    if (rc != 0) {
        if (!d->global_stale)
            dl_log(DL_LOG_WARN, "http", "cannot open the committed global for downloads, will retry",
                   "step=%" PRIu64 " serving=%s error=%s", step, d->global.available ? "previous step" : "nothing",
                   strerror(-rc));
        daemon__served_clear(&g);
        d->global_stale = 1;
        return;
    }
    g.available = 1;
    daemon__served_clear(&d->global);
    d->global = g;
    d->global_stale = 0;
}

const served_global *daemon__global(dilocod *d)
{
    if (d->global_stale && d->st.committed && (d->layout.nshards <= 1 || d->layout.step == (int64_t)d->st.step))
        daemon__serve_step(d, -1, d->st.step);
    return &d->global;
}

typedef struct set_args {
    char *src;                  /* the step's single file */
    uint64_t step;
} set_args;

/* Writes the committed step's published set from its single file, on the pool.  An index already
 * there is a complete set (written last). */
static void set_work(job *j)
{
    dilocod *d = daemon__of_job(j);
    set_args *a = j->arg;
    char *dir = store_set_dir(&d->st, a->step), *index = set_index_path(d, a->step), *dst = NULL;

    if (dir == NULL || index == NULL || asprintf(&dst, "%s/latest.safetensors", dir) < 0) {
        dst = NULL;
        j->rc = dl_fail(&j->err, DL_E_NO_MEMORY, NULL, 0, "out of memory");
    } else if (access(index, F_OK) == 0) {
        j->rc = 0;
    } else if ((j->rc = fsu_mkdirs(dir, &j->err)) == 0) {
        j->rc = st_reshard(a->src, 0, dst, d->cfg->shard_size, NULL, 0, NULL, &j->err);     /* our own global */
    }
    free(dir);
    free(index);
    free(dst);
}

static void set_retry_cb(uv_timer_t *t)
{
    daemon__ensure_set(container_of(t, dilocod, set_timer));
}

static void set_done(job *j)
{
    dilocod *d = daemon__of_job(j);
    set_args *a = j->arg;
    uint64_t step = a->step;

    pipeline_end(&d->pipe, step, STEP_ACT_SET, j->rc == 0);
    free(a->src);
    free(a);
    if (d->stopping)
        return;
    if (j->rc != 0) {
        daemon__log_error("store", "cannot write the sharded global, will retry", &j->err);
        uv_timer_start(&d->set_timer, set_retry_cb, (uint64_t)(d->cfg->retry_interval * 1000), 0);
        return;
    }
    d->layout.step = (int64_t)step;
    dl_log(DL_LOG_DEBUG, "store", "sharded global written", "step=%" PRIu64 " shards=%u", step, d->layout.nshards);
    if (step == d->st.step) {
        daemon__serve_step(d, -1, step);
        daemon__maybe_publish(d);
    }
    daemon__ensure_set(d);              /* a newer step may have been committed meanwhile */
}

/* Above --shard-size, the committed step is published and served as a set: written once per step. */
void daemon__ensure_set(dilocod *d)
{
    set_args *a;

    if (d->layout.nshards <= 1 || pipeline_any_busy(&d->pipe, STEP_ACT_SET) || d->stopping || !d->st.committed ||
        d->layout.step == (int64_t)d->st.step)
        return;
    if ((a = calloc(1, sizeof(*a))) != NULL)
        a->step = d->st.step;
    if (a == NULL || (a->src = strdup(d->st.global_path)) == NULL ||
        pipeline_start(&d->pipe, d->st.step, STEP_ACT_SET) != 0) {
        if (a != NULL)
            free(a->src);
        free(a);
        uv_timer_start(&d->set_timer, set_retry_cb, (uint64_t)(d->cfg->retry_interval * 1000), 0);
        return;
    }
    if (daemon__queue(d, set_work, set_done, a) != 0) {
        pipeline_end(&d->pipe, d->st.step, STEP_ACT_SET, 0);
        free(a->src);
        free(a);
        uv_timer_start(&d->set_timer, set_retry_cb, (uint64_t)(d->cfg->retry_interval * 1000), 0);
    }
}

/* The published layout of the model: how many shards --shard-size makes (1: the plain file), in
 * the single file's data order, as st_reshard writes them. */
void daemon__plan_layout(dilocod *d)
{
    st_spec *specs = malloc((d->model->ntensors ? d->model->ntensors : 1) * sizeof(*specs));
    uint32_t *plan = malloc((d->model->ntensors ? d->model->ntensors : 1) * sizeof(*plan)), n = 1;
    dl_error err;

    if (specs != NULL && plan != NULL) {
        for (size_t i = 0; i < d->model->ntensors; i++) {
            const st_tensor *t = &d->model->tensors[i];
            specs[i] = (st_spec){t->name, t->name_len, t->dtype, t->ndim, t->shape};
        }
        if (st_index_plan(specs, d->model->ntensors, d->cfg->shard_size, plan, &n, &err) != 0)
            n = 1;
    }
    free(specs);
    free(plan);
    if (n != d->layout.nshards && n > 1)
        dl_log(DL_LOG_INFO, "store", "the global is published sharded", "shards=%u shard_size=%" PRIu64, n,
               d->cfg->shard_size);
    d->layout.nshards = n;
}

/* ---- publishing ------------------------------------------------------------------------------ */

static void publish_retry_cb(uv_timer_t *t)
{
    daemon__maybe_publish(container_of(t, dilocod, publish_timer));
}

/* Every transport's publish ends here: the same state, counters, logs and retry (error: why this
 * attempt failed, NULL on success). */
void daemon__on_publish_done(void *app, uint64_t step, const char *error)
{
    dilocod *d = app;
    char q[600];

    pipeline_end(&d->pipe, step, STEP_ACT_PUBLISH, error == NULL);
    daemon__release_settle(d);
    if (error != NULL) {
        d->m.publish_errors++;
        /* the same failure again is no news: said once at error level, then at debug, with the retries
         * backing off up to a minute; a different failure is said again */
        int same = strcmp(d->publish.last_error, error) == 0;
        dl_log(same ? DL_LOG_DEBUG : DL_LOG_ERROR, "hub", "publish failed, will retry",
               "step=%" PRIu64 " in_seconds=%.1f error=%s", step, d->publish.backoff > 0 ? d->publish.backoff
                                                                                      : d->cfg->retry_interval,
               dl_log_q(q, sizeof(q), error));
        snprintf(d->publish.last_error, sizeof(d->publish.last_error), "%s", error);
        d->publish.backoff = d->publish.backoff > 0 ? fmin(d->publish.backoff * 2, MAX_RETRY_SECONDS)
                                                    : d->cfg->retry_interval;
        if (!d->stopping)
            uv_timer_start(&d->publish_timer, publish_retry_cb, (uint64_t)(d->publish.backoff * 1000), 0);
        return;
    }
    d->publish.backoff = 0;
    d->publish.last_error[0] = '\0';
    d->published_step = (int64_t)step;
    pipeline_published(&d->pipe, step);
    if (step == d->st.step)
        d->republish = 0;
    dl_log(DL_LOG_INFO, "hub", "published", "step=%" PRIu64 " hub=%s%s", step, d->cfg->hub,
           d->publish.bootstrap ? " bootstrap=true" : "");
    if (!d->stopping) {
        daemon__maybe_publish(d);       /* a newer step may have been committed meanwhile */
        daemon__schedule_cleanup(d);
    }
}

/* A publish of the committed step starts: the steps since the last one published are never published
 * (coalesced), and the interval runs from now. */
static void publish_started(dilocod *d)
{
    if (d->published_step >= 0 && d->st.step > (uint64_t)d->published_step + 1)
        d->publish.coalesced += d->st.step - (uint64_t)d->published_step - 1;
    d->publish.last_started = daemon__now(d);
}

/* The committed step through the transport (model: its file or its set's index), with its signed record
 * when steps are signed and it has one (a step committed before --signing-key was given has none). */
static void publish_step(dilocod *d, const char *model)
{
    char *record = d->sign.on ? store_path_manifest(d->st.dir, d->st.step, 0) : NULL;
    hub_publication pub = {
        .step = d->st.step,
        .global_path = model,
        .optimizer = config_optimizer_name(d->cfg->optimizer),
        .bootstrap = d->st.bootstrap && d->st.step == 0,
        .record_path = record != NULL && d->sign.prev_step == (int64_t)d->st.step ? record : NULL,
    };

    d->publish.bootstrap = pub.bootstrap;
    publish_started(d);
    daemon__downlink_publish(d);        /* the downlink's files go with this publish (hub.h set_downlink) */
    hub_publish_step(d->hub, &pub);
    free(record);
}

void daemon__maybe_publish(dilocod *d)
{
    /* published_known: the transport has told what it holds (its first poll), so a restart does not
     * publish again a step that is already there */
    if (d->hub == NULL || pipeline_any_busy(&d->pipe, STEP_ACT_PUBLISH) || d->stopping || !d->st.committed ||
        !d->published_known || d->published_step == (int64_t)d->st.step)
        return;
    /* --publish-interval: the newest step, at most that often (the Hub allows 128 commits an hour per
     * repository: async mode commits an update per delta) */
    double wait = d->publish.last_started >= 0 ? d->publish.last_started + d->cfg->publish_interval - daemon__now(d) : 0;
    if (d->cfg->publish_interval > 0 && wait > 0) {
        if (!uv_is_active((uv_handle_t *)&d->publish_timer))
            uv_timer_start(&d->publish_timer, publish_retry_cb, (uint64_t)(wait * 1000) + 1, 0);
        return;
    }
    if (d->layout.nshards > 1) {
        /* the sharded layout: its set once written (daemon__ensure_set publishes when it is) */
        char *index = d->layout.step == (int64_t)d->st.step ? set_index_path(d, d->st.step) : NULL;
        if (index == NULL || pipeline_start(&d->pipe, d->st.step, STEP_ACT_PUBLISH) != 0) {
            free(index);
            return;
        }
        publish_step(d, index);
        free(index);
        return;
    }
    if (pipeline_start(&d->pipe, d->st.step, STEP_ACT_PUBLISH) != 0)
        return;
    publish_step(d, d->st.global_path);
}
