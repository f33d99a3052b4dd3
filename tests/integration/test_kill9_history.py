"""Issue 10's kill -9 torture: concurrent HTTP uploaders, SIGKILLs at chosen moments of a round (mid-upload,
during aggregation, between "files written" and the commit point, just after the commit, while the committed
step's files are made durable, during the recovery that re-takes cached deltas), and the facts a crash must
never lose.

The commit order under test (server/core/store.h): the pass writes the step's files without waiting for the
disk; the redo record (redo.json) is made durable — the commit point; the step is served and published; its
files are made durable, outer_metadata.json names it and the redo record goes ("store: durable").  A kill
between the commit point and "durable" leaves the step committed by its redo record only: the restart
recomputes its files from the inputs, and they must equal the kill-free run bit for bit.  The facts:

- after every kill the state holds exactly one committed step, whose global and momentum equal, bit for bit,
  those of a kill-free run of the real daemon on the same deltas (deltas are seeded by (round, node));
- after every restart no temporary file of a killed process is left, and the history (rounds.jsonl, GET
  /rounds) holds every committed step exactly once, in ascending order;
- at the end the final global and momentum equal torch.optim.SGD (dilocod_proc.Oracle) bit for bit, /rounds and
  rounds.jsonl hold steps 0..N-1 once each, and after SIGTERM (exit code 0) nothing is left in cache/incoming,
  no cached delta and no temporary file.

The kills are timed by the daemon's debug log (--log-level debug), read incrementally in a tight loop; where a
kill actually landed is decided afterwards from the killed process's log and the state it left, and printed.

Workers behave like real ones: a connection error or a 5xx means "try again" (after Retry-After, capped), a 409
not_newer means "my delta is already in" (the upload reached the cache before the kill, or the restart re-took
it), a 409 stale means "the round already closed with my delta in it"; anything else fails the test.  Each
upload is paced (a worker on a real network is not instantaneous), which is what lets a kill land mid-upload.
"""
import http.client
import json
import math
import os
import random
import re
import shutil
import socket
import threading
import time
from pathlib import Path

import numpy as np
import requests
import torch

from dilocod_proc import Dilocod, Oracle, assert_state_equal, load_torch, write_model
from test_daemon_durability import check_clean_state, check_committed, committed_after_kill, listing
from test_http_api import delta_blob, get, put, session

SEED = 1010
NODES = ["w0", "w1", "w2", "w3"]
ROUNDS = 14
# The kill targets of each round, in order.  "recovery" kills the restart that follows the previous kill
# while it re-takes its cached deltas.  When a kill lands after the commit, the rest of its round's targets
# move to the next round.
PLAN = [
    ["upload", "recovery", "aggregating"],
    ["commit_point"],
    ["durable", "recovery"],
    ["settling"],
    ["aggregating", "recovery", "commit_point"],
    ["upload", "committed"],
    ["settling"],
    ["durable"],
    ["upload", "recovery", "recovery", "commit_point"],
    ["settling"],
    ["aggregating", "durable"],
    ["commit_point"],
    ["upload", "recovery", "committed"],
    ["commit_point"],
]
assert len(PLAN) == ROUNDS
UPLOAD_PIECES, UPLOAD_PAUSE = 16, 0.004     # ~70 ms per upload: a kill can land in the middle of it
# a file the daemon (any process) writes temporarily: uploads in cache/incoming, atomic replacements
TEMP_RE = re.compile(r"^upload-(\d+)-\d+$|\.tmp-(\d+)-\d+$")


def kill9_model():
    g = torch.Generator().manual_seed(SEED)
    return {
        "body.weight": torch.randn(1024, 1024, generator=g),                    # 4 MiB of F32
        "body.bias": torch.randn(1024, generator=g),
        "emb": torch.randn(256, 64, generator=g).to(torch.bfloat16),            # rounded back to BF16
        "steps": torch.tensor([7, 8, 9], dtype=torch.int64),                    # carried unchanged
    }


def round_delta(model, r, i):
    """Node i's delta of round r: the same on every attempt and in every run."""
    rng = np.random.default_rng([SEED, r, i])
    return {k: rng.standard_normal(tuple(v.shape), dtype=np.float32) * np.float32(0.01)
            for k, v in model.items() if v.is_floating_point()}


