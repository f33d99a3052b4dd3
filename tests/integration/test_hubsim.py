"""The Hub emulator (tests/hubsim/hubsim.py) driven by the STOCK huggingface_hub client (no hf_xet):
repo create/info, upload_file (regular, LFS basic, LFS multipart), create_commit with parent_commit
(and a stale one -> 412), recursive tree listing across pages, hf_hub_download (regular and LFS),
token checks, persistence across a restart, and one test per fault switch showing what the stock
client sees.  Raw http.client requests check the exact wire details the C hf:// transport relies on
(hub-protocol.md): ETag / X-Repo-Commit / X-Linked-* headers, 302 to another host, Range/206/416,
absolute Link pagination, quoted and unquoted paths, lfsFile/verify checks."""
import os

os.environ["HF_HUB_DISABLE_XET"] = "1"
os.environ["HF_HUB_DISABLE_TELEMETRY"] = "1"
os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"

import base64  # noqa: E402
import hashlib  # noqa: E402
import http.client  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import re  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import urllib.error  # noqa: E402
import urllib.request  # noqa: E402
from pathlib import Path  # noqa: E402
from urllib.parse import urlsplit  # noqa: E402

import pytest  # noqa: E402
from huggingface_hub import CommitOperationAdd, CommitOperationDelete, HfApi, constants, hf_hub_download  # noqa: E402
from huggingface_hub.errors import (  # noqa: E402
    HfHubHTTPError,
    RemoteEntryNotFoundError,
    RepositoryNotFoundError,
)

constants.HF_HUB_DISABLE_XET = True  # in case huggingface_hub was imported before this module

HUBSIM = Path(__file__).resolve().parents[1] / "hubsim" / "hubsim.py"
TOKEN = "hf_simtoken_0123456789"
MiB = 1024 * 1024


def git_blob_sha1(data):
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


class Hub:
    """One emulator process.  endpoint uses the host name "localhost"; its CDN is "127.0.0.1"."""

    def __init__(self, root, *args):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.errlog = open(self.root.parent / f"{self.root.name}.stderr", "ab")
        self.proc = subprocess.Popen([sys.executable, str(HUBSIM), "--root", str(self.root), "--port", "0", *args],
                                     stdout=subprocess.PIPE, stderr=self.errlog, text=True)
        line = self.proc.stdout.readline()
        if not line.strip().isdigit():
            self.proc.kill()
            raise RuntimeError(f"hubsim did not start: {line!r}\n{(self.root.parent / f'{self.root.name}.stderr').read_text()}")
        self.port = int(line)
        self.endpoint = f"http://localhost:{self.port}"

    def ctl(self, method, path, body=None):
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.endpoint + path, data=data, method=method,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=30) as r:
            return json.loads(r.read() or b"null")

    def fault(self, **rule):
        return self.ctl("POST", "/_sim/faults", rule)["rules"][0]

    def clear_faults(self):
        self.ctl("DELETE", "/_sim/faults")

    def stats(self):
        return self.ctl("GET", "/_sim/stats")

    def reset_stats(self):
        self.ctl("POST", "/_sim/reset-stats")

    def requests(self):
        return self.ctl("GET", "/_sim/requests")

    def raw(self, method, path, headers=None, body=None, host="localhost", auth=True):
        """(status, lower-cased headers, body) of one request, redirects NOT followed."""
        h = dict(headers or {})
        if auth:
            h.setdefault("Authorization", f"Bearer {TOKEN}")
        conn = http.client.HTTPConnection(host, self.port, timeout=30)
        try:
            conn.request(method, path, body=body, headers=h)
            r = conn.getresponse()
            data = r.read()
            return r.status, {k.lower(): v for k, v in r.getheaders()}, data
        finally:
            conn.close()

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.errlog.close()


@pytest.fixture(scope="module")
def workdir():
    with tempfile.TemporaryDirectory(prefix="hubsim-test-") as d:
        os.environ["HF_HOME"] = os.path.join(d, "hf_home")  # never touch the user's cache / token
        yield Path(d)


@pytest.fixture(scope="module")
def hub(workdir):
    h = Hub(workdir / "root", "--token", TOKEN, "--page-size", "2", "--commits-page-size", "3")
    yield h
    h.stop()


