/* safetensors: a strict reader and a byte-compatible, streaming, atomic writer.
 *
 * The reader validates exactly as the reference implementation (huggingface/safetensors, tensor.rs)
 * and is stricter in three ways (tested against the reference in tests/integration/test_malformed.py):
 * duplicate keys at any level are
 * rejected, every size is computed with checked arithmetic, JSON nesting is capped at 128 levels.
 * The writer produces the reference's bytes for the same tensors and at most one metadata key. */
#ifndef SAFETENSORS_H
#define SAFETENSORS_H

#include <stdint.h>
#include <stddef.h>
#include <sys/types.h>

#include "dl_error.h"

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "libdiloco reads and writes little-endian tensor data in place: a little-endian host is required"
#endif

#define ST_MAX_HEADER_SIZE 100000000ULL   /* the reference's MAX_HEADER_SIZE */
#define ST_MAX_JSON_DEPTH 128             /* serde_json's recursion budget: 127 levels nest */

/* Enum order is the reference's Dtype order: the writer sorts by it (descending). */
typedef enum st_dtype {
    ST_BOOL, ST_F4, ST_F6_E2M3, ST_F6_E3M2, ST_U8, ST_I8, ST_F8_E5M2, ST_F8_E4M3, ST_F8_E8M0,
    ST_F8_E4M3FNUZ, ST_F8_E5M2FNUZ, ST_I16, ST_U16, ST_F16, ST_BF16, ST_I32, ST_U32, ST_F32,
    ST_C64, ST_F64, ST_I64, ST_U64,
    ST_DTYPE_COUNT
} st_dtype;

const char *st_dtype_name(st_dtype dt);
/* Parses a dtype name (case-sensitive); returns 0 and sets *out, or -1. */
int st_dtype_parse(const char *name, size_t len, st_dtype *out);
unsigned st_dtype_bits(st_dtype dt);
/* Floating for this project: F16, BF16, F32, F64, the F8/F6/F4 families and C64. */
int st_dtype_is_floating(st_dtype dt);

typedef struct st_tensor {
    char *name;             /* NUL-terminated copy; may itself contain NUL, so use name_len */
    size_t name_len;
    st_dtype dtype;
    size_t ndim;
    uint64_t *shape;        /* ndim entries (NULL for a scalar) */
    uint64_t nelem;         /* product of shape (1 for a scalar) */
    uint64_t begin, end;    /* byte range relative to the start of the data section */
} st_tensor;

typedef struct st_meta {
    char *key;
    size_t key_len;
    char *value;
    size_t value_len;
} st_meta;

typedef struct st_header {
    st_tensor *tensors;     /* in data-offset order */
    size_t ntensors;
    size_t *by_name;        /* indices into tensors, sorted by name bytes */
    st_meta *meta;          /* sorted by key bytes */
    size_t nmeta;
    int has_metadata;       /* "__metadata__" present and not null */
    uint64_t header_len;    /* N, the JSON length */
    uint64_t data_len;      /* end of the last tensor */
} st_header;

/* Parses and validates the N header bytes of a file of total length file_len (8 + N + data).
 * On success *out is a new header (st_header_free).  Stops at the first violation with its code. */
int st_header_parse(const char *json, size_t n, uint64_t file_len, st_header **out, dl_error *err);
/* All of the above but the final size check: for a file still being written or received. */
int st_header_parse_unsized(const char *json, size_t n, st_header **out, dl_error *err);
/* 8 + N + data length: the exact size of the file this header describes (-1 on overflow). */
int st_header_file_len(const st_header *h, uint64_t *len);
/* The same checks for a prefix of a file: validates the 8-byte length and the header when they are
 * complete.  Returns 0 with *out == NULL while more bytes are needed (need tells how many in total),
 * a header when complete, or an error.  Used by streaming uploads to refuse a bad file early. */
int st_header_parse_prefix(const char *buf, size_t avail, uint64_t file_len, size_t *need,
                           st_header **out, dl_error *err);
