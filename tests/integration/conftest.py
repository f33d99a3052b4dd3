"""Shared fixtures for the integration tests: paths of the real binaries and a runner."""
import json
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BUILD = Path(os.environ.get("DILOCO_BUILD", ROOT / "build"))
# every dilocod the tests start (they inherit this environment) aborts at a move its step pipeline's
# table refuses, where the bug is, instead of stopping cleanly as a production daemon does
os.environ.setdefault("DILOCOD_TEST_STRICT_PIPELINE", "1")


PIPELINE_ERRORS = ("illegal pipeline transition", "pipeline: step not entered")


@pytest.fixture(autouse=True)
def pipeline_moves_are_legal(request):
    """After every test: no dilocod it ran made a move its step pipeline's table refuses
    (server/core/pipeline.c logs one at error level; it is a bug in the daemon whatever the test)."""
    tmp = request.getfixturevalue("tmp_path") if "tmp_path" in request.fixturenames else None
    yield
    if tmp is None:
        return
    for log in tmp.rglob("*.log"):
        try:
            text = log.read_text(errors="replace")
        except OSError:
            continue
        bad = [ln for ln in text.splitlines() if any(e in ln for e in PIPELINE_ERRORS)]
        assert not bad, f"{log}:\n" + "\n".join(bad[:10])


def _binary(name: str) -> Path:
    path = BUILD / name
    if not path.exists():
        raise RuntimeError(f"{path} is missing: run `make` first (or `make check`)")
    return path


@pytest.fixture(scope="session")
def diloco_bin() -> Path:
    return _binary("diloco")


@pytest.fixture(scope="session")
def st_write_bin() -> Path:
    return _binary("tests/st-write")


def run(args, check=None, **kw):
    """Runs a command, returns CompletedProcess with text output.  check=N asserts the exit code."""
    p = subprocess.run([str(a) for a in args], capture_output=True, text=True, timeout=600, **kw)
    if check is not None:
        assert p.returncode == check, (
            f"{args} exited {p.returncode}, expected {check}\nstdout:\n{p.stdout}\nstderr:\n{p.stderr}")
    return p


@pytest.fixture
def diloco(diloco_bin):
    """diloco(*args, check=0) -> CompletedProcess."""
    def _run(*args, check=None):
        return run([diloco_bin, *args], check=check)
    return _run


def inspect_json(diloco_bin, path):
    """(exit code, parsed JSON) of `diloco inspect --json --hash path`."""
    p = run([diloco_bin, "inspect", "--json", "--hash", path])
    return p.returncode, json.loads(p.stdout) if p.stdout.strip() else None
