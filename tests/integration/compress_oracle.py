"""server/README.md's "Compressed deltas in full" in numpy, written from that text alone: the element
formats' values, decoding (every operation an F32 one), the encoders (OCP MX scale choice, round to
nearest even, saturation; int8 absmax/127) and error feedback.  The tests compare dilocod and diloco
with it."""
import math

import numpy as np

SUFFIX = ".__scales__"


def e4m3_values():
    """All 256 E4M3 (fn) codes as F32: bias 7, 3 mantissa bits, S.1111.111 is NaN, no infinities."""
    out = np.zeros(256, dtype=np.float32)
    for b in range(256):
        e, m = (b >> 3) & 15, b & 7
        v = m * 2.0 ** -9 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7)
        if b & 0x7f == 0x7f:
            v = math.nan
        out[b] = -v if b & 0x80 else v
    return out


def e2m1_values():
    """All 16 E2M1 codes: bias 1, 1 mantissa bit, no NaN or infinities."""
    out = np.zeros(16, dtype=np.float32)
    for b in range(16):
        e, m = (b >> 1) & 3, b & 1
        v = m * 0.5 if e == 0 else (1 + m / 2) * 2.0 ** (e - 1)
        out[b] = -v if b & 8 else v
    return out


def e8m0_values():
    """2^(e - 127) for e < 255 (as F32: 2^-127 is subnormal, exact), NaN for 0xFF."""
    return np.array([math.ldexp(1.0, e - 127) if e < 255 else math.nan for e in range(256)], dtype=np.float32)


E4M3, E2M1, E8M0 = e4m3_values(), e2m1_values(), e8m0_values()


def unpack_f4(packed, n):
    """F4 codes, two per byte, value 2j in the low nibble of byte j."""
    b = np.asarray(packed, dtype=np.uint8).reshape(-1)
    out = np.empty(b.size * 2, dtype=np.uint8)
    out[0::2] = b & 15
    out[1::2] = b >> 4
    return out[:n]


def pack_f4(codes):
    c = np.asarray(codes, dtype=np.uint8).reshape(-1)
    assert c.size % 2 == 0
    return (c[0::2] | (c[1::2] << 4)).astype(np.uint8)


def decode(enc, codes, scales, block, shape):
    """The decoded F32 values of one key: codes as stored (I8 array, E4M3 bytes as uint8, F4 packed
    bytes), scales (F32, or E8M0 bytes as uint8)."""
    n = int(np.prod(shape)) if len(shape) else 1
    blk = np.arange(n) // block
    with np.errstate(over="ignore", invalid="ignore"):
        if enc == "int8_block":
            q = np.asarray(codes, dtype=np.int8).reshape(-1).astype(np.float32)
            s = np.asarray(scales, dtype=np.float32).reshape(-1)
            x = q * s[blk]
        else:
            s = E8M0[np.asarray(scales, dtype=np.uint8).reshape(-1)]
            if enc == "mxfp8":
                v = E4M3[np.asarray(codes, dtype=np.uint8).reshape(-1)]
            else:
                v = E2M1[unpack_f4(codes, n)]
            x = v * s[blk]
    return x.astype(np.float32).reshape(shape)


def _nearest(values, w):
    """Codes (indices into ascending values) nearest w >= 0, ties to the even code, saturating."""
    w = np.asarray(w, dtype=np.float64)
    top = len(values) - 1
    v = values.astype(np.float64)
    lo = np.clip(np.searchsorted(v, w, side="right") - 1, 0, top)
    hi = np.minimum(lo + 1, top)
    below, above = w - v[lo], v[hi] - w
    pick = np.where(below < above, lo, np.where(below > above, hi, np.where(lo % 2 == 0, lo, hi)))
    return np.where(w >= v[top], top, pick).astype(np.uint8)


