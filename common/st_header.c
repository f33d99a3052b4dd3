/* Strict parser and validator of the safetensors JSON header.
 *
 * Why not cJSON: it silently lets a duplicate key win, stores numbers as doubles (offsets above 2^53
 * lose precision and "2.0", "2e0" or "-0" would pass for integers) and does not cap nesting depth.
 * Each of those is a parser differential against the reference, so the header grammar is parsed here
 * by a small recursive-descent parser that mirrors serde_json on the reference's schema. */
#include "safetensors.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

static const struct { const char *name; unsigned bits; int floating; } dtype_info[ST_DTYPE_COUNT] = {
    [ST_BOOL] = {"BOOL", 8, 0},           [ST_F4] = {"F4", 4, 1},
    [ST_F6_E2M3] = {"F6_E2M3", 6, 1},     [ST_F6_E3M2] = {"F6_E3M2", 6, 1},
    [ST_U8] = {"U8", 8, 0},               [ST_I8] = {"I8", 8, 0},
    [ST_F8_E5M2] = {"F8_E5M2", 8, 1},     [ST_F8_E4M3] = {"F8_E4M3", 8, 1},
    [ST_F8_E8M0] = {"F8_E8M0", 8, 1},     [ST_F8_E4M3FNUZ] = {"F8_E4M3FNUZ", 8, 1},
    [ST_F8_E5M2FNUZ] = {"F8_E5M2FNUZ", 8, 1},
    [ST_I16] = {"I16", 16, 0},            [ST_U16] = {"U16", 16, 0},
    [ST_F16] = {"F16", 16, 1},            [ST_BF16] = {"BF16", 16, 1},
    [ST_I32] = {"I32", 32, 0},            [ST_U32] = {"U32", 32, 0},
    [ST_F32] = {"F32", 32, 1},            [ST_C64] = {"C64", 64, 1},
    [ST_F64] = {"F64", 64, 1},            [ST_I64] = {"I64", 64, 0},
    [ST_U64] = {"U64", 64, 0},
};

const char *st_dtype_name(st_dtype dt)
{
    return (unsigned)dt < ST_DTYPE_COUNT ? dtype_info[dt].name : "?";
}

unsigned st_dtype_bits(st_dtype dt)
{
    return (unsigned)dt < ST_DTYPE_COUNT ? dtype_info[dt].bits : 0;
}

int st_dtype_is_floating(st_dtype dt)
{
    return (unsigned)dt < ST_DTYPE_COUNT && dtype_info[dt].floating;
}

int st_dtype_parse(const char *name, size_t len, st_dtype *out)
{
    for (int i = 0; i < ST_DTYPE_COUNT; i++) {
        if (strlen(dtype_info[i].name) == len && memcmp(dtype_info[i].name, name, len) == 0) {
            *out = (st_dtype)i;
            return 0;
        }
    }
    return -1;
}

int st_nbytes(st_dtype dt, const uint64_t *shape, size_t ndim, uint64_t *nelem, uint64_t *nbytes,
              dl_error *err, const char *name, size_t name_len)
{
    uint64_t n = 1, bits;

    for (size_t i = 0; i < ndim; i++) {
        if (__builtin_mul_overflow(n, shape[i], &n))
            return dl_fail(err, DL_E_VALIDATION_OVERFLOW, name, name_len,
                           "shape of tensor overflows the element count");
    }
    if (__builtin_mul_overflow(n, (uint64_t)st_dtype_bits(dt), &bits))
        return dl_fail(err, DL_E_VALIDATION_OVERFLOW, name, name_len,
                       "size in bits of tensor overflows");
    if (bits % 8 != 0)
        return dl_fail(err, DL_E_MISALIGNED_SLICE, name, name_len,
                       "%s tensor of %llu elements does not fill whole bytes", st_dtype_name(dt),
                       (unsigned long long)n);
    *nelem = n;
    *nbytes = bits / 8;
    return 0;
}

/* ---- JSON scanning ---------------------------------------------------------------------------- */

typedef struct jp {
    const unsigned char *s;
    size_t n, pos;
    int depth;
    dl_error *err;
} jp;

typedef struct jstr {   /* a decoded JSON string (malloc'd, NUL-terminated, may contain NUL) */
    char *p;
    size_t len;
} jstr;

static int jp_fail(jp *p, const char *what)
{
    return dl_fail(p->err, DL_E_INVALID_HEADER_DESERIALIZATION, NULL, 0,
                   "invalid JSON in header: %s at byte %zu", what, p->pos);
}

static void jp_ws(jp *p)
{
    while (p->pos < p->n) {
        unsigned char c = p->s[p->pos];
        if (c != ' ' && c != '\t' && c != '\n' && c != '\r')
            break;
        p->pos++;
    }
}

