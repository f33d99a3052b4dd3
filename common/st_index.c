/* st_index: the Hugging Face index + shards convention (st_index.h): names, a strict index parser and
 * the set checks; st_set.c opens a set as one file, st_index_plan.c splits one as huggingface_hub does,
 * st_set_writer.c writes it. */
#include "st_index.h"
#include "fsutil.h"
#include "strbuf.h"
#include "st_index_internal.h"

#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define SHARD_EXT ".safetensors"
#define INT_MAX_EXACT 9007199254740991.0    /* 2^53 - 1: the largest integer a JSON double keeps */

/* ---- names ----------------------------------------------------------------------------------- */

int st_index_is_index_path(const char *path)
{
    size_t n = strlen(path), sl = strlen(ST_INDEX_SUFFIX);
    return n > sl && strcmp(path + n - sl, ST_INDEX_SUFFIX) == 0;
}

int st_index_valid_base(const char *base, size_t len)
{
    if (len == 0 || len > ST_INDEX_BASE_MAX)
        return 0;
    if ((len == 1 && base[0] == '.') || (len == 2 && base[0] == '.' && base[1] == '.'))
        return 0;
    for (size_t i = 0; i < len; i++) {
        char c = base[i];
        if (!((c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '.' ||
              c == '_' || c == '-'))
            return 0;
    }
    return 1;
}

int st_index_shard_name(const char *base, uint32_t i, uint32_t n, char *out, size_t size)
{
    if (n == 0 || n > ST_INDEX_MAX_SHARDS || i >= n)
        return -1;
    int w = snprintf(out, size, "%s-%05u-of-%05u" SHARD_EXT, base, i + 1, n);
    return w < 0 || (size_t)w >= size ? -1 : 0;
}

/* Exactly five decimal digits (what "%05d" writes below 100000). */
static int five_digits(const char *s, uint32_t *out)
{
    uint32_t v = 0;
    for (int k = 0; k < 5; k++) {
        if (s[k] < '0' || s[k] > '9')
            return -1;
        v = v * 10 + (uint32_t)(s[k] - '0');
    }
    *out = v;
    return 0;
}

/* "-iiiii-of-nnnnn.safetensors" at the end of name[0..len): sets the base length. */
static int shard_tail(const char *name, size_t len, size_t *base_len, uint32_t *i, uint32_t *n)
{
    static const char tail[] = "-00000-of-00000" SHARD_EXT;
    const size_t tl = sizeof(tail) - 1;
    uint32_t a, b;

    if (len <= tl)
        return -1;
    const char *t = name + len - tl;
    if (t[0] != '-' || memcmp(t + 6, "-of-", 4) != 0 || memcmp(t + 15, SHARD_EXT, sizeof(SHARD_EXT) - 1) != 0 ||
        five_digits(t + 1, &a) != 0 || five_digits(t + 10, &b) != 0)
        return -1;
    if (b == 0 || a == 0 || a > b)
        return -1;
    *base_len = len - tl;
    *i = a - 1;
    *n = b;
    return 0;
}

int st_index_parse_shard_name(const char *name, size_t len, const char *base, uint32_t *i, uint32_t *n)
{
    size_t bl;
    if (shard_tail(name, len, &bl, i, n) != 0 || bl != strlen(base) || memcmp(name, base, bl) != 0)
        return -1;
    return 0;
}

st_name_kind st_index_classify(const char *name, size_t len, char base[ST_INDEX_BASE_MAX + 1], uint32_t *i,
                               uint32_t *n)
{
    size_t bl;
    st_name_kind kind;

    if (shard_tail(name, len, &bl, i, n) == 0)
        kind = ST_NAME_SHARD;
    else if (ends_with(name, len, ST_INDEX_SUFFIX, &bl))
        kind = ST_NAME_INDEX;
    else if (ends_with(name, len, SHARD_EXT, &bl))
        kind = ST_NAME_SINGLE;
    else
        return ST_NAME_OTHER;
    if (!st_index_valid_base(name, bl))
        return ST_NAME_OTHER;
    memcpy(base, name, bl);
    base[bl] = '\0';
    return kind;
}

/* ---- parsing --------------------------------------------------------------------------------- */
/* Why not cJSON: it builds the whole tree before any schema check, about 40 bytes of nodes per
 * byte of input for a document like {"metadata": {"x": [0,0,0,...]}}: a 10 MiB index cost ~420 MB.
 * It also lets duplicate keys through and reads "\u0000" as the end of a string.  This parser
 * walks the index's schema directly: it refuses unknown keys, nesting and any value type the
 * schema has no place for at the first byte that shows it, and keeps only what the st_index holds
 * (names and metadata, each once), so its memory is proportional to what is kept. */

typedef struct ixp {
    const unsigned char *s;
    size_t n, pos;
    dl_error *err;
} ixp;

static int bad_index(dl_error *err, const char *what)
{
    return dl_fail(err, DL_E_INVALID_HEADER_DESERIALIZATION, NULL, 0, "invalid index: %s", what);
}

static int ixp_fail(ixp *p, const char *what)
{
    return dl_fail(p->err, DL_E_INVALID_HEADER_DESERIALIZATION, NULL, 0, "invalid index: %s at byte %zu", what,
                   p->pos);
}

static int ixp_peek(ixp *p)
{
    while (p->pos < p->n) {
        unsigned char c = p->s[p->pos];
        if (c != ' ' && c != '\t' && c != '\n' && c != '\r')
            return c;
        p->pos++;
    }
    return -1;
}

/* After an object's member: 1 at its closing '}', 0 at the ',' before another member (both consumed),
 * or an error naming the object (where). */
static int ixp_member_end(ixp *p, const char *where)
{
    char what[64];
    int c = ixp_peek(p);

    if (c == '}' || c == ',') {
        p->pos++;
        return c == '}';
    }
    snprintf(what, sizeof(what), "expected ',' or '}'%s", where);
    return ixp_fail(p, what);
}

static int ixp_expect(ixp *p, int c, const char *what)
{
    if (ixp_peek(p) != c)
        return ixp_fail(p, what);
    p->pos++;
    return 0;
}

static int ixp_hex4(ixp *p, unsigned *out)
{
    unsigned v = 0;
    if (p->n - p->pos < 4)
        return ixp_fail(p, "end of input in a \\u escape");
    for (int i = 0; i < 4; i++) {
        int h = dl_hex_digit(p->s[p->pos + i]);
        if (h < 0)
            return ixp_fail(p, "invalid \\u escape");
        v = (v << 4) | (unsigned)h;
    }
    p->pos += 4;
    *out = v;
    return 0;
}

/* A JSON string at the current position, decoded into a malloc'd NUL-terminated buffer no longer
 * than its raw form.  The text is already known to be UTF-8.  Refused: a raw control byte, a NUL
 * (escaped: names and values are C strings downstream), a lone surrogate, an unknown escape. */
static int ixp_string(ixp *p, char **out, size_t *out_len)
{
    size_t start, len = 0;
    char *buf;

    if (ixp_peek(p) != '"')
        return ixp_fail(p, "expected a string");
    start = ++p->pos;
    while (p->pos < p->n && p->s[p->pos] != '"') {
        if (p->s[p->pos] < 0x20)
            return ixp_fail(p, "a control character inside a string");
        p->pos += p->s[p->pos] == '\\' ? 2 : 1;
    }
    if (p->pos >= p->n)
        return ixp_fail(p, "end of input inside a string");
    size_t end = p->pos;
    if ((buf = malloc(end - start + 1)) == NULL)
        return dl_fail(p->err, DL_E_NO_MEMORY, NULL, 0, "out of memory");
    p->pos = start;
    while (p->pos < end) {
        unsigned char c = p->s[p->pos++];
        if (c != '\\') {
            buf[len++] = (char)c;
            continue;
        }
        c = p->s[p->pos++];
        switch (c) {
        case '"': buf[len++] = '"'; break;
        case '\\': buf[len++] = '\\'; break;
        case '/': buf[len++] = '/'; break;
        case 'b': buf[len++] = '\b'; break;
        case 'f': buf[len++] = '\f'; break;
        case 'n': buf[len++] = '\n'; break;
        case 'r': buf[len++] = '\r'; break;
        case 't': buf[len++] = '\t'; break;
        case 'u': {
            unsigned cp, lo;
            if (ixp_hex4(p, &cp) != 0)
                goto fail;
            if (cp == 0) {
                ixp_fail(p, "a string holds \\u0000");
                goto fail;
            }
            if (cp >= 0xdc00 && cp <= 0xdfff) {
                ixp_fail(p, "a lone trailing surrogate");
                goto fail;
            }
            if (cp >= 0xd800 && cp <= 0xdbff) {
                if (end - p->pos < 6 || p->s[p->pos] != '\\' || p->s[p->pos + 1] != 'u') {
                    ixp_fail(p, "a lone leading surrogate");
                    goto fail;
                }
                p->pos += 2;
                if (ixp_hex4(p, &lo) != 0)
                    goto fail;
                if (lo < 0xdc00 || lo > 0xdfff) {
                    ixp_fail(p, "an invalid surrogate pair");
                    goto fail;
                }
                cp = 0x10000 + ((cp - 0xd800) << 10) + (lo - 0xdc00);
            }
            /* a \uXXXX escape is 6 raw bytes and decodes to at most 4 (a pair: 12 to 4) */
            len += dl_utf8_put(buf + len, cp);
            break;
        }
        default:
            ixp_fail(p, "an invalid escape");
            goto fail;
        }
        if (p->pos > end) {     /* an escape that ran into the closing quote: "\" */
            ixp_fail(p, "an invalid escape");
            goto fail;
        }
    }
    p->pos = end + 1;
    buf[len] = '\0';
    *out = buf;
    *out_len = len;
    return 0;
fail:
    free(buf);
    return -p->err->code;
}

/* A JSON number that is an integer in [0, 2^53), the range a JSON double (Python's reader and
 * cJSON's) keeps exactly.  An integral fraction or exponent ("24.0", "2.4e1") is accepted as the
 * cJSON-based parser did; a sign, a non-integer or a longer literal is refused. */
static int ixp_uint(ixp *p, uint64_t *out)
{
    size_t start = p->pos;
    char text[40];
    int plain = 1;

    if (ixp_peek(p) < 0 || !((p->s[p->pos] >= '0' && p->s[p->pos] <= '9')))
        return ixp_fail(p, "expected a non-negative integer");
    start = p->pos;
    while (p->pos < p->n && p->pos - start < sizeof(text)) {
        unsigned char c = p->s[p->pos];
        if (c >= '0' && c <= '9') {
            p->pos++;
        } else if (c == '.' || c == 'e' || c == 'E' || c == '+' || c == '-') {
            plain = 0;
            p->pos++;
        } else {
            break;
        }
    }
    size_t len = p->pos - start;
    if (len >= sizeof(text))
        return ixp_fail(p, "a number literal over 39 characters");
    memcpy(text, p->s + start, len);
    text[len] = '\0';
    if (plain) {
        if (len > 1 && text[0] == '0')
            return ixp_fail(p, "a number with a leading zero");
        if (len > 16)
            return ixp_fail(p, "an integer outside [0, 2^53)");
        uint64_t v = strtoull(text, NULL, 10);
        if (v > (uint64_t)INT_MAX_EXACT)
            return ixp_fail(p, "an integer outside [0, 2^53)");
        *out = v;
        return 0;
    }
    char *e;
    double d = strtod(text, &e);
    if (*e != '\0' || (text[0] == '0' && len > 1 && text[1] >= '0' && text[1] <= '9') || !isfinite(d) ||
        !(d >= 0) || d > INT_MAX_EXACT || floor(d) != d)
        return ixp_fail(p, "a number that is not an integer in [0, 2^53)");
    *out = (uint64_t)d;
    return 0;
}

static int str_ptr_cmp(const void *a, const void *b)
{
    return strcmp(*(const char *const *)a, *(const char *const *)b);
}

static int by_name_cmp(const void *a, const void *b, void *ctx)
{
    const st_index_entry *e = ctx;
    const st_index_entry *x = &e[*(const size_t *)a], *y = &e[*(const size_t *)b];
    return bytes_cmp(x->name, x->name_len, y->name, y->name_len);
}

void st_index_free(st_index *ix)
{
    if (ix == NULL)
        return;
    for (size_t i = 0; i < ix->nmeta; i++) {
        free(ix->meta[i].key);
        free(ix->meta[i].value);
    }
    for (size_t i = 0; i < ix->nentries; i++)
        free(ix->entries[i].name);
    free(ix->meta);
    free(ix->entries);
    free(ix->by_name);
    free(ix->base);
    free(ix);
}

/* A copy of n bytes and a NUL (the parser's strings hold no NUL). */
static char *dup_bytes(const char *s, size_t n)
{
    char *d = malloc(n + 1);
    if (d != NULL) {
        memcpy(d, s, n);
        d[n] = '\0';
    }
    return d;
}

st_index *st_index_clone(const st_index *ix)
{
    size_t slots = ix->nentries ? ix->nentries : 1;
    st_index *c = calloc(1, sizeof(*c));

    if (c == NULL)
        return NULL;
    c->nshards = ix->nshards;
    c->total_size = ix->total_size;
    if ((c->base = strdup(ix->base)) == NULL ||
        (ix->nmeta > 0 && (c->meta = calloc(ix->nmeta, sizeof(*c->meta))) == NULL) ||
        (c->entries = calloc(slots, sizeof(*c->entries))) == NULL ||
        (c->by_name = malloc(slots * sizeof(*c->by_name))) == NULL)
        goto fail;
    for (; c->nmeta < ix->nmeta; c->nmeta++) {
        const st_meta *m = &ix->meta[c->nmeta];
        st_meta *cm = &c->meta[c->nmeta];
        if ((cm->key = dup_bytes(m->key, m->key_len)) == NULL)
            goto fail;
        if ((cm->value = dup_bytes(m->value, m->value_len)) == NULL) {
            free(cm->key);
            goto fail;
        }
        cm->key_len = m->key_len;
        cm->value_len = m->value_len;
    }
    for (; c->nentries < ix->nentries; c->nentries++) {
        const st_index_entry *e = &ix->entries[c->nentries];
        if ((c->entries[c->nentries].name = dup_bytes(e->name, e->name_len)) == NULL)
            goto fail;
        c->entries[c->nentries].name_len = e->name_len;
        c->entries[c->nentries].shard = e->shard;
    }
    memcpy(c->by_name, ix->by_name, ix->nentries * sizeof(*c->by_name));
    return c;
fail:
    st_index_free(c);
    return NULL;
}

/* Grows *arr (of *cap elements of size sz) so that it holds at least n+1: doubling, so appends are
 * amortised O(1) and the array is at most twice what is kept. */
static int grow(void **arr, size_t *cap, size_t n, size_t sz)
{
    if (n < *cap)
        return 0;
    size_t nc = *cap ? *cap * 2 : 16;
    void *p = reallocarray(*arr, nc, sz);
    if (p == NULL)
        return -1;
    *arr = p;
    *cap = nc;
    return 0;
}

/* Keys are NUL-free C strings (a NUL is refused at parse), so strcmp orders them. */
static int check_meta_duplicates(const st_index *ix, dl_error *err)
{
    const char **keys;
    int rc = 0;

    if (ix->nmeta < 2)
        return 0;
    if ((keys = malloc(ix->nmeta * sizeof(*keys))) == NULL)
        return dl_fail(err, DL_E_NO_MEMORY, NULL, 0, "out of memory");
    for (size_t i = 0; i < ix->nmeta; i++)
        keys[i] = ix->meta[i].key;
    qsort(keys, ix->nmeta, sizeof(*keys), str_ptr_cmp);
    for (size_t i = 1; i < ix->nmeta && rc == 0; i++) {
        if (strcmp(keys[i - 1], keys[i]) == 0)
            rc = dl_fail(err, DL_E_DUPLICATE_KEY, keys[i], strlen(keys[i]),
                         "invalid index: duplicate key in \"metadata\"");
    }
    free(keys);
    return rc;
}

/* "metadata": an object of "total_size" (an integer) and otherwise strings or integers
 * (transformers adds "total_parameters"; an integer is kept as its decimal text). */
static int parse_metadata(ixp *p, st_index *ix)
{
    size_t cap = 0;
    int have_total = 0, rc, c;

    if (ixp_peek(p) != '{')
        return ixp_fail(p, "\"metadata\" is not an object");
    p->pos++;
    if ((c = ixp_peek(p)) == '}') {
        p->pos++;
        return bad_index(p->err, "\"metadata\" lacks \"total_size\"");
    }
    for (;;) {
        char *key = NULL, *value = NULL;
        size_t klen, vlen;
        uint64_t u;
        if ((rc = ixp_string(p, &key, &klen)) != 0)
            return rc;
        if ((rc = ixp_expect(p, ':', "expected ':'")) != 0) {
            free(key);
            return rc;
        }
        c = ixp_peek(p);
        if (strcmp(key, "total_size") == 0) {
            if (have_total) {
                rc = dl_fail(p->err, DL_E_DUPLICATE_KEY, key, klen, "invalid index: duplicate key in \"metadata\"");
                free(key);
                return rc;
            }
            free(key);
            if (c == '"' || (rc = ixp_uint(p, &ix->total_size)) != 0)
                return c == '"' || rc == -DL_E_INVALID_HEADER_DESERIALIZATION
                           ? bad_index(p->err, "\"total_size\" is not an integer in [0, 2^53)")
                           : rc;
            have_total = 1;
        } else {
            if (c == '"') {
                rc = ixp_string(p, &value, &vlen);
            } else if (c >= '0' && c <= '9' && (rc = ixp_uint(p, &u)) == 0) {
                char num[24];
                vlen = (size_t)snprintf(num, sizeof(num), "%llu", (unsigned long long)u);
                if ((value = strdup(num)) == NULL)
                    rc = dl_fail(p->err, DL_E_NO_MEMORY, NULL, 0, "out of memory");
            } else {
                /* nesting, arrays, null, booleans, negative or fractional numbers: refused here,
                 * before a byte of them is read */
                rc = dl_fail(p->err, DL_E_INVALID_HEADER_DESERIALIZATION, key, klen,
                             "invalid index: a metadata value is neither a string nor a non-negative integer");
            }
            if (rc == 0 && grow((void **)&ix->meta, &cap, ix->nmeta, sizeof(*ix->meta)) != 0)
                rc = dl_fail(p->err, DL_E_NO_MEMORY, NULL, 0, "out of memory");
            if (rc != 0) {
                free(key);
                free(value);
                return rc;
            }
            ix->meta[ix->nmeta++] = (st_meta){.key = key, .key_len = klen, .value = value, .value_len = vlen};
        }
        if ((rc = ixp_member_end(p, " in \"metadata\"")) < 0)
            return rc;
        if (rc == 1)
            break;
    }
    if (!have_total)
        return bad_index(p->err, "\"metadata\" lacks \"total_size\"");
    return check_meta_duplicates(ix, p->err);
}

/* One weight_map member: key (a tensor name, kept) and value (a shard file name of the base,
 * checked and dropped).  used[] records the shard numbers seen. */
static int parse_wm_entry(ixp *p, st_index *ix, size_t *cap, unsigned char **used)
{
    char *name = NULL, *file = NULL;
    size_t nlen, flen;
    uint32_t i, count;
    int rc;

    if ((rc = ixp_string(p, &name, &nlen)) != 0)
        return rc;
    if ((rc = ixp_expect(p, ':', "expected ':'")) != 0)
        goto out;
    if (ixp_peek(p) != '"') {
        rc = dl_fail(p->err, DL_E_INVALID_HEADER_DESERIALIZATION, name, nlen,
                     "invalid index: a weight_map value is not a string");
        goto out;
    }
    if ((rc = ixp_string(p, &file, &flen)) != 0)
        goto out;
    if (st_index_parse_shard_name(file, flen, ix->base, &i, &count) != 0) {
        char shown[128];
        dl_printable(shown, sizeof(shown), file, flen);
        rc = dl_fail(p->err, DL_E_INVALID_PATH, name, nlen,
                     "invalid index: \"%s\" is not a shard of %s (expected %s-<i>-of-<N>.safetensors, "
                     "5 digits each, no directory)", shown, ix->base, ix->base);
        goto out;
    }
    if (ix->nshards == 0) {
        ix->nshards = count;
        if ((*used = calloc(count, 1)) == NULL) {
            rc = dl_fail(p->err, DL_E_NO_MEMORY, NULL, 0, "out of memory");
            goto out;
        }
    } else if (count != ix->nshards) {
        rc = dl_fail(p->err, DL_E_INVALID_PATH, name, nlen,
                     "invalid index: shard names disagree on the shard count (%u and %u)", ix->nshards, count);
        goto out;
    }
    if (grow((void **)&ix->entries, cap, ix->nentries, sizeof(*ix->entries)) != 0) {
        rc = dl_fail(p->err, DL_E_NO_MEMORY, NULL, 0, "out of memory");
        goto out;
    }
    (*used)[i] = 1;
    ix->entries[ix->nentries++] = (st_index_entry){.name = name, .name_len = nlen, .shard = i};
    name = NULL;
out:
    free(name);
    free(file);
    return rc;
}

/* "weight_map": a non-empty object of tensor name -> shard file, no name twice.  *used receives
 * which shard numbers the map names (malloc'd; the caller frees it). */
static int parse_weight_map(ixp *p, st_index *ix, unsigned char **used)
{
    size_t cap = 0;
    int rc = 0;

    if (ixp_peek(p) != '{')
        return ixp_fail(p, "\"weight_map\" is not an object");
    p->pos++;
    if (ixp_peek(p) == '}') {
        p->pos++;
        return bad_index(p->err, "\"weight_map\" is empty");
    }
    for (;;) {
        if ((rc = parse_wm_entry(p, ix, &cap, used)) != 0)
            goto out;
        if ((rc = ixp_member_end(p, " in \"weight_map\"")) < 0)
            goto out;
        if (rc == 1)
            break;
    }
    rc = 0;
    if ((ix->by_name = malloc(ix->nentries * sizeof(*ix->by_name))) == NULL) {
        rc = dl_fail(p->err, DL_E_NO_MEMORY, NULL, 0, "out of memory");
        goto out;
    }
    for (size_t k = 0; k < ix->nentries; k++)
        ix->by_name[k] = k;
    qsort_r(ix->by_name, ix->nentries, sizeof(*ix->by_name), by_name_cmp, ix->entries);
    for (size_t k = 1; k < ix->nentries; k++) {
        const st_index_entry *a = &ix->entries[ix->by_name[k - 1]], *b = &ix->entries[ix->by_name[k]];
        if (bytes_cmp(a->name, a->name_len, b->name, b->name_len) == 0) {
            rc = dl_fail(p->err, DL_E_DUPLICATE_KEY, b->name, b->name_len,
                         "invalid index: duplicate key in \"weight_map\"");
            goto out;
        }
    }
out:
    return rc;
}

/* Every shard number 1..N is named (checked once the whole index is read, after the keys). */
static int check_shards_used(const st_index *ix, const unsigned char *used, dl_error *err)
{
    for (uint32_t i = 0; i < ix->nshards; i++) {
        if (!used[i]) {
            char name[ST_INDEX_BASE_MAX + 40];
            st_index_shard_name(ix->base, i, ix->nshards, name, sizeof(name));
            return dl_fail(err, DL_E_INVALID_PATH, NULL, 0,
                           "invalid index: no tensor is listed in shard %s (every shard of a set holds tensors)", name);
        }
    }
    return 0;
}

size_t st_index_cap_for(const st_header *global)
{
    /* "    \"<name>\": \"<base>-00001-of-00002.safetensors\",\n" */
    const uint64_t per_entry = 16 + ST_INDEX_BASE_MAX + sizeof("-00001-of-00002" SHARD_EXT);
    uint64_t cap = 64u * 1024u;

    for (size_t i = 0; i < global->ntensors && cap < ST_INDEX_MAX_BYTES; i++) {
        if (st_dtype_is_floating(global->tensors[i].dtype))
            cap += 6 * (uint64_t)global->tensors[i].name_len + per_entry;
    }
    return cap < ST_INDEX_MAX_BYTES ? (size_t)cap : ST_INDEX_MAX_BYTES;
}

int st_index_parse(const char *text, size_t len, const char *base, st_index **out, dl_error *err)
{
    return st_index_parse_capped(text, len, base, ST_INDEX_MAX_BYTES, out, err);
}

int st_index_parse_capped(const char *text, size_t len, const char *base, size_t cap, st_index **out,
                          dl_error *err)
{
    dl_error local;
    st_index *ix = NULL;
    ixp p = {(const unsigned char *)text, len, 0, err ? err : &local};
    int have_md = 0, have_wm = 0, rc;
    unsigned char *used = NULL;
    size_t bad;

    *out = NULL;
    if (cap > ST_INDEX_MAX_BYTES)
        cap = ST_INDEX_MAX_BYTES;
    if (!st_index_valid_base(base, strlen(base)))
        return dl_fail(p.err, DL_E_INVALID_ARGUMENT, NULL, 0, "invalid index base name");
    if (len > cap)
        return dl_fail(p.err, DL_E_HEADER_TOO_LARGE, NULL, 0, "index of %zu bytes is over the %zu-byte cap", len,
                       cap);
    if (dl_utf8_check(text, len, &bad) != 0)
        return dl_fail(p.err, DL_E_INVALID_HEADER, NULL, 0, "index is not UTF-8 (byte %zu)", bad);
    if ((ix = calloc(1, sizeof(*ix))) == NULL || (ix->base = strdup(base)) == NULL) {
        free(ix);
        return dl_fail(p.err, DL_E_NO_MEMORY, NULL, 0, "out of memory");
    }
    if (ixp_peek(&p) != '{') {
        rc = ixp_fail(&p, "not a JSON object");
        goto out;
    }
    p.pos++;
    if (ixp_peek(&p) == '}') {
        rc = bad_index(p.err, "no \"metadata\" (with \"total_size\")");
        goto out;
    }
    for (;;) {
        char *key;
        size_t klen;
        if ((rc = ixp_string(&p, &key, &klen)) != 0)
            goto out;
        int is_md = strcmp(key, "metadata") == 0, is_wm = strcmp(key, "weight_map") == 0;
        free(key);
        if (!is_md && !is_wm) {
            rc = bad_index(p.err, "an unknown key (an index holds \"metadata\" and \"weight_map\")");
            goto out;
        }
        if ((is_md && have_md) || (is_wm && have_wm)) {
            rc = dl_fail(p.err, DL_E_DUPLICATE_KEY, is_md ? "metadata" : "weight_map", is_md ? 8 : 10,
                         "invalid index: duplicate key in the index");
            goto out;
        }
        if ((rc = ixp_expect(&p, ':', "expected ':'")) != 0)
            goto out;
        if ((rc = is_md ? parse_metadata(&p, ix) : parse_weight_map(&p, ix, &used)) != 0)
            goto out;
        have_md |= is_md;
        have_wm |= is_wm;
        if ((rc = ixp_member_end(&p, "")) < 0)
            goto out;
        if (rc == 1)
            break;
    }
    rc = 0;
    if (ixp_peek(&p) != -1) {
        rc = bad_index(p.err, "trailing bytes after the JSON value");
        goto out;
    }
    if (!have_md || !have_wm) {
        rc = bad_index(p.err, !have_md ? "no \"metadata\" (with \"total_size\")" : "no \"weight_map\"");
        goto out;
    }
    if ((rc = check_shards_used(ix, used, p.err)) != 0)
        goto out;
    free(used);
    *out = ix;
    return 0;
out:
    free(used);
    st_index_free(ix);
    return rc;
}

int st_index_load(const char *path, st_index **out, dl_error *err)
{
    return st_index_load_capped(path, ST_INDEX_MAX_BYTES, out, err);
}

int st_index_load_capped(const char *path, size_t cap, st_index **out, dl_error *err)
{
    const char *name = file_name_of(path);
    char base[ST_INDEX_BASE_MAX + 1], *text = NULL;
    uint32_t i, n;
    size_t len = 0;
    struct stat sb;
    int fd, rc;

    *out = NULL;
    if (cap > ST_INDEX_MAX_BYTES)
        cap = ST_INDEX_MAX_BYTES;
    if (st_index_classify(name, strlen(name), base, &i, &n) != ST_NAME_INDEX)
        return dl_fail(err, DL_E_INVALID_PATH, NULL, 0,
                       "%s: an index is named <base>" ST_INDEX_SUFFIX " with a base of [A-Za-z0-9._-]", path);
    if ((fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK)) < 0)
        return dl_fail_errno(err, errno, "cannot open %s", path);
    if (fstat(fd, &sb) != 0) {
        rc = dl_fail_errno(err, errno, "cannot stat %s", path);
        goto out;
    }
    if (!S_ISREG(sb.st_mode)) {
        rc = dl_fail(err, DL_E_IO, NULL, 0, "%s is not a regular file", path);
        goto out;
    }
    if ((uint64_t)sb.st_size > cap) {
        rc = dl_fail(err, DL_E_HEADER_TOO_LARGE, NULL, 0, "%s: index of %lld bytes is over the %zu-byte cap", path,
                     (long long)sb.st_size, cap);
        goto out;
    }
    /* read one byte past the cap: a file that grew meanwhile is refused, not cut */
    if ((text = malloc(cap + 1)) == NULL) {
        rc = dl_fail(err, DL_E_NO_MEMORY, NULL, 0, "out of memory");
        goto out;
    }
    if ((rc = fsu_read_fd_capped(fd, text, cap, &len)) != 0) {
        rc = rc == -EFBIG ? dl_fail(err, DL_E_HEADER_TOO_LARGE, NULL, 0, "%s: index over the %zu-byte cap", path, cap)
                          : dl_fail_errno(err, -rc, "cannot read %s", path);
        goto out;
    }
    rc = st_index_parse_capped(text, len, base, cap, out, err);
out:
    free(text);
    close(fd);
    return rc;
}

