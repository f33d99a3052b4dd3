"""A hostile (or clumsy) writer of the shared directory against the real dilocod with a file:// hub:
one test per attack from the hardening issue.  Whatever is planted (a FIFO where a file belongs, a
symbolic link out of the tree at any level, a delta header over the cap, a node directory with tens
of thousands of entries), the daemon must log a clear reason, never block and never read outside the
tree.  After each attack: the daemon is alive, a brand-new HTTP client gets /healthz and /status
within 2 s, a normal round still completes (deltas written the reference's way), open descriptors
and RSS stay within FD_SLACK / RSS_SLACK_KIB of their baseline, and SIGTERM stops it with status 0.

The HTTP attacks are in test_hostile_clients.py; the Hub's in test_hostile_clients_hub.py."""
import json
import os
import re
import stat
import struct
import threading
import time
from pathlib import Path

import numpy as np
import torch
from safetensors.numpy import save_file

import hostile
from hostile import SANITIZED, proc_kib, served_quickly, wait_for
from dilocod_proc import (Dilocod, Oracle, assert_state_close, delta_metadata, load_torch, random_deltas,
                          write_delta, write_model)

FD_SLACK = 8                    # a pool job (scan, intake, publish) may hold a few while we look
RSS_SLACK_KIB = (96 if SANITIZED else 32) * 1024
NODES = ("a", "b")


# ---- helpers ------------------------------------------------------------------------------------

def small_model(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"layer.weight": torch.randn(64, 32, generator=g), "layer.bias": torch.randn(32, generator=g)}


class Baseline(hostile.Baseline):
    def __init__(self, d):
        super().__init__(d, FD_SLACK, RSS_SLACK_KIB)


class Run:
    """A daemon on tmp/hub with two expected nodes, and the torch oracle of its rounds."""

    def __init__(self, tmp_path, seed=0, init=True, extra=()):
        self.tmp = tmp_path
        self.hub = tmp_path / "hub"
        self.model = small_model(seed)
        self.oracle = Oracle(self.model)
        self.rng = np.random.default_rng(seed + 100)
        self.local = 0
        args = ["--expected-nodes", "2", *extra]
        if init:
            write_model(tmp_path / "init.safetensors", self.model)
            args += ["--init-model", str(tmp_path / "init.safetensors")]
        self.d = Dilocod(tmp_path, self.hub, *args)

    def round(self, step, nodes=NODES):
        """Every node writes its delta for `step` (save_file, temp + rename, as the reference);
        the published step+1 must equal the oracle."""
        self.local += 10
        deltas = {n: random_deltas(self.rng, self.model) for n in nodes}
        for n, t in deltas.items():
            write_delta(self.hub, n, step, self.local, t)
        want = self.oracle.step(deltas)
        wait_step(self.d, self.hub, step + 1)
        assert_state_close(load_torch(self.hub / "global" / "latest.safetensors"), want)


