#include "curl_uv.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "util.h"

#define IO_BUF (1u << 20)
/* A file sink is written in units that end at multiples of SINK_UNIT of the file: a 2 MiB write at a
 * 2 MiB offset lands in one 2 MiB page-cache folio, which the aggregation pass maps with one page-table
 * entry (common/outer.c; 8 x 256 MiB written in 1 MiB writes took it 0.35-0.39 s, in 2 MiB writes
 * 0.21-0.27 s).  Its buffers hold a unit and one write callback's worth more (curl passes at most
 * CURL_MAX_WRITE_SIZE at a time). */
#define SINK_UNIT (2u << 20)
#define SINK_BUF (SINK_UNIT + CURL_MAX_WRITE_SIZE)
/* Response headers: the Hub sends about 20 lines; curl itself caps one line at 100 KiB. */
#define MAX_HEADER_LINES 200
#define MAX_HEADER_BYTES (256u << 10)
/* A file sink's announced size is refused above its cap, but never below this floor: a redirect's
 * or an error page's small body must not fail the transfer when the remaining file is tiny (the
 * write callback enforces the exact cap on the file's bytes). */
#define MAXFILESIZE_FLOOR (64u << 10)
/* Slower than LOW_SPEED_BYTES per second for LOW_SPEED_SECONDS: the peer is gone or hostile. */
#define LOW_SPEED_BYTES 1024L
#define LOW_SPEED_SECONDS 30L
#define CONNECT_TIMEOUT_MS 15000L
/* Transfers with no file on either side are small JSON exchanges: a few seconds normally. */
#define MEMORY_TRANSFER_TIMEOUT_MS 120000L

typedef struct sock_ctx sock_ctx;

struct cuv {
    uv_loop_t *loop;
    CURLM *multi;
    uv_timer_t timer;
    int closing;
    int handles;                /* open libuv handles (timer + socket polls) */
    void (*done)(void *);
    void *done_arg;
    sock_ctx *socks;            /* every socket curl asked us to watch */
};

struct sock_ctx {
    uv_poll_t poll;
    curl_socket_t fd;
    cuv *owner;
    struct sock_ctx *next, *prev;
};

static void sock_unlink(cuv *c, sock_ctx *s)
{
    if (s->prev)
        s->prev->next = s->next;
    else
        c->socks = s->next;
    if (s->next)
        s->next->prev = s->prev;
    s->next = s->prev = NULL;
}



static void check_done(cuv *c);
static void finish(cuv_xfer *x);

static void handle_closed(uv_handle_t *h)
{
    cuv *c = h->data;
    if (h != (uv_handle_t *)&c->timer)
        free(container_of((uv_poll_t *)h, sock_ctx, poll));
    if (--c->handles == 0 && c->closing) {
        void (*done)(void *) = c->done;
        void *arg = c->done_arg;
        free(c);
        if (done)
            done(arg);
    }
}

static void poll_cb(uv_poll_t *p, int status, int events)
{
    sock_ctx *s = container_of(p, sock_ctx, poll);
    int flags = 0, running;

    if (status < 0)
        flags = CURL_CSELECT_ERR;
    if (events & UV_READABLE)
        flags |= CURL_CSELECT_IN;
    if (events & UV_WRITABLE)
        flags |= CURL_CSELECT_OUT;
    curl_multi_socket_action(s->owner->multi, s->fd, flags, &running);
    check_done(s->owner);
}

