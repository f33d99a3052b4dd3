#include "remote_fetch.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <openssl/evp.h>
#include <xxhash.h>

#include "delta.h"
#include "dl_log.h"
#include "safetensors.h"
#include "st_index.h"
#include "store.h"
#include "strbuf.h"
#include "util.h"

#define set_error(f, ...) remote_error(&(f)->rm, __VA_ARGS__)

/* ---- the close by reference count ---------------------------------------------------------------- */

static void check_idle(remote_fetch *f)
{
    if (!f->closing || f->idle_done || f->refs.n > 0 || f->jobs.in_flight > 0)
        return;
    f->idle_done = 1;
    f->ops->idle(f);
}

static void refs_check(remote_refs *r)
{
    check_idle(container_of(r, remote_fetch, refs));
}

static void jobs_drained(job_owner *o)
{
    check_idle(container_of(o, remote_fetch, jobs));
}

void remote_fetch_hold(remote_fetch *f)
{
    remote_ref(&f->refs);
}

void remote_fetch_release(remote_fetch *f)
{
    remote_unref(&f->refs);
}

int remote_fetch_job(remote_fetch *f, pool_job_fn work, pool_job_fn done, void *arg)
{
    return job_queue(&f->jobs, work, done, arg);
}

void remote_fetch_init(remote_fetch *f, const remote_fetch_config *cfg)
{
    memset(f, 0, sizeof(*f));
    f->loop = cfg->loop;
    f->ops = cfg->ops;
    f->owner = cfg->owner;
    f->st = cfg->st;
    f->cb = *cfg->cb;
    f->app = cfg->app;
    f->state_dir = cfg->state_dir;
    f->poll_interval = cfg->poll_interval;
    f->max_downloads = cfg->max_downloads;
    f->max_header = cfg->max_header;
    f->refs.check = refs_check;
    remote_init(&f->rm, cfg->loop, cfg->curl, cfg->st, cfg->req_ops, cfg->owner, &f->closing);
    f->rm.refs = &f->refs;
    job_owner_init(&f->jobs, cfg->loop, jobs_drained);
    remote_seen_open(&f->seen, cfg->loop, cfg->seen_path);
    f->seen.refs = &f->refs;
}

static void cand_list_free(remote_cand *c)
{
    while (c != NULL) {
        remote_cand *n = c->next;
        remote_cand_free(c);
        c = n;
    }
}

void remote_fetch_free(remote_fetch *f)
{
    cand_list_free(f->queue);
    cand_list_free(f->retry);
    f->queue = f->retry = NULL;
    while (f->sets)
        hub_set_free(&f->sets, f->sets);
    remote_seen_close(&f->seen);
}

void remote_fetch_close(remote_fetch *f)
{
    f->closing = 1;
    remote_cancel_all(&f->rm);
    check_idle(f);
}

/* ---- candidates ---------------------------------------------------------------------------------- */

remote_cand *remote_cand_new(const char *rel, const char *key, const char *tag, uint64_t size)
{
    remote_cand *c = calloc(1, sizeof(*c));

    if (c == NULL || (c->rel = strdup(rel)) == NULL || (c->key = strdup(key)) == NULL) {
        remote_cand_free(c);
        return NULL;
    }
    snprintf(c->tag, sizeof(c->tag), "%s", tag);
    snprintf(c->ver, sizeof(c->ver), "%s", tag);
    c->size = size;
    return c;
}

void remote_listed_free(remote_listed *l, size_t n)
{
    for (size_t i = 0; i < n; i++)
        free(l[i].key);
    free(l);
}

int remote_listed_add(remote_listed **l, size_t *n, const remote_listed *e)
{
    remote_listed *nl = realloc(*l, (*n + 1) * sizeof(*nl));

    if (nl == NULL)
        return -1;
    *l = nl;
    nl[*n] = *e;
    if ((nl[*n].key = strdup(e->key)) == NULL)
        return -1;
    (*n)++;
    return 0;
}

void remote_cand_free(remote_cand *c)
{
    if (c == NULL)
        return;
    free(c->rel);
    free(c->key);
    free(c->part);
    remote_listed_free(c->listed, c->nlisted);
    free(c);
}

int remote_fetch_set_version(const char *index_tag, const remote_listed *l, size_t n, char *out, size_t size)
{
    hub_set_version v;

    hub_set_version_start(&v, index_tag);
    for (size_t i = 0; i < n; i++)
        hub_set_version_add(&v, l[i].key, l[i].tag, l[i].size);
    return hub_set_version_end(&v, out, size);
}