static int jp_peek(jp *p)
{
    jp_ws(p);
    return p->pos < p->n ? p->s[p->pos] : -1;
}

static int jp_hex4(jp *p, unsigned *out)
{
    unsigned v = 0;

    if (p->n - p->pos < 4)
        return jp_fail(p, "EOF in \\u escape");
    for (int i = 0; i < 4; i++) {
        int h = dl_hex_digit(p->s[p->pos + i]);
        if (h < 0)
            return jp_fail(p, "invalid \\u escape");
        v = (v << 4) | (unsigned)h;
    }
    p->pos += 4;
    *out = v;
    return 0;
}

/* Parses a string at the current position (which must be '"').  The input is already known to be
 * valid UTF-8, so raw bytes are copied; escapes are decoded as serde_json does (a lone surrogate is
 * an error).  When out is NULL the string is only checked. */
static int jp_string(jp *p, jstr *out)
{
    size_t start, cap;
    char *buf = NULL;
    size_t len = 0;
    int rc;

    if (p->pos >= p->n || p->s[p->pos] != '"')
        return jp_fail(p, "expected string");
    p->pos++;
    start = p->pos;
    /* The decoded form is never longer than the raw form: size the buffer by a first scan. */
    while (p->pos < p->n && p->s[p->pos] != '"') {
        if (p->s[p->pos] == '\\')
            p->pos++;
        p->pos++;
    }
    if (p->pos >= p->n)
        return jp_fail(p, "EOF while parsing a string");
    cap = p->pos - start + 1;
    p->pos = start;
    if (out != NULL) {
        buf = malloc(cap);
        if (buf == NULL)
            return dl_fail(p->err, DL_E_NO_MEMORY, NULL, 0, "out of memory parsing header");
    }
    for (;;) {
        unsigned char c = p->s[p->pos];
        if (c == '"') {
            p->pos++;
            break;
        }
        if (c < 0x20) {
            rc = jp_fail(p, "control character in string");
            goto fail;
        }
        if (c != '\\') {
            if (buf) buf[len] = (char)c;
            len++;
            p->pos++;
            continue;
        }
        p->pos++;
        c = p->s[p->pos++];
        char e;
        switch (c) {
        case '"': e = '"'; break;
        case '\\': e = '\\'; break;
        case '/': e = '/'; break;
        case 'b': e = '\b'; break;
        case 'f': e = '\f'; break;
        case 'n': e = '\n'; break;
        case 'r': e = '\r'; break;
        case 't': e = '\t'; break;
        case 'u': {
            unsigned cp, lo;
            if ((rc = jp_hex4(p, &cp)) != 0)
                goto fail;
            if (cp >= 0xdc00 && cp <= 0xdfff) {
                rc = jp_fail(p, "lone trailing surrogate in \\u escape");
                goto fail;
            }
            if (cp >= 0xd800 && cp <= 0xdbff) {
                if (p->n - p->pos < 2 || p->s[p->pos] != '\\' || p->s[p->pos + 1] != 'u') {
                    rc = jp_fail(p, "lone leading surrogate in \\u escape");
                    goto fail;
                }
                p->pos += 2;
                if ((rc = jp_hex4(p, &lo)) != 0)
                    goto fail;
                if (lo < 0xdc00 || lo > 0xdfff) {
                    rc = jp_fail(p, "invalid surrogate pair in \\u escape");
                    goto fail;
                }
                cp = 0x10000 + ((cp - 0xd800) << 10) + (lo - 0xdc00);
            }
            char tmp[4];
            size_t k = dl_utf8_put(tmp, cp);
            if (buf) memcpy(buf + len, tmp, k);
            len += k;
            continue;
        }
        default:
            rc = jp_fail(p, "invalid escape");
            goto fail;
        }
        if (buf) buf[len] = e;
        len++;
    }
    if (out != NULL) {
        buf[len] = '\0';
        out->p = buf;
        out->len = len;
    }
    return 0;
fail:
    free(buf);
    return rc;
}

/* Number grammar of RFC 8259.  With u64 != NULL the number must be a non-negative integer literal
 * that fits in 64 bits (what serde accepts for usize): no sign, fraction or exponent. */
