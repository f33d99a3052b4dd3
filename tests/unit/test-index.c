#include "test.h"

#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include "delta.h"
#include "fsutil.h"
#include "st_index.h"
#include "st_reshard.h"

static int parse_code(const char *text, const char *base)
{
    st_index *ix = NULL;
    dl_error err;
    int rc = st_index_parse(text, strlen(text), base, &ix, &err);
    st_index_free(ix);
    return rc == 0 ? 0 : (int)err.code;
}

#define IX(meta, wm) "{\"metadata\": {\"total_size\": 24" meta "}, \"weight_map\": {" wm "}}"
#define S1 "\"d-00001-of-00002.safetensors\""
#define S2 "\"d-00002-of-00002.safetensors\""

TEST(index_parse_valid)
{
    st_index *ix = NULL;
    dl_error err;
    const char *t = IX(", \"node_id\": \"w1\", \"total_parameters\": 6", "\"b\": " S2 ", \"a\": " S1);
    CHECK_EQ(st_index_parse(t, strlen(t), "d", &ix, &err), 0);
    CHECK_EQ(ix->nshards, 2);
    CHECK_EQ(ix->total_size, 24);
    CHECK_EQ(ix->nentries, 2);
    CHECK_STR(ix->entries[0].name, "b");            /* file order kept */
    CHECK_EQ(ix->entries[0].shard, 1);
    CHECK(st_index_find(ix, "a", 1) != NULL && st_index_find(ix, "a", 1)->shard == 0);
    CHECK(st_index_find(ix, "c", 1) == NULL);
    CHECK_STR(st_index_meta(ix, "node_id", NULL), "w1");
    CHECK_STR(st_index_meta(ix, "total_parameters", NULL), "6");
    CHECK(st_index_meta(ix, "total_size", NULL) == NULL);
    st_index_free(ix);
}

