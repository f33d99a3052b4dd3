/* The step pipeline (server/core/pipeline.h): the table of legal moves, pair by pair against a list
 * written out here; a step driven from collecting to cleaned with its completions in both orders;
 * retries, reopened rounds and failures; steps entered whole; the histogram of time per state on a
 * fake clock; and the bounded table of records. */
#include "test.h"

#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "pipeline.h"

static double fake_now;

static double fake_clock(void)
{
    return fake_now;
}

static double fake_wall(void)
{
    return 1.7e9 + fake_now;
}

/* The legal moves, as server/README's state table lists them. */
static const struct {
    step_state from, to;
} legal_moves[] = {
    {STEP_COLLECTING, STEP_COMPUTING},
    {STEP_COMPUTING, STEP_INPUTS_DURABLE},
    {STEP_COMPUTING, STEP_RETRY_WAIT},
    {STEP_COMPUTING, STEP_COLLECTING},
    {STEP_COMPUTING, STEP_FAILED},
    {STEP_INPUTS_DURABLE, STEP_COMMITTED},
    {STEP_INPUTS_DURABLE, STEP_RETRY_WAIT},
    {STEP_COMMITTED, STEP_SERVED},
    {STEP_SERVED, STEP_PUBLISHED},
    {STEP_SERVED, STEP_DURABLE},
    {STEP_PUBLISHED, STEP_DURABLE},
    {STEP_DURABLE, STEP_CLEANED},
    {STEP_RETRY_WAIT, STEP_COMPUTING},
};

TEST(pipeline_every_legal_and_illegal_move)
{
    unsigned legal = 0, illegal = 0;

    for (int from = 0; from < STEP_NSTATES; from++) {
        for (int to = 0; to < STEP_NSTATES; to++) {
            int want = 0;
            for (size_t i = 0; i < sizeof(legal_moves) / sizeof(legal_moves[0]); i++)
                want |= legal_moves[i].from == (step_state)from && legal_moves[i].to == (step_state)to;
            CHECK_EQ(step_move_legal((step_state)from, (step_state)to), want);
            legal += want;
            illegal += !want;
        }
    }
    CHECK_EQ(legal, 13);
    CHECK_EQ(illegal, STEP_NSTATES * STEP_NSTATES - 13);
    CHECK(!step_move_legal(STEP_NSTATES, STEP_COLLECTING));
    CHECK(!step_move_legal(STEP_COLLECTING, STEP_NSTATES));
    CHECK_STR(step_state_name(STEP_INPUTS_DURABLE), "inputs_durable");
    CHECK_STR(step_state_name(STEP_RETRY_WAIT), "retry_wait");
    CHECK_STR(step_state_name(STEP_NSTATES), "unknown");

    /* an illegal move through the pipeline changes nothing and is counted */
    pipeline p;
    pipeline_init(&p, fake_clock, fake_wall);
    CHECK_EQ(pipeline_begin(&p, 1, STEP_COLLECTING), 0);
    CHECK_EQ(pipeline_move(&p, 1, STEP_COMMITTED), -1);
    CHECK_EQ(pipeline_find(&p, 1)->state, STEP_COLLECTING);
    CHECK_EQ(pipeline_move(&p, 2, STEP_COMPUTING), -1);        /* not in the pipeline */
    CHECK_EQ(pipeline_begin(&p, 1, STEP_COLLECTING), -1);      /* there already */
    CHECK_EQ(p.illegal, 3);
}

/* A cluster's step's legal moves (pipeline.h, step_strategy), written out: its own column of the table. */
static const struct {
    step_state from, to;
} cluster_moves[] = {
    {STEP_COLLECTING, STEP_CLUSTER_MANIFEST},
    {STEP_COLLECTING, STEP_PUBLISHED},
    {STEP_COLLECTING, STEP_FAILED},
    {STEP_CLUSTER_MANIFEST, STEP_CLUSTER_SHARDS},
    {STEP_CLUSTER_MANIFEST, STEP_COLLECTING},
    {STEP_CLUSTER_MANIFEST, STEP_PUBLISHED},
    {STEP_CLUSTER_MANIFEST, STEP_FAILED},
    {STEP_CLUSTER_SHARDS, STEP_CLUSTER_PUBLISH},
    {STEP_CLUSTER_SHARDS, STEP_COLLECTING},
    {STEP_CLUSTER_SHARDS, STEP_PUBLISHED},
    {STEP_CLUSTER_SHARDS, STEP_FAILED},
    {STEP_CLUSTER_PUBLISH, STEP_CLUSTER_SHARDS},
    {STEP_CLUSTER_PUBLISH, STEP_COLLECTING},
    {STEP_CLUSTER_PUBLISH, STEP_PUBLISHED},
    {STEP_CLUSTER_PUBLISH, STEP_FAILED},
    {STEP_PUBLISHED, STEP_DURABLE},
    {STEP_DURABLE, STEP_CLEANED},
    {STEP_FAILED, STEP_COLLECTING},
    {STEP_FAILED, STEP_CLUSTER_MANIFEST},
    {STEP_FAILED, STEP_CLUSTER_SHARDS},
    {STEP_FAILED, STEP_PUBLISHED},
};

