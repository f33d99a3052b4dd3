/* upload: PUT /nodes/{id}/delta_{n}.safetensors and POST /nodes/{id}/deltas (one whole delta), the
 * /nodes/ route, and the uploads' own state (how many are in flight, shown by their status provider).
 * The parts of a sharded delta stream the same way and are staged by upload_set.c.
 *
 * The body streams through a delta_stream (the header is checked against the global model and the
 * round as soon as it is complete, every value checked finite on the way) into a temporary file in
 * cache/incoming, written with uv_fs_write from two alternating buffers, in writes that end at multiples
 * of 2 MiB of the file (FLUSH_BYTES): while a write is in flight and the other buffer is full, the
 * connection stops reading.  A 2 MiB write at a 2 MiB offset lands in one 2 MiB page-cache folio, which
 * the pass then maps with one page-table entry (outer.c): 8 x 256 MiB uploaded in 1 MiB writes took the
 * pass 0.35-0.39 s, in 2 MiB writes 0.21-0.27 s (bench-outer).  The header (up to
 * max_delta_header_mib) is parsed on the thread pool, not on the loop, with the connection's reads
 * stopped meanwhile; bytes of the body that arrived with it wait in `pending`.  Complete and valid, the file
 * is fsynced and linked into the cache on the thread pool, then offered to the round.  A refused,
 * failed or aborted upload leaves nothing behind. */
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <math.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "api.h"
#include "auth.h"
#include "daemon.h"
#include "delta_stream.h"
#include "dl_log.h"
#include "intake.h"
#include "store.h"
#include "strbuf.h"
#include "upload_internal.h"
#include "wbuf.h"

/* ---- the uploads' own state ------------------------------------------------------------------------ */

/* The uploads being received: each holds two write buffers and up to max_delta_header_mib of header,
 * so upload_admit bounds them by --max-uploads.  A process runs one daemon: the count is this file's. */
static struct {
    int in_flight;
    auth_table tokens;          /* --token-file's (upload_tokens_load) */
} uploads;

int upload_in_flight(void)
{
    return uploads.in_flight;
}

int upload_tokens_load(const char *path, size_t *entries, dl_error *err)
{
    int rc = auth_load(&uploads.tokens, path, err);
    *entries = uploads.tokens.n;
    return rc;
}

void upload_tokens_free(void)
{
    auth_free(&uploads.tokens);
}

static void uploads_status(const dilocod *d, sbuf *b)
{
    (void)d;
    sb_printf(b, ",\"uploads_in_progress\":%d", uploads.in_flight);
}

static void uploads_metrics(const dilocod *d, sbuf *b)
{
    (void)d;
    daemon_metric_family(b, "uploads_in_progress", "gauge", "HTTP uploads being received.");
    sb_printf(b, "dilocod_uploads_in_progress %d\n", uploads.in_flight);
}

const daemon_provider upload_provider = {"uploads", uploads_status, uploads_metrics};

static atomic_uint upload_counter;

unsigned upload_next_id(void)
{
    return atomic_fetch_add(&upload_counter, 1);
}

static int status_for(dl_code code)
{
    switch (code) {
    case DL_E_KEY_MISMATCH:
    case DL_E_SHAPE_MISMATCH:
    case DL_E_DTYPE_MISMATCH:
    case DL_E_METADATA_MISSING:
    case DL_E_METADATA_INVALID:
    case DL_E_PATH_MISMATCH:
    case DL_E_INVALID_PATH:
    case DL_E_NON_FINITE:
    case DL_E_UNSUPPORTED_DTYPE:
        return 422;
    case DL_E_IO:
    case DL_E_NO_MEMORY:
        return 500;
    default:
        return 400;             /* the container itself is malformed */
    }
}

static void upload_free(upload *u)
{
    http_conn *c = u->c;
    /* a disk error can end the upload while the connection still reads its body: the connection
     * must never call back into a freed upload */
    http_body_detach(c, u);
    set_part_release(u);
    delta_stream_free(&u->ds);
    free(u->pending.p);
    free(u->body.p);
    free(u->gby);
    free(u->tmp_path);
    wbuf_free(&u->buf);
    uploads.in_flight--;
    free(u);
    http_conn_unref(c);
}

/* Closes and removes the temporary file, then frees u, once no file operation is in flight. */
void upload_discard(upload *u)
{
    u->failed = 1;
    if (u->opening || u->writing || u->finalizing || u->writeback || u->parsing || u->completing)
        return;                 /* the completion callback comes back here */
    if (u->fd >= 0) {
        close(u->fd);           /* a close of a regular file does not wait on the disk */
        u->fd = -1;
    }
    if (u->tmp_path != NULL)
        unlink(u->tmp_path);
    upload_free(u);
}

