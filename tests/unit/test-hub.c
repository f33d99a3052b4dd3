/* The transport interface (server/hub/hub.h): the scheme table, URL checks, the per-route request
 * counts, and the file:// transport driven through the interface alone on a real libuv loop, as
 * the daemon drives it (no daemon: the callbacks are recorded here). */
#include "test.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <uv.h>

#include "hub.h"
#include "round.h"

TEST(hub_scheme_table_and_url_checks)
{
    dl_error e;

    CHECK(hub_find("none") == NULL);
    CHECK(hub_find("file:///srv/hub") != NULL);
    CHECK_STR(hub_find("file:///srv/hub")->kind, "file");
    CHECK_STR(hub_find("hf://org/repo")->kind, "hf");
    CHECK_EQ(hub_check_url("none", &e), 0);
    CHECK_EQ(hub_check_url("file:///srv/hub", &e), 0);
    CHECK_EQ(hub_check_url("hf://org/repo", &e), 0);
    CHECK_EQ(hub_check_url("hf://org/repo@v1.2", &e), 0);
    static const char *const bad[] = {
        "file:///", "file://relative/dir", "hf://repo-without-namespace", "hf://a/b/c", "hf://org/re po",
        "hf://org/repo@", "ftp://host/x", "", "None", "hf:/org/repo",
    };
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        dl_error_clear(&e);
        CHECK_EQ(hub_check_url(bad[i], &e), -DL_E_INVALID_ARGUMENT);
        CHECK(e.message[0] != '\0');
    }
    /* an unknown scheme names the ones there are */
    CHECK_EQ(hub_check_url("ftp://host/x", &e), -DL_E_INVALID_ARGUMENT);
    CHECK(strstr(e.message, "file://") != NULL && strstr(e.message, "hf://") != NULL);
}

TEST(hub_counts_requests_by_route_and_code)
{
    static hub_status st;

    memset(&st, 0, sizeof(st));
    hub_count_call(&st, "revision", 200);
    hub_count_call(&st, "revision", 200);
    hub_count_call(&st, "revision", 401);
    hub_count_call(&st, "tree", 0);
    CHECK_EQ(st.ncalls, 3);
    CHECK_STR(st.calls[0].route, "revision");
    CHECK_EQ(st.calls[0].code, 200);
    CHECK_EQ(st.calls[0].count, 2);
    CHECK_EQ(st.calls[1].code, 401);
    CHECK_EQ(st.calls[2].code, 0);
    /* a full table never overflows: the rest is counted under the last row */
    for (int c = 0; c < 2 * HUB_MAX_CALL_ROWS; c++)
        hub_count_call(&st, "commit", 100 + c);
    CHECK_EQ(st.ncalls, HUB_MAX_CALL_ROWS);
    uint64_t total = 0;
    for (unsigned i = 0; i < st.ncalls; i++)
        total += st.calls[i].count;
    CHECK_EQ(total, 4 + 2 * HUB_MAX_CALL_ROWS);
}

TEST(round_peek_answers_what_offer_would_without_changing_anything)
{
    round_state r;
    delta_info in;
    char *replaced = NULL;

    round_init(&r, 3, 2, NULL, 0, 1, 0);
    memset(&in, 0, sizeof(in));
    snprintf(in.node_id, sizeof(in.node_id), "a");
    in.base_outer_step = 3;
    in.local_step = 5;
    CHECK_EQ(round_peek(&r, &in), ROUND_ACCEPTED);
    CHECK_EQ(r.n, 0);
    CHECK_EQ(r.counters.accepted, 0);
    CHECK_EQ(round_offer(&r, &in, strdup("p"), 1, 0, &replaced), ROUND_ACCEPTED);
    CHECK_EQ(round_peek(&r, &in), ROUND_NOT_NEWER);
    in.local_step = 6;
    CHECK_EQ(round_peek(&r, &in), ROUND_REPLACED);
    CHECK_EQ(round_find(&r, "a")->local_step, 5);
    in.base_outer_step = 2;
    CHECK_EQ(round_peek(&r, &in), ROUND_STALE);
    in.base_outer_step = 4;
    CHECK_EQ(round_peek(&r, &in), ROUND_FUTURE);
    CHECK_EQ(r.counters.stale + r.counters.future + r.counters.replaced + r.counters.not_newer, 0);
    round_free(&r);
}

