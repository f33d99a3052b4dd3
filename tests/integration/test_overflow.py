"""Finite is not safe (issue: a finite delta stalled the run for good).  Values a delta may hold are
bounded where they are read (finite and below 2^64 in magnitude, README "Delta rules"), and a step that
overflows anyway (an F16 global, a momentum near the limit) is never computed again from the same
deltas: it is computed without the delta of largest norm (quarantined as `overflow`) while --min-nodes
remain, and when no subset is finite the round is discarded, the committed step stays served, and
/status says `problem: "output_overflow"` until a step is finite again.  Sync and async, through the
real dilocod over real sockets, against torch."""
import re
import urllib.request

import numpy as np
import pytest
import torch

from dilocod_proc import Dilocod, Oracle, write_model
from test_robust import body_of, check_global, put, status, wait_step
from test_torch_exact import torch_cpu_capability

pytestmark = pytest.mark.skipif(
    torch_cpu_capability() not in ("AVX2", "AVX512"),
    reason="torch fuses add(x, alpha=...) only in its AVX2/AVX-512 kernels (see test_torch_exact.py)")

LR, MU = 0.7, 0.9


def model(seed, half_value=None):
    g = torch.Generator().manual_seed(seed)
    half = torch.randn(16, 8, generator=g).to(torch.float16)
    if half_value is not None:
        half = torch.full((16, 8), half_value, dtype=torch.float16)
    return {"a.w": torch.randn(33, 7, generator=g), "h.f16": half}


def small_delta(rng, state, scale=0.01):
    return {k: torch.from_numpy((rng.standard_normal(tuple(v.shape)) * scale).astype(np.float32))
            for k, v in state.items()}


def start(tmp_path, init, *args):
    init_path = tmp_path / "init.safetensors"
    write_model(init_path, init)
    d = Dilocod(tmp_path, None, "--init-model", str(init_path), "--lr", str(LR), "--momentum", str(MU),
                "--threads", "2", *args).start()
    d.wait_until(lambda: status(d).get("outer_step") == 0, "step 0")
    return d


def metrics_text(d):
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(d.url + "/metrics", timeout=10) as r:
        return r.read().decode()


def metric(d, name):
    text = metrics_text(d)
    m = re.search(r"^" + re.escape(name) + r" (\S+)$", text, re.M)
    assert m, f"{name} not in /metrics"
    return float(m.group(1))


def overflow_quarantines(d):
    return [e for e in status(d)["robust"]["quarantined"] if e["reason"] == "overflow"]


def test_values_beyond_the_bound_are_refused_where_they_are_read(tmp_path):
    """A finite value of 1.7e38 (the attack: intake took it, a later Nesterov step overflowed and the
    round was retried for ever) is refused at its upload, 422 non_finite naming the bound; BF16's too.
    A value just below 2^64 is a valid delta, and the round commits."""
    init = model(1)
    d = start(tmp_path, init, "--expected-nodes", "1")
    try:
        rng = np.random.default_rng(3)
        for bad, dtype in ((1.7e38, torch.float32), (-2.0 ** 64, torch.float32), (3e38, torch.bfloat16)):
            delta = small_delta(rng, init)
            delta["a.w"] = delta["a.w"].to(dtype)
            delta["a.w"][3, 2] = bad
            code, body = put(d, "w0", 1, body_of(delta, "w0", 0, 1))
            assert code == 422, body
            assert body["error"]["code"] == "non_finite" and "2^64" in body["error"]["message"], body
            assert body["error"]["tensor"] == "a.w"
        assert metric(d, 'dilocod_deltas_rejected_total{code="non_finite"}') == 3
        delta = small_delta(rng, init)
        delta["a.w"][0, 0] = float(np.nextafter(np.float32(2.0 ** 64), np.float32(0)))
        code, body = put(d, "w0", 1, body_of(delta, "w0", 0, 1))
        assert code == 201, body
        wait_step(d, 1)
    finally:
        assert d.stop() == 0


