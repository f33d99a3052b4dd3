/* hub_hf: the hf:// transport (hub_hf.h): its requests (the bearer token, the Hub's access
 * problems), its URLs, its listing of the repo (the revision, the nodes/ tree, global/), its verify
 * (sha256 of an LFS file, the git blob sha1 of another) and its lifecycle.  The fetch pipeline is
 * remote_fetch.c's; the publish is hub_hf_publish.c's. */
#include "hub_hf.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <unistd.h>

#include <cJSON.h>

#include "curl_uv.h"
#include "delta.h"
#include "dl_log.h"
#include "fsutil.h"
#include "hub_hf_internal.h"
#include "hub_set.h"
#include "remote.h"
#include "remote_fetch.h"
#include "seen.h"
#include "st_index.h"
#include "stepcount.h"
#include "store.h"
#include "strbuf.h"

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

/* A file of a sharded set as the tree listing showed it. */
typedef struct listed_file {
    char *rel;
    char oid[65];
    uint64_t size;
    int lfs;
    char node[DELTA_NODE_ID_MAX + 1];
    uint64_t local_step;
} listed_file;

/* route: a static name for /metrics (dilocod_hub_requests_total{route,code}); messages name the URL */
hf_req *hf_req_new(hf_hub *h, const char *method, const char *url, const char *route)
{
    return remote_req_new(&h->f.rm, method, url, NULL, route);
}

/* set_error (hub_hf_internal.h): while a request refused for access (401, 403, unknown repo)
 * ends, its callback's generic "HTTP 401" is not recorded: the access problem already says so in
 * words that tell the operator what to fix. */

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

void hf_req_go(hf_hub *h, hf_req *r, hf_req_cb cb, void *arg)
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

char *hf_api_url(hf_hub *h, const char *what, const char *path, const char *query)
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

char *hf_resolve_url(hf_hub *h, const char *path)
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
int hf_url_on_endpoint(const char *endpoint, const char *url)
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

/* Whatever the daemon decided, a downloaded (path, oid) is never downloaded again.  A download is
 * verified against the listing, so one that intake finds short is final: rejected. */
static int hf_mark_done(hub *base, const char *rel, hub_outcome outcome, const hub_version *v)
{
    (void)v;
    return remote_fetch_mark_done(&((hf_hub *)base)->f, rel, outcome);
}

/* ---- the fetch pipeline's table (remote_fetch.h) ------------------------------------------------- */

/* Files come from the resolve endpoint, which redirects to storage or a CDN: a resolver call. */
static remote_req *hf_get(remote_fetch *f, const remote_cand *c, const char *route)
{
    hf_hub *h = f->owner;
    char *url = hf_resolve_url(h, c->key);
    hf_req *r = url ? hf_req_new(h, "GET", url, route) : NULL;

    free(url);
    if (r != NULL) {
        r->follow = 1;
        r->api = 0;
    }
    return r;
}

/* <state>/cache/incoming/hf-<oid>.part: the oid names the content, so a resumed file is the same one. */
static char *hf_part_path(remote_fetch *f, const remote_cand *c)
{
    return store_path_incoming_file(f->state_dir, "hf-%s.part", c->tag);
}

/* The git blob header, "blob <size>" and its NUL, hashed before a regular file's content. */
static size_t blob_head(uint64_t size, char *head, size_t head_size)
{
    return (size_t)snprintf(head, head_size, "blob %" PRIu64, size) + 1;
}

/* On the pool: sha256 of the content (LFS) or the git blob sha1, against the listing's oid. */
static int hf_verify_file(const remote_cand *c, int fd, char *why, size_t size)
{
    char hex[130], head[48];
    size_t hl = blob_head(c->size, head, sizeof(head));

    if (remote_hash_fd(fd, c->lfs ? REMOTE_SHA256 : REMOTE_SHA1, c->lfs ? NULL : head, c->lfs ? 0 : hl, hex,
                       sizeof(hex)) != 0) {
        snprintf(why, size, "cannot hash the download");
        return -1;
    }
    if (strcmp(hex, c->tag) != 0) {
        snprintf(why, size, "%s %s, the listing says %s", c->lfs ? "sha256" : "git sha1", hex, c->tag);
        return -1;
    }
    return 0;
}

