"""dilocod durability: kill -9 at random moments of aggregation and commit, a full disk during the outer
step, and bounded memory while aggregating a large model.

Commit protocol under test (server/core/store.c): the step's global/latest-<s>.safetensors and
outer_state-<s>.safetensors are written to temporary files, fsynced and renamed, then
outer_metadata.json is atomically replaced (the commit point); startup removes every leftover.
"""
import filecmp
import json
import os
import random
import re
import shutil
import subprocess
import time
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open

from conftest import run
from dilocod_proc import Dilocod, Oracle, assert_state_close, load_torch, write_delta, write_model

MIB = 1 << 20


# ---- helpers -------------------------------------------------------------------------------------

def current_log(d: Dilocod) -> str:
    """The log of the running (or last) process only."""
    if not d.logs or not d.logs[-1].exists():
        return ""
    return d.logs[-1].read_text(errors="replace")


def wait_current_log(d: Dilocod, needle: str, timeout=60.0, poll=0.003):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if needle in current_log(d):
            return
        if not d.alive():
            raise AssertionError(f"dilocod exited ({d.proc and d.proc.returncode}) before logging {needle!r}:\n"
                                 f"{current_log(d)[-4000:]}")
        time.sleep(poll)
    raise AssertionError(f"{needle!r} not logged within {timeout}s:\n{current_log(d)[-4000:]}")


def wait_until(cond, timeout, what, d=None):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if cond():
            return
        if d is not None and d.proc is not None and not d.alive():
            raise AssertionError(f"dilocod exited while waiting for {what}:\n{d.log_text()[-4000:]}")
        time.sleep(0.005)
    raise AssertionError(f"timed out ({timeout}s) waiting for {what}" +
                         (f":\n{d.log_text()[-4000:]}" if d is not None else ""))


def listing(root: Path) -> str:
    out = []
    for dirpath, _dirs, files in sorted(os.walk(root)):
        for f in sorted(files):
            p = Path(dirpath) / f
            try:
                size = p.stat().st_size
            except OSError:
                size = -1
            out.append(f"  {p.relative_to(root)} ({size} bytes)")
    return "\n".join(out)


def check_committed(state_dir: Path, diloco_bin) -> int:
    """outer_metadata.json parses and names exactly one committed step, whose named files exist and are
    valid safetensors (momentum metadata names the same step).  Returns the step.  A running dilocod may
    commit the next step (and clean up this one's files) while the files are checked: then the check is
    made again on the step committed now."""
    for _ in range(20):
        before = (state_dir / "outer_metadata.json").read_text()
        try:
            return check_committed_once(state_dir, diloco_bin)
        except AssertionError:
            if (state_dir / "outer_metadata.json").read_text() == before:
                raise
    return check_committed_once(state_dir, diloco_bin)


def check_committed_once(state_dir: Path, diloco_bin) -> int:
    meta_path = state_dir / "outer_metadata.json"
    text = meta_path.read_text()
    try:
        meta = json.loads(text)
    except ValueError as e:
        raise AssertionError(f"outer_metadata.json does not parse ({e}):\n{text!r}\n{listing(state_dir)}")
    s = meta.get("outer_step")
    assert isinstance(s, int) and not isinstance(s, bool) and s >= 0, meta
    assert meta.get("global_file") == f"global/latest-{s}.safetensors", meta
    if s == 0:
        assert meta.get("outer_state_file") is None, meta
        named = [state_dir / meta["global_file"]]
    else:
        assert meta.get("outer_state_file") == f"outer_state-{s}.safetensors", meta
        named = [state_dir / meta["global_file"], state_dir / meta["outer_state_file"]]
    for p in named:
        assert p.is_file(), f"committed step {s} names {p}, which is missing:\n{listing(state_dir)}"
        r = run([diloco_bin, "inspect", "--json", p])
        assert r.returncode == 0, f"{p} is not valid safetensors: {r.stdout} {r.stderr}"
    if s > 0:
        info = json.loads(run([diloco_bin, "inspect", "--json", named[1]], check=0).stdout)
        assert info["metadata"].get("outer_step") == str(s), (named[1], info["metadata"])
    return s


