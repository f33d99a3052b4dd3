#include "fsutil.h"

#include <errno.h>
#include <fcntl.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

static atomic_uint tmp_counter;

static char *dir_of(const char *path)
{
    const char *slash = strrchr(path, '/');
    if (slash == NULL)
        return strdup(".");
    if (slash == path)
        return strdup("/");
    return strndup(path, (size_t)(slash - path));
}

int fsu_tmp_create(const char *path, char **tmp_path, int *fd, dl_error *err)
{
    const char *slash = strrchr(path, '/');
    const char *base = slash ? slash + 1 : path;
    size_t dlen = slash ? (size_t)(slash - path) + 1 : 0;
    size_t cap = strlen(path) + 64;
    char *t = malloc(cap);

    if (t == NULL)
        return dl_fail(err, DL_E_NO_MEMORY, NULL, 0, "out of memory");
    for (int attempt = 0; attempt < 100; attempt++) {
        snprintf(t, cap, "%.*s.%s.tmp-%ld-%u", (int)dlen, path, base, (long)getpid(),
                 atomic_fetch_add(&tmp_counter, 1));
        int f = open(t, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
        if (f >= 0) {
            *fd = f;
            *tmp_path = t;
            return 0;
        }
        if (errno != EEXIST) {
            int e = errno;
            dl_fail_errno(err, e, "cannot create a temporary file next to %s", path);
            free(t);
            return -DL_E_IO;
        }
    }
    free(t);
    return dl_fail(err, DL_E_IO, NULL, 0, "cannot create a unique temporary file next to %s", path);
}

int fsu_fsync_parent(const char *path, dl_error *err)
{
    char *dir = dir_of(path);
    int fd, rc = 0;

    if (dir == NULL)
        return dl_fail(err, DL_E_NO_MEMORY, NULL, 0, "out of memory");
    fd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0) {
        rc = dl_fail_errno(err, errno, "cannot open directory %s", dir);
    } else {
        if (fsync(fd) != 0 && errno != EINVAL)
            rc = dl_fail_errno(err, errno, "fsync of directory %s", dir);
        close(fd);
    }
    free(dir);
    return rc;
}

int fsu_commit_tmp(int fd, const char *tmp_path, const char *path, dl_error *err)
{
    if (fsync(fd) != 0) {
        int e = errno;
        close(fd);
        unlink(tmp_path);
        return dl_fail_errno(err, e, "fsync of %s", tmp_path);
    }
    if (close(fd) != 0) {
        int e = errno;
        unlink(tmp_path);
        return dl_fail_errno(err, e, "close of %s", tmp_path);
    }
    if (rename(tmp_path, path) != 0) {
        int e = errno;
        unlink(tmp_path);
        return dl_fail_errno(err, e, "rename %s -> %s", tmp_path, path);
    }
    return fsu_fsync_parent(path, err);
}

int fsu_rename_tmp(int fd, const char *tmp_path, const char *path, dl_error *err)
{
    if (close(fd) != 0) {
        int e = errno;
        unlink(tmp_path);
        return dl_fail_errno(err, e, "close of %s", tmp_path);
    }
    if (rename(tmp_path, path) != 0) {
        int e = errno;
        unlink(tmp_path);
        return dl_fail_errno(err, e, "rename %s -> %s", tmp_path, path);
    }
    return 0;
}

int fsu_fsync_path(const char *path, dl_error *err)
{
    int fd = open(path, O_RDONLY | O_CLOEXEC);

    if (fd < 0)
        return dl_fail_errno(err, errno, "cannot open %s", path);
    if (fsync(fd) != 0) {
        int e = errno;
        close(fd);
        return dl_fail_errno(err, e, "fsync of %s", path);
    }
    close(fd);
    return 0;
}

void fsu_ident_of(const struct stat *sb, fsu_ident *out)
{
    out->dev = (uint64_t)sb->st_dev;
    out->ino = (uint64_t)sb->st_ino;
    out->size = (uint64_t)sb->st_size;
    out->mtime_ns = (int64_t)sb->st_mtim.tv_sec * 1000000000 + sb->st_mtim.tv_nsec;
    out->ctime_ns = (int64_t)sb->st_ctim.tv_sec * 1000000000 + sb->st_ctim.tv_nsec;
}

