"""dilocod's HTTP API end to end (README.md, HTTP API): a whole training over HTTP only, every error
code of the upload routes, auth (tokens, SIGHUP reload, loopback-only rule), HTTP limits, protocol
details (pipelining, chunked bodies, disconnects, ETag/Range/HEAD, slowloris, many concurrent
uploads, SIGTERM mid-upload), bounded memory for a 1 GiB upload, and the /metrics, /status and
/rounds documents.  Raw sockets are used wherever the exact bytes on the wire matter."""
import concurrent.futures
import contextlib
import errno
import json
import math
import os
import re
import select
import shutil
import signal
import socket
import struct
import subprocess
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import requests
import torch
from safetensors.numpy import save as np_save
from safetensors.torch import load as torch_load_bytes

from dilocod_proc import Dilocod, Oracle, assert_state_close, delta_metadata, random_deltas, write_model

CONTAINER_CODES = {
    "header_too_small", "header_too_large", "invalid_header_length", "invalid_header",
    "invalid_header_deserialization", "invalid_offset", "metadata_incomplete_buffer", "validation_overflow",
    "misaligned_slice", "tensor_invalid_info", "duplicate_key",
}

TOKENS = {
    "node-a": "token-aaaaaaaaaaaaaaaa",
    "node-b": "token-bbbbbbbbbbbbbbbb",
    "*": "admin-tttttttttttttttttt",
}


# ---- helpers ------------------------------------------------------------------------------------

def small_model(seed=0):
    """F32, BF16 and F16 weights and an I64 buffer (deltas carry the four floating keys)."""
    g = torch.Generator().manual_seed(seed)
    return {
        "layer.weight": torch.randn(32, 16, generator=g),
        "layer.bias": torch.randn(16, generator=g),
        "emb": torch.randn(10, 8, generator=g).to(torch.bfloat16),
        "head": torch.randn(8, 4, generator=g).to(torch.float16),
        "count": torch.tensor([3, -1, 1 << 40], dtype=torch.int64),
    }


def delta_blob(node, base, local, tensors, metadata=None) -> bytes:
    """A delta file as the reference writes it (safetensors with the reference metadata), as bytes."""
    return np_save(tensors, metadata=metadata if metadata is not None else delta_metadata(node, base, local))


def header_end(blob: bytes) -> int:
    """8 + N: where the data section of a safetensors file starts."""
    return 8 + struct.unpack("<Q", blob[:8])[0]


def session():
    s = requests.Session()
    s.trust_env = False
    return s


def err_code(resp):
    body = resp.json()
    assert set(body) == {"error"}, body
    return body["error"]["code"]


def assert_error(resp, status, code, tensor=None):
    assert resp.status_code == status, (resp.status_code, resp.text)
    assert resp.headers.get("Content-Type", "").startswith("application/json"), resp.headers
    body = resp.json()
    assert body["error"]["code"] == code, body
    assert isinstance(body["error"]["message"], str) and body["error"]["message"], body
    if tensor is not None:
        assert body["error"].get("tensor") == tensor, body
    return body


def auth(node):
    return {"Authorization": f"Bearer {TOKENS[node]}"}


def put(url, node, local, blob, headers=None):
    with session() as s:
        return s.put(f"{url}/nodes/{node}/delta_{local}.safetensors", data=blob, headers=headers or {}, timeout=60)


def post(url, node, blob, headers=None):
    with session() as s:
        return s.post(f"{url}/nodes/{node}/deltas", data=blob, headers=headers or {}, timeout=60)


def get(url, path, **kw):
    with session() as s:
        return s.get(url + path, timeout=kw.pop("timeout", 30), **kw)


def status(url):
    r = get(url, "/status")
    assert r.status_code == 200, r.text
    return r.json()


def wait_for(pred, timeout=60, what="condition", interval=0.02):
    deadline = time.time() + timeout
    last = None
    while time.time() < deadline:
        last = pred()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"{what} not reached within {timeout}s (last: {last!r})")


def wait_status(url, pred, timeout=60, what="status"):
    holder = {}

    def check():
        holder["s"] = status(url)
        return pred(holder["s"])
    try:
        wait_for(check, timeout, what)
    except AssertionError:
        raise AssertionError(f"{what} not reached within {timeout}s: {json.dumps(holder.get('s'))[:3000]}")
    return holder["s"]


def assert_serving(d: Dilocod, when=""):
    """dilocod is alive and answers /healthz (else: its exit code and the end of its log)."""
    try:
        ok = get(url_of(d), "/healthz", timeout=10).status_code == 200
    except requests.ConnectionError:
        ok = False
        try:
            d.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
    assert ok and d.alive(), (f"dilocod stopped serving {when} (exit code {d.proc.poll()}):\n"
                              f"{d.log_text()[-3000:]}")


def incoming(d: Dilocod):
    p = d.state_dir / "cache" / "incoming"
    return sorted(os.listdir(p)) if p.exists() else []


def vm_kib(pid, field):
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(f"{field} not in /proc/{pid}/status")


class Resp:
    def __init__(self, status, reason, headers, body):
        self.status, self.reason, self.headers, self.body = status, reason, headers, body

    def json(self):
        return json.loads(self.body)

    def __repr__(self):
        return f"<{self.status} {self.reason} {self.headers} {self.body[:300]!r}>"


class Raw:
    """A raw HTTP/1.1 client connection: exact request bytes out, responses parsed by hand."""

    def __init__(self, host, port, timeout=20):
        self.sock = socket.create_connection((host, port), timeout=timeout)
        self.buf = b""

    def send(self, data: bytes):
        self.sock.sendall(data)

    def _fill(self):
        try:
            chunk = self.sock.recv(1 << 16)
        except ConnectionResetError:
            chunk = b""
        if not chunk:
            raise EOFError(f"connection closed by the server (buffered: {self.buf[:200]!r})")
        self.buf += chunk

    def response(self, head_only=False) -> Resp:
        while b"\r\n\r\n" not in self.buf:
            self._fill()
        head, self.buf = self.buf.split(b"\r\n\r\n", 1)
        lines = head.decode("latin-1").split("\r\n")
        version, code, reason = (lines[0].split(" ", 2) + [""])[:3]
        assert version == "HTTP/1.1", lines[0]
        headers = {}
        for line in lines[1:]:
            k, v = line.split(":", 1)
            headers[k.strip().lower()] = v.strip()
        code = int(code)
        n = 0 if head_only or code in (204, 304) or code < 200 else int(headers.get("content-length", "0"))
        while len(self.buf) < n:
            self._fill()
        body, self.buf = self.buf[:n], self.buf[n:]
        return Resp(code, reason, headers, body)

    def closed_by_peer(self, timeout=10) -> bool:
        """True once the server closed the connection (EOF or reset) with nothing more to read."""
        self.sock.settimeout(timeout)
        try:
            chunk = self.sock.recv(1 << 16)
        except ConnectionResetError:
            return True
        except socket.timeout:
            return False
        if chunk:
            self.buf += chunk
            return False
        return True

    def close(self):
        self.sock.close()


def request_head(method, path, headers=(), host="dilocod"):
    lines = [f"{method} {path} HTTP/1.1", f"Host: {host}", *[f"{k}: {v}" for k, v in headers]]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


