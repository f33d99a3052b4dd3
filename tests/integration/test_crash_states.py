"""Recovery from a crash in each state of the step pipeline (server/core/pipeline.h; issue 22 item 9).

The real dilocod is killed with SIGKILL exactly when step 2 enters a state, by its test hook
(DILOCOD_TEST_CRASH_AT=<state>:2, read by pipeline_init: the move raises SIGKILL after its log line):
computing, inputs_durable, committed, served, published and durable, the states a round's step passes on
its way to cleaned.  Collecting is a state a step stays in while its deltas arrive: the test kills the
daemon itself once /status shows step 2 collecting with one of its two deltas accepted.

The daemon is restarted on the same state directory, without the hook, and the test checks what a crash
must never lose, waiting on /status's pipeline rather than on files:
- step 2, then step 3 (one more round on the recovered momentum), equal torch.optim.SGD (nesterov;
  dilocod_proc.Oracle) bit for bit, global and momentum, in the state and in the transport;
- the transport publishes each step (step_count.json names it, its global is the committed one's bytes),
  and the step's record in /status ends cleaned and published;
- the history (rounds.jsonl and GET /rounds) holds each round exactly once, in order, each node once;
- once cleaned, the state holds only the committed step's files (no temporary, no older global, no older
  delta cache) and the transport's global/ nothing but the step's files (and on s3 its claims);
- the restart took the recovery the state calls for (RECOVERY: redone, recomputed, resumed);
- no move the pipeline's table refuses is logged (conftest's autouse fixture).

Transports: file:// for every state (fast), and s3:// against SeaweedFS (one server for the module) for
collecting (its persisted seen list) and the states around publishing.  test_daemon_durability.py and
test_kill9_history.py kill at random or log-timed moments under load; this file kills once per state,
deterministically, on a tiny model."""
import json
import time

import numpy as np
import pytest
import torch

from dilocod_proc import Dilocod, Oracle, assert_state_equal, load_torch, write_delta, write_model
from s3server import SeaweedS3
from test_daemon_durability import check_clean_state, listing
from test_s3 import S3Dilocod, put_delta

NODES = ["n0", "n1"]
CRASH_STEP = 2          # round 1 makes step 2: a previous step's files are there to clean up
MAX_ROUNDS = 16         # rounds to wait for a step that enters the state (the hook on any step)
HOOK_STATES = ["computing", "inputs_durable", "committed", "served", "published", "durable"]
S3_STATES = ["collecting", "served", "published", "durable"]


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    server = SeaweedS3(tmp_path_factory.mktemp("seaweedfs")).start()
    yield server
    server.stop()


def tiny_model():
    g = torch.Generator().manual_seed(22)
    return {
        "layer.weight": torch.randn(64, 16, generator=g),
        "layer.bias": torch.randn(16, generator=g),
        "emb": torch.randn(32, 8, generator=g).to(torch.bfloat16),     # rounded back to BF16
        "steps": torch.tensor([1, 2, 3], dtype=torch.int64),           # carried unchanged
    }


def round_delta(model, r, i):
    """Node i's delta of round r (base step r): the same in every run."""
    rng = np.random.default_rng([22, r, i])
    return {k: rng.standard_normal(tuple(v.shape), dtype=np.float32) * np.float32(0.01)
            for k, v in model.items() if v.is_floating_point()}


class FileTransport:
    """file://<tmp>/hub: deltas written into nodes/, the published global read from global/."""
    name = "file"

    def __init__(self, tmp, init, _s3):
        self.hub = tmp / "hub"
        self.d = Dilocod(tmp, self.hub, "--init-model", str(init), "--expected-nodes", str(len(NODES)))

    def deliver(self, node, r, tensors):
        write_delta(self.hub, node, r, r + 1, tensors)

    def published(self):
        """(step_count.json's step, the published global's bytes)."""
        return self.d.published_step(), (self.hub / "global/latest.safetensors").read_bytes()

    def check_published_clean(self, step):
        names = sorted(p.name for p in (self.hub / "global").iterdir())
        assert names == ["latest.safetensors", "step_count.json"], names


