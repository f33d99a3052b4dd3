"""Issue 21 item 5: hostile indexes of sharded sets cost what they hold, not ~40 bytes per byte.

An index is at most 10 MiB (huggingface_hub's MAX_INDEX_FILE_SIZE).  Before, cJSON built the whole
tree before any schema check: {"metadata": {"total_size": 0, "x": [0,0,...]}} of 10 MiB cost ~420 MB
to parse, and six concurrent HTTP uploads of it took the daemon's RSS to 2.48 GB.  The index parser
(common/st_index.c) now walks the schema and refuses nesting at its first byte, and a delta's index
is capped by the model (st_index_cap_for) over HTTP and at intake.  Item 6: a set's shards together
are held to one budget (intake_set_budget: the model's delta bytes + 8 + one header cap) on every path.

Measured at the parent commit (59f3c19) against this one, plain build: HTTP peak RSS 803 MiB -> 9 MiB;
file:// 1,596 MiB -> 18 MiB; s3:// /healthz >= 1 s (timed out) -> 0.05 s, 25 MiB; hf:// 821 MiB ->
under the bound; the over-budget
set was taken in (16 MiB staged) -> refused before staging.

Each test runs the real dilocod, attacks it, and asserts, while the attack runs and after it:
  - the daemon is alive and answers /healthz within 1 s;
  - its peak RSS (VmHWM) stays under RSS_BOUND (256 MiB; 768 MiB under ASan, whose quarantine keeps
    freed bodies resident);
  - the state root stays under STATE_BOUND (64 MiB);
  - an honest node's delta sent beside the attack is taken in (the step is published) within 60 s;
  - the published global equals torch's outer step and is finite.
"""
import os
import re
import threading
import time
from pathlib import Path

import numpy as np
import requests
import torch
from safetensors.torch import save_file

from conftest import BUILD
from dilocod_proc import Dilocod, Oracle, assert_state_close, delta_metadata, load_torch, write_model
from test_s3 import s3  # noqa: F401  (the SeaweedFS fixture)

SANITIZED = "address" in str(BUILD)
RSS_BOUND = (768 if SANITIZED else 256) << 20
STATE_BOUND = 64 << 20
HONEST_WITHIN = 60          # seconds
INDEX_CAP = 10 * 1024 * 1024


def model():
    g = torch.Generator().manual_seed(5)
    return {"a.weight": torch.randn(32, 32, generator=g), "a.bias": torch.randn(32, generator=g)}


def honest(m):
    g = torch.Generator().manual_seed(6)
    return {k: 0.01 * torch.randn(v.shape, generator=g) for k, v in m.items()}


# st_index_cap_for(model()): the two tensors' names escaped, the longest shard name, 64 KiB of metadata
MODEL_INDEX_CAP = 66108


def hostile_index(size=INDEX_CAP):
    """{"metadata": {"total_size": 0, "x": [0,0,...]}} of just under size bytes."""
    head = b'{"metadata": {"total_size": 0, "x": ['
    tail = b'0]}}'
    n = (size - 64 - len(head) - len(tail)) // 2
    return head + b"0," * n + tail


def vmhwm(pid):
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


def tree_size(root: Path):
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file() and not p.is_symlink())


class Watch:
    """Polls /healthz (each answer within 1 s) while an attack runs."""

    def __init__(self, d):
        self.d, self.url, self.slowest, self.failures = d, d.url, 0.0, []
        self.stop = threading.Event()
        self.t = threading.Thread(target=self.run, daemon=True)

    def run(self):
        while not self.stop.is_set():
            t0 = time.monotonic()
            try:
                r = requests.get(self.url + "/healthz", timeout=1)
                if r.status_code != 200:
                    self.failures.append(f"/healthz answered {r.status_code}")
            except requests.RequestException as e:
                self.failures.append(f"/healthz: {e}")
            self.slowest = max(self.slowest, time.monotonic() - t0)
            time.sleep(0.05)

    def __enter__(self):
        self.t.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.t.join()
        assert not self.failures, self.failures[:5]
        assert self.slowest < 1.0, f"/healthz took {self.slowest:.3f} s"


def check_after(d, tmp_path, m, delta):
    assert d.alive()
    hwm = vmhwm(d.proc.pid)
    assert hwm < RSS_BOUND, f"peak RSS {hwm >> 20} MiB, bound {RSS_BOUND >> 20} MiB"
    size = tree_size(d.state_root)
    assert size < STATE_BOUND, f"state root {size >> 20} MiB, bound {STATE_BOUND >> 20} MiB"
    want = Oracle(m).step({"h": delta})
    got = load_torch(d.hub / "global" / "latest.safetensors")
    for k, v in got.items():
        assert np.isfinite(np.asarray(v, dtype=np.float64)).all(), k
    assert_state_close(got, want)



