/* index_parse: one parse of one version of a sharded delta's index in a shared tree, made once and
 * shared by those who need it.
 *
 * The file:// scan reads a set's index to learn how many shards it lists; the transport keeps what it
 * learnt (its memo, by the index's path and identity) and hands the parse over with the set, and intake
 * uses it when the file it opens is still that version, instead of reading and parsing it again.  An
 * index is up to 10 MiB (st_index_cap_for: 9.7 MB for a model of 20,000 tensors, 57 ms to parse), and a
 * set is handed over again whenever any of its files changes: before, a writer who touched a shard of a
 * refused set every 30 ms had its unchanged index parsed by intake at every scan.
 *
 * The version is fsu_ident (device, inode, size, mtime, ctime) of the descriptor read, taken before the
 * read and checked after it: a file changed while read is refused as such (INDEX_UNREAD), and ctime,
 * which every write, rename, link and chmod moves and the owner cannot set back, makes a rewrite with
 * its size and mtime put back a new version.
 *
 * The verdict is kept whatever it is: the parse (INDEX_PARSED), why it does not parse (INDEX_REFUSED,
 * and whether that looks like JSON cut short: a writer still at it), or why it could not be read.  The
 * parse itself (the st_index and the bytes it was parsed from, which intake stages) is large and is
 * kept only within one process-wide budget, INDEX_PARSE_KEPT_MAX bytes (index_parse_keep); without it
 * the verdict stays (the shard count) and intake reads the file itself, as it did before.
 *
 * Immutable once shared; reference-counted, and the last index_parse_release frees it, from any thread. */
#ifndef INDEX_PARSE_H
#define INDEX_PARSE_H

#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/stat.h>

#include "dl_error.h"
#include "fsutil.h"
#include "st_index.h"

/* What the kept parses may hold together (index_parse_keep): a few of the largest indexes (one of
 * 10 MiB of short names holds ~23 MB parsed), hundreds of a usual model's. */
#define INDEX_PARSE_KEPT_MAX ((size_t)64 << 20)

typedef enum index_parse_status {
    INDEX_PARSED,               /* it parses: nshards, and the parse itself when kept (ix != NULL) */
    INDEX_REFUSED,              /* it does not parse: why */
    INDEX_UNREAD,               /* not read as one version: too large, changed or shrank while read, I/O */
} index_parse_status;

typedef struct index_parse {
    fsu_ident ident;            /* the version (of the descriptor read) */
    index_parse_status status;
    uint32_t nshards;           /* INDEX_PARSED: the shards it lists; else 0 */
    st_index *ix;               /* INDEX_PARSED and kept: the parse; NULL otherwise */
    char *text;                 /* with ix: the len bytes it was parsed from */
    size_t len;
    size_t bytes;               /* memory ix and text hold (what index_parse_keep counts) */
    int kept;                   /* counted in the process-wide budget until freed */
    /* INDEX_REFUSED and INDEX_UNREAD: why, as a dl_error says it (index_parse_error) */
    dl_code code;
    int sys_errno;
    int incomplete;             /* it may still be being written (JSON cut short, a file changing) */
    char *message, *tensor;
    atomic_uint refs;
} index_parse;

/* Reads the index open at fd, whose fstat is sb (a regular file), and parses it for base (its file
 * name without ST_INDEX_SUFFIX), capped at ST_INDEX_MAX_BYTES.  0 and *out (one reference) whatever
 * the verdict, or -ENOMEM.  The parse is not kept: index_parse_keep or index_parse_drop decide. */
int index_parse_read(int fd, const struct stat *sb, const char *base, index_parse **out);
/* The verdict for an index that could not be opened (sb: its lstat; e: the negative errno). */
int index_parse_unopened(const struct stat *sb, int e, index_parse **out);
/* Whether p describes the version of the file sb is the fstat or lstat of. */
int index_parse_is_version(const index_parse *p, const struct stat *sb);
/* Keeps p's parse if it fits the process-wide budget (1), else drops it (0).  p not yet shared. */
int index_parse_keep(index_parse *p);
/* Frees p's parse and keeps its verdict (p not yet shared). */
void index_parse_drop(index_parse *p);
/* A new object with p's verdict and without its parse (NULL when out of memory). */
index_parse *index_parse_verdict_of(const index_parse *p);
index_parse *index_parse_ref(index_parse *p);
void index_parse_release(index_parse *p);
/* Why p is INDEX_REFUSED or INDEX_UNREAD, into err. */
void index_parse_error(const index_parse *p, dl_error *err);
/* Bytes the kept parses hold now (tests, /status). */
size_t index_parse_kept_bytes(void);

#endif
