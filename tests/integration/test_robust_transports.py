"""The norm screen on the polled remote transports (README, "Robust aggregation"): s3:// on SeaweedFS with
boto3 workers, hf:// on the Hub emulator with the stock huggingface_hub client.

s3://: two honest nodes (one a sharded set written by huggingface_hub.save_torch_state_dict, one a
single file) and a third whose delta is 100x theirs.  The outlier is skipped at its offer with its
reason (basis "round"), downloaded once and judged once however many polls see it, and the round
commits over the honest two, equal to the torch oracle bit for bit.  The sharded set's intake norm
(merged from its shards' partial sums) is the norm's definition.

hf://: the outlier arrives first (nothing to compare it with: taken), then the honest two; the close
rechecks the whole round and quarantines it.  The step the Hub gets is the oracle's over the honest
nodes, and the record and /status say which delta was quarantined and why.

Every wait is on a state dilocod reports (/status, /rounds), never a sleep."""
import os

os.environ["HF_HUB_DISABLE_XET"] = "1"
os.environ["HF_HUB_DISABLE_TELEMETRY"] = "1"
os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"

from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import requests  # noqa: E402
from huggingface_hub import HfApi, hf_hub_download  # noqa: E402
from safetensors.numpy import save as np_save  # noqa: E402
from safetensors.torch import load as torch_load_bytes  # noqa: E402

from dilocod_proc import assert_state_equal, delta_metadata, random_deltas, write_model  # noqa: E402
from test_daemon_hf import REPO, TOKEN, WREV, HfDilocod, HubSim, _hf_home, procs  # noqa: E402,F401 (fixtures)
from test_robust import LR, MU, RuleOracle, norm_oracle, pytestmark  # noqa: E402,F401
from test_s3 import S3Dilocod, s3  # noqa: E402,F401 (the fixture)
from test_shards_hub import model, s3_list_requests, save_set  # noqa: E402

RATIO = 10


def honest_and_outlier(rng, state, nodes=("w0", "w1")):
    honest = {n: random_deltas(rng, state) for n in nodes}
    outlier = {k: (v * np.float32(100)).astype(np.float32) for k, v in random_deltas(rng, state).items()}
    return honest, outlier


def status(d):
    return requests.get(f"{d.url}/status", timeout=10).json()


def record_of(d, step):
    recs = requests.get(f"{d.url}/rounds", timeout=10).json().get("rounds", [])
    return next((r for r in recs if r.get("outer_step") == step), None)


def served_global(d):
    return torch_load_bytes(requests.get(f"{d.url}/global/latest.safetensors", timeout=30).content)


def check_quarantine(d, step, node, reason_basis, norm):
    """/status robust and /metrics name node's quarantine at step once, with its norm over its bound."""
    st = status(d)["robust"]
    assert st["max_norm_ratio"] == RATIO and st["quarantined_total"] == 1, st
    q = st["quarantined"][0]
    assert (q["node_id"], q["step"], q["reason"], q["basis"]) == (node, step, *reason_basis), q
    assert q["norm"] == norm and q["norm"] > q["bound"] > 0, q
    metrics = requests.get(f"{d.url}/metrics", timeout=10).text
    assert 'dilocod_deltas_quarantined_total{reason="norm_ratio"} 1' in metrics


# ---- s3:// ----------------------------------------------------------------------------------------

