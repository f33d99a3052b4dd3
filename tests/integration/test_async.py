"""Asynchronous mode (--mode async) against a torch oracle of README's contract, bit for bit.

Every accepted delta (or grace batch) is one update.  The oracle below is the contract written in torch:
per update with pseudo-gradient g (the mean of the update's deltas, sum / len in the record's order) and
weight w (the record's: the mean of its deltas' staleness weights),

    forgather:  a.add_(g, alpha=w); k += 1
                k < N:  p.add_(g, alpha=-lr*w)
                else:   p.grad = a / N; SGD(lr, momentum, nesterov).step(); a.zero_(); k = 0
    paper:      a.add_(g, alpha=w); p.add_(g, alpha=-lr*w/N); k += 1
                k < N:  p.add_(m, alpha=-lr*c*mu)            (when c > 0 and m exists)
                else:   m = mu*m + a/N (a/N the first time); p.add_(m, alpha=-lr*(1-c*N+c)*mu); a.zero_(); k = 0

on F32 copies of the weights, rounded to each weight's dtype after every update.  The deltas come with
mixed staleness (bases up to three updates old), the weights are F32 and BF16, and each published
global, momentum and accumulator is compared byte for byte."""
import json
import math
import time
import urllib.error
import urllib.request

import numpy as np
import pytest
import torch
from safetensors.numpy import save as np_save
from safetensors.torch import load as torch_load_bytes
from safetensors.torch import save as st_save

from dilocod_proc import Dilocod, Oracle, assert_state_equal, delta_metadata, load_torch, write_delta, write_model
from test_torch_exact import torch_cpu_capability

pytestmark = pytest.mark.skipif(
    torch_cpu_capability() not in ("AVX2", "AVX512"),
    reason="torch fuses add(x, alpha=...) only in its AVX2/AVX-512 kernels (see test_torch_exact.py)")

UPDATES = 21
LR, MU = 0.7, 0.9


def model(seed):
    g = torch.Generator().manual_seed(seed)
    m = {
        "f32.w": torch.randn(37, 29, generator=g),
        "f32.big": torch.randn(301, 1009, generator=g),
        "bf16.w": torch.randn(31, 17, generator=g).to(torch.bfloat16),
        "step": torch.tensor([7, -3], dtype=torch.int64),
    }
    m["f32.w"].view(-1)[::97] = -0.0
    return m


class AsyncOracle:
    """README's async contract in torch, fed the updates in the order dilocod recorded them."""

    def __init__(self, init, n, variant="forgather", c=0.0, lr=LR, mu=MU):
        self.state = {k: v.clone() for k, v in init.items()}
        self.floating = [k for k, v in init.items() if v.is_floating_point()]
        self.n, self.variant, self.c, self.lr, self.mu = n, variant, c, lr, mu
        self.params = {k: torch.nn.Parameter(init[k].to(torch.float32)) for k in self.floating}
        self.opt = torch.optim.SGD(list(self.params.values()), lr=lr, momentum=mu, nesterov=True)
        self.acc = {k: torch.zeros_like(self.params[k], dtype=torch.float32) for k in self.floating}
        self.m = {}                     # the paper variant's momentum
        self.k = 0

    def momentum(self):
        if self.variant == "paper":
            return {k: v.clone() for k, v in self.m.items()}
        out = {}
        for k in self.floating:
            buf = self.opt.state.get(self.params[k], {}).get("momentum_buffer")
            if buf is not None:
                out[k] = buf.clone()
        return out

    def update(self, deltas, w, aggregate=None):
        """deltas: the update's deltas ({key: array}) in the record's order; w: the record's weight;
        aggregate(list of F32 arrays) -> the update's g in place of the mean (--aggregate)."""
        n, lr, mu, c = self.n, self.lr, self.mu, self.c
        self.k += 1
        tick = self.k >= n
        for key in self.floating:
            if aggregate is not None:
                g = torch.from_numpy(aggregate([np.asarray(d[key], dtype=np.float32) for d in deltas]))
            else:
                g = sum(torch.from_numpy(np.asarray(d[key])).to(torch.float32) for d in deltas) / len(deltas)
            with torch.no_grad():
                p = self.params[key]
                p.copy_(self.state[key].to(torch.float32))
                self.acc[key].add_(g, alpha=w)
                if self.variant == "forgather":
                    if not tick:
                        p.add_(g, alpha=-lr * w)
                    else:
                        p.grad = self.acc[key] / n
                else:
                    p.add_(g, alpha=-lr * w / n)
                    if not tick and c > 0 and key in self.m:
                        p.add_(self.m[key], alpha=-lr * c * mu)
                    if tick:
                        grad = self.acc[key] / n
                        self.m[key] = grad.clone() if key not in self.m else self.m[key].mul(mu).add(grad)
                        p.add_(self.m[key], alpha=-lr * (1 - c * n + c) * mu)
        if tick and self.variant == "forgather":
            self.opt.step()
        for key in self.floating:
            if tick:
                self.acc[key].zero_()
            self.state[key] = self.params[key].detach().to(self.state[key].dtype).clone()
        if tick:
            self.k = 0
        return self.state


