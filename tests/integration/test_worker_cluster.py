"""diloco.Worker as a worker of a dilocod cluster (--cluster-shards S over one s3:// bucket): the bucket's
global/step_count.json names the step's own index, global/steps/<s>/model.safetensors.index.json, and its
shards model-0000i-of-0000S.safetensors beside it (server/README.md, "Cluster mode").  Two aggregators
bootstrap an empty SeaweedFS bucket from --init-model; two Workers over s3:// pull, push
nodes/<id>/delta_<n>.safetensors and wait, round after round, and every global they pull is torch's
outer Nesterov step on the mean of their deltas, bit for bit (dilocod_proc.Oracle).  A file:// copy of the
bucket's tree reads the same.  Without the daemon: the forms of step_count.json and of a step's index a
cluster never writes (a path leaving its directory, a step other than outer_step, a shard name outside
the pattern) are refused as HostileAnswer, through parse_step_count/parse_index and through a Worker over
a file:// tree and over s3://.  Harness: tests/integration/test_cluster.py."""
import json
import threading

import pytest
import torch
from safetensors.torch import save as st_torch_save

import diloco
from diloco.transport import index_place, parse_index, parse_step_count
from dilocod_proc import Oracle, assert_state_equal, module_for, write_model
from test_cluster import INDEX, LR, MOMENTUM, Bucket, Cluster, ClusterDilocod, Plan, StepWatcher, cluster_model
from test_s3 import s3  # noqa: F401 (the module's SeaweedFS fixture)
from test_daemon_hf import REPO, TOKEN, HubSim, _hf_home, procs  # noqa: F401 (fixtures; sets HF_HUB_DISABLE_XET)

S = 4
WORKERS = ["w1", "w2"]


@pytest.fixture
def s3_env(s3, monkeypatch):
    """The workers' credentials and endpoint from the usual environment, as boto3 users set them."""
    for k, v in s3.env().items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3.endpoint)
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    return s3


