/* diloco push / pull / status / wait: the worker's side of dilocod's HTTP API (libcurl). */
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

/* Caps of the answers kept in memory: a server answer over its cap is not one of dilocod's, and is
 * refused at its Content-Length, or at the first byte past the cap, without a retry. */
#define MAX_RESPONSE (16u << 20)        /* /status, the largest (every node of a round, async's nodes) */
#define MAX_ANSWER (64u << 10)          /* an upload's answer, step_count.json, an error's JSON */
#define AUTH_HEADER_MAX 320

typedef struct response {
    long status;
    sbuf body;
    size_t cap;                 /* bytes of body kept in memory at most (0: MAX_RESPONSE) */
    char etag[128];
    uint64_t outer_step;
    int has_outer_step;
    uint64_t recommended;       /* X-Recommended-Local-Steps (async dilocod's DyLU), 0: none */
    FILE *sink;                 /* a 2xx body goes here instead of memory when set */
    cli_body *guard;            /* with sink: the body is a safetensors file, taken up to its own size */
    long head_status;           /* from the status line, while the body arrives */
    uint64_t content_length;    /* the answer's Content-Length, when has_content_length */
    int has_content_length;
    int body_started;
    int refused;                /* the answer broke its bounds: why says how (shown form), no retry */
    char why[512];
} response;

static size_t answer_cap(const response *r)
{
    return r->cap != 0 ? r->cap : MAX_RESPONSE;
}

static int to_sink(const response *r)
{
    return r->sink != NULL && r->head_status >= 200 && r->head_status < 300;
}

static size_t refuse(response *r, const char *why)
{
    r->refused = 1;
    snprintf(r->why, sizeof(r->why), "%s", why);
    return 0;                   /* curl aborts the transfer */
}

static size_t refuse_over_cap(response *r)
{
    char why[160];
    snprintf(why, sizeof(why), "refused: the answer (HTTP %ld) is over %zu bytes, more than any answer of dilocod's",
             r->head_status, answer_cap(r));
    return refuse(r, why);
}

/* The first byte of an answer: a model's body is declared to its guard. */
static void body_start(response *r)
{
    r->body_started = 1;
    if (r->guard != NULL && to_sink(r) && r->has_content_length)
        cli_body_declare(r->guard, r->content_length);
}

static size_t on_body(char *p, size_t size, size_t n, void *arg)
{
    response *r = arg;
    size_t len = size * n;
    if (!r->body_started)
        body_start(r);
    /* an error answer ({"error":{...}}) is kept in memory, so its code can be shown, not saved as the model */
    if (to_sink(r)) {
        dl_error err;
        dl_error_clear(&err);
        if (r->guard != NULL && cli_body_take(r->guard, p, len, &err) != 0) {
            char msg[sizeof(r->why)];
            snprintf(r->why, sizeof(r->why), "%s: %s", dl_error_name(err.code),
                     cli_untrusted(msg, sizeof(msg), err.message, strlen(err.message)));
            r->refused = 1;
            return 0;
        }
        return fwrite(p, 1, len, r->sink);
    }
    if (r->body.len + len > answer_cap(r))
        return refuse_over_cap(r);
    sb_add(&r->body, p, len);
    return r->body.oom ? 0 : len;
}

/* A Content-Length the answer declares: digits only (curl frames the body by it; this is for the caps). */
static void take_content_length(response *r, const char *v)
{
    char *end;
    while (*v == ' ' || *v == '\t')
        v++;
    errno = 0;
    unsigned long long cl = strtoull(v, &end, 10);
    while (*end == ' ' || *end == '\t')
        end++;
    if (errno == 0 && end != v && *v >= '0' && *v <= '9' && *end == '\0') {
        r->content_length = cl;
        r->has_content_length = 1;
    }
}

static size_t on_header(char *p, size_t size, size_t n, void *arg)
{
    response *r = arg;
    size_t len = size * n;
    char line[256];
    if (len >= sizeof(line))
        return len;
    memcpy(line, p, len);
    line[len] = '\0';
    line[strcspn(line, "\r\n")] = '\0';
    if (strncmp(line, "HTTP/", 5) == 0) {
        const char *sp = strchr(line, ' ');
        r->head_status = sp ? strtol(sp + 1, NULL, 10) : 0;   /* every response of a redirect chain */
        r->recommended = 0;                                   /* the last response's header counts */
        r->has_content_length = 0;
    } else if (strncasecmp(line, "Content-Length:", 15) == 0) {
        take_content_length(r, line + 15);
        /* an answer kept in memory that says it is over its cap: refused before its first byte */
        if (r->has_content_length && !to_sink(r) && r->content_length > answer_cap(r))
            return refuse_over_cap(r);
    } else if (strncasecmp(line, "X-Recommended-Local-Steps:", 26) == 0) {
        const char *v = line + 26;
        char *end;
        while (*v == ' ')
            v++;
        errno = 0;
        unsigned long long h = strtoull(v, &end, 10);
        r->recommended = (errno == 0 && end != v && *v != '-' && *end == '\0') ? h : 0;
    } else if (strncasecmp(line, "ETag:", 5) == 0) {
        const char *v = line + 5;
        while (*v == ' ')
            v++;
        snprintf(r->etag, sizeof(r->etag), "%.*s", (int)sizeof(r->etag) - 1, v);
    } else if (strncasecmp(line, "X-Outer-Step:", 13) == 0) {
        char *end;
        errno = 0;
        unsigned long long s = strtoull(line + 13, &end, 10);
        if (errno == 0 && end != line + 13) {
            r->outer_step = s;
            r->has_outer_step = 1;
        }
    }
    return len;
}

