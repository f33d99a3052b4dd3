/* hub_file_internal.h: what the file:// tree's files share (hub_file.c the scan, hub_file_global.c
 * the global read and copied out, hub_file_publish.c the writes, hub_file_downlink.c the downlink's), for those files only. */
#ifndef HUB_FILE_INTERNAL_H
#define HUB_FILE_INTERNAL_H

#include <stdint.h>
#include <sys/stat.h>

#include "dl_error.h"
#include "hub_file.h"

int64_t hubfile__mtime_ns(const struct stat *sb);
/* The trusted start of every walk. */
int hubfile__open_root(const char *root, int *fd, dl_error *err);
/* Why an entry of the tree is not read, for the log line that reports it (malloc'd, NULL: no memory). */
char *hubfile__refusal(int rc, const struct stat *sb, const char *want);
/* The shard count an index lists, 0 if it does not parse (or cannot be read as a regular file). */
uint32_t hubfile__read_index_count(int dirfd, const char *name, const char *base);
/* The shards of base (nshards of them) in dirfd, folded into c's identity (see hub_candidate). */
void hubfile__fold_shards(int dirfd, const char *base, uint32_t nshards, hub_candidate *c, int *partial);
/* Copies size bytes of in (from offset 0) into out. */
int hubfile__copy_fd(int in, int out, uint64_t size);
/* Opens root/global as a directory of the tree, never through a link: *fd = -1 if it is missing. */
/* Publishes src (our own state's file) as name in dirfd (a directory of root's tree) atomically: linked
 * where the filesystems allow, else copied. */
int hubfile__publish_one(int dirfd, const char *root, const char *src, const char *name, dl_error *err);
int hubfile__open_global_dir(const char *root, int rootfd, int *fd, dl_error *err);

#endif
