/* api: the HTTP routes of dilocod (README.md, HTTP API): the route table, the read-only routes and
 * the global's downloads.  /status and /metrics walk the providers that each subsystem registers
 * (daemon.h); the daemon is seen through daemon.h only.  Every error is JSON:
 * {"error":{"code":...,"message":...,"tensor"?:...}}. */
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <time.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include "api.h"
#include "daemon.h"
#include "delta.h"
#include "stepcount.h"
#include "store.h"
#include "st_index.h"
#include "strbuf.h"
#include "util.h"



/* server/api/dashboard.html, compiled in by the Makefile */
extern const unsigned char dashboard_html[];
extern const size_t dashboard_html_len;

void api_count_response(int route, int status, void *app)
{
    stats_http_response(daemon_stats(app), route, status);
}

/* ---- GET /status, /rounds, /metrics, /healthz ------------------------------------------------ */

/* /status: every provider's members (daemon.h: each subsystem writes its own), in their order. */
static void status_json(dilocod *d, sbuf *b)
{
    size_t n;
    const daemon_provider *const *p = daemon_providers(d, &n);

    sb_printf(b, "{\"version\":\"%s\"", DILOCOD_VERSION);
    for (size_t i = 0; i < n; i++)
        if (p[i]->status != NULL)
            p[i]->status(d, b);
    sb_str(b, "}\n");
}

/* /metrics: every provider's families. */
static void metrics_text(dilocod *d, sbuf *b)
{
    size_t n;
    const daemon_provider *const *p = daemon_providers(d, &n);

    for (size_t i = 0; i < n; i++)
        if (p[i]->metrics != NULL)
            p[i]->metrics(d, b);
}

static void rounds_json(dilocod *d, sbuf *b)
{
    const history *h = daemon_history(d);

    sb_str(b, "{\"rounds\":[");
    for (size_t i = 0; i < history_count(h); i++) {
        if (i > 0)
            sb_add(b, ",", 1);
        history_record_json(b, history_get(h, i));
    }
    sb_str(b, "]}\n");
}

static void respond_sbuf(http_conn *c, int status, const char *type, sbuf *b)
{
    size_t len = b->len;
    char *text = sb_take(b);
    if (text == NULL) {
        http_respond_error(c, 500, "out_of_memory", "out of memory", NULL);
        return;
    }
    http_respond(c, status, type, "Cache-Control: no-store\r\n", text, len);
    free(text);
}

/* ---- the global model ------------------------------------------------------------------------ */

/* "bytes=a-b" | "bytes=a-" | "bytes=-n" (one range).  1: range set; 0: ignore the header (absent,
 * malformed or several ranges: the whole file is sent, as RFC 9110 allows); -1: unsatisfiable. */
int api_parse_range(const char *h, uint64_t size, uint64_t *from, uint64_t *len)
{
    const char *p;
    char *end;
    uint64_t a, b;

    if (h == NULL || strncasecmp(h, "bytes=", 6) != 0 || strchr(h, ',') != NULL)
        return 0;
    p = h + 6;
    while (*p == ' ')
        p++;
    if (*p == '-') {
        errno = 0;
        b = strtoull(p + 1, &end, 10);
        if (p[1] < '0' || p[1] > '9' || errno != 0 || (*end != '\0' && *end != ' '))
            return 0;
        if (b == 0 || size == 0)
            return -1;
        if (b > size)
            b = size;
        *from = size - b;
        *len = b;
        return 1;
    }
    if (*p < '0' || *p > '9')
        return 0;
    errno = 0;
    a = strtoull(p, &end, 10);
    if (errno != 0 || *end != '-')
        return 0;
    p = end + 1;
    if (*p == '\0' || *p == ' ') {
        b = size ? size - 1 : 0;
    } else {
        if (*p < '0' || *p > '9')
            return 0;
        b = strtoull(p, &end, 10);
        if (errno != 0 || (*end != '\0' && *end != ' ') || b < a)
            return 0;
    }
    if (a >= size)
        return -1;
    if (b >= size)
        b = size - 1;
    *from = a;
    *len = b - a + 1;
    return 1;
}

