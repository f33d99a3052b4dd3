"""safetensors in libdiloco's layout, written and read here.

Writing: `safetensors.torch.save` orders the metadata at random, so a delta it writes is not byte-identical
to `diloco delta`'s.  This writer makes common/st_writer.c's bytes: the metadata first, keys sorted
bytewise; then the tensors by dtype descending (the reference's Dtype order), name ascending; JSON with
no spaces, strings escaped as sb_json_string does; the header padded with spaces to a multiple of 8.

Reading: the bytes come from a server we do not trust, so every length and offset is checked before
a tensor is made (header within its cap, offsets contiguous from 0, the file ending where the header
says) and a refusal says what was wrong."""
import json
import re

import torch

from .errors import HostileAnswer

# The reference's Dtype order (common/safetensors.h st_dtype): the writer sorts by it, descending.
DTYPE_ORDER = ["BOOL", "F4", "F6_E2M3", "F6_E3M2", "U8", "I8", "F8_E5M2", "F8_E4M3", "F8_E8M0",
               "F8_E4M3FNUZ", "F8_E5M2FNUZ", "I16", "U16", "F16", "BF16", "I32", "U32", "F32",
               "C64", "F64", "I64", "U64"]
DTYPE_RANK = {name: i for i, name in enumerate(DTYPE_ORDER)}
DTYPE_BITS = {"BOOL": 8, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8,
              "F8_E8M0": 8, "F8_E4M3FNUZ": 8, "F8_E5M2FNUZ": 8, "I16": 16, "U16": 16, "F16": 16, "BF16": 16,
              "I32": 32, "U32": 32, "F32": 32, "C64": 64, "F64": 64, "I64": 64, "U64": 64}

# torch dtypes a global may hold on torch 1.13 (no float8 there; such a global is refused by name)
TORCH_DTYPES = {"BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16, "F16": torch.float16,
                "BF16": torch.bfloat16, "I32": torch.int32, "F32": torch.float32, "C64": torch.complex64,
                "F64": torch.float64, "I64": torch.int64}
ST_NAMES = {v: k for k, v in TORCH_DTYPES.items()}

MAX_HEADER_BYTES = 100_000_000      # the reference's MAX_HEADER_SIZE


class FormatError(HostileAnswer, ValueError):
    """A safetensors file (a global, a shard) that is not what its header says."""


def _json_string(s: str) -> str:
    out = ['"']
    for ch in s:
        c = ord(ch)
        if ch == '"':
            out.append('\\"')
        elif ch == '\\':
            out.append('\\\\')
        elif ch in '\b\t\n\f\r':
            out.append({'\b': '\\b', '\t': '\\t', '\n': '\\n', '\f': '\\f', '\r': '\\r'}[ch])
        elif c < 0x20:
            out.append('\\u%04x' % c)
        else:
            out.append(ch)
    out.append('"')
    return "".join(out)


def nbytes(dtype: str, shape) -> int:
    n = 1
    for d in shape:
        n *= d
    bits = n * DTYPE_BITS[dtype]
    if bits % 8:
        raise ValueError(f"{dtype} tensor of {n} elements does not fill whole bytes")
    return bits // 8


def build_header(specs, metadata):
    """specs: [(name, dtype name, shape)] in any order; metadata: {str: str} or None.
    -> (header bytes including the 8-byte length, [(name, begin, end)] in data order)."""
    order = sorted(specs, key=lambda s: (-DTYPE_RANK[s[1]], s[0].encode("utf-8")))
    names = [s[0] for s in order]
    if len(set(names)) != len(names):
        raise ValueError("duplicate tensor name")
    parts = ["{"]
    if metadata is not None:
        kv = sorted(metadata.items(), key=lambda kv: kv[0].encode("utf-8"))
        parts.append('"__metadata__":{' + ",".join(_json_string(k) + ":" + _json_string(v) for k, v in kv) + "}")
    pos, layout = 0, []
    for i, (name, dtype, shape) in enumerate(order):
        if name == "__metadata__":
            raise ValueError("a tensor may not be named __metadata__")
        n = nbytes(dtype, shape)
        if metadata is not None or i > 0:
            parts.append(",")
        parts.append(f'{_json_string(name)}:{{"dtype":"{dtype}","shape":[{",".join(str(int(d)) for d in shape)}],'
                     f'"data_offsets":[{pos},{pos + n}]}}')
        layout.append((name, pos, pos + n))
        pos += n
    parts.append("}")
    js = "".join(parts).encode("utf-8")
    js += b" " * ((8 - (8 + len(js)) % 8) % 8)
    return len(js).to_bytes(8, "little") + js, layout


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The tensor's bytes in memory order (little-endian hosts, as libdiloco): CPU, contiguous."""
    t = t.detach().to("cpu").contiguous()
    if t.numel() == 0:
        return memoryview(b"")
    return memoryview(t.reshape(-1).view(torch.uint8).numpy()).cast("B")


