#include "test.h"

#include <dirent.h>
#include <fcntl.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "safetensors.h"

/* Builds 8-byte LE length + json + data bytes into a malloc'd buffer. */
static char *make_file(const char *json, size_t data_len, size_t *total)
{
    size_t n = strlen(json);
    char *buf = calloc(1, 8 + n + data_len + 1);
    for (int i = 0; i < 8; i++)
        buf[i] = (char)(((uint64_t)n >> (8 * i)) & 0xff);
    memcpy(buf + 8, json, n);
    *total = 8 + n + data_len;
    return buf;
}

/* Parses json as the header of a file with data_len data bytes; returns 0 or the error code. */
static int parse_code(const char *json, size_t data_len)
{
    st_header *h = NULL;
    dl_error err;
    int rc = st_header_parse(json, strlen(json), 8 + strlen(json) + data_len, &h, &err);
    st_header_free(h);
    return rc == 0 ? 0 : (int)err.code;
}

TEST(header_valid_basic)
{
    const char *j = "{\"__metadata__\":{\"k\":\"v\"},\"b\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
                    "\"a\":{\"dtype\":\"I64\",\"shape\":[],\"data_offsets\":[8,16]}}";
    st_header *h;
    dl_error err;
    CHECK_EQ(st_header_parse(j, strlen(j), 8 + strlen(j) + 16, &h, &err), 0);
    CHECK_EQ(h->ntensors, 2);
    CHECK_STR(h->tensors[0].name, "b");        /* offset order */
    CHECK_STR(h->tensors[1].name, "a");
    CHECK_EQ(h->tensors[1].nelem, 1);
    CHECK(st_header_find(h, "a", 1) == &h->tensors[1]);
    CHECK(st_header_find(h, "c", 1) == NULL);
    CHECK_STR(st_header_meta(h, "k", NULL), "v");
    CHECK_EQ(h->data_len, 16);
    st_header_free(h);
}

