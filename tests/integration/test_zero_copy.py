"""Zero-copy intake on file:// (issue 12), against the real binary and torch.

- A delta of the shared tree is validated by reading it and hard-linked into the state's cache: the
  cache entry is the worker's own inode, and the round equals the torch oracle bit for bit.
- A delta rewritten in place after it was taken in (a worker saving the same file again) is dropped
  from its round and taken in again as it is now: the step is made from the new bytes, never from a
  mix (dilocod_deltas_rewritten_total counts it).
- With the state root on another filesystem (a tmpfs), intake copies as before and says once why.
- A linked cache entry met at a restart is read in full again: a worker that rewrote it with a NaN
  while dilocod was down gets it refused, not aggregated.
- The bootstrap links --init-model into the state (and the publish of step 0 links that into the tree):
  the operator's inode, unchanged, until step 1 is durable.  A model rewritten in place meanwhile stops
  the daemon with a clear error instead of a step made from other bytes; on another filesystem the
  bootstrap copies and says why.
"""
import json
import os
import re
import shutil
import signal
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from safetensors.numpy import save_file

from dilocod_proc import (Dilocod, Oracle, assert_state_equal, delta_metadata, load_torch, random_deltas,
                          write_delta, write_model)


def small_model():
    g = torch.Generator().manual_seed(12)
    return {"w": torch.randn(256, 64, generator=g), "b": torch.randn(64, generator=g),
            "e": torch.randn(32, 16, generator=g).to(torch.bfloat16)}


def start(tmp_path, model, *args, state_root=None):
    write_model(tmp_path / "init.safetensors", model)
    d = Dilocod(tmp_path, tmp_path / "hub", "--init-model", str(tmp_path / "init.safetensors"), *args,
                state_root=state_root).start()
    d.wait_step(0)
    return d


def cached(d, node, local, step=0):
    return d.state_dir / "cache" / "deltas" / f"s{step}" / node / f"delta_{local}.safetensors"


def take_in(d, tensors):
    """Node a's delta of round 0 written into the tree, once dilocod has taken it in: its path."""
    src = write_delta(d.hub, "a", 0, 10, tensors)
    d.wait_log("delta accepted")
    return src


def close_round(d, oracle, deltas):
    """Node b's delta closes round 0 (a's is in): step 1 is published and equals the oracle's step."""
    write_delta(d.hub, "b", 0, 10, deltas["b"])
    want = oracle.step(deltas)
    d.wait_step(1)
    assert_state_equal(load_torch(d.hub / "global/latest.safetensors"), want)


def rewrite_in_place(path: Path, tensors: dict, meta: dict):
    """What a worker that saves the same file name again does: truncate and write the same inode."""
    tmp = path.with_name(".scratch")
    save_file(tensors, str(tmp), metadata=meta)
    data = tmp.read_bytes()
    tmp.unlink()
    ino = path.stat().st_ino
    with open(path, "r+b") as f:
        f.truncate(0)
        f.write(data)
    assert path.stat().st_ino == ino


def metric(d, name):
    import urllib.request
    text = urllib.request.urlopen(d.url + "/metrics", timeout=10).read().decode()
    m = re.search(rf"^{name} (\d+)$", text, re.M)
    return int(m.group(1))


def test_a_tree_delta_is_linked_not_copied(tmp_path):
    model = small_model()
    oracle, rng = Oracle(model), np.random.default_rng(1)
    d = start(tmp_path, model, "--expected-nodes", "2")
    try:
        deltas = {n: random_deltas(rng, model) for n in ("a", "b")}
        src = take_in(d, deltas["a"])
        # the cache entry is the worker's inode: nothing was copied
        assert cached(d, "a", 10).stat().st_ino == src.stat().st_ino
        assert src.stat().st_nlink == 2
        close_round(d, oracle, deltas)
        assert "not linked" not in d.log_text()
    finally:
        assert d.stop() == 0


def test_a_delta_rewritten_in_place_is_taken_in_again_never_mixed(tmp_path):
    model = small_model()
    oracle, rng = Oracle(model), np.random.default_rng(2)
    d = start(tmp_path, model, "--expected-nodes", "2")
    try:
        src = take_in(d, random_deltas(rng, model))
        assert cached(d, "a", 10).stat().st_ino == src.stat().st_ino
        # the worker saves the same file again, in place, with other values
        second = random_deltas(rng, model)
        rewrite_in_place(src, second, delta_metadata("a", 0, 10))
        d.wait_log("rewritten in place after it was taken in")
        d.wait_log("delta accepted", count=2)
        close_round(d, oracle, {"a": second, "b": random_deltas(rng, model)})
        assert metric(d, "dilocod_deltas_rewritten_total") == 1
    finally:
        assert d.stop() == 0