typedef struct client_opts {
    const char *server;
    double timeout;
    int retries;
    const char *token;
} client_opts;

static char *url_of(const client_opts *o, const char *path)
{
    char *u = NULL;
    size_t l = strlen(o->server);
    while (l > 0 && o->server[l - 1] == '/')
        l--;
    if (asprintf(&u, "%.*s%s", (int)l, o->server, path) < 0)
        return NULL;
    return u;
}

static CURL *easy(const client_opts *o, const char *url, response *r, struct curl_slist **hdrs)
{
    CURL *c = curl_easy_init();
    if (c == NULL)
        return NULL;
    curl_easy_setopt(c, CURLOPT_URL, url);
    curl_easy_setopt(c, CURLOPT_WRITEFUNCTION, on_body);
    curl_easy_setopt(c, CURLOPT_WRITEDATA, r);
    curl_easy_setopt(c, CURLOPT_HEADERFUNCTION, on_header);
    curl_easy_setopt(c, CURLOPT_HEADERDATA, r);
    curl_easy_setopt(c, CURLOPT_CONNECTTIMEOUT_MS, 10000L);
    curl_easy_setopt(c, CURLOPT_NOSIGNAL, 1L);
    curl_easy_setopt(c, CURLOPT_PROTOCOLS_STR, "http,https");
    curl_easy_setopt(c, CURLOPT_USERAGENT, "diloco/0.1.0");
    if (o->timeout > 0)
        curl_easy_setopt(c, CURLOPT_TIMEOUT_MS, (long)(o->timeout * 1000));
    /* a stalled transfer (below 1 byte/s for 60 s) is a network failure, retried */
    curl_easy_setopt(c, CURLOPT_LOW_SPEED_LIMIT, 1L);
    curl_easy_setopt(c, CURLOPT_LOW_SPEED_TIME, 60L);
    if (o->token != NULL) {
        char auth[AUTH_HEADER_MAX];
        snprintf(auth, sizeof(auth), "Authorization: Bearer %s", o->token);
        *hdrs = curl_slist_append(*hdrs, auth);
    }
    if (*hdrs != NULL)
        curl_easy_setopt(c, CURLOPT_HTTPHEADER, *hdrs);
    return c;
}

static void sleep_s(double s)
{
    struct timespec ts = {(time_t)s, (long)((s - floor(s)) * 1e9)};
    while (nanosleep(&ts, &ts) != 0 && errno == EINTR)
        ;
}

/* Backoff with jitter: 0.5, 1, 2, 4 ... seconds (capped at 30), +-25%. */
static double backoff(int attempt)
{
    double base = fmin(0.5 * pow(2, attempt), 30.0);
    return base * (0.75 + 0.5 * ((double)rand() / RAND_MAX));
}

/* An answer's {"error":{"code","message","tensor"}}, in its shown form (cli_untrusted.h): a server's
 * strings are printed only so. */
typedef struct server_error {
    int found;                  /* the answer has an error code */
    char code[72];
    char message[240];          /* "" when absent */
    char tensor[240];           /* "" when absent */
} server_error;

static void server_error_of(const response *r, server_error *se)
{
    cJSON *j = cJSON_ParseWithLength(r->body.p ? r->body.p : "", r->body.len);
    const cJSON *e = cJSON_GetObjectItemCaseSensitive(j, "error");
    const char *c = cJSON_GetStringValue(cJSON_GetObjectItemCaseSensitive(e, "code"));
    const char *m = cJSON_GetStringValue(cJSON_GetObjectItemCaseSensitive(e, "message"));
    const char *t = cJSON_GetStringValue(cJSON_GetObjectItemCaseSensitive(e, "tensor"));

    se->found = c != NULL;
    cli_untrusted_str(se->code, sizeof(se->code), c);
    cli_untrusted(se->message, sizeof(se->message), m ? m : "", m ? strlen(m) : 0);
    cli_untrusted(se->tensor, sizeof(se->tensor), t ? t : "", t ? strlen(t) : 0);
    cJSON_Delete(j);
}

static void print_server_error(const char *what, const response *r)
{
    server_error se;

    server_error_of(r, &se);
    if (se.found && se.tensor[0] != '\0')
        fprintf(stderr, "diloco: %s: HTTP %ld %s: %s (tensor \"%s\")\n", what, r->status, se.code, se.message,
                se.tensor);
    else if (se.found)
        fprintf(stderr, "diloco: %s: HTTP %ld %s: %s\n", what, r->status, se.code, se.message);
    else
        fprintf(stderr, "diloco: %s: HTTP %ld\n", what, r->status);
}

/* One line for a failed attempt: "HTTP 503 no_global: no global model yet" or curl's error text. */
static void describe_failure(CURLcode cc, const response *r, char *out, size_t size)
{
    server_error se;

    if (cc != CURLE_OK) {
        snprintf(out, size, "%s", curl_easy_strerror(cc));
        return;
    }
    server_error_of(r, &se);
    if (se.found)
        snprintf(out, size, "HTTP %ld %s: %s", r->status, se.code, se.message);
    else
        snprintf(out, size, "HTTP %ld", r->status);
}

/* GET path into r (memory), retrying connection errors and 5xx.  Returns 0 when an HTTP answer
 * (any status) arrived, else EXIT_NETWORK with a message printed. */
