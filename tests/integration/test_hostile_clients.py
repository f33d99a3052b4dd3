"""Hostile and clumsy HTTP clients against the real dilocod over real sockets (no fake connections):
each test is one attack from the hardening issue.  After each, the daemon must be alive, a new client
must be served within a couple of seconds, and its open descriptors and RSS must stay within a stated
bound of their baseline.  The same tests run against the ASan/UBSan binaries under
`make SANITIZE=address,undefined check`, where a use-after-free aborts the daemon.

Attacks on the other input sources (the shared directory, the Hub) are in
test_hostile_clients_files.py and test_hostile_clients_hub.py."""
import os
import resource
import shutil
import signal
import socket
import struct
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import hostile
from dilocod_proc import delta_metadata
from hostile import SANITIZED, open_fds, served_quickly
from test_http_api import (Raw, daemons, delta_blob, get, request_head, session, small_model,  # noqa: F401
                           status, wait_for)

FD_SLACK = 16                   # descriptors a quiet daemon may open on its own (log, timers, a pool job)
RSS_SLACK_KIB = (96 if SANITIZED else 48) * 1024


def cpu_seconds(pid) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Baseline(hostile.Baseline):
    def __init__(self, d):
        super().__init__(d, FD_SLACK, RSS_SLACK_KIB)


def big_model(mib=16):
    n = mib * (1 << 20) // 4
    return {"w": torch.arange(n, dtype=torch.float32) / n}