def test_a_rewrite_racing_the_round_close_still_gives_one_version(tmp_path):
    """The rewrite and the last delta land together: whichever way the race goes (found at intake,
    before the pass, or before the commit), the step is made from one whole version of the file."""
    model = small_model()
    rng = np.random.default_rng(3)
    hub = tmp_path / "hub"
    d = start(tmp_path, model, "--expected-nodes", "2")
    try:
        first = random_deltas(rng, model)
        src = take_in(d, first)
        second, other = random_deltas(rng, model), random_deltas(rng, model)
        write_delta(hub, "b", 0, 10, other)
        rewrite_in_place(src, second, delta_metadata("a", 0, 10))
        d.wait_step(1)
        got = load_torch(hub / "global/latest.safetensors")
        # each from a fresh model: Oracle steps the F32 tensors it was given in place
        candidates = [Oracle(small_model()).step({"a": v, "b": other}) for v in (second, first)]
        matches = []
        for want in candidates:
            try:
                assert_state_equal(got, want)
                matches.append(True)
            except AssertionError:
                matches.append(False)
        assert any(matches), "the step matches neither version of a's delta: a torn read"
        if matches[1] and not matches[0]:
            # the first version went into step 1 whole; the rewrite came after its commit
            assert "rewritten in place" not in d.log_text() or d.alive()
    finally:
        assert d.stop() == 0


def test_state_on_another_filesystem_copies(tmp_path):
    model = small_model()
    oracle, rng = Oracle(model), np.random.default_rng(4)
    shm = Path(tempfile.mkdtemp(prefix="dilocod-state-", dir="/dev/shm"))
    try:
        assert os.stat(shm).st_dev != os.stat(tmp_path).st_dev
        d = start(tmp_path, model, "--expected-nodes", "2", state_root=shm)
        try:
            deltas = {n: random_deltas(rng, model) for n in ("a", "b")}
            src = take_in(d, deltas["a"])
            assert cached(d, "a", 10).stat().st_nlink == 1 and src.stat().st_nlink == 1
            close_round(d, oracle, deltas)
            log = d.log_text()
            assert log.count("deltas are copied into the state, not linked") == 1, log[-3000:]
            assert "--state-root on the shared tree" in log
        finally:
            assert d.stop() == 0
    finally:
        shutil.rmtree(shm, ignore_errors=True)


def test_a_linked_cache_entry_is_read_again_at_restart(tmp_path):
    model = small_model()
    rng = np.random.default_rng(5)
    d = start(tmp_path, model, "--expected-nodes", "2")
    src = take_in(d, random_deltas(rng, model))
    assert d.stop() == 0
    # while dilocod is down, the worker rewrites its delta in place with a NaN
    bad = random_deltas(rng, model)
    bad["w"][3, 5] = np.nan
    rewrite_in_place(src, bad, delta_metadata("a", 0, 10))
    d.start()
    try:
        d.wait_log("non_finite")
        d.wait_until(lambda: not cached(d, "a", 10).exists(), "the refused cache entry removed")
        import json
        import urllib.request
        st = json.loads(urllib.request.urlopen(d.url + "/status", timeout=10).read())
        assert st["round"]["received"] == [], st["round"]
    finally:
        assert d.stop() == 0


def stop_at_pass_start(d, step, timeout=60):
    """SIGSTOPs dilocod as soon as it logs that step's pass has opened its files and starts computing (a
    tight poll of its log): True if it stopped it with the pass still computing (not yet "computed")."""
    needle, done = f"aggregate: prepared step={step}", f"aggregate: computed step={step}"
    deadline = time.time() + timeout
    while time.time() < deadline:
        text = d.logs[-1].read_text(errors="replace")
        if needle in text:
            os.kill(d.proc.pid, signal.SIGSTOP)
            return done not in d.logs[-1].read_text(errors="replace")
        time.sleep(0.0005)
    raise AssertionError(f"{needle!r} not logged within {timeout}s:\n{d.log_text()[-4000:]}")


def big_model():
    g = torch.Generator().manual_seed(14)
    return {"w": torch.randn(4096, 4096, generator=g)}      # 64 MiB: a pass of tens of ms on one thread