TEST(pipeline_cluster_column_every_legal_and_illegal_move)
{
    unsigned legal = 0, n = sizeof(cluster_moves) / sizeof(cluster_moves[0]);

    for (int from = 0; from < STEP_NSTATES; from++) {
        for (int to = 0; to < STEP_NSTATES; to++) {
            int want = 0;
            for (size_t i = 0; i < n; i++)
                want |= cluster_moves[i].from == (step_state)from && cluster_moves[i].to == (step_state)to;
            CHECK_EQ(step_move_legal_as(STEP_CLUSTER, (step_state)from, (step_state)to), want);
            legal += want;
        }
    }
    CHECK_EQ(legal, n);
    CHECK_STR(step_state_name(STEP_CLUSTER_SHARDS), "cluster_shards");
    /* the cluster's states are not a local step's, nor the local pass's moves a cluster step's */
    CHECK(!step_move_legal(STEP_COLLECTING, STEP_CLUSTER_MANIFEST));
    CHECK(!step_move_legal_as(STEP_CLUSTER, STEP_COLLECTING, STEP_COMPUTING));

    /* a cluster step through its column: a refusal reopens the round, an overflow at the publish goes back
     * to the shards, then published, durable, cleaned; each state timed */
    pipeline p;
    fake_now = 0;
    pipeline_init(&p, fake_clock, fake_wall);
    CHECK_EQ(pipeline_begin_as(&p, 4, STEP_COLLECTING, STEP_CLUSTER), 0);
    CHECK_EQ(pipeline_find(&p, 4)->strategy, STEP_CLUSTER);
    step_state path[] = {STEP_CLUSTER_MANIFEST, STEP_CLUSTER_SHARDS, STEP_COLLECTING, STEP_CLUSTER_MANIFEST,
                         STEP_CLUSTER_SHARDS, STEP_CLUSTER_PUBLISH, STEP_CLUSTER_SHARDS, STEP_CLUSTER_PUBLISH,
                         STEP_PUBLISHED, STEP_DURABLE, STEP_CLEANED};
    for (size_t i = 0; i < sizeof(path) / sizeof(path[0]); i++) {
        fake_now += 1;
        CHECK_EQ(pipeline_move(&p, 4, path[i]), 0);
    }
    CHECK_EQ(p.seconds[STEP_CLUSTER_SHARDS].count, 3);
    CHECK_EQ(p.seconds[STEP_CLUSTER_PUBLISH].count, 2);
    CHECK_EQ(p.illegal, 0);
    /* a local move on a cluster step is refused, and a cluster state on a local step */
    CHECK_EQ(pipeline_begin_as(&p, 5, STEP_COLLECTING, STEP_CLUSTER), 0);
    CHECK_EQ(pipeline_move(&p, 5, STEP_COMPUTING), -1);
    CHECK_EQ(pipeline_begin(&p, 6, STEP_COLLECTING), 0);
    CHECK_EQ(pipeline_move(&p, 6, STEP_CLUSTER_MANIFEST), -1);
    CHECK_EQ(p.illegal, 2);
}

/* Drives step 1 to served; the caller adds what follows. */
static void to_served(pipeline *p)
{
    CHECK_EQ(pipeline_begin(p, 1, STEP_COLLECTING), 0);
    CHECK_EQ(pipeline_move(p, 1, STEP_COMPUTING), 0);
    CHECK_EQ(pipeline_move(p, 1, STEP_INPUTS_DURABLE), 0);
    CHECK_EQ(pipeline_move(p, 1, STEP_COMMITTED), 0);
    CHECK_EQ(pipeline_move(p, 1, STEP_SERVED), 0);
}

