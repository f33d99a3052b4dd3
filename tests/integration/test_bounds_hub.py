"""Issue 21, items 7 and 9c, on the network transports (test_bounds.py has them on file://): a "Python
master" plants the global a fresh dilocod adopts, on hf:// (the Hub stand-in tests/hubsim, written with the
stock huggingface_hub client) and on s3:// (SeaweedFS, written with boto3).

- item 7: global/step_count.json names outer_step 2^53 - 1, a step whose successor no delta can name.
  The global is refused at adoption, counted at each offer, logged once, never committed; the daemon
  waits for a global.  The master then publishes an honest global below the bound: it is adopted, a
  round of honest deltas commits the largest step (the torch oracle) and the round after it is not.
- item 9c: the global's header is over max_delta_header_mib (16 MiB here), as no delta of that model
  could be: a single file with a 90 MiB header, a set of two shards one of which has a 90 MiB header,
  and a set whose two 10 MiB shard headers each fit the cap but not together (a delta set's shards
  share one cap).  Each is refused with the cap in the message and without reading the header over it
  (the daemon's VmHWM stays within a stated bound of its baseline); the master's honest global is then
  adopted and, for the sets, a round of honest deltas commits (the oracle).
Each test: the daemon stays alive and serves /healthz and /status to a new client, and /status says
waiting_for_global with no outer_step while the bad global is the only one.

On hf:// the honest global of item 9c is committed while the daemon is stopped, and the daemon restarted
on the same state (it waits again: nothing was committed).  Live, the commit can land while the transport
downloads the refused global again (it is offered at each poll): the downloads then no longer match the
listing taken before the commit, the set or file is given up after its retries, and hub_hf.c lists the
global again only once the revision moves (the next commit), so the test would wait on the transport."""
import os

os.environ["HF_HUB_DISABLE_XET"] = "1"
os.environ["HF_HUB_DISABLE_TELEMETRY"] = "1"
os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"

import json  # noqa: E402
import re  # noqa: E402
import struct  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import requests  # noqa: E402
import torch  # noqa: E402
from huggingface_hub import CommitOperationAdd, HfApi, hf_hub_download, save_torch_state_dict  # noqa: E402
from safetensors.numpy import save as st_save_bytes  # noqa: E402
from safetensors.torch import load as torch_load_bytes  # noqa: E402
from safetensors.torch import save as torch_save_bytes  # noqa: E402

from dilocod_proc import Oracle, assert_state_close, delta_metadata, random_deltas  # noqa: E402
from hostile import SANITIZED, proc_kib  # noqa: E402
from s3server import SeaweedS3  # noqa: E402
from test_bounds import HEADER_BYTES, HWM_SLACK_KIB, STEP_MAX, big_header_model, metric, small_model  # noqa: E402
from test_daemon_hf import REPO, TOKEN, HfDilocod, HubSim  # noqa: E402
from test_s3 import S3Dilocod, put_delta  # noqa: E402

NODES = ("w1", "w2")
CAP = 16 << 20                  # --max-delta-header-mib's default, in bytes
CAP_RE = rf"the cap is {CAP} \(max_delta_header_mib\)"
TOGETHER_RE = rf"{CAP}-byte cap on a set's headers together \(max_delta_header_mib\)"
SHARD_HEADER_BYTES = 10 << 20   # each under the cap, two of them over it
INDEX = "global/latest.safetensors.index.json"
SHARD_MAX = 4096                # small_model's weight (8 KiB) and bias get a shard each


# ---- what the master publishes --------------------------------------------------------------------

def step_count(step, model_file="global/latest.safetensors"):
    return json.dumps({"algorithm": "dumb_diloco", "model_file": model_file, "optimizer": "nesterov",
                       "outer_step": step}).encode()


def single_global(model, step, header_bytes=None):
    """{repo path: bytes} of a plain global (its header padded to header_bytes when given)."""
    body = big_header_model(model, header_bytes) if header_bytes else torch_save_bytes(model)
    return {"global/latest.safetensors": body, "global/step_count.json": step_count(step)}