/* If-None-Match: "*" or a list of (possibly weak, W/"...") tags; ours is unique per committed file. */
static int etag_matches(const char *inm, const char *etag)
{
    if (inm == NULL || etag[0] == '\0')
        return 0;
    return strcmp(inm, "*") == 0 || strstr(inm, etag) != NULL;
}

/* Sends one file of the served global (whole, a Range of it, or 304 for a matching ETag). */
static void serve_file(http_conn *c, http_request *req, uint64_t step, const served_file *f, const char *type)
{
    char extra[256];
    uint64_t from = 0, len;
    int r;

    if (etag_matches(http_header_get(req, "if-none-match"), f->etag)) {
        snprintf(extra, sizeof(extra), "ETag: %s\r\nX-Outer-Step: %" PRIu64 "\r\n", f->etag, step);
        http_respond(c, 304, NULL, extra, NULL, 0);
        return;
    }
    len = f->size;
    r = api_parse_range(http_header_get(req, "range"), f->size, &from, &len);
    if (r < 0) {
        snprintf(extra, sizeof(extra), "Content-Range: bytes */%" PRIu64 "\r\n", f->size);
        static const char body[] =
            "{\"error\":{\"code\":\"range_not_satisfiable\",\"message\":\"range outside the file\"}}\n";
        http_respond(c, 416, "application/json", extra, body, sizeof(body) - 1);
        return;
    }
    if (r == 1)
        snprintf(extra, sizeof(extra),
                 "ETag: %s\r\nAccept-Ranges: bytes\r\nX-Outer-Step: %" PRIu64 "\r\nContent-Range: bytes %" PRIu64
                 "-%" PRIu64 "/%" PRIu64 "\r\n",
                 f->etag, step, from, from + len - 1, f->size);
    else
        snprintf(extra, sizeof(extra), "ETag: %s\r\nAccept-Ranges: bytes\r\nX-Outer-Step: %" PRIu64 "\r\n", f->etag,
                 step);
    /* the response holds its own reference: a commit that replaces the served global does not cut it short */
    http_respond_file(c, r == 1 ? 206 : 200, type, extra, f->file, from, len);
}

/* GET /global/<file>: the plain latest.safetensors, or (a global above --shard-size) the index and
 * its shards, named as the transports publish them. */
static void serve_global(dilocod *d, http_conn *c, http_request *req)
{
    const served_global *g = daemon__global(d);
    const char *name = req->path + strlen("/global/");
    char base[ST_INDEX_BASE_MAX + 1];
    uint32_t i = 0, n = 0;
    st_name_kind kind = st_index_classify(name, strlen(name), base, &i, &n);

    if (kind == ST_NAME_OTHER || strcmp(base, "latest") != 0) {
        http_respond_error(c, 404, "not_found",
                           "the global is /global/latest.safetensors, or above the shard size "
                           "/global/latest.safetensors.index.json and the shards it lists",
                           NULL);
        return;
    }
    if (daemon_config(d)->cluster_shards) {
        http_respond_error(c, 404, "cluster", "a cluster (--cluster-shards) publishes to the bucket only: read "
                           "global/step_count.json and the model_file it names there", NULL);
        return;
    }
    if (!g->available) {
        http_respond_error(c, 503, "no_global", "no global model yet", NULL);
        return;
    }
    if (g->single.file != NULL && kind == ST_NAME_SINGLE)
        return serve_file(c, req, g->step, &g->single, "application/octet-stream");
    if (g->index.file != NULL && kind == ST_NAME_INDEX)
        return serve_file(c, req, g->step, &g->index, "application/json");
    if (g->index.file != NULL && kind == ST_NAME_SHARD && n == g->nshards && i < n)
        return serve_file(c, req, g->step, &g->shards[i], "application/octet-stream");
    http_respond_error(c, 404, "not_found",
                       g->single.file != NULL ? "the global is not sharded: GET /global/latest.safetensors"
                       : kind == ST_NAME_SINGLE
                           ? "the global is sharded (above the shard size): GET /global/latest.safetensors.index.json "
                             "and the shards it lists"
                           : "no such shard of the global: its index lists them",
                       NULL);
}

