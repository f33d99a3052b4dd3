/* daemon: the event loop of dilocod.  Data flows one way: transport -> intake (validated copy in the
 * cache) -> round -> aggregation job (thread pool) -> commit -> publish.  The loop thread only
 * decides; every file operation runs on the libuv thread pool.
 *
 * This header is all that the rest of server/ (api/: the routes and the uploads) sees of the daemon:
 * the struct is opaque here (only server/daemon*.c know it, through daemon_internal.h), and these
 * calls are the way in: the facts the routes and uploads read (daemon_view.c), offering and peeking a
 * delta (daemon_intake.c), the served global (daemon_publish.c), the pool's jobs (daemon.c), the
 * counters (through stats.h's stats_ functions on daemon_stats), and the status providers that
 * /status and /metrics walk (daemon_status.c).  Everything here runs on the loop thread, except
 * daemon_of_job and what a job reads through it on the pool (see there). */
#ifndef DAEMON_H
#define DAEMON_H

#include <stddef.h>
#include <stdint.h>
#include <time.h>

#include <uv.h>

#include "config.h"
#include "delta.h"
#include "dl_error.h"
#include "history.h"
#include "http.h"
#include "jobs.h"
#include "round.h"
#include "safetensors.h"
#include "stats.h"
#include "store.h"
#include "strbuf.h"

typedef struct dilocod dilocod;

/* What serves the daemon's listener, and what the daemon asks of it: an interface the daemon owns,
 * filled by main (server/main.c: api/'s api_front), so that the daemon calls no route, loads no token
 * and counts no upload itself (the layers point one way: `make lint-layers` keeps api/ out of the
 * daemon's files).  Everything here runs on the loop thread. */
typedef struct daemon_front {
    http_request_cb on_request;     /* http_server_start's request callback (app: the dilocod) */
    http_response_cb on_response;   /* every response, counted by route and status (app: the dilocod) */
    /* The credentials of --token-file, at startup and again on SIGHUP: 0 (*entries: how many are in
     * force), or a negative code with err set and the previous ones kept. */
    int (*load_credentials)(const char *path, size_t *entries, dl_error *err);
    void (*free_credentials)(void);
    /* Requests being received that write to disk (uploads): the warm thread yields to them. */
    int (*busy)(void);
    /* The front's own part of /status and /metrics (the uploads'), registered before the cluster's. */
    const struct daemon_provider *provider;
} daemon_front;

/* Runs until SIGINT/SIGTERM, serving its listener (--listen) through front.  Returns the process exit
 * code. */
int daemon_run(config *cfg, const daemon_front *front);

/* ---- the served global ----------------------------------------------------------------------- */

/* One file of the global as downloads see it: the open file and its facts. */
typedef struct served_file {
    http_file *file;            /* NULL: not served */
    uint64_t size;
    char etag[80];
} served_file;

/* The global model as downloads see it: the open files and the facts of the same commit, replaced
 * as a whole, so a response's X-Outer-Step, ETag and body always come from one published step.
 * Below --shard-size it is the plain file (GET /global/latest.safetensors); above, the index and
 * its shards (GET /global/latest.safetensors.index.json, /global/latest-0000i-of-0000N.safetensors),
 * as the transports publish it.  Responses in flight keep their own reference on a file. */
typedef struct served_global {
    uint64_t step;
    int available;              /* something is served (the plain file, or the index and every shard) */
    served_file single;
    served_file index;
    served_file *shards;
    uint32_t nshards;
} served_global;

/* The downlink (README, "The downlink"; daemon_downlink.c): whether --downlink is on; the view served
 * and its step (NULL: none yet); the update of step if it is committed and kept (NULL: not served);
 * step_count.json's names for step (-1: the served view is not step's; 1: its hash is not known, the
 * view being the global: view_hash unset); the bytes a route sent. */
int daemon_downlink_on(const dilocod *d);
const served_file *daemon_view_file(const dilocod *d, uint64_t *step);
const served_file *daemon_update_file(const dilocod *d, uint64_t step);
int daemon_downlink_names(const dilocod *d, uint64_t step, char view_hash[65], int *has_update);
void daemon_downlink_sent(dilocod *d, int update, uint64_t bytes);

/* The global that downloads send now (retries opening a newly committed one that failed to open). */
const served_global *daemon__global(dilocod *d);

/* ---- what the routes and uploads read (daemon_view.c) ------------------------------------------ */

const config *daemon_config(const dilocod *d);
uv_loop_t *daemon_loop(dilocod *d);
/* The state directory and the committed step (committed, step, bootstrap, dir). */
const store *daemon_store(const dilocod *d);
/* When the served step was committed (0: never). */
time_t daemon_committed_at(const dilocod *d);
/* The open round, as the round module keeps it (round.h). */
const round_state *daemon_round(const dilocod *d);
/* The newest quarantine of node_id (its norm, or cosine, and the bound it broke; the reason, and what
 * the bound compared with): 0, or -1 when none. */
