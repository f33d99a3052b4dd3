"""Round benchmark: dilocod next to the Python reference round on the same files, over file:// and HTTP,
measured side by side in one run (the machine is shared and noisy: compare the ratios, not the absolute
numbers).  A report, not a test: it asserts nothing.

For each model size (MiB of F32, in 8 tensors) it writes an initial model and 8 deltas (nodes w0..w7,
base_outer_step 0), then, each measurement a median over BENCH_ROUNDS fresh rounds (a new dilocod on a new
state root and a new tree every time; a replacing upload is never counted as a round):

  reference   the Python reference round: load_file each delta, FP32 mean, torch.optim.SGD Nesterov step,
              save_file of the new global and torch.save of the momentum (its own clock, after the imports);
              peak RSS from getrusage.
  file:// critical path   7 deltas accepted, then the 8th is renamed into nodes/w7/ (a directory that
              already exists, as in every round but the first) -> global/step_count.json names step 1
              (dilocod's log: "hub published step=1").
  file:// catch-up        all 8 deltas present when dilocod starts -> step 1 published (same log line).
  file:// critical path, idle   as the critical path, but the 8th delta lands BENCH_IDLE_S (10) seconds
              after the 7th was taken in, with no page cache freed for it: what a real round looks like
              (workers train between rounds), where pages freed earlier went back to the host and the
              pass's 2 GiB of new output pages fault in again, unless dilocod warmed them while it waited.
  HTTP critical path      7 deltas uploaded, then the 8th: its 201 -> step 1 served (the log line
              "store committed step=1" is written as GET /global and /status switch to the new step; checked
              with /status).
  HTTP round              8 concurrent uploads from their start -> step 1 served.
              After each upload the bench drops the uploaded file's pages from the page cache: the worker
              that sent it runs on another machine, so its copy does not crowd the server's page cache
              (with it, 9 GiB of client files beside the server's 8 GiB of deltas evicted the pass's
              inputs: 0.4 s of memory stall and a pass twice as long as bench-outer's).
  pass        dilocod's outer pass inside the daemon (log: "aggregate started" -> "aggregate computed"), and
              bench-outer (the same pass alone, inputs from the page cache, outputs written on the same disk
              and renamed without fsync, as the daemon's redo-record commit does: DEFER=1) with its
              bandwidth counted as bytes read + written, next to the STREAM triad; then again with its
              outputs warmed first (WARM=1, untimed), as the daemon's warm thread leaves them.
  peak RSS    VmHWM of every dilocod run (the largest is shown), ru_maxrss of the reference.

The Python reference holds every delta in memory: at 1 GiB it needs 6-13 GiB of RAM.
dilocod runs with its defaults (poll_interval 5 s, threads = CPUs, 16 MiB per thread), JSON logs at debug
level, so timestamps (CLOCK_REALTIME, milliseconds) are compared with this process's time.time().
The page cache is warm for both: every run reads the same files.  Every timed write starts on just-freed
page cache (pagecache.fresh_pages: on a VM with free page reporting a write that grows the cache costs
~13x the CPU of one that reuses freed pages, and which one a measurement got used to depend on what the
step before it deleted): the reference round, the last delta of a critical path (its intake, then the new
global and momentum), the catch-up start and bench-outer get as much as they will write.  The 8
concurrent uploads do not (the pass starts ~10 s later, after the freed pages went back to the host).
Each figure also shows "memory stall": the seconds some task waited for memory during its runs, set-up
included (PSI: reclaim, compaction).  With the page cache full, new pages come from reclaim and direct
compaction, and inputs evicted since they were written are read again from disk: one daemon pass here
took 7.5 s that way (perf: 74% of its CPU in pread, 40% of it readahead, 14% direct compaction) and
0.9 s with every input resident and 11 GB free, so read the pass figures beside it.

Usage: bench_round.py BUILD_DIR [MODEL_MIB ...]   (default 1024 256)
env: BENCH_ROUNDS=3 fresh rounds per figure, BENCH_TMP=/var/tmp, BENCH_KEEP=1 keeps the files,
     BENCH_ONLY=file,idle,http,reference to run a subset, BENCH_IDLE_S=10,
     BENCH_BEFORE=OTHER_BUILD_DIR runs every dilocod figure with that build too, round by round alternated
     with BUILD_DIR (before/after a change, measured side by side).
"""
import datetime
import http.client
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from pagecache import fresh_pages, memory_stall_s, stall_since