static int socket_cb(CURL *e, curl_socket_t fd, int what, void *userp, void *socketp)
{
    cuv *c = userp;
    sock_ctx *s = socketp;
    (void)e;

    if (what == CURL_POLL_REMOVE) {
        if (s != NULL) {
            uv_poll_stop(&s->poll);                 /* stop before closing (curl may reuse the fd) */
            curl_multi_assign(c->multi, fd, NULL);
            sock_unlink(c, s);
            uv_close((uv_handle_t *)&s->poll, handle_closed);
        }
        return 0;
    }
    if (s == NULL) {
        s = calloc(1, sizeof(*s));
        if (s == NULL || uv_poll_init_socket(c->loop, &s->poll, fd) != 0) {
            free(s);
            return -1;
        }
        s->fd = fd;
        s->owner = c;
        s->poll.data = c;
        s->next = c->socks;
        if (c->socks)
            c->socks->prev = s;
        c->socks = s;
        c->handles++;
        curl_multi_assign(c->multi, fd, s);
    }
    int ev = 0;
    if (what == CURL_POLL_IN || what == CURL_POLL_INOUT)
        ev |= UV_READABLE;
    if (what == CURL_POLL_OUT || what == CURL_POLL_INOUT)
        ev |= UV_WRITABLE;
    uv_poll_start(&s->poll, ev, poll_cb);
    return 0;
}

static void timer_cb(uv_timer_t *t)
{
    cuv *c = container_of(t, cuv, timer);
    int running;
    curl_multi_socket_action(c->multi, CURL_SOCKET_TIMEOUT, 0, &running);
    check_done(c);
}

static int timer_fn(CURLM *m, long timeout_ms, void *userp)
{
    cuv *c = userp;
    (void)m;
    if (timeout_ms < 0)
        uv_timer_stop(&c->timer);
    else
        uv_timer_start(&c->timer, timer_cb, timeout_ms == 0 ? 1 : (uint64_t)timeout_ms, 0);   /* 0 -> 1 ms */
    return 0;
}

cuv *cuv_new(uv_loop_t *loop)
{
    cuv *c = calloc(1, sizeof(*c));
    if (c == NULL || (c->multi = curl_multi_init()) == NULL) {
        free(c);
        return NULL;
    }
    c->loop = loop;
    uv_timer_init(loop, &c->timer);
    c->timer.data = c;
    c->handles = 1;
    curl_multi_setopt(c->multi, CURLMOPT_SOCKETFUNCTION, socket_cb);
    curl_multi_setopt(c->multi, CURLMOPT_SOCKETDATA, c);
    curl_multi_setopt(c->multi, CURLMOPT_TIMERFUNCTION, timer_fn);
    curl_multi_setopt(c->multi, CURLMOPT_TIMERDATA, c);
    curl_multi_setopt(c->multi, CURLMOPT_MAX_HOST_CONNECTIONS, 8L);
    return c;
}

uv_loop_t *cuv_loop(cuv *c)
{
    return c->loop;
}

/* ---- headers ----------------------------------------------------------------------------------- */

static void copy_value(char *dst, size_t size, const char *v, size_t len)
{
    while (len > 0 && (*v == ' ' || *v == '\t')) {
        v++;
        len--;
    }
    while (len > 0 && (v[len - 1] == '\r' || v[len - 1] == '\n' || v[len - 1] == ' '))
        len--;
    if (len >= size)
        len = size - 1;
    memcpy(dst, v, len);
    dst[len] = '\0';
}

