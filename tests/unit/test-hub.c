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
#include "hub_file.h"
#include "index_parse.h"
#include "remote.h"
#include "round.h"
#include "seen.h"
#include "st_index.h"
#include "stepcount.h"

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
    CHECK_EQ(round_offer(&r, &in, strdup("p"), 1, 0, 0, &replaced), ROUND_ACCEPTED);
    CHECK_EQ(round_peek(&r, &in), ROUND_NOT_NEWER);
    in.local_step = 6;
    CHECK_EQ(round_peek(&r, &in), ROUND_REPLACED);
    CHECK_EQ(round_find(&r, &in)->local_step, 5);
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
    index_parse *index;         /* the last set's, a reference of ours (released by fixture_close) */
} events;

static void ev_delta(void *app, const hub_delta *d)
{
    events *ev = app;
    ev->deltas++;
    snprintf(ev->last_rel, sizeof(ev->last_rel), "%s", d->rel);
    snprintf(ev->last_path, sizeof(ev->last_path), "%s", d->path);
    ev->root_given = d->root != NULL;
    ev->owned = d->owned;
    index_parse_release(ev->index);
    ev->index = index_parse_ref(d->index);
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
    /* a hub directory that does not exist is refused (without --create-hub), and nothing is made */
    CHECK_EQ(hub_open(&h, &loop, &cfg, &ev_cbs, &ev, &err), -DL_E_INVALID_ARGUMENT);
    CHECK(h == NULL);
    CHECK(strstr(err.message, "does not exist") != NULL && strstr(err.message, "--create-hub") != NULL);
    CHECK(access(root, F_OK) != 0);
    CHECK_EQ(mkdir(root, 0755), 0);
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
    /* written under a temporary name first: a scan that caught the file half-written would see a
     * version this test does not mark done */
    snprintf(p, sizeof(p), "%s/nodes/w1/.delta_7.tmp", root);
    CHECK_EQ(write_file(p, "0123456789", 10), 0);
    char final[700];
    snprintf(final, sizeof(final), "%s/nodes/w1/delta_7.safetensors", root);
    CHECK_EQ(rename(p, final), 0);
    snprintf(p, sizeof(p), "%s", final);
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
    CHECK_EQ(mkdir(root, 0755), 0);
    CHECK_EQ(hub_open(&h, &loop, &cfg, &ev_cbs, &ev, &err), 0);
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

/* ---- sharded checkpoints on file:// (hub.h, "Sharded checkpoints") ------------------------------ */

/* A one-tensor F32 shard: tensor name holding the value v, metadata {"format": "pt"} as
 * huggingface_hub writes its shards. */
static int write_shard(const char *path, const char *name, float v)
{
    char hdr[256];
    unsigned char buf[8 + sizeof(hdr) + 4];
    int n = snprintf(hdr, sizeof(hdr),
                     "{\"__metadata__\":{\"format\":\"pt\"},"
                     "\"%s\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}}",
                     name);

    if (n < 0 || (size_t)n >= sizeof(hdr))
        return -1;
    for (int i = 0; i < 8; i++)
        buf[i] = (unsigned char)((uint64_t)n >> (8 * i));
    memcpy(buf + 8, hdr, (size_t)n);
    memcpy(buf + 8 + n, &v, 4);
    /* under a temporary name first, as a worker's save: a scan that caught the shard half-written would
     * hand over a version of the set that the test does not mark done (a clean-clone make check saw it) */
    char tmp[1100];
    const char *slash = strrchr(path, '/');
    if (slash == NULL || snprintf(tmp, sizeof(tmp), "%.*s/.%s.tmp", (int)(slash - path), path, slash + 1) >=
                             (int)sizeof(tmp))
        return -1;
    if (write_file(tmp, buf, 8 + (size_t)n + 4) != 0)
        return -1;
    return rename(tmp, path);
}

/* The index of a set of base in dir with nshards shards, tensor t<i> in shard i; and the shards
 * themselves when with_shards. */
static int write_set(const char *dir, const char *base, unsigned nshards, int with_shards)
{
    char text[2048], path[1024];
    size_t off;

    off = (size_t)snprintf(text, sizeof(text),
                           "{\n  \"metadata\": {\n    \"total_size\": %u\n  },\n  \"weight_map\": {", 4 * nshards);
    for (unsigned i = 0; i < nshards; i++)
        off += (size_t)snprintf(text + off, sizeof(text) - off, "%s\n    \"t%u\": \"%s-%05u-of-%05u.safetensors\"",
                                i ? "," : "", i, base, i + 1, nshards);
    off += (size_t)snprintf(text + off, sizeof(text) - off, "\n  }\n}");
    for (unsigned i = 0; with_shards && i < nshards; i++) {
        char t[16];
        snprintf(t, sizeof(t), "t%u", i);
        snprintf(path, sizeof(path), "%s/%s-%05u-of-%05u.safetensors", dir, base, i + 1, nshards);
        if (write_shard(path, t, (float)i) != 0)
            return -1;
    }
    snprintf(path, sizeof(path), "%s/%s.safetensors.index.json", dir, base);
    return write_file(path, text, off);
}

static int shard_path(char *out, size_t size, const char *dir, const char *base, unsigned i, unsigned n)
{
    return snprintf(out, size, "%s/%s-%05u-of-%05u.safetensors", dir, base, i, n) < (int)size ? 0 : -1;
}

/* A transport on test_dir()/tree, collecting deltas of step 0 (or waiting for a global). */
typedef struct fixture {
    uv_loop_t loop;
    hub *h;
    char root[512], state[512], nodes[600];
} fixture;

static int fixture_open(fixture *fx, events *ev, double poll, int waiting)
{
    char url[600];
    dl_error err;

    memset(ev, 0, sizeof(*ev));
    snprintf(fx->root, sizeof(fx->root), "%s/tree", test_dir());
    snprintf(fx->state, sizeof(fx->state), "%s/state", test_dir());
    snprintf(fx->nodes, sizeof(fx->nodes), "%s/nodes/w1", fx->root);
    snprintf(url, sizeof(url), "file://%s", fx->root);
    if (uv_loop_init(&fx->loop) != 0 || mkdir(fx->root, 0755) != 0)
        return -1;
    if (mkdir(test_path("tree/nodes"), 0755) != 0 || mkdir(fx->nodes, 0755) != 0)
        return -1;
    hub_config cfg = {.url = url, .state_dir = fx->state, .poll_interval = poll};
    if (hub_open(&fx->h, &fx->loop, &cfg, &ev_cbs, ev, &err) != 0)
        return -1;
    hub_set_step(fx->h, 0, waiting);
    hub_start(fx->h);
    return run_until(&fx->loop, &ev->published_seen, 1) ? 0 : -1;
}

static int fixture_close(fixture *fx, events *ev)
{
    index_parse_release(ev->index);
    ev->index = NULL;
    hub_close(fx->h, ev_closed, ev);
    if (!run_until(&fx->loop, &ev->closed, 1))
        return -1;
    uv_run(&fx->loop, UV_RUN_DEFAULT);
    return uv_loop_close(&fx->loop);
}

static hub_version version_of(const char *path)
{
    struct stat sb;
    hub_version v = {0, 0, 0};

    if (stat(path, &sb) == 0) {
        v.size = (uint64_t)sb.st_size;
        v.mtime_ns = (int64_t)sb.st_mtim.tv_sec * 1000000000 + sb.st_mtim.tv_nsec;
        v.ino = (uint64_t)sb.st_ino;
    }
    return v;
}

TEST(file_transport_hands_over_a_set_once_complete_and_again_when_a_shard_changes)
{
    static events ev;
    static fixture fx;
    char p[1024], ix[1024];

    CHECK_EQ(fixture_open(&fx, &ev, 0.05, 0), 0);
    /* the index first (a worker may write it first), then the shards one by one: nothing is handed
     * over while a listed shard is missing, and the shards are never handed over alone */
    CHECK_EQ(write_set(fx.nodes, "delta_3", 3, 0), 0);
    run_for(&fx.loop, 300);
    CHECK_EQ(ev.deltas, 0);
    CHECK_EQ(shard_path(p, sizeof(p), fx.nodes, "delta_3", 1, 3), 0);
    CHECK_EQ(write_shard(p, "t0", 0), 0);
    CHECK_EQ(shard_path(p, sizeof(p), fx.nodes, "delta_3", 3, 3), 0);
    CHECK_EQ(write_shard(p, "t2", 2), 0);
    run_for(&fx.loop, 300);
    CHECK_EQ(ev.deltas, 0);
    /* the last shard: one hub_delta, the index's rel and path, from the tree */
    CHECK_EQ(shard_path(p, sizeof(p), fx.nodes, "delta_3", 2, 3), 0);
    CHECK_EQ(write_shard(p, "t1", 1), 0);
    CHECK(run_until(&fx.loop, &ev.deltas, 1));
    CHECK_EQ(ev.deltas, 1);
    CHECK_STR(ev.last_rel, "nodes/w1/delta_3.safetensors.index.json");
    snprintf(ix, sizeof(ix), "%s/delta_3.safetensors.index.json", fx.nodes);
    CHECK_STR(ev.last_path, ix);
    CHECK(ev.root_given && !ev.owned);
    hub_version v = version_of(ix);
    CHECK_EQ(hub_mark_done(fx.h, ev.last_rel, HUB_TAKEN, &v), 0);
    run_for(&fx.loop, 300);
    CHECK_EQ(ev.deltas, 1);
    /* a shard rewritten (the index unchanged): a new version of the set, taken again */
    CHECK_EQ(write_shard(p, "t1", 42), 0);
    CHECK_EQ(unlink(p), 0);
    CHECK_EQ(write_shard(p, "t1", 42), 0);      /* a new inode, as a worker's rename gives */
    CHECK(run_until(&fx.loop, &ev.deltas, 2));
    CHECK_STR(ev.last_rel, "nodes/w1/delta_3.safetensors.index.json");
    /* still short for intake (a shard being written): retried as a set changes, like a file */
    CHECK_EQ(hub_mark_done(fx.h, ev.last_rel, HUB_INCOMPLETE, NULL), 0);
    CHECK_EQ(fixture_close(&fx, &ev), 0);
}

TEST(file_transport_a_shard_arriving_in_a_watched_directory_completes_the_set)
{
    static events ev;
    static fixture fx;
    char p[1024];

    /* a poll interval far beyond the test: only the node directory's inotify watch can trigger the
     * scan that finds the last shard */
    CHECK_EQ(fixture_open(&fx, &ev, 3600, 0), 0);
    CHECK_EQ(write_set(fx.nodes, "delta_9", 2, 0), 0);
    CHECK_EQ(shard_path(p, sizeof(p), fx.nodes, "delta_9", 1, 2), 0);
    CHECK_EQ(write_shard(p, "t0", 0), 0);
    run_for(&fx.loop, 200);
    CHECK_EQ(ev.deltas, 0);
    CHECK_EQ(shard_path(p, sizeof(p), fx.nodes, "delta_9", 2, 2), 0);
    CHECK_EQ(write_shard(p, "t1", 1), 0);
    CHECK(run_until(&fx.loop, &ev.deltas, 1));
    CHECK_STR(ev.last_rel, "nodes/w1/delta_9.safetensors.index.json");
    CHECK_EQ(fixture_close(&fx, &ev), 0);
}

TEST(file_transport_hands_over_an_index_that_does_not_parse_once_it_has_settled)
{
    static events ev;
    static fixture fx;
    char p[1024];

    CHECK_EQ(fixture_open(&fx, &ev, 0.05, 0), 0);
    /* what a scan may meet while json.dump is still writing: not refused at once */
    snprintf(p, sizeof(p), "%s/delta_4.safetensors.index.json", fx.nodes);
    CHECK_EQ(write_file(p, "{\"metadata\": {\"total_", 21), 0);
    run_for(&fx.loop, 300);
    CHECK_EQ(ev.deltas, 0);
    /* unchanged for the settle time: handed over, for intake to say why it is refused, once */
    CHECK(run_until(&fx.loop, &ev.deltas, 1));
    CHECK_STR(ev.last_rel, "nodes/w1/delta_4.safetensors.index.json");
    hub_version v = version_of(p);
    CHECK_EQ(hub_mark_done(fx.h, ev.last_rel, HUB_INVALID, &v), 0);
    run_for(&fx.loop, 300);
    CHECK_EQ(ev.deltas, 1);
    CHECK_EQ(fixture_close(&fx, &ev), 0);
}

/* The whole text of path into buf (NUL-terminated); 0 or -1. */
static int read_text(const char *path, char *buf, size_t size)
{
    FILE *f = fopen(path, "r");
    size_t n;

    if (f == NULL)
        return -1;
    n = fread(buf, 1, size - 1, f);
    buf[n] = '\0';
    fclose(f);
    return 0;
}

static int64_t mtime_of(const char *path)
{
    return version_of(path).mtime_ns;
}

TEST(file_transport_publishes_a_sharded_global_and_switches_layouts_both_ways)
{
    static events ev;
    static fixture fx;
    char src[1024], p[1024], g[700], text[1024];

    CHECK_EQ(fixture_open(&fx, &ev, 0.05, 0), 0);
    snprintf(g, sizeof(g), "%s/global", fx.root);
    /* a plain global first */
    snprintf(src, sizeof(src), "%s/plain.safetensors", test_dir());
    CHECK_EQ(write_model(src), 0);
    hub_publish(fx.h, 1, src, "nesterov_sgd", 0);
    CHECK(run_until(&fx.loop, &ev.publishes, 1));
    CHECK_STR(ev.publish_error, "");

    /* sharded, 2 shards: shards, then the index, then step_count.json naming the index; the plain
     * file goes */
    CHECK_EQ(mkdir(test_path("set2"), 0755), 0);
    CHECK_EQ(write_set(test_path("set2"), "latest", 2, 1), 0);
    snprintf(src, sizeof(src), "%s/set2/latest.safetensors.index.json", test_dir());
    hub_publish(fx.h, 2, src, "nesterov_sgd", 0);
    CHECK(run_until(&fx.loop, &ev.publishes, 2));
    CHECK_STR(ev.publish_error, "");
    snprintf(p, sizeof(p), "%s/latest.safetensors", g);
    CHECK(access(p, F_OK) != 0);
    snprintf(p, sizeof(p), "%s/step_count.json", g);
    CHECK_EQ(read_text(p, text, sizeof(text)), 0);
    CHECK(strstr(text, "\"outer_step\": 2") != NULL);
    CHECK(strstr(text, "\"model_file\": \"global/latest.safetensors.index.json\"") != NULL);
    int64_t step_t = mtime_of(p);
    snprintf(p, sizeof(p), "%s/latest.safetensors.index.json", g);
    CHECK(access(p, R_OK) == 0);
    int64_t index_t = mtime_of(p);
    CHECK(index_t <= step_t);
    for (unsigned i = 1; i <= 2; i++) {
        CHECK_EQ(shard_path(p, sizeof(p), g, "latest", i, 2), 0);
        CHECK(access(p, R_OK) == 0);
        CHECK(mtime_of(p) <= index_t);
    }
    /* byte for byte what was handed over */
    char a[1024], b[1024];
    snprintf(p, sizeof(p), "%s/latest.safetensors.index.json", g);
    CHECK_EQ(read_text(src, a, sizeof(a)), 0);
    CHECK_EQ(read_text(p, b, sizeof(b)), 0);
    CHECK_STR(a, b);

    /* 3 shards: the 2-shard files go */
    CHECK_EQ(mkdir(test_path("set3"), 0755), 0);
    CHECK_EQ(write_set(test_path("set3"), "latest", 3, 1), 0);
    snprintf(src, sizeof(src), "%s/set3/latest.safetensors.index.json", test_dir());
    hub_publish(fx.h, 3, src, "nesterov_sgd", 0);
    CHECK(run_until(&fx.loop, &ev.publishes, 3));
    CHECK_STR(ev.publish_error, "");
    for (unsigned i = 1; i <= 3; i++) {
        CHECK_EQ(shard_path(p, sizeof(p), g, "latest", i, 3), 0);
        CHECK(access(p, R_OK) == 0);
    }
    for (unsigned i = 1; i <= 2; i++) {
        CHECK_EQ(shard_path(p, sizeof(p), g, "latest", i, 2), 0);
        CHECK(access(p, F_OK) != 0);
    }

    /* plain again: the index and every shard go, step_count.json names the file */
    snprintf(src, sizeof(src), "%s/plain.safetensors", test_dir());
    hub_publish(fx.h, 4, src, "nesterov_sgd", 0);
    CHECK(run_until(&fx.loop, &ev.publishes, 4));
    CHECK_STR(ev.publish_error, "");
    snprintf(p, sizeof(p), "%s/latest.safetensors", g);
    CHECK(access(p, R_OK) == 0);
    snprintf(p, sizeof(p), "%s/latest.safetensors.index.json", g);
    CHECK(access(p, F_OK) != 0);
    for (unsigned i = 1; i <= 3; i++) {
        CHECK_EQ(shard_path(p, sizeof(p), g, "latest", i, 3), 0);
        CHECK(access(p, F_OK) != 0);
    }
    snprintf(p, sizeof(p), "%s/step_count.json", g);
    CHECK_EQ(read_text(p, text, sizeof(text)), 0);
    CHECK(strstr(text, "\"model_file\": \"global/latest.safetensors\"") != NULL);
    CHECK(strstr(text, "\"outer_step\": 4") != NULL);

    /* an index of another base names shards that would not be published under latest-*: refused */
    CHECK_EQ(mkdir(test_path("other"), 0755), 0);
    CHECK_EQ(write_set(test_path("other"), "model", 2, 1), 0);
    snprintf(src, sizeof(src), "%s/other/model.safetensors.index.json", test_dir());
    hub_publish(fx.h, 5, src, "nesterov_sgd", 0);
    CHECK(run_until(&fx.loop, &ev.publishes, 5));
    CHECK(ev.publish_error[0] != '\0');
    snprintf(p, sizeof(p), "%s/step_count.json", g);
    CHECK_EQ(read_text(p, text, sizeof(text)), 0);
    CHECK(strstr(text, "\"outer_step\": 4") != NULL);
    CHECK_EQ(fixture_close(&fx, &ev), 0);
}

TEST(file_transport_copies_a_held_sharded_global_into_a_directory_of_its_own)
{
    static events ev;
    static fixture fx;
    char g[700], p[1024];

    CHECK_EQ(fixture_open(&fx, &ev, 0.05, 1), 0);
    CHECK_EQ(ev.published, -1);
    snprintf(g, sizeof(g), "%s/global", fx.root);
    CHECK_EQ(mkdir(g, 0755), 0);
    CHECK_EQ(write_set(g, "latest", 2, 1), 0);
    char *text = stepcount_build(7, "nesterov_sgd", 0, 1, NULL);
    CHECK(text != NULL);
    snprintf(p, sizeof(p), "%s/step_count.json", g);
    int wrc = write_file(p, text, strlen(text));
    free(text);
    CHECK_EQ(wrc, 0);
    CHECK(run_until(&fx.loop, &ev.global_ready, 1));
    CHECK_EQ(ev.global_step, 7);
    CHECK_EQ(ev.published, 7);
    /* the index, in a directory of its own in the state, next to its shards */
    CHECK(strncmp(ev.global_path, fx.state, strlen(fx.state)) == 0);
    const char *name = strrchr(ev.global_path, '/');
    CHECK(name != NULL);
    CHECK_STR(name, "/latest.safetensors.index.json");
    st_set *set = NULL;
    dl_error err;
    CHECK_EQ(st_set_open(ev.global_path, &set, &err), 0);
    CHECK_EQ(set->nfiles, 2);
    CHECK_EQ(set->ntensors, 2);
    st_set_close(set);
    CHECK_EQ(fixture_close(&fx, &ev), 0);
}

TEST(file_transport_refuses_to_adopt_an_inconsistent_sharded_global)
{
    static events ev;
    static fixture fx;
    char g[700], p[1024];

    CHECK_EQ(fixture_open(&fx, &ev, 0.05, 1), 0);
    snprintf(g, sizeof(g), "%s/global", fx.root);
    CHECK_EQ(mkdir(g, 0755), 0);
    CHECK_EQ(write_set(g, "latest", 2, 1), 0);
    /* shard 2 holds a tensor the index puts nowhere */
    CHECK_EQ(shard_path(p, sizeof(p), g, "latest", 2, 2), 0);
    CHECK_EQ(write_shard(p, "stranger", 1), 0);
    char *text = stepcount_build(7, "nesterov_sgd", 0, 1, NULL);
    CHECK(text != NULL);
    snprintf(p, sizeof(p), "%s/step_count.json", g);
    int wrc = write_file(p, text, strlen(text));
    free(text);
    CHECK_EQ(wrc, 0);
    CHECK(run_until(&fx.loop, &ev.published_seen, 2));
    CHECK_EQ(ev.published, 7);
    run_for(&fx.loop, 300);
    CHECK_EQ(ev.global_ready, 0);
    CHECK(strstr(hub_get_status(fx.h)->last_error, "adopt") != NULL);
    /* and no copy is left behind once the attempts have stopped */
    CHECK_EQ(fixture_close(&fx, &ev), 0);
    snprintf(p, sizeof(p), "%s/cache/incoming/file-global-7", fx.state);
    CHECK(access(p, F_OK) != 0);
}

/* Runs the loop until path is gone (or 10 s). */
static int run_until_gone(uv_loop_t *loop, const char *path)
{
    for (int i = 0; i < 200 && access(path, F_OK) == 0; i++)
        run_for(loop, 50);
    return access(path, F_OK) != 0;
}

TEST(file_transport_prunes_a_set_only_as_it_was_taken_in)
{
    static events ev;
    static fixture fx;
    char p[1024], ix[1024];

    CHECK_EQ(fixture_open(&fx, &ev, 0.05, 0), 0);
    CHECK(hub_can_prune(fx.h));
    /* a set taken in, then pruned: the index and its shards go, nothing else */
    CHECK_EQ(write_set(fx.nodes, "delta_5", 2, 1), 0);
    snprintf(p, sizeof(p), "%s/delta_7.safetensors", fx.nodes);
    CHECK_EQ(write_model(p), 0);
    CHECK(run_until(&fx.loop, &ev.deltas, 2));
    snprintf(ix, sizeof(ix), "%s/delta_5.safetensors.index.json", fx.nodes);
    hub_version v = version_of(ix);
    CHECK_EQ(hub_mark_done(fx.h, "nodes/w1/delta_5.safetensors.index.json", HUB_TAKEN, &v), 0);
    hub_prune(fx.h, "nodes/w1/delta_5.safetensors.index.json");
    CHECK(run_until_gone(&fx.loop, ix));
    for (unsigned i = 1; i <= 2; i++) {
        CHECK_EQ(shard_path(p, sizeof(p), fx.nodes, "delta_5", i, 2), 0);
        CHECK(run_until_gone(&fx.loop, p));
    }
    snprintf(p, sizeof(p), "%s/delta_7.safetensors", fx.nodes);
    CHECK(access(p, R_OK) == 0);

    /* a set taken in, then a shard rewritten by its worker: the set stays */
    CHECK_EQ(write_set(fx.nodes, "delta_6", 2, 1), 0);
    CHECK(run_until(&fx.loop, &ev.deltas, 3));
    CHECK_STR(ev.last_rel, "nodes/w1/delta_6.safetensors.index.json");
    snprintf(ix, sizeof(ix), "%s/delta_6.safetensors.index.json", fx.nodes);
    v = version_of(ix);
    CHECK_EQ(hub_mark_done(fx.h, ev.last_rel, HUB_TAKEN, &v), 0);
    CHECK_EQ(shard_path(p, sizeof(p), fx.nodes, "delta_6", 2, 2), 0);
    CHECK_EQ(unlink(p), 0);
    CHECK_EQ(write_shard(p, "t1", 5), 0);
    hub_prune(fx.h, "nodes/w1/delta_6.safetensors.index.json");
    run_for(&fx.loop, 300);
    CHECK(access(ix, R_OK) == 0);
    CHECK(access(p, R_OK) == 0);
    CHECK_EQ(fixture_close(&fx, &ev), 0);
}

TEST(file_transport_parses_an_index_once_per_version_and_hands_the_parse_over)
{
    static events ev;
    static fixture fx;
    char p[1024], ix[1024];

    CHECK_EQ(fixture_open(&fx, &ev, 0.05, 0), 0);
    CHECK_EQ(write_set(fx.nodes, "delta_3", 2, 1), 0);
    CHECK(run_until(&fx.loop, &ev.deltas, 1));
    /* the scan's parse goes with the set, for intake */
    CHECK(ev.index != NULL && ev.index->status == INDEX_PARSED && ev.index->ix != NULL);
    CHECK_EQ(ev.index->nshards, 2);
    CHECK_EQ(hub_get_status(fx.h)->index_parses, 1);
    index_parse *first = index_parse_ref(ev.index);
    CHECK_EQ(hub_mark_done(fx.h, ev.last_rel, HUB_INVALID, NULL), 0);
    /* a shard rewritten, the index unchanged: the set again, with the same parse; scans go on and
     * nothing is read again */
    CHECK_EQ(shard_path(p, sizeof(p), fx.nodes, "delta_3", 1, 2), 0);
    CHECK_EQ(unlink(p), 0);
    CHECK_EQ(write_shard(p, "t0", 7), 0);
    CHECK(run_until(&fx.loop, &ev.deltas, 2));
    CHECK(ev.index == first);
    CHECK_EQ(hub_mark_done(fx.h, ev.last_rel, HUB_INVALID, NULL), 0);
    run_for(&fx.loop, 300);
    CHECK_EQ(ev.deltas, 2);
    CHECK_EQ(hub_get_status(fx.h)->index_parses, 1);
    /* an older set of the same node: its verdict only, the parse is kept for the newest set alone */
    CHECK_EQ(write_set(fx.nodes, "delta_2", 2, 1), 0);
    CHECK(run_until(&fx.loop, &ev.deltas, 3));
    CHECK_STR(ev.last_rel, "nodes/w1/delta_2.safetensors.index.json");
    CHECK(ev.index != NULL && ev.index->status == INDEX_PARSED && ev.index->ix == NULL);
    CHECK_EQ(ev.index->nshards, 2);
    CHECK_EQ(hub_get_status(fx.h)->index_parses, 2);
    CHECK_EQ(hub_mark_done(fx.h, ev.last_rel, HUB_INVALID, NULL), 0);
    /* delta_3's index replaced (a new file): parsed again, and that parse is handed over */
    snprintf(ix, sizeof(ix), "%s/delta_3.safetensors.index.json", fx.nodes);
    CHECK_EQ(unlink(ix), 0);
    CHECK_EQ(write_set(fx.nodes, "delta_3", 2, 0), 0);
    CHECK(run_until(&fx.loop, &ev.deltas, 4));
    CHECK_STR(ev.last_rel, "nodes/w1/delta_3.safetensors.index.json");
    CHECK(ev.index != first && ev.index->ix != NULL);
    CHECK(hub_get_status(fx.h)->index_parses >= 3);
    index_parse_release(first);
    CHECK_EQ(fixture_close(&fx, &ev), 0);
}

/* hub/remote.c's seen list, on a real loop: decisions are appended once, a restart loads them done,
 * the daemon's verdict settles the pending versions of a path only, and an overlong line in the file
 * is skipped whole. */
/* The deltas of node "a" a scan lists, in its order, into steps (returns how many; -1 on failure), and
 * the node directory's waiting count. */
static int scan_steps(const char *root, const hub_scan_opts *opts, uint64_t *steps, size_t max, uint64_t *waiting)
{
    hub_candidate *c = NULL;
    size_t n = 0, parses, k = 0;
    dl_error e;

    if (hubfile_scan(root, NULL, 0, opts, &c, &n, &parses, &e) != 0)
        return -1;
    for (size_t i = 0; i < n; i++) {
        if (c[i].node_dir)
            *waiting = c[i].waiting;
        else if (c[i].refused == NULL && k < max)
            steps[k++] = c[i].local_step;
    }
    hub_candidates_free(c, n);
    return (int)k;
}

/* Sync mode lists a node's newest deltas; async mode its lowest from the resume point, in local-step
 * order, and counts the ones left for a later scan. */
TEST(file_scan_lists_a_node_newest_in_sync_and_in_local_step_order_in_async)
{
    char root[] = "/tmp/dilocod-test-scan-XXXXXX", path[256];
    uint64_t steps[64], waiting = 0;

    CHECK(mkdtemp(root) != NULL);
    snprintf(path, sizeof(path), "%s/nodes", root);
    CHECK_EQ(mkdir(path, 0755), 0);
    snprintf(path, sizeof(path), "%s/nodes/a", root);
    CHECK_EQ(mkdir(path, 0755), 0);
    for (int i = 1; i <= 30; i++) {
        snprintf(path, sizeof(path), "%s/nodes/a/delta_%d.safetensors", root, i);
        CHECK_EQ(write_model(path), 0);
    }
    int n = scan_steps(root, NULL, steps, 64, &waiting);
    CHECK_EQ(n, HUBFILE_DELTAS_PER_NODE);
    uint64_t lo = UINT64_MAX;
    for (int i = 0; i < n; i++)
        lo = steps[i] < lo ? steps[i] : lo;
    CHECK_EQ(lo, 15u);                          /* the 16 newest: 15..30 */
    hub_scan_opts async = {.async = 1};
    n = scan_steps(root, &async, steps, 64, &waiting);
    CHECK_EQ(n, HUBFILE_DELTAS_PER_NODE);
    for (int i = 0; i < n; i++)
        CHECK_EQ(steps[i], (uint64_t)(i + 1));  /* 1..16, ascending */
    CHECK_EQ(waiting, 14u);
    hub_resume r = {.node = "a", .from = 10};
    hub_scan_opts resumed = {.async = 1, .resume = &r, .nresume = 1};
    n = scan_steps(root, &resumed, steps, 64, &waiting);
    CHECK_EQ(n, HUBFILE_DELTAS_PER_NODE);
    for (int i = 0; i < n; i++)
        CHECK_EQ(steps[i], (uint64_t)(i + 10)); /* 10..25 */
    CHECK_EQ(waiting, 5u);
    r.from = 28;
    n = scan_steps(root, &resumed, steps, 64, &waiting);
    CHECK_EQ(n, 3);
    CHECK_EQ(waiting, 0u);
    for (int i = 1; i <= 30; i++) {
        snprintf(path, sizeof(path), "%s/nodes/a/delta_%d.safetensors", root, i);
        unlink(path);
    }
    snprintf(path, sizeof(path), "%s/nodes/a", root);
    rmdir(path);
    snprintf(path, sizeof(path), "%s/nodes", root);
    rmdir(path);
    rmdir(root);
}

TEST(remote_seen_list_persists_what_is_decided)
{
    static char path[400];
    uv_loop_t loop;
    remote_seen s;
    int created;
    FILE *f;

    snprintf(path, sizeof(path), "%s/seen.tsv", test_dir());
    CHECK((f = fopen(path, "w")) != NULL);
    fprintf(f, "nodes/a/delta_1.safetensors\tv1\n");
    for (int i = 0; i < 3000; i++)
        fputc('x', f);
    fprintf(f, "\tlong\nno-tab-line\nnodes/b/delta_1.safetensors\tv9\n");
    fclose(f);
    CHECK_EQ(uv_loop_init(&loop), 0);
    remote_seen_open(&s, &loop, path);
    remote_refs refs = {0};     /* the appends in flight hold references (remote.h) */
    s.refs = &refs;
    CHECK(s.fd >= 0);
    CHECK_EQ(s.map.count, 2);
    CHECK_EQ(seen_find(&s.map, "nodes/a/delta_1.safetensors\tv1")->state, SEEN_DONE);
    CHECK(seen_find(&s.map, "nodes/b/delta_1.safetensors\tv9") != NULL);

    /* listed now: pending, then refused for this run only (not written) */
    seen_get(&s.map, "nodes/c/delta_2.safetensors\tv2", &created)->state = SEEN_PENDING;
    remote_seen_set(&s, "nodes/c/delta_2.safetensors", "v2", SEEN_REJECTED);
    CHECK_EQ(seen_find(&s.map, "nodes/c/delta_2.safetensors\tv2")->state, SEEN_REJECTED);
    /* decided for good: written once, however often it is said */
    remote_seen_done(&s, "nodes/d/delta_3.safetensors", "v3");
    remote_seen_done(&s, "nodes/d/delta_3.safetensors", "v3");
    /* the daemon's verdict: our own failure (or async's busy) makes it looked at again by a later listing,
     * not written; any other settles that path's pending ones */
    seen_get(&s.map, "nodes/e/delta_4.safetensors\tv4", &created)->state = SEEN_PENDING;
    seen_get(&s.map, "nodes/e/delta_40.safetensors\tv5", &created)->state = SEEN_PENDING;
    CHECK_EQ(remote_seen_decided(&s, "nodes/e/delta_4.safetensors", HUB_RETRY), 0);
    CHECK_EQ(seen_find(&s.map, "nodes/e/delta_4.safetensors\tv4")->state, SEEN_INCOMPLETE);
    seen_find(&s.map, "nodes/e/delta_4.safetensors\tv4")->state = SEEN_PENDING;      /* listed and handed again */
    CHECK_EQ(remote_seen_decided(&s, "nodes/e/delta_4.safetensors", HUB_INCOMPLETE), 1);
    CHECK_EQ(seen_find(&s.map, "nodes/e/delta_4.safetensors\tv4")->state, SEEN_DONE);
    CHECK_EQ(seen_find(&s.map, "nodes/e/delta_40.safetensors\tv5")->state, SEEN_PENDING);
    CHECK_EQ(remote_seen_decided(&s, "nodes/e/delta_40.safetensors", HUB_TAKEN), 0);
    CHECK(refs.n > 0);
    CHECK_EQ(uv_run(&loop, UV_RUN_DEFAULT), 0);                 /* the appends complete */
    CHECK_EQ(refs.n, 0u);
    remote_seen_close(&s);

    /* a restart: what was decided is done, what was refused for a run is not there */
    remote_seen_open(&s, &loop, path);
    CHECK_EQ(seen_find(&s.map, "nodes/d/delta_3.safetensors\tv3")->state, SEEN_DONE);
    CHECK_EQ(seen_find(&s.map, "nodes/e/delta_4.safetensors\tv4")->state, SEEN_DONE);
    CHECK_EQ(seen_find(&s.map, "nodes/e/delta_40.safetensors\tv5")->state, SEEN_DONE);
    CHECK(seen_find(&s.map, "nodes/c/delta_2.safetensors\tv2") == NULL);
    CHECK_EQ(s.map.count, 5);
    remote_seen_close(&s);
    /* the file holds each decision once */
    CHECK((f = fopen(path, "r")) != NULL);
    char line[4096];
    int d3 = 0;
    while (fgets(line, sizeof(line), f) != NULL)
        d3 += strcmp(line, "nodes/d/delta_3.safetensors\tv3\n") == 0;
    fclose(f);
    CHECK_EQ(d3, 1);
    CHECK_EQ(uv_loop_close(&loop), 0);
}

/* A cluster's step file names the step's own index; only stepcount_parse_file reads it, and a model_file
 * that is none of the three is refused rather than taken for the plain file. */
TEST(stepcount_model_files)
{
    uint64_t step;
    int boot, kind;
    char mf[128];
    dl_error err;
    char *t = stepcount_build_file(5, "nesterov_sgd", 0, "global/steps/5/model.safetensors.index.json", NULL);
    CHECK(t != NULL);
    CHECK_EQ(stepcount_parse_file(t, strlen(t), &step, &boot, &kind, mf, sizeof(mf), &err), 0);
    CHECK(step == 5 && kind == 2);
    CHECK_STR(mf, "global/steps/5/model.safetensors.index.json");
    CHECK(stepcount_parse(t, strlen(t), &step, &boot, &kind, &err) != 0);
    CHECK(strstr(err.message, "cluster") != NULL);
    free(t);
    /* another step's index is not this step's */
    t = stepcount_build_file(6, "nesterov_sgd", 0, "global/steps/5/model.safetensors.index.json", NULL);
    CHECK(t != NULL);
    CHECK(stepcount_parse_file(t, strlen(t), &step, &boot, &kind, mf, sizeof(mf), &err) != 0);
    free(t);
    t = stepcount_build_file(6, "sgd", 0, "global/other.bin", NULL);
    CHECK(t != NULL);
    CHECK(stepcount_parse(t, strlen(t), &step, &boot, &kind, &err) != 0);
    free(t);
    t = stepcount_build(6, "sgd", 0, 1, NULL);
    CHECK(t != NULL);
    CHECK_EQ(stepcount_parse_file(t, strlen(t), &step, &boot, &kind, mf, sizeof(mf), &err), 0);
    CHECK(kind == 1);
    CHECK_STR(mf, STEPCOUNT_MODEL_INDEX);
    free(t);
    const char *reference = "{\"algorithm\": \"dumb_diloco\", \"outer_step\": 3}";
    CHECK_EQ(stepcount_parse_file(reference, strlen(reference), &step, &boot, &kind, mf, sizeof(mf), &err), 0);
    CHECK(kind == 0);
    CHECK_STR(mf, STEPCOUNT_MODEL_SINGLE);
}
