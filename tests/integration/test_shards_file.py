"""Sharded checkpoints on the file:// transport (issue 14), with the real dilocod and the real peers:
workers write their deltas into the shared directory with huggingface_hub.save_torch_state_dict (shards,
then the index, straight into the node directory), or as single files with safetensors.

- a round mixing sharded and single-file nodes equals the torch oracle bit for bit, and the same round
  with every node a single file gives the same bytes;
- a set with a shard missing waits (nothing refused, the round does not close) and completes when the
  shard arrives;
- an inconsistent set (a tensor in two shards, total_size off) is refused with a reason, in the log
  and in /status;
- with a small --shard-size the published global is sharded (shards, index, step_count.json naming the
  index, no latest.safetensors), huggingface_hub.load_torch_model loads it from the tree and so does
  plain safetensors through the index; a dilocod on a fresh state directory adopts it and its next
  round equals the oracle started from the adopted weights (fresh momentum).
"""
import json
import shutil
import time
import urllib.request

import numpy as np
import torch
from huggingface_hub import load_torch_model, save_torch_state_dict
from safetensors.torch import load_file, save_file

from dilocod_proc import Dilocod, Oracle, assert_state_equal, delta_metadata, module_for, random_deltas, write_delta

DELTA_SHARD = 20_000    # bytes: each delta below splits into 4 or more shards
GLOBAL_SHARD = 50_000   # bytes: the published global needs 2 or more


def model():
    g = torch.Generator().manual_seed(3)
    return {"embed.weight": torch.randn(100, 64, generator=g),          # 25,600 bytes: a shard of its own
            "layer.0.weight": torch.randn(64, 64, generator=g),         # 16,384
            "layer.0.bias": torch.randn(64, generator=g),
            "layer.1.weight": torch.randn(128, 64, generator=g),        # 32,768
            "norm.weight": torch.randn(64, generator=g).to(torch.bfloat16),
            "steps": torch.tensor([7], dtype=torch.int64)}


def write_sharded_delta(hub, node, base, local, tensors, max_shard=DELTA_SHARD):
    """What a worker with huggingface_hub does: save_torch_state_dict straight into its node directory
    (shards, then the index).  Returns the index path."""
    d = hub / "nodes" / node
    d.mkdir(parents=True, exist_ok=True)
    sd = {k: torch.from_numpy(v) for k, v in tensors.items()}
    save_torch_state_dict(sd, str(d), filename_pattern=f"delta_{local}{{suffix}}.safetensors",
                          max_shard_size=max_shard, metadata=delta_metadata(node, base, local))
    index = d / f"delta_{local}.safetensors.index.json"
    assert index.exists() and len(set(json.loads(index.read_text())["weight_map"].values())) >= 2
    return index


def start(tmp_path, name, *args):
    hub = tmp_path / name
    init = tmp_path / "init.safetensors"
    if not init.exists():
        save_file(model(), str(init))
    d = Dilocod(tmp_path / f"run-{name}", hub, "--init-model", init, *args)
    (tmp_path / f"run-{name}").mkdir()
    d.start()
    d.wait_step(0)
    return d, hub


def place_set(index, node_dir):
    """Puts a set written elsewhere into a node directory as a careful worker does: each file renamed
    into place, the shards first, the index last."""
    node_dir.mkdir(parents=True, exist_ok=True)
    names = sorted(set(json.loads(index.read_text())["weight_map"].values())) + [index.name]
    for name in names:
        tmp = node_dir / f".{name}.tmp"
        shutil.copy(index.parent / name, tmp)
        tmp.rename(node_dir / name)


def status(d):
    with urllib.request.urlopen(d.url + "/status", timeout=30) as r:
        return json.loads(r.read())


def load_published_set(hub):
    """The published global through its index with plain safetensors."""
    g = hub / "global"
    index = json.loads((g / "latest.safetensors.index.json").read_text())
    out = {}
    for shard in sorted(set(index["weight_map"].values())):
        out.update(load_file(str(g / shard)))
    assert sorted(out) == sorted(index["weight_map"])
    return out


