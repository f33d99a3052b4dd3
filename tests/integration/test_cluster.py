"""dilocod's cluster mode (issue 26, /work/notes/cluster-spec.md) against a real S3 server, SeaweedFS:
K dilocod processes share one round over one bucket, each claiming shards of the global
(global/steps/<s>/shard-<i>.claim), reading only that shard's byte ranges of the deltas, the previous
global and the momentum, and writing the new global's shard and momentum's shard back; one of them
publishes the step (global/steps/<s>/published, then global/step_count.json naming the step's index).

Workers are boto3 clients; step 0 is published by the test as the Python reference does (safetensors
save + step_count.json).  Every step is checked bit for bit against torch's SGD (dilocod_proc.Oracle),
once-only publishing against a watcher of step_count.json and the aggregators' /status, and the
bucket's contents against the spec's garbage collection rule.  The failure tests use the C test hooks
DILOCOD_TEST_CLUSTER_STALL=<shard> (the claimer of that shard stops for 3600 s right after its claim)
and DILOCOD_TEST_CLUSTER_STALL_AFTER_PASS=<shard> (it stalls 2 s after computing the shard, before it
writes anything)."""
import json
import math
import os
import re
import signal
import subprocess
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import pytest
import requests
import torch
from safetensors.numpy import save as st_save_bytes
from safetensors.torch import load as st_torch_load
from safetensors.torch import save as st_torch_save

from conftest import BUILD
from dilocod_proc import Dilocod, Oracle, assert_state_equal, delta_metadata, module_for, random_deltas
from s3server import SeaweedS3
from test_s3 import S3Dilocod, put_delta

NODES = ["w1", "w2", "w3", "w4"]
LR, MOMENTUM = 0.7, 0.9
INDEX = "model.safetensors.index.json"


def stop_s3(server: SeaweedS3, grace=5):
    """SeaweedS3.stop with a short grace: weed mini logs every component stopped within ~2 s of SIGTERM
    but, after dilocods talked to it, its process may linger until SeaweedS3.stop's 30 s timeout."""
    if server.proc is not None and server.proc.poll() is None:
        server.proc.terminate()
        try:
            server.proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            server.proc.kill()
            server.proc.wait(timeout=30)
    server.proc = None


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    server = SeaweedS3(tmp_path_factory.mktemp("seaweedfs")).start()
    yield server
    stop_s3(server)


@pytest.fixture(scope="module", autouse=True)
def cluster_mode_built():
    """The binary under test has cluster mode (the flag the spec adds)."""
    p = subprocess.run([str(BUILD / "dilocod"), "--help"], capture_output=True, text=True, timeout=30)
    assert "--cluster-shards" in p.stdout + p.stderr, \
        f"{BUILD / 'dilocod'} has no --cluster-shards (cluster mode is not built):\n{(p.stdout + p.stderr)[-2000:]}"


# ---------------------------------------------------------------------------------------------------
# the model, its shard plan and the deltas

def cluster_model(seed):
    """24 F32 tensors of 2..100 KB (nested names, as a real model's) and an int64 buffer: ~620 KB."""
    g = torch.Generator().manual_seed(seed)
    shapes = {"embed.weight": (200, 128)}
    for b in range(5):
        shapes[f"blocks.{b}.attn.weight"] = (64, 128)
        shapes[f"blocks.{b}.attn.bias"] = (512,)
        shapes[f"blocks.{b}.mlp.weight"] = (128, 96)
        shapes[f"blocks.{b}.norm.weight"] = (1024,)
    shapes["head.weight"] = (128, 150)
    shapes["head.bias"] = (1000,)
    shapes["final_norm.weight"] = (3, 7, 50)
    state = {k: torch.randn(*s, generator=g) for k, s in shapes.items()}
    assert sum(v.dtype == torch.float32 for v in state.values()) == 24
    state["position_ids"] = torch.arange(512, dtype=torch.int64) * 3 + seed
    return state


def st_header(raw: bytes) -> dict:
    n = int.from_bytes(raw[:8], "little")
    h = json.loads(raw[8:8 + n])
    h.pop("__metadata__", None)
    return h


class Plan:
    """The spec's shard plan of a global file: its tensors in data offset order cut into S contiguous
    shards of whole tensors (cut after tensor t when running bytes * S >= (k+1) * total)."""

    def __init__(self, raw: bytes, shards: int):
        h = st_header(raw)
        order = sorted(h, key=lambda k: h[k]["data_offsets"][0])
        size = {k: h[k]["data_offsets"][1] - h[k]["data_offsets"][0] for k in order}
        self.total = sum(size.values())
        self.shards = [[]]
        forced = False
        run = 0
        for i, k in enumerate(order):
            self.shards[-1].append(k)
            run += size[k]
            tensors_left, shards_left = len(order) - i - 1, shards - len(self.shards)
            if shards_left > 0:
                if run * shards >= len(self.shards) * self.total:
                    self.shards.append([])
                elif tensors_left == shards_left:
                    forced = True
                    self.shards.append([])
        # the model is chosen so that no cut is forced (the forcing rule is not what is tested here)
        assert not forced and len(self.shards) == shards and all(self.shards), self.shards
        self.S = shards
        self.size = size
        self.f32 = {k for k in order if h[k]["dtype"] == "F32"}
        self.files = [f"model-{i + 1:05d}-of-{shards:05d}.safetensors" for i in range(shards)]
        self.momentum_files = [f"shard-{i + 1:05d}-of-{shards:05d}.safetensors" for i in range(shards)]

    def weight_map(self):
        return {k: self.files[i] for i, names in enumerate(self.shards) for k in names}

    def shard_bytes(self, i):
        return sum(self.size[k] for k in self.shards[i])

    def shard_f32_bytes(self, i):
        return sum(self.size[k] for k in self.shards[i] if k in self.f32)

    def shard_read_bytes(self, i, nodes, momentum):
        """What a shard's work reads: the deltas' ranges, the previous global's, the momentum's."""
        return nodes * self.shard_f32_bytes(i) + self.shard_bytes(i) + (self.shard_f32_bytes(i) if momentum else 0)

    def f32_bytes(self):
        return sum(self.size[k] for k in self.f32)


