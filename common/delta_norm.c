#include "delta_norm.h"

#include <math.h>
#include <string.h>

#include "checksum.h"
#include "convert.h"
#include "kernel_clones.h"

void delta_norm_init(delta_norm *n)
{
    memset(n, 0, sizeof(*n));
}

/* Adds v (a finite double >= 0) to the fixed-point sum, exactly. */
static void add_double(delta_norm *n, double v)
{
    uint64_t bits, m;
    int e;

    if (!(v > 0))
        return;
    memcpy(&bits, &v, sizeof(bits));
    e = (int)((bits >> 52) & 0x7ff);
    m = bits & ((UINT64_C(1) << 52) - 1);
    if (e == 0)
        e = 1;                          /* subnormal: no implicit bit */
    else
        m |= UINT64_C(1) << 52;
    /* v = m * 2^(e - 1075); the bit of m's lowest one in the fixed-point number */
    int pos = e - 1075 - DELTA_NORM_LSB_EXP;
    if (pos < 0) {
        /* below the accumulator's lowest bit: never for a sum of F32 squares (multiples of 2^-298) */
        m >>= -pos < 64 ? -pos : 63;
        pos = 0;
    }
    size_t w = (size_t)pos / 64;
    unsigned sh = (unsigned)pos % 64;
    if (w >= DELTA_NORM_WORDS)
        return;                         /* above 2^384: impossible for finite F32 data (see the header) */
    unsigned __int128 add = (unsigned __int128)m << sh;
    for (; w < DELTA_NORM_WORDS && add != 0; w++) {
        unsigned __int128 s = (unsigned __int128)n->w[w] + (uint64_t)add;
        n->w[w] = (uint64_t)s;
        add = (add >> 64) + (s >> 64);
    }
}

void delta_norm_merge(delta_norm *n, const delta_norm *m)
{
    unsigned carry = 0;
    for (size_t w = 0; w < DELTA_NORM_WORDS; w++) {
        unsigned __int128 s = (unsigned __int128)n->w[w] + m->w[w] + carry;
        n->w[w] = (uint64_t)s;
        carry = (unsigned)(s >> 64);
    }
}

/* Bit i of the fixed-point number. */
static int bit_at(const delta_norm *n, int i)
{
    return i >= 0 && (n->w[i / 64] >> (i % 64)) & 1;
}

static int any_below(const delta_norm *n, int i)
{
    for (int w = 0; w < DELTA_NORM_WORDS && w * 64 < i; w++) {
        uint64_t mask = i - w * 64 >= 64 ? ~UINT64_C(0) : (UINT64_C(1) << (i - w * 64)) - 1;
        if (n->w[w] & mask)
            return 1;
    }
    return 0;
}

double delta_norm_sumsq(const delta_norm *n)
{
    int top = -1;
    for (int w = DELTA_NORM_WORDS - 1; w >= 0 && top < 0; w--)
        if (n->w[w] != 0)
            top = w * 64 + 63 - __builtin_clzll(n->w[w]);
    if (top < 0)
        return 0.0;
    /* the 53 bits from top down, then round to nearest, ties to even, on the bits below */
    int low = top - 52;
    uint64_t m = 0;
    for (int i = top; i >= low; i--)
        m = (m << 1) | (uint64_t)bit_at(n, i);
    if (low > 0 && bit_at(n, low - 1) && (any_below(n, low - 1) || (m & 1)))
        m++;                            /* may carry into 2^53: ldexp takes it */
    return ldexp((double)m, low + DELTA_NORM_LSB_EXP);
}

/* Squares of F32 lanes x[0 .. m) into the block's lanes, lane (pos + i) mod 8.  Sums over independent
 * lanes: the vector width changes nothing (the file is not built with -ffast-math). */
KERNEL_CLONES static void lanes_add(double lane[8], uint64_t pos, const float *x, size_t m)
{
    size_t i = 0;
    for (; i < m && (pos + i) % 8 != 0; i++)
        lane[(pos + i) % 8] += (double)x[i] * (double)x[i];
    double l[8];
    memcpy(l, lane, sizeof(l));
    for (; i + 8 <= m; i += 8)
        for (int k = 0; k < 8; k++)
            l[k] += (double)x[i + k] * (double)x[i + k];
    memcpy(lane, l, sizeof(l));
    for (; i < m; i++)
        lane[(pos + i) % 8] += (double)x[i] * (double)x[i];
}

void delta_norm_flush(delta_norm *n, delta_norm_block *b)
{
    if (b->pos == 0)
        return;
    const double *l = b->lane;
    add_double(n, ((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7])));
    memset(b, 0, sizeof(*b));
}

void delta_norm_feed(delta_norm *n, delta_norm_block *b, st_dtype dt, const void *data, size_t nelem)
{
    const size_t lanes = cv_lanes(dt), esize = st_dtype_bits(dt) / 8;
    const uint64_t block = (uint64_t)CK_BLOCK_ELEMS * lanes;
    const unsigned char *p = data;
    float tmp[1024];

    while (nelem > 0) {
        /* elements up to the block's end, at most what tmp holds when decoding */
        uint64_t room = (block - b->pos) / lanes;
        size_t take = nelem < room ? nelem : (size_t)room;
        const float *x;
        if (dt == ST_F32 || dt == ST_C64) {
            x = (const float *)(const void *)p;
        } else {
            if (take > sizeof(tmp) / sizeof(tmp[0]))
                take = sizeof(tmp) / sizeof(tmp[0]);
            if (cv_decode(dt, p, tmp, take) != 0)
                return;                 /* not a delta dtype: the header check refused it before */
            x = tmp;
        }
        lanes_add(b->lane, b->pos, x, take * lanes);
        b->pos += take * lanes;
        if (b->pos == block)
            delta_norm_flush(n, b);
        p += take * esize;
        nelem -= take;
    }
}
