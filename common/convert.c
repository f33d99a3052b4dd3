#include "convert.h"

#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <string.h>

static inline uint32_t f2u(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline float u2f(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

/* Half -> float: move exponent and mantissa into place, rebias, then fix the two special ranges with
 * selects: Inf/NaN (exponent all ones) and subnormals (renormalised exactly by a float subtraction). */
static void f16_to_f32_portable(const uint16_t *restrict in, float *restrict out, size_t n)
{
    const uint32_t shifted_exp = 0x7c00u << 13;
    for (size_t i = 0; i < n; i++) {
        uint32_t h = in[i];
        uint32_t o = (h & 0x7fffu) << 13;
        uint32_t exp = o & shifted_exp;
        o += (uint32_t)(127 - 15) << 23;
        uint32_t inf_nan = o + ((uint32_t)(128 - 16) << 23);
        uint32_t denorm = f2u(u2f(o + (1u << 23)) - u2f(113u << 23));
        o = exp == shifted_exp ? inf_nan : o;
        o = exp == 0 ? denorm : o;
        out[i] = u2f(o | ((h & 0x8000u) << 16));
    }
}

/* Float -> half, round to nearest even.  Normal range: add the rounding bias (0xfff plus the lowest
 * kept bit) and truncate.  Subnormal range: an exact float addition of a magic constant lets the FPU
 * round.  Overflow -> Inf; NaN -> quiet NaN 0x7e00. */
static void f32_to_f16_portable(const float *restrict in, uint16_t *restrict out, size_t n)
{
    const uint32_t f32_inf = 255u << 23;
    const uint32_t f16_max = (127u + 16u) << 23;
    const uint32_t denorm_magic = ((127u - 15u) + (23u - 10u) + 1u) << 23;
    for (size_t i = 0; i < n; i++) {
        uint32_t u = f2u(in[i]);
        uint32_t sign = u & 0x80000000u;
        u ^= sign;
        uint32_t special = u > f32_inf ? 0x7e00u : 0x7c00u;
        uint32_t sub = f2u(u2f(u) + u2f(denorm_magic)) - denorm_magic;
        uint32_t mant_odd = (u >> 13) & 1u;
        uint32_t norm = (u + ((uint32_t)(15 - 127) << 23) + 0xfffu + mant_odd) >> 13;
        uint32_t o = u >= f16_max ? special : (u < (113u << 23) ? sub : norm);
        out[i] = (uint16_t)(o | (sign >> 16));
    }
}


/* x86-64 with F16C converts 8 halves per instruction (vcvtph2ps / vcvtps2ph, IEEE round to nearest
 * even, NaN stays NaN): about twice the portable bit-twiddling.  Chosen at run time, so the binary
 * still runs on CPUs without F16C; the unit tests compare both paths with gcc's _Float16. */
#if defined(__x86_64__) && defined(__GNUC__)
#include <cpuid.h>
#include <immintrin.h>
#define HAVE_F16C_PATH 1

__attribute__((target("avx,f16c"))) static void f16_to_f32_f16c(const uint16_t *restrict in,
                                                                  float *restrict out, size_t n)
{
    size_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(in + i))));
    f16_to_f32_portable(in + i, out + i, n - i);
}

__attribute__((target("avx,f16c"))) static void f32_to_f16_f16c(const float *restrict in,
                                                                  uint16_t *restrict out, size_t n)
{
    size_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128((__m128i *)(out + i),
                         _mm256_cvtps_ph(_mm256_loadu_ps(in + i), _MM_FROUND_TO_NEAREST_INT));
    f32_to_f16_portable(in + i, out + i, n - i);
}

static int have_f16c(void)
{
    static _Atomic int cached = -1;     /* every thread computes the same value */
    int v = atomic_load_explicit(&cached, memory_order_relaxed);
    if (v < 0) {
        /* CPUID.1:ECX: F16C (bit 29), AVX (28), OSXSAVE (27); and the OS must save YMM state */
        unsigned a, b, c, d;
        v = 0;
        if (__get_cpuid(1, &a, &b, &c, &d) && (c & (1u << 29)) && (c & (1u << 28)) && (c & (1u << 27))) {
            unsigned lo, hi;
            __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
            v = (lo & 6u) == 6u;
        }
        atomic_store_explicit(&cached, v, memory_order_relaxed);
    }
    return v;
}
#endif

int cv_force_portable;

void cv_f16_to_f32(const uint16_t *restrict in, float *restrict out, size_t n)
{
#ifdef HAVE_F16C_PATH
    if (!cv_force_portable && have_f16c()) {
        f16_to_f32_f16c(in, out, n);
        return;
    }
#endif
    f16_to_f32_portable(in, out, n);
}

void cv_f32_to_f16(const float *restrict in, uint16_t *restrict out, size_t n)
{
#ifdef HAVE_F16C_PATH
    if (!cv_force_portable && have_f16c()) {
        f32_to_f16_f16c(in, out, n);
        return;
    }
#endif
    f32_to_f16_portable(in, out, n);
}

void cv_bf16_to_f32(const uint16_t *restrict in, float *restrict out, size_t n)
{
    for (size_t i = 0; i < n; i++)
        out[i] = u2f((uint32_t)in[i] << 16);
}

void cv_f32_to_f64(const float *restrict in, double *restrict out, size_t n)
{
    for (size_t i = 0; i < n; i++)
        out[i] = (double)in[i];
}

