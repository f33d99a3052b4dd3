"""A bandwidth-bound round (issue 39): each aggregator in its own network namespace with its own capped link
(tests/bench/netns.py), SeaweedFS on the host side of the links, 8 deltas landing together.  A report, not a
test: it asserts nothing (tests/integration/test_netns_harness.py runs the same code small and checks the step).

Scenarios, run side by side in one run on one lab: plain s3:// (one dilocod, one capped link: it downloads the
8 deltas and uploads the global) and the cluster at K = 1, 2, 4 (--cluster-shards S, each member with its own
capped link).  Each round's 8 deltas are put into the bucket at once (8 threads, over the host's uncapped side
of the bridge); a round is timed from the last put's completion to global/step_count.json naming the step
(polled every 20 ms).  A plain dilocod starts downloading a delta as soon as it is listed, so the puts' window
(printed) favours it: the cluster's ratios are upper bounds.  Per round and aggregator it prints the bytes
the daemon says it read (/metrics: dilocod_hub_download_bytes_total for plain, dilocod_cluster_bytes_read_total
for a member) and the bytes that crossed its link each way (the host side's veth counters), and for a cluster
the most any member read over 1/K of what all read (the fair share; a round's inputs are the 8 deltas and the
previous global, and from round 2 on the momentum).

Usage: bench_netns.py BUILD_DIR [MODEL_MIB]   (default 64; 32 F32 tensors)
env: BENCH_RATE_MBIT=400, BENCH_ROUNDS=3, BENCH_KS=1,2,4 (0 = plain, always run first), BENCH_SHARDS=8,
     BENCH_TMP=/var/tmp, BENCH_KEEP=1 keeps the temporary directory
Needs root (or CAP_NET_ADMIN): it says so and exits 2 without.
"""
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import requests
from safetensors.numpy import load as st_load
from safetensors.numpy import save as st_save

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "integration"))
sys.path.insert(0, str(ROOT / "tests" / "bench"))
from netns import NetnsLab, NetnsUnavailable  # noqa: E402
from s3server import SeaweedS3  # noqa: E402

NODES = [f"w{i}" for i in range(1, 9)]
STEP0 = {"algorithm": "dumb_diloco", "model_file": "global/latest.safetensors", "optimizer": "nesterov_sgd",
         "outer_step": 0, "updated_at": "2026-01-01T00:00:00+00:00"}


def delta_meta(node, base, local):
    return {"algorithm": "dumb_diloco", "base_outer_step": str(base), "local_step": str(local), "node_id": node}


