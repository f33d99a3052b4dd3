"""The real dilocod against the real torch.optim.SGD, bit for bit: 10 rounds of F32, F16, BF16, F64 and
C64 weights (plus carried integer state), for Nesterov SGD, heavy-ball momentum and plain SGD.  Every
published global/latest.safetensors must equal, byte for byte, the file safetensors writes for the state
torch computes with the same deltas (dilocod_proc.Oracle: sum(deltas) / len(deltas), then
torch.optim.SGD on F32 copies of the weights), and every persisted momentum buffer must equal torch's.

torch fuses the multiply-adds of SGD's add(x, alpha=...) steps in its AVX2 and AVX-512 CPU kernels;
with its non-FMA kernels (CPUs without AVX2+FMA, or ATEN_CPU_CAPABILITY=default) it rounds them twice
and dilocod, which computes the fused result on every CPU, is then not expected to match it."""
import json

import numpy as np
import pytest
import torch
from safetensors.torch import save as st_save

from dilocod_proc import Dilocod, Oracle, assert_state_equal, load_torch, write_delta, write_model

ROUNDS = 10
NODES = ["n2", "n0", "n1"]          # written in this order; the mean is taken in ascending id order


def torch_cpu_capability():
    for line in torch.__config__.show().splitlines():
        if "CPU capability usage:" in line:
            return line.split(":", 1)[1].strip()
    return "unknown"


pytestmark = pytest.mark.skipif(
    torch_cpu_capability() not in ("AVX2", "AVX512"),
    reason=f"torch runs its {torch_cpu_capability()} kernels here, which do not fuse multiply-adds; dilocod "
           "computes what torch computes with AVX2/AVX-512 kernels on every CPU")


def model(seed):
    """Sizes that are not multiples of torch's or dilocod's vector widths, so tails run too; a few exact
    -0.0 weights (the sign of a zero result depends on the order and fusion of the operations)."""
    g = torch.Generator().manual_seed(seed)
    m = {
        "f32.w": torch.randn(37, 29, generator=g),
        "f32.b": torch.randn(1003, generator=g),
        # several of the pass's work items, sub-blocks and vector blocks, read in place from the page cache
        "f32.big": torch.randn(401, 1009, generator=g),
        "f16.w": torch.randn(23, 19, generator=g).to(torch.float16),
        "bf16.w": torch.randn(31, 17, generator=g).to(torch.bfloat16),
        "f64.w": torch.randn(211, generator=g, dtype=torch.float64),
        "c64.w": torch.randn(57, generator=g, dtype=torch.complex64),
        "step": torch.tensor([7, -3], dtype=torch.int64),
        "mask": torch.tensor([True, False, True]),
    }
    m["f32.b"][::97] = -0.0
    return m


def round_deltas(rng, state, r):
    """One delta per node: F32 from n0 and n2, F16 from n1 (dilocod upcasts it exactly, so must the
    oracle), a few exact -0.0 and +0.0 entries, magnitudes that change over the rounds."""
    out = {}
    for i, node in enumerate(sorted(NODES)):
        d = {}
        for k, v in state.items():
            if not (v.is_floating_point() or v.is_complex()):
                continue
            scale = 0.02 * (1 + (r + i) % 3)
            shape = tuple(v.shape)
            if v.is_complex():
                x = (rng.standard_normal(shape) + 1j * rng.standard_normal(shape)) * scale
                d[k] = np.asarray(x, dtype=np.complex64)
                continue
            x = (rng.standard_normal(shape) * scale).astype(np.float32)
            flat = x.reshape(-1)
            flat[::53] = -0.0
            flat[1::61] = 0.0
            d[k] = x.astype(np.float16) if node == "n1" else x
        out[node] = d
    return out


def unfused_state(state, lr, momentum, nesterov, bufs, mean):
    """One step with every product rounded before its add (what dilocod did before it fused): used only
    to show that this test's data tells the two apart."""
    out = {}
    for k, g in mean.items():
        p = Oracle._f32(state[k])
        if momentum:
            buf = g.clone() if k not in bufs else torch.add(torch.mul(bufs[k], momentum), g)
            d = torch.add(g, torch.mul(buf, momentum)) if nesterov else buf
        else:
            d = g
        out[k] = torch.sub(p, torch.mul(d, lr))
    return out


CASES = {
    "nesterov": ([], dict(lr=0.7, momentum=0.9, nesterov=True)),
    "momentum": (["--optimizer", "sgd", "--lr", "0.37", "--momentum", "0.85"],
                 dict(lr=0.37, momentum=0.85, nesterov=False)),
    "plain": (["--optimizer", "sgd", "--lr", "0.9"], dict(lr=0.9, momentum=0.0, nesterov=False)),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_ten_rounds_equal_torch_sgd_byte_for_byte(tmp_path, case):
    args, opt = CASES[case]
    init = model(5)
    init_path = tmp_path / "init.safetensors"
    write_model(init_path, init)
    oracle = Oracle(init, **opt)
    rng = np.random.default_rng(2024)
    hub = tmp_path / "hub"
    d = Dilocod(tmp_path, hub, "--init-model", str(init_path), "--expected-nodes", str(len(NODES)),
                "--threads", "2", *args).start()
    fused_mattered = 0
    try:
        d.wait_step(0)
        for r in range(ROUNDS):
            deltas = round_deltas(rng, oracle.state, r)
            for node in NODES:
                # n2's data at an odd offset in odd rounds: the pass reads it with pread, not in place
                write_delta(hub, node, r, 10 * (r + 1), deltas[node], header_pad=1 if node == "n2" and r % 2 else 0)
            bufs_before = oracle.momentum()
            state_before = dict(oracle.state)
            want = oracle.step(deltas)
            assert d.wait_step(r + 1) == r + 1
            got_bytes = (hub / "global" / "latest.safetensors").read_bytes()
            got = load_torch(hub / "global" / "latest.safetensors")
            assert_state_equal(got, want)
            # the whole file, as the reference's safetensors writer produces it from torch's state
            assert got_bytes == st_save({k: v.contiguous() for k, v in want.items()}), f"round {r}"
            # momentum as dilocod persisted it (F32; C64 holds F32 pairs) against torch's buffers
            d.wait_durable(r + 1)              # momentum is read from the step's durable files
            meta = json.loads((d.state_dir / "outer_metadata.json").read_text())
            assert meta["outer_step"] == r + 1
            if opt["momentum"]:
                mom = load_torch(d.state_dir / meta["outer_state_file"])
                want_mom = oracle.momentum()
                assert sorted(mom) == sorted(want_mom)
                for k, buf in want_mom.items():
                    m = torch.view_as_real(mom[k]) if mom[k].is_complex() else mom[k]
                    assert m.dtype == torch.float32 and torch.equal(m.view(torch.int32), buf.view(torch.int32)), \
                        (r, k, int((m != buf).sum()))
            else:
                assert meta.get("outer_state_file") in (None, "")
            mean = {k: oracle.mean(deltas, k) for k in oracle.floating}
            alt = unfused_state(state_before, opt["lr"], opt["momentum"], opt["nesterov"], bufs_before, mean)
            fused_mattered += sum(int((alt[k] != Oracle._f32(want[k]).to(torch.float32)).sum())
                                  for k in ("f32.w", "f32.b"))
        # non-floating state carried unchanged
        assert torch.equal(got["step"], init["step"]) and torch.equal(got["mask"], init["mask"])
        # a test that could not tell fused from separately rounded steps would prove nothing
        assert fused_mattered > 0
    finally:
        assert d.stop() == 0