TEST(pipeline_step_from_collecting_to_cleaned_in_both_orders)
{
    pipeline p;

    /* the publish first (file://: the settle follows the publish) */
    pipeline_init(&p, fake_clock, fake_wall);
    to_served(&p);
    CHECK(!pipeline_find(&p, 1)->published);
    pipeline_published(&p, 1);
    CHECK_EQ(pipeline_find(&p, 1)->state, STEP_PUBLISHED);
    CHECK(pipeline_find(&p, 1)->published);
    pipeline_durable(&p, 1);
    CHECK_EQ(pipeline_find(&p, 1)->state, STEP_DURABLE);
    pipeline_cleaned(&p, 1);
    CHECK_EQ(pipeline_find(&p, 1)->state, STEP_CLEANED);
    CHECK_EQ(p.illegal, 0);

    /* the settle first (hf://, s3://: beside the publish): durable at once, the publish recorded after */
    pipeline_init(&p, fake_clock, fake_wall);
    to_served(&p);
    pipeline_durable(&p, 1);
    CHECK_EQ(pipeline_find(&p, 1)->state, STEP_DURABLE);
    CHECK(!pipeline_find(&p, 1)->published);
    pipeline_cleaned(&p, 1);
    CHECK_EQ(pipeline_find(&p, 1)->state, STEP_CLEANED);
    pipeline_published(&p, 1);
    CHECK_EQ(pipeline_find(&p, 1)->state, STEP_CLEANED);
    CHECK(pipeline_find(&p, 1)->published);
    CHECK_EQ(p.illegal, 0);

    /* never published (no transport, or a later step published instead) */
    pipeline_init(&p, fake_clock, fake_wall);
    to_served(&p);
    pipeline_durable(&p, 1);
    pipeline_cleaned(&p, 1);
    CHECK_EQ(pipeline_find(&p, 1)->state, STEP_CLEANED);
    CHECK(!pipeline_find(&p, 1)->published);
    CHECK_EQ(p.illegal, 0);

    /* a settle reported for a step still computing is refused by the table */
    pipeline_init(&p, fake_clock, fake_wall);
    CHECK_EQ(pipeline_begin(&p, 1, STEP_COLLECTING), 0);
    CHECK_EQ(pipeline_move(&p, 1, STEP_COMPUTING), 0);
    pipeline_durable(&p, 1);
    CHECK_EQ(pipeline_find(&p, 1)->state, STEP_COMPUTING);
    CHECK_EQ(p.illegal, 1);
}

static uint64_t refused_step;
static char refused_what[128];
static int refusals;

static void on_refusal(void *arg, uint64_t step, const char *what)
{
    (*(int *)arg)++;
    refused_step = step;
    snprintf(refused_what, sizeof(refused_what), "%s", what);
}

TEST(pipeline_refusals_reach_the_owner_or_abort_under_the_strict_test_mode)
{
    pipeline p;

    unsetenv("DILOCOD_TEST_STRICT_PIPELINE");
    pipeline_init(&p, fake_clock, fake_wall);
    pipeline_on_illegal(&p, on_refusal, &refusals);
    CHECK_EQ(pipeline_begin(&p, 4, STEP_COLLECTING), 0);
    CHECK_EQ(refusals, 0);
    CHECK_EQ(pipeline_move(&p, 4, STEP_SERVED), -1);
    CHECK_EQ(refusals, 1);
    CHECK_EQ(refused_step, 4);
    CHECK_STR(refused_what, "from=collecting to=served");
    CHECK_EQ(pipeline_begin(&p, 4, STEP_DURABLE), -1);
    CHECK_EQ(refusals, 2);
    CHECK(strstr(refused_what, "there already") != NULL);
    CHECK_EQ(pipeline_end(&p, 4, STEP_ACT_PUBLISH, 1), -1);
    CHECK_EQ(refusals, 3);
    CHECK_EQ(p.illegal, 3);
    /* a settle that names a step a later settle made durable already is no refusal */
    CHECK_EQ(pipeline_move(&p, 4, STEP_COMPUTING), 0);
    CHECK_EQ(pipeline_move(&p, 4, STEP_INPUTS_DURABLE), 0);
    CHECK_EQ(pipeline_move(&p, 4, STEP_COMMITTED), 0);
    CHECK_EQ(pipeline_move(&p, 4, STEP_SERVED), 0);
    CHECK_EQ(pipeline_begin(&p, 5, STEP_COLLECTING), 0);
    pipeline_durable(&p, 4);
    pipeline_durable(&p, 4);
    CHECK_EQ(pipeline_find(&p, 4)->state, STEP_DURABLE);
    CHECK_EQ(refusals, 3);

    /* DILOCOD_TEST_STRICT_PIPELINE=1: the first refusal aborts, where the bug is */
    pid_t child = fork();
    CHECK(child >= 0);
    if (child == 0) {
        setenv("DILOCOD_TEST_STRICT_PIPELINE", "1", 1);
        pipeline_init(&p, fake_clock, fake_wall);
        (void)pipeline_begin(&p, 1, STEP_COLLECTING);
        (void)pipeline_move(&p, 1, STEP_CLEANED);
        _exit(0);       /* not reached when it aborts */
    }
    int status = 0;
    CHECK_EQ(waitpid(child, &status, 0), child);
    CHECK(WIFSIGNALED(status) && WTERMSIG(status) == SIGABRT);
}

