"""The worker package (client/python, import name diloco) against the real dilocod and the real
`diloco delta --encode`: byte-identical encoders and residuals, rounds over HTTP and file://, the
server's answers (409 stale, 422, 503 Retry-After, a connection cut mid-upload), DyLU in async mode,
and hostile answers refused with the model untouched."""
import http.server
import json
import socket
import socketserver
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load, save_file

import diloco
from diloco.encode import check_spec, residual_file
from conftest import run
from dilocod_proc import Dilocod, Oracle, assert_state_equal, write_model


def mixed_state(seed):
    """F32, BF16, F16, a scalar, an odd element count, a zero block, a non-floating buffer."""
    g = torch.Generator().manual_seed(seed)
    return {"layer.weight": torch.randn(33, 7, generator=g), "layer.bias": torch.randn(65, generator=g),
            "emb": torch.randn(12, 16, generator=g).to(torch.bfloat16),
            "head": torch.randn(3, 5, generator=g).half(), "scale": torch.tensor(0.5),
            "zeros": torch.zeros(64), "count": torch.tensor([3, 4])}


class Module(torch.nn.Module):
    """A model whose state_dict is exactly `state` (flat names through a ParameterDict-free holder)."""

    def __init__(self, state):
        super().__init__()
        self.names = {}
        for i, (k, v) in enumerate(state.items()):
            self.register_buffer(f"t{i}", v.clone())
            self.names[k] = f"t{i}"

    def state_dict(self, *a, **kw):
        own = super().state_dict(*a, **kw)
        return {k: own[n] for k, n in self.names.items()}


def perturbed(state, g, scale=0.01):
    return {k: (v + scale * torch.randn(v.shape, generator=g).to(v.dtype)) if v.is_floating_point() else v.clone()
            for k, v in state.items()}


# ---- encoders -------------------------------------------------------------------------------------
@pytest.mark.parametrize("encode", ["int8_block", "mxfp8", "mxfp4", "int8_block-256"])
def test_encoders_byte_identical_to_the_tool(tmp_path, diloco_bin, encode):
    enc, _, blk = encode.partition("-")
    block = int(blk) if blk else None
    base = mixed_state(1)
    g = torch.Generator().manual_seed(2)
    save_file(base, str(tmp_path / "base.safetensors"))
    res, res_path = None, tmp_path / "residual.safetensors"
    for call in range(3):           # error feedback carried over 3 calls, as the tool's residual file
        cur = perturbed(base, g, scale=0.01 * (call + 1))
        save_file(cur, str(tmp_path / "cur.safetensors"))
        out = tmp_path / f"delta_{call}.safetensors"
        run([diloco_bin, "delta", "--baseline", tmp_path / "base.safetensors", "--current",
             tmp_path / "cur.safetensors", "--node-id", "w1", "--base-step", "4", "--local-step", str(10 + call),
             "-o", out, "--encode", enc, "--residual", res_path, "--meta", "loss=1.25", "--meta", "num_tokens=640",
             *(["--block", str(block)] if block else [])], check=0)
        meta = diloco.delta_metadata("w1", 4, 10 + call, extra={"loss": "1.25", "num_tokens": "640"})
        delta, res = diloco.encode_delta(base, cur, enc, block=block, residual=res, metadata=meta)
        assert bytes(delta) == out.read_bytes(), (enc, call)
        assert residual_file(res, base, enc, check_spec(enc, block)) == res_path.read_bytes(), (enc, call)
        streamed = tmp_path / "streamed"
        with open(streamed, "wb") as f:
            delta.write_to(f)
        assert streamed.read_bytes() == out.read_bytes() and len(delta) == out.stat().st_size


