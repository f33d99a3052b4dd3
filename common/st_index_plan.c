/* st_index_plan: how a set is laid out (st_index.h): the split into shards as huggingface_hub makes it,
 * the even split, the index document it writes, and its size strings ("5GB"). */
#include "st_index.h"
#include "strbuf.h"

#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

/* ---- the plan -------------------------------------------------------------------------------- */

/* The split of n items of the given sizes (st_index_plan's rule). */
static int plan_by_size(const uint64_t *sizes, size_t n, uint64_t max_shard_size, uint32_t *shard_of,
                        uint32_t *nshards, dl_error *err)
{
    /* huggingface_hub's split_state_dict_into_shards_factory: a tensor over the limit is appended
     * as its own shard AT ONCE, while the shard being filled is appended only when it closes, so
     * shard numbers follow append order, not the order of the tensors.  Tokens name the groups as
     * they start; pos[token] is the group's place in the append order. */
    uint32_t *token = NULL, *pos = NULL, ntok = 0, appended = 0;
    int64_t cur = -1;
    uint64_t cur_size = 0;
    int rc = 0;

    if (max_shard_size == 0)
        max_shard_size = UINT64_MAX;
    if (n == 0) {
        *nshards = 1;
        return 0;
    }
    token = malloc(n * sizeof(*token));
    pos = malloc(n * sizeof(*pos));
    if (token == NULL || pos == NULL) {
        rc = dl_fail(err, DL_E_NO_MEMORY, NULL, 0, "out of memory");
        goto out;
    }
    for (size_t i = 0; i < n; i++) {
        uint64_t size = sizes[i];
        if (size > max_shard_size) {
            token[i] = ntok;
            pos[ntok++] = appended++;
            continue;
        }
        if (cur >= 0 && (size > max_shard_size - cur_size)) {
            pos[cur] = appended++;
            cur = -1;
            cur_size = 0;
        }
        if (cur < 0)
            cur = ntok++;
        token[i] = (uint32_t)cur;
        cur_size += size;
    }
    if (cur >= 0)
        pos[cur] = appended++;
    if (appended > ST_INDEX_MAX_SHARDS) {
        rc = dl_fail(err, DL_E_INVALID_ARGUMENT, NULL, 0, "%u shards: more than five digits can name; raise the shard size",
                     appended);
        goto out;
    }
    for (size_t i = 0; i < n; i++)
        shard_of[i] = pos[token[i]];
    *nshards = appended;
out:
    free(token);
    free(pos);
    return rc;
}

int st_index_plan_glued(const st_spec *specs, size_t n, const unsigned char *glue, uint64_t max_shard_size,
                        uint32_t *shard_of, uint32_t *nshards, dl_error *err)
{
    uint64_t *sizes = malloc((n ? n : 1) * sizeof(*sizes));
    uint32_t *unit_of = malloc((n ? n : 1) * sizeof(*unit_of)), *unit_shard = NULL;
    size_t nunits = 0;
    int rc = 0;

    if (sizes == NULL || unit_of == NULL) {
        rc = dl_fail(err, DL_E_NO_MEMORY, NULL, 0, "out of memory");
        goto out;
    }
    /* a spec glued to the one before it is one item with it: they go in one shard */
    for (size_t i = 0; i < n; i++) {
        uint64_t nelem, size;
        if ((rc = st_nbytes(specs[i].dtype, specs[i].shape, specs[i].ndim, &nelem, &size, err, specs[i].name,
                            specs[i].name_len)) != 0)
            goto out;
        if (glue != NULL && glue[i] && nunits > 0 && sizes[nunits - 1] <= UINT64_MAX - size)
            sizes[nunits - 1] += size;
        else
            sizes[nunits++] = size;
        unit_of[i] = (uint32_t)(nunits - 1);
    }
    if ((unit_shard = malloc((nunits ? nunits : 1) * sizeof(*unit_shard))) == NULL) {
        rc = dl_fail(err, DL_E_NO_MEMORY, NULL, 0, "out of memory");
        goto out;
    }
    if ((rc = plan_by_size(sizes, nunits, max_shard_size, unit_shard, nshards, err)) != 0)
        goto out;
    for (size_t i = 0; i < n; i++)
        shard_of[i] = unit_shard[unit_of[i]];
out:
    free(sizes);
    free(unit_of);
    free(unit_shard);
    return rc;
}