def test_s3_outlier_is_skipped_and_judged_once(tmp_path, s3):
    init = model()
    init_path = tmp_path / "init.safetensors"
    write_model(init_path, init)
    oracle = RuleOracle(init, "mean")
    d = S3Dilocod(tmp_path, s3, "robust/s3", "--init-model", init_path, "--lr", str(LR), "--momentum", str(MU),
                  "--expected-nodes", "3", "--round-timeout", "2", "--min-nodes", "2",
                  "--max-norm-ratio", str(RATIO)).start()
    put = d.client.put_object
    try:
        d.wait_step(0)
        honest, outlier = honest_and_outlier(np.random.default_rng(41), init)
        for name, path in save_set(tmp_path / "w0", "w0", 0, 10, honest["w0"]):
            put(Bucket=s3.bucket, Key=d.key(f"nodes/w0/{name}"), Body=path.read_bytes())
        put(Bucket=s3.bucket, Key=d.key("nodes/w1/delta_10.safetensors"),
            Body=np_save(honest["w1"], metadata=delta_metadata("w1", 0, 10)))
        d.wait_until(lambda: len(status(d)["round"]["received"]) == 2, "the honest deltas taken")
        bad_key = d.key("nodes/w2/delta_10.safetensors")
        put(Bucket=s3.bucket, Key=bad_key, Body=np_save(outlier, metadata=delta_metadata("w2", 0, 10)))
        d.wait_until(lambda: status(d)["robust"]["quarantined_total"] == 1, "the outlier quarantined")
        d.wait_step(1)
        assert_state_equal(served_global(d), oracle.step(honest))
        rec = record_of(d, 1)
        assert [n["node_id"] for n in rec["nodes"]] == ["w0", "w1"], rec
        # the set's norm, merged from its shards' partial sums, and the single file's: the definition
        assert [n["intake_norm"] for n in rec["nodes"]] == [norm_oracle(honest["w0"]), norm_oracle(honest["w1"])]
        # refused at its offer, so the closed round's record has it as a refusal, not a quarantine
        assert rec["quarantined"] == [], rec
        check_quarantine(d, 0, "w2", ("norm_ratio", "round"), norm_oracle(outlier))
        log = d.log_text()
        assert log.count("delta quarantined: not aggregated") == 1
        assert "node=w2 local_step=10 reason=norm_ratio" in log
        # judged once: the bucket still holds it, and the polls since the round closed left it alone
        lists = s3_list_requests(d)
        d.wait_until(lambda: s3_list_requests(d) >= lists + 3, "three more polls")
        assert d.log_text().count(f"s3 object downloaded key={bad_key} ") == 1
        assert status(d)["robust"]["quarantined_total"] == 1
        assert d.alive()
    finally:
        assert d.stop() == 0


# ---- hf:// ----------------------------------------------------------------------------------------

def hf_upload(api, node, base, local, tensors):
    api.upload_file(path_or_fileobj=np_save(tensors, metadata=delta_metadata(node, base, local)),
                    path_in_repo=f"nodes/{node}/delta_{local}.safetensors", repo_id=REPO, revision=WREV,
                    commit_message=f"upload {node} {local}")


def test_hf_outlier_taken_first_is_quarantined_at_close(tmp_path, procs):
    hub = HubSim(tmp_path)
    procs.append(hub)
    api = HfApi(endpoint=hub.wendpoint, token=TOKEN)
    api.create_repo(REPO)
    init = model()
    init_path = tmp_path / "init.safetensors"
    write_model(init_path, init)
    oracle = RuleOracle(init, "mean")
    d = HfDilocod(tmp_path, hub, "--init-model", init_path, "--lr", str(LR), "--momentum", str(MU),
                  "--expected-nodes", "3", "--max-norm-ratio", str(RATIO), "--retry-interval", "0.5", poll=0.2)
    procs.append(d)
    d.start()
    d.wait_published(0)
    honest, outlier = honest_and_outlier(np.random.default_rng(42), init)
    hf_upload(api, "w2", 0, 10, outlier)
    d.wait_until(lambda: [e["node_id"] for e in status(d)["round"]["received"]] == ["w2"],
                 "the outlier taken (nothing to compare it with yet)")
    for node in ("w0", "w1"):
        hf_upload(api, node, 0, 10, honest[node])
    d.wait_published(1)
    want = oracle.step(honest)
    assert_state_equal(served_global(d), want)
    on_hub = Path(hf_hub_download(REPO, "global/latest.safetensors", revision=WREV, endpoint=hub.wendpoint,
                                  token=TOKEN, cache_dir=str(tmp_path / "hf-cache"))).read_bytes()
    assert_state_equal(torch_load_bytes(on_hub), want)
    rec = record_of(d, 1)
    assert [n["node_id"] for n in rec["nodes"]] == ["w0", "w1"], rec
    assert [(q["node_id"], q["reason"]) for q in rec["quarantined"]] == [("w2", "norm_ratio")], rec
    assert rec["quarantined"][0]["norm"] == norm_oracle(outlier)
    check_quarantine(d, 0, "w2", ("norm_ratio", "round"), norm_oracle(outlier))
    assert d.log_text().count("delta quarantined: not aggregated") == 1
    assert d.stop() == 0
