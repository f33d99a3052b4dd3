/* Server modules without a socket or a loop: the API's path and Range parsing, the stats module,
 * the seen map and the store's commit protocol. */
#include "test.h"

#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include "api.h"
#include "seen.h"
#include "stats.h"
#include "store.h"

TEST(api_node_paths)
{
    char id[DELTA_NODE_ID_MAX + 1], step[32];
    int is_put = -1;

    CHECK_EQ(api_parse_node_path("/nodes/w-1/delta_42.safetensors", id, sizeof(id), step, sizeof(step), &is_put), 0);
    CHECK_STR(id, "w-1");
    CHECK_STR(step, "42");
    CHECK_EQ(is_put, 1);
    CHECK_EQ(api_parse_node_path("/nodes/w.2/deltas", id, sizeof(id), step, sizeof(step), &is_put), 0);
    CHECK_STR(id, "w.2");
    CHECK_EQ(is_put, 0);
    /* the step is checked later (canonical integer); the shape of the path here */
    static const char *const bad[] = {
        "/nodes/", "/nodes/w1", "/nodes/w1/", "/nodes//delta_1.safetensors", "/nodes/w 1/delta_1.safetensors",
        "/nodes/../delta_1.safetensors", "/nodes/w1/delta_.safetensors", "/nodes/w1/delta_1.safetensor",
        "/nodes/w1/x/delta_1.safetensors", "/node/w1/deltas", "/nodes/w1/deltas/",
        "/nodes/aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa/deltas",
    };
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++)
        CHECK_EQ(api_parse_node_path(bad[i], id, sizeof(id), step, sizeof(step), &is_put), -DL_E_INVALID_PATH);
}

TEST(api_ranges)
{
    uint64_t from = 0, len = 0;

    CHECK_EQ(api_parse_range(NULL, 100, &from, &len), 0);
    CHECK_EQ(api_parse_range("bytes=0-9", 100, &from, &len), 1);
    CHECK(from == 0 && len == 10);
    CHECK_EQ(api_parse_range("bytes=90-", 100, &from, &len), 1);
    CHECK(from == 90 && len == 10);
    CHECK_EQ(api_parse_range("bytes=-5", 100, &from, &len), 1);
    CHECK(from == 95 && len == 5);
    CHECK_EQ(api_parse_range("bytes=-500", 100, &from, &len), 1);     /* clamped to the file */
    CHECK(from == 0 && len == 100);
    CHECK_EQ(api_parse_range("bytes=50-5000", 100, &from, &len), 1);
    CHECK(from == 50 && len == 50);
    CHECK_EQ(api_parse_range("bytes=100-", 100, &from, &len), -1);
    CHECK_EQ(api_parse_range("bytes=-0", 100, &from, &len), -1);
    CHECK_EQ(api_parse_range("bytes=0-0", 0, &from, &len), -1);
    /* malformed or several ranges: the whole file */
    static const char *const ignored[] = {"bytes=9-1", "bytes=0-1,5-6", "items=0-1", "bytes=a-b", "bytes=--1",
                                          "bytes=18446744073709551616-", "bytes=1-18446744073709551616", "bytes="};
    for (size_t i = 0; i < sizeof(ignored) / sizeof(ignored[0]); i++)
        CHECK_EQ(api_parse_range(ignored[i], 100, &from, &len), 0);
}

