#include "test.h"

#include <dirent.h>
#include <fcntl.h>
#include <inttypes.h>
#include <math.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include "checksum.h"
#include "delta.h"
#include "fsutil.h"
#include "index_parse.h"
#include "intake.h"
#include "st_index.h"
#include "store.h"

/* The global: F32 "a" (4), "b" (3), "c" (5) and an I64 "i" (2, not part of a delta).  A delta of
 * node w1, local step 7, based on step 3, holds a, b, c. */
static const uint64_t SA[] = {4}, SB[] = {3}, SC[] = {5}, SI[] = {2};
static const float DA[4] = {0.5f, -1.0f, 2.0f, 0.25f}, DB[3] = {1.0f, 2.0f, 3.0f},
                   DC[5] = {-0.5f, 0.0f, 0.125f, 4.0f, -2.0f};
static const int64_t GI[2] = {1, 2};

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

/* The global model, opened (the caller closes it). */
static st_file *open_global(void)
{
    st_spec g[] = {{"a", 1, ST_F32, 1, SA}, {"b", 1, ST_F32, 1, SB}, {"c", 1, ST_F32, 1, SC}, {"i", 1, ST_I64, 1, SI}};
    const void *gd[] = {DA, DB, DC, GI};
    st_file *f = NULL;
    dl_error err;
    if (st_save(test_path("global.safetensors"), g, gd, 4, NULL, 0, &err) != 0 ||
        st_open(test_path("global.safetensors"), &f, &err) != 0)
        fprintf(stderr, "  global: %s\n", err.message);
    return f;
}

/* One shard file by hand: the tensors named in names (each of a, b, c), {"format": "pt"}; with
 * nan_in_c, c's element 3 is a NaN. */
static int write_shard(const char *dir, const char *file, const char *names, int nan_in_c)
{
    float cdata[5];
    st_spec specs[3];
    const void *data[3];
    size_t n = 0;
    char path[1024];
    st_kv fmt[] = {{"format", "pt"}};
    dl_error err;

    for (const char *c = names; *c; c++) {
        size_t k = (size_t)(*c - 'a');
        specs[n] = DELTA_SPECS[k];
        data[n++] = DELTA_DATA[k];
    }
    memcpy(cdata, DC, sizeof(cdata));
    if (nan_in_c) {
        cdata[3] = NAN;
        for (size_t k = 0; k < n; k++) {
            if (specs[k].name[0] == 'c')
                data[k] = cdata;
        }
    }
    snprintf(path, sizeof(path), "%s/%s", dir, file);
    if (st_save(path, specs, data, n, fmt, 1, &err) != 0) {
        fprintf(stderr, "  write_shard: %s\n", err.message);
        return -1;
    }
    return 0;
}

static int write_text(const char *dir, const char *file, const char *text)
{
    char path[1024];
    dl_error err;
    snprintf(path, sizeof(path), "%s/%s", dir, file);
    return fsu_write_atomic(path, text, strlen(text), &err);
}

/* ---- linking a staged set into the cache ------------------------------------------------------- */

static const delta_info INFO = {.node_id = "w1", .base_outer_step = 3, .local_step = 7};

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

/* Every path under the state directory comes from store.h: intake and the transports name it alone. */
TEST(store_paths_from_the_state_dir)
{
    char *p;

    CHECK_STR(p = store_path_state_dir("/root", "agg"), "/root/agg");
    free(p);
    CHECK_STR(p = store_path_metadata("/st"), "/st/outer_metadata.json");
    free(p);
    CHECK_STR(p = store_path_incoming("/st"), "/st/cache/incoming");
    free(p);
    CHECK_STR(p = store_path_incoming_file("/st", ".link-%d-%u", 12, 34u), "/st/cache/incoming/.link-12-34");
    free(p);
    CHECK_STR(p = store_path_cached_delta("/st", 3, "w1", 7), "/st/cache/deltas/s3/w1/delta_7.safetensors");
    free(p);
    CHECK_STR(p = intake_cache_path("/st", &INFO), "/st/cache/deltas/s3/w1/delta_7.safetensors");
    free(p);
    CHECK_STR(p = store_path_cached_index("/st", 3, "w1", 7), "/st/cache/deltas/s3/w1/delta_7.safetensors.index.json");
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
    delta_info other = {.node_id = "w1", .base_outer_step = 3, .local_step = 8};

    snprintf(staged, sizeof(staged), "%s/staged", test_dir());
    snprintf(state, sizeof(state), "%s/state", test_dir());
    CHECK_EQ(write_delta(staged, 16, NULL, 0), 0);
    st_index *ix = load_index(staged);
    CHECK(ix != NULL);
    CHECK_EQ(intake_link_set_into_cache(state, &other, staged, ix, &cache, &err), INTAKE_INVALID);
    CHECK(strstr(err.message, "delta_8") != NULL);
    st_index_free(ix);
}

/* ---- intake of a set ------------------------------------------------------------------------- */

/* The shared tree test_dir()/tree (as file:// hands a delta over), its node directory, the state. */
typedef struct fixture {
    char tree[512], node[600], state[512];
    st_file *global;
} fixture;