def describe_diff(a: bytes, b: bytes) -> str:
    """Where two safetensors files differ: header (which fields), tensors (which), or padding."""
    ha, hb = (int.from_bytes(x[:8], "little") for x in (a, b))
    ja, jb = json.loads(a[8:8 + ha]), json.loads(b[8:8 + hb])
    out = []
    if ja != jb:
        keys = sorted(set(ja) | set(jb))
        out.append("header entries differ: " + ", ".join(f"{k}: {ja.get(k)} vs {jb.get(k)}" for k in keys
                                                          if ja.get(k) != jb.get(k))[:1500])
    elif a[8:8 + ha] != b[8:8 + hb]:
        out.append(f"the same header, other JSON text:\n{a[8:8 + ha][:600]!r}\n{b[8:8 + hb][:600]!r}")
    ta, tb = st_torch_load(a), st_torch_load(b)
    differ = [k for k in sorted(set(ta) & set(tb))
              if ta[k].dtype != tb[k].dtype or ta[k].shape != tb[k].shape or
              not torch.equal(ta[k].reshape(-1).view(torch.uint8), tb[k].reshape(-1).view(torch.uint8))]
    out.append(f"tensors whose bytes differ: {differ}" if differ else "every tensor's bytes equal")
    return "; ".join(out)


def tensors_of(deltas):
    return {n: {k: torch.from_numpy(v) for k, v in t.items()} for n, t in deltas.items()}


def copy_state(state):
    return {k: v.clone() for k, v in state.items()}


def oracle_for(init):
    """torch's outer steps from init (a copy: Oracle's F32 parameters share an F32 tensor's storage, and
    its steps would change init itself)."""
    return Oracle(copy_state(init), lr=LR, momentum=MOMENTUM, nesterov=True)


# ---------------------------------------------------------------------------------------------------
# the bucket

class Bucket:
    """The objects under one prefix of the SeaweedFS bucket (boto3, as workers and readers see them)."""

    def __init__(self, s3: SeaweedS3, prefix: str):
        self.s3 = s3
        self.name = s3.bucket
        self.prefix = prefix
        self.c = s3.client()

    def key(self, rel):
        return f"{self.prefix}/{rel}"

    def put(self, rel, body):
        self.c.put_object(Bucket=self.name, Key=self.key(rel), Body=body)

    def get(self, rel) -> bytes:
        return self.c.get_object(Bucket=self.name, Key=self.key(rel))["Body"].read()

    def get_or_none(self, rel):
        try:
            return self.get(rel)
        except Exception:
            return None

    def exists(self, rel) -> bool:
        try:
            self.c.head_object(Bucket=self.name, Key=self.key(rel))
            return True
        except Exception:
            return False

    def listing(self, skip_nodes=True) -> dict:
        """{relative key: (ETag, size, Last-Modified)} of every object under the prefix (nodes/ left
        out unless skip_nodes is false)."""
        out = {}
        for page in self.c.get_paginator("list_objects_v2").paginate(Bucket=self.name, Prefix=self.prefix + "/"):
            for o in page.get("Contents", []):
                rel = o["Key"][len(self.prefix) + 1:]
                if skip_nodes and rel.startswith("nodes/"):
                    continue
                out[rel] = (o["ETag"], o["Size"], o["LastModified"])
        return out

    def step_count(self):
        raw = self.get_or_none("global/step_count.json")
        try:
            return json.loads(raw) if raw is not None else None
        except ValueError:
            return None

    def published_step(self):
        sc = self.step_count()
        return sc.get("outer_step") if isinstance(sc, dict) else None

    def claim(self, step, shard):
        raw = self.get_or_none(f"global/steps/{step}/shard-{shard}.claim")
        try:
            return json.loads(raw) if raw is not None else None
        except ValueError:
            return {"unparsable": raw}


def publish_step0(bucket: Bucket, init: dict) -> bytes:
    """Step 0 as the Python reference publishes it: global/latest.safetensors and step_count.json."""
    raw = st_torch_save({k: v.contiguous() for k, v in init.items()})
    bucket.put("global/latest.safetensors", raw)
    step_count = {"algorithm": "dumb_diloco", "model_file": "global/latest.safetensors",
                  "optimizer": "nesterov_sgd", "outer_step": 0,
                  "updated_at": datetime.now(timezone.utc).isoformat(timespec="seconds")}
    bucket.put("global/step_count.json", json.dumps(step_count, indent=2).encode())
    return raw


def local_step(step):
    """The workers' local step of round step (same digit count every round: equal delta sizes)."""
    return 100 * step


def upload_round(bucket: Bucket, deltas: dict, step: int, nodes=None):
    """The workers' pushes of round step (base step - 1)."""
    for node in sorted(nodes if nodes is not None else deltas):
        put_delta(bucket.c, bucket.name, bucket.prefix, node, step - 1, local_step(step), deltas[node])


class StepWatcher:
    """Polls global/step_count.json from its own thread and records every (outer_step, ETag) it sees:
    a step written twice (a second publisher, a zombie) shows as a second ETag of the same step."""

    def __init__(self, s3: SeaweedS3, prefix: str):
        self.client = s3.client()
        self.bucket = s3.bucket
        self.key = f"{prefix}/global/step_count.json"
        self.seen = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        while not self._stop.is_set():
            try:
                r = self.client.get_object(Bucket=self.bucket, Key=self.key)
                step = json.loads(r["Body"].read())["outer_step"]
                rec = (step, r["ETag"])
                if not self.seen or self.seen[-1] != rec:
                    self.seen.append(rec)
            except Exception:
                pass            # not there yet, or the server is restarting
            self._stop.wait(0.03)

    def stop(self):
        self._stop.set()
        self._thread.join(timeout=30)

    def check(self, steps):
        """step_count.json advanced once per step: never back, one ETag per step, every step seen."""
        seen = list(self.seen)
        for a, b in zip(seen, seen[1:]):
            assert b[0] >= a[0], f"step_count.json went back from {a[0]} to {b[0]}: {seen}"
        by_step = {}
        for step, etag in seen:
            by_step.setdefault(step, set()).add(etag)
        twice = {s: e for s, e in by_step.items() if len(e) > 1}
        assert not twice, f"step_count.json of a step was written more than once: {twice} (sequence {seen})"
        assert set(steps) <= set(by_step), f"steps {sorted(set(steps) - set(by_step))} never seen: {seen}"


# ---------------------------------------------------------------------------------------------------
# the aggregators

