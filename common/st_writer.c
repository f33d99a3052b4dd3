/* safetensors writer: the reference's exact header bytes, then data streamed or pwritten at known
 * offsets into a temporary file that replaces the target atomically. */
#include "safetensors.h"
#include "fsutil.h"
#include "strbuf.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <stdatomic.h>
#include <sys/stat.h>
#include <unistd.h>

static int bytes_cmp(const char *a, size_t al, const char *b, size_t bl)
{
    int c = memcmp(a, b, al < bl ? al : bl);
    if (c != 0)
        return c;
    return (al > bl) - (al < bl);
}

/* The reference's write order: dtype descending, then name ascending (bytewise). */
static int spec_order_cmp(const void *a, const void *b, void *ctx)
{
    const st_spec *specs = ctx;
    const st_spec *x = &specs[*(const size_t *)a], *y = &specs[*(const size_t *)b];
    if (x->dtype != y->dtype)
        return x->dtype > y->dtype ? -1 : 1;
    return bytes_cmp(x->name, x->name_len, y->name, y->name_len);
}

static int name_cmp(const void *a, const void *b, void *ctx)
{
    const st_spec *specs = ctx;
    const st_spec *x = &specs[*(const size_t *)a], *y = &specs[*(const size_t *)b];
    return bytes_cmp(x->name, x->name_len, y->name, y->name_len);
}

static int check_unique_names(const st_spec *specs, size_t n, dl_error *err)
{
    size_t *idx;
    int rc = 0;

    if (n < 2)
        return 0;
    if ((idx = malloc(n * sizeof(*idx))) == NULL)
        return dl_fail(err, DL_E_NO_MEMORY, NULL, 0, "out of memory");
    for (size_t i = 0; i < n; i++)
        idx[i] = i;
    qsort_r(idx, n, sizeof(*idx), name_cmp, (void *)specs);
    for (size_t i = 1; i < n && rc == 0; i++) {
        const st_spec *x = &specs[idx[i - 1]], *y = &specs[idx[i]];
        if (bytes_cmp(x->name, x->name_len, y->name, y->name_len) == 0)
            rc = dl_fail(err, DL_E_INVALID_ARGUMENT, y->name, y->name_len, "duplicate tensor name");
    }
    free(idx);
    return rc;
}

static int kv_cmp(const void *a, const void *b)
{
    const st_kv *x = a, *y = b;
    return strcmp(x->key, y->key);
}

