"""Sharded checkpoints (issue 14, part 1), the library and CLI half, against the real peers:

- huggingface_hub.save_torch_state_dict writes a sharded delta -> `diloco verify` / `inspect` accept it;
- hostile variants of that set (a tensor in two shards, a missing shard, an unlisted shard, total_size
  off, metadata disagreeing with the path or with a shard's own metadata, a shard name with a
  directory) are refused with a reason;
- `diloco delta` / `diloco average` over sets equal the single-file results bit for bit, and a set
  written by diloco is byte-identical to what save_torch_state_dict writes for the same state dict;
- a set written by diloco loads with huggingface_hub.load_torch_model and with plain safetensors;
- `diloco push` of a sharded delta PUTs every shard then the index (to a recording HTTP peer), and
  `diloco pull` of a sharded global served by Python's http.server writes the same layout.
"""
import http.server
import json
import os
import shutil
import threading
from pathlib import Path

import huggingface_hub as hfh
import pytest
import safetensors.torch as stt
import torch
from safetensors import safe_open

from conftest import run

META = {"algorithm": "dumb_diloco", "base_outer_step": "3", "local_step": "5", "node_id": "w1"}
SHARD = 40_000     # bytes: the state dicts below split into 3 or 4 shards


def model_state(seed):
    """A small model's state dict, in a deliberate non-alphabetical order, with a tensor bigger than
    the shard size (huggingface_hub gives it a shard of its own, numbered before the open shard)."""
    g = torch.Generator().manual_seed(seed)
    sd = {}
    for i in (3, 0, 2, 1):
        sd[f"layer{i}.weight"] = torch.randn(64, 64, generator=g)
        sd[f"layer{i}.bias"] = torch.randn(64, generator=g)
    sd["embed.weight"] = torch.randn(300, 64, generator=g)   # 76,800 bytes > SHARD
    sd["head.weight"] = torch.randn(10, 64, generator=g).to(torch.bfloat16)
    sd["steps"] = torch.tensor([7], dtype=torch.int64)      # not floating: carried, no delta
    return sd


def floating_sorted(sd):
    return {k: sd[k] for k in sorted(sd) if sd[k].is_floating_point()}


def hf_delta(tmp_path, sd, node="w1", step=5, meta=None, max_shard=SHARD):
    d = tmp_path / "nodes" / node
    d.mkdir(parents=True, exist_ok=True)
    hfh.save_torch_state_dict(sd, d, filename_pattern=f"delta_{step}{{suffix}}.safetensors",
                              metadata=meta or META, max_shard_size=max_shard)
    return d / f"delta_{step}.safetensors.index.json"


def delta_dict(seed=1):
    g = torch.Generator().manual_seed(seed)
    sd = model_state(seed)
    return {k: torch.randn(v.shape, generator=g) for k, v in floating_sorted(sd).items()}


