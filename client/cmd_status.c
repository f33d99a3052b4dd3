/* diloco status / wait: dilocod's /status shown, and waiting for a step. */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <strings.h>
#include <getopt.h>
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <cJSON.h>
#include <curl/curl.h>

#include "cli.h"
#include "cli_body.h"
#include "cli_untrusted.h"
#include "delta.h"
#include "fsutil.h"
#include "safetensors.h"
#include "st_index.h"
#include "stepcount.h"
#include "strbuf.h"
#include "cmd_http.h"

/* ---- status / wait ----------------------------------------------------------------------------- */

static cJSON *fetch_status(const client_opts *o, int *rc)
{
    response r = {0};
    cJSON *j = NULL;

    *rc = cli_get(o, "/status", &r, NULL, NULL);
    if (*rc == 0 && r.status == 200)
        j = cJSON_ParseWithLength(r.body.p ? r.body.p : "", r.body.len);
    if (*rc == 0 && j == NULL) {
        fprintf(stderr, "diloco: /status answered HTTP %ld without a JSON status\n", r.status);
        *rc = EXIT_NETWORK;
    }
    free(r.body.p);
    return j;
}

static double num(const cJSON *o, const char *k)
{
    return cJSON_GetNumberValue(cJSON_GetObjectItemCaseSensitive(o, k));
}

static int has_num(const cJSON *o, const char *k)
{
    return cJSON_IsNumber(cJSON_GetObjectItemCaseSensitive(o, k));
}

/* A string of /status as the server sent it, "-" when absent: for comparisons, never printed. */
static const char *raw_str(const cJSON *o, const char *k)
{
    const char *s = cJSON_GetStringValue(cJSON_GetObjectItemCaseSensitive(o, k));
    return s ? s : "-";
}

/* A string of /status in its shown form (cli_untrusted.h), "-" when absent: the only way one is printed. */
typedef struct shown_text {
    char s[512];
} shown_text;

static const char *shown(const cJSON *o, const char *k, shown_text *t)
{
    return cli_untrusted_str(t->s, sizeof(t->s), cJSON_GetStringValue(cJSON_GetObjectItemCaseSensitive(o, k)));
}

/* A number for a person: "-" when the server sent none (null, absent), never "-nan". */
static const char *num_text(const cJSON *o, const char *k, const char *fmt, char *buf, size_t size)
{
    if (!has_num(o, k))
        return "-";
    snprintf(buf, size, fmt, num(o, k));
    return buf;
}

/* The daemon's state in words (the same words as the dashboard); an unknown name is given back (the caller
 * passes its shown form). */
static const char *state_words(const char *state)
{
    static const char *const words[][2] = {
        {"waiting_for_global", "waiting for a global model"},
        {"collecting", "collecting deltas"},
        {"aggregating", "aggregating the round"},
        {"retry_wait", "aggregation failed, waiting to retry"},
        {"stopping", "stopping"},
    };
    for (size_t i = 0; i < sizeof(words) / sizeof(words[0]); i++) {
        if (strcmp(state, words[i][0]) == 0)
            return words[i][1];
    }
    return state;
}

/* No global model yet: say so, and how one comes (it depends on the hub), instead of a step. */
static void print_no_global(const cJSON *hub)
{
    const char *kind = raw_str(hub, "kind");
    shown_text url;
    printf("outer step: none: no global model yet, waiting for one (");
    if (strcmp(kind, "none") == 0)
        printf("restart dilocod with --init-model FILE to bootstrap one");
    else
        printf("bootstrap with --init-model, or publish global/latest.safetensors to %s", shown(hub, "url", &url));
    printf(")\n");
}

static void print_round(const cJSON *round)
{
    const cJSON *recv = cJSON_GetObjectItemCaseSensitive(round, "received"), *e;
    char a[32], b[32], c[32];
    shown_text t;

    printf("round %s (-> step ", num_text(round, "step", "%.0f", a, sizeof(a)));
    if (has_num(round, "step"))
        printf("%.0f", num(round, "step") + 1);
    else
        printf("-");
    printf("): %d of %s nodes delivered (min %s)", cJSON_GetArraySize(recv),
           num_text(round, "expected", "%.0f", b, sizeof(b)), num_text(round, "min_nodes", "%.0f", c, sizeof(c)));
    if (cJSON_IsString(cJSON_GetObjectItemCaseSensitive(round, "deadline")))
        printf(", deadline %s", shown(round, "deadline", &t));
    printf("\n");
    cJSON_ArrayForEach(e, recv)
        printf("  %-24s local_step %-10s %12s bytes\n", shown(e, "node_id", &t), num_text(e, "local_step", "%.0f", a, sizeof(a)),
               num_text(e, "bytes", "%.0f", b, sizeof(b)));
    const cJSON *missing = cJSON_GetObjectItemCaseSensitive(round, "missing");
    if (cJSON_GetArraySize(missing) > 0) {
        printf("  missing:");
        cJSON_ArrayForEach(e, missing)
            printf(" %s", cJSON_IsString(e) ? cli_untrusted_str(t.s, sizeof(t.s), e->valuestring) : "?");
        printf("\n");
    }
}

