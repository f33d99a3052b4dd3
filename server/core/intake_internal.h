/* What intake's files (server/core/intake*.c) share with each other:
 *   intake.c        a single file: open, header, finite check (in place or copied), zero-copy link
 *   intake_set.c    a sharded set: its index, listing, budget, each shard checked into a staging directory
 *   intake_cache.c  the cache under the node's lock: a file or a set linked in, the duplicate check
 * Included only by those files (make lint-layers keeps it so).  All of it blocking: the thread pool's. */
#ifndef INTAKE_INTERNAL_H
#define INTAKE_INTERNAL_H

#include <stdint.h>
#include <sys/stat.h>

#include "intake.h"

/* ---- intake.c: a single file, and what a set's shards reuse of it ---- */

/* Fails r with errno e and the message what: INTAKE_IO. */
intake_status intake__io_fail(intake_req *r, int e, const char *what);
/* A stat's mtime in nanoseconds. */
int64_t intake__mtime_ns(const struct stat *sb);
/* The header cap in bytes: the request's, never above the format's. */
uint64_t intake__max_header(const intake_req *r);
/* The refusal for a source that could not be opened (rc < 0); mode is what was found there. */
intake_status intake__open_refusal(intake_req *r, int rc, mode_t mode);
/* A safetensors file's header, read from src (size bytes), checked to describe exactly size bytes. */
intake_status intake__read_header(intake_req *r, int src, uint64_t size, unsigned char prefix[8], char **json,
                                  uint64_t *n, st_header **h);
/* Copies a file whose header was read to dst with the finite check, checks it did not change, fsyncs dst. */
intake_status intake__copy_file(intake_req *r, int src, const struct stat *before, int dst,
                                const unsigned char prefix[8], const char *json, uint64_t n, const st_header *h);

/* ---- intake_set.c ---- */

/* A sharded delta, r->src_path its index: checked and linked into the cache (intake_run's other half). */
intake_status intake__set(intake_req *r);

/* ---- intake_cache.c ---- */

/* Whether this node's delta of this local step is cached in either layout (the node's lock is held,
 * or a later link under it decides). */
int intake__cached_in_any_layout(const char *state_dir, const delta_info *info);

#endif