TEST(header_error_codes)
{
    static const struct { const char *json; size_t data; dl_code code; } cases[] = {
        {"", 0, DL_E_INVALID_HEADER_DESERIALIZATION},
        {"[]", 0, DL_E_INVALID_HEADER_DESERIALIZATION},
        {"{", 0, DL_E_INVALID_HEADER_DESERIALIZATION},
        {"{}x", 0, DL_E_INVALID_HEADER_DESERIALIZATION},
        {"{}", 1, DL_E_METADATA_INCOMPLETE_BUFFER},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]},}", 4, DL_E_INVALID_HEADER_DESERIALIZATION},
        {"{\"a\":{\"dtype\":\"F33\",\"shape\":[1],\"data_offsets\":[0,4]}}", 4, DL_E_INVALID_HEADER_DESERIALIZATION},
        {"{\"a\":{\"dtype\":\"f32\",\"shape\":[1],\"data_offsets\":[0,4]}}", 4, DL_E_INVALID_HEADER_DESERIALIZATION},
        {"{\"a\":{\"shape\":[1],\"data_offsets\":[0,4]}}", 4, DL_E_INVALID_HEADER_DESERIALIZATION},
        {"{\"a\":{\"dtype\":\"F32\",\"data_offsets\":[0,4]}}", 4, DL_E_INVALID_HEADER_DESERIALIZATION},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[1]}}", 4, DL_E_INVALID_HEADER_DESERIALIZATION},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[-1],\"data_offsets\":[0,4]}}", 4, DL_E_INVALID_HEADER_DESERIALIZATION},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[1.0],\"data_offsets\":[0,4]}}", 4, DL_E_INVALID_HEADER_DESERIALIZATION},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[1e0],\"data_offsets\":[0,4]}}", 4, DL_E_INVALID_HEADER_DESERIALIZATION},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[-0],\"data_offsets\":[0,0]}}", 0, DL_E_INVALID_HEADER_DESERIALIZATION},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[18446744073709551616],\"data_offsets\":[0,4]}}", 4,
         DL_E_INVALID_HEADER_DESERIALIZATION},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4,4]}}", 4, DL_E_INVALID_HEADER_DESERIALIZATION},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[1,5]}}", 5, DL_E_INVALID_OFFSET},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[4,0]}}", 4, DL_E_INVALID_OFFSET},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]},"
         "\"b\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[2,6]}}", 6, DL_E_INVALID_OFFSET},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,4]}}", 4, DL_E_TENSOR_INVALID_INFO},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[4294967296,4294967296],\"data_offsets\":[0,4]}}", 4,
         DL_E_VALIDATION_OVERFLOW},
        {"{\"a\":{\"dtype\":\"F64\",\"shape\":[2305843009213693952],\"data_offsets\":[0,4]}}", 4,
         DL_E_VALIDATION_OVERFLOW},
        {"{\"a\":{\"dtype\":\"F4\",\"shape\":[3],\"data_offsets\":[0,2]}}", 2, DL_E_MISALIGNED_SLICE},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]},"
         "\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[4,8]}}", 8, DL_E_DUPLICATE_KEY},
        {"{\"a\":{\"dtype\":\"F32\",\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}}", 4, DL_E_DUPLICATE_KEY},
        {"{\"__metadata__\":{\"k\":\"1\",\"k\":\"2\"}}", 0, DL_E_DUPLICATE_KEY},
        {"{\"__metadata__\":{},\"__metadata__\":{}}", 0, DL_E_DUPLICATE_KEY},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4],\"x\":{\"y\":1,\"y\":2}}}", 4,
         DL_E_DUPLICATE_KEY},
        {"{\"__metadata__\":{\"k\":1}}", 0, DL_E_INVALID_HEADER_DESERIALIZATION},
        {"{\"__metadata__\":[]}", 0, DL_E_INVALID_HEADER_DESERIALIZATION},
        {"{\"\\ud800\":{\"dtype\":\"F32\",\"shape\":[],\"data_offsets\":[0,4]}}", 4, DL_E_INVALID_HEADER_DESERIALIZATION},
        {"{\"a\tb\":{\"dtype\":\"F32\",\"shape\":[],\"data_offsets\":[0,4]}}", 4, DL_E_INVALID_HEADER_DESERIALIZATION},
        {"\xef\xbb\xbf{}", 0, DL_E_INVALID_HEADER_DESERIALIZATION},
        {"{\"\xc0\xaf\":1}", 0, DL_E_INVALID_HEADER},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}}", 3, DL_E_METADATA_INCOMPLETE_BUFFER},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        int got = parse_code(cases[i].json, cases[i].data);
        if (got != (int)cases[i].code)
            fprintf(stderr, "  case %zu: %s\n", i, cases[i].json);
        CHECK_EQ(got, cases[i].code);
    }
}

TEST(header_whitespace_and_unknown_fields_accepted)
{
    CHECK_EQ(parse_code(" \t\r\n{} \n", 0), 0);
    CHECK_EQ(parse_code("{\"a\":{\"dtype\":\"BOOL\",\"shape\":[],\"data_offsets\":[0,1],\"extra\":[1,{\"z\":null},true]}}", 1), 0);
    CHECK_EQ(parse_code("{\"__metadata__\":null}", 0), 0);
    CHECK_EQ(parse_code("{\"a\":{\"dtype\":\"U8\",\"shape\":[],\"data_offsets\":[0,1],\"x\":[1.7976931348623157e308,1e-400,-18446744073709551616]}}", 1), 0);
    CHECK_EQ(parse_code("{\"a\":{\"dtype\":\"U8\",\"shape\":[],\"data_offsets\":[0,1],\"x\":1e400}}", 1),
             DL_E_INVALID_HEADER_DESERIALIZATION);
    CHECK_EQ(parse_code("{\"e\":{\"dtype\":\"F32\",\"shape\":[0],\"data_offsets\":[0,0]},"
                        "\"f\":{\"dtype\":\"F32\",\"shape\":[0,5],\"data_offsets\":[0,0]}}", 0), 0);
}

