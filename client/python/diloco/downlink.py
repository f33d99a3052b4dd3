"""The downlink's replay (server/README.md, "The downlink"): an update U_s applied in place over the bytes
of the view a worker holds, exactly as dilocod makes view_s (common/downlink.c):

    view_s = round_to_dtype(float32(view_{s-1}) + decode(U_s))     one F32 add, one rounding

decode is the uplink's MX decode (compress.h), an exact product: e4m3(q) x 2^(e - 127) (mxfp8) or
e2m1(q) x 2^(e - 127) (mxfp4, value 2j in the low nibble of byte j), one scale per 32 values from each
key's start.  A key the update holds plain (F32, or C64 as F32 pairs) adds its values as they are.  The
view's header never changes, so the bytes after the replay are the server's file, which the update's
view_hash (the block hash, diloco.blockhash) checks."""
import numpy as np

from . import _st
from .blockhash import block_hash_bytes
from .errors import HostileAnswer

SCALES = ".__scales__"
BLOCK = 32
ENCODINGS = {"mxfp8": "F8_E4M3", "mxfp4": "F4"}
VIEW_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": None, "F64": np.float64, "C64": None}


def _e4m3_table():
    out = np.zeros(256, dtype=np.float32)
    for c in range(256):
        s, e, m = c >> 7, (c >> 3) & 15, c & 7
        if e == 15 and m == 7:
            v = np.nan
        elif e == 0:
            v = m / 8 * 2.0 ** -6
        else:
            v = (1 + m / 8) * 2.0 ** (e - 7)
        out[c] = -v if s else v
    return out


E4M3 = _e4m3_table()
E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], dtype=np.float32)


def e8m0(scales: np.ndarray) -> np.ndarray:
    """2^(e - 127) in F32 (e = 0 is 2^-127, a subnormal; 255 is NaN)."""
    out = np.ldexp(np.float32(1), scales.astype(np.int32) - 127).astype(np.float32)
    out[scales == 255] = np.nan
    return out


def decode(encoding: str, codes: np.ndarray, scales: np.ndarray, n: int) -> np.ndarray:
    """n values of one key, decoded to F32 (exact products)."""
    if encoding == "mxfp8":
        vals = E4M3[codes[:n]]
    else:
        both = np.empty(2 * codes.size, dtype=np.uint8)
        both[0::2], both[1::2] = codes & 15, codes >> 4
        vals = E2M1[both[:n]]
    s = np.repeat(e8m0(scales), BLOCK)[:n]
    return vals * s


def bf16_to_f32(raw: np.ndarray) -> np.ndarray:
    return (raw.astype(np.uint32) << 16).view(np.float32)


def f32_to_bf16(x: np.ndarray) -> np.ndarray:
    """Round to nearest even, as dilocod's cv_f32_to_bf16 and torch's .to(bfloat16) for finite values."""
    b = x.view(np.uint32).astype(np.uint64)
    r = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
    return r.astype(np.uint16)


def _values(buf, dtype, begin, end):
    raw = np.frombuffer(buf, dtype=np.uint8, count=end - begin, offset=begin)
    if dtype == "BF16":
        return bf16_to_f32(raw.view(np.uint16))
    if dtype == "C64":
        return raw.view(np.float32).copy()
    return raw.view(VIEW_DTYPES[dtype]).astype(np.float32)


def _store(buf, dtype, begin, end, v32):
    if dtype == "BF16":
        out = f32_to_bf16(v32).view(np.uint8)
    elif dtype == "C64":
        out = v32.view(np.uint8)
    else:
        out = v32.astype(VIEW_DTYPES[dtype]).view(np.uint8)
    memoryview(buf)[begin:end] = out.tobytes()


def update_meta(meta, what):
    """An update's metadata checked -> (step, base_step, encoding, view_hash)."""
    if not isinstance(meta, dict):
        raise HostileAnswer(f"{what}: no metadata")
    enc = meta.get("encoding")
    if enc not in ENCODINGS or meta.get("block") != str(BLOCK):
        raise HostileAnswer(f"{what}: encoding {enc!r:.20} block {meta.get('block')!r:.20} is not mxfp8 or mxfp4 "
                            f"with block 32")
    from .transport import parse_step
    h = meta.get("view_hash")
    if not isinstance(h, str) or len(h) != 64 or any(c not in "0123456789abcdef" for c in h):
        raise HostileAnswer(f"{what}: view_hash {h!r:.80} is not 64 hex digits")
    return parse_step(meta.get("step"), f"{what} step"), parse_step(meta.get("base_step"), f"{what} base_step"), enc, h


def apply_update(view: bytearray, update, what="update", max_header=_st.MAX_HEADER_BYTES):
    """Applies update (bytes of U_s) in place to view (the bytes of view_{s-1}) and checks the result
    against the update's view_hash.  -> (step, base_step).  Raises HostileAnswer (the view is then not
    to be used: the caller downloads it again)."""
    meta, ut = _st.parse(update, max_header=max_header, what=what)
    step, base, enc, want = update_meta(meta, what)
    _, vt = _st.parse(view, max_header=max_header, what="view")
    floating = {k: v for k, v in vt.items() if v[0] in VIEW_DTYPES}
    expect = set(floating)
    for name, (dt, shape, b, e) in floating.items():
        n = int(np.prod(shape, dtype=np.int64)) if shape else 1
        u = ut.get(name)
        if u is None:
            raise HostileAnswer(f"{what}: no key {name!r:.80}")
        if u[0] == ENCODINGS[enc]:
            sc = ut.get(name + SCALES)
            if sc is None or sc[0] != "F8_E8M0" or sc[1] != ((n + BLOCK - 1) // BLOCK,) or u[1] != tuple(shape):
                raise HostileAnswer(f"{what}: {name!r:.80}'s codes or scales do not match its shape")
            expect.add(name + SCALES)
            codes = np.frombuffer(update, dtype=np.uint8, count=u[3] - u[2], offset=u[2])
            scales = np.frombuffer(update, dtype=np.uint8, count=sc[3] - sc[2], offset=sc[2])
            x = decode(enc, codes, scales, n)
        elif u[0] == ("C64" if dt == "C64" else "F32") and u[1] == tuple(shape):
            x = np.frombuffer(update, dtype=np.float32, count=(u[3] - u[2]) // 4, offset=u[2])
        else:
            raise HostileAnswer(f"{what}: {name!r:.80} is {u[0]} {list(u[1])}, not the encoding's codes nor plain")
        if not np.all(np.isfinite(x)):
            raise HostileAnswer(f"{what}: {name!r:.80} decodes to a value that is not finite")
        v = _values(view, dt, b, e)
        with np.errstate(over="ignore"):
            _store(view, dt, b, e, (v + x).astype(np.float32))
    if set(ut) != expect:
        raise HostileAnswer(f"{what}: keys other than the view's floating ones and their scales: "
                            f"{sorted(set(ut) - expect)[:5]}")
    got = block_hash_bytes(view)
    if got != want:
        raise HostileAnswer(f"{what}: the view after step {step}'s update has block hash {got}, the update says "
                            f"{want}")
    return step, base