def padded(shard: bytes, header_bytes: int) -> bytes:
    """The same safetensors file with its JSON header padded with spaces to header_bytes."""
    n = struct.unpack("<Q", shard[:8])[0]
    return struct.pack("<Q", header_bytes) + shard[8:8 + n] + b" " * (header_bytes - n) + shard[8 + n:]


def sharded_global(tmp: Path, model, step, pad=None):
    """{repo path: bytes} of a set saved by huggingface_hub (2 shards, the index, step_count.json naming
    it); pad = {shard number (1-based): header bytes}.  Padding changes no tensor: the index still
    matches, so only a header cap tells the padded set from the honest one."""
    out = tmp / f"set-{time.monotonic_ns()}"
    out.mkdir()
    save_torch_state_dict({k: v.clone() for k, v in model.items()}, str(out),
                          filename_pattern="latest{suffix}.safetensors", max_shard_size=SHARD_MAX)
    shards = sorted(p.name for p in out.glob("latest-*.safetensors"))
    assert shards == ["latest-00001-of-00002.safetensors", "latest-00002-of-00002.safetensors"], shards
    files = {}
    for i, name in enumerate(shards, 1):
        raw = (out / name).read_bytes()
        files[f"global/{name}"] = padded(raw, pad[i]) if pad and i in pad else raw
    files[INDEX] = (out / "latest.safetensors.index.json").read_bytes()
    files["global/step_count.json"] = step_count(step, INDEX)
    return files


# ---- what every test checks ---------------------------------------------------------------------

def status(d):
    """The daemon is alive and a new client gets /healthz and /status (no latency bound: a liveness
    check); -> the /status document."""
    assert d.alive(), d.log_text()[-4000:]
    with requests.Session() as s:
        s.trust_env = False
        h = s.get(d.url + "/healthz", timeout=30)
        st = s.get(d.url + "/status", timeout=30)
    assert h.status_code == 200 and st.status_code == 200, (h.status_code, st.status_code, d.log_text()[-3000:])
    return st.json()


def wait_status(d, pred, what, timeout=120):
    deadline = time.time() + timeout
    while time.time() < deadline:
        st = status(d)
        if pred(st):
            return st
        time.sleep(0.1)
    raise AssertionError(f"{what}: not within {timeout}s; /status {status(d)}\n{d.log_text()[-4000:]}")


def wait_refused(d, times, pattern):
    """Waits until `times` adoptions were refused (/metrics), the daemon still waiting for a global, and
    checks nothing was adopted or committed and the refusal was logged once, with its reason."""
    def refused(st):
        assert st["outer_step"] is None, f"the planted global was adopted: /status {st}, VmHWM {hwm_kib(d)} KiB"
        return (metric(d, "dilocod_adoptions_refused_total") or 0) >= times
    wait_status(d, refused, f"{times} refused adoptions")
    st = status(d)
    assert st["state"] == "waiting_for_global" and st["outer_step"] is None and st["round"] is None, st
    log = d.log_text()
    assert "store: adopted the published global" not in log, log[-3000:]
    refusals = [ln for ln in log.splitlines() if " error " in ln and "cannot adopt the published global" in ln]
    assert len(refusals) == 1, refusals     # counted each time, logged once for that step
    assert re.search(pattern, refusals[0]), refusals[0]
    return refusals[0]


def wait_adopted(d, step):
    st = wait_status(d, lambda st: st["outer_step"] == step, f"adoption of step {step}")
    assert st["state"] == "collecting", st
    assert f"store: adopted the published global step={step} momentum=fresh" in d.log_text()


def hwm_kib(d):
    return proc_kib(d.proc.pid, "VmHWM")


def check_hwm(d, hwm0, slack_kib):
    hwm = hwm_kib(d)
    print(f"VmHWM {hwm0} -> {hwm} KiB (bound +{slack_kib} KiB)")
    assert hwm <= hwm0 + slack_kib, (hwm0, hwm, slack_kib)


