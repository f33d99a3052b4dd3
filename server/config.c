#include "config.h"
#include "hub_hf.h"

#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "util.h"

typedef enum opt_type { T_STR, T_UINT, T_DOUBLE, T_OPTIMIZER, T_NODES, T_LOGLEVEL, T_LOGFORMAT } opt_type;

typedef struct opt {
    const char *key;            /* file key; the flag is "--" + key with '_' -> '-' */
    opt_type type;
    size_t offset;
    double min, max;            /* numeric range */
    const char *help;
} opt;

#define OFF(f) offsetof(config, f)
static const opt options[] = {
    {"state_root", T_STR, OFF(state_root), 0, 0, "DIR       local state (one subdirectory per aggregator id)"},
    {"id", T_STR, OFF(id), 0, 0, "NAME              aggregator id: state lives in <state_root>/<id>/"},
    {"hub", T_STR, OFF(hub), 0, 0, "URL              file:///abs/dir | hf://ns/repo[@rev] | none"},
    {"init_model", T_STR, OFF(init_model), 0, 0, "FILE      initial model, published as step 0 when there is no state and no global"},
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
    {"listen", T_STR, OFF(listen), 0, 0, "HOST:PORT     HTTP API address (port 0: any free port); none disables it"},
    {"token_file", T_STR, OFF(token_file), 0, 0, "FILE      upload tokens, lines 'node_id token' ('*' = any node); without it uploads are loopback-only"},
    {"max_header_bytes", T_UINT, OFF(max_header_bytes), 256, 1 << 24, "N   HTTP request head size limit (431 beyond)"},
    {"max_headers", T_UINT, OFF(max_headers), 4, 10000, "N        HTTP header count limit (431 beyond)"},
    {"max_body_mib", T_UINT, OFF(max_body_mib), 0, 1 << 22, "MIB     upload size limit (413 beyond); 0 = the expected delta size + the header cap"},
    {"max_delta_header_mib", T_UINT, OFF(max_delta_header_mib), 1, 95, "MIB  cap on a delta's safetensors header (uploads, file:// and hf://)"},
    {"max_uploads", T_UINT, OFF(max_uploads), 1, 65536, "N        delta uploads in progress at most (503 + Retry-After beyond)"},
    {"header_timeout", T_DOUBLE, OFF(header_timeout), 0.01, 3600, "SECONDS  to receive a request head (slowloris)"},
    {"idle_timeout", T_DOUBLE, OFF(idle_timeout), 0.01, 86400, "SECONDS  without progress on a connection (idle, stalled body or download)"},
    {"max_connections", T_UINT, OFF(max_connections), 1, 1000000, "N    open HTTP connections at most"},
    {"hub_endpoint", T_STR, OFF(hub_endpoint), 0, 0, "URL     Hub endpoint for hf:// (default $HF_ENDPOINT or https://huggingface.co)"},
    {"hub_token_file", T_STR, OFF(hub_token_file), 0, 0, "FILE  file holding the Hub token (default $HF_TOKEN)"},
    {"max_downloads", T_UINT, OFF(max_downloads), 1, 64, "N      parallel delta downloads from the Hub"},
};

const char *config_optimizer_name(config_optimizer o)
{
    return o == OPT_SGD ? "sgd" : "nesterov_sgd";
}

static int bad(const char *origin, const char *key, const char *fmt, ...)
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

static void free_nodes(config *c)
{
    for (size_t i = 0; i < c->nnodes; i++)
        free(c->nodes[i]);
    free(c->nodes);
    c->nodes = NULL;
    c->nnodes = 0;
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
            return bad(origin, key, "invalid node id '%.*s' (allowed: [A-Za-z0-9._-]{1,64}, not . or ..)", (int)len, p);
        for (size_t i = 0; i < c->nnodes; i++) {
            if (strlen(c->nodes[i]) == len && memcmp(c->nodes[i], p, len) == 0)
                return bad(origin, key, "node id '%.*s' listed twice", (int)len, p);
        }
        if (c->nnodes >= CONFIG_MAX_NODES)
            return bad(origin, key, "more than %d nodes", CONFIG_MAX_NODES);
        char **nv = realloc(c->nodes, (c->nnodes + 1) * sizeof(*nv));
        if (nv == NULL || (nv[c->nnodes] = strndup(p, len)) == NULL) {
            if (nv != NULL)
                c->nodes = nv;
            return bad(origin, key, "out of memory");
        }
        c->nodes = nv;
        c->nnodes++;
        if (comma == NULL)
            break;
        p = comma + 1;
    }
    return 0;
}