def truncate_under_the_pass(tmp: Path, rng):
    """One round whose first delta is truncated right after the pass starts, then saved again whole.
    Returns whether the truncation landed while the pass computed (then the step must come from the
    second version); either way the daemon must live and the step be one whole version."""
    tmp.mkdir()
    hub = tmp / "hub"
    d = start(tmp, big_model(), "--expected-nodes", "2", "--threads", "1", "--retry-interval", "0.2")
    try:
        a_first, b = random_deltas(rng, big_model()), random_deltas(rng, big_model())
        src = write_delta(hub, "a", 0, 10, a_first)
        d.wait_log("delta accepted")
        write_delta(hub, "b", 0, 10, b)
        mid_pass = stop_at_pass_start(d, 1)
        with open(src, "r+b") as f:
            f.truncate(64)
        os.kill(d.proc.pid, signal.SIGCONT)
        if mid_pass:
            d.wait_log("SIGBUS")
            assert "outer step failed" in d.log_text()
        # the worker saves its delta again, whole, in place
        a_second = random_deltas(rng, big_model())
        rewrite_in_place(src, a_second, delta_metadata("a", 0, 10))
        d.wait_step(1, timeout=120)
        got = load_torch(hub / "global/latest.safetensors")
        versions = (a_second,) if mid_pass else (a_second, a_first)
        wants = [Oracle(big_model()).step({"a": v, "b": b}) for v in versions]
        assert any(same_state(got, w) for w in wants), "the step is not made from one whole version of a's delta"
        assert d.alive()
        return mid_pass
    finally:
        assert d.stop() == 0


def same_state(got, want):
    try:
        assert_state_equal(got, want)
        return True
    except AssertionError:
        return False


def test_a_delta_truncated_while_the_pass_reads_it_in_place(tmp_path):
    """The pass reads linked deltas through mappings of the worker's own file.  A worker truncating its
    file under the pass raises SIGBUS in a pass thread: the step fails like a short read, dilocod keeps
    running, and once the worker has saved the file again the round takes that version in and the step
    is made from it, whole.  dilocod is stopped (SIGSTOP) right after its pass starts, so that the
    truncation lands while the pass computes; if the stop came too late (the pass had finished), the
    round is tried again with a new daemon, up to 3 times."""
    rng = np.random.default_rng(4)
    hits = [truncate_under_the_pass(tmp_path / "try0", rng)]
    while not hits[-1] and len(hits) < 3:
        hits.append(truncate_under_the_pass(tmp_path / f"try{len(hits)}", rng))
    assert hits[-1], "the stop never landed while the pass computed"


def kill_between_publish_and_durable(tmp: Path, rng):
    """One round of the 64 MiB model; dilocod is killed (-9) as soon as it logs that step 1 is published
    (a tight poll of its log), before its files are durable.  Returns (daemon, deltas, whether the kill
    landed before step 1 was durable)."""
    tmp.mkdir()
    d = start(tmp, big_model(), "--expected-nodes", "2", "--threads", "2")
    deltas = {n: random_deltas(rng, big_model()) for n in ("a", "b")}
    write_delta(d.hub, "a", 0, 10, deltas["a"])
    d.wait_log("delta accepted")
    write_delta(d.hub, "b", 0, 10, deltas["b"])
    needle, deadline = "hub: published step=1 ", time.time() + 60
    while needle not in d.logs[-1].read_text(errors="replace"):
        assert time.time() < deadline and d.alive(), d.log_text()[-4000:]
        time.sleep(0.0005)
    d.kill9()
    # in the window: step 1 committed by its redo record only (its files not durable)
    return d, deltas, (d.state_dir / "redo.json").exists() and d.durable_step() == 0


def test_a_step_published_before_it_was_durable_is_published_again_after_recovery(tmp_path):
    """A file:// publish links the step's global into the tree without waiting for its data to reach the
    disk: the step is committed by its redo record, and its files become durable in the background.  A
    machine crash in between can leave the tree naming the step with its data lost.  dilocod is killed
    right after publishing step 1 and the published file is cut to nothing (what such a crash leaves on
    ext4: the size is written with the data); the restart recomputes step 1 from its redo record and
    publishes it again, so the tree ends with torch's step 1, whole.  If the kill came after step 1 was
    durable, the round is tried again, up to 5 times."""
    rng = np.random.default_rng(5)
    for attempt in range(5):
        d, deltas, in_window = kill_between_publish_and_durable(tmp_path / f"try{attempt}", rng)
        if in_window:
            break
    assert in_window, "the kill never landed between the publish and durable"
    assert d.published_step() == 1
    published = d.hub / "global/latest.safetensors"
    assert os.stat(published).st_ino == os.stat(d.state_dir / "global/latest-1.safetensors").st_ino
    os.truncate(published, 0)
    d.start()
    try:
        d.wait_log("store: recovered step=1")
        d.wait_log("hub: publishing the recovered step again step=1")
        d.wait_until(lambda: published.stat().st_size > 0, "the recovered step published again")
        assert d.published_step() == 1
        assert_state_equal(load_torch(published), Oracle(big_model()).step(deltas))
        d.wait_durable(1)
    finally:
        assert d.stop() == 0


