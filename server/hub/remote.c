#include "remote.h"

#include <fcntl.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "dl_log.h"

void remote_init(remote *rm, uv_loop_t *loop, cuv *curl, hub_status *st, const remote_ops *ops, void *owner,
                 const int *closing)
{
    memset(rm, 0, sizeof(*rm));
    rm->loop = loop;
    rm->curl = curl;
    rm->st = st;
    rm->ops = ops;
    rm->owner = owner;
    rm->closing = closing;
}

void remote_error(remote *rm, const char *fmt, ...)
{
    char msg[sizeof(rm->st->last_error)], q[400];
    va_list ap;

    if (rm->quiet)
        return;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof(msg), fmt, ap);
    va_end(ap);
    rm->st->errors++;
    /* a failure that repeats at every poll (wrong credentials, a server down) is logged when it
     * starts or changes, not each time */
    if (strcmp(msg, rm->st->last_error) != 0)
        dl_log(DL_LOG_ERROR, "hub", rm->ops->failure_log, "error=%s", dl_log_q(q, sizeof(q), msg));
    memcpy(rm->st->last_error, msg, sizeof(msg));
}

double remote_jittered(double base)
{
    return base * (0.75 + 0.5 * ((double)rand() / RAND_MAX));
}

void remote_ref(remote_refs *r)
{
    if (r != NULL)
        r->n++;
}

void remote_unref(remote_refs *r)
{
    if (r != NULL && --r->n == 0 && r->check != NULL)
        r->check(r);
}

static void req_free(remote_req *r)
{
    remote_refs *refs = r->rm != NULL ? r->rm->refs : NULL;

    free(r->url);
    free(r->what);
    curl_slist_free_all(r->headers);
    free(r->body);
    cuv_xfer_free(r->x);
    free(r);
    remote_unref(refs);
}

remote_req *remote_req_new(remote *rm, const char *method, const char *url, const char *what, const char *route)
{
    remote_req *r = calloc(1, sizeof(*r));

    if (r == NULL)
        return NULL;
    r->url = strdup(url);
    r->what = strdup(what != NULL ? what : url);
    if (r->url == NULL || r->what == NULL) {
        req_free(r);            /* r->rm is NULL: it holds no reference yet */
        return NULL;
    }
    r->rm = rm;
    remote_ref(rm->refs);
    snprintf(r->method, sizeof(r->method), "%s", method);
    r->route = route;
    r->src_fd = r->sink_fd = -1;
    r->max_attempts = 5;
    r->auth = 1;
    r->api = 1;
    return r;
}

void remote_req_header(remote_req *r, const char *line)
{
    struct curl_slist *n = curl_slist_append(r->headers, line);
    if (n != NULL)
        r->headers = n;
}

int remote_req_body(remote_req *r, const char *data, size_t len)
{
    free(r->body);
    r->has_body = 0;
    if ((r->body = malloc(len ? len : 1)) == NULL)
        return -1;
    memcpy(r->body, data, len);
    r->body_len = len;
    r->has_body = 1;
    return 0;
}

static void unlink_req(remote_req *r)
{
    remote *rm = r->rm;

    if (r->prev)
        r->prev->next = r->next;
    else if (rm->inflight == r)
        rm->inflight = r->next;
    if (r->next)
        r->next->prev = r->prev;
    r->next = r->prev = NULL;
}

static void timer_closed(uv_handle_t *t)
{
    req_free(t->data);
}

void remote_req_end(remote_req *r)
{
    unlink_req(r);
    if (r->timer_open) {
        uv_timer_stop(&r->timer);
        uv_close((uv_handle_t *)&r->timer, timer_closed);
    } else {
        req_free(r);
    }
}

static void complete(remote_req *r, int ok)
{
    if (r->done != NULL)
        r->done(r, ok);
    else
        r->rm->ops->complete(r->rm, r, ok);
}

static void send_attempt(remote_req *r);

static void retry_cb(uv_timer_t *t)
{
    send_attempt(t->data);
}

static int transient(const cuv_xfer *x)
{
    return x->result != CURLE_OK || x->status == 408 || x->status == 429 || x->status >= 500;
}

/* A failure worth another attempt: recorded, then sent again after the server's Retry-After or a
 * backoff, unless r has had its attempts. */