TEST(header_depth_limit)
{
    /* the tensor entry is at depth 2; the unknown field adds levels; 127 in all is the most */
    char json[2048];
    for (int extra = 125; extra <= 126; extra++) {
        size_t o = (size_t)snprintf(json, sizeof(json), "{\"a\":{\"dtype\":\"U8\",\"shape\":[],\"data_offsets\":[0,1],\"x\":");
        for (int i = 0; i < extra; i++)
            json[o++] = '[';
        for (int i = 0; i < extra; i++)
            json[o++] = ']';
        o += (size_t)snprintf(json + o, sizeof(json) - o, "}}");
        CHECK_EQ(parse_code(json, 1), extra == 125 ? 0 : DL_E_INVALID_HEADER_DESERIALIZATION);
    }
}

TEST(header_name_with_nul_and_escapes)
{
    const char *j = "{\"a\\u0000b\":{\"dtype\":\"U8\",\"shape\":[],\"data_offsets\":[0,1]},"
                    "\"\\ud83d\\ude00\\\"\\\\\":{\"dtype\":\"U8\",\"shape\":[],\"data_offsets\":[1,2]}}";
    st_header *h;
    dl_error err;
    CHECK_EQ(st_header_parse(j, strlen(j), 8 + strlen(j) + 2, &h, &err), 0);
    CHECK(st_header_find(h, "a\0b", 3) != NULL);
    CHECK(st_header_find(h, "a", 1) == NULL);
    CHECK(st_header_find(h, "\xf0\x9f\x98\x80\"\\", 6) != NULL);
    st_header_free(h);
}

TEST(header_final_sum_checked)
{
    /* Eight U8 tensors of 2^61 - 1 bytes (the most whose bit count fits 64 bits) end at 2^64 - 8:
     * every per-tensor check passes and data_end + 8 + N wraps in unchecked arithmetic. */
    char json[2048];
    size_t o = 0;
    const uint64_t chunk = (1ULL << 61) - 1;

    json[o++] = '{';
    for (int i = 0; i < 8; i++) {
        uint64_t begin = (uint64_t)i * chunk, end = begin + chunk;
        o += (size_t)snprintf(json + o, sizeof(json) - o,
                              "%s\"t%d\":{\"dtype\":\"U8\",\"shape\":[%llu],\"data_offsets\":[%llu,%llu]}",
                              i ? "," : "", i, (unsigned long long)(end - begin), (unsigned long long)begin,
                              (unsigned long long)end);
    }
    snprintf(json + o, sizeof(json) - o, "}");
    CHECK_EQ(parse_code(json, 0), DL_E_METADATA_INCOMPLETE_BUFFER);
}

TEST(prefix_parser_incremental)
{
    const char *j = "{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}}";
    size_t total, need = 0;
    char *file = make_file(j, 4, &total);
    st_header *h = NULL;
    dl_error err;
    CHECK_EQ(st_header_parse_prefix(file, 3, total, &need, &h, &err), 0);
    CHECK(h == NULL);
    CHECK_EQ(need, 8);
    CHECK_EQ(st_header_parse_prefix(file, 20, total, &need, &h, &err), 0);
    CHECK(h == NULL);
    CHECK_EQ(need, 8 + strlen(j));
    CHECK_EQ(st_header_parse_prefix(file, need, total, &need, &h, &err), 0);
    CHECK(h != NULL);
    st_header_free(h);
    /* a header longer than the announced file is refused before it arrives */
    CHECK(st_header_parse_prefix(file, 8, 20, &need, &h, &err) < 0);
    CHECK_EQ(err.code, DL_E_INVALID_HEADER_LENGTH);
    file[7] = 0x10;
    CHECK(st_header_parse_prefix(file, 8, total, &need, &h, &err) < 0);
    CHECK_EQ(err.code, DL_E_HEADER_TOO_LARGE);
    CHECK(st_header_parse_prefix(file, 3, 7, &need, &h, &err) < 0);
    CHECK_EQ(err.code, DL_E_HEADER_TOO_SMALL);
    free(file);
}

