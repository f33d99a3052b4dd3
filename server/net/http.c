/* The HTTP/1.1 engine on libuv + llhttp (http.h): the server and its connections' lifetime.  This
 * file accepts (with a backoff when descriptors run out, and the eviction of idle connections at
 * max_conns), keeps the head and idle deadlines, closes (lingering when a refused body may still be
 * arriving) and frees, and makes the fake connections the tests and the fuzzer feed.
 * http_parse.c reads and parses, http_out.c queues and writes; http_internal.h is what they share. */
#include "http_internal.h"

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <unistd.h>

#include "util.h"

#define ACCEPT_BACKOFF_MS 250           /* listener pause when accept fails for want of resources */
#define LINGER_MS 2000
#define EVICT_TRIES 16                 /* idle candidates found holding a request before a new connection is refused */

static void idle_timeout_cb(uv_timer_t *t);

void http__touch(http_conn *c)
{
    c->last_active = uv_now(c->srv->loop);
    if (!c->closing && !c->lingering)
        uv_timer_start(&c->idle_timer, idle_timeout_cb, (uint64_t)(c->srv->lim.idle_timeout * 1000), 0);
}

static void linger_timeout_cb(uv_timer_t *t)
{
    http__conn_close(container_of(t, http_conn, idle_timer));
}

/* The answer is out and the connection must close.  If the peer may still be sending a body we
 * refused, a plain close() would make the kernel reset the connection and a proxy in front would
 * report 502 instead of our answer: close our side for writing, read and discard for a bounded
 * time and amount, then close (a lingering close, as nginx and Apache do). */
void http__conn_finish(http_conn *c)
{
    if (c->closing || c->lingering)
        return;                 /* already closing, or already draining */
    if (c->fake_out || !c->head_done || c->message_done) {
        http__conn_close(c);
        return;
    }
    if (shutdown(c->fd, SHUT_WR) != 0) {
        http__conn_close(c);
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
    http__conn_update_poll(c);
}

/* ---- timers ------------------------------------------------------------------------------------ */

void http__head_timeout_cb(uv_timer_t *t)
{
    http_conn *c = container_of(t, http_conn, head_timer);
    c->srv->stats.timeouts++;
    c->close_after = 1;
    if (!c->responded)
        http_respond_error(c, 408, "request_timeout", "request head not received in time", NULL);
    else
        http__conn_close(c);
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
    http__conn_close(c);
}

/* ---- lifetime ---------------------------------------------------------------------------------- */

static void conn_free(http_conn *c)
{
    http_server *s = c->srv;

    http__request_free(&c->req);
    free(c->url.p);
    free(c->hname.p);
    free(c->hval.p);
    free(c->rbuf);
    http__out_free_all(c);
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

void http__conn_close(http_conn *c)
{
    if (c->closing)
        return;
    c->closing = 1;
    if (c->body != NULL && !c->body_done && c->head_done) {
        c->body_done = 1;
        c->body->abort(c, c->body_ctx);
    }
    if (!c->fake_out)
        http__conn_flush(c);          /* a last try for an error response already queued */
    http__out_free_all(c);
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
    http__parser_init(c);
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
        http__conn_close(victim);
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
            http__conn_close(c);      /* closes fd; the poll handle was never made */
            continue;
        }
        c->poll.data = c;
        c->has_poll = 1;
        c->handles++;
        http__touch(c);
        /* the head deadline runs from accept: a connection that never sends a byte is a slowloris too */
        uv_timer_start(&c->head_timer, http__head_timeout_cb, (uint64_t)(s->lim.header_timeout * 1000), 0);
        http__conn_update_poll(c);
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
            http__conn_close(c);
        else if (c->body != NULL && !c->body_done)
            http__conn_close(c);      /* an upload in progress is abandoned: nothing partial is kept */
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
            http__conn_process(c);
            if (READ_BUF - c->rlen == 0)
                return 0;
            continue;
        }
        memcpy(c->rbuf + c->rlen, data, n);
        c->rlen += n;
        data += n;
        len -= n;
        http__conn_process(c);
    }
    return c->closing ? -1 : 0;
}

void http_conn_fake_eof(http_conn *c)
{
    if (!c->closing)
        http__on_eof(c);
}
