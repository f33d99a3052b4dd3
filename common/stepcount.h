/* stepcount: global/step_count.json, the version file published next to global/latest.safetensors.
 *   {"algorithm": "dumb_diloco", "model_file": "global/latest.safetensors", "optimizer": "...",
 *    "outer_step": 12, "updated_at": "2026-01-01T12:00:00+00:00"[, "bootstrap": "true"]}
 * written as the Python reference does (json.dumps(..., indent=2), keys in this order, extra values
 * as strings after them). */
#ifndef STEPCOUNT_H
#define STEPCOUNT_H

#include <stddef.h>
#include <stdint.h>

#include "dl_error.h"

/* malloc'd text; updated_at NULL means now (UTC, seconds). */
char *stepcount_build(uint64_t outer_step, const char *optimizer, int bootstrap, const char *updated_at);
/* Strict parse of a published file: outer_step must be a non-negative integer <= 2^53-1. */
int stepcount_parse(const char *text, size_t len, uint64_t *outer_step, int *bootstrap, dl_error *err);

#endif
