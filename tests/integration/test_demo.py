"""`make demo DEMO_ROUNDS=3` runs non-interactively, trains a real model through dilocod with
PyTorch workers, and its output shows the loss falling.  From a terminal (a pty here) the dashboard
keeps being served until Ctrl-C; without one the demo says that the dashboard stops with it; a busy
port is refused up front with the DEMO_PORT to use."""
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
    assert re.search(r"dashboard: http://127\.0\.0\.1:\d+/", out), out
    assert "not a terminal: the demo ends now and dilocod stops with it" in out, out
    # every process the demo started is gone, and dilocod stopped cleanly
    log = (tmp_path / "demo" / "dilocod.log").read_text()
    assert "main: stopped step=3 exit_code=0" in log, log[-2000:]


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