class S3Transport:
    """s3://<bucket>/<test's own prefix> on the module's SeaweedFS; workers put their deltas with boto3."""
    name = "s3"

    def __init__(self, tmp, init, s3):
        self.s3 = s3
        self.prefix = f"crash/{tmp.name}"
        self.d = S3Dilocod(tmp, s3, self.prefix, "--init-model", str(init), "--expected-nodes", str(len(NODES)))

    def deliver(self, node, r, tensors):
        put_delta(self.d.client, self.s3.bucket, self.prefix, node, r, r + 1, tensors)

    def published(self):
        return self.d.published_step(), self.d.get("global/latest.safetensors")

    def check_published_clean(self, step):
        """One claim per step, all this instance's (a restart keeps its instance); no multipart upload left."""
        instance = (self.d.state_dir / "s3_instance").read_text().strip()
        keys = []
        pages = self.d.client.get_paginator("list_objects_v2").paginate(Bucket=self.s3.bucket,
                                                                        Prefix=f"{self.prefix}/global/")
        for page in pages:
            keys += [o["Key"][len(self.prefix) + 1:] for o in page.get("Contents", [])]
        want = ["global/latest.safetensors", "global/step_count.json"] + \
            [f"global/steps/{s}.claim" for s in range(step + 1)]
        assert sorted(keys) == sorted(want), keys
        for s in range(step + 1):
            claim = json.loads(self.d.get(f"global/steps/{s}.claim"))
            assert claim["outer_step"] == s and claim["instance"] == instance, claim
        assert not self.d.client.list_multipart_uploads(Bucket=self.s3.bucket, Prefix=self.prefix).get("Uploads")


def history_steps(d):
    """(rounds.jsonl's steps, GET /rounds's steps); each round's record names every node once."""
    path = d.state_dir / "rounds.jsonl"
    in_file = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    served = d.rounds()
    for rec in in_file + served:
        assert sorted(n["node_id"] for n in rec["nodes"]) == NODES, rec
    return [x["step"] for x in in_file], [x["step"] for x in served]


def check_step(t, oracle, step):
    """Step is committed, durable and cleaned: its global and momentum equal torch's bit for bit, the
    transport publishes it (its pipeline record says so too, also when a restart found it there), the
    history holds rounds 0..step-1 once each, and no file is left over."""
    d = t.d
    assert d.wait_settled(step) == step, d.pipeline()
    d.wait_until(lambda: (d.get_json("/status") or {}).get("hub", {}).get("published_step") == step,
                 f"the transport holding step {step} (/status hub.published_step)")
    rec = [r for r in d.pipeline() if r["step"] == step]
    assert rec and rec[0]["state"] == "cleaned", d.pipeline()
    assert rec[0]["published"], f"step {step} is the transport's, its pipeline record says otherwise: {d.pipeline()}"
    assert rec[0]["busy"] == [] and rec[0]["failed"] == [], rec      # nothing runs for a cleaned step
    assert_state_equal(load_torch(d.state_dir / f"global/latest-{step}.safetensors"), oracle.state)
    assert_state_equal(load_torch(d.state_dir / f"outer_state-{step}.safetensors"), oracle.momentum())
    published_step, published_bytes = t.published()
    assert published_step == step
    assert published_bytes == (d.state_dir / f"global/latest-{step}.safetensors").read_bytes(), \
        "the published global is not the committed one"
    assert history_steps(d) == (list(range(step)), list(range(step)))
    assert json.loads((d.state_dir / "outer_metadata.json").read_text())["outer_step"] == step
    assert not (d.state_dir / "redo.json").exists(), listing(d.state_dir)
    check_clean_state(d.state_dir, step, own_pid=d.proc.pid)
    t.check_published_clean(step)


# How the restart brings back a step killed in each state, as its log tells:
# - "redone": the step was not committed (no redo record): its round is collected and computed again,
#   from the deltas the crash left in the cache and from the transport;
# - "recomputed": committed by its redo record only: the restart recomputes its files from the inputs;
# - "resumed": durable (outer_metadata.json names it): only the files before it are cleaned.
# A step killed as it is published may be either of the last two: its settle runs as the publish ends
# (file://) or beside it (s3://), and may have made it durable on disk before the kill.
RECOVERY = {"collecting": "redone", "computing": "redone", "inputs_durable": "redone",
            "committed": "recomputed", "served": "recomputed", "durable": "resumed"}


def recovery_path(log, step):
    if f"store: recovered step={step} " in log:
        return "recomputed"
    if f"store: resuming step={step} " in log:
        return "resumed"
    assert f"store: resuming step={step - 1} " in log and f"aggregate: started step={step} " in log, log[-4000:]
    return "redone"


