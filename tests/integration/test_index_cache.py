"""Issue 21 item 5, file://: a sharded delta's index is read and parsed once per version of its file.

An index may be as large as the model's cap (st_index_cap_for: up to 10 MiB, ~60 ms to parse).  The
scan kept only the shard count of what it parsed, so intake read and parsed the index again at every
hand-over: a junk set refused at its shards, whose writer touches a shard, came back at every scan with
its index parsed each time (3 such nodes of a 20,000-tensor model, a 9.7 MB index each: 81 parses in
3 s, and an honest delta's intake 0.30 s -> 0.77 s).  The scan's parse now travels with the set (core/index_parse.h,
the transport's memo keyed by the index's identity: device, inode, size, mtime and ctime), and intake
uses it when the file it opens is still that version.

Asserted on the daemon's own counts (dilocod_index_parses_total{by="hub"|"intake"}), never on time:
  - each planted index is parsed once, by the scan, and intake parses none of them;
  - many scans later, and after each junk set was handed over and refused again three times (a shard
    touched each time), nothing was parsed again;
  - an index replaced by a new file is parsed again, once; one rewritten in place with its size and
    mtime put back (only ctime tells) is parsed again too;
  - an honest node's sharded delta is parsed once (by the scan) and taken: step 1 is the oracle's.
"""
import json
import os
import re
import shutil
import time
import urllib.request

import torch
from huggingface_hub import save_torch_state_dict

from dilocod_proc import Dilocod, Oracle, assert_state_close, delta_metadata, load_torch, write_model

NT = 2000
NAME = "model.layers.{:04d}.mlp.down_proj.weight"
# st_index_cap_for(model): 64 KiB, plus per floating tensor 6 bytes per name byte and 244 bytes
CAP = 64 * 1024 + NT * (6 * len(NAME.format(0)) + 16 + 200 + 28)
JUNK = ("x0", "x1", "x2")


def model():
    g = torch.Generator().manual_seed(11)
    return {NAME.format(i): torch.randn(4, generator=g) for i in range(NT)}


def junk_index(node, word="junk"):
    """Just under the model's index cap; it parses and names node and step 0, so intake takes it up to
    its shards (which are junk).  Two shards listed."""
    head = json.dumps({"metadata": {"total_size": 8, **delta_metadata(node, 0, 1)}})[:-1] + ', "weight_map": {'
    parts, size, i = [head], len(head), 0
    while True:
        e = f'"{word}.{i:07d}": "delta_1-00001-of-00002.safetensors", '
        if size + len(e) > CAP - 4096:
            break
        parts.append(e)
        size += len(e)
        i += 1
    parts.append('"last": "delta_1-00002-of-00002.safetensors"}}')
    return "".join(parts).encode()


def write_atomic(path, data):
    tmp = path.parent / f".{path.name}.tmp"
    tmp.write_bytes(data)
    os.rename(tmp, path)


def plant_junk(hub, node):
    d = hub / "nodes" / node
    d.mkdir(parents=True)
    for s in (1, 2):
        (d / f"delta_1-0000{s}-of-00002.safetensors").write_bytes(b"not a safetensors file")
    write_atomic(d / "delta_1.safetensors.index.json", junk_index(node))


def metrics(d):
    with urllib.request.urlopen(d.url + "/metrics", timeout=5) as r:
        text = r.read().decode()

    def one(pattern):
        m = re.search(rf"^{pattern} (\d+)$", text, re.M)
        assert m, f"{pattern} missing from /metrics"
        return int(m.group(1))

    return {"hub": one(r'dilocod_index_parses_total\{by="hub"\}'),
            "intake": one(r'dilocod_index_parses_total\{by="intake"\}'),
            "poll": one("dilocod_hub_last_poll_timestamp_seconds")}


def refusals(d, node):
    return d.log_text().count(f"delta rejected path=nodes/{node}/delta_1.safetensors.index.json")


def wait_scans(d, seconds):
    """Until the hub's last poll is `seconds` later than now: at --poll-interval 0.05, dozens of scans."""
    start = metrics(d)["poll"]
    d.wait_until(lambda: metrics(d)["poll"] >= start + seconds, f"polls {seconds} s on")


