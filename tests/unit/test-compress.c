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
