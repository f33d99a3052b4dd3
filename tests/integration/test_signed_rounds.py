"""Verifiable rounds (issue 38, README "Verifiable rounds"): dilocod --signing-key signs a record of
every committed step, global/rounds/<s>.json with its detached Ed25519 signature <s>.json.sig, published
before step_count.json names the step on file:// and served over HTTP.

What is checked against independent implementations: every signature with Python's `cryptography`
(not the server's OpenSSL calls), every block hash with hashlib through diloco.blockhash (the definition:
sha256 over the sha256 digests of 16 MiB blocks), the inputs' hashes against the bytes the workers sent,
the outputs' against the files served, and the chain of "previous" links.  The worker package's
Worker(public_key=) refuses an edited record, another key's signature, a global planted in the tree with
a record of its own, and a rollback to an older genuine step, leaving the model untouched.  kill -9 at
each crash hook of the commit leaves no published step without its record, and the record recomputed
at the restart is the same bytes."""
import hashlib
import json
import os
import subprocess

import numpy as np
import pytest
import requests
import torch
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import (Encoding, PublicFormat, load_pem_private_key,
                                                          load_pem_public_key)

import diloco
from diloco.blockhash import block_hash_bytes
from conftest import BUILD
from dilocod_proc import Dilocod, write_delta, write_model

NODES = ["n1", "n2", "n3"]


