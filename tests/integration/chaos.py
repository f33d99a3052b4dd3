#!/usr/bin/env python3
"""A chaos client for dilocod's HTTP API: for a bounded time, on many concurrent raw sockets, it mixes at
random (seeded) every misbehaviour we could think of, and checks what it does read back.

    python3 tests/integration/chaos.py --url http://127.0.0.1:8470 --seconds 60 --seed 1 \
            --ghost ghost:TOKEN --victims w0,w1 [--threads 16] [--stats out.json]

or, from a test, ``Chaos(url, seconds=60, seed=1, ghost=("ghost", token), victims=["w0", "w1"]).run()``.

Misbehaviours (one action = one or a few sockets, each bounded in time):
  pipeline          dozens of pipelined requests (GET global, GET /, /metrics, /status, /rounds, HEAD, 304,
                    404, 405, step file) on a socket with a tiny receive buffer; then never read and close,
                    never read and reset, read part and reset, half-close and read, or read everything and
                    check every response in order
  half_close        shutdown(SHUT_WR) in the middle of a request head or an upload body, then read to EOF
  reset_download    SO_LINGER 0 close after reading 0..N bytes of the global (or of a range of it)
  close_after_req   a request for the global, then close (or reset) at once without reading
  slow_reader       tiny SO_RCVBUF, reads 1 byte every 0.2-1 s, then resets or drains and checks
  slow_writer       a request head written 1 byte per 100 ms (may outlive the header timeout: 408)
  bogus_range       bogus, overlapping, multiple, huge, negative, malformed Range headers; a 206 must carry
                    the right Content-Range and exactly those bytes of the global with that ETag
  huge_head         32-300 KiB heads (one huge header, thousands of headers, a huge URI)
  malformed_head    garbage request lines, NULs, bad versions, conflicting/negative/huge Content-Length,
                    Content-Length with chunked, LF-only lines, obs-fold, header without colon
  bad_chunked       uploads with invalid chunked framing (bad size, negative, huge, missing CRLF, truncated)
  expect_nothing    Expect: 100-continue, then no body at all (wait, close, reset, or leave it open)
  foreign_upload    uploads for the victims' node ids with the ghost's, a wrong, a malformed or no token
  wrong_step        the ghost's uploads with a stale or future base_outer_step, path/metadata mismatch,
                    invalid node ids and steps in the path, POST with a bad body
  truncated_upload  a valid-looking upload (right node, token, step, shapes) that stops half way: close,
                    reset, half-close, or silence until the idle timeout
  corrupt_upload    uploads with corrupt safetensors headers (bad length, bad JSON, overlapping offsets, wrong
                    dtype/shape/keys, a gigantic declared header) and a complete body with a NaN in it
  slow_body         a valid-looking upload whose body trickles 1 byte per 100 ms, then a reset
  silent_flood      20-250 connections opened and left silent for 1-6 s, then closed or reset
  fetch_global      an ordinary GET (sometimes If-None-Match): keeps the ETag -> bytes cache fresh

The ghost node has a real token but must never get a delta accepted: it only ever sends uploads that are
incomplete, corrupt, non-finite, for another node or for another step.  So the rounds of the normal workers
are not affected unless dilocod has a bug.  What the client checks (a "violation" when it fails): no 5xx
answer, no 2xx answer to any ghost/foreign/corrupt upload, every response read in full is well formed,
pipelined answers come in order with the expected statuses, a 200/206 of the global carries exactly the
bytes of the global with its ETag, a 416 names the size.  Connection errors (resets, timeouts, EPIPE) are
counted, never violations: they are what the misbehaviour provokes."""
import argparse
import collections
import json
import random
import signal
import socket
import struct
import sys
import threading
import time
from array import array
from urllib.parse import urlparse

FLOAT_DTYPES = {"F32", "F16", "BF16", "F64", "F8_E4M3", "F8_E5M2"}
COMPLEX_DTYPES = {"C64"}
NET_ERRORS = (OSError, EOFError, socket.timeout)
HUGE_FUTURE = 1_000_000_000


class ProtocolError(Exception):
    pass


class Resp:
    __slots__ = ("status", "reason", "headers", "body", "version")

    def __init__(self, version, status, reason, headers, body):
        self.version, self.status, self.reason, self.headers, self.body = version, status, reason, headers, body

    def __repr__(self):
        return f"<{self.status} {self.reason} {dict(self.headers)} {self.body[:200]!r}>"


def request(method, path, headers=(), body=b"", host="dilocod", version="HTTP/1.1") -> bytes:
    lines = [f"{method} {path} {version}", f"Host: {host}", *[f"{k}: {v}" for k, v in headers]]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


