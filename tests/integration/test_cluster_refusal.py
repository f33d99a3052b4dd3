"""A cluster's answer to a delta whose values intake would refuse (README, "Scaling out": a delta refused
for its values).  No aggregator reads a whole delta, so a NaN is found only by the shard that holds it,
after the manifest is fixed: the finder writes global/steps/<s>/refused.json, every aggregator reads that
node's slice of that shard itself, and the next generation's manifest (manifest.g1.json, the same bytes
from whoever derives it) leaves the node out; its outputs are model.g1-*.  A refusal a bucket writer plants
that names a valid slice is ignored.  Harness: tests/integration/test_cluster.py (SeaweedFS, boto3,
torch's SGD)."""
import json

import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from dilocod_proc import Oracle, assert_state_equal
from safetensors.torch import load as st_torch_load
from test_cluster import (NODES, Cluster, Plan, StepWatcher, cluster_model, publish_step0, random_deltas,
                          tensors_of, upload_round)
from test_s3 import s3  # noqa: F401 (the module's SeaweedFS fixture)

S = 4


def read_generation(cl, plan, step, gen):
    """The published global of step when its manifest's generation is gen (model[.g<gen>] names)."""
    base = "model" if gen == 0 else f"model.g{gen}"
    sc = cl.bucket.step_count()
    assert sc["outer_step"] == step and sc["model_file"] == f"global/steps/{step}/{base}.safetensors.index.json", sc
    index = json.loads(cl.bucket.get(sc["model_file"]))
    files = [f"{base}-{i + 1:05d}-of-{S:05d}.safetensors" for i in range(S)]
    assert sorted(set(index["weight_map"].values())) == files, index["weight_map"]
    state = {}
    for f in files:
        state.update(st_torch_load(cl.bucket.get(f"global/steps/{step}/{f}")))
    return state


def test_nan_in_one_shard_drops_that_node_and_the_round_goes_on(tmp_path, s3):
    init = cluster_model(3)
    cl = Cluster(tmp_path, s3, "refusal-nan", S, 5)
    plan = Plan(publish_step0(cl.bucket, init), S)
    rng = np.random.default_rng(26)
    watcher = StepWatcher(s3, cl.prefix)
    try:
        for i in ("a", "b"):
            cl.add(f"agg-{i}")
        cl.wait_ready()
        oracle = Oracle(init, lr=0.7, momentum=0.9)
        deltas = {n: random_deltas(rng, init) for n in NODES}
        # w3's delta holds one NaN in a tensor of the last shard: its header is fine, its values are not
        victim = [k for k in plan.shards[S - 1] if k in plan.f32][0]
        deltas["w3"][victim].reshape(-1)[7] = np.nan
        upload_round(cl.bucket, deltas, 1)
        cl.wait_published(1, 60)
        good = {n: d for n, d in deltas.items() if n != "w3"}
        oracle.step(tensors_of(good))
        assert_state_equal(read_generation(cl, plan, 1, 1), oracle.state)
        assert cl.bucket.exists("global/steps/1/refused.json") and cl.bucket.exists("global/steps/1/manifest.g1.json")
        m1 = json.loads(cl.bucket.get("global/steps/1/manifest.g1.json"))
        assert [e["node"] for e in m1["nodes"]] == ["w1", "w2", "w4"] and m1["generation"] == 1, m1
        logs = "".join(d.log_text() for d in cl.procs.values())
        assert "delta refused for its values" in logs and "the round goes on without it" in logs, cl.logs()
        # the next round builds on generation 1's global and momentum, all four nodes again
        deltas = {n: random_deltas(rng, init) for n in NODES}
        upload_round(cl.bucket, deltas, 2)
        cl.wait_published(2, 60)
        oracle.step(tensors_of(deltas))
        assert_state_equal(read_generation(cl, plan, 2, 0), oracle.state)
        cl.wait_publishes(2)
        # garbage: nothing of step 1's generation 0 outputs, nor of its control objects, is left
        cl.wait(lambda: not [k for k in cl.bucket.listing() if k.startswith("global/steps/1/") and
                             not k.startswith("global/steps/1/model.g1")],
                "step 1's control objects and generation-0 outputs collected", 20)
        watcher.check([1, 2])
    finally:
        watcher.stop()
        cl.stop()


def test_planted_refusal_of_a_valid_delta_is_ignored(tmp_path, s3):
    init = cluster_model(4)
    cl = Cluster(tmp_path, s3, "refusal-planted", S, 5)
    plan = Plan(publish_step0(cl.bucket, init), S)
    rng = np.random.default_rng(27)
    try:
        # a bucket writer's refusal, there before the round even closes
        cl.bucket.put("global/steps/1/refused.json",
                      json.dumps({"outer_step": 1, "generation": 0, "shard": 1, "node": "w2"}).encode())
        for i in ("a", "b"):
            cl.add(f"agg-{i}")
        cl.wait_ready()
        oracle = Oracle(init, lr=0.7, momentum=0.9)
        deltas = {n: random_deltas(rng, init) for n in NODES}
        upload_round(cl.bucket, deltas, 1)
        cl.wait_published(1, 60)
        oracle.step(tensors_of(deltas))
        assert_state_equal(read_generation(cl, plan, 1, 0), oracle.state)
        assert not cl.bucket.exists("global/steps/1/manifest.g1.json")
        logs = "".join(d.log_text() for d in cl.procs.values())
        assert "a refusal names a delta whose values are valid: ignored" in logs, cl.logs()
        # /metrics in cluster mode parses as Prometheus text, the cluster's families with the work done
        cl.wait_publishes(1)
        fams = {}
        for d in cl.procs.values():
            text = d.http.get(f"{d.url}/metrics", timeout=10).text
            for f in text_string_to_metric_families(text):
                for smp in f.samples:
                    fams.setdefault(smp.name, []).append(smp.value)
        assert sum(fams["dilocod_cluster_shards_done_total"]) == S, fams["dilocod_cluster_shards_done_total"]
        assert sum(fams["dilocod_cluster_publishes_total"]) == 1
        assert sum(fams["dilocod_cluster_bytes_read_total"]) >= len(NODES) * plan.f32_bytes()
        assert sum(fams["dilocod_cluster_bytes_written_total"]) >= plan.total
    finally:
        cl.stop()


