#include "hub_hf.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cJSON.h>
#include <openssl/evp.h>

#include "curl_uv.h"
#include "delta.h"
#include "dl_log.h"
#include "fsutil.h"
#include "hub_set.h"
#include "jobs.h"
#include "remote.h"
#include "seen.h"
#include "st_index.h"
#include "stepcount.h"
#include "strbuf.h"

/* The header peek reads this much; a header that fits is parsed on the loop thread (a 64 KiB parse
 * is well under a millisecond), a larger one is left to the intake, which runs on the pool. */
#define PEEK_BYTES 65536
#define MAX_ATTEMPTS_DOWNLOAD 6
#define MAX_BACKOFF REMOTE_MAX_BACKOFF
/* step_count.json is about 100 bytes */
#define STEPFILE_BODY_CAP (64u << 10)
/* One listing: 1,000 pages of 1,000 entries is a million files, far beyond a DiLoCo repo; a Hub
 * whose Link never ends is cut there.  New delta paths taken from one listing are capped too, so a
 * Hub listing millions of fake deltas cannot fill memory with candidates: the rest wait for the
 * next listing. */
#define MAX_LIST_PAGES 1000
#define MAX_NEW_PER_LISTING 4096
/* indexes and shards remembered from one listing (the rest wait for the next listing) */
#define MAX_LISTED_SET_FILES 65536
/* 2^53: every integer below it is exact in a double */
#define JSON_MAX_EXACT 9007199254740992.0

/* ---- requests with retries ------------------------------------------------------------------- */

typedef struct hf_hub hf_hub;
typedef remote_req hf_req;         /* remote.h: the retrying request */
typedef void (*hf_req_cb)(hf_hub *h, hf_req *r, int ok);


/* A file of a sharded set as the tree listing showed it. */
typedef struct listed_file {
    char *rel;
    char oid[65];
    uint64_t size;
    int lfs;
    char node[DELTA_NODE_ID_MAX + 1];
    uint64_t local_step;
} listed_file;

typedef struct candidate {
    char *rel;
    char *oid;
    char ver[80];               /* the seen list's version: the oid, or a set's (set_version) */
    uint64_t size;
    int lfs;
    int is_set;                 /* an index: fetched, parsed, then its shards become candidates */
    listed_file *listed;        /* is_set: the shards listed next to it */
    size_t nlisted;
    hub_set *set;               /* a shard: the set it belongs to */
    char *part;                 /* download path */
    uint64_t have;
    int attempts;
    uint64_t not_before;        /* loop time (ms) before which a failed one is not tried again */
    int peeked;                 /* its header was looked at: download it */
    int is_global;              /* the Hub's global, for adoption (verified like a delta) */
    uint64_t step;
    struct candidate *next;
} candidate;

/* One file of a publish: the plain global, or a shard or the index of a sharded one. */
typedef struct pub_file {
    char rel[ST_INDEX_BASE_MAX + 64];   /* global/<name> */
    char *path;
    int fd;
    uint64_t size;
    char sha256[65];
    char sample_b64[700];
    char *content;              /* an index's bytes, for the commit when the Hub wants it inline */
    size_t content_len;
    int lfs;                    /* the Hub's preupload said "lfs" */
} pub_file;

typedef struct pub_state {
    int active;
    uint64_t step;
    int sharded;
    pub_file *files;            /* the shards, then the index (or the one file) */
    unsigned nfiles, cur;       /* cur: the LFS upload in progress */
    char **deletes;             /* the other layout's files on the Hub, deleted in the commit */
    size_t ndeletes;
    int uploaded;               /* every LFS object is stored: a 412 retry only commits again */
    char *path;
    char optimizer[32];
    int bootstrap;
    int fd;
    uint64_t size;
    char sha256[65];
    char sample_b64[700];
    char *stepfile;
    char parent[48];
    cJSON *batch;               /* the LFS batch answer */
    char **part_etags;
    size_t nparts, part_next;
    uint64_t chunk;
    double backoff;
} pub_state;

struct hf_hub {
    hub base;                   /* first: the transport interface's handle */
    uv_loop_t *loop;
    cuv *curl;
    hub_callbacks cb;
    void *app;
    char *endpoint, *repo, *rev, *token, *state_dir;
    double poll_interval;
    unsigned max_downloads;
    uint64_t max_header;        /* a delta's header cap */
    hub_limits limits;          /* the open round's model (hub_set_limits) */
    unsigned list_pages;        /* pages of the current listing */
    unsigned list_new;          /* new candidates taken from the current listing */
    int list_cut;               /* ... and some left for the next listing */
    uv_timer_t poll_timer;
    int closing;
    hub_status st;
    uint64_t step;
    int waiting;
    int polling;                /* a poll cycle is running */
    remote_seen seen;           /* every listed (path, version) looked at, the decided ones in a file */
    remote_global_gate gate;    /* the global last handed over: not fetched again at every poll */
    candidate *queue, *retry;   /* to peek/download; failed ones waiting for the next poll */
    unsigned active_downloads;
    remote rm;                  /* requests: retries, failures, every one in flight */
    job_owner jobs;             /* pool jobs out (jobs.h): verifies, index parses, hashes */
    int64_t published_known;    /* the Hub's step_count.json outer_step, -1 unknown */
    int global_download;        /* adoption download in progress */
    int told_none;              /* published_seen(-1) was reported */
    uint64_t poll_resume_ms;    /* after a 429 or an access problem: no poll before this loop time */
    double access_backoff;      /* seconds between polls while the Hub refuses access (0: it does not) */
    int problem_status;         /* the HTTP status behind st.problem */
    int problem_write;          /* ... refused a write (a commit): reads may still work */
    listed_file *lidx, *lshards; /* indexes and shards of the listing in progress */
    size_t nlidx, nlshards;
    hub_set *sets;              /* sets whose shards are downloading */
    int adopt_sharded;          /* the Hub's step_count.json names the index */
    pub_state pub;
    void (*close_done)(void *);
    void *close_arg;
    int handles;
};

/* route: a static name for /metrics (dilocod_hub_requests_total{route,code}); messages name the URL */
static hf_req *req_new(hf_hub *h, const char *method, const char *url, const char *route)
{
    return remote_req_new(&h->rm, method, url, NULL, route);
}

/* A failure recorded in /status and logged when it changes (remote.h).  While a request refused for
 * access (401, 403, unknown repo) ends, its callback's generic "HTTP 401" is not recorded: the
 * access problem already says so in words that tell the operator what to fix. */
#define set_error(h, ...) remote_error(&(h)->rm, __VA_ARGS__)

/* ---- access problems: a wrong token or repo id ---------------------------------------------------
 * Retrying cannot fix these, only the operator can, so they are said once in words that name the
 * fix, shown in /status (st.problem), and polled at a slowing pace until they go away. */

/* The stable name of the access problem x's answer shows, or NULL.  The mapping is the one
 * huggingface_hub applies to the Hub's answers (hf_raise_for_status): X-Error-Code GatedRepo,
 * RepoNotFound, RevisionNotFound; 401 for a missing or invalid token or a private or absent repo;
 * 403 for a token without the right.  Other 404s (EntryNotFound: a file not there yet) are normal. */
static const char *access_problem(const cuv_xfer *x)
{
    if (x == NULL || x->result != CURLE_OK)
        return NULL;
    if (strcmp(x->error_code, "GatedRepo") == 0)
        return "gated";
    if (x->status == 401)
        return "unauthorized";
    if (x->status == 403)
        return "forbidden";
    if (x->status == 404 && strcmp(x->error_code, "RepoNotFound") == 0)
        return "repo_not_found";
    if (x->status == 404 && strcmp(x->error_code, "RevisionNotFound") == 0)
        return "revision_not_found";
    return NULL;
}

/* The Hub's own words: {"error": "..."} in a JSON answer held in memory (capped by curl_uv). */
static void hub_error_message(const cuv_xfer *x, char *out, size_t size)
{
    out[0] = '\0';
    if (x->body.p == NULL || x->body.len == 0 || strcasestr(x->content_type, "json") == NULL)
        return;
    cJSON *j = cJSON_ParseWithLength(x->body.p, x->body.len);
    const char *m = cJSON_GetStringValue(cJSON_GetObjectItemCaseSensitive(j, "error"));
    if (m != NULL)
        snprintf(out, size, "%s", m);
    cJSON_Delete(j);
    for (char *p = out; *p; p++)        /* one line in /status and the log, whatever the Hub sent */
        if ((unsigned char)*p < 0x20 || *p == 0x7f)
            *p = ' ';
}

static const char *access_fix(const char *problem)
{
    if (strcmp(problem, "gated") == 0)
        return "the repo is gated: accept its conditions on the Hub with the token's account, or use another repo";
    if (strcmp(problem, "forbidden") == 0)
        return "the token lacks the permission: give it write access to the repo (a fine-grained token needs "
               "'write' on this repo), then set it with HF_TOKEN, --hub-token-file or hub_token_file";
    if (strcmp(problem, "revision_not_found") == 0)
        return "the branch or revision after '@' in --hub hf://<namespace>/<repo>@<revision> does not exist";
    return "set a valid token with HF_TOKEN, --hub-token-file FILE or hub_token_file in the config file, and "
           "check the repo id in --hub hf://<namespace>/<repo>";
}

static int req_writes(const hf_req *r)
{
    return strcmp(r->method, "GET") != 0 && strcmp(r->method, "HEAD") != 0;
}

/* r's answer is an access problem: recorded, logged when it is new (another problem, status or
 * kind of request).  A refused read slows the polls down, doubling up to MAX_BACKOFF; a refused
 * write (a read-only token) leaves them alone: deltas still come in, and the daemon paces its
 * publish retries. */
static void access_failed(hf_hub *h, const hf_req *r, const cuv_xfer *x, const char *problem)
{
    char said[160], q_said[200], q_repo[200], q_fix[400];
    int writes = req_writes(r);
    int is_new = strcmp(h->st.problem, problem) != 0 || h->problem_status != (int)x->status ||
                 h->problem_write != writes;

    hub_error_message(x, said, sizeof(said));
    snprintf(h->st.problem, sizeof(h->st.problem), "%s", problem);
    h->problem_status = (int)x->status;
    h->problem_write = writes;
    snprintf(h->st.last_error, sizeof(h->st.last_error), "%s: HTTP %ld%s%s on %s%s%s%s: the Hub token or the repo id "
             "hf://%s is wrong", problem, x->status, x->error_code[0] ? " " : "", x->error_code, r->route,
             said[0] ? " (" : "", said, said[0] ? ")" : "", h->repo);
    h->st.errors++;
    if (!writes) {
        h->access_backoff = h->access_backoff > 0 ? fmin(2 * h->access_backoff, MAX_BACKOFF)
                                                  : fmin(fmax(h->poll_interval, 1.0), MAX_BACKOFF);
        uint64_t resume = uv_now(h->loop) + (uint64_t)(h->access_backoff * 1000);
        if (resume > h->poll_resume_ms)
            h->poll_resume_ms = resume;
    }
    if (!is_new)
        return;
    char retry[64];
    if (writes)
        snprintf(retry, sizeof(retry), "\"publishing is retried\"");
    else
        snprintf(retry, sizeof(retry), "\"polls back off up to %.0f s\"", MAX_BACKOFF);
    dl_log(DL_LOG_ERROR, "hub", "the Hub refuses access: the token or the repo id is wrong",
           "problem=%s status=%ld code=%s route=%s repo=%s token=%s hub_says=%s fix=%s retry=%s",
           problem, x->status, x->error_code[0] ? x->error_code : "none", r->route,
           dl_log_q(q_repo, sizeof(q_repo), h->repo), h->token != NULL ? "set" : "not_set",
           dl_log_q(q_said, sizeof(q_said), said[0] ? said : "nothing"), dl_log_q(q_fix, sizeof(q_fix), access_fix(problem)),
           retry);
}

/* A request that carried the token was answered: the access problem is over (a refused write only
 * when a write goes through). */
static void access_ok(hf_hub *h, const hf_req *r)
{
    char q[80];
    if (h->st.problem[0] == '\0' || (h->problem_write && !req_writes(r)))
        return;
    dl_log(DL_LOG_INFO, "hub", "the Hub accepts the token again", "repo=%s was=%s",
           dl_log_q(q, sizeof(q), h->repo), h->st.problem);
    h->st.problem[0] = '\0';
    h->problem_status = 0;
    h->problem_write = 0;
    h->access_backoff = 0;
    h->poll_resume_ms = 0;
    h->st.last_error[0] = '\0';
}

static int hf_authorize(remote *rm, remote_req *r, cuv_xfer *x)
{
    hf_hub *h = rm->owner;

    if (r->auth)
        cuv_xfer_bearer(x, h->token);
    return 0;
}

/* Only an answer to our token says something about it (a pre-signed storage URL's 403 does not). */
static int hf_judge(remote *rm, remote_req *r, const cuv_xfer *x)
{
    const char *problem = r->auth ? access_problem(x) : NULL;

    if (problem == NULL)
        return 0;
    access_failed(rm->owner, r, x, problem);
    return 1;
}

static void hf_authorized(remote *rm, remote_req *r)
{
    access_ok(rm->owner, r);
}

static void describe_answer(const cuv_xfer *x, char *out, size_t size)
{
    if (x->result != CURLE_OK)
        snprintf(out, size, "%s", curl_easy_strerror(x->result));
    else
        snprintf(out, size, "HTTP %ld%s%s", x->status, x->error_code[0] ? " " : "", x->error_code);
}