BUILD = Path(sys.argv[1] if len(sys.argv) > 1 else "build").resolve()
BEFORE = Path(os.environ["BENCH_BEFORE"]).resolve() if os.environ.get("BENCH_BEFORE") else None
SIZES = [int(x) for x in sys.argv[2:]] or [1024, 256]
NODES = 8
TENSORS = 8
ROUNDS = int(os.environ.get("BENCH_ROUNDS", "3"))
ONLY = set(os.environ.get("BENCH_ONLY", "file,idle,http,reference").split(","))
IDLE_S = float(os.environ.get("BENCH_IDLE_S", "10"))
TIMEOUT = 1800

REFERENCE = r'''
import sys, time, torch, resource
from safetensors.torch import load_file, save_file
glob, out, mom_out, *deltas = sys.argv[1:]
t0 = time.time()
params = {k: torch.nn.Parameter(v) for k, v in load_file(glob).items()}
opt = torch.optim.SGD(list(params.values()), lr=0.7, momentum=0.9, nesterov=True)
avg = None
for path in deltas:
    d = load_file(path)
    if avg is None:
        avg = {k: v.float().clone() for k, v in d.items()}
    else:
        for k, v in d.items():
            avg[k] += v.float()
    del d
for k in avg:
    params[k].grad = avg[k] / len(deltas)
opt.step()
save_file({k: p.detach() for k, p in params.items()}, out)
torch.save({k: opt.state[p]["momentum_buffer"] for k, p in params.items()}, mom_out)
print(time.time() - t0, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
'''


# ---- data ---------------------------------------------------------------------------------------

def write_model(path, mib, rng):
    from safetensors.numpy import save_file
    n = mib * (1 << 20) // 4 // TENSORS
    block = rng.standard_normal(1 << 20).astype(np.float32)
    save_file({f"layer{i}.weight": np.resize(np.roll(block, i), n) for i in range(TENSORS)}, str(path))


def write_delta(path, mib, rng, node):
    from safetensors.numpy import save_file
    n = mib * (1 << 20) // 4 // TENSORS
    block = (rng.standard_normal(1 << 20) * 0.01).astype(np.float32)
    meta = {"algorithm": "dumb_diloco", "base_outer_step": "0", "local_step": "100", "node_id": f"w{node}"}
    save_file({f"layer{i}.weight": np.resize(np.roll(block, i + node), n) for i in range(TENSORS)}, str(path),
              metadata=meta)


def make_data(directory, mib):
    rng = np.random.default_rng(mib)
    init = directory / "init.safetensors"
    write_model(init, mib, rng)
    deltas = []
    for k in range(NODES):
        p = directory / f"delta_w{k}.safetensors"
        write_delta(p, mib, rng, k)
        deltas.append(p)
    return init, deltas


# ---- the machine --------------------------------------------------------------------------------

def stream_triad():
    out = subprocess.run([str(BUILD / "tests" / "stream")], capture_output=True, text=True, check=True).stdout
    return float(out.split()[1])


def fdatasync_gbps(directory, mib=512):
    """Buffered write + fdatasync of MIB MiB: what any durable write of that much data costs here."""
    path = Path(directory) / "disk-probe"
    block = os.urandom(1 << 20)
    t0 = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        for _ in range(mib):
            os.write(fd, block)
        os.fdatasync(fd)
    finally:
        os.close(fd)
    dt = time.perf_counter() - t0
    path.unlink()
    return mib * (1 << 20) / dt / 1e9


# ---- dilocod ------------------------------------------------------------------------------------

def log_time(ts):
    return datetime.datetime.fromisoformat(ts.replace("Z", "+00:00")).timestamp()