/* ---- the file:// transport through the interface ------------------------------------------------ */

typedef struct events {
    int published_seen;
    int64_t published;
    int deltas;
    char last_rel[256], last_path[512];
    int root_given, owned;
    int publishes;
    char publish_error[256];
    int global_ready;
    uint64_t global_step;
    char global_path[512];
    int closed;
} events;

static void ev_delta(void *app, const hub_delta *d)
{
    events *ev = app;
    ev->deltas++;
    snprintf(ev->last_rel, sizeof(ev->last_rel), "%s", d->rel);
    snprintf(ev->last_path, sizeof(ev->last_path), "%s", d->path);
    ev->root_given = d->root != NULL;
    ev->owned = d->owned;
}

static void ev_published(void *app, int64_t step)
{
    events *ev = app;
    ev->published_seen++;
    ev->published = step;
}

static void ev_global(void *app, uint64_t step, const char *path)
{
    events *ev = app;
    ev->global_ready++;
    ev->global_step = step;
    snprintf(ev->global_path, sizeof(ev->global_path), "%s", path);
}

static void ev_publish_done(void *app, uint64_t step, const char *error)
{
    events *ev = app;
    (void)step;
    ev->publishes++;
    snprintf(ev->publish_error, sizeof(ev->publish_error), "%s", error ? error : "");
}

static void ev_closed(void *arg)
{
    ((events *)arg)->closed = 1;
}

static const hub_callbacks ev_cbs = {ev_delta, ev_published, ev_global, ev_publish_done};

static void tick_cb(uv_timer_t *t)
{
    (void)t;            /* only wakes the loop */
}

/* Runs the loop until *flag reaches want (10 s at most). */
static int run_until(uv_loop_t *loop, const int *flag, int want)
{
    uint64_t end = uv_now(loop) + 10000;
    uv_timer_t tick;

    uv_timer_init(loop, &tick);
    while (*flag < want && uv_now(loop) < end) {
        uv_timer_start(&tick, tick_cb, 20, 0);   /* wakes the loop to check */
        uv_run(loop, UV_RUN_ONCE);
        uv_update_time(loop);
    }
    uv_close((uv_handle_t *)&tick, NULL);
    uv_run(loop, UV_RUN_NOWAIT);
    return *flag >= want;
}

/* Runs the loop for ms milliseconds. */
static void run_for(uv_loop_t *loop, uint64_t ms)
{
    uint64_t end = uv_now(loop) + ms;
    uv_timer_t tick;

    uv_timer_init(loop, &tick);
    while (uv_now(loop) < end) {
        uv_timer_start(&tick, tick_cb, 20, 0);
        uv_run(loop, UV_RUN_ONCE);
        uv_update_time(loop);
    }
    uv_close((uv_handle_t *)&tick, NULL);
    uv_run(loop, UV_RUN_NOWAIT);
}

static int write_file(const char *path, const void *data, size_t len)
{
    FILE *f = fopen(path, "wb");
    if (f == NULL)
        return -1;
    int ok = fwrite(data, 1, len, f) == len;
    return fclose(f) == 0 && ok ? 0 : -1;
}

/* The smallest valid model: one F32 tensor "w" of one element. */
static int write_model(const char *path)
{
    const char hdr[] = "{\"w\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}}";
    unsigned char buf[8 + sizeof(hdr) - 1 + 4];
    uint64_t n = sizeof(hdr) - 1;

    for (int i = 0; i < 8; i++)
        buf[i] = (unsigned char)(n >> (8 * i));
    memcpy(buf + 8, hdr, n);
    memset(buf + 8 + n, 0, 4);
    return write_file(path, buf, sizeof(buf));
}