# ---- hf:// ----------------------------------------------------------------------------------------

@pytest.fixture
def hub(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))   # never the user's cache or token
    h = HubSim(tmp_path)
    HfApi(endpoint=h.wendpoint, token=TOKEN).create_repo(REPO)
    yield h
    h.stop()


def hf_publish(hub, files: dict, message):
    """The master's commit: every file at once (the stock client's create_commit)."""
    api = HfApi(endpoint=hub.wendpoint, token=TOKEN)
    api.create_commit(REPO, operations=[CommitOperationAdd(p, b) for p, b in files.items()], commit_message=message)


def hf_round(hub, base, rng, model, local):
    """Honest deltas of every node on base, uploaded with upload_file; -> {node: tensors}."""
    api = HfApi(endpoint=hub.wendpoint, token=TOKEN)
    deltas = {n: random_deltas(rng, model) for n in NODES}
    for n, t in deltas.items():
        api.upload_file(path_or_fileobj=st_save_bytes(t, metadata=delta_metadata(n, base, local)),
                        path_in_repo=f"nodes/{n}/delta_{local}.safetensors", repo_id=REPO,
                        commit_message=f"{n}: delta {local}")
    return deltas


def hf_global(hub, tmp: Path):
    path = hf_hub_download(REPO, "global/latest.safetensors", endpoint=hub.wendpoint, token=TOKEN,
                           cache_dir=str(tmp / f"dl-{time.monotonic_ns()}"), force_download=True)
    return torch_load_bytes(Path(path).read_bytes())


def hf_start(tmp_path, hub, *args):
    return HfDilocod(tmp_path, hub, "--nodes", ",".join(NODES), "--retry-interval", "0.5", *args).start()


def test_hf_global_given_up_is_listed_again_without_a_new_commit(tmp_path, hub):
    """hf://, waiting for a global: its download fails until the transport gives it up (six corrupt
    answers from the LFS CDN, each refused by its sha256).  The next poll lists global/ again although
    the revision has not moved, and the global is adopted.  Before, the transport cleared its download
    but kept the revision it had listed, so it waited for a commit that never came."""
    model = small_model()
    hf_publish(hub, single_global(model, 3), "python master: outer step 3")
    rule = hub.fault(kind="corrupt", path_regex=r"^/lfs-cdn/.*[?&]path=global%2Flatest", count=6)
    d = hf_start(tmp_path, hub)
    try:
        deadline = time.time() + 120
        while any(r["id"] == rule["id"] for r in hub.faults()):
            assert time.time() < deadline, d.log_text()[-4000:]
            status(d)
            time.sleep(0.2)
        assert d.log_text().count("download does not match the listing, discarded") >= 6, d.log_text()[-4000:]
        wait_adopted(d, 3)
        assert hub.faults() == [] or all(r["id"] != rule["id"] for r in hub.faults())
    finally:
        d.stop()


def test_hf_step_without_a_writable_successor_is_not_adopted(tmp_path, hub):
    model = small_model()
    hf_publish(hub, single_global(model, 2**53 - 1), "python master: outer step 2^53 - 1")
    d = hf_start(tmp_path, hub)
    try:
        line = wait_refused(d, 3, r"past the largest step")
        assert str(STEP_MAX) in line, line

        # an honest step below the bound: adopted, and its round commits the largest step, exactly
        hf_publish(hub, single_global(model, STEP_MAX - 1), "python master: an honest step")
        wait_adopted(d, STEP_MAX - 1)
        rng = np.random.default_rng(5)
        deltas = hf_round(hub, STEP_MAX - 1, rng, model, 10)
        want = Oracle(model).step(deltas)
        wait_status(d, lambda st: st["hub"]["published_step"] == STEP_MAX, f"step {STEP_MAX} published")
        got = hf_global(hub, tmp_path)
        assert_state_close(got, want)
        assert all(torch.isfinite(v).all() for v in got.values())

        # the round at the largest step takes its deltas in but never commits its successor
        hf_round(hub, STEP_MAX, rng, model, 20)
        d.wait_log("outer step failed, not committed", timeout=60)
        assert f"step {STEP_MAX + 1} is past the largest step" in d.log_text()
        st = status(d)
        assert st["outer_step"] == STEP_MAX and st["hub"]["published_step"] == STEP_MAX, st
    finally:
        assert d.stop() == 0


