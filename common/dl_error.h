/* dl_error: the error model of libdiloco.
 *
 * Functions that can fail return 0 or a negative DL_E_* code and, when given a dl_error, fill it with
 * the stable code, a message a person can act on, and the tensor it concerns (if any).  The code names
 * (dl_error_name) are part of the interface: they appear in CLI output, logs and HTTP error bodies. */
#ifndef DL_ERROR_H
#define DL_ERROR_H

#include <stddef.h>

typedef enum dl_code {
    DL_OK = 0,
    /* safetensors container, mirroring the reference's SafeTensorError variants */
    DL_E_HEADER_TOO_SMALL = 1,
    DL_E_HEADER_TOO_LARGE,
    DL_E_INVALID_HEADER_LENGTH,
    DL_E_INVALID_HEADER,                /* header is not UTF-8 */
    DL_E_INVALID_HEADER_DESERIALIZATION,/* JSON or schema error */
    DL_E_INVALID_OFFSET,
    DL_E_METADATA_INCOMPLETE_BUFFER,
    DL_E_VALIDATION_OVERFLOW,
    DL_E_MISALIGNED_SLICE,
    DL_E_TENSOR_INVALID_INFO,
    DL_E_DUPLICATE_KEY,                 /* stricter than the reference (it lets the last key win) */
    /* delta rules */
    DL_E_KEY_MISMATCH,
    DL_E_SHAPE_MISMATCH,
    DL_E_DTYPE_MISMATCH,
    DL_E_METADATA_MISSING,
    DL_E_METADATA_INVALID,
    DL_E_PATH_MISMATCH,
    DL_E_INVALID_PATH,
    DL_E_NON_FINITE,
    DL_E_UNSUPPORTED_DTYPE,
    DL_E_EMPTY_INPUT,
    /* environment */
    DL_E_INVALID_ARGUMENT,
    DL_E_IO,
    DL_E_NO_MEMORY,
    /* integrity: bytes read that are not the ones validated (a file rewritten in place) */
    DL_E_CHECKSUM_MISMATCH,
    /* the program's own invariants (a state table refused a move): a bug, said as one */
    DL_E_INTERNAL,
    DL_E__COUNT
} dl_code;

typedef struct dl_error {
    dl_code code;
    int sys_errno;          /* errno for DL_E_IO, else 0 */
    char message[512];
    char tensor[256];       /* printable (escaped) tensor name, "" when none */
} dl_error;

/* Stable snake_case name of a code ("shape_mismatch"). */
const char *dl_error_name(dl_code code);

/* Fills err (if non-NULL) and returns -code.  tensor may be NULL; name_len allows names with NUL. */
int dl_fail(dl_error *err, dl_code code, const char *tensor, size_t tensor_len, const char *fmt, ...)
    __attribute__((format(printf, 5, 6)));
/* DL_E_IO with errno e and the strerror text appended. */
int dl_fail_errno(dl_error *err, int e, const char *fmt, ...) __attribute__((format(printf, 3, 4)));

void dl_error_clear(dl_error *err);

/* 0 if s[0..n) is valid UTF-8 as Rust's from_utf8 defines it (no overlongs, no surrogates, at most
 * U+10FFFF); else -1 with the offset of the first bad byte in *bad_pos (if non-NULL). */
int dl_utf8_check(const char *s, size_t n, size_t *bad_pos);

/* The JSON parsers' shared pieces: a hex digit's value (-1 if c is none), and code point cp (at most
 * U+10FFFF) written as UTF-8 into o (room for 4 bytes), returning its length. */
int dl_hex_digit(unsigned char c);
size_t dl_utf8_put(char *o, unsigned cp);

/* Writes a printable form of an arbitrary byte string (JSON-style escapes for control bytes and NUL,
 * invalid UTF-8 as \xNN) into out, truncated with "..." when it does not fit.  Always NUL-terminates. */
void dl_printable(char *out, size_t out_size, const char *s, size_t len);

#endif