class Dilocod:
    """One dilocod on a fresh state root; its JSON log is parsed as it grows."""

    def __init__(self, build, tmp, init, hub, listen="none"):
        self.log = tmp / "dilocod.log"
        self.proc = subprocess.Popen(
            [str(build / "dilocod"), "--state-root", str(tmp / "state"), "--hub", hub, "--init-model", str(init),
             "--expected-nodes", str(NODES), "--listen", listen, "--log-level", "debug", "--log-format", "json"],
            stdout=subprocess.DEVNULL, stderr=open(self.log, "wb"))
        self.port = None

    def records(self):
        out = []
        for line in self.log.read_text(errors="replace").splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:
                continue
        return out

    def find(self, component, msg, **fields):
        for r in self.records():
            if r.get("component") == component and r.get("msg") == msg and \
                    all(str(r.get(k)) == str(v) for k, v in fields.items()):
                return r
        return None

    def count(self, component, msg):
        return sum(1 for r in self.records() if r.get("component") == component and r.get("msg") == msg)

    def wait(self, what, cond, timeout=TIMEOUT):
        deadline = time.time() + timeout
        while time.time() < deadline:
            got = cond()
            if got:
                return got
            if self.proc.poll() is not None:
                raise RuntimeError(f"dilocod exited ({self.proc.returncode}) waiting for {what}:\n"
                                   f"{self.log.read_text(errors='replace')[-3000:]}")
            time.sleep(0.01)
        raise RuntimeError(f"dilocod: no {what} within {timeout} s:\n{self.log.read_text(errors='replace')[-3000:]}")

    def wait_port(self):
        r = self.wait("listening", lambda: self.find("http", "listening"))
        self.port = int(r["port"])
        return self.port

    def hwm_mib(self):
        text = Path(f"/proc/{self.proc.pid}/status").read_text()
        return int(re.search(r"VmHWM:\s+(\d+) kB", text).group(1)) / 1024

    def pass_seconds(self, step):
        a = self.find("aggregate", "started", step=step)
        c = self.find("aggregate", "computed", step=step)
        return log_time(c["ts"]) - log_time(a["ts"]) if a and c else float("nan")

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=30)


def published(d):
    """file://: the moment step_count.json names step 1 (logged right after its rename)."""
    return d.find("hub", "published", step=1)


def served(d):
    """HTTP: the moment GET /global and /status switch to step 1 (logged as the commit is applied)."""
    return d.find("store", "committed", step=1)


def status_step(port):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        c.request("GET", "/status")
        return json.loads(c.getresponse().read())["outer_step"]
    finally:
        c.close()


def link_delta(src, hub, k, via_rename):
    node = hub / "nodes" / f"w{k}"
    node.mkdir(parents=True, exist_ok=True)
    target = node / "delta_100.safetensors"
    if not via_rename:
        os.link(src, target)
        return None
    staging = hub / f".incoming-w{k}"
    os.link(src, staging)
    os.rename(staging, target)
    return time.time()


def file_round(build, tmp, init, deltas, catch_up, idle=False):
    """One fresh file:// round: (seconds to published, pass seconds, VmHWM MiB).  idle: the last delta
    lands IDLE_S after the others were taken in, with no page cache freed for it (as in a real run,
    where the round waits for workers to train)."""
    hub = tmp / "hub"
    hub.mkdir()
    for k in range(NODES):
        (hub / "nodes" / f"w{k}").mkdir(parents=True)
    last = NODES if catch_up else NODES - 1
    for k in range(last):
        link_delta(deltas[k], hub, k, False)
    if catch_up:
        fresh_pages(tmp, 3 * deltas[-1].stat().st_size)
    t_start = time.time()
    d = Dilocod(build, tmp, init, f"file://{hub}")
    try:
        if not catch_up:
            d.wait("7 accepted deltas", lambda: d.count("round", "delta accepted") >= NODES - 1)
            if idle:
                time.sleep(IDLE_S)
            else:
                fresh_pages(tmp, 3 * deltas[-1].stat().st_size)
            t_start = link_delta(deltas[-1], hub, NODES - 1, True)
        r = d.wait("step 1 published", lambda: published(d))
        if json.loads((hub / "global" / "step_count.json").read_text())["outer_step"] != 1:
            raise RuntimeError("step_count.json does not name step 1")
        return log_time(r["ts"]) - t_start, d.pass_seconds(1), d.hwm_mib()
    finally:
        d.stop()


