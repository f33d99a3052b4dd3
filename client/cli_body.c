/* A safetensors body taken up to the size its own header declares (see cli_body.h). */
#include "cli_body.h"

#include <stdlib.h>
#include <string.h>

#include "safetensors.h"

void cli_body_reset(cli_body *g)
{
    free(g->head.p);
    memset(g, 0, sizeof(*g));
}

void cli_body_declare(cli_body *g, uint64_t content_length)
{
    g->declared = content_length;
    g->has_declared = 1;
}

static uint64_t le64(const unsigned char *b)
{
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--)
        v = (v << 8) | b[i];
    return v;
}

/* The first 8 bytes are in: N, refused as every intake path refuses it (st_prefix_refusal) when it
 * is over the format's cap or past the declared body. */
static int take_prefix(cli_body *g, dl_error *err)
{
    const unsigned char *b = (const unsigned char *)g->head.p;
    uint64_t n = le64(b), body = g->has_declared ? g->declared : UINT64_MAX;

    if (n > ST_MAX_HEADER_SIZE)
        return st_prefix_refusal(err, DL_E_HEADER_TOO_LARGE, b, n, body);
    if (n + 8 > body)
        return st_prefix_refusal(err, DL_E_INVALID_HEADER_LENGTH, b, n, body);
    g->header_len = n;
    g->has_header_len = 1;
    return 0;
}

/* The whole header is in: parsed, it gives the file's size, which a Content-Length must repeat. */
static int take_header(cli_body *g, dl_error *err)
{
    st_header *h;
    uint64_t total;
    int rc = st_header_parse_unsized(g->head.p + 8, (size_t)g->header_len, &h, err);

    if (rc != 0)
        return rc;
    if (st_header_file_len(h, &total) != 0) {
        st_header_free(h);
        return dl_fail(err, DL_E_VALIDATION_OVERFLOW, NULL, 0, "the model's header declares more than 2^64 bytes");
    }
    if (g->has_declared && total != g->declared) {
        rc = dl_fail(err, DL_E_METADATA_INCOMPLETE_BUFFER, NULL, 0,
                     "the server declared a body of %llu bytes (Content-Length), the model's header a file of "
                     "%llu (8 + %llu of header + %llu of data)",
                     (unsigned long long)g->declared, (unsigned long long)total,
                     (unsigned long long)g->header_len, (unsigned long long)h->data_len);
        st_header_free(h);
        return rc;
    }
    st_header_free(h);
    g->total = total;
    free(g->head.p);                    /* the header was all it was kept for */
    memset(&g->head, 0, sizeof(g->head));
    return 0;
}

/* Keeps the header's bytes out of p[0..len) until the header is parsed (g->total set). */
static int gather_header(cli_body *g, const char *p, size_t len, dl_error *err)
{
    size_t used = 0;
    int rc = 0;

    while (rc == 0 && g->total == 0 && used < len) {
        /* N is at most ST_MAX_HEADER_SIZE here (take_prefix), so the sum fits a size_t */
        size_t want = g->has_header_len ? (size_t)(8 + g->header_len) : 8;
        size_t n = want - g->head.len < len - used ? want - g->head.len : len - used;
        sb_add(&g->head, p + used, n);
        if (g->head.oom)
            return dl_fail(err, DL_E_NO_MEMORY, NULL, 0, "out of memory keeping the model's header");
        used += n;
        if (!g->has_header_len && g->head.len == 8)
            rc = take_prefix(g, err);
        /* not else: an empty header (N = 0) is complete with its length */
        if (rc == 0 && g->has_header_len && g->head.len == 8 + g->header_len)
            rc = take_header(g, err);
    }
    return rc;
}

int cli_body_take(cli_body *g, const char *p, size_t len, dl_error *err)
{
    uint64_t after;
    int rc;

    if (__builtin_add_overflow(g->received, (uint64_t)len, &after))
        return dl_fail(err, DL_E_VALIDATION_OVERFLOW, NULL, 0, "the server sent more than 2^64 bytes");
    if (g->has_declared && after > g->declared)
        return dl_fail(err, DL_E_METADATA_INCOMPLETE_BUFFER, NULL, 0,
                       "the server sent more than the %llu bytes it declared (Content-Length)",
                       (unsigned long long)g->declared);
    if (g->total == 0 && (rc = gather_header(g, p, len, err)) != 0)
        return rc;
    if (g->total != 0 && after > g->total)
        return dl_fail(err, DL_E_METADATA_INCOMPLETE_BUFFER, NULL, 0,
                       "the server sent more than the %llu bytes the model's header declares (8 + %llu of header + "
                       "data): refused at byte %llu",
                       (unsigned long long)g->total, (unsigned long long)g->header_len,
                       (unsigned long long)(g->total + 1));
    g->received = after;
    return 0;
}