def test_delta_rewritten_after_the_manifest_is_dropped(tmp_path, s3):
    """A worker that rewrites its delta once the manifest names it: every ranged read of it answers 412
    (If-Match on the manifest's ETag), and the round goes on without that node instead of stalling."""
    init = cluster_model(5)
    cl = Cluster(tmp_path, s3, "refusal-rewritten", S, 5)
    plan = Plan(publish_step0(cl.bucket, init), S)
    rng = np.random.default_rng(28)
    try:
        # one aggregator, which pauses 2 s after computing shard 0: the manifest is fixed by then
        a = cl.add("agg-a", env={"DILOCOD_TEST_CLUSTER_STALL_AFTER_PASS": "0"})
        cl.wait_ready()
        oracle = Oracle(init, lr=0.7, momentum=0.9)
        deltas = {n: random_deltas(rng, init) for n in NODES}
        upload_round(cl.bucket, deltas, 1)
        cl.wait(lambda: "test hook: pausing after the pass shard=0" in a.log_text(), "agg-a to compute shard 0", 20,
                interval=0.01)
        assert cl.bucket.exists("global/steps/1/manifest.json")
        upload_round(cl.bucket, {"w2": random_deltas(rng, init)}, 1)      # same key, other bytes
        cl.wait_published(1, 60)
        oracle.step(tensors_of({n: d for n, d in deltas.items() if n != "w2"}))
        assert_state_equal(read_generation(cl, plan, 1, 1), oracle.state)
        assert "it changed since the manifest listed it" in a.log_text(), cl.logs()
    finally:
        cl.stop()


def test_delta_removed_after_the_manifest_does_not_stop_a_late_member(tmp_path, s3):
    """A worker removes its delta once the manifest names it: an aggregator that adopts the manifest only
    then cannot read that header any more, and still adopts it (the delta is refused in the aggregation,
    the round goes on without it) instead of refusing the manifest and waiting for ever."""
    init = cluster_model(7)
    cl = Cluster(tmp_path, s3, "refusal-removed", S, 5)
    plan = Plan(publish_step0(cl.bucket, init), S)
    rng = np.random.default_rng(29)
    try:
        a = cl.add("agg-a", env={"DILOCOD_TEST_CLUSTER_STALL_AFTER_PASS": "0"})
        cl.wait_ready()
        oracle = Oracle(init, lr=0.7, momentum=0.9)
        deltas = {n: random_deltas(rng, init) for n in NODES}
        upload_round(cl.bucket, deltas, 1)
        cl.wait(lambda: "test hook: pausing after the pass shard=0" in a.log_text(), "agg-a to compute shard 0", 20,
                interval=0.01)
        cl.bucket.c.delete_object(Bucket=cl.bucket.name, Key=cl.bucket.key("nodes/w4/delta_100.safetensors"))
        b = cl.add("agg-b")
        cl.wait_published(1, 60)
        oracle.step(tensors_of({n: d for n, d in deltas.items() if n != "w4"}))
        assert_state_equal(read_generation(cl, plan, 1, 1), oracle.state)
        assert "a delta of the manifest is gone from the bucket" in b.log_text(), cl.logs()
        assert "manifest refused" not in b.log_text(), cl.logs()
    finally:
        cl.stop()


def test_rewrite_before_close_garbage_done_marker_and_huge_refusal(tmp_path, s3):
    """Three things an outside attack stalled the cluster with, each now handled: a worker uploading its
    delta again (same key, other bytes) before the round closes (the manifest names the new version), a
    done marker planted by a bucket writer (it does not hold, so the shard is computed and the marker
    replaced), and a refusal over its size cap (refused at once, not retried for minutes)."""
    init = cluster_model(8)
    cl = Cluster(tmp_path, s3, "refusal-planted-done", S, 5)
    plan = Plan(publish_step0(cl.bucket, init), S)
    rng = np.random.default_rng(30)
    try:
        cl.bucket.put("global/steps/1/shard-1.done", b'{"outer_step": 1, "shard": 1, "global_md5": "x"}')
        cl.bucket.put("global/steps/1/refused.json", b" " * 100000)
        for i in ("a", "b"):
            cl.add(f"agg-{i}")
        cl.wait_ready()
        oracle = Oracle(init, lr=0.7, momentum=0.9)
        deltas = {n: random_deltas(rng, init) for n in NODES}
        upload_round(cl.bucket, deltas, 1, nodes=["w1", "w2", "w3"])
        cl.wait(lambda: all("delta taken step=1 node=w2" in d.log_text() for d in cl.procs.values()),
                "w2's first version taken", 20)
        deltas["w2"] = random_deltas(rng, init)
        upload_round(cl.bucket, deltas, 1, nodes=["w2", "w4"])
        cl.wait_published(1, 30)
        oracle.step(tensors_of(deltas))
        assert_state_equal(read_generation(cl, plan, 1, 0), oracle.state)
        done = json.loads(cl.bucket.get("global/steps/1/shard-1.done"))
        assert done["shard"] == 1 and len(done["global_md5"]) == 32, done
        cl.wait_publishes(1)
    finally:
        cl.stop()
