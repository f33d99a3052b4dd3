"""kill -9 torture of asynchronous mode (--mode async, issue 23) on a file:// hub.

What must hold: every acknowledged delta is applied exactly once, in the recorded commit order.  After
each kill the state is one committed update, and it is bit-identical to a kill-free run fed the same
order.  History lists every update once.

Three nodes feed ~25 deltas with mixed bases (up to three updates behind the committed step), over HTTP
(PUT; acknowledged by a 201 answer, or a 409 not_newer when a retry meets its own cached copy) and, in the
"mixed" cases, written into the file:// tree.  Between feeds the daemon is SIGKILLed at random moments
(right after an acknowledgement, a few milliseconds later, in the middle of an upload) and by its test hook
(DILOCOD_TEST_CRASH_AT=<state>, server/core/pipeline.h) as a step enters computing, inputs_durable,
committed, served, published or durable; it is restarted on the same state and the feeding goes on.
Workers behave like real ones: a broken connection or a 503 means "try again".

After each kill the test reads the state the dead process left: the committed step (redo record or
outer_metadata.json), and when that step is durable its global, momentum and accumulator bytes, and the
hub's published global.  At the end (every delta fed, the queue empty, the last step durable and published:
/status, never sleeps) the history (GET /rounds and rounds.jsonl) must list outer steps 1..S once each and
every fed delta (node, base, local_step) exactly once; AsyncOracle (test_async.py) replays the records'
deltas in record order with the records' weights (a cached delta's tau is recomputed when a restart offers
it again, so the record's weight is the truth), and every snapshot taken at a kill and the final
published global, momentum and accumulator must equal the replay byte for byte.

Two focused tests pin down the two ways the daemon applies a delta twice (found by the torture): a restart
re-applies a consumed delta it finds again in the file:// tree, and a re-upload of an applied delta is
accepted and applied again."""
import http.client
import json
import math
import random
import signal
import threading
import time
from collections import Counter

import numpy as np
import pytest
import torch
from safetensors.numpy import save as np_save
from safetensors.torch import load as torch_load_bytes
from safetensors.torch import save as st_save

from dilocod_proc import Dilocod, delta_metadata, load_torch, write_delta, write_model
from test_async import AsyncOracle, model, rand_delta
from test_torch_exact import torch_cpu_capability

pytestmark = pytest.mark.skipif(
    torch_cpu_capability() not in ("AVX2", "AVX512"),
    reason="torch fuses add(x, alpha=...) only in its AVX2/AVX-512 kernels (see test_torch_exact.py)")

SEED = 2323
NODES = ["w0", "w1", "w2"]
FEEDS = 25
PERIOD = 3
HOOK_STATES = ["computing", "inputs_durable", "committed", "served", "published", "durable"]
KILL_HOOK = "pipeline: test hook: killed"


