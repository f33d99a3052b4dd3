/* hub_s3: the s3:// transport (hub_s3.h), on libcurl multi inside the libuv loop (curl_uv), every
 * request signed with libcurl's SigV4.
 *
 * Polling: every poll interval, global/step_count.json (a GET); then, while the daemon is not
 * waiting for a global, ListObjectsV2 of <prefix>/nodes/ (every page, by continuation token).  In
 * sync mode only each node directory's delta with the highest local step matters (a worker's later
 * delta replaces its earlier ones in a round, and is never based on an older step), so at most one
 * download per node per poll; in async mode every delta is an update, and a node's single files not
 * handled yet are taken in local-step order, ASYNC_DELTAS_PER_NODE per poll (consider_async).  A
 * (key, ETag) pair is handed over once (again after a HUB_RETRY): the pairs handled are remembered in
 * <state>/s3_seen.tsv, also across restarts.
 *
 * Peeking: a new delta's first 64 KiB (at most its listed size) are read first (a Range GET): a header over the header cap
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
 * delta into cache/incoming/s3-<version>.set/, and the set is handed over at its index's
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
 * per listing are capped, a repeated continuation token ends the listing, and every request has curl_uv's connect and low-speed limits.
 *
 * This file holds the requests (SigV4), the polls, the verify (MD5) and the adoption's confirmation, and
 * the lifecycle; the listing's walk is hub_s3_list.c's; the peek, download, verify and set machinery is
 * remote_fetch.c's, the publish hub_s3_publish.c's. */
#include "hub.h"
#include "hub_s3.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <openssl/rand.h>

#include "curl_uv.h"
#include "curl_uv_aws.h"
#include "delta.h"
#include "dl_log.h"
#include "fsutil.h"
#include "hub_s3_internal.h"
#include "hub_set.h"
#include "remote.h"
#include "remote_fetch.h"
#include "seen.h"
#include "st_index.h"
#include "stepcount.h"
#include "store.h"
#include "strbuf.h"

#define DEFAULT_PART_SIZE (64ull << 20)
#define XML_CAP S3_LIST_PAGE_CAP
#define CREDENTIALS_FILE_CAP (64u << 10)

/* ---- requests with retries ------------------------------------------------------------------- */

/* "HTTP 403 InvalidAccessKeyId: The AWS Access Key Id you provided does not exist in our records." */
void s3_describe_answer(const cuv_xfer *x, char *out, size_t size)
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

s3_req *s3_req_new(s3_hub *h, const char *method, const char *key, const char *query, const char *route)
{
    char *url = s3_url(h->endpoint, h->bucket, h->virtual_host, key, query);
    s3_req *r = url != NULL ? remote_req_new(&h->f.rm, method, url, key ? key : "(bucket)", route) : NULL;

    free(url);
    return r;
}

/* Each attempt signed with SigV4, and the payload hash it signs: libcurl takes it from this header
 * (it could not hash a body it reads through a callback); a file body is sent unsigned, as the AWS
 * SDKs do over TLS. */
static int s3_authorize(remote *rm, remote_req *r, cuv_xfer *x)
{
    s3_hub *h = rm->owner;
    char line[128];
    int rc = s3_payload_header(r->has_body ? S3_PAYLOAD_MEMORY : r->src_fd >= 0 ? S3_PAYLOAD_FILE : S3_PAYLOAD_NONE,
                               r->body, r->body_len, line);

    if (rc != 0)
        return rc;
    cuv_xfer_header(x, line);
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
    .describe = s3_describe_answer,
    .complete = s3_complete,
};

void s3_req_go(s3_hub *h, s3_req *r, s3_req_cb cb, void *arg)
{
    (void)h;
    remote_go(r, (remote_fn)cb, arg);
}

char *s3_full_key(const s3_hub *h, const char *rel)
{
    char *k = NULL;
    if (asprintf(&k, "%s%s%s", h->prefix, h->prefix[0] ? "/" : "", rel) < 0)
        return NULL;
    return k;
}

/* Whatever the daemon decided, a handed-over (key, ETag) is not downloaded again; a download is
 * verified against the listing, so one that intake finds short is final. */
static int s3_mark_done(hub *base, const char *rel, hub_outcome outcome, const hub_version *v)
{
    (void)v;
    return remote_fetch_mark_done(&((s3_hub *)base)->f, rel, outcome);
}

