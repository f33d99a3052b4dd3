/* blockhash: sha256 over the sha256 digests of a file's 16 MiB blocks (blockhash.h). */
#include "blockhash.h"

#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <openssl/evp.h>

static int digest_start(void **slot, dl_error *err)
{
    EVP_MD_CTX *m = EVP_MD_CTX_new();

    if (m == NULL)
        return dl_fail(err, DL_E_NO_MEMORY, NULL, 0, "out of memory for a sha256 context");
    if (EVP_DigestInit_ex(m, EVP_sha256(), NULL) != 1) {
        EVP_MD_CTX_free(m);
        return dl_fail(err, DL_E_INTERNAL, NULL, 0, "sha256 could not be initialised (libcrypto)");
    }
    *slot = m;
    return 0;
}

int blockhash_init(blockhash_ctx *c, dl_error *err)
{
    int rc;

    memset(c, 0, sizeof(*c));
    if ((rc = digest_start(&c->outer, err)) != 0)
        return rc;
    if ((rc = digest_start(&c->block, err)) != 0) {
        blockhash_free(c);
        return rc;
    }
    return 0;
}

void blockhash_free(blockhash_ctx *c)
{
    EVP_MD_CTX_free(c->outer);
    EVP_MD_CTX_free(c->block);
    c->outer = c->block = NULL;
}

/* Ends the current block: its digest goes into the outer hash and a new block starts. */
static int close_block(blockhash_ctx *c, dl_error *err)
{
    unsigned char d[BLOCKHASH_SIZE];
    unsigned len = 0;

    if (EVP_DigestFinal_ex(c->block, d, &len) != 1 || len != BLOCKHASH_SIZE ||
        EVP_DigestUpdate(c->outer, d, sizeof(d)) != 1 || EVP_DigestInit_ex(c->block, EVP_sha256(), NULL) != 1)
        return dl_fail(err, DL_E_INTERNAL, NULL, 0, "sha256 failed (libcrypto)");
    c->in_block = 0;
    c->blocks++;
    return 0;
}

int blockhash_update(blockhash_ctx *c, const void *p, size_t n, dl_error *err)
{
    const unsigned char *b = p;

    if (c->outer == NULL)
        return dl_fail(err, DL_E_INVALID_ARGUMENT, NULL, 0, "block hash updated after it was finished");
    while (n > 0) {
        size_t take = BLOCKHASH_BLOCK - c->in_block;
        int rc;

        if (take > n)
            take = n;
        if (EVP_DigestUpdate(c->block, b, take) != 1)
            return dl_fail(err, DL_E_INTERNAL, NULL, 0, "sha256 failed (libcrypto)");
        c->in_block += take;
        b += take;
        n -= take;
        /* a full block is closed only when more bytes follow it: a file of exactly k blocks has k
         * digests, and an empty file has one (of the empty block) */
        if (c->in_block == BLOCKHASH_BLOCK && n > 0 && (rc = close_block(c, err)) != 0)
            return rc;
    }
    return 0;
}

int blockhash_final(blockhash_ctx *c, unsigned char out[BLOCKHASH_SIZE], dl_error *err)
{
    unsigned len = 0;
    int rc;

    if (c->outer == NULL)
        return dl_fail(err, DL_E_INVALID_ARGUMENT, NULL, 0, "block hash finished twice");
    rc = close_block(c, err);
    if (rc == 0 && (EVP_DigestFinal_ex(c->outer, out, &len) != 1 || len != BLOCKHASH_SIZE))
        rc = dl_fail(err, DL_E_INTERNAL, NULL, 0, "sha256 failed (libcrypto)");
    blockhash_free(c);
    return rc;
}

int blockhash_bytes(const void *p, size_t n, unsigned char out[BLOCKHASH_SIZE], dl_error *err)
{
    blockhash_ctx c;
    int rc;

    if ((rc = blockhash_init(&c, err)) != 0)
        return rc;
    if ((rc = blockhash_update(&c, p, n, err)) != 0) {
        blockhash_free(&c);
        return rc;
    }
    return blockhash_final(&c, out, err);
}

int blockhash_fd(int fd, unsigned char out[BLOCKHASH_SIZE], dl_error *err)
{
    enum { READ = 1 << 20 };
    unsigned char *buf = malloc(READ);
    blockhash_ctx c;
    off_t at = 0;
    int rc;

    if (buf == NULL)
        return dl_fail(err, DL_E_NO_MEMORY, NULL, 0, "out of memory for a read buffer");
    if ((rc = blockhash_init(&c, err)) != 0) {
        free(buf);
        return rc;
    }
    for (;;) {
        ssize_t got = pread(fd, buf, READ, at);

        if (got < 0 && errno == EINTR)
            continue;
        if (got < 0) {
            rc = dl_fail_errno(err, errno, "read failed at offset %lld", (long long)at);
            break;
        }
        if (got == 0)
            break;
        if ((rc = blockhash_update(&c, buf, (size_t)got, err)) != 0)
            break;
        at += got;
    }
    free(buf);
    if (rc != 0) {
        blockhash_free(&c);
        return rc;
    }
    return blockhash_final(&c, out, err);
}

int blockhash_path(const char *path, unsigned char out[BLOCKHASH_SIZE], dl_error *err)
{
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    int rc;

    if (fd < 0)
        return dl_fail_errno(err, errno, "cannot open %s", path);
    rc = blockhash_fd(fd, out, err);
    close(fd);
    return rc;
}

void blockhash_hex(const unsigned char d[BLOCKHASH_SIZE], char hex[2 * BLOCKHASH_SIZE + 1])
{
    static const char digits[] = "0123456789abcdef";

    for (unsigned i = 0; i < BLOCKHASH_SIZE; i++) {
        hex[2 * i] = digits[d[i] >> 4];
        hex[2 * i + 1] = digits[d[i] & 15];
    }
    hex[2 * BLOCKHASH_SIZE] = '\0';
}