class ClusterDilocod(S3Dilocod):
    """dilocod --hub s3://<bucket>/<prefix> --cluster-shards S --cluster-lease L with its own --id and
    --state-root, logs under <tmp>/<id>/."""

    def __init__(self, tmp, s3: SeaweedS3, prefix, agg_id, shards, lease, *args, env=None, nodes=len(NODES)):
        d = Path(tmp) / agg_id
        d.mkdir(parents=True, exist_ok=True)
        super().__init__(d, s3, prefix, *args, env=env, state_root=d / "state")
        self.agg_id = agg_id
        self.shards = shards
        self.lease = lease
        self.nodes = nodes
        self._port = None
        self.http = requests.Session()
        self.http.trust_env = False

    @property
    def state_dir(self) -> Path:
        return self.state_root / self.agg_id

    def start(self, *extra):
        log = self.tmp / f"dilocod-{len(self.logs)}.log"
        self.logs.append(log)
        self._port = None
        cmd = [str(BUILD / "dilocod"), "--state-root", str(self.state_root), "--id", self.agg_id,
               "--hub", f"s3://{self.s3.bucket}/{self.prefix}", "--hub-endpoint", self.s3.endpoint,
               "--listen", "127.0.0.1:0", "--poll-interval", "0.2", "--retry-interval", "0.5",
               "--log-level", "debug", "--mode", "sync", "--aggregate", "mean", "--optimizer", "nesterov_sgd",
               "--lr", str(LR), "--momentum", str(MOMENTUM), "--expected-nodes", str(self.nodes),
               "--cluster-shards", str(self.shards), "--cluster-lease", str(self.lease), *self.args, *extra]
        env = dict(os.environ, **(self.env or {}))
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=open(log, "wb"), env=env)
        return self

    @property
    def port(self) -> int:
        """The HTTP port of the last start (the base class reads it from the log), looked up once."""
        if self._port is None:
            self._port = Dilocod.port.fget(self)
        return self._port

    def cluster(self, timeout=2.0):
        """/status's "cluster" object, or None while it cannot be read."""
        try:
            doc = self.http.get(f"{self.url}/status", timeout=timeout).json()
        except Exception:
            return None
        return doc.get("cluster") if isinstance(doc, dict) else None

    def shard_entry(self, cl, shard):
        for e in (cl or {}).get("per_shard") or ():
            if e.get("shard") == shard:
                return e
        return None

    def tail(self, n=3500):
        return self.log_text()[-n:]


class Cluster:
    """K ClusterDilocods on one prefix, the bucket, and waits that fail with every log's tail."""

    def __init__(self, tmp, s3: SeaweedS3, prefix, shards, lease):
        self.tmp = Path(tmp)
        self.s3 = s3
        self.prefix = prefix
        self.shards = shards
        self.lease = lease
        self.bucket = Bucket(s3, prefix)
        self.procs = {}
        self.gone = set()       # killed on purpose
        self.paused = set()     # SIGSTOPped on purpose

    def add(self, agg_id, env=None, start=True) -> ClusterDilocod:
        d = ClusterDilocod(self.tmp, self.s3, self.prefix, agg_id, self.shards, self.lease, env=env)
        self.procs[agg_id] = d
        if start:
            d.start()
        return d

    def live(self):
        return [d for i, d in self.procs.items() if i not in self.gone and i not in self.paused]

    def logs(self, n=3500):
        parts = []
        for i, d in self.procs.items():
            state = "killed" if i in self.gone else "stopped" if i in self.paused else \
                "alive" if d.alive() else f"exited {d.proc.returncode if d.proc else '?'}"
            parts.append(f"===== {i} ({state}) log tail =====\n{d.tail(n)}")
        try:
            listing = sorted(self.bucket.listing())
        except Exception as e:
            listing = f"(listing failed: {e})"
        parts.append(f"===== bucket {self.prefix}/ (nodes/ left out) =====\n{listing}")
        return "\n".join(parts)

    def fail(self, msg):
        raise AssertionError(f"{msg}\n{self.logs()}")

    def check_alive(self):
        for d in self.live():
            if not d.alive():
                self.fail(f"{d.agg_id} exited with {d.proc.returncode if d.proc else '?'}")

    def wait(self, pred, what, timeout, interval=0.05):
        deadline = time.time() + timeout
        while True:
            self.check_alive()
            got = pred()
            if got:
                return got
            if time.time() >= deadline:
                self.fail(f"timed out after {timeout}s waiting for {what}")
            time.sleep(interval)

    def statuses(self, procs=None):
        return {d.agg_id: d.cluster() for d in (procs if procs is not None else self.live())}

    def wait_ready(self, procs=None, step=0, timeout=30):
        """Every aggregator's /status shows cluster mode on the bucket's step."""
        procs = procs if procs is not None else self.live()

        def ready():
            sts = self.statuses(procs)
            return all(isinstance(c, dict) and c.get("published_step") == step and
                       c.get("state") not in (None, "waiting_for_global") for c in sts.values()) and sts
        sts = self.wait(ready, f"{[d.agg_id for d in procs]} ready at step {step}", timeout)
        for i, c in sts.items():
            assert c["shards"] == self.shards and c["lease_s"] == self.lease, (i, c)
            assert c["instance"].startswith(f"{i}-") and re.fullmatch(r"[0-9a-fA-F]+", c["instance"][len(i) + 1:]), \
                (i, c["instance"])
        return sts

    def wait_published(self, step, timeout):
        """Waits until the bucket's step_count.json names step (or later) -> the time it was seen."""
        self.wait(lambda: (self.bucket.published_step() or 0) >= step, f"step {step} published in the bucket",
                  timeout)
        return time.time()

    def publishes(self, procs=None):
        sts = self.statuses(procs)
        missing = [i for i, c in sts.items() if not isinstance(c, dict)]
        if missing:
            self.fail(f"/status of {missing} unreadable")
        return {i: c["publishes"] for i, c in sts.items()}

    def wait_publishes(self, total, procs=None, timeout=15):
        """The aggregators' /status publishes add up to total (a publisher counts its step once it is
        done): one publisher per step."""
        def counted():
            sts = self.statuses(procs)
            if not all(isinstance(c, dict) for c in sts.values()):
                return None
            n = sum(c["publishes"] for c in sts.values())
            if n > total:
                self.fail(f"{n} publishes counted for {total} steps: {({i: c['publishes'] for i, c in sts.items()})}")
            return sts if n == total else None
        return self.wait(counted, f"{total} publishes counted in /status", timeout)

    def stop(self):
        for i, d in self.procs.items():
            if d.proc is None:
                continue
            try:
                d.proc.send_signal(signal.SIGCONT)
            except ProcessLookupError:
                pass
            try:
                d.stop(timeout=15)
            except subprocess.TimeoutExpired:
                d.kill9()