def write_honest_set(tmp, hub, node, delta):
    """A worker's sharded delta written the atomic way: shards in place first, the index renamed in last."""
    stage = tmp / f"stage-{node}"
    stage.mkdir()
    save_torch_state_dict(delta, str(stage), filename_pattern="delta_1{suffix}.safetensors",
                          max_shard_size=NT * 16 // 3, metadata=delta_metadata(node, 0, 1))
    index = stage / "delta_1.safetensors.index.json"
    assert index.exists() and len(list(stage.glob("delta_1-*.safetensors"))) >= 2
    dst = hub / "nodes" / node
    dst.mkdir(parents=True)
    for shard in sorted(stage.glob("delta_1-*.safetensors")):
        os.rename(shard, dst / shard.name)
    os.rename(index, dst / index.name)
    shutil.rmtree(stage)


def test_file_index_parsed_once_per_version(tmp_path):
    m = model()
    write_model(tmp_path / "init.safetensors", m)
    hub = tmp_path / "hub"
    for node in JUNK:
        plant_junk(hub, node)
    assert CAP - 8192 < len(junk_index("x0")) <= CAP
    d = Dilocod(tmp_path, hub, "--init-model", tmp_path / "init.safetensors", "--expected-nodes", "1").start()
    try:
        d.wait_step(0)
        for node in JUNK:
            d.wait_until(lambda: refusals(d, node) >= 1, f"{node}'s set refused")
        first = metrics(d)
        assert (first["hub"], first["intake"]) == (len(JUNK), 0), first

        # unchanged: however many scans, never read again
        wait_scans(d, 2)
        assert (metrics(d)["hub"], metrics(d)["intake"]) == (len(JUNK), 0)

        # a shard touched: the set is a new version, handed over and refused again, its index unchanged
        for round_ in range(3):
            before = {node: refusals(d, node) for node in JUNK}
            for node in JUNK:
                shard = hub / "nodes" / node / "delta_1-00001-of-00002.safetensors"
                t = time.time_ns() + (round_ + 1) * 1_000_000_000
                os.utime(shard, ns=(t, t))
            for node in JUNK:
                d.wait_until(lambda: refusals(d, node) > before[node], f"{node}'s touched set refused again")
        now = metrics(d)
        assert (now["hub"], now["intake"]) == (len(JUNK), 0), now

        # a new file under the index's name: parsed again, once, and intake uses that parse
        before = refusals(d, "x0")
        write_atomic(hub / "nodes" / "x0" / "delta_1.safetensors.index.json", junk_index("x0", "trash"))
        d.wait_until(lambda: refusals(d, "x0") > before, "x0's new index refused")
        now = metrics(d)
        assert (now["hub"], now["intake"]) == (len(JUNK) + 1, 0), now

        # rewritten in place with its size and mtime put back: only ctime says it changed
        index = hub / "nodes" / "x1" / "delta_1.safetensors.index.json"
        st = os.stat(index)
        data = index.read_bytes()
        with open(index, "r+b") as f:
            f.write(data.replace(b'"junk.0000000"', b'"jUnk.0000000"', 1))
        os.utime(index, ns=(st.st_atime_ns, st.st_mtime_ns))
        assert (os.stat(index).st_size, os.stat(index).st_mtime_ns) == (st.st_size, st.st_mtime_ns)
        d.wait_until(lambda: metrics(d)["hub"] > len(JUNK) + 1, "x1's rewritten index parsed again")
        wait_scans(d, 2)
        # (a scan that met it between the write and the utime saw one more version, which intake may
        # have read itself: counted from here on)
        settled = metrics(d)
        wait_scans(d, 2)
        assert (metrics(d)["hub"], metrics(d)["intake"]) == (settled["hub"], settled["intake"])

        # an honest sharded delta beside the junk: parsed once, by the scan, and taken
        g = torch.Generator().manual_seed(12)
        delta = {k: 0.01 * torch.randn(v.shape, generator=g) for k, v in m.items()}
        write_honest_set(tmp_path, hub, "h", delta)
        d.wait_step(1)
        now = metrics(d)
        assert (now["hub"], now["intake"]) == (settled["hub"] + 1, settled["intake"]), (settled, now)
        assert_state_close(load_torch(hub / "global" / "latest.safetensors"), Oracle(m).step({"h": delta}))
        assert d.stop() == 0        # a clean exit (under ASan: no leak of a kept parse)
    finally:
        d.stop()
