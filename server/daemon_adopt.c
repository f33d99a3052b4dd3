/* Adopting a global: the transport's published one (a verified local copy in our state, moved into
 * place) or --init-model (linked where it can be, else copied), validated and committed as the state's
 * first step.  A plain --init-model is taken in two jobs so the first round collects meanwhile
 * (bootstrap_header_work, then adopt_work).  The transport's published_seen and global_ready
 * callbacks land here. */
#include "daemon_internal.h"
#include "daemon_parts.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "dl_log.h"
#include "fsutil.h"
#include "hub.h"
#include "pipeline.h"
#include "hub_file.h"          /* hubfile_copy: --init-model, a trusted file, copied into the state */
#include "safetensors.h"
#include "st_index.h"
#include "st_reshard.h"
#include "stepcount.h"
#include "manifest.h"
#include "store.h"

/* max_header: the cap on the model's header (0: the format's own) */
int daemon__open_model(dilocod *d, const char *path, uint64_t max_header, dl_error *err)
{
    st_file *f;
    int rc = st_open_capped(path, max_header, &f, err);

    if (rc != 0)
        return rc;
    st_header_free(d->model);
    d->model = f->h;
    f->h = NULL;
    st_close(f);
    return 0;
}

/* Moves our own copy (in the state directory) into place: durable before the commit names it. */
static int move_into_place(const char *src, const char *dst, dl_error *err)
{
    int fd = open(src, O_RDONLY | O_CLOEXEC);

    if (fd < 0)
        return dl_fail_errno(err, errno, "cannot open %s", src);
    if (fsync(fd) != 0) {
        int e = errno;
        close(fd);
        return dl_fail_errno(err, e, "cannot fsync %s", src);
    }
    close(fd);
    if (rename(src, dst) != 0)
        return dl_fail_errno(err, errno, "cannot rename %s to %s", src, dst);
    return fsu_fsync_parent(dst, err);
}

/* The same tensors (names, dtypes, shapes, offsets) in a and b. */
static int same_tensors(const st_header *a, const st_header *b)
{
    if (a->ntensors != b->ntensors)
        return 0;
    for (size_t i = 0; i < a->ntensors; i++) {
        const st_tensor *x = &a->tensors[i], *y = &b->tensors[i];
        if (x->name_len != y->name_len || memcmp(x->name, y->name, x->name_len) != 0 || x->dtype != y->dtype ||
            x->ndim != y->ndim || x->begin != y->begin || x->end != y->end ||
            (x->ndim > 0 && memcmp(x->shape, y->shape, x->ndim * sizeof(*x->shape)) != 0))
            return 0;
    }
    return 1;
}

/* Zero-copy bootstrap: dst becomes a hard link to src's inode, through its descriptor (a rename of src
 * meanwhile cannot swap it), made durable (the inode's fsync, the directory's fsync).  A link names a
 * whole file at once, so no temporary name is needed; dst is a step-0 file of a state with nothing
 * committed, so a leftover there is ours to replace.  The state then shares that inode with the
 * operator's file until step 1 is durable and the step-0 global goes: the version linked is committed
 * with step 0 (store.global_version) and checked before the pass, before the commit and at recovery
 * (global_rewritten).  0, or a positive errno when no link can be made here (another filesystem,
 * fs.protected_hardlinks, a file that changed while it was linked), with nothing left behind: the
 * caller copies instead. */
static int link_model(const char *src, const char *dst, fsu_ident *version)
{
    struct stat before, after;
    fsu_ident now;
    dl_error ignored;
    int fd, e = 0;

    if ((fd = open(src, O_RDONLY | O_NONBLOCK | O_CLOEXEC)) < 0)
        return errno;
    if (fstat(fd, &before) != 0 || !S_ISREG(before.st_mode)) {
        close(fd);
        return EINVAL;          /* the copy says what it is */
    }
    fsu_ident_of(&before, version);
    (void)unlink(dst);
    if ((e = fsu_link_fd(fd, AT_FDCWD, dst)) != 0) {
        close(fd);
        return e;               /* nothing made */
    }
    if (fsync(fd) != 0)
        e = errno;
    else if (fstat(fd, &after) != 0 || (fsu_ident_of(&after, &now), !fsu_ident_same_content(&now, version)))
        e = ESTALE;             /* written to while linked */
    else if (fsu_fsync_parent(dst, &ignored) != 0)
        e = EIO;
    if (e != 0)
        unlink(dst);
    close(fd);
    return e;
}