@pytest.fixture(autouse=True)
def _clean_faults(request):
    yield
    if "hub" in request.fixturenames:
        request.getfixturevalue("hub").clear_faults()


@pytest.fixture(scope="module")
def api(hub):
    return HfApi(endpoint=hub.endpoint, token=TOKEN)


@pytest.fixture(scope="module")
def seeded(hub, api):
    """A repo with a regular file and two LFS files (basic transfer), committed in one commit."""
    repo_id = "sim/seeded"
    api.create_repo(repo_id)
    files = {
        "config.json": b'{"hidden": 64, "layers": 2}\n',
        "nodes/w1/delta.safetensors": os.urandom(200_000),
        "global/latest.safetensors": os.urandom(50_000),
    }
    info = api.create_commit(repo_id, [CommitOperationAdd(p, d) for p, d in files.items()], commit_message="seed")
    return {"repo_id": repo_id, "files": files, "sha": info.oid}


def download(hub, repo_id, filename, cache_dir, **kw):
    return Path(hf_hub_download(repo_id, filename, endpoint=hub.endpoint, token=TOKEN, cache_dir=str(cache_dir), **kw))


# ------------------------------------------------------------------------------------------ basic surface


def test_create_repo_and_repo_info(hub, api):
    url = api.create_repo("sim/info")
    assert url.repo_id == "sim/info" and url.endpoint == hub.endpoint
    with pytest.raises(HfHubHTTPError) as e:
        api.create_repo("sim/info")
    assert e.value.response.status_code == 409
    assert e.value.response.json()["url"] == f"{hub.endpoint}/sim/info"
    assert api.create_repo("sim/info", exist_ok=True).repo_id == "sim/info"

    info = api.repo_info("sim/info")
    assert info.id == "sim/info" and re.fullmatch(r"[0-9a-f]{40}", info.sha)
    assert [s.rfilename for s in info.siblings] == [".gitattributes"]  # the Hub's initial commit
    assert api.repo_info("sim/info", revision=info.sha).sha == info.sha
    assert api.repo_info("sim/info", revision="main").sha == info.sha
    with pytest.raises(RepositoryNotFoundError):
        api.repo_info("sim/does-not-exist")

    # raw: quoted revision form + ?expand=sha
    st, h, body = hub.raw("GET", "/api/models/sim/info/revision/main?expand=sha")
    assert st == 200 and json.loads(body) == {"_id": json.loads(body)["_id"], "id": "sim/info", "sha": info.sha}


def test_token_is_required_on_api_calls(hub, api):
    api.create_repo("sim/auth", exist_ok=True)
    hub.reset_stats()
    with pytest.raises(RepositoryNotFoundError) as e:
        HfApi(endpoint=hub.endpoint, token=False).repo_info("sim/auth")
    assert e.value.response.status_code == 401
    # a wrong token: the real Hub says 401 "Invalid credentials" without an error code, and the stock
    # client raises a plain HfHubHTTPError (a missing token gets RepositoryNotFoundError, as above)
    with pytest.raises(HfHubHTTPError) as e:
        HfApi(endpoint=hub.endpoint, token="hf_wrong").repo_info("sim/auth")
    assert not isinstance(e.value, RepositoryNotFoundError)
    assert e.value.response.status_code == 401 and "X-Error-Code" not in e.value.response.headers
    assert e.value.response.headers["X-Error-Message"] == "Invalid credentials in Authorization header"
    st, h, _ = hub.raw("HEAD", "/sim/auth/resolve/main/.gitattributes", auth=False)
    assert st == 401 and h["x-error-code"] == "RepoNotFound"
    st, h, body = hub.raw("POST", "/sim/auth.git/info/lfs/objects/batch", auth=False,
                          body=json.dumps({"operation": "upload", "objects": []}))
    assert st == 401 and json.loads(body)["error"] and h["x-error-message"]
    assert hub.stats()["statuses"] == {"401": 4}