/* ---- the fetch pipeline's table (remote_fetch.h) ------------------------------------------------- */

/* Every GET of an object is conditional on the listed ETag: an object replaced in the middle is
 * never stitched from two versions (412: remote_fetch drops it, the next listing has the new one). */
static remote_req *s3_get(remote_fetch *f, const remote_cand *c, const char *route)
{
    s3_req *r = s3_req_new(f->owner, "GET", c->key, NULL, route);
    char line[160];

    if (r != NULL) {
        snprintf(line, sizeof(line), "If-Match: \"%s\"", c->tag);
        remote_req_header(r, line);
    }
    return r;
}

/* The part file's name: the key's path and the ETag, in characters any file system takes. */
static char *s3_part_path(remote_fetch *f, const remote_cand *c)
{
    sbuf b = {0};
    char *dir = store_path_incoming(f->state_dir);

    if (dir == NULL)
        return NULL;
    sb_str(&b, dir);
    sb_str(&b, "/s3-");
    free(dir);
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

/* A single-part upload's ETag is the MD5 of the object (32 hex digits); a multipart one's is not
 * ("<md5 of md5s>-<parts>"), and neither is an SSE-KMS object's: those are checked by size and by
 * If-Match on the ETag while downloading. */
static int etag_is_md5(const char *etag)
{
    return strlen(etag) == 32 && strspn(etag, "0123456789abcdef") == 32;
}

/* On the pool: the MD5 against a single-part upload's ETag. */
static int s3_verify_file(const remote_cand *c, int fd, char *why, size_t size)
{
    char hex[33];

    if (!etag_is_md5(c->tag))
        return 0;
    if (remote_hash_fd(fd, REMOTE_MD5, NULL, 0, hex, sizeof(hex)) != 0) {
        snprintf(why, size, "cannot hash the download");
        return -1;
    }
    if (strcmp(hex, c->tag) != 0) {
        snprintf(why, size, "MD5 %s, the ETag says %s", hex, c->tag);
        return -1;
    }
    return 0;
}

/* The global was listed after step_count.json was read: a publish in between would pair the new
 * model with the old step.  Publishers write the model first and the step file last, so reading the
 * step file again after the download tells: unchanged, the model is that step's. */
static void adopt_confirm_done(s3_hub *h, s3_req *r, int ok)
{
    remote_cand *c = r->arg;
    uint64_t step = 0;
    int bootstrap = 0;

    if (!h->f.closing && ok && stepcount_parse(r->x->body.p, r->x->body.len, &step, &bootstrap, NULL, NULL) == 0 &&
        step == c->step) {
        remote_req_end(r);
        remote_fetch_global_ready(&h->f, c);
        return;
    }
    remote_req_end(r);
    if (!h->f.closing)
        dl_log(DL_LOG_INFO, "hub", "the bucket's step moved during the adoption download, trying again",
               "step=%" PRIu64, c->step);
    remote_fetch_global_failed(&h->f, c);       /* the next poll starts the adoption over */
}

static void s3_confirm_global(remote_fetch *f, remote_cand *c)
{
    s3_hub *h = f->owner;
    char *key = s3_full_key(h, "global/step_count.json");
    s3_req *r = key ? s3_req_new(h, "GET", key, NULL, "step_count") : NULL;

    free(key);
    if (r == NULL) {
        remote_fetch_global_failed(f, c);
        return;
    }
    r->body_cap = STEPFILE_CAP;
    r->max_attempts = 3;
    s3_req_go(h, r, adopt_confirm_done, c);
}

static void s3_idle(remote_fetch *f);

static const remote_fetch_ops s3_fetch_ops = {
    .name_field = "key",
    .downloaded_log = "s3 object downloaded",
    .set_prefix = "s3-",
    .get = s3_get,
    .part_path = s3_part_path,
    .verify_file = s3_verify_file,
    .confirm_global = s3_confirm_global,
    .idle = s3_idle,
};

/* ---- polling ----------------------------------------------------------------------------------- */

void s3_poll_finish(s3_hub *h)
{
    h->polling = 0;
    h->st.last_poll = time(NULL);
    remote_fetch_requeue_due(&h->f);    /* failed downloads whose wait is over */
    remote_fetch_pump(&h->f);
}

/* ---- adoption: the bucket's global ------------------------------------------------------------- */

/* A sharded global: the index and the shards listed next to it become one set candidate. */
static remote_cand *adopt_set(const s3_listing *l, const char *dir)
{
    size_t dlen = strlen(dir);
    const s3_object *index = NULL;
    remote_listed *listed = NULL;
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
            remote_listed o = {.key = l->objs[i].key, .size = l->objs[i].size};
            snprintf(o.tag, sizeof(o.tag), "%s", l->objs[i].etag);
            if (remote_listed_add(&listed, &n, &o) != 0) {
                remote_listed_free(listed, n);
                return NULL;
            }
        }
    }
    remote_cand *c = index ? remote_cand_new("global/latest" ST_INDEX_SUFFIX, index->key, index->etag, index->size)
                           : NULL;
    if (c == NULL || remote_fetch_set_version(index->etag, listed, n, ver, sizeof(ver)) != 0) {
        remote_listed_free(listed, n);
        remote_cand_free(c);
        return NULL;
    }
    snprintf(c->ver, sizeof(c->ver), "%s", ver);
    c->is_set = 1;
    c->listed = listed;
    c->nlisted = n;
    return c;
}

