"""A cluster takes a worker's sharded delta set (README, "Scaling out"; server/README.md, "Cluster mode: a
node's sharded delta set"): nodes/<id>/delta_<n>.safetensors.index.json and the shards it names, written by
the real tools (huggingface_hub.save_torch_state_dict, `diloco delta --shard-size`), is one delta of its
node, taken once the index and every shard are listed, checked as the single aggregator checks one; the
manifest names each part's key and ETag, and each shard's slice reads every tensor from the part that holds
it.  A round mixing sets and single files is torch's step bit for bit, with K=2 as with K=1 over the same
deltas as single files (the same published bytes); a set missing a shard waits and is taken once it lands;
hostile sets (an index naming another node's shard, an index over the cap, a shard with a tensor of the
wrong shape) are refused and the round goes on; a part rewritten after the manifest drops its node as a
rewritten single delta does.  Harness: tests/integration/test_cluster.py (SeaweedFS, boto3, torch's SGD)."""
import json
import subprocess
from pathlib import Path

import numpy as np
import torch
from huggingface_hub import save_torch_state_dict
from safetensors.torch import load_file
from safetensors.torch import save_file as st_torch_save_file

from conftest import BUILD
from dilocod_proc import Oracle, assert_state_equal, delta_metadata
from test_cluster import (NODES, Cluster, Plan, StepWatcher, check_exact, cluster_model, local_step, oracle_for,
                          publish_step0, random_deltas, tensors_of, upload_round)
from test_cluster_refusal import read_generation
from test_s3 import put_delta, s3  # noqa: F401 (the module's SeaweedFS fixture)

S = 4
SET_SHARD = 150_000     # the deltas (~600 KB of F32) split into 4-5 shards


def hf_set(directory: Path, node, base, local, tensors, max_shard=SET_SHARD):
    """A worker's delta set as huggingface_hub writes it -> [(file name, path)], the shards first, the index
    last (a careful uploader's order)."""
    directory.mkdir(parents=True, exist_ok=True)
    save_torch_state_dict({k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in tensors.items()}, str(directory),
                          filename_pattern=f"delta_{local}{{suffix}}.safetensors", max_shard_size=max_shard,
                          metadata=delta_metadata(node, base, local))
    return set_files(directory, local)


def set_files(directory: Path, local):
    index = directory / f"delta_{local}.safetensors.index.json"
    shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    assert len(shards) >= 2, shards
    return [(s, directory / s) for s in shards] + [(index.name, index)]


def cli_set(directory: Path, node, base, local, tensors, shard_size=SET_SHARD):
    """The same with `diloco delta --shard-size`: baseline A and current A - d -> (files, the delta's values as
    written, which the oracle takes)."""
    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(local)
    a = {k: rng.standard_normal(v.shape).astype(np.float32) for k, v in tensors.items()}
    b = {k: a[k] - v for k, v in tensors.items()}
    st_torch_save_file({k: torch.from_numpy(v) for k, v in a.items()}, str(directory / "a.safetensors"))
    st_torch_save_file({k: torch.from_numpy(v) for k, v in b.items()}, str(directory / "b.safetensors"))
    out = directory / f"delta_{local}.safetensors"
    subprocess.run([str(BUILD / "diloco"), "delta", "--baseline", str(directory / "a.safetensors"), "--current",
                    str(directory / "b.safetensors"), "--node-id", node, "--base-step", str(base), "--local-step",
                    str(local), "-o", str(out), "--shard-size", str(shard_size)], check=True, capture_output=True,
                   timeout=60)
    files = set_files(directory, local)
    values = {}
    for name, path in files[:-1]:
        values.update({k: v.numpy() for k, v in load_file(str(path)).items()})
    return files, values


def put_set(bucket, node, files, skip=()):
    for name, path in files:
        if name not in skip:
            bucket.put(f"nodes/{node}/{name}", path.read_bytes())


