/* config: dilocod's options, from config/dilocod.conf-style files and command-line flags.
 * Every option has a flag (--round-timeout) and a file key (round_timeout); flags override the file. */
#ifndef CONFIG_H
#define CONFIG_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "delta.h"
#include "dl_log.h"

#define CONFIG_MAX_NODES 4096

typedef enum config_optimizer { OPT_NESTEROV_SGD, OPT_SGD } config_optimizer;
typedef enum config_weight { WEIGHT_CONSTANT, WEIGHT_POLY } config_weight;
/* --aggregate: in outer_rule's order (common/outer.h) */
typedef enum config_rule { RULE_MEAN, RULE_WEIGHTED, RULE_CLIPPED, RULE_TRIMMED, RULE_MEDIAN } config_rule;

#define CONFIG_NO_STALENESS_BOUND UINT32_MAX      /* max_staleness = none */

typedef struct config {
    char *config_file;
    char *state_root;
    char *id;
    char *hub;                  /* "none" or a URL of a transport of the scheme table (hub.h) */
    char *init_model;
    unsigned expected_nodes;    /* 0: not set (rounds close by timeout only) */
    char **nodes;               /* allow-list of node ids (sets expected_nodes) */
    size_t nnodes;
    unsigned min_nodes;
    double round_timeout;       /* seconds since the first accepted delta; 0 = none */
    config_optimizer optimizer;
    double lr;
    double momentum;
    unsigned threads;
    double poll_interval;       /* seconds */
    dl_log_level log_level;
    int log_json;
    unsigned agg_memory_mib;    /* aggregation buffers per worker thread */
    double retry_interval;      /* seconds before retrying a failed commit or publish */
    /* asynchronous outer steps (README "Asynchronous mode"); none of them changes sync mode */
    int async;                  /* --mode async: every accepted delta (or grace batch) is one update */
    unsigned max_staleness;     /* tau above it refused (CONFIG_NO_STALENESS_BOUND: none) */
    config_weight staleness_weight;
    unsigned dn_period;         /* Delayed Nesterov period N (0 in the file: expected_nodes, or 1) */
    int dn_paper;               /* --dn-variant paper (Liu et al.'s Algorithm 3), else forgather */
    double dn_c;                /* the paper variant's momentum activation c, in [0, 1/N] */
    double grace_ms;            /* deltas within it of the first pending one make one update */
    unsigned async_queue;       /* deltas pending at most (the open update and the queue); 503 beyond */
    unsigned dylu_base_steps;   /* H_base of the recommendation; 0: the fastest node's own steps per delta */
    double publish_interval;    /* seconds between publishes at least (< 0 unset: 30 s for hf:// async, else 0) */
    /* robust aggregation (README "Robust aggregation") */
    config_rule aggregate;
    unsigned trim_k;            /* trimmed_mean:K */
    double max_norm_ratio;      /* 0: off */
    double max_norm;            /* 0: off */
    double max_weight_ratio;    /* weighted_mean: a weight is capped at R x the round's median weight (R >= 1) */
    int screen;                 /* --screen cosine:MIN */
    double screen_cosine;
    /* HTTP */
    char *listen;               /* "HOST:PORT" or "none" */
    char *listen_host;          /* parsed from listen */
    int listen_port;
    char *token_file;
    char *signing_key;          /* NULL: steps are not signed (README "Verifiable rounds") */
    double verify_keep;         /* steps whose files are kept for verifiers (a whole number once checked; -1: auto) */
    unsigned max_header_bytes;
    unsigned max_headers;
    unsigned max_body_mib;      /* 0: the expected delta size plus the header cap */
    unsigned max_delta_header_mib;
    double header_timeout;
    double idle_timeout;
    unsigned max_connections;
    unsigned max_uploads;       /* uploads in progress at once (each holds ~2 MiB of buffers + its header) */
    /* the transport */
    unsigned max_downloads;
    unsigned prune_consumed;    /* 1: remove the transport's delta files once their step is durable */
    unsigned warm_outputs;      /* 1: make the next pass's output pages while a round collects */
    unsigned history_keep;      /* rounds.jsonl keeps at least this many records (compacted at startup) */
    uint64_t shard_size;        /* a published global above this is sharded (index + shards); 0 never */
    int downlink;               /* --downlink: compress.h's cz_encoding, CZ_NONE (0, the default), CZ_MXFP8 or CZ_MXFP4 */
    unsigned updates_keep;      /* --updates-keep: the downlink's updates kept and served (the newest N) */
    unsigned cluster_shards;    /* K aggregators over one bucket (README, "Scaling out"): S shards; 0: alone */
    double cluster_lease;       /* seconds: a shard claim's lease */
    /* The transports' own options (hub.h's hub_options), one struct of the transport's type per row
     * of the scheme table, NULL for a transport without options: every one read from the flags and
     * the file, only --hub's loaded (config_hub_options) */
    void **hub_opts;
    /* per option (the table in config.c, then the transports'): "FILE:LINE" of the file line that set
     * it, NULL when a flag or the default did, so a check that fails late still points at the line to fix */
    char **origin;
} config;

/* Defaults, then the file named by --config (if any), then the flags, then every check a start would
 * make that reads nothing but the configuration and the files it names (the init model's header, the
 * token file, the listen address, the shapes of the state and hub paths); nothing is created.  On a bad
 * value prints a message naming the option (and FILE:LINE when a file set it) to stderr and returns 2;
 * --help / --version / --check-config print and return 1 (the caller exits 0); 0 means run. */
int config_load(config *c, int argc, char **argv);
void config_print(const config *c, FILE *out);
/* dilocod --combinations: the table of what combines (config_modes.c), as README's Markdown table. */
void config_print_combinations(FILE *out);
void config_free(config *c);
const char *config_optimizer_name(config_optimizer o);
const char *config_weight_name(config_weight w);
/* --hub's transport's options struct, for its open() (hub_config.options); NULL when none. */
const void *config_hub_options(const config *c);
/* 1 with *value (NULL: unset) when --hub's transport has a text option key, else 0. */
int config_hub_value(const config *c, const char *key, const char **value);

const char *config_rule_name(config_rule r);

#endif