def test_upload_file_regular_lfs_basic_and_multipart(hub, api, workdir):
    repo_id = "sim/uploads"
    api.create_repo(repo_id)

    # 1. a small text file -> regular (inline base64 in the commit), no LFS traffic
    hub.reset_stats()
    api.upload_file(path_or_fileobj=b'{"step": 12}\n', path_in_repo="global/step_count.json", repo_id=repo_id)
    s = hub.stats()
    assert s["route_ids"] == {"preupload": 1, "commit": 1}
    assert s["commits"] == 1

    # 2. a small .safetensors -> LFS basic: batch, one PUT (without Authorization), verify, commit
    small = os.urandom(300_000)
    hub.reset_stats()
    api.upload_file(path_or_fileobj=small, path_in_repo="nodes/w1/delta_1.safetensors", repo_id=repo_id)
    s = hub.stats()
    assert s["route_ids"] == {"preupload": 1, "lfs_batch": 1, "lfs_upload": 1, "lfs_verify": 1, "commit": 1}
    assert s["upload_with_auth"] == 0

    # 3. 12 MiB -> LFS multipart (threshold 8 MiB, chunk 5 MiB): 3 part PUTs + completion + verify
    big = os.urandom(12 * MiB)
    big_path = workdir / "big.bin"
    big_path.write_bytes(big)
    hub.reset_stats()
    api.upload_file(path_or_fileobj=str(big_path), path_in_repo="big.bin", repo_id=repo_id)
    s = hub.stats()
    assert s["route_ids"] == {"preupload": 1, "lfs_batch": 1, "lfs_part": math.ceil(12 / 5), "lfs_complete": 1,
                              "lfs_verify": 1, "commit": 1}
    assert s["upload_with_auth"] == 0

    # 4. uploading the same LFS content again: the batch answers "already stored" (no PUT); the client
    #    then skips the commit because preupload returned the same oid for the path
    hub.reset_stats()
    api.upload_file(path_or_fileobj=small, path_in_repo="nodes/w1/delta_1.safetensors", repo_id=repo_id)
    assert hub.stats()["route_ids"].get("lfs_upload", 0) == 0

    entries = {e.path: e for e in api.list_repo_tree(repo_id, recursive=True)}
    assert entries["global/step_count.json"].lfs is None
    assert entries["global/step_count.json"].blob_id == git_blob_sha1(b'{"step": 12}\n')
    for path, data in (("nodes/w1/delta_1.safetensors", small), ("big.bin", big)):
        e = entries[path]
        assert e.size == len(data)
        assert e.lfs.sha256 == hashlib.sha256(data).hexdigest() and e.lfs.size == len(data)
        pointer = f"version https://git-lfs.github.com/spec/v1\noid sha256:{e.lfs.sha256}\nsize {len(data)}\n".encode()
        assert e.blob_id == git_blob_sha1(pointer) and e.lfs.pointer_size == len(pointer)
    assert len(api.list_repo_commits(repo_id)) == 4  # initial + 3 uploads


def test_create_commit_parent_commit_and_stale_parent(hub, api):
    repo_id = "sim/commits"
    api.create_repo(repo_id)
    head = api.repo_info(repo_id).sha
    hub.reset_stats()
    c1 = api.create_commit(repo_id, [CommitOperationAdd("README.md", b"---\nlicense: mit\n---\n# sim\n"),
                                     CommitOperationAdd("a.txt", b"a\n")],
                           commit_message="outer step 1", parent_commit=head)
    assert hub.stats()["route_ids"]["validate_yaml"] == 1  # README.md is validated first
    assert re.fullmatch(r"[0-9a-f]{40}", c1.oid) and c1.oid != head
    assert c1.commit_url == f"{hub.endpoint}/{repo_id}/commit/{c1.oid}"
    assert api.repo_info(repo_id).sha == c1.oid

    c2 = api.create_commit(repo_id, [CommitOperationDelete("a.txt"), CommitOperationAdd("b.txt", b"b\n")],
                           commit_message="outer step 2", commit_description="details", parent_commit=c1.oid)
    with pytest.raises(HfHubHTTPError) as e:  # stale parent (c1 is no longer the head)
        api.create_commit(repo_id, [CommitOperationAdd("c.txt", b"c\n")], commit_message="late", parent_commit=c1.oid)
    assert e.value.response.status_code == 412
    assert api.repo_info(repo_id).sha == c2.oid

    commits = api.list_repo_commits(repo_id)  # 3 commits on a page: follows the Link header
    assert [c.commit_id for c in commits] == [c2.oid, c1.oid, head]
    assert [c.title for c in commits] == ["outer step 2", "outer step 1", "initial commit"]
    assert commits[0].message == "outer step 2\n\ndetails"
    assert sorted(s.rfilename for s in api.repo_info(repo_id).siblings) == [".gitattributes", "README.md", "b.txt"]

    with pytest.raises(RemoteEntryNotFoundError):  # deleting a missing file -> 404 EntryNotFound
        api.create_commit(repo_id, [CommitOperationDelete("nope.txt")], commit_message="del")


