"""The `diloco` client against a hostile server (issue 33, items 11 and 12): it trusts no answer's size
and prints no answer's bytes raw.

- `pull` takes a model's body only up to the size its safetensors header declares (8 + N + the data
  its offsets imply) and its Content-Length repeats: a 16-byte model followed by 96 MiB is refused at
  byte 17, before the rest reaches the disk, without a retry, and nothing is left in the output
  directory.
- Every answer kept in memory (/status, an upload's answer, step_count.json, an error) has a cap,
  refused at its Content-Length or at the byte past it, without a retry.
- A server's strings (`status`, `status --json`, `push`'s answer, error messages) and a file's names
  and metadata (`inspect`) reach the terminal in their shown form: control characters (C0 with ESC
  and newline, DEL, C1) as \\u00XX, bytes that are not UTF-8 as \\xXX; a screen clear, an OSC 52
  clipboard write or a fake "step 42" line never pass through.

The server is written here, on raw sockets, so that it can lie: it counts the bytes of each answer
that reached the socket before the client hung up, and samples the output directory while it sends."""
import json
import os
import socket
import subprocess
import threading
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from conftest import run
from dilocod_proc import write_delta

MiB = 1 << 20
EXTRA = 96 * MiB            # what a hostile answer sends past what it should
# Bytes that can be in flight when the client hangs up: the loopback's send and receive buffers (a
# few MiB each at most, net.ipv4.tcp_wmem / tcp_rmem) and curl's.  A client that takes the whole
# answer receives all of EXTRA.
IN_FLIGHT = 24 * MiB
CHUNK = 64 * 1024

# A valid safetensors file of 16 bytes: the length 8, then an empty header padded with spaces.
MODEL16 = (8).to_bytes(8, "little") + b"{}      "


class Writer:
    """One answer's socket: counts what was sent, stops at the first error (the client hung up)."""

    def __init__(self, conn):
        self.conn, self.sent, self.closed = conn, 0, False

    def send(self, data: bytes) -> bool:
        if self.closed:
            return False
        try:
            self.conn.sendall(data)
        except OSError:
            self.closed = True
            return False
        self.sent += len(data)
        return True

    def stream(self, head: bytes, first: bytes, extra: int, watch=None):
        """head + first, then extra zero bytes in chunks while the client takes them; watch() between
        chunks (the output directory's size)."""
        if not self.send(head + first):
            return
        zeros = bytes(CHUNK)
        left = extra
        while left > 0:
            if watch is not None:
                watch()
            n = min(CHUNK, left)
            if not self.send(zeros[:n]):
                return
            left -= n


class HostileServer:
    """HTTP/1.1 on 127.0.0.1, one request per connection (Connection: close), each answered by
    routes[(method, path)](writer, body).  requests lists (method, path) as they came; sent[path]
    adds up the bytes of that path's answers that reached the socket."""

    def __init__(self, routes):
        self.routes = routes
        self.requests, self.sent = [], {}
        self.lock = threading.Lock()
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.threads = []
        self.stopping = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while not self.stopping:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            t = threading.Thread(target=self._serve, args=(conn,), daemon=True)
            self.threads.append(t)
            t.start()

    def _read_request(self, conn):
        data = b""
        while b"\r\n\r\n" not in data:
            part = conn.recv(65536)
            if not part:
                return None
            data += part
        head, rest = data.split(b"\r\n\r\n", 1)
        lines = head.decode("latin-1").split("\r\n")
        method, path, _ = lines[0].split(" ", 2)
        headers = {k.strip().lower(): v.strip() for k, v in (ln.split(":", 1) for ln in lines[1:] if ":" in ln)}
        length = int(headers.get("content-length", "0"))
        if length and headers.get("expect", "").lower() == "100-continue":
            conn.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")
        while len(rest) < length:
            part = conn.recv(65536)
            if not part:
                return None
            rest += part
        return method, path, rest

    def _serve(self, conn):
        conn.settimeout(60)
        w = Writer(conn)
        path = "?"
        try:
            req = self._read_request(conn)
            if req is None:
                return
            method, path, body = req
            with self.lock:
                self.requests.append((method, path))
            route = self.routes.get((method, path))
            if route is None:
                w.send(answer(404, b'{"error":{"code":"not_found","message":"no such path"}}\n'))
            else:
                route(w, body)
        finally:
            with self.lock:
                self.sent[path] = self.sent.get(path, 0) + w.sent
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            conn.close()

    def count(self, method, path):
        with self.lock:
            return sum(1 for r in self.requests if r == (method, path))

    def close(self):
        self.stopping = True
        self.sock.close()
        for t in self.threads:
            t.join(60)


