"""The diloco CLI as the worker's HTTP client: a training over HTTP where every worker uses only
`diloco pull`, `diloco delta`, `diloco push`, `diloco wait`; plus retries, exit codes and `status`."""
import json
import re
import socket
import subprocess
import threading
import time

import numpy as np
import torch

from conftest import run
from dilocod_proc import Dilocod, Oracle, assert_state_close, load_torch, write_model

TOKENS = "w0 token-for-worker-0000\nw1 token-for-worker-1111\nw2 token-for-worker-2222\n"


def model():
    g = torch.Generator().manual_seed(3)
    return {"layer.weight": torch.randn(16, 8, generator=g), "layer.bias": torch.randn(8, generator=g),
            "emb": torch.randn(10, 4, generator=g).to(torch.bfloat16), "count": torch.tensor([3])}


def worker(diloco_bin, tmp, url, node, rounds, results, seed):
    """pull -> 'train' (perturb) -> delta -> push -> wait, with nothing but the CLI."""
    from safetensors.torch import save_file
    rng = torch.Generator().manual_seed(seed)
    d = tmp / node
    d.mkdir()
    for r in range(rounds):
        run([diloco_bin, "pull", "--server", url, "-o", d / "global"], check=0)
        step = json.loads((d / "global" / "step_count.json").read_text())["outer_step"]
        assert step == r, (node, step, r)
        base = load_torch(d / "global" / "latest.safetensors")
        trained = {k: (v + 0.01 * torch.randn(v.shape, generator=rng).to(v.dtype)) if v.is_floating_point() else v
                   for k, v in base.items()}
        save_file(trained, str(d / "trained.safetensors"))
        out = d / f"delta_{r}.safetensors"
        run([diloco_bin, "delta", "--baseline", d / "global" / "latest.safetensors", "--current",
             d / "trained.safetensors", "--node-id", node, "--base-step", str(r), "--local-step", str(100 * (r + 1)),
             "-o", out], check=0)
        p = run([diloco_bin, "push", "--server", url, "--token-file", tmp / "tokens", out], check=0)
        answer = json.loads(p.stdout)
        assert answer["result"] == "accepted" and answer["node_id"] == node, answer
        results.setdefault(r, {})[node] = out
        run([diloco_bin, "wait", "--server", url, "--step", str(r + 1), "--timeout", "60"], check=0)