def read_published(cluster: Cluster, plan: Plan, step: int):
    """The bucket's published global: step_count.json -> model_file -> its index -> its shards (boto3)
    -> ({name: tensor}, {file: raw bytes}, index text)."""
    b = cluster.bucket
    sc = b.step_count()
    if not isinstance(sc, dict) or sc.get("outer_step") != step:
        cluster.fail(f"step_count.json is {sc}, expected outer_step {step}")
    want = {"algorithm": "dumb_diloco", "optimizer": "nesterov_sgd", "outer_step": step,
            "model_file": f"global/steps/{step}/{INDEX}"}
    assert {k: sc.get(k) for k in want} == want and "updated_at" in sc, sc
    index_raw = b.get(sc["model_file"])
    index = json.loads(index_raw)
    assert index["weight_map"] == plan.weight_map(), \
        f"the index's weight_map is not the spec's plan:\n{index['weight_map']}\nplan: {plan.shards}"
    assert index["metadata"]["total_size"] == plan.total, (index["metadata"], plan.total)
    raw = {f: b.get(f"global/steps/{step}/{f}") for f in plan.files}
    state = {}
    for i, f in enumerate(plan.files):
        st = st_torch_load(raw[f])
        assert sorted(st) == sorted(plan.shards[i]), (f, sorted(st), sorted(plan.shards[i]))
        state.update(st)
    return state, raw, index_raw


def check_exact(cluster, plan, step, oracle_state):
    got, raw, _ = read_published(cluster, plan, step)
    try:
        assert_state_equal(got, oracle_state)
    except AssertionError as e:
        cluster.fail(f"step {step}'s published global differs from torch's: {e}")
    return raw


def check_published_marker(cluster, step):
    if not cluster.bucket.exists(f"global/steps/{step}/published"):
        cluster.fail(f"global/steps/{step}/published missing after step {step} was published")


def expected_keys(plan: Plan, last: int, momentum=True):
    """What the spec's garbage collection leaves after last (>= 2) was published (nodes/ left out)."""
    keep = {"global/latest.safetensors", "global/step_count.json"}
    keep |= {f"global/steps/{last - 1}/{f}" for f in plan.files + [INDEX]}
    control = ["manifest.json", "published"] + [f"shard-{i}.claim" for i in range(plan.S)] + \
        [f"shard-{i}.done" for i in range(plan.S)]
    keep |= {f"global/steps/{last}/{f}" for f in plan.files + [INDEX] + control}
    if momentum:
        keep |= {f"state/momentum/{last}/{f}" for f in plan.momentum_files}
    return keep


def wait_gc(cluster, plan, last, timeout=20):
    want = expected_keys(plan, last)
    got = {}

    def done():
        got.clear()
        got.update(cluster.bucket.listing())
        # the last step's members (join-<instance>, one per aggregator that took part) stay with its control objects
        joins = {k for k in got if k.startswith(f"global/steps/{last}/join-")}
        return set(got) - joins == want and 1 <= len(joins) <= len(cluster.procs)
    try:
        cluster.wait(done, f"the bucket to hold exactly what the GC rule leaves after step {last}", timeout)
    except AssertionError as e:
        raise AssertionError(f"orphans: {sorted(set(got) - want)}\nmissing: {sorted(want - set(got))}\n{e}") from None
    uploads = cluster.bucket.c.list_multipart_uploads(Bucket=cluster.bucket.name, Prefix=cluster.prefix + "/")
    assert not uploads.get("Uploads"), uploads.get("Uploads")


def read_momentum(cluster, plan, step):
    state = {}
    for i, f in enumerate(plan.momentum_files):
        st = st_torch_load(cluster.bucket.get(f"state/momentum/{step}/{f}"))
        assert sorted(st) == sorted(k for k in plan.shards[i] if k in plan.f32), (f, sorted(st))
        state.update(st)
    return state


def run_round(cluster, plan, oracle, deltas, step, timeout=30):
    """Uploads round step's deltas, waits for its publish, checks it against torch -> the shards' bytes."""
    upload_round(cluster.bucket, deltas, step)
    cluster.wait_published(step, timeout)
    oracle.step(tensors_of(deltas))
    raw = check_exact(cluster, plan, step, oracle.state)
    check_published_marker(cluster, step)
    return raw


def wait_held(cluster, d, step, shard, timeout=20):
    """Waits until d holds shard of step: the claim object names its instance (read from the bucket, which
    answers while d's threads are stalled) -> the claim."""
    instance = {}

    def held():
        if "id" not in instance:
            c = d.cluster()
            if c:
                instance["id"] = c["instance"]
            return None
        claim = cluster.bucket.claim(step, shard)
        return claim if isinstance(claim, dict) and claim.get("instance") == instance["id"] else None
    return cluster.wait(held, f"{d.agg_id} to claim shard {shard} of step {step}", timeout)


# ---------------------------------------------------------------------------------------------------
# 1. K=3 == K=1 == torch

def check_cluster_rounds(d, all_deltas):
    """d's /rounds: step r's record (base r) lists round r's deltas by node, their local steps, sizes and
    L2 norms (numpy's, in double), reason cluster; no step twice."""
    recs = d.rounds()
    assert [r["step"] for r in recs] == list(range(len(all_deltas))), (d.agg_id, [r["step"] for r in recs])
    for r in recs:
        deltas = all_deltas[r["step"]]
        assert r["reason"] == "cluster" and r["outer_step"] == r["step"] + 1 and r["aggregate"] == "mean", r
        assert sorted(n["node_id"] for n in r["nodes"]) == sorted(deltas), r
        for n in r["nodes"]:
            assert n["local_step"] == local_step(r["step"] + 1) and n["bytes"] > 0, n
            want = math.sqrt(sum(float(np.sum(np.abs(np.asarray(v.numpy() if isinstance(v, torch.Tensor) else v)
                                                     .astype(np.complex128)) ** 2))
                                 for v in deltas[n["node_id"]].values()))
            assert math.isclose(n["norm"], want, rel_tol=1e-6), (d.agg_id, r["step"], n, want)
        assert r["bytes"] == sum(n["bytes"] for n in r["nodes"]), r


