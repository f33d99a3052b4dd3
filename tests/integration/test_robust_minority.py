"""A minority of workers tries to turn each robust rule against the honest majority (README, "Robust
aggregation"; issue 33, items 3 to 5), at N = 3, 4 and 5 nodes of which floor((N-1)/2) lie: 1, 1 and 2.

Each attacker sends either a *tiny* delta (the honest direction scaled to a norm near 2e-20, which once
made the median every honest delta was compared with), a *huge* one (the honest direction flipped and
1000x larger), or, for weighted_mean, a claimed weight of 1e308.  The attackers upload first, which is
the worst case for a verdict made at a delta's arrival (except a huge delta in async mode, which comes
after the honest nodes are known: before, there is nothing to compare it with).  In every case the honest deltas are aggregated
and the attackers' are quarantined or bounded, and the published global is, byte for byte, what torch
computes from the deltas the rule keeps (the oracles of test_robust.py).

Every wait is on a state dilocod reports (/status, /rounds), never a sleep."""
import numpy as np
import pytest

from test_async import AsyncOracle
# pytestmark: the torch oracles' AVX2/AVX-512 condition applies here too
from test_robust import (LR, MU, RuleOracle, as_wire, body_of, check_global, clip_scales, decoded, model,  # noqa: F401
                         norm_oracle, pytestmark, put, rand_delta, record_of, rule_oracle, start, status, wait_step,
                         weight_scales)

NODES = (3, 4, 5)
RATIO = 10
TINY = 2e-20                            # the attack's norm, as in the repro
HUGE = 1000


def cast(nodes):
    """(attackers, honest) node ids: the attackers sort first, so they are also first in node order."""
    k = (nodes - 1) // 2
    return [f"a{i}" for i in range(k)], [f"h{i}" for i in range(nodes - k)]


def honest_deltas(rng, state, names, common=None):
    """Deltas that agree on a direction (a shared part plus each node's noise), as honest workers'."""
    common = common if common is not None else rand_delta(rng, state, 0.02)
    out = {}
    for n in names:
        noise = rand_delta(rng, state, 0.005)
        out[n] = {k: (common[k] + noise[k]).astype(np.float32) for k in common}
    return out, common


def attack(rng, state, common, kind):
    """An attacker's delta: the honest direction at a norm near TINY, or flipped and HUGE times larger."""
    noise = rand_delta(rng, state, 0.005)
    d = {k: (common[k] + noise[k]).astype(np.float32) for k in common}
    if kind == "tiny":
        scale = np.float32(TINY / norm_oracle(decoded(d)))
    else:
        scale = np.float32(-HUGE)
    return {k: (v * scale).astype(np.float32) for k, v in d.items()}


def upload_all(d, deltas, order, base, local, extra=None):
    for node in order:
        code, body = put(d, node, local, body_of(as_wire(deltas[node]), node, base, local, (extra or {}).get(node)))
        assert code == 201, (node, code, body)


def round_deltas(rng, state, attackers, honest, kind):
    deltas, common = honest_deltas(rng, state, honest)
    for a in attackers:
        deltas[a] = attack(rng, state, common, kind)
    return deltas


# ---- the norm screen, sync: judged at each arrival and again at the close ---------------------------

@pytest.mark.parametrize("kind", ["tiny", "huge"])
@pytest.mark.parametrize("nodes", NODES)
def test_norm_screen_sync_keeps_the_honest_majority(tmp_path, nodes, kind):
    """--max-norm-ratio 10, the attackers first, two rounds.  Tiny: every delta is taken (a small norm is
    bounded already, and no honest delta is compared with the attackers' alone), and the round is the
    mean of all of them.  Huge: the attackers are taken at their arrival (the honest nodes still to come
    could make any median), then quarantined at the close; the round is the honest nodes' mean."""
    init = model(40 + nodes)
    oracle = RuleOracle(init, "mean")
    attackers, honest = cast(nodes)
    d = start(tmp_path, init, "--expected-nodes", str(nodes), "--max-norm-ratio", str(RATIO))
    try:
        rng = np.random.default_rng(100 + nodes)
        for step in range(2):
            deltas = round_deltas(rng, oracle.state, attackers, honest, kind)
            upload_all(d, deltas, attackers + honest, step, step + 1)
            wait_step(d, step + 1)
            kept = honest if kind == "huge" else attackers + honest
            check_global(d, oracle.step({n: decoded(deltas[n]) for n in kept}))
            rec = record_of(d, step + 1)
            assert [n["node_id"] for n in rec["nodes"]] == sorted(kept), rec
            assert sorted(q["node_id"] for q in rec["quarantined"]) == (attackers if kind == "huge" else []), rec
            for q in rec["quarantined"]:
                # the bound is R x an honest norm: the median of the round, the attackers' among it
                assert q["reason"] == "norm_ratio" and q["norm"] > q["bound"]
                assert q["bound"] / RATIO in [norm_oracle(decoded(deltas[h])) for h in honest], q
        assert status(d)["robust"]["quarantined_total"] == (2 * len(attackers) if kind == "huge" else 0)
    finally:
        assert d.stop() == 0


