#include "strbuf.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

void sb_grow(sbuf *b, size_t extra)
{
    size_t need, nc;
    char *np;

    if (b->oom)
        return;
    if (__builtin_add_overflow(b->len, extra, &need)) {
        b->oom = 1;
        return;
    }
    if (need <= b->cap)
        return;
    nc = b->cap ? b->cap : 256;
    while (nc < need)
        nc *= 2;
    np = realloc(b->p, nc);
    if (np == NULL) {
        b->oom = 1;
        return;
    }
    b->p = np;
    b->cap = nc;
}

void sb_printf(sbuf *b, const char *fmt, ...)
{
    char tmp[512];
    va_list ap;
    int n;

    va_start(ap, fmt);
    n = vsnprintf(tmp, sizeof(tmp), fmt, ap);
    va_end(ap);
    if (n < 0)
        return;
    if ((size_t)n < sizeof(tmp)) {
        sb_add(b, tmp, (size_t)n);
        return;
    }
    sb_grow(b, (size_t)n + 1);  /* longer than tmp: formatted again, straight into the buffer */
    if (b->oom)
        return;
    va_start(ap, fmt);
    n = vsnprintf(b->p + b->len, (size_t)n + 1, fmt, ap);
    va_end(ap);
    if (n > 0)
        b->len += (size_t)n;
}

void sb_add(sbuf *b, const char *s, size_t n)
{
    if (n == 0)
        return;                 /* memcpy to a NULL buffer is undefined even for 0 bytes */
    sb_grow(b, n);
    if (b->oom)
        return;
    memcpy(b->p + b->len, s, n);
    b->len += n;
}

void sb_str(sbuf *b, const char *s)
{
    sb_add(b, s, strlen(s));
}

void sb_u64(sbuf *b, uint64_t v)
{
    char tmp[24];
    int n = snprintf(tmp, sizeof(tmp), "%llu", (unsigned long long)v);
    sb_add(b, tmp, (size_t)n);
}

void sb_json_string(sbuf *b, const char *s, size_t n)
{
    static const char hex[] = "0123456789abcdef";

    sb_add(b, "\"", 1);
    for (size_t i = 0; i < n; i++) {
        unsigned char c = (unsigned char)s[i];
        char esc[6];
        switch (c) {
        case '"': sb_add(b, "\\\"", 2); break;
        case '\\': sb_add(b, "\\\\", 2); break;
        case '\b': sb_add(b, "\\b", 2); break;
        case '\t': sb_add(b, "\\t", 2); break;
        case '\n': sb_add(b, "\\n", 2); break;
        case '\f': sb_add(b, "\\f", 2); break;
        case '\r': sb_add(b, "\\r", 2); break;
        default:
            if (c < 0x20) {
                memcpy(esc, "\\u00", 4);
                esc[4] = hex[c >> 4];
                esc[5] = hex[c & 15];
                sb_add(b, esc, 6);
            } else {
                sb_add(b, (const char *)&c, 1);
            }
        }
    }
    sb_add(b, "\"", 1);
}

char *sb_take(sbuf *b)
{
    char *p;

    sb_add(b, "", 1);
    if (b->oom) {
        free(b->p);
        p = NULL;
    } else {
        p = b->p;
    }
    b->p = NULL;
    b->len = b->cap = 0;
    b->oom = 0;
    return p;
}
