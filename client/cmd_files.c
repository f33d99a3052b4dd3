/* diloco inspect / verify / delta / average / hash: commands on local files. */
#include <dirent.h>
#include <fcntl.h>
#include <errno.h>
#include <getopt.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cJSON.h>
#include <openssl/evp.h>

#include "blockhash.h"
#include "cli.h"
#include "cli_delta.h"
#include "cli_untrusted.h"
#include "delta.h"
#include "fsutil.h"
#include "safetensors.h"
#include "st_index.h"
#include "stepcount.h"
#include "strbuf.h"

static int want_help(int argc, char **argv, const char *text)
{
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--help") == 0 || strcmp(argv[i], "-h") == 0) {
            fputs(text, stdout);
            return 1;
        }
    }
    return 0;
}

static int usage_error(const char *text, const char *fmt, const char *arg)
{
    fprintf(stderr, "diloco: ");
    fprintf(stderr, fmt, arg);
    fprintf(stderr, "\n%s", text);
    return EXIT_USAGE;
}

/* sha256 of a tensor's bytes, streamed in 1 MiB reads. */
static int tensor_sha256(const st_file *f, const st_tensor *t, char hex[65], dl_error *err)
{
    static const char digits[] = "0123456789abcdef";
    enum { BUF = 1 << 20 };
    unsigned char md[32];
    unsigned mdlen = 0;
    unsigned char *buf = malloc(BUF);
    EVP_MD_CTX *ctx = EVP_MD_CTX_new();
    uint64_t size = st_tensor_bytes(t);
    int rc = 0;

    if (buf == NULL || ctx == NULL || EVP_DigestInit_ex(ctx, EVP_sha256(), NULL) != 1) {
        rc = dl_fail(err, DL_E_NO_MEMORY, NULL, 0, "cannot set up sha256");
        goto out;
    }
    for (uint64_t off = 0; off < size; off += BUF) {
        size_t n = (size_t)(size - off < BUF ? size - off : BUF);
        if ((rc = st_read(f, t, off, buf, n, err)) != 0)
            goto out;
        if (EVP_DigestUpdate(ctx, buf, n) != 1) {
            rc = dl_fail(err, DL_E_IO, NULL, 0, "sha256 update failed");
            goto out;
        }
    }
    if (EVP_DigestFinal_ex(ctx, md, &mdlen) != 1 || mdlen != 32) {
        rc = dl_fail(err, DL_E_IO, NULL, 0, "sha256 final failed");
        goto out;
    }
    for (int i = 0; i < 32; i++) {
        hex[2 * i] = digits[md[i] >> 4];
        hex[2 * i + 1] = digits[md[i] & 15];
    }
    hex[64] = '\0';
out:
    EVP_MD_CTX_free(ctx);
    free(buf);
    return rc;
}

/* A file's name or metadata for the terminal: dl_printable's form (a backslash doubled, C0, DEL and bytes
 * that are not UTF-8 escaped, cut with "..." past printable_size), then the shown form, which escapes C1
 * (U+0080..U+009F) too (cli_untrusted.h).  out holds 3 x printable_size: a C1 character's 2 bytes show as 6. */
#define FILE_TEXT_MAX 512
static const char *file_text(char out[3 * FILE_TEXT_MAX], size_t printable_size, const char *s, size_t len)
{
    char printable[FILE_TEXT_MAX];

    dl_printable(printable, printable_size < sizeof(printable) ? printable_size : sizeof(printable), s, len);
    return cli_untrusted(out, 3 * FILE_TEXT_MAX, printable, strlen(printable));
}

static void shape_text(char *out, size_t size, const st_tensor *t)
{
    size_t o = 0;
    int w = snprintf(out, size, "[");
    o = (size_t)w;
    for (size_t i = 0; i < t->ndim && o < size; i++) {
        w = snprintf(out + o, size - o, "%s%" PRIu64, i ? ", " : "", t->shape[i]);
        if (w < 0 || (size_t)w >= size - o)
            return;
        o += (size_t)w;
    }
    if (o < size)
        snprintf(out + o, size - o, "]");
}

/* cJSON stores numbers as doubles and strings as C strings: 64-bit sizes and names holding NUL would
 * be altered.  These build raw JSON values instead. */
static cJSON *json_u64(uint64_t v)
{
    char text[24];
    snprintf(text, sizeof(text), "%" PRIu64, v);
    return cJSON_CreateRaw(text);
}

static cJSON *json_bytes(const char *s, size_t n)
{
    sbuf b = {0};
    char *text;
    cJSON *item;

    sb_json_string(&b, s, n);
    if ((text = sb_take(&b)) == NULL)
        return NULL;
    item = cJSON_CreateRaw(text);
    free(text);
    return item;
}