SHARDED_CASES = {
    # one shard's header over the cap on its own: refused from that shard's 8-byte prefix
    "one_shard_over_the_cap": ({2: HEADER_BYTES}, CAP_RE, 0),
    # each shard's header fits, the two together do not: the first is read (within the cap), the
    # second refused from its prefix.  Under ASan every refusal's read of the first stays in the
    # quarantine (256 MiB by default) instead of being reused.
    "shards_together_over_the_cap": ({1: SHARD_HEADER_BYTES, 2: SHARD_HEADER_BYTES}, TOGETHER_RE,
                                     256 << 10 if SANITIZED else SHARD_HEADER_BYTES >> 10),
}


def test_hf_single_file_global_header_over_the_cap_is_refused_unread(tmp_path, hub):
    model = small_model()
    d = hf_start(tmp_path, hub)
    try:
        st = status(d)
        assert st["state"] == "waiting_for_global", st
        hwm0 = hwm_kib(d)
        hf_publish(hub, single_global(model, 3, HEADER_BYTES), "python master: a 90 MiB header")
        wait_refused(d, 2, CAP_RE)
        check_hwm(d, hwm0, HWM_SLACK_KIB)

        assert d.stop() == 0
        hf_publish(hub, single_global(model, 3), "python master: an honest global")
        d.start()       # the same state: nothing was committed, it waits again and adopts
        wait_adopted(d, 3)
        status(d)
    finally:
        assert d.stop() == 0


@pytest.mark.parametrize("case", list(SHARDED_CASES))
def test_hf_sharded_global_header_over_the_cap_is_refused_unread(tmp_path, hub, case):
    pad, pattern, read_kib = SHARDED_CASES[case]
    model = small_model()
    d = hf_start(tmp_path, hub)
    try:
        status(d)
        hwm0 = hwm_kib(d)
        hf_publish(hub, sharded_global(tmp_path, model, 3, pad), f"python master: a padded set ({case})")
        wait_refused(d, 2, pattern)
        check_hwm(d, hwm0, read_kib + HWM_SLACK_KIB)

        # the master's honest set: adopted, and a round of honest deltas on it commits (the oracle)
        assert d.stop() == 0
        hf_publish(hub, sharded_global(tmp_path, model, 3), "python master: the honest set")
        d.start()
        wait_adopted(d, 3)
        deltas = hf_round(hub, 3, np.random.default_rng(9), model, 10)
        want = Oracle(model).step(deltas)
        wait_status(d, lambda st: st["hub"]["published_step"] == 4, "step 4 published")
        assert_state_close(hf_global(hub, tmp_path), want)
        assert status(d)["counters"]["rejected"] == 0
    finally:
        assert d.stop() == 0


# ---- s3:// ----------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    server = SeaweedS3(tmp_path_factory.mktemp("seaweedfs")).start()
    yield server
    server.stop()


def s3_publish(d: S3Dilocod, files: dict):
    """The master's put_objects: the model files first, step_count.json last."""
    for p in sorted(files, key=lambda p: p.endswith("step_count.json")):
        d.client.put_object(Bucket=d.s3.bucket, Key=d.key(p), Body=files[p])


def s3_round(d: S3Dilocod, base, rng, model, local):
    deltas = {n: random_deltas(rng, model) for n in NODES}
    for n, t in deltas.items():
        put_delta(d.client, d.s3.bucket, d.prefix, n, base, local, t)
    return deltas


def s3_start(tmp_path, s3, prefix, *args):
    return S3Dilocod(tmp_path, s3, prefix, "--nodes", ",".join(NODES), *args)


