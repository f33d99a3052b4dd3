"""The pseudo-gradient rules (server/README.md, "Semantics in full (the delta rules)") checked end to end:
`diloco delta`, `diloco average` and `diloco verify` against numpy/torch oracles, on files written
and read by the real `safetensors` package.

  delta    = float32(baseline) - float32(current) for floating keys (C64 as complex F32 pairs),
             non-floating keys omitted, metadata algorithm/base_outer_step/local_step/node_id;
  average  = acc = float32(d0); acc += float32(dk) in the given order; acc /= float32(n);
  verify   = every validation failure has its stable error code.
"""
import json

import numpy as np
import pytest
import torch
import safetensors.numpy as stnp
import safetensors.torch as stt
from safetensors import safe_open

from conftest import run

BITS_VIEW = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
FLOAT_NP = (np.float16, np.float32, np.float64, np.complex64)


# ---------------------------------------------------------------------------------------------------
# helpers

def finite_bits(rng, dtype, shape):
    """Random values of a 16-bit float format over the whole range a delta may hold (README, "Delta
    rules": finite and of magnitude below 2^64; subnormals, -0.0 included), as raw uint16 bits.
    dtype: 'f16' (all of its finite range) or 'bf16'."""
    n = int(np.prod(shape, dtype=np.int64))
    bits = rng.integers(0, 1 << 16, size=n, dtype=np.uint32).astype(np.uint16)
    bound = 0x7C00 if dtype == "f16" else 0x5F80
    bad = (bits & 0x7FFF) >= bound
    bits[bad] &= np.uint16(0xBFFF)    # clear the top exponent bit (bit 14 in both formats)
    assert not np.any((bits & 0x7FFF) >= bound)
    return bits.reshape(shape)


def rand_f16(rng, shape):
    return finite_bits(rng, "f16", shape).view(np.float16)


def rand_bf16(rng, shape):
    return torch.from_numpy(finite_bits(rng, "bf16", shape).view(np.int16).copy()).view(torch.bfloat16)


def rand_f32(rng, shape, spread=20):
    """Finite float32 values over many binades (so rounding and summation order matter), with
    subnormals, zeros of both signs."""
    n = int(np.prod(shape, dtype=np.int64))
    v = rng.standard_normal(n) * np.exp2(rng.integers(-spread, spread, size=n))
    v = v.astype(np.float32)
    if n >= 4:
        v[0] = np.float32(1e-41)      # subnormal
        v[1] = np.float32(-0.0)
        v[2] = np.float32(0.0)
    return v.reshape(shape)


def rand_f64(rng, shape):
    """Finite doubles whose float32 rounding is non-trivial, including values that become float32
    subnormals."""
    n = int(np.prod(shape, dtype=np.int64))
    v = rng.standard_normal(n) * np.exp2(rng.integers(-30, 30, size=n).astype(np.float64))
    if n >= 3:
        v[0] = 3e-42
        v[1] = -1.0000000596046448    # halfway between two float32 neighbours of -1
        v[2] = 1 + 2.0 ** -24 + 2.0 ** -40
    return v.reshape(shape)


def rand_c64(rng, shape):
    re_, im = rand_f32(rng, shape), rand_f32(rng, shape)
    return (re_.astype(np.complex64) + 1j * im.astype(np.complex64)).astype(np.complex64)


def to_f32(v):
    """float32(v) as the reference computes it (torch for bfloat16)."""
    if isinstance(v, torch.Tensor):
        return v.float().numpy()
    return v.astype(np.float32)


def is_floating(v):
    if isinstance(v, torch.Tensor):
        return v.is_floating_point() or v.is_complex()
    return v.dtype.type in FLOAT_NP


def save_state(path, state, metadata=None):
    """Writes state (numpy arrays and/or torch tensors) with the real safetensors package: the numpy
    front-end when it can, the torch front-end when a torch tensor (bfloat16) is present."""
    if any(isinstance(v, torch.Tensor) for v in state.values()):
        # (np.ascontiguousarray would turn a 0-d array into shape (1,))
        tstate = {k: v if isinstance(v, torch.Tensor) else torch.from_numpy(np.array(v, order="C", copy=True))
                  for k, v in state.items()}
        stt.save_file(tstate, str(path), metadata=metadata)
    else:
        stnp.save_file({k: np.array(v, order="C", copy=True) for k, v in state.items()}, str(path),
                       metadata=metadata)
    return path


def file_metadata(path):
    with safe_open(str(path), framework="np") as f:
        return f.metadata()


def assert_bits_equal(got, want, label):
    assert got.dtype == want.dtype, f"{label!r}: dtype {got.dtype} != expected {want.dtype}"
    assert got.shape == want.shape, f"{label!r}: shape {got.shape} != expected {want.shape}"
    view = BITS_VIEW[want.dtype.itemsize]
    gf, wf = np.array(got, order="C").reshape(-1), np.array(want, order="C").reshape(-1)
    g, w = gf.view(view), wf.view(view)
    if not np.array_equal(g, w):
        idx = np.flatnonzero(g != w)[:5]
        raise AssertionError(
            f"{label!r}: {int(np.count_nonzero(g != w))} values differ, first at flat {idx.tolist()}: "
            f"got {gf[idx].tolist()} (bits {[hex(int(x)) for x in g[idx]]}), "
            f"expected {wf[idx].tolist()} (bits {[hex(int(x)) for x in w[idx]]})")