static int get(const client_opts *o, const char *path, response *r, const char *if_none_match, FILE *sink)
{
    char *url = url_of(o, path);
    int rc = EXIT_NETWORK;

    if (url == NULL)
        return EXIT_IO;
    for (int attempt = 0;; attempt++) {
        struct curl_slist *h = NULL;
        char inm[192];
        free(r->body.p);
        memset(&r->body, 0, sizeof(r->body));
        r->etag[0] = '\0';
        r->has_outer_step = 0;
        r->head_status = 0;
        r->has_content_length = 0;
        r->body_started = 0;
        r->refused = 0;
        r->sink = sink;
        if (r->guard != NULL)
            cli_body_reset(r->guard);
        if (sink != NULL && (fflush(sink) != 0 || ftruncate(fileno(sink), 0) != 0 || fseek(sink, 0, SEEK_SET) != 0)) {
            rc = EXIT_IO;
            break;
        }
        if (if_none_match != NULL && if_none_match[0]) {
            snprintf(inm, sizeof(inm), "If-None-Match: %s", if_none_match);
            h = curl_slist_append(h, inm);
        }
        CURL *c = easy(o, url, r, &h);
        CURLcode cc = c ? curl_easy_perform(c) : CURLE_OUT_OF_MEMORY;
        if (c)
            curl_easy_getinfo(c, CURLINFO_RESPONSE_CODE, &r->status);
        curl_easy_cleanup(c);
        curl_slist_free_all(h);
        if (r->refused) {
            /* a body past its bounds is the server's doing, not the network's: asking again gets the same */
            fprintf(stderr, "diloco: GET %s: %s\n", url, r->why);
            rc = EXIT_INVALID;
            break;
        }
        if (cc == CURLE_OK && r->status < 500) {
            rc = 0;
            break;
        }
        if (attempt >= o->retries) {
            if (cc != CURLE_OK)
                fprintf(stderr, "diloco: GET %s: %s\n", url, curl_easy_strerror(cc));
            else
                print_server_error(url, r);
            break;
        }
        /* say why we wait, as push does: the server's code (no_global...) or the network error */
        double wait = backoff(attempt);
        char why[400];
        describe_failure(cc, r, why, sizeof(why));
        fprintf(stderr, "diloco: GET %s: %s, retrying in %.1f s (%d of %d)\n", url, why, wait, attempt + 1,
                o->retries);
        sleep_s(wait);
    }
    free(url);
    return rc;
}

/* Strict numbers for options: a bad value is a usage error, never a silent 0. */
static int parse_count(const char *s, int max, int *out)
{
    char *end;
    errno = 0;
    long v = strtol(s, &end, 10);
    if (*s < '0' || *s > '9' || *end != '\0' || errno != 0 || v < 0 || v > max)
        return -1;
    *out = (int)v;
    return 0;
}

static int parse_seconds(const char *s, double *out)
{
    char *end;
    errno = 0;
    double v = strtod(s, &end);
    if (end == s || *end != '\0' || errno != 0 || !(v >= 0) || v > 1e7)
        return -1;
    *out = v;
    return 0;
}

static int bad_value(const char *opt, const char *v, const char *help)
{
    fprintf(stderr, "diloco: invalid value '%s' for %s\n%s", v, opt, help);
    return EXIT_USAGE;
}

/* Names what a command line lacks before the usage text, so a missing option is not a puzzle. */
static void usage_missing(int no_server, const char *missing, const char *unexpected)
{
    if (no_server)
        fprintf(stderr, "diloco: no server: give --server URL or set DILOCO_SERVER\n");
    if (missing != NULL)
        fprintf(stderr, "diloco: missing %s\n", missing);
    if (unexpected != NULL)
        fprintf(stderr, "diloco: unexpected argument '%s'\n", unexpected);
}

static void opts_defaults(client_opts *o)
{
    memset(o, 0, sizeof(*o));
    o->retries = 5;
    o->server = getenv("DILOCO_SERVER");
}

/* ---- push -------------------------------------------------------------------------------------- */

/* Token for node from a token file (lines "node_id token", "*" for any node). */
static char *token_for(const char *path, const char *node)
{
    FILE *f = fopen(path, "r");
    char line[1024], *found = NULL;

    if (f == NULL) {
        fprintf(stderr, "diloco: cannot open token file %s: %s\n", path, strerror(errno));
        return NULL;
    }
    while (fgets(line, sizeof(line), f) != NULL) {
        char *save = NULL, *id = strtok_r(line, " \t\r\n", &save), *tok = strtok_r(NULL, " \t\r\n", &save);
        if (id == NULL || id[0] == '#' || tok == NULL)
            continue;
        if (strcmp(id, node) == 0 || (strcmp(id, "*") == 0 && found == NULL)) {
            free(found);
            if ((found = strdup(tok)) == NULL) {
                fclose(f);
                fprintf(stderr, "diloco: out of memory reading %s\n", path);
                return NULL;
            }
            if (strcmp(id, node) == 0)
                break;
        }
    }
    fclose(f);
    if (found == NULL)
        fprintf(stderr, "diloco: %s has no token for node %s\n", path, node);
    return found;
}

static const char push_help[] =
    "usage: diloco push --server URL [--token-file F] [--retries N] [--timeout S] DELTA\n"
    "  Uploads DELTA to PUT /nodes/<node_id>/delta_<local_step>.safetensors, node id and step read from\n"
    "  the file's metadata (checked first: a file the server would refuse is not sent).  Streams the\n"
    "  file; retries connection errors and 5xx answers with backoff (never a 4xx); prints the answer.\n"
    "  An async dilocod's answer naming the local steps to train next (X-Recommended-Local-Steps, DyLU)\n"
    "  is printed with them as \"recommended_local_steps\": N.\n"
    "  A sharded delta (DELTA = delta_<local_step>.safetensors.index.json, as huggingface_hub writes it)\n"
    "  is checked as a set, then each shard is PUT to /nodes/<node_id>/delta_<n>-0000i-of-0000N.safetensors\n"
    "  and the index last to /nodes/<node_id>/delta_<n>.safetensors.index.json.\n"
    "  --server defaults to $DILOCO_SERVER; the token to $DILOCO_TOKEN when no token file is given.\n"
    "  exit: 0 accepted, 1 refused by the server or an invalid file, 2 usage, 3 I/O, 4 network/server\n";

