/* cmd_http.h: the HTTP client that diloco push, pull, status and wait share (cmd_http.c): the answer's
 * bounds, a curl easy handle, GET with retries, a server's errors shown, and the commands' option parsing.
 * Only the client's cmd_*.c files include it. */
#ifndef CMD_HTTP_H
#define CMD_HTTP_H

#include <stdint.h>
#include <stdio.h>

#include <curl/curl.h>

#include "cli_body.h"
#include "strbuf.h"

/* Caps of the answers kept in memory: a server answer over its cap is not one of dilocod's, and is
 * refused at its Content-Length, or at the first byte past the cap, without a retry. */
#define MAX_RESPONSE (16u << 20)        /* /status, the largest (every node of a round, async's nodes) */
#define MAX_ANSWER (64u << 10)          /* an upload's answer, step_count.json, an error's JSON */

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

typedef struct client_opts {
    const char *server;
    double timeout;
    int retries;
    const char *token;
} client_opts;

/* o->server + path (malloc'd, NULL: no memory). */
char *cli_url_of(const client_opts *o, const char *path);
/* An easy handle for url, its answer into r (bounded), the token's header in *hdrs (NULL: no memory). */
CURL *cli_easy(const client_opts *o, const char *url, response *r, struct curl_slist **hdrs);
void cli_sleep_s(double s);
/* Backoff with jitter: 0.5, 1, 2, 4 ... seconds (capped at 30), +-25%. */
double cli_backoff(int attempt);
/* "diloco: <what>: HTTP <status> <code>: <message> (tensor ...)" on stderr, the server's strings shown. */
void cli_print_server_error(const char *what, const response *r);
/* One line for a failed attempt: "HTTP 503 no_global: no global model yet" or curl's error text. */
void cli_describe_failure(CURLcode cc, const response *r, char *out, size_t size);
/* GET path into r (memory, or sink for a 2xx body), retrying connection errors and 5xx.  Returns 0 when an
 * HTTP answer (any status) arrived, else EXIT_NETWORK with a message printed. */
int cli_get(const client_opts *o, const char *path, response *r, const char *if_none_match, FILE *sink);
/* Strict numbers for options: a bad value is a usage error, never a silent 0. */
int cli_parse_count(const char *s, int max, int *out);
int cli_parse_seconds(const char *s, double *out);
int cli_bad_value(const char *opt, const char *v, const char *help);
/* Names what a command line lacks before the usage text, so a missing option is not a puzzle. */
void cli_usage_missing(int no_server, const char *missing, const char *unexpected);
void cli_opts_defaults(client_opts *o);

#endif