static size_t header_cb(char *p, size_t size, size_t n, void *arg)
{
    cuv_xfer *x = arg;
    size_t len = size * n;
    const char *colon = memchr(p, ':', len);

    x->header_bytes += len;
    if (x->header_bytes > MAX_HEADER_BYTES || ++x->nheaders > MAX_HEADER_LINES) {
        x->too_big = 1;
        return 0;               /* fails the transfer (CURLE_WRITE_ERROR) */
    }
    if (len > 5 && strncmp(p, "HTTP/", 5) == 0) {
        /* a new response (after a redirect or 100): forget the previous one's headers */
        x->etag[0] = x->location[0] = x->link_next[0] = x->error_code[0] = x->content_type[0] = '\0';
        x->last_modified[0] = x->date[0] = '\0';
        x->link_bad = 0;
        x->retry_after = -1;
        x->nheaders = 1;
        return len;
    }
    if (colon == NULL)
        return len;
    size_t nl = (size_t)(colon - p);
    const char *v = colon + 1;
    size_t vl = len - nl - 1;
    char tmp[256];
    if (nl == 4 && strncasecmp(p, "etag", 4) == 0) {
        copy_value(x->etag, sizeof(x->etag), v, vl);
    } else if (nl == 8 && strncasecmp(p, "location", 8) == 0) {
        copy_value(x->location, sizeof(x->location), v, vl);
    } else if (nl == 13 && strncasecmp(p, "x-repo-commit", 13) == 0) {
        copy_value(x->repo_commit, sizeof(x->repo_commit), v, vl);
    } else if (nl == 12 && strncasecmp(p, "x-error-code", 12) == 0) {
        copy_value(x->error_code, sizeof(x->error_code), v, vl);
    } else if (nl == 12 && strncasecmp(p, "content-type", 12) == 0) {
        copy_value(x->content_type, sizeof(x->content_type), v, vl);
    } else if (nl == 13 && strncasecmp(p, "last-modified", 13) == 0) {
        copy_value(x->last_modified, sizeof(x->last_modified), v, vl);
    } else if (nl == 4 && strncasecmp(p, "date", 4) == 0) {
        copy_value(x->date, sizeof(x->date), v, vl);
    } else if (nl == 11 && strncasecmp(p, "retry-after", 11) == 0) {
        copy_value(tmp, sizeof(tmp), v, vl);
        char *end;
        double s = strtod(tmp, &end);
        if (end != tmp && isfinite(s) && s >= 0 && s < 86400)
            x->retry_after = s;
    } else if (nl == 9 && strncasecmp(p, "ratelimit", 9) == 0) {
        /* "api";r=0;t=55: seconds until the window resets */
        copy_value(tmp, sizeof(tmp), v, vl);
        const char *t = strstr(tmp, ";t=");
        if (t != NULL) {
            char *end;
            double s = strtod(t + 3, &end);
            if (end != t + 3 && isfinite(s) && s >= 0 && s < 86400 && x->retry_after < 0)
                x->retry_after = s;
        }
    } else if (nl == 4 && strncasecmp(p, "link", 4) == 0) {
        char line[2200];
        copy_value(line, sizeof(line), v, vl);
        /* <url>; rel="next" (possibly among other links) */
        for (char *lt = strchr(line, '<'); lt != NULL; lt = strchr(lt + 1, '<')) {
            char *gt = strchr(lt, '>');
            if (gt == NULL)
                break;
            const char *next = strstr(gt, "rel=\"next\"");
            const char *comma = strchr(gt, ',');
            if (next != NULL && (comma == NULL || next < comma)) {
                *gt = '\0';
                /* a cut URL would be another URL: refuse it instead */
                if ((size_t)snprintf(x->link_next, sizeof(x->link_next), "%s", lt + 1) >= sizeof(x->link_next)) {
                    x->link_next[0] = '\0';
                    x->link_bad = 1;
                }
                break;
            }
        }
    }
    return len;
}

/* ---- response bodies --------------------------------------------------------------------------- */

static void start_write(cuv_xfer *x);

/* Bytes from where the filling buffer starts in the file (after the write in flight) to the next
 * multiple of SINK_UNIT. */
static size_t sink_unit_left(const cuv_xfer *x)
{
    return wbuf_unit_left(x->sink_off + x->wlen, SINK_UNIT);
}