/* Prints the server's answer to an upload in its shown form (cli_untrusted.h) on one line: the answer's
 * own final newline ends it, any other newline in it is a server's byte like the rest, shown escaped
 * (a line of its own could pass for ours).  When it carried X-Recommended-Local-Steps (an async
 * dilocod's DyLU: the local steps its next phase should train), a JSON object answer gets it as one more
 * member, "recommended_local_steps": N, spliced before its closing brace (the server's bytes otherwise). */
static void print_upload_answer(const response *r)
{
    const char *b = r->body.p ? r->body.p : "";
    size_t n = r->body.len;

    if (n > 0 && b[n - 1] == '\n')
        n--;
    if (r->recommended != 0) {
        cJSON *j = cJSON_ParseWithLength(b, n);
        size_t close = n;
        while (close > 0 && b[close - 1] != '}')
            close--;
        int object = cJSON_IsObject(j) && close > 0, members = object && j->child != NULL;
        cJSON_Delete(j);
        if (object) {
            cli_print_untrusted(stdout, b, close - 1);
            printf("%s\"recommended_local_steps\":%" PRIu64 "}", members ? "," : "", r->recommended);
            cli_print_untrusted(stdout, b + close, n - close);
            putchar('\n');
            return;
        }
        cli_print_untrusted(stdout, b, n);
        printf("%srecommended_local_steps=%" PRIu64 "\n", n > 0 ? "\n" : "", r->recommended);
        return;
    }
    cli_print_untrusted(stdout, b, n);
    if (r->body.len > 0)
        putchar('\n');
}

/* PUTs the file at path (size bytes) to upath, retrying connection errors and 5xx.  Prints the
 * server's answer.  Returns an exit code. */
static int put_file(const client_opts *o, const char *upath, const char *path, uint64_t size)
{
    char *url = url_of(o, upath);
    int rc = EXIT_NETWORK;

    if (url == NULL)
        return EXIT_IO;
    for (int attempt = 0;; attempt++) {
        response r = {.cap = MAX_ANSWER};
        struct curl_slist *h = curl_slist_append(NULL, "Content-Type: application/octet-stream");
        FILE *in = fopen(path, "rb");
        if (in == NULL) {
            fprintf(stderr, "diloco: cannot open %s: %s\n", path, strerror(errno));
            curl_slist_free_all(h);
            rc = EXIT_IO;
            break;
        }
        CURL *e = easy(o, url, &r, &h);
        CURLcode cc = CURLE_OUT_OF_MEMORY;
        if (e != NULL) {
            curl_easy_setopt(e, CURLOPT_UPLOAD, 1L);
            curl_easy_setopt(e, CURLOPT_READDATA, in);
            curl_easy_setopt(e, CURLOPT_INFILESIZE_LARGE, (curl_off_t)size);
            cc = curl_easy_perform(e);
            curl_easy_getinfo(e, CURLINFO_RESPONSE_CODE, &r.status);
        }
        curl_easy_cleanup(e);
        curl_slist_free_all(h);
        fclose(in);
        if (r.refused) {
            fprintf(stderr, "diloco: PUT %s: %s\n", url, r.why);
            free(r.body.p);
            rc = EXIT_INVALID;
            break;
        }
        if (cc == CURLE_OK && r.status >= 200 && r.status < 300) {
            print_upload_answer(&r);
            free(r.body.p);
            rc = EXIT_OK;
            break;
        }
        if (cc == CURLE_OK && r.status >= 400 && r.status < 500) {
            print_upload_answer(&r);
            print_server_error(url, &r);
            free(r.body.p);
            rc = EXIT_INVALID;
            break;
        }
        if (attempt >= o->retries) {
            if (cc != CURLE_OK)
                fprintf(stderr, "diloco: PUT %s: %s\n", url, curl_easy_strerror(cc));
            else
                print_server_error(url, &r);
            free(r.body.p);
            rc = EXIT_NETWORK;
            break;
        }
        double wait = backoff(attempt);
        char why[400];
        describe_failure(cc, &r, why, sizeof(why));
        free(r.body.p);
        fprintf(stderr, "diloco: PUT %s: %s, retrying in %.1f s (%d of %d)\n", url, why, wait, attempt + 1, o->retries);
        sleep_s(wait);
    }
    free(url);
    return rc;
}

/* Checks a delta (one file or a set) as the server will, against itself (the global lives on the
 * server).  On success *set is open and info filled. */
static int check_local_delta(const char *path, st_set **set, delta_info *info, dl_error *err)
{
    int rc = st_set_open(path, set, err);

    if (rc == 0)
        rc = delta_check_set_header(*set, (*set)->by_name, (*set)->ntensors, NULL, info, err);
    /* The delta was checked against itself, so the rules' message "expected F32 for a F64 weight"
     * would name the delta's own dtype as the global's: say what a delta may hold instead, and
     * leave the global's dtype to the server's answer. */
    if (rc != 0 && err->code == DL_E_DTYPE_MISMATCH && *set != NULL) {
        const st_tensor *t = st_set_find(*set, err->tensor, strlen(err->tensor), NULL);
        if (t != NULL)
            snprintf(err->message, sizeof(err->message),
                     "delta tensor has dtype %s; a delta tensor is F32, F16 or BF16 (C64 for a complex weight), "
                     "whatever the dtype of the global's weight",
                     st_dtype_name(t->dtype));
    }
    if (rc == 0 && (*set)->index != NULL) {
        /* the index names its shards by its base: the server's paths are delta_<local_step>-..., so
         * a set saved under another base would upload an index that names files it does not have */
        char want[40];
        snprintf(want, sizeof(want), "delta_%" PRIu64, info->local_step);
        if (strcmp((*set)->index->base, want) != 0)
            rc = dl_fail(err, DL_E_PATH_MISMATCH, NULL, 0,
                         "a sharded delta of local_step %" PRIu64 " is saved as %s" ST_INDEX_SUFFIX
                         " (filename_pattern=\"%s{suffix}.safetensors\"), not %s" ST_INDEX_SUFFIX,
                         info->local_step, want, want, (*set)->index->base);
    }
    if (rc != 0) {
        st_set_close(*set);
        *set = NULL;
    }
    return rc;
}

