/* strbuf: a growable byte buffer that remembers allocation failure (check .oom once at the end),
 * and JSON string quoting exactly as serde_json (so the safetensors writer matches the reference). */
#ifndef STRBUF_H
#define STRBUF_H

#include <stddef.h>
#include <stdint.h>

typedef struct sbuf {
    char *p;
    size_t len, cap;
    int oom;
} sbuf;

void sb_grow(sbuf *b, size_t extra);
void sb_add(sbuf *b, const char *s, size_t n);
void sb_str(sbuf *b, const char *s);
void sb_u64(sbuf *b, uint64_t v);
/* printf onto the end of b (a format error adds nothing). */
void sb_printf(sbuf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* A quoted JSON string escaped as serde_json does: only '"', '\\' and U+0000..U+001F; \b \t \n \f \r
 * short forms, the others as \u00xx with lowercase hex; '/', DEL and non-ASCII raw.  s may hold NUL. */
void sb_json_string(sbuf *b, const char *s, size_t n);
/* NUL-terminates and hands over the buffer (NULL if an allocation failed); b is reset. */
char *sb_take(sbuf *b);

#endif
