/* delta: the reference's pseudo-gradient rules (README.md, "Semantics"), made strict.
 *
 * A delta is `float32(baseline) - float32(current)` for the floating keys of a model, stored as F32
 * (C64 keys as complex F32 pairs; F16/BF16 deltas are accepted and upcast exactly), with string
 * metadata algorithm, base_outer_step, local_step, node_id, published at
 * nodes/<node_id>/delta_<local_step>.safetensors, or sharded (st_index.h) as
 * nodes/<node_id>/delta_<local_step>.safetensors.index.json (the metadata, in the index) plus
 * nodes/<node_id>/delta_<local_step>-<i>-of-<N>.safetensors.
 *
 * The rules are written once, over metadata lists and name-ordered tensor lists, so a single file
 * and a set are judged by the same code: delta_check_meta (metadata, path), delta_check_tensors
 * (key set, shapes, dtypes against the global's floating tensors). */
#ifndef DELTA_H
#define DELTA_H

#include <stddef.h>
#include <stdint.h>

#include <cJSON.h>

#include "checksum.h"
#include "compress.h"
#include "delta_norm.h"
#include "dl_error.h"
#include "safetensors.h"
#include "st_index.h"

#define DELTA_ALGORITHM "dumb_diloco"
#define DELTA_NODE_ID_MAX 64
/* Integers in paths and metadata are canonical decimals up to this value (fits JSON and int64). */
#define DELTA_INT_MAX 9007199254740991ULL   /* 2^53 - 1: exact in every JSON reader */

/* What a worker may report about its round in the delta's metadata, all optional (README, "Worker
 * metrics"): loss, num_tokens, inner_steps, tokens_per_second, weight and up to DELTA_METRICS_MAX
 * free-form metric.<name> keys.  Each value is a decimal string of at most DELTA_METRIC_VALUE_MAX
 * characters: -?[0-9]+(\.[0-9]+)?([eE][+-]?[0-9]+)?, finite as a double; num_tokens and inner_steps
 * are canonical non-negative integers (delta_parse_int), tokens_per_second is not negative, weight is
 * above 0.  Fixed-size, no pointers: a delta_info copies by value. */
#define DELTA_METRICS_MAX 16
#define DELTA_METRIC_NAME_MAX 32
#define DELTA_METRIC_VALUE_MAX 32
enum {
    DELTA_M_LOSS = 1u << 0,
    DELTA_M_NUM_TOKENS = 1u << 1,
    DELTA_M_INNER_STEPS = 1u << 2,
    DELTA_M_TOKENS_PER_SECOND = 1u << 3,
    DELTA_M_WEIGHT = 1u << 4,
};
typedef struct delta_metrics {
    unsigned have;              /* DELTA_M_* bits: which known keys the delta carries */
    double loss, tokens_per_second, weight;
    uint64_t num_tokens, inner_steps;
    size_t nnamed;              /* metric.<name> keys, in ascending name bytes */
    char name[DELTA_METRICS_MAX][DELTA_METRIC_NAME_MAX + 1];
    double value[DELTA_METRICS_MAX];
} delta_metrics;

typedef struct delta_info {
    char node_id[DELTA_NODE_ID_MAX + 1];
    uint64_t base_outer_step;
    uint64_t local_step;
    /* the delta's L2 norm (delta_norm.h), when its values were read (intake, an upload): has_norm */
    double norm;
    int has_norm;
    delta_metrics metrics;
    cz_spec cz;                 /* its encoding (compress.h): CZ_NONE for a plain delta */
} delta_info;

/* [A-Za-z0-9_]{1,DELTA_METRIC_NAME_MAX}: the <name> of a metric.<name> key. */
int delta_valid_metric_name(const char *s, size_t len);
/* A metric value (the grammar above, at most DELTA_METRIC_VALUE_MAX characters, finite): 0 and *out,
 * or -1. */
int delta_parse_metric_value(const char *s, size_t len, double *out);
/* Adds name = v to m, in name order (the caller checked the name); -1 when m is full or holds the name. */
int delta_metrics_add(delta_metrics *m, const char *name, size_t len, double v);

/* [A-Za-z0-9._-]{1,64}, not "." or "..". */
int delta_valid_node_id(const char *s, size_t len);
/* Canonical decimal integer: digits only, no sign, no leading zero (except "0"), <= DELTA_INT_MAX. */
int delta_parse_int(const char *s, size_t len, uint64_t *out);
/* Exactly nodes/<node_id>/delta_<integer>.safetensors.  node_id receives the id (NUL-terminated). */
int delta_parse_path(const char *path, char node_id[DELTA_NODE_ID_MAX + 1], uint64_t *local_step,
                     dl_error *err);

/* What a delta path names: nodes/<id>/delta_<n>.safetensors (SINGLE), its .safetensors.index.json
 * (INDEX) or one of its shards delta_<n>-<i>-of-<N>.safetensors (SHARD: shard 0-based, nshards). */
