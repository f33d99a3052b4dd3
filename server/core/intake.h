/* intake: turns a delta file found by a transport into a validated copy in the cache, reading it
 * once: the header is checked first (staleness, metadata, path, keys, shapes, dtypes) so a stale or
 * wrong delta costs only its header; then the data is streamed into a temporary file with the
 * finite-value check on the way, fsynced, and linked into cache/deltas/s<step>/<node>/.
 * A file that is still being written (shorter than its header says, or changing during the copy)
 * is reported INCOMPLETE for the caller to retry.  Blocking: runs on the thread pool.
 *
 * Zero-copy for a shared tree (hub_root set, a single file): when the state root is on the same
 * filesystem, the file is validated by reading it and then hard-linked into the cache, not copied and
 * not fsynced (the daemon fsyncs a round's deltas beside its pass, before the commit).  The cache entry
 * is then the worker's own inode, so intake reports linked = 1 and the version it validated (ident):
 * the daemon checks it again before and after the pass, and a file rewritten in place is taken in
 * again, never aggregated torn.  Across filesystems (EXDEV), or where links are refused (EPERM:
 * protected_hardlinks and a file of another user), it copies as before and says why in link_errno.
 * A cache entry with more than one link met at a restart (in_cache) is read in full again, the tree
 * may have changed it while dilocod was down.
 *
 * A sharded delta (st_index.h) is taken in through its index, src_path ending in ST_INDEX_SUFFIX:
 * the index alone decides stale, future and duplicate; then every shard it lists (in the index's
 * directory, under its own name) is checked and copied like a single file into a staging directory
 * cache/incoming/intake-XXXXXX (removed afterwards; what a crash leaves, the store sweeps at
 * startup), the whole set is checked, and it is linked into the cache as
 * delta_<n>.safetensors.index.json with its shards delta_<n>-0000i-of-0000N.safetensors next to it
 * (shards first, index last: an index in the cache means its set is complete).  cache_path is then
 * the cached index; size counts every file, the version fields are the index's.  The index is read
 * and parsed here only when the request carries no parse of the version it opens (index), so a set
 * handed over again for a changed shard does not cost its index again. */
#ifndef INTAKE_H
#define INTAKE_H

#include <stdint.h>

#include "checksum.h"
#include "delta.h"
#include "delta_norm.h"
#include "dl_error.h"
#include "fsutil.h"
#include "index_parse.h"
#include "safetensors.h"

typedef enum intake_status {
    INTAKE_OK,              /* cache_path holds the validated delta */
    INTAKE_STALE,           /* base_outer_step more than max_staleness before step (info filled) */
    INTAKE_FUTURE,          /* base_outer_step > step (info filled) */
    INTAKE_DUPLICATE,       /* this node's delta of this local step is already in the cache */
    INTAKE_INCOMPLETE,      /* still being written: retry later */
    INTAKE_INVALID,         /* rejected: err says why */
    INTAKE_IO,              /* our side failed (disk full, ...): err says why; retry later */
} intake_status;

typedef struct intake_req {
    /* in */
    char *src_path;             /* the file to take in (named in messages) */
    char *rel_path;             /* its Hub path nodes/<id>/delta_<n>.safetensors, or NULL */
    char *hub_root;             /* non-NULL: src is rel_path in this shared tree, which others write: it is
                                   reached from the root without links and must be a regular file */
    uint64_t max_header;        /* cap on the safetensors header in bytes (0: the format's own cap) */
    const st_header *global;    /* the global model's header (read-only, shared) */
    uint64_t step;              /* current outer step */
#define INTAKE_STALE_BASE(r, base) ((base) < (r)->step && (r)->step - (base) > (r)->max_staleness)
    uint64_t max_staleness;     /* a base this many steps before step is still taken (0: sync mode, step only;
                                   async: the bound, UINT64_MAX none) */
    char *state_dir;            /* <state_root>/<id> */
    int in_cache;               /* src is already our validated cache copy (restart): check header only */
    int remove_src;             /* src is a download of ours: the daemon removes it afterwards */
    int no_link;                /* copy even where a link would do (tests; a transport's wish) */
    const ck_key *ck;           /* the state's checksum key: a linked delta's checksum goes into ident */
    index_parse *index;         /* a reference, or NULL: the set's index as the transport read it, used
                                   instead of reading it when the file opened is that version (index_parse.h) */
    /* out */
    intake_status status;
    dl_error err;
    delta_info info;
    char *cache_path;
    uint64_t size;
    int64_t mtime_ns;
    uint64_t ino;
    int linked;                 /* cache_path is a hard link to the shared tree's file: guard it with ident */
    fsu_ident ident;            /* the version validated, with its data's checksum (linked only) */
    int link_errno;             /* a link was tried and refused (EXDEV, EPERM ...): copied instead */
    int index_parsed;           /* a set's index was read and parsed (counted in dilocod_index_parses_total) */
    delta_norm norm;            /* the sums of squares of the values read (delta_norm.h): info.norm */
    int norm_unknown;           /* the data was not read (a cached set at a restart): info.has_norm 0 */
} intake_req;

