/* remote: what the network transports (hub_hf.c, hub_s3.c) share of talking to their server, written
 * once so that the two cannot drift apart:
 *   - the retrying request: one policy for what counts as success (a 2xx answer), what is tried
 *     again (no answer, 408, 429, 5xx), how long to wait (the server's Retry-After, else an
 *     exponential backoff with jitter, at most REMOTE_MAX_BACKOFF) and how often (max_attempts: a
 *     request never retries for ever; a publish that fails is tried again whole by the daemon, with
 *     its own backoff, for the newest step);
 *   - failures recorded in the transport's hub_status (last_error, errors) and logged at error
 *     level when they change, not at every poll that repeats them.
 * A transport supplies a small table (remote_ops): its credentials for each attempt (a bearer
 * token, a SigV4 signature), how it words a failed answer, optionally its own judgment of an answer
 * before the policy (hf://: access problems), and how to call a request's callback as it typed it.
 * A request held by remote_fetch.c ends through remote_go_done instead, and every request, and every
 * seen append, holds a reference (remote_refs) for a close that completes when the last one drops.
 *
 * The fetch pipeline built on these (remote_fetch.h) is the one both transports run.  Where their two
 * copies had drifted, one behaviour now holds for both:
 *   - candidates are taken first in, first out (hf:// took the newest first);
 *   - a peek asks for at most the listed size (s3:// asked for 64 KiB whatever the size), and a peek
 *     that cannot be sent gives the candidate up for the run (hf:// left it pending);
 *   - a part file complete before a restart asks for its last byte again, under the transport's
 *     conditions (hf:// got a 416 and started over), and a resumed download is logged on both;
 *   - a failed download or index read is recorded in words ("GET <key>: HTTP 404"; hf:// recorded
 *     only the retried ones), and a download that does not match the listing is logged at warn level
 *     and recorded once per change (hf:// wrote last_error without its log line);
 *   - a verify cut short by a stop keeps the file for the next start (hf:// removed it);
 *   - an answer 412 to a GET means the object changed since the listing: dropped for the run, the
 *     next listing has the new version (s3://'s If-Match; the Hub never answers one);
 *   - an index is read with two attempts, capped at its listed size (s3:// took three, capped at the
 *     index cap);
 *   - a set's directory is cache/incoming/<hf-|s3->[global-]<set version>-<key hash>.set on both (s3:// named it
 *     after the index's key);
 *   - a given-up adoption lists again at the next poll (hf:// cleared its head; s3:// has none);
 *   - downloads and download_bytes are counted on both;
 *   - the close is a reference count on both, no polling timer;
 *   - the published step is reported only when it changes, from "not reported yet" (-2) through none
 *     (-1) to a step, by remote_report_step (hf:// started at -1 and said "none" once per run).
 * Logs name a candidate by its key as the transport lists it ("path=" on hf://, "key=" on s3://).
 * Everything here runs on the loop thread. */
#ifndef REMOTE_H
#define REMOTE_H

#include <stddef.h>
#include <stdint.h>

#include <curl/curl.h>
#include <uv.h>

#include "curl_uv.h"
#include "hub.h"
#include "seen.h"

#define REMOTE_MAX_BACKOFF 60.0        /* seconds */

typedef struct remote remote;
typedef struct remote_req remote_req;

/* References of what is in flight, for a close that completes when the last one is dropped
 * (remote_fetch.h): each request holds one from remote_req_new until it is freed, each seen append
 * one until its write returns.  check runs after every drop that leaves none. */
typedef struct remote_refs {
    unsigned n;
    void (*check)(struct remote_refs *r);
} remote_refs;

void remote_ref(remote_refs *r);
void remote_unref(remote_refs *r);

typedef struct remote_ops {
    const char *failure_log;    /* the log line of a failure: "hub request failed", "s3 request failed" */
    /* Adds the transport's credentials (and what signing them needs) to one attempt.  0, or -1: the
     * attempt fails without being sent. */
    int (*authorize)(remote *rm, remote_req *r, cuv_xfer *x);
    /* Optional, before the policy: 1 when the transport has dealt with this answer itself (the
     * request then ends failed, and what its callback records as a failure is not: the transport
     * has said it in its own words), 0 to let the policy judge it. */
    int (*judge)(remote *rm, remote_req *r, const cuv_xfer *x);
    /* Optional, after a 2xx answer to a request with auth set. */
    void (*authorized)(remote *rm, remote_req *r);
    /* A failed answer in words for last_error and the log ("HTTP 503 SlowDown: ..."). */
    void (*describe)(const cuv_xfer *x, char *out, size_t size);
    /* Calls r's callback (remote_go's cb, of the transport's own type) with ok. */
    void (*complete)(remote *rm, remote_req *r, int ok);
} remote_ops;

struct remote {
    uv_loop_t *loop;
    cuv *curl;
    hub_status *st;             /* the transport's: call counts, errors, last_error */
    const remote_ops *ops;
    void *owner;                /* the transport */
    const int *closing;         /* the transport's closing flag: no attempt starts once it is set */
    size_t body_cap;            /* answers in memory are capped at this unless a request says (0: curl_uv's) */
    int quiet;                  /* failures are not recorded (the transport is saying one in its own words) */
    remote_req *inflight;       /* every request not ended, for close */
    remote_refs *refs;          /* optional: each request holds one */
};

typedef void (*remote_fn)(void);        /* a transport's callback type, cast back by ops->complete */