def published_step(hub: Path):
    """The hub's published step, read the way dilocod does: a FIFO planted by a test must not block
    the test itself (None unless a regular file holds a step)."""
    try:
        fd = os.open(hub / "global" / "step_count.json", os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        return json.loads(os.read(fd, 4096))["outer_step"]
    except (OSError, ValueError, KeyError):
        return None
    finally:
        os.close(fd)


def wait_step(d, hub, step, timeout=60):
    deadline = time.time() + timeout
    while time.time() < deadline:
        s = published_step(hub)
        if s is not None and s >= step:
            return s
        assert d.alive(), d.log_text()[-4000:]
        time.sleep(0.02)
    raise AssertionError(f"step {step} not published within {timeout}s:\n{d.log_text()[-4000:]}")


def refused(d, path):
    return re.findall(r"hub: entry refused path=" + re.escape(path) + r" reason=(.*)", d.log_text())


def wait_refused(d, path, timeout=10):
    wait_for(lambda: refused(d, path), timeout, f"'entry refused path={path}' in the log")
    return refused(d, path)


def fifo_over(path: Path):
    """Replaces path (or creates it) with a FIFO, atomically as a writer would."""
    tmp = path.with_name("." + path.name + ".fifo")
    os.mkfifo(tmp)
    os.rename(tmp, path)


def symlink_over(path: Path, target):
    tmp = path.with_name("." + path.name + ".lnk")
    os.symlink(target, tmp)
    os.rename(tmp, path)


def outside_tree(tmp_path, node, base, local, rng, model):
    """A valid delta for `node`, written outside the hub (where a link will point)."""
    out = tmp_path / "outside"
    out.mkdir(exist_ok=True)
    t = random_deltas(rng, model)
    save_file(t, str(out / f"delta_{local}.safetensors"), metadata=delta_metadata(node, base, local))
    return out


def tree_listing(path: Path):
    return sorted((str(p.relative_to(path)), p.stat().st_size, p.read_bytes()) for p in path.rglob("*")
                  if p.is_file())


# ---- 1. a FIFO as global/step_count.json --------------------------------------------------------

def test_fifo_step_count_at_restart_does_not_stop_startup(tmp_path):
    """The issue's case: a restart with the step file replaced by a FIFO used to block in startup
    forever (never listening).  Now it is refused, the daemon resumes from its state, listens at
    once, and republishes over the FIFO."""
    r = Run(tmp_path)
    d = r.d.start()
    wait_step(d, r.hub, 0)
    r.round(0)
    assert d.stop() == 0
    fifo_over(r.hub / "global" / "step_count.json")
    t0 = time.monotonic()
    d.start()
    try:
        d.port                                      # waits for "http: listening"
        assert time.monotonic() - t0 < 5, "startup took too long"
        served_quickly(d)
        log = d.log_text()
        assert "hub: ignoring the published step file" in log and "a FIFO where global/step_count.json" in log, log
        wait_step(d, r.hub, 1)                      # republished: the FIFO is replaced by the real file
        assert not (r.hub / "global" / "step_count.json").is_fifo()
        base = Baseline(d)
        r.round(1)
        base.check()
    finally:
        assert d.stop() == 0


def test_fifo_or_huge_step_count_while_running(tmp_path):
    """Replacing the step file with a FIFO (it used to hang a pool thread for good: no more intake,
    SIGTERM ignored) or with a 100 MB file: refused once with its reason, deltas are still taken in,
    the round completes and the publish replaces the junk."""
    r = Run(tmp_path)
    d = r.d.start()
    try:
        wait_step(d, r.hub, 0)
        r.round(0)
        base = Baseline(d)
        step_file = r.hub / "global" / "step_count.json"
        fifo_over(step_file)
        reasons = wait_refused(d, "global")
        assert "a FIFO where global/step_count.json belongs: not read" in reasons[0], reasons
        time.sleep(0.5)                             # ten polls: reported once, not at every poll
        assert len(refused(d, "global")) == 1, refused(d, "global")
        base.check()
        r.round(1)                                  # intake still works; the publish heals the file
        assert json.loads(step_file.read_text())["outer_step"] == 2

        huge = step_file.with_name(".huge")
        with open(huge, "wb") as f:
            f.truncate(100 << 20)                   # sparse: costs the writer nothing
        os.rename(huge, step_file)
        wait_for(lambda: len(refused(d, "global")) == 2, 10, "the huge step file reported")
        assert "larger than 4095 bytes" in refused(d, "global")[1], refused(d, "global")
        base.check()
        r.round(2)
        base.check()
    finally:
        assert d.stop() == 0


# ---- 2. a FIFO as a delta file ------------------------------------------------------------------

def test_fifo_as_delta_file_is_refused_not_opened(tmp_path):
    r = Run(tmp_path)
    d = r.d.start()
    try:
        wait_step(d, r.hub, 0)
        r.round(0)
        base = Baseline(d)
        (r.hub / "nodes" / "w1").mkdir()
        fifo_over(r.hub / "nodes" / "w1" / "delta_500.safetensors")
        fifo_over(r.hub / "nodes" / "a" / "delta_501.safetensors")      # a valid node's newest name
        reasons = wait_refused(d, "nodes/w1/delta_500.safetensors")
        assert "a FIFO where a delta file belongs: not read" in reasons[0], reasons
        wait_refused(d, "nodes/a/delta_501.safetensors")
        time.sleep(0.5)
        assert len(refused(d, "nodes/w1/delta_500.safetensors")) == 1
        base.check()
        r.local = 1000                              # above the FIFO's local step
        r.round(1)
        base.check()
    finally:
        assert d.stop() == 0


# ---- 3. a FIFO as global/latest.safetensors during adoption -------------------------------------

def test_fifo_as_published_global_during_adoption(tmp_path):
    """No local state and no init model: dilocod adopts the hub's global.  A FIFO there (at startup,
    then flipping with a junk file while adoption is retried) is refused and never blocks; once a real
    global appears it is adopted and rounds continue from its step."""
    hub = tmp_path / "hub"
    (hub / "global").mkdir(parents=True)
    (hub / "global" / "step_count.json").write_text(json.dumps({"outer_step": 3}))
    fifo_over(hub / "global" / "latest.safetensors")
    r = Run(tmp_path, init=False)
    d = r.d.start()
    try:
        t0 = time.monotonic()
        d.port
        assert time.monotonic() - t0 < 5
        st = served_quickly(d)
        assert st["state"] == "waiting_for_global", st
        assert "global/latest.safetensors is a FIFO" in d.log_text(), d.log_text()
        base = Baseline(d)

        # a writer flipping the global between a FIFO and junk: whichever adoption meets is refused
        latest = hub / "global" / "latest.safetensors"
        stop = threading.Event()

        def flip():
            i = 0
            while not stop.is_set():
                if i % 2:
                    fifo_over(latest)
                else:
                    junk = latest.with_name(".junk")
                    junk.write_bytes(struct.pack("<Q", 2) + b"{}" + b"\0" * 64)
                    os.rename(junk, latest)
                i += 1
                time.sleep(0.003)
        t = threading.Thread(target=flip)
        t.start()
        try:
            time.sleep(2.0)
            served_quickly(d)
        finally:
            stop.set()
            t.join()
        log = d.log_text()
        assert "cannot adopt the published global, will retry" in log, log[-3000:]
        base.check()

        write_model(tmp_path / "real.safetensors", r.model)
        os.rename(tmp_path / "real.safetensors", latest)
        d.wait_log("store: adopted the published global step=3")
        base.check()
        r.round(3)
        base.check()
    finally:
        assert d.stop() == 0


# ---- 4. symbolic links out of the tree ----------------------------------------------------------

def test_symlinked_node_dirs_are_not_followed(tmp_path):
    """nodes/w9 -> a directory outside the hub holding a valid w9 delta (it used to be accepted),
    nodes/wp -> /proc/self, nodes/wd -> /dev: each refused with its reason, nothing accepted from
    them; with expected_nodes 2 the round closes on a and b alone, equal to the oracle of a and b."""
    r = Run(tmp_path)
    d = r.d.start()
    try:
        wait_step(d, r.hub, 0)
        r.round(0)
        base = Baseline(d)
        out = outside_tree(tmp_path, "w9", 1, 7, r.rng, r.model)
        os.symlink(out, r.hub / "nodes" / "w9")
        os.symlink("/proc/self", r.hub / "nodes" / "wp")
        os.symlink("/dev", r.hub / "nodes" / "wd")
        for node in ("w9", "wp", "wd"):
            reasons = wait_refused(d, f"nodes/{node}")
            assert "a symbolic link where a node directory belongs: links are not followed" in reasons[0], reasons
        time.sleep(0.5)
        assert len(refused(d, "nodes/w9")) == 1
        base.check()
        r.round(1)                                  # a and b only: w9's delta would change the mean
        log = d.log_text()
        assert "node=w9" not in log and "nodes/w9/" not in log, log
        assert "round: closed step=1 nodes=2 expected=2" in log
        base.check()
    finally:
        assert d.stop() == 0


def test_symlinked_nodes_dir_is_not_followed(tmp_path):
    """The whole nodes/ replaced by a link out of the tree: refused, nothing read behind it; a real
    nodes/ again and the round completes."""
    r = Run(tmp_path)
    d = r.d.start()
    try:
        wait_step(d, r.hub, 0)
        r.round(0)
        base = Baseline(d)
        outside = tmp_path / "outside-nodes"
        (outside / "w9").mkdir(parents=True)
        t = random_deltas(r.rng, r.model)
        save_file(t, str(outside / "w9" / "delta_7.safetensors"), metadata=delta_metadata("w9", 1, 7))
        os.rename(r.hub / "nodes", tmp_path / "nodes-real")
        os.symlink(outside, r.hub / "nodes")
        reasons = wait_refused(d, "nodes")
        assert "a symbolic link where the nodes directory belongs" in reasons[0], reasons
        time.sleep(0.5)
        assert "node=w9" not in d.log_text()
        base.check()
        os.unlink(r.hub / "nodes")
        os.rename(tmp_path / "nodes-real", r.hub / "nodes")
        r.round(1)
        assert "node=w9" not in d.log_text()
        base.check()
    finally:
        assert d.stop() == 0


def test_symlinked_delta_files_are_not_followed(tmp_path):
    """nodes/a/delta_N.safetensors -> a valid delta outside the tree, nodes/b/delta_M -> /dev/zero:
    refused, never opened; the real deltas make the round."""
    r = Run(tmp_path)
    d = r.d.start()
    try:
        wait_step(d, r.hub, 0)
        r.round(0)
        base = Baseline(d)
        out = outside_tree(tmp_path, "a", 1, 900, r.rng, r.model)
        symlink_over(r.hub / "nodes" / "a" / "delta_900.safetensors", out / "delta_900.safetensors")
        symlink_over(r.hub / "nodes" / "b" / "delta_900.safetensors", "/dev/zero")
        for node in NODES:
            reasons = wait_refused(d, f"nodes/{node}/delta_900.safetensors")
            assert "a symbolic link where a delta file belongs" in reasons[0], reasons
        time.sleep(0.5)
        assert "local_step=900" not in d.log_text()
        base.check()
        r.local = 1000
        r.round(1)
        assert "local_step=900" not in d.log_text()
        base.check()
    finally:
        assert d.stop() == 0


def test_symlinked_global_dir_is_neither_read_nor_written(tmp_path):
    """global/ replaced by a link to a directory outside the tree: refused on reading; the next
    step is committed locally but not published through the link (publish fails with the reason and
    is retried); the outside directory is untouched.  A real global/ again and the step is published."""
    r = Run(tmp_path, extra=("--retry-interval", "0.2"))
    d = r.d.start()
    try:
        wait_step(d, r.hub, 0)
        r.round(0)
        base = Baseline(d)
        outside = tmp_path / "outside-global"
        outside.mkdir()
        (outside / "step_count.json").write_text(json.dumps({"outer_step": 0}))
        (outside / "latest.safetensors").write_bytes(b"decoy")
        before = tree_listing(outside)
        os.rename(r.hub / "global", tmp_path / "global-real")
        os.symlink(outside, r.hub / "global")
        reasons = wait_refused(d, "global")
        assert "a symbolic link where the global directory belongs" in reasons[0], reasons

        r.local += 10
        deltas = {n: random_deltas(r.rng, r.model) for n in NODES}
        for n, t in deltas.items():
            write_delta(r.hub, n, 1, r.local, t)
        want = r.oracle.step(deltas)
        wait_for(lambda: d.committed_step() == 2, 30, "step 2 committed")
        d.wait_log("hub: publish failed, will retry", count=1)
        assert "global is a symbolic link where the global directory belongs" in d.log_text()
        time.sleep(0.5)                             # a few retries
        assert tree_listing(outside) == before
        base.check()

        os.unlink(r.hub / "global")
        try:
            os.rename(tmp_path / "global-real", r.hub / "global")
        except OSError:
            pass    # a publish retry created a fresh global/ in between: it publishes there, as well
        wait_step(d, r.hub, 2)
        assert_state_close(load_torch(r.hub / "global" / "latest.safetensors"), want)
        assert tree_listing(outside) == before
        r.round(2)
        base.check()
    finally:
        assert d.stop() == 0


# ---- 5. a delta header over the cap -------------------------------------------------------------

def big_header_delta(model, node, base, local, header_bytes):
    """A well-formed delta whose JSON header is padded with spaces to header_bytes."""
    tensors, off, parts = {}, 0, []
    for k, v in model.items():
        a = np.zeros(tuple(v.shape), np.float32)
        tensors[k] = {"dtype": "F32", "shape": list(v.shape), "data_offsets": [off, off + a.nbytes]}
        off += a.nbytes
        parts.append(a.tobytes())
    tensors["__metadata__"] = delta_metadata(node, base, local)
    js = json.dumps(tensors).encode()
    js += b" " * (header_bytes - len(js))
    return struct.pack("<Q", len(js)) + js + b"".join(parts)


def test_delta_header_over_the_cap_is_refused_unread(tmp_path):
    """max_delta_header_mib (default 16) now caps file:// intake too: a 60 MiB header (the format
    allows 100 MB; parsing 90 MB took 449 MiB RSS) is refused from its 8-byte prefix.  Peak RSS
    (VmHWM) does not move by more than the slack; a header under a lowered cap is still fine."""
    r = Run(tmp_path, extra=("--max-delta-header-mib", "2"))
    d = r.d.start()
    try:
        wait_step(d, r.hub, 0)
        r.round(0)
        base = Baseline(d)
        hwm0 = proc_kib(d.proc.pid, "VmHWM")
        for node, size in (("w1", 60 << 20), ("w2", 3 << 20)):
            p = r.hub / "nodes" / node
            p.mkdir()
            (p / ".tmp").write_bytes(big_header_delta(r.model, node, 1, 5, size))
            os.rename(p / ".tmp", p / "delta_5.safetensors")
        for node in ("w1", "w2"):
            d.wait_log(f"intake: delta rejected path=nodes/{node}/delta_5.safetensors code=header_too_large")
        assert "the cap is 2097152 (max_delta_header_mib)" in d.log_text()
        hwm = proc_kib(d.proc.pid, "VmHWM")
        assert hwm <= hwm0 + RSS_SLACK_KIB, f"peak RSS {hwm} KiB, before {hwm0} KiB"
        print(f"VmHWM {hwm0} -> {hwm} KiB")
        base.check()
        # a padded header under the cap is read and the delta accepted
        p = r.hub / "nodes" / "a"
        (p / ".tmp").write_bytes(big_header_delta(r.model, "a", 1, 15, 1 << 20))
        os.rename(p / ".tmp", p / "delta_15.safetensors")
        d.wait_log("round: delta accepted step=1 node=a local_step=15")
        base.check()
    finally:
        assert d.stop() == 0


# ---- 6. a node directory with tens of thousands of entries --------------------------------------

def test_node_dir_flooded_with_entries_costs_a_bounded_scan(tmp_path):
    """40,000 empty files with valid delta names in one node directory, plus 20,000 junk names in
    nodes/: only the newest few of that node's names are looked at (one delta per node counts), the
    others cost a directory record each; memory and descriptors stay flat, rounds go on."""
    r = Run(tmp_path)
    d = r.d.start()
    try:
        wait_step(d, r.hub, 0)
        r.round(0)
        base = Baseline(d)
        flood = tmp_path / "flood"                 # filled outside, then moved in at once
        flood.mkdir()
        empty = tmp_path / "empty"
        empty.write_bytes(b"")
        for i in range(40000):
            os.link(empty, flood / f"delta_{i}.safetensors")
        for i in range(20000):
            os.link(empty, r.hub / "nodes" / f"junk+{i}")       # "+" is not in a node id
        t0 = time.monotonic()
        os.rename(flood, r.hub / "nodes" / "flood")
        wait_for(lambda: d.log_text().count("hub: delta seen path=nodes/flood/") >= 16, 20, "the flood seen")
        print(f"flood seen after {time.monotonic() - t0:.2f} s")
        served_quickly(d)
        r.round(1)
        seen = set(re.findall(r"delta seen path=nodes/flood/delta_(\d+)\.safetensors", d.log_text()))
        assert len(seen) == 16 and min(int(s) for s in seen) == 40000 - 16, sorted(seen)
        base.check()
    finally:
        assert d.stop() == 0
