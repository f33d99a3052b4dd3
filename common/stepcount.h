/* stepcount: global/step_count.json, the version file published next to global/latest.safetensors.
 *   {"algorithm": "dumb_diloco", "model_file": "global/latest.safetensors", "optimizer": "...",
 *    "outer_step": 12, "updated_at": "2026-01-01T12:00:00+00:00"[, "bootstrap": "true"]}
 * written as the Python reference does (json.dumps(..., indent=2), keys in this order, extra values
 * as strings after them). */
#ifndef STEPCOUNT_H
#define STEPCOUNT_H

#include <stddef.h>
#include <inttypes.h>
#include <stdint.h>

#include "dl_error.h"

/* model_file: the plain file, or the index of a sharded global (global/latest-0000i-of-0000N.safetensors
 * + this index, the Hugging Face convention, when the model is above --shard-size). */
#define STEPCOUNT_MODEL_SINGLE "global/latest.safetensors"
#define STEPCOUNT_MODEL_INDEX "global/latest.safetensors.index.json"

/* The largest step a state may hold: its successor, the step its round's deltas name as base_outer_step
 * (and the step the round commits), must still be an integer every JSON reader keeps exact, at most
 * DELTA_INT_MAX (2^53 - 1, common/delta.h) as delta_parse_int and the wire format require.  A larger
 * step would take every delta to a 422 and the restart to "outer_metadata.json is damaged": it is
 * neither adopted nor committed. */
#define STEPCOUNT_STEP_MAX 9007199254740990ULL    /* DELTA_INT_MAX - 1 */
/* Whether a state may hold step (see STEPCOUNT_STEP_MAX). */
static inline int stepcount_step_ok(uint64_t step) { return step <= STEPCOUNT_STEP_MAX; }
/* 0 when a state may hold step, else -DL_E_METADATA_INVALID with the one message that says why (what:
 * "step", "the published step" ...). */
int stepcount_check(uint64_t step, const char *what, dl_error *err);

/* malloc'd text; sharded names STEPCOUNT_MODEL_INDEX as model_file; updated_at NULL means now (UTC,
 * seconds). */
char *stepcount_build(uint64_t outer_step, const char *optimizer, int bootstrap, int sharded, const char *updated_at);
/* The same naming model_file (a path of the bucket, JSON-safe: no quote or backslash). */
char *stepcount_build_file(uint64_t outer_step, const char *optimizer, int bootstrap, const char *model_file,
                           const char *updated_at);
/* The same with n extra string keys after the others (kv: key, value, key, value ...; the wire format's
 * rule for extra keys: string values), as the downlink names its files (view_file, update_file, view_hash). */
char *stepcount_build_extra(uint64_t outer_step, const char *optimizer, int bootstrap, const char *model_file,
                            const char *updated_at, const char *const *kv, size_t n);
/* A cluster's publish (README, "Scaling out") names the step's own index,
 * global/steps/<outer_step>/model[.g<n>].safetensors.index.json, so that a reader never mixes shards of two
 * steps (n: its manifest's generation, after a delta was refused for its values). */
/* Strict parse of a published file: outer_step must be a non-negative integer <= 2^53-1.  *sharded
 * (when non-NULL) is 1 when model_file names STEPCOUNT_MODEL_INDEX, 0 otherwise (absent or the plain
 * file: the reference's files). */
int stepcount_parse(const char *text, size_t len, uint64_t *outer_step, int *bootstrap, int *sharded, dl_error *err);
/* The same, *sharded 2 for a cluster's per-step index (see above), and
 * model_file (when non-NULL) receiving the model file named (the plain one when absent).  A model_file
 * that is none of the three is refused. */
int stepcount_parse_file(const char *text, size_t len, uint64_t *outer_step, int *bootstrap, int *sharded,
                         char *model_file, size_t model_file_size, dl_error *err);

#endif
