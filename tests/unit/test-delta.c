#include "test.h"

#include <math.h>
#include <stdlib.h>

#include "delta.h"

/* What a log line or an error shows of a hostile string: controls escaped, C0, DEL and C1 alike. */
TEST(printable_escapes_controls)
{
    char out[64];
    dl_printable(out, sizeof(out), "a\x1b[2J\xc2\x9b" "31m\xc2\x85\xc2\xa0\\", 15);
    CHECK_STR(out, "a\\u001b[2J\\u009b31m\\u0085\xc2\xa0\\\\");
}

TEST(node_ids)
{
    CHECK(delta_valid_node_id("worker-1", 8));
    CHECK(delta_valid_node_id("a.b_c-D9", 8));
    CHECK(delta_valid_node_id("...", 3));
    CHECK(!delta_valid_node_id(".", 1));
    CHECK(!delta_valid_node_id("..", 2));
    CHECK(!delta_valid_node_id("", 0));
    CHECK(!delta_valid_node_id("a b", 3));
    CHECK(!delta_valid_node_id("a/b", 3));
    CHECK(!delta_valid_node_id("a\0b", 3));
    char id[66];
    memset(id, 'x', 65);
    CHECK(delta_valid_node_id(id, 64));
    CHECK(!delta_valid_node_id(id, 65));
}

TEST(canonical_integers)
{
    uint64_t v;
    CHECK(delta_parse_int("0", 1, &v) == 0 && v == 0);
    CHECK(delta_parse_int("500", 3, &v) == 0 && v == 500);
    CHECK(delta_parse_int("9007199254740991", 16, &v) == 0 && v == DELTA_INT_MAX);
    CHECK(delta_parse_int("9007199254740992", 16, &v) != 0);
    CHECK(delta_parse_int("05", 2, &v) != 0);
    CHECK(delta_parse_int("+5", 2, &v) != 0);
    CHECK(delta_parse_int("-1", 2, &v) != 0);
    CHECK(delta_parse_int(" 5", 2, &v) != 0);
    CHECK(delta_parse_int("5_0", 3, &v) != 0);
    CHECK(delta_parse_int("", 0, &v) != 0);
    CHECK(delta_parse_int("99999999999999999999", 20, &v) != 0);
}

TEST(delta_paths)
{
    static const struct { const char *path; int ok; const char *id; uint64_t step; } cases[] = {
        {"nodes/worker-1/delta_500.safetensors", 1, "worker-1", 500},
        {"nodes/m/delta_0.safetensors", 1, "m", 0},
        {"nodes/worker-1/delta_500.safetensors.tmp", 0, NULL, 0},
        {"nodes/worker-1/x/delta_500.safetensors", 0, NULL, 0},
        {"/nodes/worker-1/delta_500.safetensors", 0, NULL, 0},
        {"nodes//delta_500.safetensors", 0, NULL, 0},
        {"nodes/../delta_500.safetensors", 0, NULL, 0},
        {"nodes/./delta_500.safetensors", 0, NULL, 0},
        {"nodes/w/delta_.safetensors", 0, NULL, 0},
        {"nodes/w/delta_+5.safetensors", 0, NULL, 0},
        {"nodes/w/delta_05.safetensors", 0, NULL, 0},
        {"nodes/w/delta_-1.safetensors", 0, NULL, 0},
        {"nodes/w/Delta_5.safetensors", 0, NULL, 0},
        {"nodes/w/delta_5", 0, NULL, 0},
        {"global/latest.safetensors", 0, NULL, 0},
        {"nodes/w", 0, NULL, 0},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        char id[DELTA_NODE_ID_MAX + 1];
        uint64_t step = 99;
        dl_error err;
        int rc = delta_parse_path(cases[i].path, id, &step, &err);
        if ((rc == 0) != cases[i].ok)
            fprintf(stderr, "  path %s\n", cases[i].path);
        CHECK_EQ(rc == 0, cases[i].ok);
        if (cases[i].ok) {
            CHECK_STR(id, cases[i].id);
            CHECK_EQ(step, cases[i].step);
        } else {
            CHECK_EQ(err.code, DL_E_INVALID_PATH);
        }
    }
}