const st_index_entry *st_index_find(const st_index *ix, const char *name, size_t name_len)
{
    size_t lo = 0, hi = ix->nentries;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        const st_index_entry *e = &ix->entries[ix->by_name[mid]];
        int c = bytes_cmp(e->name, e->name_len, name, name_len);
        if (c == 0)
            return e;
        if (c < 0)
            lo = mid + 1;
        else
            hi = mid;
    }
    return NULL;
}

const char *st_index_meta(const st_index *ix, const char *key, size_t *len)
{
    for (size_t i = 0; i < ix->nmeta; i++) {
        if (strcmp(ix->meta[i].key, key) == 0) {
            if (len != NULL)
                *len = ix->meta[i].value_len;
            return ix->meta[i].value;
        }
    }
    return NULL;
}

/* ---- set checks ------------------------------------------------------------------------------ */

static int check_shard_meta(const st_index *ix, const st_header *h, const char *shard, dl_error *err)
{
    for (size_t m = 0; m < h->nmeta; m++) {
        const st_meta *sm = &h->meta[m];
        char k[96], v[160], w[160];
        size_t vlen;
        const char *iv;
        dl_printable(k, sizeof(k), sm->key, sm->key_len);
        dl_printable(v, sizeof(v), sm->value, sm->value_len);
        if (strcmp(sm->key, "format") == 0 && sm->key_len == 6) {
            /* huggingface_hub loads only these formats; any other is not a checkpoint shard */
            if (!(sm->value_len == 2 && memcmp(sm->value, "pt", 2) == 0) &&
                !(sm->value_len == 3 && memcmp(sm->value, "mlx", 3) == 0))
                return dl_fail(err, DL_E_METADATA_INVALID, NULL, 0,
                               "shard %s has format \"%s\" (a checkpoint shard is \"pt\")", shard, v);
            continue;
        }
        if ((iv = st_index_meta(ix, sm->key, &vlen)) == NULL || sm->key_len != strlen(sm->key))
            return dl_fail(err, DL_E_METADATA_INVALID, NULL, 0,
                           "shard %s carries metadata \"%s\" = \"%s\" that the index does not have", shard, k, v);
        if (vlen != sm->value_len || memcmp(iv, sm->value, vlen) != 0) {
            dl_printable(w, sizeof(w), iv, vlen);
            return dl_fail(err, DL_E_METADATA_INVALID, NULL, 0,
                           "shard %s carries metadata \"%s\" = \"%s\", the index says \"%s\"", shard, k, v, w);
        }
    }
    return 0;
}

