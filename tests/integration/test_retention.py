"""Retention (issue 13): what dilocod keeps on disk, and what it removes, against the real binary.

- `--prune-consumed 1` on a file:// tree removes a delta once the step it went into is durable, a stale
  delta and a superseded one at once; it never removes a file rewritten after it was taken in, a delta
  of a future step, or an invalid file (the operator's to look at).  Off by default: nothing is removed.
- `--history-keep N`: rounds.jsonl is compacted at startup to the last N records once it holds 2N.
- A start that fails leaves no state skeleton behind.
"""
import json
import os
import time

import numpy as np
import torch

from dilocod_proc import Dilocod, Oracle, assert_state_close, load_torch, random_deltas, write_delta, write_model


def small_model():
    g = torch.Generator().manual_seed(5)
    return {"w": torch.randn(64, 32, generator=g), "b": torch.randn(32, generator=g)}


def start(tmp_path, model, *args):
    write_model(tmp_path / "init.safetensors", model)
    d = Dilocod(tmp_path, tmp_path / "hub", "--init-model", str(tmp_path / "init.safetensors"), *args).start()
    d.wait_step(0)
    return d


def test_prune_consumed_removes_exactly_what_can_never_count(tmp_path):
    model = small_model()
    oracle = Oracle(model)
    rng = np.random.default_rng(3)
    hub = tmp_path / "hub"
    d = start(tmp_path, model, "--expected-nodes", "2", "--prune-consumed", "1")
    try:
        # round 0: both deltas go into step 1, then are removed once step 1 is durable
        deltas = {n: random_deltas(rng, model) for n in ("a", "b")}
        for n, t in deltas.items():
            write_delta(hub, n, 0, 10, t)
        want = oracle.step(deltas)
        d.wait_step(1)
        d.wait_durable(1)
        d.wait_until(lambda: not (hub / "nodes/a/delta_10.safetensors").exists()
                     and not (hub / "nodes/b/delta_10.safetensors").exists(), "the consumed deltas pruned", timeout=10)
        assert_state_close(load_torch(hub / "global/latest.safetensors"), want)

        # a stale delta (based on step 0 while step 1 is open) is removed at once
        write_delta(hub, "c", 0, 11, random_deltas(rng, model))
        d.wait_until(lambda: not (hub / "nodes/c/delta_11.safetensors").exists(), "the stale delta pruned", timeout=10)
        # a future delta (based on step 5) and an invalid file stay
        write_delta(hub, "f", 5, 1, random_deltas(rng, model))
        (hub / "nodes/x").mkdir()
        (hub / "nodes/x/delta_1.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00not json")
        d.wait_log("delta rejected")
        d.wait_log("reason=future")

        # a file rewritten under the same name after its delta was taken in is another version: kept
        write_delta(hub, "a", 1, 20, random_deltas(rng, model))
        d.wait_log("round: delta accepted step=1 node=a ")
        (tmp_path / "junk").write_bytes(b"not the delta that was taken in")
        os.replace(tmp_path / "junk", hub / "nodes/a/delta_20.safetensors")
        # the round closes with b; a's file under the name is now another version
        write_delta(hub, "b", 1, 20, random_deltas(rng, model))
        d.wait_step(2)
        d.wait_durable(2)
        # b's prune follows the settle; a prune of the others would have happened by then too
        d.wait_until(lambda: not (hub / "nodes/b/delta_20.safetensors").exists(), "the prune of b's delta")
        time.sleep(0.5)
        assert (hub / "nodes/a/delta_20.safetensors").exists(), "a rewritten delta was pruned"
        assert (hub / "nodes/f/delta_1.safetensors").exists(), "a future delta was pruned"
        assert (hub / "nodes/x/delta_1.safetensors").exists(), "an invalid file was pruned"
    finally:
        assert d.stop() == 0