static int jp_number(jp *p, uint64_t *u64)
{
    size_t start = p->pos;
    int neg = 0, frac = 0;
    uint64_t v = 0;
    int overflow = 0;

    if (p->pos < p->n && p->s[p->pos] == '-') {
        neg = 1;
        p->pos++;
    }
    if (p->pos >= p->n || p->s[p->pos] < '0' || p->s[p->pos] > '9')
        return jp_fail(p, "invalid number");
    if (p->s[p->pos] == '0') {
        p->pos++;
        if (p->pos < p->n && p->s[p->pos] >= '0' && p->s[p->pos] <= '9')
            return jp_fail(p, "invalid number (leading zero)");
    } else {
        while (p->pos < p->n && p->s[p->pos] >= '0' && p->s[p->pos] <= '9') {
            if (__builtin_mul_overflow(v, 10, &v) ||
                __builtin_add_overflow(v, (uint64_t)(p->s[p->pos] - '0'), &v))
                overflow = 1;
            p->pos++;
        }
    }
    if (p->pos < p->n && p->s[p->pos] == '.') {
        frac = 1;
        p->pos++;
        if (p->pos >= p->n || p->s[p->pos] < '0' || p->s[p->pos] > '9')
            return jp_fail(p, "invalid number");
        while (p->pos < p->n && p->s[p->pos] >= '0' && p->s[p->pos] <= '9')
            p->pos++;
    }
    if (p->pos < p->n && (p->s[p->pos] == 'e' || p->s[p->pos] == 'E')) {
        frac = 1;
        p->pos++;
        if (p->pos < p->n && (p->s[p->pos] == '+' || p->s[p->pos] == '-'))
            p->pos++;
        if (p->pos >= p->n || p->s[p->pos] < '0' || p->s[p->pos] > '9')
            return jp_fail(p, "invalid number");
        while (p->pos < p->n && p->s[p->pos] >= '0' && p->s[p->pos] <= '9')
            p->pos++;
    }
    if (u64 == NULL) {
        /* serde_json reads every number, even an ignored one, as an integer or an f64, and refuses
         * one whose magnitude overflows f64 (1e400, a 310-digit integer). */
        size_t len = p->pos - start;
        char small[64], *text = len < sizeof(small) ? small : malloc(len + 1);
        double d;
        if (text == NULL)
            return dl_fail(p->err, DL_E_NO_MEMORY, NULL, 0, "out of memory parsing header");
        memcpy(text, p->s + start, len);
        text[len] = '\0';
        d = strtod(text, NULL);
        if (text != small)
            free(text);
        if (isinf(d)) {
            p->pos = start;
            return jp_fail(p, "number out of range");
        }
        return 0;
    }
    {
        if (neg || frac) {
            p->pos = start;
            return jp_fail(p, "expected a non-negative integer");
        }
        if (overflow) {
            p->pos = start;
            return jp_fail(p, "integer does not fit in 64 bits");
        }
        *u64 = v;
    }
    return 0;
}

static int jp_literal(jp *p, const char *lit)
{
    size_t l = strlen(lit);

    if (p->n - p->pos < l || memcmp(p->s + p->pos, lit, l) != 0)
        return jp_fail(p, "expected value");
    p->pos += l;
    return 0;
}

static int jp_enter(jp *p)
{
    /* serde_json starts with 128 levels to spend and fails when none is left: 127 levels nest. */
    if (++p->depth >= ST_MAX_JSON_DEPTH)
        return jp_fail(p, "recursion limit exceeded");
    return 0;
}

static int jstr_cmp(const void *a, const void *b)
{
    const jstr *x = a, *y = b;
    size_t m = x->len < y->len ? x->len : y->len;
    int c = memcmp(x->p, y->p, m);
    if (c != 0)
        return c;
    return (x->len > y->len) - (x->len < y->len);
}

static void jstrs_free(jstr *v, size_t n)
{
    for (size_t i = 0; i < n; i++)
        free(v[i].p);
    free(v);
}

/* Appends s to a growable vector of strings (takes ownership of s->p on success). */
static int jstrs_push(jp *p, jstr **v, size_t *n, size_t *cap, jstr *s)
{
    if (*n == *cap) {
        size_t nc = *cap ? *cap * 2 : 8;
        jstr *nv = realloc(*v, nc * sizeof(*nv));
        if (nv == NULL)
            return dl_fail(p->err, DL_E_NO_MEMORY, NULL, 0, "out of memory parsing header");
        *v = nv;
        *cap = nc;
    }
    (*v)[(*n)++] = *s;
    s->p = NULL;
    return 0;
}

/* Sorts keys and reports the first duplicate.  owner (may be NULL) is the tensor the object belongs
 * to, named in the error; keys are freed by the caller. */
static int check_unique(jp *p, jstr *keys, size_t n, const char *where, const st_tensor *owner)
{
    if (n < 2)
        return 0;
    qsort(keys, n, sizeof(*keys), jstr_cmp);
    for (size_t i = 1; i < n; i++) {
        if (jstr_cmp(&keys[i - 1], &keys[i]) == 0) {
            char shown[96];
            dl_printable(shown, sizeof(shown), keys[i].p, keys[i].len);
            return dl_fail(p->err, DL_E_DUPLICATE_KEY, owner ? owner->name : NULL,
                           owner ? owner->name_len : 0, "duplicate key \"%s\" in %s", shown, where);
        }
    }
    return 0;
}