/* The refusal of a file whose 8-byte prefix cannot be a header length: n (the prefix read as one) is
 * over ST_MAX_HEADER_SIZE (code DL_E_HEADER_TOO_LARGE) or 8 + n is past file_len, the file's or the
 * body's length (DL_E_INVALID_HEADER_LENGTH).  The message says "not a safetensors file" and what the
 * file looks like (text, a ZIP archive such as torch.save's, a pickle, an .npy array ...) rather than
 * a 19-digit length; the code stays the reference's.  Every intake path calls it, so a file is named
 * the same way whichever path it came by.  Returns -code. */
int st_prefix_refusal(dl_error *err, dl_code code, const unsigned char prefix[8], uint64_t n, uint64_t file_len);
void st_header_free(st_header *h);
const st_tensor *st_header_find(const st_header *h, const char *name, size_t name_len);
/* Metadata value for key, or NULL (sets *len when non-NULL). */
const char *st_header_meta(const st_header *h, const char *key, size_t *len);
/* Bytes of a tensor (end - begin). */
static inline uint64_t st_tensor_bytes(const st_tensor *t) { return t->end - t->begin; }

/* ---- reader ---------------------------------------------------------------------------------- */
typedef struct st_file {
    int fd;                 /* a lazy file's: -1 while closed (st_file_acquire to use it) */
    char *path;
    uint64_t file_size;
    uint64_t data_start;    /* 8 + N */
    st_header *h;
    /* lazy files (st_file_lazy): the descriptor is opened on demand, kept in a process-wide LRU of at
     * most ST_LAZY_OPEN_MAX idle descriptors, closed only when no reader holds it (refs) */
    int lazy;
    unsigned refs;
    uint64_t dev, ino;      /* the file validated: a reopen must find that inode again */
    struct st_file *lru_prev, *lru_next;
} st_file;

/* Descriptors lazy files keep open at most, all sets together (more only while that many readers
 * hold one: one per reading thread).  A set of N shards per node thus costs O(1) descriptors, not
 * nodes x shards. */
#define ST_LAZY_OPEN_MAX 32

/* Opens and validates path (reads only the 8-byte prefix and the header; data is read on demand). */
int st_open(const char *path, st_file **out, dl_error *err);
/* st_open refusing a header of more than max_header bytes from its 8-byte prefix, before reading it
 * (0: the format's own cap, ST_MAX_HEADER_SIZE).  DL_E_HEADER_TOO_LARGE. */
int st_open_capped(const char *path, uint64_t max_header, st_file **out, dl_error *err);
void st_close(st_file *f);
/* Makes f lazy: its descriptor joins the LRU and may be closed when idle; a reopen (by path) checks
 * that the path still names the inode validated.  For the shards of a set, which would otherwise hold
 * one descriptor per shard per node.  Thread-safe, as st_file_acquire and st_file_release are. */
int st_file_lazy(st_file *f, dl_error *err);
/* f's descriptor for a read, held open until st_file_release (a plain file's: f->fd, no-op release). */
int st_file_acquire(const st_file *f, int *fd, dl_error *err);
void st_file_release(const st_file *f);
/* Reads len bytes at offset off within tensor t (bounds checked) with pread. */
int st_read(const st_file *f, const st_tensor *t, uint64_t off, void *buf, size_t len, dl_error *err);

/* ---- writer ---------------------------------------------------------------------------------- */
typedef struct st_spec {
    const char *name;
    size_t name_len;
    st_dtype dtype;
    size_t ndim;
    const uint64_t *shape;
} st_spec;

typedef struct st_kv {
    const char *key;
    const char *value;
} st_kv;

/* Serialises the header for specs (any order) exactly as the reference writer does.  meta == NULL
 * means no "__metadata__" key; nmeta == 0 with meta != NULL writes "__metadata__":{}.  Metadata keys
 * are written in bytewise order (the reference uses HashMap order, so only <= 1 key is comparable).
 * On success *json (malloc'd, padded with spaces so 8 + len is a multiple of 8), *json_len, and for
 * each spec i its data offsets[2*i], offsets[2*i+1] (relative to the data section) and *data_len. */