/* --init-model into the state as dst: linked where it can be (link_model), else copied, made durable.
 * *mi is zeroed by the caller (daemon__adopt_prepare). */
static int take_model(const char *src, const char *dst, model_intake *mi, dl_error *err)
{
    if ((mi->link_errno = link_model(src, dst, &mi->version)) == 0) {
        mi->linked = 1;
        return 0;
    }
    return hubfile_copy(src, dst, err);
}

/* The bootstrap's intake of --init-model once the round opened on its header (d->model, which the
 * intakes read meanwhile: it is compared, never replaced): linked or copied, made durable, committed as
 * step 0.  A model that changed since its header was read is refused. */
static int bootstrap_take(const st_header *known, const char *src, const char *dst, model_intake *mi,
                          dl_error *err)
{
    st_file *f;
    int rc;

    if ((rc = take_model(src, dst, mi, err)) != 0)
        return rc;
    if ((rc = st_open(dst, &f, err)) == 0) {
        if (!same_tensors(f->h, known))
            rc = dl_fail(err, DL_E_METADATA_INVALID, NULL, 0,
                         "%s changed while dilocod started from it (its tensors are not the ones read first)", src);
        st_close(f);
    }
    if (rc != 0)
        unlink(dst);
    return rc;
}

/* path's header into *out (max_header: its cap, 0 for the format's own), on whatever thread. */
static int read_header(const char *path, uint64_t max_header, st_header **out, dl_error *err)
{
    st_file *f;
    int rc = st_open_capped(path, max_header, &f, err);

    if (rc != 0)
        return rc;
    *out = f->h;
    f->h = NULL;
    st_close(f);
    return 0;
}

int daemon__adopt_prepare(const dilocod *d, const char *src, uint64_t step, int bootstrap, const st_header *known,
                          adopt_result *r, dl_error *err)
{
    int rc;

    memset(r, 0, sizeof(*r));
    r->info = (store_commit_info){
        .step = step,
        .optimizer = config_optimizer_name(d->cfg->optimizer),
        .lr = d->cfg->lr,
        .momentum = d->cfg->momentum,
        .bootstrap = bootstrap,
        .origin = bootstrap ? "init_model" : "adopted",
    };
    /* another writer's global: its step and its header bounded as every other input (a step whose
     * successor no delta can name bricks the state; a header no delta of that model could have costs
     * memory for nothing).  A set's shards are held to that cap together, as a delta set's are, each
     * refused from its prefix before it is read (st_set_open_capped) */
    const uint64_t max_header = bootstrap ? 0 : (uint64_t)d->cfg->max_delta_header_mib << 20;

    if (!bootstrap && (rc = stepcount_check(step, "the published step", err)) != 0)
        return rc;
    if ((r->dst = store_global_path(&d->st, step)) == NULL)
        return dl_fail(err, DL_E_NO_MEMORY, NULL, 0, "out of memory");
    r->info.global_path = r->dst;
    /* validate first: a damaged model must not become our state.  A sharded global (an index and its
     * shards, checked as a set) becomes one file: the state keeps the plain layout whatever the size */
    if (known != NULL) {
        rc = bootstrap_take(known, src, r->dst, &r->mi, err);
    } else if (st_index_is_index_path(src)) {
        if ((rc = st_reshard(src, max_header, r->dst, 0, NULL, 0, NULL, err)) == 0 &&
            (rc = read_header(r->dst, max_header, &r->model, err)) != 0)
            unlink(r->dst);
    } else if ((rc = read_header(src, max_header, &r->model, err)) == 0) {
        rc = bootstrap ? take_model(src, r->dst, &r->mi, err) : move_into_place(src, r->dst, err);
    }
    r->info.global_version = r->mi.linked ? &r->mi.version : NULL;
    /* --signing-key: the step's record before its commit, so no committed step lacks one */
    char hash[65];
    if (rc == 0 && d->sign.on &&
        (rc = daemon__sign_whole(d, step, bootstrap ? "bootstrap" : "adopted", r->dst, hash, err)) != 0)
        unlink(r->dst);
    /* d->st is the loop's: only its directory, which never changes, is read here */
    if (rc == 0 && (rc = store_commit_write(&d->st, &r->info, err)) != 0)
        unlink(r->dst);         /* not committed: not ours to keep (and never the operator's name) */
    /* --verify-keep: the step's global for verifiers of the next step (a failure costs them that step only) */
    dl_error kerr;
    if (rc == 0 && d->cfg->verify_keep > 0 &&
        manifest_keep(d->st.dir, step, (unsigned)d->cfg->verify_keep, r->dst, NULL, NULL, NULL, NULL, 0, &kerr) != 0)
        daemon__log_error("sign", "cannot keep the global for verifiers (--verify-keep)", &kerr);
    return rc;
}