def catch_up_round(tmp: Path, model, rng, init_dir=None):
    """A new dilocod on a tree that holds two deltas and no global (catch-up), from an --init-model in
    init_dir (default: tmp): the daemon's log, once step 1 is published and equals torch's step."""
    tmp.mkdir()
    hub = tmp / "hub"
    deltas = {n: random_deltas(rng, model) for n in ("a", "b")}
    for n in deltas:
        write_delta(hub, n, 0, 10, deltas[n])
    init = (init_dir or tmp) / "init.safetensors"
    write_model(init, model)
    d = Dilocod(tmp, hub, "--init-model", str(init), "--expected-nodes", "2").start()
    try:
        d.wait_step(1, timeout=120)
        assert_state_equal(load_torch(hub / "global/latest.safetensors"), Oracle(model).step(deltas))
        return d.log_text()
    finally:
        assert d.stop() == 0


def test_catch_up_takes_deltas_in_while_the_init_model_is_copied(tmp_path):
    """Bootstrapping from an --init-model on another filesystem (/dev/shm) copies it into the state and
    makes it durable (128 MiB here).  The round opens on the model's header first, so the deltas already
    in the tree are validated and taken in during the copy; the round closes only once step 0 is
    committed, and step 1 is torch's.  The overlap depends on timing (a delta's intake against the copy's
    fsync): tried up to 3 times."""
    model = {"w": torch.randn(4096, 8192, generator=torch.Generator().manual_seed(15))}
    rng = np.random.default_rng(6)
    for attempt in range(3):
        shm = Path(tempfile.mkdtemp(prefix="dilocod-init-", dir="/dev/shm"))
        try:
            log = catch_up_round(tmp_path / f"try{attempt}", model, rng, init_dir=shm)
        finally:
            shutil.rmtree(shm, ignore_errors=True)
        assert re.search(r"store: bootstrapped step=0 .* taken=copied why_not_linked=", log), log[-4000:]
        boot = log.index("store: bootstrapped step=0")
        assert log.index("round: closed step=0") > boot, log[-4000:]
        assert log.index("round: opened step=0") < boot, log[-4000:]
        if log.index("round: delta accepted step=0") < boot:
            break
    else:
        raise AssertionError(f"no delta was taken in while the init model was copied:\n{log[-4000:]}")


# ---- the bootstrap links --init-model ----------------------------------------------------------------

def test_the_init_model_is_linked_into_the_state_and_left_as_it_was(tmp_path):
    """The bootstrap hard-links --init-model into the state (no copy: the operator's inode), records the
    version it linked in outer_metadata.json, and the publish of step 0 links it into the tree.  Step 1
    is torch's; once it is durable the state's link is gone and the operator's file is as it was."""
    model = small_model()
    oracle, rng = Oracle(model), np.random.default_rng(7)
    d = start(tmp_path, model, "--expected-nodes", "2")
    init = tmp_path / "init.safetensors"
    before = init.read_bytes()
    try:
        ino = init.stat().st_ino
        assert (d.state_dir / "global/latest-0.safetensors").stat().st_ino == ino
        assert (d.hub / "global/latest.safetensors").stat().st_ino == ino
        assert re.search(r"store: bootstrapped step=0 .* taken=linked", d.log_text()), d.log_text()[-3000:]
        version = json.loads((d.state_dir / "outer_metadata.json").read_text())["global_version"]
        st = init.stat()
        # dev:ino:size:mtime_ns:ctime_ns:checksum (none: the bootstrap reads no data)
        fields = version.split(":")
        assert fields[:4] == [str(st.st_dev), str(st.st_ino), str(st.st_size), str(st.st_mtime_ns)], version
        assert len(fields) == 6 and int(fields[4]) > 0 and fields[5] == "-", version
        deltas = {n: random_deltas(rng, model) for n in ("a", "b")}
        take_in(d, deltas["a"])
        close_round(d, oracle, deltas)
        d.wait_durable(1)
        # the settle removes the previous step's files after it names step 1
        d.wait_until(lambda: not (d.state_dir / "global/latest-0.safetensors").exists(), "step 0's global removed")
        assert "global_version" not in json.loads((d.state_dir / "outer_metadata.json").read_text())
        assert init.stat().st_nlink == 1 and init.read_bytes() == before
    finally:
        assert d.stop() == 0