def test_without_prune_consumed_nothing_is_removed(tmp_path):
    model = small_model()
    rng = np.random.default_rng(4)
    hub = tmp_path / "hub"
    d = start(tmp_path, model, "--expected-nodes", "2")
    try:
        for n in ("a", "b"):
            write_delta(hub, n, 0, 10, random_deltas(rng, model))
        d.wait_step(1)
        d.wait_durable(1)
        write_delta(hub, "c", 0, 11, random_deltas(rng, model))
        d.wait_log("reason=stale")
        time.sleep(0.3)
        for rel in ("a/delta_10", "b/delta_10", "c/delta_11"):
            assert (hub / f"nodes/{rel}.safetensors").exists(), rel
    finally:
        assert d.stop() == 0


def test_history_is_compacted_to_history_keep(tmp_path):
    model = small_model()
    rng = np.random.default_rng(5)
    hub = tmp_path / "hub"
    d = start(tmp_path, model, "--expected-nodes", "1", "--history-keep", "16")
    try:
        for r in range(34):
            write_delta(hub, "a", r, r + 1, random_deltas(rng, model))
            d.wait_step(r + 1)
        d.wait_durable(34)
    finally:
        assert d.stop() == 0
    lines = (d.state_dir / "rounds.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines] == list(range(34))      # under 2 x 16: not compacted yet
    d.start()
    try:
        d.wait_log("round: opened step=34 ", count=2)      # the restart's (the first run logged one)
        lines = (d.state_dir / "rounds.jsonl").read_text().splitlines()
        assert [json.loads(x)["step"] for x in lines] == list(range(18, 34)), lines[:2]
        import requests
        served = requests.get(f"http://127.0.0.1:{d.port}/rounds", timeout=10).json()["rounds"]
        assert [x["step"] for x in served] == list(range(18, 34))
    finally:
        assert d.stop() == 0


def test_a_failed_start_leaves_no_state_skeleton(tmp_path):
    import socket
    model = small_model()
    write_model(tmp_path / "init.safetensors", model)
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen(1)
    port = busy.getsockname()[1]
    try:
        # the port is taken: only the start finds it; nothing may be left under the state root
        d = Dilocod(tmp_path, None, "--init-model", str(tmp_path / "init.safetensors"), "--expected-nodes", "1",
                    "--listen", f"127.0.0.1:{port}").start()
        assert d.proc.wait(30) == 1
        assert not (tmp_path / "state" / "aggregator").exists(), list((tmp_path / "state").rglob("*"))
        assert "cannot listen" in d.log_text()
        # the same with a file:// hub that does not exist yet and --create-hub: neither the state nor the
        # tree is made (without --create-hub the start refuses the hub first: the same, and said)
        d1 = Dilocod(tmp_path / "one", tmp_path / "one" / "tree", "--init-model", str(tmp_path / "init.safetensors"),
                     "--expected-nodes", "1", "--listen", f"127.0.0.1:{port}", "--create-hub", make_hub=False)
        (tmp_path / "one").mkdir()
        d1.start()
        assert d1.proc.wait(30) == 1
        assert not (tmp_path / "one" / "tree").exists() and not (tmp_path / "one" / "state" / "aggregator").exists()
        # nothing to start from (--hub none, no model): the same
        d2 = Dilocod(tmp_path / "two", None, "--expected-nodes", "1")
        (tmp_path / "two").mkdir()
        d2.start()
        assert d2.proc.wait(30) == 1
        assert not (tmp_path / "two" / "state" / "aggregator").exists()
        # an existing state is never removed by a failed start
        ok = Dilocod(tmp_path / "three", None, "--init-model", str(tmp_path / "init.safetensors"),
                     "--expected-nodes", "1")
        (tmp_path / "three").mkdir()
        ok.start()
        ok.wait_log("round: opened step=0 ")
        assert ok.stop() == 0
        again = Dilocod(tmp_path / "three", None, "--expected-nodes", "1", "--listen", f"127.0.0.1:{port}")
        again.start()
        assert again.proc.wait(30) == 1
        assert (tmp_path / "three" / "state" / "aggregator" / "outer_metadata.json").exists()
    finally:
        busy.close()
