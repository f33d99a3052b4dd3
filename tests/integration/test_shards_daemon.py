"""Sharded globals on the daemon side (issue 14), over HTTP with no transport: above --shard-size the
global is served as huggingface_hub lays it out (an index and its shards; the plain file is a 404 that
says so), step_count.json names the index, `diloco pull` writes the same layout, and the stock
huggingface_hub.load_torch_model and plain safetensors load it.  A sharded --init-model (written by
huggingface_hub.save_torch_state_dict) bootstraps, and rounds stay bit-equal to the torch oracle."""
import json
import time
import urllib.error
import urllib.request

import numpy as np
import pytest
import torch

from conftest import run
from dilocod_proc import Dilocod, Oracle, assert_state_equal, delta_metadata, load_torch, module_for, random_deltas

SHARD = 50_000          # bytes: the model below needs 2 or more shards


def model():
    g = torch.Generator().manual_seed(11)
    return {"embed.weight": torch.randn(100, 64, generator=g),          # 25,600 bytes
            "layer.0.weight": torch.randn(64, 64, generator=g),         # 16,384
            "layer.0.bias": torch.randn(64, generator=g),
            "layer.1.weight": torch.randn(128, 64, generator=g),        # 32,768
            "norm.weight": torch.randn(64, generator=g).to(torch.bfloat16),
            "steps": torch.tensor([7], dtype=torch.int64)}


def get(url):
    try:
        with urllib.request.urlopen(url, timeout=30) as r:
            return r.status, r.read(), dict(r.headers)
    except urllib.error.HTTPError as e:
        return e.code, e.read(), dict(e.headers)


def wait_served(url, step, timeout=60):
    """step_count.json once GET /global/ serves step (a sharded step is served once its set is written)."""
    deadline = time.time() + timeout
    while True:
        code, body, _h = get(url + "/global/step_count.json")
        if code == 200 and json.loads(body)["outer_step"] == step:
            return json.loads(body)
        assert time.time() < deadline, (code, body)
        time.sleep(0.05)


def push(diloco_bin, url, path):
    p = run([diloco_bin, "push", "--server", url, path], check=0)
    return json.loads(p.stdout)


def write_delta_file(path, node, base, local, tensors):
    from safetensors.numpy import save_file
    save_file(tensors, str(path), metadata=delta_metadata(node, base, local))
    return path


def load_pulled(dirpath):
    """The pulled global through the index with plain safetensors (what a worker without
    huggingface_hub does, as the README shows)."""
    from safetensors.torch import load_file
    index = json.loads((dirpath / "latest.safetensors.index.json").read_text())
    out = {}
    for shard in sorted(set(index["weight_map"].values())):
        out.update(load_file(str(dirpath / shard)))
    assert sorted(out) == sorted(index["weight_map"])
    return out


