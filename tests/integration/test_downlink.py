"""The downlink (dilocod --downlink mxfp8|mxfp4; server/README.md, "The downlink"): each committed step is
published as a compressed update U_s = encode(global_s - view_{s-1}) and workers replay it bit for bit.

Checked against the real dilocod and the real worker package, with a numpy decoder written here from the
format's definition (not the package's): the worker's replayed view is byte-identical to the server's
view.safetensors at every step; the numpy replay agrees; |global - view| stays within the last update's
quantization (no drift); the bytes a worker downloads per round against the global's; catch-up (a few
steps behind replays them, beyond --updates-keep takes the view); an uncommitted or forgotten update is
never served; a tampered update in a tree is refused by its block hash and the worker falls back; kill -9
at the commit's crash hooks leaves view, update and global agreeing."""
import hashlib
import json
import os
import socket
import threading
import time
import urllib.error
import urllib.request

import numpy as np
import pytest
import torch

import diloco
from diloco.errors import HostileAnswer, ServerError
from dilocod_proc import Dilocod, write_model

STEPS = 20


# ---- a decoder from the definition (independent of diloco.downlink) --------------------------------
def e4m3(code):
    s, e, m = code >> 7, (code >> 3) & 15, code & 7
    v = m / 8 * 2.0 ** -6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7)
    return -v if s else v


E4M3 = np.array([e4m3(c) for c in range(256)], dtype=np.float64)
E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], dtype=np.float64)


def mx_decode(enc, codes, scales, n):
    """Values in float64 (exact: few-bit codes times powers of two), per block of 32."""
    codes = codes.reshape(-1).view(np.uint8)
    if enc == "mxfp8":
        v = E4M3[codes[:n]]
    else:
        nib = np.stack([codes & 15, codes >> 4], axis=1).reshape(-1)[:n]
        v = np.where(nib & 8, -1.0, 1.0) * E2M1[nib & 7]
    return v * np.ldexp(1.0, scales.view(np.uint8).astype(np.int64) - 127).repeat(32)[:n]


def bf16_round(x32):
    b = x32.view(np.uint32).astype(np.uint64)
    return ((b + 0x7FFF + ((b >> 16) & 1)) >> 16).astype(np.uint16)


def st_layout(buf):
    n = int.from_bytes(buf[:8], "little")
    h = json.loads(buf[8:8 + n])
    h.pop("__metadata__", None)
    return {k: (v["dtype"], v["shape"], 8 + n + v["data_offsets"][0], 8 + n + v["data_offsets"][1]) for k, v in h.items()}


def st_meta(buf):
    n = int.from_bytes(buf[:8], "little")
    return json.loads(buf[8:8 + n]).get("__metadata__", {})


def raw_tensors(buf):
    """{name: array}: F32 keys as float32, the rest as their bytes (numpy has no E4M3, E8M0 nor F4)."""
    out = {}
    for k, (dt, shape, b, e) in st_layout(buf).items():
        a = np.frombuffer(buf, dtype=np.uint8, count=e - b, offset=b)
        out[k] = a.view(np.float32) if dt == "F32" else a
    return out


def numpy_replay(view: bytes, update: bytes) -> bytes:
    """view_{s-1} + decode(U_s), in F32 (numpy float32 add), rounded to each key's dtype."""
    meta, out, ut = st_meta(update), bytearray(view), raw_tensors(update)
    for name, (dt, shape, b, e) in st_layout(view).items():
        if dt not in ("F32", "BF16"):
            continue
        n = int(np.prod(shape)) if shape else 1
        if name + ".__scales__" in ut:
            x = mx_decode(meta["encoding"], ut[name], ut[name + ".__scales__"], n).astype(np.float32)
        else:
            x = ut[name].reshape(-1).astype(np.float32)
        raw = np.frombuffer(view, dtype=np.uint8, count=e - b, offset=b)
        if dt == "F32":
            v = raw.view(np.float32) + x
            out[b:e] = v.astype(np.float32).tobytes()
        else:
            v = (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32) + x
            out[b:e] = bf16_round(v.astype(np.float32)).tobytes()
    return bytes(out)


