/* fsutil: durable, atomic file replacement and the small filesystem helpers around it. */
#ifndef FSUTIL_H
#define FSUTIL_H

#include <stddef.h>
#include <stdint.h>

#include "dl_error.h"

/* Creates a new temporary file in the directory of path (".<base>.tmp-<pid>-<n>"), mode 0644.
 * *tmp_path is malloc'd.  The caller renames it over path (fsu_commit_tmp) or unlinks it. */
int fsu_tmp_create(const char *path, char **tmp_path, int *fd, dl_error *err);
/* fsync(fd), close(fd), rename(tmp, path), fsync of path's directory.  Closes fd in every case and
 * unlinks tmp on failure. */
int fsu_commit_tmp(int fd, const char *tmp_path, const char *path, dl_error *err);
/* fsync of the directory that contains path. */
int fsu_fsync_parent(const char *path, dl_error *err);
/* Writes buf to path atomically: temp file, fsync, rename, fsync of the directory. */
int fsu_write_atomic(const char *path, const void *buf, size_t len, dl_error *err);
/* mkdir -p (mode 0755). */
int fsu_mkdirs(const char *dir, dl_error *err);
/* pwrite/pread the whole range, retrying on EINTR and short transfers; short read at EOF is an error. */
int fsu_pwrite_all(int fd, const void *buf, size_t len, uint64_t off);
int fsu_pread_all(int fd, void *buf, size_t len, uint64_t off);

#endif
