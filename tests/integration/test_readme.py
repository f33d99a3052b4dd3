"""README.md cannot drift: every command of its ```sh / ```bash / ```console blocks and every ```python
block is run here, as written, in a temporary directory against the freshly built binaries, or is in
NOT_RUN with the reason.  A block, or a command, that is neither fails test_every_readme_command_is_covered.

What is adapted, and only that: `build/` is the build directory under test; `make` runs in the
repository with that build directory; paths the README puts in system places (/var/lib/dilocod,
/shared/diloco) and the README's addresses (aggregator:8470, localhost:8470) point into the temporary
directory and at a free port; a dilocod that serves gets `--listen` on that port; `hf_...` is the Hub
emulator's token; the s3:// example's AWS_* exports are SeaweedFS's keys and endpoint.  The demo's sample output is compared with what `make demo` prints."""
import json
import zlib
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import requests
import torch
from huggingface_hub import HfApi
from safetensors.numpy import save_file
from safetensors.torch import save_file as torch_save_file

from conftest import BUILD, ROOT
from s3server import ACCESS_KEY, SECRET_KEY, SeaweedS3

README = ROOT / "README.md"
SHELL = {"sh", "bash", "console"}
TOKENS = {f"worker-{i}": f"token-of-worker-{i}-0123456789" for i in range(1, 5)}
HUB_TOKEN = "hf_readme_test_token_0123456789"

# Commands that are not run, and why.  Keys are the README's text (continuations joined, comments cut).
WHY_SIGN = ("test_signed_rounds.py::test_signed_run_over_http_and_file runs the same steps (keygen, a signed dilocod, the records over HTTP, verify-round from local files and with --server) against a real dilocod")
NOT_RUN = {
    "diloco keygen -o /etc/dilocod/signing.key": "writes into /etc; " + WHY_SIGN,
    "dilocod --signing-key /etc/dilocod/signing.key ...": "the rest of the command line is the reader's; " + WHY_SIGN,
    "curl -s http://aggregator:8470/global/rounds/12.json": "step 12 of a run the reader has; " + WHY_SIGN,
    "S=12; U=http://aggregator:8470": "part of the verify-round example; " + WHY_SIGN,
    "curl -so m.json $U/global/rounds/$S.json; curl -so m.sig $U/global/rounds/$S.json.sig": "part of the verify-round example; " + WHY_SIGN,
    "curl -so g.safetensors $U/rounds/$((S-1))/global.safetensors; curl -so mom.safetensors $U/rounds/$((S-1))/momentum.safetensors":
        "part of the verify-round example; " + WHY_SIGN,
    "diloco verify-round --manifest m.json --signature m.sig --public-key signing.key.pub --previous-global g.safetensors --previous-momentum mom.safetensors --inputs in":
        "part of the verify-round example; " + WHY_SIGN,
    "diloco verify-round --server $U --step $S --public-key signing.key.pub": "part of the verify-round example; " + WHY_SIGN,
    "dilocod --id agg-a --state-root /var/lib/dilocod --hub s3://runs/exp-1 --hub-endpoint https://s3.example "
    "--expected-nodes 16 --cluster-shards 64 --cluster-lease 30 --listen 0.0.0.0:8080":
        "one aggregator of a cluster of many against a bucket of 16 workers; tests/integration/test_cluster.py runs "
        "K = 3 of them with these flags against SeaweedFS",
    "make check": "the test command itself: it runs this file, so a test cannot run it",
    "sudo make install PREFIX=/usr": "installs into this machine's /usr; test_deploy.py runs the same install "
                                     "into a DESTDIR and checks every installed file and the unit",
    "sudoedit /etc/dilocod/dilocod.conf": "an interactive editor",
    "sudo systemctl enable --now dilocod": "needs systemd as PID 1 (the tests run in containers); test_deploy.py "
                                           "checks the unit with systemd-analyze",
    "journalctl -u dilocod -f": "follows the journal of the service above forever",
    "docker build -f deploy/Dockerfile -t dilocod .": "no docker daemon here; tests/integration/test_container.py builds and runs the image with podman",
    "chmod 0644 init.safetensors": "part of the container example above (no docker daemon here)",
    "sudo chown 8470:8470 tokens && sudo chmod 0400 tokens": "part of the container example above (no docker daemon "
                                                            "here); test_container.py mounts the token file this way",
    "docker run -d --name dilocod -p 8470:8470 --stop-timeout 120 -v dilocod-state:/var/lib/dilocod "
    "-v $PWD/init.safetensors:/models/init.safetensors:ro -v $PWD/tokens:/run/secrets/dilocod_tokens:ro "
    "dilocod --expected-nodes 4 --init-model /models/init.safetensors --token-file /run/secrets/dilocod_tokens":
        "no docker daemon here; tests/integration/test_container.py builds and runs the image with podman",
    "docker stop dilocod": "no docker daemon here; tests/integration/test_container.py builds and runs the image with podman",
}