def answer(status, body, content_length=True, headers=()):
    reason = {200: "OK", 201: "Created", 409: "Conflict", 503: "Service Unavailable"}.get(status, "X")
    head = [f"HTTP/1.1 {status} {reason}", "Connection: close", "Content-Type: application/json", *headers]
    if content_length:
        head.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


def model_head(content_length=None):
    """The head of a 200 for /global/latest.safetensors; without content_length the body ends at the close."""
    head = ["HTTP/1.1 200 OK", "Connection: close", "Content-Type: application/octet-stream", 'ETag: "g1"',
            "X-Outer-Step: 1"]
    if content_length is not None:
        head.append(f"Content-Length: {content_length}")
    return ("\r\n".join(head) + "\r\n\r\n").encode()


def step_count(w, _body):
    w.send(answer(200, b'{"outer_step":1}\n'))


class DirWatch:
    """The largest total size of the files in a directory, sampled while an answer is sent."""

    def __init__(self, path: Path):
        self.path, self.max = path, 0

    def __call__(self):
        total = 0
        try:
            with os.scandir(self.path) as it:
                for e in it:
                    try:
                        total += e.stat().st_size if e.is_file() else 0
                    except FileNotFoundError:
                        pass
        except FileNotFoundError:
            return
        self.max = max(self.max, total)


def clean(out: bytes, what):
    """No byte a terminal acts on: no C0 but the client's own newlines, no DEL, valid UTF-8, no C1."""
    bad = sorted({b for b in out if (b < 0x20 and b != 0x0a) or b == 0x7f})
    assert not bad, f"{what}: raw control bytes {[hex(b) for b in bad]} in {out!r}"
    text = out.decode("utf-8")          # raises on a byte that is not UTF-8
    c1 = sorted({hex(ord(c)) for c in text if 0x80 <= ord(c) <= 0x9f})
    assert not c1, f"{what}: raw C1 controls {c1} in {text!r}"
    assert not any(ln.startswith("step 42") for ln in text.splitlines()), f"{what}: a fake line in {text!r}"
    return text


def pull(diloco_bin, srv, out, *extra):
    return run([diloco_bin, "pull", "--server", srv.url, "-o", out, *extra])


def run_bytes(*args):
    """A command's output as bytes: what reaches the terminal, not yet decoded."""
    return subprocess.run([str(a) for a in args], capture_output=True, timeout=600)


def assert_nothing_kept(out: Path):
    left = sorted(p.name for p in out.iterdir()) if out.exists() else []
    assert left == [], left


# ---- item 11: pull stops at the size the model declares ------------------------------------------

def test_pull_stops_at_the_size_the_models_header_declares(tmp_path, diloco_bin):
    """A 16-byte model followed by 96 MiB, without Content-Length (the body ends at the close): refused
    at byte 17, once (the default 5 retries are for the network, not for this), nothing on disk."""
    out = tmp_path / "out"
    watch = DirWatch(out)
    srv = HostileServer({("GET", "/global/latest.safetensors"):
                         lambda w, _b: w.stream(model_head(), MODEL16, EXTRA, watch),
                         ("GET", "/global/step_count.json"): step_count})
    try:
        p = pull(diloco_bin, srv, out)
    finally:
        srv.close()
    sent = srv.sent["/global/latest.safetensors"]
    assert sent < IN_FLIGHT, f"the server sent {sent} bytes of a 16-byte model"
    assert watch.max <= len(MODEL16), f"{watch.max} bytes on disk for a 16-byte model"
    assert p.returncode == 1 and "Sanitizer" not in p.stderr, (p.returncode, p.stderr)
    assert "more than the 16 bytes the model's header declares" in p.stderr, p.stderr
    assert srv.count("GET", "/global/latest.safetensors") == 1, srv.requests
    assert_nothing_kept(out)