static int jp_value(jp *p);

/* An object or array whose content we do not interpret (unknown field of a tensor entry):
 * still a complete, valid JSON value with unique keys and bounded depth. */
static int jp_object_generic(jp *p)
{
    jstr *keys = NULL;
    size_t nkeys = 0, cap = 0;
    int rc, c;

    if ((rc = jp_enter(p)) != 0)
        return rc;
    p->pos++;                           /* '{' */
    if ((c = jp_peek(p)) == '}') {
        p->pos++;
        p->depth--;
        return 0;
    }
    for (;;) {
        jstr k = {0};
        if (jp_peek(p) != '"') { rc = jp_fail(p, "expected key"); goto out; }
        if ((rc = jp_string(p, &k)) != 0) goto out;
        if ((rc = jstrs_push(p, &keys, &nkeys, &cap, &k)) != 0) { free(k.p); goto out; }
        if (jp_peek(p) != ':') { rc = jp_fail(p, "expected ':'"); goto out; }
        p->pos++;
        if ((rc = jp_value(p)) != 0) goto out;
        c = jp_peek(p);
        if (c == ',') { p->pos++; continue; }
        if (c == '}') { p->pos++; break; }
        rc = jp_fail(p, c < 0 ? "EOF while parsing an object" : "expected ',' or '}'");
        goto out;
    }
    rc = check_unique(p, keys, nkeys, "a nested object", NULL);
    p->depth--;
out:
    jstrs_free(keys, nkeys);
    return rc;
}

static int jp_array_generic(jp *p)
{
    int rc, c;

    if ((rc = jp_enter(p)) != 0)
        return rc;
    p->pos++;                           /* '[' */
    if (jp_peek(p) == ']') {
        p->pos++;
        p->depth--;
        return 0;
    }
    for (;;) {
        if ((rc = jp_value(p)) != 0)
            return rc;
        c = jp_peek(p);
        if (c == ',') { p->pos++; continue; }
        if (c == ']') { p->pos++; break; }
        return jp_fail(p, c < 0 ? "EOF while parsing a list" : "expected ',' or ']'");
    }
    p->depth--;
    return 0;
}

static int jp_value(jp *p)
{
    switch (jp_peek(p)) {
    case '{': return jp_object_generic(p);
    case '[': return jp_array_generic(p);
    case '"': return jp_string(p, NULL);
    case 't': return jp_literal(p, "true");
    case 'f': return jp_literal(p, "false");
    case 'n': return jp_literal(p, "null");
    case -1: return jp_fail(p, "EOF while parsing a value");
    default: return jp_number(p, NULL);
    }
}

/* [u64, ...] into a malloc'd vector. */
static int jp_u64_array(jp *p, uint64_t **out, size_t *count)
{
    uint64_t *v = NULL, x;
    size_t n = 0, cap = 0;
    int rc, c;

    if (jp_peek(p) != '[')
        return jp_fail(p, "expected an array of integers");
    if ((rc = jp_enter(p)) != 0)
        return rc;
    p->pos++;
    if (jp_peek(p) == ']') {
        p->pos++;
        goto done;
    }
    for (;;) {
        jp_ws(p);
        if ((rc = jp_number(p, &x)) != 0)
            goto fail;
        if (n == cap) {
            size_t nc = cap ? cap * 2 : 4;
            uint64_t *nv = realloc(v, nc * sizeof(*nv));
            if (nv == NULL) {
                rc = dl_fail(p->err, DL_E_NO_MEMORY, NULL, 0, "out of memory parsing header");
                goto fail;
            }
            v = nv;
            cap = nc;
        }
        v[n++] = x;
        c = jp_peek(p);
        if (c == ',') { p->pos++; continue; }
        if (c == ']') { p->pos++; break; }
        rc = jp_fail(p, c < 0 ? "EOF while parsing a list" : "expected ',' or ']'");
        goto fail;
    }
done:
    p->depth--;
    *out = v;
    *count = n;
    return 0;
fail:
    free(v);
    return rc;
}

static int name_is(const jstr *s, const char *lit)
{
    return s->len == strlen(lit) && memcmp(s->p, lit, s->len) == 0;
}

