"""Verdicts a worker can read (issue 36): GET /nodes/<id> against the real dilocod over real HTTP and the
worker package.  Refusals at arrival (422, 409) and quarantines at the round's close are recorded with
their reason, the counters (/status, /metrics, the dashboard's sum) agree with the records, a close-time
quarantine answered 201 shows up as quarantined, the records survive kill -9, stay bounded (32 per node,
64 nodes, a node's own records only) and a damaged verdicts.json is refused loudly; a polled transport
with --listen serves them too."""
import json
import re
import urllib.error
import urllib.request

import pytest
import torch
from safetensors.torch import save as st_save

import diloco
from diloco.errors import HostileAnswer
from diloco.transport import parse_node_verdicts
from conftest import run
from dilocod_proc import Dilocod, delta_metadata, write_model

OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def init_state():
    g = torch.Generator().manual_seed(7)
    return {"a.w": torch.randn(8, 4, generator=g), "b.w": torch.randn(16, generator=g)}


def start(tmp_path, *args, hub=None):
    write_model(tmp_path / "init.safetensors", init_state())
    d = Dilocod(tmp_path, hub, "--init-model", str(tmp_path / "init.safetensors"), *args).start()
    d.wait_until(lambda: (d.get_json("/status") or {}).get("outer_step") == 0, "step 0")
    return d


def body(node, base, local, tensors):
    return st_save({k: v.contiguous() for k, v in tensors.items()}, metadata=delta_metadata(node, base, local))


def good(scale=0.01, seed=1):
    g = torch.Generator().manual_seed(seed)
    return {k: scale * torch.randn(v.shape, generator=g) for k, v in init_state().items()}


def misshapen():
    return {"a.w": torch.zeros(3, 3), "b.w": torch.zeros(16)}


