"""Chaos beside real training: the chaos client (chaos.py, a separate process) misbehaves on many raw
sockets for CHAOS_SECONDS (default 60; CHAOS_SECONDS=600 for longer) while two normal workers complete
rounds over HTTP uploads (numpy deltas written with safetensors, as the reference writes them).  After
every round the global dilocod serves must equal the torch oracle (dilocod_proc.Oracle) bit for bit.

Asserted, with these bounds:
  - dilocod stays alive the whole time, and a brand-new client gets /healthz answered within
    PROBE_SECONDS (2 s; 4 s on sanitizer builds) at every probe, one probe per second;
  - every round's published global equals the oracle, and only the two real workers ever took part
    (the chaos client holds a real token for a "ghost" node that must never get a delta accepted);
  - the chaos client saw no violation (no 5xx, no 2xx to a bad upload, every response it read in full
    well formed, pipelined answers in order, 206 bodies equal to the bytes of the global with that ETag);
  - while chaos runs, open descriptors stay under baseline + max_connections + FD_SLACK_BUSY and RSS under
    baseline + RSS_SLACK_BUSY_MIB;
  - once chaos stops: descriptors back within FD_SLACK of the baseline (within 15 s), RSS within
    RSS_SLACK_MIB, no ASan/UBSan report in the log, and SIGTERM exits 0.
Also run against ASan: DILOCO_BUILD=$PWD/build-address-undefined (or any sanitizer build dir).
CHAOS_SEED picks another seed; CHAOS_ACTIONS=a,b,... limits the chaos to some misbehaviours (bisecting)."""
import json
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import requests
import torch
from safetensors.numpy import save as np_save
from safetensors.torch import load as torch_load_bytes

from conftest import BUILD
from dilocod_proc import Dilocod, Oracle, assert_state_close, assert_state_equal, delta_metadata, write_model

HERE = Path(__file__).resolve().parent
CHAOS_SECONDS = float(os.environ.get("CHAOS_SECONDS", "60"))
SANITIZED = "-" in BUILD.name and any(s in BUILD.name for s in ("address", "undefined", "asan", "thread"))
PROBE_SECONDS = 4.0 if SANITIZED else 2.0
PROBE_EVERY = 1.0
MAX_CONNECTIONS = 128
FD_SLACK = 16                   # after chaos: descriptors a quiet daemon may hold beyond its baseline
FD_SLACK_BUSY = 64              # during chaos, beyond baseline + max_connections (lingering closes, files)
RSS_SLACK_MIB = 192 if SANITIZED else 48        # ASan's quarantine (256 MiB by default) keeps freed memory
RSS_SLACK_BUSY_MIB = 320 if SANITIZED else 96
TOKENS = {n: f"{n}-token-{n * 8}" for n in ("w0", "w1", "h0", "h1", "ghost")}   # node -> bearer token
SANITIZER_MARKS = ("ERROR: AddressSanitizer", "ERROR: LeakSanitizer", "runtime error:", "ERROR: ThreadSanitizer",
                   "WARNING: ThreadSanitizer")


def torch_fuses_like_dilocod() -> bool:
    """torch's AVX2/AVX-512 kernels fuse the SGD multiply-adds as dilocod does; its default kernels do not
    (then only closeness is asserted, as test_torch_exact.py explains)."""
    for line in torch.__config__.show().splitlines():
        if "CPU capability usage:" in line:
            return line.split(":", 1)[1].strip() in ("AVX2", "AVX512")
    return False


EXACT = torch_fuses_like_dilocod()


def assert_matches_oracle(got, want):
    if EXACT:
        assert_state_equal(got, want)
    else:
        assert_state_close(got, want)


# ---- process measurements ---------------------------------------------------------------------------

def open_fds(pid) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def fd_kinds(pid):
    """(sockets, other descriptors): connections are chaos noise, files and pipes are not."""
    socks = other = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:"):
            socks += 1
        else:
            other += 1
    return socks, other


def rss_kib(pid) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def cpu_seconds(pid) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def du_kib(path: Path) -> int:
    """What du reports: allocated blocks of every file and directory under path, in KiB."""
    total = 0
    seen = set()
    for root, dirs, files in os.walk(path):
        for name in [*dirs, *files]:
            try:
                st = os.lstat(os.path.join(root, name))
            except OSError:
                continue
            if (st.st_dev, st.st_ino) in seen:
                continue
            seen.add((st.st_dev, st.st_ino))
            total += st.st_blocks * 512
    try:
        total += os.lstat(path).st_blocks * 512
    except OSError:
        pass
    return total // 1024