def error_code_in(p, code):
    """The error code is reported (stderr line or JSON on stdout)."""
    text = p.stdout + p.stderr
    assert code in text, f"expected error code {code!r}; exit {p.returncode}\nstdout: {p.stdout}\nstderr: {p.stderr}"


def model_state(seed, with_bf16=True):
    """(baseline, current) of a small model: F32/F16/F64/C64 weights, BF16 (torch), I64 and BOOL buffers.
    current differs from baseline like a few steps of training would (and keeps some equal elements)."""
    rng = np.random.default_rng(seed)
    base = {
        "layers.0.attn.weight": rand_f32(rng, (16, 12)),
        "layers.0.attn.bias": rand_f32(rng, (12,)),
        "layers.1.mlp.weight": rand_f32(rng, (3, 4, 5)),
        "norm.scale": rand_f32(rng, ()),
        "empty.weight": rand_f32(rng, (0, 4)),
        "embed.weight": rand_f16(rng, (10, 8)),
        "head.weight": rand_f64(rng, (6, 7)),
        "rotary.freqs": rand_c64(rng, (4, 3)),
        "bn.num_batches_tracked": np.array(rng.integers(0, 1 << 40), dtype=np.int64),
        "bn.counts": rng.integers(-(1 << 62), 1 << 62, size=(5,), dtype=np.int64),
        "attn.mask": rng.integers(0, 2, size=(4, 4)).astype(np.bool_),
    }
    cur = {}
    for k, v in base.items():
        if v.dtype == np.float16:
            c = rand_f16(rng, v.shape)
        elif v.dtype == np.float32:
            c = (v + rand_f32(rng, v.shape, spread=8)).astype(np.float32)
        elif v.dtype == np.float64:
            c = v + rand_f64(rng, v.shape) * 1e-3
        elif v.dtype == np.complex64:
            c = (v + rand_c64(rng, v.shape)).astype(np.complex64)
        elif v.dtype == np.bool_:
            c = ~v
        else:
            c = v + 1
        c = np.asarray(c, dtype=v.dtype)
        if c.size >= 2:
            c.reshape(-1)[-1] = v.reshape(-1)[-1]     # an unchanged element: delta +0.0
        cur[k] = c
    if with_bf16:
        base["ln_f.weight"] = rand_bf16(rng, (9, 2))
        cur["ln_f.weight"] = rand_bf16(rng, (9, 2))
        base["ln_f.bias"] = rand_bf16(rng, ())
        cur["ln_f.bias"] = base["ln_f.bias"].clone()
    return base, cur


def expected_delta(base, cur):
    out = {}
    for k, b in base.items():
        if not is_floating(b):
            continue
        c = cur[k]
        if not isinstance(b, torch.Tensor) and b.dtype == np.complex64:
            # complex as pairs of F32: lane-wise F32 subtraction
            out[k] = (b.view(np.float32) - c.view(np.float32)).view(np.complex64)
        else:
            out[k] = to_f32(b) - to_f32(c)
    return out


# ---------------------------------------------------------------------------------------------------
# diloco delta

@pytest.mark.parametrize("front_end", ["numpy", "torch-bf16"])
@pytest.mark.parametrize("seed", [101, 102, 103])
def test_delta_matches_numpy(diloco_bin, tmp_path, seed, front_end):
    base, cur = model_state(seed, with_bf16=front_end == "torch-bf16")
    a = save_state(tmp_path / "baseline.safetensors", base)
    b = save_state(tmp_path / "current.safetensors", cur)
    out = tmp_path / "delta.safetensors"
    node, bstep, lstep = f"worker-{seed}", str(seed % 7), str(500 + seed)
    run([diloco_bin, "delta", "--baseline", a, "--current", b, "--node-id", node, "--base-step", bstep,
         "--local-step", lstep, "-o", out], check=0)

    got = stnp.load_file(str(out))
    want = expected_delta(base, cur)
    assert sorted(got) == sorted(want), f"delta keys {sorted(got)} != floating keys {sorted(want)}"
    for k, w in want.items():
        want_dtype = np.complex64 if w.dtype == np.complex64 else np.float32
        assert got[k].dtype == want_dtype, f"{k!r}: delta dtype {got[k].dtype}, expected {np.dtype(want_dtype)}"
        assert_bits_equal(got[k], w, k)
    meta = file_metadata(out)
    assert meta == {"algorithm": "dumb_diloco", "base_outer_step": bstep, "local_step": lstep, "node_id": node}, meta

    # the delta it wrote is one dilocod accepts for this model at its Hub path
    p = run([diloco_bin, "verify", out, "--against", a, "--path", f"nodes/{node}/delta_{lstep}.safetensors",
             "--json"], check=0)
    assert json.loads(p.stdout) == {"valid": True, "node_id": node, "base_outer_step": int(bstep),
                                    "local_step": int(lstep)}, p.stdout


def test_delta_of_identical_states_is_zero(diloco_bin, tmp_path):
    base, _ = model_state(7)
    a = save_state(tmp_path / "a.safetensors", base)
    out = tmp_path / "d.safetensors"
    run([diloco_bin, "delta", "--baseline", a, "--current", a, "--node-id", "n", "--base-step", "0",
         "--local-step", "0", "-o", out], check=0)
    got = stnp.load_file(str(out))
    for k, v in got.items():
        assert_bits_equal(v, np.zeros_like(v), k)   # x - x is +0.0, never -0.0


def _drop(key):
    def f(s):
        del s[key]
    return f


def _add(key, value):
    def f(s):
        s[key] = value
    return f


