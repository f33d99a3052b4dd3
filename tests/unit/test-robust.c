/* The robust rules' verdicts and scales (server/daemon_robust.c; README, "Robust aggregation") on a
 * daemon reduced to what they read: the configuration, the round's entries and the robust memory.  A
 * minority of nodes tries to turn each against the honest ones (issue 33): the norm screen at an
 * arrival and at the close, clipped_mean's clipping norm, weighted_mean's weights.  The integration
 * tests (test_robust_minority.py) run the same attacks through the real binary; these pin the
 * arithmetic.  daemon_internal.h and daemon_parts.h are the daemon's private headers: a unit test is
 * the one other reader (lint-layers checks server/ only), as curl's unit tests read curl's internals. */
#include "test.h"

#include <math.h>
#include <stdlib.h>

#include "daemon_internal.h"
#include "daemon_parts.h"

#define CHECK_DBL(a, b)                                                                               \
    do {                                                                                              \
        double va_ = (double)(a), vb_ = (double)(b);                                                  \
        if (!(va_ == vb_)) {                                                                          \
            fprintf(stderr, "  %s:%d: CHECK(%s == %s) failed: %.17g vs %.17g\n", __FILE__, __LINE__, #a, #b, \
                    va_, vb_);                                                                        \
            test_fail();                                                                              \
            return;                                                                                   \
        }                                                                                             \
    } while (0)

/* A sync daemon with cfg and the entries of these ids and norms (nfill of them; the callers keep the
 * ids ascending, as the round does), the first nopen of them in the open round. */
typedef struct fixture {
    dilocod d;
    config cfg;
    round_entry entries[8];
} fixture;

static void setup(fixture *f, unsigned expected, double ratio, const char *const *ids, const double *norms,
                  size_t nfill, size_t nopen)
{
    memset(f, 0, sizeof(*f));
    f->cfg.expected_nodes = expected;
    f->cfg.max_norm_ratio = ratio;
    f->cfg.max_weight_ratio = 10;
    f->d.cfg = &f->cfg;
    f->d.rnd.entries = f->entries;
    f->d.rnd.n = nopen;
    f->d.rnd.expected_nodes = expected;
    for (size_t i = 0; i < nfill; i++) {
        snprintf(f->entries[i].node_id, sizeof(f->entries[i].node_id), "%s", ids[i]);
        f->entries[i].norm = norms[i];
        f->entries[i].has_norm = 1;
    }
}

static delta_info offer_of(const char *id, double norm)
{
    delta_info info;

    memset(&info, 0, sizeof(info));
    snprintf(info.node_id, sizeof(info.node_id), "%s", id);
    info.norm = norm;
    info.has_norm = 1;
    return info;
}

/* Three nodes, the attacker's delta of norm 2e-20 in first: once the median of each honest delta's
 * others was the attacker's, and both honest deltas were refused.  Now the node still to come counts
 * as a larger norm, and the close's median is an honest one. */
TEST(norm_screen_tiny_attacker_first_refuses_no_honest_delta)
{
    static fixture f;
    const char *ids[] = {"a0", "h0", "h1"};
    const double norms[] = {2e-20, 2.0, 2.1};
    delta_info h0 = offer_of("h0", 2.0), h1 = offer_of("h1", 2.1);

    setup(&f, 3, 10, ids, norms, 3, 1);
    CHECK_EQ(daemon__robust_screen_offer(&f.d, &h0), 0);
    f.d.rnd.n = 2;
    CHECK_EQ(daemon__robust_screen_offer(&f.d, &h1), 0);
    f.d.rnd.n = 3;
    daemon__robust_screen_close(&f.d);
    for (size_t i = 0; i < 3; i++)
        CHECK_EQ(f.entries[i].quarantined, 0);
    CHECK_EQ(f.d.robust.quarantined[ROBUST_NORM_RATIO], 0);
    daemon__robust_free(&f.d);
}

/* Five nodes, two attackers in first with norm 2e-20: every honest arrival passes (the two expected
 * nodes not in yet outvote the attackers), and the close quarantines nobody. */
TEST(norm_screen_two_tiny_attackers_of_five)
{
    static fixture f;
    const char *ids[] = {"a0", "a1", "h0", "h1", "h2"};
    const double norms[] = {2e-20, 3e-20, 2.0, 2.2, 1.9};

    setup(&f, 5, 10, ids, norms, 5, 2);
    for (size_t i = 2; i < 5; i++) {
        delta_info h = offer_of(ids[i], norms[i]);
        CHECK_EQ(daemon__robust_screen_offer(&f.d, &h), 0);
        f.d.rnd.n = i + 1;
    }
    daemon__robust_screen_close(&f.d);
    for (size_t i = 0; i < 5; i++)
        CHECK_EQ(f.entries[i].quarantined, 0);
    daemon__robust_free(&f.d);
}

/* A huge delta: taken at its arrival while the nodes still to come could make any median, refused at
 * an arrival once the round is whole, and quarantined at the close with the bound R x an honest norm
 * (the lower median of the whole round, its own norm among it). */
