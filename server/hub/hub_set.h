/* hub_set: the parts of a sharded set's download and publish (hub.h, "Sharded checkpoints") that the
 * network transports (hub_hf.c, hub_s3.c) share.  A transport lists an index and the shards next to
 * it, versions the set with hub_set_version_*, fetches and parses the index, judges its base step
 * (hub_set_base_verdict) and waits for a listing that shows every shard (hub_set_missing_shard).  A
 * complete set gets a directory of its own with the index in it (hub_set_new); each shard is
 * downloaded there as the transport downloads a single delta, and hub_set_shard_done counts them.
 * After the last one the transport hands the set over (hub_set_hand_over for a delta, its own
 * adoption for a global) and frees it, or drops it with its directory (hub_set_drop).  When it
 * publishes a sharded global, hub_set_other_layout says which files of global/ the other layout
 * left behind.
 *
 * The transport keeps its listing, its requests, its seen list and its logs (each names a file its
 * own way); nothing here touches the network or the loop. */
#ifndef HUB_SET_H
#define HUB_SET_H

#include <stddef.h>
#include <stdint.h>

#include "dl_error.h"
#include "hub.h"
#include "seen.h"
#include "st_index.h"

/* A set's version for the seen list: a hash of the index's own version and of every file listed with
 * it (path, version, size), so a set rewritten in any of its files, or completed, is taken again.
 * start, add each listed file in listing order, then end; end frees the hash whatever came before. */
typedef struct hub_set_version {
    struct evp_md_ctx_st *md;
    int bad;
} hub_set_version;

void hub_set_version_start(hub_set_version *v, const char *index_version);
void hub_set_version_add(hub_set_version *v, const char *path, const char *version, uint64_t size);
/* Writes "set-" and 32 hex digits into out (size >= 37).  0, or -1 when hashing failed. */
int hub_set_version_end(hub_set_version *v, char *out, size_t size);

/* Where a delta set's index puts it against the transport's step, from its base_outer_step metadata
 * (*base gets it): -1 a stale set (not downloaded), 1 a later round's (it waits), 0 this round's or
 * one without a usable base (intake judges it). */
int hub_set_base_verdict(const st_index *ix, uint64_t step, uint64_t *base);

/* The first shard the index lists that listed(arg, name) says the listing lacks, its name in name:
 * 1 then, 0 when every shard is listed. */
int hub_set_missing_shard(const st_index *ix, int (*listed)(const void *arg, const char *name), const void *arg,
                          char *name, size_t size);

/* 1 when path's last component is name ("nodes/a/x" names "x"). */
int hub_set_path_names(const char *path, const char *name);

/* The base of an index's path (".../delta_3.safetensors.index.json" -> "delta_3"), for st_index_parse. */
void hub_set_index_base(const char *rel, char *base, size_t size);

/* A sharded delta (or global) being downloaded: the index is in its directory already, the shards
 * arrive there; the set is handed over when the last one is verified. */
typedef struct hub_set {
    char *rel;                  /* the index's, as the transport lists it */
    char ver[80];               /* the seen list's version (hub_set_version_end) */
    char *dir;                  /* a directory of its own, holding only this set */
    char *index_path;           /* the index in dir, under its own name */
    unsigned pending;           /* shards not finished */
    int failed;
    seen_state fail_state;      /* the first failure's verdict for the set's version */
    int is_global;
    uint64_t step;              /* is_global: the step the transport's step file named */
    struct hub_set *next;       /* in the transport's list of sets */
} hub_set;

/* Makes dir (taken over, freed on failure) and writes the index text into it under rel's last
 * component (a small write of the transport's own cache on the loop thread), and puts the set on
 * *list.  NULL on failure: err says why (DL_E_NO_MEMORY when an allocation failed). */
hub_set *hub_set_new(hub_set **list, char *dir, const char *rel, const char *ver, int is_global, uint64_t step,
                     const char *index_text, size_t index_len, dl_error *err);

/* Counts one shard of set finished (ok: verified; else the set failed, and the first failure's
 * fail_state is kept).  1 when it was the last one (set->failed says how the set ended), else 0. */
int hub_set_shard_done(hub_set *set, int ok, seen_state fail_state);

/* Hands a complete delta set to the daemon: one hub_delta at the index's path, owned (the daemon
 * removes the directory). */
void hub_set_hand_over(const hub_set *set, const hub_callbacks *cb, void *app);

/* Removes a set directory of ours and the files in it (names we gave: no subdirectories).  A few
 * unlinks of the transport's own cache on the loop thread, as a single download's part file is. */
void hub_set_remove_dir(const char *dir);

/* A set not taken: its directory is removed unless keep_dir (a stop: the next start resumes the
 * shards there), and it is freed. */
void hub_set_drop(hub_set **list, hub_set *set, int keep_dir);

/* Takes set off *list and frees it (its directory stays). */
void hub_set_free(hub_set **list, hub_set *set);

/* Whether name, a file in the published global/, belongs to the other layout than the publish's:
 * for a sharded publish of nshards shards the plain file and shards of another count, for a plain
 * one (sharded 0) the index and every shard. */
int hub_set_other_layout(const char *name, int sharded, uint32_t nshards);

#endif
