#include "test.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "blockhash.h"

/* Known answers computed with Python's hashlib: sha256(b"".join(sha256(block).digest() for block)). */
static const char EMPTY[] = "5df6e0e2761359d30a8275058e299fcc0381534545f55cf43e41983f5d4c9456";
static const char ABC[] = "4f8b42c22dd3729b519ba6f68d2da7cc5b2d606d05daed5ad5128cc03e6c6358";
static const char ONE_BLOCK[] = "0f5b91d5102aaab0c1cff6756ef375e087dff6f85420692493ddd95ab9dc81ae";
static const char ONE_BLOCK_AND_A_BYTE[] = "476034dee5c5149c7e386df7d78e358fbdd5e18b9d75dfa0831edf730ce44abe";

/* 16 MiB of the pattern the known answers used, plus one 0x01 byte. */
static unsigned char *pattern(void)
{
    unsigned char *p = malloc(BLOCKHASH_BLOCK + 1);
    if (p == NULL)
        return NULL;
    for (size_t i = 0; i < BLOCKHASH_BLOCK; i++)
        p[i] = (unsigned char)(((i % 65536) * 7 + 3) & 255);
    p[BLOCKHASH_BLOCK] = 1;
    return p;
}

static int hex_of(const void *p, size_t n, char hex[65])
{
    unsigned char d[BLOCKHASH_SIZE];
    dl_error err;
    if (blockhash_bytes(p, n, d, &err) != 0)
        return -1;
    blockhash_hex(d, hex);
    return 0;
}

TEST(blockhash_known_answers)
{
    char hex[65];
    unsigned char *p = pattern();
    CHECK(p != NULL);
    CHECK_EQ(hex_of("", 0, hex), 0);
    CHECK_STR(hex, EMPTY);
    CHECK_EQ(hex_of("abc", 3, hex), 0);
    CHECK_STR(hex, ABC);
    CHECK_EQ(hex_of(p, BLOCKHASH_BLOCK, hex), 0);          /* exactly one block: one digest */
    CHECK_STR(hex, ONE_BLOCK);
    CHECK_EQ(hex_of(p, BLOCKHASH_BLOCK + 1, hex), 0);      /* a second, one-byte block */
    CHECK_STR(hex, ONE_BLOCK_AND_A_BYTE);
    free(p);
}

TEST(blockhash_streams_in_any_pieces_and_reads_files)
{
    unsigned char *p = pattern();
    CHECK(p != NULL);
    /* pieces that straddle the block boundary, an empty piece among them */
    size_t cuts[] = {1, 4095, 0, BLOCKHASH_BLOCK - 8192, 4095, 2};
    blockhash_ctx c;
    dl_error err;
    unsigned char d[BLOCKHASH_SIZE];
    char hex[65];
    size_t at = 0;
    CHECK_EQ(blockhash_init(&c, &err), 0);
    for (size_t i = 0; i < sizeof(cuts) / sizeof(cuts[0]); i++) {
        CHECK_EQ(blockhash_update(&c, p + at, cuts[i], &err), 0);
        at += cuts[i];
    }
    CHECK_EQ(at, BLOCKHASH_BLOCK + 1);
    CHECK_EQ(blockhash_final(&c, d, &err), 0);
    blockhash_hex(d, hex);
    CHECK_STR(hex, ONE_BLOCK_AND_A_BYTE);
    /* a finished context refuses more input instead of hashing garbage */
    CHECK(blockhash_update(&c, p, 1, &err) < 0);
    CHECK_EQ(err.code, DL_E_INVALID_ARGUMENT);

    char path[] = "/tmp/test-blockhash-XXXXXX";
    int fd = mkstemp(path);
    CHECK(fd >= 0);
    CHECK_EQ(write(fd, p, BLOCKHASH_BLOCK + 1), (ssize_t)(BLOCKHASH_BLOCK + 1));
    CHECK_EQ(blockhash_path(path, d, &err), 0);
    blockhash_hex(d, hex);
    CHECK_STR(hex, ONE_BLOCK_AND_A_BYTE);
    CHECK_EQ(blockhash_fd(fd, d, &err), 0);                /* pread: the fd's offset does not matter */
    blockhash_hex(d, hex);
    CHECK_STR(hex, ONE_BLOCK_AND_A_BYTE);
    close(fd);
    unlink(path);
    CHECK(blockhash_path(path, d, &err) < 0);
    CHECK_EQ(err.code, DL_E_IO);
    free(p);
}
