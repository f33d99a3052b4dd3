#include "hub_file.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "delta.h"
#include "fsutil.h"
#include "stepcount.h"

#define MAX_CANDIDATES 1000000

void hub_candidates_free(hub_candidate *c, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        free(c[i].rel);
        free(c[i].abs);
    }
    free(c);
}

static int push(hub_candidate **v, size_t *n, size_t *cap, hub_candidate *c)
{
    if (*n >= MAX_CANDIDATES)
        return -E2BIG;
    if (*n == *cap) {
        size_t nc = *cap ? *cap * 2 : 64;
        hub_candidate *nv = realloc(*v, nc * sizeof(*nv));
        if (nv == NULL)
            return -ENOMEM;
        *v = nv;
        *cap = nc;
    }
    (*v)[(*n)++] = *c;
    return 0;
}

int hubfile_scan(const char *root, hub_candidate **out, size_t *count, dl_error *err)
{
    char *nodes = NULL;
    DIR *top;
    struct dirent *e;
    hub_candidate *v = NULL;
    size_t n = 0, cap = 0;
    int rc = 0;

    *out = NULL;
    *count = 0;
    if (asprintf(&nodes, "%s/nodes", root) < 0)
        return dl_fail(err, DL_E_NO_MEMORY, NULL, 0, "out of memory");
    top = opendir(nodes);
    if (top == NULL) {
        int e0 = errno;
        free(nodes);
        if (e0 == ENOENT)
            return 0;           /* no worker has written yet */
        return dl_fail_errno(err, e0, "cannot list %s/nodes", root);
    }
    while (rc == 0 && (e = readdir(top)) != NULL) {
        if (!delta_valid_node_id(e->d_name, strlen(e->d_name)))
            continue;
        char *sub = NULL;
        if (asprintf(&sub, "%s/%s", nodes, e->d_name) < 0) {
            rc = -ENOMEM;
            break;
        }
        DIR *d = opendir(sub);
        struct dirent *f;
        while (d != NULL && rc == 0 && (f = readdir(d)) != NULL) {
            hub_candidate c = {0};
            char id[DELTA_NODE_ID_MAX + 1];
            uint64_t step;
            struct stat sb;
            if (asprintf(&c.rel, "nodes/%s/%s", e->d_name, f->d_name) < 0) {
                c.rel = NULL;
                rc = -ENOMEM;
                break;
            }
            if (delta_parse_path(c.rel, id, &step, NULL) != 0 || asprintf(&c.abs, "%s/%s", root, c.rel) < 0 ||
                lstat(c.abs, &sb) != 0 || !S_ISREG(sb.st_mode)) {
                free(c.rel);
                if (c.abs)
                    free(c.abs);
                continue;
            }
            c.size = (uint64_t)sb.st_size;
            c.mtime_ns = (int64_t)sb.st_mtim.tv_sec * 1000000000 + sb.st_mtim.tv_nsec;
            c.ino = (uint64_t)sb.st_ino;
            if ((rc = push(&v, &n, &cap, &c)) != 0) {
                free(c.rel);
                free(c.abs);
            }
        }
        if (d != NULL)
            closedir(d);
        free(sub);
    }
    closedir(top);
    free(nodes);
    if (rc != 0) {
        hub_candidates_free(v, n);
        return dl_fail_errno(err, -rc, "scanning %s/nodes", root);
    }
    *out = v;
    *count = n;
    return 0;
}

char *hubfile_global_path(const char *root)
{
    char *p = NULL;
    if (asprintf(&p, "%s/global/latest.safetensors", root) < 0)
        return NULL;
    return p;
}

int hubfile_read_published(const char *root, int *present, uint64_t *step, dl_error *err)
{
    char *path = NULL, *global = hubfile_global_path(root);
    char buf[4096];
    int fd, rc;
    ssize_t len;

    *present = 0;
    if (global == NULL || asprintf(&path, "%s/global/step_count.json", root) < 0) {
        free(global);
        return dl_fail(err, DL_E_NO_MEMORY, NULL, 0, "out of memory");
    }
    fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
        rc = errno == ENOENT ? 0 : dl_fail_errno(err, errno, "cannot open %s", path);
        goto out;
    }
    len = read(fd, buf, sizeof(buf));
    close(fd);
    if (len < 0 || (size_t)len >= sizeof(buf)) {
        rc = dl_fail(err, DL_E_METADATA_INVALID, NULL, 0, "%s is unreadable or larger than %zu bytes", path,
                     sizeof(buf));
        goto out;
    }
    if ((rc = stepcount_parse(buf, (size_t)len, step, NULL, err)) != 0)
        goto out;
    if (access(global, R_OK) != 0) {
        rc = dl_fail(err, DL_E_IO, NULL, 0, "%s names step %llu but %s is missing", path, (unsigned long long)*step,
                     global);
        goto out;
    }
    *present = 1;
