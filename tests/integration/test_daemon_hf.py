"""dilocod's hf:// transport end to end against the Hub emulator (tests/hubsim/hubsim.py).

Workers are the STOCK huggingface_hub client (no hf_xet): they hf_hub_download the global, compute a
delta with torch/numpy and upload_file it to nodes/<id>/delta_<n>.safetensors; dilocod polls the repo,
aggregates and publishes each outer step as one commit.  Every published global is compared with the
torch oracle (dilocod_proc.Oracle).

Telling dilocod's requests from the workers' at the emulator:
  * dilocod talks to http://localhost:PORT (its CDN / upload host is then 127.0.0.1); the workers use
    http://127.0.0.1:PORT (their CDN host flips to localhost).  The request log's Host tells them apart.
  * Fault rules can only match method / route / path, so the workers address the branch as
    "refs/heads/main" (quoted refs%2Fheads%2Fmain in their URLs) while dilocod says "main": a rule on
    r"/commit/main$", r"/resolve/main/" ... hits dilocod only.  The LFS batch and verify URLs are the
    same for everybody: rules on them skip the workers' requests of the round (each stock upload_file
    makes exactly one batch and one verify call) or exclude the workers' oids by regex.
Every fault test checks from the request log that each injected fault landed on a dilocod request.

Tests: four workers x five rounds (oracle, one commit per step, paginated listings, each delta fetched
once); one test per fault switch plus a mixed random run; the API-call budget at the default poll
interval (8 nodes, extrapolated to 5 minutes); kill -9 in the middle of a 64 MiB download, of a
multipart publish and right after a commit; adopting a Python master's global (and the token never
leaving the API host); adopting it when its first download breaks."""
import os

os.environ["HF_HUB_DISABLE_XET"] = "1"
os.environ["HF_HUB_DISABLE_TELEMETRY"] = "1"
os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"

import hashlib  # noqa: E402
import json  # noqa: E402
import random  # noqa: E402
import re  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import urllib.request  # noqa: E402
from concurrent.futures import ThreadPoolExecutor  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from huggingface_hub import HfApi, constants, hf_hub_download  # noqa: E402
from safetensors.numpy import save as st_save  # noqa: E402

from conftest import BUILD  # noqa: E402
from dilocod_proc import (Dilocod, Oracle, assert_state_close, delta_metadata, load_torch, part_sizes,  # noqa: E402
                          write_model)

constants.HF_HUB_DISABLE_XET = True  # in case huggingface_hub was imported before this module

HUBSIM = Path(__file__).resolve().parents[1] / "hubsim" / "hubsim.py"
TOKEN = "hf_dilocodTestSecret_5b2e9f0c7a"
REPO = "org/model"
WREV = "refs/heads/main"        # the workers' name of the branch (see the module docstring)
MiB = 1024 * 1024
COMMIT_RE = re.compile(r"^dilocod: outer step (\d+)$")


# ---- the emulator -------------------------------------------------------------------------------

class HubSim:
    """One hubsim process with a token.  dilocod uses `endpoint` (localhost), workers `wendpoint`."""

    def __init__(self, tmp: Path, *args):
        self.tmp = Path(tmp)
        self.root = self.tmp / "hubroot"
        self.errlog_path = self.tmp / "hubsim.stderr"
        self.errlog = open(self.errlog_path, "ab")
        self.proc = subprocess.Popen([sys.executable, str(HUBSIM), "--root", str(self.root), "--port", "0",
                                      "--token", TOKEN, *args],
                                     stdout=subprocess.PIPE, stderr=self.errlog, text=True)
        line = self.proc.stdout.readline()
        if not line.strip().isdigit():
            self.proc.kill()
            raise RuntimeError(f"hubsim did not start: {line!r}\n{self.errlog_path.read_text()}")
        self.port = int(line)
        self.endpoint = f"http://localhost:{self.port}"
        self.wendpoint = f"http://127.0.0.1:{self.port}"

    def ctl(self, method, path, body=None):
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.wendpoint + path, data=data, method=method,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=30) as r:
            return json.loads(r.read() or b"null")

    def fault(self, **rule):
        return self.ctl("POST", "/_sim/faults", rule)["rules"][0]

    def faults(self):
        return self.ctl("GET", "/_sim/faults")

    def clear_faults(self):
        self.ctl("DELETE", "/_sim/faults")

    def stats(self):
        return self.ctl("GET", "/_sim/stats")

    def requests(self, since=0):
        return self.ctl("GET", f"/_sim/requests?since={since}")

    def last_seq(self):
        log = self.requests()
        return log[-1]["seq"] if log else 0

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.errlog.close()


def wait_until(cond, what, timeout=60, interval=0.05):
    deadline = time.time() + timeout
    while time.time() < deadline:
        v = cond()
        if v:
            return v
        time.sleep(interval)
    raise AssertionError(f"{what}: not within {timeout}s")


def by_dilocod(e) -> bool:
    """A request-log entry sent by dilocod (see the module docstring)."""
    host = (e.get("host") or "").split(":")[0]
    if e["category"] == "cdn" or e["route"] in ("lfs_upload", "lfs_part", "lfs_complete"):
        return host == "127.0.0.1"      # dilocod's CDN / storage host
    return host == "localhost"


def is_peek(e) -> bool:
    """dilocod's look at a delta's header: a Range request from byte 0 with an end."""
    return bool(re.match(r"^bytes=0-\d+$", e.get("range") or ""))


def fmt_requests(entries, n=60):
    return "\n".join(f'{e["seq"]} {e["method"]} {e["path"][:110]} host={e["host"]} range={e["range"]} '
                     f'status={e["status"]} fault={e["fault"]}' for e in entries[-n:])


