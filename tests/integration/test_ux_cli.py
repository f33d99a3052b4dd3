"""What a person reads from the diloco CLI (issue 13): honest "nothing yet" states in `diloco status`,
state names in words, usage errors that name what is missing, a dtype refusal that does not invent the
global's dtype, and "not a safetensors file" for files made by torch.save, pickle, numpy or a text editor
(the stable error codes unchanged), in the CLI and in dilocod's log."""
import json
import pickle
import re
import subprocess
import time

import numpy as np
import requests
import torch
from safetensors.torch import save_file

from conftest import run
from dilocod_proc import Dilocod, delta_metadata, write_model


def model():
    g = torch.Generator().manual_seed(4)
    return {"w": torch.randn(6, 3, generator=g), "b": torch.randn(3, generator=g)}


def no_numbers_invented(text):
    assert "nan" not in text.lower() and "inf" not in text.lower(), text
    assert not re.search(r"round 0\b", text), text


def test_status_before_any_global_says_so_in_words(tmp_path, diloco_bin):
    hub = tmp_path / "hub"
    hub.mkdir()
    d = Dilocod(tmp_path, hub, "--expected-nodes", "2", "--nodes", "a,b").start()
    try:
        url = d.url
        p = run([diloco_bin, "status", "--server", url], check=0)
        out = p.stdout
        no_numbers_invented(out)
        assert "waiting for a global model" in out and "waiting_for_global" not in out, out
        assert "no global model yet" in out and "--init-model" in out and "global/latest.safetensors" in out, out
        assert "round: none open until there is a global model" in out, out
        assert "last round: none closed yet" in out and "nothing published yet" in out, out
        # --json stays the server's document, untouched
        js = json.loads(run([diloco_bin, "status", "--server", url, "--json"], check=0).stdout)
        assert js["outer_step"] is None and js["state"] == "waiting_for_global", js
        # `wait` waits for a step that does not exist yet without inventing one
        p = run([diloco_bin, "wait", "--server", url, "--step", "0", "--timeout", "0.3"], check=5)
        assert "step 0 not reached" in p.stderr, p.stderr
    finally:
        assert d.stop() == 0


def test_status_with_a_global_names_the_round_in_words(tmp_path, diloco_bin):
    write_model(tmp_path / "init.safetensors", model())
    d = Dilocod(tmp_path, None, "--init-model", tmp_path / "init.safetensors", "--expected-nodes", "2",
                "--nodes", "a,b").start()
    try:
        out = run([diloco_bin, "status", "--server", d.url], check=0).stdout
        assert "collecting deltas" in out and "collecting\n" not in out, out
        assert "outer step: 0\n" in out, out
        assert "round 0 (-> step 1): 0 of 2 nodes delivered (min 1)" in out, out
        assert "missing: a b" in out, out
        assert "last round: none closed yet" in out and "hub: none\n" in out, out
    finally:
        assert d.stop() == 0


def test_usage_errors_name_what_is_missing(tmp_path, diloco_bin):
    p = run([diloco_bin, "pull", "--server", "http://127.0.0.1:9"], check=2)
    assert p.stderr.startswith("diloco: missing -o DIR"), p.stderr
    p = subprocess.run([str(diloco_bin), "pull", "-o", str(tmp_path / "o")], capture_output=True, text=True,
                       env={"PATH": "/usr/bin"})
    assert p.returncode == 2 and "no server: give --server URL or set DILOCO_SERVER" in p.stderr, p.stderr
    assert not (tmp_path / "o").exists()
    p = run([diloco_bin, "push", "--server", "http://127.0.0.1:9"], check=2)
    assert p.stderr.startswith("diloco: missing DELTA"), p.stderr
    p = run([diloco_bin, "push", "--server", "http://127.0.0.1:9", "a", "b"], check=2)
    assert "unexpected argument 'b'" in p.stderr, p.stderr
    p = run([diloco_bin, "wait", "--server", "http://127.0.0.1:9"], check=2)
    assert p.stderr.startswith("diloco: missing --step N"), p.stderr
    p = run([diloco_bin, "wait", "--server", "http://127.0.0.1:9", "--step", "x"], check=2)
    assert "invalid value 'x' for --step" in p.stderr, p.stderr
    p = run([diloco_bin, "status", "--server", "http://127.0.0.1:9", "extra"], check=2)
    assert "unexpected argument 'extra'" in p.stderr, p.stderr


