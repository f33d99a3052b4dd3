#include "http.h"

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/sendfile.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <llhttp.h>

#include "strbuf.h"

#include "util.h"

#define READ_BUF 65536
/* A connection's queued output (buffers, and files at their remaining length): at the high mark
 * its parser pauses after the current request, so pipelined requests wait in the read buffer and
 * then in the peer's socket; it resumes at the low mark.  A peer that never reads therefore holds
 * at most READ_BUF + OUT_HIGH_WATER + one response of our memory, and one file reference. */
#define OUT_HIGH_WATER (256u << 10)
#define OUT_LOW_WATER (64u << 10)
#define SENDFILE_CHUNK (8u << 20)
#define ACCEPT_BACKOFF_MS 250           /* listener pause when accept fails for want of resources */
#define LINGER_MS 2000
#define LINGER_MAX_BYTES (256u << 20)
#define EVICT_TRIES 16                 /* idle candidates found holding a request before a new connection is refused */

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

static void conn_close(http_conn *c);
static void conn_finish(http_conn *c);
static void conn_flush(http_conn *c);
static void conn_process(http_conn *c);
static void conn_update_poll(http_conn *c);

const char *http_reason(int status)
{
    switch (status) {
    case 100: return "Continue";
    case 200: return "OK";
    case 201: return "Created";
    case 204: return "No Content";
    case 206: return "Partial Content";
    case 304: return "Not Modified";
    case 400: return "Bad Request";
    case 401: return "Unauthorized";
    case 403: return "Forbidden";
    case 404: return "Not Found";
    case 405: return "Method Not Allowed";
    case 408: return "Request Timeout";
    case 409: return "Conflict";
    case 411: return "Length Required";
    case 413: return "Content Too Large";
    case 414: return "URI Too Long";
    case 416: return "Range Not Satisfiable";
    case 417: return "Expectation Failed";
    case 422: return "Unprocessable Content";
    case 431: return "Request Header Fields Too Large";
    case 500: return "Internal Server Error";
    case 503: return "Service Unavailable";
    case 507: return "Insufficient Storage";
    default: return "Unknown";
    }
}

const char *http_header_get(const http_request *req, const char *name)
{
    for (size_t i = 0; i < req->nheaders; i++) {
        if (strcasecmp(req->headers[i].name, name) == 0)
            return req->headers[i].value;
    }
    return NULL;
}

static void request_free(http_request *r)
{
    for (size_t i = 0; i < r->nheaders; i++) {
        free(r->headers[i].name);
        free(r->headers[i].value);
    }
    free(r->headers);
    free(r->target);
    free(r->path);
    memset(r, 0, sizeof(*r));
}

/* ---- output ------------------------------------------------------------------------------------ */

static void out_push(http_conn *c, out_item *it)
{
    it->next = NULL;
    if (c->out_tail)
        c->out_tail->next = it;
    else
        c->out_head = it;
    c->out_tail = it;
    c->out_bytes += it->file ? (size_t)it->fleft : it->len;
}

static void out_item_free(out_item *it)
{
    if (it->file)
        http_file_unref(it->file);
    if (!it->borrowed)
        free(it->data);
    free(it);
}

static void out_free_all(http_conn *c)
{
    out_item *it = c->out_head;
    while (it) {
        out_item *n = it->next;
        out_item_free(it);
        it = n;
    }
    c->out_head = c->out_tail = NULL;
    c->out_bytes = 0;
}

static int out_buffer(http_conn *c, char *data, size_t len)
{
    out_item *it = calloc(1, sizeof(*it));
    if (it == NULL) {
        free(data);
        return -1;
    }
    it->data = data;
    it->len = len;
    out_push(c, it);
    return 0;
}

static int out_static(http_conn *c, const char *data, size_t len)
{
    out_item *it = calloc(1, sizeof(*it));
    if (it == NULL)
        return -1;
    it->data = (char *)data;
    it->len = len;
    it->borrowed = 1;
    out_push(c, it);
    return 0;
}

http_file *http_file_new(int fd)
{
    http_file *f = malloc(sizeof(*f));
    if (f == NULL) {
        close(fd);
        return NULL;
    }
    f->fd = fd;
    f->refs = 1;
    return f;
}

void http_file_ref(http_file *f)
{
    f->refs++;
}

void http_file_unref(http_file *f)
{
    if (f != NULL && --f->refs == 0) {
        close(f->fd);
        free(f);
    }
}

/* Fake connections hand their output to a callback, files included (read with pread). */
static void fake_flush(http_conn *c)
{
    while (c->out_head) {
        out_item *it = c->out_head;
        if (it->file) {
            char buf[65536];
            while (it->fleft > 0) {
                size_t n = it->fleft < sizeof(buf) ? (size_t)it->fleft : sizeof(buf);
                ssize_t r = pread(it->file->fd, buf, n, (off_t)it->foff);
                if (r <= 0)
                    break;
                c->fake_out(buf, (size_t)r, c->fake_arg);
                it->foff += (uint64_t)r;
                it->fleft -= (uint64_t)r;
            }
        } else {
            c->fake_out(it->data + it->off, it->len - it->off, c->fake_arg);
        }
        c->out_head = it->next;
        out_item_free(it);
    }
    c->out_tail = NULL;
    c->out_bytes = 0;
}

static void idle_timeout_cb(uv_timer_t *t);