TEST(index_parse_hostile)
{
    static const struct { const char *text; int code; } cases[] = {
        {"", DL_E_INVALID_HEADER_DESERIALIZATION},
        {"[]", DL_E_INVALID_HEADER_DESERIALIZATION},
        {"{\"weight_map\": {\"a\": " S1 "}}", DL_E_INVALID_HEADER_DESERIALIZATION},       /* no metadata */
        {"{\"metadata\": {}, \"weight_map\": {\"a\": " S1 "}}", DL_E_INVALID_HEADER_DESERIALIZATION},
        {IX("", ""), DL_E_INVALID_HEADER_DESERIALIZATION},                                 /* empty map */
        {IX("", "\"a\": " S1 ", \"b\": " S2) "x", DL_E_INVALID_HEADER_DESERIALIZATION},    /* trailing */
        {IX(", \"x\": 1.5", "\"a\": " S1 ", \"b\": " S2), DL_E_INVALID_HEADER_DESERIALIZATION},
        {IX(", \"x\": [1]", "\"a\": " S1 ", \"b\": " S2), DL_E_INVALID_HEADER_DESERIALIZATION},
        {IX(", \"x\": null", "\"a\": " S1 ", \"b\": " S2), DL_E_INVALID_HEADER_DESERIALIZATION},
        {"{\"metadata\": {\"total_size\": -1}, \"weight_map\": {\"a\": " S1 ", \"b\": " S2 "}}",
         DL_E_INVALID_HEADER_DESERIALIZATION},
        {"{\"metadata\": {\"total_size\": 2.5}, \"weight_map\": {\"a\": " S1 ", \"b\": " S2 "}}",
         DL_E_INVALID_HEADER_DESERIALIZATION},
        {"{\"metadata\": {\"total_size\": 9007199254740992}, \"weight_map\": {\"a\": " S1 ", \"b\": " S2 "}}",
         DL_E_INVALID_HEADER_DESERIALIZATION},
        {"{\"metadata\": {\"total_size\": \"24\"}, \"weight_map\": {\"a\": " S1 ", \"b\": " S2 "}}",
         DL_E_INVALID_HEADER_DESERIALIZATION},
        {IX("", "\"a\": " S1 ", \"b\": " S2) , 0},
        {"{\"metadata\": {\"total_size\": 24}, \"weight_map\": {\"a\": " S1 ", \"b\": " S2 "}, \"x\": 1}",
         DL_E_INVALID_HEADER_DESERIALIZATION},                                             /* unknown key */
        {IX("", "\"a\": " S1 ", \"a\": " S2), DL_E_DUPLICATE_KEY},
        {IX(", \"total_size\": 24", "\"a\": " S1 ", \"b\": " S2), DL_E_DUPLICATE_KEY},
        {"{\"metadata\": {\"total_size\": 24}, \"metadata\": {\"total_size\": 24}, \"weight_map\": {\"a\": " S1 "}}",
         DL_E_DUPLICATE_KEY},
        {IX("", "\"a\": " S1 ", \"b\": 3"), DL_E_INVALID_HEADER_DESERIALIZATION},
        {IX("", "\"a\": " S1), DL_E_INVALID_PATH},                                         /* shard 2 unused */
        {IX("", "\"a\": " S1 ", \"b\": \"d-00002-of-00003.safetensors\""), DL_E_INVALID_PATH},
        {IX("", "\"a\": " S1 ", \"b\": \"d-00003-of-00002.safetensors\""), DL_E_INVALID_PATH},
        {IX("", "\"a\": " S1 ", \"b\": \"d-00000-of-00002.safetensors\""), DL_E_INVALID_PATH},
        {IX("", "\"a\": " S1 ", \"b\": \"../d-00002-of-00002.safetensors\""), DL_E_INVALID_PATH},
        {IX("", "\"a\": " S1 ", \"b\": \"x/d-00002-of-00002.safetensors\""), DL_E_INVALID_PATH},
        {IX("", "\"a\": " S1 ", \"b\": \"e-00002-of-00002.safetensors\""), DL_E_INVALID_PATH},
        {IX("", "\"a\": " S1 ", \"b\": \"d-2-of-2.safetensors\""), DL_E_INVALID_PATH},
        {IX("", "\"a\": " S1 ", \"b\": \"d-00002-of-00002.bin\""), DL_E_INVALID_PATH},
        {IX("", "\"a\": " S1 ", \"b\": \"d-00002-of-00002.safetensors.tmp\""), DL_E_INVALID_PATH},
        {IX("", "\"a\\u0000x\": " S1 ", \"b\": " S2), DL_E_INVALID_HEADER_DESERIALIZATION},  /* NUL in a name */
        {IX("", "\"a\nx\": " S1 ", \"b\": " S2), DL_E_INVALID_HEADER_DESERIALIZATION},      /* raw control */
        {IX("", "\"a\xff\": " S1 ", \"b\": " S2), DL_E_INVALID_HEADER},                     /* not UTF-8 */
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        int got = parse_code(cases[i].text, "d");
        if (got != cases[i].code)
            fprintf(stderr, "  case %zu: %s\n", i, cases[i].text);
        CHECK_EQ(got, cases[i].code);
    }
    CHECK_EQ(parse_code(IX("", "\"a\": " S1 ", \"b\": " S2), "../d"), DL_E_INVALID_ARGUMENT);
}

TEST(index_size_cap)
{
    size_t n = ST_INDEX_MAX_BYTES + 1;
    char *big = malloc(n + 1);
    st_index *ix = NULL;
    dl_error err;
    CHECK(big != NULL);
    memset(big, ' ', n);
    big[n] = '\0';
    CHECK_EQ(st_index_parse(big, n, "d", &ix, &err), -DL_E_HEADER_TOO_LARGE);
    CHECK(ix == NULL);
    /* a file over the cap is refused before it is parsed */
    CHECK_EQ(fsu_write_atomic(test_path("d.safetensors.index.json"), big, n, &err), 0);
    CHECK_EQ(st_index_load(test_path("d.safetensors.index.json"), &ix, &err), -DL_E_HEADER_TOO_LARGE);
    free(big);
    /* the name must follow the convention */
    CHECK_EQ(st_index_load(test_path("d.json"), &ix, &err), -DL_E_INVALID_PATH);
}