/* {"dtype":..., "shape":[...], "data_offsets":[b,e], <ignored>...} for tensor t (name already set). */
static int jp_tensor_entry(jp *p, st_tensor *t)
{
    int have_dtype = 0, have_shape = 0, have_offsets = 0;
    jstr *keys = NULL;
    size_t nkeys = 0, cap = 0;
    int rc, c;

    if (jp_peek(p) != '{') {
        rc = dl_fail(p->err, DL_E_INVALID_HEADER_DESERIALIZATION, t->name, t->name_len,
                     "invalid JSON in header: tensor entry is not an object at byte %zu", p->pos);
        return rc;
    }
    if ((rc = jp_enter(p)) != 0)
        return rc;
    p->pos++;
    if (jp_peek(p) == '}') {
        p->pos++;
        goto close;
    }
    for (;;) {
        jstr k = {0};
        if (jp_peek(p) != '"') { rc = jp_fail(p, "expected key"); goto out; }
        if ((rc = jp_string(p, &k)) != 0) goto out;
        if (jp_peek(p) != ':') { free(k.p); rc = jp_fail(p, "expected ':'"); goto out; }
        p->pos++;
        if (name_is(&k, "dtype")) {
            jstr d = {0};
            have_dtype = 1;
            if (jp_peek(p) != '"') {
                rc = jp_fail(p, "dtype is not a string");
            } else if ((rc = jp_string(p, &d)) == 0) {
                if (st_dtype_parse(d.p, d.len, &t->dtype) != 0) {
                    char shown[64];
                    dl_printable(shown, sizeof(shown), d.p, d.len);
                    rc = dl_fail(p->err, DL_E_INVALID_HEADER_DESERIALIZATION, t->name, t->name_len,
                                 "invalid JSON in header: unknown dtype \"%s\"", shown);
                }
                free(d.p);
            }
        } else if (name_is(&k, "shape")) {
            have_shape = 1;
            free(t->shape);
            t->shape = NULL;
            rc = jp_u64_array(p, &t->shape, &t->ndim);
        } else if (name_is(&k, "data_offsets")) {
            uint64_t *v = NULL;
            size_t nv = 0;
            have_offsets = 1;
            rc = jp_u64_array(p, &v, &nv);
            if (rc == 0 && nv != 2)
                rc = dl_fail(p->err, DL_E_INVALID_HEADER_DESERIALIZATION, t->name, t->name_len,
                             "invalid JSON in header: data_offsets has %zu values, expected 2", nv);
            if (rc == 0) {
                t->begin = v[0];
                t->end = v[1];
            }
            free(v);
        } else {
            rc = jp_value(p);           /* the reference ignores unknown fields */
        }
        if (rc == 0)
            rc = jstrs_push(p, &keys, &nkeys, &cap, &k);
        free(k.p);
        if (rc != 0)
            goto out;
        c = jp_peek(p);
        if (c == ',') { p->pos++; continue; }
        if (c == '}') { p->pos++; break; }
        rc = jp_fail(p, c < 0 ? "EOF while parsing an object" : "expected ',' or '}'");
        goto out;
    }
    if ((rc = check_unique(p, keys, nkeys, "a tensor entry", t)) != 0)
        goto out;
close:
    p->depth--;
    if (!have_dtype || !have_shape || !have_offsets)
        rc = dl_fail(p->err, DL_E_INVALID_HEADER_DESERIALIZATION, t->name, t->name_len,
                     "invalid JSON in header: missing field `%s`",
                     !have_dtype ? "dtype" : !have_shape ? "shape" : "data_offsets");
out:
    jstrs_free(keys, nkeys);
    return rc;
}

/* "__metadata__": null or {string: string}. */
static int jp_metadata(jp *p, st_header *h)
{
    size_t cap = 0;
    int rc, c;

    c = jp_peek(p);
    if (c == 'n')
        return jp_literal(p, "null");
    if (c != '{')
        return jp_fail(p, "__metadata__ is not an object");
    h->has_metadata = 1;
    if ((rc = jp_enter(p)) != 0)
        return rc;
    p->pos++;
    if (jp_peek(p) == '}') {
        p->pos++;
        p->depth--;
        return 0;
    }
    for (;;) {
        jstr k = {0}, v = {0};
        if (jp_peek(p) != '"')
            return jp_fail(p, "expected key");
        if ((rc = jp_string(p, &k)) != 0)
            return rc;
        if (jp_peek(p) != ':') {
            free(k.p);
            return jp_fail(p, "expected ':'");
        }
        p->pos++;
        if (jp_peek(p) != '"') {
            rc = dl_fail(p->err, DL_E_INVALID_HEADER_DESERIALIZATION, NULL, 0,
                         "invalid JSON in header: __metadata__ value for key \"%.64s\" is not a string",
                         k.p);
            free(k.p);
            return rc;
        }
        if ((rc = jp_string(p, &v)) != 0) {
            free(k.p);
            return rc;
        }
        if (h->nmeta == cap) {
            size_t nc = cap ? cap * 2 : 8;
            st_meta *nm = realloc(h->meta, nc * sizeof(*nm));
            if (nm == NULL) {
                free(k.p);
                free(v.p);
                return dl_fail(p->err, DL_E_NO_MEMORY, NULL, 0, "out of memory parsing header");
            }
            h->meta = nm;
            cap = nc;
        }
        h->meta[h->nmeta++] = (st_meta){k.p, k.len, v.p, v.len};
        c = jp_peek(p);
        if (c == ',') { p->pos++; continue; }
        if (c == '}') { p->pos++; break; }
        return jp_fail(p, c < 0 ? "EOF while parsing an object" : "expected ',' or '}'");
    }
    p->depth--;
    return 0;
}