@pytest.mark.parametrize("kind", ["tiny", "huge"])
def test_norm_screen_without_expected_nodes_judges_at_the_close(tmp_path, kind):
    """A sync round closed by its timeout (no --expected-nodes) could always be outvoted by nodes still to
    come, so only its close judges by ratio: the tiny attacker sent first refuses no honest delta at its
    arrival, and the huge one is quarantined at the close."""
    init = model(45)
    oracle = RuleOracle(init, "mean")
    attackers, honest = cast(3)
    d = start(tmp_path, init, "--round-timeout", "0.5", "--min-nodes", "3", "--max-norm-ratio", str(RATIO))
    try:
        deltas = round_deltas(np.random.default_rng(145), oracle.state, attackers, honest, kind)
        upload_all(d, deltas, attackers + honest, 0, 1)
        wait_step(d, 1)
        kept = honest if kind == "huge" else attackers + honest
        check_global(d, oracle.step({n: decoded(deltas[n]) for n in kept}))
        rec = record_of(d, 1)
        assert [n["node_id"] for n in rec["nodes"]] == sorted(kept), rec
        assert [q["node_id"] for q in rec["quarantined"]] == (attackers if kind == "huge" else []), rec
    finally:
        assert d.stop() == 0


# ---- the norm screen, async: judged at each arrival against the other nodes' last norms ------------

def async_start(tmp_path, init, nodes, *args):
    return start(tmp_path, init, "--mode", "async", "--expected-nodes", str(nodes), "--dn-period", "2", *args)


def send_update(d, oracle, node, delta, aggregate=None):
    """One async update of one delta (no grace window): uploaded at the current step, applied, checked."""
    step = status(d)["outer_step"]
    code, body = put(d, node, step + 1, body_of(as_wire(delta), node, step, step + 1))
    assert code == 201, (node, code, body)
    wait_step(d, step + 1)
    rec = record_of(d, step + 1)
    assert [n["node_id"] for n in rec["nodes"]] == [node], rec
    oracle.update([decoded(delta)], rec["weight"], aggregate=aggregate)
    check_global(d, oracle.state)
    return rec


def refused_outlier(d, node, delta):
    step = status(d)["outer_step"]
    code, body = put(d, node, step + 1, body_of(as_wire(delta), node, step, step + 1))
    assert code == 422 and body["error"]["code"] == "outlier", (node, code, body)
    assert status(d)["outer_step"] == step


@pytest.mark.parametrize("kind", ["tiny", "huge"])
@pytest.mark.parametrize("nodes", NODES)
def test_norm_screen_async_keeps_the_honest_majority(tmp_path, nodes, kind):
    """Async mode, --max-norm-ratio 10, each delta one update, two passes over the nodes.  Tiny: the
    attackers go first and are applied (nothing to compare with), and no honest delta after them is
    refused, however few honest norms are known yet.  Huge: once the honest nodes are known, every
    attacker's delta is refused at its arrival (422 outlier), and the updates are the honest ones."""
    init = model(50 + nodes)
    oracle = AsyncOracle(init, 2, lr=LR, mu=MU)
    attackers, honest = cast(nodes)
    d = async_start(tmp_path, init, nodes, "--max-norm-ratio", str(RATIO))
    try:
        rng = np.random.default_rng(200 + nodes)
        for _ in range(2):
            deltas = round_deltas(rng, oracle.state, attackers, honest, kind)
            order = attackers + honest if kind == "tiny" else honest + attackers
            for node in order:
                if node in attackers and kind == "huge":
                    refused_outlier(d, node, deltas[node])
                else:
                    send_update(d, oracle, node, deltas[node])
        st = status(d)["robust"]
        assert st["quarantined_total"] == (2 * len(attackers) if kind == "huge" else 0), st
        assert {q["node_id"] for q in st["quarantined"]} == (set(attackers) if kind == "huge" else set())
    finally:
        assert d.stop() == 0