def keygen(path):
    p = subprocess.run([str(BUILD / "diloco"), "keygen", "-o", str(path)], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    return path, p.stdout.split()[0]


def pub_of(path):
    return load_pem_public_key((path.parent / (path.name + ".pub")).read_bytes())


def model_of(seed=38):
    g = torch.Generator().manual_seed(seed)
    return {"layer.weight": torch.randn(48, 32, generator=g), "layer.bias": torch.randn(32, generator=g),
            "emb": torch.randn(16, 8, generator=g).to(torch.bfloat16)}


class Net(torch.nn.Module):
    """A module whose state_dict is model_of()'s (the worker package pulls into a module)."""

    def __init__(self, state):
        super().__init__()
        for k, v in state.items():
            self.register_buffer(k.replace(".", "_"), v.clone())
        self._names = {k.replace(".", "_"): k for k in state}

    def state_dict(self, *a, **kw):
        return {self._names[k]: v for k, v in self._buffers.items()}


def delta_bytes(model, node, base, local, scale, encode=None, seed=0):
    """A delta's file bytes, as the worker package writes them (plain F32, or compressed)."""
    rng = np.random.default_rng([38, base, local, seed])
    base_state = {k: v.clone() for k, v in model.items()}
    cur = {k: (v.float() - torch.from_numpy(rng.standard_normal(tuple(v.shape)).astype(np.float32)) * scale).to(v.dtype)
           for k, v in model.items()}
    meta = diloco.delta_metadata(node, base, local)
    d = diloco.encode_delta(base_state, cur, encode, metadata=meta)[0] if encode is not None else \
        diloco.plain_delta(base_state, cur, meta)
    return bytes(d)


def put(url, node, local, body):
    return requests.put(f"{url}/nodes/{node}/delta_{local}.safetensors", data=body, timeout=60)


def record_of(tree, step):
    return (tree / f"global/rounds/{step}.json").read_bytes(), (tree / f"global/rounds/{step}.json.sig").read_bytes()


def check_chain(pub, fingerprint, records):
    """records: {step: (json bytes, sig bytes)} of consecutive steps: each signature (cryptography),
    each previous link, each outer_step."""
    prev = None
    for s in sorted(records):
        raw, sig = records[s]
        pub.verify(sig, raw)            # raises InvalidSignature
        rec = json.loads(raw)
        assert rec["outer_step"] == s and rec["aggregator"]["key_fingerprint"] == fingerprint, rec
        if prev is not None:
            assert rec["previous"] == block_hash_bytes(records[s - 1][0]), (s, rec["previous"])
        prev = rec
    return {s: json.loads(r[0]) for s, r in records.items()}


def test_signed_run_over_http_and_file(tmp_path):
    """5 rounds, median, F32 and compressed deltas over HTTP and a node writing into the file:// tree, a
    quarantined delta (--max-norm) and a stale refusal: every record checked, and a verifying worker pulls
    each step over HTTP and over file://."""
    key, fp = keygen(tmp_path / "key")
    model = model_of()
    write_model(tmp_path / "init.safetensors", model)
    hub = tmp_path / "hub"
    d = Dilocod(tmp_path, hub, "--init-model", str(tmp_path / "init.safetensors"), "--expected-nodes", "3",
                "--min-nodes", "2", "--round-timeout", "2", "--aggregate", "median", "--max-norm", "100",
                "--signing-key", str(key)).start()
    sent = {}           # (node, local) -> block hash of the bytes sent
    bodies, globals_, momenta = {}, {0: (tmp_path / "init.safetensors").read_bytes()}, {}
    http_worker = diloco.Worker(d.url, "reader-http", public_key=str(tmp_path / "key.pub"))
    file_worker = diloco.Worker(f"file://{hub}", "reader-file", public_key=str(tmp_path / "key.pub"))
    net_h, net_f = Net(model), Net(model)
    try:
        d.wait_step(0)
        assert http_worker.pull(net_h) == 0 and file_worker.pull(net_f) == 0
        for r in range(5):
            local = r + 1
            # n1: F32 over HTTP; n2: int8_block over HTTP; n3: F32 into the tree (round 2: far too large)
            b1 = delta_bytes(model, "n1", r, local, 0.01, seed=1)
            b2 = delta_bytes(model, "n2", r, local, 0.01, encode="int8_block", seed=2)
            b3 = delta_bytes(model, "n3", r, local, 100.0 if r == 2 else 0.01, seed=3)
            assert put(d.url, "n1", local, b1).status_code == 201
            assert put(d.url, "n2", local, b2).status_code == 201
            (hub / "nodes/n3").mkdir(parents=True, exist_ok=True)
            tmp = hub / f"nodes/n3/.delta_{local}.tmp"
            tmp.write_bytes(b3)
            os.rename(tmp, hub / f"nodes/n3/delta_{local}.safetensors")
            sent.update({("n1", local): block_hash_bytes(b1), ("n2", local): block_hash_bytes(b2),
                         ("n3", local): block_hash_bytes(b3)})
            bodies.update({("n1", local): b1, ("n2", local): b2, ("n3", local): b3})
            d.wait_step(r + 1)
            d.wait_settled(r + 1)       # the state's momentum of the step, for verify-round below
            globals_[r + 1] = (hub / "global/latest.safetensors").read_bytes()
            momenta[r + 1] = (d.state_dir / f"outer_state-{r + 1}.safetensors").read_bytes()
            if r == 3:      # a late delta of the closed round: 409 stale, listed in the next step's record
                stale = put(d.url, "n1", 100, delta_bytes(model, "n1", r, 100, 0.01, seed=9))
                assert stale.status_code == 409, stale.text
            assert http_worker.pull(net_h) == r + 1 and file_worker.pull(net_f) == r + 1
        served = requests.get(d.url + "/global/latest.safetensors", timeout=30).content
        d.wait_settled(5)
        momentum = (d.state_dir / "outer_state-5.safetensors").read_bytes()
        over_http = {s: (requests.get(f"{d.url}/global/rounds/{s}.json", timeout=30).content,
                         requests.get(f"{d.url}/global/rounds/{s}.json.sig", timeout=30).content) for s in range(6)}
        assert requests.get(f"{d.url}/global/rounds/6.json", timeout=30).status_code == 404
        # --verify-keep (16 by default with a key): step 4's global and momentum and step 5's inputs, served
        kept = lambda rel: requests.get(f"{d.url}/rounds/{rel}", timeout=30)
        assert kept("4/global.safetensors").content == globals_[4]
        assert kept("4/momentum.safetensors").content == momenta[4]
        rec5 = json.loads(over_http[5][0])
        served_inputs = {(i["node_id"], i["local_step"]): kept(f"5/inputs/{i['node_id']}.safetensors").content
                         for i in rec5["inputs"] if i["verdict"] == "aggregated"}
        assert served_inputs == {k: bodies[k] for k in served_inputs} and len(served_inputs) == 3
        assert kept("6/global.safetensors").status_code == 404 and kept("5/inputs/..%2f.safetensors").status_code == 404
        # ... and verify-round fetches them itself
        for s in (2, 3, 4, 5):
            p = subprocess.run([str(BUILD / "diloco"), "verify-round", "--server", d.url, "--step", str(s), "--public-key",
                                str(tmp_path / "key.pub")], capture_output=True, text=True)
            assert p.returncode == 0 and f"step {s} verified" in p.stdout, (s, p.stdout, p.stderr)
        p = subprocess.run([str(BUILD / "diloco"), "verify-round", "--server", d.url, "--chain", "2..5", "--public-key",
                            str(tmp_path / "key.pub")], capture_output=True, text=True)
        assert p.returncode == 0 and "steps 2..5 verified, each record chained" in p.stdout, (p.stdout, p.stderr)
        p = subprocess.run([str(BUILD / "diloco"), "verify-round", "--server", d.url, "--chain", "1..1", "--public-key",
                            str(tmp_path / "key.pub")], capture_output=True, text=True)
        assert p.returncode == 0, p.stderr          # the bootstrap's global is kept too (no momentum before step 1)
    finally:
        assert d.stop() == 0
    in_tree = {s: record_of(hub, s) for s in range(6)}
    assert in_tree == over_http
    recs = check_chain(pub_of(key), fp, in_tree)
    assert recs[0]["origin"] == "bootstrap" and recs[0]["previous"] is None and recs[0]["inputs"] == []
    assert recs[0]["outputs"]["global"]["block_hash"] == block_hash_bytes((tmp_path / "init.safetensors").read_bytes())
    for s in range(1, 6):
        rec = recs[s]
        assert rec["config"]["aggregate"] == "median" and rec["config"]["max_norm"] == 100, rec["config"]
        used = [i for i in rec["inputs"] if i["verdict"] == "aggregated"]
        for i in rec["inputs"]:
            if i["block_hash"] is not None:     # every delta taken in: the bytes its worker sent
                assert i["block_hash"] == sent[(i["node_id"], i["local_step"])], i
        enc = {i["node_id"]: i["encoding"] for i in used}
        assert enc.get("n2") == "int8_block" and enc.get("n1") == "none", rec["inputs"]
        if s == 3:      # round 2: n3 quarantined at its arrival by --max-norm, two aggregated
            assert sorted(i["node_id"] for i in used) == ["n1", "n2"], rec["inputs"]
            q = [i for i in rec["inputs"] if i["verdict"] == "quarantined"]
            assert [(i["node_id"], i["local_step"], i["reason"]) for i in q] == [("n3", 3, "max_norm")], rec["inputs"]
        else:
            assert sorted(i["node_id"] for i in used) == NODES, rec["inputs"]
    stale = [i for i in recs[5]["inputs"] if i["verdict"] == "refused"]
    assert stale == [{"node_id": "n1", "path": "nodes/n1/delta_100.safetensors", "base_outer_step": 3,
                      "local_step": 100, "block_hash": None, "verdict": "refused", "reason": "stale"}], recs[5]["inputs"]
    # the outputs: the global served, the momentum the state keeps, as the record hashes them
    assert recs[5]["outputs"]["global"] == {"path": "global/latest.safetensors", "block_hash": block_hash_bytes(served),
                                            "bytes": len(served)}
    assert (hub / "global/latest.safetensors").read_bytes() == served
    assert recs[5]["outputs"]["momentum"]["block_hash"] == block_hash_bytes(momentum)
    # the verifying workers installed exactly the served global and kept each record
    assert http_worker.record == recs[5] and file_worker.record == recs[5]
    for k, v in net_h.state_dict().items():
        assert torch.equal(v, net_f.state_dict()[k])
    # diloco verify-round recomputes every step from its inputs with libdiloco's pass
    for s in range(0, 6):
        p = verify_round(tmp_path, s, in_tree[s], globals_, momenta, bodies, recs[s])
        assert p.returncode == 0 and f"step {s} " in p.stdout, (s, p.stdout, p.stderr)
    # a verifier that has only the server's answers: step 5 from /rounds/4/ and /rounds/5/inputs/
    p = verify_round(tmp_path, 5, over_http[5], globals_, momenta, served_inputs, recs[5])
    assert p.returncode == 0, p.stderr
    # one byte flipped: in an input, in the previous global, in the previous momentum; the record edited
    flip = lambda b, at: b[:at] + bytes([b[at] ^ 1]) + b[at + 1:]
    p = verify_round(tmp_path, 4, in_tree[4], globals_, momenta, {**bodies, ("n2", 4): flip(bodies[("n2", 4)], -3)}, recs[4])
    assert p.returncode == 1 and "input n2:" in p.stderr, p.stderr
    p = verify_round(tmp_path, 4, in_tree[4], {**globals_, 3: flip(globals_[3], -5)}, momenta, bodies, recs[4])
    assert p.returncode == 1 and "previous global:" in p.stderr, p.stderr
    p = verify_round(tmp_path, 4, in_tree[4], globals_, {**momenta, 3: flip(momenta[3], -5)}, bodies, recs[4])
    assert p.returncode == 1 and "previous momentum:" in p.stderr, p.stderr
    edited = (in_tree[4][0].replace(b'"lr":0.7', b'"lr":0.6'), in_tree[4][1])
    p = verify_round(tmp_path, 4, edited, globals_, momenta, bodies, recs[4])
    assert p.returncode == 1 and "signature:" in p.stderr, p.stderr


def verify_round(tmp, step, record, globals_, momenta, bodies, rec):
    """diloco verify-round on step's record with the previous step's global and momentum and the inputs
    its record names, as files in a directory of their own."""
    d = tmp / f"verify-{step}-{os.urandom(4).hex()}"
    (d / "in").mkdir(parents=True)
    (d / "m.json").write_bytes(record[0])
    (d / "m.json.sig").write_bytes(record[1])
    (d / "prev.safetensors").write_bytes(globals_[max(step - 1, 0)] if step > 0 else globals_[0])
    args = [str(BUILD / "diloco"), "verify-round", "--manifest", str(d / "m.json"), "--signature", str(d / "m.json.sig"),
            "--public-key", str(tmp / "key.pub"), "--previous-global", str(d / "prev.safetensors"), "--inputs", str(d / "in")]
    if step - 1 in momenta:
        (d / "mom.safetensors").write_bytes(momenta[step - 1])
        args += ["--previous-momentum", str(d / "mom.safetensors")]
    for i in rec["inputs"]:
        if i["verdict"] == "aggregated":
            f = d / "in" / i["path"]
            f.parent.mkdir(parents=True, exist_ok=True)
            f.write_bytes(bodies[(i["node_id"], i["local_step"])])
    return subprocess.run(args, capture_output=True, text=True)


def run_rounds(tmp_path, key, rounds, *extra):
    model = model_of(7)
    write_model(tmp_path / "init.safetensors", model)
    hub = tmp_path / "hub"
    d = Dilocod(tmp_path, hub, "--init-model", str(tmp_path / "init.safetensors"), "--expected-nodes", "2",
                "--signing-key", str(key), *extra).start()
    d.wait_step(0)
    globals_ = {0: (hub / "global/latest.safetensors").read_bytes()}
    for r in range(rounds):
        for i, node in enumerate(NODES[:2]):
            write_delta(hub, node, r, r + 1, {k: np.random.default_rng([r, i]).standard_normal(
                tuple(v.shape)).astype(np.float32) * np.float32(0.01) for k, v in model.items()})
        d.wait_step(r + 1)
        globals_[r + 1] = (hub / "global/latest.safetensors").read_bytes()
    return d, model, hub, globals_


def refused(worker, net, reason):
    before = {k: v.clone() for k, v in net.state_dict().items()}
    with pytest.raises(diloco.RecordRefused) as e:
        worker.pull(net)
    assert e.value.reason == reason, e.value
    for k, v in net.state_dict().items():
        assert torch.equal(v, before[k]), k        # the model is left as it was
    return e.value


def test_worker_refuses_tampered_trees(tmp_path):
    """A file:// tree rewritten by another writer: the verifying worker refuses each forgery and keeps
    the model; it walks the chain over steps it skipped."""
    key, fp = keygen(tmp_path / "key")
    pub = str(tmp_path / "key.pub")
    d, model, hub, globals_ = run_rounds(tmp_path, key, 3)
    assert d.stop() == 0
    url = f"file://{hub}"
    w = diloco.Worker(url, "reader", public_key=pub)
    net = Net(model)
    assert w.pull(net) == 3 and w.record["outer_step"] == 3
    genuine = {s: record_of(hub, s) for s in range(4)}

    # the record edited (a value of its config): the signature no longer holds
    raw, sig = genuine[3]
    (hub / "global/rounds/3.json").write_bytes(raw.replace(b'"lr":0.7', b'"lr":0.8'))
    refused(diloco.Worker(url, "fresh", public_key=pub), Net(model), "signature")
    # the record signed by another key
    other = Ed25519PrivateKey.generate()
    (hub / "global/rounds/3.json").write_bytes(raw)
    (hub / "global/rounds/3.json.sig").write_bytes(other.sign(raw))
    refused(diloco.Worker(url, "fresh", public_key=pub), Net(model), "signature")
    (hub / "global/rounds/3.json.sig").write_bytes(sig)

    # a planted step 4: a global of the writer's own, its step file and a record it signed itself
    planted = {k: v + 1 for k, v in model.items()}
    write_model(hub / "global/latest.safetensors", planted)
    rec = json.loads(raw)
    rec.update(outer_step=4, previous=block_hash_bytes(raw))
    rec["outputs"]["global"] = {"path": "global/latest.safetensors", "bytes": os.path.getsize(hub / "global/latest.safetensors"),
                                "block_hash": block_hash_bytes((hub / "global/latest.safetensors").read_bytes())}
    forged = json.dumps(rec, separators=(",", ":")).encode()
    (hub / "global/rounds/4.json").write_bytes(forged)
    (hub / "global/rounds/4.json.sig").write_bytes(other.sign(forged))
    step_file = json.loads((hub / "global/step_count.json").read_text())
    (hub / "global/step_count.json").write_text(json.dumps(dict(step_file, outer_step=4)))
    refused(w, net, "signature")
    # ... or with step 3's genuine record put back under the planted global: the bytes are not the signed ones
    (hub / "global/step_count.json").write_text(json.dumps(step_file))
    e = refused(diloco.Worker(url, "fresh", public_key=pub), Net(model), "output")
    assert e.step == 3

    # rollback: step 1's genuine global, step file and record re-planted: below the step this worker verified
    (hub / "global/latest.safetensors").write_bytes(globals_[1])
    (hub / "global/step_count.json").write_text(json.dumps(dict(step_file, outer_step=1)))
    assert record_of(hub, 1) == genuine[1]
    refused(w, net, "rollback")
    # a joiner told the step it may not go below refuses it too; one that knows nothing takes the genuine
    # step 1 (trust starts at the first record it verifies)
    refused(diloco.Worker(url, "joiner", public_key=pub, min_step=2), Net(model), "rollback")
    joiner = diloco.Worker(url, "joiner", public_key=pub)
    assert joiner.pull(Net(model)) == 1 and joiner.record == json.loads(genuine[1][0])


def test_worker_walks_the_chain_and_refuses_a_break(tmp_path):
    """A worker that verified step 0 and comes back at step 3 walks records 3, 2, 1 back to 0; a record
    in between replaced by a genuine-looking one of another chain (another key) breaks the walk."""
    key, fp = keygen(tmp_path / "key")
    pub = str(tmp_path / "key.pub")
    model = model_of(7)
    write_model(tmp_path / "init.safetensors", model)
    hub = tmp_path / "hub"
    d = Dilocod(tmp_path, hub, "--init-model", str(tmp_path / "init.safetensors"), "--expected-nodes", "2",
                "--signing-key", str(key)).start()
    try:
        d.wait_step(0)
        w = diloco.Worker(d.url, "reader", public_key=pub)
        net = Net(model)
        assert w.pull(net) == 0
        for r in range(3):
            for i, node in enumerate(NODES[:2]):
                write_delta(hub, node, r, r + 1, {k: np.random.default_rng([r, i]).standard_normal(
                    tuple(v.shape)).astype(np.float32) * np.float32(0.01) for k, v in model.items()})
            d.wait_step(r + 1)
        assert w.pull(net) == 3                 # over HTTP: records 3, 2, 1 fetched and linked to 0
        assert w.record["previous"] == block_hash_bytes(record_of(hub, 2)[0])
    finally:
        assert d.stop() == 0
    # file://: step 2's record swapped for a validly signed record that is not the one step 3 names
    w = diloco.Worker(f"file://{hub}", "reader", public_key=pub)
    step_file = json.loads((hub / "global/step_count.json").read_text())
    g3 = (hub / "global/latest.safetensors").read_bytes()
    g0 = (tmp_path / "init.safetensors").read_bytes()
    (hub / "global/latest.safetensors").write_bytes(g0)
    (hub / "global/step_count.json").write_text(json.dumps(dict(step_file, outer_step=0)))
    net = Net(model)
    assert w.pull(net) == 0
    (hub / "global/latest.safetensors").write_bytes(g3)
    (hub / "global/step_count.json").write_text(json.dumps(step_file))
    (hub / "global/rounds/2.json").write_bytes(record_of(hub, 1)[0])      # genuine bytes, wrong place
    (hub / "global/rounds/2.json.sig").write_bytes(record_of(hub, 1)[1])
    refused(w, net, "record")                   # step 1's record says outer_step 1


COMMIT_HOOKS = ["inputs_durable", "committed", "served", "published", "durable"]


@pytest.mark.parametrize("state,downlink", [(s, None) for s in COMMIT_HOOKS] +
                         [("committed", "mxfp8"), ("published", "mxfp8")])
def test_kill9_at_commit_hooks_keeps_records(tmp_path, state, downlink):
    """SIGKILL as step 2 enters each state of the commit: the tree never names a step without its record,
    and once the restart recovered, step 2's record is the one it had before the kill (byte for byte),
    signature included, in the state and in the tree.  With --downlink the recovery makes the view and
    update again, and the record names them as before."""
    key, fp = keygen(tmp_path / "key")
    model = model_of(9)
    write_model(tmp_path / "init.safetensors", model)
    hub = tmp_path / "hub"
    delta = lambda r, i: {k: np.random.default_rng([9, r, i]).standard_normal(tuple(v.shape)).astype(np.float32)
                          * np.float32(0.01) for k, v in model.items()}
    d = Dilocod(tmp_path, hub, "--init-model", str(tmp_path / "init.safetensors"), "--expected-nodes", "2",
                "--signing-key", str(key), *(["--downlink", downlink] if downlink else []),
                env={"DILOCOD_TEST_CRASH_AT": f"{state}:2"}).start()
    d.wait_step(0)
    for r in range(2):
        for i, node in enumerate(NODES[:2]):
            write_delta(hub, node, r, r + 1, delta(r, i))
        if r == 0:
            d.wait_step(1)
    d.wait_killed_at(state, 2)
    published = json.loads((hub / "global/step_count.json").read_text())["outer_step"]
    for s in range(published + 1):
        assert (hub / f"global/rounds/{s}.json").exists() and (hub / f"global/rounds/{s}.json.sig").exists(), s
    before = None
    rec_path = d.state_dir / "rounds/2.json"
    if rec_path.exists():
        before = (rec_path.read_bytes(), (d.state_dir / "rounds/2.json.sig").read_bytes())
    d.env = None                                # restarted without the hook
    d.start()
    try:
        d.wait_step(2)
        d.wait_settled(2)
        after = (rec_path.read_bytes(), (d.state_dir / "rounds/2.json.sig").read_bytes())
        assert record_of(hub, 2) == after
        if state != "inputs_durable":           # committed by then: recomputed from its redo record
            assert before == after, state
        check_chain(pub_of(key), fp, {s: record_of(hub, s) for s in range(3)})
        assert json.loads(after[0])["outputs"]["global"]["block_hash"] == \
            block_hash_bytes((hub / "global/latest.safetensors").read_bytes())
        if downlink:
            outs = json.loads(after[0])["outputs"]
            view = requests.get(f"{d.url}/global/view.safetensors", timeout=30).content
            assert outs["view"]["block_hash"] == block_hash_bytes(view), outs
            assert outs["update"]["block_hash"] == \
                block_hash_bytes((hub / "global/updates/2.safetensors").read_bytes()), outs
    finally:
        assert d.stop() == 0


def test_keys_and_modes(tmp_path):
    """diloco keygen writes 0600 + .pub and never overwrites; the fingerprint is the sha256 of the raw
    public key (cryptography's); dilocod refuses a signing key or a token file others can read, and
    --signing-key beside a transport that does not publish records yet."""
    key, fp = keygen(tmp_path / "key")
    assert (os.stat(key).st_mode & 0o777) == 0o600
    raw = pub_of(key).public_bytes(Encoding.Raw, PublicFormat.Raw)
    assert fp == hashlib.sha256(raw).hexdigest()
    priv = load_pem_private_key(key.read_bytes(), None)
    assert priv.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw) == raw
    p = subprocess.run([str(BUILD / "diloco"), "keygen", "-o", str(key)], capture_output=True, text=True)
    assert p.returncode != 0 and "not overwritten" in p.stderr, p.stderr
    p = subprocess.run([str(BUILD / "diloco"), "keygen", "--fingerprint", str(tmp_path / "key.pub")],
                       capture_output=True, text=True)
    assert p.returncode == 0 and p.stdout.split()[0] == fp
    write_model(tmp_path / "init.safetensors", model_of())

    def check(*args):
        return subprocess.run([str(BUILD / "dilocod"), "--state-root", str(tmp_path / "st"), "--expected-nodes", "2",
                               "--init-model", str(tmp_path / "init.safetensors"), "--hub", "none", "--check-config",
                               *args], capture_output=True, text=True)

    assert check("--signing-key", str(key)).returncode == 0
    os.chmod(key, 0o640)
    p = check("--signing-key", str(key))
    assert p.returncode == 2 and "chmod 600" in p.stderr, p.stderr
    os.chmod(key, 0o600)
    public = tmp_path / "public-only"
    public.write_bytes((tmp_path / "key.pub").read_bytes())
    os.chmod(public, 0o600)
    p = check("--signing-key", str(public))
    assert p.returncode == 2 and "not a PEM PKCS#8 private key" in p.stderr, p.stderr
    tokens = tmp_path / "tokens"
    tokens.write_text("w1 aaaaaaaaaaaaaaaaaaaaaaaa\n")
    os.chmod(tokens, 0o644)
    p = check("--token-file", str(tokens))
    assert p.returncode == 2 and "chmod 600" in p.stderr, p.stderr
    p = check("--signing-key", str(key), "--hub", "hf://org/repo")
    assert p.returncode == 2 and "--signing-key FILE needs --hub file://..., s3://... or none" in p.stderr, p.stderr