int st_index_check_set(const st_index *ix, const st_header *const *shards, dl_error *err)
{
    char a[ST_INDEX_BASE_MAX + 40], b[ST_INDEX_BASE_MAX + 40];
    uint64_t sum = 0;
    int rc;

    for (uint32_t s = 0; s < ix->nshards; s++) {
        const st_header *h = shards[s];
        st_index_shard_name(ix->base, s, ix->nshards, a, sizeof(a));
        if ((rc = check_shard_meta(ix, h, a, err)) != 0)
            return rc;
        for (size_t k = 0; k < h->ntensors; k++) {
            const st_tensor *t = &h->tensors[k];
            const st_index_entry *e = st_index_find(ix, t->name, t->name_len);
            if (e == NULL)
                return dl_fail(err, DL_E_KEY_MISMATCH, t->name, t->name_len,
                               "shard %s holds a tensor the index does not list", a);
            if (e->shard != s) {
                st_index_shard_name(ix->base, e->shard, ix->nshards, b, sizeof(b));
                if (st_header_find(shards[e->shard], t->name, t->name_len) != NULL)
                    return dl_fail(err, DL_E_KEY_MISMATCH, t->name, t->name_len,
                                   "tensor is in two shards, %s and %s", b, a);
                return dl_fail(err, DL_E_KEY_MISMATCH, t->name, t->name_len,
                               "the index lists the tensor in %s but it is in %s", b, a);
            }
            if (__builtin_add_overflow(sum, st_tensor_bytes(t), &sum))
                return dl_fail(err, DL_E_VALIDATION_OVERFLOW, NULL, 0, "the set's size overflows");
        }
    }
    for (size_t i = 0; i < ix->nentries; i++) {
        const st_index_entry *e = &ix->entries[i];
        if (st_header_find(shards[e->shard], e->name, e->name_len) == NULL) {
            st_index_shard_name(ix->base, e->shard, ix->nshards, a, sizeof(a));
            return dl_fail(err, DL_E_KEY_MISMATCH, e->name, e->name_len,
                           "the index lists the tensor in %s but that shard does not hold it", a);
        }
    }
    if (sum != ix->total_size)
        return dl_fail(err, DL_E_METADATA_INVALID, NULL, 0,
                       "the index's total_size is %llu but its shards hold %llu bytes of tensor data",
                       (unsigned long long)ix->total_size, (unsigned long long)sum);
    return 0;
}

int st_index_check_listing(const st_index *ix, const char *const *names, size_t n, dl_error *err)
{
    for (size_t k = 0; k < n; k++) {
        char base[ST_INDEX_BASE_MAX + 1], shown[128];
        uint32_t i, count;
        if (st_index_classify(names[k], strlen(names[k]), base, &i, &count) != ST_NAME_SHARD ||
            strcmp(base, ix->base) != 0 || count == ix->nshards)
            continue;
        dl_printable(shown, sizeof(shown), names[k], strlen(names[k]));
        return dl_fail(err, DL_E_KEY_MISMATCH, NULL, 0,
                       "shard %s is not listed in the index (it lists %u shards of %s)", shown, ix->nshards, ix->base);
    }
    return 0;
}
