/* hub_s3_publish: the s3:// transport's publish (hub_s3.h): first the step's claim, with a lease
 * (PUT <prefix>/global/steps/<step>.claim with If-None-Match: *, so of several aggregators on one
 * bucket exactly one publishes each step; a claim of our own is recognised by the instance id, a
 * foreign one is waited out and taken over once its lease expired, ours is renewed while the upload
 * lasts); then global/latest.safetensors, one PUT up to the part size and a multipart upload above it,
 * or for a sharded global each shard that way and the index; then global/step_count.json, last; then
 * the other layout's objects are deleted. */
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "dl_log.h"
#include "hub_s3_internal.h"
#include "hub_set.h"
#include "st_index.h"
#include "stepcount.h"
#include "strbuf.h"

#define CLAIM_CAP (4u << 10)

static const char *pub_rel(const s3_hub *h)
{
    return h->pub.files[h->pub.cur].rel;
}

void s3_pub_finish(s3_hub *h, const char *error)
{
    pub_state *p = &h->pub;
    uint64_t step = p->step;

    if (h->claim_timer.data != NULL)
        uv_timer_stop(&h->claim_timer);
    hub_set_publish_close(p->files, p->nfiles);
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
    if (!h->f.closing)
        h->cb.publish_done(h->app, step, error);
}

/* The request failed: why, in the status and for publish_done. */
static void pub_fail(s3_hub *h, s3_req *r, const char *doing)
{
    char why[256] = "out of memory";
    if (r != NULL && r->x != NULL)
        s3_describe_answer(r->x, why, sizeof(why));
    if (!h->f.closing)
        set_error(h, "publishing step %" PRIu64 ": %s: %s", h->pub.step, doing, why);
    if (r != NULL)
        remote_req_end(r);
    s3_pub_finish(h, h->st.last_error);
}

/* A file of the other layout, left by an earlier publish: for a sharded publish the plain file and
 * shards of another count, for a plain one the index and every shard. */
static int pub_other_layout(const s3_hub *h, const char *name)
{
    /* the index is the last of files[]; its shard count is files[] minus it */
    return hub_set_other_layout(name, h->pub.sharded, (uint32_t)(h->pub.nfiles - 1 - h->pub.nrecords));
}

