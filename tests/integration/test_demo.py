"""`make demo DEMO_ROUNDS=3` runs non-interactively, trains a real model through dilocod with
PyTorch workers, and its output shows the loss falling."""
import re
import subprocess

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
