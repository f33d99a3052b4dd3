#include "test.h"

#include <math.h>
#include <stdlib.h>

#include "delta_stream.h"

/* A global {w: F32 [3, 5], k: I64 [2]} and a matching delta file in memory. */
static st_header *global_header(void)
{
    const char *j = "{\"w\":{\"dtype\":\"F32\",\"shape\":[3,5],\"data_offsets\":[0,60]},"
                    "\"k\":{\"dtype\":\"I64\",\"shape\":[2],\"data_offsets\":[60,76]}}";
    st_header *h = NULL;
    dl_error err;
    st_header_parse(j, strlen(j), 8 + strlen(j) + 76, &h, &err);
    return h;
}

static char *delta_file(float bad_value, int bad_index, size_t *len)
{
    uint64_t shape[] = {3, 5};
    float w[15];
    for (int i = 0; i < 15; i++)
        w[i] = (float)i * 0.25f;
    if (bad_index >= 0)
        w[bad_index] = bad_value;
    st_spec specs[] = {{"w", 1, ST_F32, 2, shape}};
    st_kv meta[] = {{"algorithm", "dumb_diloco"}, {"base_outer_step", "2"}, {"local_step", "7"}, {"node_id", "n1"}};
    char *json;
    size_t jl;
    uint64_t offs[2], dl;
    dl_error err;
    if (st_header_build(specs, 1, meta, 4, &json, &jl, offs, &dl, &err) != 0)
        return NULL;
    char *f = malloc(8 + jl + dl);
    for (int i = 0; i < 8; i++)
        f[i] = (char)((uint64_t)jl >> (8 * i));
    memcpy(f + 8, json, jl);
    memcpy(f + 8 + jl, w, dl);
    free(json);
    *len = 8 + jl + dl;
    return f;
}

/* Feeds the file in pieces of `piece` bytes; returns the first error code, 0 when valid. */
static int feed_all(const char *f, size_t len, size_t piece, const char *path, uint64_t declared, int *saw_header)
{
    st_header *g = global_header();
    delta_stream s = {.global = g, .path = path, .max_header = 1 << 20, .declared_len = declared};
    dl_error err;
    int rc = 0;
    *saw_header = 0;
    for (size_t o = 0; o < len && rc >= 0; o += piece) {
        size_t n = len - o < piece ? len - o : piece;
        rc = delta_stream_feed(&s, f + o, n, &err);
        if (rc == DELTA_STREAM_HEADER) {
            (*saw_header)++;
            rc = 0;
        }
    }
    if (rc == 0)
        rc = delta_stream_finish(&s, &err);
    delta_stream_free(&s);
    st_header_free(g);
    return rc < 0 ? (int)err.code : 0;
}

TEST(stream_valid_in_any_pieces)
{
    size_t len;
    char *f = delta_file(0, -1, &len);
    int saw;
    for (size_t piece = 1; piece <= len; piece += (piece < 16 ? 1 : 37)) {
        CHECK_EQ(feed_all(f, len, piece, "nodes/n1/delta_7.safetensors", len, &saw), 0);
        CHECK_EQ(saw, 1);
    }
    CHECK_EQ(feed_all(f, len, 5, NULL, 0, &saw), 0);     /* chunked: no declared length */
    free(f);
}

TEST(stream_non_finite_found_across_piece_boundaries)
{
    size_t len;
    int saw;
    for (int idx = 0; idx < 15; idx += 7) {
        char *f = delta_file(NAN, idx, &len);
        for (size_t piece = 1; piece <= 9; piece++)
            CHECK_EQ(feed_all(f, len, piece, NULL, len, &saw), DL_E_NON_FINITE);
        free(f);
        f = delta_file(-INFINITY, idx, &len);
        CHECK_EQ(feed_all(f, len, 3, NULL, 0, &saw), DL_E_NON_FINITE);
        free(f);
    }
}

TEST(stream_refuses_early_and_checks_lengths)
{
    size_t len;
    int saw;
    char *f = delta_file(0, -1, &len);
    CHECK_EQ(feed_all(f, len, 64, "nodes/n2/delta_7.safetensors", len, &saw), DL_E_PATH_MISMATCH);
    CHECK_EQ(feed_all(f, len, 64, NULL, len + 4, &saw), DL_E_METADATA_INCOMPLETE_BUFFER);
    CHECK_EQ(feed_all(f, len - 4, 64, NULL, 0, &saw), DL_E_METADATA_INCOMPLETE_BUFFER);
    CHECK_EQ(feed_all(f, 5, 64, NULL, 0, &saw), DL_E_HEADER_TOO_SMALL);
    CHECK_EQ(feed_all(f, 40, 64, NULL, 0, &saw), DL_E_INVALID_HEADER_LENGTH);
    CHECK_EQ(feed_all(f, len, 64, NULL, 30, &saw), DL_E_INVALID_HEADER_LENGTH);
    /* trailing garbage after a valid file */
    char *g = malloc(len + 3);
    memcpy(g, f, len);
    memcpy(g + len, "xyz", 3);
    CHECK_EQ(feed_all(g, len + 3, 7, NULL, 0, &saw), DL_E_METADATA_INCOMPLETE_BUFFER);
    free(g);
    /* a header larger than the cap is refused from the 8-byte prefix alone */
    st_header *gh = global_header();
    delta_stream s = {.global = gh, .max_header = 16};
    dl_error err;
    CHECK(delta_stream_feed(&s, f, 8, &err) < 0);
    CHECK_EQ(err.code, DL_E_HEADER_TOO_LARGE);
    delta_stream_free(&s);
    st_header_free(gh);
    free(f);
}

/* The event loop's way: feed only what delta_stream_room allows, parse the header "elsewhere" when
 * asked, then go on; valid in any piece sizes, and a bad value after the header is still found. */
static int feed_deferred(const char *f, size_t len, size_t piece, int *parses)
{
    st_header *g = global_header();
    delta_stream s = {.global = g, .path = "nodes/n1/delta_7.safetensors", .max_header = 1 << 20,
                      .declared_len = len, .defer_header = 1};
    dl_error err;
    int rc = 0;
    *parses = 0;
    for (size_t o = 0; o < len && rc >= 0;) {
        size_t n = len - o < piece ? len - o : piece;
        size_t k = delta_stream_room(&s, n);
        if (k == 0) {
            rc = -1;            /* no room although the header is parsed: reported as code -1 */
            err.code = (dl_code)-1;
            break;
        }
        rc = delta_stream_feed(&s, f + o, k, &err);
        o += k;
        if (rc == DELTA_STREAM_HEADER_READY) {
            if (delta_stream_room(&s, 100) != 0)
                (*parses) += 100;   /* room before the parse would let data pass unchecked */
            (*parses)++;
            rc = delta_stream_parse_header(&s, &err);
        }
    }
    if (rc == 0)
        rc = delta_stream_finish(&s, &err);
    delta_stream_free(&s);
    st_header_free(g);
    return rc < 0 ? (int)err.code : 0;
}

TEST(stream_deferred_header_parse_in_any_pieces)
{
    size_t len;
    char *f = delta_file(0, -1, &len);
    int parses;
    for (size_t piece = 1; piece <= len; piece += (piece < 16 ? 1 : 37)) {
        CHECK_EQ(feed_deferred(f, len, piece, &parses), 0);
        CHECK_EQ(parses, 1);
    }
    free(f);
    f = delta_file(NAN, 9, &len);
    CHECK_EQ(feed_deferred(f, len, 7, &parses), (int)DL_E_NON_FINITE);
    free(f);
}
