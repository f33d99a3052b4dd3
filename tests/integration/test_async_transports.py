"""--mode async over the remote transports: s3:// on SeaweedFS and hf:// on the Hub emulator.

s3://: boto3 workers put deltas with mixed bases (one at a time, then a burst of three); every accepted
delta becomes part of an update, and the published global after the last update equals AsyncOracle
(test_async.py) fed the /rounds records' deltas and weights in order, byte for byte.  A delta more than
--max-staleness behind is judged from its header only (never downloaded), never applied, and counted in
/status counters.stale.

hf://: with --publish-interval 2 and updates arriving faster than that, dilocod commits far fewer steps
to the Hub than it makes updates (the commits counted with the stock client's list_repo_commits), counts
the steps it skipped (/status hub.coalesced, equal to the steps missing from the Hub's history) and in
the end publishes its newest step.  Without --publish-interval, async mode on hf:// publishes at most
every 30 s (/status hub.publish_interval), while step 0 still goes out at once.

Every wait is on a state dilocod reports (/status, /rounds), never a sleep."""
import json
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch
from huggingface_hub import HfApi, hf_hub_download
from safetensors.torch import save as st_save

from dilocod_proc import Dilocod, delta_metadata, write_model
from s3server import SeaweedS3
from test_async import AsyncOracle
from test_daemon_hf import REPO, TOKEN, WREV, HfDilocod, HubSim, dilocod_steps_in_history
from test_s3 import S3Dilocod, put_delta
from test_torch_exact import torch_cpu_capability

from safetensors.numpy import save as np_save  # noqa: E402  (after test_daemon_hf: it sets HF_HUB_* first)

BYTE_EXACT = torch_cpu_capability() in ("AVX2", "AVX512")
needs_exact = pytest.mark.skipif(not BYTE_EXACT, reason="torch fuses add(x, alpha=...) only in its AVX2/AVX-512 "
                                                        "kernels (see test_torch_exact.py)")
NODES = ["w0", "w1", "w2"]
LR, MU = 0.7, 0.9


def model(seed):
    """F32 weights bigger than dilocod's 64 KiB header peek (peek and download are distinct requests),
    BF16 weights and an I64 buffer."""
    g = torch.Generator().manual_seed(seed)
    return {"layer.weight": torch.randn(128, 192, generator=g), "layer.bias": torch.randn(192, generator=g),
            "emb.bf16": torch.randn(16, 8, generator=g).to(torch.bfloat16),
            "counter": torch.tensor([7, -2, 1 << 40], dtype=torch.int64)}


def rand_delta(rng, init, scale=0.01):
    return {k: (rng.standard_normal(tuple(v.shape)) * scale).astype(np.float32)
            for k, v in init.items() if v.is_floating_point()}


def status(d):
    return d.get_json("/status") or {}


def wait_status(d, pred, what, timeout=60):
    """Waits until pred(/status) holds; -> that /status."""
    got = {}

    def ok():
        nonlocal got
        got = status(d)
        return bool(got) and pred(got)
    d.wait_until(ok, what, timeout)
    return got


def async_records(d):
    return sorted((r for r in (d.get_json("/rounds") or {}).get("rounds", []) if r.get("mode") == "async"),
                  key=lambda r: r["outer_step"])


def taken(d):
    """{(node, local_step)} of every delta in an update's record."""
    return {(n["node_id"], n["local_step"]) for r in async_records(d) for n in r["nodes"]}


def replay(init, recs, sent, n):
    """AsyncOracle fed the records' deltas (in each record's order) and weights, update by update."""
    oracle = AsyncOracle(init, n, lr=LR, mu=MU)
    for r in recs:
        oracle.update([sent[(x["node_id"], x["local_step"])] for x in r["nodes"]], r["weight"])
        assert r["dn_k"] == oracle.k, (r, oracle.k)
    return oracle


def state_bytes(state):
    return st_save({k: v.contiguous() for k, v in state.items()})


# ---- s3:// ----------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    server = SeaweedS3(tmp_path_factory.mktemp("seaweedfs")).start()
    yield server
    server.stop()