static void global_list_done(s3_hub *h, s3_req *r, int ok)
{
    s3_listing l;
    dl_error err = {0};
    char *want = s3_full_key(h, "global/latest.safetensors");
    uint64_t step = (uint64_t)(uintptr_t)r->arg;
    remote_cand *c = NULL;

    if (!ok || h->f.closing || want == NULL || s3_parse_listing(r->x->body.p, r->x->body.len, &l, &err) != 0) {
        if (!h->f.closing && ok)
            set_error(h, "listing the global: %s", err.message[0] ? err.message : "out of memory");
        remote_req_end(r);
        free(want);
        h->f.global_download = 0;
        if (!h->f.closing)
            s3_poll_finish(h);
        return;
    }
    remote_req_end(r);
    if (h->adopt_sharded) {
        want[strlen(want) - strlen("latest.safetensors")] = '\0';
        c = adopt_set(&l, want);
    }
    for (size_t i = 0; !h->adopt_sharded && i < l.n; i++) {
        if (strcmp(l.objs[i].key, want) == 0) {
            c = remote_cand_new("global/latest.safetensors", want, l.objs[i].etag, l.objs[i].size);
            break;
        }
    }
    s3_listing_free(&l);
    free(want);
    if (c != NULL) {
        c->is_global = 1;
        c->step = step;
        remote_fetch_offer_global(&h->f, c);
    } else {
        h->f.global_download = 0;
    }
    s3_poll_finish(h);
}

/* The plain global is listed alone; a sharded one with everything under global/latest. */
static void adopt_global(s3_hub *h, uint64_t step, int sharded)
{
    char *key = s3_full_key(h, sharded ? "global/latest" : "global/latest.safetensors");
    char *query = key ? s3_list_query(key, NULL, NULL, sharded ? S3_MAX_KEYS_PER_PAGE : 1) : NULL;
    s3_req *r = query ? s3_req_new(h, "GET", NULL, query, "list") : NULL;

    free(key);
    free(query);
    if (r == NULL) {
        s3_poll_finish(h);
        return;
    }
    h->f.global_download = 1;
    h->adopt_sharded = sharded;
    s3_req_go(h, r, global_list_done, (void *)(uintptr_t)step);
}

/* ---- the step file ----------------------------------------------------------------------------- */

static void report_step(s3_hub *h, int64_t step)
{
    s3_claim_step_seen(h, step);
    remote_report_step(&h->published_known, step, &h->cb, h->app);
}

static void stepfile_done(s3_hub *h, s3_req *r, int ok)
{
    long status = r->x ? r->x->status : 0;
    uint64_t step = 0;
    int bootstrap = 0, have = 0, sharded = 0;
    dl_error err = {0};
    char why[256];

    if (h->f.closing) {
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
            s3_describe_answer(r->x, why, sizeof(why));
            set_error(h, "GET %s: %s", r->what, why);
        }
        remote_req_end(r);
        s3_poll_finish(h);
        return;
    }
    remote_req_end(r);
    if (have)
        report_step(h, (int64_t)step);
    if (h->f.waiting) {
        if (have && !h->f.global_download)
            adopt_global(h, step, sharded);
        else
            s3_poll_finish(h);
        return;
    }
    s3_list_page(h, NULL);
}

