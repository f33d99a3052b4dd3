"""s3:// publish claims with a lease (issue 21, item 3), against SeaweedFS.

A claim (global/steps/<step>.claim) is honoured for --s3-claim-lease seconds after its last write,
timed by the server's Last-Modified against the Date of the same answer; an expired one is taken over
with If-Match.  Before the lease, a bucket writer's planted claims stopped publishing for good (55 claim
PUTs in 11 s, the bucket at step 0), and a dead aggregator's claim blocked every other forever."""
import json
import math
import re
import time

import numpy as np
import requests
import torch

from dilocod_proc import Oracle, assert_state_equal, write_model
from test_s3 import NODES, S3Dilocod, put_delta, round_deltas, s3, small_model  # noqa: F401 (s3: fixture)


def healthz_ok(d):
    t = time.monotonic()
    r = requests.get(f"{d.url}/healthz", timeout=1)
    assert r.status_code == 200 and time.monotonic() - t < 1


def claim_requests(d):
    """{code: count} of the claim PUTs dilocod sent (its /metrics)."""
    text = requests.get(f"{d.url}/metrics", timeout=5).text
    return {int(c): int(n) for c, n in re.findall(r'dilocod_hub_requests_total\{route="claim",code="(\d+)"\} (\d+)', text)}


def claim_of(d, step):
    return json.loads(d.get(f"global/steps/{step}.claim"))


def assert_exact_finite(d, oracle):
    got = {k: torch.from_numpy(v) for k, v in d.global_state().items()}
    assert all(bool(torch.isfinite(v).all()) for v in got.values())
    assert_state_equal(got, oracle.state)


def wait_step_alive(d, step, timeout):
    deadline = time.time() + timeout
    while time.time() < deadline:
        s = d.published_step()
        if s is not None and s >= step:
            return time.time()
        assert d.alive(), d.log_text()[-3000:]
        healthz_ok(d)
        time.sleep(0.1)
    raise AssertionError(f"step {step} not published within {timeout}s (at {d.published_step()}):\n"
                         f"{d.log_text()[-3000:]}")


def test_planted_claims_expire_and_every_step_publishes(tmp_path, s3):
    prefix = "claims/planted"
    lease = 3
    init = small_model(21)
    write_model(tmp_path / "init.safetensors", init)
    for step in range(1, 101):
        s3.client().put_object(Bucket=s3.bucket, Key=f"{prefix}/global/steps/{step}.claim",
                               Body=b'{"instance":"attacker"}')
    d = S3Dilocod(tmp_path, s3, prefix, "--init-model", tmp_path / "init.safetensors",
                  "--expected-nodes", str(len(NODES)), "--s3-claim-lease", str(lease)).start()
    try:
        d.wait_step(0)
        instance = (d.state_dir / "s3_instance").read_text().strip()
        oracle = Oracle(init)
        rng = np.random.default_rng(21)
        for r in range(3):
            deltas = round_deltas(rng, init)
            for node in NODES:
                put_delta(d.client, s3.bucket, prefix, node, r, 100 * (r + 1), deltas[node])
            # bound: the planted claim's lease (3 s) plus generous liveness room
            wait_step_alive(d, r + 1, lease + 30)
            oracle.step({n: {k: torch.from_numpy(v) for k, v in t.items()} for n, t in deltas.items()})
            assert_exact_finite(d, oracle)
            assert claim_of(d, r + 1)["instance"] == instance
        # each planted claim was taken over once: no claim PUT per poll (the unfixed daemon sent one a poll)
        codes = claim_requests(d)
        assert codes.get(412, 0) <= 3 * 2, codes
        assert "publish lost to another aggregator" not in d.log_text()
        assert d.log_text().count("taking over an expired claim") == 3
        # claims of later steps are left alone
        assert claim_of(d, 50) == {"instance": "attacker"}
        assert d.alive()
    finally:
        d.stop()


def test_live_claim_is_honoured_then_a_dead_aggregators_claim_is_taken_over(tmp_path, s3):
    prefix = "claims/dead"
    lease = 6
    init = small_model(22)
    write_model(tmp_path / "init.safetensors", init)
    d = S3Dilocod(tmp_path, s3, prefix, "--init-model", tmp_path / "init.safetensors",
                  "--expected-nodes", str(len(NODES)), "--s3-claim-lease", str(lease)).start()
    try:
        d.wait_step(0)
        instance = (d.state_dir / "s3_instance").read_text().strip()
        # another aggregator claims step 1, then dies: its claim is live for one lease
        dead = {"outer_step": 1, "instance": "0123456789abcdef0123456789abcdef"}
        planted = time.time()
        s3.client().put_object(Bucket=s3.bucket, Key=f"{prefix}/global/steps/1.claim",
                               Body=json.dumps(dead).encode())
        oracle = Oracle(init)
        deltas = round_deltas(np.random.default_rng(22), init)
        for node in NODES:
            put_delta(d.client, s3.bucket, prefix, node, 0, 100, deltas[node])
        d.wait_log("step claimed by another aggregator: waiting for its lease", timeout=30)
        # honoured: nothing published by us until the lease is over (Last-Modified has 1 s resolution)
        while time.time() < planted + lease - 1.5:
            assert d.published_step() == 0
            assert d.alive()
            healthz_ok(d)
            time.sleep(0.1)
        assert claim_of(d, 1) == dead
        # then taken over and published: bound, the lease plus generous liveness room
        wait_step_alive(d, 1, lease + 30)
        assert claim_of(d, 1)["instance"] == instance
        oracle.step({n: {k: torch.from_numpy(v) for k, v in t.items()} for n, t in deltas.items()})
        assert_exact_finite(d, oracle)
        assert d.log_text().count("taking over an expired claim") == 1
        # the wait was one claim PUT, then the takeover: not a PUT per poll (--poll-interval 0.1)
        assert claim_requests(d).get(412, 0) <= 2
        assert d.alive()
    finally:
        d.stop()
