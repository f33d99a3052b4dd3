/* daemon_downlink.c: (d->down) the downlink beside the pass (README, "The downlink"; common/downlink.h):
 * after the pass wrote step s's global, the view and the update of s are made on the pool from it and
 * the committed view, before the commit (the pass activity ends with them, so the redo record, the
 * commit and the settle see one step whose global, view and update agree); a committed step's view and
 * its chain's last --updates-keep updates are served; /status's "downlink" and its /metrics.  A redo
 * record that names the downlink makes them again at a restart (daemon__downlink_recover), bit for bit. */
#include "daemon.h"
#include "daemon_internal.h"
#include "daemon_parts.h"

#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "blockhash.h"
#include "compress.h"
#include "dl_log.h"
#include "downlink.h"
#include "pipeline.h"
#include "store.h"
#include "strbuf.h"

typedef struct make_args {
    downlink_args a;
    char *view_in;              /* the committed view (its global when the chain starts there) */
    char *global, *out_view, *out_update;
    uint64_t chain_from;
    downlink_pass *pass;        /* between prepare and finish */
    int jobs;                   /* run jobs still out */
    downlink_out out;
    double started, seconds;
} make_args;

static void make_args_free(make_args *m)
{
    if (m != NULL) {
        free(m->view_in);
        free(m->global);
        free(m->out_view);
        free(m->out_update);
        free(m);
    }
}

/* The arguments of step's view and update from the committed step's files; NULL without memory. */
static make_args *make_args_new(dilocod *d, int enc, uint64_t step, const char *global)
{
    make_args *m = calloc(1, sizeof(*m));

    if (m == NULL)
        return NULL;
    m->view_in = strdup(d->st.view_path != NULL ? d->st.view_path : d->st.global_path);
    m->global = strdup(global);
    m->out_view = store_view_path(&d->st, step);
    m->out_update = store_update_path(&d->st, step);
    if (m->view_in == NULL || m->global == NULL || m->out_view == NULL || m->out_update == NULL) {
        make_args_free(m);
        return NULL;
    }
    m->chain_from = d->st.view_path != NULL ? d->st.view.chain_from : d->st.step;
    m->a = (downlink_args){(cz_encoding)enc, m->global, m->view_in, m->out_view, m->out_update, step, d->st.step, 0};
    return m;
}

static store_view made_view(const make_args *m)
{
    store_view v = {.enc = (int)m->a.enc, .chain_from = m->chain_from, .hashed = 1};
    memcpy(v.hash, m->out.view_hash, sizeof(v.hash));
    return v;
}

/* The step's view and update are made as the pass is (outer.c): prepared on the pool, run by --threads
 * jobs at once, finished (the view hashed, both files renamed) by one more. */
static void finish_work(job *j)
{
    make_args *m = j->arg;

    j->rc = downlink_finish(m->pass, &m->out, &j->err);
    m->pass = NULL;
    m->seconds = daemon__clock() - m->started;
}

static void finish_done(job *j)
{
    dilocod *d = daemon__of_job(j);
    make_args *m = j->arg;
    char hex[65];

    if (j->rc != 0 || d->stopping) {
        make_args_free(m);
        daemon__aggregation_failed(d, &j->err);
        return;
    }
    d->down.pending = made_view(m);
    d->down.made = 1;
    d->down.made_step = m->a.step;
    d->down.last_update_bytes = m->out.update_bytes;
    d->down.view_bytes = m->out.view_bytes;
    d->down.last_seconds = m->seconds;
    d->down.last_gap = m->out.max_gap;
    blockhash_hex(m->out.view_hash, hex);
    dl_log(DL_LOG_DEBUG, "downlink", "view and update made", "step=%" PRIu64 " encoding=%s update_bytes=%" PRIu64
           " view_bytes=%" PRIu64 " seconds=%.3f max_gap=%.3g view_hash=%s", m->a.step, cz_encoding_name(m->a.enc),
           m->out.update_bytes, m->out.view_bytes, m->seconds, m->out.max_gap, hex);
    make_args_free(m);
    /* the step's files are all written: the commit waits in computing for the inputs and the previous settle */
    pipeline_end(&d->pipe, d->rnd.step + 1, STEP_ACT_PASS, 1);
    daemon__try_commit(d);
}