static void write_bytes(const char *path, const void *buf, size_t n)
{
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fd >= 0) {
        if (write(fd, buf, n) != (ssize_t)n)
            perror("write");
        close(fd);
    }
}

TEST(open_file_errors)
{
    st_file *f;
    dl_error err;
    size_t total;
    char *file;

    write_bytes(test_path("short"), "1234567", 7);
    CHECK(st_open(test_path("short"), &f, &err) < 0);
    CHECK_EQ(err.code, DL_E_HEADER_TOO_SMALL);
    file = make_file("{}", 0, &total);
    file[0] = 100;
    write_bytes(test_path("len"), file, total);
    CHECK(st_open(test_path("len"), &f, &err) < 0);
    CHECK_EQ(err.code, DL_E_INVALID_HEADER_LENGTH);
    free(file);
    CHECK(st_open(test_path("missing"), &f, &err) < 0);
    CHECK_EQ(err.code, DL_E_IO);
    CHECK(st_open(test_dir(), &f, &err) < 0);
    CHECK_EQ(err.code, DL_E_IO);
}

static const char *read_all(const char *path, size_t *len)
{
    static char buf[1 << 16];
    int fd = open(path, O_RDONLY);
    ssize_t n = fd >= 0 ? read(fd, buf, sizeof(buf)) : -1;
    if (fd >= 0)
        close(fd);
    *len = n > 0 ? (size_t)n : 0;
    return buf;
}

TEST(writer_empty_state)
{
    size_t len;
    const char *b;
    dl_error err;
    CHECK_EQ(st_save(test_path("e"), NULL, NULL, 0, NULL, 0, &err), 0);
    b = read_all(test_path("e"), &len);
    CHECK_EQ(len, 16);
    CHECK_MEM(b, "\x08\0\0\0\0\0\0\0{}      ", 16);
}

TEST(writer_order_escaping_padding)
{
    uint64_t s2[] = {2}, s0[] = {0};
    float f[2] = {1, 2};
    int64_t i64 = 7;
    uint16_t h = 0x3c00;
    st_spec specs[] = {
        {"b", 1, ST_F32, 1, s2},
        {"a\"\\\n\x01/\x7f", 7, ST_F32, 0, NULL},
        {"z", 1, ST_I64, 0, NULL},
        {"e", 1, ST_F16, 1, s0},
        {"h", 1, ST_F16, 0, NULL},
    };
    const void *data[] = {f, f, &i64, NULL, &h};
    st_kv meta[] = {{"format", "pt"}};
    const char *want = "{\"__metadata__\":{\"format\":\"pt\"},"
                       "\"z\":{\"dtype\":\"I64\",\"shape\":[],\"data_offsets\":[0,8]},"
                       "\"a\\\"\\\\\\n\\u0001/\x7f\":{\"dtype\":\"F32\",\"shape\":[],\"data_offsets\":[8,12]},"
                       "\"b\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[12,20]},"
                       "\"e\":{\"dtype\":\"F16\",\"shape\":[0],\"data_offsets\":[20,20]},"
                       "\"h\":{\"dtype\":\"F16\",\"shape\":[],\"data_offsets\":[20,22]}}";
    size_t len, n;
    const char *b;
    dl_error err;
    st_file *fl;

    CHECK_EQ(st_save(test_path("o"), specs, data, 5, meta, 1, &err), 0);
    b = read_all(test_path("o"), &len);
    n = (size_t)(unsigned char)b[0] | ((size_t)(unsigned char)b[1] << 8);
    CHECK_EQ((8 + n) % 8, 0);
    CHECK_MEM(b + 8, want, strlen(want));
    for (size_t i = strlen(want); i < n; i++)
        CHECK_EQ(b[8 + i], ' ');
    CHECK_EQ(len, 8 + n + 22);
    CHECK_EQ(st_open(test_path("o"), &fl, &err), 0);
    CHECK_EQ(fl->h->ntensors, 5);
    CHECK_STR(st_header_meta(fl->h, "format", NULL), "pt");
    float back[2];
    CHECK_EQ(st_read(fl, st_header_find(fl->h, "b", 1), 0, back, 8, &err), 0);
    CHECK(back[0] == 1 && back[1] == 2);
    CHECK(st_read(fl, st_header_find(fl->h, "b", 1), 4, back, 8, &err) < 0);
    st_close(fl);
}

