"""dilocod rounds end to end over a file:// hub: the torch oracle over many rounds on a mixed-dtype model,
plain averaging with sgd/lr 1, quorum and timeout, stale/future/replaced deltas, invalid and partially
written delta files, restarts between and during rounds, and configuration errors."""
import json
import re
import struct
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.numpy import save_file

from conftest import BUILD
from dilocod_proc import (Dilocod, Oracle, assert_state_close, delta_metadata, load_torch, random_deltas,
                          write_delta, write_model)

CONTAINER_CODES = {
    "header_too_small", "header_too_large", "invalid_header_length", "invalid_header",
    "invalid_header_deserialization", "invalid_offset", "metadata_incomplete_buffer", "validation_overflow",
    "misaligned_slice", "tensor_invalid_info", "duplicate_key",
}


# ---- helpers ------------------------------------------------------------------------------------

def small_model(seed=0):
    """F32, BF16 and F16 weights, an I64 and a BOOL buffer."""
    g = torch.Generator().manual_seed(seed)
    return {
        "layer.weight": torch.randn(12, 7, generator=g),
        "layer.bias": torch.randn(7, generator=g),
        "emb.bf16": torch.randn(9, 5, generator=g).to(torch.bfloat16),
        "head.f16": torch.randn(4, 6, generator=g).to(torch.float16),
        "counter": torch.tensor([3, -1, 1 << 40], dtype=torch.int64),
        "mask": torch.tensor([[True, False], [False, True]]),
    }


def start(tmp_path, model, *args, seed_name="init.safetensors"):
    init = tmp_path / seed_name
    write_model(init, model)
    d = Dilocod(tmp_path, tmp_path / "hub", "--init-model", str(init), *args).start()
    d.wait_step(0)
    return d


def published(tmp_path):
    return load_torch(tmp_path / "hub" / "global" / "latest.safetensors")


def delta_bytes(tmp_path, node, base_step, local_step, tensors, metadata=None):
    """The bytes of a delta as the reference writes it (save_file to a scratch file outside the hub)."""
    scratch = tmp_path / f"scratch-{node}-{local_step}.safetensors"
    meta = metadata if metadata is not None else delta_metadata(node, base_step, local_step)
    save_file(tensors, str(scratch), metadata=meta)
    data = scratch.read_bytes()
    scratch.unlink()
    return data


def write_raw(hub, node, local_step, data: bytes) -> Path:
    """Puts raw bytes at nodes/<node>/delta_<local>.safetensors atomically (temp + rename)."""
    d = Path(hub) / "nodes" / node
    d.mkdir(parents=True, exist_ok=True)
    tmp = d / f".raw_{local_step}.tmp"
    tmp.write_bytes(data)
    final = d / f"delta_{local_step}.safetensors"
    tmp.rename(final)
    return final


def rejected_re(node, local_step):
    return re.compile(r"intake: delta rejected path=nodes/" + re.escape(node) + r"/delta_" + str(local_step)
                      + r"\.safetensors code=(\w+)")


def rejected_codes(d, node, local_step):
    return rejected_re(node, local_step).findall(d.log_text())


def wait_rejected(d, node, local_step, timeout=30):
    deadline = time.time() + timeout
    while time.time() < deadline:
        codes = rejected_codes(d, node, local_step)
        if codes:
            return codes
        assert d.alive(), d.log_text()[-4000:]
        time.sleep(0.02)
    raise AssertionError(f"nodes/{node}/delta_{local_step} not rejected within {timeout}s:\n{d.log_text()[-4000:]}")


def run_round(tmp_path, d, oracle, model, rng, step, nodes, local_step):
    """Every node of `nodes` delivers a random delta for `step`; checks the published step+1 against the oracle."""
    deltas = {n: random_deltas(rng, model) for n in nodes}
    for n, t in deltas.items():
        write_delta(tmp_path / "hub", n, step, local_step, t)
    want = oracle.step(deltas)
    d.wait_step(step + 1)
    assert_state_close(published(tmp_path), want)
    return want