void cv_f64_to_f32(const double *restrict in, float *restrict out, size_t n)
{
    for (size_t i = 0; i < n; i++)
        out[i] = (float)in[i];          /* IEEE conversion: round to nearest even */
}

void cv_f32_to_bf16(const float *restrict in, uint16_t *restrict out, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        uint32_t u = f2u(in[i]);
        uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
        uint32_t quiet_nan = (u >> 16) | 0x40u;
        out[i] = (uint16_t)((u & 0x7fffffffu) > 0x7f800000u ? quiet_nan : rounded);
    }
}

/* ---- byte-sized F8 formats: decoded through 256-entry tables built once --------------------- */

enum { F8_E5M2, F8_E4M3, F8_E8M0, F8_E4M3FNUZ, F8_E5M2FNUZ, F8_COUNT };
static float f8_table[F8_COUNT][256];
static pthread_once_t f8_once = PTHREAD_ONCE_INIT;

/* Value of a sign/exponent/mantissa minifloat with the given bias, no specials (handled by caller). */
static float minifloat(unsigned b, int ebits, int mbits, int bias)
{
    unsigned sign = (b >> (ebits + mbits)) & 1u;
    unsigned e = (b >> mbits) & ((1u << ebits) - 1);
    unsigned m = b & ((1u << mbits) - 1);
    float v = e == 0 ? ldexpf((float)m, 1 - bias - mbits)
                     : ldexpf((float)((1u << mbits) | m), (int)e - bias - mbits);
    return sign ? -v : v;
}

static void f8_build(void)
{
    for (unsigned b = 0; b < 256; b++) {
        /* E5M2: IEEE-like, exponent 31 is Inf (mantissa 0) or NaN */
        float v = minifloat(b, 5, 2, 15);
        if (((b >> 2) & 0x1f) == 0x1f)
            v = (b & 3) ? NAN : ((b & 0x80) ? -INFINITY : INFINITY);
        f8_table[F8_E5M2][b] = v;
        /* E4M3 (fn): no Inf, NaN only at S.1111.111 */
        v = minifloat(b, 4, 3, 7);
        f8_table[F8_E4M3][b] = (b & 0x7f) == 0x7f ? NAN : v;
        /* E4M3FNUZ / E5M2FNUZ: bias 8 / 16, no Inf, no negative zero: 0x80 is the NaN */
        f8_table[F8_E4M3FNUZ][b] = b == 0x80 ? NAN : minifloat(b, 4, 3, 8);
        f8_table[F8_E5M2FNUZ][b] = b == 0x80 ? NAN : minifloat(b, 5, 2, 16);
        /* E8M0: unsigned power of two 2^(b-127), 0xff is NaN */
        f8_table[F8_E8M0][b] = b == 0xff ? NAN : ldexpf(1.0f, (int)b - 127);
    }
}

static int f8_index(st_dtype dt)
{
    switch (dt) {
    case ST_F8_E5M2: return F8_E5M2;
    case ST_F8_E4M3: return F8_E4M3;
    case ST_F8_E8M0: return F8_E8M0;
    case ST_F8_E4M3FNUZ: return F8_E4M3FNUZ;
    case ST_F8_E5M2FNUZ: return F8_E5M2FNUZ;
    default: return -1;
    }
}

const float *cv_f8_table(st_dtype dt)
{
    int f8 = f8_index(dt);

    if (f8 < 0)
        return NULL;
    pthread_once(&f8_once, f8_build);
    return f8_table[f8];
}

int cv_can_decode(st_dtype dt)
{
    return dt == ST_F16 || dt == ST_BF16 || dt == ST_F32 || dt == ST_F64 || dt == ST_C64 ||
           f8_index(dt) >= 0;
}

int cv_can_encode(st_dtype dt)
{
    return dt == ST_F16 || dt == ST_BF16 || dt == ST_F32 || dt == ST_F64 || dt == ST_C64;
}

int cv_decode(st_dtype dt, const void *restrict in, float *restrict out, size_t nelem)
{
    int f8 = f8_index(dt);

    switch (dt) {
    case ST_F32: memcpy(out, in, nelem * 4); return 0;
    case ST_C64: memcpy(out, in, nelem * 8); return 0;
    case ST_F16: cv_f16_to_f32(in, out, nelem); return 0;
    case ST_BF16: cv_bf16_to_f32(in, out, nelem); return 0;
    case ST_F64: cv_f64_to_f32(in, out, nelem); return 0;
    default: break;
    }
    if (f8 < 0)
        return -DL_E_UNSUPPORTED_DTYPE;
    pthread_once(&f8_once, f8_build);
    const unsigned char *b = in;
    for (size_t i = 0; i < nelem; i++)
        out[i] = f8_table[f8][b[i]];
    return 0;
}

int cv_encode(st_dtype dt, const float *restrict in, void *restrict out, size_t nelem)
{
    switch (dt) {
    case ST_F32: memcpy(out, in, nelem * 4); return 0;
    case ST_C64: memcpy(out, in, nelem * 8); return 0;
    case ST_F16: cv_f32_to_f16(in, out, nelem); return 0;
    case ST_BF16: cv_f32_to_bf16(in, out, nelem); return 0;
    case ST_F64: cv_f32_to_f64(in, out, nelem); return 0;
    default: return -DL_E_UNSUPPORTED_DTYPE;
    }
}