int remote_fetch_wanted(const remote_fetch *f, const char *rel, const char *ver, int *is_new)
{
    char *k = remote_seen_key(rel, ver);
    const seen_entry *e = k != NULL ? seen_find(&f->seen.map, k) : NULL;

    free(k);
    *is_new = e == NULL;
    if (k == NULL)
        return -1;
    return e == NULL || e->state == SEEN_INCOMPLETE;
}

int remote_fetch_in_flight(const remote_fetch *f, const char *rel, const char *ver)
{
    char *k = remote_seen_key(rel, ver);
    const seen_entry *e = k != NULL ? seen_find(&f->seen.map, k) : NULL;

    free(k);
    return e != NULL && e->state == SEEN_PENDING;
}

int remote_fetch_pending(remote_fetch *f, const char *rel, const char *ver)
{
    char *k = remote_seen_key(rel, ver);
    int created;
    seen_entry *e = k != NULL ? seen_get(&f->seen.map, k, &created) : NULL;

    free(k);
    if (e == NULL)
        return -1;
    e->state = SEEN_PENDING;
    return 0;
}

void remote_fetch_enqueue(remote_fetch *f, remote_cand *c)
{
    remote_cand **t = &f->queue;

    c->next = NULL;
    while (*t)
        t = &(*t)->next;
    *t = c;
}

void remote_fetch_requeue_due(remote_fetch *f)
{
    uint64_t now = uv_now(f->loop);

    for (remote_cand **p = &f->retry; *p;) {
        remote_cand *c = *p;
        if (c->not_before <= now) {
            *p = c->next;
            remote_fetch_enqueue(f, c);
        } else {
            p = &c->next;
        }
    }
}

/* A failed candidate waits, longer after each failure (1, 2, 4 ... 60 s with jitter): a server that
 * keeps failing is not hammered at the poll interval. */
static void retry_later(remote_fetch *f, remote_cand *c)
{
    int k = c->attempts > 1 ? c->attempts - 1 : 0;
    double wait = remote_jittered(fmin(ldexp(1.0, k < 16 ? k : 16), REMOTE_MAX_BACKOFF));

    c->not_before = uv_now(f->loop) + (uint64_t)(wait * 1000);
    c->next = f->retry;
    f->retry = c;
}

static void set_shard_finished(remote_fetch *f, hub_set *set, int ok, seen_state fail_state);

void remote_fetch_global_given_up(remote_fetch *f)
{
    f->global_download = 0;
    f->st->head[0] = '\0';
}

/* A candidate done with for this run (given up, or its object changed): a shard takes its set down
 * with it, a global gives the adoption up, a delta's version takes state. */
static void cand_drop(remote_fetch *f, remote_cand *c, seen_state state)
{
    if (c->set != NULL)
        set_shard_finished(f, c->set, 0, state);
    else if (c->is_global)
        remote_fetch_global_given_up(f);
    else
        remote_seen_set(&f->seen, c->rel, c->ver, state);
    remote_cand_free(c);
}

/* Another attempt after a failure, or given up after the last. */
static void retry_or_drop(remote_fetch *f, remote_cand *c)
{
    if (!f->closing && ++c->attempts < REMOTE_MAX_ATTEMPTS_DOWNLOAD)
        retry_later(f, c);
    else
        cand_drop(f, c, SEEN_REJECTED);
}

/* A candidate refused from what the listing or its header says, before (the rest of) a download. */
static void refuse(remote_fetch *f, remote_cand *c, const char *why)
{
    char q[400], qk[600];

    dl_log(DL_LOG_WARN, "hub", "delta refused before download", "%s=%s reason=%s", f->ops->name_field,
           dl_log_q(qk, sizeof(qk), c->key), dl_log_q(q, sizeof(q), why));
    set_error(f, "%s: %s", c->key, why);
    cand_drop(f, c, SEEN_REJECTED);
}

static void stale(remote_fetch *f, remote_cand *c, uint64_t base)
{
    char qk[600];

    dl_log(DL_LOG_DEBUG, "hub", "stale delta not downloaded", "%s=%s base_outer_step=%" PRIu64, f->ops->name_field,
           dl_log_q(qk, sizeof(qk), c->key), base);
    f->st->stale_skipped++;
    remote_seen_done(&f->seen, c->rel, c->ver);
    remote_cand_free(c);
}

