#!/usr/bin/env python3
"""A DiLoCo worker in PyTorch, talking to dilocod over HTTP (or to a Hugging Face Hub repo).

Every round: download the global model (only when it changed), install it, train H inner steps with
AdamW on this worker's own data shard, compute the pseudo-gradient `baseline - current` in FP32,
save it with safetensors and the reference metadata, upload it, and wait for the next outer step.

    # HTTP (dilocod --hub none or file://):
    torch_worker.py --server http://127.0.0.1:8470 --node-id worker-1 --rounds 10
    # Hugging Face Hub (dilocod --hub hf://org/model): the stock huggingface_hub client
    HF_HUB_DISABLE_XET=1 torch_worker.py --hub org/model --hub-endpoint https://huggingface.co \\
        --node-id worker-1 --rounds 10          # token from HF_TOKEN

The model and task are the demo's: an MLP of about 1.2M parameters learning a synthetic
classification task given by a fixed random "teacher" network (learnable, so the loss falls).
Prints one JSON line per round on stdout: {"node", "round", "step", "loss", "seconds"}.  Each delta's
metadata reports the round's last inner loss ("loss") and the samples it trained on ("num_tokens": inner
steps x batch), as decimal strings.  --faulty sends each delta x 100 (a broken worker, to be quarantined;
a 422 "outlier" answer is printed and the worker goes on).  --encode int8_block|mxfp8|mxfp4 sends
compressed deltas made by `diloco delta --encode --residual` (error feedback; --no-error-feedback
without it; --diloco names the tool).

Asynchronous dilocod (--mode async, run it with `--mode async` here too): the worker does not wait
for the other workers.  After each push it waits only until the global moved past the step it trained
from (its own delta makes that happen within the server's --grace-ms and one pass), pulls the newest
global and trains from it.  Its JSON lines then count this worker's phases in "round" ("step" stays
the outer step it trained from) and also carry "local_step", "inner_steps" (the steps of that phase),
"result" (accepted or queued) and "recommended_local_steps" when the answer had one.

Dynamic local updates (DyLU): when an upload answer carries X-Recommended-Local-Steps: H, the next
local phase trains H inner steps instead of --inner-steps (so a slow worker sends its delta as often
as the fast ones), bounded to [max(1, --inner-steps / 16), 4 x --inner-steps] (followed_steps: a
server's answer never makes a phase run for ever or shrink to nothing); --ignore-recommended-steps
keeps --inner-steps always.  --slowdown F makes this
worker a straggler: after every inner step it sleeps (F - 1) times the time that step took, so each
inner step lasts F times as long.
"""
import argparse
import io
import json
import math
import os
import subprocess
import sys
import tempfile
import time

import torch
import torch.nn as nn
from safetensors.torch import load, save

IN, HIDDEN, OUT = 128, 1024, 16


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(IN, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, HIDDEN), nn.GELU(),
                                 nn.Linear(HIDDEN, OUT))
        # a non-floating buffer: dilocod carries it unchanged
        self.register_buffer("version", torch.tensor([1], dtype=torch.int64))

    def forward(self, x):
        return self.net(x)


def teacher():
    g = torch.Generator().manual_seed(1234)
    w1 = torch.randn(IN, 64, generator=g) / IN ** 0.5
    w2 = torch.randn(64, OUT, generator=g) / 8
    return lambda x: torch.tanh(x @ w1) @ w2


def shard(node_seed, n=8192):
    g = torch.Generator().manual_seed(10_000 + node_seed)
    x = torch.randn(n, IN, generator=g)
    return x, teacher()(x).argmax(dim=1)


def init_state(seed=0):
    torch.manual_seed(seed)
    return {k: v.detach().clone().contiguous() for k, v in MLP().state_dict().items()}


def floating(state):
    return {k: v for k, v in state.items() if v.is_floating_point() or v.is_complex()}


def pseudo_gradient(baseline, current):
    """float32(baseline) - float32(current) for floating keys (the reference's rule)."""
    if baseline.keys() != current.keys():
        raise ValueError("key sets differ")
    return {k: (baseline[k].float() - current[k].float()).contiguous() for k in floating(baseline)}


