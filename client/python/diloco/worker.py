"""diloco.Worker: pull the global, push the pseudo-gradient, wait for the next step."""
import math
import re
import time
from dataclasses import dataclass
from typing import Optional

import torch

from . import _st
from .blockhash import block_hash_bytes
from .downlink import apply_update
from .encode import check_spec, delta_metadata, encode_delta, plain_delta, split_delta
from .errors import HostileAnswer
from .rounds import RecordChain
from .transport import FileTransport, HfTransport, HttpTransport, S3Transport, load_set

METRIC_KEYS = ("inner_steps", "tokens_per_second", "weight")
METRIC_NAME = re.compile(r"^[A-Za-z0-9_]{1,32}$")
NODE_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def followed_local_steps(recommended, local_steps):
    """The inner steps of the next phase when the server recommends `recommended` (None: none) to a
    worker that runs `local_steps`: the recommendation within [max(1, local_steps // 16), 4 * local_steps],
    dilocod's own range for it when --dylu-base-steps is local_steps.  A server's answer never makes a
    phase run for ever or shrink to nothing."""
    if recommended is None:
        return local_steps
    return min(max(int(recommended), max(1, local_steps // 16)), 4 * local_steps)


@dataclass
class PushResult:
    status: str                     # accepted, replaced, stale, written
    answer: Optional[dict]          # the server's JSON answer (None for a tree)
    recommended_local_steps: Optional[int]   # X-Recommended-Local-Steps, as the server sent it
    http_status: Optional[int] = None

    def local_steps(self, default):
        """The next phase's inner steps following the recommendation, bounded (followed_local_steps)."""
        return followed_local_steps(self.recommended_local_steps, default)


def _decimal(key, v):
    """A metric value as dilocod takes it: a finite decimal string."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ValueError(f"metric {key}: {v!r} is not a number")
    if isinstance(v, float) and not math.isfinite(v):
        raise ValueError(f"metric {key}: {v} is not finite")
    return str(v)


def _metrics(loss, tokens, metrics):
    out = {}
    if loss is not None and math.isfinite(float(loss)):
        out["loss"] = str(float(loss))
    if tokens is not None:
        out["num_tokens"] = str(int(tokens))
    for k, v in metrics.items():
        if k in METRIC_KEYS:
            out[k] = _decimal(k, v)
        elif METRIC_NAME.match(k):
            out["metric." + k] = _decimal(k, v)
        else:
            raise ValueError(f"metric name {k!r} is not [A-Za-z0-9_]{{1,32}}")
    return out


def _transport(url, token):
    if url.startswith(("http://", "https://")):
        return HttpTransport(url, token)
    if url.startswith("file://"):
        return FileTransport(url[len("file://"):])
    if url.startswith("s3://"):
        bucket, _, prefix = url[len("s3://"):].partition("/")
        if not bucket:
            raise ValueError(f"{url!r}: s3://bucket/prefix")
        return S3Transport(bucket, prefix)
    if url.startswith("hf://"):
        repo = url[len("hf://"):].strip("/")
        if repo.count("/") != 1:
            raise ValueError(f"{url!r}: hf://namespace/repo")
        return HfTransport(repo, token)
    raise ValueError(f"{url!r}: give http(s)://host:port, file:///dir, s3://bucket/prefix or hf://ns/repo")


class Worker:
    """One training process's link to dilocod.  See the package docstring for the loop."""

    def __init__(self, url, node_id, *, token=None, encode=None, block=None, error_feedback=True,
                 baseline_device="cpu", max_header_bytes=_st.MAX_HEADER_BYTES, listen=None, public_key=None,
                 min_step=None, downlink=False, max_replay=64, shard_size=None):
        if not NODE_ID.match(node_id):
            raise ValueError(f"node id {node_id!r} is not [A-Za-z0-9][A-Za-z0-9._-]{{0,127}}")
        self.node_id = node_id
        self.transport = _transport(url, token)
        # where the aggregator answers HTTP reads when deltas travel through a tree (its --listen)
        if listen is not None and not listen.startswith(("http://", "https://")):
            raise ValueError(f"listen {listen!r}: give the aggregator's http(s)://host:port")
        self._reads = self.transport if isinstance(self.transport, HttpTransport) else \
            HttpTransport(listen, token) if listen is not None else None
        # past shard_size bytes a delta is pushed as a sharded set (encode.split_delta: huggingface_hub's
        # layout, the index last), where the transport writes files one by one (file://, s3://)
        if shard_size is not None:
            if type(shard_size) is not int or shard_size <= 0:
                raise ValueError(f"shard_size must be a positive number of bytes, not {shard_size!r}")
            if not hasattr(self.transport, "put_delta_set"):
                raise ValueError("shard_size needs a file:// or s3:// url (a sharded delta is written file by file)")
        self.shard_size = shard_size
        self.encode = encode
        self.block = check_spec(encode, block) if encode is not None else None
        self.error_feedback = error_feedback
        self.baseline_device = torch.device(baseline_device)
        self.max_header_bytes = max_header_bytes
        self.step = None            # the outer step of the baseline
        self.baseline = None        # {name: tensor}: the global as pulled, on baseline_device
        self.residual = None        # error feedback: {name: F32 tensor} on the model's device
        self.last_local_step = None
        self._etag = None
        # the downlink (server/README.md, "The downlink"): the view's bytes, replayed in place
        if downlink and not hasattr(self.transport, "fetch_update"):
            raise ValueError("downlink=True works over http(s):// and file:// (dilocod --downlink publishes there)")
        self.downlink = downlink
        self.max_replay = max_replay        # further behind than this: the full view, not the updates
        self._view = None
        self.downlink_bytes = 0             # bytes downloaded by pulls (views and updates), all pulls
        self.last_pull_bytes = 0
        self.updates_applied = 0
        self.view_downloads = 0
        self.fallbacks = 0                  # updates missing or refused: the full view instead
        # public_key: the aggregator's Ed25519 key (diloco keygen's FILE.pub): every global is checked
        # against its step's signed record before it is loaded (diloco.rounds, errors.RecordRefused)
        self._chain = None
        if public_key is not None:
            if not hasattr(self.transport, "fetch_record"):
                raise ValueError("public_key= verifies globals read over http(s)://, file:// or s3://: signed records "
                                 "are not published on hf:// yet")
            self._chain = RecordChain(public_key, self.transport.fetch_record, min_step=min_step)
        elif min_step is not None:
            raise ValueError("min_step= goes with public_key= (it is the lowest step a verified global may have)")

    @property
    def record(self):
        """The signed record of the global installed last (public_key=), as a dict; None before."""
        return self._chain.record if self._chain is not None else None

    # ---- pull -------------------------------------------------------------------------------
    def _cap(self, model_state):
        """The largest global this model can take: its tensors, a header at its cap and the length."""
        return sum(v.numel() * v.element_size() for v in model_state.values()) + 8 + self.max_header_bytes

    @staticmethod
    def _check_strict(state, model_state):
        missing = sorted(set(model_state) - set(state))
        extra = sorted(set(state) - set(model_state))
        if missing or extra:
            raise HostileAnswer(f"the global's keys differ from the model's: missing {missing[:5]}, "
                                f"unexpected {extra[:5]}")
        for k, v in state.items():
            m = model_state[k]
            if tuple(v.shape) != tuple(m.shape) or v.dtype != m.dtype:
                raise HostileAnswer(f"global tensor {k!r} is {v.dtype} {list(v.shape)}, the model's "
                                    f"{m.dtype} {list(m.shape)}")

    def _baseline_of(self, state, model_state):
        pin = self.baseline_device.type == "cpu" and any(v.is_cuda for v in model_state.values())
        out = {}
        for k, v in state.items():
            b = v.to(self.baseline_device, copy=True)
            out[k] = b.pin_memory() if pin else b
        return out

    # ---- the downlink ---------------------------------------------------------------------------
    def _replay(self, target, cap):
        """Applies the updates after self.step up to target to the view in place.  -> bytes downloaded.
        Any failure drops the view (the caller downloads it whole)."""
        got = 0
        try:
            for s in range(self.step + 1, target + 1):
                u = self.transport.fetch_update(s, cap)
                if u is None:
                    raise HostileAnswer(f"update {s} is not available")
                got += len(u)
                step, base = apply_update(self._view, u, f"update {s}", self.max_header_bytes)
                if step != s or base != s - 1:
                    raise HostileAnswer(f"update {s} says step {step} on base {base}")
                self.step = s
                self.updates_applied += 1
        except BaseException:
            self._view = None
            raise
        finally:
            self.downlink_bytes += got
            self.last_pull_bytes += got
        return got

    def _fetch_view(self, target, cap):
        step, buf = self.transport.fetch_view(cap)
        self.downlink_bytes += len(buf)
        self.last_pull_bytes += len(buf)
        self.view_downloads += 1
        _st.parse(buf, max_header=self.max_header_bytes, what="view")
        self._view, self.step = bytearray(buf), step
        if step < target:
            self._replay(target, cap)       # a tree's checkpoint: the updates since

    def _sync_view(self, cap):
        """Brings the view to the newest step: its updates when it is a few steps behind, else (or when one
        is missing or refused) the view itself.  -> whether it changed."""
        target, want, _ = self.transport.downlink_info()
        self.last_pull_bytes = 0
        if self._view is not None and self.step == target:
            return False
        if self._view is not None:
            if self.step < target <= self.step + self.max_replay:
                try:
                    self._replay(target, cap)
                except (HostileAnswer, _st.FormatError, OSError):
                    self.fallbacks += 1
            else:
                self._view = None
        if self._view is None:
            self._fetch_view(target, cap)
        if want is not None and self.step == target and block_hash_bytes(self._view) != want:
            self._view = None
            raise HostileAnswer(f"the view of step {target} does not have step_count.json's view_hash {want}")
        if self._chain is not None:
            try:        # public_key=: the view's bytes are the ones its step's signed record names
                self._chain.check_view(self.step, self._view)
            except BaseException:
                self._view = None
                raise
        return True

    def _pull_view(self, model, strict):
        model_state = model.state_dict()
        if self._sync_view(self._cap(model_state)) or self.baseline is None:
            state = load_set({"view": self._view}, None, "view", self.max_header_bytes)
            self.baseline = self._accepted_baseline(state, model_state, strict)
        return self._load_baseline(model_state)

    def _accepted_baseline(self, state, model_state, strict):
        """state checked against the model (strict: every key; else the keys that match), as the new
        baseline; a verified record's step becomes the chain's last."""
        if strict:
            self._check_strict(state, model_state)
        else:
            state = {k: v for k, v in state.items()
                     if k in model_state and tuple(v.shape) == tuple(model_state[k].shape)}
        baseline = self._baseline_of(state, model_state)
        if self._chain is not None:
            self._chain.accept()
        return baseline

    def _load_baseline(self, model_state):
        with torch.no_grad():
            for k, v in self.baseline.items():
                model_state[k].copy_(v)
        return self.step

    def view_bytes(self):
        """The view's bytes as this worker holds them (a copy), None before the first pull."""
        return bytes(self._view) if self._view is not None else None

    def pull(self, model, strict=True) -> int:
        """Loads the newest global into model (names, shapes and dtypes must match unless strict=False:
        then matching keys load) and keeps it as the baseline.  Returns its outer step.  A global that
        is refused (errors.HostileAnswer, or with public_key= errors.RecordRefused) leaves the model as it
        was.  With downlink=True the model is the server's view (server/README.md, "The downlink"):
        downloaded once, then moved on by each step's compressed update, replayed bit for bit and checked by
        its block hash (with public_key=, by the one its step's signed record names too); the full view again
        when more than max_replay steps behind or when an update is missing or refused."""
        if self.downlink:
            return self._pull_view(model, strict)
        model_state = model.state_dict()
        verify = {"check": self._chain.check_global} if self._chain is not None else {}
        got = self.transport.fetch_global(self._etag if self.baseline is not None else None, self._cap(model_state),
                                          self.max_header_bytes, **verify)
        if got is not None:
            step, etag, state = got
            self.baseline, self.step, self._etag = self._accepted_baseline(state, model_state, strict), step, etag
        return self._load_baseline(model_state)

    # ---- push -------------------------------------------------------------------------------
    def push(self, model, *, local_step, loss=None, tokens=None, **metrics) -> PushResult:
        """Sends baseline - current (F32, floating keys; compressed with error feedback when the worker
        has `encode`).  local_step must increase with every push of this node, across restarts too.
        -> PushResult; 409 stale is status "stale" (the model is not touched: pull when you choose);
        422 raises errors.DeltaRefused, other refusals errors.ServerError."""
        if self.baseline is None:
            raise RuntimeError("push before pull: there is no baseline")
        if type(local_step) is not int or local_step < 0 or local_step > 2 ** 53 - 1:
            raise ValueError(f"local_step must be an integer in [0, 2^53 - 1], not {local_step!r}")
        if self.last_local_step is not None and local_step <= self.last_local_step:
            raise ValueError(f"local_step {local_step} does not increase (last {self.last_local_step})")
        current = {k: v for k, v in model.state_dict().items() if k in self.baseline}
        meta = delta_metadata(self.node_id, self.step, local_step, extra=_metrics(loss, tokens, metrics))
        new_res = None
        if self.encode is None:
            delta = plain_delta(self.baseline, current, meta)
        else:
            delta, new_res = encode_delta(self.baseline, current, self.encode, block=self.block,
                                          residual=self.residual if self.error_feedback else None, metadata=meta)
        split = split_delta(delta, self.shard_size, f"delta_{local_step}") if self.shard_size else None
        if split is None:
            status, http_status, answer, rec = self.transport.put_delta(self.node_id, local_step, delta)
        else:
            status, http_status, answer, rec = self.transport.put_delta_set(self.node_id, local_step, *split)
        if status != "stale":
            self.last_local_step = local_step
            if self.error_feedback and new_res is not None:
                self.residual = new_res         # only a delta that landed moves the error feedback on
        return PushResult(status, answer, rec, http_status)

    # ---- verdicts ---------------------------------------------------------------------------
    def verdicts(self):
        """What the aggregator did with this node's last deltas (GET /nodes/<node_id>): an upload's
        answer says accepted, and the round's close may still quarantine the delta (norm or cosine
        screen, an overflowed step) or discard its round.  -> {"node_id", "total", "counts": {reason: n},
        "deltas": [{"verdict", "reason", "status", "local_step", "base_outer_step", "step", "time",
        "message"}, ...] newest first}, checked as hostile (errors.HostileAnswer); None while the
        aggregator knows no verdict of this node.  Over http(s), or with listen= on file://, s3://, hf://."""
        if self._reads is None:
            raise ValueError("verdicts() needs the aggregator's HTTP address: an http(s):// url, or listen= "
                             "(its --listen) beside a file://, s3:// or hf:// url")
        return self._reads.node_verdicts(self.node_id)

    # ---- wait -------------------------------------------------------------------------------
    def wait(self, step, timeout=None, poll=0.05) -> int:
        """Waits until the global's outer step is at least `step` -> that step.  TimeoutError after
        `timeout` seconds (None: never)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        delay = poll
        while True:
            s = self.transport.outer_step()
            if s is not None and s >= step:
                return s
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"outer step {step} not reached within {timeout}s (at {s})")
            time.sleep(delay)
            delay = min(delay * 1.5, 1.0)