static int set_option(config *c, const opt *o, const char *v, const char *origin)
{
    void *field = (char *)c + o->offset;
    char *end;

    switch (o->type) {
    case T_STR: {
        char **s = field;
        char *copy = strdup(v);
        if (copy == NULL)
            return bad(origin, o->key, "out of memory");
        free(*s);
        *s = copy;
        return 0;
    }
    case T_UINT: {
        unsigned long long x;
        errno = 0;
        if (*v < '0' || *v > '9' || (x = strtoull(v, &end, 10), errno != 0) || *end != '\0' ||
            (double)x < o->min || (double)x > o->max)
            return bad(origin, o->key, "'%s' is not an integer in [%g, %g]", v, o->min, o->max);
        *(unsigned *)field = (unsigned)x;
        return 0;
    }
    case T_DOUBLE: {
        double x;
        errno = 0;
        x = strtod(v, &end);
        if (end == v || *end != '\0' || errno != 0 || !isfinite(x) || x < o->min || x > o->max)
            return bad(origin, o->key, "'%s' is not a number in [%g, %g]", v, o->min, o->max);
        *(double *)field = x;
        return 0;
    }
    case T_OPTIMIZER:
        if (strcmp(v, "nesterov_sgd") == 0)
            *(config_optimizer *)field = OPT_NESTEROV_SGD;
        else if (strcmp(v, "sgd") == 0)
            *(config_optimizer *)field = OPT_SGD;
        else
            return bad(origin, o->key, "'%s' is not an optimizer (nesterov_sgd, sgd)", v);
        return 0;
    case T_NODES:
        return set_nodes(c, v, origin, o->key);
    case T_LOGLEVEL:
        if (dl_log_parse_level(v, (dl_log_level *)field) != 0)
            return bad(origin, o->key, "'%s' is not a log level (error, warn, info, debug)", v);
        return 0;
    case T_LOGFORMAT:
        if (strcmp(v, "text") == 0)
            *(int *)field = 0;
        else if (strcmp(v, "json") == 0)
            *(int *)field = 1;
        else
            return bad(origin, o->key, "'%s' is not a log format (text, json)", v);
        return 0;
    }
    return 2;
}

static const opt *find_key(const char *key, size_t len)
{
    for (size_t i = 0; i < sizeof(options) / sizeof(options[0]); i++) {
        if (strlen(options[i].key) == len && memcmp(options[i].key, key, len) == 0)
            return &options[i];
    }
    return NULL;
}