def put(port, k, path):
    """PUT of one delta; returns (status, time.time() when the answer arrived)."""
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=600, blocksize=1 << 20)
    try:
        with open(path, "rb") as f:
            c.request("PUT", f"/nodes/w{k}/delta_100.safetensors", body=f,
                      headers={"Content-Length": str(path.stat().st_size),
                               "Content-Type": "application/octet-stream"})
            r = c.getresponse()
            body = r.read()
            t = time.time()
            # a worker runs on another machine: its file's pages are not in the server's page cache
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        if r.status != 201:
            raise RuntimeError(f"upload w{k}: {r.status} {body[:300]!r}")
        return t
    finally:
        c.close()


def http_round(build, tmp, init, deltas, concurrent):
    """One fresh HTTP round: (seconds to served, pass seconds, VmHWM MiB)."""
    d = Dilocod(build, tmp, init, "none", listen="127.0.0.1:0")
    try:
        port = d.wait_port()
        d.wait("bootstrap", lambda: d.find("store", "committed", step=0) or d.find("round", "opened", step=0))
        if concurrent:
            errors = []

            def one(k):
                try:
                    put(port, k, deltas[k])
                except Exception as e:     # reported below, after every thread ended
                    errors.append(f"w{k}: {e}")
            threads = [threading.Thread(target=one, args=(k,)) for k in range(NODES)]
            t_start = time.time()
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            if errors:
                raise RuntimeError("; ".join(errors))
        else:
            for k in range(NODES - 1):
                put(port, k, deltas[k])
            fresh_pages(tmp, 3 * deltas[-1].stat().st_size)
            t_start = put(port, NODES - 1, deltas[-1])
        r = d.wait("step 1 served", lambda: served(d))
        if status_step(port) != 1:
            raise RuntimeError("/status does not report step 1")
        return log_time(r["ts"]) - t_start, d.pass_seconds(1), d.hwm_mib()
    finally:
        d.stop()


def bench_outer(build, tmp, init, deltas, warm=False):
    """The pass alone: (compute seconds, bytes read + written per second).  warm: its output files are
    created and read once first, untimed, as the daemon's warm thread does while a round collects."""
    out = tmp / "outer"
    out.mkdir()
    fresh_pages(tmp, 2 * init.stat().st_size)
    p = subprocess.run([str(build / "tests" / "bench-outer"), str(os.cpu_count()), str(init), str(out),
                        *map(str, deltas)], capture_output=True, text=True, check=True,
                       env=dict(os.environ, DEFER="1", WARM="1" if warm else "0"))
    m = re.search(r"compute ([\d.]+) s \(([\d.]+) GB/s", p.stdout)
    shutil.rmtree(out)
    return float(m.group(1)), float(m.group(2))


def reference_round(tmp, init, deltas):
    fresh_pages(tmp, 2 * init.stat().st_size)       # its new global and momentum
    p = subprocess.run([sys.executable, "-c", REFERENCE, str(init), str(tmp / "ref.safetensors"),
                        str(tmp / "ref_state.pt"), *map(str, deltas)], capture_output=True, text=True, check=True)
    secs, rss_kb = p.stdout.split()
    (tmp / "ref.safetensors").unlink()
    (tmp / "ref_state.pt").unlink()
    return float(secs), int(rss_kb) / 1024


# ---- the report ---------------------------------------------------------------------------------

def fresh(base, name):
    return Path(tempfile.mkdtemp(prefix=f"{name}-", dir=base))


def median_of(fn, base, name, builds=(None,)):
    """ROUNDS fresh runs of fn(build, tmp) -> tuple for each build, round by round alternated, each with
    the seconds some task waited for memory during it (PSI) appended; returns {build: (medians, samples)}."""
    samples = {b: [] for b in builds}
    for _ in range(ROUNDS):
        for b in builds:
            tmp = fresh(base, name)
            try:
                stall0 = memory_stall_s()
                samples[b].append(fn(b, tmp) + (stall_since(stall0),))
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
    return {b: (tuple(statistics.median(col) for col in zip(*s)), s) for b, s in samples.items()}


def fmt_samples(samples, i=0):
    return ", ".join(f"{s[i]:.2f}" for s in samples)


def builds():
    return (BUILD,) if BEFORE is None else (BEFORE, BUILD)


def label_of(build):
    return "" if BEFORE is None else (" [before]" if build == BEFORE else " [after] ")


