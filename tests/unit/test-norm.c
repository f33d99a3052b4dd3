/* delta_norm: the exact sum of block sums (README, "Robust aggregation"): independent of the order and
 * split of the blocks, rounded once, and each block's lanes as the definition says. */
#include "test.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "checksum.h"
#include "convert.h"
#include "delta_norm.h"

/* The definition written out: lanes of squares in double, combined pairwise. */
static double block_sum(const float *x, size_t n)
{
    double l[8] = {0};
    for (size_t i = 0; i < n; i++)
        l[i % 8] += (double)x[i] * (double)x[i];
    return ((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7]));
}

static float *random_floats(size_t n, unsigned seed, float scale)
{
    float *x = malloc(n * sizeof(*x));
    srand(seed);
    for (size_t i = 0; i < n; i++)
        x[i] = scale * ((float)rand() / (float)RAND_MAX - 0.5f);
    return x;
}

TEST(norm_one_block_is_its_lanes)
{
    float *x = random_floats(1000, 1, 2.0f);
    delta_norm n;
    delta_norm_block b = {{0}, 0};

    delta_norm_init(&n);
    delta_norm_feed(&n, &b, ST_F32, x, 1000);
    delta_norm_flush(&n, &b);
    CHECK(delta_norm_sumsq(&n) == block_sum(x, 1000));
    free(x);
}

TEST(norm_independent_of_feeds_and_splits)
{
    const size_t n = 3 * CK_BLOCK_ELEMS + 777;
    float *x = random_floats(n, 2, 1e3f);
    delta_norm whole, parts, other;
    delta_norm_block b = {{0}, 0};

    delta_norm_init(&whole);
    delta_norm_feed(&whole, &b, ST_F32, x, n);
    delta_norm_flush(&whole, &b);
    /* odd-sized feeds */
    delta_norm_init(&parts);
    for (size_t i = 0; i < n;) {
        size_t k = (i * 7 + 13) % 1031 + 1;
        if (k > n - i)
            k = n - i;
        delta_norm_feed(&parts, &b, ST_F32, x + i, k);
        i += k;
    }
    delta_norm_flush(&parts, &b);
    CHECK(memcmp(&whole, &parts, sizeof(whole)) == 0);
    /* two halves on a block boundary, merged in either order */
    delta_norm_init(&parts);
    delta_norm_init(&other);
    delta_norm_feed(&parts, &b, ST_F32, x, 2 * CK_BLOCK_ELEMS);
    delta_norm_flush(&parts, &b);
    delta_norm_feed(&other, &b, ST_F32, x + 2 * CK_BLOCK_ELEMS, n - 2 * CK_BLOCK_ELEMS);
    delta_norm_flush(&other, &b);
    delta_norm_merge(&other, &parts);
    CHECK(delta_norm_sumsq(&other) == delta_norm_sumsq(&whole));
    /* the expected value: the blocks' sums, summed exactly (here in long double, then compared loosely) */
    long double want = 0;
    for (size_t i = 0; i < n; i += CK_BLOCK_ELEMS)
        want += block_sum(x + i, n - i < CK_BLOCK_ELEMS ? n - i : CK_BLOCK_ELEMS);
    CHECK(fabsl((long double)delta_norm_sumsq(&whole) - want) <= want * 1e-15L);
    free(x);
}

TEST(norm_sum_is_exact_and_rounded_once)
{
    /* 2^60 + 1 + 1 ... : a double sum loses the ones, the exact sum keeps them until rounding */
    float big = 0x1p30f, one = 1.0f;
    delta_norm n;
    delta_norm_block b = {{0}, 0};

    delta_norm_init(&n);
    delta_norm_feed(&n, &b, ST_F32, &big, 1);
    delta_norm_flush(&n, &b);
    for (int i = 0; i < 4096; i++) {        /* 4096 blocks of one value 1: 2^12 added exactly */
        delta_norm_feed(&n, &b, ST_F32, &one, 1);
        delta_norm_flush(&n, &b);
    }
    CHECK(delta_norm_sumsq(&n) == 0x1p60 + 0x1p12);
    /* ties to even: 2^53 + 1 rounds to 2^53, 2^53 + 3 to 2^53 + 4 */
    delta_norm e, o;
    float a = 0x1p26f, c = 0x1p-0f, t = 0x1p0f;
    delta_norm_init(&e);
    delta_norm_feed(&e, &b, ST_F32, &a, 1);
    delta_norm_flush(&e, &b);
    delta_norm_feed(&e, &b, ST_F32, &c, 1);
    delta_norm_flush(&e, &b);
    CHECK(delta_norm_sumsq(&e) == 0x1p52 + 1);
    delta_norm_init(&o);
    o = e;
    delta_norm_merge(&o, &e);               /* 2^53 + 2 */
    delta_norm_feed(&o, &b, ST_F32, &t, 1);
    delta_norm_flush(&o, &b);               /* 2^53 + 3 -> 2^53 + 4 */
    CHECK(delta_norm_sumsq(&o) == 0x1p53 + 4);
}

TEST(norm_extremes_and_bf16)
{
    float x[3] = {0x1p-149f, -0x1p127f * 1.9f, -0.0f};
    delta_norm n;
    delta_norm_block b = {{0}, 0};

    delta_norm_init(&n);
    delta_norm_feed(&n, &b, ST_F32, x, 3);
    delta_norm_flush(&n, &b);
    CHECK(delta_norm_sumsq(&n) == block_sum(x, 3));
    CHECK(isfinite(delta_norm_sumsq(&n)));
    /* BF16 decoded exactly: the same as its F32 values */
    uint16_t h[5] = {0x3f80, 0xbf00, 0x4049, 0x0001, 0x8000};
    float f[5];
    CHECK(cv_decode(ST_BF16, h, f, 5) == 0);
    delta_norm_init(&n);
    delta_norm_feed(&n, &b, ST_BF16, h, 5);
    delta_norm_flush(&n, &b);
    CHECK(delta_norm_sumsq(&n) == block_sum(f, 5));
}
