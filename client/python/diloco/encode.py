"""Compressed deltas in torch (README, "Compressed deltas"; common/compress.h is the definition).

Every rule below is common/compress.c's and common/delta_encode.c's, written on F32/F64 tensors and
integer views because torch 1.13 has no float8 or float4 dtypes.  The bytes and the residual are
identical to `diloco delta --encode --residual` (tests/integration/test_worker_package.py checks it):
F32 arithmetic is IEEE on every torch backend, and the one step that is not plain F32 (the nearest
element value) compares with midpoints that F32 holds exactly, as compress.c's double arithmetic does.
"""
import io
import json

import torch

from . import _st

ENCODINGS = ("int8_block", "mxfp8", "mxfp4")
BLOCK_MIN, BLOCK_MAX, MX_BLOCK = 32, 4096, 32
SCALES_SUFFIX = ".__scales__"
ALGORITHM = "dumb_diloco"


def _e4m3_values():
    """The non-negative E4M3 codes 0x00..0x7e (0x7f is NaN), ascending."""
    out = []
    for c in range(127):
        e, m = c >> 3, c & 7
        out.append(m / 8 * 2.0 ** -6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7))
    return out


E4M3 = _e4m3_values()
E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def check_spec(encode, block):
    """-> the block the encoding takes (int8_block: default 32)."""
    if encode not in ENCODINGS:
        raise ValueError(f"encode must be one of {', '.join(ENCODINGS)}, not {encode!r}")
    if encode == "int8_block":
        block = 32 if block is None else int(block)
        if not (BLOCK_MIN <= block <= BLOCK_MAX and block & (block - 1) == 0):
            raise ValueError(f"int8_block takes a block that is a power of two from 32 to 4096, not {block}")
    else:
        if block not in (None, MX_BLOCK):
            raise ValueError(f"{encode} takes block 32, not {block}")
        block = MX_BLOCK
    return block


def _blocks(e: torch.Tensor, block: int):
    """e (1-D F32) -> (n, e padded with zeros to whole blocks, as [nblocks, block]).  A zero pad changes
    no block's amax, and its codes are cut off again."""
    n = e.numel()
    nb = (n + block - 1) // block
    if nb * block != n:
        e = torch.cat([e, e.new_zeros(nb * block - n)])
    return n, e.view(nb, block)


def _encode_int8(e, block):
    """s = amax / 127 (F32), q = clamp(rint(v / s), -127, 127); s = 0 -> q = 0.  -> (codes I8, scales F32, decoded)."""
    n, eb = _blocks(e, block)
    amax = eb.abs().amax(dim=1)
    sc = amax / 127.0
    safe = torch.where(sc > 0, sc, torch.ones_like(sc))
    r = torch.round(eb / safe[:, None])         # torch.round: half to even, as rintf
    r = torch.where(sc[:, None] > 0, r, torch.zeros_like(r)).clamp(-127, 127)
    q = r.to(torch.int8)
    dec = q.to(torch.float32) * sc[:, None]     # (float)q * s, one F32 multiplication
    return q.reshape(-1)[:n], sc, dec.reshape(-1)[:n]


def _midpoints(table):
    """The midpoints between consecutive element values: exact in F32 (the values have few bits)."""
    return [(a + b) / 2 for a, b in zip(table, table[1:])]


E4M3_MIDS, E2M1_MIDS = _midpoints(E4M3), _midpoints(E2M1)


def _nearest_codes(w: torch.Tensor, mids: torch.Tensor) -> torch.Tensor:
    """The code of the element value nearest w (F32, >= 0), ties to the even code, saturating at the
    last code.  compress.c compares w - values[lo] with values[lo + 1] - w in double; that is comparing
    w with the midpoint, which F32 does exactly here (w = |v| * 2^-shared is exact in F32 except below
    2^-126, far under the first midpoint)."""
    code = torch.bucketize(w, mids)                 # mids strictly below w: a tie gets the lower code
    tie = (mids[code.clamp(max=mids.numel() - 1)] == w) & (code % 2 == 1)
    return code + tie.to(code.dtype)


