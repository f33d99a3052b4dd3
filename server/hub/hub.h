/* hub: the transport interface.  A transport is where deltas come from and where the global goes:
 * a shared directory, a Hugging Face Hub repo, a bucket (the scheme table of hub.c lists them).  Every
 * transport implements all of it, asynchronously on the daemon's loop, with the same callbacks, so
 * the daemon has no branch on which transport it talks to.
 *
 * Adding a transport: one file (hub_<scheme>.c) that defines a `const hub_ops hub_<scheme>_ops`
 * with its option table (hub_options, below), plus one row in the scheme table of hub.c.
 *
 * The contract, for every transport:
 *   - open() prepares what must exist (a directory tree, a state subdirectory) and fails with a
 *     message if it cannot: startup fails before anything else is touched.
 *   - start() begins polling.  The first poll reports published_seen(): the step the transport
 *     holds (from global/step_count.json), or -1 when it holds none.  Later polls report it again
 *     only when it changes.
 *   - Each delta file found is handed over once per version with delta_ready().  The daemon takes it
 *     in and answers with hub_mark_done() and the outcome; a transport never hands over the same
 *     version again after HUB_TAKEN or HUB_INVALID, and always does after HUB_RETRY.
 *   - Sync mode needs a node's newest delta only; in async mode (hub_limits.async) every delta is an
 *     update: a transport hands over each one, in local-step order per node, a capped few per poll,
 *     the next poll going on where the last stopped (hub_status.deltas_waiting counts what waits).
 *   - While set_step(..., waiting_for_global = 1), the transport does not hand over deltas; when it
 *     holds a global it copies it into state_dir and reports global_ready() (the daemon owns the copy).
 *   - publish() writes global/latest.safetensors, then global/step_count.json (last, so a reader never
 *     sees a step whose model is not there), and reports publish_done() exactly once per call.  It
 *     need not wait for the model's data to be durable (file:// links the daemon's own file): the
 *     daemon publishes again a step it recovered from its redo record, even where the transport
 *     reports that step.
 *   - With a record (hub_publication.record_path: --signing-key), publish() writes the step's signed
 *     record first, global/rounds/<s>.json.sig then global/rounds/<s>.json, then the model and the step
 *     file as above: a reader never sees a step named without its record.
 *   - close() cancels what is in flight; done(arg) runs once every handle and job is finished.
 * Everything runs on the loop thread; blocking file work goes to the libuv pool inside the transport.
 *
 * Sharded checkpoints (the Hugging Face index + shards convention, common/st_index.h):
 *   - A sharded delta is nodes/<id>/delta_<n>.safetensors.index.json plus the shards its weight_map
 *     lists (delta_<n>-0000i-of-0000N.safetensors).  The transport hands it over once the index and
 *     every listed shard are there (a partial set waits), as ONE hub_delta whose rel and path are the
 *     index's: path's directory holds the shards under their own names (file://: the node directory of
 *     the shared tree; a download: a directory of its own holding only that set, which the daemon
 *     removes as a whole when owned).  mark_done, the version and prune name the index's rel; prune
 *     removes the index and its shards.
 *   - publish() with a global_path ending in ".safetensors.index.json" publishes a sharded global:
 *     the shards the index lists (in the index's directory, named latest-0000i-of-0000N.safetensors),
 *     then global/latest.safetensors.index.json, then step_count.json naming the index as model_file
 *     (stepcount_build(..., sharded = 1, ...)); files of the other layout (latest.safetensors, or
 *     shards of another count) are removed after step_count.json.  A plain path publishes as before
 *     and removes a previous sharded layout the same way.
 *   - A held global whose step_count.json names the index (stepcount_parse's *sharded) is copied or
 *     downloaded as the index plus its shards into a directory of its own in state_dir, and
 *     global_ready() gets the index's path (the daemon owns and removes that directory). */
#ifndef HUB_H
#define HUB_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <time.h>

#include <uv.h>

#include "dl_error.h"

typedef struct hub_ops hub_ops;
struct index_parse;

/* Every transport's handle starts with this (the transport's own struct embeds it first). */
typedef struct hub {
    const hub_ops *ops;
} hub;

/* The downlink's files of a step to publish beside its global (README, "The downlink"): the update of
 * step (NULL at the chain's first step, whose view is its global), the step's view (for a checkpoint
 * every keep/2 steps), the view's block hash in hex ("" unknown: the view is the global). */
