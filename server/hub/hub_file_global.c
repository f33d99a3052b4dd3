/* hub_file_global: file://'s global/ directory read (hub_file.h): the published step, the global (one file
 * or a set) copied out of the tree with its header checked first, and the copies' helpers.  Reached as
 * hub_file.c reaches the tree: openat from the root, never through a link. */
#include "hub_file.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "delta.h"
#include "dl_log.h"
#include "fsutil.h"
#include "safetensors.h"
#include "st_index.h"
#include "stepcount.h"

#include "hub_file_internal.h"

#define STEP_FILE_MAX 4095

/* Opens root/global as a directory of the tree, never through a link: *fd = -1 if it is missing. */
int hubfile__open_global_dir(const char *root, int rootfd, int *fd, dl_error *err)
{
    struct stat sb = {0};
    char *why;
    int rc = fsu_open_dir_at(rootfd, "global", fd);

    if (rc == 0 || rc == -ENOENT)
        return 0;
    fstatat(rootfd, "global", &sb, AT_SYMLINK_NOFOLLOW);
    why = hubfile__refusal(rc, &sb, "the global directory");
    rc = dl_fail(err, DL_E_IO, NULL, 0, "%s/global is %s", root, why ? why : "unusable");
    free(why);
    return rc;
}

int hubfile_read_published(const char *root, int *present, uint64_t *step, int *sharded, dl_error *err)
{
    char buf[STEP_FILE_MAX + 1];
    const char *model;          /* "global/<name>": the name is model + 7 */
    struct stat sb;
    size_t len;
    int rc, rootfd, gfd = -1, is_sharded = 0;

    *present = 0;
    if (sharded != NULL)
        *sharded = 0;
    if ((rc = hubfile__open_root(root, &rootfd, err)) != 0)
        return rc;
    if ((rc = hubfile__open_global_dir(root, rootfd, &gfd, err)) != 0 || gfd < 0)
        goto out;
    rc = fsu_read_small_at(gfd, "step_count.json", buf, STEP_FILE_MAX, &len, &sb);
    if (rc == -ENOENT) {
        rc = 0;
        goto out;
    }
    if (rc == -EFBIG) {
        rc = dl_fail(err, DL_E_METADATA_INVALID, NULL, 0, "%s/global/step_count.json is larger than %d bytes", root,
                     STEP_FILE_MAX);
        goto out;
    }
    if (rc != 0) {
        char *why = hubfile__refusal(rc, &sb, "global/step_count.json");
        rc = dl_fail(err, DL_E_IO, NULL, 0, "%s/global/step_count.json is %s", root, why ? why : "unusable");
        free(why);
        goto out;
    }
    if ((rc = stepcount_parse(buf, len, step, NULL, &is_sharded, err)) != 0)
        goto out;
    model = is_sharded ? STEPCOUNT_MODEL_INDEX : STEPCOUNT_MODEL_SINGLE;
    /* lstat only: the global is opened (safely) when it is adopted */
    if (fstatat(gfd, model + 7, &sb, AT_SYMLINK_NOFOLLOW) != 0) {
        rc = dl_fail_errno(err, errno, "%s/global/step_count.json names step %" PRIu64
                           " but %s cannot be found", root, *step, model);
        goto out;
    }
    if (!S_ISREG(sb.st_mode)) {
        rc = dl_fail(err, DL_E_IO, NULL, 0, "%s/global/step_count.json names step %" PRIu64
                     " but %s is %s: not read", root, *step, model, fsu_kind_name(sb.st_mode));
        goto out;
    }
    *present = 1;
    if (sharded != NULL)
        *sharded = is_sharded;
out:
    if (gfd >= 0)
        close(gfd);
    close(rootfd);
    return rc;
}

/* Copies size bytes of in (from offset 0) into out. */
/* Bytes copied between two write-back starts.  Every copy here is fsynced right after (the bootstrap's
 * --init-model, an adopted global, a publish), so the disk may as well start on each piece while the
 * next one is copied instead of taking the whole file at the fsync. */
#define COPY_WRITEBACK_BYTES (64u << 20)