def model_of(rng, mib, ntensors=32, cols=256):
    per = max(cols, mib * (1 << 20) // 4 // ntensors)
    return {f"layers.{i:02d}.weight": rng.standard_normal((per // cols, cols), dtype=np.float32)
            for i in range(ntensors)}


def deltas_of(rng, model, rounds):
    """rounds x {node: safetensors bytes}, F32, base_outer_step = the round's index."""
    return [{n: st_save({k: rng.standard_normal(v.shape, dtype=np.float32) * np.float32(0.01)
                         for k, v in model.items()}, metadata=delta_meta(n, r, r + 1)) for n in NODES}
            for r in range(rounds)]


class Bucket:
    def __init__(self, s3, prefix):
        self.s3, self.prefix, self.client = s3, prefix, s3.client()

    def put(self, rel, body, client=None):
        (client or self.client).put_object(Bucket=self.s3.bucket, Key=f"{self.prefix}/{rel}", Body=body)

    def get(self, rel):
        return self.client.get_object(Bucket=self.s3.bucket, Key=f"{self.prefix}/{rel}")["Body"].read()

    def step(self):
        try:
            return json.loads(self.get("global/step_count.json"))["outer_step"]
        except Exception:       # not there yet, or being replaced
            return -1

    def published(self):
        """The published global as {name: array}: step_count.json's model_file, a safetensors file or (a
        cluster's) an index whose weight_map names the shard files beside it."""
        model_file = json.loads(self.get("global/step_count.json"))["model_file"]
        if not model_file.endswith(".index.json"):
            return st_load(self.get(model_file))
        where = model_file.rsplit("/", 1)[0]
        state = {}
        for f in sorted(set(json.loads(self.get(model_file))["weight_map"].values())):
            if "/" in f or f.startswith("."):
                raise RuntimeError(f"the index names {f!r}, not a file beside it")
            state.update(st_load(self.get(f"{where}/{f}")))
        return state

    def put_together(self, files):
        """Puts {rel: body} from one thread each, released together; returns (first done, last done) in
        perf_counter seconds."""
        clients = [self.s3.client() for _ in files]
        gate, done, errors = threading.Barrier(len(files)), [], []

        def one(rel, body, client):
            try:
                gate.wait()
                self.put(rel, body, client)
                done.append(time.perf_counter())
            except Exception as e:  # reported below: a bench with a missing delta would wait forever
                errors.append(f"{rel}: {e}")
        threads = [threading.Thread(target=one, args=(rel, body, c)) for (rel, body), c in zip(files.items(), clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise RuntimeError("putting the deltas failed: " + "; ".join(errors))
        return min(done), max(done)


class Aggregator:
    """One dilocod inside namespace i of the lab, listening on the namespace's address."""

    def __init__(self, lab, i, build, tmp, s3, prefix, name, extra):
        self.lab, self.i, self.name = lab, i, name
        self.log_path = tmp / f"{name}.log"
        cmd = [str(build / "dilocod"), "--state-root", str(tmp / f"state-{name}"), "--id", name,
               "--hub", f"s3://{s3.bucket}/{prefix}", "--hub-endpoint", s3.endpoint,
               "--listen", f"{lab.addr(i)}:0", "--poll-interval", "0.05", "--expected-nodes", str(len(NODES)),
               "--lr", "0.7", "--momentum", "0.9", "--threads", "2", *extra]
        self.proc = subprocess.Popen(lab.exec_argv(i, cmd), stdout=subprocess.DEVNULL,
                                     stderr=open(self.log_path, "wb"), env=dict(os.environ, **s3.env()))
        self.port = None
        for _ in range(600):
            text = self.log_path.read_text(errors="replace")
            if "listening" in text and "port=" in text:
                self.port = int(text.split("listening", 1)[1].split("port=", 1)[1].split()[0])
                return
            if self.proc.poll() is not None:
                break
            time.sleep(0.05)
        raise RuntimeError(f"{name} did not start listening:\n{self.log_path.read_text(errors='replace')[-3000:]}")

    def url(self, path):
        return f"http://{self.lab.addr(self.i)}:{self.port}{path}"

    def status(self):
        return requests.get(self.url("/status"), timeout=10).json()

    def read_bytes(self):
        """What the daemon says it read from the bucket: a member's shard reads, or a plain one's downloads."""
        text = requests.get(self.url("/metrics"), timeout=10).text
        vals = {}
        for line in text.splitlines():
            for name in ("dilocod_cluster_bytes_read_total", "dilocod_hub_download_bytes_total"):
                if line.startswith(name + " "):
                    vals[name] = int(float(line.split()[1]))
        return vals.get("dilocod_cluster_bytes_read_total", vals.get("dilocod_hub_download_bytes_total", 0))

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=30)


def scenario(lab, build, tmp, s3, model, rounds, k, shards, label, keep_globals=False):
    """k = 0: one plain dilocod in namespace 0; else a cluster of k in namespaces 0..k-1.  Returns a dict:
    seconds (per round), window (the puts' spread per round), read (per round, per aggregator: the daemon's
    bytes), link (per round, per aggregator: bytes into, out of its namespace), globals (the published global
    after each round as {name: array}, when keep_globals)."""
    prefix = "netns-" + label
    b = Bucket(s3, prefix)
    b.put("global/latest.safetensors", st_save(model))
    b.put("global/step_count.json", json.dumps(STEP0))
    extra = [] if k == 0 else ["--cluster-shards", str(shards), "--cluster-lease", "30"]
    aggs = []
    out = {"seconds": [], "window": [], "read": [], "link": [], "globals": []}
    try:
        for i in range(max(k, 1)):
            aggs.append(Aggregator(lab, i, build, tmp, s3, prefix, f"{prefix}-{i}", extra))
        deadline = time.monotonic() + 120
        while k == 0 and aggs[0].status().get("state") != "collecting":
            if time.monotonic() > deadline:
                raise RuntimeError(f"{label}: the plain dilocod never opened round 1")
            time.sleep(0.05)
        for r, deltas in enumerate(rounds):
            read0 = [a.read_bytes() for a in aggs]
            link0 = [lab.link_bytes(a.i) for a in aggs]
            first, last = b.put_together({f"nodes/{n}/delta_{r + 1}.safetensors": body for n, body in deltas.items()})
            while b.step() < r + 1:
                if time.perf_counter() - last > 900:
                    raise RuntimeError(f"{label}: round {r + 1} did not publish")
                time.sleep(0.02)
            out["seconds"].append(time.perf_counter() - last)
            out["window"].append(last - first)
            time.sleep(0.3)     # the members' counters of the step's last writes
            out["read"].append([a.read_bytes() - x for a, x in zip(aggs, read0)])
            out["link"].append([tuple(n - o for n, o in zip(lab.link_bytes(a.i), l0)) for a, l0 in zip(aggs, link0)])
            if keep_globals:
                out["globals"].append(b.published())
    finally:
        for a in aggs:
            a.stop()
    return out


def report(results, model_bytes, rate, shards, nrounds):
    round_in = model_bytes * (len(NODES) + 2)
    print(f"bench_netns: model {model_bytes / 2**20:.0f} MiB (F32), {len(NODES)} deltas landing together, each "
          f"aggregator's link capped at {rate} Mbit/s both ways, S = {shards}, {nrounds} rounds each (median); "
          f"a round's inputs {round_in / 2**20:.0f} MiB (8 deltas, the global, the momentum)")
    plain = statistics.median(results[0][2]["seconds"])
    print(f"{'scenario':<14} {'round s':>8} {'vs plain':>8} {'puts window':>11}  per aggregator, each round: "
          f"MiB read (daemon) / MiB in, out (link); the most read / (all read / K)")
    for label, k, res in results:
        secs = statistics.median(res["seconds"])
        print(f"{label:<14} {secs:8.2f} {secs / plain:7.2f}x {statistics.median(res['window']):10.2f}s  "
              f"rounds: " + ", ".join(f"{s:.2f}" for s in res["seconds"]))
        for r, (reads, link) in enumerate(zip(res["read"], res["link"])):
            cells = "; ".join(f"{rd / 2**20:.0f} / {li / 2**20:.0f}, {lo / 2**20:.0f}"
                              for rd, (li, lo) in zip(reads, link))
            fair = f"; {max(reads) / (sum(reads) / k):.2f}x" if k else ""
            print(f"{'':<14}   round {r + 1}: {cells}{fair}")


def main():
    build = Path(sys.argv[1] if len(sys.argv) > 1 else "build").resolve()
    mib = int(sys.argv[2]) if len(sys.argv) > 2 else 64
    rate = int(os.environ.get("BENCH_RATE_MBIT", "400"))
    nrounds = int(os.environ.get("BENCH_ROUNDS", "3"))
    shards = int(os.environ.get("BENCH_SHARDS", "8"))
    ks = [int(x) for x in os.environ.get("BENCH_KS", "1,2,4").split(",") if x.strip() and int(x) > 0]
    if mib < 1 or rate < 1 or nrounds < 1 or any(k > shards for k in ks):
        sys.exit(f"bench_netns: bad arguments (MODEL_MIB {mib}, rate {rate}, rounds {nrounds}, K {ks}, S {shards})")
    # SIGTERM (make's, a timeout's) unwinds through the finally blocks, so the lab is torn down
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    rng = np.random.default_rng(39)
    model = model_of(rng, mib)
    model_bytes = sum(v.nbytes for v in model.values())
    rounds = deltas_of(rng, model, nrounds)
    lab = NetnsLab(max(ks + [1]), rate)
    try:
        lab.setup()
    except NetnsUnavailable as e:
        print(f"bench_netns: skipped: {e}", file=sys.stderr)
        sys.exit(2)
    base = Path(tempfile.mkdtemp(prefix="bench-netns-", dir=os.environ.get("BENCH_TMP", "/var/tmp")))
    try:
        s3 = SeaweedS3(base / "s3", host=lab.host_addr).start()
        try:
            results = [("plain s3", 0, scenario(lab, build, base, s3, model, rounds, 0, shards, "plain"))]
            for k in ks:
                results.append((f"cluster K={k}", k, scenario(lab, build, base, s3, model, rounds, k, shards, f"k{k}")))
            report(results, model_bytes, rate, shards, nrounds)
        finally:
            s3.stop()
    finally:
        lab.teardown()
        if not os.environ.get("BENCH_KEEP"):
            shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
