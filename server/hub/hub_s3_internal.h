/* hub_s3_internal: what hub_s3.c (requests, polling, adoption, lifecycle), hub_s3_list.c (the listing) and
 * hub_s3_publish.c (claims, uploads, multipart, step_count.json, the other layout's cleanup) share of
 * the s3:// transport: its handle and the request helpers.  Private to those three files
 * (tests/tools/lint-layers.sh). */
#ifndef HUB_S3_INTERNAL_H
#define HUB_S3_INTERNAL_H

#include <stddef.h>
#include <stdint.h>

#include "curl_uv.h"
#include "delta.h"
#include "s3_lease.h"
#include "hub.h"
#include "hub_s3.h"
#include "hub_set.h"
#include "remote.h"
#include "remote_fetch.h"
#include "st_index.h"

#define MAX_BACKOFF REMOTE_MAX_BACKOFF
#define STEPFILE_CAP (64u << 10)
#define MAX_LIST_PAGES 1000

typedef struct s3_hub s3_hub;
typedef remote_req s3_req;         /* remote.h: the retrying request */
typedef void (*s3_req_cb)(s3_hub *h, s3_req *r, int ok);

/* One object of a publish: the plain global, or a shard or the index of a sharded one. */
typedef hub_pub_file pub_file;

typedef struct pub_state {
    int active;
    uint64_t step;
    char optimizer[32];
    int bootstrap;
    int sharded;
    pub_file *files;            /* in upload order: the step's signed record (its .sig, then the .json:
                                   nrecords of them, --signing-key), the shards, then the index (or the one file) */
    unsigned nfiles, cur, nrecords;
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
    s3_lease_seen foreign;      /* the foreign claim's version, and since when (loop seconds) */
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
    uv_timer_t poll_timer;
    int polling;
    hub_status st;
    remote_fetch f;             /* the fetch pipeline (remote_fetch.h): requests, seen list, queue, sets, close */
    int64_t published_known;    /* the step last reported (remote_report_step) */
    best_entry *best;
    size_t nbest;
    shard_entry *shards;
    size_t nshards, shards_cap;
    int adopt_sharded;          /* the adoption in flight is of a sharded global */
    unsigned list_pages;
    uint64_t list_bytes;        /* listing bytes read this poll */
    uint64_t *list_tokens;      /* hashes of the continuation tokens of this poll (a repeat ends it) */
    char *resume_after;         /* where the next poll starts (start-after), NULL: at the top */
    char *node_boundary;        /* this poll: the last key before the current node's first, NULL: none */
    char *prev_key;             /* this poll: the last delta key considered */
    char cur_node[DELTA_NODE_ID_MAX + 1];   /* this poll: the node of prev_key */
    size_t cur_node_shards;     /* its shards remembered */
    uint64_t list_waiting;      /* this poll, async: deltas beyond a node's per-poll cap (the next polls') */
    size_t cur_node_in_flight;  /* this poll, async: the current node's deltas listed and not decided yet */
    int list_full;              /* a table filled: the poll ends at node_boundary */
    pub_state pub;
    unsigned pub_gen;
    double claim_lease;         /* seconds */
    uv_timer_t claim_timer;     /* waits out a foreign claim's lease, or renews ours */
    uint64_t claim_waits;       /* foreign live claims waited out (each one once per publish is logged) */
    void (*close_done)(void *);
    void *close_arg;
};

/* key NULL: the bucket; query canonical (s3_list_query, or hand-sorted).  Messages name the key. */
s3_req *s3_req_new(s3_hub *h, const char *method, const char *key, const char *query, const char *route);
/* cb, of this transport's type, runs when r ends (remote_go). */
void s3_req_go(s3_hub *h, s3_req *r, s3_req_cb cb, void *arg);
/* <prefix>/<rel>, or rel when there is no prefix.  malloc'd. */
char *s3_full_key(const s3_hub *h, const char *rel);
/* "HTTP 403 InvalidAccessKeyId: ..." */
void s3_describe_answer(const cuv_xfer *x, char *out, size_t size);

/* A failure recorded in /status and logged when it changes (remote.h). */
#define set_error(h, ...) remote_error(&(h)->f.rm, __VA_ARGS__)

/* hub_s3.c: the end of a poll (downloads whose wait is over requeued, the fetch pipeline pumped). */
void s3_poll_finish(s3_hub *h);
/* hub_s3_list.c: the listing walk's state dropped; the nodes/ listing's page after token (NULL: the
 * first, or after the node boundary where the last poll stopped). */
void s3_best_reset(s3_hub *h);
void s3_list_page(s3_hub *h, const char *token);

/* hub_s3_publish.c: hub_ops.publish; the end of a publish (error NULL: published); a poll saw the
 * bucket's step (a claim waited on is over once the bucket reached its step). */
void s3_publish(hub *base, const hub_publication *pub);
void s3_pub_finish(s3_hub *h, const char *error);
void s3_claim_step_seen(s3_hub *h, int64_t step);

#endif
