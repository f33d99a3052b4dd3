/* hub_file: the file:// transport, a directory laid out like the Hub repo (a shared filesystem).
 *   nodes/<node_id>/delta_<local_step>.safetensors   written by workers
 *   nodes/<node_id>/delta_<n>.safetensors.index.json + delta_<n>-0000i-of-0000N.safetensors   (a set)
 *   global/latest.safetensors, global/step_count.json published here (temp + rename, step file last),
 *   or a sharded global: global/latest-0000i-of-0000N.safetensors + latest.safetensors.index.json
 * The tree is written by other people: below the root nothing is reached through a symbolic link
 * and nothing but directories and regular files is opened (a FIFO would block, a link may lead out
 * of the tree).  Blocking functions: the daemon runs them on the thread pool. */
#ifndef HUB_FILE_H
#define HUB_FILE_H

#include <stddef.h>
#include <stdint.h>

#include "delta.h"
#include "dl_error.h"
#include "hub.h"
#include "index_parse.h"

typedef struct hub_candidate {
    char *rel;                  /* nodes/<id>/delta_<n>.safetensors or its .safetensors.index.json (strictly
                                   parsed), or the refused entry */
    char *abs;
    uint64_t size;              /* identity of this version (lstat); for a set, of the whole set (below) */
    int64_t mtime_ns;
    uint64_t ino;
    /* A sharded delta, named by its index.  Its identity (size, mtime_ns, ino) covers every file of the
     * set: the sum of the sizes of the index and its shards, the latest mtime among them, and the
     * index's inode mixed (FNV-1a) with each shard's inode, size and mtime, so a shard rewritten,
     * replaced or arriving makes the set a new version. */
    int set;
    uint32_t nshards;           /* shards the index lists; 0: the index does not parse (intake says why) */
    int partial;                /* a listed shard is not there yet: the set waits (identity of what is there,
                                   up to the first missing shard) */
    index_parse *index;         /* a set: a reference to the index's verdict, with the parse itself when it is
                                   kept (the newest set of its node, within the budget): for hub_index_memo
                                   and for intake */
    char *refused;              /* non-NULL: junk in the tree (a link, a FIFO, ...), never read: why */
    int node_dir;               /* 1: not a delta but a node directory the scan read (rel nodes/<id>),
                                   for the transport to watch */
    uint64_t local_step;        /* a delta's */
    uint64_t waiting;           /* a node directory's (async scan): deltas from its resume point on beyond the
                                   per-node cap, left for a later scan */
} hub_candidate;

/* Async mode's listing (hub_limits.async): every delta is an update, so a node directory is read in
 * local-step order from where the decided ones end, the lowest HUBFILE_DELTAS_PER_NODE from that point
 * per scan, rather than its newest few.  One per node directory whose lower local steps are all decided
 * (handed over and answered for good): those below from are not listed again. */
typedef struct hub_resume {
    char node[DELTA_NODE_ID_MAX + 1];
    uint64_t from;
} hub_resume;

typedef struct hub_scan_opts {
    int async;
    const hub_resume *resume;   /* sorted by node (strcmp), nresume entries; may be NULL */
    size_t nresume;
} hub_scan_opts;

#define HUBFILE_DELTAS_PER_NODE 16

/* What an earlier scan learnt from a version of an index (index_parse.h: the version's identity, its
 * verdict, and the parse itself when kept).  An index is read and parsed once per version, not at
 * every scan nor again by intake (it may be 10 MiB).  The parse is kept for one index per node
 * directory, the newest by local step (one delta per node counts), while the process-wide budget
 * has room (INDEX_PARSE_KEPT_MAX): a node's junk never takes another node's parse away, and a node
 * gets none once the budget is spent (its sets are then parsed again by intake, as before). */
typedef struct hub_index_memo {
    char *rel;
    index_parse *index;         /* a reference */
} hub_index_memo;

/* Lists the deltas under root/nodes (per node directory the newest few by local step, or with
 * opts->async the lowest few above its resume point, in ascending local-step order: single files and
 * set indexes; shards are looked at through their index, never listed alone), the node directories it
 * read, and the entries it refused to read (a node directory that is a link, a delta that is a FIFO, a
 * file whose name is not a delta's, ...).  memo (sorted by rel, nmemo entries, may be NULL) is only
 * read: what earlier scans learnt of the indexes; so is opts (NULL: sync).  *index_parses: the indexes
 * it read and parsed (set also when the scan fails). */