def rand_delta(rng, state, scale):
    out = {}
    for k, v in state.items():
        if not v.is_floating_point():
            continue
        x = (rng.standard_normal(tuple(v.shape)) * scale).astype(np.float32)
        x.reshape(-1)[::53] = -0.0
        out[k] = x
    return out


def records(d):
    return (d.get_json("/rounds") or {}).get("rounds", [])


def record_of(d, step):
    for r in records(d):
        if r.get("outer_step") == step:
            return r
    return None


def check_step(d, hub, oracle, step, want):
    got = load_torch(hub / "global" / "latest.safetensors")
    assert_state_equal(got, want)
    assert (hub / "global" / "latest.safetensors").read_bytes() == st_save(
        {k: v.contiguous() for k, v in want.items()}), f"update {step}"
    d.wait_durable(step)
    meta = json.loads((d.state_dir / "outer_metadata.json").read_text())
    assert meta["outer_step"] == step and meta["dn"]["k"] == oracle.k, (meta, oracle.k)
    mom = oracle.momentum()
    if mom:
        got_m = load_torch(d.state_dir / meta["outer_state_file"])
        for k, v in mom.items():
            assert torch.equal(got_m[k].view(torch.int32), v.view(torch.int32)), (step, k)
    else:
        assert meta.get("outer_state_file") is None
    if oracle.k > 0:
        got_a = load_torch(d.state_dir / meta["accum_file"])
        for k, v in oracle.acc.items():
            assert torch.equal(got_a[k].view(torch.int32), v.view(torch.int32)), (step, k)
    else:
        assert meta["accum_file"] is None


