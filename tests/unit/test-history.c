#include "test.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "history.h"

static char *record_line(uint64_t step, const char *node, double norm)
{
    node_stat n = {.local_step = 10 * step + 1, .bytes = 4096, .norm = norm, .cosine = 0.5};
    round_record r = {.step = step, .seconds = 0.25, .gbps = 1.5, .bytes = 8192, .mean_norm = norm,
                      .closed_at = 1764460800, .n = 1, .nodes = &n};
    sbuf b = {0};
    snprintf(n.node_id, sizeof(n.node_id), "%s", node);
    snprintf(r.reason, sizeof(r.reason), "all_nodes");
    history_record_json(&b, &r);
    return sb_take(&b);
}

static void write_file(const char *path, const char *text)
{
    FILE *f = fopen(path, "w");
    fputs(text, f);
    fclose(f);
}

static char *read_file(const char *path)
{
    static char buf[65536];
    FILE *f = fopen(path, "r");
    size_t n = f ? fread(buf, 1, sizeof(buf) - 1, f) : 0;
    if (f)
        fclose(f);
    buf[n] = '\0';
    return buf;
}

TEST(history_record_round_trips_through_json)
{
    char *line = record_line(7, "w-1", 0.125);
    round_record r;
    CHECK_EQ(history_record_parse(&r, line), 0);
    CHECK_EQ(r.step, (uint64_t)7);
    CHECK_STR(r.reason, "all_nodes");
    CHECK_EQ(r.n, (size_t)1);
    CHECK_STR(r.nodes[0].node_id, "w-1");
    CHECK_EQ(r.nodes[0].local_step, (uint64_t)71);
    CHECK(r.nodes[0].norm == 0.125 && r.mean_norm == 0.125 && r.seconds == 0.25);
    CHECK_EQ((long)r.closed_at, 1764460800L);
    history_record_free(&r);
    CHECK(history_record_parse(&r, "{\"step\":-1,\"nodes\":[]}") != 0);
    CHECK(history_record_parse(&r, "{\"step\":1.5,\"nodes\":[]}") != 0);
    CHECK(history_record_parse(&r, "[1]") != 0);
    free(line);
}

TEST(history_ring_keeps_the_last_records)
{
    history h = {0};
    for (uint64_t s = 0; s < HISTORY_MAX + 5; s++) {
        round_record r = {.step = s};
        r.nodes = calloc(1, sizeof(*r.nodes));
        r.n = 1;
        history_push(&h, &r);
        CHECK(r.nodes == NULL);
    }
    CHECK_EQ(history_count(&h), (size_t)HISTORY_MAX);
    CHECK_EQ(history_get(&h, 0)->step, (uint64_t)5);
    CHECK_EQ(history_last(&h)->step, (uint64_t)HISTORY_MAX + 4);
    CHECK(history_get(&h, HISTORY_MAX) == NULL);
    history_free(&h);
}

/* A kill between the commit and the append: the committed record is replayed, once. */
TEST(history_load_replays_the_committed_round_once)
{
    char *r0 = record_line(0, "a", 1), *r1 = record_line(1, "a", 2), *r2 = record_line(2, "a", 3);
    char text[8192];
    history h = {0};
    dl_error err;

    snprintf(text, sizeof(text), "%s\n%s\n", r0, r1);
    write_file(test_path("rounds.jsonl"), text);
    /* committed step 3 was produced by the round based on step 2, missing from the file */
    CHECK_EQ(history_load(&h, test_dir(), 3, r2, &err), 0);
    CHECK_EQ(history_count(&h), (size_t)3);
    CHECK_EQ(history_last(&h)->step, (uint64_t)2);
    history_free(&h);
    /* a second start finds it in the file: no duplicate */
    CHECK_EQ(history_load(&h, test_dir(), 3, r2, &err), 0);
    CHECK_EQ(history_count(&h), (size_t)3);
    history_free(&h);
    snprintf(text, sizeof(text), "%s\n%s\n%s\n", r0, r1, r2);
    CHECK_STR(read_file(test_path("rounds.jsonl")), text);
    free(r0);
    free(r1);
    free(r2);
}

TEST(history_load_trims_a_torn_line_and_drops_duplicates_and_uncommitted_steps)
{
    char *r0 = record_line(0, "a", 1), *r1 = record_line(1, "a", 2), *r5 = record_line(5, "a", 3);
    char text[8192];
    history h = {0};
    dl_error err;

    /* r1 twice, a record past the committed step, and a torn tail */
    snprintf(text, sizeof(text), "%s\n%s\n%s\nnot json\n%s\n{\"step\":2,\"no", r0, r1, r1, r5);
    write_file(test_path("rounds.jsonl"), text);
    CHECK_EQ(history_load(&h, test_dir(), 2, NULL, &err), 0);
    CHECK_EQ(history_count(&h), (size_t)2);
    CHECK_EQ(history_get(&h, 0)->step, (uint64_t)0);
    CHECK_EQ(history_get(&h, 1)->step, (uint64_t)1);
    history_free(&h);
    /* the torn tail is gone, so the next append starts a line of its own */
    CHECK_EQ(history_append(test_dir(), "{\"step\":2,\"nodes\":[]}", &err), 0);
    const char *now = read_file(test_path("rounds.jsonl"));
    size_t len = strlen(now);
    CHECK(len > 0 && now[len - 1] == '\n');
    CHECK(strstr(now, "{\"step\":2,\"no\n") == NULL && strstr(now, "\n{\"step\":2,\"nodes\":[]}\n") != NULL);
    free(r0);
    free(r1);
    free(r5);
}

