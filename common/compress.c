#include "compress.h"

#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "convert.h"
#include "delta.h"
#include "kernel_clones.h"

static const char *const enc_names[] = {"none", "int8_block", "mxfp8", "mxfp4"};

const char *cz_encoding_name(cz_encoding enc)
{
    return (unsigned)enc < sizeof(enc_names) / sizeof(enc_names[0]) ? enc_names[enc] : "?";
}

int cz_encoding_parse(const char *s, size_t len, cz_encoding *out)
{
    for (unsigned i = CZ_INT8_BLOCK; i <= CZ_MXFP4; i++) {
        if (strlen(enc_names[i]) == len && memcmp(enc_names[i], s, len) == 0) {
            *out = (cz_encoding)i;
            return 0;
        }
    }
    return -1;
}

int cz_spec_valid(const cz_spec *s)
{
    switch (s->enc) {
    case CZ_NONE: return s->block == 0;
    case CZ_INT8_BLOCK:
        return s->block >= CZ_BLOCK_MIN && s->block <= CZ_BLOCK_MAX && (s->block & (s->block - 1)) == 0;
    case CZ_MXFP8:
    case CZ_MXFP4: return s->block == CZ_MX_BLOCK;
    }
    return 0;
}

static const st_meta *find_meta(const st_meta *meta, size_t n, const char *key)
{
    size_t kl = strlen(key);
    for (size_t i = 0; i < n; i++)
        if (meta[i].key_len == kl && memcmp(meta[i].key, key, kl) == 0)
            return &meta[i];
    return NULL;
}

int cz_spec_from_meta(const st_meta *meta, size_t nmeta, cz_spec *out, dl_error *err)
{
    const st_meta *enc = find_meta(meta, nmeta, "encoding"), *block = find_meta(meta, nmeta, "block");
    uint64_t b = 0;

    *out = (cz_spec){CZ_NONE, 0};
    if (enc == NULL) {
        if (block != NULL)
            return dl_fail(err, DL_E_METADATA_INVALID, NULL, 0, "delta metadata has block but no encoding");
        return 0;
    }
    if (cz_encoding_parse(enc->value, enc->value_len, &out->enc) != 0)
        return dl_fail(err, DL_E_METADATA_INVALID, NULL, 0,
                       "delta metadata encoding \"%.32s\" is not int8_block, mxfp8 or mxfp4", enc->value);
    if (block == NULL)
        return dl_fail(err, DL_E_METADATA_MISSING, NULL, 0, "delta metadata lacks \"block\" (encoding %s)",
                       cz_encoding_name(out->enc));
    if (delta_parse_int(block->value, block->value_len, &b) != 0 || b > CZ_BLOCK_MAX)
        return dl_fail(err, DL_E_METADATA_INVALID, NULL, 0,
                       "delta metadata block \"%.32s\" is not a canonical integer up to %u", block->value,
                       CZ_BLOCK_MAX);
    out->block = (uint32_t)b;
    if (!cz_spec_valid(out))
        return dl_fail(err, DL_E_METADATA_INVALID, NULL, 0,
                       out->enc == CZ_INT8_BLOCK ? "delta metadata block %u: int8_block takes a power of two "
                                                   "from 32 to 4096"
                                                 : "delta metadata block %u: the mx formats take 32",
                       out->block);
    return 0;
}

st_dtype cz_code_dtype(cz_encoding enc)
{
    return enc == CZ_INT8_BLOCK ? ST_I8 : enc == CZ_MXFP8 ? ST_F8_E4M3 : ST_F4;
}

st_dtype cz_scale_dtype(cz_encoding enc)
{
    return enc == CZ_INT8_BLOCK ? ST_F32 : ST_F8_E8M0;
}

int cz_is_scales_name(const char *name, size_t len)
{
    return len > CZ_SCALES_SUFFIX_LEN &&
           memcmp(name + len - CZ_SCALES_SUFFIX_LEN, CZ_SCALES_SUFFIX, CZ_SCALES_SUFFIX_LEN) == 0;
}