/* Answers a refused upload (when its client still listens) and logs it. */
void upload_refuse(http_conn *c, const char *node_id, int status, const char *code, const char *msg,
                   const char *tensor)
{
    char m[600], t[300], qn[160];
    if (c != NULL && http_conn_alive(c))
        http_respond_error(c, status, code, msg, tensor);
    dl_log(status >= 500 ? DL_LOG_ERROR : DL_LOG_WARN, "http", "upload refused",
           "node=%s status=%d code=%s error=%s%s%s", dl_log_q(qn, sizeof(qn), node_id), status, code,
           dl_log_q(m, sizeof(m), msg), tensor && tensor[0] ? " tensor=" : "",
           tensor && tensor[0] ? dl_log_q(t, sizeof(t), tensor) : "");
}

void upload_reject(upload *u, int status, const char *code, const char *msg, const char *tensor)
{
    u->failed = 1;              /* refused: an abort reported while answering must not free u */
    upload_refuse(u->c, u->node_id, status, code, msg, tensor);
}

void upload_reject_err(upload *u, const dl_error *err)
{
    int status = status_for(err->code);
    if (err->code == DL_E_IO && err->sys_errno == ENOSPC)
        status = 507;
    if (status != 500 && status != 507)         /* the delta's verdict, not the server's trouble */
        daemon_verdict_rejected(u->d, u->node_id, &u->ds.info, err->code, status, err->message, err->tensor);
    upload_reject(u, status, dl_error_name(err->code), err->message, err->tensor);
}

static int start_write(upload *u);
static void finalize(upload *u);

#define WRITEBACK_BYTES (8u << 20)

/* Starts the disk on what is written so far (the final fsync then waits for little), off the loop:
 * sync_file_range may wait for a congested device queue. */
static void writeback_work(pool_job *j)
{
    upload *u = j->arg;
    /* the range is the job's (u->file_off belongs to the loop thread) */
    (void)sync_file_range(u->fd, (off64_t)u->wb_off, (off64_t)u->wb_len, SYNC_FILE_RANGE_WRITE);
}

static void writeback_done(pool_job *j)
{
    upload *u = j->arg;
    u->writeback--;
    if (u->failed)
        upload_discard(u);
}

static void maybe_writeback(upload *u)
{
    uint64_t len = u->file_off - u->wb_done;
    if (u->writeback || len < WRITEBACK_BYTES)
        return;
    if (len > (1u << 30))
        len = 1u << 30;
    u->wb_off = u->wb_done;
    u->wb_len = len;
    if (daemon__queue(u->d, writeback_work, writeback_done, u) == 0) {
        u->writeback++;
        u->wb_done += len;
    }
}

static void write_cb(uv_fs_t *req)
{
    upload *u = req->data;
    ssize_t r = req->result;

    uv_fs_req_cleanup(req);
    u->writing = 0;
    if (u->failed || u->aborted) {
        upload_discard(u);
        return;
    }
    if (r < 0 || (size_t)r != u->wlen) {
        dl_error e;
        int code = r < 0 ? (int)-r : EIO;
        dl_fail_errno(&e, code, "writing the upload to %s", u->tmp_path);
        upload_reject_err(u, &e);
        upload_discard(u);
        return;
    }
    u->file_off += u->wlen;
    u->wlen = 0;
    maybe_writeback(u);
    if (u->buf.fill_len >= FLUSH_BYTES || (u->ended && u->buf.fill_len > 0)) {
        start_write(u);
        return;
    }
    if (u->ended) {
        finalize(u);
        return;
    }
    if (!u->parsing)
        http_resume(u->c);
}

/* Returns 0, or -1 when the upload failed and was discarded (u may be gone).  Writes what the filling
 * buffer holds up to the next multiple of FLUSH_BYTES of the file (all of it at the end); the rest moves
 * to the other buffer, which fills next. */
static int start_write(upload *u)
{
    size_t len = wbuf_cut(&u->buf, u->file_off, FLUSH_BYTES, u->ended);
    int rc;

    if (wbuf_swap(&u->buf, len) != 0) {
        upload_reject(u, 500, "out_of_memory", "out of memory buffering the upload", NULL);
        upload_discard(u);
        return API_ANSWERED;
    }
    u->wlen = len;
    u->wiov = uv_buf_init(u->buf.out, (unsigned)u->wlen);
    u->write_req.data = u;
    u->writing = 1;
    if ((rc = uv_fs_write(http_conn_loop(u->c), &u->write_req, u->fd, &u->wiov, 1, (int64_t)u->file_off,
                          write_cb)) != 0) {
        dl_error e;
        u->writing = 0;
        dl_fail_errno(&e, -rc, "writing the upload");
        upload_reject_err(u, &e);
        upload_discard(u);
        return API_ANSWERED;
    }
    return 0;
}