def round_blob(model, r, i):
    return delta_blob(NODES[i], r, r + 1, round_delta(model, r, i))


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Tail:
    """The log of one dilocod process, read incrementally (cheap enough to poll every half millisecond)."""

    def __init__(self, path: Path):
        self.path, self.f, self.text = path, None, ""

    def read(self) -> str:
        if self.f is None:
            try:
                self.f = open(self.path, "r", errors="replace")
            except FileNotFoundError:
                return self.text
        chunk = self.f.read()
        if chunk:
            self.text += chunk
        return self.text

    def close(self):
        if self.f is not None:
            self.f.close()
            self.f = None


def put_paced(port, node, local, blob):
    """PUT /nodes/<node>/delta_<local>.safetensors with Content-Length, the body in UPLOAD_PIECES pieces with a
    pause after each.  Returns (status, parsed JSON body or None, Retry-After); raises OSError or
    http.client.HTTPException when the connection breaks (the daemon was killed)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.putrequest("PUT", f"/nodes/{node}/delta_{local}.safetensors", skip_accept_encoding=True)
        conn.putheader("Content-Length", str(len(blob)))
        conn.putheader("Content-Type", "application/octet-stream")
        conn.endheaders()
        piece = -(-len(blob) // UPLOAD_PIECES)
        try:
            for off in range(0, len(blob), piece):
                conn.send(blob[off:off + piece])
                time.sleep(UPLOAD_PAUSE)
        except OSError:
            pass        # refused early (a 409 after the header, say): its answer may still be readable
        resp = conn.getresponse()
        body = resp.read()
        try:
            doc = json.loads(body)
        except ValueError:
            doc = None
        return resp.status, doc, resp.getheader("Retry-After")
    finally:
        conn.close()


class Worker(threading.Thread):
    """One node: for each round, wait until the daemon's step reaches it, then upload the round's delta until
    the daemon has it (201, or 409 not_newer / stale)."""

    # While HOLD is set no upload starts: the controller sets it (holding GATE, so that no upload is under
    # way either) around a restart whose recovered step it reads from the state, which the next round's
    # settle would otherwise remove under it.
    GATE = threading.Lock()
    HOLD = threading.Event()

    def __init__(self, i, port, blobs, stop):
        super().__init__(name=f"worker-{NODES[i]}", daemon=True)
        self.i, self.node, self.port, self.blobs, self.stop = i, NODES[i], port, blobs, stop
        self.error = None
        self.outcomes = {}      # round -> final answer
        self.counts = {"connection": 0, "5xx": 0, "201": 0, "not_newer": 0, "stale": 0, "future": 0}

    def step(self, s):
        try:
            r = s.get(f"http://127.0.0.1:{self.port}/global/step_count.json", timeout=5)
            if r.status_code == 200:
                return r.json()["outer_step"]
        except (requests.RequestException, ValueError, KeyError):
            pass
        return None

    def run(self):
        try:
            with session() as s:
                for r in range(ROUNDS):
                    while not self.stop.is_set():
                        st = self.step(s)
                        if st is not None and st >= r:
                            break
                        time.sleep(0.01)
                    self.upload(r)
                    if self.stop.is_set():
                        return
        except BaseException as e:      # reported by the controller
            self.error = e

    def upload(self, r):
        blob = self.blobs(r, self.i)
        while not self.stop.is_set():
            try:
                with Worker.GATE:
                    if Worker.HOLD.is_set():
                        raise BlockingIOError("held")
                    status, doc, retry_after = put_paced(self.port, self.node, r + 1, blob)
            except BlockingIOError:
                time.sleep(0.005)
                continue
            except (OSError, http.client.HTTPException):
                self.counts["connection"] += 1
                time.sleep(0.02)
                continue
            code = doc.get("error", {}).get("code") if isinstance(doc, dict) else None
            if status == 201:
                assert doc["result"] in ("accepted", "replaced") and doc["base_outer_step"] == r, doc
                self.counts["201"] += 1
                self.outcomes[r] = "201"
                return
            if status == 409 and code in ("not_newer", "stale"):
                self.counts[code] += 1
                self.outcomes[r] = code
                return
            if status == 409 and code == "future":
                # the step file named this round's step, yet the daemon says its round is not open: a server
                # contradicting itself (the step file ran ahead of the round before 7beee4e).  A worker would
                # try again shortly; the test counts it and fails at the end.
                self.counts["future"] += 1
                time.sleep(0.01)
                continue
            if status >= 500:
                self.counts["5xx"] += 1
                time.sleep(min(float(retry_after or 0.05), 0.1))
                continue
            raise AssertionError(f"{self.node} round {r}: unexpected answer {status} {doc}")


class Controller:
    """Runs the daemon, watches its log, kills it at the planned moments and checks what it left."""

    def __init__(self, d: Dilocod, port, diloco_bin, ref_dir: Path, workers, rnd: random.Random, t_agg: float):
        self.d, self.diloco_bin, self.ref_dir, self.workers, self.rnd = d, diloco_bin, ref_dir, workers, rnd
        self.url = f"http://127.0.0.1:{port}"
        self.t_agg = t_agg
        self.tail = None
        self.kills = []                 # one dict per kill
        self.history_problems = []      # history checks that failed (reported at the end)
        self.recovering = None          # the open round's step when this process started with cached deltas
        self.redo_pending = None        # the step the last kill left committed by its redo record only
        self.recovered = []             # steps recomputed from a redo record by a restart

    # -- process ----------------------------------------------------------------------------------
    def start(self):
        s = self.d.committed_step()
        cached = s is not None and any((self.d.state_dir / "cache/deltas" / f"s{s}").rglob("*.safetensors"))
        self.d.start()
        self.tail = Tail(self.d.logs[-1])
        self.recovering = s if cached else None

    def check_workers(self):
        for w in self.workers:
            if w.error is not None:
                raise AssertionError(f"{w.node} failed: {w.error!r}") from w.error

    def wait(self, pred, timeout, what):
        """Polls the log (and the state) until pred(log text) is true; returns its value."""
        deadline = time.time() + timeout
        while True:
            text = self.tail.read()
            v = pred(text)
            if v:
                return v
            if not self.d.alive():
                raise AssertionError(f"dilocod exited ({self.d.proc.returncode}) waiting for {what}:\n"
                                     f"{self.tail.read()[-4000:]}")
            if time.time() > deadline:
                raise AssertionError(f"timed out ({timeout}s) waiting for {what}:\n{text[-4000:]}")
            self.check_workers()
            time.sleep(0.0005)

    def incoming(self):
        try:
            return os.listdir(self.d.state_dir / "cache/incoming")
        except FileNotFoundError:
            return []

    # -- the reference -----------------------------------------------------------------------------
    def check_step(self, s, when):
        try:
            assert_state_equal(load_torch(self.d.state_dir / f"global/latest-{s}.safetensors"),
                               load_torch(self.ref_dir / f"global-{s}.safetensors"))
            if s > 0:
                assert_state_equal(load_torch(self.d.state_dir / f"outer_state-{s}.safetensors"),
                                   load_torch(self.ref_dir / f"momentum-{s}.safetensors"))
        except AssertionError as e:
            raise AssertionError(f"{when}: committed step {s} differs from the kill-free run: {e}\n"
                                 f"{listing(self.d.state_dir)}") from None

    # -- history ----------------------------------------------------------------------------------
    def history_file_steps(self):
        p = self.d.state_dir / "rounds.jsonl"
        if not p.exists():
            return []
        steps = []
        for line in p.read_text().splitlines():
            try:
                steps.append(json.loads(line)["step"])
            except (ValueError, KeyError, TypeError):
                steps.append(f"bad line {line[:80]!r}")
        return steps

    def check_history(self, committed, when):
        """rounds.jsonl and GET /rounds: steps 0..k-1 once each, ascending, with k >= committed (the daemon may
        have committed more meanwhile).  Failures are collected, not raised: the fix is in progress."""
        steps = self.history_file_steps()
        if steps != list(range(len(steps))) or len(steps) < committed:
            self.history_problems.append(f"{when}: committed step {committed}, rounds.jsonl holds steps {steps}")
        try:
            r = get(self.url, "/rounds", timeout=10)
            served = [x["step"] for x in r.json()["rounds"]]
        except (requests.RequestException, ValueError, KeyError) as e:
            if self.d.alive():
                self.history_problems.append(f"{when}: GET /rounds failed: {e!r}")
            return
        if served != list(range(len(served))) or len(served) < committed:
            self.history_problems.append(f"{when}: committed step {committed}, GET /rounds holds steps {served}")

    # -- kills --------------------------------------------------------------------------------------
    def kill(self, r, target, how):
        recovering = self.recovering
        pid = self.d.proc.pid
        self.d.kill9()
        text = self.tail.read()
        self.tail.close()
        partial = [n for n in self.incoming() if (m := TEMP_RE.search(n)) and int(m.group(1) or m.group(2)) == pid]
        s, durable = committed_after_kill(self.d.state_dir, self.diloco_bin)
        assert s in (r, r + 1), f"round {r}: committed step {s} after the kill\n{listing(self.d.state_dir)}"
        # the durable step's files now; a step committed by its redo record only is checked after the restart
        self.check_step(durable, f"round {r}, kill '{target}' ({how})")
        self.redo_pending = s if s != durable else None
        closed = f"round: closed step={r} " in text
        if f"store: committed step={r + 1} " in text and s != durable:
            phase = "settling"              # committed by the redo record, the files not durable yet
        elif f"store: committed step={r + 1} " in text:
            phase = "after_commit"
        elif s == r + 1:
            phase = "commit_unlogged"       # the commit point was passed, its log line not written yet
        elif f"aggregate: files written step={r + 1} " in text:
            phase = "written_to_commit"
        elif f"aggregate: started step={r + 1} " in text:
            phase = "aggregating"
        elif closed:
            phase = "closed"
        elif recovering == r:
            phase = "recovery"
        elif partial:
            phase = "mid_upload"
        else:
            phase = "collecting"
        if phase in ("after_commit", "settling"):
            assert s == r + 1, f"round {r}: the logged commit of step {r + 1} was lost"
        if phase in ("aggregating", "closed", "recovery", "mid_upload", "collecting", "written_to_commit"):
            assert s == r, f"round {r}: step {s} committed in phase {phase}"
        hist = self.history_file_steps()
        rec = {"round": r, "target": target, "how": how, "phase": phase, "committed": s, "partial_uploads": len(partial),
               "accepted_in_log": text.count(f"round: delta accepted step={r} "),
               "history_at_kill": r in hist if s == r + 1 else None, "pid": pid}
        self.kills.append(rec)
        return s

    def restart_checked(self, committed, when):
        """After a restart: no temporary file of a dead process, and the history."""
        redo = getattr(self, "redo_pending", None)
        if redo is not None:
            with Worker.GATE:
                Worker.HOLD.set()       # no round closes while the recovered step is read
        try:
            self.start()
            self.wait(lambda t: "round: opened step=" in t, 60, "the restart's round")
            if redo is not None:
                # the step the kill left committed by its redo record: recomputed, durable, bit for bit
                assert "store: recovered step=%d " % redo in self.tail.read(), self.tail.read()[-3000:]
                assert check_committed(self.d.state_dir, self.diloco_bin) >= redo
                self.check_step(redo, f"{when}: recomputed from the redo record")
                self.recovered.append(redo)
                self.redo_pending = None
        finally:
            Worker.HOLD.clear()
        own = self.d.proc.pid
        for dirpath, dirs, files in os.walk(self.d.state_dir):
            for name in dirs + files:
                m = TEMP_RE.search(name)
                if m and int(m.group(1) or m.group(2)) != own:
                    raise AssertionError(f"{when}: {Path(dirpath) / name} left by a killed process\n"
                                         f"{listing(self.d.state_dir)}")
        self.check_history(committed, when)

    def trigger(self, r, target):
        """Waits for the moment of target in round r; returns a description of the moment taken."""
        accepted = f"round: delta accepted step={r} "
        closed = f"round: closed step={r} "
        if target == "upload":
            # one delta of the round in the cache, another one still arriving (or, failing that, the close)
            def moment(t):
                if closed in t:
                    return "round closed first"
                return accepted in t and self.incoming() and "delta in, another arriving"
            return self.wait(moment, 60, f"uploads of round {r}")
        if target == "aggregating":
            how = self.rnd.choice(["started", "prepared", "started+delay"])
            needle = f"aggregate: {how.split('+')[0]} step={r + 1} "
            self.wait(lambda t: needle in t, 60, needle)
            if how.endswith("delay"):
                time.sleep(self.rnd.uniform(0, self.t_agg))
            return how
        if target == "settling":
            # committed (the redo record is durable), its files not yet: a moment inside the background fsync
            needle = f"store: committed step={r + 1} "
            self.wait(lambda t: needle in t, 60, needle)
            return "committed, settling"
        if target == "durable":
            needle = f"aggregate: files written step={r + 1} "
            self.wait(lambda t: needle in t, 60, needle)
            delay = self.rnd.choice([0, 0, 0.0005, 0.001])
            if delay:
                time.sleep(delay)
            return f"files written+{delay * 1000:.1f}ms"
        if target == "commit_point":
            # redo.json names the new step (its atomic replacement is the commit point): the moment before
            # anything else of the commit (log line, serving, publishing, durability) has happened
            self.wait(lambda t: self.d.committed_step() == r + 1, 60, f"outer_metadata.json naming step {r + 1}")
            return "metadata renamed"
        if target == "committed":
            # committed and durable (outer_metadata.json names it): the steady state after a commit
            needle = f"store: durable step={r + 1}"
            self.wait(lambda t: needle in t, 60, needle)
            delay = self.rnd.choice([0, 0, 0.001, 0.003])
            if delay:
                time.sleep(delay)
            return f"committed+{delay * 1000:.0f}ms"
        if target == "recovery":
            how = self.rnd.choice(["store: resuming", "round: opened step=", "round: delta accepted step="])
            self.wait(lambda t: how in t, 60, how)
            return how
        raise AssertionError(target)


def reference_run(tmp: Path, model, init: Path, blobs, ref_dir: Path, port):
    """The kill-free run: the same daemon and options, the same deltas (plain PUTs); every committed step's
    global and momentum are copied to ref_dir.  Returns the longest aggregation (seconds, from the log)."""
    d = Dilocod(tmp, None, "--init-model", str(init), "--expected-nodes", str(len(NODES)), "--threads", "2",
                "--agg-memory-mib", "1", "--listen", f"127.0.0.1:{port}")
    url = f"http://127.0.0.1:{port}"
    ref_dir.mkdir()
    tail = None
    try:
        d.start()
        tail = Tail(d.logs[-1])
        deadline = time.time() + 30
        while "round: opened step=0 " not in tail.read():
            assert time.time() < deadline and d.alive(), d.log_text()[-3000:]
            time.sleep(0.01)
        shutil.copy(d.state_dir / "global/latest-0.safetensors", ref_dir / "global-0.safetensors")
        for r in range(ROUNDS):
            for i, node in enumerate(NODES):
                for _attempt in range(200):     # the port may still be coming up
                    try:
                        resp = put(url, node, r + 1, blobs(r, i))
                        break
                    except requests.ConnectionError:
                        time.sleep(0.02)
                assert resp.status_code == 201, (r, node, resp.status_code, resp.text)
            # the round of the new step is open (outer_metadata.json names the step a moment before)
            deadline = time.time() + 60
            while f"round: opened step={r + 1} " not in tail.read():
                assert time.time() < deadline and d.alive(), d.log_text()[-3000:]
                time.sleep(0.005)
            assert d.committed_step() == r + 1
            shutil.copy(d.state_dir / f"global/latest-{r + 1}.safetensors", ref_dir / f"global-{r + 1}.safetensors")
            shutil.copy(d.state_dir / f"outer_state-{r + 1}.safetensors", ref_dir / f"momentum-{r + 1}.safetensors")
        assert d.stop() == 0
    finally:
        if d.alive():
            d.kill9()
        if tail is not None:
            tail.close()
    shutil.copy(d.state_dir / "rounds.jsonl", ref_dir / "rounds.jsonl")
    times = [float(x) for x in re.findall(r"aggregate: done step=\d+ .*?seconds=([0-9.]+)", d.log_text())]
    assert len(times) == ROUNDS, d.log_text()[-3000:]
    shutil.rmtree(d.state_root, ignore_errors=True)
    return max(times)


def record_differences(got: list, want: list) -> list:
    """What differs between two histories (lists of round records), leaving out the timings: steps, reason,
    bytes and nodes exactly, the norms and cosines to float precision (threads may sum chunks in another
    order)."""
    out = []
    if [g.get("step") for g in got] != [w["step"] for w in want]:
        return [f"steps {[g.get('step') for g in got]}, want {[w['step'] for w in want]}"]
    for g, w in zip(got, want):
        for k in ("outer_step", "reason", "bytes"):
            if g.get(k) != w[k]:
                out.append(f"step {w['step']}: {k} {g.get(k)!r}, want {w[k]!r}")
        gn, wn = g.get("nodes") or [], w["nodes"]
        if [(n.get("node_id"), n.get("local_step"), n.get("bytes")) for n in gn] != \
                [(n["node_id"], n["local_step"], n["bytes"]) for n in wn]:
            out.append(f"step {w['step']}: nodes {gn}, want {wn}")
            continue
        pairs = [(g.get("mean_norm"), w["mean_norm"])] + [(a.get(k), b[k]) for a, b in zip(gn, wn)
                                                          for k in ("norm", "cosine")]
        if not all(isinstance(x, (int, float)) and math.isclose(x, y, rel_tol=1e-5, abs_tol=1e-7) for x, y in pairs):
            out.append(f"step {w['step']}: norms/cosines {g}, want {w}")
    return out


def test_kill9_torture_keeps_weights_momentum_and_history(tmp_path, diloco_bin):
    t_start = time.time()
    model = kill9_model()
    init = tmp_path / "init.safetensors"
    write_model(init, model)
    cache = {}
    cache_lock = threading.Lock()

    def blobs(r, i):
        with cache_lock:
            if (r, i) not in cache:
                cache[(r, i)] = round_blob(model, r, i)
            for old in [k for k in cache if k[0] < r - 1]:
                del cache[old]
            return cache[(r, i)]

    port = free_port()
    ref_dir = tmp_path / "ref"
    (tmp_path / "ref-run").mkdir()
    t_agg = reference_run(tmp_path / "ref-run", model, init, blobs, ref_dir, port)
    t_ref = time.time() - t_start

    d = Dilocod(tmp_path, None, "--init-model", str(init), "--expected-nodes", str(len(NODES)), "--threads", "2",
                "--agg-memory-mib", "1", "--retry-interval", "0.2", "--listen", f"127.0.0.1:{port}")
    stop = threading.Event()
    workers = [Worker(i, port, blobs, stop) for i in range(len(NODES))]
    ctl = Controller(d, port, diloco_bin, ref_dir, workers, random.Random(SEED), t_agg)
    pending = []
    try:
        ctl.start()
        ctl.wait(lambda t: "round: opened step=0 " in t, 60, "the bootstrap")
        ctl.check_step(0, "bootstrap")
        for w in workers:
            w.start()
        pending = []
        for r in range(ROUNDS):
            pending += PLAN[r]      # with what a kill that committed early left of the previous round's plan
            while pending and d.committed_step() == r:
                target = pending.pop(0)
                if target == "recovery" and not d.alive():
                    # the restart after the previous kill, killed while it starts / re-takes its deltas
                    ctl.start()
                elif not d.alive():
                    ctl.restart_checked(r, f"round {r}: restart before '{target}'")
                how = ctl.trigger(r, target)
                if ctl.kill(r, target, how) != r:
                    break
            if not d.alive() and (r == ROUNDS - 1 or not pending or pending[0] != "recovery"):
                ctl.restart_checked(d.committed_step(), f"round {r}: restart after the kills")
            if d.alive():
                ctl.wait(lambda t: d.committed_step() >= r + 1, 60, f"the commit of step {r + 1}")
        for w in workers:
            w.join(timeout=60)
            assert not w.is_alive(), f"{w.node} did not finish"
        ctl.check_workers()
        for w in workers:
            assert sorted(w.outcomes) == list(range(ROUNDS)), (w.node, w.outcomes)

        # the end: the final step against the kill-free run and against torch, and the history
        assert d.committed_step() == ROUNDS
        ctl.check_step(ROUNDS, "the end")
        oracle = Oracle(model)
        for r in range(ROUNDS):
            oracle.step({NODES[i]: round_delta(model, r, i) for i in range(len(NODES))})
        torch_problems = []
        for what, got, want in (
                ("global", load_torch(d.state_dir / f"global/latest-{ROUNDS}.safetensors"), oracle.state),
                ("momentum", load_torch(d.state_dir / f"outer_state-{ROUNDS}.safetensors"), oracle.momentum())):
            try:
                assert_state_equal(got, want)
            except AssertionError as e:
                torch_problems.append(f"final {what} differs from torch.optim.SGD: {e}")
        assert get(ctl.url, "/global/latest.safetensors").content == \
            (d.state_dir / f"global/latest-{ROUNDS}.safetensors").read_bytes(), "the served global is not the committed one"
        deadline = time.time() + 10     # the last round's record may still be on its way to the file
        while len(ctl.history_file_steps()) < ROUNDS and time.time() < deadline:
            time.sleep(0.01)
        ctl.check_history(ROUNDS, "the end (running)")
        rounds_doc = get(ctl.url, "/rounds").json()["rounds"]
        final_served = [x.get("step") for x in rounds_doc]
        pid = d.proc.pid
        assert d.stop() == 0, ctl.tail.read()[-3000:]
        final_file = ctl.history_file_steps()
        final_records = [json.loads(line) for line in (d.state_dir / "rounds.jsonl").read_text().splitlines()]
        check_clean_state(d.state_dir, ROUNDS, own_pid=pid)
        assert os.listdir(d.state_dir / "cache/incoming") == [], listing(d.state_dir)
        left = [str(p.relative_to(d.state_dir)) for p in (d.state_dir / "cache/deltas").rglob("*") if p.is_file()]
        assert left == [], f"cached deltas left after the last round: {left}"
    finally:
        stop.set()
        if d.alive():
            d.kill9()
        for w in workers:
            w.join(timeout=5)
        landed = {}
        for k in ctl.kills:
            landed[k["phase"]] = landed.get(k["phase"], 0) + 1
        print(f"\nreference run {t_ref:.1f} s (longest aggregation {t_agg * 1000:.1f} ms); "
              f"{len(ctl.kills)} kills over {ROUNDS} rounds, landed: {landed}; targets left over: {pending}")
        for k in ctl.kills:
            print("  ", {x: k[x] for x in ("round", "target", "how", "phase", "committed", "partial_uploads",
                                           "accepted_in_log", "history_at_kill")})
        for w in workers:
            print(f"   {w.node}: {w.counts}")
        print(f"total {time.time() - t_start:.1f} s")

    problems = list(ctl.history_problems) + torch_problems
    problems += [f"{w.node}: {w.counts['future']} uploads refused as 'future' after step_count.json named their round"
                 for w in workers if w.counts["future"]]
    if final_served != list(range(ROUNDS)):
        problems.append(f"the end: GET /rounds holds steps {final_served}, want 0..{ROUNDS - 1} once each")
    if final_file != list(range(ROUNDS)):
        problems.append(f"the end: rounds.jsonl holds steps {final_file}, want 0..{ROUNDS - 1} once each")
    want_records = [json.loads(line) for line in (ref_dir / "rounds.jsonl").read_text().splitlines()]
    problems += [f"the end: GET /rounds: {x}" for x in record_differences(rounds_doc, want_records)]
    problems += [f"the end: rounds.jsonl: {x}" for x in record_differences(final_records, want_records)]
    phases = [k["phase"] for k in ctl.kills]
    assert len(ctl.kills) >= 20, ctl.kills
    assert len({k["round"] for k in ctl.kills}) >= 10, ctl.kills
    assert not problems, "\n".join(problems)
    # every window was hit at least once (each is aimed at more than once)
    for window in ("mid_upload", "aggregating", "after_commit", "recovery"):
        assert window in phases, (window, phases)
    assert {"written_to_commit", "commit_unlogged"} & set(phases), phases
    # a kill left a step committed by its redo record only, and its restart recomputed it bit for bit
    assert "settling" in phases and ctl.recovered, (phases, ctl.recovered)