def killed_or_settled(d, state, step, timeout=60):
    """True when the process killed itself as step entered state (its test hook), False when step was
    cleaned without entering it."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if d.proc.poll() is not None:
            d.wait_killed_at(state, step, timeout=1)
            return True
        if any(rec["step"] == step and rec["state"] == "cleaned" for rec in d.pipeline() or ()):
            return False
        time.sleep(0.01)
    raise AssertionError(f"step {step} neither killed at {state} nor cleaned within {timeout}s "
                         f"(pipeline {d.pipeline()}):\n{d.log_text()[-4000:]}")


def crash_and_recover(tmp_path, transport, state, s3=None, crash_step=CRASH_STEP, crash_env=None):
    """Rounds until the crash, the restart, then one more round; every step checked (check_step).
    crash_step None: the hook kills at the first step that enters state, the rounds go on until one does.
    crash_env: more environment for the run that crashes (the restart runs without it)."""
    model = tiny_model()
    init = tmp_path / "init.safetensors"
    write_model(init, model)
    t = transport(tmp_path, init, s3)
    d = t.d
    oracle = Oracle(model)
    base_env = dict(d.env or {})
    if state != "collecting":
        d.env = dict(base_env, DILOCOD_TEST_CRASH_AT=state if crash_step is None else f"{state}:{crash_step}",
                     **(crash_env or {}))
    crashed, r = None, 0
    try:
        d.start()
        d.wait_settled(0)
        while crashed is None or r <= crashed + 1:
            assert r < MAX_ROUNDS, f"no step entered {state} in {MAX_ROUNDS} rounds"
            deltas = {node: round_delta(model, r, i) for i, node in enumerate(NODES)}
            if state == "collecting" and r == crash_step - 1:
                # one delta of the round accepted, the other still to come: killed while it collects
                t.deliver(NODES[0], r, deltas[NODES[0]])
                d.wait_received(r + 1, [NODES[0]])
                d.kill9()
                crashed = r
                d.start()
                t.deliver(NODES[1], r, deltas[NODES[1]])
            else:
                for node in NODES:
                    t.deliver(node, r, deltas[node])
                if crashed is None and state != "collecting":
                    if killed_or_settled(d, state, r + 1):
                        crashed = r
                        d.env = base_env
                        d.start()
                    else:
                        assert crash_step is None or r + 1 < crash_step, f"step {r + 1} never entered {state}"
            oracle.step(deltas)
            check_step(t, oracle, r + 1)
            if crashed == r:
                path = recovery_path(d.logs[-1].read_text(errors="replace"), r + 1)
                print(f"\n{t.name} {state}: killed at step {r + 1}, recovered by {path}")
                assert RECOVERY.get(state) in (None, path), (state, path, d.logs[-1].read_text()[-4000:])
            r += 1
        assert crash_step is None or crashed == crash_step - 1, crashed
        assert d.stop() == 0, d.log_text()[-3000:]
    finally:
        if d.alive():
            d.kill9()


@pytest.mark.parametrize("state", ["collecting"] + HOOK_STATES)
def test_file_crash_in_state_recovers(tmp_path, state):
    crash_and_recover(tmp_path, FileTransport, state)


@pytest.mark.parametrize("state", S3_STATES)
def test_s3_crash_in_state_recovers(tmp_path, s3, state):
    # on s3:// the settle runs beside the publish and a small step's ends first (served -> durable, the
    # publish recorded without a move): for published the crashing run settles after its publish, as
    # file:// always does (the DILOCOD_TEST_SETTLE_AFTER_PUBLISH hook), so step 2 enters it every time
    env = {"DILOCOD_TEST_SETTLE_AFTER_PUBLISH": "1"} if state == "published" else None
    crash_and_recover(tmp_path, S3Transport, state, s3, crash_env=env)


def test_unknown_crash_state_is_refused_and_ignored(tmp_path):
    """A typo in the hook never kills a daemon: it is logged at error level and the daemon runs on."""
    model = tiny_model()
    write_model(tmp_path / "init.safetensors", model)
    d = Dilocod(tmp_path, tmp_path / "hub", "--init-model", str(tmp_path / "init.safetensors"),
                "--expected-nodes", "1", env={"DILOCOD_TEST_CRASH_AT": "servd:1"})
    try:
        d.start()
        d.wait_log("error pipeline: DILOCOD_TEST_CRASH_AT ignored: not <state>[:<step>] value=servd:1")
        write_delta(tmp_path / "hub", NODES[0], 0, 1, round_delta(model, 0, 0))
        d.wait_settled(1)
        assert d.alive() and "test hook" not in d.log_text()
        assert d.stop() == 0
    finally:
        if d.alive():
            d.kill9()