static st_header *header(const char *json, size_t data_len)
{
    st_header *h = NULL;
    dl_error err;
    if (st_header_parse(json, strlen(json), 8 + strlen(json) + data_len, &h, &err) != 0)
        fprintf(stderr, "  bad test header: %s\n", err.message);
    return h;
}

#define GLOBAL "{\"w\":{\"dtype\":\"BF16\",\"shape\":[2],\"data_offsets\":[0,4]}," \
               "\"z\":{\"dtype\":\"C64\",\"shape\":[],\"data_offsets\":[4,12]}," \
               "\"n\":{\"dtype\":\"I64\",\"shape\":[],\"data_offsets\":[12,20]}}"
#define META(b, l, id) "\"__metadata__\":{\"algorithm\":\"dumb_diloco\",\"base_outer_step\":\"" b \
                       "\",\"local_step\":\"" l "\",\"node_id\":\"" id "\"}"
#define W(dt, n, b, e) "\"w\":{\"dtype\":\"" dt "\",\"shape\":[" n "],\"data_offsets\":[" b "," e "]}"
#define Z(dt) "\"z\":{\"dtype\":\"" dt "\",\"shape\":[],\"data_offsets\":[8,16]}"

static int check_code(const char *delta_json, size_t data_len, const char *path)
{
    st_header *g = header(GLOBAL, 20), *d = header(delta_json, data_len);
    dl_error err;
    delta_info info;
    int rc;
    if (g == NULL || d == NULL) {
        st_header_free(g);
        st_header_free(d);
        return -1;
    }
    rc = delta_check_header(d, g, path, &info, &err);
    st_header_free(g);
    st_header_free(d);
    return rc == 0 ? 0 : (int)err.code;
}

TEST(check_header_codes)
{
    const char *p = "nodes/w1/delta_5.safetensors";
    CHECK_EQ(check_code("{" META("3", "5", "w1") "," W("F32", "2", "0", "8") "," Z("C64") "}", 16, p), 0);
    CHECK_EQ(check_code("{" META("3", "5", "w1") "," W("F16", "2", "0", "4") ","
                        "\"z\":{\"dtype\":\"C64\",\"shape\":[],\"data_offsets\":[4,12]}}", 12, NULL), 0);
    /* key set */
    CHECK_EQ(check_code("{" META("3", "5", "w1") "," W("F32", "2", "0", "8") "}", 8, p), DL_E_KEY_MISMATCH);
    CHECK_EQ(check_code("{" META("3", "5", "w1") "," W("F32", "2", "0", "8") "," Z("C64") ","
                        "\"n\":{\"dtype\":\"I64\",\"shape\":[],\"data_offsets\":[16,24]}}", 24, p),
             DL_E_KEY_MISMATCH);
    CHECK_EQ(check_code("{" META("3", "5", "w1") "," W("F32", "2", "0", "8") "," Z("C64") ","
                        "\"q\":{\"dtype\":\"F32\",\"shape\":[],\"data_offsets\":[16,20]}}", 20, p),
             DL_E_KEY_MISMATCH);
    /* shape and dtype */
    CHECK_EQ(check_code("{" META("3", "5", "w1") "," W("F32", "1,2", "0", "8") "," Z("C64") "}", 16, p),
             DL_E_SHAPE_MISMATCH);
    CHECK_EQ(check_code("{" META("3", "5", "w1") "," W("F64", "1", "0", "8") "," Z("C64") "}", 16, p),
             DL_E_SHAPE_MISMATCH);
    CHECK_EQ(check_code("{" META("3", "5", "w1") "," W("I32", "2", "0", "8") "," Z("C64") "}", 16, p),
             DL_E_DTYPE_MISMATCH);
    CHECK_EQ(check_code("{" META("3", "5", "w1") "," W("F32", "2", "0", "8") "," Z("F64") "}", 16, p),
             DL_E_DTYPE_MISMATCH);
    /* metadata */
    CHECK_EQ(check_code("{" W("F32", "2", "0", "8") "," Z("C64") "}", 16, p), DL_E_METADATA_MISSING);
    CHECK_EQ(check_code("{" META("03", "5", "w1") "," W("F32", "2", "0", "8") "," Z("C64") "}", 16, p),
             DL_E_METADATA_INVALID);
    CHECK_EQ(check_code("{" META("3", "5", "w 1") "," W("F32", "2", "0", "8") "," Z("C64") "}", 16, NULL),
             DL_E_METADATA_INVALID);
    CHECK_EQ(check_code("{\"__metadata__\":{\"algorithm\":\"other\",\"base_outer_step\":\"1\",\"local_step\":\"5\","
                        "\"node_id\":\"w1\"}," W("F32", "2", "0", "8") "," Z("C64") "}", 16, p),
             DL_E_METADATA_INVALID);
    /* path */
    CHECK_EQ(check_code("{" META("3", "6", "w1") "," W("F32", "2", "0", "8") "," Z("C64") "}", 16, p),
             DL_E_PATH_MISMATCH);
    CHECK_EQ(check_code("{" META("3", "5", "w2") "," W("F32", "2", "0", "8") "," Z("C64") "}", 16, p),
             DL_E_PATH_MISMATCH);
    CHECK_EQ(check_code("{" META("3", "5", "w1") "," W("F32", "2", "0", "8") "," Z("C64") "}", 16, "nodes/w1/x"),
             DL_E_INVALID_PATH);
}