/* A record's nodes' reported metrics come back from its JSON bit for bit, and the JSON again is the
 * same text (history_record_json and history_record_parse are each other's inverse). */
TEST(history_metrics_round_trip)
{
    node_stat n[3] = {{.local_step = 5, .bytes = 64, .norm = 1, .cosine = 1},
                      {.local_step = 6, .bytes = 64, .norm = 2, .cosine = 1},
                      {.local_step = 7, .bytes = 64, .norm = 3, .cosine = 1}};
    round_record r = {.step = 3, .closed_at = 1764460800, .n = 3, .nodes = n}, back;
    sbuf b = {0}, again = {0};

    snprintf(r.reason, sizeof(r.reason), "all_nodes");
    snprintf(n[0].node_id, sizeof(n[0].node_id), "a");
    snprintf(n[1].node_id, sizeof(n[1].node_id), "b");
    snprintf(n[2].node_id, sizeof(n[2].node_id), "c");
    n[0].metrics.have = DELTA_M_LOSS | DELTA_M_NUM_TOKENS | DELTA_M_INNER_STEPS | DELTA_M_TOKENS_PER_SECOND |
                        DELTA_M_WEIGHT;
    n[0].metrics.loss = 0.1 + 0.2;                      /* 0.30000000000000004: needs 17 digits */
    n[0].metrics.num_tokens = 9007199254740991ULL;
    n[0].metrics.inner_steps = 500;
    n[0].metrics.tokens_per_second = 12345.678901234567;
    n[0].metrics.weight = 1e-300;
    CHECK_EQ(delta_metrics_add(&n[0].metrics, "lr", 2, 3e-4), 0);
    CHECK_EQ(delta_metrics_add(&n[0].metrics, "grad_norm", 9, -1.0 / 3.0), 0);
    n[1].metrics.have = DELTA_M_LOSS;
    n[1].metrics.loss = -2.5e-320;                      /* subnormal */
    /* n[2] reported nothing: no "metrics" member */
    history_record_json(&b, &r);
    char *json = sb_take(&b), *json_again;                 /* NUL-terminated for strstr */
    CHECK(json != NULL);
    CHECK(strstr(json, "\"metrics\":{\"loss\":0.30000000000000004,\"num_tokens\":9007199254740991,"
                         "\"inner_steps\":500,") != NULL);
    CHECK(strstr(json, "\"metric\":{\"grad_norm\":-0.3333333333333333,\"lr\":0.0003}") != NULL);
    CHECK(strstr(strstr(json, "\"node_id\":\"c\""), "metrics") == NULL);
    CHECK_EQ(history_record_parse(&back, json), 0);
    CHECK_EQ(back.n, 3);
    const delta_metrics *m = &back.nodes[0].metrics;
    CHECK_HEX(m->have, n[0].metrics.have);
    CHECK(m->loss == n[0].metrics.loss);
    CHECK_EQ(m->num_tokens, 9007199254740991ULL);
    CHECK_EQ(m->inner_steps, 500);
    CHECK(m->tokens_per_second == n[0].metrics.tokens_per_second);
    CHECK(m->weight == 1e-300);
    CHECK_EQ(m->nnamed, 2);
    CHECK_STR(m->name[0], "grad_norm");
    CHECK(m->value[0] == -1.0 / 3.0);
    CHECK_STR(m->name[1], "lr");
    CHECK(m->value[1] == 3e-4);
    CHECK_HEX(back.nodes[1].metrics.have, DELTA_M_LOSS);
    CHECK(back.nodes[1].metrics.loss == -2.5e-320);
    CHECK_EQ(back.nodes[2].metrics.have, 0);
    CHECK_EQ(back.nodes[2].metrics.nnamed, 0);
    history_record_json(&again, &back);
    json_again = sb_take(&again);
    CHECK(json_again != NULL);
    CHECK_STR(json_again, json);
    history_record_free(&back);
    free(json);
    free(json_again);
}

