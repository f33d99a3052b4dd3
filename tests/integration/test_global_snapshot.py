"""GET /global/latest.safetensors while rounds commit: the X-Outer-Step and ETag headers and the body
of every response come from one published file (issue: the step header was read from the store while
the served file was still the previous one).  A reader hammers the global over keep-alive and Range
requests while 25 rounds commit over HTTP; each body must equal, bit for bit, the torch oracle's
model of the step its header names."""
import hashlib
import threading

import numpy as np
import pytest
import torch
from safetensors.torch import load as torch_load_bytes

from dilocod_proc import Oracle, assert_state_equal
from test_http_api import daemons, delta_blob, session, small_model, wait_status  # noqa: F401

ROUNDS = 25


def test_step_header_and_body_come_from_one_published_file(daemons):
    model = small_model(21)
    d = daemons(model, "--expected-nodes", "2", "--lr", "0.7", "--momentum", "0.9")
    url = d.url
    oracle = Oracle(model, lr=0.7, momentum=0.9, nesterov=True)
    expected = {0: {k: v.clone() for k, v in model.items()}}
    seen = []                   # (step, etag, sha256, body)
    stop = threading.Event()
    errors = []

    def reader():
        with session() as s:
            while not stop.is_set():
                try:
                    r = s.get(url + "/global/latest.safetensors", timeout=10)
                except Exception as e:      # noqa: BLE001 - reported below
                    errors.append(repr(e))
                    return
                if r.status_code != 200:
                    errors.append(f"{r.status_code} {r.text[:200]}")
                    return
                seen.append((int(r.headers["X-Outer-Step"]), r.headers["ETag"],
                             hashlib.sha256(r.content).hexdigest(), r.content))
                # a Range request names its step too: its bytes must be that step's bytes
                rr = s.get(url + "/global/latest.safetensors", headers={"Range": "bytes=0-15"}, timeout=10)
                if rr.status_code == 206:
                    seen.append((int(rr.headers["X-Outer-Step"]), rr.headers["ETag"], None, rr.content))

    threads = [threading.Thread(target=reader) for _ in range(2)]
    for t in threads:
        t.start()
    rng = np.random.default_rng(21)
    try:
        for step in range(ROUNDS):
            deltas = {}
            for node in ("node-a", "node-b"):
                tensors = {k: (rng.standard_normal(tuple(v.shape)) * 0.01).astype(np.float32)
                           for k, v in model.items() if v.is_floating_point()}
                deltas[node] = {k: torch.from_numpy(v) for k, v in tensors.items()}
                r = session().put(f"{url}/nodes/{node}/delta_{step + 1}.safetensors",
                                  data=delta_blob(node, step, step + 1, tensors), timeout=30)
                assert r.status_code == 201, r.text
            oracle.step(deltas)
            expected[step + 1] = {k: v.clone() for k, v in oracle.state.items()}
            wait_status(url, lambda s, n=step + 1: s["outer_step"] == n, 60, f"step {step + 1}")
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=30)
    assert not errors, errors
    full = [x for x in seen if x[2] is not None]
    steps = {x[0] for x in full}
    assert len(steps) >= 5, f"the readers saw only steps {sorted(steps)}"
    # one body per step, one ETag per step
    by_step = {}
    for step, etag, digest, body in full:
        prev = by_step.setdefault(step, (etag, digest, body))
        assert prev[0] == etag and prev[1] == digest, f"step {step} was served with two different bodies"
    for step, (etag, digest, body) in sorted(by_step.items()):
        assert f'"s{step}-' in etag, (step, etag)
        assert_state_equal(torch_load_bytes(body), expected[step])
    for step, etag, digest, prefix in seen:
        if digest is None and step in by_step:
            assert by_step[step][2][:16] == prefix, f"a Range response of step {step} had other bytes"
    assert d.stop() == 0
