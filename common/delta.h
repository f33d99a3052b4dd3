/* delta: the reference's pseudo-gradient rules (README.md, "Semantics"), made strict.
 *
 * A delta is `float32(baseline) - float32(current)` for the floating keys of a model, stored as F32
 * (C64 keys as complex F32 pairs; F16/BF16 deltas are accepted and upcast exactly), with string
 * metadata algorithm, base_outer_step, local_step, node_id, published at
 * nodes/<node_id>/delta_<local_step>.safetensors. */
#ifndef DELTA_H
#define DELTA_H

#include <stddef.h>
#include <stdint.h>

#include <cJSON.h>

#include "dl_error.h"
#include "safetensors.h"

#define DELTA_ALGORITHM "dumb_diloco"
#define DELTA_NODE_ID_MAX 64
/* Integers in paths and metadata are canonical decimals up to this value (fits JSON and int64). */
#define DELTA_INT_MAX 9007199254740991ULL   /* 2^53 - 1: exact in every JSON reader */

typedef struct delta_info {
    char node_id[DELTA_NODE_ID_MAX + 1];
    uint64_t base_outer_step;
    uint64_t local_step;
} delta_info;

/* [A-Za-z0-9._-]{1,64}, not "." or "..". */
int delta_valid_node_id(const char *s, size_t len);
/* Canonical decimal integer: digits only, no sign, no leading zero (except "0"), <= DELTA_INT_MAX. */
int delta_parse_int(const char *s, size_t len, uint64_t *out);
/* Exactly nodes/<node_id>/delta_<integer>.safetensors.  node_id receives the id (NUL-terminated). */
int delta_parse_path(const char *path, char node_id[DELTA_NODE_ID_MAX + 1], uint64_t *local_step,
                     dl_error *err);

/* The floating tensors of a header in name order (an array of pointers into h, to free()). */
int delta_floating_state(const st_header *h, const st_tensor ***out, size_t *n, dl_error *err);
/* The dtype a delta for a global tensor of dtype dt carries: C64 for C64, F32 for other floats. */
static inline st_dtype delta_dtype_for(st_dtype dt) { return dt == ST_C64 ? ST_C64 : ST_F32; }

/* Everything that can be checked from a delta's header alone: metadata (required keys, algorithm,
 * canonical integers, node id), agreement with path (when non-NULL), key set equal to the global's
 * floating keys, shapes, dtypes (F32/F16/BF16; C64 for C64 keys).  Fills info when non-NULL. */
int delta_check_header(const st_header *delta, const st_header *global, const char *path,
                       delta_info *info, dl_error *err);
/* Index of the first non-finite lane in n elements of dt (F32, F16, BF16, C64), or -1 if none. */
int64_t delta_find_non_finite(st_dtype dt, const void *data, size_t nelem);
/* delta_check_header plus a full scan of the data for NaN/Inf. */
int delta_validate(const st_file *delta, const st_header *global, const char *path, delta_info *info,
                   dl_error *err);

/* Writes the delta of two model files to out (atomically), with the reference's metadata. */
int delta_compute(const char *baseline, const char *current, const char *out, const char *node_id,
                  uint64_t base_outer_step, uint64_t local_step, dl_error *err);
/* FP32 average of n delta files in the given order (first file's keys and shapes are the reference;
 * others must match exactly).  Output: F32 (C64 for C64 keys), no metadata. */
int delta_average(const char *const *paths, size_t n, const char *out, dl_error *err);

/* The reference's metadata_json: every value JSON-decoded, or all values as strings when any value
 * is not valid JSON.  NULL on allocation failure. */
cJSON *delta_metadata_json(const st_header *h);

#endif