def test_pull_refuses_a_content_length_the_models_header_does_not_repeat(tmp_path, diloco_bin):
    """Content-Length says 16 + 96 MiB, the model's header 16: refused when the header is in."""
    out = tmp_path / "out"
    watch = DirWatch(out)
    srv = HostileServer({("GET", "/global/latest.safetensors"):
                         lambda w, _b: w.stream(model_head(len(MODEL16) + EXTRA), MODEL16, EXTRA, watch),
                         ("GET", "/global/step_count.json"): step_count})
    try:
        p = pull(diloco_bin, srv, out)
    finally:
        srv.close()
    sent = srv.sent["/global/latest.safetensors"]
    assert sent < IN_FLIGHT, f"the server sent {sent} bytes of a 16-byte model"
    assert watch.max <= len(MODEL16), f"{watch.max} bytes on disk for a 16-byte model"
    assert p.returncode == 1 and "Sanitizer" not in p.stderr, (p.returncode, p.stderr)
    assert f"declared a body of {len(MODEL16) + EXTRA} bytes (Content-Length)" in p.stderr, p.stderr
    assert "a file of 16" in p.stderr, p.stderr
    assert srv.count("GET", "/global/latest.safetensors") == 1, srv.requests
    assert_nothing_kept(out)


def test_pull_refuses_a_header_length_over_the_formats_cap_at_its_first_8_bytes(tmp_path, diloco_bin):
    """A first 8 bytes giving a 1 TiB header: refused there, not after the 96 MiB that follow."""
    out = tmp_path / "out"
    watch = DirWatch(out)
    srv = HostileServer({("GET", "/global/latest.safetensors"):
                         lambda w, _b: w.stream(model_head(), (1 << 40).to_bytes(8, "little"), EXTRA, watch)})
    try:
        p = pull(diloco_bin, srv, out)
    finally:
        srv.close()
    sent = srv.sent["/global/latest.safetensors"]
    assert sent < IN_FLIGHT, f"the server sent {sent} bytes past a refusable length"
    assert watch.max <= 8, f"{watch.max} bytes on disk"
    assert p.returncode == 1 and "Sanitizer" not in p.stderr, (p.returncode, p.stderr)
    assert "header_too_large" in p.stderr and "not a safetensors file" in p.stderr, p.stderr
    assert srv.count("GET", "/global/latest.safetensors") == 1, srv.requests
    assert_nothing_kept(out)


def test_pull_of_a_sharded_global_stops_each_shard_at_its_declared_size(tmp_path, diloco_bin):
    """No single file, an index naming one shard: the shard followed by 96 MiB is refused the same way,
    and neither the shard nor the index is left in the output directory."""
    src = tmp_path / "shard.safetensors"
    save_file({"w": np.ones(2, dtype=np.float32)}, str(src))
    shard = src.read_bytes()
    index = json.dumps({"metadata": {"total_size": 8},
                        "weight_map": {"w": "latest-00001-of-00001.safetensors"}}).encode()
    out = tmp_path / "out"
    watch = DirWatch(out)
    srv = HostileServer({("GET", "/global/latest.safetensors.index.json"):
                         lambda w, _b: w.send(answer(200, index, headers=['ETag: "i1"', "X-Outer-Step: 1"])),
                         ("GET", "/global/latest-00001-of-00001.safetensors"):
                         lambda w, _b: w.stream(model_head(), shard, EXTRA, watch),
                         ("GET", "/global/step_count.json"): step_count})
    try:
        p = pull(diloco_bin, srv, out)
    finally:
        srv.close()
    sent = srv.sent["/global/latest-00001-of-00001.safetensors"]
    assert sent < IN_FLIGHT, f"the server sent {sent} bytes of a {len(shard)}-byte shard"
    assert watch.max <= len(shard), f"{watch.max} bytes on disk for a {len(shard)}-byte shard"
    assert p.returncode == 1 and "Sanitizer" not in p.stderr, (p.returncode, p.stderr)
    assert f"more than the {len(shard)} bytes the model's header declares" in p.stderr, p.stderr
    assert srv.count("GET", "/global/latest-00001-of-00001.safetensors") == 1, srv.requests
    assert_nothing_kept(out)