TEST(names)
{
    char buf[64], base[ST_INDEX_BASE_MAX + 1];
    uint32_t i, n;
    CHECK_EQ(st_index_shard_name("latest", 0, 3, buf, sizeof(buf)), 0);
    CHECK_STR(buf, "latest-00001-of-00003.safetensors");
    CHECK_EQ(st_index_shard_name("latest", 3, 3, buf, sizeof(buf)), -1);
    CHECK_EQ(st_index_shard_name("latest", 0, 100000, buf, sizeof(buf)), -1);
    CHECK_EQ(st_index_parse_shard_name("latest-00002-of-00003.safetensors", 33, "latest", &i, &n), 0);
    CHECK(i == 1 && n == 3);
    CHECK_EQ(st_index_parse_shard_name("latest-00002-of-00003.safetensors", 33, "late", &i, &n), -1);
    CHECK_EQ(st_index_classify("delta_5.safetensors", 19, base, &i, &n), ST_NAME_SINGLE);
    CHECK_STR(base, "delta_5");
    CHECK_EQ(st_index_classify("delta_5.safetensors.index.json", 30, base, &i, &n), ST_NAME_INDEX);
    CHECK_EQ(st_index_classify("delta_5-00001-of-00002.safetensors", 34, base, &i, &n), ST_NAME_SHARD);
    CHECK_STR(base, "delta_5");
    CHECK_EQ(st_index_classify("delta_5.bin", 11, base, &i, &n), ST_NAME_OTHER);
    CHECK_EQ(st_index_classify(".safetensors", 12, base, &i, &n), ST_NAME_OTHER);

    delta_path p;
    dl_error err;
    CHECK_EQ(delta_parse_any_path("nodes/w1/delta_5-00002-of-00003.safetensors", &p, &err), 0);
    CHECK(p.kind == DELTA_PATH_SHARD && p.shard == 1 && p.nshards == 3 && p.local_step == 5);
    CHECK_STR(p.node_id, "w1");
    CHECK_EQ(delta_parse_any_path("nodes/w1/delta_7.safetensors.index.json", &p, &err), 0);
    CHECK(p.kind == DELTA_PATH_INDEX && p.local_step == 7);
    CHECK_EQ(delta_parse_any_path("nodes/w1/delta_07.safetensors.index.json", &p, &err), -DL_E_INVALID_PATH);
    CHECK_EQ(delta_parse_any_path("nodes/w1/model-00001-of-00002.safetensors", &p, &err), -DL_E_INVALID_PATH);
    CHECK_EQ(delta_parse_any_path("nodes/../delta_5.safetensors", &p, &err), -DL_E_INVALID_PATH);
}

TEST(sizes)
{
    uint64_t v;
    CHECK(st_parse_size("5GB", &v) == 0 && v == 5000000000ULL);
    CHECK(st_parse_size("1.5MB", &v) == 0 && v == 1500000);
    CHECK(st_parse_size("40kb", &v) == 0 && v == 40000);
    CHECK(st_parse_size("123", &v) == 0 && v == 123);
    CHECK(st_parse_size("0", &v) == 0 && v == 0);
    CHECK(st_parse_size("", &v) != 0);
    CHECK(st_parse_size("GB", &v) != 0);
    CHECK(st_parse_size("-1GB", &v) != 0);
    CHECK(st_parse_size("5 XB", &v) != 0);
    CHECK(st_parse_size("1e30TB", &v) != 0);
    CHECK(st_parse_size("99999999999999999999", &v) != 0);
}

/* A cluster's plan: exactly S contiguous shards of whole tensors, about equal bytes, every shard non-empty
 * even when one tensor is most of the model; fewer tensors than shards is refused. */
