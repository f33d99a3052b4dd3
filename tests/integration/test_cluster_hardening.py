"""The cluster's answers to issue 33's attacks (README, "Scaling out": a delta refused for its values, an
overflow, the deltas not looked at again), each through the real build/dilocod against SeaweedFS:

- values of 1.5e19 (below the intake bound of 2^64, but their sums of squares overflow F32 lanes): the done
  markers carry only JSON numbers, and the step is published with that node;
- deltas in range whose Nesterov step overflows the stored F16 (65504 at most): the step is computed again without the delta of
  largest norm (reason "overflow"), again while --min-nodes remain, and when no subset is finite the round is
  discarded (problem "output_overflow") and the step collects again;
- a NaN that leaves fewer than --min-nodes: the step collects again and the worker's valid re-upload is taken;
- junk under nodes/: refused once, and not peeked at again at the next step.

Harness: tests/integration/test_cluster.py (SeaweedFS, boto3, torch's SGD)."""
import json

import numpy as np
import torch

from dilocod_proc import Oracle, assert_state_equal
from test_cluster import (NODES, Cluster, ClusterDilocod, Plan, cluster_model, publish_step0, random_deltas,
                          tensors_of, upload_round)
from test_cluster_refusal import read_generation
from test_s3 import put_delta, s3  # noqa: F401 (the module's SeaweedFS fixture)

S = 4
NEAR_F16_MAX = 65000.0      # one element of an F16 tensor of the global near F16's limit (65504)
# The outer step moves a weight by -lr * (1 + momentum) * mean = -1.33 x the mean on a first step: a mean of
# -5e4 or less at that element pushes it past F16's largest value, one of a few units leaves it finite.
PUSH = {"w3": -3.0e5, "w4": -1.5e5}


def add_aggregators(cl, ids, nodes, *args):
    """Aggregators with round options of their own (--expected-nodes nodes, then args)."""
    for i in ids:
        d = ClusterDilocod(cl.tmp, cl.s3, cl.prefix, i, cl.shards, cl.lease, *args, nodes=nodes)
        cl.procs[i] = d
        d.start()


def strict_json(raw: bytes):
    """json.loads that refuses inf/nan (Python's own parser takes Infinity and NaN)."""
    def bad(name):
        raise ValueError(f"non-JSON constant {name}")
    return json.loads(raw, parse_constant=bad)


def markers(cl, step):
    """{key: parsed} of every done marker of step (any generation)."""
    out = {}
    for k in cl.bucket.listing():
        if k.startswith(f"global/steps/{step}/") and k.endswith(".done"):
            raw = cl.bucket.get(k)
            assert b"inf" not in raw.lower() and b"nan" not in raw.lower(), (k, raw)
            out[k] = strict_json(raw)
    return out


def logs_of(cl):
    return "".join(d.log_text() for d in cl.procs.values())


def test_values_whose_squares_overflow_f32_are_published(tmp_path, s3):
    """1.5e19 is below the intake bound, and so is the step, but the sum of a few of its squares is not an F32
    (2.25e38 each): the pass's statistics were inf and every done marker said `inf` (not JSON), so no aggregator
    could ever publish."""
    init = cluster_model(40)
    cl = Cluster(tmp_path, s3, "hardening-big-values", S, 5)
    plan = Plan(publish_step0(cl.bucket, init), S)
    rng = np.random.default_rng(40)
    try:
        for i in ("a", "b"):
            cl.add(f"agg-{i}")
        cl.wait_ready()
        oracle = Oracle(init, lr=0.7, momentum=0.9)
        deltas = {n: random_deltas(rng, init) for n in NODES}
        for k in deltas["w2"]:
            deltas["w2"][k][...] = np.float32(1.5e19)
        upload_round(cl.bucket, deltas, 1)
        cl.wait_published(1, 60)
        oracle.step(tensors_of(deltas))
        assert_state_equal(read_generation(cl, plan, 1, 0), oracle.state)
        got = markers(cl, 1)
        assert len(got) == S and all(len(m["stats"]) == len(NODES) for m in got.values()), got
        cl.wait_publishes(1)
    finally:
        cl.stop()


def near_limit_model(seed):
    """cluster_model with head.bias stored in F16, its first element at 65000."""
    init = cluster_model(seed)
    init["head.bias"] = init["head.bias"].to(torch.float16)
    init["head.bias"][0] = NEAR_F16_MAX
    return init


