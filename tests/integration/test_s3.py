"""dilocod's s3:// transport end to end against a real S3 server, SeaweedFS (tests/integration/s3server.py).

Workers are boto3 clients, as real workers are: they put_object their deltas under
<prefix>/nodes/<id>/delta_<n>.safetensors and get_object the global.  Each test checks the bucket's
contents against an oracle (torch's SGD, the bytes that went in) or the server's own answers."""
import io
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
import requests
import torch
from boto3.s3.transfer import TransferConfig
from safetensors.numpy import load as st_load_bytes
from safetensors.numpy import save as st_save_bytes

from conftest import BUILD
from dilocod_proc import (Dilocod, Oracle, assert_state_equal, delta_metadata, part_sizes,
                          write_model)
from s3server import SeaweedS3

PREFIX = "runs/exp-1"
NODES = ["w1", "w2"]


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    server = SeaweedS3(tmp_path_factory.mktemp("seaweedfs")).start()
    yield server
    server.stop()


class S3Dilocod(Dilocod):
    """dilocod --hub s3://<bucket>/<prefix> --hub-endpoint <SeaweedFS>, credentials in the environment
    (or a credentials file when given)."""

    def __init__(self, tmp, s3: SeaweedS3, prefix, *args, env=None, state_root=None):
        super().__init__(tmp, None, *args, state_root=state_root, env=dict(s3.env(), **(env or {})))
        self.s3 = s3
        self.prefix = prefix
        self.client = s3.client()

    def start(self, *extra):
        log = self.tmp / f"dilocod-{len(self.logs)}.log"
        self.logs.append(log)
        cmd = [str(BUILD / "dilocod"), "--state-root", str(self.state_root),
               "--hub", f"s3://{self.s3.bucket}/{self.prefix}", "--hub-endpoint", self.s3.endpoint,
               "--listen", "127.0.0.1:0", "--poll-interval", "0.1", "--retry-interval", "0.5",
               "--log-level", "debug", *self.args, *extra]
        env = dict(os.environ, **(self.env or {}))
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=open(log, "wb"), env=env)
        return self

    def key(self, rel):
        return f"{self.prefix}/{rel}"

    def get(self, rel):
        return self.client.get_object(Bucket=self.s3.bucket, Key=self.key(rel))["Body"].read()

    def published_step(self):
        try:
            return json.loads(self.get("global/step_count.json"))["outer_step"]
        except Exception:
            return None

    def global_state(self):
        return st_load_bytes(self.get("global/latest.safetensors"))

    def status(self):
        return requests.get(f"{self.url}/status", timeout=10).json()


def put_delta(client, bucket, prefix, node, base_step, local_step, tensors, multipart=False):
    """A worker's push: the reference's metadata, one put_object (boto3), or boto3's managed upload in
    8 MiB parts (as upload_file does for large files: the object's ETag is then not its MD5)."""
    body = st_save_bytes(tensors, metadata=delta_metadata(node, base_step, local_step))
    key = f"{prefix}/nodes/{node}/delta_{local_step}.safetensors"
    if multipart:
        cfg = TransferConfig(multipart_threshold=8 << 20, multipart_chunksize=8 << 20)
        client.upload_fileobj(io.BytesIO(body), bucket, key, Config=cfg)
    else:
        client.put_object(Bucket=bucket, Key=key, Body=body)


def small_model(seed, n=64):
    g = torch.Generator().manual_seed(seed)
    return {"layer.weight": torch.randn(n, 16, generator=g), "layer.bias": torch.randn(16, generator=g)}


def round_deltas(rng, model):
    return {node: {k: (rng.standard_normal(tuple(v.shape)) * 0.01).astype(np.float32) for k, v in model.items()}
            for node in NODES}


def claims(client, bucket, prefix):
    """{step: instance} of every claim object under <prefix>/global/steps/."""
    out = {}
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=f"{prefix}/global/steps/")
    for page in pages:
        for o in page.get("Contents", []):
            step = int(o["Key"].rsplit("/", 1)[1].split(".")[0])
            body = json.loads(client.get_object(Bucket=bucket, Key=o["Key"])["Body"].read())
            assert body["outer_step"] == step
            out[step] = body["instance"]
    return out


