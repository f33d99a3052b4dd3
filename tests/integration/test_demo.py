"""`make demo DEMO_ROUNDS=3` runs non-interactively, trains a real model through dilocod with
PyTorch workers, and its output shows the loss falling; so does `make demo DEMO_MODE=async` with a
straggler (DEMO_SPEEDS=1,1,3), whose workers follow dilocod's recommended local steps.  From a
terminal (a pty here) the dashboard keeps being served until Ctrl-C; without one the demo says that
the dashboard stops with it; a busy port is refused up front with the DEMO_PORT to use."""
import json
import os
import pty
import re
import select
import signal
import socket
import subprocess
import time

import requests

from conftest import BUILD, ROOT


def test_make_demo_three_rounds(tmp_path):
    p = subprocess.run(["make", "-C", str(ROOT), "--no-print-directory", "demo", "DEMO_ROUNDS=3", "DEMO_WORKERS=3",
                        "DEMO_PORT=0", f"DEMO_DIR={tmp_path / 'demo'}", f"BUILD={BUILD}"],
                       stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=900)
    out = p.stdout
    assert p.returncode == 0, out[-3000:] + p.stderr[-3000:]
    rounds = re.findall(r"round +(\d+): step (\d+) -> (\d+), (\d+) nodes, aggregation ([\d.]+) ms, "
                        r"mean worker loss ([\d.]+)", out)
    assert [int(r[0]) for r in rounds] == [0, 1, 2], out
    assert all(int(r[3]) == 3 for r in rounds), out
    losses = [float(r[5]) for r in rounds]
    assert losses[-1] < losses[0], losses
    m = re.search(r"loss ([\d.]+) -> ([\d.]+) over 3 rounds \(falling\)", out)
    assert m, out
    assert re.search(r"deltas taken: 9, [\d.]+ MiB as F32\n", out), out
    assert re.search(r"dashboard: http://127\.0\.0\.1:\d+/", out), out
    assert "not a terminal: the demo ends now and dilocod stops with it" in out, out
    # every process the demo started is gone, and dilocod stopped cleanly
    log = (tmp_path / "demo" / "dilocod.log").read_text()
    assert "main: stopped step=3 exit_code=0" in log, log[-2000:]
    # the workers reported their last inner loss and the samples they trained (30 steps x 128) with each delta
    jsonl = (tmp_path / "demo" / "state" / "aggregator" / "rounds.jsonl").read_text().splitlines()
    for rec in map(json.loads, jsonl):
        assert sorted(n["node_id"] for n in rec["nodes"]) == ["worker-1", "worker-2", "worker-3"], rec
        for n in rec["nodes"]:
            assert set(n["metrics"]) == {"loss", "num_tokens"} and n["metrics"]["num_tokens"] == 30 * 128, n
            assert 0 < n["metrics"]["loss"] < 10, n


