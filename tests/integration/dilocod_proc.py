"""Helpers for tests that run the real dilocod: a process wrapper, a worker that writes deltas the way
the Python reference does (safetensors save_file with the reference metadata), and a torch oracle of
the outer step (sum(deltas) / len(deltas) and torch.optim.SGD on F32 copies of the weights, rounded back
to each weight's dtype)."""
import json
import os
import re
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

import numpy as np
import torch
from safetensors.numpy import save_file, load_file

from conftest import BUILD

FLOAT_KINDS = ("f", "c")


def torch_dtype_name(t):
    return str(t.dtype).replace("torch.", "")


class Dilocod:
    """A dilocod process with a file:// hub.  Logs go to <tmp>/dilocod-N.log."""

    def __init__(self, tmp: Path, hub, *args, state_root=None, env=None, make_hub=True):
        self.make_hub = make_hub        # False: the test gives --create-hub, or wants the refusal
        self.tmp = Path(tmp)
        self.hub = Path(hub) if hub is not None else None
        self.state_root = Path(state_root) if state_root else self.tmp / "state"
        self.args = list(args)
        self.env = env
        self.proc = None
        self.logs = []

    @property
    def state_dir(self) -> Path:
        return self.state_root / "aggregator"

    def start(self, *extra):
        n = len(self.logs)
        log = self.tmp / f"dilocod-{n}.log"
        self.logs.append(log)
        hub = ["--hub", f"file://{self.hub}"] if self.hub is not None else ["--hub", "none"]
        if self.make_hub and self.hub is not None and not os.path.lexists(self.hub):
            self.hub.mkdir(parents=True)        # as an operator does: dilocod refuses a hub that does not exist
        listen = [] if any(str(a).startswith("--listen") for a in (*self.args, *extra)) else ["--listen", "127.0.0.1:0"]
        cmd = [str(BUILD / "dilocod"), "--state-root", str(self.state_root), *hub, *listen,
               "--poll-interval", "0.05", "--log-level", "debug", *self.args, *extra]
        env = dict(os.environ, **(self.env or {}))
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=open(log, "wb"), env=env)
        return self

    @property
    def port(self) -> int:
        """The HTTP port (the helper listens on 127.0.0.1:0 unless told otherwise)."""
        deadline = time.time() + 30
        while time.time() < deadline:
            m = re.findall(r"http: listening addr=\S+ port=(\d+)", self.logs[-1].read_text(errors="replace")
                           if self.logs and self.logs[-1].exists() else "")
            if m:
                return int(m[-1])
            if self.proc is not None and self.proc.poll() is not None:
                raise AssertionError(f"dilocod exited with {self.proc.returncode}:\n{self.log_text()[-4000:]}")
            time.sleep(0.02)
        raise AssertionError("dilocod did not report its HTTP port")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log_text(self) -> str:
        return "".join(p.read_text(errors="replace") for p in self.logs if p.exists())

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, sig=signal.SIGTERM, timeout=60) -> int:
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        rc = self.proc.wait(timeout=timeout)
        self.proc = None
        return rc

    def kill9(self):
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(timeout=30)
            self.proc = None

    def published_step(self):
        try:
            return json.loads((self.hub / "global" / "step_count.json").read_text())["outer_step"]
        except (OSError, ValueError, KeyError):
            return None

    def wait_step(self, step, timeout=60):
        deadline = time.time() + timeout
        while time.time() < deadline:
            s = self.published_step()
            if s is not None and s >= step:
                return s
            if self.proc is not None and self.proc.poll() is not None:
                raise AssertionError(f"dilocod exited with {self.proc.returncode}:\n{self.log_text()[-4000:]}")
            time.sleep(0.02)
        raise AssertionError(f"step {step} not published within {timeout}s (at {self.published_step()}):\n"
                             f"{self.log_text()[-4000:]}")

    def wait_until(self, pred, what, timeout=30):
        """Waits until pred() is true while dilocod runs; fails with what and the log's tail."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            if pred():
                return
            assert self.alive(), self.log_text()[-3000:]
            time.sleep(0.02)
        raise AssertionError(f"timed out waiting for {what}:\n{self.log_text()[-3000:]}")

    def wait_log(self, needle, timeout=30, count=1):
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.log_text().count(needle) >= count:
                return
            time.sleep(0.02)
        raise AssertionError(f"{needle!r} not logged {count}x within {timeout}s:\n{self.log_text()[-4000:]}")

    def durable_step(self):
        """The step outer_metadata.json names (its files are durable), or None."""
        try:
            return json.loads((self.state_dir / "outer_metadata.json").read_text())["outer_step"]
        except (OSError, ValueError, KeyError):
            return None

    def committed_step(self):
        """The committed step: a round is committed by its redo record (redo.json), durable before the
        step is served or published; outer_metadata.json follows once the step's files are durable.
        The redo record is read first: the settle names the step in outer_metadata.json before it removes
        redo.json, so a record gone by now means outer_metadata.json, read after, names its step."""
        try:
            redo = json.loads((self.state_dir / "redo.json").read_text())["step"]
        except (OSError, ValueError, KeyError):
            redo = None
        durable = self.durable_step()
        if redo is None:
            return durable
        return redo if durable is None else max(durable, redo)

    def get_json(self, path):
        """GET path of the HTTP API, parsed, or None while it cannot be read."""
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        try:
            with opener.open(self.url + path, timeout=5) as r:
                return json.loads(r.read())
        except (OSError, ValueError):
            return None

    def pipeline(self):
        """/status's pipeline: [{step, state, since, published, attempts, busy, failed}] of the steps in
        flight and the last ones done (server/core/pipeline.h), or None while it cannot be read."""
        doc = self.get_json("/status")
        return doc.get("pipeline") if isinstance(doc, dict) else None

    def rounds(self):
        """GET /rounds's records (the history), in order."""
        doc = self.get_json("/rounds")
        assert isinstance(doc, dict), f"GET /rounds failed:\n{self.log_text()[-3000:]}"
        return doc["rounds"]

    def wait_pipeline(self, step, states, what, timeout):
        """Waits until the pipeline has step, or a later one, in one of states (a later step is never
        further behind: its commit waited for step's settle); -> that record's step."""
        deadline = time.time() + timeout
        recs = None
        while time.time() < deadline:
            recs = self.pipeline()
            for rec in recs or ():
                if rec["step"] >= step and rec["state"] in states:
                    return rec["step"]
            if self.proc is not None and self.proc.poll() is not None:
                raise AssertionError(f"dilocod exited with {self.proc.returncode}:\n{self.log_text()[-4000:]}")
            time.sleep(0.01)
        raise AssertionError(f"step {step} not {what} within {timeout}s (pipeline {recs}):\n"
                             f"{self.log_text()[-4000:]}")

    def wait_durable(self, step, timeout=60):
        """Waits until step (or a later one) is durable: outer_metadata.json names it, the redo record is
        gone."""
        return self.wait_pipeline(step, ("durable", "cleaned"), "durable", timeout)

    def wait_settled(self, step, timeout=60):
        """wait_durable, then the cleanup that follows it (a later job) removed the earlier steps'
        global, momentum and delta cache: walking the state directory before that races with the
        removal."""
        return self.wait_pipeline(step, ("cleaned",), "cleaned", timeout)

    def wait_received(self, step, nodes, timeout=60):
        """Waits until step collects with nodes' deltas accepted (/status's pipeline and round)."""
        def collecting():
            doc = self.get_json("/status")
            if not isinstance(doc, dict) or not isinstance(doc.get("round"), dict):
                return False
            received = {e["node_id"] for e in doc["round"]["received"]}
            return doc["round"]["step"] == step - 1 and set(nodes) <= received and \
                any(rec["step"] == step and rec["state"] == "collecting" for rec in doc["pipeline"])
        self.wait_until(collecting, f"step {step} collecting with {nodes} accepted", timeout)

    def wait_killed_at(self, state, step, timeout=60):
        """Waits until the process, started with DILOCOD_TEST_CRASH_AT=<state>:<step> (server/core/pipeline.h),
        killed itself as step entered state."""
        try:
            rc = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"not killed at {state} (pipeline {self.pipeline()}):\n"
                                 f"{self.log_text()[-4000:]}") from None
        self.proc = None
        assert rc == -signal.SIGKILL, f"exited with {rc}, not killed at {state}:\n{self.log_text()[-4000:]}"
        needle = f"pipeline: test hook: killed step={step} state={state}"
        assert needle in self.logs[-1].read_text(errors="replace"), self.log_text()[-4000:]

    def global_state(self):
        return load_file(str(self.hub / "global" / "latest.safetensors"))


