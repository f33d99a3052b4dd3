/* st_set_writer: writing a set exactly as huggingface_hub would (st_index.h): the plain single file when
 * one shard is enough, else the shards and the index, and the other layout's files removed once durable. */
#include "st_index.h"
#include "st_index_internal.h"
#include "fsutil.h"

#include <dirent.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* ---- writing --------------------------------------------------------------------------------- */

struct st_set_writer {
    char *path;             /* the single file, or the index */
    char *dir;              /* directory of the output ("." when none) */
    char base[ST_INDEX_BASE_MAX + 1];
    int has_base;           /* path follows the convention: earlier layouts can be cleaned up */
    uint32_t nshards;
    st_writer **shards;     /* nshards writers (one: the plain file) */
    uint32_t *shard_of;     /* spec -> shard */
    size_t *local;          /* spec -> index within its shard's specs */
    char *index_json;
    size_t index_len;
};

static void writer_free(st_set_writer *w)
{
    if (w == NULL)
        return;
    free(w->shards);
    free(w->shard_of);
    free(w->local);
    free(w->index_json);
    free(w->path);
    free(w->dir);
    free(w);
}

void st_set_writer_abort(st_set_writer *w)
{
    if (w == NULL)
        return;
    for (uint32_t s = 0; s < w->nshards; s++)
        st_writer_abort(w->shards[s]);
    writer_free(w);
}

/* Splits path into directory and base (<base>.safetensors or <base>.safetensors.index.json). */
static int writer_names(st_set_writer *w, const char *path)
{
    const char *name = file_name_of(path);
    size_t nlen = strlen(name), stem;
    uint32_t i, n;
    char base[ST_INDEX_BASE_MAX + 1];

    if ((w->dir = name == path ? strdup(".") : strndup(path, (size_t)(name - path))) == NULL)
        return -1;
    st_name_kind k = st_index_classify(name, nlen, base, &i, &n);
    if (k == ST_NAME_SINGLE || k == ST_NAME_INDEX) {
        memcpy(w->base, base, sizeof(base));
        w->has_base = 1;
    }
    (void)stem;
    return 0;
}

int st_set_writer_open(const char *path, const st_spec *specs, size_t n, const st_kv *meta, size_t nmeta,
                       uint64_t max_shard_size, st_set_writer **out, dl_error *err)
{
    return st_set_writer_open_glued(path, specs, n, NULL, meta, nmeta, max_shard_size, out, err);
}