@contextlib.contextmanager
def non_loopback_address():
    """An IPv4 address of this machine outside 127/8: one it has, or one on a dummy interface."""
    out = subprocess.run(["hostname", "-I"], capture_output=True, text=True).stdout.split()
    have = [a for a in out if re.fullmatch(r"\d+\.\d+\.\d+\.\d+", a) and not a.startswith("127.")]
    if have:
        yield have[0]
        return
    created = None
    if subprocess.run(["ip", "link", "add", "dl0", "type", "dummy"]).returncode == 0:
        created = ("link", "dl0")
        subprocess.run(["ip", "addr", "add", "10.99.0.1/24", "dev", "dl0"], check=True)
        subprocess.run(["ip", "link", "set", "dl0", "up"], check=True)
    else:
        subprocess.run(["ip", "addr", "add", "10.99.0.1/32", "dev", "lo"], check=True)
        created = ("addr", "lo")
    try:
        yield "10.99.0.1"
    finally:
        if created[0] == "link":
            subprocess.run(["ip", "link", "del", "dl0"])
        else:
            subprocess.run(["ip", "addr", "del", "10.99.0.1/32", "dev", "lo"])


def write_token_file(path, tokens):
    path.write_text("# node token\n" + "".join(f"{n} {t}\n" for n, t in tokens.items()))
    path.chmod(0o600)           # dilocod refuses a token file others can read


def url_of(d: Dilocod, host="127.0.0.1"):
    return f"http://{host}:{d.port}"



@pytest.fixture
def daemons(tmp_path):
    """start(model, *args, name=, hub=, init=True) -> a running Dilocod (hub None: --hub none), ready
    to answer /healthz.  Every daemon still running at the end is stopped."""
    started = []

    def start(model, *args, name="d", hub=None, init=True, host="127.0.0.1"):
        base = tmp_path / name
        base.mkdir(exist_ok=True)
        extra = []
        if init:
            if not (base / "init.safetensors").exists():
                write_model(base / "init.safetensors", model)
            extra = ["--init-model", str(base / "init.safetensors")]
        d = Dilocod(base, hub, *extra, *args).start()
        started.append(d)
        wait_healthy(d, host)
        return d

    yield start
    for d in started:
        if d.proc is not None and d.proc.poll() not in (None, 0):
            print(f"dilocod in {d.tmp} died with exit code {d.proc.returncode}; its log ends with:\n"
                  f"{d.log_text()[-4000:]}")
        if d.alive():
            try:
                d.stop(timeout=30)
            except Exception:
                d.kill9()


def wait_healthy(d: Dilocod, host="127.0.0.1", timeout=30):
    url = url_of(d, host)

    def ok():
        try:
            return get(url, "/healthz", timeout=2).status_code == 200
        except requests.ConnectionError:
            return False
    wait_for(ok, timeout, "dilocod answering /healthz")


# ---- 1. a whole training over HTTP only -----------------------------------------------------------

def test_training_over_http_only_matches_the_torch_oracle(daemons):
    """Four workers (threads), --hub none: each round they download the global and step file, upload
    a random delta (two by PUT, two by POST), wait for outer_step to advance; every global they
    downloaded equals the torch oracle."""
    model = small_model(1)
    d = daemons(model, "--expected-nodes", "4", "--threads", "2")
    url = d.url
    nodes = ["worker-0", "worker-1", "worker-2", "worker-3"]
    by_post = {"worker-1", "worker-3"}
    rounds = 5
    deltas = {r: {} for r in range(rounds)}
    downloads = {n: {} for n in nodes}
    lock = threading.Lock()

    def worker(i, node):
        rng = np.random.default_rng(1000 + i)
        with session() as s:
            for r in range(rounds + 1):
                g = s.get(f"{url}/global/latest.safetensors", timeout=30)
                assert g.status_code == 200, (node, r, g.status_code, g.text[:300])
                assert g.headers["X-Outer-Step"] == str(r), (node, r, g.headers)
                assert len(g.content) == int(g.headers["Content-Length"])
                sc = s.get(f"{url}/global/step_count.json", timeout=30)
                assert sc.status_code == 200, sc.text
                sc = sc.json()
                assert sc["outer_step"] == r and sc["algorithm"] == "dumb_diloco", sc
                assert sc["model_file"] == "global/latest.safetensors", sc
                with lock:
                    downloads[node][r] = g.content
                if r == rounds:
                    return
                t = random_deltas(rng, model)
                local = 100 * (r + 1) + i
                blob = delta_blob(node, r, local, t)
                with lock:
                    deltas[r][node] = t
                if node in by_post:
                    resp = s.post(f"{url}/nodes/{node}/deltas", data=blob, timeout=60)
                else:
                    resp = s.put(f"{url}/nodes/{node}/delta_{local}.safetensors", data=blob, timeout=60)
                assert resp.status_code == 201, (node, r, resp.status_code, resp.text)
                j = resp.json()
                assert (j["node_id"], j["local_step"], j["base_outer_step"], j["bytes"], j["result"]) == \
                    (node, local, r, len(blob), "accepted"), j
                assert j["path"] == f"nodes/{node}/delta_{local}.safetensors", j
                deadline = time.time() + 60
                while True:
                    st = s.get(f"{url}/status", timeout=30).json()
                    if st["outer_step"] is not None and st["outer_step"] > r:
                        assert st["outer_step"] == r + 1, st
                        break
                    assert time.time() < deadline, f"{node}: outer_step stuck at {st['outer_step']} (round {r})"
                    time.sleep(0.02)

    with concurrent.futures.ThreadPoolExecutor(len(nodes)) as ex:
        futs = [ex.submit(worker, i, n) for i, n in enumerate(nodes)]
        for f in futs:
            f.result(timeout=180)

    oracle = Oracle(model)
    want = [{k: v.clone() for k, v in model.items()}]
    for r in range(rounds):
        assert sorted(deltas[r]) == nodes
        want.append({k: v.clone() for k, v in oracle.step(deltas[r]).items()})
    for node in nodes:
        assert sorted(downloads[node]) == list(range(rounds + 1))
        for r in range(rounds + 1):
            assert_state_close(torch_load_bytes(downloads[node][r]), want[r])
    assert downloads[nodes[0]][0] == (d.tmp / "init.safetensors").read_bytes()
    st = status(url)
    assert st["outer_step"] == rounds and st["counters"]["accepted"] == 4 * rounds, st
    assert d.stop() == 0


# ---- 2. every error code --------------------------------------------------------------------------

def assert_nothing_kept(d, url):
    st = status(url)
    assert st["round"]["received"] == [], st["round"]
    # a refused upload's file goes once its open or write job is back: the reply may come first
    d.wait_until(lambda: status(url)["uploads_in_progress"] == 0 and incoming(d) == [],
                 "the refused uploads' files to go")


