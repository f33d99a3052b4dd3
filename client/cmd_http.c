/* diloco push / pull / status / wait: the worker's side of dilocod's HTTP API (libcurl).  This file is the
 * client they share (cmd_http.h); the commands are cmd_push.c, cmd_pull.c and cmd_status.c. */
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

#define AUTH_HEADER_MAX 320

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

char *cli_url_of(const client_opts *o, const char *path)
{
    char *u = NULL;
    size_t l = strlen(o->server);
    while (l > 0 && o->server[l - 1] == '/')
        l--;
    if (asprintf(&u, "%.*s%s", (int)l, o->server, path) < 0)
        return NULL;
    return u;
}

CURL *cli_easy(const client_opts *o, const char *url, response *r, struct curl_slist **hdrs)
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

void cli_sleep_s(double s)
{
    struct timespec ts = {(time_t)s, (long)((s - floor(s)) * 1e9)};
    while (nanosleep(&ts, &ts) != 0 && errno == EINTR)
        ;
}

/* Backoff with jitter: 0.5, 1, 2, 4 ... seconds (capped at 30), +-25%. */
double cli_backoff(int attempt)
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

void cli_print_server_error(const char *what, const response *r)
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
void cli_describe_failure(CURLcode cc, const response *r, char *out, size_t size)
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
int cli_get(const client_opts *o, const char *path, response *r, const char *if_none_match, FILE *sink)
{
    char *url = cli_url_of(o, path);
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
        CURL *c = cli_easy(o, url, r, &h);
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
                cli_print_server_error(url, r);
            break;
        }
        /* say why we wait, as push does: the server's code (no_global...) or the network error */
        double wait = cli_backoff(attempt);
        char why[400];
        cli_describe_failure(cc, r, why, sizeof(why));
        fprintf(stderr, "diloco: GET %s: %s, retrying in %.1f s (%d of %d)\n", url, why, wait, attempt + 1,
                o->retries);
        cli_sleep_s(wait);
    }
    free(url);
    return rc;
}

/* Strict numbers for options: a bad value is a usage error, never a silent 0. */
int cli_parse_count(const char *s, int max, int *out)
{
    char *end;
    errno = 0;
    long v = strtol(s, &end, 10);
    if (*s < '0' || *s > '9' || *end != '\0' || errno != 0 || v < 0 || v > max)
        return -1;
    *out = (int)v;
    return 0;
}

int cli_parse_seconds(const char *s, double *out)
{
    char *end;
    errno = 0;
    double v = strtod(s, &end);
    if (end == s || *end != '\0' || errno != 0 || !(v >= 0) || v > 1e7)
        return -1;
    *out = v;
    return 0;
}

int cli_bad_value(const char *opt, const char *v, const char *help)
{
    fprintf(stderr, "diloco: invalid value '%s' for %s\n%s", v, opt, help);
    return EXIT_USAGE;
}

/* Names what a command line lacks before the usage text, so a missing option is not a puzzle. */
void cli_usage_missing(int no_server, const char *missing, const char *unexpected)
{
    if (no_server)
        fprintf(stderr, "diloco: no server: give --server URL or set DILOCO_SERVER\n");
    if (missing != NULL)
        fprintf(stderr, "diloco: missing %s\n", missing);
    if (unexpected != NULL)
        fprintf(stderr, "diloco: unexpected argument '%s'\n", unexpected);
}

void cli_opts_defaults(client_opts *o)
{
    memset(o, 0, sizeof(*o));
    o->retries = 5;
    o->server = getenv("DILOCO_SERVER");
}
