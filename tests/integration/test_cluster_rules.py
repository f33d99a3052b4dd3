"""The robust rules a cluster computes (issue 34: the cluster's refusals lifted), each through the real
build/dilocod against SeaweedFS, bit-exact with torch fed README's definitions:

- weighted_mean: each delta scaled by a_k from its "weight" (or "num_tokens") metadata, capped at
  --max-weight-ratio medians; every shard, on any aggregator, scales by the same bits, and a worker's
  claim of weight 1e308 does not take the round over;
- a delta that reports no weight is refused under weighted_mean (missing_weight) and the round goes on
  with the others, as a single dilocod answers 422.

Harness: tests/integration/test_cluster.py (SeaweedFS, boto3, torch's SGD)."""
import numpy as np
import torch
from safetensors.numpy import save as st_save_bytes

from dilocod_proc import Oracle, assert_state_equal, delta_metadata
from test_cluster import Cluster, ClusterDilocod, Plan, cluster_model, publish_step0, random_deltas, tensors_of
from test_cluster_refusal import read_generation
from test_robust import rule_oracle, weight_scales
from test_s3 import s3  # noqa: F401 (the module's SeaweedFS fixture)

S = 4
NODES = ["w1", "w2", "w3", "w4"]


class WeightedOracle(Oracle):
    """torch.optim.SGD on weighted_mean's aggregate (README's definition, in F32) in place of the mean."""

    def __init__(self, init, scales):
        super().__init__(init, lr=0.7, momentum=0.9)
        self.scales = scales

    def mean(self, deltas_by_node, key):
        ds = [self._f32(deltas_by_node[n][key]).numpy() for n in sorted(deltas_by_node)]
        return torch.from_numpy(rule_oracle("weighted_mean", ds, self.scales))


def put_weighted(bucket, node, step, tensors, **metrics):
    """A worker's push of round step with its metrics metadata (string values, as the wire format says)."""
    meta = delta_metadata(node, step - 1, 100 * step)
    meta.update({k: str(v) for k, v in metrics.items()})
    body = st_save_bytes(tensors, metadata=meta)
    bucket.c.put_object(Bucket=bucket.name, Key=bucket.key(f"nodes/{node}/delta_{100 * step}.safetensors"),
                        Body=body)


def start(cl, *args, nodes=len(NODES)):
    for i in ("agg-a", "agg-b"):
        d = ClusterDilocod(cl.tmp, cl.s3, cl.prefix, i, cl.shards, cl.lease, "--aggregate", "weighted_mean", *args,
                           nodes=nodes)
        cl.procs[i] = d
        d.start()
    cl.wait_ready()


def test_weighted_mean_in_a_cluster_matches_torch(tmp_path, s3):
    """Round 1: weights 2.5, 1e308 (a worker's claim to own the round), 0.125 and num_tokens 4: the claim is
    capped at 10 medians.  Round 2: num_tokens only.  Both published as torch computes them."""
    init = cluster_model(50)
    cl = Cluster(tmp_path, s3, "rules-weighted", S, 5)
    plan = Plan(publish_step0(cl.bucket, init), S)
    assert plan.S == S
    rng = np.random.default_rng(50)
    try:
        start(cl)
        rounds = [
            {"w1": {"weight": 2.5}, "w2": {"weight": 1e308}, "w3": {"weight": 0.125}, "w4": {"num_tokens": 4}},
            {"w1": {"num_tokens": 1000}, "w2": {"num_tokens": 3000}, "w3": {"num_tokens": 500},
             "w4": {"num_tokens": 1}},
        ]
        oracle = WeightedOracle(init, None)
        for step, metrics in enumerate(rounds, start=1):
            deltas = {n: random_deltas(rng, init) for n in NODES}
            for n in NODES:
                put_weighted(cl.bucket, n, step, deltas[n], **metrics[n])
            cl.wait_published(step, 60)
            weights = [next(iter(metrics[n].values())) for n in NODES]
            oracle.scales = weight_scales(weights)
            oracle.step(tensors_of(deltas))
            assert_state_equal(read_generation(cl, plan, step, 0), oracle.state)
        # what the first step was checked against: the claim capped at 10 x the median weight 2.5, so the
        # honest deltas keep their say (uncapped, w2's scale would be 1 and every other 0)
        first = weight_scales([2.5, 1e308, 0.125, 4])
        assert first[1] / first[0] == np.float32(10) and min(first) > 0, first
    finally:
        cl.stop()


def test_weighted_mean_refuses_a_delta_without_weight(tmp_path, s3):
    """w3 reports neither weight nor num_tokens: refused (missing_weight, logged), and the step is the
    weighted mean of the other three, with --expected-nodes 3."""
    init = cluster_model(51)
    cl = Cluster(tmp_path, s3, "rules-noweight", S, 5)
    plan = Plan(publish_step0(cl.bucket, init), S)
    rng = np.random.default_rng(51)
    try:
        start(cl, nodes=3)
        deltas = {n: random_deltas(rng, init) for n in NODES}
        put_weighted(cl.bucket, "w3", 1, deltas["w3"])
        cl.wait(lambda: "missing_weight" in "".join(d.log_text() for d in cl.procs.values()),
                "w3's delta refused for its missing weight", 30)
        weights = {"w1": 3.0, "w2": 1.0, "w4": 2.0}
        for n, w in weights.items():
            put_weighted(cl.bucket, n, 1, deltas[n], weight=w)
        cl.wait_published(1, 60)
        oracle = WeightedOracle(init, weight_scales([weights[n] for n in sorted(weights)]))
        oracle.step(tensors_of({n: deltas[n] for n in weights}))
        assert_state_equal(read_generation(cl, plan, 1, 0), oracle.state)
    finally:
        cl.stop()