def test_async_one_record_per_update(tmp_path):
    """--mode async: every update is a step with its own record (its one delta, its staleness weight, the
    Delayed Nesterov phase), chained; the accumulator is an output while the phase is between Nesterov
    steps."""
    key, fp = keygen(tmp_path / "key")
    model = model_of(11)
    write_model(tmp_path / "init.safetensors", model)
    hub = tmp_path / "hub"
    d = Dilocod(tmp_path, hub, "--init-model", str(tmp_path / "init.safetensors"), "--mode", "async",
                "--expected-nodes", "2", "--dn-period", "2", "--grace-ms", "0", "--staleness-weight", "poly",
                "--signing-key", str(key), "--verify-keep", "2").start()
    sent = {}
    try:
        d.wait_step(0)
        for u in range(4):
            node, base = NODES[u % 2], max(0, u - 1)       # one delta per update, the odd ones one step stale
            body = delta_bytes(model, node, base, u + 1, 0.01, seed=u)
            assert put(d.url, node, u + 1, body).status_code == 201
            sent[(node, u + 1)] = block_hash_bytes(body)
            d.wait_step(u + 1)
        d.wait_settled(4)
    finally:
        assert d.stop() == 0
    # --verify-keep 2: the last two updates' files, the accumulator where the update left one
    assert sorted(os.listdir(d.state_dir / "verify")) == ["3", "4"]
    assert sorted(os.listdir(d.state_dir / "verify/3")) == ["accumulator.safetensors", "global.safetensors",
                                                          "inputs", "momentum.safetensors"]
    recs = check_chain(pub_of(key), fp, {s: record_of(hub, s) for s in range(5)})
    for s in range(1, 5):
        rec = recs[s]
        assert rec["config"]["mode"] == "async" and rec["config"]["async"]["dn_period"] == 2, rec["config"]
        [i] = rec["inputs"]
        assert i["verdict"] == "aggregated" and i["block_hash"] == sent[(i["node_id"], i["local_step"])], i
        tau = s - 1 - i["base_outer_step"]
        assert rec["config"]["async"]["weight"] == pytest.approx((1 + tau) ** -0.5), (s, rec["config"])
        # k before the update: 0, 1, 0, 1 with period 2; after an odd one the accumulator holds a delta
        assert rec["config"]["async"]["dn_k"] == (s - 1) % 2, rec["config"]
        assert ("accumulator" in rec["outputs"]) == (rec["config"]["async"]["dn_k"] == 0), rec["outputs"]