def run_dilocod(args, timeout=30):
    p = subprocess.run([str(BUILD / "dilocod"), *[str(a) for a in args]], capture_output=True, text=True,
                       timeout=timeout)
    return p


# ---- 1. the oracle over 10 rounds ---------------------------------------------------------------

def test_ten_rounds_mixed_dtypes_match_oracle(tmp_path):
    model = small_model(1)
    oracle = Oracle(model)
    rng = np.random.default_rng(11)
    d = start(tmp_path, model, "--expected-nodes", "4", "--threads", "3")
    try:
        assert_state_close(published(tmp_path), model)
        for r in range(10):
            # write in an order that is not the node order: the mean must still be taken in node order
            nodes = ["n3", "n0", "n2", "n1"] if r % 2 else ["n1", "n3", "n0", "n2"]
            deltas = {n: random_deltas(rng, model, scale=0.05) for n in nodes}
            for n in nodes:
                write_delta(tmp_path / "hub", n, r, 100 * (r + 1), deltas[n])
            want = oracle.step(deltas)
            assert d.wait_step(r + 1) == r + 1
            got = published(tmp_path)
            assert_state_close(got, want)
            # non-floating state is carried unchanged, bit for bit
            assert torch.equal(got["counter"], model["counter"]) and torch.equal(got["mask"], model["mask"])
        assert d.committed_step() == 10
        # step_count.json is renamed into place just before "published" is logged: a loaded machine can
        # read the file before the line is written
        d.wait_log("hub: published step=10 ")
        log = d.log_text()
        for r in range(10):
            assert f"round: closed step={r} nodes=4 expected=4 reason=all_nodes" in log
            assert f"store: committed step={r + 1} " in log
            assert f"hub: published step={r + 1} " in log
    finally:
        assert d.stop() == 0


# ---- 2. sgd with lr 1 is plain averaging --------------------------------------------------------

def test_sgd_lr1_is_plain_averaging(tmp_path):
    model = small_model(2)
    rng = np.random.default_rng(12)
    d = start(tmp_path, model, "--expected-nodes", "3", "--optimizer", "sgd", "--lr", "1")
    try:
        old = published(tmp_path)
        for r in range(3):
            nodes = ["b", "c", "a"]
            deltas = {n: random_deltas(rng, model, scale=0.1) for n in nodes}
            for n in nodes:
                write_delta(tmp_path / "hub", n, r, r + 1, deltas[n])
            d.wait_step(r + 1)
            new = published(tmp_path)
            assert sorted(new) == sorted(old)
            for k, v in old.items():
                assert new[k].dtype == v.dtype and tuple(new[k].shape) == tuple(v.shape), k
                if not v.is_floating_point():
                    assert torch.equal(new[k], v), k
                    continue
                acc = deltas["a"][k].copy()        # ascending node id order
                acc += deltas["b"][k]
                acc += deltas["c"][k]
                mean = acc / np.float32(3)
                assert mean.dtype == np.float32
                want32 = v.to(torch.float32).numpy() - mean
                assert want32.dtype == np.float32
                want = torch.from_numpy(want32).to(v.dtype)
                # exact: old - mean in float32, rounded (RNE) to the weight's dtype
                assert torch.equal(new[k], want), (k, (new[k].double() - want.double()).abs().max().item())
            old = new
        assert d.committed_step() == 3
        # the settle and the cleanup remove the closed round's files in the background: walk the state
        # once they are done
        d.wait_settled(3)
        assert list(d.state_dir.rglob("outer_state*")) == [], list(d.state_dir.rglob("outer_state*"))
        assert "optimizer=sgd lr=1 momentum=0 " in d.log_text()
    finally:
        assert d.stop() == 0


# ---- 3. quorum and timeout ----------------------------------------------------------------------