def _encode_mx(e, fp4):
    """OCP MX: shared = floor(log2(amax)) - emax clamped to [-127, 127]; codes by nearest value.
    -> (codes as uint8 bytes, scales E8M0 as uint8, decoded F32)."""
    emax = 2 if fp4 else 8
    table = E2M1 if fp4 else E4M3
    n, eb = _blocks(e, MX_BLOCK)
    amax = eb.abs().amax(dim=1)
    # floor(log2(amax)) from the F32 exponent bits; a subnormal or zero amax clamps to -127 either way
    bexp = (amax.view(torch.int32) >> 23) & 0xFF
    shared = (bexp - 127 - emax).clamp(-127, 127)
    scales = (shared + 127).to(torch.uint8)
    values = torch.tensor(table, dtype=torch.float32, device=e.device)
    mids = torch.tensor(E2M1_MIDS if fp4 else E4M3_MIDS, dtype=torch.float32, device=e.device)
    # 2^-shared in F32: shared is within [-127, 125] here, a normal or (2^127) exact power of two
    w = eb.abs() * torch.pow(2.0, (-shared).to(torch.float64)).to(torch.float32)[:, None]
    code = _nearest_codes(w.reshape(-1), mids).view(eb.shape)
    neg = eb.view(torch.int32) < 0                # the sign bit: -0 keeps its sign
    dec_mag = values[code]
    scale_f32 = torch.pow(2.0, (scales.to(torch.float64) - 127)).to(torch.float32)  # 2^(e-127), exact in F32
    dec = torch.where(neg, -dec_mag, dec_mag) * scale_f32[:, None]
    sign = 8 if fp4 else 0x80
    code = code + neg.to(code.dtype) * sign
    code = code.reshape(-1)[:n]
    if fp4:
        pair = code.view(-1, 2)
        codes = (pair[:, 0] | (pair[:, 1] << 4)).to(torch.uint8)
    else:
        codes = code.to(torch.uint8)
    return codes, scales, dec.reshape(-1)[:n]


def encode_tensor(e: torch.Tensor, encode: str, block: int):
    """e: 1-D F32 (the error, delta + residual).  -> (codes, scales, decoded e)."""
    if encode == "int8_block":
        return _encode_int8(e, block)
    return _encode_mx(e, encode == "mxfp4")


def _encodable(encode, t):
    return not t.is_complex() and (encode != "mxfp4" or t.numel() % 2 == 0)


class EncodedDelta:
    """A delta file ready to send: header bytes plus its tensors' data, streamed by write_to()."""

    def __init__(self, tensors, metadata):
        """tensors: {name: (st dtype name, shape, tensor whose memory bytes are the data, or a function
        that makes it when it is written)}."""
        specs = [(name, dt, shape) for name, (dt, shape, _) in tensors.items()]
        self.header, self.layout = _st.build_header(specs, metadata)
        self.tensors = tensors
        self.metadata = dict(metadata)
        self.size = len(self.header) + (self.layout[-1][2] if self.layout else 0)

    def write_to(self, f):
        """Writes the file to f (a binary file object) tensor by tensor: never a second copy of the whole."""
        f.write(self.header)
        for name, _, _ in self.layout:
            f.write(_st.tensor_bytes(self._data(name)))

    def chunks(self):
        yield self.header
        for name, _, _ in self.layout:
            mv = _st.tensor_bytes(self._data(name))
            if len(mv):
                yield mv

    def _data(self, name):
        t = self.tensors[name][2]
        return t() if callable(t) else t

    def __len__(self):
        return self.size

    def __bytes__(self):
        b = io.BytesIO()
        self.write_to(b)
        return b.getvalue()


