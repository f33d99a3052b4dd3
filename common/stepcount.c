#include "stepcount.h"

#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cJSON.h>

#include "delta.h"
#include "strbuf.h"

#define ST_INDEX_SUFFIX_TEXT ".safetensors.index.json"

char *stepcount_build(uint64_t outer_step, const char *optimizer, int bootstrap, int sharded, const char *updated_at)
{
    return stepcount_build_file(outer_step, optimizer, bootstrap, sharded ? STEPCOUNT_MODEL_INDEX : STEPCOUNT_MODEL_SINGLE,
                                updated_at);
}

char *stepcount_build_file(uint64_t outer_step, const char *optimizer, int bootstrap, const char *model_file,
                           const char *updated_at)
{
    return stepcount_build_extra(outer_step, optimizer, bootstrap, model_file, updated_at, NULL, 0);
}

char *stepcount_build_extra(uint64_t outer_step, const char *optimizer, int bootstrap, const char *model_file,
                            const char *updated_at, const char *const *kv, size_t n)
{
    sbuf b = {0};
    char when[40];

    if (updated_at == NULL) {
        time_t t = time(NULL);
        struct tm tm;
        gmtime_r(&t, &tm);
        strftime(when, sizeof(when), "%Y-%m-%dT%H:%M:%S+00:00", &tm);
        updated_at = when;
    }
    sb_str(&b, "{\n  \"algorithm\": \"" DELTA_ALGORITHM "\",\n  \"model_file\": \"");
    sb_str(&b, model_file);
    sb_str(&b, "\",\n  \"optimizer\": ");
    sb_json_string(&b, optimizer, strlen(optimizer));
    sb_str(&b, ",\n  \"outer_step\": ");
    sb_u64(&b, outer_step);
    sb_str(&b, ",\n  \"updated_at\": ");
    sb_json_string(&b, updated_at, strlen(updated_at));
    if (bootstrap)
        sb_str(&b, ",\n  \"bootstrap\": \"true\"");
    for (size_t i = 0; i < n; i++) {
        sb_str(&b, ",\n  ");
        sb_json_string(&b, kv[2 * i], strlen(kv[2 * i]));
        sb_str(&b, ": ");
        sb_json_string(&b, kv[2 * i + 1], strlen(kv[2 * i + 1]));
    }
    sb_str(&b, "\n}\n");
    return sb_take(&b);
}

int stepcount_parse(const char *text, size_t len, uint64_t *outer_step, int *bootstrap, int *sharded, dl_error *err)
{
    int kind = 0;
    int rc = stepcount_parse_file(text, len, outer_step, bootstrap, &kind, NULL, 0, err);
    if (rc == 0 && kind == 2)
        return dl_fail(err, DL_E_METADATA_INVALID, NULL, 0, "step_count.json names a cluster's per-step index "
                       "(global/steps/<step>/...): only an aggregator with --cluster-shards reads it");
    if (sharded != NULL)
        *sharded = kind;
    return rc;
}

/* global/steps/<outer_step>/model[.g<n>].safetensors.index.json, exactly (a cluster's publish; n: the
 * generation of its manifest, after a delta was refused for its values) */
static int is_step_index(const char *m, uint64_t step)
{
    char want[96];
    snprintf(want, sizeof(want), "global/steps/%" PRIu64 "/model", step);
    size_t wl = strlen(want);
    if (strncmp(m, want, wl) != 0)
        return 0;
    m += wl;
    if (m[0] == '.' && m[1] == 'g' && m[2] >= '1' && m[2] <= '9') {
        size_t d = 2;
        while (d < 12 && m[d] >= '0' && m[d] <= '9')
            d++;
        m += d;
    }
    return strcmp(m, ST_INDEX_SUFFIX_TEXT) == 0;
}

int stepcount_parse_file(const char *text, size_t len, uint64_t *outer_step, int *bootstrap, int *sharded,
                         char *model_file, size_t model_file_size, dl_error *err)
{
    cJSON *root = cJSON_ParseWithLength(text, len), *step, *boot, *model;
    int rc = 0;

    if (!cJSON_IsObject(root)) {
        rc = dl_fail(err, DL_E_METADATA_INVALID, NULL, 0, "step_count.json is not a JSON object");
        goto out;
    }
    step = cJSON_GetObjectItemCaseSensitive(root, "outer_step");
    /* cJSON keeps numbers as doubles: integers up to 2^53 are exact, which DELTA_INT_MAX respects */
    if (!cJSON_IsNumber(step) || !(step->valuedouble >= 0) || step->valuedouble > (double)DELTA_INT_MAX ||
        floor(step->valuedouble) != step->valuedouble) {
        rc = dl_fail(err, DL_E_METADATA_INVALID, NULL, 0, "step_count.json: outer_step is not a non-negative integer");
        goto out;
    }
    *outer_step = (uint64_t)step->valuedouble;
    boot = cJSON_GetObjectItemCaseSensitive(root, "bootstrap");
    if (bootstrap != NULL)
        *bootstrap = (cJSON_IsString(boot) && strcmp(boot->valuestring, "true") == 0) || cJSON_IsTrue(boot);
    model = cJSON_GetObjectItemCaseSensitive(root, "model_file");
    if (sharded != NULL)
        *sharded = cJSON_IsString(model) && strcmp(model->valuestring, STEPCOUNT_MODEL_INDEX) == 0;
    if (cJSON_IsString(model) && is_step_index(model->valuestring, *outer_step)) {
        if (sharded != NULL)
            *sharded = 2;
    } else if (model != NULL && (!cJSON_IsString(model) || (strcmp(model->valuestring, STEPCOUNT_MODEL_INDEX) != 0 &&
                                                            strcmp(model->valuestring, STEPCOUNT_MODEL_SINGLE) != 0))) {
        /* a model file we would not read is not taken for the plain one */
        rc = dl_fail(err, DL_E_METADATA_INVALID, NULL, 0, "step_count.json: model_file is none of %s, %s or "
                     "global/steps/%" PRIu64 "/model[.g<n>].safetensors.index.json", STEPCOUNT_MODEL_SINGLE,
                     STEPCOUNT_MODEL_INDEX, *outer_step);
        goto out;
    }
    if (model_file != NULL)
        snprintf(model_file, model_file_size, "%s", cJSON_IsString(model) ? model->valuestring : STEPCOUNT_MODEL_SINGLE);
out:
    cJSON_Delete(root);
    return rc;
}

int stepcount_check(uint64_t step, const char *what, dl_error *err)
{
    if (stepcount_step_ok(step))
        return 0;
    return dl_fail(err, DL_E_METADATA_INVALID, NULL, 0, "%s %" PRIu64 " is past the largest step a state may hold "
                   "(%llu): its successor cannot be a delta's base_outer_step", what, step,
                   (unsigned long long)STEPCOUNT_STEP_MAX);
}