TEST(writer_refuses_bad_specs)
{
    st_spec meta_name[] = {{"__metadata__", 12, ST_F32, 0, NULL}};
    st_spec dup[] = {{"x", 1, ST_F32, 0, NULL}, {"y", 1, ST_I8, 0, NULL}, {"x", 1, ST_I64, 0, NULL}};
    st_spec bad_utf8[] = {{"\xff", 1, ST_F32, 0, NULL}};
    uint64_t three[] = {3};
    st_spec misaligned[] = {{"f4", 2, ST_F4, 1, three}};
    char *json;
    size_t len;
    uint64_t offs[6], dlen;
    dl_error err;
    struct stat sb;

    CHECK(st_header_build(meta_name, 1, NULL, 0, &json, &len, offs, &dlen, &err) < 0);
    CHECK_EQ(err.code, DL_E_INVALID_ARGUMENT);
    CHECK(st_header_build(dup, 3, NULL, 0, &json, &len, offs, &dlen, &err) < 0);
    CHECK_EQ(err.code, DL_E_INVALID_ARGUMENT);
    CHECK(st_header_build(bad_utf8, 1, NULL, 0, &json, &len, offs, &dlen, &err) < 0);
    CHECK(st_header_build(misaligned, 1, NULL, 0, &json, &len, offs, &dlen, &err) < 0);
    CHECK_EQ(err.code, DL_E_MISALIGNED_SLICE);
    /* a refused write leaves nothing behind */
    CHECK(st_save(test_path("x"), dup, NULL, 3, NULL, 0, &err) < 0);
    CHECK(stat(test_path("x"), &sb) != 0);
}

/* Temporary files in this run's directory (other runs of the unit tests may be working beside it). */
static int temporary_files(void)
{
    DIR *dir = opendir(test_dir());
    struct dirent *e;
    int temps = 0;

    while (dir != NULL && (e = readdir(dir)) != NULL)
        temps += strstr(e->d_name, ".tmp-") != NULL;
    if (dir != NULL)
        closedir(dir);
    return dir != NULL ? temps : -1;
}

TEST(writer_streaming_pwrite_any_order_and_abort)
{
    uint64_t shape[] = {1000};
    st_spec specs[] = {{"p", 1, ST_F32, 1, shape}, {"q", 1, ST_F32, 1, shape}};
    static float a[1000], b[1000];
    st_writer *w;
    st_file *f;
    dl_error err;
    struct stat sb;

    for (int i = 0; i < 1000; i++) {
        a[i] = (float)i;
        b[i] = -(float)i;
    }
    CHECK_EQ(st_writer_open(test_path("s"), specs, 2, NULL, 0, &w, &err), 0);
    CHECK(stat(test_path("s"), &sb) != 0);          /* nothing at the target until commit */
    CHECK_EQ(st_writer_write(w, 1, 2000, b + 500, 2000, &err), 0);
    CHECK_EQ(st_writer_write(w, 0, 0, a, 4000, &err), 0);
    CHECK_EQ(st_writer_write(w, 1, 0, b, 2000, &err), 0);
    CHECK(st_writer_write(w, 1, 3000, b, 2000, &err) < 0);
    CHECK_EQ(st_writer_commit(w, &err), 0);
    CHECK_EQ(st_open(test_path("s"), &f, &err), 0);
    static float back[1000];
    CHECK_EQ(st_read(f, st_header_find(f->h, "q", 1), 0, back, 4000, &err), 0);
    CHECK_MEM(back, b, 4000);
    st_close(f);

    CHECK_EQ(st_writer_open(test_path("t"), specs, 2, NULL, 0, &w, &err), 0);
    st_writer_abort(w);
    CHECK(stat(test_path("t"), &sb) != 0);
    /* only the two files of this test: no temporary file left */
    CHECK_EQ(temporary_files(), 0);
}