static void fixture_init(fixture *f)
{
    char path[700];

    snprintf(f->tree, sizeof(f->tree), "%s/tree", test_dir());
    snprintf(f->node, sizeof(f->node), "%s/nodes/w1", f->tree);
    snprintf(f->state, sizeof(f->state), "%s/state", test_dir());
    mkdir_p(f->node);
    snprintf(path, sizeof(path), "%s/cache/incoming", f->state);
    mkdir_p(path);          /* the daemon makes it at start */
    f->global = open_global();
}

/* Takes in rel (under the tree) at outer step `step`. */
static intake_req *take(const fixture *f, const char *rel, uint64_t step)
{
    intake_req *r = calloc(1, sizeof(*r));
    if (r == NULL || asprintf(&r->src_path, "%s/%s", f->tree, rel) < 0)
        return NULL;
    r->rel_path = strdup(rel);
    r->hub_root = strdup(f->tree);
    r->state_dir = strdup(f->state);
    r->global = f->global->h;
    r->step = step;
    intake_run(r);
    if (r->status != INTAKE_OK)
        fprintf(stderr, "  (intake of %s: %s, %s [%s])\n", rel, intake_status_name(r->status), r->err.message,
                r->err.tensor);
    return r;
}

#define SET_REL "nodes/w1/delta_7.safetensors.index.json"

/* Entries in state/cache/incoming (staging leftovers), -1 if it cannot be read. */
static int incoming_entries(const fixture *f)
{
    char path[700];
    int n = 0;
    snprintf(path, sizeof(path), "%s/cache/incoming", f->state);
    DIR *d = opendir(path);
    if (d == NULL)
        return 0;
    struct dirent *de;
    while ((de = readdir(d)) != NULL)
        n += strcmp(de->d_name, ".") != 0 && strcmp(de->d_name, "..") != 0;
    closedir(d);
    return n;
}

static int same_bytes(const char *a, const char *b)
{
    char cmd[2200];
    snprintf(cmd, sizeof(cmd), "cmp -s '%s' '%s'", a, b);
    return system(cmd) == 0;
}

static uint64_t file_size(const char *path)
{
    struct stat sb;
    return stat(path, &sb) == 0 ? (uint64_t)sb.st_size : 0;
}

TEST(intake_set_good_one_tensor_per_shard_and_mixed)
{
    static const struct { uint64_t shard_size; uint32_t nshards; } layouts[] = {{16, 3}, {28, 2}, {8, 3}};
    for (size_t l = 0; l < sizeof(layouts) / sizeof(layouts[0]); l++) {
        fixture f;
        char cmd[700];
        snprintf(cmd, sizeof(cmd), "rm -rf '%s'/*", test_dir());
        CHECK_EQ(system(cmd), 0);
        fixture_init(&f);
        CHECK_EQ(write_delta(f.node, layouts[l].shard_size, NULL, 0), 0);
        intake_req *r = take(&f, SET_REL, 3);
        CHECK_EQ(r->status, INTAKE_OK);
        CHECK_STR(r->info.node_id, "w1");
        CHECK_EQ(r->info.local_step, 7);
        CHECK_EQ(r->info.base_outer_step, 3);
        char want[900], src[900];
        snprintf(want, sizeof(want), "%s/cache/deltas/s3/w1/delta_7.safetensors.index.json", f.state);
        CHECK_STR(r->cache_path, want);
        struct stat sb;
        CHECK_EQ(stat(r->src_path, &sb), 0);
        CHECK_EQ(r->ino, sb.st_ino);            /* the version is the index's */
        uint64_t total = (uint64_t)sb.st_size;
        CHECK(same_bytes(r->src_path, r->cache_path));
        for (uint32_t i = 1; i <= layouts[l].nshards; i++) {
            snprintf(src, sizeof(src), "%s/delta_7-%05u-of-%05u.safetensors", f.node, i, layouts[l].nshards);
            snprintf(want, sizeof(want), "%s/cache/deltas/s3/w1/delta_7-%05u-of-%05u.safetensors", f.state, i,
                     layouts[l].nshards);
            CHECK(same_bytes(src, want));
            total += file_size(src);
        }
        CHECK_EQ(r->size, total);
        CHECK_EQ(incoming_entries(&f), 0);
        st_set *s = NULL;
        dl_error err;
        CHECK_EQ(st_set_open(r->cache_path, &s, &err), 0);
        CHECK_EQ(s->nfiles, layouts[l].nshards);
        st_set_close(s);
        intake_req_free(r);
        st_close(f.global);
    }
}

TEST(intake_set_missing_shard_is_incomplete)
{
    fixture f;
    char path[900];
    fixture_init(&f);
    CHECK_EQ(write_delta(f.node, 16, NULL, 0), 0);
    snprintf(path, sizeof(path), "%s/delta_7-00002-of-00003.safetensors", f.node);
    CHECK_EQ(unlink(path), 0);
    intake_req *r = take(&f, SET_REL, 3);
    CHECK_EQ(r->status, INTAKE_INCOMPLETE);
    CHECK(strstr(r->err.message, "delta_7-00002-of-00003.safetensors") != NULL);
    CHECK(r->cache_path == NULL);
    CHECK_EQ(incoming_entries(&f), 0);
    snprintf(path, sizeof(path), "%s/cache/deltas/s3/w1/delta_7-00001-of-00003.safetensors", f.state);
    CHECK(!exists(path));
    intake_req_free(r);
    st_close(f.global);
}