int daemon__adopt_apply(dilocod *d, adopt_result *r)
{
    if (store_commit_apply(&d->st, &r->info) != 0)
        return -1;
    if (r->model != NULL) {
        st_header_free(d->model);
        d->model = r->model;
        r->model = NULL;
    }
    return 0;
}

void daemon__adopt_result_free(adopt_result *r)
{
    st_header_free(r->model);
    free(r->dst);
    memset(r, 0, sizeof(*r));
}

typedef struct adopt_args {
    char *path;
    uint64_t step;
    int bootstrap;
    int header_known;           /* the round opened on the model's header (bootstrap_header_done) */
    st_header *header;          /* bootstrap_header_work's result, until the loop takes it */
    adopt_result res;           /* adopt_work's, applied by adopt_done */
} adopt_args;

static void adopt_work(job *j)
{
    adopt_args *a = j->arg;
    const dilocod *d = daemon__of_job(j);
    /* the round's header (bootstrap_header_done set it, and the loop only reads it until adopt_done) */
    const st_header *known = a->header_known ? d->model : NULL;

    j->rc = daemon__adopt_prepare(d, a->path, a->step, a->bootstrap, known, &a->res, &j->err);
}

/* The "bootstrapped" line: how --init-model came in (a copy says why it was not linked). */
void daemon__log_bootstrapped(const dilocod *d, const char *path, const model_intake *mi)
{
    char qp[600], qw[160];

    dl_log(DL_LOG_INFO, "store", "bootstrapped", "step=0 init_model=%s tensors=%zu taken=%s%s%s",
           dl_log_q(qp, sizeof(qp), path), d->model->ntensors, mi->linked ? "linked" : "copied",
           mi->linked ? "" : " why_not_linked=", mi->linked ? "" : dl_log_q(qw, sizeof(qw), strerror(mi->link_errno)));
}

static void adopt_done(job *j)
{
    dilocod *d = daemon__of_job(j);
    adopt_args *a = j->arg;

    d->bootstrap_in_flight = 0;
    if (!a->bootstrap)
        daemon__discard_local(d, a->path, 1);   /* moved into place, or refused: either way gone */
    if (j->rc != 0 && a->bootstrap) {
        daemon__fatal(d, "store", "cannot bootstrap from --init-model", &j->err);   /* nothing to start from */
    } else if (j->rc != 0) {
        d->adoptions_refused++;
        /* the transport offers a refused global again at each poll: one line per step offered */
        if (d->adopt_refused_step != (int64_t)a->step)
            daemon__log_error("store", "cannot adopt the published global", &j->err);
        d->adopt_refused_step = (int64_t)a->step;
        if (!d->stopping)
            hub_set_step(d->hub, 0, 1);     /* still waiting: the transport offers its global again */
    } else if (daemon__adopt_apply(d, &a->res) != 0) {
        /* durable on disk, unknown in memory: a restart reads it back; stop rather than serve a lie */
        dl_error e;
        dl_fail(&e, DL_E_NO_MEMORY, NULL, 0, "out of memory recording the adoption of step %" PRIu64
                "; restarting is safe (it is durable)", a->step);
        daemon__fatal(d, "store", "cannot go on", &e);
    } else if (!d->stopping) {
        daemon__sign_chain(d);
        if (a->bootstrap) {
            daemon__log_bootstrapped(d, a->path, &a->res.mi);
        } else {
            d->published_step = (int64_t)a->step;
            dl_log(DL_LOG_WARN, "store", "adopted the published global", "step=%" PRIu64 " momentum=fresh", a->step);
        }
        if (a->header_known) {
            daemon__global_committed(d);        /* the round is open already: it may close now */
            daemon__maybe_close_round(d);
        } else {
            daemon__collecting_start(d);
        }
    }
    daemon__adopt_result_free(&a->res);
    free(a->path);
    st_header_free(a->header);
    free(a);
}

/* A bootstrap overlapped with the first round's intake: this job reads the model's header only; the
 * round opens on it (deltas are validated against it) while adopt_work copies the model into the
 * state and makes it durable, and the round closes once step 0 is committed.  A sharded
 * --init-model is resharded into one file first, in adopt_work alone (start_adopt). */