def test_hf_sharded_delta_is_accepted(tmp_path, diloco):
    index = hf_delta(tmp_path, delta_dict())
    files = sorted(p.name for p in index.parent.iterdir())
    n = nshards(index)
    assert n >= 3
    assert files == [f"delta_5-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)] + [index.name]
    rel = "nodes/w1/delta_5.safetensors.index.json"
    p = diloco("verify", index, "--path", rel, "--json", check=0)
    assert json.loads(p.stdout) == {"valid": True, "node_id": "w1", "base_outer_step": 3, "local_step": 5,
                                    "shards": n}
    # the path may also be given as the single file's: the same delta
    diloco("verify", index, "--path", "nodes/w1/delta_5.safetensors", check=0)
    p = diloco("inspect", "--json", index, check=0)
    j = json.loads(p.stdout)
    hf_index = json.loads(index.read_text())
    assert j["sharded"] is True and j["total_size"] == hf_index["metadata"]["total_size"]
    assert j["metadata"] == META
    assert [s["file"] for s in j["shards"]] == files[:n]
    assert all(s["metadata"] == {"format": "pt"} for s in j["shards"])
    assert {t["name"]: t["shard"] for t in j["tensors"]} == hf_index["weight_map"]
    assert j["total_bytes"] == hf_index["metadata"]["total_size"]
    text = diloco("inspect", index, check=0).stdout
    assert f"{n} shards" in text and f"delta_5-00002-of-{n:05d}.safetensors" in text


def test_against_a_sharded_global(tmp_path, diloco):
    gdir = tmp_path / "global"
    gdir.mkdir()
    hfh.save_torch_state_dict(model_state(0), gdir, filename_pattern="latest{suffix}.safetensors",
                              max_shard_size=SHARD)
    index = hf_delta(tmp_path, delta_dict())
    diloco("verify", index, "--against", gdir / "latest.safetensors.index.json", check=0)
    # a single-file delta against the sharded global, and the set against a single-file global
    single = tmp_path / "single.safetensors"
    stt.save_file(delta_dict(), single, metadata=META)
    diloco("verify", single, "--against", gdir / "latest.safetensors.index.json", check=0)
    gfile = tmp_path / "g.safetensors"
    stt.save_file(model_state(0), gfile)
    diloco("verify", index, "--against", gfile, check=0)
    # a delta lacking a key of the sharded global
    d = delta_dict()
    del d["layer2.bias"]
    bad = hf_delta(tmp_path / "b", d)
    p = diloco("verify", bad, "--against", gdir / "latest.safetensors.index.json", check=1)
    assert "key_mismatch" in p.stderr and "layer2.bias" in p.stderr


def rewrite_index(index, fn):
    j = json.loads(index.read_text())
    fn(j)
    index.write_text(json.dumps(j, indent=2))


def nshards(index):
    return len(set(json.loads(index.read_text())["weight_map"].values()))


def shard_path(index, i, n=None, base="delta_5"):
    n = n or nshards(index)
    return index.parent / f"{base}-{i:05d}-of-{n:05d}.safetensors"


def refused(diloco, index, code, *words, path="nodes/w1/delta_5.safetensors.index.json"):
    p = diloco("verify", index, "--path", path, check=1)
    assert code in p.stderr, p.stderr
    for w in words:
        assert w in p.stderr, p.stderr
    return p


def test_hostile_sets_are_refused(tmp_path, diloco):
    def fresh(name):
        return hf_delta(tmp_path / name, delta_dict())

    # a tensor in two shards: shard 3 also carries a tensor of shard 1
    index = fresh("two")
    s1 = stt.load_file(shard_path(index, 1))
    s3 = stt.load_file(shard_path(index, 3))
    name = next(iter(s1))
    s3[name] = s1[name]
    stt.save_file(s3, shard_path(index, 3), metadata={"format": "pt"})
    refused(diloco, index, "key_mismatch", "two shards", name)

    # a missing shard
    index = fresh("missing")
    shard_path(index, 2).unlink()
    refused(diloco, index, "key_mismatch", f"delta_5-00002-of-{nshards(index):05d}.safetensors", "missing")

    # an unlisted shard: a stray part of another save of the same base in the directory
    index = fresh("stray")
    n = nshards(index)
    shutil.copy(shard_path(index, 1), shard_path(index, 1, n=n + 1))
    refused(diloco, index, "key_mismatch", f"delta_5-00001-of-{n + 1:05d}.safetensors", "not listed")

    # a tensor in a shard that the index does not list
    index = fresh("unlisted_tensor")
    s2 = stt.load_file(shard_path(index, 2))
    s2["extra.weight"] = torch.zeros(3)
    stt.save_file(s2, shard_path(index, 2), metadata={"format": "pt"})
    refused(diloco, index, "key_mismatch", "does not list", "extra.weight")

    # total_size off by one
    index = fresh("total")
    rewrite_index(index, lambda j: j["metadata"].__setitem__("total_size", j["metadata"]["total_size"] + 1))
    refused(diloco, index, "metadata_invalid", "total_size")

    # metadata disagreeing with the path
    index = fresh("path")
    rewrite_index(index, lambda j: j["metadata"].__setitem__("local_step", "6"))
    refused(diloco, index, "path_mismatch", "local_step 6")
    index = fresh("node")
    refused(diloco, index, "path_mismatch", "node_id", path="nodes/w2/delta_5.safetensors.index.json")

    # a shard carrying its own metadata that disagrees with the index
    index = fresh("shardmeta")
    s3 = stt.load_file(shard_path(index, 3))
    stt.save_file(s3, shard_path(index, 3), metadata={"format": "pt", "node_id": "w9"})
    refused(diloco, index, "metadata_invalid", f"delta_5-00003-of-{nshards(index):05d}.safetensors", "w9")
    # ... while agreeing metadata in a shard is fine
    index = fresh("shardmeta_ok")
    stt.save_file(stt.load_file(shard_path(index, 3)), shard_path(index, 3), metadata={"format": "pt", **META})
    diloco("verify", index, "--path", "nodes/w1/delta_5.safetensors.index.json", check=0)

    # a shard name with a directory, another base, or a path outside
    for bad in ("../delta_5-00001-of-00003.safetensors", "sub/delta_5-00001-of-00003.safetensors",
                "delta_6-00001-of-00003.safetensors", "delta_5-1-of-3.safetensors", "/etc/passwd"):
        index = fresh("name" + str(abs(hash(bad))))
        rewrite_index(index, lambda j: j["weight_map"].__setitem__(next(iter(j["weight_map"])), bad))
        refused(diloco, index, "invalid_path", "not a shard")

    # a duplicate key in the index (json.loads would let the last one win)
    index = fresh("dup")
    text = index.read_text()
    first = next(iter(json.loads(text)["weight_map"]))
    last = sorted(set(json.loads(text)["weight_map"].values()))[-1]
    index.write_text(text.replace('"weight_map": {', '"weight_map": {\n    "%s": "%s",' % (first, last), 1))
    refused(diloco, index, "duplicate_key")

    # not an index at all, or one without total_size
    index = fresh("junk")
    index.write_text("[1, 2, 3]")
    refused(diloco, index, "invalid_header_deserialization")
    index = fresh("nototal")
    rewrite_index(index, lambda j: j["metadata"].pop("total_size"))
    refused(diloco, index, "invalid_header_deserialization", "total_size")

    # a non-finite value in one shard
    index = fresh("nan")
    s2 = stt.load_file(shard_path(index, 2))
    k = next(iter(s2))
    s2[k] = s2[k].clone()
    s2[k].view(-1)[3] = float("nan")
    stt.save_file(s2, shard_path(index, 2), metadata={"format": "pt"})
    refused(diloco, index, "non_finite", k)


def test_delta_and_average_over_sets_are_bit_identical(tmp_path, diloco):
    base_sd, cur_sd = model_state(0), model_state(1)
    # the same two models as single files and as sets
    stt.save_file(base_sd, tmp_path / "base.safetensors")
    stt.save_file(cur_sd, tmp_path / "cur.safetensors")
    for name, sd in (("base", base_sd), ("cur", cur_sd)):
        d = tmp_path / f"{name}_set"
        d.mkdir()
        hfh.save_torch_state_dict(sd, d, filename_pattern="model{suffix}.safetensors", max_shard_size=SHARD)
    args = ["--node-id", "w1", "--base-step", "3", "--local-step", "5"]
    single = tmp_path / "single" / "delta_5.safetensors"
    single.parent.mkdir()
    diloco("delta", "--baseline", tmp_path / "base.safetensors", "--current", tmp_path / "cur.safetensors",
           *args, "-o", single, check=0)
    from_sets = tmp_path / "from_sets" / "delta_5.safetensors"
    from_sets.parent.mkdir()
    diloco("delta", "--baseline", tmp_path / "base_set/model.safetensors.index.json",
           "--current", tmp_path / "cur_set/model.safetensors.index.json", *args, "-o", from_sets, check=0)
    assert from_sets.read_bytes() == single.read_bytes()

    # sharded output: the same tensors' bytes as the single file, and byte-identical to
    # save_torch_state_dict for the same state dict in the same order (the baseline's file order: name order)
    sharded = tmp_path / "sharded" / "nodes" / "w1" / "delta_5.safetensors"
    sharded.parent.mkdir(parents=True)
    diloco("delta", "--baseline", tmp_path / "base.safetensors", "--current", tmp_path / "cur.safetensors",
           *args, "--shard-size", str(SHARD), "-o", sharded, check=0)
    index = sharded.parent / "delta_5.safetensors.index.json"
    assert index.exists() and not sharded.exists()
    oracle = {k: base_sd[k].float() - cur_sd[k].float() for k in sorted(base_sd) if base_sd[k].is_floating_point()}
    ref = tmp_path / "ref"
    ref.mkdir()
    hfh.save_torch_state_dict(oracle, ref, filename_pattern="delta_5{suffix}.safetensors", metadata=META,
                              max_shard_size=SHARD)
    ours = sorted(p.name for p in sharded.parent.iterdir())
    assert ours == sorted(p.name for p in ref.iterdir())
    for name in ours:
        assert (sharded.parent / name).read_bytes() == (ref / name).read_bytes(), name
    diloco("verify", index, "--path", "nodes/w1/delta_5.safetensors.index.json", check=0)

    # average: sets and files mixed give the single-file result bit for bit, sharded or not
    d2 = tmp_path / "d2.safetensors"
    stt.save_file(delta_dict(7), d2, metadata={**META, "node_id": "w2"})
    avg_files = tmp_path / "avg.safetensors"
    diloco("average", "-o", avg_files, single, d2, check=0)
    avg_mixed = tmp_path / "avg_mixed.safetensors"
    diloco("average", "-o", avg_mixed, index, d2, check=0)
    assert avg_mixed.read_bytes() == avg_files.read_bytes()
    avg_sharded = tmp_path / "avg_sharded" / "avg.safetensors"
    avg_sharded.parent.mkdir()
    diloco("average", "--shard-size", "40KB", "-o", avg_sharded, index, d2, check=0)
    want = stt.load_file(avg_files)
    got = {}
    for p in sorted(avg_sharded.parent.glob("avg-*.safetensors")):
        got.update(stt.load_file(p))
    assert set(got) == set(want)
    for k in want:
        assert torch.equal(got[k].view(torch.int32), want[k].view(torch.int32)), k

    # re-writing below the shard size replaces the set with the plain file (and removes the set)
    diloco("average", "-o", avg_sharded, index, d2, check=0)
    assert sorted(p.name for p in avg_sharded.parent.iterdir()) == ["avg.safetensors"]
    assert avg_sharded.read_bytes() == avg_files.read_bytes()


def test_a_set_written_by_diloco_loads_everywhere(tmp_path, diloco):
    """diloco's sharded output loads with huggingface_hub.load_torch_model and with plain safetensors
    (the snippet a worker that only knows safetensors would use)."""
    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Linear(64, 300, bias=False)
            self.layer0 = torch.nn.Linear(64, 64)
            self.layer1 = torch.nn.Linear(64, 64)
            self.head = torch.nn.Linear(64, 10, bias=False)

    src = Model()
    stt.save_file(src.state_dict(), tmp_path / "a.safetensors")
    zero = {k: torch.zeros_like(v) for k, v in src.state_dict().items()}
    stt.save_file(zero, tmp_path / "zero.safetensors")
    # a - 0 = a: the "delta" equals the model's weights, written as a sharded set
    out = tmp_path / "global" / "latest.safetensors"
    out.parent.mkdir()
    diloco("delta", "--baseline", tmp_path / "a.safetensors", "--current", tmp_path / "zero.safetensors",
           "--node-id", "w1", "--base-step", "0", "--local-step", "0", "--shard-size", "20000", "-o", out, check=0)
    assert (out.parent / "latest.safetensors.index.json").exists()

    m = Model()
    hfh.load_torch_model(m, out.parent, filename_pattern="latest{suffix}.safetensors", strict=True)
    for k, v in src.state_dict().items():
        assert torch.equal(m.state_dict()[k], v), k

    # plain safetensors: read the index, load each shard it names
    index = json.loads((out.parent / "latest.safetensors.index.json").read_text())
    state = {}
    for shard in sorted(set(index["weight_map"].values())):
        with safe_open(out.parent / shard, framework="pt") as f:
            for k in f.keys():
                state[k] = f.get_tensor(k)
    assert set(state) == set(index["weight_map"])
    m2 = Model()
    m2.load_state_dict(state)
    for k, v in src.state_dict().items():
        assert torch.equal(m2.state_dict()[k], v), k


class _Recorder(http.server.BaseHTTPRequestHandler):
    """A peer that takes PUTs and records them (path, body) in order, answering 201 as dilocod does."""
    puts = []

    def do_PUT(self):
        n = int(self.headers["Content-Length"])
        body = self.rfile.read(n)
        self.puts.append((self.path, body))
        out = json.dumps({"path": self.path, "bytes": n}).encode() + b"\n"
        self.send_response(201)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    def log_message(self, *a):
        pass


def serve(handler):
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv, f"http://127.0.0.1:{srv.server_address[1]}"


def test_push_of_a_sharded_delta_puts_shards_then_index(tmp_path, diloco):
    index = hf_delta(tmp_path, delta_dict())
    _Recorder.puts = []
    srv, url = serve(_Recorder)
    try:
        p = diloco("push", "--server", url, "--retries", "0", index, check=0)
    finally:
        srv.shutdown()
    paths = [p for p, _ in _Recorder.puts]
    n = nshards(index)
    assert paths == [f"/nodes/w1/delta_5-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)] + \
        ["/nodes/w1/delta_5.safetensors.index.json"]
    for path, body in _Recorder.puts:
        assert body == (index.parent / Path(path).name).read_bytes(), path
    assert p.stdout.count('"bytes"') == n + 1
    # a set saved under another base than delta_<local_step> would upload an index naming other files
    other = tmp_path / "other"
    other.mkdir()
    hfh.save_torch_state_dict(delta_dict(), other, filename_pattern="mydelta{suffix}.safetensors", metadata=META,
                              max_shard_size=SHARD)
    p = diloco("push", "--server", url, "--retries", "0", other / "mydelta.safetensors.index.json", check=1)
    assert "path_mismatch" in p.stderr and "delta_5{suffix}" in p.stderr


def test_pull_of_a_sharded_global_writes_the_same_layout(tmp_path, diloco):
    root = tmp_path / "srv"
    (root / "global").mkdir(parents=True)
    sd = model_state(0)
    hfh.save_torch_state_dict(sd, root / "global", filename_pattern="latest{suffix}.safetensors",
                              max_shard_size=SHARD)
    (root / "global" / "step_count.json").write_text(json.dumps(
        {"algorithm": "dumb_diloco", "model_file": "global/latest.safetensors.index.json", "optimizer": "nesterov",
         "outer_step": 4, "updated_at": "2026-01-01T00:00:00+00:00"}, indent=2))

    class Static(http.server.SimpleHTTPRequestHandler):
        def __init__(self, *a, **kw):
            super().__init__(*a, directory=str(root), **kw)

        def log_message(self, *a):
            pass

    srv, url = serve(Static)
    out = tmp_path / "worker"
    out.mkdir()
    (out / "latest.safetensors").write_bytes(b"an older single-file global")
    try:
        p = diloco("pull", "--server", url, "-o", out, "--retries", "0", check=0)
    finally:
        srv.shutdown()
    assert f"step 4 downloaded ({nshards(root / 'global' / 'latest.safetensors.index.json')} shards)" in p.stdout
    names = sorted(n for n in os.listdir(out) if not n.startswith("."))
    assert names == sorted(n for n in os.listdir(root / "global"))
    for n in names:
        assert (out / n).read_bytes() == (root / "global" / n).read_bytes(), n
    m = {}
    for n in names:
        if n.startswith("latest-"):
            m.update(stt.load_file(out / n))
    assert set(m) == set(sd) and all(torch.equal(m[k], sd[k]) for k in sd)
