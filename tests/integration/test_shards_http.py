"""Sharded deltas uploaded over HTTP (issue 14), with the real dilocod and its real peers:

- `diloco push` of a delta that huggingface_hub.save_torch_state_dict wrote as a set (a small
  max_shard_size) gives the same round, byte for byte, as the same delta pushed as one file, and both
  equal the torch oracle;
- curl PUTs of the parts in any order (the index first or last, a shard sent twice): every part but
  the one that completes the set is answered 202 with what the set has and still misses, the last one
  201 with the round's verdict;
- hostile sets are refused with a reason: a tensor in two shards, total_size wrong, a shard with NaN,
  more shards than the model has floating tensors, an index over the cap, shards of another count;
- a set that is never completed does not hold the round up (it closes by timeout without it), a newer
  local step replaces a node's staged set, and the staging is gone afterwards.
"""
import json
import os
import socket
import subprocess

import huggingface_hub as hfh
import numpy as np
import torch
from safetensors.torch import save_file

from conftest import run
from dilocod_proc import (Dilocod, Oracle, assert_state_close, assert_state_equal, delta_metadata, load_torch,
                          write_model)

SHARD = 10_000      # bytes: every 64x64 F32 tensor below gets a shard of its own (4 shards)


def torch_fuses():
    """torch's AVX2/AVX-512 kernels fuse SGD's multiply-adds as dilocod does (test_torch_exact.py)."""
    return any("CPU capability usage: AVX2" in line or "CPU capability usage: AVX512" in line
               for line in torch.__config__.show().splitlines())


def model():
    g = torch.Generator().manual_seed(11)
    return {"layer0.weight": torch.randn(64, 64, generator=g), "layer0.bias": torch.randn(64, generator=g),
            "layer1.weight": torch.randn(64, 64, generator=g), "layer1.bias": torch.randn(64, generator=g),
            "embed": torch.randn(80, 64, generator=g).to(torch.float16),
            "head": torch.randn(10, 64, generator=g).to(torch.bfloat16),
            "steps": torch.tensor([4, 2], dtype=torch.int64)}


def delta_of(seed, m):
    g = torch.Generator().manual_seed(seed)
    return {k: 0.01 * torch.randn(v.shape, generator=g) for k, v in m.items() if v.is_floating_point()}


def save_set(d, node, base, local, tensors, max_shard=SHARD):
    """The set as huggingface_hub writes it; returns the index's path."""
    d.mkdir(parents=True, exist_ok=True)
    hfh.save_torch_state_dict(tensors, d, filename_pattern=f"delta_{local}{{suffix}}.safetensors",
                              metadata=delta_metadata(node, base, local), max_shard_size=max_shard)
    return d / f"delta_{local}.safetensors.index.json"


def save_single(d, node, base, local, tensors):
    d.mkdir(parents=True, exist_ok=True)
    path = d / f"delta_{local}.safetensors"
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path), metadata=delta_metadata(node, base, local))
    return path


def parts(index):
    """The set's files: its shards (in shard order) and its index."""
    names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    return [index.parent / n for n in names], index