static cJSON *json_metadata(const st_header *h)
{
    sbuf b = {0};
    char *text;
    cJSON *item;

    if (!h->has_metadata)
        return cJSON_CreateNull();
    sb_add(&b, "{", 1);
    for (size_t i = 0; i < h->nmeta; i++) {
        if (i > 0)
            sb_add(&b, ",", 1);
        sb_json_string(&b, h->meta[i].key, h->meta[i].key_len);
        sb_add(&b, ":", 1);
        sb_json_string(&b, h->meta[i].value, h->meta[i].value_len);
    }
    sb_add(&b, "}", 1);
    if ((text = sb_take(&b)) == NULL)
        return NULL;
    item = cJSON_CreateRaw(text);
    free(text);
    return item;
}

/* Adds item to obj under key; frees item and returns 0 if either is NULL or the add fails. */
static int add(cJSON *obj, const char *key, cJSON *item)
{
    if (obj == NULL || item == NULL || !cJSON_AddItemToObject(obj, key, item)) {
        cJSON_Delete(item);
        return 0;
    }
    return 1;
}

static cJSON *u64_array(const uint64_t *v, size_t n)
{
    cJSON *a = cJSON_CreateArray();

    for (size_t i = 0; a != NULL && i < n; i++) {
        cJSON *x = json_u64(v[i]);
        if (x == NULL || !cJSON_AddItemToArray(a, x)) {
            cJSON_Delete(x);
            cJSON_Delete(a);
            return NULL;
        }
    }
    return a;
}

static cJSON *inspect_json(const st_file *f, int hash, dl_error *err)
{
    cJSON *root = cJSON_CreateObject(), *tensors = cJSON_CreateArray();
    uint64_t params = 0;
    int ok;

    ok = add(root, "file", cJSON_CreateString(f->path)) && add(root, "file_size", json_u64(f->file_size)) &&
         add(root, "header_size", json_u64(f->h->header_len)) && add(root, "data_offset", json_u64(f->data_start)) &&
         add(root, "metadata", json_metadata(f->h));
    if (ok)
        ok = add(root, "tensors", tensors);     /* filled below: the array stays valid inside root */
    else
        cJSON_Delete(tensors);
    for (size_t i = 0; ok && i < f->h->ntensors; i++) {
        const st_tensor *t = &f->h->tensors[i];
        uint64_t offs[2] = {t->begin, t->end};
        cJSON *o = cJSON_CreateObject();
        ok = o != NULL && cJSON_AddItemToArray(tensors, o) && add(o, "name", json_bytes(t->name, t->name_len)) &&
             add(o, "dtype", cJSON_CreateString(st_dtype_name(t->dtype))) &&
             add(o, "shape", u64_array(t->shape, t->ndim)) && add(o, "data_offsets", u64_array(offs, 2)) &&
             add(o, "bytes", json_u64(st_tensor_bytes(t)));
        if (ok && hash) {
            char hex[65];
            if (tensor_sha256(f, t, hex, err) != 0) {
                cJSON_Delete(root);
                return NULL;
            }
            ok = add(o, "sha256", cJSON_CreateString(hex));
        }
        params += t->nelem;     /* cannot overflow: the data size bounds the element count */
    }
    ok = ok && add(root, "tensor_count", json_u64(f->h->ntensors)) &&
         add(root, "total_bytes", json_u64(f->h->data_len)) && add(root, "total_parameters", json_u64(params));
    if (!ok) {
        cJSON_Delete(root);
        dl_fail(err, DL_E_NO_MEMORY, NULL, 0, "out of memory");
        return NULL;
    }
    return root;
}

/* A compressed delta (README, "Compressed deltas"): its encoding, how many keys it compresses, and its
 * data against the same delta in F32. */
static void inspect_encoding(const st_file *f)
{
    cz_spec cz;
    uint64_t f32 = 0;
    size_t keys = 0, compressed = 0;

    if (cz_spec_from_meta(f->h->meta, f->h->nmeta, &cz, NULL) != 0 || cz.enc == CZ_NONE)
        return;
    for (size_t i = 0; i < f->h->ntensors; i++) {
        const st_tensor *t = &f->h->tensors[i];
        if (cz_is_scales_name(t->name, t->name_len))
            continue;
        keys++;
        compressed += t->dtype == cz_code_dtype(cz.enc);
        f32 += t->nelem * (t->dtype == ST_C64 ? 8 : 4);
    }
    printf("encoding: %s, block %u: %zu of %zu keys compressed, %" PRIu64 " data bytes against %" PRIu64
           " in F32 (%.2fx fewer)\n", cz_encoding_name(cz.enc), cz.block, compressed, keys, f->h->data_len, f32,
           f->h->data_len ? (double)f32 / (double)f->h->data_len : 0.0);
}

