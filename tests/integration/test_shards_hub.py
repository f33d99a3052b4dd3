"""Sharded checkpoints on the network transports (issue 14): s3:// against SeaweedFS with boto3 workers,
hf:// against the Hub emulator with the stock huggingface_hub client (no hf_xet).

Workers write a sharded delta with huggingface_hub.save_torch_state_dict into a local directory and
upload it as they would: boto3 put_object file by file (shards, then the index), or huggingface_hub's
upload_folder (one commit).  dilocod runs with a small --shard-size, so every global it publishes is a
set (latest-0000i-of-0000N.safetensors + latest.safetensors.index.json, step_count.json naming the
index).

s3://
  - a round mixing sharded and single-file deltas equals the torch oracle bit for bit; the published
    set has exactly the shards, the index and step_count.json (no latest.safetensors), and
    huggingface_hub.load_torch_model loads it after a boto3 download;
  - a set missing a shard waits (nothing refused, the round stays open) and completes when it arrives;
  - an index that does not parse, or that names another base's shards, is refused once with its reason;
  - a sharded global with a shard above --s3-part-mib goes up as a multipart object;
  - a dilocod on a fresh state directory adopts the bucket's sharded global and goes on from it.
hf://
  - step 0 is published as a set in one commit; snapshot_download + load_torch_model loads it;
  - a sharded delta uploaded with upload_folder and a single file with upload_file are aggregated
    (the torch oracle, bit for bit), again in one commit per step;
  - a fresh dilocod adopts the Hub's sharded global and its next round equals the oracle;
  - a dilocod with a larger --shard-size publishes the plain file and deletes the set in that commit;
  - a set committed without its last shard waits and completes when the shard is uploaded.
"""
import os

os.environ["HF_HUB_DISABLE_XET"] = "1"
os.environ["HF_HUB_DISABLE_TELEMETRY"] = "1"
os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"

import json  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import requests  # noqa: E402
import torch  # noqa: E402
from huggingface_hub import (CommitOperationAdd, HfApi, load_torch_model, save_torch_state_dict,  # noqa: E402
                             snapshot_download)
from safetensors.numpy import save as st_save_bytes  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from dilocod_proc import (Oracle, assert_state_equal, delta_metadata, module_for, random_deltas,  # noqa: E402
                         write_model)
from s3server import SeaweedS3  # noqa: E402
from test_daemon_hf import REPO, TOKEN, HfDilocod, HubSim, dilocod_steps_in_history  # noqa: E402
from test_s3 import S3Dilocod  # noqa: E402

DELTA_SHARD = 20_000    # bytes: each delta of model() splits into 4 or more shards
GLOBAL_SHARD = 50_000   # bytes: the published global needs 2 or more
INDEX = "global/latest.safetensors.index.json"


def model():
    g = torch.Generator().manual_seed(5)
    return {"embed.weight": torch.randn(100, 64, generator=g),          # 25,600 bytes: a shard of its own
            "layer.0.weight": torch.randn(64, 64, generator=g),
            "layer.0.bias": torch.randn(64, generator=g),
            "layer.1.weight": torch.randn(128, 64, generator=g),
            "norm.weight": torch.randn(64, generator=g).to(torch.bfloat16),
            "steps": torch.tensor([7], dtype=torch.int64)}


def a_round(rng, m, nodes=("w1", "w2")):
    """Random deltas of model m for nodes, and the torch oracle stepped by them from m."""
    deltas = {n: random_deltas(rng, m) for n in nodes}
    oracle = Oracle({k: v.clone() for k, v in m.items()})     # its own copy: torch steps an F32 tensor in place
    oracle.step(torch_deltas(deltas))
    return deltas, oracle


def run_dir(tmp_path, name, init):
    """A directory of its own for one dilocod, and the arguments that bootstrap it from init (if any)."""
    run = tmp_path / name
    run.mkdir()
    if init is None:
        return run, []
    write_model(run / "init.safetensors", init)
    return run, ["--init-model", run / "init.safetensors"]


def torch_deltas(deltas):
    return {n: {k: torch.from_numpy(v) for k, v in t.items()} for n, t in deltas.items()}