def test_s3_publishes_records_before_the_step(tmp_path, monkeypatch):
    """s3:// (SeaweedFS): each step's record and signature are objects under global/rounds/, put before
    step_count.json names the step, the same bytes as the state's and HTTP's, chained and signed."""
    from s3server import SeaweedS3
    from test_s3 import S3Dilocod, put_delta

    key, fp = keygen(tmp_path / "key")
    s3 = SeaweedS3(tmp_path / "seaweedfs").start()
    try:
        model = model_of(13)
        write_model(tmp_path / "init.safetensors", model)
        prefix = "signed/run"
        d = S3Dilocod(tmp_path, s3, prefix, "--init-model", tmp_path / "init.safetensors", "--expected-nodes", "2",
                      "--signing-key", str(key)).start()
        try:
            d.wait_step(0)
            for r in range(2):
                for i, node in enumerate(NODES[:2]):
                    put_delta(d.client, s3.bucket, prefix, node, r, r + 1, {k: np.random.default_rng([13, r, i]).standard_normal(
                        tuple(v.shape)).astype(np.float32) * np.float32(0.01) for k, v in model.items()})
                d.wait_step(r + 1)
            objs = {s: (d.get(f"global/rounds/{s}.json"), d.get(f"global/rounds/{s}.json.sig")) for s in range(3)}
            http = {s: (requests.get(f"{d.url}/global/rounds/{s}.json", timeout=30).content,
                        requests.get(f"{d.url}/global/rounds/{s}.json.sig", timeout=30).content) for s in range(3)}
            g = d.get("global/latest.safetensors")
            # a verifying worker reads the bucket itself (boto3, the test server's credentials)
            for k, v in dict(s3.env(), AWS_ENDPOINT_URL=s3.endpoint, AWS_DEFAULT_REGION="us-east-1").items():
                monkeypatch.setenv(k, v)
            w = diloco.Worker(f"s3://{s3.bucket}/{prefix}", "reader", public_key=str(tmp_path / "key.pub"))
            assert w.pull(Net(model)) == 2 and w.record["outer_step"] == 2
            # the step file is put after the record: its object is the newer
            meta = lambda rel: d.client.head_object(Bucket=s3.bucket, Key=d.key(rel))["LastModified"]
            assert meta("global/rounds/2.json") <= meta("global/step_count.json")
        finally:
            assert d.stop() == 0
        assert objs == http
        recs = check_chain(pub_of(key), fp, objs)
        assert recs[2]["outputs"]["global"]["block_hash"] == block_hash_bytes(g)
    finally:
        s3.stop()