TEST(stats_counts_in_one_place)
{
    stats s = {0};

    stats_http_response(&s, ROUTE_UPLOAD, 201);
    stats_http_response(&s, ROUTE_UPLOAD, 403);
    stats_http_response(&s, -1, 431);             /* before routing: "other" */
    stats_http_response(&s, ROUTE_STATUS, 299);   /* a status not in the table: "other" code */
    CHECK_EQ(s.http[ROUTE_UPLOAD][1], (uint64_t)1);            /* 201 */
    CHECK_EQ(s.http[ROUTE_UPLOAD][7], (uint64_t)1);            /* 403 */
    CHECK_EQ(stats_http_codes[1], 201);
    CHECK_EQ(stats_http_codes[7], 403);
    CHECK_EQ(s.http[ROUTE_OTHER][18], (uint64_t)1);
    CHECK_EQ(stats_http_codes[18], 431);
    CHECK_EQ(s.http[ROUTE_STATUS][STATS_HTTP_CODES - 1], (uint64_t)1);
    stats_delta_rejected(&s, DL_E_NON_FINITE);
    stats_delta_rejected(&s, DL_E_SHAPE_MISMATCH);
    stats_delta_rejected(&s, (dl_code)9999);      /* out of range: ignored, never out of bounds */
    CHECK_EQ(stats_rejected_total(&s), (uint64_t)2);
    CHECK_EQ(stats_delta_refused(&s, ROUND_STALE), REFUSED_STALE);
    CHECK_EQ(stats_delta_refused(&s, ROUND_ACCEPTED), REFUSED__COUNT);
    CHECK_EQ(s.refused[REFUSED_STALE], (uint64_t)1);
    stats_delta_taken(&s, ROUND_ACCEPTED);
    stats_delta_taken(&s, ROUND_REPLACED);
    CHECK(s.deltas_accepted == 1 && s.deltas_replaced == 1);
    stats_round_committed(&s, 0.3);
    CHECK_EQ(s.agg_buckets[3], (uint64_t)0);      /* le 0.25 */
    CHECK_EQ(s.agg_buckets[4], (uint64_t)1);      /* le 0.5 */
    CHECK_EQ(s.agg_count, (uint64_t)1);
}

TEST(seen_map_finds_and_grows)
{
    seen_map m = {0};
    char key[64];
    int created;

    for (int i = 0; i < 5000; i++) {
        snprintf(key, sizeof(key), "nodes/w%d/delta_%d.safetensors", i % 7, i);
        seen_entry *e = seen_get(&m, key, &created);
        CHECK(e != NULL && created == 1);
        e->size = (uint64_t)i;
    }
    for (int i = 0; i < 5000; i += 37) {
        snprintf(key, sizeof(key), "nodes/w%d/delta_%d.safetensors", i % 7, i);
        seen_entry *e = seen_find(&m, key);
        CHECK(e != NULL && e->size == (uint64_t)i);
        CHECK(seen_get(&m, key, &created) == e && created == 0);
    }
    CHECK(seen_find(&m, "nodes/w1/delta_999999.safetensors") == NULL);
    seen_free(&m);
}

/* Keys are workers' file names: the map's hash is keyed by a seed of its own, drawn at its first growth,
 * kept through growth and pruning, so two maps (two processes) place the same names differently. */
static int keep_even(const seen_entry *e, void *arg)
{
    (void)arg;
    return e->size % 2 == 0;
}

TEST(seen_map_hash_is_keyed_by_its_own_seed)
{
    seen_map a = {0}, b = {0};
    char key[64];
    int created;

    CHECK(seen_find(&a, "nodes/w0/delta_1.safetensors") == NULL);  /* empty and unseeded: nothing to find */
    for (int i = 0; i < 300; i++) {
        snprintf(key, sizeof(key), "nodes/w%d/delta_%d.safetensors", i, i);
        seen_entry *e = seen_get(&a, key, &created);
        CHECK(e != NULL && created);
        e->size = (uint64_t)i;
        CHECK(seen_get(&b, key, &created) != NULL && created);
    }
    CHECK(a.seed != 0 && b.seed != 0 && a.seed != b.seed);
    uint64_t seed = a.seed;
    /* the same names, in other slots: the layouts differ */
    size_t same = 0;
    for (size_t i = 0; i < a.cap && i < b.cap; i++)
        same += a.slots[i].key != NULL && b.slots[i].key != NULL && strcmp(a.slots[i].key, b.slots[i].key) == 0;
    CHECK(same < 300);
    CHECK_EQ(seen_prune(&a, keep_even, NULL), 0);
    CHECK_EQ(a.count, 150);
    CHECK(a.seed == seed);
    for (int i = 0; i < 300; i++) {
        snprintf(key, sizeof(key), "nodes/w%d/delta_%d.safetensors", i, i);
        seen_entry *e = seen_find(&a, key);
        CHECK(i % 2 == 0 ? e != NULL && e->size == (uint64_t)i : e == NULL);
    }
    seen_free(&a);
    seen_free(&b);
}