int hubfile__copy_fd(int in, int out, uint64_t size)
{
    uint64_t done = 0, flushed = 0;

    if (lseek(in, 0, SEEK_SET) < 0)
        return -errno;
    while (done < size) {
        if (done - flushed >= COPY_WRITEBACK_BYTES) {
            /* a hint: a failure shows at the fsync, which writes whatever this did not */
            (void)sync_file_range(out, (off64_t)flushed, (off64_t)(done - flushed), SYNC_FILE_RANGE_WRITE);
            flushed = done;
        }
        size_t want = size - done > COPY_WRITEBACK_BYTES ? COPY_WRITEBACK_BYTES : (size_t)(size - done);
        /* kernel-side copy: no trip through user space, reflinks where the filesystem can */
        ssize_t w = copy_file_range(in, NULL, out, NULL, want, 0);
        if (w < 0 && errno == EINTR)
            continue;
        if (w < 0 && (errno == EXDEV || errno == ENOSYS || errno == EOPNOTSUPP || errno == EINVAL)) {
            char buf[1 << 16];
            ssize_t r = read(in, buf, want < sizeof(buf) ? want : sizeof(buf));
            int rc;
            if (r < 0 && errno == EINTR)
                continue;
            if (r < 0)
                return -errno;
            if (r == 0)
                return -ENODATA;        /* it shrank under us */
            if ((rc = fsu_pwrite_all(out, buf, (size_t)r, done)) != 0)
                return rc;
            done += (uint64_t)r;
            continue;
        }
        if (w < 0)
            return -errno;
        if (w == 0)
            return -ENODATA;
        done += (uint64_t)w;
    }
    return 0;
}

/* Copies in (size bytes) to dst atomically; what is the source's name in messages. */
static int copy_to_path(int in, uint64_t size, const char *what, const char *dst, dl_error *err)
{
    char *tmp = NULL;
    int out, rc;

    if ((rc = fsu_tmp_create(dst, &tmp, &out, err)) != 0)
        return rc;
    if ((rc = hubfile__copy_fd(in, out, size)) != 0) {
        close(out);
        unlink(tmp);
        rc = dl_fail_errno(err, -rc, "copying %s to %s", what, tmp);
    } else {
        rc = fsu_commit_tmp(out, tmp, dst, err);
    }
    free(tmp);
    return rc;
}

int hubfile_copy(const char *src, const char *dst, dl_error *err)
{
    struct stat sb;
    int in, rc;

    in = open(src, O_RDONLY | O_NONBLOCK | O_CLOEXEC);
    if (in < 0)
        return dl_fail_errno(err, errno, "cannot open %s", src);
    if (fstat(in, &sb) != 0)
        rc = dl_fail_errno(err, errno, "cannot stat %s", src);
    else if (!S_ISREG(sb.st_mode))
        rc = dl_fail(err, DL_E_IO, NULL, 0, "%s is %s, not a regular file", src, fsu_kind_name(sb.st_mode));
    else
        rc = copy_to_path(in, (uint64_t)sb.st_size, src, dst, err);
    close(in);
    return rc;
}

/* A cheap look at the header before a copy: a file that is not a safetensors model costs its
 * header, not a copy of the whole file into the state directory. */
/* max_header: refused from the 8-byte prefix above it, before the header is read (0: no cap of ours) */
static int check_model_header(int fd, uint64_t size, uint64_t max_header, const char *what, dl_error *err)
{
    unsigned char prefix[8];
    st_header *h = NULL;
    char *json = NULL;
    size_t need;
    int rc;

    if (size < 8)
        return dl_fail(err, DL_E_HEADER_TOO_SMALL, NULL, 0, "%s: file too small: %" PRIu64 " bytes", what, size);
    if ((rc = fsu_pread_all(fd, prefix, 8, 0)) != 0)
        return dl_fail_errno(err, -rc, "cannot read %s", what);
    if ((rc = st_header_parse_prefix((const char *)prefix, 8, size, &need, &h, err)) != 0)
        return rc;
    if (max_header != 0 && need - 8 > max_header)
        return dl_fail(err, DL_E_HEADER_TOO_LARGE, NULL, 0,
                       "%s: a header of %zu bytes, the cap is %" PRIu64 " (max_delta_header_mib)", what, need - 8,
                       max_header);
    if ((json = malloc(need - 8 ? need - 8 : 1)) == NULL)
        return dl_fail(err, DL_E_NO_MEMORY, NULL, 0, "out of memory for the header of %s", what);
    if ((rc = fsu_pread_all(fd, json, need - 8, 8)) != 0)
        rc = dl_fail_errno(err, -rc, "cannot read the header of %s", what);
    else
        rc = st_header_parse(json, need - 8, size, &h, err);
    free(json);
    st_header_free(h);
    return rc;
}