/* "--round-timeout" -> the round_timeout option. */
static const opt *find_flag(const char *flag)
{
    char key[64];
    size_t n = strlen(flag);

    if (n >= sizeof(key))
        return NULL;
    for (size_t i = 0; i <= n; i++)
        key[i] = flag[i] == '-' ? '_' : flag[i];
    return find_key(key, n);
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

static int load_file(config *c, const char *path)
{
    FILE *f = fopen(path, "r");
    char line[8192], origin[600];
    int lineno = 0, rc = 0;

    if (f == NULL) {
        fprintf(stderr, "dilocod: --config: cannot open %s: %s\n", path, strerror(errno));
        return 2;
    }
    while (rc == 0 && fgets(line, sizeof(line), f) != NULL) {
        char *s, *eq, *key, *val;
        const opt *o;
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
        val = trim(eq + 1);
        snprintf(origin, sizeof(origin), "%s:%d: ", path, lineno);
        if ((o = find_key(key, strlen(key))) == NULL) {
            fprintf(stderr, "dilocod: %sunknown option '%s'\n", origin, key);
            rc = 2;
            break;
        }
        rc = set_option(c, o, val, origin);
    }
    fclose(f);
    return rc;
}

static void usage(FILE *out)
{
    fprintf(out, "usage: dilocod [options]\n\n"
                 "The DiLoCo outer-loop aggregator: collects node deltas, averages them, applies the outer\n"
                 "optimizer and publishes the new global model.\n\noptions (each also a key in the config file):\n");
    for (size_t i = 0; i < sizeof(options) / sizeof(options[0]); i++) {
        char flag[64];
        size_t n = strlen(options[i].key);
        for (size_t k = 0; k <= n; k++)
            flag[k] = options[i].key[k] == '_' ? '-' : options[i].key[k];
        fprintf(out, "  --%s %s\n", flag, options[i].help);
    }
    fprintf(out, "  --config FILE          read options from FILE first (key = value, # comments)\n"
                 "  --check-config         validate, print the effective configuration and exit\n"
                 "  --help, --version\n");
}

static void set_defaults(config *c)
{
    memset(c, 0, sizeof(*c));
    c->state_root = strdup("/var/lib/dilocod");
    c->id = strdup("aggregator");
    c->hub = strdup("none");
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
    c->retry_interval = 5.0;
    c->listen = strdup("127.0.0.1:8470");
    c->max_header_bytes = 16384;
    c->max_headers = 100;
    c->max_delta_header_mib = 16;
    c->header_timeout = 10;
    c->idle_timeout = 60;
    c->max_connections = 1024;
    c->max_uploads = 64;
    c->max_downloads = 2;
}

/* hf://ns/repo[@rev], the endpoint and the token (never printed, never logged). */
static int load_hf(config *c)
{
    const char *env;

    free(c->hf_repo);
    free(c->hf_rev);
    if (hf_parse_url(c->hub, &c->hf_repo, &c->hf_rev) != 0)
        return bad("--", "hub", "'%s' is not hf://namespace/repo[@revision]", c->hub);
    if (c->hub_endpoint == NULL) {
        env = getenv("HF_ENDPOINT");
        c->hub_endpoint = strdup(env && *env ? env : "https://huggingface.co");
    }
    if (strncmp(c->hub_endpoint, "https://", 8) != 0 && strncmp(c->hub_endpoint, "http://", 7) != 0)
        return bad("--", "hub-endpoint", "'%s' is not an http(s) URL", c->hub_endpoint);
    free(c->hub_token);
    c->hub_token = NULL;
    if (c->hub_token_file != NULL) {
        FILE *f = fopen(c->hub_token_file, "r");
        char line[512];
        if (f == NULL)
            return bad("--", "hub-token-file", "cannot read %s: %s", c->hub_token_file, strerror(errno));
        if (fgets(line, sizeof(line), f) == NULL)
            line[0] = '\0';
        fclose(f);
        line[strcspn(line, "\r\n")] = '\0';
        if (line[0] == '\0' || strpbrk(line, " \t") != NULL)
            return bad("--", "hub-token-file", "%s does not hold a token on its first line", c->hub_token_file);
        c->hub_token = strdup(line);
        memset(line, 0, sizeof(line));
    } else if ((env = getenv("HF_TOKEN")) != NULL && *env) {
        c->hub_token = strdup(env);
    }
    return 0;
}

/* HOST:PORT, [v6]:PORT or none. */
static int parse_listen(config *c)
{
    const char *v = c->listen, *colon;
    char *end;
    long port;

    free(c->listen_host);
    c->listen_host = NULL;
    if (strcmp(v, "none") == 0)
        return 0;
    if (v[0] == '[') {
        const char *close = strchr(v, ']');
        if (close == NULL || close[1] != ':')
            return bad("--", "listen", "'%s' is not HOST:PORT, [V6ADDR]:PORT or none", v);
        c->listen_host = strndup(v + 1, (size_t)(close - v - 1));
        colon = close + 1;
    } else {
        colon = strrchr(v, ':');
        if (colon == NULL || colon == v)
            return bad("--", "listen", "'%s' is not HOST:PORT, [V6ADDR]:PORT or none", v);
        c->listen_host = strndup(v, (size_t)(colon - v));
    }
    errno = 0;
    port = strtol(colon + 1, &end, 10);
    if (colon[1] == '\0' || *end != '\0' || errno != 0 || port < 0 || port > 65535)
        return bad("--", "listen", "'%s': the port must be 0..65535", v);
    c->listen_port = (int)port;
    return c->listen_host ? 0 : bad("--", "listen", "out of memory");
}

static int validate(config *c)
{
    if (c->state_root == NULL || c->id == NULL || c->hub == NULL)
        return bad("", "config", "out of memory");
    if (c->state_root[0] == '\0')
        return bad("--", "state-root", "must not be empty");
    if (!delta_valid_node_id(c->id, strlen(c->id)))
        return bad("--", "id", "'%s' is not a valid id ([A-Za-z0-9._-]{1,64}, not . or ..)", c->id);
    if (strcmp(c->hub, "none") != 0 && strncmp(c->hub, "file:///", 8) != 0 && strncmp(c->hub, "hf://", 5) != 0)
        return bad("--", "hub", "'%s' is not file:///abs/dir, hf://ns/repo[@rev] or none", c->hub);
    if (strncmp(c->hub, "hf://", 5) == 0) {
        int rc = load_hf(c);
        if (rc != 0)
            return rc;
    }
    if (strcmp(c->hub, "file:///") == 0)
        return bad("--", "hub", "file:// needs a directory other than /");
    if (c->nnodes > 0) {
        if (c->expected_nodes != 0 && c->expected_nodes != c->nnodes)
            return bad("--", "expected-nodes", "%u disagrees with the %zu ids given by --nodes", c->expected_nodes,
                       c->nnodes);
        c->expected_nodes = (unsigned)c->nnodes;
    }
    if (c->expected_nodes == 0 && c->round_timeout == 0)
        return bad("--", "expected-nodes", "rounds would never close: give --expected-nodes/--nodes or --round-timeout");
    if (c->expected_nodes != 0 && c->min_nodes > c->expected_nodes)
        return bad("--", "min-nodes", "%u is more than the %u expected nodes", c->min_nodes, c->expected_nodes);
    if (c->momentum < 0)
        c->momentum = c->optimizer == OPT_NESTEROV_SGD ? 0.9 : 0.0;
    if (c->momentum >= 1)
        return bad("--", "momentum", "%g must be below 1", c->momentum);
    if (c->listen == NULL)
        return bad("", "config", "out of memory");
    if (c->token_file != NULL && access(c->token_file, R_OK) != 0)
        return bad("--", "token-file", "cannot read %s: %s", c->token_file, strerror(errno));
    return parse_listen(c);
}

int config_load(config *c, int argc, char **argv)
{
    int rc, check = 0;

    set_defaults(c);
    /* the file first, so that flags override it wherever they stand */
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--config") == 0 || strncmp(argv[i], "--config=", 9) == 0) {
            const char *v = argv[i][8] == '=' ? argv[i] + 9 : (i + 1 < argc ? argv[i + 1] : NULL);
            if (v == NULL)
                return bad("--", "config", "needs a FILE");
            free(c->config_file);
            c->config_file = strdup(v);
            if ((rc = load_file(c, v)) != 0)
                return rc;
        }
    }
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *val;
        char name[64];
        const opt *o;
        if (strcmp(a, "--help") == 0 || strcmp(a, "-h") == 0) {
            usage(stdout);
            return 1;
        }
        if (strcmp(a, "--version") == 0) {
            printf("dilocod %s\n", DILOCOD_VERSION);
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
        if (eq != NULL) {
            val = eq + 1;
        } else if (i + 1 < argc) {
            val = argv[++i];
        } else {
            fprintf(stderr, "dilocod: --%s needs a value\n", name);
            return 2;
        }
        if (strcmp(name, "config") == 0)
            continue;
        if ((o = find_flag(name)) == NULL) {
            fprintf(stderr, "dilocod: unknown option '--%s' (see --help)\n", name);
            return 2;
        }
        if ((rc = set_option(c, o, val, "--")) != 0) {
            return rc;
        }
    }
    if ((rc = validate(c)) != 0)
        return rc;
    if (check) {
        config_print(c, stdout);
        return 1;
    }
    return 0;
}