typedef enum delta_path_kind { DELTA_PATH_SINGLE, DELTA_PATH_INDEX, DELTA_PATH_SHARD } delta_path_kind;
typedef struct delta_path {
    delta_path_kind kind;
    char node_id[DELTA_NODE_ID_MAX + 1];
    uint64_t local_step;
    uint32_t shard, nshards;
} delta_path;
/* Any of the three forms (delta_parse_path accepts the single file only). */
int delta_parse_any_path(const char *path, delta_path *out, dl_error *err);

/* The floating tensors of a header in name order (an array of pointers into h, to free()). */
int delta_floating_state(const st_header *h, const st_tensor ***out, size_t *n, dl_error *err);
/* The dtype a delta for a global tensor of dtype dt carries: C64 for C64, F32 for other floats. */
static inline st_dtype delta_dtype_for(st_dtype dt) { return dt == ST_C64 ? ST_C64 : ST_F32; }

/* Everything that can be checked from a delta's header alone: metadata (required keys, algorithm,
 * canonical integers, node id), agreement with path (when non-NULL), key set equal to the global's
 * floating keys, shapes, dtypes (F32/F16/BF16; C64 for C64 keys).  Fills info when non-NULL. */
int delta_check_header(const st_header *delta, const st_header *global, const char *path,
                       delta_info *info, dl_error *err);
/* The metadata rules (required keys, algorithm, canonical integers, node id) on a metadata list (a
 * file's header, or a set's index: st_set_metadata) and, when path is non-NULL, agreement with a
 * SINGLE or INDEX delta path.  Fills info when non-NULL. */
int delta_check_meta(const st_meta *meta, size_t nmeta, const char *path, delta_info *info, dl_error *err);
/* The tensors' rules: delta (nd tensors in name order) holds exactly the floating keys of global (ng
 * tensors in name order, all of the model's), with the same shapes and delta dtypes; with an encoding
 * (cz not NULL nor CZ_NONE), a key may hold codes instead, and then its scales tensor (compress.h) is
 * there too, each scales tensor belonging to a key with codes. */
int delta_check_tensors(const st_tensor *const *delta, size_t nd, const st_tensor *const *global, size_t ng,
                        const cz_spec *cz, dl_error *err);
/* A header's tensors in name order (malloc'd array to free()), for the two functions above. */
int delta_header_by_name(const st_header *h, const st_tensor ***out, dl_error *err);
/* One shard of a delta set, on its own (as it arrives, before the others and the index): every
 * tensor is a floating key of global with its shape and a delta dtype, or (compressed deltas,
 * compress.h) a key's codes with its scales in this same shard.  cz is the set's encoding when the
 * index was read first, or NULL when it is not known yet (an upload's shard): then codes of any
 * encoding and scales are taken provisionally, and delta_check_set_header decides. */
int delta_check_shard_header(const st_header *shard, const st_tensor *const *global, size_t nglobal,
                             const cz_spec *cz, dl_error *err);
/* A whole set (st_set_assemble/st_set_open already checked it is consistent): metadata from the
 * index against path, then the union of keys and shapes against the global's floating set.  Also
 * takes a one-file st_set (st_set_wrap), with the file's metadata. */
int delta_check_set_header(const st_set *delta, const st_tensor *const *global, size_t nglobal, const char *path,
                           delta_info *info, dl_error *err);
/* Whether dt is a plain delta dtype (F32, F16, BF16, C64), whose values are read as they are stored;
 * the other tensors of a valid delta are a compressed key's codes or scales. */
static inline int delta_plain_dtype(st_dtype dt) { return dt == ST_F32 || dt == ST_F16 || dt == ST_BF16 || dt == ST_C64; }
/* Whether t is a compressed key's scales in a delta of encoding cz (delta_check_tensors made every
 * tensor so named one): read with its codes, never as a plain tensor (int8_block's are F32). */
static inline int delta_is_scales(const cz_spec *cz, const st_tensor *t)
{
    return cz->enc != CZ_NONE && cz_is_scales_name(t->name, t->name_len);
}
/* The same for a tensor whose delta's encoding is not known yet (an uploaded shard before its index):
 * named as scales and not a key of the model (a model with such a key takes plain deltas only). */
int delta_may_be_scales(const st_header *global, const st_tensor *t);
/* The scales tensor of codes tensor t in h (compress.h), or NULL. */
const st_tensor *delta_scales_of(const st_header *h, const st_tensor *t);
/* Decodes n values of codes tensor t from value first (a multiple of the block) into out: codes and
 * scales are the bytes of that range (cz_decode); a value that does not decode to a finite F32 is
 * refused with the element named; the values are fed to norm's block nb when norm is not NULL. */
int delta_decode_checked(const cz_spec *cz, const st_tensor *t, const void *codes, const void *scales,
                         uint64_t first, float *out, size_t n, delta_norm *norm, delta_norm_block *nb, dl_error *err);