int st_header_build(const st_spec *specs, size_t n, const st_kv *meta, size_t nmeta, char **json,
                    size_t *json_len, uint64_t *offsets, uint64_t *data_len, dl_error *err)
{
    size_t *order = NULL;
    st_kv *kv = NULL;
    sbuf b = {0};
    uint64_t pos = 0;
    int rc = 0;

    *json = NULL;
    if (n > 0 && (order = malloc(n * sizeof(*order))) == NULL)
        return dl_fail(err, DL_E_NO_MEMORY, NULL, 0, "out of memory");
    for (size_t i = 0; i < n; i++) {
        const st_spec *s = &specs[i];
        if ((unsigned)s->dtype >= ST_DTYPE_COUNT) {
            rc = dl_fail(err, DL_E_INVALID_ARGUMENT, s->name, s->name_len, "invalid dtype");
            goto out;
        }
        if (s->name_len == 12 && memcmp(s->name, "__metadata__", 12) == 0) {
            rc = dl_fail(err, DL_E_INVALID_ARGUMENT, s->name, s->name_len,
                         "a tensor may not be named __metadata__");
            goto out;
        }
        if (dl_utf8_check(s->name, s->name_len, NULL) != 0) {
            rc = dl_fail(err, DL_E_INVALID_ARGUMENT, s->name, s->name_len,
                         "tensor name is not valid UTF-8");
            goto out;
        }
        order[i] = i;
    }
    if (n > 0)
        qsort_r(order, n, sizeof(*order), spec_order_cmp, (void *)specs);
    if ((rc = check_unique_names(specs, n, err)) != 0)
        goto out;
    if (meta != NULL && nmeta > 0) {
        kv = malloc(nmeta * sizeof(*kv));
        if (kv == NULL) {
            rc = dl_fail(err, DL_E_NO_MEMORY, NULL, 0, "out of memory");
            goto out;
        }
        memcpy(kv, meta, nmeta * sizeof(*kv));
        qsort(kv, nmeta, sizeof(*kv), kv_cmp);
        for (size_t i = 0; i < nmeta; i++) {
            if (dl_utf8_check(kv[i].key, strlen(kv[i].key), NULL) != 0 ||
                dl_utf8_check(kv[i].value, strlen(kv[i].value), NULL) != 0) {
                rc = dl_fail(err, DL_E_INVALID_ARGUMENT, NULL, 0, "metadata is not valid UTF-8");
                goto out;
            }
            if (i > 0 && strcmp(kv[i - 1].key, kv[i].key) == 0) {
                rc = dl_fail(err, DL_E_INVALID_ARGUMENT, NULL, 0, "duplicate metadata key \"%.64s\"",
                             kv[i].key);
                goto out;
            }
        }
    }

    sb_add(&b, "{", 1);
    if (meta != NULL) {
        sb_str(&b, "\"__metadata__\":{");
        for (size_t i = 0; i < nmeta; i++) {
            if (i > 0)
                sb_add(&b, ",", 1);
            sb_json_string(&b, kv[i].key, strlen(kv[i].key));
            sb_add(&b, ":", 1);
            sb_json_string(&b, kv[i].value, strlen(kv[i].value));
        }
        sb_add(&b, "}", 1);
    }
    for (size_t k = 0; k < n; k++) {
        const st_spec *s = &specs[order[k]];
        uint64_t nelem, nbytes;
        if ((rc = st_nbytes(s->dtype, s->shape, s->ndim, &nelem, &nbytes, err, s->name, s->name_len)) != 0)
            goto out;
        if (meta != NULL || k > 0)
            sb_add(&b, ",", 1);
        sb_json_string(&b, s->name, s->name_len);
        sb_str(&b, ":{\"dtype\":\"");
        sb_str(&b, st_dtype_name(s->dtype));
        sb_str(&b, "\",\"shape\":[");
        for (size_t d = 0; d < s->ndim; d++) {
            if (d > 0)
                sb_add(&b, ",", 1);
            sb_u64(&b, s->shape[d]);
        }
        sb_str(&b, "],\"data_offsets\":[");
        sb_u64(&b, pos);
        sb_add(&b, ",", 1);
        offsets[2 * order[k]] = pos;
        if (__builtin_add_overflow(pos, nbytes, &pos)) {
            rc = dl_fail(err, DL_E_VALIDATION_OVERFLOW, s->name, s->name_len, "total data size overflows");
            goto out;
        }
        offsets[2 * order[k] + 1] = pos;
        sb_u64(&b, pos);
        sb_str(&b, "]}");
    }
    sb_add(&b, "}", 1);
    while (!b.oom && (8 + b.len) % 8 != 0)
        sb_add(&b, " ", 1);
    if (b.oom) {
        rc = dl_fail(err, DL_E_NO_MEMORY, NULL, 0, "out of memory building the header");
        goto out;
    }
    if (b.len > ST_MAX_HEADER_SIZE) {
        rc = dl_fail(err, DL_E_HEADER_TOO_LARGE, NULL, 0, "header would be %zu bytes (max %llu)", b.len,
                     ST_MAX_HEADER_SIZE);
        goto out;
    }
    *json = b.p;
    *json_len = b.len;
    *data_len = pos;
    b.p = NULL;
out:
    free(b.p);
    free(order);
    free(kv);
    return rc;
}

struct st_writer {
    char *path;
    char *tmp_path;
    int fd;
    size_t n;
    uint64_t data_start;
    uint64_t *offsets;      /* 2 per spec, relative to the data section */
    int writeback;          /* start writeback of every range as soon as it is written */
    int deferred;           /* commit renames only: the caller makes the file durable later */
};

int st_writer_fd(const st_writer *w)
{
    return w->fd;
}

void st_writer_set_writeback(st_writer *w, int on)
{
    w->writeback = on;
}

/* The writer's temporary file: warm_tmp taken over when it is there (a regular file of ours, sized to
 * total), else a new one. */