/* Async mode has no rounds: every delta is an update.  Its words: the updates, what waits for one, the
 * staleness, and each node's deltas with the local steps recommended back to it. */
static void print_async(const cJSON *as)
{
    const cJSON *queue = cJSON_GetObjectItemCaseSensitive(as, "queue");
    const cJSON *stale = cJSON_GetObjectItemCaseSensitive(as, "staleness");
    const cJSON *nodes = cJSON_GetObjectItemCaseSensitive(as, "nodes"), *e;
    char a[32], b[32], c[32], d[32];
    shown_text t;

    printf("async: %s updates (%s Nesterov steps), %s deltas accepted; waiting: %s pending, %s queued (max %s)\n",
           num_text(as, "updates", "%.0f", a, sizeof(a)), num_text(as, "nesterov_steps", "%.0f", b, sizeof(b)),
           num_text(as, "accepted", "%.0f", c, sizeof(c)), num_text(queue, "pending", "%.0f", d, sizeof(d)),
           num_text(queue, "queued", "%.0f", a, sizeof(a)), num_text(queue, "max", "%.0f", b, sizeof(b)));
    printf("staleness: mean %s updates behind\n", num_text(stale, "mean", "%.2f", a, sizeof(a)));
    cJSON_ArrayForEach(e, nodes)
        printf("  %-24s %s deltas, last local step %s, %s steps per delta, recommended %s\n", shown(e, "node_id", &t),
               num_text(e, "deltas", "%.0f", a, sizeof(a)), num_text(e, "last_local_step", "%.0f", b, sizeof(b)),
               num_text(e, "steps_per_delta", "%.0f", c, sizeof(c)),
               num_text(e, "recommended_local_steps", "%.0f", d, sizeof(d)));
}

static void print_status(const cJSON *j)
{
    const cJSON *round = cJSON_GetObjectItemCaseSensitive(j, "round");
    const cJSON *last = cJSON_GetObjectItemCaseSensitive(j, "last_round");
    const cJSON *opt = cJSON_GetObjectItemCaseSensitive(j, "optimizer");
    const cJSON *hub = cJSON_GetObjectItemCaseSensitive(j, "hub");
    const cJSON *agg = cJSON_GetObjectItemCaseSensitive(j, "aggregation"), *e;
    /* "nothing yet" is outer_step null: no round is open then, whatever else the server sends */
    int have_global = has_num(j, "outer_step");
    char a[32], b[32], c[32], d[32];
    shown_text t, u;

    printf("dilocod %s, up %s s, %s\n", shown(j, "version", &t), num_text(j, "uptime_seconds", "%.0f", a, sizeof(a)),
           state_words(shown(j, "state", &u)));
    if (have_global)
        printf("outer step: %.0f\n", num(j, "outer_step"));
    else
        print_no_global(hub);
    printf("optimizer: %s lr=%s momentum=%s\n", shown(opt, "name", &t), num_text(opt, "lr", "%g", a, sizeof(a)),
           num_text(opt, "momentum", "%g", b, sizeof(b)));
    const cJSON *as = cJSON_GetObjectItemCaseSensitive(j, "async");
    int async = strcmp(raw_str(j, "mode"), "async") == 0 && cJSON_IsObject(as);
    if (async && have_global)
        print_async(as);
    else if (have_global && cJSON_IsObject(round))
        print_round(round);
    else
        printf("%s: none open until there is a global model\n", async ? "updates" : "round");
    if (cJSON_IsObject(agg))
        printf("aggregating: %s%% after %s s\n", num_text(agg, "percent", "%.1f", a, sizeof(a)),
               num_text(agg, "seconds", "%.1f", b, sizeof(b)));
    if (cJSON_IsObject(last)) {
        const cJSON *nodes = cJSON_GetObjectItemCaseSensitive(last, "nodes");
        printf(async ? "last update: step %s -> %s, %d deltas, %s s (%s GB/s), made by %s\n"
                     : "last round: step %s -> %s, %d nodes, %s s (%s GB/s), closed by %s\n",
               num_text(last, "step", "%.0f", a, sizeof(a)), num_text(last, "outer_step", "%.0f", b, sizeof(b)),
               cJSON_GetArraySize(nodes), num_text(last, "seconds", "%.3f", c, sizeof(c)),
               num_text(last, "gbps", "%.2f", d, sizeof(d)), shown(last, "reason", &t));
        cJSON_ArrayForEach(e, nodes)
            printf("  %-24s norm %-12s cosine to mean %s\n", shown(e, "node_id", &t), num_text(e, "norm", "%.6g", a, sizeof(a)),
                   num_text(e, "cosine", "%.4f", b, sizeof(b)));
    } else {
        printf(async ? "last update: none made yet\n" : "last round: none closed yet\n");
    }
    printf("hub: %s", shown(hub, "kind", &t));
    if (has_num(hub, "published_step"))
        printf(", published step %.0f", num(hub, "published_step"));
    else if (strcmp(raw_str(hub, "kind"), "none") != 0)
        printf(", nothing published yet");
    if (cJSON_IsString(cJSON_GetObjectItemCaseSensitive(hub, "last_error")))
        printf(", last error: %s", shown(hub, "last_error", &t));
    printf("\n");
}