# The blocks the tests below run, each found by a piece of its text (test name -> anchor).
ANCHORS = {
    "test_quick_start_demo": "make demo       #",
    "test_build_and_test": "make            # build/libdiloco.a",
    "test_running_dilocod_file_hub": "--hub file:///shared/diloco",
    "test_hf_hub": "--hub hf://my-org/my-model",
    "test_s3_hub": "--hub s3://my-bucket/runs/my-model",
    "test_training_over_http_only": "build/diloco pull",
    "test_http_api_curl": "curl -s localhost:8470/status",
    "test_configuration_check": "--check-config > effective.conf",
    "test_worker_snippet": "import requests, torch",
    "test_worker_package_snippet": "worker = diloco.Worker(",
    "test_verdicts_snippet": "doc = worker.verdicts()",
    "test_sharded_global_loader": "def load_global(d):",
}


# ---- reading the README -----------------------------------------------------------------------------

def blocks():
    """[(language, first line number, text)] of every fenced block."""
    out, lang, start, buf = [], None, 0, []
    for no, line in enumerate(README.read_text().splitlines(), 1):
        if line.startswith("```"):
            if lang is None:
                lang, start, buf = line[3:].strip() or "text", no + 1, []
            else:
                out.append((lang, start, "\n".join(buf)))
                lang = None
        elif lang is not None:
            buf.append(line)
    return out


def commands(text):
    """The commands of a shell block: continuations joined, comment lines and trailing comments cut."""
    out, cur = [], ""
    for line in text.splitlines():
        cur += line.rstrip()
        if cur.endswith("\\"):
            cur = cur[:-1] + " "
            continue
        cmd, cur = cut_comment(cur), ""
        if cmd:
            out.append(" ".join(cmd.split()))
    return out


def cut_comment(line):
    """line without a trailing `# ...` comment (a # outside quotes, at a word start)."""
    quote = None
    for i, ch in enumerate(line):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1] in " \t"):
            return line[:i].strip()
    return line.strip()


def block(test_name):
    anchor = ANCHORS[test_name]
    found = [b for b in blocks() if anchor in b[2]]
    assert len(found) == 1, f"README: {len(found)} blocks hold {anchor!r} (the anchor of {test_name})"
    return found[0]


def block_commands(test_name):
    lang, _, text = block(test_name)
    assert lang in SHELL, (test_name, lang)
    return [c for c in commands(text) if c not in NOT_RUN]


def test_every_readme_command_is_covered():
    anchored = {block(t)[1] for t in ANCHORS}
    loose = []
    for lang, line, text in blocks():
        if lang == "python" and line not in anchored:
            loose.append(f"README.md:{line}: a python block no test runs")
        if lang in SHELL and line not in anchored:
            loose += [f"README.md:{line}: {c}" for c in commands(text) if c not in NOT_RUN]
    assert not loose, "README commands that no test runs (add them to a test, or to NOT_RUN with the reason):\n" + \
        "\n".join(loose)
    every = {c for lang, _, text in blocks() if lang in SHELL for c in commands(text)}
    stale = sorted(set(NOT_RUN) - every)
    assert not stale, f"NOT_RUN lists commands the README no longer has: {stale}"


# ---- running commands -------------------------------------------------------------------------------