def test_list_repo_tree_recursive_across_pages(hub, api):
    repo_id = "sim/tree"
    api.create_repo(repo_id)
    paths = ["top.txt", "nodes/w1/a.json", "nodes/w1/b.json", "nodes/w2/a.json", "nodes/w2/sub/c.json",
             "global/latest.json", "global/step.json"]
    api.create_commit(repo_id, [CommitOperationAdd(p, p.encode()) for p in paths], commit_message="files")
    dirs = ["nodes", "nodes/w1", "nodes/w2", "nodes/w2/sub", "global"]

    hub.reset_stats()
    entries = list(api.list_repo_tree(repo_id, recursive=True))
    total = len(paths) + 1 + len(dirs)  # + .gitattributes
    assert sorted(e.path for e in entries) == sorted(paths + [".gitattributes"] + dirs)
    assert hub.stats()["route_ids"]["tree"] == math.ceil(total / 2)  # page size 2
    by_path = {e.path: e for e in entries}
    assert by_path["nodes/w1/a.json"].blob_id == git_blob_sha1(b"nodes/w1/a.json")
    assert re.fullmatch(r"[0-9a-f]{40}", by_path["nodes/w2/sub"].tree_id)

    sub = sorted(e.path for e in api.list_repo_tree(repo_id, path_in_repo="nodes/w2", recursive=True))
    assert sub == ["nodes/w2/a.json", "nodes/w2/sub", "nodes/w2/sub/c.json"]
    assert sorted(e.path for e in api.list_repo_tree(repo_id, path_in_repo="nodes")) == ["nodes/w1", "nodes/w2"]

    # raw: Python quoting (a%2Fb, recursive=true) and JS style (a/b, recursive=1) give the same pages;
    # the Link header is absolute and is followed verbatim
    def walk(url):
        out, pages = [], 0
        while url:
            parts = urlsplit(url)
            st, h, body = hub.raw("GET", parts.path + "?" + parts.query)
            assert st == 200
            out += json.loads(body)
            pages += 1
            link = h.get("link")
            url = re.match(r'<([^>]+)>;\s*rel="next"', link).group(1) if link else None
            if url:
                assert url.startswith(hub.endpoint + "/api/models/sim/tree/tree/") and "cursor=" in url
        return out, pages

    a, pages = walk(f"{hub.endpoint}/api/models/{repo_id}/tree/main/nodes%2Fw2?recursive=true&expand=false")
    b, _ = walk(f"{hub.endpoint}/api/models/{repo_id}/tree/main/nodes/w2?recursive=1&expand=false")
    assert a == b and pages == 2 and len(a) == 3
    for e in a:
        assert set(e) == ({"type", "oid", "size", "path"} if e["type"] == "directory" or "lfs" not in e
                          else {"type", "oid", "size", "path", "lfs"})


# ------------------------------------------------------------------------------------------ downloads