def split_delta(delta, shard_size, base):
    """delta (an EncodedDelta) split as huggingface_hub.save_torch_state_dict(max_shard_size=shard_size) splits
    a state dict: its tensors in order, a new shard when the next would take the current one past
    shard_size, a tensor larger than that in a shard of its own, a compressed key's scales in its codes'
    shard (dilocod refuses a set that parts them).  Each shard's metadata is {"format": "pt"}; the delta's is
    in the index, {"metadata": {"total_size": T, ...}, "weight_map": {...}} (json.dump, indent=2).
    -> None when one shard is enough (the plain file is sent), else ([(shard file name, EncodedDelta)],
    the index's bytes), the shards named <base>-0000i-of-0000N.safetensors."""
    if type(shard_size) is not int or shard_size <= 0:
        raise ValueError(f"shard_size must be a positive number of bytes, not {shard_size!r}")
    sizes = {name: end - begin for name, begin, end in delta.layout}
    units = []
    for name in delta.tensors:
        key = name[:-len(SCALES_SUFFIX)] if name.endswith(SCALES_SUFFIX) else None
        if key is not None and units and units[-1][0] == key:
            units[-1].append(name)
        else:
            units.append([name])
    shards, current, run = [], [], 0
    for unit in units:
        n = sum(sizes[x] for x in unit)
        if n > shard_size:
            shards.append(unit)
            continue
        if current and run + n > shard_size:
            shards.append(current)
            current, run = [], 0
        current.extend(unit)
        run += n
    if current:
        shards.append(current)
    if len(shards) <= 1:
        return None
    if len(shards) > 99999:
        raise ValueError(f"shard_size {shard_size} cuts the delta into {len(shards)} shards, more than five digits name")
    names = [f"{base}-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    parts = [(names[i], EncodedDelta({k: delta.tensors[k] for k in s}, {"format": "pt"})) for i, s in enumerate(shards)]
    index = {"metadata": {"total_size": sum(sizes.values()), **delta.metadata},
             "weight_map": {k: names[i] for i, s in enumerate(shards) for k in s}}
    return parts, json.dumps(index, indent=2).encode("utf-8")


def delta_metadata(node_id, base_outer_step, local_step, encode=None, block=None, extra=None):
    meta = {"algorithm": ALGORITHM, "base_outer_step": str(int(base_outer_step)),
            "local_step": str(int(local_step)), "node_id": node_id}
    if encode is not None:
        meta["encoding"], meta["block"] = encode, str(block)
    for k, v in (extra or {}).items():
        if k in meta:
            raise ValueError(f"metadata key {k!r} is the delta's own")
        meta[k] = v
    return meta


def _floating(state):
    return [k for k, v in state.items() if v.is_floating_point() or v.is_complex()]


def _as_f32(t):
    """The delta's arithmetic type: F32, and C64 as pairs of F32 (libdiloco's lanes)."""
    if t.is_complex():
        return torch.view_as_real(t.to(torch.complex64)).reshape(-1)
    return t.to(torch.float32).reshape(-1)


def check_pair(baseline, current):
    if baseline.keys() != current.keys():
        missing, extra = sorted(set(baseline) - set(current)), sorted(set(current) - set(baseline))
        raise ValueError(f"the model's keys differ from the baseline's: missing {missing[:5]}, extra {extra[:5]}")
    for k, b in baseline.items():
        c = current[k]
        if tuple(b.shape) != tuple(c.shape) or b.dtype != c.dtype:
            raise ValueError(f"tensor {k!r}: the model has {c.dtype} {list(c.shape)}, the baseline "
                             f"{b.dtype} {list(b.shape)}")
        if k.endswith(SCALES_SUFFIX):
            raise ValueError(f"the model's key {k!r} ends in {SCALES_SUFFIX}, which compressed deltas reserve")


def plain_delta(baseline, current, metadata):
    """The uncompressed delta: float32(baseline) - float32(current) for floating keys (C64 stays C64)."""
    check_pair(baseline, current)
    tensors = {}
    for k in _floating(baseline):
        c = current[k].detach()
        b = baseline[k].to(c.device)
        if c.is_complex():
            d = b.to(torch.complex64) - c.to(torch.complex64)
            tensors[k] = ("C64", tuple(c.shape), d)
        else:
            # computed as it is sent, tensor by tensor: a whole F32 delta is never held at once
            tensors[k] = ("F32", tuple(c.shape), lambda b=b, c=c: b.float() - c.float())
    return EncodedDelta(tensors, metadata)


def encode_delta(baseline, current, encode, *, block=None, residual=None, metadata):
    """The compressed delta of `current` against `baseline` ({name: tensor} state dicts, the same keys,
    shapes and dtypes), with error feedback through `residual` (the previous call's, or None for zero):
    e = (baseline - current) + residual, out = encode(e), residual' = e - decode(out).
    -> (EncodedDelta, residual'): residual' holds an F32 tensor per floating key on current's device
    (C64 keys, stored plain, and mxfp4 keys of an odd count, likewise, leave zeros).
    metadata: the delta's metadata (delta_metadata()); `encoding` and `block` are set here."""
    block = check_spec(encode, block)
    check_pair(baseline, current)
    meta = dict(metadata)
    meta["encoding"], meta["block"] = encode, str(block)
    tensors, new_res = {}, {}
    for k in _floating(baseline):
        c = current[k].detach()
        dev = c.device
        e = _as_f32(baseline[k].to(dev)) - _as_f32(c)
        if residual is not None:
            r = residual.get(k)
            if r is None or r.numel() != e.numel():
                raise ValueError(f"residual does not match the model at {k!r}")
            e = e + r.to(dev).reshape(-1)
        if not torch.isfinite(e).all() or (e.abs() >= 2.0 ** 64).any():
            raise ValueError(f"tensor {k!r}: the delta (with the residual) holds a value that is not finite "
                             "or of magnitude 2^64 or more")
        rshape = tuple(c.shape) + ((2,) if c.is_complex() else ())
        if not _encodable(encode, c):
            tensors[k] = ("C64" if c.is_complex() else "F32", tuple(c.shape), e)
            new_res[k] = torch.zeros(rshape, dtype=torch.float32, device=dev)
            continue
        codes, scales, dec = encode_tensor(e, encode, block)
        tensors[k] = ({"int8_block": "I8", "mxfp8": "F8_E4M3", "mxfp4": "F4"}[encode], tuple(c.shape), codes)
        tensors[k + SCALES_SUFFIX] = ("F32" if encode == "int8_block" else "F8_E8M0", (scales.numel(),), scales)
        new_res[k] = (e - dec).view(rshape)
    return EncodedDelta(tensors, meta), new_res


def residual_file(residual, baseline, encode, block) -> bytes:
    """The residual as `diloco delta --residual` writes it (F32 per floating key, C64 for C64 keys;
    metadata block and encoding): for comparing with the tool and for keeping across restarts."""
    tensors = {}
    for k, r in residual.items():
        b = baseline[k]
        if b.is_complex():
            tensors[k] = ("C64", tuple(b.shape), r)
        else:
            tensors[k] = ("F32", tuple(b.shape), r)
    return bytes(EncodedDelta(tensors, {"block": str(block), "encoding": encode}))