int cmd_push(int argc, char **argv)
{
    static const struct option opts[] = {{"server", required_argument, NULL, 's'},
                                         {"token-file", required_argument, NULL, 't'},
                                         {"retries", required_argument, NULL, 'r'},
                                         {"timeout", required_argument, NULL, 'T'},
                                         {"help", no_argument, NULL, 'h'},
                                         {NULL, 0, NULL, 0}};
    client_opts o;
    const char *token_file = NULL, *path;
    char *token = NULL, upath[400];
    st_set *set = NULL;
    delta_info info;
    dl_error err;
    int c, rc = EXIT_NETWORK;

    opts_defaults(&o);
    while ((c = getopt_long(argc, argv, "h", opts, NULL)) != -1) {
        switch (c) {
        case 's': o.server = optarg; break;
        case 't': token_file = optarg; break;
        case 'r': if (parse_count(optarg, 100, &o.retries) != 0) return bad_value("--retries", optarg, push_help); break;
        case 'T': if (parse_seconds(optarg, &o.timeout) != 0) return bad_value("--timeout", optarg, push_help); break;
        case 'h': fputs(push_help, stdout); return EXIT_OK;
        default: fputs(push_help, stderr); return EXIT_USAGE;
        }
    }
    if (o.server == NULL || optind != argc - 1 || o.retries < 0 || o.retries > 100) {
        usage_missing(o.server == NULL, optind >= argc ? "DELTA (the delta file to upload)" : NULL,
                      argc - optind > 1 ? argv[optind + 1] : NULL);
        fputs(push_help, stderr);
        return EXIT_USAGE;
    }
    path = argv[optind];
    dl_error_clear(&err);
    /* the delta's own header (or index) names it: check it as the server will, before sending a byte */
    if (check_local_delta(path, &set, &info, &err) != 0)
        return cli_report(path, &err);
    if (token_file != NULL) {
        if ((token = token_for(token_file, info.node_id)) == NULL) {
            st_set_close(set);
            return EXIT_USAGE;
        }
        o.token = token;
    } else {
        o.token = getenv("DILOCO_TOKEN");
    }
    if (set->index == NULL) {
        snprintf(upath, sizeof(upath), "/nodes/%s/delta_%" PRIu64 ".safetensors", info.node_id, info.local_step);
        rc = put_file(&o, upath, path, set->files[0]->file_size);
    } else {
        /* the shards first, the index last: the set is complete on the server when its index is in */
        rc = EXIT_OK;
        for (size_t i = 0; i < set->nfiles && rc == EXIT_OK; i++) {
            char name[ST_INDEX_BASE_MAX + 40];
            st_index_shard_name(set->index->base, (uint32_t)i, (uint32_t)set->nfiles, name, sizeof(name));
            snprintf(upath, sizeof(upath), "/nodes/%s/%s", info.node_id, name);
            rc = put_file(&o, upath, set->files[i]->path, set->files[i]->file_size);
        }
        if (rc == EXIT_OK) {
            struct stat sb;
            snprintf(upath, sizeof(upath), "/nodes/%s/%s" ST_INDEX_SUFFIX, info.node_id, set->index->base);
            if (stat(path, &sb) != 0) {
                fprintf(stderr, "diloco: cannot stat %s: %s\n", path, strerror(errno));
                rc = EXIT_IO;
            } else {
                rc = put_file(&o, upath, path, (uint64_t)sb.st_size);
            }
        }
    }
    st_set_close(set);
    free(token);
    return rc;
}

/* ---- pull -------------------------------------------------------------------------------------- */

static char *join(const char *dir, const char *name)
{
    char *p = NULL;
    if (asprintf(&p, "%s/%s", dir, name) < 0)
        return NULL;
    return p;
}

/* Removes from dir what another layout of "latest" left (the single file, or shards of another
 * count), after the new layout is in place. */
static void remove_other_layouts(const char *dir, uint32_t nshards)
{
    DIR *d = opendir(dir);
    struct dirent *de;

    if (d == NULL)
        return;
    while ((de = readdir(d)) != NULL) {
        char base[ST_INDEX_BASE_MAX + 1];
        uint32_t i, n;
        st_name_kind k = st_index_classify(de->d_name, strlen(de->d_name), base, &i, &n);
        if (strcmp(base, "latest") != 0 || k == ST_NAME_OTHER)
            continue;
        int stale = nshards == 1 ? (k == ST_NAME_INDEX || k == ST_NAME_SHARD)
                                 : (k == ST_NAME_SINGLE || (k == ST_NAME_SHARD && n != nshards));
        if (stale && unlinkat(dirfd(d), de->d_name, 0) != 0 && errno != ENOENT)
            fprintf(stderr, "diloco: cannot remove %s/%s: %s\n", dir, de->d_name, strerror(errno));
    }
    closedir(d);
}