int fsu_ident_check(const char *path, const fsu_ident *id)
{
    struct stat sb;
    fsu_ident now;

    if (lstat(path, &sb) != 0)
        return errno == ENOENT || errno == ENOTDIR ? FSU_IDENT_CHANGED : -errno;
    fsu_ident_of(&sb, &now);
    return fsu_ident_compare(&now, id);
}

int fsu_ident_same_content(const fsu_ident *a, const fsu_ident *b)
{
    return a->dev == b->dev && a->ino == b->ino && a->size == b->size && a->mtime_ns == b->mtime_ns;
}

int fsu_ident_compare(const fsu_ident *a, const fsu_ident *b)
{
    if (!fsu_ident_same_content(a, b))
        return FSU_IDENT_CHANGED;
    if (a->ctime_ns != b->ctime_ns && a->ctime_ns != FSU_CTIME_UNKNOWN && b->ctime_ns != FSU_CTIME_UNKNOWN)
        return FSU_IDENT_CTIME_MOVED;
    return FSU_IDENT_SAME;
}

int fsu_link_fd(int fd, int dirfd, const char *name)
{
    char fdpath[64];

    snprintf(fdpath, sizeof(fdpath), "/proc/self/fd/%d", fd);
    return linkat(AT_FDCWD, fdpath, dirfd, name, AT_SYMLINK_FOLLOW) == 0 ? 0 : errno;
}

int fsu_pwrite_all(int fd, const void *buf, size_t len, uint64_t off)
{
    const char *p = buf;

    while (len > 0) {
        ssize_t w = pwrite(fd, p, len, (off_t)off);
        if (w < 0) {
            if (errno == EINTR)
                continue;
            return -errno;
        }
        if (w == 0)
            return -EIO;
        p += w;
        len -= (size_t)w;
        off += (uint64_t)w;
    }
    return 0;
}

int fsu_pread_all(int fd, void *buf, size_t len, uint64_t off)
{
    char *p = buf;

    while (len > 0) {
        ssize_t r = pread(fd, p, len, (off_t)off);
        if (r < 0) {
            if (errno == EINTR)
                continue;
            return -errno;
        }
        if (r == 0)
            return -ENODATA;        /* the file shrank under us */
        p += r;
        len -= (size_t)r;
        off += (uint64_t)r;
    }
    return 0;
}

int fsu_write_atomic(const char *path, const void *buf, size_t len, dl_error *err)
{
    char *tmp;
    int fd, rc;

    if ((rc = fsu_tmp_create(path, &tmp, &fd, err)) != 0)
        return rc;
    if ((rc = fsu_pwrite_all(fd, buf, len, 0)) != 0) {
        dl_fail_errno(err, -rc, "write of %s", tmp);
        close(fd);
        unlink(tmp);
        free(tmp);
        return -DL_E_IO;
    }
    rc = fsu_commit_tmp(fd, tmp, path, err);
    free(tmp);
    return rc;
}

int fsu_mkdirs(const char *dir, dl_error *err)
{
    char *p;
    int rc = 0;

    if (dir[0] == '\0')
        return 0;
    p = strdup(dir);
    if (p == NULL)
        return dl_fail(err, DL_E_NO_MEMORY, NULL, 0, "out of memory");
    for (char *s = p + 1;; s++) {
        if (*s == '/' || *s == '\0') {
            char saved = *s;
            *s = '\0';
            if (mkdir(p, 0755) != 0 && errno != EEXIST) {
                rc = dl_fail_errno(err, errno, "cannot create directory %s", p);
                break;
            }
            *s = saved;
            if (saved == '\0')
                break;
        }
    }
    free(p);
    return rc;
}

/* ---- reading a tree that other people write ---------------------------------------------------- */

/* One path component: a name that cannot climb out of its directory or cross into another. */
static int plain_name(const char *name)
{
    return name[0] != '\0' && strchr(name, '/') == NULL && strcmp(name, ".") != 0 && strcmp(name, "..") != 0;
}

/* The errno that names a non-regular type (see fsutil.h). */
static int kind_errno(mode_t mode)
{
    if (S_ISLNK(mode))
        return -ELOOP;
    if (S_ISDIR(mode))
        return -EISDIR;
    return -EINVAL;
}