TEST(plan_even_cuts_exactly_s_shards)
{
    static const uint64_t s4[] = {1}, s40[] = {10}, s400[] = {100};
    st_spec specs[] = {{"a", 1, ST_F32, 1, s4}, {"b", 1, ST_F32, 1, s4}, {"c", 1, ST_F32, 1, s4},
                       {"d", 1, ST_F32, 1, s4}, {"e", 1, ST_F32, 1, s4}, {"f", 1, ST_F32, 1, s4}};
    uint32_t shard_of[6];
    dl_error err;
    CHECK_EQ(st_index_plan_even(specs, 6, 3, shard_of, &err), 0);
    for (int i = 0; i < 6; i++)
        CHECK_EQ(shard_of[i], (uint32_t)(i / 2));
    CHECK_EQ(st_index_plan_even(specs, 6, 6, shard_of, &err), 0);
    for (int i = 0; i < 6; i++)
        CHECK_EQ(shard_of[i], (uint32_t)i);
    CHECK_EQ(st_index_plan_even(specs, 6, 1, shard_of, &err), 0);
    for (int i = 0; i < 6; i++)
        CHECK_EQ(shard_of[i], 0);
    CHECK(st_index_plan_even(specs, 6, 7, shard_of, &err) != 0);
    CHECK(st_index_plan_even(specs, 6, 0, shard_of, &err) != 0);
    /* one big tensor first: a shard of its own; the cut falls once the bytes reach each k/S of the total */
    st_spec big[] = {{"a", 1, ST_F32, 1, s400}, {"b", 1, ST_F32, 1, s40}, {"c", 1, ST_F32, 1, s4},
                     {"d", 1, ST_F32, 1, s4}};
    CHECK_EQ(st_index_plan_even(big, 4, 3, shard_of, &err), 0);
    CHECK(shard_of[0] == 0 && shard_of[1] == 1 && shard_of[2] == 2 && shard_of[3] == 2);
    /* contiguous and non-decreasing, ending at S - 1 */
    CHECK_EQ(st_index_plan_even(big, 4, 4, shard_of, &err), 0);
    CHECK(shard_of[0] == 0 && shard_of[1] == 1 && shard_of[2] == 2 && shard_of[3] == 3);
}

/* huggingface_hub's split: a tensor over the limit gets its own shard at once, numbered before the
 * shard still being filled (sizes 4, 16(big), 4, 4, 4 with limit 10 -> [big], [a, c], [d, e]). */
TEST(plan_matches_huggingface_hub)
{
    static const uint64_t s4[] = {1}, s16[] = {4};
    st_spec specs[] = {{"a", 1, ST_F32, 1, s4}, {"big", 3, ST_F32, 1, s16}, {"c", 1, ST_F32, 1, s4},
                       {"d", 1, ST_F32, 1, s4}, {"e", 1, ST_F32, 1, s4}};
    uint32_t shard_of[5], n;
    dl_error err;
    CHECK_EQ(st_index_plan(specs, 5, 10, shard_of, &n, &err), 0);
    CHECK_EQ(n, 3);
    CHECK_EQ(shard_of[1], 0);
    CHECK(shard_of[0] == 1 && shard_of[2] == 1);
    CHECK(shard_of[3] == 2 && shard_of[4] == 2);
    CHECK_EQ(st_index_plan(specs, 5, 0, shard_of, &n, &err), 0);
    CHECK_EQ(n, 1);
    CHECK_EQ(st_index_plan(specs, 5, 100, shard_of, &n, &err), 0);
    CHECK_EQ(n, 1);
    /* d glued to c: the pair is split as one 8-byte item, so [big], [a], [c, d], [e] */
    unsigned char glue[5] = {0, 0, 0, 1, 0};
    CHECK_EQ(st_index_plan_glued(specs, 5, glue, 10, shard_of, &n, &err), 0);
    CHECK_EQ(shard_of[2], shard_of[3]);                  /* c and d together */
    CHECK(shard_of[0] != shard_of[2]);                   /* a (4) + c, d (8) > 10 */
    CHECK_EQ(n, 4);

    size_t len;
    st_kv meta[] = {{"node_id", "w\xc3\xa9\"1"}};
    char *json = st_index_build_json("d", specs, 5, (uint32_t[]){1, 0, 1, 2, 2}, 3, meta, 1, &len);
    CHECK(json != NULL);
    CHECK_STR(json, "{\n  \"metadata\": {\n    \"total_size\": 32,\n    \"node_id\": \"w\\u00e9\\\"1\"\n  },\n"
                    "  \"weight_map\": {\n    \"big\": \"d-00001-of-00003.safetensors\",\n"
                    "    \"a\": \"d-00002-of-00003.safetensors\",\n    \"c\": \"d-00002-of-00003.safetensors\",\n"
                    "    \"d\": \"d-00003-of-00003.safetensors\",\n    \"e\": \"d-00003-of-00003.safetensors\"\n  }\n}");
    free(json);
}

