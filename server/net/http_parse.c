/* The HTTP engine's input: reads from the socket into each connection's buffer, llhttp's callbacks
 * that build the request (with the URL, header and body limits), hand it to the application and
 * pause for its answer or for the output to drain, and the poll's interest that follows from it.
 * http_internal.h has the structs; http.c owns connections' lifetime, http_out.c the output. */
#include "http_internal.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <unistd.h>

#include "util.h"

#define LINGER_MAX_BYTES (256u << 20)    /* a lingering close discards at most this much of a refused body */

const char *http_header_get(const http_request *req, const char *name)
{
    for (size_t i = 0; i < req->nheaders; i++) {
        if (strcasecmp(req->headers[i].name, name) == 0)
            return req->headers[i].value;
    }
    return NULL;
}

void http__request_free(http_request *r)
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

/* ---- llhttp callbacks -------------------------------------------------------------------------- */

static http_conn *conn_of(llhttp_t *p)
{
    return p->data;
}

static int on_message_begin(llhttp_t *p)
{
    http_conn *c = conn_of(p);
    http__request_free(&c->req);
    free(c->url.p);
    free(c->hname.p);
    free(c->hval.p);
    memset(&c->url, 0, sizeof(c->url));
    memset(&c->hname, 0, sizeof(c->hname));
    memset(&c->hval, 0, sizeof(c->hval));
    c->in_request = 1;
    c->head_done = c->responded = c->message_done = 0;
    c->resp_header[0] = '\0';
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
        uv_timer_start(&c->head_timer, http__head_timeout_cb, (uint64_t)(c->srv->lim.header_timeout * 1000), 0);
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
                http__out_buffer(c, copy, sizeof(cont) - 1);
                http__conn_flush(c);
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

void http__parser_init(http_conn *c)
{
    llhttp_init(&c->parser, HTTP_REQUEST, &parser_settings);
    c->parser.data = c;
}

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
        http__conn_flush(c);
    }
}

void http__conn_process(http_conn *c)
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
            http__conn_flush(c);
        } else {
            c->rpos = c->rlen;
            parse_error(c, err);
        }
    }
    if (c->closing)
        return;
    if (c->close_after && c->out_head == NULL && (c->message_done || c->responded)) {
        http__conn_finish(c);         /* deferred by conn_flush while the parser was running */
        return;
    }
    if (c->rpos == c->rlen) {
        c->rpos = c->rlen = 0;
    } else if (c->rpos > 0) {
        memmove(c->rbuf, c->rbuf + c->rpos, c->rlen - c->rpos);
        c->rlen -= c->rpos;
        c->rpos = 0;
    }
    http__conn_update_poll(c);
}

static int want_read(const http_conn *c)
{
    if (c->lingering)
        return !c->closing;
    return !c->closing && !c->paused && !c->out_paused && !c->body_stop && !c->close_after && c->rlen < READ_BUF &&
           c->out_bytes < OUT_HIGH_WATER && !c->srv->stopping;
}

static void poll_cb(uv_poll_t *h, int status, int events);

void http__conn_update_poll(http_conn *c)
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

void http__on_eof(http_conn *c)
{
    if (c->in_request && c->body != NULL && !c->body_done && c->head_done) {
        c->body_done = 1;
        c->body->abort(c, c->body_ctx);
    }
    llhttp_finish(&c->parser);
    http__conn_close(c);
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
            http__on_eof(c);
            return;
        }
        if (r == 0) {
            http__on_eof(c);
            return;
        }
        c->srv->stats.bytes_received += (uint64_t)r;
        if (c->lingering) {
            c->linger_bytes += (uint64_t)r;
            if (c->linger_bytes > LINGER_MAX_BYTES) {
                http__conn_close(c);
                return;
            }
            if ((size_t)r < room)
                break;
            continue;           /* discarded: only the peer's seeing our answer matters now */
        }
        c->rlen += (size_t)r;
        c->has_unread = 0;
        http__touch(c);
        http__conn_process(c);
        if (c->closing)
            return;
        if ((size_t)r < room)
            break;
    }
    http__conn_update_poll(c);
}

static void poll_cb(uv_poll_t *h, int status, int events)
{
    http_conn *c = container_of(h, http_conn, poll);

    c->refs++;
    if (status < 0) {
        http__on_eof(c);
    } else {
        if (events & UV_WRITABLE)
            http__conn_flush(c);
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
    http__touch(c);
    if (c->fake_out)
        return;
    http__conn_update_poll(c);
}