int hubfile_scan(const char *root, const hub_index_memo *memo, size_t nmemo, const hub_scan_opts *opts,
                 hub_candidate **out, size_t *n, size_t *index_parses, dl_error *err);
void hub_candidates_free(hub_candidate *c, size_t n);
/* The memo of a scan's candidates, sorted by rel (replaces *memo; the old one is freed).  0 or -ENOMEM
 * (the old memo is kept). */
int hub_index_memo_build(const hub_candidate *c, size_t n, hub_index_memo **memo, size_t *nmemo);
void hub_index_memo_free(hub_index_memo *memo, size_t n);
/* The published step, if root/global/step_count.json and the model it names exist (*present = 0 if
 * not); *sharded (may be NULL) is 1 when that is global/latest.safetensors.index.json. */
int hubfile_read_published(const char *root, int *present, uint64_t *step, int *sharded, dl_error *err);
/* Publishes src (record: the step's signed record in the state, or NULL; first, as
 * root/global/rounds/<step>.json.sig and .json, the newest MANIFEST_KEEP kept): a plain file is copied
 * to root/global/latest.safetensors; an index (a path ending in .safetensors.index.json, base "latest")
 * publishes the shards it lists from its directory, then global/latest.safetensors.index.json.  Then
 * the downlink's files (dl, or NULL: hubfile_publish_downlink), then step_count.json (naming them),
 * then the other layout's files are removed from root/global.  Each file atomically (temp, fsync,
 * rename). */
int hubfile_publish(const char *root, const char *src, uint64_t step, const char *optimizer, int bootstrap,
                    const char *record, const hub_downlink *dl, dl_error *err);
/* hub_file_downlink.c: the downlink's files of a step (dl) into root/global (gfd): the update as
 * updates/<step>.safetensors (and any kept one the tree lacks), a view checkpoint views/<c>.safetensors
 * every keep/2 steps; *view_step: the newest checkpoint the tree holds, which step_count.json names.
 * Linked where the filesystems allow, else copied, each atomically. */
int hubfile_publish_downlink(int gfd, const char *root, const hub_downlink *dl, uint64_t *view_step, dl_error *err);
/* After step_count.json: the updates no longer kept and the views before the last two checkpoints go
 * (a failure is logged: the step is published). */
void hubfile_prune_downlink(int gfd, const char *root, const hub_downlink *dl, uint64_t view_step);
/* Removes root/rel (a delta path, strictly parsed, reached without links) if it is still the version
 * (size, mtime, inode) that was taken in; for a set's index, the whole set (the index, then its
 * shards) if the set's identity (hub_candidate) is still that.  0 removed or already gone, 1 kept
 * (another version), or a negative code. */
int hubfile_remove_delta(const char *root, const char *rel, uint64_t size, int64_t mtime, uint64_t ino,
                         dl_error *err);
/* Removes temporary files a publish cut short (a crash) left in root/global (startup only). */
int hubfile_cleanup_temps(const char *root, dl_error *err);
/* Copies root/global/latest.safetensors (reached without links, a regular file whose header
 * parses, of at most max_header bytes: 0 for the format's own cap) to dst atomically; fails if it
 * changed during the copy.  The caller validates dst. */
int hubfile_copy_global(const char *root, const char *dst, uint64_t max_header, dl_error *err);
/* Copies a sharded global (root/global/latest.safetensors.index.json and the shards it lists, each
 * reached without links and unchanged during its copy) into the directory dir (created; emptied
 * first), and checks the copy is a consistent set (st_set_open).  The index is dir/<its name>.  Each
 * shard's header is capped at max_header bytes (0: the format's own cap). */
int hubfile_copy_global_set(const char *root, const char *dir, uint64_t max_header, dl_error *err);
/* Removes dir and the files in it (a local copy of ours: state_dir); 0 or a negative code. */
int hubfile_remove_dir(const char *dir, dl_error *err);
/* Copies a file (a trusted path: the operator's init model) to dst atomically (temp in dst's directory,
 * fsync, rename, fsync of the directory). */
int hubfile_copy(const char *src, const char *dst, dl_error *err);

#endif