static void touch(http_conn *c)
{
    c->last_active = uv_now(c->srv->loop);
    if (!c->closing && !c->lingering)
        uv_timer_start(&c->idle_timer, idle_timeout_cb, (uint64_t)(c->srv->lim.idle_timeout * 1000), 0);
}

/* Writes as much as the socket takes; returns -1 if the connection failed. */
static int write_some(http_conn *c)
{
    while (c->out_head) {
        out_item *it = c->out_head;
        if (it->file) {
            if (it->fleft > 0) {
                off_t off = (off_t)it->foff;
                size_t n = it->fleft < SENDFILE_CHUNK ? (size_t)it->fleft : SENDFILE_CHUNK;
                ssize_t w = sendfile(c->fd, it->file->fd, &off, n);
                if (w < 0) {
                    if (errno == EAGAIN || errno == EINTR)
                        return 0;
                    return -1;  /* EPIPE, ECONNRESET...: the peer is gone */
                }
                if (w == 0)
                    return -1;  /* the file shrank under us */
                it->foff += (uint64_t)w;
                it->fleft -= (uint64_t)w;
                c->out_bytes -= (size_t)w;
                c->srv->stats.bytes_sent += (uint64_t)w;
                touch(c);
                continue;
            }
        } else {
            struct iovec iov[16];
            int n = 0;
            for (out_item *j = it; j && !j->file && n < 16; j = j->next) {
                iov[n].iov_base = j->data + j->off;
                iov[n].iov_len = j->len - j->off;
                n++;
            }
            ssize_t w = writev(c->fd, iov, n);
            if (w < 0) {
                if (errno == EAGAIN || errno == EINTR)
                    return 0;
                return -1;
            }
            c->srv->stats.bytes_sent += (uint64_t)w;
            touch(c);
            while (w > 0 && c->out_head && !c->out_head->file) {
                out_item *h = c->out_head;
                size_t left = h->len - h->off;
                if ((size_t)w < left) {
                    h->off += (size_t)w;
                    c->out_bytes -= (size_t)w;
                    w = 0;
                    break;
                }
                w -= (ssize_t)left;
                c->out_bytes -= left;
                c->out_head = h->next;
                out_item_free(h);
            }
            if (c->out_head == NULL)
                c->out_tail = NULL;
            continue;
        }
        c->out_head = it->next;
        if (c->out_head == NULL)
            c->out_tail = NULL;
        out_item_free(it);
    }
    return 0;
}

static void conn_flush(http_conn *c)
{
    if (c->closing && c->fd < 0)
        return;
    if (c->fake_out) {
        fake_flush(c);
    } else if (write_some(c) != 0) {
        out_free_all(c);
        conn_close(c);
        return;
    }
    if (c->out_head == NULL && c->close_after && (c->message_done || c->responded)) {
        /* Never from inside llhttp_execute: the callback that answered (a body consumer refusing
         * an upload, say) is still running and must not see its connection, or itself, freed.
         * conn_process closes once execute has returned. */
        if (!c->in_execute)
            conn_finish(c);
        return;
    }
    if (c->out_paused && c->out_bytes <= OUT_LOW_WATER && !c->in_execute && !c->closing) {
        /* drained: the pipelined requests waiting in the read buffer go on */
        c->out_paused = 0;
        llhttp_resume(&c->parser);
        conn_process(c);
        return;
    }
    conn_update_poll(c);
}

/* ---- responses --------------------------------------------------------------------------------- */

static int should_close(http_conn *c)
{
    return c->close_after || c->srv->stopping || !llhttp_should_keep_alive(&c->parser);
}

static void after_response(http_conn *c)
{
    c->responded = 1;
    if (c->body != NULL && !c->body_done && c->head_done) {
        /* answered before the body was read (early rejection): the rest cannot be parsed as requests */
        c->close_after = 1;
    }
    if (c->paused && !c->in_execute && !c->closing) {
        c->paused = 0;
        llhttp_resume(&c->parser);
        conn_flush(c);
        if (!c->closing)
            conn_process(c);
        return;
    }
    conn_flush(c);
}

static char *response_head(http_conn *c, int status, const char *content_type, const char *extra, uint64_t len,
                           size_t *out_len)
{
    sbuf b = {0};
    char line[160];
    int n;

    if (c->body != NULL && !c->body_done)
        c->close_after = 1;
    if (c->srv->on_response != NULL)
        c->srv->on_response(c->route, status, c->srv->app);
    n = snprintf(line, sizeof(line), "HTTP/1.1 %d %s\r\n", status, http_reason(status));
    sb_add(&b, line, (size_t)n);
    if (content_type != NULL) {
        sb_str(&b, "Content-Type: ");
        sb_str(&b, content_type);
        sb_str(&b, "\r\n");
    }
    if (status != 304 && status != 204) {
        n = snprintf(line, sizeof(line), "Content-Length: %" PRIu64 "\r\n", len);
        sb_add(&b, line, (size_t)n);
    }
    if (should_close(c)) {
        c->close_after = 1;
        sb_str(&b, "Connection: close\r\n");
    }
    if (extra != NULL)
        sb_str(&b, extra);
    sb_str(&b, "\r\n");
    *out_len = b.len;
    return sb_take(&b);
}

