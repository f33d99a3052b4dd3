/* checksum: see checksum.h. */
#include "checksum.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>

#include <xxhash.h>
#if defined(__x86_64__)
/* Debian's libxxhash picks its AVX2 or AVX-512 loop at run time behind these names (its plain ones are
 * built for SSE2): 37 GB/s against 16 for a 16 KiB block in cache here */
#include <xxh_x86dispatch.h>
#define ck_xxh3_secret XXH3_64bits_withSecret_dispatch
#else
#define ck_xxh3_secret XXH3_64bits_withSecret
#endif

#include "fsutil.h"

_Static_assert(CK_SECRET_SIZE >= XXH3_SECRET_SIZE_MIN, "XXH3 needs a longer secret");

static int fill_random(void *buf, size_t len)
{
    unsigned char *p = buf;

    while (len > 0) {
        ssize_t n = getrandom(p, len, 0);
        if (n < 0) {
            if (errno == EINTR)
                continue;
            return -errno;
        }
        p += n;
        len -= (size_t)n;
    }
    return 0;
}

int ck_key_random(ck_key *key, dl_error *err)
{
    int rc = fill_random(key, sizeof(*key));

    return rc == 0 ? 0 : dl_fail_errno(err, -rc, "cannot draw a checksum key");
}

static int read_key(int fd, const char *path, ck_key *key, dl_error *err)
{
    struct stat sb;
    unsigned char buf[sizeof(*key) + 1];
    ssize_t n;

    if (fstat(fd, &sb) != 0)
        return dl_fail_errno(err, errno, "cannot stat %s", path);
    if (!S_ISREG(sb.st_mode) || (sb.st_mode & 077) != 0 || sb.st_uid != geteuid())
        return dl_fail(err, DL_E_IO, NULL, 0, "%s must be a regular file of ours with mode 0600 (it is the state's "
                       "secret)", path);
    do
        n = pread(fd, buf, sizeof(buf), 0);
    while (n < 0 && errno == EINTR);
    if (n < 0)
        return dl_fail_errno(err, errno, "cannot read %s", path);
    if ((size_t)n != sizeof(*key))
        return dl_fail(err, DL_E_IO, NULL, 0, "%s is %zd bytes, a checksum key is %zu: remove it to make a new one "
                       "(the checksums of the committed step are then not verified)", path, n, sizeof(*key));
    memcpy(key, buf, sizeof(*key));
    return 0;
}

int ck_key_load(const char *path, ck_key *key, dl_error *err)
{
    int fd = open(path, O_RDONLY | O_NOFOLLOW | O_CLOEXEC);
    int rc;

    if (fd >= 0) {
        rc = read_key(fd, path, key, err);
        close(fd);
        return rc;
    }
    if (errno != ENOENT)
        return dl_fail_errno(err, errno, "cannot open %s", path);
    char *tmp = NULL;
    if ((rc = ck_key_random(key, err)) != 0 || (rc = fsu_tmp_create(path, &tmp, &fd, err)) != 0)
        return rc;
    if (fchmod(fd, 0600) != 0 || (rc = fsu_pwrite_all(fd, key, sizeof(*key), 0)) != 0) {
        rc = dl_fail_errno(err, rc != 0 ? -rc : errno, "cannot write %s", tmp);
        close(fd);
        unlink(tmp);
    } else {
        rc = fsu_commit_tmp(fd, tmp, path, err);
    }
    free(tmp);
    return rc;
}

/* The term of one block: its keyed hash, mixed with where it stands. */
static uint64_t block_term(const ck_key *key, uint32_t tensor, int dtype, uint64_t block, const void *p, size_t len)
{
    struct {
        uint64_t hash, block;
        uint32_t tensor, dtype;
    } at = {ck_xxh3_secret(p, len, key->secret, sizeof(key->secret)), block, tensor, (uint32_t)dtype};

    return XXH3_64bits_withSeed(&at, sizeof(at), key->seed);
}

uint64_t ck_blocks_of(const ck_key *key, uint32_t tensor, int dtype, uint64_t first, const void *data, uint64_t nelem,
                      unsigned bits, uint64_t block_elems)
{
    const unsigned char *p = data;
    uint64_t sum = 0, block = first / block_elems;

    for (uint64_t e = 0; e < nelem; e += block_elems, block++) {
        uint64_t n = nelem - e < block_elems ? nelem - e : block_elems;
        sum += block_term(key, tensor, dtype, block, p + e * bits / 8, (size_t)(n * bits / 8));
    }
    return sum;
}

uint64_t ck_blocks(const ck_key *key, uint32_t tensor, int dtype, uint64_t first, const void *data, uint64_t nelem,
                   size_t esize)
{
    return ck_blocks_of(key, tensor, dtype, first, data, nelem, (unsigned)esize * 8, CK_BLOCK_ELEMS);
}

void ck_format(uint64_t sum, char out[17])
{
    snprintf(out, 17, "%016" PRIx64, sum);
}

int ck_parse(const char *text, uint64_t *sum)
{
    uint64_t v = 0;

    if (strlen(text) != 16)
        return -1;
    for (int i = 0; i < 16; i++) {
        char c = text[i];
        int d = c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1;
        if (d < 0)
            return -1;
        v = v << 4 | (uint64_t)d;
    }
    *sum = v;
    return 0;
}