CASES = {
    "constant-n1": ("constant", 1, "forgather", 0.0),
    "constant-n3": ("constant", 3, "forgather", 0.0),
    "poly-n1": ("poly", 1, "forgather", 0.0),
    "poly-n3": ("poly", 3, "forgather", 0.0),
    "paper-poly-n3": ("poly", 3, "paper", 0.0),
    "paper-c-n3": ("constant", 3, "paper", 0.25),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_async_updates_equal_the_torch_oracle(tmp_path, case):
    weight, n, variant, c = CASES[case]
    init = model(11)
    init_path = tmp_path / "init.safetensors"
    write_model(init_path, init)
    hub = tmp_path / "hub"
    oracle = AsyncOracle(init, n, variant, c)
    rng = np.random.default_rng(7)
    d = Dilocod(tmp_path, hub, "--init-model", str(init_path), "--mode", "async", "--expected-nodes", "3",
                "--staleness-weight", weight, "--dn-period", str(n), "--dn-variant", variant,
                "--dn-momentum-activation", str(c), "--grace-ms", "0", "--threads", "2").start()
    taus = set()
    try:
        d.wait_step(0)
        local = {}
        for step in range(UPDATES):
            node = f"w{step % 3}"
            base = max(0, step - int(rng.integers(0, 4)))      # up to three updates stale
            local[node] = local.get(node, 0) + 10
            delta = rand_delta(rng, oracle.state, 0.01 * (1 + step % 4))
            write_delta(hub, node, base, local[node], delta)
            assert d.wait_step(step + 1) == step + 1
            rec = record_of(d, step + 1)
            assert rec is not None and rec["mode"] == "async" and len(rec["nodes"]) == 1, rec
            tau = step - base
            taus.add(tau)
            assert rec["nodes"][0]["tau"] == tau and rec["nodes"][0]["base_outer_step"] == base
            want_w = 1.0 if weight == "constant" else (1 + tau) ** -0.5
            assert rec["weight"] == rec["nodes"][0]["weight"] and abs(rec["weight"] - want_w) < 1e-15
            want = oracle.update([delta], rec["weight"])
            assert rec["dn_k"] == oracle.k and rec["nesterov_step"] == (oracle.k == 0)
            check_step(d, hub, oracle, step + 1, want)
        assert len(taus) >= 3           # the staleness was mixed
        st = d.get_json("/status")
        assert st["mode"] == "async" and st["async"]["updates"] == UPDATES
        assert st["async"]["dn"] == {"variant": variant, "period": n, "k": oracle.k, "c": c}
        assert sum(st["async"]["staleness"]["histogram"].values()) == UPDATES
    finally:
        assert d.stop() == 0


def put_delta(d, node, base, local, tensors):
    """PUT /nodes/<node>/delta_<local>.safetensors: (status, headers, body)."""
    body = np_save(tensors, metadata=delta_metadata(node, base, local))
    req = urllib.request.Request(f"{d.url}/nodes/{node}/delta_{local}.safetensors", data=body, method="PUT")
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(req, timeout=30) as r:
            return r.status, dict(r.headers), json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), json.loads(e.read())


def test_grace_window_batches_and_max_staleness_refuses(tmp_path):
    """Deltas within --grace-ms of the first pending one make one update (averaged in ascending node id
    order, their weights averaged), a delta more than --max-staleness behind is refused with 409 stale
    naming tau and S, and each answer recommends local steps."""
    init = model(3)
    init_path = tmp_path / "init.safetensors"
    write_model(init_path, init)
    oracle = AsyncOracle(init, 2)
    rng = np.random.default_rng(1)
    d = Dilocod(tmp_path, None, "--init-model", str(init_path), "--mode", "async", "--expected-nodes", "3",
                "--staleness-weight", "poly", "--dn-period", "2", "--grace-ms", "1500", "--max-staleness", "2",
                "--dylu-base-steps", "100", "--threads", "2").start()
    try:
        d.wait_until(lambda: (d.get_json("/status") or {}).get("outer_step") == 0, "step 0")
        # update 1: one delta; updates 2 and 3 to make stale bases possible
        for step in range(3):
            delta = rand_delta(rng, oracle.state, 0.01)
            status, headers, body = put_delta(d, "w0", step, 10 * (step + 1), delta)
            assert status == 201 and body["result"] == "accepted", body
            d.wait_until(lambda: (d.get_json("/status") or {}).get("outer_step") == step + 1, f"update {step + 1}")
            oracle.update([delta], 1.0)
        # three deltas inside one grace window, bases 3 (tau 0), 2 (tau 1) and 1 (tau 2)
        batch = {}
        for node, base in (("w2", 3), ("w1", 2), ("w0", 1)):
            batch[node] = rand_delta(rng, oracle.state, 0.02)
            status, headers, body = put_delta(d, node, base, 100 + base, batch[node])
            assert status == 201, body
            assert headers.get("X-Recommended-Local-Steps") is not None, headers
        # too stale: tau 3 > S = 2
        status, headers, body = put_delta(d, "w1", 0, 999, rand_delta(rng, oracle.state, 0.01))
        assert status == 409 and body["error"]["code"] == "stale", body
        assert "tau = 3" in body["error"]["message"] and "S = 2" in body["error"]["message"], body
        d.wait_until(lambda: (d.get_json("/status") or {}).get("outer_step") == 4, "the grace batch's update")
        rec = record_of(d, 4)
        assert [x["node_id"] for x in rec["nodes"]] == ["w0", "w1", "w2"] and rec["reason"] == "grace", rec
        assert [x["tau"] for x in rec["nodes"]] == [2, 1, 0]
        ws = [(1 + t) ** -0.5 for t in (2, 1, 0)]
        assert rec["weight"] == sum(ws) / 3, rec
        want = oracle.update([batch["w0"], batch["w1"], batch["w2"]], rec["weight"])
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        with opener.open(d.url + "/global/latest.safetensors", timeout=30) as r:
            got = torch_load_bytes(r.read())
        assert_state_equal(got, want)
        st = d.get_json("/status")
        assert st["async"]["dn"]["k"] == oracle.k
        assert st["counters"]["stale"] >= 1, st["counters"]
        nodes = {x["node_id"]: x for x in st["async"]["nodes"]}
        assert nodes["w0"]["recommended_local_steps"] >= 1
    finally:
        assert d.stop() == 0