/* Delta data at least this large is checked in place in two halves at once, the second on a thread of
 * its own, when no other check runs in the process: the last delta of a round is checked alone, on the
 * round's critical path, while the pool's other thread is idle.  Both halves read on the windows a single
 * check reads, and the verdict is the one a single check gives (the first non-finite value in file
 * order).  A variable so that the tests can run either way. */
extern uint64_t intake_split_min;

/* A delta's byte budget, one computation for every intake path (HTTP uploads, file://, s3://, hf://):
 * the data a delta of the model holds (intake_delta_bytes: every floating tensor in F32, C64 in 8
 * bytes, as /status's delta_bytes) plus the 8-byte prefix and one header cap.  A set's shards
 * together must fit it: N shards each with a header just under the cap would otherwise cost N caps
 * (16 shards of 16 MiB headers: 256 MiB per node per round). */
uint64_t intake_delta_bytes(const st_header *global);
uint64_t intake_set_budget(uint64_t delta_bytes, uint64_t max_header);
void intake_run(intake_req *r);
/* A compressed delta's codes in the file fd (header h, validated against global with info): each key
 * decoded with its scales and checked finite, its values' sums added to norm.  For an upload, whose
 * plain keys the stream checked (delta_stream.h).  INTAKE_OK, or the failure with err. */
intake_status intake_check_codes(const st_header *global, int fd, const st_header *h, delta_info *info,
                                 delta_norm *norm, dl_error *err);
const char *intake_status_name(intake_status s);
void intake_req_free(intake_req *r);
/* Links a finished, fsynced temporary file into the cache under the delta's final name (never
 * replacing one: INTAKE_DUPLICATE then, also when that delta is cached as a set).  The caller
 * removes tmp afterwards. */
intake_status intake_link_into_cache(const char *state_dir, const delta_info *info, const char *tmp,
                                     char **cache_path, dl_error *err);
/* Cache path of a delta: <state_dir>/cache/deltas/s<base>/<node>/delta_<local>.safetensors */
char *intake_cache_path(const char *state_dir, const delta_info *info);
/* Cache path of a sharded delta's index:
 * <state_dir>/cache/deltas/s<base>/<node>/delta_<local>.safetensors.index.json */
char *intake_cache_index_path(const char *state_dir, const delta_info *info);
/* The shards of a set staged in dir (the files ix names, which it takes) opened as one set, each
 * shard's descriptor held only while it is read (not every shard's at once: st_file_lazy), and
 * checked as a whole against the global's tensors: every listed tensor in its shard and in no other,
 * total_size, the metadata against rel, the keys against the global's floating ones (info, when not
 * NULL, receives the metadata).  *shard_bytes (when not NULL) receives the shards' sizes together.
 * The one check of a staged set: intake's (file://, hf://, s3://) and the HTTP upload's.
 * INTAKE_OK and *set; INTAKE_INVALID (the set's fault) or INTAKE_IO (ours), err says why. */
intake_status intake_check_set_dir(const char *dir, st_index *ix, const st_tensor *const *global, size_t nglobal,
                                   const char *rel, delta_info *info, st_set **set, uint64_t *shard_bytes,
                                   dl_error *err);
/* Links a checked, fsynced set into the cache: dir/<every shard ix lists>, then
 * dir/<ix->base>.safetensors.index.json, under the same names in the node's cache directory (ix->base
 * must be delta_<local>: the index's text names its shards), then fsyncs that directory.
 * INTAKE_DUPLICATE when this node's delta of this local step is already cached in either layout.
 * *cache_path receives the cached index's path.  The caller removes dir afterwards. */
intake_status intake_link_set_into_cache(const char *state_dir, const delta_info *info, const char *dir,
                                         const st_index *ix, char **cache_path, dl_error *err);

#endif
