/* compress: the element formats, the encoders' rounding and saturation, decoding's refusals and the
 * metadata rules (README, "Compressed deltas").  The exhaustive comparison with numpy is
 * tests/integration/test_compress.py. */
#include "test.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "compress.h"

TEST(compress_element_values)
{
    CHECK(cz_e4m3_value(0x00) == 0.0f && signbit(cz_e4m3_value(0x80)));
    CHECK(cz_e4m3_value(0x01) == ldexpf(1, -9));         /* the smallest subnormal */
    CHECK(cz_e4m3_value(0x08) == ldexpf(1, -6));         /* the smallest normal */
    CHECK(cz_e4m3_value(0x7e) == 448.0f && cz_e4m3_value(0xfe) == -448.0f);
    CHECK(isnan(cz_e4m3_value(0x7f)) && isnan(cz_e4m3_value(0xff)));
    static const float e2m1[8] = {0, 0.5f, 1, 1.5f, 2, 3, 4, 6};
    for (uint8_t c = 0; c < 8; c++) {
        CHECK(cz_e2m1_value(c) == e2m1[c]);
        CHECK(cz_e2m1_value((uint8_t)(c | 8)) == -e2m1[c]);
    }
    CHECK(cz_e8m0_value(127) == 1.0f && cz_e8m0_value(0) == ldexpf(1, -127) && cz_e8m0_value(254) == ldexpf(1, 127));
    CHECK(isnan(cz_e8m0_value(255)));
}

/* mxfp4 of one block: scale 2^(floor(log2 amax) - 2), ties to the even code, saturation at 6. */
TEST(compress_mxfp4_rounds_to_even_and_saturates)
{
    float in[32] = {7.0f, 6.0f, 5.0f, 2.5f, 0.25f, -0.75f, -0.0f, 1.25f};
    unsigned char codes[16], scale;
    float out[32];
    const cz_spec s = {CZ_MXFP4, 32};

    cz_encode(&s, in, 32, codes, &scale);
    CHECK_EQ(scale, 127);                                /* amax 7: floor(log2 7) - 2 = 0 */
    CHECK_EQ(cz_decode(&s, codes, &scale, 0, out, 32), -1);
    CHECK(out[0] == 6.0f);                               /* 7 saturates at 6 */
    CHECK(out[1] == 6.0f);
    CHECK(out[2] == 4.0f);                               /* 5: between 4 and 6, to 4 (even code 6) */
    CHECK(out[3] == 2.0f);                               /* 2.5: between 2 and 3, to 2 */
    CHECK(out[4] == 0.0f);                               /* 0.25: between 0 and 0.5, to 0 */
    CHECK(out[5] == -1.0f);                              /* -0.75: between 0.5 and 1, to 1 (code 2) */
    CHECK(out[6] == 0.0f && signbit(out[6]));            /* -0 keeps its sign */
    CHECK(out[7] == 1.0f);                               /* 1.25: between 1 and 1.5, to 1 */
    CHECK_EQ(codes[0], 0x77);                            /* values 0 and 1: low nibble first */
}

TEST(compress_int8_is_absmax_over_127)
{
    float in[64], out[64], sc[2];
    int8_t q[64];
    const cz_spec s = {CZ_INT8_BLOCK, 32};

    for (int i = 0; i < 64; i++)
        in[i] = i < 32 ? (float)(i - 16) / 4.0f : 0.0f;  /* the second block all zero */
    cz_encode(&s, in, 64, q, sc);
    CHECK(sc[0] == 4.0f / 127.0f && sc[1] == 0.0f);
    CHECK_EQ(q[0], -127);
    CHECK_EQ(q[32], 0);
    CHECK_EQ(cz_decode(&s, q, sc, 0, out, 64), -1);
    for (int i = 0; i < 64; i++)
        CHECK(out[i] == (float)q[i] * sc[i / 32]);
}

/* A value that does not decode to a finite F32 is named: NaN codes and scales, negative int8 scales,
 * an overflowing product; decoding from a block boundary past the first uses the right scale. */
