/* hub_s3: the s3:// transport (hub_s3.h), on libcurl multi inside the libuv loop (curl_uv), every
 * request signed with libcurl's SigV4.
 *
 * Polling: every poll interval, global/step_count.json (a GET); then, while the daemon is not
 * waiting for a global, ListObjectsV2 of <prefix>/nodes/ (every page, by continuation token).  Of
 * each node directory only the delta with the highest local step matters (a worker's later delta
 * replaces its earlier ones in a round, and is never based on an older step), so at most one
 * download per node per poll.  A (key, ETag) pair is handed over once: the pairs handled are
 * remembered in <state>/s3_seen.tsv, also across restarts.
 *
 * Peeking: a new delta's first 64 KiB are read first (a Range GET): a header over the header cap
 * or describing another size than the listing's is refused without a download, a delta of an
 * older step is never downloaded, one of a later step is looked at again by later polls.
 *
 * Downloads: ranged GETs into <state>/cache/incoming, with If-Match on the listed ETag (an object
 * replaced in the middle is never stitched from two versions), capped at the listed size and
 * resumed with Range after a failure or a restart; then verified (the size, and the MD5 when the
 * ETag is a single-part upload's) and handed over with delta_ready (owned).
 *
 * Sharded deltas (hub.h): a node's newest index is its candidate when it is newer than its newest
 * single file; the shards listed next to it (same node and step) version the set (a hash of every
 * key, ETag and size).  The index is read whole (at most ST_INDEX_MAX_BYTES, If-Match) and parsed
 * (it stands in for the peek); when every shard it lists is listed, each is downloaded like a single
 * delta into cache/incoming/s3-<index>-<version>.set/, and the set is handed over at its index's
 * path.  A partial set waits for a listing with another version.  A sharded global is adopted the
 * same way.
 *
 * Publishing: first a claim (with a lease: see "the step's claim" below), PUT
 * <prefix>/global/steps/<step>.claim with If-None-Match: * (the
 * server refuses the second writer with 412): of several aggregators on one bucket exactly one
 * publishes each step; the others report publish_done with why, and adopt the winner's step from
 * its step_count.json at the next poll.  A claim of our own (a restart in the middle of a publish)
 * is recognised by the instance id in <state>/s3_instance.  Then global/latest.safetensors, one PUT
 * up to the part size and a multipart upload above it (S3 refuses single PUTs over 5 GB), or for a
 * sharded global each shard that way and the index, then global/step_count.json, last; then the
 * other layout's objects are deleted.
 *
 * Answers are hostile: XML through expat with caps (s3_api.c), sizes exact below 2^53, a download
 * may not grow past its listed size, memory answers are capped, pages, listing bytes and new entries
 * per listing are capped, a repeated continuation token ends the listing, and every request has curl_uv's connect and low-speed limits. */
#include "hub.h"
#include "hub_s3.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <math.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cJSON.h>
#include <openssl/evp.h>
#include <openssl/rand.h>

#include "curl_uv.h"
#include "curl_uv_aws.h"
#include "delta.h"
#include "dl_log.h"
#include "fsutil.h"
#include "hub_set.h"
#include "jobs.h"
#include "remote.h"
#include "safetensors.h"
#include "seen.h"
#include "st_index.h"
#include "stepcount.h"
#include "strbuf.h"

#define DEFAULT_PART_SIZE (64ull << 20)
/* A delta's first bytes, read before its download: its header when it fits (a header parse of this
 * size is well under a millisecond on the loop thread). */
#define PEEK_BYTES 65536
#define MAX_ATTEMPTS_DOWNLOAD 6
#define MAX_BACKOFF REMOTE_MAX_BACKOFF
#define STEPFILE_CAP (64u << 10)
#define CLAIM_CAP (4u << 10)
#define XML_CAP (4u << 20)
#define MAX_LIST_PAGES 1000
/* listing bytes read per poll: a page of 1,000 keys is about 300 KiB, so this is some 200 pages; a
 * server that sends 4 MiB pages (or loops its token) costs at most this much XML per poll */
#define MAX_LIST_BYTES_PER_POLL (64ull << 20)
/* Caps of one poll, fair per node: a node's keys are contiguous in the sorted listing, so a poll that fills
 * a table stops at the boundary of the node that did not fit, and the next poll starts there
 * (start-after), where the listing's first page would otherwise make the same nodes win every time. */
#define MAX_NODES_PER_LISTING 8192
#define MAX_SHARDS_PER_LISTING 65536
/* shards remembered of one node: its one set's (more than any model's tensors need; a node that lists
 * more has its extra shards ignored, and its set is incomplete) */
#define MAX_SHARDS_PER_NODE 16384
#define CREDENTIALS_FILE_CAP (64u << 10)
#define EMPTY_SHA256 "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"

typedef struct s3_hub s3_hub;
typedef remote_req s3_req;         /* remote.h: the retrying request */
typedef void (*s3_req_cb)(s3_hub *h, s3_req *r, int ok);

/* ---- requests with retries ------------------------------------------------------------------- */


typedef struct candidate {
    char *rel;                  /* nodes/<id>/delta_<n>.safetensors, or global/latest.safetensors */
    char *key;
    char etag[80];
    char ver[80];               /* the seen list's version: the ETag, or a set's (set_version) */
    uint64_t size;
    int is_set;                 /* an index: fetched, parsed, then its shards become candidates */
    s3_object *listed;          /* is_set: the shards of its base that the listing showed */
    size_t nlisted;
    hub_set *set;               /* a shard: the set it belongs to */
    char *part;
    int attempts;
    uint64_t not_before;        /* loop ms */
    int is_global;
    int peeked;                 /* its header was looked at (or could not be): download it */
    uint64_t step;              /* is_global: the step the step file named */
    struct candidate *next;
} candidate;

/* One object of a publish: the plain global, or a shard or the index of a sharded one. */
typedef struct pub_file {
    char rel[ST_INDEX_BASE_MAX + 64];   /* global/<name> */
    int fd;
    uint64_t size;
} pub_file;

typedef struct pub_state {
    int active;
    uint64_t step;
    char optimizer[32];
    int bootstrap;
    int sharded;
    pub_file *files;            /* in upload order: the shards, then the index (or the one file) */
    unsigned nfiles, cur;
    int fd;                     /* files[cur]'s */
    uint64_t size;
    char *stepfile;
    char *upload_id;
    char **etags;
    uint64_t part_size;
    unsigned nparts, next_part;
    /* the step's claim (see pub_claim) */
    char claim_body[256];       /* what we write, exactly: compared with a read-back after a 412 */
    size_t claim_len;
    unsigned renewal;           /* in the body, so that each renewal is a new ETag */
    char claim_etag[160];       /* ours once we hold it: renewals are If-Match on it */
    int claim_held, claim_waiting, claim_gone, claim_lost, takeovers, warned;
    char foreign_ver[240];      /* the foreign claim's ETag + Last-Modified, and since when (loop ms) */
    uint64_t foreign_since;
    unsigned gen;               /* this publish's number: a late renewal answer of an earlier one is ignored */
} pub_state;

/* One page-walk of the nodes/ listing: the best delta (a file or an index) of each node so far,
 * and every shard listed, matched to the indexes after the last page. */
typedef struct best_entry {
    char node[DELTA_NODE_ID_MAX + 1];
    uint64_t local_step;
    char *key;
    char etag[80];
    uint64_t size;
    int is_index;
} best_entry;

typedef struct shard_entry {
    char node[DELTA_NODE_ID_MAX + 1];
    uint64_t local_step;
    s3_object obj;
} shard_entry;

struct s3_hub {
    hub base;                   /* first: the transport interface's handle */
    uv_loop_t *loop;
    cuv *curl;
    hub_callbacks cb;
    void *app;
    char *endpoint, *bucket, *prefix, *region, *key_id, *secret, *state_dir;
    char instance[33];          /* this state root's id in claims */
    int virtual_host;
    uint64_t part_size;
    double poll_interval;
    unsigned max_downloads;
    uint64_t max_header;
    hub_limits limits;          /* the open round's model (hub_set_limits) */
    uv_timer_t poll_timer;
    int closing, polling;
    hub_status st;
    uint64_t step;
    int waiting;
    remote_seen seen;           /* every listed (path, version) looked at, the decided ones in a file */
    remote_global_gate gate;    /* the global last handed over: not fetched again at every poll */
    candidate *queue, *retry;
    unsigned active_downloads;
    int global_download;
    int64_t published_known;    /* -2: nothing reported yet */
    best_entry *best;
    size_t nbest;
    shard_entry *shards;
    size_t nshards, shards_cap;
    hub_set *sets;              /* sets whose shards are downloading */
    int adopt_sharded;          /* the adoption in flight is of a sharded global */
    unsigned list_pages;
    uint64_t list_bytes;        /* listing bytes read this poll */
    uint64_t *list_tokens;      /* hashes of the continuation tokens of this poll (a repeat ends it) */
    char *resume_after;         /* where the next poll starts (start-after), NULL: at the top */
    char *node_boundary;        /* this poll: the last key before the current node's first, NULL: none */
    char *prev_key;             /* this poll: the last delta key considered */
    char cur_node[DELTA_NODE_ID_MAX + 1];   /* this poll: the node of prev_key */
    size_t cur_node_shards;     /* its shards remembered */
    int list_full;              /* a table filled: the poll ends at node_boundary */
    remote rm;                  /* requests: retries, failures, every one in flight */
    job_owner jobs;             /* pool jobs out (jobs.h): verifies, index parses, hashes */
    pub_state pub;
    unsigned pub_gen;
    double claim_lease;         /* seconds */
    uv_timer_t claim_timer;     /* waits out a foreign claim's lease, or renews ours */
    uint64_t claim_waits;       /* foreign live claims waited out (each one once per publish is logged) */
    void (*close_done)(void *);
    void *close_arg;
    int handles;                /* poll timer + pool jobs + pending appends */
};


/* A failure recorded in /status and logged when it changes (remote.h). */
#define set_error(h, ...) remote_error(&(h)->rm, __VA_ARGS__)

/* "HTTP 403 InvalidAccessKeyId: The AWS Access Key Id you provided does not exist in our records." */
static void describe_answer(const cuv_xfer *x, char *out, size_t size)
{
    char code[64], msg[160];

    if (x->result != CURLE_OK) {
        snprintf(out, size, "%s", curl_easy_strerror(x->result));
        return;
    }
    if (s3_parse_error(x->body.p, x->body.len, code, sizeof(code), msg, sizeof(msg)) && code[0])
        snprintf(out, size, "HTTP %ld %s%s%s", x->status, code, msg[0] ? ": " : "", msg);
    else
        snprintf(out, size, "HTTP %ld", x->status);
}

/* key NULL: the bucket; query canonical (s3_list_query, or hand-sorted below).  Messages name the key. */
static s3_req *req_new(s3_hub *h, const char *method, const char *key, const char *query, const char *route)
{
    char *url = s3_url(h->endpoint, h->bucket, h->virtual_host, key, query);
    s3_req *r = url != NULL ? remote_req_new(&h->rm, method, url, key ? key : "(bucket)", route) : NULL;

    free(url);
    return r;
}

static int sha256_hex(const void *data, size_t len, char hex[65])
{
    static const char digits[] = "0123456789abcdef";
    unsigned char md[EVP_MAX_MD_SIZE];
    unsigned mdlen = 0;

    if (EVP_Digest(data, len, md, &mdlen, EVP_sha256(), NULL) != 1 || mdlen != 32)
        return -1;
    for (unsigned i = 0; i < 32; i++) {
        hex[2 * i] = digits[md[i] >> 4];
        hex[2 * i + 1] = digits[md[i] & 15];
    }
    hex[64] = '\0';
    return 0;
}

/* Each attempt signed with SigV4, and the payload hash it signs: libcurl takes it from this header
 * (it could not hash a body it reads through a callback); a file body is sent unsigned, as the AWS
 * SDKs do over TLS. */
static int s3_authorize(remote *rm, remote_req *r, cuv_xfer *x)
{
    s3_hub *h = rm->owner;
    char hex[65], line[128];

    if (r->has_body) {
        if (sha256_hex(r->body, r->body_len, hex) != 0)
            return -1;
        snprintf(line, sizeof(line), "x-amz-content-sha256: %s", hex);
        cuv_xfer_header(x, line);
    } else if (r->src_fd >= 0) {
        cuv_xfer_header(x, "x-amz-content-sha256: UNSIGNED-PAYLOAD");
    } else {
        cuv_xfer_header(x, "x-amz-content-sha256: " EMPTY_SHA256);
    }
    if (strcmp(r->method, "DELETE") == 0)
        cuv_xfer_method(x, "DELETE");
    cuv_xfer_aws_sigv4(x, h->region, h->key_id, h->secret);
    return 0;
}

static void s3_complete(remote *rm, remote_req *r, int ok)
{
    ((s3_req_cb)r->cb)(rm->owner, r, ok);
}

static const remote_ops s3_remote_ops = {
    .failure_log = "s3 request failed",
    .authorize = s3_authorize,
    .describe = describe_answer,
    .complete = s3_complete,
};

/* cb, of this file's type, runs when r ends (remote_go). */
static void req_go(s3_hub *h, s3_req *r, s3_req_cb cb, void *arg)
{
    (void)h;
    remote_go(r, (remote_fn)cb, arg);
}

/* <prefix>/<rel>, or rel when there is no prefix.  malloc'd. */
static char *full_key(const s3_hub *h, const char *rel)
{
    char *k = NULL;
    if (asprintf(&k, "%s%s%s", h->prefix, h->prefix[0] ? "/" : "", rel) < 0)
        return NULL;
    return k;
}

/* ---- the seen list ----------------------------------------------------------------------------- */






/* Whatever the daemon decided, a handed-over (key, ETag) is not downloaded again; a download is
 * verified against the listing, so one that intake finds short is final. */