typedef struct hub_downlink {
    const char *update_path;
    const char *view_path;
    uint64_t step, chain_from;
    unsigned keep;
    char view_hash[65];
} hub_downlink;

/* A delta file a transport hands to the daemon. */
typedef struct hub_delta {
    const char *rel;            /* nodes/<id>/delta_<n>.safetensors, as the transport lists it */
    const char *path;           /* where intake reads it */
    const char *root;           /* non-NULL: path is a file of this shared tree, which others write: intake
                                   reaches it from the root without following links (file://) */
    int owned;                  /* 1: a local copy (a download) that the daemon removes after intake */
    struct index_parse *index;  /* may be NULL: a set's index as the transport already read it
                                   (core/index_parse.h), which intake uses instead of reading the file again
                                   while it is that version; the daemon takes its own reference */
} hub_delta;

/* What became of a delta the transport handed over (hub_mark_done). */
typedef enum hub_outcome {
    HUB_TAKEN,                  /* decided for good: accepted, replaced, stale, future, duplicate, refused */
    HUB_INVALID,                /* refused by validation (the daemon counted and logged it) */
    HUB_INCOMPLETE,             /* shorter than its header says: it may still be being written */
    HUB_RETRY,                  /* our own failure (disk full, ...), or async mode's queue full (busy):
                                   hand it over again later, whichever transport */
} hub_outcome;

/* The version of a file that intake read (for transports that see files change in place). */
typedef struct hub_version {
    uint64_t size;
    int64_t mtime_ns;
    uint64_t ino;
} hub_version;

typedef struct hub_callbacks {
    void (*delta_ready)(void *app, const hub_delta *delta);
    /* The transport's published step when first known or changed; -1 when it holds none. */
    void (*published_seen)(void *app, int64_t step);
    /* A verified local copy of the transport's global at step, in state_dir (the daemon owns it). */
    void (*global_ready)(void *app, uint64_t step, const char *local_path);
    /* A publish() finished: error is NULL on success, else why this attempt failed. */
    void (*publish_done)(void *app, uint64_t step, const char *error);
} hub_callbacks;

/* The open round's model bounds what a network transport downloads before intake sees it: a
 * delta set's index and its shards together are refused from the listing's sizes, before a byte
 * is fetched (intake applies the same bounds again to what it reads). */
typedef struct hub_limits {
    size_t delta_index_bytes;   /* st_index_cap_for(model); 0: no model yet (ST_INDEX_MAX_BYTES) */
    uint64_t delta_set_bytes;   /* intake_set_budget(delta bytes, header cap); 0: no model yet (no bound) */
    uint64_t max_staleness;     /* a delta based this many steps before the current one is still taken: 0
                                   in sync mode, the bound (UINT64_MAX: none) in async mode */
    int async;                  /* async mode: every delta is an update, none supersedes another (a polled
                                   transport hands each over, in local-step order per node) */
    uint64_t min_base;          /* async: a base below it is stale whatever the bound (the daemon's applied
                                   set does not reach below it) */
} hub_limits;

/* Whether a delta based on base is too old for the round of step (hub_limits.max_staleness, min_base). */
static inline int hub_base_stale(const hub_limits *lim, uint64_t step, uint64_t base)
{
    return (base < step && step - base > lim->max_staleness) || base < lim->min_base;
}

typedef struct hub_config {
    const char *url;            /* <scheme>://... (hub_find accepted it) */
    const char *state_dir;      /* <state_root>/<id>: the transport's own files (downloads, lists) */
    double poll_interval;       /* seconds */
    unsigned max_downloads;     /* parallel downloads */
    uint64_t max_header_bytes;  /* cap on a delta's safetensors header (0: the format's own cap) */
    /* The transport's own options, its hub_options struct as its table and load() made it (config
     * time), or NULL: the transport's defaults.  Only the transport reads it. */
    const void *options;
} hub_config;

/* ---- a transport's options ----------------------------------------------------------------------
 * A transport declares its options in a table reached through hub_ops.options; the configuration
 * (server/config.c) reads them from the command line and the config file, lists them in --help and
 * prints them in --check-config through the table alone, into one struct per transport of the
 * transport's own type.  Only the struct of the transport --hub names is loaded (load(): the
 * environment's fallbacks and the checks) and handed to its open() as hub_config.options; a value
 * given for another transport's option is checked against the table, then unused.
 *
 * A key several transports declare (hub_endpoint) is one option: one value, set in each of their
 * structs; --help prints the first declarer's help, then " or " and each later declarer's. */