TEST(compress_decode_names_the_first_non_finite_value)
{
    const cz_spec s8 = {CZ_MXFP8, 32}, i8 = {CZ_INT8_BLOCK, 32};
    unsigned char codes[64] = {0}, scales[2] = {127, 127};
    float out[64], fs[2] = {1.0f, -1.0f};
    int8_t q[64] = {0};

    codes[40] = 0x7f;
    CHECK_EQ(cz_decode(&s8, codes, scales, 0, out, 64), 40);
    codes[40] = 0x7e;
    scales[1] = 254;                                      /* 448 * 2^127 overflows */
    CHECK_EQ(cz_decode(&s8, codes, scales, 0, out, 64), 40);
    scales[1] = 255;
    CHECK_EQ(cz_decode(&s8, codes, scales, 0, out, 64), 32);
    CHECK_EQ(cz_decode(&s8, codes + 32, scales + 1, 32, out, 32), 0);
    CHECK_EQ(cz_decode(&i8, q, fs, 0, out, 64), 32);     /* the negative scale's first value */
    fs[1] = 3.0f;
    q[33] = 5;
    CHECK_EQ(cz_decode(&i8, q + 32, fs + 1, 32, out, 32), -1);
    CHECK(out[1] == 15.0f);
}

static int spec_of(const char *enc, const char *block, cz_spec *out)
{
    st_meta m[2] = {{"block", 5, (char *)block, block ? strlen(block) : 0},
                    {"encoding", 8, (char *)enc, enc ? strlen(enc) : 0}};
    size_t n = 0;
    st_meta list[2] = {{0}};
    if (block)
        list[n++] = m[0];
    if (enc)
        list[n++] = m[1];
    return cz_spec_from_meta(list, n, out, NULL);
}

TEST(compress_metadata_rules)
{
    cz_spec s;
    CHECK_EQ(spec_of(NULL, NULL, &s), 0);
    CHECK_EQ(s.enc, CZ_NONE);
    CHECK_EQ(spec_of("int8_block", "4096", &s), 0);
    CHECK_EQ(s.block, 4096);
    CHECK_EQ(spec_of("mxfp4", "32", &s), 0);
    CHECK(spec_of(NULL, "32", &s) < 0);                   /* block without encoding */
    CHECK(spec_of("int8_block", NULL, &s) < 0);
    CHECK(spec_of("int8_block", "48", &s) < 0);           /* not a power of two */
    CHECK(spec_of("int8_block", "16", &s) < 0);
    CHECK(spec_of("int8_block", "8192", &s) < 0);
    CHECK(spec_of("int8_block", "032", &s) < 0);          /* not canonical */
    CHECK(spec_of("mxfp8", "64", &s) < 0);
    CHECK(spec_of("fp2", "32", &s) < 0);
    CHECK(spec_of("int8_block", "99999999999999999999999", &s) < 0);
    CHECK(cz_is_scales_name("a" CZ_SCALES_SUFFIX, 1 + CZ_SCALES_SUFFIX_LEN));
    CHECK(!cz_is_scales_name(CZ_SCALES_SUFFIX, CZ_SCALES_SUFFIX_LEN));
    CHECK(!cz_is_scales_name("a.scales", 8));
}

/* The reference of the mx encoders' rounding: the nearest of the element values by search (ties to the
 * even code, saturating at the last), as the encoder computed it before its exponent-and-mantissa form
 * (compress.c, mx_code).  The two must give the same code for every value. */
static unsigned search_code(const float *values, unsigned ncodes, double w)
{
    unsigned lo = 0, hi = ncodes - 1;
    if (w >= values[hi])
        return hi;
    while (lo < hi) {
        unsigned mid = (lo + hi + 1) / 2;
        if ((double)values[mid] <= w)
            lo = mid;
        else
            hi = mid - 1;
    }
    double below = w - values[lo], above = (double)values[lo + 1] - w;
    if (below < above)
        return lo;
    if (below > above)
        return lo + 1;
    return lo % 2 == 0 ? lo : lo + 1;
}