static void retry_or_fail(remote_req *r, const cuv_xfer *x)
{
    remote *rm = r->rm;
    char why[256];

    r->attempt++;
    rm->ops->describe(x, why, sizeof(why));
    remote_error(rm, "%s %s: %s", r->method, r->what, why);
    if (r->attempt >= r->max_attempts) {
        complete(r, 0);
        return;
    }
    double wait = x->retry_after >= 0 ? x->retry_after + 0.1
                                      : remote_jittered(fmin(0.5 * pow(2, r->attempt - 1), REMOTE_MAX_BACKOFF));
    if (!r->timer_open) {
        uv_timer_init(rm->loop, &r->timer);
        r->timer.data = r;
        r->timer_open = 1;
    }
    uv_timer_start(&r->timer, retry_cb, (uint64_t)(wait * 1000), 0);
}

static void attempt_done(cuv_xfer *x, void *arg)
{
    remote_req *r = arg;
    remote *rm = r->rm;

    if (x->result == CURLE_ABORTED_BY_CALLBACK || *rm->closing) {
        complete(r, 0);
        return;
    }
    hub_count_call(rm->st, r->route, x->result == CURLE_OK ? (int)x->status : 0);
    if (x->too_big) {
        /* asking again gets the same oversized answer: a failure, not a transient error */
        remote_error(rm, "%s %s: the answer is larger than allowed, abandoned", r->method, r->what);
        complete(r, 0);
        return;
    }
    if (rm->ops->judge != NULL && rm->ops->judge(rm, r, x)) {
        rm->quiet = 1;          /* the transport said it in its words; the callback's generic ones would hide them */
        complete(r, 0);
        rm->quiet = 0;
        return;
    }
    if (transient(x)) {
        retry_or_fail(r, x);
        return;
    }
    /* only 2xx: a redirect that was not followed (or one past curl's limit) is not the answer asked for */
    int ok = x->status >= 200 && x->status < 300;
    if (ok && r->auth && rm->ops->authorized != NULL)
        rm->ops->authorized(rm, r);
    complete(r, ok);
}

static void send_attempt(remote_req *r)
{
    remote *rm = r->rm;
    cuv_xfer *x;

    cuv_xfer_free(r->x);
    r->x = NULL;
    if (*rm->closing || (x = cuv_xfer_new(rm->curl, r->method, r->url)) == NULL) {
        complete(r, 0);
        return;
    }
    r->x = x;
    for (struct curl_slist *l = r->headers; l; l = l->next)
        cuv_xfer_header(x, l->data);
    cuv_xfer_follow(x, r->follow);
    if (r->has_body)
        cuv_xfer_body(x, r->body, r->body_len);
    else if (r->src_fd >= 0)
        cuv_xfer_body_file(x, r->src_fd, r->src_off, r->src_len);
    else if (strcmp(r->method, "POST") == 0)
        cuv_xfer_body(x, "", 0);
    if (r->sink_fd >= 0)
        cuv_xfer_sink_file(x, r->sink_fd, r->sink_off);
    if (r->sink_capped)
        cuv_xfer_sink_max(x, r->sink_max);
    size_t cap = r->body_cap ? r->body_cap : rm->body_cap;
    if (cap > 0)
        cuv_xfer_body_cap(x, cap);
    if (rm->ops->authorize(rm, r, x) != 0) {
        complete(r, 0);
        return;
    }
    if (r->api)
        rm->st->api_calls++;
    else
        rm->st->resolver_calls++;
    if (cuv_start(x, attempt_done, r) != 0)
        complete(r, 0);
}

void remote_go(remote_req *r, remote_fn cb, void *arg)
{
    remote *rm = r->rm;

    r->cb = cb;
    r->arg = arg;
    r->next = rm->inflight;
    if (rm->inflight)
        rm->inflight->prev = r;
    rm->inflight = r;
    send_attempt(r);
}

void remote_go_done(remote_req *r, void (*done)(remote_req *r, int ok), void *arg)
{
    r->done = done;
    remote_go(r, NULL, arg);
}

void remote_cancel_all(remote *rm)
{
    for (remote_req *r = rm->inflight, *n; r; r = n) {
        n = r->next;
        if (r->timer_open)
            uv_timer_stop(&r->timer);
        if (r->x != NULL && !r->x->finished)
            cuv_xfer_cancel(r->x);      /* its callback ends the request */
        else
            complete(r, 0);
    }
}

/* ---- the seen list ------------------------------------------------------------------------------ */