out:
    free(path);
    free(global);
    return rc;
}

int hubfile_copy(const char *src, const char *dst, dl_error *err)
{
    int in, out = -1, rc;
    char *tmp = NULL;
    struct stat sb;
    off_t left;

    in = open(src, O_RDONLY | O_CLOEXEC);
    if (in < 0)
        return dl_fail_errno(err, errno, "cannot open %s", src);
    if (fstat(in, &sb) != 0) {
        rc = dl_fail_errno(err, errno, "cannot stat %s", src);
        goto out;
    }
    if ((rc = fsu_tmp_create(dst, &tmp, &out, err)) != 0)
        goto out;
    left = sb.st_size;
    while (left > 0) {
        /* kernel-side copy: no trip through user space, reflinks where the filesystem can */
        ssize_t w = copy_file_range(in, NULL, out, NULL, (size_t)left, 0);
        if (w < 0 && errno == EINTR)
            continue;
        if (w < 0 && (errno == EXDEV || errno == ENOSYS || errno == EOPNOTSUPP || errno == EINVAL)) {
            char buf[1 << 16];
            ssize_t r = read(in, buf, sizeof(buf));
            if (r > 0 && fsu_pwrite_all(out, buf, (size_t)r, (uint64_t)(sb.st_size - left)) == 0) {
                left -= r;
                continue;
            }
            w = -1;
            if (r == 0)
                errno = ENODATA;
        }
        if (w <= 0) {
            rc = dl_fail_errno(err, w == 0 ? ENODATA : errno, "copying %s to %s", src, tmp);
            goto out;
        }
        left -= w;
    }
    rc = fsu_commit_tmp(out, tmp, dst, err);
    out = -1;
out:
    if (out >= 0) {
        close(out);
        unlink(tmp);
    }
    free(tmp);
    close(in);
    return rc;
}

int hubfile_publish(const char *root, const char *src, uint64_t step, const char *optimizer, int bootstrap,
                    dl_error *err)
{
    char *dir = NULL, *global = hubfile_global_path(root), *stepfile = NULL, *text = NULL;
    int rc;

    if (global == NULL || asprintf(&dir, "%s/global", root) < 0 ||
        asprintf(&stepfile, "%s/global/step_count.json", root) < 0) {
        rc = dl_fail(err, DL_E_NO_MEMORY, NULL, 0, "out of memory");
        goto out;
    }
    if ((rc = fsu_mkdirs(dir, err)) != 0 || (rc = hubfile_copy(src, global, err)) != 0)
        goto out;
    text = stepcount_build(step, optimizer, bootstrap, NULL);
    if (text == NULL) {
        rc = dl_fail(err, DL_E_NO_MEMORY, NULL, 0, "out of memory");
        goto out;
    }
    rc = fsu_write_atomic(stepfile, text, strlen(text), err);
out:
    free(dir);
    free(global);
    free(stepfile);
    free(text);
    return rc;
}

int hubfile_cleanup_temps(const char *root, dl_error *err)
{
    char *dir = NULL;
    DIR *d;
    struct dirent *e;
    int rc = 0;

    if (asprintf(&dir, "%s/global", root) < 0)
        return dl_fail(err, DL_E_NO_MEMORY, NULL, 0, "out of memory");
    d = opendir(dir);
    if (d == NULL) {
        int e0 = errno;
        free(dir);
        return e0 == ENOENT ? 0 : dl_fail_errno(err, e0, "cannot list %s/global", root);
    }
    while ((e = readdir(d)) != NULL) {
        /* our temporary names only (fsu_tmp_create): what a publish cut short left behind */
        if (strncmp(e->d_name, ".latest.safetensors.tmp-", 24) != 0 &&
            strncmp(e->d_name, ".step_count.json.tmp-", 21) != 0)
            continue;
        if (unlinkat(dirfd(d), e->d_name, 0) != 0 && errno != ENOENT)
            rc = dl_fail_errno(err, errno, "cannot remove %s/%s", dir, e->d_name);
    }
    closedir(d);
    free(dir);
    return rc;
}
