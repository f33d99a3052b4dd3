/* remote_fetch: the fetch pipeline that the network transports (hub_hf.c, hub_s3.c) share, written
 * once (remote.h holds the retrying request and the seen list it uses).  A transport lists its
 * server its own way and turns what it finds into candidates (remote_cand); from there everything
 * is here:
 *   - the candidate queue (first in, first out) and the pump: at most max_downloads requests and
 *     verifies in flight; a failed candidate waits in the retry list, 1, 2, 4 ... 60 s with jitter
 *     after each failure, and goes back into the queue at a poll once its wait is over
 *     (remote_fetch_requeue_due); six failures give it up for this run (SEEN_REJECTED);
 *   - the peek: a ranged GET of a delta's first 64 KiB (never more than the listing's size), and the
 *     header judgment: a header over the cap, one that cannot fit the listed size or that describes
 *     another size is refused before the download; a delta of an older step is never downloaded (its
 *     version done for good), one of a later step is looked at again at later polls; any other (or a
 *     header the peek could not read) is downloaded and the intake decides;
 *   - the download: a ranged GET into a .part file of cache/incoming capped at the listed size,
 *     resumed with Range after a failure or a restart (a file complete before a restart asks for its
 *     last byte again, so the transport's conditions still hold); a server that ignores the Range, an
 *     answer 416 or one larger than the listing starts the file over; an answer 412 (the object
 *     changed since the listing: s3's If-Match) drops the candidate, the next listing has the new
 *     version;
 *   - the verify on the pool: the size, then the transport's algorithm (hf://: sha256 of an LFS file
 *     or the git blob sha1; s3://: MD5 when the ETag is a single-part upload's); a download that
 *     fails it is removed, logged at warn level and recorded, and tried again;
 *   - sets (hub_set.h): the index read whole into memory (the transport's own check of its text on
 *     the pool, then the parse), the base verdict, the wait for a listing with every shard, the byte
 *     budget, one candidate per shard, and the hand-over of the whole set;
 *   - the adoption hand-off: a verified global (a file, or a set's index) goes to global_ready,
 *     after the transport's optional confirmation (s3: the step file read again), through the
 *     remote_global_gate;
 *   - close by reference count: every request (remote.h), seen append, timer of the transport and
 *     pool job (counted by the job owner) holds a reference; once the transport closes and the last
 *     one is dropped, the transport's idle callback runs, once.
 * Logs name a candidate by its key (ops->name_field: "path=" on hf://, "key=" on s3://).
 * Everything here runs on the loop thread except the verify functions. */
#ifndef REMOTE_FETCH_H
#define REMOTE_FETCH_H

#include <stddef.h>
#include <stdint.h>

#include <uv.h>

#include "hub.h"
#include "hub_set.h"
#include "jobs.h"
#include "remote.h"

#define REMOTE_PEEK_BYTES 65536
#define REMOTE_MAX_ATTEMPTS_DOWNLOAD 6

typedef struct remote_fetch remote_fetch;

/* A file of a sharded set as the listing showed it. */
typedef struct remote_listed {
    char *key;                  /* as the transport names it (hf://: the path, s3://: the full key) */
    char tag[80];               /* its content id: the oid (hf://), the ETag (s3://) */
    uint64_t size;
    int lfs;                    /* hf://: tag is an LFS sha256 (else a git blob sha1) */
} remote_listed;

typedef struct remote_cand {
    char *rel;                  /* nodes/<id>/delta_<n>.safetensors, or global/..., under the transport's root */
    char *key;                  /* what the transport fetches, and logs name */
    char tag[80];               /* the listing's content id (remote_listed.tag) */
    int lfs;
    char ver[80];               /* the seen list's version: the tag, or a set's (remote_fetch_set_version) */
    uint64_t size;
    int is_set;                 /* an index: fetched, parsed, then its shards become candidates */
    remote_listed *listed;      /* is_set: the shards listed next to it */
    size_t nlisted;
    hub_set *set;               /* a shard: the set it belongs to */
    char *part;                 /* where it is downloaded */
    int attempts;
    uint64_t not_before;        /* loop ms: a failed one is not tried again before */
    int peeked;                 /* its header was looked at: download it */
    int is_global;              /* the transport's global, for adoption */
    uint64_t step;              /* is_global: the step its step file named */
    struct remote_cand *next;
} remote_cand;

/* What really differs between the transports' fetches. */
typedef struct remote_fetch_ops {
    const char *name_field;     /* the log field naming a candidate: "path", "key" */
    const char *downloaded_log; /* the debug line of a verified download */
    const char *set_prefix;     /* a set's directory name: <state>/cache/incoming/<prefix>... */
    /* A GET of c's object (the transport's URL and conditions), route static.  NULL: out of memory. */
    remote_req *(*get)(remote_fetch *f, const remote_cand *c, const char *route);
    /* The .part file a single download goes to, malloc'd (NULL: out of memory). */
    char *(*part_path)(remote_fetch *f, const remote_cand *c);
    /* On the pool, for a file of c->size bytes at c->part (open as fd): 0 when it is the one listed,
     * else -1 with why. */
    int (*verify_file)(const remote_cand *c, int fd, char *why, size_t size);
    /* Optional, on the pool: 0 when an index's text is the one listed. */
    int (*verify_index)(const remote_cand *c, const char *text, size_t len);
    /* Optional: a verified global goes through this before the hand-over; it takes c and ends it
     * with remote_fetch_global_ready or remote_fetch_global_failed. */
    void (*confirm_global)(remote_fetch *f, remote_cand *c);
    /* After close, when the last reference is dropped (once): the transport closes its curl handle
     * and frees itself. */
    void (*idle)(remote_fetch *f);
} remote_fetch_ops;