static void write_done(uv_fs_t *req)
{
    cuv_xfer *x = req->data;
    ssize_t r = req->result;

    uv_fs_req_cleanup(req);
    x->writing = 0;
    if (r < 0 || (size_t)r != x->wlen) {
        if (x->io_error == 0)
            x->io_error = r < 0 ? (int)-r : EIO;
    } else {
        x->sink_off += x->wlen;
        x->written += x->wlen;
    }
    x->wlen = 0;
    if (x->io_error == 0 && x->buf.fill_len > 0 && (x->finished || x->buf.fill_len >= sink_unit_left(x)))
        start_write(x);
    if (x->finished && x->result == CURLE_ABORTED_BY_CALLBACK) {
        if (!x->writing)
            finish(x);
        return;
    }
    if (x->paused_write && !x->writing && x->io_error == 0) {
        x->paused_write = 0;
        curl_easy_pause(x->easy, CURLPAUSE_CONT);
        check_done(x->owner);
    } else if (x->paused_write && x->io_error != 0) {
        x->paused_write = 0;
        curl_easy_pause(x->easy, CURLPAUSE_CONT);   /* the write callback now fails the transfer */
        check_done(x->owner);
    }
    if (x->finished && !x->writing)
        finish(x);
}

/* Writes the filling buffer up to the next multiple of SINK_UNIT of the file (all of it once the
 * transfer is over); the bytes past it move to the other buffer, which fills next. */
static void start_write(cuv_xfer *x)
{
    size_t len = wbuf_cut(&x->buf, x->sink_off + x->wlen, SINK_UNIT, x->finished);

    if (wbuf_swap(&x->buf, len) != 0) {
        x->io_error = ENOMEM;
        return;
    }
    x->wlen = len;
    x->iov = uv_buf_init(x->buf.out, (unsigned)x->wlen);
    x->wreq.data = x;
    x->writing = 1;
    if (uv_fs_write(x->owner->loop, &x->wreq, x->sink_fd, &x->iov, 1, (int64_t)x->sink_off, write_done) != 0) {
        x->writing = 0;
        x->io_error = EIO;
    }
}

static size_t body_cb(char *p, size_t size, size_t n, void *arg)
{
    cuv_xfer *x = arg;
    size_t len = size * n;
    long status = 0;

    /* only a successful answer's body is the file: an error page must never land in it (a resume
     * would then continue after the error text) */
    if (x->sink_fd >= 0)
        curl_easy_getinfo(x->easy, CURLINFO_RESPONSE_CODE, &status);
    if (x->sink_fd < 0 || status < 200 || status > 299) {
        if (len > x->body_cap || x->body.len > x->body_cap - len) {
            x->too_big = 1;
            return 0;           /* larger than any answer we expect: fail the transfer */
        }
        sb_add(&x->body, p, len);
        return x->body.oom ? 0 : len;
    }
    if (x->io_error != 0)
        return 0;
    /* the listed size is all the file may be: one byte more and the transfer is over (the bytes
     * before it are on their way to the disk, never beyond the cap) */
    if (x->sink_capped && (len > x->sink_max || x->sink_end > x->sink_max - len)) {
        x->too_big = 1;
        return 0;
    }
    if (len > x->buf.fill_cap - x->buf.fill_len) {
        if (x->writing) {
            x->paused_write = 1;
            return CURL_WRITEFUNC_PAUSE;    /* redelivered after the disk caught up */
        }
        start_write(x);
        if (x->io_error != 0)
            return 0;
    }
    /* (grows the buffer for more than curl passes at a time past a buffer's unit) */
    if (wbuf_append(&x->buf, p, len) != 0) {
        x->io_error = ENOMEM;
        return 0;
    }
    x->sink_end += len;
    if (x->buf.fill_len >= sink_unit_left(x) && !x->writing)
        start_write(x);
    return len;
}

/* ---- request bodies from files ---------------------------------------------------------------- */

