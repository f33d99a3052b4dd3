/* st_index: sharded safetensors checkpoints, the Hugging Face index + shards convention.
 *
 * huggingface_hub.save_torch_state_dict(sd, dir, filename_pattern="<base>{suffix}.safetensors",
 * max_shard_size=S, metadata=M) (checked against huggingface_hub 2.4) writes either
 *   - the plain <base>.safetensors with metadata {"format": "pt", **M}, when everything fits one shard;
 *   - or <base>-00001-of-0000N.safetensors ... <base>-0000N-of-0000N.safetensors, each with the metadata
 *     {"format": "pt"} only, and <base>.safetensors.index.json =
 *     {"metadata": {"total_size": T, **M}, "weight_map": {tensor: shard file}} (json.dump, indent=2).
 * Shard numbers are "%05d" (1-based), T is the sum of the tensors' storage bytes (for a state dict of
 * contiguous tensors that own their storage, as a delta's are: the sum of the tensors' data bytes).
 * The split walks the state dict in order and starts a new shard when the next tensor would take
 * the current one past S; a tensor larger than S gets a shard of its own.
 *
 * This module
 *   - parses an index strictly (st_index_parse / st_index_load: hostile input);
 *   - checks a complete set given the shards' headers (st_index_check_set);
 *   - opens one file or a whole set as one logical safetensors (st_set), so code that reads tensors
 *     by name works over either;
 *   - writes a set exactly as huggingface_hub would for the same tensors in the same order
 *     (st_set_writer), or the plain single file when one shard is enough.
 * The delta rules over a set (metadata from the index, agreement with the path) live in delta.h.
 *
 * For the daemon: intake of a set = parse the index (st_index_parse) as soon as it arrives, check
 * each shard's header as it arrives (delta_check_shard_header), and when the index and all N shards
 * are in, st_set_assemble + delta_check_set_header; the aggregation pass reads through st_set_find /
 * st_set_read; publishing a global is st_set_writer_open with --shard-size. */
#ifndef ST_INDEX_H
#define ST_INDEX_H

#include <stddef.h>
#include <stdint.h>

#include "dl_error.h"
#include "safetensors.h"

#define ST_INDEX_MAX_BYTES (10u * 1024u * 1024u)   /* huggingface_hub's MAX_INDEX_FILE_SIZE */
#define ST_INDEX_MAX_SHARDS 99999u                  /* what five digits can name */
#define ST_INDEX_SUFFIX ".safetensors.index.json"
#define ST_SHARD_SIZE_DEFAULT 5000000000ULL         /* huggingface_hub's "5GB" (decimal) */
/* Longest base name accepted (a file name component, with room for the suffixes). */
#define ST_INDEX_BASE_MAX 200

typedef struct st_index_entry {
    char *name;             /* tensor name (NUL-terminated; never holds NUL: refused at parse) */
    size_t name_len;
    uint32_t shard;         /* 0-based: file <base>-<shard+1>-of-<nshards> */
} st_index_entry;

typedef struct st_index {
    char *base;             /* "delta_5": files are <base>-%05u-of-%05u.safetensors */
    uint32_t nshards;
    uint64_t total_size;
    st_meta *meta;          /* "metadata" other than total_size, in file order; integer values as decimal text */
    size_t nmeta;
    st_index_entry *entries;/* "weight_map" in file order (huggingface_hub: the state dict's order) */
    size_t nentries;
    size_t *by_name;        /* indices into entries, sorted by name bytes */
} st_index;

/* Strict parse of an index's text for the given base (the file name minus ST_INDEX_SUFFIX):
 * at most ST_INDEX_MAX_BYTES of UTF-8 JSON, exactly the keys "metadata" (an object holding
 * "total_size", an integer in [0, 2^53), and otherwise strings or such integers) and "weight_map"
 * (a non-empty object of strings); no duplicate key at any level, no NUL in any string; every
 * weight_map value is <base>-<i>-of-<N>.safetensors with one N for all and every i in 1..N used.
 * Codes: DL_E_INVALID_HEADER_DESERIALIZATION for JSON and schema errors, DL_E_DUPLICATE_KEY,
 * DL_E_INVALID_PATH for a bad shard name, DL_E_HEADER_TOO_LARGE over the cap. */
int st_index_parse(const char *text, size_t len, const char *base, st_index **out, dl_error *err);
/* The same with a tighter cap (bytes, at most ST_INDEX_MAX_BYTES): see st_index_cap_for.  The
 * parser walks the schema without building a tree: nesting, arrays, null, booleans and unknown keys
 * are refused at their first byte, and memory is proportional to what the st_index keeps. */
int st_index_parse_capped(const char *text, size_t len, const char *base, size_t cap, st_index **out,
                          dl_error *err);
