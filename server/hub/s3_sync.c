#include "s3_sync.h"

#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <time.h>
#include <unistd.h>

#include <curl/curl.h>

#include "curl_uv_aws.h"
#include "dl_log.h"
#include "remote_fetch.h"

#define ERROR_BODY_CAP (64u << 10)

int s3s_init(s3s_client *c, const s3_access *a, const atomic_int *stop)
{
    memset(c, 0, sizeof(*c));
    c->a = *a;
    c->stop = stop;
    c->retry_for = 120;
    if ((c->curl = curl_easy_init()) == NULL)
        return -1;
    return 0;
}

void s3s_free(s3s_client *c)
{
    if (c->curl != NULL)
        curl_easy_cleanup(c->curl);
    c->curl = NULL;
}

static void body_reset(sbuf *b)
{
    free(b->p);
    memset(b, 0, sizeof(*b));
}

void s3s_resp_free(s3s_resp *r)
{
    body_reset(&r->body);
    memset(r, 0, sizeof(*r));
}

typedef struct xfer {
    s3s_client *c;
    const s3s_req *q;
    s3s_resp *r;
    size_t sent;                /* of a memory body */
    uint64_t file_sent;
    int failed;                 /* the body could not be kept (cap, file write) */
    char why[160];
} xfer;

static size_t on_header(char *p, size_t size, size_t n, void *arg)
{
    xfer *t = arg;
    size_t len = size * n;
    const char *v;
    size_t vl;
    struct { const char *name; char *out; size_t cap; } want[] = {
        {"etag:", t->r->etag, sizeof(t->r->etag)},
        {"last-modified:", t->r->last_modified, sizeof(t->r->last_modified)},
        {"date:", t->r->date, sizeof(t->r->date)},
    };
    if (len >= 5 && strncmp(p, "HTTP/", 5) == 0) {
        /* a new answer (after a 100 Continue, or a retry): forget the last one's headers */
        t->r->etag[0] = t->r->last_modified[0] = t->r->date[0] = '\0';
        t->r->has_total = 0;
        return len;
    }
    if (len > 15 && strncasecmp(p, "content-range:", 14) == 0) {
        /* bytes a-b/T: the object's size */
        const char *slash = memchr(p, '/', len);
        char num[24];
        size_t k = 0;
        for (const char *q = slash ? slash + 1 : p + len; q < p + len && *q >= '0' && *q <= '9' && k + 1 < sizeof(num); q++)
            num[k++] = *q;
        num[k] = '\0';
        if (k > 0 && k < 20) {
            t->r->total = strtoull(num, NULL, 10);
            t->r->has_total = 1;
        }
        return len;
    }
    if (len > 16 && strncasecmp(p, "content-length:", 15) == 0 && !t->r->has_total) {
        char num[24];
        size_t k = 0;
        for (const char *q = p + 15; q < p + len && k + 1 < sizeof(num); q++)
            if (*q >= '0' && *q <= '9')
                num[k++] = *q;
        num[k] = '\0';
        if (k > 0 && k < 20)
            t->r->total = strtoull(num, NULL, 10);
        return len;
    }
    for (size_t i = 0; i < sizeof(want) / sizeof(want[0]); i++) {
        size_t nl = strlen(want[i].name);
        if (len <= nl || strncasecmp(p, want[i].name, nl) != 0)
            continue;
        v = p + nl;
        vl = len - nl;
        while (vl > 0 && (*v == ' ' || *v == '\t'))
            v++, vl--;
        while (vl > 0 && (v[vl - 1] == '\r' || v[vl - 1] == '\n' || v[vl - 1] == ' '))
            vl--;
        if (i == 0) {
            if (s3_clean_etag(v, vl, want[i].out, want[i].cap) != 0)
                want[i].out[0] = '\0';
        } else if (vl < want[i].cap) {
            memcpy(want[i].out, v, vl);
            want[i].out[vl] = '\0';
        }
    }
    return len;
}

static size_t on_body(char *p, size_t size, size_t n, void *arg)
{
    xfer *t = arg;
    size_t len = size * n;
    long status = 0;

    curl_easy_getinfo(t->c->curl, CURLINFO_RESPONSE_CODE, &status);
    /* a file receives only a successful answer's bytes, and never past the range */
    if (t->q->dst_fd >= 0 && status >= 200 && status < 300) {
        if (t->r->got + len > t->q->range_len) {
            snprintf(t->why, sizeof(t->why), "the answer is longer than the %" PRIu64 " bytes asked for",
                     t->q->range_len);
            t->failed = 1;
            return 0;
        }
        for (size_t done = 0; done < len;) {
            ssize_t w = pwrite(t->q->dst_fd, p + done, len - done, (off_t)(t->q->dst_off + t->r->got + done));
            if (w < 0 && errno == EINTR)
                continue;
            if (w <= 0) {
                snprintf(t->why, sizeof(t->why), "writing the local copy: %s", strerror(w < 0 ? errno : EIO));
                t->failed = 1;
                return 0;
            }
            done += (size_t)w;
        }
    } else {
        size_t cap = t->q->dst_fd >= 0 || status < 200 || status >= 300 ? ERROR_BODY_CAP : t->q->body_cap;
        if (t->r->body.len + len > cap) {
            snprintf(t->why, sizeof(t->why), "the answer is larger than %zu bytes", cap);
            t->failed = 1;
            return 0;
        }
        sb_add(&t->r->body, p, len);
        if (t->r->body.oom) {
            snprintf(t->why, sizeof(t->why), "out of memory");
            t->failed = 1;
            return 0;
        }
    }
    t->r->got += len;
    atomic_fetch_add(&t->c->bytes_in, len);
    return len;
}