void http_respond(http_conn *c, int status, const char *content_type, const char *extra_headers, const char *body,
                  size_t len)
{
    size_t hlen;
    char *head;

    if (c->closing || c->responded)
        return;
    head = response_head(c, status, content_type, extra_headers, len, &hlen);
    if (head == NULL) {
        conn_close(c);
        return;
    }
    int with_body = body != NULL && len > 0 && !c->req.head_only;
    char *all = realloc(head, hlen + (with_body ? len : 0) + 1);
    if (all == NULL) {
        free(head);
        conn_close(c);
        return;
    }
    if (with_body)
        memcpy(all + hlen, body, len);
    if (out_buffer(c, all, hlen + (with_body ? len : 0)) != 0) {
        conn_close(c);
        return;
    }
    after_response(c);
}

void http_respond_static(http_conn *c, int status, const char *content_type, const char *extra_headers,
                         const char *body, size_t len)
{
    size_t hlen;
    char *head;

    if (c->closing || c->responded)
        return;
    head = response_head(c, status, content_type, extra_headers, len, &hlen);
    if (head == NULL || out_buffer(c, head, hlen) != 0 ||
        (body != NULL && len > 0 && !c->req.head_only && out_static(c, body, len) != 0)) {
        conn_close(c);
        return;
    }
    after_response(c);
}

void http_respond_error(http_conn *c, int status, const char *code, const char *message, const char *tensor)
{
    sbuf b = {0};
    char *text;

    sb_str(&b, "{\"error\":{\"code\":");
    sb_json_string(&b, code, strlen(code));
    sb_str(&b, ",\"message\":");
    sb_json_string(&b, message, strlen(message));
    if (tensor != NULL && tensor[0] != '\0') {
        sb_str(&b, ",\"tensor\":");
        sb_json_string(&b, tensor, strlen(tensor));
    }
    sb_str(&b, "}}\n");
    size_t len = b.len;
    text = sb_take(&b);
    if (text == NULL) {
        conn_close(c);
        return;
    }
    http_respond(c, status, "application/json", NULL, text, len);
    free(text);
}

void http_respond_file(http_conn *c, int status, const char *content_type, const char *extra_headers, http_file *f,
                       uint64_t off, uint64_t len)
{
    size_t hlen;
    char *head;
    out_item *it;

    if (c->closing || c->responded)
        return;
    head = response_head(c, status, content_type, extra_headers, len, &hlen);
    if (head == NULL || out_buffer(c, head, hlen) != 0) {
        conn_close(c);
        return;
    }
    if (!c->req.head_only && len > 0) {
        if ((it = calloc(1, sizeof(*it))) == NULL) {
            conn_close(c);      /* the head promised a body that cannot follow */
            return;
        }
        http_file_ref(f);
        it->file = f;
        it->foff = off;
        it->fleft = len;
        out_push(c, it);
    }
    after_response(c);
}

/* ---- llhttp callbacks -------------------------------------------------------------------------- */

static http_conn *conn_of(llhttp_t *p)
{
    return p->data;
}

static void head_timeout_cb(uv_timer_t *t);

static int on_message_begin(llhttp_t *p)
{
    http_conn *c = conn_of(p);
    request_free(&c->req);
    free(c->url.p);
    free(c->hname.p);
    free(c->hval.p);
    memset(&c->url, 0, sizeof(c->url));
    memset(&c->hname, 0, sizeof(c->hname));
    memset(&c->hval, 0, sizeof(c->hval));
    c->in_request = 1;
    c->head_done = c->responded = c->message_done = 0;
    c->header_bytes = 0;
    c->in_value = 0;
    c->body = NULL;
    c->body_ctx = NULL;
    c->body_stop = c->body_done = 0;
    c->body_received = 0;
    c->route = -1;
    c->req.loopback = c->peer_loopback;
    memcpy(c->req.peer, c->peer, sizeof(c->req.peer));
    c->srv->stats.requests_total++;
    if (!c->fake_out || c->srv->lim.header_timeout > 0)
        uv_timer_start(&c->head_timer, head_timeout_cb, (uint64_t)(c->srv->lim.header_timeout * 1000), 0);
    return 0;
}

static int reject_head(http_conn *c, int status, const char *code, const char *msg)
{
    c->close_after = 1;
    http_respond_error(c, status, code, msg, NULL);
    return HPE_USER;
}

static int on_url(llhttp_t *p, const char *at, size_t len)
{
    http_conn *c = conn_of(p);
    if (c->url.len + len > c->srv->lim.max_url)
        return reject_head(c, 414, "uri_too_long", "request target too long");
    sb_add(&c->url, at, len);
    return c->url.oom ? -1 : 0;
}

static int finish_header(http_conn *c)
{
    http_header *nh;
    char *name, *value;

    if (!c->in_value)
        return 0;
    if (c->req.nheaders >= c->srv->lim.max_headers)
        return reject_head(c, 431, "headers_too_large", "too many header fields");
    name = sb_take(&c->hname);
    value = sb_take(&c->hval);
    nh = realloc(c->req.headers, (c->req.nheaders + 1) * sizeof(*nh));
    if (name == NULL || value == NULL || nh == NULL) {
        free(name);
        free(value);
        if (nh)
            c->req.headers = nh;
        return -1;
    }
    for (char *s = name; *s; s++)
        if (*s >= 'A' && *s <= 'Z')
            *s = (char)(*s - 'A' + 'a');
    c->req.headers = nh;
    c->req.headers[c->req.nheaders++] = (http_header){name, value};
    c->in_value = 0;
    return 0;
}