/* GET /nodes/<id> (the node's verdicts), the document parsed; NULL with *rc set (the server's error said). */
static cJSON *fetch_node(const client_opts *o, const char *node, int *rc)
{
    response r = {0};
    cJSON *j = NULL, *err;
    char path[16 + DELTA_NODE_ID_MAX];
    shown_text t, u;

    snprintf(path, sizeof(path), "/nodes/%s", node);
    *rc = cli_get(o, path, &r, NULL, NULL);
    if (*rc == 0)
        j = cJSON_ParseWithLength(r.body.p ? r.body.p : "", r.body.len);
    if (*rc == 0 && (r.status != 200 || !cJSON_IsObject(j))) {
        err = cJSON_GetObjectItemCaseSensitive(j, "error");
        fprintf(stderr, "diloco: node %s: HTTP %ld %s%s%s\n", node, r.status, shown(err, "code", &t),
                cJSON_IsObject(err) ? ": " : "", cJSON_IsObject(err) ? cli_untrusted_str(u.s, sizeof(u.s),
                cJSON_GetStringValue(cJSON_GetObjectItemCaseSensitive(err, "message"))) : "");
        cJSON_Delete(j);
        j = NULL;
        *rc = EXIT_NETWORK;
    }
    free(r.body.p);
    return j;
}

/* A node's verdicts for a person: the counts, then each delta, newest first (every string shown, never raw). */
static void print_node(const cJSON *j)
{
    const cJSON *counts = cJSON_GetObjectItemCaseSensitive(j, "counts");
    const cJSON *deltas = cJSON_GetObjectItemCaseSensitive(j, "deltas"), *e;
    char a[32], b[32], c[32], d[32];
    shown_text t, u, v;

    printf("node %s: %s verdicts\n", shown(j, "node_id", &t), num_text(j, "total", "%.0f", a, sizeof(a)));
    printf("counts:");
    cJSON_ArrayForEach(e, counts)
        printf(" %s %s", cli_untrusted_str(t.s, sizeof(t.s), e->string), cJSON_IsNumber(e) ? (snprintf(a, sizeof(a),
               "%.0f", e->valuedouble), a) : "-");
    printf("\n");
    cJSON_ArrayForEach(e, deltas)
        printf("  local_step %-8s base %-6s step %-6s %-11s %-16s HTTP %-4s %s\n",
               num_text(e, "local_step", "%.0f", a, sizeof(a)), num_text(e, "base_outer_step", "%.0f", b, sizeof(b)),
               num_text(e, "step", "%.0f", c, sizeof(c)), shown(e, "verdict", &t), shown(e, "reason", &u),
               num_text(e, "status", "%.0f", d, sizeof(d)), shown(e, "message", &v));
}

static const char status_help[] =
    "usage: diloco status --server URL [--node ID] [--json] [--retries N]\n"
    "  A readable summary of dilocod's state: the step, the open round (which nodes delivered), the\n"
    "  last round (time, per-node norm and cosine to the mean), the hub.  --json prints /status as is.\n"
    "  --node ID: that node's last deltas and their verdicts instead (GET /nodes/ID: accepted, queued,\n"
    "  aggregated, quarantined, replaced, refused, with the reason), and its counts by reason.\n"
    "  --retries N: retries of connection errors and 5xx answers (default 2)\n";

