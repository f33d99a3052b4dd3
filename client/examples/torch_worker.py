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
Prints one JSON line per round on stdout: {"node", "round", "step", "loss", "seconds"}.
"""
import argparse
import io
import json
import os
import sys
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


def metadata(node, base_step, local_step):
    return {"algorithm": "dumb_diloco", "base_outer_step": str(base_step), "local_step": str(local_step),
            "node_id": node}


class HttpTransport:
    def __init__(self, server, token):
        import requests
        self.s = requests.Session()
        self.server = server.rstrip("/")
        self.headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.etag, self.cached = None, None

    def step(self):
        return self.s.get(f"{self.server}/status", timeout=30).json()["outer_step"]

    def wait(self, step, timeout=3600):
        deadline = time.time() + timeout
        while time.time() < deadline:
            try:
                s = self.step()
                if s is not None and s >= step:
                    return s
            except Exception:       # the server restarting: keep waiting
                pass
            time.sleep(0.2)
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
            if r.status_code != 201:
                raise RuntimeError(f"upload refused: {r.status_code} {r.text}")
            return r.json()
        raise RuntimeError("upload failed after retries")


class HubTransport:
    def __init__(self, repo, endpoint, token):
        from huggingface_hub import HfApi
        self.api = HfApi(endpoint=endpoint, token=token)
        self.repo, self.endpoint, self.token = repo, endpoint, token

    def _get(self, path):
        from huggingface_hub import hf_hub_download
        return hf_hub_download(self.repo, path, endpoint=self.endpoint, token=self.token, force_download=True)

    def step(self):
        with open(self._get("global/step_count.json")) as f:
            return json.load(f)["outer_step"]

    def wait(self, step, timeout=3600):
        deadline = time.time() + timeout
        while time.time() < deadline:
            try:
                if self.step() >= step:
                    return
            except Exception:
                pass
            time.sleep(1.0)
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
    a = ap.parse_args()
    if bool(a.server) == bool(a.hub):
        ap.error("give exactly one of --server and --hub")
    torch.set_num_threads(a.threads)
    seed = a.seed if a.seed is not None else sum(map(ord, a.node_id))
    x, y = shard(seed)
    model = MLP()
    inner = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=0.01)
    loss_fn = nn.CrossEntropyLoss()
    t = HttpTransport(a.server, a.token) if a.server else HubTransport(a.hub, a.hub_endpoint, a.token)
    g = torch.Generator().manual_seed(seed)
    local_step = 0
    step = t.wait(0) or 0
    for _ in range(a.rounds):
        t0 = time.time()
        step, state = t.pull()
        # install: permissive, as the reference (matching keys and shapes load)
        model.load_state_dict({k: v for k, v in state.items() if k in model.state_dict()}, strict=False)
        baseline = {k: v.detach().clone() for k, v in model.state_dict().items()}
        losses = []
        for _ in range(a.inner_steps):
            idx = torch.randint(0, x.shape[0], (a.batch,), generator=g)
            loss = loss_fn(model(x[idx]), y[idx])
            inner.zero_grad()
            loss.backward()
            inner.step()
            losses.append(loss.item())
            local_step += 1
        delta = pseudo_gradient(baseline, {k: v.detach() for k, v in model.state_dict().items()})
        data = save(delta, metadata=metadata(a.node_id, step, local_step))
        t.push(a.node_id, local_step, data)
        print(json.dumps({"node": a.node_id, "round": step, "step": step, "loss": sum(losses) / len(losses),
                          "seconds": round(time.time() - t0, 3)}), flush=True)
        t.wait(step + 1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