def test_seaweedfs_listens_on_loopback_only_without_telemetry(s3):
    socks = s3.listening()
    assert any(port == s3.port for _, port in socks), socks
    assert all(addr == "127.0.0.1" for addr, _ in socks), f"weed listens beyond loopback: {socks}"
    assert "-master.telemetry=false" in s3.cmd
    # the identities file is in force: a wrong secret is refused by the server itself
    with pytest.raises(Exception, match="SignatureDoesNotMatch|InvalidAccessKeyId|AccessDenied"):
        s3.client(secret="wrong-secret").list_objects_v2(Bucket=s3.bucket)


def test_rounds_equal_torch_oracle(tmp_path, s3):
    prefix = "oracle/run"
    init = small_model(1)
    write_model(tmp_path / "init.safetensors", init)
    d = S3Dilocod(tmp_path, s3, prefix, "--init-model", tmp_path / "init.safetensors",
                  "--expected-nodes", str(len(NODES))).start()
    try:
        d.wait_step(0)
        assert d.get("global/latest.safetensors") == (tmp_path / "init.safetensors").read_bytes()
        oracle = Oracle(init)
        rng = np.random.default_rng(7)
        for r in range(3):
            deltas = round_deltas(rng, init)
            for node in NODES:
                put_delta(d.client, s3.bucket, prefix, node, r, 100 * (r + 1), deltas[node])
            d.wait_step(r + 1)
            oracle.step({n: {k: torch.from_numpy(v) for k, v in t.items()} for n, t in deltas.items()})
            got = {k: torch.from_numpy(v) for k, v in d.global_state().items()}
            assert_state_equal(got, oracle.state)
            step_file = json.loads(d.get("global/step_count.json"))
            assert step_file["outer_step"] == r + 1 and step_file["model_file"] == "global/latest.safetensors"
        # one claim per step, all ours
        instance = (d.state_dir / "s3_instance").read_text().strip()
        assert claims(d.client, s3.bucket, prefix) == {s: instance for s in range(4)}
        assert d.alive()
    finally:
        d.stop()


def test_multipart_publish_above_part_size(tmp_path, s3):
    prefix = "multipart/run"
    # 6.3 MiB of weights: above a 5 MiB part size, so the global goes up in two parts
    init = {"big": torch.randn(1_650_000, generator=torch.Generator().manual_seed(3))}
    write_model(tmp_path / "init.safetensors", init)
    d = S3Dilocod(tmp_path, s3, prefix, "--init-model", tmp_path / "init.safetensors", "--expected-nodes", "1",
                  "--s3-part-mib", "5").start()
    try:
        d.wait_step(0)
        head = d.client.head_object(Bucket=s3.bucket, Key=d.key("global/latest.safetensors"))
        assert head["ETag"].strip('"').endswith("-2"), head["ETag"]     # a multipart object of 2 parts
        assert d.get("global/latest.safetensors") == (tmp_path / "init.safetensors").read_bytes()
        # no multipart upload left behind
        assert not d.client.list_multipart_uploads(Bucket=s3.bucket, Prefix=prefix).get("Uploads")
    finally:
        d.stop()


def test_wrong_credentials_give_a_clear_error(tmp_path, s3):
    prefix = "wrongcreds/run"
    init = small_model(2)
    write_model(tmp_path / "init.safetensors", init)
    d = S3Dilocod(tmp_path, s3, prefix, "--init-model", tmp_path / "init.safetensors", "--expected-nodes", "1",
                  env={"AWS_SECRET_ACCESS_KEY": "not-the-secret"}).start()
    try:
        d.wait_log("SignatureDoesNotMatch")
        hub = d.status()["hub"]
        assert "SignatureDoesNotMatch" in json.dumps(hub), hub
        assert "HTTP 403" in d.log_text()
        # the error is logged when it starts, not at every poll
        time.sleep(1)
        assert d.log_text().count("s3 request failed") <= 3, d.log_text()[-3000:]
        assert requests.get(f"{d.url}/healthz", timeout=10).status_code in (200, 503)
        assert d.alive()
        # nothing reached the bucket
        assert "Contents" not in d.client.list_objects_v2(Bucket=s3.bucket, Prefix=prefix)
    finally:
        d.stop()