/* The checksum terms (checksum.h) of values [first, first + n) of a compressed key, the model's tensor
 * mt: its codes' blocks of CK_BLOCK_ELEMS values, and its scales' blocks (the scales of each
 * CK_BLOCK_ELEMS values, as tensor CK_SCALES_OF(mt)); first a multiple of CK_BLOCK_ELEMS, n too unless
 * the range ends the tensor.  codes and scales as read for the range (delta_scales_range). */
uint64_t delta_ck_compressed(const ck_key *key, uint32_t mt, const cz_spec *cz, uint64_t first, const void *codes,
                             const void *scales, uint64_t n);
/* The bytes of scales for values [first, first + n) of a tensor of nelem values: from byte
 * *off on, *len bytes (first a multiple of the block). */
void delta_scales_range(const cz_spec *cz, uint64_t first, uint64_t n, uint64_t *off, uint64_t *len);
/* Index of the first non-finite lane in n elements of dt (F32, F16, BF16, C64), or -1 if none. */
int64_t delta_find_non_finite(st_dtype dt, const void *data, size_t nelem);
/* A delta's values are finite and of magnitude below 2^64 (README, "Delta rules"): beyond it the pass's
 * squares overflow F32, and a handful of such deltas push the sums, the momentum and then the global
 * to Inf in later steps, from inputs that were each finite.  No trained model's pseudo-gradient comes
 * near it (BF16 models' weights are O(1)). */
#define DELTA_VALUE_BOUND 0x1p64
#define DELTA_VALUE_BOUND_F32_BITS 0x5f800000u
#define DELTA_BAD_VALUE_TEXT "a non-finite value (NaN or Inf) or one of magnitude 2^64 or more"
/* Index of the first element of n of dt that is not finite or reaches DELTA_VALUE_BOUND in magnitude,
 * or -1 if none: the value check of every delta taken in. */
int64_t delta_find_bad_value(st_dtype dt, const void *data, size_t nelem);
/* delta_check_header plus a full scan of the data for bad values (delta_find_bad_value). */
int delta_validate(const st_file *delta, const st_header *global, const char *path, delta_info *info,
                   dl_error *err);

/* delta_check_set_header plus a full scan of every file for bad values (delta_find_bad_value). */
int delta_validate_set(const st_set *delta, const st_tensor *const *global, size_t nglobal, const char *path,
                       delta_info *info, dl_error *err);

/* Writes the delta of two models (files or index paths: st_set_open) to out, with the reference's
 * metadata: the plain file, or past shard_size bytes (0: never) a set as huggingface_hub writes it
 * (st_set_writer_open), split in the baseline's save order. */
int delta_compute_set(const char *baseline, const char *current, const char *out, const char *node_id,
                      uint64_t base_outer_step, uint64_t local_step, uint64_t shard_size, dl_error *err);
/* The rules of a baseline and current pair: the same keys and shapes, floating where the other is. */
int delta_check_pair(const st_set *fb, const st_set *fc, dl_error *err);
/* n elements of t (in file `file` of s) from element e on, decoded to F32 lanes in out (raw: 8 bytes
 * per element of room). */
int delta_read_f32(const st_set *s, uint32_t file, const st_tensor *t, uint64_t e, size_t n, void *raw, float *out,
                   dl_error *err);
/* delta_compute_set encoded (compress.h) with error feedback: e = (baseline - current) + R, q =
 * encode(e), R = e - decode(q), R read from residual (zero when the file does not exist; NULL: none)
 * and written back there.  out is one file, or past shard_size bytes (0: never) a set whose shards keep
 * each key's codes and scales together.  A key the encoding cannot hold (C64; an odd count for mxfp4)
 * goes in plain F32 (its residual stays 0).  extra: more metadata (e.g. the worker metrics), checked by
 * delta_check_meta's rules before anything is written; a key of the delta's own is refused.  out and
 * residual are each written atomically, out first. */
int delta_compute_encoded(const char *baseline, const char *current, const char *out, const char *node_id,
                          uint64_t base_outer_step, uint64_t local_step, const cz_spec *cz, const char *residual,
                          const st_kv *extra, size_t nextra, uint64_t shard_size, dl_error *err);
/* delta_compute_set that never shards. */
int delta_compute(const char *baseline, const char *current, const char *out, const char *node_id,
                  uint64_t base_outer_step, uint64_t local_step, dl_error *err);
/* FP32 average of n deltas (files or sets) in the given order (first one's keys and shapes are the
 * reference; others must match exactly).  Output: F32 (C64 for C64 keys), no metadata; sharded past
 * shard_size (0: never) in the first one's save order.  Bit-identical whatever the layouts. */
int delta_average_set(const char *const *paths, size_t n, const char *out, uint64_t shard_size, dl_error *err);
int delta_average(const char *const *paths, size_t n, const char *out, dl_error *err);

/* The reference's metadata_json: every value JSON-decoded, or all values as strings when any value
 * is not valid JSON.  NULL on allocation failure. */
cJSON *delta_metadata_json(const st_header *h);

#endif