def save_set(directory: Path, node, base, local, tensors, max_shard=DELTA_SHARD):
    """A worker's sharded delta, as huggingface_hub writes it: [(name, path)], the shards first and the
    index last (the order a careful uploader puts them in)."""
    directory.mkdir(parents=True, exist_ok=True)
    save_torch_state_dict({k: torch.from_numpy(v) for k, v in tensors.items()}, str(directory),
                          filename_pattern=f"delta_{local}{{suffix}}.safetensors", max_shard_size=max_shard,
                          metadata=delta_metadata(node, base, local))
    index = directory / f"delta_{local}.safetensors.index.json"
    shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    assert len(shards) >= 2, shards
    return [(s, directory / s) for s in shards] + [(index.name, index)]


def set_layout_ok(names, base="latest"):
    """The names of a published global directory: n >= 2 shards, the index, step_count.json."""
    shards = sorted(n for n in names if n.startswith(f"{base}-"))
    n = len(shards)
    assert n >= 2 and shards == [f"{base}-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)], names
    assert sorted(names) == sorted(shards + [f"{base}.safetensors.index.json", "step_count.json"]), names
    return shards


def load_set_dir(directory: Path, m):
    """huggingface_hub.load_torch_model over a downloaded global directory."""
    mod = module_for(m)
    load_torch_model(mod, str(directory), strict=True, filename_pattern="latest{suffix}.safetensors")
    return dict(mod.state_dict())


# ---- s3:// ----------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    server = SeaweedS3(tmp_path_factory.mktemp("seaweedfs")).start()
    yield server
    server.stop()


def s3_put_set(d: S3Dilocod, node, files, skip=()):
    for name, path in files:
        if name not in skip:
            d.client.put_object(Bucket=d.s3.bucket, Key=d.key(f"nodes/{node}/{name}"), Body=path.read_bytes())


def s3_put_single(d: S3Dilocod, node, base, local, tensors):
    body = st_save_bytes(tensors, metadata=delta_metadata(node, base, local))
    d.client.put_object(Bucket=d.s3.bucket, Key=d.key(f"nodes/{node}/delta_{local}.safetensors"), Body=body)


def s3_list_requests(d: S3Dilocod):
    """ListObjectsV2 requests dilocod made, from its /metrics."""
    text = requests.get(f"{d.url}/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith('dilocod_hub_requests_total{route="list"'))


def s3_global_names(d: S3Dilocod):
    out = d.client.list_objects_v2(Bucket=d.s3.bucket, Prefix=d.key("global/"))
    return sorted(o["Key"][len(d.key("global/")):] for o in out.get("Contents", [])
                  if "/" not in o["Key"][len(d.key("global/")):])


def s3_download_global(d: S3Dilocod, dest: Path):
    dest.mkdir(parents=True, exist_ok=True)
    for name in s3_global_names(d):
        d.client.download_file(d.s3.bucket, d.key(f"global/{name}"), str(dest / name))
    return dest


def s3_start(tmp_path, s3, prefix, name, *args, init=None, shard_size=GLOBAL_SHARD):
    run, more = run_dir(tmp_path, name, init)
    return S3Dilocod(run, s3, prefix, *more, "--shard-size", str(shard_size), *args).start()


def test_s3_sharded_and_single_deltas_round_equals_torch_and_publishes_a_loadable_set(tmp_path, s3):
    m = model()
    deltas, oracle = a_round(np.random.default_rng(31), m, ("w1", "w2", "w3"))
    d = s3_start(tmp_path, s3, "shards/round", "run", "--expected-nodes", "3", init=m)
    try:
        d.wait_step(0)
        set_layout_ok(s3_global_names(d))
        assert_state_equal(load_set_dir(s3_download_global(d, tmp_path / "g0"), m), m)
        w1 = save_set(tmp_path / "w1", "w1", 0, 10, deltas["w1"])
        w3 = save_set(tmp_path / "w3", "w3", 0, 10, deltas["w3"], max_shard=30_000)
        s3_put_set(d, "w1", w1)
        s3_put_single(d, "w2", 0, 10, deltas["w2"])
        s3_put_set(d, "w3", w3)
        d.wait_step(1)
        sc = json.loads(d.get("global/step_count.json"))
        assert sc["outer_step"] == 1 and sc["model_file"] == INDEX, sc
        set_layout_ok(s3_global_names(d))
        got = load_set_dir(s3_download_global(d, tmp_path / "g1"), m)
        assert_state_equal(got, oracle.state)
        s = d.status()
        assert s["counters"]["rejected"] == 0, s["counters"]
        # every shard of the sets downloaded once, into the set's own directory (then removed)
        log = d.log_text()
        for node, files in (("w1", w1), ("w3", w3)):
            for name, _ in files[:-1]:
                assert log.count(f"s3 object downloaded key={d.key(f'nodes/{node}/{name}')} ") == 1, (node, name)
        assert not any((d.state_dir / "cache" / "incoming").iterdir())
        assert d.alive()
    finally:
        assert d.stop() == 0


def test_s3_a_partial_set_waits_and_completes(tmp_path, s3):
    m = model()
    deltas, oracle = a_round(np.random.default_rng(32), m)
    d = s3_start(tmp_path, s3, "shards/partial", "run", "--expected-nodes", "2", init=m)
    try:
        d.wait_step(0)
        files = save_set(tmp_path / "w1", "w1", 0, 4, deltas["w1"])
        last_shard = files[-2][0]
        s3_put_set(d, "w1", files, skip=(last_shard,))
        s3_put_single(d, "w2", 0, 4, deltas["w2"])
        index_key = d.key("nodes/w1/delta_4.safetensors.index.json")
        d.wait_log(f"sharded set incomplete, waiting for its shards key={index_key}")
        # w2 is in, w1 waits: the round stays open and nothing is refused
        d.wait_until(lambda: d.status()["counters"]["accepted"] >= 1, "w2 accepted")
        assert d.published_step() == 0
        assert d.status()["counters"]["rejected"] == 0
        # the missing shard arrives: the listing shows a new version of the set, which is taken
        s3_put_set(d, "w1", [f for f in files if f[0] == last_shard])
        d.wait_step(1)
        assert_state_equal(load_set_dir(s3_download_global(d, tmp_path / "g1"), m), oracle.state)
        assert "delta rejected" not in d.log_text()
    finally:
        assert d.stop() == 0


def test_s3_an_index_that_does_not_parse_is_refused_once_with_its_reason(tmp_path, s3):
    m = model()
    rng = np.random.default_rng(34)
    d = s3_start(tmp_path, s3, "shards/hostile", "run", "--expected-nodes", "2", init=m)
    try:
        d.wait_step(0)
        key = d.key("nodes/w1/delta_5.safetensors.index.json")
        d.client.put_object(Bucket=s3.bucket, Key=key, Body=b'{"metadata": {"total_size": 1}, "weight_map": ')
        # an index naming shards of another base: refused as a whole, its shards never handed over alone
        files = save_set(tmp_path / "w2", "w2", 0, 6, random_deltas(rng, m))
        doc = json.loads(files[-1][1].read_text())
        doc["weight_map"] = {k: v.replace("delta_6-", "delta_7-") for k, v in doc["weight_map"].items()}
        files[-1][1].write_text(json.dumps(doc, indent=2))
        s3_put_set(d, "w2", files)
        d.wait_log("delta rejected")
        # more polls (every 0.1 s) hand neither over again; the w2 index (which names delta_7's shards)
        # is refused by intake, and no shard ever reaches it on its own
        d.wait_log("delta rejected", count=2)
        lists = s3_list_requests(d)
        d.wait_until(lambda: s3_list_requests(d) >= lists + 5, "five more listings of nodes/")
        lines = [l for l in d.log_text().splitlines() if "delta rejected" in l]
        assert len(lines) == 2, lines
        assert sum("nodes/w1/delta_5.safetensors.index.json" in l for l in lines) == 1, lines
        assert sum("nodes/w2/delta_6.safetensors.index.json" in l for l in lines) == 1, lines
        s = d.status()
        assert s["counters"]["rejected"] == 2 and s["counters"]["accepted"] == 0, s["counters"]
        assert d.published_step() == 0 and d.alive()
    finally:
        assert d.stop() == 0


def test_s3_a_shard_above_the_part_size_goes_up_in_parts(tmp_path, s3):
    # a 6.3 MiB tensor: its shard (--shard-size 6 MB keeps it alone) is above a 5 MiB part
    g = torch.Generator().manual_seed(9)
    m = {"big": torch.randn(1_650_000, generator=g), "small": torch.randn(1000, generator=g)}
    d = s3_start(tmp_path, s3, "shards/multipart", "run", "--expected-nodes", "1", "--s3-part-mib", "5",
                 init=m, shard_size=6_000_000)
    try:
        d.wait_step(0)
        shards = set_layout_ok(s3_global_names(d))
        etags = [d.client.head_object(Bucket=s3.bucket, Key=d.key(f"global/{s}"))["ETag"].strip('"')
                 for s in shards]
        assert sum(e.endswith("-2") for e in etags) == 1, etags        # the big shard: 2 parts
        assert_state_equal(load_set_dir(s3_download_global(d, tmp_path / "g0"), m), m)
        assert not d.client.list_multipart_uploads(Bucket=s3.bucket, Prefix=d.key("")).get("Uploads")
    finally:
        assert d.stop() == 0


def test_s3_a_fresh_dilocod_adopts_the_sharded_global(tmp_path, s3):
    m = model()
    rng = np.random.default_rng(33)
    first, oracle = a_round(rng, m)
    prefix = "shards/adopt"
    d = s3_start(tmp_path, s3, prefix, "run", "--expected-nodes", "2", init=m)
    try:
        d.wait_step(0)
        s3_put_set(d, "w1", save_set(tmp_path / "a", "w1", 0, 10, first["w1"]))
        s3_put_single(d, "w2", 0, 10, first["w2"])
        d.wait_step(1)
    finally:
        assert d.stop() == 0
    adopted = Oracle(oracle.state)     # momentum starts fresh on adoption
    more = {n: random_deltas(rng, m) for n in ("w1", "w2")}
    adopted.step(torch_deltas(more))
    d2 = s3_start(tmp_path, s3, prefix, "fresh", "--expected-nodes", "2")
    try:
        d2.wait_log("adopted the published global step=1")
        s3_put_set(d2, "w1", save_set(tmp_path / "b1", "w1", 1, 20, more["w1"]))
        s3_put_set(d2, "w2", save_set(tmp_path / "b2", "w2", 1, 20, more["w2"], max_shard=30_000))
        d2.wait_step(2)
        set_layout_ok(s3_global_names(d2))
        assert_state_equal(load_set_dir(s3_download_global(d2, tmp_path / "g2"), m), adopted.state)
    finally:
        assert d2.stop() == 0


# ---- hf:// ----------------------------------------------------------------------------------------

@pytest.fixture
def hub(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))   # never the user's cache or token
    h = HubSim(tmp_path)
    yield h
    h.stop()


def hf_download_global(hub: HubSim, dest: Path):
    snapshot_download(REPO, allow_patterns=["global/*"], local_dir=str(dest), endpoint=hub.wendpoint, token=TOKEN)
    return dest / "global"


def hf_global_names(api: HfApi):
    return sorted(f[len("global/"):] for f in api.list_repo_files(REPO) if f.startswith("global/"))


def hf_dilocod(tmp_path, hub, name, *args, init=None):
    run, more = run_dir(tmp_path, name, init)
    return HfDilocod(run, hub, *more, "--nodes", "w1,w2", "--retry-interval", "0.5",
                     "--shard-size", str(GLOBAL_SHARD), *args)


def hf_bootstrap(tmp_path, hub, m):
    """A new repo and a dilocod bootstrapped from m that has published step 0 there as a set: (api, d)."""
    api = HfApi(endpoint=hub.wendpoint, token=TOKEN)
    api.create_repo(REPO)
    d = hf_dilocod(tmp_path, hub, "run", init=m).start()
    try:
        d.wait_published(0)
        set_layout_ok(hf_global_names(api))
    except BaseException:
        d.stop()
        raise
    return api, d


def test_hf_sharded_global_and_a_sharded_delta_through_the_hub(tmp_path, hub):
    m = model()
    rng = np.random.default_rng(41)
    api, d = hf_bootstrap(tmp_path, hub, m)
    try:
        sc = json.loads(Path(api.hf_hub_download(REPO, "global/step_count.json", cache_dir=str(tmp_path / "c0")))
                        .read_text())
        assert sc["outer_step"] == 0 and sc["model_file"] == INDEX, sc
        assert_state_equal(load_set_dir(hf_download_global(hub, tmp_path / "g0"), m), m)

        deltas, oracle = a_round(rng, m)
        files = save_set(tmp_path / "w1", "w1", 0, 10, deltas["w1"])
        api.upload_folder(folder_path=str(tmp_path / "w1"), path_in_repo="nodes/w1", repo_id=REPO,
                          commit_message="w1: sharded delta")
        api.upload_file(path_or_fileobj=st_save_bytes(deltas["w2"], metadata=delta_metadata("w2", 0, 10)),
                        path_in_repo="nodes/w2/delta_10.safetensors", repo_id=REPO, commit_message="w2: delta")
        d.wait_published(1)
        assert len(files) >= 3
        set_layout_ok(hf_global_names(api))
        assert_state_equal(load_set_dir(hf_download_global(hub, tmp_path / "g1"), m), oracle.state)
        # one commit per step, each holding the whole set and its step file
        assert dilocod_steps_in_history(api) == [0, 1]
        assert d.status()["counters"]["rejected"] == 0
        log = d.log_text()
        for name, _ in files[:-1]:
            assert log.count(f"delta downloaded path=nodes/w1/{name} ") == 1, name
    finally:
        assert d.stop() == 0

    # a fresh dilocod adopts the Hub's sharded global (fresh momentum) and goes on from it
    adopted = Oracle(oracle.state)
    more = {n: random_deltas(rng, m) for n in ("w1", "w2")}
    adopted.step(torch_deltas(more))
    d2 = hf_dilocod(tmp_path, hub, "fresh").start()
    try:
        d2.wait_log("adopted the published global step=1")
        save_set(tmp_path / "m1", "w1", 1, 20, more["w1"])
        save_set(tmp_path / "m2", "w2", 1, 20, more["w2"], max_shard=30_000)
        api.upload_folder(folder_path=str(tmp_path / "m1"), path_in_repo="nodes/w1", repo_id=REPO)
        api.upload_folder(folder_path=str(tmp_path / "m2"), path_in_repo="nodes/w2", repo_id=REPO)
        d2.wait_published(2)
        set_layout_ok(hf_global_names(api))
        assert_state_equal(load_set_dir(hf_download_global(hub, tmp_path / "g2"), m), adopted.state)
        assert dilocod_steps_in_history(api) == [0, 1, 2]
    finally:
        assert d2.stop() == 0


def test_hf_a_plain_publish_replaces_the_sharded_layout_in_its_commit(tmp_path, hub):
    """The layout follows --shard-size: a dilocod with a larger one publishes the plain file and the
    same commit deletes the set (and the other way round)."""
    m = model()
    rng = np.random.default_rng(42)
    api, d = hf_bootstrap(tmp_path, hub, m)
    assert d.stop() == 0
    d2 = HfDilocod(tmp_path / "run", hub, "--nodes", "w1,w2", "--retry-interval", "0.5", "--shard-size", "5GB",
                   state_root=d.state_root)
    d2.start()
    try:
        deltas, oracle = a_round(rng, m)
        for n in ("w1", "w2"):
            api.upload_file(path_or_fileobj=st_save_bytes(deltas[n], metadata=delta_metadata(n, 0, 10)),
                            path_in_repo=f"nodes/{n}/delta_10.safetensors", repo_id=REPO)
        d2.wait_published(1)
        assert hf_global_names(api) == ["latest.safetensors", "step_count.json"]
        got = load_file(api.hf_hub_download(REPO, "global/latest.safetensors", cache_dir=str(tmp_path / "c1")))
        assert_state_equal(got, oracle.state)
        assert dilocod_steps_in_history(api) == [0, 1]
    finally:
        assert d2.stop() == 0


def test_hf_a_partial_set_waits_and_completes(tmp_path, hub):
    m = model()
    deltas, oracle = a_round(np.random.default_rng(43), m)
    api, d = hf_bootstrap(tmp_path, hub, m)
    try:
        files = save_set(tmp_path / "w1", "w1", 0, 4, deltas["w1"])
        last_shard = files[-2]
        # one commit with the index and every shard but the last, as an interrupted uploader leaves it
        api.create_commit(REPO, [CommitOperationAdd(f"nodes/w1/{name}", str(path))
                                 for name, path in files if name != last_shard[0]],
                          commit_message="w1: part of a set")
        api.upload_file(path_or_fileobj=st_save_bytes(deltas["w2"], metadata=delta_metadata("w2", 0, 4)),
                        path_in_repo="nodes/w2/delta_4.safetensors", repo_id=REPO)
        d.wait_log("sharded set incomplete, waiting for its shards path=nodes/w1/delta_4.safetensors.index.json")
        d.wait(lambda: d.status()["counters"]["accepted"] >= 1, "w2 accepted")
        assert d.status()["hub"].get("published_step") == 0
        assert d.status()["counters"]["rejected"] == 0
        api.upload_file(path_or_fileobj=str(last_shard[1]), path_in_repo=f"nodes/w1/{last_shard[0]}",
                        repo_id=REPO, commit_message="w1: the last shard")
        d.wait_published(1)
        assert_state_equal(load_set_dir(hf_download_global(hub, tmp_path / "g1"), m), oracle.state)
        assert "delta rejected" not in d.log_text()
    finally:
        assert d.stop() == 0