TEST(intake_set_stray_shard_refused)
{
    fixture f;
    fixture_init(&f);
    CHECK_EQ(write_delta(f.node, 16, NULL, 0), 0);
    CHECK_EQ(write_shard(f.node, "delta_7-00002-of-00002.safetensors", "c", 0), 0);    /* of another save */
    intake_req *r = take(&f, SET_REL, 3);
    CHECK_EQ(r->status, INTAKE_INVALID);
    CHECK_EQ(r->err.code, DL_E_KEY_MISMATCH);
    CHECK(strstr(r->err.message, "delta_7-00002-of-00002.safetensors") != NULL);
    intake_req_free(r);
    st_close(f.global);
}

#define META_JSON                                                                                     \
    "\"algorithm\": \"dumb_diloco\", \"base_outer_step\": \"3\", \"local_step\": \"7\", \"node_id\": \"w1\""
#define SH1 "\"delta_7-00001-of-00002.safetensors\""
#define SH2 "\"delta_7-00002-of-00002.safetensors\""

/* delta_7.safetensors.index.json of the two-shard set {a, b} + {c} with the given total_size (48 is
 * right). */
static int write_abc_index(const char *dir, int total_size)
{
    char json[512];
    snprintf(json, sizeof(json),
             "{\"metadata\": {\"total_size\": %d, " META_JSON "}, \"weight_map\": {\"a\": " SH1 ", \"b\": " SH1
             ", \"c\": " SH2 "}}",
             total_size);
    return write_text(dir, "delta_7.safetensors.index.json", json);
}

TEST(intake_set_tensor_in_two_shards_refused)
{
    fixture f;
    fixture_init(&f);
    CHECK_EQ(write_shard(f.node, "delta_7-00001-of-00002.safetensors", "ab", 0), 0);
    CHECK_EQ(write_shard(f.node, "delta_7-00002-of-00002.safetensors", "bc", 0), 0);
    CHECK_EQ(write_abc_index(f.node, 48), 0);
    intake_req *r = take(&f, SET_REL, 3);
    CHECK_EQ(r->status, INTAKE_INVALID);
    CHECK_STR(r->err.tensor, "b");
    CHECK(strstr(r->err.message, "two shards") != NULL);
    CHECK(strstr(r->err.message, "delta_7-00002-of-00002.safetensors") != NULL);
    CHECK_EQ(incoming_entries(&f), 0);
    intake_req_free(r);
    st_close(f.global);
}

TEST(intake_set_wrong_total_size_refused)
{
    fixture f;
    fixture_init(&f);
    CHECK_EQ(write_shard(f.node, "delta_7-00001-of-00002.safetensors", "ab", 0), 0);
    CHECK_EQ(write_shard(f.node, "delta_7-00002-of-00002.safetensors", "c", 0), 0);
    CHECK_EQ(write_abc_index(f.node, 47), 0);
    intake_req *r = take(&f, SET_REL, 3);
    CHECK_EQ(r->status, INTAKE_INVALID);
    CHECK(strstr(r->err.message, "total_size is 47") != NULL);
    intake_req_free(r);
    /* the same set with the right total is taken */
    CHECK_EQ(write_abc_index(f.node, 48), 0);
    r = take(&f, SET_REL, 3);
    CHECK_EQ(r->status, INTAKE_OK);
    intake_req_free(r);
    st_close(f.global);
}

TEST(intake_set_metadata_must_agree_with_path)
{
    fixture f;
    const st_kv other[] = {{"algorithm", "dumb_diloco"}, {"base_outer_step", "3"}, {"local_step", "8"},
                           {"node_id", "w1"}};
    fixture_init(&f);
    CHECK_EQ(write_delta(f.node, 16, other, 4), 0);     /* delta_7's files saying local step 8 */
    intake_req *r = take(&f, SET_REL, 3);
    CHECK_EQ(r->status, INTAKE_INVALID);
    CHECK_EQ(r->err.code, DL_E_PATH_MISMATCH);
    intake_req_free(r);
    st_close(f.global);
}

TEST(intake_set_nan_names_shard_and_tensor)
{
    fixture f;
    fixture_init(&f);
    CHECK_EQ(write_shard(f.node, "delta_7-00001-of-00002.safetensors", "ab", 0), 0);
    CHECK_EQ(write_shard(f.node, "delta_7-00002-of-00002.safetensors", "c", 1), 0);
    CHECK_EQ(write_abc_index(f.node, 48), 0);
    intake_req *r = take(&f, SET_REL, 3);
    CHECK_EQ(r->status, INTAKE_INVALID);
    CHECK_EQ(r->err.code, DL_E_NON_FINITE);
    CHECK_STR(r->err.tensor, "c");
    CHECK(strstr(r->err.message, "shard delta_7-00002-of-00002.safetensors") != NULL);
    CHECK(strstr(r->err.message, "element 3") != NULL);
    CHECK_EQ(incoming_entries(&f), 0);
    intake_req_free(r);
    st_close(f.global);
}