static size_t on_read(char *p, size_t size, size_t n, void *arg)
{
    xfer *t = arg;
    size_t cap = size * n;

    if (t->q->src_fd >= 0) {
        uint64_t left = t->q->src_len - t->file_sent;
        size_t want = left < cap ? (size_t)left : cap;
        if (want == 0)
            return 0;
        ssize_t got = pread(t->q->src_fd, p, want, (off_t)t->file_sent);
        if (got <= 0) {
            snprintf(t->why, sizeof(t->why), "reading the file to upload: %s", got < 0 ? strerror(errno) : "short");
            t->failed = 1;
            return CURL_READFUNC_ABORT;
        }
        t->file_sent += (uint64_t)got;
        atomic_fetch_add(&t->c->bytes_out, (uint64_t)got);
        return (size_t)got;
    }
    size_t left = t->q->body_len - t->sent;
    size_t k = left < cap ? left : cap;
    memcpy(p, (const char *)t->q->body + t->sent, k);
    t->sent += k;
    atomic_fetch_add(&t->c->bytes_out, k);
    return k;
}

static int on_progress(void *arg, curl_off_t dt, curl_off_t dn, curl_off_t ut, curl_off_t un)
{
    xfer *t = arg;
    (void)dt, (void)dn, (void)ut, (void)un;
    return t->c->stop != NULL && atomic_load(t->c->stop) ? 1 : 0;
}

static char *object_url(const s3s_client *c, const s3s_req *q)
{
    char *key = NULL, *url;

    if (q->rel != NULL) {
        size_t pl = strlen(c->a.prefix), rl = strlen(q->rel);
        if ((key = malloc(pl + rl + 2)) == NULL)
            return NULL;
        if (pl > 0)
            snprintf(key, pl + rl + 2, "%s/%s", c->a.prefix, q->rel);
        else
            memcpy(key, q->rel, rl + 1);
    }
    url = s3_url(c->a.endpoint, c->a.bucket, c->a.virtual_host, key, q->query);
    free(key);
    return url;
}