def test_malformed_and_invalid_deltas_are_refused_with_their_code(daemons):
    model = small_model(2)
    d = daemons(model, "--expected-nodes", "2")
    url = d.url
    rng = np.random.default_rng(7)
    good = random_deltas(rng, model)

    # malformed containers: 400 with the container's code.  The last one's header describes 16 bytes
    # of data and 8 follow.
    h = json.dumps({"__metadata__": delta_metadata("node-a", 0, 1),
                    "x": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}).encode()
    h += b" " * ((-len(h)) % 8)
    malformed = {
        "short": (b"\x01\x02\x03", "header_too_small"),
        "header longer than the body": (struct.pack("<Q", 4096) + b"{}" + b" " * 14, "invalid_header_length"),
        "header not JSON": (struct.pack("<Q", 16) + b"{not json at all", "invalid_header_deserialization"),
        "data shorter than the header says": (struct.pack("<Q", len(h)) + h + b"\0" * 8,
                                              "metadata_incomplete_buffer"),
    }
    for what, (blob, code) in malformed.items():
        r = put(url, "node-a", 1, blob)
        assert r.status_code == 400, (what, r.status_code, r.text)
        assert err_code(r) == code and code in CONTAINER_CODES, (what, r.text)

    # the same refusals when the body arrives in its own segments, after the upload has started (as
    # curl and streaming clients send it): a refusal from the 8-byte prefix, from the header and from
    # the data, each answered, and the daemon keeps serving
    nan = {k: v.copy() for k, v in good.items()}
    nan["layer.weight"][3, 4] = np.nan
    wrong_key = dict(good, **{"zz.extra": np.ones(8, np.float32)})
    for blob, status_code, code in ((malformed["header longer than the body"][0], 400, "invalid_header_length"),
                                    (malformed["header not JSON"][0], 400, "invalid_header_deserialization"),
                                    (delta_blob("node-a", 0, 1, wrong_key), 422, "key_mismatch"),
                                    (delta_blob("node-a", 0, 1, nan), 422, "non_finite")):
        raw = Raw("127.0.0.1", d.port)
        raw.send(request_head("PUT", "/nodes/node-a/delta_1.safetensors", [("Content-Length", len(blob))]))
        wait_status(url, lambda s: s["uploads_in_progress"] == 1, what="the upload started")
        time.sleep(0.1)
        try:
            for i in range(0, len(blob), 100):
                raw.send(blob[i:i + 100])
                time.sleep(0.001)
        except (BrokenPipeError, ConnectionResetError):
            pass                # refused early and closed: the response is already on its way
        try:
            resp = raw.response()
        except EOFError:
            resp = None
        raw.close()
        assert_serving(d, f"after refusing a {code} upload sent in pieces")
        assert resp is not None and resp.status == status_code, (code, resp)
        assert resp.json()["error"]["code"] == code, (code, resp)
        wait_status(url, lambda s: s["uploads_in_progress"] == 0, what="the refused upload released")
    assert "upload aborted" not in d.log_text(), "a refused upload was also reported aborted"

    # wrong shape, NaN, wrong dtype, missing metadata: 422, the tensor named
    bad = dict(good, **{"layer.weight": np.zeros((16, 32), np.float32)})
    assert_error(put(url, "node-a", 1, delta_blob("node-a", 0, 1, bad)), 422, "shape_mismatch", "layer.weight")
    nan = {k: v.copy() for k, v in good.items()}
    nan["layer.bias"][5] = np.nan
    body = assert_error(put(url, "node-a", 1, delta_blob("node-a", 0, 1, nan)), 422, "non_finite", "layer.bias")
    assert "element 5" in body["error"]["message"], body
    inf = {k: v.copy() for k, v in good.items()}
    inf["head"][3, 2] = -np.inf
    assert_error(post(url, "node-a", delta_blob("node-a", 0, 1, inf)), 422, "non_finite", "head")
    f64 = dict(good, emb=good["emb"].astype(np.float64))
    assert_error(put(url, "node-a", 1, delta_blob("node-a", 0, 1, f64)), 422, "dtype_mismatch", "emb")
    assert_error(put(url, "node-a", 1, delta_blob("node-a", 0, 1, good, metadata={"algorithm": "dumb_diloco"})),
                 422, "metadata_missing")

    # path and metadata disagree: 422 path_mismatch (PUT: another node's / another step's metadata;
    # POST: the URL's node id is not the metadata's)
    assert_error(put(url, "node-a", 1, delta_blob("node-b", 0, 1, good)), 422, "path_mismatch")
    assert_error(put(url, "node-a", 2, delta_blob("node-a", 0, 1, good)), 422, "path_mismatch")
    assert_error(post(url, "node-a", delta_blob("node-b", 0, 1, good)), 422, "path_mismatch")
    # a step in the path that is not a canonical integer
    assert_error(put(url, "node-a", "01", delta_blob("node-a", 0, 1, good)), 400, "invalid_path")
    assert_nothing_kept(d, url)

    # wrong keys: refused from the header alone, before the body is sent.  The request announces the
    # whole file but sends only the 8-byte prefix and the header JSON.
    extra = dict(good, **{"zz.extra": np.ones(4096, np.float32)})
    blob = delta_blob("node-a", 0, 1, extra)
    raw = Raw("127.0.0.1", d.port)
    raw.send(request_head("PUT", "/nodes/node-a/delta_1.safetensors",
                          [("Content-Type", "application/octet-stream"), ("Content-Length", len(blob))]))
    raw.send(blob[:header_end(blob)])
    resp = raw.response()
    assert resp.status == 422, resp
    assert resp.json()["error"]["code"] == "key_mismatch" and resp.json()["error"]["tensor"] == "zz.extra", resp
    assert resp.headers.get("connection") == "close", resp
    assert raw.closed_by_peer(10), "the server did not close the connection after refusing the upload"
    raw.close()
    missing = {k: v for k, v in good.items() if k != "head"}
    assert_error(post(url, "node-a", delta_blob("node-a", 0, 1, missing)), 422, "key_mismatch", "head")
    assert_nothing_kept(d, url)

    # round rules: close round 0, then stale (409), future (409), not_newer (409), replaced (201)
    for node in ("node-a", "node-b"):
        r = put(url, node, 5, delta_blob(node, 0, 5, random_deltas(rng, model)))
        assert r.status_code == 201, r.text
    wait_status(url, lambda s: s["outer_step"] == 1, what="outer_step 1")
    assert_error(put(url, "node-a", 6, delta_blob("node-a", 0, 6, good)), 409, "stale")
    assert_error(post(url, "node-a", delta_blob("node-a", 2, 6, good)), 409, "future")
    r = put(url, "node-a", 20, delta_blob("node-a", 1, 20, good))
    assert r.status_code == 201 and r.json()["result"] == "accepted", r.text
    assert_error(put(url, "node-a", 20, delta_blob("node-a", 1, 20, good)), 409, "not_newer")
    assert_error(post(url, "node-a", delta_blob("node-a", 1, 19, good)), 409, "not_newer")
    r = post(url, "node-a", delta_blob("node-a", 1, 21, good))
    assert r.status_code == 201 and r.json()["result"] == "replaced", r.text
    st = status(url)
    assert [(e["node_id"], e["local_step"]) for e in st["round"]["received"]] == [("node-a", 21)], st["round"]
    c = st["counters"]
    assert (c["stale"], c["future"], c["not_newer"], c["replaced"]) == (1, 1, 2, 1), c
    assert incoming(d) == []
    log = d.log_text()
    assert "upload refused" in log and "code=key_mismatch" in log, log[-3000:]


