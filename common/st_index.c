/* st_index: the Hugging Face index + shards convention (st_index.h): a strict index parser, the
 * set checks, the set view over one file or many, and a writer that splits as huggingface_hub does. */
#include "st_index.h"
#include "fsutil.h"
#include "strbuf.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/stat.h>
#include <unistd.h>

#define SHARD_EXT ".safetensors"
#define INT_MAX_EXACT 9007199254740991.0    /* 2^53 - 1: the largest integer a JSON double keeps */

static int bytes_cmp(const char *a, size_t al, const char *b, size_t bl)
{
    int c = memcmp(a, b, al < bl ? al : bl);
    if (c != 0)
        return c;
    return (al > bl) - (al < bl);
}

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

static int ends_with(const char *s, size_t len, const char *suffix, size_t *stem)
{
    size_t sl = strlen(suffix);
    if (len < sl || memcmp(s + len - sl, suffix, sl) != 0)
        return 0;
    *stem = len - sl;
    return 1;
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

static const char *file_name_of(const char *path)
{
    const char *slash = strrchr(path, '/');
    return slash ? slash + 1 : path;
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
    for (;;) {
        ssize_t r = read(fd, text + len, cap + 1 - len);
        if (r < 0 && errno == EINTR)
            continue;
        if (r < 0) {
            rc = dl_fail_errno(err, errno, "cannot read %s", path);
            goto out;
        }
        if (r == 0)
            break;
        len += (size_t)r;
        if (len > cap) {
            rc = dl_fail(err, DL_E_HEADER_TOO_LARGE, NULL, 0, "%s: index over the %zu-byte cap", path, cap);
            goto out;
        }
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

/* ---- the set view ---------------------------------------------------------------------------- */

typedef struct name_ref {
    const st_tensor *t;
    uint32_t file;
} name_ref;

static int ref_cmp(const void *a, const void *b)
{
    const name_ref *x = a, *y = b;
    return bytes_cmp(x->t->name, x->t->name_len, y->t->name, y->t->name_len);
}

void st_set_close(st_set *s)
{
    if (s == NULL)
        return;
    for (size_t i = 0; i < s->nfiles; i++)
        st_close(s->files[i]);
    free(s->files);
    st_index_free(s->index);
    free(s->by_name);
    free(s->by_name_file);
    free(s->order);
    free(s->order_file);
    free(s->path);
    free(s);
}

/* Fills by_name from every file, and order from the index (or name order). */
static int set_tables(st_set *s, dl_error *err)
{
    name_ref *refs;
    size_t n = 0, k = 0;

    for (size_t f = 0; f < s->nfiles; f++)
        n += s->files[f]->h->ntensors;
    s->ntensors = n;
    refs = malloc((n ? n : 1) * sizeof(*refs));
    s->by_name = malloc((n ? n : 1) * sizeof(*s->by_name));
    s->by_name_file = malloc((n ? n : 1) * sizeof(*s->by_name_file));
    s->order = malloc((n ? n : 1) * sizeof(*s->order));
    s->order_file = malloc((n ? n : 1) * sizeof(*s->order_file));
    if (refs == NULL || s->by_name == NULL || s->by_name_file == NULL || s->order == NULL || s->order_file == NULL) {
        free(refs);
        return dl_fail(err, DL_E_NO_MEMORY, NULL, 0, "out of memory");
    }
    for (size_t f = 0; f < s->nfiles; f++) {
        const st_header *h = s->files[f]->h;
        for (size_t i = 0; i < h->ntensors; i++) {
            refs[k++] = (name_ref){&h->tensors[i], (uint32_t)f};
            s->data_bytes += st_tensor_bytes(&h->tensors[i]);  /* bounded by the files' sizes */
        }
    }
    qsort(refs, n, sizeof(*refs), ref_cmp);
    for (size_t i = 0; i < n; i++) {
        s->by_name[i] = refs[i].t;
        s->by_name_file[i] = refs[i].file;
    }
    free(refs);
    if (s->index == NULL) {
        memcpy(s->order, s->by_name, n * sizeof(*s->order));
        memcpy(s->order_file, s->by_name_file, n * sizeof(*s->order_file));
        return 0;
    }
    /* the index was checked against the shards: every entry names exactly one tensor */
    for (size_t i = 0; i < s->index->nentries; i++) {
        const st_index_entry *e = &s->index->entries[i];
        s->order[i] = st_header_find(s->files[e->shard]->h, e->name, e->name_len);
        s->order_file[i] = e->shard;
    }
    return 0;
}

int st_set_assemble(const char *path, st_index *ix, st_file **files, st_set **out, dl_error *err)
{
    const st_header **headers = NULL;
    st_set *s = calloc(1, sizeof(*s));
    int rc;

    *out = NULL;
    if (s == NULL) {
        for (uint32_t i = 0; i < ix->nshards; i++)
            st_close(files[i]);
        free(files);
        st_index_free(ix);
        return dl_fail(err, DL_E_NO_MEMORY, NULL, 0, "out of memory");
    }
    s->index = ix;
    s->files = files;
    s->nfiles = ix->nshards;
    if ((s->path = strdup(path)) == NULL ||
        (headers = malloc(s->nfiles * sizeof(*headers))) == NULL) {
        rc = dl_fail(err, DL_E_NO_MEMORY, NULL, 0, "out of memory");
        goto fail;
    }
    for (size_t i = 0; i < s->nfiles; i++)
        headers[i] = files[i]->h;
    if ((rc = st_index_check_set(ix, headers, err)) != 0 || (rc = set_tables(s, err)) != 0)
        goto fail;
    free(headers);
    *out = s;
    return 0;
fail:
    free(headers);
    st_set_close(s);
    return rc;
}

int st_set_wrap(st_file *f, st_set **out, dl_error *err)
{
    st_set *s = calloc(1, sizeof(*s));
    int rc;

    *out = NULL;
    if (s == NULL || (s->files = malloc(sizeof(*s->files))) == NULL) {
        free(s);
        st_close(f);
        return dl_fail(err, DL_E_NO_MEMORY, NULL, 0, "out of memory");
    }
    s->files[0] = f;
    s->nfiles = 1;
    if ((s->path = strdup(f->path)) == NULL) {
        st_set_close(s);
        return dl_fail(err, DL_E_NO_MEMORY, NULL, 0, "out of memory");
    }
    if ((rc = set_tables(s, err)) != 0) {
        st_set_close(s);
        return rc;
    }
    *out = s;
    return 0;
}

/* What the headers of a set may cost together (st_set_open_capped): a shard's header is read only
 * once its 8-byte prefix fits what the shards before it left of the cap. */
typedef struct header_budget {
    uint64_t cap;           /* 0: no cap of ours (each file the format's own) */
    uint64_t left;
} header_budget;

/* An index names each tensor once, the shards' headers each with its dtype, shape and offsets: per
 * tensor, at most 6 index bytes per name byte (json.dump's \u00XX) and st_index_cap_for's 244 of
 * punctuation and shard name, against at least 1 header byte per name byte and 49 for
 * "":{"dtype":"U8","shape":[],"data_offsets":[0,0]}.  So the index of a set whose headers fit
 * max_header is at most 6 x max_header, plus 64 KiB for its metadata; at most ST_INDEX_MAX_BYTES. */
static size_t index_cap_for_headers(uint64_t max_header)
{
    uint64_t cap;

    if (max_header > ST_INDEX_MAX_BYTES)        /* past the cap either way; 6 x it could overflow */
        return ST_INDEX_MAX_BYTES;
    cap = 6 * max_header + 64u * 1024u;
    return cap < ST_INDEX_MAX_BYTES ? (size_t)cap : ST_INDEX_MAX_BYTES;
}

/* The header length an 8-byte prefix gives, for a refusal's message (0 when it cannot be read). */
static uint64_t prefix_header_len(const char *path)
{
    unsigned char b[8];
    uint64_t n = 0;
    int fd = open(path, O_RDONLY | O_NONBLOCK | O_CLOEXEC);

    if (fd < 0)
        return 0;
    if (fsu_pread_all(fd, b, 8, 0) == 0) {
        for (int i = 7; i >= 0; i--)
            n = (n << 8) | b[i];
    }
    close(fd);
    return n;
}

/* Shard i of ix, next to the index at path, its header within the budget; the budget is then what
 * is left after it. */
static int open_shard(const char *path, const st_index *ix, uint32_t i, header_budget *b, st_file **out,
                      dl_error *err)
{
    size_t dir_len = (size_t)(file_name_of(path) - path);
    char name[ST_INDEX_BASE_MAX + 40], *p = NULL;
    int rc;

    *out = NULL;
    st_index_shard_name(ix->base, i, ix->nshards, name, sizeof(name));
    /* a valid header is never empty: nothing left means this shard cannot fit (and a cap of 0 would
     * mean none to st_open_capped) */
    if (b->cap != 0 && b->left == 0)
        return dl_fail(err, DL_E_HEADER_TOO_LARGE, NULL, 0,
                       "%s: the %u shards before %s hold the whole %" PRIu64 "-byte cap on a set's headers together "
                       "(max_delta_header_mib)", path, i, name, b->cap);
    if (asprintf(&p, "%.*s%s", (int)dir_len, path, name) < 0)
        return dl_fail(err, DL_E_NO_MEMORY, NULL, 0, "out of memory");
    rc = st_open_capped(p, b->left, out, err);
    if (rc != 0 && err != NULL && err->code == DL_E_IO && err->sys_errno == ENOENT) {
        rc = dl_fail(err, DL_E_KEY_MISMATCH, NULL, 0, "shard %s of the set is missing (the index lists %u shards)",
                     name, ix->nshards);
    } else if (rc != 0 && err != NULL && err->code == DL_E_HEADER_TOO_LARGE && b->left < b->cap) {
        /* refused against what the shards before it left: say which cap it is over */
        uint64_t n = prefix_header_len(p);
        if (n > b->cap)
            rc = dl_fail(err, DL_E_HEADER_TOO_LARGE, NULL, 0, "%s: a header of %" PRIu64 " bytes, the cap is %" PRIu64
                         " (max_delta_header_mib)", p, n, b->cap);
        else
            rc = dl_fail(err, DL_E_HEADER_TOO_LARGE, NULL, 0,
                         "%s: the header of %s (%" PRIu64 " bytes) is over the %" PRIu64 " bytes the %u shards before "
                         "it left of the %" PRIu64 "-byte cap on a set's headers together (max_delta_header_mib)",
                         path, name, n, b->left, i, b->cap);
    }
    free(p);
    if (rc != 0)
        return rc;
    if (b->cap != 0)
        b->left -= (*out)->data_start - 8;
    /* a shard's descriptor is opened as its tensors are read: sets of many shards from many nodes
     * would otherwise hold nodes x shards descriptors at once */
    if ((rc = st_file_lazy(*out, err)) != 0) {
        st_close(*out);
        *out = NULL;
    }
    return rc;
}

int st_set_open(const char *path, st_set **out, dl_error *err)
{
    return st_set_open_capped(path, 0, out, err);
}

int st_set_open_capped(const char *path, uint64_t max_header, st_set **out, dl_error *err)
{
    size_t plen = strlen(path), stem;
    header_budget budget = {max_header, max_header};
    st_index *ix = NULL;
    st_file **files, *f;
    int rc;

    *out = NULL;
    if (!ends_with(path, plen, ST_INDEX_SUFFIX, &stem)) {
        if ((rc = st_open_capped(path, max_header, &f, err)) != 0)
            return rc;
        return st_set_wrap(f, out, err);
    }
    rc = max_header != 0 ? st_index_load_capped(path, index_cap_for_headers(max_header), &ix, err)
                         : st_index_load(path, &ix, err);
    if (rc != 0)
        return rc;
    if ((files = calloc(ix->nshards, sizeof(*files))) == NULL) {
        st_index_free(ix);
        return dl_fail(err, DL_E_NO_MEMORY, NULL, 0, "out of memory");
    }
    for (uint32_t i = 0; i < ix->nshards; i++) {
        if ((rc = open_shard(path, ix, i, &budget, &files[i], err)) != 0)
            goto fail;
    }
    return st_set_assemble(path, ix, files, out, err);
fail:
    for (uint32_t i = 0; i < ix->nshards; i++)
        st_close(files[i]);
    free(files);
    st_index_free(ix);
    return rc;
}

const st_tensor *st_set_find(const st_set *s, const char *name, size_t name_len, uint32_t *file)
{
    size_t lo = 0, hi = s->ntensors;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        const st_tensor *t = s->by_name[mid];
        int c = bytes_cmp(t->name, t->name_len, name, name_len);
        if (c == 0) {
            if (file != NULL)
                *file = s->by_name_file[mid];
            return t;
        }
        if (c < 0)
            lo = mid + 1;
        else
            hi = mid;
    }
    return NULL;
}

int st_set_read(const st_set *s, uint32_t file, const st_tensor *t, uint64_t off, void *buf, size_t len,
                dl_error *err)
{
    if (file >= s->nfiles)
        return dl_fail(err, DL_E_INVALID_ARGUMENT, t->name, t->name_len, "no file %u in the set", file);
    return st_read(s->files[file], t, off, buf, len, err);
}

void st_set_metadata(const st_set *s, const st_meta **meta, size_t *n)
{
    if (s->index != NULL) {
        *meta = s->index->meta;
        *n = s->index->nmeta;
    } else {
        *meta = s->files[0]->h->meta;
        *n = s->files[0]->h->nmeta;
    }
}

/* ---- writing --------------------------------------------------------------------------------- */

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

struct st_set_writer {
    char *path;             /* the single file, or the index */
    char *dir;              /* directory of the output ("." when none) */
    char base[ST_INDEX_BASE_MAX + 1];
    int has_base;           /* path follows the convention: earlier layouts can be cleaned up */
    uint32_t nshards;
    st_writer **shards;     /* nshards writers (one: the plain file) */
    uint32_t *shard_of;     /* spec -> shard */
    size_t *local;          /* spec -> index within its shard's specs */
    char *index_json;
    size_t index_len;
};

static void writer_free(st_set_writer *w)
{
    if (w == NULL)
        return;
    free(w->shards);
    free(w->shard_of);
    free(w->local);
    free(w->index_json);
    free(w->path);
    free(w->dir);
    free(w);
}

void st_set_writer_abort(st_set_writer *w)
{
    if (w == NULL)
        return;
    for (uint32_t s = 0; s < w->nshards; s++)
        st_writer_abort(w->shards[s]);
    writer_free(w);
}

/* Splits path into directory and base (<base>.safetensors or <base>.safetensors.index.json). */
static int writer_names(st_set_writer *w, const char *path)
{
    const char *name = file_name_of(path);
    size_t nlen = strlen(name), stem;
    uint32_t i, n;
    char base[ST_INDEX_BASE_MAX + 1];

    if ((w->dir = name == path ? strdup(".") : strndup(path, (size_t)(name - path))) == NULL)
        return -1;
    st_name_kind k = st_index_classify(name, nlen, base, &i, &n);
    if (k == ST_NAME_SINGLE || k == ST_NAME_INDEX) {
        memcpy(w->base, base, sizeof(base));
        w->has_base = 1;
    }
    (void)stem;
    return 0;
}

int st_set_writer_open(const char *path, const st_spec *specs, size_t n, const st_kv *meta, size_t nmeta,
                       uint64_t max_shard_size, st_set_writer **out, dl_error *err)
{
    return st_set_writer_open_glued(path, specs, n, NULL, meta, nmeta, max_shard_size, out, err);
}

int st_set_writer_open_glued(const char *path, const st_spec *specs, size_t n, const unsigned char *glue,
                             const st_kv *meta, size_t nmeta, uint64_t max_shard_size, st_set_writer **out,
                             dl_error *err)
{
    st_set_writer *w = calloc(1, sizeof(*w));
    st_spec *part = NULL;
    int rc;

    *out = NULL;
    if (w == NULL || writer_names(w, path) != 0 || (w->shard_of = malloc((n ? n : 1) * sizeof(*w->shard_of))) == NULL ||
        (w->local = malloc((n ? n : 1) * sizeof(*w->local))) == NULL) {
        rc = dl_fail(err, DL_E_NO_MEMORY, NULL, 0, "out of memory");
        goto fail;
    }
    for (size_t m = 0; m < nmeta; m++) {
        if (dl_utf8_check(meta[m].key, strlen(meta[m].key), NULL) != 0 ||
            dl_utf8_check(meta[m].value, strlen(meta[m].value), NULL) != 0) {
            rc = dl_fail(err, DL_E_INVALID_ARGUMENT, NULL, 0, "metadata is not UTF-8");
            goto fail;
        }
    }
    if ((rc = st_index_plan_glued(specs, n, glue, max_shard_size, w->shard_of, &w->nshards, err)) != 0)
        goto fail;
    if (w->nshards > 1 && !w->has_base) {
        rc = dl_fail(err, DL_E_INVALID_ARGUMENT, NULL, 0,
                     "%s: a sharded output is named <base>.safetensors (base of [A-Za-z0-9._-])", path);
        goto fail;
    }
    if ((w->shards = calloc(w->nshards, sizeof(*w->shards))) == NULL) {
        rc = dl_fail(err, DL_E_NO_MEMORY, NULL, 0, "out of memory");
        goto fail;
    }
    if (w->nshards == 1) {
        memset(w->shard_of, 0, (n ? n : 1) * sizeof(*w->shard_of));
        for (size_t i = 0; i < n; i++)
            w->local[i] = i;
        /* the plain file: exactly what st_writer_open writes today */
        if ((w->path = strdup(path)) == NULL) {
            rc = dl_fail(err, DL_E_NO_MEMORY, NULL, 0, "out of memory");
            goto fail;
        }
        if ((rc = st_writer_open(path, specs, n, meta, nmeta, &w->shards[0], err)) != 0)
            goto fail;
        *out = w;
        return 0;
    }
    if (asprintf(&w->path, "%s/%s" ST_INDEX_SUFFIX, w->dir, w->base) < 0) {
        w->path = NULL;
        rc = dl_fail(err, DL_E_NO_MEMORY, NULL, 0, "out of memory");
        goto fail;
    }
    if ((w->index_json = st_index_build_json(w->base, specs, n, w->shard_of, w->nshards, meta, nmeta,
                                             &w->index_len)) == NULL ||
        (part = malloc(n * sizeof(*part))) == NULL) {
        rc = dl_fail(err, DL_E_NO_MEMORY, NULL, 0, "out of memory");
        goto fail;
    }
    static const st_kv format_pt[] = {{"format", "pt"}};
    for (uint32_t s = 0; s < w->nshards; s++) {
        char name[ST_INDEX_BASE_MAX + 40], *p = NULL;
        size_t k = 0;
        for (size_t i = 0; i < n; i++) {
            if (w->shard_of[i] == s) {
                w->local[i] = k;
                part[k++] = specs[i];
            }
        }
        st_index_shard_name(w->base, s, w->nshards, name, sizeof(name));
        if (asprintf(&p, "%s/%s", w->dir, name) < 0) {
            rc = dl_fail(err, DL_E_NO_MEMORY, NULL, 0, "out of memory");
            goto fail;
        }
        rc = st_writer_open(p, part, k, format_pt, 1, &w->shards[s], err);
        free(p);
        if (rc != 0)
            goto fail;
    }
    free(part);
    *out = w;
    return 0;
fail:
    free(part);
    st_set_writer_abort(w);
    return rc;
}

int st_set_writer_write(st_set_writer *w, size_t spec_index, uint64_t off, const void *buf, size_t len,
                        dl_error *err)
{
    return st_writer_write(w->shards[w->shard_of[spec_index]], w->local[spec_index], off, buf, len, err);
}

uint32_t st_set_writer_nshards(const st_set_writer *w)
{
    return w->nshards;
}

/* Removes what another layout of the same base left in the directory (huggingface_hub removes
 * them before saving; here after the new files are durable, so a crash never leaves neither). */
static int remove_other_layouts(const st_set_writer *w, dl_error *err)
{
    DIR *d;
    struct dirent *de;
    int rc = 0;

    if (!w->has_base)
        return 0;
    if ((d = opendir(w->dir)) == NULL)
        return dl_fail_errno(err, errno, "cannot list %s", w->dir);
    while ((de = readdir(d)) != NULL) {
        char base[ST_INDEX_BASE_MAX + 1];
        uint32_t i, n;
        st_name_kind k = st_index_classify(de->d_name, strlen(de->d_name), base, &i, &n);
        if (k == ST_NAME_OTHER || strcmp(base, w->base) != 0)
            continue;
        int stale = w->nshards == 1 ? (k == ST_NAME_INDEX || k == ST_NAME_SHARD)
                                    : (k == ST_NAME_SINGLE || (k == ST_NAME_SHARD && n != w->nshards));
        if (stale && unlinkat(dirfd(d), de->d_name, 0) != 0 && errno != ENOENT) {
            rc = dl_fail_errno(err, errno, "cannot remove %s/%s", w->dir, de->d_name);
            break;
        }
    }
    closedir(d);
    return rc;
}

int st_set_writer_commit(st_set_writer *w, dl_error *err)
{
    int rc = 0;

    for (uint32_t s = 0; s < w->nshards; s++) {
        st_writer *x = w->shards[s];
        w->shards[s] = NULL;
        if (rc == 0)
            rc = st_writer_commit(x, err);
        else
            st_writer_abort(x);
    }
    if (rc == 0 && w->nshards > 1)
        rc = fsu_write_atomic(w->path, w->index_json, w->index_len, err);
    if (rc == 0)
        rc = remove_other_layouts(w, err);
    writer_free(w);
    return rc;
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