def _rename(old, new):
    def f(s):
        s[new] = s.pop(old)
    return f


def _set(key, fn):
    def f(s):
        s[key] = fn(s[key])
    return f


DELTA_MISMATCHES = {
    "current-lacks-floating-key": ("key_mismatch", _drop("layers.0.attn.bias")),
    "current-lacks-int-buffer": ("key_mismatch", _drop("bn.num_batches_tracked")),
    "current-extra-key": ("key_mismatch", _add("extra.weight", np.zeros(3, np.float32))),
    "current-extra-int-key": ("key_mismatch", _add("extra.count", np.zeros((), np.int64))),
    "current-renamed-key": ("key_mismatch", _rename("head.weight", "head.weight2")),
    "transposed": ("shape_mismatch", _set("layers.0.attn.weight", lambda v: np.ascontiguousarray(v.T))),
    "scalar-vs-1": ("shape_mismatch", _set("norm.scale", lambda v: v.reshape(1))),
    "empty-shape": ("shape_mismatch", _set("empty.weight", lambda v: np.zeros((0, 5), np.float32))),
    "extra-dim": ("shape_mismatch", _set("layers.0.attn.bias", lambda v: v.reshape(12, 1))),
    "buffer-shape": ("shape_mismatch", _set("bn.counts", lambda v: v[:4].copy())),
    "float-vs-int": ("dtype_mismatch", _set("layers.0.attn.bias", lambda v: v.astype(np.int32))),
    "complex-vs-float": ("dtype_mismatch", _set("rotary.freqs", lambda v: v.real.astype(np.float32).copy())),
}


@pytest.mark.parametrize("case", list(DELTA_MISMATCHES))
def test_delta_mismatch(diloco_bin, tmp_path, case):
    code, mutate = DELTA_MISMATCHES[case]
    base, cur = model_state(200, with_bf16=False)
    mutate(cur)
    a = save_state(tmp_path / "baseline.safetensors", base)
    b = save_state(tmp_path / "current.safetensors", cur)
    out = tmp_path / "delta.safetensors"
    p = run([diloco_bin, "delta", "--baseline", a, "--current", b, "--node-id", "w", "--base-step", "1",
             "--local-step", "2", "-o", out])
    assert p.returncode == 1, f"exit {p.returncode}, expected 1\nstderr: {p.stderr}"
    error_code_in(p, code)
    assert not out.exists(), "a rejected delta must not be written"
    # the other direction is rejected the same way
    p = run([diloco_bin, "delta", "--baseline", b, "--current", a, "--node-id", "w", "--base-step", "1",
             "--local-step", "2", "-o", out])
    assert p.returncode == 1, f"(swapped) exit {p.returncode}, expected 1\nstderr: {p.stderr}"
    error_code_in(p, code)


@pytest.mark.parametrize("args", [
    ["--node-id", "a b"], ["--node-id", ".."], ["--node-id", "x" * 65], ["--node-id", "a/b"],
    ["--base-step", "-1"], ["--base-step", "05"], ["--local-step", "+5"], ["--local-step", "1.0"],
    ["--local-step", "9007199254740992"],
], ids=lambda a: f"{a[0]}={a[1][:10]}")
def test_delta_bad_arguments_are_usage_errors(diloco_bin, tmp_path, args):
    base, cur = model_state(300, with_bf16=False)
    a = save_state(tmp_path / "a.safetensors", base)
    b = save_state(tmp_path / "b.safetensors", cur)
    out = tmp_path / "d.safetensors"
    opts = {"--node-id": "w", "--base-step": "1", "--local-step": "2"}
    opts[args[0]] = args[1]
    p = run([diloco_bin, "delta", "--baseline", a, "--current", b, *[x for kv in opts.items() for x in kv],
             "-o", out])
    assert p.returncode == 2, f"exit {p.returncode}, expected 2 (usage)\nstderr: {p.stderr}"
    assert not out.exists()


# ---------------------------------------------------------------------------------------------------
# diloco average

AVG_SHAPES = {"w.a": (32, 9), "w.b": (7,), "w.s": (), "w.e": (0, 3), "w.c": (5, 2)}   # w.c is complex


def rand_delta(rng, kind):
    """A delta over AVG_SHAPES; kind F32, F16 or BF16 (w.c is always C64)."""
    d = {}
    for k, shape in AVG_SHAPES.items():
        if k == "w.c":
            d[k] = rand_c64(rng, shape)
        elif kind == "F32":
            d[k] = rand_f32(rng, shape, spread=30)
        elif kind == "F16":
            d[k] = rand_f16(rng, shape)
        else:
            d[k] = rand_bf16(rng, shape)
    return d


def expected_average(deltas):
    n = len(deltas)
    out = {}
    for k in deltas[0]:
        if k == "w.c":
            acc = deltas[0][k].view(np.float32).copy()
            for d in deltas[1:]:
                acc += d[k].view(np.float32)
            out[k] = (acc / np.float32(n)).view(np.complex64)
        else:
            acc = to_f32(deltas[0][k]).copy()
            for d in deltas[1:]:
                acc += to_f32(d[k])
            out[k] = acc / np.float32(n)
    return out


AVG_CASES = {
    "1xF32": ["F32"],
    "2xF32": ["F32", "F32"],
    "3xF32": ["F32"] * 3,
    "4xF32": ["F32"] * 4,
    "5xF32": ["F32"] * 5,
    "2xF32+F16+BF16": ["F32", "F16", "F32", "BF16"],
    "BF16-first+3xF32+F16": ["BF16", "F32", "F32", "F32", "F16"],
    "F16-first+4xF32+BF16": ["F16", "F32", "F32", "BF16", "F32", "F32"],
    "5xF32+F16+BF16": ["F32", "F32", "F16", "F32", "F32", "BF16", "F32"],
}


