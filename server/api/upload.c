/* upload: PUT /nodes/{id}/delta_{n}.safetensors and POST /nodes/{id}/deltas, and the parts of a
 * sharded delta: PUT /nodes/{id}/delta_{n}-0000i-of-0000N.safetensors and
 * PUT /nodes/{id}/delta_{n}.safetensors.index.json (st_index.h), in any order.
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
 * failed or aborted upload leaves nothing behind.
 *
 * A shard streams the same way (its header checked on its own: delta_check_shard_header) into the
 * staging directory of its set, cache/incoming/set-<node>-<k>/, one per node and local step; the
 * index (at most ST_INDEX_MAX_BYTES) is parsed and its metadata checked against the path on the
 * pool and written next to them.  When the index and every shard it lists are in, the set is checked
 * as a whole (st_set_assemble, delta_check_set_header), linked into the cache and offered to the
 * round: that part is answered with the round's verdict, every earlier part with 202, counts and
 * the first few parts still missing.  A set's shard count is fixed by the first part that names it
 * (a shard's request, the index once parsed) and its arrays sized then; an index is reconciled with
 * the shards in (count, total_size) before it is written and again on the loop.  A staged set is
 * bounded (its shards by the single-delta body limit, its index by the index cap, its shard count
 * by the model's floating tensors), is replaced by a newer local step of its node, and goes
 * (directory and memory) when its round moves on or it is refused. */
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
#include "fsutil.h"
#include "st_index.h"
#include "strbuf.h"
#include "wbuf.h"

#define FLUSH_BYTES (2u << 20)
#define READ_SLACK 65536        /* a read that arrives after the buffer filled up */
#define PART_NAME_MAX (ST_INDEX_BASE_MAX + 40)

typedef enum upload_kind {
    UP_SINGLE,                  /* a whole delta */
    UP_SHARD,                   /* one shard of a sharded delta */
    UP_INDEX,                   /* a sharded delta's index */
} upload_kind;

typedef struct stage stage;

