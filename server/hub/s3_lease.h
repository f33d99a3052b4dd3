/* s3_lease: the one lease/claim primitive of the bucket's writers, for the loop's asynchronous client
 * (a step's publish claim, hub_s3_publish.c) and the cluster's blocking one (a shard's claim and the
 * publish claim, s3_cluster_shard.c and s3_cluster.c).  Each drives its own requests; what an answer
 * means is decided here, once.
 *
 * A claim is an object created with If-None-Match: * (of several writers exactly one succeeds), renewed
 * and taken over with If-Match on the ETag last read or written.  A 412 is ambiguous (another holds it,
 * or our own retried PUT met its first attempt): it is settled by reading the claim back and comparing
 * its bytes with what we wrote.  Another's claim is honoured for `lease` seconds after its last write,
 * timed by the server (its Last-Modified against the Date of the same answer: no local clock, so no
 * skew) or, when either is missing or lies, by how long this very version (ETag and Last-Modified) has
 * been seen unchanged here, whichever is longer.  A claim's content is never trusted for timing. */
#ifndef S3_LEASE_H
#define S3_LEASE_H

#include <stddef.h>

/* What a conditional PUT of a claim (create, renew, take over) answered. */
typedef enum s3_lease_put {
    S3_LEASE_PUT_WRITTEN,       /* 200: ours, with the answer's ETag */
    S3_LEASE_PUT_READ_BACK,     /* 412: read the claim back, s3_lease_judge decides */
    S3_LEASE_PUT_FAILED,        /* anything else (no answer included): the caller's retry policy */
} s3_lease_put;

/* A claim read back. */
typedef enum s3_lease_verdict {
    S3_LEASE_OURS,              /* the bytes we wrote (or our instance's): an answer we lost, or a restart */
    S3_LEASE_LIVE,              /* another's, within its lease (or without an ETag to take it over by) */
    S3_LEASE_EXPIRED,           /* another's, its lease over: take it over with If-Match on its ETag */
} s3_lease_verdict;

/* The foreign version last seen, and since when (the caller's monotonic seconds). */
typedef struct s3_lease_seen {
    char version[240];
    double since;
} s3_lease_seen;

s3_lease_put s3_lease_after_put(long status);

/* Seconds from an answer's Last-Modified to its Date, by the server's clock; -1 when either is missing
 * or unreadable. */
double s3_lease_server_age(const char *last_modified, const char *date);

/* The age of a foreign claim's version at now: the server's age, or how long seen unchanged here
 * (seen is updated when the version changed), whichever is longer. */
double s3_lease_age(s3_lease_seen *seen, const char *etag, const char *last_modified, const char *date, double now);

/* A claim read back (read, read_len) against the one we wrote (mine, mine_len; 0 when we wrote none
 * yet): ours when the bytes are equal or ours_by_instance (the caller found its instance id in it),
 * else live or expired by age against lease; never expired without an ETag to take it over by. */
s3_lease_verdict s3_lease_judge(const void *read, size_t read_len, const void *mine, size_t mine_len,
                                int ours_by_instance, double age, double lease, const char *etag);

#endif