void config_print(const config *c, FILE *out)
{
    fprintf(out, "# dilocod effective configuration\n");
    if (c->config_file)
        fprintf(out, "# read from %s, then overridden by flags\n", c->config_file);
    fprintf(out, "state_root = %s\nid = %s\nhub = %s\ninit_model = %s\n", c->state_root, c->id, c->hub,
            c->init_model ? c->init_model : "");
    fprintf(out, "expected_nodes = %u\nnodes = ", c->expected_nodes);
    for (size_t i = 0; i < c->nnodes; i++)
        fprintf(out, "%s%s", i ? "," : "", c->nodes[i]);
    fprintf(out, "\nmin_nodes = %u\nround_timeout = %g\noptimizer = %s\nlr = %.9g\nmomentum = %.9g\n", c->min_nodes,
            c->round_timeout, config_optimizer_name(c->optimizer), c->lr, c->momentum);
    fprintf(out, "threads = %u\npoll_interval = %g\nlog_level = %s\nlog_format = %s\nagg_memory_mib = %u\n"
                 "retry_interval = %g\n",
            c->threads, c->poll_interval, dl_log_level_name(c->log_level), c->log_json ? "json" : "text",
            c->agg_memory_mib, c->retry_interval);
    fprintf(out, "listen = %s\ntoken_file = %s\nmax_header_bytes = %u\nmax_headers = %u\nmax_body_mib = %u\n"
                 "max_delta_header_mib = %u\nmax_uploads = %u\nheader_timeout = %g\nidle_timeout = %g\n"
                 "max_connections = %u\n",
            c->listen, c->token_file ? c->token_file : "", c->max_header_bytes, c->max_headers, c->max_body_mib,
            c->max_delta_header_mib, c->max_uploads, c->header_timeout, c->idle_timeout, c->max_connections);
    fprintf(out, "hub_endpoint = %s\nhub_token_file = %s\nmax_downloads = %u\n# hub token: %s\n",
            c->hub_endpoint ? c->hub_endpoint : "", c->hub_token_file ? c->hub_token_file : "", c->max_downloads,
            c->hub_token ? "set" : "not set");
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
    free(c->hub_endpoint);
    free(c->hub_token_file);
    if (c->hub_token)
        memset(c->hub_token, 0, strlen(c->hub_token));
    free(c->hub_token);
    free(c->hf_repo);
    free(c->hf_rev);
    free_nodes(c);
}