/* A sharded global: the index (already in idx) names the shards; each is downloaded to a temporary
 * file, the set is checked as a whole, then the shards are renamed into place, the index written
 * last (atomically), and the step file after it: the same layout and order as the server's. */
static int pull_sharded(const client_opts *o, const char *dir, const response *idx, const char *stepfile,
                        const char *etagfile)
{
    st_index *ix = NULL;
    st_set *set = NULL;
    st_file **files = NULL;
    char **tmps = NULL, *index_path = join(dir, "latest" ST_INDEX_SUFFIX);
    response s = {.cap = MAX_ANSWER};
    uint32_t n = 0;
    uint64_t step;
    dl_error err;
    int rc;

    dl_error_clear(&err);
    if (index_path == NULL)
        return EXIT_IO;
    if (st_index_parse(idx->body.p ? idx->body.p : "", idx->body.len, "latest", &ix, &err) != 0) {
        rc = cli_report("the server's global/latest" ST_INDEX_SUFFIX, &err);
        goto out;
    }
    n = ix->nshards;
    files = calloc(n, sizeof(*files));
    tmps = calloc(n, sizeof(*tmps));
    if (files == NULL || tmps == NULL) {
        rc = EXIT_IO;
        goto out;
    }
    for (uint32_t i = 0; i < n; i++) {
        char name[ST_INDEX_BASE_MAX + 40], rpath[ST_INDEX_BASE_MAX + 48], *final = NULL;
        cli_body guard = {0};
        response r = {.cap = MAX_ANSWER, .guard = &guard};
        FILE *sink = NULL;
        int fd = -1;
        st_index_shard_name("latest", i, n, name, sizeof(name));
        snprintf(rpath, sizeof(rpath), "/global/%s", name);
        if ((final = join(dir, name)) == NULL || fsu_tmp_create(final, &tmps[i], &fd, &err) != 0 ||
            (sink = fdopen(fd, "wb")) == NULL) {
            if (err.code == DL_OK)
                dl_fail_errno(&err, errno, "cannot write to %s", dir);
            if (fd >= 0 && sink == NULL)
                close(fd);
            free(final);
            rc = cli_report(dir, &err);
            goto out;
        }
        free(final);
        rc = get(o, rpath, &r, NULL, sink);
        if (rc == 0 && r.status != 200) {
            print_server_error(rpath, &r);
            rc = EXIT_INVALID;
        }
        if (rc == 0 && (fflush(sink) != 0 || fsync(fileno(sink)) != 0)) {
            dl_fail_errno(&err, errno, "writing %s", tmps[i]);
            rc = cli_report(tmps[i], &err);
        }
        fclose(sink);
        free(r.body.p);
        cli_body_reset(&guard);
        if (rc != 0)
            goto out;
        if (st_open(tmps[i], &files[i], &err) != 0) {
            rc = cli_report(rpath, &err);
            goto out;
        }
    }
    /* assemble owns the index and the files from here, whatever it answers */
    rc = st_set_assemble(index_path, ix, files, &set, &err);
    ix = NULL;
    files = NULL;
    if (rc != 0) {
        rc = cli_report("downloaded global", &err);
        goto out;
    }
    if ((rc = get(o, "/global/step_count.json", &s, NULL, NULL)) != 0)
        goto out;
    if (s.status != 200 || stepcount_parse(s.body.p ? s.body.p : "", s.body.len, &step, NULL, NULL, &err) != 0) {
        fprintf(stderr, "diloco: the server's step_count.json is missing or invalid (HTTP %ld)\n", s.status);
        rc = EXIT_INVALID;
        goto out;
    }
    if (idx->has_outer_step && step != idx->outer_step) {
        fprintf(stderr, "diloco: the server moved from step %" PRIu64 " to %" PRIu64 " during the pull; retry\n",
                idx->outer_step, step);
        rc = EXIT_NETWORK;
        goto out;
    }
    for (uint32_t i = 0; i < n; i++) {
        char name[ST_INDEX_BASE_MAX + 40], *final;
        st_index_shard_name("latest", i, n, name, sizeof(name));
        if ((final = join(dir, name)) == NULL || rename(tmps[i], final) != 0) {
            dl_fail_errno(&err, errno, "replacing %s/%s", dir, name);
            free(final);
            rc = cli_report(dir, &err);
            goto out;
        }
        free(final);
        free(tmps[i]);
        tmps[i] = NULL;
    }
    if (fsu_fsync_parent(index_path, &err) != 0 ||
        fsu_write_atomic(index_path, idx->body.p, idx->body.len, &err) != 0 ||
        fsu_write_atomic(stepfile, s.body.p, s.body.len, &err) != 0 ||
        fsu_write_atomic(etagfile, idx->etag, strlen(idx->etag), &err) != 0) {
        rc = cli_report(dir, &err);
        goto out;
    }
    remove_other_layouts(dir, n);
    printf("step %" PRIu64 " downloaded (%u shards)\n", step, n);
    rc = EXIT_OK;
out:
    for (uint32_t i = 0; tmps != NULL && i < n; i++) {
        if (tmps[i] != NULL)
            unlink(tmps[i]);
        free(tmps[i]);
    }
    free(tmps);
    for (uint32_t i = 0; files != NULL && i < n; i++)
        st_close(files[i]);
    free(files);
    st_index_free(ix);
    st_set_close(set);
    free(index_path);
    free(s.body.p);
    return rc;
}