def test_overflow_drops_the_largest_norm_until_finite(tmp_path, s3):
    """The F16 head.bias holds 65000 in one element; w3 and w4 send deltas of -3e5 and -1.5e5 there (in range
    for intake).  The Nesterov step overflows F16 with both (and with w4 alone): the step is computed without w3 (the largest
    norm), then without w4, and published from w1 and w2, as torch computes it."""
    init = near_limit_model(41)
    cl = Cluster(tmp_path, s3, "hardening-overflow", S, 5)
    plan = Plan(publish_step0(cl.bucket, init), S)
    rng = np.random.default_rng(41)
    try:
        for i in ("a", "b"):
            cl.add(f"agg-{i}")
        cl.wait_ready()
        oracle = Oracle(init, lr=0.7, momentum=0.9)
        deltas = {n: random_deltas(rng, init) for n in NODES}
        for n, v in PUSH.items():
            deltas[n]["head.bias"][0] = np.float32(v)
        upload_round(cl.bucket, deltas, 1)
        cl.wait_published(1, 90)
        good = {n: d for n, d in deltas.items() if n in ("w1", "w2")}
        oracle.step(tensors_of(good))
        assert_state_equal(read_generation(cl, plan, 1, 2), oracle.state)
        r0 = strict_json(cl.bucket.get("global/steps/1/refused.json"))
        r1 = strict_json(cl.bucket.get("global/steps/1/refused.g1.json"))
        assert (r0["reason"], r0["node"], r1["reason"], r1["node"]) == ("overflow", "w3", "overflow", "w4"), (r0, r1)
        m2 = strict_json(cl.bucket.get("global/steps/1/manifest.g2.json"))
        assert [e["node"] for e in m2["nodes"]] == ["w1", "w2"], m2
        got = markers(cl, 1)
        assert any(m.get("overflow") for m in got.values()), got
        logs = logs_of(cl)
        assert "the round goes on without the delta of largest norm" in logs, cl.logs()
        # the next step builds on it with all four nodes again
        deltas = {n: random_deltas(rng, init) for n in NODES}
        upload_round(cl.bucket, deltas, 2)
        cl.wait_published(2, 60)
        oracle.step(tensors_of(deltas))
        assert_state_equal(read_generation(cl, plan, 2, 0), oracle.state)
    finally:
        cl.stop()


def test_overflow_of_every_subset_discards_the_round(tmp_path, s3):
    """--min-nodes 2 of 2: w1's delta overflows the step and w2 alone is under the floor, so no subset
    makes a finite step.  The round is discarded (not run again on the same deltas), the published step
    stays, /status says problem output_overflow, and new uploads make step 1."""
    init = near_limit_model(42)
    cl = Cluster(tmp_path, s3, "hardening-discard", S, 5)
    plan = Plan(publish_step0(cl.bucket, init), S)
    rng = np.random.default_rng(42)
    try:
        add_aggregators(cl, ("agg-a", "agg-b"), 2, "--min-nodes", "2")
        cl.wait_ready()
        oracle = Oracle(init, lr=0.7, momentum=0.9)
        deltas = {n: random_deltas(rng, init) for n in ("w1", "w2")}
        deltas["w1"]["head.bias"][0] = np.float32(PUSH["w3"])
        upload_round(cl.bucket, deltas, 1)
        cl.wait(lambda: all((d.cluster() or {}).get("problem") == "output_overflow" for d in cl.procs.values()),
                "problem output_overflow in every /status", 60)
        assert cl.bucket.published_step() == 0
        assert cl.bucket.exists("global/steps/1/refused.json")
        # the top level of /status says it as a single dilocod does
        for d in cl.procs.values():
            assert d.http.get(f"{d.url}/status", timeout=5).json()["problem"] == "output_overflow"
        # collecting again: the same deltas are never aggregated again, new ones are
        cl.wait(lambda: all((d.cluster() or {}).get("state") == "collecting" for d in cl.procs.values()),
                "every aggregator collecting again", 30)
        assert not cl.bucket.exists("global/steps/1/manifest.g1.json")
        logs = logs_of(cl)
        assert logs.count("no subset of the round's deltas makes a finite step") == 2, cl.logs()
        fresh = {n: random_deltas(rng, init) for n in ("w1", "w2")}
        for n in ("w1", "w2"):
            put_delta(cl.bucket.c, cl.bucket.name, cl.bucket.prefix, n, 0, 101, fresh[n])
        cl.wait_published(1, 60)
        oracle.step(tensors_of(fresh))
        assert_state_equal(read_generation(cl, plan, 1, 1), oracle.state)
        m1 = strict_json(cl.bucket.get("global/steps/1/manifest.g1.json"))
        assert [(e["node"], e["local_step"]) for e in m1["nodes"]] == [("w1", 101), ("w2", 101)], m1
        cl.wait(lambda: all((d.cluster() or {}).get("problem") is None for d in cl.procs.values()),
                "problem output_overflow over once step 1 is published", 30)
        for d in cl.procs.values():
            assert d.http.get(f"{d.url}/status", timeout=5).json()["problem"] is None
    finally:
        cl.stop()