def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Ctx:
    def __init__(self, tmp: Path):
        self.tmp = tmp
        self.port = free_port()
        self.env = dict(os.environ, PATH=os.environ.get("PATH", "/usr/bin:/bin"))
        self.daemons = []

    @property
    def url(self):
        return f"http://127.0.0.1:{self.port}"

    def adapt(self, cmd):
        cmd = re.sub(r"(?<![\w/.])build/", f"{BUILD}/", cmd)
        cmd = cmd.replace("/var/lib/dilocod", str(self.tmp / "state"))
        cmd = cmd.replace("file:///shared/diloco", f"file://{self.tmp}/shared")
        cmd = re.sub(r"(?<![\w/:])/shared/diloco", f"{self.tmp}/shared", cmd)     # mkdir -p /shared/diloco
        cmd = cmd.replace("http://aggregator:8470", self.url).replace("localhost:8470", f"127.0.0.1:{self.port}")
        cmd = cmd.replace("config/dilocod.conf", str(ROOT / "config/dilocod.conf"))
        if cmd == "make" or cmd.startswith("make "):
            extra = f" DEMO_PORT=0 DEMO_DIR={self.tmp}/demo" if " demo" in cmd else ""
            cmd = f"make -C {ROOT} --no-print-directory BUILD={BUILD}{extra}" + cmd[4:]
        if re.match(rf"{re.escape(str(BUILD))}/dilocod ", cmd) and "--check-config" not in cmd:
            cmd += f" --listen 127.0.0.1:{self.port}"
        return cmd

    def run(self, cmd, timeout=600):
        """One README command: exports change the environment, a serving dilocod runs in the background,
        anything else must exit 0.  Returns its stdout."""
        m = re.fullmatch(r"export (\w+)=(\S+)", cmd)
        if m:
            self.env[m.group(1)] = HUB_TOKEN if m.group(2) == "hf_..." else m.group(2)
            return ""
        real = self.adapt(cmd)
        if real.startswith(f"{BUILD}/dilocod ") and "--check-config" not in real:
            log = self.tmp / f"dilocod-{len(self.daemons)}.log"
            proc = subprocess.Popen(["bash", "-c", "exec " + real], cwd=self.tmp, env=self.env,
                                    stdout=subprocess.DEVNULL, stderr=open(log, "wb"))
            self.daemons.append((proc, log))
            self.wait(lambda: "http: listening" in log.read_text(), f"dilocod listening ({cmd})", proc, log)
            return ""
        p = subprocess.run(["bash", "-c", "set -euo pipefail\n" + real], cwd=self.tmp, env=self.env,
                           capture_output=True, text=True, timeout=timeout)
        assert p.returncode == 0, f"README command failed: {cmd}\nran: {real}\nexit {p.returncode}\n" \
                                  f"stdout:\n{p.stdout[-3000:]}\nstderr:\n{p.stderr[-3000:]}"
        return p.stdout

    def wait(self, cond, what, proc=None, log=None, timeout=120):
        deadline = time.time() + timeout
        while not cond():
            if proc is not None and proc.poll() is not None:
                raise AssertionError(f"exited {proc.returncode} while waiting for {what}:\n{log.read_text()[-3000:]}")
            assert time.time() < deadline, f"no {what}:\n{self.logs()[-3000:]}"
            time.sleep(0.05)

    def logs(self):
        return "".join(log.read_text() for _, log in self.daemons)

    def status(self):
        return requests.get(f"{self.url}/status", timeout=10).json()

    def stop(self):
        for proc, log in self.daemons:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=60) == 0, log.read_text()[-3000:]


@pytest.fixture
def ctx(tmp_path):
    c = Ctx(tmp_path)
    try:
        yield c
    finally:
        for proc, _ in c.daemons:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def init_model(path):
    rng = np.random.default_rng(0)
    save_file({"w": rng.standard_normal((4, 8), dtype=np.float32), "b": np.zeros(8, dtype=np.float32)}, str(path))
    return path