def test_bearer_tokens_per_node_admin_and_sighup_reload(daemons, tmp_path):
    model = small_model(3)
    tokens = tmp_path / "tokens.txt"
    write_token_file(tokens, TOKENS)
    d = daemons(model, "--expected-nodes", "3", "--token-file", str(tokens))
    url = d.url
    rng = np.random.default_rng(11)
    blob_a = delta_blob("node-a", 0, 1, random_deltas(rng, model))

    # no token / malformed scheme / wrong token: 401 with a Bearer challenge
    for headers in ({}, {"Authorization": f"Basic {TOKENS['node-a']}"},
                    {"Authorization": "Bearer wrong-token-0123456789"},
                    {"Authorization": f"Bearer {TOKENS['node-a']}x"}):
        r = put(url, "node-a", 1, blob_a, headers)
        assert_error(r, 401, "unauthorized")
        assert r.headers.get("WWW-Authenticate", "").startswith("Bearer"), (headers, r.headers)
        r = post(url, "node-a", blob_a, headers)
        assert_error(r, 401, "unauthorized")
        assert r.headers.get("WWW-Authenticate", "").startswith("Bearer"), r.headers
    # another node's token: 403
    assert_error(put(url, "node-a", 1, blob_a, auth("node-b")), 403, "forbidden")
    assert_error(post(url, "node-a", blob_a, auth("node-b")), 403, "forbidden")
    assert status(url)["round"]["received"] == []
    # reads need no token
    assert get(url, "/global/latest.safetensors").status_code == 200
    # the node's own token, and the admin token for any node
    r = put(url, "node-a", 1, blob_a, auth("node-a"))
    assert r.status_code == 201, r.text
    r = post(url, "node-b", delta_blob("node-b", 0, 1, random_deltas(rng, model)), auth("*"))
    assert r.status_code == 201, r.text
    # Content-Length missing and not chunked: 411 (raw bytes: a client library would add a length)
    raw = Raw("127.0.0.1", d.port)
    raw.send(request_head("PUT", "/nodes/node-a/delta_2.safetensors",
                          [("Authorization", f"Bearer {TOKENS['node-a']}")]))
    resp = raw.response()
    assert resp.status == 411 and resp.json()["error"]["code"] == "length_required", resp
    raw.close()

    # a new node's token works only after SIGHUP reloads the file
    node_c_token = "token-cccccccccccccccc"
    blob_c = delta_blob("node-c", 0, 1, random_deltas(rng, model))
    write_token_file(tokens, dict(TOKENS, **{"node-c": node_c_token}))
    assert_error(put(url, "node-c", 1, blob_c, {"Authorization": f"Bearer {node_c_token}"}), 401, "unauthorized")
    reloads = d.log_text().count("tokens reloaded")
    os.kill(d.proc.pid, signal.SIGHUP)
    d.wait_log("tokens reloaded", count=reloads + 1)
    r = put(url, "node-c", 1, blob_c, {"Authorization": f"Bearer {node_c_token}"})
    assert r.status_code == 201, r.text
    st = wait_status(url, lambda s: s["outer_step"] == 1, what="the round of node-a, node-b, node-c")
    assert [n["node_id"] for n in st["last_round"]["nodes"]] == ["node-a", "node-b", "node-c"], st["last_round"]
    assert d.alive()
    assert d.stop() == 0


def test_non_loopback_peer_needs_a_token_file(daemons, tmp_path):
    """Without --token-file only loopback peers may upload; a peer on another address gets 403 (and
    still reads).  With a token file the same peer uploads with its token."""
    model = small_model(4)
    rng = np.random.default_rng(12)
    blob = delta_blob("node-a", 0, 1, random_deltas(rng, model))
    with non_loopback_address() as addr:
        d = daemons(model, "--expected-nodes", "2", "--listen", f"{addr}:0", name="open", host=addr)
        url = url_of(d, addr)
        assert_error(put(url, "node-a", 1, blob), 403, "forbidden")
        assert_error(post(url, "node-a", blob), 403, "forbidden")
        assert status(url)["round"]["received"] == []
        assert get(url, "/global/latest.safetensors").status_code == 200
        assert d.stop() == 0

        tokens = tmp_path / "tokens.txt"
        write_token_file(tokens, TOKENS)
        d2 = daemons(model, "--expected-nodes", "2", "--listen", f"{addr}:0", "--token-file", str(tokens),
                     name="with-tokens", host=addr)
        url2 = url_of(d2, addr)
        assert_error(put(url2, "node-a", 1, blob), 401, "unauthorized")
        r = put(url2, "node-a", 1, blob, auth("node-a"))
        assert r.status_code == 201, r.text
        assert d2.stop() == 0


def test_http_limits_and_routing_errors(daemons):
    model = small_model(5)
    d = daemons(model, "--expected-nodes", "2", "--max-body-mib", "1", "--max-headers", "20",
                "--max-header-bytes", "4096")
    url = d.url
    rng = np.random.default_rng(13)

    # 413: a Content-Length above --max-body-mib, refused from the head (no body sent)
    raw = Raw("127.0.0.1", d.port)
    raw.send(request_head("PUT", "/nodes/node-a/delta_1.safetensors", [("Content-Length", (1 << 20) + 1)]))
    resp = raw.response()
    assert resp.status == 413 and resp.json()["error"]["code"] == "too_large", resp
    assert raw.closed_by_peer(10)
    raw.close()
    # a delta within the limit is fine
    r = put(url, "node-a", 1, delta_blob("node-a", 0, 1, random_deltas(rng, model)))
    assert r.status_code == 201, r.text

    # 431: too many header fields, and header fields too large
    for headers in ([(f"X-Many-{i}", "v") for i in range(40)], [("X-Huge", "h" * 8000)]):
        raw = Raw("127.0.0.1", d.port)
        raw.send(request_head("GET", "/status", headers))
        resp = raw.response()
        assert resp.status == 431 and resp.json()["error"]["code"] == "headers_too_large", resp
        assert raw.closed_by_peer(10)
        raw.close()
    # within the limits
    raw = Raw("127.0.0.1", d.port)
    raw.send(request_head("GET", "/status", [(f"X-Few-{i}", "v" * 100) for i in range(10)]))
    assert raw.response().status == 200
    raw.close()

    # 405 with Allow
    with session() as s:
        for method, path, allow in (("DELETE", "/status", "GET, HEAD"), ("POST", "/healthz", "GET, HEAD"),
                                    ("PUT", "/global/latest.safetensors", "GET, HEAD"),
                                    ("GET", "/nodes/node-a/deltas", "POST"),
                                    ("POST", "/nodes/node-a/delta_1.safetensors", "PUT"),
                                    ("GET", "/nodes/node-a/delta_1.safetensors", "PUT")):
            r = s.request(method, url + path, timeout=30)
            assert_error(r, 405, "method_not_allowed")
            assert r.headers.get("Allow") == allow, (method, path, r.headers)
        # 404
        for path in ("/nope", "/global/other.safetensors", "/nodes/node-a/delta_x.bin",
                     "/nodes/../delta_1.safetensors", "/nodes/a%2Fb/deltas"):
            r = s.get(url + path, timeout=30)
            assert_error(r, 404, "not_found")
        # /nodes/<id> is the node's verdicts (test_node_verdicts.py): a node never seen is 404 unknown_node
        assert_error(s.get(url + "/nodes/never-seen", timeout=30), 404, "unknown_node")
    # 411 on a POST without a length
    raw = Raw("127.0.0.1", d.port)
    raw.send(request_head("POST", "/nodes/node-a/deltas"))
    resp = raw.response()
    assert resp.status == 411 and resp.json()["error"]["code"] == "length_required", resp
    raw.close()
    st = status(url)
    assert [e["node_id"] for e in st["round"]["received"]] == ["node-a"], st["round"]
    assert d.stop() == 0


def test_no_global_yet_is_503(daemons, tmp_path):
    """--hub file://<empty dir> and no --init-model: dilocod waits for a global; uploads and global
    downloads are 503 no_global."""
    model = small_model(6)
    hub = tmp_path / "emptyhub"
    hub.mkdir()
    d = daemons(model, "--expected-nodes", "1", hub=hub, init=False)
    url = d.url
    st = status(url)
    assert st["outer_step"] is None and st["state"] == "waiting_for_global", st
    blob = delta_blob("node-a", 0, 1, random_deltas(np.random.default_rng(1), model))
    assert_error(put(url, "node-a", 1, blob), 503, "no_global")
    assert_error(post(url, "node-a", blob), 503, "no_global")
    assert_error(get(url, "/global/latest.safetensors"), 503, "no_global")
    assert_error(get(url, "/global/step_count.json"), 503, "no_global")
    assert get(url, "/healthz").status_code == 200
    assert incoming(d) == []
    assert d.stop() == 0


# ---- 3. protocol ----------------------------------------------------------------------------------