TEST(pipeline_retries_reopened_rounds_and_failures)
{
    pipeline p;

    pipeline_init(&p, fake_clock, fake_wall);
    CHECK_EQ(pipeline_begin(&p, 4, STEP_COLLECTING), 0);
    CHECK_EQ(pipeline_move(&p, 4, STEP_COMPUTING), 0);
    CHECK_EQ(pipeline_move(&p, 4, STEP_RETRY_WAIT), 0);        /* the pass failed */
    CHECK_EQ(pipeline_move(&p, 4, STEP_COMPUTING), 0);
    CHECK_EQ(pipeline_move(&p, 4, STEP_COLLECTING), 0);        /* a rewritten input dropped */
    CHECK_EQ(pipeline_move(&p, 4, STEP_COMPUTING), 0);
    CHECK_EQ(pipeline_move(&p, 4, STEP_INPUTS_DURABLE), 0);
    CHECK_EQ(pipeline_move(&p, 4, STEP_RETRY_WAIT), 0);        /* the redo record could not be written */
    CHECK_EQ(pipeline_move(&p, 4, STEP_COMPUTING), 0);
    CHECK_EQ(pipeline_move(&p, 4, STEP_FAILED), 0);            /* the committed global was rewritten */
    CHECK_EQ(pipeline_move(&p, 4, STEP_COMPUTING), -1);        /* failed is final */
    CHECK_EQ(p.illegal, 1);
}

TEST(pipeline_steps_in_flight_side_by_side_and_entered_whole)
{
    pipeline p;

    pipeline_init(&p, fake_clock, fake_wall);
    CHECK_EQ(pipeline_begin(&p, 8, STEP_COLLECTING), 0);
    CHECK_EQ(pipeline_begin(&p, 7, STEP_DURABLE), 0);          /* adopted: committed whole */
    CHECK_EQ(p.n, 2);
    CHECK_EQ(p.rec[0].step, 7);                                 /* by step */
    CHECK_EQ(p.rec[1].step, 8);
    pipeline_cleaned(&p, 7);
    CHECK_EQ(pipeline_find(&p, 7)->state, STEP_CLEANED);
    CHECK_EQ(pipeline_find(&p, 8)->state, STEP_COLLECTING);    /* cleaning is of durable steps only */
    pipeline_published(&p, 7);                                  /* published after: recorded, no move */
    CHECK_EQ(pipeline_find(&p, 7)->state, STEP_CLEANED);
    CHECK(pipeline_find(&p, 7)->published);
    CHECK_EQ(p.illegal, 0);

    /* the table keeps PIPELINE_MAX records: done ones make room, in-flight ones never do */
    pipeline_init(&p, fake_clock, fake_wall);
    for (uint64_t s = 0; s < PIPELINE_MAX; s++)
        CHECK_EQ(pipeline_begin(&p, s, s < 2 ? STEP_DURABLE : STEP_COLLECTING), 0);
    CHECK_EQ(pipeline_start(&p, 0, STEP_ACT_CLEANUP), 0);     /* durable ones whose cleanup runs */
    CHECK_EQ(pipeline_start(&p, 1, STEP_ACT_CLEANUP), 0);
    CHECK_EQ(pipeline_begin(&p, 100, STEP_COLLECTING), -1);
    p.illegal = 0;
    CHECK_EQ(pipeline_end(&p, 0, STEP_ACT_CLEANUP, 1), 0);
    pipeline_cleaned(&p, 0);
    CHECK_EQ(pipeline_begin(&p, 100, STEP_COLLECTING), 0);
    CHECK(pipeline_find(&p, 0) == NULL);
    CHECK(pipeline_find(&p, 1) != NULL);
    CHECK_EQ(p.n, PIPELINE_MAX);
    CHECK_EQ(p.rec[PIPELINE_MAX - 1].step, 100);
}