def committed_after_kill(state_dir: Path, diloco_bin) -> tuple:
    """(committed, durable): durable is the step outer_metadata.json names (check_committed: its files are
    there and valid); committed is the step of a redo record that follows it (redo.json: a round committed,
    its files not durable yet, recomputed by the restart), else durable."""
    durable = check_committed(state_dir, diloco_bin)
    try:
        redo = json.loads((state_dir / "redo.json").read_text())
    except FileNotFoundError:
        return durable, durable
    assert redo.get("base_step") == durable and redo.get("step") == durable + 1 or redo.get("step") == durable, \
        f"redo.json {redo} does not follow the durable step {durable}"
    return redo["step"], durable


def assert_close(got: dict, want: dict, rtol=1e-5, atol=1e-6):
    """assert_state_close's check for big F32 tensors without its float64 copies (several times faster on
    64 MiB); everything else goes to assert_state_close."""
    assert sorted(got) == sorted(want), (sorted(got), sorted(want))
    for k in want:
        g, w = got[k], want[k]
        if w.dtype != torch.float32 or g.dtype != torch.float32 or g.shape != w.shape:
            assert_state_close({k: g}, {k: w}, rtol=rtol, atol=atol)
            continue
        if torch.equal(g, w):
            continue
        excess = (g - w).abs_().sub_(w.abs().mul_(rtol))
        worst = float(excess.max())
        assert worst <= atol, (k, float((g - w).abs().max()))


def check_step_content(state_dir: Path, s: int, states: dict, moms: dict):
    """The committed global and momentum equal the oracle's for exactly step s."""
    assert_close(load_torch(state_dir / f"global/latest-{s}.safetensors"), states[s])
    if s > 0:
        assert_close(load_torch(state_dir / f"outer_state-{s}.safetensors"), moms[s])


TMP_RE = re.compile(r"\.tmp-(\d+)-\d+$")


def wait_for_starved_warm_files(state_dir: Path, s: int, own_pid: int, timeout=30):
    """Waits until the running daemon's warmed outputs of step s are gone.  Its warm thread runs under
    SCHED_IDLE: on a loaded machine it can still sit between creating a file and reserving its space
    (0 bytes, not ready, so the pass wrote its own) after step s was computed and cleaned; the file goes
    when the thread next runs.  One that stays is a leak, and the caller's check says so."""
    names = [state_dir / "global" / f".latest-{s}.safetensors.tmp-{own_pid}-",
             state_dir / f".outer_state-{s}.safetensors.tmp-{own_pid}-"]

    def starved():
        return [p for p in (state_dir / "global").iterdir() if str(p).startswith(str(names[0]))] + \
            [p for p in state_dir.iterdir() if str(p).startswith(str(names[1]))]
    deadline = time.time() + timeout
    while starved() and time.time() < deadline:
        time.sleep(0.05)


