/* manifest: the signed record of a committed step (README "Verifiable rounds").
 *
 * <state>/rounds/<s>.json is one JSON object, published as global/rounds/<s>.json with its detached
 * signature <s>.json.sig (64 raw bytes: Ed25519 over the exact bytes of the .json).  The daemon builds
 * its *skeleton* when it commits a step (everything but the outputs: the step, the previous record's block
 * hash, the configuration that changes the arithmetic, every input with its block hash and verdict, the
 * aggregator and the key) and keeps it verbatim in the redo record; manifest_write completes it with the
 * block hash of every output file.  The step's outputs are deterministic, so a step recomputed after a
 * crash gets the same record, byte for byte, and the same signature (Ed25519 is deterministic).
 *
 * The record's text: the skeleton without its closing brace, then
 *   ,"outputs":{"<name>":{"path":"<tree path>","block_hash":"<hex>","bytes":N},...}}
 * in the order of the outputs given (global first; momentum and the async accumulator when the step has
 * them; the downlink's view and update join the same list).  No time, no host, nothing that a recompute
 * could change.  All functions do blocking I/O: call them from the pool (or before the loop runs). */
#ifndef MANIFEST_H
#define MANIFEST_H

#include <stddef.h>
#include <stdint.h>

#include "dl_error.h"
#include "sign.h"
#include "strbuf.h"

#define MANIFEST_FORMAT 1
#define MANIFEST_MAX ((size_t)4 << 20)  /* a record is ~0.3 KB per input: 4 MiB is far above any round */
#define MANIFEST_KEEP 10000             /* records kept in the state (the newest), as on the Hub */
#define MANIFEST_HASH_HEX 65

/* One output of a step: name (a JSON key: "global", "momentum", "accumulator", ...), the path a worker
 * knows it by in the published tree (NULL: not published, e.g. the momentum), and the local file. */
typedef struct manifest_output {
    const char *name;
    const char *tree_path;
    const char *file;
} manifest_output;

/* Completes skeleton (a JSON object's text) with the outputs' block hashes, signs it with key and
 * writes rounds/<step>.json and .json.sig into state_dir, each renamed into place but not fsynced
 * (manifest_sync, from the step's settle; a crash before it recomputes the step and so the record).
 * hash receives the record's block hash (the next record's "previous").  0 or -DL_E_*. */
int manifest_write(const char *state_dir, uint64_t step, const char *skeleton, const manifest_output *outs,
                   size_t nouts, const sign_key *key, char hash[MANIFEST_HASH_HEX], dl_error *err);
/* manifest_write, also giving each output's block hash (out_hex[i] for outs[i]). */
int manifest_write_hashes(const char *state_dir, uint64_t step, const char *skeleton, const manifest_output *outs,
                          size_t nouts, const sign_key *key, char hash[MANIFEST_HASH_HEX],
                          char (*out_hex)[MANIFEST_HASH_HEX], dl_error *err);
/* The block hash the record of step names for its output name (hex ""): 0, 1 when the record or the
 * output is not there, or -DL_E_*. */
int manifest_output_of(const char *state_dir, uint64_t step, const char *name, char hex[MANIFEST_HASH_HEX],
                       dl_error *err);
/* The record and its signature made durable (their directory too). */
int manifest_sync(const char *state_dir, uint64_t step, dl_error *err);
/* The block hash of step's record in state_dir: 0, 1 when there is none, or -DL_E_*. */
int manifest_hash_of(const char *state_dir, uint64_t step, char hash[MANIFEST_HASH_HEX], dl_error *err);
/* Removes the record of step - MANIFEST_KEEP, if any (each write calls it: one goes as one comes). */
void manifest_prune(const char *state_dir, uint64_t step);

/* --verify-keep: what a verifier needs of a durable step, kept as hard links (no copy) in
 * verify/<step>/: global.safetensors, momentum.safetensors, accumulator.safetensors (those given) and
 * inputs/<node>.safetensors (single-file deltas; a set is not kept), made in a temporary directory and
 * renamed into place, then the steps keep or more older removed.  keep 0: nothing kept, every kept step
 * removed.  0 or -DL_E_*. */
int manifest_keep(const char *state_dir, uint64_t step, unsigned keep, const char *global, const char *momentum,
                  const char *accum, char *const *inputs, char *const *nodes, size_t n, dl_error *err);

/* Helpers for building a skeleton: a double in its shortest text that reads back to the same value
 * (JSON has no NaN/Inf: null), and "key":value members. */
void manifest_double(sbuf *b, double v);

#endif