def test_push_of_an_f64_delta_does_not_invent_the_globals_dtype(tmp_path, diloco_bin):
    m = model()                               # F32 weights
    write_model(tmp_path / "init.safetensors", m)
    delta = tmp_path / "d.safetensors"
    save_file({k: (0.01 * torch.ones_like(v)).to(torch.float64) for k, v in m.items()}, str(delta),
              metadata=delta_metadata("a", 0, 1))
    d = Dilocod(tmp_path, None, "--init-model", tmp_path / "init.safetensors", "--expected-nodes", "1").start()
    try:
        p = run([diloco_bin, "push", "--server", d.url, delta], check=1)
        assert "dtype_mismatch" in p.stderr and "dtype F64" in p.stderr, p.stderr
        assert "F64 weight" not in p.stderr, p.stderr
        # the server, which has the global, names its dtype: F32
        s = requests.Session()
        s.trust_env = False
        r = s.put(f"{d.url}/nodes/a/delta_1.safetensors", data=delta.read_bytes(), timeout=30)
        assert r.status_code == 422 and r.json()["error"]["code"] == "dtype_mismatch", r.text
        assert "F32 weight" in r.json()["error"]["message"], r.text
    finally:
        assert d.stop() == 0


def foreign_files(tmp_path):
    """Files a person may hand us instead of safetensors, made by their real tools."""
    out = {}
    torch.save(model(), tmp_path / "ckpt.pt")
    out["torch.save"] = (tmp_path / "ckpt.pt", "ZIP archive")
    with open(tmp_path / "state.pkl", "wb") as f:
        pickle.dump({"w": list(range(100))}, f, protocol=4)
    out["pickle"] = (tmp_path / "state.pkl", "Python pickle")
    np.save(tmp_path / "arr.npy", np.zeros(64, dtype=np.float32))
    out["numpy"] = (tmp_path / "arr.npy", "NumPy .npy")
    (tmp_path / "notes.txt").write_text("these are not weights, just some text\n")
    out["text"] = (tmp_path / "notes.txt", 'text ("these ar")')
    return out


def test_not_a_safetensors_file(tmp_path, diloco_bin):
    for tool, (path, kind) in foreign_files(tmp_path).items():
        p = run([diloco_bin, "inspect", path], check=1)
        assert "not a safetensors file" in p.stderr and kind in p.stderr, (tool, p.stderr)
        assert re.search(r"\d{12}", p.stderr) is None, (tool, p.stderr)     # no 19-digit "header length"
        assert "header_too_large" in p.stderr, (tool, p.stderr)              # the stable code is kept
        js = json.loads(run([diloco_bin, "inspect", "--json", path], check=1).stdout)
        assert js["error"]["code"] == "header_too_large" and "not a safetensors file" in js["error"]["message"], js
        p = run([diloco_bin, "push", "--server", "http://127.0.0.1:9", "--retries", "0", path], check=1)
        assert "not a safetensors file" in p.stderr, (tool, p.stderr)
    # a length that is merely beyond the file: perhaps cut short
    (tmp_path / "cut.safetensors").write_bytes((500).to_bytes(8, "little") + b'{"__metadata__":{}}')
    p = run([diloco_bin, "inspect", tmp_path / "cut.safetensors"], check=1)
    assert "invalid_header_length: not a safetensors file, or a truncated one" in p.stderr, p.stderr
    assert "header of 500 bytes, the file has 27" in p.stderr, p.stderr


def test_dilocod_says_a_text_global_is_not_safetensors(tmp_path):
    """A Git LFS pointer (text) where the hub's global belongs: dilocod's log says what the file is, not a
    19-digit header length, and dilocod keeps running without a global."""
    hub = tmp_path / "hub"
    (hub / "global").mkdir(parents=True)
    (hub / "global" / "latest.safetensors").write_text("version https://git-lfs.github.com/spec/v1\noid sha256:0\n")
    (hub / "global" / "step_count.json").write_text('{"outer_step": 0}')
    d = Dilocod(tmp_path, hub, "--expected-nodes", "1").start()
    try:
        d.wait_log("not a safetensors file")
        log = d.log_text()
        assert re.search(r'code=header_too_large error="not a safetensors file: it starts with text '
                         r'\(\\"version \\"\)', log), log[-2000:]
        assert re.search(r"header too large: \d{12}", log) is None, log[-2000:]
        s = requests.Session()
        s.trust_env = False
        assert d.alive() and s.get(d.url + "/status", timeout=10).json()["outer_step"] is None
    finally:
        assert d.stop() == 0