int daemon_quarantine_detail(const dilocod *d, const char *node_id, double *norm, double *bound, const char **reason,
                             const char **basis);
/* The committed rounds (the last HISTORY_MAX). */
const history *daemon_history(const dilocod *d);
/* The global model's header, the same for every step: deltas are checked against it (NULL until there
 * is a global), and the size of a whole delta of it. */
const st_header *daemon_model(const dilocod *d);
uint64_t daemon_delta_bytes(const dilocod *d);
/* 1 when a delta can be uploaded at all: there is a global to upload it against. */
int daemon_takes_uploads(const dilocod *d);
/* The daemon's state by name ("collecting", ...), and whether it is stopping. */
const char *daemon_state_name(const dilocod *d);
int daemon_stopping(const dilocod *d);
/* Every counter: count with stats.h's stats_ functions, read by the providers. */
stats *daemon_stats(dilocod *d);

/* ---- deltas in (daemon_intake.c) ---------------------------------------------------------------- */

/* Offers a validated delta (its cache copy) to the round, logs, and closes the round if it is
 * complete.  Takes ownership of cache_path on ROUND_ACCEPTED/ROUND_REPLACED, else deletes the file. */
round_verdict daemon__offer(dilocod *d, const delta_info *info, char *cache_path, uint64_t size);
/* What round_offer would answer for a delta of info now (without offering it). */
round_verdict daemon__peek(dilocod *d, const delta_info *info);
/* Async mode: the local steps recommended to node_id (Dynamic Local Updates); 0 when none (sync mode, or
 * nothing measured and no --dylu-base-steps). */
uint64_t daemon__async_recommended(const dilocod *d, const char *node_id);
/* Counts and logs a rejected delta. */
void daemon__rejected(dilocod *d, const char *what, const char *rel, const delta_info *info, const dl_error *err);

/* ---- verdicts (daemon_verdicts.c): what happened to each node's deltas ------------------------- */

/* A delta refused as invalid (code) or by the round's rules (v), answered with HTTP status (0: none):
 * counted (stats.h) and recorded for its node (GET /nodes/<id>) in the one call, so that /status,
 * /metrics and the node's document agree.  info NULL (or without a node id): not read yet, node_id
 * says whose it is. */
void daemon_verdict_rejected(dilocod *d, const char *node_id, const delta_info *info, dl_code code, int status,
                             const char *message, const char *tensor);
void daemon_verdict_refused(dilocod *d, const char *node_id, const delta_info *info, round_verdict v, int status,
                            const char *message);
/* GET /nodes/<id>'s document for node_id into b: 0, or -1 when no verdict of that node is known. */
int daemon_node_verdicts_json(const dilocod *d, const char *node_id, sbuf *b);

/* ---- the pool (daemon.c) ---------------------------------------------------------------------- */

/* Runs work on the thread pool, then done on the loop (jobs.h: arg holds the job's typed arguments and
 * results; the daemon waits for every job at shutdown).  0, or a negative errno. */
int daemon__queue(dilocod *d, pool_job_fn work, pool_job_fn done, void *arg);
/* The daemon a job of daemon__queue's belongs to.  On the pool, a job reads through it only what does
 * not change while jobs run: the model's header and the store's directory. */
dilocod *daemon_of_job(const pool_job *j);

/* ---- /status and /metrics: the providers (daemon_status.c) -------------------------------------- */

/* A part of /status and of /metrics, written by the module whose state it reads (h2o's status
 * handlers): /status is {"version":...} followed by every provider's members in the order they were
 * registered, /metrics every provider's families.  A provider reads its state on the loop thread. */
typedef struct daemon_provider {
    const char *name;
    /* its members of the /status object, each written as ,"key":value (NULL: none) */
    void (*status)(const dilocod *d, sbuf *b);
    /* its whole families of /metrics, each with its # HELP and # TYPE (NULL: none) */
    void (*metrics)(const dilocod *d, sbuf *b);
} daemon_provider;

#define DAEMON_PROVIDERS_MAX 24

/* Adds p (kept by reference: static) after those registered before.  0, or -ENOSPC. */
int daemon_provide(dilocod *d, const daemon_provider *p);
/* The providers in their order; *n of them. */
const daemon_provider *const *daemon_providers(const dilocod *d, size_t *n);

/* Helpers for a provider's text. */
void daemon_metric_family(sbuf *b, const char *name, const char *type, const char *help);
/* A JSON number for a double: finite values only (JSON has no NaN: null).  _exact: all 17 digits, so
 * that it reads back as the same double (a norm /status shows equals the record's). */
void daemon_json_num(sbuf *b, double v);
void daemon_json_num_exact(sbuf *b, double v);
/* A JSON date ("2026-01-02T03:04:05+00:00"), or null for 0. */
void daemon_json_time(sbuf *b, time_t t);

#endif