char *cz_scales_name(const char *name, size_t len)
{
    char *out = malloc(len + CZ_SCALES_SUFFIX_LEN + 1);

    if (out == NULL)
        return NULL;
    memcpy(out, name, len);
    memcpy(out + len, CZ_SCALES_SUFFIX, CZ_SCALES_SUFFIX_LEN + 1);
    return out;
}

uint64_t cz_code_bytes(cz_encoding enc, uint64_t n)
{
    return enc == CZ_MXFP4 ? n / 2 : n;
}

/* ---- the element formats -------------------------------------------------------------------------- */

/* E4M3 and E8M0 are convert.c's tables (cv_f8_table); E2M1, which convert.c does not decode, is here,
 * with the pairs of values of each byte of packed F4. */
static const float *e4m3_table, *e8m0_table;
static float e2m1_table[16];
static float e2m1_pairs[256][2];        /* byte b: the values of its low and its high nibble */
static pthread_once_t tables_once = PTHREAD_ONCE_INIT;

static void tables_build(void)
{
    e4m3_table = cv_f8_table(ST_F8_E4M3);
    e8m0_table = cv_f8_table(ST_F8_E8M0);
    for (unsigned b = 0; b < 16; b++) {
        unsigned e = (b >> 1) & 3, m = b & 1;
        float v = e == 0 ? 0.5f * (float)m : ldexpf((float)(2 | m), (int)e - 2);
        e2m1_table[b] = b & 8 ? -v : v;
    }
    for (unsigned b = 0; b < 256; b++) {
        e2m1_pairs[b][0] = e2m1_table[b & 15];
        e2m1_pairs[b][1] = e2m1_table[b >> 4];
    }
}

float cz_e4m3_value(uint8_t code)
{
    pthread_once(&tables_once, tables_build);
    return e4m3_table[code];
}

float cz_e2m1_value(uint8_t code)
{
    pthread_once(&tables_once, tables_build);
    return e2m1_table[code & 15];
}

float cz_e8m0_value(uint8_t code)
{
    pthread_once(&tables_once, tables_build);
    return e8m0_table[code];
}

/* ---- decoding ------------------------------------------------------------------------------------- */