@needs_exact
def test_s3_async_updates_equal_the_oracle_and_stale_deltas_are_skipped(tmp_path, s3):
    prefix = "async/run"
    init = model(21)
    init_path = tmp_path / "init.safetensors"
    write_model(init_path, init)
    S = 2
    d = S3Dilocod(tmp_path, s3, prefix, "--init-model", init_path, "--mode", "async", "--nodes", ",".join(NODES),
                  "--staleness-weight", "poly", "--dn-period", "2", "--grace-ms", "0", "--max-staleness", str(S),
                  "--threads", "2").start()
    rng = np.random.default_rng(5)
    sent, local = {}, {n: 0 for n in NODES}

    def push(node, base):
        local[node] += 10
        delta = rand_delta(rng, init, 0.01 * (1 + len(sent) % 3))
        sent[(node, local[node])] = delta
        put_delta(d.client, s3.bucket, prefix, node, base, local[node], delta)
        return node, local[node]

    try:
        wait_status(d, lambda st: st["outer_step"] == 0 and st["hub"]["published_step"] == 0, "step 0 published")
        # one delta at a time, bases 0, 1 and 2 updates behind
        behind = [0, 0, 1, 2, 0, 2, 1, 2]
        for i, back in enumerate(behind):
            base = max(0, i - back)
            push(NODES[i % 3], base)
            wait_status(d, lambda st, i=i: st["async"]["updates"] == i + 1, f"update {i + 1}")
        recs = async_records(d)
        assert [r["outer_step"] for r in recs] == list(range(1, len(behind) + 1))
        for i, r in enumerate(recs):
            assert len(r["nodes"]) == 1 and r["nodes"][0]["base_outer_step"] == max(0, i - behind[i]), r
            assert r["nodes"][0]["tau"] == i - max(0, i - behind[i]), r
        assert len({r["nodes"][0]["tau"] for r in recs}) == 3        # tau 0, 1 and 2
        # a burst: three deltas at once on the current step; however dilocod batches them, each is in
        # exactly one update (none lost, none twice)
        step = status(d)["outer_step"]
        with ThreadPoolExecutor(3) as ex:
            burst = list(ex.map(lambda node: push(node, step), NODES))
        d.wait_until(lambda: set(burst) <= taken(d), "the burst's deltas in updates")
        # too stale: tau = S + 1.  Judged from its header, never downloaded, never applied (its count in
        # /status: test_s3_async_stale_delta_is_counted)
        step = wait_status(d, lambda st: st["async"]["queue"]["pending"] == 0, "the queue drained")["outer_step"]
        bad = push("w1", step - (S + 1))
        key = f"{prefix}/nodes/w1/delta_{bad[1]}.safetensors"
        d.wait_log(f"stale delta not downloaded key={key}")
        # and a good delta after it: it makes the last update
        last = push("w2", step)
        d.wait_until(lambda: last in taken(d), "the last delta in an update")
        final = wait_status(d, lambda st: st["async"]["queue"]["pending"] == 0 and
                            st["hub"]["published_step"] == st["outer_step"], "the newest step published")
        recs = async_records(d)
        assert final["outer_step"] == len(recs) == final["async"]["updates"], (final["async"], len(recs))
        in_updates = [(n["node_id"], n["local_step"]) for r in recs for n in r["nodes"]]
        assert sorted(in_updates) == sorted(k for k in sent if k != bad), "a delta lost or applied twice"
        assert bad not in in_updates
        assert f"s3 object downloaded key={key}" not in d.log_text()
        for r in recs:                  # every accepted delta within the bound
            assert all(x["tau"] <= S for x in r["nodes"]), r
        oracle = replay(init, recs, sent, 2)
        published = d.get("global/latest.safetensors")
        assert published == state_bytes(oracle.state), "the published global differs from AsyncOracle's replay"
        assert json.loads(d.get("global/step_count.json"))["outer_step"] == final["outer_step"]
        assert d.alive()
    finally:
        assert d.stop() == 0


def test_s3_async_stale_delta_is_counted(tmp_path, s3):
    prefix = "async/stale"
    init = model(22)
    init_path = tmp_path / "init.safetensors"
    write_model(init_path, init)
    d = S3Dilocod(tmp_path, s3, prefix, "--init-model", init_path, "--mode", "async", "--nodes", ",".join(NODES),
                  "--grace-ms", "0", "--max-staleness", "0").start()
    rng = np.random.default_rng(6)
    try:
        wait_status(d, lambda st: st["hub"]["published_step"] == 0, "step 0 published")
        put_delta(d.client, s3.bucket, prefix, "w0", 0, 10, rand_delta(rng, init))
        wait_status(d, lambda st: st["async"]["updates"] == 1, "update 1")
        assert status(d)["counters"]["stale"] == 0
        put_delta(d.client, s3.bucket, prefix, "w1", 0, 10, rand_delta(rng, init))     # tau 1 > S = 0
        d.wait_log(f"stale delta not downloaded key={prefix}/nodes/w1/delta_10.safetensors")
        st = status(d)
        assert st["async"]["updates"] == 1 and st["outer_step"] == 1, st["async"]
        assert st["counters"]["stale"] == 1, st["counters"]
    finally:
        assert d.stop() == 0


# ---- hf:// ----------------------------------------------------------------------------------------

@pytest.fixture(autouse=True)
def _hf_home(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))  # never the user's cache or token


@pytest.fixture
def procs():
    items = []
    yield items
    for p in reversed(items):
        try:
            if isinstance(p, HubSim):
                p.stop()
            elif p.alive():
                p.kill9()
        except Exception:  # noqa: BLE001 - best-effort cleanup
            pass


def hf_run(tmp, procs, *args):
    hub = HubSim(tmp)
    procs.append(hub)
    api = HfApi(endpoint=hub.wendpoint, token=TOKEN)
    api.create_repo(REPO)
    init = model(31)
    init_path = tmp / "init.safetensors"
    write_model(init_path, init)
    d = HfDilocod(tmp, hub, "--init-model", init_path, "--nodes", ",".join(NODES), "--mode", "async",
                  "--grace-ms", "0", "--retry-interval", "0.5", "--threads", "2", *args, poll=0.2)
    procs.append(d)
    return hub, api, d, init