/* A file of the state served whole (a record, a kept step's file): opened without following a link. */
static void serve_state_file(http_conn *c, char *path, const char *type, const char *missing)
{
    struct stat sb;
    http_file *f;
    int fd = path != NULL ? open(path, O_RDONLY | O_CLOEXEC | O_NOFOLLOW) : -1;

    free(path);
    if (fd >= 0 && (fstat(fd, &sb) != 0 || !S_ISREG(sb.st_mode))) {
        close(fd);
        fd = -1;
    }
    if (fd < 0) {
        http_respond_error(c, 404, "not_found", missing, NULL);
        return;
    }
    if ((f = http_file_new(fd)) == NULL) {      /* it closed fd */
        http_respond_error(c, 500, "out_of_memory", "out of memory", NULL);
        return;
    }
    http_respond_file(c, 200, type, "Cache-Control: max-age=3600\r\n", f, 0, (uint64_t)sb.st_size);
    http_file_unref(f);
}

/* GET /global/rounds/<s>.json and <s>.json.sig (--signing-key): a served step's signed record and its
 * signature, as the transports publish them.  A step above the one served has none to give yet. */
static void serve_record(dilocod *d, http_conn *c, http_request *req)
{
    const served_global *g = daemon__global(d);
    const char *name = req->path + strlen("/global/rounds/"), *dot = strchr(name, '.');
    uint64_t step;
    int sig = dot != NULL && strcmp(dot, ".json.sig") == 0;

    if (dot == NULL || (!sig && strcmp(dot, ".json") != 0) || delta_parse_int(name, (size_t)(dot - name), &step) != 0) {
        http_respond_error(c, 404, "not_found", "a step's record is /global/rounds/<step>.json, its signature "
                           "/global/rounds/<step>.json.sig", NULL);
        return;
    }
    if (daemon_config(d)->signing_key == NULL) {
        http_respond_error(c, 404, "not_signed", "steps are not signed here (dilocod --signing-key)", NULL);
        return;
    }
    if (!g->available || step > g->step) {
        http_respond_error(c, 404, "not_found", "no record of that step is served", NULL);
        return;
    }
    /* a record never changes once its step is served: the same bytes however often it is asked */
    serve_state_file(c, store_path_manifest(daemon_store(d)->dir, step, sig),
                     sig ? "application/octet-stream" : "application/json",
                     "no record of that step (older than the records kept, or made before --signing-key was given)");
}

/* GET /rounds/<s>/global.safetensors, momentum.safetensors, accumulator.safetensors and
 * inputs/<node_id>.safetensors: what --verify-keep kept of the last N steps, for diloco verify-round. */
static void serve_kept(dilocod *d, http_conn *c, http_request *req)
{
    const char *rest = req->path + strlen("/rounds/"), *slash = strchr(rest, '/'), *name;
    const served_global *g = daemon__global(d);
    uint64_t step;
    char *dir, *path = NULL;

    if (slash == NULL || delta_parse_int(rest, (size_t)(slash - rest), &step) != 0) {
        http_respond_error(c, 404, "not_found", "a kept step's files are /rounds/<step>/global.safetensors, "
                           "momentum.safetensors, accumulator.safetensors and inputs/<node_id>.safetensors", NULL);
        return;
    }
    name = slash + 1;
    int known = strcmp(name, "global.safetensors") == 0 || strcmp(name, "momentum.safetensors") == 0 ||
                strcmp(name, "accumulator.safetensors") == 0;
    if (!known && strncmp(name, "inputs/", 7) == 0) {
        const char *node = name + 7, *dot = strrchr(node, '.');
        known = dot != NULL && strcmp(dot, ".safetensors") == 0 && delta_valid_node_id(node, (size_t)(dot - node));
    }
    if (!known || !g->available || step > g->step) {
        http_respond_error(c, 404, "not_found", "no such file of a kept step", NULL);
        return;
    }
    if ((dir = store_path_verify_step(daemon_store(d)->dir, step)) != NULL && asprintf(&path, "%s/%s", dir, name) < 0)
        path = NULL;
    free(dir);
    serve_state_file(c, path, "application/octet-stream",
                     "not kept: the step is older than the last --verify-keep steps, or has no such file");
}

