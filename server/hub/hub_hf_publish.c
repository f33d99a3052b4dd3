/* hub_hf_publish: the hf:// transport's publish (hub_hf.h): ONE commit per outer step through the
 * Hub's commit API.  First the Hub's step_count.json is read (a step already there is not committed
 * again), then the head (parentCommit) and global/ at it (the other layout's files, deleted in the
 * same commit); the preupload says which files go through LFS; each LFS object is uploaded after its
 * batch (basic, or multipart in the chunks the server says, with the verify action after), and the
 * commit holds the LFS pointers, the index inline when the Hub wants it so, and step_count.json.  A
 * 412 (the parent moved) reads the Hub again before committing on the new head.  The sha256 of each
 * file is computed on the pool before the first request. */
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cJSON.h>

#include "dl_log.h"
#include "fsutil.h"
#include "hub_hf_internal.h"
#include "hub_set.h"
#include "jobs.h"
#include "st_index.h"
#include "stepcount.h"
#include "strbuf.h"

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
static int pub_hash_file(const hub_pub_file *io, pub_file *f, int is_index)
{
    unsigned char sample[512];
    sbuf s = {0};

    if (hf_sha256_file(io->path, f->sha256, sizeof(f->sha256)) != 0)
        return -1;
    ssize_t n = pread(io->fd, sample, sizeof(sample), 0);
    if (n < 0)
        return -1;
    b64(&s, sample, (size_t)n);
    char *t = sb_take(&s);
    if (t == NULL)
        return -1;
    snprintf(f->sample_b64, sizeof(f->sample_b64), "%s", t);
    free(t);
    if (is_index) {
        if (io->size > ST_INDEX_MAX_BYTES || (f->content = malloc(io->size ? io->size : 1)) == NULL ||
            fsu_pread_all(io->fd, f->content, io->size, 0) != 0)
            return -1;
        f->content_len = io->size;
    }
    return 0;
}

static void pub_hash_work(pool_job *pj)
{
    hash_job *j = pj->arg;
    pub_state *p = &j->h->pub;

    for (unsigned i = 0; i < p->nfiles; i++)
        if (pub_hash_file(&p->io[i], &p->files[i], p->sharded && i == p->nfiles - 1) != 0)
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
        hf_pub_finish(h, 1);
        return;
    }
    if (status == 412 && !h->f.closing) {
        /* Either someone else committed, or our own commit went through and its answer was lost
         * (then the retry found the head moved).  The Hub's step file tells which: only in the
         * first case do we commit again, on the new head. */
        dl_log(DL_LOG_INFO, "hub", "parent commit moved, checking the Hub before committing again",
               "step=%" PRIu64, h->pub.step);
        pub_check(h);
        return;
    }
    set_error(h, "commit of step %" PRIu64 ": HTTP %ld", h->pub.step, status);
    hf_pub_finish(h, 0);
}

/* Sends a publishing request whose body is b (consumed): retried until it succeeds or fails for
 * good; an allocation failure ends this publish attempt. */
static void pub_send(hf_hub *h, hf_req *r, sbuf *b, const char *content_type, hf_req_cb cb)
{
    size_t len = b->len;
    char *body = sb_take(b), line[96];

    if (body == NULL) {
        remote_req_end(r);
        hf_pub_finish(h, 0);
        return;
    }
    remote_req_body(r, body, len);
    free(body);
    snprintf(line, sizeof(line), "Content-Type: %s", content_type);
    remote_req_header(r, line);
    if (strstr(content_type, "git-lfs") != NULL)
        remote_req_header(r, "Accept: application/vnd.git-lfs+json");
    hf_req_go(h, r, cb, NULL);
}

static void pub_commit(hf_hub *h)
{
    pub_state *p = &h->pub;
    sbuf b = {0};
    char line[512];
    char *url = hf_api_url(h, "commit", NULL, NULL);
    hf_req *r = url ? hf_req_new(h, "POST", url, "commit") : NULL;

    free(url);
    if (r == NULL) {
        hf_pub_finish(h, 0);
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
                     p->io[i].rel, f->sha256, p->io[i].size);
            sb_str(&b, line);
        } else {
            sb_str(&b, "{\"key\":\"file\",\"value\":{\"content\":\"");
            b64(&b, (const unsigned char *)f->content, f->content_len);
            snprintf(line, sizeof(line), "\",\"path\":\"%s\",\"encoding\":\"base64\"}}\n", p->io[i].rel);
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
        hf_pub_finish(h, 0);
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
    hf_req *r = hf_req_new(h, "POST", href, "lfs_verify");
    char body[200];
    if (r == NULL) {
        hf_pub_finish(h, 0);
        return;
    }
    snprintf(body, sizeof(body), "{\"oid\":\"%s\",\"size\":%" PRIu64 "}", h->pub.sha256, h->pub.size);
    remote_req_body(r, body, strlen(body));
    /* the verify URL comes from the batch answer: the token goes along only to the endpoint */
    r->auth = hf_url_on_endpoint(h->endpoint, href);
    remote_req_header(r, "Content-Type: application/vnd.git-lfs+json");
    remote_req_header(r, "Accept: application/vnd.git-lfs+json");
    hf_req_go(h, r, verify_lfs_done, NULL);
}

