"""Robust aggregation (README, "Robust aggregation") against numpy/torch oracles, bit for bit: the intake
L2 norm's definition, each --aggregate rule followed by torch.optim.SGD, the norm screen's quarantine
(422 outlier over HTTP, skipped on file://), the cosine screen's two passes, and a round whose every
delta is quarantined (not committed, and /status says why)."""
import json
import math
import urllib.error
import urllib.request

import numpy as np
import pytest
import torch
from safetensors.numpy import save as np_save

from dilocod_proc import Dilocod, Oracle, assert_state_equal, delta_metadata, load_torch, write_delta, write_model
from test_torch_exact import torch_cpu_capability

pytestmark = pytest.mark.skipif(
    torch_cpu_capability() not in ("AVX2", "AVX512"),
    reason="torch fuses add(x, alpha=...) only in its AVX2/AVX-512 kernels (see test_torch_exact.py)")

LR, MU = 0.7, 0.9
BLOCK = 4096            # CK_BLOCK_ELEMS: the norm's blocks


def model(seed):
    g = torch.Generator().manual_seed(seed)
    return {
        "a.w": torch.randn(41, 13, generator=g),               # 533: one short block
        "b.big": torch.randn(3, 4099, generator=g),            # 12297: three blocks and a short one
        "c.bf16": torch.randn(29, 7, generator=g).to(torch.bfloat16),
        "d.count": torch.tensor([3, 1], dtype=torch.int64),
    }


def floating(state):
    return [k for k, v in state.items() if v.is_floating_point()]


# ---- oracles --------------------------------------------------------------------------------------

def norm_oracle(delta):
    """README's intake norm: per tensor, blocks of 4096 values, 8 lanes of squares in double added in
    order, lanes combined ((l0+l1)+(l2+l3))+((l4+l5)+(l6+l7)); the exact sum of every block (fsum)."""
    blocks = []
    for name in delta:
        v = np.asarray(delta[name], dtype=np.float32).astype(np.float64).ravel()
        for b0 in range(0, v.size, BLOCK):
            blk = v[b0:b0 + BLOCK]
            sq = np.concatenate([blk * blk, np.zeros((-blk.size) % 8)]).reshape(-1, 8)
            lanes = np.cumsum(sq, axis=0)[-1]          # numpy's cumsum adds in order
            blocks.append(((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7])))
    return math.sqrt(math.fsum(blocks))


def total_order_sorted(stack):
    """The values along axis 0 sorted in IEEE-754 totalOrder (-0 before +0), via their integer keys."""
    i = stack.view(np.int32)
    keys = i ^ ((i >> 31) & 0x7fffffff)
    return np.take_along_axis(stack, np.argsort(keys, axis=0, kind="stable"), axis=0)


