#include "test.h"

#include <math.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include "delta.h"
#include "fsutil.h"
#include "intake.h"
#include "st_index.h"

/* The global: F32 "a" (4), "b" (3), "c" (5) and an I64 "i" (2, not part of a delta).  A delta of
 * node w1, local step 7, based on step 3, holds a, b, c. */
static const uint64_t SA[] = {4}, SB[] = {3}, SC[] = {5};
static const float DA[4] = {0.5f, -1.0f, 2.0f, 0.25f}, DB[3] = {1.0f, 2.0f, 3.0f},
                   DC[5] = {-0.5f, 0.0f, 0.125f, 4.0f, -2.0f};

static const st_spec DELTA_SPECS[] = {{"a", 1, ST_F32, 1, SA}, {"b", 1, ST_F32, 1, SB}, {"c", 1, ST_F32, 1, SC}};
static const void *const DELTA_DATA[] = {DA, DB, DC};

static const st_kv META[] = {{"algorithm", "dumb_diloco"}, {"base_outer_step", "3"}, {"local_step", "7"},
                             {"node_id", "w1"}};

static void mkdir_p(const char *dir)
{
    dl_error err;
    if (fsu_mkdirs(dir, &err) != 0)
        fprintf(stderr, "  mkdir %s: %s\n", dir, err.message);
}

static int exists(const char *path)
{
    return access(path, F_OK) == 0;
}

/* Writes the delta at dir/delta_7.safetensors[.index.json] as huggingface_hub would, split at
 * shard_size (0: the plain file), with meta (NULL: META). */
static int write_delta(const char *dir, uint64_t shard_size, const st_kv *meta, size_t nmeta)
{
    char path[512];
    st_set_writer *w = NULL;
    dl_error err;

    mkdir_p(dir);
    snprintf(path, sizeof(path), "%s/delta_7.safetensors", dir);
    if (meta == NULL) {
        meta = META;
        nmeta = 4;
    }
    if (st_set_writer_open(path, DELTA_SPECS, 3, meta, nmeta, shard_size, &w, &err) != 0)
        goto fail;
    for (size_t i = 0; i < 3; i++) {
        uint64_t bytes = DELTA_SPECS[i].shape[0] * 4;
        if (st_set_writer_write(w, i, 0, DELTA_DATA[i], bytes, &err) != 0) {
            st_set_writer_abort(w);
            goto fail;
        }
    }
    if (st_set_writer_commit(w, &err) != 0)
        goto fail;
    return 0;
fail:
    fprintf(stderr, "  write_delta: %s\n", err.message);
    return -1;
}

static int write_text(const char *dir, const char *file, const char *text)
{
    char path[1024];
    dl_error err;
    snprintf(path, sizeof(path), "%s/%s", dir, file);
    return fsu_write_atomic(path, text, strlen(text), &err);
}

/* ---- linking a staged set into the cache ------------------------------------------------------- */

static const delta_info INFO = {"w1", 3, 7};

static st_index *load_index(const char *dir)
{
    char path[512];
    st_index *ix = NULL;
    dl_error err;
    snprintf(path, sizeof(path), "%s/delta_7.safetensors.index.json", dir);
    if (st_index_load(path, &ix, &err) != 0)
        fprintf(stderr, "  index: %s\n", err.message);
    return ix;
}

TEST(intake_cache_index_path_names_the_set)
{
    char *p = intake_cache_index_path("/st", &INFO);
    CHECK_STR(p, "/st/cache/deltas/s3/w1/delta_7.safetensors.index.json");
    free(p);
}

