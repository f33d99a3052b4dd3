#include "test.h"

#include <stdio.h>
#include <stdlib.h>

#include "strbuf.h"
#include "verdicts.h"

static verdict_delta delta(const char *node, uint64_t local, uint64_t base)
{
    verdict_delta v = {node, 1, local, base, base};
    return v;
}

static const verdict_record *newest(const verdict_node *e)
{
    return &e->ring[(e->head + e->n - 1) % VERDICTS_PER_NODE];
}

TEST(verdicts_keep_the_last_32_and_exact_counts)
{
    verdicts v;
    CHECK_EQ(verdicts_init(&v), 0);
    for (uint64_t i = 1; i <= 40; i++) {
        verdict_delta dl = delta("w0", i, 0);
        verdicts_arrive(&v, &dl, VERDICT_REFUSED, i % 2 ? "shape_mismatch" : "stale", 422, "bad", 1.0);
    }
    const verdict_node *e = verdicts_find(&v, "w0");
    CHECK(e != NULL);
    CHECK_EQ(e->n, VERDICTS_PER_NODE);
    CHECK_EQ(e->total, 40);
    CHECK_EQ(verdicts_count(&v, "w0", "shape_mismatch"), 20);
    CHECK_EQ(verdicts_count(&v, "w0", "stale"), 20);
    CHECK_EQ(newest(e)->local_step, 40);
    CHECK_EQ(e->ring[e->head].local_step, 9);
    CHECK_EQ(v.changes, 40);
    verdicts_free(&v);
}

TEST(verdicts_settle_the_pending_record_in_place)
{
    verdicts v;
    CHECK_EQ(verdicts_init(&v), 0);
    verdict_delta dl = delta("w0", 5, 2);
    verdicts_arrive(&v, &dl, VERDICT_ACCEPTED, NULL, 201, "in the round", 1.0);
    /* a retry refused in between does not hide the pending record */
    verdicts_arrive(&v, &dl, VERDICT_REFUSED, "not_newer", 409, NULL, 2.0);
    CHECK(verdicts_pending(&v, &dl));
    CHECK_EQ(verdicts_settle(&v, &dl, VERDICT_QUARANTINED, "norm_ratio", "too big", 3.0, 1), 1);
    const verdict_node *e = verdicts_find(&v, "w0");
    CHECK_EQ(e->n, 2);
    CHECK_EQ(e->ring[e->head].kind, VERDICT_QUARANTINED);
    CHECK_STR(e->ring[e->head].reason, "norm_ratio");
    CHECK_EQ(e->ring[e->head].status, 201);          /* what the upload was answered stays */
    CHECK(!verdicts_pending(&v, &dl));
    /* decided: a replay changes nothing, a later verdict without only_pending is a new record */
    CHECK_EQ(verdicts_settle(&v, &dl, VERDICT_AGGREGATED, NULL, NULL, 4.0, 1), 0);
    CHECK_EQ(e->n, 2);
    CHECK_EQ(verdicts_settle(&v, &dl, VERDICT_REFUSED, "round_discarded", NULL, 4.0, 0), 1);
    CHECK_EQ(e->n, 3);
    CHECK_EQ(e->total, 4);
    CHECK_EQ(verdicts_count(&v, "w0", "accepted"), 1);
    verdicts_free(&v);
}

TEST(verdicts_bound_nodes_reasons_and_messages)
{
    verdicts v;
    char id[16], reason[16], msg[600];
    CHECK_EQ(verdicts_init(&v), 0);
    for (int i = 0; i < VERDICTS_NODES_MAX + 10; i++) {
        snprintf(id, sizeof(id), "n%03d", i);
        verdict_delta dl = delta(id, 1, 0);
        verdicts_arrive(&v, &dl, VERDICT_REFUSED, "stale", 409, NULL, 1.0);
    }
    CHECK_EQ(v.n, VERDICTS_NODES_MAX);
    CHECK_EQ(v.dropped_nodes, 10);
    CHECK(verdicts_find(&v, "n000") == NULL);
    CHECK(verdicts_find(&v, "n073") != NULL);
    /* 40 distinct reasons: the first 23 kept, the rest counted as "other"; the counts add up */
    for (int i = 0; i < 40; i++) {
        snprintf(reason, sizeof(reason), "r%02d", i);
        verdict_delta dl = delta("n073", (uint64_t)i + 2, 0);
        verdicts_arrive(&v, &dl, VERDICT_REFUSED, reason, 422, NULL, 1.0);
    }
    const verdict_node *e = verdicts_find(&v, "n073");
    CHECK_EQ(e->ncounts, VERDICT_REASONS_MAX);
    CHECK_STR(e->counts[VERDICT_REASONS_MAX - 1].reason, "other");
    uint64_t sum = 0;
    for (size_t i = 0; i < e->ncounts; i++)
        sum += e->counts[i].n;
    CHECK_EQ(sum, e->total);
    /* a hostile node id is never recorded; an invalid reason becomes the kind's name; a message is cut
     * to printable ASCII */
    verdict_delta bad = delta("../x", 1, 0);
    verdicts_arrive(&v, &bad, VERDICT_REFUSED, "stale", 409, NULL, 1.0);
    CHECK(verdicts_find(&v, "../x") == NULL);
    memset(msg, 'a', sizeof(msg) - 1);
    msg[sizeof(msg) - 1] = '\0';
    msg[3] = '\n';
    msg[4] = (char)0xff;
    verdict_delta dl = delta("n072", 9, 0);
    verdicts_arrive(&v, &dl, VERDICT_REFUSED, "Not A Reason", 422, msg, 1.0);
    e = verdicts_find(&v, "n072");
    CHECK_STR(newest(e)->reason, "refused");
    CHECK_EQ(strlen(newest(e)->message), VERDICT_MESSAGE_MAX);
    CHECK(newest(e)->message[3] == '?' && newest(e)->message[4] == '?');
    verdicts_free(&v);
}