TEST(non_finite_scan)
{
    float f[4] = {1, 2, NAN, 3};
    uint16_t h[3] = {0x3c00, 0x7c00, 0};
    uint16_t b[3] = {0x3f80, 0x0000, 0xff80};
    CHECK_EQ(delta_find_non_finite(ST_F32, f, 4), 2);
    CHECK_EQ(delta_find_non_finite(ST_F32, f, 2), -1);
    CHECK_EQ(delta_find_non_finite(ST_C64, f, 2), 1);
    CHECK_EQ(delta_find_non_finite(ST_F16, h, 3), 1);
    CHECK_EQ(delta_find_non_finite(ST_BF16, b, 3), 2);
    f[2] = -INFINITY;
    CHECK_EQ(delta_find_non_finite(ST_F32, f, 4), 2);
}

/* A delta's values: finite and of magnitude below 2^64 (delta.h); the output check stays finiteness. */
TEST(bad_value_bound)
{
    float f[5] = {1, -0x1.fffffep63f, 3e38f, 5, -0x1p64f};
    CHECK_EQ(delta_find_bad_value(ST_F32, f, 2), -1);       /* the largest F32 below 2^64, negated */
    CHECK_EQ(delta_find_bad_value(ST_F32, f, 5), 2);        /* finite, near F32's limit */
    CHECK_EQ(delta_find_non_finite(ST_F32, f, 5), -1);
    f[2] = 0;
    CHECK_EQ(delta_find_bad_value(ST_F32, f, 5), 4);        /* exactly -2^64 */
    CHECK_EQ(delta_find_bad_value(ST_C64, f, 2), -1);
    f[1] = NAN;
    CHECK_EQ(delta_find_bad_value(ST_C64, f, 2), 0);        /* the first complex element holds the NaN */
    uint16_t b[3] = {0x5f7f, 0xdf7f, 0x5f80};               /* BF16: below 2^64, its negation, 2^64 */
    CHECK_EQ(delta_find_bad_value(ST_BF16, b, 2), -1);
    CHECK_EQ(delta_find_bad_value(ST_BF16, b, 3), 2);
    uint16_t h[3] = {0x7bff, 0xfbff, 0xfc00};               /* F16: 65504, -65504, -Inf */
    CHECK_EQ(delta_find_bad_value(ST_F16, h, 2), -1);
    CHECK_EQ(delta_find_bad_value(ST_F16, h, 3), 2);
    /* many lanes (the vector path), the bad one last */
    float many[9000];
    for (size_t i = 0; i < 9000; i++)
        many[i] = (float)i;
    CHECK_EQ(delta_find_bad_value(ST_F32, many, 9000), -1);
    many[8999] = 1e20f;
    CHECK_EQ(delta_find_bad_value(ST_F32, many, 9000), 8999);
}

