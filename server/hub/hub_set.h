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
#include "jobs.h"
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
int hub_set_base_verdict(const st_index *ix, uint64_t step, const hub_limits *lim, uint64_t *base);

/* The cap on an index a transport fetches: a delta's is bounded by the open round's model
 * (st_index_cap_for, in lim); a global's lists every tensor, so it keeps the format's cap. */
size_t hub_set_index_cap(const hub_limits *lim, int is_global);

/* Looks up every shard the index lists with listed(arg, name, &bytes), which says whether the
 * listing shows it and its listed size.  1 and the first missing shard's name in name when the
 * listing lacks one; else 0 and *total the shards' listed sizes together (saturating), for the set's
 * byte budget before a byte is downloaded. */
int hub_set_listed_shards(const st_index *ix, int (*listed)(const void *arg, const char *name, uint64_t *bytes),
                          const void *arg, char *name, size_t size, uint64_t *total);

/* A set's index, downloaded into memory, checked and parsed on the thread pool: hashing and
 * walking an index near its 10 MiB cap takes tens of milliseconds, which the loop must not spend
 * (every connection waits).  The job owns the text; done runs on the loop with the result (rc 0 and
 * ix; or mismatch when verify refused the text; or err), or with cancelled set when the loop is
 * going away.  The transport frees the job with hub_index_job_free. */
typedef struct hub_index_job hub_index_job;
typedef void (*hub_index_parsed)(hub_index_job *j);
struct hub_index_job {
    char *text;                 /* the index, NUL-terminated (taken from the download) */
    size_t len;
    size_t cap;                 /* st_index_parse_capped's */
    char base[ST_INDEX_BASE_MAX + 1];
    /* optional, on the pool before the parse: 0 when the text is the one the listing named (the
     * transport's arg is its own until done runs) */
    int (*verify)(const hub_index_job *j);
    int rc, mismatch, cancelled;
    st_index *ix;
    dl_error err;
    hub_index_parsed done;
    void *owner, *arg;          /* the transport's, untouched */
};

/* Takes text (malloc'd, len bytes; freed here when the job cannot be made).  NULL when out of memory. */
hub_index_job *hub_index_job_new(char *text, size_t len, const char *rel, size_t cap, hub_index_parsed done,
                                 void *owner, void *arg);
/* Queues the check and parse on o's pool jobs (jobs.h).  0, or -1 when it could not be queued (the job
 * is still the caller's). */
int hub_index_job_queue(job_owner *o, hub_index_job *j);
void hub_index_job_free(hub_index_job *j);

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

/* One file a publish uploads, open. */
typedef struct hub_pub_file {
    char rel[ST_INDEX_BASE_MAX + 64];   /* global/<name> */
    char *path;
    int fd;                     /* the step's file stays readable even if a later cleanup unlinks it */
    uint64_t size;              /* when it was opened */
} hub_pub_file;

/* Opens the files a publish of global_path uploads, in order: global_path alone (named
 * latest.safetensors), or for an index (latest.safetensors.index.json) the shards it lists, in its
 * directory under their own names, then the index.  *files (n of them) is the caller's to
 * hub_set_publish_close (also on failure).  0, or a negative code with err saying why. */
int hub_set_publish_open(const char *global_path, hub_pub_file **files, unsigned *n, dl_error *err);
void hub_set_publish_close(hub_pub_file *files, unsigned n);

/* Whether name, a file in the published global/, belongs to the other layout than the publish's:
 * for a sharded publish of nshards shards the plain file and shards of another count, for a plain
 * one (sharded 0) the index and every shard. */
int hub_set_other_layout(const char *name, int sharded, uint32_t nshards);

#endif