def f32_values(buf, name):
    dt, shape, b, e = st_layout(buf)[name]
    raw = np.frombuffer(buf, dtype=np.uint8, count=e - b, offset=b)
    if dt == "BF16":
        return (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    return raw.view(np.float32)


def block_hash(data):
    """The block hash from its definition (sha256 of the sha256 digests of 16 MiB blocks)."""
    blk = 16 << 20
    parts = [hashlib.sha256(data[i:i + blk]).digest() for i in range(0, max(len(data), 1), blk)] or \
        [hashlib.sha256(b"").digest()]
    return hashlib.sha256(b"".join(parts)).hexdigest()


# ---- the model, the worker's module, the server ------------------------------------------------------
def model_state(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(256, 512, generator=g).to(dtype), "b": torch.randn(257, generator=g).to(dtype),
            "count": torch.tensor([1, 2, 3])}


class Module(torch.nn.Module):
    def __init__(self, state):
        super().__init__()
        for k, v in state.items():
            self.register_buffer(k, v.clone())


def train(m, g, scale=0.02):
    with torch.no_grad():
        for k, v in m.state_dict().items():
            if v.is_floating_point():
                v.add_((scale * torch.randn(v.shape, generator=g)).to(v.dtype))


OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def get(url, path, headers=None):
    try:
        with OPENER.open(urllib.request.Request(url + path, headers=headers or {}), timeout=30) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


def start(tmp_path, init, *args, hub=None):
    d = Dilocod(tmp_path, hub, "--init-model", str(init), "--expected-nodes", "1", *args)
    d.start()
    return d


def wait_step(d, step, timeout=60):
    d.wait_until(lambda: (d.get_json("/status") or {}).get("outer_step", -1) >= step, f"step {step}", timeout)


# ---- 20 steps: replay, numpy, no drift, bytes ------------------------------------------------------
@pytest.mark.parametrize("enc", ["mxfp8", "mxfp4"])
@pytest.mark.parametrize("dtype", ["F32", "BF16"])
def test_twenty_steps_replayed_bit_for_bit(tmp_path, enc, dtype):
    tdt = torch.float32 if dtype == "F32" else torch.bfloat16
    init = tmp_path / "init.safetensors"
    state = model_state(tdt)
    write_model(init, state)
    d = start(tmp_path, init, "--downlink", enc)
    try:
        url = d.url
        m, g = Module(state), torch.Generator().manual_seed(1)
        w = diloco.Worker(url, "w1", downlink=True)
        _, _, view = get(url, "/global/view.safetensors")
        mine = view                                 # the numpy replay's own copy
        ratios = []
        for s in range(1, STEPS + 1):
            w.pull(m)
            train(m, g)
            assert w.push(m, local_step=s).status == "accepted"
            wait_step(d, s)
            w.pull(m)
            assert w.step == s
            code, h, view = get(url, "/global/view.safetensors")
            assert code == 200 and h["X-Outer-Step"] == str(s)
            assert w.view_bytes() == view, f"step {s}: the worker's replayed view differs from the server's"
            code, h, update = get(url, f"/global/updates/{s}.safetensors")
            assert code == 200 and h["X-Outer-Step"] == str(s)
            meta = st_meta(update)
            assert (meta["step"], meta["base_step"], meta["encoding"], meta["block"]) == (str(s), str(s - 1), enc, "32")
            assert meta["view_hash"] == block_hash(view)
            mine = numpy_replay(mine, update)
            assert mine == view, f"step {s}: the numpy replay differs from the server's view"
            sc = json.loads(get(url, "/global/step_count.json")[2])
            assert (sc["view_file"], sc["update_file"], sc["view_hash"]) == \
                ("global/view.safetensors", f"global/updates/{s}.safetensors", block_hash(view))
            # no drift: the gap is within the last update's quantization, per block of 32
            _, _, glob = get(url, "/global/latest.safetensors")
            ut = raw_tensors(update)
            for key in ("w", "b"):
                gap = np.abs(f32_values(glob, key).astype(np.float64) - f32_values(view, key))
                gv = np.abs(f32_values(glob, key).astype(np.float64))
                if key + ".__scales__" in ut:
                    unit = np.ldexp(1.0, ut[key + ".__scales__"].view(np.uint8).astype(np.int64) - 127).repeat(32)
                    # the largest error of one block: E4M3's saturation 448..512 is 64 units, E2M1's 6..8 is 2
                    bound = unit[:gap.size] * (64 if enc == "mxfp8" else 2)
                else:
                    bound = np.abs(ut[key].astype(np.float64)) * 2 ** -23
                bound = bound + (gv * 2 ** -8 if dtype == "BF16" else gv * 2 ** -23)
                assert np.all(gap <= bound), (s, key, float(gap.max()))
            ratios.append(len(glob) / w.last_pull_bytes)
        st = d.get_json("/status")["downlink"]
        assert st["view_step"] == STEPS and st["updates_sent"] >= STEPS
        assert w.updates_applied == STEPS and w.view_downloads == 1 and w.fallbacks == 0
        print(f"\n{enc} {dtype}: global {len(glob)} B, update {st['last_update_bytes']} B, "
              f"a worker downloads {min(ratios):.2f}x-{max(ratios):.2f}x fewer bytes per round")
        if dtype == "F32":
            assert min(ratios) >= (3.5 if enc == "mxfp8" else 7.0), ratios
        assert d.stop() == 0
    finally:
        if d.alive():
            d.kill9()


# ---- catch-up, the updates kept, what is never served ------------------------------------------------
def test_catch_up_and_the_updates_kept(tmp_path):
    init = tmp_path / "init.safetensors"
    state = model_state(torch.float32)
    write_model(init, state)
    d = start(tmp_path, init, "--downlink", "mxfp8", "--updates-keep", "8")
    try:
        url = d.url
        pusher, m, g = diloco.Worker(url, "w1"), Module(state), torch.Generator().manual_seed(3)
        late, lm = diloco.Worker(url, "late", downlink=True), Module(state)

        def rounds(k, first):
            for s in range(first, first + k):
                pusher.pull(m)
                train(m, g)
                assert pusher.push(m, local_step=s).status == "accepted"
                wait_step(d, s)

        late.pull(lm)
        assert (late.step, late.view_downloads) == (0, 1)
        rounds(5, 1)
        late.pull(lm)              # 5 behind: 5 updates
        assert (late.step, late.updates_applied, late.view_downloads) == (5, 5, 1)
        assert late.view_bytes() == get(url, "/global/view.safetensors")[2]
        rounds(10, 6)              # 10 behind, 8 kept: the view
        late.pull(lm)
        assert (late.step, late.updates_applied, late.view_downloads) == (15, 5, 2)
        assert late.view_bytes() == get(url, "/global/view.safetensors")[2]
        # the last 8 updates are served, the one before is not, nor a step not committed
        assert get(url, "/global/updates/8.safetensors")[0] == 200
        code, _, body = get(url, "/global/updates/7.safetensors")
        assert code == 404 and json.loads(body)["error"]["code"] == "update_not_served"
        code, _, body = get(url, "/global/updates/16.safetensors")
        assert code == 404 and "not committed" in json.loads(body)["error"]["message"]
        for bad in ("/global/updates/016.safetensors", "/global/updates/x.safetensors", "/global/updates/15"):
            assert get(url, bad)[0] == 404
        # Range and ETag as for the global
        code, h, whole = get(url, "/global/updates/15.safetensors")
        code, h2, part = get(url, "/global/updates/15.safetensors", {"Range": "bytes=8-99"})
        assert code == 206 and part == whole[8:100]
        assert get(url, "/global/updates/15.safetensors", {"If-None-Match": h["ETag"]})[0] == 304
        # the state keeps the chain's last 8 updates only (cleanup after each durable step)
        d.wait_until(lambda: sorted(p.name for p in (d.state_dir / "global").glob("update-*")) ==
                     sorted(f"update-{k}.safetensors" for k in range(8, 16)), "the state's updates 8..15")
        assert d.stop() == 0
    finally:
        if d.alive():
            d.kill9()


def test_downlink_none_is_todays_server(tmp_path):
    init = tmp_path / "init.safetensors"
    write_model(init, model_state(torch.float32))
    d = start(tmp_path, init)
    try:
        code, _, body = get(d.url, "/global/view.safetensors")
        assert code == 404 and json.loads(body)["error"]["code"] == "no_downlink"
        sc = json.loads(get(d.url, "/global/step_count.json")[2])
        assert not {"view_file", "update_file", "view_hash"} & set(sc)
        assert "downlink" not in d.get_json("/status")
        with pytest.raises(ServerError, match="no_downlink"):
            diloco.Worker(d.url, "w1", downlink=True).pull(Module(model_state(torch.float32)))
        assert d.stop() == 0
    finally:
        if d.alive():
            d.kill9()


def test_refused_options(tmp_path):
    from conftest import run
    from conftest import BUILD
    dl = str(BUILD / "dilocod")
    r = run([dl, "--check-config", "--downlink", "int8_block"], check=2)
    assert "int8_block is uplink only" in r.stderr
    r = run([dl, "--check-config", "--expected-nodes", "1", "--downlink", "mxfp8", "--hub", "s3://bucket/p"], check=2)
    assert "--downlink E needs --hub none or --hub file://" in r.stderr
    r = run([dl, "--check-config", "--expected-nodes", "1", "--downlink", "mxfp8", "--hub", "none", "--publish-interval", "5"], check=2)
    assert "--publish-interval 0" in r.stderr


# ---- kill -9 in each state of the commit: view, update and global agree after the restart --------------
def state_agrees(d, step):
    """outer_metadata.json's view is the state's view file (its block hash), and view_step = view_{step-1}
    replayed with update_step, from the files the state holds."""
    meta = json.loads((d.state_dir / "outer_metadata.json").read_text())
    assert meta["outer_step"] == step
    g = d.state_dir / "global"
    view = (g / f"view-{step}.safetensors").read_bytes()
    assert meta["view"]["hash"] == block_hash(view) and meta["view"]["encoding"] == "mxfp8"
    return view, (g / f"update-{step}.safetensors").read_bytes()


@pytest.mark.parametrize("state", ["computing", "inputs_durable", "committed", "served", "durable"])
def test_kill9_in_each_state_leaves_view_update_and_global_agreeing(tmp_path, state):
    init = tmp_path / "init.safetensors"
    st = model_state(torch.float32)
    write_model(init, st)
    with socket.socket() as sk:        # one port for both runs: the upload cut by the kill retries into the restart
        sk.bind(("127.0.0.1", 0))
        port = sk.getsockname()[1]
    d = Dilocod(tmp_path, None, "--init-model", str(init), "--expected-nodes", "1", "--downlink", "mxfp8",
                "--listen", f"127.0.0.1:{port}", env={"DILOCOD_TEST_CRASH_AT": f"{state}:2"})
    d.start()
    try:
        pusher, m, g = diloco.Worker(d.url, "w1"), Module(st), torch.Generator().manual_seed(5)
        w, wm = diloco.Worker(d.url, "view", downlink=True), Module(st)
        views = {}
        for s in range(1, 5):
            pusher.pull(m)
            train(m, g)
            if s != 2:
                assert pusher.push(m, local_step=s).status == "accepted"
            else:
                # the kill may come before the upload's answer: it is retried into the restart
                up = threading.Thread(target=lambda: results.append(pusher.push(m, local_step=s).status))
                results = []
                up.start()
                d.wait_killed_at(state, 2)
                d.env = {}
                d.start()           # the cached delta is offered again, or the redo record recomputes
                up.join(120)
                assert results in (["accepted"], ["stale"]), results      # stale: step 2 was made from the cache
            wait_step(d, s)
            w.pull(wm)
            views[s] = get(d.url, "/global/view.safetensors")[2]
            assert w.step == s and w.view_bytes() == views[s], f"step {s} after a kill at {state}"
            if s >= 2:
                d.wait_until(lambda: d.durable_step() == s, f"step {s} durable")
                view, update = state_agrees(d, s)
                assert view == views[s]
                if s - 1 in views:
                    assert numpy_replay(views[s - 1], update) == view
        # committed by its redo record only: the restart made global, view and update again from it
        assert ("store: recovered step=2 " in d.logs[-1].read_text()) == (state in ("committed", "served"))
        # the worker that held step 1's view replayed every update after the kill, never the view again
        assert (w.view_downloads, w.fallbacks, w.updates_applied) == (1, 0, 3), (w.view_downloads, w.fallbacks)
        assert d.stop() == 0, d.log_text()[-3000:]
    finally:
        if d.alive():
            d.kill9()


# ---- file://: updates and view checkpoints in the tree ------------------------------------------------
def test_file_tree_updates_checkpoints_and_a_tampered_update(tmp_path):
    init, hub = tmp_path / "init.safetensors", tmp_path / "hub"
    st = model_state(torch.float32)
    write_model(init, st)
    d = Dilocod(tmp_path, hub, "--init-model", str(init), "--expected-nodes", "1", "--downlink", "mxfp4",
                "--updates-keep", "4")
    d.start()
    try:
        url = f"file://{hub}"
        pusher, m, g = diloco.Worker(url, "w1"), Module(st), torch.Generator().manual_seed(7)
        w, wm = diloco.Worker(url, "view", downlink=True), Module(st)
        d.wait_step(0)
        sc = json.loads((hub / "global/step_count.json").read_text())
        assert sc["view_file"] == "global/views/0.safetensors" and "update_file" not in sc
        for s in range(1, 9):
            pusher.pull(m)
            train(m, g)
            assert pusher.push(m, local_step=s).status == "written"
            d.wait_step(s)
            w.pull(wm)
            view = (d.state_dir / f"global/view-{s}.safetensors").read_bytes()
            assert w.step == s and w.view_bytes() == view, s
            sc = json.loads((hub / "global/step_count.json").read_text())
            assert sc["update_file"] == f"global/updates/{s}.safetensors" and sc["view_hash"] == block_hash(view)
            assert sc["view_file"] == f"global/views/{s - s % 2}.safetensors"     # a checkpoint every 4 / 2 steps
            assert (hub / "global/updates" / f"{s}.safetensors").read_bytes() == \
                (d.state_dir / f"global/update-{s}.safetensors").read_bytes()
        # pruned once step_count.json names step 8 (the same publish, just after it)
        d.wait_until(lambda: sorted(p.name for p in (hub / "global/updates").iterdir()) ==
                     [f"{k}.safetensors" for k in range(5, 9)] and
                     sorted(p.name for p in (hub / "global/views").iterdir()) == ["6.safetensors", "8.safetensors"],
                     "the tree's updates 5..8 and views 6 and 8")
        assert (w.view_downloads, w.updates_applied, w.fallbacks) == (1, 8, 0)
        # a joiner takes the newest checkpoint and replays what follows it
        j, jm = diloco.Worker(url, "joiner", downlink=True), Module(st)
        pusher.pull(m)
        train(m, g)
        pusher.push(m, local_step=9)
        d.wait_step(9)
        j.pull(jm)
        assert (j.step, j.view_downloads, j.updates_applied) == (9, 1, 1)
        assert j.view_bytes() == (d.state_dir / "global/view-9.safetensors").read_bytes()
        # a tampered update (one code byte flipped, its header intact) is refused by the view's block hash:
        # the worker 2 behind falls back to the view checkpoint of that step
        behind, bm = diloco.Worker(url, "behind", downlink=True), Module(st)
        behind.pull(bm)
        assert behind.step == 9

        def steps(*ks):
            d.start()
            for k in ks:
                pusher.pull(m)
                train(m, g)
                pusher.push(m, local_step=k)
                d.wait_step(k)
            assert d.stop() == 0    # nothing rewrites the tree while it is tampered with

        def tamper(k):
            u = hub / f"global/updates/{k}.safetensors"
            raw = bytearray(u.read_bytes())
            raw[-1] ^= 0x01
            u.write_bytes(raw)

        d.stop()
        (hub / "global/updates/9.safetensors").unlink()      # as if its publish had been skipped
        steps(10, 11)
        assert (hub / "global/updates/9.safetensors").read_bytes() == \
            (d.state_dir / "global/update-9.safetensors").read_bytes()          # a later publish puts it back
        tamper(10)                  # a checkpoint's step: the fallback needs no update
        behind.pull(bm)
        assert (behind.step, behind.fallbacks, behind.view_downloads) == (11, 1, 2)
        assert behind.view_bytes() == (d.state_dir / "global/view-11.safetensors").read_bytes()
        steps(12, 13)
        tamper(13)                  # after the checkpoint 12: the fallback replays it too, and refuses it
        before = {k: v.clone() for k, v in bm.state_dict().items()}
        with pytest.raises(HostileAnswer, match="block hash"):
            behind.pull(bm)
        assert all(torch.equal(before[k], v) for k, v in bm.state_dict().items())
    finally:
        if d.alive():
            d.kill9()


def test_async_mode_each_update_is_a_step_of_the_chain(tmp_path):
    """--mode async: every update the server commits is a step of the chain; the worker replays them."""
    init = tmp_path / "init.safetensors"
    st = model_state(torch.bfloat16)
    write_model(init, st)
    d = start(tmp_path, init, "--mode", "async", "--downlink", "mxfp8", "--grace-ms", "0")
    try:
        pushers = [diloco.Worker(d.url, f"w{i}") for i in range(2)]
        ms, g = [Module(st) for _ in range(2)], torch.Generator().manual_seed(9)
        w, wm = diloco.Worker(d.url, "view", downlink=True), Module(st)
        w.pull(wm)
        for s in range(1, 7):
            p, m = pushers[s % 2], ms[s % 2]
            p.pull(m)
            train(m, g)
            assert p.push(m, local_step=s).status == "accepted"
            wait_step(d, s)
            w.pull(wm)
            assert w.step == s and w.view_bytes() == get(d.url, "/global/view.safetensors")[2], s
        assert (w.view_downloads, w.updates_applied, w.fallbacks) == (1, 6, 0)
        assert d.stop() == 0
    finally:
        if d.alive():
            d.kill9()