def upload(api, node, base, local, tensors):
    body = np_save(tensors, metadata=delta_metadata(node, base, local))
    api.upload_file(path_or_fileobj=body, path_in_repo=f"nodes/{node}/delta_{local}.safetensors", repo_id=REPO,
                    revision=WREV, commit_message=f"upload {node} {local}")


def fetch(url):
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(url, timeout=30) as r:
        return r.read()


def test_hf_publishes_are_coalesced_and_the_newest_step_goes_out(tmp_path, procs):
    interval = 2
    hub, api, d, init = hf_run(tmp_path, procs, "--publish-interval", str(interval), "--dn-period", "2")
    t0 = time.monotonic()
    d.start()
    d.wait_published(0)
    st = status(d)
    assert st["hub"]["publish_interval"] == interval and st["hub"]["coalesced"] == 0, st["hub"]
    rng = np.random.default_rng(9)
    sent, local = {}, {n: 0 for n in NODES}
    updates = 12
    for i in range(updates):
        node = NODES[i % 3]
        local[node] += 10
        sent[(node, local[node])] = rand_delta(rng, init)
        upload(api, node, status(d)["outer_step"], local[node], sent[(node, local[node])])
        wait_status(d, lambda st, i=i: st["async"]["updates"] == i + 1, f"update {i + 1}")
    final = wait_status(d, lambda st: st["hub"]["published_step"] == st["outer_step"] == updates,
                        "the newest step published", timeout=30)
    elapsed = time.monotonic() - t0
    commits = dilocod_steps_in_history(api)
    # the Hub got step 0, some steps in between and the newest one, in order: after step 0 one publish at
    # most per interval (however fast this machine ran the updates), so fewer commits than updates
    assert commits[0] == 0 and commits[-1] == updates and commits == sorted(set(commits)), commits
    assert len(commits) - 1 <= elapsed // interval, (commits, elapsed)
    assert len(commits) - 1 < updates, commits
    # every committed step the Hub never got is counted as coalesced
    assert final["hub"]["coalesced"] == updates + 1 - len(commits) > 0, (final["hub"], commits)
    m = fetch(d.url + "/metrics").decode()
    assert f"dilocod_publish_coalesced_total {final['hub']['coalesced']}" in m
    # the Hub's global is the daemon's newest step (stock client, the branch as workers name it)
    cache = str(tmp_path / "hf-cache")
    sc = json.loads(Path(hf_hub_download(REPO, "global/step_count.json", revision=WREV, endpoint=hub.wendpoint,
                                         token=TOKEN, cache_dir=cache)).read_text())
    assert sc["outer_step"] == updates, sc
    on_hub = Path(hf_hub_download(REPO, "global/latest.safetensors", revision=WREV, endpoint=hub.wendpoint,
                                  token=TOKEN, cache_dir=cache)).read_bytes()
    assert on_hub == fetch(d.url + "/global/latest.safetensors")
    recs = async_records(d)
    assert [r["outer_step"] for r in recs] == list(range(1, updates + 1))
    assert sorted((x["node_id"], x["local_step"]) for r in recs for x in r["nodes"]) == sorted(sent)
    if BYTE_EXACT:
        assert on_hub == state_bytes(replay(init, recs, sent, 2).state)
    assert d.stop() == 0


def test_hf_async_publishes_every_30_seconds_by_default(tmp_path, procs):
    hub, api, d, init = hf_run(tmp_path, procs)
    d.start()
    d.wait_published(0)                 # the first publish is not held back
    st = status(d)
    assert st["mode"] == "async" and st["hub"]["publish_interval"] == 30, st["hub"]
    upload(api, "w0", 0, 10, rand_delta(np.random.default_rng(1), init))
    st = wait_status(d, lambda st: st["async"]["updates"] == 1, "update 1")
    # committed, held back: step 0 went out less than 30 s ago
    assert st["outer_step"] == 1 and st["hub"]["published_step"] == 0 and st["hub"]["publish_pending"], st["hub"]
    assert dilocod_steps_in_history(api) == [0]
    assert d.stop() == 0
    # the default is for hf:// in async mode only: file:// (async) and hf:// (sync) publish every step
    f = Dilocod(tmp_path / "file", tmp_path / "file" / "hub", "--init-model", tmp_path / "init.safetensors",
                "--mode", "async", "--nodes", ",".join(NODES))
    (tmp_path / "file").mkdir()
    procs.append(f)
    f.start()
    assert wait_status(f, lambda st: "hub" in st, "/status")["hub"]["publish_interval"] == 0
    assert f.stop() == 0
    d2 = HfDilocod(tmp_path / "sync", hub, "--init-model", tmp_path / "init.safetensors",
                   "--nodes", ",".join(NODES), poll=0.2)
    (tmp_path / "sync").mkdir()
    procs.append(d2)
    d2.start()
    st = wait_status(d2, lambda st: "hub" in st, "/status")
    assert st["mode"] == "sync" and st["hub"]["publish_interval"] == 0, st["hub"]
    assert d2.stop() == 0
