/* cli_delta: see cli_delta.h. */
#include "cli_delta.h"

#include <stdlib.h>

#include "compress.h"

int cli_check_delta_alone(const st_set *delta, const char *path, int with_values, delta_info *info,
                          dl_error *err)
{
    const st_meta *meta;
    size_t nmeta, n = 0;
    cz_spec cz;
    int rc;

    st_set_metadata(delta, &meta, &nmeta);
    if (cz_spec_from_meta(meta, nmeta, &cz, NULL) != 0 || cz.enc == CZ_NONE)
        return with_values ? delta_validate_set(delta, delta->by_name, delta->ntensors, path, info, err)
                           : delta_check_set_header(delta, delta->by_name, delta->ntensors, path, info, err);
    st_tensor *model = calloc(delta->ntensors + 1, sizeof(*model));
    const st_tensor **by_name = calloc(delta->ntensors + 1, sizeof(*by_name));
    if (model == NULL || by_name == NULL) {
        free(model);
        free(by_name);
        return dl_fail(err, DL_E_NO_MEMORY, NULL, 0, "out of memory");
    }
    for (size_t i = 0; i < delta->ntensors; i++) {
        const st_tensor *t = delta->by_name[i];
        if (cz_is_scales_name(t->name, t->name_len))
            continue;
        model[n] = *t;
        if (t->dtype == cz_code_dtype(cz.enc))
            model[n].dtype = ST_F32;
        by_name[n] = &model[n];
        n++;
    }
    rc = with_values ? delta_validate_set(delta, by_name, n, path, info, err)
                     : delta_check_set_header(delta, by_name, n, path, info, err);
    free(by_name);
    free(model);
    return rc;
}
