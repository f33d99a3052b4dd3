/* remote.c and remote_fetch.c against a fake transport: a tiny HTTP server on the test's own uv loop
 * (real sockets, real libcurl through curl_uv), answering each request from a script. */
#include "test.h"

#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <uv.h>

#include "curl_uv.h"
#include "remote.h"
#include "remote_fetch.h"

/* ---- the fake server ----------------------------------------------------------------------------- */

typedef struct fake_answer {
    int status;
    char headers[256];          /* extra header lines, each ending in \r\n */
    const char *body;
    size_t len;
    int hold;                   /* no answer: the connection stays open until the server closes */
} fake_answer;

typedef struct fake_srv fake_srv;
typedef void (*fake_fn)(fake_srv *s, const char *path, long long range_from, fake_answer *a);

typedef struct fake_conn {
    uv_tcp_t tcp;
    fake_srv *s;
    char in[8192];
    size_t len;
    int answered;
    char *out;
    uv_write_t w;
    struct fake_conn *next;
} fake_conn;

struct fake_srv {
    uv_tcp_t tcp;
    int port;
    fake_fn fn;
    void *arg;
    int nreq;
    long long last_range;       /* the last request's Range start, -1: none */
    fake_conn *conns;
};

static void conn_closed(uv_handle_t *h)
{
    fake_conn *c = h->data;
    fake_srv *s = c->s;

    for (fake_conn **p = &s->conns; *p; p = &(*p)->next)
        if (*p == c) {
            *p = c->next;
            break;
        }
    free(c->out);
    free(c);
}

static void conn_close(fake_conn *c)
{
    if (!uv_is_closing((uv_handle_t *)&c->tcp))
        uv_close((uv_handle_t *)&c->tcp, conn_closed);
}

static void written(uv_write_t *w, int status)
{
    (void)status;
    conn_close(w->data);
}

static void conn_alloc(uv_handle_t *h, size_t hint, uv_buf_t *buf)
{
    fake_conn *c = h->data;
    (void)hint;
    *buf = uv_buf_init(c->in + c->len, (unsigned)(sizeof(c->in) - 1 - c->len));
}

static void answer(fake_conn *c)
{
    fake_srv *s = c->s;
    fake_answer a = {.status = 200};
    char path[512] = "";
    long long from = -1;
    const char *range;

    sscanf(c->in, "%*s %511s", path);
    if ((range = strcasestr(c->in, "\r\nRange: bytes=")) != NULL)
        from = strtoll(range + strlen("\r\nRange: bytes="), NULL, 10);
    s->nreq++;
    s->last_range = from;
    s->fn(s, path, from, &a);
    if (a.hold)
        return;
    size_t cap = a.len + 512;
    c->out = malloc(cap);
    int n = snprintf(c->out, cap, "HTTP/1.1 %d X\r\n%sContent-Length: %zu\r\nConnection: close\r\n\r\n", a.status,
                     a.headers, a.len);
    memcpy(c->out + n, a.body, a.len);
    uv_buf_t buf = uv_buf_init(c->out, (unsigned)(n + (int)a.len));
    c->w.data = c;
    uv_write(&c->w, (uv_stream_t *)&c->tcp, &buf, 1, written);
}

static void conn_read(uv_stream_t *st, ssize_t n, const uv_buf_t *buf)
{
    fake_conn *c = st->data;
    (void)buf;

    if (n < 0) {
        conn_close(c);
        return;
    }
    c->len += (size_t)n;
    c->in[c->len] = '\0';
    if (!c->answered && strstr(c->in, "\r\n\r\n") != NULL) {
        c->answered = 1;
        answer(c);
    }
}