# ---- dilocod with an hf:// hub --------------------------------------------------------------------

class HfDilocod(Dilocod):
    """dilocod --hub hf://org/model --hub-endpoint <hubsim>.  poll=None leaves --poll-interval at its
    default; token_file passes --hub-token-file instead of HF_TOKEN."""

    def __init__(self, tmp, hub: HubSim, *args, poll=0.3, token_file=None, state_root=None):
        super().__init__(tmp, None, *args, state_root=state_root)
        self.hubsim = hub
        self.poll = poll
        self.token_file = token_file
        self._url = None

    def start(self, *extra):
        log = self.tmp / f"dilocod-{len(self.logs)}.log"
        self.logs.append(log)
        self._url = None
        cmd = [str(BUILD / "dilocod"), "--state-root", str(self.state_root), "--hub", f"hf://{REPO}",
               "--hub-endpoint", self.hubsim.endpoint, "--listen", "127.0.0.1:0", "--log-level", "debug"]
        if self.poll is not None:
            cmd += ["--poll-interval", str(self.poll)]
        env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
        if self.token_file is not None:
            cmd += ["--hub-token-file", str(self.token_file)]
        else:
            env["HF_TOKEN"] = TOKEN
        cmd += [str(a) for a in (*self.args, *extra)]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=open(log, "wb"), env=env)
        return self

    @property
    def url(self) -> str:
        if self._url is None:
            self._url = f"http://127.0.0.1:{self.port}"
        return self._url

    def status_text(self) -> str:
        with urllib.request.urlopen(self.url + "/status", timeout=10) as r:
            return r.read().decode()

    def status(self) -> dict:
        return json.loads(self.status_text())

    def check_alive(self):
        if self.proc is None or self.proc.poll() is not None:
            raise AssertionError(f"dilocod exited ({self.proc and self.proc.returncode}):\n{self.diag()}")

    def diag(self) -> str:
        try:
            reqs = fmt_requests(self.hubsim.requests())
        except Exception as e:  # noqa: BLE001 - diagnostics only
            reqs = repr(e)
        return f"--- dilocod log (tail)\n{self.log_text()[-6000:]}\n--- hubsim requests (tail)\n{reqs}"

    def wait_published(self, step, timeout=60):
        """Waits until dilocod reports step as published on the Hub (its /status, not a Hub request)."""
        deadline = time.time() + timeout
        last = None
        while time.time() < deadline:
            self.check_alive()
            try:
                last = self.status()["hub"].get("published_step")
            except OSError:
                last = None
            if last is not None and last >= step:
                return last
            time.sleep(0.05)
        raise AssertionError(f"step {step} not published within {timeout}s (published {last}):\n{self.diag()}")

    def wait(self, cond, what, timeout=60, interval=0.05):
        deadline = time.time() + timeout
        while time.time() < deadline:
            self.check_alive()
            v = cond()
            if v:
                return v
            time.sleep(interval)
        raise AssertionError(f"{what}: not within {timeout}s:\n{self.diag()}")


# ---- the model, workers and the Hub as the stock client sees it ------------------------------------

def model(seed=0, rows=128, cols=192):
    """F32 and BF16 weights and an I64 buffer; the F32 matrix makes a delta bigger than dilocod's 64 KiB
    header peek, so peeks and downloads are different requests."""
    g = torch.Generator().manual_seed(seed)
    return {
        "layer.weight": torch.randn(rows, cols, generator=g),
        "layer.bias": torch.randn(cols, generator=g),
        "emb.bf16": torch.randn(16, 8, generator=g).to(torch.bfloat16),
        "counter": torch.tensor([7, -2, 1 << 40], dtype=torch.int64),
    }


def worker_delta(global_state: dict, rng: np.random.Generator, scale=0.01) -> dict:
    """A stand-in for H inner steps: current = global + noise; delta = float32(global) - float32(current)."""
    out = {}
    for k, v in global_state.items():
        if v.is_floating_point():
            base = v.to(torch.float32)
            noise = torch.from_numpy((rng.standard_normal(tuple(v.shape)) * scale).astype(np.float32))
            current = (base + noise).to(v.dtype).to(torch.float32)
            out[k] = (base - current).numpy()
    return out


def delta_bytes(node, base_step, local_step, tensors) -> bytes:
    return st_save(tensors, metadata=delta_metadata(node, base_step, local_step))


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class Workers:
    """Stock-client workers (one HfApi each, threads for a round)."""

    def __init__(self, hub: HubSim, tmp: Path, nodes, revision=WREV, seed=1):
        self.hub = hub
        self.tmp = Path(tmp)
        self.nodes = list(nodes)
        self.revision = revision
        self.api = HfApi(endpoint=hub.wendpoint, token=TOKEN)
        self.rngs = {n: np.random.default_rng([seed, i]) for i, n in enumerate(self.nodes)}
        self.local = {n: 0 for n in self.nodes}

    def download(self, filename, cache="w"):
        return hf_hub_download(REPO, filename, revision=self.revision, endpoint=self.hub.wendpoint, token=TOKEN,
                               cache_dir=str(self.tmp / f"hf-cache-{cache}"), force_download=True)

    def step_count(self, cache="w"):
        return json.loads(Path(self.download("global/step_count.json", cache)).read_text())

    def global_state(self, cache="w"):
        return load_torch(Path(self.download("global/latest.safetensors", cache)))

    def prepare(self, node, step, global_state):
        """(path_in_repo, bytes, tensors) of node's delta based on step."""
        self.local[node] += 10
        tensors = worker_delta(global_state, self.rngs[node])
        path = f"nodes/{node}/delta_{self.local[node]}.safetensors"
        return path, delta_bytes(node, step, self.local[node], tensors), tensors

    def upload(self, path, data):
        self.api.upload_file(path_or_fileobj=data, path_in_repo=path, repo_id=REPO, revision=self.revision,
                             commit_message=f"upload {path}")

    def round(self, step, want=None, download=True, nodes=None):
        """One round: every node (in parallel) downloads the global with the stock client (checks it is
        step `step` and equals `want`), computes its delta and uploads it.  -> {node: tensors}."""
        nodes = list(nodes or self.nodes)

        def one(node):
            if download:
                sc = self.step_count(node)
                assert sc["outer_step"] == step, (node, sc, step)
                g = self.global_state(node)
                if want is not None:
                    assert_state_close(g, want)
            else:
                g = want
            path, data, tensors = self.prepare(node, step, g)
            self.upload(path, data)
            return node, tensors

        with ThreadPoolExecutor(len(nodes)) as ex:
            return dict(ex.map(one, nodes))


