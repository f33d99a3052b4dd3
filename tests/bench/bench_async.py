"""Async-mode benchmark: updates per second of dilocod --mode async, and the cost of one update against a
plain memory pass over the same bytes, measured side by side in one run (the machine is shared and
noisy: compare the ratios, not the absolute numbers).  A report, not a test: it asserts nothing.

For each model size (MiB of F32, in 8 tensors, as bench_round.py's) it writes an initial model and a
ring of RING delta files (nodes w0..w5), then:

  async       one dilocod --mode async --grace-ms 0 --dn-period 4 --max-staleness none on a file://
              hub.  The bench feeds WARMUP + MEASURE deltas (4 + 8), one node after the other, keeping
              DEPTH (2) deltas not yet committed, so that one always waits in the queue while an update's
              pass runs: each delta is one update.  A delta is hard-linked into nodes/wK/ through a
              rename (no data written); its ring file is used again, with a new header (pwrite of the
              same length: new base_outer_step, local_step) and a changed first value, once the step
              that consumed it is durable (the daemon's log: "store durable").  base_outer_step is the
              step committed when it is fed (tau 0-2).
              After the warm-up (one Delayed Nesterov period: the momentum exists from then on) it
              reports, over the MEASURE updates: updates/s (commits per second, "store committed"),
              and for plain steps (k < N) and Nesterov steps (k = N) apart, the median interval between
              two commits and the median pass (the daemon's log, "aggregate started" -> "computed").
              Every record of /rounds is checked to be one delta and its nesterov_step flag read.
              GB/s: the bytes the daemon's pass read + wrote ("aggregate done": 7 x the model's size in a
              plain step, 6 x in a Nesterov step) over its pass.
  memory pass tests/stream pass MIB: one pass over four F32 arrays of the model's size (delta, global,
              momentum, accumulator), the four read and three written in place, best of 5: the plain
              streaming read + write of the bytes a plain update moves (a Nesterov step writes one
              array less).  Measured before and after the async run (the median of the two is the
              baseline); "x pass" is an update's time over it.
  sync        for comparison, dilocod in sync mode with --expected-nodes 1 on the same size: a fresh
              daemon, its one delta renamed into nodes/w0/ -> step 1 published (the critical path),
              and its pass; median of BENCH_ROUNDS fresh rounds.  Its first step has no momentum to
              read: it reads delta + global and writes global + momentum.

dilocod runs with its defaults otherwise (threads = CPUs), JSON logs at debug level; the files stay in
the page cache (every delta is one of the RING files, 6 x the model's size).  The timed updates write new
global, momentum and accumulator files (3 x the model's size each) whose write-back to the shared disk
runs behind them: the "feeder waited" count says how often a ring file was not durable yet, i.e. how
often the disk, not the pass, set the pace.

Usage: bench_async.py BUILD_DIR [MODEL_MIB ...]   (default 256 1024)
env: BENCH_ROUNDS=3 sync rounds, BENCH_TMP=/var/tmp, BENCH_ASYNC_MEASURE=8 updates measured, BENCH_KEEP=1
     keeps the async daemon's log (in BENCH_TMP).
"""
import http.client
import json
import os
import shutil
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from bench_round import fdatasync_gbps, log_time, write_model
from pagecache import memory_stall_s, stall_since

BUILD = Path(sys.argv[1] if len(sys.argv) > 1 else "build").resolve()
SIZES = [int(x) for x in sys.argv[2:]] or [256, 1024]
TENSORS = 8
RING = 6
DEPTH = 2
PERIOD = 4
WARMUP = PERIOD
MEASURE = int(os.environ.get("BENCH_ASYNC_MEASURE", "8"))
ROUNDS = int(os.environ.get("BENCH_ROUNDS", "3"))
HEADER = 4096 - 8           # the JSON header's fixed length: data at 4 KiB, a new header is one pwrite
TIMEOUT = 600


# ---- the ring of delta files ---------------------------------------------------------------------