def check_cluster_pipeline(procs, rounds):
    """The cluster's steps in the one pipeline (core/pipeline.h, the table's cluster column): on every member
    /status pipeline[] holds the next step collecting and the steps before it cleaned (published, recorded,
    left behind), and /metrics' per-state histogram counts each step's time in cluster_manifest and
    cluster_shards on every member, in cluster_publish on whoever published it; no move was refused."""
    publishes = 0
    for d in procs:
        st = d.http.get(f"{d.url}/status", timeout=10).json()
        by_step = {p["step"]: p["state"] for p in st["pipeline"]}
        assert by_step.get(rounds + 1) == "collecting", (d.agg_id, st["pipeline"])
        assert all(state == "cleaned" for step, state in by_step.items() if 1 <= step <= rounds), (d.agg_id, by_step)
        assert sum(1 for step in by_step if 1 <= step <= rounds) >= min(rounds, 3), (d.agg_id, by_step)
        text = d.http.get(f"{d.url}/metrics", timeout=10).text
        count = {m.group(1): int(m.group(2)) for m in
                 re.finditer(r'^dilocod_pipeline_state_seconds_count\{state="([a-z_]+)"\} (\d+)$', text, re.M)}
        assert count["cluster_manifest"] >= rounds and count["cluster_shards"] >= rounds, (d.agg_id, count)
        assert count["published"] >= rounds and count["durable"] >= rounds, (d.agg_id, count)
        assert count["computing"] == 0, (d.agg_id, count)             # no local pass ran
        assert re.search(r"^dilocod_pipeline_illegal_transitions_total 0$", text, re.M), d.agg_id
        publishes += count["cluster_publish"]
    assert publishes >= rounds, publishes


def test_k3_equals_k1_and_torch(tmp_path, s3):
    S, rounds = 6, 3
    init = cluster_model(1)
    rng = np.random.default_rng(2601)
    all_deltas = [{n: random_deltas(rng, init) for n in NODES} for _ in range(rounds)]

    def run(prefix, ids):
        cl = Cluster(tmp_path / prefix.replace("/", "-"), s3, prefix, S, 10)
        raw0 = publish_step0(cl.bucket, init)
        plan = Plan(raw0, S)
        watcher = StepWatcher(s3, prefix)
        oracle = oracle_for(init)
        states, shard_bytes = {}, {}
        try:
            for i in ids:
                cl.add(i)
            cl.wait_ready()
            for r in range(rounds):
                step = r + 1
                shard_bytes[step] = run_round(cl, plan, oracle, all_deltas[r], step)
                states[step] = copy_state(oracle.state)
                cl.wait_publishes(step)
            wait_gc(cl, plan, rounds)
            momentum = read_momentum(cl, plan, rounds)
            try:
                assert_state_equal(momentum, oracle.momentum())
            except AssertionError as e:
                cl.fail(f"state/momentum/{rounds}/ differs from torch's momentum buffers: {e}")
            cl.wait_publishes(rounds)
            sts = cl.wait(lambda: (lambda sts: sts if all(isinstance(c, dict) and c.get("published_step") == rounds and
                                                          c.get("state") == "collecting" for c in sts.values())
                                   else None)(cl.statuses()),
                          f"every aggregator to see step {rounds} published and collect the next round", 15)
            watcher.stop()
            watcher.check(range(rounds + 1))
            return cl, plan, states, shard_bytes, momentum, sts
        except BaseException:
            watcher.stop()
            cl.stop()
            raise

    cl3, plan, states, shards3, momentum3, sts = run("cluster/k3", ["agg-a", "agg-b", "agg-c"])
    try:
        # the work was shared: every shard of every step done once, each aggregator about a third of it
        done = {i: c["shards_done"] for i, c in sts.items()}
        assert sum(done.values()) == S * rounds, done
        assert sum(c["takeovers"] for c in sts.values()) == 0, {i: c["takeovers"] for i, c in sts.items()}
        read = {i: c["bytes_read"] for i, c in sts.items()}
        total = sum(read.values())
        worth = max(plan.shard_read_bytes(i, len(NODES), True) for i in range(S))
        minimum = rounds * len(NODES) * plan.f32_bytes()
        full = rounds * (len(NODES) * plan.f32_bytes() + plan.total) + (rounds - 1) * plan.f32_bytes()
        assert minimum <= total <= 2 * full + 65536 * rounds * len(NODES) * 3, (read, minimum, full)
        # (checked last, below: which aggregator claims what is a race of their polls)
        unbalanced = [f"{i} read {n} bytes, not a third of {total} within one shard's {worth}"
                      for i, n in read.items() if abs(n - total / 3) > worth]
        for i, c in sts.items():
            assert c["published_step"] == rounds and c.get("last_error") in (None, ""), (i, c)
        # in cluster mode uploads are refused and the global is not served
        d = cl3.procs["agg-a"]
        body = st_save_bytes(all_deltas[0]["w1"], metadata=delta_metadata("w1", rounds, 999))
        # a fresh connection each (the status session's may have been closed idle by the server meanwhile)
        fresh = requests.Session()
        fresh.trust_env = False
        r = fresh.post(f"{d.url}/nodes/w1/deltas", data=body, timeout=10, headers={"Connection": "close"})
        assert r.status_code == 409, (r.status_code, r.text)
        # refused before its body was read: the server says it closes (a client must not reuse the connection)
        r = d.http.post(f"{d.url}/nodes/w1/deltas", data=body, timeout=10)
        assert r.status_code == 409 and r.headers.get("Connection") == "close", (r.status_code, r.headers)
        r = fresh.put(f"{d.url}/nodes/w1/delta_999.safetensors", data=body, timeout=10, headers={"Connection": "close"})
        assert r.status_code == 409, (r.status_code, r.text)
        r = fresh.get(f"{d.url}/global/latest.safetensors", timeout=10, headers={"Connection": "close"})
        assert r.status_code == 404 and r.text, (r.status_code, r.text)
        # huggingface_hub loads the step's directory (index + shards) into a module: torch's weights
        from huggingface_hub import load_torch_model
        for step in (rounds - 1, rounds):
            out = tmp_path / f"hf-step-{step}"
            out.mkdir()
            for f in plan.files + [INDEX]:
                (out / f).write_bytes(cl3.bucket.get(f"global/steps/{step}/{f}"))
            module = module_for(init)
            load_torch_model(module, str(out), strict=True)
            assert_state_equal(dict(module.state_dict()), states[step])
        for d in cl3.procs.values():
            assert d.alive(), cl3.logs()
        # /rounds on every member: each step it saw published, as a local round's record (the manifest's
        # nodes and local steps, their bytes and whole norms, the rule); kept in rounds.jsonl across a restart
        for d in cl3.procs.values():
            cl3.wait(lambda: len(d.rounds()) == rounds, f"{d.agg_id}'s /rounds holding {rounds} steps", 20)
            check_cluster_rounds(d, all_deltas)
        check_cluster_pipeline(cl3.procs.values(), rounds)
        d = cl3.procs["agg-b"]
        d.stop()
        d.start()
        cl3.wait(lambda: d.cluster() is not None, "agg-b back", 20)
        check_cluster_rounds(d, all_deltas)
    finally:
        cl3.stop()

    # the same deltas through one cluster dilocod: the same bytes, shard by shard
    cl1, plan1, states1, shards1, momentum1, sts1 = run("cluster/k1", ["solo"])
    try:
        assert plan1.shards == plan.shards
        assert sts1["solo"]["shards_done"] == S * rounds, sts1
        for step in range(1, rounds + 1):
            for f in plan.files:
                assert shards1[step][f] == shards3[step][f], \
                    f"step {step} {f}: K=1 and K=3 bytes differ: {describe_diff(shards1[step][f], shards3[step][f])}"
        for f in plan.momentum_files:
            a = cl1.bucket.get(f"state/momentum/{rounds}/{f}")
            b = Bucket(s3, "cluster/k3").get(f"state/momentum/{rounds}/{f}")
            assert a == b, f"state/momentum/{rounds}/{f}: K=1 and K=3 bytes differ: {describe_diff(a, b)}"
    finally:
        cl1.stop()
    # each of the K=3 aggregators did about a third of the work (bytes read)
    assert not unbalanced, f"{unbalanced}: {read} (shards done {done})"