static void inspect_text(const st_file *f)
{
    uint64_t params = 0;

    printf("file:     %s (%" PRIu64 " bytes)\n", f->path, f->file_size);
    printf("header:   %" PRIu64 " bytes, data at offset %" PRIu64 "\n", f->h->header_len, f->data_start);
    if (!f->h->has_metadata)
        printf("metadata: none\n");
    for (size_t i = 0; i < f->h->nmeta; i++) {
        char k[3 * FILE_TEXT_MAX], v[3 * FILE_TEXT_MAX];
        printf("%s%s = %s\n", i == 0 ? "metadata: " : "          ",
               file_text(k, 256, f->h->meta[i].key, f->h->meta[i].key_len),
               file_text(v, 512, f->h->meta[i].value, f->h->meta[i].value_len));
    }
    printf("%-40s %-11s %-20s %14s  %s\n", "tensor", "dtype", "shape", "bytes", "data offsets");
    for (size_t i = 0; i < f->h->ntensors; i++) {
        const st_tensor *t = &f->h->tensors[i];
        char name[3 * FILE_TEXT_MAX], shape[128];
        file_text(name, 256, t->name, t->name_len);
        shape_text(shape, sizeof(shape), t);
        printf("%-40s %-11s %-20s %14" PRIu64 "  [%" PRIu64 ", %" PRIu64 "]\n", name, st_dtype_name(t->dtype),
               shape, st_tensor_bytes(t), t->begin, t->end);
        params += t->nelem;
    }
    printf("total:    %zu tensors, %" PRIu64 " parameters, %" PRIu64 " data bytes\n", f->h->ntensors, params,
           f->h->data_len);
    inspect_encoding(f);
}

static const char *shard_file_name(const st_set *s, uint32_t file)
{
    const char *slash = strrchr(s->files[file]->path, '/');
    return slash ? slash + 1 : s->files[file]->path;
}

static cJSON *meta_list_json(const st_meta *m, size_t n)
{
    sbuf b = {0};
    char *text;
    cJSON *item;

    sb_add(&b, "{", 1);
    for (size_t i = 0; i < n; i++) {
        if (i > 0)
            sb_add(&b, ",", 1);
        sb_json_string(&b, m[i].key, m[i].key_len);
        sb_add(&b, ":", 1);
        sb_json_string(&b, m[i].value, m[i].value_len);
    }
    sb_add(&b, "}", 1);
    if ((text = sb_take(&b)) == NULL)
        return NULL;
    item = cJSON_CreateRaw(text);
    free(text);
    return item;
}

/* A set: the index's metadata and total, each shard's file, and each tensor with its shard. */
static cJSON *inspect_set_json(const st_set *s, int hash, dl_error *err)
{
    cJSON *root = cJSON_CreateObject(), *shards = cJSON_CreateArray(), *tensors = cJSON_CreateArray();
    uint64_t params = 0;
    int ok;

    ok = add(root, "file", cJSON_CreateString(s->path)) && add(root, "sharded", cJSON_CreateTrue()) &&
         add(root, "total_size", json_u64(s->index->total_size)) &&
         add(root, "metadata", meta_list_json(s->index->meta, s->index->nmeta));
    ok = ok && add(root, "shards", shards);
    if (!ok)
        cJSON_Delete(shards);
    ok = ok && add(root, "tensors", tensors);
    if (!ok)
        cJSON_Delete(tensors);
    for (size_t f = 0; ok && f < s->nfiles; f++) {
        const st_file *x = s->files[f];
        cJSON *o = cJSON_CreateObject();
        ok = o != NULL && cJSON_AddItemToArray(shards, o) && add(o, "file", cJSON_CreateString(shard_file_name(s, f))) &&
             add(o, "file_size", json_u64(x->file_size)) && add(o, "header_size", json_u64(x->h->header_len)) &&
             add(o, "metadata", json_metadata(x->h)) && add(o, "tensor_count", json_u64(x->h->ntensors));
    }
    for (size_t i = 0; ok && i < s->ntensors; i++) {
        const st_tensor *t = s->order[i];
        uint32_t f = s->order_file[i];
        uint64_t offs[2] = {t->begin, t->end};
        cJSON *o = cJSON_CreateObject();
        ok = o != NULL && cJSON_AddItemToArray(tensors, o) && add(o, "name", json_bytes(t->name, t->name_len)) &&
             add(o, "shard", cJSON_CreateString(shard_file_name(s, f))) &&
             add(o, "dtype", cJSON_CreateString(st_dtype_name(t->dtype))) &&
             add(o, "shape", u64_array(t->shape, t->ndim)) && add(o, "data_offsets", u64_array(offs, 2)) &&
             add(o, "bytes", json_u64(st_tensor_bytes(t)));
        if (ok && hash) {
            char hex[65];
            if (tensor_sha256(s->files[f], t, hex, err) != 0) {
                cJSON_Delete(root);
                return NULL;
            }
            ok = add(o, "sha256", cJSON_CreateString(hex));
        }
        params += t->nelem;
    }
    ok = ok && add(root, "tensor_count", json_u64(s->ntensors)) && add(root, "total_bytes", json_u64(s->data_bytes)) &&
         add(root, "total_parameters", json_u64(params));
    if (!ok) {
        cJSON_Delete(root);
        dl_fail(err, DL_E_NO_MEMORY, NULL, 0, "out of memory");
        return NULL;
    }
    return root;
}