@pytest.mark.parametrize("case", list(AVG_CASES))
def test_average_matches_numpy(diloco_bin, tmp_path, case):
    kinds = AVG_CASES[case]
    rng = np.random.default_rng(400 + list(AVG_CASES).index(case))
    deltas = [rand_delta(rng, kind) for kind in kinds]
    paths = []
    for i, d in enumerate(deltas):
        meta = {"algorithm": "dumb_diloco", "base_outer_step": "3", "local_step": str(100 + i),
                "node_id": f"node-{i}"}
        paths.append(save_state(tmp_path / f"d{i}.safetensors", d, metadata=meta))
    out = tmp_path / "avg.safetensors"
    run([diloco_bin, "average", "-o", out, *paths], check=0)
    got = stnp.load_file(str(out))
    want = expected_average(deltas)
    assert sorted(got) == sorted(want), f"keys {sorted(got)} != {sorted(want)}"
    for k, w in want.items():
        assert_bits_equal(got[k], w, k)
    assert file_metadata(out) is None, f"average output metadata {file_metadata(out)!r}, expected none"


def test_average_order_matters(diloco_bin, tmp_path):
    """FP32 accumulation in the given order: values chosen so that another order rounds differently."""
    vals = [np.array([1e8, 1.0, -1e8], np.float32), np.array([1.0, 1e8, 1.0], np.float32),
            np.array([-1e8, -1e8, 1e8], np.float32)]
    deltas = [{"w": v} for v in vals]
    for order in ([0, 1, 2], [1, 2, 0], [2, 0, 1]):
        ds = [deltas[i] for i in order]
        paths = [save_state(tmp_path / f"o{j}.safetensors", d) for j, d in enumerate(ds)]
        out = tmp_path / "avg.safetensors"
        run([diloco_bin, "average", "-o", out, *paths], check=0)
        acc = ds[0]["w"].copy()
        for d in ds[1:]:
            acc += d["w"]
        assert_bits_equal(stnp.load_file(str(out))["w"], acc / np.float32(3), f"order {order}")


def _dset(key, value):
    def f(d):
        d[key] = value
    return f


AVG_MISMATCHES = {
    "missing-key": ("key_mismatch", _drop("w.b")),
    "extra-key": ("key_mismatch", _add("w.z", np.zeros(2, np.float32))),
    "renamed-key": ("key_mismatch", _rename("w.b", "w.B")),
    "shape": ("shape_mismatch", _dset("w.a", np.zeros((9, 32), np.float32))),
    "scalar-vs-1": ("shape_mismatch", _dset("w.s", np.zeros((1,), np.float32))),
    "empty-shape": ("shape_mismatch", _dset("w.e", np.zeros((0, 4), np.float32))),
    "f64-delta": ("dtype_mismatch", _dset("w.b", np.zeros((7,), np.float64))),
    "int-delta": ("dtype_mismatch", _dset("w.b", np.zeros((7,), np.int32))),
    "f32-for-complex": ("dtype_mismatch", _dset("w.c", np.zeros((5, 2), np.float32))),
    "complex-for-f32": ("dtype_mismatch", _dset("w.b", np.zeros((7,), np.complex64))),
}


@pytest.mark.parametrize("position", ["second", "last"])
@pytest.mark.parametrize("case", list(AVG_MISMATCHES))
def test_average_mismatch(diloco_bin, tmp_path, case, position):
    code, mutate = AVG_MISMATCHES[case]
    rng = np.random.default_rng(500)
    deltas = [rand_delta(rng, "F32") for _ in range(3)]
    mutate(deltas[1] if position == "second" else deltas[2])
    paths = [save_state(tmp_path / f"d{i}.safetensors", d) for i, d in enumerate(deltas)]
    out = tmp_path / "avg.safetensors"
    p = run([diloco_bin, "average", "-o", out, *paths])
    assert p.returncode == 1, f"exit {p.returncode}, expected 1\nstderr: {p.stderr}"
    error_code_in(p, code)
    assert not out.exists(), "a failed average must not be written"


@pytest.mark.parametrize("case", ["f64-delta", "int-delta"])
def test_average_first_delta_bad_dtype(diloco_bin, tmp_path, case):
    code, mutate = AVG_MISMATCHES[case]
    rng = np.random.default_rng(501)
    deltas = [rand_delta(rng, "F32") for _ in range(2)]
    mutate(deltas[0])
    paths = [save_state(tmp_path / f"d{i}.safetensors", d) for i, d in enumerate(deltas)]
    p = run([diloco_bin, "average", "-o", tmp_path / "avg.safetensors", *paths])
    assert p.returncode == 1, f"exit {p.returncode}, expected 1\nstderr: {p.stderr}"
    error_code_in(p, code)


def test_average_no_inputs_is_usage_error(diloco_bin, tmp_path):
    p = run([diloco_bin, "average", "-o", tmp_path / "avg.safetensors"])
    assert p.returncode == 2, f"exit {p.returncode}, expected 2\nstderr: {p.stderr}"
    assert not (tmp_path / "avg.safetensors").exists()


# ---------------------------------------------------------------------------------------------------
# diloco verify