def part_sizes(incoming: Path, pattern: str) -> dict:
    """{name: size} of the partial downloads matching pattern in incoming (a state's cache/incoming):
    a download that finishes between the listing and its stat is left out."""
    sizes = {}
    for p in incoming.glob(pattern) if incoming.exists() else ():
        try:
            sizes[p.name] = p.stat().st_size
        except FileNotFoundError:
            pass
    return sizes


def write_model(path: Path, state: dict):
    """Saves a {name: torch tensor} model with safetensors.torch (BF16 needs torch)."""
    from safetensors.torch import save_file as torch_save
    torch_save({k: v.contiguous() for k, v in state.items()}, str(path))


def load_torch(path: Path) -> dict:
    from safetensors.torch import load_file as torch_load
    return torch_load(str(path))


def delta_metadata(node_id, base_step, local_step):
    return {"algorithm": "dumb_diloco", "base_outer_step": str(base_step), "local_step": str(local_step),
            "node_id": node_id}


def pad_header(path, extra):
    """Lengthens a safetensors file's JSON header by extra spaces (the reference accepts any header
    length), so that its data starts at an offset of another alignment."""
    raw = Path(path).read_bytes()
    n = int.from_bytes(raw[:8], "little")
    Path(path).write_bytes((n + extra).to_bytes(8, "little") + raw[8:8 + n] + b" " * extra + raw[8 + n:])


