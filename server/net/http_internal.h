/* What the HTTP engine's files (server/net/http*.c) share with each other: the server and
 * connection structs, the marks they test, and the calls between the three parts:
 *   http.c        connections' lifetime: accept, eviction, timers, lingering close, free; the server
 *   http_out.c    the output queue and its writes (writev, sendfile), the responses
 *   http_parse.c  the input: reads, llhttp's callbacks, the request, the poll's interest
 * Included only by those files (make lint-layers keeps it so).  Everything here runs on the loop thread. */
#ifndef HTTP_INTERNAL_H
#define HTTP_INTERNAL_H

#include <stddef.h>
#include <stdint.h>

#include <llhttp.h>
#include <uv.h>

#include "http.h"
#include "strbuf.h"

#define READ_BUF 65536
/* A connection's queued output (buffers, and files at their remaining length): at the high mark
 * its parser pauses after the current request, so pipelined requests wait in the read buffer and
 * then in the peer's socket; it resumes at the low mark.  A peer that never reads therefore holds
 * at most READ_BUF + OUT_HIGH_WATER + one response of our memory, and one file reference. */
#define OUT_HIGH_WATER (256u << 10)
#define OUT_LOW_WATER (64u << 10)

struct http_file {
    int fd;
    unsigned refs;
};

typedef struct out_item {
    struct out_item *next;
    char *data;                 /* a buffer item ... */
    size_t len, off;
    int borrowed;               /* data is static: not freed */
    http_file *file;            /* ... or a file range */
    uint64_t foff, fleft;
} out_item;

struct http_server {
    uv_loop_t *loop;
    uv_poll_t listen_poll;
    uv_timer_t accept_timer;    /* resumes accepting after a backoff */
    int listen_fd;
    int reserve_fd;             /* spent on EMFILE to accept and close what waits (libuv's trick) */
    int port;
    int listening;
    http_limits lim;
    http_request_cb on_request;
    http_response_cb on_response;
    void *app;
    http_conn *conns;
    unsigned nconns;
    int stopping;
    void (*done)(void *app);
    http_stats stats;
};

struct http_conn {
    http_server *srv;
    http_conn *next, *prev;
    int fd;
    uv_poll_t poll;
    uv_timer_t head_timer, idle_timer;
    int handles;                /* open libuv handles (freed when 0 and refs == 0) */
    int refs;
    int poll_events;
    llhttp_t parser;
    char *rbuf;
    size_t rlen, rpos;
    int paused;                 /* parser paused at message complete until the response is queued */
    int out_paused;             /* parser paused at message complete until the output drains */
    int has_poll;               /* the uv_poll_t was initialised (closed with the connection) */
    int route;                  /* the application's tag of the current request (-1: none) */
    uint64_t last_active;       /* loop time of the last progress (eviction picks the oldest idle) */
    int has_unread;             /* eviction saw bytes in the socket not read yet: not idle */
    int in_execute;
    int closing, close_after;
    /* current request */
    http_request req;
    int in_request, head_done, responded, message_done;
    char resp_header[128];      /* one header line ("Name: value\r\n") every response to the request carries */
    size_t header_bytes;
    sbuf url, hname, hval;
    int in_value;
    const http_body_ops *body;
    void *body_ctx;
    int body_stop, body_done;
    uint64_t body_received;
    /* output */
    out_item *out_head, *out_tail;
    size_t out_bytes;
    int peer_loopback;
    char peer[64];
    int lingering;              /* answered early: discarding the unread body before closing */
    uint64_t linger_bytes;
    /* fake connections */
    http_output_cb fake_out;
    void *fake_arg;
};

/* ---- http.c: lifetime ---- */

/* Closes the connection now: aborts an unfinished body, closes the handles and the socket (freed
 * when the last handle is closed and no reference is held). */
void http__conn_close(http_conn *c);
/* The answer is out and the connection must close: closes, or lingers first while a refused body may
 * still be arriving. */
void http__conn_finish(http_conn *c);
/* Progress: the idle deadline starts again. */
void http__touch(http_conn *c);
/* The request head did not arrive in time: 408, or a close. */
void http__head_timeout_cb(uv_timer_t *t);

/* ---- http_out.c: output ---- */

/* Queues a malloc'd buffer, which the queue now owns (freed on failure too); 0 or -1 (no memory). */
int http__out_buffer(http_conn *c, char *data, size_t len);
/* Drops everything queued. */
void http__out_free_all(http_conn *c);
/* Writes what the socket takes, then closes, resumes the paused parser or updates the poll. */
void http__conn_flush(http_conn *c);

/* ---- http_parse.c: input ---- */

/* The connection's parser, with the engine's callbacks. */
void http__parser_init(http_conn *c);
/* Runs the parser over the read buffer until it is empty, paused or the connection closes. */
void http__conn_process(http_conn *c);
/* Polls for what the connection wants now (reads, writes, or nothing). */
void http__conn_update_poll(http_conn *c);
/* The peer closed (or the socket failed): an unfinished body is aborted and the connection closed. */
void http__on_eof(http_conn *c);
/* Frees a request's strings and headers and zeroes it. */
void http__request_free(http_request *r);

#endif
