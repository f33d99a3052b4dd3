/* upload: PUT /nodes/{id}/delta_{n}.safetensors and POST /nodes/{id}/deltas.
 *
 * The body streams through a delta_stream (the header is checked against the global model and the
 * round as soon as it is complete, every value checked finite on the way) into a temporary file in
 * cache/incoming, written with uv_fs_write from two alternating 1 MiB buffers: while a write is in
 * flight and the other buffer is full, the connection stops reading.  The header (up to
 * max_delta_header_mib) is parsed on the thread pool, not on the loop, with the connection's reads
 * stopped meanwhile; bytes of the body that arrived with it wait in `pending`.  Complete and valid, the file
 * is fsynced and linked into the cache on the thread pool, then offered to the round.  A refused,
 * failed or aborted upload leaves nothing behind. */
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "daemon_internal.h"
#include "delta_stream.h"
#include "dl_log.h"
#include "strbuf.h"

#define FLUSH_BYTES (1u << 20)

typedef struct upload {
    dilocod *d;
    http_conn *c;
    char node_id[DELTA_NODE_ID_MAX + 1];
    char rel[160];              /* nodes/<id>/delta_<n>.safetensors */
    int by_path;                /* PUT: the path names the step */
    delta_stream ds;
    char *tmp_path;
    uv_file fd;                 /* -1 until opened */
    uv_fs_t open_req, write_req;
    char *fill, *wbuf;          /* filling buffer, buffer being written */
    size_t fill_len, fill_cap, wlen;
    uint64_t file_off;
    int opening, writing, ended, aborted, failed, finalizing;
    int parsing;                /* the header's parse job is out (the job owns u->ds meanwhile) */
    int end_seen;               /* the body's last byte arrived (ended: and it passed the checks) */
    sbuf pending;               /* body bytes that arrived after the header, fed once it is parsed */
    int writeback;              /* writeback jobs in flight */
    uint64_t wb_done;           /* bytes handed to writeback so far */
    uv_buf_t wiov;
} upload;

static atomic_uint upload_counter;

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

static void upload_discard(upload *u);

static void upload_free(upload *u)
{
    http_conn *c = u->c;
    /* a disk error can end the upload while the connection still reads its body: the connection
     * must never call back into a freed upload */
    http_body_detach(c, u);
    delta_stream_free(&u->ds);
    free(u->pending.p);
    free(u->tmp_path);
    free(u->fill);
    free(u->wbuf);
    u->d->uploads_in_flight--;
    free(u);
    http_conn_unref(c);
}

/* Closes and removes the temporary file, then frees u, once no file operation is in flight. */
static void upload_discard(upload *u)
{
    u->failed = 1;
    if (u->opening || u->writing || u->finalizing || u->writeback || u->parsing)
        return;                 /* the completion callback comes back here */
    if (u->fd >= 0) {
        close(u->fd);           /* a close of a regular file does not wait on the disk */
        u->fd = -1;
    }
    if (u->tmp_path != NULL)
        unlink(u->tmp_path);
    upload_free(u);
}

static void reject(upload *u, int status, const char *code, const char *msg, const char *tensor)
{
    char m[600], t[300];
    u->failed = 1;              /* refused: an abort reported while answering must not free u */
    if (http_conn_alive(u->c))
        http_respond_error(u->c, status, code, msg, tensor);
    dl_log(status >= 500 ? DL_LOG_ERROR : DL_LOG_WARN, "http", "upload refused",
           "node=%s status=%d code=%s error=%s%s%s", u->node_id, status, code, dl_log_q(m, sizeof(m), msg),
           tensor && tensor[0] ? " tensor=" : "", tensor && tensor[0] ? dl_log_q(t, sizeof(t), tensor) : "");
}

static void reject_err(upload *u, const dl_error *err)
{
    int status = status_for(err->code);
    if (err->code == DL_E_IO && err->sys_errno == ENOSPC)
        status = 507;
    if (status != 500 && status != 507)
        stats_delta_rejected(&u->d->m, err->code);
    reject(u, status, dl_error_name(err->code), err->message, err->tensor);
}

static int start_write(upload *u);
static void finalize(upload *u);

#define WRITEBACK_BYTES (8u << 20)

/* Starts the disk on what is written so far (the final fsync then waits for little), off the loop:
 * sync_file_range may wait for a congested device queue. */
static void writeback_work(daemon_job *j)
{
    upload *u = j->arg;
    /* the range travels in the job (u->file_off belongs to the loop thread) */
    (void)sync_file_range(u->fd, (off64_t)j->u, (off64_t)j->flag, SYNC_FILE_RANGE_WRITE);
}

