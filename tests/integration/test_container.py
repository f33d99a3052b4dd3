"""The container image, built and run for real.  deploy/Dockerfile is built with podman from this
checkout on a `debian:bookworm-slim` made by debootstrap from this machine's own Debian mirror
(tests/tools/container-base.sh, cached between runs: there is no registry here), then run the way its
header says, with a named volume as the state root and the model and token file mounted read-only:

- a round over HTTP from two workers that use only the `diloco` CLI equals the torch oracle's outer
  step bit for bit;
- `podman healthcheck run` (the image's HEALTHCHECK, kept by the docker image format) passes;
- no process in the container runs as root or holds a capability (its /proc, and podman's host view);
- SIGTERM stops it with exit code 0, the volume holds the committed step, and a new container on the
  same volume continues from it (a second round, momentum included, equals the oracle again).

podman runs with `--runtime runc` and deploy/containers.conf (no rlimits, no pids cgroup, cgroupfs):
crun cannot set rlimits or cgroups in this sandbox.  The test removes its containers, volume and image;
the cached base stays."""
import json
import os
import socket
import subprocess

import pytest
import torch
from safetensors.numpy import load_file
from safetensors.torch import save_file

from conftest import ROOT, run
from dilocod_proc import Oracle, assert_state_equal, load_torch, write_model

CONF = ROOT / "deploy" / "containers.conf"
ENV = dict(os.environ, CONTAINERS_CONF=str(CONF))
TAG = f"localhost/dilocod-test-{os.getpid()}:latest"
DILOCOD_UID = 8470
TOKENS = "w0 token-for-worker-0000\nw1 token-for-worker-1111\n"


def podman(*args, check=0, timeout=900):
    """podman --runtime runc ARGS with deploy/containers.conf; check=N asserts the exit code."""
    p = subprocess.run(["podman", "--runtime", "runc", *map(str, args)], capture_output=True, text=True,
                       env=ENV, timeout=timeout)
    if check is not None:
        assert p.returncode == check, (f"podman {' '.join(map(str, args))} exited {p.returncode}, expected "
                                       f"{check}\nstdout:\n{p.stdout[-4000:]}\nstderr:\n{p.stderr[-4000:]}")
    return p


@pytest.fixture(scope="module")
def image():
    """The image built from the checkout as it is now; removed afterwards (the base image stays)."""
    p = subprocess.run(["bash", str(ROOT / "tests" / "tools" / "container-base.sh")], capture_output=True,
                       text=True, env=ENV, timeout=1800)
    assert p.returncode == 0, f"container-base.sh exited {p.returncode}:\n{p.stdout}\n{p.stderr}"
    # --layers=false: no intermediate images are left behind, only the tagged result
    podman("build", "--network", "host", "--pull=never", "--format", "docker", "--layers=false",
           "-f", ROOT / "deploy" / "Dockerfile", "-t", TAG, ROOT)
    try:
        yield TAG
    finally:
        podman("rmi", "--force", TAG, check=None)


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def test_image_config_and_binaries(image, build_version):
    data = json.loads(podman("image", "inspect", image).stdout)[0]
    cfg = data["Config"]
    assert cfg["User"] == "dilocod:dilocod", cfg["User"]
    # an OCI-format build would drop HEALTHCHECK: it is kept only in the docker format
    health = data.get("Healthcheck") or {}
    assert health.get("Test", [])[:3] == ["CMD", "/usr/bin/diloco", "status"], sorted(data)
    assert "/var/lib/dilocod" in cfg["Volumes"], cfg["Volumes"]
    assert "8470/tcp" in cfg["ExposedPorts"], cfg["ExposedPorts"]
    assert cfg["StopSignal"] == "SIGTERM", cfg["StopSignal"]
    # the runtime stage's packages are enough for both binaries to load and run
    for binary in ("/usr/sbin/dilocod", "/usr/bin/diloco"):
        p = podman("run", "--rm", "--network", "none", "--entrypoint", binary, image, "--version")
        assert p.stdout.strip() == build_version[binary.rsplit("/", 1)[1]], (binary, p.stdout)