struct remote_req {
    remote *rm;
    char method[8];
    char *url;
    char *what;                 /* what messages name: the key, or the URL (remote_req_new's default) */
    const char *route;          /* static, for /metrics (dilocod_hub_requests_total{route,code}) */
    struct curl_slist *headers;
    char *body;                 /* memory body (has_body: sent even when empty) */
    size_t body_len;
    int has_body;
    int src_fd;                 /* file body (-1: none) */
    uint64_t src_off, src_len;
    int sink_fd;                /* file answer (-1: in memory); resumed by the caller, with max_attempts 1 */
    uint64_t sink_off, sink_max;
    int sink_capped;            /* sink_max applies */
    size_t body_cap;            /* the memory answer's cap (0: the remote's) */
    int auth;                   /* send the transport's credentials */
    int follow;                 /* follow redirects */
    int api;                    /* count as an API call (else a resolver call: storage, CDN) */
    int max_attempts, attempt;
    uv_timer_t timer;
    int timer_open;
    cuv_xfer *x;                /* the last attempt (valid in the callback) */
    remote_fn cb;
    void (*done)(remote_req *r, int ok);    /* remote_go_done's: called instead of ops->complete */
    void *arg;
    remote_req *next, *prev;
};

void remote_init(remote *rm, uv_loop_t *loop, cuv *curl, hub_status *st, const remote_ops *ops, void *owner,
                 const int *closing);
/* A request of method to url (copied); what NULL names it by its URL.  Five attempts, auth and api
 * set.  NULL when out of memory. */
remote_req *remote_req_new(remote *rm, const char *method, const char *url, const char *what, const char *route);
void remote_req_header(remote_req *r, const char *line);
/* A copy of data as the body.  0, or -1 when out of memory. */
int remote_req_body(remote_req *r, const char *data, size_t len);
/* Sends r; cb (the transport's type, cast to remote_fn) runs through ops->complete when it ends. */
void remote_go(remote_req *r, remote_fn cb, void *arg);
/* Sends r; done(r, ok) runs when it ends (r->arg is arg): for callers that are not the transport,
 * such as remote_fetch.c, which finds itself from r->rm. */
void remote_go_done(remote_req *r, void (*done)(remote_req *r, int ok), void *arg);
/* Takes r off the in-flight list and frees it (after its retry timer is closed). */
void remote_req_end(remote_req *r);
/* At close: stops every retry timer and cancels every transfer in flight (their callbacks run). */
void remote_cancel_all(remote *rm);

/* The seen list of a network transport: every listed (path, version) it has looked at, in memory
 * for this run (seen.h), and the ones decided for good appended to a file, so that a restart does not
 * download them again.  Each line of the file is "<path>\t<version>". */
typedef struct remote_seen {
    seen_map map;
    uv_loop_t *loop;
    int fd;                     /* the file, opened for appending (-1: decisions are kept for this run only) */
    remote_refs *refs;          /* optional: each append in flight holds one (the close waits for them) */
} remote_seen;

/* Loads path (every entry done) and opens it for appending; a file that cannot be read or opened
 * leaves the list in memory only. */
void remote_seen_open(remote_seen *s, uv_loop_t *loop, const char *path);
/* Closes the file and frees the list (no append may be in flight). */
void remote_seen_close(remote_seen *s);
/* "<rel>\t<version>", malloc'd (NULL when out of memory). */
char *remote_seen_key(const char *rel, const char *version);
/* rel's version is decided for good: done, and appended to the file once. */
void remote_seen_done(remote_seen *s, const char *rel, const char *version);
/* rel's version takes state for this run only (not written: a restart looks again). */
void remote_seen_set(remote_seen *s, const char *rel, const char *version, seen_state state);
/* hub_ops.mark_done: the daemon decided rel, so its pending versions are done for good (unless it
 * was our own failure, HUB_RETRY: they stay pending for this run).  1 when an HUB_INCOMPLETE outcome
 * is final (a download was verified against the listing, so one found short stays short). */
int remote_seen_decided(remote_seen *s, const char *rel, hub_outcome outcome);

/* The global a transport offers while the daemon waits for one.  A global handed over and then
 * asked for again was not adopted (its step out of bounds, its header over the cap, a damaged
 * file): the same version at the same step is downloaded again only after a backoff that doubles
 * from twice the poll interval up to REMOTE_GLOBAL_BACKOFF_MAX, so a planted global that can never be
 * adopted costs one download per backoff instead of one per poll.  Another version or step is
 * fetched at once. */
#define REMOTE_GLOBAL_BACKOFF_MAX 3600.0        /* seconds */
typedef struct remote_global_gate {
    char version[96];           /* the one last handed over ("": none) */
    uint64_t step;
    unsigned offers;            /* times in a row it was handed over */
    uint64_t not_before;        /* loop ms: not fetched again before */
} remote_global_gate;

/* 1 when the global of step and version may be downloaded at now_ms. */
int remote_global_may_fetch(const remote_global_gate *g, uint64_t step, const char *version, uint64_t now_ms);
/* The transport hands the global of step and version over (global_ready). */
void remote_global_handed(remote_global_gate *g, uint64_t step, const char *version, uint64_t now_ms,
                          double poll_interval);

/* The step a network transport last reported through published_seen: REMOTE_STEP_UNREPORTED until
 * its first readable poll, -1 when it found no step file, else the step.  One rule for both: a poll
 * reports only a change (a publish of ours sets it to its step first, so it is not reported back). */
#define REMOTE_STEP_UNREPORTED (-2)
/* Reports step (-1: none) through cb when it differs from *known, and records it.  1 when reported. */
int remote_report_step(int64_t *known, int64_t step, const hub_callbacks *cb, void *app);

/* Records a failure (counted each time, logged when it differs from the last one). */
void remote_error(remote *rm, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* An exponential backoff's step with jitter: base scaled by a factor in [0.75, 1.25). */
double remote_jittered(double base);

#endif