# ---------------------------------------------------------------------------------------------------
# 2. kill -9 of a shard's holder

def test_kill9_holder_is_taken_over(tmp_path, s3):
    S, lease, X = 6, 2, 1
    prefix = "cluster/kill9"
    init = cluster_model(2)
    cl = Cluster(tmp_path, s3, prefix, S, lease)
    plan = Plan(publish_step0(cl.bucket, init), S)
    oracle = oracle_for(init)
    rng = np.random.default_rng(2602)
    watcher = StepWatcher(s3, prefix)
    try:
        # the stalling aggregator alone first, so that it is the one that claims shard X
        a = cl.add("agg-a", env={"DILOCOD_TEST_CLUSTER_STALL": str(X)})
        cl.wait_ready()
        deltas = {n: random_deltas(rng, init) for n in NODES}
        upload_round(cl.bucket, deltas, 1)
        wait_held(cl, a, 1, X)
        b, c = cl.add("agg-b"), cl.add("agg-c")
        cl.wait_ready([b, c])
        st_a = a.cluster()
        if st_a is not None:        # its loop answers: /status says it holds X
            assert X in st_a["held"], st_a
        assert cl.bucket.published_step() == 0, "step 1 published while its shard is held by a stalled process"
        a.kill9()
        cl.gone.add("agg-a")
        cl.wait_published(1, lease + 30)
        oracle.step(tensors_of(deltas))
        check_exact(cl, plan, 1, oracle.state)
        check_published_marker(cl, 1)
        sts = cl.wait_publishes(1)
        assert max(s["takeovers"] for s in sts.values()) >= 1, sts
        survivors = {s["instance"] for s in sts.values()}
        claim = cl.bucket.claim(1, X)
        assert isinstance(claim, dict) and claim.get("instance") in survivors, (claim, survivors)
        # the two survivors go on
        run_round(cl, plan, oracle, {n: random_deltas(rng, init) for n in NODES}, 2)
        cl.wait_publishes(2)
        watcher.stop()
        watcher.check([0, 1, 2])
    finally:
        watcher.stop()
        cl.stop()


# ---------------------------------------------------------------------------------------------------
# 3. a SIGSTOPped holder past its lease (a zombie)

def test_sigstop_zombie(tmp_path, s3):
    S, lease, X = 6, 2, 1
    prefix = "cluster/zombie"
    init = cluster_model(3)
    cl = Cluster(tmp_path, s3, prefix, S, lease)
    plan = Plan(publish_step0(cl.bucket, init), S)
    oracle = oracle_for(init)
    rng = np.random.default_rng(2603)
    watcher = StepWatcher(s3, prefix)
    try:
        a = cl.add("agg-a", env={"DILOCOD_TEST_CLUSTER_STALL_AFTER_PASS": str(X)})
        cl.wait_ready()
        deltas = {n: random_deltas(rng, init) for n in NODES}
        upload_round(cl.bucket, deltas, 1)
        wait_held(cl, a, 1, X)
        # SIGSTOP it inside its 2 s stall, after it computed shard X and before it wrote anything
        cl.wait(lambda: re.search(rf"test hook: pausing after the pass shard={X}\b", a.log_text()),
                f"agg-a to compute shard {X} and pause (its test hook)", 15, interval=0.01)
        assert cl.bucket.published_step() == 0
        os.kill(a.proc.pid, signal.SIGSTOP)
        stopped = time.time()
        cl.paused.add("agg-a")
        b, c = cl.add("agg-b"), cl.add("agg-c")
        cl.wait_ready([b, c])
        cl.wait_published(1, lease + 30)
        oracle.step(tensors_of(deltas))
        check_exact(cl, plan, 1, oracle.state)
        check_published_marker(cl, 1)
        sts = cl.wait_publishes(1, [b, c])
        assert max(s["takeovers"] for s in sts.values()) >= 1, sts
        # stopped past 3 leases, then continued: the zombie changes nothing
        cl.wait(lambda: time.time() >= stopped + 3 * lease, "3 leases since SIGSTOP", 3 * lease + 5)
        before = cl.bucket.listing()
        sc_before = cl.bucket.get("global/step_count.json")
        os.kill(a.proc.pid, signal.SIGCONT)
        cl.paused.discard("agg-a")

        def zombie_noticed():
            st = a.cluster()
            if not st or (st.get("published_step") or 0) < 1 or X in (st.get("held") or []):
                return None
            e = a.shard_entry(st, X)
            return st if e is None or e.get("state") != "ours" else None
        st_a = cl.wait(zombie_noticed, "agg-a, continued, to see step 1 published and drop shard X", 20)
        assert st_a["publishes"] == 0, st_a
        deadline = time.time() + 3       # a bounded look for late writes of the zombie
        while time.time() < deadline:
            now = cl.bucket.listing()
            if now != before:
                changed = {k: (before.get(k), now.get(k)) for k in set(before) | set(now)
                           if before.get(k) != now.get(k)}
                cl.fail(f"the zombie (or someone) changed the bucket after SIGCONT: {changed}")
            time.sleep(0.2)
        assert cl.bucket.get("global/step_count.json") == sc_before
        check_exact(cl, plan, 1, oracle.state)
        # the next round, all three alive, publishes once
        run_round(cl, plan, oracle, {n: random_deltas(rng, init) for n in NODES}, 2)
        cl.wait_publishes(2)
        watcher.stop()
        watcher.check([0, 1, 2])
    finally:
        watcher.stop()
        cl.stop()