/* On the pool: an index read into memory is the blob the listing named. */
static int hf_verify_index(const remote_cand *c, const char *text, size_t len)
{
    char hex[130], head[48];
    size_t hl = blob_head(len, head, sizeof(head));

    return remote_hash_mem(text, len, c->lfs ? REMOTE_SHA256 : REMOTE_SHA1, c->lfs ? NULL : head, c->lfs ? 0 : hl,
                           hex, sizeof(hex)) == 0 && strcmp(hex, c->tag) == 0
               ? 0
               : -1;
}

int hf_sha256_file(const char *path, char *hex, size_t hex_size)
{
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    int rc = fd >= 0 ? remote_hash_fd(fd, REMOTE_SHA256, NULL, 0, hex, hex_size) : -1;

    if (fd >= 0)
        close(fd);
    return rc;
}

static void hf_idle(remote_fetch *f);

static const remote_fetch_ops hf_fetch_ops = {
    .name_field = "path",
    .downloaded_log = "delta downloaded",
    .set_prefix = "hf-",
    .get = hf_get,
    .part_path = hf_part_path,
    .verify_file = hf_verify_file,
    .verify_index = hf_verify_index,
    .idle = hf_idle,
};

/* ---- listing ------------------------------------------------------------------------------------ */

/* After the listing's last page: each listed index with the shards listed next to it (same node
 * and step) becomes one candidate, unless this version of the set was handled. */
static void sets_from_listing(hf_hub *h)
{
    for (size_t i = 0; i < h->nlidx; i++) {
        listed_file *ix = &h->lidx[i];
        remote_listed *l = NULL;
        size_t n = 0;
        char ver[80];
        int oom = 0;

        for (size_t k = 0; k < h->nlshards && !oom; k++) {
            const listed_file *e = &h->lshards[k];
            if (e->local_step != ix->local_step || strcmp(e->node, ix->node) != 0)
                continue;
            remote_listed r = {.key = e->rel, .size = e->size, .lfs = e->lfs};
            snprintf(r.tag, sizeof(r.tag), "%s", e->oid);
            oom = remote_listed_add(&l, &n, &r) != 0;
        }
        if (oom || remote_fetch_set_version(ix->oid, l, n, ver, sizeof(ver)) != 0) {
            remote_listed_free(l, n);
            continue;
        }
        int is_new, wanted = remote_fetch_wanted(&h->f, ix->rel, ver, &is_new);
        if (wanted <= 0 || h->list_new >= MAX_NEW_PER_LISTING) {
            h->list_cut |= wanted > 0 && is_new;   /* not remembered: the next listing offers it again */
            remote_listed_free(l, n);
            continue;
        }
        remote_cand *c = remote_cand_new(ix->rel, ix->rel, ix->oid, ix->size);
        if (c == NULL || remote_fetch_pending(&h->f, ix->rel, ver) != 0) {
            remote_cand_free(c);
            remote_listed_free(l, n);
            continue;
        }
        h->list_new++;
        snprintf(c->ver, sizeof(c->ver), "%s", ver);
        c->lfs = ix->lfs;
        c->is_set = 1;
        c->listed = l;
        c->nlisted = n;
        remote_fetch_enqueue(&h->f, c);
    }
}

static void listed_files_free(listed_file *l, size_t n)
{
    for (size_t i = 0; i < n; i++)
        free(l[i].rel);
    free(l);
}

