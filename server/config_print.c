/* config_print.c: --check-config's output, the effective configuration as a config file that reads back to
 * the same settings (unset options as comments). */
#include "config.h"
#include "config_internal.h"
#include "compress.h"
#include "hub.h"

#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* A value the file reader would read back as something else is printed double-quoted: empty, with
 * blanks at either end, opening with a quote, or holding a '#' that would start a comment. */
static int needs_quotes(const char *v)
{
    size_t n = strlen(v);

    if (n == 0 || v[0] == '"' || v[0] == '\'' || v[0] == ' ' || v[n - 1] == ' ')
        return 1;
    for (size_t i = 0; i < n; i++)
        if (v[i] == '#' && (i == 0 || v[i - 1] == ' '))
            return 1;
    return 0;
}

/* The shortest decimal that reads back as the same double (0.7, not 0.69999999999999996). */
static void print_double(FILE *out, const char *key, double x)
{
    char buf[40];

    for (int prec = 6; prec <= 17; prec++) {
        snprintf(buf, sizeof(buf), "%.*g", prec, x);
        if (strtod(buf, NULL) == x)
            break;
    }
    fprintf(out, "%s = %s\n", key, buf);
}

/* Unset options become comments, so the output is a config file that reads back to the same settings. */
static void print_str(FILE *out, const char *key, const char *v, const char *unset)
{
    if (v == NULL) {
        fprintf(out, "# %s: not set%s\n", key, unset);
        return;
    }
    if (!needs_quotes(v)) {
        fprintf(out, "%s = %s\n", key, v);
        return;
    }
    fprintf(out, "%s = \"", key);
    for (const char *p = v; *p; p++) {
        if (*p == '"' || *p == '\\')
            fputc('\\', out);
        fputc(*p, out);
    }
    fputs("\"\n", out);
}

/* Why a transport's option is unset: the transport's own word, its table's, else which schemes use it. */
static void unset_note(const config *c, size_t t, const hub_option *h, char *buf, size_t size)
{
    const hub_options *ho = hub_transport(t)->options;
    const char *note = ho->unset_note != NULL ? ho->unset_note(c->hub_opts[t], h->key) : NULL;
    size_t n;

    if (note == NULL)
        note = h->unset;
    if (note != NULL) {
        snprintf(buf, size, "%s", note);
        return;
    }
    snprintf(buf, size, " (");
    for (size_t u = 0, k = 0; u < hub_transport_count(); u++) {
        if (config__transport_option(u, h->key) == NULL)
            continue;
        n = strlen(buf);
        snprintf(buf + n, size - n, "%s%s", k++ ? " and " : "", hub_transport(u)->scheme);
    }
    n = strlen(buf);
    snprintf(buf + n, size - n, " only)");
}

/* Each key once, at its first place, with the value of --hub's transport when it declares the key
 * (its load() may have filled it), else of the first that does; then each transport's own lines. */
static void print_transport_options(const config *c, FILE *out)
{
    size_t configured = config__transport_of(c->hub);
    slot o, first;

    for (size_t i = config__nown(); config__slot_at(i, &o) == 0; i++) {
        size_t t = o.transport;
        const hub_option *h = o.hopt;
        char note[128];

        if (config__find_key(o.key, strlen(o.key), &first) == 0 && first.index == i) {
            if (configured < hub_transport_count() && config__transport_option(configured, o.key) != NULL) {
                t = configured;
                h = config__transport_option(t, o.key);
            }
            const char *field = (const char *)c->hub_opts[t] + h->offset;
            if (h->type == HUB_OPT_UINT) {
                fprintf(out, "%s = %u\n", h->key, *(const unsigned *)field);
            } else {
                unset_note(c, t, h, note, sizeof(note));
                print_str(out, h->key, *(char *const *)field, note);
            }
        }
        const hub_options *ho = hub_transport(o.transport)->options;
        if (o.hopt == &ho->opt[ho->n - 1] && ho->print != NULL)
            ho->print(c->hub_opts[o.transport], c->hub, out);
    }
}