TEST(file_transport_through_the_interface)
{
    static events ev;
    uv_loop_t loop;
    hub *h = NULL;
    dl_error err;
    char root[512], url[600], state[512], p[700];

    memset(&ev, 0, sizeof(ev));
    snprintf(root, sizeof(root), "%s/tree", test_dir());
    snprintf(state, sizeof(state), "%s/state", test_dir());
    snprintf(url, sizeof(url), "file://%s", root);
    CHECK_EQ(uv_loop_init(&loop), 0);
    hub_config cfg = {.url = url, .state_dir = state, .poll_interval = 0.05};
    CHECK_EQ(hub_open(&h, &loop, &cfg, &ev_cbs, &ev, &err), 0);
    CHECK_STR(hub_kind(h), "file");
    /* open creates nothing in the tree (a start that fails after it leaves the tree as it was) */
    snprintf(p, sizeof(p), "%s/nodes", root);
    CHECK(access(p, F_OK) != 0);

    /* waiting for a global: start makes nodes/, the first poll says nothing is published */
    hub_set_step(h, 0, 1);
    hub_start(h);
    CHECK(access(p, F_OK) == 0);
    CHECK(run_until(&loop, &ev.published_seen, 1));
    CHECK_EQ(ev.published, -1);
    CHECK(hub_get_status(h)->last_poll != 0);

    /* a published global appears: it is copied into the state and handed over */
    snprintf(p, sizeof(p), "%s/global", root);
    CHECK_EQ(mkdir(p, 0755), 0);
    snprintf(p, sizeof(p), "%s/global/latest.safetensors", root);
    CHECK_EQ(write_model(p), 0);
    snprintf(p, sizeof(p), "%s/global/step_count.json", root);
    CHECK_EQ(write_file(p, "{\"outer_step\": 4}", 17), 0);
    CHECK(run_until(&loop, &ev.global_ready, 1));
    CHECK_EQ(ev.global_step, 4);
    CHECK(strncmp(ev.global_path, state, strlen(state)) == 0);
    CHECK(access(ev.global_path, R_OK) == 0);
    CHECK_EQ(ev.published, 4);

    /* collecting: a delta renamed into a node directory is handed over once, from the tree */
    hub_set_step(h, 4, 0);
    snprintf(p, sizeof(p), "%s/nodes/w1", root);
    CHECK_EQ(mkdir(p, 0755), 0);
    snprintf(p, sizeof(p), "%s/nodes/w1/delta_7.safetensors", root);
    CHECK_EQ(write_file(p, "0123456789", 10), 0);
    CHECK(run_until(&loop, &ev.deltas, 1));
    CHECK_STR(ev.last_rel, "nodes/w1/delta_7.safetensors");
    CHECK(ev.root_given && !ev.owned);
    struct stat sb;
    CHECK_EQ(stat(p, &sb), 0);
    hub_version v = {(uint64_t)sb.st_size, (int64_t)sb.st_mtim.tv_sec * 1000000000 + sb.st_mtim.tv_nsec,
                     (uint64_t)sb.st_ino};
    CHECK_EQ(hub_mark_done(h, ev.last_rel, HUB_TAKEN, &v), 0);
    /* taken: later scans do not hand the same version over again */
    int before = ev.deltas;
    run_for(&loop, 300);            /* several polls */
    CHECK_EQ(ev.deltas, before);

    /* publishing: latest.safetensors then step_count.json; done reported once, no error */
    snprintf(p, sizeof(p), "%s/mine.safetensors", test_dir());
    CHECK_EQ(write_model(p), 0);
    hub_publish(h, 5, p, "nesterov_sgd", 0);
    CHECK(run_until(&loop, &ev.publishes, 1));
    CHECK_STR(ev.publish_error, "");
    CHECK(hub_get_status(h)->last_publish != 0);
    snprintf(p, sizeof(p), "%s/global/step_count.json", root);
    FILE *f = fopen(p, "r");
    char text[256] = "";
    CHECK(f != NULL);
    CHECK(fread(text, 1, sizeof(text) - 1, f) > 0);
    fclose(f);
    CHECK(strstr(text, "\"outer_step\": 5") != NULL);
    /* our own publish is not reported back as a change */
    CHECK_EQ(ev.published, 4);

    hub_close(h, ev_closed, &ev);
    CHECK(run_until(&loop, &ev.closed, 1));
    uv_run(&loop, UV_RUN_DEFAULT);
    CHECK_EQ(uv_loop_close(&loop), 0);
}