def test_an_overflowing_delta_is_left_out_and_the_step_commits(tmp_path):
    """Sync, default rule, 3 nodes: one worker's delta is in range but makes the F16 global overflow.
    The step is computed again without it (the largest norm), commits equal to torch over the two honest
    deltas, and the attacker is quarantined with reason overflow; nothing is retried, no problem stays."""
    init = model(2)
    oracle = Oracle(init, lr=LR, momentum=MU)
    d = start(tmp_path, init, "--expected-nodes", "3")
    try:
        rng = np.random.default_rng(5)
        honest = {f"w{i}": small_delta(rng, init) for i in range(2)}
        attack = small_delta(rng, init)
        attack["h.f16"] = torch.full((16, 8), 3e5, dtype=torch.float32)      # F16 holds 65504 at most
        for node, delta in list(honest.items()) + [("w2", attack)]:
            assert put(d, node, 1, body_of(delta, node, 0, 1))[0] == 201
        wait_step(d, 1)
        check_global(d, oracle.step({n: {k: v.numpy() for k, v in t.items()} for n, t in honest.items()}))
        q = overflow_quarantines(d)
        assert [(e["node_id"], e["step"], e["basis"]) for e in q] == [("w2", 0, "largest")], q
        assert q[0]["norm"] > 3e5
        st = status(d)
        assert st["problem"] is None and st["state"] == "collecting"
        assert metric(d, 'dilocod_deltas_quarantined_total{reason="overflow"}') == 1
        assert metric(d, "dilocod_rounds_overflowed_total") == 0
        log = d.log_text()
        assert "will retry" not in log
        # the next round is an ordinary one
        deltas = {f"w{i}": small_delta(rng, oracle.state) for i in range(3)}
        for node, delta in deltas.items():
            assert put(d, node, 2, body_of(delta, node, 1, 2))[0] == 201
        wait_step(d, 2)
        check_global(d, oracle.step({n: {k: v.numpy() for k, v in t.items()} for n, t in deltas.items()}))
    finally:
        assert d.stop() == 0


def test_a_state_near_its_limit_discards_the_round_and_says_so(tmp_path):
    """The F16 global is at 65000: any honest step that moves it up overflows, with every subset of the
    deltas.  The round is discarded (not retried), step 0 stays served, /status says
    problem output_overflow (logged once), and a later round whose step is finite commits and clears
    it."""
    init = model(3, half_value=65000.0)
    oracle = Oracle(init, lr=LR, momentum=MU)
    d = start(tmp_path, init, "--expected-nodes", "2")
    try:
        rng = np.random.default_rng(7)
        for rnd in range(2):
            for i in range(2):
                delta = small_delta(rng, init)
                delta["h.f16"] = torch.full((16, 8), -1000.0 - i)     # the step adds lr * 1.9 * 1000
                assert put(d, f"w{i}", rnd + 1, body_of(delta, f"w{i}", 0, rnd + 1))[0] == 201
            d.wait_until(lambda: metric(d, "dilocod_rounds_overflowed_total") == rnd + 1, "the round discarded")
            st = status(d)
            assert st["outer_step"] == 0 and st["problem"] == "output_overflow", st
        check_global(d, init)
        log = d.log_text()
        said = [l for l in log.splitlines() if "no subset of the round's deltas makes a finite step" in l]
        assert len(said) == 2 and [" warn " in l for l in said] == [True, False], said   # warned once
        assert "will retry" not in log
        assert 'problem="output_overflow"' not in metrics_text(d)     # a state, not a label
        # the honest nodes move it down: finite, committed, the problem over
        deltas = {}
        for i in range(2):
            delta = small_delta(rng, init)
            delta["h.f16"] = torch.full((16, 8), 10.0)
            deltas[f"w{i}"] = delta
            assert put(d, f"w{i}", 3, body_of(delta, f"w{i}", 0, 3))[0] == 201
        wait_step(d, 1)
        check_global(d, oracle.step({n: {k: v.numpy() for k, v in t.items()} for n, t in deltas.items()}))
        assert status(d)["problem"] is None
    finally:
        assert d.stop() == 0


def test_async_an_overflowing_update_is_dropped_and_the_next_applies(tmp_path):
    """Async: an update of one delta that overflows was retried for ever, and every later upload queued
    and then answered 503.  It is dropped and recorded; the honest deltas sent meanwhile apply."""
    init = model(4)
    d = start(tmp_path, init, "--mode", "async", "--expected-nodes", "3", "--grace-ms", "0")
    try:
        rng = np.random.default_rng(9)
        attack = small_delta(rng, init)
        attack["h.f16"] = torch.full((16, 8), 3e5)
        assert put(d, "w9", 1, body_of(attack, "w9", 0, 1))[0] == 201
        codes = [put(d, f"w{i}", 1, body_of(small_delta(rng, init), f"w{i}", 0, 1))[0] for i in range(3)]
        assert all(c in (201, 202) for c in codes), codes
        d.wait_until(lambda: status(d).get("outer_step", 0) >= 1, "an honest update applied")
        q = overflow_quarantines(d)
        assert [e["node_id"] for e in q] == ["w9"], q
        d.wait_until(lambda: status(d).get("state") == "collecting" and status(d)["round"]["received"] == [],
                     "every honest delta applied")
        assert metric(d, 'dilocod_deltas_refused_total{reason="busy"}') == 0
        assert status(d)["problem"] is None
    finally:
        assert d.stop() == 0