def test_mixed_sharded_and_single_round_equals_torch_and_all_single(tmp_path):
    m = model()
    rng = np.random.default_rng(21)
    deltas = {n: random_deltas(rng, m) for n in ("w1", "w2", "w3")}
    oracle = Oracle(m)
    oracle.step({n: {k: torch.from_numpy(v) for k, v in t.items()} for n, t in deltas.items()})

    mixed, mixed_hub = start(tmp_path, "mixed", "--expected-nodes", "3")
    single, single_hub = start(tmp_path, "single", "--expected-nodes", "3")
    try:
        write_sharded_delta(mixed_hub, "w1", 0, 10, deltas["w1"])
        write_delta(mixed_hub, "w2", 0, 10, deltas["w2"])
        write_sharded_delta(mixed_hub, "w3", 0, 10, deltas["w3"], max_shard=30_000)
        for n, t in deltas.items():
            write_delta(single_hub, n, 0, 10, t)
        mixed.wait_step(1)
        single.wait_step(1)
        assert_state_equal(load_file(str(mixed_hub / "global" / "latest.safetensors")), oracle.state)
        assert ((mixed_hub / "global" / "latest.safetensors").read_bytes()
                == (single_hub / "global" / "latest.safetensors").read_bytes())
        s = status(mixed)
        assert s["counters"]["rejected"] == 0, s["counters"]
        log = mixed.log_text()
        assert "nodes/w1/delta_10.safetensors.index.json" in log and "delta rejected" not in log
    finally:
        assert mixed.stop() == 0
        assert single.stop() == 0


def test_a_partial_set_waits_and_completes(tmp_path):
    m = model()
    rng = np.random.default_rng(22)
    deltas = {n: random_deltas(rng, m) for n in ("w1", "w2")}
    oracle = Oracle(m)
    oracle.step({n: {k: torch.from_numpy(v) for k, v in t.items()} for n, t in deltas.items()})
    d, hub = start(tmp_path, "tree", "--expected-nodes", "2")
    try:
        # the set is written elsewhere, then put in place without its last shard
        staged = write_sharded_delta(tmp_path / "staging", "w1", 0, 4, deltas["w1"])
        node = hub / "nodes" / "w1"
        node.mkdir(parents=True, exist_ok=True)
        shards = sorted(set(json.loads(staged.read_text())["weight_map"].values()))
        for s in shards[:-1]:
            shutil.copy(staged.parent / s, node / s)
        shutil.copy(staged, node / staged.name)
        write_delta(hub, "w2", 0, 4, deltas["w2"])
        d.wait_log("sharded delta incomplete, waiting for its shards path=nodes/w1/delta_4.safetensors.index.json")
        d.wait_log("path=nodes/w2/delta_4.safetensors")
        # w2 is in, w1 waits: the round stays open, nothing is refused
        deadline = time.time() + 30
        while status(d)["counters"]["accepted"] < 1:
            assert time.time() < deadline, status(d)
            time.sleep(0.05)
        assert d.published_step() == 0
        assert status(d)["counters"]["rejected"] == 0
        assert "delta rejected" not in d.log_text()
        # the last shard arrives (renamed into place, as a worker does): the set is taken, the round closes
        tmp = node / f".{shards[-1]}.tmp"
        shutil.copy(staged.parent / shards[-1], tmp)
        tmp.rename(node / shards[-1])
        d.wait_step(1)
        assert_state_equal(load_file(str(hub / "global" / "latest.safetensors")), oracle.state)
        assert d.log_text().count("sharded delta incomplete, waiting for its shards") == 1
    finally:
        assert d.stop() == 0