static void mismatch(remote_fetch *f, const remote_cand *c, const char *why)
{
    char q[400], qk[600];

    dl_log(DL_LOG_WARN, "hub", "download does not match the listing, discarded", "%s=%s reason=%s",
           f->ops->name_field, dl_log_q(qk, sizeof(qk), c->key), dl_log_q(q, sizeof(q), why));
    set_error(f, "%s: %s", c->key, why);
}

/* A failed request's answer in words, recorded (not when the transport said it in its own). */
static void request_failed(remote_fetch *f, const remote_req *r, const remote_cand *c)
{
    char why[256];

    if (f->closing || r->x == NULL)
        return;
    f->rm.ops->describe(r->x, why, sizeof(why));
    set_error(f, "GET %s: %s", c->key, why);
}

/* ---- the adoption hand-off ----------------------------------------------------------------------- */

void remote_fetch_offer_global(remote_fetch *f, remote_cand *c)
{
    if (!remote_global_may_fetch(&f->gate, c->step, c->ver, uv_now(f->loop))) {
        /* handed over before and not adopted: listed again at later polls, fetched after the backoff */
        remote_cand_free(c);
        remote_fetch_global_given_up(f);
        return;
    }
    f->global_download = 1;
    remote_fetch_enqueue(f, c);
    remote_fetch_pump(f);
}

void remote_fetch_global_ready(remote_fetch *f, remote_cand *c)
{
    f->global_download = 0;
    remote_global_handed(&f->gate, c->step, c->ver, uv_now(f->loop), f->poll_interval);
    if (!f->closing)
        f->cb.global_ready(f->app, c->step, c->part);
    remote_cand_free(c);
}

void remote_fetch_global_failed(remote_fetch *f, remote_cand *c)
{
    if (c->is_set) {
        /* a sharded global: the index in a directory of its own with its shards */
        char *slash = strrchr(c->part, '/');
        if (slash != NULL) {
            *slash = '\0';
            hub_set_remove_dir(c->part);
        }
    } else {
        unlink(c->part);
    }
    remote_fetch_global_given_up(f);
    remote_cand_free(c);
}

static void hand_global(remote_fetch *f, remote_cand *c)
{
    if (f->ops->confirm_global != NULL && !f->closing)
        f->ops->confirm_global(f, c);
    else
        remote_fetch_global_ready(f, c);
}

int remote_fetch_mark_done(remote_fetch *f, const char *rel, hub_outcome outcome)
{
    return remote_seen_decided(&f->seen, rel, outcome);
}

/* ---- verify on the pool -------------------------------------------------------------------------- */

static const EVP_MD *digest_md(remote_digest alg)
{
    return alg == REMOTE_SHA256 ? EVP_sha256() : alg == REMOTE_SHA1 ? EVP_sha1() : EVP_md5();
}

static int digest_hex(EVP_MD_CTX *ctx, char *hex, size_t hex_size)
{
    static const char digits[] = "0123456789abcdef";
    unsigned char md[EVP_MAX_MD_SIZE];
    unsigned mdlen = 0;

    if (EVP_DigestFinal_ex(ctx, md, &mdlen) != 1 || hex_size < 2 * (size_t)mdlen + 1)
        return -1;
    for (unsigned i = 0; i < mdlen; i++) {
        hex[2 * i] = digits[md[i] >> 4];
        hex[2 * i + 1] = digits[md[i] & 15];
    }
    hex[2 * mdlen] = '\0';
    return 0;
}

int remote_hash_fd(int fd, remote_digest alg, const void *head, size_t head_len, char *hex, size_t hex_size)
{
    EVP_MD_CTX *ctx = EVP_MD_CTX_new();
    unsigned char *buf = malloc(1 << 20);
    int bad = ctx == NULL || buf == NULL || EVP_DigestInit_ex(ctx, digest_md(alg), NULL) != 1 ||
              (head != NULL && EVP_DigestUpdate(ctx, head, head_len) != 1);

    for (ssize_t r; !bad && (r = read(fd, buf, 1 << 20)) != 0;) {
        if (r < 0 && errno == EINTR)
            continue;
        bad = r < 0 || EVP_DigestUpdate(ctx, buf, (size_t)r) != 1;
    }
    bad = bad || digest_hex(ctx, hex, hex_size) != 0;
    EVP_MD_CTX_free(ctx);
    free(buf);
    return bad ? -1 : 0;
}