const char *fsu_kind_name(mode_t mode)
{
    switch (mode & S_IFMT) {
    case S_IFREG: return "a regular file";
    case S_IFDIR: return "a directory";
    case S_IFLNK: return "a symbolic link";
    case S_IFIFO: return "a FIFO";
    case S_IFSOCK: return "a socket";
    case S_IFCHR: return "a character device";
    case S_IFBLK: return "a block device";
    }
    return "not a file";
}

int fsu_open_dir_at(int dirfd, const char *name, int *fd)
{
    struct stat sb;
    int f;

    *fd = -1;
    if (!plain_name(name))
        return -EINVAL;
    /* O_DIRECTORY is checked before any open side effect (a FIFO is refused, not waited on) */
    f = openat(dirfd, name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
    if (f < 0) {
        int e = errno;
        /* name the reason the same way whatever the kernel said for a link with O_DIRECTORY */
        if ((e == ENOTDIR || e == ELOOP) && fstatat(dirfd, name, &sb, AT_SYMLINK_NOFOLLOW) == 0)
            return S_ISLNK(sb.st_mode) ? -ELOOP : -ENOTDIR;
        return -e;
    }
    *fd = f;
    return 0;
}

int fsu_open_file_at(int dirfd, const char *name, int *fd, struct stat *sb)
{
    int f;

    *fd = -1;
    memset(sb, 0, sizeof(*sb));
    if (!plain_name(name))
        return -EINVAL;
    if (fstatat(dirfd, name, sb, AT_SYMLINK_NOFOLLOW) != 0)
        return -errno;
    if (!S_ISREG(sb->st_mode))
        return kind_errno(sb->st_mode);
    /* swapped for something else since the fstatat: O_NOFOLLOW refuses a link, O_NONBLOCK keeps a
     * FIFO from blocking the open, and the fstat below refuses it */
    f = openat(dirfd, name, O_RDONLY | O_NONBLOCK | O_NOFOLLOW | O_NOCTTY | O_CLOEXEC);
    if (f < 0) {
        int e = errno;
        if (e == ELOOP)
            sb->st_mode = S_IFLNK;
        return -e;
    }
    if (fstat(f, sb) != 0) {
        int e = errno;
        close(f);
        return -e;
    }
    if (!S_ISREG(sb->st_mode)) {
        close(f);
        return kind_errno(sb->st_mode);
    }
    *fd = f;
    return 0;
}

int fsu_open_path_at(int dirfd, const char *rel, int *fd, struct stat *sb)
{
    char name[256];
    const char *p = rel;
    int cur = dirfd, rc;

    *fd = -1;
    memset(sb, 0, sizeof(*sb));
    for (;;) {
        const char *slash = strchr(p, '/');
        if (slash == NULL)
            break;
        size_t len = (size_t)(slash - p);
        if (len == 0 || len >= sizeof(name)) {
            rc = len == 0 ? -EINVAL : -ENAMETOOLONG;
            goto out;
        }
        memcpy(name, p, len);
        name[len] = '\0';
        int next;
        if ((rc = fsu_open_dir_at(cur, name, &next)) != 0) {
            if (rc == -ELOOP)
                sb->st_mode = S_IFLNK;
            goto out;
        }
        if (cur != dirfd)
            close(cur);
        cur = next;
        p = slash + 1;
    }
    rc = fsu_open_file_at(cur, p, fd, sb);
out:
    if (cur != dirfd)
        close(cur);
    return rc;
}

int fsu_read_fd_capped(int fd, char *buf, size_t cap, size_t *len)
{
    size_t got = 0;

    *len = 0;
    /* read to EOF but never more than cap + 1 bytes: a file growing under us is refused, not
     * followed without end */
    while (got <= cap) {
        ssize_t r = read(fd, buf + got, cap + 1 - got);
        if (r < 0 && errno == EINTR)
            continue;
        if (r < 0)
            return -errno;
        if (r == 0)
            break;
        got += (size_t)r;
    }
    if (got > cap)
        return -EFBIG;
    buf[got] = '\0';
    *len = got;
    return 0;
}

int fsu_read_small_at(int dirfd, const char *name, char *buf, size_t cap, size_t *len, struct stat *sb)
{
    int fd, rc;

    *len = 0;
    if ((rc = fsu_open_file_at(dirfd, name, &fd, sb)) != 0)
        return rc;
    rc = (uint64_t)sb->st_size > cap ? -EFBIG : fsu_read_fd_capped(fd, buf, cap, len);
    close(fd);
    return rc;
}

int fsu_tmp_create_at(int dirfd, const char *name, char **tmp_name, int *fd)
{
    size_t cap = strlen(name) + 64;
    char *t;

    *fd = -1;
    *tmp_name = NULL;
    if (!plain_name(name))
        return -EINVAL;
    if ((t = malloc(cap)) == NULL)
        return -ENOMEM;
    for (int attempt = 0; attempt < 100; attempt++) {
        snprintf(t, cap, ".%s.tmp-%ld-%u", name, (long)getpid(), atomic_fetch_add(&tmp_counter, 1));
        /* O_EXCL: a link planted under this name is never written through */
        int f = openat(dirfd, t, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0644);
        if (f >= 0) {
            *fd = f;
            *tmp_name = t;
            return 0;
        }
        if (errno != EEXIST) {
            int e = errno;
            free(t);
            return -e;
        }
    }
    free(t);
    return -EEXIST;
}

int fsu_commit_tmp_at(int dirfd, int fd, const char *tmp_name, const char *name)
{
    int e;

    if (fsync(fd) != 0) {
        e = errno;
        close(fd);
        goto fail;
    }
    if (close(fd) != 0) {
        e = errno;
        goto fail;
    }
    /* renameat replaces whatever entry holds name (a link, a FIFO) and never follows it */
    if (renameat(dirfd, tmp_name, dirfd, name) != 0) {
        e = errno;
        goto fail;
    }
    if (fsync(dirfd) != 0 && errno != EINVAL)
        return -errno;
    return 0;
fail:
    unlinkat(dirfd, tmp_name, 0);
    return -e;
}

int fsu_write_atomic_at(int dirfd, const char *name, const void *buf, size_t len)
{
    char *tmp;
    int fd, rc;

    if ((rc = fsu_tmp_create_at(dirfd, name, &tmp, &fd)) != 0)
        return rc;
    if ((rc = fsu_pwrite_all(fd, buf, len, 0)) != 0) {
        close(fd);
        unlinkat(dirfd, tmp, 0);
    } else {
        rc = fsu_commit_tmp_at(dirfd, fd, tmp, name);
    }
    free(tmp);
    return rc;
}

int fsu_check_regular_file(const char *path, dl_error *err)
{
    struct stat sb;

    if (stat(path, &sb) != 0)
        return dl_fail(err, DL_E_IO, NULL, 0, "cannot read %s: %s", path, strerror(errno));
    if (!S_ISREG(sb.st_mode))
        return dl_fail(err, DL_E_IO, NULL, 0, "%s is not a regular file", path);
    if (access(path, R_OK) != 0)
        return dl_fail(err, DL_E_IO, NULL, 0, "cannot read %s: %s", path, strerror(errno));
    return 0;
}

int fsu_check_dir_path(const char *path, dl_error *err)
{
    char *p = strdup(path), *slash;
    struct stat sb;
    int rc = 0;

    if (p == NULL)
        return dl_fail(err, DL_E_NO_MEMORY, NULL, 0, "out of memory");
    for (;;) {
        if (stat(p, &sb) == 0) {
            if (!S_ISDIR(sb.st_mode))
                rc = dl_fail(err, DL_E_IO, NULL, 0, "%s: %s is not a directory", path, p);
            break;
        }
        if (errno == ENOTDIR) {
            rc = dl_fail(err, DL_E_IO, NULL, 0, "%s: a part of the path is not a directory", path);
            break;
        }
        if (errno != ENOENT) {
            rc = dl_fail(err, DL_E_IO, NULL, 0, "%s: %s", strcmp(p, path) == 0 ? path : p, strerror(errno));
            break;
        }
        if ((slash = strrchr(p, '/')) == NULL || slash == p)
            break;              /* a relative first part, or /: nothing above it to check */
        *slash = '\0';
    }
    free(p);
    return rc;
}