TEST(intake_set_shard_being_written_is_incomplete)
{
    fixture f;
    char path[900];
    fixture_init(&f);
    CHECK_EQ(write_delta(f.node, 16, NULL, 0), 0);
    snprintf(path, sizeof(path), "%s/delta_7-00003-of-00003.safetensors", f.node);
    CHECK_EQ(truncate(path, (off_t)file_size(path) - 6), 0);     /* its last bytes not written yet */
    intake_req *r = take(&f, SET_REL, 3);
    CHECK_EQ(r->status, INTAKE_INCOMPLETE);
    CHECK(strstr(r->err.message, "delta_7-00003-of-00003.safetensors") != NULL);
    intake_req_free(r);
    /* an index cut short is on its way too, not malformed */
    CHECK_EQ(write_text(f.node, "delta_7.safetensors.index.json", "{\"metadata\": {\"total_size\": 48, "), 0);
    r = take(&f, SET_REL, 3);
    CHECK_EQ(r->status, INTAKE_INCOMPLETE);
    intake_req_free(r);
    st_close(f.global);
}

TEST(intake_set_stale_or_future_costs_only_the_index)
{
    fixture f;
    char path[900];
    fixture_init(&f);
    CHECK_EQ(write_delta(f.node, 16, NULL, 0), 0);
    for (int i = 1; i <= 3; i++) {       /* no shard at all: only the index can be read */
        snprintf(path, sizeof(path), "%s/delta_7-%05d-of-00003.safetensors", f.node, i);
        CHECK_EQ(unlink(path), 0);
    }
    intake_req *r = take(&f, SET_REL, 4);
    CHECK_EQ(r->status, INTAKE_STALE);
    CHECK_EQ(r->info.base_outer_step, 3);
    CHECK_EQ(r->size, file_size(r->src_path));
    intake_req_free(r);
    r = take(&f, SET_REL, 2);
    CHECK_EQ(r->status, INTAKE_FUTURE);
    intake_req_free(r);
    CHECK_EQ(incoming_entries(&f), 0);
    st_close(f.global);
}

TEST(intake_set_and_single_file_are_duplicates_of_each_other)
{
    fixture f;
    fixture_init(&f);
    CHECK_EQ(write_delta(f.node, 0, NULL, 0), 0);       /* the plain file first */
    intake_req *r = take(&f, "nodes/w1/delta_7.safetensors", 3);
    CHECK_EQ(r->status, INTAKE_OK);
    intake_req_free(r);
    CHECK_EQ(write_delta(f.node, 16, NULL, 0), 0);      /* then the same step as a set (it replaces the file) */
    r = take(&f, SET_REL, 3);
    CHECK_EQ(r->status, INTAKE_DUPLICATE);
    intake_req_free(r);

    fixture g;
    char cmd[700];
    st_close(f.global);
    snprintf(cmd, sizeof(cmd), "rm -rf '%s'/*", test_dir());
    CHECK_EQ(system(cmd), 0);
    fixture_init(&g);
    CHECK_EQ(write_delta(g.node, 16, NULL, 0), 0);      /* the set first */
    r = take(&g, SET_REL, 3);
    CHECK_EQ(r->status, INTAKE_OK);
    intake_req_free(r);
    CHECK_EQ(write_delta(g.node, 0, NULL, 0), 0);
    r = take(&g, "nodes/w1/delta_7.safetensors", 3);
    CHECK_EQ(r->status, INTAKE_DUPLICATE);
    intake_req_free(r);
    st_close(g.global);
}

TEST(intake_set_in_cache_restart_checks_headers)
{
    fixture f;
    char path[900];
    fixture_init(&f);
    CHECK_EQ(write_delta(f.node, 16, NULL, 0), 0);
    intake_req *r = take(&f, SET_REL, 3);
    CHECK_EQ(r->status, INTAKE_OK);
    uint64_t size = r->size;
    char *cached = strdup(r->cache_path);
    intake_req_free(r);
    /* a restart: the cached index, no Hub path, no tree */
    r = calloc(1, sizeof(*r));
    r->src_path = strdup(cached);
    r->state_dir = strdup(f.state);
    r->global = f.global->h;
    r->step = 3;
    r->in_cache = 1;
    intake_run(r);
    CHECK_EQ(r->status, INTAKE_OK);
    CHECK_STR(r->cache_path, cached);
    CHECK_EQ(r->size, size);
    CHECK_STR(r->info.node_id, "w1");
    intake_req_free(r);
    /* a cached set that lost a shard is refused */
    snprintf(path, sizeof(path), "%s/cache/deltas/s3/w1/delta_7-00002-of-00003.safetensors", f.state);
    CHECK_EQ(unlink(path), 0);
    r = calloc(1, sizeof(*r));
    r->src_path = strdup(cached);
    r->state_dir = strdup(f.state);
    r->global = f.global->h;
    r->step = 3;
    r->in_cache = 1;
    intake_run(r);
    CHECK_EQ(r->status, INTAKE_INVALID);
    CHECK(strstr(r->err.message, "delta_7-00002-of-00003.safetensors") != NULL);
    intake_req_free(r);
    free(cached);
    st_close(f.global);
}