static void inspect_set_text(const st_set *s, int hash)
{
    uint64_t params = 0;

    printf("index:    %s (%zu shards, total_size %" PRIu64 ")\n", s->path, s->nfiles, s->index->total_size);
    for (size_t i = 0; i < s->index->nmeta; i++) {
        char k[3 * FILE_TEXT_MAX], v[3 * FILE_TEXT_MAX];
        printf("%s%s = %s\n", i == 0 ? "metadata: " : "          ",
               file_text(k, 256, s->index->meta[i].key, s->index->meta[i].key_len),
               file_text(v, 512, s->index->meta[i].value, s->index->meta[i].value_len));
    }
    for (size_t f = 0; f < s->nfiles; f++)
        printf("shard:    %s (%" PRIu64 " bytes, %zu tensors)\n", shard_file_name(s, f), s->files[f]->file_size,
               s->files[f]->h->ntensors);
    printf("%-40s %-11s %-20s %14s  %s\n", "tensor", "dtype", "shape", "bytes", "shard");
    for (size_t i = 0; i < s->ntensors; i++) {
        const st_tensor *t = s->order[i];
        char name[3 * FILE_TEXT_MAX], shape[128];
        file_text(name, 256, t->name, t->name_len);
        shape_text(shape, sizeof(shape), t);
        printf("%-40s %-11s %-20s %14" PRIu64 "  %s\n", name, st_dtype_name(t->dtype), shape, st_tensor_bytes(t),
               shard_file_name(s, s->order_file[i]));
        params += t->nelem;
    }
    printf("total:    %zu tensors, %" PRIu64 " parameters, %" PRIu64 " data bytes\n", s->ntensors, params,
           s->data_bytes);
    for (size_t i = 0; hash && i < s->ntensors; i++) {
        char hex[65], name[3 * FILE_TEXT_MAX];
        dl_error err;
        if (tensor_sha256(s->files[s->order_file[i]], s->order[i], hex, &err) != 0)
            break;
        file_text(name, 256, s->order[i]->name, s->order[i]->name_len);
        printf("sha256 %s  %s\n", hex, name);
    }
}

/* The shard files of the set's base in its directory: one the index does not list is refused
 * (a stray part of another save would otherwise go unnoticed). */
static int check_directory(const st_set *s, dl_error *err)
{
    const char *slash = strrchr(s->path, '/');
    char *dir = slash ? strndup(s->path, (size_t)(slash - s->path) + 1) : strdup(".");
    DIR *d;
    struct dirent *de;
    int rc = 0;

    if (dir == NULL)
        return dl_fail(err, DL_E_NO_MEMORY, NULL, 0, "out of memory");
    if ((d = opendir(dir)) == NULL) {
        rc = dl_fail_errno(err, errno, "cannot list %s", dir);
        free(dir);
        return rc;
    }
    while (rc == 0 && (de = readdir(d)) != NULL) {
        const char *name = de->d_name;
        rc = st_index_check_listing(s->index, &name, 1, err);
    }
    closedir(d);
    free(dir);
    return rc;
}

/* Opens FILE as one file or, for an index, as the whole set (checked, with its directory). */
static int open_any(const char *path, st_set **out, dl_error *err)
{
    int rc = st_set_open(path, out, err);
    if (rc == 0 && (*out)->index != NULL && (rc = check_directory(*out, err)) != 0) {
        st_set_close(*out);
        *out = NULL;
    }
    return rc;
}

static const char inspect_help[] =
    "usage: diloco inspect FILE [--json] [--hash]\n"
    "  Validates FILE as strictly as the safetensors reference (and stricter: duplicate keys) and shows\n"
    "  its header size, metadata, and each tensor's dtype, shape, bytes and data offsets; totals.\n"
    "  FILE may be a sharded checkpoint's <base>.safetensors.index.json: the index and every shard are\n"
    "  checked as one set (every shard present and listed, no tensor in two shards, total_size) and\n"
    "  shown with each tensor's shard.\n"
    "  --json   machine-readable output (on error: {\"error\":{\"code\",\"message\",\"tensor\"}})\n"
    "  --hash   add the sha256 of each tensor's bytes (reads the whole file)\n";

static int inspect_set(const char *path, int json, int hash)
{
    st_set *s;
    dl_error err;

    dl_error_clear(&err);
    if (open_any(path, &s, &err) != 0) {
        if (json)
            cli_print_error_json(&err);
        return cli_report(path, &err);
    }
    if (json) {
        cJSON *root = inspect_set_json(s, hash, &err);
        if (root == NULL) {
            st_set_close(s);
            cli_print_error_json(&err);
            return cli_report(path, &err);
        }
        cli_print_json(root);
    } else {
        inspect_set_text(s, hash);
    }
    st_set_close(s);
    return EXIT_OK;
}

