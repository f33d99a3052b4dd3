"""K aggregators over one bucket (README, "Scaling out"): a round's time and each aggregator's bytes, for one
plain s3:// dilocod (it stages whole deltas in cache/incoming, then runs the pass on local files) and for a
cluster of K = 1, 2, 3 dilocods with --cluster-shards S (ranged reads of each shard's byte ranges into the
pass), over the same deltas in a real S3 server (SeaweedFS) on loopback, run side by side in one run.  A
report, not a test: it asserts nothing.

A round is timed from the moment its last delta is in the bucket to the moment global/step_count.json names
the new step (polled every 20 ms): every delta is already there, so nothing of the transfer overlaps the
round's collection, the critical path of a round whose last worker is the slowest.  Each scenario runs
ROUNDS rounds on a prefix of its own; the median is reported.  On a 2-core machine every aggregator, the S3
server and the pass share the same two cores and the same loopback: what this shows is the bytes each
aggregator reads (1/K of the round's) and what a ranged-read pass costs against staging, not a speed-up in K.

With BENCH_SETS=N, two more scenarios run the cluster with every delta pushed as a sharded set of N
shards (the Hugging Face index + shards, the index last): K = 1 and K = 2 against the same deltas as single
files.

Usage: bench_cluster.py BUILD_DIR [MODEL_MIB]   (default 256; 24 F32 tensors, 4 nodes, S = 6)
env: BENCH_TMP=/var/tmp, BENCH_ROUNDS=3, BENCH_SETS=0
"""
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import requests
from safetensors.numpy import save as st_save

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "integration"))
from s3server import SeaweedS3  # noqa: E402

BUILD = Path(sys.argv[1] if len(sys.argv) > 1 else "build").resolve()
MIB = int(sys.argv[2]) if len(sys.argv) > 2 else 256
ROUNDS = int(os.environ.get("BENCH_ROUNDS", "3"))
NODES = ["w1", "w2", "w3", "w4"]
SHARDS = 6
NTENSORS = 24
SETS = int(os.environ.get("BENCH_SETS", "0"))