def test_s3_step_without_a_writable_successor_is_not_adopted(tmp_path, s3):
    model = small_model()
    d = s3_start(tmp_path, s3, "bounds/step")
    s3_publish(d, single_global(model, 2**53 - 1))
    d.start()
    try:
        line = wait_refused(d, 3, r"past the largest step")
        assert str(STEP_MAX) in line, line

        s3_publish(d, single_global(model, STEP_MAX - 1))
        wait_adopted(d, STEP_MAX - 1)
        rng = np.random.default_rng(6)
        deltas = s3_round(d, STEP_MAX - 1, rng, model, 10)
        want = Oracle(model).step(deltas)
        wait_status(d, lambda st: st["hub"]["published_step"] == STEP_MAX, f"step {STEP_MAX} published")
        assert json.loads(d.get("global/step_count.json"))["outer_step"] == STEP_MAX
        got = torch_load_bytes(d.get("global/latest.safetensors"))
        assert_state_close(got, want)

        s3_round(d, STEP_MAX, rng, model, 20)
        d.wait_log("outer step failed, not committed", timeout=60)
        assert f"step {STEP_MAX + 1} is past the largest step" in d.log_text()
        st = status(d)
        assert st["outer_step"] == STEP_MAX and st["hub"]["published_step"] == STEP_MAX, st
    finally:
        assert d.stop() == 0


def hub_requests(d, route):
    """dilocod_hub_requests_total of one route, every code."""
    text = requests.get(d.url + "/metrics", timeout=30).text
    return sum(int(n) for n in re.findall(r'^dilocod_hub_requests_total\{route="%s",code="\d+"\} (\d+)$' % route,
                                          text, re.M))


def test_s3_global_never_adoptable_is_not_downloaded_at_every_poll(tmp_path, s3):
    """A planted global that can never be adopted (its step past the bound): the transport hands it
    over, the daemon refuses it, and the same version is fetched again only after a backoff that
    doubles from twice the poll interval.  Before, it was downloaded at every poll (a 90 MiB global
    cost 90 MiB a poll).  Counted against the polls themselves (the step file's reads), so no clock is
    involved: 20 polls see at most a handful of downloads, and at least two refusals (it is still
    looked at).  A new version is fetched at once."""
    model = small_model()
    d = s3_start(tmp_path, s3, "bounds/gate", "--poll-interval", "0.1")
    s3_publish(d, single_global(model, 2**53 - 1))
    d.start()
    try:
        wait_status(d, lambda st: hub_requests(d, "step_count") >= 20, "20 polls")
        polls, downloads = hub_requests(d, "step_count"), hub_requests(d, "download")
        refused = metric(d, "dilocod_adoptions_refused_total") or 0
        print(f"{polls} polls, {downloads} downloads of the global, {refused} refusals")
        assert 2 <= refused and downloads <= polls // 3, (polls, downloads, refused)
        s3_publish(d, single_global(model, 5))
        wait_adopted(d, 5)
    finally:
        assert d.stop() == 0


def test_s3_sharded_global_header_over_the_cap_is_refused_unread(tmp_path, s3):
    pad, pattern, read_kib = SHARDED_CASES["one_shard_over_the_cap"]
    model = small_model()
    d = s3_start(tmp_path, s3, "bounds/sharded").start()
    try:
        status(d)
        hwm0 = hwm_kib(d)
        s3_publish(d, sharded_global(tmp_path, model, 3, pad))
        wait_refused(d, 2, pattern)
        check_hwm(d, hwm0, read_kib + HWM_SLACK_KIB)

        s3_publish(d, sharded_global(tmp_path, model, 3))
        wait_adopted(d, 3)
        deltas = s3_round(d, 3, np.random.default_rng(10), model, 10)
        want = Oracle(model).step(deltas)
        wait_status(d, lambda st: st["hub"]["published_step"] == 4, "step 4 published")
        assert_state_close(torch_load_bytes(d.get("global/latest.safetensors")), want)
    finally:
        assert d.stop() == 0
