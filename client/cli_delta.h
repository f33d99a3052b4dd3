/* A delta checked with no global at hand (diloco verify without --against, diloco push before it sends
 * a byte): its own keys are the expected key set.  A compressed delta's are each key, its codes standing
 * for an F32 weight, and not its scales, so that the check says what the server will of a delta whose
 * keys match the model. */
#ifndef CLI_DELTA_H
#define CLI_DELTA_H

#include "delta.h"
#include "st_index.h"

/* 0, or -DL_E_* with err set.  with_values: also scan every value (delta_validate_set), else the header,
 * the metadata and the encoding's rules only (delta_check_set_header). */
int cli_check_delta_alone(const st_set *delta, const char *path, int with_values, delta_info *info,
                          dl_error *err);

#endif