def test_recovery_keeps_the_key_a_step_was_committed_under(tmp_path):
    """A step committed under one key and recomputed at a restart given another: refused with the way
    out (a record would name one key and carry another's signature); with the first key it recovers."""
    key, fp = keygen(tmp_path / "key")
    other, _ = keygen(tmp_path / "other")
    model = model_of(5)
    write_model(tmp_path / "init.safetensors", model)
    hub = tmp_path / "hub"
    d = Dilocod(tmp_path, hub, "--init-model", str(tmp_path / "init.safetensors"), "--expected-nodes", "2",
                env={"DILOCOD_TEST_CRASH_AT": "committed:1"})
    d.start("--signing-key", str(key))
    d.wait_step(0)
    for i, node in enumerate(NODES[:2]):
        write_delta(hub, node, 0, 1, {k: np.full(tuple(v.shape), 0.01 * (i + 1), dtype=np.float32) for k, v in model.items()})
    d.wait_killed_at("committed", 1)
    before = ((d.state_dir / "rounds/1.json").read_bytes(), (d.state_dir / "rounds/1.json.sig").read_bytes())
    d.env = None
    d.start("--signing-key", str(other))
    assert d.proc.wait(timeout=60) != 0
    assert "committed under another signing key" in d.log_text(), d.log_text()[-2000:]
    d.proc = None
    d.start("--signing-key", str(key))
    try:
        d.wait_step(1)
        assert record_of(hub, 1) == before
        check_chain(pub_of(key), fp, {s: record_of(hub, s) for s in range(2)})
    finally:
        assert d.stop() == 0


