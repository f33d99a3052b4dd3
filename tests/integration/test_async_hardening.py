"""Async mode against the attacks of issue 33 (items 6, 7 and 9), through the real dilocod, real sockets,
the real file:// tree and SeaweedFS.

- A restart never applies a delta twice, though rounds.jsonl was compacted below the deltas the tree
  still holds (--history-keep), and a dilocod started on an old run's tree does not apply the old deltas
  (the applied set's floor, README "Asynchronous mode").
- A polled transport hands over every delta of a node, in local-step order, a few per poll, and a delta
  refused `busy` comes back: file:// (40 files of one node) and s3:// (objects of one node put at once).
- DyLU: one worker's claim (local_step 1, then 2^53 - 2, milliseconds apart) does not set the honest
  nodes' recommendations, and the example worker bounds what it follows.

Every wait is on a state dilocod reports (/status, /rounds), never a sleep (the DyLU test paces its uploads
to make the speeds it measures, and waits on nothing with it)."""
import json
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.numpy import save as np_save

from dilocod_proc import Dilocod, delta_metadata, write_delta, write_model

REPO = Path(__file__).resolve().parents[2]


def model(seed):
    g = torch.Generator().manual_seed(seed)
    return {"layer.weight": torch.randn(24, 16, generator=g), "layer.bias": torch.randn(16, generator=g),
            "counter": torch.tensor([3, -1], dtype=torch.int64)}


def rand_delta(rng, init, scale=0.01):
    return {k: (rng.standard_normal(tuple(v.shape)) * scale).astype(np.float32)
            for k, v in init.items() if v.is_floating_point()}


def status(d):
    return d.get_json("/status") or {}


def wait_status(d, pred, what, timeout=60):
    got = {}

    def ok():
        nonlocal got
        got = status(d)
        return bool(got) and pred(got)
    d.wait_until(ok, what, timeout)
    return got


def async_records(d):
    return sorted((r for r in (d.get_json("/rounds") or {}).get("rounds", []) if r.get("mode") == "async"),
                  key=lambda r: r["outer_step"])


def taken(d):
    """[(node, local_step)] of every delta in an update's record, with repeats."""
    return [(n["node_id"], n["local_step"]) for r in async_records(d) for n in r["nodes"]]


def put_delta(url, node, base, local, tensors):
    body = np_save(tensors, metadata=delta_metadata(node, base, local))
    req = urllib.request.Request(f"{url}/nodes/{node}/delta_{local}.safetensors", data=body, method="PUT")
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(req, timeout=30) as r:
            return r.status, dict(r.headers), json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), json.loads(e.read())


# ---- item 6: a restart (or an old run's tree) never applies a delta twice --------------------------

def test_restart_does_not_apply_again_the_deltas_compaction_forgot(tmp_path):
    """40 workers x 1 delta over file://, --history-keep 16, a restart: rounds.jsonl keeps 16 records, and
    the 24 deltas it forgot are still in the tree.  Before the fix they were applied again (step 40 became
    64); now each is refused (stale: based before the oldest update whose deltas are known), the global
    does not move, and a new delta still makes an update.  Then a second dilocod, with a state of its own,
    adopts that tree's global: the 41 deltas of the old run are stale below the step it starts from."""
    init = model(1)
    init_path = tmp_path / "init.safetensors"
    write_model(init_path, init)
    hub = tmp_path / "hub"
    rng = np.random.default_rng(1)
    args = ("--mode", "async", "--expected-nodes", "4", "--dn-period", "1", "--grace-ms", "0",
            "--history-keep", "16", "--threads", "2")
    d = Dilocod(tmp_path, hub, "--init-model", str(init_path), *args).start()
    try:
        d.wait_step(0)
        for i in range(40):
            write_delta(hub, f"w{i:02d}", i, 1, rand_delta(rng, init))     # based on the newest step
            d.wait_step(i + 1)
        assert sorted(taken(d)) == sorted((f"w{i:02d}", 1) for i in range(40))
        before = (hub / "global" / "latest.safetensors").read_bytes()
        assert d.stop() == 0
        lines = (d.state_dir / "rounds.jsonl").read_text().splitlines()
        assert len(lines) == 40
        d.start()
        # compacted to the last 16 records (steps 24..39): bases 24..39 are known applied, 0..23 are not
        st = wait_status(d, lambda s: s["async"].get("refused_below_floor", 0) >= 24 and
                         s["counters"]["not_newer"] >= 16, "the tree's 40 deltas refused")
        assert len((d.state_dir / "rounds.jsonl").read_text().splitlines()) == 16
        assert st["async"]["applied_floor"] == 24, st["async"]
        assert st["async"]["refused_below_floor"] == 24 and st["counters"]["not_newer"] == 16, st
        assert st["outer_step"] == 40 and st["async"]["updates"] == 0, st["async"]
        assert (hub / "global" / "latest.safetensors").read_bytes() == before
        assert "it may have been applied already" in d.log_text()
        # a new delta is an update as before
        write_delta(hub, "w40", 40, 1, rand_delta(rng, init))
        d.wait_step(41)
        st = wait_status(d, lambda s: s["async"]["queue"]["pending"] == 0, "the queue drained")
        assert st["outer_step"] == 41 and st["async"]["updates"] == 1, st["async"]
    finally:
        assert d.stop() == 0
    # another state on the same tree: it adopts step 41, and the old run's 41 deltas are stale below it
    other = Dilocod(tmp_path / "other", hub, *args, state_root=tmp_path / "other-state")
    (tmp_path / "other").mkdir()
    other.start()
    try:
        st = wait_status(other, lambda s: s.get("outer_step") == 41 and
                         s.get("async", {}).get("refused_below_floor", 0) >= 41, "the old run's deltas refused")
        assert st["async"]["applied_floor"] == 41 and st["async"]["updates"] == 0, st["async"]
        write_delta(hub, "w41", 41, 1, rand_delta(rng, init))
        st = wait_status(other, lambda s: s["outer_step"] == 42 and s["async"]["queue"]["pending"] == 0, "update 42")
        assert st["async"]["updates"] == 1 and taken(other) == [("w41", 1)], st["async"]
    finally:
        assert other.stop() == 0