def header_bytes(n, node, base, local):
    h = {"__metadata__": {"algorithm": "dumb_diloco", "base_outer_step": str(base), "local_step": str(local),
                          "node_id": node}}
    for i in range(TENSORS):
        h[f"layer{i}.weight"] = {"dtype": "F32", "shape": [n], "data_offsets": [i * n * 4, (i + 1) * n * 4]}
    raw = json.dumps(h, separators=(",", ":")).encode()
    if len(raw) > HEADER:
        raise RuntimeError("delta header too long")
    return struct.pack("<Q", HEADER) + raw + b" " * (HEADER - len(raw))


def write_ring_delta(path, mib, rng, k):
    n = mib * (1 << 20) // 4 // TENSORS
    block = (rng.standard_normal(1 << 20) * 0.01).astype(np.float32)
    with open(path, "wb") as f:
        f.write(header_bytes(n, f"w{k}", 0, 100))
        for i in range(TENSORS):
            f.write(np.resize(np.roll(block, i + k), n).tobytes())
    return n


def relabel(path, n, node, base, local, use):
    """A new header of the same length and a new first value: the same file is a new delta."""
    fd = os.open(path, os.O_WRONLY)
    try:
        os.pwrite(fd, header_bytes(n, node, base, local), 0)
        os.pwrite(fd, struct.pack("<f", 0.001 * (use + 1)), 8 + HEADER)
    finally:
        os.close(fd)


def link_in(src, hub, node, local):
    d = hub / "nodes" / node
    d.mkdir(parents=True, exist_ok=True)
    staging = hub / f".incoming-{node}"
    os.link(src, staging)
    target = d / f"delta_{local}.safetensors"
    os.rename(staging, target)
    return target, time.time()


# ---- dilocod ------------------------------------------------------------------------------------

class Dilocod:
    """One dilocod on a fresh state root; its JSON log is read as it grows, records by (component, msg)."""

    def __init__(self, tmp, init, hub, *args):
        self.log = tmp / "dilocod.log"
        self.proc = subprocess.Popen(
            [str(BUILD / "dilocod"), "--state-root", str(tmp / "state"), "--hub", f"file://{hub}",
             "--init-model", str(init), "--listen", "127.0.0.1:0", "--log-level", "debug", "--log-format", "json",
             *args], stdout=subprocess.DEVNULL, stderr=open(self.log, "wb"))
        self.fh = open(self.log, "rb")
        self.buf = b""
        self.by = {}
        self.port = None

    def poll(self):
        self.buf += self.fh.read()
        *lines, self.buf = self.buf.split(b"\n")
        for line in lines:
            try:
                r = json.loads(line)
            except ValueError:
                continue
            self.by.setdefault((r.get("component"), r.get("msg")), []).append(r)

    def find(self, component, msg, **fields):
        for r in self.by.get((component, msg), []):
            if all(str(r.get(k)) == str(v) for k, v in fields.items()):
                return r
        return None

    def steps(self, component, msg):
        """{step: time} of the records carrying a step."""
        return {int(r["step"]): log_time(r["ts"]) for r in self.by.get((component, msg), []) if "step" in r}

    def wait(self, what, cond, timeout=TIMEOUT):
        deadline = time.time() + timeout
        while time.time() < deadline:
            self.poll()
            got = cond()
            if got:
                return got
            if self.proc.poll() is not None:
                raise RuntimeError(f"dilocod exited ({self.proc.returncode}) waiting for {what}:\n"
                                   f"{self.log.read_text(errors='replace')[-3000:]}")
            time.sleep(0.005)
        raise RuntimeError(f"dilocod: no {what} within {timeout} s:\n{self.log.read_text(errors='replace')[-3000:]}")

    def start(self):
        r = self.wait("listening", lambda: self.find("http", "listening"))
        self.port = int(r["port"])
        self.wait("step 0", lambda: self.find("store", "committed", step=0) or self.find("round", "opened", step=0))
        return self

    def get_json(self, path):
        c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        try:
            c.request("GET", path)
            return json.loads(c.getresponse().read())
        finally:
            c.close()

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=30)
        self.fh.close()


