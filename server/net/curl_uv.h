/* curl_uv: libcurl's multi interface driven by the libuv loop (curl's multi-uv pattern):
 * CURLMOPT_SOCKETFUNCTION -> one uv_poll_t per socket, CURLMOPT_TIMERFUNCTION -> a uv_timer_t,
 * curl_multi_socket_action on events, completed transfers drained with curl_multi_info_read.
 * Connections are reused across transfers (one multi handle).  File bodies and file sinks never
 * touch the disk from the loop thread: reads and writes go through uv_fs_read/uv_fs_write and the
 * transfer is paused (CURL_READFUNC_PAUSE / CURL_WRITEFUNC_PAUSE) until they complete.
 *
 * The peer is not trusted: every transfer has a connect timeout and a low-speed limit (a server
 * that goes silent or trickles is cut off), transfers without a file on either side also have a
 * total deadline, memory bodies and response headers are capped, a file sink can be capped, and
 * Authorization never follows a redirect to another host, port or scheme. */
#ifndef CURL_UV_H
#define CURL_UV_H

#include <stdint.h>

#include <curl/curl.h>
#include <uv.h>

#include "strbuf.h"
#include "wbuf.h"

typedef struct cuv cuv;
typedef struct cuv_xfer cuv_xfer;
typedef void (*cuv_done_cb)(cuv_xfer *x, void *arg);

struct cuv_xfer {
    /* results, valid in the done callback */
    CURLcode result;
    long status;
    sbuf body;                  /* the response body (memory transfers; capped) */
    char etag[160];
    char location[1024];
    char link_next[2048];       /* Link: <...>; rel="next" */
    char repo_commit[64];       /* X-Repo-Commit */
    char error_code[64];        /* X-Error-Code */
    char content_type[128];     /* Content-Type of the last response */
    char last_modified[64];     /* Last-Modified and Date of the last response, as sent ("" when absent) */
    char date[64];
    double retry_after;         /* Retry-After or RateLimit t= (seconds), -1 when absent */
    uint64_t written;           /* bytes written to the file sink */
    int io_error;               /* errno of a failed sink write / source read, else 0 */
    int too_big;                /* aborted: the answer outgrew its cap (body, file or headers) */
    int link_bad;               /* a Link rel="next" was present but unusable (too long) */
    /* private */
    cuv *owner;
    CURL *easy;
    struct curl_slist *headers;
    cuv_done_cb cb;
    void *arg;
    char *send;                 /* memory request body */
    size_t send_len, send_off;
    uv_file src_fd;             /* file request body (-1: none) */
    uint64_t src_off, src_left;
    char *rbuf;
    size_t rbuf_len, rbuf_off;
    int reading, src_eof, paused_read;
    uv_fs_t rreq;
    uv_file sink_fd;            /* file response body (-1: memory) */
    uint64_t sink_off;
    uint64_t sink_end;          /* file offset after the last byte accepted from curl */
    uint64_t sink_max;          /* the file may not grow past this, when sink_capped */
    int sink_capped;
    unsigned nheaders;          /* header lines of the current response */
    size_t header_bytes;        /* header bytes of the whole transfer (redirects included) */
    wbuf buf;                   /* the file sink's buffers (buf.out: the write in flight, wlen bytes) */
    size_t wlen;
    int writing, paused_write, finished;
    uv_fs_t wreq;
    uv_buf_t iov;
    size_t body_cap;
};

cuv *cuv_new(uv_loop_t *loop);
/* Closes the integration (cancel every transfer first): stops watching curl's sockets, closes its
 * cached connections, and frees itself once its handles are closed; then done(arg). */
void cuv_close(cuv *c, void (*done)(void *), void *arg);
uv_loop_t *cuv_loop(cuv *c);

/* A transfer: method "GET", "HEAD", "POST", "PUT". */
cuv_xfer *cuv_xfer_new(cuv *c, const char *method, const char *url);
void cuv_xfer_header(cuv_xfer *x, const char *line);
/* Authorization: Bearer, sent to the URL's host only (libcurl drops it on a redirect elsewhere). */
void cuv_xfer_bearer(cuv_xfer *x, const char *token);
void cuv_xfer_follow(cuv_xfer *x, int on);
/* Request body: a copy of data, or len bytes of fd from off (fd stays the caller's). */
int cuv_xfer_body(cuv_xfer *x, const void *data, size_t len);
void cuv_xfer_body_file(cuv_xfer *x, uv_file fd, uint64_t off, uint64_t len);
/* Response body to fd at off (the caller's fd), instead of memory. */
void cuv_xfer_sink_file(cuv_xfer *x, uv_file fd, uint64_t off);
/* The file sink may hold at most max bytes (from offset 0): an answer that announces more is
 * refused before its body, one that streams more is aborted at the first byte too many; either way
 * too_big is set.  A Hub that lists a size and then streams more must not fill the disk. */
void cuv_xfer_sink_max(cuv_xfer *x, uint64_t max);
/* Memory bodies (and non-2xx bodies of file transfers) are capped: CUV_DEFAULT_BODY_CAP unless set. */
#define CUV_DEFAULT_BODY_CAP (4u << 20)
void cuv_xfer_body_cap(cuv_xfer *x, size_t cap);
/* Starts it; cb runs on the loop when it is complete (and its file writes are on disk). */
int cuv_start(cuv_xfer *x, cuv_done_cb cb, void *arg);
/* Aborts a started transfer: its callback runs with CURLE_ABORTED_BY_CALLBACK (at once, or when
 * its pending file operation completes). */
void cuv_xfer_cancel(cuv_xfer *x);
void cuv_xfer_free(cuv_xfer *x);

#endif