/* Async updates faster than the settles: each settle names the newest committed step, so steps before it
 * are served and never settled on their own.  They become durable with it, and cleaned after it, so the
 * table keeps room: left served, PIPELINE_MAX of them stopped every later step from being entered. */
static void drive_to_served(pipeline *p, uint64_t s)
{
    CHECK_EQ(pipeline_begin(p, s, STEP_COLLECTING), 0);
    CHECK_EQ(pipeline_move(p, s, STEP_COMPUTING), 0);
    CHECK_EQ(pipeline_move(p, s, STEP_INPUTS_DURABLE), 0);
    CHECK_EQ(pipeline_move(p, s, STEP_COMMITTED), 0);
    CHECK_EQ(pipeline_move(p, s, STEP_SERVED), 0);
}

TEST(pipeline_settle_of_a_later_step_settles_the_ones_before)
{
    pipeline p;

    pipeline_init(&p, fake_clock, fake_wall);
    for (uint64_t s = 1; s <= 3 * PIPELINE_MAX; s++) {
        drive_to_served(&p, s);
        if (s % 5 == 0) {                       /* one settle for five updates, the newest named */
            pipeline_published(&p, s);
            pipeline_durable(&p, s);
            pipeline_cleaned(&p, s);
            for (uint64_t e = s > 4 ? s - 4 : 1; e <= s; e++)
                CHECK(pipeline_find(&p, e) == NULL || pipeline_find(&p, e)->state == STEP_CLEANED);
        }
    }
    CHECK_EQ(p.illegal, 0);
    CHECK(p.n <= PIPELINE_MAX);
    CHECK_EQ(pipeline_find(&p, 3 * PIPELINE_MAX)->state, STEP_SERVED);

    /* settles that keep up but cleanups that do not: a full table of durable steps makes room with its
     * oldest (the later cleanup covers it), never with a step still running something */
    pipeline_init(&p, fake_clock, fake_wall);
    for (uint64_t s = 1; s <= PIPELINE_MAX; s++) {
        drive_to_served(&p, s);
        pipeline_durable(&p, s);
    }
    CHECK_EQ(pipeline_start(&p, 1, STEP_ACT_CLEANUP), 0);
    CHECK_EQ(pipeline_begin(&p, PIPELINE_MAX + 1, STEP_COLLECTING), 0);
    CHECK(pipeline_find(&p, 1) != NULL);                       /* busy: kept */
    CHECK(pipeline_find(&p, 2) == NULL);                       /* the oldest idle durable one made room */
    CHECK_EQ(p.n, PIPELINE_MAX);
    CHECK_EQ(p.illegal, 0);
}

TEST(pipeline_time_per_state_on_a_fake_clock)
{
    pipeline p;

    fake_now = 10;
    pipeline_init(&p, fake_clock, fake_wall);
    CHECK_EQ(pipeline_begin(&p, 1, STEP_COLLECTING), 0);
    CHECK(pipeline_find(&p, 1)->since_wall == 1.7e9 + 10);
    fake_now = 12.5;                                            /* 2.5 s collecting */
    CHECK_EQ(pipeline_move(&p, 1, STEP_COMPUTING), 0);
    fake_now = 12.5005;                                         /* 0.5 ms computing */
    CHECK_EQ(pipeline_move(&p, 1, STEP_INPUTS_DURABLE), 0);
    const state_histogram *h = &p.seconds[STEP_COLLECTING];
    CHECK_EQ(h->count, 1);
    CHECK(h->sum == 2.5);
    for (int i = 0; i < PIPELINE_NBUCKETS; i++)                 /* bounds 0.01 .. 600, then +Inf */
        CHECK_EQ(h->buckets[i], i == PIPELINE_NBUCKETS - 1 || PIPELINE_BUCKETS[i] >= 2.5 ? 1u : 0u);
    h = &p.seconds[STEP_COMPUTING];
    CHECK_EQ(h->count, 1);
    for (int i = 0; i < PIPELINE_NBUCKETS; i++)
        CHECK_EQ(h->buckets[i], 1u);                            /* 0.5 ms is under every bound */
    CHECK_EQ(p.seconds[STEP_INPUTS_DURABLE].count, 0);         /* not left yet */
    fake_now = 0;
}