# ---------------------------------------------------------------------------------------------------
# 4. the S3 server restarts mid round

def restart_s3(server: SeaweedS3):
    """Stops SeaweedFS and starts it again on the same directory and ports (its log is kept)."""
    stop_s3(server)
    if server.log_path.exists():
        n = len(list(server.tmp.glob("seaweedfs-*.log")))
        server.log_path.rename(server.tmp / f"seaweedfs-{n}.log")
    server.start()


def test_s3_restart_mid_round(tmp_path):
    S, lease, X = 6, 10, 2
    prefix = "cluster/restart"
    server = SeaweedS3(tmp_path / "s3").start()
    cl = Cluster(tmp_path, server, prefix, S, lease)
    watcher = None
    try:
        init = cluster_model(4)
        plan = Plan(publish_step0(cl.bucket, init), S)
        oracle = oracle_for(init)
        rng = np.random.default_rng(2604)
        watcher = StepWatcher(server, prefix)
        # whoever claims shard X stalls 2 s after computing it: the round is surely in flight then
        env = {"DILOCOD_TEST_CLUSTER_STALL_AFTER_PASS": str(X)}
        for i in ("agg-a", "agg-b", "agg-c"):
            cl.add(i, env=env)
        cl.wait_ready()
        deltas = {n: random_deltas(rng, init) for n in NODES}
        upload_round(cl.bucket, deltas, 1)
        cl.wait(lambda: cl.bucket.exists(f"global/steps/1/shard-{X}.claim"), f"shard {X} of step 1 claimed", 20,
                interval=0.02)
        assert cl.bucket.published_step() == 0, "step 1 published before the restart: the test hook did not stall"
        restart_s3(server)
        cl.wait_published(1, 45)
        oracle.step(tensors_of(deltas))
        check_exact(cl, plan, 1, oracle.state)
        check_published_marker(cl, 1)
        cl.wait_publishes(1)
        run_round(cl, plan, oracle, {n: random_deltas(rng, init) for n in NODES}, 2)
        cl.wait_publishes(2)
        watcher.stop()
        watcher.check([0, 1, 2])
    finally:
        if watcher is not None:
            watcher.stop()
        cl.stop()
        stop_s3(server)


# ---------------------------------------------------------------------------------------------------
# 5. a bucket writer's planted control objects

def wait_refused(cl, step, timeout=20):
    """Every aggregator refuses the step's manifest: /status says so, its log names the manifest."""
    def refused():
        sts = cl.statuses()
        ok = all(isinstance(c, dict) and (c.get("state") == "refused" or
                                          "manifest" in (c.get("last_error") or "").lower())
                 for c in sts.values())
        return sts if ok else None
    sts = cl.wait(refused, f"every aggregator to refuse step {step}'s planted manifest", timeout)
    for d in cl.live():
        lines = [ln for ln in d.log_text().splitlines()
                 if "manifest" in ln.lower() and re.search(r"\b(warn|error)\b", ln)]
        if not lines:
            cl.fail(f"{d.agg_id} logged no warning or error naming the manifest")
    return sts


def assert_not_published(cl, step, manifest_body, hold=2.0):
    """For hold seconds: step is not published, nothing of its global is written, the planted manifest
    stays as planted (a bounded look: the refusal is a state, this checks it holds)."""
    deadline = time.time() + hold
    while True:
        cl.check_alive()
        assert cl.bucket.published_step() == step - 1, cl.logs()
        names = [k for k in cl.bucket.listing() if k.startswith(f"global/steps/{step}/")]
        bad = [k for k in names if k.endswith("published") or "/model" in k]
        if bad:
            cl.fail(f"step {step} objects written despite the refused manifest: {bad}")
        assert cl.bucket.get(f"global/steps/{step}/manifest.json") == manifest_body
        if time.time() >= deadline:
            return
        time.sleep(0.2)


def forge_manifest(real: bytes, old_step, new_step, old_keys: dict, new_keys: dict, etags: dict):
    """A step's manifest made from a real one of another step: its keys renamed to the new round's
    deltas, each ETag replaced by one that matches no object -> (body, ETags replaced)."""
    doc = json.loads(real)
    count = [0]
    bogus = {}
    for node, etag in etags.items():
        bare = etag.strip('"')
        bogus[bare] = "0123456789abcdef0123456789abcdef" if bare != "0123456789abcdef0123456789abcdef" else "f" * 32

    def walk(v, key=None):
        if isinstance(v, dict):
            return {k: walk(x, k) for k, x in v.items()}
        if isinstance(v, list):
            return [walk(x) for x in v]
        if isinstance(v, str):
            for bare, fake in bogus.items():
                if bare in v:
                    count[0] += 1
                    v = v.replace(bare, fake)
            for node, k in old_keys.items():
                v = v.replace(k, new_keys[node])
            if key in ("outer_step", "step", "base_outer_step") and v == str(old_step):
                v = str(new_step)
            return v
        if isinstance(v, int) and not isinstance(v, bool):
            if key in ("outer_step", "step") and v == old_step:
                return new_step
            if key in ("base_outer_step", "base_step") and v == old_step - 1:
                return new_step - 1
            if key == "local_step" and v == local_step(old_step):
                return local_step(new_step)
        return v
    return json.dumps(walk(doc)).encode(), count[0]