static void hf_complete(remote *rm, remote_req *r, int ok)
{
    ((hf_req_cb)r->cb)(rm->owner, r, ok);
}

static const remote_ops hf_remote_ops = {
    .failure_log = "hub request failed",
    .authorize = hf_authorize,
    .judge = hf_judge,
    .authorized = hf_authorized,
    .describe = describe_answer,
    .complete = hf_complete,
};

/* cb, of this file's type, runs when r ends (remote_go). */
static void req_go(hf_hub *h, hf_req *r, hf_req_cb cb, void *arg)
{
    (void)h;
    remote_go(r, (remote_fn)cb, arg);
}

/* ---- URLs -------------------------------------------------------------------------------------- */

/* quote(s, safe=""): everything but unreserved characters percent-encoded. */
static void url_quote(sbuf *b, const char *s)
{
    static const char hex[] = "0123456789ABCDEF";
    for (; *s; s++) {
        unsigned char c = (unsigned char)*s;
        if ((c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '-' || c == '_' ||
            c == '.' || c == '~') {
            sb_add(b, (const char *)&c, 1);
        } else {
            char e[3] = {'%', hex[c >> 4], hex[c & 15]};
            sb_add(b, e, 3);
        }
    }
}

static char *api_url(hf_hub *h, const char *what, const char *path, const char *query)
{
    sbuf b = {0};
    sb_str(&b, h->endpoint);
    sb_str(&b, "/api/models/");
    sb_str(&b, h->repo);
    sb_str(&b, "/");
    sb_str(&b, what);
    sb_str(&b, "/");
    url_quote(&b, h->rev);
    if (path != NULL) {
        sb_str(&b, "/");
        url_quote(&b, path);
    }
    if (query != NULL)
        sb_str(&b, query);
    return sb_take(&b);
}

static char *resolve_url(hf_hub *h, const char *path)
{
    sbuf b = {0};
    sb_str(&b, h->endpoint);
    sb_str(&b, "/");
    sb_str(&b, h->repo);
    sb_str(&b, "/resolve/");
    url_quote(&b, h->rev);
    sb_str(&b, "/");
    /* path segments keep their slashes */
    for (const char *p = path; *p;) {
        const char *slash = strchr(p, '/');
        size_t n = slash ? (size_t)(slash - p) : strlen(p);
        char seg[256];
        snprintf(seg, sizeof(seg), "%.*s", (int)n, p);
        url_quote(&b, seg);
        if (!slash)
            break;
        sb_str(&b, "/");
        p = slash + 1;
    }
    return sb_take(&b);
}

/* Whether url is on the endpoint: the same scheme, host and port (default ports filled in), no user
 * information, and a path under the endpoint's own path.  Only such URLs may carry the token: a
 * prefix comparison of the strings would let "http://ep:80@evil/" or "https://huggingface.co.evil/"
 * through. */
static int url_on_endpoint(const char *endpoint, const char *url)
{
    CURLU *e = curl_url(), *u = curl_url();
    char *es = NULL, *eh = NULL, *ep = NULL, *epath = NULL, *us = NULL, *uh = NULL, *up = NULL, *upath = NULL;
    char *userinfo = NULL;
    int ok = 0;

    if (e == NULL || u == NULL || curl_url_set(e, CURLUPART_URL, endpoint, 0) != CURLUE_OK ||
        curl_url_set(u, CURLUPART_URL, url, 0) != CURLUE_OK)
        goto out;
    if (curl_url_get(u, CURLUPART_USER, &userinfo, 0) == CURLUE_OK ||
        curl_url_get(u, CURLUPART_PASSWORD, &userinfo, 0) == CURLUE_OK ||
        curl_url_get(u, CURLUPART_OPTIONS, &userinfo, 0) == CURLUE_OK)
        goto out;
    if (curl_url_get(e, CURLUPART_SCHEME, &es, 0) != CURLUE_OK || curl_url_get(u, CURLUPART_SCHEME, &us, 0) != CURLUE_OK ||
        curl_url_get(e, CURLUPART_HOST, &eh, 0) != CURLUE_OK || curl_url_get(u, CURLUPART_HOST, &uh, 0) != CURLUE_OK ||
        curl_url_get(e, CURLUPART_PORT, &ep, CURLU_DEFAULT_PORT) != CURLUE_OK ||
        curl_url_get(u, CURLUPART_PORT, &up, CURLU_DEFAULT_PORT) != CURLUE_OK ||
        curl_url_get(e, CURLUPART_PATH, &epath, 0) != CURLUE_OK || curl_url_get(u, CURLUPART_PATH, &upath, 0) != CURLUE_OK)
        goto out;
    if (strcasecmp(es, us) != 0 || strcasecmp(eh, uh) != 0 || strcmp(ep, up) != 0)
        goto out;
    /* the path: "/" or "/prefix" (trailing slashes ignored) must lead the URL's path */
    size_t pl = strlen(epath);
    while (pl > 0 && epath[pl - 1] == '/')
        pl--;
    ok = strncmp(upath, epath, pl) == 0 && upath[pl] == '/';
out:
    curl_free(userinfo);
    curl_free(es);
    curl_free(eh);
    curl_free(ep);
    curl_free(epath);
    curl_free(us);
    curl_free(uh);
    curl_free(up);
    curl_free(upath);
    curl_url_cleanup(e);
    curl_url_cleanup(u);
    return ok;
}

/* A size from the Hub's JSON: an exact non-negative integer below 2^53, where doubles are exact.
 * Anything else (1e30, -1, 1.5, a string) is refused before the conversion, which would be
 * undefined for values out of uint64_t's range. */
static int json_size(const cJSON *v, uint64_t *out)
{
    if (!cJSON_IsNumber(v))
        return -EINVAL;
    double d = v->valuedouble;
    if (!isfinite(d) || d < 0 || d >= JSON_MAX_EXACT || floor(d) != d)
        return -EINVAL;
    *out = (uint64_t)d;
    return 0;
}

/* ---- seen (path, oid) ------------------------------------------------------------------------ */







/* Whatever the daemon decided, a downloaded (path, oid) is never downloaded again.  A download is
 * verified against the listing, so one that intake finds short is final: rejected. */
static int hf_mark_done(hub *base, const char *rel, hub_outcome outcome, const hub_version *v)
{
    (void)v;
    return remote_seen_decided(&((hf_hub *)base)->seen, rel, outcome);
}

/* ---- downloads ------------------------------------------------------------------------------- */

static void listed_free(listed_file *l, size_t n)
{
    for (size_t i = 0; i < n; i++)
        free(l[i].rel);
    free(l);
}

static void candidate_free(candidate *c)
{
    free(c->rel);
    free(c->oid);
    free(c->part);
    listed_free(c->listed, c->nlisted);
    free(c);
}

static void dset_finished(hf_hub *h, hub_set *set, int ok);

/* A candidate given up on (or cancelled): a shard takes its set down with it. */
/* The global was not taken (its listing, download or set given up): the next poll lists global/
 * again even if the revision has not moved, instead of waiting for a commit that may never come. */
static void global_given_up(hf_hub *h)
{
    h->global_download = 0;
    h->st.head[0] = '\0';
}

static void candidate_abandon(hf_hub *h, candidate *c)
{
    if (c->set != NULL)
        dset_finished(h, c->set, 0);
    candidate_free(c);
}

static void pump_downloads(hf_hub *h);

/* A failed download waits for a later poll, longer after each failure (1, 2, 4 ... 60 s with
 * jitter): a Hub that keeps failing is not hammered at the poll interval. */
static void retry_later(hf_hub *h, candidate *c)
{
    int k = c->attempts > 1 ? c->attempts - 1 : 0;
    double wait = remote_jittered(fmin(ldexp(1.0, k < 16 ? k : 16), MAX_BACKOFF));
    c->not_before = uv_now(h->loop) + (uint64_t)(wait * 1000);
    c->next = h->retry;
    h->retry = c;
}

typedef struct verify_job {
    hf_hub *h;
    candidate *c;
    int ok;
    char why[160];
} verify_job;

/* sha256 of the content (LFS) or the git blob sha1 ("blob <size>\0" + content). */
static int hash_file(const char *path, int git_sha1, uint64_t size, char *hex, size_t hexlen)
{
    static const char digits[] = "0123456789abcdef";
    EVP_MD_CTX *ctx = EVP_MD_CTX_new();
    unsigned char md[EVP_MAX_MD_SIZE], *buf = malloc(1 << 20);
    unsigned mdlen = 0;
    int fd = open(path, O_RDONLY | O_CLOEXEC), rc = -1;

    if (ctx == NULL || buf == NULL || fd < 0 || EVP_DigestInit_ex(ctx, git_sha1 ? EVP_sha1() : EVP_sha256(), NULL) != 1)
        goto out;
    if (git_sha1) {
        char head[48];
        int n = snprintf(head, sizeof(head), "blob %" PRIu64, size);
        EVP_DigestUpdate(ctx, head, (size_t)n + 1);     /* with the NUL */
    }
    for (;;) {
        ssize_t r = read(fd, buf, 1 << 20);
        if (r < 0 && errno == EINTR)
            continue;
        if (r < 0)
            goto out;
        if (r == 0)
            break;
        EVP_DigestUpdate(ctx, buf, (size_t)r);
    }
    if (EVP_DigestFinal_ex(ctx, md, &mdlen) != 1 || hexlen < 2 * mdlen + 1)
        goto out;
    for (unsigned i = 0; i < mdlen; i++) {
        hex[2 * i] = digits[md[i] >> 4];
        hex[2 * i + 1] = digits[md[i] & 15];
    }
    hex[2 * mdlen] = '\0';
    rc = 0;
out:
    if (fd >= 0)
        close(fd);
    free(buf);
    EVP_MD_CTX_free(ctx);
    return rc;
}

static void verify_work(pool_job *pj)
{
    verify_job *j = pj->arg;
    candidate *c = j->c;
    struct stat sb;
    char hex[130];

    if (stat(c->part, &sb) != 0 || (uint64_t)sb.st_size != c->size) {
        snprintf(j->why, sizeof(j->why), "size %lld, the listing says %" PRIu64, (long long)sb.st_size, c->size);
        return;
    }
    if (hash_file(c->part, !c->lfs, c->size, hex, sizeof(hex)) != 0) {
        snprintf(j->why, sizeof(j->why), "cannot hash the download");
        return;
    }
    if (strcmp(hex, c->oid) != 0) {
        snprintf(j->why, sizeof(j->why), "%s %s, the listing says %s", c->lfs ? "sha256" : "git sha1", hex, c->oid);
        return;
    }
    j->ok = 1;
}

static void verify_after(pool_job *pj)
{
    verify_job *j = pj->arg;
    int status = pj->cancelled ? UV_ECANCELED : 0;
    hf_hub *h = j->h;
    candidate *c = j->c;
    char q[300];

    h->active_downloads--;
    if (status == 0 && j->ok && !h->closing) {
        h->st.downloads++;
        h->st.download_bytes += c->size;
        char qp[600], qo[100];
        /* quoted: a hex id of digits only would become a (rounded) JSON number */
        dl_log(DL_LOG_DEBUG, "hub", "delta downloaded", "path=%s bytes=%" PRIu64 " oid=%s",
               dl_log_q(qp, sizeof(qp), c->rel), c->size, dl_log_q(qo, sizeof(qo), c->oid));
        if (c->set != NULL) {
            dset_finished(h, c->set, 1);
        } else if (c->is_global) {
            h->global_download = 0;
            remote_global_handed(&h->gate, c->step, c->ver, uv_now(h->loop), h->poll_interval);
            h->cb.global_ready(h->app, c->step, c->part);
        } else {
            hub_delta d = {.rel = c->rel, .path = c->part, .root = NULL, .owned = 1};
            h->cb.delta_ready(h->app, &d);
        }
        candidate_free(c);
    } else {
        if (status == 0 && !h->closing) {
            char qp[600];
            dl_log(DL_LOG_WARN, "hub", "download does not match the listing, discarded", "path=%s reason=%s",
                   dl_log_q(qp, sizeof(qp), c->rel), dl_log_q(q, sizeof(q), j->why));
            h->st.errors++;
            snprintf(h->st.last_error, sizeof(h->st.last_error), "%s: %s", c->rel, j->why);
        }
        unlink(c->part);
        c->have = 0;
        if (++c->attempts < MAX_ATTEMPTS_DOWNLOAD && !h->closing) {
            retry_later(h, c);      /* a later poll tries it again */
        } else {
            if (c->set == NULL)
                remote_seen_set(&h->seen, c->rel, c->ver, SEEN_REJECTED);     /* given up for this run */
            if (c->is_global)
                global_given_up(h);         /* the next poll starts the adoption over */
            candidate_abandon(h, c);
        }
    }
    free(j);
    pump_downloads(h);
}

static void download_done(hf_hub *h, hf_req *r, int ok)
{
    candidate *c = r->arg;
    long status = r->x != NULL ? r->x->status : 0;
    int range_ignored = c->have > 0 && status == 200;
    int too_big = r->x != NULL && r->x->too_big;
    int fd = r->sink_fd;

    remote_req_end(r);              /* frees r and its transfer: only the copies above from here on */
    close(fd);
    if (too_big && !h->closing) {
        char qp[600];
        dl_log(DL_LOG_WARN, "hub", "download larger than the listing, discarded", "path=%s listed=%" PRIu64,
               dl_log_q(qp, sizeof(qp), c->rel), c->size);
        snprintf(h->st.last_error, sizeof(h->st.last_error), "%s: the Hub sent more than the listed %" PRIu64 " bytes",
                 c->rel, c->size);
    }
    if (!ok || range_ignored || h->closing) {
        h->active_downloads--;
        if (range_ignored || status == 416 || too_big)
            unlink(c->part);    /* start over: the server would not resume, or sent garbage */
        if (!h->closing && ++c->attempts < MAX_ATTEMPTS_DOWNLOAD) {
            retry_later(h, c);
        } else {
            if (c->is_global)
                global_given_up(h);
            candidate_abandon(h, c);
        }
        pump_downloads(h);
        return;
    }
    verify_job *j = calloc(1, sizeof(*j));
    if (j == NULL) {
        h->active_downloads--;
        candidate_abandon(h, c);
        return;
    }
    j->h = h;
    j->c = c;
    if (job_queue(&h->jobs, verify_work, verify_after, j) != 0) {
        h->active_downloads--;
        free(j);
        candidate_abandon(h, c);
    }
}

static void start_download(hf_hub *h, candidate *c)
{
    char *url = resolve_url(h, c->rel);
    struct stat sb;
    int fd;
    hf_req *r;

    if (c->part == NULL && asprintf(&c->part, "%s/cache/incoming/hf-%s.part", h->state_dir, c->oid) < 0)
        c->part = NULL;
    /* a small open of our own cache file; the data goes through uv_fs_write */
    fd = c->part ? open(c->part, O_WRONLY | O_CREAT | O_CLOEXEC, 0644) : -1;
    if (url == NULL || fd < 0 || fstat(fd, &sb) != 0 || (r = req_new(h, "GET", url, "download")) == NULL) {
        free(url);
        if (fd >= 0)
            close(fd);
        candidate_abandon(h, c);
        return;
    }
    free(url);
    c->have = (uint64_t)sb.st_size;
    if (c->have > c->size) {
        c->have = 0;
        if (ftruncate(fd, 0) != 0) {
            close(fd);
            remote_req_end(r);
            candidate_abandon(h, c);
            return;
        }
    }
    if (c->have > 0) {
        char range[64];
        snprintf(range, sizeof(range), "Range: bytes=%" PRIu64 "-", c->have);
        remote_req_header(r, range);
    }
    r->sink_fd = fd;
    r->sink_off = c->have;
    r->sink_max = c->size;      /* the listing's size is all the file may be */
    r->sink_capped = 1;
    r->follow = 1;
    r->api = 0;
    r->max_attempts = 1;        /* resume is driven here, with a fresh Range each time */
    h->active_downloads++;
    req_go(h, r, download_done, c);
}

/* ---- peeking at a delta's header ------------------------------------------------------------- */

static void peek_done(hf_hub *h, hf_req *r, int ok)
{
    candidate *c = r->arg;
    cuv_xfer *x = r->x;
    int decided = 0;

    h->active_downloads--;
    if (ok && x != NULL && x->body.len >= 8) {
        const unsigned char *b = (const unsigned char *)x->body.p;
        uint64_t n = 0, want = 0;
        for (int i = 7; i >= 0; i--)
            n = (n << 8) | b[i];
        st_header *hd = NULL;
        const char *why = NULL;
        char whybuf[160];
        if (n > h->max_header) {
            snprintf(whybuf, sizeof(whybuf), "header of %" PRIu64 " bytes, the cap is %" PRIu64, n, h->max_header);
            why = whybuf;
        } else if (c->size < 8 || n > c->size - 8) {
            snprintf(whybuf, sizeof(whybuf), "header of %" PRIu64 " bytes in a file of %" PRIu64, n, c->size);
            why = whybuf;
        } else if (8 + n <= x->body.len && st_header_parse_unsized(x->body.p + 8, (size_t)n, &hd, NULL) == 0 &&
                   (st_header_file_len(hd, &want) != 0 || want != c->size)) {
            snprintf(whybuf, sizeof(whybuf), "the header describes a file of %" PRIu64 " bytes, the listing says %" PRIu64,
                     want, c->size);
            why = whybuf;
        }
        if (why != NULL) {
            /* never downloaded: refused for this run (a restart with another cap looks again) */
            char q[200], qp[600];
            dl_log(DL_LOG_WARN, "hub", "delta refused before download", "path=%s reason=%s",
                   dl_log_q(qp, sizeof(qp), c->rel), dl_log_q(q, sizeof(q), why));
            h->st.errors++;
            snprintf(h->st.last_error, sizeof(h->st.last_error), "%s: %s", c->rel, why);
            remote_seen_set(&h->seen, c->rel, c->ver, SEEN_REJECTED);
            decided = 1;
        } else if (hd != NULL) {
            size_t vl;
            const char *v = st_header_meta(hd, "base_outer_step", &vl);
            uint64_t base;
            if (v != NULL && delta_parse_int(v, vl, &base) == 0) {
                if (base < h->step) {
                    char qp[600];
                    dl_log(DL_LOG_DEBUG, "hub", "stale delta not downloaded", "path=%s base_outer_step=%" PRIu64,
                           dl_log_q(qp, sizeof(qp), c->rel), base);
                    remote_seen_done(&h->seen, c->rel, c->ver);
                    decided = 1;
                } else if (base > h->step) {
                    /* not ours yet (or never): look again at a later poll */
                    remote_seen_set(&h->seen, c->rel, c->ver, SEEN_INCOMPLETE);
                    decided = 1;
                }
            }
        }
        st_header_free(hd);
    }
    remote_req_end(r);
    if (decided) {
        candidate_free(c);
    } else {
        /* current step, or a header we could not read: the full download and intake decide */
        c->next = h->queue;
        h->queue = c;
        c->peeked = 1;          /* a retry after a failed download goes straight to the download */
    }
    pump_downloads(h);
}

static void start_peek(hf_hub *h, candidate *c)
{
    char *url = resolve_url(h, c->rel);
    hf_req *r = url ? req_new(h, "GET", url, "peek") : NULL;
    free(url);
    if (r == NULL) {
        candidate_free(c);
        return;
    }
    /* never more than the listing says the file has; a server that ignores the Range and sends more
     * fails the peek, and the (capped) download and the intake decide */
    uint64_t want = c->size < PEEK_BYTES ? c->size : PEEK_BYTES;
    char range[48];
    snprintf(range, sizeof(range), "Range: bytes=0-%" PRIu64, want > 0 ? want - 1 : 0);
    remote_req_header(r, range);
    r->body_cap = (size_t)(want > 0 ? want : 1);
    r->follow = 1;
    r->api = 0;
    r->max_attempts = 2;
    h->active_downloads++;
    req_go(h, r, peek_done, c);
}

/* ---- sharded sets ------------------------------------------------------------------------------ */

/* A set's version for the seen list (hub_set.h): the index's oid and every listed shard of its base
 * (path, oid, size). */
static int set_version(const char *index_oid, const listed_file *l, size_t n, char *out, size_t size)
{
    hub_set_version v;

    hub_set_version_start(&v, index_oid);
    for (size_t i = 0; i < n; i++)
        hub_set_version_add(&v, l[i].rel, l[i].oid, l[i].size);
    return hub_set_version_end(&v, out, size);
}

/* One shard candidate of set finished (ok: verified); after the last one the set is handed over,
 * or, when a shard failed, dropped as a whole (not taken this run). */
static void dset_finished(hf_hub *h, hub_set *set, int ok)
{
    if (!hub_set_shard_done(set, ok, SEEN_REJECTED))
        return;
    if (set->failed || h->closing) {
        /* a stop keeps the directory: the next start resumes the shards there */
        if (!h->closing) {
            char qp[600];
            dl_log(DL_LOG_INFO, "hub", "sharded set not taken: a shard could not be downloaded", "path=%s",
                   dl_log_q(qp, sizeof(qp), set->rel));
        }
        if (set->is_global)
            global_given_up(h);
        else
            remote_seen_set(&h->seen, set->rel, set->ver, SEEN_REJECTED);
        hub_set_drop(&h->sets, set, h->closing);
        return;
    }
    if (set->is_global) {
        h->global_download = 0;
        remote_global_handed(&h->gate, set->step, set->ver, uv_now(h->loop), h->poll_interval);
        h->cb.global_ready(h->app, set->step, set->index_path);
    } else {
        hub_set_hand_over(set, &h->cb, h->app);
    }
    hub_set_free(&h->sets, set);
}

/* The set's directory, <state>/cache/incoming/hf-set-<version>.set, with the index written into it. */
static hub_set *dset_new(hf_hub *h, const candidate *c, const char *text, size_t len)
{
    char *dir = NULL;
    dl_error err = {0};
    hub_set *set;

    if (asprintf(&dir, "%s/cache/incoming/hf-%s%s.set", h->state_dir, c->is_global ? "global-" : "", c->ver) < 0)
        dir = NULL;
    set = hub_set_new(&h->sets, dir, c->rel, c->ver, c->is_global, c->step, text, len, &err);
    if (set == NULL && err.code != DL_E_NO_MEMORY)
        set_error(h, "cannot store the index of %s: %s", c->rel, err.message);
    return set;
}

static const listed_file *listed_shard(const candidate *c, const char *name)
{
    for (size_t i = 0; i < c->nlisted; i++)
        if (hub_set_path_names(c->listed[i].rel, name))
            return &c->listed[i];
    return NULL;
}

static int shard_listed(const void *c, const char *name, uint64_t *bytes)
{
    const listed_file *l = listed_shard(c, name);

    *bytes = l ? l->size : 0;
    return l != NULL;
}

/* The set is given up for this version (a later listing with other files has another). */
static void set_drop(hf_hub *h, candidate *c, seen_state state)
{
    if (c->is_global)
        global_given_up(h);
    else
        remote_seen_set(&h->seen, c->rel, c->ver, state);
    candidate_free(c);
}

/* The index is parsed: the stale or later round's set is judged here (as a single delta's peek
 * judges it), a partial set waits for a listing that shows every shard, and a complete one gets a
 * directory and one candidate per shard. */
static void set_start_shards(hf_hub *h, candidate *c, const st_index *ix, const char *text, size_t len)
{
    char name[ST_INDEX_BASE_MAX + 48], q[300], qp[600];
    uint64_t base, total;
    int verdict = c->is_global ? 0 : hub_set_base_verdict(ix, h->step, &base);

    if (verdict < 0) {
        dl_log(DL_LOG_DEBUG, "hub", "stale delta not downloaded", "path=%s base_outer_step=%" PRIu64,
               dl_log_q(qp, sizeof(qp), c->rel), base);
        remote_seen_done(&h->seen, c->rel, c->ver);
        candidate_free(c);
        return;
    }
    if (verdict > 0) {
        set_drop(h, c, SEEN_INCOMPLETE);
        return;
    }
    if (hub_set_listed_shards(ix, shard_listed, c, name, sizeof(name), &total)) {
        dl_log(DL_LOG_DEBUG, "hub", "sharded set incomplete, waiting for its shards", "path=%s missing=%s",
               dl_log_q(qp, sizeof(qp), c->rel), dl_log_q(q, sizeof(q), name));
        set_drop(h, c, SEEN_REJECTED);
        return;
    }
    if (!c->is_global && h->limits.delta_set_bytes != 0 && total > h->limits.delta_set_bytes) {
        /* refused from the listing, before a byte: this version of the set is not looked at again */
        snprintf(q, sizeof(q), "its shards are %" PRIu64 " bytes together, a delta of this model at most %" PRIu64,
                 total, h->limits.delta_set_bytes);
        dl_log(DL_LOG_WARN, "hub", "delta refused before download", "path=%s reason=\"%s\"",
               dl_log_q(qp, sizeof(qp), c->rel), q);
        set_error(h, "%s: %s", c->rel, q);
        set_drop(h, c, SEEN_REJECTED);
        return;
    }
    hub_set *set = dset_new(h, c, text, len);
    if (set == NULL) {
        set_drop(h, c, SEEN_REJECTED);
        return;
    }
    set->pending = ix->nshards;
    for (uint32_t i = 0; i < ix->nshards; i++) {
        st_index_shard_name(ix->base, i, ix->nshards, name, sizeof(name));
        const listed_file *l = listed_shard(c, name);
        candidate *s = calloc(1, sizeof(*s));
        if (s != NULL && asprintf(&s->part, "%s/%s", set->dir, name) < 0)
            s->part = NULL;
        if (s == NULL || s->part == NULL || (s->rel = strdup(l->rel)) == NULL || (s->oid = strdup(l->oid)) == NULL) {
            if (s != NULL)
                candidate_free(s);
            dset_finished(h, set, 0);
            continue;
        }
        snprintf(s->ver, sizeof(s->ver), "%s", l->oid);
        s->size = l->size;
        s->lfs = l->lfs;
        s->set = set;
        s->peeked = 1;
        s->next = h->queue;
        h->queue = s;
    }
    candidate_free(c);
}

/* The git blob sha1 (or sha256 for an LFS file) of an index read into memory. */
static int hash_mem(const char *p, size_t len, int git_sha1, char *hex, size_t hexlen)
{
    static const char digits[] = "0123456789abcdef";
    unsigned char md[EVP_MAX_MD_SIZE];
    unsigned mdlen = 0;
    char head[48];
    int n = snprintf(head, sizeof(head), "blob %zu", len);
    EVP_MD_CTX *ctx = EVP_MD_CTX_new();
    int bad = ctx == NULL || EVP_DigestInit_ex(ctx, git_sha1 ? EVP_sha1() : EVP_sha256(), NULL) != 1 ||
              (git_sha1 && EVP_DigestUpdate(ctx, head, (size_t)n + 1) != 1) ||
              EVP_DigestUpdate(ctx, p, len) != 1 || EVP_DigestFinal_ex(ctx, md, &mdlen) != 1 ||
              hexlen < 2 * mdlen + 1;
    EVP_MD_CTX_free(ctx);
    if (bad)
        return -1;
    for (unsigned i = 0; i < mdlen; i++) {
        hex[2 * i] = digits[md[i] >> 4];
        hex[2 * i + 1] = digits[md[i] & 15];
    }
    hex[2 * mdlen] = '\0';
    return 0;
}

/* On the pool: the download is the blob the listing named (its git sha1, or sha256 for LFS). */
static int index_matches_listing(const hub_index_job *j)
{
    const candidate *c = j->arg;
    char hex[130];

    return j->len == c->size && hash_mem(j->text, j->len, !c->lfs, hex, sizeof(hex)) == 0 && strcmp(hex, c->oid) == 0
               ? 0
               : -1;
}

/* A failed index download, or one that is not the listed blob: tried again a few times. */
static void index_retry(hf_hub *h, candidate *c)
{
    if (++c->attempts < MAX_ATTEMPTS_DOWNLOAD)
        retry_later(h, c);
    else
        set_drop(h, c, SEEN_REJECTED);
}

/* The index checked and parsed (hub_set_parse_index): the download stays counted in
 * active_downloads until here. */
static void index_parsed(hub_index_job *j)
{
    hf_hub *h = j->owner;
    candidate *c = j->arg;
    char qp[600];

    h->active_downloads--;
    if (h->closing || j->cancelled) {
        candidate_free(c);
    } else if (j->mismatch) {
        dl_log(DL_LOG_WARN, "hub", "download does not match the listing, discarded", "path=%s",
               dl_log_q(qp, sizeof(qp), c->rel));
        set_error(h, "%s: the download does not match the listing's size and oid", c->rel);
        index_retry(h, c);
    } else if (j->rc == 0) {
        set_start_shards(h, c, j->ix, j->text, j->len);
    } else if (c->is_global) {
        set_error(h, "the Hub's global index: %s", j->err.message);
        set_drop(h, c, SEEN_REJECTED);
    } else {
        /* handed over alone: intake refuses it with the reason, once for this version */
        hub_set *set = dset_new(h, c, j->text, j->len);
        if (set == NULL) {
            set_drop(h, c, SEEN_REJECTED);
        } else {
            candidate_free(c);
            dset_finished(h, set, 1);
        }
    }
    hub_index_job_free(j);
    if (!h->closing)
        pump_downloads(h);
}

static void index_done(hf_hub *h, hf_req *r, int ok)
{
    candidate *c = r->arg;
    cuv_xfer *x = r->x;
    char qp[600];

    if (h->closing) {
        h->active_downloads--;
        remote_req_end(r);
        candidate_free(c);
        return;
    }
    if (!ok || x == NULL || x->status != 200) {
        h->active_downloads--;
        if (ok && x != NULL) {
            dl_log(DL_LOG_WARN, "hub", "download does not match the listing, discarded", "path=%s",
                   dl_log_q(qp, sizeof(qp), c->rel));
            set_error(h, "%s: the download does not match the listing's size and oid", c->rel);
        }
        remote_req_end(r);
        index_retry(h, c);
        pump_downloads(h);
        return;
    }
    size_t len = x->body.len;
    char *text = sb_take(&x->body);
    remote_req_end(r);
    size_t cap = hub_set_index_cap(&h->limits, c->is_global);
    hub_index_job *j = hub_index_job_new(text, len, c->rel, cap, index_parsed, h, c);
    if (j != NULL)
        j->verify = index_matches_listing;
    if (j == NULL || hub_index_job_queue(&h->jobs, j) != 0) {
        hub_index_job_free(j);
        h->active_downloads--;
        set_drop(h, c, SEEN_REJECTED);
        pump_downloads(h);
        return;
    }
}

/* An index is read whole into memory, capped as huggingface_hub caps it. */
static void start_index(hf_hub *h, candidate *c)
{
    char *url, line[160];
    size_t cap = hub_set_index_cap(&h->limits, c->is_global);
    hf_req *r;

    if (c->size > cap) {
        char qp[600], q[300];
        snprintf(line, sizeof(line), "an index of %" PRIu64 " bytes, the cap is %zu", c->size, cap);
        dl_log(DL_LOG_WARN, "hub", "delta refused before download", "path=%s reason=%s",
               dl_log_q(qp, sizeof(qp), c->rel), dl_log_q(q, sizeof(q), line));
        set_error(h, "%s: %s", c->rel, line);
        set_drop(h, c, SEEN_REJECTED);
        return;
    }
    url = resolve_url(h, c->rel);
    r = url ? req_new(h, "GET", url, "index") : NULL;
    free(url);
    if (r == NULL) {
        set_drop(h, c, SEEN_REJECTED);
        return;
    }
    r->body_cap = (size_t)(c->size > 0 ? c->size : 1);
    r->follow = 1;
    r->api = 0;
    r->max_attempts = 2;
    h->active_downloads++;
    req_go(h, r, index_done, c);
}

/* After the listing's last page: each listed index with the shards listed next to it (same node
 * and step) becomes one candidate, unless this version of the set was handled. */
static void sets_from_listing(hf_hub *h)
{
    for (size_t i = 0; i < h->nlidx; i++) {
        listed_file *ix = &h->lidx[i];
        listed_file *l = NULL;
        size_t n = 0;
        char ver[80];
        int created, oom = 0;

        for (size_t k = 0; k < h->nlshards && !oom; k++) {
            const listed_file *e = &h->lshards[k];
            if (e->local_step != ix->local_step || strcmp(e->node, ix->node) != 0)
                continue;
            listed_file *nl = realloc(l, (n + 1) * sizeof(*nl));
            if (nl == NULL || (nl[n] = *e, nl[n].rel = strdup(e->rel)) == NULL) {
                oom = 1;
                if (nl != NULL)
                    l = nl;
                break;
            }
            l = nl;
            n++;
        }
        if (oom || set_version(ix->oid, l, n, ver, sizeof(ver)) != 0) {
            listed_free(l, n);
            continue;
        }
        char *k = remote_seen_key(ix->rel, ver);
        seen_entry *se = k ? seen_find(&h->seen.map, k) : NULL;
        if (k == NULL || (se != NULL && se->state != SEEN_INCOMPLETE) || h->list_new >= MAX_NEW_PER_LISTING) {
            h->list_cut |= k != NULL && se == NULL;
            free(k);
            listed_free(l, n);
            continue;
        }
        if (se == NULL)
            se = seen_get(&h->seen.map, k, &created);
        free(k);
        candidate *c = se ? calloc(1, sizeof(*c)) : NULL;
        if (c == NULL || (c->rel = strdup(ix->rel)) == NULL || (c->oid = strdup(ix->oid)) == NULL) {
            if (c != NULL)
                candidate_free(c);
            listed_free(l, n);
            continue;
        }
        h->list_new++;
        se->state = SEEN_PENDING;
        snprintf(c->ver, sizeof(c->ver), "%s", ver);
        c->size = ix->size;
        c->lfs = ix->lfs;
        c->is_set = 1;
        c->listed = l;
        c->nlisted = n;
        c->next = h->queue;
        h->queue = c;
    }
}

static void listing_reset(hf_hub *h)
{
    listed_free(h->lidx, h->nlidx);
    listed_free(h->lshards, h->nlshards);
    h->lidx = h->lshards = NULL;
    h->nlidx = h->nlshards = 0;
}

/* Remembers an index or a shard of the listing in progress (capped: the rest waits). */
static void remember_listed(hf_hub *h, const delta_path *dp, const char *path, const char *oid, uint64_t size,
                            int lfs)
{
    listed_file **arr = dp->kind == DELTA_PATH_INDEX ? &h->lidx : &h->lshards;
    size_t *n = dp->kind == DELTA_PATH_INDEX ? &h->nlidx : &h->nlshards;

    if (*n >= MAX_LISTED_SET_FILES) {
        h->list_cut = 1;
        return;
    }
    listed_file *na = realloc(*arr, (*n + 1) * sizeof(*na));
    if (na == NULL)
        return;
    *arr = na;
    listed_file *f = &na[*n];
    memset(f, 0, sizeof(*f));
    if ((f->rel = strdup(path)) == NULL)
        return;
    snprintf(f->oid, sizeof(f->oid), "%s", oid);
    f->size = size;
    f->lfs = lfs;
    snprintf(f->node, sizeof(f->node), "%s", dp->node_id);
    f->local_step = dp->local_step;
    (*n)++;
}

static void pump_downloads(hf_hub *h)
{
    while (!h->closing && h->queue != NULL && h->active_downloads < h->max_downloads) {
        candidate *c = h->queue;
        h->queue = c->next;
        c->next = NULL;
        if (c->is_set) {
            start_index(h, c);
        } else if (c->peeked || c->is_global) {
            start_download(h, c);
        } else {
            start_peek(h, c);
        }
    }
}

/* ---- polling ----------------------------------------------------------------------------------- */

/* Takes a listed delta as a candidate.  -EINVAL when a delta path comes with an unusable size. */
static int consider_entry(hf_hub *h, const cJSON *e)
{
    const char *type = cJSON_GetStringValue(cJSON_GetObjectItemCaseSensitive(e, "type"));
    const char *path = cJSON_GetStringValue(cJSON_GetObjectItemCaseSensitive(e, "path"));
    const char *oid = cJSON_GetStringValue(cJSON_GetObjectItemCaseSensitive(e, "oid"));
    const cJSON *lfs = cJSON_GetObjectItemCaseSensitive(e, "lfs");
    const cJSON *size = cJSON_GetObjectItemCaseSensitive(e, "size");
    delta_path dp;
    uint64_t nbytes, lfs_bytes;
    int created;

    if (type == NULL || strcmp(type, "file") != 0 || path == NULL || delta_parse_any_path(path, &dp, NULL) != 0)
        return 0;
    if (oid == NULL || json_size(size, &nbytes) != 0)
        return -EINVAL;
    if (cJSON_IsObject(lfs)) {
        const char *loid = cJSON_GetStringValue(cJSON_GetObjectItemCaseSensitive(lfs, "oid"));
        const cJSON *lsize = cJSON_GetObjectItemCaseSensitive(lfs, "size");
        if (loid == NULL || strlen(loid) != 64)
            return -EINVAL;
        if (lsize != NULL && (json_size(lsize, &lfs_bytes) != 0 || lfs_bytes != nbytes))
            return -EINVAL;     /* two sizes for one file: which one would we cap the download at? */
        oid = loid;
    } else if (strlen(oid) != 40) {
        return -EINVAL;
    }
    for (const char *p = oid; *p; p++)
        if (!((*p >= '0' && *p <= '9') || (*p >= 'a' && *p <= 'f')))
            return -EINVAL;     /* hostile: the oid names a file in our cache */
    if (dp.kind != DELTA_PATH_SINGLE) {
        /* an index or a shard: matched up after the last page (sets_from_listing) */
        remember_listed(h, &dp, path, oid, nbytes, cJSON_IsObject(lfs));
        return 0;
    }
    char *k = remote_seen_key(path, oid);
    seen_entry *se = k ? seen_find(&h->seen.map, k) : NULL;
    if (k == NULL || (se != NULL && se->state != SEEN_INCOMPLETE)) {
        free(k);
        return 0;               /* done, rejected for this run, or in flight */
    }
    if (h->list_new >= MAX_NEW_PER_LISTING) {
        h->list_cut = 1;        /* not remembered: the next listing offers it again */
        free(k);
        return 0;
    }
    if (se == NULL)
        se = seen_get(&h->seen.map, k, &created);
    free(k);
    if (se == NULL)
        return 0;
    h->list_new++;
    se->state = SEEN_PENDING;
    candidate *c = calloc(1, sizeof(*c));
    if (c == NULL || (c->rel = strdup(path)) == NULL || (c->oid = strdup(oid)) == NULL) {
        if (c)
            candidate_free(c);
        return 0;
    }
    snprintf(c->ver, sizeof(c->ver), "%s", oid);
    c->size = nbytes;
    c->lfs = cJSON_IsObject(lfs);
    c->next = h->queue;
    h->queue = c;
    return 0;
}

static void list_page(hf_hub *h, const char *url);

static void list_done(hf_hub *h, hf_req *r, int ok)
{
    cuv_xfer *x = r->x;
    char next[2048] = "";

    if (ok && x != NULL && x->status == 200 && strcasestr(x->content_type, "json") == NULL) {
        set_error(h, "tree listing: Content-Type \"%s\" is not JSON", x->content_type);
        h->st.head[0] = '\0';
    } else if (ok && x != NULL && x->status == 200) {
        cJSON *arr = cJSON_ParseWithLength(x->body.p ? x->body.p : "", x->body.len), *e;
        if (cJSON_IsArray(arr)) {
            unsigned bad = 0;
            cJSON_ArrayForEach(e, arr)
                bad += consider_entry(h, e) != 0;
            if (bad > 0) {
                /* a broken entry is skipped, not remembered: list again until the Hub mends it */
                set_error(h, "tree listing: %u delta entries with an unusable size or oid ignored", bad);
                h->st.head[0] = '\0';
            }
        } else {
            set_error(h, "tree listing is not a JSON array");
            h->st.head[0] = '\0';     /* list again at the next poll, even if the head does not move */
        }
        cJSON_Delete(arr);
        /* The next page gets our token: it must be on the endpoint (a hostile or intercepted answer
         * could point anywhere).  A refused or endless Link is an incomplete listing: list again. */
        if (x->link_bad || (x->link_next[0] && !url_on_endpoint(h->endpoint, x->link_next))) {
            char q[300];
            set_error(h, "tree listing: the next page %s is not on the endpoint, not followed",
                      dl_log_q(q, sizeof(q), x->link_bad ? "(too long)" : x->link_next));
            h->st.head[0] = '\0';
        } else if (x->link_next[0] && ++h->list_pages >= MAX_LIST_PAGES) {
            set_error(h, "tree listing: more than %d pages, cut", MAX_LIST_PAGES);
            h->st.head[0] = '\0';
        } else if (x->link_next[0]) {
            snprintf(next, sizeof(next), "%s", x->link_next);
        }
        if (h->list_cut)
            h->st.head[0] = '\0';     /* the rest at the next poll */
    } else if (x != NULL && x->status == 404) {
        /* no nodes/ directory yet: no worker has uploaded */
    } else {
        h->st.head[0] = '\0';         /* a failed page: list again at the next poll */
    }
    remote_req_end(r);
    if (next[0] && !h->closing) {
        list_page(h, next);
        return;
    }
    sets_from_listing(h);
    listing_reset(h);
    h->polling = 0;
    pump_downloads(h);
}

static void list_page(hf_hub *h, const char *url)
{
    hf_req *r = req_new(h, "GET", url, "tree");
    if (r == NULL) {
        listing_reset(h);
        h->polling = 0;
        return;
    }
    req_go(h, r, list_done, NULL);
}

static void adopt_download(hf_hub *h);

static void stepfile_done(hf_hub *h, hf_req *r, int ok)
{
    cuv_xfer *x = r->x;
    uint64_t step;
    int list = r->arg != NULL, sharded = 0;

    if (ok && x != NULL && x->status == 200 &&
        stepcount_parse(x->body.p ? x->body.p : "", x->body.len, &step, NULL, &sharded, NULL) == 0) {
        h->adopt_sharded = sharded;
        if (h->published_known != (int64_t)step) {
            h->published_known = (int64_t)step;
            h->cb.published_seen(h->app, (int64_t)step);
        }
    } else if (x != NULL && x->status == 404) {
        if (!h->told_none) {
            h->told_none = 1;
            h->cb.published_seen(h->app, -1);  /* no global on the Hub yet */
        }
    } else {
        h->st.head[0] = '\0';         /* unreadable: look again at the next poll */
    }
    remote_req_end(r);
    if (h->waiting && h->published_known >= 0 && !h->global_download) {
        adopt_download(h);
        h->polling = 0;
        return;
    }
    if (list && !h->closing && !h->waiting) {
        char *url = api_url(h, "tree", "nodes", "?recursive=true&expand=false");
        h->list_pages = 0;
        h->list_new = 0;
        h->list_cut = 0;
        listing_reset(h);
        if (url != NULL) {
            list_page(h, url);
            free(url);
            return;
        }
    }
    h->polling = 0;
    pump_downloads(h);
}

static void fetch_stepfile(hf_hub *h, int then_list)
{
    char *url = resolve_url(h, "global/step_count.json");
    hf_req *r = url ? req_new(h, "GET", url, "step_file") : NULL;
    free(url);
    if (r == NULL) {
        h->polling = 0;
        return;
    }
    r->follow = 1;
    r->api = 0;
    r->max_attempts = 2;
    r->body_cap = STEPFILE_BODY_CAP;
    req_go(h, r, stepfile_done, then_list ? (void *)1 : NULL);
}

static void revision_done(hf_hub *h, hf_req *r, int ok)
{
    cuv_xfer *x = r->x;
    int moved = 0;

    h->st.last_poll = time(NULL);
    if (ok && x != NULL && x->status == 200) {
        cJSON *j = cJSON_ParseWithLength(x->body.p ? x->body.p : "", x->body.len);
        const char *sha = cJSON_GetStringValue(cJSON_GetObjectItemCaseSensitive(j, "sha"));
        if (sha != NULL && strlen(sha) < sizeof(h->st.head)) {
            moved = strcmp(sha, h->st.head) != 0;
            snprintf(h->st.head, sizeof(h->st.head), "%s", sha);
        }
        cJSON_Delete(j);
    } else if (x != NULL && x->status != 0) {
        set_error(h, "revision: HTTP %ld %s", x->status, x->error_code);
    }
    if (x != NULL && x->retry_after >= 0)      /* rate limited: the server says when to come back */
        h->poll_resume_ms = uv_now(h->loop) + (uint64_t)(x->retry_after * 1000);
    remote_req_end(r);
    if (moved && !h->closing) {
        char qs[100];
        dl_log(DL_LOG_DEBUG, "hub", "revision moved", "sha=%s", dl_log_q(qs, sizeof(qs), h->st.head));
        fetch_stepfile(h, 1);
        return;
    }
    /* failed downloads wait for a poll; the head has not moved, so retry those whose wait is over */
    for (candidate **pp = &h->retry; *pp != NULL;) {
        candidate *c = *pp;
        if (c->not_before > uv_now(h->loop)) {
            pp = &c->next;
            continue;
        }
        *pp = c->next;
        c->next = h->queue;
        h->queue = c;
    }
    h->polling = 0;
    pump_downloads(h);
}

static void poll_cb(uv_timer_t *t)
{
    hf_hub *h = t->data;
    hf_req *r;
    char *url;

    if (h->polling || h->closing || uv_now(h->loop) < h->poll_resume_ms)
        return;
    url = api_url(h, "revision", NULL, NULL);
    r = url ? req_new(h, "GET", url, "revision") : NULL;
    free(url);
    if (r == NULL)
        return;
    r->max_attempts = 1;        /* the next poll is the retry */
    h->polling = 1;
    req_go(h, r, revision_done, NULL);
}

/* ---- adoption: download the Hub's global ----------------------------------------------------- */

/* The Hub's global/ listing gives the model's size and oid, so the adoption download is verified
 * like a delta's (a truncated or corrupted copy must never become our state). */
/* A listed global file's oid and size (the LFS oid when it is one).  0 or -1. */
static int global_entry(const cJSON *e, const char **oid, uint64_t *size, int *lfs)
{
    const cJSON *l = cJSON_GetObjectItemCaseSensitive(e, "lfs");

    *oid = cJSON_GetStringValue(cJSON_GetObjectItemCaseSensitive(e, "oid"));
    *lfs = cJSON_IsObject(l);
    if (*lfs)
        *oid = cJSON_GetStringValue(cJSON_GetObjectItemCaseSensitive(l, "oid"));
    if (*oid == NULL || json_size(cJSON_GetObjectItemCaseSensitive(e, "size"), size) != 0 ||
        strspn(*oid, "0123456789abcdef") != strlen(*oid) || strlen(*oid) != (*lfs ? 64u : 40u))
        return -1;
    return 0;
}

/* A sharded global: global/latest.safetensors.index.json and the latest-* shards listed next to it
 * become one set candidate, downloaded and verified like a delta's set. */
static candidate *global_set_candidate(hf_hub *h, const cJSON *arr)
{
    const cJSON *e, *index = NULL;
    listed_file *l = NULL;
    size_t n = 0;
    const char *oid, *ioid = NULL;
    uint64_t size, isize = 0;
    int lfs, ilfs = 0;
    char base[ST_INDEX_BASE_MAX + 1];

    cJSON_ArrayForEach(e, arr) {
        const char *path = cJSON_GetStringValue(cJSON_GetObjectItemCaseSensitive(e, "path"));
        uint32_t si, sn;
        if (path == NULL || strncmp(path, "global/", 7) != 0 || global_entry(e, &oid, &size, &lfs) != 0)
            continue;
        st_name_kind k = st_index_classify(path + 7, strlen(path + 7), base, &si, &sn);
        if (strcmp(base, "latest") != 0)
            continue;
        if (k == ST_NAME_INDEX) {
            index = e;
            ioid = oid;
            isize = size;
            ilfs = lfs;
        } else if (k == ST_NAME_SHARD) {
            listed_file *nl = realloc(l, (n + 1) * sizeof(*nl));
            if (nl == NULL)
                break;
            l = nl;
            memset(&l[n], 0, sizeof(l[n]));
            if ((l[n].rel = strdup(path)) == NULL)
                break;
            snprintf(l[n].oid, sizeof(l[n].oid), "%s", oid);
            l[n].size = size;
            l[n].lfs = lfs;
            n++;
        }
    }
    candidate *c = index ? calloc(1, sizeof(*c)) : NULL;
    if (c == NULL || (c->rel = strdup("global/latest" ST_INDEX_SUFFIX)) == NULL || (c->oid = strdup(ioid)) == NULL ||
        set_version(ioid, l, n, c->ver, sizeof(c->ver)) != 0) {
        listed_free(l, n);
        if (c != NULL)
            candidate_free(c);
        return NULL;
    }
    c->size = isize;
    c->lfs = ilfs;
    c->is_set = 1;
    c->is_global = 1;
    c->step = (uint64_t)h->published_known;
    c->listed = l;
    c->nlisted = n;
    return c;
}

static void global_list_done(hf_hub *h, hf_req *r, int ok)
{
    cuv_xfer *x = r->x;
    candidate *c = NULL;
    cJSON *arr = ok && x && x->status == 200 ? cJSON_ParseWithLength(x->body.p ? x->body.p : "", x->body.len) : NULL, *e;

    if (h->adopt_sharded) {
        c = global_set_candidate(h, arr);
        cJSON_Delete(arr);
        arr = NULL;
    }
    cJSON_ArrayForEach(e, arr) {
        const char *path = cJSON_GetStringValue(cJSON_GetObjectItemCaseSensitive(e, "path"));
        const char *oid = cJSON_GetStringValue(cJSON_GetObjectItemCaseSensitive(e, "oid"));
        const cJSON *lfs = cJSON_GetObjectItemCaseSensitive(e, "lfs");
        const cJSON *size = cJSON_GetObjectItemCaseSensitive(e, "size");
        uint64_t nbytes;
        if (path == NULL || strcmp(path, "global/latest.safetensors") != 0 || oid == NULL)
            continue;
        if (json_size(size, &nbytes) != 0)
            break;
        if (cJSON_IsObject(lfs))
            oid = cJSON_GetStringValue(cJSON_GetObjectItemCaseSensitive(lfs, "oid"));
        if (oid == NULL || strspn(oid, "0123456789abcdef") != strlen(oid) ||
            strlen(oid) != (cJSON_IsObject(lfs) ? 64u : 40u))
            break;
        c = calloc(1, sizeof(*c));
        if (c == NULL || (c->rel = strdup(path)) == NULL || (c->oid = strdup(oid)) == NULL) {
            if (c)
                candidate_free(c);
            c = NULL;
            break;
        }
        snprintf(c->ver, sizeof(c->ver), "%s", oid);
        c->size = nbytes;
        c->lfs = cJSON_IsObject(lfs);
        c->is_global = 1;
        c->step = (uint64_t)h->published_known;
        break;
    }
    cJSON_Delete(arr);
    remote_req_end(r);
    if (c == NULL) {
        set_error(h, "the Hub's global/ listing has no usable %s",
                  h->adopt_sharded ? "latest.safetensors.index.json" : "latest.safetensors");
        global_given_up(h);
        return;
    }
    if (!remote_global_may_fetch(&h->gate, c->step, c->ver, uv_now(h->loop))) {
        /* handed over before and not adopted: listed again at later polls, fetched after the backoff */
        candidate_free(c);
        global_given_up(h);
        return;
    }
    c->next = h->queue;
    h->queue = c;
    pump_downloads(h);
}

static void adopt_download(hf_hub *h)
{
    char *url = api_url(h, "tree", "global", "?recursive=false&expand=false");
    hf_req *r = url ? req_new(h, "GET", url, "tree") : NULL;
    free(url);
    if (r == NULL)
        return;
    h->global_download = 1;
    req_go(h, r, global_list_done, NULL);
}

/* ---- publishing -------------------------------------------------------------------------------- */

static void pub_finish(hf_hub *h, int ok);
static void pub_revision(hf_hub *h);

static void b64(sbuf *out, const unsigned char *p, size_t n)
{
    static const char tbl[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    for (size_t i = 0; i < n; i += 3) {
        unsigned v = (unsigned)p[i] << 16 | (i + 1 < n ? (unsigned)p[i + 1] << 8 : 0) | (i + 2 < n ? p[i + 2] : 0);
        char q[4] = {tbl[(v >> 18) & 63], tbl[(v >> 12) & 63], i + 1 < n ? tbl[(v >> 6) & 63] : '=',
                     i + 2 < n ? tbl[v & 63] : '='};
        sb_add(out, q, 4);
    }
}

typedef struct hash_job {
    hf_hub *h;
    int ok;
} hash_job;

/* sha256, size and the preupload sample of one file (read through its descriptor: the step's
 * file may be unlinked by a later cleanup), and an index's bytes.  0 or -1. */
static int pub_hash_file(pub_file *f, int is_index)
{
    struct stat sb;
    unsigned char sample[512];
    sbuf s = {0};

    if (fstat(f->fd, &sb) != 0 || hash_file(f->path, 0, 0, f->sha256, sizeof(f->sha256)) != 0)
        return -1;
    f->size = (uint64_t)sb.st_size;
    ssize_t n = pread(f->fd, sample, sizeof(sample), 0);
    if (n < 0)
        return -1;
    b64(&s, sample, (size_t)n);
    char *t = sb_take(&s);
    if (t == NULL)
        return -1;
    snprintf(f->sample_b64, sizeof(f->sample_b64), "%s", t);
    free(t);
    if (is_index) {
        if (f->size > ST_INDEX_MAX_BYTES || (f->content = malloc(f->size ? f->size : 1)) == NULL ||
            fsu_pread_all(f->fd, f->content, f->size, 0) != 0)
            return -1;
        f->content_len = f->size;
    }
    return 0;
}

static void pub_hash_work(pool_job *pj)
{
    hash_job *j = pj->arg;
    pub_state *p = &j->h->pub;

    for (unsigned i = 0; i < p->nfiles; i++)
        if (pub_hash_file(&p->files[i], p->sharded && i == p->nfiles - 1) != 0)
            return;
    j->ok = 1;
}

static void pub_commit(hf_hub *h);
static void pub_check(hf_hub *h);

static void commit_done(hf_hub *h, hf_req *r, int ok)
{
    cuv_xfer *x = r->x;
    long status = x ? x->status : 0;
    remote_req_end(r);
    if (ok && status == 200) {
        pub_finish(h, 1);
        return;
    }
    if (status == 412 && !h->closing) {
        /* Either someone else committed, or our own commit went through and its answer was lost
         * (then the retry found the head moved).  The Hub's step file tells which: only in the
         * first case do we commit again, on the new head. */
        dl_log(DL_LOG_INFO, "hub", "parent commit moved, checking the Hub before committing again",
               "step=%" PRIu64, h->pub.step);
        pub_check(h);
        return;
    }
    set_error(h, "commit of step %" PRIu64 ": HTTP %ld", h->pub.step, status);
    pub_finish(h, 0);
}

/* Sends a publishing request whose body is b (consumed): retried until it succeeds or fails for
 * good; an allocation failure ends this publish attempt. */
static void pub_send(hf_hub *h, hf_req *r, sbuf *b, const char *content_type, hf_req_cb cb)
{
    size_t len = b->len;
    char *body = sb_take(b), line[96];

    if (body == NULL) {
        remote_req_end(r);
        pub_finish(h, 0);
        return;
    }
    remote_req_body(r, body, len);
    free(body);
    snprintf(line, sizeof(line), "Content-Type: %s", content_type);
    remote_req_header(r, line);
    if (strstr(content_type, "git-lfs") != NULL)
        remote_req_header(r, "Accept: application/vnd.git-lfs+json");
    req_go(h, r, cb, NULL);
}

static void pub_commit(hf_hub *h)
{
    pub_state *p = &h->pub;
    sbuf b = {0};
    char line[512];
    char *url = api_url(h, "commit", NULL, NULL);
    hf_req *r = url ? req_new(h, "POST", url, "commit") : NULL;

    free(url);
    if (r == NULL) {
        pub_finish(h, 0);
        return;
    }
    snprintf(line, sizeof(line),
             "{\"key\":\"header\",\"value\":{\"summary\":\"dilocod: outer step %" PRIu64
             "\",\"description\":\"\",\"parentCommit\":\"%s\"}}\n",
             p->step, p->parent);
    sb_str(&b, line);
    /* one commit: a reader of any revision sees a whole layout, never half of two */
    for (unsigned i = 0; i < p->nfiles; i++) {
        const pub_file *f = &p->files[i];
        if (f->lfs) {
            snprintf(line, sizeof(line),
                     "{\"key\":\"lfsFile\",\"value\":{\"path\":\"%s\",\"algo\":\"sha256\","
                     "\"oid\":\"%s\",\"size\":%" PRIu64 "}}\n",
                     f->rel, f->sha256, f->size);
            sb_str(&b, line);
        } else {
            sb_str(&b, "{\"key\":\"file\",\"value\":{\"content\":\"");
            b64(&b, (const unsigned char *)f->content, f->content_len);
            snprintf(line, sizeof(line), "\",\"path\":\"%s\",\"encoding\":\"base64\"}}\n", f->rel);
            sb_str(&b, line);
        }
    }
    sb_str(&b, "{\"key\":\"file\",\"value\":{\"content\":\"");
    b64(&b, (const unsigned char *)p->stepfile, strlen(p->stepfile));
    sb_str(&b, "\",\"path\":\"global/step_count.json\",\"encoding\":\"base64\"}}\n");
    for (size_t i = 0; i < p->ndeletes; i++) {
        sb_str(&b, "{\"key\":\"deletedFile\",\"value\":{\"path\":");
        sb_json_string(&b, p->deletes[i], strlen(p->deletes[i]));
        sb_str(&b, "}}\n");
    }
    pub_send(h, r, &b, "application/x-ndjson", commit_done);
}

static void pub_next_lfs(hf_hub *h);

static void verify_lfs_done(hf_hub *h, hf_req *r, int ok)
{
    remote_req_end(r);
    if (!ok) {
        set_error(h, "LFS verify of step %" PRIu64 " failed", h->pub.step);
        pub_finish(h, 0);
        return;
    }
    pub_next_lfs(h);
}

/* After the object's bytes are up: the verify action if any, then the commit. */
static void pub_after_upload(hf_hub *h)
{
    const cJSON *obj = cJSON_GetArrayItem(cJSON_GetObjectItemCaseSensitive(h->pub.batch, "objects"), 0);
    const cJSON *verify = cJSON_GetObjectItemCaseSensitive(cJSON_GetObjectItemCaseSensitive(obj, "actions"), "verify");
    const char *href = cJSON_GetStringValue(cJSON_GetObjectItemCaseSensitive(verify, "href"));

    if (href == NULL) {
        pub_next_lfs(h);
        return;
    }
    hf_req *r = req_new(h, "POST", href, "lfs_verify");
    char body[200];
    if (r == NULL) {
        pub_finish(h, 0);
        return;
    }
    snprintf(body, sizeof(body), "{\"oid\":\"%s\",\"size\":%" PRIu64 "}", h->pub.sha256, h->pub.size);
    remote_req_body(r, body, strlen(body));
    /* the verify URL comes from the batch answer: the token goes along only to the endpoint */
    r->auth = url_on_endpoint(h->endpoint, href);
    remote_req_header(r, "Content-Type: application/vnd.git-lfs+json");
    remote_req_header(r, "Accept: application/vnd.git-lfs+json");
    req_go(h, r, verify_lfs_done, NULL);
}

static void basic_put_done(hf_hub *h, hf_req *r, int ok)
{
    remote_req_end(r);
    if (!ok) {
        set_error(h, "LFS upload of step %" PRIu64 " failed", h->pub.step);
        pub_finish(h, 0);
        return;
    }
    pub_after_upload(h);
}

static void add_action_headers(hf_req *r, const cJSON *action)
{
    const cJSON *hdr = cJSON_GetObjectItemCaseSensitive(action, "header"), *e;
    cJSON_ArrayForEach(e, hdr) {
        if (cJSON_IsString(e) && e->string && strcasecmp(e->string, "chunk_size") != 0 &&
            strspn(e->string, "0123456789") != strlen(e->string)) {
            char line[1024];
            snprintf(line, sizeof(line), "%s: %s", e->string, e->valuestring);
            if (strpbrk(line, "\r\n") == NULL)
                remote_req_header(r, line);
        }
    }
}

static void multipart_next(hf_hub *h);

static void part_done(hf_hub *h, hf_req *r, int ok)
{
    pub_state *p = &h->pub;
    cuv_xfer *x = r->x;
    if (ok && x != NULL && x->etag[0]) {
        free(p->part_etags[p->part_next]);
        p->part_etags[p->part_next] = strdup(x->etag);
        p->part_next++;
        remote_req_end(r);
        multipart_next(h);
        return;
    }
    remote_req_end(r);
    set_error(h, "LFS multipart upload of step %" PRIu64 " failed at part %zu", p->step, p->part_next + 1);
    pub_finish(h, 0);
}

static void complete_done(hf_hub *h, hf_req *r, int ok)
{
    remote_req_end(r);
    if (!ok) {
        set_error(h, "LFS multipart completion of step %" PRIu64 " failed", h->pub.step);
        pub_finish(h, 0);
        return;
    }
    pub_after_upload(h);
}

static void multipart_next(hf_hub *h)
{
    pub_state *p = &h->pub;
    const cJSON *obj = cJSON_GetArrayItem(cJSON_GetObjectItemCaseSensitive(p->batch, "objects"), 0);
    const cJSON *upload = cJSON_GetObjectItemCaseSensitive(cJSON_GetObjectItemCaseSensitive(obj, "actions"), "upload");
    const cJSON *hdr = cJSON_GetObjectItemCaseSensitive(upload, "header");

    if (p->part_next < p->nparts) {
        char key[24];
        snprintf(key, sizeof(key), "%05zu", p->part_next + 1);
        const char *href = cJSON_GetStringValue(cJSON_GetObjectItemCaseSensitive(hdr, key));
        hf_req *r = href ? req_new(h, "PUT", href, "lfs_part") : NULL;
        if (r == NULL) {
            set_error(h, "LFS multipart answer lacks part %s", key);
            pub_finish(h, 0);
            return;
        }
        uint64_t off = p->part_next * p->chunk;
        r->src_fd = p->fd;
        r->src_off = off;
        r->src_len = off + p->chunk <= p->size ? p->chunk : p->size - off;
        r->auth = 0;            /* pre-signed storage URLs: never our token */
        r->api = 0;
        req_go(h, r, part_done, NULL);
        return;
    }
    /* completion: {"oid":..., "parts":[{"partNumber":1,"etag":"..."}]} */
    const char *href = cJSON_GetStringValue(cJSON_GetObjectItemCaseSensitive(upload, "href"));
    sbuf b = {0};
    hf_req *r = href ? req_new(h, "POST", href, "lfs_complete") : NULL;
    if (r == NULL) {
        pub_finish(h, 0);
        return;
    }
    sb_str(&b, "{\"oid\":\"");
    sb_str(&b, p->sha256);
    sb_str(&b, "\",\"parts\":[");
    for (size_t i = 0; i < p->nparts; i++) {
        char part[64];
        snprintf(part, sizeof(part), "%s{\"partNumber\":%zu,\"etag\":", i ? "," : "", i + 1);
        sb_str(&b, part);
        sb_json_string(&b, p->part_etags[i] ? p->part_etags[i] : "", p->part_etags[i] ? strlen(p->part_etags[i]) : 0);
        sb_str(&b, "}");
    }
    sb_str(&b, "]}");
    r->auth = 0;
    pub_send(h, r, &b, "application/vnd.git-lfs+json", complete_done);
}

static void batch_done(hf_hub *h, hf_req *r, int ok)
{
    pub_state *p = &h->pub;
    cuv_xfer *x = r->x;
    cJSON *j = ok && x ? cJSON_ParseWithLength(x->body.p ? x->body.p : "", x->body.len) : NULL;
    remote_req_end(r);
    const cJSON *obj = cJSON_GetArrayItem(cJSON_GetObjectItemCaseSensitive(j, "objects"), 0);
    if (obj == NULL || cJSON_GetObjectItemCaseSensitive(obj, "error") != NULL) {
        set_error(h, "LFS batch for step %" PRIu64 " refused", p->step);
        cJSON_Delete(j);
        pub_finish(h, 0);
        return;
    }
    cJSON_Delete(p->batch);
    p->batch = j;
    const cJSON *actions = cJSON_GetObjectItemCaseSensitive(obj, "actions");
    const cJSON *upload = cJSON_GetObjectItemCaseSensitive(actions, "upload");
    if (upload == NULL) {
        pub_after_upload(h);    /* already stored */
        return;
    }
    const char *transfer = cJSON_GetStringValue(cJSON_GetObjectItemCaseSensitive(j, "transfer"));
    const cJSON *hdr = cJSON_GetObjectItemCaseSensitive(upload, "header");
    const char *chunk = cJSON_GetStringValue(cJSON_GetObjectItemCaseSensitive(hdr, "chunk_size"));
    if (transfer != NULL && strcmp(transfer, "multipart") == 0 && chunk != NULL) {
        char *end;
        unsigned long long cs = strtoull(chunk, &end, 10);
        if (*end != '\0' || cs == 0 || cs > p->size + 1) {
            set_error(h, "LFS multipart chunk_size \"%s\" is not usable", chunk);
            pub_finish(h, 0);
            return;
        }
        p->chunk = cs;
        p->nparts = (size_t)((p->size + cs - 1) / cs);
        p->part_next = 0;
        p->part_etags = calloc(p->nparts + 1, sizeof(char *));
        if (p->part_etags == NULL) {
            pub_finish(h, 0);
            return;
        }
        multipart_next(h);
        return;
    }
    const char *href = cJSON_GetStringValue(cJSON_GetObjectItemCaseSensitive(upload, "href"));
    hf_req *pr = href ? req_new(h, "PUT", href, "lfs_upload") : NULL;
    if (pr == NULL) {
        pub_finish(h, 0);
        return;
    }
    add_action_headers(pr, upload);
    pr->src_fd = p->fd;
    pr->src_off = 0;
    pr->src_len = p->size;
    pr->auth = 0;
    pr->api = 0;
    req_go(h, pr, basic_put_done, NULL);
}

static void pub_batch(hf_hub *h);

/* The current LFS object is stored: the next one, or the commit after the last. */
static void pub_next_lfs(hf_hub *h)
{
    pub_state *p = &h->pub;

    for (size_t i = 0; p->part_etags && i < p->nparts; i++)
        free(p->part_etags[i]);
    free(p->part_etags);
    p->part_etags = NULL;
    p->nparts = p->part_next = 0;
    p->cur++;
    while (p->cur < p->nfiles && !p->files[p->cur].lfs)
        p->cur++;
    pub_batch(h);
}

static void preupload_done(hf_hub *h, hf_req *r, int ok)
{
    pub_state *p = &h->pub;
    cuv_xfer *x = r->x;
    cJSON *j = ok && x ? cJSON_ParseWithLength(x->body.p ? x->body.p : "", x->body.len) : NULL, *f;
    remote_req_end(r);
    if (j == NULL) {
        set_error(h, "preupload for step %" PRIu64 " failed", p->step);
        pub_finish(h, 0);
        return;
    }
    for (unsigned i = 0; i < p->nfiles; i++)
        p->files[i].lfs = 1;
    cJSON_ArrayForEach(f, cJSON_GetObjectItemCaseSensitive(j, "files")) {
        const char *path = cJSON_GetStringValue(cJSON_GetObjectItemCaseSensitive(f, "path"));
        const char *mode = cJSON_GetStringValue(cJSON_GetObjectItemCaseSensitive(f, "uploadMode"));
        for (unsigned i = 0; path && mode && i < p->nfiles; i++)
            if (strcmp(path, p->files[i].rel) == 0)
                p->files[i].lfs = strcmp(mode, "lfs") == 0;
    }
    cJSON_Delete(j);
    for (unsigned i = 0; i < p->nfiles; i++) {
        if (!p->files[i].lfs && p->files[i].content == NULL) {
            /* a regular file would travel inline, base64 in the commit: only sane for small files */
            set_error(h, "the Hub wants %s as a regular file: not supported, use LFS", p->files[i].rel);
            pub_finish(h, 0);
            return;
        }
    }
    p->cur = 0;
    while (p->cur < p->nfiles && !p->files[p->cur].lfs)
        p->cur++;
    pub_batch(h);
}

/* The LFS batch for files[cur] (one object per batch: each is uploaded and verified in turn). */
static void pub_batch(hf_hub *h)
{
    pub_state *p = &h->pub;

    if (p->cur >= p->nfiles) {
        p->uploaded = 1;
        pub_commit(h);
        return;
    }
    p->fd = p->files[p->cur].fd;
    p->size = p->files[p->cur].size;
    memcpy(p->sha256, p->files[p->cur].sha256, sizeof(p->sha256));
    sbuf b = {0};
    char head[512], *body, *url = NULL;
    snprintf(head, sizeof(head),
             "{\"operation\":\"upload\",\"transfers\":[\"basic\",\"multipart\"],\"objects\":[{\"oid\":\"%s\",\"size\":%" PRIu64
             "}],\"hash_algo\":\"sha256\",\"ref\":{\"name\":",
             p->sha256, p->size);
    sb_str(&b, head);
    sb_json_string(&b, h->rev, strlen(h->rev));
    sb_str(&b, "}}");
    size_t len = b.len;
    body = sb_take(&b);
    if (body == NULL || asprintf(&url, "%s/%s.git/info/lfs/objects/batch", h->endpoint, h->repo) < 0) {
        free(body);
        pub_finish(h, 0);
        return;
    }
    hf_req *br = req_new(h, "POST", url, "lfs_batch");
    free(url);
    if (br == NULL) {
        free(body);
        pub_finish(h, 0);
        return;
    }
    remote_req_body(br, body, len);
    free(body);
    remote_req_header(br, "Content-Type: application/vnd.git-lfs+json");
    remote_req_header(br, "Accept: application/vnd.git-lfs+json");
    req_go(h, br, batch_done, NULL);
}

static void pub_preupload(hf_hub *h)
{
    pub_state *p = &h->pub;
    char *url = api_url(h, "preupload", NULL, NULL);
    hf_req *r = url ? req_new(h, "POST", url, "preupload") : NULL;
    sbuf b = {0}, s = {0};
    char part[400], *ssample;

    free(url);
    if (r == NULL) {
        pub_finish(h, 0);
        return;
    }
    b64(&s, (const unsigned char *)p->stepfile, strlen(p->stepfile) < 512 ? strlen(p->stepfile) : 512);
    ssample = sb_take(&s);
    sb_str(&b, "{\"files\":[");
    for (unsigned i = 0; i < p->nfiles; i++) {
        snprintf(part, sizeof(part), "{\"path\":\"%s\",\"sample\":\"", p->files[i].rel);
        sb_str(&b, part);
        sb_str(&b, p->files[i].sample_b64);
        snprintf(part, sizeof(part), "\",\"size\":%" PRIu64 "},", p->files[i].size);
        sb_str(&b, part);
    }
    sb_str(&b, "{\"path\":\"global/step_count.json\",\"sample\":\"");
    sb_str(&b, ssample ? ssample : "");
    snprintf(part, sizeof(part), "\",\"size\":%zu}]}", strlen(p->stepfile));
    sb_str(&b, part);
    free(ssample);
    pub_send(h, r, &b, "application/json", preupload_done);
}

/* A file of the other layout, left by an earlier publish: for a sharded publish the plain file and
 * shards of another count, for a plain one the index and every shard. */
static int pub_other_layout(const pub_state *p, const char *name)
{
    /* the index is the last of files[]; its shard count is files[] minus it */
    return hub_set_other_layout(name, p->sharded, (uint32_t)(p->nfiles - 1));
}

static void pub_deletes_free(pub_state *p)
{
    for (size_t i = 0; i < p->ndeletes; i++)
        free(p->deletes[i]);
    free(p->deletes);
    p->deletes = NULL;
    p->ndeletes = 0;
}

/* The Hub's global/ at the parent: what of the other layout the commit deletes. */
static void pub_list_global_done(hf_hub *h, hf_req *r, int ok)
{
    pub_state *p = &h->pub;
    cuv_xfer *x = r->x;
    long status = x ? x->status : 0;
    cJSON *arr = ok && status == 200 ? cJSON_ParseWithLength(x->body.p ? x->body.p : "", x->body.len) : NULL, *e;

    pub_deletes_free(p);
    if (status != 404 && !cJSON_IsArray(arr)) {
        cJSON_Delete(arr);
        remote_req_end(r);
        set_error(h, "cannot list global/ before publishing step %" PRIu64, p->step);
        pub_finish(h, 0);
        return;
    }
    cJSON_ArrayForEach(e, arr) {
        const char *path = cJSON_GetStringValue(cJSON_GetObjectItemCaseSensitive(e, "path"));
        const char *type = cJSON_GetStringValue(cJSON_GetObjectItemCaseSensitive(e, "type"));
        if (path == NULL || type == NULL || strcmp(type, "file") != 0 || strncmp(path, "global/", 7) != 0 ||
            !pub_other_layout(p, path + 7))
            continue;
        char **nd = realloc(p->deletes, (p->ndeletes + 1) * sizeof(*nd));
        if (nd == NULL || (nd[p->ndeletes] = strdup(path)) == NULL) {
            if (nd != NULL)
                p->deletes = nd;
            break;
        }
        p->deletes = nd;
        p->ndeletes++;
    }
    cJSON_Delete(arr);
    remote_req_end(r);
    if (p->uploaded)
        pub_commit(h);          /* after a 412: the objects are stored, commit again */
    else
        pub_preupload(h);
}

static void pub_list_global(hf_hub *h)
{
    char *url = api_url(h, "tree", "global", "?recursive=false&expand=false");
    hf_req *r = url ? req_new(h, "GET", url, "tree") : NULL;
    free(url);
    if (r == NULL) {
        pub_finish(h, 0);
        return;
    }
    req_go(h, r, pub_list_global_done, NULL);
}

static void pub_revision_done(hf_hub *h, hf_req *r, int ok)
{
    cuv_xfer *x = r->x;
    const char *sha = NULL;
    cJSON *j = ok && x ? cJSON_ParseWithLength(x->body.p ? x->body.p : "", x->body.len) : NULL;
    sha = cJSON_GetStringValue(cJSON_GetObjectItemCaseSensitive(j, "sha"));
    if (sha != NULL && strlen(sha) < sizeof(h->pub.parent))
        snprintf(h->pub.parent, sizeof(h->pub.parent), "%s", sha);
    cJSON_Delete(j);
    remote_req_end(r);
    if (sha == NULL) {
        set_error(h, "cannot read the head before publishing step %" PRIu64, h->pub.step);
        pub_finish(h, 0);
        return;
    }
    pub_list_global(h);
}

static void pub_revision(hf_hub *h)
{
    char *url = api_url(h, "revision", NULL, NULL);
    hf_req *r = url ? req_new(h, "GET", url, "revision") : NULL;
    free(url);
    if (r == NULL) {
        pub_finish(h, 0);
        return;
    }
    req_go(h, r, pub_revision_done, NULL);
}

/* Before committing: is this step's step_count.json already on the Hub (a publish completed just
 * before a crash)?  Then committing again would publish the step twice. */
static void pub_check_done(hf_hub *h, hf_req *r, int ok)
{
    cuv_xfer *x = r->x;
    uint64_t step;
    int already = ok && x != NULL && x->status == 200 &&
                  stepcount_parse(x->body.p ? x->body.p : "", x->body.len, &step, NULL, NULL, NULL) == 0 &&
                  step == h->pub.step;
    int missing = x != NULL && (x->status == 200 || x->status == 404);
    remote_req_end(r);
    if (already) {
        dl_log(DL_LOG_INFO, "hub", "step already on the Hub, not committed again", "step=%" PRIu64, h->pub.step);
        pub_finish(h, 1);
        return;
    }
    if (!missing) {
        set_error(h, "cannot read the Hub's step_count.json before publishing");
        pub_finish(h, 0);
        return;
    }
    pub_revision(h);
}

static void pub_check(hf_hub *h)
{
    char *url = resolve_url(h, "global/step_count.json");
    hf_req *r = url ? req_new(h, "GET", url, "step_file") : NULL;
    free(url);
    if (r == NULL) {
        pub_finish(h, 0);
        return;
    }
    r->follow = 1;
    r->api = 0;
    r->body_cap = STEPFILE_BODY_CAP;
    req_go(h, r, pub_check_done, NULL);
}

static void pub_hash_after(pool_job *pj)
{
    hash_job *j = pj->arg;
    hf_hub *h = j->h;
    int ok = !pj->cancelled && j->ok;
    free(j);
    if (!ok || h->closing) {
        set_error(h, "cannot read the global of step %" PRIu64, h->pub.step);
        pub_finish(h, 0);
        return;
    }
    pub_check(h);
}

static void pub_finish(hf_hub *h, int ok)
{
    pub_state *p = &h->pub;
    uint64_t step = p->step;

    for (unsigned i = 0; p->files && i < p->nfiles; i++) {
        if (p->files[i].fd >= 0)
            close(p->files[i].fd);
        free(p->files[i].path);
        free(p->files[i].content);
    }
    free(p->files);
    pub_deletes_free(p);
    p->fd = -1;
    free(p->path);
    free(p->stepfile);
    cJSON_Delete(p->batch);
    for (size_t i = 0; p->part_etags && i < p->nparts; i++)
        free(p->part_etags[i]);
    free(p->part_etags);
    memset(p, 0, sizeof(*p));
    p->fd = -1;
    h->st.publishing = 0;
    if (ok) {
        h->st.last_publish = time(NULL);
        h->published_known = (int64_t)step;
    }
    if (!h->closing)
        h->cb.publish_done(h->app, step, ok ? NULL : h->st.last_error[0] ? h->st.last_error : "the Hub commit failed");
}

/* Opens one file of the publish (the descriptor keeps the step's file readable even if a later
 * cleanup unlinks it).  0 or -1 with errno. */
static int pub_open_file(pub_file *f, const char *path, const char *name)
{
    snprintf(f->rel, sizeof(f->rel), "global/%s", name);
    if ((f->path = strdup(path)) == NULL)
        return -1;
    f->fd = open(path, O_RDONLY | O_CLOEXEC);
    return f->fd < 0 ? -1 : 0;
}

/* The files of a publish: global_path alone, or the shards its index lists (in the index's
 * directory) and the index last.  0, or -1 with the reason set. */
static int pub_open_files(hf_hub *h, pub_state *p, const char *global_path)
{
    st_index *ix = NULL;
    dl_error err = {0};
    char path[4096], name[ST_INDEX_BASE_MAX + 48];
    int rc = -1;

    p->sharded = st_index_is_index_path(global_path);
    if (!p->sharded) {
        if ((p->files = calloc(1, sizeof(*p->files))) == NULL)
            return -1;
        p->nfiles = 1;
        p->files[0].fd = -1;
        if (pub_open_file(&p->files[0], global_path, "latest.safetensors") != 0) {
            set_error(h, "publishing step %" PRIu64 ": cannot read %s: %s", p->step, global_path, strerror(errno));
            return -1;
        }
        return 0;
    }
    if (st_index_load(global_path, &ix, &err) != 0) {
        set_error(h, "publishing step %" PRIu64 ": %s", p->step, err.message);
        return -1;
    }
    if (strcmp(ix->base, "latest") != 0) {
        set_error(h, "publishing step %" PRIu64 ": a global's index is latest%s", p->step, ST_INDEX_SUFFIX);
        goto out;
    }
    const char *slash = strrchr(global_path, '/');
    int dlen = slash ? (int)(slash - global_path) : 1;
    const char *dir = slash ? global_path : ".";
    if ((p->files = calloc((size_t)ix->nshards + 1, sizeof(*p->files))) == NULL)
        goto out;
    p->nfiles = ix->nshards + 1;
    for (unsigned i = 0; i < p->nfiles; i++)
        p->files[i].fd = -1;
    for (uint32_t i = 0; i <= ix->nshards; i++) {
        if (i < ix->nshards) {
            if (st_index_shard_name(ix->base, i, ix->nshards, name, sizeof(name)) != 0 ||
                snprintf(path, sizeof(path), "%.*s/%s", dlen, dir, name) >= (int)sizeof(path))
                goto out;
        } else {
            snprintf(name, sizeof(name), "latest%s", ST_INDEX_SUFFIX);
            snprintf(path, sizeof(path), "%s", global_path);
        }
        if (pub_open_file(&p->files[i], path, name) != 0) {
            set_error(h, "publishing step %" PRIu64 ": cannot read %.300s: %s", p->step, path, strerror(errno));
            goto out;
        }
    }
    rc = 0;
out:
    st_index_free(ix);
    return rc;
}

static void hf_publish(hub *base, uint64_t step, const char *global_path, const char *optimizer, int bootstrap)
{
    hf_hub *h = (hf_hub *)base;
    pub_state *p = &h->pub;
    hash_job *j;

    if (p->active || h->closing)
        return;
    memset(p, 0, sizeof(*p));
    p->active = 1;
    p->step = step;
    p->bootstrap = bootstrap;
    snprintf(p->optimizer, sizeof(p->optimizer), "%s", optimizer);
    p->fd = -1;
    p->path = strdup(global_path);
    h->st.publishing = 1;
    if (p->path == NULL || pub_open_files(h, p, global_path) != 0) {
        pub_finish(h, 0);
        return;
    }
    p->stepfile = stepcount_build(step, optimizer, bootstrap, p->sharded, NULL);
    j = calloc(1, sizeof(*j));
    if (p->stepfile == NULL || j == NULL) {
        free(j);
        pub_finish(h, 0);
        return;
    }
    j->h = h;
    if (job_queue(&h->jobs, pub_hash_work, pub_hash_after, j) != 0) {
        free(j);
        pub_finish(h, 0);
    }
}

/* ---- lifecycle --------------------------------------------------------------------------------- */

int hf_parse_url(const char *url, char **repo, char **rev)
{
    const char *p = url + 5, *at, *slash;
    *repo = *rev = NULL;
    if (strncmp(url, "hf://", 5) != 0)
        return -1;
    at = strchr(p, '@');
    size_t rl = at ? (size_t)(at - p) : strlen(p);
    slash = memchr(p, '/', rl);
    if (slash == NULL || slash == p || (size_t)(slash - p) + 1 >= rl || memchr(slash + 1, '/', rl - (size_t)(slash - p) - 1))
        return -1;
    /* namespaces and repo names: [A-Za-z0-9._-] (the Hub's own rule is narrower) */
    for (size_t i = 0; i < rl; i++) {
        char c = p[i];
        if (!(c == '/' || c == '.' || c == '_' || c == '-' || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') ||
              (c >= '0' && c <= '9')))
            return -1;
    }
    if (at != NULL && (at[1] == '\0' || strpbrk(at + 1, " \t\r\n") != NULL))
        return -1;
    *repo = strndup(p, rl);
    *rev = strdup(at ? at + 1 : "main");
    if (*repo == NULL || *rev == NULL) {
        free(*repo);
        free(*rev);
        return -1;
    }
    return 0;
}

static int hf_check_url(const char *url, dl_error *err)
{
    char *repo, *rev;

    if (hf_parse_url(url, &repo, &rev) != 0)
        return dl_fail(err, DL_E_INVALID_ARGUMENT, NULL, 0, "'%.200s' is not hf://namespace/repo[@revision]", url);
    free(repo);
    free(rev);
    return 0;
}

/* ---- options (hub.h's hub_options: config.c reads them through this table) ---- */

typedef struct hf_options {
    char *endpoint;             /* hub_endpoint; load: else $HF_ENDPOINT, else https://huggingface.co */
    char *token_file;           /* hub_token_file; else $HF_TOKEN */
    char *token;                /* loaded by hf_load_options, never printed */
} hf_options;

static const hub_option hf_option_table[] = {
    {"hub_endpoint", HUB_OPT_OPTSTR, offsetof(hf_options, endpoint), 0, 0, NULL,
     "URL     server of hf:// (default $HF_ENDPOINT or https://huggingface.co)", NULL},
    {"hub_token_file", HUB_OPT_OPTSTR, offsetof(hf_options, token_file), 0, 0, NULL,
     "FILE  file holding the Hub token (default $HF_TOKEN)", ""},
};

/* The first line of the token file, which must be one word. */
static int read_token_file(hf_options *o, dl_error *err)
{
    char line[512];
    FILE *f;
    int rc;

    if ((rc = fsu_check_regular_file(o->token_file, err)) != 0)
        return rc;
    if ((f = fopen(o->token_file, "r")) == NULL)
        return dl_fail(err, DL_E_IO, NULL, 0, "cannot read %s: %s", o->token_file, strerror(errno));
    if (fgets(line, sizeof(line), f) == NULL)
        line[0] = '\0';
    fclose(f);
    line[strcspn(line, "\r\n")] = '\0';
    if (line[0] == '\0' || strpbrk(line, " \t") != NULL)
        return dl_fail(err, DL_E_INVALID_ARGUMENT, NULL, 0, "%s does not hold a token on its first line",
                       o->token_file);
    o->token = strdup(line);
    memset(line, 0, sizeof(line));
    return o->token != NULL ? 0 : dl_fail(err, DL_E_NO_MEMORY, NULL, 0, "out of memory");
}

/* The endpoint and the token (never printed, never logged). */
static int hf_load_options(void *opts, const char *url, const char **key, dl_error *err)
{
    hf_options *o = opts;
    const char *env;

    (void)url;
    *key = "hub_endpoint";
    if (o->endpoint == NULL) {
        env = getenv("HF_ENDPOINT");
        if ((o->endpoint = strdup(env && *env ? env : "https://huggingface.co")) == NULL)
            return dl_fail(err, DL_E_NO_MEMORY, NULL, 0, "out of memory");
    }
    if (!hub_is_http_url(o->endpoint))
        return dl_fail(err, DL_E_INVALID_ARGUMENT, NULL, 0, "'%s' is not an http(s) URL", o->endpoint);
    *key = "hub_token_file";
    free(o->token);
    o->token = NULL;
    if (o->token_file != NULL)
        return read_token_file(o, err);
    if ((env = getenv("HF_TOKEN")) != NULL && *env && (o->token = strdup(env)) == NULL)
        return dl_fail(err, DL_E_NO_MEMORY, NULL, 0, "out of memory");
    return 0;
}

static const char *hf_unset_note(const void *opts, const char *key)
{
    const hf_options *o = opts;
    return strcmp(key, "hub_token_file") == 0 && o->token != NULL ? " (the token is from $HF_TOKEN)" : NULL;
}

static void hf_print_options(const void *opts, FILE *out)
{
    fprintf(out, "# hub token: %s\n", ((const hf_options *)opts)->token ? "set" : "not set");
}

static void hf_clear_options(void *opts)
{
    hf_options *o = opts;
    if (o->token != NULL)
        memset(o->token, 0, strlen(o->token));
    free(o->token);
    o->token = NULL;
}

static const hub_options hf_options_ops = {
    .opt = hf_option_table,
    .n = sizeof(hf_option_table) / sizeof(hf_option_table[0]),
    .size = sizeof(hf_options),
    .load = hf_load_options,
    .unset_note = hf_unset_note,
    .print = hf_print_options,
    .clear = hf_clear_options,
};

static int hf_open(hub **out, uv_loop_t *loop, const hub_config *cfg, const hub_callbacks *cb, void *app,
                   dl_error *err)
{
    extern const hub_ops hub_hf_ops;
    hf_hub *h;
    char *seen_path = NULL;
    int rc;

    *out = NULL;
    if ((rc = hf_check_url(cfg->url, err)) != 0)
        return rc;
    const hf_options *o = cfg->options;
    const char *endpoint = o != NULL ? o->endpoint : NULL, *token = o != NULL ? o->token : NULL;
    if (endpoint == NULL)
        return dl_fail(err, DL_E_INVALID_ARGUMENT, NULL, 0, "hf:// needs the Hub's endpoint");
    if ((rc = fsu_mkdirs(cfg->state_dir, err)) != 0)
        return rc;
    if ((h = calloc(1, sizeof(*h))) == NULL)
        return dl_fail(err, DL_E_NO_MEMORY, NULL, 0, "out of memory");
    h->base.ops = &hub_hf_ops;
    h->loop = loop;
    h->cb = *cb;
    h->app = app;
    h->endpoint = strdup(endpoint);
    hf_parse_url(cfg->url, &h->repo, &h->rev);
    h->token = token ? strdup(token) : NULL;
    h->state_dir = strdup(cfg->state_dir);
    h->poll_interval = cfg->poll_interval;
    h->max_downloads = cfg->max_downloads ? cfg->max_downloads : 2;
    h->max_header = cfg->max_header_bytes && cfg->max_header_bytes < ST_MAX_HEADER_SIZE ? cfg->max_header_bytes
                                                                                       : ST_MAX_HEADER_SIZE;
    h->published_known = -1;
    h->pub.fd = -1;
    size_t el = h->endpoint ? strlen(h->endpoint) : 0;
    while (el > 0 && h->endpoint[el - 1] == '/')
        h->endpoint[--el] = '\0';
    if (h->endpoint == NULL || h->repo == NULL || h->rev == NULL || h->state_dir == NULL ||
        (token != NULL && h->token == NULL) || asprintf(&seen_path, "%s/hub_seen.tsv", h->state_dir) < 0 ||
        (h->curl = cuv_new(loop)) == NULL) {
        free(seen_path);
        free(h->endpoint);
        free(h->repo);
        free(h->rev);
        free(h->token);
        free(h->state_dir);
        free(h);
        return dl_fail(err, DL_E_NO_MEMORY, NULL, 0, "cannot set up the Hub transport: out of memory");
    }
    remote_init(&h->rm, loop, h->curl, &h->st, &hf_remote_ops, h, &h->closing);
    job_owner_init(&h->jobs, loop, NULL);
    remote_seen_open(&h->seen, loop, seen_path);
    free(seen_path);
    uv_timer_init(loop, &h->poll_timer);
    h->poll_timer.data = h;
    h->handles = 1;
    *out = &h->base;
    return 0;
}

static void hf_set_limits(hub *base, const hub_limits *lim)
{
    ((hf_hub *)base)->limits = *lim;
}

static void hf_set_step(hub *base, uint64_t step, int waiting)
{
    hf_hub *h = (hf_hub *)base;

    h->step = step;
    h->waiting = waiting;
    if (waiting)
        h->st.head[0] = '\0';         /* read the step file again at the next poll */
    /* deltas parked as "future" are worth a new look now */
    for (size_t i = 0; i < h->seen.map.cap; i++)
        if (h->seen.map.slots[i].key && h->seen.map.slots[i].state == SEEN_INCOMPLETE)
            h->st.head[0] = '\0';       /* forces the next poll to list again */
}

static void hf_start(hub *base)
{
    hf_hub *h = (hf_hub *)base;
    uv_timer_start(&h->poll_timer, poll_cb, 0, (uint64_t)(h->poll_interval * 1000));
}

static const hub_status *hf_get_status(const hub *base)
{
    return &((const hf_hub *)base)->st;
}

static void hub_free(hf_hub *h)
{
    void (*done)(void *) = h->close_done;
    void *arg = h->close_arg;
    while (h->queue) {
        candidate *c = h->queue;
        h->queue = c->next;
        candidate_free(c);
    }
    while (h->retry) {
        candidate *c = h->retry;
        h->retry = c->next;
        candidate_free(c);
    }
    listing_reset(h);
    while (h->sets)
        hub_set_free(&h->sets, h->sets);
    remote_seen_close(&h->seen);
    free(h->endpoint);
    free(h->repo);
    free(h->rev);
    if (h->token)
        memset(h->token, 0, strlen(h->token));
    free(h->token);
    free(h->state_dir);
    free(h);
    if (done)
        done(arg);
}

static void curl_closed(void *arg)
{
    hf_hub *h = arg;
    if (--h->handles == 0)
        hub_free(h);
}

static void poll_timer_closed(uv_handle_t *t)
{
    hf_hub *h = t->data;
    /* every request has ended (cancelled ones call back at once or after their file op) */
    cuv_close(h->curl, curl_closed, h);
}

static void close_when_idle(uv_timer_t *t);

static void hf_close(hub *base, void (*done)(void *), void *arg)
{
    hf_hub *h = (hf_hub *)base;

    h->closing = 1;
    h->close_done = done;
    h->close_arg = arg;
    uv_timer_stop(&h->poll_timer);
    remote_cancel_all(&h->rm);
    if (h->pub.active && h->rm.inflight == NULL && h->handles == 1 && h->jobs.in_flight == 0)
        pub_finish(h, 0);
    uv_timer_start(&h->poll_timer, close_when_idle, 10, 10);
}

/* Waits for cancelled requests and pool jobs (hash, verify) to come back, then closes. */
static void close_when_idle(uv_timer_t *t)
{
    hf_hub *h = t->data;
    if (h->rm.inflight != NULL || h->handles > 1 || h->jobs.in_flight > 0 || h->seen.writes > 0)
        return;
    if (h->pub.active)
        pub_finish(h, 0);
    uv_timer_stop(t);
    uv_close((uv_handle_t *)t, poll_timer_closed);
}

const hub_ops hub_hf_ops = {
    .scheme = "hf://",
    .kind = "hf",
    .url_form = "hf://ns/repo[@rev]",
    .options = &hf_options_ops,
    .check_url = hf_check_url,
    .open = hf_open,
    .start = hf_start,
    .set_step = hf_set_step,
    .set_limits = hf_set_limits,
    .publish = hf_publish,
    .mark_done = hf_mark_done,
    .status = hf_get_status,
    .close = hf_close,
};