static void open_cb(uv_fs_t *req)
{
    upload *u = req->data;
    ssize_t r = req->result;

    uv_fs_req_cleanup(req);
    u->opening = 0;
    if (r >= 0)
        u->fd = (uv_file)r;
    if (u->failed || u->aborted) {
        upload_discard(u);
        return;
    }
    if (r < 0) {
        dl_error e;
        dl_fail_errno(&e, (int)-r, "cannot create %s", u->tmp_path);
        upload_reject_err(u, &e);
        upload_discard(u);
        return;
    }
    if (u->buf.fill_len >= FLUSH_BYTES || (u->ended && u->buf.fill_len > 0))
        start_write(u);
    else if (u->ended)
        finalize(u);
    else if (!u->parsing)
        http_resume(u->c);
}

/* Why the round will not take a delta of info (known_base 0: a set whose index has not arrived,
 * judged as if based on the open round's step).  Returns the HTTP status. */
static int verdict_message(dilocod *d, round_verdict v, const delta_info *info, int known_base, char *msg,
                           size_t size)
{
    const round_entry *e;

    const round_state *r = daemon_round(d);

    switch (v) {
    case ROUND_STALE:
        if (r->async && known_base) {
            snprintf(msg, size, "base_outer_step %" PRIu64 " is stale: tau = %" PRIu64 " updates behind step %" PRIu64
                     ", above max_staleness S = %" PRIu64, info->base_outer_step, r->step - info->base_outer_step,
                     r->step, r->max_staleness);
            return 409;
        }
        if (known_base)
            snprintf(msg, size, "base_outer_step %" PRIu64 " is stale: the round for step %" PRIu64 " is %s",
                     info->base_outer_step, daemon_round(d)->step, info->base_outer_step == daemon_round(d)->step ? "closed" : "open");
        else
            snprintf(msg, size, "the round for step %" PRIu64 " is closed: no delta can join it now", daemon_round(d)->step);
        return 409;
    case ROUND_FUTURE:
        snprintf(msg, size, "base_outer_step %" PRIu64 " is ahead of the current step %" PRIu64, info->base_outer_step,
                 daemon_round(d)->step);
        return 409;
    case ROUND_NOT_NEWER:
        e = round_find(daemon_round(d), info);
        snprintf(msg, size, "node %s already delivered local_step %" PRIu64 " or later in this round", info->node_id,
                 e != NULL ? e->local_step : info->local_step);
        return 409;
    case ROUND_UNKNOWN_NODE:
        snprintf(msg, size, "node %s is not in the allow-list", info->node_id);
        return 403;
    case ROUND_OUTLIER: {
        double norm = 0, bound = 0;
        const char *reason = "norm_ratio", *basis = "round";
        daemon_quarantine_detail(d, info->node_id, &norm, &bound, &reason, &basis);
        if (strcmp(reason, "max_norm") == 0)
            snprintf(msg, size, "quarantined: the delta's L2 norm %.9g is above max_norm %.9g", norm, bound);
        else
            snprintf(msg, size, "quarantined: the delta's L2 norm %.9g is above the bound %.9g (max_norm_ratio x the "
                     "median norm of the %s)", norm, bound, strcmp(basis, "trailing") == 0 ? "node's last rounds"
                                                                                            : "round's deltas, its own included");
        return 422;
    }
    case ROUND_NO_WEIGHT:
        snprintf(msg, size, "--aggregate weighted_mean weighs each delta by its \"weight\" or \"num_tokens\" "
                 "metadata, and this delta has neither (or num_tokens 0)");
        return 422;
    case ROUND_BUSY:
        snprintf(msg, size, "%zu deltas already wait for an update (async_queue %zu): retry shortly", round_pending(r),
                 r->queue_max);
        return 503;
    default:
        snprintf(msg, size, "the round already has its %u nodes", daemon_config(d)->expected_nodes);
        return 409;
    }
}

/* Asks the round about info now: 0 when it would take it, else answers, counts and returns -1. */
int upload_peek_or_refuse(dilocod *d, http_conn *c, const delta_info *info, int known_base)
{
    char msg[240];
    round_verdict v = daemon__peek(d, info);

    if (round_verdict_taken(v))
        return 0;
    int status = verdict_message(d, v, info, known_base, msg, sizeof(msg));
    daemon_verdict_refused(d, info->node_id, known_base ? info : NULL, v, status, msg);
    if (status == 503)
        (void)http_conn_set_response_header(c, "Retry-After", "1");
    upload_refuse(c, info->node_id, status, round_verdict_name(v), msg, NULL);
    return API_ANSWERED;
}

/* upload_peek_or_refuse for an upload in progress: marked failed first, so an abort that the refusal's
 * answer reports (the connection finishing) does not free u under its caller. */
int upload_peek(upload *u, const delta_info *info)
{
    int was = u->failed;

    u->failed = 1;
    if (upload_peek_or_refuse(u->d, u->c, info, 1) != 0)
        return API_ANSWERED;
    u->failed = was;
    return 0;
}

