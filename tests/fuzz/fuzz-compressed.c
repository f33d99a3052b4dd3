/* libFuzzer target: bytes -> a delta file -> the compressed-delta validator (README, "Compressed
 * deltas") against a fixed model, then the property it promises: every key of a delta it takes decodes
 * to finite values, with one scale per block.  The model has an F32 key with a short last block, a BF16
 * key of an odd count (mxfp4 cannot hold it), a C64 key (always plain) and an integer buffer. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "compress.h"
#include "delta.h"
#include "safetensors.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static st_header *model;

static void model_init(void)
{
    static const char json[] = "{\"a\":{\"dtype\":\"F32\",\"shape\":[3,50],\"data_offsets\":[0,600]},"
                               "\"b\":{\"dtype\":\"BF16\",\"shape\":[33],\"data_offsets\":[600,666]},"
                               "\"c\":{\"dtype\":\"C64\",\"shape\":[2],\"data_offsets\":[666,682]},"
                               "\"n\":{\"dtype\":\"I64\",\"shape\":[1],\"data_offsets\":[682,690]}}";
    static char file[8 + sizeof(json) + 690];
    dl_error err;
    size_t need = 0, n = sizeof(json) - 1;

    for (int i = 0; i < 8; i++)
        file[i] = (char)((n >> (8 * i)) & 0xff);
    memcpy(file + 8, json, n);
    if (st_header_parse_prefix(file, 8 + n + 690, 8 + n + 690, &need, &model, &err) != 0)
        abort();
}

/* Every compressed key of a validated delta decodes to finite values. */
static void check_decodes(const st_file *f, const cz_spec *cz)
{
    for (size_t i = 0; i < f->h->ntensors; i++) {
        const st_tensor *t = &f->h->tensors[i], *sc;
        if (delta_is_scales(cz, t) || delta_plain_dtype(t->dtype))
            continue;
        if ((sc = delta_scales_of(f->h, t)) == NULL || sc->shape[0] != cz_nscales(t->nelem, cz->block))
            abort();
        unsigned char *codes = malloc(st_tensor_bytes(t) + 1), *scales = malloc(st_tensor_bytes(sc) + 1);
        float *out = malloc(t->nelem * sizeof(float) + 1);
        dl_error err;
        if (codes == NULL || scales == NULL || out == NULL || st_read(f, t, 0, codes, st_tensor_bytes(t), &err) != 0 ||
            st_read(f, sc, 0, scales, st_tensor_bytes(sc), &err) != 0)
            abort();
        if (cz_decode(cz, codes, scales, 0, out, t->nelem) >= 0)
            abort();                        /* validated, yet a value is not finite */
        free(codes);
        free(scales);
        free(out);
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    char path[] = "/tmp/fuzz-compressed-XXXXXX";
    st_file *f = NULL;
    delta_info info;
    dl_error err;

    if (model == NULL)
        model_init();
    int fd = mkstemp(path);
    if (fd < 0)
        return 0;
    int ok = write(fd, data, size) == (ssize_t)size;
    close(fd);
    if (ok && st_open(path, &f, &err) == 0) {
        if (delta_validate(f, model, "nodes/w1/delta_1.safetensors", &info, &err) == 0 && info.cz.enc != CZ_NONE)
            check_decodes(f, &info.cz);
        st_close(f);
    }
    unlink(path);
    return 0;
}