def honest_file_delta(d, hub, delta):
    """An honest node h's delta of round 0, written the reference's way (temp + rename) into the tree;
    step 1 must follow within HONEST_WITHIN seconds."""
    t0 = time.monotonic()
    dh = hub / "nodes" / "h"
    dh.mkdir(parents=True)
    save_file(delta, str(dh / ".tmp"), metadata=delta_metadata("h", 0, 1))
    os.rename(dh / ".tmp", dh / "delta_1.safetensors")
    d.wait_step(1, timeout=HONEST_WITHIN - (time.monotonic() - t0))

def test_http_concurrent_hostile_indexes(tmp_path):
    m = model()
    write_model(tmp_path / "init.safetensors", m)
    delta = honest(m)
    single = tmp_path / "delta_1.safetensors"
    save_file(delta, str(single), metadata=delta_metadata("h", 0, 1))
    body = hostile_index()
    d = Dilocod(tmp_path, tmp_path / "hub", "--init-model", tmp_path / "init.safetensors",
                "--expected-nodes", "1").start()
    try:
        d.wait_step(0)
        answers = []

        def attack(k):
            """Up to three parsed uploads per attacker: a 503 (too many sharded uploads staged at once:
            upload.c's cap) is retried a few times."""
            done = 0
            for _ in range(100):
                if done == 3:
                    break
                try:
                    r = requests.put(f"{d.url}/nodes/x{k}/delta_1.safetensors.index.json", data=body, timeout=60)
                except requests.RequestException as e:
                    answers.append(str(e))
                    continue
                if r.status_code == 503:
                    time.sleep(0.02)
                    continue
                answers.append(r.status_code)
                done += 1

        with Watch(d):
            threads = [threading.Thread(target=attack, args=(k,)) for k in range(6)]
            for t in threads:
                t.start()
            # the honest delta goes in once the attack has had indexes parsed (it would close the
            # round, after which the attackers' step-0 sets are refused before any parse: 409)
            deadline = time.monotonic() + 30
            while len(answers) < 6 and any(t.is_alive() for t in threads) and time.monotonic() < deadline:
                time.sleep(0.01)
            t0 = time.monotonic()
            r = requests.put(f"{d.url}/nodes/h/delta_1.safetensors", data=single.read_bytes(), timeout=HONEST_WITHIN)
            assert r.status_code in (200, 201), r.text
            d.wait_step(1, timeout=HONEST_WITHIN - (time.monotonic() - t0))
            for t in threads:
                t.join()
        # 400: the index is refused at its nesting; 409: refused for its step once step 1 is out
        # 413: over the model's index cap (st_index_cap_for: ~66 KB for this 2-tensor model), refused by
        # its Content-Length before a byte of it is read; 400: refused at its nesting by the parser;
        # 409: refused for its step once step 1 is out
        assert answers and all(a in (400, 409, 413) for a in answers), answers
        check_after(d, tmp_path, m, delta)
    finally:
        d.stop()


def test_file_hostile_index_rescanned(tmp_path):
    """file://: a hostile index sits in the hub and is seen at every scan (0.05 s apart)."""
    m = model()
    write_model(tmp_path / "init.safetensors", m)
    delta = honest(m)
    hub = tmp_path / "hub"
    for k in range(4):
        x = hub / "nodes" / f"x{k}"
        x.mkdir(parents=True)
        (x / "delta_1.safetensors.index.json").write_bytes(hostile_index())
    d = Dilocod(tmp_path, hub, "--init-model", tmp_path / "init.safetensors", "--expected-nodes", "1").start()
    try:
        d.wait_step(0)
        with Watch(d):
            time.sleep(2)       # several scans over the hostile indexes
            honest_file_delta(d, hub, delta)
        check_after(d, tmp_path, m, delta)
    finally:
        d.stop()


def test_file_set_over_the_byte_budget(tmp_path):
    """Issue 21 item 6, file://: 16 shards, each with a header padded to just under the header cap
    (--max-delta-header-mib 1 here) and 32 bytes of data.  Each shard passes alone; together they
    hold ~16 MiB, over the set's budget (the model's 512 delta bytes + 8 + one 1 MiB header cap), so
    the set is refused whole before a byte is staged, and the state root stays under 4 MiB."""
    import huggingface_hub as hfh
    from dilocod_proc import pad_header

    g = torch.Generator().manual_seed(8)
    m = {f"t{i:02d}": torch.randn(8, generator=g) for i in range(16)}
    write_model(tmp_path / "init.safetensors", m)
    hub = tmp_path / "hub"
    xd = hub / "nodes" / "x"
    xd.mkdir(parents=True)
    hfh.save_torch_state_dict({k: 0.01 * v for k, v in m.items()}, xd, filename_pattern="delta_1{suffix}.safetensors",
                              metadata=delta_metadata("x", 0, 1), max_shard_size=40)
    shards = sorted(xd.glob("delta_1-*-of-00016.safetensors"))
    assert len(shards) == 16
    for s in shards:
        pad_header(s, (1 << 20) - 4096)
    delta = {k: 0.02 * torch.randn(v.shape, generator=g) for k, v in m.items()}
    d = Dilocod(tmp_path, hub, "--init-model", tmp_path / "init.safetensors", "--expected-nodes", "1",
                "--max-delta-header-mib", "1").start()
    try:
        d.wait_step(0)
        with Watch(d):
            d.wait_log("delta budget")
            honest_file_delta(d, hub, delta)
        assert d.alive()
        size = tree_size(d.state_root)
        assert size < 4 << 20, f"state root {size >> 20} MiB, bound 4 MiB"
        check_after(d, tmp_path, m, delta)
    finally:
        d.stop()


