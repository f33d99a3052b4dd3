"""Compressed deltas on the remote transports: s3:// on SeaweedFS with boto3 workers, hf:// on the Hub
emulator with the stock huggingface_hub client.  Workers make their deltas with diloco delta --encode
--residual; two rounds mixing F32, int8_block, mxfp8 and mxfp4 equal torch.optim.SGD on the decoded
deltas bit for bit, and a hostile one (a NaN scale) is skipped with its reason, judged once."""
import os

os.environ["HF_HUB_DISABLE_XET"] = "1"
os.environ["HF_HUB_DISABLE_TELEMETRY"] = "1"
os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"

import numpy as np  # noqa: E402
import requests  # noqa: E402
import torch  # noqa: E402
from huggingface_hub import HfApi  # noqa: E402
from safetensors.torch import load as torch_load_bytes  # noqa: E402

import compress_oracle as co  # noqa: E402
from dilocod_proc import Oracle, assert_state_equal, delta_metadata, write_model  # noqa: E402
from test_compress import LR, MU, WORKERS, model, pytestmark, read_raw, worker_round  # noqa: E402
from test_daemon_hf import REPO, TOKEN, WREV, HfDilocod, HubSim, _hf_home, procs  # noqa: E402,F401 (fixtures)
from test_s3 import S3Dilocod, s3  # noqa: E402,F401 (the fixture)

assert pytestmark is not None


def served(d):
    return torch_load_bytes(requests.get(f"{d.url}/global/latest.safetensors", timeout=30).content)


def status(d):
    return requests.get(f"{d.url}/status", timeout=10).json()


def nan_scale_delta(init, step):
    zeros = {k: np.zeros(tuple(v.shape), np.float32) for k, v in init.items() if v.is_floating_point()}
    good, _ = co.compressed_delta("mxfp8", 32, zeros, delta_metadata("w9", step - 1, step))
    raw = {k: (dt, shape, np.frombuffer(b, np.uint8).copy()) for k, (dt, shape, b) in read_raw(good).items()}
    raw["a.w" + co.SUFFIX][2][0] = 0xff
    return co.serialize(raw, dict(delta_metadata("w9", step - 1, step), encoding="mxfp8", block="32"))


def run_rounds(tmp, d, put, wait_published, init):
    oracle = Oracle(init, lr=LR, momentum=MU)
    rng = np.random.default_rng(31)
    residual = {n: {k: np.zeros(tuple(v.shape), np.float32) for k, v in init.items() if v.is_floating_point()}
                for n in WORKERS}
    for step in (1, 2):
        if step == 1:
            put("w9", 1, nan_scale_delta(init, 1))          # first: skipped with its reason
            d.wait_log("decode to a non-finite value")
        bodies, decoded = worker_round(tmp, served(d), rng, step, residual)
        for node, body in bodies.items():
            put(node, step, body)
        wait_published(step)
        want = oracle.step({n: {k: torch.from_numpy(v.copy()) for k, v in dd.items()} for n, dd in decoded.items()})
        assert_state_equal(served(d), want)
    workers = {w["node_id"]: w["encoding"] for w in status(d)["workers"]}
    assert workers == {n: (s[0] if s else "none") for n, s in WORKERS.items()}, workers
    assert d.log_text().count("decode to a non-finite value") == 1       # judged once
    assert status(d)["counters"]["rejected"] >= 1


def test_s3_rounds_of_compressed_deltas(tmp_path, s3):
    init = model(5)
    write_model(tmp_path / "init.safetensors", init)
    d = S3Dilocod(tmp_path, s3, "compress/s3", "--init-model", tmp_path / "init.safetensors", "--lr", str(LR),
                  "--momentum", str(MU), "--expected-nodes", "4").start()

    def put(node, step, body):
        d.client.put_object(Bucket=s3.bucket, Key=d.key(f"nodes/{node}/delta_{step}.safetensors"), Body=body)

    try:
        d.wait_step(0)
        run_rounds(tmp_path, d, put, d.wait_step, init)
    finally:
        assert d.stop() == 0


def test_hf_rounds_of_compressed_deltas(tmp_path, procs):
    hub = HubSim(tmp_path)
    procs.append(hub)
    api = HfApi(endpoint=hub.wendpoint, token=TOKEN)
    api.create_repo(REPO)
    init = model(6)
    write_model(tmp_path / "init.safetensors", init)
    d = HfDilocod(tmp_path, hub, "--init-model", tmp_path / "init.safetensors", "--lr", str(LR), "--momentum",
                  str(MU), "--expected-nodes", "4", "--retry-interval", "0.5", poll=0.2)
    procs.append(d)

    def put(node, step, body):
        api.upload_file(path_or_fileobj=body, path_in_repo=f"nodes/{node}/delta_{step}.safetensors", repo_id=REPO,
                        revision=WREV, commit_message=f"{node} {step}")

    d.start()
    d.wait_published(0)
    run_rounds(tmp_path, d, put, d.wait_published, init)
    assert d.stop() == 0


def test_s3_sharded_compressed_set(tmp_path, s3):
    """A sharded mxfp4 set (each key's codes and scales in one shard) put with boto3, shards then index,
    beside a single int8_block file: the round equals torch on the decoded deltas."""
    from test_compress import compressed_set
    from safetensors.torch import save as st_save
    init = {"a.w": torch.randn(40, 16, generator=torch.Generator().manual_seed(7)),
            "b.big": torch.randn(3, 4100, generator=torch.Generator().manual_seed(8))}
    write_model(tmp_path / "init.safetensors", init)
    d = S3Dilocod(tmp_path, s3, "compress/set", "--init-model", tmp_path / "init.safetensors", "--lr", str(LR),
                  "--momentum", str(MU), "--expected-nodes", "2").start()
    rng = np.random.default_rng(41)
    delta = {n: {k: (rng.standard_normal(tuple(v.shape)) * 0.01).astype(np.float32) for k, v in init.items()}
             for n in ("w0", "w1")}
    try:
        d.wait_step(0)
        files, dec0 = compressed_set("mxfp4", 32, delta["w0"], delta_metadata("w0", 0, 1), [["a.w"], ["b.big"]])
        for name, body in files.items():         # dict order: the shards, then the index
            d.client.put_object(Bucket=s3.bucket, Key=d.key(f"nodes/w0/{name}"), Body=body)
        body1, dec1 = co.compressed_delta("int8_block", 32, delta["w1"], delta_metadata("w1", 0, 1))
        d.client.put_object(Bucket=s3.bucket, Key=d.key("nodes/w1/delta_1.safetensors"), Body=body1)
        d.wait_step(1)
        want = Oracle(init, lr=LR, momentum=MU).step({n: {k: torch.from_numpy(v.copy()) for k, v in dd.items()}
                                                      for n, dd in (("w0", dec0), ("w1", dec1))})
        assert requests.get(f"{d.url}/global/latest.safetensors", timeout=30).content == \
            st_save({k: v.contiguous() for k, v in want.items()})
    finally:
        assert d.stop() == 0
