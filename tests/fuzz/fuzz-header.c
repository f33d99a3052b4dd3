/* libFuzzer target: bytes -> the safetensors prefix/header parser -> lookups on the result.
 * The input is treated as a whole file: its length is the file length the header must cover. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "delta.h"
#include "safetensors.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    st_header *h = NULL;
    dl_error err;
    size_t need = 0;

    if (st_header_parse_prefix((const char *)data, size, size, &need, &h, &err) != 0 || h == NULL)
        return 0;
    for (size_t i = 0; i < h->ntensors; i++) {
        const st_tensor *t = &h->tensors[i];
        if (st_header_find(h, t->name, t->name_len) == NULL)
            abort();                        /* every parsed name must be found again */
        if (t->end > size)
            abort();                        /* validation guarantees data lies inside the file */
    }
    /* the delta rules must cope with any valid header, checked against itself */
    delta_info info;
    (void)delta_check_header(h, h, "nodes/x/delta_1.safetensors", &info, &err);
    cJSON_Delete(delta_metadata_json(h));
    st_header_free(h);
    return 0;
}