NODE, BASE_STEP, LOCAL_STEP = "worker-1", "7", "500"
VALID_PATH = f"nodes/{NODE}/delta_{LOCAL_STEP}.safetensors"


def global_state():
    rng = np.random.default_rng(600)
    return {
        "w.f32": rand_f32(rng, (4, 3)),
        "w.f16": rand_f16(rng, (5,)),
        "w.bf16": rand_bf16(rng, (2, 2)),
        "w.f64": rand_f64(rng, (3,)),
        "w.c64": rand_c64(rng, (2,)),
        "w.scalar": rand_f32(rng, ()),
        "w.empty": rand_f32(rng, (0, 3)),
        "buf.i64": np.array(12, np.int64),
        "buf.bool": np.array([True, False, True]),
    }


def valid_meta(node=NODE, local_step=LOCAL_STEP):
    return {"algorithm": "dumb_diloco", "base_outer_step": BASE_STEP, "local_step": local_step, "node_id": node}


def valid_delta(kind="F32", seed=601):
    """A delta for global_state(): F32 (or F16 / BF16 / mixed) for floating keys, C64 for the C64 key."""
    rng = np.random.default_rng(seed)
    d = {}
    for i, (k, v) in enumerate(global_state().items()):
        if not is_floating(v):
            continue
        shape = tuple(v.shape)
        kk = kind if kind != "mixed" else ["F32", "F16", "BF16"][i % 3]
        if k == "w.c64":
            d[k] = rand_c64(rng, shape)
        elif kk == "F16":
            d[k] = rand_f16(rng, shape)
        elif kk == "BF16":
            d[k] = rand_bf16(rng, shape)
        else:
            d[k] = rand_f32(rng, shape)
    return d


@pytest.fixture(scope="module")
def global_file(tmp_path_factory):
    return save_state(tmp_path_factory.mktemp("global") / "latest.safetensors", global_state())


def verify(diloco_bin, delta, against=None, path=None):
    args = [diloco_bin, "verify", delta, "--json"]
    if against is not None:
        args += ["--against", against]
    if path is not None:
        args += ["--path", path]
    p = run(args)
    try:
        out = json.loads(p.stdout)
    except ValueError:
        raise AssertionError(f"verify --json printed no JSON (exit {p.returncode})\nstdout: {p.stdout!r}\n"
                             f"stderr: {p.stderr}")
    return p, out


def assert_valid(p, out, node=NODE, local_step=LOCAL_STEP):
    assert p.returncode == 0, f"exit {p.returncode}, expected 0: {out}\nstderr: {p.stderr}"
    want = {"valid": True, "node_id": node, "base_outer_step": int(BASE_STEP), "local_step": int(local_step)}
    assert out == want, f"verify said {out}, expected {want}"


def assert_invalid(p, out, code, tensor=None):
    assert p.returncode == 1, f"exit {p.returncode}, expected 1 ({code}): {out}\nstderr: {p.stderr}"
    assert out.get("valid") is False, f"verify said {out}, expected valid false"
    err = out.get("error", {})
    assert err.get("code") == code, f"error code {err.get('code')!r}, expected {code!r}: {out}"
    assert isinstance(err.get("message"), str) and err["message"], f"no message: {out}"
    if tensor is not None:
        assert err.get("tensor") == tensor, f"error tensor {err.get('tensor')!r}, expected {tensor!r}: {out}"


@pytest.mark.parametrize("kind", ["F32", "F16", "BF16", "mixed"])
@pytest.mark.parametrize("mode", ["against+path", "against", "path", "alone"])
def test_verify_valid(diloco_bin, tmp_path, global_file, kind, mode):
    delta = save_state(tmp_path / "delta.safetensors", valid_delta(kind), metadata=valid_meta())
    p, out = verify(diloco_bin, delta, against=global_file if "against" in mode else None,
                    path=VALID_PATH if "path" in mode else None)
    assert_valid(p, out)


def _meta_drop(key):
    def f(d, m):
        del m[key]
    return f


def _meta_set(key, value):
    def f(d, m):
        m[key] = value
    return f


def _t_drop(key):
    def f(d, m):
        del d[key]
    return f


def _t_set(key, value):
    def f(d, m):
        d[key] = value
    return f


def _t_poke(key, index, value):
    """Sets one element of d[key] (numpy or bf16 torch) to value."""
    def f(d, m):
        v = d[key]
        if isinstance(v, torch.Tensor):
            v = v.clone()
            v.view(-1)[index] = value
        else:
            v = v.copy()
            v.reshape(-1)[index] = value
        d[key] = v
    return f


def _t_poke_imag(key, index, value):
    def f(d, m):
        v = d[key].copy()
        v.reshape(-1).view(np.float32)[2 * index + 1] = value
        d[key] = v
    return f


def _t_kind(kind):
    def f(d, m):
        d.clear()
        d.update(valid_delta(kind))
    return f