@pytest.fixture(scope="module")
def build_version():
    """What the host's build of the same checkout says it is."""
    from conftest import BUILD
    return {name: run([BUILD / name, "--version"], check=0).stdout.strip() for name in ("dilocod", "diloco")}


def model():
    g = torch.Generator().manual_seed(13)
    return {"layer.weight": torch.randn(32, 16, generator=g), "layer.bias": torch.randn(16, generator=g),
            "emb": torch.randn(20, 8, generator=g).to(torch.bfloat16), "count": torch.tensor([7])}


class Container:
    """One `podman run -d` of the image with the deployment's mounts; the API on 127.0.0.1:<port>."""

    def __init__(self, image, name, volume, tmp, port, *args):
        self.name, self.url = name, f"http://127.0.0.1:{port}"
        podman("run", "-d", "--name", name, "-p", f"127.0.0.1:{port}:8470",
               "-v", f"{volume}:/var/lib/dilocod",
               "-v", f"{tmp / 'init.safetensors'}:/models/init.safetensors:ro",
               "-v", f"{tmp / 'tokens'}:/run/secrets/dilocod_tokens:ro",
               image, "--init-model", "/models/init.safetensors",
               "--token-file", "/run/secrets/dilocod_tokens", *args)

    def logs(self) -> str:
        p = podman("logs", self.name, check=None)
        return p.stdout + p.stderr

    def wait_step(self, diloco_bin, step):
        p = run([diloco_bin, "wait", "--server", self.url, "--step", str(step), "--timeout", "120"])
        assert p.returncode == 0, (p.returncode, p.stderr, self.logs()[-4000:])

    def sigterm(self) -> int:
        """SIGTERM (the image's STOPSIGNAL) and the container's exit code."""
        podman("kill", "--signal", "TERM", self.name)
        return int(podman("wait", self.name).stdout.strip())


def worker_round(diloco_bin, tmp, url, node, step, seed) -> dict:
    """One worker's round with the CLI only: pull, 'train', diloco delta, diloco push.  The delta's
    tensors, for the oracle."""
    d = tmp / node
    d.mkdir(exist_ok=True)
    run([diloco_bin, "pull", "--server", url, "-o", d / "global"], check=0)
    assert json.loads((d / "global" / "step_count.json").read_text())["outer_step"] == step
    base = load_torch(d / "global" / "latest.safetensors")
    rng = torch.Generator().manual_seed(seed)
    trained = {k: (v + 0.01 * torch.randn(v.shape, generator=rng).to(v.dtype)) if v.is_floating_point() else v
               for k, v in base.items()}
    save_file(trained, str(d / "trained.safetensors"))
    out = d / f"delta_{step}.safetensors"
    run([diloco_bin, "delta", "--baseline", d / "global" / "latest.safetensors", "--current",
         d / "trained.safetensors", "--node-id", node, "--base-step", str(step), "--local-step",
         str(100 * (step + 1)), "-o", out], check=0)
    answer = json.loads(run([diloco_bin, "push", "--server", url, "--token-file", tmp / "tokens", out],
                            check=0).stdout)
    assert answer["result"] == "accepted" and answer["node_id"] == node, answer
    return load_file(str(out))


def fetch_global(url, path):
    subprocess.run(["curl", "-sf", f"{url}/global/latest.safetensors", "-o", str(path)], check=True, timeout=120)
    return load_torch(path)


def procs_in(name) -> list:
    """[(pid, Uid fields, Gid fields, CapEff, cmdline)] of every process in the container, read from
    its /proc by a shell the container runs (as its user)."""
    script = ('for p in /proc/[0-9]*; do [ -r "$p/status" ] || continue; '
              'printf "%s|%s|%s|%s|" "${p#/proc/}" "$(grep ^Uid: $p/status)" "$(grep ^Gid: $p/status)" '
              '"$(grep ^CapEff: $p/status)"; tr "\\0" " " < "$p/cmdline"; echo; done')
    out = podman("exec", name, "/bin/sh", "-c", script).stdout
    rows = []
    for line in out.splitlines():
        pid, uid, gid, cap, cmd = line.split("|", 4)
        rows.append((int(pid), uid.split()[1:], gid.split()[1:], cap.split()[1], cmd.strip()))
    return rows