static const char pull_help[] =
    "usage: diloco pull --server URL -o DIR [--retries N] [--timeout S]\n"
    "  Downloads global/latest.safetensors and global/step_count.json into DIR when they changed\n"
    "  (If-None-Match with the ETag kept in DIR/.latest.etag), verifies the model, and replaces both\n"
    "  files atomically (the model first).  Prints the step.  exit: 0 ok, 1 the server sent an invalid\n"
    "  file or refused, 2 usage, 3 I/O, 4 network/server\n"
    "  A sharded global (no global/latest.safetensors, a global/latest.safetensors.index.json) is\n"
    "  written in the same layout: DIR/latest-0000i-of-0000N.safetensors, checked as one set, then\n"
    "  DIR/latest.safetensors.index.json, then DIR/step_count.json.\n";

int cmd_pull(int argc, char **argv)
{
    static const struct option opts[] = {{"server", required_argument, NULL, 's'},
                                         {"output", required_argument, NULL, 'o'},
                                         {"retries", required_argument, NULL, 'r'},
                                         {"timeout", required_argument, NULL, 'T'},
                                         {"help", no_argument, NULL, 'h'},
                                         {NULL, 0, NULL, 0}};
    client_opts o;
    const char *dir = NULL;
    char *model = NULL, *stepfile = NULL, *etagfile = NULL, *tmp = NULL;
    char etag[128] = "";
    cli_body guard = {0};
    response r = {.cap = MAX_ANSWER, .guard = &guard}, s = {.cap = MAX_ANSWER};
    dl_error err;
    int c, rc, fd = -1;
    FILE *sink = NULL;

    opts_defaults(&o);
    while ((c = getopt_long(argc, argv, "ho:", opts, NULL)) != -1) {
        switch (c) {
        case 's': o.server = optarg; break;
        case 'o': dir = optarg; break;
        case 'r': if (parse_count(optarg, 100, &o.retries) != 0) return bad_value("--retries", optarg, pull_help); break;
        case 'T': if (parse_seconds(optarg, &o.timeout) != 0) return bad_value("--timeout", optarg, pull_help); break;
        case 'h': fputs(pull_help, stdout); return EXIT_OK;
        default: fputs(pull_help, stderr); return EXIT_USAGE;
        }
    }
    if (o.server == NULL || dir == NULL || optind != argc) {
        usage_missing(o.server == NULL, dir == NULL ? "-o DIR (the directory to download the model into)" : NULL,
                      optind < argc ? argv[optind] : NULL);
        fputs(pull_help, stderr);
        return EXIT_USAGE;
    }
    dl_error_clear(&err);
    model = join(dir, "latest.safetensors");
    stepfile = join(dir, "step_count.json");
    etagfile = join(dir, ".latest.etag");
    if (!model || !stepfile || !etagfile || fsu_mkdirs(dir, &err) != 0) {
        rc = cli_report(dir, &err);
        goto out;
    }
    char *index_file = join(dir, "latest" ST_INDEX_SUFFIX);
    int have_model = access(model, R_OK) == 0 || (index_file != NULL && access(index_file, R_OK) == 0);
    free(index_file);
    if (have_model) {
        FILE *ef = fopen(etagfile, "r");
        if (ef != NULL) {
            if (fgets(etag, sizeof(etag), ef) == NULL)
                etag[0] = '\0';
            etag[strcspn(etag, "\r\n")] = '\0';
            fclose(ef);
        }
    }
    if (fsu_tmp_create(model, &tmp, &fd, &err) != 0 || (sink = fdopen(fd, "wb")) == NULL) {
        if (err.code == DL_OK)
            dl_fail_errno(&err, errno, "cannot write to %s", tmp ? tmp : dir);
        rc = cli_report(model, &err);
        goto out;
    }
    fd = -1;
    if ((rc = get(&o, "/global/latest.safetensors", &r, etag, sink)) != 0)
        goto out;
    if (r.status == 304) {
        printf("step %" PRIu64 " (unchanged)\n", r.outer_step);
        rc = EXIT_OK;
        goto out;
    }
    if (r.status == 404) {
        /* no single file: a global past the shard size is published as an index and its shards */
        response ix = {.cap = ST_INDEX_MAX_BYTES};
        if ((rc = get(&o, "/global/latest" ST_INDEX_SUFFIX, &ix, etag, NULL)) == 0) {
            if (ix.status == 304) {
                printf("step %" PRIu64 " (unchanged)\n", ix.outer_step);
                rc = EXIT_OK;
            } else if (ix.status == 200) {
                rc = pull_sharded(&o, dir, &ix, stepfile, etagfile);
            } else {
                print_server_error("GET /global/latest.safetensors", &r);
                rc = EXIT_INVALID;
            }
        }
        free(ix.body.p);
        goto out;
    }
    if (r.status != 200) {
        print_server_error("GET /global/latest.safetensors", &r);
        rc = EXIT_INVALID;
        goto out;
    }
    if (fflush(sink) != 0 || fsync(fileno(sink)) != 0) {
        dl_fail_errno(&err, errno, "writing %s", tmp);
        rc = cli_report(tmp, &err);
        goto out;
    }
    {
        st_file *check;
        if (st_open(tmp, &check, &err) != 0) {
            rc = cli_report("downloaded global", &err);
            goto out;
        }
        st_close(check);
    }
    if ((rc = get(&o, "/global/step_count.json", &s, NULL, NULL)) != 0)
        goto out;
    uint64_t step;
    if (s.status != 200 || stepcount_parse(s.body.p ? s.body.p : "", s.body.len, &step, NULL, NULL, &err) != 0) {
        fprintf(stderr, "diloco: the server's step_count.json is missing or invalid (HTTP %ld)\n", s.status);
        rc = EXIT_INVALID;
        goto out;
    }
    if (r.has_outer_step && step != r.outer_step) {
        /* a commit happened between the two requests: the next pull fetches the newer pair */
        fprintf(stderr, "diloco: the server moved from step %" PRIu64 " to %" PRIu64 " during the pull; retry\n",
                r.outer_step, step);
        rc = EXIT_NETWORK;
        goto out;
    }
    fclose(sink);
    sink = NULL;
    if (rename(tmp, model) != 0 || fsu_fsync_parent(model, &err) != 0 ||
        fsu_write_atomic(stepfile, s.body.p, s.body.len, &err) != 0 ||
        fsu_write_atomic(etagfile, r.etag, strlen(r.etag), &err) != 0) {
        if (err.code == DL_OK)
            dl_fail_errno(&err, errno, "replacing %s", model);
        rc = cli_report(dir, &err);
        goto out;
    }
    free(tmp);
    tmp = NULL;
    remove_other_layouts(dir, 1);
    printf("step %" PRIu64 " downloaded\n", step);
    rc = EXIT_OK;
out:
    if (sink != NULL)
        fclose(sink);
    if (fd >= 0)
        close(fd);
    if (tmp != NULL) {
        unlink(tmp);
        free(tmp);
    }
    free(model);
    free(stepfile);
    free(etagfile);
    free(r.body.p);
    free(s.body.p);
    cli_body_reset(&guard);
    return rc;
}