def parse(buf, *, max_header=MAX_HEADER_BYTES, what="file"):
    """Checks a whole safetensors file held in buf (bytes-like) -> (metadata or None,
    {name: (dtype, shape, begin, end)} with absolute offsets).  Raises FormatError."""
    size = len(buf)
    if size < 8:
        raise FormatError(f"{what}: {size} bytes, shorter than the 8-byte header length")
    n = int.from_bytes(bytes(buf[:8]), "little")
    if n > max_header:
        raise FormatError(f"{what}: header of {n} bytes is over the cap of {max_header}")
    if 8 + n > size:
        raise FormatError(f"{what}: header of {n} bytes runs past the end of the file ({size} bytes): truncated")
    try:
        h = json.loads(bytes(buf[8:8 + n]).decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise FormatError(f"{what}: header is not valid JSON ({e})") from None
    if not isinstance(h, dict):
        raise FormatError(f"{what}: header is not a JSON object")
    meta = h.pop("__metadata__", None)
    if meta is not None and (not isinstance(meta, dict) or
                             not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items())):
        raise FormatError(f"{what}: __metadata__ is not a string map")
    tensors, spans = {}, []
    for name, info in h.items():
        if not isinstance(info, dict) or set(info) != {"dtype", "shape", "data_offsets"}:
            raise FormatError(f"{what}: tensor {name!r}: malformed entry")
        dtype, shape, offs = info["dtype"], info["shape"], info["data_offsets"]
        if dtype not in DTYPE_BITS:
            raise FormatError(f"{what}: tensor {name!r}: unknown dtype {dtype!r}")
        if (not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape) or
                not isinstance(offs, list) or len(offs) != 2 or not all(type(o) is int and o >= 0 for o in offs)):
            raise FormatError(f"{what}: tensor {name!r}: bad shape or data_offsets")
        try:
            want = nbytes(dtype, shape)
        except ValueError as e:
            raise FormatError(f"{what}: tensor {name!r}: {e}") from None
        if offs[1] - offs[0] != want:
            raise FormatError(f"{what}: tensor {name!r}: data_offsets span {offs[1] - offs[0]} bytes, "
                              f"its dtype and shape {want}")
        spans.append((offs[0], offs[1], name))
        tensors[name] = (dtype, tuple(shape), 8 + n + offs[0], 8 + n + offs[1])
    # the data section is exactly the tensors, back to back: no gap, no overlap, nothing after
    pos = 0
    for b, e, name in sorted(spans):
        if b != pos:
            raise FormatError(f"{what}: tensor {name!r} starts at {b}, expected {pos} (gap or overlap)")
        pos = e
    if 8 + n + pos != size:
        if 8 + n + pos > size:
            raise FormatError(f"{what}: the header says the file ends at byte {8 + n + pos}, "
                              f"it has {size}: truncated")
        raise FormatError(f"{what}: {size - (8 + n + pos)} bytes after the last tensor")
    return meta, tensors


def tensor_from(buf, dtype: str, shape, begin: int, end: int, name: str, what: str) -> torch.Tensor:
    if dtype not in TORCH_DTYPES:
        raise FormatError(f"{what}: tensor {name!r} has dtype {dtype}, which this torch cannot hold")
    tdt = TORCH_DTYPES[dtype]
    if end == begin:
        return torch.empty(shape, dtype=tdt)
    # a view of the downloaded buffer, not a copy: the worker copies once, into its baseline
    if not isinstance(buf, bytearray):
        buf = bytearray(buf[begin:end])
        begin, end = 0, end - begin
    raw = torch.frombuffer(memoryview(buf)[begin:end], dtype=torch.uint8)
    return raw.view(tdt).reshape(shape)


def shard_re(base: str):
    """The shards of an index named <base>.safetensors.index.json: <base>-iiiii-of-nnnnn.safetensors, ASCII
    digits only (str.isdigit and \\d take other scripts' digits too), matched whole (fullmatch: `$` would
    take a trailing newline)."""
    return re.compile(re.escape(base) + r"-([0-9]{5})-of-([0-9]{5})\.safetensors")


SHARD_RE = shard_re("latest")       # a single dilocod's sharded global/latest.safetensors