static int on_header_field(llhttp_t *p, const char *at, size_t len)
{
    http_conn *c = conn_of(p);
    int rc;
    if ((rc = finish_header(c)) != 0)
        return rc;
    c->header_bytes += len;
    if (c->header_bytes > c->srv->lim.max_header_bytes)
        return reject_head(c, 431, "headers_too_large", "request header fields too large");
    sb_add(&c->hname, at, len);
    return c->hname.oom ? -1 : 0;
}

static int on_header_value(llhttp_t *p, const char *at, size_t len)
{
    http_conn *c = conn_of(p);
    c->in_value = 1;
    c->header_bytes += len;
    if (c->header_bytes > c->srv->lim.max_header_bytes)
        return reject_head(c, 431, "headers_too_large", "request header fields too large");
    sb_add(&c->hval, at, len);
    return c->hval.oom ? -1 : 0;
}

static int on_headers_complete(llhttp_t *p)
{
    http_conn *c = conn_of(p);
    http_request *r = &c->req;
    const char *te, *expect;
    int rc;

    if ((rc = finish_header(c)) != 0)
        return rc;
    uv_timer_stop(&c->head_timer);
    c->head_done = 1;
    r->method = p->method;
    r->method_name = llhttp_method_name((llhttp_method_t)p->method);
    r->head_only = p->method == HTTP_HEAD;
    r->target = sb_take(&c->url);
    if (r->target == NULL)
        return -1;
    char *q = strchr(r->target, '?');
    r->path = q ? strndup(r->target, (size_t)(q - r->target)) : strdup(r->target);
    if (r->path == NULL)
        return -1;
    r->query = q ? q + 1 : "";
    r->has_length = (p->flags & F_CONTENT_LENGTH) != 0;
    r->content_length = r->has_length ? p->content_length : 0;
    te = http_header_get(r, "transfer-encoding");
    r->chunked = (p->flags & F_CHUNKED) != 0 || (te != NULL && strcasestr(te, "chunked") != NULL);
    expect = http_header_get(r, "expect");
    r->expect_continue = expect != NULL && strcasecmp(expect, "100-continue") == 0;
    if (expect != NULL && !r->expect_continue)
        return reject_head(c, 417, "expectation_failed", "only Expect: 100-continue is supported");
    c->srv->on_request(c, r, c->srv->app);
    if (c->closing)
        return HPE_USER;
    if (c->body != NULL) {
        if (r->expect_continue && !c->responded) {
            static const char cont[] = "HTTP/1.1 100 Continue\r\n\r\n";
            char *copy = malloc(sizeof(cont) - 1);
            if (copy != NULL) {
                memcpy(copy, cont, sizeof(cont) - 1);
                out_buffer(c, copy, sizeof(cont) - 1);
                conn_flush(c);
            }
        }
        return 0;
    }
    if (!c->responded) {
        /* the handler must answer or take the body: a bug, not the client's fault */
        http_respond_error(c, 500, "internal", "request not handled", NULL);
    }
    if ((r->has_length && r->content_length > 0) || r->chunked) {
        c->close_after = 1;     /* an unread body follows: it must not be parsed as a request */
        return HPE_USER;
    }
    return 0;
}

static int on_body(llhttp_t *p, const char *at, size_t len)
{
    http_conn *c = conn_of(p);
    int rc;

    if (c->body == NULL || c->responded)
        return HPE_USER;
    c->body_received += len;
    rc = c->body->data(c, at, len, c->body_ctx);
    if (rc < 0) {
        c->body_done = 1;       /* the consumer gave up and released itself: never call it again */
        c->close_after = 1;
        if (!c->responded)
            http_respond_error(c, 400, "bad_request", "request body refused", NULL);
        return HPE_USER;
    }
    if (rc == 1)
        c->body_stop = 1;
    return 0;
}

static int on_message_complete(llhttp_t *p)
{
    http_conn *c = conn_of(p);

    c->message_done = 1;
    c->in_request = 0;
    c->body_stop = 0;           /* the body is all in: a consumer's "stop reading" has nothing left to hold */
    if (c->body != NULL && !c->body_done) {
        c->body_done = 1;
        c->body->end(c, c->body_ctx);
    }
    if (c->closing)
        return HPE_USER;
    if (!c->responded) {
        c->paused = 1;          /* the handler answers later: hold the next pipelined request */
        uv_timer_stop(&c->idle_timer);
        return HPE_PAUSED;
    }
    if (c->out_bytes >= OUT_HIGH_WATER && !c->close_after) {
        c->out_paused = 1;      /* the peer is not reading fast enough: the next request waits */
        return HPE_PAUSED;
    }
    return 0;
}

static const llhttp_settings_t parser_settings = {
    .on_message_begin = on_message_begin,
    .on_url = on_url,
    .on_header_field = on_header_field,
    .on_header_value = on_header_value,
    .on_headers_complete = on_headers_complete,
    .on_body = on_body,
    .on_message_complete = on_message_complete,
};

/* ---- input ------------------------------------------------------------------------------------- */

static void parse_error(http_conn *c, llhttp_errno_t err)
{
    c->srv->stats.parse_errors++;
    c->close_after = 1;
    if (c->body != NULL && !c->body_done && c->head_done) {
        c->body_done = 1;
        c->body->abort(c, c->body_ctx);
    }
    if (!c->responded && !c->closing) {
        char msg[160];
        snprintf(msg, sizeof(msg), "malformed HTTP request: %s (%s)", llhttp_errno_name(err),
                 llhttp_get_error_reason(&c->parser) ? llhttp_get_error_reason(&c->parser) : "");
        http_respond_error(c, 400, "bad_request", msg, NULL);
    } else {
        conn_flush(c);
    }
}