def dilocod_steps_in_history(api: HfApi):
    """The steps of dilocod's commits, oldest first (list_repo_commits is newest first)."""
    titles = [c.title for c in api.list_repo_commits(REPO)]
    return [int(m.group(1)) for m in (COMMIT_RE.match(t) for t in reversed(titles)) if m]


def setup_run(tmp: Path, nodes, *args, poll=0.3, init=None, retry="0.5", hub_args=(), **kw):
    """hubsim + repo + a dilocod (not started) that bootstraps from init and publishes it as step 0."""
    hub = HubSim(tmp, *hub_args)
    api = HfApi(endpoint=hub.wendpoint, token=TOKEN)
    api.create_repo(REPO)
    init = init if init is not None else model()
    init_path = tmp / "init.safetensors"
    write_model(init_path, init)
    more = ["--retry-interval", retry] if retry is not None else []
    d = HfDilocod(tmp, hub, "--init-model", init_path, "--nodes", ",".join(nodes), *more, *args, poll=poll, **kw)
    return hub, api, d, init


@pytest.fixture
def procs():
    """Collects hubsims and dilocods to stop at the end of a test, whatever happens."""
    items = []
    yield items
    for p in reversed(items):
        try:
            if isinstance(p, HubSim):
                p.stop()
            else:
                p.kill9() if p.alive() else None
        except Exception:  # noqa: BLE001 - best-effort cleanup
            pass


@pytest.fixture(autouse=True)
def _hf_home(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))  # never the user's cache or token


# ---- 1. four stock-client workers, five rounds ---------------------------------------------------

def test_four_workers_five_rounds_match_the_oracle(tmp_path, procs):
    nodes = ["w0", "w1", "w2", "w3"]
    hub, api, d, init = setup_run(tmp_path, nodes, hub_args=("--page-size", "3"))   # listings span pages
    procs += [hub, d]
    d.start()
    oracle = Oracle(init)
    workers = Workers(hub, tmp_path, nodes, revision=None)  # plain stock-client calls, "main" implied
    d.wait_published(0)
    sc = workers.step_count()
    assert sc["outer_step"] == 0 and sc.get("bootstrap") == "true", sc
    for step in range(5):
        deltas = workers.round(step, want=oracle.state)
        oracle.step(deltas)
        d.wait_published(step + 1)
    assert workers.step_count()["outer_step"] == 5
    assert_state_close(workers.global_state(), oracle.state)
    assert dilocod_steps_in_history(api) == [0, 1, 2, 3, 4, 5]
    # each delta was downloaded once (old rounds' deltas stay in the tree: not fetched again)
    full = [e["path"].split("?")[0] for e in dilocod_entries(hub, 0, "cdn") if not is_peek(e)]
    assert len(full) == 20 and len(set(full)) == 20, full
    assert len(dilocod_entries(hub, 0, "tree")) > len([e for e in dilocod_entries(hub, 0, "tree")
                                                        if "cursor=" not in e["path"]])    # pages followed
    st = d.status()
    assert st["outer_step"] == 5 and st["counters"]["rounds"] == 5, st
    assert d.stop() == 0


# ---- 2. fault switches ----------------------------------------------------------------------------

DISCARDED = "download does not match the listing, discarded"


