/* delta_norm: a delta's L2 norm, defined bit for bit and independent of how it is read (README,
 * "Robust aggregation").
 *
 * A floating tensor's values are taken as F32 lanes (F16 and BF16 decoded exactly, C64 as its two F32
 * lanes per element) and cut into blocks of CK_BLOCK_ELEMS elements from the tensor's first element
 * (the checksum's blocks; the last one shorter).  A block's sum of squares is computed in double over 8
 * lanes (lane = the value's index in the block mod 8; each lane adds its squares in order; a square of
 * an F32 is exact in double), the lanes combined as ((l0+l1)+(l2+l3))+((l4+l5)+(l6+l7)).  The delta's
 * sum of squares is the exact sum of all its blocks' sums (of every tensor), rounded once to double; its
 * norm is the square root.
 *
 * The exact sum (a fixed-point accumulator of every block sum) makes the figure the same whatever order
 * the blocks are read in and however they are split: two halves of a file checked by two threads, the
 * shards of a set, the shards of a cluster's plan, all merge (delta_norm_merge) into the same bits.  So a
 * per-shard partial sum is a delta_norm, and the whole model's is their merge, in any order.  The oracle
 * is numpy's sequential cumsum per lane and Python's math.fsum over the blocks (correctly rounded). */
#ifndef DELTA_NORM_H
#define DELTA_NORM_H

#include <stddef.h>
#include <stdint.h>

#include "safetensors.h"

/* Block sums are multiples of 2^-298 (an F32 is a multiple of 2^-149) and below 2^270; with up to 2^40
 * blocks the sum stays below 2^310.  Words of the fixed-point number, its lowest bit weighing 2^-320. */
#define DELTA_NORM_WORDS 11
#define DELTA_NORM_LSB_EXP (-320)

typedef struct delta_norm {
    uint64_t w[DELTA_NORM_WORDS];       /* little-endian words */
} delta_norm;

/* The block being summed: its lanes and how many values (F32 lanes) it holds so far. */
typedef struct delta_norm_block {
    double lane[8];
    uint64_t pos;
} delta_norm_block;

void delta_norm_init(delta_norm *n);
/* Adds nelem elements of dt (F32, F16, BF16, C64) that continue tensor data already fed into b (b zeroed,
 * or flushed, at the tensor's first element or at a block boundary). */
void delta_norm_feed(delta_norm *n, delta_norm_block *b, st_dtype dt, const void *data, size_t nelem);
/* Ends the current block (at a tensor's end, or where a feed stops on a block boundary): its sum joins n. */
void delta_norm_flush(delta_norm *n, delta_norm_block *b);
/* n += m, exactly. */
void delta_norm_merge(delta_norm *n, const delta_norm *m);
/* The sum of squares, rounded once (to nearest, ties to even). */
double delta_norm_sumsq(const delta_norm *n);

#endif