def hub_calls(d, route):
    """/metrics' count of the transport's requests of one route (dilocod_hub_requests_total), whatever
    their answer."""
    text = requests.get(d.url + "/metrics", timeout=5).text
    pat = re.compile(r'^dilocod_hub_requests_total\{route="%s",code="\d+"\} (\d+)$' % re.escape(route), re.M)
    return sum(int(n) for n in pat.findall(text))


def test_s3_hostile_indexes(tmp_path, s3):
    """s3:// (SeaweedFS, test_s3.py's fixture): four nested-array indexes under nodes/x*/.  Two of 10 MiB
    are over the model's index cap (st_index_cap_for, 66,108 bytes here) and refused from the listing's
    size, never fetched; two just under it are fetched, parsed on the pool (never in the curl callback)
    and refused at their nesting.  The loop keeps answering and RSS stays bounded."""
    from test_s3 import S3Dilocod, put_delta

    prefix = "index-attack/run"
    m = model()
    write_model(tmp_path / "init.safetensors", m)
    delta = {k: v.numpy() for k, v in honest(m).items()}
    d = S3Dilocod(tmp_path, s3, prefix, "--init-model", tmp_path / "init.safetensors", "--expected-nodes", "1")
    for k in range(4):
        body = hostile_index() if k < 2 else hostile_index(MODEL_INDEX_CAP)
        d.client.put_object(Bucket=s3.bucket, Key=f"{prefix}/nodes/x{k}/delta_1.safetensors.index.json", Body=body)
    d.start()
    try:
        d.wait_step(0)
        with Watch(d):
            d.wait_log("the cap is 66108", count=2)                 # refused from the listing
            d.wait_log("delta rejected path=nodes/x", count=2)     # fetched, parsed and refused
            t0 = time.monotonic()
            put_delta(d.client, s3.bucket, prefix, "h", 0, 1, delta)
            d.wait_step(1, timeout=HONEST_WITHIN - (time.monotonic() - t0))
        assert d.alive()
        assert hub_calls(d, "index") == 2, "only the indexes under the model's cap are fetched"
        for k in (0, 1):
            assert f"nodes/x{k}/delta_1.safetensors.index.json: an index of 10485695 bytes" in d.log_text()
        hwm = vmhwm(d.proc.pid)
        assert hwm < RSS_BOUND, f"peak RSS {hwm >> 20} MiB, bound {RSS_BOUND >> 20} MiB"
        size = tree_size(d.state_root)
        assert size < STATE_BOUND, f"state root {size >> 20} MiB, bound {STATE_BOUND >> 20} MiB"
        want = Oracle(m).step({"h": {k: torch.from_numpy(v) for k, v in delta.items()}})
        got = {k: torch.from_numpy(v.copy()) for k, v in d.global_state().items()}
        for k, v in got.items():
            assert torch.isfinite(v).all(), k
        assert_state_close(got, want)
    finally:
        d.stop()