/* The header is complete: decide from it whether the round can take this delta at all. */
static int header_verdict(upload *u)
{
    const delta_info *info = &u->ds.info;

    if (u->kind == UP_SHARD)
        return set_shard_verdict(u);
    if (!u->by_path) {
        if (strcmp(info->node_id, u->node_id) != 0) {
            char msg[200];
            snprintf(msg, sizeof(msg), "delta metadata node_id \"%s\" does not match the URL's node id \"%s\"",
                     info->node_id, u->node_id);
            daemon_verdict_rejected(u->d, u->node_id, NULL, DL_E_PATH_MISMATCH, 422, msg, NULL);
            upload_reject(u, 422, "path_mismatch", msg, NULL);
            return API_ANSWERED;
        }
        snprintf(u->rel, sizeof(u->rel), "nodes/%s/delta_%" PRIu64 ".safetensors", info->node_id, info->local_step);
    }
    if (upload_peek(u, info) != 0)
        return API_ANSWERED;
    return 0;
}

static void header_parsed(pool_job *j);
static void end_of_body(upload *u);

static void header_parse_work(pool_job *j)
{
    upload *u = j->arg;
    j->rc = u->kind == UP_SHARD ? set_shard_parse_header(u, &j->err) : delta_stream_parse_header(&u->ds, &j->err);
}

/* Feeds body bytes to the validator, stopping at the end of the header bytes to parse them on the
 * pool.  Returns 0, or -1 when the upload was refused (and discarded). */
static int validate(upload *u, const char *p, size_t n)
{
    dl_error err;

    while (n > 0) {
        size_t k = delta_stream_room(&u->ds, n);
        int rc = delta_stream_feed(&u->ds, p, k, &err);
        if (rc < 0) {
            upload_reject_err(u, &err);
            upload_discard(u);
            return API_ANSWERED;
        }
        p += k;
        n -= k;
        if (rc == DELTA_STREAM_HEADER_READY) {
            if (n > 0)
                sb_add(&u->pending, p, n);
            if (u->pending.oom || daemon__queue(u->d, header_parse_work, header_parsed, u) != 0) {
                upload_reject(u, 500, "out_of_memory", "cannot queue the header's parse", NULL);
                upload_discard(u);
                return API_ANSWERED;
            }
            u->parsing = 1;
            return 0;
        }
    }
    return 0;
}

/* Decides what the connection does next: 0 go on reading, 1 stop until http_resume. */
static int read_verdict(upload *u)
{
    if (u->parsing)
        return 1;               /* until the header is parsed */
    if (u->buf.fill_len < FLUSH_BYTES)
        return 0;
    if (!u->writing && !u->opening)
        return start_write(u) != 0 ? -1 : 1;
    return 1;                   /* both buffers busy: stop reading until the disk catches up */
}

static void header_parsed(pool_job *j)
{
    upload *u = j->arg;
    char *rest;
    size_t rest_len;

    u->parsing = 0;
    if (u->failed || u->aborted) {
        upload_discard(u);
        return;
    }
    if (j->rc != 0) {
        upload_reject_err(u, &j->err);
        upload_discard(u);
        return;
    }
    if (header_verdict(u) != 0) {
        upload_discard(u);
        return;
    }
    /* what came with the header, and after it, is checked now */
    rest = u->pending.p;
    rest_len = u->pending.len;
    memset(&u->pending, 0, sizeof(u->pending));
    int rc = validate(u, rest, rest_len);
    free(rest);
    if (rc != 0)
        return;
    if (u->end_seen) {
        end_of_body(u);
        return;
    }
    if (read_verdict(u) == 0)
        http_resume(u->c);
}

int upload_body_read(upload *u, size_t n)
{
    if (u->failed)
        return API_ANSWERED;
    if (u->stage != NULL && u->stage->dead) {
        upload_reject(u, u->stage->dead_status, u->stage->dead_code, u->stage->dead_why, NULL);
        upload_discard(u);
        return API_ANSWERED;
    }
    stats_upload_received(daemon_stats(u->d), n);
    return 0;
}

static int on_data(http_conn *c, const char *p, size_t n, void *ctx)
{
    upload *u = ctx;

    (void)c;
    if (upload_body_read(u, n) != 0)
        return API_ANSWERED;
    if (u->parsing) {
        /* the rest of the read buffer, parsed by llhttp after we asked to stop: it waits */
        sb_add(&u->pending, p, n);
    } else if (validate(u, p, n) != 0) {
        return API_ANSWERED;
    }
    if (u->pending.oom || wbuf_append(&u->buf, p, n) != 0) {
        upload_reject(u, 500, "out_of_memory", "out of memory buffering the upload", NULL);
        upload_discard(u);
        return API_ANSWERED;
    }
    return read_verdict(u);
}