class Conn:
    """One raw client socket: exact bytes out, responses parsed by hand (Content-Length or chunked)."""

    def __init__(self, addr, rcvbuf=None, sndbuf=None, timeout=5.0):
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        if rcvbuf:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        if sndbuf:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, sndbuf)
        self.sock.settimeout(timeout)
        self.sock.connect(addr)
        self.buf = b""
        self.eof = False
        self.received = 0

    # -- sending
    def send(self, data: bytes, deadline=None) -> bool:
        """Sends what the peer takes before the deadline; False when it hung up or stopped taking."""
        view = memoryview(data)
        while view:
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self.sock.settimeout(min(left, 5.0))
            try:
                n = self.sock.send(view[:65536])
            except (BrokenPipeError, ConnectionResetError, socket.timeout, OSError):
                return False
            view = view[n:]
        return True

    def send_slowly(self, data: bytes, per_byte: float, deadline: float) -> bool:
        for i in range(len(data)):
            if time.monotonic() > deadline:
                return False
            if not self.send(data[i:i + 1]):
                return False
            time.sleep(per_byte)
        return True

    # -- ending
    def reset(self):
        try:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        except OSError:
            pass
        self.sock.close()

    def close(self):
        self.sock.close()

    def half_close(self):
        try:
            self.sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass

    # -- receiving
    def _fill(self, deadline, maxbytes=1 << 16):
        left = deadline - time.monotonic()
        if left <= 0:
            raise socket.timeout("deadline")
        self.sock.settimeout(left)
        chunk = self.sock.recv(maxbytes)
        if not chunk:
            self.eof = True
            raise EOFError("closed by the server")
        self.received += len(chunk)
        self.buf += chunk

    def read_exact(self, n, deadline):
        while len(self.buf) < n:
            self._fill(deadline)
        out, self.buf = self.buf[:n], self.buf[n:]
        return out

    def read_line(self, deadline):
        while b"\r\n" not in self.buf:
            if len(self.buf) > 1 << 16:
                raise ProtocolError("line over 64 KiB")
            self._fill(deadline)
        line, self.buf = self.buf.split(b"\r\n", 1)
        return line

    def response(self, deadline, method="GET") -> Resp:
        """One whole response; ProtocolError when what arrives is not HTTP/1.x framing."""
        while b"\r\n\r\n" not in self.buf:
            if len(self.buf) > 1 << 16:
                raise ProtocolError(f"response head over 64 KiB: {self.buf[:200]!r}")
            self._fill(deadline)
        head, self.buf = self.buf.split(b"\r\n\r\n", 1)
        lines = head.decode("latin-1").split("\r\n")
        parts = lines[0].split(" ", 2)
        if len(parts) < 2 or parts[0] not in ("HTTP/1.1", "HTTP/1.0") or not parts[1].isdigit() \
                or len(parts[1]) != 3:
            raise ProtocolError(f"bad status line {lines[0]!r}")
        status = int(parts[1])
        headers = {}
        for line in lines[1:]:
            if ":" not in line:
                raise ProtocolError(f"bad header line {line!r}")
            k, v = line.split(":", 1)
            k = k.strip().lower()
            if k in headers and k in ("content-length", "transfer-encoding", "content-range", "etag"):
                raise ProtocolError(f"duplicate {k} header")
            headers[k] = v.strip()
        if method == "HEAD" or status in (204, 304) or 100 <= status < 200:
            body = b""
        elif "chunked" in headers.get("transfer-encoding", "").lower():
            body = b""
            while True:
                size_line = self.read_line(deadline).split(b";")[0].strip()
                try:
                    size = int(size_line, 16)
                except ValueError:
                    raise ProtocolError(f"bad chunk size {size_line!r}")
                if size == 0:
                    while self.read_line(deadline):
                        pass
                    break
                body += self.read_exact(size, deadline)
                if self.read_exact(2, deadline) != b"\r\n":
                    raise ProtocolError("chunk not followed by CRLF")
        elif "content-length" in headers:
            cl = headers["content-length"]
            if not cl.isdigit():
                raise ProtocolError(f"bad Content-Length {cl!r}")
            body = self.read_exact(int(cl), deadline)
        else:
            # a body delimited by the close: only acceptable on a response that closes
            body = self.drain(deadline)
        return Resp(parts[0], status, parts[2] if len(parts) > 2 else "", headers, body)

    def final_response(self, deadline, method="GET") -> Resp:
        """The final response, skipping 1xx interim responses."""
        while True:
            r = self.response(deadline, method)
            if r.status >= 200 or r.status == 101:
                return r

    def drain(self, deadline, limit=1 << 26) -> bytes:
        """Everything until EOF (or the deadline, or limit bytes)."""
        out = b""
        try:
            while len(self.buf) < limit:
                self._fill(deadline)
        except (EOFError, ConnectionResetError):
            pass
        out, self.buf = self.buf, b""
        return out

    def wait_closed(self, deadline) -> bool:
        """Reads and discards until the server closes (True) or the deadline passes (False)."""
        try:
            while True:
                self._fill(deadline)
                self.buf = b""
        except (EOFError, ConnectionResetError):
            return True
        except (socket.timeout, OSError):
            return False


# ---- safetensors by hand (so that any byte can be broken) -------------------------------------------

def st_blob(tensors, metadata, order=None) -> bytes:
    """tensors: [(name, dtype, shape, data bytes)] -> a safetensors file (offsets in list order)."""
    hdr, off = {}, 0
    if metadata is not None:
        hdr["__metadata__"] = metadata
    for name, dtype, shape, data in tensors:
        hdr[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [off, off + len(data)]}
        off += len(data)
    js = json.dumps(hdr, separators=(",", ":")).encode()
    js += b" " * (-len(js) % 8)
    return struct.pack("<Q", len(js)) + js + b"".join(t[3] for t in tensors)


def parse_st_header(blob: bytes):
    n = struct.unpack("<Q", blob[:8])[0]
    return n, json.loads(blob[8:8 + n])


def numel(shape):
    n = 1
    for s in shape:
        n *= s
    return n


class Stats:
    def __init__(self):
        self.lock = threading.Lock()
        self.actions = collections.Counter()
        self.statuses = collections.Counter()
        self.net_errors = collections.Counter()
        self.violations = []
        self.violation_count = 0
        self.sockets = 0
        self.bytes_out = 0
        self.bytes_in = 0

    def as_dict(self):
        with self.lock:
            return {"actions": dict(self.actions), "statuses": {str(k): v for k, v in self.statuses.items()},
                    "net_errors": dict(self.net_errors), "violation_count": self.violation_count,
                    "violations": list(self.violations), "sockets": self.sockets,
                    "bytes_in": self.bytes_in}