def test_credentials_file(tmp_path, s3):
    prefix = "credfile/run"
    init = small_model(4)
    write_model(tmp_path / "init.safetensors", init)
    creds = tmp_path / "credentials"
    env = s3.env()
    creds.write_text(f"[other]\naws_access_key_id = AKIAOTHER\n\n[default]\naws_access_key_id = "
                     f"{env['AWS_ACCESS_KEY_ID']}\naws_secret_access_key = {env['AWS_SECRET_ACCESS_KEY']}\n")
    d = S3Dilocod(tmp_path, s3, prefix, "--init-model", tmp_path / "init.safetensors", "--expected-nodes", "1",
                  "--s3-credentials-file", creds, env={"AWS_ACCESS_KEY_ID": "", "AWS_SECRET_ACCESS_KEY": ""})
    d.start()
    try:
        d.wait_step(0)
        assert d.get("global/latest.safetensors") == (tmp_path / "init.safetensors").read_bytes()
    finally:
        d.stop()


def test_killed_mid_download_and_mid_publish(tmp_path, s3):
    """kill -9 while a large delta is being downloaded, and again while a step is being published:
    the restarted dilocod resumes the download (Range) and finishes its own claimed publish, and the
    result equals the oracle."""
    prefix = "kill/run"
    init = {"big": torch.randn(8_000_000, generator=torch.Generator().manual_seed(5))}    # 32 MB
    write_model(tmp_path / "init.safetensors", init)
    args = ("--init-model", tmp_path / "init.safetensors", "--expected-nodes", "2", "--s3-part-mib", "5")
    d = S3Dilocod(tmp_path, s3, prefix, *args).start()
    d.wait_step(0)
    rng = np.random.default_rng(11)
    deltas = round_deltas(rng, init)
    incoming = d.state_dir / "cache" / "incoming"
    # kill -9 once part of the download is on disk; should this machine be so slow to look that the
    # whole download was taken in first, the same delta is pushed again under a higher local step
    for local in range(10, 15):
        put_delta(d.client, s3.bucket, prefix, "w1", 0, local, deltas["w1"])
        taken = f"delta accepted step=0 node=w1 local_step={local} "
        while not any(part_sizes(incoming, "s3-*.part").values()) and taken not in d.log_text():
            assert d.alive(), d.log_text()[-3000:]
            time.sleep(0.001)
        if taken not in d.log_text():
            break
    d.kill9()
    d.start()
    # the partial download is continued where it stopped (Range), not started over
    d.wait_log(f"hub: resuming a download key=kill/run/nodes/w1/delta_{local}.safetensors")
    put_delta(d.client, s3.bucket, prefix, "w2", 0, 10, deltas["w2"], multipart=True)
    etag = d.client.head_object(Bucket=s3.bucket, Key=d.key("nodes/w2/delta_10.safetensors"))["ETag"]
    assert etag.strip('"').endswith("-4"), etag     # 32 MB in 8 MiB parts
    # kill -9 as soon as the step's claim exists (the upload of the global follows it)
    while True:
        try:
            d.client.head_object(Bucket=s3.bucket, Key=d.key("global/steps/1.claim"))
            break
        except Exception:
            assert d.alive(), d.log_text()[-3000:]
            time.sleep(0.001)
    d.kill9()
    d.start()
    try:
        d.wait_step(1)
        oracle = Oracle(init)
        oracle.step({n: {k: torch.from_numpy(v) for k, v in t.items()} for n, t in deltas.items()})
        got = {k: torch.from_numpy(v) for k, v in d.global_state().items()}
        assert_state_equal(got, oracle.state)
        instance = (d.state_dir / "s3_instance").read_text().strip()
        assert claims(d.client, s3.bucket, prefix) == {0: instance, 1: instance}
        assert "publish lost" not in d.log_text()
        assert not d.client.list_multipart_uploads(Bucket=s3.bucket, Prefix=prefix).get("Uploads")
    finally:
        d.stop()


