#include "test.h"

#include <math.h>
#include <stdlib.h>

#include "convert.h"

static uint32_t f2u(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static float u2f(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

/* Oracle: gcc's _Float16 conversions (libgcc soft-float, IEEE round-to-nearest-even). */
static float ref_h2f(uint16_t h) { _Float16 x; memcpy(&x, &h, 2); return (float)x; }
static uint16_t ref_f2h(float f) { _Float16 x = (_Float16)f; uint16_t h; memcpy(&h, &x, 2); return h; }

static void f16_to_f32_exhaustive_body(void);
TEST(f16_to_f32_exhaustive)
{
    cv_force_portable = 0;
    f16_to_f32_exhaustive_body();
}

TEST(f16_to_f32_exhaustive_portable)
{
    cv_force_portable = 1;
    f16_to_f32_exhaustive_body();
}

static void f16_to_f32_exhaustive_body(void)
{
    static uint16_t in[65536];
    static float out[65536];
    for (uint32_t i = 0; i < 65536; i++)
        in[i] = (uint16_t)i;
    cv_f16_to_f32(in, out, 65536);
    for (uint32_t i = 0; i < 65536; i++) {
        float want = ref_h2f((uint16_t)i);
        if (isnan(want))
            CHECK(isnan(out[i]) && (f2u(out[i]) >> 31) == (i >> 15));
        else
            CHECK_HEX(f2u(out[i]), f2u(want));
    }
}

/* Every f16 value, the midpoints between neighbours (ties) and one f32 ulp either side of them. */
static void f32_to_f16_rounding_boundaries_body(void);
TEST(f32_to_f16_rounding_boundaries)
{
    cv_force_portable = 0;
    f32_to_f16_rounding_boundaries_body();
}

TEST(f32_to_f16_rounding_boundaries_portable)
{
    cv_force_portable = 1;
    f32_to_f16_rounding_boundaries_body();
}

static void f32_to_f16_rounding_boundaries_body(void)
{
    enum { N = 65536 * 5 };
    float *in = malloc(N * sizeof(float));
    uint16_t *out = malloc(N * sizeof(uint16_t));
    size_t n = 0;
    for (uint32_t h = 0; h < 65536; h++) {
        float a = ref_h2f((uint16_t)h);
        float b = ref_h2f((uint16_t)(h + 1));
        in[n++] = a;
        if (isfinite(a) && isfinite(b) && (h & 0x7fff) != 0x7bff && (h & 0x7fff) != 0x7fff) {
            float mid = (float)(((double)a + (double)b) / 2);   /* exact: f16 midpoints fit in f32 */
            in[n++] = mid;
            in[n++] = nextafterf(mid, INFINITY);
            in[n++] = nextafterf(mid, -INFINITY);
        }
    }
    in[n++] = 65520.0f;             /* rounds to Inf */
    in[n++] = 65519.996f;           /* rounds to max */
    in[n++] = 1e-8f;                /* below the smallest subnormal's half: 0 */
    cv_f32_to_f16(in, out, n);
    for (size_t i = 0; i < n; i++) {
        uint16_t want = ref_f2h(in[i]);
        if (isnan(in[i]))
            CHECK((out[i] & 0x7c00) == 0x7c00 && (out[i] & 0x3ff) != 0);
        else if (out[i] != want)
            fprintf(stderr, "  input %a (0x%08x)\n", (double)in[i], f2u(in[i]));
        if (!isnan(in[i]))
            CHECK_HEX(out[i], want);
    }
    free(in);
    free(out);
}

static uint32_t rng_state = 12345;
static uint32_t rng(void)
{
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 17;
    rng_state ^= rng_state << 5;
    return rng_state;
}

static void f32_to_f16_random_body(void);
TEST(f32_to_f16_random)
{
    cv_force_portable = 0;
    f32_to_f16_random_body();
}

TEST(f32_to_f16_random_portable)
{
    cv_force_portable = 1;
    f32_to_f16_random_body();
}

static void f32_to_f16_random_body(void)
{
    enum { N = 1 << 20 };
    float *in = malloc(N * sizeof(float));
    uint16_t *out = malloc(N * sizeof(uint16_t));
    for (size_t i = 0; i < N; i++)
        in[i] = u2f(rng());
    cv_f32_to_f16(in, out, N);
    for (size_t i = 0; i < N; i++) {
        if (isnan(in[i]))
            CHECK((out[i] & 0x7c00) == 0x7c00 && (out[i] & 0x3ff) != 0);
        else
            CHECK_HEX(out[i], ref_f2h(in[i]));
    }
    free(in);
    free(out);
}

/* Oracle for bf16: pick the nearer of the two truncation neighbours in double arithmetic, ties to
 * the even one. */
static uint16_t ref_f2bf(float f)
{
    uint32_t u = f2u(f);
    if (isnan(f))
        return (uint16_t)((u >> 16) | 0x40);
    uint16_t lo = (uint16_t)(u >> 16), hi = (uint16_t)(lo + 1);
    double x = fabs((double)f);
    double a = fabs((double)u2f((uint32_t)lo << 16)), b = fabs((double)u2f((uint32_t)hi << 16));
    if ((hi & 0x7f80) == 0x7f80 && (hi & 0x7f) == 0)
        b = ldexp(1.0, 128);    /* the neighbour above the max finite is Inf: distance as if 2^128 */
    if (x - a < b - x) return lo;
    if (x - a > b - x) return hi;
    return (lo & 1) ? hi : lo;
}

TEST(f32_to_bf16_random_and_ties)
{
    enum { N = 1 << 20 };
    float *in = malloc((N + 4) * sizeof(float));
    uint16_t *out = malloc((N + 4) * sizeof(uint16_t));
    for (size_t i = 0; i < N; i++) {
        uint32_t u = rng();
        if (i % 4 == 0)
            u = (u & 0xffff0000u) | 0x8000u;    /* an exact tie */
        in[i] = u2f(u);
    }
    in[N] = u2f(0x7f7fffffu);           /* max float rounds to Inf */
    in[N + 1] = INFINITY;
    in[N + 2] = -0.0f;
    in[N + 3] = u2f(0x7f800001u);       /* signalling NaN stays NaN */
    cv_f32_to_bf16(in, out, N + 4);
    for (size_t i = 0; i < N + 4; i++)
        CHECK_HEX(out[i], ref_f2bf(in[i]));
    CHECK_HEX(out[N], 0x7f80);
    CHECK_HEX(out[N + 2], 0x8000);
    CHECK((out[N + 3] & 0x7f80) == 0x7f80 && (out[N + 3] & 0x7f) != 0);
    free(in);
    free(out);
}

TEST(bf16_f64_widening_exact)
{
    uint16_t b[3] = {0x3f80, 0xc000, 0x7fc0};
    float f[3];
    double d[3];
    cv_bf16_to_f32(b, f, 3);
    CHECK(f[0] == 1.0f && f[1] == -2.0f && isnan(f[2]));
    cv_f32_to_f64(f, d, 3);
    CHECK(d[0] == 1.0 && d[1] == -2.0 && isnan(d[2]));
    double in[4] = {1.0 + ldexp(1.0, -24), 1.0 + 3 * ldexp(1.0, -24), 1e300, NAN};
    cv_f64_to_f32(in, f, 3);
    float g;
    cv_f64_to_f32(in + 3, &g, 1);
    CHECK_HEX(f2u(f[0]), f2u(1.0f));                        /* tie to even (down) */
    CHECK_HEX(f2u(f[1]), f2u(1.0f + ldexpf(1.0f, -22)));    /* tie to even (up) */
    CHECK(isinf(f[2]) && isnan(g));
}

TEST(f8_decode_tables)
{
    uint8_t b[6] = {0x38, 0x7c, 0x7f, 0x7e, 0x01, 0x80};
    float f[6];
    CHECK_EQ(cv_decode(ST_F8_E4M3, b, f, 6), 0);
    CHECK(f[0] == 1.0f && f[1] == 384.0f && isnan(f[2]) && f[3] == 448.0f && f[4] == ldexpf(1, -9));
    CHECK(f[5] == 0.0f && signbit(f[5]));
    uint8_t e5[3] = {0x3c, 0x7c, 0x7d};
    CHECK_EQ(cv_decode(ST_F8_E5M2, e5, f, 3), 0);
    CHECK(f[0] == 1.0f && isinf(f[1]) && isnan(f[2]));
    uint8_t e8[3] = {127, 0, 0xff};
    CHECK_EQ(cv_decode(ST_F8_E8M0, e8, f, 3), 0);
    CHECK(f[0] == 1.0f && f[1] == ldexpf(1, -127) && isnan(f[2]));
    uint8_t fnuz[2] = {0x80, 0x40};
    CHECK_EQ(cv_decode(ST_F8_E4M3FNUZ, fnuz, f, 2), 0);
    CHECK(isnan(f[0]) && f[1] == 1.0f);
    CHECK_EQ(cv_decode(ST_F8_E5M2FNUZ, fnuz, f, 2), 0);
    CHECK(isnan(f[0]) && f[1] == 1.0f);
    CHECK_EQ(cv_decode(ST_F4, b, f, 2), -DL_E_UNSUPPORTED_DTYPE);
    CHECK_EQ(cv_encode(ST_F8_E4M3, f, b, 1), -DL_E_UNSUPPORTED_DTYPE);
}