def edge_values():
    """Blocks of 32 that hit the encoders' corners: exact ties between E4M3 and E2M1 values (at scale
    2^0), signed zeros, subnormals, the largest values a delta may hold, a block of zeros."""
    from diloco.encode import E2M1_MIDS, E4M3_MIDS
    e4 = [448.0] + [m * s for m in E4M3_MIDS[::4] for s in (1, -1)][:31]
    e2 = [6.0] + [m * s for m in E2M1_MIDS for s in (1, -1)] + [0.0, -0.0] * 8 + [1.0, 3.0, 4.0]
    sub = [2.0 ** -149, -(2.0 ** -149), 2.0 ** -130, 2.0 ** -126, 1e-38, -3e-39] + [0.0] * 26
    big = [9e18, -9e18, 4.6e18, 2.0 ** 40, -(2.0 ** 62)] + [1.0] * 27     # with the residual, below 2^64
    vals = e4 + e2[:32] + sub + big + [0.0] * 32
    return torch.tensor(vals, dtype=torch.float32)


@pytest.mark.parametrize("encode", ["int8_block", "mxfp8", "mxfp4"])
def test_encoders_byte_identical_at_the_corners(tmp_path, diloco_bin, encode):
    base = {"edge": edge_values(), "tail": torch.tensor([2.5, -0.75])}
    cur = {k: torch.zeros_like(v) for k, v in base.items()}         # the delta is exactly `base`
    save_file(base, str(tmp_path / "b.safetensors"))
    save_file(cur, str(tmp_path / "c.safetensors"))
    out, res_path, res = tmp_path / "d.safetensors", tmp_path / "r.safetensors", None
    for call in range(2):
        run([diloco_bin, "delta", "--baseline", tmp_path / "b.safetensors", "--current", tmp_path / "c.safetensors",
             "--node-id", "w1", "--base-step", "0", "--local-step", str(call + 1), "-o", out, "--encode", encode,
             "--residual", res_path], check=0)
        delta, res = diloco.encode_delta(base, cur, encode, residual=res,
                                         metadata=diloco.delta_metadata("w1", 0, call + 1))
        assert bytes(delta) == out.read_bytes(), (encode, call)
        assert residual_file(res, base, encode, check_spec(encode, None)) == res_path.read_bytes(), (encode, call)


def test_plain_delta_byte_identical_to_the_tool(tmp_path, diloco_bin):
    base, cur = mixed_state(3), perturbed(mixed_state(3), torch.Generator().manual_seed(4))
    save_file(base, str(tmp_path / "b.safetensors"))
    save_file(cur, str(tmp_path / "c.safetensors"))
    run([diloco_bin, "delta", "--baseline", tmp_path / "b.safetensors", "--current", tmp_path / "c.safetensors",
         "--node-id", "w1", "--base-step", "0", "--local-step", "7", "-o", tmp_path / "d.safetensors"], check=0)
    assert bytes(diloco.plain_delta(base, cur, diloco.delta_metadata("w1", 0, 7))) == \
        (tmp_path / "d.safetensors").read_bytes()


# ---- rounds ---------------------------------------------------------------------------------------
def rounds(worker_urls, d, init, nrounds, encode=None):
    """Two workers in threads, nrounds sync rounds; the oracle is fed the deltas the workers sent
    (decoded by the server: for plain deltas, exactly the F32 differences) -> the oracle's state."""
    sent, errors = {}, []

    def work(i, url):
        try:
            node = f"w{i}"
            model = Module(init)
            w = diloco.Worker(url, node, encode=encode)
            g = torch.Generator().manual_seed(100 + i)
            for r in range(nrounds):
                step = w.pull(model)
                assert step == r
                base = {k: v.clone() for k, v in model.state_dict().items()}
                with torch.no_grad():
                    for k, v in model.state_dict().items():
                        if v.is_floating_point():
                            v.add_((0.01 * torch.randn(v.shape, generator=g)).to(v.dtype))
                cur = model.state_dict()
                sent.setdefault(r, {})[node] = {k: base[k].float() - cur[k].float()
                                                for k in base if base[k].is_floating_point()}
                res = w.push(model, local_step=10 * (r + 1), loss=1.0 / (r + 1), tokens=64)
                assert res.status in ("accepted", "written"), res
                w.wait(step + 1, timeout=60)
        except BaseException as e:      # surfaced by the caller
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i, u)) for i, u in enumerate(worker_urls)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not errors, errors
    oracle = Oracle(init)
    for r in range(nrounds):
        oracle.step(sent[r])
    return oracle.state