int cmd_inspect(int argc, char **argv)
{
    static const struct option opts[] = {{"json", no_argument, NULL, 'j'}, {"hash", no_argument, NULL, 'H'},
                                         {NULL, 0, NULL, 0}};
    int json = 0, hash = 0, c, rc;
    st_file *f;
    dl_error err;

    if (want_help(argc, argv, inspect_help))
        return EXIT_OK;
    while ((c = getopt_long(argc, argv, "", opts, NULL)) != -1) {
        if (c == 'j') json = 1;
        else if (c == 'H') hash = 1;
        else return usage_error(inspect_help, "%s", "bad option");
    }
    if (optind != argc - 1)
        return usage_error(inspect_help, "%s", "inspect takes exactly one FILE");
    if (st_index_is_index_path(argv[optind]))
        return inspect_set(argv[optind], json, hash);
    dl_error_clear(&err);
    if ((rc = st_open(argv[optind], &f, &err)) != 0) {
        if (json)
            cli_print_error_json(&err);
        return cli_report(argv[optind], &err);
    }
    if (json || hash) {
        cJSON *root = inspect_json(f, hash, &err);
        char *text = root ? cJSON_PrintUnformatted(root) : NULL;
        cJSON_Delete(root);
        if (text == NULL) {
            st_close(f);
            if (json)
                cli_print_error_json(&err);
            return cli_report(argv[optind], &err);
        }
        if (json) {
            cli_print_untrusted(stdout, text, strlen(text));    /* names hold C1 as cJSON leaves it */
            putchar('\n');
        } else {
            inspect_text(f);
        }
        cJSON_free(text);
        if (!json && hash) {
            for (size_t i = 0; i < f->h->ntensors; i++) {
                char hex[65], name[3 * FILE_TEXT_MAX];
                if (tensor_sha256(f, &f->h->tensors[i], hex, &err) != 0)
                    break;
                file_text(name, 256, f->h->tensors[i].name, f->h->tensors[i].name_len);
                printf("sha256 %s  %s\n", hex, name);
            }
        }
    } else {
        inspect_text(f);
    }
    st_close(f);
    return EXIT_OK;
}

static const char verify_help[] =
    "usage: diloco verify DELTA [--against GLOBAL [--step N]] [--path nodes/ID/delta_N.safetensors] [--json]\n"
    "  Checks a delta as dilocod does: the container, the metadata (algorithm, base_outer_step,\n"
    "  local_step, node_id), dtypes (F32, F16, BF16; C64 for complex keys), finite values (a compressed\n"
    "  delta's as they decode, with its encoding and scales checked); with\n"
    "  --against, the key set and shapes against the global model's floating tensors; with --path,\n"
    "  that the metadata agrees with the Hub path.  With --against, the delta must also be based on the\n"
    "  global's outer step (--step N, else the step_count.json beside GLOBAL, as diloco pull and a tree\n"
    "  keep it): a delta of an older step is reported stale, as dilocod answers it (409 stale).\n"
    "  Exit 0 when valid, 1 with the error code otherwise.\n"
    "  DELTA (and GLOBAL) may be a sharded set's delta_N.safetensors.index.json: the metadata is the\n"
    "  index's, every shard must be present and listed (no other shard of the set in its directory),\n"
    "  no tensor in two shards, total_size exact, a shard's own metadata must agree with the index.\n";

/* The outer step of GLOBAL: the step_count.json in its directory (diloco pull's -o DIR, a tree's global/).
 * 1 found (*step), 0 none there, -DL_E_* one that cannot be read or parsed (err). */
static int global_step_beside(const char *global, uint64_t *step, dl_error *err)
{
    const char *slash = strrchr(global, '/');
    char *dir = slash == NULL ? strdup(".") : strndup(global, (size_t)(slash - global) + (slash == global));
    char text[4096];
    size_t len = 0;
    struct stat sb;
    int dfd = -1, rc;

    if (dir == NULL)
        return dl_fail(err, DL_E_NO_MEMORY, NULL, 0, "out of memory");
    dfd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    free(dir);
    if (dfd < 0)
        return dl_fail_errno(err, errno, "%s's directory", global);
    rc = fsu_read_small_at(dfd, "step_count.json", text, sizeof(text) - 1, &len, &sb);
    close(dfd);
    if (rc == -ENOENT)
        return 0;
    if (rc != 0)
        return dl_fail_errno(err, -rc, "step_count.json beside %s", global);
    rc = stepcount_parse_file(text, len, step, NULL, NULL, NULL, 0, err);
    return rc != 0 ? rc : 1;
}

/* Whether a valid delta is based on the global's step: 0 yes (or the step unknown: *checked 0), 1 stale or
 * from the future (err's message says which; code "stale"), negative: the step file is unreadable (err). */