def test_an_inconsistent_set_is_refused_with_a_reason(tmp_path):
    m = model()
    rng = np.random.default_rng(23)
    d, hub = start(tmp_path, "tree", "--expected-nodes", "2")
    try:
        # each set is spoiled where it is written, then put in place whole (shards, then the index),
        # so the daemon only ever sees the spoiled version
        # total_size off by 4
        index = write_sharded_delta(tmp_path / "staging", "w1", 0, 5, random_deltas(rng, m))
        doc = json.loads(index.read_text())
        doc["metadata"]["total_size"] += 4
        index.write_text(json.dumps(doc, indent=2))
        # a tensor listed in one shard and stored in two
        index2 = write_sharded_delta(tmp_path / "staging", "w2", 0, 6, random_deltas(rng, m))
        doc = json.loads(index2.read_text())
        shards = sorted(set(doc["weight_map"].values()))
        first = load_file(str(index2.parent / shards[0]))
        other = load_file(str(index2.parent / shards[1]))
        other.update(first)
        save_file(other, str(index2.parent / shards[1]), metadata={"format": "pt"})
        place_set(index, hub / "nodes" / "w1")
        place_set(index2, hub / "nodes" / "w2")
        d.wait_log("delta rejected", count=2)
        log = d.log_text()
        lines = [l for l in log.splitlines() if "delta rejected" in l]
        w1 = [l for l in lines if "nodes/w1/delta_5.safetensors.index.json" in l]
        w2 = [l for l in lines if "nodes/w2/delta_6.safetensors.index.json" in l]
        assert len(w1) == 1 and "total_size" in w1[0], lines
        assert len(w2) == 1 and shards[1] in w2[0], lines
        s = status(d)
        assert s["counters"]["rejected"] == 2 and s["counters"]["accepted"] == 0, s["counters"]
        assert d.published_step() == 0
        # refused once per version: more polls (every 0.05 s) add nothing
        time.sleep(0.5)
        assert d.log_text().count("delta rejected") == 2
    finally:
        assert d.stop() == 0


def test_small_shard_size_publishes_a_sharded_global_that_loads_and_is_adopted(tmp_path):
    m = model()
    rng = np.random.default_rng(24)
    deltas = {n: random_deltas(rng, m) for n in ("w1", "w2")}
    oracle = Oracle(m)
    oracle.step({n: {k: torch.from_numpy(v) for k, v in t.items()} for n, t in deltas.items()})
    d, hub = start(tmp_path, "tree", "--expected-nodes", "2", "--shard-size", str(GLOBAL_SHARD))
    g = hub / "global"
    try:
        write_sharded_delta(hub, "w1", 0, 10, deltas["w1"])
        write_delta(hub, "w2", 0, 10, deltas["w2"])
        d.wait_step(1)
    finally:
        assert d.stop() == 0
    sc = json.loads((g / "step_count.json").read_text())
    assert sc["outer_step"] == 1 and sc["model_file"] == "global/latest.safetensors.index.json", sc
    assert not (g / "latest.safetensors").exists()
    names = sorted(p.name for p in g.iterdir())
    index = json.loads((g / "latest.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    n = len(shards)
    assert n >= 2 and shards == [f"latest-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)], shards
    assert names == sorted(shards + ["latest.safetensors.index.json", "step_count.json"]), names
    # plain safetensors through the index, and huggingface_hub from the tree itself
    assert_state_equal(load_published_set(hub), oracle.state)
    mod = module_for(m)
    load_torch_model(mod, str(g), strict=True, filename_pattern="latest{suffix}.safetensors")
    assert_state_equal(dict(mod.state_dict()), oracle.state)

    # a dilocod on a fresh state directory adopts the sharded global (momentum fresh) and goes on
    adopted = Oracle(oracle.state)
    more = {n: random_deltas(rng, m) for n in ("w1", "w2")}
    adopted.step({n: {k: torch.from_numpy(v) for k, v in t.items()} for n, t in more.items()})
    (tmp_path / "fresh").mkdir()
    d2 = Dilocod(tmp_path / "fresh", hub, "--expected-nodes", "2", "--shard-size", str(GLOBAL_SHARD),
                 state_root=tmp_path / "fresh" / "state")
    d2.start()
    try:
        d2.wait_log("adopted the published global step=1")
        write_sharded_delta(hub, "w1", 1, 20, more["w1"])
        write_sharded_delta(hub, "w2", 1, 20, more["w2"], max_shard=30_000)
        d2.wait_step(2)
        # the transport's copy of the set (a directory of its own) is gone once the daemon took it in
        assert not (d2.state_dir / "cache" / "incoming" / "file-global-1").exists()
        sc = json.loads((g / "step_count.json").read_text())
        assert sc["model_file"] == "global/latest.safetensors.index.json", sc
        assert_state_equal(load_published_set(hub), adopted.state)
    finally:
        assert d2.stop() == 0
