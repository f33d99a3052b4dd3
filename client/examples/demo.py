#!/usr/bin/env python3
"""`make demo`: a real DiLoCo training through dilocod, on this machine.

Starts dilocod on a file:// tree under ./demo/ with its HTTP API on 127.0.0.1:8470, bootstraps a
1.2M-parameter MLP, and runs N PyTorch workers (client/examples/torch_worker.py) that pull the
global over HTTP, train H inner steps with AdamW on their own data shard, and push their
pseudo-gradients.  Prints one line per round (step, nodes, aggregation time, mean worker loss) and
the dashboard URL.  When run from a terminal it keeps dilocod up after the last round so the
dashboard stays live, until Ctrl-C (or SIGTERM), which stops every process it started.  Without a
terminal (CI) it says that the dashboard stops with it, and exits.  A busy port is refused before
anything starts, with the DEMO_PORT to use instead.
"""
import argparse
import json
import os
import errno
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import torch_worker  # noqa: E402  (the model and its initial state)


def get_json(url, timeout=10):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read())


def port_busy(port):
    """Whether 127.0.0.1:port is taken (port 0 never is: dilocod picks a free one)."""
    if port == 0:
        return False
    s = socket.socket()
    try:
        s.bind(("127.0.0.1", port))
        return False
    except OSError as e:
        return e.errno == errno.EADDRINUSE
    finally:
        s.close()


def busy_message(port):
    return (f"demo: port {port} on 127.0.0.1 is in use (another dilocod or demo still running?): "
            f"run `make demo DEMO_PORT={port + 1}`, or DEMO_PORT=0 for any free port")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build", default="build")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--workers", type=int, default=3)
    ap.add_argument("--inner-steps", type=int, default=30)
    ap.add_argument("--port", type=int, default=8470, help="0 picks a free port")
    ap.add_argument("--dir", default="demo")
    a = ap.parse_args()
    if port_busy(a.port):
        raise SystemExit(busy_message(a.port))

    root = Path(a.dir).resolve()
    marker = root / ".dilocod-demo"
    if root.exists():
        # every demo starts from step 0, but only a directory an earlier demo made and marked is
        # removed: DEMO_DIR pointing at anything else (a home directory, a real run) is refused
        if root.is_symlink() or not root.is_dir() or (any(root.iterdir()) and not marker.is_file()):
            raise SystemExit(f"demo: {root} exists and was not made by the demo (no {marker.name} in it); "
                             f"refusing to delete it: choose another DEMO_DIR or remove it yourself")
        shutil.rmtree(root)
    (root / "hub").mkdir(parents=True)
    marker.write_text("made by client/examples/demo.py; `make demo` may delete this directory\n")
    init = root / "init.safetensors"
    from safetensors.torch import save_file
    save_file(torch_worker.init_state(), str(init))
    params = sum(v.numel() for v in torch_worker.init_state().values() if v.is_floating_point())

    log = open(root / "dilocod.log", "wb")
    dilocod = subprocess.Popen([str(Path(a.build) / "dilocod"), "--state-root", str(root / "state"),
                                "--hub", f"file://{root / 'hub'}", "--listen", f"127.0.0.1:{a.port}",
                                "--init-model", str(init), "--expected-nodes", str(a.workers),
                                "--poll-interval", "0.5", "--threads", "2"], stdout=log, stderr=log)
    procs = [dilocod]
    stopping = threading.Event()

    def stop_all(*_):
        stopping.set()
        for p in procs[1:]:
            if p.poll() is None:
                p.terminate()
        for p in procs[1:]:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
        if dilocod.poll() is None:
            dilocod.send_signal(signal.SIGTERM)
            try:
                dilocod.wait(timeout=60)
            except subprocess.TimeoutExpired:
                dilocod.kill()

    def interrupted(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, interrupted)
    signal.signal(signal.SIGTERM, interrupted)
    try:
        port = a.port
        deadline = time.time() + 30
        while True:
            m = re.findall(rb"http: listening addr=\S+ port=(\d+)", (root / "dilocod.log").read_bytes())
            if m:
                port = int(m[-1])
                break
            if dilocod.poll() is not None or time.time() > deadline:
                text = (root / "dilocod.log").read_text(errors="replace")
                sys.stdout.write(text)
                if "Address already in use" in text:      # taken between our check and dilocod's listen
                    raise SystemExit(busy_message(a.port))
                raise SystemExit(f"dilocod did not start (exit {dilocod.poll()})")
            time.sleep(0.05)
        url = f"http://127.0.0.1:{port}"
        print(f"dilocod is up: {url}   model: MLP, {params / 1e6:.2f}M parameters   workers: {a.workers}", flush=True)
        print(f"dashboard: {url}/", flush=True)

        losses = {}                 # round -> {node: loss}
        lock = threading.Lock()

        def read(p, node):
            for line in p.stdout:
                try:
                    rec = json.loads(line)
                except ValueError:
                    continue
                with lock:
                    losses.setdefault(rec["round"], {})[node] = rec["loss"]

        env = dict(os.environ, OMP_NUM_THREADS="1")
        for i in range(a.workers):
            node = f"worker-{i + 1}"
            p = subprocess.Popen([sys.executable, str(HERE / "torch_worker.py"), "--server", url, "--node-id", node,
                                  "--rounds", str(a.rounds), "--inner-steps", str(a.inner_steps), "--seed", str(i)],
                                 stdout=subprocess.PIPE, text=True, env=env)
            procs.append(p)
            threading.Thread(target=read, args=(p, node), daemon=True).start()

        printed = 0
        first = last = None
        while printed < a.rounds:
            for p in procs:
                if p.poll() not in (None, 0):
                    raise SystemExit(f"a demo process failed (exit {p.returncode}); see {root}/dilocod.log")
            rounds = get_json(f"{url}/rounds")["rounds"]
            for r in rounds:
                if r["step"] != printed:
                    continue
                with lock:
                    got = losses.get(r["step"], {})
                mean = sum(got.values()) / len(got) if got else float("nan")
                first = mean if first is None else first
                last = mean
                print(f"round {r['step']:3d}: step {r['step']} -> {r['outer_step']}, {len(r['nodes'])} nodes, "
                      f"aggregation {r['seconds'] * 1000:.1f} ms, mean worker loss {mean:.4f}", flush=True)
                printed += 1
            time.sleep(0.2)
        print(f"loss {first:.4f} -> {last:.4f} over {a.rounds} rounds "
              f"({'falling' if last < first else 'NOT falling'})", flush=True)
        for p in procs[1:]:
            p.wait(timeout=120)
        print(f"dashboard: {url}/   state: {root / 'state'}   log: {root / 'dilocod.log'}", flush=True)
        if sys.stdin.isatty():
            print("dilocod keeps serving the dashboard; press Ctrl-C to stop it", flush=True)
            while dilocod.poll() is None:
                time.sleep(0.5)
            raise SystemExit(f"dilocod stopped on its own (exit {dilocod.returncode}); see {root}/dilocod.log")
        else:
            # no terminal to press Ctrl-C in: the demo ends here and takes dilocod with it
            print("not a terminal: the demo ends now and dilocod stops with it, so the dashboard URL above "
                  "goes dead; run `make demo` from a terminal to keep it serving until Ctrl-C", flush=True)
        return 0 if last < first else 1
    except KeyboardInterrupt:
        print("\nstopping...", flush=True)
        return 130
    finally:
        stop_all()


if __name__ == "__main__":
    sys.exit(main())