def log_of(cl):
    return "".join(d.log_text() for d in cl.procs.values())


def test_mixed_round_k2_equals_single_files_k1_and_torch(tmp_path, s3):
    """Rounds whose w1 (huggingface_hub) and w2 (`diloco delta`) push sets, w3 and w4 single files: K=2 is
    torch's step bit for bit, the manifest names the sets' parts and keeps single entries as they were, and
    K=1 over the same values as single files publishes the same bytes."""
    rounds = 2
    init = cluster_model(11)
    rng = np.random.default_rng(3411)
    all_deltas = [{n: random_deltas(rng, init) for n in NODES} for _ in range(rounds)]
    sets = {}
    for r in range(rounds):
        step = r + 1
        sets[(step, "w1")] = hf_set(tmp_path / f"w1-{step}", "w1", step - 1, local_step(step), all_deltas[r]["w1"])
        files, values = cli_set(tmp_path / f"w2-{step}", "w2", step - 1, local_step(step), all_deltas[r]["w2"])
        sets[(step, "w2")] = files
        all_deltas[r]["w2"] = values

    published = {}
    for prefix, ids, as_sets in (("sets/k2", ["agg-a", "agg-b"], True), ("sets/k1-files", ["agg-a"], False)):
        cl = Cluster(tmp_path / prefix.replace("/", "-"), s3, prefix, S, 10)
        plan = Plan(publish_step0(cl.bucket, init), S)
        watcher = StepWatcher(s3, prefix)
        oracle = oracle_for(init)
        try:
            for i in ids:
                cl.add(i)
            cl.wait_ready()
            for r in range(rounds):
                step = r + 1
                if as_sets:
                    for node in ("w1", "w2"):
                        put_set(cl.bucket, node, sets[(step, node)])
                    upload_round(cl.bucket, all_deltas[r], step, nodes=["w3", "w4"])
                else:
                    upload_round(cl.bucket, all_deltas[r], step)
                cl.wait_published(step, 60)
                oracle.step(tensors_of(all_deltas[r]))
                raw = check_exact(cl, plan, step, oracle.state)
                published.setdefault(step, []).append(raw)
                m = json.loads(cl.bucket.get(f"global/steps/{step}/manifest.json"))
                entries = {e["node"]: e for e in m["nodes"]}
                assert sorted(entries) == NODES, m
                for node, e in entries.items():
                    if as_sets and node in ("w1", "w2"):
                        names = [n for n, _ in sets[(step, node)][:-1]]
                        assert e["key"] == f"nodes/{node}/delta_{local_step(step)}.safetensors.index.json", e
                        assert [p["key"] for p in e["parts"]] == [f"nodes/{node}/{n}" for n in names], e
                        assert all(len(p["etag"]) >= 32 and len(p["header_sha256"]) == 64 for p in e["parts"]), e
                    else:
                        # a single file's entry keeps its fields and their order (mixed clusters, old manifests)
                        assert list(e) == ["node", "key", "etag", "size", "local_step", "header_sha256"], e
                cl.wait_publishes(step)
            watcher.stop()
            watcher.check(range(rounds + 1))
            assert "a cluster takes single-file deltas" not in log_of(cl), cl.logs()
            # /rounds counts a set's bytes as its shards' together (not its index's)
            for d in cl.procs.values():
                recs = cl.wait(lambda: (lambda r: r if len(r) == rounds else None)(d.rounds()),
                               f"{d.agg_id}'s /rounds holding {rounds} steps", 20)
                for rec in recs:
                    step = rec["step"] + 1
                    nodes = {n["node_id"]: n for n in rec["nodes"]}
                    assert sorted(nodes) == NODES, rec
                    for node in ("w1", "w2") if as_sets else ():
                        want = sum(p.stat().st_size for _, p in sets[(step, node)][:-1])
                        assert nodes[node]["bytes"] == want, (node, nodes[node], want)
            sts = cl.statuses()
            assert all(c["refusals"] == 0 for c in sts.values()), sts
        finally:
            watcher.stop()
            cl.stop()
    for step, (k2, k1) in published.items():
        assert k2 == k1, f"step {step}: the sets' round published other bytes than the same deltas as single files"


