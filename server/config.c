/* config: dilocod's options (config.h): the table of its own and the transports' (hub_options), their sources (a
 * config file, then flags), setting each value, the defaults, config_load; config_check.c validates them
 * together, config_print.c prints the effective configuration. */
#include "config.h"
#include "config_internal.h"
#include "compress.h"
#include "hub.h"
#include "st_index.h"

#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>

#include "util.h"

#define OFF(f) offsetof(config, f)
static const opt options[] = {
    {"state_root", T_STR, OFF(state_root), 0, 0, "DIR       local state (one subdirectory per aggregator id)"},
    {"id", T_STR, OFF(id), 0, 0, "NAME              aggregator id: state lives in <state_root>/<id>/"},
    {"hub", T_STR, OFF(hub), 0, 0, "URL             "},     /* + each transport's URL form (usage) */
    {"init_model", T_OPTSTR, OFF(init_model), 0, 0, "FILE      initial model, published as step 0 when there is no state and no global"},
    {"expected_nodes", T_UINT, OFF(expected_nodes), 0, CONFIG_MAX_NODES, "N     a round closes when N distinct nodes delivered"},
    {"nodes", T_NODES, OFF(nodes), 0, 0, "ID,ID,...      allow-list of node ids (sets expected_nodes)"},
    {"min_nodes", T_UINT, OFF(min_nodes), 1, CONFIG_MAX_NODES, "N          after round_timeout, close with at least N nodes"},
    {"round_timeout", T_DOUBLE, OFF(round_timeout), 0, 31536000, "SECONDS  since the first accepted delta of a round; 0 = wait for all"},
    {"optimizer", T_OPTIMIZER, OFF(optimizer), 0, 0, "NAME       nesterov_sgd | sgd"},
    {"lr", T_DOUBLE, OFF(lr), 0, 1e6, "X                 outer learning rate"},
    {"momentum", T_DOUBLE, OFF(momentum), 0, 1, "X           outer momentum (0 <= X < 1)"},
    {"threads", T_UINT, OFF(threads), 1, 1024, "N             aggregation threads (libuv thread pool size)"},
    {"poll_interval", T_DOUBLE, OFF(poll_interval), 0.01, 86400, "SECONDS  how often the hub is polled for new deltas"},
    {"log_level", T_LOGLEVEL, OFF(log_level), 0, 0, "LEVEL     error | warn | info | debug"},
    {"log_format", T_LOGFORMAT, OFF(log_json), 0, 0, "FMT      text | json"},
    {"agg_memory_mib", T_UINT, OFF(agg_memory_mib), 1, 65536, "MIB   aggregation buffer budget per thread"},
    {"retry_interval", T_DOUBLE, OFF(retry_interval), 0.01, 86400, "SECONDS  wait before retrying a failed commit or publish"},
    {"mode", T_MODE, OFF(async), 0, 0, "sync|async       sync: rounds of expected_nodes; async: every delta is an update (Delayed Nesterov)"},
    {"max_staleness", T_BOUND, OFF(max_staleness), 0, 1000000000, "S|none  async: refuse a delta more than S updates behind (409 stale)"},
    {"staleness_weight", T_WEIGHT, OFF(staleness_weight), 0, 0, "constant|poly  async: a delta's weight, 1 or (1+tau)^-1/2"},
    {"dn_period", T_UINT, OFF(dn_period), 0, 1000000, "N           async: a Nesterov step every N updates, plain steps between (0: expected_nodes, or 1)"},
    {"dn_variant", T_VARIANT, OFF(dn_paper), 0, 0, "NAME       async: forgather (a plain step of -lr*w*g between Nesterov steps on a/N) | paper (Liu et al. Algorithm 3)"},
    {"dn_momentum_activation", T_DOUBLE, OFF(dn_c), 0, 1, "C  async, dn_variant paper: the share c of the momentum applied at each plain step, 0 <= C <= 1/N"},
    {"grace_ms", T_DOUBLE, OFF(grace_ms), 0, 3600000, "MS           async: deltas within MS of the first pending one are averaged into one update"},
    {"async_queue", T_UINT, OFF(async_queue), 0, 1000000, "N         async: deltas waiting at most (the open update and the queue), 503 beyond (0: 4 x expected_nodes, at least 16)"},
    {"dylu_base_steps", T_UINT, OFF(dylu_base_steps), 0, 1000000000, "H     async: the fastest node's recommended local steps (0: the most any node ran per delta)"},
    {"publish_interval", T_DOUBLE, OFF(publish_interval), -1, 86400, "SECONDS  publish at most this often, the newest step (-1: 30 for hf:// in async mode, else 0)"},
    {"aggregate", T_RULE, OFF(aggregate), 0, 1000, "RULE     mean | weighted_mean | trimmed_mean:K | median | clipped_mean (README, Robust aggregation)"},
    {"max_norm_ratio", T_DOUBLE, OFF(max_norm_ratio), 0, 1e30, "R    quarantine a delta whose norm is above R x the median norm of its round, its own included (0: off; R >= 1)"},
    {"max_norm", T_DOUBLE, OFF(max_norm), 0, 1e300, "X          quarantine a delta whose L2 norm is above X (0: off)"},
    {"max_weight_ratio", T_DOUBLE, OFF(max_weight_ratio), 1, 1e30, "R  weighted_mean: cap each delta's weight at R x the round's median weight (R >= 1)"},
    {"screen", T_SCREEN, OFF(screen_cosine), 0, 0, "none|cosine:MIN  two passes: drop the deltas whose cosine with the round's mean is below MIN"},
    {"listen", T_STR, OFF(listen), 0, 0, "HOST:PORT     HTTP API address (port 0: any free port); none disables it"},
    {"token_file", T_OPTSTR, OFF(token_file), 0, 0, "FILE      upload tokens, lines 'node_id token' ('*' = any node); without it uploads are loopback-only"},
    {"signing_key", T_OPTSTR, OFF(signing_key), 0, 0, "FILE    sign every committed step's record (global/rounds/<s>.json) with this Ed25519 key (diloco keygen; mode 0600; not hf:// yet)"},
    {"verify_keep", T_DOUBLE, OFF(verify_keep), -1, 100000, "N    keep the last N steps' global, momentum and input deltas for verifiers, served under /rounds/<s>/ (-1: 16 with signing_key, else 0)"},
    {"max_header_bytes", T_UINT, OFF(max_header_bytes), 256, 1 << 24, "N   HTTP request head size limit (431 beyond)"},
    {"max_headers", T_UINT, OFF(max_headers), 4, 10000, "N        HTTP header count limit (431 beyond)"},
    {"max_body_mib", T_UINT, OFF(max_body_mib), 0, 1 << 22, "MIB     upload size limit (413 beyond); 0 = the expected delta size + the header cap"},
    {"max_delta_header_mib", T_UINT, OFF(max_delta_header_mib), 1, 95, "MIB  cap on a delta's safetensors header (uploads, file:// and hf://)"},
    {"max_uploads", T_UINT, OFF(max_uploads), 1, 65536, "N        delta uploads in progress at most (503 + Retry-After beyond)"},
    {"header_timeout", T_DOUBLE, OFF(header_timeout), 0.01, 3600, "SECONDS  to receive a request head (slowloris)"},
    {"idle_timeout", T_DOUBLE, OFF(idle_timeout), 0.01, 86400, "SECONDS  without progress on a connection (idle, stalled body or download)"},
    {"max_connections", T_UINT, OFF(max_connections), 1, 1000000, "N    open HTTP connections at most"},
    {"max_downloads", T_UINT, OFF(max_downloads), 1, 64, "N      parallel delta downloads from the Hub"},
    {"prune_consumed", T_UINT, OFF(prune_consumed), 0, 1, "0|1   remove a file:// delta once the step it went into is durable, or once it is stale or superseded"},
    {"warm_outputs", T_UINT, OFF(warm_outputs), 0, 1, "0|1     while a round collects, make the page cache the next pass writes into (2 x model size, reclaimable)"},
    {"history_keep", T_UINT, OFF(history_keep), 16, 100000000, "N   rounds.jsonl keeps the last N round records (compacted at startup)"},
    {"shard_size", T_SIZE, OFF(shard_size), 0, 0, "SIZE      publish the global sharded (index + shards) above SIZE: bytes or 5GB, 500MB ... (0 = never)"},
    {"downlink", T_DOWNLINK, OFF(downlink), 0, 0, "none|mxfp8|mxfp4  workers download each step as a compressed update against the view they hold (README, The downlink)"},
    {"updates_keep", T_UINT, OFF(updates_keep), 2, 100000, "N      downlink: the newest N updates stay available (the view is checkpointed every N/2 steps in a tree)"},
    {"cluster_shards", T_UINT, OFF(cluster_shards), 0, 4096, "S     s3:// only: share each round with the other aggregators of the bucket, in S shards (0: alone; README, Scaling out)"},
    {"cluster_lease", T_DOUBLE, OFF(cluster_lease), 1, 3600, "SECONDS  cluster: a shard claim's lease (renewed by its holder; taken over once it is over)"},
    /* then the transports' own options, from their tables (hub.h's hub_options) */
};