/* The cap for a delta index of the model `global` (its floating tensors are a delta's keys): per
 * tensor its name as json.dump may escape it (at most 6 bytes per byte: \u00XX), the longest shard
 * file name and the indent=2 punctuation, plus 64 KiB for the metadata; at most ST_INDEX_MAX_BYTES.
 * A 1,000-tensor model with 50-byte names gets ~0.6 MB, not 10 MiB. */
size_t st_index_cap_for(const st_header *global);
/* Reads path (capped) and parses it; the base comes from the file name, which must end in
 * ST_INDEX_SUFFIX. */
int st_index_load(const char *path, st_index **out, dl_error *err);
/* The same refusing an index over cap bytes (at most ST_INDEX_MAX_BYTES) from its size, before it is read. */
int st_index_load_capped(const char *path, size_t cap, st_index **out, dl_error *err);
void st_index_free(st_index *ix);
/* A deep copy (for a caller that must hand an index over, st_set_assemble, while keeping its own);
 * NULL when out of memory. */
st_index *st_index_clone(const st_index *ix);
const st_index_entry *st_index_find(const st_index *ix, const char *name, size_t name_len);
/* Metadata value for key (not total_size), or NULL; sets *len when non-NULL. */
const char *st_index_meta(const st_index *ix, const char *key, size_t *len);

/* Whether path names an index (ends in ST_INDEX_SUFFIX, with something before it). */
int st_index_is_index_path(const char *path);
/* Whether base is usable in file names: 1..ST_INDEX_BASE_MAX bytes of [A-Za-z0-9._-], not "." or "..". */
int st_index_valid_base(const char *base, size_t len);
/* "<base>-%05u-of-%05u.safetensors" for 0-based shard i of n into out; -1 if it does not fit. */
int st_index_shard_name(const char *base, uint32_t i, uint32_t n, char *out, size_t size);
/* Parses a shard file name of base: sets the 0-based *i and the count *n.  0 or -1. */
int st_index_parse_shard_name(const char *name, size_t len, const char *base, uint32_t *i, uint32_t *n);
/* What a file name is with respect to the convention: ST_NAME_SINGLE "<base>.safetensors",
 * ST_NAME_INDEX "<base>.safetensors.index.json", ST_NAME_SHARD "<base>-<i>-of-<N>.safetensors"
 * (base, i, n set), or ST_NAME_OTHER.  base receives the base (NUL-terminated). */
typedef enum st_name_kind { ST_NAME_OTHER, ST_NAME_SINGLE, ST_NAME_INDEX, ST_NAME_SHARD } st_name_kind;
st_name_kind st_index_classify(const char *name, size_t len, char base[ST_INDEX_BASE_MAX + 1], uint32_t *i,
                               uint32_t *n);

/* Checks a complete set: shards[i] is the header of shard i (0-based, ix->nshards of them).  Every
 * tensor of every shard is listed for that shard, every listed tensor is in its shard, no tensor is
 * in two shards, total_size equals the sum of the tensors' data bytes, a shard's "format" metadata
 * (if any) is "pt" or "mlx" (what huggingface_hub loads), and any other metadata a shard carries
 * agrees with the index's value for that key.  DL_E_KEY_MISMATCH / DL_E_METADATA_INVALID /
 * DL_E_PATH_MISMATCH with the tensor or the shard named. */
int st_index_check_set(const st_index *ix, const st_header *const *shards, dl_error *err);
/* Checks that names (a directory or a Hub listing, file names only) hold no shard of base that
 * the index does not list (another shard number or count): a stray part of another set. */
int st_index_check_listing(const st_index *ix, const char *const *names, size_t n, dl_error *err);

/* ---- one file or a set, as one logical safetensors ------------------------------------------- */
typedef struct st_set {
    char *path;                 /* what was opened: the .safetensors file or the index */
    st_index *index;            /* NULL for a single file */
    st_file **files;            /* the file, or the shards in shard order */
    size_t nfiles;
    size_t ntensors;
    const st_tensor **by_name;  /* every tensor, sorted by name bytes (pointers into files[]->h) */
    uint32_t *by_name_file;     /* which file holds by_name[i] */
    const st_tensor **order;    /* the save order: the index's weight_map order, name order for one file */
    uint32_t *order_file;
    uint64_t data_bytes;        /* sum of the tensors' data bytes */
} st_set;

/* Opens path: an index (ST_INDEX_SUFFIX: the shards are read from its directory and the set is
 * checked with st_index_check_set) or a single safetensors file. */
int st_set_open(const char *path, st_set **out, dl_error *err);
/* st_set_open for another writer's checkpoint (an adopted global), its headers held to max_header
 * bytes as a delta's are (0: st_set_open, the format's own caps).  A single file's header is capped
 * at max_header; a set's shards' headers together are (a delta set's budget holds one header cap
 * too), each refused from its 8-byte prefix before it is read, and its index at what such a set's
 * index can be (6 x max_header + 64 KiB: see index_cap_for_headers), at most ST_INDEX_MAX_BYTES.
 * DL_E_HEADER_TOO_LARGE, naming the file and the cap. */