def test_round_over_http(tmp_path):
    init = mixed_state(5)
    write_model(tmp_path / "init.safetensors", init)
    d = Dilocod(tmp_path, None, "--init-model", tmp_path / "init.safetensors", "--expected-nodes", "2").start()
    try:
        want = rounds([d.url, d.url], d, init, 3)
        model = Module(init)
        w = diloco.Worker(d.url, "w0")
        assert w.pull(model) == 3
        assert_state_equal(model.state_dict(), want)
        # unchanged since: If-None-Match answers 304 and the model is set to the kept baseline again
        with torch.no_grad():
            model.state_dict()["layer.bias"].add_(1.0)
        assert w.pull(model) == 3
        assert_state_equal(model.state_dict(), want)
        # the worker metrics reached the server
        st = d.get_json("/status")
        assert {x["node_id"] for x in st["workers"]} == {"w0", "w1"}
    finally:
        assert d.stop() == 0


def test_round_over_file_tree(tmp_path):
    init = mixed_state(6)
    hub = tmp_path / "hub"
    hub.mkdir()
    write_model(tmp_path / "init.safetensors", init)
    d = Dilocod(tmp_path, hub, "--init-model", tmp_path / "init.safetensors", "--expected-nodes", "2").start()
    try:
        d.wait_step(0)
        want = rounds([f"file://{hub}"] * 2, d, init, 2)
        model = Module(init)
        assert diloco.Worker(f"file://{hub}", "w0").pull(model) == 2
        assert_state_equal(model.state_dict(), want)
        # nothing half-written was ever left in the tree
        assert not [p for p in hub.rglob("*") if p.name.startswith(".")], list(hub.rglob(".*"))
    finally:
        assert d.stop() == 0


def test_compressed_round_over_http(tmp_path):
    """mxfp8 with error feedback: accepted, and the global moves by the server's decoding of it."""
    init = mixed_state(7)
    write_model(tmp_path / "init.safetensors", init)
    d = Dilocod(tmp_path, None, "--init-model", tmp_path / "init.safetensors", "--expected-nodes", "1").start()
    try:
        model = Module(init)
        w = diloco.Worker(d.url, "w0", encode="mxfp8")
        g = torch.Generator().manual_seed(8)
        for r in range(3):
            assert w.pull(model) == r
            with torch.no_grad():
                for k, v in model.state_dict().items():
                    if v.is_floating_point():
                        v.add_((0.01 * torch.randn(v.shape, generator=g)).to(v.dtype))
            before = {k: v.clone() for k, v in w.residual.items()} if w.residual else None
            res = w.push(model, local_step=r + 1)
            assert res.status == "accepted" and res.answer["result"] == "accepted", res
            assert w.residual is not None and (before is None or any(
                not torch.equal(before[k], w.residual[k]) for k in before))
            w.wait(r + 1, timeout=60)
    finally:
        assert d.stop() == 0


# ---- the answers ----------------------------------------------------------------------------------
def test_stale_is_a_status_and_the_model_is_untouched(tmp_path):
    init = mixed_state(9)
    write_model(tmp_path / "init.safetensors", init)
    d = Dilocod(tmp_path, None, "--init-model", tmp_path / "init.safetensors", "--expected-nodes", "1").start()
    try:
        a, b = Module(init), Module(init)
        wa, wb = diloco.Worker(d.url, "wa"), diloco.Worker(d.url, "wb", encode="int8_block")
        assert wa.pull(a) == 0 and wb.pull(b) == 0
        with torch.no_grad():
            a.state_dict()["layer.bias"].add_(0.1)
            b.state_dict()["layer.bias"].add_(0.2)
        assert wa.push(a, local_step=1).status == "accepted"
        wa.wait(1, timeout=60)
        mine = {k: v.clone() for k, v in b.state_dict().items()}
        res = wb.push(b, local_step=1)
        assert res.status == "stale" and res.http_status == 409, res
        assert res.answer["error"]["code"] == "stale"
        assert_state_equal(b.state_dict(), mine)
        assert wb.residual is None          # a refused delta does not move the error feedback on
        assert wb.pull(b) == 1
        assert wb.push(b, local_step=2).status == "accepted"
    finally:
        assert d.stop() == 0