static void listing_reset(hf_hub *h)
{
    listed_files_free(h->lidx, h->nlidx);
    listed_files_free(h->lshards, h->nlshards);
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
    int is_new;
    if (remote_fetch_wanted(&h->f, path, oid, &is_new) <= 0)
        return 0;               /* done, rejected for this run, or in flight */
    if (h->list_new >= MAX_NEW_PER_LISTING) {
        h->list_cut = 1;        /* not remembered: the next listing offers it again */
        return 0;
    }
    remote_cand *c = remote_cand_new(path, path, oid, nbytes);
    if (c == NULL || remote_fetch_pending(&h->f, path, oid) != 0) {
        remote_cand_free(c);
        return 0;
    }
    h->list_new++;
    c->lfs = cJSON_IsObject(lfs);
    remote_fetch_enqueue(&h->f, c);
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
        if (x->link_bad || (x->link_next[0] && !hf_url_on_endpoint(h->endpoint, x->link_next))) {
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
    if (next[0] && !h->f.closing) {
        list_page(h, next);
        return;
    }
    sets_from_listing(h);
    listing_reset(h);
    h->polling = 0;
    remote_fetch_pump(&h->f);
}

static void list_page(hf_hub *h, const char *url)
{
    hf_req *r = hf_req_new(h, "GET", url, "tree");
    if (r == NULL) {
        listing_reset(h);
        h->polling = 0;
        return;
    }
    hf_req_go(h, r, list_done, NULL);
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
        remote_report_step(&h->published_known, (int64_t)step, &h->cb, h->app);
    } else if (x != NULL && x->status == 404) {
        remote_report_step(&h->published_known, -1, &h->cb, h->app);     /* no global on the Hub */
    } else {
        h->st.head[0] = '\0';         /* unreadable: look again at the next poll */
    }
    remote_req_end(r);
    if (h->f.waiting && h->published_known >= 0 && !h->f.global_download) {
        adopt_download(h);
        h->polling = 0;
        return;
    }
    if (list && !h->f.closing && !h->f.waiting) {
        char *url = hf_api_url(h, "tree", "nodes", "?recursive=true&expand=false");
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
    remote_fetch_pump(&h->f);
}

static void fetch_stepfile(hf_hub *h, int then_list)
{
    char *url = hf_resolve_url(h, "global/step_count.json");
    hf_req *r = url ? hf_req_new(h, "GET", url, "step_file") : NULL;
    free(url);
    if (r == NULL) {
        h->polling = 0;
        return;
    }
    r->follow = 1;
    r->api = 0;
    r->max_attempts = 2;
    r->body_cap = STEPFILE_BODY_CAP;
    hf_req_go(h, r, stepfile_done, then_list ? (void *)1 : NULL);
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
    if (moved && !h->f.closing) {
        char qs[100];
        dl_log(DL_LOG_DEBUG, "hub", "revision moved", "sha=%s", dl_log_q(qs, sizeof(qs), h->st.head));
        fetch_stepfile(h, 1);
        return;
    }
    /* failed downloads wait for a poll; the head has not moved, so retry those whose wait is over */
    remote_fetch_requeue_due(&h->f);
    h->polling = 0;
    remote_fetch_pump(&h->f);
}

static void poll_cb(uv_timer_t *t)
{
    hf_hub *h = t->data;
    hf_req *r;
    char *url;

    if (h->polling || h->f.closing || uv_now(h->loop) < h->poll_resume_ms)
        return;
    url = hf_api_url(h, "revision", NULL, NULL);
    r = url ? hf_req_new(h, "GET", url, "revision") : NULL;
    free(url);
    if (r == NULL)
        return;
    r->max_attempts = 1;        /* the next poll is the retry */
    h->polling = 1;
    hf_req_go(h, r, revision_done, NULL);
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
static remote_cand *global_set_candidate(const cJSON *arr)
{
    const cJSON *e, *index = NULL;
    remote_listed *l = NULL;
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
            remote_listed r = {.key = (char *)path, .size = size, .lfs = lfs};
            snprintf(r.tag, sizeof(r.tag), "%s", oid);
            if (remote_listed_add(&l, &n, &r) != 0)
                break;
        }
    }
    remote_cand *c = index ? remote_cand_new("global/latest" ST_INDEX_SUFFIX, "global/latest" ST_INDEX_SUFFIX, ioid, isize)
                           : NULL;
    if (c == NULL || remote_fetch_set_version(ioid, l, n, c->ver, sizeof(c->ver)) != 0) {
        remote_listed_free(l, n);
        remote_cand_free(c);
        return NULL;
    }
    c->lfs = ilfs;
    c->is_set = 1;
    c->listed = l;
    c->nlisted = n;
    return c;
}

