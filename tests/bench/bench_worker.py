"""The worker package's cost (client/python, `diloco`): a round's pull + push for a model of MODEL_MIB
MiB of F32 (8 tensors) against the real dilocod (--hub none, one expected node), side by side in one run
(the machine is shared and noisy: compare the ratios).  A report, not a test.

Variants, each in a process of its own (its peak RSS is its own):
  raw      README's requests snippet: GET, safetensors load, load_state_dict, the F32 delta, save, PUT
  worker   diloco.Worker pull + push, plain F32
  mxfp8    diloco.Worker(encode="mxfp8") pull + push, error feedback on
Each runs ROUNDS rounds (the first is a warm-up, not counted); reported: the median pull and push
seconds, and the process's peak RSS above its RSS once torch was imported and the model built, in models
(a worker keeps one extra model for the baseline).  Then the encoders' throughput on CPU: diloco.encode_delta over the same model, MB of F32
input per second.

Usage: bench_worker.py BUILD_DIR [MODEL_MIB]   (default 256)
env: BENCH_ROUNDS=4
"""
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve()
TENSORS = 8


def model_state(mib):
    n = mib * 1024 * 1024 // 4 // TENSORS
    g = torch.Generator().manual_seed(0)
    return {f"layer{i}.weight": torch.randn(n, generator=g) * 0.02 for i in range(TENSORS)}


class Holder(torch.nn.Module):
    def __init__(self, state):
        super().__init__()
        for k, v in state.items():
            mod, name = k.split(".")
            if not hasattr(self, mod):
                self.add_module(mod, torch.nn.Module())
            getattr(self, mod).register_parameter(name, torch.nn.Parameter(v.clone()))


def train(model, r):
    """Stands for H inner steps: moves every weight a little."""
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1e-3 * (r + 1))


def raw_round(url, model, node, local_step):
    """README's raw snippet, timed in its pull and its push halves."""
    import requests
    from safetensors.torch import load, save
    t0 = time.perf_counter()
    r = requests.get(f"{url}/global/latest.safetensors")
    step = int(r.headers["X-Outer-Step"])
    model.load_state_dict(load(r.content), strict=False)
    baseline = {k: v.detach().clone() for k, v in model.state_dict().items()}
    t1 = time.perf_counter()
    train(model, local_step)
    t2 = time.perf_counter()
    delta = {k: (baseline[k].float() - v.detach().float()).contiguous()
             for k, v in model.state_dict().items() if v.is_floating_point() or v.is_complex()}
    meta = {"algorithm": "dumb_diloco", "base_outer_step": str(step), "local_step": str(local_step), "node_id": node}
    r = requests.put(f"{url}/nodes/{node}/delta_{local_step}.safetensors", data=save(delta, metadata=meta))
    r.raise_for_status()
    return step, t1 - t0, time.perf_counter() - t2


def rss(field="VmRSS"):
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0


def reset_peak():
    """Linux: writing 5 to clear_refs resets VmHWM, the peak RSS, to the current RSS (building the model
    made a temporary copy that is not the worker's)."""
    Path("/proc/self/clear_refs").write_text("5")


def child(variant, url, mib, rounds):
    import diloco
    import requests  # noqa: F401  (imported before the baseline RSS, as the package imports it)
    model = Holder(model_state(mib))
    before = rss()          # torch, the libraries and the model itself: what every variant starts from
    reset_peak()
    worker = None if variant == "raw" else diloco.Worker(url, "w0", encode="mxfp8" if variant == "mxfp8" else None)
    pulls, pushes = [], []
    for r in range(rounds):
        if worker is None:
            step, tp, tq = raw_round(url, model, "w0", r + 1)
            waiter = diloco.Worker(url, "w0")
        else:
            t0 = time.perf_counter()
            step = worker.pull(model)
            tp = time.perf_counter() - t0
            train(model, r)
            t1 = time.perf_counter()
            res = worker.push(model, local_step=r + 1)
            tq = time.perf_counter() - t1
            assert res.status == "accepted", res
            waiter = worker
        waiter.wait(step + 1, timeout=600)
        if r > 0:
            pulls.append(tp)
            pushes.append(tq)
    peak = rss("VmHWM")
    print(json.dumps({"pull": statistics.median(pulls), "push": statistics.median(pushes), "peak": peak,
                      "extra": peak - before}))


def encode_throughput(mib):
    import diloco
    base = model_state(mib)
    cur = {k: v + 1e-3 for k, v in base.items()}
    out = {}
    for enc in ("int8_block", "mxfp8", "mxfp4"):
        t0 = time.perf_counter()
        delta, res = diloco.encode_delta(base, cur, enc, metadata=diloco.delta_metadata("w0", 0, 1))
        bytes(delta)
        out[enc] = mib * 1048576 / 1e6 / (time.perf_counter() - t0)
    return out


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]))
        return 0
    sys.path.insert(0, str(HERE.parent.parent / "integration"))
    from dilocod_proc import Dilocod
    from safetensors.torch import save_file
    build = Path(sys.argv[1] if len(sys.argv) > 1 else "build").resolve()
    os.environ["DILOCO_BUILD"] = str(build)
    mib = int(sys.argv[2]) if len(sys.argv) > 2 else 256
    rounds = int(os.environ.get("BENCH_ROUNDS", "4"))
    torch.set_num_threads(os.cpu_count() or 1)
    results = {}
    with tempfile.TemporaryDirectory(prefix="bench-worker-", dir=os.environ.get("BENCH_TMP")) as tmp:
        tmp = Path(tmp)
        save_file(Holder(model_state(mib)).state_dict(), str(tmp / "init.safetensors"))
        for variant in ("raw", "worker", "mxfp8"):
            vt = tmp / variant
            vt.mkdir()
            d = Dilocod(vt, None, "--init-model", tmp / "init.safetensors", "--expected-nodes", "1").start()
            try:
                p = subprocess.run([sys.executable, str(HERE), "--child", variant, d.url, str(mib), str(rounds)],
                                   capture_output=True, text=True, check=True)
                results[variant] = json.loads(p.stdout.strip().splitlines()[-1])
            finally:
                d.stop()
    model_bytes = mib * 1048576
    raw = results["raw"]["pull"] + results["raw"]["push"]
    print(f"worker package, a {mib} MiB F32 model ({TENSORS} tensors), median of {rounds - 1} rounds:")
    print(f"{'variant':8} {'pull s':>8} {'push s':>8} {'round s':>8} {'x raw':>6} {'peak RSS':>10} "
          f"{'extra peak, in models':>22}")
    for v, r in results.items():
        tot = r["pull"] + r["push"]
        print(f"{v:8} {r['pull']:8.3f} {r['push']:8.3f} {tot:8.3f} {tot / raw:6.2f} "
              f"{r['peak'] / 1048576:8.0f}Mi {r['extra'] / model_bytes:22.2f}")
    tp = encode_throughput(mib)
    print("encode_delta on CPU (F32 input, MB/s): " + ", ".join(f"{k} {v:.0f}" for k, v in tp.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