/* What runs beside a state: started once, ended once, its failure kept until it starts again; the
 * queries the daemon's guards read (a commit waits for the sync and for every committed step to be
 * durable; a cleanup for any publish); a record that runs something is never dropped for room. */
TEST(pipeline_activities_beside_the_states)
{
    pipeline p;

    pipeline_init(&p, fake_clock, fake_wall);
    CHECK_EQ(pipeline_begin(&p, 5, STEP_SERVED), 0);          /* entered at any state (no move) */
    CHECK_EQ(pipeline_begin(&p, 6, STEP_COLLECTING), 0);
    CHECK(pipeline_unsettled(&p));                              /* step 5 is served, not durable */
    CHECK_EQ(pipeline_move(&p, 6, STEP_COMPUTING), 0);
    CHECK_EQ(pipeline_find(&p, 6)->attempts, 1u);
    CHECK_EQ(pipeline_start(&p, 6, STEP_ACT_PASS), 0);
    CHECK_EQ(pipeline_start(&p, 6, STEP_ACT_SYNC), 0);
    CHECK(pipeline_busy(&p, 6, STEP_ACT_PASS));
    CHECK(!pipeline_busy(&p, 5, STEP_ACT_PASS));
    CHECK_EQ(pipeline_start(&p, 6, STEP_ACT_PASS), -1);        /* twice: a guard is wrong */
    CHECK_EQ(p.illegal, 1);
    CHECK_EQ(pipeline_end(&p, 6, STEP_ACT_SYNC, 0), 0);        /* failed: kept */
    CHECK(pipeline_failed(&p, 6, STEP_ACT_SYNC));
    CHECK(!pipeline_busy(&p, 6, STEP_ACT_SYNC));
    CHECK_EQ(pipeline_end(&p, 6, STEP_ACT_SYNC, 1), -1);       /* not running */
    CHECK_EQ(p.illegal, 2);
    CHECK_EQ(pipeline_start(&p, 6, STEP_ACT_SYNC), 0);         /* again: the failure is forgotten */
    CHECK(!pipeline_failed(&p, 6, STEP_ACT_SYNC));
    CHECK_EQ(pipeline_end(&p, 6, STEP_ACT_SYNC, 1), 0);
    CHECK_EQ(pipeline_end(&p, 6, STEP_ACT_PASS, 1), 0);
    CHECK_EQ(pipeline_start(&p, 7, STEP_ACT_PASS), -1);        /* no such step */
    CHECK_EQ(p.illegal, 3);

    CHECK_EQ(pipeline_start(&p, 5, STEP_ACT_PUBLISH), 0);
    CHECK(pipeline_any_busy(&p, STEP_ACT_PUBLISH));
    CHECK(!pipeline_any_busy(&p, STEP_ACT_CLEANUP));
    pipeline_durable(&p, 5);
    CHECK(!pipeline_unsettled(&p));
    CHECK_EQ(pipeline_state(&p, 5), STEP_DURABLE);
    CHECK_EQ(pipeline_state(&p, 42), STEP_NSTATES);
    CHECK_EQ(pipeline_end(&p, 5, STEP_ACT_PUBLISH, 1), 0);
    CHECK(!pipeline_any_busy(&p, STEP_ACT_PUBLISH));
    CHECK_EQ(pipeline_move(&p, 6, STEP_RETRY_WAIT), 0);
    CHECK_EQ(pipeline_move(&p, 6, STEP_COMPUTING), 0);
    CHECK_EQ(pipeline_find(&p, 6)->attempts, 2u);               /* a sync of attempt 1 sees the change */
    CHECK(strcmp(step_activity_name(STEP_ACT_CLEANUP), "cleanup") == 0);
    CHECK(strcmp(step_activity_name(STEP_NACTS), "unknown") == 0);

    /* a done record still running something (a publish of a cleaned step) keeps its place */
    pipeline_init(&p, fake_clock, fake_wall);
    for (uint64_t s = 0; s < PIPELINE_MAX; s++)
        CHECK_EQ(pipeline_begin(&p, s, s < 2 ? STEP_DURABLE : STEP_COLLECTING), 0);
    CHECK_EQ(pipeline_start(&p, 0, STEP_ACT_PUBLISH), 0);
    pipeline_cleaned(&p, 1);
    CHECK_EQ(pipeline_begin(&p, 100, STEP_COLLECTING), 0);
    CHECK(pipeline_find(&p, 0) != NULL);                        /* busy: 1 went instead */
    CHECK(pipeline_find(&p, 1) == NULL);
    CHECK_EQ(pipeline_begin(&p, 101, STEP_COLLECTING), -1);
}