static void serve_stepfile(dilocod *d, http_conn *c)
{
    /* the step whose files GET /global/ sends (a sharded step is served once its set is written) */
    const served_global *g = daemon__global(d);
    const store *st = daemon_store(d);
    char when[48], *text;
    struct tm tm;
    time_t t = daemon_committed_at(d);

    if (!st->committed || !g->available) {
        http_respond_error(c, 503, "no_global", "no global model yet", NULL);
        return;
    }
    gmtime_r(&t, &tm);
    strftime(when, sizeof(when), "%Y-%m-%dT%H:%M:%S+00:00", &tm);
    /* the downlink's names (README, "The downlink"): string values, the wire format's rule for extra keys */
    char hash[65], update[64];
    const char *kv[6];
    size_t nkv = 0;
    int has_update = 0, names = daemon_downlink_on(d) ? daemon_downlink_names(d, g->step, hash, &has_update) : -1;
    if (names >= 0) {
        snprintf(update, sizeof(update), "global/updates/%" PRIu64 ".safetensors", g->step);
        kv[nkv * 2] = "view_file";
        kv[nkv++ * 2 + 1] = "global/view.safetensors";
        if (has_update) {
            kv[nkv * 2] = "update_file";
            kv[nkv++ * 2 + 1] = update;
        }
        if (names == 0) {
            kv[nkv * 2] = "view_hash";
            kv[nkv++ * 2 + 1] = hash;
        }
    }
    text = stepcount_build_extra(g->step, config_optimizer_name(daemon_config(d)->optimizer),
                                 st->bootstrap && g->step == 0,
                                 g->index.file != NULL ? STEPCOUNT_MODEL_INDEX : STEPCOUNT_MODEL_SINGLE, when, kv, nkv);
    if (text == NULL) {
        http_respond_error(c, 500, "out_of_memory", "out of memory", NULL);
        return;
    }
    http_respond(c, 200, "application/json", "Cache-Control: no-cache\r\n", text, strlen(text));
    free(text);
}

/* ---- the downlink (README, "The downlink") --------------------------------------------------------- */

static int downlink_refused(dilocod *d, http_conn *c)
{
    if (daemon_downlink_on(d))
        return 0;
    http_respond_error(c, 404, "no_downlink", "this server runs --downlink none: workers download the global, "
                       "GET /global/latest.safetensors", NULL);
    return 1;
}

/* The bytes a response sends of f (a Range's, or the whole file; none for 304, 416), for the counts. */
static uint64_t bytes_to_send(http_request *req, const served_file *f)
{
    uint64_t from = 0, len = f->size;
    if (etag_matches(http_header_get(req, "if-none-match"), f->etag) ||
        api_parse_range(http_header_get(req, "range"), f->size, &from, &len) < 0)
        return 0;
    return len;
}

/* GET /global/view.safetensors: the newest committed step's view (X-Outer-Step its step). */
static void serve_view(dilocod *d, http_conn *c, http_request *req)
{
    uint64_t step;
    const served_file *f;

    if (downlink_refused(d, c))
        return;
    if ((f = daemon_view_file(d, &step)) == NULL) {
        http_respond_error(c, 503, "no_global", "no view yet", NULL);
        return;
    }
    daemon_downlink_sent(d, 0, bytes_to_send(req, f));
    serve_file(c, req, step, f, "application/octet-stream");
}