def model_of(rng):
    per = MIB * (1 << 20) // 4 // NTENSORS
    cols = 256
    return {f"layers.{i:02d}.weight": rng.standard_normal((per // cols, cols), dtype=np.float32)
            for i in range(NTENSORS)}


def delta_meta(node, base, local):
    return {"algorithm": "dumb_diloco", "base_outer_step": str(base), "local_step": str(local), "node_id": node}


class Bucket:
    def __init__(self, s3, prefix):
        self.s3, self.prefix, self.client = s3, prefix, s3.client()

    def put(self, rel, body):
        self.client.put_object(Bucket=self.s3.bucket, Key=f"{self.prefix}/{rel}", Body=body)

    def step(self):
        try:
            body = self.client.get_object(Bucket=self.s3.bucket, Key=f"{self.prefix}/global/step_count.json")["Body"]
            return json.loads(body.read())["outer_step"]
        except Exception:
            return -1


def as_set(tensors, meta, local, n):
    """A delta as a set of n shards of contiguous tensors: [(file name, bytes)], the index last."""
    names = list(tensors)
    cuts = [names[i * len(names) // n:(i + 1) * len(names) // n] for i in range(n)]
    files = [f"delta_{local}-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    out = [(files[i], st_save({k: tensors[k] for k in cut}, metadata={"format": "pt"})) for i, cut in enumerate(cuts)]
    index = {"metadata": {"total_size": sum(v.nbytes for v in tensors.values()), **meta},
             "weight_map": {k: files[i] for i, cut in enumerate(cuts) for k in cut}}
    return out + [(f"delta_{local}.safetensors.index.json", json.dumps(index, indent=2).encode())]


def start(tmp, s3, prefix, name, extra):
    log = open(tmp / f"{name}.log", "wb")
    cmd = [str(BUILD / "dilocod"), "--state-root", str(tmp / f"state-{name}"), "--id", name,
           "--hub", f"s3://{s3.bucket}/{prefix}", "--hub-endpoint", s3.endpoint, "--listen", "127.0.0.1:0",
           "--poll-interval", "0.05", "--expected-nodes", str(len(NODES)), "--lr", "0.7", "--momentum", "0.9",
           "--threads", "2", *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log, env=dict(os.environ, **s3.env()))
    port = None
    for _ in range(400):
        text = (tmp / f"{name}.log").read_text(errors="replace")
        if "listening" in text and "port=" in text:
            port = int(text.split("listening", 1)[1].split("port=", 1)[1].split()[0])
            break
        time.sleep(0.05)
    return proc, port


def status(port):
    return requests.get(f"http://127.0.0.1:{port}/status", timeout=10).json()


def scenario(tmp, s3, model, deltas_per_round, label, k):
    """k = 0: one plain dilocod; else a cluster of k.  Returns (median seconds, per-aggregator bytes of the last
    round's shards: None for the plain one)."""
    prefix = "bench-" + "".join(ch if ch.isalnum() else "-" for ch in label).strip("-").replace("--", "-")
    b = Bucket(s3, prefix)
    b.put("global/latest.safetensors", st_save(model))
    b.put("global/step_count.json", json.dumps({"algorithm": "dumb_diloco", "model_file": "global/latest.safetensors",
                                                "optimizer": "nesterov_sgd", "outer_step": 0,
                                                "updated_at": "2026-01-01T00:00:00+00:00"}))
    procs = []
    if k == 0:
        procs.append(start(tmp, s3, prefix, f"{prefix}-0", []))
        # wait until the global is adopted (the round opens)
        for _ in range(600):
            if status(procs[0][1]).get("state") == "collecting":
                break
            time.sleep(0.05)
    else:
        for i in range(k):
            procs.append(start(tmp, s3, prefix, f"{prefix}-{i}", ["--cluster-shards", str(SHARDS),
                                                                  "--cluster-lease", "30"]))
    times, last_bytes = [], None
    try:
        for r, deltas in enumerate(deltas_per_round):
            before = [status(p)["cluster"] if k else None for _, p in procs]
            for node, body in deltas.items():
                if isinstance(body, list):
                    for name, part in body:
                        b.put(f"nodes/{node}/{name}", part)
                else:
                    b.put(f"nodes/{node}/delta_{r + 1}.safetensors", body)
            t0 = time.perf_counter()
            while b.step() < r + 1:
                if time.perf_counter() - t0 > 600:
                    raise RuntimeError(f"{label}: round {r + 1} did not publish")
                time.sleep(0.02)
            times.append(time.perf_counter() - t0)
            if k:
                time.sleep(0.3)
                after = [status(p)["cluster"] for _, p in procs]
                last_bytes = [(a["bytes_read"] - b_["bytes_read"],
                               {x: a["seconds"][x] - b_["seconds"][x] for x in ("read", "pass", "write")})
                              for a, b_ in zip(after, before)]
    finally:
        for proc, _ in procs:
            proc.terminate()
        for proc, _ in procs:
            proc.wait(timeout=60)
    return statistics.median(times), last_bytes


def main():
    rng = np.random.default_rng(7)
    model = model_of(rng)
    model_bytes = sum(v.nbytes for v in model.values())
    rounds, set_rounds = [], []
    for r in range(ROUNDS):
        values = {n: {k: (rng.standard_normal(v.shape, dtype=np.float32) * 0.01) for k, v in model.items()}
                  for n in NODES}
        rounds.append({n: st_save(values[n], metadata=delta_meta(n, r, r + 1)) for n in NODES})
        if SETS:
            set_rounds.append({n: as_set(values[n], delta_meta(n, r, r + 1), r + 1, SETS) for n in NODES})
    base = Path(tempfile.mkdtemp(prefix="bench-cluster-", dir=os.environ.get("BENCH_TMP", "/var/tmp")))
    s3 = SeaweedS3(base / "s3").start()
    try:
        results = []
        for label, k in [("plain s3 (staged)", 0), ("cluster K=1", 1), ("cluster K=2", 2), ("cluster K=3", 3)]:
            secs, per = scenario(base, s3, model, rounds, label, k)
            results.append((label, k, secs, per))
        for label, k in ([(f"K=1, sets of {SETS}", 1), (f"K=2, sets of {SETS}", 2)] if SETS else []):
            secs, per = scenario(base, s3, model, set_rounds, label, k)
            results.append((label, k, secs, per))
        round_in = model_bytes * (len(NODES) + 2)   # the deltas, the previous global, the momentum
        print(f"bench_cluster: model {model_bytes / 2**20:.0f} MiB ({NTENSORS} F32 tensors), {len(NODES)} deltas, "
              f"S = {SHARDS}, {ROUNDS} rounds each; a round's inputs {round_in / 2**20:.0f} MiB")
        ref = results[0][2]
        print(f"{'scenario':<20} {'round s':>8} {'vs plain':>8}  bytes read per aggregator (MiB, last round)")
        for label, k, secs, per in results:
            if per is None:
                print(f"{label:<20} {secs:8.2f} {secs / ref:7.2f}x")
                continue
            nbytes = [b for b, _ in per]
            print(f"{label:<20} {secs:8.2f} {secs / ref:7.2f}x  " + ", ".join(f"{x / 2**20:.0f}" for x in nbytes) +
                  f"  (sum {sum(nbytes) / 2**20:.0f}; {statistics.mean(nbytes) / secs / 1e6:.0f} MB/s per aggregator)")
            for i, (_, t) in enumerate(per):
                print(f"{'':<20}   aggregator {i}: reading {t['read']:.2f} s, pass {t['pass']:.2f} s, "
                      f"writing back {t['write']:.2f} s")
    finally:
        s3.stop()
        if not os.environ.get("BENCH_KEEP"):
            shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