def test_hf_hub_download_regular_and_lfs(hub, seeded, tmp_path):
    repo_id, files = seeded["repo_id"], seeded["files"]
    for name, data in files.items():
        assert download(hub, repo_id, name, tmp_path).read_bytes() == data

    # raw wire details of resolve
    st, h, _ = hub.raw("HEAD", f"/{repo_id}/resolve/main/config.json")
    assert st == 200 and h["etag"] == f'"{git_blob_sha1(files["config.json"])}"'
    assert h["x-repo-commit"] == seeded["sha"] and int(h["content-length"]) == len(files["config.json"])
    st, h, body = hub.raw("GET", f"/{repo_id}/resolve/main/config.json", headers={"Range": "bytes=2-7"})
    assert st == 206 and body == files["config.json"][2:8]
    assert h["content-range"] == f"bytes 2-7/{len(files['config.json'])}"
    st, h, _ = hub.raw("GET", f"/{repo_id}/resolve/main/config.json", headers={"Range": "bytes=999-"})
    assert st == 416 and h["content-range"] == f"bytes */{len(files['config.json'])}"

    lfs = files["nodes/w1/delta.safetensors"]
    st, h, _ = hub.raw("HEAD", f"/{repo_id}/resolve/{seeded['sha']}/nodes%2Fw1%2Fdelta.safetensors")
    assert st == 302
    assert h["x-linked-etag"] == f'"{hashlib.sha256(lfs).hexdigest()}"' and h["x-linked-size"] == str(len(lfs))
    assert h["x-repo-commit"] == seeded["sha"]
    loc = urlsplit(h["location"])
    assert loc.hostname == "127.0.0.1" and loc.port == hub.port  # another host than the API's "localhost"
    st, h2, body = hub.raw("GET", loc.path + "?" + loc.query, host="127.0.0.1", auth=False,
                           headers={"Range": f"bytes={len(lfs) - 10}-"})
    assert st == 206 and body == lfs[-10:]

    with pytest.raises(RemoteEntryNotFoundError):
        download(hub, repo_id, "missing.bin", tmp_path)
    st, h, _ = hub.raw("HEAD", f"/{repo_id}/resolve/main/missing.bin")
    assert st == 404 and h["x-error-code"] == "EntryNotFound" and h["x-repo-commit"] == seeded["sha"]


def test_authorization_not_sent_to_cdn_on_redirect(hub, seeded, tmp_path):
    hub.reset_stats()
    name = "global/latest.safetensors"
    assert download(hub, seeded["repo_id"], name, tmp_path).read_bytes() == seeded["files"][name]
    log = hub.requests()
    resolve = [r for r in log if r["route"] == "resolve"]
    cdn = [r for r in log if r["route"] == "cdn"]
    assert resolve and all(r["auth"] for r in resolve) and all(r["host"].startswith("localhost:") for r in resolve)
    assert cdn and not any(r["auth"] for r in cdn) and all(r["host"].startswith("127.0.0.1:") for r in cdn)
    s = hub.stats()
    assert s["cdn"] == len(cdn) and s["resolver"] == len(resolve) and s["cdn_with_auth"] == 0


def test_persistence_across_restart_and_fault_flag(workdir, tmp_path):
    root = workdir / "persist"
    h = Hub(root, "--token", TOKEN, "--fault", '{"status": 503, "count": 1, "route": "create_repo"}')
    try:
        api = HfApi(endpoint=h.endpoint, token=TOKEN)
        with pytest.raises(HfHubHTTPError) as e:  # create_repo is not retried by the client
            api.create_repo("sim/persist")
        assert e.value.response.status_code == 503
        assert e.value.response.headers["X-Error-Code"] and e.value.response.headers["X-Error-Message"]
        api.create_repo("sim/persist")
        data = os.urandom(70_000)
        api.upload_file(path_or_fileobj=data, path_in_repo="w.safetensors", repo_id="sim/persist")
        sha = api.repo_info("sim/persist").sha
    finally:
        h.stop()
    h = Hub(root, "--token", TOKEN)
    try:
        api = HfApi(endpoint=h.endpoint, token=TOKEN)
        assert api.repo_info("sim/persist").sha == sha
        assert len(api.list_repo_commits("sim/persist")) == 2
        got = hf_hub_download("sim/persist", "w.safetensors", endpoint=h.endpoint, token=TOKEN, cache_dir=str(tmp_path))
        assert Path(got).read_bytes() == data
    finally:
        h.stop()