/* ---- options by place ---------------------------------------------------------------------------
 * Place i is options[i] for i below COUNT_OF(options), then each transport's table in the scheme
 * table's order.  A key several transports declare is one option, named by its first place (which
 * holds its origin), and set in every transport that declares it. */

static size_t transport_nopts(size_t t)
{
    const hub_options *ho = hub_transport(t)->options;
    return ho != NULL ? ho->n : 0;
}

static size_t nslots(void)
{
    size_t n = COUNT_OF(options);
    for (size_t t = 0; t < hub_transport_count(); t++)
        n += transport_nopts(t);
    return n;
}

size_t config__nown(void)
{
    return COUNT_OF(options);
}

/* 0, or -1 past the last place. */
int config__slot_at(size_t i, slot *s)
{
    *s = (slot){.index = i};
    if (i < COUNT_OF(options)) {
        s->own = &options[i];
        s->key = s->own->key;
        return 0;
    }
    i -= COUNT_OF(options);
    for (size_t t = 0; t < hub_transport_count(); t++) {
        if (i < transport_nopts(t)) {
            s->transport = t;
            s->hopt = &hub_transport(t)->options->opt[i];
            s->key = s->hopt->key;
            return 0;
        }
        i -= transport_nopts(t);
    }
    return -1;
}