def test_training_with_the_cli_only(tmp_path, diloco_bin):
    m = model()
    write_model(tmp_path / "init.safetensors", m)
    (tmp_path / "tokens").write_text(TOKENS)
    (tmp_path / "tokens").chmod(0o600)      # dilocod refuses a token file others can read
    d = Dilocod(tmp_path, None, "--init-model", tmp_path / "init.safetensors", "--expected-nodes", "3",
                "--token-file", tmp_path / "tokens").start()
    results, errors = {}, []
    try:
        url = d.url

        def guarded(node, seed):
            try:
                worker(diloco_bin, tmp_path, url, node, 3, results, seed)
            except BaseException as e:   # surfaced below
                errors.append(e)
        threads = [threading.Thread(target=guarded, args=(f"w{i}", i)) for i in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        assert not errors, errors
        # the oracle from the very deltas the CLI computed and pushed
        from safetensors.numpy import load_file
        oracle = Oracle(m)
        for r in range(3):
            oracle.step({n: load_file(str(p)) for n, p in results[r].items()})
        got = subprocess.run(["curl", "-sf", f"{url}/global/latest.safetensors", "-o",
                              str(tmp_path / "final.safetensors")], check=True)
        assert got.returncode == 0
        assert_state_close(load_torch(tmp_path / "final.safetensors"), oracle.state)
        text = run([diloco_bin, "status", "--server", url], check=0).stdout
        assert "outer step: 3" in text and "last round: step 2 -> 3, 3 nodes" in text, text
        js = json.loads(run([diloco_bin, "status", "--server", url, "--json"], check=0).stdout)
        assert js["outer_step"] == 3 and len(js["last_round"]["nodes"]) == 3
        # the worker last pulled step 2: one pull fetches step 3, the next is a no-op (304)
        p = run([diloco_bin, "pull", "--server", url, "-o", tmp_path / "w0" / "global"], check=0)
        assert p.stdout.strip() == "step 3 downloaded", p.stdout
        p = run([diloco_bin, "pull", "--server", url, "-o", tmp_path / "w0" / "global"], check=0)
        assert p.stdout.strip() == "step 3 (unchanged)", p.stdout
        assert (tmp_path / "w0" / "global" / "latest.safetensors").read_bytes() == \
            (tmp_path / "final.safetensors").read_bytes()
    finally:
        assert d.stop() == 0


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def test_push_exit_codes_and_retries(tmp_path, diloco_bin):
    m = model()
    write_model(tmp_path / "init.safetensors", m)
    # a valid delta for step 0
    from safetensors.torch import save_file
    save_file({k: v + 0.5 if v.is_floating_point() else v for k, v in m.items()}, str(tmp_path / "cur.safetensors"))
    delta = tmp_path / "d.safetensors"
    run([diloco_bin, "delta", "--baseline", tmp_path / "init.safetensors", "--current", tmp_path / "cur.safetensors",
         "--node-id", "w0", "--base-step", "0", "--local-step", "1", "-o", delta], check=0)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    # nobody listens: connection errors are retried, then exit 4
    t0 = time.time()
    p = run([diloco_bin, "push", "--server", url, "--retries", "2", delta])
    assert p.returncode == 4 and "retrying" in p.stderr, (p.returncode, p.stderr)
    assert time.time() - t0 >= 0.5
    # the server comes up while push is retrying: the upload succeeds
    d = Dilocod(tmp_path, None, "--init-model", tmp_path / "init.safetensors", "--expected-nodes", "2",
                "--listen", f"127.0.0.1:{port}")
    pusher = subprocess.Popen([str(diloco_bin), "push", "--server", url, "--retries", "8", str(delta)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    time.sleep(1.0)
    d.start()
    try:
        out, err = pusher.communicate(timeout=120)
        assert pusher.returncode == 0, (out, err)
        assert json.loads(out)["result"] == "accepted"
        # a 4xx is never retried: the same delta again is not newer -> exit 1 at once
        t0 = time.time()
        p = run([diloco_bin, "push", "--server", url, "--retries", "5", delta])
        assert p.returncode == 1 and "not_newer" in p.stdout and time.time() - t0 < 5, (p.returncode, p.stdout)
        # an invalid file is refused locally, before any request
        (tmp_path / "junk.safetensors").write_bytes(b"\x04\x00\x00\x00\x00\x00\x00\x00{}  ")
        p = run([diloco_bin, "push", "--server", url, tmp_path / "junk.safetensors"])
        assert p.returncode == 1, p.stderr
        # usage errors
        assert subprocess.run([str(diloco_bin), "push", str(delta)], env={"PATH": "/usr/bin"}).returncode == 2
        assert run([diloco_bin, "wait", "--server", url, "--step", "x"]).returncode == 2
        p = run([diloco_bin, "wait", "--server", url, "--step", "1", "--timeout", "0.5"])
        assert p.returncode == 5, p
    finally:
        assert d.stop() == 0


def test_pull_before_any_global_says_why_while_it_waits(tmp_path, diloco_bin):
    """No global yet: each retry of `diloco pull` prints the server's code and reason, the last
    message keeps them too, and nothing is saved as the model."""
    hub = tmp_path / "emptyhub"
    hub.mkdir()
    d = Dilocod(tmp_path, hub, "--expected-nodes", "1").start()
    try:
        url = f"http://127.0.0.1:{d.port}"
        p = run([diloco_bin, "pull", "--server", url, "-o", tmp_path / "out", "--retries", "2"], check=4)
        retries = [l for l in p.stderr.splitlines() if "retrying in" in l]
        assert len(retries) == 2, p.stderr
        assert all("HTTP 503 no_global: no global model yet" in l for l in retries), p.stderr
        last = p.stderr.strip().splitlines()[-1]
        assert "503" in last and "no_global" in last and "no global model yet" in last, p.stderr
        assert not (tmp_path / "out" / "latest.safetensors").exists()
        assert d.stop() == 0
    finally:
        if d.alive():
            d.kill9()


def test_push_prints_the_recommended_local_steps_of_an_async_dilocod(tmp_path, diloco_bin):
    """Against --mode async, once dilocod has measured the node (two of its deltas), the upload answer
    carries X-Recommended-Local-Steps and `diloco push` prints it as "recommended_local_steps"."""
    from safetensors.torch import save_file
    m = model()
    write_model(tmp_path / "init.safetensors", m)
    d = Dilocod(tmp_path, None, "--init-model", tmp_path / "init.safetensors", "--expected-nodes", "1",
                "--mode", "async", "--grace-ms", "0").start()
    try:
        url = d.url
        answers = []
        for i in range(3):
            run([diloco_bin, "pull", "--server", url, "-o", tmp_path / "global"], check=0)
            step = json.loads((tmp_path / "global" / "step_count.json").read_text())["outer_step"]
            base = load_torch(tmp_path / "global" / "latest.safetensors")
            save_file({k: v + 0.01 if v.is_floating_point() else v for k, v in base.items()},
                      str(tmp_path / "cur.safetensors"))
            delta = tmp_path / f"delta_{i}.safetensors"
            run([diloco_bin, "delta", "--baseline", tmp_path / "global" / "latest.safetensors", "--current",
                 tmp_path / "cur.safetensors", "--node-id", "w0", "--base-step", str(step),
                 "--local-step", str(10 * (i + 1)), "-o", delta], check=0)
            answers.append(json.loads(run([diloco_bin, "push", "--server", url, delta], check=0).stdout))
            run([diloco_bin, "wait", "--server", url, "--step", str(i + 1), "--timeout", "60"], check=0)
        # nothing measured at the first answer: no recommendation, and the answer is the server's own
        assert answers[0]["result"] == "accepted" and "recommended_local_steps" not in answers[0], answers
        node = d.get_json("/status")["async"]["nodes"][0]
        assert node["node_id"] == "w0" and node["steps_per_delta"] == 10, node
        # the only node is the fastest: its own steps per delta (H_base) are recommended back
        assert answers[-1]["result"] == "accepted" and answers[-1]["recommended_local_steps"] == 10, answers
        assert node["recommended_local_steps"] == 10, node
        # diloco status speaks async: updates and the nodes' recommendations, not rounds of N nodes
        text = run([diloco_bin, "status", "--server", url], check=0).stdout
        assert "async: 3 updates" in text and "nodes delivered" not in text and "last round" not in text, text
        assert re.search(r"w0 +3 deltas, last local step 30, 10 steps per delta, recommended 10", text), text
        assert "last update: step 2 -> 3, 1 deltas" in text, text
    finally:
        assert d.stop() == 0


def test_push_takes_every_encoding_and_says_stale(tmp_path, diloco_bin):
    """diloco push checks a delta against itself before it sends a byte: a compressed delta's scales are
    not model keys (it used to refuse every compressed delta with key_mismatch "....__scales__"), so each
    encoding is uploaded and accepted; a stale compressed delta gets the server's 409 stale, not a key
    mismatch."""
    from safetensors.torch import save_file
    m = model()
    write_model(tmp_path / "init.safetensors", m)
    d = Dilocod(tmp_path, None, "--init-model", tmp_path / "init.safetensors", "--expected-nodes", "1").start()
    try:
        url = d.url
        for i, enc in enumerate(["none", "int8_block", "mxfp8", "mxfp4"]):
            run([diloco_bin, "pull", "--server", url, "-o", tmp_path / "global"], check=0)
            step = json.loads((tmp_path / "global" / "step_count.json").read_text())["outer_step"]
            assert step == i
            base = load_torch(tmp_path / "global" / "latest.safetensors")
            save_file({k: v + 0.01 if v.is_floating_point() else v for k, v in base.items()},
                      str(tmp_path / "cur.safetensors"))
            delta = tmp_path / f"delta_{i}.safetensors"
            args = [diloco_bin, "delta", "--baseline", tmp_path / "global" / "latest.safetensors", "--current",
                    tmp_path / "cur.safetensors", "--node-id", "w0", "--base-step", str(step),
                    "--local-step", str(10 * (i + 1)), "-o", delta]
            if enc != "none":
                args[2:2] = ["--encode", enc]
            run(args, check=0)
            p = run([diloco_bin, "push", "--server", url, delta], check=None)
            assert p.returncode == 0, (enc, p.stdout, p.stderr)
            assert json.loads(p.stdout)["result"] == "accepted", (enc, p.stdout)
            run([diloco_bin, "wait", "--server", url, "--step", str(i + 1), "--timeout", "60"], check=0)
        # the int8_block delta of step 1, pushed again under a new local step, is stale now
        stale = tmp_path / "stale.safetensors"
        run([diloco_bin, "delta", "--encode", "int8_block", "--baseline", tmp_path / "global" / "latest.safetensors",
             "--current", tmp_path / "cur.safetensors", "--node-id", "w0", "--base-step", "1",
             "--local-step", "99", "-o", stale], check=0)
        p = run([diloco_bin, "push", "--server", url, stale], check=None)
        assert p.returncode != 0 and "stale" in (p.stdout + p.stderr), (p.stdout, p.stderr)
        assert "key_mismatch" not in (p.stdout + p.stderr), (p.stdout, p.stderr)
    finally:
        assert d.stop() == 0
