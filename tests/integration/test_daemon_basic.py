"""dilocod end to end over file://: bootstrap, rounds, and the torch oracle on a mixed-dtype model."""
import json
import os

import numpy as np
import torch

from dilocod_proc import Dilocod, Oracle, assert_state_close, load_torch, random_deltas, write_delta, write_model


def mixed_model(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {
        "w32": torch.randn(33, 17, generator=g),
        "w16": torch.randn(40, generator=g).to(torch.float16),
        "wbf": torch.randn(8, 9, generator=g).to(torch.bfloat16),
        "w64": torch.randn(5, generator=g).to(torch.float64),
        "z": torch.randn(6, generator=g).to(torch.complex64),
        "scalar": torch.tensor(1.5),
        "steps": torch.tensor([7, 8, 9], dtype=torch.int64),
        "mask": torch.tensor([True, False, True]),
    }


def test_bootstrap_publishes_step_zero(tmp_path):
    model = mixed_model()
    write_model(tmp_path / "init.safetensors", model)
    d = Dilocod(tmp_path, tmp_path / "hub", "--init-model", str(tmp_path / "init.safetensors"),
                "--expected-nodes", "2").start()
    try:
        d.wait_step(0)
        step = json.loads((tmp_path / "hub/global/step_count.json").read_text())
        assert step["outer_step"] == 0 and step["bootstrap"] == "true", step
        assert step["algorithm"] == "dumb_diloco" and step["model_file"] == "global/latest.safetensors"
        assert (tmp_path / "hub/global/latest.safetensors").read_bytes() == (tmp_path / "init.safetensors").read_bytes()
    finally:
        assert d.stop() == 0


def test_rounds_match_torch_oracle(tmp_path):
    model = mixed_model(1)
    write_model(tmp_path / "init.safetensors", model)
    oracle = Oracle(model)
    rng = np.random.default_rng(5)
    d = Dilocod(tmp_path, tmp_path / "hub", "--init-model", str(tmp_path / "init.safetensors"),
                "--expected-nodes", "4", "--threads", "2").start()
    try:
        for r in range(4):
            d.wait_step(r)
            deltas = {f"node-{i}": random_deltas(rng, model) for i in (3, 1, 0, 2)}
            for node, t in deltas.items():
                write_delta(tmp_path / "hub", node, r, 10 * (r + 1), t)
            want = oracle.step(deltas)
            d.wait_step(r + 1)
            assert_state_close(load_torch(tmp_path / "hub/global/latest.safetensors"), want)
        assert d.committed_step() == 4
    finally:
        assert d.stop() == 0
    log = d.log_text()
    assert "reason=all_nodes" in log and "stopped step=4" in log, log[-2000:]


def test_json_logs_one_object_per_line(tmp_path):
    """--log-format json: every line is a JSON object with ts, level, component, msg and the event's
    fields, also for messages holding quotes, spaces and backslashes."""
    model = mixed_model(2)
    write_model(tmp_path / "init.safetensors", model)
    d = Dilocod(tmp_path, tmp_path / "hub", "--init-model", str(tmp_path / "init.safetensors"),
                "--expected-nodes", "2", "--log-format", "json").start()
    try:
        d.wait_step(0)
        bad = tmp_path / "hub" / "nodes" / "w1"
        bad.mkdir(parents=True)
        # renamed into place, as a worker does (a node directory is watched: a file written in place may
        # be seen half-written first)
        (tmp_path / "bad.tmp").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{\"a\\\\b\": \"c d\"}  ")
        os.rename(tmp_path / "bad.tmp", bad / "delta_1.safetensors")
        d.wait_log("delta rejected")
    finally:
        assert d.stop() == 0
    lines = d.log_text().splitlines()
    objs = [json.loads(line) for line in lines]
    assert all({"ts", "level", "component", "msg"} <= o.keys() for o in objs), objs[:3]
    rejected = [o for o in objs if o["msg"] == "delta rejected"]
    assert len(rejected) == 1 and rejected[0]["path"] == "nodes/w1/delta_1.safetensors", rejected
    assert rejected[0]["code"].startswith("invalid_header") and " " in rejected[0]["error"], rejected
    assert any(o["msg"] == "stopped" and o["exit_code"] == 0 for o in objs)   # a number (JSON logs keep types)