/* Transport t's option key, or NULL when it has none of that name. */
const hub_option *config__transport_option(size_t t, const char *key)
{
    const hub_options *ho = hub_transport(t)->options;
    for (size_t i = 0; ho != NULL && i < ho->n; i++)
        if (strcmp(ho->opt[i].key, key) == 0)
            return &ho->opt[i];
    return NULL;
}

/* The row of url's transport in the scheme table; hub_transport_count() for none. */
size_t config__transport_of(const char *url)
{
    const hub_ops *ops = hub_find(url);
    size_t t = 0;
    while (t < hub_transport_count() && hub_transport(t) != ops)
        t++;
    return t;
}

static opt_type plain_type(hub_opt_type t)
{
    return t == HUB_OPT_STR ? T_STR : t == HUB_OPT_OPTSTR ? T_OPTSTR : T_UINT;
}

const char *config_weight_name(config_weight w)
{
    return w == WEIGHT_POLY ? "poly" : "constant";
}

const char *config_optimizer_name(config_optimizer o)
{
    return o == OPT_SGD ? "sgd" : "nesterov_sgd";
}

int config__bad(const char *origin, const char *key, const char *fmt, ...)
{
    va_list ap;
    char name[64];
    /* name a flag as it is typed (--min-nodes), a file key as it is written (min_nodes) */
    snprintf(name, sizeof(name), "%s", key);
    if (strcmp(origin, "--") == 0)
        for (char *p = name; *p; p++)
            if (*p == '_')
                *p = '-';
    fprintf(stderr, "dilocod: %s%s: ", origin, name);
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fprintf(stderr, "\n");
    return 2;
}

int config__find_key(const char *key, size_t len, slot *s)
{
    for (size_t i = 0; config__slot_at(i, s) == 0; i++)
        if (strlen(s->key) == len && memcmp(s->key, key, len) == 0)
            return 0;
    return -1;
}

/* A check after all sources were read: names the line that set the option, or its flag. */
int config__bad_opt(const config *c, const char *key, const char *fmt, ...)
{
    slot s;
    const char *where = c->origin != NULL && config__find_key(key, strlen(key), &s) == 0 ? c->origin[s.index] : NULL;
    char name[64];
    va_list ap;

    snprintf(name, sizeof(name), "%s", key);
    if (where != NULL) {
        fprintf(stderr, "dilocod: %s: %s: ", where, name);
    } else {
        for (char *p = name; *p; p++)
            if (*p == '_')
                *p = '-';
        fprintf(stderr, "dilocod: --%s: ", name);
    }
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fprintf(stderr, "\n");
    return 2;
}

/* where: "FILE:LINE" for a file line, NULL for a flag (which overrides whatever the file said). */
static int set_origin(config *c, const slot *s, const char *where)
{
    char *copy = NULL;

    if (where != NULL && (copy = strdup(where)) == NULL)
        return config__bad("", s->key, "out of memory");
    free(c->origin[s->index]);
    c->origin[s->index] = copy;
    return 0;
}

static void free_nodes(config *c)
{
    for (size_t i = 0; i < c->nnodes; i++)
        free(c->nodes[i]);
    free(c->nodes);
    c->nodes = NULL;
    c->nnodes = 0;
}

static const char *const rule_names[] = {"mean", "weighted_mean", "clipped_mean", "trimmed_mean", "median"};

const char *config_rule_name(config_rule r)
{
    return (size_t)r < COUNT_OF(rule_names) ? rule_names[r] : "?";
}

/* --aggregate RULE: one of rule_names, trimmed_mean with its ":K" (1 <= K <= CONFIG_MAX_NODES). */
static int set_rule(config *c, const char *v, const char *origin, const char *key)
{
    for (size_t i = 0; i < COUNT_OF(rule_names); i++) {
        size_t n = strlen(rule_names[i]);
        if (strncmp(v, rule_names[i], n) != 0)
            continue;
        if (i == RULE_TRIMMED) {
            char *end;
            unsigned long k;
            if (v[n] != ':' || v[n + 1] < '1' || v[n + 1] > '9')
                return config__bad(origin, key, "'%s': trimmed_mean takes the count to trim from each end, trimmed_mean:K", v);
            errno = 0;
            k = strtoul(v + n + 1, &end, 10);
            if (*end != '\0' || errno != 0 || k > CONFIG_MAX_NODES)
                return config__bad(origin, key, "'%s': K must be an integer from 1 to %u", v, CONFIG_MAX_NODES);
            c->trim_k = (unsigned)k;
        } else if (v[n] != '\0') {
            continue;
        } else {
            c->trim_k = 0;
        }
        c->aggregate = (config_rule)i;
        return 0;
    }
    return config__bad(origin, key, "'%s' is not an aggregation rule (mean, weighted_mean, trimmed_mean:K, median, clipped_mean)",
               v);
}