class FaultRun:
    """hubsim + dilocod (3 nodes, poll 0.3 s) at step 0, a torch oracle and stock-client workers that
    address the branch as refs/heads/main (so path rules on ".../main" hit dilocod only)."""

    def __init__(self, tmp, procs, nodes=("w0", "w1", "w2")):
        self.nodes = list(nodes)
        self.hub, self.api, self.d, init = setup_run(tmp, self.nodes)
        procs += [self.hub, self.d]
        self.d.start()
        self.d.wait_published(0)
        self.oracle = Oracle(init)
        self.workers = Workers(self.hub, tmp, self.nodes)
        self.step = 0
        self.seq0 = self.hub.last_seq()
        self.rules = []

    @property
    def W(self):
        return len(self.nodes)

    def fault(self, **rule):
        r = self.hub.fault(**rule)
        self.rules.append(r)
        return r

    def prepare(self):
        """Each worker downloads step_count.json and the global with the stock client, checks both,
        and computes its delta.  -> [(node, path, bytes, tensors)]"""
        out = []
        for node in self.nodes:
            sc = self.workers.step_count(node)
            assert sc["outer_step"] == self.step, sc
            g = self.workers.global_state(node)
            assert_state_close(g, self.oracle.state)
            out.append((node, *self.workers.prepare(node, self.step, g)))
        return out

    def upload(self, prepared):
        with ThreadPoolExecutor(len(prepared)) as ex:
            list(ex.map(lambda p: self.workers.upload(p[1], p[2]), prepared))

    def finish(self, prepared, timeout=90):
        self.d.wait_published(self.step + 1, timeout=timeout)
        self.oracle.step({p[0]: p[3] for p in prepared})
        self.step += 1

    def round(self, install=None, timeout=90):
        """One round; install(prepared) adds the round's fault rules before the uploads."""
        prepared = self.prepare()
        if install is not None:
            install(prepared)
        self.upload(prepared)
        self.finish(prepared, timeout)
        return prepared

    def all_fired(self):
        """Every finite rule installed so far has fired its full count (hubsim drops spent rules)."""
        left = [r for r in self.hub.faults() if r["count"] > 0]
        assert not left, f"fault rules that did not (fully) fire: {left}\n{self.d.diag()}"

    def faulted(self):
        return [e for e in self.hub.requests(self.seq0) if e["fault"]]

    def check(self, min_faults=1):
        """Faults off; all of them hit dilocod; one clean round; final global = oracle; one commit per
        step, in order."""
        self.all_fired()
        self.hub.clear_faults()
        faulted = self.faulted()
        assert len(faulted) >= min_faults, fmt_requests(faulted)
        wrong = [e for e in faulted if not by_dilocod(e)]
        assert not wrong, "faults hit the workers' requests:\n" + fmt_requests(wrong)
        # every corrupted / truncated delta download (not a 64 KiB header peek) was caught and discarded
        spoiled = [e for e in faulted if e["route"] == "cdn" and e["fault"] in ("corrupt", "truncate")
                   and not is_peek(e)]
        assert self.d.log_text().count(DISCARDED) >= len(spoiled), fmt_requests(spoiled)
        self.round()
        assert self.workers.step_count()["outer_step"] == self.step
        assert_state_close(self.workers.global_state(), self.oracle.state)
        assert dilocod_steps_in_history(self.api) == list(range(self.step + 1)), self.d.diag()
        self.d.check_alive()


def dilocod_entries(hub, since, route=None):
    return [e for e in hub.requests(since) if by_dilocod(e) and (route is None or e["route"] == route)]


def assert_waited_after_429(run, min_wait):
    """After each 429 that dilocod got, its next request to that route came no sooner than the wait
    the answer asked for (Retry-After / RateLimit t)."""
    entries = dilocod_entries(run.hub, run.seq0)
    got429 = [e for e in entries if e["status"] == 429]
    assert got429, fmt_requests(entries)
    bad = []
    for e in got429:
        nxt = [n for n in entries if n["seq"] > e["seq"] and n["route"] == e["route"]]
        assert nxt, f"no request after the 429 on {e['route']}"
        gap = nxt[0]["time"] - e["time"]
        if gap < min_wait[e["route"]] - 0.05:
            bad.append(f"{nxt[0]['method']} {nxt[0]['path']} {gap:.2f}s after a 429 that asked for "
                       f"{min_wait[e['route']]}s")
    assert not bad, "dilocod did not wait as told:\n" + "\n".join(bad) + "\n" + fmt_requests(entries, 40)


REV = r"/api/models/org/model/revision/main$"
TREE = r"/api/models/org/model/tree/main/nodes"
RESOLVE = r"^/org/model/resolve/main/"
STEPFILE = r"^/org/model/resolve/main/global/step_count\.json$"
PREUPLOAD = r"/api/models/org/model/preupload/main$"
COMMIT = r"/api/models/org/model/commit/main$"
DELTA_CDN = r"^/lfs-cdn/.*[?&]path=nodes%2F"


def case_5xx_polling(run):
    def install(prepared):
        run.fault(status=500, path_regex=REV, count=3)
        run.fault(status=502, path_regex=TREE, count=2)
        run.fault(status=503, method="GET", path_regex=RESOLVE, count=3)
        node, path, data, tensors = prepared[-1]
        # the other deltas' CDN requests: this rule must leave the last delta's alone, or its peek (the
        # request the rule below lets through) may be answered by this one and the skip lands on the download
        run.fault(status=502, route="cdn", path_regex=f"^/lfs-cdn/(?!{sha256(data)}).*[?&]path=nodes%2F", count=2)
        run.fault(status=503, route="cdn", oid=sha256(data), skip=1, count=1)    # its download, not the peek
    run.round(install)
    # a 5xx answer's body is not delta data: nothing may end up discarded for a bad sha256 / size
    bad = [ln for ln in run.d.log_text().splitlines() if DISCARDED in ln]
    assert not bad, "\n".join(bad) + "\n" + fmt_requests(dilocod_entries(run.hub, run.seq0, "cdn"))
    run.check(min_faults=11)


def case_5xx_publishing(run):
    W = run.W

    def install(prepared):
        run.fault(status=500, path_regex=PREUPLOAD, count=2)
        run.fault(status=503, route="lfs_batch", skip=W, count=2)
        run.fault(status=502, route="lfs_upload", skip=W, count=2)
        run.fault(status=503, route="lfs_verify", skip=W, count=2)
        run.fault(status=500, path_regex=COMMIT, count=2)
    run.round(install)
    run.check(min_faults=10)