static void fetch_stepfile(s3_hub *h)
{
    char *key = s3_full_key(h, "global/step_count.json");
    s3_req *r = key ? s3_req_new(h, "GET", key, NULL, "step_count") : NULL;

    free(key);
    if (r == NULL) {
        s3_poll_finish(h);
        return;
    }
    r->body_cap = STEPFILE_CAP;
    r->max_attempts = 3;
    s3_req_go(h, r, stepfile_done, NULL);
}

static void poll_cb(uv_timer_t *t)
{
    s3_hub *h = t->data;
    if (h->polling || h->f.closing)
        return;
    h->polling = 1;
    fetch_stepfile(h);
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
    s3_best_reset(h);
    remote_fetch_free(&h->f);
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
    h->f.seen.fd = -1;
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
    if ((h->state_dir = strdup(cfg->state_dir)) == NULL || (incoming = store_path_incoming(cfg->state_dir)) == NULL)
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
    h->base.ops = &hub_s3_ops;
    h->loop = loop;
    h->cb = *cb;
    h->app = app;
    h->poll_interval = cfg->poll_interval > 0 ? cfg->poll_interval : 5;
    h->max_downloads = cfg->max_downloads ? cfg->max_downloads : 2;
    h->max_header = cfg->max_header_bytes && cfg->max_header_bytes < ST_MAX_HEADER_SIZE ? cfg->max_header_bytes
                                                                                       : ST_MAX_HEADER_SIZE;
    h->published_known = REMOTE_STEP_UNREPORTED;
    remote_fetch_init(&h->f, &(remote_fetch_config){.loop = loop, .curl = h->curl, .st = &h->st,
                                                     .req_ops = &s3_remote_ops, .ops = &s3_fetch_ops, .owner = h,
                                                     .cb = cb, .app = app, .state_dir = h->state_dir,
                                                     .seen_path = seen_path, .poll_interval = h->poll_interval,
                                                     .max_downloads = h->max_downloads, .max_header = h->max_header});
    h->f.rm.body_cap = XML_CAP;
    free(seen_path);
    seen_path = NULL;
    uv_timer_init(loop, &h->poll_timer);
    h->poll_timer.data = h;
    uv_timer_init(loop, &h->claim_timer);
    h->claim_timer.data = h;
    h->claim_lease = o->claim_lease ? o->claim_lease : 60;
    remote_fetch_hold(&h->f);   /* the poll timer's and the claim timer's, until they are closed */
    remote_fetch_hold(&h->f);
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
    ((s3_hub *)base)->f.limits = *lim;
}

static void s3_set_step(hub *base, uint64_t step, int waiting)
{
    s3_hub *h = (s3_hub *)base;
    h->f.step = step;
    h->f.waiting = waiting;
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

/* Everything in flight has ended (remote_fetch.h's reference count): a publish cut short ends here. */
static void s3_idle(remote_fetch *f)
{
    s3_hub *h = f->owner;

    if (h->pub.active)
        s3_pub_finish(h, "stopped");
    cuv_close(h->curl, curl_closed, h);
}

static void timer_closed(uv_handle_t *t)
{
    s3_hub *h = t->data;

    remote_fetch_release(&h->f);
}

static void s3_close(hub *base, void (*done)(void *), void *arg)
{
    s3_hub *h = (s3_hub *)base;

    h->close_done = done;
    h->close_arg = arg;
    uv_timer_stop(&h->poll_timer);
    uv_close((uv_handle_t *)&h->poll_timer, timer_closed);
    uv_timer_stop(&h->claim_timer);
    uv_close((uv_handle_t *)&h->claim_timer, timer_closed);
    remote_fetch_close(&h->f);
}

int hub_s3_access(const hub *base, s3_access *out)
{
    extern const hub_ops hub_s3_ops;
    const s3_hub *h = (const s3_hub *)base;
    if (base == NULL || base->ops != &hub_s3_ops)
        return -1;
    *out = (s3_access){h->endpoint, h->bucket, h->prefix, h->region, h->key_id, h->secret, h->virtual_host};
    return 0;
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