/* --screen none | cosine:MIN, -1 <= MIN <= 1. */
static int set_screen(config *c, const char *v, const char *origin, const char *key)
{
    char *end;
    double m;

    if (strcmp(v, "none") == 0) {
        c->screen = 0;
        return 0;
    }
    if (strncmp(v, "cosine:", 7) != 0 || v[7] == '\0')
        return config__bad(origin, key, "'%s' is not a screen (none, cosine:MIN)", v);
    errno = 0;
    m = strtod(v + 7, &end);
    if (*end != '\0' || errno != 0 || !(m >= -1 && m <= 1))
        return config__bad(origin, key, "'%s': MIN must be a number from -1 to 1", v);
    c->screen = 1;
    c->screen_cosine = m;
    return 0;
}

static int set_nodes(config *c, const char *v, const char *origin, const char *key)
{
    const char *p = v;

    free_nodes(c);
    if (*v == '\0')
        return 0;
    for (;;) {
        const char *comma = strchr(p, ',');
        size_t len = comma ? (size_t)(comma - p) : strlen(p);
        while (len > 0 && *p == ' ') { p++; len--; }
        while (len > 0 && p[len - 1] == ' ') len--;
        if (!delta_valid_node_id(p, len))
            return config__bad(origin, key, "invalid node id '%.*s' (allowed: [A-Za-z0-9._-]{1,64}, not . or ..)", (int)len, p);
        for (size_t i = 0; i < c->nnodes; i++) {
            if (strlen(c->nodes[i]) == len && memcmp(c->nodes[i], p, len) == 0)
                return config__bad(origin, key, "node id '%.*s' listed twice", (int)len, p);
        }
        if (c->nnodes >= CONFIG_MAX_NODES)
            return config__bad(origin, key, "more than %d nodes", CONFIG_MAX_NODES);
        char **nv = realloc(c->nodes, (c->nnodes + 1) * sizeof(*nv));
        if (nv == NULL || (nv[c->nnodes] = strndup(p, len)) == NULL) {
            if (nv != NULL)
                c->nodes = nv;
            return config__bad(origin, key, "out of memory");
        }
        c->nodes = nv;
        c->nnodes++;
        if (comma == NULL)
            break;
        p = comma + 1;
    }
    return 0;
}

/* The types a transport's option may have too (T_STR, T_OPTSTR, T_UINT, T_DOUBLE), into field. */
static int set_plain(void *field, opt_type type, double min, double max, const char *key, const char *v,
                     const char *origin)
{
    char *end;

    switch (type) {
    case T_OPTSTR:
        if (*v == '\0') {
            free(*(char **)field);
            *(char **)field = NULL;
            return 0;
        }
        /* fall through */
    case T_STR: {
        char **s = field;
        char *copy = strdup(v);
        if (copy == NULL)
            return config__bad(origin, key, "out of memory");
        free(*s);
        *s = copy;
        return 0;
    }
    case T_UINT: {
        unsigned long long x;
        errno = 0;
        if (*v < '0' || *v > '9' || (x = strtoull(v, &end, 10), errno != 0) || *end != '\0' ||
            (double)x < min || (double)x > max)
            return config__bad(origin, key, "'%s' is not an integer in [%g, %g]", v, min, max);
        *(unsigned *)field = (unsigned)x;
        return 0;
    }
    case T_DOUBLE: {
        double x;
        errno = 0;
        x = strtod(v, &end);
        if (end == v || *end != '\0' || errno != 0 || !isfinite(x) || x < min || x > max)
            return config__bad(origin, key, "'%s' is not a number in [%g, %g]", v, min, max);
        *(double *)field = x;
        return 0;
    }
    default:
        return 2;
    }
}