def memory_pass(mib):
    out = subprocess.run([str(BUILD / "tests" / "stream"), "pass", str(mib)], capture_output=True, text=True,
                         check=True).stdout.split()
    return float(out[1]), float(out[3])


def triad():
    return float(subprocess.run([str(BUILD / "tests" / "stream")], capture_output=True, text=True,
                                check=True).stdout.split()[1])


# ---- the runs -----------------------------------------------------------------------------------

def async_run(tmp, init, ring, n):
    hub = tmp / "hub"
    (hub / "nodes").mkdir(parents=True)
    total = WARMUP + MEASURE
    d = Dilocod(tmp, init, hub, "--mode", "async", "--grace-ms", "0", "--dn-period", str(PERIOD),
                "--max-staleness", "none", "--expected-nodes", str(RING)).start()
    try:
        fed, waited, links = 0, 0, {}
        intake = lambda: len(d.by.get(("round", "delta accepted"), [])) + \
            len(d.by.get(("round", "delta queued for the next update"), []))
        while True:
            d.poll()
            committed = max(d.steps("store", "committed"), default=0)
            if committed >= total:
                break
            if fed < total and fed - committed < DEPTH:
                i = fed + 1
                slot = (i - 1) % RING
                if i > RING and max(d.steps("store", "durable"), default=0) < i - RING:
                    waited += 1
                    d.wait(f"step {i - RING} durable",
                           lambda: max(d.steps("store", "durable"), default=0) >= i - RING)
                node = f"w{slot}"
                if node in links:
                    links.pop(node).unlink()
                relabel(ring[slot], n, node, committed, 100 * i, i)
                links[node], _ = link_in(ring[slot], hub, node, 100 * i)
                fed = i
                d.wait(f"delta {i} taken in", lambda: intake() >= i)
                continue
            time.sleep(0.005)
        rounds = {r["outer_step"]: r for r in d.get_json("/rounds")["rounds"]}
    finally:
        d.stop()
        if os.environ.get("BENCH_KEEP"):
            kept = Path(tempfile.mkstemp(prefix="bench-async-", suffix=".log", dir=tmp.parent.parent)[1])
            shutil.copy(d.log, kept)
            print("  kept the daemon's log:", kept)
    started, computed = d.steps("aggregate", "started"), d.steps("aggregate", "computed")
    comm = d.steps("store", "committed")
    moved = {int(r["step"]): int(r["bytes"]) for r in d.by.get(("aggregate", "done"), [])}
    rows = {"plain": [], "nesterov": []}
    for s in range(WARMUP + 1, total + 1):
        r = rounds[s]
        if len(r["nodes"]) != 1 or r.get("mode") != "async":
            raise RuntimeError(f"update {s} is not one delta: {r}")
        kind = "nesterov" if r["nesterov_step"] else "plain"
        rows[kind].append((comm[s] - comm[s - 1], computed[s] - started[s], moved[s]))
    ups = MEASURE / (comm[total] - comm[WARMUP])
    return ups, rows, waited


def sync_round(tmp, init, ring, n):
    hub = tmp / "hub"
    (hub / "nodes" / "w0").mkdir(parents=True)
    relabel(ring[0], n, "w0", 0, 100, 0)
    d = Dilocod(tmp, init, hub, "--mode", "sync", "--expected-nodes", "1").start()
    try:
        _, t0 = link_in(ring[0], hub, "w0", 100)
        r = d.wait("step 1 published", lambda: d.find("hub", "published", step=1))
        pas = log_time(d.find("aggregate", "computed", step=1)["ts"]) - log_time(d.find("aggregate", "started",
                                                                                         step=1)["ts"])
        return log_time(r["ts"]) - t0, pas
    finally:
        d.stop()


def fresh(base, name):
    return Path(tempfile.mkdtemp(prefix=f"{name}-", dir=base))