def request(d, method, path, data=None):
    req = urllib.request.Request(d.url + path, data=data, method=method)
    try:
        with OPENER.open(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def put(d, node, local, data):
    return request(d, "PUT", f"/nodes/{node}/delta_{local}.safetensors", data)


def node_doc(d, node):
    return request(d, "GET", f"/nodes/{node}")


def status(d):
    return d.get_json("/status") or {}


def metrics(d):
    with OPENER.open(d.url + "/metrics", timeout=10) as r:
        return r.read().decode()


def metric(text, name, labels=""):
    m = re.search(rf"^dilocod_{name}{re.escape(labels)} (\d+)$", text, re.M)
    return int(m.group(1)) if m else None


def persisted(d):
    v = status(d).get("verdicts") or {}
    return v.get("changes") is not None and v.get("persisted") == v.get("changes")


# ---- refusals at arrival ---------------------------------------------------------------------------

def test_three_422s_are_recorded_and_the_counters_agree(tmp_path, diloco_bin):
    d = start(tmp_path, "--expected-nodes", "2")
    try:
        for local in (1, 2, 3):
            code, ans = put(d, "w0", local, body("w0", 0, local, misshapen()))
            assert code == 422 and ans["error"]["code"] == "shape_mismatch", ans
        code, doc = node_doc(d, "w0")
        assert code == 200, doc
        assert doc["node_id"] == "w0" and doc["total"] == 3 and doc["counts"] == {"shape_mismatch": 3}, doc
        assert [r["local_step"] for r in doc["deltas"]] == [3, 2, 1]            # newest first
        for r in doc["deltas"]:
            assert r["verdict"] == "refused" and r["reason"] == "shape_mismatch" and r["status"] == 422, r
            assert r["base_outer_step"] == 0 and r["step"] == 0 and "a.w" in r["message"], r
        c = status(d)["counters"]
        assert c["rejected"] == 3 and c["refused"] == 0, c
        text = metrics(d)
        assert metric(text, "deltas_rejected_total", '{code="shape_mismatch"}') == 3
        assert metric(text, "http_requests_total", '{route="node",code="200"}') == 1
        # the package's call returns the same document
        assert diloco.Worker(d.url, "w0").verdicts() == parse_node_verdicts(json.dumps(doc).encode(), "w0")
        # a refusal by the round's rules: a delta from the future (409), counted and recorded alike
        code, ans = put(d, "w0", 4, body("w0", 5, 4, good()))
        assert code == 409 and ans["error"]["code"] == "future", ans
        _, doc = node_doc(d, "w0")
        assert doc["deltas"][0]["verdict"] == "refused" and doc["deltas"][0]["reason"] == "future"
        assert doc["deltas"][0]["status"] == 409 and doc["counts"]["future"] == 1
        c = status(d)["counters"]
        assert c["future"] == 1 and c["refused"] == 1 and c["rejected"] == 3, c
        # an unknown node: 404 in the project's error JSON; the package says None
        code, err = node_doc(d, "nobody")
        assert code == 404 and err["error"]["code"] == "unknown_node" and err["error"]["message"], err
        assert diloco.Worker(d.url, "nobody").verdicts() is None
        # the C tool: diloco status --node
        out = run([diloco_bin, "status", "--server", d.url, "--node", "w0"], check=0).stdout
        assert "node w0: 4 verdicts" in out and "shape_mismatch 3" in out and "future 1" in out, out
        assert out.count(" refused ") == 4, out
        out = run([diloco_bin, "status", "--server", d.url, "--node", "w0", "--json"], check=0).stdout
        assert json.loads(out) == node_doc(d, "w0")[1]
        r = run([diloco_bin, "status", "--server", d.url, "--node", "nobody"])
        assert r.returncode == 4 and "unknown_node" in r.stderr, (r.returncode, r.stderr)
        assert run([diloco_bin, "status", "--server", d.url, "--node", "../x"]).returncode == 2
    finally:
        assert d.stop() == 0


# ---- the close decides -----------------------------------------------------------------------------

def test_close_time_quarantine_answered_201_then_visible(tmp_path):
    """--max-norm-ratio 10, three nodes: an outlier sent first has nothing to compare with yet and is
    taken (201, not final), then quarantined at the close; the honest two are aggregated into step 1.  In
    round 2 an outlier sent last is quarantined at arrival (422 outlier), counted in the dashboard's sum."""
    d = start(tmp_path, "--expected-nodes", "3", "--round-timeout", "1", "--min-nodes", "2",
              "--max-norm-ratio", "10")
    try:
        code, ans = put(d, "w2", 1, body("w2", 0, 1, good(scale=10.0, seed=3)))
        assert code == 201 and ans["result"] == "accepted", ans
        assert ans["final"] is False and ans["decided_at"] == "round_close" and ans["verdicts"] == "/nodes/w2", ans
        for i in range(2):
            code, ans = put(d, f"w{i}", 1, body(f"w{i}", 0, 1, good(seed=10 + i)))
            assert code == 201, ans
        d.wait_until(lambda: status(d).get("outer_step") == 1, "step 1")
        d.wait_until(lambda: node_doc(d, "w0")[1]["deltas"][0]["verdict"] == "aggregated", "w0 aggregated")
        _, doc = node_doc(d, "w2")
        r = doc["deltas"][0]
        assert r["verdict"] == "quarantined" and r["reason"] == "norm_ratio", doc
        assert r["status"] == 201 and r["local_step"] == 1 and r["base_outer_step"] == 0, r
        assert "norm" in r["message"] and "bound" in r["message"], r
        assert doc["counts"] == {"accepted": 1, "norm_ratio": 1} and doc["total"] == 2, doc
        _, w0 = node_doc(d, "w0")
        assert w0["deltas"][0]["verdict"] == "aggregated" and w0["deltas"][0]["step"] == 1, w0
        assert w0["counts"] == {"accepted": 1, "aggregated": 1}, w0
        assert diloco.Worker(d.url, "w2").verdicts()["deltas"][0]["verdict"] == "quarantined"
        # round 2: the outlier last is quarantined at arrival
        for i in range(2):
            assert put(d, f"w{i}", 2, body(f"w{i}", 1, 2, good(seed=20 + i)))[0] == 201
        code, ans = put(d, "w2", 2, body("w2", 1, 2, good(scale=10.0, seed=4)))
        assert code == 422 and ans["error"]["code"] == "outlier", ans
        _, doc = node_doc(d, "w2")
        assert doc["deltas"][0]["verdict"] == "quarantined" and doc["deltas"][0]["reason"] == "outlier", doc
        assert doc["deltas"][0]["status"] == 422
        c = status(d)["counters"]
        assert c["outlier"] == 1 and c["refused"] == 1 and c["rejected"] == 0, c
        robust = status(d)["robust"]
        # every quarantine robust counts is in the records (at arrival "outlier", at the close its reason)
        assert robust["quarantined_total"] == doc["counts"]["outlier"] + doc["counts"]["norm_ratio"] == 2
    finally:
        assert d.stop() == 0


# ---- durability, bounds ----------------------------------------------------------------------------

def test_records_survive_kill9_and_a_damaged_file_is_refused_loudly(tmp_path):
    d = start(tmp_path, "--expected-nodes", "2")
    try:
        for local in (1, 2):
            assert put(d, "w0", local, body("w0", 0, local, misshapen()))[0] == 422
        assert put(d, "w1", 1, body("w1", 0, 1, good()))[0] == 201
        d.wait_until(lambda: persisted(d), "verdicts.json written")
        before = {n: node_doc(d, n)[1] for n in ("w0", "w1")}
        d.kill9()
        d.start()
        d.wait_until(lambda: (d.get_json("/status") or {}).get("outer_step") == 0, "step 0 again")
        after = {n: node_doc(d, n)[1] for n in ("w0", "w1")}
        assert after == before
        assert (d.state_dir / "verdicts.json").exists()
        assert d.stop() == 0
        # a damaged file: refused as a whole, said at error level, kept aside; the daemon runs
        (d.state_dir / "verdicts.json").write_text('{"version":1,"dropped_nodes":0,"nodes":[{"node_id":"w0",'
                                                   '"total":5,"counts":{"shape_mismatch":2},"deltas":[]}]}')
        d.start()
        d.wait_log("verdicts.json refused")
        assert node_doc(d, "w0")[0] == 404
        assert (d.state_dir / "verdicts.json.refused").exists()
        assert d.stop() == 0
        # hostile: over the cap, not JSON, a node id that leaves its directory
        for n, text in enumerate(("x" * (5 << 20), "\x00{}", '{"version":1,"dropped_nodes":0,"nodes":[{"node_id":"../x",'
                     '"total":0,"counts":{},"deltas":[]}]}')):
            (d.state_dir / "verdicts.json").write_text(text)
            d.start()
            d.wait_log("verdicts.json refused", count=2 + n)
            assert node_doc(d, "x")[0] == 404 and d.alive()
            assert d.stop() == 0
    finally:
        d.stop()


def test_more_than_32_keep_the_last_32_and_exact_counts(tmp_path):
    d = start(tmp_path, "--expected-nodes", "2")
    try:
        for local in range(1, 41):
            assert put(d, "w0", local, body("w0", 0, local, misshapen()))[0] == 422
        assert put(d, "w0", 41, body("w0", 9, 41, good()))[0] == 409
        _, doc = node_doc(d, "w0")
        assert len(doc["deltas"]) == 32 and doc["total"] == 41, doc
        assert doc["counts"] == {"shape_mismatch": 40, "future": 1}
        assert [r["local_step"] for r in doc["deltas"]] == list(range(41, 9, -1))
        assert status(d)["counters"]["rejected"] == 40
    finally:
        assert d.stop() == 0


def test_node_ids_are_bounded_and_hostile_ones_refused(tmp_path):
    d = start(tmp_path, "--expected-nodes", "2")
    try:
        for i in range(80):
            assert put(d, f"n{i:02d}", 1, body(f"n{i:02d}", 0, 1, misshapen()))[0] == 422
        v = status(d)["verdicts"]
        assert v["nodes"] == 64 and v["dropped_nodes"] == 16, v
        assert node_doc(d, "n00")[0] == 404 and node_doc(d, "n79")[0] == 200
        assert metric(metrics(d), "verdict_nodes") == 64
        # a node's records are its own: metadata claiming another node lands in the uploader's
        code, ans = request(d, "POST", "/nodes/n79/deltas", body("victim", 0, 2, good()))
        assert code == 422 and ans["error"]["code"] == "path_mismatch", ans
        assert node_doc(d, "victim")[0] == 404
        assert node_doc(d, "n79")[1]["counts"]["path_mismatch"] == 1
        # hostile ids: never a crash, never a record
        for path in ("/nodes/..", "/nodes/.", "/nodes/" + "a" * 65, "/nodes/a%2Fb", "/nodes/%00"):
            code, err = request(d, "GET", path)
            assert code in (400, 404) and "error" in err, (path, err)
        assert request(d, "DELETE", "/nodes/n79")[0] == 405
        assert d.alive()
    finally:
        assert d.stop() == 0


# ---- a polled transport with --listen --------------------------------------------------------------

def test_file_transport_serves_verdicts_with_listen(tmp_path):
    hub = tmp_path / "hub"
    hub.mkdir()
    d = start(tmp_path, "--expected-nodes", "2", hub=hub)
    try:
        nd = hub / "nodes" / "f0"
        nd.mkdir(parents=True)
        (nd / "delta_1.safetensors.tmp").write_bytes(body("f0", 0, 1, misshapen()))
        (nd / "delta_1.safetensors.tmp").rename(nd / "delta_1.safetensors")
        d.wait_until(lambda: node_doc(d, "f0")[0] == 200, "the tree's delta judged")
        _, doc = node_doc(d, "f0")
        r = doc["deltas"][0]
        assert r["verdict"] == "refused" and r["reason"] == "shape_mismatch" and r["status"] is None, doc
        w = diloco.Worker(f"file://{hub}", "f0", listen=d.url)
        assert w.verdicts() == parse_node_verdicts(json.dumps(doc).encode(), "f0")
        with pytest.raises(ValueError):
            diloco.Worker(f"file://{hub}", "f0").verdicts()
    finally:
        assert d.stop() == 0


# ---- the package refuses a hostile answer ----------------------------------------------------------

@pytest.mark.parametrize("doc", [
    {"node_id": "other", "total": 0, "counts": {}, "deltas": []},
    {"node_id": "w0", "total": 2, "counts": {"x": 1}, "deltas": []},
    {"node_id": "w0", "total": 1, "counts": {"Bad Reason": 1}, "deltas": []},
    {"node_id": "w0", "total": 0, "counts": {}, "deltas": [{"verdict": "pwned"}]},
    {"node_id": "w0", "total": 0, "counts": {}, "deltas": [{}] * 33},
    {"node_id": "w0", "total": 0, "counts": {}, "deltas": [
        {"verdict": "refused", "reason": "x", "status": 99999, "local_step": 1, "base_outer_step": 0, "step": 0,
         "time": 1.0, "message": ""}]},
    {"node_id": "w0", "total": 0, "counts": {}, "deltas": [
        {"verdict": "refused", "reason": "x", "status": 422, "local_step": -1, "base_outer_step": 0, "step": 0,
         "time": 1.0, "message": ""}]},
])
def test_package_refuses_hostile_documents(doc):
    with pytest.raises(HostileAnswer):
        parse_node_verdicts(json.dumps(doc).encode(), "w0")
