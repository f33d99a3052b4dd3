/* config_modes.c: what combines, as one table (README, "What combines").  A row is something the
 * configuration asks for and what it needs.  A row of kind REFUSED refuses a configuration that asks
 * without the need (--check-config and the start, exit 2), its message naming both sides; a row of kind
 * IGNORED warns about an option set to another value than its default while the mode that reads it is
 * not chosen (accepted: the shipped config file sets async options beside mode = sync).  `dilocod
 * --combinations` prints the table; README's is checked against it (test_config.py). */
#include "config.h"
#include "config_internal.h"
#include "st_index.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef enum combine_kind { COMBINE_REFUSED, COMBINE_IGNORED } combine_kind;

typedef struct combine_row {
    combine_kind kind;
    const char *key;            /* the option to blame (REFUSED) or to warn about (IGNORED) */
    const char *asks;           /* the feature, as a user gives it */
    int (*asked)(const config *c);      /* REFUSED only: whether c asks for it (IGNORED: its value is not the default) */
    const char *needs;          /* the requirement, as a user gives it */
    int (*holds)(const config *c);
    const char *why;
} combine_row;

static int is_async(const config *c) { return c->async; }
static int is_sync(const config *c) { return !c->async; }
static int is_cluster(const config *c) { return c->cluster_shards != 0; }
static int not_cluster(const config *c) { return c->cluster_shards == 0; }
static int is_weighted(const config *c) { return c->aggregate == RULE_WEIGHTED; }
static int is_clipped(const config *c) { return c->aggregate == RULE_CLIPPED; }
static int hub_is_s3(const config *c) { return strncmp(c->hub, "s3://", 5) == 0; }
static int has_max_norm(const config *c) { return c->max_norm != 0; }
static int has_max_norm_ratio(const config *c) { return c->max_norm_ratio != 0; }
static int has_screen(const config *c) { return c->screen; }
static int async_ratio(const config *c) { return c->async && c->max_norm_ratio != 0; }
static int counts_nodes(const config *c) { return c->expected_nodes != 0; }
static int async_activation(const config *c) { return c->async && c->dn_c != 0; }
static int paper_variant(const config *c) { return c->dn_paper; }
static int is_signing(const config *c) { return c->signing_key != NULL; }
static int not_hf(const config *c) { return strncmp(c->hub, "hf://", 5) != 0; }
static int has_downlink(const config *c) { return c->downlink != 0; }
static int hub_local(const config *c) { return strcmp(c->hub, "none") == 0 || strncmp(c->hub, "file://", 7) == 0; }
static int publishes_each(const config *c) { return c->publish_interval == 0; }
static int rounds_close(const config *c) { return c->expected_nodes != 0 || c->round_timeout != 0; }

#define SLICES "each aggregator of a cluster reads one slice of each delta"

static const combine_row rows[] = {
    {COMBINE_REFUSED, "cluster_shards", "--cluster-shards S", is_cluster, "--hub s3://...", hub_is_s3,
     "the bucket is what the aggregators share"},
    {COMBINE_REFUSED, "cluster_shards", "--cluster-shards S", is_cluster, "--mode sync", is_sync,
     "an asynchronous cluster is not built yet"},
    {COMBINE_REFUSED, "aggregate", "--aggregate clipped_mean", is_clipped, "no --cluster-shards", not_cluster,
     "it needs each delta's whole norm, and " SLICES " (a cluster takes mean, weighted_mean, median or trimmed_mean:K)"},
    {COMBINE_REFUSED, "max_norm", "--max-norm X", has_max_norm, "no --cluster-shards", not_cluster,
     "the norm and cosine screens need whole deltas, and " SLICES},
    {COMBINE_REFUSED, "max_norm_ratio", "--max-norm-ratio R", has_max_norm_ratio, "no --cluster-shards", not_cluster,
     "the norm and cosine screens need whole deltas, and " SLICES},
    {COMBINE_REFUSED, "screen", "--screen cosine:MIN", has_screen, "no --cluster-shards", not_cluster,
     "the norm and cosine screens need whole deltas, and " SLICES},
    {COMBINE_REFUSED, "max_norm_ratio", "--max-norm-ratio R in --mode async", async_ratio,
     "--expected-nodes N (or --nodes)", counts_nodes,
     "the nodes not seen yet must count, or the first ones to send would set the median every delta is judged by"},
    {COMBINE_REFUSED, "dn_momentum_activation", "--dn-momentum-activation C in --mode async", async_activation,
     "--dn-variant paper", paper_variant, "it applies to dn_variant paper only"},
    {COMBINE_REFUSED, "expected_nodes", "--mode sync", is_sync, "--expected-nodes N, --nodes or --round-timeout S",
     rounds_close, "rounds would never close"},
    {COMBINE_REFUSED, "signing_key", "--signing-key FILE", is_signing, "--hub file://..., s3://... or none", not_hf,
     "signed records are not published on hf:// yet"},
    {COMBINE_REFUSED, "signing_key", "--signing-key FILE", is_signing, "no --cluster-shards", not_cluster,
     "a cluster's done markers are not signed yet"},
    {COMBINE_REFUSED, "downlink", "--downlink E", has_downlink, "no --cluster-shards", not_cluster,
     "a cluster's aggregators would each compute the update of their shard: not built yet"},
    {COMBINE_REFUSED, "downlink", "--downlink E", has_downlink, "--hub none or --hub file://...", hub_local,
     "the updates and views are published over HTTP and file:// only: s3:// and hf:// are not built yet"},
    {COMBINE_REFUSED, "downlink", "--downlink E", has_downlink, "--publish-interval 0", publishes_each,
     "a tree that skips steps would lose the updates between them: each published step's update is "
     "against the step before"},
    {COMBINE_IGNORED, "updates_keep", NULL, NULL, "--downlink mxfp8 or mxfp4", has_downlink, NULL},
    {COMBINE_IGNORED, "max_staleness", NULL, NULL, "--mode async", is_async, NULL},
    {COMBINE_IGNORED, "staleness_weight", NULL, NULL, "--mode async", is_async, NULL},
    {COMBINE_IGNORED, "dn_period", NULL, NULL, "--mode async", is_async, NULL},
    {COMBINE_IGNORED, "dn_variant", NULL, NULL, "--mode async", is_async, NULL},
    {COMBINE_IGNORED, "dn_momentum_activation", NULL, NULL, "--mode async", is_async, NULL},
    {COMBINE_IGNORED, "grace_ms", NULL, NULL, "--mode async", is_async, NULL},
    {COMBINE_IGNORED, "async_queue", NULL, NULL, "--mode async", is_async, NULL},
    {COMBINE_IGNORED, "dylu_base_steps", NULL, NULL, "--mode async", is_async, NULL},
    {COMBINE_IGNORED, "cluster_lease", NULL, NULL, "--cluster-shards S", is_cluster, NULL},
    {COMBINE_IGNORED, "max_weight_ratio", NULL, NULL, "--aggregate weighted_mean", is_weighted, NULL},
};