def test_record_parser_refuses_malformed_records():
    """diloco.rounds.parse_record reads a signed record as hostile too (a key's owner may sign garbage, a
    bug may write it): what a worker relies on is checked."""
    from diloco.rounds import parse_record
    h = "ab" * 32
    good = {"format": 1, "outer_step": 3, "previous": h, "aggregator": {"key_fingerprint": "fp"},
            "outputs": {"global": {"block_hash": h, "bytes": 10}}}
    assert parse_record(json.dumps(good).encode(), 3, "fp")["outer_step"] == 3
    bad = [b"not json", b"[]", json.dumps(dict(good, format=2)).encode(), json.dumps(dict(good, outer_step=4)).encode(),
           json.dumps(dict(good, outer_step=True)).encode(), json.dumps(dict(good, previous="xyz")).encode(),
           json.dumps(dict(good, aggregator={"key_fingerprint": "other"})).encode(),
           json.dumps(dict(good, outputs={"global": {"block_hash": h.upper(), "bytes": 10}})).encode(),
           json.dumps(dict(good, outputs={"global": {"block_hash": h, "bytes": -1}})).encode(),
           json.dumps(dict(good, outputs={})).encode()]
    for raw in bad:
        with pytest.raises(diloco.RecordRefused) as e:
            parse_record(raw, 3, "fp")
        assert e.value.reason == "record", raw


