/* store: the local state tree under <state_root>/<id>/ and its commit protocol.
 *
 *   global/latest-<step>.safetensors     the global model of each committed step (only the current one kept)
 *   global/set-<step>/                   the same model as published when it is above --shard-size:
 *                                        latest.safetensors.index.json + latest-0000i-of-0000N.safetensors,
 *                                        made from the file above (the index last: its presence = complete)
 *   global/view-<step>.safetensors       --downlink: the committed step's view (store_view.c; absent when the
 *                                        step's global is its view: the chain starts there)
 *   global/update-<step>.safetensors     --downlink: the chain's last --updates-keep updates
 *   outer_state-<step>.safetensors       momentum buffers of that step (F32; absent for momentum 0)
 *   outer_accum-<step>.safetensors       async mode: the Delayed Nesterov accumulator after that step (F32;
 *                                        absent when its k is 0)
 *   outer_metadata.json                  THE commit point: names the current step and its files, and
 *                                        holds the record of the round that produced it
 *   rounds.jsonl                         one record per committed round (history.h)
 *   verdicts.json                        each node's last deltas and their verdicts (verdicts.h), replaced
 *                                        atomically after every change
 *   cache/deltas/s<step>/<node>/delta_<local_step>.safetensors   validated deltas of the open round (async:
 *                                        of every base within the staleness bound; a consumed one is removed
 *                                        when its step is durable, before the redo record)
 *   cache/incoming/                      deltas being received or copied (temporary)
 *   redo.json                            a round committed but not yet durable: its inputs and record
 *   verify/<step>/                       --verify-keep: a step's global, momentum, accumulator and input deltas
 *                                        (hard links), the newest N steps, for verifiers (manifest_keep)
 *   rounds/<step>.json, <step>.json.sig  --signing-key: each step's signed record (manifest.h), the newest
 *                                        MANIFEST_KEEP kept
 *
 * A bootstrap or an adoption is committed by atomically replacing outer_metadata.json (temp, fsync,
 * rename, fsync of the directory) after its global file is durable.  A round is committed by its redo
 * record (redo.json: the step, its inputs — the committed step's files and the round's cached deltas —
 * the optimizer and the round's record), made durable in a few milliseconds; its outputs are then
 * written, served and published without waiting for the disk, and made durable in the background,
 * after which outer_metadata.json names the new step and the redo record goes.  The aggregation is
 * deterministic, so a restart that finds a redo record recomputes the step from its inputs, bit for bit
 * (the inputs are kept until the outputs are durable).  The files carry the step in their names, so a
 * crash at any moment leaves exactly one committed step (plus at most a redo record naming the next)
 * and some leftovers, which store_cleanup() removes.  All functions do blocking I/O: call them from the thread pool (or before
 * the loop runs). */
#ifndef STORE_H
#define STORE_H

#include <stdint.h>

#include "checksum.h"
#include "dl_error.h"
#include "fsutil.h"

/* Asynchronous mode's Delayed Nesterov state of a step (README "Asynchronous mode"). */
typedef struct store_dn {
    int on;                     /* the step was made in async mode */
    unsigned period;            /* N */
    unsigned k;                 /* updates since the last Nesterov step: after the step (metadata), before the
                                   update (redo record) */
    int paper;                  /* the variant: 0 "forgather", 1 "paper" (Algorithm 3 of Liu et al.) */
    double c;                   /* the paper variant's momentum activation */
    double weight;              /* redo record only: the update's staleness weight */
} store_dn;

/* The downlink's view of a committed step (README, "The downlink"; common/downlink.h). */
typedef struct store_view {
    int enc;                    /* compress.h's cz_encoding of the updates; 0: the view is the step's global */
    uint64_t chain_from;        /* the step whose global the view started from: updates exist for the steps
                                   after it, up to the committed one */
    unsigned char hash[32];     /* the view file's block hash (blockhash.h), when hashed */
    int hashed;
} store_view;