static int s3_mark_done(hub *base, const char *rel, hub_outcome outcome, const hub_version *v)
{
    (void)v;
    return remote_seen_decided(&((s3_hub *)base)->seen, rel, outcome);
}

/* ---- downloads --------------------------------------------------------------------------------- */

static void candidate_free(candidate *c)
{
    if (c == NULL)
        return;
    free(c->rel);
    free(c->key);
    free(c->part);
    for (size_t i = 0; i < c->nlisted; i++)
        free(c->listed[i].key);
    free(c->listed);
    free(c);
}

static void pump_downloads(s3_hub *h);

static void retry_later(s3_hub *h, candidate *c)
{
    int k = c->attempts > 1 ? c->attempts - 1 : 0;
    double wait = remote_jittered(fmin(ldexp(1.0, k < 16 ? k : 16), MAX_BACKOFF));
    c->not_before = uv_now(h->loop) + (uint64_t)(wait * 1000);
    c->next = h->retry;
    h->retry = c;
}

static void dset_shard_finished(s3_hub *h, hub_set *set, int ok, seen_state fail_state);

/* A candidate is done with for this run (given up, or its object changed): forget it. */
static void candidate_drop(s3_hub *h, candidate *c, seen_state state)
{
    if (c->set != NULL)
        dset_shard_finished(h, c->set, 0, state);
    else if (c->is_global)
        h->global_download = 0;
    else
        remote_seen_set(&h->seen, c->rel, c->ver, state);
    candidate_free(c);
}

typedef struct verify_job {
    s3_hub *h;
    candidate *c;
    int ok;
    char why[200];
} verify_job;

/* A single-part upload's ETag is the MD5 of the object (32 hex digits); a multipart one's is not
 * ("<md5 of md5s>-<parts>"), and neither is an SSE-KMS object's: those are checked by size and by
 * If-Match on the ETag while downloading. */
static int etag_is_md5(const char *etag)
{
    size_t n = strlen(etag);
    if (n != 32)
        return 0;
    for (size_t i = 0; i < n; i++)
        if (!((etag[i] >= '0' && etag[i] <= '9') || (etag[i] >= 'a' && etag[i] <= 'f')))
            return 0;
    return 1;
}

static void verify_work(pool_job *pj)
{
    static const char digits[] = "0123456789abcdef";
    verify_job *j = pj->arg;
    candidate *c = j->c;
    struct stat sb;
    int fd = open(c->part, O_RDONLY | O_CLOEXEC);

    if (fd < 0 || fstat(fd, &sb) != 0) {
        snprintf(j->why, sizeof(j->why), "cannot read the download: %s", strerror(errno));
        goto out;
    }
    if ((uint64_t)sb.st_size != c->size) {
        snprintf(j->why, sizeof(j->why), "%lld bytes, the listing says %" PRIu64, (long long)sb.st_size, c->size);
        goto out;
    }
    if (etag_is_md5(c->etag)) {
        EVP_MD_CTX *ctx = EVP_MD_CTX_new();
        unsigned char md[EVP_MAX_MD_SIZE], *buf = malloc(1 << 20);
        unsigned mdlen = 0;
        int bad = ctx == NULL || buf == NULL || EVP_DigestInit_ex(ctx, EVP_md5(), NULL) != 1;
        for (ssize_t r; !bad && (r = read(fd, buf, 1 << 20)) != 0;) {
            if (r < 0 && errno == EINTR)
                continue;
            bad = r < 0 || EVP_DigestUpdate(ctx, buf, (size_t)r) != 1;
        }
        bad = bad || EVP_DigestFinal_ex(ctx, md, &mdlen) != 1 || mdlen != 16;
        char hex[33] = "";
        for (unsigned i = 0; !bad && i < 16; i++) {
            hex[2 * i] = digits[md[i] >> 4];
            hex[2 * i + 1] = digits[md[i] & 15];
        }
        EVP_MD_CTX_free(ctx);
        free(buf);
        if (bad) {
            snprintf(j->why, sizeof(j->why), "cannot hash the download");
            goto out;
        }
        if (strcmp(hex, c->etag) != 0) {
            snprintf(j->why, sizeof(j->why), "MD5 %s, the ETag says %s", hex, c->etag);
            goto out;
        }
    }
    j->ok = 1;
out:
    if (fd >= 0)
        close(fd);
}

/* The global was listed after step_count.json was read: a publish in between would pair the new
 * model with the old step.  Publishers write the model first and the step file last, so reading the
 * step file again after the download tells: unchanged, the model is that step's. */
static void adopt_confirm_done(s3_hub *h, s3_req *r, int ok)
{
    candidate *c = r->arg;
    uint64_t step = 0;
    int bootstrap = 0;

    if (!h->closing && ok && stepcount_parse(r->x->body.p, r->x->body.len, &step, &bootstrap, NULL, NULL) == 0 &&
        step == c->step) {
        remote_req_end(r);
        h->global_download = 0;
        remote_global_handed(&h->gate, c->step, c->ver, uv_now(h->loop), h->poll_interval);
        h->cb.global_ready(h->app, c->step, c->part);
        candidate_free(c);
        return;
    }
    remote_req_end(r);
    if (!h->closing)
        dl_log(DL_LOG_INFO, "hub", "the bucket's step moved during the adoption download, trying again",
               "step=%" PRIu64, c->step);
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
    h->global_download = 0;     /* the next poll starts the adoption over */
    candidate_free(c);
}

static void adopt_confirm(s3_hub *h, candidate *c)
{
    char *key = full_key(h, "global/step_count.json");
    s3_req *r = key ? req_new(h, "GET", key, NULL, "step_count") : NULL;

    free(key);
    if (r == NULL) {
        unlink(c->part);
        h->global_download = 0;
        candidate_free(c);
        return;
    }
    r->body_cap = STEPFILE_CAP;
    r->max_attempts = 3;
    req_go(h, r, adopt_confirm_done, c);
}

static void verify_after(pool_job *pj)
{
    verify_job *j = pj->arg;
    int status = pj->cancelled ? UV_ECANCELED : 0;
    s3_hub *h = j->h;
    candidate *c = j->c;
    char q[300];

    h->active_downloads--;
    if (status == 0 && j->ok && !h->closing) {
        h->st.downloads++;
        h->st.download_bytes += c->size;
        dl_log(DL_LOG_DEBUG, "hub", "s3 object downloaded", "key=%s bytes=%" PRIu64 " etag=%s", c->key, c->size,
               c->etag);
        if (c->set != NULL) {
            hub_set *set = c->set;
            candidate_free(c);
            dset_shard_finished(h, set, 1, SEEN_DONE);
        } else if (c->is_global) {
            adopt_confirm(h, c);
        } else {
            hub_delta d = {.rel = c->rel, .path = c->part, .root = NULL, .owned = 1};
            h->cb.delta_ready(h->app, &d);
            candidate_free(c);
        }
    } else {
        if (status == 0 && !h->closing) {
            dl_log(DL_LOG_WARN, "hub", "download does not match the listing, discarded", "key=%s reason=%s", c->key,
                   dl_log_q(q, sizeof(q), j->why));
            set_error(h, "%s: %s", c->key, j->why);
        }
        /* a complete download cut short by a stop is kept: the next start resumes or reuses it */
        if (status == 0 && !j->ok)
            unlink(c->part);
        if (++c->attempts < MAX_ATTEMPTS_DOWNLOAD && !h->closing)
            retry_later(h, c);
        else
            candidate_drop(h, c, SEEN_REJECTED);
    }
    free(j);
    pump_downloads(h);
}

static void download_done(s3_hub *h, s3_req *r, int ok)
{
    candidate *c = r->arg;
    long status = r->x ? r->x->status : 0;
    int range_ignored = r->sink_off > 0 && status == 200;
    int too_big = r->x && r->x->too_big;
    int fd = r->sink_fd;
    char why[256] = "";

    if (!ok && r->x && !h->closing)
        describe_answer(r->x, why, sizeof(why));
    remote_req_end(r);
    close(fd);
    if (status == 412 && !h->closing) {
        /* replaced since the listing: the next listing shows the new version */
        dl_log(DL_LOG_INFO, "hub", "s3 object changed while downloading", "key=%s", c->key);
        unlink(c->part);
        h->active_downloads--;
        candidate_drop(h, c, SEEN_DONE);
        pump_downloads(h);
        return;
    }
    if (!ok || range_ignored || h->closing) {
        h->active_downloads--;
        if (!h->closing && why[0])
            set_error(h, "GET %s: %s", c->key, why);
        if (range_ignored || status == 416 || too_big)
            unlink(c->part);    /* start over: the server would not resume, or sent too much */
        if (!h->closing && ++c->attempts < MAX_ATTEMPTS_DOWNLOAD)
            retry_later(h, c);
        else
            candidate_drop(h, c, SEEN_REJECTED);
        pump_downloads(h);
        return;
    }
    verify_job *j = calloc(1, sizeof(*j));
    if (j == NULL) {
        h->active_downloads--;
        candidate_drop(h, c, SEEN_REJECTED);
        return;
    }
    j->h = h;
    j->c = c;
    if (job_queue(&h->jobs, verify_work, verify_after, j) != 0) {
        h->active_downloads--;
        free(j);
        candidate_drop(h, c, SEEN_REJECTED);
    }
}

/* The part file's name: the key's path and the ETag, in characters any file system takes. */
static char *part_path(const s3_hub *h, const candidate *c)
{
    sbuf b = {0};
    sb_str(&b, h->state_dir);
    sb_str(&b, "/cache/incoming/s3-");
    for (const char *s = c->rel; *s; s++)
        sb_add(&b, (*s >= 'a' && *s <= 'z') || (*s >= 'A' && *s <= 'Z') || (*s >= '0' && *s <= '9') || *s == '-' ||
                           *s == '.' || *s == '_' ? s : "_", 1);
    sb_str(&b, "-");
    for (const char *s = c->ver; *s; s++)
        sb_add(&b, (*s >= 'a' && *s <= 'z') || (*s >= 'A' && *s <= 'Z') || (*s >= '0' && *s <= '9') || *s == '-' ? s
                                                                                                             : "_", 1);
    sb_str(&b, ".part");
    return sb_take(&b);
}

static void start_download(s3_hub *h, candidate *c)
{
    struct stat sb;
    char line[160];
    s3_req *r;
    int fd;

    if (c->part == NULL)
        c->part = part_path(h, c);
    /* a small open of our own cache file; the data goes through uv_fs_write */
    fd = c->part ? open(c->part, O_WRONLY | O_CREAT | O_CLOEXEC, 0644) : -1;
    if (fd < 0 || fstat(fd, &sb) != 0 || (r = req_new(h, "GET", c->key, NULL, "download")) == NULL) {
        if (fd >= 0)
            close(fd);
        set_error(h, "cannot open %s: %s", c->part ? c->part : "a download file", strerror(errno));
        candidate_drop(h, c, SEEN_REJECTED);
        return;
    }
    uint64_t have = (uint64_t)sb.st_size;
    if (have > c->size) {
        have = 0;
        if (ftruncate(fd, 0) != 0) {
            close(fd);
            remote_req_end(r);
            candidate_drop(h, c, SEEN_REJECTED);
            return;
        }
    }
    if (have == c->size && have > 0) {
        /* complete before a restart: ask for the last byte only, to confirm the ETag still holds */
        have = c->size - 1;
    }
    if (have > 0) {
        dl_log(DL_LOG_INFO, "hub", "resuming a download", "key=%s from=%" PRIu64 " size=%" PRIu64, c->key, have,
               c->size);
        snprintf(line, sizeof(line), "Range: bytes=%" PRIu64 "-", have);
        remote_req_header(r, line);
    }
    snprintf(line, sizeof(line), "If-Match: \"%s\"", c->etag);
    remote_req_header(r, line);
    r->sink_fd = fd;
    r->sink_off = have;
    r->sink_max = c->size;
    r->sink_capped = 1;
    r->max_attempts = 1;        /* resume is driven from here, with a fresh Range each time */
    h->active_downloads++;
    req_go(h, r, download_done, c);
}

/* ---- peeking at a delta's header --------------------------------------------------------------- */

static void enqueue(s3_hub *h, candidate *c);

/* Why the delta is refused before its download (NULL: not refused); *base is its base_outer_step
 * when the header was read, else UINT64_MAX. */
