"""Compressed deltas (README, "Compressed deltas") against the numpy oracle (compress_oracle.py) and
torch.optim.SGD, bit for bit.

- Decoding: every E4M3 code and every E2M1 code under every finite E8M0 scale, and all 256 int8 codes
  under F32 scales from 0 and subnormals to the largest that cannot overflow, read back from the global
  of a plain SGD step (lr 1, momentum 0, a zero model: the global is -decoded).
- The encoder: diloco delta --encode, with and without --residual, three calls in a row: the codes,
  the scales and the residual equal the oracle's error feedback byte for byte.
- Rounds: four workers (F32, int8_block, mxfp8, mxfp4; over HTTP and file://) make their deltas with
  diloco delta --encode --residual; three Nesterov rounds equal torch on the decoded deltas.
- Hostile files: each refused with its reason (HTTP 422; file:// skipped), the service unharmed."""
import json
import subprocess
import urllib.error
import urllib.request

import numpy as np
import pytest
import torch
from safetensors import deserialize
from safetensors.torch import load as torch_load_bytes
from safetensors.torch import save as st_save

import compress_oracle as co
from conftest import BUILD
from dilocod_proc import Dilocod, Oracle, assert_state_equal, delta_metadata, write_model
from test_robust import norm_oracle
from test_torch_exact import torch_cpu_capability

pytestmark = pytest.mark.skipif(
    torch_cpu_capability() not in ("AVX2", "AVX512"),
    reason="torch fuses add(x, alpha=...) only in its AVX2/AVX-512 kernels (see test_torch_exact.py)")

LR, MU = 0.7, 0.9


def opener():
    return urllib.request.build_opener(urllib.request.ProxyHandler({}))