def check_clean_state(state_dir: Path, s: int, own_pid: int):
    """After startup cleanup: only the committed step's files, no temporary file of another process, only
    the committed step's delta cache, an incoming directory holding at most our own in-flight temps, and
    at most the running daemon's warmed outputs of the next step (global/.latest-{s+1}.safetensors.tmp-*,
    .outer_state-{s+1}.safetensors.tmp-*)."""
    where = f"\nstate dir:\n{listing(state_dir)}"
    top = set(os.listdir(state_dir))
    assert {"global", "cache", "outer_metadata.json"} <= top, where
    moms = {n for n in top if re.fullmatch(r"outer_state-\d+\.safetensors", n)}
    assert moms == ({f"outer_state-{s}.safetensors"} if s > 0 else set()), f"momentum files {sorted(moms)}{where}"
    globals_ = {n for n in os.listdir(state_dir / "global") if not n.startswith(".")}
    assert globals_ == {f"latest-{s}.safetensors"}, f"global/ holds {sorted(globals_)}{where}"
    assert set(os.listdir(state_dir / "cache")) == {"deltas", "incoming"}, where
    assert set(os.listdir(state_dir / "cache/deltas")) <= {f"s{s}"}, where
    for name in os.listdir(state_dir / "cache/incoming"):
        # our own in-flight temporaries, and the names zero-copy intake links a delta under on its way
        # into the cache (.link-<pid>-<inode>): the restarted daemon takes the hub's deltas in meanwhile
        m = TMP_RE.search(name) or re.fullmatch(r"\.link-(\d+)-\d+", name)
        assert m and int(m.group(1)) == own_pid, f"leftover in cache/incoming: {name}{where}"
    warm = {(state_dir / "global", f".latest-{s + 1}.safetensors"), (state_dir, f".outer_state-{s + 1}.safetensors")}
    wait_for_starved_warm_files(state_dir, s, own_pid)
    for dirpath, dirs, files in os.walk(state_dir):
        for name in dirs + files:
            if ".tmp-" in name:
                m = TMP_RE.search(name)
                ours = m and int(m.group(1)) == own_pid
                # the running daemon's write of verdicts.json (replaced after every verdict) may be out
                in_flight = Path(dirpath) == state_dir / "cache/incoming" or \
                    (Path(dirpath), name[:m.start()] if m else name) in warm or \
                    (Path(dirpath) == state_dir and name.startswith(".verdicts.json.tmp-"))
                assert ours and in_flight, f"leftover temporary file {Path(dirpath) / name}{where}"


def snapshot(oracle: Oracle):
    state = {k: v.clone() for k, v in oracle.state.items()}
    mom = {k: oracle.opt.state[oracle.params[k]]["momentum_buffer"].clone() for k in oracle.floating}
    return state, mom


# ---- 1. kill -9 torture --------------------------------------------------------------------------

def torture_model():
    g = torch.Generator().manual_seed(11)
    return {
        "a": torch.randn(2048, 4096, generator=g),          # 32 MiB
        "b": torch.randn(4096, 1024, generator=g),          # 16 MiB
        "c": torch.randn(4 << 20, generator=g),             # 16 MiB
        "steps": torch.tensor([1, 2, 3], dtype=torch.int64),
    }