# ---- item 7: every delta of a polled transport, in local-step order; busy ones come back -----------

def test_file_tree_hands_over_every_delta_of_a_node(tmp_path):
    """One node writes 40 deltas at once (all based on step 0), with room for 2 in the async queue: before
    the fix the scan listed the node's 16 highest local steps only and 16 were applied; now all 40 are,
    each once (handed over in local-step order; intake runs several at once, so updates need not be), and the
    ones refused busy came back."""
    init = model(2)
    init_path = tmp_path / "init.safetensors"
    write_model(init_path, init)
    hub = tmp_path / "hub"
    rng = np.random.default_rng(2)
    d = Dilocod(tmp_path, hub, "--init-model", str(init_path), "--mode", "async", "--expected-nodes", "1",
                "--dn-period", "1", "--grace-ms", "0", "--async-queue", "2", "--threads", "2").start()
    try:
        d.wait_step(0)
        for ls in range(1, 41):
            write_delta(hub, "w0", 0, ls, rand_delta(rng, init))
        want = [("w0", ls) for ls in range(1, 41)]
        d.wait_until(lambda: sorted(taken(d)) == sorted(want), "the node's 40 deltas in updates", timeout=120)
        st = wait_status(d, lambda s: s["async"]["queue"]["pending"] == 0 and s["async"]["listing"]["waiting"] == 0,
                         "nothing waits")
        got = taken(d)
        assert len(got) == len(set(got)) == 40, "a delta applied twice"
        assert st["async"]["listing"]["deferred"] > 0, st["async"]     # the 24 beyond the first scan's 16
        m = urllib.request.build_opener(urllib.request.ProxyHandler({})).open(d.url + "/metrics", timeout=30)
        text = m.read().decode()
        assert "dilocod_async_listing_deferred_total " in text and "dilocod_async_listing_waiting 0" in text
    finally:
        assert d.stop() == 0


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    from s3server import SeaweedS3
    server = SeaweedS3(tmp_path_factory.mktemp("seaweedfs")).start()
    yield server
    server.stop()


def test_s3_hands_over_every_object_of_a_node(tmp_path, s3):
    """Six objects of one node put at once, then twenty: before the fix each poll took the node's newest
    only (6 objects gave 1 update); now every one is applied once, and those refused busy (--async-queue 1)
    are downloaded again and applied."""
    from test_s3 import S3Dilocod
    from test_s3 import put_delta as s3_put
    prefix = "hardening/every"
    init = model(3)
    init_path = tmp_path / "init.safetensors"
    write_model(init_path, init)
    rng = np.random.default_rng(3)
    d = S3Dilocod(tmp_path, s3, prefix, "--init-model", init_path, "--mode", "async", "--expected-nodes", "1",
                  "--dn-period", "1", "--grace-ms", "0", "--async-queue", "1").start()
    try:
        wait_status(d, lambda st: st["outer_step"] == 0 and st["hub"]["published_step"] == 0, "step 0 published")
        for ls in range(1, 7):
            s3_put(d.client, s3.bucket, prefix, "w0", 0, ls, rand_delta(rng, init))
        want = [("w0", ls) for ls in range(1, 7)]
        d.wait_until(lambda: sorted(taken(d)) == want, "the node's 6 objects in updates", timeout=120)
        for ls in range(7, 27):
            s3_put(d.client, s3.bucket, prefix, "w0", 0, ls, rand_delta(rng, init))
        want = [("w0", ls) for ls in range(1, 27)]
        d.wait_until(lambda: sorted(taken(d)) == want, "the node's 26 objects in updates", timeout=180)
        st = wait_status(d, lambda s: s["async"]["queue"]["pending"] == 0, "the queue drained")
        got = taken(d)
        assert len(got) == len(set(got)) == 26, "an object applied twice"
        assert st["outer_step"] == st["async"]["updates"] == len(async_records(d)), st["async"]
        assert d.alive()
    finally:
        assert d.stop() == 0