TEST(intake_set_linked_shard_refused)
{
    fixture f;
    char path[900];
    fixture_init(&f);
    CHECK_EQ(write_delta(f.node, 16, NULL, 0), 0);
    snprintf(path, sizeof(path), "%s/delta_7-00001-of-00003.safetensors", f.node);
    CHECK_EQ(rename(path, test_path("elsewhere")), 0);
    CHECK_EQ(symlink(test_path("elsewhere"), path), 0);
    intake_req *r = take(&f, SET_REL, 3);
    CHECK_EQ(r->status, INTAKE_INVALID);
    CHECK(strstr(r->err.message, "shard delta_7-00001-of-00003.safetensors") != NULL);
    CHECK(strstr(r->err.message, "symbolic link") != NULL);
    intake_req_free(r);
    st_close(f.global);
}

TEST(intake_set_shard_checked_against_index_before_its_copy)
{
    fixture f;
    fixture_init(&f);
    /* shard 1 of 3 holds every tensor, the index spreads them over three shards: refused at shard 1,
     * before shards 2 and 3 (absent here) are looked for, so a hostile set never costs more than one
     * delta's copy */
    CHECK_EQ(write_shard(f.node, "delta_7-00001-of-00003.safetensors", "abc", 0), 0);
    CHECK_EQ(write_text(f.node, "delta_7.safetensors.index.json",
                        "{\"metadata\": {\"total_size\": 48, " META_JSON "}, \"weight_map\": {"
                        "\"a\": \"delta_7-00001-of-00003.safetensors\", \"b\": \"delta_7-00002-of-00003.safetensors\", "
                        "\"c\": \"delta_7-00003-of-00003.safetensors\"}}"), 0);
    intake_req *r = take(&f, SET_REL, 3);
    CHECK_EQ(r->status, INTAKE_INVALID);
    CHECK_EQ(r->err.code, DL_E_KEY_MISMATCH);
    CHECK_STR(r->err.tensor, "b");
    CHECK(strstr(r->err.message, "shard delta_7-00001-of-00003.safetensors") != NULL);
    CHECK(strstr(r->err.message, "delta_7-00002-of-00003.safetensors") != NULL);
    CHECK_EQ(incoming_entries(&f), 0);
    intake_req_free(r);
    /* a shard lacking a tensor the index lists for it (shard 2, c, absent: never looked for) */
    CHECK_EQ(write_shard(f.node, "delta_7-00001-of-00002.safetensors", "a", 0), 0);
    CHECK_EQ(write_abc_index(f.node, 48), 0);
    CHECK_EQ(unlink(test_path("tree/nodes/w1/delta_7-00001-of-00003.safetensors")), 0);
    r = take(&f, SET_REL, 3);
    CHECK_EQ(r->status, INTAKE_INVALID);
    CHECK_STR(r->err.tensor, "b");
    CHECK(strstr(r->err.message, "does not hold it") != NULL);
    intake_req_free(r);
    st_close(f.global);
}

/* ---- a set's index parsed by the transport (index_parse.h) --------------------------------------- */

/* The parse of the tree's test index, as the file:// scan makes it. */
static index_parse *parse_of(const char *path)
{
    index_parse *p = NULL;
    struct stat sb;
    int fd = open(path, O_RDONLY | O_CLOEXEC);

    if (fd < 0)
        return NULL;
    if (fstat(fd, &sb) != 0 || index_parse_read(fd, &sb, "delta_7", &p) != 0)
        p = NULL;
    close(fd);
    return p;
}

/* take() with the transport's parse carried along (a reference of the request's own). */
static intake_req *take_with(const fixture *f, const char *rel, uint64_t step, index_parse *p)
{
    intake_req *r = calloc(1, sizeof(*r));
    if (r == NULL || asprintf(&r->src_path, "%s/%s", f->tree, rel) < 0)
        return NULL;
    r->rel_path = strdup(rel);
    r->hub_root = strdup(f->tree);
    r->state_dir = strdup(f->state);
    r->global = f->global->h;
    r->step = step;
    r->index = index_parse_ref(p);
    intake_run(r);
    return r;
}

TEST(intake_set_uses_the_transports_parse_of_the_version_it_opens)
{
    fixture f;
    char ix[700], cmd[900];
    fixture_init(&f);
    CHECK_EQ(write_delta(f.node, 16, NULL, 0), 0);
    snprintf(ix, sizeof(ix), "%s/delta_7.safetensors.index.json", f.node);
    /* a parse of an earlier version (only ctime moved since: a chmod, or a rewrite with its mtime put
     * back): not used, the index is read and parsed again */
    index_parse *p = parse_of(ix);
    CHECK(p != NULL && p->status == INDEX_PARSED && p->ix != NULL);
    struct stat sb;
    for (int i = 0; i < 1000; i++) {        /* until the filesystem's clock ticks and ctime moves */
        CHECK_EQ(chmod(ix, i % 2 ? 0644 : 0600), 0);
        CHECK_EQ(stat(ix, &sb), 0);
        if ((int64_t)sb.st_ctim.tv_sec * 1000000000 + sb.st_ctim.tv_nsec != p->ident.ctime_ns)
            break;
        usleep(1000);
    }
    CHECK(!index_parse_is_version(p, &sb));
    intake_req *r = take_with(&f, SET_REL, 3, p);
    CHECK_EQ(r->status, INTAKE_OK);
    CHECK_EQ(r->index_parsed, 1);
    intake_req_free(r);
    index_parse_release(p);
    snprintf(cmd, sizeof(cmd), "rm -rf '%s/cache/deltas'", f.state);
    CHECK_EQ(system(cmd), 0);
    /* a parse of this version: used as it is, no read, no parse, and the staged index is its bytes */
    p = parse_of(ix);
    CHECK(p != NULL);
    r = take_with(&f, SET_REL, 3, p);
    CHECK_EQ(r->status, INTAKE_OK);
    CHECK_EQ(r->index_parsed, 0);
    CHECK(same_bytes(ix, r->cache_path));
    intake_req_free(r);
    CHECK_EQ(system(cmd), 0);
    /* the parse outlives the request and is still the transport's to use: taken again from it */
    r = take_with(&f, SET_REL, 3, p);
    CHECK_EQ(r->status, INTAKE_OK);
    CHECK_EQ(r->index_parsed, 0);
    CHECK_EQ(p->ix->nshards, 3);
    intake_req_free(r);
    index_parse_release(p);
    st_close(f.global);
}