def test_kill9_torture_during_aggregation_and_commit(tmp_path, diloco_bin):
    seed = 20240611
    rnd = random.Random(seed)
    rng = np.random.default_rng(seed)
    model = torture_model()
    write_model(tmp_path / "init.safetensors", model)
    shapes = {k: tuple(v.shape) for k, v in model.items() if v.is_floating_point()}
    nodes = ["n0", "n1", "n2"]
    hub = tmp_path / "hub"
    oracle = Oracle(model)
    states = {0: {k: v.clone() for k, v in model.items()}}
    moms = {}

    def prepare_round(r):
        """Oracle of round r (base step r -> r + 1); returns the deltas to write."""
        deltas = {n: {k: (rng.random(shp, dtype=np.float32) - np.float32(0.5)) * np.float32(0.02)
                      for k, shp in shapes.items()} for n in nodes}
        oracle.step(deltas)
        states[r + 1], moms[r + 1] = snapshot(oracle)
        for old in [s for s in states if s < r - 1]:
            del states[old]
            moms.pop(old, None)
        for n in nodes:         # keep one stale round in the hub, drop older ones (disk)
            (hub / "nodes" / n / f"delta_{r - 1}.safetensors").unlink(missing_ok=True)
        return deltas

    def write_round(r, deltas):
        for n in nodes:
            write_delta(hub, n, r, r + 1, deltas[n])

    d = Dilocod(tmp_path, hub, "--init-model", str(tmp_path / "init.safetensors"), "--expected-nodes", "3",
                "--threads", "2", "--agg-memory-mib", "1", "--retry-interval", "0.2")
    calib_rounds, kills = 2, 32
    records = []
    try:
        d.start()
        d.wait_step(0)
        # calibration: clean rounds, measuring delta-written -> committed and the aggregation+commit time
        t_commit, t_agg, t_tail = 0.0, 0.0, None
        for r in range(calib_rounds):
            deltas = prepare_round(r)
            write_round(r, deltas)
            t0 = time.time()
            wait_until(lambda: d.committed_step() == r + 1, 120, f"commit of step {r + 1}", d)
            t_commit = max(t_commit, time.time() - t0)
            d.wait_step(r + 1)
            m = re.search(rf"aggregate: done step={r + 1} .*?seconds=([0-9.]+)", d.log_text())
            assert m, d.log_text()[-3000:]
            t_agg = max(t_agg, float(m.group(1)))
            # the tail after the pass computed its chunks: durable files, renames, the metadata commit
            c = re.search(rf"aggregate: computed step={r + 1} seconds=([0-9.]+)", d.log_text())
            if c:
                t_tail = max(t_tail or 0.0, float(m.group(1)) - float(c.group(1)))
            check_step_content(d.state_dir, r + 1, states, moms)
        print(f"\ncalibration: delta written -> committed {t_commit * 1000:.0f} ms, "
              f"aggregation+commit {t_agg * 1000:.0f} ms, commit tail {(t_tail or 0) * 1000:.0f} ms")
        uniform_max = 1.1 * t_commit

        for i in range(kills):
            r = calib_rounds + i
            deltas = prepare_round(r)
            mode = ("uniform", "aggregating", "committing", "uniform", "after_commit", "aggregating", "uniform",
                    "committing")[i % 8]
            write_round(r, deltas)
            if mode == "uniform":
                delay = rnd.uniform(0, uniform_max)
                time.sleep(delay)
            elif mode == "aggregating":
                wait_current_log(d, f"aggregate: started step={r + 1} ")
                delay = rnd.uniform(0, t_agg)
                time.sleep(delay)
            elif mode == "committing" and t_tail is not None:
                wait_current_log(d, f"aggregate: computed step={r + 1} ", poll=0.001)
                delay = rnd.uniform(0, t_tail)
                time.sleep(delay)
            elif mode == "committing":     # no debug line to aim at: the end of the measured pass
                wait_current_log(d, f"aggregate: started step={r + 1} ")
                delay = rnd.uniform(0.8 * t_agg, 1.1 * t_agg)
                time.sleep(delay)
            else:
                wait_current_log(d, f"store: committed step={r + 1} ")
                delay = rnd.uniform(0, 0.03)
                time.sleep(delay)
            assert d.alive(), current_log(d)[-3000:]
            d.kill9()
            killed_log = current_log(d)
            if f"store: committed step={r + 1} " in killed_log:
                phase = "after_commit"
            elif f"aggregate: computed step={r + 1} " in killed_log:
                phase = "committing"        # the pass is done: files being made durable, renamed, committed
            elif f"aggregate: started step={r + 1} " in killed_log:
                phase = "aggregating"
            else:
                phase = "before_aggregation"

            # the on-disk state right after the crash: exactly one committed step, old or new, never a mix
            # (a new one may be committed by its redo record only: the restart recomputes its files)
            s, durable = committed_after_kill(d.state_dir, diloco_bin)
            assert s in (r, r + 1), f"round {r}: committed step {s}\n{listing(d.state_dir)}"
            if durable in states:      # (a step before r: its round's commit was still settling)
                check_step_content(d.state_dir, durable, states, moms)
            if phase == "before_aggregation":
                assert s == r, f"round {r}: step {s} committed before its aggregation started"
            if phase == "after_commit":
                assert s == r + 1, f"round {r}: the logged commit of step {r + 1} was lost"
            records.append((r, mode, round(delay * 1000), phase, "new" if s == r + 1 else "old",
                            "redo" if s != durable else ""))

            # a restart whose round cannot close (later flag wins): the startup cleanup, checked at rest
            d.start("--expected-nodes", "1000")
            wait_current_log(d, f"round: opened step={s} ")
            assert check_committed(d.state_dir, diloco_bin) == s
            assert not (d.state_dir / "redo.json").exists()
            check_step_content(d.state_dir, s, states, moms)   # recomputed from the redo record: the same bits
            check_clean_state(d.state_dir, s, d.proc.pid)
            # a publish cut short by the kill leaves a temporary in the hub: startup removes it
            hub_tmp = [p.name for p in (hub / "global").iterdir()
                       if ".tmp-" in p.name and not p.name.startswith(tuple(
                           f".{n}.tmp-{d.proc.pid}-" for n in ("latest.safetensors", "step_count.json")))]
            assert hub_tmp == [], f"round {r}: hub/global temporaries after restart: {hub_tmp}"
            assert d.stop() == 0, current_log(d)[-3000:]

            # the real restart: an old commit redoes the round from the hub; a new one is just published
            d.start()
            d.wait_step(r + 1, timeout=120)
            wait_until(lambda: d.committed_step() == r + 1, 60, f"commit of step {r + 1}", d)
            assert d.published_step() == r + 1
            if s == r:          # redone: the new step equals the oracle (not lost, not applied twice)
                check_step_content(d.state_dir, r + 1, states, moms)
            assert filecmp.cmp(hub / "global/latest.safetensors", d.state_dir / f"global/latest-{r + 1}.safetensors",
                               shallow=False), "the published global is not the committed one"

        final = calib_rounds + kills
        assert d.committed_step() == final and d.published_step() == final
        assert_close(load_torch(hub / "global/latest.safetensors"), states[final])
        assert d.stop() == 0
        d.start("--expected-nodes", "1000")
        wait_current_log(d, f"round: opened step={final} ")
        check_clean_state(d.state_dir, final, d.proc.pid)
        check_step_content(d.state_dir, final, states, moms)
        assert d.stop() == 0
    finally:
        if d.alive():
            d.kill9()
        print("kills (round, mode, delay ms, phase, committed):")
        for rec in records:
            print("  ", rec)
    log = d.log_text()
    applied = re.findall(r"store: committed step=(\d+) ", log)
    # a round applied twice would commit its step twice (a kill between the rename and the log line
    # may leave a step without its log line, never with two)
    assert len(applied) == len(set(applied)) and set(map(int, applied)) <= set(range(1, calib_rounds + kills + 1)), \
        applied
    phases = [rec[3] for rec in records]
    outcomes = [rec[4] for rec in records]
    assert len(records) == kills >= 20
    assert phases.count("aggregating") + phases.count("committing") >= 3, records
    assert outcomes.count("old") >= 1 and outcomes.count("new") >= 1, records
    shutil.rmtree(hub, ignore_errors=True)
    shutil.rmtree(d.state_root, ignore_errors=True)


