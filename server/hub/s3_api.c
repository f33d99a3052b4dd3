/* s3_api: the S3 REST API's URLs, canonical query strings and XML answers (hub_s3.h).  No I/O. */
#include "hub_s3.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <expat.h>

#include "delta.h"
#include "remote_fetch.h"

/* ---- URLs ---------------------------------------------------------------------------------------- */

static int bucket_char(char c)
{
    return (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '.' || c == '-';
}

static int alnum_lower(char c)
{
    return (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9');
}

/* A prefix segment: what a node id may hold plus '+', '=' and '@', never "." or "..". */
static int prefix_segment_ok(const char *s, size_t n)
{
    if (n == 0 || (n == 1 && s[0] == '.') || (n == 2 && s[0] == '.' && s[1] == '.'))
        return 0;
    for (size_t i = 0; i < n; i++) {
        char c = s[i];
        if (!((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '.' || c == '_' ||
              c == '-' || c == '+' || c == '=' || c == '@'))
            return 0;
    }
    return 1;
}

int s3_parse_url(const char *url, char **bucket, char **prefix, dl_error *err)
{
    const char *b = url + 5, *slash;
    size_t bl;

    *bucket = *prefix = NULL;
    if (strncmp(url, "s3://", 5) != 0)
        return dl_fail(err, DL_E_INVALID_ARGUMENT, NULL, 0, "'%.200s' is not s3://bucket[/prefix]", url);
    slash = strchr(b, '/');
    bl = slash ? (size_t)(slash - b) : strlen(b);
    if (bl < 3 || bl > 63 || !alnum_lower(b[0]) || !alnum_lower(b[bl - 1]))
        return dl_fail(err, DL_E_INVALID_ARGUMENT, NULL, 0,
                       "'%.200s': a bucket name is 3 to 63 characters of a-z 0-9 . -, starting and ending with a "
                       "letter or digit", url);
    for (size_t i = 0; i < bl; i++)
        if (!bucket_char(b[i]) || (i > 0 && b[i] == '.' && b[i - 1] == '.'))
            return dl_fail(err, DL_E_INVALID_ARGUMENT, NULL, 0, "'%.200s': bad character in the bucket name", url);
    const char *p = slash ? slash + 1 : "";
    size_t pl = strlen(p);
    if (slash != NULL && pl == 0)
        return dl_fail(err, DL_E_INVALID_ARGUMENT, NULL, 0, "'%.200s': no trailing / (s3://bucket or s3://bucket/prefix)",
                       url);
    if (pl > 512)
        return dl_fail(err, DL_E_INVALID_ARGUMENT, NULL, 0, "'%.200s': the prefix is longer than 512 bytes", url);
    for (const char *seg = p; pl > 0;) {
        const char *e = strchr(seg, '/');
        size_t sl = e ? (size_t)(e - seg) : strlen(seg);
        if (!prefix_segment_ok(seg, sl))
            return dl_fail(err, DL_E_INVALID_ARGUMENT, NULL, 0,
                           "'%.200s': each prefix segment is letters, digits and . _ - + = @ (no empty, . or .. "
                           "segment, no trailing /)", url);
        if (e == NULL)
            break;
        seg = e + 1;
    }
    *bucket = strndup(b, bl);
    *prefix = strdup(p);
    if (*bucket == NULL || *prefix == NULL) {
        free(*bucket);
        free(*prefix);
        *bucket = *prefix = NULL;
        return dl_fail(err, DL_E_NO_MEMORY, NULL, 0, "out of memory");
    }
    return 0;
}

void s3_uri_encode(sbuf *b, const char *s, int keep_slash)
{
    static const char hex[] = "0123456789ABCDEF";
    for (const unsigned char *p = (const unsigned char *)s; *p; p++) {
        unsigned char c = *p;
        if ((c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '-' || c == '.' ||
            c == '_' || c == '~' || (keep_slash && c == '/')) {
            sb_add(b, (const char *)p, 1);
        } else {
            char e[3] = {'%', hex[c >> 4], hex[c & 15]};
            sb_add(b, e, 3);
        }
    }
}

int s3_payload_header(s3_payload kind, const void *body, size_t len, char line[128])
{
    static const char empty_sha256[] = "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855";
    char hex[65];

    switch (kind) {
    case S3_PAYLOAD_MEMORY:
        if (remote_hash_mem(len ? body : "", len, REMOTE_SHA256, NULL, 0, hex, sizeof(hex)) != 0)
            return -DL_E_INTERNAL;
        snprintf(line, 128, "x-amz-content-sha256: %s", hex);
        return 0;
    case S3_PAYLOAD_FILE:
        snprintf(line, 128, "x-amz-content-sha256: UNSIGNED-PAYLOAD");
        return 0;
    case S3_PAYLOAD_NONE:
    default:
        snprintf(line, 128, "x-amz-content-sha256: %s", empty_sha256);
        return 0;
    }
}

char *s3_url(const char *endpoint, const char *bucket, int virtual_host, const char *key, const char *query)
{
    sbuf b = {0};
    const char *hostpart = strstr(endpoint, "://");
    size_t el = strlen(endpoint);

    while (el > 0 && endpoint[el - 1] == '/')
        el--;
    if (virtual_host && hostpart != NULL) {
        /* scheme://bucket.host[:port][/base] */
        sb_add(&b, endpoint, (size_t)(hostpart - endpoint) + 3);
        sb_str(&b, bucket);
        sb_str(&b, ".");
        sb_add(&b, hostpart + 3, el - (size_t)(hostpart + 3 - endpoint));
        sb_str(&b, "/");
    } else {
        sb_add(&b, endpoint, el);
        sb_str(&b, "/");
        s3_uri_encode(&b, bucket, 0);
        sb_str(&b, "/");
    }
    if (key != NULL)
        s3_uri_encode(&b, key, 1);
    if (query != NULL && query[0]) {
        sb_str(&b, "?");
        sb_str(&b, query);
    }
    return sb_take(&b);
}

char *s3_list_query(const char *prefix, const char *token, const char *start_after, unsigned max_keys)
{
    sbuf b = {0};
    /* sorted by name: continuation-token < list-type < max-keys < prefix < start-after */
    if (token != NULL) {
        sb_str(&b, "continuation-token=");
        s3_uri_encode(&b, token, 0);
        sb_str(&b, "&");
    }
    sb_str(&b, "list-type=2&max-keys=");
    sb_u64(&b, max_keys);
    sb_str(&b, "&prefix=");
    s3_uri_encode(&b, prefix, 0);
    if (start_after != NULL) {
        sb_str(&b, "&start-after=");
        s3_uri_encode(&b, start_after, 0);
    }
    return sb_take(&b);
}

int s3_clean_etag(const char *in, size_t len, char *out, size_t out_size)
{
    while (len > 0 && (*in == ' ' || *in == '\t')) {
        in++;
        len--;
    }
    while (len > 0 && (in[len - 1] == ' ' || in[len - 1] == '\t' || in[len - 1] == '\r' || in[len - 1] == '\n'))
        len--;
    /* "W/" weak tags and &quot; are what XML gives back decoded as plain quotes */
    if (len >= 2 && in[0] == '"' && in[len - 1] == '"') {
        in++;
        len -= 2;
    }
    if (len == 0 || len > 64 || len >= out_size)
        return -1;
    for (size_t i = 0; i < len; i++)
        if (in[i] <= ' ' || in[i] > '~' || in[i] == '"' || in[i] == '\\')
            return -1;
    memcpy(out, in, len);
    out[len] = '\0';
    return 0;
}

/* ---- XML ----------------------------------------------------------------------------------------- */

#define XML_MAX_DEPTH 16
#define XML_MAX_TEXT 4096
#define XML_NAME_KEEP 48

typedef enum xml_kind { XK_LISTING, XK_ERROR, XK_UPLOAD_ID, XK_UPLOADS } xml_kind;

typedef struct xml_ctx {
    XML_Parser p;
    xml_kind kind;
    int depth;
    char names[XML_MAX_DEPTH][XML_NAME_KEEP];
    sbuf text;
    int text_over;
    char why[200];
    /* listing */
    s3_listing *l;
    size_t cap;
    s3_object cur;
    int have_key, have_size, have_etag;
    int saw_root;
    /* error */
    char *code, *msg;
    size_t code_size, msg_size;
    int is_error;
    /* upload id */
    char *upload_id;
    /* uploads of one key */
    const char *want_key;
    char **ids;
    size_t nids;
    char *u_key, *u_id;
} xml_ctx;

static void xml_fail(xml_ctx *x, const char *why)
{
    if (x->why[0] == '\0')
        snprintf(x->why, sizeof(x->why), "%s", why);
    XML_StopParser(x->p, XML_FALSE);
}

/* Element names compared without a namespace prefix ("s3:Key" is "Key"). */
static const char *local_name(const char *n)
{
    const char *c = strrchr(n, ':');
    return c ? c + 1 : n;
}

static void on_start(void *arg, const XML_Char *name, const XML_Char **attrs)
{
    xml_ctx *x = arg;
    (void)attrs;
    if (x->depth >= XML_MAX_DEPTH) {
        xml_fail(x, "XML nested deeper than 16 elements");
        return;
    }
    snprintf(x->names[x->depth], XML_NAME_KEEP, "%s", local_name(name));
    x->depth++;
    x->text.len = 0;
    x->text_over = 0;
    if (x->depth == 1)
        x->saw_root = 1;
    if (x->kind == XK_LISTING && x->depth == 2 && strcmp(x->names[1], "Contents") == 0) {
        free(x->cur.key);
        memset(&x->cur, 0, sizeof(x->cur));
        x->have_key = x->have_size = x->have_etag = 0;
    }
}

static void on_text(void *arg, const XML_Char *s, int len)
{
    xml_ctx *x = arg;
    if (len <= 0 || x->text_over)
        return;
    if (x->text.len + (size_t)len > XML_MAX_TEXT) {
        x->text_over = 1;
        return;
    }
    sb_add(&x->text, s, (size_t)len);
}

/* The text of the element that just ended (NUL-terminated in place), NULL when over the cap. */
static const char *ended_text(xml_ctx *x, size_t *len)
{
    if (x->text_over || x->text.oom)
        return NULL;
    sb_add(&x->text, "", 1);
    if (x->text.oom)
        return NULL;
    x->text.len--;
    *len = x->text.len;
    return x->text.p;
}

static int parse_bool(const char *t, int *out)
{
    if (strcmp(t, "true") == 0)
        *out = 1;
    else if (strcmp(t, "false") == 0)
        *out = 0;
    else
        return -1;
    return 0;
}

static void listing_end(xml_ctx *x, const char *name, const char *t, size_t tl)
{
    if (x->depth == 1) {
        if (strcmp(name, "ListBucketResult") != 0)
            xml_fail(x, "the answer is not a ListBucketResult");
        return;
    }
    if (x->depth == 3 && strcmp(x->names[1], "Contents") == 0) {
        if (t == NULL) {
            xml_fail(x, "an element of an entry is longer than 4096 bytes");
        } else if (strcmp(name, "Key") == 0) {
            if (tl == 0 || tl > S3_MAX_KEY || memchr(t, '\0', tl) != NULL)
                xml_fail(x, "an entry's Key is empty or longer than 1024 bytes");
            else if (x->have_key)
                xml_fail(x, "an entry with two Keys");
            else if ((x->cur.key = strdup(t)) == NULL)
                xml_fail(x, "out of memory");
            else
                x->have_key = 1;
        } else if (strcmp(name, "Size") == 0) {
            uint64_t v;
            /* exact decimal digits, below 2^53 like every size we accept from a server */
            if (delta_parse_int(t, tl, &v) != 0 || v > (1ull << 53))
                xml_fail(x, "an entry's Size is not an integer below 2^53");
            else {
                x->cur.size = v;
                x->have_size = 1;
            }
        } else if (strcmp(name, "ETag") == 0) {
            if (s3_clean_etag(t, tl, x->cur.etag, sizeof(x->cur.etag)) != 0)
                xml_fail(x, "an entry's ETag is not a short printable tag");
            else
                x->have_etag = 1;
        }
        return;
    }
    if (x->depth != 2)
        return;
    if (strcmp(name, "Contents") == 0) {
        if (!x->have_key || !x->have_size || !x->have_etag) {
            xml_fail(x, "an entry without Key, Size or ETag");
            return;
        }
        if (x->l->n == S3_MAX_KEYS_PER_PAGE) {
            xml_fail(x, "more than 1000 entries in one page");
            return;
        }
        if (x->l->n == x->cap) {
            size_t nc = x->cap ? 2 * x->cap : 64;
            s3_object *no = realloc(x->l->objs, nc * sizeof(*no));
            if (no == NULL) {
                xml_fail(x, "out of memory");
                return;
            }
            x->l->objs = no;
            x->cap = nc;
        }
        x->l->objs[x->l->n++] = x->cur;
        memset(&x->cur, 0, sizeof(x->cur));
    } else if (strcmp(name, "IsTruncated") == 0) {
        if (t == NULL || parse_bool(t, &x->l->truncated) != 0)
            xml_fail(x, "IsTruncated is neither true nor false");
    } else if (strcmp(name, "NextContinuationToken") == 0) {
        if (t == NULL || tl == 0 || tl > 1024 || x->l->next_token != NULL)
            xml_fail(x, "NextContinuationToken is empty, repeated or longer than 1024 bytes");
        else if ((x->l->next_token = strdup(t)) == NULL)
            xml_fail(x, "out of memory");
    }
}

static void uploads_end(xml_ctx *x, const char *name, const char *t, size_t tl)
{
    if (x->depth == 1 && strcmp(name, "ListMultipartUploadsResult") != 0) {
        xml_fail(x, "the answer is not a ListMultipartUploadsResult");
    } else if (x->depth == 3 && strcmp(x->names[1], "Upload") == 0 &&
               (strcmp(name, "Key") == 0 || strcmp(name, "UploadId") == 0)) {
        char **dst = name[0] == 'K' ? &x->u_key : &x->u_id;
        if (t == NULL || tl == 0 || tl > S3_MAX_KEY || *dst != NULL)
            xml_fail(x, "an Upload's Key or UploadId is empty, repeated or too long");
        else if ((*dst = strdup(t)) == NULL)
            xml_fail(x, "out of memory");
    } else if (x->depth == 2 && strcmp(name, "Upload") == 0) {
        if (x->u_key == NULL || x->u_id == NULL) {
            xml_fail(x, "an Upload without Key or UploadId");
        } else if (strcmp(x->u_key, x->want_key) == 0) {
            char **nids = x->nids < S3_MAX_KEYS_PER_PAGE ? realloc(x->ids, (x->nids + 1) * sizeof(*nids)) : NULL;
            if (nids == NULL) {
                xml_fail(x, "more than 1000 uploads, or out of memory");
            } else {
                x->ids = nids;
                x->ids[x->nids++] = x->u_id;
                x->u_id = NULL;
            }
        }
        free(x->u_key);
        free(x->u_id);
        x->u_key = x->u_id = NULL;
    }
}

static void copy_capped(char *dst, size_t size, const char *t)
{
    if (size == 0)
        return;
    snprintf(dst, size, "%s", t ? t : "");
}

static void on_end(void *arg, const XML_Char *raw)
{
    xml_ctx *x = arg;
    const char *name = local_name(raw);
    size_t tl = 0;
    const char *t = ended_text(x, &tl);

    switch (x->kind) {
    case XK_LISTING:
        listing_end(x, name, t, tl);
        break;
    case XK_ERROR:
        if (x->depth == 1)
            x->is_error = strcmp(name, "Error") == 0;
        else if (x->depth == 2 && strcmp(x->names[0], "Error") == 0 && strcmp(name, "Code") == 0)
            copy_capped(x->code, x->code_size, t);
        else if (x->depth == 2 && strcmp(x->names[0], "Error") == 0 && strcmp(name, "Message") == 0)
            copy_capped(x->msg, x->msg_size, t);
        break;
    case XK_UPLOADS:
        uploads_end(x, name, t, tl);
        break;
    case XK_UPLOAD_ID:
        if (x->depth == 1 && strcmp(name, "InitiateMultipartUploadResult") != 0)
            xml_fail(x, "the answer is not an InitiateMultipartUploadResult");
        else if (x->depth == 2 && strcmp(name, "UploadId") == 0) {
            if (t == NULL || tl == 0 || tl > 1024 || x->upload_id != NULL)
                xml_fail(x, "UploadId is empty, repeated or longer than 1024 bytes");
            else if ((x->upload_id = strdup(t)) == NULL)
                xml_fail(x, "out of memory");
        }
        break;
    }
    x->depth--;
    x->text.len = 0;
    x->text_over = 0;
}

/* A DOCTYPE could declare entities (a billion laughs, or external ones): no S3 answer has one. */
static void on_doctype(void *arg, const XML_Char *name, const XML_Char *sysid, const XML_Char *pubid, int internal)
{
    (void)name;
    (void)sysid;
    (void)pubid;
    (void)internal;
    xml_fail(arg, "a DOCTYPE in the answer");
}

static void on_entity_decl(void *arg, const XML_Char *name, int pe, const XML_Char *value, int vlen,
                           const XML_Char *base, const XML_Char *sysid, const XML_Char *pubid,
                           const XML_Char *notation)
{
    (void)name, (void)pe, (void)value, (void)vlen, (void)base, (void)sysid, (void)pubid, (void)notation;
    xml_fail(arg, "an entity declaration in the answer");
}

/* Parses the whole document; 0, or -1 with x->why. */
static int xml_run(xml_ctx *x, const char *xml, size_t len)
{
    int rc = 0;

    if (len > (size_t)INT32_MAX) {
        snprintf(x->why, sizeof(x->why), "the answer is too large");
        return -1;
    }
    x->p = XML_ParserCreate("UTF-8");
    if (x->p == NULL) {
        snprintf(x->why, sizeof(x->why), "out of memory");
        return -1;
    }
    XML_SetUserData(x->p, x);
    XML_SetElementHandler(x->p, on_start, on_end);
    XML_SetCharacterDataHandler(x->p, on_text);
    XML_SetStartDoctypeDeclHandler(x->p, on_doctype);
    XML_SetEntityDeclHandler(x->p, on_entity_decl);
    if (XML_Parse(x->p, xml, (int)len, XML_TRUE) != XML_STATUS_OK) {
        if (x->why[0] == '\0')
            snprintf(x->why, sizeof(x->why), "not well-formed XML (%s at line %lu)",
                     XML_ErrorString(XML_GetErrorCode(x->p)), (unsigned long)XML_GetCurrentLineNumber(x->p));
        rc = -1;
    } else if (x->why[0] != '\0') {
        rc = -1;
    } else if (!x->saw_root) {
        snprintf(x->why, sizeof(x->why), "an empty answer");
        rc = -1;
    }
    XML_ParserFree(x->p);
    x->p = NULL;
    free(x->text.p);
    x->text.p = NULL;
    return rc;
}

void s3_listing_free(s3_listing *l)
{
    for (size_t i = 0; l->objs && i < l->n; i++)
        free(l->objs[i].key);
    free(l->objs);
    free(l->next_token);
    memset(l, 0, sizeof(*l));
}

int s3_parse_listing(const char *xml, size_t len, s3_listing *out, dl_error *err)
{
    xml_ctx x = {.kind = XK_LISTING, .l = out};

    memset(out, 0, sizeof(*out));
    if (xml_run(&x, xml, len) == 0 && out->truncated && out->next_token == NULL)
        snprintf(x.why, sizeof(x.why), "a truncated page without a NextContinuationToken");
    free(x.cur.key);
    if (x.why[0] != '\0') {
        s3_listing_free(out);
        return dl_fail(err, DL_E_INVALID_ARGUMENT, NULL, 0, "bad ListObjectsV2 answer: %s", x.why);
    }
    return 0;
}

int s3_parse_error(const char *xml, size_t len, char *code, size_t code_size, char *msg, size_t msg_size)
{
    xml_ctx x = {.kind = XK_ERROR, .code = code, .code_size = code_size, .msg = msg, .msg_size = msg_size};

    copy_capped(code, code_size, "");
    copy_capped(msg, msg_size, "");
    if (len == 0 || xml_run(&x, xml, len) != 0)
        return 0;
    return x.is_error;
}

int s3_parse_upload_id(const char *xml, size_t len, char **upload_id, dl_error *err)
{
    xml_ctx x = {.kind = XK_UPLOAD_ID};

    *upload_id = NULL;
    if (xml_run(&x, xml, len) == 0 && x.upload_id == NULL)
        snprintf(x.why, sizeof(x.why), "no UploadId");
    if (x.why[0] != '\0') {
        free(x.upload_id);
        return dl_fail(err, DL_E_INVALID_ARGUMENT, NULL, 0, "bad CreateMultipartUpload answer: %s", x.why);
    }
    *upload_id = x.upload_id;
    return 0;
}

void s3_uploads_free(char **ids, size_t n)
{
    for (size_t i = 0; ids && i < n; i++)
        free(ids[i]);
    free(ids);
}

int s3_parse_uploads(const char *xml, size_t len, const char *key, char ***ids, size_t *n, dl_error *err)
{
    xml_ctx x = {.kind = XK_UPLOADS, .want_key = key};

    *ids = NULL;
    *n = 0;
    xml_run(&x, xml, len);
    free(x.u_key);
    free(x.u_id);
    if (x.why[0] != '\0') {
        s3_uploads_free(x.ids, x.nids);
        return dl_fail(err, DL_E_INVALID_ARGUMENT, NULL, 0, "bad ListMultipartUploads answer: %s", x.why);
    }
    *ids = x.ids;
    *n = x.nids;
    return 0;
}

/* ---- credentials --------------------------------------------------------------------------------- */

static void trim_span(const char **s, size_t *n)
{
    while (*n > 0 && (**s == ' ' || **s == '\t')) {
        (*s)++;
        (*n)--;
    }
    while (*n > 0 && ((*s)[*n - 1] == ' ' || (*s)[*n - 1] == '\t' || (*s)[*n - 1] == '\r'))
        (*n)--;
}

int s3_parse_credentials(const char *text, size_t len, char **key_id, char **secret, dl_error *err)
{
    int in_default = 1;

    *key_id = *secret = NULL;
    for (const char *p = text, *end = text + len; p < end;) {
        const char *nl = memchr(p, '\n', (size_t)(end - p));
        const char *line = p;
        size_t n = nl ? (size_t)(nl - p) : (size_t)(end - p);
        p = nl ? nl + 1 : end;
        trim_span(&line, &n);
        if (n == 0 || line[0] == '#' || line[0] == ';')
            continue;
        if (line[0] == '[') {
            in_default = n == 9 && memcmp(line, "[default]", 9) == 0;
            continue;
        }
        const char *eq = memchr(line, '=', n);
        if (!in_default || eq == NULL)
            continue;
        const char *k = line, *v = eq + 1;
        size_t kl = (size_t)(eq - line), vl = n - kl - 1;
        trim_span(&k, &kl);
        trim_span(&v, &vl);
        char **dst = kl == 17 && memcmp(k, "aws_access_key_id", 17) == 0       ? key_id
                     : kl == 21 && memcmp(k, "aws_secret_access_key", 21) == 0 ? secret
                                                                               : NULL;
        if (dst == NULL || vl == 0)
            continue;
        if (vl > 256 || memchr(v, '\0', vl) != NULL) {
            free(*key_id);
            free(*secret);
            *key_id = *secret = NULL;
            return dl_fail(err, DL_E_INVALID_ARGUMENT, NULL, 0, "a credential value is longer than 256 bytes");
        }
        free(*dst);
        if ((*dst = strndup(v, vl)) == NULL) {
            free(*key_id);
            free(*secret);
            *key_id = *secret = NULL;
            return dl_fail(err, DL_E_NO_MEMORY, NULL, 0, "out of memory");
        }
    }
    if (*key_id == NULL || *secret == NULL) {
        free(*key_id);
        free(*secret);
        *key_id = *secret = NULL;
        return dl_fail(err, DL_E_INVALID_ARGUMENT, NULL, 0,
                       "no aws_access_key_id and aws_secret_access_key under [default]");
    }
    return 0;
}