int remote_hash_mem(const void *p, size_t len, remote_digest alg, const void *head, size_t head_len, char *hex,
                    size_t hex_size)
{
    EVP_MD_CTX *ctx = EVP_MD_CTX_new();
    int bad = ctx == NULL || EVP_DigestInit_ex(ctx, digest_md(alg), NULL) != 1 ||
              (head != NULL && EVP_DigestUpdate(ctx, head, head_len) != 1) || EVP_DigestUpdate(ctx, p, len) != 1 ||
              digest_hex(ctx, hex, hex_size) != 0;

    EVP_MD_CTX_free(ctx);
    return bad ? -1 : 0;
}

typedef struct verify_job {
    remote_fetch *f;
    remote_cand *c;
    const remote_fetch_ops *ops;        /* read on the pool: the table is constant */
    int ok;
    char why[200];
} verify_job;

static void verify_work(pool_job *pj)
{
    verify_job *j = pj->arg;
    const remote_cand *c = j->c;
    struct stat sb;
    int fd = open(c->part, O_RDONLY | O_CLOEXEC);

    if (fd < 0 || fstat(fd, &sb) != 0)
        snprintf(j->why, sizeof(j->why), "cannot read the download: %s", strerror(errno));
    else if ((uint64_t)sb.st_size != c->size)
        snprintf(j->why, sizeof(j->why), "size %lld, the listing says %" PRIu64, (long long)sb.st_size, c->size);
    else
        j->ok = j->ops->verify_file(c, fd, j->why, sizeof(j->why)) == 0;
    if (fd >= 0)
        close(fd);
}

static void verified(remote_fetch *f, remote_cand *c)
{
    char qk[600], qt[100];

    f->st->downloads++;
    f->st->download_bytes += c->size;
    /* quoted: a hex id of digits only would become a (rounded) JSON number */
    dl_log(DL_LOG_DEBUG, "hub", f->ops->downloaded_log, "%s=%s bytes=%" PRIu64 " version=%s", f->ops->name_field,
           dl_log_q(qk, sizeof(qk), c->key), c->size, dl_log_q(qt, sizeof(qt), c->tag));
    if (c->set != NULL) {
        hub_set *set = c->set;
        remote_cand_free(c);
        set_shard_finished(f, set, 1, SEEN_DONE);
    } else if (c->is_global) {
        hand_global(f, c);
    } else {
        hub_delta d = {.rel = c->rel, .path = c->part, .root = NULL, .owned = 1};
        f->cb.delta_ready(f->app, &d);
        remote_cand_free(c);
    }
}

static void verify_after(pool_job *pj)
{
    verify_job *j = pj->arg;
    remote_fetch *f = j->f;
    remote_cand *c = j->c;

    f->active--;
    if (!pj->cancelled && j->ok && !f->closing) {
        verified(f, c);
    } else {
        if (!pj->cancelled && !f->closing)
            mismatch(f, c, j->why);
        /* a complete download cut short by a stop is kept: the next start resumes or reuses it */
        if (!pj->cancelled && !j->ok)
            unlink(c->part);
        retry_or_drop(f, c);
    }
    free(j);
    remote_fetch_pump(f);
}

static void start_verify(remote_fetch *f, remote_cand *c)
{
    verify_job *j = calloc(1, sizeof(*j));

    if (j != NULL) {
        j->f = f;
        j->c = c;
        j->ops = f->ops;
        if (job_queue(&f->jobs, verify_work, verify_after, j) == 0)
            return;
    }
    free(j);
    f->active--;
    cand_drop(f, c, SEEN_REJECTED);
}

/* ---- the download -------------------------------------------------------------------------------- */