static void on_connection(uv_stream_t *server, int status)
{
    fake_srv *s = server->data;
    fake_conn *c = calloc(1, sizeof(*c));

    if (status != 0 || c == NULL) {
        free(c);
        return;
    }
    c->s = s;
    uv_tcp_init(server->loop, &c->tcp);
    c->tcp.data = c;
    c->next = s->conns;
    s->conns = c;
    if (uv_accept(server, (uv_stream_t *)&c->tcp) == 0)
        uv_read_start((uv_stream_t *)&c->tcp, conn_alloc, conn_read);
    else
        conn_close(c);
}

static int srv_start(fake_srv *s, uv_loop_t *loop, fake_fn fn, void *arg)
{
    struct sockaddr_in addr;
    struct sockaddr_storage got;
    int len = sizeof(got);

    memset(s, 0, sizeof(*s));
    s->fn = fn;
    s->arg = arg;
    uv_tcp_init(loop, &s->tcp);
    s->tcp.data = s;
    uv_ip4_addr("127.0.0.1", 0, &addr);
    if (uv_tcp_bind(&s->tcp, (const struct sockaddr *)&addr, 0) != 0 ||
        uv_listen((uv_stream_t *)&s->tcp, 16, on_connection) != 0 ||
        uv_tcp_getsockname(&s->tcp, (struct sockaddr *)&got, &len) != 0)
        return -1;
    s->port = ntohs(((struct sockaddr_in *)&got)->sin_port);
    return 0;
}

static void srv_stop(fake_srv *s)
{
    for (fake_conn *c = s->conns; c; c = c->next)
        conn_close(c);
    if (!uv_is_closing((uv_handle_t *)&s->tcp))
        uv_close((uv_handle_t *)&s->tcp, NULL);
}

/* ---- a fake transport ---------------------------------------------------------------------------- */

static int fake_authorize(remote *rm, remote_req *r, cuv_xfer *x)
{
    (void)rm;
    (void)r;
    (void)x;
    return 0;
}

static void fake_describe(const cuv_xfer *x, char *out, size_t size)
{
    snprintf(out, size, "HTTP %ld", x->status);
}

static void fake_complete(remote *rm, remote_req *r, int ok)
{
    (void)rm;
    (void)r;
    (void)ok;               /* every request here ends through remote_go_done */
}

static const remote_ops fake_req_ops = {
    .failure_log = "fake request failed",
    .authorize = fake_authorize,
    .describe = fake_describe,
    .complete = fake_complete,
};

static void nothing(void *arg)
{
    (void)arg;
}

/* ---- the retrying request ------------------------------------------------------------------------ */

typedef struct req_test {
    uv_loop_t loop;
    fake_srv srv;
    cuv *curl;
    remote rm;
    hub_status st;
    int closing;
    int calls;                  /* answers the server gave so far */
    int ends, ok;
    long status;
    uint64_t started, ended;    /* loop ms */
    const char *script;         /* one status per request: "503 200", "429 200", "404" */
} req_test;

/* Answers the nth request with the script's nth status; 429 says Retry-After: 1. */
static void scripted(fake_srv *s, const char *path, long long from, fake_answer *a)
{
    req_test *t = s->arg;
    const char *p = t->script;
    (void)path;
    (void)from;

    for (int i = 0; i < t->calls && p != NULL; i++)
        p = strchr(p, ' ') ? strchr(p, ' ') + 1 : NULL;
    t->calls++;
    a->status = p != NULL ? atoi(p) : 500;
    if (a->status == 429)
        snprintf(a->headers, sizeof(a->headers), "Retry-After: 1\r\n");
    a->body = "{}";
    a->len = 2;
}

static void req_ended(remote_req *r, int ok)
{
    req_test *t = r->arg;

    t->ends++;
    t->ok = ok;
    t->status = r->x != NULL ? r->x->status : 0;
    t->ended = uv_now(&t->loop);
    remote_req_end(r);
    srv_stop(&t->srv);
    cuv_close(t->curl, nothing, NULL);
}