TEST(verdicts_file_round_trips_and_hostile_files_are_refused)
{
    verdicts v, w;
    sbuf a = {0}, b = {0};
    dl_error err;
    CHECK_EQ(verdicts_init(&v), 0);
    CHECK_EQ(verdicts_init(&w), 0);
    verdict_delta d1 = delta("w0", 3, 1);
    verdict_delta unread = {"w1", 0, 0, 0, 1};
    verdicts_arrive(&v, &d1, VERDICT_ACCEPTED, NULL, 201, "quote \" and \\ back", 1733400000.5);
    verdicts_settle(&v, &d1, VERDICT_AGGREGATED, NULL, "aggregated into step 2", 1733400001.0, 1);
    verdicts_arrive(&v, &unread, VERDICT_REFUSED, "header_too_small", 400, "empty", 1733400002.0);
    verdicts_json(&v, &a);
    char *text = sb_take(&a);
    CHECK(text != NULL);
    CHECK_EQ(verdicts_parse(&w, text, strlen(text), &err), 0);
    verdicts_json(&w, &b);
    char *again = sb_take(&b);
    CHECK(again != NULL);
    CHECK_STR(again, text);
    CHECK_EQ(w.n, 2);
    CHECK(!verdicts_find(&w, "w1")->ring[0].has_steps);
    free(again);
    verdicts_free(&w);

    static const char *const hostile[] = {
        "",
        "[]",
        "{\"version\":2,\"dropped_nodes\":0,\"nodes\":[]}",
        "{\"version\":1,\"dropped_nodes\":-1,\"nodes\":[]}",
        /* counts that do not add up, a duplicate node, a node id that leaves its directory */
        "{\"version\":1,\"dropped_nodes\":0,\"nodes\":[{\"node_id\":\"a\",\"total\":3,\"counts\":{\"x\":1},\"deltas\":[]}]}",
        "{\"version\":1,\"dropped_nodes\":0,\"nodes\":[{\"node_id\":\"a\",\"total\":0,\"counts\":{},\"deltas\":[]},"
        "{\"node_id\":\"a\",\"total\":0,\"counts\":{},\"deltas\":[]}]}",
        "{\"version\":1,\"dropped_nodes\":0,\"nodes\":[{\"node_id\":\"..\",\"total\":0,\"counts\":{},\"deltas\":[]}]}",
        /* a record of an unknown verdict, a step past 2^53, a message with a control byte */
        "{\"version\":1,\"dropped_nodes\":0,\"nodes\":[{\"node_id\":\"a\",\"total\":0,\"counts\":{},\"deltas\":[{"
        "\"verdict\":\"owned\",\"reason\":\"x\",\"status\":null,\"local_step\":1,\"base_outer_step\":0,\"step\":0,"
        "\"time\":1,\"message\":\"\"}]}]}",
        "{\"version\":1,\"dropped_nodes\":0,\"nodes\":[{\"node_id\":\"a\",\"total\":0,\"counts\":{},\"deltas\":[{"
        "\"verdict\":\"refused\",\"reason\":\"x\",\"status\":null,\"local_step\":1e300,\"base_outer_step\":0,"
        "\"step\":0,\"time\":1,\"message\":\"\"}]}]}",
        "{\"version\":1,\"dropped_nodes\":0,\"nodes\":[{\"node_id\":\"a\",\"total\":0,\"counts\":{},\"deltas\":[{"
        "\"verdict\":\"refused\",\"reason\":\"x\",\"status\":null,\"local_step\":1,\"base_outer_step\":0,"
        "\"step\":0,\"time\":1,\"message\":\"\\u0001\"}]}]}",
    };
    for (size_t i = 0; i < sizeof(hostile) / sizeof(hostile[0]); i++) {
        CHECK_EQ(verdicts_init(&w), 0);
        dl_error_clear(&err);
        if (verdicts_parse(&w, hostile[i], strlen(hostile[i]), &err) == 0) {
            fprintf(stderr, "  hostile file %zu was taken: %s\n", i, hostile[i]);
            test_fail();
        }
        CHECK_EQ(w.n, 0);
        CHECK(err.message[0] != '\0');
        verdicts_free(&w);
    }
    /* more records than a node keeps */
    sbuf big = {0};
    sb_str(&big, "{\"version\":1,\"dropped_nodes\":0,\"nodes\":[{\"node_id\":\"a\",\"total\":0,\"counts\":{},\"deltas\":[");
    for (int i = 0; i < VERDICTS_PER_NODE + 1; i++)
        sb_printf(&big, "%s{\"verdict\":\"refused\",\"reason\":\"x\",\"status\":null,\"local_step\":1,"
                  "\"base_outer_step\":0,\"step\":0,\"time\":1,\"message\":\"\"}", i ? "," : "");
    sb_str(&big, "]}]}");
    char *bt = sb_take(&big);
    CHECK(bt != NULL);
    CHECK_EQ(verdicts_init(&w), 0);
    CHECK(verdicts_parse(&w, bt, strlen(bt), &err) != 0);
    verdicts_free(&w);
    free(bt);
    free(text);
    verdicts_free(&v);
}