/* GET /global/updates/<s>.safetensors: step s's update, while s is committed and among the kept. */
static void serve_update(dilocod *d, http_conn *c, http_request *req)
{
    const char *name = req->path + strlen("/global/updates/"), *dot = strchr(name, '.');
    uint64_t step;
    const served_file *f;

    if (downlink_refused(d, c))
        return;
    if (dot == NULL || strcmp(dot, ".safetensors") != 0 || delta_parse_int(name, (size_t)(dot - name), &step) != 0) {
        http_respond_error(c, 404, "not_found", "an update is /global/updates/<step>.safetensors (a canonical "
                           "decimal step)", NULL);
        return;
    }
    if ((f = daemon_update_file(d, step)) == NULL) {
        const store *st = daemon_store(d);
        http_respond_error(c, 404, "update_not_served",
                           !st->committed || step > st->step
                               ? "that step is not committed"
                               : "that update is not kept (the newest --updates-keep of the view's chain are): "
                                 "GET /global/view.safetensors",
                           NULL);
        return;
    }
    daemon_downlink_sent(d, 1, bytes_to_send(req, f));
    serve_file(c, req, step, f, "application/octet-stream");
}

/* ---- routing ----------------------------------------------------------------------------------- */

static int method_is(const http_request *r, const char *m)
{
    return strcmp(r->method_name, m) == 0;
}

void api_not_allowed(http_conn *c, const char *allow)
{
    char extra[64], msg[96];
    snprintf(extra, sizeof(extra), "Allow: %s\r\n", allow);
    snprintf(msg, sizeof(msg), "{\"error\":{\"code\":\"method_not_allowed\",\"message\":\"allowed: %s\"}}\n", allow);
    http_respond(c, 405, "application/json", extra, msg, strlen(msg));
}

/* ---- handlers (one per route) ------------------------------------------------------------------ */

static void get_dashboard(dilocod *d, http_conn *c, http_request *req)
{
    (void)d;
    (void)req;
    /* self-contained: the page talks to this server only */
    http_respond_static(c, 200, "text/html; charset=utf-8",
                        "Cache-Control: no-cache\r\nX-Content-Type-Options: nosniff\r\n"
                        "Content-Security-Policy: default-src 'self'; style-src 'self' 'unsafe-inline'; "
                        "script-src 'self' 'unsafe-inline'; img-src 'self' data:\r\n",
                        (const char *)dashboard_html, dashboard_html_len);
}

static void healthz_json(dilocod *d, sbuf *b)
{
    sb_printf(b, "{\"status\":\"ok\",\"state\":\"%s\"}\n", daemon_stopping(d) ? "stopping" : daemon_state_name(d));
}

static void get_stepfile(dilocod *d, http_conn *c, http_request *req)
{
    (void)req;
    serve_stepfile(d, c);
}

/* GET /nodes/<id>: the node's last deltas and their verdicts (daemon_verdicts.c).  Read like /status
 * and /rounds, without a token: it says what the server did with deltas, never their content. */
static void get_node(dilocod *d, http_conn *c, http_request *req)
{
    const char *id = req->path + strlen("/nodes/");
    sbuf b = {0};

    if (!delta_valid_node_id(id, strlen(id))) {
        http_respond_error(c, 404, "not_found", "node ids are [A-Za-z0-9._-]{1,64}, never . or ..", NULL);
        return;
    }
    if (daemon_node_verdicts_json(d, id, &b) != 0) {
        free(b.p);
        http_respond_error(c, 404, "unknown_node",
                           "no verdict of this node is known (none of its deltas arrived, or it was forgotten for "
                           "more recent nodes)", NULL);
        return;
    }
    respond_sbuf(c, 200, "application/json", &b);
}

/* /nodes/<id> and nothing below it: the uploads' paths go on to their own row. */
static int is_node_path(const char *path)
{
    return strncmp(path, "/nodes/", 7) == 0 && path[7] != '\0' && strchr(path + 7, '/') == NULL;
}

