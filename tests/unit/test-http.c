#include "test.h"

#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <poll.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <unistd.h>

#include "http.h"
#include "strbuf.h"

/* A tiny application: GET answers with the path; PUT counts the body and answers with its size. */
typedef struct app {
    int requests;
    uint64_t body_bytes;
    int stop_reading;           /* the body consumer asks for backpressure */
} app;

static sbuf out;

static void capture(const char *p, size_t n, void *arg)
{
    (void)arg;
    sb_add(&out, p, n);
}

static int body_data(http_conn *c, const char *p, size_t n, void *ctx)
{
    app *a = ctx;
    (void)c;
    (void)p;
    a->body_bytes += n;
    return a->stop_reading ? 1 : 0;
}

static void body_end(http_conn *c, void *ctx)
{
    app *a = ctx;
    char msg[64];
    snprintf(msg, sizeof(msg), "got %llu", (unsigned long long)a->body_bytes);
    http_respond(c, 201, "text/plain", NULL, msg, strlen(msg));
}

static void body_abort(http_conn *c, void *ctx)
{
    (void)c;
    ((app *)ctx)->body_bytes = (uint64_t)-1;
}

static const http_body_ops ops = {body_data, body_end, body_abort};

static void on_request(http_conn *c, http_request *req, void *arg)
{
    app *a = arg;
    a->requests++;
    if (strcmp(req->method_name, "PUT") == 0) {
        a->body_bytes = 0;
        http_accept_body(c, &ops, a);
        return;
    }
    http_respond(c, 200, "text/plain", NULL, req->path, strlen(req->path));
}

static const http_limits limits = {.max_url = 64, .max_header_bytes = 256, .max_headers = 4, .header_timeout = 10,
                                   .idle_timeout = 10, .max_conns = 8};

static http_conn *setup(uv_loop_t *loop, http_server **s, app *a)
{
    memset(a, 0, sizeof(*a));
    free(out.p);
    memset(&out, 0, sizeof(out));
    uv_loop_init(loop);
    http_server_fake(s, loop, &limits, on_request, a);
    return http_conn_fake(*s, capture, NULL);
}

static void teardown(uv_loop_t *loop, http_server *s, http_conn *c)
{
    http_conn_fake_eof(c);
    http_server_stop(s, NULL);
    uv_run(loop, UV_RUN_DEFAULT);
    uv_loop_close(loop);
}

static int count_of(const char *hay, const char *needle)
{
    int n = 0;
    for (const char *p = hay; (p = strstr(p, needle)) != NULL; p++)
        n++;
    return n;
}

TEST(http_pipelined_requests_answered_in_order)
{
    uv_loop_t loop;
    http_server *s;
    app a;
    http_conn *c = setup(&loop, &s, &a);
    const char req[] = "GET /a HTTP/1.1\r\n\r\nGET /bb HTTP/1.1\r\n\r\nGET /ccc?x=1 HTTP/1.1\r\n\r\n";
    CHECK_EQ(http_conn_feed(c, req, sizeof(req) - 1), 0);
    sb_add(&out, "", 1);
    CHECK_EQ(a.requests, 3);
    const char *p1 = strstr(out.p, "\r\n\r\n/a"), *p2 = strstr(out.p, "\r\n\r\n/bb"), *p3 = strstr(out.p, "\r\n\r\n/ccc");
    CHECK(p1 && p2 && p3 && p1 < p2 && p2 < p3);
    CHECK_EQ(count_of(out.p, "HTTP/1.1 200 OK"), 3);
    teardown(&loop, s, c);
}

TEST(http_body_content_length_and_chunked)
{
    uv_loop_t loop;
    http_server *s;
    app a;
    http_conn *c = setup(&loop, &s, &a);
    const char req[] = "PUT /u HTTP/1.1\r\nContent-Length: 10\r\n\r\n0123456789"
                       "PUT /u HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n4\r\ndefg\r\n0\r\n\r\n";
    /* fed one byte at a time: the parser must keep its state across reads */
    for (size_t i = 0; i < sizeof(req) - 1; i++)
        CHECK_EQ(http_conn_feed(c, req + i, 1), 0);
    sb_add(&out, "", 1);
    CHECK(strstr(out.p, "got 10") != NULL);
    CHECK(strstr(out.p, "got 7") != NULL);
    CHECK_EQ(count_of(out.p, "HTTP/1.1 201 Created"), 2);
    teardown(&loop, s, c);
}