static int set_option(config *c, const opt *o, const char *v, const char *origin)
{
    void *field = (char *)c + o->offset;

    switch (o->type) {
    case T_OPTSTR:
    case T_STR:
    case T_UINT:
    case T_DOUBLE:
        return set_plain(field, o->type, o->min, o->max, o->key, v, origin);
    case T_OPTIMIZER:
        if (strcmp(v, "nesterov_sgd") == 0)
            *(config_optimizer *)field = OPT_NESTEROV_SGD;
        else if (strcmp(v, "sgd") == 0)
            *(config_optimizer *)field = OPT_SGD;
        else
            return config__bad(origin, o->key, "'%s' is not an optimizer (nesterov_sgd, sgd)", v);
        return 0;
    case T_NODES:
        return set_nodes(c, v, origin, o->key);
    case T_LOGLEVEL:
        if (dl_log_parse_level(v, (dl_log_level *)field) != 0)
            return config__bad(origin, o->key, "'%s' is not a log level (error, warn, info, debug)", v);
        return 0;
    case T_SIZE:
        /* huggingface_hub's max_shard_size spelling: "5GB" is 5 * 10^9 */
        if (st_parse_size(v, (uint64_t *)field) != 0)
            return config__bad(origin, o->key, "'%s' is not a size (bytes, or a number with KB, MB, GB or TB)", v);
        return 0;
    case T_MODE:
        if (strcmp(v, "sync") == 0 || strcmp(v, "async") == 0)
            *(int *)field = v[0] == 'a';
        else
            return config__bad(origin, o->key, "'%s' is not a mode (sync, async)", v);
        return 0;
    case T_WEIGHT:
        if (strcmp(v, "constant") == 0)
            *(config_weight *)field = WEIGHT_CONSTANT;
        else if (strcmp(v, "poly") == 0)
            *(config_weight *)field = WEIGHT_POLY;
        else
            return config__bad(origin, o->key, "'%s' is not a staleness weight (constant, poly)", v);
        return 0;
    case T_VARIANT:
        if (strcmp(v, "forgather") == 0 || strcmp(v, "paper") == 0)
            *(int *)field = v[0] == 'p';
        else
            return config__bad(origin, o->key, "'%s' is not a Delayed Nesterov variant (forgather, paper)", v);
        return 0;
    case T_DOWNLINK:
        /* int8_block is not offered: its q x s is a rounded product, and a fused multiply-add would add it
         * to the view with other bits (compress.h, downlink.h) */
        if (strcmp(v, "none") == 0)
            *(int *)field = CZ_NONE;
        else if (strcmp(v, "mxfp8") == 0)
            *(int *)field = CZ_MXFP8;
        else if (strcmp(v, "mxfp4") == 0)
            *(int *)field = CZ_MXFP4;
        else
            return config__bad(origin, o->key, "'%s' is not a downlink encoding (none, mxfp8, mxfp4; int8_block is "
                               "uplink only: its decode is a rounded product, not reproducible bit for bit)", v);
        return 0;
    case T_BOUND:
        if (strcmp(v, "none") == 0) {
            *(unsigned *)field = CONFIG_NO_STALENESS_BOUND;
            return 0;
        }
        return set_plain(field, T_UINT, o->min, o->max, o->key, v, origin);
    case T_RULE:
        return set_rule(c, v, origin, o->key);
    case T_SCREEN:
        return set_screen(c, v, origin, o->key);
    case T_LOGFORMAT:
        if (strcmp(v, "text") == 0)
            *(int *)field = 0;
        else if (strcmp(v, "json") == 0)
            *(int *)field = 1;
        else
            return config__bad(origin, o->key, "'%s' is not a log format (text, json)", v);
        return 0;
    }
    return 2;
}

/* A value for the option at s: config's own, or every transport's that declares its key. */
static int set_value(config *c, const slot *s, const char *v, const char *origin)
{
    /* values end up in paths, log lines and the printed configuration: no control characters */
    for (const char *p = v; *p; p++)
        if ((unsigned char)*p < 0x20 || *p == 0x7f)
            return config__bad(origin, s->key, "the value contains a control character (byte 0x%02x)", (unsigned char)*p);
    if (s->own != NULL)
        return set_option(c, s->own, v, origin);
    for (size_t t = 0; t < hub_transport_count(); t++) {
        const hub_option *h = config__transport_option(t, s->key);
        int rc;
        if (h != NULL && c->hub_opts[t] != NULL &&
            (rc = set_plain((char *)c->hub_opts[t] + h->offset, plain_type(h->type), h->min, h->max, h->key, v,
                            origin)) != 0)
            return rc;
    }
    return 0;
}

/* "--round-timeout" -> the round_timeout option. */
static int find_flag(const char *flag, slot *s)
{
    char key[64];
    size_t n = strlen(flag);

    if (n >= sizeof(key))
        return -1;
    for (size_t i = 0; i <= n; i++)
        key[i] = flag[i] == '-' ? '_' : flag[i];
    return config__find_key(key, n, s);
}

/* A 0|1 option (its flag may stand alone for 1): no value of it starts with "--". */
static int is_switch(const slot *s)
{
    if (s->own != NULL)
        return s->own->type == T_UINT && s->own->min == 0 && s->own->max == 1;
    return s->hopt != NULL && s->hopt->type == HUB_OPT_UINT && s->hopt->min == 0 && s->hopt->max == 1;
}

static char *trim(char *s)
{
    char *e;
    while (*s == ' ' || *s == '\t')
        s++;
    e = s + strlen(s);
    while (e > s && (e[-1] == ' ' || e[-1] == '\t' || e[-1] == '\r' || e[-1] == '\n'))
        *--e = '\0';
    return s;
}

