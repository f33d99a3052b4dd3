/* convert: exact dtype conversions to and from F32, written as straight loops over bit patterns so
 * that the compiler vectorises them (no branches on values, no libm calls in the hot loops). */
#ifndef CONVERT_H
#define CONVERT_H

#include <stddef.h>
#include <stdint.h>

#include "safetensors.h"

/* Tests set this to exercise the portable code where the CPU has a faster path (F16C). */
extern int cv_force_portable;

/* Exact widening conversions (every value is representable). */
void cv_f16_to_f32(const uint16_t *restrict in, float *restrict out, size_t n);
void cv_bf16_to_f32(const uint16_t *restrict in, float *restrict out, size_t n);
void cv_f32_to_f64(const float *restrict in, double *restrict out, size_t n);
/* Narrowing conversions, round-to-nearest-even; NaN stays NaN (quiet), +-Inf and overflow give Inf. */
void cv_f32_to_f16(const float *restrict in, uint16_t *restrict out, size_t n);
void cv_f32_to_bf16(const float *restrict in, uint16_t *restrict out, size_t n);
void cv_f64_to_f32(const double *restrict in, float *restrict out, size_t n);

/* F32 lanes per element: 2 for C64 (real, imaginary), 1 otherwise. */
static inline size_t cv_lanes(st_dtype dt) { return dt == ST_C64 ? 2 : 1; }
/* Whether cv_decode/cv_encode handle dt: F16, BF16, F32, F64, C64, the byte-sized F8 formats (decode
 * only).  The packed sub-byte F6/F4 formats have no agreed element order and are refused. */
int cv_can_decode(st_dtype dt);
int cv_can_encode(st_dtype dt);
/* nelem elements of dt at in -> nelem * cv_lanes(dt) floats.  Returns 0 or -DL_E_UNSUPPORTED_DTYPE. */
int cv_decode(st_dtype dt, const void *restrict in, float *restrict out, size_t nelem);
/* The 256 values of a byte-sized F8 dtype (NaN codes included), or NULL for another dtype. */
const float *cv_f8_table(st_dtype dt);
int cv_encode(st_dtype dt, const float *restrict in, void *restrict out, size_t nelem);

#endif
