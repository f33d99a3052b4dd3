/* What the daemon's own files (server/daemon*.c) share with each other: one concern per file, and
 * these the calls between them.  Included only by those files (make lint-layers keeps it so); the
 * state they act on is daemon_internal.h's.  Everything here runs on the loop thread. */
#ifndef DAEMON_PARTS_H
#define DAEMON_PARTS_H

#include <stddef.h>
#include <stdint.h>

#include <uv.h>

#include "daemon_internal.h"
#include "dl_error.h"
#include "fsutil.h"
#include "hub.h"
#include "outer.h"
#include "safetensors.h"

/* Intake requests in flight at once (the pool is sized for them beside the pass's threads). */
#define MAX_INTAKE_IN_FLIGHT 2
/* The longest wait before an aggregation or a publish is tried again. */
#define MAX_RETRY_SECONDS 60.0

/* A pool job (daemon__queue, jobs.h), by its short name in the daemon's files. */
typedef pool_job job;

struct settle_args;

/* ---- daemon_status.c: the parts of /status and /metrics ---- */

/* Registers every provider (the daemon's, then the uploads'), in /status's order.  0, or -ENOSPC. */
/* daemon.c: the front's busy() (daemon.h's daemon_front: uploads being received), 0 without one: what the
 * warm thread yields to (daemon_pass.c). */
int daemon__front_busy(const dilocod *d);
int daemon__status_register(dilocod *d);

/* ---- daemon_verdicts.c: each node's deltas and their verdicts ---- */

/* Startup: <state>/verdicts.json read back (a damaged one set aside, loudly: the table starts empty). */
void daemon__verdicts_load(dilocod *d);
/* A delta the round took (accepted, replaced: the one it replaced, queued), answered status (0: none). */
void daemon__verdict_taken(dilocod *d, const delta_info *info, round_verdict v, int status, int recovered,
                           int had_prev, uint64_t prev_local, uint64_t prev_base);
/* A round entry quarantined at the close (reason: norm_ratio, max_norm, cosine, overflow). */
void daemon__verdict_quarantined(dilocod *d, const round_entry *e, const char *reason, const char *message);
/* A round entry dropped with its discarded round (not quarantined itself). */
void daemon__verdict_discarded(dilocod *d, const round_entry *e, const char *reason);
/* A committed round (or, replay 1, a record of the history at startup): its deltas aggregated, its
 * quarantined ones quarantined (replay: only where the file still says accepted or queued). */
void daemon__verdicts_committed(dilocod *d, const round_record *r, int replay);
/* Shutdown, the loop gone: the last changes written (blocking), the table freed. */
void daemon__verdicts_close(dilocod *d);
extern const daemon_provider daemon__verdicts_provider;

/* ---- daemon_async.c: asynchronous mode ---- */

/* A delta taken (accepted or queued) with staleness tau: its node's speed, the staleness histogram. */
void daemon__async_accepted(dilocod *d, const delta_info *info, uint64_t tau, double now);
/* The Delayed Nesterov parameters of the update the open round makes (dn->on 0 in sync mode). */
void daemon__async_update(const dilocod *d, store_dn *dn);
/* The phase a step is committed with after the update dn. */
store_dn daemon__async_after(const store_dn *dn);
/* An update committed: counted. */
void daemon__async_committed(dilocod *d, const store_dn *dn);
void daemon__async_free(dilocod *d);
/* Whether info's delta was applied already (async mode: it is refused as not newer). */
int daemon__async_applied(const dilocod *d, const delta_info *info);
/* The committed update's deltas join the applied set (and deltas too stale to be taken again leave it). */
void daemon__async_record_applied(dilocod *d, const round_record *r);
/* For history_load_each at startup: each record's deltas join the applied set. */
void daemon__async_load_record(void *d, const round_record *r);
/* Startup, after the records are loaded: the applied set's floor, if the records tell it. */
void daemon__async_loaded(dilocod *d);
/* A round opens: the floor, if the records did not tell it, is the step the state starts from. */
void daemon__async_round_opened(dilocod *d);
/* The staleness bound the round applies now (ROUND_NO_STALENESS_BOUND: none): --max-staleness,
 * tightened so that no base below the applied set's floor is taken; also set in d->rnd. */
uint64_t daemon__async_bound(dilocod *d);
/* Whether info's base is below the floor (counted and logged when count is set). */
int daemon__async_below_floor(dilocod *d, const delta_info *info, int count);
extern const daemon_provider daemon__async_provider;