/* Writes a 3-tensor delta as a set of 2 shards through the writer, then reads it back as a set. */
static int write_set(const char *path, uint64_t shard_size)
{
    static const uint64_t shape[] = {2};
    static const float a[] = {1, 2}, b[] = {3, 4}, c[] = {5, 6};
    st_spec specs[] = {{"w.a", 3, ST_F32, 1, shape}, {"w.b", 3, ST_F32, 1, shape}, {"w.c", 3, ST_F32, 1, shape}};
    const float *data[] = {a, b, c};
    st_kv meta[] = {{"algorithm", DELTA_ALGORITHM}, {"base_outer_step", "3"}, {"local_step", "5"}, {"node_id", "w1"}};
    st_set_writer *w;
    dl_error err;
    if (st_set_writer_open(path, specs, 3, meta, 4, shard_size, &w, &err) != 0)
        return -1;
    for (size_t i = 0; i < 3; i++) {
        if (st_set_writer_write(w, i, 0, data[i], 8, &err) != 0) {
            st_set_writer_abort(w);
            return -1;
        }
    }
    return st_set_writer_commit(w, &err);
}

TEST(writer_and_set_view)
{
    char path[512], index[512];
    st_set *s = NULL;
    dl_error err;
    float got[2];
    uint32_t file;
    snprintf(path, sizeof(path), "%s", test_path("delta_5.safetensors"));
    snprintf(index, sizeof(index), "%s", test_path("delta_5.safetensors.index.json"));
    CHECK_EQ(write_set(path, 16), 0);              /* 8 bytes each: two per shard */
    CHECK_EQ(access(path, F_OK), -1);
    CHECK_EQ(st_set_open(index, &s, &err), 0);
    CHECK_EQ(s->nfiles, 2);
    CHECK_EQ(s->ntensors, 3);
    CHECK_EQ(s->data_bytes, 24);
    const st_tensor *t = st_set_find(s, "w.c", 3, &file);
    CHECK(t != NULL);
    CHECK_EQ(file, 1);
    CHECK_EQ(st_set_read(s, file, t, 0, got, 8, &err), 0);
    CHECK(got[0] == 5 && got[1] == 6);
    CHECK_EQ(s->files[0]->h->nmeta, 1);            /* shards carry {"format": "pt"} only */
    delta_info info;
    CHECK_EQ(delta_validate_set(s, s->by_name, s->ntensors, "nodes/w1/delta_5.safetensors.index.json", &info, &err), 0);
    CHECK_EQ(info.local_step, 5);
    CHECK_EQ(delta_check_set_header(s, s->by_name, s->ntensors, "nodes/w2/delta_5.safetensors.index.json", &info,
                                    &err), -DL_E_PATH_MISMATCH);
    CHECK_EQ(delta_check_set_header(s, s->by_name, s->ntensors, "nodes/w1/delta_5-00001-of-00002.safetensors", &info,
                                    &err), -DL_E_INVALID_PATH);
    /* each shard on its own is a subset of the floating keys */
    CHECK_EQ(delta_check_shard_header(s->files[1]->h, s->by_name, s->ntensors, NULL, &err), 0);
    CHECK_EQ(delta_check_shard_header(s->files[1]->h, s->by_name, 2, NULL, &err), -DL_E_KEY_MISMATCH);
    st_set_close(s);
    /* writing the plain file replaces the set */
    CHECK_EQ(write_set(path, 0), 0);
    CHECK_EQ(access(index, F_OK), -1);
    CHECK_EQ(access(test_path("delta_5-00001-of-00002.safetensors"), F_OK), -1);
    CHECK_EQ(st_set_open(path, &s, &err), 0);
    CHECK(s->index == NULL && s->nfiles == 1 && s->ntensors == 3);
    st_set_close(s);
}

