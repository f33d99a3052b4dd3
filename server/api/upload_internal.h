/* upload_internal: what the two files of HTTP uploads share (upload.c: one delta's upload, streamed
 * to disk and offered to the round; upload_set.c: the parts of a sharded delta staged per node until
 * the set is complete).  The upload object and a staged set are known to both: a part streams like a
 * whole delta, into its set's directory.  Included by those two files only (make lint-layers).
 * Everything here runs on the loop thread. */
#ifndef UPLOAD_INTERNAL_H
#define UPLOAD_INTERNAL_H

#include <stddef.h>
#include <stdint.h>

#include <uv.h>

#include "api.h"
#include "daemon.h"
#include "delta.h"
#include "delta_stream.h"
#include "dl_error.h"
#include "http.h"
#include "round.h"
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


/* A staged set of a sharded delta (upload_set.c owns the table of them). */
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
    delta_norm *part_norm;      /* per shard: its values' sums of squares (delta_norm.h) once in */
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

/* ---- upload.c: one upload ---- */

/* A new upload of kind for node_id (counted in the uploads in flight until it is freed), or NULL. */
upload *upload_new(dilocod *d, http_conn *c, const char *node_id, upload_kind kind);
/* Closes and removes the temporary file, then frees u, once no file operation is in flight. */
void upload_discard(upload *u);
/* Creates the temporary file (a part: its set's directory first).  0 or a libuv error. */
int upload_start_open(upload *u);
/* Streams u's body (a whole delta, a shard) to disk, into the temporary file tmp_path (taken; NULL:
 * out of memory making it): the file is created, then the body read.  On failure u is answered and
 * discarded. */
void upload_stream_body(upload *u, http_request *req, char *tmp_path);
/* The body's abort callback: the same for every kind of upload. */
void upload_on_abort(http_conn *c, void *ctx);
/* A number for a temporary name, unique in the process. */
unsigned upload_next_id(void);

/* What every upload must pass before its body is read.  0, or API_ANSWERED. */
int upload_admit(dilocod *d, http_conn *c, http_request *req, const char *node_id);
/* The body limit of a whole delta, and of a set's shards together. */
uint64_t upload_body_limit(const dilocod *d);
/* Asks the round about info now (known_base 0: a set whose index has not arrived, judged as if based
 * on the open round's step): 0 when it would take it, else answers, counts and returns API_ANSWERED. */
int upload_peek_or_refuse(dilocod *d, http_conn *c, const delta_info *info, int known_base);
/* upload_peek_or_refuse for an upload in progress (an abort its answer reports does not free u). */
int upload_peek(upload *u, const delta_info *info);

/* Answers a refused upload (when its client still listens) and logs it. */
/* Async mode: the X-Recommended-Local-Steps header on every answer to this request. */
void upload_recommend(dilocod *d, http_conn *c, const char *node_id);
/* Answers a delta the round refused after its body arrived (verdict v). */
void upload_reject_verdict(upload *u, const delta_info *info, round_verdict v);
void upload_refuse(http_conn *c, const char *node_id, int status, const char *code, const char *msg,
                   const char *tensor);
/* upload_refuse for u, marked failed first; _err: the status from the error's code, counted. */
void upload_reject(upload *u, int status, const char *code, const char *msg, const char *tensor);
void upload_reject_err(upload *u, const dl_error *err);
/* A read of n bytes of u's body: 0, they are counted; API_ANSWERED when u failed or its set was discarded
 * (answered and discarded). */
int upload_body_read(upload *u, size_t n);
/* Sends b (taken) as u's JSON answer of status, or 500 when b ran out of memory. */
void upload_respond_json(upload *u, int status, sbuf *b);
/* 201: the delta (or set) of info is in the round. */
void upload_respond_created(upload *u, const delta_info *info, const char *rel, round_verdict v, uint64_t size);

/* ---- upload_set.c: the parts of a sharded delta ---- */

/* PUT of a shard or an index: the round's answer as far as the path allows, then the node's set. */
void set_part_start(dilocod *d, http_conn *c, http_request *req, const delta_path *dp);
/* A shard's header, checked on its own (on the pool). */
int set_shard_parse_header(upload *u, dl_error *err);
/* A shard's header is in: 0 when its data is read, else API_ANSWERED. */
int set_shard_verdict(upload *u);
/* A shard's file is in its set's directory (size bytes). */
void set_shard_in(upload *u, uint64_t size);
/* A part is done with its set (in, refused or aborted). */
void set_part_release(upload *u);

#endif