TEST(metadata_json_all_or_nothing)
{
    st_header *h = header("{\"__metadata__\":{\"a\":\"1\",\"b\":\"[1,2]\",\"c\":\"\\\"s\\\"\"}}", 0);
    cJSON *j = delta_metadata_json(h);
    CHECK(j != NULL);
    CHECK(cJSON_IsNumber(cJSON_GetObjectItem(j, "a")));
    CHECK(cJSON_IsArray(cJSON_GetObjectItem(j, "b")));
    CHECK_STR(cJSON_GetStringValue(cJSON_GetObjectItem(j, "c")), "s");
    cJSON_Delete(j);
    st_header_free(h);
    h = header("{\"__metadata__\":{\"a\":\"1\",\"b\":\"worker-1\"}}", 0);
    j = delta_metadata_json(h);
    CHECK_STR(cJSON_GetStringValue(cJSON_GetObjectItem(j, "a")), "1");
    CHECK_STR(cJSON_GetStringValue(cJSON_GetObjectItem(j, "b")), "worker-1");
    cJSON_Delete(j);
    st_header_free(h);
}

TEST(average_empty_refused)
{
    dl_error err;
    CHECK(delta_average(NULL, 0, test_path("o"), &err) < 0);
    CHECK_EQ(err.code, DL_E_EMPTY_INPUT);
}

/* ---- worker-reported metrics ------------------------------------------------------------------- */

/* delta_check_meta on the required keys plus one extra key = value. */
static int meta_with(const char *key, const char *value, delta_info *info, dl_error *err)
{
    st_meta m[5] = {
        {(char *)"algorithm", 9, (char *)DELTA_ALGORITHM, strlen(DELTA_ALGORITHM)},
        {(char *)"base_outer_step", 15, (char *)"3", 1},
        {(char *)"local_step", 10, (char *)"5", 1},
        {(char *)"node_id", 7, (char *)"w1", 2},
        {(char *)key, strlen(key), (char *)value, strlen(value)},
    };
    return delta_check_meta(m, 5, NULL, info, err);
}

TEST(metrics_values_parsed)
{
    static const struct {
        const char *text;
        double want;
    } good[] = {
        {"0", 0.0}, {"-0", 0.0}, {"1", 1.0}, {"2.5", 2.5}, {"-3.25", -3.25}, {"1e-05", 1e-05}, {"1E+20", 1e20},
        {"0.1", 0.1}, {"007", 7.0}, {"2.302585092994046", 2.302585092994046}, {"1e-400", 0.0},
        {"12345678901234567890123456789012", 12345678901234567890123456789012.0},
    };
    for (size_t i = 0; i < sizeof(good) / sizeof(good[0]); i++) {
        double v = -1;
        if (delta_parse_metric_value(good[i].text, strlen(good[i].text), &v) != 0 || v != good[i].want) {
            fprintf(stderr, "  value \"%s\": got %.17g, want %.17g\n", good[i].text, v, good[i].want);
            CHECK(0);
        }
    }
    delta_info info;
    dl_error err;
    CHECK_EQ(meta_with("loss", "2.75", &info, &err), 0);
    CHECK_HEX(info.metrics.have, DELTA_M_LOSS);
    CHECK(info.metrics.loss == 2.75);
    CHECK_EQ(meta_with("num_tokens", "4096", &info, &err), 0);
    CHECK_HEX(info.metrics.have, DELTA_M_NUM_TOKENS);
    CHECK_EQ(info.metrics.num_tokens, 4096);
    CHECK_EQ(meta_with("inner_steps", "0", &info, &err), 0);
    CHECK_HEX(info.metrics.have, DELTA_M_INNER_STEPS);
    CHECK_EQ(meta_with("tokens_per_second", "1234.5", &info, &err), 0);
    CHECK(info.metrics.tokens_per_second == 1234.5);
    CHECK_EQ(meta_with("weight", "1e-3", &info, &err), 0);
    CHECK(info.metrics.weight == 1e-3);
    CHECK_EQ(meta_with("metric.grad_norm", "-0.5", &info, &err), 0);
    CHECK_EQ(info.metrics.nnamed, 1);
    CHECK_STR(info.metrics.name[0], "grad_norm");
    CHECK(info.metrics.value[0] == -0.5);
    /* other keys stay accepted, and the metrics of an earlier parse do not leak into the next */
    CHECK_EQ(meta_with("format", "pt", &info, &err), 0);
    CHECK_EQ(info.metrics.have, 0);
    CHECK_EQ(info.metrics.nnamed, 0);
    CHECK_EQ(meta_with("metricx", "nan", &info, &err), 0);
    CHECK_EQ(meta_with("metrics.a", "nan", &info, &err), 0);
    CHECK_EQ(info.metrics.nnamed, 0);
}