/* Writes p and q (1000 F32 each) through a writer on warm_tmp (NULL: a new temporary file) to path. */
static int write_pq(const char *path, const char *warm_tmp, const float *a, const float *b)
{
    uint64_t shape[] = {1000};
    st_spec specs[] = {{"p", 1, ST_F32, 1, shape}, {"q", 1, ST_F32, 1, shape}};
    st_writer *w;
    dl_error err;

    if (st_writer_open_warm(path, specs, 2, NULL, 0, warm_tmp, &w, &err) != 0)
        return -1;
    if (st_writer_write(w, 1, 0, b, 4000, &err) != 0 || st_writer_write(w, 0, 0, a, 4000, &err) != 0) {
        st_writer_abort(w);
        return -1;
    }
    return st_writer_commit(w, &err);
}

/* A warm file: made with its space, read into the page cache (all of it resident, all zeros), then
 * taken over by a writer, which resizes it; the output is byte for byte a new file's. */
static char *warm_file(const char *path, uint64_t size, uint64_t *filled)
{
    char *tmp = NULL;
    int fd;
    atomic_int go = 0;
    dl_error err;

    if (st_writer_warm_create(path, size, &tmp, &fd, &err) != 0)
        return NULL;
    *filled = st_writer_warm_fill(fd, size, &go, NULL);
    close(fd);
    return tmp;
}

static size_t resident_pages(const char *path, size_t size)
{
    int fd = open(path, O_RDONLY);
    void *m = fd >= 0 ? mmap(NULL, size, PROT_READ, MAP_SHARED, fd, 0) : MAP_FAILED;
    size_t np = (size + 4095) / 4096, n = 0;
    unsigned char *vec = malloc(np);

    if (m != MAP_FAILED && vec != NULL && mincore(m, size, vec) == 0)
        for (size_t i = 0; i < np; i++)
            n += vec[i] & 1;
    if (m != MAP_FAILED)
        munmap(m, size);
    if (fd >= 0)
        close(fd);
    free(vec);
    return n;
}

