/* The HTTP engine's output: each connection's queue of buffers and file ranges, written with writev
 * and sendfile as the socket takes them (or handed to a fake connection's callback), the high and
 * low marks that pause and resume the parser, and the responses (head, body, error, file) that fill
 * the queue.  http_internal.h has the structs; http.c owns connections' lifetime, http_parse.c the input. */
#include "http_internal.h"

#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/sendfile.h>
#include <sys/uio.h>
#include <unistd.h>

#include "util.h"

#define SENDFILE_CHUNK (8u << 20)

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

void http__out_free_all(http_conn *c)
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

int http__out_buffer(http_conn *c, char *data, size_t len)
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
                http__touch(c);
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
            http__touch(c);
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

void http__conn_flush(http_conn *c)
{
    if (c->closing && c->fd < 0)
        return;
    if (c->fake_out) {
        fake_flush(c);
    } else if (write_some(c) != 0) {
        http__out_free_all(c);
        http__conn_close(c);
        return;
    }
    if (c->out_head == NULL && c->close_after && (c->message_done || c->responded)) {
        /* Never from inside llhttp_execute: the callback that answered (a body consumer refusing
         * an upload, say) is still running and must not see its connection, or itself, freed.
         * conn_process closes once execute has returned. */
        if (!c->in_execute)
            http__conn_finish(c);
        return;
    }
    if (c->out_paused && c->out_bytes <= OUT_LOW_WATER && !c->in_execute && !c->closing) {
        /* drained: the pipelined requests waiting in the read buffer go on */
        c->out_paused = 0;
        llhttp_resume(&c->parser);
        http__conn_process(c);
        return;
    }
    http__conn_update_poll(c);
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
        http__conn_flush(c);
        if (!c->closing)
            http__conn_process(c);
        return;
    }
    http__conn_flush(c);
}

static char *response_head(http_conn *c, int status, const char *content_type, const char *extra, uint64_t len,
                           size_t *out_len)
{
    sbuf b = {0};
    char line[160];
    int n;

    if (c->body != NULL && !c->body_done)
        c->close_after = 1;
    /* answered while the request head is handled, with a body no consumer takes (an early refusal): the
     * connection closes after it (http_parse.c), which the client must be told, or it reuses it */
    if (c->body == NULL && c->in_request && !c->message_done &&
        ((c->req.has_length && c->req.content_length > 0) || c->req.chunked))
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
    sb_str(&b, c->resp_header);
    sb_str(&b, "\r\n");
    *out_len = b.len;
    return sb_take(&b);
}

int http_conn_set_response_header(http_conn *c, const char *name, const char *value)
{
    size_t n = strlen(name), v = strlen(value);

    /* a header line of ours: a token name and a value without CR or LF */
    if (n == 0 || strpbrk(name, ": \r\n") != NULL || strpbrk(value, "\r\n") != NULL ||
        n + v + 5 > sizeof(c->resp_header))
        return -EINVAL;
    memcpy(c->resp_header, name, n);
    memcpy(c->resp_header + n, ": ", 2);
    memcpy(c->resp_header + n + 2, value, v);
    memcpy(c->resp_header + n + 2 + v, "\r\n", 3);
    return 0;
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
        http__conn_close(c);
        return;
    }
    int with_body = body != NULL && len > 0 && !c->req.head_only;
    char *all = realloc(head, hlen + (with_body ? len : 0) + 1);
    if (all == NULL) {
        free(head);
        http__conn_close(c);
        return;
    }
    if (with_body)
        memcpy(all + hlen, body, len);
    if (http__out_buffer(c, all, hlen + (with_body ? len : 0)) != 0) {
        http__conn_close(c);
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
    if (head == NULL || http__out_buffer(c, head, hlen) != 0 ||
        (body != NULL && len > 0 && !c->req.head_only && out_static(c, body, len) != 0)) {
        http__conn_close(c);
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
        http__conn_close(c);
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
    if (head == NULL || http__out_buffer(c, head, hlen) != 0) {
        http__conn_close(c);
        return;
    }
    if (!c->req.head_only && len > 0) {
        if ((it = calloc(1, sizeof(*it))) == NULL) {
            http__conn_close(c);      /* the head promised a body that cannot follow */
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