/* daemon_cluster.c: K aggregators over one bucket (README, Scaling out; hub/s3_cluster.h) */
int daemon__cluster_start(dilocod *d, dl_error *err);
void daemon__cluster_stop(dilocod *d);
extern const daemon_provider daemon__cluster_provider;
/* daemon.c: closes the transport (shutdown) */
void daemon__close_hub(dilocod *d);

/* daemon_robust.c: the norm and cosine screens, the rules' per-delta scales (README, Robust aggregation) */
/* Whether a delta offered is quarantined by the norm screen (counted, logged and remembered if so). */
int daemon__robust_screen_offer(dilocod *d, const delta_info *info);
/* Whether the rule can weigh the delta: weighted_mean needs its weight or num_tokens metadata. */
int daemon__robust_weighable(const dilocod *d, const delta_info *info);
/* Sync: the norm screen again over the closed round, every delta against all the others. */
void daemon__robust_screen_close(dilocod *d);
/* The cosine screen's verdict on an entry (quarantined below --screen cosine:MIN). */
void daemon__robust_cosine(dilocod *d, round_entry *e, double cosine);
/* An entry left out because the step overflowed with it (its norm the largest of the pass's deltas). */
void daemon__robust_overflow(dilocod *d, round_entry *e, double norm);
/* weighted_mean's normalized weights or clipped_mean's clip factors of the n aggregated entries (1 for
 * the other rules); 0, or -1 without memory. */
int daemon__robust_scales(const dilocod *d, const round_entry *const *e, size_t n, float *scale);
/* A committed round's aggregated deltas join their nodes' trailing norms; at startup, the history's. */
void daemon__robust_aggregated(dilocod *d, const node_stat *nodes, size_t n);
void daemon__robust_load(dilocod *d);
/* The newest quarantine of node_id, or NULL. */
const robust_event *daemon__robust_last(const dilocod *d, const char *node_id);
void daemon__robust_free(dilocod *d);
extern const daemon_provider daemon__robust_provider;

/* ---- daemon.c: wiring and lifecycle ---- */

/* Logs a failure at error level: the component, what failed, and the dl_error's code, message and tensor. */
void daemon__log_error(const char *component, const char *msg, const dl_error *e);
/* A fatal error: e logged at error level as msg, then the daemon stops (exit code 1) on the loop's next
 * turn, as SIGTERM stops it.  For what the daemon cannot go on from but a restart can (the state on
 * disk is sound: out of memory after a durable commit, an input changed under it).  The caller returns
 * and runs nothing more for the step. */
void daemon__fatal(dilocod *d, const char *component, const char *msg, const dl_error *e);
/* Deletes a file without blocking the loop (libuv runs the unlink on its pool). */
void daemon__unlink_async(dilocod *d, const char *path);
/* Deletes a delta or a global of ours (a file, or a set) without blocking the loop; download: a transport's. */
void daemon__discard_local(dilocod *d, const char *path, int download);
/* Collecting starts on the committed global (at startup or after an adoption): the round opens, it is served. */
void daemon__collecting_start(dilocod *d);
/* d->st.step's global is committed (at startup, adopted, or bootstrapped): served and published. */
void daemon__global_committed(dilocod *d);
/* Shutdown ends here once no job, no HTTP server and no transport is left: every handle is closed. */
void daemon__maybe_finish_shutdown(dilocod *d);

/* ---- daemon_intake.c: deltas in, the open round ---- */

/* hub_callbacks.delta_ready: a delta the transport found, queued for intake. */
void daemon__on_delta_ready(void *app, const hub_delta *hd);
/* Starts queued intakes while there is room (MAX_INTAKE_IN_FLIGHT) and a round to take them. */
void daemon__dispatch_intake(dilocod *d);
/* Arms the round timer for the open round's deadline (--round-timeout). */
void daemon__arm_round_timer(dilocod *d);
/* Closes the round and starts its aggregation if it is complete (or timed out) and nothing holds it. */
void daemon__maybe_close_round(dilocod *d);
/* The round of d->st.step opens on d->model: deltas are taken in from here on. */
void daemon__round_open(dilocod *d);
/* --prune-consumed: the transport removes a delta that no step will need again. */
void daemon__prune_now(dilocod *d, const char *rel);
/* Frees a list of the transport's file names. */
void daemon__free_rels(char **rels, size_t n);

/* ---- daemon_pass.c: the aggregation, its warmed outputs, its inputs' durability ---- */