/* The index at path with n spaces after its opening brace: the same index, n bytes longer. */
static int pad_index(const char *path, size_t n)
{
    char *text = malloc(ST_INDEX_MAX_BYTES), *padded;
    FILE *f = fopen(path, "rb");
    size_t len = f ? fread(text, 1, ST_INDEX_MAX_BYTES, f) : 0;
    dl_error err;
    int rc = -1;

    if (f != NULL)
        fclose(f);
    if (text != NULL && len > 1 && text[0] == '{' && (padded = malloc(len + n)) != NULL) {
        padded[0] = '{';
        memset(padded + 1, ' ', n);
        memcpy(padded + 1 + n, text + 1, len - 1);
        rc = fsu_write_atomic(path, padded, len + n, &err);
        free(padded);
    }
    free(text);
    return rc;
}

/* Issue 21 item 9c: another writer's set (an adopted global) is opened with its headers capped:
 * each shard from its 8-byte prefix, the shards' headers together at the one cap (a delta set's
 * budget), the index at 6 x the cap + 64 KiB; st_reshard passes the cap on and writes nothing when
 * it refuses. */
TEST(set_open_capped)
{
    char path[512], index[512], out[512];
    const char *second = "delta_5-00002-of-00002.safetensors";
    st_set *s = NULL;
    dl_error err;
    uint64_t h0, h1;
    snprintf(path, sizeof(path), "%s", test_path("delta_5.safetensors"));
    snprintf(index, sizeof(index), "%s", test_path("delta_5.safetensors.index.json"));
    snprintf(out, sizeof(out), "%s", test_path("one.safetensors"));
    CHECK_EQ(write_set(path, 16), 0);
    CHECK_EQ(st_set_open(index, &s, &err), 0);
    CHECK_EQ(s->nfiles, 2);
    h0 = s->files[0]->data_start - 8;
    h1 = s->files[1]->data_start - 8;
    st_set_close(s);

    CHECK_EQ(st_set_open_capped(index, h0 + h1, &s, &err), 0);      /* together, exactly the cap */
    CHECK_EQ(s->ntensors, 3);
    st_set_close(s);
    s = NULL;
    /* each shard alone fits, the second not in what the first left: refused before it is read */
    CHECK_EQ(st_set_open_capped(index, h0 + h1 - 1, &s, &err), -DL_E_HEADER_TOO_LARGE);
    CHECK(s == NULL);
    CHECK(strstr(err.message, second) != NULL);
    CHECK(strstr(err.message, "headers together (max_delta_header_mib)") != NULL);
    CHECK_EQ(st_set_open_capped(index, h0, &s, &err), -DL_E_HEADER_TOO_LARGE);   /* nothing left */
    CHECK(strstr(err.message, "hold the whole") != NULL && strstr(err.message, second) != NULL);
    /* a shard over the cap on its own: st_open_capped's message, naming that shard */
    CHECK_EQ(st_set_open_capped(index, (h0 < h1 ? h0 : h1) - 1, &s, &err), -DL_E_HEADER_TOO_LARGE);
    CHECK(strstr(err.message, "the cap is") != NULL);
    CHECK(strstr(err.message, "-00001-of-00002.safetensors") != NULL);

    /* st_reshard: the cap reaches the source; a refusal leaves no output */
    CHECK_EQ(st_reshard(index, h0 + h1 - 1, out, 0, NULL, 0, NULL, &err), -DL_E_HEADER_TOO_LARGE);
    CHECK_EQ(access(out, F_OK), -1);
    CHECK_EQ(st_reshard(index, h0 + h1, out, 0, NULL, 0, NULL, &err), 0);
    CHECK_EQ(st_set_open(out, &s, &err), 0);
    CHECK(s->index == NULL && s->ntensors == 3);
    uint64_t h = s->files[0]->data_start - 8;
    st_set_close(s);
    CHECK_EQ(st_set_open_capped(out, h, &s, &err), 0);              /* one file: st_open_capped */
    st_set_close(s);
    CHECK_EQ(st_set_open_capped(out, 16, &s, &err), -DL_E_HEADER_TOO_LARGE);
    CHECK(strstr(err.message, "the cap is 16") != NULL);

    /* the index: 6 x the cap + 64 KiB; one byte more is refused from its size, unread (uncapped, it
     * is the same index and opens) */
    uint64_t index_cap = 6 * (h0 + h1) + 64 * 1024;
    struct stat sb;
    CHECK_EQ(stat(index, &sb), 0);
    CHECK_EQ(pad_index(index, index_cap + 1 - (size_t)sb.st_size), 0);
    CHECK_EQ(st_set_open_capped(index, h0 + h1, &s, &err), -DL_E_HEADER_TOO_LARGE);
    CHECK(strstr(err.message, "index of") != NULL);
    CHECK_EQ(st_set_open(index, &s, &err), 0);
    st_set_close(s);
    CHECK_EQ(write_set(path, 16), 0);      /* the set again, its index padded to exactly the cap */
    CHECK_EQ(stat(index, &sb), 0);
    CHECK_EQ(pad_index(index, index_cap - (size_t)sb.st_size), 0);
    CHECK_EQ(st_set_open_capped(index, h0 + h1, &s, &err), 0);
    st_set_close(s);
}

