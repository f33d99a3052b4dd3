/* http: an HTTP/1.1 server engine on libuv and llhttp.
 *
 * Connections are non-blocking sockets driven by uv_poll_t, so the engine writes buffers with
 * writev and files with sendfile(2) (zero copy) and reads only when the application can take more:
 * a body consumer that is waiting for its disk write stops the reads (backpressure reaches the
 * client through TCP).  One request is processed at a time per connection; pipelined requests wait
 * in the read buffer, so responses leave in order.  Every buffer has a cap (431, 414, 413), and two
 * timers per connection close slow or idle peers: a request-head deadline (slowloris) and an
 * inactivity timer (idle keep-alive, stalled body, stalled download).
 *
 * Nothing a peer does may exhaust the process: a connection's parser pauses while its queued output
 * (files counted at their remaining length) is over a cap, so pipelined requests wait in the read
 * buffer and then in the socket; the request-head deadline runs from accept, so silent connections
 * go; at max_conns the least recently active idle keep-alive connection makes room for a new one; on
 * EMFILE/ENFILE the listener drains its queue with a reserve descriptor and backs off.  The
 * process must ignore SIGPIPE (sendfile and writev have no MSG_NOSIGNAL): a peer that hangs up is an
 * EPIPE/ECONNRESET that closes its connection.
 *
 * The application sees requests through on_request and answers with http_respond*() or takes the
 * body with http_accept_body().  For tests and fuzzing, a connection can also be fed bytes without
 * a socket (http_conn_feed) with its output captured. */
#ifndef HTTP_H
#define HTTP_H

#include <stddef.h>
#include <stdint.h>

#include <uv.h>

typedef struct http_server http_server;
typedef struct http_conn http_conn;

typedef struct http_limits {
    size_t max_url;             /* 414 beyond */
    size_t max_header_bytes;    /* 431 beyond (all field names and values) */
    size_t max_headers;         /* 431 beyond */
    double header_timeout;      /* seconds to receive a whole request head */
    double idle_timeout;        /* seconds without progress (between requests, in a body, in a response) */
    unsigned max_conns;
} http_limits;

typedef struct http_header {
    char *name;                 /* lower-cased */
    char *value;
} http_header;

typedef struct http_request {
    int method;                 /* llhttp_method_t */
    const char *method_name;
    char *target;               /* request target as received */
    char *path;                 /* target without the query string */
    const char *query;          /* after '?', or "" */
    http_header *headers;
    size_t nheaders;
    int has_length;             /* Content-Length given */
    uint64_t content_length;
    int chunked;
    int expect_continue;
    int loopback;               /* the peer is 127.0.0.0/8 or ::1 (or a fed connection) */
    char peer[64];
    int head_only;              /* HEAD: responses carry headers only */
} http_request;

/* Case-insensitive lookup; NULL when absent. */
const char *http_header_get(const http_request *req, const char *name);

typedef void (*http_request_cb)(http_conn *c, http_request *req, void *app);

typedef struct http_body_ops {
    /* A body chunk.  Return 0 to go on, 1 to stop reading until http_resume(), -1 when the consumer
     * has responded with an error (the rest of the body is not read; the connection closes after
     * the response). */
    int (*data)(http_conn *c, const char *p, size_t n, void *ctx);
    /* The whole body arrived: respond now or later (the connection waits). */
    void (*end)(http_conn *c, void *ctx);
    /* The request ended without end() (peer gone, timeout, malformed chunking, shutdown). */
    void (*abort)(http_conn *c, void *ctx);
} http_body_ops;

typedef struct http_stats {
    uint64_t connections_total, connections_open, requests_total, bytes_received, bytes_sent,
        timeouts, rejected_conns, parse_errors;
    uint64_t evicted_idle;      /* idle keep-alive connections closed to make room at max_conns */
    uint64_t accept_errors;     /* accept(2) failures (EMFILE, ENFILE, ENOBUFS...): the listener backed off */
} http_stats;

/* A read-only file shared by every response that sends it: one descriptor however many downloads
 * are in flight (a dup per response let pipelined requests exhaust RLIMIT_NOFILE). */