static void touch_file(const char *path)
{
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fd >= 0) {
        if (write(fd, "x", 1) != 1)
            perror(path);
        close(fd);
    }
}

/* Write on one side, apply on the other, and a fresh open reads the same commit back. */
TEST(store_commit_write_apply_and_reopen)
{
    store s = {0}, again = {0};
    dl_error err;

    CHECK_EQ(store_open(&s, test_dir(), "agg", &err), 0);
    CHECK_EQ(s.committed, 0);
    char *g = store_global_path(&s, 3), *m = store_momentum_path(&s, 3);
    touch_file(g);
    touch_file(m);
    store_commit_info info = {.step = 3, .global_path = g, .momentum_path = m, .optimizer = "nesterov_sgd",
                              .lr = 0.7, .momentum = 0.9, .origin = "round",
                              .round_json = "{\"step\":2,\"nodes\":[]}\n"};
    CHECK_EQ(store_commit_write(&s, &info, &err), 0);
    CHECK_EQ(s.committed, 0);                     /* written, not yet recorded in memory */
    CHECK_EQ(store_commit_apply(&s, &info), 0);
    CHECK(s.committed && s.step == 3);
    CHECK_STR(s.global_path, g);
    CHECK_EQ(store_open(&again, test_dir(), "agg", &err), 0);
    CHECK(again.committed && again.step == 3 && again.momentum_path != NULL);
    CHECK_STR(again.round_json, "{\"step\":2,\"nodes\":[]}");
    store_free(&again);
    /* a metadata file that names another step's file is refused */
    char meta[512];
    snprintf(meta, sizeof(meta), "%s/agg/outer_metadata.json", test_dir());
    FILE *f = fopen(meta, "w");
    fputs("{\"outer_step\":3,\"global_file\":\"global/latest-2.safetensors\"}", f);
    fclose(f);
    CHECK(store_open(&again, test_dir(), "agg", &err) != 0);
    store_free(&again);
    store_free(&s);
    free(g);
    free(m);
}

/* Async mode's state: the Delayed Nesterov phase and the accumulator are committed with the step, the
 * redo record's update (k before, the weight) is read back, its deltas may be of older bases (never of a
 * later one), and damaged values are refused. */