def test_sharded_global_over_http(tmp_path, diloco_bin):
    from huggingface_hub import load_torch_model
    m = model()
    from safetensors.torch import save_file
    save_file(m, str(tmp_path / "init.safetensors"))
    d = Dilocod(tmp_path, None, "--init-model", tmp_path / "init.safetensors", "--expected-nodes", "2",
                "--shard-size", str(SHARD)).start()
    oracle = Oracle(m)
    rng = np.random.default_rng(5)
    try:
        url = d.url
        d.wait_log("the global is published sharded")
        # step 0: the bootstrap, served sharded
        for step in range(3):
            sc = wait_served(url, step)
            assert sc["model_file"] == "global/latest.safetensors.index.json", sc
            code, body, _h = get(url + "/global/latest.safetensors")
            assert code == 404 and b"sharded" in body, (code, body)
            code, body, h = get(url + "/global/latest.safetensors.index.json")
            assert code == 200 and h["X-Outer-Step"] == str(step), (code, h)
            index = json.loads(body)
            shards = sorted(set(index["weight_map"].values()))
            n = len(shards)
            assert n >= 2 and shards == [f"latest-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)], shards
            assert index["metadata"]["total_size"] == sum(v.numel() * v.element_size() for v in m.values())
            code, body, _h = get(url + f"/global/latest-{n + 1:05d}-of-{n:05d}.safetensors")
            assert code == 404, code
            # diloco pull writes the same layout; huggingface_hub and plain safetensors load it
            out = tmp_path / f"pulled-{step}"
            run([diloco_bin, "pull", "--server", url, "-o", out], check=0)
            assert (out / "latest.safetensors.index.json").exists() and not (out / "latest.safetensors").exists()
            got = load_pulled(out)
            assert_state_equal(got, oracle.state)
            mod = module_for(m)
            load_torch_model(mod, str(out), strict=True, filename_pattern="latest{suffix}.safetensors")
            assert_state_equal(dict(mod.state_dict()), oracle.state)
            # a round of two single-file deltas against the sharded global
            if step < 2:
                deltas = {n: random_deltas(rng, m) for n in ("w1", "w2")}
                for n, t in deltas.items():
                    ans = push(diloco_bin, url, write_delta_file(tmp_path / f"{n}-{step}.safetensors", n, step,
                                                                 10 * (step + 1), t))
                    assert ans["result"] == "accepted", ans
                oracle.step({n: {k: torch.from_numpy(v) for k, v in t.items()} for n, t in deltas.items()})
        d.wait_settled(2)       # the earlier steps' files go in a job after the settle; a stop skips it
    finally:
        assert d.stop() == 0
    # the state keeps one file per step; the published set sits next to it
    sets = sorted(p.name for p in (d.state_dir / "global").iterdir())
    assert sets == ["latest-2.safetensors", "set-2"], sets


def test_sharded_init_model_and_restart(tmp_path, diloco_bin):
    """An --init-model saved sharded by huggingface_hub bootstraps (the state holds one file); below
    the shard size the global is served plain, byte for byte the file safetensors writes; a restart
    above it writes the set for the committed step and serves it."""
    from huggingface_hub import save_torch_state_dict
    from safetensors.torch import save_file
    m = model()
    init = tmp_path / "init"
    init.mkdir()
    save_torch_state_dict(m, str(init), filename_pattern="model{suffix}.safetensors", max_shard_size=SHARD)
    assert (init / "model.safetensors.index.json").exists()
    d = Dilocod(tmp_path, None, "--init-model", init / "model.safetensors.index.json", "--expected-nodes", "2").start()
    try:
        code, body, h = get(d.url + "/global/latest.safetensors")
        assert code == 200 and h["X-Outer-Step"] == "0"
        save_file(m, str(tmp_path / "plain.safetensors"))
        got = load_torch(tmp_path / "plain.safetensors")
        from safetensors.torch import load as st_load
        assert_state_equal(st_load(body), got)
        code, body, _h = get(d.url + "/global/latest.safetensors.index.json")
        assert code == 404 and b"not sharded" in body
        sc = json.loads(get(d.url + "/global/step_count.json")[1])
        assert sc["model_file"] == "global/latest.safetensors" and sc["outer_step"] == 0
    finally:
        assert d.stop() == 0
    d.start("--shard-size", str(SHARD))
    try:
        d.wait_log("sharded global written")
        code, body, _h = get(d.url + "/global/latest.safetensors.index.json")
        assert code == 200
        out = tmp_path / "pulled"
        run([diloco_bin, "pull", "--server", d.url, "-o", out], check=0)
        assert_state_equal(load_pulled(out), m)
    finally:
        assert d.stop() == 0


@pytest.mark.parametrize("value,want", [("5GB", 5_000_000_000), ("1000000", 1_000_000), ("0", 0),
                                        ("1.5MB", 1_500_000), ("5 GB", None), ("-1", None), ("lots", None)])
def test_shard_size_option(tmp_path, value, want):
    """--shard-size takes bytes or huggingface_hub's units (decimal); --check-config prints it back."""
    from conftest import BUILD
    from safetensors.torch import save_file
    save_file(model(), str(tmp_path / "init.safetensors"))
    p = run([BUILD / "dilocod", "--check-config", "--state-root", tmp_path / "state", "--hub", "none",
             "--init-model", tmp_path / "init.safetensors", "--expected-nodes", "2", "--shard-size", value])
    if want is None:
        assert p.returncode == 2 and "--shard-size" in p.stderr and "is not a size" in p.stderr, p
    else:
        assert p.returncode == 0 and f"shard_size = {want}\n" in p.stdout, p