def test_set_missing_a_shard_waits_then_is_taken(tmp_path, s3):
    """A set whose last shard is not uploaded yet is not taken (the round of 4 expected nodes stays open);
    once the shard lands the set is taken and the step is torch's."""
    init = cluster_model(12)
    cl = Cluster(tmp_path, s3, "sets-missing", S, 10)
    plan = Plan(publish_step0(cl.bucket, init), S)
    rng = np.random.default_rng(3412)
    try:
        a = cl.add("agg-a")
        cl.wait_ready()
        deltas = {n: random_deltas(rng, init) for n in NODES}
        files = hf_set(tmp_path / "w4", "w4", 0, local_step(1), deltas["w4"])
        last = files[-2][0]
        put_set(cl.bucket, "w4", files, skip=(last,))
        upload_round(cl.bucket, deltas, 1, nodes=["w1", "w2", "w3"])
        cl.wait(lambda: a.log_text().count("delta taken") >= 3, "the three single deltas taken", 20)
        cl.wait(lambda: "a set waits for its shards" in a.log_text(), "the incomplete set noticed", 20)
        # several polls later it still waits: not taken, not refused, nothing published
        polls = a.log_text().count("a set waits for its shards")
        cl.wait(lambda: a.log_text().count("a set waits for its shards") >= polls + 5, "more polls", 20)
        assert "node=w4" not in "".join(l for l in a.log_text().splitlines() if "delta taken" in l), a.tail()
        assert "delta refused" not in a.log_text(), a.tail()
        assert cl.bucket.published_step() == 0 and not cl.bucket.exists("global/steps/1/manifest.json")
        cl.bucket.put(f"nodes/w4/{last}", files[-2][1].read_bytes())
        cl.wait_published(1, 60)
        oracle = oracle_for(init)
        oracle.step(tensors_of(deltas))
        check_exact(cl, plan, 1, oracle.state)
        m = json.loads(cl.bucket.get("global/steps/1/manifest.json"))
        assert [e["node"] for e in m["nodes"]] == NODES and len(m["nodes"][3]["parts"]) == len(files) - 1, m
    finally:
        cl.stop()


