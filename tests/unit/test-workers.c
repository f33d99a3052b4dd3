#include "test.h"

#include <stdio.h>
#include <stdlib.h>

#include "workers.h"

static const cz_spec plain = {CZ_NONE, 0};

static delta_metrics loss(double v)
{
    delta_metrics m;
    memset(&m, 0, sizeof(m));
    m.have = DELTA_M_LOSS;
    m.loss = v;
    return m;
}

TEST(workers_keep_the_latest_report_sorted)
{
    workers *w = malloc(sizeof(*w));
    delta_metrics m = loss(3.0);
    workers_init(w);
    workers_report(w, "b", 1, 10, 100, &m, &plain, 100);
    m = loss(2.0);
    workers_report(w, "a", 1, 11, 101, &m, &plain, 100);
    m = loss(1.5);
    workers_report(w, "b", 2, 12, 102, &m, &plain, 100);
    CHECK_EQ(w->n, 2);
    CHECK_STR(w->w[0].node_id, "a");
    CHECK_STR(w->w[1].node_id, "b");
    CHECK(w->w[1].metrics.loss == 1.5);
    CHECK_EQ(w->w[1].local_step, 12);
    CHECK_EQ(w->w[1].base_outer_step, 2);
    CHECK_EQ((long)w->w[1].at, 102L);
    CHECK(workers_find(w, "c") == NULL);
    CHECK(workers_find(w, "a") == &w->w[0]);
    free(w);
}

TEST(workers_forget_the_least_recent_past_the_cap)
{
    workers *w = malloc(sizeof(*w));
    delta_metrics m = loss(1.0);
    char id[16];
    workers_init(w);
    for (int i = 0; i < WORKERS_MAX; i++) {
        snprintf(id, sizeof(id), "n%03d", i);
        workers_report(w, id, 0, 1, 0, &m, &plain, 100);
    }
    workers_report(w, "n000", 0, 2, 0, &m, &plain, 100);     /* n000 seen again: n001 is now the least recent */
    workers_report(w, "z", 0, 1, 0, &m, &plain, 100);
    CHECK_EQ(w->n, WORKERS_MAX);
    CHECK_EQ(w->dropped_nodes, 1);
    CHECK(workers_find(w, "n001") == NULL);
    CHECK(workers_find(w, "n000") != NULL);
    CHECK_STR(w->w[WORKERS_MAX - 1].node_id, "z");
    for (size_t i = 1; i < w->n; i++)
        CHECK(strcmp(w->w[i - 1].node_id, w->w[i].node_id) < 0);
    free(w);
}

TEST(workers_keep_the_first_metric_names)
{
    workers *w = malloc(sizeof(*w));
    delta_metrics m;
    char name[16];
    workers_init(w);
    memset(&m, 0, sizeof(m));
    for (int i = 0; i < WORKERS_NAMES_MAX; i++) {
        snprintf(name, sizeof(name), "m%02d", i);
        CHECK_EQ(delta_metrics_add(&m, name, strlen(name), i), 0);
    }
    workers_report(w, "a", 0, 1, 0, &m, &plain, 100);
    CHECK_EQ(w->nnames, WORKERS_NAMES_MAX);
    CHECK_EQ(w->dropped_names, 0);
    memset(&m, 0, sizeof(m));
    CHECK_EQ(delta_metrics_add(&m, "m03", 3, 7.0), 0);
    CHECK_EQ(delta_metrics_add(&m, "new", 3, 8.0), 0);
    workers_report(w, "b", 0, 1, 0, &m, &plain, 100);
    CHECK_EQ(w->dropped_names, 1);
    const worker_report *b = workers_find(w, "b");
    CHECK_EQ(b->metrics.nnamed, 1);
    CHECK_STR(b->metrics.name[0], "m03");
    CHECK(b->metrics.value[0] == 7.0);
    free(w);
}

