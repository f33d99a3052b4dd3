/* compress: compressed deltas (README, "Compressed deltas"), the codec.
 *
 * A compressed delta is a delta (delta.h) whose metadata also holds `encoding` (int8_block, mxfp8 or
 * mxfp4) and `block` (values per scale).  A floating key K of the model is then either plain (F32,
 * F16, BF16; C64 for C64 keys), or compressed: K holds codes (I8, F8_E4M3 or F4) with K's shape, and
 * the tensor K + CZ_SCALES_SUFFIX holds one scale per block (F32 for int8_block, F8_E8M0 for the mx
 * formats) with shape [ceil(numel / block)].  The last block is shorter when block does not divide the
 * tensor's values.
 *
 * Decoding, bit for bit (value i of K, block b = i / block, q its code, s the block's scale):
 *   int8_block  x = (float)q * s           one F32 multiplication, rounded to nearest even
 *   mxfp8       x = e4m3(q) * 2^(e - 127)  exact in F32 (e the E8M0 scale byte)
 *   mxfp4       x = e2m1(q) * 2^(e - 127)  exact in F32; value 2j in the low nibble of byte j
 * A delta whose decoded values are not all finite is refused: a NaN code (E4M3 S.1111.111), the E8M0
 * NaN 0xFF, a non-finite or negative F32 scale, or a product that overflows.
 *
 * Encoding (the worker's side, diloco delta --encode), per block of values v (F32):
 *   int8_block  s = amax / 127 (F32 division), q = clamp(rint(v / s), -127, 127); s = 0, q = 0 when amax = 0
 *   mxfp8/mxfp4 as the OCP Microscaling spec (v1.0, 6.3): shared = floor(log2(amax)) - emax (8 for E4M3,
 *               2 for E2M1), clamped to [-127, 127] (amax = 0: -127), e = shared + 127; each v / 2^shared
 *               rounded to the nearest element value, ties to the even code, saturating at the largest
 *               normal (448, 6); the sign kept (-0 is the code 0x80 / 0x8). */
#ifndef COMPRESS_H
#define COMPRESS_H

#include <stddef.h>
#include <stdint.h>

#include "dl_error.h"
#include "safetensors.h"

#define CZ_SCALES_SUFFIX ".__scales__"
#define CZ_SCALES_SUFFIX_LEN (sizeof(CZ_SCALES_SUFFIX) - 1)
#define CZ_BLOCK_MIN 32u
#define CZ_BLOCK_MAX 4096u      /* a divisor of CK_BLOCK_ELEMS: checksum blocks hold whole scale blocks */
#define CZ_MX_BLOCK 32u

typedef enum cz_encoding { CZ_NONE = 0, CZ_INT8_BLOCK, CZ_MXFP8, CZ_MXFP4 } cz_encoding;

typedef struct cz_spec {
    cz_encoding enc;
    uint32_t block;
} cz_spec;

/* "int8_block", "mxfp8", "mxfp4"; "none" for CZ_NONE. */
const char *cz_encoding_name(cz_encoding enc);
/* The encoding named by s (len bytes): 0, or -1. */
int cz_encoding_parse(const char *s, size_t len, cz_encoding *out);
/* The spec of a delta's metadata: no `encoding` key is CZ_NONE (and then `block` is refused); else the
 * name and a canonical decimal `block`: a power of two in [CZ_BLOCK_MIN, CZ_BLOCK_MAX] for int8_block,
 * CZ_MX_BLOCK for the mx formats. */
int cz_spec_from_meta(const st_meta *meta, size_t nmeta, cz_spec *out, dl_error *err);
/* Whether enc's spec is complete and valid (the block rule above). */
int cz_spec_valid(const cz_spec *s);

st_dtype cz_code_dtype(cz_encoding enc);
st_dtype cz_scale_dtype(cz_encoding enc);
/* Whether name ends with CZ_SCALES_SUFFIX (and is longer than it). */
int cz_is_scales_name(const char *name, size_t len);
/* The scales' count for nelem values. */
static inline uint64_t cz_nscales(uint64_t nelem, uint32_t block) { return (nelem + block - 1) / block; }
/* The scales' name of the key name (len bytes, may hold NUL): malloc'd, NUL-terminated (length len +
 * CZ_SCALES_SUFFIX_LEN), or NULL. */
char *cz_scales_name(const char *name, size_t len);
/* Bytes of n codes (F4: n / 2, n even). */
uint64_t cz_code_bytes(cz_encoding enc, uint64_t n);

/* Decodes n values from value index first (a multiple of 2 for mxfp4) of one tensor: codes holds their
 * codes, scales the scales from block first / block on.  Returns the index (from 0) of the first value
 * that does not decode to a finite F32, or -1.  out is filled either way. */
int64_t cz_decode(const cz_spec *s, const void *codes, const void *scales, uint64_t first, float *out, size_t n);

/* Encodes n values of one tensor (from its first value, or a block boundary): codes and
 * cz_nscales(n, block) scales. */
void cz_encode(const cz_spec *s, const float *in, size_t n, void *codes, void *scales);

/* The value of each code, for tests and the tables: E4M3 (256 codes; NaN for 0x7f, 0xff), E2M1 (16). */
float cz_e4m3_value(uint8_t code);
float cz_e2m1_value(uint8_t code);
float cz_e8m0_value(uint8_t code);

#endif