/* One attempt: 0 with an answer in r, -1 without (t.why says why). */
static int attempt(s3s_client *c, const s3s_req *q, const char *url, s3s_resp *r, char *why, size_t why_size)
{
    CURL *e = c->curl;
    struct curl_slist *hl = NULL;
    char line[200];
    xfer t = {.c = c, .q = q, .r = r};
    int rc = 0;

    body_reset(&r->body);
    r->status = 0;
    r->got = 0;
    r->etag[0] = r->last_modified[0] = r->date[0] = '\0';
    curl_easy_reset(e);
    curl_easy_setopt(e, CURLOPT_URL, url);
    curl_easy_setopt(e, CURLOPT_NOSIGNAL, 1L);
    curl_easy_setopt(e, CURLOPT_CONNECTTIMEOUT, 10L);
    curl_easy_setopt(e, CURLOPT_LOW_SPEED_LIMIT, 1L);
    curl_easy_setopt(e, CURLOPT_LOW_SPEED_TIME, 30L);
    curl_easy_setopt(e, CURLOPT_FOLLOWLOCATION, 0L);
    curl_easy_setopt(e, CURLOPT_PROTOCOLS_STR, "http,https");
    curl_easy_setopt(e, CURLOPT_HEADERFUNCTION, on_header);
    curl_easy_setopt(e, CURLOPT_HEADERDATA, &t);
    curl_easy_setopt(e, CURLOPT_WRITEFUNCTION, on_body);
    curl_easy_setopt(e, CURLOPT_WRITEDATA, &t);
    curl_easy_setopt(e, CURLOPT_NOPROGRESS, 0L);
    curl_easy_setopt(e, CURLOPT_XFERINFOFUNCTION, on_progress);
    curl_easy_setopt(e, CURLOPT_XFERINFODATA, &t);
    aws_sigv4_setopt(e, c->a.region, c->a.key_id, c->a.secret);
    if (strcmp(q->method, "PUT") == 0) {
        uint64_t len = q->src_fd >= 0 ? q->src_len : q->body_len;
        curl_easy_setopt(e, CURLOPT_UPLOAD, 1L);
        curl_easy_setopt(e, CURLOPT_READFUNCTION, on_read);
        curl_easy_setopt(e, CURLOPT_READDATA, &t);
        curl_easy_setopt(e, CURLOPT_INFILESIZE_LARGE, (curl_off_t)len);
        /* libcurl's SigV4 signs the length it is given here */
        curl_easy_setopt(e, CURLOPT_POSTFIELDSIZE_LARGE, (curl_off_t)len);
        if (s3_payload_header(q->src_fd >= 0 ? S3_PAYLOAD_FILE : S3_PAYLOAD_MEMORY, q->body, q->body_len, line) != 0) {
            snprintf(why, why_size, "hashing the body failed");
            return -1;
        }
        hl = curl_slist_append(hl, line);
    } else {
        s3_payload_header(S3_PAYLOAD_NONE, NULL, 0, line);
        hl = curl_slist_append(hl, line);
        if (strcmp(q->method, "HEAD") == 0)
            curl_easy_setopt(e, CURLOPT_NOBODY, 1L);
        else if (strcmp(q->method, "DELETE") == 0)
            curl_easy_setopt(e, CURLOPT_CUSTOMREQUEST, "DELETE");
    }
    if (q->range_len > 0) {
        snprintf(line, sizeof(line), "Range: bytes=%" PRIu64 "-%" PRIu64, q->range_off, q->range_off + q->range_len - 1);
        hl = curl_slist_append(hl, line);
    }
    if (q->if_match != NULL) {
        snprintf(line, sizeof(line), "If-Match: \"%s\"", q->if_match);
        hl = curl_slist_append(hl, line);
    }
    if (q->if_none_match)
        hl = curl_slist_append(hl, "If-None-Match: *");
    curl_easy_setopt(e, CURLOPT_HTTPHEADER, hl);
    atomic_fetch_add(&c->requests, 1);
    CURLcode cc = curl_easy_perform(e);
    curl_slist_free_all(hl);
    if (t.failed) {
        /* an answer we refuse to keep (over its cap, longer than asked, not writable here): no retry brings
         * another; its status says what the server answered */
        snprintf(why, why_size, "%s", t.why);
        curl_easy_getinfo(e, CURLINFO_RESPONSE_CODE, &r->status);
        return -2;
    }
    if (cc != CURLE_OK) {
        snprintf(why, why_size, "%s", curl_easy_strerror(cc));
        r->status = 0;
        return -1;
    }
    curl_easy_getinfo(e, CURLINFO_RESPONSE_CODE, &r->status);
    if (q->dst_fd >= 0 && r->status >= 200 && r->status < 300 && r->got != q->range_len) {
        snprintf(why, why_size, "the answer held %" PRIu64 " of the %" PRIu64 " bytes asked for", r->got, q->range_len);
        rc = -1;
    }
    return rc;
}

static void pause_for(const s3s_client *c, double seconds)
{
    for (double waited = 0; waited < seconds; waited += 0.05) {
        if (c->stop != NULL && atomic_load(c->stop))
            return;
        struct timespec ts = {0, 50 * 1000 * 1000};
        nanosleep(&ts, NULL);
    }
}

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec / 1e9;
}

int s3s_do(s3s_client *c, const s3s_req *q, s3s_resp *r, char *why, size_t why_size)
{
    char *url = object_url(c, q);
    double start = now_s(), wait = 0.25;
    int rc;

    memset(r, 0, sizeof(*r));
    if (url == NULL) {
        snprintf(why, why_size, "out of memory");
        return -1;
    }
    for (;;) {
        rc = attempt(c, q, url, r, why, why_size);
        if (rc == -2) {
            rc = -1;
            break;
        }
        int again = rc != 0 || r->status == 408 || r->status == 429 || r->status >= 500;
        if (!again)
            break;
        if (rc == 0)
            s3s_describe(r, why, why_size);
        dl_log(DL_LOG_DEBUG, "cluster", "s3 request failed", "method=%s key=%s why=%s", q->method,
               q->rel ? q->rel : "(bucket)", why);
        if ((c->stop != NULL && atomic_load(c->stop)) || now_s() - start + wait > c->retry_for) {
            rc = -1;
            break;
        }
        atomic_fetch_add(&c->retries, 1);
        pause_for(c, wait);
        wait = wait * 2 > 8 ? 8 : wait * 2;
    }
    free(url);
    return rc;
}

void s3s_describe(const s3s_resp *r, char *out, size_t size)
{
    char code[64], msg[160];
    if (r->status == 0)
        snprintf(out, size, "no answer");
    else if (s3_parse_error(r->body.p, r->body.len, code, sizeof(code), msg, sizeof(msg)) && code[0])
        snprintf(out, size, "HTTP %ld %s%s%s", r->status, code, msg[0] ? ": " : "", msg);
    else
        snprintf(out, size, "HTTP %ld", r->status);
}
