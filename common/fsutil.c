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
