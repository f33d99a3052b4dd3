#include "dl_error.h"

#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

static const char *const code_names[DL_E__COUNT] = {
    [DL_OK] = "ok",
    [DL_E_HEADER_TOO_SMALL] = "header_too_small",
    [DL_E_HEADER_TOO_LARGE] = "header_too_large",
    [DL_E_INVALID_HEADER_LENGTH] = "invalid_header_length",
    [DL_E_INVALID_HEADER] = "invalid_header",
    [DL_E_INVALID_HEADER_DESERIALIZATION] = "invalid_header_deserialization",
    [DL_E_INVALID_OFFSET] = "invalid_offset",
    [DL_E_METADATA_INCOMPLETE_BUFFER] = "metadata_incomplete_buffer",
    [DL_E_VALIDATION_OVERFLOW] = "validation_overflow",
    [DL_E_MISALIGNED_SLICE] = "misaligned_slice",
    [DL_E_TENSOR_INVALID_INFO] = "tensor_invalid_info",
    [DL_E_DUPLICATE_KEY] = "duplicate_key",
    [DL_E_KEY_MISMATCH] = "key_mismatch",
    [DL_E_SHAPE_MISMATCH] = "shape_mismatch",
    [DL_E_DTYPE_MISMATCH] = "dtype_mismatch",
    [DL_E_METADATA_MISSING] = "metadata_missing",
    [DL_E_METADATA_INVALID] = "metadata_invalid",
    [DL_E_PATH_MISMATCH] = "path_mismatch",
    [DL_E_INVALID_PATH] = "invalid_path",
    [DL_E_NON_FINITE] = "non_finite",
    [DL_E_UNSUPPORTED_DTYPE] = "unsupported_dtype",
    [DL_E_EMPTY_INPUT] = "empty_input",
    [DL_E_INVALID_ARGUMENT] = "invalid_argument",
    [DL_E_IO] = "io_error",
    [DL_E_NO_MEMORY] = "out_of_memory",
    [DL_E_CHECKSUM_MISMATCH] = "checksum_mismatch",
    [DL_E_INTERNAL] = "internal_error",
};

const char *dl_error_name(dl_code code)
{
    if ((unsigned)code >= DL_E__COUNT || code_names[code] == NULL)
        return "unknown_error";
    return code_names[code];
}

void dl_error_clear(dl_error *err)
{
    if (err == NULL)
        return;
    err->code = DL_OK;
    err->sys_errno = 0;
    err->message[0] = '\0';
    err->tensor[0] = '\0';
}

/* Length of the valid UTF-8 sequence starting at s (1..4), or 0 if it is not one. */
static size_t utf8_seq_len(const unsigned char *s, size_t avail)
{
    unsigned c = s[0];
    size_t n;
    unsigned min;
    unsigned cp;

    if (c < 0x80)
        return 1;
    if (c >= 0xc2 && c <= 0xdf) { n = 2; min = 0x80; cp = c & 0x1f; }
    else if (c >= 0xe0 && c <= 0xef) { n = 3; min = 0x800; cp = c & 0x0f; }
    else if (c >= 0xf0 && c <= 0xf4) { n = 4; min = 0x10000; cp = c & 0x07; }
    else return 0;
    if (avail < n)
        return 0;
    for (size_t i = 1; i < n; i++) {
        if ((s[i] & 0xc0) != 0x80)
            return 0;
        cp = (cp << 6) | (s[i] & 0x3f);
    }
    if (cp < min || cp > 0x10ffff || (cp >= 0xd800 && cp <= 0xdfff))
        return 0;
    return n;
}

int dl_utf8_check(const char *s, size_t n, size_t *bad_pos)
{
    const unsigned char *u = (const unsigned char *)s;

    for (size_t i = 0; i < n;) {
        size_t k = utf8_seq_len(u + i, n - i);
        if (k == 0) {
            if (bad_pos != NULL)
                *bad_pos = i;
            return -1;
        }
        i += k;
    }
    return 0;
}