static void download_done(remote_req *r, int ok)
{
    remote_fetch *f = container_of(r->rm, remote_fetch, rm);
    remote_cand *c = r->arg;
    long status = r->x != NULL ? r->x->status : 0;
    int range_ignored = r->sink_off > 0 && status == 200;
    int too_big = r->x != NULL && r->x->too_big;
    int fd = r->sink_fd;
    char qk[600];

    if (!ok && status != 412 && !too_big)
        request_failed(f, r, c);
    remote_req_end(r);              /* frees r and its transfer: only the copies above from here on */
    close(fd);
    if (f->closing) {
        f->active--;
        cand_drop(f, c, SEEN_REJECTED);
        return;
    }
    if (status == 412) {
        /* replaced since the listing (If-Match): the next listing shows the new version */
        dl_log(DL_LOG_INFO, "hub", "object changed while downloading", "%s=%s", f->ops->name_field,
               dl_log_q(qk, sizeof(qk), c->key));
        unlink(c->part);
        f->active--;
        cand_drop(f, c, SEEN_DONE);
        remote_fetch_pump(f);
        return;
    }
    if (too_big) {
        dl_log(DL_LOG_WARN, "hub", "download larger than the listing, discarded", "%s=%s listed=%" PRIu64,
               f->ops->name_field, dl_log_q(qk, sizeof(qk), c->key), c->size);
        set_error(f, "%s: the server sent more than the listed %" PRIu64 " bytes", c->key, c->size);
    }
    if (!ok || range_ignored) {
        f->active--;
        if (range_ignored || status == 416 || too_big)
            unlink(c->part);    /* start over: the server would not resume, or sent too much */
        retry_or_drop(f, c);
        remote_fetch_pump(f);
        return;
    }
    start_verify(f, c);
}

static void start_download(remote_fetch *f, remote_cand *c)
{
    struct stat sb;
    char line[160], qk[600];
    remote_req *r = NULL;
    int fd;

    if (c->part == NULL)
        c->part = f->ops->part_path(f, c);
    /* a small open of our own cache file; the data goes through uv_fs_write */
    fd = c->part ? open(c->part, O_WRONLY | O_CREAT | O_CLOEXEC, 0644) : -1;
    if (fd < 0 || fstat(fd, &sb) != 0) {
        set_error(f, "cannot open %s: %s", c->part ? c->part : "a download file", c->part ? strerror(errno) : "out of memory");
        if (fd >= 0)
            close(fd);
        cand_drop(f, c, SEEN_REJECTED);
        return;
    }
    if ((r = f->ops->get(f, c, "download")) == NULL) {
        close(fd);
        cand_drop(f, c, SEEN_REJECTED);
        return;
    }
    uint64_t have = (uint64_t)sb.st_size;
    if (have > c->size) {
        have = 0;
        if (ftruncate(fd, 0) != 0) {
            close(fd);
            remote_req_end(r);
            cand_drop(f, c, SEEN_REJECTED);
            return;
        }
    }
    if (have == c->size && have > 0)
        have = c->size - 1;     /* complete before a restart: the last byte again, under the transport's conditions */
    if (have > 0) {
        dl_log(DL_LOG_INFO, "hub", "resuming a download", "%s=%s from=%" PRIu64 " size=%" PRIu64, f->ops->name_field,
               dl_log_q(qk, sizeof(qk), c->key), have, c->size);
        snprintf(line, sizeof(line), "Range: bytes=%" PRIu64 "-", have);
        remote_req_header(r, line);
    }
    r->sink_fd = fd;
    r->sink_off = have;
    r->sink_max = c->size;      /* the listing's size is all the file may be */
    r->sink_capped = 1;
    r->max_attempts = 1;        /* resume is driven from here, with a fresh Range each time */
    f->active++;
    remote_go_done(r, download_done, c);
}

/* ---- the peek and the header judgment ------------------------------------------------------------ */

/* Why the delta is refused before its download (NULL: not refused); *base is its base_outer_step
 * when the header was read, else UINT64_MAX. */
static const char *judge_header(const remote_fetch *f, const remote_cand *c, const sbuf *b, uint64_t *base,
                                char *why, size_t why_size)
{
    const unsigned char *p = (const unsigned char *)b->p;
    uint64_t n = 0, want = 0;
    st_header *hd = NULL;

    *base = UINT64_MAX;
    for (int i = 7; i >= 0; i--)
        n = (n << 8) | p[i];
    if (n > f->max_header) {
        snprintf(why, why_size, "header of %" PRIu64 " bytes, the cap is %" PRIu64, n, f->max_header);
        return why;
    }
    if (c->size < 8 || n > c->size - 8) {
        snprintf(why, why_size, "header of %" PRIu64 " bytes in a file of %" PRIu64, n, c->size);
        return why;
    }
    if (8 + n > b->len || st_header_parse_unsized(b->p + 8, (size_t)n, &hd, NULL) != 0)
        return NULL;            /* larger than the peek, or bad: the intake's full check says why */
    const char *res = NULL;
    if (st_header_file_len(hd, &want) != 0 || want != c->size) {
        snprintf(why, why_size, "the header describes a file of %" PRIu64 " bytes, the listing says %" PRIu64, want,
                 c->size);
        res = why;
    } else {
        size_t vl;
        const char *v = st_header_meta(hd, "base_outer_step", &vl);
        if (v == NULL || delta_parse_int(v, vl, base) != 0)
            *base = UINT64_MAX;
    }
    st_header_free(hd);
    return res;
}