static void run_request(req_test *t, const char *script)
{
    char url[128];

    t->script = script;
    CHECK_EQ(uv_loop_init(&t->loop), 0);
    CHECK_EQ(srv_start(&t->srv, &t->loop, scripted, t), 0);
    CHECK((t->curl = cuv_new(&t->loop)) != NULL);
    remote_init(&t->rm, &t->loop, t->curl, &t->st, &fake_req_ops, t, &t->closing);
    snprintf(url, sizeof(url), "http://127.0.0.1:%d/x", t->srv.port);
    remote_req *r = remote_req_new(&t->rm, "GET", url, NULL, "test");
    CHECK(r != NULL);
    t->started = uv_now(&t->loop);
    remote_go_done(r, req_ended, t);
    CHECK_EQ(uv_run(&t->loop, UV_RUN_DEFAULT), 0);
    CHECK_EQ(uv_loop_close(&t->loop), 0);
}

TEST(remote_retries_503_then_200)
{
    req_test t = {0};

    run_request(&t, "503 200");
    CHECK_EQ(t.ends, 1);
    CHECK_EQ(t.ok, 1);
    CHECK_EQ(t.status, 200);
    CHECK_EQ(t.calls, 2);
    CHECK_EQ(t.st.errors, 1u);                          /* the 503, recorded */
    CHECK(strstr(t.st.last_error, "HTTP 503") != NULL);
    CHECK_INT(t.ended - t.started, <, 1000);            /* a jittered 0.5 s backoff, not a Retry-After */
}

TEST(remote_retries_429_after_retry_after)
{
    req_test t = {0};

    run_request(&t, "429 200");
    CHECK_EQ(t.ok, 1);
    CHECK_EQ(t.calls, 2);
    CHECK_INT(t.ended - t.started, >=, 1000);           /* the server's Retry-After: 1 */
}

TEST(remote_does_not_retry_404)
{
    req_test t = {0};

    run_request(&t, "404 200");
    CHECK_EQ(t.ends, 1);
    CHECK_EQ(t.ok, 0);
    CHECK_EQ(t.status, 404);
    CHECK_EQ(t.calls, 1);
}

/* ---- the fetch pipeline -------------------------------------------------------------------------- */

#define CONTENT_LEN 100000

typedef struct fetch_test {
    uv_loop_t loop;
    fake_srv srv;
    cuv *curl;
    remote_fetch f;
    hub_status st;
    char content[CONTENT_LEN];  /* the object the server holds */
    int corrupt;                /* the server sends other bytes of the same length */
    int hold;                   /* the server never answers */
    char delivered[CONTENT_LEN];
    int deltas, idles;
    int req_ends, job_ends, timer_closes;
    int ends_at_idle;           /* req_ends + job_ends + timer_closes when idle ran */
    uv_timer_t timer;
} fetch_test;

static void object(fake_srv *s, const char *path, long long from, fake_answer *a)
{
    fetch_test *t = s->arg;
    static char bad[CONTENT_LEN];
    (void)path;

    if (t->hold) {
        a->hold = 1;
        return;
    }
    memset(bad, 'x', sizeof(bad));
    const char *src = t->corrupt ? bad : t->content;
    if (from > 0 && from < CONTENT_LEN) {
        a->status = 206;
        snprintf(a->headers, sizeof(a->headers), "Content-Range: bytes %lld-%d/%d\r\n", from, CONTENT_LEN - 1,
                 CONTENT_LEN);
        a->body = src + from;
        a->len = (size_t)(CONTENT_LEN - from);
    } else {
        a->body = src;
        a->len = CONTENT_LEN;
    }
}

static remote_req *fake_get(remote_fetch *f, const remote_cand *c, const char *route)
{
    fetch_test *t = f->owner;
    char url[256];

    snprintf(url, sizeof(url), "http://127.0.0.1:%d%s", t->srv.port, c->key);
    return remote_req_new(&f->rm, "GET", url, c->key, route);
}