/* What store_global_intact's answer says the operator can do (with daemon__global_change). */
#define GLOBAL_CHANGED_HELP                                                                                  \
    "put that file back as it was (its bytes and its modification time), or start again from an empty state " \
    "directory"

/* The closed round's pass starts on the pool (or fails into a retry). */
void daemon__start_aggregation(dilocod *d);
/* The pass or its commit failed: released, and retried after a backoff. */
void daemon__aggregation_failed(dilocod *d, const dl_error *err);
/* Frees the pass and what it was given (its warmed files, the pending round record). */
void daemon__pass_release(dilocod *d);
/* Sets up the pass of new_step from the committed step's files (a round's, or a redo record's); dn:
 * async mode's update (dn->on 0: a synchronous step). */
int daemon__setup_pass(dilocod *d, outer_pass *p, uint64_t new_step, const char *optimizer, double lr,
                       double momentum, const store_dn *dn, st_kv meta[2], char *step_text, size_t step_text_size);
/* Before a pass (before_pass) and before its commit: reopens a round that lost a rewritten delta.  1 if so. */
int daemon__reopen_if_rewritten(dilocod *d, int before_pass);
/* Why a linked global's check (store_global_intact's rc) failed, for a message. */
const char *daemon__global_change(int rc);
/* When a round opens: warms the files its pass will write. */
void daemon__start_warm(dilocod *d);
/* Tells a running warm thread to stop (shutdown). */
void daemon__stop_warm(dilocod *d);
/* The warm thread ended (its uv_async_t): joined, its files kept for the round or removed. */
void daemon__warm_async_cb(uv_async_t *h);
/* Removes warm files that will not be used and forgets them. */
void daemon__drop_warm(dilocod *d, char **tmp);

/* ---- daemon_commit.c: the commit, settling, cleanup, round records, recovery ---- */

/* The finished pass's record (per-node norms and cosines, its time) as a JSON line.  0 or -ENOMEM. */
int daemon__prepare_round_record(dilocod *d, double seconds);
/* Commits the finished pass once the previous step is durable and the round's deltas are. */
void daemon__try_commit(dilocod *d);
/* Starts the settle that waited for the publish (the publish ended, none started, or shutdown). */
void daemon__release_settle(dilocod *d);
/* Frees a settle job's arguments (NULL: nothing). */
void daemon__settle_free(struct settle_args *a);
/* Removes the files of the steps before the durable one, when nothing needs them. */
void daemon__schedule_cleanup(dilocod *d);
/* At startup: recomputes and commits the step a redo record names, or removes an old record. */
int daemon__recover_redo(dilocod *d, dl_error *err);

/* daemon_sign.c: --signing-key.  The key loaded (startup), freed. */
int daemon__sign_open(dilocod *d, dl_error *err);
void daemon__sign_free(dilocod *d);
/* The committed step's record (if any) becomes the next record's previous. */
void daemon__sign_chain(dilocod *d);
/* The record of step was written with block hash hash; out: its global's, momentum's and accumulator's
 * block hashes ("" for none). */
void daemon__sign_recorded(dilocod *d, uint64_t step, const char *hash, const char out[3][65]);
/* On the pool: a delta's block hash as hex.  0 or -DL_E_*. */
int daemon__sign_hash_delta(const char *path, char hex[65], dl_error *err);
/* A delta taken into the round (its cache path): its block hash computed now, on the pool. */
void daemon__sign_hash_taken(dilocod *d, const char *path);
/* The hash computed for path when it was taken, or NULL. */
const char *daemon__sign_known(const dilocod *d, const char *path);
/* The open round's entries' hashes (taken over), computed beside the pass for step. */
void daemon__sign_inputs_hashed(dilocod *d, uint64_t step, char (*hash)[65], size_t n);
/* A delta of the open round refused at its arrival (verdict "refused", reason "stale"; or "quarantined" by the
 * norm screen, with its reason), for the round's record. */
void daemon__sign_refused(dilocod *d, const char *node_id, const delta_info *info, const char *verdict,
                          const char *reason);
/* The closing round's record without its outputs (malloc'd), or NULL when not signing (or out of memory:
 * then d->sign.on tells). */
char *daemon__sign_skeleton(dilocod *d);
/* The round is committed: its refusals are in its record. */
void daemon__sign_round_committed(dilocod *d);
/* A step entered whole (origin "bootstrap" or "adopted"): its record written and durable, before the
 * step's commit.  Reads only the configuration, the key and d->st.dir: any thread. */
int daemon__sign_whole(const dilocod *d, uint64_t step, const char *origin, const char *global_path, char hash[65],
                       dl_error *err);