def test_lfs_batch_verify_and_lfsfile_checks(hub, api):
    """The server-side checks a C client depends on, with raw requests."""
    repo_id = "sim/lfsraw"
    api.create_repo(repo_id)
    head = api.repo_info(repo_id).sha
    data = os.urandom(4096)
    oid = hashlib.sha256(data).hexdigest()
    lfs_h = {"Accept": "application/vnd.git-lfs+json", "Content-Type": "application/vnd.git-lfs+json"}

    def commit(*ops, parent=head):
        lines = [{"key": "header", "value": {"summary": "raw", "description": "", "parentCommit": parent}}]
        lines += [{"key": k, "value": v} for k, v in ops]
        body = "".join(json.dumps(x) + "\n" for x in lines)
        return hub.raw("POST", f"/api/models/{repo_id}/commit/main", body=body,
                       headers={"Content-Type": "application/x-ndjson"})

    st, _, body = commit(("lfsFile", {"path": "x.safetensors", "algo": "sha256", "oid": oid, "size": len(data)}))
    assert st == 422 and "error" in json.loads(body)  # object never uploaded

    batch = {"operation": "upload", "transfers": ["basic", "multipart"], "hash_algo": "sha256",
             "objects": [{"oid": oid, "size": len(data)}], "ref": {"name": "main"}}
    st, h, body = hub.raw("POST", f"/{repo_id}.git/info/lfs/objects/batch", body=json.dumps(batch), headers=lfs_h)
    obj = json.loads(body)["objects"][0]
    up, verify = obj["actions"]["upload"], obj["actions"]["verify"]
    assert "chunk_size" not in up.get("header", {})
    upu = urlsplit(up["href"])
    assert upu.hostname == "127.0.0.1"
    st, _, _ = hub.raw("PUT", upu.path + "?" + upu.query, body=b"x" * len(data), host="127.0.0.1", auth=False)
    assert st == 200  # like S3: anything is accepted ...
    vpath = urlsplit(verify["href"]).path
    st, _, body = hub.raw("POST", vpath, body=json.dumps({"oid": oid, "size": len(data)}), headers=lfs_h)
    assert st == 422 and "sha256" in json.loads(body)["error"]  # ... but verify checks the sha256
    st, _, _ = hub.raw("PUT", upu.path + "?" + upu.query, body=data, host="127.0.0.1", auth=False)
    assert st == 200
    st, _, _ = hub.raw("POST", vpath, body=json.dumps({"oid": oid, "size": len(data) + 1}), headers=lfs_h)
    assert st == 422  # wrong size
    st, _, _ = hub.raw("POST", vpath, body=json.dumps({"oid": oid, "size": len(data)}), headers=lfs_h)
    assert st == 200
    st, _, body = hub.raw("POST", f"/{repo_id}.git/info/lfs/objects/batch", body=json.dumps(batch), headers=lfs_h)
    assert "actions" not in json.loads(body)["objects"][0]  # already stored

    st, _, _ = commit(("lfsFile", {"path": "x.safetensors", "algo": "sha256", "oid": oid, "size": len(data) + 1}))
    assert st == 422
    st, _, _ = commit(("file", {"path": "bin.dat", "encoding": "base64", "content": base64.b64encode(b"\0\1\2").decode()}))
    assert st == 400  # binary inline file: rejected like the Hub does
    st, _, body = commit(("lfsFile", {"path": "x.safetensors", "algo": "sha256", "oid": oid, "size": len(data)}),
                         ("file", {"path": "s.json", "encoding": "base64", "content": base64.b64encode(b"{}").decode()}))
    assert st == 200, body
    r = json.loads(body)
    assert r["success"] is True and re.fullmatch(r"[0-9a-f]{40}", r["commitOid"])
    st, _, _ = commit(("deletedFile", {"path": "s.json"}))  # parent is stale now
    assert st == 412
    st, _, _ = commit(("deletedFile", {"path": "s.json"}), parent=r["commitOid"])
    assert st == 200


# ------------------------------------------------------------------------------------------ faults


@pytest.mark.parametrize("status", [500, 502, 503])
def test_fault_5xx_is_retried_by_the_client(hub, api, status):
    repo_id = f"sim/retry{status}"
    api.create_repo(repo_id)
    hub.reset_stats()
    hub.fault(status=status, count=1, route="preupload")
    api.upload_file(path_or_fileobj=b"retried\n", path_in_repo="r.txt", repo_id=repo_id)
    s = hub.stats()
    assert s["route_ids"]["preupload"] == 2 and s["statuses"][str(status)] == 1
    assert s["faults_fired"] == {f"status_{status}": 1}