def test_quorum_and_timeout(tmp_path):
    model = small_model(3)
    oracle = Oracle(model)
    rng = np.random.default_rng(13)
    d = start(tmp_path, model, "--expected-nodes", "4", "--min-nodes", "2", "--round-timeout", "1.5")
    hub = tmp_path / "hub"
    try:
        # only 2 of 4 deliver: the round closes by timeout, 1.5 s after the first accepted delta
        deltas = {n: random_deltas(rng, model) for n in ("n0", "n1")}
        t0 = time.time()
        for n, t in deltas.items():
            write_delta(hub, n, 0, 10, t)
        d.wait_log("round: delta accepted step=0 node=n0")
        d.wait_log("round: delta accepted step=0 node=n1")
        want = oracle.step(deltas)
        d.wait_step(1, timeout=30)
        elapsed = time.time() - t0
        assert elapsed >= 1.4, f"round closed after {elapsed:.2f}s, before the 1.5s timeout"
        assert "round: closed step=0 nodes=2 expected=4 reason=timeout" in d.log_text()
        assert_state_close(published(hub.parent), want)

        # 1 node (below min_nodes=2): the round stays open well past the timeout
        only = {"n2": random_deltas(rng, model)}
        write_delta(hub, "n2", 1, 20, only["n2"])
        d.wait_log("round: delta accepted step=1 node=n2")
        time.sleep(3.5)
        assert d.alive()
        assert d.published_step() == 1 and d.committed_step() == 1
        assert "round: closed step=1" not in d.log_text()

        # a second node reaches the quorum: the deadline is long past, so the round closes at once
        second = random_deltas(rng, model)
        t1 = time.time()
        write_delta(hub, "n3", 1, 20, second)
        d.wait_step(2, timeout=30)
        assert time.time() - t1 < 1.0, f"round took {time.time() - t1:.2f}s to close after the quorum"
        assert "round: closed step=1 nodes=2 expected=4 reason=timeout" in d.log_text()
        want = oracle.step({"n2": only["n2"], "n3": second})
        assert_state_close(published(hub.parent), want)
    finally:
        assert d.stop() == 0


# ---- 4. stale and future deltas -----------------------------------------------------------------

def test_stale_and_future_deltas_are_refused(tmp_path):
    model = small_model(4)
    oracle = Oracle(model)
    rng = np.random.default_rng(14)
    hub = tmp_path / "hub"
    d = start(tmp_path, model, "--expected-nodes", "2")
    try:
        # a future delta at step 0
        write_delta(hub, "c", 3, 1, random_deltas(rng, model))
        d.wait_log("reason=future")
        assert re.search(r"delta refused .*node=c .*base_outer_step=3 .*reason=future", d.log_text())
        run_round(tmp_path, d, oracle, model, rng, 0, ["a", "b"], 10)

        # step 1: a stale delta (base 0) and a future one (base 2), both huge: were either used, the
        # result would be far from the oracle (and with expected 2 the round would close early)
        big = {k: v * 1000 for k, v in random_deltas(rng, model).items()}
        write_delta(hub, "c", 0, 50, big)
        write_delta(hub, "e", 2, 60, big)
        d.wait_log("reason=stale")
        d.wait_log("reason=future", count=2)
        log = d.log_text()
        assert re.search(r"delta refused path=nodes/c/delta_50\.safetensors node=c base_outer_step=0 step=1 "
                         r"reason=stale", log) or \
            re.search(r"round: delta refused step=1 node=c local_step=50 base_outer_step=0 reason=stale", log), log
        assert re.search(r"delta refused .*node=e .*base_outer_step=2 .*reason=future", log), log
        assert "delta accepted step=1" not in log
        time.sleep(0.5)
        assert d.published_step() == 1
        run_round(tmp_path, d, oracle, model, rng, 1, ["b", "a"], 20)
        log = d.log_text()
        assert "round: closed step=1 nodes=2 expected=2 reason=all_nodes" in log
        assert "delta accepted step=1 node=c" not in log and "delta accepted step=1 node=e" not in log
        # refused once each, not again at every poll
        assert len(re.findall(r"delta refused .*node=c .*base_outer_step=0 .*reason=stale", log)) == 1, log
        assert len(re.findall(r"delta refused .*node=e .*base_outer_step=2 .*reason=future", log)) == 1, log
    finally:
        assert d.stop() == 0