def test_nan_leaving_too_few_nodes_collects_again_and_takes_the_reupload(tmp_path, s3):
    """--min-nodes 2 of 2, and w2's delta holds a NaN: the refusal leaves one node, under the floor.  The
    step used to wait for the bucket to move, for ever; now it collects again, as a single dilocod that
    refuses the NaN at intake does, and w2's valid re-upload (same key, other bytes) makes step 1."""
    init = cluster_model(43)
    cl = Cluster(tmp_path, s3, "hardening-nan-floor", S, 5)
    plan = Plan(publish_step0(cl.bucket, init), S)
    rng = np.random.default_rng(43)
    try:
        add_aggregators(cl, ("agg-a", "agg-b"), 2, "--min-nodes", "2")
        cl.wait_ready()
        oracle = Oracle(init, lr=0.7, momentum=0.9)
        deltas = {n: random_deltas(rng, init) for n in ("w1", "w2")}
        victim = [k for k in plan.shards[S - 1] if k in plan.f32][0]
        deltas["w2"][victim].reshape(-1)[3] = np.nan
        upload_round(cl.bucket, deltas, 1)
        cl.wait(lambda: all("the step collects again" in d.log_text() for d in cl.procs.values()),
                "every aggregator to send the step back to collecting", 60)
        deltas["w2"] = random_deltas(rng, init)
        upload_round(cl.bucket, deltas, 1, nodes=["w2"])
        cl.wait_published(1, 60)
        oracle.step(tensors_of(deltas))
        assert_state_equal(read_generation(cl, plan, 1, 1), oracle.state)
        m1 = strict_json(cl.bucket.get("global/steps/1/manifest.g1.json"))
        assert [e["node"] for e in m1["nodes"]] == ["w1", "w2"] and m1["generation"] == 1, m1
        cl.wait_publishes(1)
    finally:
        cl.stop()


def test_junk_under_nodes_is_refused_once_across_steps(tmp_path, s3):
    """40 objects with delta names and junk bodies (one empty): each is refused (a warning) once, and at the next step
    none of them is read again (the refusals are remembered by key and ETag across steps)."""
    init = cluster_model(44)
    cl = Cluster(tmp_path, s3, "hardening-junk", S, 5)
    plan = Plan(publish_step0(cl.bucket, init), S)
    rng = np.random.default_rng(44)
    junk = [f"nodes/junk-{k:02d}/delta_100.safetensors" for k in range(40)]
    try:
        for key in junk:
            cl.bucket.put(key, b"" if key == junk[0] else b"not a safetensors file, not a delta")
        for i in ("a", "b"):
            cl.add(f"agg-{i}")
        cl.wait_ready()
        oracle = Oracle(init, lr=0.7, momentum=0.9)
        for step in (1, 2):
            deltas = {n: random_deltas(rng, init) for n in NODES}
            # three nodes first, until every aggregator has listed them (and the junk before them: a listing
            # is in key order) in this step's round, then the last one
            upload_round(cl.bucket, deltas, step, nodes=NODES[:3])
            cl.wait(lambda: all(f"delta taken step={step} node=w3" in d.log_text() for d in cl.procs.values()),
                    f"every aggregator to list step {step}'s deltas", 30)
            upload_round(cl.bucket, deltas, step, nodes=NODES[3:])
            cl.wait_published(step, 60)
            oracle.step(tensors_of(deltas))
            assert_state_equal(read_generation(cl, plan, step, 0), oracle.state)
        cl.wait_publishes(2)
        for d in cl.procs.values():
            text = d.log_text()
            for key in junk:
                n = text.count(f"delta refused key={key} ")
                assert n == 1, f"{d.agg_id}: {key} refused {n} times\n{d.tail()}"
            # step 1's own deltas, stale at step 2, are noted once too
            for node in NODES:
                n = text.count(f"delta of an earlier round key=nodes/{node}/delta_100.safetensors ")
                assert n <= 1, f"{d.agg_id}: {node}'s step-1 delta looked at {n} times\n{d.tail()}"
            cl_status = d.cluster()
            assert cl_status["refused_remembered"] >= len(junk), cl_status
    finally:
        cl.stop()