TEST(norm_screen_huge_attacker_quarantined)
{
    static fixture f;
    const char *ids[] = {"a0", "h0", "h1", "h2"};
    const double norms[] = {2000.0, 2.0, 2.1, 1.9};
    delta_info late = offer_of("a0", 2000.0);

    setup(&f, 4, 10, ids, norms, 4, 0);
    CHECK_EQ(daemon__robust_screen_offer(&f.d, &late), 0);   /* nothing to compare with */
    f.d.rnd.n = 4;
    daemon__robust_screen_close(&f.d);
    CHECK_EQ(f.entries[0].quarantined, 1);
    CHECK_STR(f.entries[0].quarantine_reason, "norm_ratio");
    CHECK_DBL(f.entries[0].quarantine_bound, 10 * 2.0);      /* sorted 1.9 2.0 2.1 2000: the lower median */
    for (size_t i = 1; i < 4; i++)
        CHECK_EQ(f.entries[i].quarantined, 0);
    /* the attacker again, at the arrival that completes the round (its entry replaced): refused */
    f.entries[0].quarantined = 0;
    CHECK_EQ(daemon__robust_screen_offer(&f.d, &late), 1);
    daemon__robust_free(&f.d);
}

/* A sync round without an expected count closes by its timeout, and any number of nodes may still
 * come: an arrival is not judged by ratio (the close is). */
TEST(norm_screen_without_expected_nodes_waits_for_the_close)
{
    static fixture f;
    const char *ids[] = {"a0"};
    const double norms[] = {2e-20};
    delta_info h = offer_of("h0", 2.0);

    setup(&f, 0, 10, ids, norms, 1, 1);
    CHECK_EQ(daemon__robust_screen_offer(&f.d, &h), 0);
    daemon__robust_free(&f.d);
}

/* weighted_mean: two claims of 1e308 once summed to +inf and every scale was 0 (a zero step); one gave
 * the honest deltas 0.  Capped at R x the median (an honest 2 here: 1 2 2 1e308 1e308), taken in its
 * units. */
TEST(weighted_scales_cap_claimed_weights)
{
    static fixture f;
    const char *ids[] = {"a0", "a1", "h0", "h1", "h2"};
    const double norms[] = {1, 1, 1, 1, 1};
    const double w[] = {1e308, 1e308, 1.0, 2.0, 2.0};
    const round_entry *e[5];
    float scale[5];

    setup(&f, 5, 0, ids, norms, 5, 5);
    f.cfg.aggregate = RULE_WEIGHTED;
    for (size_t i = 0; i < 5; i++) {
        f.entries[i].metrics.have = DELTA_M_WEIGHT;
        f.entries[i].metrics.weight = w[i];
        e[i] = &f.entries[i];
    }
    CHECK_EQ(daemon__robust_scales(&f.d, e, 5, scale), 0);
    /* m = 2: u = 10, 10, 0.5, 1, 1; U = 22.5 */
    CHECK_DBL(scale[0], (float)(10 / 22.5));
    CHECK_DBL(scale[1], (float)(10 / 22.5));
    CHECK_DBL(scale[2], (float)(0.5 / 22.5));
    CHECK_DBL(scale[3], (float)(1 / 22.5));
    CHECK_DBL(scale[4], (float)(1 / 22.5));
    /* a median so small that w / m overflows: still R, never inf */
    f.entries[2].metrics.weight = 1e-300;
    f.entries[3].metrics.weight = 1e-300;
    f.entries[4].metrics.weight = 1e-300;
    CHECK_EQ(daemon__robust_scales(&f.d, e, 5, scale), 0);
    for (size_t i = 0; i < 5; i++)
        CHECK(isfinite(scale[i]) && scale[i] >= 0);
    CHECK_DBL(scale[2], (float)(1 / 23.0));                 /* u = 10, 10, 1, 1, 1 */
    CHECK_DBL(scale[0], (float)(10 / 23.0));
    /* R = 1: every weight above the median counts as the median */
    f.cfg.max_weight_ratio = 1;
    CHECK_EQ(daemon__robust_scales(&f.d, e, 5, scale), 0);
    for (size_t i = 0; i < 5; i++)
        CHECK_DBL(scale[i], (float)(1 / 5.0));
    daemon__robust_free(&f.d);
}

/* clipped_mean: the clipping norm is the lower median of every aggregated norm, the clipped delta's
 * own among them: an honest node's whichever way one of four lies. */
TEST(clipped_scales_median_is_an_honest_norm)
{
    static fixture f;
    const char *ids[] = {"a0", "h0", "h1", "h2"};
    const double tiny[] = {2e-20, 2.0, 3.0, 4.0}, huge[] = {4000.0, 2.0, 3.0, 4.0};
    const round_entry *e[4];
    float scale[4];

    setup(&f, 4, 0, ids, tiny, 4, 4);
    f.cfg.aggregate = RULE_CLIPPED;
    for (size_t i = 0; i < 4; i++)
        e[i] = &f.entries[i];
    CHECK_EQ(daemon__robust_scales(&f.d, e, 4, scale), 0);
    CHECK_DBL(scale[0], 1.0f);
    CHECK_DBL(scale[1], 1.0f);                              /* m = 2: the smallest honest norm */
    CHECK_DBL(scale[2], (float)(2.0 / 3.0));
    setup(&f, 4, 0, ids, huge, 4, 4);
    f.cfg.aggregate = RULE_CLIPPED;
    CHECK_EQ(daemon__robust_scales(&f.d, e, 4, scale), 0);
    CHECK_DBL(scale[0], (float)(3.0 / 4000.0));             /* m = 3 */
    CHECK_DBL(scale[1], 1.0f);
    daemon__robust_free(&f.d);
}
