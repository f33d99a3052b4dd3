/* s3_sync: a blocking S3 client for one thread of its own (a cluster's, s3_cluster.h): libcurl's easy
 * interface with SigV4 (CURLOPT_AWS_SIGV4), one connection kept alive between requests.  The loop's
 * transports use curl_uv and remote.c instead; what both share is s3_api (URLs, listing and error
 * parsers) and the answer's headers (ETag cleaned by s3_clean_etag).
 *
 * Every answer is hostile: a body read into memory is capped (body_cap), one read into a file is
 * capped at the range asked for and must be exactly that long, and no answer is followed elsewhere
 * (no redirects).  A request without an answer, or answered 408, 429 or 5xx, is tried again after a
 * doubling wait (0.25 s .. 8 s) until retry_for seconds have passed or the stop flag is set; a
 * conditional PUT so retried may meet its own first attempt (412): its caller reads back and compares. */
#ifndef S3_SYNC_H
#define S3_SYNC_H

#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#include "hub_s3.h"
#include "strbuf.h"

typedef struct s3s_client {
    void *curl;                 /* CURL * */
    s3_access a;                /* borrowed from the transport */
    char *userpwd;
    const atomic_int *stop;     /* set: no retry starts, and a request in flight is aborted */
    double retry_for;           /* seconds a request is retried at most */
    atomic_uint_fast64_t bytes_in, bytes_out;   /* body bytes received and sent */
    atomic_uint_fast64_t requests, retries;
} s3s_client;

typedef struct s3s_req {
    const char *method;         /* GET, PUT, HEAD, DELETE */
    const char *rel;            /* the key under the transport's prefix; NULL: the bucket (a listing) */
    const char *query;          /* canonical (s3_list_query), or NULL */
    const char *if_match;       /* an ETag (without quotes), or NULL */
    int if_none_match;          /* If-None-Match: * */
    uint64_t range_off, range_len;      /* range_len 0: the whole object */
    const void *body;           /* PUT from memory */
    size_t body_len;
    int src_fd;                 /* PUT from a file (>= 0): src_len bytes from offset 0 */
    uint64_t src_len;
    int dst_fd;                 /* GET into a file (>= 0) at dst_off: exactly range_len bytes */
    uint64_t dst_off;
    size_t body_cap;            /* GET into memory: at most this many bytes (more: an error) */
} s3s_req;

#define S3S_REQ_INIT {.src_fd = -1, .dst_fd = -1}

typedef struct s3s_resp {
    long status;                /* 0: no answer */
    char etag[80];
    char last_modified[64];
    char date[64];
    sbuf body;                  /* GET into memory, and error documents */
    uint64_t got;               /* body bytes of this answer */
    uint64_t total;             /* a ranged answer's object size (Content-Range), else its Content-Length */
    int has_total;
} s3s_resp;

/* 0: the client is ready (a copy of a's credentials kept); -1 when out of memory. */
int s3s_init(s3s_client *c, const s3_access *a, const atomic_int *stop);
void s3s_free(s3s_client *c);
/* Runs q.  0 when an answer came (any status: r->status says which), -1 when none did within the
 * retries, or one came that is not kept (over its cap, longer than asked, a file body not written:
 * r->status is its status, and it is not retried); why says so.  r is reset first; s3s_resp_free after. */
int s3s_do(s3s_client *c, const s3s_req *q, s3s_resp *r, char *why, size_t why_size);
void s3s_resp_free(s3s_resp *r);
/* "HTTP 412 PreconditionFailed: ..." of an answer, for logs. */
void s3s_describe(const s3s_resp *r, char *out, size_t size);

#endif