def put(url, node, path, name=None):
    """curl -T: (status, parsed JSON answer)."""
    p = subprocess.run(["curl", "-sS", "-o", "-", "-w", "\n%{http_code}", "-T", str(path),
                        f"{url}/nodes/{node}/{name or path.name}"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    body, _, code = p.stdout.rpartition("\n")
    return int(code), json.loads(body) if body.strip() else None


def staged(d):
    return sorted(p.name for p in (d.state_dir / "cache" / "incoming").glob("set-*"))


def wait_unstaged(d):
    """The staging of a discarded set is removed on the thread pool: wait for it."""
    d.wait_log("sharded upload discarded")
    for _ in range(3000):
        if not staged(d):
            return
        subprocess.run(["sleep", "0.01"])
    raise AssertionError(f"staging left behind: {staged(d)}")


def check_oracle(got, want):
    (assert_state_equal if torch_fuses() else assert_state_close)(got, want)


def test_push_of_hf_set_equals_single_file_and_torch(tmp_path, diloco_bin):
    m = model()
    write_model(tmp_path / "init.safetensors", m)
    d0, d1 = delta_of(1, m), delta_of(2, m)
    index = save_set(tmp_path / "w0set", "w0", 0, 7, d0)
    shards, _ = parts(index)
    assert len(shards) >= 4
    single0 = save_single(tmp_path / "w0single", "w0", 0, 7, d0)
    single1 = save_single(tmp_path / "w1", "w1", 0, 3, d1)

    globals_ = {}
    for layout, first in (("sharded", index), ("single", single0)):
        hub = tmp_path / f"hub-{layout}"
        d = Dilocod(tmp_path / layout, hub, "--init-model", tmp_path / "init.safetensors", "--expected-nodes", "2")
        (tmp_path / layout).mkdir()
        d.start()
        try:
            d.wait_step(0)
            p = run([diloco_bin, "push", "--server", d.url, first], check=0)
            answers = [json.loads(line) for line in p.stdout.splitlines() if line.strip()]
            last = answers[-1]
            assert last["result"] == "accepted" and last["node_id"] == "w0" and last["local_step"] == 7, last
            if layout == "sharded":
                # one answer per shard (202, what the set still misses), the index's last (201)
                assert len(answers) == len(shards) + 1
                assert [a["result"] for a in answers[:-1]] == ["incomplete"] * len(shards)
                assert answers[0]["set"]["missing"][-1] == index.name
                assert answers[-2]["set"]["missing"] == [index.name]
                assert last["path"] == f"nodes/w0/{index.name}"
                assert last["bytes"] == sum(s.stat().st_size for s in shards) + index.stat().st_size
            run([diloco_bin, "push", "--server", d.url, single1], check=0)
            d.wait_step(1)
            globals_[layout] = (hub / "global" / "latest.safetensors").read_bytes()
            assert staged(d) == []
        finally:
            assert d.stop() == 0
    assert globals_["sharded"] == globals_["single"]
    want = Oracle(m).step({"w0": d0, "w1": d1})
    check_oracle(load_torch(tmp_path / "hub-sharded" / "global" / "latest.safetensors"), want)


def test_curl_parts_in_any_order(tmp_path):
    m = model()
    write_model(tmp_path / "init.safetensors", m)
    da, db = delta_of(3, m), delta_of(4, m)
    ia = save_set(tmp_path / "a", "a", 0, 5, da)
    ib = save_set(tmp_path / "b", "b", 0, 9, db)
    sa, _ = parts(ia)
    sb, _ = parts(ib)
    hub = tmp_path / "hub"
    d = Dilocod(tmp_path, hub, "--init-model", tmp_path / "init.safetensors", "--expected-nodes", "2").start()
    try:
        d.wait_step(0)
        # a: the index first, then the shards from last to first
        code, ans = put(d.url, "a", ia)
        assert code == 202, ans
        assert ans["set"]["received"] == 1 and ans["set"]["index"] is True
        assert ans["set"]["missing"] == [s.name for s in sa] and ans["set"]["missing_count"] == len(sa)
        for k, s in enumerate(reversed(sa)):
            code, ans = put(d.url, "a", s)
            if k < len(sa) - 1:
                assert code == 202 and ans["result"] == "incomplete", ans
                assert s.name not in ans["set"]["missing"] and ans["set"]["received"] == k + 2
        assert code == 201 and ans["result"] == "accepted", ans
        assert ans["base_outer_step"] == 0 and ans["round"]["received"] == 1
        # b: the shards shuffled, one of them sent twice (the second copy replaces the first), the index last
        order = [sb[2], sb[0], sb[2], *sb[3:], sb[1]]
        for s in order:
            code, ans = put(d.url, "b", s)
            assert code == 202, ans
        assert ans["set"]["missing"] == [ib.name] and ans["set"]["shards"] == len(sb)
        assert ans["set"]["bytes"] == sum(s.stat().st_size for s in sb)
        code, ans = put(d.url, "b", ib)
        assert code == 201 and ans["result"] == "accepted", ans
        d.wait_step(1)
        assert staged(d) == []
        check_oracle(load_torch(hub / "global" / "latest.safetensors"), Oracle(m).step({"a": da, "b": db}))
        # a set for the round that is over: refused once its index says so, and its staging goes
        code, ans = put(d.url, "a", ia)
        assert code == 409 and ans["error"]["code"] == "stale", ans
        wait_unstaged_but(d, set())
        # logged once per part taken (b's shard sent twice counts twice)
        assert d.log_text().count("sharded upload part received") == (len(sa) + 1) + (len(order) + 1)
    finally:
        assert d.stop() == 0


def hostile_shards(tmp, node, local, tensors, split, index_extra=0):
    """A set written by hand: split lists each shard's tensor names (a name may be in two shards);
    the index lists each tensor once (its first shard); total_size is off by index_extra."""
    tmp.mkdir(parents=True, exist_ok=True)
    n = len(split)
    names, weight_map, total = [], {}, 0
    for i, keys in enumerate(split):
        name = f"delta_{local}-{i + 1:05d}-of-{n:05d}.safetensors"
        save_file({k: tensors[k].contiguous() for k in keys}, str(tmp / name), metadata={"format": "pt"})
        names.append(tmp / name)
        for k in keys:
            if k not in weight_map:
                weight_map[k] = name
                total += tensors[k].numel() * 4
    index = tmp / f"delta_{local}.safetensors.index.json"
    meta = {"total_size": total + index_extra, **delta_metadata(node, 0, local)}
    index.write_text(json.dumps({"metadata": meta, "weight_map": weight_map}, indent=2))
    return names, index


def test_hostile_sets_are_refused_with_a_reason(tmp_path):
    m = model()
    write_model(tmp_path / "init.safetensors", m)
    dt = delta_of(5, m)
    keys = sorted(dt)
    hub = tmp_path / "hub"
    # nobody completes the round: every refusal below leaves it open
    d = Dilocod(tmp_path, hub, "--init-model", tmp_path / "init.safetensors", "--expected-nodes", "4").start()
    try:
        d.wait_step(0)

        # a tensor in two shards: the shards in hold more tensor data than the index's total_size (the
        # index is reconciled with them as it comes in, issue 21)
        shards, index = hostile_shards(tmp_path / "two", "two", 1, dt, [keys[:3], keys[2:]])
        for s in shards:
            assert put(d.url, "two", s)[0] == 202
        code, ans = put(d.url, "two", index)
        assert code == 422 and ans["error"]["code"] == "metadata_invalid", ans
        assert "total_size" in ans["error"]["message"] and "already in hold" in ans["error"]["message"], ans

        # total_size wrong
        shards, index = hostile_shards(tmp_path / "total", "total", 1, dt, [keys[:3], keys[3:]], index_extra=4)
        assert put(d.url, "total", index)[0] == 202
        assert put(d.url, "total", shards[0])[0] == 202
        code, ans = put(d.url, "total", shards[1])
        assert code == 422 and "total_size" in ans["error"]["message"], ans

        # a shard with a NaN: refused while it streams, the tensor and the element named
        bad = dict(dt)
        bad[keys[4]] = bad[keys[4]].clone()
        bad[keys[4]].view(-1)[17] = float("nan")
        shards, index = hostile_shards(tmp_path / "nan", "nan", 1, bad, [keys[:3], keys[3:]])
        assert put(d.url, "nan", index)[0] == 202
        code, ans = put(d.url, "nan", shards[1])
        assert code == 422 and ans["error"]["code"] == "non_finite" and ans["error"]["tensor"] == keys[4], ans
        assert "element 17" in ans["error"]["message"], ans

        # more shards than the model has floating tensors: refused from the path
        code, ans = put(d.url, "many", shards[0], name="delta_1-00001-of-00007.safetensors")
        assert code == 422 and ans["error"]["code"] == "invalid_path" and "6 floating tensors" in \
            ans["error"]["message"], ans
        # shards of another count than the set being uploaded
        code, ans = put(d.url, "nan", shards[0], name="delta_1-00001-of-00003.safetensors")
        assert code == 422 and "has 2 shards" in ans["error"]["message"], ans
        # an index over the cap (10 MiB), refused before its body
        big = tmp_path / "big.json"
        big.write_bytes(b" " * (10 * 1024 * 1024 + 1))
        code, ans = put(d.url, "big", big, name="delta_1.safetensors.index.json")
        assert code == 413 and ans["error"]["code"] == "too_large", ans
        # an index that does not fit the model
        wrong = tmp_path / "wrong" / "delta_1.safetensors.index.json"
        wrong.parent.mkdir()
        ix = json.loads(index.read_text())
        ix["weight_map"]["nonexistent"] = ix["weight_map"][keys[0]]
        ix["metadata"]["node_id"] = "wrong"
        wrong.write_text(json.dumps(ix))
        code, ans = put(d.url, "wrong", wrong)
        assert code == 422 and ans["error"]["code"] == "key_mismatch" and ans["error"]["tensor"] == "nonexistent", ans
        # metadata that disagrees with the path
        code, ans = put(d.url, "other", index)
        assert code == 422 and ans["error"]["code"] == "path_mismatch", ans

        # the refused sets' staging is gone; the NaN set (its index in) waits for a good shard
        wait_unstaged_but(d, {"nan"})
        assert d.alive()
    finally:
        assert d.stop() == 0


def quiet_fds(d):
    """The fewest descriptors over 0.4 s: a baseline without the transient ones."""
    samples = []
    for _ in range(20):
        samples.append(open_fds(d))
        subprocess.run(["sleep", "0.02"])
    return min(samples, key=len)


def open_fds(d):
    """The daemon's open descriptors, by what they point at."""
    fd_dir = f"/proc/{d.proc.pid}/fd"
    out = []
    for fd in os.listdir(fd_dir):
        try:
            out.append(os.readlink(f"{fd_dir}/{fd}"))
        except OSError:
            pass        # the descriptor of the listing itself, gone by now
    return sorted(out)


def wait_unstaged_but(d, nodes):
    for _ in range(3000):
        left = {name.split("-")[1] for name in staged(d)}
        if left == nodes:
            return
        subprocess.run(["sleep", "0.01"])
    raise AssertionError(f"staging: {staged(d)}")


def test_a_set_never_completed_does_not_block_the_round(tmp_path):
    m = model()
    write_model(tmp_path / "init.safetensors", m)
    da, db = delta_of(6, m), delta_of(7, m)
    ia5 = save_set(tmp_path / "a5", "a", 0, 5, da)
    ia6 = save_set(tmp_path / "a6", "a", 0, 6, da)
    single_b = save_single(tmp_path / "b", "b", 0, 2, db)
    hub = tmp_path / "hub"
    d = Dilocod(tmp_path, hub, "--init-model", tmp_path / "init.safetensors", "--expected-nodes", "2",
                "--min-nodes", "1", "--round-timeout", "1").start()
    try:
        d.wait_step(0)
        # the baseline once step 0's end is over (the thread warming step 1's outputs holds two files, a
        # scan of the tree its directories): the fewest descriptors over a moment
        d.wait_log("outputs warmed step=1 ")
        fds = quiet_fds(d)
        # a starts local step 5, then 6: the newer one replaces the staged set
        assert put(d.url, "a", parts(ia5)[0][0])[0] == 202
        first = staged(d)
        assert len(first) == 1
        assert put(d.url, "a", parts(ia6)[0][1])[0] == 202
        code, ans = put(d.url, "a", parts(ia5)[0][1])
        assert code == 409 and ans["error"]["code"] == "not_newer", ans
        d.wait_log("sharded upload discarded")
        for _ in range(3000):
            if first[0] not in staged(d):
                break
            subprocess.run(["sleep", "0.01"])
        assert len(staged(d)) == 1 and staged(d) != first
        # a shard cut off in the middle (the client goes away): its temporary file goes, the set stays
        shard = parts(ia6)[0][2]
        body = shard.read_bytes()
        with socket.create_connection(("127.0.0.1", d.port)) as s:
            s.sendall(f"PUT /nodes/a/{shard.name} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n\r\n"
                      .encode() + body[:len(body) // 2])
        d.wait_log("upload aborted")
        set_dir = d.state_dir / "cache" / "incoming" / staged(d)[0]
        for _ in range(3000):
            if sorted(p.name for p in set_dir.iterdir()) == [parts(ia6)[0][1].name]:
                break
            subprocess.run(["sleep", "0.01"])
        assert sorted(p.name for p in set_dir.iterdir()) == [parts(ia6)[0][1].name]
        # b delivers; a never finishes: the round closes by timeout with b alone
        assert put(d.url, "b", single_b)[0] == 201
        d.wait_step(1)
        check_oracle(load_torch(hub / "global" / "latest.safetensors"), Oracle(m).step({"b": db}))
        d.wait_log("ended before the set was complete")
        wait_unstaged(d)
        # the rest of a's set, late: refused, nothing staged
        code, ans = put(d.url, "a", ia6)
        assert code == 409 and ans["error"]["code"] == "stale", ans
        wait_unstaged_but(d, set())
        # every descriptor the uploads opened is closed again (the served global is the new step's).  The
        # step's end holds some for a moment (the thread warming step 2's outputs two; a clean-clone run
        # once found step 0's global still open just after step 1 was durable): a leak is one that stays
        d.wait_log("outputs warmed step=2 ")
        for _ in range(500):
            now = open_fds(d)
            if len(now) <= len(fds):
                break
            subprocess.run(["sleep", "0.02"])
        assert len(now) <= len(fds), (now, fds)
        assert not [f for f in now if "/cache/" in f], now
        assert d.alive()
    finally:
        assert d.stop() == 0
