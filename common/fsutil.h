/* fsutil: durable, atomic file replacement and the small filesystem helpers around it. */
#ifndef FSUTIL_H
#define FSUTIL_H

#include <stddef.h>
#include <stdint.h>

#include <sys/stat.h>

#include "dl_error.h"

/* Creates a new temporary file in the directory of path (".<base>.tmp-<pid>-<n>"), mode 0644.
 * *tmp_path is malloc'd.  The caller renames it over path (fsu_commit_tmp) or unlinks it. */
int fsu_tmp_create(const char *path, char **tmp_path, int *fd, dl_error *err);
/* fsync(fd), close(fd), rename(tmp, path), fsync of path's directory.  Closes fd in every case and
 * unlinks tmp on failure. */
int fsu_commit_tmp(int fd, const char *tmp_path, const char *path, dl_error *err);
/* fsync of the directory that contains path. */
int fsu_fsync_parent(const char *path, dl_error *err);
/* fsu_commit_tmp without the durability: close and rename only (the caller makes it durable later
 * with fsu_fsync_path and fsu_fsync_parent, or can recreate it after a crash). */
int fsu_rename_tmp(int fd, const char *tmp_path, const char *path, dl_error *err);
/* fsync of a file by path. */
int fsu_fsync_path(const char *path, dl_error *err);
/* Writes buf to path atomically: temp file, fsync, rename, fsync of the directory. */
int fsu_write_atomic(const char *path, const void *buf, size_t len, dl_error *err);
/* mkdir -p (mode 0755). */
int fsu_mkdirs(const char *dir, dl_error *err);
/* One version of a file, as fstat sees it: a write moves mtime (to the nanosecond), but the file's owner
 * can put mtime back (utimensat); ctime it cannot, every write and every utimensat moves it.  A link
 * count change moves ctime too (a worker removing its file, our own links), so ctime is compared only
 * between two moments with no link of ours in between.  sum is the content checksum of that version
 * (checksum.h) when has_sum: identity is not integrity, only the bytes prove the bytes. */
typedef struct fsu_ident {
    uint64_t dev, ino, size;
    int64_t mtime_ns;
    int64_t ctime_ns;           /* FSU_CTIME_UNKNOWN: not recorded (a record of an earlier version) */
    uint64_t sum;
    int has_sum;
} fsu_ident;
#define FSU_CTIME_UNKNOWN INT64_MIN
/* Fills the identity fields (not sum and has_sum, which it leaves alone). */
void fsu_ident_of(const struct stat *sb, fsu_ident *out);
/* What fsu_ident_check says: the same version, or only its ctime moved (rewritten with its mtime put
 * back, re-linked, chmod'ed: its content cannot be told from its identity). */
enum { FSU_IDENT_CHANGED = 0, FSU_IDENT_SAME = 1, FSU_IDENT_CTIME_MOVED = 2 };
/* FSU_IDENT_* for path (a last-component link is not followed) against id: CHANGED also when it is gone;
 * a negative errno when it cannot be told. */
int fsu_ident_check(const char *path, const fsu_ident *id);
/* Whether two versions are the same one: FSU_IDENT_*. */
int fsu_ident_compare(const fsu_ident *a, const fsu_ident *b);
/* Whether two versions have the same device, inode, size and mtime (ctime not compared). */
int fsu_ident_same_content(const fsu_ident *a, const fsu_ident *b);
/* Hard-links the open file fd as dirfd/name (AT_FDCWD: name is a path): through the descriptor, so the
 * very inode that was read is linked whatever its names became meanwhile (linkat's AT_EMPTY_PATH needs a
 * privilege; /proc/self/fd/N with AT_SYMLINK_FOLLOW does not).  0, or the errno of the failed linkat
 * (EXDEV on another filesystem, EPERM where protected_hardlinks refuses, EEXIST ...). */
int fsu_link_fd(int fd, int dirfd, const char *name);
/* pwrite/pread the whole range, retrying on EINTR and short transfers; short read at EOF is an error. */
int fsu_pwrite_all(int fd, const void *buf, size_t len, uint64_t off);
int fsu_pread_all(int fd, void *buf, size_t len, uint64_t off);

/* ---- reading a tree that other people write -------------------------------------------------
 * Everything below a trusted directory descriptor is reached with openat, one component at a
 * time, never following a symbolic link (O_NOFOLLOW covers only the last component of a path, so
 * a path string is never handed to open()), and never opening anything but a directory or a
 * regular file: a FIFO would block open() or read() for good, a device may act on open.
 * All of them return 0 or a negative errno. */

/* Opens the directory name under dirfd.  -ELOOP if it is a symbolic link, -ENOTDIR if it is
 * anything else that is not a directory. */
int fsu_open_dir_at(int dirfd, const char *name, int *fd);
/* Opens the regular file name under dirfd read-only (O_NONBLOCK|O_NOFOLLOW|O_CLOEXEC); *sb is its
 * fstat.  The type is checked before the open (so a device or a FIFO is never opened) and after it
 * (the entry may be swapped in between).  -ELOOP for a symbolic link, -EISDIR for a directory,
 * -EINVAL for any other non-regular file; then sb->st_mode holds what was found (fsu_kind_name). */
int fsu_open_file_at(int dirfd, const char *name, int *fd, struct stat *sb);
/* fsu_open_file_at for a relative path "a/b/file": every directory component through
 * fsu_open_dir_at.  Empty, "." and ".." components are refused with -EINVAL (sb->st_mode 0). */
int fsu_open_path_at(int dirfd, const char *rel, int *fd, struct stat *sb);
/* Reads the whole regular file name under dirfd into buf (cap bytes at most, NUL-terminated, so
 * buf holds cap + 1).  -EFBIG if the file holds more than cap bytes, also if it grows while read. */
int fsu_read_small_at(int dirfd, const char *name, char *buf, size_t cap, size_t *len, struct stat *sb);
/* Reads fd from its offset to EOF into buf (cap bytes at most, NUL-terminated, so buf holds cap + 1):
 * 0, -EFBIG when it holds more than cap bytes (also a file growing while read: never followed without
 * end), or -errno.  The one capped read of a small file (fsu_read_small_at, keys, indexes). */
int fsu_read_fd_capped(int fd, char *buf, size_t cap, size_t *len);
/* "a FIFO", "a symbolic link", ... for a log message about a refused entry. */
const char *fsu_kind_name(mode_t mode);

/* Atomic replacement inside a directory descriptor: a new temporary ".<name>.tmp-<pid>-<n>"
 * (O_EXCL, so never through a planted link), then fsync, renameat over name, fsync of the
 * directory.  *tmp_name is malloc'd.  fsu_commit_tmp_at closes fd and removes tmp on failure. */
int fsu_tmp_create_at(int dirfd, const char *name, char **tmp_name, int *fd);
int fsu_commit_tmp_at(int dirfd, int fd, const char *tmp_name, const char *name);
int fsu_write_atomic_at(int dirfd, const char *name, const void *buf, size_t len);

/* Configuration checks (nothing is created).  path must be a regular file this process can read: a
 * FIFO or a device would hold a reader that opens without O_NONBLOCK.  0 or -DL_E_IO with why. */
int fsu_check_regular_file(const char *path, dl_error *err);
/* Every part of path that exists must be a directory (so that the directories below it can be
 * made); writability is not checked.  0 or -DL_E_IO with why. */
int fsu_check_dir_path(const char *path, dl_error *err);

#endif