TEST(http_limits_431_414_and_bad_requests)
{
    uv_loop_t loop;
    http_server *s;
    app a;
    http_conn *c = setup(&loop, &s, &a);
    const char many[] = "GET / HTTP/1.1\r\nA: 1\r\nB: 2\r\nC: 3\r\nD: 4\r\nE: 5\r\n\r\n";
    CHECK_EQ(http_conn_feed(c, many, sizeof(many) - 1), -1);     /* answered, then closed */
    sb_add(&out, "", 1);
    CHECK(strstr(out.p, "HTTP/1.1 431") != NULL);
    CHECK(strstr(out.p, "Connection: close") != NULL);
    CHECK_EQ(a.requests, 0);
    teardown(&loop, s, c);

    c = setup(&loop, &s, &a);
    char longurl[200];
    snprintf(longurl, sizeof(longurl), "GET /%0100d HTTP/1.1\r\n\r\n", 0);
    CHECK_EQ(http_conn_feed(c, longurl, strlen(longurl)), -1);
    sb_add(&out, "", 1);
    CHECK(strstr(out.p, "HTTP/1.1 414") != NULL);
    teardown(&loop, s, c);

    c = setup(&loop, &s, &a);
    CHECK_EQ(http_conn_feed(c, "BLAH / HTTP/1.1\r\n\r\n", 19), -1);
    sb_add(&out, "", 1);
    CHECK(strstr(out.p, "HTTP/1.1 400") != NULL && strstr(out.p, "\"code\":\"bad_request\"") != NULL);
    teardown(&loop, s, c);

    c = setup(&loop, &s, &a);
    const char big[] = "GET / HTTP/1.1\r\nX: 0123456789012345678901234567890123456789012345678901234567890123456789"
                       "0123456789012345678901234567890123456789012345678901234567890123456789"
                       "0123456789012345678901234567890123456789012345678901234567890123456789"
                       "0123456789012345678901234567890123456789012345678901234567890123456789\r\n\r\n";
    CHECK_EQ(http_conn_feed(c, big, sizeof(big) - 1), -1);
    sb_add(&out, "", 1);
    CHECK(strstr(out.p, "HTTP/1.1 431") != NULL);
    teardown(&loop, s, c);
}

TEST(http_abort_reaches_the_body_consumer)
{
    uv_loop_t loop;
    http_server *s;
    app a;
    http_conn *c = setup(&loop, &s, &a);
    const char req[] = "PUT /u HTTP/1.1\r\nContent-Length: 100\r\n\r\n0123456789";
    CHECK_EQ(http_conn_feed(c, req, sizeof(req) - 1), 0);
    CHECK_EQ(a.body_bytes, 10);
    http_conn_fake_eof(c);
    CHECK(a.body_bytes == (uint64_t)-1);
    http_server_stop(s, NULL);
    uv_run(&loop, UV_RUN_DEFAULT);
    CHECK_EQ(uv_loop_close(&loop), 0);
}

TEST(http_keep_alive_and_close)
{
    uv_loop_t loop;
    http_server *s;
    app a;
    http_conn *c = setup(&loop, &s, &a);
    CHECK_EQ(http_conn_feed(c, "GET /x HTTP/1.0\r\n\r\n", 19), -1);   /* HTTP/1.0 without keep-alive */
    sb_add(&out, "", 1);
    CHECK(strstr(out.p, "Connection: close") != NULL);
    teardown(&loop, s, c);
    c = setup(&loop, &s, &a);
    CHECK_EQ(http_conn_feed(c, "GET /x HTTP/1.1\r\nConnection: close\r\n\r\nGET /y HTTP/1.1\r\n\r\n", 56), -1);
    CHECK_EQ(a.requests, 1);
    teardown(&loop, s, c);
}