typedef struct finalize_args {
    upload *u;
    char *cache_path;
    intake_status st;
} finalize_args;

static void finalize_work(pool_job *j)
{
    finalize_args *a = j->arg;
    upload *u = a->u;

    /* a compressed delta's codes decode with their scales, which the stream saw apart: read back from
     * our own file (nobody else writes it) */
    if (u->ds.info.cz.enc != CZ_NONE) {
        if ((a->st = intake_check_codes(u->ds.global, u->fd, u->ds.h, &u->ds.info, &u->ds.norm, &j->err)) != INTAKE_OK)
            return;
        u->ds.info.norm = sqrt(delta_norm_sumsq(&u->ds.norm));
        u->ds.info.has_norm = 1;
    }
    if (fsync(u->fd) != 0) {
        dl_fail_errno(&j->err, errno, "fsync of the upload");
        a->st = INTAKE_IO;
        return;
    }
    if (u->kind == UP_SHARD) {
        /* into its set under its own name, replacing an earlier copy of the same shard; the set's
         * directory stays while this part holds its reference */
        char *final = NULL;
        a->st = INTAKE_OK;
        if (asprintf(&final, "%s/%s", u->stage->dir, u->part) < 0) {
            dl_fail_errno(&j->err, ENOMEM, "out of memory");
            a->st = INTAKE_IO;
        } else if (rename(u->tmp_path, final) != 0) {
            dl_fail_errno(&j->err, errno, "moving the shard into %s", final);
            a->st = INTAKE_IO;
        }
        free(final);
        return;
    }
    a->st = intake_link_into_cache(daemon_store(daemon_of_job(j))->dir, &u->ds.info, u->tmp_path, &a->cache_path, &j->err);
}

void upload_respond_json(upload *u, int status, sbuf *b)
{
    size_t len = b->len;
    char *text = sb_take(b);

    if (text == NULL) {
        http_respond_error(u->c, 500, "out_of_memory", "out of memory", NULL);
        return;
    }
    http_respond(u->c, status, "application/json", NULL, text, len);
    free(text);
}

void upload_respond_created(upload *u, const delta_info *info, const char *rel, round_verdict v, uint64_t size)
{
    dilocod *d = u->d;
    sbuf b = {0};
    char num[256];

    if (!http_conn_alive(u->c))
        return;
    upload_recommend(d, u->c, info->node_id);       /* with this delta's measure */
    snprintf(num, sizeof(num),
             "{\"node_id\":\"%s\",\"local_step\":%" PRIu64 ",\"base_outer_step\":%" PRIu64 ",\"bytes\":%" PRIu64
             ",\"result\":\"%s\",",
             info->node_id, info->local_step, info->base_outer_step, size, round_verdict_name(v));
    sb_str(&b, num);
    sb_str(&b, "\"path\":");
    sb_json_string(&b, rel, strlen(rel));
    /* what the answer cannot know yet: the close's screens (norm, cosine), an overflowed pass or a
     * discarded round may still keep the delta out of the step; GET /nodes/<id> tells (README, "Verdicts") */
    sb_printf(&b, ",\"final\":false,\"decided_at\":\"%s\",\"verdicts\":\"/nodes/%s\"",
              daemon_round(d)->async ? (v == ROUND_QUEUED ? "next_update" : "update") : "round_close", info->node_id);
    /* the round may already have closed on this very delta */
    snprintf(num, sizeof(num), ",\"round\":{\"step\":%" PRIu64 ",\"received\":%zu,\"expected\":%u,\"state\":\"%s\"}}\n",
             info->base_outer_step, daemon_round(d)->step == info->base_outer_step ? daemon_round(d)->n : (size_t)0,
             daemon_config(d)->expected_nodes, daemon_state_name(d));
    sb_str(&b, num);
    upload_respond_json(u, 201, &b);
}

static void finalize_done(pool_job *j)
{
    finalize_args *a = j->arg;
    upload *u = a->u;
    dilocod *d = u->d;
    uint64_t size = u->ds.file_len;

    u->finalizing = 0;
    if (a->st == INTAKE_OK && u->kind == UP_SHARD) {
        set_shard_in(u, size);
    } else if (a->st == INTAKE_OK) {
        /* the file is in the cache: whatever happens to the connection, the round gets it */
        round_verdict v = daemon__offer(d, &u->ds.info, a->cache_path, size);
        a->cache_path = NULL;
        if (round_verdict_taken(v))
            upload_respond_created(u, &u->ds.info, u->rel, v, size);
        else
            upload_reject_verdict(u, &u->ds.info, v);
    } else if (a->st == INTAKE_DUPLICATE) {
        static const char dup[] = "this node's delta for this local_step is already in the round";
        daemon_verdict_refused(d, u->node_id, &u->ds.info, ROUND_NOT_NEWER, 409, dup);
        upload_reject(u, 409, "not_newer", dup, NULL);
    } else {
        upload_reject_err(u, &j->err);
    }
    free(a);
    upload_discard(u);          /* the temporary name goes in every case; the cache link stays */
}

