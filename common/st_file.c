/* safetensors reader over a file descriptor: reads the 8-byte prefix and the header with pread,
 * never the data; tensor bytes are read on demand (st_read) so callers can stream in chunks. */
#include "safetensors.h"
#include "fsutil.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

int st_open(const char *path, st_file **out, dl_error *err)
{
    return st_open_capped(path, 0, out, err);
}

int st_open_capped(const char *path, uint64_t max_header, st_file **out, dl_error *err)
{
    st_file *f;
    struct stat sb;
    unsigned char prefix[8];
    char *json = NULL;
    size_t need;
    uint64_t n;
    int rc;

    *out = NULL;
    f = calloc(1, sizeof(*f));
    if (f == NULL)
        return dl_fail(err, DL_E_NO_MEMORY, NULL, 0, "out of memory");
    f->fd = open(path, O_RDONLY | O_CLOEXEC);
    if (f->fd < 0) {
        rc = dl_fail_errno(err, errno, "cannot open %s", path);
        goto fail;
    }
    if (fstat(f->fd, &sb) != 0) {
        rc = dl_fail_errno(err, errno, "cannot stat %s", path);
        goto fail;
    }
    if (!S_ISREG(sb.st_mode)) {
        rc = dl_fail(err, DL_E_IO, NULL, 0, "%s is not a regular file", path);
        goto fail;
    }
    f->file_size = (uint64_t)sb.st_size;
    if (f->file_size < 8) {
        rc = dl_fail(err, DL_E_HEADER_TOO_SMALL, NULL, 0, "file too small: %llu bytes, need at least 8",
                     (unsigned long long)f->file_size);
        goto fail;
    }
    if ((rc = fsu_pread_all(f->fd, prefix, 8, 0)) != 0) {
        rc = dl_fail_errno(err, -rc, "cannot read %s", path);
        goto fail;
    }
    /* Let the prefix parser apply the length checks in the reference's order. */
    if ((rc = st_header_parse_prefix((const char *)prefix, 8, f->file_size, &need, &f->h, err)) != 0)
        goto fail;
    n = need - 8;
    if (max_header != 0 && n > max_header) {
        rc = dl_fail(err, DL_E_HEADER_TOO_LARGE, NULL, 0,
                     "%s: a header of %llu bytes, the cap is %llu (max_delta_header_mib)", path,
                     (unsigned long long)n, (unsigned long long)max_header);
        goto fail;
    }
    json = malloc(n ? n : 1);
    if (json == NULL) {
        rc = dl_fail(err, DL_E_NO_MEMORY, NULL, 0, "out of memory for a header of %llu bytes",
                     (unsigned long long)n);
        goto fail;
    }
    if ((rc = fsu_pread_all(f->fd, json, n, 8)) != 0) {
        rc = dl_fail_errno(err, -rc, "cannot read the header of %s", path);
        goto fail;
    }
    if ((rc = st_header_parse(json, n, f->file_size, &f->h, err)) != 0)
        goto fail;
    free(json);
    json = NULL;
    f->data_start = 8 + n;
    f->path = strdup(path);
    if (f->path == NULL) {
        rc = dl_fail(err, DL_E_NO_MEMORY, NULL, 0, "out of memory");
        goto fail;
    }
    *out = f;
    return 0;
fail:
    free(json);
    st_close(f);
    return rc;
}

/* ---- lazy descriptors: one LRU for the process, under one mutex ------------------------------------
 * The list holds the lazy files whose descriptor is open (lazy_open of them), most recently used first.
 * Eviction closes idle ones (refs == 0) from the tail; a descriptor a reader holds is never closed. */
static pthread_mutex_t lazy_mu = PTHREAD_MUTEX_INITIALIZER;
static st_file *lazy_head, *lazy_tail;
static unsigned lazy_open;

static void lru_unlink(st_file *f)
{
    if (f->lru_prev != NULL)
        f->lru_prev->lru_next = f->lru_next;
    else
        lazy_head = f->lru_next;
    if (f->lru_next != NULL)
        f->lru_next->lru_prev = f->lru_prev;
    else
        lazy_tail = f->lru_prev;
    f->lru_prev = f->lru_next = NULL;
}