def test_container_round_health_nonroot_sigterm_resume(image, tmp_path, diloco_bin):
    m = model()
    write_model(tmp_path / "init.safetensors", m)
    (tmp_path / "tokens").write_text(TOKENS)
    # read by the container's unprivileged user through the read-only mounts, as the Dockerfile's
    # header says to: the model made readable (safetensors writes 0600), the tokens the daemon's alone
    os.chmod(tmp_path / "init.safetensors", 0o644)
    os.chown(tmp_path / "tokens", DILOCOD_UID, DILOCOD_UID)
    os.chmod(tmp_path / "tokens", 0o400)
    volume = f"dilocod-test-state-{os.getpid()}"
    names = [f"dilocod-test-{os.getpid()}-{i}" for i in range(2)]
    podman("volume", "create", volume)
    try:
        oracle = Oracle(m)
        c = Container(image, names[0], volume, tmp_path, free_port(), "--expected-nodes", "2")
        c.wait_step(diloco_bin, 0)

        # a round over HTTP: the published global is torch's outer step on the very deltas pushed
        deltas = {n: worker_round(diloco_bin, tmp_path, c.url, n, 0, seed) for seed, n in enumerate(("w0", "w1"))}
        c.wait_step(diloco_bin, 1)
        oracle.step(deltas)
        got = fetch_global(c.url, tmp_path / "global-1.safetensors")
        assert_state_equal(got, oracle.state)

        # the image's own health check, run by podman
        podman("healthcheck", "run", c.name)
        health = json.loads(podman("inspect", c.name).stdout)[0]["State"]["Health"]
        assert health["Status"] == "healthy", health

        # nobody is root: every process's real, effective, saved and filesystem ids, and no capability
        procs = procs_in(c.name)
        assert [cmd for pid, _, _, _, cmd in procs if pid == 1][0].startswith("/usr/sbin/dilocod "), procs
        for pid, uid, gid, cap, cmd in procs:
            assert uid == [str(DILOCOD_UID)] * 4 and gid == [str(DILOCOD_UID)] * 4, (pid, uid, gid, cmd)
            assert int(cap, 16) == 0, (pid, cap, cmd)
        top = podman("top", c.name, "huser", "args").stdout.splitlines()[1:]
        assert top and all(line.split()[0] == str(DILOCOD_UID) for line in top), top

        # SIGTERM: a clean stop, and the volume holds the committed step
        assert c.sigterm() == 0, c.logs()[-4000:]
        logs = c.logs()
        assert "shutting down signal=SIGTERM" in logs and "stopped step=1 exit_code=0" in logs, logs[-4000:]
        mount = podman("volume", "inspect", volume, "--format", "{{.Mountpoint}}").stdout.strip()
        state = os.path.join(mount, "aggregator")
        with open(os.path.join(state, "outer_metadata.json")) as f:
            assert json.load(f)["outer_step"] == 1
        with open(os.path.join(state, "global", "latest-1.safetensors"), "rb") as f:
            assert f.read() == (tmp_path / "global-1.safetensors").read_bytes()
        assert os.stat(os.path.join(state, "outer_metadata.json")).st_uid == DILOCOD_UID
        podman("rm", c.name)

        # a new container on the same volume continues from step 1 (no second bootstrap)
        c = Container(image, names[1], volume, tmp_path, free_port(), "--expected-nodes", "2")
        c.wait_step(diloco_bin, 1)
        assert "bootstrapped" not in c.logs(), c.logs()[-4000:]
        status = json.loads(run([diloco_bin, "status", "--server", c.url, "--json"], check=0).stdout)
        assert status["outer_step"] == 1, status
        deltas = {n: worker_round(diloco_bin, tmp_path, c.url, n, 1, 10 + seed)
                  for seed, n in enumerate(("w0", "w1"))}
        c.wait_step(diloco_bin, 2)
        oracle.step(deltas)
        assert_state_equal(fetch_global(c.url, tmp_path / "global-2.safetensors"), oracle.state)
        assert c.sigterm() == 0, c.logs()[-4000:]
    finally:
        for name in names:
            podman("rm", "--force", "--time", "0", name, check=None)
        podman("volume", "rm", "--force", volume, check=None)