static void finalize(upload *u)
{
    finalize_args *a = calloc(1, sizeof(*a));

    if (a == NULL) {
        upload_reject(u, 500, "out_of_memory", "out of memory", NULL);
        upload_discard(u);
        return;
    }
    a->u = u;
    u->finalizing = 1;
    if (daemon__queue(u->d, finalize_work, finalize_done, a) != 0) {
        u->finalizing = 0;
        free(a);
        upload_reject(u, 500, "internal", "cannot queue the upload's final step", NULL);
        upload_discard(u);
    }
}

static void end_of_body(upload *u)
{
    dl_error err;

    if (delta_stream_finish(&u->ds, &err) != 0) {
        upload_reject_err(u, &err);
        upload_discard(u);
        return;
    }
    u->ended = 1;               /* open_cb and write_cb now finish the file */
    if (u->opening || u->writing)
        return;                 /* their callbacks continue */
    if (u->buf.fill_len > 0)
        start_write(u);
    else
        finalize(u);
}

static void on_end(http_conn *c, void *ctx)
{
    upload *u = ctx;

    (void)c;
    if (u->failed)
        return;
    u->end_seen = 1;
    if (!u->parsing)            /* else header_parsed finishes */
        end_of_body(u);
}

void upload_on_abort(http_conn *c, void *ctx)
{
    upload *u = ctx;
    (void)c;
    if (u->failed)
        return;
    u->aborted = 1;
    dl_log(DL_LOG_INFO, "http", "upload aborted", "node=%s received=%" PRIu64, u->node_id,
           u->kind == UP_INDEX ? (uint64_t)u->body.len : u->ds.pos);
    if (!u->finalizing)
        upload_discard(u);      /* waits for a header parse or a disk operation in flight */
}

static const http_body_ops upload_ops = {on_data, on_end, upload_on_abort};

static int authorize(dilocod *d, http_conn *c, http_request *req, const char *node_id)
{
    if (daemon_config(d)->token_file == NULL) {
        /* behind a reverse proxy on this host every peer is loopback: a forwarded request is not */
        if (http_header_get(req, "x-forwarded-for") != NULL || http_header_get(req, "forwarded") != NULL) {
            http_respond_error(c, 403, "forbidden",
                               "uploads through a proxy need a token file (--token-file): the loopback rule "
                               "cannot tell the proxy's clients apart",
                               NULL);
            return API_ANSWERED;
        }
        if (!req->loopback) {
            http_respond_error(c, 403, "forbidden",
                               "uploads from other hosts need a token file (--token-file); only loopback peers "
                               "may upload without one",
                               NULL);
            return API_ANSWERED;
        }
        return 0;
    }
    switch (auth_check(&uploads.tokens, http_header_get(req, "authorization"), node_id)) {
    case AUTH_OK:
        return 0;
    case AUTH_MISSING: {
        static const char body[] = "{\"error\":{\"code\":\"unauthorized\",\"message\":\"missing bearer token\"}}\n";
        http_respond(c, 401, "application/json", "WWW-Authenticate: Bearer\r\n", body, sizeof(body) - 1);
        return API_ANSWERED;
    }
    case AUTH_BAD_TOKEN: {
        static const char body[] = "{\"error\":{\"code\":\"unauthorized\",\"message\":\"invalid bearer token\"}}\n";
        http_respond(c, 401, "application/json", "WWW-Authenticate: Bearer error=\"invalid_token\"\r\n", body,
                     sizeof(body) - 1);
        return API_ANSWERED;
    }
    case AUTH_WRONG_NODE:
        http_respond_error(c, 403, "forbidden", "this token may not upload for this node", NULL);
        return API_ANSWERED;
    }
    return API_ANSWERED;
}

uint64_t upload_body_limit(const dilocod *d)
{
    return daemon_config(d)->max_body_mib ? (uint64_t)daemon_config(d)->max_body_mib << 20
                                : intake_set_budget(daemon_delta_bytes(d), (uint64_t)daemon_config(d)->max_delta_header_mib << 20);
}

/* What every upload must pass before its body is read.  0, or -1 when answered. */
/* Async mode: every upload answer carries the local steps recommended to its node (DyLU). */
void upload_recommend(dilocod *d, http_conn *c, const char *node_id)
{
    uint64_t h = daemon__async_recommended(d, node_id);
    char v[24];

    if (h == 0)
        return;
    snprintf(v, sizeof(v), "%" PRIu64, h);
    (void)http_conn_set_response_header(c, "X-Recommended-Local-Steps", v);
}