void remote_seen_open(remote_seen *s, uv_loop_t *loop, const char *path)
{
    FILE *f = fopen(path, "r");
    char line[2048];
    int created;

    memset(s, 0, sizeof(*s));
    s->loop = loop;
    if (f != NULL) {
        while (fgets(line, sizeof(line), f) != NULL) {
            size_t n = strcspn(line, "\n");
            if (line[n] != '\n' && !feof(f)) {
                /* longer than any key we write: skip the rest of it */
                int c;
                while ((c = fgetc(f)) != EOF && c != '\n')
                    ;
                continue;
            }
            line[n] = '\0';
            if (strchr(line, '\t') == NULL)
                continue;
            seen_entry *e = seen_get(&s->map, line, &created);
            if (e != NULL)
                e->state = SEEN_DONE;
        }
        fclose(f);
    }
    s->fd = open(path, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
}

void remote_seen_close(remote_seen *s)
{
    if (s->fd >= 0)
        close(s->fd);
    s->fd = -1;
    seen_free(&s->map);
}

char *remote_seen_key(const char *rel, const char *version)
{
    char *k = NULL;
    if (asprintf(&k, "%s\t%s", rel, version) < 0)
        return NULL;
    return k;
}

typedef struct seen_append {
    uv_fs_t req;
    remote_seen *s;
    char *line;
} seen_append;

static void seen_appended(uv_fs_t *req)
{
    seen_append *a = req->data;

    remote_refs *refs = a->s->refs;

    uv_fs_req_cleanup(req);
    free(a->line);
    free(a);
    remote_unref(refs);
}

/* A line appended (by the loop's file system pool, never blocking the loop). */
static void seen_persist(remote_seen *s, const char *key)
{
    seen_append *a = malloc(sizeof(*a));

    if (a == NULL || s->fd < 0 || asprintf(&a->line, "%s\n", key) < 0) {
        free(a);
        return;
    }
    a->s = s;
    a->req.data = a;
    uv_buf_t buf = uv_buf_init(a->line, (unsigned)strlen(a->line));
    remote_ref(s->refs);
    if (uv_fs_write(s->loop, &a->req, s->fd, &buf, 1, -1, seen_appended) != 0) {
        free(a->line);
        free(a);
        remote_unref(s->refs);
    }
}

void remote_seen_done(remote_seen *s, const char *rel, const char *version)
{
    char *k = remote_seen_key(rel, version);
    int created;
    seen_entry *e = k != NULL ? seen_get(&s->map, k, &created) : NULL;

    if (e != NULL && e->state != SEEN_DONE) {
        e->state = SEEN_DONE;
        seen_persist(s, k);
    }
    free(k);
}

void remote_seen_set(remote_seen *s, const char *rel, const char *version, seen_state state)
{
    char *k = remote_seen_key(rel, version);
    seen_entry *e = k != NULL ? seen_find(&s->map, k) : NULL;

    if (e != NULL)
        e->state = state;
    free(k);
}

int remote_seen_decided(remote_seen *s, const char *rel, hub_outcome outcome)
{
    size_t rl = strlen(rel);

    /* the daemon knows the path; the version is the pending entry's.  A retry (our own failure, or
     * async mode's queue full: busy) is looked at again by a later listing, never persisted; it was
     * left pending once, and a delta refused busy never came back */
    for (size_t i = 0; i < s->map.cap; i++) {
        seen_entry *e = &s->map.slots[i];
        if (e->key && e->state == SEEN_PENDING && strncmp(e->key, rel, rl) == 0 && e->key[rl] == '\t') {
            e->state = outcome == HUB_RETRY ? SEEN_INCOMPLETE : SEEN_DONE;
            if (outcome != HUB_RETRY)
                seen_persist(s, e->key);
        }
    }
    return outcome == HUB_INCOMPLETE;
}

/* ---- the global offered while the daemon waits ---------------------------------------------------- */

static int same_global(const remote_global_gate *g, uint64_t step, const char *version)
{
    return g->offers > 0 && g->step == step && strcmp(g->version, version) == 0;
}

int remote_global_may_fetch(const remote_global_gate *g, uint64_t step, const char *version, uint64_t now_ms)
{
    return !same_global(g, step, version) || now_ms >= g->not_before;
}

void remote_global_handed(remote_global_gate *g, uint64_t step, const char *version, uint64_t now_ms,
                          double poll_interval)
{
    if (same_global(g, step, version)) {
        g->offers++;
    } else {
        snprintf(g->version, sizeof(g->version), "%s", version);
        g->step = step;
        g->offers = 1;
    }
    double wait = fmax(poll_interval, 0.05) * ldexp(1.0, g->offers < 20 ? (int)g->offers : 20);
    g->not_before = now_ms + (uint64_t)(fmin(wait, REMOTE_GLOBAL_BACKOFF_MAX) * 1000);
}

int remote_report_step(int64_t *known, int64_t step, const hub_callbacks *cb, void *app)
{
    if (step == *known)
        return 0;
    *known = step;
    cb->published_seen(app, step);
    return 1;
}