TEST(metrics_bad_values_refused)
{
    static const struct {
        const char *key, *value;
    } bad[] = {
        {"loss", ""}, {"loss", "nan"}, {"loss", "NaN"}, {"loss", "inf"}, {"loss", "-inf"}, {"loss", "Infinity"},
        {"loss", "0x1p3"}, {"loss", " 1"}, {"loss", "1 "}, {"loss", "+1"}, {"loss", ".5"}, {"loss", "5."},
        {"loss", "1e"}, {"loss", "1e+"}, {"loss", "1.e5"}, {"loss", "--1"}, {"loss", "1,5"}, {"loss", "1e999"},
        {"loss", "-1e309"}, {"loss", "123456789012345678901234567890123"}, {"loss", "\"1\""}, {"loss", "1\n"},
        {"num_tokens", "-1"}, {"num_tokens", "1.0"}, {"num_tokens", "01"}, {"num_tokens", "1e3"},
        {"num_tokens", "9007199254740992"}, {"num_tokens", ""}, {"inner_steps", "-0"}, {"inner_steps", "x"},
        {"tokens_per_second", "-1"}, {"tokens_per_second", "nan"}, {"weight", "0"}, {"weight", "-0"},
        {"weight", "-2"}, {"weight", "0e5"}, {"weight", "inf"}, {"metric.", "1"}, {"metric.a-b", "1"},
        {"metric.a.b", "1"}, {"metric.abcdefghijabcdefghijabcdefghijabc", "1"}, {"metric.x", "nan"},
        {"metric.x", ""}, {"metric.x", "1e400"},
    };
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        delta_info info;
        dl_error err;
        int rc = meta_with(bad[i].key, bad[i].value, &info, &err);
        const char *name = bad[i].key;
        if (rc == 0 || err.code != DL_E_METADATA_INVALID || strstr(err.message, name) == NULL) {
            fprintf(stderr, "  %s = \"%s\": rc %d code %d message \"%s\"\n", bad[i].key, bad[i].value, rc,
                    rc ? (int)err.code : 0, rc ? err.message : "");
            CHECK(0);
        }
    }
    /* the longest name is taken, one more character is not */
    delta_info info;
    dl_error err;
    CHECK_EQ(meta_with("metric.abcdefghijabcdefghijabcdefghijab", "1", &info, &err), 0);
    CHECK_STR(info.metrics.name[0], "abcdefghijabcdefghijabcdefghijab");
}