static int meta_cmp(const void *a, const void *b)
{
    const st_meta *x = a, *y = b;
    jstr xs = {x->key, x->key_len}, ys = {y->key, y->key_len};
    return jstr_cmp(&xs, &ys);
}

/* qsort_r comparator: headers are parsed on several threads at once, so no static sort context. */
static int by_name_cmp(const void *a, const void *b, void *ctx)
{
    const st_header *h = ctx;
    const st_tensor *x = &h->tensors[*(const size_t *)a];
    const st_tensor *y = &h->tensors[*(const size_t *)b];
    jstr xs = {x->name, x->name_len}, ys = {y->name, y->name_len};
    return jstr_cmp(&xs, &ys);
}

static int by_offset_cmp(const void *a, const void *b)
{
    const st_tensor *x = a, *y = b;
    if (x->begin != y->begin)
        return x->begin < y->begin ? -1 : 1;
    if (x->end != y->end)
        return x->end < y->end ? -1 : 1;
    return 0;
}

/* Top-level object: tensor entries and an optional __metadata__. */
static int jp_header(jp *p, st_header *h)
{
    size_t cap = 0;
    int seen_meta = 0;
    int rc, c;

    if ((c = jp_peek(p)) != '{')
        return jp_fail(p, c < 0 ? "EOF while parsing a value" : "header is not a JSON object");
    if ((rc = jp_enter(p)) != 0)
        return rc;
    p->pos++;
    if (jp_peek(p) == '}') {
        p->pos++;
        goto end;
    }
    for (;;) {
        jstr k = {0};
        if (jp_peek(p) != '"')
            return jp_fail(p, "expected key");
        if ((rc = jp_string(p, &k)) != 0)
            return rc;
        if (jp_peek(p) != ':') {
            free(k.p);
            return jp_fail(p, "expected ':'");
        }
        p->pos++;
        if (name_is(&k, "__metadata__")) {
            free(k.p);
            if (seen_meta)
                return dl_fail(p->err, DL_E_DUPLICATE_KEY, "__metadata__", 12,
                               "duplicate key \"__metadata__\" in header");
            seen_meta = 1;
            if ((rc = jp_metadata(p, h)) != 0)
                return rc;
        } else {
            if (h->ntensors == cap) {
                size_t nc = cap ? cap * 2 : 16;
                st_tensor *nt = realloc(h->tensors, nc * sizeof(*nt));
                if (nt == NULL) {
                    free(k.p);
                    return dl_fail(p->err, DL_E_NO_MEMORY, NULL, 0, "out of memory parsing header");
                }
                h->tensors = nt;
                cap = nc;
            }
            st_tensor *t = &h->tensors[h->ntensors++];
            memset(t, 0, sizeof(*t));
            t->name = k.p;
            t->name_len = k.len;
            if ((rc = jp_tensor_entry(p, t)) != 0)
                return rc;
        }
        c = jp_peek(p);
        if (c == ',') { p->pos++; continue; }
        if (c == '}') { p->pos++; break; }
        return jp_fail(p, c < 0 ? "EOF while parsing an object" : "expected ',' or '}'");
    }
end:
    p->depth--;
    if (jp_peek(p) != -1)
        return jp_fail(p, "trailing characters");
    return 0;
}

