/* delta_stream: validates a delta while its bytes arrive (an HTTP upload), so a bad file is refused
 * from its first bytes: the 8-byte length, then the header (metadata, path, key set, shapes, dtypes
 * checked against the global model as soon as it is complete), then every value checked finite as
 * it streams by.  Pure: no I/O; the caller writes the bytes wherever it keeps them. */
#ifndef DELTA_STREAM_H
#define DELTA_STREAM_H

#include <stddef.h>
#include <stdint.h>

#include "delta.h"
#include "delta_norm.h"
#include "dl_error.h"
#include "safetensors.h"

typedef struct delta_stream {
    /* set by the caller before the first feed */
    const st_header *global;
    const char *path;           /* the Hub path the metadata must agree with, or NULL */
    uint64_t max_header;        /* cap on N (bytes of header JSON held in memory) */
    uint64_t declared_len;      /* Content-Length, or 0 when unknown (chunked) */
    int defer_header;           /* the caller parses the header itself (delta_stream_parse_header) */
    /* state */
    unsigned char prefix[8];
    uint64_t n;
    char *hbuf;
    st_header *h;               /* the parsed header once complete */
    delta_info info;
    uint64_t file_len;          /* 8 + N + data, known with the header */
    uint64_t pos;               /* bytes fed so far */
    size_t tensor;              /* data section: current tensor (offset order) */
    unsigned char carry[8];     /* bytes of an element split between two feeds */
    size_t carry_len;
    delta_norm norm;            /* the values' sums of squares (delta_norm.h): info.norm once finished */
    delta_norm_block norm_block;
} delta_stream;

enum { DELTA_STREAM_MORE = 0, DELTA_STREAM_HEADER = 1, DELTA_STREAM_HEADER_READY = 2 };

/* Feeds bytes.  Returns DELTA_STREAM_HEADER exactly once, on the feed that completed the header (the
 * info and header are then available), DELTA_STREAM_MORE otherwise, or a negative code: the stream
 * is invalid (err says why and names the tensor). */
int delta_stream_feed(delta_stream *s, const char *p, size_t n, dl_error *err);
/* With defer_header set (a caller on an event loop, which must not spend a 16 MiB header's parse
 * there): feed at most delta_stream_room(s, n) bytes at a time.  The feed that completes the header
 * bytes returns DELTA_STREAM_HEADER_READY without parsing them; delta_stream_parse_header() then
 * parses and checks them (on any thread: it touches only s and reads s->global) and returns 0 or
 * a negative code, after which the data section is fed as usual.  Room is 0 in between. */
size_t delta_stream_room(const delta_stream *s, size_t n);
int delta_stream_parse_header(delta_stream *s, dl_error *err);
/* The same parse without the rules of a whole delta (metadata, every key): for one shard of a set,
 * which the caller checks on its own (delta_check_shard_header). */
int delta_stream_parse_header_only(delta_stream *s, dl_error *err);
/* After the last byte: the file must be exactly as long as its header says.  A compressed delta's codes
 * and scales are not checked here (they stream by in any order): the caller decodes them from the file
 * (delta_check_compressed_fd), merging norm (the plain keys' sums) with theirs. */
int delta_stream_finish(delta_stream *s, dl_error *err);
void delta_stream_free(delta_stream *s);

#endif