static int check_base(const char *against, const char *step_opt, const delta_info *info, int *checked, uint64_t *gstep,
                      dl_error *err)
{
    *checked = 0;
    if (step_opt != NULL) {
        char *end;
        errno = 0;
        unsigned long long v = strtoull(step_opt, &end, 10);
        if (errno != 0 || end == step_opt || *end != '\0' || step_opt[0] == '-')
            return dl_fail(err, DL_E_INVALID_ARGUMENT, NULL, 0, "--step %s is not an outer step", step_opt);
        *gstep = v;
    } else {
        int got = global_step_beside(against, gstep, err);
        if (got <= 0)
            return got;
    }
    *checked = 1;
    if (info->base_outer_step == *gstep)
        return 0;
    snprintf(err->message, sizeof(err->message), info->base_outer_step < *gstep
             ? "the delta is based on outer step %" PRIu64 ", the global is at step %" PRIu64 ": dilocod answers "
               "409 stale (pull the new global, train from it, push again)"
             : "the delta is based on outer step %" PRIu64 ", after the global's step %" PRIu64 ": a newer global "
               "than this one, or a wrong base_outer_step",
             info->base_outer_step, *gstep);
    return 1;
}

int cmd_verify(int argc, char **argv)
{
    static const struct option opts[] = {{"against", required_argument, NULL, 'a'},
                                         {"step", required_argument, NULL, 's'},
                                         {"path", required_argument, NULL, 'p'},
                                         {"json", no_argument, NULL, 'j'},
                                         {NULL, 0, NULL, 0}};
    const char *against = NULL, *path = NULL, *step_opt = NULL;
    int json = 0, c, rc, checked = 0, stale = 0;
    uint64_t gstep = 0;
    st_set *delta = NULL, *global = NULL;
    delta_info info;
    dl_error err;
    const char *what;

    if (want_help(argc, argv, verify_help))
        return EXIT_OK;
    while ((c = getopt_long(argc, argv, "", opts, NULL)) != -1) {
        if (c == 'a') against = optarg;
        else if (c == 's') step_opt = optarg;
        else if (c == 'p') path = optarg;
        else if (c == 'j') json = 1;
        else return usage_error(verify_help, "%s", "bad option");
    }
    if (optind != argc - 1)
        return usage_error(verify_help, "%s", "verify takes exactly one DELTA");
    if (step_opt != NULL && against == NULL)
        return usage_error(verify_help, "%s", "--step is the --against global's step: give --against GLOBAL");
    dl_error_clear(&err);
    what = argv[optind];
    if ((rc = open_any(argv[optind], &delta, &err)) == 0) {
        if (against != NULL && (rc = open_any(against, &global, &err)) != 0)
            what = against;
    }
    if (rc == 0 && global != NULL)
        rc = delta_validate_set(delta, global->by_name, global->ntensors, path, &info, &err);
    else if (rc == 0)
        rc = cli_check_delta_alone(delta, path, 1, &info, &err);
    if (rc == 0 && against != NULL) {
        dl_error_clear(&err);
        int b = check_base(against, step_opt, &info, &checked, &gstep, &err);
        if (b < 0) {
            what = against;
            rc = -1;
        } else if (b > 0) {
            stale = 1;
        }
    }
    if (stale) {
        if (json) {
            cJSON *root = cJSON_CreateObject(), *e = cJSON_CreateObject();
            if (root != NULL && e != NULL && cJSON_AddStringToObject(e, "code", "stale") &&
                cJSON_AddStringToObject(e, "message", err.message) && cJSON_AddFalseToObject(root, "valid") &&
                cJSON_AddItemToObject(root, "error", e))
                e = NULL;
            cJSON_Delete(e);
            cli_print_json(root);
        } else {
            char shown[600];
            fprintf(stderr, "diloco: %s: stale: %s\n", cli_untrusted(shown, sizeof(shown), argv[optind],
                                                                     strlen(argv[optind])), err.message);
        }
        st_set_close(delta);
        st_set_close(global);
        return EXIT_INVALID;
    }
    if (rc != 0) {
        if (json) {
            cJSON *root = cJSON_CreateObject(), *e = cli_error_object(&err);
            if (root != NULL && e != NULL && cJSON_AddFalseToObject(root, "valid") &&
                cJSON_AddItemToObject(root, "error", e))
                e = NULL;
            cJSON_Delete(e);
            cli_print_json(root);
        }
        st_set_close(delta);
        st_set_close(global);
        return cli_report(what, &err);
    }
    if (json) {
        cJSON *root = cJSON_CreateObject();
        cJSON_AddTrueToObject(root, "valid");
        cJSON_AddStringToObject(root, "node_id", info.node_id);
        add(root, "base_outer_step", json_u64(info.base_outer_step));
        add(root, "local_step", json_u64(info.local_step));
        if (info.cz.enc != CZ_NONE) {
            cJSON_AddStringToObject(root, "encoding", cz_encoding_name(info.cz.enc));
            add(root, "block", json_u64(info.cz.block));
        }
        if (delta->index != NULL)
            add(root, "shards", json_u64(delta->nfiles));
        cli_print_json(root);
    }
    else if (delta->index != NULL)
        printf("%s: valid delta from node %s, base_outer_step %" PRIu64 ", local_step %" PRIu64 ", %zu shards\n",
               argv[optind], info.node_id, info.base_outer_step, info.local_step, delta->nfiles);
    else if (info.cz.enc != CZ_NONE)
        printf("%s: valid delta from node %s, base_outer_step %" PRIu64 ", local_step %" PRIu64
               ", encoding %s (block %u)\n",
               argv[optind], info.node_id, info.base_outer_step, info.local_step, cz_encoding_name(info.cz.enc),
               info.cz.block);
    else
        printf("%s: valid delta from node %s, base_outer_step %" PRIu64 ", local_step %" PRIu64 "\n",
               argv[optind], info.node_id, info.base_outer_step, info.local_step);
    st_set_close(delta);
    st_set_close(global);
    return EXIT_OK;
}