def test_a_delta_is_applied_once_across_retries_and_restarts(tmp_path):
    """An upload retried after its delta was applied, and a file:// tree handed over again at a restart,
    do not apply a delta twice (async mode takes old bases, so the staleness check cannot tell)."""
    init = model(5)
    init_path = tmp_path / "init.safetensors"
    write_model(init_path, init)
    hub = tmp_path / "hub"
    oracle = AsyncOracle(init, 1)
    rng = np.random.default_rng(3)
    d = Dilocod(tmp_path, hub, "--init-model", str(init_path), "--mode", "async", "--expected-nodes", "2",
                "--dn-period", "1", "--threads", "2").start()
    try:
        d.wait_step(0)
        for step in range(3):
            delta = rand_delta(rng, oracle.state, 0.01)
            write_delta(hub, f"w{step % 2}", 0, 10 * (step + 1), delta)     # all based on step 0
            d.wait_step(step + 1)
            oracle.update([delta], 1.0)
        again = rand_delta(rng, oracle.state, 0.01)
        status, _, body = put_delta(d, "w0", 0, 10, again)                  # w0's first delta, once more
        assert status == 409 and body["error"]["code"] == "not_newer", body
        assert d.stop() == 0
        d.start()
        # the tree's three deltas are handed over again and refused as applied
        d.wait_until(lambda: ((d.get_json("/status") or {}).get("counters") or {}).get("not_newer", 0) >= 3,
                     "the tree's deltas refused as applied")
        st = d.get_json("/status")
        assert st["outer_step"] == 3 and st["async"]["queue"]["pending"] == 0, st
        assert_state_equal(load_torch(hub / "global" / "latest.safetensors"), oracle.state)
    finally:
        assert d.stop() == 0


def test_sharded_deltas_of_older_bases_are_updates_too(tmp_path):
    """A sharded delta (huggingface_hub's save_torch_state_dict into the node directory) based on an older
    step joins an update like a single file, and leaves the cache, every shard with its index, once the
    update is durable."""
    from test_shards_file import write_sharded_delta
    init = model(9)
    init_path = tmp_path / "init.safetensors"
    write_model(init_path, init)
    hub = tmp_path / "hub"
    oracle = AsyncOracle(init, 2)
    rng = np.random.default_rng(9)
    d = Dilocod(tmp_path, hub, "--init-model", str(init_path), "--mode", "async", "--expected-nodes", "2",
                "--dn-period", "2", "--threads", "2").start()
    try:
        d.wait_step(0)
        for step, (node, base) in enumerate((("w0", 0), ("w1", 0), ("w0", 1))):
            delta = rand_delta(rng, oracle.state, 0.01)
            write_sharded_delta(hub, node, base, 10 * (step + 1), delta, max_shard=400_000)
            d.wait_step(step + 1)
            rec = record_of(d, step + 1)
            assert rec["nodes"][0]["tau"] == step - base, rec
            check_step(d, hub, oracle, step + 1, oracle.update([delta], rec["weight"]))
            # consumed: removed by the settle before the step became durable (check_step waited for that)
            assert not list((d.state_dir / "cache" / "deltas").rglob("delta_*")), step
    finally:
        assert d.stop() == 0
