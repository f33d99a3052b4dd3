/* verdicts: what happened to each node's last deltas, for the node itself (GET /nodes/<id>).  Pure
 * state plus its file, unit-tested directly.
 *
 * An upload's answer can say only what is known when it is sent: a delta accepted into a round may
 * still be quarantined by the close's norm or cosine screen, by an overflowed pass, or dropped with a
 * discarded round.  So each verdict a delta gets is recorded here, for its node: at its arrival
 * (verdicts_arrive: accepted, queued, or refused with its reason) and later (verdicts_settle:
 * aggregated, quarantined, replaced, refused at the close), the latter updating the delta's pending
 * record in place.  Each node keeps its last VERDICTS_PER_NODE records and exact counts by reason
 * (every verdict given, whatever the records forgot).
 *
 * Bounded whatever a token holder sends: VERDICTS_NODES_MAX nodes (one more forgets the one seen
 * longest ago, counted in dropped_nodes), VERDICT_REASONS_MAX reasons per node (any other is counted
 * as "other"), messages cut to VERDICT_MESSAGE_MAX printable ASCII bytes.
 *
 * The table persists in <state>/verdicts.json (store_path_verdicts), replaced atomically
 * (verdicts_json + fsu_write_atomic); verdicts_parse refuses a file that is not exactly what
 * verdicts_json writes (a damaged or hostile one) as a whole, with a message. */
#ifndef VERDICTS_H
#define VERDICTS_H

#include <stddef.h>
#include <stdint.h>

#include "delta.h"
#include "dl_error.h"
#include "strbuf.h"

#define VERDICTS_PER_NODE 32
#define VERDICTS_NODES_MAX 64
#define VERDICT_REASONS_MAX 24
#define VERDICT_REASON_MAX 31
#define VERDICT_MESSAGE_MAX 240
#define VERDICTS_FILE_MAX (4u << 20)     /* far above a full table's file (about 1.3 MiB) */

typedef enum verdict_kind {
    VERDICT_ACCEPTED,           /* in the open round; the close decides (sync), or the update (async) */
    VERDICT_QUEUED,             /* async: taken for the update after the one being computed */
    VERDICT_AGGREGATED,         /* in a committed step (`step`: the step it made) */
    VERDICT_QUARANTINED,        /* not aggregated: the norm or cosine screen, or an overflowed pass */
    VERDICT_REPLACED,           /* a newer delta of the node took its place in the round */
    VERDICT_REFUSED,            /* not taken: invalid (an error code) or the round's rules (stale, ...) */
    VERDICT__COUNT
} verdict_kind;

typedef struct verdict_record {
    verdict_kind kind;
    char reason[VERDICT_REASON_MAX + 1];        /* [a-z0-9_]: the kind's name when it has no other */
    int status;                 /* the HTTP status answered, 0 when none was (a polled delta, the close) */
    int has_steps;              /* local_step and base_outer_step known (not for a container refused unread) */
    uint64_t local_step, base_outer_step;
    uint64_t step;              /* the open step when judged; for aggregated, the step it made */
    double at;                  /* Unix time */
    char message[VERDICT_MESSAGE_MAX + 1];
} verdict_record;

typedef struct verdict_count {
    char reason[VERDICT_REASON_MAX + 1];
    uint64_t n;
} verdict_count;

typedef struct verdict_node {
    char node_id[DELTA_NODE_ID_MAX + 1];
    verdict_record ring[VERDICTS_PER_NODE];    /* the oldest at head */
    size_t head, n;
    verdict_count counts[VERDICT_REASONS_MAX];      /* in the order first seen; the last may be "other" */
    size_t ncounts;
    uint64_t total;             /* every verdict recorded: the sum of counts */
    uint64_t seen;              /* the table's clock at its last verdict */
} verdict_node;

typedef struct verdicts {
    verdict_node *nodes;        /* VERDICTS_NODES_MAX of them (heap: about 0.5 MiB) */
    size_t n;
    uint64_t clock;
    uint64_t dropped_nodes;     /* nodes forgotten for more recent ones */
    uint64_t changes;           /* bumped by every verdict: the persisted copy is behind while it differs */
} verdicts;

extern const char *const verdict_kind_names[VERDICT__COUNT];

/* 0 or -DL_E_NO_MEMORY. */
int verdicts_init(verdicts *v);
void verdicts_free(verdicts *v);

/* What a verdict is about: the delta (has_steps 0: unknown) and its node's open step. */
typedef struct verdict_delta {
    const char *node_id;
    int has_steps;
    uint64_t local_step, base_outer_step, step;
} verdict_delta;

/* A delta's verdict at its arrival: a new record.  reason NULL: the kind's name.  message may be NULL. */
void verdicts_arrive(verdicts *v, const verdict_delta *dlt, verdict_kind kind, const char *reason, int status,
                     const char *message, double at);
/* A later verdict of a delta: its newest record of the same (local_step, base_outer_step) that is still
 * accepted or queued takes it; when none (forgotten, or a restart's replay of what the file already
 * says), only_pending leaves everything as it was, else a new record is made.  1 when recorded. */
int verdicts_settle(verdicts *v, const verdict_delta *dlt, verdict_kind kind, const char *reason,
                    const char *message, double at, int only_pending);

/* Whether the delta's newest record is still accepted or queued (a restart offers a cached delta again:
 * it has its record). */
int verdicts_pending(const verdicts *v, const verdict_delta *dlt);
const verdict_node *verdicts_find(const verdicts *v, const char *node_id);
/* How many verdicts of reason the node got (0 for an unknown node). */
uint64_t verdicts_count(const verdicts *v, const char *node_id, const char *reason);

/* GET /nodes/<id>'s document for node e (newest record first). */
void verdicts_node_json(const verdict_node *e, sbuf *b);
/* The file: every node's records and counts. */
void verdicts_json(const verdicts *v, sbuf *b);
/* Fills v (initialised, empty) from the file's text; on a refusal v is left empty: -DL_E_METADATA_INVALID
 * with what is wrong. */
int verdicts_parse(verdicts *v, const char *text, size_t len, dl_error *err);

#endif