/* A delta the round refused once its body was in (the round changed meanwhile). */
void upload_reject_verdict(upload *u, const delta_info *info, round_verdict v)
{
    char msg[240];
    int status = verdict_message(u->d, v, info, 1, msg, sizeof(msg));

    if (status == 503)
        (void)http_conn_set_response_header(u->c, "Retry-After", "1");
    upload_reject(u, status, round_verdict_name(v), msg, NULL);
}

int upload_admit(dilocod *d, http_conn *c, http_request *req, const char *node_id)
{
    if (authorize(d, c, req, node_id) != 0)
        return API_ANSWERED;
    upload_recommend(d, c, node_id);
    if (uploads.in_flight >= (int)daemon_config(d)->max_uploads) {
        /* each upload holds two 1 MiB buffers and up to max_delta_header_mib of header: bounded */
        static const char body[] =
            "{\"error\":{\"code\":\"busy\",\"message\":\"too many uploads in progress; retry shortly\"}}\n";
        http_respond(c, 503, "application/json", "Retry-After: 1\r\n", body, sizeof(body) - 1);
        return API_ANSWERED;
    }
    if (daemon_config(d)->cluster_shards) {
        http_respond_error(c, 409, "cluster", "this aggregator is one of a cluster (--cluster-shards): workers "
                           "upload their deltas to the bucket's nodes/<id>/", NULL);
        return API_ANSWERED;
    }
    if (!daemon_takes_uploads(d)) {
        http_respond_error(c, 503, "no_global", "no global model yet: nothing to upload deltas against", NULL);
        return API_ANSWERED;
    }
    if (!req->has_length && !req->chunked) {
        http_respond_error(c, 411, "length_required", "a delta upload needs Content-Length or chunked encoding", NULL);
        return API_ANSWERED;
    }
    if (req->has_length && req->content_length == 0) {
        http_respond_error(c, 400, "header_too_small", "empty body", NULL);
        return API_ANSWERED;
    }
    return 0;
}

/* A new upload of kind for node_id (the two write buffers only for a file that streams to disk). */
upload *upload_new(dilocod *d, http_conn *c, const char *node_id, upload_kind kind)
{
    upload *u = calloc(1, sizeof(*u));

    if (u == NULL)
        return NULL;
    if (kind != UP_INDEX) {
        if (wbuf_init(&u->buf, FLUSH_BYTES + READ_SLACK) != 0) {
            free(u);
            return NULL;
        }
    }
    u->d = d;
    u->c = c;
    u->fd = -1;
    u->kind = kind;
    snprintf(u->node_id, sizeof(u->node_id), "%s", node_id);
    u->ds.global = daemon_model(d);
    u->ds.max_header = (uint64_t)daemon_config(d)->max_delta_header_mib << 20;
    u->ds.defer_header = 1;
    /* from here upload_free undoes everything */
    http_conn_ref(c);
    uploads.in_flight++;
    return u;
}

static void mkdir_cb(uv_fs_t *req);

/* Creates the temporary file (a part: its set's directory first).  0 or a libuv error. */
int upload_start_open(upload *u)
{
    int rc;

    u->opening = 1;
    u->open_req.data = u;
    if (u->stage != NULL && !u->stage->dir_made)
        rc = uv_fs_mkdir(daemon_loop(u->d), &u->open_req, u->stage->dir, 0755, mkdir_cb);
    else
        rc = uv_fs_open(daemon_loop(u->d), &u->open_req, u->tmp_path, O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0644,
                        open_cb);
    if (rc != 0)
        u->opening = 0;
    return rc;
}

static void mkdir_cb(uv_fs_t *req)
{
    upload *u = req->data;
    ssize_t r = req->result;
    int rc;

    uv_fs_req_cleanup(req);
    if (r == 0 || r == UV_EEXIST)
        u->stage->dir_made = 1;
    u->opening = 0;
    if (u->failed || u->aborted) {
        upload_discard(u);
        return;
    }
    if (r != 0 && r != UV_EEXIST) {
        dl_error e;
        dl_fail_errno(&e, (int)-r, "cannot create %s", u->stage->dir);
        upload_reject_err(u, &e);
        upload_discard(u);
        return;
    }
    if ((rc = upload_start_open(u)) != 0) {
        dl_error e;
        dl_fail_errno(&e, -rc, "cannot create %s", u->tmp_path);
        upload_reject_err(u, &e);
        upload_discard(u);
    }
}

void upload_stream_body(upload *u, http_request *req, char *tmp_path)
{
    u->ds.declared_len = req->has_length ? req->content_length : 0;
    u->tmp_path = tmp_path;
    if (tmp_path == NULL) {
        http_respond_error(u->c, 500, "out_of_memory", "out of memory", NULL);
        upload_discard(u);
        return;
    }
    if (upload_start_open(u) != 0) {
        http_respond_error(u->c, 500, "io_error", "cannot create the upload file", NULL);
        upload_discard(u);
        return;
    }
    http_accept_body(u->c, &upload_ops, u);
}