def delta(path, node, base, local, scale=0.01):
    rng = np.random.default_rng(zlib.crc32(f"{node}/{local}".encode()))
    meta = {"algorithm": "dumb_diloco", "base_outer_step": str(base), "local_step": str(local), "node_id": node}
    tmp = path.with_name(path.name + ".tmp")
    save_file({"w": (rng.standard_normal((4, 8)) * scale).astype(np.float32),
               "b": (rng.standard_normal(8) * scale).astype(np.float32)}, str(tmp), metadata=meta)
    tmp.rename(path)                    # written aside and renamed, as the README tells workers to
    return path


def token_file(path):
    path.write_text("".join(f"{n} {t}\n" for n, t in TOKENS.items()))
    path.chmod(0o600)           # dilocod refuses a token file others can read
    return path


# ---- the blocks -----------------------------------------------------------------------------------

def test_quick_start_demo(ctx):
    """`make demo` runs, and prints what the README shows (the aggregation times and port aside)."""
    (cmd,) = block_commands("test_quick_start_demo")
    out = ctx.run(cmd, timeout=1800)
    intro = README.read_text().split("You see:", 1)[1]
    sample = [b for b in blocks() if b[0] == "text" and b[2] in intro][0][2]
    for line in sample.splitlines():
        if line == "...":
            continue
        pattern = re.escape(line)
        pattern = re.sub(r"127\\\.0\\\.0\\\.1:8470", r"127\\.0\\.0\\.1:\\d+", pattern)
        pattern = re.sub(r"aggregation\\ [\d.\\]+\\ ms", r"aggregation\\ [\\d.]+\\ ms", pattern)
        assert re.search(rf"^{pattern}$", out, re.M), f"README's sample line is not what the demo printed:\n" \
                                                       f"{line}\n--- the demo printed:\n{out}"


def test_build_and_test(ctx):
    for cmd in block_commands("test_build_and_test"):
        ctx.run(cmd)
    assert (BUILD / "dilocod").is_file() and (BUILD / "diloco").is_file() and (BUILD / "libdiloco.a").is_file()


def test_running_dilocod_file_hub(ctx):
    """The file:// example: bootstraps, and 4 workers writing into the shared tree make a round."""
    init_model(ctx.tmp / "init.safetensors")
    for cmd in block_commands("test_running_dilocod_file_hub"):
        ctx.run(cmd)
    shared = ctx.tmp / "shared"
    step_file = shared / "global/step_count.json"
    ctx.wait(lambda: step_file.exists(), "step 0 published")
    for i in range(1, 5):
        (shared / f"nodes/w{i}").mkdir(parents=True, exist_ok=True)
        delta(shared / f"nodes/w{i}/delta_500.safetensors", f"w{i}", 0, 500)
    ctx.wait(lambda: json.loads(step_file.read_text()).get("outer_step") in (1, "1"), "step 1 published")
    ctx.stop()


def hubsim(tmp):
    proc = subprocess.Popen([sys.executable, str(ROOT / "tests/hubsim/hubsim.py"), "--root", str(tmp / "hubroot"),
                             "--port", "0", "--token", HUB_TOKEN],
                            stdout=subprocess.PIPE, stderr=open(tmp / "hubsim.log", "wb"), text=True)
    line = proc.stdout.readline()
    assert line.strip().isdigit(), f"hubsim did not start: {line!r}"
    return proc, f"http://localhost:{int(line)}"