static const char delta_help[] =
    "usage: diloco delta --baseline A --current B --node-id ID --base-step S --local-step N -o OUT\n"
    "                    [--shard-size SIZE]\n"
    "  Writes float32(A) - float32(B) for every floating tensor (F16, BF16, F32, F64, F8 formats;\n"
    "  C64 as complex pairs) with the reference's metadata; integer and bool buffers are omitted.\n"
    "  A and B must have exactly the same keys and shapes.  OUT is replaced atomically.\n"
    "  A and B may be sharded checkpoints (their .safetensors.index.json).  Past SIZE (bytes, or\n"
    "  huggingface_hub's units: 5GB, 500MB; default 5GB; 0: never) OUT=<dir>/<base>.safetensors is\n"
    "  written as huggingface_hub.save_torch_state_dict writes it: <base>-0000i-of-0000N.safetensors\n"
    "  and <base>.safetensors.index.json (the metadata in the index), the index last.\n"
    "  --encode int8_block|mxfp8|mxfp4 [--block N] [--residual R]: a compressed delta (README,\n"
    "  \"Compressed deltas\"; sharded as above, each key's codes and scales in one shard): each key's codes\n"
    "  and its scales (key + \".__scales__\"), N values\n"
    "  per scale (int8_block: a power of two from 32 to 4096, default 32; mx: 32).  With --residual, error\n"
    "  feedback: e = (A - B) + R, OUT = encode(e), R = e - decode(OUT); R starts at zero when the file\n"
    "  does not exist and is rewritten atomically after OUT.  C64 keys (and, for mxfp4, keys with an odd\n"
    "  number of values) stay plain F32.  --meta KEY=VALUE (repeatable) adds metadata, e.g. the worker\n"
    "  metrics loss=0.52 num_tokens=4096, checked as dilocod checks them.\n";

static int parse_step(const char *s, uint64_t *out)
{
    return delta_parse_int(s, strlen(s), out);
}

int cmd_delta(int argc, char **argv)
{
    static const struct option opts[] = {{"baseline", required_argument, NULL, 'b'},
                                         {"current", required_argument, NULL, 'c'},
                                         {"node-id", required_argument, NULL, 'n'},
                                         {"base-step", required_argument, NULL, 's'},
                                         {"local-step", required_argument, NULL, 'l'},
                                         {"output", required_argument, NULL, 'o'},
                                         {"shard-size", required_argument, NULL, 'S'},
                                         {"encode", required_argument, NULL, 'e'},
                                         {"block", required_argument, NULL, 'B'},
                                         {"residual", required_argument, NULL, 'r'},
                                         {"meta", required_argument, NULL, 'm'},
                                         {NULL, 0, NULL, 0}};
    enum { EXTRA_MAX = 32 };
    st_kv extra[EXTRA_MAX];
    size_t nextra = 0;
    const char *baseline = NULL, *current = NULL, *node = NULL, *out = NULL, *bs = NULL, *ls = NULL;
    const char *residual = NULL, *block = NULL;
    uint64_t base_step, local_step, shard_size = ST_SHARD_SIZE_DEFAULT, b = 0;
    cz_spec cz = {CZ_NONE, 0};
    dl_error err;
    int c;

    if (want_help(argc, argv, delta_help))
        return EXIT_OK;
    while ((c = getopt_long(argc, argv, "o:", opts, NULL)) != -1) {
        switch (c) {
        case 'b': baseline = optarg; break;
        case 'c': current = optarg; break;
        case 'n': node = optarg; break;
        case 's': bs = optarg; break;
        case 'l': ls = optarg; break;
        case 'o': out = optarg; break;
        case 'S':
            if (st_parse_size(optarg, &shard_size) != 0)
                return usage_error(delta_help, "invalid --shard-size '%s' (bytes, or a number with KB, MB, GB, TB)", optarg);
            break;
        case 'e':
            if (cz_encoding_parse(optarg, strlen(optarg), &cz.enc) != 0)
                return usage_error(delta_help, "invalid --encode '%s' (int8_block, mxfp8, mxfp4)", optarg);
            break;
        case 'B': block = optarg; break;
        case 'r': residual = optarg; break;
        case 'm': {
            char *eq = strchr(optarg, '=');
            if (eq == NULL || eq == optarg || nextra == EXTRA_MAX)
                return usage_error(delta_help, "invalid --meta '%s' (KEY=VALUE, at most 32)", optarg);
            /* the argument is the process's own: split it in place */
            *eq = '\0';
            extra[nextra++] = (st_kv){optarg, eq + 1};
            break;
        }
        default: return usage_error(delta_help, "%s", "bad option");
        }
    }
    if ((block != NULL || residual != NULL || nextra > 0) && cz.enc == CZ_NONE)
        return usage_error(delta_help, "%s", "--block, --residual and --meta go with --encode");
    if (cz.enc != CZ_NONE) {
        cz.block = CZ_MX_BLOCK;
        if (block != NULL) {
            if (delta_parse_int(block, strlen(block), &b) != 0 || b > CZ_BLOCK_MAX)
                return usage_error(delta_help, "invalid --block '%s'", block);
            cz.block = (uint32_t)b;
        }
        if (!cz_spec_valid(&cz))
            return usage_error(delta_help, "invalid --block '%s' (int8_block: a power of two from 32 to 4096; "
                               "mxfp8, mxfp4: 32)", block != NULL ? block : "32");
    }
    if (!baseline || !current || !node || !bs || !ls || !out || optind != argc)
        return usage_error(delta_help, "%s", "delta needs --baseline --current --node-id --base-step --local-step -o");
    if (!delta_valid_node_id(node, strlen(node)))
        return usage_error(delta_help, "invalid --node-id '%s' (allowed: [A-Za-z0-9._-]{1,64})", node);
    if (parse_step(bs, &base_step) != 0)
        return usage_error(delta_help, "invalid --base-step '%s'", bs);
    if (parse_step(ls, &local_step) != 0)
        return usage_error(delta_help, "invalid --local-step '%s'", ls);
    dl_error_clear(&err);
    if (cz.enc != CZ_NONE ? delta_compute_encoded(baseline, current, out, node, base_step, local_step, &cz, residual,
                                                  extra, nextra, shard_size, &err) != 0
                          : delta_compute_set(baseline, current, out, node, base_step, local_step, shard_size, &err) != 0)
        return cli_report(out, &err);
    return EXIT_OK;
}