def write_delta(hub: Path, node_id: str, base_step: int, local_step: int, tensors: dict, metadata=None,
                atomic=True, header_pad=0) -> Path:
    """Writes nodes/<id>/delta_<local>.safetensors with numpy tensors, the reference's metadata, and
    (by default) temp file + rename so dilocod never sees a partial file; header_pad: pad_header's."""
    d = Path(hub) / "nodes" / node_id
    d.mkdir(parents=True, exist_ok=True)
    final = d / f"delta_{local_step}.safetensors"
    meta = metadata if metadata is not None else delta_metadata(node_id, base_step, local_step)
    if atomic:
        tmp = d / f".delta_{local_step}.tmp"
        save_file(tensors, str(tmp), metadata=meta)
        if header_pad:
            pad_header(tmp, header_pad)
        os.rename(tmp, final)
    else:
        save_file(tensors, str(final), metadata=meta)
    return final


class Oracle:
    """The outer step computed by torch itself, as the reference runs it: the mean is
    sum(deltas) / len(deltas) over F32 tensors in ascending node id order (F16/BF16 deltas upcast
    first), then torch.optim.SGD (nesterov or not, momentum or not) steps F32 copies of the floating
    weights, reloaded each round from the stored (rounded) weights as dilocod reloads the published
    global, and the results are rounded to each weight's dtype; non-floating state is carried unchanged.
    The momentum buffers live in the optimizer, in F32, across rounds.  Complex weights are stepped as
    pairs of F32 (torch.view_as_real), which is dilocod's contract for C64 (torch's complex kernels
    round their multiply and divide differently)."""

    def __init__(self, init_state: dict, lr=0.7, momentum=0.9, nesterov=True):
        self.state = {k: v.clone() for k, v in init_state.items()}
        self.floating = [k for k, v in init_state.items() if v.is_floating_point() or v.is_complex()]
        self.params = {k: torch.nn.Parameter(self._f32(init_state[k])) for k in self.floating}
        self.opt = torch.optim.SGD(list(self.params.values()), lr=lr, momentum=momentum,
                                   nesterov=nesterov and momentum > 0)

    @staticmethod
    def _f32(t):
        if not isinstance(t, torch.Tensor):
            t = torch.tensor(np.asarray(t))        # a copy; keeps 0-d arrays 0-d
        if t.is_complex():
            return torch.view_as_real(t.to(torch.complex64)).clone()
        return t.to(torch.float32)

    def mean(self, deltas_by_node: dict, key):
        """torch's sum(...) / len(...) in ascending node id order (sum starts from the integer 0)."""
        order = sorted(deltas_by_node)
        return sum(self._f32(deltas_by_node[node][key]) for node in order) / len(order)

    def step(self, deltas_by_node: dict):
        for k in self.floating:
            self.params[k].grad = self.mean(deltas_by_node, k)
            with torch.no_grad():
                self.params[k].copy_(self._f32(self.state[k]))
        self.opt.step()
        for k in self.floating:
            p = self.params[k].detach()
            if self.state[k].is_complex():
                self.state[k] = torch.view_as_complex(p.contiguous()).to(self.state[k].dtype).clone()
            else:
                self.state[k] = p.to(self.state[k].dtype).clone()
        return self.state

    def momentum(self) -> dict:
        """The optimizer's momentum buffers by key (F32; complex keys as F32 pairs), or {} before any."""
        out = {}
        for k in self.floating:
            buf = self.opt.state.get(self.params[k], {}).get("momentum_buffer")
            if buf is not None:
                out[k] = buf.clone()
        return out