TEST(store_async_phase_accumulator_and_redo)
{
    store s = {0}, again = {0};
    dl_error err;
    char dir[600];

    snprintf(dir, sizeof(dir), "%s/async", test_dir());
    CHECK_EQ(store_open(&s, dir, "agg", &err), 0);
    char *g = store_global_path(&s, 5), *a = store_accum_path(&s, 5);
    touch_file(g);
    touch_file(a);
    store_dn dn = {.on = 1, .period = 3, .k = 2, .paper = 1, .c = 0.25};
    uint64_t asum = 0x1234;
    store_commit_info info = {.step = 5, .global_path = g, .optimizer = "nesterov_sgd", .lr = 0.7, .momentum = 0.9,
                              .origin = "round", .accum_path = a, .accum_sum = &asum, .dn = &dn,
                              .round_json = "{\"step\":4,\"mode\":\"async\",\"weight\":0.57735026918962584}\n"};
    CHECK_EQ(store_commit(&s, &info, &err), 0);
    CHECK_EQ(store_open(&again, dir, "agg", &err), 0);
    /* every digit of the record kept (cJSON would print 0.577350269189626) */
    CHECK_STR(again.round_json, "{\"step\":4,\"mode\":\"async\",\"weight\":0.57735026918962584}");
    CHECK(again.dn.on && again.dn.period == 3 && again.dn.k == 2 && again.dn.paper && again.dn.c == 0.25);
    CHECK(again.accum_path != NULL && again.accum_summed && again.accum_sum == 0x1234);
    store_free(&again);

    char old[700], cur[700];
    snprintf(old, sizeof(old), "%s/agg/cache/deltas/s3/w1/delta_10.safetensors", dir);
    snprintf(cur, sizeof(cur), "%s/agg/cache/deltas/s5/w2/delta_20.safetensors", dir);
    char *deltas[2] = {old, cur};
    store_redo r = {.step = 6, .base = 5, .deltas = deltas, .ndeltas = 2, .optimizer = "nesterov_sgd", .lr = 0.7,
                    .momentum = 0.9, .dn = {.on = 1, .period = 3, .k = 2, .paper = 0, .c = 0, .weight = 0.75},
                    .round_json = "{\"step\":5,\"weight\":0.70710678118654757}\n"};
    store_redo back;
    int present;
    CHECK_EQ(store_redo_write(&s, &r, &err), 0);
    CHECK_EQ(store_redo_read(&s, &back, &present, &err), 0);
    CHECK(present && back.dn.on && back.dn.k == 2 && back.dn.weight == 0.75 && back.ndeltas == 2);
    CHECK_STR(back.deltas[0], old);
    CHECK_STR(back.round_json, "{\"step\":5,\"weight\":0.70710678118654757}");
    store_redo_free(&back);
    /* a delta of a later base than the update's, or a sync record naming an older base: damaged */
    char later[700];
    snprintf(later, sizeof(later), "%s/agg/cache/deltas/s6/w2/delta_20.safetensors", dir);
    deltas[1] = later;
    CHECK_EQ(store_redo_write(&s, &r, &err), 0);
    CHECK(store_redo_read(&s, &back, &present, &err) != 0 && err.code == DL_E_METADATA_INVALID);
    deltas[1] = cur;
    r.dn.on = 0;
    CHECK_EQ(store_redo_write(&s, &r, &err), 0);
    CHECK(store_redo_read(&s, &back, &present, &err) != 0);
    /* hand-edited phases: a weight out of (0, 1], an unknown variant */
    char redo[700];
    snprintf(redo, sizeof(redo), "%s/agg/redo.json", dir);
    static const char *const bad[] = {
        "{\"step\":6,\"base_step\":5,\"optimizer\":\"sgd\",\"lr\":1,\"momentum\":0,\"deltas\":"
        "[\"cache/deltas/s5/w2/delta_20.safetensors\"],\"async\":{\"period\":3,\"k\":0,\"variant\":\"forgather\","
        "\"c\":0,\"weight\":2}}",
        "{\"step\":6,\"base_step\":5,\"optimizer\":\"sgd\",\"lr\":1,\"momentum\":0,\"deltas\":"
        "[\"cache/deltas/s5/w2/delta_20.safetensors\"],\"async\":{\"period\":3,\"k\":0,\"variant\":\"adam\","
        "\"c\":0,\"weight\":1}}",
    };
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        FILE *f = fopen(redo, "w");
        fputs(bad[i], f);
        fclose(f);
        CHECK(store_redo_read(&s, &back, &present, &err) != 0 && err.code == DL_E_METADATA_INVALID);
    }
    store_free(&s);
    free(g);
    free(a);
}

TEST(seen_prune_forgets_what_is_no_longer_listed)
{
    seen_map m = {0};
    char key[64];
    int created;

    for (int i = 0; i < 1000; i++) {
        snprintf(key, sizeof(key), "nodes/w/delta_%d.safetensors", i);
        seen_get(&m, key, &created)->size = (uint64_t)i;
    }
    CHECK_EQ(seen_prune(&m, keep_even, NULL), 0);
    CHECK_EQ(m.count, (size_t)500);
    CHECK(m.cap <= 2048);
    for (int i = 0; i < 1000; i++) {
        snprintf(key, sizeof(key), "nodes/w/delta_%d.safetensors", i);
        seen_entry *e = seen_find(&m, key);
        CHECK((e != NULL) == (i % 2 == 0));
    }
    /* the table still takes new keys after a prune */
    CHECK(seen_get(&m, "nodes/x/delta_1.safetensors", &created) != NULL && created);
    CHECK_EQ(m.count, (size_t)501);
    seen_free(&m);
}