def test_hostile_sets_are_refused_and_the_round_goes_on(tmp_path, s3):
    """Three nodes push sets an attacker shaped: h1's index names w1's shard (another node's directory), h2's
    index is over the cap a delta index of this model can need, h3's shard holds a tensor of the wrong shape.
    Each is refused once (remembered: not read again), and the round of the four workers is torch's."""
    init = cluster_model(13)
    cl = Cluster(tmp_path, s3, "sets-hostile", S, 10)
    plan = Plan(publish_step0(cl.bucket, init), S)
    rng = np.random.default_rng(3413)
    local = local_step(1)
    try:
        a = cl.add("agg-a")
        cl.wait_ready()
        deltas = {n: random_deltas(rng, init) for n in NODES}
        # h1: a valid set, its index rewritten to read w1's first shard instead of its own
        files = hf_set(tmp_path / "h1", "h1", 0, local, random_deltas(rng, init))
        index = json.loads(files[-1][1].read_text())
        first = files[0][0]
        index["weight_map"] = {k: (f"../w1/{v}" if v == first else v) for k, v in index["weight_map"].items()}
        files[-1][1].write_text(json.dumps(index, indent=2))
        put_set(cl.bucket, "h1", files)
        # h2: a valid set whose index carries 2 MB of metadata
        files = hf_set(tmp_path / "h2", "h2", 0, local, random_deltas(rng, init))
        index = json.loads(files[-1][1].read_text())
        index["metadata"]["padding"] = "x" * (2 << 20)
        files[-1][1].write_text(json.dumps(index, indent=2))
        put_set(cl.bucket, "h2", files)
        # h3: a set whose tensor blocks.0.attn.bias is [256], not [512]
        bad = random_deltas(rng, init)
        bad["blocks.0.attn.bias"] = bad["blocks.0.attn.bias"][:256].copy()
        put_set(cl.bucket, "h3", hf_set(tmp_path / "h3", "h3", 0, local, bad))
        for node, why in (("h1", "its index"), ("h2", "over the"), ("h3", "shape")):
            key = f"nodes/{node}/delta_{local}.safetensors.index.json"
            cl.wait(lambda: any("delta refused" in line and f"key={key}" in line and why in line
                                for line in a.log_text().splitlines()), f"{node}'s set refused ({why})", 20)
        upload_round(cl.bucket, deltas, 1)
        cl.wait_published(1, 60)
        oracle = oracle_for(init)
        oracle.step(tensors_of(deltas))
        check_exact(cl, plan, 1, oracle.state)
        m = json.loads(cl.bucket.get("global/steps/1/manifest.json"))
        assert [e["node"] for e in m["nodes"]] == NODES, m
        # refused once each, across the polls that list them again
        refused = [line for line in a.log_text().splitlines() if "delta refused" in line]
        assert len(refused) == 3, refused
        assert cl.statuses()["agg-a"]["refused_remembered"] >= 3
    finally:
        cl.stop()


def test_set_part_rewritten_after_the_manifest_is_dropped(tmp_path, s3):
    """A worker that rewrites one shard of its set once the manifest names it: the ranged reads of that part
    answer 412 (If-Match on the manifest's part ETag), and the round goes on without that node, as with a
    rewritten single delta."""
    init = cluster_model(14)
    cl = Cluster(tmp_path, s3, "sets-rewritten", S, 5)
    plan = Plan(publish_step0(cl.bucket, init), S)
    rng = np.random.default_rng(3414)
    try:
        a = cl.add("agg-a", env={"DILOCOD_TEST_CLUSTER_STALL_AFTER_PASS": "0"})
        cl.wait_ready()
        deltas = {n: random_deltas(rng, init) for n in NODES}
        files = hf_set(tmp_path / "w2", "w2", 0, local_step(1), deltas["w2"])
        put_set(cl.bucket, "w2", files)
        upload_round(cl.bucket, deltas, 1, nodes=["w1", "w3", "w4"])
        cl.wait(lambda: "test hook: pausing after the pass shard=0" in a.log_text(), "agg-a to compute shard 0", 30,
                interval=0.01)
        assert cl.bucket.exists("global/steps/1/manifest.json")
        # the set's last shard again, other bytes (the same tensors, other values)
        name, path = files[-2]
        part = load_file(str(path))
        st_torch_save_file({k: v + 1 for k, v in part.items()}, str(path), metadata={"format": "pt"})
        cl.bucket.put(f"nodes/w2/{name}", path.read_bytes())
        cl.wait_published(1, 60)
        oracle = Oracle(init, lr=0.7, momentum=0.9)
        oracle.step(tensors_of({n: d for n, d in deltas.items() if n != "w2"}))
        assert_state_equal(read_generation(cl, plan, 1, 1), oracle.state)
        assert "it changed since the manifest listed it" in a.log_text(), cl.logs()
        m1 = json.loads(cl.bucket.get("global/steps/1/manifest.g1.json"))
        assert [e["node"] for e in m1["nodes"]] == ["w1", "w3", "w4"], m1
    finally:
        cl.stop()