def test_signed_downlink_records_name_the_view_and_update(tmp_path):
    """--signing-key with --downlink mxfp8: each round's record names the step's view and update with the
    block hashes of the files served (HTTP and the file:// tree), step_count.json's view_hash is the
    record's, and a Worker(public_key=, downlink=True) checks each view it installs against its record
    (over HTTP and over file://); verify-round still verifies the step (the view and update said not
    recomputed)."""
    key, fp = keygen(tmp_path / "key")
    model = model_of(7)
    write_model(tmp_path / "init.safetensors", model)
    hub = tmp_path / "hub"
    d = Dilocod(tmp_path, hub, "--init-model", str(tmp_path / "init.safetensors"), "--expected-nodes", "2",
                "--signing-key", str(key), "--downlink", "mxfp8").start()
    pub = str(tmp_path / "key.pub")
    http_w, file_w = diloco.Worker(d.url, "v-http", public_key=pub, downlink=True), \
        diloco.Worker(f"file://{hub}", "v-file", public_key=pub, downlink=True)
    net_h, net_f = Net(model), Net(model)
    try:
        d.wait_step(0)
        assert http_w.pull(net_h) == 0 and file_w.pull(net_f) == 0
        for r in range(3):
            for i, node in enumerate(NODES[:2]):
                write_delta(hub, node, r, r + 1, {k: np.random.default_rng([r, i]).standard_normal(
                    tuple(v.shape)).astype(np.float32) * np.float32(0.01) for k, v in model.items()})
            d.wait_step(r + 1)
            s = r + 1
            raw = requests.get(f"{d.url}/global/rounds/{s}.json", timeout=30).content
            sig = requests.get(f"{d.url}/global/rounds/{s}.json.sig", timeout=30).content
            pub_of(key).verify(sig, raw)
            rec = json.loads(raw)
            view = requests.get(f"{d.url}/global/view.safetensors", timeout=30)
            assert view.status_code == 200 and int(view.headers["X-Outer-Step"]) == s
            update = requests.get(f"{d.url}/global/updates/{s}.safetensors", timeout=30)
            assert update.status_code == 200
            assert rec["outputs"]["view"] == {"path": None, "block_hash": block_hash_bytes(view.content),
                                              "bytes": len(view.content)}, rec["outputs"]
            assert rec["outputs"]["update"] == {"path": f"global/updates/{s}.safetensors",
                                                "block_hash": block_hash_bytes(update.content),
                                                "bytes": len(update.content)}, rec["outputs"]
            # the tree: the same update, step_count.json's view_hash the record's, the record before the step
            assert (hub / f"global/updates/{s}.safetensors").read_bytes() == update.content
            sc = json.loads((hub / "global/step_count.json").read_bytes())
            assert sc["view_hash"] == rec["outputs"]["view"]["block_hash"], sc
            assert record_of(hub, s) == (raw, sig)
            # verifying downlink workers: the replayed view is the one the record signs
            assert http_w.pull(net_h) == s and file_w.pull(net_f) == s
            assert http_w.record == rec and file_w.record == rec
            assert block_hash_bytes(http_w.view_bytes()) == rec["outputs"]["view"]["block_hash"]
            assert http_w.view_bytes() == file_w.view_bytes() == view.content
        assert http_w.updates_applied == 3, http_w.updates_applied     # replayed, each checked by its record
        d.wait_settled(3)
        recs = check_chain(pub_of(key), fp, {s: record_of(hub, s) for s in range(4)})
        assert "view" not in recs[0]["outputs"]         # the bootstrap: the view is the global
        p = subprocess.run([str(BUILD / "diloco"), "verify-round", "--server", d.url, "--step", "3", "--public-key",
                            pub], capture_output=True, text=True)
        assert p.returncode == 0 and "step 3 verified" in p.stdout and "not recomputed" in p.stdout, \
            (p.stdout, p.stderr)
    finally:
        assert d.stop() == 0