/* ---- the route table --------------------------------------------------------------------------- */

typedef void (*route_handler)(dilocod *d, http_conn *c, http_request *req);
typedef void (*document_builder)(dilocod *d, sbuf *b);

/* A row: the path, how it is counted, and either a handler or a document built fresh per request
 * (sent 200, Cache-Control: no-store). */
typedef struct route {
    const char *path;           /* exact path, or a prefix when it ends with '/' (and is not "/") */
    stats_route id;             /* what /metrics counts it as */
    int read_only;              /* GET and HEAD only (else the handler checks methods itself) */
    route_handler handler;
    document_builder document;
    const char *type;           /* the document's Content-Type */
    int (*match)(const char *path);     /* optional: narrows a prefix row to the paths it takes */
} route;

#define JSON "application/json"
static const route routes[] = {
    {"/", ROUTE_DASHBOARD, 1, get_dashboard, NULL, NULL, NULL},
    {"/index.html", ROUTE_DASHBOARD, 1, get_dashboard, NULL, NULL, NULL},
    {"/status", ROUTE_STATUS, 1, NULL, status_json, JSON, NULL},
    {"/healthz", ROUTE_HEALTHZ, 1, NULL, healthz_json, JSON, NULL},
    {"/metrics", ROUTE_METRICS, 1, NULL, metrics_text, "text/plain; version=0.0.4; charset=utf-8", NULL},
    {"/rounds", ROUTE_ROUNDS, 1, NULL, rounds_json, JSON, NULL},
    {"/rounds/", ROUTE_ROUNDS, 1, serve_kept, NULL, NULL, NULL},
    {"/global/step_count.json", ROUTE_STEPFILE, 1, get_stepfile, NULL, NULL, NULL},
    {"/global/rounds/", ROUTE_GLOBAL, 1, serve_record, NULL, NULL, NULL},
    {"/global/view.safetensors", ROUTE_GLOBAL, 1, serve_view, NULL, NULL, NULL},
    {"/global/updates/", ROUTE_GLOBAL, 1, serve_update, NULL, NULL, NULL},
    {"/global/", ROUTE_GLOBAL, 1, serve_global, NULL, NULL, NULL},
    {"/nodes/", ROUTE_NODE, 1, get_node, NULL, NULL, is_node_path},
    {"/nodes/", ROUTE_UPLOAD, 0, upload_route, NULL, NULL, NULL},
};
#undef JSON

static const route *route_find(const char *path)
{
    for (size_t i = 0; i < sizeof(routes) / sizeof(routes[0]); i++) {
        const route *r = &routes[i];
        size_t n = strlen(r->path);
        int prefix = n > 1 && r->path[n - 1] == '/';
        if ((prefix ? strncmp(path, r->path, n) == 0 : strcmp(path, r->path) == 0) &&
            (r->match == NULL || r->match(path)))
            return r;
    }
    return NULL;
}

void api_on_request(http_conn *c, http_request *req, void *app)
{
    dilocod *d = app;
    const route *r = route_find(req->path);

    if (r == NULL) {
        http_conn_set_route(c, ROUTE_OTHER);
        http_respond_error(c, 404, "not_found", "no such resource", NULL);
        return;
    }
    http_conn_set_route(c, r->id);
    if (r->read_only && !method_is(req, "GET") && !method_is(req, "HEAD"))
        return api_not_allowed(c, "GET, HEAD");
    if (r->document != NULL) {
        sbuf b = {0};
        r->document(d, &b);
        respond_sbuf(c, 200, r->type, &b);
        return;
    }
    r->handler(d, c, req);
}

const daemon_front api_front = {
    .on_request = api_on_request,
    .on_response = api_count_response,
    .load_credentials = upload_tokens_load,
    .free_credentials = upload_tokens_free,
    .busy = upload_in_flight,
    .provider = &upload_provider,
};