static void conn_process(http_conn *c)
{
    while (!c->closing && !c->paused && !c->out_paused && c->rpos < c->rlen && !c->close_after) {
        const char *start = c->rbuf + c->rpos;
        c->in_execute = 1;
        llhttp_errno_t err = llhttp_execute(&c->parser, start, c->rlen - c->rpos);
        c->in_execute = 0;
        if (err == HPE_OK) {
            c->rpos = c->rlen;
        } else if (err == HPE_PAUSED) {
            c->rpos += (size_t)(llhttp_get_error_pos(&c->parser) - start);
            if (c->paused && c->responded && !c->closing) {     /* answered during the pause's own callback */
                c->paused = 0;
                llhttp_resume(&c->parser);
            }
        } else if (err == HPE_USER) {
            c->rpos = c->rlen;
            c->close_after = 1;
            if (c->body != NULL && !c->body_done && c->head_done && !c->responded) {
                c->body_done = 1;
                c->body->abort(c, c->body_ctx);
            }
            conn_flush(c);
        } else {
            c->rpos = c->rlen;
            parse_error(c, err);
        }
    }
    if (c->closing)
        return;
    if (c->close_after && c->out_head == NULL && (c->message_done || c->responded)) {
        conn_finish(c);         /* deferred by conn_flush while the parser was running */
        return;
    }
    if (c->rpos == c->rlen) {
        c->rpos = c->rlen = 0;
    } else if (c->rpos > 0) {
        memmove(c->rbuf, c->rbuf + c->rpos, c->rlen - c->rpos);
        c->rlen -= c->rpos;
        c->rpos = 0;
    }
    conn_update_poll(c);
}

static int want_read(const http_conn *c)
{
    if (c->lingering)
        return !c->closing;
    return !c->closing && !c->paused && !c->out_paused && !c->body_stop && !c->close_after && c->rlen < READ_BUF &&
           c->out_bytes < OUT_HIGH_WATER && !c->srv->stopping;
}

static void poll_cb(uv_poll_t *h, int status, int events);

static void conn_update_poll(http_conn *c)
{
    int ev = 0;

    if (c->closing || c->fake_out)
        return;
    if (want_read(c))
        ev |= UV_READABLE;
    if (c->out_head != NULL)
        ev |= UV_WRITABLE;
    if (ev == c->poll_events)
        return;
    c->poll_events = ev;
    if (ev == 0)
        uv_poll_stop(&c->poll);
    else
        uv_poll_start(&c->poll, ev, poll_cb);
}

static void linger_timeout_cb(uv_timer_t *t)
{
    conn_close(container_of(t, http_conn, idle_timer));
}

/* The answer is out and the connection must close.  If the peer may still be sending a body we
 * refused, a plain close() would make the kernel reset the connection and a proxy in front would
 * report 502 instead of our answer: close our side for writing, read and discard for a bounded
 * time and amount, then close (a lingering close, as nginx and Apache do). */
static void conn_finish(http_conn *c)
{
    if (c->closing || c->lingering)
        return;                 /* already closing, or already draining */
    if (c->fake_out || !c->head_done || c->message_done) {
        conn_close(c);
        return;
    }
    if (shutdown(c->fd, SHUT_WR) != 0) {
        conn_close(c);
        return;
    }
    c->lingering = 1;
    c->paused = 0;
    c->body_stop = 0;
    if (c->body != NULL && !c->body_done) {
        c->body_done = 1;
        c->body->abort(c, c->body_ctx);
    }
    uv_timer_stop(&c->head_timer);
    uv_timer_start(&c->idle_timer, linger_timeout_cb, LINGER_MS, 0);
    c->rlen = c->rpos = 0;
    conn_update_poll(c);
}

static void on_eof(http_conn *c)
{
    if (c->in_request && c->body != NULL && !c->body_done && c->head_done) {
        c->body_done = 1;
        c->body->abort(c, c->body_ctx);
    }
    llhttp_finish(&c->parser);
    conn_close(c);
}

/* Reads until the socket has no more, the buffer is full or the application stops the reads.  A
 * read that returns less than it asked for emptied the socket: the loop stops there instead of
 * asking again only to get EAGAIN (a keep-alive request fits in one read, so that was one syscall
 * in four per request); the poll is level-triggered, so bytes that arrive after it are reported at
 * the next iteration. */
static void read_some(http_conn *c)
{
    while (want_read(c)) {
        size_t room = READ_BUF - c->rlen;
        ssize_t r = read(c->fd, c->rbuf + c->rlen, room);
        if (r < 0) {
            if (errno == EINTR)
                continue;
            if (errno == EAGAIN)
                break;
            on_eof(c);
            return;
        }
        if (r == 0) {
            on_eof(c);
            return;
        }
        c->srv->stats.bytes_received += (uint64_t)r;
        if (c->lingering) {
            c->linger_bytes += (uint64_t)r;
            if (c->linger_bytes > LINGER_MAX_BYTES) {
                conn_close(c);
                return;
            }
            if ((size_t)r < room)
                break;
            continue;           /* discarded: only the peer's seeing our answer matters now */
        }
        c->rlen += (size_t)r;
        c->has_unread = 0;
        touch(c);
        conn_process(c);
        if (c->closing)
            return;
        if ((size_t)r < room)
            break;
    }
    conn_update_poll(c);
}