/* The daemon's guards driven by a fake pass, a fake sync and a fake transport: step 3 committed and
 * settling while step 4 collects and computes; step 4's commit waits for its pass, its sync and
 * step 3's settle (the publish and the settle end in either order), the cleanup for all of it, and a
 * sync still out when step 4 is computed again sees the new attempt. */
static void fake_pass_done(pipeline *p, uint64_t step)
{
    CHECK_EQ(pipeline_end(p, step, STEP_ACT_PASS, 1), 0);
}

TEST(pipeline_guards_driven_by_a_fake_pass_and_transport)
{
    for (int publish_first = 0; publish_first < 2; publish_first++) {
        pipeline p;

        pipeline_init(&p, fake_clock, fake_wall);
        CHECK_EQ(pipeline_begin(&p, 3, STEP_SERVED), 0);       /* committed, served, settling */
        CHECK_EQ(pipeline_start(&p, 3, STEP_ACT_PUBLISH), 0);
        CHECK_EQ(pipeline_begin(&p, 4, STEP_COLLECTING), 0);
        CHECK(!pipeline_cleanup_ready(&p, 4));                  /* step 3 settles and is published */
        CHECK_EQ(pipeline_move(&p, 4, STEP_COMPUTING), 0);
        CHECK_EQ(pipeline_start(&p, 4, STEP_ACT_PASS), 0);
        CHECK_EQ(pipeline_start(&p, 4, STEP_ACT_SYNC), 0);
        CHECK(!pipeline_outputs_written(&p, 4));
        fake_pass_done(&p, 4);
        CHECK(pipeline_outputs_written(&p, 4));
        CHECK(!pipeline_commit_ready(&p, 4));                   /* the sync, and step 3's settle */
        CHECK_EQ(pipeline_end(&p, 4, STEP_ACT_SYNC, 1), 0);
        CHECK(!pipeline_commit_ready(&p, 4));                   /* step 3's settle */
        if (publish_first) {
            CHECK_EQ(pipeline_end(&p, 3, STEP_ACT_PUBLISH, 1), 0);
            pipeline_published(&p, 3);
            CHECK(!pipeline_commit_ready(&p, 4));
            pipeline_durable(&p, 3);
        } else {
            pipeline_durable(&p, 3);
            CHECK(pipeline_commit_ready(&p, 4));                /* a publish does not hold the commit */
            CHECK(!pipeline_cleanup_ready(&p, 4));              /* but it holds the cleanup */
            CHECK_EQ(pipeline_end(&p, 3, STEP_ACT_PUBLISH, 1), 0);
            pipeline_published(&p, 3);
        }
        CHECK_EQ(pipeline_state(&p, 3), STEP_DURABLE);
        CHECK(pipeline_find(&p, 3)->published);
        CHECK(pipeline_commit_ready(&p, 4));
        CHECK(!pipeline_cleanup_ready(&p, 4));                  /* step 4's commit waits */
        CHECK_EQ(pipeline_move(&p, 4, STEP_INPUTS_DURABLE), 0); /* the commit queued: once */
        CHECK(!pipeline_commit_ready(&p, 4));
        CHECK_EQ(pipeline_move(&p, 4, STEP_COMMITTED), 0);
        CHECK_EQ(pipeline_move(&p, 4, STEP_SERVED), 0);
        CHECK_EQ(pipeline_begin(&p, 5, STEP_COLLECTING), 0);
        CHECK(!pipeline_cleanup_ready(&p, 5));                  /* step 4 settles */
        pipeline_durable(&p, 4);
        CHECK(pipeline_cleanup_ready(&p, 5));
        CHECK_EQ(pipeline_start(&p, 4, STEP_ACT_CLEANUP), 0);
        CHECK(!pipeline_cleanup_ready(&p, 5));                  /* one at a time */
        CHECK_EQ(pipeline_end(&p, 4, STEP_ACT_CLEANUP, 1), 0);
        pipeline_cleaned(&p, 4);
        CHECK_EQ(pipeline_state(&p, 3), STEP_CLEANED);
        CHECK_EQ(pipeline_state(&p, 4), STEP_CLEANED);

        /* step 5: its first pass fails while its sync is out; the retry's pass ends first */
        CHECK_EQ(pipeline_move(&p, 5, STEP_COMPUTING), 0);
        CHECK_EQ(pipeline_start(&p, 5, STEP_ACT_PASS), 0);
        CHECK_EQ(pipeline_start(&p, 5, STEP_ACT_SYNC), 0);
        unsigned synced_attempt = pipeline_find(&p, 5)->attempts;
        CHECK_EQ(pipeline_end(&p, 5, STEP_ACT_PASS, 0), 0);
        CHECK_EQ(pipeline_move(&p, 5, STEP_RETRY_WAIT), 0);
        CHECK(!pipeline_outputs_written(&p, 5));
        CHECK_EQ(pipeline_move(&p, 5, STEP_COMPUTING), 0);
        CHECK_EQ(pipeline_start(&p, 5, STEP_ACT_PASS), 0);
        fake_pass_done(&p, 5);
        CHECK(!pipeline_commit_ready(&p, 5));                   /* the old sync is out */
        CHECK(pipeline_find(&p, 5)->attempts != synced_attempt); /* it syncs again when it ends */
        CHECK_EQ(pipeline_end(&p, 5, STEP_ACT_SYNC, 1), 0);
        CHECK_EQ(pipeline_start(&p, 5, STEP_ACT_SYNC), 0);
        CHECK_EQ(pipeline_end(&p, 5, STEP_ACT_SYNC, 0), 0);     /* the new sync fails */
        CHECK(pipeline_commit_ready(&p, 5));
        CHECK(pipeline_failed(&p, 5, STEP_ACT_SYNC));           /* the caller retries the step on it */
        CHECK_EQ(p.illegal, 0);
    }
}