def delta_of(init, node, local):
    """Node's delta at local_step local: the same in every run and on every retry."""
    rng = np.random.default_rng([SEED, NODES.index(node), local])
    return rand_delta(rng, init, 0.01 * (1 + (local // 10) % 4))


def raw_put(port, node, base, local, blob):
    """PUT /nodes/<node>/delta_<local>.safetensors: (status, parsed body, Retry-After); raises OSError or
    http.client.HTTPException when the connection breaks (the daemon was killed)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("PUT", f"/nodes/{node}/delta_{local}.safetensors", body=blob,
                     headers={"Content-Type": "application/octet-stream"})
        resp = conn.getresponse()
        raw = resp.read()
        try:
            doc = json.loads(raw)
        except ValueError:
            doc = None
        return resp.status, doc, resp.getheader("Retry-After")
    finally:
        conn.close()


def identities(recs):
    return Counter((n["node_id"], n["base_outer_step"], n["local_step"]) for r in recs for n in r["nodes"])


def history_file(d):
    p = d.state_dir / "rounds.jsonl"
    return [json.loads(line) for line in p.read_text().splitlines()] if p.exists() else []


class Torture:
    """The daemon, its kills and restarts, the feeding workers' view, and what each kill left."""

    def __init__(self, tmp, init, args, rnd: random.Random):
        write_model(tmp / "init.safetensors", init)
        self.hub = tmp / "hub"
        self.init, self.rnd = init, rnd
        self.d = Dilocod(tmp, self.hub, "--init-model", str(tmp / "init.safetensors"), "--mode", "async",
                         "--expected-nodes", str(len(NODES)), *args, "--threads", "2")
        self.hook = None
        self.kills = []         # {feed, how, committed, durable, published}
        self.snapshots = {}     # step -> {name: bytes} of a durable step found at a kill
        self.published = []     # (step_count.json's step, the committed step, the hub's global) at a kill
        self.fed = []           # (node, base, local) in feeding order
        self.counts = Counter()
        self.feed_no = 0

    # -- process -----------------------------------------------------------------------------------
    def start(self, hook=None):
        self.hook = hook
        self.d.env = {"DILOCOD_TEST_CRASH_AT": hook} if hook else None
        self.d.start()

    def port(self):
        """The running process's port; None when it died before listening (its hook in recovery)."""
        try:
            return self.d.port
        except AssertionError:
            if self.d.proc is not None and self.d.proc.poll() is not None:
                return None
            raise

    def reap(self):
        """A process that killed itself (its hook): recorded and restarted.  -> True if it had."""
        p = self.d.proc
        if p is None or p.poll() is None:
            return False
        log = self.d.logs[-1].read_text(errors="replace")
        assert p.returncode == -signal.SIGKILL and self.hook and KILL_HOOK in log, \
            f"dilocod exited with {p.returncode}:\n{self.d.log_text()[-4000:]}"
        self.d.proc = None
        line = [x for x in log.splitlines() if KILL_HOOK in x][-1]
        self.after_kill(f"hook {line.split(KILL_HOOK, 1)[1].strip()}")
        self.start()
        return True

    def kill(self, how, hook=None):
        self.d.kill9()
        self.after_kill(how)
        self.start(hook)

    def after_kill(self, how):
        """The dead process's state: one committed update (the redo record's step, or outer_metadata.json's
        when no redo record is left); a durable step's files and the published global are kept for the
        replay's comparison."""
        sd = self.d.state_dir
        committed = self.d.committed_step()
        assert committed is not None, f"{how}: no committed step after the kill"
        meta = json.loads((sd / "outer_metadata.json").read_text())
        redo = json.loads((sd / "redo.json").read_text()) if (sd / "redo.json").exists() else None
        if redo is not None:
            # the redo record commits the step after the durable one, never another
            assert redo["step"] in (meta["outer_step"], meta["outer_step"] + 1), (how, redo["step"], meta)
        else:
            files = {"global": (sd / meta["global_file"]).read_bytes()}
            if meta.get("outer_state_file"):
                files["momentum"] = (sd / meta["outer_state_file"]).read_bytes()
            if meta.get("accum_file"):
                files["accum"] = (sd / meta["accum_file"]).read_bytes()
            files["k"] = meta.get("dn", {}).get("k", 0)       # step 0 (the bootstrap) has no phase
            self.snapshots[meta["outer_step"]] = files
        pub = self.d.published_step()
        if pub is not None and pub > 0:
            self.published.append((pub, committed, (self.hub / "global" / "latest.safetensors").read_bytes()))
        self.kills.append({"feed": self.feed_no, "how": how, "committed": committed,
                           "durable": meta["outer_step"], "published": pub})

    # -- the workers ---------------------------------------------------------------------------------
    def committed_now(self):
        """The committed step as /status tells it (the state's, while the process is not answering)."""
        while True:
            self.reap()
            port = self.port()
            if port is None:
                continue
            try:
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
                conn.request("GET", "/status")
                doc = json.loads(conn.getresponse().read())
                conn.close()
                if isinstance(doc.get("outer_step"), int):
                    return doc["outer_step"]
            except (OSError, http.client.HTTPException, ValueError):
                pass
            if not self.d.alive():
                continue
            return self.d.committed_step()

    def put_until_taken(self, node, base, local, blob):
        """Uploads until the daemon has the delta: 201, or 409 not_newer (the restart re-took the copy a
        killed process cached before it could answer)."""
        deadline = time.time() + 20
        while True:
            assert time.time() < deadline, \
                f"{node} delta_{local} not taken within 20 s ({dict(self.counts)}; status {self.d.get_json('/status')}):\n" \
                f"{self.d.log_text()[-2000:]}"
            self.reap()
            port = self.port()
            if port is None:
                continue
            try:
                status, doc, retry_after = raw_put(port, node, base, local, blob)
            except (OSError, http.client.HTTPException):
                self.counts["connection"] += 1
                if self.d.alive():
                    time.sleep(0.01)
                continue
            code = (doc or {}).get("error", {}).get("code") if isinstance(doc, dict) else None
            if status == 201:
                assert doc["result"] in ("accepted", "queued"), doc
                self.counts[doc["result"]] += 1
                return
            if status == 409 and code == "not_newer":
                self.counts["not_newer"] += 1
                return
            if status == 503:
                self.counts["busy"] += 1
                time.sleep(min(float(retry_after or 0.05), 0.1))
                continue
            raise AssertionError(f"{node} delta_{local} (base {base}): unexpected answer {status} {doc}")

    def feed(self, node, local, via_hub, kill):
        """One delta; kill: None, "after" (kill -9 right after it is taken), "later" (a few ms after),
        "mid" (during its upload), "hook" (the next process kills itself as a step enters a state).  While
        a hook is armed no other kill is made: a kill -9 before the step reached the hook's state replaced
        the armed process, and a run could end with no hook landed."""
        if self.hook is not None:
            kill = None
        committed = self.committed_now() if not via_hub else self.d.committed_step()
        base = max(0, committed - self.rnd.randint(0, 3))
        tensors = delta_of(self.init, node, local)
        self.fed.append((node, base, local))
        if via_hub:
            write_delta(self.hub, node, base, local, tensors)
            self.counts["hub"] += 1
        else:
            blob = np_save(tensors, metadata=delta_metadata(node, base, local))
            if kill == "mid":
                port = self.port()
                got = {}

                def one():
                    try:
                        got["answer"] = raw_put(port, node, base, local, blob)
                    except (OSError, http.client.HTTPException) as e:
                        got["error"] = e
                t = threading.Thread(target=one, daemon=True)
                t.start()
                time.sleep(self.rnd.uniform(0, 0.02))
                if self.d.alive():
                    self.kill("mid-upload")
                t.join(timeout=30)
                if got.get("answer", (0,))[0] == 201:
                    self.counts["201 before the kill"] += 1
                else:
                    self.put_until_taken(node, base, local, blob)       # the worker tries again
                return
            self.put_until_taken(node, base, local, blob)
        if kill == "after" and self.d.alive():
            self.kill("after ack")
        elif kill == "later" and self.d.alive():
            time.sleep(self.rnd.uniform(0.002, 0.05))
            if self.d.alive():
                self.kill("later")
        elif kill == "hook" and self.d.alive():
            self.kill("to arm the hook", hook=self.rnd.choice(HOOK_STATES))

    # -- the end -----------------------------------------------------------------------------------
    def settle(self, timeout=20):
        """Waits until every fed delta is in the history, nothing is pending, and the last step is durable
        and published (a process still armed with its hook is replaced first)."""
        if self.hook is not None:
            self.reap() or self.kill("disarm the hook")
        d, want = self.d, set(self.fed)

        def done():
            if self.reap():
                return False
            st = d.get_json("/status")
            if not isinstance(st, dict) or st["async"]["queue"]["pending"] != 0:
                return False
            recs = (d.get_json("/rounds") or {}).get("rounds")
            if recs is None or not want <= set(identities(recs)):
                return False
            s = st["outer_step"]
            return recs[-1]["outer_step"] == s and st["hub"].get("published_step") == s and \
                any(r["step"] == s and r["state"] in ("durable", "cleaned") for r in st["pipeline"])
        deadline = time.time() + timeout
        while not done():
            if time.time() > deadline:
                recs = (d.get_json("/rounds") or {}).get("rounds") or []
                missing = want - set(identities(recs))
                raise AssertionError(f"not settled within {timeout}s; missing from the history: {sorted(missing)}\n"
                                     f"status {d.get_json('/status')}\n{d.log_text()[-3000:]}")
            time.sleep(0.02)


def replay(init, recs):
    """AsyncOracle fed the records in order, each update weighted as the daemon weighs it: the mean (in
    double, in the record's order) of its deltas' 1/sqrt(1 + tau), tau as recorded (counted when the delta
    was accepted, or accepted again by a restart).  -> ([(state bytes, momentum, acc, k) after each update],
    the records whose weights lost digits)."""
    oracle = AsyncOracle(init, PERIOD)
    out, lossy = [], []
    for rec in recs:
        nodes = rec["nodes"]
        ws = [1.0 / math.sqrt(1 + n["tau"]) for n in nodes]      # round_staleness_weight
        w = sum(ws) / len(ws)
        for n in nodes:
            # tau is counted at (re-)acceptance: never more than the update's own step behind its base
            assert 0 <= n["tau"] <= rec["outer_step"] - 1 - n["base_outer_step"], (rec["outer_step"], n)
        assert math.isclose(rec["weight"], w, rel_tol=1e-14), (rec, w)
        if rec["weight"] != w or any(n["weight"] != x for n, x in zip(nodes, ws)):
            lossy.append((rec["outer_step"], rec["weight"], w))
        state = oracle.update([delta_of(init, n["node_id"], n["local_step"]) for n in nodes], w)
        assert rec["dn_k"] == oracle.k and rec["nesterov_step"] == (oracle.k == 0), (rec, oracle.k)
        out.append((st_save({k: v.contiguous() for k, v in state.items()}),
                    oracle.momentum(), {k: v.clone() for k, v in oracle.acc.items()}, oracle.k))
    return out, lossy


def check_files(step, got_m, got_a, want):
    """The momentum and accumulator dilocod wrote for step equal the replay's, bit for bit."""
    _, mom, acc, k = want
    if mom:
        assert got_m is not None, f"step {step}: no momentum file"
        for key, v in mom.items():
            assert torch.equal(got_m[key].view(torch.int32), v.view(torch.int32)), (step, "momentum", key)
    else:
        assert got_m is None, f"step {step}: a momentum file before any Nesterov step"
    if k > 0:
        assert got_a is not None, f"step {step}: no accumulator file"
        for key, v in acc.items():
            assert torch.equal(got_a[key].view(torch.int32), v.view(torch.int32)), (step, "accumulator", key)
    else:
        assert got_a is None, f"step {step}: an accumulator file after a Nesterov step"


CASES = {
    # name: (grace_ms, share of deltas written into the file:// tree)
    "http-grace0": (0, 0.0),
    "http-grace300": (300, 0.0),
    "mixed-grace0": (0, 0.4),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_async_kill9_torture(tmp_path, case):
    grace, hub_share = CASES[case]
    seed = SEED + sorted(CASES).index(case)
    rnd = random.Random(seed)
    init = model(seed)
    t = Torture(tmp_path, init, ["--dn-period", str(PERIOD), "--staleness-weight", "poly",
                                 "--grace-ms", str(grace)], rnd)
    t0 = time.time()
    t.start()
    try:
        t.d.wait_step(0)
        local = {n: 0 for n in NODES}
        for i in range(FEEDS):
            t.feed_no = i
            node = NODES[rnd.randrange(len(NODES))] if grace else NODES[i % len(NODES)]
            local[node] += 10
            via_hub = rnd.random() < hub_share
            kill = rnd.choice([None, None, "after", "later", "hook"] + ([] if via_hub else ["mid"]))
            t.feed(node, local[node], via_hub, kill)
        t.settle()
        d = t.d

        recs = d.rounds()
        steps = [r["outer_step"] for r in recs]
        S = len(recs)
        problems = []
        if steps != list(range(1, S + 1)):
            problems.append(f"GET /rounds lists outer steps {steps}, want 1..{S} once each")
        in_file = [r["outer_step"] for r in history_file(d)]
        if in_file != steps:
            problems.append(f"rounds.jsonl lists outer steps {in_file}, GET /rounds {steps}")
        ids = identities(recs)
        dup = {k: v for k, v in ids.items() if v > 1}
        extra = set(ids) - set(t.fed)
        if dup:
            problems.append(f"applied more than once: {dup} (kills: {t.kills})")
        if extra:
            problems.append(f"applied but never fed: {sorted(extra)}")
        assert not problems, "\n".join(problems)
        assert sorted(ids) == sorted(t.fed)
        st = d.get_json("/status")
        # the updates counter is the last process's: the steps it committed after the last kill (none,
        # when every delta was applied before it started)
        since = t.kills[-1]["committed"] if t.kills else 0
        assert st["outer_step"] == S and st["async"]["updates"] == S - since, (st["async"], t.kills[-1:])

        # the replay: a kill-free run fed the recorded order
        want, lossy = replay(init, recs)
        assert (t.hub / "global" / "latest.safetensors").read_bytes() == want[S - 1][0], "the final published global"
        meta = json.loads((d.state_dir / "outer_metadata.json").read_text())
        assert meta["outer_step"] == S and meta["dn"]["k"] == want[S - 1][3], meta
        check_files(S, load_torch(d.state_dir / meta["outer_state_file"]) if meta.get("outer_state_file") else None,
                    load_torch(d.state_dir / meta["accum_file"]) if meta.get("accum_file") else None, want[S - 1])
        # what each kill left
        for step, files in t.snapshots.items():
            if step == 0:
                continue
            assert files["global"] == want[step - 1][0], f"the durable step {step} a kill left differs from the replay"
            assert files["k"] == want[step - 1][3], (step, files["k"])
            check_files(step, torch_load_bytes(files["momentum"]) if "momentum" in files else None,
                        torch_load_bytes(files["accum"]) if "accum" in files else None, want[step - 1])
        for pub, committed, blob in t.published:
            # file:// publishes the global, then the step file: a kill between the two leaves the step file
            # naming the step before the global's, never one past the committed step
            match = [i + 1 for i, x in enumerate(want) if x[0] == blob]
            assert match and pub <= match[0] <= committed, \
                f"the hub's global a kill left (step_count.json {pub}, committed {committed}) is the replay's step {match}"
        assert d.stop() == 0
        assert len(t.kills) >= 6, t.kills
        # history.c writes a weight with every digit (%.17g) so that an oracle recomputes the update's
        # alpha from the record bit for bit; a record re-printed by cJSON (%.15g when it is "close enough")
        # does not let it
        assert not lossy, f"records whose weight lost digits (outer_step, recorded, exact): {lossy}"
        assert any(k["how"].startswith("hook") for k in t.kills), t.kills
    finally:
        if t.d.alive():
            t.d.kill9()
        print(f"\n{case} (seed {seed}): {len(t.fed)} deltas, {len(t.kills)} kills, {time.time() - t0:.1f} s; "
              f"answers {dict(t.counts)}")
        for k in t.kills:
            print("  ", k)


def small_daemon(tmp_path, *args):
    init = model(5)
    write_model(tmp_path / "init.safetensors", init)
    d = Dilocod(tmp_path, tmp_path / "hub", "--init-model", str(tmp_path / "init.safetensors"), "--mode", "async",
                "--expected-nodes", "3", "--grace-ms", "0", "--dn-period", str(PERIOD), "--threads", "2", *args)
    return init, d


def test_restart_does_not_reapply_a_consumed_hub_delta(tmp_path):
    """A delta written into the file:// tree is applied once; a restart (even a clean one) lists it again
    and must not apply it a second time.  A later delta of the same node, written after the restart, makes
    the restart's scan of the node's directory a fact the test can wait on."""
    init, d = small_daemon(tmp_path)
    d.start()
    try:
        d.wait_step(0)
        write_delta(d.hub, "w0", 0, 10, delta_of(init, "w0", 10))
        d.wait_settled(1)
        assert d.stop() == 0
        d.start()
        d.wait_step(1)
        write_delta(d.hub, "w0", 1, 20, delta_of(init, "w0", 20))
        d.wait_until(lambda: ("w0", 1, 20) in identities((d.get_json("/rounds") or {}).get("rounds", [])),
                     "the second delta in the history")
        d.wait_until(lambda: (d.get_json("/status") or {}).get("async", {}).get("queue", {}).get("pending") == 0,
                     "nothing pending")
        ids = identities(d.rounds())
        assert ids == Counter({("w0", 0, 10): 1, ("w0", 1, 20): 1}), \
            f"history {[(r['outer_step'], [(n['node_id'], n['base_outer_step'], n['local_step']) for n in r['nodes']]) for r in d.rounds()]}"
    finally:
        if d.alive():
            d.kill9()


def test_reupload_of_an_applied_delta_is_not_applied_again(tmp_path):
    """A worker that did not see its answer (the connection broke) uploads the same delta again: once the
    delta is applied, the retry must not make a second update (sync mode answers 409 stale; async mode
    must answer a 409 too, not 201)."""
    init, d = small_daemon(tmp_path)
    d.start()
    try:
        d.wait_step(0)
        blob = np_save(delta_of(init, "w1", 10), metadata=delta_metadata("w1", 0, 10))
        status, doc, _ = raw_put(d.port, "w1", 0, 10, blob)
        assert status == 201, doc
        d.wait_settled(1)
        status, doc, _ = raw_put(d.port, "w1", 0, 10, blob)
        assert status == 409, f"the same delta again: {status} {doc}"
        assert identities(d.rounds()) == Counter({("w1", 0, 10): 1})
    finally:
        if d.alive():
            d.kill9()