typedef enum hub_opt_type {
    HUB_OPT_STR,                /* char *: must not be empty */
    HUB_OPT_OPTSTR,             /* char *: may be unset (NULL); an empty value unsets it */
    HUB_OPT_UINT,               /* unsigned, in [min, max] */
} hub_opt_type;

typedef struct hub_option {
    const char *key;            /* the file key; the flag is "--" + key with '_' -> '-' */
    hub_opt_type type;
    size_t offset;              /* of the field in the transport's options struct */
    double min, max;            /* HUB_OPT_UINT's bounds */
    const char *deflt;          /* the default as it would be written in the file; NULL: unset */
    const char *help;           /* --help: the text after the flag ("URL     where ...") */
    const char *unset;          /* --check-config's note on an unset value; NULL: " (<schemes> only)" */
} hub_option;

typedef struct hub_options {
    const hub_option *opt;
    size_t n;
    size_t size;                /* of the options struct (calloc'd, then the table's defaults) */
    /* Optional.  Config time, when this transport is --hub's (its check_url accepted the URL):
     * fills what the environment supplies and checks the values together; nothing is created.  0,
     * or -DL_E_* with err saying why and *key naming the option to blame. */
    int (*load)(void *opts, const char *url, const char **key, dl_error *err);
    /* Optional: the note --check-config prints for key when it is unset, instead of the table's
     * (NULL: the table's). */
    const char *(*unset_note)(const void *opts, const char *key);
    /* Optional: comment lines --check-config prints after the transport's options (never a secret);
     * url is --hub's, whichever transport it names. */
    void (*print)(const void *opts, const char *url, FILE *out);
    /* Optional: frees what load() added beyond the table's string fields (which the caller frees). */
    void (*clear)(void *opts);
} hub_options;

/* Requests a transport made to its server, by route and status code (for /metrics). */
#define HUB_MAX_CALL_ROWS 48
typedef struct hub_call_count {
    const char *route;          /* a static name: "revision", "tree", "commit", ... */
    int code;                   /* HTTP status, or 0 when no answer came (network error) */
    uint64_t count;
} hub_call_count;

typedef struct hub_status {
    time_t last_poll, last_publish;     /* 0: never */
    char head[48];                      /* the revision last seen, if the transport has one */
    char last_error[256];
    uint64_t errors, api_calls, resolver_calls, downloads, download_bytes;
    uint64_t index_parses;              /* sharded deltas' indexes the transport read and parsed (file://: its scans) */
    uint64_t stale_skipped;             /* deltas judged stale from their header or index and never downloaded
                                           (the daemon counts them with its own stale ones) */
    uint64_t deltas_waiting;            /* async: deltas the last listing left for a later one (beyond a node's
                                           per-poll cap: they come in local-step order) */
    uint64_t deltas_deferred;           /* async: times a listing left a delta for a later one (a counter) */
    int publishing;
    time_t rate_reset_at;               /* when the server's rate budget resets, if it said (0: unknown) */
    hub_call_count calls[HUB_MAX_CALL_ROWS];
    unsigned ncalls;
    /* A lasting failure only the operator can fix, as a stable name for /status ("" when none):
     * "unauthorized" (401: the token is missing or invalid, or the repo is private or absent),
     * "forbidden" (403: the token may not do this), "gated" (403: the repo is gated),
     * "repo_not_found", "revision_not_found" (404).  last_error says it in words. */
    char problem[32];
} hub_status;

/* What publish() publishes. */
typedef struct hub_publication {
    uint64_t step;
    const char *global_path;    /* the model: a file, or a set's index */
    const char *optimizer;
    int bootstrap;
    /* the step's signed record in the state (rounds/<s>.json, its signature beside it as .json.sig),
     * published as global/rounds/<s>.json[.sig] before the model; NULL: the step is not signed */
    const char *record_path;
} hub_publication;