def test_pull_of_an_honest_answer_is_taken_whole(tmp_path, diloco_bin):
    """The bounds refuse nothing of a real model: with Content-Length, and ending at the close."""
    src = tmp_path / "model.safetensors"
    save_file({"w": np.arange(4096, dtype=np.float32).reshape(64, 64), "b": np.ones(7, dtype=np.float32)},
              str(src), metadata={"note": "honest"})
    raw = src.read_bytes()
    for with_length in (True, False):
        out = tmp_path / f"out-{with_length}"
        srv = HostileServer({("GET", "/global/latest.safetensors"):
                             lambda w, _b: w.send(model_head(len(raw) if with_length else None) + raw),
                             ("GET", "/global/step_count.json"): step_count})
        try:
            p = pull(diloco_bin, srv, out)
        finally:
            srv.close()
        assert p.returncode == 0, (with_length, p.stderr)
        assert p.stdout.strip() == "step 1 downloaded", p.stdout
        assert (out / "latest.safetensors").read_bytes() == raw


# ---- every answer kept in memory is capped ---------------------------------------------------------

def test_answers_kept_in_memory_are_capped_and_not_asked_again(tmp_path, diloco_bin):
    """/status without an end, step_count.json and an upload's answer declaring 96 MiB: each refused
    once (at its cap, or at its Content-Length before its first byte), with the cap named."""
    def endless(w, _body):
        w.stream(answer(200, b"", content_length=False), b'{"version":"', EXTRA)

    def declared(w, _body):
        w.stream(answer(200, b"", content_length=False, headers=[f"Content-Length: {EXTRA}"]), b"{", EXTRA - 1)

    src = tmp_path / "model.safetensors"
    save_file({"w": np.zeros(4, dtype=np.float32)}, str(src))
    raw = src.read_bytes()
    delta = write_delta(tmp_path / "hub", "w0", 0, 1, {"w": np.full(4, 0.5, dtype=np.float32)})
    srv = HostileServer({("GET", "/status"): endless,
                         ("GET", "/global/latest.safetensors"): lambda w, _b: w.send(model_head(len(raw)) + raw),
                         ("GET", "/global/step_count.json"): declared,
                         ("PUT", "/nodes/w0/delta_1.safetensors"): declared})
    try:
        st = run([diloco_bin, "status", "--server", srv.url])
        pl = pull(diloco_bin, srv, tmp_path / "out")
        ps = run([diloco_bin, "push", "--server", srv.url, delta])
    finally:
        srv.close()
    assert st.returncode == 1 and "is over 16777216 bytes" in st.stderr, (st.returncode, st.stderr)
    assert srv.count("GET", "/status") == 1, srv.requests
    assert srv.sent["/status"] < 16 * MiB + IN_FLIGHT, srv.sent
    assert pl.returncode == 1 and "is over 65536 bytes" in pl.stderr, (pl.returncode, pl.stderr)
    assert srv.count("GET", "/global/step_count.json") == 1, srv.requests
    assert srv.sent["/global/step_count.json"] < IN_FLIGHT, srv.sent
    assert not (tmp_path / "out" / "latest.safetensors").exists()
    assert ps.returncode == 1 and "is over 65536 bytes" in ps.stderr, (ps.returncode, ps.stderr)
    assert srv.count("PUT", "/nodes/w0/delta_1.safetensors") == 1, srv.requests
    assert srv.sent["/nodes/w0/delta_1.safetensors"] < IN_FLIGHT, srv.sent