typedef struct upload {
    dilocod *d;
    http_conn *c;
    char node_id[DELTA_NODE_ID_MAX + 1];
    char rel[PART_NAME_MAX + DELTA_NODE_ID_MAX + 16]; /* nodes/<id>/delta_<n>.safetensors (a part: nodes/<id>/<part>) */
    int by_path;                /* PUT: the path names the step */
    upload_kind kind;
    delta_stream ds;
    char *tmp_path;
    uv_file fd;                 /* -1 until opened */
    uv_fs_t open_req, write_req;
    wbuf buf;                   /* filling buffer, buffer being written (buf.out, wlen bytes) */
    size_t wlen;
    uint64_t file_off;
    int opening, writing, ended, aborted, failed, finalizing;
    int parsing;                /* the header's parse job is out (the job owns u->ds meanwhile) */
    int end_seen;               /* the body's last byte arrived (ended: and it passed the checks) */
    sbuf pending;               /* body bytes that arrived after the header, fed once it is parsed */
    int writeback;              /* writeback jobs in flight */
    uint64_t wb_done;           /* bytes handed to writeback so far */
    uint64_t wb_off, wb_len;    /* the writeback job's range (set while none is out: it reads them) */
    uint64_t index_nfloat;      /* for the index's parse: how many floating tensors the global has */
    uv_buf_t wiov;
    /* a part of a sharded delta */
    stage *stage;               /* the set it belongs to (holds a reference until the part is in) */
    uint64_t local_step;        /* from the path */
    uint32_t shard, nshards;    /* UP_SHARD: 0-based shard and count, from the path */
    char part[PART_NAME_MAX];   /* the part's file name in the set */
    const st_tensor **gby;      /* the global's tensors by name (a shard's header is checked against it) */
    size_t ngby;
    uint64_t reserved;          /* bytes of the set's cap this shard holds while it streams */
    sbuf body;                  /* UP_INDEX: the index's text */
    uint32_t set_nshards;       /* UP_INDEX: the set's fixed count when the body ended (0: none yet) */
    uint64_t set_data;          /* UP_INDEX: tensor bytes of the shards in when the body ended */
    uint64_t total_size;        /* UP_INDEX: the index's total_size (from the parse) */
    int unreconciled;           /* UP_INDEX: refused for disagreeing with the shards in */
    int completing;             /* the set's completion job is out and answers for this part */
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

/* ---- staged sets of a sharded delta ------------------------------------------------------------ */

struct stage {
    stage *next;
    dilocod *d;
    char node_id[DELTA_NODE_ID_MAX + 1];
    uint64_t local_step;
    uint64_t round_step;        /* the round it was opened in: it goes when that round does */
    char *dir;                  /* <state>/cache/incoming/set-<node>-<k> */
    int dir_made;
    /* The count is fixed by the first part that names it (a shard's name at its request, an index
     * once parsed) and the arrays are sized with it then: nothing is indexed by a count from
     * another source, and a part that disagrees with it is refused. */
    uint32_t nshards;           /* 0 until a part names the count */
    uint64_t *part_bytes;       /* per shard: its size once in, 0 before */
    uint64_t *part_data;        /* per shard: its tensor bytes once in */
    uint64_t data;              /* sum of part_data: never above the index's total_size */
    uint32_t nreceived;
    uint64_t index_bytes;       /* 0 until the index is in */
    uint64_t total_size;        /* the index's total_size (once index_bytes != 0) */
    int index_streaming;        /* an index is being received or parsed: one at a time */
    delta_info info;            /* the index's metadata (once index_bytes != 0) */
    uint64_t bytes, reserved;   /* shard bytes in, and held by shards streaming: both count against the cap */
    int refs;                   /* parts in flight */
    int completing;             /* the set's check-and-link job is out */
    int dead;                   /* discarded: its directory goes once no part or job uses it */
    int reaped;                 /* its removal is queued: nothing may touch it again */
    int dead_status;            /* what a part still in flight is answered */
    char dead_code[16];
    char dead_why[200];
};

/* The staged sets.  The daemon's state (daemon_internal.h) has no slot for them and a process runs
 * one daemon, so the table is this file's, bound to the daemon that stages (sets.d). */
static struct {
    dilocod *d;
    stage *head;
    size_t n;
    uv_prepare_t watch;         /* notices a round that moved on, each time before the loop waits */
    int watch_ready;
} sets;

static void set_complete(stage *s, upload *responder);

static int stage_complete(const stage *s)
{
    return s->index_bytes != 0 && s->nshards != 0 && s->nreceived == s->nshards;
}

static void stage_free(stage *s)
{
    free(s->dir);
    free(s->part_bytes);
    free(s->part_data);
    free(s);
}

static void stage_remove_work(pool_job *j)
{
    stage *s = j->arg;
    int rc = store_remove_tree(s->dir);
    if (rc != 0 && rc != -ENOENT)
        dl_fail_errno(&j->err, -rc, "removing %s", s->dir);
    j->rc = rc == -ENOENT ? 0 : rc;
}

static void stage_remove_done(pool_job *j)
{
    stage *s = j->arg;
    if (j->rc != 0) {
        char m[600];
        dl_log(DL_LOG_ERROR, "http", "cannot remove a sharded upload's staging", "dir=%s error=%s", s->dir,
               dl_log_q(m, sizeof(m), j->err.message));
    }
    stage_free(s);
}

/* Frees a discarded set once no part and no job uses it; its directory is removed on the pool. */
static void stage_reap(stage *s)
{
    if (!s->dead || s->refs > 0 || s->completing || s->reaped)
        return;
    s->reaped = 1;
    if (daemon__queue(s->d, stage_remove_work, stage_remove_done, s) != 0) {
        (void)store_remove_tree(s->dir);        /* the pool refused (out of memory): here, once */
        stage_free(s);
    }
}

/* Takes s off the table at once (a new set of the node starts clean); a part still in flight is
 * answered dead_status/dead_code/why (status 0: the set was taken in, nothing to say). */
static void stage_discard(stage *s, int status, const char *code, const char *why)
{
    stage **pp;
    char qn[160], m[300];

    if (s->dead) {
        stage_reap(s);          /* discarded while its intake ran: it may be free to go now */
        return;
    }
    for (pp = &sets.head; *pp != NULL; pp = &(*pp)->next) {
        if (*pp == s) {
            *pp = s->next;
            sets.n--;
            break;
        }
    }
    s->dead = 1;
    s->dead_status = status;
    snprintf(s->dead_code, sizeof(s->dead_code), "%s", code);
    snprintf(s->dead_why, sizeof(s->dead_why), "%s", why);
    if (status != 0)
        dl_log(DL_LOG_INFO, "http", "sharded upload discarded",
               "node=%s local_step=%" PRIu64 " shards=%u/%u index=%s bytes=%" PRIu64 " reason=%s",
               dl_log_q(qn, sizeof(qn), s->node_id), s->local_step, s->nreceived, s->nshards,
               s->index_bytes ? "yes" : "no", s->bytes + s->index_bytes, dl_log_q(m, sizeof(m), why));
    stage_reap(s);
}

/* A round that moved on (or a stop) takes its staged sets with it. */
static void sets_sweep(dilocod *d)
{
    stage *s, *next;
    char why[200];

    for (s = sets.head; s != NULL; s = next) {
        next = s->next;
        if (d->stopping) {
            stage_discard(s, 503, "shutting_down", "the server is stopping");
        } else if (s->round_step != d->rnd.step) {
            snprintf(why, sizeof(why), "the round for step %" PRIu64 " ended before the set was complete",
                     s->round_step);
            stage_discard(s, 409, "stale", why);
        }
    }
}

static void watch_cb(uv_prepare_t *h)
{
    sets_sweep(sets.d);
    if (sets.head == NULL)
        uv_prepare_stop(h);
}

static void watch_start(dilocod *d)
{
    if (!sets.watch_ready || sets.d != d) {
        /* never fails for a prepare handle; unref'd: it never keeps the loop alive on its own */
        uv_prepare_init(&d->loop, &sets.watch);
        uv_unref((uv_handle_t *)&sets.watch);
        sets.watch_ready = 1;
        sets.d = d;
    }
    if (!uv_is_closing((uv_handle_t *)&sets.watch))
        uv_prepare_start(&sets.watch, watch_cb);
}

static stage *stage_find(const char *node_id)
{
    for (stage *s = sets.head; s != NULL; s = s->next)
        if (strcmp(s->node_id, node_id) == 0)
            return s;
    return NULL;
}

/* At most one set per node, and no more nodes than a round can take. */
static size_t stage_limit(const dilocod *d)
{
    return d->cfg->expected_nodes ? d->cfg->expected_nodes : CONFIG_MAX_NODES;
}

/* Fixes the set's shard count (nshards != 0, the set's still 0) and sizes its arrays by it. */
static int stage_fix_count(stage *s, uint32_t nshards)
{
    uint64_t *bytes = calloc(nshards, sizeof(*bytes)), *data = calloc(nshards, sizeof(*data));

    if (bytes == NULL || data == NULL) {
        free(bytes);
        free(data);
        return -ENOMEM;
    }
    s->part_bytes = bytes;
    s->part_data = data;
    s->nshards = nshards;
    return 0;
}

static stage *stage_new(dilocod *d, const char *node_id, uint64_t local_step, uint32_t nshards)
{
    stage *s = calloc(1, sizeof(*s));

    if (s == NULL)
        return NULL;
    s->d = d;
    snprintf(s->node_id, sizeof(s->node_id), "%s", node_id);
    s->local_step = local_step;
    s->round_step = d->rnd.step;
    if (asprintf(&s->dir, "%s/cache/incoming/set-%s-%u", d->st.dir, node_id,
                 atomic_fetch_add(&upload_counter, 1)) < 0) {
        s->dir = NULL;
        stage_free(s);
        return NULL;
    }
    if (nshards != 0 && stage_fix_count(s, nshards) != 0) {
        stage_free(s);
        return NULL;
    }
    s->next = sets.head;
    sets.head = s;
    sets.n++;
    watch_start(d);
    return s;
}

/* A part is done with its set (in, refused or aborted): the last one out of a complete set starts
 * its intake (nobody left to answer for it: the round's log says what became of it). */
static void part_release(upload *u)
{
    stage *s = u->stage;

    if (s == NULL)
        return;
    u->stage = NULL;
    s->reserved -= u->reserved;
    u->reserved = 0;
    if (u->kind == UP_INDEX)
        s->index_streaming = 0;
    s->refs--;
    if (s->dead)
        stage_reap(s);
    else if (stage_complete(s) && s->refs == 0 && !s->completing)
        set_complete(s, NULL);
}

static void upload_discard(upload *u);

static void upload_free(upload *u)
{
    http_conn *c = u->c;
    /* a disk error can end the upload while the connection still reads its body: the connection
     * must never call back into a freed upload */
    http_body_detach(c, u);
    part_release(u);
    delta_stream_free(&u->ds);
    free(u->pending.p);
    free(u->body.p);
    free(u->gby);
    free(u->tmp_path);
    wbuf_free(&u->buf);
    u->d->uploads_in_flight--;
    free(u);
    http_conn_unref(c);
}

/* Closes and removes the temporary file, then frees u, once no file operation is in flight. */
static void upload_discard(upload *u)
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
static void refuse(http_conn *c, const char *node_id, int status, const char *code, const char *msg,
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

static void reject(upload *u, int status, const char *code, const char *msg, const char *tensor)
{
    u->failed = 1;              /* refused: an abort reported while answering must not free u */
    refuse(u->c, u->node_id, status, code, msg, tensor);
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
        reject_err(u, &e);
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
        reject(u, 500, "out_of_memory", "out of memory buffering the upload", NULL);
        upload_discard(u);
        return -1;
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

    switch (v) {
    case ROUND_STALE:
        if (known_base)
            snprintf(msg, size, "base_outer_step %" PRIu64 " is stale: the round for step %" PRIu64 " is %s",
                     info->base_outer_step, d->rnd.step, info->base_outer_step == d->rnd.step ? "closed" : "open");
        else
            snprintf(msg, size, "the round for step %" PRIu64 " is closed: no delta can join it now", d->rnd.step);
        return 409;
    case ROUND_FUTURE:
        snprintf(msg, size, "base_outer_step %" PRIu64 " is ahead of the current step %" PRIu64, info->base_outer_step,
                 d->rnd.step);
        return 409;
    case ROUND_NOT_NEWER:
        e = round_find(&d->rnd, info->node_id);
        snprintf(msg, size, "node %s already delivered local_step %" PRIu64 " or later in this round", info->node_id,
                 e != NULL ? e->local_step : info->local_step);
        return 409;
    case ROUND_UNKNOWN_NODE:
        snprintf(msg, size, "node %s is not in the allow-list", info->node_id);
        return 403;
    default:
        snprintf(msg, size, "the round already has its %u nodes", d->cfg->expected_nodes);
        return 409;
    }
}

/* Asks the round about info now: 0 when it would take it, else answers, counts and returns -1. */
static int peek_or_refuse(dilocod *d, http_conn *c, const delta_info *info, int known_base)
{
    char msg[240];
    round_verdict v = daemon__peek(d, info);

    if (v == ROUND_ACCEPTED || v == ROUND_REPLACED)
        return 0;
    int status = verdict_message(d, v, info, known_base, msg, sizeof(msg));
    stats_delta_refused(&d->m, v);
    refuse(c, info->node_id, status, round_verdict_name(v), msg, NULL);
    return -1;
}

/* peek_or_refuse for an upload in progress: marked failed first, so an abort that the refusal's
 * answer reports (the connection finishing) does not free u under its caller. */
static int upload_peek(upload *u, const delta_info *info)
{
    int was = u->failed;

    u->failed = 1;
    if (peek_or_refuse(u->d, u->c, info, 1) != 0)
        return -1;
    u->failed = was;
    return 0;
}

static int shard_verdict(upload *u);

/* The header is complete: decide from it whether the round can take this delta at all. */
static int header_verdict(upload *u)
{
    const delta_info *info = &u->ds.info;

    if (u->kind == UP_SHARD)
        return shard_verdict(u);
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
    if (upload_peek(u, info) != 0)
        return -1;
    return 0;
}

static void header_parsed(pool_job *j);
static void end_of_body(upload *u);

static int shard_parse_header(upload *u, dl_error *err);

static void header_parse_work(pool_job *j)
{
    upload *u = j->arg;
    j->rc = u->kind == UP_SHARD ? shard_parse_header(u, &j->err) : delta_stream_parse_header(&u->ds, &j->err);
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
            if (u->pending.oom || daemon__queue(u->d, header_parse_work, header_parsed, u) != 0) {
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
    if (u->stage != NULL && u->stage->dead) {
        reject(u, u->stage->dead_status, u->stage->dead_code, u->stage->dead_why, NULL);
        upload_discard(u);
        return -1;
    }
    stats_upload_received(&u->d->m, n);
    if (u->parsing) {
        /* the rest of the read buffer, parsed by llhttp after we asked to stop: it waits */
        sb_add(&u->pending, p, n);
    } else if (validate(u, p, n) != 0) {
        return -1;
    }
    if (u->pending.oom || wbuf_append(&u->buf, p, n) != 0) {
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

static void finalize_work(pool_job *j)
{
    finalize_args *a = j->arg;
    upload *u = a->u;

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
    a->st = intake_link_into_cache(daemon__of_job(j)->st.dir, &u->ds.info, u->tmp_path, &a->cache_path, &j->err);
}

static void respond_created(upload *u, const delta_info *info, const char *rel, round_verdict v, uint64_t size)
{
    dilocod *d = u->d;
    sbuf b = {0};
    char num[256];
    char *text;

    if (!http_conn_alive(u->c))
        return;
    snprintf(num, sizeof(num),
             "{\"node_id\":\"%s\",\"local_step\":%" PRIu64 ",\"base_outer_step\":%" PRIu64 ",\"bytes\":%" PRIu64
             ",\"result\":\"%s\",",
             info->node_id, info->local_step, info->base_outer_step, size, round_verdict_name(v));
    sb_str(&b, num);
    sb_str(&b, "\"path\":");
    sb_json_string(&b, rel, strlen(rel));
    /* the round may already have closed on this very delta */
    snprintf(num, sizeof(num), ",\"round\":{\"step\":%" PRIu64 ",\"received\":%zu,\"expected\":%u,\"state\":\"%s\"}}\n",
             info->base_outer_step, d->rnd.step == info->base_outer_step ? d->rnd.n : (size_t)0,
             d->cfg->expected_nodes, daemon__state_name(daemon__state(d)));
    sb_str(&b, num);
    size_t len = b.len;
    if ((text = sb_take(&b)) == NULL) {
        http_respond_error(u->c, 500, "out_of_memory", "out of memory", NULL);
        return;
    }
    http_respond(u->c, 201, "application/json", NULL, text, len);
    free(text);
}

static void part_in(upload *u);

/* A shard's tensor bytes (what the index's total_size sums), known once its header is. */
static uint64_t shard_data_bytes(const upload *u)
{
    return u->ds.file_len - 8 - u->ds.n;
}

static void shard_in(upload *u, uint64_t size)
{
    stage *s = u->stage;

    if (s->dead) {              /* renamed into a discarded set: it goes with its directory */
        reject(u, s->dead_status, s->dead_code, s->dead_why, NULL);
        return;
    }
    if (u->nshards != s->nshards || u->shard >= s->nshards) {
        /* never: the shard's request fixed the count or was refused for disagreeing with it */
        reject(u, 500, "internal", "the shard does not fit its set's count", NULL);
        return;
    }
    if (s->part_bytes[u->shard] == 0)
        s->nreceived++;
    s->bytes = s->bytes - s->part_bytes[u->shard] + size;
    s->part_bytes[u->shard] = size;
    s->data = s->data - s->part_data[u->shard] + shard_data_bytes(u);
    s->part_data[u->shard] = shard_data_bytes(u);
    s->reserved -= u->reserved;
    u->reserved = 0;
    part_in(u);
}

static void finalize_done(pool_job *j)
{
    finalize_args *a = j->arg;
    upload *u = a->u;
    dilocod *d = u->d;
    uint64_t size = u->ds.file_len;

    u->finalizing = 0;
    if (a->st == INTAKE_OK && u->kind == UP_SHARD) {
        shard_in(u, size);
    } else if (a->st == INTAKE_OK) {
        /* the file is in the cache: whatever happens to the connection, the round gets it */
        round_verdict v = daemon__offer(d, &u->ds.info, a->cache_path, size);
        a->cache_path = NULL;
        if (v == ROUND_ACCEPTED || v == ROUND_REPLACED)
            respond_created(u, &u->ds.info, u->rel, v, size);
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
    if (daemon__queue(u->d, finalize_work, finalize_done, a) != 0) {
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

static void on_abort(http_conn *c, void *ctx)
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
                               "uploads from other hosts need a token file (--token-file); only loopback peers "
                               "may upload without one",
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

static uint64_t body_limit(const dilocod *d)
{
    return d->cfg->max_body_mib ? (uint64_t)d->cfg->max_body_mib << 20
                                : intake_set_budget(d->delta_bytes, (uint64_t)d->cfg->max_delta_header_mib << 20);
}

/* What every upload must pass before its body is read.  0, or -1 when answered. */
static int admit(dilocod *d, http_conn *c, http_request *req, const char *node_id)
{
    if (authorize(d, c, req, node_id) != 0)
        return -1;
    if (d->uploads_in_flight >= (int)d->cfg->max_uploads) {
        /* each upload holds two 1 MiB buffers and up to max_delta_header_mib of header: bounded */
        static const char body[] =
            "{\"error\":{\"code\":\"busy\",\"message\":\"too many uploads in progress; retry shortly\"}}\n";
        http_respond(c, 503, "application/json", "Retry-After: 1\r\n", body, sizeof(body) - 1);
        return -1;
    }
    if (daemon__state(d) == S_WAITING_GLOBAL || d->model == NULL) {
        http_respond_error(c, 503, "no_global", "no global model yet: nothing to upload deltas against", NULL);
        return -1;
    }
    if (!req->has_length && !req->chunked) {
        http_respond_error(c, 411, "length_required", "a delta upload needs Content-Length or chunked encoding", NULL);
        return -1;
    }
    if (req->has_length && req->content_length == 0) {
        http_respond_error(c, 400, "header_too_small", "empty body", NULL);
        return -1;
    }
    return 0;
}

/* A new upload of kind for node_id (the two write buffers only for a file that streams to disk). */
static upload *upload_new(dilocod *d, http_conn *c, const char *node_id, upload_kind kind)
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
    u->ds.global = d->model;
    u->ds.max_header = (uint64_t)d->cfg->max_delta_header_mib << 20;
    u->ds.defer_header = 1;
    /* from here upload_free undoes everything */
    http_conn_ref(c);
    d->uploads_in_flight++;
    return u;
}

static void mkdir_cb(uv_fs_t *req);

/* Creates the temporary file (a part: its set's directory first).  0 or a libuv error. */
static int start_open(upload *u)
{
    int rc;

    u->opening = 1;
    u->open_req.data = u;
    if (u->stage != NULL && !u->stage->dir_made)
        rc = uv_fs_mkdir(&u->d->loop, &u->open_req, u->stage->dir, 0755, mkdir_cb);
    else
        rc = uv_fs_open(&u->d->loop, &u->open_req, u->tmp_path, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644,
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
        reject_err(u, &e);
        upload_discard(u);
        return;
    }
    if ((rc = start_open(u)) != 0) {
        dl_error e;
        dl_fail_errno(&e, -rc, "cannot create %s", u->tmp_path);
        reject_err(u, &e);
        upload_discard(u);
    }
}

void upload_start(dilocod *d, http_conn *c, http_request *req, const char *node_id, const char *path_step)
{
    upload *u;
    uint64_t step = 0, max_body;
    char msg[200];

    if (admit(d, c, req, node_id) != 0)
        return;
    if (path_step != NULL && delta_parse_int(path_step, strlen(path_step), &step) != 0) {
        http_respond_error(c, 400, "invalid_path",
                           "the step in delta_<local_step>.safetensors is not a canonical integer", NULL);
        return;
    }
    max_body = body_limit(d);
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
    u->ds.declared_len = req->has_length ? req->content_length : 0;
    if (asprintf(&u->tmp_path, "%s/cache/incoming/upload-%ld-%u", d->st.dir, (long)getpid(),
                 atomic_fetch_add(&upload_counter, 1)) < 0) {
        u->tmp_path = NULL;
        http_respond_error(c, 500, "out_of_memory", "out of memory", NULL);
        upload_discard(u);
        return;
    }
    if (start_open(u) != 0) {
        http_respond_error(c, 500, "io_error", "cannot create the upload file", NULL);
        upload_discard(u);
        return;
    }
    http_accept_body(c, &upload_ops, u);
}

/* ---- parts of a sharded delta ------------------------------------------------------------------ */

/* A shard's header, checked on its own (parsed on the pool): every tensor a floating key of the
 * global with its shape and a delta dtype.  delta_stream_parse_header would apply the rules of a
 * whole delta (metadata, every key) that only the set as a whole meets. */
static int shard_parse_header(upload *u, dl_error *err)
{
    int rc = delta_stream_parse_header_only(&u->ds, err);

    if (rc != 0)
        return rc;
    return delta_check_shard_header(u->ds.h, u->gby, u->ngby, err);
}

/* A shard's own metadata, when it carries the delta's (huggingface_hub's shards carry only
 * "format"): node_id and local_step must agree with the path; base_outer_step answers early. */
static int shard_meta(upload *u, delta_info *info, int *have_base)
{
    const st_header *h = u->ds.h;
    const char *v;
    size_t len;
    uint64_t n;
    char msg[240];

    *have_base = 0;
    memset(info, 0, sizeof(*info));
    snprintf(info->node_id, sizeof(info->node_id), "%s", u->node_id);
    info->local_step = u->local_step;
    if ((v = st_header_meta(h, "node_id", &len)) != NULL && (len != strlen(u->node_id) || memcmp(v, u->node_id, len))) {
        snprintf(msg, sizeof(msg), "the shard's metadata node_id does not match the path's node id \"%s\"", u->node_id);
        stats_delta_rejected(&u->d->m, DL_E_PATH_MISMATCH);
        reject(u, 422, "path_mismatch", msg, NULL);
        return -1;
    }
    if ((v = st_header_meta(h, "local_step", &len)) != NULL &&
        (delta_parse_int(v, len, &n) != 0 || n != u->local_step)) {
        snprintf(msg, sizeof(msg), "the shard's metadata local_step does not match the path's step %" PRIu64,
                 u->local_step);
        stats_delta_rejected(&u->d->m, DL_E_PATH_MISMATCH);
        reject(u, 422, "path_mismatch", msg, NULL);
        return -1;
    }
    if ((v = st_header_meta(h, "base_outer_step", &len)) != NULL) {
        if (delta_parse_int(v, len, &info->base_outer_step) != 0) {
            stats_delta_rejected(&u->d->m, DL_E_METADATA_INVALID);
            reject(u, 422, "metadata_invalid", "the shard's metadata base_outer_step is not a canonical integer", NULL);
            return -1;
        }
        *have_base = 1;
    }
    return 0;
}

/* A shard's header is in: the round (from the set's index, or the shard's own metadata) and the
 * set's byte cap decide whether its data is read. */
static int shard_verdict(upload *u)
{
    stage *s = u->stage;
    dilocod *d = u->d;
    delta_info info;
    int have_base;
    uint64_t cap = body_limit(d), others, len = u->ds.file_len, tdata;
    char msg[240];

    if (s->dead) {
        reject(u, s->dead_status, s->dead_code, s->dead_why, NULL);
        return -1;
    }
    if (u->nshards != s->nshards || u->shard >= s->nshards) {
        /* never: the shard's request fixed the count or was refused for disagreeing with it */
        reject(u, 500, "internal", "the shard does not fit its set's count", NULL);
        return -1;
    }
    if (shard_meta(u, &info, &have_base) != 0)
        return -1;
    /* mis-sized against the index in: the tensor data of the shards in (an earlier copy of this one
     * excepted) and this one's, above the index's total_size */
    tdata = shard_data_bytes(u);
    if (s->index_bytes != 0 &&
        (tdata > s->total_size || s->data - s->part_data[u->shard] > s->total_size - tdata)) {
        snprintf(msg, sizeof(msg), "the set's shards would hold more tensor data than the index's total_size of "
                 "%" PRIu64 " bytes", s->total_size);
        stats_delta_rejected(&d->m, DL_E_METADATA_INVALID);
        reject(u, 422, "metadata_invalid", msg, NULL);
        return -1;
    }
    if (s->index_bytes != 0) {
        info = s->info;
        have_base = 1;
    }
    if (have_base && upload_peek(u, &info) != 0)
        return -1;
    /* the shards staged (an earlier copy of this one excepted) and those streaming, plus this one */
    others = s->bytes - s->part_bytes[u->shard] + s->reserved;
    if (len > cap || others > cap - len) {
        snprintf(msg, sizeof(msg), "the set's shards would hold %" PRIu64 " bytes, more than the limit of %" PRIu64,
                 others + len, cap);
        reject(u, 413, "too_large", msg, NULL);
        return -1;
    }
    s->reserved += len;
    u->reserved = len;
    return 0;
}

/* 202: what the set has and what it still needs, bounded whatever the set's size: counts, and the
 * first PARTIAL_NAMED missing parts by name (an answer naming every missing shard was 740 KB at
 * 20,000 shards, sent again for every shard). */
#define PARTIAL_NAMED 8

static void partial_name(sbuf *b, const char *name, unsigned *named)
{
    if (*named >= PARTIAL_NAMED)
        return;
    if (*named > 0)
        sb_str(b, ",");
    sb_json_string(b, name, strlen(name));
    (*named)++;
}

static void respond_partial(upload *u, const stage *s, uint64_t size)
{
    sbuf b = {0};
    char num[320], name[PART_NAME_MAX], base[40];
    char *text;
    unsigned named = 0;
    uint64_t received = s->nreceived + (s->index_bytes != 0);
    uint64_t missing = (uint64_t)(s->nshards - s->nreceived) + (s->index_bytes == 0);

    if (!http_conn_alive(u->c))
        return;
    snprintf(base, sizeof(base), "delta_%" PRIu64, s->local_step);
    snprintf(num, sizeof(num),
             "{\"node_id\":\"%s\",\"local_step\":%" PRIu64 ",\"bytes\":%" PRIu64 ",\"result\":\"incomplete\",\"part\":",
             s->node_id, s->local_step, size);
    sb_str(&b, num);
    sb_json_string(&b, u->part, strlen(u->part));
    /* shards 0 while no part has named the count: the missing shards are then not known, only the index */
    snprintf(num, sizeof(num), ",\"set\":{\"shards\":%u,\"index\":%s,\"bytes\":%" PRIu64 ",\"parts_in_flight\":%d,"
             "\"received\":%" PRIu64 ",\"missing_count\":%" PRIu64 ",\"missing\":[",
             s->nshards, s->index_bytes != 0 ? "true" : "false", s->bytes + s->index_bytes, s->refs, received, missing);
    sb_str(&b, num);
    for (uint32_t i = 0; i < s->nshards && named < PARTIAL_NAMED; i++) {
        if (s->part_bytes[i] != 0)
            continue;
        st_index_shard_name(base, i, s->nshards, name, sizeof(name));
        partial_name(&b, name, &named);
    }
    if (s->index_bytes == 0) {  /* the shards, then the index, as a client sends them */
        snprintf(name, sizeof(name), "%s" ST_INDEX_SUFFIX, base);
        partial_name(&b, name, &named);
    }
    sb_str(&b, "]}}\n");
    size_t len = b.len;
    if ((text = sb_take(&b)) == NULL) {
        http_respond_error(u->c, 500, "out_of_memory", "out of memory", NULL);
        return;
    }
    http_respond(u->c, 202, "application/json", NULL, text, len);
    free(text);
}

/* A part is in its set: the set is taken in if it is now complete and no other part of it is still
 * streaming (this part then gets the round's verdict), else this part gets 202.  The caller
 * discards u afterwards (it waits for the set's intake when it answers for it). */
static void part_in(upload *u)
{
    stage *s = u->stage;
    uint64_t size = u->kind == UP_INDEX ? s->index_bytes : s->part_bytes[u->shard];
    char qn[160], qp[PART_NAME_MAX + 8];

    dl_log(DL_LOG_INFO, "http", "sharded upload part received",
           "node=%s local_step=%" PRIu64 " part=%s bytes=%" PRIu64 " shards=%u/%u index=%s",
           dl_log_q(qn, sizeof(qn), s->node_id), s->local_step, dl_log_q(qp, sizeof(qp), u->part), size,
           s->nreceived, s->nshards, s->index_bytes ? "yes" : "no");
    u->stage = NULL;            /* this part's reference goes now: the set counts only those still streaming */
    if (u->kind == UP_INDEX)
        s->index_streaming = 0;
    s->refs--;
    if (stage_complete(s) && s->refs == 0 && !s->completing) {
        set_complete(s, u);
        return;
    }
    respond_partial(u, s, size);
}

/* ---- the index ---- */

static int index_on_data(http_conn *c, const char *p, size_t n, void *ctx)
{
    upload *u = ctx;
    char msg[160];

    (void)c;
    if (u->failed)
        return -1;
    if (u->stage != NULL && u->stage->dead) {
        reject(u, u->stage->dead_status, u->stage->dead_code, u->stage->dead_why, NULL);
        upload_discard(u);
        return -1;
    }
    stats_upload_received(&u->d->m, n);
    /* the model's cap: an index lists its floating tensors */
    size_t cap = u->d->model ? st_index_cap_for(u->d->model) : ST_INDEX_MAX_BYTES;
    if (n > cap - u->body.len) {
        snprintf(msg, sizeof(msg), "an index for this model is at most %zu bytes", cap);
        reject(u, 413, "too_large", msg, NULL);
        upload_discard(u);
        return -1;
    }
    sb_add(&u->body, p, n);
    if (u->body.oom) {
        reject(u, 500, "out_of_memory", "out of memory buffering the index", NULL);
        upload_discard(u);
        return -1;
    }
    return 0;
}

/* An index against the set's fixed count and the tensor bytes of its shards in (on the pool with
 * their state when its body ended, on the loop with the state now): 0, or DL_E_INVALID_PATH for
 * another count, DL_E_METADATA_INVALID for a total_size below what the shards in hold. */
static int index_reconcile(const upload *u, uint32_t nshards, uint64_t data, dl_error *err)
{
    if (nshards != 0 && u->nshards != nshards)
        return dl_fail(err, DL_E_INVALID_PATH, NULL, 0, "the index lists %u shards; the set being uploaded has %u "
                       "(the count its first part named)", u->nshards, nshards);
    if (data > u->total_size)
        return dl_fail(err, DL_E_METADATA_INVALID, NULL, 0, "the index's total_size is %" PRIu64 " but the shards "
                       "already in hold %" PRIu64 " bytes of tensor data", u->total_size, data);
    return 0;
}

/* On the pool: parse the index strictly, check its metadata against the path and its keys against
 * the global's floating keys, and write it into the set's directory (durable: it is linked into the
 * cache as it is).  u->index_nfloat: how many floating tensors the global has. */
static void index_work(pool_job *j)
{
    upload *u = j->arg;
    const dilocod *d = daemon__of_job(j);
    st_index *ix = NULL;
    char base[40], *path = NULL;
    int rc;

    snprintf(base, sizeof(base), "delta_%" PRIu64, u->local_step);
    if ((rc = st_index_parse_capped(u->body.p ? u->body.p : "", u->body.len, base, st_index_cap_for(d->model), &ix,
                                    &j->err)) != 0)
        goto out;
    if ((rc = delta_check_meta(ix->meta, ix->nmeta, u->rel, &u->ds.info, &j->err)) != 0)
        goto out;
    for (size_t i = 0; i < ix->nentries; i++) {
        const st_index_entry *e = &ix->entries[i];
        const st_tensor *t = st_header_find(d->model, e->name, e->name_len);
        if (t == NULL || !st_dtype_is_floating(t->dtype)) {
            rc = dl_fail(&j->err, DL_E_KEY_MISMATCH, e->name, e->name_len,
                         t != NULL ? "the index lists a non-floating key of the global model"
                                   : "the index lists a key the global model does not have");
            goto out;
        }
    }
    if (ix->nentries != u->index_nfloat) {
        rc = dl_fail(&j->err, DL_E_KEY_MISMATCH, NULL, 0, "the index lists %zu tensors; the global has %" PRIu64
                     " floating tensors", ix->nentries, u->index_nfloat);
        goto out;
    }
    u->nshards = ix->nshards;
    u->total_size = ix->total_size;
    /* reconciled with the shards in (u->set_*: their state when the body ended), before it is
     * written: an index of the set is refused here, never written over the one the set has */
    if ((rc = index_reconcile(u, u->set_nshards, u->set_data, &j->err)) != 0) {
        u->unreconciled = 1;
        goto out;
    }
    if ((rc = fsu_mkdirs(u->stage->dir, &j->err)) != 0)
        goto out;
    if (asprintf(&path, "%s/%s", u->stage->dir, u->part) < 0) {
        path = NULL;
        rc = dl_fail(&j->err, DL_E_NO_MEMORY, NULL, 0, "out of memory");
        goto out;
    }
    rc = fsu_write_atomic(path, u->body.p, u->body.len, &j->err);
out:
    j->rc = rc;
    free(path);
    st_index_free(ix);
}

static void index_done(pool_job *j)
{
    upload *u = j->arg;
    stage *s = u->stage;
    char msg[sizeof(((dl_error *)0)->message) + 64];
    dl_error err;

    u->parsing = 0;
    if (u->failed || u->aborted) {
        upload_discard(u);
        return;
    }
    if (j->rc != 0) {
        reject_err(u, &j->err);         /* a bad index alone: the set waits for a good one */
        if (u->unreconciled && !s->dead) {
            snprintf(msg, sizeof(msg), "the set's index disagrees with its shards: %s", j->err.message);
            stage_discard(s, 409, "set_refused", msg);
        }
        upload_discard(u);
        return;
    }
    if (s->dead) {
        reject(u, s->dead_status, s->dead_code, s->dead_why, NULL);
        upload_discard(u);
        return;
    }
    /* shards that started or came in while it was parsed: a count fixed by a shard's request
     * meanwhile, more tensor data than total_size.  Either side may be the wrong one: the set
     * starts over (and the index text written meanwhile goes with it) */
    if (index_reconcile(u, s->nshards, s->data, &err) != 0) {
        reject_err(u, &err);
        snprintf(msg, sizeof(msg), "the set's index disagrees with its shards: %s", err.message);
        stage_discard(s, 409, "set_refused", msg);
        upload_discard(u);
        return;
    }
    if (upload_peek(u, &u->ds.info) != 0) {
        snprintf(msg, sizeof(msg), "the set's index was refused by the round (%s)",
                 round_verdict_name(daemon__peek(u->d, &u->ds.info)));
        stage_discard(s, 409, "set_refused", msg);
        upload_discard(u);
        return;
    }
    if (s->nshards == 0 && stage_fix_count(s, u->nshards) != 0) {
        reject(u, 500, "out_of_memory", "out of memory", NULL);
        upload_discard(u);
        return;
    }
    s->info = u->ds.info;
    s->index_bytes = u->body.len;
    s->total_size = u->total_size;
    part_in(u);
    upload_discard(u);
}

static void index_on_end(http_conn *c, void *ctx)
{
    upload *u = ctx;
    uint64_t nfloat = 0;

    (void)c;
    if (u->failed)
        return;
    for (size_t i = 0; i < u->d->model->ntensors; i++)
        nfloat += st_dtype_is_floating(u->d->model->tensors[i].dtype) != 0;
    u->set_nshards = u->stage->nshards;
    u->set_data = u->stage->data;
    u->parsing = 1;
    u->index_nfloat = nfloat;
    if (daemon__queue(u->d, index_work, index_done, u) != 0) {
        u->parsing = 0;
        reject(u, 500, "internal", "cannot queue the index's parse", NULL);
        upload_discard(u);
    }
}

/* an abort is the same for every kind of upload (on_abort) */
static const http_body_ops index_ops = {index_on_data, index_on_end, on_abort};

/* ---- a complete set ---- */

typedef struct complete_args {
    stage *s;
    upload *u;                  /* answers for the set, or NULL */
    const st_tensor **gby;      /* the global's tensors by name */
    size_t ngby;
    char rel[160];              /* nodes/<id>/delta_<n>.safetensors.index.json */
    delta_info info;
    char *cache_path;
    uint64_t size;
    intake_status st;
} complete_args;

/* On the pool: the set as a whole (every listed tensor in its shard and in no other, total_size, the
 * metadata against the path, the union of keys against the global), then linked into the cache. */
static void complete_work(pool_job *j)
{
    complete_args *a = j->arg;
    const stage *s = a->s;
    st_index *ix = NULL;
    st_set *set = NULL;
    char *ipath = NULL;
    uint64_t shard_bytes = 0;

    a->st = INTAKE_INVALID;
    if (asprintf(&ipath, "%s/delta_%" PRIu64 ST_INDEX_SUFFIX, s->dir, s->local_step) < 0) {
        ipath = NULL;
        dl_fail(&j->err, DL_E_NO_MEMORY, NULL, 0, "out of memory");
        a->st = INTAKE_IO;
    } else if (st_index_load(ipath, &ix, &j->err) != 0) {
        a->st = j->err.code == DL_E_IO || j->err.code == DL_E_NO_MEMORY ? INTAKE_IO : INTAKE_INVALID;
    } else if ((a->st = intake_check_set_dir(s->dir, ix, a->gby, a->ngby, a->rel, &a->info, &set, &shard_bytes,
                                             &j->err)) == INTAKE_OK) {
        a->size = s->index_bytes + shard_bytes;
        a->st = intake_link_set_into_cache(daemon__of_job(j)->st.dir, &a->info, s->dir, set->index, &a->cache_path, &j->err);
    }
    st_set_close(set);
    free(ipath);
}

static void complete_done(pool_job *j)
{
    complete_args *a = j->arg;
    stage *s = a->s;
    upload *u = a->u;
    dilocod *d = daemon__of_job(j);

    s->completing = 0;
    if (a->st == INTAKE_OK) {
        /* the set is in the cache: whatever happens to the connection, the round gets it */
        round_verdict v = daemon__offer(d, &a->info, a->cache_path, a->size);
        a->cache_path = NULL;
        if (u != NULL && (v == ROUND_ACCEPTED || v == ROUND_REPLACED))
            respond_created(u, &a->info, a->rel, v, a->size);
        else if (u != NULL)
            reject(u, v == ROUND_UNKNOWN_NODE ? 403 : 409, round_verdict_name(v),
                   "the round changed while the set was uploaded", NULL);
        stage_discard(s, 0, "", "");
    } else {
        char why[sizeof(j->err.message) + 32];
        if (a->st == INTAKE_DUPLICATE) {
            dl_fail(&j->err, DL_E_IO, NULL, 0, "this node's delta for this local_step is already in the round");
            if (u != NULL)
                reject(u, 409, "not_newer", j->err.message, NULL);
        } else if (u != NULL) {
            reject_err(u, &j->err);
        } else {
            daemon__rejected(d, a->rel, &j->err);
        }
        snprintf(why, sizeof(why), "the set was refused: %s", j->err.message);
        stage_discard(s, 409, "set_refused", why);
    }
    free(a->cache_path);
    free(a->gby);
    free(a);
    if (u != NULL) {
        u->completing = 0;
        upload_discard(u);
    }
}

/* Every part is in: check the set and take it in on the pool; responder (if any) gets the verdict. */
static void set_complete(stage *s, upload *responder)
{
    dilocod *d = s->d;
    complete_args *a = calloc(1, sizeof(*a));
    dl_error err;

    if (a == NULL || delta_header_by_name(d->model, &a->gby, &err) != 0) {
        free(a);
        if (responder != NULL)
            reject(responder, 500, "out_of_memory", "out of memory", NULL);
        stage_discard(s, 500, "out_of_memory", "out of memory taking the set in");
        return;
    }
    a->s = s;
    a->u = responder;
    a->ngby = d->model->ntensors;
    snprintf(a->rel, sizeof(a->rel), "nodes/%s/delta_%" PRIu64 ST_INDEX_SUFFIX, s->node_id, s->local_step);
    s->completing = 1;
    if (responder != NULL)
        responder->completing = 1;
    if (daemon__queue(d, complete_work, complete_done, a) != 0) {
        s->completing = 0;
        if (responder != NULL) {
            responder->completing = 0;
            reject(responder, 500, "internal", "cannot queue the set's intake", NULL);
        }
        free(a->gby);
        free(a);
        stage_discard(s, 500, "internal", "cannot queue the set's intake");
    }
}

/* PUT of a shard or an index: the round's answer as far as the path allows, then the node's set. */
static void set_part_start(dilocod *d, http_conn *c, http_request *req, const delta_path *dp)
{
    delta_info probe;
    stage *s;
    upload *u;
    uint32_t nfloat = 0;
    upload_kind kind = dp->kind == DELTA_PATH_INDEX ? UP_INDEX : UP_SHARD;
    char base[40], part[PART_NAME_MAX], msg[240];

    if (admit(d, c, req, dp->node_id) != 0)
        return;
    sets_sweep(d);              /* a round that moved on takes its sets now, not at the next loop turn */
    for (size_t i = 0; i < d->model->ntensors; i++)
        nfloat += st_dtype_is_floating(d->model->tensors[i].dtype) != 0;
    snprintf(base, sizeof(base), "delta_%" PRIu64, dp->local_step);
    if (kind == UP_INDEX) {
        snprintf(part, sizeof(part), "%s" ST_INDEX_SUFFIX, base);
        if (req->has_length && req->content_length > st_index_cap_for(d->model)) {
            snprintf(msg, sizeof(msg), "an index for this model is at most %zu bytes; this one has %" PRIu64,
                     st_index_cap_for(d->model), req->content_length);
            http_respond_error(c, 413, "too_large", msg, NULL);
            return;
        }
    } else {
        st_index_shard_name(base, dp->shard, dp->nshards, part, sizeof(part));
        if (dp->nshards > nfloat) {
            /* huggingface_hub never writes an empty shard: each holds at least one tensor */
            snprintf(msg, sizeof(msg), "a set of %u shards for a model of %u floating tensors: every shard holds "
                     "at least one tensor", dp->nshards, nfloat);
            stats_delta_rejected(&d->m, DL_E_INVALID_PATH);
            refuse(c, dp->node_id, 422, "invalid_path", msg, NULL);
            return;
        }
        if (req->has_length && req->content_length > body_limit(d)) {
            snprintf(msg, sizeof(msg), "body of %" PRIu64 " bytes is larger than the limit of %" PRIu64,
                     req->content_length, body_limit(d));
            http_respond_error(c, 413, "too_large", msg, NULL);
            return;
        }
    }
    /* before the metadata: the node, its step, a closed or full round */
    memset(&probe, 0, sizeof(probe));
    snprintf(probe.node_id, sizeof(probe.node_id), "%s", dp->node_id);
    probe.local_step = dp->local_step;
    probe.base_outer_step = d->rnd.step;
    if (peek_or_refuse(d, c, &probe, 0) != 0)
        return;
    s = stage_find(dp->node_id);
    if (s != NULL && s->local_step > dp->local_step) {
        snprintf(msg, sizeof(msg), "node %s is uploading the set of local_step %" PRIu64 ", a later one", dp->node_id,
                 s->local_step);
        stats_delta_refused(&d->m, ROUND_NOT_NEWER);
        refuse(c, dp->node_id, 409, "not_newer", msg, NULL);
        return;
    }
    if (s != NULL && s->local_step < dp->local_step) {
        snprintf(msg, sizeof(msg), "node %s started the set of local_step %" PRIu64 ", a later one", dp->node_id,
                 dp->local_step);
        stage_discard(s, 409, "not_newer", msg);
        s = NULL;
    }
    if (s != NULL && s->completing) {
        static const char body[] =
            "{\"error\":{\"code\":\"busy\",\"message\":\"the set is being taken in; retry shortly\"}}\n";
        http_respond(c, 503, "application/json", "Retry-After: 1\r\n", body, sizeof(body) - 1);
        return;
    }
    if (s != NULL && kind == UP_INDEX && s->index_streaming) {
        /* one index at a time: the one in flight is reconciled and written before another is read */
        static const char body[] =
            "{\"error\":{\"code\":\"busy\",\"message\":\"an index of this set is being received; retry shortly\"}}\n";
        http_respond(c, 503, "application/json", "Retry-After: 1\r\n", body, sizeof(body) - 1);
        return;
    }
    if (s != NULL && kind == UP_SHARD && s->nshards != 0 && s->nshards != dp->nshards) {
        snprintf(msg, sizeof(msg), "the set of local_step %" PRIu64 " being uploaded has %u shards, not %u",
                 dp->local_step, s->nshards, dp->nshards);
        stats_delta_rejected(&d->m, DL_E_INVALID_PATH);
        refuse(c, dp->node_id, 422, "invalid_path", msg, NULL);
        return;
    }
    if (s != NULL && s->index_bytes != 0 && peek_or_refuse(d, c, &s->info, 1) != 0)
        return;
    if (s == NULL && sets.n >= stage_limit(d)) {
        static const char body[] = "{\"error\":{\"code\":\"busy\",\"message\":"
                                   "\"too many sharded uploads in progress; retry shortly\"}}\n";
        http_respond(c, 503, "application/json", "Retry-After: 1\r\n", body, sizeof(body) - 1);
        return;
    }
    if (s == NULL && (s = stage_new(d, dp->node_id, dp->local_step, kind == UP_SHARD ? dp->nshards : 0)) == NULL) {
        http_respond_error(c, 500, "out_of_memory", "out of memory", NULL);
        return;
    }
    /* a set opened by its index (still parsing or refused): the first shard names the count */
    if (kind == UP_SHARD && s->nshards == 0 && stage_fix_count(s, dp->nshards) != 0) {
        http_respond_error(c, 500, "out_of_memory", "out of memory", NULL);
        return;
    }
    if ((u = upload_new(d, c, dp->node_id, kind)) == NULL) {
        http_respond_error(c, 500, "out_of_memory", "out of memory", NULL);
        if (s->refs == 0 && s->nreceived == 0 && s->index_bytes == 0)
            stage_discard(s, 500, "out_of_memory", "out of memory");
        return;
    }
    u->stage = s;
    s->refs++;
    if (kind == UP_INDEX)
        s->index_streaming = 1;
    u->local_step = dp->local_step;
    u->shard = dp->shard;
    u->nshards = dp->nshards;
    u->by_path = 1;
    snprintf(u->part, sizeof(u->part), "%s", part);
    snprintf(u->rel, sizeof(u->rel), "nodes/%s/%s", dp->node_id, part);
    if (kind == UP_INDEX) {
        http_accept_body(c, &index_ops, u);
        return;
    }
    u->ds.declared_len = req->has_length ? req->content_length : 0;
    u->ngby = d->model->ntensors;
    if (delta_header_by_name(d->model, &u->gby, &(dl_error){0}) != 0 ||
        asprintf(&u->tmp_path, "%s/%s.part-%u", s->dir, part, atomic_fetch_add(&upload_counter, 1)) < 0) {
        u->tmp_path = NULL;
        http_respond_error(c, 500, "out_of_memory", "out of memory", NULL);
        upload_discard(u);
        return;
    }
    if (start_open(u) != 0) {
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