typedef struct store {
    char *dir;                  /* <state_root>/<id> */
    int committed;              /* a step is committed */
    uint64_t step;
    char *global_path;          /* absolute paths of the committed step's files */
    char *momentum_path;        /* NULL: no momentum (fresh or momentum 0) */
    char *accum_path;           /* NULL: no accumulator (sync mode, or dn.k 0) */
    store_dn dn;
    int accum_summed;
    uint64_t accum_sum;
    /* async mode (set by the caller of store_cleanup): cleanup keeps every cached delta (each is consumed,
     * removed when its step is durable, or refused, removed at once) and removes only empty directories */
    int async_cache;
    int bootstrap;              /* the committed step is a bootstrap / adopted model */
    char *round_json;           /* the committed round's record (history.h), NULL for a bootstrap / adoption */
    /* the committed global is a hard link to a file others may rewrite in place (a bootstrap linked from
     * --init-model): global_version is the version committed (outer_metadata.json "global_version") */
    int global_guarded;
    fsu_ident global_version;
    /* the content checksums (checksum.h) of the committed step's global and momentum, as the pass that
     * made them computed them (outer_metadata.json "global_checksum", "momentum_checksum"): the next pass
     * verifies them, so a step is never made from bytes that someone wrote into our files (a tree writer
     * with our uid writing into global/latest.safetensors, which file:// links to the state's inode) */
    int global_summed, momentum_summed;
    uint64_t global_sum, momentum_sum;
    store_view view;            /* the committed step's view (view.enc 0: its global is the view) */
    char *view_path;            /* global/view-<step>.safetensors, NULL when view.enc is 0 */
    unsigned updates_keep;      /* set by the caller of store_cleanup: the newest N updates of the chain stay */
    ck_key key;                 /* the state's checksum key (<dir>/checksum.key), loaded by store_open */
    int startup;                /* private to store_cleanup */
} store;

typedef struct store_commit_info {
    uint64_t step;
    const char *global_path;    /* must be store_global_path(step) */
    const char *momentum_path;  /* store_momentum_path(step) or NULL */
    const char *optimizer;
    double lr, momentum;
    int bootstrap;
    const char *origin;         /* "round", "init_model", "adopted" */
    const char *round_json;     /* the round's record (one JSON object), committed with the step; or NULL */
    const fsu_ident *global_version;    /* NULL, or the global is a link others may rewrite: its version */
    const uint64_t *global_sum;         /* NULL, or the global's content checksum */
    const uint64_t *momentum_sum;       /* NULL, or the momentum's */
    const char *accum_path;             /* store_accum_path(step) or NULL */
    const uint64_t *accum_sum;
    const store_dn *dn;                 /* NULL: sync mode */
    const store_view *view;             /* NULL: the step's view is its global (no downlink, or it starts here);
                                           else its view is store_view_path(step) */
} store_commit_info;

/* Creates the tree and loads the committed step (if any). */
int store_open(store *s, const char *state_root, const char *id, dl_error *err);
/* Writes outer_metadata.json atomically: from this moment info->step is the committed step on disk.
 * Reads only s->dir, so a pool thread may call it while the loop reads s. */
int store_commit_write(const store *s, const store_commit_info *info, dl_error *err);
/* Records a written commit in s (on the thread that owns s).  0 or -DL_E_NO_MEMORY. */
int store_commit_apply(store *s, const store_commit_info *info);
/* Both, for a caller that owns s alone (startup). */
int store_commit(store *s, const store_commit_info *info, dl_error *err);
/* A committed round whose outputs are not durable yet (redo.json). */
typedef struct store_redo {
    uint64_t step;              /* the step it makes */
    uint64_t base;              /* the step it starts from (step - 1) */
    char **deltas;              /* absolute paths of the round's cached deltas, in aggregation order */
    size_t ndeltas;
    /* per delta: a link to a shared tree's file (zero-copy intake) and the version that was aggregated,
     * which recovery checks before recomputing (NULL: none is guarded) */
    unsigned char *guarded;
    fsu_ident *versions;
    char *optimizer;
    double lr, momentum;
    store_dn dn;                /* async mode's update (dn.on): its deltas may be of any base up to base */
    /* the aggregation rule (outer.h's outer_rule: mean, weighted_mean, clipped_mean, trimmed_mean, median)
     * with its K, and the per-delta scales weighted_mean and clipped_mean used (NULL: none), so that a
     * restart recomputes the same bytes whatever the screens would judge now */
    int rule;
    unsigned trim_k;
    float *scales;
    char *round_json;           /* the round's record (history.h) */
    /* --signing-key: the step's signed record without its outputs (manifest.h), a JSON object's text kept
     * verbatim as a string, so that a recomputed step's record is the same bytes (NULL: not signed) */
    char *manifest;
    int downlink;               /* the step's view and update are made too, with this cz_encoding (0: none) */
} store_redo;

/* Writes redo.json atomically and durably: from this moment the round's step is committed. */
int store_redo_write(const store *s, const store_redo *r, dl_error *err);
/* Reads and validates redo.json (*present = 0 if there is none).  Its delta paths must be cache files
 * of its base step: a damaged or hand-edited record never names another file. */