# ---- 5. a newer delta replaces the older one, a lower one is refused ----------------------------

def test_newer_delta_replaces_older_and_lower_is_refused(tmp_path):
    model = small_model(5)
    oracle = Oracle(model)
    rng = np.random.default_rng(15)
    hub = tmp_path / "hub"
    d = start(tmp_path, model, "--expected-nodes", "2")
    try:
        first, newer, lower = (random_deltas(rng, model) for _ in range(3))
        write_delta(hub, "a", 0, 10, first)
        d.wait_log("round: delta accepted step=0 node=a local_step=10")
        write_delta(hub, "a", 0, 20, newer)
        d.wait_log("round: delta replaced step=0 node=a local_step=20")
        write_delta(hub, "a", 0, 5, lower)
        d.wait_log("reason=not_newer")
        assert re.search(r"round: delta refused step=0 node=a local_step=5 base_outer_step=0 reason=not_newer",
                         d.log_text()), d.log_text()
        assert d.published_step() == 0
        b = random_deltas(rng, model)
        write_delta(hub, "b", 0, 7, b)
        want = oracle.step({"a": newer, "b": b})
        d.wait_step(1)
        assert_state_close(published(tmp_path), want)
        log = d.log_text()
        assert "round: closed step=0 nodes=2 expected=2 reason=all_nodes" in log
        assert re.search(r"node statistics step=1 node=a local_step=20 ", log), log
        # the replaced copy left the cache of the closed round (removed by the settle, in the background)
        d.wait_settled(1)
        cached = sorted(p.name for p in (d.state_dir / "cache").rglob("delta_*.safetensors"))
        assert "delta_10.safetensors" not in cached and "delta_5.safetensors" not in cached, cached
    finally:
        assert d.stop() == 0


# ---- 6. invalid deltas are skipped, each reported once with its code ----------------------------