class Chaos:
    """Run with run() (blocking) or start()/join().  Everything random comes from `seed`."""

    def __init__(self, url, seconds=60.0, seed=1, threads=16, ghost=None, victims=(), max_flood=250,
                 log=None, actions=None):
        u = urlparse(url)
        self.addr = (u.hostname or "127.0.0.1", u.port or 80)
        self.seconds = float(seconds)
        self.seed = seed
        self.nthreads = threads
        self.ghost, self.ghost_token = ghost if ghost else ("ghost", None)
        self.victims = list(victims) or ["w0"]
        self.max_flood = max_flood
        self.flood_budget = threading.Semaphore(max_flood)
        self.log = log
        self.actions = [(a, w) for a, w in self.ACTIONS if actions is None or a in actions]
        unknown = set(actions or ()) - {a for a, _ in self.ACTIONS}
        if unknown or not self.actions:
            raise ValueError(f"unknown or no actions: {sorted(unknown)}")
        self.stats = Stats()
        self.deadline = None
        self.stop_event = threading.Event()
        self.globals = collections.OrderedDict()     # etag -> bytes (the first body seen with that tag)
        self.glock = threading.Lock()
        self.layout = None                           # [(name, delta dtype, shape)] of the floating keys
        self.delta_data = None                       # finite F32/C64 data for that layout
        self.step_cache = (0.0, None)
        self.threads = []
        self.runner = None

    # ---- bookkeeping
    def note(self, action, status=None):
        with self.stats.lock:
            if status is not None:
                self.stats.statuses[status] += 1

    def violation(self, action, msg):
        with self.stats.lock:
            self.stats.violation_count += 1
            if len(self.stats.violations) < 100:
                self.stats.violations.append(f"{time.strftime('%H:%M:%S')} {action}: {msg}")
        if self.log:
            self.log(f"chaos VIOLATION {action}: {msg}")

    def check_status(self, action, r: Resp, allowed=None, upload=False):
        self.note(action, r.status)
        if r.status >= 500:
            self.violation(action, f"server error {r.status}: {r.body[:300]!r}")
        elif upload and 200 <= r.status < 300:
            self.violation(action, f"a delta that must be refused got {r.status}: {r.body[:300]!r}")
        elif allowed is not None and r.status not in allowed:
            self.violation(action, f"status {r.status} not in {sorted(allowed)}: {r.body[:200]!r}")

    def conn(self, **kw) -> Conn:
        c = Conn(self.addr, **kw)
        with self.stats.lock:
            self.stats.sockets += 1
        return c

    def budget(self, rng, lo=1.0, hi=5.0):
        """A deadline for one action: a few seconds, never past the end of the run (+ a grace)."""
        return min(time.monotonic() + rng.uniform(lo, hi), self.deadline + 2.0)

    # ---- what the client knows of the server
    def remember_global(self, action, r: Resp, path_range=None):
        """Checks a 200/206 of the global against the first body seen with its ETag."""
        etag = r.headers.get("etag")
        if etag is None:
            self.violation(action, f"{r.status} of the global without ETag")
            return
        if "x-outer-step" not in r.headers:
            self.violation(action, f"{r.status} of the global without X-Outer-Step")
        with self.glock:
            known = self.globals.get(etag)
        if r.status == 200:
            if known is None:
                try:
                    n, hdr = parse_st_header(r.body)
                    if 8 + n > len(r.body):
                        raise ValueError("short")
                except Exception as e:   # noqa: BLE001 - any parse failure is the finding
                    self.violation(action, f"200 global {etag} is not a safetensors file: {e}")
                    return
                with self.glock:
                    self.globals[etag] = r.body
                    while len(self.globals) > 32:
                        self.globals.popitem(last=False)
                if self.layout is None:
                    self.learn_layout(hdr)
            elif known != r.body:
                self.violation(action, f"200 global {etag}: {len(r.body)} bytes differ from the "
                                       f"{len(known)} first served with that ETag")
        elif r.status == 206:
            cr = r.headers.get("content-range", "")
            try:
                unit, rest = cr.split(" ", 1)
                span, total = rest.split("/")
                a, b = (int(x) for x in span.split("-"))
                total = int(total)
                assert unit == "bytes" and 0 <= a <= b < total
            except Exception:   # noqa: BLE001
                self.violation(action, f"206 with a bad Content-Range {cr!r}")
                return
            if len(r.body) != b - a + 1:
                self.violation(action, f"206 {cr}: body of {len(r.body)} bytes")
            if known is not None:
                if total != len(known) or known[a:b + 1] != r.body:
                    self.violation(action, f"206 {cr} ({etag}): bytes differ from the global with that ETag")
            if path_range is not None and path_range != (a, b):
                self.violation(action, f"range {path_range} answered with {cr}")

    def learn_layout(self, hdr):
        layout = []
        for name, info in sorted(hdr.items()):
            if name == "__metadata__":
                continue
            if info["dtype"] in FLOAT_DTYPES:
                layout.append((name, "F32", tuple(info["shape"])))
            elif info["dtype"] in COMPLEX_DTYPES:
                layout.append((name, "C64", tuple(info["shape"])))
        rng = random.Random(self.seed ^ 0x5EED)
        data = {}
        for name, dt, shape in layout:
            n = numel(shape) * (2 if dt == "C64" else 1)
            data[name] = array("f", (rng.gauss(0.0, 0.01) for _ in range(n))).tobytes()
        self.delta_data = data
        self.layout = layout

    def fetch_global_plain(self):
        c = self.conn(timeout=10)
        try:
            c.send(request("GET", "/global/latest.safetensors"))
            r = c.final_response(time.monotonic() + 20)
            if r.status == 200:
                self.remember_global("fetch_global", r)
            return r
        finally:
            c.close()

    def current_step(self, rng):
        """The open round's step, from /status (cached for a fraction of a second)."""
        t, s = self.step_cache
        if s is not None and time.monotonic() - t < 0.3:
            return s
        c = self.conn(timeout=5)
        try:
            c.send(request("GET", "/status"))
            r = c.final_response(time.monotonic() + 5)
            self.check_status("status", r, {200})
            st = json.loads(r.body)
            s = (st.get("round") or {}).get("step", st.get("outer_step"))
            if s is None:
                s = st.get("outer_step", 0)
            self.step_cache = (time.monotonic(), int(s))
            return int(s)
        finally:
            c.close()

    # ---- deltas
    def delta(self, node, base, local, mutate=None, rng=None) -> bytes:
        tensors = [(name, dt, shape, self.delta_data[name]) for name, dt, shape in self.layout]
        meta = {"algorithm": "dumb_diloco", "base_outer_step": str(base), "local_step": str(local),
                "node_id": node}
        if mutate is not None:
            tensors, meta = mutate(tensors, meta, rng)
        return st_blob(tensors, meta)

    def upload_head(self, node, local, length=None, token="ghost", extra=(), method="PUT", path=None):
        h = []
        if token == "ghost":
            token = self.ghost_token
        if token is not None:
            h.append(("Authorization", f"Bearer {token}"))
        if length is not None:
            h.append(("Content-Length", str(length)))
        h.extend(extra)
        p = path or (f"/nodes/{node}/delta_{local}.safetensors" if method == "PUT" else f"/nodes/{node}/deltas")
        return request(method, p, h)

    def send_upload(self, action, rng, head, body, read=True, method="PUT"):
        """Sends head + body (the server may answer early and close) and checks the answer is a refusal."""
        deadline = self.budget(rng, 3, 6)
        c = self.conn(timeout=5)
        try:
            c.send(head, deadline)
            c.send(body, deadline)
            if read:
                r = c.final_response(deadline, method)
                self.check_status(action, r, upload=True)
        finally:
            c.reset() if rng.random() < 0.3 else c.close()

    # ---- the misbehaviours ---------------------------------------------------------------------
    def a_fetch_global(self, rng):
        c = self.conn(timeout=10)
        try:
            with self.glock:
                tags = list(self.globals)
            if tags and rng.random() < 0.3:
                tag = rng.choice(tags)
                c.send(request("GET", "/global/latest.safetensors", [("If-None-Match", tag)]))
                r = c.final_response(self.budget(rng, 5, 8))
                self.check_status("fetch_global", r, {200, 304})
                if r.status == 200:
                    self.remember_global("fetch_global", r)
                elif r.headers.get("etag") != tag:
                    self.violation("fetch_global", f"304 for If-None-Match {tag} names {r.headers.get('etag')}")
            else:
                c.send(request("GET", "/global/latest.safetensors"))
                r = c.final_response(self.budget(rng, 5, 8))
                self.check_status("fetch_global", r, {200})
                if r.status == 200:
                    self.remember_global("fetch_global", r)
        finally:
            c.close()

    PIPELINE_MENU = [
        ("GET", "/global/latest.safetensors", (), {200}),
        ("HEAD", "/global/latest.safetensors", (), {200}),
        ("GET", "/", (), {200}),
        ("GET", "/metrics", (), {200}),
        ("GET", "/status", (), {200}),
        ("GET", "/healthz", (), {200}),
        ("GET", "/rounds", (), {200}),
        ("GET", "/global/step_count.json", (), {200}),
        ("GET", "/global/latest.safetensors", (("If-None-Match", "*"),), {304}),
        ("GET", "/global/latest.safetensors", (("Range", "bytes=0-7"),), {206}),
        ("GET", "/no/such/thing", (), {404}),
        ("DELETE", "/status", (), {405}),
    ]

    def a_pipeline(self, rng):
        n = rng.randint(12, 80)
        reqs = [rng.choice(self.PIPELINE_MENU) for _ in range(n)]
        blob = b"".join(request(m, p, h) for m, p, h, _ in reqs)
        mode = rng.choice(["never_read_close", "never_read_reset", "read_some_reset", "half_close_read",
                           "read_all", "read_all", "read_all"])
        c = self.conn(rcvbuf=rng.choice([1024, 4096, 16384, None]), timeout=5)
        deadline = self.budget(rng, 4, 8)
        try:
            c.send(blob, min(deadline, time.monotonic() + 2.0))
            if mode == "never_read_close":
                time.sleep(rng.uniform(0, 2))
                c.close()
                return
            if mode == "never_read_reset":
                time.sleep(rng.uniform(0, 2))
                c.reset()
                return
            if mode == "read_some_reset":
                try:
                    c._fill(min(deadline, time.monotonic() + 1), rng.randint(1, 5000))
                except NET_ERRORS:
                    pass
                c.reset()
                return
            if mode == "half_close_read":
                c.half_close()
            for i, (m, p, h, allowed) in enumerate(reqs):
                try:
                    r = c.final_response(deadline, m)
                except (EOFError, ConnectionResetError):
                    if mode == "read_all":
                        self.violation("pipeline", f"closed after {i} of {n} pipelined responses")
                    break
                self.check_status("pipeline", r, allowed)
                if r.status in (200, 206) and p == "/global/latest.safetensors" and m == "GET":
                    self.remember_global("pipeline", r, (0, 7) if r.status == 206 else None)
                if m == "HEAD" and r.status == 200 and "content-length" not in r.headers:
                    self.violation("pipeline", "HEAD of the global without Content-Length")
            c.close()
        except BaseException:
            c.reset()
            raise

    def a_half_close(self, rng):
        c = self.conn(timeout=5)
        deadline = self.budget(rng, 2, 6)
        kind = rng.randrange(3)
        try:
            if kind == 0:                                     # in the middle of a head
                head = request("GET", "/global/latest.safetensors", [("X-Pad", "y" * rng.randint(0, 200))])
                c.send(head[:rng.randint(1, len(head) - 1)])
            elif kind == 1 and self.layout:                   # in the middle of an upload body
                step, local = self.current_step(rng), rng.randint(1, 1 << 30)
                body = self.delta(self.ghost, step, local)
                c.send(self.upload_head(self.ghost, local, len(body)) +
                       body[:rng.randint(0, len(body) - 1)], deadline)
            else:                                             # a complete request, then half-close
                c.send(request("GET", rng.choice(["/status", "/global/latest.safetensors", "/"])))
            c.half_close()
            while True:
                try:
                    r = c.final_response(deadline)
                except (EOFError, ConnectionResetError):
                    break
                self.check_status("half_close", r, upload=(kind == 1))
                if r.status == 200 and r.headers.get("etag"):
                    self.remember_global("half_close", r)
        finally:
            c.close()

    def a_reset_download(self, rng):
        c = self.conn(rcvbuf=rng.choice([2048, 8192, None]), timeout=5)
        try:
            h = [("Range", f"bytes={rng.randint(0, 1000)}-")] if rng.random() < 0.3 else []
            c.send(request("GET", "/global/latest.safetensors", h))
            want = rng.choice([0, 1, 100, 5000, 100000])
            deadline = self.budget(rng, 0.5, 2)
            try:
                while c.received < want:
                    c._fill(deadline)
            except NET_ERRORS:
                pass
        finally:
            c.reset()

    def a_close_after_req(self, rng):
        c = self.conn(rcvbuf=rng.choice([1024, None]), timeout=5)
        reqs = rng.randint(1, 5)
        c.send(request("GET", "/global/latest.safetensors") * reqs)
        if rng.random() < 0.5:
            time.sleep(rng.uniform(0, 0.05))
        c.reset() if rng.random() < 0.5 else c.close()

    def a_slow_reader(self, rng):
        c = self.conn(rcvbuf=rng.choice([256, 1024, 2048]), timeout=5)
        deadline = self.budget(rng, 3, 8)
        per_byte = rng.uniform(0.2, 1.0)
        try:
            n = rng.randint(1, 4)
            c.send(request("GET", rng.choice(["/global/latest.safetensors", "/", "/metrics"])) * n)
            try:
                while time.monotonic() + per_byte < deadline:
                    c._fill(deadline, 1)
                    time.sleep(per_byte)
            except NET_ERRORS:
                pass
        finally:
            c.reset() if rng.random() < 0.7 else c.close()

    def a_slow_writer(self, rng):
        c = self.conn(timeout=5)
        deadline = self.budget(rng, 3, 8)
        try:
            short = rng.random() < 0.5
            head = request("GET", "/healthz", host="h") if short else \
                request("GET", "/global/latest.safetensors", [("User-Agent", "chaos-slow-writer/1.0")])
            if not c.send_slowly(head, 0.1, deadline):
                return
            try:
                r = c.final_response(deadline)
            except (EOFError, ConnectionResetError):
                return
            self.check_status("slow_writer", r, {200, 408})
            if r.status == 200 and r.headers.get("etag"):
                self.remember_global("slow_writer", r)
        finally:
            c.close()

    RANGES_EXACT = [("bytes=0-0", (0, 0)), ("bytes=0-7", (0, 7)), ("bytes=3-10", (3, 10)),
                    ("bytes=-1", None), ("bytes=-16", None), ("bytes=5-", None), ("bytes=100-200", (100, 200))]
    RANGES_ODD = ["bytes=5-2", "bytes=-0", "bytes=0-", "bytes=999999999999-", "bytes=18446744073709551615-",
                  "bytes=18446744073709551616-", "bytes=0-18446744073709551616", "bytes=-18446744073709551615",
                  "bytes=-99999999999999999999999", "bytes=0-99999999999999999999999", "bytes=1-2,3-4",
                  "bytes=0-10,5-15", "bytes=0-5,0-5,0-5", "bytes= 3-7", "bytes=abc", "items=0-1", "bytes=--5",
                  "bytes=4-3", "bytes=-", "bytes=", "bytes=-5-", "bytes=0x10-0x20", "bytes=+1-2", "bytes=1 -2",
                  "bytes=\t1-2", "BYTES=1-2", "bytes=1-2 ", "bytes=1-2;q=1", "bytes=" + "9" * 4000,
                  "bytes=0-" + "9" * 300, "bytes=-" + "0" * 50 + "1", "bytes=1-2, -1", "bytes=0-0,-1"]

    def a_bogus_range(self, rng):
        c = self.conn(timeout=5)
        deadline = self.budget(rng, 3, 6)
        try:
            n = rng.randint(1, 6)
            sent = []
            for _ in range(n):
                if rng.random() < 0.35:
                    rh, want = rng.choice(self.RANGES_EXACT)
                    h = [("Range", rh)]
                else:
                    rh, want = rng.choice(self.RANGES_ODD), None
                    h = [("Range", rh)]
                    if rng.random() < 0.15:
                        h.append(("Range", rng.choice(self.RANGES_ODD)))   # two Range headers
                    if rng.random() < 0.15:
                        h.append(("If-Range", '"bogus"'))
                sent.append((rh, want, len(h) > 1))
                c.send(request("GET", "/global/latest.safetensors", h))
            for rh, want, multi in sent:
                try:
                    r = c.final_response(deadline)
                except (EOFError, ConnectionResetError):
                    break
                allowed = {200, 206, 416, 400, 431}
                if not multi and any(rh == e for e, _ in self.RANGES_EXACT):
                    allowed = {206}
                self.check_status("bogus_range", r, allowed)
                if r.status in (200, 206):
                    self.remember_global("bogus_range", r, want)
                elif r.status == 416:
                    cr = r.headers.get("content-range", "")
                    if not (cr.startswith("bytes */") and cr[8:].isdigit()):
                        self.violation("bogus_range", f"416 for {rh!r} with Content-Range {cr!r}")
                if r.status >= 400 and r.status != 416:
                    break       # the server may close after an error
        finally:
            c.close()

    def a_huge_head(self, rng):
        c = self.conn(timeout=5)
        deadline = self.budget(rng, 2, 5)
        kind = rng.randrange(4)
        if kind == 0:
            head = request("GET", "/status", [("X-Huge", "a" * rng.randint(20000, 300000))])
        elif kind == 1:
            head = request("GET", "/status", [(f"X-H{i}", "v") for i in range(rng.randint(150, 5000))])
        elif kind == 2:
            head = request("GET", "/global/latest.safetensors?" + "q" * rng.randint(20000, 100000))
        else:
            head = self.upload_head(self.ghost, 1, 100, extra=[("Cookie", "c" * rng.randint(17000, 70000))])
        try:
            c.send(head, deadline)
            try:
                r = c.final_response(deadline)
                self.check_status("huge_head", r, {431, 400, 413, 414, 408})
            except (EOFError, ConnectionResetError):
                pass
        finally:
            c.reset() if rng.random() < 0.3 else c.close()

    MALFORMED = [
        b"GET\r\n\r\n", b"GET / HTTP/9.9\r\nHost: x\r\n\r\n", b"\x00\x01\x02\x03garbage\r\n\r\n",
        b"GET /%00 HTTP/1.1\r\nHost: x\r\n\r\n", b"GET / HTTP/1.1\nHost: x\n\n", b"GET / HTTP/1.1\r\nNoColon\r\n\r\n",
        b"GET / HTTP/1.1\r\nHost: x\r\n folded: value\r\n\r\n", b"GET  /  HTTP/1.1\r\n\r\n",
        b"PUT /nodes/ghost/delta_1.safetensors HTTP/1.1\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\nabcdef",
        b"PUT /nodes/ghost/delta_1.safetensors HTTP/1.1\r\nContent-Length: -1\r\n\r\n",
        b"PUT /nodes/ghost/delta_1.safetensors HTTP/1.1\r\nContent-Length: 99999999999999999999999\r\n\r\n",
        b"PUT /nodes/ghost/delta_1.safetensors HTTP/1.1\r\nContent-Length: 10\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
        b"PUT /nodes/ghost/delta_1.safetensors HTTP/1.1\r\nTransfer-Encoding: gzip, chunked\r\n\r\n0\r\n\r\n",
        b"PUT /nodes/ghost/delta_1.safetensors HTTP/1.1\r\nTransfer-Encoding: identity\r\n\r\n",
        b"PUT /nodes/ghost/delta_1.safetensors HTTP/1.1\r\nHost: x\r\n\r\n",
        b"POST /nodes/ghost/deltas HTTP/1.1\r\nContent-Length: 0\r\n\r\n",
        b"GET /global/latest.safetensors HTTP/1.1\r\nContent-Length: 5\r\n\r\nGET /",
        b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\nGET / HTTP/1.1\r\n\r\n",
        b"GET / HTTP/1.0\r\n\r\n", b"get / http/1.1\r\n\r\n", b"\r\n\r\n\r\n\r\n",
        b"GET /nodes/../global/latest.safetensors HTTP/1.1\r\n\r\n", b"GET http://evil/ HTTP/1.1\r\n\r\n",
        b"CONNECT 127.0.0.1:22 HTTP/1.1\r\n\r\n", b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",
        b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + bytes(64),
        b"GET / HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\n\r\n",
        b"GET / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
        b"GET /\xff\xfe HTTP/1.1\r\n\r\n", b"GET / HTTP/1.1\r\nX: \x7f\x00\r\n\r\n",
    ]

    def a_malformed_head(self, rng):
        c = self.conn(timeout=5)
        deadline = self.budget(rng, 1, 4)
        data = rng.choice(self.MALFORMED)
        if rng.random() < 0.2:
            data = bytes(rng.randrange(256) for _ in range(rng.randint(1, 2000)))
        try:
            c.send(data, deadline)
            if rng.random() < 0.3:
                c.half_close()
            for _ in range(3):
                try:
                    r = c.final_response(deadline)
                except (EOFError, ConnectionResetError):
                    break
                except ProtocolError as e:
                    self.violation("malformed_head", f"{data[:60]!r}: {e}")
                    break
                self.check_status("malformed_head", r, upload=b"/nodes/" in data[:40])
        finally:
            c.reset() if rng.random() < 0.3 else c.close()

    def a_bad_chunked(self, rng):
        if not self.layout:
            return
        step = self.current_step(rng)
        body = self.delta(self.ghost, step, 5)
        cut = rng.randint(1, len(body) - 1)
        bad = rng.choice([b"zz\r\n", b"-1\r\n", b"ffffffffffffffffffff\r\n", b"10\r\nshort", b"5\r\nabcdefgh\r\n",
                          b"5;ext=" + b"e" * 5000 + b"\r\nabcde\r\n", b"\r\n", b"0x10\r\n", b" 5\r\nabcde\r\n"])
        pieces = b""
        pos = 0
        while pos < cut:
            n = min(rng.randint(1, 4096), cut - pos)
            pieces += b"%x\r\n" % n + body[pos:pos + n] + b"\r\n"
            pos += n
        ending = rng.choice(["bad", "bad", "stop", "reset"])
        head = self.upload_head(self.ghost, 5, None, extra=[("Transfer-Encoding", "chunked")],
                                method=rng.choice(["PUT", "POST"]))
        deadline = self.budget(rng, 2, 6)
        c = self.conn(timeout=5)
        try:
            c.send(head + pieces + (bad if ending == "bad" else b""), deadline)
            if ending == "reset":
                c.reset()
                return
            if ending == "stop":
                c.half_close()
            try:
                r = c.final_response(deadline, "PUT")
                self.check_status("bad_chunked", r, upload=True)
            except (EOFError, ConnectionResetError):
                pass
            c.close()
        except BaseException:
            c.reset()
            raise

    def a_expect_nothing(self, rng):
        if not self.layout:
            return
        step = self.current_step(rng)
        body = self.delta(self.ghost, step, 9)
        c = self.conn(timeout=5)
        deadline = self.budget(rng, 1, 7)
        try:
            c.send(self.upload_head(self.ghost, 9, len(body), extra=[("Expect", "100-continue")]))
            try:
                r = c.response(deadline, "PUT")
                self.check_status("expect_nothing", r, {100, 408, 400})
                if r.status != 100:
                    return
                what = rng.choice(["wait", "close", "reset", "partial"])
                if what == "partial":
                    c.send(body[:rng.randint(0, len(body) - 1)])
                if what in ("wait", "partial"):
                    c.wait_closed(deadline)
            except (EOFError, ConnectionResetError):
                pass
        finally:
            c.reset() if rng.random() < 0.5 else c.close()

    def a_foreign_upload(self, rng):
        if not self.layout:
            return
        step = self.current_step(rng)
        victim = rng.choice(self.victims + ["nobody", "x" * 64])
        local = rng.randint(1, 1 << 40)
        token = rng.choice(["ghost", None, "wrong-token-" + "z" * rng.randint(0, 40), "", "a" * 5000])
        body = self.delta(victim, step, local)
        extra = []
        if rng.random() < 0.2:
            extra.append(("X-Forwarded-For", "10.0.0.1"))
        head = self.upload_head(victim, local, len(body), token=token, extra=extra)
        if token is not None and rng.random() < 0.2:
            head = head.replace(b"Bearer ", rng.choice([b"Basic ", b"bearer  ", b"Bearer\t", b""]))
        self.send_upload("foreign_upload", rng, head, body)

    def a_wrong_step(self, rng):
        if not self.layout:
            return
        step = self.current_step(rng)
        local = rng.randint(1, 1 << 40)
        kind = rng.randrange(6)
        if kind == 0 and step > 0:
            body = self.delta(self.ghost, rng.randint(0, step - 1), local)
        elif kind == 1:
            body = self.delta(self.ghost, step + HUGE_FUTURE + rng.randint(0, 1000), local)
        elif kind == 2:
            body = self.delta(self.ghost, step, local + 1)                  # metadata != path
        elif kind == 3:
            body = self.delta("someone-else", step, local)                # metadata node != path node
        elif kind == 4:
            path = rng.choice(["/nodes/../delta_1.safetensors", "/nodes/ghost/delta_01.safetensors",
                               "/nodes/ghost/delta_-1.safetensors", "/nodes/ghost/delta_1.bin",
                               "/nodes/ghost/delta_99999999999999999999999.safetensors",
                               "/nodes/gh%2Fost/delta_1.safetensors", "/nodes//delta_1.safetensors",
                               "/nodes/" + "g" * 65 + "/delta_1.safetensors", "/nodes/ghost/delta_1.safetensors/x",
                               "/nodes/ghost/delta_+1.safetensors", "/nodes/ghost/deltas/1"])
            body = self.delta(self.ghost, step, 1)
            self.send_upload("wrong_step", rng, self.upload_head(self.ghost, 1, len(body), path=path), body)
            return
        else:
            body = self.delta(self.ghost, step + HUGE_FUTURE, local)       # POST, step from metadata
            self.send_upload("wrong_step", rng, self.upload_head(self.ghost, local, len(body), method="POST"),
                             body, method="POST")
            return
        self.send_upload("wrong_step", rng, self.upload_head(self.ghost, local, len(body)), body)

    def a_truncated_upload(self, rng):
        if not self.layout:
            return
        step = self.current_step(rng)
        local = rng.randint(1, 1 << 40)
        body = self.delta(self.ghost, step, local)
        cut = rng.choice([rng.randint(1, 8), rng.randint(8, len(body) - 1), len(body) - 1,
                          rng.randint(len(body) // 2, len(body) - 1)])
        chunked = rng.random() < 0.25
        if chunked:
            head = self.upload_head(self.ghost, local, None, extra=[("Transfer-Encoding", "chunked")])
            data = b"%x\r\n" % cut + body[:cut] + b"\r\n"
        else:
            head = self.upload_head(self.ghost, local, len(body))
            data = body[:cut]
        c = self.conn(timeout=5)
        deadline = self.budget(rng, 2, 8)
        ending = rng.choice(["close", "reset", "half_close", "silence"])
        try:
            c.send(head, deadline)
            if rng.random() < 0.3:
                c.send_slowly(data[:20], 0.05, deadline)
                data = data[20:]
            c.send(data, deadline)
            if ending == "close":
                c.close()
                return
            if ending == "reset":
                c.reset()
                return
            if ending == "half_close":
                c.half_close()
            try:
                r = c.final_response(deadline, "PUT")
                self.check_status("truncated_upload", r, upload=True)
            except (EOFError, ConnectionResetError):
                pass
            c.close()
        except BaseException:
            c.reset()
            raise

    @staticmethod
    def _corruptions():
        def bad_len(t, m, rng):
            return t, m      # handled on the bytes below

        def overlap(t, m, rng):
            return t, m

        def wrong_dtype(t, m, rng):
            t = list(t)
            name, dt, shape, data = t[0]
            t[0] = (name, rng.choice(["F64", "I32", "F16", "BOOL", "U8"]), shape, data)
            return t, m

        def wrong_shape(t, m, rng):
            t = list(t)
            name, dt, shape, data = t[-1]
            t[-1] = (name, dt, (len(data) // 4,) if len(shape) != 1 else (1, len(data) // 4), data)
            return t, m

        def missing_key(t, m, rng):
            return t[:-1], m

        def extra_key(t, m, rng):
            return list(t) + [("zz.extra", "F32", (2,), bytes(8))], m

        def nan(t, m, rng):
            t = list(t)
            name, dt, shape, data = t[-1]
            pos = rng.randrange(len(data) // 4) * 4
            val = rng.choice([b"\x00\x00\xc0\x7f", b"\x00\x00\x80\x7f", b"\x00\x00\x80\xff"])
            t[-1] = (name, dt, shape, data[:pos] + val + data[pos + 4:])
            return t, m

        def bad_meta(t, m, rng):
            m = dict(m)
            k = rng.choice(["algorithm", "base_outer_step", "local_step", "node_id"])
            if rng.random() < 0.5:
                del m[k]
            else:
                m[k] = rng.choice(["", "x", "-1", "01", "1e3", "😀", "a" * 100])
            return t, m

        return [bad_len, overlap, wrong_dtype, wrong_shape, missing_key, extra_key, nan, nan, bad_meta]

    def a_corrupt_upload(self, rng):
        if not self.layout:
            return
        step = self.current_step(rng)
        local = rng.randint(1, 1 << 40)
        mut = rng.choice(self._corruptions())
        body = self.delta(self.ghost, step, local, mutate=mut, rng=rng)
        n = struct.unpack("<Q", body[:8])[0]
        if mut.__name__ == "bad_len":
            body = struct.pack("<Q", rng.choice([0, 1, n + 1, n - 1, len(body), 1 << 40, (1 << 64) - 1,
                                                 100_000_001, 16 << 20])) + body[8:]
        elif mut.__name__ == "overlap":
            hdr = json.loads(body[8:8 + n])
            keys = [k for k in hdr if k != "__metadata__"]
            if len(keys) >= 2:
                hdr[keys[1]]["data_offsets"] = [0, hdr[keys[1]]["data_offsets"][1] - hdr[keys[1]]["data_offsets"][0]]
            else:
                hdr[keys[0]]["data_offsets"][0] += 4
            js = json.dumps(hdr, separators=(",", ":")).encode()
            js += b" " * (-len(js) % 8)
            body = struct.pack("<Q", len(js)) + js + body[8 + n:]
        elif rng.random() < 0.15:                      # bytes flipped inside the JSON
            pos = 8 + rng.randrange(n)
            body = body[:pos] + bytes([rng.randrange(256)]) + body[pos + 1:]
        self.send_upload("corrupt_upload", rng, self.upload_head(self.ghost, local, len(body)), body)

    def a_slow_body(self, rng):
        if not self.layout:
            return
        step = self.current_step(rng)
        local = rng.randint(1, 1 << 40)
        body = self.delta(self.ghost, step, local)
        c = self.conn(timeout=5)
        deadline = self.budget(rng, 2, 6)
        try:
            c.send(self.upload_head(self.ghost, local, len(body)))
            c.send_slowly(body[:len(body) - 1], 0.1, deadline)
        finally:
            c.reset()

    def a_silent_flood(self, rng):
        n = rng.randint(20, 250)
        socks = []
        try:
            for _ in range(n):
                if not self.flood_budget.acquire(blocking=False):
                    break
                try:
                    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                    s.setblocking(False)
                    try:
                        s.connect(self.addr)
                    except BlockingIOError:
                        pass
                    socks.append(s)
                except OSError:
                    self.flood_budget.release()
                    break
            with self.stats.lock:
                self.stats.sockets += len(socks)
            end = self.budget(rng, 1, 6)
            while time.monotonic() < end and not self.stop_event.is_set():
                time.sleep(0.1)
        finally:
            for s in socks:
                try:
                    if rng.random() < 0.5:
                        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    s.close()
                except OSError:
                    pass
                self.flood_budget.release()

    ACTIONS = [("fetch_global", 5), ("pipeline", 10), ("half_close", 5), ("reset_download", 6),
               ("close_after_req", 6), ("slow_reader", 4), ("slow_writer", 3), ("bogus_range", 8),
               ("huge_head", 3), ("malformed_head", 6), ("bad_chunked", 4), ("expect_nothing", 3),
               ("foreign_upload", 5), ("wrong_step", 5), ("truncated_upload", 6), ("corrupt_upload", 6),
               ("slow_body", 2), ("silent_flood", 2)]

    # ---- running -----------------------------------------------------------------------------------
    def _worker(self, i):
        rng = random.Random(self.seed * 1_000_003 + i)
        names = [a for a, _ in self.actions]
        weights = [w for _, w in self.actions]
        while time.monotonic() < self.deadline and not self.stop_event.is_set():
            action = rng.choices(names, weights)[0]
            with self.stats.lock:
                self.stats.actions[action] += 1
            try:
                getattr(self, "a_" + action)(rng)
            except ProtocolError as e:
                self.violation(action, f"malformed response: {e}")
            except ConnectionRefusedError as e:
                with self.stats.lock:
                    self.stats.net_errors["refused"] += 1
                time.sleep(0.05)
            except NET_ERRORS as e:
                with self.stats.lock:
                    self.stats.net_errors[type(e).__name__] += 1
            except Exception as e:    # noqa: BLE001 - a bug in the chaos client itself must be seen
                self.violation(action, f"chaos client error {type(e).__name__}: {e}")
                time.sleep(0.1)

    def prepare(self):
        """Learns the model layout from the global (retries for up to 30 s)."""
        end = time.monotonic() + 30
        while self.layout is None:
            try:
                self.fetch_global_plain()
            except NET_ERRORS:
                pass
            if self.layout is None:
                if time.monotonic() > end:
                    raise RuntimeError("chaos: could not fetch the global to learn the model layout")
                time.sleep(0.2)

    def run(self) -> dict:
        self.prepare()
        self.deadline = time.monotonic() + self.seconds
        self.threads = [threading.Thread(target=self._worker, args=(i,), daemon=True, name=f"chaos-{i}")
                        for i in range(self.nthreads)]
        for t in self.threads:
            t.start()
        for t in self.threads:
            t.join()
        return self.stats.as_dict()

    def start(self):
        self.result = None

        def go():
            self.result = self.run()
        self.runner = threading.Thread(target=go, daemon=True, name="chaos")
        self.runner.start()
        return self

    def stop(self):
        self.stop_event.set()

    def join(self, timeout=None) -> dict:
        self.runner.join(timeout)
        return self.stats.as_dict()


def summary(stats: dict) -> str:
    acts = ", ".join(f"{k} {v}" for k, v in sorted(stats["actions"].items()))
    sts = ", ".join(f"{k}x{v}" for k, v in sorted(stats["statuses"].items()))
    nets = ", ".join(f"{k} {v}" for k, v in sorted(stats["net_errors"].items())) or "none"
    return (f"chaos: {sum(stats['actions'].values())} actions on {stats['sockets']} sockets; {acts}\n"
            f"chaos: statuses {sts}\nchaos: connection errors {nets}\n"
            f"chaos: {stats['violation_count']} violations" +
            "".join(f"\n  {v}" for v in stats["violations"][:20]))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", required=True)
    ap.add_argument("--seconds", type=float, default=60)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--threads", type=int, default=16)
    ap.add_argument("--ghost", default="ghost:", help="NODE:TOKEN a real token whose node must never be accepted")
    ap.add_argument("--victims", default="w0", help="node ids of the real workers (uploads for them are forged)")
    ap.add_argument("--max-flood", type=int, default=250)
    ap.add_argument("--stats", help="write the statistics as JSON to this file")
    ap.add_argument("--actions", help="comma-separated subset of the misbehaviours (default: all): " +
                    ",".join(a for a, _ in Chaos.ACTIONS))
    a = ap.parse_args(argv)
    node, _, token = a.ghost.partition(":")
    ch = Chaos(a.url, a.seconds, a.seed, a.threads, (node, token or None), a.victims.split(","), a.max_flood,
               log=lambda m: print(m, file=sys.stderr, flush=True),
               actions=a.actions.split(",") if a.actions else None)
    signal.signal(signal.SIGTERM, lambda *_: ch.stop())      # stop early, still report
    stats = ch.run()
    print(summary(stats), flush=True)
    if a.stats:
        with open(a.stats, "w") as f:
            json.dump(stats, f, indent=1)
    return 1 if stats["violation_count"] else 0


if __name__ == "__main__":
    sys.exit(main())