int store_redo_read(const store *s, store_redo *r, int *present, dl_error *err);
/* Removes redo.json (the step it made is durable and named by outer_metadata.json). */
int store_redo_remove(const store *s, dl_error *err);
void store_redo_free(store_redo *r);
/* 1 when the committed global is still the version committed (always, unless it is guarded), 0 when it
 * was rewritten in place or is gone, a negative errno when that cannot be told.  A guarded global is the
 * operator's --init-model: its ctime moves when the operator removes or renames their name of it, so
 * only its device, inode, size and mtime are compared (the operator is trusted with their model). */
int store_global_intact(const store *s);

/* Removes files of steps before the committed one (globals, momentum, cached deltas).  At startup
 * (nothing else running) also uncommitted step files, temporary files and incoming copies. */
int store_cleanup(const store *s, int at_startup, dl_error *err);
/* malloc'd absolute paths */
char *store_global_path(const store *s, uint64_t step);
char *store_momentum_path(const store *s, uint64_t step);
char *store_accum_path(const store *s, uint64_t step);     /* outer_accum-<step>.safetensors */
const char *store_dn_variant_name(int paper);
char *store_set_dir(const store *s, uint64_t step);
char *store_view_path(const store *s, uint64_t step);       /* global/view-<step>.safetensors */
char *store_update_path(const store *s, uint64_t step);     /* global/update-<step>.safetensors */
/* store_view.c, for store.c: outer_metadata.json's "view" written and read, applied at a commit, the
 * files cleanup keeps (1, 0; -1: not a view's nor an update's name), the redo record's "downlink" */
struct sbuf;
struct cJSON;
void store__view_json(struct sbuf *b, const store_view *v);
int store__view_parse(store *s, const struct cJSON *v);
int store__view_apply(store *s, const store_commit_info *info);
int store__keep_view(const store *s, const char *name,
                     int (*match)(const char *, const char *, const char *, uint64_t *));
const char *store_redo_downlink_name(int enc);
int store__redo_downlink_parse(const struct cJSON *v, int *enc);         /* global/set-<step> */
char *store_cache_dir(const store *s, uint64_t step);       /* cache/deltas/s<step> */
char *store_cache_root(const store *s);                     /* cache/deltas */
char *store_incoming_dir(const store *s);
/* The same tree's paths from the state directory's name alone, for the code that holds no store (intake,
 * the transports, the daemon before its store is open, the configuration): every path under the state
 * directory is made here, none by hand.  malloc'd; NULL when out of memory. */
char *store_path_state_dir(const char *state_root, const char *id);      /* <state_root>/<id> */
char *store_path_metadata(const char *state_dir);                         /* outer_metadata.json */
char *store_path_verdicts(const char *state_dir);                         /* verdicts.json */
char *store_path_manifest_dir(const char *state_dir);                     /* rounds */
/* rounds/<step>.json, or with sig its detached signature rounds/<step>.json.sig */
char *store_path_manifest(const char *state_dir, uint64_t step, int sig);
char *store_path_verify_dir(const char *state_dir);                       /* verify */
char *store_path_verify_step(const char *state_dir, uint64_t step);       /* verify/<step> */
/* <state>/verdicts.json's text (NUL-terminated, at most max bytes): 0, 1 when there is none, or -DL_E_IO
 * (not a regular file, over max, unreadable). */
int store_read_verdicts(const char *state_dir, size_t max, char **text, size_t *len, dl_error *err);
char *store_path_incoming(const char *state_dir);                         /* cache/incoming */
/* cache/incoming/<name>, name made from fmt (a temporary file or directory of one writer, named so that
 * store_cleanup knows what to keep: a transport's partial downloads) */
char *store_path_incoming_file(const char *state_dir, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* cache/deltas/s<base_step>/<node>/delta_<local_step>.safetensors: a cached single-file delta */
char *store_path_cached_delta(const char *state_dir, uint64_t base_step, const char *node_id, uint64_t local_step);
/* cache/deltas/s<base_step>/<node>/delta_<local_step>.safetensors.index.json: a cached set's index */
char *store_path_cached_index(const char *state_dir, uint64_t base_step, const char *node_id, uint64_t local_step);
void store_free(store *s);
/* Removes a cached delta: the file, or a set's index and then every shard of its base next to it
 * (the index first, so a crash in between leaves an incomplete set nobody names, which cleanup
 * takes with its step).  0 or a negative errno. */
int store_remove_delta(const char *path);
/* Async: the consumed deltas of a durable step removed, and their directories made durable (before its
 * redo record goes: the record is what says they were consumed).  0 or -DL_E_*. */
int store_remove_consumed(char *const *paths, size_t n, dl_error *err);
/* fsync of a cached delta: the file, or a set's index and shards. */
int store_sync_delta(const char *path, dl_error *err);
/* rm -r of a directory tree we own (never follows symbolic links).  0 or a negative errno. */
int store_remove_tree(const char *path);

#endif