/* The value after '=', in place: "double quoted" (escapes \\ and \"), 'single quoted' (verbatim) or
 * bare.  A '#' at the start of a bare value or after a blank starts a comment, so a bare value may hold
 * '#' (a URL's #fragment is not cut) and a quoted one anything.  NULL with *why on a malformed value. */
static char *parse_value(char *s, const char **why)
{
    char *w, *r;

    while (*s == ' ' || *s == '\t')
        s++;
    if (*s != '"' && *s != '\'') {
        for (r = s; *r; r++) {
            if (*r == '#' && (r == s || r[-1] == ' ' || r[-1] == '\t')) {
                *r = '\0';
                break;
            }
        }
        return trim(s);
    }
    char quote = *s;
    for (w = r = s + 1; *r != quote; r++) {
        if (*r == '\0') {
            *why = "the quoted value has no closing quote";
            return NULL;
        }
        if (quote == '"' && *r == '\\') {
            r++;
            if (*r != '\\' && *r != '"') {
                *why = "unknown escape in a double-quoted value (the escapes are \\\\ and \\\")";
                return NULL;
            }
        }
        *w++ = *r;
    }
    *w = '\0';                  /* w < r: the closing quote at r is never overwritten */
    for (r++; *r == ' ' || *r == '\t'; r++)
        ;
    if (*r != '\0' && *r != '#') {
        *why = "text after the closing quote (a comment starts with #)";
        return NULL;
    }
    return s + 1;
}

static int load_file(config *c, const char *path)
{
    FILE *f = fopen(path, "r");
    char line[8192], origin[616], where[600];
    int lineno = 0, rc = 0;

    if (f == NULL) {
        fprintf(stderr, "dilocod: --config: cannot open %s: %s\n", path, strerror(errno));
        return 2;
    }
    while (rc == 0 && fgets(line, sizeof(line), f) != NULL) {
        char *s, *eq, *key, *val;
        slot o;
        lineno++;
        if (strchr(line, '\n') == NULL && !feof(f)) {
            fprintf(stderr, "dilocod: %s:%d: line too long\n", path, lineno);
            rc = 2;
            break;
        }
        s = trim(line);
        if (*s == '#' || *s == '\0')
            continue;
        eq = strchr(s, '=');
        if (eq == NULL) {
            fprintf(stderr, "dilocod: %s:%d: expected 'key = value'\n", path, lineno);
            rc = 2;
            break;
        }
        *eq = '\0';
        key = trim(s);
        snprintf(where, sizeof(where), "%s:%d", path, lineno);
        snprintf(origin, sizeof(origin), "%s: ", where);
        if (config__find_key(key, strlen(key), &o) != 0) {
            fprintf(stderr, "dilocod: %sunknown option '%s'\n", origin, key);
            rc = 2;
            break;
        }
        const char *why = NULL;
        if ((val = parse_value(eq + 1, &why)) == NULL) {
            rc = config__bad(origin, o.key, "%s", why);
            break;
        }
        if ((rc = set_value(c, &o, val, origin)) == 0)
            rc = set_origin(c, &o, where);
    }
    fclose(f);
    return rc;
}

static void usage(FILE *out)
{
    fprintf(out, "usage: dilocod [options]\n\n"
                 "The DiLoCo outer-loop aggregator: collects node deltas, averages them, applies the outer\n"
                 "optimizer and publishes the new global model.\n\noptions (each also a key in the config file):\n");
    slot o, first;
    for (size_t i = 0; config__slot_at(i, &o) == 0; i++) {
        char flag[64];
        size_t n = strlen(o.key);
        if (config__find_key(o.key, n, &first) != 0 || first.index != i)
            continue;           /* a transport's key another declared first: listed there */
        for (size_t k = 0; k <= n; k++)
            flag[k] = o.key[k] == '_' ? '-' : o.key[k];
        if (o.own != NULL && strcmp(o.key, "hub") == 0) {
            fprintf(out, "  --%s %s", flag, o.own->help);
            for (size_t t = 0; t < hub_transport_count(); t++)
                fprintf(out, " %s |", hub_transport(t)->url_form);
            fprintf(out, " none\n");
            continue;
        }
        if (o.own != NULL) {
            fprintf(out, "  --%s %s\n", flag, o.own->help);
            continue;
        }
        fprintf(out, "  --%s %s", flag, o.hopt->help);
        for (size_t t = o.transport + 1; t < hub_transport_count(); t++) {
            const hub_option *h = config__transport_option(t, o.key);
            if (h != NULL)
                fprintf(out, " or %s", h->help);
        }
        fputc('\n', out);
    }
    fprintf(out, "  --config FILE          read options from FILE first (key = value, # comments, \"quoted\" values)\n"
                 "  --check-config         validate, print the effective configuration and exit\n"
                 "  --combinations         print the table of what combines (README, What combines) and exit\n"
                 "  --help, --version\n");
}