static void read_done(uv_fs_t *req)
{
    cuv_xfer *x = req->data;
    ssize_t r = req->result;

    uv_fs_req_cleanup(req);
    x->reading = 0;
    if (x->finished) {          /* cancelled while reading */
        finish(x);
        return;
    }
    if (r < 0) {
        x->io_error = (int)-r;
    } else if (r == 0 && x->src_left > 0) {
        x->io_error = ENODATA;          /* the file is shorter than announced */
    } else {
        x->rbuf_len = (size_t)r;
        x->rbuf_off = 0;
        x->src_off += (uint64_t)r;
        x->src_left -= (uint64_t)r;
    }
    if (x->paused_read) {
        x->paused_read = 0;
        curl_easy_pause(x->easy, CURLPAUSE_CONT);
        check_done(x->owner);
    }
}

static size_t read_cb(char *out, size_t size, size_t n, void *arg)
{
    cuv_xfer *x = arg;
    size_t want = size * n;

    if (x->src_fd < 0) {                /* memory body */
        size_t left = x->send_len - x->send_off;
        size_t k = want < left ? want : left;
        memcpy(out, x->send + x->send_off, k);
        x->send_off += k;
        return k;
    }
    if (x->io_error != 0)
        return CURL_READFUNC_ABORT;
    if (x->rbuf_off < x->rbuf_len) {
        size_t k = x->rbuf_len - x->rbuf_off;
        if (k > want)
            k = want;
        memcpy(out, x->rbuf + x->rbuf_off, k);
        x->rbuf_off += k;
        return k;
    }
    if (x->src_left == 0)
        return 0;
    if (!x->reading) {
        size_t k = x->src_left < IO_BUF ? (size_t)x->src_left : IO_BUF;
        x->iov = uv_buf_init(x->rbuf, (unsigned)k);
        x->rreq.data = x;
        x->reading = 1;
        if (uv_fs_read(x->owner->loop, &x->rreq, x->src_fd, &x->iov, 1, (int64_t)x->src_off, read_done) != 0) {
            x->reading = 0;
            x->io_error = EIO;
            return CURL_READFUNC_ABORT;
        }
    }
    x->paused_read = 1;
    return CURL_READFUNC_PAUSE;
}

/* ---- transfers --------------------------------------------------------------------------------- */

cuv_xfer *cuv_xfer_new(cuv *c, const char *method, const char *url)
{
    cuv_xfer *x = calloc(1, sizeof(*x));
    if (x == NULL || (x->easy = curl_easy_init()) == NULL) {
        free(x);
        return NULL;
    }
    x->owner = c;
    x->src_fd = -1;
    x->sink_fd = -1;
    x->retry_after = -1;
    x->body_cap = CUV_DEFAULT_BODY_CAP;
    CURL *e = x->easy;
    curl_easy_setopt(e, CURLOPT_URL, url);
    curl_easy_setopt(e, CURLOPT_PRIVATE, x);
    curl_easy_setopt(e, CURLOPT_NOSIGNAL, 1L);
    curl_easy_setopt(e, CURLOPT_PROTOCOLS_STR, "http,https");
    curl_easy_setopt(e, CURLOPT_REDIR_PROTOCOLS_STR, "http,https");
    curl_easy_setopt(e, CURLOPT_HEADERFUNCTION, header_cb);
    curl_easy_setopt(e, CURLOPT_HEADERDATA, x);
    curl_easy_setopt(e, CURLOPT_WRITEFUNCTION, body_cb);
    curl_easy_setopt(e, CURLOPT_WRITEDATA, x);
    curl_easy_setopt(e, CURLOPT_USERAGENT, "dilocod/0.1.0");
    curl_easy_setopt(e, CURLOPT_CONNECTTIMEOUT_MS, CONNECT_TIMEOUT_MS);
    /* 1 byte/s would let a trickling server hold a transfer (and the poll behind it) for ever */
    curl_easy_setopt(e, CURLOPT_LOW_SPEED_LIMIT, LOW_SPEED_BYTES);
    curl_easy_setopt(e, CURLOPT_LOW_SPEED_TIME, LOW_SPEED_SECONDS);
    /* credentials go to the URL's own scheme, host and port only, never along a redirect */
    curl_easy_setopt(e, CURLOPT_UNRESTRICTED_AUTH, 0L);
    curl_easy_setopt(e, CURLOPT_MAXREDIRS, 5L);
    if (strcmp(method, "HEAD") == 0)
        curl_easy_setopt(e, CURLOPT_NOBODY, 1L);
    else if (strcmp(method, "POST") == 0)
        curl_easy_setopt(e, CURLOPT_POST, 1L);
    else if (strcmp(method, "PUT") == 0)
        curl_easy_setopt(e, CURLOPT_UPLOAD, 1L);
    return x;
}