def reset_close(sock):
    """Close with an RST (SO_LINGER 0), as a crashing client or a middlebox would."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


def send_some(sock, data, seconds):
    """Sends as much of data as the peer takes within `seconds` (it may stop reading); returns bytes sent."""
    sock.setblocking(False)
    sent, deadline = 0, time.monotonic() + seconds
    while sent < len(data) and time.monotonic() < deadline:
        try:
            sent += sock.send(data[sent:sent + 65536])
        except BlockingIOError:
            time.sleep(0.01)
        except (BrokenPipeError, ConnectionResetError):
            break
    sock.setblocking(True)
    return sent


# ---- 1. a client that hangs up mid-download ---------------------------------------------------------

def test_hangup_mid_download_does_not_kill_the_daemon(daemons):
    """SIGPIPE: GET the 16 MiB global and close (or reset) without reading, many times over."""
    d = daemons(big_model(16), "--expected-nodes", "2")
    base = Baseline(d)
    for i in range(20):
        sock = socket.create_connection(("127.0.0.1", d.port))
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.sendall(request_head("GET", "/global/latest.safetensors"))
        if i % 2:
            sock.recv(100)      # the transfer has started
        reset_close(sock) if i % 3 == 0 else sock.close()
        time.sleep(0.02)
    base.check()
    # and a whole download still works
    r = get(d.url, "/global/latest.safetensors", timeout=30)
    assert r.status_code == 200 and len(r.content) > 16 << 20
    assert d.stop() == 0


# ---- 2. pipelining without reading ----------------------------------------------------------------

def test_pipelined_global_gets_hold_one_descriptor_each_connection(daemons):
    """30,000 pipelined GETs of the global on three connections that never read: the parser pauses
    while output waits, so descriptors stay flat (each used to dup the global)."""
    d = daemons(big_model(4), "--expected-nodes", "2")
    base = Baseline(d)
    req = request_head("GET", "/global/latest.safetensors") * 30000
    socks = []
    for _ in range(3):
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.connect(("127.0.0.1", d.port))
        send_some(s, req, 1.5)
        socks.append(s)
    pid = d.proc.pid
    during = open_fds(pid)
    assert during <= base.fds + 3 + FD_SLACK, f"{during} descriptors with 3 attackers (baseline {base.fds})"
    served_quickly(d)
    r = get(d.url, "/global/latest.safetensors", timeout=30)
    assert r.status_code == 200 and r.headers["X-Outer-Step"] == "0"
    # the attackers' connections still work: reading drains them in order
    s = socks[0]
    s.settimeout(10)
    got = s.recv(65536)
    assert got.startswith(b"HTTP/1.1 200 OK\r\n"), got[:100]
    for s in socks:
        reset_close(s)
    base.check()
    assert d.stop() == 0


def test_pipelined_small_requests_keep_memory_bounded(daemons):
    """Ten connections each pipelining 64 KiB of `GET /` (the dashboard) and never reading."""
    d = daemons(small_model(1), "--expected-nodes", "2")
    base = Baseline(d)
    req = request_head("GET", "/") + request_head("GET", "/metrics") + request_head("GET", "/status")
    blob = req * (65536 // len(req) + 1)
    socks = []
    for _ in range(10):
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.connect(("127.0.0.1", d.port))
        send_some(s, blob * 4, 1.0)
        socks.append(s)
    time.sleep(0.5)
    rss = hostile.proc_kib(d.proc.pid)
    # per connection: a 64 KiB read buffer and at most 256 KiB of queued output plus one response
    assert rss <= base.rss + 10 * 1024 + RSS_SLACK_KIB // 2, f"RSS {rss} KiB (baseline {base.rss})"
    served_quickly(d)
    for s in socks:
        reset_close(s)
    base.check()
    assert d.stop() == 0


def test_descriptor_exhaustion_backs_off_and_keeps_serving_the_global(daemons, tmp_path):
    """RLIMIT_NOFILE 64 and a flood of connections: accept fails with EMFILE.  The listener must not
    spin a core, existing connections keep downloading the global (no new descriptor needed), and
    once the flood is gone new clients are served again."""
    model = big_model(1)
    base_dir = tmp_path / "emfile"
    base_dir.mkdir()
    from dilocod_proc import Dilocod, write_model
    write_model(base_dir / "init.safetensors", model)
    d = Dilocod(base_dir, None, "--init-model", str(base_dir / "init.safetensors"), "--expected-nodes", "2",
                "--max-connections", "10000", "--header-timeout", "30", "--idle-timeout", "60")
    limit = 64

    def lower_limit():
        resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit))
    import subprocess
    orig_popen = subprocess.Popen

    class LimitedPopen(orig_popen):
        def __init__(self, *a, **kw):
            kw["preexec_fn"] = lower_limit
            super().__init__(*a, **kw)
    subprocess.Popen = LimitedPopen
    try:
        d.start()
    finally:
        subprocess.Popen = orig_popen
    try:
        served_quickly(d, within=30)
        keeper = Raw("127.0.0.1", d.port)       # accepted before the flood
        flood = []
        for _ in range(3 * limit):
            try:
                flood.append(socket.create_connection(("127.0.0.1", d.port), timeout=2))
            except OSError:
                break
        time.sleep(0.5)
        cpu0 = cpu_seconds(d.proc.pid)
        time.sleep(2.0)
        busy = cpu_seconds(d.proc.pid) - cpu0
        # a listener woken forever by a connection it cannot accept burns the whole 2 s
        assert busy < 1.0, f"dilocod used {busy:.2f} s of CPU in 2 s while out of descriptors"
        for _ in range(3):
            keeper.send(request_head("GET", "/global/latest.safetensors"))
            r = keeper.response()
            assert r.status == 200 and len(r.body) == int(r.headers["content-length"]), r
        for s in flood:
            s.close()
        keeper.close()
        served_quickly(d, within=5)
        m = get(d.url, "/metrics").text
        assert "dilocod_http_accept_errors_total" in m, m
        assert d.alive()
        assert d.stop() == 0
    finally:
        if d.alive():
            d.kill9()


# ---- 3. an upload that fails asynchronously ---------------------------------------------------------

def make_incoming_unwritable(d):
    """Replaces <state>/cache/incoming with a regular file: creating the upload's temporary file
    then fails in open_cb (ENOTDIR), asynchronously, after the body consumer is installed."""
    inc = d.state_dir / "cache" / "incoming"
    shutil.rmtree(inc)
    inc.write_bytes(b"not a directory")
    return inc


@pytest.mark.parametrize("ending", ["reset", "eof", "idle"])
def test_upload_failing_on_disk_then_peer_gone_is_not_a_use_after_free(daemons, ending):
    """open_cb fails and answers 500 while the connection still has the upload as its body consumer;
    a later reset, EOF or idle timeout must not call back into the freed upload.  The PUT is
    pipelined behind a global GET, so its response is queued behind a file (real socket)."""
    model = big_model(16)       # the global's response stays queued: the client does not read it
    d = daemons(model, "--expected-nodes", "2", "--idle-timeout", "1")
    base = Baseline(d)
    inc = make_incoming_unwritable(d)
    blob = delta_blob("node-a", 0, 1, {"w": np.full(model["w"].shape, 1e-3, dtype=np.float32)})
    for _ in range(3):
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect(("127.0.0.1", d.port))
        head = request_head("PUT", "/nodes/node-a/delta_1.safetensors", [("Content-Length", str(len(blob)))])
        send_some(sock, request_head("GET", "/global/latest.safetensors") + head + blob[:len(blob) // 2], 1.0)
        time.sleep(0.3)
        if ending == "reset":
            reset_close(sock)
        elif ending == "eof":
            try:
                sock.shutdown(socket.SHUT_WR)
            except OSError:
                pass            # the idle timer (1 s) may have closed it already
            time.sleep(0.2)
            sock.close()
        else:
            time.sleep(1.5)     # the idle timer fires on the half-sent body
            sock.close()
    time.sleep(0.3)
    inc.unlink()
    inc.mkdir()
    base.check()
    # uploads work again once the directory is back
    r = session().put(d.url + "/nodes/node-a/delta_1.safetensors", data=blob, timeout=30)
    assert r.status_code == 201, r.text
    assert d.stop() == 0


def test_upload_failing_on_disk_answers_and_keeps_the_connection_sane(daemons):
    """The whole body is sent; the disk error is answered (500 with a code) and, the body having been
    read to its end, the connection stays usable."""
    model = small_model(4)
    d = daemons(model, "--expected-nodes", "2")
    inc = make_incoming_unwritable(d)
    rng = np.random.default_rng(4)
    tensors = {k: rng.standard_normal(tuple(v.shape)).astype(np.float32) * 0.01
               for k, v in model.items() if v.is_floating_point()}
    blob = delta_blob("node-a", 0, 1, tensors)
    raw = Raw("127.0.0.1", d.port)
    raw.send(request_head("PUT", "/nodes/node-a/delta_1.safetensors", [("Content-Length", str(len(blob)))]) + blob)
    r = raw.response()
    assert r.status == 500 and r.json()["error"]["code"] == "io_error", r
    raw.send(request_head("GET", "/healthz"))
    assert raw.response().status == 200
    raw.close()
    inc.unlink()
    inc.mkdir()
    served_quickly(d)
    assert d.stop() == 0


# ---- 8. silent connections ------------------------------------------------------------------------

def test_silent_connections_are_closed_at_the_header_deadline(daemons):
    """Connections that never send a byte are closed --header-timeout after accept (not after the
    idle timeout), and at --max-connections a new client takes an idle one's place."""
    d = daemons(small_model(5), "--expected-nodes", "2", "--header-timeout", "1", "--idle-timeout", "60",
                "--max-connections", "64")
    base = Baseline(d)
    silent = [socket.create_connection(("127.0.0.1", d.port)) for _ in range(64)]
    time.sleep(0.2)
    # every slot is taken by a silent connection: a real client still gets in at once
    served_quickly(d, within=2.0)
    t0 = time.monotonic()
    closed = 0
    for s in silent:
        s.settimeout(max(0.1, t0 + 3.0 - time.monotonic()))
        try:
            while s.recv(4096):
                pass
            closed += 1
        except ConnectionResetError:
            closed += 1
        except socket.timeout:
            pass
        s.close()
    assert closed == len(silent), f"{len(silent) - closed} silent connections still open 3 s after accept"
    m = get(d.url, "/metrics").text
    assert "dilocod_http_evicted_idle_total" in m
    base.check()
    assert d.stop() == 0