TEST(file_transport_rejects_a_short_file_once_it_stops_changing)
{
    static events ev;
    uv_loop_t loop;
    hub *h = NULL;
    dl_error err;
    char root[512], url[600], state[512], p[700];

    memset(&ev, 0, sizeof(ev));
    snprintf(root, sizeof(root), "%s/tree", test_dir());
    snprintf(state, sizeof(state), "%s/state", test_dir());
    snprintf(url, sizeof(url), "file://%s", root);
    CHECK_EQ(uv_loop_init(&loop), 0);
    hub_config cfg = {.url = url, .state_dir = state, .poll_interval = 0.05};
    CHECK_EQ(hub_open(&h, &loop, &cfg, &ev_cbs, &ev, &err), 0);
    CHECK_EQ(mkdir(root, 0755), 0);
    snprintf(p, sizeof(p), "%s/nodes", root);
    CHECK_EQ(mkdir(p, 0755), 0);
    snprintf(p, sizeof(p), "%s/nodes/w1", root);
    CHECK_EQ(mkdir(p, 0755), 0);
    snprintf(p, sizeof(p), "%s/nodes/w1/delta_1.safetensors", root);
    CHECK_EQ(write_file(p, "short", 5), 0);
    hub_set_step(h, 0, 0);
    hub_start(h);
    CHECK(run_until(&loop, &ev.deltas, 1));
    /* intake says INCOMPLETE: not final while the file may still grow */
    CHECK_EQ(hub_mark_done(h, ev.last_rel, HUB_INCOMPLETE, NULL), 0);
    /* unchanged for the settle time (2 s at this poll interval): handed over once more, and that
     * INCOMPLETE is final */
    CHECK(run_until(&loop, &ev.deltas, 2));
    CHECK_EQ(hub_mark_done(h, ev.last_rel, HUB_INCOMPLETE, NULL), 1);
    hub_close(h, ev_closed, &ev);
    CHECK(run_until(&loop, &ev.closed, 1));
    uv_run(&loop, UV_RUN_DEFAULT);
    CHECK_EQ(uv_loop_close(&loop), 0);
}

TEST(file_transport_open_fails_cleanly)
{
    uv_loop_t loop;
    hub *h = (hub *)1;
    dl_error err;
    static events ev;
    char url[700], state[512], p[600];

    CHECK_EQ(uv_loop_init(&loop), 0);
    /* the tree's root is a file: it cannot be made a tree */
    snprintf(p, sizeof(p), "%s/afile", test_dir());
    CHECK_EQ(write_file(p, "x", 1), 0);
    snprintf(url, sizeof(url), "file://%s", p);
    snprintf(state, sizeof(state), "%s/state", test_dir());
    hub_config cfg = {.url = url, .state_dir = state, .poll_interval = 1};
    CHECK(hub_open(&h, &loop, &cfg, &ev_cbs, &ev, &err) != 0);
    CHECK(h == NULL);
    CHECK(err.message[0] != '\0');
    CHECK_EQ(uv_loop_close(&loop), 0);
}