/* The pass is given up (no job for its end): finished here, its outputs removed. */
static void finish_now(dilocod *d, make_args *m, const char *why)
{
    dl_error e;
    downlink_abort(m->pass);
    downlink_finish(m->pass, &m->out, NULL);
    make_args_free(m);
    dl_fail(&e, DL_E_NO_MEMORY, NULL, 0, "%s", why);
    daemon__aggregation_failed(d, &e);
}

static void queue_finish(dilocod *d, make_args *m)
{
    if (daemon__queue(d, finish_work, finish_done, m) != 0)
        finish_now(d, m, "cannot queue the end of the downlink's view and update");
}

static void run_work(job *j)
{
    downlink_run(((make_args *)j->arg)->pass);
}

static void run_done(job *j)
{
    make_args *m = j->arg;
    if (--m->jobs == 0)
        queue_finish(daemon__of_job(j), m);
}

static void prepare_work(job *j)
{
    make_args *m = j->arg;
    m->started = daemon__clock();
    j->rc = downlink_prepare(&m->a, &m->pass, &j->err);
}

static void prepare_done(job *j)
{
    dilocod *d = daemon__of_job(j);
    make_args *m = j->arg;

    if (j->rc != 0) {
        make_args_free(m);
        daemon__aggregation_failed(d, &j->err);
        return;
    }
    if (d->stopping) {
        downlink_abort(m->pass);
        queue_finish(d, m);
        return;
    }
    for (unsigned i = 0; i < d->cfg->threads; i++)
        if (daemon__queue(d, run_work, run_done, m) == 0)
            m->jobs++;
    if (m->jobs == 0)
        finish_now(d, m, "cannot queue the downlink's view and update");
}

void daemon__downlink_make(dilocod *d)
{
    make_args *m = make_args_new(d, d->cfg->downlink, d->rnd.step + 1, d->agg.pass->out_global_path);
    dl_error e;

    d->down.made = 0;
    if (m != NULL && daemon__queue(d, prepare_work, prepare_done, m) == 0)
        return;
    make_args_free(m);
    dl_fail(&e, DL_E_NO_MEMORY, NULL, 0, "cannot queue the downlink's view and update");
    daemon__aggregation_failed(d, &e);
}

const store_view *daemon__downlink_made(const dilocod *d, uint64_t step)
{
    return d->down.made && d->down.made_step == step ? &d->down.pending : NULL;
}

int daemon__downlink_recover(dilocod *d, int enc, uint64_t step, const char *global, store_view *out, dl_error *err)
{
    make_args *m = make_args_new(d, enc, step, global);
    int rc;

    if (m == NULL)
        return dl_fail(err, DL_E_NO_MEMORY, NULL, 0, "out of memory");
    m->a.durable = 1;   /* outer_metadata.json names them at once: no settle follows a recovery */
    if ((rc = downlink_make(&m->a, &m->out, err)) == 0)
        *out = made_view(m);
    make_args_free(m);
    return rc;
}

/* ---- serving: the committed view and the chain's last updates -------------------------------------- */

static void ring_clear(dilocod *d)
{
    for (unsigned i = 0; d->down.updates != NULL && i < d->down.nring; i++)
        daemon__served_file_clear(&d->down.updates[i]);
}

/* Whether step's update is of the committed chain and among the last kept. */
static int update_kept(const dilocod *d, uint64_t step)
{
    const store *st = &d->st;
    return st->view_path != NULL && step > st->view.chain_from && step <= st->step &&
           step + d->cfg->updates_keep > st->step;
}

/* Opens step's update into its ring slot (unless it holds it already).  Opens on the loop: one file of
 * the state directory per commit (or a few at startup), as small as the open of the global's step file. */