/* ---- status / wait ----------------------------------------------------------------------------- */

static cJSON *fetch_status(const client_opts *o, int *rc)
{
    response r = {0};
    cJSON *j = NULL;

    *rc = get(o, "/status", &r, NULL, NULL);
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
    if (have_global && cJSON_IsObject(round))
        print_round(round);
    else
        printf("round: none open until there is a global model\n");
    if (cJSON_IsObject(agg))
        printf("aggregating: %s%% after %s s\n", num_text(agg, "percent", "%.1f", a, sizeof(a)),
               num_text(agg, "seconds", "%.1f", b, sizeof(b)));
    if (cJSON_IsObject(last)) {
        const cJSON *nodes = cJSON_GetObjectItemCaseSensitive(last, "nodes");
        printf("last round: step %s -> %s, %d nodes, %s s (%s GB/s), closed by %s\n",
               num_text(last, "step", "%.0f", a, sizeof(a)), num_text(last, "outer_step", "%.0f", b, sizeof(b)),
               cJSON_GetArraySize(nodes), num_text(last, "seconds", "%.3f", c, sizeof(c)),
               num_text(last, "gbps", "%.2f", d, sizeof(d)), shown(last, "reason", &t));
        cJSON_ArrayForEach(e, nodes)
            printf("  %-24s norm %-12s cosine to mean %s\n", shown(e, "node_id", &t), num_text(e, "norm", "%.6g", a, sizeof(a)),
                   num_text(e, "cosine", "%.4f", b, sizeof(b)));
    } else {
        printf("last round: none closed yet\n");
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

static const char status_help[] =
    "usage: diloco status --server URL [--json] [--retries N]\n"
    "  A readable summary of dilocod's state: the step, the open round (which nodes delivered), the\n"
    "  last round (time, per-node norm and cosine to the mean), the hub.  --json prints /status as is.\n"
    "  --retries N: retries of connection errors and 5xx answers (default 2)\n";

int cmd_status(int argc, char **argv)
{
    static const struct option opts[] = {{"server", required_argument, NULL, 's'},
                                         {"json", no_argument, NULL, 'j'},
                                         {"retries", required_argument, NULL, 'r'},
                                         {"help", no_argument, NULL, 'h'},
                                         {NULL, 0, NULL, 0}};
    client_opts o;
    int c, json = 0, rc;
    cJSON *j;

    opts_defaults(&o);
    o.retries = 2;
    while ((c = getopt_long(argc, argv, "h", opts, NULL)) != -1) {
        switch (c) {
        case 's': o.server = optarg; break;
        case 'j': json = 1; break;
        case 'r': if (parse_count(optarg, 100, &o.retries) != 0) return bad_value("--retries", optarg, status_help); break;
        case 'h': fputs(status_help, stdout); return EXIT_OK;
        default: fputs(status_help, stderr); return EXIT_USAGE;
        }
    }
    if (o.server == NULL || optind != argc) {
        usage_missing(o.server == NULL, NULL, optind < argc ? argv[optind] : NULL);
        fputs(status_help, stderr);
        return EXIT_USAGE;
    }
    if ((j = fetch_status(&o, &rc)) == NULL)
        return rc;
    if (json) {
        /* cJSON escapes C0 in strings, not DEL, C1 or bytes that are not UTF-8 */
        char *t = cJSON_PrintUnformatted(j);
        cli_print_untrusted(stdout, t ? t : "null", t ? strlen(t) : 4);
        putchar('\n');
        cJSON_free(t);
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

    opts_defaults(&o);
    o.retries = 0;
    while ((c = getopt_long(argc, argv, "h", opts, NULL)) != -1) {
        switch (c) {
        case 's': o.server = optarg; break;
        case 'n': step_s = optarg; break;
        case 'T': if (parse_seconds(optarg, &timeout) != 0) return bad_value("--timeout", optarg, wait_help); break;
        case 'i': if (parse_seconds(optarg, &interval) != 0) return bad_value("--interval", optarg, wait_help); break;
        case 'h': fputs(wait_help, stdout); return EXIT_OK;
        default: fputs(wait_help, stderr); return EXIT_USAGE;
        }
    }
    if (o.server == NULL || step_s == NULL || optind != argc || delta_parse_int(step_s, strlen(step_s), &want) != 0 ||
        !(interval > 0) || timeout < 0) {
        usage_missing(o.server == NULL, step_s == NULL ? "--step N (the outer step to wait for)" : NULL,
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
        sleep_s(timeout > 0 ? fmin(interval, timeout - elapsed) : interval);
    }
}