int st_set_writer_open_glued(const char *path, const st_spec *specs, size_t n, const unsigned char *glue,
                             const st_kv *meta, size_t nmeta, uint64_t max_shard_size, st_set_writer **out,
                             dl_error *err)
{
    st_set_writer *w = calloc(1, sizeof(*w));
    st_spec *part = NULL;
    int rc;

    *out = NULL;
    if (w == NULL || writer_names(w, path) != 0 || (w->shard_of = malloc((n ? n : 1) * sizeof(*w->shard_of))) == NULL ||
        (w->local = malloc((n ? n : 1) * sizeof(*w->local))) == NULL) {
        rc = dl_fail(err, DL_E_NO_MEMORY, NULL, 0, "out of memory");
        goto fail;
    }
    for (size_t m = 0; m < nmeta; m++) {
        if (dl_utf8_check(meta[m].key, strlen(meta[m].key), NULL) != 0 ||
            dl_utf8_check(meta[m].value, strlen(meta[m].value), NULL) != 0) {
            rc = dl_fail(err, DL_E_INVALID_ARGUMENT, NULL, 0, "metadata is not UTF-8");
            goto fail;
        }
    }
    if ((rc = st_index_plan_glued(specs, n, glue, max_shard_size, w->shard_of, &w->nshards, err)) != 0)
        goto fail;
    if (w->nshards > 1 && !w->has_base) {
        rc = dl_fail(err, DL_E_INVALID_ARGUMENT, NULL, 0,
                     "%s: a sharded output is named <base>.safetensors (base of [A-Za-z0-9._-])", path);
        goto fail;
    }
    if ((w->shards = calloc(w->nshards, sizeof(*w->shards))) == NULL) {
        rc = dl_fail(err, DL_E_NO_MEMORY, NULL, 0, "out of memory");
        goto fail;
    }
    if (w->nshards == 1) {
        memset(w->shard_of, 0, (n ? n : 1) * sizeof(*w->shard_of));
        for (size_t i = 0; i < n; i++)
            w->local[i] = i;
        /* the plain file: exactly what st_writer_open writes today */
        if ((w->path = strdup(path)) == NULL) {
            rc = dl_fail(err, DL_E_NO_MEMORY, NULL, 0, "out of memory");
            goto fail;
        }
        if ((rc = st_writer_open(path, specs, n, meta, nmeta, &w->shards[0], err)) != 0)
            goto fail;
        *out = w;
        return 0;
    }
    if (asprintf(&w->path, "%s/%s" ST_INDEX_SUFFIX, w->dir, w->base) < 0) {
        w->path = NULL;
        rc = dl_fail(err, DL_E_NO_MEMORY, NULL, 0, "out of memory");
        goto fail;
    }
    if ((w->index_json = st_index_build_json(w->base, specs, n, w->shard_of, w->nshards, meta, nmeta,
                                             &w->index_len)) == NULL ||
        (part = malloc(n * sizeof(*part))) == NULL) {
        rc = dl_fail(err, DL_E_NO_MEMORY, NULL, 0, "out of memory");
        goto fail;
    }
    static const st_kv format_pt[] = {{"format", "pt"}};
    for (uint32_t s = 0; s < w->nshards; s++) {
        char name[ST_INDEX_BASE_MAX + 40], *p = NULL;
        size_t k = 0;
        for (size_t i = 0; i < n; i++) {
            if (w->shard_of[i] == s) {
                w->local[i] = k;
                part[k++] = specs[i];
            }
        }
        st_index_shard_name(w->base, s, w->nshards, name, sizeof(name));
        if (asprintf(&p, "%s/%s", w->dir, name) < 0) {
            rc = dl_fail(err, DL_E_NO_MEMORY, NULL, 0, "out of memory");
            goto fail;
        }
        rc = st_writer_open(p, part, k, format_pt, 1, &w->shards[s], err);
        free(p);
        if (rc != 0)
            goto fail;
    }
    free(part);
    *out = w;
    return 0;
fail:
    free(part);
    st_set_writer_abort(w);
    return rc;
}

int st_set_writer_write(st_set_writer *w, size_t spec_index, uint64_t off, const void *buf, size_t len,
                        dl_error *err)
{
    return st_writer_write(w->shards[w->shard_of[spec_index]], w->local[spec_index], off, buf, len, err);
}

uint32_t st_set_writer_nshards(const st_set_writer *w)
{
    return w->nshards;
}

/* Removes what another layout of the same base left in the directory (huggingface_hub removes
 * them before saving; here after the new files are durable, so a crash never leaves neither). */
static int remove_other_layouts(const st_set_writer *w, dl_error *err)
{
    DIR *d;
    struct dirent *de;
    int rc = 0;

    if (!w->has_base)
        return 0;
    if ((d = opendir(w->dir)) == NULL)
        return dl_fail_errno(err, errno, "cannot list %s", w->dir);
    while ((de = readdir(d)) != NULL) {
        char base[ST_INDEX_BASE_MAX + 1];
        uint32_t i, n;
        st_name_kind k = st_index_classify(de->d_name, strlen(de->d_name), base, &i, &n);
        if (k == ST_NAME_OTHER || strcmp(base, w->base) != 0)
            continue;
        int stale = w->nshards == 1 ? (k == ST_NAME_INDEX || k == ST_NAME_SHARD)
                                    : (k == ST_NAME_SINGLE || (k == ST_NAME_SHARD && n != w->nshards));
        if (stale && unlinkat(dirfd(d), de->d_name, 0) != 0 && errno != ENOENT) {
            rc = dl_fail_errno(err, errno, "cannot remove %s/%s", w->dir, de->d_name);
            break;
        }
    }
    closedir(d);
    return rc;
}

int st_set_writer_commit(st_set_writer *w, dl_error *err)
{
    int rc = 0;

    for (uint32_t s = 0; s < w->nshards; s++) {
        st_writer *x = w->shards[s];
        w->shards[s] = NULL;
        if (rc == 0)
            rc = st_writer_commit(x, err);
        else
            st_writer_abort(x);
    }
    if (rc == 0 && w->nshards > 1)
        rc = fsu_write_atomic(w->path, w->index_json, w->index_len, err);
    if (rc == 0)
        rc = remove_other_layouts(w, err);
    writer_free(w);
    return rc;
}