TEST(check_set_hostile)
{
    char path[512];
    st_set *s = NULL;
    st_index *ix = NULL;
    dl_error err;
    snprintf(path, sizeof(path), "%s", test_path("delta_5.safetensors"));
    CHECK_EQ(write_set(path, 16), 0);
    CHECK_EQ(st_set_open(test_path("delta_5.safetensors.index.json"), &s, &err), 0);
    const st_header *h[2] = {s->files[0]->h, s->files[1]->h};
    const char *variants[][2] = {
        /* total_size off */
        {"{\"metadata\": {\"total_size\": 23}, \"weight_map\": {\"w.a\": \"delta_5-00001-of-00002.safetensors\", "
         "\"w.b\": \"delta_5-00001-of-00002.safetensors\", \"w.c\": \"delta_5-00002-of-00002.safetensors\"}}",
         "total_size"},
        /* a tensor listed in the wrong shard */
        {"{\"metadata\": {\"total_size\": 24}, \"weight_map\": {\"w.a\": \"delta_5-00002-of-00002.safetensors\", "
         "\"w.b\": \"delta_5-00001-of-00002.safetensors\", \"w.c\": \"delta_5-00002-of-00002.safetensors\"}}",
         "lists the tensor in"},
        /* a tensor the index does not list */
        {"{\"metadata\": {\"total_size\": 24}, \"weight_map\": {\"w.a\": \"delta_5-00001-of-00002.safetensors\", "
         "\"w.c\": \"delta_5-00002-of-00002.safetensors\"}}",
         "does not list"},
        /* a tensor listed that no shard holds */
        {"{\"metadata\": {\"total_size\": 24}, \"weight_map\": {\"w.a\": \"delta_5-00001-of-00002.safetensors\", "
         "\"w.b\": \"delta_5-00001-of-00002.safetensors\", \"w.c\": \"delta_5-00002-of-00002.safetensors\", "
         "\"w.d\": \"delta_5-00002-of-00002.safetensors\"}}",
         "does not hold"},
    };
    for (size_t i = 0; i < sizeof(variants) / sizeof(variants[0]); i++) {
        CHECK_EQ(st_index_parse(variants[i][0], strlen(variants[i][0]), "delta_5", &ix, &err), 0);
        CHECK(st_index_check_set(ix, h, &err) != 0);
        CHECK(strstr(err.message, variants[i][1]) != NULL);
        st_index_free(ix);
        ix = NULL;
    }
    /* a tensor in two shards */
    const st_header *twice[2] = {s->files[0]->h, s->files[0]->h};
    CHECK(st_index_check_set(s->index, twice, &err) != 0);
    CHECK(strstr(err.message, "two shards") != NULL);
    /* a stray shard of another count in a listing */
    const char *names[] = {"delta_5-00001-of-00002.safetensors", "delta_5-00003-of-00003.safetensors"};
    CHECK_EQ(st_index_check_listing(s->index, names, 1, &err), 0);
    CHECK_EQ(st_index_check_listing(s->index, names, 2, &err), -DL_E_KEY_MISMATCH);
    st_set_close(s);
}

/* Issue 21 item 5: shapes an attacker sends to make a tree-building parser allocate ~40 bytes per
 * input byte.  Each is refused at its first byte that the schema has no place for (the error names
 * a byte offset near the start), however long the rest is. */