def followed_steps(recommended, inner_steps):
    """The inner steps of the next phase when the server recommends `recommended` (None: none): the
    recommendation within [max(1, inner_steps // 16), 4 * inner_steps], the range dilocod itself keeps
    a recommendation in when --dylu-base-steps is this worker's --inner-steps."""
    if recommended is None:
        return inner_steps
    return min(max(int(recommended), max(1, inner_steps // 16)), 4 * inner_steps)


def metadata(node, base_step, local_step, loss=None, num_tokens=None):
    """The reference's metadata, plus what the worker reports (dilocod keeps it per node and round): the
    last inner loss and the samples trained this round, as decimal strings (str(float) is one, when finite)."""
    meta = {"algorithm": "dumb_diloco", "base_outer_step": str(base_step), "local_step": str(local_step),
            "node_id": node}
    if loss is not None and math.isfinite(loss):
        meta["loss"] = str(float(loss))
    if num_tokens is not None:
        meta["num_tokens"] = str(int(num_tokens))
    return meta


def encoded_delta(diloco, workdir, node, base_step, local_step, baseline, current, meta, encode, block,
                  error_feedback):
    """The delta compressed by `diloco delta --encode` (README, "Compressed deltas"), with error feedback
    through the residual file it keeps in workdir unless error_feedback is off: -> the file's bytes."""
    base_path, cur_path = os.path.join(workdir, "baseline.safetensors"), os.path.join(workdir, "current.safetensors")
    out = os.path.join(workdir, f"delta_{local_step}.safetensors")
    with open(base_path, "wb") as f:
        f.write(save({k: v.contiguous() for k, v in baseline.items()}))
    with open(cur_path, "wb") as f:
        f.write(save({k: v.contiguous() for k, v in current.items()}))
    cmd = [diloco, "delta", "--baseline", base_path, "--current", cur_path, "--node-id", node,
           "--base-step", str(base_step), "--local-step", str(local_step), "-o", out, "--encode", encode]
    if block:
        cmd += ["--block", str(block)]
    if error_feedback:
        cmd += ["--residual", os.path.join(workdir, "residual.safetensors")]
    for k in ("loss", "num_tokens"):
        if k in meta:
            cmd += ["--meta", f"{k}={meta[k]}"]
    subprocess.run(cmd, check=True)
    with open(out, "rb") as f:
        data = f.read()
    os.unlink(out)
    return data


class HttpTransport:
    def __init__(self, server, token):
        import requests
        self.s = requests.Session()
        self.server = server.rstrip("/")
        self.headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.etag, self.cached = None, None
        self.recommended = None     # X-Recommended-Local-Steps of the last upload answer (DyLU)

    def step(self):
        return self.s.get(f"{self.server}/status", timeout=30).json()["outer_step"]

    def wait(self, step, timeout=3600, poll=0.2):
        deadline = time.time() + timeout
        while time.time() < deadline:
            try:
                s = self.step()
                if s is not None and s >= step:
                    return s
            except Exception:       # the server restarting: keep waiting
                pass
            time.sleep(poll)
        raise TimeoutError(f"step {step} not reached")

    def pull(self):
        h = {"If-None-Match": self.etag} if self.etag else {}
        r = self.s.get(f"{self.server}/global/latest.safetensors", headers=h, timeout=600)
        if r.status_code == 304:
            return self.cached
        r.raise_for_status()
        self.etag, self.cached = r.headers.get("ETag"), (int(r.headers["X-Outer-Step"]), load(r.content))
        return self.cached

    def push(self, node, local_step, data):
        for attempt in range(6):
            try:
                r = self.s.put(f"{self.server}/nodes/{node}/delta_{local_step}.safetensors", data=data,
                               headers=self.headers, timeout=600)
            except Exception:
                time.sleep(0.5 * 2 ** attempt)
                continue
            if r.status_code >= 500:
                time.sleep(0.5 * 2 ** attempt)
                continue
            if r.status_code == 422 and r.json().get("error", {}).get("code") == "outlier":
                # quarantined: the round goes on without it; so does this worker, from the next global
                print(f"{node}: delta quarantined: {r.json()['error'].get('message')}", file=sys.stderr, flush=True)
                return {"result": "quarantined"}
            if r.status_code != 201:
                raise RuntimeError(f"upload refused: {r.status_code} {r.text}")
            h = r.headers.get("X-Recommended-Local-Steps")
            self.recommended = int(h) if h and h.isdigit() and int(h) > 0 else None
            return r.json()
        raise RuntimeError("upload failed after retries")


class HubTransport:
    def __init__(self, repo, endpoint, token):
        from huggingface_hub import HfApi
        self.api = HfApi(endpoint=endpoint, token=token)
        self.repo, self.endpoint, self.token = repo, endpoint, token
        self.recommended = None     # the Hub's answers carry no recommendation


    def _get(self, path):
        from huggingface_hub import hf_hub_download
        return hf_hub_download(self.repo, path, endpoint=self.endpoint, token=self.token, force_download=True)

    def step(self):
        with open(self._get("global/step_count.json")) as f:
            return json.load(f)["outer_step"]

    def wait(self, step, timeout=3600, poll=1.0):
        deadline = time.time() + timeout
        while time.time() < deadline:
            try:
                if self.step() >= step:
                    return
            except Exception:
                pass
            time.sleep(poll)
        raise TimeoutError(f"step {step} not reached")

    def pull(self):
        step = self.step()
        with open(self._get("global/latest.safetensors"), "rb") as f:
            return step, load(f.read())

    def push(self, node, local_step, data):
        self.api.upload_file(path_or_fileobj=io.BytesIO(data),
                             path_in_repo=f"nodes/{node}/delta_{local_step}.safetensors", repo_id=self.repo)
        return {"result": "uploaded"}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--server", help="dilocod URL, e.g. http://127.0.0.1:8470")
    ap.add_argument("--hub", help="Hub repo id (ns/name) instead of --server")
    ap.add_argument("--hub-endpoint", default=os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    ap.add_argument("--token", default=os.environ.get("DILOCO_TOKEN") or os.environ.get("HF_TOKEN"))
    ap.add_argument("--node-id", required=True)
    ap.add_argument("--seed", type=int, default=None, help="data shard seed (default: from the node id)")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--inner-steps", type=int, default=30, help="H: inner AdamW steps per round")
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--mode", choices=("sync", "async"), default="sync",
                    help="async: after each push, train from the newest global without waiting for the others")
    ap.add_argument("--ignore-recommended-steps", action="store_true",
                    help="train --inner-steps every phase, whatever X-Recommended-Local-Steps says (no DyLU)")
    ap.add_argument("--slowdown", type=float, default=1.0,
                    help="F >= 1: each inner step lasts F times as long (sleeps (F-1) x its compute time)")
    ap.add_argument("--encode", choices=("int8_block", "mxfp8", "mxfp4"),
                    help="send compressed deltas made by `diloco delta --encode` (error feedback on)")
    ap.add_argument("--block", type=int, default=None, help="--encode int8_block: values per scale (default 32)")
    ap.add_argument("--no-error-feedback", action="store_true", help="--encode without the residual")
    ap.add_argument("--diloco", default=os.environ.get("DILOCO", "diloco"), help="the diloco tool (--encode)")
    ap.add_argument("--faulty", action="store_true",
                    help="a broken worker: multiplies its delta by 100 before sending it (dilocod should quarantine it)")
    a = ap.parse_args()
    if bool(a.server) == bool(a.hub):
        ap.error("give exactly one of --server and --hub")
    if a.slowdown < 1:
        ap.error("--slowdown is at least 1")
    torch.set_num_threads(a.threads)
    seed = a.seed if a.seed is not None else sum(map(ord, a.node_id))
    x, y = shard(seed)
    model = MLP()
    inner = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=0.01)
    loss_fn = nn.CrossEntropyLoss()
    t = HttpTransport(a.server, a.token) if a.server else HubTransport(a.hub, a.hub_endpoint, a.token)
    g = torch.Generator().manual_seed(seed)
    workdir = tempfile.mkdtemp(prefix=f"diloco-{a.node_id}-") if a.encode else None
    local_step = 0
    steps = a.inner_steps       # this phase's inner steps: --inner-steps, or the server's recommendation
    step = t.wait(0) or 0
    for phase in range(a.rounds):
        t0 = time.time()
        step, state = t.pull()
        # install: permissive, as the reference (matching keys and shapes load)
        model.load_state_dict({k: v for k, v in state.items() if k in model.state_dict()}, strict=False)
        baseline = {k: v.detach().clone() for k, v in model.state_dict().items()}
        losses = []
        for _ in range(steps):
            ts = time.perf_counter()
            idx = torch.randint(0, x.shape[0], (a.batch,), generator=g)
            loss = loss_fn(model(x[idx]), y[idx])
            inner.zero_grad()
            loss.backward()
            inner.step()
            losses.append(loss.item())
            local_step += 1
            if a.slowdown > 1:
                time.sleep((a.slowdown - 1) * (time.perf_counter() - ts))
        current = {k: v.detach() for k, v in model.state_dict().items()}
        delta = pseudo_gradient(baseline, current)
        if a.faulty:
            delta = {k: v * 100 for k, v in delta.items()}
        meta = metadata(a.node_id, step, local_step, losses[-1] if losses else None, steps * a.batch)
        if a.encode:
            if a.faulty:        # the current model that makes the delta x 100
                current = dict(current, **{k: baseline[k].float() - d for k, d in delta.items()})
            data = encoded_delta(a.diloco, workdir, a.node_id, step, local_step, baseline, current, meta, a.encode,
                                 a.block, not a.no_error_feedback)
        else:
            data = save(delta, metadata=meta)
        answer = t.push(a.node_id, local_step, data)
        rec = {"node": a.node_id, "round": step, "step": step, "loss": sum(losses) / len(losses),
               "seconds": round(time.time() - t0, 3)}
        if a.mode == "async":
            rec.update(round=phase, local_step=local_step, inner_steps=steps, result=answer.get("result"))
            if t.recommended is not None:
                rec["recommended_local_steps"] = t.recommended
        print(json.dumps(rec), flush=True)
        if t.recommended is not None and not a.ignore_recommended_steps:
            steps = followed_steps(t.recommended, a.inner_steps)
        if a.mode == "async":
            # only until the global moved past the one this phase trained from: this worker's own
            # delta moves it (one update within --grace-ms and a pass), the others are not waited for
            if phase + 1 < a.rounds:
                t.wait(step + 1, poll=0.02)
        else:
            t.wait(step + 1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