static void global_list_done(hf_hub *h, hf_req *r, int ok)
{
    cuv_xfer *x = r->x;
    remote_cand *c = NULL;
    cJSON *arr = ok && x && x->status == 200 ? cJSON_ParseWithLength(x->body.p ? x->body.p : "", x->body.len) : NULL, *e;

    if (h->adopt_sharded) {
        c = global_set_candidate(arr);
        cJSON_Delete(arr);
        arr = NULL;
    }
    cJSON_ArrayForEach(e, arr) {
        const char *path = cJSON_GetStringValue(cJSON_GetObjectItemCaseSensitive(e, "path"));
        const char *oid;
        uint64_t nbytes;
        int lfs;
        if (path == NULL || strcmp(path, "global/latest.safetensors") != 0)
            continue;
        if (global_entry(e, &oid, &nbytes, &lfs) == 0 && (c = remote_cand_new(path, path, oid, nbytes)) != NULL)
            c->lfs = lfs;
        break;
    }
    cJSON_Delete(arr);
    remote_req_end(r);
    if (c == NULL) {
        set_error(h, "the Hub's global/ listing has no usable %s",
                  h->adopt_sharded ? "latest.safetensors.index.json" : "latest.safetensors");
        remote_fetch_global_given_up(&h->f);
        return;
    }
    c->is_global = 1;
    c->step = (uint64_t)h->published_known;
    remote_fetch_offer_global(&h->f, c);
}

static void adopt_download(hf_hub *h)
{
    char *url = hf_api_url(h, "tree", "global", "?recursive=false&expand=false");
    hf_req *r = url ? hf_req_new(h, "GET", url, "tree") : NULL;
    free(url);
    if (r == NULL)
        return;
    h->f.global_download = 1;
    hf_req_go(h, r, global_list_done, NULL);
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

static void hf_print_options(const void *opts, const char *url, FILE *out)
{
    (void)url;
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
    /* lint-errors: allow alloc: every copy is tested together below, before anything uses them */
    h->token = token ? strdup(token) : NULL;
    /* lint-errors: allow alloc: tested with the others below */
    h->state_dir = strdup(cfg->state_dir);
    h->poll_interval = cfg->poll_interval;
    h->max_downloads = cfg->max_downloads ? cfg->max_downloads : 2;
    h->max_header = cfg->max_header_bytes && cfg->max_header_bytes < ST_MAX_HEADER_SIZE ? cfg->max_header_bytes
                                                                                       : ST_MAX_HEADER_SIZE;
    h->published_known = REMOTE_STEP_UNREPORTED;
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
    remote_fetch_init(&h->f, &(remote_fetch_config){.loop = loop, .curl = h->curl, .st = &h->st,
                                                     .req_ops = &hf_remote_ops, .ops = &hf_fetch_ops, .owner = h,
                                                     .cb = cb, .app = app, .state_dir = h->state_dir,
                                                     .seen_path = seen_path, .poll_interval = h->poll_interval,
                                                     .max_downloads = h->max_downloads, .max_header = h->max_header});
    free(seen_path);
    uv_timer_init(loop, &h->poll_timer);
    h->poll_timer.data = h;
    remote_fetch_hold(&h->f);   /* the poll timer's, until it is closed */
    *out = &h->base;
    return 0;
}

static void hf_set_limits(hub *base, const hub_limits *lim)
{
    ((hf_hub *)base)->f.limits = *lim;
}

static void hf_set_step(hub *base, uint64_t step, int waiting)
{
    hf_hub *h = (hf_hub *)base;

    h->f.step = step;
    h->f.waiting = waiting;
    if (waiting)
        h->st.head[0] = '\0';         /* read the step file again at the next poll */
    /* deltas parked as "future" are worth a new look now */
    for (size_t i = 0; i < h->f.seen.map.cap; i++)
        if (h->f.seen.map.slots[i].key && h->f.seen.map.slots[i].state == SEEN_INCOMPLETE)
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

    listing_reset(h);
    remote_fetch_free(&h->f);
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
    hub_free(arg);
}

/* Everything in flight has ended (remote_fetch.h's reference count): a publish cut short ends here. */
static void hf_idle(remote_fetch *f)
{
    hf_hub *h = f->owner;

    if (h->pub.active)
        hf_pub_finish(h, 0);
    cuv_close(h->curl, curl_closed, h);
}

static void poll_timer_closed(uv_handle_t *t)
{
    hf_hub *h = t->data;

    remote_fetch_release(&h->f);
}

static void hf_close(hub *base, void (*done)(void *), void *arg)
{
    hf_hub *h = (hf_hub *)base;

    h->close_done = done;
    h->close_arg = arg;
    uv_timer_stop(&h->poll_timer);
    uv_close((uv_handle_t *)&h->poll_timer, poll_timer_closed);
    remote_fetch_close(&h->f);
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