# case -> (expected code, mutation of (tensors, metadata), tensor named by the error or None, verify kwargs)
# kwargs: "path" (default VALID_PATH), "against" (default True)
VERIFY_FAILURES = {
    # metadata_missing
    "no-metadata-at-all": ("metadata_missing", lambda d, m: m.clear(), None, {}),
    "missing-algorithm": ("metadata_missing", _meta_drop("algorithm"), None, {}),
    "missing-base_outer_step": ("metadata_missing", _meta_drop("base_outer_step"), None, {}),
    "missing-local_step": ("metadata_missing", _meta_drop("local_step"), None, {"path": None}),
    "missing-node_id": ("metadata_missing", _meta_drop("node_id"), None, {"path": None}),
    # metadata_invalid
    "algorithm-other": ("metadata_invalid", _meta_set("algorithm", "diloco"), None, {}),
    "algorithm-case": ("metadata_invalid", _meta_set("algorithm", "Dumb_DiLoCo"), None, {}),
    "algorithm-empty": ("metadata_invalid", _meta_set("algorithm", ""), None, {}),
    "algorithm-trailing-space": ("metadata_invalid", _meta_set("algorithm", "dumb_diloco "), None, {}),
    "base_outer_step-plus": ("metadata_invalid", _meta_set("base_outer_step", "+7"), None, {}),
    "base_outer_step-leading-zero": ("metadata_invalid", _meta_set("base_outer_step", "07"), None, {}),
    "base_outer_step-negative": ("metadata_invalid", _meta_set("base_outer_step", "-1"), None, {}),
    "base_outer_step-float": ("metadata_invalid", _meta_set("base_outer_step", "1.0"), None, {}),
    "base_outer_step-exponent": ("metadata_invalid", _meta_set("base_outer_step", "7e0"), None, {}),
    "base_outer_step-hex": ("metadata_invalid", _meta_set("base_outer_step", "0x7"), None, {}),
    "base_outer_step-space": ("metadata_invalid", _meta_set("base_outer_step", " 7"), None, {}),
    "base_outer_step-empty": ("metadata_invalid", _meta_set("base_outer_step", ""), None, {}),
    "base_outer_step-2^53": ("metadata_invalid", _meta_set("base_outer_step", "9007199254740992"), None, {}),
    "base_outer_step-2^64": ("metadata_invalid", _meta_set("base_outer_step", "18446744073709551616"), None, {}),
    "local_step-plus": ("metadata_invalid", _meta_set("local_step", "+5"), None, {"path": None}),
    "local_step-leading-zero": ("metadata_invalid", _meta_set("local_step", "05"), None, {"path": None}),
    "local_step-negative": ("metadata_invalid", _meta_set("local_step", "-1"), None, {"path": None}),
    "local_step-float": ("metadata_invalid", _meta_set("local_step", "500.0"), None, {"path": None}),
    "node_id-space": ("metadata_invalid", _meta_set("node_id", "worker 1"), None, {"path": None}),
    "node_id-dot": ("metadata_invalid", _meta_set("node_id", "."), None, {"path": None}),
    "node_id-dotdot": ("metadata_invalid", _meta_set("node_id", ".."), None, {"path": None}),
    "node_id-65-chars": ("metadata_invalid", _meta_set("node_id", "n" * 65), None, {"path": None}),
    "node_id-slash": ("metadata_invalid", _meta_set("node_id", "a/b"), None, {"path": None}),
    "node_id-empty": ("metadata_invalid", _meta_set("node_id", ""), None, {"path": None}),
    "node_id-unicode": ("metadata_invalid", _meta_set("node_id", "wörker"), None, {"path": None}),
    # invalid_path / path_mismatch
    "path-invalid": ("invalid_path", lambda d, m: None, None, {"path": "nodes/worker-1/delta_500.st"}),
    "path-other-node": ("path_mismatch", lambda d, m: None, None,
                        {"path": "nodes/worker-2/delta_500.safetensors"}),
    "path-node-case": ("path_mismatch", lambda d, m: None, None,
                       {"path": "nodes/Worker-1/delta_500.safetensors"}),
    "path-other-step": ("path_mismatch", lambda d, m: None, None,
                        {"path": "nodes/worker-1/delta_501.safetensors"}),
    "path-step-is-base-step": ("path_mismatch", lambda d, m: None, None,
                               {"path": "nodes/worker-1/delta_7.safetensors"}),
    # key_mismatch
    "missing-floating-key": ("key_mismatch", _t_drop("w.f16"), "w.f16", {}),
    "missing-empty-key": ("key_mismatch", _t_drop("w.empty"), "w.empty", {}),
    "extra-key": ("key_mismatch", _t_set("w.extra", np.zeros(2, np.float32)), "w.extra", {}),
    "non-floating-key-i64": ("key_mismatch", _t_set("buf.i64", np.array(1, np.int64)), "buf.i64", {}),
    "non-floating-key-as-f32": ("key_mismatch", _t_set("buf.bool", np.zeros(3, np.float32)), "buf.bool", {}),
    # shape_mismatch
    "shape-transposed": ("shape_mismatch", _t_set("w.f32", np.zeros((3, 4), np.float32)), "w.f32", {}),
    "shape-scalar-vs-1": ("shape_mismatch", _t_set("w.scalar", np.zeros((1,), np.float32)), "w.scalar", {}),
    "shape-empty": ("shape_mismatch", _t_set("w.empty", np.zeros((0, 4), np.float32)), "w.empty", {}),
    "shape-extra-dim": ("shape_mismatch", _t_set("w.f16", np.zeros((5, 1), np.float32)), "w.f16", {}),
    "shape-complex": ("shape_mismatch", _t_set("w.c64", np.zeros((3,), np.complex64)), "w.c64", {}),
    # dtype_mismatch
    "dtype-f64": ("dtype_mismatch", _t_set("w.f32", np.zeros((4, 3), np.float64)), "w.f32", {}),
    "dtype-f64-for-f64-weight": ("dtype_mismatch", _t_set("w.f64", np.zeros((3,), np.float64)), "w.f64", {}),
    "dtype-i32": ("dtype_mismatch", _t_set("w.f32", np.zeros((4, 3), np.int32)), "w.f32", {}),
    "dtype-u8": ("dtype_mismatch", _t_set("w.f16", np.zeros((5,), np.uint8)), "w.f16", {}),
    "dtype-bool": ("dtype_mismatch", _t_set("w.scalar", np.array(True)), "w.scalar", {}),
    "dtype-f32-for-c64": ("dtype_mismatch", _t_set("w.c64", np.zeros((2,), np.float32)), "w.c64", {}),
    "dtype-c64-for-f32": ("dtype_mismatch", _t_set("w.f64", np.zeros((3,), np.complex64)), "w.f64", {}),
    # non_finite
    "nan-f32": ("non_finite", _t_poke("w.f32", 5, np.nan), "w.f32", {}),
    "neg-nan-f32": ("non_finite", _t_poke("w.f32", 0, -np.nan), "w.f32", {}),
    "inf-f32-last": ("non_finite", _t_poke("w.f32", 11, np.inf), "w.f32", {}),
    "neg-inf-scalar": ("non_finite", _t_poke("w.scalar", 0, -np.inf), "w.scalar", {}),
    "nan-imag-c64": ("non_finite", _t_poke_imag("w.c64", 1, np.nan), "w.c64", {}),
    "inf-real-c64": ("non_finite", _t_poke("w.c64", 0, complex(np.inf, 0)), "w.c64", {}),
    "nan-in-f16-delta": ("non_finite", lambda d, m: (_t_kind("F16")(d, m), _t_poke("w.f16", 2, np.nan)(d, m)),
                         "w.f16", {}),
    "inf-in-f16-delta": ("non_finite", lambda d, m: (_t_kind("F16")(d, m), _t_poke("w.f32", 3, -np.inf)(d, m)),
                         "w.f32", {}),
    "nan-in-bf16-delta": ("non_finite",
                          lambda d, m: (_t_kind("BF16")(d, m), _t_poke("w.bf16", 1, float("nan"))(d, m)),
                          "w.bf16", {}),
    "inf-in-bf16-delta": ("non_finite",
                          lambda d, m: (_t_kind("BF16")(d, m), _t_poke("w.f64", 2, float("inf"))(d, m)),
                          "w.f64", {}),
}