def test_hf_hub(ctx):
    """The hf:// example against the Hub emulator: the init model is published to the repo as step 0."""
    proc, endpoint = hubsim(ctx.tmp)
    try:
        HfApi(endpoint=endpoint, token=HUB_TOKEN).create_repo("my-org/my-model")
        ctx.env["HF_ENDPOINT"] = endpoint
        init_model(ctx.tmp / "init.safetensors")
        for cmd in block_commands("test_hf_hub"):
            ctx.run(cmd)
        ctx.wait(lambda: re.search(r"hub: published step=0", ctx.logs()), "step 0 published to the Hub")
        files = HfApi(endpoint=endpoint, token=HUB_TOKEN).list_repo_files("my-org/my-model")
        assert "global/latest.safetensors" in files and "global/step_count.json" in files, files
        ctx.stop()
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_s3_hub(ctx):
    """The s3:// example against SeaweedFS (a real S3 server): step 0 is published into the bucket, and
    the --expected-nodes workers, putting their deltas with boto3's upload_file, make round 0 -> 1."""
    server = SeaweedS3(ctx.tmp / "s3", bucket="my-bucket").start()
    try:
        # what the example exports, with this server's values; nothing else of the machine's AWS setup
        real = {"AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
                "AWS_ENDPOINT_URL": server.endpoint}
        for k in [k for k in ctx.env if k.startswith("AWS_")]:
            del ctx.env[k]
        init_model(ctx.tmp / "init.safetensors")
        nodes = 0
        for cmd in block_commands("test_s3_hub"):
            m = re.fullmatch(r"export (\w+)=(\S+)", cmd)
            if m:
                assert m.group(1) in real, f"README exports {m.group(1)}: the test does not know its value"
                ctx.env[m.group(1)] = real[m.group(1)]
                continue
            if "--expected-nodes" in cmd:
                nodes = int(re.search(r"--expected-nodes (\d+)", cmd).group(1))
            ctx.run(cmd)
        assert nodes >= 1, "the s3:// example starts no dilocod"
        s3 = server.client()
        prefix = re.search(r"--hub s3://my-bucket/(\S+)", block("test_s3_hub")[2]).group(1)

        def step():
            try:
                body = s3.get_object(Bucket="my-bucket", Key=f"{prefix}/global/step_count.json")["Body"].read()
            except s3.exceptions.NoSuchKey:
                return None
            return json.loads(body)["outer_step"]

        ctx.wait(lambda: step() in (0, "0"), "step 0 published into the bucket")
        init = s3.get_object(Bucket="my-bucket", Key=f"{prefix}/global/latest.safetensors")["Body"].read()
        assert init == (ctx.tmp / "init.safetensors").read_bytes()
        for i in range(1, nodes + 1):
            path = delta(ctx.tmp / f"s3-delta-{i}.safetensors", f"w{i}", 0, 500)
            s3.upload_file(str(path), "my-bucket", f"{prefix}/nodes/w{i}/delta_500.safetensors")
        ctx.wait(lambda: step() in (1, "1"), "step 1 published into the bucket")
        status = ctx.status()
        assert status["outer_step"] == 1 and status["hub"]["kind"] == "s3", status
        assert status["last_round"]["nodes"] and len(status["last_round"]["nodes"]) == nodes, status
        ctx.stop()
    finally:
        server.stop()


def test_training_over_http_only(ctx):
    """dilocod --hub none, and one worker's round with the CLI (the other 3 nodes push alongside)."""
    init_model(ctx.tmp / "init.safetensors")
    token_file(ctx.tmp / "tokens")
    delta(ctx.tmp / "delta.safetensors", "worker-1", 0, 100)
    ctx.env["STEP"] = "0"
    for cmd in block_commands("test_training_over_http_only"):
        if " wait " in cmd:
            # the round needs all 4 expected nodes: the other workers deliver before this one waits
            for i in (2, 3, 4):
                ctx.run(f"build/diloco push --server http://aggregator:8470 --token-file tokens "
                        f"{delta(ctx.tmp / f'd{i}.safetensors', f'worker-{i}', 0, 100)}")
        ctx.run(cmd)
    assert (ctx.tmp / "global/latest.safetensors").is_file()
    assert ctx.status()["outer_step"] == 1
    ctx.stop()


def test_http_api_curl(ctx):
    """The curl examples against a dilocod with a token file: status, download, a conditional GET, an upload."""
    init_model(ctx.tmp / "init.safetensors")
    token_file(ctx.tmp / "tokens")
    ctx.run("build/dilocod --state-root ./state --init-model init.safetensors --expected-nodes 4 --token-file tokens")
    delta(ctx.tmp / "delta_500.safetensors", "worker-1", 0, 500)
    ctx.env["TOKEN"] = TOKENS["worker-1"]
    outs = [ctx.run(cmd) for cmd in block_commands("test_http_api_curl")]
    assert any('"outer_step": 0' in o for o in outs), outs
    assert any(re.search(r"^X-Outer-Step: 0\s*$", o, re.M | re.I) for o in outs), outs
    assert (ctx.tmp / "global.safetensors").stat().st_size > 0
    assert any(o.strip() == "200" for o in outs), outs          # the README's ETag is not the current one
    assert ctx.status()["counters"]["accepted"] == 1, outs
    ctx.stop()


