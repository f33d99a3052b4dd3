/* downlink: the view and the update of a step (common/downlink.h).  The view is the previous view plus
 * the decoded update, rounded once to the key's dtype; its header is the first view's; the update holds
 * the encoding's codes and scales with its metadata; the view's block hash is the file's.  The replay by
 * the Python worker and a numpy decoder is tests/integration/test_downlink.py. */
#include "test.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "blockhash.h"
#include "compress.h"
#include "convert.h"
#include "downlink.h"
#include "safetensors.h"

#define N 1000          /* not a multiple of the block: the last block is short */

static float value(unsigned i, unsigned step)
{
    return sinf((float)i * 0.37f + (float)step) * (1.0f + (float)(i % 7)) * 0.01f + (float)step * 1e-3f;
}

/* A model of one F32 key w, one BF16 key b, one odd-sized F32 key o (plain under mxfp4), one I64 key
 * c; values of step. */
static int save_model(const char *path, unsigned step)
{
    static float w[N];
    static uint16_t b[N];
    static float o[7];
    static int64_t c[3] = {1, 2, 3};
    uint64_t sw[] = {N}, so[] = {7}, sc[] = {3};
    for (unsigned i = 0; i < N; i++)
        w[i] = value(i, step);
    cv_f32_to_bf16(w, b, N);
    for (unsigned i = 0; i < 7; i++)
        o[i] = value(i + 3, step);
    st_spec specs[] = {{"w", 1, ST_F32, 1, sw}, {"b", 1, ST_BF16, 1, sw}, {"o", 1, ST_F32, 1, so},
                       {"c", 1, ST_I64, 1, sc}};
    const void *data[] = {w, b, o, c};
    return st_save(path, specs, data, 4, NULL, 0, NULL);
}

static int read_f32(st_file *f, const char *name, float *out, uint64_t n)
{
    const st_tensor *t = st_header_find(f->h, name, strlen(name));
    if (t == NULL || t->nelem != n)
        return -1;
    void *raw = malloc(st_tensor_bytes(t));
    int rc = raw != NULL ? st_read(f, t, 0, raw, st_tensor_bytes(t), NULL) : -1;
    if (rc == 0)
        rc = cv_decode(t->dtype, raw, out, n);
    free(raw);
    return rc;
}