TEST(intake_set_uses_the_transports_refusal_of_the_version_it_opens)
{
    fixture f;
    char ix[700];
    fixture_init(&f);
    CHECK_EQ(write_delta(f.node, 16, NULL, 0), 0);
    CHECK_EQ(write_text(f.node, "delta_7.safetensors.index.json", "{\"metadata\": {\"total_size\": 48}, \"x\": 1}"), 0);
    snprintf(ix, sizeof(ix), "%s/delta_7.safetensors.index.json", f.node);
    index_parse *p = parse_of(ix);
    CHECK(p != NULL && p->status == INDEX_REFUSED && p->ix == NULL);
    intake_req *r = take_with(&f, SET_REL, 3, p);
    CHECK_EQ(r->status, INTAKE_INVALID);
    CHECK_EQ(r->index_parsed, 0);
    CHECK_EQ(r->err.code, p->code);
    CHECK_STR(r->err.message, p->message);
    intake_req_free(r);
    index_parse_release(p);
    /* cut short: still being written, as intake's own parse says */
    CHECK_EQ(write_text(f.node, "delta_7.safetensors.index.json", "{\"metadata\": {\"total_size\": 48, "), 0);
    p = parse_of(ix);
    CHECK(p != NULL && p->status == INDEX_REFUSED && p->incomplete);
    r = take_with(&f, SET_REL, 3, p);
    CHECK_EQ(r->status, INTAKE_INCOMPLETE);
    CHECK_EQ(r->index_parsed, 0);
    CHECK(strstr(r->err.message, "not complete yet") != NULL);
    intake_req_free(r);
    index_parse_release(p);
    st_close(f.global);
}

/* ---- a linked delta's values, checked in place --------------------------------------------------- */

/* The data section of a delta written by the reference's rules puts C64 "z" first, then F32 "big",
 * then F16 "h" (largest dtype first): together 28 MB, so each spans checking windows (8 MiB). */
enum { NZ = 1100000, NBIG = 2600000, NH = 4500000 };

/* Rewrites path with its header `pad` spaces longer (a header length the reference accepts), so the
 * data section starts pad bytes later. */
static int pad_header(const char *path, unsigned pad)
{
    FILE *f = fopen(path, "rb");
    unsigned char *buf = NULL;
    long size;
    int rc = -1;

    if (f == NULL || fseek(f, 0, SEEK_END) != 0 || (size = ftell(f)) < 8 || fseek(f, 0, SEEK_SET) != 0 ||
        (buf = malloc((size_t)size)) == NULL || fread(buf, 1, (size_t)size, f) != (size_t)size)
        goto out;
    fclose(f);
    uint64_t n = 0;
    for (int i = 7; i >= 0; i--)
        n = n << 8 | buf[i];
    uint64_t m = n + pad;
    unsigned char len[8], *spaces = malloc(pad);
    for (int i = 0; i < 8; i++)
        len[i] = (unsigned char)(m >> (8 * i));
    if (spaces == NULL)
        goto out_nofile;
    memset(spaces, ' ', pad);
    f = fopen(path, "wb");
    rc = f != NULL && fwrite(len, 1, 8, f) == 8 && fwrite(buf + 8, 1, n, f) == n && fwrite(spaces, 1, pad, f) == pad &&
                 fwrite(buf + 8 + n, 1, (size_t)size - 8 - n, f) == (size_t)size - 8 - n
             ? 0
             : -1;
    free(spaces);
out:
    if (f != NULL && fclose(f) != 0)
        rc = -1;
out_nofile:
    free(buf);
    return rc;
}

/* Writes the delta into the tree (nodes/w1/delta_7.safetensors) with one non-finite value: lane `lane`
 * of tensor `which` ('z', 'b' or 'h'; 0: none), and its header padded by pad. */