def test_422_raises_with_the_servers_code(tmp_path):
    init = mixed_state(10)
    write_model(tmp_path / "init.safetensors", init)
    d = Dilocod(tmp_path, None, "--init-model", tmp_path / "init.safetensors", "--expected-nodes", "1").start()
    try:
        m = Module(init)
        w = diloco.Worker(d.url, "w0")
        w.pull(m)
        with torch.no_grad():
            m.state_dict()["layer.bias"][3] = float("nan")
        with pytest.raises(diloco.DeltaRefused) as e:
            w.push(m, local_step=1)
        assert e.value.status == 422 and e.value.code == "non_finite" and e.value.message, e.value
    finally:
        assert d.stop() == 0


class CuttingProxy:
    """A TCP relay in front of dilocod that misbehaves on the first upload it sees: 'cut' drops the
    connection after part of the body, 'lose' forwards the whole upload and drops the answer (the
    delta landed), '503' answers 503 busy with Retry-After: 1 itself; 'cutget' cuts the first download
    of the global after 1200 bytes.  Later connections are relayed."""

    def __init__(self, target_port, mode):
        self.target, self.mode, self.tripped = target_port, mode, False
        self.heads = []                  # the requests' first bytes, in order
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(c,), daemon=True).start()

    def _serve(self, c):
        """Relays both ways; the first PUT (the worker keeps its connection alive, so it may come after
        a GET on the same connection) is where the misbehaviour happens."""
        s = socket.create_connection(("127.0.0.1", self.target))
        mute = threading.Event()         # 'lose': the answer is swallowed
        limit = [None]                   # 'cutget': bytes of the answer still relayed

        def back():
            try:
                while True:
                    data = s.recv(65536)
                    if not data:
                        break
                    if mute.is_set():
                        break
                    if limit[0] is not None:
                        data = data[:limit[0]]
                        limit[0] -= len(data)
                        c.sendall(data)
                        if limit[0] <= 0:
                            break
                        continue
                    c.sendall(data)
            except OSError:
                pass
            finally:
                for x in (c, s):
                    try:
                        x.shutdown(socket.SHUT_RDWR)
                    except OSError:
                        pass

        threading.Thread(target=back, daemon=True).start()
        try:
            while True:
                chunk = c.recv(65536)
                if not chunk:
                    break
                if chunk[:4] in (b"GET ", b"PUT "):
                    self.heads.append(chunk[:1024])
                if self.mode == "cutget" and chunk.startswith(b"GET /global/latest.safetensors") and \
                        not self.tripped:
                    self.tripped = True
                    limit[0] = 1200      # the head and the first bytes of the body, then the cut
                if chunk.startswith(b"PUT") and not self.tripped:
                    self.tripped = True
                    if self.mode == "cut":
                        s.sendall(chunk[:len(chunk) // 2])
                        break
                    if self.mode == "503":
                        body = b'{"error":{"code":"busy","message":"uploads in flight"}}'
                        mute.set()
                        c.sendall(b"HTTP/1.1 503 Service Unavailable\r\nRetry-After: 1\r\n"
                                  b"Content-Type: application/json\r\nConnection: close\r\n"
                                  b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
                        break
                    if self.mode == "lose":
                        mute.set()
                s.sendall(chunk)
        except OSError:
            pass
        if self.mode == "lose" and mute.is_set():
            time.sleep(1.0)             # the server reads the whole upload and answers into the void
        for x in (c, s):
            try:
                x.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            x.close()

    def close(self):
        self.sock.close()


@pytest.mark.parametrize("mode", ["cut", "lose", "503"])
def test_upload_retried_after_a_cut_a_lost_answer_or_503(tmp_path, mode):
    init = mixed_state(11)
    write_model(tmp_path / "init.safetensors", init)
    # two expected nodes: the round stays open, so a retry meets the delta its first attempt left
    d = Dilocod(tmp_path, None, "--init-model", tmp_path / "init.safetensors", "--expected-nodes", "2").start()
    proxy = CuttingProxy(d.port, mode)
    try:
        m = Module(init)
        w = diloco.Worker(f"http://127.0.0.1:{proxy.port}", "w0", encode="mxfp4")
        w.pull(m)
        with torch.no_grad():
            m.state_dict()["layer.weight"].add_(0.05)
        res = w.push(m, local_step=1)
        assert proxy.tripped
        assert res.status == "accepted", res
        if mode == "lose":      # the retry is answered not_newer: the first attempt landed
            assert res.http_status == 409 and res.answer["error"]["code"] == "not_newer", res
        else:
            assert res.http_status == 201 and res.answer["result"] == "accepted", res
        assert w.residual is not None
        d.wait_received(1, ["w0"])
        received = [e["node_id"] for e in d.get_json("/status")["round"]["received"]]
        assert received == ["w0"], received      # one delta from w0, not two
        # nothing of the cut attempt is left in the server's intake
        assert not list((d.state_dir / "cache" / "incoming").glob("*")) if (d.state_dir / "cache" / "incoming").exists() else True
    finally:
        proxy.close()
        assert d.stop() == 0


def test_pull_resumes_a_cut_download_with_range(tmp_path):
    init = mixed_state(16)
    write_model(tmp_path / "init.safetensors", init)
    d = Dilocod(tmp_path, None, "--init-model", tmp_path / "init.safetensors", "--expected-nodes", "1").start()
    proxy = CuttingProxy(d.port, "cutget")
    try:
        m = Module(mixed_state(17))
        w = diloco.Worker(f"http://127.0.0.1:{proxy.port}", "w0")
        assert w.pull(m) == 0
        assert proxy.tripped
        assert_state_equal(m.state_dict(), init)
        # the second request asked for the rest only, of the same file
        gets = [h for h in proxy.heads if h.startswith(b"GET /global/latest.safetensors")]
        assert len(gets) == 2 and b"Range: bytes=" in gets[1] and b"If-Range: " in gets[1], gets
    finally:
        proxy.close()
        assert d.stop() == 0


def test_async_dylu_recommendation_followed_within_bounds(tmp_path):
    init = mixed_state(12)
    write_model(tmp_path / "init.safetensors", init)
    d = Dilocod(tmp_path, None, "--init-model", tmp_path / "init.safetensors", "--mode", "async",
                "--expected-nodes", "2", "--dylu-base-steps", "64").start()
    try:
        m = Module(init)
        w = diloco.Worker(d.url, "w0")
        local, H, seen = 0, 64, []
        for phase in range(3):
            step = w.pull(m)
            with torch.no_grad():
                m.state_dict()["layer.bias"].add_(0.01)
            local += H
            res = w.push(m, local_step=local, tokens=H * 8)
            assert res.status == "accepted", res
            assert res.recommended_local_steps is not None and 1 <= res.recommended_local_steps <= 64, res
            H = res.local_steps(64)
            assert max(1, 64 // 16) <= H <= 4 * 64 and H == min(max(res.recommended_local_steps, 4), 256)
            seen.append(res.recommended_local_steps)
            w.wait(step + 1, timeout=60)
        assert diloco.followed_local_steps(10 ** 9, 64) == 256 and diloco.followed_local_steps(0, 64) == 4
        assert diloco.followed_local_steps(None, 64) == 64
    finally:
        assert d.stop() == 0


# ---- hostile answers ------------------------------------------------------------------------------
class Hostile(http.server.BaseHTTPRequestHandler):
    """Serves whatever `routes` says: path -> (status, headers, body, bytes actually sent or None)."""
    routes = {}

    def log_message(self, *a):
        pass

    def do_GET(self):
        status, headers, body, send = self.routes.get(self.path, (404, {}, b'{"error":{"code":"not_found"}}', None))
        self.send_response(status)
        for k, v in headers.items():
            self.send_header(k, v)
        if "Content-Length" not in headers:
            self.send_header("Content-Length", str(len(body)))
        self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(body[:send] if send is not None else body)
        self.close_connection = True


@pytest.fixture
def hostile():
    socketserver.TCPServer.allow_reuse_address = True
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Hostile)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield srv
    srv.shutdown()
    srv.server_close()


def global_bytes(state):
    from safetensors.torch import save
    return save({k: v.contiguous() for k, v in state.items()})


def attack(hostile, routes, match):
    Hostile.routes = routes
    init = mixed_state(13)
    m = Module(init)
    before = {k: v.clone() for k, v in m.state_dict().items()}
    w = diloco.Worker(f"http://127.0.0.1:{hostile.server_address[1]}", "w0")
    with pytest.raises(diloco.HostileAnswer, match=match):
        w.pull(m)
    assert_state_equal(m.state_dict(), before)
    assert w.baseline is None


def test_hostile_truncated_global(hostile):
    g = global_bytes(perturbed(mixed_state(13), torch.Generator().manual_seed(1)))
    # well-formed HTTP, but the file stops before the end its header gives
    attack(hostile, {"/global/latest.safetensors": (200, {"X-Outer-Step": "1", "ETag": '"a"'}, g[:-40], None)},
           "truncated")


def test_hostile_bytes_not_matching_content_length(hostile):
    g = global_bytes(perturbed(mixed_state(13), torch.Generator().manual_seed(1)))
    # Content-Length says the whole file, the connection closes 100 bytes short, every time
    attack(hostile, {"/global/latest.safetensors": (200, {"X-Outer-Step": "1", "ETag": '"a"',
                                                          "Content-Length": str(len(g))}, g, len(g) - 100)},
           "Content-Length")


def test_hostile_header_over_its_cap(hostile):
    g = bytearray(global_bytes(mixed_state(13)))
    g[:8] = (200_000_000).to_bytes(8, "little")
    attack(hostile, {"/global/latest.safetensors": (200, {"X-Outer-Step": "1"}, bytes(g), None)}, "over the cap")


def test_hostile_shard_name_leaving_global(hostile):
    state = mixed_state(13)
    index = {"metadata": {"total_size": 1}, "weight_map": {k: "latest-00001-of-00001.safetensors" for k in state}}
    index["weight_map"]["emb"] = "../../etc/latest-00001-of-00001.safetensors"
    attack(hostile, {"/global/latest.safetensors.index.json": (200, {"X-Outer-Step": "1", "ETag": '"i"'},
                                                               json.dumps(index).encode(), None)},
           "not a name")


def test_hostile_global_of_another_shape_is_refused_strictly(hostile):
    state = mixed_state(13)
    state["layer.bias"] = torch.zeros(66)
    attack(hostile, {"/global/latest.safetensors": (200, {"X-Outer-Step": "1"}, global_bytes(state), None)},
           "layer.bias")


# ---- the remote transports: s3:// on SeaweedFS, hf:// on the Hub emulator ---------------------------
from test_s3 import S3Dilocod, s3  # noqa: E402,F401 (the SeaweedFS fixture)
from test_daemon_hf import REPO, TOKEN, HfDilocod, HubSim, _hf_home, procs  # noqa: E402,F401 (fixtures)


def test_round_over_s3(tmp_path, s3, monkeypatch):
    # the worker's credentials and endpoint from the usual environment, as boto3 users set them
    for k, v in s3.env().items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3.endpoint)
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    init = mixed_state(14)
    write_model(tmp_path / "init.safetensors", init)
    d = S3Dilocod(tmp_path, s3, "worker-pkg", "--init-model", tmp_path / "init.safetensors",
                  "--expected-nodes", "2").start()
    try:
        d.wait_step(0)
        url = f"s3://{s3.bucket}/worker-pkg"
        want = rounds([url, url], d, init, 2)
        model = Module(init)
        assert diloco.Worker(url, "w0").pull(model) == 2
        assert_state_equal(model.state_dict(), want)
    finally:
        assert d.stop() == 0


def test_round_over_hf(tmp_path, procs, monkeypatch):
    from huggingface_hub import HfApi
    hub = HubSim(tmp_path)
    procs.append(hub)
    HfApi(endpoint=hub.wendpoint, token=TOKEN).create_repo(REPO)
    monkeypatch.setenv("HF_ENDPOINT", hub.wendpoint)
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    init = mixed_state(15)
    write_model(tmp_path / "init.safetensors", init)
    d = HfDilocod(tmp_path, hub, "--init-model", tmp_path / "init.safetensors", "--expected-nodes", "2", poll=0.2)
    procs.append(d)
    d.start()
    d.wait_published(0)
    url = f"hf://{REPO}"
    want = rounds([url, url], d, init, 2)
    model = Module(init)
    assert diloco.Worker(url, "w0").pull(model) == 2
    assert_state_equal(model.state_dict(), want)
    assert d.stop() == 0


# ---- DiLoCoCallback: a Hugging Face Trainer, 2 worker processes, 3 rounds over HTTP -----------------
TRANSFORMERS_PY = Path(__file__).resolve().parents[2] / ".venv-transformers" / "bin" / "python"


def test_hf_trainer_callback_two_workers_three_rounds(tmp_path):
    import os
    import subprocess
    from safetensors.torch import load_file
    helper = Path(__file__).with_name("hf_trainer_worker.py")
    assert TRANSFORMERS_PY.exists(), "run `make venv-transformers` (make check does)"
    run([TRANSFORMERS_PY, helper, "--init", tmp_path / "init.safetensors"], check=0)
    init = load_file(str(tmp_path / "init.safetensors"))
    d = Dilocod(tmp_path, None, "--init-model", tmp_path / "init.safetensors", "--expected-nodes", "2").start()
    out, H, R = tmp_path / "rec", 10, 3
    try:
        env = dict(os.environ, OMP_NUM_THREADS="1")
        procs_ = [subprocess.Popen([str(TRANSFORMERS_PY), str(helper), d.url, f"w{i}", str(i), str(R), str(H), str(out)],
                                   stdout=open(tmp_path / f"w{i}.out", "wb"), stderr=subprocess.STDOUT, env=env)
                  for i in range(2)]
        for i, p in enumerate(procs_):
            assert p.wait(600) == 0, (tmp_path / f"w{i}.out").read_text()[-4000:]
    finally:
        assert d.stop() == 0
    # every global equals torch's outer step fed the deltas the server received
    oracle = Oracle(init)
    for step in range(R):
        for node in ("w0", "w1"):
            assert_state_equal(load_file(str(out / node / f"global_{step}.safetensors")), oracle.state)
        oracle.step({node: load_file(str(out / node / f"delta_{step}.safetensors")) for node in ("w0", "w1")})
    for node in ("w0", "w1"):
        assert_state_equal(load_file(str(out / node / f"global_{R}.safetensors")), oracle.state)
    # the loss falls: each worker's last round against its first
    for node in ("w0", "w1"):
        rec = json.loads((out / node / "losses.json").read_text())
        assert rec["results"] == ["accepted"] * R, rec
        losses = rec["losses"]
        assert len(losses) == R * H
        first, last = sum(losses[:H]) / H, sum(losses[-H:]) / H
        assert last < first, (node, first, last)


@pytest.mark.parametrize("transport", ["http", "file"])
def test_round_with_a_sharded_global(tmp_path, transport):
    """dilocod publishes and serves the global as an index and its shards (--shard-size 1KB): the worker
    pulls the set (each shard checked, the model strict), pushes, and the rounds equal torch's."""
    init = mixed_state(8)
    hub = tmp_path / "hub"
    hub.mkdir()
    write_model(tmp_path / "init.safetensors", init)
    d = Dilocod(tmp_path, hub, "--init-model", tmp_path / "init.safetensors", "--expected-nodes", "2",
                "--shard-size", "1KB").start()
    try:
        d.wait_step(0)
        url = d.url if transport == "http" else f"file://{hub}"
        want = rounds([url, url], d, init, 2)
        # the global really is a set of several shards, on both sides
        index = json.loads((hub / "global" / "latest.safetensors.index.json").read_text())
        assert len(set(index["weight_map"].values())) > 1, index
        model = Module(init)
        assert diloco.Worker(url, "w0").pull(model) == 2
        assert_state_equal(model.state_dict(), want)
    finally:
        assert d.stop() == 0