def sanitizer_reports(d: Dilocod) -> list:
    return [line for line in d.log_text().splitlines() if any(m in line for m in SANITIZER_MARKS)]


# ---- clients --------------------------------------------------------------------------------------

def session():
    s = requests.Session()
    s.trust_env = False
    return s


def retrying(fn, what, timeout=60.0):
    """Runs fn() until it returns without a connection error (the chaos may fill the server's
    connection table for a moment, as any busy server's would be); a real worker retries too."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        try:
            return fn()
        except (requests.ConnectionError, requests.Timeout) as e:
            last = e
            time.sleep(0.1)
    raise AssertionError(f"{what}: no answer within {timeout}s ({last!r})")


def http_get(url, path, headers=None, timeout=20):
    def go():
        with session() as s:
            return s.get(url + path, headers=headers or {}, timeout=timeout)
    return retrying(go, f"GET {path}")


def get_global(url):
    r = http_get(url, "/global/latest.safetensors")
    assert r.status_code == 200, (r.status_code, r.text[:300])
    return int(r.headers["X-Outer-Step"]), r.content


def get_global_after_status(url, step, lagging, within=5.0):
    """GET the global once /status said outer_step >= step: it must be that step at once (a client that
    waits for the step and then pulls must get it).  When it is older, the lag is recorded in
    `lagging` (asserted empty at the end) and the GET retried, so the rest of the test still runs."""
    t0 = time.monotonic()
    got, blob = get_global(url)
    if got == step:
        return got, blob
    first = got
    while got < step and time.monotonic() - t0 < within:
        time.sleep(0.005)
        got, blob = get_global(url)
    lagging.append((step, first, round(time.monotonic() - t0, 3)))
    assert got == step, f"/status said outer_step {step}, GET /global still serves {got} after {within}s"
    return got, blob


def upload(url, node, step, local, tensors):
    """PUT the delta with the node's token; a retry after a lost answer may find it already taken."""
    blob = np_save(tensors, metadata=delta_metadata(node, step, local))
    headers = {"Authorization": f"Bearer {TOKENS[node]}"}
    attempts = [0]

    def go():
        attempts[0] += 1
        with session() as s:
            return s.put(f"{url}/nodes/{node}/delta_{local}.safetensors", data=blob, headers=headers, timeout=30)
    r = retrying(go, f"PUT {node} step {step}")
    if r.status_code == 201:
        return r.json()
    code = r.json().get("error", {}).get("code") if r.headers.get("Content-Type", "").startswith(
        "application/json") else None
    assert attempts[0] > 1 and r.status_code == 409 and code in ("not_newer", "stale"), \
        (node, step, r.status_code, r.text[:500])
    return None


def status(url):
    r = http_get(url, "/status")
    assert r.status_code == 200, r.text
    return r.json()


def wait_outer_step(d: Dilocod, url, step, timeout=60):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert d.alive(), f"dilocod died (exit {d.proc.poll()}):\n{d.log_text()[-4000:]}"
        if status(url)["outer_step"] >= step:
            return
        time.sleep(0.01)
    raise AssertionError(f"outer step {step} not reached within {timeout}s: {json.dumps(status(url))[:2000]}")


def make_deltas(model, rnd, nodes):
    """One F32 delta per node (floating keys only), reproducible from the round and node."""
    out = {}
    for i, node in enumerate(nodes):
        rng = np.random.default_rng([rnd, i, 77])
        d = {}
        for k, v in model.items():
            if v.is_floating_point():
                scale = 0.01 * (1 + (rnd + i) % 3)
                d[k] = np.asarray(rng.standard_normal(tuple(v.shape)) * scale, dtype=np.float32)
        out[node] = d
    return out


class Prober:
    """A thread that, every PROBE_EVERY seconds, asks /healthz as a brand-new client and records how long
    the answer took; a probe that gets no 200 within PROBE_SECONDS is a failure."""

    def __init__(self, d: Dilocod, url):
        self.d, self.url = d, url
        self.latencies = []
        self.failures = []
        self.dead = None
        self.stop_event = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True, name="prober")

    def probe_once(self):
        t0 = time.monotonic()
        deadline = t0 + PROBE_SECONDS
        last = None
        while time.monotonic() < deadline:
            try:
                with session() as s:
                    r = s.get(self.url + "/healthz", timeout=max(0.1, deadline - time.monotonic()))
                if r.status_code == 200:
                    return time.monotonic() - t0, None
                last = r.status_code
            except requests.RequestException as e:
                last = e
            time.sleep(0.05)
        return time.monotonic() - t0, last

    def run(self):
        while not self.stop_event.is_set():
            if not self.d.alive():
                self.dead = self.d.proc.poll() if self.d.proc else "gone"
                return
            took, err = self.probe_once()
            self.latencies.append(took)
            if err is not None:
                self.failures.append((time.strftime("%H:%M:%S"), repr(err)[:200]))
            self.stop_event.wait(PROBE_EVERY)

    def start(self):
        self.thread.start()
        return self

    def stop(self):
        self.stop_event.set()
        self.thread.join(timeout=PROBE_SECONDS + 5)

    def summary(self):
        lat = sorted(self.latencies) or [0.0]
        return (f"probes: {len(self.latencies)}, failures {len(self.failures)}, latency median "
                f"{lat[len(lat) // 2] * 1000:.1f} ms, max {lat[-1] * 1000:.1f} ms")