static const char average_help[] =
    "usage: diloco average -o OUT [--shard-size SIZE] D1 [D2 ...]\n"
    "  Plain FP32 average of deltas (accumulated in the given order, divided by their count), written\n"
    "  to OUT.  A debugging aid: dilocod averages in ascending node id order and applies the outer step.\n"
    "  A delta may be a sharded set (its .safetensors.index.json): the result is the same bits.  Past\n"
    "  SIZE (default 5GB; 0: never) OUT=<dir>/<base>.safetensors is written as a set, as delta does.\n";

int cmd_average(int argc, char **argv)
{
    static const struct option opts[] = {{"output", required_argument, NULL, 'o'},
                                         {"shard-size", required_argument, NULL, 'S'},
                                         {NULL, 0, NULL, 0}};
    const char *out = NULL;
    uint64_t shard_size = ST_SHARD_SIZE_DEFAULT;
    dl_error err;
    int c;

    if (want_help(argc, argv, average_help))
        return EXIT_OK;
    while ((c = getopt_long(argc, argv, "o:", opts, NULL)) != -1) {
        if (c == 'o') out = optarg;
        else if (c == 'S') {
            if (st_parse_size(optarg, &shard_size) != 0)
                return usage_error(average_help, "invalid --shard-size '%s' (bytes, or a number with KB, MB, GB, TB)",
                                   optarg);
        } else return usage_error(average_help, "%s", "bad option");
    }
    if (out == NULL || optind >= argc)
        return usage_error(average_help, "%s", "average needs -o OUT and at least one delta");
    dl_error_clear(&err);
    if (delta_average_set((const char *const *)argv + optind, (size_t)(argc - optind), out, shard_size, &err) != 0)
        return cli_report(out, &err);
    return EXIT_OK;
}

static const char hash_help[] =
    "usage: diloco hash FILE [FILE ...]\n"
    "  Print each file's block hash, \"<hex>  <file>\": the sha256 of the concatenated sha256 digests of\n"
    "  its consecutive 16 MiB blocks (the last may be short; an empty file is one empty block).  The\n"
    "  project's one content hash: signed round records and the downlink's views name files by it, and\n"
    "  the Python package's diloco.blockhash computes the same.\n";

int cmd_hash(int argc, char **argv)
{
    int worst = EXIT_OK;

    if (want_help(argc, argv, hash_help))
        return EXIT_OK;
    if (argc < 2)
        return usage_error(hash_help, "%s", "hash needs at least one FILE");
    for (int i = 1; i < argc; i++) {
        unsigned char d[BLOCKHASH_SIZE];
        char hex[2 * BLOCKHASH_SIZE + 1], shown[6 * 256];
        dl_error err;

        dl_error_clear(&err);
        if (blockhash_path(argv[i], d, &err) != 0) {
            /* every file is tried: the exit code is the first failure's */
            int rc = cli_report(argv[i], &err);
            if (worst == EXIT_OK)
                worst = rc;
            continue;
        }
        blockhash_hex(d, hex);
        cli_untrusted(shown, sizeof(shown), argv[i], strlen(argv[i]));
        printf("%s  %s\n", hex, shown);
    }
    return worst;
}