static void basic_put_done(hf_hub *h, hf_req *r, int ok)
{
    remote_req_end(r);
    if (!ok) {
        set_error(h, "LFS upload of step %" PRIu64 " failed", h->pub.step);
        hf_pub_finish(h, 0);
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
        if ((p->part_etags[p->part_next] = strdup(x->etag)) == NULL) {
            remote_req_end(r);
            hf_pub_finish(h, 0);
            return;
        }
        p->part_next++;
        remote_req_end(r);
        multipart_next(h);
        return;
    }
    remote_req_end(r);
    set_error(h, "LFS multipart upload of step %" PRIu64 " failed at part %zu", p->step, p->part_next + 1);
    hf_pub_finish(h, 0);
}

static void complete_done(hf_hub *h, hf_req *r, int ok)
{
    remote_req_end(r);
    if (!ok) {
        set_error(h, "LFS multipart completion of step %" PRIu64 " failed", h->pub.step);
        hf_pub_finish(h, 0);
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
        hf_req *r = href ? hf_req_new(h, "PUT", href, "lfs_part") : NULL;
        if (r == NULL) {
            set_error(h, "LFS multipart answer lacks part %s", key);
            hf_pub_finish(h, 0);
            return;
        }
        uint64_t off = p->part_next * p->chunk;
        r->src_fd = p->fd;
        r->src_off = off;
        r->src_len = off + p->chunk <= p->size ? p->chunk : p->size - off;
        r->auth = 0;            /* pre-signed storage URLs: never our token */
        r->api = 0;
        hf_req_go(h, r, part_done, NULL);
        return;
    }
    /* completion: {"oid":..., "parts":[{"partNumber":1,"etag":"..."}]} */
    const char *href = cJSON_GetStringValue(cJSON_GetObjectItemCaseSensitive(upload, "href"));
    sbuf b = {0};
    hf_req *r = href ? hf_req_new(h, "POST", href, "lfs_complete") : NULL;
    if (r == NULL) {
        hf_pub_finish(h, 0);
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
        hf_pub_finish(h, 0);
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
            hf_pub_finish(h, 0);
            return;
        }
        p->chunk = cs;
        p->nparts = (size_t)((p->size + cs - 1) / cs);
        p->part_next = 0;
        p->part_etags = calloc(p->nparts + 1, sizeof(char *));
        if (p->part_etags == NULL) {
            hf_pub_finish(h, 0);
            return;
        }
        multipart_next(h);
        return;
    }
    const char *href = cJSON_GetStringValue(cJSON_GetObjectItemCaseSensitive(upload, "href"));
    hf_req *pr = href ? hf_req_new(h, "PUT", href, "lfs_upload") : NULL;
    if (pr == NULL) {
        hf_pub_finish(h, 0);
        return;
    }
    add_action_headers(pr, upload);
    pr->src_fd = p->fd;
    pr->src_off = 0;
    pr->src_len = p->size;
    pr->auth = 0;
    pr->api = 0;
    hf_req_go(h, pr, basic_put_done, NULL);
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
        hf_pub_finish(h, 0);
        return;
    }
    for (unsigned i = 0; i < p->nfiles; i++)
        p->files[i].lfs = 1;
    cJSON_ArrayForEach(f, cJSON_GetObjectItemCaseSensitive(j, "files")) {
        const char *path = cJSON_GetStringValue(cJSON_GetObjectItemCaseSensitive(f, "path"));
        const char *mode = cJSON_GetStringValue(cJSON_GetObjectItemCaseSensitive(f, "uploadMode"));
        for (unsigned i = 0; path && mode && i < p->nfiles; i++)
            if (strcmp(path, p->io[i].rel) == 0)
                p->files[i].lfs = strcmp(mode, "lfs") == 0;
    }
    cJSON_Delete(j);
    for (unsigned i = 0; i < p->nfiles; i++) {
        if (!p->files[i].lfs && p->files[i].content == NULL) {
            /* a regular file would travel inline, base64 in the commit: only sane for small files */
            set_error(h, "the Hub wants %s as a regular file: not supported, use LFS", p->io[i].rel);
            hf_pub_finish(h, 0);
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
    p->fd = p->io[p->cur].fd;
    p->size = p->io[p->cur].size;
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
        hf_pub_finish(h, 0);
        return;
    }
    hf_req *br = hf_req_new(h, "POST", url, "lfs_batch");
    free(url);
    if (br == NULL) {
        free(body);
        hf_pub_finish(h, 0);
        return;
    }
    remote_req_body(br, body, len);
    free(body);
    remote_req_header(br, "Content-Type: application/vnd.git-lfs+json");
    remote_req_header(br, "Accept: application/vnd.git-lfs+json");
    hf_req_go(h, br, batch_done, NULL);
}