#define NROWS (sizeof(rows) / sizeof(rows[0]))

int config__check_combinations(const config *c)
{
    for (size_t i = 0; i < NROWS; i++) {
        const combine_row *r = &rows[i];
        if (r->kind == COMBINE_REFUSED && r->asked(c) && !r->holds(c)) {
            const char *no = strncmp(r->needs, "no ", 3) == 0 ? r->needs + 3 : NULL;
            if (no != NULL)
                return config__bad_opt(c, r->key, "%s does not combine with %s: %s", r->asks, no, r->why);
            return config__bad_opt(c, r->key, "%s needs %s: %s", r->asks, r->needs, r->why);
        }
    }
    return 0;
}

/* Whether option o holds its default in c (d: a configuration of defaults only). */
static int holds_default(const config *c, const config *d, const opt *o)
{
    const char *a = (const char *)c + o->offset, *b = (const char *)d + o->offset;
    switch (o->type) {
    case T_UINT: case T_BOUND: return memcmp(a, b, sizeof(unsigned)) == 0;
    case T_DOUBLE: return *(const double *)(const void *)a == *(const double *)(const void *)b;
    case T_WEIGHT: return memcmp(a, b, sizeof(config_weight)) == 0;
    case T_VARIANT: return memcmp(a, b, sizeof(int)) == 0;
    default: return 1;          /* a type no row has: never warned about */
    }
}

/* Says that option s, set in c, is ignored: read only with needs. */
void config__warn_ignored(const config *c, const slot *s, const char *needs)
{
    char flag[64];
    snprintf(flag, sizeof(flag), "%s", s->key);
    for (char *q = flag; *q; q++)
        if (*q == '_')
            *q = '-';
    if (c->origin[s->index] != NULL)
        fprintf(stderr, "dilocod: warning: %s: %s is read only with %s: ignored here\n", c->origin[s->index], s->key,
                needs);
    else
        fprintf(stderr, "dilocod: warning: --%s is read only with %s: ignored here\n", flag, needs);
}

void config__warn_ignored_rows(const config *c, const config *defaults)
{
    for (size_t i = 0; i < NROWS; i++) {
        const combine_row *r = &rows[i];
        slot s;
        if (r->kind != COMBINE_IGNORED || r->holds(c) || config__find_key(r->key, strlen(r->key), &s) != 0 ||
            s.own == NULL || holds_default(c, defaults, s.own))
            continue;
        config__warn_ignored(c, &s, r->needs);
    }
}

/* An option key as its flag: dn_period -> --dn-period. */
static void flag_of(const char *key, char *out, size_t size)
{
    snprintf(out, size, "--%s", key);
    for (char *q = out + 2; *q; q++)
        if (*q == '_')
            *q = '-';
}

void config_print_combinations(FILE *out)
{
    char flag[80];

    fprintf(out, "| asks for | needs | else |\n|---|---|---|\n");
    for (size_t i = 0; i < NROWS; i++) {
        const combine_row *r = &rows[i];
        if (r->kind == COMBINE_REFUSED) {
            fprintf(out, "| `%s` | %s%s%s | refused: %s |\n", r->asks, strncmp(r->needs, "no ", 3) == 0 ? "no `" : "`",
                    strncmp(r->needs, "no ", 3) == 0 ? r->needs + 3 : r->needs, "`", r->why);
        } else {
            flag_of(r->key, flag, sizeof(flag));
            fprintf(out, "| `%s` (not its default) | `%s` | ignored, with a warning |\n", flag, r->needs);
        }
    }
}