def snapshot(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


def worker_rounds(url, init, nrounds):
    """Each of WORKERS in a thread: nrounds of pull, perturb, push, wait -> ({round: {node: the global
    it pulled}}, {round: {node: the F32 delta it sent}})."""
    pulled, sent, errors = {}, {}, []

    def work(i, node):
        try:
            model = module_for(init)
            w = diloco.Worker(url, node)
            g = torch.Generator().manual_seed(500 + i)
            for r in range(nrounds):
                step = w.pull(model)
                assert step == r, (node, step, r)
                base = snapshot(model)
                pulled.setdefault(r, {})[node] = base
                with torch.no_grad():
                    for v in model.state_dict().values():
                        if v.is_floating_point():
                            v.add_((0.01 * torch.randn(v.shape, generator=g)).to(v.dtype))
                cur = model.state_dict()
                sent.setdefault(r, {})[node] = {k: base[k].float() - cur[k].float()
                                                for k in base if base[k].is_floating_point()}
                res = w.push(model, local_step=10 * (r + 1), loss=1.0 / (r + 1), tokens=64)
                assert res.status == "written", res
                assert w.wait(step + 1, timeout=90) >= step + 1
            # the last step's global too, and a pull of an unchanged step (If-None-Match) loads the baseline again
            pulled.setdefault(nrounds, {})[node] = (w.pull(model), snapshot(model))
            with torch.no_grad():
                model.state_dict()["head.bias"].add_(1.0)
            assert w.pull(model) == nrounds
            assert_state_equal(snapshot(model), pulled[nrounds][node][1])
        except BaseException as e:      # surfaced by the caller
            errors.append((node, e))

    threads = [threading.Thread(target=work, args=(i, n)) for i, n in enumerate(WORKERS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    return pulled, sent, errors


def copy_tree(bucket: Bucket, dest):
    """The bucket's prefix copied into dest as it is (aws s3 sync's layout)."""
    for rel in bucket.listing(skip_nodes=False):
        p = dest / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(bucket.get(rel))


def test_workers_of_a_two_aggregator_cluster_pull_torch_exact_globals(tmp_path, s3_env):
    rounds = 3
    init = cluster_model(70)
    init_path = tmp_path / "init.safetensors"
    write_model(init_path, init)
    prefix = "worker-cluster/k2"
    cl = Cluster(tmp_path, s3_env, prefix, S, 5)
    watcher = StepWatcher(s3_env, prefix)
    try:
        for i in ("agg-a", "agg-b"):
            d = ClusterDilocod(cl.tmp, cl.s3, cl.prefix, i, cl.shards, cl.lease, "--init-model", str(init_path),
                               nodes=len(WORKERS))
            cl.procs[i] = d
            d.start()
        cl.wait_ready()
        url = f"s3://{s3_env.bucket}/{prefix}"
        pulled, sent, errors = worker_rounds(url, init, rounds)
        if errors:
            cl.fail(f"the workers failed: {errors}")
        # what the workers pulled is torch's outer step on what they pushed, every round
        oracle = Oracle(init, lr=LR, momentum=MOMENTUM, nesterov=True)
        for r in range(rounds + 1):
            if r:
                oracle.step(sent[r - 1])
            for node in WORKERS:
                got = pulled[r][node]
                if r == rounds:
                    step, got = got
                    assert step == rounds
                try:
                    assert_state_equal(got, oracle.state)
                except AssertionError as e:
                    cl.fail(f"{node}'s global of step {r} differs from torch's: {e}")
        # the steps were the cluster's own, each published once, the work shared
        sc = cl.bucket.step_count()
        assert sc["outer_step"] == rounds and sc["model_file"] == f"global/steps/{rounds}/{INDEX}", sc
        index = json.loads(cl.bucket.get(sc["model_file"]))
        plan = Plan(cl.bucket.get("global/latest.safetensors"), S)
        assert index["weight_map"] == plan.weight_map(), index["weight_map"]
        cl.wait_publishes(rounds)
        watcher.stop()
        watcher.check(range(rounds + 1))
        # the workers' uploads are in the bucket where a single dilocod takes them
        nodes = {rel for rel in cl.bucket.listing(skip_nodes=False) if rel.startswith("nodes/")}
        for node in WORKERS:
            assert f"nodes/{node}/delta_{10 * rounds}.safetensors" in nodes, sorted(nodes)
        # a fresh worker over s3://, and one over a file:// copy of the bucket's tree, pull the same step
        for u in (url, f"file://{tmp_path / 'copy'}"):
            if u.startswith("file://"):
                copy_tree(cl.bucket, tmp_path / "copy")
            model = module_for(init)
            assert diloco.Worker(u, "w9").pull(model) == rounds
            assert_state_equal(snapshot(model), oracle.state)
    finally:
        watcher.stop()
        cl.stop()


# ---- refusals: what a cluster never writes ----------------------------------------------------------

def step_count(step, model_file):
    return json.dumps({"algorithm": "dumb_diloco", "optimizer": "nesterov_sgd", "outer_step": step,
                       "model_file": model_file}).encode()


def test_parse_step_count_takes_exactly_a_clusters_step_index():
    for step, mf in ((7, "global/steps/7/model.safetensors.index.json"),
                     (0, "global/steps/0/model.safetensors.index.json"),
                     (12, "global/steps/12/model.g1.safetensors.index.json"),     # a refusal's generation
                     (3, "global/latest.safetensors"), (3, "global/latest.safetensors.index.json")):
        assert parse_step_count(step_count(step, mf), "step_count.json") == (step, mf)
    assert index_place("global/steps/7/model.safetensors.index.json") == ("global/steps/7", "model")
    assert index_place("global/steps/7/model.g2.safetensors.index.json") == ("global/steps/7", "model.g2")
    assert index_place("global/latest.safetensors.index.json") == ("global", "latest")
    assert index_place("global/latest.safetensors") is None


@pytest.mark.parametrize("step,mf,match", [
    (7, "global/steps/7/../../../etc/model.safetensors.index.json", "neither"),
    (7, "global/steps/7/../7/model.safetensors.index.json", "neither"),
    (7, "global/steps/../steps/7/model.safetensors.index.json", "neither"),
    (7, "/global/steps/7/model.safetensors.index.json", "neither"),
    (7, "global/steps/7/sub/model.safetensors.index.json", "neither"),
    (7, "global/steps/7//model.safetensors.index.json", "neither"),
    (7, "global/steps/07/model.safetensors.index.json", "neither"),
    (7, "global/steps/\u0667/model.safetensors.index.json", "neither"),        # an Arabic-Indic 7
    (7, "global/steps/7/model.safetensors.index.json\n", "neither"),
    (7, "global/steps/7/other.safetensors.index.json", "neither"),
    (7, "global/steps/7/model.g0.safetensors.index.json", "neither"),
    (7, "global/steps/7/model.safetensors", "neither"),
    (7, "global/steps/7/model-00001-of-00004.safetensors", "neither"),
    (7, ["global/steps/7/model.safetensors.index.json"], "neither"),
    (7, "global/steps/6/model.safetensors.index.json", "step 6's, for outer_step 7"),
    (7, "global/steps/8/model.g1.safetensors.index.json", "step 8's, for outer_step 7"),
])
def test_parse_step_count_refuses_what_a_cluster_never_writes(step, mf, match):
    with pytest.raises(diloco.HostileAnswer, match=match):
        parse_step_count(step_count(step, mf), "global/step_count.json")


def test_parse_index_of_a_cluster_step():
    wm = {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}
    doc = json.dumps({"metadata": {"total_size": 8}, "weight_map": wm}).encode()
    assert parse_index(doc, "global/steps/3/model.safetensors.index.json", "model") == wm
    # the shards of one index are its base's: the latest set's names are not a cluster step's, and back
    with pytest.raises(diloco.HostileAnswer, match="not a name latest-0000i-of-0000N"):
        parse_index(doc, "global/latest.safetensors.index.json", "latest")
    g1 = {"a": "model.g1-00001-of-00001.safetensors"}
    assert parse_index(json.dumps({"weight_map": g1}).encode(), "x", "model.g1") == g1


@pytest.mark.parametrize("shard,match", [
    ("../model-00001-of-00002.safetensors", "not a name model-0000i-of-0000N"),
    ("../../nodes/w1/model-00001-of-00002.safetensors", "not a name"),
    ("sub/model-00001-of-00002.safetensors", "not a name"),
    ("/model-00001-of-00002.safetensors", "not a name"),
    ("model-00001-of-00002.safetensors/..", "not a name"),
    ("model-00001-of-00002.safetensors\n", "not a name"),
    ("model-0001-of-00002.safetensors", "not a name"),
    ("model-\u0661\u0660\u0660\u0660\u0660-of-00002.safetensors", "not a name"),   # Arabic-Indic digits
    ("latest-00001-of-00002.safetensors", "not a name"),
    ("model.g1-00001-of-00002.safetensors", "not a name"),
    ("modelX00001-of-00002.safetensors", "not a name"),
    ("model-00003-of-00002.safetensors", "outside 1..2"),
    ("model-00000-of-00002.safetensors", "outside 1..2"),
    ("model-00001-of-00003.safetensors", "several counts"),
    (7, "not a name"),
])
def test_parse_index_refuses_a_shard_outside_the_pattern(shard, match):
    wm = {"a": "model-00002-of-00002.safetensors", "b": shard}
    with pytest.raises(diloco.HostileAnswer, match=match):
        parse_index(json.dumps({"weight_map": wm}).encode(), "global/steps/3/model.safetensors.index.json",
                    "model")


def hostile_cases(init):
    """(name, {relative path: bytes}, the refusal's words): a cluster step's tree made hostile one way each;
    the files a good step has are there too, so that only the refusal can stop the pull."""
    raw = st_torch_save({k: v.contiguous() for k, v in init.items()})
    good_wm = {k: "model-00001-of-00001.safetensors" for k in init}
    index = json.dumps({"metadata": {"total_size": 1}, "weight_map": good_wm}).encode()
    good = {"global/steps/5/model.safetensors.index.json": index,
            "global/steps/5/model-00001-of-00001.safetensors": raw,
            "global/steps/4/model.safetensors.index.json": index,
            "global/steps/4/model-00001-of-00001.safetensors": raw,
            "nodes/model-00001-of-00001.safetensors": raw}
    leaving = dict(good_wm, **{"head.bias": "../../../nodes/model-00001-of-00001.safetensors"})
    other = dict(good_wm, **{"head.bias": "latest-00001-of-00001.safetensors"})
    return [
        ("dotdot", dict(good, **{"global/step_count.json": step_count(
            5, "global/steps/5/../4/model.safetensors.index.json")}), "neither global/latest.safetensors"),
        ("another-step", dict(good, **{"global/step_count.json": step_count(
            5, "global/steps/4/model.safetensors.index.json")}), "step 4's, for outer_step 5"),
        ("shard-leaving", dict(good, **{
            "global/step_count.json": step_count(5, "global/steps/5/model.safetensors.index.json"),
            "global/steps/5/model.safetensors.index.json": json.dumps({"weight_map": leaving}).encode()}),
         "not a name model-0000i-of-0000N"),
        ("shard-of-another-base", dict(good, **{
            "global/step_count.json": step_count(5, "global/steps/5/model.safetensors.index.json"),
            "global/steps/5/model.safetensors.index.json": json.dumps({"weight_map": other}).encode()}),
         "not a name model-0000i-of-0000N"),
    ]


def refused(url, init, match):
    model = module_for(init)
    before = snapshot(model)
    w = diloco.Worker(url, "w0")
    with pytest.raises(diloco.HostileAnswer, match=match):
        w.pull(model)
    assert_state_equal(snapshot(model), before)
    assert w.baseline is None


def write_tree(root, files):
    for rel, body in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(body)
    return root


def good_case(init):
    """hostile_cases' tree with a step_count.json a cluster writes."""
    return dict(hostile_cases(init)[0][1], **{"global/step_count.json": step_count(
        5, "global/steps/5/model.safetensors.index.json")})


def test_hostile_cluster_trees_over_file(tmp_path):
    init = cluster_model(71)
    for name, files, match in hostile_cases(init):
        refused(f"file://{write_tree(tmp_path / name, files)}", init, match)
    # the same tree made good is read (the refusals above are the hostile parts')
    model = module_for(init)
    assert diloco.Worker(f"file://{write_tree(tmp_path / 'good', good_case(init))}", "w0").pull(model) == 5
    assert_state_equal(snapshot(model), init)


def test_cluster_tree_over_hf(tmp_path, procs, monkeypatch):
    """hf:// is not a cluster's transport (--cluster-shards is s3:// only), but a copy of a cluster step's
    tree in a Hub repo reads as over file://, with the same refusals."""
    from huggingface_hub import HfApi
    hub = HubSim(tmp_path)
    procs.append(hub)
    api = HfApi(endpoint=hub.wendpoint, token=TOKEN)
    api.create_repo(REPO)
    monkeypatch.setenv("HF_ENDPOINT", hub.wendpoint)
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    init = cluster_model(73)
    api.upload_folder(repo_id=REPO, folder_path=str(write_tree(tmp_path / "good", good_case(init))))
    model = module_for(init)
    assert diloco.Worker(f"hf://{REPO}", "w0").pull(model) == 5
    assert_state_equal(snapshot(model), init)
    for name, files, match in hostile_cases(init)[1:3]:
        api.upload_folder(repo_id=REPO, folder_path=str(write_tree(tmp_path / name, files)))
        refused(f"hf://{REPO}", init, match)


def test_hostile_cluster_trees_over_s3(s3_env):
    init = cluster_model(72)
    c = s3_env.client()
    for name, files, match in hostile_cases(init):
        prefix = f"worker-cluster/hostile-{name}"
        for rel, body in files.items():
            c.put_object(Bucket=s3_env.bucket, Key=f"{prefix}/{rel}", Body=body)
        refused(f"s3://{s3_env.bucket}/{prefix}", init, match)