TEST(workers_count_committed_tokens_and_replay_the_history)
{
    workers *w = malloc(sizeof(*w));
    node_stat n[2];
    round_record r = {.step = 4, .closed_at = 500, .n = 2, .nodes = n};
    workers_init(w);
    memset(n, 0, sizeof(n));
    snprintf(n[0].node_id, sizeof(n[0].node_id), "a");
    snprintf(n[1].node_id, sizeof(n[1].node_id), "b");
    n[0].local_step = 9;
    n[0].metrics.have = DELTA_M_NUM_TOKENS | DELTA_M_LOSS;
    n[0].metrics.num_tokens = 1000;
    n[0].metrics.loss = 0.5;
    n[1].metrics.have = DELTA_M_LOSS;
    /* at runtime: only the workers the table holds count; the latest report is the take's */
    delta_metrics m = loss(9.0);
    workers_report(w, "a", 4, 10, 0, &m, &plain, 100);
    workers_committed(w, &r, 0);
    CHECK_EQ(w->n, 1);
    CHECK_EQ(w->w[0].tokens_total, 1000);
    CHECK(w->w[0].metrics.loss == 9.0);
    CHECK_EQ(w->w[0].local_step, 10);
    /* the startup's replay: the record's reports become the latest */
    workers_init(w);
    workers_committed(w, &r, 1);
    r.step = 5;
    workers_committed(w, &r, 1);
    CHECK_EQ(w->n, 2);
    CHECK_EQ(w->w[0].tokens_total, 2000);
    CHECK(w->w[0].metrics.loss == 0.5);
    CHECK_EQ(w->w[0].base_outer_step, 5);
    CHECK_EQ(w->w[0].local_step, 9);
    CHECK_EQ((long)w->w[0].at, 500L);
    CHECK_EQ(w->w[1].tokens_total, 0);
    free(w);
}

/* A worker's tokens_total saturates: num_tokens may be any uint64, and a sum that wrapped made the
 * counter dilocod_node_tokens_total go down. */
TEST(workers_tokens_total_saturates)
{
    workers *w = malloc(sizeof(*w));
    node_stat n;
    round_record r = {.step = 1, .closed_at = 1, .n = 1, .nodes = &n};
    workers_init(w);
    memset(&n, 0, sizeof(n));
    snprintf(n.node_id, sizeof(n.node_id), "a");
    n.metrics.have = DELTA_M_NUM_TOKENS;
    n.metrics.num_tokens = UINT64_MAX - 5;
    workers_committed(w, &r, 1);
    CHECK_EQ(w->w[0].tokens_total, UINT64_MAX - 5);
    uint64_t before = w->w[0].tokens_total;
    for (int i = 0; i < 2049; i++) {
        workers_committed(w, &r, 1);
        CHECK(w->w[0].tokens_total >= before);
        before = w->w[0].tokens_total;
    }
    CHECK_EQ(w->w[0].tokens_total, UINT64_MAX);
    free(w);
}

/* Each worker's last encoding and bytes, and the bytes taken by encoding. */
TEST(workers_keep_the_encoding_and_the_bytes_on_the_wire)
{
    workers *w = malloc(sizeof(*w));
    delta_metrics m = loss(1.0);
    const cz_spec fp4 = {CZ_MXFP4, 32}, i8 = {CZ_INT8_BLOCK, 64};
    workers_init(w);
    workers_report(w, "a", 0, 1, 0, &m, &fp4, 1000);
    workers_report(w, "b", 0, 1, 0, &m, &plain, 7000);
    workers_report(w, "a", 1, 2, 0, &m, &i8, 2000);
    CHECK_EQ(w->w[0].cz.enc, CZ_INT8_BLOCK);
    CHECK_EQ(w->w[0].cz.block, 64);
    CHECK_EQ(w->w[0].bytes, 2000);
    CHECK_EQ(w->w[1].cz.enc, CZ_NONE);
    CHECK_EQ(w->wire_bytes[CZ_MXFP4], 1000);
    CHECK_EQ(w->wire_bytes[CZ_INT8_BLOCK], 2000);
    CHECK_EQ(w->wire_bytes[CZ_NONE], 7000);
    CHECK_EQ(w->wire_deltas[CZ_MXFP4], 1);
    free(w);
}