def test_worker_pushes_a_sharded_delta_to_a_cluster(tmp_path, s3, monkeypatch):
    """diloco.Worker("s3://...", "w1", shard_size=N) pushes each delta past N bytes as a set (its shards, then
    its index) to a two-aggregator cluster's bucket, beside w2's single files: every step is torch's outer
    step on what the two sent, and the manifest names w1's parts."""
    import diloco
    from dilocod_proc import module_for
    from test_cluster import ClusterDilocod
    for k, v in s3.env().items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3.endpoint)
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    rounds = 2
    init = cluster_model(15)
    prefix = "sets-worker"
    cl = Cluster(tmp_path, s3, prefix, S, 10)
    plan = Plan(publish_step0(cl.bucket, init), S)
    try:
        for i in ("agg-a", "agg-b"):
            d = ClusterDilocod(cl.tmp, cl.s3, cl.prefix, i, cl.shards, cl.lease, nodes=2)
            cl.procs[i] = d
            d.start()
        cl.wait_ready()
        url = f"s3://{s3.bucket}/{prefix}"
        workers = {"w1": diloco.Worker(url, "w1", shard_size=100_000), "w2": diloco.Worker(url, "w2")}
        models = {n: module_for(init) for n in workers}
        oracle = oracle_for(init)
        g = torch.Generator().manual_seed(15)
        for r in range(rounds):
            step, local = r + 1, 10 * (r + 1)
            sent = {}
            for n, w in workers.items():
                assert w.pull(models[n]) == r
                base = {k: v.clone() for k, v in models[n].state_dict().items()}
                with torch.no_grad():
                    for v in models[n].state_dict().values():
                        if v.is_floating_point():
                            v.add_(0.01 * torch.randn(v.shape, generator=g))
                cur = models[n].state_dict()
                sent[n] = {k: base[k].float() - cur[k].float() for k in base if base[k].is_floating_point()}
                assert w.push(models[n], local_step=local, loss=0.5, tokens=64).status == "written"
            cl.wait_published(step, 60)
            oracle.step(sent)
            check_exact(cl, plan, step, oracle.state)
            keys = {rel for rel in cl.bucket.listing(skip_nodes=False) if rel.startswith("nodes/")}
            shards = sorted(k for k in keys if k.startswith(f"nodes/w1/delta_{local}-"))
            assert len(shards) >= 2 and f"nodes/w1/delta_{local}.safetensors.index.json" in keys, sorted(keys)
            assert f"nodes/w1/delta_{local}.safetensors" not in keys and f"nodes/w2/delta_{local}.safetensors" in keys
            m = json.loads(cl.bucket.get(f"global/steps/{step}/manifest.json"))
            entries = {e["node"]: e for e in m["nodes"]}
            assert [p["key"] for p in entries["w1"]["parts"]] == shards and "parts" not in entries["w2"], m
            # the index holds the delta's metadata, the worker's metrics among it; each shard only "format"
            index = json.loads(cl.bucket.get(f"nodes/w1/delta_{local}.safetensors.index.json"))
            assert index["metadata"]["node_id"] == "w1" and index["metadata"]["local_step"] == str(local), index
            assert index["metadata"]["total_size"] == sum(4 * v.numel() for v in sent["w1"].values()), index
        for n, w in workers.items():
            assert w.pull(models[n]) == rounds
            assert_state_equal({k: v for k, v in models[n].state_dict().items()}, oracle.state)
        cl.wait_publishes(rounds)
    finally:
        cl.stop()


