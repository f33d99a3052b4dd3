/* store: the local state tree under <state_root>/<id>/ and its commit protocol.
 *
 *   global/latest-<step>.safetensors     the global model of each committed step (only the current one kept)
 *   outer_state-<step>.safetensors       momentum buffers of that step (F32; absent for momentum 0)
 *   outer_metadata.json                  THE commit point: names the current step and its files, and
 *                                        holds the record of the round that produced it
 *   rounds.jsonl                         one record per committed round (history.h)
 *   cache/deltas/s<step>/<node>/delta_<local_step>.safetensors   validated deltas of the open round
 *   cache/incoming/                      deltas being received or copied (temporary)
 *
 * A step is committed by atomically replacing outer_metadata.json (temp, fsync, rename, fsync of the
 * directory) after its global and momentum files are durable; the files carry the step in their
 * names, so a crash at any moment leaves exactly one committed step and at most some leftovers, which
 * store_cleanup() removes.  All functions do blocking I/O: call them from the thread pool (or before
 * the loop runs). */
#ifndef STORE_H
#define STORE_H

#include <stdint.h>

#include "dl_error.h"

typedef struct store {
    char *dir;                  /* <state_root>/<id> */
    int committed;              /* a step is committed */
    uint64_t step;
    char *global_path;          /* absolute paths of the committed step's files */
    char *momentum_path;        /* NULL: no momentum (fresh or momentum 0) */
    int bootstrap;              /* the committed step is a bootstrap / adopted model */
    char *round_json;           /* the committed round's record (history.h), NULL for a bootstrap / adoption */
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
} store_commit_info;

/* Creates the tree and loads the committed step (if any). */
int store_open(store *s, const char *state_root, const char *id, dl_error *err);
/* Writes outer_metadata.json atomically: from this moment info->step is the committed step on disk.
 * Reads only s->dir, so a pool thread may call it while the loop reads s. */
int store_commit_write(const store *s, const store_commit_info *info, dl_error *err);
/* Records a written commit in s (on the thread that owns s).  0 or -ENOMEM. */
int store_commit_apply(store *s, const store_commit_info *info);
/* Both, for a caller that owns s alone (startup). */
int store_commit(store *s, const store_commit_info *info, dl_error *err);
/* Removes files of steps before the committed one (globals, momentum, cached deltas).  At startup
 * (nothing else running) also uncommitted step files, temporary files and incoming copies. */
int store_cleanup(const store *s, int at_startup, dl_error *err);
/* malloc'd absolute paths */
char *store_global_path(const store *s, uint64_t step);
char *store_momentum_path(const store *s, uint64_t step);
char *store_cache_dir(const store *s, uint64_t step);       /* cache/deltas/s<step> */
char *store_incoming_dir(const store *s);
void store_free(store *s);

#endif