# ---- clipped_mean ---------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["tiny", "huge"])
@pytest.mark.parametrize("nodes", NODES)
def test_clipped_mean_bounds_the_minority(tmp_path, nodes, kind):
    """--aggregate clipped_mean: the clipping norm m is the lower median of the round's norms, an honest
    node's whichever way the minority lies.  Huge: each attacker's delta is clipped to it.  Tiny: no
    honest delta is clipped below the smallest honest norm."""
    init = model(60 + nodes)
    oracle = RuleOracle(init, "clipped_mean")
    attackers, honest = cast(nodes)
    d = start(tmp_path, init, "--expected-nodes", str(nodes), "--aggregate", "clipped_mean")
    try:
        rng = np.random.default_rng(300 + nodes)
        deltas = round_deltas(rng, oracle.state, attackers, honest, kind)
        upload_all(d, deltas, attackers + honest, 0, 1)
        wait_step(d, 1)
        order = sorted(deltas)
        norms = {n: norm_oracle(decoded(deltas[n])) for n in order}
        oracle.scales = clip_scales([norms[n] for n in order])
        check_global(d, oracle.step({n: decoded(v) for n, v in deltas.items()}))
        rec = record_of(d, 1)
        scale = {n["node_id"]: np.float32(n["scale"]) for n in rec["nodes"]}
        assert [scale[n] for n in order] == oracle.scales
        m = sorted(norms.values())[(nodes - 1) // 2]
        assert m in [norms[h] for h in honest]
        for h in honest:
            assert scale[h] * norms[h] >= min(norms[x] for x in honest) * (1 - 1e-6)
        for a in attackers:
            assert scale[a] * norms[a] <= m * (1 + 1e-6)
    finally:
        assert d.stop() == 0


@pytest.mark.parametrize("nodes", NODES)
def test_clipped_mean_async_bounds_a_huge_delta(tmp_path, nodes):
    """Async mode, --aggregate clipped_mean, each delta one update: an update's clipping norm is the lower
    median of its own norm and each other node's last aggregated norm (alone, an update would clip
    nothing).  The honest nodes first, then each attacker's huge delta: applied, clipped to an honest
    node's norm."""
    init = model(70 + nodes)
    oracle = AsyncOracle(init, 2, lr=LR, mu=MU)
    attackers, honest = cast(nodes)
    d = async_start(tmp_path, init, nodes, "--aggregate", "clipped_mean")
    try:
        rng = np.random.default_rng(400 + nodes)
        deltas = round_deltas(rng, oracle.state, attackers, honest, "huge")
        last = {}
        for node in honest + attackers:
            norm = norm_oracle(decoded(deltas[node]))
            ref = [norm] + [v for n, v in last.items() if n != node]
            m = sorted(ref)[(len(ref) - 1) // 2]
            s = clip_scales([norm]) if not ref[1:] else [np.float32(min(1.0, m / norm))]
            rec = send_update(d, oracle, node, deltas[node],
                              aggregate=lambda xs, s=s: rule_oracle("clipped_mean", xs, s))
            assert np.float32(rec["nodes"][0]["scale"]) == s[0], (node, rec)
            if node in attackers:
                assert s[0] < 1e-2 and m in [last[h] for h in honest]
            last[node] = norm
    finally:
        assert d.stop() == 0


# ---- weighted_mean --------------------------------------------------------------------------------

@pytest.mark.parametrize("ratio", [None, 1])
@pytest.mark.parametrize("nodes", NODES)
def test_weighted_mean_caps_a_claimed_weight(tmp_path, nodes, ratio):
    """--aggregate weighted_mean, the attackers claiming weight 1e308 (two of them once summed to inf
    and committed a zero step; one gave every honest delta scale 0).  Each weight is capped at
    --max-weight-ratio (default 10) x the round's median weight, an honest one: every honest delta keeps
    a share, the attackers' is bounded, and the step is the oracle's, finite."""
    init = model(80 + nodes)
    oracle = RuleOracle(init, "weighted_mean")
    attackers, honest = cast(nodes)
    r = 10 if ratio is None else ratio
    d = start(tmp_path, init, "--expected-nodes", str(nodes), "--aggregate", "weighted_mean",
              *(() if ratio is None else ("--max-weight-ratio", str(ratio))))
    try:
        rng = np.random.default_rng(500 + nodes)
        deltas = round_deltas(rng, oracle.state, attackers, honest, "huge")
        claimed = {a: 1e308 for a in attackers}
        claimed.update({h: 1.0 + i for i, h in enumerate(honest)})
        upload_all(d, deltas, attackers + honest, 0, 1, {n: {"weight": repr(w)} for n, w in claimed.items()})
        wait_step(d, 1)
        order = sorted(deltas)
        oracle.scales = weight_scales([claimed[n] for n in order], r)
        want = oracle.step({n: decoded(v) for n, v in deltas.items()})
        check_global(d, want)
        assert all(np.isfinite(v.float().numpy()).all() for v in want.values() if v.is_floating_point())
        scale = {n["node_id"]: np.float32(n["scale"]) for n in record_of(d, 1)["nodes"]}
        assert [scale[n] for n in order] == oracle.scales
        assert st_shown(d) == r
        # the median weight is an honest node's; an attacker counts as R times it, an honest node as itself
        # (or as R times the median too, when it is above: R = 1 makes equal every weight above the median)
        m = sorted(claimed.values())[(nodes - 1) // 2]
        assert m in [claimed[h] for h in honest]
        for h in honest:
            assert scale[h] > 0
            for a in attackers:
                assert scale[a] / scale[h] == pytest.approx(r / min(claimed[h] / m, r), rel=1e-6)
    finally:
        assert d.stop() == 0


def st_shown(d):
    return status(d)["robust"]["max_weight_ratio"]


# ---- trimmed_mean and median ----------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["tiny", "huge"])
@pytest.mark.parametrize("rule", ["median", "trimmed_mean"])
@pytest.mark.parametrize("nodes", NODES)
def test_coordinate_rules_stay_within_the_honest_values(tmp_path, nodes, rule, kind):
    """--aggregate median and trimmed_mean:K with K the attackers' count: per coordinate, the aggregate
    lies between the honest nodes' smallest and largest value whatever the minority sends; the step is
    the oracle's."""
    init = model(90 + nodes)
    attackers, honest = cast(nodes)
    name = rule if rule == "median" else f"trimmed_mean:{len(attackers)}"
    oracle = RuleOracle(init, name)
    d = start(tmp_path, init, "--expected-nodes", str(nodes), "--aggregate", name)
    try:
        rng = np.random.default_rng(600 + nodes)
        deltas = round_deltas(rng, oracle.state, attackers, honest, kind)
        upload_all(d, deltas, attackers + honest, 0, 1)
        wait_step(d, 1)
        check_global(d, oracle.step({n: decoded(v) for n, v in deltas.items()}))
        for key in deltas[honest[0]]:
            g = rule_oracle(name, [decoded(deltas[n])[key] for n in sorted(deltas)])
            hv = np.stack([decoded(deltas[h])[key] for h in honest])
            assert (g >= hv.min(axis=0)).all() and (g <= hv.max(axis=0)).all(), key
    finally:
        assert d.stop() == 0


# ---- the cosine screen ----------------------------------------------------------------------------

@pytest.mark.parametrize("nodes", NODES)
def test_cosine_screen_keeps_the_honest_majority(tmp_path, nodes):
    """--screen cosine:0: each attacker sends the honest direction flipped and 1000x larger.  Against a
    robust center (issue 33: the coordinate median) the honest cosines are near 1 and the attackers'
    near -1: the attackers are quarantined and the step is the honest nodes' mean.  (Against the plain
    mean, which one such delta dominates, the honest cosines were -1: the honest were dropped.)"""
    init = model(110 + nodes)
    oracle = RuleOracle(init, "mean")
    attackers, honest = cast(nodes)
    d = start(tmp_path, init, "--expected-nodes", str(nodes), "--screen", "cosine:0")
    try:
        rng = np.random.default_rng(700 + nodes)
        deltas = round_deltas(rng, oracle.state, attackers, honest, "huge")
        upload_all(d, deltas, attackers + honest, 0, 1)
        wait_step(d, 1)
        rec = record_of(d, 1)
        assert sorted(q["node_id"] for q in rec["quarantined"]) == attackers, rec
        assert all(q["reason"] == "cosine" and q["cosine"] < 0 for q in rec["quarantined"]), rec
        assert [n["node_id"] for n in rec["nodes"]] == honest, rec
        check_global(d, oracle.step({n: decoded(deltas[n]) for n in honest}))
    finally:
        assert d.stop() == 0