void cuv_xfer_header(cuv_xfer *x, const char *line)
{
    struct curl_slist *n = curl_slist_append(x->headers, line);
    if (n != NULL)
        x->headers = n;
}

void cuv_xfer_bearer(cuv_xfer *x, const char *token)
{
    if (token == NULL || token[0] == '\0')
        return;
    /* libcurl (>= 7.83) sends HTTP auth only to the original scheme, host and port unless
     * CURLOPT_UNRESTRICTED_AUTH is set (it is off, see cuv_xfer_new): a resolve's 302 to the LFS CDN
     * carries no token */
    curl_easy_setopt(x->easy, CURLOPT_HTTPAUTH, (long)CURLAUTH_BEARER);
    curl_easy_setopt(x->easy, CURLOPT_XOAUTH2_BEARER, token);
}

void cuv_xfer_follow(cuv_xfer *x, int on)
{
    curl_easy_setopt(x->easy, CURLOPT_FOLLOWLOCATION, on ? 1L : 0L);
}

int cuv_xfer_body(cuv_xfer *x, const void *data, size_t len)
{
    x->send = malloc(len ? len : 1);
    if (x->send == NULL)
        return -1;
    memcpy(x->send, data, len);
    x->send_len = len;
    curl_easy_setopt(x->easy, CURLOPT_READFUNCTION, read_cb);
    curl_easy_setopt(x->easy, CURLOPT_READDATA, x);
    curl_easy_setopt(x->easy, CURLOPT_POSTFIELDSIZE_LARGE, (curl_off_t)len);
    curl_easy_setopt(x->easy, CURLOPT_INFILESIZE_LARGE, (curl_off_t)len);
    return 0;
}

void cuv_xfer_body_file(cuv_xfer *x, uv_file fd, uint64_t off, uint64_t len)
{
    x->src_fd = fd;
    x->src_off = off;
    x->src_left = len;
    x->rbuf = malloc(IO_BUF);   /* lint-errors: allow alloc: a NULL buffer makes cuv_start refuse the transfer */
    curl_easy_setopt(x->easy, CURLOPT_READFUNCTION, read_cb);
    curl_easy_setopt(x->easy, CURLOPT_READDATA, x);
    curl_easy_setopt(x->easy, CURLOPT_INFILESIZE_LARGE, (curl_off_t)len);
    curl_easy_setopt(x->easy, CURLOPT_POSTFIELDSIZE_LARGE, (curl_off_t)len);
}

void cuv_xfer_sink_file(cuv_xfer *x, uv_file fd, uint64_t off)
{
    x->sink_fd = fd;
    x->sink_off = off;
    (void)wbuf_init(&x->buf, SINK_BUF);    /* a failure leaves NULL buffers: cuv_start refuses them */
}

void cuv_xfer_body_cap(cuv_xfer *x, size_t cap)
{
    x->body_cap = cap;
}

void cuv_xfer_sink_max(cuv_xfer *x, uint64_t max)
{
    x->sink_max = max;
    x->sink_capped = 1;
}