void dl_printable(char *out, size_t out_size, const char *s, size_t len)
{
    size_t o = 0;

    if (out_size == 0)
        return;
    for (size_t i = 0; i < len;) {
        const unsigned char *u = (const unsigned char *)s + i;
        char tmp[8];
        size_t tlen;
        size_t adv = utf8_seq_len(u, len - i);

        if (adv == 1 && *u >= 0x20 && *u != 0x7f && *u != '\\') {
            tmp[0] = (char)*u;
            tlen = 1;
        } else if (adv == 1 && *u == '\\') {
            memcpy(tmp, "\\\\", 2);
            tlen = 2;
        } else if (adv == 1) {
            tlen = (size_t)snprintf(tmp, sizeof(tmp), "\\u%04x", *u);
        } else if (adv == 2 && u[0] == 0xc2 && u[1] < 0xa0) {
            /* a C1 control (U+0080..U+009F): U+009B is a CSI to terminals that take 8-bit controls */
            tlen = (size_t)snprintf(tmp, sizeof(tmp), "\\u%04x", u[1]);
        } else if (adv == 0) {
            tlen = (size_t)snprintf(tmp, sizeof(tmp), "\\x%02x", *u);
            adv = 1;
        } else {
            memcpy(tmp, u, adv);
            tlen = adv;
        }
        if (o + tlen + 4 > out_size) {      /* keep room for "..." and NUL */
            if (o + 4 <= out_size) {
                memcpy(out + o, "...", 3);
                o += 3;
            }
            break;
        }
        memcpy(out + o, tmp, tlen);
        o += tlen;
        i += adv;
    }
    out[o < out_size ? o : out_size - 1] = '\0';
}

static int dl_vfail(dl_error *err, dl_code code, const char *tensor, size_t tensor_len, const char *fmt,
                    va_list ap)
{
    if (err != NULL) {
        err->code = code;
        err->sys_errno = 0;
        vsnprintf(err->message, sizeof(err->message), fmt, ap);
        if (tensor != NULL)
            dl_printable(err->tensor, sizeof(err->tensor), tensor, tensor_len);
        else
            err->tensor[0] = '\0';
    }
    return -(int)code;
}

int dl_fail(dl_error *err, dl_code code, const char *tensor, size_t tensor_len, const char *fmt, ...)
{
    va_list ap;
    int rc;

    va_start(ap, fmt);
    rc = dl_vfail(err, code, tensor, tensor_len, fmt, ap);
    va_end(ap);
    return rc;
}

int dl_fail_errno(dl_error *err, int e, const char *fmt, ...)
{
    va_list ap;
    int rc;

    va_start(ap, fmt);
    rc = dl_vfail(err, DL_E_IO, NULL, 0, fmt, ap);
    va_end(ap);
    if (err != NULL) {
        size_t used = strlen(err->message);
        err->sys_errno = e;
        snprintf(err->message + used, sizeof(err->message) - used, ": %s", strerror(e));
    }
    return rc;
}

int dl_hex_digit(unsigned char c)
{
    if (c >= '0' && c <= '9')
        return c - '0';
    if (c >= 'a' && c <= 'f')
        return c - 'a' + 10;
    if (c >= 'A' && c <= 'F')
        return c - 'A' + 10;
    return -1;
}

size_t dl_utf8_put(char *o, unsigned cp)
{
    if (cp < 0x80) {
        o[0] = (char)cp;
        return 1;
    }
    if (cp < 0x800) {
        o[0] = (char)(0xc0 | (cp >> 6));
        o[1] = (char)(0x80 | (cp & 0x3f));
        return 2;
    }
    if (cp < 0x10000) {
        o[0] = (char)(0xe0 | (cp >> 12));
        o[1] = (char)(0x80 | ((cp >> 6) & 0x3f));
        o[2] = (char)(0x80 | (cp & 0x3f));
        return 3;
    }
    o[0] = (char)(0xf0 | (cp >> 18));
    o[1] = (char)(0x80 | ((cp >> 12) & 0x3f));
    o[2] = (char)(0x80 | ((cp >> 6) & 0x3f));
    o[3] = (char)(0x80 | (cp & 0x3f));
    return 4;
}