int st_header_build(const st_spec *specs, size_t n, const st_kv *meta, size_t nmeta, char **json,
                    size_t *json_len, uint64_t *offsets, uint64_t *data_len, dl_error *err);

typedef struct st_writer st_writer;

/* Creates a temporary file next to path, writes the header and reserves the data space.  Data is
 * then written per tensor with st_writer_write (any order, pwrite at known offsets, so several
 * threads may write disjoint ranges concurrently).  st_writer_commit fsyncs, renames over path and
 * fsyncs the directory; st_writer_abort removes the temporary file.  Either frees the writer. */
int st_writer_open(const char *path, const st_spec *specs, size_t n, const st_kv *meta, size_t nmeta,
                   st_writer **out, dl_error *err);
/* st_writer_open writing into warm_tmp (a file st_writer_warm_create made next to path) instead of a
 * new temporary file, when warm_tmp is non-NULL and still there: the writer takes it over (resized to
 * the output's size; a commit renames it, an abort removes it).  Without it, as st_writer_open. */
int st_writer_open_warm(const char *path, const st_spec *specs, size_t n, const st_kv *meta, size_t nmeta,
                        const char *warm_tmp, st_writer **out, dl_error *err);

/* Output pages made ahead of the writes.  Writing into page cache that does not exist yet costs a page
 * allocation per page; on a VM whose balloon reports free pages to the host, a page the guest gave back
 * also faults in the host (measured here: 1.35 s of system time to write 1 GiB of new page cache after
 * 8 s idle, 0.09 s to overwrite 1 GiB already cached).  st_writer_warm_create makes a temporary file
 * next to path with size bytes reserved (fallocate: the blocks are allocated, unwritten);
 * st_writer_warm_fill reads it, which puts zero pages into the page cache without any disk I/O (reserved,
 * unwritten space reads as zeros), until size bytes are in or *stop becomes nonzero.  A writer opened on
 * it later overwrites cached pages.  *tmp_path is malloc'd; *fd is read-only. */
int st_writer_warm_create(const char *path, uint64_t size, char **tmp_path, int *fd, dl_error *err);
/* Returns the bytes brought in (all of them unless stopped or a read failed).  While *pause is nonzero
 * (pause may be NULL) it waits, 10 ms at a time, without reading. */
uint64_t st_writer_warm_fill(int fd, uint64_t size, const _Atomic int *stop, const _Atomic int *pause);
int st_writer_write(st_writer *w, size_t spec_index, uint64_t off, const void *buf, size_t len,
                    dl_error *err);
/* Starts writeback of each range right after it is written (large outputs: the final fsync then
 * waits for little). */
void st_writer_set_writeback(st_writer *w, int on);
/* off: st_writer_commit only renames (no fsync of the file or its directory); the caller makes the
 * file durable later (a redo record can recreate it after a crash). */
void st_writer_set_durable(st_writer *w, int on);
/* Absolute file offset of the first byte of spec i's data. */
uint64_t st_writer_data_offset(const st_writer *w, size_t spec_index);
int st_writer_commit(st_writer *w, dl_error *err);
/* The temporary file's descriptor (for a caller that starts its write-back from another thread). */
int st_writer_fd(const st_writer *w);
void st_writer_abort(st_writer *w);

/* Whole-file convenience: data[i] holds spec i's bytes. */
int st_save(const char *path, const st_spec *specs, const void *const *data, size_t n,
            const st_kv *meta, size_t nmeta, dl_error *err);

/* Byte size of nelem elements of dt with the reference's checks (overflow, sub-byte alignment). */
int st_nbytes(st_dtype dt, const uint64_t *shape, size_t ndim, uint64_t *nelem, uint64_t *nbytes,
              dl_error *err, const char *name, size_t name_len);

#endif
