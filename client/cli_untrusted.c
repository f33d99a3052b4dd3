/* The shown form of outside strings (see cli_untrusted.h for what is escaped and why). */
#include "cli_untrusted.h"

#include <errno.h>
#include <stdint.h>
#include <string.h>

/* Length (1..4) of the valid UTF-8 sequence at s, with its code point in *cp; 0 when s does not start
 * one.  Valid as Rust's from_utf8 and dl_utf8_check define it: no overlong form, no surrogate,
 * nothing past U+10FFFF (a terminal decodes some of those to controls). */
static size_t utf8_next(const unsigned char *s, size_t avail, uint32_t *cp)
{
    uint32_t c = s[0], min;
    size_t n;

    if (c < 0x80) {
        *cp = c;
        return 1;
    }
    if (c >= 0xc2 && c <= 0xdf) { n = 2; min = 0x80; c &= 0x1f; }
    else if (c >= 0xe0 && c <= 0xef) { n = 3; min = 0x800; c &= 0x0f; }
    else if (c >= 0xf0 && c <= 0xf4) { n = 4; min = 0x10000; c &= 0x07; }
    else return 0;
    if (avail < n)
        return 0;
    for (size_t i = 1; i < n; i++) {
        if ((s[i] & 0xc0) != 0x80)
            return 0;
        c = (c << 6) | (s[i] & 0x3f);
    }
    if (c < min || c > 0x10ffff || (c >= 0xd800 && c <= 0xdfff))
        return 0;
    *cp = c;
    return n;
}

static int is_control(uint32_t cp)
{
    return cp < 0x20 || (cp >= 0x7f && cp <= 0x9f);
}

/* The shown form of the character at s (avail > 0 bytes) into out, its length in *out_len; returns
 * the input bytes it stands for. */
static size_t shown_unit(const unsigned char *s, size_t avail, char out[CLI_UNTRUSTED_UNIT_MAX], size_t *out_len)
{
    static const char hex[] = "0123456789abcdef";
    uint32_t cp = 0;
    size_t n = utf8_next(s, avail, &cp);

    if (n == 0) {
        memcpy(out, "\\x", 2);
        out[2] = hex[s[0] >> 4];
        out[3] = hex[s[0] & 15];
        *out_len = 4;
        return 1;
    }
    if (is_control(cp)) {
        memcpy(out, "\\u00", 4);
        out[4] = hex[cp >> 4];
        out[5] = hex[cp & 15];
        *out_len = 6;
        return n;
    }
    memcpy(out, s, n);
    *out_len = n;
    return n;
}

void cli_untrusted_append(sbuf *b, const char *s, size_t len)
{
    const unsigned char *u = (const unsigned char *)s;

    for (size_t i = 0; i < len;) {
        char unit[CLI_UNTRUSTED_UNIT_MAX];
        size_t ulen;
        i += shown_unit(u + i, len - i, unit, &ulen);
        sb_add(b, unit, ulen);
    }
}

/* Bytes of the shown form of s[0..len). */
static size_t shown_len(const unsigned char *u, size_t len)
{
    size_t total = 0;

    for (size_t i = 0; i < len;) {
        char unit[CLI_UNTRUSTED_UNIT_MAX];
        size_t ulen;
        i += shown_unit(u + i, len - i, unit, &ulen);
        total += ulen;
    }
    return total;
}

const char *cli_untrusted(char *out, size_t size, const char *s, size_t len)
{
    const unsigned char *u = (const unsigned char *)s;
    /* all of it when it fits with its NUL; else whole characters while "..." and the NUL still fit */
    size_t o = 0, limit = shown_len(u, len) < size ? size : size - (size < 4 ? size : 4);

    if (size == 0)
        return out;
    for (size_t i = 0; i < len;) {
        char unit[CLI_UNTRUSTED_UNIT_MAX];
        size_t ulen, used = shown_unit(u + i, len - i, unit, &ulen);
        if (o + ulen > limit) {
            if (o + 4 <= size) {
                memcpy(out + o, "...", 3);
                o += 3;
            }
            break;
        }
        memcpy(out + o, unit, ulen);
        o += ulen;
        i += used;
    }
    out[o] = '\0';
    return out;
}

const char *cli_untrusted_str(char *out, size_t size, const char *s)
{
    if (s == NULL)
        s = "-";
    return cli_untrusted(out, size, s, strlen(s));
}

int cli_print_untrusted(FILE *f, const char *s, size_t len)
{
    const unsigned char *u = (const unsigned char *)s;

    for (size_t i = 0; i < len;) {
        char unit[CLI_UNTRUSTED_UNIT_MAX];
        size_t ulen;
        i += shown_unit(u + i, len - i, unit, &ulen);
        if (fwrite(unit, 1, ulen, f) != ulen)
            return -EIO;
    }
    return 0;
}
