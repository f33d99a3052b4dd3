/* workers: what each worker last reported with its deltas (delta.h, delta_metrics), for /status and
 * /metrics.  Pure state, no I/O, unit-tested directly.
 *
 * The label cardinality is bounded: the table keeps the WORKERS_MAX workers seen most recently (one
 * more forgets the one seen longest ago), and the metric.<name> values are kept under the first
 * WORKERS_NAMES_MAX names seen since the process started; a value under any other name, and a worker
 * forgotten, are counted (the history keeps everything a round aggregated, whatever this table drops).
 *
 * A report (workers_report) is a delta the round took: the latest metrics.  A committed round
 * (workers_committed) adds its nodes' num_tokens to their tokens_total, the tokens trained into the
 * global; at startup the history's records are replayed with latest set, so a restart shows the
 * last aggregated reports again. */
#ifndef WORKERS_H
#define WORKERS_H

#include <stddef.h>
#include <stdint.h>
#include <time.h>

#include "delta.h"
#include "history.h"

#define WORKERS_MAX 64
#define WORKERS_NAMES_MAX 16

typedef struct worker_report {
    char node_id[DELTA_NODE_ID_MAX + 1];
    uint64_t base_outer_step, local_step;
    time_t at;                  /* when it was reported (Unix time) */
    uint64_t seen;              /* the table's clock at the report: the largest is the most recent */
    uint64_t tokens_total;      /* num_tokens of its deltas in committed rounds */
    delta_metrics metrics;      /* the named ones: only those under the table's names */
    cz_spec cz;                 /* the encoding of its last delta (compress.h) */
    uint64_t bytes;             /* and its bytes on the wire (the file, or the set's files) */
} worker_report;

typedef struct workers {
    worker_report w[WORKERS_MAX];       /* ascending node_id bytes */
    size_t n;
    uint64_t clock;
    char names[WORKERS_NAMES_MAX][DELTA_METRIC_NAME_MAX + 1];   /* in the order first seen */
    size_t nnames;
    uint64_t dropped_names;     /* metric.<name> values not kept: their name came past the cap */
    uint64_t dropped_nodes;     /* workers forgotten for a more recent one */
    uint64_t wire_bytes[CZ_MXFP4 + 1], wire_deltas[CZ_MXFP4 + 1];      /* the deltas taken, by encoding */
} workers;

void workers_init(workers *w);
/* node_id's delta (base, local_step) was taken with metrics m, in encoding cz, bytes on the wire. */
void workers_report(workers *w, const char *node_id, uint64_t base, uint64_t local_step, time_t at,
                    const delta_metrics *m, const cz_spec *cz, uint64_t bytes);
/* Round r was committed: its nodes' tokens count; latest (the startup's replay of the history): their
 * reports become the latest too. */
void workers_committed(workers *w, const round_record *r, int latest);
/* The worker's entry, or NULL. */
const worker_report *workers_find(const workers *w, const char *node_id);

#endif