typedef struct remote_fetch_config {
    uv_loop_t *loop;
    cuv *curl;
    hub_status *st;             /* the transport's */
    const remote_ops *req_ops;
    const remote_fetch_ops *ops;
    void *owner;                /* the transport */
    const hub_callbacks *cb;
    void *app;
    const char *state_dir;      /* the transport's (not copied: it outlives the fetch) */
    const char *seen_path;
    double poll_interval;
    unsigned max_downloads;
    uint64_t max_header;
} remote_fetch_config;

struct remote_fetch {
    uv_loop_t *loop;
    const remote_fetch_ops *ops;
    void *owner;
    hub_status *st;
    hub_callbacks cb;
    void *app;
    const char *state_dir;
    double poll_interval;
    unsigned max_downloads;
    uint64_t max_header;        /* a delta's header cap */
    hub_limits limits;          /* the open round's model (hub_set_limits) */
    uint64_t step;              /* the daemon's (set_step) */
    int waiting;
    int closing;
    remote rm;                  /* requests: retries, failures, every one in flight */
    remote_seen seen;           /* every listed (path, version) looked at, the decided ones in a file */
    remote_global_gate gate;    /* the global last handed over: not fetched again at every poll */
    job_owner jobs;             /* pool jobs out (jobs.h): verifies, index parses, the publish's */
    remote_refs refs;           /* everything else in flight (requests, seen appends, timers) */
    int idle_done;
    remote_cand *queue, *retry; /* to peek or download; failed ones waiting */
    unsigned active;            /* peeks, downloads, index reads and verifies in flight */
    hub_set *sets;              /* sets whose shards are downloading */
    int global_download;        /* an adoption is in progress */
};

void remote_fetch_init(remote_fetch *f, const remote_fetch_config *cfg);
/* Frees the queues, the sets (their directories stay) and the seen list. */
void remote_fetch_free(remote_fetch *f);
/* Stops: nothing new starts, every request is cancelled; ops->idle runs when the last reference
 * is dropped (a transport holds one for each of its timers until their close callbacks). */
void remote_fetch_close(remote_fetch *f);
/* A reference of the transport's (a timer until it is closed). */
void remote_fetch_hold(remote_fetch *f);
void remote_fetch_release(remote_fetch *f);
/* Queues a pool job counted for the close (jobs.h's job_queue on f's owner). */
int remote_fetch_job(remote_fetch *f, pool_job_fn work, pool_job_fn done, void *arg);

/* A candidate (rel, key copied; tag and ver are tag).  NULL when out of memory. */
remote_cand *remote_cand_new(const char *rel, const char *key, const char *tag, uint64_t size);
void remote_cand_free(remote_cand *c);
void remote_listed_free(remote_listed *l, size_t n);
/* Appends a copy of e to *l (*n entries).  0, or -1 when out of memory (*l unchanged). */
int remote_listed_add(remote_listed **l, size_t *n, const remote_listed *e);

/* A set's version for the seen list (hub_set.h): the index's tag and every listed shard. */
int remote_fetch_set_version(const char *index_tag, const remote_listed *l, size_t n, char *out, size_t size);

/* Whether a listed (rel, version) is to become a candidate: 1 when it is new (*is_new set) or a
 * later round's delta looked at again, 0 when it is pending, done or given up for this run, -1 when
 * out of memory. */
int remote_fetch_wanted(const remote_fetch *f, const char *rel, const char *ver, int *is_new);
/* 1 when (rel, version) is a candidate the daemon has not decided yet (pending). */
int remote_fetch_in_flight(const remote_fetch *f, const char *rel, const char *ver);
/* A candidate was made of (rel, version): pending until the daemon decides it.  0, or -1 when out
 * of memory (no candidate then). */
int remote_fetch_pending(remote_fetch *f, const char *rel, const char *ver);

void remote_fetch_enqueue(remote_fetch *f, remote_cand *c);
/* Failed candidates whose wait is over go back into the queue. */
void remote_fetch_requeue_due(remote_fetch *f);
/* Starts queued candidates while fewer than max_downloads are in flight. */
void remote_fetch_pump(remote_fetch *f);

/* The transport's global as a candidate (is_global, step set): queued unless it was handed over
 * before and its backoff is not over (remote_global_gate).  Pumps. */
void remote_fetch_offer_global(remote_fetch *f, remote_cand *c);
/* The adoption was given up (its listing, download or set): the next poll starts it over, listing
 * again even where the transport's head did not move. */
void remote_fetch_global_given_up(remote_fetch *f);
/* A verified global (c->part: the file, or a set's index) to the daemon; frees c. */
void remote_fetch_global_ready(remote_fetch *f, remote_cand *c);
/* A verified global that is not to be handed over: its file (or set directory) removed, the adoption
 * given up; frees c. */
void remote_fetch_global_failed(remote_fetch *f, remote_cand *c);

/* hub_ops.mark_done: remote_seen_decided. */
int remote_fetch_mark_done(remote_fetch *f, const char *rel, hub_outcome outcome);

/* Digests for the verify functions.  hex gets the lower-case digest. */
typedef enum remote_digest { REMOTE_SHA256, REMOTE_SHA1, REMOTE_MD5 } remote_digest;
/* The digest of head (may be NULL) then of fd read from its offset to its end.  0 or -1. */
int remote_hash_fd(int fd, remote_digest alg, const void *head, size_t head_len, char *hex, size_t hex_size);
int remote_hash_mem(const void *p, size_t len, remote_digest alg, const void *head, size_t head_len, char *hex,
                    size_t hex_size);

#endif