def test_split_delta_cuts_as_huggingface_hub(tmp_path):
    """diloco.encode.split_delta cuts a delta where huggingface_hub.save_torch_state_dict cuts the same state
    dict (a tensor over the size in a shard of its own), names its files the same, and its index holds the
    delta's metadata and total_size; a compressed key's scales stay in their codes' shard."""
    from huggingface_hub import split_torch_state_dict_into_shards
    from diloco.encode import SCALES_SUFFIX, delta_metadata as pkg_metadata, encode_delta, plain_delta, split_delta
    init = cluster_model(16)
    floating = {k: v for k, v in init.items() if v.is_floating_point()}
    cur = {k: v + 0.01 for k, v in floating.items()}
    meta = pkg_metadata("w1", 0, 7)
    delta = plain_delta(floating, cur, meta)
    for size in (30_000, 70_000, 150_000):
        parts, index = split_delta(delta, size, "delta_7")
        ix = json.loads(index)
        want = split_torch_state_dict_into_shards({k: torch.zeros_like(v) for k, v in floating.items()},
                                                  filename_pattern="delta_7{suffix}.safetensors", max_shard_size=size)
        assert ix["weight_map"] == want.tensor_to_filename, size
        assert ix["metadata"] == {"total_size": want.metadata["total_size"], **meta}, ix["metadata"]
        assert [n for n, _ in parts] == sorted(want.filename_to_tensors), size
        for name, part in parts:
            raw = bytes(part)
            h = json.loads(raw[8:8 + int.from_bytes(raw[:8], "little")])
            assert h.pop("__metadata__") == {"format": "pt"} and sorted(h) == sorted(want.filename_to_tensors[name])
    assert split_delta(delta, 10 << 20, "delta_7") is None          # one shard: the plain file is sent
    enc, _ = encode_delta(floating, cur, "int8_block", metadata=meta)
    parts, index = split_delta(enc, 20_000, "delta_7")
    wm = json.loads(index)["weight_map"]
    assert len(parts) >= 2 and all(wm[k + SCALES_SUFFIX] == wm[k] for k in floating), wm


def test_sets_gone_after_the_manifest_do_not_stop_a_late_member(tmp_path, s3):
    """w2's and w3's sets each lose a shard once the manifest names them; a member that adopts the manifest
    only then finds them gone and still adopts it.  Both members derive each next generation's manifest (one
    node dropped at a time, the other gone set still named by its manifest ETags and hashes) to the same
    bytes, and the step is torch's over w1 and w4."""
    init = cluster_model(17)
    cl = Cluster(tmp_path, s3, "sets-gone", S, 5)
    plan = Plan(publish_step0(cl.bucket, init), S)
    rng = np.random.default_rng(3417)
    try:
        a = cl.add("agg-a", env={"DILOCOD_TEST_CLUSTER_STALL_AFTER_PASS": "0"})
        cl.wait_ready()
        deltas = {n: random_deltas(rng, init) for n in NODES}
        files = {n: hf_set(tmp_path / n, n, 0, local_step(1), deltas[n]) for n in ("w2", "w3")}
        for n in ("w2", "w3"):
            put_set(cl.bucket, n, files[n])
        upload_round(cl.bucket, deltas, 1, nodes=["w1", "w4"])
        cl.wait(lambda: "test hook: pausing after the pass shard=0" in a.log_text(), "agg-a to compute shard 0", 30,
                interval=0.01)
        m0 = json.loads(cl.bucket.get("global/steps/1/manifest.json"))
        assert [e["node"] for e in m0["nodes"]] == NODES, m0
        for n in ("w2", "w3"):
            cl.bucket.c.delete_object(Bucket=cl.bucket.name, Key=cl.bucket.key(f"nodes/{n}/{files[n][0][0]}"))
        b = cl.add("agg-b")
        cl.wait_published(1, 90)
        oracle = Oracle(init, lr=0.7, momentum=0.9)
        oracle.step(tensors_of({n: d for n, d in deltas.items() if n in ("w1", "w4")}))
        assert_state_equal(read_generation(cl, plan, 1, 2), oracle.state)
        m2 = json.loads(cl.bucket.get("global/steps/1/manifest.g2.json"))
        assert [e["node"] for e in m2["nodes"]] == ["w1", "w4"], m2
        assert "a delta set of the manifest is gone from the bucket" in b.log_text(), cl.logs()
        assert "manifest refused" not in b.log_text() and "not the manifest derived" not in log_of(cl), cl.logs()
    finally:
        cl.stop()