/* ---- a real socket: the engine's read loop --------------------------------------------------------- */

/* Runs the loop and reads what the server sent on fd until want appears in got (or the peer closed
 * when want is NULL).  Returns 1 when it did; 0 after 500 rounds of 10 ms (a hang is a failure, not a
 * time limit on anything measured). */
static int pump_until(uv_loop_t *loop, int fd, sbuf *got, const char *want)
{
    for (int i = 0; i < 500; i++) {
        struct pollfd pfd = {.fd = fd, .events = POLLIN};
        char buf[4096];

        uv_run(loop, UV_RUN_NOWAIT);
        if (poll(&pfd, 1, 10) < 0 && errno != EINTR)
            return 0;
        ssize_t r = recv(fd, buf, sizeof(buf), MSG_DONTWAIT);
        if (r > 0) {
            sb_add(got, buf, (size_t)r);
            sb_add(got, "", 1);         /* keep it a string; the NUL is overwritten by the next bytes */
            got->len--;
        } else if (r == 0 && want == NULL) {
            return 1;
        } else if (r == 0 || (r < 0 && errno != EAGAIN && errno != EINTR)) {
            return 0;
        }
        if (want != NULL && got->p != NULL && strstr(got->p, want) != NULL)
            return 1;
    }
    return 0;
}

static int send_all(int fd, const char *p)
{
    size_t n = strlen(p);
    return send(fd, p, n, MSG_NOSIGNAL) == (ssize_t)n ? 0 : -1;
}

/* A read that comes back short ends the engine's read loop (it waits for the next poll event rather
 * than reading again for EAGAIN): a head split over two sends, a keep-alive request sent after the
 * first answer and a half-close after the last request must each still be seen. */
TEST(http_socket_reads_resume_after_a_short_read)
{
    uv_loop_t loop;
    http_server *s;
    app a;
    sbuf got = {0};
    struct sockaddr_in sa = {.sin_family = AF_INET};

    memset(&a, 0, sizeof(a));
    CHECK_EQ(uv_loop_init(&loop), 0);
    CHECK_EQ(http_server_start(&s, &loop, "127.0.0.1", 0, &limits, on_request, &a), 0);
    sa.sin_port = htons((uint16_t)http_server_port(s));
    sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    CHECK(fd >= 0);
    CHECK_EQ(connect(fd, (struct sockaddr *)&sa, sizeof(sa)), 0);

    CHECK_EQ(send_all(fd, "GET /first HTTP/1.1\r\n"), 0);
    for (int i = 0; i < 20; i++)        /* accepted, and the half head read (a short read) */
        uv_run(&loop, UV_RUN_NOWAIT);
    CHECK_EQ(a.requests, 0);
    CHECK_EQ(send_all(fd, "\r\n"), 0);
    CHECK(pump_until(&loop, fd, &got, "\r\n\r\n/first"));
    CHECK_EQ(a.requests, 1);

    CHECK_EQ(send_all(fd, "GET /second HTTP/1.1\r\n\r\n"), 0);
    CHECK(pump_until(&loop, fd, &got, "\r\n\r\n/second"));
    CHECK_EQ(a.requests, 2);

    CHECK_EQ(send_all(fd, "GET /third HTTP/1.1\r\n\r\n"), 0);
    CHECK_EQ(shutdown(fd, SHUT_WR), 0);
    CHECK(pump_until(&loop, fd, &got, NULL));      /* answered, then closed on our EOF */
    CHECK(strstr(got.p, "\r\n\r\n/third") != NULL);
    CHECK_EQ(a.requests, 3);
    CHECK_EQ((int)http_server_stats(s)->connections_open, 0);

    close(fd);
    free(got.p);
    http_server_stop(s, NULL);
    uv_run(&loop, UV_RUN_DEFAULT);
    CHECK_EQ(uv_loop_close(&loop), 0);
}