static void pub_preupload(hf_hub *h)
{
    pub_state *p = &h->pub;
    char *url = hf_api_url(h, "preupload", NULL, NULL);
    hf_req *r = url ? hf_req_new(h, "POST", url, "preupload") : NULL;
    sbuf b = {0}, s = {0};
    char part[400], *ssample;

    free(url);
    if (r == NULL) {
        hf_pub_finish(h, 0);
        return;
    }
    b64(&s, (const unsigned char *)p->stepfile, strlen(p->stepfile) < 512 ? strlen(p->stepfile) : 512);
    ssample = sb_take(&s);
    sb_str(&b, "{\"files\":[");
    for (unsigned i = 0; i < p->nfiles; i++) {
        snprintf(part, sizeof(part), "{\"path\":\"%s\",\"sample\":\"", p->io[i].rel);
        sb_str(&b, part);
        sb_str(&b, p->files[i].sample_b64);
        snprintf(part, sizeof(part), "\",\"size\":%" PRIu64 "},", p->io[i].size);
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
        hf_pub_finish(h, 0);
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
    char *url = hf_api_url(h, "tree", "global", "?recursive=false&expand=false");
    hf_req *r = url ? hf_req_new(h, "GET", url, "tree") : NULL;
    free(url);
    if (r == NULL) {
        hf_pub_finish(h, 0);
        return;
    }
    hf_req_go(h, r, pub_list_global_done, NULL);
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
        hf_pub_finish(h, 0);
        return;
    }
    pub_list_global(h);
}

static void pub_revision(hf_hub *h)
{
    char *url = hf_api_url(h, "revision", NULL, NULL);
    hf_req *r = url ? hf_req_new(h, "GET", url, "revision") : NULL;
    free(url);
    if (r == NULL) {
        hf_pub_finish(h, 0);
        return;
    }
    hf_req_go(h, r, pub_revision_done, NULL);
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
        hf_pub_finish(h, 1);
        return;
    }
    if (!missing) {
        set_error(h, "cannot read the Hub's step_count.json before publishing");
        hf_pub_finish(h, 0);
        return;
    }
    pub_revision(h);
}

static void pub_check(hf_hub *h)
{
    char *url = hf_resolve_url(h, "global/step_count.json");
    hf_req *r = url ? hf_req_new(h, "GET", url, "step_file") : NULL;
    free(url);
    if (r == NULL) {
        hf_pub_finish(h, 0);
        return;
    }
    r->follow = 1;
    r->api = 0;
    r->body_cap = STEPFILE_BODY_CAP;
    hf_req_go(h, r, pub_check_done, NULL);
}

static void pub_hash_after(pool_job *pj)
{
    hash_job *j = pj->arg;
    hf_hub *h = j->h;
    int ok = !pj->cancelled && j->ok;
    free(j);
    if (!ok || h->f.closing) {
        set_error(h, "cannot read the global of step %" PRIu64, h->pub.step);
        hf_pub_finish(h, 0);
        return;
    }
    pub_check(h);
}

void hf_pub_finish(hf_hub *h, int ok)
{
    pub_state *p = &h->pub;
    uint64_t step = p->step;

    for (unsigned i = 0; p->files && i < p->nfiles; i++)
        free(p->files[i].content);
    free(p->files);
    hub_set_publish_close(p->io, p->nfiles);
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
    if (!h->f.closing)
        h->cb.publish_done(h->app, step, ok ? NULL : h->st.last_error[0] ? h->st.last_error : "the Hub commit failed");
}

/* The files of a publish (hub_set_publish_open).  0, or -1 with the reason set. */
static int pub_open_files(hf_hub *h, pub_state *p, const char *global_path)
{
    dl_error err = {0};

    p->sharded = st_index_is_index_path(global_path);
    if (hub_set_publish_open(global_path, &p->io, &p->nfiles, &err) != 0) {
        set_error(h, "publishing step %" PRIu64 ": %s", p->step, err.message);
        return -1;
    }
    if ((p->files = calloc(p->nfiles, sizeof(*p->files))) == NULL)
        return -1;
    return 0;
}

/* pub->record_path is not published here yet: --signing-key with hf:// is refused (config_modes.c). */
void hf_publish(hub *base, const hub_publication *pub)
{
    uint64_t step = pub->step;
    const char *global_path = pub->global_path, *optimizer = pub->optimizer;
    int bootstrap = pub->bootstrap;
    hf_hub *h = (hf_hub *)base;
    pub_state *p = &h->pub;
    hash_job *j;

    if (p->active || h->f.closing)
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
        hf_pub_finish(h, 0);
        return;
    }
    p->stepfile = stepcount_build(step, optimizer, bootstrap, p->sharded, NULL);
    j = calloc(1, sizeof(*j));
    if (p->stepfile == NULL || j == NULL) {
        free(j);
        hf_pub_finish(h, 0);
        return;
    }
    j->h = h;
    if (remote_fetch_job(&h->f, pub_hash_work, pub_hash_after, j) != 0) {
        free(j);
        hf_pub_finish(h, 0);
    }
}