/* One struct per transport with options, holding its table's defaults.  0 or 2 (said why). */
static int set_transport_defaults(config *c)
{
    if ((c->hub_opts = calloc(hub_transport_count(), sizeof(*c->hub_opts))) == NULL)
        return config__bad("", "config", "out of memory");
    for (size_t t = 0; t < hub_transport_count(); t++) {
        const hub_options *ho = hub_transport(t)->options;
        int rc;
        if (ho == NULL || ho->size == 0)
            continue;
        if ((c->hub_opts[t] = calloc(1, ho->size)) == NULL)
            return config__bad("", "config", "out of memory");
        for (size_t i = 0; i < ho->n; i++) {
            const hub_option *h = &ho->opt[i];
            if (h->deflt != NULL && (rc = set_plain((char *)c->hub_opts[t] + h->offset, plain_type(h->type), h->min,
                                                    h->max, h->key, h->deflt, "")) != 0)
                return rc;
        }
    }
    return 0;
}

static int set_defaults(config *c)
{
    memset(c, 0, sizeof(*c));
    if ((c->origin = calloc(nslots(), sizeof(*c->origin))) == NULL ||
        (c->state_root = strdup("/var/lib/dilocod")) == NULL || (c->id = strdup("aggregator")) == NULL ||
        (c->hub = strdup("none")) == NULL || (c->listen = strdup("127.0.0.1:8470")) == NULL)
        return -ENOMEM;
    c->min_nodes = 1;
    c->optimizer = OPT_NESTEROV_SGD;
    c->lr = 0.7;
    c->momentum = -1;           /* unset: 0.9 for nesterov_sgd, 0 for sgd */
    c->threads = (unsigned)sysconf(_SC_NPROCESSORS_ONLN);
    if (c->threads < 1 || c->threads > 1024)
        c->threads = 4;
    c->poll_interval = 5.0;
    c->log_level = DL_LOG_INFO;
    c->agg_memory_mib = 16;
    c->warm_outputs = 1;
    c->retry_interval = 5.0;
    c->max_staleness = CONFIG_NO_STALENESS_BOUND;
    c->publish_interval = -1;
    c->verify_keep = -1;
    c->cluster_lease = 30;
    c->max_header_bytes = 16384;
    c->max_headers = 100;
    c->max_delta_header_mib = 16;
    c->header_timeout = 10;
    c->idle_timeout = 60;
    c->max_connections = 1024;
    c->max_uploads = 64;
    c->max_downloads = 2;
    c->history_keep = 100000;
    c->updates_keep = 16;
    c->shard_size = ST_SHARD_SIZE_DEFAULT;
    c->max_weight_ratio = 10;
    return set_transport_defaults(c);
}

/* ---- options the chosen mode ignores ------------------------------------------------------------
 * An option that only one mode reads is accepted in the others (the shipped config file sets async
 * options beside mode = sync), but one set to a value other than its default is said, at the start and by
 * --check-config: a run that was meant to be asynchronous, or a cluster's lease without a cluster, is then
 * not silently another.  Which option each mode reads is a row of the table of what combines
 * (config_modes.c); a transport's options are read with its --hub only. */

/* Whether transport option h holds its table's default in opts (the transport's struct). */
static int holds_transport_default(const void *opts, const hub_option *h)
{
    const char *field = (const char *)opts + h->offset;
    if (h->type == HUB_OPT_UINT)
        return h->deflt != NULL && *(const unsigned *)(const void *)field == strtoul(h->deflt, NULL, 10);
    const char *v = *(char *const *)(const void *)field;
    return v == NULL ? h->deflt == NULL : h->deflt != NULL && strcmp(v, h->deflt) == 0;
}

/* A transport's option given (a flag or a file line) while --hub names another transport, none of whose
 * options it is: checked against its table, then unused. */
static void warn_other_transports_options(const config *c)
{
    size_t configured = config__transport_of(c->hub);
    slot s;

    for (size_t i = config__nown(); config__slot_at(i, &s) == 0; i++) {
        slot first;
        if (s.hopt == NULL || c->hub_opts == NULL || c->hub_opts[s.transport] == NULL ||
            holds_transport_default(c->hub_opts[s.transport], s.hopt) ||
            config__find_key(s.key, strlen(s.key), &first) != 0 || first.index != i)
            continue;           /* its default, or a later declarer of a shared key (named by its first place) */
        if (configured < hub_transport_count() && config__transport_option(configured, s.key) != NULL)
            continue;
        char needs[128] = "--hub";
        size_t n = strlen(needs);
        for (size_t t = 0; t < hub_transport_count(); t++)       /* every declarer of a shared key */
            if (config__transport_option(t, s.key) != NULL && n < sizeof(needs))
                n += (size_t)snprintf(needs + n, sizeof(needs) - n, "%s %s", n > 5 ? " or" : "",
                                      hub_transport(t)->scheme);
        config__warn_ignored(c, &s, needs);
    }
}

static void warn_ignored_options(const config *c)
{
    config d;
    if (set_defaults(&d) == 0)
        config__warn_ignored_rows(c, &d);
    config_free(&d);
    warn_other_transports_options(c);
}