/* The reference's Metadata::validate(), plus duplicate names. */
static int validate(st_header *h, dl_error *err)
{
    uint64_t start = 0;

    if (h->ntensors > 0) {
        h->by_name = malloc(h->ntensors * sizeof(*h->by_name));
        if (h->by_name == NULL)
            return dl_fail(err, DL_E_NO_MEMORY, NULL, 0, "out of memory validating header");
        for (size_t i = 0; i < h->ntensors; i++)
            h->by_name[i] = i;
        qsort_r(h->by_name, h->ntensors, sizeof(size_t), by_name_cmp, h);
        for (size_t i = 1; i < h->ntensors; i++) {
            const st_tensor *a = &h->tensors[h->by_name[i - 1]], *b = &h->tensors[h->by_name[i]];
            if (a->name_len == b->name_len && memcmp(a->name, b->name, a->name_len) == 0)
                return dl_fail(err, DL_E_DUPLICATE_KEY, b->name, b->name_len,
                               "duplicate tensor name in header");
        }
    }
    if (h->nmeta > 1) {
        qsort(h->meta, h->nmeta, sizeof(*h->meta), meta_cmp);
        for (size_t i = 1; i < h->nmeta; i++) {
            if (meta_cmp(&h->meta[i - 1], &h->meta[i]) == 0)
                return dl_fail(err, DL_E_DUPLICATE_KEY, NULL, 0,
                               "duplicate key in __metadata__: \"%.64s\"", h->meta[i].key);
        }
    }
    /* Order of equal ranges does not matter: equal ranges are empty tensors (else an overlap). */
    if (h->ntensors > 1)                /* qsort's base must not be NULL, even for 0 elements */
        qsort(h->tensors, h->ntensors, sizeof(*h->tensors), by_offset_cmp);
    /* by_name indices were taken before the offset sort: rebuild them. */
    for (size_t i = 0; i < h->ntensors; i++)
        h->by_name[i] = i;
    if (h->ntensors > 0)
        qsort_r(h->by_name, h->ntensors, sizeof(size_t), by_name_cmp, h);
    for (size_t i = 0; i < h->ntensors; i++) {
        st_tensor *t = &h->tensors[i];
        uint64_t nbytes;
        int rc;

        if (t->begin != start || t->end < t->begin)
            return dl_fail(err, DL_E_INVALID_OFFSET, t->name, t->name_len,
                           "invalid offset for tensor: data_offsets [%llu, %llu], expected to start at %llu",
                           (unsigned long long)t->begin, (unsigned long long)t->end,
                           (unsigned long long)start);
        start = t->end;
        if ((rc = st_nbytes(t->dtype, t->shape, t->ndim, &t->nelem, &nbytes, err, t->name,
                            t->name_len)) != 0)
            return rc;
        if (t->end - t->begin != nbytes)
            return dl_fail(err, DL_E_TENSOR_INVALID_INFO, t->name, t->name_len,
                           "invalid shape, data type, or offset for tensor: %s x %llu elements is %llu bytes, data_offsets cover %llu",
                           st_dtype_name(t->dtype), (unsigned long long)t->nelem,
                           (unsigned long long)nbytes, (unsigned long long)(t->end - t->begin));
    }
    h->data_len = start;
    return 0;
}

void st_header_free(st_header *h)
{
    if (h == NULL)
        return;
    for (size_t i = 0; i < h->ntensors; i++) {
        free(h->tensors[i].name);
        free(h->tensors[i].shape);
    }
    for (size_t i = 0; i < h->nmeta; i++) {
        free(h->meta[i].key);
        free(h->meta[i].value);
    }
    free(h->tensors);
    free(h->by_name);
    free(h->meta);
    free(h);
}

int st_header_parse_unsized(const char *json, size_t n, st_header **out, dl_error *err)
{
    st_header *h;
    jp p = {(const unsigned char *)json, n, 0, 0, err};
    size_t bad;
    int rc;

    *out = NULL;
    if (n > ST_MAX_HEADER_SIZE)
        return dl_fail(err, DL_E_HEADER_TOO_LARGE, NULL, 0, "header too large: %zu bytes (max %llu)",
                       n, ST_MAX_HEADER_SIZE);
    if (dl_utf8_check(json, n, &bad) != 0)
        return dl_fail(err, DL_E_INVALID_HEADER, NULL, 0, "invalid UTF-8 in header at byte %zu", bad);
    h = calloc(1, sizeof(*h));
    if (h == NULL)
        return dl_fail(err, DL_E_NO_MEMORY, NULL, 0, "out of memory parsing header");
    h->header_len = n;
    if ((rc = jp_header(&p, h)) != 0 || (rc = validate(h, err)) != 0) {
        st_header_free(h);
        return rc;
    }
    *out = h;
    return 0;
}

int st_header_file_len(const st_header *h, uint64_t *len)
{
    uint64_t total;
    if (__builtin_add_overflow(h->data_len, (uint64_t)8, &total) ||
        __builtin_add_overflow(total, h->header_len, &total))
        return -1;
    *len = total;
    return 0;
}

int st_header_parse(const char *json, size_t n, uint64_t file_len, st_header **out, dl_error *err)
{
    st_header *h;
    uint64_t total;
    int rc;

    if ((rc = st_header_parse_unsized(json, n, &h, err)) != 0)
        return rc;
    if (st_header_file_len(h, &total) != 0 || total != file_len) {
        rc = dl_fail(err, DL_E_METADATA_INCOMPLETE_BUFFER, NULL, 0,
                     "incomplete metadata, file not fully covered: header and tensors need 8 + %zu + %llu bytes, the file has %llu",
                     n, (unsigned long long)h->data_len, (unsigned long long)file_len);
        st_header_free(h);
        return rc;
    }
    *out = h;
    return 0;
}

