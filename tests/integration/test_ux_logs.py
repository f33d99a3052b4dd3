"""`--log-format json`: every line dilocod writes is one JSON object (parsed here with Python's json),
numbers are JSON numbers, booleans JSON booleans, strings stay strings (escaped), from a real run: a
bootstrap published to a file:// hub, one round over HTTP, a refused delta, a clean stop."""
import json
import re
import signal
import subprocess
import time

import numpy as np
import requests
import torch
from safetensors.numpy import save as np_save

from conftest import BUILD
from dilocod_proc import delta_metadata, random_deltas, write_model


def model():
    g = torch.Generator().manual_seed(11)
    return {"w": torch.randn(8, 4, generator=g), "b": torch.randn(4, generator=g)}


def records(log):
    text = log.read_text()
    out = []
    for line in text.splitlines():
        rec = json.loads(line)          # every line, not just the ones we look at
        assert isinstance(rec, dict), line
        out.append(rec)
    return out


def find(recs, component, msg):
    got = [r for r in recs if r["component"] == component and r["msg"] == msg]
    assert got, (component, msg, [(r["component"], r["msg"]) for r in recs])
    return got


def test_json_log_lines_have_typed_values(tmp_path):
    m = model()
    write_model(tmp_path / "init.safetensors", m)
    hub = tmp_path / "hub"
    hub.mkdir()
    log = tmp_path / "dilocod.log"
    p = subprocess.Popen([str(BUILD / "dilocod"), "--state-root", str(tmp_path / "state"), "--hub", f"file://{hub}",
                          "--listen", "127.0.0.1:0", "--init-model", str(tmp_path / "init.safetensors"),
                          "--expected-nodes", "1", "--nodes", "w1", "--poll-interval", "0.05",
                          "--log-format", "json", "--log-level", "debug"],
                         stdout=subprocess.DEVNULL, stderr=open(log, "wb"))
    try:
        deadline = time.time() + 30
        port = None
        while port is None:
            assert p.poll() is None and time.time() < deadline, log.read_text()[-3000:]
            for line in log.read_text().splitlines():
                rec = json.loads(line)
                if rec["component"] == "http" and rec["msg"] == "listening":
                    port = rec["port"]
            time.sleep(0.05)
        assert isinstance(port, int) and not isinstance(port, bool) and 0 < port < 65536, port
        url = f"http://127.0.0.1:{port}"
        s = requests.Session()
        s.trust_env = False
        blob = np_save(random_deltas(np.random.default_rng(1), m), metadata=delta_metadata("w1", 0, 7))
        r = s.put(f"{url}/nodes/w1/delta_7.safetensors", data=blob, timeout=30)
        assert r.status_code == 201, r.text
        deadline = time.time() + 30
        while s.get(url + "/status", timeout=10).json()["outer_step"] != 1:
            assert time.time() < deadline
            time.sleep(0.05)
        # the same delta again: refused as stale (a string code and message in the log)
        r = s.put(f"{url}/nodes/w1/delta_7.safetensors", data=blob, timeout=30)
        assert r.status_code == 409, r.text
    finally:
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=60) == 0, log.read_text()[-3000:]

    recs = records(log)
    for rec in recs:
        assert isinstance(rec["ts"], str) and re.match(r"\d{4}-\d\d-\d\dT", rec["ts"]), rec
        assert rec["level"] in ("error", "warn", "info", "debug"), rec
        # no field holds a number or a boolean spelled as a string: "step":"0" was the bug
        for k, v in rec.items():
            if isinstance(v, str) and k not in ("msg", "ts"):
                assert not re.fullmatch(r"-?\d+(\.\d+)?([eE][+-]?\d+)?|true|false", v), (k, v, rec)

    closed = find(recs, "round", "closed")[0]
    assert closed["step"] == 0 and type(closed["step"]) is int, closed
    assert closed["nodes"] == 1 and closed["expected"] == 1, closed
    assert isinstance(closed["reason"], str), closed
    done = find(recs, "aggregate", "done")[0]
    assert any(isinstance(v, float) for v in done.values()), done
    committed = [r for r in find(recs, "store", "committed") if r["step"] == 1]
    assert committed and isinstance(committed[0]["global"], str), committed
    boot = [r for r in find(recs, "hub", "published") if r["step"] == 0]
    assert boot and boot[0]["bootstrap"] is True and isinstance(boot[0]["hub"], str), boot
    refused = find(recs, "http", "upload refused")[0]
    assert refused["status"] == 409 and refused["code"] == "stale" and refused["node"] == "w1", refused
    assert "base_outer_step 0 is stale" in refused["error"], refused
    accepted = find(recs, "round", "delta accepted")[0]
    assert accepted["local_step"] == 7 and accepted["bytes"] > 0, accepted
