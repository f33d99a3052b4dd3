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
