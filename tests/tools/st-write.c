/* st-write SPEC.json OUT: writes a safetensors file through libdiloco's writer, so the integration
 * tests can compare its bytes with the reference's save_file for the same tensors.
 * SPEC: {"metadata": {str: str} | null, "tensors": [{"name", "dtype", "shape": [...], "data": path}]}
 * Exit 0 written, 1 refused by the writer, 2 bad spec, 3 I/O. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cJSON.h>

#include "safetensors.h"

static char *slurp(const char *path, size_t *len)
{
    FILE *f = fopen(path, "rb");
    char *buf = NULL;
    long size;

    if (f == NULL)
        return NULL;
    if (fseek(f, 0, SEEK_END) == 0 && (size = ftell(f)) >= 0 && fseek(f, 0, SEEK_SET) == 0) {
        buf = malloc((size_t)size + 1);
        if (buf != NULL && fread(buf, 1, (size_t)size, f) != (size_t)size) {
            free(buf);
            buf = NULL;
        }
        if (buf != NULL) {
            buf[size] = '\0';
            *len = (size_t)size;
        }
    }
    fclose(f);
    return buf;
}

int main(int argc, char **argv)
{
    cJSON *spec, *tensors, *meta, *t;
    st_spec *specs;
    const void **data;
    st_kv *kv = NULL;
    size_t n, nmeta = 0, len, i = 0;
    uint64_t **shapes;
    char *text;
    dl_error err;
    int rc = 0;

    if (argc != 3) {
        fprintf(stderr, "usage: st-write SPEC.json OUT\n");
        return 2;
    }
    if ((text = slurp(argv[1], &len)) == NULL || (spec = cJSON_Parse(text)) == NULL) {
        fprintf(stderr, "st-write: cannot read spec %s\n", argv[1]);
        return 2;
    }
    free(text);
    tensors = cJSON_GetObjectItemCaseSensitive(spec, "tensors");
    meta = cJSON_GetObjectItemCaseSensitive(spec, "metadata");
    n = (size_t)cJSON_GetArraySize(tensors);
    specs = calloc(n + 1, sizeof(*specs));
    data = calloc(n + 1, sizeof(*data));
    shapes = calloc(n + 1, sizeof(*shapes));
    if (cJSON_IsObject(meta)) {
        cJSON *m;
        kv = calloc((size_t)cJSON_GetArraySize(meta) + 1, sizeof(*kv));
        cJSON_ArrayForEach(m, meta) {
            kv[nmeta].key = m->string;
            kv[nmeta++].value = cJSON_GetStringValue(m);
        }
    }
    cJSON_ArrayForEach(t, tensors) {
        const char *name = cJSON_GetStringValue(cJSON_GetObjectItemCaseSensitive(t, "name"));
        const char *dtype = cJSON_GetStringValue(cJSON_GetObjectItemCaseSensitive(t, "dtype"));
        const char *path = cJSON_GetStringValue(cJSON_GetObjectItemCaseSensitive(t, "data"));
        cJSON *shape = cJSON_GetObjectItemCaseSensitive(t, "shape"), *d;
        size_t dlen = 0, nd = 0;
        if (name == NULL || dtype == NULL || path == NULL ||
            st_dtype_parse(dtype, strlen(dtype), &specs[i].dtype) != 0) {
            fprintf(stderr, "st-write: bad tensor entry %zu\n", i);
            return 2;
        }
        shapes[i] = calloc((size_t)cJSON_GetArraySize(shape) + 1, sizeof(uint64_t));
        cJSON_ArrayForEach(d, shape)
            shapes[i][nd++] = (uint64_t)d->valuedouble;
        specs[i] = (st_spec){name, strlen(name), specs[i].dtype, nd, shapes[i]};
        if ((data[i] = slurp(path, &dlen)) == NULL) {
            fprintf(stderr, "st-write: cannot read %s\n", path);
            return 3;
        }
        i++;
    }
    dl_error_clear(&err);
    if (st_save(argv[2], specs, data, n, cJSON_IsObject(meta) ? kv : NULL, nmeta, &err) != 0) {
        fprintf(stderr, "st-write: %s: %s\n", dl_error_name(err.code), err.message);
        rc = err.code == DL_E_IO ? 3 : 1;
    }
    for (i = 0; i < n; i++) {
        free((void *)data[i]);
        free(shapes[i]);
    }
    free(data);
    free(shapes);
    free(specs);
    free(kv);
    cJSON_Delete(spec);
    return rc;
}