static void writeback_done(daemon_job *j)
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
    if (daemon__queue(u->d, writeback_work, writeback_done, u, u->wb_done, (int)len) == 0) {
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
        reject_err(u, &e);
        upload_discard(u);
        return;
    }
    u->file_off += u->wlen;
    u->wlen = 0;
    maybe_writeback(u);
    if (u->fill_len >= FLUSH_BYTES || (u->ended && u->fill_len > 0)) {
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

/* Returns 0, or -1 when the upload failed and was discarded (u may be gone). */
static int start_write(upload *u)
{
    char *t = u->wbuf;
    int rc;

    u->wbuf = u->fill;
    u->wlen = u->fill_len;
    u->fill = t;
    u->fill_len = 0;
    u->wiov = uv_buf_init(u->wbuf, (unsigned)u->wlen);
    u->write_req.data = u;
    u->writing = 1;
    if ((rc = uv_fs_write(http_conn_loop(u->c), &u->write_req, u->fd, &u->wiov, 1, (int64_t)u->file_off,
                          write_cb)) != 0) {
        dl_error e;
        u->writing = 0;
        dl_fail_errno(&e, -rc, "writing the upload");
        reject_err(u, &e);
        upload_discard(u);
        return -1;
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
        reject_err(u, &e);
        upload_discard(u);
        return;
    }
    if (u->fill_len >= FLUSH_BYTES || (u->ended && u->fill_len > 0))
        start_write(u);
    else if (u->ended)
        finalize(u);
    else if (!u->parsing)
        http_resume(u->c);
}

static int buffer_append(upload *u, const char *p, size_t n)
{
    if (u->fill_len + n > u->fill_cap) {
        size_t nc = u->fill_cap * 2;
        while (nc < u->fill_len + n)
            nc *= 2;
        char *nb = realloc(u->fill, nc);
        if (nb == NULL)
            return -1;
        u->fill = nb;
        u->fill_cap = nc;
    }
    memcpy(u->fill + u->fill_len, p, n);
    u->fill_len += n;
    return 0;
}

/* The header is complete: decide from it whether the round can take this delta at all. */
static int header_verdict(upload *u)
{
    const delta_info *info = &u->ds.info;
    round_verdict v;

    if (!u->by_path) {
        if (strcmp(info->node_id, u->node_id) != 0) {
            char msg[200];
            snprintf(msg, sizeof(msg), "delta metadata node_id \"%s\" does not match the URL's node id \"%s\"",
                     info->node_id, u->node_id);
            stats_delta_rejected(&u->d->m, DL_E_PATH_MISMATCH);
            reject(u, 422, "path_mismatch", msg, NULL);
            return -1;
        }
        snprintf(u->rel, sizeof(u->rel), "nodes/%s/delta_%" PRIu64 ".safetensors", info->node_id, info->local_step);
    }
    v = daemon__peek(u->d, info);
    if (v == ROUND_ACCEPTED || v == ROUND_REPLACED)
        return 0;
    char msg[240];
    int status = 409;
    switch (v) {
    case ROUND_STALE:
        snprintf(msg, sizeof(msg), "base_outer_step %" PRIu64 " is stale: the round for step %" PRIu64 " is %s",
                 info->base_outer_step, u->d->rnd.step,
                 info->base_outer_step == u->d->rnd.step ? "closed" : "open");
        break;
    case ROUND_FUTURE:
        snprintf(msg, sizeof(msg), "base_outer_step %" PRIu64 " is ahead of the current step %" PRIu64,
                 info->base_outer_step, u->d->rnd.step);
        break;
    case ROUND_NOT_NEWER:
        snprintf(msg, sizeof(msg), "node %s already delivered local_step %" PRIu64 " or later in this round",
                 info->node_id, round_find(&u->d->rnd, info->node_id)->local_step);
        break;
    case ROUND_UNKNOWN_NODE:
        snprintf(msg, sizeof(msg), "node %s is not in the allow-list", info->node_id);
        status = 403;
        break;
    default:
        snprintf(msg, sizeof(msg), "the round already has its %u nodes", u->d->cfg->expected_nodes);
        break;
    }
    stats_delta_refused(&u->d->m, v);
    reject(u, status, round_verdict_name(v), msg, NULL);
    return -1;
}

static void header_parsed(daemon_job *j);
static void end_of_body(upload *u);

static void header_parse_work(daemon_job *j)
{
    upload *u = j->arg;
    j->rc = delta_stream_parse_header(&u->ds, &j->err);
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
            reject_err(u, &err);
            upload_discard(u);
            return -1;
        }
        p += k;
        n -= k;
        if (rc == DELTA_STREAM_HEADER_READY) {
            if (n > 0)
                sb_add(&u->pending, p, n);
            if (u->pending.oom || daemon__queue(u->d, header_parse_work, header_parsed, u, 0, 0) != 0) {
                reject(u, 500, "out_of_memory", "cannot queue the header's parse", NULL);
                upload_discard(u);
                return -1;
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
    if (u->fill_len < FLUSH_BYTES)
        return 0;
    if (!u->writing && !u->opening)
        return start_write(u) != 0 ? -1 : 1;
    return 1;                   /* both buffers busy: stop reading until the disk catches up */
}

static void header_parsed(daemon_job *j)
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
        reject_err(u, &j->err);
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

static int on_data(http_conn *c, const char *p, size_t n, void *ctx)
{
    upload *u = ctx;

    (void)c;
    if (u->failed)
        return -1;
    u->d->m.upload_bytes += n;
    if (u->parsing) {
        /* the rest of the read buffer, parsed by llhttp after we asked to stop: it waits */
        sb_add(&u->pending, p, n);
    } else if (validate(u, p, n) != 0) {
        return -1;
    }
    if (u->pending.oom || buffer_append(u, p, n) != 0) {
        reject(u, 500, "out_of_memory", "out of memory buffering the upload", NULL);
        upload_discard(u);
        return -1;
    }
    return read_verdict(u);
}

typedef struct finalize_args {
    upload *u;
    char *cache_path;
    intake_status st;
} finalize_args;

static void finalize_work(daemon_job *j)
{
    finalize_args *a = j->arg;
    upload *u = a->u;

    if (fsync(u->fd) != 0) {
        dl_fail_errno(&j->err, errno, "fsync of the upload");
        a->st = INTAKE_IO;
        return;
    }
    a->st = intake_link_into_cache(j->d->st.dir, &u->ds.info, u->tmp_path, &a->cache_path, &j->err);
}

static void respond_created(upload *u, round_verdict v, uint64_t size)
{
    dilocod *d = u->d;
    sbuf b = {0};
    char num[256];
    char *text;

    snprintf(num, sizeof(num),
             "{\"node_id\":\"%s\",\"local_step\":%" PRIu64 ",\"base_outer_step\":%" PRIu64 ",\"bytes\":%" PRIu64
             ",\"result\":\"%s\",",
             u->ds.info.node_id, u->ds.info.local_step, u->ds.info.base_outer_step, size, round_verdict_name(v));
    sb_str(&b, num);
    sb_str(&b, "\"path\":");
    sb_json_string(&b, u->rel, strlen(u->rel));
    /* the round may already have closed on this very delta */
    snprintf(num, sizeof(num), ",\"round\":{\"step\":%" PRIu64 ",\"received\":%zu,\"expected\":%u,\"state\":\"%s\"}}\n",
             u->ds.info.base_outer_step, d->rnd.step == u->ds.info.base_outer_step ? d->rnd.n : (size_t)0,
             d->cfg->expected_nodes, daemon__state_name(d->state));
    sb_str(&b, num);
    size_t len = b.len;
    if ((text = sb_take(&b)) == NULL) {
        http_respond_error(u->c, 500, "out_of_memory", "out of memory", NULL);
        return;
    }
    http_respond(u->c, 201, "application/json", NULL, text, len);
    free(text);
}

static void finalize_done(daemon_job *j)
{
    finalize_args *a = j->arg;
    upload *u = a->u;
    dilocod *d = u->d;
    uint64_t size = u->ds.file_len;

    u->finalizing = 0;
    if (a->st == INTAKE_OK) {
        /* the file is in the cache: whatever happens to the connection, the round gets it */
        round_verdict v = daemon__offer(d, &u->ds.info, a->cache_path, size);
        a->cache_path = NULL;
        if (v == ROUND_ACCEPTED || v == ROUND_REPLACED)
            respond_created(u, v, size);
        else
            reject(u, v == ROUND_UNKNOWN_NODE ? 403 : 409, round_verdict_name(v),
                   "the round changed while the delta was uploaded", NULL);
    } else if (a->st == INTAKE_DUPLICATE) {
        reject(u, 409, "not_newer", "this node's delta for this local_step is already in the round", NULL);
    } else {
        reject_err(u, &j->err);
    }
    free(a);
    upload_discard(u);          /* the temporary name goes in every case; the cache link stays */
}

static void finalize(upload *u)
{
    finalize_args *a = calloc(1, sizeof(*a));

    if (a == NULL) {
        reject(u, 500, "out_of_memory", "out of memory", NULL);
        upload_discard(u);
        return;
    }
    a->u = u;
    u->finalizing = 1;
    if (daemon__queue(u->d, finalize_work, finalize_done, a, 0, 0) != 0) {
        u->finalizing = 0;
        free(a);
        reject(u, 500, "internal", "cannot queue the upload's final step", NULL);
        upload_discard(u);
    }
}

static void end_of_body(upload *u)
{
    dl_error err;

    if (delta_stream_finish(&u->ds, &err) != 0) {
        reject_err(u, &err);
        upload_discard(u);
        return;
    }
    u->ended = 1;               /* open_cb and write_cb now finish the file */
    if (u->opening || u->writing)
        return;                 /* their callbacks continue */
    if (u->fill_len > 0)
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

static void on_abort(http_conn *c, void *ctx)
{
    upload *u = ctx;
    (void)c;
    if (u->failed)
        return;
    u->aborted = 1;
    dl_log(DL_LOG_INFO, "http", "upload aborted", "node=%s received=%" PRIu64, u->node_id, u->ds.pos);
    if (!u->finalizing)
        upload_discard(u);      /* waits for a header parse or a disk operation in flight */
}

static const http_body_ops upload_ops = {on_data, on_end, on_abort};

static int authorize(dilocod *d, http_conn *c, http_request *req, const char *node_id)
{
    if (d->cfg->token_file == NULL) {
        /* behind a reverse proxy on this host every peer is loopback: a forwarded request is not */
        if (http_header_get(req, "x-forwarded-for") != NULL || http_header_get(req, "forwarded") != NULL) {
            http_respond_error(c, 403, "forbidden",
                               "uploads through a proxy need a token file (--token-file): the loopback rule "
                               "cannot tell the proxy's clients apart",
                               NULL);
            return -1;
        }
        if (!req->loopback) {
            http_respond_error(c, 403, "forbidden",
                               "uploads from other hosts need a token file (--token-file); only loopback peers may upload without one",
                               NULL);
            return -1;
        }
        return 0;
    }
    switch (auth_check(&d->auth, http_header_get(req, "authorization"), node_id)) {
    case AUTH_OK:
        return 0;
    case AUTH_MISSING: {
        static const char body[] = "{\"error\":{\"code\":\"unauthorized\",\"message\":\"missing bearer token\"}}\n";
        http_respond(c, 401, "application/json", "WWW-Authenticate: Bearer\r\n", body, sizeof(body) - 1);
        return -1;
    }
    case AUTH_BAD_TOKEN: {
        static const char body[] = "{\"error\":{\"code\":\"unauthorized\",\"message\":\"invalid bearer token\"}}\n";
        http_respond(c, 401, "application/json", "WWW-Authenticate: Bearer error=\"invalid_token\"\r\n", body,
                     sizeof(body) - 1);
        return -1;
    }
    case AUTH_WRONG_NODE:
        http_respond_error(c, 403, "forbidden", "this token may not upload for this node", NULL);
        return -1;
    }
    return -1;
}

void upload_start(dilocod *d, http_conn *c, http_request *req, const char *node_id, const char *path_step)
{
    upload *u;
    uint64_t step = 0, max_body;
    char msg[200];

    if (authorize(d, c, req, node_id) != 0)
        return;
    if (d->uploads_in_flight >= (int)d->cfg->max_uploads) {
        /* each upload holds two 1 MiB buffers and up to max_delta_header_mib of header: bounded */
        static const char body[] = "{\"error\":{\"code\":\"busy\",\"message\":\"too many uploads in progress; retry shortly\"}}\n";
        http_respond(c, 503, "application/json", "Retry-After: 1\r\n", body, sizeof(body) - 1);
        return;
    }
    if (d->state == S_WAITING_GLOBAL || d->model == NULL) {
        http_respond_error(c, 503, "no_global", "no global model yet: nothing to upload deltas against", NULL);
        return;
    }
    if (path_step != NULL && delta_parse_int(path_step, strlen(path_step), &step) != 0) {
        http_respond_error(c, 400, "invalid_path", "the step in delta_<local_step>.safetensors is not a canonical integer",
                           NULL);
        return;
    }
    if (!req->has_length && !req->chunked) {
        http_respond_error(c, 411, "length_required", "a delta upload needs Content-Length or chunked encoding", NULL);
        return;
    }
    max_body = d->cfg->max_body_mib ? (uint64_t)d->cfg->max_body_mib << 20
                                    : d->delta_bytes + 8 + ((uint64_t)d->cfg->max_delta_header_mib << 20);
    if (req->has_length && req->content_length > max_body) {
        snprintf(msg, sizeof(msg), "body of %" PRIu64 " bytes is larger than the limit of %" PRIu64, req->content_length,
                 max_body);
        http_respond_error(c, 413, "too_large", msg, NULL);
        return;
    }
    u = calloc(1, sizeof(*u));
    if (u == NULL || (u->fill = malloc(FLUSH_BYTES + 65536)) == NULL || (u->wbuf = malloc(FLUSH_BYTES + 65536)) == NULL) {
        if (u) {
            free(u->fill);
            free(u);
        }
        http_respond_error(c, 500, "out_of_memory", "out of memory", NULL);
        return;
    }
    u->d = d;
    u->c = c;
    u->fd = -1;
    u->fill_cap = FLUSH_BYTES + 65536;
    snprintf(u->node_id, sizeof(u->node_id), "%s", node_id);
    u->by_path = path_step != NULL;
    if (u->by_path)
        snprintf(u->rel, sizeof(u->rel), "nodes/%s/delta_%" PRIu64 ".safetensors", node_id, step);
    u->ds.global = d->model;
    u->ds.path = u->by_path ? u->rel : NULL;
    u->ds.max_header = (uint64_t)d->cfg->max_delta_header_mib << 20;
    u->ds.declared_len = req->has_length ? req->content_length : 0;
    u->ds.defer_header = 1;
    if (req->has_length && req->content_length == 0) {
        free(u->fill);
        free(u->wbuf);
        free(u);
        http_respond_error(c, 400, "header_too_small", "empty body", NULL);
        return;
    }
    if (asprintf(&u->tmp_path, "%s/cache/incoming/upload-%ld-%u", d->st.dir, (long)getpid(),
                 atomic_fetch_add(&upload_counter, 1)) < 0) {
        free(u->fill);
        free(u->wbuf);
        free(u);
        http_respond_error(c, 500, "out_of_memory", "out of memory", NULL);
        return;
    }
    http_conn_ref(c);
    d->uploads_in_flight++;
    u->opening = 1;
    u->open_req.data = u;
    if (uv_fs_open(&d->loop, &u->open_req, u->tmp_path, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644, open_cb) != 0) {
        u->opening = 0;
        http_respond_error(c, 500, "io_error", "cannot create the upload file", NULL);
        upload_discard(u);
        return;
    }
    http_accept_body(c, &upload_ops, u);
}

/* ---- the route ---------------------------------------------------------------------------------- */

/* /nodes/{id}/delta_{n}.safetensors -> id, "n"; /nodes/{id}/deltas -> id, NULL.  0 or -1. */
int api_parse_node_path(const char *path, char *id, size_t id_size, char *step, size_t step_size, int *is_put)
{
    const char *p, *slash;
    size_t il;

    if (strncmp(path, "/nodes/", 7) != 0)
        return -1;
    p = path + 7;
    slash = strchr(p, '/');
    if (slash == NULL)
        return -1;
    il = (size_t)(slash - p);
    if (il >= id_size || !delta_valid_node_id(p, il))
        return -1;
    memcpy(id, p, il);
    id[il] = '\0';
    p = slash + 1;
    if (strcmp(p, "deltas") == 0) {
        *is_put = 0;
        return 0;
    }
    size_t pl = strlen(p);
    if (pl < 6 + 12 + 1 || strncmp(p, "delta_", 6) != 0 || strcmp(p + pl - 12, ".safetensors") != 0)
        return -1;
    size_t sl = pl - 6 - 12;
    if (sl >= step_size)
        return -1;
    memcpy(step, p + 6, sl);
    step[sl] = '\0';
    *is_put = 1;
    return 0;
}


/* The /nodes/ route: PUT /nodes/{id}/delta_{n}.safetensors, POST /nodes/{id}/deltas. */
void upload_route(dilocod *d, http_conn *c, http_request *req)
{
    char id[DELTA_NODE_ID_MAX + 1], step[32];
    int is_put;

    if (api_parse_node_path(req->path, id, sizeof(id), step, sizeof(step), &is_put) != 0) {
        http_respond_error(c, 404, "not_found",
                           "upload paths are /nodes/{node_id}/delta_{local_step}.safetensors (PUT) and "
                           "/nodes/{node_id}/deltas (POST)",
                           NULL);
        return;
    }
    if (is_put && !strcmp(req->method_name, "PUT") == 0)
        return api_not_allowed(c, "PUT");
    if (!is_put && !strcmp(req->method_name, "POST") == 0)
        return api_not_allowed(c, "POST");
    upload_start(d, c, req, id, is_put ? step : NULL);
}