def rule_oracle(rule, ds, scales=None):
    """README's definitions, in numpy F32 (every operation rounded to F32): ds in node order."""
    n = len(ds)
    zero = np.float32(0.0)
    if rule in ("mean", "clipped_mean"):
        acc = zero + (ds[0] if rule == "mean" else np.float32(scales[0]) * ds[0])
        for k in range(1, n):
            acc = acc + (ds[k] if rule == "mean" else np.float32(scales[k]) * ds[k])
        return (acc / np.float32(n)).astype(np.float32)
    if rule == "weighted_mean":
        acc = zero + np.float32(scales[0]) * ds[0]
        for k in range(1, n):
            acc = acc + np.float32(scales[k]) * ds[k]
        return acc.astype(np.float32)
    s = total_order_sorted(np.stack(ds))
    if rule == "median":
        return s[(n - 1) // 2].copy()
    assert rule.startswith("trimmed_mean:")
    k = min(int(rule.split(":")[1]), (n - 1) // 2)
    kept = s[k:n - k]
    acc = zero + kept[0]
    for x in kept[1:]:
        acc = acc + x
    return (acc / np.float32(n - 2 * k)).astype(np.float32)


def weight_scales(weights, ratio=10):
    """weighted_mean's a_k: m the lower median of the positive weights, u_k = min(w_k / m, R) (R is
    --max-weight-ratio), U their sum in node order in double, a_k = float32(u_k / U)."""
    pos = sorted(w for w in weights if w > 0)
    m = pos[(len(pos) - 1) // 2]
    u = [min(w / m, ratio) for w in weights]
    total = 0.0
    for x in u:
        total += x
    return [np.float32(x / total) for x in u]


def clip_scales(norms):
    m = sorted(norms)[(len(norms) - 1) // 2]
    return [np.float32(min(1.0, m / x)) if x > 0 else np.float32(1.0) for x in norms]


class RuleOracle(Oracle):
    """torch.optim.SGD on the rule's aggregate in place of the mean."""

    def __init__(self, init, rule, **kw):
        super().__init__(init, lr=LR, momentum=MU, **kw)
        self.rule, self.scales = rule, None

    def mean(self, deltas_by_node, key):
        order = sorted(deltas_by_node)
        ds = [self._f32(deltas_by_node[node][key]).numpy() for node in order]
        return torch.from_numpy(rule_oracle(self.rule, ds, self.scales))


# ---- helpers --------------------------------------------------------------------------------------

def rand_delta(rng, state, scale, ties=False):
    out = {}
    for k in floating(state):
        v = state[k]
        x = (rng.standard_normal(tuple(v.shape)) * scale).astype(np.float32)
        x.reshape(-1)[::41] = -0.0
        x.reshape(-1)[1::41] = 0.0
        if ties:                        # a few values every node shares exactly (ties in the sort)
            x.reshape(-1)[2::7] = np.float32(0.125)
        out[k] = x
    return out


def as_wire(delta):
    """The delta as sent: F32, except c.bf16 as BF16 (upcast exactly by dilocod)."""
    out = {}
    for k, v in delta.items():
        if k == "c.bf16":
            out[k] = torch.from_numpy(v).to(torch.bfloat16)
        else:
            out[k] = torch.from_numpy(v)
    return out


def decoded(delta):
    """What dilocod aggregates: the wire values decoded to F32."""
    return {k: (v.to(torch.float32).numpy() if isinstance(v, torch.Tensor) else v) for k, v in as_wire(delta).items()}


def body_of(tensors, node, base, local, extra_meta=None):
    from safetensors.torch import save as st_save
    meta = delta_metadata(node, base, local)
    meta.update(extra_meta or {})
    return st_save({k: v.contiguous() for k, v in tensors.items()}, metadata=meta)


def put(d, node, local, body):
    req = urllib.request.Request(f"{d.url}/nodes/{node}/delta_{local}.safetensors", data=body, method="PUT")
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def status(d):
    return d.get_json("/status") or {}


def rounds(d):
    return (d.get_json("/rounds") or {}).get("rounds", [])


def record_of(d, step):
    for r in rounds(d):
        if r.get("outer_step") == step:
            return r
    return None


def wait_step(d, step, timeout=60):
    d.wait_until(lambda: status(d).get("outer_step") == step, f"step {step}", timeout=timeout)


def start(tmp_path, init, *args, hub=None):
    init_path = tmp_path / "init.safetensors"
    write_model(init_path, init)
    d = Dilocod(tmp_path, hub, "--init-model", str(init_path), "--lr", str(LR), "--momentum", str(MU),
                "--threads", "2", *args).start()
    d.wait_until(lambda: status(d).get("outer_step") == 0, "step 0")
    return d


def check_global(d, want):
    """The served global (GET /global/latest.safetensors) against the oracle's, byte for byte."""
    from safetensors.torch import load as torch_load_bytes
    from safetensors.torch import save as st_save
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(d.url + "/global/latest.safetensors", timeout=30) as r:
        raw = r.read()
    assert_state_equal(torch_load_bytes(raw), want)
    assert raw == st_save({k: v.contiguous() for k, v in want.items()})


# ---- the norm -------------------------------------------------------------------------------------

def test_intake_norm_matches_its_definition_on_every_path(tmp_path):
    """The norm /rounds reports (intake_norm, %.17g) is README's definition bit for bit, for a delta
    uploaded over HTTP (validated as it streams) and one taken from a file:// tree (read in place or
    copied), with F32 and BF16 tensors, blocks split across tensors and short last blocks."""
    init = model(1)
    hub = tmp_path / "hub"
    hub.mkdir()
    d = start(tmp_path, init, "--expected-nodes", "2", hub=hub)
    try:
        rng = np.random.default_rng(7)
        a, b = rand_delta(rng, init, 0.03), rand_delta(rng, init, 5.0)
        assert put(d, "http-node", 1, body_of(as_wire(a), "http-node", 0, 1))[0] == 201
        write_delta(hub, "tree-node", 0, 1, {k: v.numpy() if k != "c.bf16" else v.to(torch.float32).numpy()
                                             for k, v in as_wire(b).items()})
        wait_step(d, 1)
        rec = record_of(d, 1)
        got = {n["node_id"]: n["intake_norm"] for n in rec["nodes"]}
        assert got["http-node"] == norm_oracle(decoded(a))
        assert got["tree-node"] == norm_oracle(decoded(b))
        assert rec["aggregate"] == "mean" and rec["quarantined"] == []
    finally:
        assert d.stop() == 0


# ---- the rules ------------------------------------------------------------------------------------

RULES = ["mean", "clipped_mean", "trimmed_mean:1", "trimmed_mean:2", "median"]


# trimmed_mean:2 over 4 nodes is not a run: 2K >= N is refused by the configuration (test_config)
@pytest.mark.parametrize("rule,nodes", [(r, n) for r in RULES for n in (4, 5) if (r, n) != ("trimmed_mean:2", 4)])
def test_rule_matches_its_oracle_over_rounds(tmp_path, rule, nodes):
    """Three rounds of each rule over an even and an odd node count (ties, +-0, one delta 20x larger),
    then Nesterov SGD: every published global byte for byte as the oracle's, and the record names the
    rule and each delta's scale."""
    init = model(2)
    oracle = RuleOracle(init, rule)
    d = start(tmp_path, init, "--expected-nodes", str(nodes), "--aggregate", rule)
    try:
        rng = np.random.default_rng(nodes * 31 + len(rule))
        for step in range(3):
            deltas = {f"w{i}": rand_delta(rng, oracle.state, 0.01 * (20 if i == 1 else 1), ties=True)
                      for i in range(nodes)}
            for node, delta in deltas.items():
                assert put(d, node, step + 1, body_of(as_wire(delta), node, step, step + 1))[0] == 201
            wait_step(d, step + 1)
            if rule == "clipped_mean":
                oracle.scales = clip_scales([norm_oracle(decoded(deltas[n])) for n in sorted(deltas)])
            want = oracle.step({n: decoded(v) for n, v in deltas.items()})
            check_global(d, want)
            rec = record_of(d, step + 1)
            assert rec["aggregate"] == rule
            if rule == "clipped_mean":
                assert [np.float32(n["scale"]) for n in rec["nodes"]] == oracle.scales
                assert min(n["scale"] for n in rec["nodes"]) < 1      # the large delta was clipped
    finally:
        assert d.stop() == 0


def test_weighted_mean_by_reported_weights(tmp_path):
    """--aggregate weighted_mean: w_k the delta's "weight" metadata (else its "num_tokens"), capped at
    --max-weight-ratio (default 10) x the round's lower median weight, u_k = min(w_k / m, R), a_k =
    float32(u_k / U) with U their double sum in node order; g = sum of a_k * d_k in F32.  The 1000 here
    is capped at 10 x 2.5.  A delta reporting neither is refused with 422 at its header."""
    init = model(9)
    oracle = RuleOracle(init, "weighted_mean")
    d = start(tmp_path, init, "--expected-nodes", "3", "--aggregate", "weighted_mean")
    try:
        rng = np.random.default_rng(19)
        code, body = put(d, "w9", 1, body_of(as_wire(rand_delta(rng, init, 0.01)), "w9", 0, 1))
        assert code == 422 and body["error"]["code"] == "missing_weight", body
        reports = [{"weight": "2.5"}, {"num_tokens": "1000"}, {"weight": "0.125", "num_tokens": "7"}]
        for step in range(2):
            deltas = {f"w{i}": rand_delta(rng, oracle.state, 0.01, ties=True) for i in range(3)}
            for i, (node, delta) in enumerate(deltas.items()):
                assert put(d, node, step + 1, body_of(as_wire(delta), node, step, step + 1, reports[i]))[0] == 201
            wait_step(d, step + 1)
            oracle.scales = weight_scales([2.5, 1000.0, 0.125])
            assert oracle.scales[1] / oracle.scales[0] == pytest.approx(10)      # capped: 10 x the median 2.5
            check_global(d, oracle.step({n: decoded(v) for n, v in deltas.items()}))
            assert [np.float32(n["scale"]) for n in record_of(d, step + 1)["nodes"]] == oracle.scales
        assert status(d)["robust"]["max_weight_ratio"] == 10
    finally:
        assert d.stop() == 0


def test_median_agrees_with_torch_median():
    """The median's definition is torch.median's (the lower of the two middle values for an even count):
    the oracle above equals torch's on every value (== treats -0 and +0 alike; torch does not define
    which of equal values it returns)."""
    rng = np.random.default_rng(3)
    for n in (2, 3, 4, 7, 8):
        stack = rng.standard_normal((n, 5000)).astype(np.float32)
        stack[:, ::9] = np.float32(0.5)
        stack[rng.integers(0, n), ::13] = -0.0
        ours = rule_oracle("median", list(stack))
        theirs = torch.median(torch.from_numpy(stack), dim=0).values.numpy()
        assert np.array_equal(ours, theirs)


# ---- the norm screen ------------------------------------------------------------------------------

def test_outlier_quarantined_over_http_and_file(tmp_path):
    """--max-norm-ratio 10 with 3 nodes: a delta 100x the others' sent last gets 422 outlier naming its
    norm and the bound; one sent first (nothing to compare with yet) is taken, then quarantined when
    the round closes; a file:// tree's is skipped.  The rounds commit without them, equal to the oracle
    over the honest nodes; /status, /metrics and the record show the quarantine."""
    init = model(4)
    hub = tmp_path / "hub"
    hub.mkdir()
    oracle = RuleOracle(init, "mean")
    d = start(tmp_path, init, "--expected-nodes", "3", "--round-timeout", "1", "--min-nodes", "2",
              "--max-norm-ratio", "10", hub=hub)
    try:
        rng = np.random.default_rng(5)
        # round 1: the faulty delta last, over HTTP
        honest = {f"w{i}": rand_delta(rng, oracle.state, 0.01) for i in range(2)}
        for node, delta in honest.items():
            assert put(d, node, 1, body_of(as_wire(delta), node, 0, 1))[0] == 201
        bad = {k: (v * np.float32(100)).astype(np.float32) for k, v in rand_delta(rng, oracle.state, 0.01).items()}
        code, body = put(d, "w2", 1, body_of(as_wire(bad), "w2", 0, 1))
        assert code == 422 and body["error"]["code"] == "outlier", body
        assert "norm" in body["error"]["message"] and "bound" in body["error"]["message"]
        wait_step(d, 1)
        check_global(d, oracle.step({n: decoded(v) for n, v in honest.items()}))
        # round 2: the faulty delta first, from the file:// tree
        bad = {k: (v * np.float32(100)).astype(np.float32) for k, v in rand_delta(rng, oracle.state, 0.01).items()}
        write_delta(hub, "w2", 1, 2, decoded(bad))
        d.wait_until(lambda: any(e["step"] == 1 for e in status(d)["robust"]["quarantined"]) or
                     len(status(d)["round"]["received"]) >= 1, "the tree's delta taken")
        honest = {f"w{i}": rand_delta(rng, oracle.state, 0.01) for i in range(2)}
        for node, delta in honest.items():
            assert put(d, node, 2, body_of(as_wire(delta), node, 1, 2))[0] == 201
        wait_step(d, 2)
        check_global(d, oracle.step({n: decoded(v) for n, v in honest.items()}))
        rec = record_of(d, 2)
        assert [n["node_id"] for n in rec["nodes"]] == ["w0", "w1"]
        assert [q["node_id"] for q in rec["quarantined"]] == ["w2"]
        q = rec["quarantined"][0]
        assert q["reason"] == "norm_ratio" and q["norm"] > q["bound"] > 0
        assert q["norm"] == norm_oracle(decoded(bad))
        st = status(d)["robust"]
        assert st["max_norm_ratio"] == 10 and st["quarantined_total"] == 2
        assert [e["node_id"] for e in st["quarantined"]] == ["w2", "w2"]
        assert {e["basis"] for e in st["quarantined"]} == {"round"}
        metrics = urllib.request.build_opener(urllib.request.ProxyHandler({})).open(f"{d.url}/metrics").read().decode()
        assert 'dilocod_deltas_quarantined_total{reason="norm_ratio"} 2' in metrics
    finally:
        assert d.stop() == 0


def test_max_norm_refuses_every_delta_and_nothing_commits(tmp_path):
    """--max-norm below every delta's norm: each is refused 422, the round never closes, the committed
    step stays 0, and /status says why (every quarantine, with the absolute bound)."""
    init = model(5)
    d = start(tmp_path, init, "--expected-nodes", "2", "--round-timeout", "0.5", "--max-norm", "0.001")
    try:
        rng = np.random.default_rng(9)
        for node in ("w0", "w1"):
            code, body = put(d, node, 1, body_of(as_wire(rand_delta(rng, init, 0.01)), node, 0, 1))
            assert code == 422 and "max_norm" in body["error"]["message"], body
        st = status(d)
        assert st["outer_step"] == 0 and len(st["round"]["received"]) == 0
        assert [(e["node_id"], e["reason"], e["basis"]) for e in st["robust"]["quarantined"]] == [
            ("w0", "max_norm", "absolute"), ("w1", "max_norm", "absolute")]
        assert rounds(d) == [] or all(r["outer_step"] == 0 for r in rounds(d))
    finally:
        assert d.stop() == 0


# ---- the cosine screen ----------------------------------------------------------------------------

def test_cosine_screen_drops_a_flipped_sign(tmp_path):
    """--screen cosine:0: a first pass takes the round's mean and each delta's cosine with it; the
    delta whose sign was flipped (negative cosine) is dropped and the second pass aggregates the others,
    equal to the oracle over them."""
    init = model(6)
    oracle = RuleOracle(init, "median")
    d = start(tmp_path, init, "--expected-nodes", "4", "--screen", "cosine:0", "--aggregate", "median")
    try:
        rng = np.random.default_rng(11)
        common = rand_delta(rng, init, 0.02)
        deltas = {}
        for i in range(4):
            noise = rand_delta(rng, init, 0.005)
            deltas[f"w{i}"] = {k: (common[k] + noise[k]).astype(np.float32) for k in common}
        deltas["w2"] = {k: (-v).astype(np.float32) for k, v in deltas["w2"].items()}
        for node, delta in deltas.items():
            assert put(d, node, 1, body_of(as_wire(delta), node, 0, 1))[0] == 201
        wait_step(d, 1)
        kept = {n: decoded(v) for n, v in deltas.items() if n != "w2"}
        check_global(d, oracle.step(kept))
        rec = record_of(d, 1)
        assert [q["node_id"] for q in rec["quarantined"]] == ["w2"]
        assert rec["quarantined"][0]["reason"] == "cosine" and rec["quarantined"][0]["cosine"] < 0
        assert status(d)["robust"]["screen"] == "cosine:0"
    finally:
        assert d.stop() == 0


def test_cosine_screen_dropping_every_delta_commits_nothing(tmp_path):
    """A screen no delta passes (cosine:1 with deltas pointing different ways): nothing is committed,
    the round's deltas go and it collects again, and the same workers' next deltas make the step."""
    init = model(7)
    d = start(tmp_path, init, "--expected-nodes", "2", "--screen", "cosine:1")
    try:
        rng = np.random.default_rng(13)
        for node in ("w0", "w1"):
            assert put(d, node, 1, body_of(as_wire(rand_delta(rng, init, 0.01)), node, 0, 1))[0] == 201
        d.wait_until(lambda: status(d)["robust"]["quarantined_by_reason"]["cosine"] == 2, "both screened out")
        d.wait_until(lambda: status(d).get("state") == "collecting", "collecting again")
        st = status(d)
        assert st["outer_step"] == 0 and len(st["round"]["received"]) == 0
        assert "every delta of the round was quarantined" in d.log_text()
    finally:
        assert d.stop() == 0


# ---- async mode -----------------------------------------------------------------------------------

@pytest.mark.parametrize("rule", ["median", "trimmed_mean:1", "clipped_mean"])
def test_rules_in_async_mode(tmp_path, rule):
    """Async mode with a grace window: each update's batch of three deltas is aggregated by the rule,
    then Delayed Nesterov; every update's global equals the async oracle fed the rule's aggregate."""
    from test_async import AsyncOracle
    init = model(8)
    oracle = AsyncOracle(init, 2, lr=LR, mu=MU)
    d = start(tmp_path, init, "--mode", "async", "--expected-nodes", "3", "--dn-period", "2", "--grace-ms", "1500",
              "--aggregate", rule)
    try:
        rng = np.random.default_rng(17)
        for step in range(4):
            batch = {f"w{i}": rand_delta(rng, oracle.state, 0.01 * (10 if i == 2 else 1), ties=True)
                     for i in range(3)}
            for node, delta in batch.items():
                code, body = put(d, node, step + 1, body_of(as_wire(delta), node, step, step + 1))
                assert code == 201, body
            wait_step(d, step + 1)
            rec = record_of(d, step + 1)
            assert [n["node_id"] for n in rec["nodes"]] == ["w0", "w1", "w2"], rec
            ds = [decoded(batch[n]) for n in ("w0", "w1", "w2")]
            scales = clip_scales([norm_oracle(x) for x in ds]) if rule == "clipped_mean" else None
            oracle.update(ds, rec["weight"], aggregate=lambda xs: rule_oracle(rule, xs, scales))
            check_global(d, oracle.state)
    finally:
        assert d.stop() == 0