int hubfile_copy_global(const char *root, const char *dst, uint64_t max_header, dl_error *err)
{
    struct stat before, after;
    char what[64];
    int rc, rootfd, gfd = -1, in = -1;

    snprintf(what, sizeof(what), "global/latest.safetensors");
    if ((rc = hubfile__open_root(root, &rootfd, err)) != 0)
        return rc;
    if ((rc = hubfile__open_global_dir(root, rootfd, &gfd, err)) != 0)
        goto out;
    if (gfd < 0) {
        rc = dl_fail(err, DL_E_IO, NULL, 0, "%s/global is missing", root);
        goto out;
    }
    if ((rc = fsu_open_file_at(gfd, "latest.safetensors", &in, &before)) != 0) {
        char *why = hubfile__refusal(rc, &before, what);
        rc = rc == -ENOENT ? dl_fail(err, DL_E_IO, NULL, 0, "%s/%s is missing", root, what)
                           : dl_fail(err, DL_E_IO, NULL, 0, "%s/%s is %s", root, what, why ? why : "unusable");
        free(why);
        goto out;
    }
    if ((rc = check_model_header(in, (uint64_t)before.st_size, max_header, what, err)) != 0)
        goto out;
    if ((rc = copy_to_path(in, (uint64_t)before.st_size, what, dst, err)) != 0)
        goto out;
    /* replaced in place while we copied: our copy may mix two versions; the next scan retries */
    if (fstat(in, &after) != 0 || after.st_size != before.st_size || hubfile__mtime_ns(&after) != hubfile__mtime_ns(&before)) {
        unlink(dst);
        rc = dl_fail(err, DL_E_IO, NULL, 0, "%s/%s changed while it was copied", root, what);
    }
out:
    if (in >= 0)
        close(in);
    if (gfd >= 0)
        close(gfd);
    close(rootfd);
    return rc;
}

int hubfile_remove_dir(const char *dir, dl_error *err)
{
    DIR *d = opendir(dir);
    struct dirent *e;
    int rc = 0;

    if (d == NULL)
        return errno == ENOENT ? 0 : dl_fail_errno(err, errno, "cannot list %s", dir);
    while ((e = readdir(d)) != NULL) {
        if (strcmp(e->d_name, ".") == 0 || strcmp(e->d_name, "..") == 0)
            continue;
        if (unlinkat(dirfd(d), e->d_name, 0) != 0 && errno != ENOENT && rc == 0)
            rc = dl_fail_errno(err, errno, "cannot remove %s/%s", dir, e->d_name);
    }
    closedir(d);
    if (rc == 0 && rmdir(dir) != 0 && errno != ENOENT)
        rc = dl_fail_errno(err, errno, "cannot remove %s", dir);
    return rc;
}

/* Copies root/global/name (gfd) to dir/name: a regular file reached without links, whose header
 * parses, that did not change during the copy. */
static int copy_global_file(int gfd, const char *root, const char *name, const char *dir, uint64_t max_header,
                            dl_error *err)
{
    struct stat before, after;
    char what[128], *dst = NULL;
    int rc, in = -1;

    snprintf(what, sizeof(what), "global/%s", name);
    if ((rc = fsu_open_file_at(gfd, name, &in, &before)) != 0) {
        char *why = hubfile__refusal(rc, &before, what);
        rc = rc == -ENOENT ? dl_fail(err, DL_E_IO, NULL, 0, "%s/%s is missing", root, what)
                           : dl_fail(err, DL_E_IO, NULL, 0, "%s/%s is %s", root, what, why ? why : "unusable");
        free(why);
        return rc;
    }
    if (asprintf(&dst, "%s/%s", dir, name) < 0) {
        dst = NULL;
        rc = dl_fail(err, DL_E_NO_MEMORY, NULL, 0, "out of memory");
        goto out;
    }
    if ((rc = check_model_header(in, (uint64_t)before.st_size, max_header, what, err)) != 0 ||
        (rc = copy_to_path(in, (uint64_t)before.st_size, what, dst, err)) != 0)
        goto out;
    if (fstat(in, &after) != 0 || after.st_size != before.st_size || hubfile__mtime_ns(&after) != hubfile__mtime_ns(&before))
        rc = dl_fail(err, DL_E_IO, NULL, 0, "%s/%s changed while it was copied", root, what);
out:
    free(dst);
    close(in);
    return rc;
}