void config_print(const config *c, FILE *out)
{
    fprintf(out, "# dilocod effective configuration (a config file: dilocod --config FILE reads it back)\n");
    if (c->config_file)
        fprintf(out, "# read from %s, then overridden by flags\n", c->config_file);
    print_str(out, "state_root", c->state_root, "");
    print_str(out, "id", c->id, "");
    print_str(out, "hub", c->hub, "");
    print_str(out, "init_model", c->init_model, " (no model to bootstrap from)");
    fprintf(out, "expected_nodes = %u\n", c->expected_nodes);
    if (c->nnodes == 0) {
        fprintf(out, "# nodes: not set (any node id may deliver)\n");
    } else {
        fprintf(out, "nodes = ");
        for (size_t i = 0; i < c->nnodes; i++)
            fprintf(out, "%s%s", i ? "," : "", c->nodes[i]);
        fprintf(out, "\n");
    }
    fprintf(out, "min_nodes = %u\n", c->min_nodes);
    print_double(out, "round_timeout", c->round_timeout);
    fprintf(out, "optimizer = %s\n", config_optimizer_name(c->optimizer));
    print_double(out, "lr", c->lr);
    print_double(out, "momentum", c->momentum);
    fprintf(out, "threads = %u\n", c->threads);
    print_double(out, "poll_interval", c->poll_interval);
    fprintf(out, "log_level = %s\nlog_format = %s\nagg_memory_mib = %u\n", dl_log_level_name(c->log_level),
            c->log_json ? "json" : "text", c->agg_memory_mib);
    print_double(out, "retry_interval", c->retry_interval);
    fprintf(out, "mode = %s\n", c->async ? "async" : "sync");
    if (c->max_staleness == CONFIG_NO_STALENESS_BOUND)
        fprintf(out, "max_staleness = none\n");
    else
        fprintf(out, "max_staleness = %u\n", c->max_staleness);
    fprintf(out, "staleness_weight = %s\ndn_period = %u\ndn_variant = %s\n", config_weight_name(c->staleness_weight),
            c->dn_period, c->dn_paper ? "paper" : "forgather");
    print_double(out, "dn_momentum_activation", c->dn_c);
    print_double(out, "grace_ms", c->grace_ms);
    fprintf(out, "async_queue = %u\ndylu_base_steps = %u\n", c->async_queue, c->dylu_base_steps);
    print_double(out, "publish_interval", c->publish_interval);
    print_double(out, "verify_keep", c->verify_keep);
    if (c->aggregate == RULE_TRIMMED)
        fprintf(out, "aggregate = trimmed_mean:%u\n", c->trim_k);
    else
        fprintf(out, "aggregate = %s\n", config_rule_name(c->aggregate));
    print_double(out, "max_norm_ratio", c->max_norm_ratio);
    print_double(out, "max_norm", c->max_norm);
    print_double(out, "max_weight_ratio", c->max_weight_ratio);
    if (c->screen)
        fprintf(out, "screen = cosine:%.17g\n", c->screen_cosine);
    else
        fprintf(out, "screen = none\n");
    print_str(out, "listen", c->listen, "");
    print_str(out, "token_file", c->token_file, " (uploads from loopback peers only)");
    print_str(out, "signing_key", c->signing_key, " (steps are not signed)");
    fprintf(out, "max_header_bytes = %u\nmax_headers = %u\nmax_body_mib = %u\nmax_delta_header_mib = %u\n"
                 "max_uploads = %u\n",
            c->max_header_bytes, c->max_headers, c->max_body_mib, c->max_delta_header_mib, c->max_uploads);
    print_double(out, "header_timeout", c->header_timeout);
    print_double(out, "idle_timeout", c->idle_timeout);
    fprintf(out, "max_connections = %u\nmax_downloads = %u\n", c->max_connections, c->max_downloads);
    fprintf(out, "prune_consumed = %u\nwarm_outputs = %u\nhistory_keep = %u\n", c->prune_consumed, c->warm_outputs,
            c->history_keep);
    fprintf(out, "shard_size = %" PRIu64 "\n", c->shard_size);
    fprintf(out, "downlink = %s\nupdates_keep = %u\n", cz_encoding_name((cz_encoding)c->downlink), c->updates_keep);
    fprintf(out, "cluster_shards = %u\n", c->cluster_shards);
    print_double(out, "cluster_lease", c->cluster_lease);
    print_transport_options(c, out);
}