struct hub_ops {
    const char *scheme;         /* "file://" */
    const char *kind;           /* "file", as /status names it */
    const char *url_form;       /* "file:///abs/dir": the URL's shape, as --help lists it for --hub */
    /* 1: publish() writes to the local disk the daemon's state is on (file://), so its few small
     * durable writes wait behind whatever else that disk is writing: the daemon makes the step's
     * files durable after the publish rather than beside it */
    int publish_writes_locally;
    /* The transport's options (NULL: it has none): see "a transport's options" above. */
    const hub_options *options;
    /* Checks a URL of this scheme (config time, nothing touched).  0 or -DL_E_INVALID_ARGUMENT. */
    int (*check_url)(const char *url, dl_error *err);
    int (*open)(hub **out, uv_loop_t *loop, const hub_config *cfg, const hub_callbacks *cb, void *app,
                dl_error *err);
    void (*start)(hub *h);
    void (*set_step)(hub *h, uint64_t step, int waiting_for_global);
    void (*publish)(hub *h, const hub_publication *pub);
    /* Returns 1 when an HUB_INCOMPLETE outcome is final (the file stopped changing and is still
     * short: the daemon rejects it), else 0. */
    int (*mark_done)(hub *h, const char *rel, hub_outcome outcome, const hub_version *version);
    const hub_status *(*status)(const hub *h);
    void (*close)(hub *h, void (*done)(void *arg), void *arg);
    /* Optional (NULL: the transport keeps every file): removes a delta the daemon is done with (used
     * in a durable step, or stale, or superseded), if it is still the version that was handed over. */
    void (*prune)(hub *h, const char *rel);
    /* Optional (NULL: intake alone applies them): the bounds of the open round's model and its mode,
     * set when a round opens (file:// reads in place and takes only the mode: async lists each node
     * directory in local-step order). */
    void (*set_limits)(hub *h, const hub_limits *lim);
    /* Optional (NULL: the transport publishes no downlink; --downlink refuses it, config_modes.c): the
     * downlink's files the next publish() puts beside the global, copied (dl NULL: none). */
    int (*set_downlink)(hub *h, const hub_downlink *dl);
};

/* The scheme table: the transport for url, or NULL ("none" has no transport). */
const hub_ops *hub_find(const char *url);
/* The scheme table's rows in order, for what goes through every transport (their options):
 * hub_transport(i) for i < hub_transport_count(). */
size_t hub_transport_count(void);
const hub_ops *hub_transport(size_t i);
/* Checks a --hub value: "none" or a URL of a known scheme.  0 or -DL_E_INVALID_ARGUMENT with why. */
int hub_check_url(const char *url, dl_error *err);

int hub_open(hub **out, uv_loop_t *loop, const hub_config *cfg, const hub_callbacks *cb, void *app, dl_error *err);

static inline void hub_start(hub *h) { h->ops->start(h); }
static inline int hub_publish_writes_locally(const hub *h) { return h->ops->publish_writes_locally; }
static inline void hub_set_step(hub *h, uint64_t step, int waiting) { h->ops->set_step(h, step, waiting); }
static inline void hub_publish_step(hub *h, const hub_publication *pub) { h->ops->publish(h, pub); }
/* A step without a record. */
static inline void hub_publish(hub *h, uint64_t step, const char *global_path, const char *optimizer, int bootstrap)
{
    hub_publication pub = {step, global_path, optimizer, bootstrap, NULL};
    h->ops->publish(h, &pub);
}
static inline int hub_set_downlink(hub *h, const hub_downlink *dl)
{
    return h->ops->set_downlink != NULL ? h->ops->set_downlink(h, dl) : 0;
}
static inline int hub_mark_done(hub *h, const char *rel, hub_outcome o, const hub_version *v)
{
    return h->ops->mark_done(h, rel, o, v);
}
static inline const hub_status *hub_get_status(const hub *h) { return h->ops->status(h); }
static inline const char *hub_kind(const hub *h) { return h->ops->kind; }
static inline void hub_close(hub *h, void (*done)(void *), void *arg) { h->ops->close(h, done, arg); }
static inline void hub_set_limits(hub *h, const hub_limits *lim)
{
    if (h->ops->set_limits != NULL)
        h->ops->set_limits(h, lim);
}
/* 1 if the transport can prune consumed deltas. */
static inline int hub_can_prune(const hub *h) { return h->ops->prune != NULL; }
static inline void hub_prune(hub *h, const char *rel)
{
    if (h->ops->prune != NULL)
        h->ops->prune(h, rel);
}

/* For transports: counts a request by route and code in st->calls (the table is small and fixed;
 * a row past its end is counted under the last row). */
void hub_count_call(hub_status *st, const char *route, int code);
/* For options' load(): 1 if s starts with http:// or https://. */
int hub_is_http_url(const char *s);

#endif