/* The test hook's variable (pipeline.h): a state, or a state and a step; anything else is ignored
 * (logged at error level), so that a typo never kills a daemon at a state nobody meant. */
TEST(pipeline_crash_hook_is_read_once_and_validated)
{
    static const struct {
        const char *value;
        step_state at;
        int64_t step;
    } cases[] = {
        {"served", STEP_SERVED, -1},
        {"inputs_durable:12", STEP_INPUTS_DURABLE, 12},
        {"collecting:0", STEP_COLLECTING, 0},
        {"", STEP_NSTATES, -1},
        {"serve", STEP_NSTATES, -1},
        {"servedx", STEP_NSTATES, -1},
        {"served:", STEP_NSTATES, -1},
        {"served:x", STEP_NSTATES, -1},
        {"served:-1", STEP_NSTATES, -1},
        {"served:1x", STEP_NSTATES, -1},
        {"served:99999999999999999999", STEP_NSTATES, -1},
        {":3", STEP_NSTATES, -1},
    };
    pipeline p;

    pipeline_init(&p, fake_clock, fake_wall);
    CHECK_EQ(p.crash_at, STEP_NSTATES);                         /* unset: no hook */
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        CHECK_EQ(setenv("DILOCOD_TEST_CRASH_AT", cases[i].value, 1), 0);
        pipeline_init(&p, fake_clock, fake_wall);
        CHECK_EQ(p.crash_at, cases[i].at);
        CHECK_EQ(p.crash_step, cases[i].step);
    }
    CHECK_EQ(setenv("DILOCOD_TEST_CRASH_AT", "cleaned:5", 1), 0);
    pipeline_init(&p, fake_clock, fake_wall);
    CHECK_EQ(unsetenv("DILOCOD_TEST_CRASH_AT"), 0);
    /* other steps, and other states of step 5, move as usual (the process is still here) */
    CHECK_EQ(pipeline_begin(&p, 4, STEP_DURABLE), 0);
    CHECK_EQ(pipeline_begin(&p, 5, STEP_SERVED), 0);
    pipeline_cleaned(&p, 4);
    pipeline_durable(&p, 5);
    CHECK_EQ(pipeline_find(&p, 4)->state, STEP_CLEANED);
    CHECK_EQ(pipeline_find(&p, 5)->state, STEP_DURABLE);
}
