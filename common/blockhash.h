/* blockhash: the project's one content hash of a file.
 *
 * The block hash of a byte string is the sha256 of the concatenated raw sha256 digests of its
 * consecutive BLOCKHASH_BLOCK-byte blocks (the last one may be short; an empty string is one empty
 * block).  Blocks hash independently, so a large file's hash can be computed on several threads or
 * beside the pass that reads it, and a reader that verifies a file block by block can stop at the first
 * bad block.  Signed round records and the downlink's views name files by it; `diloco hash FILE` prints
 * it and the Python package's diloco.blockhash computes the same. */
#ifndef BLOCKHASH_H
#define BLOCKHASH_H

#include <stddef.h>
#include <stdint.h>

#include "dl_error.h"

#define BLOCKHASH_BLOCK ((size_t)16 << 20)
#define BLOCKHASH_SIZE 32u

/* A streaming hash: update in pieces of any size, in order. */
typedef struct blockhash_ctx {
    void *outer;            /* EVP_MD_CTX over the blocks' digests */
    void *block;            /* EVP_MD_CTX over the current block */
    size_t in_block;        /* bytes of the current block hashed so far */
    uint64_t blocks;        /* blocks finished */
} blockhash_ctx;

int blockhash_init(blockhash_ctx *c, dl_error *err);
int blockhash_update(blockhash_ctx *c, const void *p, size_t n, dl_error *err);
/* Finishes the hash into out; the context is freed (blockhash_free is then a no-op). */
int blockhash_final(blockhash_ctx *c, unsigned char out[BLOCKHASH_SIZE], dl_error *err);
void blockhash_free(blockhash_ctx *c);

/* The block hash of fd's bytes from offset 0 to its end (pread: fd's offset is not moved). */
int blockhash_fd(int fd, unsigned char out[BLOCKHASH_SIZE], dl_error *err);
int blockhash_path(const char *path, unsigned char out[BLOCKHASH_SIZE], dl_error *err);
/* One block's digest is the sha256 of its bytes: the block hash of in-memory data, for tests and callers
 * that hold a whole file. */
int blockhash_bytes(const void *p, size_t n, unsigned char out[BLOCKHASH_SIZE], dl_error *err);

/* Lower-case hex, NUL-terminated. */
void blockhash_hex(const unsigned char d[BLOCKHASH_SIZE], char hex[2 * BLOCKHASH_SIZE + 1]);

#endif