static void upload_start(dilocod *d, http_conn *c, http_request *req, const char *node_id, const char *path_step)
{
    upload *u;
    char *tmp;
    uint64_t step = 0, max_body;
    char msg[200];

    if (upload_admit(d, c, req, node_id) != 0)
        return;
    if (path_step != NULL && delta_parse_int(path_step, strlen(path_step), &step) != 0) {
        http_respond_error(c, 400, "invalid_path",
                           "the step in delta_<local_step>.safetensors is not a canonical integer", NULL);
        return;
    }
    max_body = upload_body_limit(d);
    if (req->has_length && req->content_length > max_body) {
        snprintf(msg, sizeof(msg), "body of %" PRIu64 " bytes is larger than the limit of %" PRIu64,
                 req->content_length, max_body);
        http_respond_error(c, 413, "too_large", msg, NULL);
        return;
    }
    if ((u = upload_new(d, c, node_id, UP_SINGLE)) == NULL) {
        http_respond_error(c, 500, "out_of_memory", "out of memory", NULL);
        return;
    }
    u->by_path = path_step != NULL;
    if (u->by_path)
        snprintf(u->rel, sizeof(u->rel), "nodes/%s/delta_%" PRIu64 ".safetensors", node_id, step);
    u->ds.path = u->by_path ? u->rel : NULL;
    tmp = store_path_incoming_file(daemon_store(d)->dir, "upload-%ld-%u", (long)getpid(), upload_next_id());
    upload_stream_body(u, req, tmp);
}

/* ---- the route ---------------------------------------------------------------------------------- */

/* /nodes/{id}/delta_{n}.safetensors -> id, "n"; /nodes/{id}/deltas -> id, NULL.  0 or -1. */
int api_parse_node_path(const char *path, char *id, size_t id_size, char *step, size_t step_size, int *is_put)
{
    const char *p, *slash;
    size_t il;

    if (strncmp(path, "/nodes/", 7) != 0)
        return -DL_E_INVALID_PATH;
    p = path + 7;
    slash = strchr(p, '/');
    if (slash == NULL)
        return -DL_E_INVALID_PATH;
    il = (size_t)(slash - p);
    if (il >= id_size || !delta_valid_node_id(p, il))
        return -DL_E_INVALID_PATH;
    memcpy(id, p, il);
    id[il] = '\0';
    p = slash + 1;
    if (strcmp(p, "deltas") == 0) {
        *is_put = 0;
        return 0;
    }
    size_t pl = strlen(p);
    if (pl < 6 + 12 + 1 || strncmp(p, "delta_", 6) != 0 || strcmp(p + pl - 12, ".safetensors") != 0)
        return -DL_E_INVALID_PATH;
    size_t sl = pl - 6 - 12;
    if (sl >= step_size)
        return -DL_E_INVALID_PATH;
    memcpy(step, p + 6, sl);
    step[sl] = '\0';
    *is_put = 1;
    return 0;
}


/* The /nodes/ route: PUT /nodes/{id}/delta_{n}.safetensors, POST /nodes/{id}/deltas, and the parts
 * of a sharded delta, PUT /nodes/{id}/delta_{n}.safetensors.index.json and
 * PUT /nodes/{id}/delta_{n}-0000i-of-0000N.safetensors. */
void upload_route(dilocod *d, http_conn *c, http_request *req)
{
    char id[DELTA_NODE_ID_MAX + 1], step[32];
    int is_put;
    delta_path dp;
    dl_error err;

    if (delta_parse_any_path(req->path + 1, &dp, &err) == 0 && dp.kind != DELTA_PATH_SINGLE) {
        if (strcmp(req->method_name, "PUT") != 0)
            return api_not_allowed(c, "PUT");
        set_part_start(d, c, req, &dp);
        return;
    }
    if (api_parse_node_path(req->path, id, sizeof(id), step, sizeof(step), &is_put) != 0) {
        http_respond_error(c, 404, "not_found",
                           "upload paths are /nodes/{node_id}/delta_{local_step}.safetensors (PUT), "
                           "/nodes/{node_id}/deltas (POST), and for a sharded delta "
                           "/nodes/{node_id}/delta_{local_step}.safetensors.index.json and "
                           "/nodes/{node_id}/delta_{local_step}-0000i-of-0000N.safetensors (PUT)",
                           NULL);
        return;
    }
    if (is_put && strcmp(req->method_name, "PUT") != 0)
        return api_not_allowed(c, "PUT");
    if (!is_put && strcmp(req->method_name, "POST") != 0)
        return api_not_allowed(c, "POST");
    upload_start(d, c, req, id, is_put ? step : NULL);
}