# ---- item 12: a server's strings in their shown form -----------------------------------------------

ESC_CLEAR = "\x1b[2J\x1b[H"
OSC52 = "\x1b]52;c;ZXZpbA==\x07"           # "evil" to the clipboard
FAKE_LINE = "w0\nstep 42 downloaded"
C1 = "\u009b31m\u0085"                      # CSI and NEL as UTF-8 (C2 9B, C2 85)
INVALID = "@@INVALID@@"                     # replaced by bytes that are not UTF-8 (a raw CSI among them)


def hostile_status():
    node = {"node_id": FAKE_LINE, "local_step": 5, "bytes": 10}
    return {
        "version": ESC_CLEAR + "0.1.0",
        "uptime_seconds": 3, "state": "collecting" + OSC52, "outer_step": 7,
        "optimizer": {"name": "nesterov" + C1, "lr": 0.7, "momentum": 0.9},
        "round": {"step": 7, "expected": 3, "min_nodes": 2, "deadline": "soon\r\rstep 42",
                  "received": [node], "missing": ["w1" + OSC52, "w2\x7f"]},
        "last_round": {"step": 6, "outer_step": 7, "seconds": 1.0, "gbps": 1.0, "reason": "all\x1b[8m",
                       "nodes": [{"node_id": FAKE_LINE, "norm": 1.0, "cosine": 1.0}]},
        "hub": {"kind": "file", "url": "file:///x" + ESC_CLEAR, "published_step": 7,
                "last_error": "disk " + C1 + INVALID},
    }


def status_bytes(doc, invalid=True):
    raw = json.dumps(doc, ensure_ascii=False).encode()     # C0 as \\u00XX (the JSON way), C1 and DEL raw
    return raw.replace(INVALID.encode(), b"\xff\x9b\xc3" if invalid else b"")


def shown_forms(text, json_text=False):
    """The escaped forms of hostile_status()'s strings in text (JSON writes newline and CR as \\n, \\r)."""
    lf, cr = ("\\n", "\\r") if json_text else ("\\u000a", "\\u000d")
    for form in ("\\u001b[2J\\u001b[H0.1.0", "\\u001b]52;c;ZXZpbA==\\u0007", f"w0{lf}step 42 downloaded",
                 "nesterov\\u009b31m\\u0085", "w2\\u007f", f"soon{cr}{cr}step 42"):
        assert form in text, (form, text)


def test_status_shows_a_servers_strings_escaped(tmp_path, diloco_bin):
    doc = hostile_status()
    srv = HostileServer({("GET", "/status"): lambda w, _b: w.send(answer(200, status_bytes(doc)))})
    try:
        p = run_bytes(diloco_bin, "status", "--server", srv.url)
        pj = run_bytes(diloco_bin, "status", "--server", srv.url, "--json")
    finally:
        srv.close()
    assert p.returncode == 0, p.stderr
    text = clean(p.stdout, "status")
    shown_forms(text)
    assert "disk \\u009b31m\\u0085\\xff\\x9b\\xc3" in text, text
    assert "dilocod \\u001b[2J\\u001b[H0.1.0, up 3 s, collecting\\u001b]52;c;ZXZpbA==\\u0007" in text, text
    assert pj.returncode == 0, pj.stderr
    shown_forms(clean(pj.stdout, "status --json"), json_text=True)


def test_status_json_stays_the_servers_json(tmp_path, diloco_bin):
    """The shown form of valid JSON is valid JSON of the same values: \\u00XX is JSON's own escape."""
    doc = hostile_status()
    srv = HostileServer({("GET", "/status"): lambda w, _b: w.send(answer(200, status_bytes(doc, invalid=False)))})
    try:
        p = run_bytes(diloco_bin, "status", "--server", srv.url, "--json")
    finally:
        srv.close()
    assert p.returncode == 0, p.stderr
    got = json.loads(clean(p.stdout, "status --json"))
    doc["hub"]["last_error"] = doc["hub"]["last_error"].replace(INVALID, "")
    assert got == doc