def test_planted_manifest_is_refused(tmp_path, s3):
    S, lease = 6, 10
    init = cluster_model(5)
    rng = np.random.default_rng(2605)
    ids = ("agg-a", "agg-b", "agg-c")
    # (a) garbage at global/steps/1/manifest.json before the round closes
    cl = Cluster(tmp_path / "garbage", s3, "cluster/manifest-garbage", S, lease)
    try:
        publish_step0(cl.bucket, init)
        for i in ids:
            cl.add(i)
        cl.wait_ready()
        garbage = b'{"outer_step": 1, "nodes": [{"key": "nodes/w1/delta_100.safe'
        cl.bucket.put("global/steps/1/manifest.json", garbage)
        upload_round(cl.bucket, {n: random_deltas(rng, init) for n in NODES}, 1)
        wait_refused(cl, 1)
        assert_not_published(cl, 1, garbage)
    finally:
        cl.stop()

    # (b) a well-formed manifest for step 2 whose ETags match no delta (made from step 1's real one): every
    # delta it names is not in the bucket in that version, as if each had been rewritten after the manifest.
    # Each is left out in turn (reason "changed", never "values"), the step collects again (issue 33: the
    # cluster never waits on the impossible), and step 2 is published from the deltas really uploaded, as
    # torch computes it; nothing is ever computed from the planted manifest, which stays as planted.
    cl = Cluster(tmp_path / "etag", s3, "cluster/manifest-etag", S, lease)
    try:
        plan = Plan(publish_step0(cl.bucket, init), S)
        oracle = oracle_for(init)
        for i in ids:
            cl.add(i)
        cl.wait_ready()
        run_round(cl, plan, oracle, {n: random_deltas(rng, init) for n in NODES}, 1)
        cl.wait_publishes(1)
        real = cl.bucket.get("global/steps/1/manifest.json")
        key = lambda n, s: f"nodes/{n}/delta_{local_step(s)}.safetensors"      # noqa: E731
        etags = {n: cl.bucket.c.head_object(Bucket=cl.bucket.name, Key=cl.bucket.key(key(n, 1)))["ETag"]
                 for n in NODES}
        forged, replaced = forge_manifest(real, 1, 2, {n: key(n, 1) for n in NODES}, {n: key(n, 2) for n in NODES},
                                          etags)
        assert replaced >= len(NODES), f"step 1's manifest does not show the deltas' ETags: {real[:2000]!r}"
        cl.bucket.put("global/steps/2/manifest.json", forged)
        deltas = {n: random_deltas(rng, init) for n in NODES}
        upload_round(cl.bucket, deltas, 2)
        cl.wait_published(2, 60)
        oracle.step(tensors_of(deltas))
        sc = cl.bucket.step_count()
        gen = len(NODES)             # one generation per node left out, then the round collected again
        assert sc["model_file"] == f"global/steps/2/model.g{gen}.safetensors.index.json", sc
        index = json.loads(cl.bucket.get(sc["model_file"]))
        state = {}
        for f in sorted(set(index["weight_map"].values())):
            state.update(st_torch_load(cl.bucket.get(f"global/steps/2/{f}")))
        assert_state_equal(state, oracle.state)
        assert cl.bucket.get("global/steps/2/manifest.json") == forged
        assert not any(k.startswith("global/steps/2/model-") for k in cl.bucket.listing())
        logs = "".join(d.log_text() for d in cl.procs.values())
        assert "reason=changed" in logs and "reason=values" not in logs, cl.logs()
    finally:
        cl.stop()


def test_planted_claim_waits_for_lease(tmp_path, s3):
    S, lease = 6, 2
    prefix = "cluster/planted-claim"
    init = cluster_model(6)
    cl = Cluster(tmp_path, s3, prefix, S, lease)
    plan = Plan(publish_step0(cl.bucket, init), S)
    oracle = oracle_for(init)
    rng = np.random.default_rng(2606)
    watcher = StepWatcher(s3, prefix)
    try:
        for i in ("agg-a", "agg-b", "agg-c"):
            cl.add(i)
        cl.wait_ready()
        planted = time.time()
        cl.bucket.put("global/steps/1/shard-0.claim", b"planted by a bucket writer: not a claim")
        deltas = {n: random_deltas(rng, init) for n in NODES}
        upload_round(cl.bucket, deltas, 1)
        seen = cl.wait_published(1, lease + 30)
        # honoured for about one lease after its write, then taken over (timed by the server's
        # Last-Modified against its Date, both in whole seconds: the age read can be up to 1 s above the true)
        assert seen - planted >= lease - 1.2, f"published {seen - planted:.2f}s after the planted claim"
        assert seen - planted <= lease + 15, f"published {seen - planted:.2f}s after the planted claim"
        oracle.step(tensors_of(deltas))
        check_exact(cl, plan, 1, oracle.state)
        check_published_marker(cl, 1)
        sts = cl.wait_publishes(1)
        assert sum(c["takeovers"] for c in sts.values()) >= 1, sts
        claim = cl.bucket.claim(1, 0)
        assert isinstance(claim, dict) and claim.get("instance") in {c["instance"] for c in sts.values()}, claim
        watcher.stop()
        watcher.check([0, 1])
    finally:
        watcher.stop()
        cl.stop()


# ---------------------------------------------------------------------------------------------------
# 6. an aggregator restarted between rounds takes part again from the bucket alone

def test_restarted_aggregator_takes_part_again(tmp_path, s3):
    S = 4
    prefix = "cluster/restarted"
    init = cluster_model(6)
    cl = Cluster(tmp_path, s3, prefix, S, 5)
    plan = Plan(publish_step0(cl.bucket, init), S)
    oracle = oracle_for(init)
    rng = np.random.default_rng(2606)
    try:
        a, b = cl.add("agg-a"), cl.add("agg-b")
        cl.wait_ready()
        run_round(cl, plan, oracle, {n: random_deltas(rng, init) for n in NODES}, 1)
        first = b.cluster()["instance"]
        # b stops (SIGTERM) and starts again on the same state root: a new instance, the bucket's step
        assert b.stop() == 0
        b.start()
        cl.wait_ready([b], step=1)
        assert b.cluster()["instance"] != first
        run_round(cl, plan, oracle, {n: random_deltas(rng, init) for n in NODES}, 2)
        sts = cl.wait(lambda: (lambda sts: sts if all(isinstance(c, dict) and c.get("published_step") == 2
                                                      for c in sts.values()) else None)(cl.statuses()),
                      "both aggregators to see step 2 published", 15)
        assert sts["agg-b"]["shards_done"] >= 1, sts       # it took part in step 2 (its own share first)
    finally:
        cl.stop()