static void peek_done(remote_req *r, int ok)
{
    remote_fetch *f = container_of(r->rm, remote_fetch, rm);
    remote_cand *c = r->arg;
    uint64_t base = UINT64_MAX;
    char whybuf[200];
    const char *why = NULL;

    f->active--;
    if (ok && !f->closing && r->x->body.len >= 8)
        why = judge_header(f, c, &r->x->body, &base, whybuf, sizeof(whybuf));
    remote_req_end(r);
    if (f->closing) {
        cand_drop(f, c, SEEN_REJECTED);
        return;
    }
    if (why != NULL) {
        refuse(f, c, why);      /* for this run: a restart (perhaps with another cap) looks again */
    } else if (base != UINT64_MAX && hub_base_stale(&f->limits, f->step, base)) {
        stale(f, c, base);
    } else if (base != UINT64_MAX && base > f->step) {
        cand_drop(f, c, SEEN_INCOMPLETE);       /* a later round's (or never ours): later polls look again */
    } else {
        /* the current round's, or a header the peek could not judge: the download and intake decide */
        c->peeked = 1;          /* a retry after a failed download goes straight to the download */
        remote_fetch_enqueue(f, c);
    }
    remote_fetch_pump(f);
}

static void start_peek(remote_fetch *f, remote_cand *c)
{
    remote_req *r = f->ops->get(f, c, "peek");
    char range[48];

    if (r == NULL) {
        cand_drop(f, c, SEEN_REJECTED);
        return;
    }
    /* never more than the listing says the file has; a server that ignores the Range and sends more
     * fails the peek, and the (capped) download and the intake decide */
    uint64_t want = c->size < REMOTE_PEEK_BYTES ? c->size : REMOTE_PEEK_BYTES;
    snprintf(range, sizeof(range), "Range: bytes=0-%" PRIu64, want > 0 ? want - 1 : 0);
    remote_req_header(r, range);
    r->body_cap = (size_t)(want > 0 ? want : 1);
    r->max_attempts = 2;
    f->active++;
    remote_go_done(r, peek_done, c);
}

/* ---- sets ---------------------------------------------------------------------------------------- */

/* One shard candidate of set finished (ok: verified); after the last one the set is handed over,
 * or, when a shard failed, dropped as a whole (its version is not taken this run). */
static void set_shard_finished(remote_fetch *f, hub_set *set, int ok, seen_state fail_state)
{
    char qk[600];

    if (!hub_set_shard_done(set, ok, fail_state))
        return;
    if (set->failed || f->closing) {
        /* a stop keeps the directory: the next start resumes the shards there */
        if (!f->closing)
            dl_log(DL_LOG_INFO, "hub", "sharded set not taken: a shard could not be downloaded", "%s=%s",
                   f->ops->name_field, dl_log_q(qk, sizeof(qk), set->rel));
        if (set->is_global)
            remote_fetch_global_given_up(f);
        else
            remote_seen_set(&f->seen, set->rel, set->ver, set->fail_state);
        hub_set_drop(&f->sets, set, f->closing);
        return;
    }
    if (set->is_global) {
        remote_cand *g = remote_cand_new(set->rel, set->rel, set->ver, 0);
        if (g == NULL || (g->part = strdup(set->index_path)) == NULL) {
            remote_cand_free(g);
            hub_set_remove_dir(set->dir);
            remote_fetch_global_given_up(f);
        } else {
            g->is_global = 1;
            g->is_set = 1;
            g->step = set->step;
            hand_global(f, g);
        }
    } else {
        hub_set_hand_over(set, &f->cb, f->app);
    }
    hub_set_free(&f->sets, set);
}

/* The set's directory, <state>/cache/incoming/<prefix>[global-]<version>-<key hash>.set, with the index
 * in it.  The version alone is not enough: two nodes' byte-identical indexes without shards listed yet
 * have one version, and the second set would be staged in (and dropped with) the first one's directory;
 * the hash of the index's key keeps each node's set apart. */