static const char *judge_header(const s3_hub *h, const candidate *c, const sbuf *b, uint64_t *base, char *why,
                                size_t why_size)
{
    const unsigned char *p = (const unsigned char *)b->p;
    uint64_t n = 0, want = 0;
    st_header *hd = NULL;

    *base = UINT64_MAX;
    for (int i = 7; i >= 0; i--)
        n = (n << 8) | p[i];
    if (n > h->max_header) {
        snprintf(why, why_size, "header of %" PRIu64 " bytes, the cap is %" PRIu64, n, h->max_header);
        return why;
    }
    if (c->size < 8 || n > c->size - 8) {
        snprintf(why, why_size, "header of %" PRIu64 " bytes in an object of %" PRIu64, n, c->size);
        return why;
    }
    if (8 + n > b->len || st_header_parse_unsized(b->p + 8, (size_t)n, &hd, NULL) != 0)
        return NULL;            /* larger than the peek, or bad: the intake's full check says why */
    const char *res = NULL;
    if (st_header_file_len(hd, &want) != 0 || want != c->size) {
        snprintf(why, why_size, "the header describes %" PRIu64 " bytes, the listing says %" PRIu64, want, c->size);
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

static void peek_done(s3_hub *h, s3_req *r, int ok)
{
    candidate *c = r->arg;
    uint64_t base = UINT64_MAX;
    char whybuf[200], q[260];
    const char *why = NULL;

    h->active_downloads--;
    if (ok && !h->closing && r->x->body.len >= 8)
        why = judge_header(h, c, &r->x->body, &base, whybuf, sizeof(whybuf));
    remote_req_end(r);
    if (h->closing) {
        candidate_free(c);
        return;
    }
    if (why != NULL) {
        /* never downloaded; a restart (perhaps with another cap) looks again */
        dl_log(DL_LOG_WARN, "hub", "delta refused before download", "key=%s reason=%s", c->key,
               dl_log_q(q, sizeof(q), why));
        set_error(h, "%s: %s", c->key, why);
        candidate_drop(h, c, SEEN_REJECTED);
    } else if (base != UINT64_MAX && base < h->step) {
        dl_log(DL_LOG_DEBUG, "hub", "stale delta not downloaded", "key=%s base_outer_step=%" PRIu64, c->key, base);
        remote_seen_done(&h->seen, c->rel, c->ver);
        candidate_free(c);
    } else if (base != UINT64_MAX && base > h->step) {
        /* a later round's (or never ours): looked at again by later polls */
        candidate_drop(h, c, SEEN_INCOMPLETE);
    } else {
        /* the current round's, or a header the peek could not judge: the download and intake decide */
        c->peeked = 1;
        enqueue(h, c);
    }
    pump_downloads(h);
}

static void start_peek(s3_hub *h, candidate *c)
{
    char line[160];
    s3_req *r = req_new(h, "GET", c->key, NULL, "peek");

    if (r == NULL) {
        candidate_drop(h, c, SEEN_REJECTED);
        return;
    }
    snprintf(line, sizeof(line), "Range: bytes=0-%u", PEEK_BYTES - 1);
    remote_req_header(r, line);
    snprintf(line, sizeof(line), "If-Match: \"%s\"", c->etag);
    remote_req_header(r, line);
    /* a server that ignores Range and sends the whole object is cut off here */
    r->body_cap = PEEK_BYTES;
    r->max_attempts = 2;
    h->active_downloads++;
    req_go(h, r, peek_done, c);
}

static candidate *candidate_new(s3_hub *h, const char *rel, const char *key, const char *etag, uint64_t size);

/* ---- sharded sets ------------------------------------------------------------------------------ */

/* A set's version for the seen list (hub_set.h): the index's ETag and every listed shard of its base
 * (key, ETag, size). */
static int set_version(const char *index_etag, const s3_object *listed, size_t n, char *out, size_t size)
{
    hub_set_version v;

    hub_set_version_start(&v, index_etag);
    for (size_t i = 0; i < n; i++)
        hub_set_version_add(&v, listed[i].key, listed[i].etag, listed[i].size);
    return hub_set_version_end(&v, out, size);
}

static void adopt_confirm(s3_hub *h, candidate *c);

/* One shard candidate of set finished (ok: verified); after the last one the set is handed over,
 * or, when a shard failed, dropped as a whole (its version is not taken this run). */
static void dset_shard_finished(s3_hub *h, hub_set *set, int ok, seen_state fail_state)
{
    if (!hub_set_shard_done(set, ok, fail_state))
        return;
    if (set->failed || h->closing) {
        /* a stop keeps the directory: the next start resumes the shards there */
        if (!h->closing)
            dl_log(DL_LOG_INFO, "hub", "sharded set not taken: a shard could not be downloaded", "key=%s", set->rel);
        if (set->is_global)
            h->global_download = 0;
        else
            remote_seen_set(&h->seen, set->rel, set->ver, set->fail_state);
        hub_set_drop(&h->sets, set, h->closing);
        return;
    }
    if (set->is_global) {
        candidate *g = candidate_new(h, set->rel, set->rel, set->ver, 0);
        if (g == NULL || (g->part = strdup(set->index_path)) == NULL) {
            candidate_free(g);
            hub_set_remove_dir(set->dir);
            h->global_download = 0;
        } else {
            g->is_global = 1;
            g->is_set = 1;
            g->step = set->step;
            adopt_confirm(h, g);
        }
    } else {
        hub_set_hand_over(set, &h->cb, h->app);
    }
    hub_set_free(&h->sets, set);
}

static char *part_path(const s3_hub *h, const candidate *c);

/* The set's directory (named like a part file, ".set" for ".part") with the index written into it. */
static hub_set *dset_new(s3_hub *h, candidate *c, const char *index_text, size_t index_len)
{
    char *dir = part_path(h, c);
    dl_error err = {0};
    hub_set *set;

    if (dir != NULL && strlen(dir) >= 5) {
        memcpy(dir + strlen(dir) - 5, ".set", 5);     /* ".part" -> ".set" and its NUL */
    } else {
        free(dir);
        dir = NULL;
    }
    set = hub_set_new(&h->sets, dir, c->rel, c->ver, c->is_global, c->step, index_text, index_len, &err);
    if (set == NULL && err.code != DL_E_NO_MEMORY)
        set_error(h, "cannot store the index of %s: %s", c->key, err.message);
    return set;
}

/* The listed object of c's set that is called name in the index's directory, or NULL. */
static const s3_object *listed_shard(const candidate *c, const char *name)
{
    for (size_t i = 0; i < c->nlisted; i++)
        if (hub_set_path_names(c->listed[i].key, name))
            return &c->listed[i];
    return NULL;
}

static int shard_listed(const void *c, const char *name, uint64_t *bytes)
{
    const s3_object *o = listed_shard(c, name);

    *bytes = o ? o->size : 0;
    return o != NULL;
}

/* The index is parsed: the stale or later round's set is judged here (as a single delta's peek
 * judges it), a partial set waits for a listing that shows every shard, and a complete one gets a
 * directory and one candidate per shard. */
static void set_start_shards(s3_hub *h, candidate *c, const st_index *ix, const char *text, size_t len)
{
    char name[ST_INDEX_BASE_MAX + 48], q[300];
    uint64_t base, total;
    int verdict = c->is_global ? 0 : hub_set_base_verdict(ix, h->step, &base);

    if (verdict < 0) {
        dl_log(DL_LOG_DEBUG, "hub", "stale delta not downloaded", "key=%s base_outer_step=%" PRIu64, c->key, base);
        remote_seen_done(&h->seen, c->rel, c->ver);
        candidate_free(c);
        return;
    }
    if (verdict > 0) {
        candidate_drop(h, c, SEEN_INCOMPLETE);
        return;
    }
    if (hub_set_listed_shards(ix, shard_listed, c, name, sizeof(name), &total)) {
        /* a later listing that shows the shard has another version: the set is looked at again */
        dl_log(DL_LOG_DEBUG, "hub", "sharded set incomplete, waiting for its shards", "key=%s missing=%s", c->key,
               dl_log_q(q, sizeof(q), name));
        candidate_drop(h, c, SEEN_REJECTED);
        return;
    }
    if (!c->is_global && h->limits.delta_set_bytes != 0 && total > h->limits.delta_set_bytes) {
        /* refused from the listing, before a byte: this version of the set is not looked at again */
        snprintf(q, sizeof(q), "its shards are %" PRIu64 " bytes together, a delta of this model at most %" PRIu64,
                 total, h->limits.delta_set_bytes);
        dl_log(DL_LOG_WARN, "hub", "delta refused before download", "key=%s reason=\"%s\"", c->key, q);
        set_error(h, "%s: %s", c->key, q);
        candidate_drop(h, c, SEEN_REJECTED);
        return;
    }
    hub_set *set = dset_new(h, c, text, len);
    if (set == NULL) {
        candidate_drop(h, c, SEEN_REJECTED);
        return;
    }
    set->pending = ix->nshards;
    size_t dlen = (size_t)(strrchr(c->rel, '/') - c->rel);
    for (uint32_t i = 0; i < ix->nshards; i++) {
        st_index_shard_name(ix->base, i, ix->nshards, name, sizeof(name));
        const s3_object *o = listed_shard(c, name);
        char *rel = NULL;
        candidate *s = NULL;
        if (asprintf(&rel, "%.*s/%s", (int)dlen, c->rel, name) >= 0)
            s = candidate_new(h, rel, o->key, o->etag, o->size);
        free(rel);
        if (s == NULL || asprintf(&s->part, "%s/%s", set->dir, name) < 0) {
            if (s != NULL)
                s->part = NULL;
            candidate_free(s);
            dset_shard_finished(h, set, 0, SEEN_REJECTED);
            continue;
        }
        s->set = set;
        s->peeked = 1;
        enqueue(h, s);
    }
    candidate_free(c);
}

/* The index parsed (hub_set_parse_index): the download stays counted in active_downloads until here. */
static void index_parsed(hub_index_job *j)
{
    s3_hub *h = j->owner;
    candidate *c = j->arg;

    h->active_downloads--;
    if (h->closing || j->cancelled) {
        candidate_free(c);
    } else if (j->rc == 0) {
        set_start_shards(h, c, j->ix, j->text, j->len);
    } else if (c->is_global) {
        set_error(h, "the bucket's global index %s: %s", c->key, j->err.message);
        candidate_drop(h, c, SEEN_REJECTED);
    } else {
        /* handed over alone: intake refuses it with the reason, once for this version */
        hub_set *set = dset_new(h, c, j->text, j->len);
        if (set == NULL) {
            candidate_drop(h, c, SEEN_REJECTED);
        } else {
            candidate_free(c);
            dset_shard_finished(h, set, 1, SEEN_DONE);
        }
    }
    hub_index_job_free(j);
    if (!h->closing)
        pump_downloads(h);
}

static void index_done(s3_hub *h, s3_req *r, int ok)
{
    candidate *c = r->arg;
    long status = r->x ? r->x->status : 0;
    char why[256] = "";

    if (h->closing) {
        h->active_downloads--;
        remote_req_end(r);
        candidate_free(c);
        return;
    }
    if (!ok) {
        h->active_downloads--;
        if (r->x != NULL)
            describe_answer(r->x, why, sizeof(why));
        remote_req_end(r);
        if (status == 412) {
            candidate_drop(h, c, SEEN_DONE);        /* replaced: the next listing has the new version */
        } else {
            set_error(h, "GET %s: %s", c->key, why);
            if (++c->attempts < MAX_ATTEMPTS_DOWNLOAD)
                retry_later(h, c);
            else
                candidate_drop(h, c, SEEN_REJECTED);
        }
        pump_downloads(h);
        return;
    }
    size_t len = r->x->body.len;
    char *text = sb_take(&r->x->body);
    remote_req_end(r);
    size_t cap = hub_set_index_cap(&h->limits, c->is_global);
    hub_index_job *j = hub_index_job_new(text, len, c->rel, cap, index_parsed, h, c);
    if (j == NULL || hub_index_job_queue(&h->jobs, j) != 0) {
        hub_index_job_free(j);
        h->active_downloads--;
        candidate_drop(h, c, SEEN_REJECTED);
        pump_downloads(h);
        return;
    }
}

/* An index is read whole into memory, capped as huggingface_hub caps it. */
static void start_index(s3_hub *h, candidate *c)
{
    char line[160], q[300];
    size_t cap = hub_set_index_cap(&h->limits, c->is_global);
    s3_req *r;

    if (c->size > cap) {
        snprintf(line, sizeof(line), "an index of %" PRIu64 " bytes, the cap is %zu", c->size, cap);
        dl_log(DL_LOG_WARN, "hub", "delta refused before download", "key=%s reason=%s", c->key,
               dl_log_q(q, sizeof(q), line));
        set_error(h, "%s: %s", c->key, line);
        candidate_drop(h, c, SEEN_REJECTED);
        return;
    }
    if ((r = req_new(h, "GET", c->key, NULL, "index")) == NULL) {
        candidate_drop(h, c, SEEN_REJECTED);
        return;
    }
    snprintf(line, sizeof(line), "If-Match: \"%s\"", c->etag);
    remote_req_header(r, line);
    r->body_cap = cap;
    r->max_attempts = 3;
    h->active_downloads++;
    req_go(h, r, index_done, c);
}

static void pump_downloads(s3_hub *h)
{
    uint64_t now = uv_now(h->loop);
    if (h->closing)
        return;
    while (h->active_downloads < h->max_downloads && h->queue != NULL) {
        candidate *c = h->queue;
        h->queue = c->next;
        c->next = NULL;
        if (c->not_before > now) {
            c->next = h->retry;
            h->retry = c;
            continue;
        }
        if (c->is_set)
            start_index(h, c);
        else if (c->peeked || c->is_global)
            start_download(h, c);
        else
            start_peek(h, c);
    }
}

static candidate *candidate_new(s3_hub *h, const char *rel, const char *key, const char *etag, uint64_t size)
{
    candidate *c = calloc(1, sizeof(*c));
    (void)h;
    if (c == NULL || (c->rel = strdup(rel)) == NULL || (c->key = strdup(key)) == NULL) {
        candidate_free(c);
        return NULL;
    }
    snprintf(c->etag, sizeof(c->etag), "%s", etag);
    snprintf(c->ver, sizeof(c->ver), "%s", etag);
    c->size = size;
    return c;
}

static void enqueue(s3_hub *h, candidate *c)
{
    candidate **t = &h->queue;
    while (*t)
        t = &(*t)->next;
    *t = c;
}

/* A global handed over before and not adopted waits for its backoff (remote_global_gate): listed
 * again at later polls, fetched once it has passed. */
static void enqueue_global(s3_hub *h, candidate *c)
{
    if (remote_global_may_fetch(&h->gate, c->step, c->ver, uv_now(h->loop)))
        enqueue(h, c);
    else
        candidate_free(c);
}

/* ---- polling ----------------------------------------------------------------------------------- */

static void poll_finish(s3_hub *h)
{
    h->polling = 0;
    h->st.last_poll = time(NULL);
    /* failed downloads whose wait is over go back into the queue */
    for (candidate **p = &h->retry; *p;) {
        candidate *c = *p;
        if (c->not_before <= uv_now(h->loop)) {
            *p = c->next;
            c->next = NULL;
            enqueue(h, c);
        } else {
            p = &c->next;
        }
    }
    pump_downloads(h);
}

static void best_reset(s3_hub *h)
{
    for (size_t i = 0; i < h->nbest; i++)
        free(h->best[i].key);
    free(h->best);
    h->best = NULL;
    h->nbest = 0;
    for (size_t i = 0; i < h->nshards; i++)
        free(h->shards[i].obj.key);
    free(h->shards);
    h->shards = NULL;
    h->nshards = h->shards_cap = 0;
    h->list_pages = 0;
    h->list_bytes = 0;
    free(h->list_tokens);
    h->list_tokens = NULL;
    free(h->node_boundary);
    free(h->prev_key);
    h->node_boundary = h->prev_key = NULL;
    h->cur_node[0] = '\0';
    h->cur_node_shards = 0;
    h->list_full = 0;
}

/* Forgets what this poll remembered of node (a node the poll stops in: the next one lists it whole). */
static void forget_node(s3_hub *h, const char *node)
{
    for (size_t i = 0; i < h->nbest;) {
        if (strcmp(h->best[i].node, node) == 0) {
            free(h->best[i].key);
            h->best[i] = h->best[--h->nbest];
        } else {
            i++;
        }
    }
    for (size_t i = 0; i < h->nshards;) {
        if (strcmp(h->shards[i].node, node) == 0) {
            free(h->shards[i].obj.key);
            h->shards[i] = h->shards[--h->nshards];
        } else {
            i++;
        }
    }
}

/* The poll stops before the current node: it is forgotten, and the next poll starts with it (after
 * node_boundary); when it is the poll's first node, after the whole node (it alone is over a cap). */
static void stop_before_node(s3_hub *h)
{
    char *next = NULL;

    if (h->node_boundary != NULL) {
        next = strdup(h->node_boundary);
    } else if (h->cur_node[0] != '\0') {
        /* "<prefix>/nodes/<node>0" sorts after every "<prefix>/nodes/<node>/..." and before the next node */
        char *dir = full_key(h, "nodes/");
        if (dir != NULL && asprintf(&next, "%s%s0", dir, h->cur_node) < 0)
            next = NULL;
        free(dir);
    }
    if (h->cur_node[0] != '\0')
        forget_node(h, h->cur_node);
    free(h->resume_after);
    h->resume_after = next;
    h->list_full = 1;
}

/* Keeps track of the node boundary the listing is at (keys sorted: a node's keys are contiguous).  0, or
 * -1 when the poll must stop here (a table is full and key begins a new node). */
static int enter_node(s3_hub *h, const char *key, const char *node)
{
    if (strcmp(h->cur_node, node) == 0)
        goto same;
    if (h->nbest == MAX_NODES_PER_LISTING || h->nshards == MAX_SHARDS_PER_LISTING) {
        /* the previous node is whole; this one starts the next poll */
        free(h->resume_after);
        h->resume_after = h->prev_key != NULL ? strdup(h->prev_key) : NULL;
        h->list_full = 1;
        return -1;
    }
    free(h->node_boundary);
    h->node_boundary = h->prev_key;
    h->prev_key = NULL;
    snprintf(h->cur_node, sizeof(h->cur_node), "%s", node);
    h->cur_node_shards = 0;
same:
    free(h->prev_key);
    h->prev_key = strdup(key);
    return 0;
}

/* A shard is remembered for the index of its node and step, if one is the node's best.  0, or -1 when
 * it was not. */
static int remember_shard(s3_hub *h, const s3_object *o, const delta_path *dp)
{
    if (h->nshards == h->shards_cap) {
        size_t cap = h->shards_cap ? 2 * h->shards_cap : 64;
        if (h->shards_cap == MAX_SHARDS_PER_LISTING)
            return -1;
        if (cap > MAX_SHARDS_PER_LISTING)
            cap = MAX_SHARDS_PER_LISTING;
        shard_entry *ns = realloc(h->shards, cap * sizeof(*ns));
        if (ns == NULL)
            return -1;
        h->shards = ns;
        h->shards_cap = cap;
    }
    shard_entry *e = &h->shards[h->nshards];
    memset(e, 0, sizeof(*e));
    if ((e->obj.key = strdup(o->key)) == NULL)
        return -1;
    snprintf(e->node, sizeof(e->node), "%s", dp->node_id);
    e->local_step = dp->local_step;
    e->obj.size = o->size;
    snprintf(e->obj.etag, sizeof(e->obj.etag), "%s", o->etag);
    h->nshards++;
    return 0;
}

/* Keeps obj if it is the highest local step of its node seen in this listing (a file or an index;
 * shards are kept aside for their index). */
static void consider_object(s3_hub *h, const s3_object *o, const char *rel)
{
    const char *node;
    uint64_t local_step;
    delta_path dp;
    size_t i;

    if (h->list_full || delta_parse_any_path(rel, &dp, NULL) != 0)
        return;                 /* not a delta's name: nothing of ours (temporary names, other files) */
    if (enter_node(h, o->key, dp.node_id) != 0)
        return;
    if (dp.kind == DELTA_PATH_SHARD) {
        if (h->cur_node_shards < MAX_SHARDS_PER_NODE && remember_shard(h, o, &dp) == 0)
            h->cur_node_shards++;
        return;
    }
    node = dp.node_id;
    local_step = dp.local_step;
    for (i = 0; i < h->nbest; i++)
        if (strcmp(h->best[i].node, node) == 0)
            break;
    if (i == h->nbest) {
        if (h->nbest == MAX_NODES_PER_LISTING)
            return;
        best_entry *nb = realloc(h->best, (h->nbest + 1) * sizeof(*nb));
        if (nb == NULL)
            return;
        h->best = nb;
        memset(&h->best[i], 0, sizeof(h->best[i]));
        snprintf(h->best[i].node, sizeof(h->best[i].node), "%s", node);
        h->nbest++;
    } else if (local_step <= h->best[i].local_step) {
        return;
    }
    char *k = strdup(o->key);
    if (k == NULL)
        return;
    free(h->best[i].key);
    h->best[i].key = k;
    h->best[i].local_step = local_step;
    h->best[i].is_index = dp.kind == DELTA_PATH_INDEX;
    h->best[i].size = o->size;
    snprintf(h->best[i].etag, sizeof(h->best[i].etag), "%s", o->etag);
}

static void listed_free(s3_object *l, size_t n)
{
    for (size_t i = 0; i < n; i++)
        free(l[i].key);
    free(l);
}

/* The shards listed next to an index (same node and step) and the set's version.  0 or -1. */
static int set_listed(s3_hub *h, const best_entry *b, s3_object **out, size_t *n, char *ver, size_t ver_size)
{
    s3_object *l = NULL;
    size_t k = 0;

    for (size_t i = 0; i < h->nshards; i++) {
        const shard_entry *e = &h->shards[i];
        if (e->local_step != b->local_step || strcmp(e->node, b->node) != 0)
            continue;
        s3_object *nl = realloc(l, (k + 1) * sizeof(*nl));
        if (nl == NULL || (nl[k].key = strdup(e->obj.key)) == NULL) {
            listed_free(nl ? nl : l, k);
            return -1;
        }
        l = nl;
        nl[k].size = e->obj.size;
        memcpy(nl[k].etag, e->obj.etag, sizeof(nl[k].etag));
        k++;
    }
    if (set_version(b->etag, l, k, ver, ver_size) != 0) {
        listed_free(l, k);
        return -1;
    }
    *out = l;
    *n = k;
    return 0;
}

/* After the last page: each node's newest delta, unless it was handled already. */
static void listing_complete(s3_hub *h)
{
    size_t plen = h->prefix[0] ? strlen(h->prefix) + 1 : 0;
    for (size_t i = 0; i < h->nbest; i++) {
        best_entry *b = &h->best[i];
        const char *rel = b->key + plen;
        s3_object *listed = NULL;
        size_t nlisted = 0;
        char ver[80];
        snprintf(ver, sizeof(ver), "%s", b->etag);
        if (b->is_index && set_listed(h, b, &listed, &nlisted, ver, sizeof(ver)) != 0)
            continue;
        char *k = remote_seen_key(rel, ver);
        int created = 0;
        seen_entry *e = k ? seen_get(&h->seen.map, k, &created) : NULL;
        free(k);
        /* new, or a later round's delta that is looked at again; pending, done or given up: not */
        if (e == NULL || (!created && e->state != SEEN_INCOMPLETE)) {
            listed_free(listed, nlisted);
            continue;
        }
        e->state = SEEN_PENDING;
        candidate *c = candidate_new(h, rel, b->key, b->etag, b->size);
        if (c == NULL) {
            listed_free(listed, nlisted);
            remote_seen_set(&h->seen, rel, ver, SEEN_REJECTED);
            continue;
        }
        snprintf(c->ver, sizeof(c->ver), "%s", ver);
        c->is_set = b->is_index;
        c->listed = listed;
        c->nlisted = nlisted;
        enqueue(h, c);
    }
    best_reset(h);
    poll_finish(h);
}

static void list_page(s3_hub *h, const char *token);

/* 1 when this poll met token before (a server that loops its continuation token), else remembers it.
 * At most MAX_LIST_PAGES tokens a poll; a missing token counts as repeated (no way to go on). */
static int token_repeated(s3_hub *h, const char *token)
{
    uint64_t x = 1469598103934665603ull;
    if (token == NULL || !*token)
        return 1;
    for (const unsigned char *c = (const unsigned char *)token; *c; c++)
        x = (x ^ *c) * 1099511628211ull;        /* FNV-1a */
    for (unsigned i = 0; h->list_tokens && i < h->list_pages; i++)
        if (h->list_tokens[i] == x)
            return 1;
    if (h->list_tokens == NULL && (h->list_tokens = calloc(MAX_LIST_PAGES, sizeof(*h->list_tokens))) == NULL)
        return 1;
    h->list_tokens[h->list_pages] = x;
    return 0;
}

static void list_done(s3_hub *h, s3_req *r, int ok)
{
    s3_listing l;
    dl_error err = {0};
    char why[256];
    size_t plen = h->prefix[0] ? strlen(h->prefix) + 1 : 0;

    if (!ok || h->closing) {
        if (!h->closing && r->x) {
            describe_answer(r->x, why, sizeof(why));
            set_error(h, "listing s3://%s/%s: %s", h->bucket, r->what, why);
        }
        remote_req_end(r);
        best_reset(h);
        if (!h->closing)
            poll_finish(h);
        return;
    }
    if (s3_parse_listing(r->x->body.p, r->x->body.len, &l, &err) != 0) {
        set_error(h, "listing s3://%s/%s: %s", h->bucket, r->what, err.message);
        remote_req_end(r);
        best_reset(h);
        poll_finish(h);
        return;
    }
    size_t r_len = r->x->body.len;
    remote_req_end(r);
    for (size_t i = 0; i < l.n; i++) {
        /* the server answers for the prefix we asked; anything else is not ours to read */
        if (strncmp(l.objs[i].key, h->prefix, plen ? plen - 1 : 0) != 0 || (plen && l.objs[i].key[plen - 1] != '/'))
            continue;
        consider_object(h, &l.objs[i], l.objs[i].key + plen);
    }
    h->list_bytes += r_len;
    const char *stop = NULL;
    if (l.truncated && h->list_pages + 1 >= MAX_LIST_PAGES)
        stop = "more than 1000 pages";
    else if (l.truncated && h->list_bytes >= MAX_LIST_BYTES_PER_POLL)
        stop = "more than 64 MiB of listing";
    else if (l.truncated && token_repeated(h, l.next_token))
        stop = "the server repeated a continuation token";
    if (h->list_full) {
        /* a table filled at a node boundary: the next poll starts there */
        listing_complete(h);
    } else if (l.truncated && stop == NULL) {
        h->list_pages++;
        list_page(h, l.next_token);
    } else {
        if (stop != NULL) {
            set_error(h, "listing s3://%s/%s/nodes/: %s, the poll ends there", h->bucket, h->prefix, stop);
            stop_before_node(h);        /* the next poll goes on from the node it stopped in */
        } else {
            free(h->resume_after);      /* the whole listing was read: the next poll starts at the top */
            h->resume_after = NULL;
        }
        listing_complete(h);
    }
    s3_listing_free(&l);
}

static void list_page(s3_hub *h, const char *token)
{
    char *prefix = full_key(h, "nodes/");
    char *query = prefix ? s3_list_query(prefix, token, token == NULL ? h->resume_after : NULL, S3_MAX_KEYS_PER_PAGE) : NULL;
    s3_req *r = query ? req_new(h, "GET", NULL, query, "list") : NULL;

    if (r != NULL) {
        free(r->what);
        r->what = prefix;
        prefix = NULL;
    }
    free(prefix);
    free(query);
    if (r == NULL) {
        best_reset(h);
        poll_finish(h);
        return;
    }
    req_go(h, r, list_done, NULL);
}

/* ---- adoption: the bucket's global ------------------------------------------------------------- */

/* A sharded global: the index and the shards listed next to it become one set candidate. */
static void adopt_set(s3_hub *h, const s3_listing *l, const char *dir, uint64_t step)
{
    size_t dlen = strlen(dir);
    const s3_object *index = NULL;
    s3_object *listed = NULL;
    size_t n = 0;
    char base[ST_INDEX_BASE_MAX + 1], ver[80];

    for (size_t i = 0; i < l->n; i++) {
        const char *key = l->objs[i].key, *name = key + dlen;
        uint32_t si, sn;
        if (strncmp(key, dir, dlen) != 0 || strchr(name, '/') != NULL)
            continue;
        st_name_kind k = st_index_classify(name, strlen(name), base, &si, &sn);
        if (strcmp(base, "latest") != 0)
            continue;
        if (k == ST_NAME_INDEX) {
            index = &l->objs[i];
        } else if (k == ST_NAME_SHARD) {
            s3_object *nl = realloc(listed, (n + 1) * sizeof(*nl));
            if (nl == NULL || (nl[n].key = strdup(key)) == NULL) {
                listed_free(nl ? nl : listed, n);
                return;
            }
            listed = nl;
            nl[n].size = l->objs[i].size;
            memcpy(nl[n].etag, l->objs[i].etag, sizeof(nl[n].etag));
            n++;
        }
    }
    candidate *c = index ? candidate_new(h, "global/latest" ST_INDEX_SUFFIX, index->key, index->etag, index->size)
                         : NULL;
    if (c == NULL || set_version(index->etag, listed, n, ver, sizeof(ver)) != 0) {
        listed_free(listed, n);
        candidate_free(c);
        return;
    }
    snprintf(c->ver, sizeof(c->ver), "%s", ver);
    c->is_global = 1;
    c->is_set = 1;
    c->step = step;
    c->listed = listed;
    c->nlisted = n;
    enqueue_global(h, c);
}

static void global_list_done(s3_hub *h, s3_req *r, int ok)
{
    s3_listing l;
    dl_error err = {0};
    char *want = full_key(h, "global/latest.safetensors");
    uint64_t step = (uint64_t)(uintptr_t)r->arg;

    if (!ok || h->closing || want == NULL || s3_parse_listing(r->x->body.p, r->x->body.len, &l, &err) != 0) {
        if (!h->closing && ok)
            set_error(h, "listing the global: %s", err.message[0] ? err.message : "out of memory");
        remote_req_end(r);
        free(want);
        h->global_download = 0;
        if (!h->closing)
            poll_finish(h);
        return;
    }
    remote_req_end(r);
    if (h->adopt_sharded) {
        want[strlen(want) - strlen("latest.safetensors")] = '\0';
        adopt_set(h, &l, want, step);
    }
    for (size_t i = 0; !h->adopt_sharded && i < l.n; i++) {
        if (strcmp(l.objs[i].key, want) != 0)
            continue;
        candidate *c = candidate_new(h, "global/latest.safetensors", want, l.objs[i].etag, l.objs[i].size);
        if (c != NULL) {
            c->is_global = 1;
            c->step = step;
            enqueue_global(h, c);
        }
        break;
    }
    s3_listing_free(&l);
    free(want);
    h->global_download = 0;
    for (candidate *c = h->queue; c; c = c->next)
        h->global_download |= c->is_global;
    poll_finish(h);
}

/* The plain global is listed alone; a sharded one with everything under global/latest. */
static void adopt_global(s3_hub *h, uint64_t step, int sharded)
{
    char *key = full_key(h, sharded ? "global/latest" : "global/latest.safetensors");
    char *query = key ? s3_list_query(key, NULL, NULL, sharded ? S3_MAX_KEYS_PER_PAGE : 1) : NULL;
    s3_req *r = query ? req_new(h, "GET", NULL, query, "list") : NULL;

    free(key);
    free(query);
    if (r == NULL) {
        poll_finish(h);
        return;
    }
    h->global_download = 1;
    h->adopt_sharded = sharded;
    req_go(h, r, global_list_done, (void *)(uintptr_t)step);
}

/* ---- the step file ----------------------------------------------------------------------------- */

static void claim_step_seen(s3_hub *h, int64_t step);

static void report_step(s3_hub *h, int64_t step)
{
    claim_step_seen(h, step);
    if (step == h->published_known)
        return;
    h->published_known = step;
    h->cb.published_seen(h->app, step);
}

static void stepfile_done(s3_hub *h, s3_req *r, int ok)
{
    long status = r->x ? r->x->status : 0;
    uint64_t step = 0;
    int bootstrap = 0, have = 0, sharded = 0;
    dl_error err = {0};
    char why[256];

    if (h->closing) {
        remote_req_end(r);
        return;
    }
    if (ok && stepcount_parse(r->x->body.p, r->x->body.len, &step, &bootstrap, &sharded, &err) == 0) {
        have = 1;
    } else if (status == 404) {
        report_step(h, -1);
    } else {
        if (ok)
            set_error(h, "%s: %s", r->what, err.message);
        else if (r->x) {
            describe_answer(r->x, why, sizeof(why));
            set_error(h, "GET %s: %s", r->what, why);
        }
        remote_req_end(r);
        poll_finish(h);
        return;
    }
    remote_req_end(r);
    if (have)
        report_step(h, (int64_t)step);
    if (h->waiting) {
        if (have && !h->global_download)
            adopt_global(h, step, sharded);
        else
            poll_finish(h);
        return;
    }
    list_page(h, NULL);
}

static void fetch_stepfile(s3_hub *h)
{
    char *key = full_key(h, "global/step_count.json");
    s3_req *r = key ? req_new(h, "GET", key, NULL, "step_count") : NULL;

    free(key);
    if (r == NULL) {
        poll_finish(h);
        return;
    }
    r->body_cap = STEPFILE_CAP;
    r->max_attempts = 3;
    req_go(h, r, stepfile_done, NULL);
}

static void poll_cb(uv_timer_t *t)
{
    s3_hub *h = t->data;
    if (h->polling || h->closing)
        return;
    h->polling = 1;
    fetch_stepfile(h);
}

/* ---- publishing -------------------------------------------------------------------------------- */

static const char *pub_rel(const s3_hub *h)
{
    return h->pub.files[h->pub.cur].rel;
}

static void pub_finish(s3_hub *h, const char *error)
{
    pub_state *p = &h->pub;
    uint64_t step = p->step;

    if (h->claim_timer.data != NULL)
        uv_timer_stop(&h->claim_timer);
    for (unsigned i = 0; p->files && i < p->nfiles; i++)
        if (p->files[i].fd >= 0)
            close(p->files[i].fd);
    free(p->files);
    free(p->stepfile);
    free(p->upload_id);
    for (unsigned i = 0; p->etags && i < p->nparts; i++)
        free(p->etags[i]);
    free(p->etags);
    memset(p, 0, sizeof(*p));
    p->fd = -1;
    h->st.publishing = 0;
    if (error == NULL) {
        h->st.last_publish = time(NULL);
        h->published_known = (int64_t)step;
        dl_log(DL_LOG_INFO, "hub", "published", "step=%" PRIu64 " bucket=%s", step, h->bucket);
    }
    if (!h->closing)
        h->cb.publish_done(h->app, step, error);
}

/* The request failed: why, in the status and for publish_done. */
static void pub_fail(s3_hub *h, s3_req *r, const char *doing)
{
    char why[256] = "out of memory";
    if (r != NULL && r->x != NULL)
        describe_answer(r->x, why, sizeof(why));
    if (!h->closing)
        set_error(h, "publishing step %" PRIu64 ": %s: %s", h->pub.step, doing, why);
    if (r != NULL)
        remote_req_end(r);
    pub_finish(h, h->st.last_error);
}

/* A file of the other layout, left by an earlier publish: for a sharded publish the plain file and
 * shards of another count, for a plain one the index and every shard. */
static int pub_other_layout(const s3_hub *h, const char *name)
{
    /* the index is the last of files[]; its shard count is files[] minus it */
    return hub_set_other_layout(name, h->pub.sharded, (uint32_t)(h->pub.nfiles - 1));
}

static void delete_done(s3_hub *h, s3_req *r, int ok)
{
    if (!ok && !h->closing && r->x != NULL) {
        char why[256];
        describe_answer(r->x, why, sizeof(why));
        dl_log(DL_LOG_WARN, "hub", "cannot remove a global file of the other layout", "key=%s reason=%s", r->what,
               why);
    }
    remote_req_end(r);
}

/* After step_count.json: the other layout's objects go (a reader that follows step_count.json
 * never needs them).  A failure leaves them behind, logged: the publish itself is done. */
static void pub_cleanup_done(s3_hub *h, s3_req *r, int ok)
{
    s3_listing l;
    dl_error err = {0};
    char *dir = full_key(h, "global/");
    size_t dlen = dir ? strlen(dir) : 0;

    if (!h->closing && ok && dir != NULL && s3_parse_listing(r->x->body.p, r->x->body.len, &l, &err) == 0) {
        for (size_t i = 0; i < l.n; i++) {
            const char *key = l.objs[i].key;
            if (strncmp(key, dir, dlen) != 0 || strchr(key + dlen, '/') != NULL || !pub_other_layout(h, key + dlen))
                continue;
            s3_req *d = req_new(h, "DELETE", key, NULL, "delete_global");
            if (d != NULL) {
                d->max_attempts = 3;
                req_go(h, d, delete_done, NULL);
            }
        }
        s3_listing_free(&l);
    } else if (!h->closing) {
        dl_log(DL_LOG_WARN, "hub", "cannot list the global files of the other layout", "reason=%s",
               err.message[0] ? err.message : "the listing failed");
    }
    free(dir);
    remote_req_end(r);
    pub_finish(h, NULL);
}

static void pub_cleanup(s3_hub *h)
{
    char *prefix = full_key(h, "global/latest");
    char *query = prefix ? s3_list_query(prefix, NULL, NULL, S3_MAX_KEYS_PER_PAGE) : NULL;
    s3_req *r = query ? req_new(h, "GET", NULL, query, "list") : NULL;

    free(prefix);
    free(query);
    if (r == NULL) {
        pub_finish(h, NULL);
        return;
    }
    r->max_attempts = 3;
    req_go(h, r, pub_cleanup_done, NULL);
}

static void pub_stepfile_done(s3_hub *h, s3_req *r, int ok)
{
    if (!ok || h->closing) {
        pub_fail(h, r, "PUT global/step_count.json");
        return;
    }
    remote_req_end(r);
    pub_cleanup(h);
}

/* Last: a reader never sees a step whose model is not there. */
static void pub_stepfile(s3_hub *h)
{
    if (h->pub.claim_lost) {
        /* the step file is the publish's commit point: not written once another holds the claim */
        set_error(h, "publishing step %" PRIu64 ": our claim was taken over (renew it within --s3-claim-lease)",
                  h->pub.step);
        pub_finish(h, h->st.last_error);
        return;
    }
    char *key = full_key(h, "global/step_count.json");
    s3_req *r = key ? req_new(h, "PUT", key, NULL, "put_step_count") : NULL;

    free(key);
    if (r == NULL || remote_req_body(r, h->pub.stepfile, strlen(h->pub.stepfile)) != 0) {
        if (r)
            remote_req_end(r);
        pub_fail(h, NULL, "PUT global/step_count.json");
        return;
    }
    remote_req_header(r, "Content-Type: application/json");
    req_go(h, r, pub_stepfile_done, NULL);
}

static void pub_upload(s3_hub *h);

/* The current file is up: the next one, or the step file after the last. */
static void pub_next_file(s3_hub *h)
{
    pub_state *p = &h->pub;

    free(p->upload_id);
    p->upload_id = NULL;
    for (unsigned i = 0; p->etags && i < p->nparts; i++)
        free(p->etags[i]);
    free(p->etags);
    p->etags = NULL;
    p->nparts = p->next_part = 0;
    if (++p->cur == p->nfiles) {
        pub_stepfile(h);
        return;
    }
    p->fd = p->files[p->cur].fd;
    p->size = p->files[p->cur].size;
    pub_upload(h);
}

static void pub_single_done(s3_hub *h, s3_req *r, int ok)
{
    char doing[ST_INDEX_BASE_MAX + 160];

    if (!ok || h->closing) {
        snprintf(doing, sizeof(doing), "PUT %s", pub_rel(h));
        pub_fail(h, r, doing);
        return;
    }
    remote_req_end(r);
    pub_next_file(h);
}

/* uploadId=<id> (+ partNumber first when given: SigV4 sorts by name).  malloc'd. */
static char *upload_query(const char *upload_id, unsigned part)
{
    sbuf b = {0};
    if (part > 0) {
        sb_str(&b, "partNumber=");
        sb_u64(&b, part);
        sb_str(&b, "&");
    }
    sb_str(&b, "uploadId=");
    s3_uri_encode(&b, upload_id, 0);
    return sb_take(&b);
}

static void abort_done(s3_hub *h, s3_req *r, int ok)
{
    (void)h;
    (void)ok;
    remote_req_end(r);
}

/* A failed multipart upload is aborted (its parts would be stored, and billed, until then). */
static void pub_abort_upload(s3_hub *h)
{
    char *key = full_key(h, pub_rel(h));
    char *q = key && h->pub.upload_id ? upload_query(h->pub.upload_id, 0) : NULL;
    s3_req *r = q ? req_new(h, "DELETE", key, q, "abort_upload") : NULL;
    free(key);
    free(q);
    if (r != NULL && !h->closing) {
        r->max_attempts = 2;
        req_go(h, r, abort_done, NULL);
    } else if (r != NULL) {
        remote_req_end(r);
    }
}

static void pub_complete_done(s3_hub *h, s3_req *r, int ok)
{
    char code[64], msg[160], doing[ST_INDEX_BASE_MAX + 160];

    /* CompleteMultipartUpload can fail after a 200: the error is then in the body */
    if (ok && !h->closing && s3_parse_error(r->x->body.p, r->x->body.len, code, sizeof(code), msg, sizeof(msg)))
        ok = 0;
    if (!ok || h->closing) {
        pub_abort_upload(h);
        snprintf(doing, sizeof(doing), "completing the multipart upload of %s", pub_rel(h));
        pub_fail(h, r, doing);
        return;
    }
    remote_req_end(r);
    pub_next_file(h);
}

static void pub_complete(s3_hub *h)
{
    pub_state *p = &h->pub;
    sbuf b = {0};
    char *key = full_key(h, pub_rel(h));
    char *q = upload_query(p->upload_id, 0);
    s3_req *r = key && q ? req_new(h, "POST", key, q, "complete_upload") : NULL;

    sb_str(&b, "<CompleteMultipartUpload xmlns=\"http://s3.amazonaws.com/doc/2006-03-01/\">");
    for (unsigned i = 0; i < p->nparts; i++) {
        sb_str(&b, "<Part><PartNumber>");
        sb_u64(&b, i + 1);
        sb_str(&b, "</PartNumber><ETag>\"");
        sb_str(&b, p->etags[i]);   /* pub_part_done refused '<', '>' and '&' */
        sb_str(&b, "\"</ETag></Part>");
    }
    sb_str(&b, "</CompleteMultipartUpload>");
    char *xml = sb_take(&b);
    free(key);
    free(q);
    if (r == NULL || xml == NULL || remote_req_body(r, xml, strlen(xml)) != 0) {
        free(xml);
        if (r)
            remote_req_end(r);
        pub_abort_upload(h);
        pub_fail(h, NULL, "completing the multipart upload");
        return;
    }
    free(xml);
    remote_req_header(r, "Content-Type: application/xml");
    req_go(h, r, pub_complete_done, NULL);
}

static void pub_next_part(s3_hub *h);

static void pub_part_done(s3_hub *h, s3_req *r, int ok)
{
    pub_state *p = &h->pub;
    char etag[80];

    if (!ok || h->closing || s3_clean_etag(r->x->etag, strlen(r->x->etag), etag, sizeof(etag)) != 0 ||
        strpbrk(etag, "<>&") != NULL || (p->etags[p->next_part] = strdup(etag)) == NULL) {
        char doing[ST_INDEX_BASE_MAX + 160];
        if (ok && !h->closing)
            set_error(h, "publishing step %" PRIu64 ": part %u: no usable ETag in the answer", p->step,
                      p->next_part + 1);
        snprintf(doing, sizeof(doing), "PUT part %u of %s", p->next_part + 1, pub_rel(h));
        pub_abort_upload(h);
        pub_fail(h, r, doing);
        return;
    }
    remote_req_end(r);
    p->next_part++;
    pub_next_part(h);
}

static void pub_next_part(s3_hub *h)
{
    pub_state *p = &h->pub;
    if (p->next_part == p->nparts) {
        pub_complete(h);
        return;
    }
    uint64_t off = (uint64_t)p->next_part * p->part_size;
    uint64_t len = p->size - off < p->part_size ? p->size - off : p->part_size;
    char *key = full_key(h, pub_rel(h));
    char *q = upload_query(p->upload_id, p->next_part + 1);
    s3_req *r = key && q ? req_new(h, "PUT", key, q, "upload_part") : NULL;
    free(key);
    free(q);
    if (r == NULL) {
        pub_abort_upload(h);
        pub_fail(h, NULL, "uploading a part");
        return;
    }
    r->src_fd = p->fd;
    r->src_off = off;
    r->src_len = len;
    req_go(h, r, pub_part_done, NULL);
}

static void pub_initiate_done(s3_hub *h, s3_req *r, int ok)
{
    pub_state *p = &h->pub;
    dl_error err = {0};
    char doing[ST_INDEX_BASE_MAX + 160];

    if (!ok || h->closing) {
        snprintf(doing, sizeof(doing), "starting the multipart upload of %s", pub_rel(h));
        pub_fail(h, r, doing);
        return;
    }
    if (s3_parse_upload_id(r->x->body.p, r->x->body.len, &p->upload_id, &err) != 0) {
        set_error(h, "publishing step %" PRIu64 ": %s", p->step, err.message);
        remote_req_end(r);
        pub_finish(h, h->st.last_error);
        return;
    }
    remote_req_end(r);
    if ((p->etags = calloc(p->nparts, sizeof(*p->etags))) == NULL) {
        pub_abort_upload(h);
        pub_fail(h, NULL, "multipart upload");
        return;
    }
    pub_next_part(h);
}

/* The current file: one PUT up to the part size, a multipart upload above it. */
static void pub_upload(s3_hub *h)
{
    pub_state *p = &h->pub;
    char *key = full_key(h, pub_rel(h));
    char doing[ST_INDEX_BASE_MAX + 160];
    s3_req *r;

    snprintf(doing, sizeof(doing), "PUT %s", pub_rel(h));
    if (key == NULL) {
        pub_fail(h, NULL, doing);
        return;
    }
    if (p->size <= h->part_size) {
        r = req_new(h, "PUT", key, NULL, "put_global");
        free(key);
        if (r == NULL) {
            pub_fail(h, NULL, doing);
            return;
        }
        r->src_fd = p->fd;
        r->src_off = 0;
        r->src_len = p->size;
        remote_req_header(r, p->sharded && p->cur == p->nfiles - 1 ? "Content-Type: application/json"
                                                             : "Content-Type: application/octet-stream");
        req_go(h, r, pub_single_done, NULL);
        return;
    }
    /* parts of part_size; S3 takes at most 10,000, so a larger file gets larger parts */
    p->part_size = h->part_size;
    if ((p->size + p->part_size - 1) / p->part_size > S3_MAX_PARTS)
        p->part_size = ((p->size + S3_MAX_PARTS - 1) / S3_MAX_PARTS + (1u << 20) - 1) & ~(uint64_t)((1u << 20) - 1);
    p->nparts = (unsigned)((p->size + p->part_size - 1) / p->part_size);
    r = req_new(h, "POST", key, "uploads=", "create_upload");
    free(key);
    if (r == NULL) {
        pub_fail(h, NULL, "starting the multipart upload");
        return;
    }
    remote_req_header(r, "Content-Type: application/octet-stream");
    req_go(h, r, pub_initiate_done, NULL);
}

static void pub_uploads_done(s3_hub *h, s3_req *r, int ok)
{
    pub_state *p = &h->pub;
    dl_error err = {0};

    if (h->closing) {
        pub_fail(h, r, "listing interrupted uploads");
        return;
    }
    /* a failure here only leaves parts behind: the publish goes on */
    if (!ok) {
        char why[256] = "";
        if (r->x != NULL)
            describe_answer(r->x, why, sizeof(why));
        dl_log(DL_LOG_WARN, "hub", "cannot list interrupted multipart uploads", "reason=%s", why);
    }
    for (unsigned f = 0; ok && f < p->nfiles; f++) {
        char *key = full_key(h, p->files[f].rel);
        char **ids = NULL;
        size_t n = 0;
        if (key == NULL || s3_parse_uploads(r->x->body.p, r->x->body.len, key, &ids, &n, &err) != 0) {
            dl_log(DL_LOG_WARN, "hub", "cannot list interrupted multipart uploads", "reason=%s",
                   err.message[0] ? err.message : "out of memory");
            free(key);
            break;
        }
        for (size_t i = 0; i < n; i++) {
            char *q = upload_query(ids[i], 0);
            s3_req *a = q ? req_new(h, "DELETE", key, q, "abort_upload") : NULL;
            free(q);
            if (a != NULL) {
                dl_log(DL_LOG_INFO, "hub", "aborting an interrupted multipart upload", "key=%s", key);
                a->max_attempts = 2;
                req_go(h, a, abort_done, NULL);
            }
        }
        s3_uploads_free(ids, n);
        free(key);
    }
    remote_req_end(r);
    pub_upload(h);
}

/* ListMultipartUploads of the global's keys: prefix=<prefix>/global/latest&uploads= (sorted,
 * canonical); the answer is matched against each file's exact key. */
static void pub_clean_uploads(s3_hub *h)
{
    char *key = full_key(h, "global/latest");
    sbuf q = {0};
    sb_str(&q, "prefix=");
    if (key != NULL)
        s3_uri_encode(&q, key, 0);
    sb_str(&q, "&uploads=");
    char *query = sb_take(&q);
    s3_req *r = key && query ? req_new(h, "GET", NULL, query, "list_uploads") : NULL;
    free(key);
    free(query);
    if (r == NULL) {
        pub_upload(h);
        return;
    }
    req_go(h, r, pub_uploads_done, NULL);
}

/* ---- the step's claim, with a lease ----------------------------------------------------------------
 * PUT global/steps/<step>.claim If-None-Match: * (of two aggregators exactly one writes it).  A claim
 * that exists is ours (our instance id: a restart mid-publish, or our own PUT whose answer was lost and
 * whose retry met it: the read-back equals what we wrote) or another's.  Another's is honoured only
 * for --s3-claim-lease seconds after its last write, timed by the server: its Last-Modified against the
 * Date of the same answer (no local clock, so no skew), or, when either is missing or lies, by how long
 * the same version has been seen unchanged here.  While it is live we wait (one GET when its lease
 * should be over, never a PUT per poll); a step the bucket reaches meanwhile ends the wait (lost); an
 * expired claim is taken over with If-Match on its ETag.  Our own claim is renewed (If-Match) every
 * half lease while the publish runs; a renewal lost to a taker stops the publish before its step file.
 * The claim's content is never trusted for timing; claims of other steps are never read. */

static void pub_claim(s3_hub *h);
static void pub_claim_read(s3_hub *h);
static void pub_claim_put(s3_hub *h, const char *cond, s3_req_cb cb);

static char *claim_key(const s3_hub *h, uint64_t step)
{
    char rel[64];
    snprintf(rel, sizeof(rel), "global/steps/%" PRIu64 ".claim", step);
    return full_key(h, rel);
}

static void claim_build(s3_hub *h)
{
    pub_state *p = &h->pub;
    int n = snprintf(p->claim_body, sizeof(p->claim_body),
                     "{\"outer_step\": %" PRIu64 ", \"instance\": \"%s\", \"renewal\": %u}\n", p->step, h->instance,
                     p->renewal);
    p->claim_len = n > 0 && (size_t)n < sizeof(p->claim_body) ? (size_t)n : 0;
}

static void claim_timer_start(s3_hub *h, double seconds, uv_timer_cb cb)
{
    if (seconds < 0.1)
        seconds = 0.1;
    uv_timer_stop(&h->claim_timer);
    uv_timer_start(&h->claim_timer, cb, (uint64_t)(seconds * 1000), 0);
}

static void claim_renew_cb(uv_timer_t *t);
static void claim_renew_check(s3_hub *h);

/* We hold the claim (its ETag from the answer): renew it while the publish lasts. */
static void claim_held(s3_hub *h, const cuv_xfer *x)
{
    pub_state *p = &h->pub;
    snprintf(p->claim_etag, sizeof(p->claim_etag), "%s", x ? x->etag : "");
    p->claim_held = 1;
    p->claim_waiting = 0;
    claim_timer_start(h, h->claim_lease / 2, claim_renew_cb);
}

static void claim_renew_check_done(s3_hub *h, s3_req *r, int ok)
{
    pub_state *p = &h->pub;
    unsigned gen = (unsigned)(uintptr_t)r->arg;

    if (h->closing || !p->active || gen != p->gen) {
        remote_req_end(r);
        return;
    }
    if (ok && r->x->body.len == p->claim_len && memcmp(r->x->body.p, p->claim_body, p->claim_len) == 0) {
        claim_held(h, r->x);    /* our renewal went through on an earlier attempt */
    } else if (ok || r->x == NULL || r->x->status == 404) {
        /* another's now: the publish ends before its step file (pub_stepfile) */
        dl_log(DL_LOG_ERROR, "hub", "our claim was taken over while publishing", "step=%" PRIu64, p->step);
        p->claim_lost = 1;
    } else {
        claim_timer_start(h, h->claim_lease / 8, claim_renew_cb);
    }
    remote_req_end(r);
}

static void claim_renew_check(s3_hub *h)
{
    char *key = claim_key(h, h->pub.step);
    s3_req *r = key ? req_new(h, "GET", key, NULL, "read_claim") : NULL;
    free(key);
    if (r == NULL) {
        claim_timer_start(h, h->claim_lease / 8, claim_renew_cb);
        return;
    }
    r->body_cap = CLAIM_CAP;
    req_go(h, r, claim_renew_check_done, (void *)(uintptr_t)h->pub.gen);
}

static void claim_renew_done(s3_hub *h, s3_req *r, int ok)
{
    pub_state *p = &h->pub;
    unsigned gen = (unsigned)(uintptr_t)r->arg;

    if (h->closing || !p->active || gen != p->gen) {
        remote_req_end(r);
        return;
    }
    if (ok) {
        claim_held(h, r->x);
    } else if (r->x != NULL && r->x->status == 412) {
        /* taken over (we were too late), or our retried renewal had succeeded: read it back */
        remote_req_end(r);
        claim_renew_check(h);
        return;
    } else {
        /* a failed renewal is tried again soon: the lease is not over yet */
        claim_timer_start(h, h->claim_lease / 8, claim_renew_cb);
    }
    remote_req_end(r);
}

static void claim_renew_cb(uv_timer_t *t)
{
    s3_hub *h = t->data;
    pub_state *p = &h->pub;
    if (h->closing || !p->active || !p->claim_held || p->claim_lost)
        return;
    char *key = claim_key(h, p->step);
    s3_req *r = key ? req_new(h, "PUT", key, NULL, "claim_renew") : NULL;
    char cond[200];
    free(key);
    p->renewal++;
    claim_build(h);
    snprintf(cond, sizeof(cond), "If-Match: %s", p->claim_etag);
    if (r == NULL || remote_req_body(r, p->claim_body, p->claim_len) != 0) {
        if (r)
            remote_req_end(r);
        claim_timer_start(h, h->claim_lease / 8, claim_renew_cb);
        return;
    }
    remote_req_header(r, cond);
    remote_req_header(r, "Content-Type: application/json");
    req_go(h, r, claim_renew_done, (void *)(uintptr_t)p->gen);
}

/* The bucket names our step (or a later one): another aggregator published it. */
static void claim_lost_to(s3_hub *h, const char *who)
{
    pub_state *p = &h->pub;
    char msg[256];
    snprintf(msg, sizeof(msg), "step %" PRIu64 " was claimed by another aggregator (instance %.40s): it publishes it",
             p->step, who);
    dl_log(DL_LOG_WARN, "hub", "publish lost to another aggregator", "step=%" PRIu64, p->step);
    snprintf(h->st.last_error, sizeof(h->st.last_error), "%s", msg);
    /* the next poll reports the bucket's step again, even unchanged: the winner's step is adopted */
    h->published_known = -2;
    pub_finish(h, msg);
}

static void claim_wait_cb(uv_timer_t *t)
{
    s3_hub *h = t->data;
    if (h->closing || !h->pub.active || !h->pub.claim_waiting)
        return;
    if (h->pub.claim_gone) {
        h->pub.claim_gone = 0;
        pub_claim(h);           /* it was removed: claim the step afresh */
    } else {
        pub_claim_read(h);
    }
}

/* Seconds since an HTTP date, by the server's own Date (-1: not known). */
static double claim_age(const cuv_xfer *x)
{
    time_t lm = x->last_modified[0] ? curl_getdate(x->last_modified, NULL) : -1;
    time_t now = x->date[0] ? curl_getdate(x->date, NULL) : -1;
    if (lm < 0 || now < 0)
        return -1;
    return now >= lm ? (double)(now - lm) : 0;
}

static void pub_claim_read_done(s3_hub *h, s3_req *r, int ok)
{
    pub_state *p = &h->pub;
    long status = r->x ? r->x->status : 0;

    if (h->closing) {
        pub_fail(h, r, "reading the claim of the step");
        return;
    }
    if (!ok && status == 404) {
        /* gone between our PUT and the read (removed by hand): claim again, not at once */
        remote_req_end(r);
        p->claim_waiting = 1;
        p->claim_gone = 1;
        claim_timer_start(h, 1, claim_wait_cb);
        p->takeovers++;
        if (p->takeovers > 8) {
            pub_fail(h, NULL, "the claim keeps disappearing");
            return;
        }
        return;
    }
    if (!ok) {
        pub_fail(h, r, "reading the claim of the step");
        return;
    }
    const sbuf *b = &r->x->body;
    cJSON *j = cJSON_ParseWithLength(b->p, b->len);
    const cJSON *inst = cJSON_GetObjectItemCaseSensitive(j, "instance");
    char who[48];
    snprintf(who, sizeof(who), "%.40s", cJSON_IsString(inst) ? inst->valuestring : "unknown");
    int ours = (p->claim_len && b->len == p->claim_len && memcmp(b->p, p->claim_body, b->len) == 0) ||
               (cJSON_IsString(inst) && strcmp(inst->valuestring, h->instance) == 0);
    cJSON_Delete(j);
    if (ours) {
        /* ours: a publish that a stop or a crash interrupted, or our own PUT whose answer was lost;
         * the uploads are idempotent, and an interrupted multipart upload (if any) is aborted first */
        dl_log(DL_LOG_INFO, "hub", "resuming our own claimed publish", "step=%" PRIu64, p->step);
        claim_held(h, r->x);
        remote_req_end(r);
        pub_clean_uploads(h);
        return;
    }
    if (h->published_known >= 0 && (uint64_t)h->published_known >= p->step) {
        remote_req_end(r);
        claim_lost_to(h, who);
        return;
    }
    /* a foreign claim: its age by the server, and by how long we have seen this very version */
    char ver[240];
    snprintf(ver, sizeof(ver), "%s|%s", r->x->etag, r->x->last_modified);
    if (strcmp(ver, p->foreign_ver) != 0) {
        snprintf(p->foreign_ver, sizeof(p->foreign_ver), "%s", ver);
        p->foreign_since = uv_now(h->loop);
    }
    double age = claim_age(r->x), seen = (double)(uv_now(h->loop) - p->foreign_since) / 1000;
    if (seen > age)
        age = seen;
    snprintf(p->claim_etag, sizeof(p->claim_etag), "%s", r->x->etag);
    remote_req_end(r);
    if (age >= h->claim_lease && p->claim_etag[0] && p->takeovers < 3) {
        dl_log(DL_LOG_WARN, "hub", "taking over an expired claim", "step=%" PRIu64 " instance=%s age_s=%.0f", p->step,
               who, age);
        char cond[200];
        snprintf(cond, sizeof(cond), "If-Match: %s", p->claim_etag);
        p->takeovers++;
        pub_claim_put(h, cond, NULL);
        return;
    }
    /* live (or a takeover keeps failing): wait until its lease should be over, then look again */
    double wait = age >= h->claim_lease ? h->claim_lease : h->claim_lease - age + 1;
    if (wait > h->claim_lease + 1)
        wait = h->claim_lease + 1;
    p->takeovers = 0;
    p->claim_waiting = 1;
    h->claim_waits++;
    if (!p->warned) {
        dl_log(DL_LOG_WARN, "hub", "step claimed by another aggregator: waiting for its lease",
               "step=%" PRIu64 " instance=%s in_seconds=%.0f", p->step, who, wait);
        p->warned = 1;
    } else {
        dl_log(DL_LOG_DEBUG, "hub", "claim still live", "step=%" PRIu64 " waits=%" PRIu64, p->step, h->claim_waits);
    }
    claim_timer_start(h, wait, claim_wait_cb);
}

static void pub_claim_read(s3_hub *h)
{
    char *key = claim_key(h, h->pub.step);
    s3_req *r = key ? req_new(h, "GET", key, NULL, "read_claim") : NULL;
    free(key);
    if (r == NULL) {
        pub_fail(h, NULL, "reading the claim");
        return;
    }
    r->body_cap = CLAIM_CAP;
    req_go(h, r, pub_claim_read_done, NULL);
}

static void pub_claim_done(s3_hub *h, s3_req *r, int ok)
{
    long status = r->x ? r->x->status : 0;

    if (status == 412 && !h->closing) {
        /* the claim exists (or changed since we read it): whose it is decides, read it back */
        remote_req_end(r);
        pub_claim_read(h);
        return;
    }
    if (!ok || h->closing) {
        pub_fail(h, r, "claiming the step");
        return;
    }
    claim_held(h, r->x);
    remote_req_end(r);
    if (h->pub.takeovers > 0)
        pub_clean_uploads(h);   /* the dead owner's multipart upload, if any */
    else
        pub_upload(h);
}

static void pub_claim_put(s3_hub *h, const char *cond, s3_req_cb cb)
{
    pub_state *p = &h->pub;
    char *key = claim_key(h, p->step);
    s3_req *r = key ? req_new(h, "PUT", key, NULL, "claim") : NULL;

    free(key);
    claim_build(h);
    if (r == NULL || p->claim_len == 0 || remote_req_body(r, p->claim_body, p->claim_len) != 0) {
        if (r)
            remote_req_end(r);
        pub_fail(h, NULL, "claiming the step");
        return;
    }
    remote_req_header(r, cond);
    remote_req_header(r, "Content-Type: application/json");
    req_go(h, r, cb ? cb : pub_claim_done, NULL);
}

/* If-None-Match: * makes the PUT conditional on the key not existing: of two aggregators that
 * claim one step, the server lets exactly one write it. */
static void pub_claim(s3_hub *h)
{
    pub_claim_put(h, "If-None-Match: *", NULL);
}

/* A poll saw the bucket's step: a claim we wait on is over if the bucket reached our step. */
static void claim_step_seen(s3_hub *h, int64_t step)
{
    if (h->pub.active && h->pub.claim_waiting && step >= 0 && (uint64_t)step >= h->pub.step) {
        uv_timer_stop(&h->claim_timer);
        claim_lost_to(h, "of the bucket's step");
    }
}

/* Opens one file of the publish (the descriptor keeps the step's file readable even if a later
 * cleanup unlinks it).  0 or -1 with errno. */
static int pub_open_file(pub_file *f, const char *path, const char *name)
{
    struct stat sb;

    snprintf(f->rel, sizeof(f->rel), "global/%s", name);
    if ((f->fd = open(path, O_RDONLY | O_CLOEXEC)) < 0)
        return -1;
    if (fstat(f->fd, &sb) != 0)
        return -1;
    f->size = (uint64_t)sb.st_size;
    return 0;
}

/* The files of a publish: global_path alone, or the shards its index lists (in the index's
 * directory) and the index last.  0, or -1 with why. */
static int pub_open_files(pub_state *p, const char *global_path, char *why, size_t why_size)
{
    st_index *ix = NULL;
    dl_error err = {0};
    char path[4096], name[ST_INDEX_BASE_MAX + 48];
    int rc = -1;

    p->sharded = st_index_is_index_path(global_path);
    if (!p->sharded) {
        if ((p->files = calloc(1, sizeof(*p->files))) == NULL)
            goto oom;
        p->nfiles = 1;
        p->files[0].fd = -1;
        if (pub_open_file(&p->files[0], global_path, "latest.safetensors") != 0)
            goto sys;
        return 0;
    }
    if (st_index_load(global_path, &ix, &err) != 0) {
        snprintf(why, why_size, "%s: %s", global_path, err.message);
        return -1;
    }
    if (strcmp(ix->base, "latest") != 0) {
        snprintf(why, why_size, "%s: a global's index is latest%s", global_path, ST_INDEX_SUFFIX);
        goto out;
    }
    const char *slash = strrchr(global_path, '/');
    int dlen = slash ? (int)(slash - global_path) : 1;
    const char *dir = slash ? global_path : ".";
    if ((p->files = calloc((size_t)ix->nshards + 1, sizeof(*p->files))) == NULL)
        goto oom;
    p->nfiles = ix->nshards + 1;
    for (unsigned i = 0; i < p->nfiles; i++)
        p->files[i].fd = -1;
    for (uint32_t i = 0; i < ix->nshards; i++) {
        if (st_index_shard_name(ix->base, i, ix->nshards, name, sizeof(name)) != 0 ||
            snprintf(path, sizeof(path), "%.*s/%s", dlen, dir, name) >= (int)sizeof(path))
            goto oom;
        if (pub_open_file(&p->files[i], path, name) != 0)
            goto sys_path;
    }
    if (pub_open_file(&p->files[ix->nshards], global_path, "latest" ST_INDEX_SUFFIX) != 0) {
        snprintf(path, sizeof(path), "%s", global_path);
        goto sys_path;
    }
    rc = 0;
    goto out;
sys:
    snprintf(path, sizeof(path), "%s", global_path);
sys_path:
    snprintf(why, why_size, "cannot read %.400s: %s", path, strerror(errno));
    goto out;
oom:
    snprintf(why, why_size, "out of memory");
out:
    st_index_free(ix);
    return rc;
}

static void s3_publish(hub *base, uint64_t step, const char *global_path, const char *optimizer, int bootstrap)
{
    s3_hub *h = (s3_hub *)base;
    pub_state *p = &h->pub;
    char why[600];

    if (p->active || h->closing)
        return;
    memset(p, 0, sizeof(*p));
    p->fd = -1;
    p->active = 1;
    p->step = step;
    p->gen = ++h->pub_gen;
    p->bootstrap = bootstrap;
    snprintf(p->optimizer, sizeof(p->optimizer), "%s", optimizer);
    h->st.publishing = 1;
    if (pub_open_files(p, global_path, why, sizeof(why)) != 0) {
        set_error(h, "publishing step %" PRIu64 ": %s", step, why);
        pub_finish(h, h->st.last_error);
        return;
    }
    p->stepfile = stepcount_build(step, optimizer, bootstrap, p->sharded, NULL);
    if (p->stepfile == NULL) {
        set_error(h, "publishing step %" PRIu64 ": out of memory", step);
        pub_finish(h, h->st.last_error);
        return;
    }
    p->fd = p->files[0].fd;
    p->size = p->files[0].size;
    pub_claim(h);
}

/* ---- lifecycle --------------------------------------------------------------------------------- */

static int s3_check_url(const char *url, dl_error *err)
{
    char *bucket, *prefix;
    int rc = s3_parse_url(url, &bucket, &prefix, err);
    free(bucket);
    free(prefix);
    return rc;
}

static char *trim(char *s)
{
    while (*s == ' ' || *s == '\t')
        s++;
    size_t n = strlen(s);
    while (n > 0 && (s[n - 1] == ' ' || s[n - 1] == '\t' || s[n - 1] == '\r' || s[n - 1] == '\n'))
        s[--n] = '\0';
    return s;
}

/* The key pair from an AWS credentials file (s3_parse_credentials), read with a cap. */
static int load_credentials_file(s3_hub *h, const char *path, dl_error *err)
{
    char *buf = malloc(CREDENTIALS_FILE_CAP + 1);
    FILE *f = fopen(path, "r");
    size_t len = 0;
    int rc;

    if (f == NULL || buf == NULL) {
        rc = dl_fail(err, DL_E_IO, NULL, 0, "cannot read the S3 credentials file %s: %s", path,
                     f == NULL ? strerror(errno) : "out of memory");
        goto out;
    }
    len = fread(buf, 1, CREDENTIALS_FILE_CAP + 1, f);
    if (ferror(f) || len > CREDENTIALS_FILE_CAP) {
        rc = dl_fail(err, DL_E_INVALID_ARGUMENT, NULL, 0, "the S3 credentials file %s is unreadable or over 64 KiB",
                     path);
        goto out;
    }
    if ((rc = s3_parse_credentials(buf, len, &h->key_id, &h->secret, err)) != 0) {
        char why[sizeof(err->message)];
        snprintf(why, sizeof(why), "%s", err->message);
        dl_fail(err, -rc, NULL, 0, "the S3 credentials file %s: %s", path, why);
    }
out:
    if (f != NULL)
        fclose(f);
    if (buf != NULL)
        memset(buf, 0, len);
    free(buf);
    return rc;
}

/* This state root's id in claims, made once: a restart recognises its own claim. */
static int load_instance(s3_hub *h, dl_error *err)
{
    char *path = NULL, buf[64];
    size_t len = 0;
    int rc = 0;

    if (asprintf(&path, "%s/s3_instance", h->state_dir) < 0)
        return dl_fail(err, DL_E_NO_MEMORY, NULL, 0, "out of memory");
    FILE *f = fopen(path, "r");
    if (f != NULL) {
        len = fread(buf, 1, sizeof(buf) - 1, f);
        fclose(f);
        buf[len] = '\0';
        char *s = trim(buf);
        if (strlen(s) == 32 && strspn(s, "0123456789abcdef") == 32) {
            memcpy(h->instance, s, 33);
            free(path);
            return 0;
        }
    }
    unsigned char r[16];
    if (RAND_bytes(r, sizeof(r)) != 1) {
        free(path);
        return dl_fail(err, DL_E_IO, NULL, 0, "no random bytes for the instance id");
    }
    for (int i = 0; i < 16; i++)
        snprintf(h->instance + 2 * i, 3, "%02x", r[i]);
    char line[34];
    snprintf(line, sizeof(line), "%s\n", h->instance);
    rc = fsu_write_atomic(path, line, 33, err);
    free(path);
    return rc;
}

static void s3_free(s3_hub *h)
{
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
    best_reset(h);
    while (h->sets)
        hub_set_free(&h->sets, h->sets);
    remote_seen_close(&h->seen);
    free(h->endpoint);
    free(h->bucket);
    free(h->prefix);
    free(h->region);
    free(h->key_id);
    if (h->secret)
        memset(h->secret, 0, strlen(h->secret));
    free(h->secret);
    free(h->state_dir);
    free(h->resume_after);
    free(h);
}

/* ---- options (hub.h's hub_options: config.c reads them through this table) ---- */

typedef struct s3_options {
    char *endpoint;             /* hub_endpoint; load: else $AWS_ENDPOINT_URL_S3, $AWS_ENDPOINT_URL; NULL: AWS's own */
    char *region;               /* s3_region; load: else $AWS_REGION, $AWS_DEFAULT_REGION, else us-east-1 */
    char *addressing;           /* s3_addressing: auto | path | virtual */
    unsigned part_mib;          /* s3_part_mib: multipart upload above this, in parts of this size */
    unsigned claim_lease;       /* s3_claim_lease: seconds a publish claim is honoured (by its Last-Modified) */
    char *credentials_file;     /* s3_credentials_file; NULL: $AWS_ACCESS_KEY_ID / $AWS_SECRET_ACCESS_KEY */
} s3_options;

#define S3_OPT(field) offsetof(s3_options, field)
static const hub_option s3_option_table[] = {
    {"hub_endpoint", HUB_OPT_OPTSTR, S3_OPT(endpoint), 0, 0, NULL,
     "s3:// (default $AWS_ENDPOINT_URL_S3, $AWS_ENDPOINT_URL or AWS)", NULL},
    {"s3_region", HUB_OPT_OPTSTR, S3_OPT(region), 0, 0, NULL,
     "REGION     s3:// SigV4 region (default $AWS_REGION, $AWS_DEFAULT_REGION or us-east-1)", NULL},
    {"s3_addressing", HUB_OPT_STR, S3_OPT(addressing), 0, 0, "auto", "MODE   s3:// bucket addressing: auto | path | virtual",
     ""},
    {"s3_part_mib", HUB_OPT_UINT, S3_OPT(part_mib), 5, 5120, "64",
     "MIB      s3:// multipart upload above this size, in parts of this size", NULL},
    {"s3_claim_lease", HUB_OPT_UINT, S3_OPT(claim_lease), 2, 86400, "60",
     "SECONDS s3:// a step's claim by another aggregator is honoured this long after its last write", NULL},
    {"s3_credentials_file", HUB_OPT_OPTSTR, S3_OPT(credentials_file), 0, 0, NULL,
     "FILE  s3:// AWS credentials file (default $AWS_ACCESS_KEY_ID/$AWS_SECRET_ACCESS_KEY)",
     " (s3:// keys from the environment)"},
};

/* $name, else $fallback; NULL when neither is set (or both are empty). */
static const char *getenv_either(const char *name, const char *fallback)
{
    const char *v = getenv(name);
    if (v == NULL || *v == '\0')
        v = getenv(fallback);
    return v != NULL && *v != '\0' ? v : NULL;
}

/* Region, addressing, endpoint and credentials file (its secrets are read by s3_open, never kept here). */
static int s3_load_options(void *opts, const char *url, const char **key, dl_error *err)
{
    s3_options *o = opts;
    const char *env;

    (void)url;
    *key = "s3_region";
    if (o->region == NULL) {
        env = getenv_either("AWS_REGION", "AWS_DEFAULT_REGION");
        if ((o->region = strdup(env ? env : "us-east-1")) == NULL)
            return dl_fail(err, DL_E_NO_MEMORY, NULL, 0, "out of memory");
    }
    size_t n = strlen(o->region);
    if (n == 0 || n > 32 || strspn(o->region, "abcdefghijklmnopqrstuvwxyz0123456789-") != n)
        return dl_fail(err, DL_E_INVALID_ARGUMENT, NULL, 0, "'%s' is not a region ([a-z0-9-]{1,32})", o->region);
    *key = "s3_addressing";
    if (strcmp(o->addressing, "auto") != 0 && strcmp(o->addressing, "path") != 0 &&
        strcmp(o->addressing, "virtual") != 0)
        return dl_fail(err, DL_E_INVALID_ARGUMENT, NULL, 0, "'%s' is not auto, path or virtual", o->addressing);
    *key = "hub_endpoint";
    if (o->endpoint == NULL && (env = getenv_either("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL")) != NULL &&
        (o->endpoint = strdup(env)) == NULL)
        return dl_fail(err, DL_E_NO_MEMORY, NULL, 0, "out of memory");
    if (o->endpoint != NULL && !hub_is_http_url(o->endpoint))
        return dl_fail(err, DL_E_INVALID_ARGUMENT, NULL, 0, "'%s' is not an http(s) URL", o->endpoint);
    *key = "s3_credentials_file";
    return o->credentials_file != NULL ? fsu_check_regular_file(o->credentials_file, err) : 0;
}

static const hub_options s3_options_ops = {
    .opt = s3_option_table,
    .n = sizeof(s3_option_table) / sizeof(s3_option_table[0]),
    .size = sizeof(s3_options),
    .load = s3_load_options,
};

static int s3_open(hub **out, uv_loop_t *loop, const hub_config *cfg, const hub_callbacks *cb, void *app,
                   dl_error *err)
{
    extern const hub_ops hub_s3_ops;
    s3_hub *h;
    int rc;
    char *incoming = NULL, *seen_path = NULL;

    *out = NULL;
    if ((h = calloc(1, sizeof(*h))) == NULL)
        return dl_fail(err, DL_E_NO_MEMORY, NULL, 0, "out of memory");
    h->seen.fd = -1;
    h->pub.fd = -1;
    static const s3_options defaults = {0};
    const s3_options *o = cfg->options != NULL ? cfg->options : &defaults;
    if ((rc = s3_parse_url(cfg->url, &h->bucket, &h->prefix, err)) != 0)
        goto fail;
    h->region = strdup(o->region && o->region[0] ? o->region : "us-east-1");
    if (h->region == NULL)
        goto oom;
    if (o->endpoint != NULL && o->endpoint[0])
        h->endpoint = strdup(o->endpoint);
    else if (asprintf(&h->endpoint, "https://s3.%s.amazonaws.com", h->region) < 0)
        h->endpoint = NULL;
    if (h->endpoint == NULL)
        goto oom;
    if (strncmp(h->endpoint, "https://", 8) != 0 && strncmp(h->endpoint, "http://", 7) != 0) {
        rc = dl_fail(err, DL_E_INVALID_ARGUMENT, NULL, 0, "the S3 endpoint '%.200s' is not an http(s) URL",
                     h->endpoint);
        goto fail;
    }
    s3_addressing addressing = o->addressing == NULL || strcmp(o->addressing, "auto") == 0 ? S3_ADDRESSING_AUTO
                               : strcmp(o->addressing, "path") == 0                       ? S3_ADDRESSING_PATH
                                                                                          : S3_ADDRESSING_VIRTUAL;
    h->virtual_host = addressing == S3_ADDRESSING_VIRTUAL ||
                      (addressing == S3_ADDRESSING_AUTO && strstr(h->endpoint, ".amazonaws.com") != NULL);
    /* a bucket name with dots breaks TLS on virtual hosts (the certificate is *.s3...) */
    if (h->virtual_host && strchr(h->bucket, '.') != NULL && strncmp(h->endpoint, "https://", 8) == 0) {
        rc = dl_fail(err, DL_E_INVALID_ARGUMENT, NULL, 0,
                     "bucket '%s' has dots: use path-style addressing for it over https", h->bucket);
        goto fail;
    }
    h->part_size = o->part_mib ? (uint64_t)o->part_mib << 20 : DEFAULT_PART_SIZE;
    if (h->part_size < S3_MIN_PART_SIZE || h->part_size > S3_MAX_PART_SIZE) {
        rc = dl_fail(err, DL_E_INVALID_ARGUMENT, NULL, 0, "the S3 part size must be 5 MiB to 5 GiB");
        goto fail;
    }
    if (o->credentials_file != NULL) {
        if ((rc = load_credentials_file(h, o->credentials_file, err)) != 0)
            goto fail;
    } else {
        const char *k = getenv("AWS_ACCESS_KEY_ID"), *s = getenv("AWS_SECRET_ACCESS_KEY");
        if (k == NULL || !*k || s == NULL || !*s) {
            rc = dl_fail(err, DL_E_INVALID_ARGUMENT, NULL, 0,
                         "s3:// needs credentials: AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or a credentials file");
            goto fail;
        }
        h->key_id = strdup(k);
        h->secret = strdup(s);
        if (h->key_id == NULL || h->secret == NULL)
            goto oom;
    }
    if ((h->state_dir = strdup(cfg->state_dir)) == NULL || asprintf(&incoming, "%s/cache/incoming", cfg->state_dir) < 0)
        goto oom;
    if ((rc = fsu_mkdirs(incoming, err)) != 0 || (rc = load_instance(h, err)) != 0)
        goto fail;
    free(incoming);
    incoming = NULL;
    if (asprintf(&seen_path, "%s/s3_seen.tsv", h->state_dir) < 0) {
        seen_path = NULL;
        goto oom;
    }
    if ((h->curl = cuv_new(loop)) == NULL)
        goto oom;
    remote_init(&h->rm, loop, h->curl, &h->st, &s3_remote_ops, h, &h->closing);
    job_owner_init(&h->jobs, loop, NULL);
    h->rm.body_cap = XML_CAP;
    h->base.ops = &hub_s3_ops;
    h->loop = loop;
    h->cb = *cb;
    h->app = app;
    h->poll_interval = cfg->poll_interval > 0 ? cfg->poll_interval : 5;
    h->max_downloads = cfg->max_downloads ? cfg->max_downloads : 2;
    h->max_header = cfg->max_header_bytes && cfg->max_header_bytes < ST_MAX_HEADER_SIZE ? cfg->max_header_bytes
                                                                                       : ST_MAX_HEADER_SIZE;
    h->published_known = -2;
    remote_seen_open(&h->seen, loop, seen_path);
    free(seen_path);
    seen_path = NULL;
    uv_timer_init(loop, &h->poll_timer);
    h->poll_timer.data = h;
    uv_timer_init(loop, &h->claim_timer);
    h->claim_timer.data = h;
    h->claim_lease = o->claim_lease ? o->claim_lease : 60;
    h->handles = 2;             /* the poll timer and the claim timer */
    snprintf(h->st.head, sizeof(h->st.head), "%s", "");
    dl_log(DL_LOG_INFO, "hub", "s3 transport", "bucket=%s prefix=%s endpoint=%s region=%s addressing=%s part_mib=%" PRIu64,
           h->bucket, h->prefix[0] ? h->prefix : "\"\"", h->endpoint, h->region, h->virtual_host ? "virtual" : "path",
           h->part_size >> 20);
    *out = &h->base;
    return 0;
oom:
    rc = dl_fail(err, DL_E_NO_MEMORY, NULL, 0, "cannot set up the S3 transport: out of memory");
fail:
    free(incoming);
    free(seen_path);
    s3_free(h);
    return rc;
}

static void s3_start(hub *base)
{
    s3_hub *h = (s3_hub *)base;
    uv_timer_start(&h->poll_timer, poll_cb, 0, (uint64_t)(h->poll_interval * 1000));
}

static void s3_set_limits(hub *base, const hub_limits *lim)
{
    ((s3_hub *)base)->limits = *lim;
}

static void s3_set_step(hub *base, uint64_t step, int waiting)
{
    s3_hub *h = (s3_hub *)base;
    h->step = step;
    h->waiting = waiting;
}

static const hub_status *s3_get_status(const hub *base)
{
    return &((const s3_hub *)base)->st;
}

static void curl_closed(void *arg)
{
    s3_hub *h = arg;
    void (*done)(void *) = h->close_done;
    void *darg = h->close_arg;
    s3_free(h);
    if (done)
        done(darg);
}

static void poll_timer_closed(uv_handle_t *t)
{
    s3_hub *h = t->data;
    cuv_close(h->curl, curl_closed, h);
}

static void claim_timer_closed(uv_handle_t *t)
{
    s3_hub *h = t->data;
    h->handles--;
}

static void close_when_idle(uv_timer_t *t)
{
    s3_hub *h = t->data;
    if (h->rm.inflight != NULL || h->handles > 1 || h->jobs.in_flight > 0 || h->seen.writes > 0)
        return;
    if (h->pub.active)
        pub_finish(h, "stopped");
    uv_timer_stop(t);
    uv_close((uv_handle_t *)t, poll_timer_closed);
}

static void s3_close(hub *base, void (*done)(void *), void *arg)
{
    s3_hub *h = (s3_hub *)base;

    h->closing = 1;
    h->close_done = done;
    h->close_arg = arg;
    uv_timer_stop(&h->poll_timer);
    uv_timer_stop(&h->claim_timer);
    uv_close((uv_handle_t *)&h->claim_timer, claim_timer_closed);
    remote_cancel_all(&h->rm);
    /* cancelled requests and pool jobs come back before the handles close */
    uv_timer_start(&h->poll_timer, close_when_idle, 10, 10);
}

const hub_ops hub_s3_ops = {
    .scheme = "s3://",
    .kind = "s3",
    .url_form = "s3://bucket[/prefix]",
    .options = &s3_options_ops,
    .check_url = s3_check_url,
    .open = s3_open,
    .start = s3_start,
    .set_step = s3_set_step,
    .set_limits = s3_set_limits,
    .publish = s3_publish,
    .mark_done = s3_mark_done,
    .status = s3_get_status,
    .close = s3_close,
};