int cmd_status(int argc, char **argv)
{
    static const struct option opts[] = {{"server", required_argument, NULL, 's'},
                                         {"json", no_argument, NULL, 'j'},
                                         {"node", required_argument, NULL, 'n'},
                                         {"retries", required_argument, NULL, 'r'},
                                         {"help", no_argument, NULL, 'h'},
                                         {NULL, 0, NULL, 0}};
    client_opts o;
    int c, json = 0, rc;
    const char *node = NULL;
    cJSON *j;

    cli_opts_defaults(&o);
    o.retries = 2;
    while ((c = getopt_long(argc, argv, "h", opts, NULL)) != -1) {
        switch (c) {
        case 's': o.server = optarg; break;
        case 'j': json = 1; break;
        case 'n':
            if (!delta_valid_node_id(optarg, strlen(optarg)))
                return cli_bad_value("--node", optarg, status_help);
            node = optarg;
            break;
        case 'r': if (cli_parse_count(optarg, 100, &o.retries) != 0) return cli_bad_value("--retries", optarg, status_help); break;
        case 'h': fputs(status_help, stdout); return EXIT_OK;
        default: fputs(status_help, stderr); return EXIT_USAGE;
        }
    }
    if (o.server == NULL || optind != argc) {
        cli_usage_missing(o.server == NULL, NULL, optind < argc ? argv[optind] : NULL);
        fputs(status_help, stderr);
        return EXIT_USAGE;
    }
    if ((j = node != NULL ? fetch_node(&o, node, &rc) : fetch_status(&o, &rc)) == NULL)
        return rc;
    if (json) {
        /* cJSON escapes C0 in strings, not DEL, C1 or bytes that are not UTF-8 */
        char *t = cJSON_PrintUnformatted(j);
        cli_print_untrusted(stdout, t ? t : "null", t ? strlen(t) : 4);
        putchar('\n');
        cJSON_free(t);
    } else if (node != NULL) {
        print_node(j);
    } else {
        print_status(j);
    }
    cJSON_Delete(j);
    return EXIT_OK;
}

static const char wait_help[] =
    "usage: diloco wait --server URL --step N [--timeout S] [--interval S]\n"
    "  Blocks until dilocod's outer_step >= N (for worker scripts).  Server errors and restarts are\n"
    "  waited out.  exit: 0 reached, 2 usage, 5 timeout\n";

int cmd_wait(int argc, char **argv)
{
    static const struct option opts[] = {{"server", required_argument, NULL, 's'},
                                         {"step", required_argument, NULL, 'n'},
                                         {"timeout", required_argument, NULL, 'T'},
                                         {"interval", required_argument, NULL, 'i'},
                                         {"help", no_argument, NULL, 'h'},
                                         {NULL, 0, NULL, 0}};
    client_opts o;
    const char *step_s = NULL;
    uint64_t want;
    double timeout = 0, interval = 0.5;
    struct timespec t0, t1;
    int c;

    cli_opts_defaults(&o);
    o.retries = 0;
    while ((c = getopt_long(argc, argv, "h", opts, NULL)) != -1) {
        switch (c) {
        case 's': o.server = optarg; break;
        case 'n': step_s = optarg; break;
        case 'T': if (cli_parse_seconds(optarg, &timeout) != 0) return cli_bad_value("--timeout", optarg, wait_help); break;
        case 'i': if (cli_parse_seconds(optarg, &interval) != 0) return cli_bad_value("--interval", optarg, wait_help); break;
        case 'h': fputs(wait_help, stdout); return EXIT_OK;
        default: fputs(wait_help, stderr); return EXIT_USAGE;
        }
    }
    if (o.server == NULL || step_s == NULL || optind != argc || delta_parse_int(step_s, strlen(step_s), &want) != 0 ||
        !(interval > 0) || timeout < 0) {
        cli_usage_missing(o.server == NULL, step_s == NULL ? "--step N (the outer step to wait for)" : NULL,
                      optind < argc ? argv[optind] : NULL);
        if (step_s != NULL && delta_parse_int(step_s, strlen(step_s), &want) != 0)
            fprintf(stderr, "diloco: invalid value '%s' for --step\n", step_s);
        fputs(wait_help, stderr);
        return EXIT_USAGE;
    }
    o.timeout = 10;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (;;) {
        int rc;
        cJSON *j = fetch_status(&o, &rc);
        const cJSON *s = cJSON_GetObjectItemCaseSensitive(j, "outer_step");
        if (cJSON_IsNumber(s) && s->valuedouble >= (double)want) {
            printf("step %.0f\n", s->valuedouble);
            cJSON_Delete(j);
            return EXIT_OK;
        }
        cJSON_Delete(j);
        clock_gettime(CLOCK_MONOTONIC, &t1);
        double elapsed = (double)(t1.tv_sec - t0.tv_sec) + (double)(t1.tv_nsec - t0.tv_nsec) * 1e-9;
        if (timeout > 0 && elapsed >= timeout) {
            fprintf(stderr, "diloco: step %" PRIu64 " not reached within %g s\n", want, timeout);
            return EXIT_TIMEOUT;
        }
        cli_sleep_s(timeout > 0 ? fmin(interval, timeout - elapsed) : interval);
    }
}
