"""Compressed deltas' pass (README, "Compressed deltas"): the outer pass over 8 deltas of a model of
MODEL_MIB MiB of F32 (8 tensors), sent as F32, int8_block (block 32), mxfp8 and mxfp4, measured side by
side in one run (the machine is shared and noisy: compare the ratios).  A report, not a test.

Each variant is tests/bench-outer (common/outer.c alone: THREADS = CPUs, Nesterov SGD with a momentum
file, outputs deferred as the daemon's redo commit does), inputs in the page cache, run in turn REPEAT
times (round-robin); the median compute time of each is reported with the bytes it read (8 deltas, the
previous global and the momentum) and written (global and momentum), against one memory pass over those
bytes at the machine's STREAM triad bandwidth (tests/stream): how close the pass comes to the memory's
limit, whatever it decodes.  The compressed deltas hold valid random codes (no NaN code; scales that
cannot overflow): the pass's cost does not depend on the values.

Usage: bench_compress.py BUILD_DIR [MODEL_MIB]   (default 1024; 8 tensors, 8 deltas)
env: BENCH_TMP=/var/tmp, BENCH_REPEAT=3
"""
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "integration"))
import compress_oracle as co  # noqa: E402
from bench_robust import run as run_variant  # noqa: E402
from bench_round import TENSORS, write_delta, write_model  # noqa: E402

BUILD = Path(sys.argv[1] if len(sys.argv) > 1 else "build").resolve()
MIB = int(sys.argv[2]) if len(sys.argv) > 2 else 1024
REPEAT = int(os.environ.get("BENCH_REPEAT", "3"))
NODES = 8
ENCODINGS = ["int8_block", "mxfp8", "mxfp4"]


def write_compressed(path, enc, n, rng, node):
    """A compressed delta of TENSORS keys of n values: random valid codes, scales near 2^-7."""
    tensors = {}
    nscales = -(-n // 32)
    for i in range(TENSORS):
        key = f"layer{i}.weight"
        if enc == "int8_block":
            codes = rng.integers(-127, 128, n, dtype=np.int8)
            scales = np.full(nscales, 1e-4, np.float32)
        elif enc == "mxfp8":
            codes = rng.integers(0, 256, n, dtype=np.uint8)
            codes[(codes & 0x7f) == 0x7f] = 0
            scales = np.full(nscales, 120, np.uint8)
        else:
            codes = rng.integers(0, 256, n // 2, dtype=np.uint8)
            scales = np.full(nscales, 120, np.uint8)
        tensors[key] = (co.CODE_DTYPE[enc], (n,), codes)
        tensors[key + co.SUFFIX] = (co.SCALE_DTYPE[enc], (nscales,), scales)
    meta = {"algorithm": "dumb_diloco", "base_outer_step": "0", "local_step": "100", "node_id": f"w{node}",
            "encoding": enc, "block": "32"}
    path.write_bytes(co.serialize(tensors, meta))


def run(init, out, deltas, momentum):
    return run_variant({}, init, out, deltas, momentum)


def triad_gbps():
    p = subprocess.run([str(BUILD / "tests" / "stream")], capture_output=True, text=True, check=True)
    return float(re.search(r"triad_gbps ([\d.]+)", p.stdout).group(1))


def main():
    base = Path(os.environ.get("BENCH_TMP", "/var/tmp"))
    with tempfile.TemporaryDirectory(dir=base, prefix="bench-compress-") as tmp:
        tmp = Path(tmp)
        rng = np.random.default_rng(MIB)
        init = tmp / "init.safetensors"
        write_model(init, MIB, rng)
        n = MIB * (1 << 20) // 4 // TENSORS
        sets = {"F32": []}
        for k in range(NODES):
            sets["F32"].append(tmp / f"f32_w{k}.safetensors")
            write_delta(sets["F32"][-1], MIB, rng, k)
        for enc in ENCODINGS:
            sets[enc] = []
            for k in range(NODES):
                sets[enc].append(tmp / f"{enc}_w{k}.safetensors")
                write_compressed(sets[enc][-1], enc, n, rng, k)
        out = tmp / "out"
        out.mkdir()
        run(init, out, sets["F32"], None)         # a first step: its momentum is the one the timed steps read
        momentum = tmp / "momentum.safetensors"
        os.replace(out / "mom.safetensors", momentum)
        times = {name: [] for name in sets}
        for _ in range(REPEAT):
            for name, deltas in sets.items():
                times[name].append(run(init, out, deltas, momentum))
        gbps = triad_gbps()
        state = init.stat().st_size + momentum.stat().st_size
        f32_wall = statistics.median(t[0] for t in times["F32"])
        print(f"compressed deltas' pass, {NODES} deltas of a {MIB} MiB F32 model, {os.cpu_count()} threads, "
              f"medians of {REPEAT}; STREAM triad {gbps:.1f} GB/s:")
        for name, deltas in sets.items():
            wall = statistics.median(t[0] for t in times[name])
            cpu = statistics.median(t[1] for t in times[name])
            delta_bytes = sum(p.stat().st_size for p in deltas)
            moved = delta_bytes + 2 * state            # read: deltas, global, momentum; written: both
            floor = moved / (gbps * 1e9)
            print(f"  {name:11s} deltas {delta_bytes / 2**30:6.2f} GiB ({delta_bytes / sum(p.stat().st_size for p in sets['F32']):.3f} of F32)"
                  f"  pass {wall:6.3f} s ({wall / f32_wall:4.2f}x F32), CPU {cpu:6.3f} s"
                  f"  one memory pass over the {moved / 2**30:5.2f} GiB moved: {floor:6.3f} s ({wall / floor:4.2f}x)")


if __name__ == "__main__":
    main()
