#include "test.h"

#include <math.h>
#include <stdlib.h>

#include "round.h"

static delta_info info(const char *node, uint64_t base, uint64_t local)
{
    delta_info i;
    memset(&i, 0, sizeof(i));
    snprintf(i.node_id, sizeof(i.node_id), "%s", node);
    i.base_outer_step = base;
    i.local_step = local;
    return i;
}

static round_verdict offer(round_state *r, const char *node, uint64_t base, uint64_t local, double now)
{
    char *replaced = NULL;
    delta_info i = info(node, base, local);
    char path[128];
    snprintf(path, sizeof(path), "cache/%s/%llu", node, (unsigned long long)local);
    char *p = strdup(path);
    round_verdict v = round_offer(r, &i, p, 100, now, 0, &replaced);
    if (!round_verdict_taken(v))
        free(p);
    free(replaced);
    return v;
}

TEST(round_async_takes_stale_within_bound_and_weights)
{
    round_state r;
    round_close_reason why;
    round_init(&r, 10, 3, NULL, 0, 1, 0);
    round_init_async(&r, 4, 1, 0.5, 3);
    CHECK_EQ(offer(&r, "a", 11, 1, 1.0), ROUND_FUTURE);
    CHECK_EQ(offer(&r, "a", 5, 1, 1.0), ROUND_STALE);          /* tau 5 > 4 */
    CHECK_EQ(offer(&r, "b", 6, 1, 1.0), ROUND_ACCEPTED);       /* tau 4 */
    CHECK_EQ(offer(&r, "b", 6, 1, 1.0), ROUND_NOT_NEWER);      /* the same delta */
    CHECK_EQ(offer(&r, "b", 10, 2, 1.2), ROUND_ACCEPTED);      /* a node's second delta: another update's worth */
    CHECK_EQ(offer(&r, "a", 9, 3, 1.3), ROUND_ACCEPTED);
    CHECK_EQ(offer(&r, "c", 9, 3, 1.3), ROUND_BUSY);           /* three wait: the queue bound */
    CHECK_EQ(r.n, 3);
    CHECK_STR(r.entries[0].node_id, "a");
    CHECK_EQ(r.entries[1].base, 6);                            /* b's by base, then local_step */
    CHECK_EQ(r.entries[1].tau, 4);
    CHECK(r.entries[1].weight == 1.0 / sqrt(5.0));
    CHECK_EQ(r.entries[2].tau, 0);
    CHECK(r.entries[2].weight == 1.0);
    CHECK(!round_should_close(&r, 1.4, &why));                /* the grace window runs from the first */
    CHECK(round_should_close(&r, 1.5, &why));
    CHECK_EQ(why, ROUND_GRACE);
    r.closed = 1;                                              /* its pass runs: the next wait in the queue */
    CHECK_EQ(round_pending(&r), 0);
    CHECK_EQ(offer(&r, "c", 10, 1, 2.0), ROUND_QUEUED);
    CHECK_EQ(offer(&r, "d", 10, 1, 2.4), ROUND_QUEUED);
    CHECK_EQ(offer(&r, "e", 10, 1, 2.6), ROUND_QUEUED);        /* past c's grace: a later update */
    CHECK_EQ(offer(&r, "f", 10, 1, 2.7), ROUND_BUSY);
    round_reset(&r, 11);
    CHECK_EQ(r.n, 2);                                          /* c and d, within 0.5 s of c */
    CHECK_EQ(r.nqueue, 1);
    CHECK(r.first_at == 2.0);
    CHECK_EQ(r.entries[0].tau, 0);                             /* fixed when it was taken */
    CHECK(round_should_close(&r, 3.0, &why));
    round_free(&r);
}

TEST(round_async_recovered_deltas_are_not_bounded_again)
{
    round_state r;
    char *replaced = NULL;
    round_init(&r, 10, 1, NULL, 0, 1, 0);
    round_init_async(&r, 0, 0, 0, 1);
    delta_info i = info("a", 8, 1), j = info("b", 9, 1);
    char *p = strdup("x"), *q = strdup("y");
    CHECK_EQ(round_offer(&r, &i, p, 1, 0, 1, &replaced), ROUND_ACCEPTED);   /* tau 2 > 0, and over the bound */
    CHECK_EQ(round_offer(&r, &j, q, 1, 0, 1, &replaced), ROUND_ACCEPTED);
    CHECK_EQ(r.n, 2);
    CHECK_EQ(offer(&r, "c", 9, 1, 0), ROUND_STALE);
    CHECK_EQ(offer(&r, "c", 10, 1, 0), ROUND_BUSY);
    round_free(&r);
}

TEST(round_orders_nodes_and_closes_when_all_arrived)
{
    round_state r;
    round_close_reason why;
    round_init(&r, 5, 3, NULL, 0, 1, 0);
    CHECK_EQ(offer(&r, "w2", 5, 10, 1.0), ROUND_ACCEPTED);
    CHECK_EQ(offer(&r, "w10", 5, 10, 2.0), ROUND_ACCEPTED);
    CHECK(!round_should_close(&r, 3.0, &why));
    CHECK_EQ(offer(&r, "w1", 5, 10, 3.0), ROUND_ACCEPTED);
    CHECK(round_should_close(&r, 3.0, &why));
    CHECK_EQ(why, ROUND_ALL_NODES);
    CHECK_STR(r.entries[0].node_id, "w1");     /* bytewise ascending: the aggregation order */
    CHECK_STR(r.entries[1].node_id, "w10");
    CHECK_STR(r.entries[2].node_id, "w2");
    CHECK(r.first_at == 1.0);
    round_free(&r);
}