static void bootstrap_header_work(job *j)
{
    adopt_args *a = j->arg;
    st_file *f;

    if ((j->rc = st_open(a->path, &f, &j->err)) != 0)
        return;
    a->header = f->h;
    f->h = NULL;
    st_close(f);
}

static void bootstrap_header_done(job *j)
{
    dilocod *d = daemon__of_job(j);
    adopt_args *a = j->arg;

    if (j->rc != 0 || d->stopping) {
        adopt_done(j);          /* a refused model fails the bootstrap there */
        return;
    }
    st_header_free(d->model);
    d->model = a->header;
    a->header = NULL;
    a->header_known = 1;
    daemon__round_open(d);
    if (daemon__queue(d, adopt_work, adopt_done, a) != 0) {
        j->rc = dl_fail(&j->err, DL_E_NO_MEMORY, NULL, 0, "cannot queue the copy of --init-model");
        adopt_done(j);
    }
}

/* An adoption or bootstrap that could not even be queued (out of memory): as if it had failed, so that
 * the daemon never waits for a global nothing is making.  A bootstrap stops the daemon (exit 1, as a
 * refused --init-model does); an adoption lets the transport offer its global again. */
static void adopt_not_queued(dilocod *d, const char *path, int bootstrap)
{
    dl_error e;

    dl_fail(&e, DL_E_NO_MEMORY, NULL, 0, "out of memory for the job");
    if (bootstrap) {
        daemon__fatal(d, "store", "cannot bootstrap from --init-model", &e);
        return;
    }
    daemon__log_error("store", "cannot adopt the published global", &e);
    daemon__discard_local(d, path, 1);
    hub_set_step(d->hub, 0, 1);
}

static void start_adopt(dilocod *d, const char *path, uint64_t step, int bootstrap)
{
    /* a plain --init-model: its header first, and the round opens on it (bootstrap_header_work) */
    const int header_first = bootstrap && !st_index_is_index_path(path);
    adopt_args *a;

    if (d->bootstrap_in_flight || d->stopping) {
        if (!bootstrap)
            daemon__discard_local(d, path, 1);
        return;
    }
    if ((a = calloc(1, sizeof(*a))) == NULL || (a->path = strdup(path)) == NULL) {
        free(a);
        adopt_not_queued(d, path, bootstrap);
        return;
    }
    a->step = step;
    a->bootstrap = bootstrap;
    if (daemon__queue(d, header_first ? bootstrap_header_work : adopt_work,
                      header_first ? bootstrap_header_done : adopt_done, a) == 0) {
        d->bootstrap_in_flight = 1;
    } else {
        free(a->path);
        free(a);
        adopt_not_queued(d, path, bootstrap);
    }
}

/* The transport's published step, when first known (its first poll) or changed. */
void daemon__on_published_seen(void *app, int64_t step)
{
    dilocod *d = app;

    d->published_known = 1;
    if (daemon__state(d) == S_WAITING_GLOBAL) {
        if (step < 0 && d->cfg->init_model != NULL)
            start_adopt(d, d->cfg->init_model, 0, 1);       /* nothing published: our model is step 0 */
        else if (step < 0)
            dl_log(DL_LOG_WARN, "store", "no state, no --init-model, nothing published: waiting for a global",
                   "hub=%s", d->cfg->hub);
        return;                 /* with a global there, the transport copies it: daemon__on_global_ready */
    }
    if (step >= 0 && (uint64_t)step == d->st.step && d->republish) {
        dl_log(DL_LOG_WARN, "hub", "publishing the recovered step again",
               "step=%" PRId64 " why=the hub's copy was published before the step's files were durable", step);
    } else if (step >= 0 && (uint64_t)step == d->st.step) {
        d->published_step = step;
        pipeline_published(&d->pipe, d->st.step);      /* found there: /status says so, as after our publish */
    } else if (step > (int64_t)d->st.step) {
        dl_log(DL_LOG_WARN, "hub", "the hub holds a newer step than our state; ours will be published over it",
               "hub_step=%" PRId64 " step=%" PRIu64, step, d->st.step);
    }
    daemon__maybe_publish(d);
}

void daemon__on_global_ready(void *app, uint64_t step, const char *local_path)
{
    dilocod *d = app;
    if (daemon__state(d) != S_WAITING_GLOBAL) {
        daemon__discard_local(d, local_path, 1);
        return;
    }
    start_adopt(d, local_path, step, 0);
}
