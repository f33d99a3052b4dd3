/* safetensors reader over a file descriptor: reads the 8-byte prefix and the header with pread,
 * never the data; tensor bytes are read on demand (st_read) so callers can stream in chunks. */
#include "safetensors.h"
#include "fsutil.h"

#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

int st_open(const char *path, st_file **out, dl_error *err)
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

void st_close(st_file *f)
{
    if (f == NULL)
        return;
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
    if ((rc = fsu_pread_all(f->fd, buf, len, f->data_start + t->begin + off)) != 0)
        return dl_fail_errno(err, -rc, "cannot read tensor data from %s", f->path);
    return 0;
}