static void poll_cb(uv_poll_t *h, int status, int events)
{
    http_conn *c = container_of(h, http_conn, poll);

    c->refs++;
    if (status < 0) {
        on_eof(c);
    } else {
        if (events & UV_WRITABLE)
            conn_flush(c);
        if (!c->closing && (events & UV_READABLE))
            read_some(c);
    }
    http_conn_unref(c);
}

void http_resume(http_conn *c)
{
    if (c->closing || !c->body_stop)
        return;
    c->body_stop = 0;
    touch(c);
    if (c->fake_out)
        return;
    conn_update_poll(c);
}

/* ---- timers ------------------------------------------------------------------------------------ */

static void head_timeout_cb(uv_timer_t *t)
{
    http_conn *c = container_of(t, http_conn, head_timer);
    c->srv->stats.timeouts++;
    c->close_after = 1;
    if (!c->responded)
        http_respond_error(c, 408, "request_timeout", "request head not received in time", NULL);
    else
        conn_close(c);
}

static void idle_timeout_cb(uv_timer_t *t)
{
    http_conn *c = container_of(t, http_conn, idle_timer);
    if (c->paused)
        return;                 /* waiting for our own handler, not for the peer */
    if (c->in_request || c->out_head != NULL)
        c->srv->stats.timeouts++;
    if (c->body != NULL && !c->body_done && c->head_done) {
        c->body_done = 1;
        c->body->abort(c, c->body_ctx);
    }
    conn_close(c);
}

/* ---- lifetime ---------------------------------------------------------------------------------- */

static void conn_free(http_conn *c)
{
    http_server *s = c->srv;

    request_free(&c->req);
    free(c->url.p);
    free(c->hname.p);
    free(c->hval.p);
    free(c->rbuf);
    out_free_all(c);
    if (c->prev)
        c->prev->next = c->next;
    else
        s->conns = c->next;
    if (c->next)
        c->next->prev = c->prev;
    s->nconns--;
    s->stats.connections_open = s->nconns;
    free(c);
    if (s->stopping && s->nconns == 0 && !s->listening) {
        void (*done)(void *) = s->done;
        void *app = s->app;
        free(s);
        if (done)
            done(app);
    }
}

static void handle_closed(uv_handle_t *h)
{
    http_conn *c = h->data;
    if (--c->handles == 0 && c->refs == 0)
        conn_free(c);
}

static void conn_close(http_conn *c)
{
    if (c->closing)
        return;
    c->closing = 1;
    if (c->body != NULL && !c->body_done && c->head_done) {
        c->body_done = 1;
        c->body->abort(c, c->body_ctx);
    }
    if (!c->fake_out)
        conn_flush(c);          /* a last try for an error response already queued */
    out_free_all(c);
    uv_timer_stop(&c->head_timer);
    uv_timer_stop(&c->idle_timer);
    uv_close((uv_handle_t *)&c->head_timer, handle_closed);
    uv_close((uv_handle_t *)&c->idle_timer, handle_closed);
    if (c->has_poll)
        uv_close((uv_handle_t *)&c->poll, handle_closed);
    if (c->fd >= 0) {
        close(c->fd);
        c->fd = -1;
    }
}

void http_conn_ref(http_conn *c)
{
    c->refs++;
}

void http_conn_unref(http_conn *c)
{
    if (--c->refs == 0 && c->handles == 0)
        conn_free(c);
}

int http_conn_alive(const http_conn *c)
{
    return !c->closing;
}

http_request *http_conn_request(http_conn *c)
{
    return c->in_request || c->message_done ? &c->req : NULL;
}

uv_loop_t *http_conn_loop(const http_conn *c)
{
    return c->srv->loop;
}

void http_accept_body(http_conn *c, const http_body_ops *ops, void *ctx)
{
    c->body = ops;
    c->body_ctx = ctx;
}

void http_body_detach(http_conn *c, void *ctx)
{
    if (c->body == NULL || c->body_ctx != ctx)
        return;
    if (!c->body_done)
        c->close_after = 1;     /* what is left of the body must not be parsed as requests */
    c->body = NULL;
    c->body_ctx = NULL;
    c->body_done = 1;
}

static http_conn *conn_new(http_server *s, int fd)
{
    http_conn *c = calloc(1, sizeof(*c));
    if (c == NULL || (c->rbuf = malloc(READ_BUF)) == NULL) {
        free(c);
        return NULL;
    }
    c->srv = s;
    c->fd = fd;
    c->route = -1;
    llhttp_init(&c->parser, HTTP_REQUEST, &parser_settings);
    c->parser.data = c;
    uv_timer_init(s->loop, &c->head_timer);
    uv_timer_init(s->loop, &c->idle_timer);
    c->head_timer.data = c->idle_timer.data = c;
    c->handles = 2;
    c->next = s->conns;
    if (s->conns)
        s->conns->prev = c;
    s->conns = c;
    s->nconns++;
    s->stats.connections_total++;
    s->stats.connections_open = s->nconns;
    return c;
}

/* The request struct is reset at each message; the peer facts live on in the connection. */
static void conn_peer(http_conn *c, int loopback, const char *peer)
{
    c->peer_loopback = loopback;
    snprintf(c->peer, sizeof(c->peer), "%s", peer);
}