static void delete_done(s3_hub *h, s3_req *r, int ok)
{
    if (!ok && !h->f.closing && r->x != NULL) {
        char why[256];
        s3_describe_answer(r->x, why, sizeof(why));
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
    char *dir = s3_full_key(h, "global/");
    size_t dlen = dir ? strlen(dir) : 0;

    if (!h->f.closing && ok && dir != NULL && s3_parse_listing(r->x->body.p, r->x->body.len, &l, &err) == 0) {
        for (size_t i = 0; i < l.n; i++) {
            const char *key = l.objs[i].key;
            if (strncmp(key, dir, dlen) != 0 || strchr(key + dlen, '/') != NULL || !pub_other_layout(h, key + dlen))
                continue;
            s3_req *d = s3_req_new(h, "DELETE", key, NULL, "delete_global");
            if (d != NULL) {
                d->max_attempts = 3;
                s3_req_go(h, d, delete_done, NULL);
            }
        }
        s3_listing_free(&l);
    } else if (!h->f.closing) {
        dl_log(DL_LOG_WARN, "hub", "cannot list the global files of the other layout", "reason=%s",
               err.message[0] ? err.message : "the listing failed");
    }
    free(dir);
    remote_req_end(r);
    s3_pub_finish(h, NULL);
}

static void pub_cleanup(s3_hub *h)
{
    char *prefix = s3_full_key(h, "global/latest");
    char *query = prefix ? s3_list_query(prefix, NULL, NULL, S3_MAX_KEYS_PER_PAGE) : NULL;
    s3_req *r = query ? s3_req_new(h, "GET", NULL, query, "list") : NULL;

    free(prefix);
    free(query);
    if (r == NULL) {
        s3_pub_finish(h, NULL);
        return;
    }
    r->max_attempts = 3;
    s3_req_go(h, r, pub_cleanup_done, NULL);
}

static void pub_stepfile_done(s3_hub *h, s3_req *r, int ok)
{
    if (!ok || h->f.closing) {
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
        s3_pub_finish(h, h->st.last_error);
        return;
    }
    char *key = s3_full_key(h, "global/step_count.json");
    s3_req *r = key ? s3_req_new(h, "PUT", key, NULL, "put_step_count") : NULL;

    free(key);
    if (r == NULL || remote_req_body(r, h->pub.stepfile, strlen(h->pub.stepfile)) != 0) {
        if (r)
            remote_req_end(r);
        pub_fail(h, NULL, "PUT global/step_count.json");
        return;
    }
    remote_req_header(r, "Content-Type: application/json");
    s3_req_go(h, r, pub_stepfile_done, NULL);
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

    if (!ok || h->f.closing) {
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
    char *key = s3_full_key(h, pub_rel(h));
    char *q = key && h->pub.upload_id ? upload_query(h->pub.upload_id, 0) : NULL;
    s3_req *r = q ? s3_req_new(h, "DELETE", key, q, "abort_upload") : NULL;
    free(key);
    free(q);
    if (r != NULL && !h->f.closing) {
        r->max_attempts = 2;
        s3_req_go(h, r, abort_done, NULL);
    } else if (r != NULL) {
        remote_req_end(r);
    }
}

static void pub_complete_done(s3_hub *h, s3_req *r, int ok)
{
    char code[64], msg[160], doing[ST_INDEX_BASE_MAX + 160];

    /* CompleteMultipartUpload can fail after a 200: the error is then in the body */
    if (ok && !h->f.closing && s3_parse_error(r->x->body.p, r->x->body.len, code, sizeof(code), msg, sizeof(msg)))
        ok = 0;
    if (!ok || h->f.closing) {
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
    char *key = s3_full_key(h, pub_rel(h));
    char *q = upload_query(p->upload_id, 0);
    s3_req *r = key && q ? s3_req_new(h, "POST", key, q, "complete_upload") : NULL;

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
    s3_req_go(h, r, pub_complete_done, NULL);
}

static void pub_next_part(s3_hub *h);

static void pub_part_done(s3_hub *h, s3_req *r, int ok)
{
    pub_state *p = &h->pub;
    char etag[80];

    if (!ok || h->f.closing || s3_clean_etag(r->x->etag, strlen(r->x->etag), etag, sizeof(etag)) != 0 ||
        strpbrk(etag, "<>&") != NULL || (p->etags[p->next_part] = strdup(etag)) == NULL) {
        char doing[ST_INDEX_BASE_MAX + 160];
        if (ok && !h->f.closing)
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
    char *key = s3_full_key(h, pub_rel(h));
    char *q = upload_query(p->upload_id, p->next_part + 1);
    s3_req *r = key && q ? s3_req_new(h, "PUT", key, q, "upload_part") : NULL;
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
    s3_req_go(h, r, pub_part_done, NULL);
}

static void pub_initiate_done(s3_hub *h, s3_req *r, int ok)
{
    pub_state *p = &h->pub;
    dl_error err = {0};
    char doing[ST_INDEX_BASE_MAX + 160];

    if (!ok || h->f.closing) {
        snprintf(doing, sizeof(doing), "starting the multipart upload of %s", pub_rel(h));
        pub_fail(h, r, doing);
        return;
    }
    if (s3_parse_upload_id(r->x->body.p, r->x->body.len, &p->upload_id, &err) != 0) {
        set_error(h, "publishing step %" PRIu64 ": %s", p->step, err.message);
        remote_req_end(r);
        s3_pub_finish(h, h->st.last_error);
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
    char *key = s3_full_key(h, pub_rel(h));
    char doing[ST_INDEX_BASE_MAX + 160];
    s3_req *r;

    snprintf(doing, sizeof(doing), "PUT %s", pub_rel(h));
    if (key == NULL) {
        pub_fail(h, NULL, doing);
        return;
    }
    if (p->size <= h->part_size) {
        r = s3_req_new(h, "PUT", key, NULL, "put_global");
        free(key);
        if (r == NULL) {
            pub_fail(h, NULL, doing);
            return;
        }
        r->src_fd = p->fd;
        r->src_off = 0;
        r->src_len = p->size;
        remote_req_header(r, (p->sharded && p->cur == p->nfiles - 1) || (p->cur + 1 == p->nrecords) ? "Content-Type: application/json"
                                                             : "Content-Type: application/octet-stream");
        s3_req_go(h, r, pub_single_done, NULL);
        return;
    }
    /* parts of part_size; S3 takes at most 10,000, so a larger file gets larger parts */
    p->part_size = h->part_size;
    if ((p->size + p->part_size - 1) / p->part_size > S3_MAX_PARTS)
        p->part_size = ((p->size + S3_MAX_PARTS - 1) / S3_MAX_PARTS + (1u << 20) - 1) & ~(uint64_t)((1u << 20) - 1);
    p->nparts = (unsigned)((p->size + p->part_size - 1) / p->part_size);
    r = s3_req_new(h, "POST", key, "uploads=", "create_upload");
    free(key);
    if (r == NULL) {
        pub_fail(h, NULL, "starting the multipart upload");
        return;
    }
    remote_req_header(r, "Content-Type: application/octet-stream");
    s3_req_go(h, r, pub_initiate_done, NULL);
}

static void pub_uploads_done(s3_hub *h, s3_req *r, int ok)
{
    pub_state *p = &h->pub;
    dl_error err = {0};

    if (h->f.closing) {
        pub_fail(h, r, "listing interrupted uploads");
        return;
    }
    /* a failure here only leaves parts behind: the publish goes on */
    if (!ok) {
        char why[256] = "";
        if (r->x != NULL)
            s3_describe_answer(r->x, why, sizeof(why));
        dl_log(DL_LOG_WARN, "hub", "cannot list interrupted multipart uploads", "reason=%s", why);
    }
    for (unsigned f = 0; ok && f < p->nfiles; f++) {
        char *key = s3_full_key(h, p->files[f].rel);
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
            s3_req *a = q ? s3_req_new(h, "DELETE", key, q, "abort_upload") : NULL;
            free(q);
            if (a != NULL) {
                dl_log(DL_LOG_INFO, "hub", "aborting an interrupted multipart upload", "key=%s", key);
                a->max_attempts = 2;
                s3_req_go(h, a, abort_done, NULL);
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
    char *key = s3_full_key(h, "global/latest");
    sbuf q = {0};
    sb_str(&q, "prefix=");
    if (key != NULL)
        s3_uri_encode(&q, key, 0);
    sb_str(&q, "&uploads=");
    char *query = sb_take(&q);
    s3_req *r = key && query ? s3_req_new(h, "GET", NULL, query, "list_uploads") : NULL;
    free(key);
    free(query);
    if (r == NULL) {
        pub_upload(h);
        return;
    }
    s3_req_go(h, r, pub_uploads_done, NULL);
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
    return s3_full_key(h, rel);
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

    if (h->f.closing || !p->active || gen != p->gen) {
        remote_req_end(r);
        return;
    }
    if (ok && s3_lease_judge(r->x->body.p, r->x->body.len, p->claim_body, p->claim_len, 0, 0, h->claim_lease, NULL) ==
                  S3_LEASE_OURS) {
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
    s3_req *r = key ? s3_req_new(h, "GET", key, NULL, "read_claim") : NULL;
    free(key);
    if (r == NULL) {
        claim_timer_start(h, h->claim_lease / 8, claim_renew_cb);
        return;
    }
    r->body_cap = CLAIM_CAP;
    s3_req_go(h, r, claim_renew_check_done, (void *)(uintptr_t)h->pub.gen);
}

static void claim_renew_done(s3_hub *h, s3_req *r, int ok)
{
    pub_state *p = &h->pub;
    unsigned gen = (unsigned)(uintptr_t)r->arg;

    if (h->f.closing || !p->active || gen != p->gen) {
        remote_req_end(r);
        return;
    }
    if (ok) {
        claim_held(h, r->x);
    } else if (s3_lease_after_put(r->x != NULL ? r->x->status : 0) == S3_LEASE_PUT_READ_BACK) {
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
    if (h->f.closing || !p->active || !p->claim_held || p->claim_lost)
        return;
    char *key = claim_key(h, p->step);
    s3_req *r = key ? s3_req_new(h, "PUT", key, NULL, "claim_renew") : NULL;
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
    s3_req_go(h, r, claim_renew_done, (void *)(uintptr_t)p->gen);
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
    h->published_known = REMOTE_STEP_UNREPORTED;
    s3_pub_finish(h, msg);
}

static void claim_wait_cb(uv_timer_t *t)
{
    s3_hub *h = t->data;
    if (h->f.closing || !h->pub.active || !h->pub.claim_waiting)
        return;
    if (h->pub.claim_gone) {
        h->pub.claim_gone = 0;
        pub_claim(h);           /* it was removed: claim the step afresh */
    } else {
        pub_claim_read(h);
    }
}

static void pub_claim_read_done(s3_hub *h, s3_req *r, int ok)
{
    pub_state *p = &h->pub;
    long status = r->x ? r->x->status : 0;

    if (h->f.closing) {
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
    int by_instance = cJSON_IsString(inst) && strcmp(inst->valuestring, h->instance) == 0;
    cJSON_Delete(j);
    /* a foreign claim's age by the server, and by how long we have seen this very version (s3_lease.h) */
    double age = s3_lease_age(&p->foreign, r->x->etag, r->x->last_modified, r->x->date,
                              (double)uv_now(h->loop) / 1000);
    s3_lease_verdict v = s3_lease_judge(b->p, b->len, p->claim_body, p->claim_len, by_instance, age,
                                        h->claim_lease, r->x->etag);
    if (v == S3_LEASE_OURS) {
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
    snprintf(p->claim_etag, sizeof(p->claim_etag), "%s", r->x->etag);
    remote_req_end(r);
    if (v == S3_LEASE_EXPIRED && p->takeovers < 3) {
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
    s3_req *r = key ? s3_req_new(h, "GET", key, NULL, "read_claim") : NULL;
    free(key);
    if (r == NULL) {
        pub_fail(h, NULL, "reading the claim");
        return;
    }
    r->body_cap = CLAIM_CAP;
    s3_req_go(h, r, pub_claim_read_done, NULL);
}

static void pub_claim_done(s3_hub *h, s3_req *r, int ok)
{
    long status = r->x ? r->x->status : 0;

    if (s3_lease_after_put(status) == S3_LEASE_PUT_READ_BACK && !h->f.closing) {
        /* the claim exists (or changed since we read it): whose it is decides, read it back */
        remote_req_end(r);
        pub_claim_read(h);
        return;
    }
    if (!ok || h->f.closing) {
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
    s3_req *r = key ? s3_req_new(h, "PUT", key, NULL, "claim") : NULL;

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
    s3_req_go(h, r, cb ? cb : pub_claim_done, NULL);
}

/* If-None-Match: * makes the PUT conditional on the key not existing: of two aggregators that
 * claim one step, the server lets exactly one write it. */
static void pub_claim(s3_hub *h)
{
    pub_claim_put(h, "If-None-Match: *", NULL);
}

/* A poll saw the bucket's step: a claim we wait on is over if the bucket reached our step. */
void s3_claim_step_seen(s3_hub *h, int64_t step)
{
    if (h->pub.active && h->pub.claim_waiting && step >= 0 && (uint64_t)step >= h->pub.step) {
        uv_timer_stop(&h->claim_timer);
        claim_lost_to(h, "of the bucket's step");
    }
}

/* The step's signed record (--signing-key) before the model's files: global/rounds/<s>.json.sig, then
 * global/rounds/<s>.json, uploaded like them, so that step_count.json (last) never names a step without
 * its record.  0, or -1 with the reason set. */
static int pub_add_record(s3_hub *h, const char *record)
{
    pub_state *p = &h->pub;
    hub_pub_file *all = calloc(p->nfiles + 2, sizeof(*all));
    struct stat sb;

    if (all == NULL) {
        set_error(h, "publishing step %" PRIu64 ": out of memory", p->step);
        return -1;
    }
    memcpy(all + 2, p->files, p->nfiles * sizeof(*all));
    free(p->files);             /* its descriptors and paths live on in all */
    p->files = all;
    p->nfiles += 2;
    p->nrecords = 2;
    for (int i = 0; i < 2; i++) {
        hub_pub_file *f = &all[i];
        f->fd = -1;
        snprintf(f->rel, sizeof(f->rel), "global/rounds/%" PRIu64 ".json%s", p->step, i == 0 ? ".sig" : "");
        if (asprintf(&f->path, "%s%s", record, i == 0 ? ".sig" : "") < 0) {
            f->path = NULL;
            set_error(h, "publishing step %" PRIu64 ": out of memory", p->step);
            return -1;
        }
        if ((f->fd = open(f->path, O_RDONLY | O_CLOEXEC | O_NOFOLLOW)) < 0 || fstat(f->fd, &sb) != 0) {
            set_error(h, "publishing step %" PRIu64 ": cannot read its record %.300s: %s", p->step, f->path,
                      strerror(errno));
            return -1;
        }
        f->size = (uint64_t)sb.st_size;
    }
    return 0;
}

void s3_publish(hub *base, const hub_publication *pub)
{
    uint64_t step = pub->step;
    const char *global_path = pub->global_path, *optimizer = pub->optimizer;
    int bootstrap = pub->bootstrap;
    s3_hub *h = (s3_hub *)base;
    pub_state *p = &h->pub;
    dl_error err = {0};

    if (p->active || h->f.closing)
        return;
    memset(p, 0, sizeof(*p));
    p->fd = -1;
    p->active = 1;
    p->step = step;
    p->gen = ++h->pub_gen;
    p->bootstrap = bootstrap;
    snprintf(p->optimizer, sizeof(p->optimizer), "%s", optimizer);
    h->st.publishing = 1;
    p->sharded = st_index_is_index_path(global_path);
    if (hub_set_publish_open(global_path, &p->files, &p->nfiles, &err) != 0) {
        set_error(h, "publishing step %" PRIu64 ": %s", step, err.message);
        s3_pub_finish(h, h->st.last_error);
        return;
    }
    if (pub->record_path != NULL && pub_add_record(h, pub->record_path) != 0) {
        s3_pub_finish(h, h->st.last_error);
        return;
    }
    p->stepfile = stepcount_build(step, optimizer, bootstrap, p->sharded, NULL);
    if (p->stepfile == NULL) {
        set_error(h, "publishing step %" PRIu64 ": out of memory", step);
        s3_pub_finish(h, h->st.last_error);
        return;
    }
    p->fd = p->files[0].fd;
    p->size = p->files[0].size;
    pub_claim(h);
}