static hub_set *set_new(remote_fetch *f, const remote_cand *c, const char *text, size_t len)
{
    char *dir = store_path_incoming_file(f->state_dir, "%s%s%s-%016" PRIx64 ".set", f->ops->set_prefix,
                                         c->is_global ? "global-" : "", c->ver,
                                         (uint64_t)XXH3_64bits(c->rel, strlen(c->rel)));
    dl_error err = {0};
    hub_set *set;

    set = hub_set_new(&f->sets, dir, c->rel, c->ver, c->is_global, c->step, text, len, &err);
    if (set == NULL && err.code != DL_E_NO_MEMORY)
        set_error(f, "cannot store the index of %s: %s", c->key, err.message);
    return set;
}

/* The listed file of c's set that is called name in the index's directory, or NULL. */
static const remote_listed *listed_shard(const remote_cand *c, const char *name)
{
    for (size_t i = 0; i < c->nlisted; i++)
        if (hub_set_path_names(c->listed[i].key, name))
            return &c->listed[i];
    return NULL;
}

static int shard_listed(const void *c, const char *name, uint64_t *bytes)
{
    const remote_listed *l = listed_shard(c, name);

    *bytes = l ? l->size : 0;
    return l != NULL;
}

/* One candidate per shard of a complete set, downloaded into its directory. */
static void queue_shards(remote_fetch *f, const remote_cand *c, hub_set *set, const st_index *ix)
{
    char name[ST_INDEX_BASE_MAX + 48];
    const char *slash = strrchr(c->rel, '/');
    int dlen = slash != NULL ? (int)(slash - c->rel) : 0;

    set->pending = ix->nshards;
    for (uint32_t i = 0; i < ix->nshards; i++) {
        st_index_shard_name(ix->base, i, ix->nshards, name, sizeof(name));
        const remote_listed *l = listed_shard(c, name);
        char *rel = NULL;
        remote_cand *s = NULL;
        if (asprintf(&rel, "%.*s%s%s", dlen, c->rel, dlen ? "/" : "", name) >= 0)
            s = remote_cand_new(rel, l->key, l->tag, l->size);
        free(rel);
        if (s == NULL || asprintf(&s->part, "%s/%s", set->dir, name) < 0) {
            if (s != NULL)
                s->part = NULL;
            remote_cand_free(s);
            set_shard_finished(f, set, 0, SEEN_REJECTED);
            continue;
        }
        s->lfs = l->lfs;
        s->set = set;
        s->peeked = 1;
        remote_fetch_enqueue(f, s);
    }
}

/* The index is parsed: the stale or later round's set is judged here (as a single delta's peek
 * judges it), a partial set waits for a listing that shows every shard, and a complete one gets a
 * directory and one candidate per shard. */
static void set_start_shards(remote_fetch *f, remote_cand *c, const st_index *ix, const char *text, size_t len)
{
    char name[ST_INDEX_BASE_MAX + 48], q[300], qk[600];
    uint64_t base, total;
    int verdict = c->is_global ? 0 : hub_set_base_verdict(ix, f->step, &f->limits, &base);

    if (verdict < 0) {
        stale(f, c, base);
        return;
    }
    if (verdict > 0) {
        cand_drop(f, c, SEEN_INCOMPLETE);
        return;
    }
    if (hub_set_listed_shards(ix, shard_listed, c, name, sizeof(name), &total)) {
        /* a later listing that shows the shard has another version: the set is looked at again */
        dl_log(DL_LOG_DEBUG, "hub", "sharded set incomplete, waiting for its shards", "%s=%s missing=%s",
               f->ops->name_field, dl_log_q(qk, sizeof(qk), c->key), dl_log_q(q, sizeof(q), name));
        cand_drop(f, c, SEEN_REJECTED);
        return;
    }
    if (!c->is_global && f->limits.delta_set_bytes != 0 && total > f->limits.delta_set_bytes) {
        /* refused from the listing, before a byte: this version of the set is not looked at again */
        snprintf(q, sizeof(q), "its shards are %" PRIu64 " bytes together, a delta of this model at most %" PRIu64,
                 total, f->limits.delta_set_bytes);
        refuse(f, c, q);
        return;
    }
    hub_set *set = set_new(f, c, text, len);
    if (set == NULL) {
        cand_drop(f, c, SEEN_REJECTED);
        return;
    }
    queue_shards(f, c, set, ix);
    remote_cand_free(c);
}