static int write_big_delta(const fixture *f, char which, uint64_t lane, unsigned pad)
{
    static const uint64_t sz[] = {NZ}, sb[] = {NBIG}, sh[] = {NH};
    const st_spec specs[] = {{"z", 1, ST_C64, 1, sz}, {"big", 3, ST_F32, 1, sb}, {"h", 1, ST_F16, 1, sh}};
    float *z = calloc((size_t)NZ * 2, 4), *big = calloc(NBIG, 4);
    uint16_t *h = calloc(NH, 2);
    char path[700];
    dl_error err;
    int rc = -1;

    if (z == NULL || big == NULL || h == NULL)
        goto out;
    for (size_t i = 0; i < (size_t)NZ * 2; i++)
        z[i] = (float)(i % 9) * 0.25f;
    for (size_t i = 0; i < NBIG; i++)
        big[i] = (float)(i % 5) - 2.0f;
    for (size_t i = 0; i < NH; i++)
        h[i] = 0x3c00;                          /* 1.0 */
    if (which == 'z' || which == '2')
        z[lane] = NAN;
    if (which == '2')
        h[NH - 7] = 0x7e00;                     /* and one in the last tensor: the first half's is named */
    else if (which == 'b')
        big[lane] = INFINITY;
    else if (which == 'h')
        h[lane] = 0x7e00;                       /* an F16 NaN */
    const void *data[] = {z, big, h};
    snprintf(path, sizeof(path), "%s/delta_7.safetensors", f->node);
    rc = st_save(path, specs, data, 3, META, 4, &err) == 0 && pad_header(path, pad) == 0 ? 0 : -1;
out:
    free(z);
    free(big);
    free(h);
    return rc;
}

/* The checksum key take_big's intakes use (NULL: none). */
static const ck_key *take_key;

/* The global take_big takes deltas against: F32 "big" and "h", C64 "z". */
static st_header *big_global(void)
{
    static const uint64_t sz[] = {NZ}, sb[] = {NBIG}, sh[] = {NH};
    const st_spec g[] = {{"z", 1, ST_C64, 1, sz}, {"big", 3, ST_F32, 1, sb}, {"h", 1, ST_F32, 1, sh}};
    st_header *h = NULL;
    char *json = NULL;
    size_t json_len;
    uint64_t offsets[6], data_len;
    dl_error err;

    if (st_header_build(g, 3, NULL, 0, &json, &json_len, offsets, &data_len, &err) != 0 ||
        st_header_parse_unsized(json, json_len, &h, &err) != 0)
        h = NULL;
    free(json);
    return h;
}

/* The intake of the delta written by write_big_delta, against a global of F32 "big" and "h" and C64
 * "z", in a state of its own. */
static intake_req *take_big(const fixture *f, const char *state)
{
    static const uint64_t sz[] = {NZ}, sb[] = {NBIG}, sh[] = {NH};
    const st_spec g[] = {{"z", 1, ST_C64, 1, sz}, {"big", 3, ST_F32, 1, sb}, {"h", 1, ST_F32, 1, sh}};
    char path[700], dir[700];
    st_header *h = NULL;
    char *json = NULL;
    size_t json_len;
    uint64_t offsets[6], data_len;
    dl_error err;

    snprintf(dir, sizeof(dir), "%s/cache/incoming", state);
    mkdir_p(dir);
    if (st_header_build(g, 3, NULL, 0, &json, &json_len, offsets, &data_len, &err) != 0 ||
        st_header_parse_unsized(json, json_len, &h, &err) != 0) {
        free(json);
        return NULL;
    }
    free(json);
    intake_req *r = calloc(1, sizeof(*r));
    snprintf(path, sizeof(path), "%s/nodes/w1/delta_7.safetensors", f->tree);
    r->src_path = strdup(path);
    r->rel_path = strdup("nodes/w1/delta_7.safetensors");
    r->hub_root = strdup(f->tree);
    r->state_dir = strdup(state);
    r->global = h;
    r->step = 3;
    r->ck = take_key;
    intake_run(r);
    st_header_free(h);
    r->global = NULL;
    return r;
}

/* A linked delta is checked in place, window by window: the first non-finite value is found and named
 * by its element in each dtype, also past a window's end, in a C64 element the window's end cuts in
 * two (data at 4 mod 8), and with the data at an odd offset (read with pread); a finite one is linked.
 * The same verdicts from a check in one part and from one split in two halves (intake_split_min): with
 * a value in each half, the first half's (the first in file order) is named. */
