/* The bounds of a safetensors file arriving as an HTTP body (diloco pull).
 *
 * A file's size is written in its first bytes: 8 + N (the 8-byte header length, then N bytes of
 * header) + the data the header's offsets imply.  A body is taken only up to that size, and only when
 * its Content-Length, if it has one, says the same: a server that sends more is refused at the first
 * byte past the file, before it reaches the disk, instead of filling it (issue 33: a 16-byte model
 * followed by 300 MB was written whole before anything was checked). */
#ifndef CLI_BODY_H
#define CLI_BODY_H

#include <stdint.h>

#include "dl_error.h"
#include "strbuf.h"

typedef struct cli_body {
    uint64_t declared;      /* the body's Content-Length, when has_declared */
    int has_declared;
    uint64_t received;      /* body bytes taken so far */
    uint64_t header_len;    /* N, once the first 8 bytes are in (has_header_len) */
    int has_header_len;
    uint64_t total;         /* 8 + N + data, once the header is parsed; 0 before */
    sbuf head;              /* the first 8 + N bytes, kept until the header is parsed */
} cli_body;

/* Forgets everything (a new attempt, a new answer); frees what it held.  A zeroed cli_body is reset. */
void cli_body_reset(cli_body *g);

/* The body's Content-Length, before its first byte. */
void cli_body_declare(cli_body *g, uint64_t content_length);

/* Takes the body's next len bytes: 0 when all of them lie within the file (write them), else a
 * negative dl_code with err saying what the server sent (write none of them, abort the transfer). */
int cli_body_take(cli_body *g, const char *p, size_t len, dl_error *err);

#endif