TEST(round_stale_future_replace_not_newer)
{
    round_state r;
    round_init(&r, 5, 2, NULL, 0, 1, 0);
    CHECK_EQ(offer(&r, "a", 4, 10, 0), ROUND_STALE);
    CHECK_EQ(offer(&r, "a", 6, 10, 0), ROUND_FUTURE);
    CHECK_EQ(offer(&r, "a", 5, 10, 0), ROUND_ACCEPTED);
    CHECK_EQ(offer(&r, "a", 5, 10, 0), ROUND_NOT_NEWER);
    CHECK_EQ(offer(&r, "a", 5, 9, 0), ROUND_NOT_NEWER);
    CHECK_EQ(offer(&r, "a", 5, 11, 0), ROUND_REPLACED);
    delta_info a = info("a", 5, 0);
    CHECK_EQ(round_find(&r, &a)->local_step, 11);
    CHECK_STR(round_find(&r, &a)->path, "cache/a/11");
    CHECK_EQ(r.n, 1);
    CHECK_EQ(r.counters.stale, 1);
    CHECK_EQ(r.counters.future, 1);
    CHECK_EQ(r.counters.not_newer, 2);
    CHECK_EQ(r.counters.replaced, 1);
    r.closed = 1;
    CHECK_EQ(offer(&r, "b", 5, 1, 0), ROUND_STALE);   /* late for a closed round */
    round_reset(&r, 6);
    CHECK_EQ(r.n, 0);
    CHECK_EQ(offer(&r, "b", 6, 1, 0), ROUND_ACCEPTED);
    CHECK_EQ(r.counters.stale, 2);                      /* counters survive rounds */
    round_free(&r);
}

TEST(round_timeout_and_min_nodes)
{
    round_state r;
    round_close_reason why;
    round_init(&r, 0, 4, NULL, 0, 2, 10.0);
    CHECK(round_deadline(&r) < 0);
    CHECK_EQ(offer(&r, "a", 0, 1, 100.0), ROUND_ACCEPTED);
    CHECK(round_deadline(&r) == 110.0);
    CHECK(!round_should_close(&r, 200.0, &why));        /* past the deadline but below min_nodes */
    CHECK_EQ(offer(&r, "b", 0, 1, 201.0), ROUND_ACCEPTED);
    CHECK(round_should_close(&r, 201.0, &why));
    CHECK_EQ(why, ROUND_TIMEOUT);
    round_free(&r);
}

TEST(round_allow_list_and_full)
{
    round_state r;
    char *allow[] = {"x", "y"};
    round_init(&r, 0, 2, allow, 2, 1, 0);
    CHECK_EQ(offer(&r, "z", 0, 1, 0), ROUND_UNKNOWN_NODE);
    CHECK_EQ(offer(&r, "x", 0, 1, 0), ROUND_ACCEPTED);
    round_free(&r);
    round_init(&r, 0, 1, NULL, 0, 1, 0);
    CHECK_EQ(offer(&r, "x", 0, 1, 0), ROUND_ACCEPTED);
    CHECK_EQ(offer(&r, "y", 0, 1, 0), ROUND_FULL);
    round_free(&r);
}

/* The worker's reported metrics travel with its entry: a replacing delta brings its own. */
TEST(round_entry_keeps_the_reported_metrics)
{
    round_state r;
    char *replaced = NULL;
    delta_info i = info("a", 4, 1);
    round_init(&r, 4, 2, NULL, 0, 1, 0);
    i.metrics.have = DELTA_M_LOSS | DELTA_M_NUM_TOKENS;
    i.metrics.loss = 2.5;
    i.metrics.num_tokens = 100;
    CHECK_EQ(delta_metrics_add(&i.metrics, "acc", 3, 0.75), 0);
    CHECK_EQ(round_offer(&r, &i, strdup("p1"), 10, 1.0, 0, &replaced), ROUND_ACCEPTED);
    CHECK_HEX(r.entries[0].metrics.have, DELTA_M_LOSS | DELTA_M_NUM_TOKENS);
    CHECK(r.entries[0].metrics.loss == 2.5);
    CHECK_STR(r.entries[0].metrics.name[0], "acc");
    i = info("a", 4, 2);
    i.metrics.have = DELTA_M_LOSS;
    i.metrics.loss = 1.25;
    CHECK_EQ(round_offer(&r, &i, strdup("p2"), 10, 2.0, 0, &replaced), ROUND_REPLACED);
    free(replaced);
    CHECK_HEX(r.entries[0].metrics.have, DELTA_M_LOSS);
    CHECK(r.entries[0].metrics.loss == 1.25);
    CHECK_EQ(r.entries[0].metrics.nnamed, 0);
    round_free(&r);
}