int st_set_open_capped(const char *path, uint64_t max_header, st_set **out, dl_error *err);
/* Builds a set from an index and its opened shards (files[i] = shard i, ix->nshards of them),
 * checking it with st_index_check_set.  Takes ownership of ix and of every file and the files
 * array (malloc'd) in every case.  For callers that open files their own way (openat). */
int st_set_assemble(const char *path, st_index *ix, st_file **files, st_set **out, dl_error *err);
/* A one-file set around f (takes ownership of f in every case). */
int st_set_wrap(st_file *f, st_set **out, dl_error *err);
void st_set_close(st_set *s);
/* The tensor called name, or NULL; *file (when non-NULL) receives the file that holds it. */
const st_tensor *st_set_find(const st_set *s, const char *name, size_t name_len, uint32_t *file);
/* st_read on the file that holds t. */
int st_set_read(const st_set *s, uint32_t file, const st_tensor *t, uint64_t off, void *buf, size_t len,
                dl_error *err);
/* The set's metadata (the index's without total_size, or the file's header's).  Pointers stay valid
 * while s is open. */
void st_set_metadata(const st_set *s, const st_meta **meta, size_t *n);

/* ---- writing --------------------------------------------------------------------------------- */
/* huggingface_hub's split: shard_of[i] (0-based) for specs in the given order, *nshards.
 * max_shard_size 0 means one shard.  Sizes with st_nbytes (errors for invalid specs). */
/* st_index_plan with glue (st_set_writer_open_glued). */
int st_index_plan_glued(const st_spec *specs, size_t n, const unsigned char *glue, uint64_t max_shard_size,
                        uint32_t *shard_of, uint32_t *nshards, dl_error *err);
int st_index_plan(const st_spec *specs, size_t n, uint64_t max_shard_size, uint32_t *shard_of,
                  uint32_t *nshards, dl_error *err);
/* A cluster's plan (README, "Scaling out"): specs in the given order cut into exactly nshards
 * contiguous runs of whole tensors of about equal bytes; every aggregator computes the same.
 * -DL_E_INVALID_ARGUMENT when there are fewer tensors than shards. */
int st_index_plan_even(const st_spec *specs, size_t n, uint32_t nshards, uint32_t *shard_of, dl_error *err);
/* The index text exactly as json.dump(index, f, indent=2) writes it (ensure_ascii escapes), for
 * the plan and specs above and the metadata in the given order.  malloc'd, *len set; NULL on OOM. */
char *st_index_build_json(const char *base, const st_spec *specs, size_t n, const uint32_t *shard_of,
                          uint32_t nshards, const st_kv *meta, size_t nmeta, size_t *len);

typedef struct st_set_writer st_set_writer;
/* Like st_writer_open for path = <dir>/<base>.safetensors (a path ending in ST_INDEX_SUFFIX is
 * taken as the same base).  When the specs, in the given order, need more than one shard of
 * max_shard_size bytes (0: never shard), writes the shards with {"format": "pt"} and, at commit,
 * the index with total_size and meta; otherwise the plain file at path with meta, byte for byte as
 * st_writer_open.  Data is written per spec as with st_writer_write (any order, any thread). */
int st_set_writer_open(const char *path, const st_spec *specs, size_t n, const st_kv *meta, size_t nmeta,
                       uint64_t max_shard_size, st_set_writer **out, dl_error *err);
/* The same, spec i in the shard of spec i - 1 wherever glue[i] is set (a compressed key's scales with
 * its codes): glued specs are split as one tensor of their total size.  glue NULL: none. */
int st_set_writer_open_glued(const char *path, const st_spec *specs, size_t n, const unsigned char *glue,
                             const st_kv *meta, size_t nmeta, uint64_t max_shard_size, st_set_writer **out,
                             dl_error *err);
int st_set_writer_write(st_set_writer *w, size_t spec_index, uint64_t off, const void *buf, size_t len,
                        dl_error *err);
/* 1 for a plain file, else the shard count. */
uint32_t st_set_writer_nshards(const st_set_writer *w);
/* Commits every shard (each atomically, durable), then the index last (atomically), so an index
 * is only ever seen next to a complete set.  Then removes what an earlier save of the same base
 * left in the directory that the new layout does not use (the single file, an index, shards of
 * another count), as huggingface_hub does before saving.  Frees w in every case. */
int st_set_writer_commit(st_set_writer *w, dl_error *err);
void st_set_writer_abort(st_set_writer *w);

/* Parses a size: bytes ("1000000") or huggingface_hub's units ("5GB", "1.5MB", "10KB", "1TB",
 * decimal).  0 or -1. */
int st_parse_size(const char *s, uint64_t *out);

#endif