# ---- 2. no space left on device ------------------------------------------------------------------

def small_model():
    g = torch.Generator().manual_seed(21)
    return {
        "a": torch.randn(1024, 1024, generator=g),          # 4 MiB
        "b": torch.randn(1 << 20, generator=g),             # 4 MiB
        "steps": torch.tensor([5, 6], dtype=torch.int64),
    }


def test_enospc_during_outer_step_keeps_last_commit_and_recovers(tmp_path, diloco_bin):
    model = small_model()
    write_model(tmp_path / "init.safetensors", model)
    shapes = {k: tuple(v.shape) for k, v in model.items() if v.is_floating_point()}
    rng = np.random.default_rng(7)
    oracle = Oracle(model)
    states, moms = {0: {k: v.clone() for k, v in model.items()}}, {}
    hub = tmp_path / "hub"
    mnt = tmp_path / "tmpfs"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(mnt)], check=True)
    # --warm-outputs 0: a warmed pass took its space while the round collected, so it cannot run out at
    # its own start as this test needs (test_warm_outputs.py covers a warm job meeting a full disk)
    d = Dilocod(tmp_path, hub, "--init-model", str(tmp_path / "init.safetensors"), "--expected-nodes", "2",
                "--threads", "2", "--retry-interval", "0.2", "--warm-outputs", "0", state_root=mnt)
    try:
        d.start()
        d.wait_step(0)

        def round_deltas(r):
            deltas = {n: {k: rng.standard_normal(shp, dtype=np.float32) * np.float32(0.01)
                          for k, shp in shapes.items()} for n in ("n0", "n1")}
            oracle.step(deltas)
            states[r + 1], moms[r + 1] = snapshot(oracle)
            return deltas

        # round 0 normally: step 1 has a momentum file
        deltas = round_deltas(0)
        paths = [write_delta(hub, n, 0, 1, t) for n, t in deltas.items()]
        d.wait_step(1)
        d.wait_durable(1)   # check_committed reads outer_metadata.json, written after the publish
        assert check_committed(d.state_dir, diloco_bin) == 1
        check_step_content(d.state_dir, 1, states, moms)
        # wait for the cleanup of step 0 so the free space is what the step needs
        wait_until(lambda: not (d.state_dir / "global/latest-0.safetensors").exists() and
                   not (d.state_dir / "cache/deltas/s0").exists(), 30, "cleanup of step 0", d)

        delta_bytes = paths[0].stat().st_size
        st = os.statvfs(mnt)
        free = st.f_bavail * st.f_frsize
        # after caching the 2 deltas, 12 MiB stay free: the new global (8 MiB) fits, its momentum does not
        filler_size = free - 2 * delta_bytes - 12 * MIB
        assert filler_size > 0, (free, delta_bytes)
        filler = mnt / "filler"
        fd = os.open(filler, os.O_CREAT | os.O_WRONLY, 0o600)
        try:
            os.posix_fallocate(fd, 0, filler_size)
        finally:
            os.close(fd)

        deltas = round_deltas(1)
        for n, t in deltas.items():
            write_delta(hub, n, 1, 2, t)
        d.wait_log("outer step failed, not committed", timeout=60)
        d.wait_log("aggregate: will retry", timeout=30, count=2)       # it keeps trying
        log = d.log_text()
        failures = [line for line in log.splitlines() if "outer step failed, not committed" in line]
        assert failures and all("No space left on device" in line for line in failures), failures
        assert "error" in failures[0].split("aggregate:")[0], failures[0]      # logged at error level
        assert "round: closed step=1 nodes=2" in log, log[-3000:]
        assert d.alive(), log[-3000:]
        # the last committed step is untouched and still the one served
        assert check_committed(d.state_dir, diloco_bin) == 1
        check_step_content(d.state_dir, 1, states, moms)
        assert d.published_step() == 1
        assert_state_close(load_torch(hub / "global/latest.safetensors"), states[1])
        assert not (d.state_dir / "global/latest-2.safetensors").exists()
        assert not (d.state_dir / "outer_state-2.safetensors").exists()

        filler.unlink()
        d.wait_step(2, timeout=120)
        wait_until(lambda: d.committed_step() == 2, 30, "commit of step 2", d)
        assert d.alive()
        d.wait_durable(2)
        # the pipeline counts the attempts of step 2 (every failed one, then the one committed) and
        # nothing is left running or failed on it
        rec = [r for r in d.pipeline() if r["step"] == 2][0]
        retries = log.count("aggregate: will retry")
        assert rec["attempts"] >= retries + 1 >= 3, (rec, retries)
        assert rec["failed"] == [] and "pass" not in rec["busy"] and "sync" not in rec["busy"], rec
        assert check_committed(d.state_dir, diloco_bin) == 2
        check_step_content(d.state_dir, 2, states, moms)
        assert_state_close(load_torch(hub / "global/latest.safetensors"), states[2])
        # the failed attempts left nothing behind (walked once the cleanup no longer removes files under it)
        d.wait_settled(2)
        leftovers = [str(p) for p in d.state_dir.rglob("*") if ".tmp-" in p.name]
        assert not leftovers, f"{leftovers}\n{listing(d.state_dir)}"
        assert d.stop() == 0
        nfail = d.log_text().count("outer step failed, not committed")
        print(f"\nENOSPC: {nfail} failed attempts before space was freed, then step 2 committed")
    finally:
        if d.alive():
            d.kill9()
        if subprocess.run(["umount", str(mnt)]).returncode != 0:
            subprocess.run(["umount", "-l", str(mnt)])