static inline uint32_t f2u(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline double u2d(uint64_t u) { double d; memcpy(&d, &u, 8); return d; }

/* The decoding loops: a code's value from its table (sign and NaN included) times the block's scale,
 * one F32 multiplication, without branches on values so that they vectorise (KERNEL_CLONES: an
 * AVX-512 or AVX2 copy where the CPU has it; tests/integration/test_compress.py compares every code
 * under every scale with numpy).  Each returns whether a value it wrote is not finite (an OR beside the
 * work, so that a valid delta is read once; the rare failure is then located). */
/* not finite, or of magnitude 2^64 or more: a delta's bad values (delta_find_bad_value) */
#define NOT_FINITE(u) ((uint32_t)(((u) & 0x7fffffffu) >= DELTA_VALUE_BOUND_F32_BITS))

/* Whole blocks of CZ_MX_BLOCK values, one E8M0 scale each: the inner loop's constant count vectorises
 * without a remainder. */
KERNEL_CLONES static uint32_t decode_e4m3_blocks(const unsigned char *restrict c, const unsigned char *restrict e,
                                                 float *restrict out, size_t nblocks)
{
    /* per lane, reduced once at the end: a reduction per block would cost more than the block */
    uint32_t bad[CZ_MX_BLOCK] = {0}, any = 0;
    for (size_t k = 0; k < nblocks; k++) {
        float sc = e8m0_table[e[k]];
        for (size_t j = 0; j < CZ_MX_BLOCK; j++) {
            float x = e4m3_table[c[k * CZ_MX_BLOCK + j]] * sc;
            bad[j] |= NOT_FINITE(f2u(x));
            out[k * CZ_MX_BLOCK + j] = x;
        }
    }
    for (size_t j = 0; j < CZ_MX_BLOCK; j++)
        any |= bad[j];
    return any;
}

static uint32_t decode_e4m3_run(const unsigned char *c, float sc, float *out, size_t n)
{
    uint32_t bad = 0;
    for (size_t j = 0; j < n; j++) {
        out[j] = e4m3_table[c[j]] * sc;
        bad |= NOT_FINITE(f2u(out[j]));
    }
    return bad;
}

/* n values from an even value index: byte j holds values 2j (low nibble) and 2j + 1; n may be odd.
 * Through a table of the 256 bytes' value pairs (2 KiB, in L1): one load per two values. */
static uint32_t decode_e2m1_run(const unsigned char *restrict c, float sc, float *restrict out, size_t n)
{
    size_t pairs = n / 2;
    uint32_t bad = 0;
    for (size_t j = 0; j < pairs; j++) {
        const float *v = e2m1_pairs[c[j]];
        out[2 * j] = v[0] * sc;
        out[2 * j + 1] = v[1] * sc;
    }
    if (n % 2)
        out[n - 1] = e2m1_pairs[c[pairs]][0] * sc;
    /* E2M1 has no NaN: only the scale (NaN, or one that overflows 6 x it) makes a value not finite */
    float top = 6.0f * sc;
    bad |= NOT_FINITE(f2u(top));
    return bad;
}

KERNEL_CLONES static uint32_t decode_i8_run(const int8_t *restrict c, float sc, float *restrict out, size_t n)
{
    uint32_t bad = 0;
    for (size_t j = 0; j < n; j++) {
        out[j] = (float)c[j] * sc;
        bad |= NOT_FINITE(f2u(out[j]));
    }
    return bad;
}

int64_t cz_decode(const cz_spec *s, const void *codes, const void *scales, uint64_t first, float *out, size_t n)
{
    const uint32_t B = s->block;
    const unsigned char *q = codes, *sb = scales;
    size_t i = 0;
    int64_t bad_scale = -1;
    uint32_t bad = 0;

    pthread_once(&tables_once, tables_build);
    if (s->enc == CZ_MXFP8 && first % B == 0) {
        /* the whole blocks at once */
        size_t whole = n / CZ_MX_BLOCK;
        bad |= decode_e4m3_blocks(q, sb, out, whole);
        i = whole * CZ_MX_BLOCK;
    }
    /* block by block: the scale is one value for the run of its block's values in [first, first + n) */
    while (i < n) {
        uint64_t v = first + i, blk = v / B - first / B;
        size_t run = (size_t)((v / B + 1) * B - v);
        if (run > n - i)
            run = n - i;
        if (s->enc == CZ_INT8_BLOCK) {
            float sc;
            memcpy(&sc, sb + blk * 4, 4);
            /* a negative scale (or -0) is not what the encoder writes: its values count as not finite */
            if (bad_scale < 0 && (f2u(sc) >> 31) != 0)
                bad_scale = (int64_t)i;
            bad |= decode_i8_run((const int8_t *)q + i, sc, out + i, run);
        } else if (s->enc == CZ_MXFP8) {
            bad |= decode_e4m3_run(q + i, e8m0_table[sb[blk]], out + i, run);
        } else {
            /* i is even: first and B are */
            bad |= decode_e2m1_run(q + i / 2, e8m0_table[sb[blk]], out + i, run);
        }
        i += run;
    }
    if (!bad)
        return bad_scale;
    int64_t at = delta_find_bad_value(ST_F32, out, n);
    return bad_scale >= 0 && (at < 0 || bad_scale < at) ? bad_scale : at;
}

/* ---- encoding ------------------------------------------------------------------------------------- */

/* RNE of x (0 <= x < 2^51) to an integer, in the default rounding mode: no libm call (rint is one
 * without SSE4.1), and the compiler keeps it (no -ffast-math here). */
static inline double rne(double x)
{
    const double big = 4503599627370496.0;        /* 2^52 */
    return (x + big) - big;
}

/* The code of the element value nearest w = a / 2^shared (a = |v|), ties to the even code, saturating at
 * the largest normal (448, 6): what nearest_code's search of the value table finds, from a's exponent
 * and mantissa.  Within a binade the values are evenly spaced (2^mbits of them), so the nearest is the
 * mantissa scaled to [2^mbits, 2^(mbits+1)] rounded to nearest even (a carry to 2^(mbits+1) is the next
 * binade's first code), and below the smallest normal the multiples of its spacing; the code's low bit is
 * the mantissa's, so even codes are even mantissas.  tests/unit/test-compress.c compares it with the
 * search over every boundary. */
static inline unsigned mx_code(float a, int shared, int fp4)
{
    const int emax = fp4 ? 2 : 8, emin = fp4 ? 0 : -6, mbits = fp4 ? 1 : 3;
    const unsigned top = fp4 ? 7u : 126u;
    uint32_t b = f2u(a);
    int ex;

    if (b == 0)
        return 0;
    if (b >= 0x00800000u) {
        ex = (int)(b >> 23) - 126;                  /* a = f * 2^ex, f in [0.5, 1) */
    } else {
        (void)frexpf(a, &ex);                        /* an F32 subnormal */
    }
    const int e = ex - 1 - shared;                  /* floor(log2 w) */
    if (e > emax)
        return top;
    /* w / 2^(max(e, emin) - mbits), exact in double (a has 24 bits, the power of two is in range) */
    const int k = mbits - (e < emin ? emin : e) - shared;
    const double scaled = (double)a * u2d((uint64_t)(k + 1023) << 52);
    const unsigned q = (unsigned)rne(scaled);
    if (e < emin)
        return q;                                   /* 2^mbits: the smallest normal's code */
    const unsigned code = (unsigned)(e - emin + 1) * (1u << mbits) + q - (1u << mbits);
    return code > top ? top : code;
}

static void encode_mx(const cz_spec *s, const float *in, size_t n, unsigned char *codes, unsigned char *scales)
{
    const int fp4 = s->enc == CZ_MXFP4, emax = fp4 ? 2 : 8;

    if (fp4)
        memset(codes, 0, (n + 1) / 2);
    for (size_t b0 = 0, k = 0; b0 < n; b0 += s->block, k++) {
        size_t m = n - b0 < s->block ? n - b0 : s->block;
        float amax = 0;
        /* fmaxf's NaN rule without its libm call: a NaN compares false and leaves amax as it was */
        for (size_t j = 0; j < m; j++) {
            float a = fabsf(in[b0 + j]);
            amax = a > amax ? a : amax;
        }
        int shared = -127;
        if (amax > 0) {
            int ex;
            frexpf(amax, &ex);                      /* amax = f * 2^ex, f in [0.5, 1) */
            shared = ex - 1 - emax;
            shared = shared < -127 ? -127 : shared > 127 ? 127 : shared;
        }
        scales[k] = (unsigned char)(shared + 127);
        for (size_t j = 0; j < m; j++) {
            float v = in[b0 + j];
            unsigned c = mx_code(fabsf(v), shared, fp4);
            unsigned sign = signbit(v) ? (fp4 ? 8u : 0x80u) : 0u;
            size_t at = b0 + j;
            if (fp4)
                codes[at / 2] |= (unsigned char)((c | sign) << (at & 1 ? 4 : 0));
            else
                codes[at] = (unsigned char)(c | sign);
        }
    }
}

static void encode_int8(const cz_spec *s, const float *in, size_t n, int8_t *codes, float *scales)
{
    for (size_t b0 = 0, k = 0; b0 < n; b0 += s->block, k++) {
        size_t m = n - b0 < s->block ? n - b0 : s->block;
        float amax = 0;
        for (size_t j = 0; j < m; j++)
            amax = fmaxf(amax, fabsf(in[b0 + j]));
        float sc = amax / 127.0f;
        scales[k] = sc;
        for (size_t j = 0; j < m; j++) {
            float r = sc > 0 ? rintf(in[b0 + j] / sc) : 0.0f;
            codes[b0 + j] = (int8_t)(r > 127.0f ? 127 : r < -127.0f ? -127 : (int)r);
        }
    }
}

void cz_encode(const cz_spec *s, const float *in, size_t n, void *codes, void *scales)
{
    pthread_once(&tables_once, tables_build);
    if (s->enc == CZ_INT8_BLOCK)
        encode_int8(s, in, n, codes, scales);
    else
        encode_mx(s, in, n, codes, scales);
}