def put(d, node, local, body):
    req = urllib.request.Request(f"{d.url}/nodes/{node}/delta_{local}.safetensors", data=body, method="PUT")
    try:
        with opener().open(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def status(d):
    return d.get_json("/status") or {}


def record_of(d, step):
    return next((r for r in (d.get_json("/rounds") or {}).get("rounds", []) if r.get("outer_step") == step), None)


def wait_step(d, step, timeout=60):
    d.wait_until(lambda: status(d).get("outer_step") == step, f"step {step}", timeout=timeout)


def served(d):
    with opener().open(d.url + "/global/latest.safetensors", timeout=30) as r:
        return r.read()


def start(tmp_path, init, *args, hub=None):
    write_model(tmp_path / "init.safetensors", init)
    d = Dilocod(tmp_path, hub, "--init-model", str(tmp_path / "init.safetensors"), "--threads", "2", *args).start()
    wait_step(d, 0)
    return d


def read_raw(data):
    """{name: (dtype, shape, bytes)} of a safetensors file, by the reference's reader."""
    return {k: (v["dtype"], v["shape"], bytes(v["data"])) for k, v in deserialize(data)}


# ---- decoding -------------------------------------------------------------------------------------

def exhaustive_mx(enc):
    """Codes and scales holding every code of enc under every finite scale e (0..254), a code whose
    product would overflow (or is E4M3's NaN) replaced by code 0; one scale block per (e, 32 codes)."""
    table = co.E4M3 if enc == "mxfp8" else co.E2M1
    ncodes = 256 if enc == "mxfp8" else 16
    per_e = max(1, ncodes // 32)                          # scale blocks per e: 8 (E4M3), 1 (E2M1)
    codes = np.tile(np.arange(ncodes, dtype=np.uint8), (255, 32 * per_e // ncodes))
    e = np.repeat(np.arange(255, dtype=np.uint8), per_e)
    with np.errstate(over="ignore", invalid="ignore"):
        prod = table[codes].astype(np.float32) * np.repeat(co.E8M0[:255], 32 * per_e).reshape(255, -1)
    codes[~(np.abs(prod) < 2.0 ** 64)] = 0        # a delta's values are below 2^64 (README, "Delta rules")
    return codes, e


def test_decoding_is_the_oracle_for_every_code_and_scale(tmp_path):
    e4, s4 = exhaustive_mx("mxfp8")           # [255, 256] codes, 2040 scales
    e2, s2 = exhaustive_mx("mxfp4")           # [255, 32] codes, 255 scales
    assert (e4 != 0).sum() > 255 * 180 and set(np.unique(e4[:128])) == set(range(256)) - {0x7f, 0xff}
    q8 = np.tile(np.arange(-128, 128, dtype=np.int8), (64, 1))       # every int8 code, one block each row
    rng = np.random.default_rng(3)
    # the largest scales: -128 x scale stays below 2^64 in magnitude (README, "Delta rules")
    s8 = np.concatenate([[0.0, 1.4e-45, 1e-40, 1.1754944e-38, 1.0, 0.5, 3.0],
                         rng.uniform(1e-6, 10, 54), [1e15, np.nextafter(np.float32(2.0 ** 57), np.float32(0)),
                                                     np.float32(2.0 ** 56)]])
    s8 = s8.astype(np.float32)
    assert s8.size == 64
    init = {"e4m3": torch.zeros(255, 256), "e2m1": torch.zeros(255, 32), "i8": torch.zeros(64, 256)}
    d = start(tmp_path, init, "--optimizer", "sgd", "--lr", "1", "--momentum", "0", "--expected-nodes", "1")
    zeros = {k: np.zeros(tuple(v.shape), np.float32) for k, v in init.items()}
    rounds = [("mxfp8", 32, "e4m3", e4, s4), ("mxfp4", 32, "e2m1", co.pack_f4(e2), s2), ("int8_block", 256, "i8", q8, s8)]
    want = {k: torch.zeros(tuple(v.shape)) for k, v in init.items()}
    try:
        for step, (enc, block, key, codes, scales) in enumerate(rounds, 1):
            tensors = {k: ("F32", z.shape, z) for k, z in zeros.items() if k != key}
            tensors[key] = (co.CODE_DTYPE[enc], zeros[key].shape, codes)
            tensors[key + co.SUFFIX] = (co.SCALE_DTYPE[enc], (scales.size,), scales)
            body = co.serialize(tensors, dict(delta_metadata("w0", step - 1, step), encoding=enc, block=str(block)))
            code, resp = put(d, "w0", step, body)
            assert code == 201, resp
            wait_step(d, step)
            dec = co.decode(enc, codes, scales, block, zeros[key].shape)
            assert np.isfinite(dec).all()
            want[key] = torch.from_numpy((-dec + np.float32(0)).astype(np.float32))   # fma(-1, dec, 0)
            got = torch_load_bytes(served(d))
            assert_state_equal(got, want)
            rec = record_of(d, step)
            assert rec["nodes"][0]["intake_norm"] == norm_oracle(dict(zeros, **{key: dec})), rec
    finally:
        assert d.stop() == 0


# ---- the encoder ----------------------------------------------------------------------------------

def model(seed):
    g = torch.Generator().manual_seed(seed)
    return {"a.w": torch.randn(40, 13, generator=g),               # 520 values: a short last block
            "b.big": torch.randn(3, 4100, generator=g),            # 12300: past a checksum block
            "c.bf16": torch.randn(29, 7, generator=g).to(torch.bfloat16),   # 203, odd: plain for mxfp4
            "d.count": torch.tensor([3, 1], dtype=torch.int64)}


def f32_delta(base, cur):
    return {k: (base[k].to(torch.float32) - cur[k].to(torch.float32)).numpy() for k in base if base[k].is_floating_point()}


def diloco_delta(tmp, base, cur, node, bstep, lstep, out, *enc_args):
    write_model(tmp / "baseline.safetensors", base)
    write_model(tmp / "current.safetensors", cur)
    r = subprocess.run([str(BUILD / "diloco"), "delta", "--baseline", str(tmp / "baseline.safetensors"),
                        "--current", str(tmp / "current.safetensors"), "--node-id", node, "--base-step", str(bstep),
                        "--local-step", str(lstep), "-o", str(out), *enc_args], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return out.read_bytes()


def step_model(rng, state, scale):
    return {k: (v - torch.from_numpy((rng.standard_normal(tuple(v.shape)) * scale).astype(np.float32)).to(v.dtype)
                if v.is_floating_point() else v.clone()) for k, v in state.items()}


def check_file_against_oracle(data, enc, block, delta, residual):
    """data (diloco's output) against the oracle's error feedback from residual: -> (decoded, new R)."""
    raw = read_raw(data)
    dec, new_r = {}, {}
    for k, v in delta.items():
        if enc == "mxfp4" and v.size % 2:
            assert raw[k][0] == "F32" and k + co.SUFFIX not in raw       # plain: nothing left over
            dec[k] = np.frombuffer(raw[k][2], np.float32).reshape(v.shape)
            assert np.array_equal(dec[k].view(np.uint32), (v + residual[k]).astype(np.float32).view(np.uint32))
            new_r[k] = np.zeros_like(v)
            continue
        codes, scales, dk, rk = co.error_feedback(enc, block, v, residual[k])
        assert raw[k][:2] == (co.CODE_DTYPE[enc], list(v.shape)), (k, raw[k][:2])
        assert raw[k][2] == codes.tobytes(), f"{enc} {k}: codes differ from the oracle's"
        assert raw[k + co.SUFFIX][2] == scales.tobytes(), f"{enc} {k}: scales differ from the oracle's"
        dec[k], new_r[k] = dk, rk
    return dec, new_r


@pytest.mark.parametrize("enc,block", [("int8_block", 32), ("int8_block", 4096), ("mxfp8", 32), ("mxfp4", 32)])
def test_encoder_and_residual_equal_the_oracle(tmp_path, enc, block):
    rng = np.random.default_rng(11)
    base = model(1)
    residual = {k: np.zeros(tuple(v.shape), np.float32) for k, v in base.items() if v.is_floating_point()}
    rpath = tmp_path / "residual.safetensors"
    for call in range(3):
        cur = step_model(rng, base, 0.01 * (call + 1))
        delta = f32_delta(base, cur)
        data = diloco_delta(tmp_path, base, cur, "w1", call, call + 1, tmp_path / f"d{call}.safetensors",
                            "--encode", enc, "--block", str(block), "--residual", str(rpath))
        _, residual = check_file_against_oracle(data, enc, block, delta, residual)
        got = {k: (v[0], v[2]) for k, v in read_raw(rpath.read_bytes()).items()}
        assert set(got) == set(residual)
        for k, r in residual.items():
            assert got[k] == ("F32", r.tobytes()), f"call {call}: residual of {k} differs from the oracle's"
        verify = subprocess.run([str(BUILD / "diloco"), "verify", str(tmp_path / f"d{call}.safetensors"), "--against",
                                 str(tmp_path / "baseline.safetensors")], capture_output=True, text=True)
        assert verify.returncode == 0, verify.stderr
        alone = subprocess.run([str(BUILD / "diloco"), "verify", "--json", str(tmp_path / f"d{call}.safetensors")],
                               capture_output=True, text=True)
        assert alone.returncode == 0 and json.loads(alone.stdout)["encoding"] == enc, (alone.stdout, alone.stderr)
        inspect = subprocess.run([str(BUILD / "diloco"), "inspect", str(tmp_path / f"d{call}.safetensors")],
                                 capture_output=True, text=True)
        assert f"encoding: {enc}, block {block}:" in inspect.stdout, inspect.stdout
        base = cur
    # without --residual: plain encoding, no file left
    data = diloco_delta(tmp_path, base, step_model(rng, base, 0.01), "w1", 9, 10, tmp_path / "plain.safetensors",
                        "--encode", enc, "--block", str(block))
    assert json.loads(data[8:8 + int.from_bytes(data[:8], "little")])["__metadata__"]["encoding"] == enc
    # a residual left by another encoding is refused, not mixed in
    other = "mxfp8" if enc != "mxfp8" else "int8_block"
    r = subprocess.run([str(BUILD / "diloco"), "delta", "--baseline", str(tmp_path / "baseline.safetensors"),
                        "--current", str(tmp_path / "current.safetensors"), "--node-id", "w1", "--base-step", "0",
                        "--local-step", "1", "-o", str(tmp_path / "x.safetensors"), "--encode", other,
                        "--residual", str(rpath)], capture_output=True, text=True)
    assert r.returncode != 0 and "residual" in r.stderr and enc in r.stderr, r.stderr


# ---- rounds ---------------------------------------------------------------------------------------

WORKERS = {"w0": None, "w1": ("int8_block", 64), "w2": ("mxfp8", 32), "w3": ("mxfp4", 32)}


def worker_round(tmp, glob, rng, step, residual):
    """Every worker of WORKERS trains from glob and makes its delta for step with diloco delta (F32, or
    --encode with its residual), checked against the oracle's error feedback: -> ({node: file bytes},
    {node: decoded values}); residual is updated."""
    bodies, decoded = {}, {}
    for node, spec in WORKERS.items():
        wdir = tmp / node
        wdir.mkdir(exist_ok=True)
        cur = step_model(rng, glob, 0.01 * (1 + int(node[1])))
        delta = f32_delta(glob, cur)
        extra = [] if spec is None else ["--encode", spec[0], "--block", str(spec[1]),
                                          "--residual", str(wdir / "residual.safetensors")]
        bodies[node] = diloco_delta(wdir, glob, cur, node, step - 1, step, wdir / f"delta_{step}.safetensors", *extra)
        if spec is None:
            decoded[node] = delta
        else:
            decoded[node], residual[node] = check_file_against_oracle(bodies[node], spec[0], spec[1], delta,
                                                                      residual[node])
    return bodies, decoded


def test_rounds_mixing_encodings_equal_torch_over_http_and_file(tmp_path):
    """w0 sends F32 and w1 int8_block over HTTP; w2 (mxfp8) and w3 (mxfp4) write into the file:// tree.
    Each makes its delta with diloco delta from the global it trained from; three Nesterov rounds equal
    torch.optim.SGD on the decoded deltas, byte for byte, and the records name each node's encoding."""
    init = model(2)
    hub = tmp_path / "hub"
    hub.mkdir()
    d = start(tmp_path, init, "--expected-nodes", "4", "--lr", str(LR), "--momentum", str(MU), hub=hub)
    oracle = Oracle(init, lr=LR, momentum=MU)
    rng = np.random.default_rng(21)
    residual = {n: {k: np.zeros(tuple(v.shape), np.float32) for k, v in init.items() if v.is_floating_point()}
                for n in WORKERS}
    sent = {}
    try:
        for step in range(1, 4):
            bodies, decoded = worker_round(tmp_path, torch_load_bytes(served(d)), rng, step, residual)
            sent.update(bodies)
            for node, data in bodies.items():
                if node in ("w0", "w1"):
                    code, resp = put(d, node, step, data)
                    assert code == 201, resp
                else:
                    ndir = hub / "nodes" / node
                    ndir.mkdir(parents=True, exist_ok=True)
                    (ndir / f".tmp_{step}").write_bytes(data)
                    (ndir / f".tmp_{step}").rename(ndir / f"delta_{step}.safetensors")
            wait_step(d, step)
            want = oracle.step({n: {k: torch.from_numpy(v.copy()) for k, v in dd.items()} for n, dd in decoded.items()})
            raw = served(d)
            assert_state_equal(torch_load_bytes(raw), want)
            assert raw == st_save({k: v.contiguous() for k, v in want.items()})
            rec = record_of(d, step)
            for n in rec["nodes"]:
                assert n["intake_norm"] == norm_oracle(decoded[n["node_id"]]), n
                spec = WORKERS[n["node_id"]]
                assert (n.get("encoding"), n.get("block")) == ((spec[0], spec[1]) if spec else (None, None)), n
                assert n["bytes"] == len(sent[n["node_id"]]), n
        # /status and /metrics: each node's encoding and bytes on the wire
        workers = {w["node_id"]: w for w in status(d)["workers"]}
        metrics = opener().open(d.url + "/metrics", timeout=10).read().decode()
        for node, spec in WORKERS.items():
            enc = spec[0] if spec else "none"
            assert (workers[node]["encoding"], workers[node]["bytes"]) == (enc, len(sent[node])), workers[node]
            assert f'dilocod_node_delta_bytes{{node="{node}",encoding="{enc}"}} {len(sent[node])}' in metrics
        f32 = len(sent["w0"])
        assert len(sent["w1"]) < f32 / 3 and len(sent["w2"]) < f32 / 3 and len(sent["w3"]) < f32 / 1.9, \
            {n: len(b) for n, b in sent.items()}
        assert 'dilocod_deltas_by_encoding_total{encoding="mxfp4"} 3' in metrics
    finally:
        assert d.stop() == 0


# ---- hostile files --------------------------------------------------------------------------------

def hostile_cases(init):
    """(name, body, expected error code, a word of the message) for a model of init's keys."""
    zeros = {k: np.zeros(tuple(v.shape), np.float32) for k, v in init.items() if v.is_floating_point()}
    meta = delta_metadata("w1", 0, 1)
    good, _ = co.compressed_delta("mxfp8", 32, zeros, meta)
    parts = read_raw(good)

    def rebuild(mutate, enc="mxfp8", block="32", metadata=None):
        t = {k: [dt, list(shape), np.frombuffer(b, np.uint8).copy()] for k, (dt, shape, b) in parts.items()}
        mutate(t)
        m = dict(meta, encoding=enc, block=block) if metadata is None else metadata
        return co.serialize({k: (dt, shape, a) for k, (dt, shape, a) in t.items()}, m)

    def set_(key, i, value):
        return lambda t: t[key][2].__setitem__(i, value)

    def few_scales(t):
        t["a.w" + co.SUFFIX][1] = [t["a.w" + co.SUFFIX][1][0] - 1]
        t["a.w" + co.SUFFIX][2] = t["a.w" + co.SUFFIX][2][:-1]

    def overflow(t):
        t["a.w" + co.SUFFIX][2][0] = 254                 # 2^127
        t["a.w"][2][0] = 0x7e                            # 448: 448 * 2^127 overflows F32

    def int8_parts(scale):
        q = np.full(520, 3, np.int8)
        return co.serialize({"a.w": ("I8", [40, 13], q), "a.w" + co.SUFFIX: ("F32", [17], np.full(17, scale, np.float32)),
                             "b.big": ("F32", [3, 4100], zeros["b.big"]), "c.bf16": ("F32", [29, 7], zeros["c.bf16"])},
                            dict(meta, encoding="int8_block", block="32"))

    return [
        ("a wrong scale count", rebuild(few_scales), "shape_mismatch", "scales must have shape"),
        ("the E8M0 NaN scale", rebuild(set_("b.big" + co.SUFFIX, 5, 0xff)), "non_finite", "decode"),
        ("an E4M3 NaN code", rebuild(set_("b.big", 77, 0x7f)), "non_finite", "decode"),
        ("a product that overflows", rebuild(overflow), "non_finite", "overflows"),
        ("a NaN int8 scale", int8_parts(np.nan), "non_finite", "decode"),
        ("a negative int8 scale", int8_parts(-1.0), "non_finite", "negative"),
        ("a huge block", rebuild(lambda t: None, block="1099511627776"), "metadata_invalid", "block"),
        ("a block that is not a power of two", rebuild(lambda t: None, enc="int8_block", block="48"),
         "metadata_invalid", "power of two"),
        ("mx with another block", rebuild(lambda t: None, block="64"), "metadata_invalid", "32"),
        ("an unknown encoding", rebuild(lambda t: None, enc="fp2"), "metadata_invalid", "encoding"),
        ("codes without their scales", rebuild(lambda t: t.pop("a.w" + co.SUFFIX)), "key_mismatch", "scales"),
        ("scales without codes", rebuild(lambda t: t.__setitem__("c.bf16", ["F32", [29, 7], zeros["c.bf16"].view(np.uint8)])),
         "key_mismatch", "no mxfp8 codes"),
        ("codes of another encoding", rebuild(lambda t: None, enc="int8_block", block="32"), "dtype_mismatch", "F8_E4M3"),
        ("codes without an encoding", rebuild(lambda t: None, metadata=meta), "dtype_mismatch", "F8_E4M3"),
    ]


def odd_f4_file(meta):
    """An F4 tensor of 3 values (12 bits): the reference's writer cannot make it, so the header is
    written by hand.  The format itself refuses it (MisalignedSlice)."""
    header = {"__metadata__": dict(meta, encoding="mxfp4", block="32"),
              "x": {"dtype": "F4", "shape": [3], "data_offsets": [0, 2]},
              "x" + co.SUFFIX: {"dtype": "F8_E8M0", "shape": [1], "data_offsets": [2, 3]}}
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-(8 + len(h)) % 8)
    return len(h).to_bytes(8, "little") + h + bytes([0x11, 0x01, 127])


def test_hostile_compressed_files_are_refused_with_their_reason(tmp_path):
    init = model(3)
    hub = tmp_path / "hub"
    hub.mkdir()
    d = start(tmp_path, init, "--expected-nodes", "2", hub=hub)
    try:
        for name, body, code_name, word in hostile_cases(init):
            code, resp = put(d, "w1", 1, body)
            assert code == 422, (name, resp)
            assert resp["error"]["code"] == code_name and word in resp["error"]["message"], (name, resp)
        code, resp = put(d, "w1", 1, odd_f4_file(delta_metadata("w1", 0, 1)))
        # the container's own rule (a 400, as every malformed safetensors file)
        assert code == 400 and resp["error"]["code"] == "misaligned_slice" and "F4" in resp["error"]["message"], resp
        # the same refusals from the file:// tree: skipped with the reason, the round still open
        cases = hostile_cases(init)
        (hub / "nodes" / "w2").mkdir(parents=True)
        (hub / "nodes" / "w2" / "delta_1.safetensors").write_bytes(cases[3][1])      # the overflow
        d.wait_log("decode to a non-finite value")
        st = status(d)
        assert st["outer_step"] == 0 and st["round"]["received"] == [] and d.alive(), st["round"]
        # diloco verify refuses them the same way
        bad = tmp_path / "bad.safetensors"
        bad.write_bytes(cases[1][1])                                                 # the NaN scale
        write_model(tmp_path / "global.safetensors", init)
        v = subprocess.run([str(BUILD / "diloco"), "verify", "--json", str(bad), "--against",
                            str(tmp_path / "global.safetensors")], capture_output=True, text=True)
        assert v.returncode == 1 and json.loads(v.stdout)["error"]["code"] == "non_finite", (v.stdout, v.stderr)
        # and a good compressed delta after them all is taken
        good, _ = co.compressed_delta("mxfp4", 32, {k: np.full(tuple(v.shape), 0.01, np.float32)
                                                     for k, v in init.items() if v.is_floating_point()},
                                      delta_metadata("w1", 0, 1), plain=("c.bf16",))
        code, resp = put(d, "w1", 1, good)
        assert code == 201, resp
    finally:
        assert d.stop() == 0


def test_a_model_with_a_scales_like_key_takes_plain_deltas_only(tmp_path):
    init = {"w": torch.zeros(64), "w" + co.SUFFIX: torch.zeros(2)}
    d = start(tmp_path, init, "--expected-nodes", "1")
    try:
        body, _ = co.compressed_delta("mxfp8", 32, {"w": np.zeros(64, np.float32)}, delta_metadata("w1", 0, 1))
        code, resp = put(d, "w1", 1, body)
        assert code == 422 and resp["error"]["code"] == "key_mismatch" and "reserve" in resp["error"]["message"], resp
        plain = st_save({"w": torch.zeros(64), "w" + co.SUFFIX: torch.zeros(2)}, metadata=delta_metadata("w1", 0, 1))
        code, resp = put(d, "w1", 1, plain)
        assert code == 201, resp
    finally:
        assert d.stop() == 0


def test_compressed_deltas_in_async_mode(tmp_path):
    """--mode async with a grace window: each update's batch (int8_block, mxfp8 and mxfp4, sent in that
    order) is decoded and aggregated, then Delayed Nesterov; every update equals the async oracle fed the
    decoded deltas, and median composes with it."""
    from test_async import AsyncOracle
    from test_robust import rule_oracle
    init = model(4)
    oracle = AsyncOracle(init, 2, lr=LR, mu=MU)
    d = start(tmp_path, init, "--mode", "async", "--expected-nodes", "3", "--dn-period", "2", "--grace-ms", "1500",
              "--lr", str(LR), "--momentum", str(MU), "--aggregate", "median")
    encs = {"w0": ("int8_block", 128), "w1": ("mxfp8", 32), "w2": ("mxfp4", 32)}
    rng = np.random.default_rng(23)
    try:
        for step in range(3):
            batch = {}
            for node, (enc, block) in encs.items():
                delta = {k: (rng.standard_normal(tuple(v.shape)) * 0.01).astype(np.float32)
                         for k, v in init.items() if v.is_floating_point()}
                plain = tuple(k for k, v in delta.items() if enc == "mxfp4" and v.size % 2)
                body, batch[node] = co.compressed_delta(enc, block, delta, delta_metadata(node, step, step + 1), plain)
                code, resp = put(d, node, step + 1, body)
                assert code == 201, resp
            wait_step(d, step + 1)
            rec = record_of(d, step + 1)
            assert [n["node_id"] for n in rec["nodes"]] == ["w0", "w1", "w2"], rec
            oracle.update([batch[n] for n in ("w0", "w1", "w2")], rec["weight"],
                          aggregate=lambda xs: rule_oracle("median", xs))
            raw = served(d)
            assert raw == st_save({k: v.contiguous() for k, v in oracle.state.items()})
    finally:
        assert d.stop() == 0


# ---- sharded compressed sets ----------------------------------------------------------------------

def compressed_set(enc, block, delta, meta, groups):
    """A sharded compressed delta as huggingface_hub lays a set out: shards delta_<n>-0000i-of-0000N
    holding the keys of groups[i] (each key with its scales), and the index with the delta metadata
    (encoding and block too) and total_size.  -> ({file name: bytes}, {key: decoded})."""
    local = meta["local_step"]
    files, decoded, weight_map, total = {}, {}, {}, 0
    n = len(groups)
    for i, keys in enumerate(groups):
        name = f"delta_{local}-{i + 1:05d}-of-{n:05d}.safetensors"
        tensors = {}
        for k in keys:
            v = np.asarray(delta[k], dtype=np.float32)
            codes, scales = co.encode(enc, v, block)
            tensors[k] = (co.CODE_DTYPE[enc], v.shape, codes)
            tensors[k + co.SUFFIX] = (co.SCALE_DTYPE[enc], (scales.size,), scales)
            decoded[k] = co.decode(enc, codes, scales, block, v.shape)
            for t in (k, k + co.SUFFIX):
                weight_map[t] = name
                total += np.asarray(tensors[t][2]).nbytes
        files[name] = co.serialize(tensors, {"format": "pt"})
    index = {"metadata": dict(meta, encoding=enc, block=str(block), total_size=total), "weight_map": weight_map}
    files[f"delta_{local}.safetensors.index.json"] = json.dumps(index).encode()
    return files, decoded


def put_file(d, node, name, body):
    req = urllib.request.Request(f"{d.url}/nodes/{node}/{name}", data=body, method="PUT")
    try:
        with opener().open(req, timeout=30) as r:
            return r.status, json.loads(r.read() or b"null")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_sharded_compressed_sets_over_http_and_file(tmp_path):
    """Two nodes send sharded compressed sets (each key's codes and scales in one shard): w1 uploads its
    shards and then its index over HTTP, w2 writes its set into the file:// tree; a third sends one file.
    The round equals torch on the decoded deltas, the records' intake norms are the decoded deltas'; a set
    that splits a key's codes from its scales is refused, naming the rule."""
    init = {"a.w": torch.randn(40, 16, generator=torch.Generator().manual_seed(3)),
            "b.big": torch.randn(3, 4100, generator=torch.Generator().manual_seed(4)),
            "c.v": torch.randn(64, generator=torch.Generator().manual_seed(5))}
    hub = tmp_path / "hub"
    hub.mkdir()
    d = start(tmp_path, init, "--expected-nodes", "3", "--lr", str(LR), "--momentum", str(MU), hub=hub)
    oracle = Oracle(init, lr=LR, momentum=MU)
    rng = np.random.default_rng(31)
    delta = {n: {k: (rng.standard_normal(tuple(v.shape)) * 0.01).astype(np.float32) for k, v in init.items()}
             for n in ("w0", "w1", "w2")}
    try:
        # a set whose b.big codes and scales are in two shards: refused at the index
        files, _ = compressed_set("mxfp8", 32, delta["w1"], delta_metadata("w1", 0, 1), [["a.w", "b.big", "c.v"]])
        shard = read_raw(files["delta_1-00001-of-00001.safetensors"])
        split = {"delta_1-00001-of-00002.safetensors": co.serialize({k: (dt, s, np.frombuffer(b, np.uint8))
                                                                   for k, (dt, s, b) in shard.items() if k != "b.big.__scales__"}),
                 "delta_1-00002-of-00002.safetensors": co.serialize({"b.big.__scales__": (shard["b.big.__scales__"][0], shard["b.big.__scales__"][1],
                                                                                         np.frombuffer(shard["b.big.__scales__"][2], np.uint8))})}
        code, resp = put_file(d, "w1", "delta_1-00001-of-00002.safetensors", split["delta_1-00001-of-00002.safetensors"])
        assert code == 422 and "one shard" in resp["error"]["message"], resp
        # w1 over HTTP: shards first, the index last
        files, dec1 = compressed_set("mxfp4", 32, delta["w1"], delta_metadata("w1", 0, 1), [["a.w", "c.v"], ["b.big"]])
        for name, body in files.items():
            code, resp = put_file(d, "w1", name, body)
            assert code in (201, 202), (name, code, resp)
        # w2 into the tree: shards, then the index
        files2, dec2 = compressed_set("int8_block", 64, delta["w2"], delta_metadata("w2", 0, 1), [["b.big"], ["a.w", "c.v"]])
        ndir = hub / "nodes" / "w2"
        ndir.mkdir(parents=True)
        for name, body in files2.items():
            (ndir / f".{name}.tmp").write_bytes(body)
            (ndir / f".{name}.tmp").rename(ndir / name)
        # w0: one mxfp8 file
        body0, dec0 = co.compressed_delta("mxfp8", 32, delta["w0"], delta_metadata("w0", 0, 1))
        code, resp = put(d, "w0", 1, body0)
        assert code == 201, resp
        wait_step(d, 1)
        decoded = {"w0": dec0, "w1": dec1, "w2": dec2}
        want = oracle.step({n: {k: torch.from_numpy(v.copy()) for k, v in dd.items()} for n, dd in decoded.items()})
        assert served(d) == st_save({k: v.contiguous() for k, v in want.items()})
        rec = record_of(d, 1)
        for n in rec["nodes"]:
            assert n["intake_norm"] == norm_oracle(decoded[n["node_id"]]), n
        assert {n["node_id"]: n.get("encoding") for n in rec["nodes"]} == {"w0": "mxfp8", "w1": "mxfp4", "w2": "int8_block"}
    finally:
        assert d.stop() == 0


def test_diloco_writes_a_sharded_compressed_set_that_dilocod_takes(tmp_path):
    """diloco delta --encode mxfp8 --shard-size: a set whose every shard holds whole keys (codes and
    scales together), diloco verify passes it, and dilocod takes it from the file:// tree: the round
    equals torch on its decoded values."""
    init = model(9)
    hub = tmp_path / "hub"
    hub.mkdir()
    d = start(tmp_path, init, "--expected-nodes", "1", "--lr", str(LR), "--momentum", str(MU), hub=hub)
    try:
        cur = step_model(np.random.default_rng(5), init, 0.01)
        wdir = tmp_path / "w1"
        wdir.mkdir()
        out = tmp_path / "set" / "delta_1.safetensors"
        out.parent.mkdir()
        write_model(wdir / "baseline.safetensors", init)
        write_model(wdir / "current.safetensors", cur)
        r = subprocess.run([str(BUILD / "diloco"), "delta", "--baseline", str(wdir / "baseline.safetensors"), "--current",
                            str(wdir / "current.safetensors"), "--node-id", "w1", "--base-step", "0", "--local-step", "1",
                            "-o", str(out), "--encode", "mxfp8", "--shard-size", "6000"], capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        index = json.loads((out.parent / "delta_1.safetensors.index.json").read_text())
        shards = sorted(set(index["weight_map"].values()))
        assert len(shards) >= 2, shards
        assert index["metadata"]["encoding"] == "mxfp8"
        for k, shard in index["weight_map"].items():
            if k.endswith(co.SUFFIX):
                assert index["weight_map"][k[:-len(co.SUFFIX)]] == shard, (k, shard)
        v = subprocess.run([str(BUILD / "diloco"), "verify", str(out.parent / "delta_1.safetensors.index.json"),
                            "--against", str(wdir / "baseline.safetensors")], capture_output=True, text=True)
        assert v.returncode == 0, v.stderr
        decoded = {}
        for name in shards:
            raw = read_raw((out.parent / name).read_bytes())
            for k, (dt, shape, b) in raw.items():
                if k.endswith(co.SUFFIX):
                    continue
                if dt == "F32":
                    decoded[k] = np.frombuffer(b, np.float32).reshape(shape)
                else:
                    decoded[k] = co.decode("mxfp8", np.frombuffer(b, np.uint8), np.frombuffer(raw[k + co.SUFFIX][2], np.uint8),
                                           32, tuple(shape))
        ndir = hub / "nodes" / "w1"
        ndir.mkdir(parents=True)
        for name in shards + ["delta_1.safetensors.index.json"]:
            (ndir / f".{name}").write_bytes((out.parent / name).read_bytes())
            (ndir / f".{name}").rename(ndir / name)
        wait_step(d, 1)
        want = Oracle(init, lr=LR, momentum=MU).step({"w1": {k: torch.from_numpy(v.copy()) for k, v in decoded.items()}})
        assert served(d) == st_save({k: v.contiguous() for k, v in want.items()})
    finally:
        assert d.stop() == 0


def test_encoder_refusals_leave_nothing_behind(tmp_path):
    """diloco delta --encode refuses a non-finite delta and a residual of another shape, leaving no
    temporary file next to OUT or R and the previous residual untouched."""
    base = {"w": torch.tensor([[1.0, float("inf"), 0.5]]), "v": torch.zeros(2, 3)}
    cur = {"w": torch.zeros(1, 3), "v": torch.ones(2, 3)}
    write_model(tmp_path / "a.safetensors", base)
    write_model(tmp_path / "b.safetensors", cur)
    rpath = tmp_path / "r.safetensors"

    def encode(*extra):
        return subprocess.run([str(BUILD / "diloco"), "delta", "--baseline", str(tmp_path / "a.safetensors"),
                               "--current", str(tmp_path / "b.safetensors"), "--node-id", "w1", "--base-step", "0",
                               "--local-step", "1", "-o", str(tmp_path / "out.safetensors"), "--encode", "int8_block",
                               "--residual", str(rpath), *extra], capture_output=True, text=True)

    r = encode()
    assert r.returncode == 1 and "non_finite" in r.stderr, r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.safetensors", "b.safetensors"]
    base["w"] = torch.tensor([[1.0, 2.0, 0.5]])
    write_model(tmp_path / "a.safetensors", base)
    from safetensors.torch import save_file
    save_file({"w": torch.zeros(3, 1), "v": torch.zeros(2, 3)}, str(rpath), metadata={"encoding": "int8_block", "block": "32"})
    before = rpath.read_bytes()
    r = encode()
    assert r.returncode == 1 and "residual" in r.stderr and "does not match" in r.stderr, r.stderr
    assert rpath.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.safetensors", "b.safetensors", "r.safetensors"]