def test_s3_set_over_the_byte_budget(tmp_path, s3):
    """Issue 21 item 6, s3://: test_file_set_over_the_byte_budget's set (16 shards, each header padded
    to just under --max-delta-header-mib 1) put in the bucket.  The listing's sizes already say the
    shards are ~16 MiB together, over the set's budget: the set is refused before a shard is fetched
    (before, each shard was downloaded and checked alone), and an honest node is taken beside it."""
    import huggingface_hub as hfh
    from dilocod_proc import pad_header
    from test_s3 import S3Dilocod, put_delta

    prefix = "index-attack/budget"
    g = torch.Generator().manual_seed(8)
    m = {f"t{i:02d}": torch.randn(8, generator=g) for i in range(16)}
    write_model(tmp_path / "init.safetensors", m)
    xd = tmp_path / "set"
    xd.mkdir()
    hfh.save_torch_state_dict({k: 0.01 * v for k, v in m.items()}, xd, filename_pattern="delta_1{suffix}.safetensors",
                              metadata=delta_metadata("x", 0, 1), max_shard_size=40)
    shards = sorted(xd.glob("delta_1-*-of-00016.safetensors"))
    assert len(shards) == 16
    for f in shards:
        pad_header(f, (1 << 20) - 4096)
    d = S3Dilocod(tmp_path, s3, prefix, "--init-model", tmp_path / "init.safetensors", "--expected-nodes", "1",
                  "--max-delta-header-mib", "1")
    for f in [*shards, xd / "delta_1.safetensors.index.json"]:
        d.client.put_object(Bucket=s3.bucket, Key=f"{prefix}/nodes/x/{f.name}", Body=f.read_bytes())
    delta = {k: (0.02 * torch.randn(v.shape, generator=g)).numpy() for k, v in m.items()}
    d.start()
    try:
        d.wait_step(0)
        with Watch(d):
            d.wait_log("bytes together, a delta of this model at most")
            t0 = time.monotonic()
            put_delta(d.client, s3.bucket, prefix, "h", 0, 1, delta)
            d.wait_step(1, timeout=HONEST_WITHIN - (time.monotonic() - t0))
        assert d.alive()
        assert hub_calls(d, "download") == 1, "only the honest delta is downloaded"
        size = tree_size(d.state_root)
        assert size < 4 << 20, f"state root {size >> 20} MiB, bound 4 MiB"
        want = Oracle(m).step({"h": {k: torch.from_numpy(v) for k, v in delta.items()}})
        got = {k: torch.from_numpy(v.copy()) for k, v in d.global_state().items()}
        assert_state_close(got, want)
    finally:
        d.stop()


def test_hf_hostile_index(tmp_path, monkeypatch):
    """hf:// (tests/hubsim): a 10 MiB nested-array index committed under nodes/w1/ beside w2's honest
    delta is refused from the listing's size (over the model's index cap); one just under the cap
    under nodes/w3/ is downloaded, checked against its oid and parsed on the pool, and refused."""
    import test_shards_hub as sh
    from huggingface_hub import HfApi
    from safetensors.numpy import save as st_save_bytes

    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))
    hub = sh.HubSim(tmp_path)
    try:
        m = sh.model()
        api = HfApi(endpoint=hub.wendpoint, token=sh.TOKEN)
        api.create_repo(sh.REPO)
        # w1 never sends a valid delta: the round closes by timeout with w2 alone
        d = sh.hf_dilocod(tmp_path, hub, "run", "--min-nodes", "1", "--round-timeout", "2", init=m).start()
        try:
            d.wait_published(0)
            with Watch(d):
                api.upload_file(path_or_fileobj=hostile_index(), path_in_repo="nodes/w1/delta_1.safetensors.index.json",
                                repo_id=sh.REPO, commit_message="w1: hostile index")
                d.wait_log("delta refused before download path=nodes/w1/delta_1.safetensors.index.json")
                cap = int(re.search(r"nodes/w1/delta_1.safetensors.index.json: an index of \d+ bytes, the cap is (\d+)",
                                    d.log_text()).group(1))
                # one just under the model's cap is fetched, checked against its oid and parsed on the pool
                api.upload_file(path_or_fileobj=hostile_index(cap), path_in_repo="nodes/w3/delta_1.safetensors.index.json",
                                repo_id=sh.REPO, commit_message="w3: hostile index under the cap")
                d.wait_log("delta rejected path=nodes/w3/delta_1.safetensors.index.json")
                rng = np.random.default_rng(3)
                delta = sh.random_deltas(rng, m)
                t0 = time.monotonic()
                api.upload_file(path_or_fileobj=st_save_bytes(delta, metadata=delta_metadata("w2", 0, 1)),
                                path_in_repo="nodes/w2/delta_1.safetensors", repo_id=sh.REPO, commit_message="w2")
                d.wait_published(1, timeout=HONEST_WITHIN - (time.monotonic() - t0))
            assert d.alive()
            hwm = vmhwm(d.proc.pid)
            assert hwm < RSS_BOUND, f"peak RSS {hwm >> 20} MiB, bound {RSS_BOUND >> 20} MiB"
            size = tree_size(d.state_root)
            assert size < STATE_BOUND, f"state root {size >> 20} MiB, bound {STATE_BOUND >> 20} MiB"
            want = Oracle({k: v.clone() for k, v in m.items()}).step({"w2": {k: torch.from_numpy(v)
                                                                          for k, v in delta.items()}})
            got = sh.load_set_dir(sh.hf_download_global(hub, tmp_path / "g1"), m)
            for k, v in got.items():
                assert torch.isfinite(v.float()).all() if v.is_floating_point() else True, k
            assert_state_close(got, want)
        finally:
            d.stop()
    finally:
        hub.stop()