static char *fake_part_path(remote_fetch *f, const remote_cand *c)
{
    char *p = NULL;
    (void)c;
    return asprintf(&p, "%s/delta.part", f->state_dir) < 0 ? NULL : p;
}

/* The MD5 of the content against the tag, as s3:// checks a single-part ETag. */
static int fake_verify(const remote_cand *c, int fd, char *why, size_t size)
{
    char hex[33];

    if (remote_hash_fd(fd, REMOTE_MD5, NULL, 0, hex, sizeof(hex)) != 0 || strcmp(hex, c->tag) != 0) {
        snprintf(why, size, "MD5 %s, the listing says %s", hex, c->tag);
        return -1;
    }
    return 0;
}

static void curl_closed(void *arg)
{
    fetch_test *t = arg;

    remote_fetch_free(&t->f);
    srv_stop(&t->srv);
}

static void fake_idle(remote_fetch *f)
{
    fetch_test *t = f->owner;

    t->idles++;
    t->ends_at_idle = t->req_ends + t->job_ends + t->timer_closes;
    cuv_close(t->curl, curl_closed, t);
}

static const remote_fetch_ops fake_fetch_ops = {
    .name_field = "key",
    .downloaded_log = "fake object downloaded",
    .set_prefix = "fake-",
    .get = fake_get,
    .part_path = fake_part_path,
    .verify_file = fake_verify,
    .idle = fake_idle,
};

static void delta_ready(void *app, const hub_delta *d)
{
    fetch_test *t = app;
    int fd = open(d->path, O_RDONLY);

    t->deltas++;
    if (fd >= 0) {
        if (read(fd, t->delivered, sizeof(t->delivered)) != (ssize_t)sizeof(t->delivered))
            t->delivered[0] = '\0';
        close(fd);
    }
    remote_fetch_close(&t->f);
}

static void published_seen(void *app, int64_t step)
{
    (void)app;
    (void)step;
}

static void global_ready(void *app, uint64_t step, const char *path)
{
    (void)app;
    (void)step;
    (void)path;
}

static void publish_done(void *app, uint64_t step, const char *error)
{
    (void)app;
    (void)step;
    (void)error;
}

static const hub_callbacks fake_cb = {delta_ready, published_seen, global_ready, publish_done};

static int fetch_setup(fetch_test *t)
{
    char seen[512];

    for (int i = 0; i < CONTENT_LEN; i++)
        t->content[i] = (char)(i * 7 + i / 251);
    if (uv_loop_init(&t->loop) != 0 || srv_start(&t->srv, &t->loop, object, t) != 0 ||
        (t->curl = cuv_new(&t->loop)) == NULL)
        return -1;
    snprintf(seen, sizeof(seen), "%s", test_path("seen.tsv"));
    remote_fetch_init(&t->f, &(remote_fetch_config){.loop = &t->loop, .curl = t->curl, .st = &t->st,
                                                    .req_ops = &fake_req_ops, .ops = &fake_fetch_ops, .owner = t,
                                                    .cb = &fake_cb, .app = t, .state_dir = test_dir(),
                                                    .seen_path = seen, .poll_interval = 1, .max_downloads = 2,
                                                    .max_header = 1 << 20});
    return 0;
}

/* A candidate of the content, to be downloaded straight away (its header taken as looked at). */
static remote_cand *content_candidate(fetch_test *t)
{
    char md5[33];
    remote_cand *c;

    if (remote_hash_mem(t->content, CONTENT_LEN, REMOTE_MD5, NULL, 0, md5, sizeof(md5)) != 0 ||
        (c = remote_cand_new("nodes/a/delta_1.safetensors", "/nodes/a/delta_1.safetensors", md5, CONTENT_LEN)) == NULL)
        return NULL;
    c->peeked = 1;
    return c;
}