/* A failed index download, or one that is not the listed text: tried again a few times. */
static void index_retry(remote_fetch *f, remote_cand *c)
{
    retry_or_drop(f, c);
}

/* On the pool: the transport's check of the text against the listing. */
static int index_matches_listing(const hub_index_job *j)
{
    const remote_cand *c = j->arg;
    const remote_fetch *f = j->owner;

    return j->len == c->size && f->ops->verify_index(c, j->text, j->len) == 0 ? 0 : -1;
}

/* The index checked and parsed (hub_index_job): the download stays counted in active until here. */
static void index_parsed(hub_index_job *j)
{
    remote_fetch *f = j->owner;
    remote_cand *c = j->arg;

    f->active--;
    if (f->closing || j->cancelled) {
        cand_drop(f, c, SEEN_REJECTED);
    } else if (j->mismatch) {
        mismatch(f, c, "the download does not match the listing's size and version");
        index_retry(f, c);
    } else if (j->rc == 0) {
        set_start_shards(f, c, j->ix, j->text, j->len);
    } else if (c->is_global) {
        set_error(f, "the global index %s: %s", c->key, j->err.message);
        cand_drop(f, c, SEEN_REJECTED);
    } else {
        /* handed over alone: intake refuses it with the reason, once for this version */
        hub_set *set = set_new(f, c, j->text, j->len);
        if (set == NULL) {
            cand_drop(f, c, SEEN_REJECTED);
        } else {
            remote_cand_free(c);
            set_shard_finished(f, set, 1, SEEN_DONE);
        }
    }
    hub_index_job_free(j);
    remote_fetch_pump(f);
}

static void index_done(remote_req *r, int ok)
{
    remote_fetch *f = container_of(r->rm, remote_fetch, rm);
    remote_cand *c = r->arg;
    cuv_xfer *x = r->x;
    long status = x != NULL ? x->status : 0;

    if (f->closing) {
        f->active--;
        remote_req_end(r);
        cand_drop(f, c, SEEN_REJECTED);
        return;
    }
    if (!ok || status != 200) {
        f->active--;
        if (ok)
            mismatch(f, c, "the download does not match the listing's size and version");
        else if (status != 412)
            request_failed(f, r, c);
        remote_req_end(r);
        if (status == 412)
            cand_drop(f, c, SEEN_DONE);         /* replaced: the next listing has the new version */
        else
            index_retry(f, c);
        remote_fetch_pump(f);
        return;
    }
    size_t len = x->body.len;
    char *text = sb_take(&x->body);
    remote_req_end(r);
    hub_index_job *j = hub_index_job_new(text, len, c->rel, hub_set_index_cap(&f->limits, c->is_global), index_parsed,
                                         f, c);
    if (j != NULL && f->ops->verify_index != NULL)
        j->verify = index_matches_listing;
    if (j == NULL || hub_index_job_queue(&f->jobs, j) != 0) {
        hub_index_job_free(j);
        f->active--;
        cand_drop(f, c, SEEN_REJECTED);
        remote_fetch_pump(f);
    }
}

/* An index is read whole into memory, capped as huggingface_hub caps it. */
static void start_index(remote_fetch *f, remote_cand *c)
{
    char line[160];
    size_t cap = hub_set_index_cap(&f->limits, c->is_global);
    remote_req *r;

    if (c->size > cap) {
        snprintf(line, sizeof(line), "an index of %" PRIu64 " bytes, the cap is %zu", c->size, cap);
        refuse(f, c, line);
        return;
    }
    if ((r = f->ops->get(f, c, "index")) == NULL) {
        cand_drop(f, c, SEEN_REJECTED);
        return;
    }
    r->body_cap = (size_t)(c->size > 0 ? c->size : 1);
    r->max_attempts = 2;
    f->active++;
    remote_go_done(r, index_done, c);
}

/* ---- the pump ------------------------------------------------------------------------------------ */

void remote_fetch_pump(remote_fetch *f)
{
    uint64_t now = uv_now(f->loop);

    while (!f->closing && f->active < f->max_downloads && f->queue != NULL) {
        remote_cand *c = f->queue;
        f->queue = c->next;
        c->next = NULL;
        if (c->not_before > now) {
            c->next = f->retry;
            f->retry = c;
        } else if (c->is_set) {
            start_index(f, c);
        } else if (c->peeked || c->is_global) {
            start_download(f, c);
        } else {
            start_peek(f, c);
        }
    }
}