def encode(enc, values, block):
    """-> (codes, scales) as diloco writes them (codes: int8, uint8 E4M3 bytes, or packed F4 bytes)."""
    x = np.asarray(values, dtype=np.float32).reshape(-1)
    n = x.size
    nb = -(-n // block)
    pad = np.zeros(nb * block - n, dtype=np.float32)
    xb = np.concatenate([x, pad]).reshape(nb, block)
    amax = np.abs(xb).max(axis=1).astype(np.float32)
    if enc == "int8_block":
        s = (amax / np.float32(127)).astype(np.float32)
        with np.errstate(divide="ignore", invalid="ignore"):
            r = np.rint(xb / s[:, None]).astype(np.float32)
        r = np.where(s[:, None] > 0, r, np.float32(0))
        q = np.clip(r, -127, 127).astype(np.int8).reshape(-1)[:n]
        return q, s
    emax = 8 if enc == "mxfp8" else 2
    table = E4M3[:127] if enc == "mxfp8" else E2M1[:8]
    sign = np.uint8(0x80 if enc == "mxfp8" else 8)
    _, ex = np.frexp(amax.astype(np.float64))
    shared = np.where(amax > 0, np.clip(ex - 1 - emax, -127, 127), -127).astype(np.int64)
    w = np.abs(xb.astype(np.float64)) * np.ldexp(1.0, -shared)[:, None]
    c = _nearest(table, w) | np.where(np.signbit(xb), sign, np.uint8(0))
    c = c.astype(np.uint8).reshape(-1)[:n]
    return (c if enc == "mxfp8" else pack_f4(c)), (shared + 127).astype(np.uint8)


def error_feedback(enc, block, delta, residual):
    """One call of diloco delta --encode --residual: -> (codes, scales, decoded, new residual)."""
    e = (np.asarray(delta, dtype=np.float32) + np.asarray(residual, dtype=np.float32)).astype(np.float32)
    codes, scales = encode(enc, e, block)
    dec = decode(enc, codes, scales, block, e.shape)
    return codes, scales, dec, (e - dec).astype(np.float32)


# ---- files, written by the reference's own serializer ------------------------------------------------

_TORCH_NAMES = {"I8": "int8", "F32": "float32", "F8_E4M3": "float8_e4m3fn", "F8_E8M0": "float8_e8m0fnu",
                "F4": "float4_e2m1fn_x2", "F16": "float16", "BF16": "bfloat16", "C64": "complex64"}
CODE_DTYPE = {"int8_block": "I8", "mxfp8": "F8_E4M3", "mxfp4": "F4"}
SCALE_DTYPE = {"int8_block": "F32", "mxfp8": "F8_E8M0", "mxfp4": "F8_E8M0"}


_ORDER = ["BOOL", "F4", "F6_E2M3", "F6_E3M2", "U8", "I8", "F8_E5M2", "F8_E4M3", "F8_E8M0", "F8_E4M3FNUZ",
          "F8_E5M2FNUZ", "I16", "U16", "F16", "BF16", "I32", "U32", "F32", "C64", "F64", "I64", "U64"]


def serialize_by_hand(tensors, metadata=None):
    """The writer's layout (dtype descending, then name; compact JSON padded with spaces), for what the
    reference's binding cannot express: an F4 tensor whose last dimension is odd ([40, 13] holds 520
    values, 260 whole bytes: the format takes it, torch's float4_e2m1fn_x2 pairs cannot shape it)."""
    import json
    names = sorted(tensors, key=lambda k: (-_ORDER.index(tensors[k][0]), k.encode()))
    header, data, off = {}, [], 0
    if metadata is not None:
        header["__metadata__"] = metadata
    for k in names:
        dt, shape, arr = tensors[k]
        b = np.ascontiguousarray(arr).view(np.uint8).tobytes()
        header[k] = {"dtype": dt, "shape": list(shape), "data_offsets": [off, off + len(b)]}
        data.append(b)
        off += len(b)
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-(8 + len(h)) % 8)
    return len(h).to_bytes(8, "little") + h + b"".join(data)


def serialize(tensors, metadata=None):
    """tensors: {name: (dtype, shape, array)} in safetensors dtype names, F4 shapes in values (the
    reference's Python binding takes float4_e2m1fn_x2 pairs and doubles the last dimension)."""
    from safetensors import TensorSpec
    from safetensors import serialize as st_serialize
    if any(dt == "F4" and (not shape or shape[-1] % 2) for dt, shape, _ in tensors.values()):
        return serialize_by_hand(tensors, metadata)
    keep, specs = [], {}
    for name, (dt, shape, arr) in tensors.items():
        a = np.ascontiguousarray(arr).view(np.uint8).reshape(-1)
        keep.append(a)
        shape = list(shape)
        if dt == "F4":
            assert shape and shape[-1] % 2 == 0
            shape[-1] //= 2
        specs[name] = TensorSpec(dtype=_TORCH_NAMES[dt], shape=shape, data_ptr=a.ctypes.data, data_len=a.nbytes)
    return bytes(st_serialize(specs, metadata))


def compressed_delta(enc, block, delta, meta, plain=()):
    """The file of a compressed delta {key: F32 array} (keys in plain stay F32), as diloco writes it,
    and {key: decoded values}."""
    tensors, decoded = {}, {}
    for k, v in delta.items():
        v = np.asarray(v, dtype=np.float32)
        if k in plain:
            tensors[k] = ("F32", v.shape, v)
            decoded[k] = v
            continue
        codes, scales = encode(enc, v, block)
        tensors[k] = (CODE_DTYPE[enc], v.shape, codes)
        tensors[k + SUFFIX] = (SCALE_DTYPE[enc], (scales.size,), scales)
        decoded[k] = decode(enc, codes, scales, block, v.shape)
    return serialize(tensors, dict(meta, encoding=enc, block=str(block))), decoded