static int is_loopback(const struct sockaddr_storage *ss)
{
    if (ss->ss_family == AF_INET) {
        const struct sockaddr_in *in = (const struct sockaddr_in *)ss;
        return (ntohl(in->sin_addr.s_addr) >> 24) == 127;
    }
    if (ss->ss_family == AF_INET6) {
        const struct sockaddr_in6 *in6 = (const struct sockaddr_in6 *)ss;
        if (IN6_IS_ADDR_LOOPBACK(&in6->sin6_addr))
            return 1;
        if (IN6_IS_ADDR_V4MAPPED(&in6->sin6_addr))
            return in6->sin6_addr.s6_addr[12] == 127;
    }
    return 0;
}

/* The least recently active connection that is between requests (sent nothing yet, or idle
 * keep-alive) with nothing left to send.  conns is newest first, so on a tie (connections accepted
 * in one loop turn share last_active) the oldest wins. */
static http_conn *oldest_idle(http_server *s)
{
    http_conn *victim = NULL;

    for (http_conn *c = s->conns; c; c = c->next) {
        if (c->closing || c->lingering || c->in_request || c->paused || c->out_paused || c->out_head != NULL ||
            c->rlen > 0 || c->fake_out || c->has_unread)
            continue;
        if (victim == NULL || c->last_active <= victim->last_active)
            victim = c;
    }
    return victim;
}

/* Bytes the peer sent that this loop turn has not read yet: a connection accepted in an earlier
 * turn whose request arrived after it looks idle (rlen is 0) until its poll callback runs. */
static int has_unread_bytes(const http_conn *c)
{
    int n = 0;
    return c->fd >= 0 && ioctl(c->fd, FIONREAD, &n) == 0 && n > 0;
}

/* At max_conns, a new connection takes the place of the least recently active idle connection, as
 * nginx reuses keep-alive connections: a crowd of silent sockets cannot lock real clients out.  A
 * candidate whose request is already in its socket is a real client, not an idle one: evicting it
 * reset a pipelined client before it got any answer (read_some clears the mark). */
static int evict_idle(http_server *s)
{
    for (int tries = 0; tries < EVICT_TRIES; tries++) {
        http_conn *victim = oldest_idle(s);
        if (victim == NULL)
            return -1;
        if (has_unread_bytes(victim)) {
            victim->has_unread = 1;
            continue;
        }
        s->stats.evicted_idle++;
        conn_close(victim);
        return 0;
    }
    return -1;
}

static void accept_cb(uv_poll_t *h, int status, int events);
static void listen_closed(uv_handle_t *h);

static void accept_resume_cb(uv_timer_t *t)
{
    http_server *s = container_of(t, http_server, accept_timer);
    if (!s->stopping && s->listening)
        uv_poll_start(&s->listen_poll, UV_READABLE, accept_cb);
}

/* accept failed for want of descriptors or memory: the pending connection stays queued and the
 * listener would wake at once, forever (a spinning core).  Spend the reserve descriptor to accept
 * and close what waits, so those clients see a close rather than a hang, and pause the listener
 * briefly so the loop serves the connections it has. */
static void accept_backoff(http_server *s)
{
    s->stats.accept_errors++;
    if (s->reserve_fd >= 0) {
        close(s->reserve_fd);
        s->reserve_fd = -1;
        for (;;) {
            int fd = accept4(s->listen_fd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
            if (fd < 0)
                break;
            s->stats.rejected_conns++;
            close(fd);
        }
        s->reserve_fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
    }
    uv_poll_stop(&s->listen_poll);
    uv_timer_start(&s->accept_timer, accept_resume_cb, ACCEPT_BACKOFF_MS, 0);
}

static void accept_cb(uv_poll_t *h, int status, int events)
{
    http_server *s = container_of(h, http_server, listen_poll);
    (void)events;
    if (status < 0 || s->stopping)
        return;
    if (s->reserve_fd < 0)
        s->reserve_fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
    for (int i = 0; i < 64; i++) {
        struct sockaddr_storage ss;
        socklen_t sl = sizeof(ss);
        int fd = accept4(s->listen_fd, (struct sockaddr *)&ss, &sl, SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (fd < 0) {
            if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM)
                accept_backoff(s);
            else if (errno == ECONNABORTED || errno == EINTR || errno == EPROTO)
                continue;       /* that one connection is gone; others may wait */
            return;
        }
        if (s->nconns >= s->lim.max_conns && evict_idle(s) != 0) {
            s->stats.rejected_conns++;
            close(fd);
            continue;
        }
        int one = 1;
        setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
        http_conn *c = conn_new(s, fd);
        if (c == NULL) {
            close(fd);
            continue;
        }
        char addr[INET6_ADDRSTRLEN] = "?";
        if (ss.ss_family == AF_INET)
            inet_ntop(AF_INET, &((struct sockaddr_in *)&ss)->sin_addr, addr, sizeof(addr));
        else if (ss.ss_family == AF_INET6)
            inet_ntop(AF_INET6, &((struct sockaddr_in6 *)&ss)->sin6_addr, addr, sizeof(addr));
        conn_peer(c, is_loopback(&ss), addr);
        if (uv_poll_init(s->loop, &c->poll, fd) != 0) {
            conn_close(c);      /* closes fd; the poll handle was never made */
            continue;
        }
        c->poll.data = c;
        c->has_poll = 1;
        c->handles++;
        touch(c);
        /* the head deadline runs from accept: a connection that never sends a byte is a slowloris too */
        uv_timer_start(&c->head_timer, head_timeout_cb, (uint64_t)(s->lim.header_timeout * 1000), 0);
        conn_update_poll(c);
    }
}

int http_server_start(http_server **out, uv_loop_t *loop, const char *host, int port, const http_limits *lim,
                      http_request_cb on_request, void *app)
{
    struct addrinfo hints = {0}, *res = NULL;
    char portstr[16];
    http_server *s;
    int fd = -1, rc, one = 1;

    snprintf(portstr, sizeof(portstr), "%d", port);
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
    if ((rc = getaddrinfo(host, portstr, &hints, &res)) != 0)
        return rc == EAI_SYSTEM ? -errno : -EADDRNOTAVAIL;
    fd = socket(res->ai_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0 || setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one)) != 0 ||
        bind(fd, res->ai_addr, res->ai_addrlen) != 0 || listen(fd, 511) != 0) {
        rc = -errno;
        if (fd >= 0)
            close(fd);
        freeaddrinfo(res);
        return rc;
    }
    freeaddrinfo(res);
    if ((rc = http_server_fake(&s, loop, lim, on_request, app)) != 0) {
        close(fd);
        return rc;
    }
    struct sockaddr_storage ss;
    socklen_t sl = sizeof(ss);
    getsockname(fd, (struct sockaddr *)&ss, &sl);
    s->port = ntohs(ss.ss_family == AF_INET6 ? ((struct sockaddr_in6 *)&ss)->sin6_port
                                             : ((struct sockaddr_in *)&ss)->sin_port);
    s->listen_fd = fd;
    s->reserve_fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
    uv_timer_init(loop, &s->accept_timer);     /* cannot fail */
    s->listen_poll.data = s->accept_timer.data = s;
    if ((rc = uv_poll_init(loop, &s->listen_poll, fd)) != 0) {
        s->listening = 1;       /* listen_closed closes the descriptors and frees s */
        uv_close((uv_handle_t *)&s->accept_timer, listen_closed);
        return rc;
    }
    uv_poll_start(&s->listen_poll, UV_READABLE, accept_cb);
    s->listening = 2;           /* handles to close: the listen poll and the accept timer */
    *out = s;
    return 0;
}