# ---- item 9: DyLU from bounded evidence -------------------------------------------------------------

def recommended(d):
    return {n["node_id"]: n["recommended_local_steps"] for n in status(d)["async"]["nodes"]}


@pytest.mark.parametrize("base_steps", [100, 0])
def test_one_worker_claim_does_not_set_the_recommendations(tmp_path, base_steps):
    """Two honest nodes run 100 local steps per delta; an attacker uploads local_step 1, then 2^53 - 2 at
    once.  Before the fix both honest recommendations fell to 1 for good (--dylu-base-steps 100), or
    H_base became 2^53 (default).  Now a measure counts up to twice the median node's speed and jump: the
    honest recommendations (of nodes at one pace) lose at most half, stay within [H_base / 16, H_base], and H_base stays within
    twice the median node's steps per delta."""
    init = model(4)
    init_path = tmp_path / "init.safetensors"
    write_model(init_path, init)
    rng = np.random.default_rng(4)
    d = Dilocod(tmp_path, None, "--init-model", str(init_path), "--mode", "async", "--expected-nodes", "3",
                "--dn-period", "1", "--grace-ms", "0", "--dylu-base-steps", str(base_steps), "--threads", "2").start()
    try:
        wait_status(d, lambda s: s.get("outer_step") == 0, "step 0")

        def push(node, local):
            step = status(d)["outer_step"]
            code, headers, body = put_delta(d.url, node, step, local, rand_delta(rng, init))
            assert code == 201, body
            return headers

        # the honest nodes run at one pace: a second between their deltas, so that their measured speeds
        # differ by the jitter of an HTTP answer, not by 2x (with 2 honest nodes the attacker's third
        # measure makes the faster one the median, and the cap follows it: the slower one would lose the
        # ratio of their speeds, which is no part of the claim)
        for local in (100, 200, 300):
            for node in ("w0", "w1"):
                push(node, local)
            time.sleep(1.0)
        honest = wait_status(d, lambda s: {n["node_id"] for n in s["async"]["nodes"] if n["speed"] > 0} ==
                             {"w0", "w1"}, "both honest nodes measured")
        h_base = honest["async"]["dylu_base_steps"]
        assert h_base == 100, honest["async"]
        before = recommended(d)
        push("evil", 1)
        push("evil", (1 << 53) - 2)
        st = wait_status(d, lambda s: any(n["node_id"] == "evil" and n["speed"] > 0 for n in s["async"]["nodes"]),
                         "the attacker measured")
        after = recommended(d)
        h_after = st["async"]["dylu_base_steps"]
        assert h_after <= 2 * 100, st["async"]     # the median node's jump is 100
        for node in ("w0", "w1"):
            assert after[node] >= before[node] // 2 - 1, (before, after)     # halved at most (each floored)
            assert max(1, h_after // 16) <= after[node] <= h_after, (h_after, after)
        assert after["evil"] <= h_after, after
        # what an honest worker is told in its upload answer: within the documented range too
        rec = int(push("w0", 400)["X-Recommended-Local-Steps"])
        assert max(1, h_after // 16) <= rec <= h_after, rec
        text = urllib.request.build_opener(urllib.request.ProxyHandler({})).open(
            d.url + "/metrics", timeout=30).read().decode()
        assert f'dilocod_node_recommended_local_steps{{node="evil"}} {after["evil"]}' in text
    finally:
        assert d.stop() == 0


def test_example_worker_bounds_what_it_follows():
    """client/examples/torch_worker.py follows a recommendation only within [inner / 16, 4 x inner]."""
    sys.path.insert(0, str(REPO / "client" / "examples"))
    try:
        import torch_worker
    finally:
        sys.path.pop(0)
    f = torch_worker.followed_steps
    assert f(None, 30) == 30 and f(25, 30) == 25 and f(90, 30) == 90
    assert f(1, 100) == 6 and f(1, 10) == 1                 # never below inner / 16 (at least 1)
    assert f((1 << 53) - 2, 30) == 120                      # never past 4 x inner