def test_fault_503_twice_on_lfs_batch_then_success(hub, api):
    repo_id = "sim/retry-batch"
    api.create_repo(repo_id)
    hub.reset_stats()
    hub.fault(status=503, count=2, path_regex=r"\.git/info/lfs/objects/batch$")
    api.upload_file(path_or_fileobj=os.urandom(1000), path_in_repo="w.safetensors", repo_id=repo_id)
    assert hub.stats()["route_ids"]["lfs_batch"] == 3
    assert hub.ctl("GET", "/_sim/faults") == []  # consumed


def test_fault_5xx_surfaces_on_commit(hub, api):
    repo_id = "sim/commit500"
    api.create_repo(repo_id)
    head = api.repo_info(repo_id).sha
    hub.fault(status=500, count=-1, route="commit")  # until removed
    for _ in range(2):
        with pytest.raises(HfHubHTTPError) as e:  # the client does not retry commits
            api.upload_file(path_or_fileobj=b"x\n", path_in_repo="x.txt", repo_id=repo_id)
        assert e.value.response.status_code == 500
    assert api.repo_info(repo_id).sha == head
    hub.clear_faults()
    api.upload_file(path_or_fileobj=b"x\n", path_in_repo="x.txt", repo_id=repo_id)
    assert api.repo_info(repo_id).sha != head


def test_fault_429_rate_limit(hub, api):
    repo_id = "sim/ratelimited"
    api.create_repo(repo_id)
    hub.fault(status=429, retry_after=7, count=1, route="repo_info")
    st, h, _ = hub.raw("GET", f"/api/models/{repo_id}")
    assert st == 429 and h["retry-after"] == "7" and h["ratelimit"] == '"api";r=0;t=7'

    hub.reset_stats()
    hub.fault(status=429, retry_after=0, count=1, route="preupload")
    t0 = time.monotonic()
    api.upload_file(path_or_fileobj=b"after 429\n", path_in_repo="r.txt", repo_id=repo_id)
    assert time.monotonic() - t0 >= 1.0  # waited t + 1 s as the RateLimit header says
    assert hub.stats()["route_ids"]["preupload"] == 2

    # the built-in budget (runtime config): 2 API calls per window, then 429 with the RateLimit headers
    hub.ctl("POST", "/_sim/config", {"api_limit": 2, "rate_window": 60})
    try:
        api.repo_info(repo_id)
        api.repo_info(repo_id)
        with pytest.raises(HfHubHTTPError) as e:  # repo_info is not retried
            api.repo_info(repo_id)
        assert e.value.response.status_code == 429
        assert re.fullmatch(r'"api";r=0;t=\d+', e.value.response.headers["RateLimit"])
    finally:
        hub.ctl("POST", "/_sim/config", {"api_limit": 0})
    assert hub.stats()["rate_limited"] == 1


def test_fault_connection_dropped_mid_body_client_resumes(hub, api, seeded, tmp_path):
    name = "nodes/w1/delta.safetensors"
    hub.reset_stats()
    hub.fault(kind="drop", route="cdn", after_bytes=10_000)
    assert download(hub, seeded["repo_id"], name, tmp_path / "a").read_bytes() == seeded["files"][name]
    cdn = [r for r in hub.requests() if r["route"] == "cdn"]
    assert [r["fault"] for r in cdn] == ["drop", None]
    # the client writes 10 MiB chunks: after a drop this early it has nothing to resume from and starts over
    assert (cdn[1]["status"], cdn[1]["range"]) == (200, None)

    # past the first 10 MiB chunk it resumes with `Range: bytes=N-` and the CDN answers 206
    big = os.urandom(11 * MiB)
    api.upload_file(path_or_fileobj=big, path_in_repo="big/resume.bin", repo_id=seeded["repo_id"])
    hub.reset_stats()
    hub.fault(kind="drop", route="cdn", after_bytes=10 * MiB + 300_000)
    assert download(hub, seeded["repo_id"], "big/resume.bin", tmp_path / "b").read_bytes() == big
    cdn = [r for r in hub.requests() if r["route"] == "cdn"]
    assert [(r["fault"], r["status"], r["range"]) for r in cdn] == [("drop", 200, None), (None, 206, f"bytes={10 * MiB}-")]