def test_push_and_errors_show_a_servers_strings_escaped(tmp_path, diloco_bin):
    """An upload's answer (raw bytes), an error's message and tensor (JSON), a retried 503's reason."""
    delta = write_delta(tmp_path / "hub", "w0", 0, 1, {"w": np.full(4, 0.5, dtype=np.float32)})
    accepted = (b'{"result":"accepted","node_id":"w0","note":"\x1b[2J\x1b]52;c;aGk=\x07 \xc2\x9b0m\x7f"}'
                b"\nstep 42 accepted\xff\n")
    refused = json.dumps({"error": {"code": "stale\x1b[2J", "message": "old " + OSC52 + C1,
                                    "tensor": FAKE_LINE}}, ensure_ascii=False).encode() + b"\n"
    busy = json.dumps({"error": {"code": "busy", "message": "wait\n" + "step 42" + ESC_CLEAR}}).encode()
    srv = HostileServer({("PUT", "/nodes/w0/delta_1.safetensors"): lambda w, _b: w.send(answer(201, accepted)),
                         ("PUT", "/nodes/w0/delta_2.safetensors"): lambda w, _b: w.send(answer(409, refused)),
                         ("GET", "/global/latest.safetensors"): lambda w, _b: w.send(answer(503, busy))})
    delta2 = write_delta(tmp_path / "hub", "w0", 0, 2, {"w": np.full(4, 0.5, dtype=np.float32)})
    try:
        ok = run_bytes(diloco_bin, "push", "--server", srv.url, delta)
        no = run_bytes(diloco_bin, "push", "--server", srv.url, delta2)
        pl = run_bytes(diloco_bin, "pull", "--server", srv.url, "-o", tmp_path / "out", "--retries", "1")
    finally:
        srv.close()
    assert ok.returncode == 0, ok.stderr
    out = clean(ok.stdout, "push stdout")
    assert out.count("\n") == 1, out
    assert "\\u001b[2J\\u001b]52;c;aGk=\\u0007 \\u009b0m\\u007f\"}\\u000astep 42 accepted\\xff" in out, out
    clean(ok.stderr, "push stderr")
    assert no.returncode == 1, no.stderr
    clean(no.stdout, "refused push stdout")
    err = clean(no.stderr, "refused push stderr")
    assert ("HTTP 409 stale\\u001b[2J: old \\u001b]52;c;ZXZpbA==\\u0007\\u009b31m\\u0085 "
            "(tensor \"w0\\u000astep 42 downloaded\")") in err, err
    assert pl.returncode == 4, pl.stderr
    err = clean(pl.stderr, "pull stderr")
    assert err.count("HTTP 503 busy: wait\\u000astep 42\\u001b[2J\\u001b[H") == 2, err


def test_inspect_shows_a_files_c1_escaped(tmp_path, diloco_bin):
    """A file's metadata and tensor names: C1 (valid UTF-8, so the file is valid) shown escaped too."""
    path = tmp_path / "m.safetensors"
    save_file({"w\u009b2J": np.zeros(2, dtype=np.float32)}, str(path),
              metadata={"note\u0085": "x\u009b31m" + OSC52})
    p = run_bytes(diloco_bin, "inspect", path)
    pj = run_bytes(diloco_bin, "inspect", "--json", path)
    assert p.returncode == 0, p.stderr
    text = clean(p.stdout, "inspect")
    assert "note\\u0085 = x\\u009b31m\\u001b]52;c;ZXZpbA==\\u0007" in text, text
    assert "w\\u009b2J" in text, text
    assert pj.returncode == 0, pj.stderr
    got = json.loads(clean(pj.stdout, "inspect --json"))
    assert got["metadata"] == {"note\u0085": "x\u009b31m" + OSC52}, got["metadata"]
    assert got["tensors"][0]["name"] == "w\u009b2J", got["tensors"]