def test_make_demo_says_what_encoding_saved_and_why_a_round_waited(tmp_path):
    """DEMO_ENCODE=mxfp4 prints the bytes the deltas took against F32 (from dilocod's records), and
    DEMO_FAULTY=2's rounds say they waited the full --round-timeout for the faulty worker, or that its
    delta was quarantined at the close: the demo's 3x longer rounds are explained where they happen."""
    p = subprocess.run(["make", "-C", str(ROOT), "--no-print-directory", "demo", "DEMO_ROUNDS=3", "DEMO_WORKERS=3",
                        "DEMO_PORT=0", "DEMO_ENCODE=mxfp4", "DEMO_FAULTY=2", f"DEMO_DIR={tmp_path / 'demo'}",
                        f"BUILD={BUILD}"], stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=900)
    out = p.stdout
    assert p.returncode == 0, out[-3000:] + p.stderr[-3000:]
    recs = [json.loads(x) for x in (tmp_path / "demo/state/aggregator/rounds.jsonl").read_text().splitlines()]
    lines = {int(m.group(1)): m.group(0) for m in re.finditer(r"round +(\d+): step .*", out)}
    assert sorted(lines) == [r["step"] for r in recs] == [0, 1, 2], out
    for r in recs:
        line = lines[r["step"]]
        assert "worker-2" not in [n["node_id"] for n in r["nodes"]], r
        if r["reason"] == "timeout":
            assert "waited the full --round-timeout for worker-2 (faulty: its deltas are quarantined)" in line, line
        else:       # it came in time, and was quarantined at the close
            assert [q["node_id"] for q in r["quarantined"]] == ["worker-2"], r
            assert "worker-2's delta quarantined at the close (norm_ratio)" in line, line
    taken = sum(n["bytes"] for r in recs for n in r["nodes"])
    f32 = (tmp_path / "demo" / "init.safetensors").stat().st_size * 6
    m = re.search(r"deltas taken: 6, ([\d.]+) MiB as mxfp4; as F32 about ([\d.]+) MiB: ([\d.]+)x smaller, "
                  r"([\d.]+) MiB saved", out)
    assert m, out
    assert float(m.group(1)) == round(taken / 2**20, 2) and float(m.group(2)) == round(f32 / 2**20, 2), (m.group(0), taken)
    assert 6.5 < float(m.group(3)) < 8.1, m.group(0)       # mxfp4: 4.25 bits per value against 32


def test_make_demo_async_with_a_straggler(tmp_path):
    """Three rounds a worker against dilocod --mode async, worker-3 three times as slow: every delta is
    in an update the demo prints, the loss falls, and each worker's next phase trains the local steps the
    previous upload answer recommended (DyLU)."""
    p = subprocess.run(["make", "-C", str(ROOT), "--no-print-directory", "demo", "DEMO_MODE=async",
                        "DEMO_SPEEDS=1,1,3", "DEMO_ROUNDS=3", "DEMO_WORKERS=3", "DEMO_PORT=0",
                        f"DEMO_DIR={tmp_path / 'demo'}", f"BUILD={BUILD}"],
                       stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=900)
    out = p.stdout
    assert p.returncode == 0, out[-3000:] + p.stderr[-3000:]
    assert re.search(r"deltas taken: \d+, [\d.]+ MiB as F32\n", out), out
    assert "(async: dn_period 3, grace 20 ms, dylu_base_steps 30) speeds 1,1,3" in out, out
    updates = re.findall(r"update +(\d+): step (\d+) -> (\d+), (.*), aggregation ([\d.]+) ms, loss ([\d.]+)", out)
    assert [int(u[0]) for u in updates] == list(range(len(updates))), out
    assert all(int(u[2]) == int(u[1]) + 1 for u in updates), out
    nodes = [re.findall(r"(worker-\d) \(tau (\d+), (\d+) steps\)", u[3]) for u in updates]
    sent = sorted(n for ns in nodes for n, _, _ in ns)
    assert sent == ["worker-1"] * 3 + ["worker-2"] * 3 + ["worker-3"] * 3, out
    m = re.search(r"loss ([\d.]+) -> ([\d.]+) over (\d+) updates, 9 deltas \(falling\)", out)
    assert m and float(m.group(2)) < float(m.group(1)) and int(m.group(3)) == len(updates), out
    for w in ("worker-1", "worker-2", "worker-3"):
        m = re.search(rf"{w}: inner steps ([\d ]+), recommended after each push ([\d -]+)\n", out)
        assert m, out
        steps, rec = m.group(1).split(), m.group(2).split()
        assert steps[0] == "30" and len(steps) == len(rec) == 3, (w, steps, rec)
        # the phase after an answer with a recommendation trains that many steps; without one, as before
        for i in range(2):
            assert steps[i + 1] == (rec[i] if rec[i] != "-" else steps[i]), (w, steps, rec)
    # dilocod ran in async mode: its round records say so, one per update the demo printed
    jsonl = tmp_path / "demo" / "state" / "aggregator" / "rounds.jsonl"
    recs = [json.loads(line) for line in jsonl.read_text().splitlines()]
    assert len(recs) == len(updates) and all(r["mode"] == "async" for r in recs), recs
    log = (tmp_path / "demo" / "dilocod.log").read_text()
    assert f"main: stopped step={len(updates)} exit_code=0" in log, log[-2000:]


