"""A cluster bootstraps an empty bucket (issue 34: the cluster's refusals lifted): K aggregators started
together with the same --init-model publish one step 0, the reference's bootstrap (global/latest.safetensors,
then step_count.json with "bootstrap": "true", each written once), and the rounds after it are bit-exact with
torch.  A late aggregator adopts the bucket's step 0 whatever its --init-model (the option is for an empty
bucket, as a single dilocod's is for an empty state), and says so; one that finds a half-written bootstrap
from another file refuses to overwrite it and says why.  Through the real
build/dilocod against SeaweedFS; harness: tests/integration/test_cluster.py."""
import json

import numpy as np

from dilocod_proc import Oracle, write_model
from safetensors.torch import save as st_torch_save
from test_cluster import (NODES, Cluster, ClusterDilocod, Plan, StepWatcher, cluster_model, random_deltas,
                          run_round)
from test_s3 import s3  # noqa: F401 (the module's SeaweedFS fixture)

S = 4


def test_cluster_bootstraps_an_empty_bucket_once(tmp_path, s3):
    init = cluster_model(60)
    init_path = tmp_path / "init.safetensors"
    write_model(init_path, init)
    prefix = "bootstrap/empty"
    cl = Cluster(tmp_path, s3, prefix, S, 5)
    watcher = StepWatcher(s3, prefix)
    rng = np.random.default_rng(60)
    try:
        assert not cl.bucket.exists("global/step_count.json")
        for i in ("agg-a", "agg-b", "agg-c"):
            d = ClusterDilocod(cl.tmp, cl.s3, cl.prefix, i, cl.shards, cl.lease, "--init-model", str(init_path))
            cl.procs[i] = d
            d.start()
        cl.wait(lambda: isinstance(cl.bucket.step_count(), dict), "step 0 published in the bucket", 30)
        sc = cl.bucket.step_count()
        assert sc["outer_step"] == 0 and sc["model_file"] == "global/latest.safetensors", sc
        assert sc.get("bootstrap") in ("true", True), sc
        raw = cl.bucket.get("global/latest.safetensors")
        assert raw == init_path.read_bytes()
        cl.wait_ready()
        logs = "".join(d.log_text() for d in cl.procs.values())
        assert logs.count("bootstrapped: step 0 published from --init-model") == 1, cl.logs()
        # the rounds after it, as torch computes them
        plan = Plan(raw, S)
        oracle = Oracle(init, lr=0.7, momentum=0.9)
        for step in (1, 2):
            run_round(cl, plan, oracle, {n: random_deltas(rng, init) for n in NODES}, step)
        # a late aggregator given another file: the bucket's step 0 stands, it says so and joins the rounds
        other = {k: v.clone() for k, v in init.items()}
        other["head.bias"] += 1
        other_path = tmp_path / "other.safetensors"
        other_path.write_bytes(st_torch_save({k: v.contiguous() for k, v in other.items()}))
        d = ClusterDilocod(cl.tmp, cl.s3, cl.prefix, "agg-d", cl.shards, cl.lease, "--init-model", str(other_path))
        cl.procs["agg-d"] = d
        d.start()
        cl.wait_ready(step=2)
        assert "bootstrapped" not in d.log_text(), d.log_text()
        assert "the bucket holds a global: --init-model is not used" in d.log_text(), d.log_text()
        run_round(cl, plan, oracle, {n: random_deltas(rng, init) for n in NODES}, 3)
        assert cl.bucket.get("global/latest.safetensors") == raw
        watcher.stop()
        watcher.check([0, 1, 2, 3])
    finally:
        watcher.stop()
        cl.stop()


def test_cluster_refuses_a_different_init_model_in_a_half_bootstrapped_bucket(tmp_path, s3):
    """A bucket whose global/latest.safetensors holds other bytes and no step file (a bootstrap that
    crashed, from another file): the aggregator never overwrites it, says why, and publishes nothing."""
    init = cluster_model(61)
    init_path = tmp_path / "init.safetensors"
    write_model(init_path, init)
    cl = Cluster(tmp_path, s3, "bootstrap/conflict", S, 5)
    try:
        planted = st_torch_save({k: v.contiguous() + (1 if v.is_floating_point() else 0) for k, v in init.items()})
        cl.bucket.put("global/latest.safetensors", planted)
        d = ClusterDilocod(cl.tmp, cl.s3, cl.prefix, "agg-a", cl.shards, cl.lease, "--init-model", str(init_path))
        cl.procs["agg-a"] = d
        d.start()
        cl.wait(lambda: "must be given the same file" in d.log_text(), "the conflict named in the log", 30)
        assert not cl.bucket.exists("global/step_count.json")
        assert cl.bucket.get("global/latest.safetensors") == planted
        st = d.cluster()
        assert st is not None and st["state"] == "waiting_for_global", st
        assert json.dumps(st)  # /status still answers
    finally:
        cl.stop()