def case_publish_outage_retried_whole(run):
    """The commit endpoint fails 7 times in a row: the publish's commit request gives up after its 5
    attempts (no request retries for ever), the daemon counts a failed publish and publishes again
    after its backoff, for the newest step, and the second publish goes through."""
    def install(prepared):
        run.fault(status=503, path_regex=COMMIT, count=7)
    run.round(install)
    with urllib.request.urlopen(run.d.url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    errors = int(re.search(r"^dilocod_publish_errors_total (\d+)$", text, re.M).group(1))
    assert errors >= 1, text
    assert "publish failed, will retry" in run.d.log_text(), run.d.diag()
    run.check(min_faults=7)


def case_429_retry_after(run):
    def install(prepared):
        run.fault(status=429, retry_after=2, path_regex=REV, count=1)
        run.fault(status=429, retry_after=1, method="GET", path_regex=RESOLVE, count=1)
        run.fault(status=429, retry_after=2, path_regex=COMMIT, count=1)
    run.round(install)
    assert_waited_after_429(run, {"repo_info": 2, "resolve": 1, "commit": 2})
    run.check(min_faults=3)


def case_429_ratelimit_t(run):
    """Only the RateLimit header's t is usable (Retry-After is garbage)."""
    W = run.W

    def install(prepared):
        bad = {"Retry-After": "soon"}
        run.fault(status=429, retry_after=2, headers=bad, path_regex=TREE, count=1)
        run.fault(status=429, retry_after=2, headers=bad, route="lfs_batch", skip=W, count=1)
        run.fault(status=429, retry_after=2, headers=bad, path_regex=COMMIT, count=1)
    run.round(install)
    assert_waited_after_429(run, {"tree": 2, "lfs_batch": 2, "commit": 2})
    run.check(min_faults=3)


def case_drop_mid_body(run):
    W = run.W

    def install(prepared):
        for node, path, data, tensors in prepared[:2]:
            # skip=1: the header peek; then the download is cut after 40000 bytes
            run.fault(kind="drop", route="cdn", oid=sha256(data), skip=1, count=1, after_bytes=40000)
        run.fault(kind="drop", path_regex=TREE, count=1)
        run.fault(kind="drop", path_regex=REV, count=1)
        run.fault(kind="drop", route="lfs_batch", skip=W, count=1)
    prepared = run.round(install)
    # the cut downloads were resumed with a Range request from where they stopped
    cdn = dilocod_entries(run.hub, run.seq0, "cdn")
    for node, path, data, tensors in prepared[:2]:
        ranges = [e["range"] for e in cdn if sha256(data) in e["path"] and e["range"]]
        assert "bytes=40000-" in ranges, (node, ranges)
    run.check(min_faults=5)


def case_drop_commit_response(run):
    """The commit is applied, then the connection drops before dilocod reads the answer: dilocod must
    find out that the step is on the Hub, not commit it a second time."""
    def install(prepared):
        run.fault(kind="drop", path_regex=COMMIT, count=1, after_bytes=5)
    run.round(install)
    run.check(min_faults=1)


def case_truncate(run):
    def install(prepared):
        node, path, data, tensors = prepared[0]
        run.fault(kind="truncate", oid=sha256(data), skip=1, count=1)   # skip=1: the header peek
        run.fault(kind="truncate", path_regex=STEPFILE, count=1)
    prepared = run.round(install)
    log = run.d.log_text()
    bad = [ln for ln in log.splitlines() if DISCARDED in ln]
    assert any(prepared[0][1] in ln and "size" in ln for ln in bad), "\n".join(bad) or log[-4000:]
    run.check(min_faults=2)


def case_truncate_last_listing(run):
    """The only listing that shows the round's last deltas comes back truncated (valid HTTP, broken
    JSON): dilocod must list again at a later poll even though the revision sha does not move."""
    prepared = run.prepare()
    block = run.hub.fault(status=503, path_regex=REV, count=-1)    # hold the polls
    n0 = len(dilocod_entries(run.hub, run.seq0, "repo_info"))
    run.d.wait(lambda: len(dilocod_entries(run.hub, run.seq0, "repo_info")) > n0 + 1, "polls answered 503")
    run.upload(prepared)
    run.fault(kind="truncate", path_regex=TREE, count=1)
    run.hub.ctl("DELETE", f"/_sim/faults/{block['id']}")
    run.finish(prepared, timeout=30)
    run.check(min_faults=2)


def case_corrupt(run):
    def install(prepared):
        for node, path, data, tensors in prepared[1:]:
            run.fault(kind="corrupt", oid=sha256(data), skip=1, count=1)
    prepared = run.round(install)
    bad = [ln for ln in run.d.log_text().splitlines() if DISCARDED in ln]
    for node, path, data, tensors in prepared[1:]:
        assert any(path in ln and "sha256" in ln for ln in bad), (path, bad)
    run.check(min_faults=2)


def case_slow(run):
    W = run.W

    def install(prepared):
        run.fault(kind="delay", delay=1.0, path_regex=REV, count=2)
        run.fault(kind="delay", delay=1.5, path_regex=TREE, count=1)
        run.fault(kind="throttle", bytes_per_sec=100_000, route="cdn", path_regex=DELTA_CDN, count=2)
        run.fault(kind="delay", delay=1.0, route="lfs_upload", skip=W, count=1)
        run.fault(kind="delay", delay=1.0, path_regex=COMMIT, count=1)
    run.round(install)
    run.check(min_faults=7)


def case_412(run):
    """A 412 on dilocod's commit (hubsim's switch), then a real one: while dilocod's second try is held
    back, another client commits to main."""
    prepared = run.prepare()
    run.fault(kind="commit_412", path_regex=COMMIT, count=1)
    run.fault(kind="delay", delay=3, path_regex=COMMIT, skip=1, count=1)
    since = run.hub.last_seq()
    run.upload(prepared)
    run.d.wait(lambda: [e for e in dilocod_entries(run.hub, since, "commit") if e["fault"] == "delay"],
               "dilocod's second commit (held back)")
    run.workers.api.upload_file(path_or_fileobj=b"hello\n", path_in_repo="notes/other-client.txt", repo_id=REPO,
                                revision=WREV, commit_message="another client")
    run.finish(prepared)
    statuses = [e["status"] for e in dilocod_entries(run.hub, since, "commit")]
    assert statuses[:3] == [412, 412, 200], statuses
    assert run.d.log_text().count("hub: parent commit moved") >= 2, run.d.diag()
    run.check(min_faults=2)


def case_mixed_random(run):
    rng = random.Random(20240611)
    W = run.W
    pool = [
        lambda p: run.fault(status=rng.choice([500, 502, 503]), path_regex=REV, count=rng.randint(1, 3)),
        lambda p: run.fault(status=rng.choice([500, 502, 503]), path_regex=TREE, count=rng.randint(1, 2)),
        lambda p: run.fault(status=rng.choice([502, 503]), method="GET", path_regex=RESOLVE, count=rng.randint(1, 3)),
        lambda p: run.fault(status=rng.choice([500, 503]), route="cdn", path_regex=DELTA_CDN, count=rng.randint(1, 2)),
        lambda p: run.fault(status=429, retry_after=1, path_regex=rng.choice([REV, TREE, COMMIT, PREUPLOAD])),
        lambda p: run.fault(status=rng.choice([500, 502, 503, 429]), retry_after=1,
                            route=rng.choice(["lfs_batch", "lfs_upload", "lfs_verify"]), skip=W),
        lambda p: run.fault(status=rng.choice([500, 503]), path_regex=rng.choice([PREUPLOAD, COMMIT])),
        lambda p: run.fault(kind="drop", oid=sha256(rng.choice(p)[2]), skip=1, after_bytes=rng.randint(1, 60000)),
        lambda p: run.fault(kind="drop", path_regex=rng.choice([REV, TREE])),
        lambda p: run.fault(kind="truncate", oid=sha256(rng.choice(p)[2]), skip=1),
        lambda p: run.fault(kind="corrupt", oid=sha256(rng.choice(p)[2]), skip=1),
        lambda p: run.fault(kind="delay", delay=round(rng.uniform(0.2, 1.0), 2),
                            path_regex=rng.choice([REV, TREE, RESOLVE, COMMIT])),
        lambda p: run.fault(kind="throttle", bytes_per_sec=200_000, route="cdn", path_regex=DELTA_CDN),
        lambda p: run.fault(kind="commit_412", path_regex=COMMIT),
    ]
    for _ in range(3):
        run.round(lambda p: [rng.choice(pool)(p) for _ in range(4)])
        # a rule may be left over only if its request did not happen in this round: drop them all
        run.hub.clear_faults()
    run.rules = []
    print("mixed run, faults that fired:", sorted(e["fault"] for e in run.faulted()))
    run.check(min_faults=6)


FAULT_CASES = {
    "5xx_polling": case_5xx_polling,
    "5xx_publishing": case_5xx_publishing,
    "publish_outage_retried_whole": case_publish_outage_retried_whole,
    "429_retry_after": case_429_retry_after,
    "429_ratelimit_t": case_429_ratelimit_t,
    "drop_mid_body": case_drop_mid_body,
    "drop_commit_response": case_drop_commit_response,
    "truncate": case_truncate,
    "truncate_last_listing": case_truncate_last_listing,
    "corrupt": case_corrupt,
    "slow": case_slow,
    "412": case_412,
    "mixed_random": case_mixed_random,
}


@pytest.mark.parametrize("case", list(FAULT_CASES))
def test_fault_switches(tmp_path, procs, case):
    run = FaultRun(tmp_path, procs)
    FAULT_CASES[case](run)
    assert run.d.stop() == 0


# ---- 3. API-call budget at the default poll interval -----------------------------------------------

def test_api_call_budget_default_poll_interval(tmp_path, procs):
    """8 stock-client workers, rounds back to back, dilocod at its default --poll-interval (5 s).

    Method: real time, ~60 s from dilocod's start (bootstrap and publish of step 0 included, so the
    figure is pessimistic), then linear extrapolation to the Hub's 5-minute window:
    calls_per_5min = calls * 300 / elapsed.  The Hub's limit (1,000 API calls / 5 min) is per user
    token, and every worker uploads with its own token, so the figure that must stay under it is
    dilocod's: its requests in the emulator's request log (/_sim/requests, the per-request view of
    /_sim/stats; Host tells dilocod from the workers), category "api" only (not resolver / CDN / LFS).
    The emulator's total (workers included) is reported too."""
    nodes = [f"w{i}" for i in range(8)]
    hub, api, d, init = setup_run(tmp_path, nodes, poll=None, retry=None)   # defaults only
    procs += [hub, d]
    seq0 = hub.last_seq()
    stats0 = hub.stats()
    t0 = time.time()
    d.start()
    workers = Workers(hub, tmp_path, nodes, revision=None)
    oracle = Oracle(init)
    d.wait_published(0, timeout=30)
    step = 0
    while time.time() - t0 < 52:
        deltas = workers.round(step, want=oracle.state)
        oracle.step(deltas)
        step += 1
        d.wait_published(step, timeout=30)
    t1 = time.time()
    elapsed = t1 - t0
    entries = [e for e in hub.requests(seq0) if e["time"] <= t1]
    mine = [e for e in entries if by_dilocod(e)]
    api_calls = sum(e["category"] == "api" for e in mine)
    per5 = api_calls * 300.0 / elapsed
    total_api = hub.stats()["api"] - stats0["api"]
    by_route = {}
    for e in mine:
        by_route[e["route"]] = by_route.get(e["route"], 0) + 1
    report = (f"{step} rounds in {elapsed:.1f}s; dilocod: {api_calls} API calls -> {per5:.0f} per 5 min "
              f"(dilocod's own counter {d.status()['hub']['api_calls']}, incl. LFS batch/verify); "
              f"all clients at the emulator: {total_api} API calls -> {total_api * 300.0 / elapsed:.0f} per 5 min; "
              f"dilocod requests by route {by_route}")
    print(report)
    assert step >= 3, report                    # rounds really ran during the window
    assert per5 < 1000, report
    # /metrics carries the transport's counters, the same numbers /status shows
    import urllib.request
    from prometheus_client.parser import text_string_to_metric_families
    with urllib.request.urlopen(d.url + "/metrics", timeout=10) as r:
        fams = {f.name: f for f in text_string_to_metric_families(r.read().decode())}
    calls = fams["dilocod_hub_api_calls"].samples[0].value
    assert 0 < calls <= d.status()["hub"]["api_calls"], (calls, d.status()["hub"])
    assert fams["dilocod_hub_last_poll_timestamp_seconds"].samples[0].value > t0 - 60
    assert fams["dilocod_hub_last_publish_timestamp_seconds"].samples[0].value > t0 - 60
    # every round's deltas were downloaded, each at least the model's floating bytes (s3:// counted
    # them; hf:// left the counter at 0)
    float_bytes = sum(v.numel() * 4 for v in init.values() if v.is_floating_point())
    got = fams["dilocod_hub_download_bytes"].samples[0].value
    assert got >= step * len(nodes) * float_bytes, (got, step, float_bytes)
    assert dilocod_steps_in_history(api) == list(range(step + 1))
    assert_state_close(workers.global_state(), oracle.state)
    assert d.stop() == 0


# ---- 4. kill -9 in the middle of a download and of a publish ---------------------------------------

def big_model(seed=3):
    """64 MiB of F32 (plus a small bias and an I64 buffer): a 64 MiB delta, a multipart global."""
    g = torch.Generator().manual_seed(seed)
    return {"big.weight": torch.randn(4096, 4096, generator=g), "big.bias": torch.randn(64, generator=g),
            "steps": torch.tensor([1, 2, 3], dtype=torch.int64)}


def test_restart_mid_download_and_mid_publish(tmp_path, procs):
    nodes = ["w0", "w1"]
    init = big_model()
    hub, api, d, init = setup_run(tmp_path, nodes, init=init)
    procs += [hub, d]
    d.start()
    d.wait_published(0, timeout=120)
    oracle = Oracle(init)
    workers = Workers(hub, tmp_path, nodes)
    incoming = d.state_dir / "cache" / "incoming"

    def prepare(step):
        return [(n, *workers.prepare(n, step, oracle.state)) for n in nodes]

    def upload(prepared):
        with ThreadPoolExecutor(len(prepared)) as ex:
            list(ex.map(lambda p: workers.upload(p[1], p[2]), prepared))

    # -- round 1: kill -9 while both 64 MiB deltas are half downloaded (the CDN sends 8 MiB/s)
    prepared = prepare(0)
    for p in prepared:
        hub.fault(kind="throttle", bytes_per_sec=8 * MiB, route="cdn", oid=sha256(p[2]), count=-1)
    upload(prepared)

    def parts():
        return part_sizes(incoming, "hf-*.part")

    d.wait(lambda: sum(parts().values()) >= 16 * MiB, "half-downloaded deltas in cache/incoming", timeout=60)
    d.kill9()
    before = {name: n for name, n in parts().items() if n > 0}
    assert before and all(n < 64 * MiB for n in before.values()), before
    hub.clear_faults()
    seq = hub.last_seq()
    d.start()
    d.wait_published(1, timeout=120)
    oracle.step({p[0]: p[3] for p in prepared})
    cdn = dilocod_entries(hub, seq, "cdn")
    for name, size in before.items():
        oid = name[len("hf-"):-len(".part")]
        ranges = [e["range"] for e in cdn if oid in e["path"] and not is_peek(e)]
        assert ranges and ranges[0] == f"bytes={size}-", (name, size, ranges, fmt_requests(cdn))
    assert "resuming" in d.log_text()

    # -- round 2: kill -9 while dilocod uploads the parts of global step 2 (they are held 5 s each)
    prepared = prepare(1)
    not_workers = "|".join(sha256(p[2]) for p in prepared)
    hub.fault(kind="delay", delay=5, route="lfs_part", path_regex=rf"^/lfs-upload/(?!{not_workers})", count=-1)
    seq = hub.last_seq()
    upload(prepared)
    d.wait(lambda: [e for e in dilocod_entries(hub, seq, "lfs_part") if e["fault"] == "delay"],
           "dilocod uploading the parts of step 2", timeout=120)
    assert d.status()["outer_step"] == 2
    d.kill9()
    hub.clear_faults()
    oracle.step({p[0]: p[3] for p in prepared})
    assert dilocod_steps_in_history(api) == [0, 1]
    d.start()
    d.wait_published(2, timeout=120)
    assert dilocod_steps_in_history(api) == [0, 1, 2]

    # -- round 3: the commit of step 3 is applied but its answer is lost (connection cut, the retry
    # held back), and dilocod is killed right then; restarted, it must see that step 3 is published
    prepared = prepare(2)
    hub.fault(kind="drop", path_regex=COMMIT, count=1, after_bytes=5)
    hub.fault(kind="delay", delay=5, path_regex=COMMIT, skip=1, count=1)
    seq = hub.last_seq()
    upload(prepared)
    d.wait(lambda: [e for e in dilocod_entries(hub, seq, "commit") if e["status"] == 200],
           "dilocod's commit of step 3", timeout=120, interval=0.01)
    d.kill9()
    hub.clear_faults()
    oracle.step({p[0]: p[3] for p in prepared})
    # a retry that was held back still reaches the emulator (and is refused: stale parent): wait for it
    wait_until(lambda: all(e["status"] is not None for e in dilocod_entries(hub, seq, "commit")),
               "the held-back commit retry answered", timeout=15)
    assert dilocod_steps_in_history(api) == [0, 1, 2, 3]
    d.start()
    d.wait_published(3, timeout=60)
    time.sleep(1.5)     # a few polls: nothing more may be committed
    assert dilocod_steps_in_history(api) == [0, 1, 2, 3], d.diag()
    assert d.status()["outer_step"] == 3

    # -- a clean round after all that
    prepared = prepare(3)
    upload(prepared)
    d.wait_published(4, timeout=120)
    oracle.step({p[0]: p[3] for p in prepared})
    assert dilocod_steps_in_history(api) == [0, 1, 2, 3, 4]
    assert workers.step_count()["outer_step"] == 4
    assert_state_close(workers.global_state(), oracle.state)
    assert d.stop() == 0


# ---- 5. adopting a Python master's global; the token stays home ---------------------------------

def python_master(tmp_path, procs, step=7):
    """hubsim with a repo where a "Python master" (stock client) published its global at `step`."""
    from huggingface_hub import CommitOperationAdd
    from safetensors.torch import save as torch_save

    hub = HubSim(tmp_path)
    procs.append(hub)
    api = HfApi(endpoint=hub.wendpoint, token=TOKEN)
    api.create_repo(REPO)
    master = model(seed=42)
    step_count = {"algorithm": "dumb_diloco", "model_file": "global/latest.safetensors", "optimizer": "nesterov_sgd",
                  "outer_step": step, "updated_at": "2026-01-01T12:00:00+00:00"}
    api.create_commit(REPO, operations=[
        CommitOperationAdd("global/latest.safetensors", torch_save(master)),
        CommitOperationAdd("global/step_count.json", json.dumps(step_count, indent=2).encode()),
    ], commit_message=f"python master: outer step {step}")
    return hub, api, master


def served_global(d):
    from safetensors.torch import load as torch_load
    with urllib.request.urlopen(d.url + "/global/latest.safetensors", timeout=30) as r:
        return torch_load(r.read())


def test_adopts_python_masters_global_and_keeps_the_token_home(tmp_path, procs):
    hub, api, master = python_master(tmp_path, procs)
    init_path = tmp_path / "init.safetensors"       # given, but the Hub's global wins
    write_model(init_path, model(seed=0))
    token_file = tmp_path / "hub-token"
    token_file.write_text(TOKEN + "\n")
    nodes = ["w0", "w1"]
    d = HfDilocod(tmp_path, hub, "--init-model", init_path, "--nodes", ",".join(nodes), "--retry-interval", "0.5",
                  token_file=token_file)
    procs.append(d)
    d.start()
    d.wait(lambda: re.search(r"adopted the published global step=7 momentum=fresh", d.log_text()),
           "adoption of step 7")
    assert d.status()["outer_step"] == 7
    d.wait_published(7)
    workers = Workers(hub, tmp_path, nodes)
    oracle = Oracle(master)                         # fresh momentum
    deltas = workers.round(7, want=master)
    oracle.step(deltas)
    d.wait_published(8)
    assert workers.step_count()["outer_step"] == 8
    assert_state_close(workers.global_state(), oracle.state)
    assert dilocod_steps_in_history(api) == [8]     # step 7 is not published again, no step 0

    # the token: sent on API / resolve / LFS batch calls, never to the CDN or the storage host
    mine = [e for e in hub.requests() if by_dilocod(e)]
    cdn = [e for e in mine if e["category"] == "cdn"]
    storage = [e for e in mine if e["route"] in ("lfs_upload", "lfs_part", "lfs_complete")]
    assert cdn and storage, fmt_requests(mine)
    assert not [e for e in cdn + storage if e["auth"]], fmt_requests(cdn + storage)
    assert all(e["auth"] for e in mine if e["category"] in ("api", "resolver")), fmt_requests(mine)
    stats = hub.stats()
    assert stats["cdn_with_auth"] == 0 and stats["upload_with_auth"] == 0, stats
    # ... and never shows up in what dilocod writes or serves
    served = d.status_text()
    for path in ("/metrics", "/rounds", "/", "/global/step_count.json"):
        with urllib.request.urlopen(d.url + path, timeout=10) as r:
            served += r.read().decode(errors="replace")
    assert TOKEN not in served
    assert TOKEN not in d.log_text()
    assert d.stop() == 0
    assert TOKEN not in d.log_text()


ADOPTION_FAULTS = {
    "503_on_resolve": dict(status=503, method="GET", path_regex=r"^/org/model/resolve/main/global/latest\."),
    "drop_on_cdn": dict(kind="drop", route="cdn", path_regex=r"path=global%2Flatest"),
    "truncate_on_cdn": dict(kind="truncate", route="cdn", path_regex=r"path=global%2Flatest"),
    "corrupt_on_cdn": dict(kind="corrupt", route="cdn", path_regex=r"path=global%2Flatest"),
}


@pytest.mark.parametrize("fault", list(ADOPTION_FAULTS))
def test_adoption_survives_one_broken_download_of_the_global(tmp_path, procs, fault):
    """The first download of the Hub's global (to adopt it) fails once, transiently or with wrong bytes:
    dilocod must not adopt anything broken, must try again, and adopt the master's global."""
    hub, api, master = python_master(tmp_path, procs)
    hub.fault(count=1, **ADOPTION_FAULTS[fault])
    d = HfDilocod(tmp_path, hub, "--nodes", "w0,w1", "--retry-interval", "0.5")
    procs.append(d)
    d.start()
    d.wait(lambda: "adopted the published global step=7" in d.log_text(), "adoption of step 7", timeout=12)
    assert [r for r in hub.faults() if r["count"] > 0] == []    # the fault did fire
    assert d.status()["outer_step"] == 7
    assert_state_close(served_global(d), master)
    assert d.stop() == 0