int hubfile_copy_global_set(const char *root, const char *dir, uint64_t max_header, dl_error *err)
{
    static const char index_name[] = "latest" ST_INDEX_SUFFIX;
    char *buf = NULL, *ipath = NULL;
    st_index *ix = NULL;
    st_set *set = NULL;
    struct stat sb;
    size_t len;
    int rc, rootfd, gfd = -1;

    if ((rc = hubfile_remove_dir(dir, err)) != 0 || (rc = fsu_mkdirs(dir, err)) != 0)
        return rc;
    if ((rc = hubfile__open_root(root, &rootfd, err)) != 0)
        return rc;
    if ((rc = hubfile__open_global_dir(root, rootfd, &gfd, err)) != 0)
        goto out;
    if (gfd < 0) {
        rc = dl_fail(err, DL_E_IO, NULL, 0, "%s/global is missing", root);
        goto out;
    }
    if ((buf = malloc((size_t)ST_INDEX_MAX_BYTES + 1)) == NULL) {
        rc = dl_fail(err, DL_E_NO_MEMORY, NULL, 0, "out of memory");
        goto out;
    }
    /* the index read once: the bytes parsed are the bytes copied */
    if ((rc = fsu_read_small_at(gfd, index_name, buf, ST_INDEX_MAX_BYTES, &len, &sb)) != 0) {
        char *why = hubfile__refusal(rc, &sb, "global/latest" ST_INDEX_SUFFIX);
        rc = rc == -EFBIG ? dl_fail(err, DL_E_HEADER_TOO_LARGE, NULL, 0, "%s/global/%s is larger than %u bytes", root,
                                    index_name, ST_INDEX_MAX_BYTES)
                          : dl_fail(err, DL_E_IO, NULL, 0, "%s/global/%s is %s", root, index_name,
                                    why ? why : "unusable");
        free(why);
        goto out;
    }
    if ((rc = st_index_parse(buf, len, "latest", &ix, err)) != 0)
        goto out;
    for (uint32_t i = 0; i < ix->nshards && rc == 0; i++) {
        char name[64];
        if (st_index_shard_name("latest", i, ix->nshards, name, sizeof(name)) != 0)
            rc = dl_fail(err, DL_E_INVALID_PATH, NULL, 0, "a shard name of %u does not fit", ix->nshards);
        else
            rc = copy_global_file(gfd, root, name, dir, max_header, err);
    }
    if (rc != 0)
        goto out;
    if (asprintf(&ipath, "%s/%s", dir, index_name) < 0) {
        ipath = NULL;
        rc = dl_fail(err, DL_E_NO_MEMORY, NULL, 0, "out of memory");
        goto out;
    }
    if ((rc = fsu_write_atomic(ipath, buf, len, err)) != 0)
        goto out;
    /* the shards and the index agree (every tensor where the index says, total_size); the daemon
     * validates the model itself */
    if ((rc = st_set_open(ipath, &set, err)) == 0)
        st_set_close(set);
out:
    st_index_free(ix);
    free(ipath);
    free(buf);
    if (gfd >= 0)
        close(gfd);
    close(rootfd);
    if (rc != 0) {
        dl_error ignored;
        hubfile_remove_dir(dir, &ignored);
    }
    return rc;
}

/* Zero-copy publish: hard-links in (our own file) into root/global under a temporary name and renames
 * it over name.  The published file then shares its inode with the state's: global/ is written only by
 * aggregators, always by rename, never in place.  Its data is not waited for here: the step is committed
 * by its redo record, the settle makes the same inode durable in the background, and a restart that
 * recovers the step from its redo record publishes it again (a crash of the machine may have lost what
 * the tree showed).  0, 1 when a link is not possible here (another filesystem, links refused: the caller
 * copies), or a negative code with err set. */