/* A hand-edited or damaged "metrics" member loses the values that break the delta rules, not the record. */
TEST(history_metrics_damaged_members_dropped)
{
    round_record r;
    CHECK_EQ(history_record_parse(&r, "{\"step\":1,\"nodes\":[{\"node_id\":\"a\",\"metrics\":{\"loss\":\"1\","
                                      "\"num_tokens\":-3,\"inner_steps\":1.5,\"tokens_per_second\":-1,\"weight\":0,"
                                      "\"metric\":{\"ok\":2,\"bad-name\":1,\"s\":\"x\"}}},"
                                      "{\"node_id\":\"b\",\"metrics\":[1]}]}"), 0);
    CHECK_EQ(r.n, 2);
    CHECK_EQ(r.nodes[0].metrics.have, 0);
    CHECK_EQ(r.nodes[0].metrics.nnamed, 1);
    CHECK_STR(r.nodes[0].metrics.name[0], "ok");
    CHECK_EQ(r.nodes[1].metrics.have, 0);
    history_record_free(&r);
}

/* The round's times: opened, closed and each delta's arrival (quarantined ones too) come back from the
 * JSON to the millisecond; a record written before they were kept has none of them, reads back with
 * them unknown (0) and writes back as the same text. */
TEST(history_record_times_round_trip_and_old_records_stay_the_same)
{
    const char *old = "{\"step\":4,\"outer_step\":5,\"reason\":\"all_nodes\",\"closed_at\":\"2025-12-01T00:00:00+00:00\","
                      "\"seconds\":0.25,\"gbps\":1.5,\"bytes\":8192,\"mean_norm\":0.5,\"nodes\":[{\"node_id\":\"a\","
                      "\"local_step\":3,\"bytes\":4096,\"norm\":0.5,\"cosine\":1,\"intake_norm\":null,\"scale\":1}],"
                      "\"quarantined\":[{\"node_id\":\"q\",\"local_step\":3,\"norm\":9,\"bound\":5,\"reason\":\"norm_ratio\"}]}";
    round_record r, back;
    sbuf b = {0}, again = {0};

    CHECK_EQ(history_record_parse(&r, old), 0);
    CHECK(r.opened_at == 0 && r.closed_wall == 0 && r.nodes[0].received_at == 0 && r.quarantined[0].received_at == 0);
    history_record_json(&b, &r);
    char *json = sb_take(&b);
    CHECK(json != NULL);
    CHECK_STR(json, old);
    free(json);

    r.opened_at = 1764547200.125;
    r.closed_wall = 1764547205.5;
    r.nodes[0].received_at = 1764547203.25;
    r.quarantined[0].received_at = 1764547201.75;
    r.quarantined[0].metrics.have = DELTA_M_LOSS;
    r.quarantined[0].metrics.loss = 2.5;
    history_record_json(&again, &r);
    json = sb_take(&again);
    CHECK(json != NULL);
    CHECK(strstr(json, "\"opened_unix\":1764547200.125,\"closed_unix\":1764547205.500,") != NULL);
    CHECK(strstr(json, "\"scale\":1,\"received_unix\":1764547203.250}") != NULL);
    CHECK(strstr(json, "\"reason\":\"norm_ratio\",\"received_unix\":1764547201.750,\"metrics\":{\"loss\":2.5}}") != NULL);
    CHECK_EQ(history_record_parse(&back, json), 0);
    CHECK(back.opened_at == r.opened_at && back.closed_wall == r.closed_wall);
    CHECK(back.nodes[0].received_at == r.nodes[0].received_at);
    CHECK(back.quarantined[0].received_at == r.quarantined[0].received_at);
    CHECK(back.quarantined[0].metrics.have == DELTA_M_LOSS && back.quarantined[0].metrics.loss == 2.5);
    history_record_free(&back);
    free(json);

    /* the deltas refused at their offer: "refused" after "quarantined", only when there are some */
    r.refused = calloc(1, sizeof(*r.refused));
    CHECK(r.refused != NULL);
    r.nrefused = 1;
    snprintf(r.refused[0].node_id, sizeof(r.refused[0].node_id), "x");
    snprintf(r.refused[0].quarantine_reason, sizeof(r.refused[0].quarantine_reason), "max_norm");
    r.refused[0].local_step = 9;
    r.refused[0].norm = 100;
    r.refused[0].bound = 10;
    r.refused[0].received_at = 1764547202.5;
    sbuf third = {0};
    history_record_json(&third, &r);
    json = sb_take(&third);
    CHECK(json != NULL);
    CHECK(strstr(json, "],\"refused\":[{\"node_id\":\"x\",\"local_step\":9,\"norm\":100,\"bound\":10,\"reason\":\"max_norm\","
                       "\"received_unix\":1764547202.500}]}") != NULL);
    CHECK_EQ(history_record_parse(&back, json), 0);
    CHECK_EQ(back.nrefused, (size_t)1);
    CHECK_EQ(back.nquarantined, (size_t)1);
    CHECK_STR(back.refused[0].node_id, "x");
    CHECK(back.refused[0].norm == 100 && back.refused[0].received_at == 1764547202.5);
    history_record_free(&back);
    history_record_free(&r);
    free(json);
}