int cuv_start(cuv_xfer *x, cuv_done_cb cb, void *arg)
{
    if ((x->src_fd >= 0 && x->rbuf == NULL) || (x->sink_fd >= 0 && x->buf.fill == NULL))
        return -1;
    x->cb = cb;
    x->arg = arg;
    x->sink_end = x->sink_off;
    if (x->sink_fd >= 0 && x->sink_capped) {
        /* refused at the headers when the answer announces more than the file may still take */
        uint64_t left = x->sink_max > x->sink_off ? x->sink_max - x->sink_off : 0;
        if (left < MAXFILESIZE_FLOOR)
            left = MAXFILESIZE_FLOOR;
        if (left > (uint64_t)INT64_MAX)
            left = (uint64_t)INT64_MAX;
        curl_easy_setopt(x->easy, CURLOPT_MAXFILESIZE_LARGE, (curl_off_t)left);
    }
    if (x->sink_fd < 0 && x->src_fd < 0)
        curl_easy_setopt(x->easy, CURLOPT_TIMEOUT_MS, MEMORY_TRANSFER_TIMEOUT_MS);
    if (x->headers != NULL)
        curl_easy_setopt(x->easy, CURLOPT_HTTPHEADER, x->headers);
    if (x->owner->closing || curl_multi_add_handle(x->owner->multi, x->easy) != CURLM_OK)
        return -1;
    return 0;
}

void cuv_xfer_free(cuv_xfer *x)
{
    if (x == NULL)
        return;
    curl_easy_cleanup(x->easy);
    curl_slist_free_all(x->headers);
    free(x->body.p);
    free(x->send);
    free(x->rbuf);
    wbuf_free(&x->buf);
    free(x);
}

/* The transfer and its last disk write are complete. */
static void finish(cuv_xfer *x)
{
    if (x->io_error != 0 && x->result == CURLE_OK)
        x->result = CURLE_WRITE_ERROR;
    if (x->result == CURLE_FILESIZE_EXCEEDED)
        x->too_big = 1;
    x->cb(x, x->arg);
}

static void check_done(cuv *c)
{
    CURLMsg *m;
    int left;

    while ((m = curl_multi_info_read(c->multi, &left)) != NULL) {
        if (m->msg != CURLMSG_DONE)
            continue;
        cuv_xfer *x = NULL;
        curl_easy_getinfo(m->easy_handle, CURLINFO_PRIVATE, (char **)&x);
        x->result = m->data.result;
        curl_easy_getinfo(x->easy, CURLINFO_RESPONSE_CODE, &x->status);
        curl_multi_remove_handle(c->multi, x->easy);
        x->finished = 1;
        if (x->reading)
            continue;           /* cannot happen once done, but never free a buffer in use */
        if (x->sink_fd >= 0 && x->io_error == 0 && x->buf.fill_len > 0 && !x->writing)
            start_write(x);
        if (!x->writing)
            finish(x);
    }
}

void cuv_close(cuv *c, void (*done)(void *), void *arg)
{
    c->closing = 1;
    c->done = done;
    c->done_arg = arg;
    /* stop watching every socket first, then let curl close its cached connections */
    while (c->socks != NULL) {
        sock_ctx *s = c->socks;
        sock_unlink(c, s);
        uv_poll_stop(&s->poll);
        uv_close((uv_handle_t *)&s->poll, handle_closed);
    }
    curl_multi_setopt(c->multi, CURLMOPT_SOCKETFUNCTION, NULL);
    curl_multi_setopt(c->multi, CURLMOPT_TIMERFUNCTION, NULL);
    curl_multi_cleanup(c->multi);
    c->multi = NULL;
    uv_timer_stop(&c->timer);
    uv_close((uv_handle_t *)&c->timer, handle_closed);
}

void cuv_xfer_cancel(cuv_xfer *x)
{
    if (x->finished)
        return;
    curl_multi_remove_handle(x->owner->multi, x->easy);
    x->finished = 1;
    x->result = CURLE_ABORTED_BY_CALLBACK;
    if (!x->writing && !x->reading)
        finish(x);
    /* else the pending file operation's callback finishes it */
}