static int write_part(const char *data, size_t len)
{
    int fd = open(test_path("delta.part"), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    int ok = fd >= 0 && write(fd, data, len) == (ssize_t)len;

    if (fd >= 0)
        close(fd);
    return ok ? 0 : -1;
}

TEST(remote_fetch_resumes_a_ranged_download)
{
    fetch_test *t = calloc(1, sizeof(*t));
    remote_cand *c;

    CHECK(t != NULL);
    CHECK_EQ(fetch_setup(t), 0);
    CHECK_EQ(write_part(t->content, 40000), 0);         /* what an earlier attempt got */
    CHECK((c = content_candidate(t)) != NULL);
    remote_fetch_enqueue(&t->f, c);
    remote_fetch_pump(&t->f);
    CHECK_EQ(uv_run(&t->loop, UV_RUN_DEFAULT), 0);
    CHECK_EQ(uv_loop_close(&t->loop), 0);
    CHECK_EQ(t->srv.nreq, 1);
    CHECK_EQ(t->srv.last_range, 40000);                 /* only the rest was asked for */
    CHECK_EQ(t->deltas, 1);
    CHECK(memcmp(t->delivered, t->content, CONTENT_LEN) == 0);
    CHECK_EQ(t->st.downloads, 1u);
    CHECK_EQ(t->st.download_bytes, (uint64_t)CONTENT_LEN);
    CHECK_EQ(t->idles, 1);
    free(t);
}

static void wait_for_retry(uv_timer_t *timer)
{
    fetch_test *t = timer->data;

    if (t->f.retry == NULL)
        return;                 /* the verify is still on the pool */
    uv_close((uv_handle_t *)timer, NULL);
    remote_fetch_close(&t->f);
}

TEST(remote_fetch_verify_failure_discards_and_retries_later)
{
    fetch_test *t = calloc(1, sizeof(*t));
    remote_cand *c;
    struct stat sb;

    CHECK(t != NULL);
    CHECK_EQ(fetch_setup(t), 0);
    t->corrupt = 1;
    CHECK((c = content_candidate(t)) != NULL);
    remote_fetch_enqueue(&t->f, c);
    remote_fetch_pump(&t->f);
    uv_timer_init(&t->loop, &t->timer);
    t->timer.data = t;
    uv_timer_start(&t->timer, wait_for_retry, 10, 10);
    /* what the retry list holds is checked before the close frees it */
    while (t->f.retry == NULL && uv_run(&t->loop, UV_RUN_ONCE) != 0)
        ;
    CHECK(t->f.retry != NULL);
    CHECK_EQ(t->f.retry->attempts, 1);
    CHECK_INT(t->f.retry->not_before, >, uv_now(&t->loop));    /* it waits before the next attempt */
    CHECK_EQ(t->deltas, 0);
    CHECK_EQ(t->st.downloads, 0u);
    CHECK(strstr(t->st.last_error, "MD5") != NULL);
    CHECK(stat(test_path("delta.part"), &sb) != 0);             /* the bad download is gone */
    CHECK_EQ(uv_run(&t->loop, UV_RUN_DEFAULT), 0);
    CHECK_EQ(uv_loop_close(&t->loop), 0);
    CHECK_EQ(t->idles, 1);
    free(t);
}

/* ---- close while busy ---------------------------------------------------------------------------- */

static void held_req_ended(remote_req *r, int ok)
{
    fetch_test *t = r->arg;

    t->req_ends += 1 + (ok ? 100 : 0);                 /* a cancelled request ends failed */
    remote_req_end(r);
}

static void slow_work(pool_job *j)
{
    (void)j;
    usleep(200 * 1000);
}

static void slow_done(pool_job *j)
{
    fetch_test *t = j->arg;

    t->job_ends++;
}

static void timer_closed(uv_handle_t *h)
{
    fetch_test *t = h->data;

    t->timer_closes++;
    remote_fetch_release(&t->f);
}

/* The server has the request: close now, with it, the pool job and the timer in flight. */
static void close_busy(uv_timer_t *timer)
{
    fetch_test *t = timer->data;

    if (t->srv.nreq == 0)
        return;
    uv_timer_stop(timer);
    uv_close((uv_handle_t *)timer, timer_closed);
    remote_fetch_close(&t->f);
    remote_fetch_close(&t->f);                          /* a second close changes nothing */
}

TEST(remote_fetch_close_waits_for_everything_in_flight)
{
    fetch_test *t = calloc(1, sizeof(*t));
    char url[128];

    CHECK(t != NULL);
    CHECK_EQ(fetch_setup(t), 0);
    t->hold = 1;
    snprintf(url, sizeof(url), "http://127.0.0.1:%d/slow", t->srv.port);
    remote_req *r = remote_req_new(&t->f.rm, "GET", url, NULL, "test");
    CHECK(r != NULL);
    remote_go_done(r, held_req_ended, t);
    CHECK_EQ(remote_fetch_job(&t->f, slow_work, slow_done, t), 0);
    uv_timer_init(&t->loop, &t->timer);
    t->timer.data = t;
    remote_fetch_hold(&t->f);                           /* the timer's, until its close callback */
    uv_timer_start(&t->timer, close_busy, 5, 5);
    CHECK_EQ(uv_run(&t->loop, UV_RUN_DEFAULT), 0);
    CHECK_EQ(uv_loop_close(&t->loop), 0);
    CHECK_EQ(t->idles, 1);
    CHECK_EQ(t->req_ends, 1);
    CHECK_EQ(t->job_ends, 1);
    CHECK_EQ(t->timer_closes, 1);
    CHECK_EQ(t->ends_at_idle, 3);                       /* idle came after all three */
    free(t);
}

/* ---- the seen list's say on a listed version ----------------------------------------------------- */

static void close_at_once(uv_timer_t *timer)
{
    fetch_test *t = timer->data;

    uv_close((uv_handle_t *)timer, NULL);
    remote_fetch_close(&t->f);
}

TEST(remote_fetch_takes_a_listed_version_once)
{
    fetch_test *t = calloc(1, sizeof(*t));
    int is_new = 0;

    CHECK(t != NULL);
    CHECK_EQ(fetch_setup(t), 0);
    CHECK_EQ(remote_fetch_wanted(&t->f, "nodes/a/delta_1.safetensors", "v1", &is_new), 1);
    CHECK_EQ(is_new, 1);
    CHECK_EQ(remote_fetch_pending(&t->f, "nodes/a/delta_1.safetensors", "v1"), 0);
    CHECK_EQ(remote_fetch_wanted(&t->f, "nodes/a/delta_1.safetensors", "v1", &is_new), 0);     /* in flight */
    /* a later round's delta is looked at again, and is not new */
    remote_seen_set(&t->f.seen, "nodes/a/delta_1.safetensors", "v1", SEEN_INCOMPLETE);
    CHECK_EQ(remote_fetch_wanted(&t->f, "nodes/a/delta_1.safetensors", "v1", &is_new), 1);
    CHECK_EQ(is_new, 0);
    /* given up for this run: not again */
    remote_seen_set(&t->f.seen, "nodes/a/delta_1.safetensors", "v1", SEEN_REJECTED);
    CHECK_EQ(remote_fetch_wanted(&t->f, "nodes/a/delta_1.safetensors", "v1", &is_new), 0);
    /* another version is */
    CHECK_EQ(remote_fetch_wanted(&t->f, "nodes/a/delta_1.safetensors", "v2", &is_new), 1);
    uv_timer_init(&t->loop, &t->timer);
    t->timer.data = t;
    uv_timer_start(&t->timer, close_at_once, 0, 0);
    CHECK_EQ(uv_run(&t->loop, UV_RUN_DEFAULT), 0);
    CHECK_EQ(uv_loop_close(&t->loop), 0);
    CHECK_EQ(t->idles, 1);
    free(t);
}