static int writer_tmp(st_writer *w, const char *path, const char *warm_tmp, uint64_t total, dl_error *err)
{
    if (warm_tmp != NULL) {
        struct stat sb;
        int fd = open(warm_tmp, O_WRONLY | O_NOFOLLOW | O_CLOEXEC);
        if (fd >= 0 && fstat(fd, &sb) == 0 && S_ISREG(sb.st_mode) && sb.st_nlink == 1 &&
            ftruncate(fd, (off_t)total) == 0 && (w->tmp_path = strdup(warm_tmp)) != NULL) {
            w->fd = fd;
            return 0;
        }
        if (fd >= 0)
            close(fd);
        unlink(warm_tmp);       /* unusable: a new file instead, and nothing left behind */
    }
    return fsu_tmp_create(path, &w->tmp_path, &w->fd, err);
}

int st_writer_open(const char *path, const st_spec *specs, size_t n, const st_kv *meta, size_t nmeta,
                   st_writer **out, dl_error *err)
{
    return st_writer_open_warm(path, specs, n, meta, nmeta, NULL, out, err);
}

int st_writer_open_warm(const char *path, const st_spec *specs, size_t n, const st_kv *meta, size_t nmeta,
                        const char *warm_tmp, st_writer **out, dl_error *err)
{
    st_writer *w;
    char *json = NULL;
    size_t json_len;
    uint64_t data_len, total;
    unsigned char prefix[8];
    int rc;

    *out = NULL;
    w = calloc(1, sizeof(*w));
    if (w == NULL)
        return dl_fail(err, DL_E_NO_MEMORY, NULL, 0, "out of memory");
    w->fd = -1;
    w->n = n;
    w->offsets = malloc((n ? n : 1) * 2 * sizeof(uint64_t));
    w->path = strdup(path);
    if (w->offsets == NULL || w->path == NULL) {
        rc = dl_fail(err, DL_E_NO_MEMORY, NULL, 0, "out of memory");
        goto fail;
    }
    if ((rc = st_header_build(specs, n, meta, nmeta, &json, &json_len, w->offsets, &data_len, err)) != 0)
        goto fail;
    w->data_start = 8 + (uint64_t)json_len;
    if (__builtin_add_overflow(w->data_start, data_len, &total)) {
        rc = dl_fail(err, DL_E_VALIDATION_OVERFLOW, NULL, 0, "file size overflows");
        goto fail;
    }
    if ((rc = writer_tmp(w, path, warm_tmp, total, err)) != 0)
        goto fail;
    /* Reserve the space now so that a full disk fails here, before any data is computed. */
    if (total > 0) {
        int e = posix_fallocate(w->fd, 0, (off_t)total);
        if (e != 0 && e != EOPNOTSUPP && e != EINVAL) {
            rc = dl_fail_errno(err, e, "cannot reserve %llu bytes for %s", (unsigned long long)total, path);
            goto fail;
        }
        if (e != 0 && ftruncate(w->fd, (off_t)total) != 0) {
            rc = dl_fail_errno(err, errno, "cannot size %s", w->tmp_path);
            goto fail;
        }
    }
    for (int i = 0; i < 8; i++)
        prefix[i] = (unsigned char)((uint64_t)json_len >> (8 * i));
    if ((rc = fsu_pwrite_all(w->fd, prefix, 8, 0)) != 0 ||
        (rc = fsu_pwrite_all(w->fd, json, json_len, 8)) != 0) {
        rc = dl_fail_errno(err, -rc, "cannot write the header of %s", w->tmp_path);
        goto fail;
    }
    free(json);
    *out = w;
    return 0;
fail:
    free(json);
    st_writer_abort(w);
    return rc;
}

uint64_t st_writer_data_offset(const st_writer *w, size_t spec_index)
{
    return w->data_start + w->offsets[2 * spec_index];
}