def test_a_thousand_silent_connections_do_not_lock_clients_out(daemons):
    """1,024 connections (the default limit) that send nothing: clients are still served."""
    d = daemons(small_model(6), "--expected-nodes", "2")
    base = Baseline(d)
    silent = []
    for _ in range(1024):
        try:
            silent.append(socket.create_connection(("127.0.0.1", d.port), timeout=5))
        except OSError:
            break
    assert len(silent) >= 900, len(silent)
    time.sleep(0.3)
    for _ in range(5):
        served_quickly(d, within=2.0)
    for s in silent:
        s.close()
    base.check(fd_slack=FD_SLACK)
    assert d.stop() == 0


def test_a_request_waiting_unread_is_not_evicted_as_idle(daemons):
    """At --max-connections the oldest idle connection makes room for a new one.  A connection
    accepted in an earlier loop turn whose request arrived since looks idle until its read callback
    runs: dilocod evicted it when new connections were accepted first in the same turn, and the
    pipelining client saw a reset before any answer (the chaos soak's "closed after 0 of 40").  The
    daemon is stopped so that both happen while it cannot run: the new connections queue first, then
    the request arrives."""
    d = daemons(small_model(7), "--expected-nodes", "2", "--max-connections", "4", "--header-timeout", "30")
    base = Baseline(d)
    client = socket.create_connection(("127.0.0.1", d.port), timeout=10)
    # a request answered on a connection made after it: the accept queue is FIFO, so the client is accepted
    assert get(d.url, "/healthz", headers={"Connection": "close"}).status_code == 200
    paths = ["/status", "/healthz", "/global/step_count.json", "/metrics"] * 5
    os.kill(d.proc.pid, signal.SIGSTOP)
    try:
        newcomers = [socket.create_connection(("127.0.0.1", d.port), timeout=10) for _ in range(4)]
        client.sendall(b"".join(f"GET {p} HTTP/1.1\r\nHost: x\r\n\r\n".encode() for p in paths))
        time.sleep(0.1)
    finally:
        os.kill(d.proc.pid, signal.SIGCONT)
    f = client.makefile("rb")
    for p in paths:
        line = f.readline()
        assert line.startswith(b"HTTP/1.1 200"), f"{p}: {line!r} (evicted with its request unread?)"
        length = None
        while (h := f.readline()) not in (b"\r\n", b""):
            if h.lower().startswith(b"content-length:"):
                length = int(h.split(b":")[1])
        assert length is not None, p
        f.read(length)
    client.close()
    # the room was made by evicting a newcomer that had sent nothing
    evicted = 0
    for s in newcomers:
        s.settimeout(0.5)
        try:
            evicted += s.recv(1) == b""
        except socket.timeout:
            pass
    assert evicted == 1, f"{evicted} of the silent newcomers evicted"
    for s in newcomers:
        s.close()
    base.check()
    assert d.stop() == 0