def test_pipelined_requests_are_answered_in_order(daemons):
    d = daemons(small_model(7), "--expected-nodes", "2")
    raw = Raw("127.0.0.1", d.port)
    raw.send(request_head("GET", "/status") + request_head("GET", "/status?x=1") + request_head("HEAD", "/status")
             + request_head("GET", "/healthz"))
    first = raw.response()
    second = raw.response()
    third = raw.response(head_only=True)
    fourth = raw.response()
    assert [first.status, second.status, third.status, fourth.status] == [200] * 4
    assert first.json()["outer_step"] == 0 and second.json()["outer_step"] == 0, (first, second)
    assert int(third.headers["content-length"]) > 0 and third.body == b""
    assert fourth.json()["status"] == "ok", fourth
    assert raw.buf == b""
    # the connection stays open for more
    raw.send(request_head("GET", "/healthz"))
    assert raw.response().json()["status"] == "ok"
    raw.close()
    assert d.stop() == 0


def test_chunked_upload_and_client_disconnect_mid_upload(daemons):
    model = small_model(8)
    d = daemons(model, "--expected-nodes", "3", "--idle-timeout", "30")
    url = d.url
    rng = np.random.default_rng(14)

    # a client gone halfway through its body: nothing accepted, nothing left in cache/incoming
    blob = delta_blob("node-a", 0, 1, random_deltas(rng, model))
    raw = Raw("127.0.0.1", d.port)
    raw.send(request_head("PUT", "/nodes/node-a/delta_1.safetensors", [("Content-Length", len(blob))]))
    raw.send(blob[:len(blob) // 2])
    wait_status(url, lambda s: s["uploads_in_progress"] == 1, what="the upload in progress")
    raw.close()
    d.wait_log("upload aborted")
    st = wait_status(url, lambda s: s["uploads_in_progress"] == 0, what="the upload dropped")
    assert st["round"]["received"] == [], st["round"]
    assert st["counters"]["accepted"] == 0, st["counters"]
    wait_for(lambda: incoming(d) == [], 10, "an empty cache/incoming")
    # the same delta, whole, is then accepted
    r = put(url, "node-a", 1, blob)
    assert r.status_code == 201 and r.json()["result"] == "accepted", r.text

    # chunked transfer encoding (odd chunk sizes that split the prefix, the header and elements)
    tensors = random_deltas(rng, model)
    blob = delta_blob("node-b", 0, 7, tensors)
    cuts = [0, 3, 11, 50, header_end(blob) - 1, header_end(blob) + 5, header_end(blob) + 1001, len(blob)]
    with session() as s:
        r = s.put(f"{url}/nodes/node-b/delta_7.safetensors", data=iter([blob[a:b] for a, b in zip(cuts, cuts[1:])]),
                  timeout=60)
    assert r.request.headers.get("Transfer-Encoding") == "chunked"
    assert r.status_code == 201, r.text
    assert r.json()["bytes"] == len(blob), r.text
    # chunked, raw, over POST
    blob = delta_blob("node-c", 0, 3, random_deltas(rng, model))
    body = b"".join(b"%x\r\n%s\r\n" % (len(blob[i:i + 777]), blob[i:i + 777]) for i in range(0, len(blob), 777))
    raw = Raw("127.0.0.1", d.port)
    raw.send(request_head("POST", "/nodes/node-c/deltas", [("Transfer-Encoding", "chunked")]) + body + b"0\r\n\r\n")
    resp = raw.response()
    assert resp.status == 201, resp
    raw.close()
    st = wait_status(url, lambda s: s["outer_step"] == 1, what="the round of three")
    assert [(n["node_id"], n["local_step"]) for n in st["last_round"]["nodes"]] == \
        [("node-a", 1), ("node-b", 7), ("node-c", 3)], st["last_round"]
    assert incoming(d) == []
    assert d.stop() == 0


def test_uploads_are_stored_byte_for_byte_across_their_write_units(daemons):
    """Uploads are written in units that end at multiples of 2 MiB of the file, the bytes past a unit
    carried to the next buffer: a 5 MiB delta sent by curl and one sent in odd chunks (a prime size that
    never lines up with a unit) are stored as sent, and the step made from them is torch's."""
    from safetensors.torch import load as st_load_bytes
    g = torch.Generator().manual_seed(21)
    model = {"w": torch.randn(1201, 1117, generator=g), "b": torch.randn(1009, generator=g)}   # 5.1 MiB
    d = daemons(model, "--expected-nodes", "3")
    url = d.url
    rng = np.random.default_rng(21)
    nodes = ("node-a", "node-b", "node-c")
    deltas = {n: random_deltas(rng, model) for n in nodes}
    blobs = {n: delta_blob(n, 0, 4, t) for n, t in deltas.items()}
    path = d.tmp / "delta_a.safetensors"
    path.write_bytes(blobs["node-a"])
    p = subprocess.run(["curl", "-sS", "--noproxy", "*", "-T", str(path), "-o", "/dev/null", "-w", "%{http_code}",
                        f"{url}/nodes/node-a/delta_4.safetensors"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and p.stdout == "201", (p.returncode, p.stdout, p.stderr)
    blob = blobs["node-b"]
    cuts = list(range(0, len(blob), 65521)) + [len(blob)]

    def slow_chunks():
        for a, b in zip(cuts, cuts[1:]):
            yield blob[a:b]
            time.sleep(0.001)          # separate reads on the server's side
    with session() as s:
        r = s.put(f"{url}/nodes/node-b/delta_4.safetensors", data=slow_chunks(), timeout=120)
    assert r.status_code == 201, r.text
    # the round waits for node-c: both stored deltas are in the cache, as sent
    for node in ("node-a", "node-b"):
        stored = d.state_dir / "cache" / "deltas" / "s0" / node / "delta_4.safetensors"
        assert stored.read_bytes() == blobs[node], node
    assert put(url, "node-c", 4, blobs["node-c"]).status_code == 201
    wait_status(url, lambda s: s["outer_step"] == 1, what="the round of three")
    got = st_load_bytes(get(url, "/global/latest.safetensors").content)
    want = Oracle(model).step(deltas)
    assert sorted(got) == sorted(want)
    for k in want:
        assert torch.equal(got[k].view(torch.int32), want[k].view(torch.int32)), k
    assert d.stop() == 0


def test_global_download_etag_range_and_head(daemons):
    model = small_model(9)
    d = daemons(model, "--expected-nodes", "1")
    url = d.url
    full = (d.tmp / "init.safetensors").read_bytes()
    size = len(full)
    assert size > 200
    with session() as s:
        r = s.get(url + "/global/latest.safetensors", timeout=30)
        assert r.status_code == 200 and r.content == full
        etag = r.headers["ETag"]
        assert re.fullmatch(r'(W/)?"[^"]+"', etag), etag
        assert r.headers["Accept-Ranges"] == "bytes" and r.headers["X-Outer-Step"] == "0"
        # 304
        r = s.get(url + "/global/latest.safetensors", headers={"If-None-Match": etag}, timeout=30)
        assert r.status_code == 304 and r.content == b"" and r.headers["ETag"] == etag, r.headers
        r = s.get(url + "/global/latest.safetensors", headers={"If-None-Match": '"other"'}, timeout=30)
        assert r.status_code == 200 and r.content == full
        # 206
        for rng_hdr, start, end in (("bytes=0-99", 0, 99), ("bytes=-10", size - 10, size - 1),
                                    ("bytes=100-", 100, size - 1), (f"bytes=5-{size + 50}", 5, size - 1)):
            r = s.get(url + "/global/latest.safetensors", headers={"Range": rng_hdr}, timeout=30)
            assert r.status_code == 206, (rng_hdr, r.status_code)
            assert r.headers["Content-Range"] == f"bytes {start}-{end}/{size}", (rng_hdr, r.headers)
            assert r.content == full[start:end + 1], rng_hdr
            assert int(r.headers["Content-Length"]) == end + 1 - start
        # 416
        for rng_hdr in (f"bytes={size}-", f"bytes={size + 10}-{size + 20}"):
            r = s.get(url + "/global/latest.safetensors", headers={"Range": rng_hdr}, timeout=30)
            assert r.status_code == 416, (rng_hdr, r.status_code)
            assert r.headers["Content-Range"] == f"bytes */{size}", r.headers
            assert err_code(r) == "range_not_satisfiable"
    # HEAD: the headers of the GET, no body (the next pipelined response follows at once)
    raw = Raw("127.0.0.1", d.port)
    raw.send(request_head("HEAD", "/global/latest.safetensors") + request_head("GET", "/healthz"))
    head = raw.response(head_only=True)
    assert head.status == 200 and int(head.headers["content-length"]) == size, head
    assert head.headers["etag"] == etag and head.headers["x-outer-step"] == "0", head
    nxt = raw.response()
    assert nxt.status == 200 and nxt.json()["status"] == "ok", nxt
    raw.close()
    # after a round the ETag changes and the old one no longer matches
    r = put(url, "node-a", 1, delta_blob("node-a", 0, 1, random_deltas(np.random.default_rng(2), model)))
    assert r.status_code == 201, r.text
    wait_status(url, lambda s: s["outer_step"] == 1)
    r = get(url, "/global/latest.safetensors", headers={"If-None-Match": etag})
    assert r.status_code == 200 and r.headers["ETag"] != etag and r.headers["X-Outer-Step"] == "1"
    assert d.stop() == 0


def test_slowloris_connections_are_closed_while_others_are_served(daemons):
    """Connections that send their request head one byte per second are answered 408 and closed
    within --header-timeout (1 s); a normal client keeps getting /status answers meanwhile."""
    d = daemons(small_model(10), "--expected-nodes", "2", "--header-timeout", "1")
    port, url = d.port, d.url
    head = request_head("GET", "/status", [("User-Agent", "slowloris"), ("Accept", "*/*")])
    n_slow = 6
    results = [None] * n_slow
    started = threading.Barrier(n_slow + 1)

    def slow(i):
        sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        got = b""
        started.wait()
        t0 = time.monotonic()
        sent = 0
        closed_at = None
        try:
            while sent < len(head) and closed_at is None and time.monotonic() - t0 < 6:
                try:
                    sock.sendall(head[sent:sent + 1])
                    sent += 1
                except (BrokenPipeError, ConnectionResetError):
                    closed_at = time.monotonic()
                    break
                deadline = time.monotonic() + 1.0
                while closed_at is None:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    if select.select([sock], [], [], left)[0]:
                        try:
                            chunk = sock.recv(4096)
                        except ConnectionResetError:
                            chunk = b""
                        if not chunk:
                            closed_at = time.monotonic()
                        got += chunk
        finally:
            sock.close()
        results[i] = (sent, None if closed_at is None else closed_at - t0, got)

    threads = [threading.Thread(target=slow, args=(i,)) for i in range(n_slow)]
    for t in threads:
        t.start()
    started.wait()
    answered = 0
    t_end = time.monotonic() + 3.5
    with session() as s:
        while time.monotonic() < t_end:
            r = s.get(url + "/status", timeout=5)
            assert r.status_code == 200 and r.json()["outer_step"] == 0
            answered += 1
            time.sleep(0.05)
    for t in threads:
        t.join(timeout=60)
    assert answered >= 10, answered
    for sent, after, got in results:
        assert after is not None, f"a slowloris connection was not closed (sent {sent} of {len(head)} bytes)"
        assert after < 1 + 2.0, f"closed {after:.2f}s after its first byte (--header-timeout 1)"
        assert sent < len(head), sent
        assert got.startswith(b"HTTP/1.1 408 "), got
        assert b'"request_timeout"' in got, got
    text = get(url, "/metrics").text
    m = re.search(r"^dilocod_http_timeouts_total (\d+)$", text, re.M)
    assert m and int(m.group(1)) >= n_slow, text
    assert d.stop() == 0


def test_64_concurrent_uploads_none_lost(daemons):
    model = small_model(11)
    n = 64
    nodes = [f"node-{i:02d}" for i in range(n)]
    d = daemons(model, "--expected-nodes", str(n), "--threads", "2")
    url = d.url
    rng = np.random.default_rng(15)
    deltas = {node: random_deltas(rng, model) for node in nodes}
    blobs = {node: delta_blob(node, 0, 3 + i, deltas[node]) for i, node in enumerate(nodes)}
    go = threading.Barrier(n)

    def upload(i, node):
        go.wait()
        if i % 2:
            return post(url, node, blobs[node])
        return put(url, node, 3 + i, blobs[node])

    with concurrent.futures.ThreadPoolExecutor(n) as ex:
        resps = list(ex.map(upload, range(n), nodes, timeout=120))
    for node, r in zip(nodes, resps):
        assert r.status_code == 201, (node, r.status_code, r.text)
        assert r.json()["node_id"] == node and r.json()["result"] == "accepted", r.text
    st = wait_status(url, lambda s: s["outer_step"] == 1, what="the round of 64")
    assert [x["node_id"] for x in st["last_round"]["nodes"]] == nodes, st["last_round"]
    assert st["counters"]["accepted"] == n, st["counters"]
    want = Oracle(model).step(deltas)
    assert_state_close(torch_load_bytes(get(url, "/global/latest.safetensors").content), want)
    assert incoming(d) == []
    assert d.stop() == 0


def test_sigterm_during_uploads_keeps_nothing_partial(daemons):
    """Slow uploads in progress (each past its first 1 MiB write) when SIGTERM arrives: the process
    exits 0, the uploads are dropped, and after a restart the round has received nothing."""
    g = torch.Generator().manual_seed(12)
    model = {"big": torch.randn(1024, 1024, generator=g), "bias": torch.randn(64, generator=g)}
    d = daemons(model, "--expected-nodes", "4")
    url, port = d.url, d.port
    rng = np.random.default_rng(16)
    conns = []
    for i in range(3):
        node = f"node-{i}"
        blob = delta_blob(node, 0, 1, random_deltas(rng, model))
        raw = Raw("127.0.0.1", port)
        raw.send(request_head("PUT", f"/nodes/{node}/delta_1.safetensors", [("Content-Length", len(blob))]))
        raw.send(blob[:(5 * len(blob)) // 8])
        conns.append(raw)
    wait_status(url, lambda s: s["uploads_in_progress"] == 3, what="three uploads in progress")

    def written():
        files = incoming(d)
        sizes = [(d.state_dir / "cache" / "incoming" / f).stat().st_size for f in files]
        return len(files) == 3 and all(sz >= 1 << 20 for sz in sizes) and sizes
    wait_for(written, 30, "the partial uploads written to cache/incoming")
    # a trickle keeps them alive, then SIGTERM
    for raw in conns:
        raw.send(b"\0" * 64)
    d.proc.send_signal(signal.SIGTERM)
    assert d.proc.wait(timeout=30) == 0, d.log_text()[-3000:]
    d.proc = None
    for raw in conns:
        assert raw.closed_by_peer(10)
        raw.close()
    assert incoming(d) == [], incoming(d)
    assert list((d.state_dir / "cache" / "deltas").rglob("*.safetensors")) == []
    d.start()
    wait_healthy(d)
    st = status(d.url)
    assert st["outer_step"] == 0 and st["round"]["received"] == [], st
    assert st["uploads_in_progress"] == 0
    assert incoming(d) == []
    # and the restarted daemon takes a whole upload
    r = put(d.url, "node-0", 2, delta_blob("node-0", 0, 2, random_deltas(rng, model)))
    assert r.status_code == 201, r.text
    assert d.stop() == 0


# ---- 4. memory ------------------------------------------------------------------------------------

def write_f32_safetensors(path, names, shape, metadata=None, block=None):
    """A safetensors file of F32 tensors written block by block (block=None: zeros, sparse)."""
    nbytes = int(np.prod(shape)) * 4
    header = {"__metadata__": metadata} if metadata else {}
    for i, name in enumerate(names):
        header[name] = {"dtype": "F32", "shape": list(shape), "data_offsets": [i * nbytes, (i + 1) * nbytes]}
    hj = json.dumps(header, separators=(",", ":")).encode()
    hj += b" " * ((-len(hj)) % 8)
    total = 8 + len(hj) + nbytes * len(names)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(hj)) + hj)
        if block is None:
            f.truncate(total)
        else:
            data = block.astype(np.float32).tobytes()
            assert nbytes % len(data) == 0
            for _ in range(len(names) * nbytes // len(data)):
                f.write(data)
    assert os.path.getsize(path) == total
    return total


def test_1gib_upload_keeps_memory_bounded(daemons, tmp_path):
    """A 1 GiB delta streamed from disk (curl -T) grows the server's peak RSS by less than 64 MiB."""
    names, shape = ["t0", "t1", "t2", "t3"], (8192, 8192)      # 4 x 256 MiB of F32
    base = tmp_path / "big"
    base.mkdir()
    delta_path = tmp_path / "delta_big.safetensors"
    try:
        write_f32_safetensors(base / "init.safetensors", names, shape)
        block = (np.random.default_rng(17).standard_normal(1 << 18) * 1e-3).astype(np.float32)   # 1 MiB
        size = write_f32_safetensors(delta_path, names, shape, delta_metadata("node-a", 0, 1), block)
        assert size > 1 << 30
        d = daemons(None, "--expected-nodes", "2", name="big")
        url = d.url
        pid = d.proc.pid
        # the peak so far (bootstrap) is not the upload's: reset VmHWM to the current RSS
        Path(f"/proc/{pid}/clear_refs").write_text("5")
        rss_before = vm_kib(pid, "VmRSS")
        hwm_before = vm_kib(pid, "VmHWM")
        out = tmp_path / "resp.json"
        p = subprocess.run(["curl", "-sS", "--noproxy", "*", "-T", str(delta_path), "-o", str(out),
                            "-w", "%{http_code}", f"{url}/nodes/node-a/delta_1.safetensors"],
                           capture_output=True, text=True, timeout=300)
        assert p.returncode == 0 and p.stdout == "201", (p.returncode, p.stdout, p.stderr, out.read_text())
        resp = json.loads(out.read_text())
        assert resp["bytes"] == size and resp["result"] == "accepted", resp
        hwm_after = vm_kib(pid, "VmHWM")
        growth_mib = (hwm_after - min(hwm_before, rss_before)) / 1024
        print(f"\n1 GiB upload: VmRSS before {rss_before / 1024:.1f} MiB, VmHWM before {hwm_before / 1024:.1f} MiB,"
              f" VmHWM after {hwm_after / 1024:.1f} MiB, growth {growth_mib:.1f} MiB")
        assert growth_mib < 64, f"peak RSS grew by {growth_mib:.1f} MiB during a 1 GiB upload"
        st = status(url)
        assert [(e["node_id"], e["bytes"]) for e in st["round"]["received"]] == [("node-a", size)], st["round"]
        assert incoming(d) == []
        assert d.stop() == 0
    finally:
        delta_path.unlink(missing_ok=True)
        shutil.rmtree(base, ignore_errors=True)


# ---- 5. /metrics, /status, /rounds --------------------------------------------------------------

PROM_LINE = re.compile(
    r'^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)'
    r'(?:\{(?P<labels>[a-zA-Z_][a-zA-Z0-9_]*="(?:[^"\\\n]|\\.)*"(?:,[a-zA-Z_][a-zA-Z0-9_]*="(?:[^"\\\n]|\\.)*")*,?)\})?'
    r' (?P<value>[-+]?(?:[0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?|Inf|NaN))(?: -?[0-9]+)?$')


def parse_prometheus(text):
    """{(name, frozenset(labels)): value}; asserts the text format line by line."""
    assert text.endswith("\n"), text[-100:]
    samples, types = {}, {}
    for line in text.splitlines():
        if line.startswith("#"):
            m = re.match(r"^# (HELP|TYPE) ([a-zA-Z_:][a-zA-Z0-9_:]*) (.+)$", line)
            assert m, line
            if m.group(1) == "TYPE":
                assert m.group(3) in ("counter", "gauge", "histogram", "summary", "untyped"), line
                assert m.group(2) not in types, f"TYPE twice: {line}"
                types[m.group(2)] = m.group(3)
            continue
        assert line.strip(), "empty line in the exposition"
        m = PROM_LINE.match(line)
        assert m, f"not a Prometheus sample line: {line!r}"
        name = m.group("name")
        assert name.startswith("dilocod_"), line
        family = re.sub(r"_(bucket|sum|count)$", "", name) if name not in types else name
        assert family in types, f"sample before/without its TYPE: {line}"
        labels = frozenset(re.findall(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"', m.group("labels") or ""))
        key = (name, labels)
        assert key not in samples, f"duplicate sample {line}"
        samples[key] = float(m.group("value"))
    return samples, types


def flat(tensors):
    return np.concatenate([np.asarray(tensors[k], np.float64).ravel() for k in sorted(tensors)])


def test_metrics_status_and_rounds_documents(daemons):
    model = small_model(13)
    d = daemons(model, "--expected-nodes", "2", "--lr", "0.5", "--momentum", "0.8")
    url = d.url
    rng = np.random.default_rng(18)

    st = status(url)
    for key in ("version", "uptime_seconds", "algorithm", "outer_step", "state", "round", "last_round", "optimizer",
                "model", "hub"):
        assert key in st, (key, st)
    assert isinstance(st["version"], str) and st["version"] and isinstance(st["uptime_seconds"], int)
    assert st["algorithm"] == "dumb_diloco" and st["outer_step"] == 0 and st["state"] == "collecting", st
    rnd = st["round"]
    assert (rnd["step"], rnd["expected"], rnd["min_nodes"], rnd["deadline"], rnd["received"]) == (0, 2, 1, None, []), rnd
    assert st["last_round"] is None
    assert st["optimizer"] == {"name": "nesterov_sgd", "lr": 0.5, "momentum": 0.8}, st["optimizer"]
    params = sum(int(np.prod(v.shape)) for v in model.values())
    nbytes = sum(v.numel() * v.element_size() for v in model.values())
    assert (st["model"]["tensors"], st["model"]["parameters"], st["model"]["bytes"]) == (len(model), params, nbytes), \
        st["model"]
    assert st["hub"]["kind"] == "none" and "last_publish" in st["hub"] and "errors" in st["hub"], st["hub"]

    # a rejection, then a round of two
    bad = random_deltas(rng, model)
    bad["layer.bias"] = np.zeros(17, np.float32)
    assert_error(put(url, "node-x", 1, delta_blob("node-x", 0, 1, bad)), 422, "shape_mismatch", "layer.bias")
    deltas = {"node-b": random_deltas(rng, model), "node-a": random_deltas(rng, model)}
    r = put(url, "node-b", 4, delta_blob("node-b", 0, 4, deltas["node-b"]))
    assert r.status_code == 201, r.text
    st = status(url)
    (entry,) = st["round"]["received"]
    assert (entry["node_id"], entry["local_step"], entry["bytes"]) == ("node-b", 4, len(r.request.body)), entry
    r = post(url, "node-a", delta_blob("node-a", 0, 9, deltas["node-a"]))
    assert r.status_code == 201, r.text
    st = wait_status(url, lambda s: s["outer_step"] == 1 and s["last_round"] is not None, what="round 0 closed")

    # /rounds: per-node norm and cosine to the mean, checked against numpy
    mean = (flat(deltas["node-a"]) + flat(deltas["node-b"])) / 2
    rounds = get(url, "/rounds").json()["rounds"]
    assert len(rounds) == 1 and rounds[0]["step"] == 0 and rounds[0]["outer_step"] == 1, rounds
    assert [(n["node_id"], n["local_step"]) for n in rounds[0]["nodes"]] == [("node-a", 9), ("node-b", 4)], rounds
    for n in rounds[0]["nodes"]:
        v = flat(deltas[n["node_id"]])
        assert math.isclose(n["norm"], np.linalg.norm(v), rel_tol=1e-4), (n, np.linalg.norm(v))
        cos = float(v @ mean / (np.linalg.norm(v) * np.linalg.norm(mean)))
        assert math.isclose(n["cosine"], cos, rel_tol=1e-4, abs_tol=1e-6), (n, cos)
    assert math.isclose(rounds[0]["mean_norm"], np.linalg.norm(mean), rel_tol=1e-4), rounds[0]
    last = st["last_round"]
    assert [(n["node_id"], n["norm"], n["cosine"]) for n in last["nodes"]] == \
        [(n["node_id"], n["norm"], n["cosine"]) for n in rounds[0]["nodes"]], (last, rounds)
    assert st["round"]["step"] == 1 and st["round"]["received"] == [], st["round"]
    want = Oracle(model, lr=0.5, momentum=0.8).step(deltas)
    assert_state_close(torch_load_bytes(get(url, "/global/latest.safetensors").content), want)

    # /metrics
    r = get(url, "/metrics")
    assert r.status_code == 200 and r.headers["Content-Type"].startswith("text/plain"), r.headers
    samples, types = parse_prometheus(r.text)

    def val(name, **labels):
        key = (name, frozenset(labels.items()))
        assert key in samples, (key, r.text)
        return samples[key]
    assert val("dilocod_outer_step") == 1 and types["dilocod_outer_step"] == "gauge"
    assert val("dilocod_deltas_rejected_total", code="shape_mismatch") == 1
    assert types["dilocod_deltas_rejected_total"] == "counter"
    assert val("dilocod_deltas_accepted_total") == 2 and val("dilocod_rounds_total") == 1
    assert types["dilocod_http_requests_total"] == "counter"
    # exact status codes, as Prometheus users expect
    assert val("dilocod_http_requests_total", route="upload", code="201") == 2
    assert val("dilocod_http_requests_total", route="upload", code="422") == 1
    assert val("dilocod_http_requests_total", route="status", code="200") >= 3
    # one count of rejections everywhere: /status agrees with /metrics
    rejected = sum(v for (name, _), v in samples.items() if name == "dilocod_deltas_rejected_total")
    assert rejected == status(url)["counters"]["rejected"] == 1, (rejected, status(url)["counters"])
    # prometheus_client reads it, and registers every family without a duplicate
    from prometheus_client.parser import text_string_to_metric_families
    from prometheus_client.registry import CollectorRegistry

    class Replay:
        def __init__(self, text):
            self.families = list(text_string_to_metric_families(text))

        def collect(self):
            return self.families
    names = [f.name for f in Replay(r.text).families]
    assert len(names) == len(set(names)), sorted(n for n in names if names.count(n) > 1)
    CollectorRegistry().register(Replay(r.text))
    assert types["dilocod_aggregation_seconds"] == "histogram"
    buckets = sorted(((float(dict(k[1])["le"]), v) for k, v in samples.items()
                      if k[0] == "dilocod_aggregation_seconds_bucket"), key=lambda x: x[0])
    assert buckets and buckets[-1][0] == math.inf and buckets[-1][1] == 1, buckets
    assert all(a[1] <= b[1] for a, b in zip(buckets, buckets[1:])), buckets
    assert val("dilocod_aggregation_seconds_count") == 1
    assert 0 < val("dilocod_aggregation_seconds_sum") < 60
    assert d.stop() == 0


def test_every_response_is_counted_by_route_and_exact_code(daemons, tmp_path):
    """401 and 403 from auth, the engine's own 431 and 404s: each counted once under its exact code."""
    tokens = tmp_path / "tokens"
    write_token_file(tokens, TOKENS)
    d = daemons(small_model(30), "--expected-nodes", "2", "--token-file", str(tokens), "--max-header-bytes", "1024")
    url = d.url
    blob = delta_blob("node-a", 0, 1, {"layer.weight": np.zeros((32, 16), np.float32)})
    assert put(url, "node-a", 1, blob).status_code == 401
    assert put(url, "node-a", 1, blob, headers=auth("node-b")).status_code == 403
    with session() as s:
        assert s.get(url + "/status", headers={"X-Big": "x" * 2000}, timeout=10).status_code == 431
        assert s.get(url + "/nope", timeout=10).status_code == 404
        assert s.post(url + "/status", timeout=10).status_code == 405
    samples, _ = parse_prometheus(get(url, "/metrics").text)

    def val(**labels):
        return samples.get(("dilocod_http_requests_total", frozenset(labels.items())), 0)
    assert val(route="upload", code="401") == 1
    assert val(route="upload", code="403") == 1
    assert val(route="other", code="431") == 1
    assert val(route="other", code="404") == 1
    assert val(route="status", code="405") == 1
    assert d.stop() == 0


def test_file_hub_status_fields_and_publish_errors(daemons, tmp_path):
    """file:// fills hub.last_poll, last_publish and published_step, and a failed publish counts in
    hub.errors and dilocod_publish_errors_total like hf://'s (one publish completion for both); the step's
    files, made durable after its publish on file://, become durable all the same."""
    hub = tmp_path / "hub"
    hub.mkdir()
    model = small_model(31)
    d = daemons(model, "--expected-nodes", "1", hub=hub)
    url = d.url
    st = wait_status(url, lambda s: s["hub"]["published_step"] == 0 and s["hub"]["last_poll"] is not None,
                     30, "bootstrap published and a poll done")
    assert st["hub"]["kind"] == "file" and st["hub"]["last_publish"] is not None and st["hub"]["errors"] == 0, st
    # global/ becomes a link out of the tree: the next publish is refused and retried
    outside = tmp_path / "outside"
    outside.mkdir()
    (hub / "global").rename(tmp_path / "global.saved")
    (hub / "global").symlink_to(outside)
    rng = np.random.default_rng(31)
    tensors = {k: (rng.standard_normal(tuple(v.shape)) * 0.01).astype(np.float32)
               for k, v in model.items() if v.is_floating_point()}
    assert put(url, "node-a", 1, delta_blob("node-a", 0, 1, tensors)).status_code == 201
    st = wait_status(url, lambda s: s["outer_step"] == 1 and s["hub"]["errors"] >= 1, 30, "a failed publish")
    assert st["hub"]["publish_pending"] is True and st["hub"]["last_error"], st["hub"]
    # a file:// step is made durable after its publish: a publish that keeps failing does not hold it up
    d.wait_durable(1)
    assert d.durable_step() == 1 and not (d.state_dir / "redo.json").exists()
    samples, _ = parse_prometheus(get(url, "/metrics").text)
    assert samples[("dilocod_publish_errors_total", frozenset())] >= 1
    assert list(outside.iterdir()) == []
    (hub / "global").unlink()
    try:
        (tmp_path / "global.saved").rename(hub / "global")
    except OSError as e:
        # the publish's retry may make global/ anew between the two calls: it then publishes there
        assert e.errno in (errno.ENOTEMPTY, errno.EEXIST), e
    st = wait_status(url, lambda s: s["hub"]["published_step"] == 1, 30, "published after the retry")
    assert st["hub"]["publish_pending"] is False, st["hub"]
    assert d.stop() == 0