int st_index_plan(const st_spec *specs, size_t n, uint64_t max_shard_size, uint32_t *shard_of, uint32_t *nshards,
                  dl_error *err)
{
    return st_index_plan_glued(specs, n, NULL, max_shard_size, shard_of, nshards, err);
}

/* Cut after tensor t once the bytes so far reach the next k/S of the total (exact in 128 bits), and
 * wherever the tensors left are just enough for one per shard left. */
int st_index_plan_even(const st_spec *specs, size_t n, uint32_t nshards, uint32_t *shard_of, dl_error *err)
{
    uint64_t *bytes = n ? malloc(n * sizeof(*bytes)) : NULL;
    unsigned __int128 total = 0, acc = 0;
    uint32_t k = 0;

    if (n > 0 && bytes == NULL)
        return dl_fail(err, DL_E_NO_MEMORY, NULL, 0, "out of memory");
    if (nshards == 0 || nshards > ST_INDEX_MAX_SHARDS || n < nshards) {
        free(bytes);
        return dl_fail(err, DL_E_INVALID_ARGUMENT, NULL, 0, "%u shards of whole tensors cannot be cut from %zu tensors",
                       nshards, n);
    }
    for (size_t i = 0; i < n; i++) {
        uint64_t ne;
        int rc = st_nbytes(specs[i].dtype, specs[i].shape, specs[i].ndim, &ne, &bytes[i], err, specs[i].name,
                           specs[i].name_len);
        if (rc != 0) {
            free(bytes);
            return rc;
        }
        total += bytes[i];
    }
    for (size_t i = 0; i < n; i++) {
        shard_of[i] = k;
        acc += bytes[i];
        if (k + 1 < nshards &&
            (n - 1 - i == nshards - 1 - k || acc * nshards >= (unsigned __int128)(k + 1) * total))
            k++;
    }
    free(bytes);
    return 0;
}

/* A JSON string as Python's json.dumps(ensure_ascii=True) writes it: '"' and '\\' escaped, the
 * short escapes \b \f \n \r \t, everything else outside ' '..'~' as \uxxxx (lowercase hex,
 * surrogate pairs above U+FFFF).  s is valid UTF-8 (checked by the callers). */
static void py_json_string(sbuf *b, const char *s, size_t n)
{
    static const char hex[] = "0123456789abcdef";
    sb_add(b, "\"", 1);
    for (size_t i = 0; i < n;) {
        unsigned char c = (unsigned char)s[i];
        unsigned cp;
        size_t k;
        if (c < 0x80) {
            cp = c;
            k = 1;
        } else if (c < 0xe0) {
            cp = (c & 0x1fu) << 6 | ((unsigned char)s[i + 1] & 0x3fu);
            k = 2;
        } else if (c < 0xf0) {
            cp = (c & 0x0fu) << 12 | ((unsigned char)s[i + 1] & 0x3fu) << 6 | ((unsigned char)s[i + 2] & 0x3fu);
            k = 3;
        } else {
            cp = (c & 0x07u) << 18 | ((unsigned char)s[i + 1] & 0x3fu) << 12 | ((unsigned char)s[i + 2] & 0x3fu) << 6 |
                 ((unsigned char)s[i + 3] & 0x3fu);
            k = 4;
        }
        i += k;
        switch (cp) {
        case '"': sb_add(b, "\\\"", 2); continue;
        case '\\': sb_add(b, "\\\\", 2); continue;
        case '\b': sb_add(b, "\\b", 2); continue;
        case '\f': sb_add(b, "\\f", 2); continue;
        case '\n': sb_add(b, "\\n", 2); continue;
        case '\r': sb_add(b, "\\r", 2); continue;
        case '\t': sb_add(b, "\\t", 2); continue;
        default: break;
        }
        if (cp >= 0x20 && cp <= 0x7e) {
            char ch = (char)cp;
            sb_add(b, &ch, 1);
            continue;
        }
        unsigned units[2], nu = 1;
        if (cp > 0xffff) {
            cp -= 0x10000;
            units[0] = 0xd800 | (cp >> 10);
            units[1] = 0xdc00 | (cp & 0x3ff);
            nu = 2;
        } else {
            units[0] = cp;
        }
        for (unsigned u = 0; u < nu; u++) {
            char esc[6] = {'\\', 'u', hex[(units[u] >> 12) & 15], hex[(units[u] >> 8) & 15], hex[(units[u] >> 4) & 15],
                           hex[units[u] & 15]};
            sb_add(b, esc, 6);
        }
    }
    sb_add(b, "\"", 1);
}

