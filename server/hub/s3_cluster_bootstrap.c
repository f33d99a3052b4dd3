/* s3_cluster_bootstrap.c: an empty bucket and --init-model (README, "Scaling out"): step 0 is the
 * reference's bootstrap, its model files and then step_count.json ("bootstrap": "true"), each written once
 * (If-None-Match), so that K aggregators starting together publish one step 0.  A single file goes as
 * global/latest.safetensors; a set (an index) as the single aggregator publishes a sharded global, its
 * shards' bytes as they are under global/latest-0000i-of-0000N.safetensors and the index written anew for
 * those names.  An aggregator that finds a file written already checks that it holds these bytes (a single
 * PUT's ETag is its MD5): another --init-model is an operator's error, said once, and the bucket's is what
 * everyone adopts.  A crash between the writes is mended by the next try (the files are ours, the rest is
 * written). */
#include "s3_cluster_internal.h"

#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "dl_log.h"
#include "fsutil.h"
#include "st_index.h"
#include "stepcount.h"

/* The index of a set republished under the name a global's set has (latest-0000i-of-0000N.safetensors and
 * latest.safetensors.index.json): the set's tensors in its save order, each in its shard, and its path in
 * the scratch directory.  Every aggregator given the same set writes the same bytes.  0, or -1 (why). */
static int bootstrap_index(cluster *c, const st_set *set, char **path, char *why, size_t why_size)
{
    size_t n = set->ntensors, len = 0;
    st_spec *specs = calloc(n ? n : 1, sizeof(*specs));
    uint32_t *shard_of = calloc(n ? n : 1, sizeof(*shard_of));
    char *text = NULL;
    dl_error err;
    int rc = -1;

    *path = NULL;
    if (specs == NULL || shard_of == NULL) {
        snprintf(why, why_size, "out of memory");
        goto out;
    }
    for (size_t t = 0; t < n; t++) {
        const st_tensor *x = set->order[t];
        specs[t] = (st_spec){x->name, x->name_len, x->dtype, x->ndim, x->shape};
        shard_of[t] = set->order_file[t];
    }
    if ((text = st_index_build_json("latest", specs, n, shard_of, set->index->nshards, NULL, 0, &len)) == NULL ||
        (*path = cl_rel_printf("%s/bootstrap.safetensors.index.json", c->scratch)) == NULL) {
        snprintf(why, why_size, "out of memory");
        goto out;
    }
    if (fsu_write_atomic(*path, text, len, &err) != 0) {
        snprintf(why, why_size, "%.300s", err.message);
        goto out;
    }
    rc = 0;
out:
    if (rc != 0) {
        free(*path);
        *path = NULL;
    }
    free(specs);
    free(shard_of);
    free(text);
    return rc;
}

/* Step 0's files from --init-model, each written once (cl_put_once): the file as global/latest.safetensors,
 * or a set's shards as global/latest-0000i-of-0000N.safetensors (their bytes as they are) and its index
 * written anew for those names, as one dilocod publishes a sharded global.  0, -1 (why; tried again), -2
 * the bucket holds other bytes (why). */
static int bootstrap_files(cluster *c, const st_set *set, uint64_t *bytes, char *why, size_t why_size)
{
    char md5[33], rel[ST_INDEX_BASE_MAX + 64], name[ST_INDEX_BASE_MAX + 48];
    uint64_t size = 0;
    int put;

    *bytes = 0;
    if (set->index == NULL) {
        put = cl_put_once(c, "global/latest.safetensors", c->cfg.init_model, md5, &size, why, why_size);
        *bytes = size;
        return put;
    }
    for (uint32_t i = 0; i < set->index->nshards; i++) {
        if (st_index_shard_name("latest", i, set->index->nshards, name, sizeof(name)) != 0) {
            snprintf(why, why_size, "a shard name too long");
            return -1;
        }
        snprintf(rel, sizeof(rel), "global/%s", name);
        if ((put = cl_put_once(c, rel, set->files[i]->path, md5, &size, why, why_size)) != 0)
            return put;
        *bytes += size;
    }
    char *index = NULL;
    if (bootstrap_index(c, set, &index, why, why_size) != 0)
        return -1;
    put = cl_put_once(c, STEPCOUNT_MODEL_INDEX, index, md5, &size, why, why_size);
    unlink(index);
    free(index);
    return put;
}

int cl_bootstrap(cluster *c, char *why, size_t why_size)
{
    st_set *set = NULL;
    dl_error err;
    uint64_t bytes = 0;
    s3s_resp r;

    /* the file or set is read as dilocod reads a global: strict headers, data exactly as long as they say,
     * a set's shards checked against its index */
    if (st_set_open(c->cfg.init_model, &set, &err) != 0) {
        snprintf(why, why_size, "--init-model %.300s: %.300s", c->cfg.init_model, err.message);
        return -1;
    }
    int put = bootstrap_files(c, set, &bytes, why, why_size);
    int sharded = set->index != NULL;
    st_set_close(set);
    if (put == -2) {
        char inner[600];
        snprintf(inner, sizeof(inner), "%.500s", why);
        snprintf(why, why_size, "the bucket's step 0 is not --init-model %.200s (%.300s): every aggregator of a "
                 "cluster must be given the same file", c->cfg.init_model, inner);
        return -2;
    }
    if (put != 0)
        return -1;
    char *text = stepcount_build(0, c->cfg.optimizer, 1, sharded, NULL);
    if (text == NULL) {
        snprintf(why, why_size, "out of memory");
        return -1;
    }
    memset(&r, 0, sizeof(r));
    long st = cl_put_small(c, "global/step_count.json", text, strlen(text), NULL, 1, &r, why, why_size);
    free(text);
    s3s_resp_free(&r);
    if (st == 200)
        dl_log(DL_LOG_INFO, "cluster", "bootstrapped: step 0 published from --init-model", "init_model=%s bytes=%" PRIu64
               " sharded=%d", c->cfg.init_model, bytes, sharded);
    else if (st == 412)
        dl_log(DL_LOG_INFO, "cluster", "step 0 published by another aggregator meanwhile", "init_model=%s",
               c->cfg.init_model);
    else {
        if (st != 0)
            snprintf(why, why_size, "global/step_count.json: HTTP %ld", st);
        return -1;
    }
    return 0;
}