def test_an_init_model_rewritten_in_place_after_the_bootstrap_stops_the_daemon(tmp_path):
    """The operator saves another model over --init-model (the same inode) while step 0, linked from it,
    is the committed global: step 1 cannot be made from the version workers trained on.  The round's
    pass is refused and dilocod stops with exit code 1 and an error that says what happened and what to
    do; nothing is committed or published for step 1, and a restart refuses the same way."""
    model = small_model()
    rng = np.random.default_rng(8)
    d = start(tmp_path, model, "--expected-nodes", "2")
    init = tmp_path / "init.safetensors"
    deltas = {n: random_deltas(rng, model) for n in ("a", "b")}
    take_in(d, deltas["a"])
    # the same names, dtypes and shapes, other values: only the version guard can tell
    write_model(tmp_path / "other.safetensors", {k: v + 1 for k, v in model.items()})
    data = (tmp_path / "other.safetensors").read_bytes()
    assert len(data) == init.stat().st_size
    with open(init, "r+b") as f:
        f.write(data)
    write_delta(d.hub, "b", 0, 10, deltas["b"])
    assert d.proc.wait(timeout=60) == 1, d.log_text()[-3000:]
    d.proc = None
    log = d.log_text()
    assert "is a link to --init-model that is no longer the version linked at the bootstrap" in log, log[-3000:]
    assert "put that file back as it was (its bytes and its modification time), or start again" in log
    assert "main: shutting down reason=fatal_error" in log, log[-3000:]        # daemon__fatal, as SIGTERM would
    assert d.published_step() == 0 and d.committed_step() == 0
    assert not (d.state_dir / "redo.json").exists()
    d.start()
    assert d.proc.wait(timeout=60) == 1, d.log_text()[-3000:]
    d.proc = None
    assert d.log_text().count("is a link to --init-model that is no longer the version linked") == 2
    assert d.published_step() == 0


def test_an_init_model_rewritten_before_step_1_was_durable_is_not_recomputed_from(tmp_path):
    """dilocod is killed right after publishing step 1, whose base (step 0) is linked from --init-model,
    before step 1's files are durable; the operator then saves other values over --init-model.  The
    restart must recompute step 1 from its redo record, whose base is no longer the version workers
    trained on: it refuses to start, with the error and the way out, rather than publish other bytes."""
    rng = np.random.default_rng(9)
    for attempt in range(5):
        tmp = tmp_path / f"try{attempt}"
        d, deltas, in_window = kill_between_publish_and_durable(tmp, rng)
        if in_window:
            break
    assert in_window, "the kill never landed between the publish and durable"
    init = tmp / "init.safetensors"
    assert (d.state_dir / "global/latest-0.safetensors").stat().st_ino == init.stat().st_ino
    original, st = init.read_bytes(), init.stat()
    write_model(tmp / "other.safetensors", {k: v + 1 for k, v in big_model().items()})
    data = (tmp / "other.safetensors").read_bytes()
    assert len(data) == init.stat().st_size
    with open(init, "r+b") as f:
        f.write(data)
    d.start()
    assert d.proc.wait(timeout=60) == 1, d.log_text()[-3000:]
    d.proc = None
    log = d.logs[-1].read_text(errors="replace")
    assert re.search(r"cannot recompute step 1: its base, the global of step 0 \(\S+\), is a link to --init-model "
                     r"that is no longer the version linked at the bootstrap", log), log[-3000:]
    assert "recovered step=1" not in log
    assert (d.state_dir / "redo.json").exists()
    # put back as it was, bytes and modification time: the restart recovers step 1, torch's
    with open(init, "r+b") as f:
        f.write(original)
    os.utime(init, ns=(st.st_atime_ns, st.st_mtime_ns))
    d.start()
    try:
        d.wait_log("store: recovered step=1")
        d.wait_durable(1)
        assert_state_equal(load_torch(d.hub / "global/latest.safetensors"), Oracle(big_model()).step(deltas))
    finally:
        assert d.stop() == 0