@pytest.mark.parametrize("case", list(VERIFY_FAILURES))
def test_verify_failure(diloco_bin, tmp_path, global_file, case):
    code, mutate, tensor, kw = VERIFY_FAILURES[case]
    d, m = valid_delta(), valid_meta()
    mutate(d, m)
    delta = save_state(tmp_path / "delta.safetensors", d, metadata=m if m else None)
    p, out = verify(diloco_bin, delta, against=global_file if kw.get("against", True) else None,
                    path=kw.get("path", VALID_PATH))
    assert_invalid(p, out, code, tensor)


# Without --against the key-set check is skipped, the rest applies.
VERIFY_ALONE = {
    "missing-key-ok": (None, _t_drop("w.f16"), None),
    "extra-key-ok": (None, _t_set("w.extra", np.zeros(2, np.float32)), None),
    "metadata-missing": ("metadata_missing", _meta_drop("node_id"), None),
    "metadata-invalid": ("metadata_invalid", _meta_set("local_step", "05"), None),
    "dtype-f64": ("dtype_mismatch", _t_set("w.f32", np.zeros((4, 3), np.float64)), "w.f32"),
    "nan": ("non_finite", _t_poke("w.f32", 4, np.nan), "w.f32"),
    "inf-bf16": ("non_finite", lambda d, m: (_t_kind("BF16")(d, m), _t_poke("w.bf16", 0, float("-inf"))(d, m)),
                 "w.bf16"),
}


@pytest.mark.parametrize("case", list(VERIFY_ALONE))
def test_verify_without_global(diloco_bin, tmp_path, case):
    code, mutate, tensor = VERIFY_ALONE[case]
    d, m = valid_delta(), valid_meta()
    mutate(d, m)
    delta = save_state(tmp_path / "delta.safetensors", d, metadata=m)
    p, out = verify(diloco_bin, delta)
    if code is None:
        assert_valid(p, out)
    else:
        assert_invalid(p, out, code, tensor)


def test_verify_without_global_rejects_non_floating_key(diloco_bin, tmp_path):
    """A delta never carries integer/bool tensors, with or without the global at hand."""
    d = valid_delta()
    d["buf.i64"] = np.array(1, np.int64)
    delta = save_state(tmp_path / "delta.safetensors", d, metadata=valid_meta())
    p, out = verify(diloco_bin, delta)
    assert p.returncode == 1 and out.get("valid") is False, f"exit {p.returncode}: {out}"
    assert out["error"]["code"] in ("key_mismatch", "dtype_mismatch"), out
    assert out["error"].get("tensor") == "buf.i64", out


def test_verify_not_a_safetensors_file(diloco_bin, tmp_path, global_file):
    bad = tmp_path / "delta.safetensors"
    bad.write_bytes(b"\x64\x00\x00\x00\x00\x00\x00\x00{}")   # header length beyond the file
    p, out = verify(diloco_bin, bad, against=global_file)
    assert p.returncode == 1 and out.get("valid") is False, f"exit {p.returncode}: {out}"


# ---------------------------------------------------------------------------------------------------
# parse_delta_path, through verify --path

VALID_PATHS = [
    ("worker-1", "500"),
    ("a", "0"),
    ("A.b_c-9", "9007199254740991"),
    ("n" * 64, "1"),
    ("...", "3"),
    ("-", "10"),
    ("_", "7"),
    ("node.", "12"),
    (".hidden", "4"),
]