/* Encodes 31 values a (|a| below 2^(shared + emax + 1)) in a block whose amax fixes shared; checks
 * each code against the search. */
static int check_block(cz_encoding enc, int shared, const float *a, const float *table, unsigned ncodes)
{
    const int emax = enc == CZ_MXFP4 ? 2 : 8;
    const cz_spec s = {enc, 32};
    float in[32];
    unsigned char codes[32], scale;

    in[0] = nextafterf(ldexpf(1.0f, shared + emax + 1), 0);      /* floor(log2 amax) = shared + emax */
    memcpy(in + 1, a, 31 * sizeof(float));
    cz_encode(&s, in, 32, codes, &scale);
    if (scale != shared + 127)
        return -1000;
    for (int j = 1; j < 32; j++) {
        unsigned got = enc == CZ_MXFP4 ? (codes[j / 2] >> (j & 1 ? 4 : 0)) & 15 : codes[j];
        unsigned sign = signbit(in[j]) ? (enc == CZ_MXFP4 ? 8u : 0x80u) : 0u;
        unsigned want = search_code(table, ncodes, ldexp(fabs((double)in[j]), -shared)) | sign;
        if (got != want) {
            fprintf(stderr, "  %s shared %d value %a: code %u, the search's %u\n", cz_encoding_name(enc), shared,
                    (double)in[j], got, want);
            return j;
        }
    }
    return 0;
}

TEST(compress_mx_rounding_is_the_search_everywhere)
{
    static const int shareds[] = {-127, -126, -120, -20, -1, 0, 7, 100};
    for (int fp4 = 0; fp4 < 2; fp4++) {
        const cz_encoding enc = fp4 ? CZ_MXFP4 : CZ_MXFP8;
        const unsigned ncodes = fp4 ? 8 : 127;
        float table[127];
        for (unsigned c = 0; c < ncodes; c++)
            table[c] = fp4 ? cz_e2m1_value((uint8_t)c) : cz_e4m3_value((uint8_t)c);
        for (size_t si = 0; si < sizeof(shareds) / sizeof(shareds[0]); si++) {
            int shared = shareds[si];
            float a[31];
            int n = 0;
            /* every midpoint between neighbouring values, and the floats around it */
            for (unsigned c = 0; c + 1 < ncodes; c++) {
                double mid = ((double)table[c] + table[c + 1]) / 2;
                float m = (float)ldexp(mid, shared);
                float around[] = {m, nextafterf(m, 0), nextafterf(m, INFINITY), nextafterf(nextafterf(m, 0), 0),
                                  (float)ldexp(table[c], shared), (float)ldexp(table[c + 1], shared)};
                for (size_t i = 0; i < sizeof(around) / sizeof(around[0]); i++) {
                    a[n++] = (i & 1) ? -around[i] : around[i];
                    if (n == 31) {
                        CHECK_EQ(check_block(enc, shared, a, table, ncodes), 0);
                        n = 0;
                    }
                }
            }
            /* values up to the block's top, log-uniform, and the F32 subnormals */
            uint32_t x = 12345u + (uint32_t)si;
            for (int k = 0; k < 20000; k++) {
                x = x * 1664525u + 1013904223u;
                double e = (double)(x >> 8) / (double)(1u << 24) * 40.0 - 30.0;
                float v = (float)ldexp(exp2(fmod(e, 1.0)), shared + (int)floor(e));
                if (k % 7 == 0) {
                    uint32_t sub = x >> 9;           /* an F32 subnormal */
                    memcpy(&v, &sub, 4);
                }
                if (!(fabsf(v) < ldexpf(1.0f, shared + (fp4 ? 3 : 9))) || !isfinite(v))
                    continue;
                a[n++] = (x & 1) ? -v : v;
                if (n == 31) {
                    CHECK_EQ(check_block(enc, shared, a, table, ncodes), 0);
                    n = 0;
                }
            }
        }
    }
}
