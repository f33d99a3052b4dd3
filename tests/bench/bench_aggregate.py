"""Round aggregation benchmark: dilocod next to the Python reference and to the memory bandwidth,
measured side by side in one run (these machines are shared: compare the ratios, not the absolute
numbers).  A report, not a test: it asserts nothing.

For N nodes and a model of MODEL_MIB MiB (F32):
  (a) the Python reference: load_file each delta, FP32 average, torch.optim.SGD Nesterov step,
      save_file of the new global (and torch.save of the momentum, as the reference's outer_state.pt);
  (b) STREAM triad bandwidth of this machine (tests/bench/stream.c);
  dilocod: the aggregation time it logs (open inputs .. files durable and committed) and its
      effective bandwidth (bytes read + written / seconds), plus its peak RSS (VmHWM).
Usage: bench_aggregate.py BUILD_DIR [MODEL_MIB] [NODES ...]
"""
import json
import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

BUILD = Path(sys.argv[1]).resolve()
MODEL_MIB = int(sys.argv[2]) if len(sys.argv) > 2 else 1024
NODES = [int(x) for x in sys.argv[3:]] or [2, 8]
TENSORS = 8

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


def write_model(path, rng, scale):
    from safetensors.numpy import save_file
    n = MODEL_MIB * (1 << 20) // 4 // TENSORS
    block = (rng.standard_normal(1 << 20) * scale).astype(np.float32)
    state = {f"layer{i}.weight": np.resize(np.roll(block, i), n) for i in range(TENSORS)}
    save_file(state, str(path))


def write_delta(path, rng, node, base):
    from safetensors.numpy import save_file
    n = MODEL_MIB * (1 << 20) // 4 // TENSORS
    block = (rng.standard_normal(1 << 20) * 0.01).astype(np.float32)
    state = {f"layer{i}.weight": np.resize(np.roll(block, i + node), n) for i in range(TENSORS)}
    meta = {"algorithm": "dumb_diloco", "base_outer_step": str(base), "local_step": "100", "node_id": f"w{node}"}
    save_file(state, str(path), metadata=meta)


def drop_caches_hint():
    subprocess.run(["sync"], check=False)


def run_dilocod(tmp, hub, init, nodes):
    state = tmp / "state"
    log = tmp / "dilocod.log"
    proc = subprocess.Popen([str(BUILD / "dilocod"), "--state-root", str(state), "--hub", f"file://{hub}",
                             "--init-model", str(init), "--expected-nodes", str(nodes), "--poll-interval", "0.05",
                             "--threads", str(os.cpu_count()), "--log-level", "debug"], stderr=open(log, "wb"))
    try:
        deadline = time.time() + 3600
        while time.time() < deadline:
            text = log.read_text()
            m = re.search(r"aggregate: done step=1 nodes=\d+ seconds=([\d.]+) gbps=([\d.]+) bytes=(\d+)", text)
            if m and "published step=1" in text:
                status = Path(f"/proc/{proc.pid}/status").read_text()
                hwm = int(re.search(r"VmHWM:\s+(\d+) kB", status).group(1))
                c = re.search(r"aggregate: computed step=1 seconds=([\d.]+)", text)
                return float(m.group(1)), int(m.group(3)), hwm, float(c.group(1)) if c else float("nan")
            if proc.poll() is not None:
                raise RuntimeError(f"dilocod exited: {text[-2000:]}")
            time.sleep(0.05)
        raise RuntimeError("dilocod did not finish the round")
    finally:
        proc.terminate()
        proc.wait(timeout=120)


def disk_write_gbps(directory, mib=512):
    """Buffered write + fsync of MIB MiB: the floor under any durable commit of that much data."""
    path = Path(directory) / "disk-probe"
    block = os.urandom(1 << 20)
    t0 = time.time()
    with open(path, "wb") as f:
        for _ in range(mib):
            f.write(block)
        f.flush()
        os.fsync(f.fileno())
    dt = time.time() - t0
    path.unlink()
    return mib * (1 << 20) / dt / 1e9


def main():
    stream = subprocess.run([str(BUILD / "tests" / "stream")], capture_output=True, text=True, check=True).stdout
    triad = float(stream.split()[1])
    print(f"STREAM triad: {triad:.2f} GB/s ({stream.split()[3]} threads)")
    disk = disk_write_gbps(os.environ.get("BENCH_TMP", "/var/tmp"))
    print(f"disk: buffered write + fsync {disk:.2f} GB/s (each step durably writes the global and the momentum)")
    print(f"model: {MODEL_MIB} MiB F32 in {TENSORS} tensors\n")
    rows = []
    for nodes in NODES:
        tmp = Path(tempfile.mkdtemp(prefix="dilocod-bench-", dir=os.environ.get("BENCH_TMP", "/var/tmp")))
        try:
            rng = np.random.default_rng(nodes)
            hub = tmp / "hub"
            init = tmp / "init.safetensors"
            write_model(init, rng, 1.0)
            deltas = []
            for i in range(nodes):
                p = hub / "nodes" / f"w{i}" / "delta_100.safetensors"
                p.parent.mkdir(parents=True)
                write_delta(p, rng, i, 0)
                deltas.append(p)
            drop_caches_hint()
            ref = subprocess.run([sys.executable, "-c", REFERENCE, str(init), str(tmp / "ref.safetensors"),
                                  str(tmp / "ref_state.pt"), *map(str, deltas)],
                                 capture_output=True, text=True, check=True)
            ref_s, ref_rss_kb = ref.stdout.split()
            ref_s, ref_rss = float(ref_s), int(ref_rss_kb) / 1024
            d_s, d_bytes, d_hwm, d_compute = run_dilocod(tmp, hub, init, nodes)
            gbps = d_bytes / d_s / 1e9
            cgbps = d_bytes / d_compute / 1e9
            rows.append((nodes, d_s, gbps, d_hwm / 1024, ref_s, ref_rss))
            print(f"N={nodes}: dilocod {d_s:.2f} s to a durable commit ({gbps:.2f} GB/s effective, "
                  f"{gbps / triad:.0%} of STREAM triad); compute pass {d_compute:.2f} s ({cgbps:.2f} GB/s, "
                  f"{cgbps / triad:.0%} of triad); peak RSS {d_hwm / 1024:.0f} MiB")
            print(f"      Python reference {ref_s:.2f} s (peak RSS {ref_rss:.0f} MiB, no fsync) -> "
                  f"dilocod is {ref_s / d_s:.1f}x faster")
        finally:
            if os.environ.get("BENCH_KEEP"):
                print("kept", tmp)
            else:
                shutil.rmtree(tmp, ignore_errors=True)
    print("\ntargets: >= 3x the reference, >= 50% of STREAM triad, RSS < 256 MiB")


if __name__ == "__main__":
    main()