def test_invalid_deltas_rejected_once_with_their_codes(tmp_path):
    model = small_model(6)
    oracle = Oracle(model)
    rng = np.random.default_rng(16)
    hub = tmp_path / "hub"
    d = start(tmp_path, model, "--expected-nodes", "2")
    try:
        def good():
            return random_deltas(rng, model)

        cases = {}                                  # (node, local_step) -> expected code(s)

        t = good(); del t["layer.bias"]
        write_delta(hub, "bad-missing", 0, 1, t); cases[("bad-missing", 1)] = {"key_mismatch"}
        t = good(); t["extra"] = np.zeros(3, np.float32)
        write_delta(hub, "bad-extra", 0, 1, t); cases[("bad-extra", 1)] = {"key_mismatch"}
        t = good(); t["layer.weight"] = t["layer.weight"].reshape(7, 12).copy()
        write_delta(hub, "bad-shape", 0, 1, t); cases[("bad-shape", 1)] = {"shape_mismatch"}
        t = good(); t["layer.bias"] = np.arange(7, dtype=np.int32)
        write_delta(hub, "bad-dtype", 0, 1, t); cases[("bad-dtype", 1)] = {"dtype_mismatch"}
        t = good(); t["emb.bf16"] = t["emb.bf16"].astype(np.float64)
        write_delta(hub, "bad-f64", 0, 1, t); cases[("bad-f64", 1)] = {"dtype_mismatch"}
        t = good(); t["head.f16"][2, 3] = np.nan
        write_delta(hub, "a", 0, 1, t); cases[("a", 1)] = {"non_finite"}           # a valid node's bad delta
        t = good(); t["layer.weight"][11, 6] = np.inf
        write_delta(hub, "bad-inf", 0, 1, t); cases[("bad-inf", 1)] = {"non_finite"}
        write_delta(hub, "bad-path", 0, 1, good(), metadata=delta_metadata("someone-else", 0, 1))
        cases[("bad-path", 1)] = {"path_mismatch"}
        write_delta(hub, "bad-lstep", 0, 1, good(), metadata=delta_metadata("bad-lstep", 0, 2))
        cases[("bad-lstep", 1)] = {"path_mismatch"}
        garbage = b"\xff" * 8 + np.random.default_rng(1).bytes(300)
        write_raw(hub, "bad-garbage", 1, garbage); cases[("bad-garbage", 1)] = CONTAINER_CODES
        js = b"{this is not json at all}"
        write_raw(hub, "bad-json", 1, struct.pack("<Q", len(js)) + js); cases[("bad-json", 1)] = CONTAINER_CODES
        longer = delta_bytes(tmp_path, "bad-long", 0, 1, good()) + b"\0" * 16
        write_raw(hub, "bad-long", 1, longer); cases[("bad-long", 1)] = CONTAINER_CODES

        for (node, ls), codes in cases.items():
            got = wait_rejected(d, node, ls)
            assert got[0] in codes, (node, got, codes)
        time.sleep(0.6)                             # a dozen poll intervals: nothing is reported twice
        for (node, ls) in cases:
            assert len(rejected_codes(d, node, ls)) == 1, (node, rejected_codes(d, node, ls))
        assert d.published_step() == 0
        assert "delta accepted" not in d.log_text()
        m = re.search(r"delta rejected path=nodes/bad-missing/delta_1\.safetensors code=key_mismatch .*tensor=(\S+)",
                      d.log_text())
        assert m and "layer.bias" in m.group(1), d.log_text()
        m = re.search(r"delta rejected path=nodes/bad-shape/delta_1\.safetensors code=shape_mismatch .*tensor=(\S+)",
                      d.log_text())
        assert m and "layer.weight" in m.group(1), d.log_text()

        # the valid deltas of the other nodes (and a's corrected one) make the round
        a, b = good(), good()
        write_delta(hub, "a", 0, 2, a)
        write_delta(hub, "b", 0, 2, b)
        want = oracle.step({"a": a, "b": b})
        d.wait_step(1)
        assert_state_close(published(tmp_path), want)
        assert "round: closed step=0 nodes=2 expected=2 reason=all_nodes" in d.log_text()
        time.sleep(0.4)                             # a new step does not resurrect the rejected files
        for (node, ls) in cases:
            assert len(rejected_codes(d, node, ls)) == 1, (node, rejected_codes(d, node, ls))
    finally:
        assert d.stop() == 0


# ---- 7. files being written, and truncated files ------------------------------------------------