static void lru_push(st_file *f)
{
    f->lru_prev = NULL;
    f->lru_next = lazy_head;
    if (lazy_head != NULL)
        lazy_head->lru_prev = f;
    lazy_head = f;
    if (lazy_tail == NULL)
        lazy_tail = f;
}

/* Closes idle descriptors from the tail until fewer than keep are open (called with lazy_mu held). */
static void lru_trim(unsigned keep)
{
    st_file *f = lazy_tail;
    while (lazy_open > keep && f != NULL) {
        st_file *prev = f->lru_prev;
        if (f->refs == 0) {
            lru_unlink(f);
            close(f->fd);
            f->fd = -1;
            lazy_open--;
        }
        f = prev;
    }
}

int st_file_lazy(st_file *f, dl_error *err)
{
    struct stat sb;

    if (f->lazy)
        return 0;
    if (fstat(f->fd, &sb) != 0)
        return dl_fail_errno(err, errno, "cannot stat %s", f->path);
    f->dev = (uint64_t)sb.st_dev;
    f->ino = (uint64_t)sb.st_ino;
    pthread_mutex_lock(&lazy_mu);
    f->lazy = 1;
    lru_push(f);
    lazy_open++;
    lru_trim(ST_LAZY_OPEN_MAX);
    pthread_mutex_unlock(&lazy_mu);
    return 0;
}

/* Opens a closed lazy file again (lazy_mu held): the inode validated, or an error (never another file's
 * bytes under this one's name). */
static int lazy_reopen(st_file *f, dl_error *err)
{
    struct stat sb;
    int fd;

    lru_trim(ST_LAZY_OPEN_MAX - 1);
    if ((fd = open(f->path, O_RDONLY | O_CLOEXEC)) < 0)
        return dl_fail_errno(err, errno, "cannot open %s again", f->path);
    if (fstat(fd, &sb) != 0 || (uint64_t)sb.st_dev != f->dev || (uint64_t)sb.st_ino != f->ino ||
        (uint64_t)sb.st_size != f->file_size) {
        close(fd);
        return dl_fail(err, DL_E_IO, NULL, 0, "%s is no longer the file validated (replaced or resized)", f->path);
    }
    f->fd = fd;
    lru_push(f);
    lazy_open++;
    return 0;
}

int st_file_acquire(const st_file *cf, int *fd, dl_error *err)
{
    st_file *f = (st_file *)cf;   /* the descriptor is a cache: reading a file changes only that */
    int rc = 0;

    if (!f->lazy) {
        *fd = f->fd;
        return 0;
    }
    pthread_mutex_lock(&lazy_mu);
    if (f->fd < 0) {
        rc = lazy_reopen(f, err);
    } else if (lazy_head != f) {
        lru_unlink(f);
        lru_push(f);
    }
    if (rc == 0) {
        f->refs++;
        *fd = f->fd;
    }
    pthread_mutex_unlock(&lazy_mu);
    return rc;
}

void st_file_release(const st_file *cf)
{
    st_file *f = (st_file *)cf;

    if (!f->lazy)
        return;
    pthread_mutex_lock(&lazy_mu);
    f->refs--;
    pthread_mutex_unlock(&lazy_mu);
}

void st_close(st_file *f)
{
    if (f == NULL)
        return;
    if (f->lazy) {
        pthread_mutex_lock(&lazy_mu);
        if (f->fd >= 0) {
            lru_unlink(f);
            lazy_open--;
        }
        pthread_mutex_unlock(&lazy_mu);
    }
    if (f->fd >= 0)
        close(f->fd);
    st_header_free(f->h);
    free(f->path);
    free(f);
}

int st_read(const st_file *f, const st_tensor *t, uint64_t off, void *buf, size_t len, dl_error *err)
{
    uint64_t size = st_tensor_bytes(t);
    int rc;

    if (off > size || len > size - off)
        return dl_fail(err, DL_E_INVALID_ARGUMENT, t->name, t->name_len,
                       "read of %zu bytes at %llu is outside the tensor (%llu bytes)", len,
                       (unsigned long long)off, (unsigned long long)size);
    int fd;
    if ((rc = st_file_acquire(f, &fd, err)) != 0)
        return rc;
    rc = fsu_pread_all(fd, buf, len, f->data_start + t->begin + off);
    st_file_release(f);
    if (rc != 0)
        return dl_fail_errno(err, -rc, "cannot read tensor data from %s", f->path);
    return 0;
}