def run_size(base, mib):
    data = fresh(base, f"data-{mib}")
    try:
        t0 = time.time()
        rng = np.random.default_rng(mib)
        init = data / "init.safetensors"
        write_model(init, mib, rng)
        ring = [data / f"ring_w{k}.safetensors" for k in range(RING)]
        n = 0
        for k, p in enumerate(ring):
            n = write_ring_delta(p, mib, rng, k)
        os.sync()
        print(f"== {mib} MiB F32 model ({TENSORS} tensors), {RING} ring deltas written in {time.time() - t0:.0f} s")
        gb = mib * (1 << 20) / 1e9
        mp = [memory_pass(mib)]
        tmp = fresh(base, "async")
        stall0 = memory_stall_s()
        try:
            ups, rows, waited = async_run(tmp, init, ring, n)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        stall = stall_since(stall0)
        mp.append(memory_pass(mib))
        mp_s = statistics.median(x[0] for x in mp)
        print(f"  memory pass, 4 x {mib} MiB read + 3 written: {mp_s:.3f} s "
              f"({', '.join(f'{s:.3f} s {g:.1f} GB/s' for s, g in mp)}, before and after)")
        # the pass's own count (aggregate done bytes=): a plain step carries the momentum by a link
        pgb = statistics.median(x[2] for x in rows["plain"]) / 1e9 if rows["plain"] else 0.0
        print(f"  async: {ups:.2f} updates/s over {MEASURE} updates after {WARMUP} ({pgb:.2f} GB read + written "
              f"per plain update: {pgb * ups:.1f} GB/s); feeder waited for durability {waited} times; "
              f"memory stall {stall:.2f} s")
        print(f"  {'':24s} {'n':>2s} {'interval':>9s} {'x pass':>7s} {'pass':>7s} {'x pass':>7s} {'GB/s':>6s}   "
              f"(samples: interval/pass)")
        for kind in ("plain", "nesterov"):
            r = rows[kind]
            if not r:
                continue
            iv = statistics.median(x[0] for x in r)
            ps = statistics.median(x[1] for x in r)
            gbps = statistics.median(x[2] / x[1] for x in r) / 1e9
            label = f"async {kind} (k{'<' if kind == 'plain' else '='}N)"
            print(f"  {label:24s} {len(r):2d} {iv:8.3f}s {iv / mp_s:6.2f}x {ps:6.3f}s {ps / mp_s:6.2f}x {gbps:6.2f}   "
                  f"({', '.join(f'{a:.2f}/{b:.2f}' for a, b, _ in r)})")
        samples = []
        for _ in range(ROUNDS):
            tmp = fresh(base, "sync")
            try:
                samples.append(sync_round(tmp, init, ring, n))
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
        cp = statistics.median(x[0] for x in samples)
        ps = statistics.median(x[1] for x in samples)
        print(f"  {'sync, 1 node':24s} {len(samples):2d} {cp:8.3f}s {cp / mp_s:6.2f}x {ps:6.3f}s {ps / mp_s:6.2f}x   "
              f"(critical path / pass: {', '.join(f'{a:.2f}/{b:.2f}' for a, b in samples)})")
        print()
    finally:
        shutil.rmtree(data, ignore_errors=True)


def main():
    for f in ("dilocod", "tests/stream"):
        if not (BUILD / f).exists():
            sys.exit(f"bench_async: {BUILD / f} is missing: run make bench")
    base = Path(tempfile.mkdtemp(prefix="dilocod-asyncbench-", dir=os.environ.get("BENCH_TMP", "/var/tmp")))
    try:
        print("dilocod async benchmark, side by side in one run (a shared machine: compare the ratios)")
        print(f"machine: {os.cpu_count()} CPUs, STREAM triad {triad():.2f} GB/s; disk {base.parent}: write + "
              f"fdatasync {fdatasync_gbps(base):.2f} GB/s")
        print(f"interval: between two commits with the queue kept full; pass: the daemon's outer pass; x pass: "
              f"over the memory pass\n")
        for mib in SIZES:
            run_size(base, mib)
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
