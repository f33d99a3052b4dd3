/* Reading files in place through read-only mappings, safe against a file that shrinks meanwhile.
 *
 * A mapped page past a file's new end raises SIGBUS when touched (a worker truncated the delta we read,
 * or the disk failed a page-in).  mapread_guarded runs a function with a per-thread guard armed: SIGBUS
 * inside it jumps back and the call returns MAPREAD_BUS, which the caller turns into the same failure a
 * short pread would be.  A SIGBUS outside any guard puts the prior action back and happens again under
 * it (the default: the process dies; or a sanitizer's report).
 *
 * Mapped pages count in RSS while they are mapped: callers map bounded windows and unmap them, or reserve
 * a long window, populate it a part at a time and drop what they are done with. */
#ifndef DILOCO_MAPREAD_H
#define DILOCO_MAPREAD_H

#include <stddef.h>
#include <stdint.h>

/* 2 MiB: a window that starts and ends on these units of the file gets one page-table entry per 2 MiB
 * folio of the page cache (ext4 caches 2 MiB-aligned 2 MiB writes in such folios). */
#define MAPREAD_UNIT ((uint64_t)2 << 20)

/* What mapread_guarded returns when SIGBUS interrupted fn (fn's own results must differ from it). */
#define MAPREAD_BUS (-0x4255)

/* Installs the SIGBUS handler once per process; 1 when it is in place (reading in place is then
 * safe), 0 when it could not be (read with pread instead). */
int mapread_ready(void);

/* fn(arg) with the calling thread's guard armed; its result, or MAPREAD_BUS.  fn must leave nothing
 * half-done that a jump out of it would leak (no allocation, no lock held across the reads). */
int mapread_guarded(int (*fn)(void *arg), void *arg);

/* A read-only mapping of bytes [off, off + len) of fd, widened to whole units (MAPREAD_UNIT when
 * units, else pages) within file_size rounded up to a page.  MAP_POPULATE: one call sets up the page
 * tables of what is cached.  Returns the address of byte off, or NULL (then *base is NULL; read with
 * pread).  Unmap with mapread_unmap(*base, *maplen). */
const void *mapread_map(int fd, uint64_t file_size, uint64_t off, uint64_t len, int units, void **base,
                        size_t *maplen);
void mapread_unmap(void *base, size_t maplen);

/* As mapread_map, without setting up any page table: a window over a long range read in order, whose
 * pages the reader populates a part at a time (mapread_populate) and drops behind it (mapread_drop).
 * Each page is then populated once, by one call for many, and RSS stays what is being read now. */
const void *mapread_reserve(int fd, uint64_t file_size, uint64_t off, uint64_t len, int units, void **base,
                            size_t *maplen);
/* Sets up the page tables of the pages under [p, p + len) of a window, from what is cached (reading what
 * is not).  Best effort: a page it could not populate (a file cut short) is faulted in when read, or
 * raises SIGBUS there (under mapread_guarded). */
void mapread_populate(const void *p, size_t len);
/* Drops the page tables of bytes [from, to) of the window at base (from and to page multiples): their
 * pages leave RSS (the page cache keeps them). */
void mapread_drop(void *base, size_t from, size_t to);

#endif
