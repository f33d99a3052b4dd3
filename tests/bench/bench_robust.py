"""Robust aggregation's cost: the pass of each --aggregate rule, and the cosine screen's two passes,
against the mean's one pass, over the same 8 deltas, measured side by side in one run (the machine is
shared and noisy: compare the ratios).  A report, not a test: it asserts nothing.

Each variant is tests/bench-outer (the daemon's pass, common/outer.c, alone: THREADS = CPUs, Nesterov SGD
with a momentum file, outputs deferred as the daemon's redo commit does), inputs in the page cache, run in
turn REPEAT times (round-robin, so drift hits them alike); the median compute time (wall and CPU) of each is
reported, with its ratio to the mean's.  "cosine screen" is the statistics-only first pass followed by a
mean pass: what --screen cosine:MIN adds to a round's critical path.

Usage: bench_robust.py BUILD_DIR [MODEL_MIB]   (default 256; 8 tensors, 8 deltas)
env: BENCH_TMP=/var/tmp, BENCH_REPEAT=5
"""
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from bench_round import write_delta, write_model

BUILD = Path(sys.argv[1] if len(sys.argv) > 1 else "build").resolve()
MIB = int(sys.argv[2]) if len(sys.argv) > 2 else 256
REPEAT = int(os.environ.get("BENCH_REPEAT", "5"))
NODES = 8
VARIANTS = [("mean", {}), ("weighted_mean", {"RULE": "weighted_mean"}), ("clipped_mean", {"RULE": "clipped_mean"}),
            ("trimmed_mean:1", {"RULE": "trimmed_mean", "TRIM_K": "1"}), ("median", {"RULE": "median"}),
            ("screen pass (stats only)", {"STATS_ONLY": "1"})]


def run(env_extra, init, out, deltas, momentum):
    env = dict(os.environ, DEFER="1", **env_extra)
    if momentum is not None:
        env["MOMENTUM"] = str(momentum)
    p = subprocess.run([str(BUILD / "tests" / "bench-outer"), str(os.cpu_count()), str(init), str(out),
                        *map(str, deltas)], env=env, capture_output=True, text=True, check=True)
    m = re.search(r"compute ([\d.]+) s \(([\d.]+) GB/s; ([\d.]+) CPU s\)", p.stdout)
    return float(m.group(1)), float(m.group(3))


def main():
    base = Path(os.environ.get("BENCH_TMP", "/var/tmp"))
    with tempfile.TemporaryDirectory(dir=base, prefix="bench-robust-") as tmp:
        tmp = Path(tmp)
        rng = np.random.default_rng(MIB)
        init = tmp / "init.safetensors"
        write_model(init, MIB, rng)
        deltas = []
        for k in range(NODES):
            deltas.append(tmp / f"delta_w{k}.safetensors")
            write_delta(deltas[-1], MIB, rng, k)
        out = tmp / "out"
        out.mkdir()
        run({}, init, out, deltas, None)          # a first step: its momentum is the one the timed steps read
        momentum = tmp / "momentum.safetensors"
        os.replace(out / "mom.safetensors", momentum)
        times = {name: [] for name, _ in VARIANTS}
        for _ in range(REPEAT):
            for name, env in VARIANTS:
                times[name].append(run(env, init, out, deltas, momentum))
        med = {name: (statistics.median(t[0] for t in v), statistics.median(t[1] for t in v)) for name, v in times.items()}
        mean_wall, mean_cpu = med["mean"]
        print(f"robust aggregation, {NODES} deltas x {MIB} MiB F32, {os.cpu_count()} threads, medians of {REPEAT}:")
        for name, (wall, cpu) in med.items():
            print(f"  {name:26s} {wall:7.3f} s ({wall / mean_wall:5.2f}x mean)  CPU {cpu:7.3f} s ({cpu / mean_cpu:5.2f}x)")
        sw, sc = med["screen pass (stats only)"]
        print(f"  {'cosine screen: both passes':26s} {sw + mean_wall:7.3f} s ({(sw + mean_wall) / mean_wall:5.2f}x mean)"
              f"  CPU {sc + mean_cpu:7.3f} s ({(sc + mean_cpu) / mean_cpu:5.2f}x)")


if __name__ == "__main__":
    main()