char *st_index_build_json(const char *base, const st_spec *specs, size_t n, const uint32_t *shard_of,
                          uint32_t nshards, const st_kv *meta, size_t nmeta, size_t *len)
{
    sbuf b = {0};
    uint64_t total = 0;
    char *text;
    int first = 1;

    for (size_t i = 0; i < n; i++) {
        uint64_t nelem, size;
        if (st_nbytes(specs[i].dtype, specs[i].shape, specs[i].ndim, &nelem, &size, NULL, NULL, 0) != 0)
            return NULL;
        total += size;
    }
    sb_str(&b, "{\n  \"metadata\": {\n    \"total_size\": ");
    sb_u64(&b, total);
    for (size_t m = 0; m < nmeta; m++) {
        sb_str(&b, ",\n    ");
        py_json_string(&b, meta[m].key, strlen(meta[m].key));
        sb_str(&b, ": ");
        py_json_string(&b, meta[m].value, strlen(meta[m].value));
    }
    sb_str(&b, "\n  },\n  \"weight_map\": {");
    /* huggingface_hub's tensor_to_filename: shard after shard, each in the state dict's order */
    for (uint32_t s = 0; s < nshards; s++) {
        char name[ST_INDEX_BASE_MAX + 40];
        if (st_index_shard_name(base, s, nshards, name, sizeof(name)) != 0) {
            free(b.p);
            return NULL;
        }
        for (size_t i = 0; i < n; i++) {
            if (shard_of[i] != s)
                continue;
            sb_str(&b, first ? "\n    " : ",\n    ");
            first = 0;
            py_json_string(&b, specs[i].name, specs[i].name_len);
            sb_str(&b, ": ");
            py_json_string(&b, name, strlen(name));
        }
    }
    sb_str(&b, first ? "}\n}" : "\n  }\n}");
    *len = b.len;
    text = sb_take(&b);
    return text;
}

/* ---- sizes ----------------------------------------------------------------------------------- */

int st_parse_size(const char *s, uint64_t *out)
{
    static const struct { const char *unit; double mult; } units[] = {
        {"TB", 1e12}, {"GB", 1e9}, {"MB", 1e6}, {"KB", 1e3}};
    size_t len = strlen(s);
    char *end;

    if (len == 0)
        return -1;
    if (strspn(s, "0123456789") == len) {
        errno = 0;
        unsigned long long v = strtoull(s, &end, 10);
        if (errno != 0 || *end != '\0')
            return -1;
        *out = v;
        return 0;
    }
    if (len < 3)
        return -1;
    for (size_t u = 0; u < sizeof(units) / sizeof(units[0]); u++) {
        char num[64];
        if (strcasecmp(s + len - 2, units[u].unit) != 0)
            continue;
        if (len - 2 >= sizeof(num))
            return -1;
        memcpy(num, s, len - 2);
        num[len - 2] = '\0';
        if (num[0] < '0' || num[0] > '9')
            return -1;
        errno = 0;
        double v = strtod(num, &end);
        if (errno != 0 || *end != '\0' || !isfinite(v) || v < 0 || v * units[u].mult >= 9.2e18)
            return -1;
        *out = (uint64_t)(v * units[u].mult);   /* Python's int(): truncates, as parse_size_to_int */
        return 0;
    }
    return -1;
}