# ---- integrity: identity is not integrity (issue 21, item 2) ---------------------------------------

def rewrite_keep_identity(path: Path, tensors: dict, meta: dict):
    """What a worker that owns the file can do: write other bytes into the same inode, the same size,
    and put its mtime back (os.utime with nanoseconds).  Only ctime and the content tell."""
    st = path.stat()
    tmp = path.with_name(".scratch")
    save_file(tensors, str(tmp), metadata=meta)
    data = tmp.read_bytes()
    tmp.unlink()
    assert len(data) == st.st_size
    with open(path, "r+b") as f:
        f.write(data)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    after = path.stat()
    assert (after.st_ino, after.st_size, after.st_mtime_ns) == (st.st_ino, st.st_size, st.st_mtime_ns)


def test_a_delta_rewritten_with_nan_and_its_mtime_put_back_never_reaches_the_global(tmp_path):
    """The attack of issue 21: validated and linked, then rewritten in place with NaN, size and mtime
    put back, and the round's last delta sent.  The rewrite is found by its ctime (when the tree's scan
    met it: taken in again and refused as non-finite; else before the pass: dropped), the round waits,
    the worker's next delta is taken in and the step equals the oracle, finite."""
    model = small_model()
    oracle, rng = Oracle(model), np.random.default_rng(21)
    d = start(tmp_path, model, "--expected-nodes", "2")
    try:
        src = take_in(d, random_deltas(rng, model))
        poisoned = {k: np.full_like(v, np.nan) for k, v in random_deltas(rng, model).items()}
        rewrite_keep_identity(src, poisoned, delta_metadata("a", 0, 10))
        other = random_deltas(rng, model)
        write_delta(d.hub, "b", 0, 10, other)
        d.wait_log("rewritten in place after it was taken in")
        d.wait_until(lambda: metric(d, "dilocod_deltas_rewritten_total") >= 1, "the rewrite counted")
        d.wait_log("round: delta accepted step=0 node=b")
        time.sleep(0.5)
        assert d.published_step() == 0          # a's delta is out of the round: it waits
        honest = random_deltas(rng, model)
        write_delta(d.hub, "a", 0, 11, honest)
        want = oracle.step({"a": honest, "b": other})
        d.wait_step(1)
        assert_state_equal(load_torch(d.hub / "global/latest.safetensors"), want)
        got = load_torch(d.hub / "global/latest.safetensors")
        assert all(torch.isfinite(t.float()).all() for t in got.values())
        assert not [p for p in (d.state_dir).rglob("outer_state-*") if p.stat().st_size == 0]
    finally:
        assert d.stop() == 0


def test_the_published_global_written_into_by_a_tree_writer_is_never_aggregated_from(tmp_path):
    """file:// publishes the state's own global by a link: a writer of the tree with dilocod's uid that
    writes into global/latest.safetensors in place (size and mtime put back) writes into the state.  The
    next pass finds the committed global's checksum changed and the daemon stops with a clear error
    (exit 1) instead of publishing a step made from those bytes."""
    model = small_model()
    oracle, rng = Oracle(model), np.random.default_rng(22)
    d = start(tmp_path, model, "--expected-nodes", "2")
    try:
        take_in(d, first := random_deltas(rng, model))
        close_round(d, oracle, {"a": first, "b": random_deltas(rng, model)})
        d.wait_settled(1)
        latest = d.hub / "global/latest.safetensors"
        state_global = d.state_dir / "global/latest-1.safetensors"
        assert latest.stat().st_ino == state_global.stat().st_ino       # one inode: the state's
        # other finite values in the data section (the header as it was: the same size)
        st = latest.stat()
        n = int.from_bytes(latest.read_bytes()[:8], "little")
        with open(latest, "r+b") as f:
            f.seek(8 + n)
            f.write(b"\x11" * (st.st_size - 8 - n))
        os.utime(latest, ns=(st.st_atime_ns, st.st_mtime_ns))
        for n in ("a", "b"):
            write_delta(d.hub, n, 1, 20, random_deltas(rng, model))
        d.wait_until(lambda: not d.alive(), "the daemon stopped", timeout=60)
        assert d.proc.wait() == 1
        assert "written in place since it was committed" in d.log_text()
        assert d.published_step() == 1
        assert not (d.state_dir / "global/latest-2.safetensors").exists()
    finally:
        if d.alive():
            d.stop()