TEST(index_parse_hostile_shapes)
{
    static const char *const heads[] = {
        "{\"metadata\": {\"total_size\": 0, \"x\": [",        /* an array in metadata */
        "{\"metadata\": {\"total_size\": 0, \"x\": {\"y\": ", /* nesting in metadata */
        "{\"metadata\": {\"total_size\": 0, \"x\": true",
        "{\"weight_map\": {\"a\": [",                         /* an array for a shard name */
        "{\"weight_map\": {\"a\": {",
        "{\"x\": [",                                          /* an unknown key */
        "[",
    };
    size_t n = ST_INDEX_MAX_BYTES - 16;
    char *big = malloc(n + 1);
    CHECK(big != NULL);
    for (size_t h = 0; h < sizeof(heads) / sizeof(heads[0]); h++) {
        size_t hl = strlen(heads[h]);
        st_index *ix = NULL;
        dl_error err;
        memcpy(big, heads[h], hl);
        for (size_t i = hl; i < n; i += 2)
            memcpy(big + i, "0,", 2);
        big[n] = '\0';
        CHECK_EQ(st_index_parse(big, n, "d", &ix, &err), -DL_E_INVALID_HEADER_DESERIALIZATION);
        CHECK(ix == NULL);
    }
    free(big);
    /* ensure_ascii escapes (json.dump's default), surrogate pairs, "/" escaped, indent=2 */
    {
        const char *t = "{\n  \"metadata\": {\n    \"total_size\": 24,\n    \"note\": \"\\u00e9\\ud83d\\ude00\\/\"\n  },\n"
                        "  \"weight_map\": {\n    \"\\u00e9\": \"d-00001-of-00001.safetensors\"\n  }\n}\n";
        st_index *ix = NULL;
        dl_error err;
        CHECK_EQ(st_index_parse(t, strlen(t), "d", &ix, &err), 0);
        CHECK_STR(ix->entries[0].name, "\xc3\xa9");
        CHECK_STR(st_index_meta(ix, "note", NULL), "\xc3\xa9\xf0\x9f\x98\x80/");
        st_index_free(ix);
    }
    static const char *const bad[] = {
        IX(", \"n\": \"\\ud83d\"", "\"a\": " S1 ", \"b\": " S2),        /* lone leading surrogate */
        IX(", \"n\": \"\\ude00\"", "\"a\": " S1 ", \"b\": " S2),        /* lone trailing surrogate */
        IX(", \"n\": \"\\x\"", "\"a\": " S1 ", \"b\": " S2),            /* unknown escape */
        IX(", \"n\": 01", "\"a\": " S1 ", \"b\": " S2),                 /* leading zero */
        IX(", \"n\": 1e999", "\"a\": " S1 ", \"b\": " S2),
        IX(", \"n\": 12345678901234567890123456789012345678901", "\"a\": " S1 ", \"b\": " S2),
        IX(", \"n\": \"unterminated", ""),
        "{\"metadata\": {\"total_size\": 24} \"weight_map\": {}}",    /* no comma */
        "{\"metadata\": {\"total_size\": 24}, \"weight_map\": {\"a\": " S1 " \"b\": " S2 "}}",
        IX("", "\"a\": " S1 ", \"b\": " S2 ","),                        /* trailing comma */
    };
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        int got = parse_code(bad[i], "d");
        if (got != DL_E_INVALID_HEADER_DESERIALIZATION)
            fprintf(stderr, "  case %zu: %s\n", i, bad[i]);
        CHECK_EQ(got, DL_E_INVALID_HEADER_DESERIALIZATION);
    }
    /* integral numbers written as floats are read as before (cJSON read them as doubles) */
    CHECK_EQ(parse_code("{\"metadata\": {\"total_size\": 24.0}, \"weight_map\": {\"a\": " S1 ", \"b\": " S2 "}}", "d"),
             0);
    /* a tighter cap */
    {
        const char *t = IX("", "\"a\": " S1 ", \"b\": " S2);
        st_index *ix = NULL;
        dl_error err;
        CHECK_EQ(st_index_parse_capped(t, strlen(t), "d", 16, &ix, &err), -DL_E_HEADER_TOO_LARGE);
        CHECK_EQ(st_index_parse_capped(t, strlen(t), "d", strlen(t), &ix, &err), 0);
        st_index_free(ix);
    }
}