# ---- 3. bounded memory on a large model ----------------------------------------------------------

def vm_hwm_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise AssertionError("no VmHWM in /proc/PID/status")


def test_peak_rss_bounded_with_512mib_model_and_8_deltas(tmp_path, diloco_bin):
    from safetensors.numpy import save_file

    names = [f"layer{i}.weight" for i in range(4)]
    per = 32 << 20                                  # 4 x 32 Mi floats = 512 MiB of F32
    nnodes = 8
    lr, mu = np.float32(0.7), np.float32(0.9)
    rng = np.random.default_rng(3)
    hub, state = tmp_path / "hub", tmp_path / "state"
    init = tmp_path / "init.safetensors"
    d = Dilocod(tmp_path, hub, "--init-model", str(init), "--expected-nodes", str(nnodes), "--threads", "2")
    scale = [np.float32(1 + 0.05 * k) for k in range(nnodes)]
    offset = [np.float32(0.001 * (k - 3.5)) for k in range(nnodes)]
    try:
        t0 = time.time()
        g0 = {n: rng.standard_normal(per, dtype=np.float32) for n in names}
        save_file(g0, str(init))
        base = {n: rng.standard_normal(per, dtype=np.float32) * np.float32(0.01) for n in names}
        d.start()
        d.wait_step(0, timeout=120)
        for k in range(nnodes):
            write_delta(hub, f"n{k}", 0, 1, {n: base[n] * scale[k] + offset[k] for n in names})
        t_written = time.time()
        d.wait_step(1, timeout=300)
        wait_until(lambda: d.committed_step() == 1, 60, "commit of step 1", d)
        hwm = vm_hwm_kib(d.proc.pid)            # just before stopping
        assert d.stop() == 0
        log = d.log_text()
        m = re.search(r"aggregate: done step=1 nodes=8 seconds=([0-9.]+) gbps=([0-9.]+)", log)
        assert m, log[-3000:]
        print(f"\npeak RSS (VmHWM) {hwm / 1024:.1f} MiB; aggregation {float(m.group(1)):.2f} s "
              f"({m.group(2)} GB/s); files written in {t_written - t0:.1f} s, "
              f"deltas -> published {time.time() - t_written:.1f} s")
        assert hwm < 256 * 1024, f"VmHWM {hwm} kB is not under 256 MiB"

        # the result, against numpy doing the same F32 operations
        gpath = d.state_dir / "global/latest-1.safetensors"
        mpath = d.state_dir / "outer_state-1.safetensors"
        worst = 0.0
        with safe_open(str(gpath), "numpy") as fg, safe_open(str(mpath), "numpy") as fm:
            assert sorted(fg.keys()) == sorted(names) and sorted(fm.keys()) == sorted(names)
            for n in names:
                acc = base[n] * scale[0] + offset[0]
                for k in range(1, nnodes):
                    acc += base[n] * scale[k] + offset[k]
                g = acc / np.float32(nnodes)
                want = g0[n] - lr * (g + mu * g)        # first step: buf = g (nesterov)
                got = fg.get_tensor(n)
                assert got.dtype == np.float32 and got.shape == (per,)
                np.testing.assert_allclose(fm.get_tensor(n), g, rtol=1e-6, atol=1e-9, err_msg=n)
                np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7, err_msg=n)
                worst = max(worst, float(np.abs(got - want).max()))
                del acc, g, want, got
        print(f"max |dilocod - numpy| = {worst:.3g}")
        assert (hub / "global/latest.safetensors").stat().st_size == gpath.stat().st_size
    finally:
        if d.alive():
            d.kill9()
        for p in (hub, state):
            shutil.rmtree(p, ignore_errors=True)
        init.unlink(missing_ok=True)