typedef struct http_file http_file;
/* Takes ownership of fd (closed with the last reference); NULL (fd closed) when out of memory. */
http_file *http_file_new(int fd);
void http_file_ref(http_file *f);
void http_file_unref(http_file *f);

/* Listens on host:port (port 0 picks one; see http_server_port).  Returns 0 or a negative errno. */
int http_server_start(http_server **out, uv_loop_t *loop, const char *host, int port, const http_limits *lim,
                      http_request_cb on_request, void *app);
int http_server_port(const http_server *s);
/* Stops accepting, closes idle connections, aborts bodies in progress; the server frees itself
 * once every connection is closed and then calls done(app) (may be NULL). */
void http_server_stop(http_server *s, void (*done)(void *app));
const http_stats *http_server_stats(const http_server *s);
/* Called for every response the server sends, with the route the application tagged the request
 * with (http_conn_set_route; -1 when untagged, e.g. a malformed head) and the status: the one place
 * responses are counted, the engine's own 400/408/413/414/417/431 included. */
typedef void (*http_response_cb)(int route, int status, void *app);
void http_server_on_response(http_server *s, http_response_cb cb);
void http_conn_set_route(http_conn *c, int route);

/* ---- answering --------------------------------------------------------------------------------- */
/* extra_headers: zero or more complete "Name: value\r\n" lines.  The body is copied. */
void http_respond(http_conn *c, int status, const char *content_type, const char *extra_headers, const char *body,
                  size_t len);
/* {"error":{"code":...,"message":...,"tensor":...}} */
void http_respond_error(http_conn *c, int status, const char *code, const char *message, const char *tensor);
/* One header line every response to the current request carries (set again: replaced).  0, or -EINVAL
 * for a name or value that is not one header line. */
int http_conn_set_response_header(http_conn *c, const char *name, const char *value);
/* Like http_respond, for a body that outlives the connection (static data): it is not copied. */
void http_respond_static(http_conn *c, int status, const char *content_type, const char *extra_headers,
                         const char *body, size_t len);
/* Sends len bytes of f from offset off with sendfile; takes a reference of its own on f.  len is
 * the Content-Length; with status 206 the Content-Range is in extra_headers. */
void http_respond_file(http_conn *c, int status, const char *content_type, const char *extra_headers, http_file *f,
                       uint64_t off, uint64_t len);
/* Takes the request body. */
void http_accept_body(http_conn *c, const http_body_ops *ops, void *ctx);
/* The body consumer ctx lets go of the connection (it is about to be freed, for example after an
 * asynchronous disk error): no callback of it runs again.  An unread rest of the body is never
 * parsed as requests (the connection closes after its response). */
void http_body_detach(http_conn *c, void *ctx);
/* Reads again after a body consumer returned 1. */
void http_resume(http_conn *c);
/* The request the connection is processing (NULL between requests). */
http_request *http_conn_request(http_conn *c);
/* Whether the connection is still usable (an async handler may find it gone): returns 0 if the
 * connection was aborted. */
int http_conn_alive(const http_conn *c);
/* Keep a connection object alive across an asynchronous operation (pair every ref with an unref). */
void http_conn_ref(http_conn *c);
void http_conn_unref(http_conn *c);
uv_loop_t *http_conn_loop(const http_conn *c);
/* Status line text. */
const char *http_reason(int status);

/* ---- socket-less connections (tests, fuzzing) -------------------------------------------------- */
typedef void (*http_output_cb)(const char *data, size_t len, void *arg);
http_conn *http_conn_fake(http_server *s, http_output_cb out, void *arg);
/* Feeds bytes as if read from the socket; returns 0, or -1 once the connection is closed. */
int http_conn_feed(http_conn *c, const char *data, size_t len);
void http_conn_fake_eof(http_conn *c);
/* A server that does not listen (for http_conn_fake). */
int http_server_fake(http_server **out, uv_loop_t *loop, const http_limits *lim, http_request_cb on_request,
                     void *app);

#endif