TEST(writer_takes_over_a_warm_file)
{
    static float a[1000], b[1000];
    static char plain[1 << 16], got[1 << 16];
    size_t plain_len, len;
    uint64_t filled;
    char *tmp;
    struct stat sb;
    atomic_int stop = 1;
    dl_error err;
    int fd;

    for (int i = 0; i < 1000; i++) {
        a[i] = (float)i * 0.5f;
        b[i] = -(float)i;
    }
    CHECK_EQ(write_pq(test_path("plain"), NULL, a, b), 0);
    memcpy(plain, read_all(test_path("plain"), &plain_len), sizeof(plain));
    CHECK(plain_len > 8000);

    /* larger than the output: every page comes in, zeros, no byte written; the writer shrinks it */
    tmp = warm_file(test_path("big"), 1 << 20, &filled);
    CHECK(tmp != NULL);
    CHECK_EQ(filled, 1 << 20);
    CHECK_EQ(resident_pages(tmp, 1 << 20), 256);
    CHECK_EQ(stat(tmp, &sb), 0);
    CHECK_EQ(sb.st_size, 1 << 20);
    const char *z = read_all(tmp, &len);
    CHECK_EQ(len, 1 << 16);
    for (size_t i = 0; i < len; i++)
        CHECK_EQ(z[i], 0);
    CHECK_EQ(write_pq(test_path("big"), tmp, a, b), 0);
    CHECK(stat(tmp, &sb) != 0);                     /* renamed into place */
    memcpy(got, read_all(test_path("big"), &len), sizeof(got));
    CHECK_EQ(len, plain_len);
    CHECK_MEM(got, plain, plain_len);
    free(tmp);

    /* smaller: extended */
    tmp = warm_file(test_path("small"), 100, &filled);
    CHECK(tmp != NULL);
    CHECK_EQ(filled, 100);
    CHECK_EQ(write_pq(test_path("small"), tmp, a, b), 0);
    memcpy(got, read_all(test_path("small"), &len), sizeof(got));
    CHECK_EQ(len, plain_len);
    CHECK_MEM(got, plain, plain_len);
    free(tmp);

    /* gone (removed meanwhile): a new temporary file (test_path's buffer is reused: copies) */
    char out[4096], warm[4096];
    snprintf(out, sizeof(out), "%s", test_path("gone"));
    snprintf(warm, sizeof(warm), "%s", test_path("no-such-warm-file"));
    CHECK_EQ(write_pq(out, warm, a, b), 0);
    memset(got, 1, sizeof(got));
    memcpy(got, read_all(out, &len), sizeof(got));
    CHECK_EQ(len, plain_len);
    CHECK_MEM(got, plain, plain_len);

    /* a symlink in its place is not written through: removed, and a new file used */
    snprintf(out, sizeof(out), "%s", test_path("viasym"));
    snprintf(warm, sizeof(warm), "%s", test_path("link"));
    CHECK_EQ(symlink(test_path("plain"), warm), 0);
    CHECK_EQ(write_pq(out, warm, a, b), 0);
    CHECK(lstat(warm, &sb) != 0);
    CHECK_EQ(lstat(out, &sb), 0);
    CHECK_EQ(sb.st_size, plain_len);
    memcpy(got, read_all(test_path("plain"), &len), sizeof(got));
    CHECK_EQ(len, plain_len);
    CHECK_MEM(got, plain, plain_len);

    /* a stopped fill reads nothing; an aborted writer removes the warm file */
    CHECK_EQ(st_writer_warm_create(test_path("stopped"), 1 << 20, &tmp, &fd, &err), 0);
    CHECK_EQ(st_writer_warm_fill(fd, 1 << 20, &stop, NULL), 0);
    close(fd);
    uint64_t shape[] = {1000};
    st_spec specs[] = {{"p", 1, ST_F32, 1, shape}};
    st_writer *w;
    CHECK_EQ(st_writer_open_warm(test_path("stopped"), specs, 1, NULL, 0, tmp, &w, &err), 0);
    st_writer_abort(w);
    CHECK(stat(tmp, &sb) != 0);
    CHECK(stat(test_path("stopped"), &sb) != 0);
    free(tmp);

    /* no space: a clear error, nothing left */
    CHECK(st_writer_warm_create(test_path("huge"), UINT64_C(1) << 62, &tmp, &fd, &err) < 0);
    CHECK(tmp == NULL);
    CHECK(strstr(err.message, "cannot reserve") != NULL);
    CHECK_EQ(temporary_files(), 0);
}

TEST(dtype_table)
{
    st_dtype d;
    CHECK_EQ(ST_DTYPE_COUNT, 22);
    for (int i = 0; i < ST_DTYPE_COUNT; i++) {
        const char *name = st_dtype_name((st_dtype)i);
        CHECK_EQ(st_dtype_parse(name, strlen(name), &d), 0);
        CHECK_EQ(d, i);
    }
    CHECK(st_dtype_is_floating(ST_C64) && st_dtype_is_floating(ST_F8_E8M0) && st_dtype_is_floating(ST_F4));
    CHECK(!st_dtype_is_floating(ST_BOOL) && !st_dtype_is_floating(ST_U64) && !st_dtype_is_floating(ST_I8));
    CHECK_EQ(st_dtype_bits(ST_F6_E3M2), 6);
    CHECK(st_dtype_parse("BF16 ", 5, &d) != 0);
}