static void check_step(cz_encoding enc)
{
    char g0[512], g1[512], v1[512], u1[512];
    snprintf(g0, sizeof(g0), "%s", test_path("g0.safetensors"));
    snprintf(g1, sizeof(g1), "%s", test_path("g1.safetensors"));
    snprintf(v1, sizeof(v1), "%s", test_path("v1.safetensors"));
    snprintf(u1, sizeof(u1), "%s", test_path("u1.safetensors"));
    CHECK_EQ(save_model(g0, 0), 0);
    CHECK_EQ(save_model(g1, 1), 0);
    downlink_args a = {enc, g1, g0, v1, u1, 1, 0, 0};
    downlink_out out;
    dl_error err = {0};
    int rc = downlink_make(&a, &out, &err);
    if (rc != 0)
        fprintf(stderr, "  %s\n", err.message);
    CHECK_EQ(rc, 0);

    /* the hash is the file's */
    unsigned char h[32];
    CHECK_EQ(blockhash_path(v1, h, NULL), 0);
    CHECK_MEM(h, out.view_hash, 32);

    st_file *view, *up, *gl, *prev;
    CHECK_EQ(st_open(v1, &view, NULL), 0);
    CHECK_EQ(st_open(u1, &up, NULL), 0);
    CHECK_EQ(st_open(g1, &gl, NULL), 0);
    CHECK_EQ(st_open(g0, &prev, NULL), 0);
    /* the first view's header, byte for byte */
    CHECK_EQ(view->data_start, prev->data_start);
    CHECK_EQ(view->file_size, prev->file_size);
    size_t len;
    const char *m = st_header_meta(up->h, "encoding", &len);
    CHECK(m != NULL && len == strlen(cz_encoding_name(enc)) && memcmp(m, cz_encoding_name(enc), len) == 0);
    char hex[65];
    blockhash_hex(out.view_hash, hex);
    m = st_header_meta(up->h, "view_hash", &len);
    CHECK(m != NULL && len == 64 && memcmp(m, hex, 64) == 0);
    CHECK(st_header_meta(up->h, "base_step", &len) != NULL && len == 1);
    CHECK(st_header_find(up->h, "c", 1) == NULL);               /* no non-floating key */
    /* mxfp4 keeps the odd-sized key plain */
    const st_tensor *ot = st_header_find(up->h, "o", 1);
    CHECK(ot != NULL && ot->dtype == (enc == CZ_MXFP4 ? ST_F32 : ST_F8_E4M3));

    /* view_1 = round(view_0 + decode(U_1)), key by key, and within the block's quantization of global_1 */
    static float v0[N], x[N], v[N], g[N];
    const cz_spec cz = {enc, CZ_MX_BLOCK};
    const char *names[] = {"w", "b"};
    for (int k = 0; k < 2; k++) {
        const st_tensor *ct = st_header_find(up->h, names[k], 1);
        char sname[32];
        snprintf(sname, sizeof(sname), "%s" CZ_SCALES_SUFFIX, names[k]);
        const st_tensor *stt = st_header_find(up->h, sname, strlen(sname));
        CHECK(ct != NULL && stt != NULL && stt->nelem == cz_nscales(N, CZ_MX_BLOCK));
        static unsigned char codes[N], scales[N];
        CHECK_EQ(st_read(up, ct, 0, codes, st_tensor_bytes(ct), NULL), 0);
        CHECK_EQ(st_read(up, stt, 0, scales, st_tensor_bytes(stt), NULL), 0);
        CHECK_EQ(cz_decode(&cz, codes, scales, 0, x, N), -1);
        CHECK_EQ(read_f32(prev, names[k], v0, N), 0);
        CHECK_EQ(read_f32(view, names[k], v, N), 0);
        CHECK_EQ(read_f32(gl, names[k], g, N), 0);
        const st_tensor *vt = st_header_find(view->h, names[k], 1);
        for (unsigned i = 0; i < N; i++) {
            float sum = v0[i] + x[i], want;
            uint16_t r;
            if (vt->dtype == ST_BF16) {
                cv_f32_to_bf16(&sum, &r, 1);
                cv_bf16_to_f32(&r, &want, 1);
            } else {
                want = sum;
            }
            CHECK(memcmp(&want, &v[i], 4) == 0);
            /* the block's scale bounds the error: a code step at the block's top, or saturation */
            float step = ldexpf(1.0f, (int)scales[i / CZ_MX_BLOCK] - 127) * (enc == CZ_MXFP8 ? 64.0f : 2.0f);
            CHECK(fabsf(g[i] - v[i]) <= step + fabsf(g[i]) * (vt->dtype == ST_BF16 ? 1.0f / 128 : 0));
        }
    }
    CHECK(out.max_gap > 0 && out.max_gap < 0.1);      /* a gap, within the per-value bounds above */
    st_close(view);
    st_close(up);
    st_close(gl);
    st_close(prev);
}

TEST(downlink_mxfp8_view_is_previous_plus_decoded_update)
{
    check_step(CZ_MXFP8);
}

TEST(downlink_mxfp4_view_is_previous_plus_decoded_update)
{
    check_step(CZ_MXFP4);
}

TEST(downlink_refuses_int8_block_and_a_changed_model)
{
    char g0[512], g1[512];
    snprintf(g0, sizeof(g0), "%s", test_path("g0.safetensors"));
    snprintf(g1, sizeof(g1), "%s", test_path("g1.safetensors"));
    CHECK_EQ(save_model(g0, 0), 0);
    uint64_t s[] = {4};
    float w[4] = {1, 2, 3, 4};
    st_spec spec = {"w", 1, ST_F32, 1, s};
    const void *data[] = {w};
    CHECK_EQ(st_save(g1, &spec, data, 1, NULL, 0, NULL), 0);
    downlink_args a = {CZ_INT8_BLOCK, g0, g0, test_path("v.safetensors"), "/nonexistent/u", 1, 0, 0};
    downlink_out out;
    dl_error err = {0};
    CHECK_EQ(downlink_make(&a, &out, &err), -DL_E_INVALID_ARGUMENT);
    char v[512];
    snprintf(v, sizeof(v), "%s", test_path("v.safetensors"));
    a = (downlink_args){CZ_MXFP8, g1, g0, v, test_path("u.safetensors"), 1, 0, 0};
    CHECK_EQ(downlink_make(&a, &out, &err), -DL_E_KEY_MISMATCH);
    CHECK(strstr(err.message, "structure") != NULL);
}

