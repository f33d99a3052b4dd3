#!/usr/bin/env python3
"""A DiLoCo worker in PyTorch on the `diloco` package (client/python: pip install ./client/python),
talking to dilocod over HTTP (or to a Hugging Face Hub repo).

Every round: worker.pull(model) (the global, only when it changed, checked and installed), H inner steps
with AdamW on this worker's own data shard, worker.push(model, local_step=..., loss=..., tokens=...)
(the pseudo-gradient `baseline - current` in FP32, or compressed with error feedback), and
worker.wait(step + 1) for the next outer step.

    # HTTP (dilocod --hub none or file://):
    torch_worker.py --server http://127.0.0.1:8470 --node-id worker-1 --rounds 10
    # Hugging Face Hub (dilocod --hub hf://org/model): the stock huggingface_hub client underneath
    HF_HUB_DISABLE_XET=1 torch_worker.py --hub org/model --hub-endpoint https://huggingface.co \\
        --node-id worker-1 --rounds 10          # token from HF_TOKEN

The model and task are the demo's: an MLP of about 1.2M parameters learning a synthetic
classification task given by a fixed random "teacher" network (learnable, so the loss falls).
Prints one JSON line per round on stdout: {"node", "round", "step", "loss", "seconds"}.  Each delta's
metadata reports the round's last inner loss ("loss") and the samples it trained on ("num_tokens": inner
steps x batch).  --faulty sends each delta x 100 (a broken worker, to be quarantined; a 422 answer is
printed and the worker goes on).  --encode int8_block|mxfp8|mxfp4 sends compressed deltas, encoded by
the package in torch, byte-identical to `diloco delta --encode --residual` (error feedback;
--no-error-feedback without it).

Asynchronous dilocod (--mode async, run it with `--mode async` here too): the worker does not wait
for the other workers.  After each push it waits only until the global moved past the step it trained
from (its own delta makes that happen within the server's --grace-ms and one pass), pulls the newest
global and trains from it.  Its JSON lines then count this worker's phases in "round" ("step" stays
the outer step it trained from) and also carry "local_step", "inner_steps" (the steps of that phase),
"result" (accepted) and "recommended_local_steps" when the answer had one.

Dynamic local updates (DyLU): when an upload answer carries X-Recommended-Local-Steps: H, the next
local phase trains H inner steps instead of --inner-steps (so a slow worker sends its delta as often
as the fast ones), bounded to [max(1, --inner-steps / 16), 4 x --inner-steps] (diloco.followed_local_steps:
a server's answer never makes a phase run for ever or shrink to nothing); --ignore-recommended-steps
keeps --inner-steps always.  --slowdown F makes this
worker a straggler: after every inner step it sleeps (F - 1) times the time that step took, so each
inner step lasts F times as long.
"""
import argparse
import json
import os
import sys
import time

import torch
import torch.nn as nn

import diloco

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


# the bounds a recommendation is followed within (tests/integration/test_async_hardening.py checks them)
followed_steps = diloco.followed_local_steps

# 422 codes that quarantine a delta: the round goes on without it, and so does this worker
QUARANTINED = ("outlier", "norm_ratio", "cosine")


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
                    help="send compressed deltas (the package's encoders, error feedback on)")
    ap.add_argument("--block", type=int, default=None, help="--encode int8_block: values per scale (default 32)")
    ap.add_argument("--no-error-feedback", action="store_true", help="--encode without the residual")
    ap.add_argument("--downlink", action="store_true",
                    help="pull the server's view and replay each step's compressed update (dilocod --downlink)")
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
    if a.hub:
        os.environ["HF_ENDPOINT"] = a.hub_endpoint
    worker = diloco.Worker(a.server or f"hf://{a.hub}", a.node_id, token=a.token, encode=a.encode, block=a.block,
                           error_feedback=not a.no_error_feedback, downlink=a.downlink)
    g = torch.Generator().manual_seed(seed)
    local_step = 0
    steps = a.inner_steps       # this phase's inner steps: --inner-steps, or the server's recommendation
    worker.wait(0)
    for phase in range(a.rounds):
        t0 = time.time()
        step = worker.pull(model)
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
        if a.faulty:
            # the model whose delta is 100 x this round's: baseline - 100 (baseline - current)
            with torch.no_grad():
                for k, v in model.state_dict().items():
                    if v.is_floating_point():
                        b = worker.baseline[k].float()
                        v.copy_(b - 100 * (b - v.float()))
        try:
            res = worker.push(model, local_step=local_step, loss=losses[-1] if losses else None,
                              tokens=steps * a.batch)
            result, recommended = res.status, res.recommended_local_steps
        except diloco.DeltaRefused as e:
            if e.code not in QUARANTINED:
                raise
            print(f"{a.node_id}: delta quarantined: {e.message}", file=sys.stderr, flush=True)
            result, recommended = "quarantined", None
        rec = {"node": a.node_id, "round": step, "step": step, "loss": sum(losses) / len(losses),
               "seconds": round(time.time() - t0, 3)}
        if a.mode == "async":
            rec.update(round=phase, local_step=local_step, inner_steps=steps, result=result)
            if recommended is not None:
                rec["recommended_local_steps"] = recommended
        print(json.dumps(rec), flush=True)
        if recommended is not None and not a.ignore_recommended_steps:
            steps = followed_steps(recommended, a.inner_steps)
        if a.mode == "async":
            # only until the global moved past the one this phase trained from: this worker's own
            # delta moves it (one update within --grace-ms and a pass), the others are not waited for
            if phase + 1 < a.rounds:
                worker.wait(step + 1, poll=0.02)
        elif result != "stale":
            worker.wait(step + 1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