def test_fault_truncated_body_with_matching_content_length(hub, seeded, tmp_path):
    name = "nodes/w1/delta.safetensors"
    st, h, body = hub.raw("GET", f"/{seeded['repo_id']}/resolve/main/{name}")
    loc = urlsplit(h["location"])
    hub.fault(kind="truncate", route="cdn", bytes=1234)
    st, h, body = hub.raw("GET", loc.path + "?" + loc.query, host="127.0.0.1", auth=False)
    assert st == 200 and h["content-length"] == "1234" and body == seeded["files"][name][:1234]  # valid HTTP

    hub.fault(kind="truncate", route="cdn", bytes=1234)
    with pytest.raises(OSError, match="Consistency check failed"):  # only the size check catches it
        download(hub, seeded["repo_id"], name, tmp_path)


def test_fault_corrupted_lfs_bytes(hub, seeded, tmp_path):
    name = "global/latest.safetensors"
    data = seeded["files"][name]
    oid = hashlib.sha256(data).hexdigest()
    hub.fault(kind="corrupt", oid=oid)
    got = download(hub, seeded["repo_id"], name, tmp_path).read_bytes()
    # the stock client checks the size only: wrong bytes reach the cache; a sha256 check would catch it
    assert len(got) == len(data) and got != data
    assert got[64:] == data[64:] and hashlib.sha256(got).hexdigest() != oid
    assert hub.stats()["faults_fired"].get("corrupt", 0) >= 1


def test_fault_slow_responses(hub, api, seeded, tmp_path):
    hub.fault(delay=0.6, route="repo_info")
    t0 = time.monotonic()
    api.repo_info(seeded["repo_id"])
    assert time.monotonic() - t0 >= 0.6

    # a HEAD slower than etag_timeout: the client gives up on it and retries with a longer timeout
    hub.reset_stats()
    hub.fault(delay=2, route="resolve", method="HEAD")
    name = "config.json"
    got = download(hub, seeded["repo_id"], name, tmp_path, etag_timeout=0.5)
    assert got.read_bytes() == seeded["files"][name]
    assert hub.stats()["routes"]["HEAD /{repo}/resolve/{rev}/{path}"] == 2

    # a slow body: 50 kB at 250 kB/s
    name = "global/latest.safetensors"
    hub.fault(kind="throttle", route="cdn", bytes_per_sec=250_000)
    t0 = time.monotonic()
    assert download(hub, seeded["repo_id"], name, tmp_path / "t").read_bytes() == seeded["files"][name]
    assert time.monotonic() - t0 >= 0.18


def test_fault_412_on_next_commit(hub, api):
    repo_id = "sim/412"
    api.create_repo(repo_id)
    head = api.repo_info(repo_id).sha
    hub.fault(kind="commit_412")
    with pytest.raises(HfHubHTTPError) as e:
        api.create_commit(repo_id, [CommitOperationAdd("a.txt", b"a")], commit_message="m", parent_commit=head)
    assert e.value.response.status_code == 412
    assert e.value.response.headers["X-Error-Code"] == "PreconditionFailed"
    c = api.create_commit(repo_id, [CommitOperationAdd("a.txt", b"a")], commit_message="m", parent_commit=head)
    assert api.repo_info(repo_id).sha == c.oid


def test_control_api_stats_reset_and_fault_validation(hub, api, seeded):
    hub.reset_stats()
    assert hub.stats()["total"] == 0
    api.repo_info(seeded["repo_id"])
    api.list_repo_tree(seeded["repo_id"])  # lazy: not sent
    s = hub.stats()
    assert s["total"] == s["api"] == 1 and s["routes"] == {"GET /api/models/{repo}": 1}
    with pytest.raises(urllib.error.HTTPError) as e:
        hub.ctl("POST", "/_sim/faults", {"kind": "nonsense"})
    assert e.value.code == 400
    r = hub.fault(status=503, count=-1, skip=1, method="GET", route="api")
    assert hub.ctl("GET", "/_sim/faults")[0]["id"] == r["id"]
    api.repo_info(seeded["repo_id"])  # skipped once
    with pytest.raises(HfHubHTTPError):
        api.repo_info(seeded["repo_id"])
    hub.ctl("DELETE", f"/_sim/faults/{r['id']}")
    api.repo_info(seeded["repo_id"])
    assert hub.ctl("GET", "/_sim/health")["port"] == hub.port
