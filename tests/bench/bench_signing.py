"""Signing benchmark: what --signing-key adds to a step's critical path (README "Verifiable rounds").

One dilocod per configuration (signed and not, alternated run by run), file:// with an HTTP listener,
NODES workers writing F32 deltas of a MODEL_MIB model into the tree; each round's times are read from
the daemon's own pipeline log (debug level): the time its step spent in

  computing        the pass (and the round's deltas fsynced beside it: signed, their block hashes too)
  inputs_durable   the commit job: the redo record (signed: the outputs' block hashes, the record signed
                   and written first)
  served           until the transport published it (signed: the record published first)

and, for the signed run, `diloco verify-round --server` on its last step: its pass against the daemon's
("aggregate: done ... seconds") for the same step, and its total (the signature, the hashes of the
inputs and the previous global and momentum, the delta rules, the pass, the outputs' hashes; the files
fetched from /rounds/ before the clock starts).

and their sum, from the round's close to the step published: the critical path.  Each round, NODES - 1
deltas are taken in first, then the last one lands a second later (workers finish apart): the deltas
before it are hashed as they arrive, the last one beside the pass.  A report, not a test:
it asserts nothing.  Medians over BENCH_ROUNDS rounds per run, BENCH_RUNS runs per configuration.

Usage: bench_signing.py BUILD_DIR [MODEL_MIB ...]   (default 256)
env: BENCH_ROUNDS=4, BENCH_RUNS=2, BENCH_NODES=4, BENCH_TMP=/var/tmp
"""
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

BUILD = Path(sys.argv[1] if len(sys.argv) > 1 else "build").resolve()
SIZES = [int(x) for x in sys.argv[2:]] or [256]
ROUNDS = int(os.environ.get("BENCH_ROUNDS", "4"))
RUNS = int(os.environ.get("BENCH_RUNS", "2"))
NODES = int(os.environ.get("BENCH_NODES", "4"))
VERIFY = []     # (the daemon's pass, verify-round's pass, verify-round's total) seconds
MOVE = re.compile(r"pipeline: step moved step=(\d+) from=(\w+) to=(\w+) seconds=([0-9.]+)")


def write_delta(hub, node, base, local, arrays):
    d = hub / "nodes" / node
    d.mkdir(parents=True, exist_ok=True)
    tmp = d / f".tmp-{local}"
    save_file(arrays, str(tmp), metadata={"algorithm": "dumb_diloco", "base_outer_step": str(base),
                                          "local_step": str(local), "node_id": node})
    os.rename(tmp, d / f"delta_{local}.safetensors")


def run(tmp, mib, signed):
    n = mib * (1 << 20) // 4 // 8
    rng = np.random.default_rng(0)
    model = {f"t{i}": rng.standard_normal(n, dtype=np.float32) for i in range(8)}
    deltas = [{k: (rng.standard_normal(n, dtype=np.float32) * np.float32(0.01)) for k in model} for _ in range(NODES)]
    root = Path(tempfile.mkdtemp(dir=tmp))
    hub = root / "hub"
    hub.mkdir()
    save_file(model, str(root / "init.safetensors"))
    args = [str(BUILD / "dilocod"), "--state-root", str(root / "state"), "--hub", f"file://{hub}", "--listen",
            "127.0.0.1:0", "--init-model", str(root / "init.safetensors"), "--expected-nodes", str(NODES),
            "--poll-interval", "0.05", "--log-level", "debug"]
    if signed:
        subprocess.run([str(BUILD / "diloco"), "keygen", "-o", str(root / "key")], check=True, capture_output=True)
        args += ["--signing-key", str(root / "key")]
    log = root / "log"
    p = subprocess.Popen(args, stderr=open(log, "wb"), stdout=subprocess.DEVNULL)
    try:
        def wait_published(step):
            while f"hub: published step={step} " not in log.read_text(errors="replace"):
                if p.poll() is not None:
                    raise SystemExit(log.read_text()[-3000:])
                time.sleep(0.02)
        wait_published(0)
        accepted = 0
        for r in range(ROUNDS):
            # the critical path: NODES - 1 deltas taken in, then the last one lands (workers finish apart)
            for i in range(NODES - 1):
                write_delta(hub, f"w{i}", r, r + 1, deltas[i])
            accepted += NODES - 1
            while log.read_text(errors="replace").count("round: delta accepted") < accepted:
                time.sleep(0.02)
            time.sleep(1.0)
            write_delta(hub, f"w{NODES - 1}", r, r + 1, deltas[NODES - 1])
            accepted += 1
            wait_published(r + 1)
            time.sleep(0.5)         # the settle and cleanup out of the way of the next round
        if signed:
            # verify-round on the last step, fetched from the server (--verify-keep), against the pass that made it
            port = re.search(r"http: listening addr=\S+ port=(\d+)", log.read_text()).group(1)
            v = subprocess.run([str(BUILD / "diloco"), "verify-round", "--server", f"http://127.0.0.1:{port}", "--step",
                                str(ROUNDS), "--public-key", str(root / "key.pub")], capture_output=True, text=True)
            m = re.search(r"pass ([0-9.]+) s, total ([0-9.]+) s", v.stdout)
            done = re.findall(rf"aggregate: done step={ROUNDS} .*?seconds=([0-9.]+)", log.read_text())
            if v.returncode != 0 or m is None or not done:
                raise SystemExit(f"verify-round failed: {v.stdout} {v.stderr}")
            VERIFY.append((float(done[-1]), float(m.group(1)), float(m.group(2))))
    finally:
        p.terminate()
        p.wait()
    times = {}
    for m in MOVE.finditer(log.read_text()):
        step, frm, sec = int(m.group(1)), m.group(2), float(m.group(4))
        if step >= 1 and frm in ("computing", "inputs_durable", "served"):
            times.setdefault(step, {})[frm] = sec
    shutil.rmtree(root, ignore_errors=True)
    return [t for t in times.values() if len(t) == 3]


def main():
    tmp = os.environ.get("BENCH_TMP", "/var/tmp")
    for mib in SIZES:
        got = {False: [], True: []}
        for _ in range(RUNS):
            for signed in (False, True):
                got[signed] += run(tmp, mib, signed)
        print(f"model {mib} MiB F32, {NODES} nodes, file:// ({len(got[False])} and {len(got[True])} rounds)")
        for signed in (False, True):
            t = got[signed]
            med = {k: statistics.median(x[k] for x in t) for k in ("computing", "inputs_durable", "served")}
            total = statistics.median(sum(x.values()) for x in t)
            print(f"  {'signed  ' if signed else 'unsigned'}  computing {med['computing']:.3f} s  commit "
                  f"{med['inputs_durable']:.3f} s  publish {med['served']:.3f} s  critical path {total:.3f} s")
        for daemon_pass, v_pass, v_total in VERIFY:
            print(f"  verify-round of step {ROUNDS}: its pass {v_pass:.3f} s (the daemon's {daemon_pass:.3f} s), "
                  f"total {v_total:.3f} s with the fetch-free checks (hashes, delta rules, signature)")
        VERIFY.clear()


if __name__ == "__main__":
    main()
