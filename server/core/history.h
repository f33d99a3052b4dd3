/* history: the record of every committed round, for /rounds, /status, /metrics and the dashboard.
 *
 * A round's record is part of its commit: the daemon serialises it before the commit, store_commit
 * writes it into outer_metadata.json (the commit point), and only then is it appended to
 * <state>/rounds.jsonl.  A crash between the commit and the append loses nothing: at startup,
 * history_load() finds the committed round's record missing from rounds.jsonl and appends it.  So
 * after any crash the file holds every committed step exactly once, in ascending order (duplicates
 * from an append that was retried are dropped on load).
 *
 * Memory keeps the last HISTORY_MAX records in a ring.  Functions that do I/O block: call them from
 * the thread pool or before the loop runs. */
#ifndef HISTORY_H
#define HISTORY_H

#include <stddef.h>
#include <stdint.h>
#include <time.h>

#include "delta.h"
#include "dl_error.h"
#include "strbuf.h"

typedef struct node_stat {
    char node_id[DELTA_NODE_ID_MAX + 1];
    uint64_t local_step;
    uint64_t bytes;
    double norm, cosine;
    /* async mode's update (record async): the delta's base, staleness at acceptance and weight */
    uint64_t base_outer_step, tau;
    double weight;
    /* robust aggregation: the norm intake read (delta_norm.h; NaN: not known), the scale the rule gave
     * the delta (clip factor or normalized weight; 1 otherwise); for a quarantined delta (the record's
     * quarantined[]) why, and the bound its norm (or cosine, in norm) broke */
    double intake_norm;
    double scale;
    char quarantine_reason[16];
    double bound;
    delta_metrics metrics;      /* what the worker reported with the delta (JSON "metrics", when any; a
                                   quarantined delta's too) */
    cz_spec cz;                 /* its encoding (JSON "encoding" and "block", when compressed) */
    double received_at;         /* Unix seconds the round took the delta (JSON "received_unix"); 0: not known,
                                   a record written before it was kept */
} node_stat;

/* One closed and committed round. */
typedef struct round_record {
    uint64_t step;              /* the step the round was based on; it produced step + 1 */
    char reason[16];
    double seconds;             /* aggregation: inputs opened .. files durable */
    double gbps;
    uint64_t bytes;
    double mean_norm;
    time_t closed_at;
    /* Unix seconds, finer than closed_at (a round may take 5 s): when the round opened (the previous
     * commit; 0: not known, the first round of a process or an older record) and closed (JSON
     * "opened_unix", "closed_unix"; 0 is left out, so an older record reads and writes back the same) */
    double opened_at, closed_wall;
    size_t n;
    node_stat *nodes;           /* owned */
    /* async mode: one update; its weight (the mean of its deltas'), its Delayed Nesterov phase after it
     * (k of N) and whether it was a Nesterov step */
    int async;
    double weight;
    unsigned dn_k, dn_period;
    int dn_tick;
    /* robust aggregation: the rule (--aggregate), and the round's quarantined deltas (owned) */
    char aggregate[24];
    size_t nquarantined;
    node_stat *quarantined;
    /* the deltas of the round's step the norm screen refused at their offer (422 outlier): never in the
     * round, so not its quarantines, kept for the history (JSON "refused", left out when none; owned) */
    size_t nrefused;
    node_stat *refused;
} round_record;

#define HISTORY_MAX 200

typedef struct history {
    round_record rec[HISTORY_MAX];
    size_t n, head;             /* ring: oldest at head */
} history;

/* A worker's reported metrics as one JSON object, the keys it carries only ({} for none): "loss",
 * "num_tokens", "inner_steps", "tokens_per_second", "weight", "metric": {name: value}; every double in the
 * fewest of 15..17 significant digits that parse back to the same bits. */
void history_metrics_json(sbuf *b, const delta_metrics *m);
/* The record as one JSON object (no newline): the line format of rounds.jsonl and of /rounds. */
void history_record_json(sbuf *b, const round_record *r);
/* Parses one such object; 0, or -1 when it is not a record. */
int history_record_parse(round_record *r, const char *json);
void history_record_free(round_record *r);

/* Appends r (the ring takes r->nodes; the oldest record goes when full). */
void history_push(history *h, round_record *r);
size_t history_count(const history *h);
/* i = 0 is the oldest kept record; NULL when out of range. */
const round_record *history_get(const history *h, size_t i);
const round_record *history_last(const history *h);
void history_free(history *h);

/* Appends lines (records, one per line; the last newline may be missing) to <state_dir>/rounds.jsonl
 * and makes them durable. */
int history_append(const char *state_dir, const char *lines, dl_error *err);
/* Startup: loads rounds.jsonl (records of steps before committed_step, ascending, each once), then
 * replays the committed round's record (committed_round_json, from outer_metadata.json; may be
 * NULL) if the file lacks it.  committed_step is UINT64_MAX when nothing is committed. */
int history_load(history *h, const char *state_dir, uint64_t committed_step, const char *committed_round_json,
                 dl_error *err);
/* history_load, calling each(arg, record) for every record it keeps (before the ring may drop it). */
int history_load_each(history *h, const char *state_dir, uint64_t committed_step, const char *committed_round_json,
                      void (*each)(void *arg, const round_record *r), void *arg, dl_error *err);
/* Retention: past 2 x keep records, rounds.jsonl is rewritten with the last keep (startup only). */
int history_compact(const char *state_dir, size_t keep, dl_error *err);

#endif