class ChaosProcess:
    """chaos.py as its own process (its threads do not share the workers' GIL)."""

    def __init__(self, url, seconds, seed, out: Path, threads=16, victims=("w0", "w1")):
        self.stats_path = out / f"chaos-{seed}.json"
        self.log_path = out / f"chaos-{seed}.log"
        self.proc = subprocess.Popen(
            [sys.executable, str(HERE / "chaos.py"), "--url", url, "--seconds", str(seconds), "--seed", str(seed),
             "--threads", str(threads), "--ghost", f"ghost:{TOKENS['ghost']}", "--victims", ",".join(victims),
             "--stats", str(self.stats_path),
             *(["--actions", os.environ["CHAOS_ACTIONS"]] if os.environ.get("CHAOS_ACTIONS") else [])],
            stdout=open(self.log_path, "wb"), stderr=subprocess.STDOUT)

    def running(self):
        return self.proc.poll() is None

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    def wait(self, timeout):
        self.proc.wait(timeout=timeout)
        stats = json.loads(self.stats_path.read_text())
        return stats, self.log_path.read_text(errors="replace")


def chaos_model():
    """~1 MiB: big enough that a global download outlasts the socket buffers (resets mid-download,
    slow readers), small enough for quick rounds.  F32, BF16, F16 and an I64 buffer."""
    g = torch.Generator().manual_seed(9)
    return {
        "w": torch.randn(256, 1000, generator=g),
        "b": torch.randn(1000, generator=g).to(torch.bfloat16),
        "h": torch.randn(33, 7, generator=g).to(torch.float16),
        "count": torch.tensor([3, -1, 1 << 40], dtype=torch.int64),
    }


def start_daemon(tmp_path, model, *extra, hub=None, nodes=("w0", "w1")):
    write_model(tmp_path / "init.safetensors", model)
    tokens = tmp_path / "tokens"
    tokens.write_text("".join(f"{n} {t}\n" for n, t in TOKENS.items()))
    tokens.chmod(0o600)         # dilocod refuses a token file others can read
    d = Dilocod(tmp_path, hub, "--init-model", str(tmp_path / "init.safetensors"), "--expected-nodes",
                str(len(nodes)), "--token-file", str(tokens), "--header-timeout", "3", "--idle-timeout", "5",
                "--max-connections", str(MAX_CONNECTIONS), "--threads", "2", "--log-level", "info", *extra)
    d.start()
    url = d.url
    deadline = time.monotonic() + 30
    while True:
        try:
            if http_get(url, "/healthz", timeout=2).status_code == 200:
                break
        except AssertionError:
            pass
        assert time.monotonic() < deadline and d.alive(), d.log_text()[-3000:]
        time.sleep(0.05)
    return d, url


def check_rounds_history(url, rounds, nodes):
    """/rounds names exactly the real workers for every round: the ghost never got in."""
    hist = http_get(url, "/rounds").json()["rounds"]
    for entry in hist:
        got = sorted(n["node_id"] for n in entry.get("nodes", []))
        assert got == sorted(nodes), f"round {entry.get('step')} aggregated {got}, expected {sorted(nodes)}"
    st = status(url)
    assert st["counters"]["rounds"] >= rounds, st["counters"]


# ---- the test ---------------------------------------------------------------------------------------