def run_size(base, mib):
    data = fresh(base, f"data-{mib}")
    try:
        t0 = time.time()
        init, deltas = make_data(data, mib)
        os.sync()
        print(f"== {NODES} x {mib} MiB F32 deltas ({TENSORS} tensors), files written in {time.time() - t0:.0f} s; "
              f"medians of {ROUNDS} fresh rounds")
        ref_s = float("nan")
        if "reference" in ONLY:
            r = median_of(lambda b, t: reference_round(t, init, deltas), base, "ref")[None]
            (ref_s, ref_rss, stall), s = r
            print(f"  {'Python reference round':37s} {ref_s:7.2f} s   peak RSS {ref_rss:7.0f} MiB   ({fmt_samples(s)}; "
                  f"memory stall {stall:.2f} s)")
        hwm = {b: [] for b in builds()}
        passes = {b: [] for b in builds()}
        rows = []
        if "file" in ONLY:
            rows += [("file:// critical path", lambda b, t: file_round(b, t, init, deltas, False), "file"),
                     ("file:// catch-up", lambda b, t: file_round(b, t, init, deltas, True), "file")]
        if "idle" in ONLY:
            rows += [(f"file:// critical path, {IDLE_S:.0f} s idle", lambda b, t: file_round(b, t, init, deltas, False,
                                                                                      True), "idle")]
        if "http" in ONLY:
            rows += [("HTTP critical path", lambda b, t: http_round(b, t, init, deltas, False), "http"),
                     ("HTTP round (8 concurrent)", lambda b, t: http_round(b, t, init, deltas, True), "http")]
        for label, fn, name in rows:
            for b, ((sec, pas, _, stall), s) in median_of(fn, base, name, builds()).items():
                hwm[b] += [x[2] for x in s]
                passes[b].append(pas)
                print(f"  {label + label_of(b):37s} {sec:7.2f} s   {ref_s / sec:5.2f}x the reference   "
                      f"(pass {pas:.2f} s; {fmt_samples(s)}; memory stall {stall:.2f} s)")
        for b in builds():
            if passes[b]:
                p = statistics.median(passes[b])
                print(f"  {'dilocod pass, in the daemon' + label_of(b):37s} {p:7.2f} s   "
                      f"{ref_s / p:5.2f}x the reference round")
        # the triad is measured again next to every pass sample: the machine's load changes within a run
        for warm in (False, True):
            def outer_sample(b, t):
                return bench_outer(b, t, init, deltas, warm) + (stream_triad(),)
            what = "pass alone, outputs warmed" if warm else "pass alone (bench-outer)"
            for b, ((sec, gbps, tri, stall), s) in median_of(outer_sample, base, "outer", builds()).items():
                print(f"  {what + label_of(b):37s} {sec:7.2f} s   "
                      f"{ref_s / sec:5.2f}x the reference   {gbps:.2f} GB/s read + written = {gbps / tri:.0%} of "
                      f"STREAM triad ({tri:.1f} GB/s, measured beside it; {fmt_samples(s)}; memory stall "
                      f"{stall:.2f} s)")
        for b in builds():
            if hwm[b]:
                print(f"  {'dilocod peak RSS (VmHWM)' + label_of(b):37s} {max(hwm[b]):7.0f} MiB "
                      f"(largest of {len(hwm[b])} runs)")
        print()
    finally:
        if os.environ.get("BENCH_KEEP"):
            print("kept", data)
        else:
            shutil.rmtree(data, ignore_errors=True)


def main():
    for b in builds():
        for f in ("dilocod", "tests/stream", "tests/bench-outer"):
            if not (b / f).exists():
                sys.exit(f"bench_round: {b / f} is missing: run make bench")
    base = Path(tempfile.mkdtemp(prefix="dilocod-roundbench-", dir=os.environ.get("BENCH_TMP", "/var/tmp")))
    try:
        triad = stream_triad()
        print("dilocod round benchmark, side by side in one run (a shared machine: compare the ratios)")
        print(f"machine: {os.cpu_count()} CPUs, STREAM triad {triad:.2f} GB/s; disk {base.parent}: write + "
              f"fdatasync {fdatasync_gbps(base):.2f} GB/s")
        print("targets (issue 12): critical path >= 5x the reference at 1 GiB, >= 3x at 256 MiB; catch-up >= 3x "
              "and >= 2x; pass >= 50% of triad; peak RSS <= 256 MiB\n")
        for mib in SIZES:
            run_size(base, mib)
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