@pytest.mark.parametrize("node,step", VALID_PATHS, ids=[f"{n[:12]}-{s}" for n, s in VALID_PATHS])
def test_delta_path_valid(diloco_bin, tmp_path, global_file, node, step):
    delta = save_state(tmp_path / "delta.safetensors", valid_delta(), metadata=valid_meta(node, step))
    p, out = verify(diloco_bin, delta, against=global_file, path=f"nodes/{node}/delta_{step}.safetensors")
    assert_valid(p, out, node=node, local_step=step)


INVALID_PATHS = [
    "node/worker-1/delta_500.safetensors",
    "Nodes/worker-1/delta_500.safetensors",
    "/nodes/worker-1/delta_500.safetensors",
    "./nodes/worker-1/delta_500.safetensors",
    "x/nodes/worker-1/delta_500.safetensors",
    "nodes/worker-1/x/delta_500.safetensors",
    "nodes/worker-1/delta_500.safetensors/",
    "nodes/worker-1//delta_500.safetensors",
    "nodes/worker-1",
    "nodes/worker-1/",
    "nodes/",
    "",
    "nodes//delta_500.safetensors",
    "nodes/./delta_500.safetensors",
    "nodes/../delta_500.safetensors",
    "nodes/" + "w" * 65 + "/delta_500.safetensors",
    "nodes/worker 1/delta_500.safetensors",
    "nodes/worker/1/delta_500.safetensors",
    "nodes/worker\\1/delta_500.safetensors",
    "nodes/wörker/delta_500.safetensors",
    "nodes/worker-1/delta_+5.safetensors",
    "nodes/worker-1/delta_05.safetensors",
    "nodes/worker-1/delta_-1.safetensors",
    "nodes/worker-1/delta_5.safetensors.tmp",
    "nodes/worker-1/delta_.safetensors",
    "nodes/worker-1/delta_9007199254740992.safetensors",
    "nodes/worker-1/delta_18446744073709551616.safetensors",
    "nodes/worker-1/delta_5.0.safetensors",
    "nodes/worker-1/delta_5e2.safetensors",
    "nodes/worker-1/delta_0x5.safetensors",
    "nodes/worker-1/delta_ 5.safetensors",
    "nodes/worker-1/delta_5 .safetensors",
    "nodes/worker-1/delta_5",
    "nodes/worker-1/delta_5.SAFETENSORS",
    "nodes/worker-1/Delta_5.safetensors",
    "nodes/worker-1/delta-5.safetensors",
    "nodes/worker-1/delta5.safetensors",
    "nodes/worker-1/.safetensors",
    "nodes/worker-1/delta_500.safetensors\n",
]


@pytest.mark.parametrize("path", INVALID_PATHS, ids=[repr(p)[1:-1][-60:] or "empty" for p in INVALID_PATHS])
def test_delta_path_invalid(diloco_bin, tmp_path, global_file, path):
    # metadata is valid for worker-1 / 500: only the path is wrong
    delta = save_state(tmp_path / "delta.safetensors", valid_delta(), metadata=valid_meta())
    p, out = verify(diloco_bin, delta, against=global_file, path=path)
    assert_invalid(p, out, "invalid_path")


def test_verify_against_a_newer_global_says_stale(diloco_bin, tmp_path):
    """verify --against checks the delta's base against the global's step: the step_count.json beside it
    (as diloco pull -o DIR and a tree keep it) or --step N.  A delta of an older step is stale, as dilocod
    answers it (409), not "valid"; one of the same step is valid; a step file that does not parse is an
    error naming it."""
    gdir = tmp_path / "pulled"
    gdir.mkdir()
    g = save_state(gdir / "latest.safetensors", global_state())
    delta = save_state(tmp_path / "delta.safetensors", valid_delta(), metadata=valid_meta())
    step_file = gdir / "step_count.json"
    step_file.write_text(json.dumps({"algorithm": "dumb_diloco", "model_file": "global/latest.safetensors",
                                     "optimizer": "nesterov_sgd", "outer_step": int(BASE_STEP) + 2,
                                     "updated_at": "2026-01-01T12:00:00+00:00"}))
    p, out = verify(diloco_bin, delta, against=g)
    assert p.returncode == 1 and out["valid"] is False and out["error"]["code"] == "stale", out
    assert f"based on outer step {BASE_STEP}, the global is at step {int(BASE_STEP) + 2}" in out["error"]["message"]
    p = run([diloco_bin, "verify", delta, "--against", g])
    assert p.returncode == 1 and "stale" in p.stderr and "409" in p.stderr, p.stderr
    # --step overrides the file; the same step is valid
    p = run([diloco_bin, "verify", delta, "--against", g, "--step", BASE_STEP, "--json"])
    assert p.returncode == 0 and json.loads(p.stdout)["valid"] is True, (p.stdout, p.stderr)
    step_file.write_text(step_file.read_text().replace(f'"outer_step": {int(BASE_STEP) + 2}',
                                                       f'"outer_step": {BASE_STEP}'))
    assert_valid(*verify(diloco_bin, delta, against=g))
    step_file.write_text("{not json")
    p = run([diloco_bin, "verify", delta, "--against", g])
    assert p.returncode == 1 and "step_count.json" in p.stderr, p.stderr
    p = run([diloco_bin, "verify", delta, "--step", "3"])
    assert p.returncode == 2, p.stderr