def test_demo_refuses_to_delete_a_directory_it_did_not_make(tmp_path):
    """DEMO_DIR naming an existing directory the demo did not create is left alone, not rmtree'd."""
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "notes.txt").write_text("keep me")
    p = subprocess.run([str(ROOT / ".venv/bin/python"), str(ROOT / "client/examples/demo.py"), "--build", str(BUILD),
                        "--rounds", "1", "--workers", "1", "--port", "0", "--dir", str(precious)],
                       stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=120)
    assert p.returncode != 0
    assert "refusing to delete it" in p.stdout + p.stderr, p.stdout + p.stderr
    assert (precious / "notes.txt").read_text() == "keep me"
    assert sorted(x.name for x in precious.iterdir()) == ["notes.txt"]
    # a symbolic link is never followed into its target either
    link = tmp_path / "link"
    link.symlink_to(precious)
    p = subprocess.run([str(ROOT / ".venv/bin/python"), str(ROOT / "client/examples/demo.py"), "--build", str(BUILD),
                        "--rounds", "1", "--workers", "1", "--port", "0", "--dir", str(link)],
                       stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=120)
    assert p.returncode != 0 and (precious / "notes.txt").exists()


def demo_cmd(tmp_path, *extra):
    return [str(ROOT / ".venv/bin/python"), str(ROOT / "client/examples/demo.py"), "--build", str(BUILD),
            "--rounds", "1", "--workers", "1", "--inner-steps", "2", "--dir", str(tmp_path / "demo"), *extra]


def test_demo_with_the_port_busy_names_demo_port(tmp_path):
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    port = s.getsockname()[1]
    try:
        p = subprocess.run(demo_cmd(tmp_path, "--port", str(port)), stdin=subprocess.DEVNULL, capture_output=True,
                           text=True, timeout=120)
    finally:
        s.close()
    assert p.returncode != 0
    err = p.stdout + p.stderr
    assert f"port {port} on 127.0.0.1 is in use" in err and f"DEMO_PORT={port + 1}" in err and "DEMO_PORT=0" in err, err
    assert not (tmp_path / "demo").exists(), "nothing is made before the port is known to be free"


def test_demo_in_a_terminal_keeps_the_dashboard_until_ctrl_c(tmp_path):
    """Under a pty the demo keeps dilocod serving after the last round; the dashboard answers; Ctrl-C
    (SIGINT to the demo, as a terminal sends it) stops everything cleanly."""
    pid, fd = pty.fork()
    if pid == 0:
        os.execv(str(ROOT / ".venv/bin/python"), demo_cmd(tmp_path, "--port", "0"))
    out = b""
    try:
        deadline = time.time() + 600
        while b"press Ctrl-C to stop it" not in out:
            assert time.time() < deadline, out.decode(errors="replace")[-3000:]
            r, _, _ = select.select([fd], [], [], 1)
            if r:
                try:
                    chunk = os.read(fd, 65536)
                except OSError:
                    chunk = b""
                assert chunk, out.decode(errors="replace")[-3000:]
                out += chunk
        text = out.decode(errors="replace")
        url = re.findall(r"dashboard: (http://127\.0\.0\.1:\d+/)", text)[-1]
        s = requests.Session()
        s.trust_env = False
        # still serving after the last round: the page and a status with the step the demo reached
        assert s.get(url, timeout=10).status_code == 200
        assert s.get(url + "status", timeout=10).json()["outer_step"] == 1
        os.kill(pid, signal.SIGINT)
        _, st = os.waitpid(pid, 0)
        assert os.WIFEXITED(st) and os.WEXITSTATUS(st) == 130, st
    finally:
        try:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass
        os.close(fd)
    log = (tmp_path / "demo" / "dilocod.log").read_text()
    assert "main: stopped step=1 exit_code=0" in log, log[-2000:]