# ---- 9. one header cap, parsed off the loop ---------------------------------------------------------

def big_header_blob(node, base, local, model, header_bytes):
    """A delta whose header is padded to about header_bytes with metadata (valid JSON, valid file)."""
    rng = np.random.default_rng(9)
    tensors = {k: rng.standard_normal(tuple(v.shape)).astype(np.float32) * 0.01
               for k, v in model.items() if v.is_floating_point()}
    meta = delta_metadata(node, base, local)
    meta["padding"] = "x" * header_bytes
    return delta_blob(node, base, local, tensors, meta)


def test_upload_header_over_the_cap_is_refused_before_it_is_buffered(daemons):
    model = small_model(7)
    d = daemons(model, "--expected-nodes", "2", "--max-delta-header-mib", "1", "--max-body-mib", "64")
    base = Baseline(d)
    blob = big_header_blob("node-a", 0, 1, model, 2 << 20)
    r = session().put(d.url + "/nodes/node-a/delta_1.safetensors", data=blob, timeout=30)
    assert r.status_code in (400, 413), r.text
    assert r.json()["error"]["code"] == "header_too_large", r.text
    base.check()
    assert d.stop() == 0


def test_upload_with_a_large_header_does_not_stall_the_loop(daemons):
    """A delta with a 15 MiB header (under the 16 MiB cap) is parsed on the thread pool: /healthz on
    other connections keeps being answered meanwhile, and the upload is then refused (unknown key)
    or taken on its merits."""
    model = small_model(8)
    d = daemons(model, "--expected-nodes", "2")
    base = Baseline(d)
    blob = big_header_blob("node-a", 0, 1, model, 15 << 20)
    result = {}

    def upload():
        result["r"] = session().put(d.url + "/nodes/node-a/delta_1.safetensors", data=blob, timeout=60)
    t = threading.Thread(target=upload)
    t.start()
    while t.is_alive():
        served_quickly(d, within=2.0)
        time.sleep(0.01)
    t.join()
    r = result["r"]
    assert r.status_code == 201, r.text
    base.check(rss_slack_kib=RSS_SLACK_KIB + 200 * 1024)
    assert d.stop() == 0


def test_uploads_in_progress_are_capped(daemons):
    """--max-uploads 2: two uploads that stall half way hold their slots; a third is told 503 busy
    with Retry-After (diloco push retries it) and succeeds once a slot is free."""
    model = small_model(9)
    d = daemons(model, "--expected-nodes", "3", "--max-uploads", "2", "--idle-timeout", "30")
    base = Baseline(d)
    rng = np.random.default_rng(9)

    def blob(node):
        tensors = {k: rng.standard_normal(tuple(v.shape)).astype(np.float32) * 0.01
                   for k, v in model.items() if v.is_floating_point()}
        return delta_blob(node, 0, 1, tensors)
    stalled = []
    for node in ("node-a", "node-b"):
        b = blob(node)
        s = socket.create_connection(("127.0.0.1", d.port))
        s.sendall(request_head("PUT", f"/nodes/{node}/delta_1.safetensors", [("Content-Length", str(len(b)))])
                  + b[:len(b) // 2])
        stalled.append(s)
    wait_for(lambda: status(d.url)["uploads_in_progress"] == 2, 10, "two uploads in progress")
    third = blob("node-c")
    r = session().put(d.url + "/nodes/node-c/delta_1.safetensors", data=third, timeout=30)
    assert r.status_code == 503 and r.headers.get("Retry-After") == "1", (r.status_code, r.headers, r.text)
    assert r.json()["error"]["code"] == "busy"
    reset_close(stalled.pop())
    wait_for(lambda: status(d.url)["uploads_in_progress"] == 1, 10, "one upload in progress")
    r = session().put(d.url + "/nodes/node-c/delta_1.safetensors", data=third, timeout=30)
    assert r.status_code == 201, r.text
    for s in stalled:
        reset_close(s)
    base.check()
    assert d.stop() == 0
