/* libFuzzer target over the HTTP request path without sockets: bytes -> llhttp -> routing ->
 * handlers (status, metrics, global with Range/ETag, uploads with streaming validation into a
 * temporary state directory).  Each input is one connection; the loop runs until the request's work
 * (file writes, the upload's final step) is done, so handler code paths run to completion. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "config.h"
#include "api.h"
#include "daemon_internal.h"
#include "daemon_parts.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static dilocod *D;
static config CFG;

static void on_output(const char *p, size_t n, void *arg)
{
    (void)arg;
    /* every answer is an HTTP/1.1 response */
    if (n >= 5 && memcmp(p, "HTTP/", 5) != 0 && memcmp(p, "{", 1) != 0 && memcmp(p, "#", 1) != 0 &&
        memcmp(p, "\x08", 1) != 0 && memcmp(p, "\xa8", 1) != 0)
        (void)0;                /* bodies follow heads in separate calls: nothing to assert here */
}

static void setup(void)
{
    static char dir[] = "/tmp/dilocod-fuzz-XXXXXX";
    char global[256];
    dl_error err;
    char *argv[] = {"dilocod", "--state-root", dir, "--expected-nodes", "4096", "--listen", "none",
                    "--log-level", "error", NULL};
    uint64_t s2[] = {2, 3}, s1[] = {4};
    float w[6] = {1, 2, 3, 4, 5, 6};
    int64_t k[4] = {1, 2, 3, 4};
    st_spec specs[] = {{"w", 1, ST_F32, 2, s2}, {"k", 1, ST_I64, 1, s1}};
    const void *bufs[] = {w, k};

    if (mkdtemp(dir) == NULL || config_load(&CFG, 9, argv) != 0)
        abort();
    dl_log_set_level(DL_LOG_ERROR);
    D = calloc(1, sizeof(*D));
    D->cfg = &CFG;
    if (uv_loop_init(&D->loop) != 0 || store_open(&D->st, dir, "aggregator", &err) != 0)
        abort();
    job_owner_init(&D->jobs, &D->loop, NULL);   /* an upload's validation is a pool job (core/jobs.h) */
    snprintf(global, sizeof(global), "%s/aggregator/global/latest-0.safetensors", dir);
    store_commit_info info = {.step = 0, .global_path = global, .optimizer = "nesterov_sgd", .lr = 0.7,
                              .momentum = 0.9, .bootstrap = 1, .origin = "fuzz"};
    st_file *f;
    if (st_save(global, specs, bufs, 2, NULL, 0, &err) != 0 || store_commit(&D->st, &info, &err) != 0 ||
        st_open(global, &f, &err) != 0)
        abort();
    D->model = f->h;
    f->h = NULL;
    st_close(f);
    int gfd = open(global, O_RDONLY);
    if (gfd < 0 || (D->global.single.file = http_file_new(gfd)) == NULL)
        abort();
    D->global.single.size = 256;
    snprintf(D->global.single.etag, sizeof(D->global.single.etag), "\"s0-fuzz\"");
    D->global.available = 1;
    D->layout.nshards = 1;
    D->layout.step = -1;
    D->delta_bytes = 24;
    D->st.committed = 1;
    round_init(&D->rnd, 0, CFG.expected_nodes, NULL, 0, 1, 0);
    http_limits lim = {.max_url = 8192, .max_header_bytes = 4096, .max_headers = 50, .header_timeout = 10,
                       .idle_timeout = 60, .max_conns = 16};
    D->front = &api_front;      /* as main wires it */
    if (daemon__status_register(D) != 0 || http_server_fake(&D->http, &D->loop, &lim, api_on_request, D) != 0)
        abort();
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (D == NULL)
        setup();
    http_conn *c = http_conn_fake(D->http, on_output, NULL);
    if (c == NULL)
        return 0;
    /* Feed up to each end of a request head, then let the file operations it started (an upload's
     * open, writes) complete before the next bytes: the orders a real network produces. */
    const char *p = (const char *)data, *end = p + size;
    http_conn_ref(c);
    while (p < end && http_conn_alive(c)) {
        const char *cut = memmem(p, (size_t)(end - p), "\r\n\r\n", 4);
        size_t n = cut ? (size_t)(cut + 4 - p) : (size_t)(end - p);
        http_conn_feed(c, p, n);
        p += n;
        while (D->loop.active_reqs.count > 0) {
            uv_run(&D->loop, UV_RUN_NOWAIT);
            if (D->loop.active_reqs.count > 0)
                uv_sleep(0);
        }
    }
    if (http_conn_alive(c))
        http_conn_fake_eof(c);
    http_conn_unref(c);
    uv_run(&D->loop, UV_RUN_DEFAULT);
    /* keep rounds open and small: what one input accepted does not carry into the next */
    round_reset(&D->rnd, 0);
    return 0;
}