def module_for(state: dict):
    """A torch module whose state_dict has state's keys (nested submodules, buffers at the leaves), for
    huggingface_hub.load_torch_model."""
    root = torch.nn.Module()
    for key, v in state.items():
        *path, leaf = key.split(".")
        mod = root
        for part in path:
            if not hasattr(mod, part):
                mod.add_module(part, torch.nn.Module())
            mod = getattr(mod, part)
        mod.register_buffer(leaf, torch.zeros_like(v))
    return root


def random_deltas(rng: np.random.Generator, model: dict, scale=0.01) -> dict:
    """One node's delta for a torch model: F32 (complex64 for complex weights), floating keys only."""
    out = {}
    for k, v in model.items():
        if v.is_complex():
            re = rng.standard_normal(tuple(v.shape)).astype(np.float32) * scale
            im = rng.standard_normal(tuple(v.shape)).astype(np.float32) * scale
            out[k] = np.asarray(re + 1j * im, dtype=np.complex64)
        elif v.is_floating_point():
            out[k] = np.asarray(rng.standard_normal(tuple(v.shape)) * scale, dtype=np.float32)
    return out


def assert_state_equal(got: dict, want: dict):
    """Equal key sets, dtypes and shapes, and every tensor's bytes identical (what dilocod promises
    against Oracle on a CPU where torch runs its AVX2/AVX-512 kernels)."""
    assert sorted(got) == sorted(want), (sorted(got), sorted(want))
    for k in want:
        g, w = got[k], want[k]
        assert g.dtype == w.dtype, (k, g.dtype, w.dtype)
        assert tuple(g.shape) == tuple(w.shape), (k, g.shape, w.shape)
        gb = g.contiguous().view(torch.uint8) if g.dim() else g.reshape(1).view(torch.uint8)
        wb = w.contiguous().view(torch.uint8) if w.dim() else w.reshape(1).view(torch.uint8)
        if not torch.equal(gb, wb):
            gf = torch.view_as_real(g) if g.is_complex() else g
            wf = torch.view_as_real(w) if w.is_complex() else w
            ne = (gf != wf) | (torch.signbit(gf) != torch.signbit(wf)) if gf.is_floating_point() else gf != wf
            raise AssertionError(f"{k}: {int(ne.sum())} of {ne.numel()} elements differ from torch, "
                                 f"max |diff| {(gf.double() - wf.double()).abs().max().item()}")


def assert_state_close(got: dict, want: dict, rtol=1e-5, atol=1e-6, ulps=None):
    """Equal key sets, dtypes and shapes; non-floating values identical; floating values within
    float32 tolerance of the oracle.  dilocod matches Oracle bit for bit (assert_state_equal); this
    looser check is for comparisons that do not need that."""
    assert sorted(got) == sorted(want), (sorted(got), sorted(want))
    for k in want:
        g, w = got[k], want[k]
        assert g.dtype == w.dtype, (k, g.dtype, w.dtype)
        assert tuple(g.shape) == tuple(w.shape), (k, g.shape, w.shape)
        if not (w.is_floating_point() or w.is_complex()):
            assert torch.equal(g, w), k
            continue
        gf = g.to(torch.complex128) if w.is_complex() else g.to(torch.float64)
        wf = w.to(torch.complex128) if w.is_complex() else w.to(torch.float64)
        if w.dtype in (torch.float16, torch.bfloat16):
            # one rounding step of the storage dtype: compare in units of its epsilon
            eps = torch.finfo(w.dtype).eps
            tol = eps * wf.abs().clamp(min=torch.finfo(w.dtype).tiny) * 1.01
            assert ((gf - wf).abs() <= tol).all(), (k, (gf - wf).abs().max().item())
        else:
            assert torch.allclose(gf, wf, rtol=rtol, atol=atol), (k, (gf - wf).abs().max().item())