def test_rounds_stay_exact_under_chaos(tmp_path):
    model = chaos_model()
    d, url = start_daemon(tmp_path, model)
    nodes = ["w0", "w1"]
    pid = d.proc.pid
    oracle = Oracle(model)
    chaos = prober = None
    try:
        # warm-up round without chaos: the global is mapped, the pool's threads exist
        rnd = 0

        def do_round(rnd):
            deltas = make_deltas(model, rnd, nodes)

            def work(node):
                step, _ = get_global(url)
                assert step == rnd, (node, step, rnd)
                upload(url, node, rnd, 100 * (rnd + 1), deltas[node])
            with ThreadPoolExecutor(len(nodes)) as ex:
                for f in [ex.submit(work, n) for n in nodes]:
                    f.result()
            wait_outer_step(d, url, rnd + 1)
            want = oracle.step(deltas)
            step, blob = get_global_after_status(url, rnd + 1, lagging)
            try:
                assert_matches_oracle(torch_load_bytes(blob), want)
            except AssertionError as e:
                raise AssertionError(f"round {rnd}: the published global differs from the torch oracle: {e}")

        lagging = []
        do_round(rnd)
        rnd += 1
        time.sleep(0.5)
        base_fds, base_rss = open_fds(pid), rss_kib(pid)
        print(f"\nbaseline: {base_fds} descriptors, RSS {base_rss} KiB; chaos for {CHAOS_SECONDS:.0f} s")

        chaos = ChaosProcess(url, CHAOS_SECONDS, seed=int(os.environ.get("CHAOS_SEED", "1")), out=tmp_path)
        prober = Prober(d, url).start()
        max_fds = max_rss = 0
        t0 = time.monotonic()
        while chaos.running():
            assert d.alive(), f"dilocod died under chaos (exit {d.proc.poll()}):\n{d.log_text()[-4000:]}"
            do_round(rnd)
            rnd += 1
            max_fds, max_rss = max(max_fds, open_fds(pid)), max(max_rss, rss_kib(pid))
            assert max_fds <= base_fds + MAX_CONNECTIONS + FD_SLACK_BUSY, \
                f"{max_fds} descriptors during chaos (baseline {base_fds})"
            assert max_rss <= base_rss + RSS_SLACK_BUSY_MIB * 1024, \
                f"RSS {max_rss} KiB during chaos (baseline {base_rss} KiB)"
            assert time.monotonic() - t0 < CHAOS_SECONDS + 120, "chaos did not stop"
        stats, chaos_log = chaos.wait(timeout=60)
        prober.stop()
        elapsed = time.monotonic() - t0
        from chaos import summary
        print(summary(stats))
        print(prober.summary())
        print(f"rounds under chaos: {rnd - 1} in {elapsed:.1f} s; peak {max_fds} descriptors, "
              f"peak RSS {max_rss} KiB")

        # every bound is checked and every failure reported together (one run shows the whole picture)
        problems = []

        def expect(ok, msg):
            if not ok:
                problems.append(msg)
        assert prober.dead is None, f"dilocod died (exit {prober.dead}):\n{d.log_text()[-4000:]}"
        expect(not prober.failures, f"{len(prober.failures)} probes not served within {PROBE_SECONDS}s: "
                                    f"{prober.failures[:10]}")
        expect(stats["violation_count"] == 0, "the chaos client saw violations:\n" + "\n".join(stats["violations"]))
        expect(sum(stats["actions"].values()) >= CHAOS_SECONDS, f"too few chaos actions {stats['actions']}")
        expect(rnd - 1 >= 5, f"only {rnd - 1} rounds completed under {CHAOS_SECONDS} s of chaos")
        expect(not lagging, f"{len(lagging)} times /status named a step before GET /global served it "
                            f"(step, served, seconds until served): {lagging[:10]}")

        # one more round after the chaos, then the bounds
        do_round(rnd)
        rnd += 1
        check_rounds_history(url, rnd, nodes)
        deadline = time.monotonic() + 15
        while open_fds(pid) > base_fds + FD_SLACK and time.monotonic() < deadline:
            time.sleep(0.1)
        fds, rss = open_fds(pid), rss_kib(pid)
        print(f"after chaos: {fds} descriptors (baseline {base_fds}), RSS {rss} KiB (baseline {base_rss})")
        expect(fds <= base_fds + FD_SLACK, f"{fds} descriptors after chaos, baseline {base_fds} (+{FD_SLACK})")
        expect(rss <= base_rss + RSS_SLACK_MIB * 1024,
               f"RSS {rss} KiB after chaos, baseline {base_rss} KiB (+{RSS_SLACK_MIB} MiB)")
        rc = d.stop(timeout=60)
        expect(rc == 0, f"SIGTERM: exit {rc}\n{d.log_text()[-3000:]}")
        reports = sanitizer_reports(d)
        expect(not reports, "sanitizer reports in the daemon log:\n" + "\n".join(reports[:20]))
        assert not problems, "\n".join(problems)
    finally:
        if chaos is not None:
            chaos.stop()
            try:
                chaos.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                chaos.proc.kill()
        if prober is not None:
            prober.stop()
        if d.alive():
            d.kill9()
        elif d.proc is not None and d.proc.returncode not in (0, None):
            print(f"dilocod exit {d.proc.returncode}; log ends:\n{d.log_text()[-4000:]}")