static uint64_t le64(const unsigned char *b)
{
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--)
        v = (v << 8) | b[i];
    return v;
}

/* What a file starts with when its first 8 bytes are not a header length: a signature we know, or
 * text (8 printable ASCII bytes; a real length below the 100 MB cap has its high bytes zero, so text
 * never is one).  NULL when the bytes say nothing. */
static const char *foreign_kind(const unsigned char *b)
{
    static const struct { const char *magic; size_t len; const char *what; } sigs[] = {
        {"PK\x03\x04", 4, "a ZIP archive (a torch.save checkpoint is one)"},
        {"\x1f\x8b", 2, "gzip data"},
        {"\x93NUMPY", 6, "a NumPy .npy array"},
        {"GGUF", 4, "a GGUF model"},
        {"\x89HDF\r\n\x1a\n", 8, "an HDF5 file"},
        {"\x89PNG", 4, "a PNG image"},
    };
    for (size_t i = 0; i < sizeof(sigs) / sizeof(sigs[0]); i++) {
        if (memcmp(b, sigs[i].magic, sigs[i].len) == 0)
            return sigs[i].what;
    }
    if (b[0] == 0x80 && b[1] >= 2 && b[1] <= 5)
        return "a Python pickle";
    for (int i = 0; i < 8; i++) {
        if (!(b[i] >= 0x20 && b[i] < 0x7f) && b[i] != '\t' && b[i] != '\n' && b[i] != '\r')
            return NULL;
    }
    return "text";
}

int st_prefix_refusal(dl_error *err, dl_code code, const unsigned char b[8], uint64_t n, uint64_t file_len)
{
    const char *kind = foreign_kind(b);
    char shown[48];

    if (kind != NULL && strcmp(kind, "text") == 0) {
        dl_printable(shown, sizeof(shown), (const char *)b, 8);
        return dl_fail(err, code, NULL, 0, "not a safetensors file: it starts with text (\"%s\") where the "
                       "8-byte header length belongs", shown);
    }
    if (kind != NULL)
        return dl_fail(err, code, NULL, 0, "not a safetensors file: it starts like %s", kind);
    if (code == DL_E_HEADER_TOO_LARGE)
        return dl_fail(err, code, NULL, 0, "not a safetensors file: its first 8 bytes give a header length of "
                       "%llu bytes, over the %llu-byte limit", (unsigned long long)n, ST_MAX_HEADER_SIZE);
    return dl_fail(err, code, NULL, 0, "not a safetensors file, or a truncated one: its first 8 bytes give a "
                   "header of %llu bytes, the file has %llu", (unsigned long long)n, (unsigned long long)file_len);
}

int st_header_parse_prefix(const char *buf, size_t avail, uint64_t file_len, size_t *need,
                           st_header **out, dl_error *err)
{
    uint64_t n;

    *out = NULL;
    if (file_len < 8)
        return dl_fail(err, DL_E_HEADER_TOO_SMALL, NULL, 0, "file too small: %llu bytes, need at least 8",
                       (unsigned long long)file_len);
    if (avail < 8) {
        *need = 8;
        return 0;
    }
    n = le64((const unsigned char *)buf);
    if (n > ST_MAX_HEADER_SIZE)
        return st_prefix_refusal(err, DL_E_HEADER_TOO_LARGE, (const unsigned char *)buf, n, file_len);
    if (n + 8 > file_len)
        return st_prefix_refusal(err, DL_E_INVALID_HEADER_LENGTH, (const unsigned char *)buf, n, file_len);
    if (avail < n + 8) {
        *need = (size_t)(n + 8);
        return 0;
    }
    *need = (size_t)(n + 8);
    return st_header_parse(buf + 8, (size_t)n, file_len, out, err);
}

const st_tensor *st_header_find(const st_header *h, const char *name, size_t name_len)
{
    size_t lo = 0, hi = h->ntensors;
    jstr key = {(char *)name, name_len};

    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        const st_tensor *t = &h->tensors[h->by_name[mid]];
        jstr ts = {t->name, t->name_len};
        int c = jstr_cmp(&ts, &key);
        if (c == 0)
            return t;
        if (c < 0)
            lo = mid + 1;
        else
            hi = mid;
    }
    return NULL;
}

const char *st_header_meta(const st_header *h, const char *key, size_t *len)
{
    size_t kl = strlen(key);

    for (size_t i = 0; i < h->nmeta; i++) {
        if (h->meta[i].key_len == kl && memcmp(h->meta[i].key, key, kl) == 0) {
            if (len != NULL)
                *len = h->meta[i].value_len;
            return h->meta[i].value;
        }
    }
    return NULL;
}
