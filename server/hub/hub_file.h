/* hub_file: the file:// transport, a directory laid out like the Hub repo (a shared filesystem).
 *   nodes/<node_id>/delta_<local_step>.safetensors   written by workers
 *   global/latest.safetensors, global/step_count.json published here (temp + rename, step file last)
 * The tree is written by other people: below the root nothing is reached through a symbolic link
 * and nothing but directories and regular files is opened (a FIFO would block, a link may lead out
 * of the tree).  Blocking functions: the daemon runs them on the thread pool. */
#ifndef HUB_FILE_H
#define HUB_FILE_H

#include <stddef.h>
#include <stdint.h>

#include "dl_error.h"

typedef struct hub_candidate {
    char *rel;                  /* nodes/<id>/delta_<n>.safetensors (strictly parsed), or the refused entry */
    char *abs;
    uint64_t size;              /* identity of this version (lstat) */
    int64_t mtime_ns;
    uint64_t ino;
    char *refused;              /* non-NULL: junk in the tree (a link, a FIFO, ...), never read: why */
    int node_dir;               /* 1: not a delta but a node directory the scan read (rel nodes/<id>),
                                   for the transport to watch */
} hub_candidate;

/* Lists the delta files under root/nodes (per node directory the newest few by local step), the node
 * directories it read, and the entries it refused to read (a node directory that is a link, a delta
 * that is a FIFO, a file whose name is not a delta's, ...). */
int hubfile_scan(const char *root, hub_candidate **out, size_t *n, dl_error *err);
void hub_candidates_free(hub_candidate *c, size_t n);
/* The published step, if root/global/step_count.json and latest.safetensors exist (*present = 0 if not). */
int hubfile_read_published(const char *root, int *present, uint64_t *step, dl_error *err);
/* Copies src to root/global/latest.safetensors, then writes step_count.json, each atomically. */
int hubfile_publish(const char *root, const char *src, uint64_t step, const char *optimizer, int bootstrap,
                    dl_error *err);
/* Removes root/rel (a delta path, strictly parsed, reached without links) if it is still the version
 * (size, mtime, inode) that was taken in.  0 removed or already gone, 1 kept (another version), or a
 * negative code. */
int hubfile_remove_delta(const char *root, const char *rel, uint64_t size, int64_t mtime, uint64_t ino,
                         dl_error *err);
/* Removes temporary files a publish cut short (a crash) left in root/global (startup only). */
int hubfile_cleanup_temps(const char *root, dl_error *err);
/* Copies root/global/latest.safetensors (reached without links, a regular file whose header
 * parses) to dst atomically; fails if it changed during the copy.  The caller validates dst. */
int hubfile_copy_global(const char *root, const char *dst, dl_error *err);
/* Copies a file (a trusted path: the operator's init model) to dst atomically (temp in dst's directory, fsync, rename, fsync of the directory). */
int hubfile_copy(const char *src, const char *dst, dl_error *err);

#endif