TEST(metrics_named_cap_and_order)
{
    st_meta m[4 + DELTA_METRICS_MAX + 1];
    char keys[DELTA_METRICS_MAX + 1][16], vals[DELTA_METRICS_MAX + 1][8];
    delta_info info;
    dl_error err;

    m[0] = (st_meta){(char *)"algorithm", 9, (char *)DELTA_ALGORITHM, strlen(DELTA_ALGORITHM)};
    m[1] = (st_meta){(char *)"base_outer_step", 15, (char *)"3", 1};
    m[2] = (st_meta){(char *)"local_step", 10, (char *)"5", 1};
    m[3] = (st_meta){(char *)"node_id", 7, (char *)"w1", 2};
    /* in descending name order: the parse keeps them ascending */
    for (int i = 0; i <= DELTA_METRICS_MAX; i++) {
        snprintf(keys[i], sizeof(keys[i]), "metric.m%02d", DELTA_METRICS_MAX - i);
        snprintf(vals[i], sizeof(vals[i]), "%d", DELTA_METRICS_MAX - i);
        m[4 + i] = (st_meta){keys[i], strlen(keys[i]), vals[i], strlen(vals[i])};
    }
    CHECK_EQ(delta_check_meta(m, 4 + DELTA_METRICS_MAX, NULL, &info, &err), 0);
    CHECK_EQ(info.metrics.nnamed, DELTA_METRICS_MAX);
    for (int i = 0; i < DELTA_METRICS_MAX; i++) {
        char want[8];
        snprintf(want, sizeof(want), "m%02d", i + 1);
        CHECK_STR(info.metrics.name[i], want);
        CHECK(info.metrics.value[i] == (double)(i + 1));
    }
    CHECK(delta_check_meta(m, 4 + DELTA_METRICS_MAX + 1, NULL, &info, &err) != 0);
    CHECK_EQ(err.code, DL_E_METADATA_INVALID);
    CHECK(strstr(err.message, "metric.m00") != NULL);
    CHECK(strstr(err.message, "more than 16") != NULL);
    /* a delta_info copies by value */
    CHECK_EQ(delta_check_meta(m, 4 + DELTA_METRICS_MAX, NULL, &info, &err), 0);
    delta_info copy = info;
    CHECK_STR(copy.metrics.name[DELTA_METRICS_MAX - 1], "m16");
    CHECK(delta_metrics_add(&copy.metrics, "z", 1, 1.0) != 0);  /* full */
    copy.metrics.nnamed = 1;
    CHECK(delta_metrics_add(&copy.metrics, "m01", 3, 1.0) != 0);  /* already there */
    CHECK_EQ(delta_metrics_add(&copy.metrics, "a", 1, 2.0), 0);
    CHECK_STR(copy.metrics.name[0], "a");
    CHECK_STR(copy.metrics.name[1], "m01");
}

/* A key mismatch from a wrapped model's state_dict names the prefix and the fix; any other names neither. */
static void mismatch_message(const char *global_json, size_t glen, const char *delta_json, size_t dlen, char *out,
                             size_t size)
{
    st_header *g = header(global_json, glen), *d = header(delta_json, dlen);
    dl_error err;
    delta_info info;
    out[0] = '\0';
    if (g != NULL && d != NULL && delta_check_header(d, g, NULL, &info, &err) == -DL_E_KEY_MISMATCH)
        snprintf(out, size, "%s", err.message);
    st_header_free(g);
    st_header_free(d);
}

#define T(name, b, e) "\"" name "\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[" b "," e "]}"

TEST(key_mismatch_names_a_wrapper_prefix)
{
    char msg[512];
    const char *g = "{" T("a.weight", "0", "8") "," T("b.bias", "8", "16") "}";
    mismatch_message(g, 16, "{" META("3", "5", "w1") "," T("module.a.weight", "0", "8") "," T("module.b.bias", "8", "16")
                     "}", 16, msg, sizeof(msg));
    CHECK(strstr(msg, "every key of the delta starts with \"module.\"") != NULL);
    CHECK(strstr(msg, "model.module") != NULL);
    mismatch_message(g, 16, "{" META("3", "5", "w1") "," T("_orig_mod.a.weight", "0", "8") ","
                     T("_orig_mod.b.bias", "8", "16") "}", 16, msg, sizeof(msg));
    CHECK(strstr(msg, "\"_orig_mod.\"") != NULL);
    /* the global saved from the wrapped model */
    mismatch_message("{" T("module.a.weight", "0", "8") "," T("module.b.bias", "8", "16") "}", 16,
                     "{" META("3", "5", "w1") "," T("a.weight", "0", "8") "," T("b.bias", "8", "16") "}", 16, msg,
                     sizeof(msg));
    CHECK(strstr(msg, "every key of the global model starts with \"module.\"") != NULL);
    /* keys that differ otherwise: no advice */
    mismatch_message(g, 16, "{" META("3", "5", "w1") "," T("a.weight", "0", "8") "," T("c.bias", "8", "16") "}", 16,
                     msg, sizeof(msg));
    CHECK(msg[0] != '\0' && strstr(msg, "starts with") == NULL);
    mismatch_message(g, 16, "{" META("3", "5", "w1") "," T("module.a.weight", "0", "8") "," T("b.bias", "8", "16")
                     "}", 16, msg, sizeof(msg));
    CHECK(msg[0] != '\0' && strstr(msg, "starts with") == NULL);
}