def test_cluster_bootstraps_an_empty_bucket_from_a_set(tmp_path, s3):
    """--init-model INDEX.json (a sharded checkpoint, as huggingface_hub saves one): two aggregators publish
    one step 0 as one dilocod publishes a sharded global (global/latest-0000i-of-0000N.safetensors, the
    shards' bytes as they are, and global/latest.safetensors.index.json naming them), which
    huggingface_hub loads as the init model; the rounds after it are bit-exact with torch, as from the
    same model in one file."""
    from huggingface_hub import load_torch_model
    from test_cluster import module_for, st_header

    init = cluster_model(62)
    single = st_torch_save({k: v.contiguous() for k, v in init.items()})
    h = st_header(single)
    order = sorted(h, key=lambda k: h[k]["data_offsets"][0])
    halves = [order[:len(order) // 2], order[len(order) // 2:]]
    set_dir = tmp_path / "init"
    set_dir.mkdir()
    names = [f"model-{i + 1:05d}-of-00002.safetensors" for i in range(2)]
    for name, keys in zip(names, halves):
        (set_dir / name).write_bytes(st_torch_save({k: init[k].contiguous() for k in keys}))
    index = set_dir / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {"total_size": sum(h[k]["data_offsets"][1] - h[k]["data_offsets"][0]
                                                                for k in order)},
                                 "weight_map": {k: names[i] for i, keys in enumerate(halves) for k in keys}}))
    cl = Cluster(tmp_path, s3, "bootstrap/set", S, 5)
    watcher = StepWatcher(s3, "bootstrap/set")
    rng = np.random.default_rng(62)
    try:
        for i in ("agg-a", "agg-b"):
            d = ClusterDilocod(cl.tmp, cl.s3, cl.prefix, i, cl.shards, cl.lease, "--init-model", str(index))
            cl.procs[i] = d
            d.start()
        cl.wait(lambda: isinstance(cl.bucket.step_count(), dict), "step 0 published in the bucket", 30)
        sc = cl.bucket.step_count()
        assert sc["outer_step"] == 0 and sc["model_file"] == "global/latest.safetensors.index.json", sc
        assert sc.get("bootstrap") in ("true", True), sc
        out = tmp_path / "step0"
        out.mkdir()
        published = json.loads(cl.bucket.get("global/latest.safetensors.index.json"))
        shard_names = sorted(set(published["weight_map"].values()))
        assert shard_names == ["latest-00001-of-00002.safetensors", "latest-00002-of-00002.safetensors"], published
        for i, name in enumerate(shard_names):
            raw = cl.bucket.get(f"global/{name}")
            assert raw == (set_dir / names[i]).read_bytes(), name      # the shard's bytes as they are
            (out / name).write_bytes(raw)
        (out / "model.safetensors.index.json").write_text(
            json.dumps({**published, "weight_map": {k: v.replace("latest", "model") for k, v in
                                                    published["weight_map"].items()}}))
        for i, name in enumerate(shard_names):
            (out / name).rename(out / name.replace("latest", "model"))
        module = module_for(init)
        load_torch_model(module, str(out), strict=True)
        for k, v in module.state_dict().items():
            assert v.equal(init[k]), k
        cl.wait_ready()
        logs = "".join(d.log_text() for d in cl.procs.values())
        assert logs.count("bootstrapped: step 0 published from --init-model") == 1, cl.logs()
        plan = Plan(single, S)
        oracle = Oracle(init, lr=0.7, momentum=0.9)
        for step in (1, 2):
            run_round(cl, plan, oracle, {n: random_deltas(rng, init) for n in NODES}, step)
        watcher.stop()
        watcher.check([0, 1, 2])
    finally:
        watcher.stop()
        cl.stop()