def test_two_aggregators_one_bucket_one_publisher_per_step(tmp_path, s3):
    prefix = "two/run"
    init = small_model(6)
    write_model(tmp_path / "init.safetensors", init)
    args = ("--init-model", tmp_path / "init.safetensors", "--expected-nodes", str(len(NODES)))
    a = S3Dilocod(tmp_path / "a", s3, prefix, *args, state_root=tmp_path / "a" / "state")
    b = S3Dilocod(tmp_path / "b", s3, prefix, *args, state_root=tmp_path / "b" / "state")
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    a.start()
    b.start()
    try:
        a.wait_step(0)
        rng = np.random.default_rng(13)
        for r in range(3):
            deltas = round_deltas(rng, init)
            for node in NODES:
                put_delta(a.client, s3.bucket, prefix, node, r, 100 * (r + 1), deltas[node])
            a.wait_step(r + 1)
        ids = {(a.state_dir / "s3_instance").read_text().strip(), (b.state_dir / "s3_instance").read_text().strip()}
        assert len(ids) == 2
        got = claims(a.client, s3.bucket, prefix)
        assert sorted(got) == [0, 1, 2, 3]
        assert set(got.values()) <= ids
        # each step was published by exactly one of the two; the other lost its claim and said so
        # the step's objects are in the bucket just before "published" is logged: wait for the line
        deadline = time.time() + 30
        while "hub: published step=3 bucket=" not in a.log_text() + b.log_text() and time.time() < deadline:
            time.sleep(0.05)
        logs = a.log_text() + b.log_text()
        for step in range(4):
            assert logs.count(f"hub: published step={step} bucket=") == 1, (step, logs[-4000:])
        assert "publish lost to another aggregator" in logs
        assert a.alive() and b.alive()
    finally:
        a.stop()
        b.stop()


def test_hostile_bucket_entries_are_refused_before_download(tmp_path, s3):
    """Objects that a writer with access to the bucket planted: a header length past the cap, a
    header that describes another size than the listing's, a stale delta, names that are no delta's.
    None is downloaded; the round still closes on the good deltas and equals the oracle."""
    prefix = "hostile/run"
    init = small_model(8)
    write_model(tmp_path / "init.safetensors", init)
    d = S3Dilocod(tmp_path, s3, prefix, "--init-model", tmp_path / "init.safetensors",
                  "--expected-nodes", str(len(NODES))).start()
    try:
        d.wait_step(0)
        c, bucket = d.client, s3.bucket
        rng = np.random.default_rng(17)
        deltas = round_deltas(rng, init)
        c.put_object(Bucket=bucket, Key=f"{prefix}/nodes/evil1/delta_1.safetensors",
                     Body=(1 << 40).to_bytes(8, "little") + b"{}")
        good = st_save_bytes(deltas["w1"], metadata=delta_metadata("evil2", 0, 1))
        c.put_object(Bucket=bucket, Key=f"{prefix}/nodes/evil2/delta_1.safetensors", Body=good + b"\0" * 4096)
        c.put_object(Bucket=bucket, Key=f"{prefix}/nodes/w1/notes.txt", Body=b"not a delta")
        c.put_object(Bucket=bucket, Key=f"{prefix}/nodes/w2/delta_007.safetensors", Body=b"x")
        d.wait_log("delta refused before download", count=2)
        log = d.log_text()
        assert "header of 1099511627776 bytes" in log
        assert "the header describes" in log
        for node in NODES:
            put_delta(c, bucket, prefix, node, 0, 5, deltas[node])
        d.wait_step(1)
        oracle = Oracle(init)
        oracle.step({n: {k: torch.from_numpy(v) for k, v in t.items()} for n, t in deltas.items()})
        assert_state_equal({k: torch.from_numpy(v) for k, v in d.global_state().items()}, oracle.state)
        # a delta of the finished round is stale: peeked at, never downloaded
        put_delta(c, bucket, prefix, "w1", 0, 6, deltas["w1"])
        d.wait_log("stale delta not downloaded key=hostile/run/nodes/w1/delta_6.safetensors")
        assert "s3 object downloaded key=hostile/run/nodes/evil" not in d.log_text()
        assert "notes.txt" not in d.log_text() and "delta_007" not in d.log_text()
        assert "s3 object downloaded key=hostile/run/nodes/w1/delta_6" not in d.log_text()
        assert d.alive()
    finally:
        d.stop()