/* ---- the state's view (server/core/store_view.c) ------------------------------------------------------- */
#include <sys/stat.h>
#include <unistd.h>

#include "store.h"

static void touch(const char *path)
{
    FILE *f = fopen(path, "w");
    if (f != NULL)
        fclose(f);
}

static int exists(const store *s, const char *name)
{
    char p[700];
    struct stat sb;
    snprintf(p, sizeof(p), "%s/global/%s", s->dir, name);
    return stat(p, &sb) == 0;
}

/* outer_metadata.json's view read back; the redo record's downlink; cleanup keeps the chain's last
 * updates_keep updates and the committed view, and at startup drops an uncommitted step's. */
TEST(store_view_committed_read_back_and_cleaned)
{
    store s = {0}, again = {0};
    dl_error err;

    CHECK_EQ(store_open(&s, test_dir(), "agg", &err), 0);
    char *g = store_global_path(&s, 9);
    touch(g);
    for (unsigned k = 3; k <= 10; k++) {
        char *u = store_update_path(&s, k), *v = store_view_path(&s, k);
        touch(u);
        touch(v);
        free(u);
        free(v);
    }
    store_view view = {.enc = CZ_MXFP4, .chain_from = 2, .hashed = 1};
    memset(view.hash, 0xab, sizeof(view.hash));
    store_commit_info info = {.step = 9, .global_path = g, .optimizer = "sgd", .origin = "round", .view = &view};
    CHECK_EQ(store_commit(&s, &info, &err), 0);
    CHECK_EQ(store_open(&again, test_dir(), "agg", &err), 0);
    CHECK(again.view_path != NULL && again.view.enc == CZ_MXFP4 && again.view.chain_from == 2 && again.view.hashed);
    CHECK_MEM(again.view.hash, view.hash, 32);
    again.updates_keep = 4;
    CHECK_EQ(store_cleanup(&again, 1, &err), 0);
    CHECK(exists(&again, "view-9.safetensors") && !exists(&again, "view-8.safetensors") &&
          !exists(&again, "view-10.safetensors"));
    CHECK(!exists(&again, "update-5.safetensors") && exists(&again, "update-6.safetensors") &&
          exists(&again, "update-9.safetensors") && !exists(&again, "update-10.safetensors"));
    store_free(&again);

    /* a step committed without a view starts a new chain: its updates and views all go */
    info = (store_commit_info){.step = 9, .global_path = g, .optimizer = "sgd", .origin = "adopted"};
    CHECK_EQ(store_commit(&s, &info, &err), 0);
    CHECK(s.view_path == NULL && s.view.chain_from == 9);
    s.updates_keep = 4;
    CHECK_EQ(store_cleanup(&s, 1, &err), 0);
    CHECK(!exists(&s, "view-9.safetensors") && !exists(&s, "update-9.safetensors"));

    /* the redo record names the downlink's encoding; int8_block is refused there */
    char dpath[700], *dp = dpath;
    snprintf(dpath, sizeof(dpath), "%s/cache/deltas/s9/n1/delta_1.safetensors", s.dir);
    store_redo r = {.step = 10, .base = 9, .optimizer = "sgd", .deltas = &dp, .ndeltas = 1, .downlink = CZ_MXFP8}, back;
    int present;
    CHECK_EQ(store_redo_write(&s, &r, &err), 0);
    int rrc = store_redo_read(&s, &back, &present, &err);
    if (rrc != 0)
        fprintf(stderr, "  %s\n", err.message);
    CHECK_EQ(rrc, 0);
    CHECK(present && back.downlink == CZ_MXFP8);
    store_redo_free(&back);
    char meta[700];
    snprintf(meta, sizeof(meta), "%s/outer_metadata.json", s.dir);
    FILE *f = fopen(meta, "w");
    fputs("{\"outer_step\":9,\"global_file\":\"global/latest-9.safetensors\",\"view\":{\"encoding\":\"int8_block\","
          "\"chain_from\":2,\"hash\":\"00\"}}", f);
    fclose(f);
    CHECK(store_open(&again, test_dir(), "agg", &err) != 0);
    CHECK(strstr(err.message, "(view)") != NULL);
    store_free(&again);
    store_free(&s);
    free(g);
}
