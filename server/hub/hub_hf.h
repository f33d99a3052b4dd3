/* hub_hf: the hf:// transport, a Hugging Face Hub repo spoken to over its HTTP API
 * (its protocol is summarised in README.md, "Through a Hugging Face Hub repo") with libcurl multi
 * inside the libuv loop.
 *
 * Polling: the revision sha every poll interval; the nodes/ tree (all pages, following Link) only
 * when the sha moved.  A new delta path (strict parse_delta_path) is first peeked at with a Range
 * request for its header: deltas based on an older step are never downloaded.  The others are
 * downloaded (bounded parallelism, Range resume after a failure) into cache/incoming, verified
 * against the listing's size and sha256 (LFS) or git blob sha1, and handed to the daemon, which
 * validates them like file:// deltas.  (path, oid) pairs already handled are remembered in
 * <state>/hub_seen.tsv, so nothing is downloaded twice, also across restarts.
 *
 * Publishing: ONE commit per outer step with global/latest.safetensors (LFS, basic or multipart as
 * the server says) and global/step_count.json (inline), with parentCommit; 412 re-reads the head and
 * retries the commit, 429 waits for Retry-After / RateLimit t, 5xx and network errors retry with
 * exponential backoff and jitter.  A step whose step_count.json is already on the Hub is not
 * committed again (a restart in the middle of a publish).
 *
 * Every answer is treated as hostile: the token goes only to the endpoint's scheme, host and port
 * (Link pages, LFS verify URLs and redirects elsewhere get none), sizes in listings must be exact
 * integers, a download may not grow past its listed size, a delta's header must fit the header cap
 * and describe exactly the listed size before the delta is downloaded, and JSON answers are capped
 * in size. */
#ifndef HUB_HF_H
#define HUB_HF_H

#include <stdint.h>
#include <time.h>

#include <uv.h>

typedef struct hf_hub hf_hub;

typedef struct hf_callbacks {
    /* A verified download of a current delta: the daemon takes it in (and removes local_path). */
    void (*delta_ready)(void *app, const char *rel, const char *local_path);
    /* The Hub's published step (from global/step_count.json) when first known or changed; -1 once
     * when the Hub has no step file at all. */
    void (*published_seen)(void *app, int64_t step);
    /* A downloaded, verified copy of the Hub's global at step (for adoption); the daemon owns the file. */
    void (*global_ready)(void *app, uint64_t step, const char *local_path);
    /* A publish finished: ok, or gave up this attempt (it is retried by the next hf_publish). */
    void (*publish_done)(void *app, uint64_t step, int ok);
} hf_callbacks;

typedef struct hf_config {
    const char *endpoint;       /* https://huggingface.co */
    const char *repo;           /* ns/name */
    const char *revision;       /* main */
    const char *token;          /* may be NULL */
    const char *state_dir;      /* for cache/incoming and hub_seen.tsv */
    double poll_interval;
    unsigned max_downloads;
    uint64_t max_header_bytes;  /* cap on a delta's safetensors header (0: the format's own cap) */
} hf_config;

typedef struct hf_status {
    time_t last_poll, last_publish;
    char head[48];              /* last revision sha seen */
    char last_error[256];
    uint64_t errors, api_calls, resolver_calls, downloads;
    int publishing;
} hf_status;

/* Parses "hf://ns/repo[@revision]".  repo and rev are malloc'd. */
int hf_parse_url(const char *url, char **repo, char **rev);
hf_hub *hf_open(uv_loop_t *loop, const hf_config *cfg, const hf_callbacks *cb, void *app);
/* The current outer step: deltas based on older steps are not downloaded; waiting (no global yet)
 * asks for the Hub's global instead. */
void hf_set_step(hf_hub *h, uint64_t step, int waiting_for_global);
/* Starts polling now and every poll interval. */
void hf_start(hf_hub *h);
/* Publishes step (its global file at global_path) as one commit; publish_done reports it. */
void hf_publish(hf_hub *h, uint64_t step, const char *global_path, const char *optimizer, int bootstrap);
/* Records that the daemon handled a delta (any outcome): it will not be downloaded again. */
void hf_mark_done(hf_hub *h, const char *rel);
const hf_status *hf_get_status(const hf_hub *h);
/* Cancels everything in flight and frees the hub; done(arg) when its handles are closed. */
void hf_close(hf_hub *h, void (*done)(void *), void *arg);

#endif