TEST(intake_link_set_shards_then_index_and_duplicates)
{
    char staged[512], state[512], *cache = NULL;
    dl_error err;

    snprintf(staged, sizeof(staged), "%s/staged", test_dir());
    snprintf(state, sizeof(state), "%s/state", test_dir());
    CHECK_EQ(write_delta(staged, 16, NULL, 0), 0);      /* a | b | c: three shards */
    st_index *ix = load_index(staged);
    CHECK(ix != NULL);
    CHECK_EQ(ix->nshards, 3);
    CHECK_EQ(intake_link_set_into_cache(state, &INFO, staged, ix, &cache, &err), INTAKE_OK);
    char want[600];
    snprintf(want, sizeof(want), "%s/cache/deltas/s3/w1/delta_7.safetensors.index.json", state);
    CHECK_STR(cache, want);
    for (int i = 1; i <= 3; i++) {
        snprintf(want, sizeof(want), "%s/cache/deltas/s3/w1/delta_7-%05d-of-00003.safetensors", state, i);
        CHECK(exists(want));
    }
    /* the cached set opens as one */
    st_set *s = NULL;
    CHECK_EQ(st_set_open(cache, &s, &err), 0);
    CHECK_EQ(s->ntensors, 3);
    st_set_close(s);
    free(cache);
    cache = NULL;
    /* the same set again, and a single file of the same step: duplicates */
    CHECK_EQ(intake_link_set_into_cache(state, &INFO, staged, ix, &cache, &err), INTAKE_DUPLICATE);
    CHECK(cache == NULL);
    char single[512];
    snprintf(single, sizeof(single), "%s/single", test_dir());
    CHECK_EQ(write_delta(single, 0, NULL, 0), 0);
    snprintf(want, sizeof(want), "%s/delta_7.safetensors", single);
    CHECK_EQ(intake_link_into_cache(state, &INFO, want, &cache, &err), INTAKE_DUPLICATE);
    CHECK(cache == NULL);
    snprintf(want, sizeof(want), "%s/cache/deltas/s3/w1/delta_7.safetensors", state);
    CHECK(!exists(want));
    st_index_free(ix);
}

TEST(intake_link_set_after_single_is_duplicate)
{
    char staged[512], single[512], state[512], path[600], *cache = NULL;
    dl_error err;

    snprintf(staged, sizeof(staged), "%s/staged", test_dir());
    snprintf(single, sizeof(single), "%s/single", test_dir());
    snprintf(state, sizeof(state), "%s/state", test_dir());
    CHECK_EQ(write_delta(single, 0, NULL, 0), 0);
    snprintf(path, sizeof(path), "%s/delta_7.safetensors", single);
    CHECK_EQ(intake_link_into_cache(state, &INFO, path, &cache, &err), INTAKE_OK);
    free(cache);
    cache = NULL;
    CHECK_EQ(write_delta(staged, 16, NULL, 0), 0);
    st_index *ix = load_index(staged);
    CHECK(ix != NULL);
    CHECK_EQ(intake_link_set_into_cache(state, &INFO, staged, ix, &cache, &err), INTAKE_DUPLICATE);
    snprintf(path, sizeof(path), "%s/cache/deltas/s3/w1/delta_7-00001-of-00003.safetensors", state);
    CHECK(!exists(path));       /* nothing of the set was linked */
    st_index_free(ix);
}

TEST(intake_link_set_replaces_leftover_shards_of_a_cut_link)
{
    char staged[512], state[512], path[600], *cache = NULL;
    dl_error err;

    snprintf(staged, sizeof(staged), "%s/staged", test_dir());
    snprintf(state, sizeof(state), "%s/state", test_dir());
    CHECK_EQ(write_delta(staged, 16, NULL, 0), 0);
    /* a crash after the first shard's link: a shard without its index */
    snprintf(path, sizeof(path), "%s/cache/deltas/s3/w1", state);
    mkdir_p(path);
    CHECK_EQ(write_text(path, "delta_7-00001-of-00003.safetensors", "left over"), 0);
    st_index *ix = load_index(staged);
    CHECK(ix != NULL);
    CHECK_EQ(intake_link_set_into_cache(state, &INFO, staged, ix, &cache, &err), INTAKE_OK);
    st_set *s = NULL;
    CHECK_EQ(st_set_open(cache, &s, &err), 0);
    st_set_close(s);
    free(cache);
    st_index_free(ix);
}

TEST(intake_link_set_refuses_another_base)
{
    char staged[512], state[512], *cache = NULL;
    dl_error err;
    delta_info other = {"w1", 3, 8};

    snprintf(staged, sizeof(staged), "%s/staged", test_dir());
    snprintf(state, sizeof(state), "%s/state", test_dir());
    CHECK_EQ(write_delta(staged, 16, NULL, 0), 0);
    st_index *ix = load_index(staged);
    CHECK(ix != NULL);
    CHECK_EQ(intake_link_set_into_cache(state, &other, staged, ix, &cache, &err), INTAKE_INVALID);
    CHECK(strstr(err.message, "delta_8") != NULL);
    st_index_free(ix);
}