def test_slowly_written_delta_accepted_truncated_rejected(tmp_path):
    model = small_model(7)
    oracle = Oracle(model)
    rng = np.random.default_rng(17)
    hub = tmp_path / "hub"
    d = start(tmp_path, model, "--expected-nodes", "2")
    try:
        full = delta_bytes(tmp_path, "x", 0, 1, random_deltas(rng, model))
        hlen = struct.unpack("<Q", full[:8])[0]
        assert len(full) > 8 + hlen + 100
        truncated = {
            ("trunc-data", 1): (full[:8 + hlen + 50], {"metadata_incomplete_buffer"}),
            ("trunc-header", 1): (full[:8 + hlen // 2], {"invalid_header_length"}),
            ("trunc-tiny", 1): (full[:5], {"header_too_small"}),
        }
        t_written = time.time()
        for (node, ls), (data, _) in truncated.items():
            write_raw(hub, node, ls, data)

        # a delta written non-atomically, in ~5 pieces with pauses
        slow = random_deltas(rng, model)
        data = delta_bytes(tmp_path, "slow", 0, 3, slow)
        target = hub / "nodes" / "slow" / "delta_3.safetensors"
        target.parent.mkdir(parents=True, exist_ok=True)
        step = -(-len(data) // 5)
        with open(target, "wb") as f:
            for i in range(0, len(data), step):
                f.write(data[i:i + step])
                f.flush()
                time.sleep(0.3)
        d.wait_log("round: delta accepted step=0 node=slow local_step=3")
        assert rejected_codes(d, "slow", 3) == []
        assert "delta incomplete, will retry path=nodes/slow/delta_3.safetensors" in d.log_text()

        for (node, ls), (_, codes) in truncated.items():
            got = wait_rejected(d, node, ls)
            assert got[0] in codes, (node, got, codes)
        # they were given time to complete (settle: 2 s without change)
        assert time.time() - t_written >= 1.9
        assert "delta incomplete, will retry path=nodes/trunc-data/delta_1.safetensors" in d.log_text()
        b = random_deltas(rng, model)
        write_delta(hub, "b", 0, 4, b)
        want = oracle.step({"slow": slow, "b": b})
        d.wait_step(1)
        assert_state_close(published(tmp_path), want)
        time.sleep(1.0)
        for (node, ls) in truncated:
            assert len(rejected_codes(d, node, ls)) == 1, (node, rejected_codes(d, node, ls))
        assert "delta accepted step=0 node=trunc" not in d.log_text()
    finally:
        assert d.stop() == 0


# ---- 8. restarts --------------------------------------------------------------------------------

def test_restart_between_and_during_rounds(tmp_path):
    model = small_model(8)
    oracle = Oracle(model)
    rng = np.random.default_rng(18)
    hub = tmp_path / "hub"
    nodes = ["n0", "n1", "n2", "n3"]
    d = start(tmp_path, model, "--expected-nodes", "4")
    try:
        for r in range(2):
            run_round(tmp_path, d, oracle, model, rng, r, nodes, 10 * (r + 1))
        d.wait_log("hub: published step=2 ")
        assert d.stop() == 0
        assert "main: stopped step=2 exit_code=0" in d.log_text()

        # restart between rounds: resumes at step 2, nothing to republish, momentum carried on
        d.start()
        d.wait_log("store: resuming step=2 ")
        d.wait_log("round: opened step=2 ")
        for r in range(2, 4):
            run_round(tmp_path, d, oracle, model, rng, r, nodes, 10 * (r + 1))
        second = d.logs[-1].read_text()
        assert "hub: published step=2 " not in second, second
        assert "bootstrapped" not in second and "adopted" not in second, second
        assert d.committed_step() == 4

        # restart during a round: 2 of 4 deltas in, stop, restart, the other 2
        deltas = {n: random_deltas(rng, model) for n in nodes}
        for n in ("n2", "n0"):
            write_delta(hub, n, 4, 50, deltas[n])
        d.wait_log("round: delta accepted step=4 node=n2")
        d.wait_log("round: delta accepted step=4 node=n0")
        assert d.stop() == 0
        assert d.published_step() == 4 and d.committed_step() == 4
        d.start()
        d.wait_log("store: resuming step=4 ")
        third_log = d.logs[-1]
        deadline = time.time() + 30
        while time.time() < deadline and third_log.read_text().count("round: delta accepted step=4") < 2:
            time.sleep(0.02)
        assert third_log.read_text().count("round: delta accepted step=4") == 2, third_log.read_text()
        assert d.published_step() == 4
        for n in ("n3", "n1"):
            write_delta(hub, n, 4, 50, deltas[n])
        want = oracle.step(deltas)
        d.wait_step(5)
        assert_state_close(published(tmp_path), want)
        text = third_log.read_text()
        assert "round: closed step=4 nodes=4 expected=4 reason=all_nodes" in text, text
        assert text.count("round: delta accepted step=4") == 4, text

        # and one more round after that
        run_round(tmp_path, d, oracle, model, rng, 5, nodes, 60)
        assert d.committed_step() == 6
    finally:
        assert d.stop() == 0


# ---- 9. configuration ---------------------------------------------------------------------------

_BUSY = []


def _busy_port():
    """A port held by a listening socket for the whole module: a start on it fails (exit 1)."""
    if not _BUSY:
        import socket
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        _BUSY.append(s)
    return _BUSY[0].getsockname()[1]


def _base(tmp_path):
    # a complete, valid configuration (--check-config passes it): should a bad value be accepted,
    # dilocod would start and exit 1 (its port is taken, which only the start can find), never 2
    model = tmp_path / "init.safetensors"
    if not model.exists():
        from safetensors.numpy import save_file
        save_file({"w": np.zeros(4, dtype=np.float32)}, str(model))
    return ["--state-root", tmp_path / "state", "--hub", f"file://{tmp_path}/hub", "--expected-nodes", "2",
            "--init-model", model, "--listen", f"127.0.0.1:{_busy_port()}"]


def test_valid_base_configuration_is_not_a_usage_error(tmp_path):
    p = run_dilocod(_base(tmp_path))
    assert p.returncode == 1, (p.returncode, p.stderr)


@pytest.mark.parametrize("args, names", [
    (["--lr", "abc"], ["lr"]),
    (["--lr", "-0.5"], ["lr"]),
    (["--lr=nan"], ["lr"]),
    (["--momentum", "1.5"], ["momentum"]),
    (["--momentum", "1"], ["momentum"]),
    (["--threads", "0"], ["threads"]),
    (["--threads", "2x"], ["threads"]),
    (["--optimizer", "adam"], ["optimizer", "adam"]),
    (["--nodes", "a,a"], ["nodes"]),
    (["--nodes", "a,../b"], ["nodes"]),
    (["--hub", "ftp://x"], ["hub"]),
    (["--min-nodes", "5", "--expected-nodes", "2"], ["min[-_]nodes"]),
    (["--expected-nodes", "3", "--nodes", "a,b"], ["expected[-_]nodes|nodes"]),
    (["--round-timeout", "-1"], ["round[-_]timeout"]),
    (["--poll-interval", "0"], ["poll[-_]interval"]),
    (["--log-level", "chatty"], ["log[-_]level"]),
    (["--frobnicate", "1"], ["frobnicate"]),
    (["stray"], ["stray"]),
    (["--lr"], ["lr"]),
])
def test_bad_option_values_exit_2(tmp_path, args, names):
    p = run_dilocod(_base(tmp_path) + args)
    assert p.returncode == 2, (args, p.returncode, p.stderr)
    for name in names:
        assert re.search(name, p.stderr), (args, p.stderr)
    assert p.stderr.strip(), args


def test_no_closing_rule_exits_2(tmp_path):
    p = run_dilocod(["--state-root", tmp_path / "state", "--hub", f"file://{tmp_path}/hub"])
    assert p.returncode == 2, (p.returncode, p.stderr)
    assert "expected-nodes" in p.stderr or "round-timeout" in p.stderr, p.stderr


def test_config_file_errors_exit_2(tmp_path):
    missing = tmp_path / "nope.conf"
    p = run_dilocod(_base(tmp_path) + ["--config", missing])
    assert p.returncode == 2 and "config" in p.stderr and str(missing) in p.stderr, p.stderr

    unknown = tmp_path / "unknown.conf"
    unknown.write_text("# comment\nlr = 0.5\nlearning_rate = 0.1\n")
    p = run_dilocod(_base(tmp_path) + ["--config", unknown])
    assert p.returncode == 2 and "learning_rate" in p.stderr and f"{unknown}:3" in p.stderr, p.stderr

    badline = tmp_path / "badline.conf"
    badline.write_text("lr = 0.5\n\nthis line has no equals sign\n")
    p = run_dilocod(_base(tmp_path) + ["--config", badline])
    assert p.returncode == 2 and f"{badline}:3" in p.stderr, p.stderr

    badvalue = tmp_path / "badvalue.conf"
    badvalue.write_text("momentum = 2\n")
    p = run_dilocod(_base(tmp_path) + [f"--config={badvalue}"])
    assert p.returncode == 2 and "momentum" in p.stderr and f"{badvalue}:1" in p.stderr, p.stderr


def test_help_and_version_exit_0(tmp_path):
    p = run_dilocod(["--help"])
    assert p.returncode == 0, p.stderr
    for flag in ("--expected-nodes", "--min-nodes", "--round-timeout", "--optimizer", "--lr", "--momentum",
                 "--config", "--check-config"):
        assert flag in p.stdout, flag
    p = run_dilocod(["--version"])
    assert p.returncode == 0 and re.match(r"dilocod \d+\.\d+", p.stdout), (p.stdout, p.stderr)


def test_check_config_prints_effective_configuration(tmp_path):
    conf = tmp_path / "d.conf"
    conf.write_text("# test\nlr = 0.5\nmomentum = 0.8\nexpected_nodes = 3\nround_timeout = 7\n"
                    "min_nodes = 2\noptimizer = nesterov_sgd\n")
    # a flag overrides the file wherever it stands, even before --config
    p = run_dilocod(["--lr", "0.25", "--config", conf, "--state-root", tmp_path / "s", "--min-nodes", "3",
                     "--check-config"])
    assert p.returncode == 0, p.stderr
    out = p.stdout
    assert re.search(r"^lr = 0\.25$", out, re.M), out
    assert re.search(r"^momentum = 0\.8$", out, re.M), out
    assert re.search(r"^expected_nodes = 3$", out, re.M), out
    assert re.search(r"^min_nodes = 3$", out, re.M), out
    assert re.search(r"^round_timeout = 7$", out, re.M), out
    assert re.search(r"^optimizer = nesterov_sgd$", out, re.M), out
    assert re.search(r"^state_root = " + re.escape(str(tmp_path / "s")) + "$", out, re.M), out
    assert not (tmp_path / "s").exists(), "--check-config must not create the state"

    # defaults: sgd has momentum 0, nesterov_sgd 0.9 and lr 0.7
    p = run_dilocod(["--expected-nodes", "2", "--optimizer", "sgd", "--check-config"])
    assert p.returncode == 0, p.stderr
    assert re.search(r"^momentum = 0$", p.stdout, re.M) and re.search(r"^lr = 0\.7$", p.stdout, re.M), p.stdout
    p = run_dilocod(["--expected-nodes", "2", "--check-config"])
    assert p.returncode == 0, p.stderr
    assert re.search(r"^momentum = 0\.9$", p.stdout, re.M) and re.search(r"^optimizer = nesterov_sgd$", p.stdout,
                                                                            re.M), p.stdout
    # a bad value still fails under --check-config
    p = run_dilocod(["--expected-nodes", "2", "--lr", "x", "--check-config"])
    assert p.returncode == 2 and "lr" in p.stderr, p.stderr


# ---- rounds.jsonl that cannot be appended to for a while -------------------------------------------

def test_history_records_kept_through_failed_appends(tmp_path):
    """rounds.jsonl replaced by a directory (every append fails): the records of the rounds committed
    meanwhile are kept in memory and appended, one per line, with the first append that works again; a
    restart then reads every step once, in order."""
    model = small_model(9)
    rng = np.random.default_rng(19)
    d = start(tmp_path, model, "--expected-nodes", "1")
    jsonl = d.state_dir / "rounds.jsonl"
    try:
        write_delta(tmp_path / "hub", "n0", 0, 10, random_deltas(rng, model, scale=0.05))
        d.wait_step(1)
        d.wait_log("store: durable step=1", timeout=30)
        kept = jsonl.read_bytes()
        jsonl.unlink()
        jsonl.mkdir()
        for r in (1, 2):
            write_delta(tmp_path / "hub", "n0", r, 10 * (r + 1), random_deltas(rng, model, scale=0.05))
            d.wait_step(r + 1)
            d.wait_log(f"store: durable step={r + 1}", timeout=30)
        assert d.log_text().count("rounds.jsonl") >= 2, d.log_text()[-3000:]
        jsonl.rmdir()
        jsonl.write_bytes(kept)
        write_delta(tmp_path / "hub", "n0", 3, 40, random_deltas(rng, model, scale=0.05))
        d.wait_step(4)
        d.wait_log("store: durable step=4", timeout=30)
    finally:
        assert d.stop() == 0
    lines = jsonl.read_text().splitlines()
    assert [json.loads(l)["step"] for l in lines] == [0, 1, 2, 3], lines
    d.start()
    try:
        assert [r["step"] for r in d.rounds()] == [0, 1, 2, 3]
    finally:
        assert d.stop() == 0