def test_configuration_check(ctx):
    for cmd in block_commands("test_configuration_check"):
        ctx.run(cmd)
    text = (ctx.tmp / "effective.conf").read_text()
    assert re.search(r"^expected_nodes = 4$", text, re.M), text


class MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 8)
        self.out = torch.nn.Linear(8, 2)


def test_worker_snippet(ctx):
    """The Python worker core, as written, against a real dilocod: one round with a second node."""
    lang, _, snippet = block("test_worker_snippet")
    assert lang == "python"
    torch.manual_seed(0)
    torch_save_file(MLP().state_dict(), str(ctx.tmp / "init.safetensors"))
    token_file(ctx.tmp / "tokens")
    (ctx.tmp / "token").write_text(TOKENS["worker-1"] + "\n")
    ctx.run("build/dilocod --state-root ./state --init-model init.safetensors --expected-nodes 2 --token-file tokens")
    # what the snippet takes as given: a model, H inner steps and the local step count
    prelude = ("import torch\n" + "\n".join(
        ["class MLP(torch.nn.Module):", "    def __init__(self):", "        super().__init__()",
         "        self.fc = torch.nn.Linear(4, 8)", "        self.out = torch.nn.Linear(8, 2)"]) +
        "\nmodel = MLP()\nH = 2\nlocal_step = 0\n")
    script = ctx.tmp / "worker.py"
    script.write_text(prelude + snippet.replace("http://aggregator:8470", ctx.url))
    proc = subprocess.Popen([sys.executable, str(script)], cwd=ctx.tmp, env=ctx.env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        # the snippet's delta is in the round; the round closes only with a second node, so the snippet
        # is in its wait loop (time.sleep) when the other node delivers
        ctx.wait(lambda: proc.poll() is not None or
                 any(r["node_id"] == "worker-1" for r in ctx.status()["round"]["received"]), "the snippet's delta")
        assert proc.poll() is None, proc.stdout.read()
        sd = MLP().state_dict()
        meta = {"algorithm": "dumb_diloco", "base_outer_step": "0", "local_step": "2", "node_id": "worker-2"}
        torch_save_file({k: torch.zeros_like(v) for k, v in sd.items()}, str(ctx.tmp / "w2.safetensors"), metadata=meta)
        ctx.run(f"build/diloco push --server http://aggregator:8470 --token-file tokens {ctx.tmp}/w2.safetensors")
        assert proc.wait(timeout=120) == 0, proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()
    assert ctx.status()["outer_step"] == 1
    ctx.stop()


def test_worker_package_snippet(ctx):
    """The package's round, as written, against a real dilocod: two rounds, a second node alongside."""
    lang, _, snippet = block("test_worker_package_snippet")
    assert lang == "python"
    torch.manual_seed(0)
    torch_save_file(MLP().state_dict(), str(ctx.tmp / "init.safetensors"))
    token_file(ctx.tmp / "tokens")
    (ctx.tmp / "token").write_text(TOKENS["worker-1"] + "\n")
    ctx.run("build/dilocod --state-root ./state --init-model init.safetensors --expected-nodes 2 --token-file tokens")
    prelude = ("import torch\n" + "\n".join(
        ["class MLP(torch.nn.Module):", "    def __init__(self):", "        super().__init__()",
         "        self.fc = torch.nn.Linear(4, 8)", "        self.out = torch.nn.Linear(8, 2)"]) +
        "\nmodel = MLP()\nH = 2\nlocal_step = 0\n")
    script = ctx.tmp / "pkg_worker.py"
    script.write_text(prelude + snippet.replace("http://aggregator:8470", ctx.url))
    proc = subprocess.Popen([sys.executable, str(script)], cwd=ctx.tmp, env=ctx.env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        sd = MLP().state_dict()
        for step in (0, 1):
            # the snippet's delta is in the round, which closes only with the second node's
            ctx.wait(lambda: proc.poll() is not None or
                     (ctx.status()["outer_step"] == step and
                      any(r["node_id"] == "worker-1" for r in ctx.status()["round"]["received"])),
                     f"the snippet's delta of step {step}")
            assert proc.poll() is None, proc.stdout.read()
            meta = {"algorithm": "dumb_diloco", "base_outer_step": str(step), "local_step": str(2 * (step + 1)),
                    "node_id": "worker-2"}
            torch_save_file({k: torch.zeros_like(v) for k, v in sd.items()}, str(ctx.tmp / "w2.safetensors"),
                            metadata=meta)
            ctx.run(f"build/diloco push --server http://aggregator:8470 --token-file tokens {ctx.tmp}/w2.safetensors")
        assert proc.wait(timeout=120) == 0, proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()
    assert ctx.status()["outer_step"] == 2
    ctx.stop()


def test_verdicts_snippet(ctx):
    """What happens to my delta: the verdict snippet, as written, after a pull, against a real dilocod
    whose round takes one node: GET /nodes/<id> then says the delta was aggregated into step 1 (the
    global it made)."""
    lang, _, snippet = block("test_verdicts_snippet")
    assert lang == "python"
    torch.manual_seed(0)
    torch_save_file(MLP().state_dict(), str(ctx.tmp / "init.safetensors"))
    token_file(ctx.tmp / "tokens")
    ctx.run("build/dilocod --state-root ./state --init-model init.safetensors --expected-nodes 1 --token-file tokens")
    prelude = ("import diloco, torch\n" + "\n".join(
        ["class MLP(torch.nn.Module):", "    def __init__(self):", "        super().__init__()",
         "        self.fc = torch.nn.Linear(4, 8)", "        self.out = torch.nn.Linear(8, 2)"]) +
        f"\nmodel = MLP()\nH = 2\nworker = diloco.Worker({ctx.url!r}, 'worker-1', token={TOKENS['worker-1']!r})\n"
        "worker.pull(model)\nwith torch.no_grad():\n    model.fc.weight.add_(0.01)\n")
    epilogue = ("\nworker.wait(1)\ndoc = worker.verdicts()\n"
                "assert doc['deltas'][0]['verdict'] == 'aggregated' and doc['deltas'][0]['step'] == 1, doc\n"
                "print('verdict', doc['deltas'][0]['verdict'])\n")
    script = ctx.tmp / "verdicts.py"
    script.write_text(prelude + snippet + epilogue)
    p = subprocess.run([sys.executable, str(script)], cwd=ctx.tmp, env=ctx.env, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0 and "verdict aggregated" in p.stdout, p.stdout + p.stderr
    assert ctx.status()["outer_step"] == 1
    ctx.stop()


def test_sharded_global_loader(ctx):
    """Sharded checkpoints' safetensors-only loader, as written, on what `diloco pull` writes from a
    dilocod serving a sharded global (--shard-size below the model) and a plain one: both give the
    model huggingface_hub.load_torch_model loads."""
    from huggingface_hub import load_torch_model
    lang, _, snippet = block("test_sharded_global_loader")
    assert lang == "python"
    torch.manual_seed(1)
    model = MLP()
    torch_save_file(model.state_dict(), str(ctx.tmp / "init.safetensors"))
    ns = {}
    exec(compile(snippet, "README.md (load_global)", "exec"), ns)
    for shard_size, sharded in (("100", True), ("0", False)):
        ctx.run(f"build/dilocod --state-root ./state-{shard_size} --init-model init.safetensors --expected-nodes 2 "
                f"--shard-size {shard_size}")
        out = ctx.tmp / f"pulled-{shard_size}"
        ctx.run(f"build/diloco pull --server http://aggregator:8470 -o {out}")
        assert (out / "latest.safetensors.index.json").exists() == sharded
        got = ns["load_global"](str(out))
        want = MLP()
        load_torch_model(want, str(out), filename_pattern="latest{suffix}.safetensors")
        assert sorted(got) == sorted(want.state_dict())
        for k, v in want.state_dict().items():
            assert torch.equal(got[k], v), k
        ctx.stop()