int http_server_fake(http_server **out, uv_loop_t *loop, const http_limits *lim, http_request_cb on_request,
                     void *app)
{
    http_server *s = calloc(1, sizeof(*s));
    if (s == NULL)
        return -ENOMEM;
    s->loop = loop;
    s->lim = *lim;
    s->on_request = on_request;
    s->app = app;
    s->listen_fd = -1;
    s->reserve_fd = -1;
    *out = s;
    return 0;
}

int http_server_port(const http_server *s)
{
    return s->port;
}

const http_stats *http_server_stats(const http_server *s)
{
    return &s->stats;
}

void http_server_on_response(http_server *s, http_response_cb cb)
{
    s->on_response = cb;
}

void http_conn_set_route(http_conn *c, int route)
{
    c->route = route;
}

static void listen_closed(uv_handle_t *h)
{
    http_server *s = h->data;
    if (--s->listening > 0)
        return;
    close(s->listen_fd);
    if (s->reserve_fd >= 0)
        close(s->reserve_fd);
    if (s->nconns == 0) {
        void (*done)(void *) = s->done;
        void *app = s->app;
        free(s);
        if (done)
            done(app);
    }
}

void http_server_stop(http_server *s, void (*done)(void *app))
{
    s->stopping = 1;
    s->done = done;
    /* connections between requests close now; ones mid-request close after their response */
    for (http_conn *c = s->conns, *n; c; c = n) {
        n = c->next;
        if (!c->in_request && !c->paused && c->out_head == NULL)
            conn_close(c);
        else if (c->body != NULL && !c->body_done)
            conn_close(c);      /* an upload in progress is abandoned: nothing partial is kept */
        else
            c->close_after = 1;
    }
    if (s->listening) {
        uv_poll_stop(&s->listen_poll);
        uv_timer_stop(&s->accept_timer);
        uv_close((uv_handle_t *)&s->listen_poll, listen_closed);
        uv_close((uv_handle_t *)&s->accept_timer, listen_closed);
    } else if (s->nconns == 0) {
        void *app = s->app;
        free(s);
        if (done)
            done(app);
    }
}

http_conn *http_conn_fake(http_server *s, http_output_cb out, void *arg)
{
    http_conn *c = conn_new(s, -1);
    if (c == NULL)
        return NULL;
    c->fake_out = out;
    c->fake_arg = arg;
    conn_peer(c, 1, "fake");
    return c;
}

int http_conn_feed(http_conn *c, const char *data, size_t len)
{
    while (len > 0 && !c->closing) {
        size_t room = READ_BUF - c->rlen;
        size_t n = len < room ? len : room;
        if (n == 0) {
            if (c->paused || c->body_stop)
                return 0;       /* the application holds the input: the rest would wait in the socket */
            conn_process(c);
            if (READ_BUF - c->rlen == 0)
                return 0;
            continue;
        }
        memcpy(c->rbuf + c->rlen, data, n);
        c->rlen += n;
        data += n;
        len -= n;
        conn_process(c);
    }
    return c->closing ? -1 : 0;
}

void http_conn_fake_eof(http_conn *c)
{
    if (!c->closing)
        on_eof(c);
}
