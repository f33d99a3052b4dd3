/* wbuf: two buffers that stream a file to disk, one filling while the other is written, with the writes
 * cut at multiples of a unit of the file.  Used by HTTP uploads and the Hub's file downloads: a 2 MiB
 * write at a 2 MiB offset lands in one 2 MiB page-cache folio, which the aggregation pass maps with one
 * page-table entry (common/outer.c). */
#ifndef WBUF_H
#define WBUF_H

#include <stddef.h>
#include <stdint.h>

typedef struct wbuf {
    char *fill;                 /* the filling buffer */
    char *out;                  /* the buffer handed to the write in flight */
    size_t fill_len, fill_cap, out_cap;
} wbuf;

/* Two buffers of cap bytes.  0 or -ENOMEM (nothing kept). */
int wbuf_init(wbuf *b, size_t cap);
void wbuf_free(wbuf *b);
/* Bytes from file offset off to the next multiple of unit (unit when off is one). */
size_t wbuf_unit_left(uint64_t off, size_t unit);
/* How much of the filling buffer, which starts at file offset off, to write now: up to the next
 * multiple of unit, or all of it when all (the stream ended). */
size_t wbuf_cut(const wbuf *b, uint64_t off, size_t unit, int all);
/* Appends n bytes to the filling buffer, growing it if need be.  0 or -ENOMEM (nothing appended). */
int wbuf_append(wbuf *b, const void *p, size_t n);
/* Hands the first len (<= fill_len) bytes of the filling buffer to the write (b->out) and carries the
 * rest to the other buffer, which fills next.  0 or -ENOMEM (nothing moved). */
int wbuf_swap(wbuf *b, size_t len);

#endif
