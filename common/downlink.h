/* downlink: the compressed update workers download instead of the model (README, "The downlink").
 *
 * Besides the exact global, the server keeps the view: the model the workers hold.  At step s, per
 * floating key, with the uplink's codec (compress.h) and its block rules:
 *   U_s    = encode(global_s - view_{s-1})                  the difference in F32
 *   view_s = round(view_{s-1} + decode(U_s))                one F32 add, one rounding to the key's dtype
 * The MX decodes are exact products, so any IEEE-754 device that adds in F32 and rounds to nearest even
 * makes the same view bit for bit.  int8_block is not offered: its q x s is a rounded product, and a
 * fused multiply-add gives other bits.  A key the encoding cannot hold (C64; mxfp4 with an odd count)
 * is plain in U_s (F32, or C64 as F32 pairs): its decode is the difference itself.
 *
 * The view's file keeps the header of the first view (the global it started from) byte for byte: only
 * the values of floating keys change, so a worker that replays the updates in place over the bytes of
 * the view it downloaded holds exactly the server's file, and checks it with its block hash
 * (blockhash.h), which each update's metadata carries ("view_hash").  Non-floating keys never change
 * (the outer step copies them), so they are copied and an update has none.
 *
 * The update's metadata (string values): step, base_step (the step of the view it applies to),
 * encoding, block, view_hash (hex, of view_s's file). */
#ifndef DOWNLINK_H
#define DOWNLINK_H

#include <stdint.h>

#include "compress.h"
#include "dl_error.h"

/* Values read per chunk: a multiple of CZ_MX_BLOCK (and even, for mxfp4's nibbles). */
#define DOWNLINK_CHUNK ((uint64_t)1 << 18)

typedef struct downlink_args {
    cz_encoding enc;            /* CZ_MXFP8 or CZ_MXFP4 */
    const char *global_path;    /* global_s */
    const char *view_path;      /* view_{s-1} (the global itself when the view starts here) */
    const char *out_view_path;  /* view_s */
    const char *out_update_path;        /* U_s */
    uint64_t step, base_step;
    int durable;                /* fsync the outputs and their directory; else rename only (the caller makes
                                   them durable later: a redo record recomputes them after a crash) */
} downlink_args;

typedef struct downlink_out {
    unsigned char view_hash[32];        /* blockhash of out_view_path's bytes */
    uint64_t view_bytes, update_bytes;  /* the two files' sizes */
    double max_gap;                     /* max |global_s - view_s| over the floating values (F32) */
} downlink_out;

/* The same in parts, for several threads (the daemon's pool): downlink_prepare opens the inputs, plans the
 * units and opens both outputs; downlink_run, called from any number of threads at once, takes units
 * until none is left (or one failed: its error is the pass's); downlink_finish, after every run returned,
 * hashes the view and commits both files, or removes them, and frees the pass whatever happened.  The
 * args' strings must outlive the pass. */
typedef struct downlink_pass downlink_pass;
int downlink_prepare(const downlink_args *a, downlink_pass **out, dl_error *err);
int downlink_run(downlink_pass *p);
/* Makes the runs stop at their next unit (downlink_finish then removes the outputs). */
void downlink_abort(downlink_pass *p);
int downlink_finish(downlink_pass *p, downlink_out *out, dl_error *err);

/* Whether the downlink can use enc (mxfp8, mxfp4). */
int downlink_encoding_ok(cz_encoding enc);
/* Makes view_s and U_s.  Both outputs are written to temporary files and renamed into place; on failure
 * neither is left.  0, or a negative DL_E_* with the message (the tensor named where one is at fault). */
int downlink_make(const downlink_args *a, downlink_out *out, dl_error *err);

#endif
