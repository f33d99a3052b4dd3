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

--mode async (`make demo DEMO_MODE=async`) starts dilocod with --mode async (--dn-period <workers>,
--grace-ms 20, --dn-variant paper --momentum 0, --dylu-base-steps <inner steps>: see async_args) and
the workers with --mode async: each delta is one update, and a
worker trains from the newest global after each push instead of waiting for the others.  The demo
prints one line per update (its nodes with their staleness tau, the loss of the phases that made it).
The workers follow dilocod's X-Recommended-Local-Steps (DyLU) unless --ignore-recommended-steps.

--speeds 1,1,3 (DEMO_SPEEDS) slows worker i down by speeds[i]: each of its inner steps lasts that many
times as long (a straggler), in either mode.  --target-loss L evaluates every global the demo sees (kept
in memory, evaluated after the run so that takes no CPU from the workers) on the workers' data and on
held-out data, and prints when the former first reached L, in wall-clock seconds from the workers'
start.

--faulty N (DEMO_FAULTY=N) makes worker N (1-based; 0: none) faulty: it sends its delta x 100.  dilocod
then runs with --max-norm-ratio 10, which quarantines it, and (sync) --min-nodes <workers - 1> with a
--round-timeout of 5 s, so each round closes without it; the dashboard shows it quarantined, and the
loss, of the other workers, still falls.
"""
import argparse
import json
import os
import errno
import re
import shlex
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


def speeds_of(text, workers):
    """--speeds: empty for all 1, else one factor >= 1 per worker."""
    if not text:
        return [1.0] * workers
    try:
        out = [float(x) for x in text.split(",")]
    except ValueError:
        raise SystemExit(f"demo: --speeds {text!r}: give comma-separated numbers, e.g. 1,1,3")
    if len(out) != workers or any(not f >= 1 for f in out):
        raise SystemExit(f"demo: --speeds {text!r}: give {workers} factors, each at least 1 (one per worker)")
    return out


def fmt_speed(f):
    return f"{f:g}"


class GlobalWatch:
    """Keeps every global the server publishes (polled), with when it was seen, for evaluation after the run."""

    def __init__(self, url, t0):
        self.url, self.t0 = url, t0
        self.seen = []              # (seconds since t0, step, safetensors bytes)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self):
        last = None
        while not self.stop.is_set():
            try:
                step = get_json(f"{self.url}/status")["outer_step"]
                if step is not None and step != last:
                    with urllib.request.urlopen(f"{self.url}/global/latest.safetensors", timeout=30) as r:
                        t, got, data = time.time() - self.t0, int(r.headers["X-Outer-Step"]), r.read()
                    if got != last:
                        self.seen.append((t, got, data))
                        last = got
            except (OSError, ValueError, KeyError):
                pass
            self.stop.wait(0.02)

    def evaluate(self, target, workers):
        """Prints the loss of each global seen on the workers' data (the first 1024 examples of each
        shard: the objective they train) and on held-out data, and when the former first reached target."""
        import torch
        from safetensors.torch import load
        torch.set_num_threads(1)
        parts = [torch_worker.shard(i, n=1024) for i in range(workers)]
        x, y = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
        hx, hy = torch_worker.shard(99_999, n=2048)
        model, loss_fn = torch_worker.MLP(), torch.nn.CrossEntropyLoss()
        reached = None
        for t, step, data in self.seen:
            model.load_state_dict(load(data))
            with torch.no_grad():
                loss, held = loss_fn(model(x), y).item(), loss_fn(model(hx), hy).item()
            print(f"global step {step:3d} at {t:6.2f} s: loss {loss:.4f} (held-out {held:.4f})", flush=True)
            if reached is None and loss <= target:
                reached = (step, t)
        if reached:
            print(f"target loss {target:.4f} reached at step {reached[0]} after {reached[1]:.2f} s", flush=True)
        else:
            print(f"target loss {target:.4f} not reached", flush=True)
        return reached


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build", default="build")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--workers", type=int, default=3)
    ap.add_argument("--inner-steps", type=int, default=30)
    ap.add_argument("--port", type=int, default=8470, help="0 picks a free port")
    ap.add_argument("--dir", default="demo")
    ap.add_argument("--mode", choices=("sync", "async"), default="sync", help="dilocod's --mode, and the workers'")
    ap.add_argument("--speeds", default="", help="per-worker slowdown factors, e.g. 1,1,3 (empty: all 1)")
    ap.add_argument("--ignore-recommended-steps", action="store_true",
                    help="async: the workers keep --inner-steps, whatever dilocod recommends (no DyLU)")
    ap.add_argument("--target-loss", type=float, default=None,
                    help="evaluate the globals on a held-out set; print when the loss first reached this")
    ap.add_argument("--faulty", type=int, default=0, help="worker N (1-based) sends its delta x 100 (0: none)")
    ap.add_argument("--encode", default="", choices=("", "int8_block", "mxfp8", "mxfp4"),
                    help="the workers send compressed deltas (the diloco package's encoders; empty: F32)")
    ap.add_argument("--no-error-feedback", action="store_true", help="--encode without the workers' residuals")
    ap.add_argument("--downlink", default="", choices=("", "mxfp8", "mxfp4"),
                    help="dilocod --downlink: the workers replay each step's compressed update (empty: the global)")
    ap.add_argument("--dilocod-args", default="", help="async: more dilocod options, e.g. '--momentum 0.9'")
    a = ap.parse_args()
    speeds = speeds_of(a.speeds, a.workers)
    if not 0 <= a.faulty <= a.workers or (a.faulty and a.workers < 3):
        raise SystemExit(f"demo: --faulty {a.faulty}: give 0 (none) or a worker 1..{a.workers}, with 3 workers or more "
                         f"(the norm screen takes the median of the others)")
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
                                "--poll-interval", "0.5", "--threads", "2", *async_args(a), *faulty_args(a),
                                *(["--downlink", a.downlink] if a.downlink else [])],
                               stdout=log, stderr=log)
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
        how = ("" if a.mode == "sync" else
               f" (async: dn_period {a.workers}, grace 20 ms, dylu_base_steps {a.inner_steps})")
        if a.speeds:
            how += f" speeds {','.join(fmt_speed(f) for f in speeds)}"
        print(f"dilocod is up: {url}   model: MLP, {params / 1e6:.2f}M parameters   workers: {a.workers}{how}",
              flush=True)
        print(f"dashboard: {url}/", flush=True)

        losses = {}                 # round -> {node: loss}; async: (node, local_step) -> its line
        lock = threading.Lock()

        def read(p, node):
            for line in p.stdout:
                try:
                    rec = json.loads(line)
                except ValueError:
                    continue
                with lock:
                    if a.mode == "async":
                        losses[(node, rec["local_step"])] = rec
                    else:
                        losses.setdefault(rec["round"], {})[node] = rec["loss"]

        t0 = time.time()
        watch = GlobalWatch(url, t0) if a.target_loss is not None else None
        if watch:
            watch.thread.start()
        env = dict(os.environ, OMP_NUM_THREADS="1")
        readers = []
        for i in range(a.workers):
            node = f"worker-{i + 1}"
            extra = ["--slowdown", fmt_speed(speeds[i])] if speeds[i] != 1 else []
            if a.mode == "async":
                extra += ["--mode", "async"]
            if a.ignore_recommended_steps:
                extra += ["--ignore-recommended-steps"]
            if a.faulty == i + 1:
                extra += ["--faulty"]
            if a.encode:
                extra += ["--encode", a.encode]
                if a.no_error_feedback:
                    extra += ["--no-error-feedback"]
            if a.downlink:
                extra += ["--downlink"]
            p = subprocess.Popen([sys.executable, str(HERE / "torch_worker.py"), "--server", url, "--node-id", node,
                                  "--rounds", str(a.rounds), "--inner-steps", str(a.inner_steps), "--seed", str(i),
                                  *extra],
                                 stdout=subprocess.PIPE, text=True, env=env)
            procs.append(p)
            readers.append(threading.Thread(target=read, args=(p, node), daemon=True))
            readers[-1].start()

        if a.mode == "async":
            ok = async_report(a, url, procs, readers, root, losses, lock, t0, BytesSent(a, root / "init.safetensors"))
            return finish(a, url, root, dilocod, procs, watch, ok)

        printed = 0
        first = last = None
        sent = BytesSent(a, root / "init.safetensors")
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
                      f"aggregation {r['seconds'] * 1000:.1f} ms, mean worker loss {mean:.4f}"
                      f"{why_it_waited(a, r)}", flush=True)
                sent.add(r)
                printed += 1
            time.sleep(0.2)
        print(f"loss {first:.4f} -> {last:.4f} over {a.rounds} rounds "
              f"({'falling' if last < first else 'NOT falling'})", flush=True)
        sent.report()
        for p in procs[1:]:
            p.wait(timeout=120)
        downlink_report(a, url, root / "init.safetensors")
        if watch:
            print(f"wall-clock: {time.time() - t0:.2f} s for {a.rounds} rounds", flush=True)
        return finish(a, url, root, dilocod, procs, watch, last < first)
    except KeyboardInterrupt:
        print("\nstopping...", flush=True)
        return 130
    finally:
        stop_all()


def downlink_report(a, url, init):
    """The bytes the workers downloaded: the server's counts of the views and updates it sent (--downlink),
    against one global per pull (a worker pulls once a round)."""
    st = get_json(f"{url}/status").get("downlink")
    pulls = a.rounds * a.workers
    full = pulls * init.stat().st_size
    if st is None:
        print(f"downloads: about {full / 2**20:.2f} MiB ({pulls} pulls of the global)", flush=True)
        return
    got = st["update_bytes_sent"] + st["view_bytes_sent"]
    print(f"downloads ({a.downlink}): {got / 2**20:.2f} MiB ({st['views_sent']} views, {st['updates_sent']} "
          f"updates of {st['last_update_bytes']} bytes); the global at every pull: {full / 2**20:.2f} MiB, "
          f"{full / max(got, 1):.1f}x more", flush=True)


def faulty_args(a):
    """With a faulty worker: quarantine a delta past 10 x the median norm; sync, close each round with the
    others (the faulty one's delta never joins it)."""
    if not a.faulty:
        return []
    out = ["--max-norm-ratio", "10"]
    if a.mode == "sync":
        out += ["--min-nodes", str(a.workers - 1), "--round-timeout", "5"]
    return out


def async_args(a):
    """dilocod's options for --mode async: a momentum step every <workers> updates, deltas within 20 ms
    averaged into one update, the paper's variant (each delta a step of lr/N, as sync's mean) without
    momentum: on this small task, with deltas a few updates stale, the outer momentum of 0.9 made every
    Nesterov step raise the loss (0.5 and 0.3 still did; measured with --target-loss).  DyLU's base is
    --inner-steps: the fastest worker keeps training that many, the others in proportion to their speed.
    --dilocod-args comes last, so it can change any of these."""
    if a.mode != "async":
        return []
    return ["--mode", "async", "--dn-period", str(a.workers), "--grace-ms", "20", "--dn-variant", "paper",
            "--momentum", "0", "--dylu-base-steps", str(a.inner_steps), *shlex.split(a.dilocod_args)]


def why_it_waited(a, r):
    """What kept a sync round open past its fastest workers, as its record says (closed at --round-timeout
    with some expected worker missing: the faulty one's deltas are quarantined as they arrive), and the
    deltas it quarantined at its close."""
    held = "".join(f"; {q['node_id']}'s delta quarantined at the close ({q['reason']})" for q in r.get("quarantined", []))
    if r.get("reason") != "timeout":
        return held
    came = {n["node_id"] for n in r["nodes"]}
    missing = [f"worker-{i + 1}" for i in range(a.workers) if f"worker-{i + 1}" not in came]
    why = [f"{m} (faulty: its deltas are quarantined)" if a.faulty and m == f"worker-{a.faulty}" else m
           for m in missing]
    return f"; waited the full --round-timeout for {', '.join(why) or 'a node'}, then closed without it{held}"


class BytesSent:
    """The bytes of the deltas dilocod took (its records' per-node bytes) against F32 deltas of the same
    model (about the init model's file size each): what --encode saved."""

    def __init__(self, a, init):
        self.encode, self.f32_each, self.sent, self.deltas = a.encode or "F32", init.stat().st_size, 0, 0

    def add(self, rec):
        for n in rec["nodes"]:
            self.sent += n["bytes"]
            self.deltas += 1

    def report(self):
        if not self.deltas:
            return
        f32 = self.f32_each * self.deltas
        line = f"deltas taken: {self.deltas}, {self.sent / 2**20:.2f} MiB as {self.encode}"
        if self.encode != "F32":
            line += (f"; as F32 about {f32 / 2**20:.2f} MiB: {f32 / self.sent:.1f}x smaller, "
                     f"{(f32 - self.sent) / 2**20:.2f} MiB saved")
        print(line, flush=True)


def async_report(a, url, procs, readers, root, lines, lock, t0, taken):
    """Prints each update dilocod records (in step order) once the workers' lines for its deltas are in,
    until every worker is done and every delta it sent is in an update.  Whether the loss fell: the
    mean over the first <workers> deltas against the last <workers>."""
    printed, pushes, per_delta = 0, 0, []
    while True:
        for p in procs:
            if p.poll() not in (None, 0):
                raise SystemExit(f"a demo process failed (exit {p.returncode}); see {root}/dilocod.log")
        # every worker gone and its last line read
        done = all(p.poll() == 0 for p in procs[1:]) and not any(t.is_alive() for t in readers)
        with lock:
            sent = len(lines)
        rounds = get_json(f"{url}/rounds")["rounds"]
        if rounds and rounds[0]["step"] > printed:    # left the server's record ring already
            print(f"(updates {printed} to {rounds[0]['step'] - 1} are no longer in /rounds)", flush=True)
            printed = rounds[0]["step"]
        for r in rounds:
            if r["step"] != printed:
                continue
            with lock:
                got = [lines.get((n["node_id"], n["local_step"])) for n in r["nodes"]]
            if None in got:
                break               # that worker's line is on its way
            loss = sum(g["loss"] for g in got) / len(got)
            per_delta += [g["loss"] for g in got]
            who = " + ".join(f"{n['node_id']} (tau {n['tau']}, {g['inner_steps']} steps)"
                             for n, g in zip(r["nodes"], got))
            print(f"update {r['step']:3d}: step {r['step']} -> {r['outer_step']}, {who}, "
                  f"aggregation {r['seconds'] * 1000:.1f} ms, loss {loss:.4f}", flush=True)
            printed += 1
            pushes += len(r["nodes"])
            taken.add(r)
        if done and pushes >= sent:
            break
        time.sleep(0.1)
    w = min(a.workers, len(per_delta))
    first, last = sum(per_delta[:w]) / w, sum(per_delta[-w:]) / w
    with lock:
        steps = sum(g["inner_steps"] for g in lines.values())
    print(f"loss {first:.4f} -> {last:.4f} over {printed} updates, {pushes} deltas "
          f"({'falling' if last < first else 'NOT falling'})", flush=True)
    print(f"wall-clock: {time.time() - t0:.2f} s for {pushes} deltas, {steps} worker inner steps", flush=True)
    taken.report()
    for i in range(a.workers):
        node = f"worker-{i + 1}"
        with lock:
            mine = [lines[k] for k in sorted(k for k in lines if k[0] == node)]
        print(f"{node}: inner steps {' '.join(str(g['inner_steps']) for g in mine)}, recommended after each push "
              f"{' '.join(str(g.get('recommended_local_steps', '-')) for g in mine)}", flush=True)
    return last < first


def finish(a, url, root, dilocod, procs, watch, ok):
    """After the last round: the evaluation (--target-loss), then the dashboard (until Ctrl-C from a terminal)."""
    if watch:
        watch.stop.set()
        watch.thread.join(timeout=30)
        watch.evaluate(a.target_loss, a.workers)
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
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
