/* checksum: a keyed content checksum of a safetensors file's tensor data, which the pass can verify on
 * the fly whatever order and threads it reads the data in.
 *
 * Identity is not integrity: a worker owns the file it published and can put back its size and
 * modification time after rewriting it, so what intake validated must be proven by the bytes the pass
 * reads.  The checksum of a file is the sum, modulo 2^64, of one keyed hash per block: block j of tensor t
 * is the data bytes of elements [j * CK_BLOCK_ELEMS, (j + 1) * CK_BLOCK_ELEMS) (the last block shorter),
 * hashed with XXH3 under a secret, and that hash mixed with (t, the tensor's dtype, j) under a second key.
 * A sum is indifferent to order, so intake's halves and the pass's threads each add their blocks, and the
 * position in the mix makes a block count only where it was validated (the same bytes as another tensor,
 * another block or another dtype of the same width give another term).  t is the model's (the global's)
 * tensor index, so a delta's checksum does not depend on its own header's order or its shard layout.
 *
 * The key is the state's secret (<state>/checksum.key, mode 0600, made at the first start): without it
 * nobody can compute a term, so nobody can rewrite data and keep the sum.  XXH3 is not a cryptographic
 * MAC; against a writer who does not know the key, a 64-bit sum of keyed terms is what this needs: a
 * rewritten block goes unnoticed with a chance of 2^-64.  Only the data is covered: the pass reads the
 * tensors it uses through a header it parses itself, and checks that header against the model. */
#ifndef CHECKSUM_H
#define CHECKSUM_H

#include <stddef.h>
#include <stdint.h>

#include "dl_error.h"

/* Elements per block: the pass's work items and sub-blocks begin on multiples of it (outer.c). */
#define CK_BLOCK_ELEMS 4096u
#define CK_SECRET_SIZE 192u

typedef struct ck_key {
    unsigned char secret[CK_SECRET_SIZE];
    uint64_t seed;
} ck_key;

/* Reads the key from path, or creates it there (random, mode 0600, durable) when there is none.  A file
 * of another size, or one others can read or write, is refused. */
int ck_key_load(const char *path, ck_key *key, dl_error *err);
/* A random key (tests; a process without a state). */
int ck_key_random(ck_key *key, dl_error *err);

/* The sum of the terms of the blocks of elements [first, first + nelem) of tensor `tensor` (dtype, esize
 * bytes per element) whose bytes are data.  first must be a multiple of CK_BLOCK_ELEMS, and nelem too
 * unless the range ends at the tensor's end. */
uint64_t ck_blocks(const ck_key *key, uint32_t tensor, int dtype, uint64_t first, const void *data, uint64_t nelem,
                   size_t esize);
/* The same with blocks of block_elems elements of bits each (F4 codes: 4 bits; a compressed key's
 * scales: blocks of the scales of CK_BLOCK_ELEMS values, delta_ck_compressed). */
uint64_t ck_blocks_of(const ck_key *key, uint32_t tensor, int dtype, uint64_t first, const void *data, uint64_t nelem,
                      unsigned bits, uint64_t block_elems);
/* The tensor number of the scales of the model's tensor t in the terms (t's own number is t). */
#define CK_SCALES_OF(t) ((uint32_t)(t) | 0x80000000u)

/* Checksums as text in JSON records: 16 lowercase hex digits. */
void ck_format(uint64_t sum, char out[17]);
int ck_parse(const char *text, uint64_t *sum);

#endif