int st_writer_write(st_writer *w, size_t spec_index, uint64_t off, const void *buf, size_t len,
                    dl_error *err)
{
    uint64_t size;
    int rc;

    if (spec_index >= w->n)
        return dl_fail(err, DL_E_INVALID_ARGUMENT, NULL, 0, "tensor index %zu out of range", spec_index);
    size = w->offsets[2 * spec_index + 1] - w->offsets[2 * spec_index];
    if (off > size || len > size - off)
        return dl_fail(err, DL_E_INVALID_ARGUMENT, NULL, 0,
                       "write of %zu bytes at %llu is outside tensor %zu (%llu bytes)", len,
                       (unsigned long long)off, spec_index, (unsigned long long)size);
    uint64_t at = st_writer_data_offset(w, spec_index) + off;
    if ((rc = fsu_pwrite_all(w->fd, buf, len, at)) != 0)
        return dl_fail_errno(err, -rc, "cannot write %s", w->tmp_path);
    /* Asynchronous: the disk works while we compute, so the final fsync has little left to do.
     * A failure here is only a lost hint; fsync reports real I/O errors. */
    if (w->writeback)
        (void)sync_file_range(w->fd, (off64_t)at, (off64_t)len, SYNC_FILE_RANGE_WRITE);
    return 0;
}

int st_writer_warm_create(const char *path, uint64_t size, char **tmp_path, int *fd, dl_error *err)
{
    int wfd, rc = 0;

    if ((rc = fsu_tmp_create(path, tmp_path, &wfd, err)) != 0)
        return rc;
    /* fallocate(2), not posix_fallocate: where the filesystem cannot reserve space, glibc would write
     * zeros instead, which the disk then has to take; such a file is simply not warmed */
    if (fallocate(wfd, 0, 0, (off_t)size) != 0)
        rc = dl_fail_errno(err, errno, "cannot reserve %llu bytes for %s", (unsigned long long)size, *tmp_path);
    else if ((*fd = open(*tmp_path, O_RDONLY | O_CLOEXEC)) < 0)
        rc = dl_fail_errno(err, errno, "cannot open %s", *tmp_path);
    if (rc != 0) {
        close(wfd);
        unlink(*tmp_path);
        free(*tmp_path);
        *tmp_path = NULL;
        return rc;
    }
    close(wfd);
    return 0;
}

/* Bytes per read: small enough that a stop is seen within a few milliseconds (a chunk of new pages
 * costs up to ~2 ms where the host must fault them in). */
#define WARM_CHUNK (1u << 20)

uint64_t st_writer_warm_fill(int fd, uint64_t size, const _Atomic int *stop, const _Atomic int *pause)
{
    char *sink = malloc(WARM_CHUNK);    /* the zeros land here and are thrown away */
    uint64_t done = 0;

    while (sink != NULL && done < size && !atomic_load(stop)) {
        if (pause != NULL && atomic_load_explicit(pause, memory_order_relaxed)) {
            usleep(10000);
            continue;
        }
        size_t want = size - done < WARM_CHUNK ? (size_t)(size - done) : WARM_CHUNK;
        ssize_t r = pread(fd, sink, want, (off_t)done);
        if (r < 0 && errno == EINTR)
            continue;
        if (r <= 0)
            break;
        done += (uint64_t)r;
    }
    free(sink);
    return done;
}

static void writer_free(st_writer *w)
{
    free(w->path);
    free(w->tmp_path);
    free(w->offsets);
    free(w);
}

void st_writer_set_durable(st_writer *w, int on)
{
    w->deferred = !on;
}

int st_writer_commit(st_writer *w, dl_error *err)
{
    int rc = w->deferred ? fsu_rename_tmp(w->fd, w->tmp_path, w->path, err)
                         : fsu_commit_tmp(w->fd, w->tmp_path, w->path, err);
    writer_free(w);
    return rc;
}

void st_writer_abort(st_writer *w)
{
    if (w == NULL)
        return;
    if (w->fd >= 0) {
        close(w->fd);
        unlink(w->tmp_path);
    }
    writer_free(w);
}

int st_save(const char *path, const st_spec *specs, const void *const *data, size_t n,
            const st_kv *meta, size_t nmeta, dl_error *err)
{
    st_writer *w;
    int rc;

    if ((rc = st_writer_open(path, specs, n, meta, nmeta, &w, err)) != 0)
        return rc;
    for (size_t i = 0; i < n; i++) {
        uint64_t size = w->offsets[2 * i + 1] - w->offsets[2 * i];
        if (size > 0 && (rc = st_writer_write(w, i, 0, data[i], (size_t)size, err)) != 0) {
            st_writer_abort(w);
            return rc;
        }
    }
    return st_writer_commit(w, err);
}