int config_load(config *c, int argc, char **argv)
{
    int rc, check = 0;

    if ((rc = set_defaults(c)) != 0)
        return rc;
    /* the file first, so that flags override it wherever they stand */
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--config") == 0 || strncmp(argv[i], "--config=", 9) == 0) {
            const char *v = argv[i][8] == '=' ? argv[i] + 9 : (i + 1 < argc ? argv[i + 1] : NULL);
            if (v == NULL)
                return config__bad("--", "config", "needs a FILE");
            free(c->config_file);
            if ((c->config_file = strdup(v)) == NULL)
                return config__bad("--", "config", "out of memory");
            if ((rc = load_file(c, v)) != 0)
                return rc;
        }
    }
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *val;
        char name[64];
        slot o;
        if (strcmp(a, "--help") == 0 || strcmp(a, "-h") == 0) {
            usage(stdout);
            return 1;
        }
        if (strcmp(a, "--version") == 0) {
            printf("dilocod %s\n", DILOCOD_VERSION);
            return 1;
        }
        if (strcmp(a, "--combinations") == 0) {
            config_print_combinations(stdout);
            return 1;
        }
        if (strcmp(a, "--check-config") == 0) {
            check = 1;
            continue;
        }
        if (strncmp(a, "--", 2) != 0) {
            fprintf(stderr, "dilocod: unexpected argument '%s' (see --help)\n", a);
            return 2;
        }
        const char *eq = strchr(a, '=');
        size_t nlen = eq ? (size_t)(eq - a - 2) : strlen(a + 2);
        if (nlen >= sizeof(name)) {
            fprintf(stderr, "dilocod: unknown option '%s' (see --help)\n", a);
            return 2;
        }
        memcpy(name, a + 2, nlen);
        name[nlen] = '\0';
        int known = strcmp(name, "config") != 0 && find_flag(name, &o) == 0;
        if (eq != NULL) {
            val = eq + 1;
        } else if (known && is_switch(&o) && (i + 1 >= argc || strncmp(argv[i + 1], "--", 2) == 0)) {
            val = "1";          /* a 0|1 option alone: --create-hub is --create-hub 1 */
        } else if (i + 1 < argc) {
            val = argv[++i];
        } else {
            fprintf(stderr, "dilocod: --%s needs a value\n", name);
            return 2;
        }
        if (strcmp(name, "config") == 0)
            continue;
        if (!known) {
            fprintf(stderr, "dilocod: unknown option '--%s' (see --help)\n", name);
            return 2;
        }
        if ((rc = set_value(c, &o, val, "--")) != 0 || (rc = set_origin(c, &o, NULL)) != 0)
            return rc;
    }
    if ((rc = config__validate(c)) != 0)
        return rc;
    warn_ignored_options(c);
    if (check) {
        /* not an error: the same file is fine once a step is committed (or restored from a backup) */
        if (strcmp(c->hub, "none") == 0 && c->init_model == NULL && config__state_committed(c) == 0)
            fprintf(stderr, "dilocod: note: %s/%s holds no committed step and there is no init_model: with "
                            "hub = none a start now has nothing to start from (exit 1)\n", c->state_root, c->id);
        config_print(c, stdout);
        return 1;
    }
    return 0;
}

static void free_transport_options(config *c)
{
    for (size_t t = 0; c->hub_opts != NULL && t < hub_transport_count(); t++) {
        const hub_options *ho = hub_transport(t)->options;
        if (c->hub_opts[t] == NULL)
            continue;
        if (ho->clear != NULL)
            ho->clear(c->hub_opts[t]);
        for (size_t i = 0; i < ho->n; i++)
            if (ho->opt[i].type != HUB_OPT_UINT)
                free(*(char **)((char *)c->hub_opts[t] + ho->opt[i].offset));
        free(c->hub_opts[t]);
    }
    free(c->hub_opts);
    c->hub_opts = NULL;
}

void config_free(config *c)
{
    free(c->config_file);
    free(c->state_root);
    free(c->id);
    free(c->hub);
    free(c->init_model);
    free(c->listen);
    free(c->listen_host);
    free(c->token_file);
    free(c->signing_key);
    free_nodes(c);
    free_transport_options(c);
    if (c->origin != NULL)
        for (size_t i = 0; i < nslots(); i++)
            free(c->origin[i]);
    free(c->origin);
    c->origin = NULL;
}

const void *config_hub_options(const config *c)
{
    size_t t = config__transport_of(c->hub);
    return t < hub_transport_count() && c->hub_opts != NULL ? c->hub_opts[t] : NULL;
}

int config_hub_value(const config *c, const char *key, const char **value)
{
    size_t t = config__transport_of(c->hub);
    const hub_option *h = t < hub_transport_count() ? config__transport_option(t, key) : NULL;

    if (h == NULL || h->type == HUB_OPT_UINT || c->hub_opts == NULL || c->hub_opts[t] == NULL)
        return 0;
    *value = *(char *const *)((const char *)c->hub_opts[t] + h->offset);
    return 1;
}