/* ---- daemon_publish.c: the served global, the published layout, publishing ---- */

/* A descriptor for serving path, or a negative errno. */
int daemon__open_for_download(const char *path);
/* Serves step's global in its published layout (fd: its single file already open, or negative). */
void daemon__serve_step(dilocod *d, int fd, uint64_t step);
/* Releases what g serves. */
void daemon__served_clear(served_global *g);
/* f serves fd (a file of step; fd taken, or a negative errno).  0 or a negative errno. */
int daemon__served_file_set(served_file *f, int fd, uint64_t step);
void daemon__served_file_clear(served_file *f);

/* ---- daemon_downlink.c: the view and the update of each step (README, "The downlink") ---- */

/* The finished pass's global is written: its step's view and update are made on the pool, then the pass
 * activity ends and the commit is tried (or the step fails into a retry). */
void daemon__downlink_make(dilocod *d);
/* The view step's commit carries (made after its pass), or NULL. */
const store_view *daemon__downlink_made(const dilocod *d, uint64_t step);
/* Recovery of a redo record that names the downlink: step's view and update made again from the committed
 * view and global (step's global, just recomputed), durable.  Blocking, before the loop runs. */
int daemon__downlink_recover(dilocod *d, int enc, uint64_t step, const char *global, store_view *out, dl_error *err);
/* The committed step's view and its chain's kept updates are served (after a commit, at startup, after an
 * adoption). */
void daemon__downlink_serve(dilocod *d);
void daemon__downlink_free(dilocod *d);
/* Before a publish of the committed step: its downlink files handed to the transport. */
void daemon__downlink_publish(dilocod *d);
extern const daemon_provider daemon__downlink_provider;
/* Above --shard-size: writes the committed step's published set, once per step. */
void daemon__ensure_set(dilocod *d);
/* How many shards --shard-size makes of the model (1: the plain file). */
void daemon__plan_layout(dilocod *d);
/* Publishes the committed step through the transport unless it holds it or a publish is out. */
void daemon__maybe_publish(dilocod *d);
/* hub_callbacks.publish_done: every publish ends here (error NULL on success). */
void daemon__on_publish_done(void *app, uint64_t step, const char *error);

/* ---- daemon_adopt.c: a global from the transport, or --init-model ---- */

/* How a bootstrap took --init-model in: linked (version: the one linked), or copied (link_errno: why
 * not linked). */
typedef struct model_intake {
    int linked;
    int link_errno;
    fsu_ident version;
} model_intake;

/* d->model becomes path's header (max_header: its cap, 0 for the format's own). */
int daemon__open_model(dilocod *d, const char *path, uint64_t max_header, dl_error *err);
/* What an adoption made, on the pool, for the loop to apply (daemon__adopt_apply): the pool never
 * writes the daemon's state. */
typedef struct adopt_result {
    st_header *model;           /* the adopted global's header (NULL: the round's own, known before) */
    char *dst;                  /* the committed global in the state */
    model_intake mi;            /* a bootstrap: linked or copied */
    store_commit_info info;     /* what outer_metadata.json now names (durable) */
} adopt_result;

/* Makes src the committed global of step on disk (bootstrap: --init-model, linked or copied; else
 * moved): validated, made durable, outer_metadata.json written.  known: the header the open round
 * already took from src (the bootstrap overlapped with intake), which src must still match; NULL:
 * src's header is read into r->model.  Reads d's configuration and state directory only: safe on
 * the pool.  0, or an error (nothing committed; r is freed either way by daemon__adopt_result_free). */
int daemon__adopt_prepare(const dilocod *d, const char *src, uint64_t step, int bootstrap, const st_header *known,
                          adopt_result *r, dl_error *err);
/* On the loop: the commit daemon__adopt_prepare wrote becomes the store's, and its header the model.
 * 0, or -1 out of memory (durable on disk, unknown in memory: the caller stops; a restart reads it). */
int daemon__adopt_apply(dilocod *d, adopt_result *r);
void daemon__adopt_result_free(adopt_result *r);
/* The "bootstrapped" line: how --init-model came in. */
void daemon__log_bootstrapped(const dilocod *d, const char *path, const model_intake *mi);
/* hub_callbacks.published_seen: the transport's published step, first known or changed. */
void daemon__on_published_seen(void *app, int64_t step);
/* hub_callbacks.global_ready: the transport's verified copy of its global, to adopt. */
void daemon__on_global_ready(void *app, uint64_t step, const char *local_path);

#endif