TEST(intake_linked_delta_checked_in_place_names_the_non_finite_element)
{
    const uint64_t window = 8u << 20;
    const uint64_t saved_split_min = intake_split_min;
    fixture f;
    char state[700];
    int n = 0;

    fixture_init(&f);
    for (unsigned mode = 0; mode < 4; mode++) {
        const unsigned pad = mode % 2 ? 4 : 0;              /* 0: as written, 4: z at 4 mod 8 */
        intake_split_min = mode < 2 ? UINT64_MAX : 0;       /* one part, then two halves */
        /* the header length st_save wrote, to find the z element the 8 MiB boundary cuts */
        CHECK_EQ(write_big_delta(&f, 0, 0, pad), 0);
        char path[700];
        snprintf(path, sizeof(path), "%s/delta_7.safetensors", f.node);
        FILE *fp = fopen(path, "rb");
        unsigned char len[8];
        CHECK(fp != NULL && fread(len, 1, 8, fp) == 8);
        fclose(fp);
        uint64_t ds = 8 + ((uint64_t)len[0] | (uint64_t)len[1] << 8 | (uint64_t)len[2] << 16 | (uint64_t)len[3] << 24);
        CHECK_EQ(ds % 8, pad % 8);
        /* the z lane at or just past the window's end */
        uint64_t zlane = (window - ds + 3) / 4;
        struct {
            char which;
            uint64_t lane;
            const char *tensor;
            uint64_t element;
        } cases[] = {
            {'z', 0, "z", 0},
            {'z', zlane, "z", zlane / 2},
            {'z', (uint64_t)NZ * 2 - 1, "z", NZ - 1},
            {'b', 2000000, "big", 2000000},
            {'h', NH - 7, "h", NH - 7},
            {'2', 0, "z", 0},
        };
        for (size_t c = 0; c < sizeof(cases) / sizeof(cases[0]); c++) {
            char want[96];
            snprintf(state, sizeof(state), "%s/state-%d", test_dir(), n++);
            CHECK_EQ(write_big_delta(&f, cases[c].which, cases[c].lane, pad), 0);
            intake_req *r = take_big(&f, state);
            CHECK(r != NULL);
            CHECK_EQ(r->status, INTAKE_INVALID);
            CHECK_EQ(r->err.code, DL_E_NON_FINITE);
            CHECK_STR(r->err.tensor, cases[c].tensor);
            snprintf(want, sizeof(want), "at element %" PRIu64, cases[c].element);
            if (strstr(r->err.message, want) == NULL)
                fprintf(stderr, "  mode %u case %zu: %s (want %s)\n", mode, c, r->err.message, want);
            CHECK(strstr(r->err.message, want) != NULL);
            intake_req_free(r);
        }
        snprintf(state, sizeof(state), "%s/state-%d", test_dir(), n++);
        CHECK_EQ(write_big_delta(&f, 0, 0, pad), 0);
        intake_req *r = take_big(&f, state);
        CHECK(r != NULL);
        CHECK_EQ(r->status, INTAKE_OK);
        CHECK_EQ(r->linked, 1);
        intake_req_free(r);
    }
    intake_split_min = saved_split_min;
    /* data at an odd offset: read with pread, the same verdicts */
    snprintf(state, sizeof(state), "%s/state-%d", test_dir(), n++);
    CHECK_EQ(write_big_delta(&f, 'b', 2000000, 1), 0);
    intake_req *r = take_big(&f, state);
    CHECK(r != NULL);
    CHECK_EQ(r->status, INTAKE_INVALID);
    CHECK_STR(r->err.tensor, "big");
    CHECK(strstr(r->err.message, "at element 2000000") != NULL);
    intake_req_free(r);
    snprintf(state, sizeof(state), "%s/state-%d", test_dir(), n++);
    CHECK_EQ(write_big_delta(&f, 0, 0, 1), 0);
    r = take_big(&f, state);
    CHECK(r != NULL);
    CHECK_EQ(r->status, INTAKE_OK);
    intake_req_free(r);
    st_close(f.global);
}

/* The checksum of a linked delta (checksum.h) is the same whichever way it was checked (in place in one
 * part, split in two halves, with its data at 4 mod 8, read with pread), and it is the one computed here
 * tensor by tensor, keyed by the global's tensor indices: the pass verifies it against what it reads. */
TEST(intake_linked_delta_checksum_is_the_same_whatever_the_check)
{
    const uint64_t saved_split_min = intake_split_min;
    ck_key key;
    fixture f;
    char state[700], path[700];
    uint64_t sums[5];

    fixture_init(&f);
    CHECK_EQ(ck_key_random(&key, NULL), 0);
    take_key = &key;
    for (unsigned mode = 0; mode < 5; mode++) {
        const unsigned pad = mode == 4 ? 1 : mode % 2 ? 4 : 0;
        intake_split_min = mode < 2 || mode == 4 ? UINT64_MAX : 0;
        snprintf(state, sizeof(state), "%s/state-sum-%u", test_dir(), mode);
        CHECK_EQ(write_big_delta(&f, 0, 0, pad), 0);
        intake_req *r = take_big(&f, state);
        CHECK(r != NULL);
        CHECK_EQ(r->status, INTAKE_OK);
        CHECK_EQ(r->linked, 1);
        CHECK_EQ(r->ident.has_sum, 1);
        sums[mode] = r->ident.sum;
        intake_req_free(r);
    }
    intake_split_min = saved_split_min;
    take_key = NULL;
    for (unsigned mode = 1; mode < 5; mode++)
        CHECK(sums[mode] == sums[0]);
    /* computed here: the last file written (pad 1) holds the same data */
    st_header *g = big_global();
    st_file *d;
    dl_error err;
    uint64_t want = 0;
    snprintf(path, sizeof(path), "%s/delta_7.safetensors", f.node);
    CHECK(g != NULL && st_open(path, &d, &err) == 0);
    for (size_t i = 0; i < d->h->ntensors; i++) {
        const st_tensor *t = &d->h->tensors[i], *gt = st_header_find(g, t->name, t->name_len);
        void *buf = malloc(st_tensor_bytes(t));
        CHECK(buf != NULL && gt != NULL && st_read(d, t, 0, buf, st_tensor_bytes(t), &err) == 0);
        want += ck_blocks(&key, (uint32_t)(gt - g->tensors), t->dtype, 0, buf, t->nelem, st_dtype_bits(t->dtype) / 8);
        free(buf);
    }
    st_close(d);
    st_header_free(g);
    CHECK(want == sums[0]);
    st_close(f.global);
}