static void serve_update(dilocod *d, uint64_t step)
{
    served_file *f = &d->down.updates[step % d->down.nring];
    char *path;

    if (f->file != NULL && d->down.update_step[step % d->down.nring] == step)
        return;
    daemon__served_file_clear(f);
    if ((path = store_update_path(&d->st, step)) == NULL)
        return;
    int rc = daemon__served_file_set(f, daemon__open_for_download(path), step);
    if (rc != 0)
        dl_log(DL_LOG_WARN, "downlink", "cannot open an update for downloads", "step=%" PRIu64 " error=%s", step,
               strerror(-rc));
    else
        d->down.update_step[step % d->down.nring] = step;
    free(path);
}

void daemon__downlink_serve(dilocod *d)
{
    const store *st = &d->st;

    if (d->cfg->downlink == CZ_NONE || !st->committed)
        return;
    if (d->down.updates == NULL) {
        d->down.nring = d->cfg->updates_keep;
        d->down.updates = calloc(d->down.nring, sizeof(*d->down.updates));
        d->down.update_step = calloc(d->down.nring, sizeof(*d->down.update_step));
        if (d->down.updates == NULL || d->down.update_step == NULL) {
            free(d->down.updates);
            free(d->down.update_step);
            d->down.updates = NULL;
            d->down.update_step = NULL;
            dl_log(DL_LOG_ERROR, "downlink", "out of memory: no update is served", "%s", "");
            return;
        }
    }
    served_file v = {0};
    int rc = daemon__served_file_set(&v, daemon__open_for_download(st->view_path != NULL ? st->view_path
                                                                                           : st->global_path), st->step);
    if (rc != 0) {
        dl_log(DL_LOG_WARN, "downlink", "cannot open the view for downloads: the previous one stays served",
               "step=%" PRIu64 " error=%s", st->step, strerror(-rc));
    } else {
        daemon__served_file_clear(&d->down.view);
        d->down.view = v;
        d->down.view_step = st->step;
        d->down.view_hashed = st->view_path != NULL && st->view.hashed;
        memcpy(d->down.view_hash, st->view.hash, sizeof(d->down.view_hash));
    }
    /* a new chain (the view is the global again: adopted, bootstrapped, or the downlink turned on)
     * serves no update of the old one */
    if (st->view_path == NULL)
        ring_clear(d);
    uint64_t first = st->step >= d->down.nring ? st->step - d->down.nring + 1 : 0;
    for (uint64_t k = first; k <= st->step; k++)
        if (update_kept(d, k))
            serve_update(d, k);
}

void daemon__downlink_free(dilocod *d)
{
    ring_clear(d);
    daemon__served_file_clear(&d->down.view);
    free(d->down.updates);
    free(d->down.update_step);
    d->down.updates = NULL;
    d->down.update_step = NULL;
}

/* The committed step's downlink files for the transport's next publish (a tree: updates/<s>, a view
 * checkpoint every keep/2 steps). */
void daemon__downlink_publish(dilocod *d)
{
    const store *st = &d->st;
    hub_downlink dl = {0};
    char *u = NULL;

    if (d->cfg->downlink == CZ_NONE || d->hub == NULL || !st->committed)
        return;
    if (st->view_path != NULL && (u = store_update_path(st, st->step)) == NULL) {
        dl_log(DL_LOG_ERROR, "downlink", "out of memory: the step is published without its update", "step=%" PRIu64,
               st->step);
        return;
    }
    dl.update_path = u;
    dl.view_path = st->view_path != NULL ? st->view_path : st->global_path;
    dl.step = st->step;
    dl.chain_from = st->view_path != NULL ? st->view.chain_from : st->step;
    dl.keep = d->cfg->updates_keep;
    if (st->view_path != NULL && st->view.hashed)
        blockhash_hex(st->view.hash, dl.view_hash);
    if (hub_set_downlink(d->hub, &dl) != 0)
        dl_log(DL_LOG_ERROR, "downlink", "out of memory: the step is published without its update", "step=%" PRIu64,
               st->step);
    free(u);
}

/* ---- what api/ reads (daemon.h) ------------------------------------------------------------------- */

int daemon_downlink_on(const dilocod *d)
{
    return d->cfg->downlink != CZ_NONE;
}

const served_file *daemon_view_file(const dilocod *d, uint64_t *step)
{
    if (d->down.view.file == NULL)
        return NULL;
    *step = d->down.view_step;
    return &d->down.view;
}

const served_file *daemon_update_file(const dilocod *d, uint64_t step)
{
    if (d->down.updates == NULL || !update_kept(d, step))
        return NULL;
    const served_file *f = &d->down.updates[step % d->down.nring];
    return f->file != NULL && d->down.update_step[step % d->down.nring] == step ? f : NULL;
}

int daemon_downlink_names(const dilocod *d, uint64_t step, char view_hash[65], int *has_update)
{
    if (d->down.view.file == NULL || d->down.view_step != step)
        return -1;
    *has_update = daemon_update_file(d, step) != NULL;
    if (!d->down.view_hashed)
        return 1;
    blockhash_hex(d->down.view_hash, view_hash);
    return 0;
}

void daemon_downlink_sent(dilocod *d, int update, uint64_t bytes)
{
    if (update) {
        d->down.updates_sent++;
        d->down.update_bytes_sent += bytes;
    } else {
        d->down.views_sent++;
        d->down.view_bytes_sent += bytes;
    }
}

/* ---- /status and /metrics -------------------------------------------------------------------------- */

static void downlink_status(const dilocod *d, sbuf *b)
{
    char hex[65];

    if (d->cfg->downlink == CZ_NONE)
        return;
    sb_printf(b, ",\"downlink\":{\"encoding\":\"%s\",\"updates_keep\":%u", cz_encoding_name((cz_encoding)d->cfg->downlink),
              d->cfg->updates_keep);
    if (d->down.view.file != NULL) {
        sb_printf(b, ",\"view_step\":%" PRIu64 ",\"chain_from\":%" PRIu64 ",\"view_bytes\":%" PRIu64,
                  d->down.view_step, d->st.view_path != NULL ? d->st.view.chain_from : d->st.step, d->down.view.size);
        if (d->down.view_hashed) {
            blockhash_hex(d->down.view_hash, hex);
            sb_printf(b, ",\"view_hash\":\"%s\"", hex);
        }
    }
    sb_printf(b, ",\"last_update_bytes\":%" PRIu64 ",\"global_bytes\":%" PRIu64 ",\"last_make_seconds\":",
              d->down.last_update_bytes, d->global.single.size);
    daemon_json_num(b, d->down.last_seconds);
    sb_str(b, ",\"last_max_gap\":");
    daemon_json_num(b, d->down.last_gap);
    sb_printf(b, ",\"updates_sent\":%" PRIu64 ",\"update_bytes_sent\":%" PRIu64 ",\"views_sent\":%" PRIu64
              ",\"view_bytes_sent\":%" PRIu64 "}", d->down.updates_sent, d->down.update_bytes_sent,
              d->down.views_sent, d->down.view_bytes_sent);
}

static void downlink_metrics(const dilocod *d, sbuf *b)
{
    if (d->cfg->downlink == CZ_NONE)
        return;
    daemon_metric_family(b, "dilocod_downlink_bytes_sent_total", "counter",
                         "Bytes of the downlink's files sent over HTTP (update: GET /global/updates/<s>, view: GET "
                         "/global/view.safetensors)");
    sb_printf(b, "dilocod_downlink_bytes_sent_total{file=\"update\"} %" PRIu64 "\n", d->down.update_bytes_sent);
    sb_printf(b, "dilocod_downlink_bytes_sent_total{file=\"view\"} %" PRIu64 "\n", d->down.view_bytes_sent);
    daemon_metric_family(b, "dilocod_downlink_update_bytes", "gauge", "Bytes of the last update made");
    sb_printf(b, "dilocod_downlink_update_bytes %" PRIu64 "\n", d->down.last_update_bytes);
    daemon_metric_family(b, "dilocod_downlink_make_seconds", "gauge",
                         "Seconds the last step's view and update took to make (on the step's critical path)");
    sb_str(b, "dilocod_downlink_make_seconds ");
    daemon_json_num(b, d->down.last_seconds);
    sb_str(b, "\n");
}

const daemon_provider daemon__downlink_provider = {"downlink", downlink_status, downlink_metrics};
