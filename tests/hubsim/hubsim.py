#!/usr/bin/env python3
"""hubsim: a Hugging Face Hub emulator for tests (Python standard library only).

It speaks the subset of the Hub's HTTP protocol that huggingface_hub and dilocod use (README.md,
"Through a Hugging Face Hub repo"; checked against the stock huggingface_hub client: repo create/info, tree listing with absolute `Link` pagination, resolve with 302 to a "CDN",
preupload, git-lfs batch with basic and multipart transfers, verify, NDJSON commits, commit list)
and can inject faults at start-up or at run time.  Everything is persisted under --root, so a
restarted emulator serves the same repos, commits, files and LFS objects.

START
    python3 tests/hubsim/hubsim.py --root DIR [--port 0] [--token T] ...
The first line on stdout is the chosen port number (alone), flushed as soon as the socket listens.
A summary (endpoint, CDN base, root) goes to stderr.  Use the endpoint http://localhost:PORT
(HF_ENDPOINT / HfApi(endpoint=...)): LFS downloads are redirected to http://127.0.0.1:PORT/lfs-cdn/...
which is another *host* for an HTTP client (same server), so "Authorization is never forwarded to
another host" can be checked (/_sim/stats counts CDN requests that carried Authorization).  If a
client uses http://127.0.0.1:PORT as endpoint, the CDN host flips to "localhost" so it still differs.
SIGTERM / SIGINT / POST /_sim/shutdown stop it.

OPTIONS
    --root DIR                 storage directory (created if missing).  Required.
    --host ADDR                listen address (default 127.0.0.1; ::1 on the same port is also tried
                               when ADDR is 127.0.0.1, unless --no-ipv6).
    --port N                   listen port, 0 = pick a free one (default 0).
    --port-file PATH           also write the port number to PATH.
    --token T                  require `Authorization: Bearer T` on every API/resolve/LFS-batch/verify
                               call (repeatable: any of the tokens is accepted).  As the Hub answers:
                               no token: 401 + X-Error-Code: RepoNotFound (huggingface_hub raises
                               RepositoryNotFoundError); a wrong token: 401 + X-Error-Message: Invalid
                               credentials in Authorization header and no X-Error-Code (it raises
                               HfHubHTTPError).  LFS upload URLs, the multipart completion URL and the
                               CDN never require it.
    --user NAME                namespace used when create_repo has no organization (default "user").
    --api-host NAME            host name used in API URLs it generates when the request has no Host
                               header (default localhost).
    --cdn-host NAME            host name of the simulated CDN / S3 (default 127.0.0.1).
    --page-size N              tree listing page size (default 1000; 50 max with expand=true).
    --commits-page-size N      commit list page size (default 50).
    --lfs-threshold BYTES      preupload answers "lfs" from this size (default 10485760 = 10 MiB).
                               Also "lfs": paths matched by a `filter=lfs` line of the revision's
                               .gitattributes (the Hub default one, created by create_repo, has
                               *.safetensors, *.bin, *.pt, ...) and samples containing a NUL byte.
    --multipart-threshold BYTES  LFS batch uses the multipart transfer (if the client offers it) for
                               objects larger than this (default 8388608 = 8 MiB).
    --chunk-size BYTES         multipart part size (default 5242880 = 5 MiB).
    --no-regular-checks        accept inline ("file") commit entries that are >= --lfs-threshold or
                               binary (the Hub rejects them; so does hubsim by default, with 400).
    --api-limit N              built-in fixed-window rate limit on API calls (/api/...) (default off).
    --resolver-limit N         built-in rate limit on resolve calls (default off).
    --rate-window S            window of the built-in limits in seconds (default 300).
    --fault JSON               install a fault rule at start (repeatable; same JSON as POST /_sim/faults).
    --fail-next-commit         shorthand for --fault '{"kind":"commit_412"}'.
    --verbose                  log every request to stderr.

ROUTES (repo = ns/name; type = models|datasets|spaces; resolve/.git URLs take a datasets/ or spaces/
prefix for those types; rev and path are accepted quoted (refs%2Fpr%2F1, a%2Fb) or not)
    POST   /api/repos/create                     {"name","organization"?,"type"?,"private"?} -> {"url"} / 409 {"url"}
    DELETE /api/repos/delete                     {"name","organization"?,"type"?}
    POST   /api/validate-yaml                    -> {"errors":[],"warnings":[]}
    GET    /api/whoami-v2
    GET    /api/{type}/{repo}[/revision/{rev}]   -> {"id","sha","lastModified","siblings":[{"rfilename"}],...}
                                                   (?blobs=true adds size/blobId/lfs; ?expand=x keeps id+x)
    GET    /api/{type}/{repo}/tree/{rev}[/{path}]?recursive=true|1&expand=false  (Link rel="next", cursor=)
    POST   /api/{type}/{repo}/paths-info/{rev}   form or JSON {"paths":[...],"expand"}
    POST   /api/{type}/{repo}/preupload/{rev}    {"files":[{"path","sample","size"}]} (<= 256 files)
    POST   /api/{type}/{repo}/commit/{rev}       NDJSON header/file/lfsFile/deletedFile/deletedFolder
    GET    /api/{type}/{repo}/commits/{rev}      [{"id","title","message","date","authors"}] newest first, paginated
    GET    /api/{type}/{repo}/refs ; POST|DELETE /api/{type}/{repo}/branch/{name} {"startingPoint"?}
    GET|HEAD /{repo}/resolve/{rev}/{path}        regular: 200 ETag="<git sha1>"; LFS: 302 -> CDN; Range -> 206/416
    POST   /{repo}.git/info/lfs/objects/batch    git-lfs batch (upload: basic|multipart; download)
    POST   /{repo}.git/info/lfs/objects/verify   {"oid","size"} (checks sha256 and size)
    PUT    /lfs-upload/{oid}                     basic upload target (on the CDN host, no auth)
    PUT    /lfs-upload/{oid}/{upload_id}/{part}  multipart part (returns ETag = "md5")
    POST   /api/complete_multipart?uploadId=...  {"oid","parts":[{"partNumber","etag"}]} (no auth)
    GET|HEAD /lfs-cdn/{sha256}                   the CDN (no auth; Range)
A new repo gets an "initial commit" holding the Hub's default .gitattributes.  Commit ids are real git
commit hashes; file oids are git blob sha1s (of the pointer file for LFS files); directory oids are git
tree hashes.  Errors carry X-Error-Code and X-Error-Message headers and a {"error": "..."} body
(X-Error-Code RepoNotFound / RevisionNotFound / EntryNotFound where the Hub uses them).  A commit with
a stale parentCommit gets 412; an lfsFile whose object is missing (or has another size) gets 422; a
deletedFile on a missing path gets 404 EntryNotFound.  A tree cursor pins the commit being listed.

CONTROL API (never counted, never faulted, never authenticated)
    GET  /_sim/health                     {"ok","port","api","cdn","root"}
    GET  /_sim/stats                      {"total","api","resolver","cdn","lfs","other","routes":{"GET /api/models/{repo}":n,..},
                                           "route_ids":{...},"statuses":{...},"cdn_with_auth","upload_with_auth",
                                           "faults_fired":{...},"commits","rate_limited"}
    POST /_sim/reset-stats                zero the counters and the request log
    GET  /_sim/requests[?since=SEQ]       request log (last 5000): seq, method, path, host, route, template,
                                          category, auth (bool), range, status, fault
    GET  /_sim/faults                     active fault rules
    POST /_sim/faults                     add one rule (object) or several (list); {"clear": true} clears
    DELETE /_sim/faults[/{id}]            remove all rules / one rule
    GET|POST /_sim/config                 read / change page_size, commits_page_size, expand_page_size,
                                          lfs_threshold, multipart_threshold, chunk_size, tokens (list),
                                          api_limit, resolver_limit, rate_window, regular_checks
    POST /_sim/shutdown

FAULT RULES (JSON object; all keys optional except what defines the kind)
    kind        "status" (default when "status" is given) | "delay" (default when only "delay" is given)
                | "drop" | "truncate" | "corrupt" | "throttle" | "commit_412" (= status 412 on the next commit)
                | hostile Hub: "headers" | "oversize" | "endless" | "listing_size" | "lfs_href" (below)
    count       how many times it fires (default 1; -1 or null = until removed)
    skip        let this many matching requests through first (default 0)
    method      "GET", "HEAD", ... ; path_regex: re.search on the raw path?query ;
    route       a route id (repo_info, tree, paths_info, preupload, commit, commits, refs, branch, resolve,
                lfs_batch, lfs_verify, lfs_upload, lfs_part, lfs_complete, cdn, create_repo, delete_repo,
                validate_yaml, whoami) or a category (api, resolver, lfs, cdn, other)
    status      HTTP status for kind=status, e.g. 500/502/503/404/412; 429 adds `Retry-After: N` and
                `RateLimit: "api";r=0;t=N` (`"resolvers"` for resolve) with N = retry_after (default 1)
    message, error_code, headers   X-Error-Message / X-Error-Code / extra headers of a status fault
    delay       seconds to sleep before answering (kind=delay, or in addition to a status fault)
    after_bytes drop: send the headers (full Content-Length) and this many body bytes (default half),
                then close the connection
    bytes       truncate: serve only this many bytes (default half) with a Content-Length that matches
                the short body (HTTP-wise valid; only a size check catches it)
    oid         corrupt: only for a URL containing this sha256 (default: any GET with a body); the first
                64 bytes of the served body are XOR-ed with 0xFF (same length, wrong sha256)
    bytes_per_sec  throttle: send the body at this rate
    headers     headers: these response headers replace (or add to) the real answer's, e.g.
                {"Link": "<http://evil:1/x>; rel=\"next\""} on a tree page (any response, HEAD too)
    on_status   headers: fire only on a response of this HTTP status (e.g. 200: a Link on a listing's
                404 means nothing to a client, and would use the rule up unseen)
    extra       oversize: after the real body, this many more filler bytes (default 200 MiB) ...
    announce    ... announced in Content-Length (true, default) or close-delimited with no length (false)
    max_bytes   endless: instead of the real body, a never-ending JSON array of fake file entries,
                close-delimited, until the client leaves or max_bytes (default 1 GiB) went out
    size / raw_size  listing_size: file entries of a tree page (those whose path matches entry_regex, if
                given) list this size instead of the real one; raw_size is literal JSON text ("1e30",
                "-1", "1.5", "NaN", "18446744073709551616"), size any JSON value; lfs.size follows
    action, href  lfs_href: an LFS batch answer's "verify" (or "upload") action of each object points to
                href instead (a hostile Hub sending the client elsewhere)
Request-phase rules (status, delay) are checked before auth; body-phase rules (drop, truncate, corrupt,
throttle) apply only to responses that have a body (never to HEAD) and are consumed only then.
"""

import argparse
import base64
import binascii
import collections
import fnmatch
import hashlib
import json
import math
import os
import re
import shutil
import signal
import socket
import sys
import threading
import time
import traceback
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qsl, quote, unquote, urlencode, urlsplit

MiB = 1024 * 1024
REPO_TYPES = {"models": "model", "datasets": "dataset", "spaces": "space"}
URL_PREFIX = {"model": "", "dataset": "datasets/", "space": "spaces/"}
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,95}$")
SHA256_RE = re.compile(r"^[0-9a-f]{64}$")
HEX_RE = re.compile(r"^[0-9a-f]{7,40}$")

DEFAULT_GITATTRIBUTES = """*.7z filter=lfs diff=lfs merge=lfs -text
*.arrow filter=lfs diff=lfs merge=lfs -text
*.bin filter=lfs diff=lfs merge=lfs -text
*.bz2 filter=lfs diff=lfs merge=lfs -text
*.ckpt filter=lfs diff=lfs merge=lfs -text
*.ftz filter=lfs diff=lfs merge=lfs -text
*.gz filter=lfs diff=lfs merge=lfs -text
*.h5 filter=lfs diff=lfs merge=lfs -text
*.joblib filter=lfs diff=lfs merge=lfs -text
*.lfs.* filter=lfs diff=lfs merge=lfs -text
*.mlmodel filter=lfs diff=lfs merge=lfs -text
*.model filter=lfs diff=lfs merge=lfs -text
*.msgpack filter=lfs diff=lfs merge=lfs -text
*.npy filter=lfs diff=lfs merge=lfs -text
*.npz filter=lfs diff=lfs merge=lfs -text
*.onnx filter=lfs diff=lfs merge=lfs -text
*.ot filter=lfs diff=lfs merge=lfs -text
*.parquet filter=lfs diff=lfs merge=lfs -text
*.pb filter=lfs diff=lfs merge=lfs -text
*.pickle filter=lfs diff=lfs merge=lfs -text
*.pkl filter=lfs diff=lfs merge=lfs -text
*.pt filter=lfs diff=lfs merge=lfs -text
*.pth filter=lfs diff=lfs merge=lfs -text
*.rar filter=lfs diff=lfs merge=lfs -text
*.safetensors filter=lfs diff=lfs merge=lfs -text
saved_model/**/* filter=lfs diff=lfs merge=lfs -text
*.tar.* filter=lfs diff=lfs merge=lfs -text
*.tar filter=lfs diff=lfs merge=lfs -text
*.tflite filter=lfs diff=lfs merge=lfs -text
*.tgz filter=lfs diff=lfs merge=lfs -text
*.wasm filter=lfs diff=lfs merge=lfs -text
*.xz filter=lfs diff=lfs merge=lfs -text
*.zip filter=lfs diff=lfs merge=lfs -text
*.zst filter=lfs diff=lfs merge=lfs -text
*tfevents* filter=lfs diff=lfs merge=lfs -text
"""

ERROR_CODES = {
    400: "BadRequest", 401: "RepoNotFound", 403: "Forbidden", 404: "NotFound", 405: "MethodNotAllowed",
    409: "Conflict", 411: "LengthRequired", 412: "PreconditionFailed", 413: "PayloadTooLarge",
    416: "RangeNotSatisfiable", 422: "UnprocessableEntity", 429: "RateLimited", 500: "InternalError",
    501: "NotImplemented", 502: "BadGateway", 503: "ServiceUnavailable", 504: "GatewayTimeout",
}

# route id -> category (what /_sim/stats counts separately)
ROUTE_CATEGORY = {
    "create_repo": "api", "delete_repo": "api", "validate_yaml": "api", "whoami": "api", "repo_info": "api",
    "tree": "api", "paths_info": "api", "preupload": "api", "commit": "api", "commits": "api", "refs": "api",
    "branch": "api", "api_other": "api",
    "resolve": "resolver",
    "lfs_batch": "lfs", "lfs_verify": "lfs", "lfs_upload": "lfs", "lfs_part": "lfs", "lfs_complete": "lfs",
    "cdn": "cdn", "unknown": "other",
}
NO_AUTH_ROUTES = {"lfs_upload", "lfs_part", "lfs_complete", "cdn", "unknown"}


class HubError(Exception):
    def __init__(self, status, message, code=None, headers=None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.headers = headers or {}


class ClientGone(Exception):
    pass


# ----------------------------------------------------------------------------------------------------------
# git object helpers


def git_blob_sha1(data):
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def lfs_pointer(oid, size):
    return f"version https://git-lfs.github.com/spec/v1\noid sha256:{oid}\nsize {size}\n".encode()


def iso_time(t):
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(t)) + ".%03dZ" % int((t % 1) * 1000)


def valid_repo_path(p):
    if not isinstance(p, str) or not p or p.startswith("/") or p.endswith("/") or len(p) > 4096:
        return False
    if any(c in p for c in "\0\n\r"):
        return False
    return all(part not in ("", ".", "..", ".git") for part in p.split("/"))


class TreeIndex:
    """Directories and git tree hashes of one commit's file set."""

    def __init__(self, files):
        self.files = files
        children = {"": {}}
        for path, entry in files.items():
            parts = path.split("/")
            cur = ""
            for name in parts[:-1]:
                child = name if not cur else cur + "/" + name
                children.setdefault(cur, {})[name] = ("dir", child)
                children.setdefault(child, {})
                cur = child
            children.setdefault(cur, {})[parts[-1]] = ("file", entry["blob"])
        self.children = children
        self.tree_sha = {}
        for d in sorted(children, key=lambda x: -(x.count("/") + (1 if x else 0))):
            items = []
            for name, (kind, ref) in children[d].items():
                if kind == "dir":
                    items.append(((name + "/").encode(), b"40000 " + name.encode() + b"\0" + bytes.fromhex(self.tree_sha[ref])))
                else:
                    items.append((name.encode(), b"100644 " + name.encode() + b"\0" + bytes.fromhex(ref)))
            items.sort(key=lambda x: x[0])
            content = b"".join(x[1] for x in items)
            self.tree_sha[d] = hashlib.sha1(b"tree %d\0" % len(content) + content).hexdigest()

    @property
    def dirs(self):
        return [d for d in self.children if d]

    def root(self):
        return self.tree_sha[""]


def file_entry_json(path, e):
    out = {"type": "file", "oid": e["blob"], "size": e["size"], "path": path}
    if e.get("lfs"):
        out["lfs"] = {"oid": e["lfs"]["oid"], "size": e["lfs"]["size"], "pointerSize": e["lfs"]["pointerSize"]}
    return out


def lfs_patterns_match(gitattributes, path):
    """Whether `path` is tracked by git-lfs per a .gitattributes text (last matching line wins)."""
    result = False
    base = path.rsplit("/", 1)[-1]
    for line in gitattributes.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        fields = line.split()
        pattern, attrs = fields[0], fields[1:]
        if pattern.startswith("/"):
            pattern = pattern[1:]
        if "/" in pattern:
            ok = fnmatch.fnmatchcase(path, pattern)  # fnmatch's * also crosses "/"
            if not ok and "/**/" in pattern:
                ok = fnmatch.fnmatchcase(path, pattern.replace("/**/", "/"))
        else:
            ok = fnmatch.fnmatchcase(base, pattern)
        if not ok:
            continue
        for a in attrs:
            if a == "filter=lfs":
                result = True
            elif a in ("-filter", "!filter") or (a.startswith("filter=") and a != "filter=lfs"):
                result = False
    return result


# ----------------------------------------------------------------------------------------------------------
# persistent store


class Store:
    def __init__(self, root):
        self.root = os.path.abspath(root)
        for sub in ("repos", "blobs", "lfs/objects", "lfs/staging", "uploads", "tmp"):
            os.makedirs(os.path.join(self.root, sub), exist_ok=True)
        self.lock = threading.RLock()
        self._commit_cache = {}
        self._index_cache = collections.OrderedDict()

    # -- files
    def _tmp(self):
        return os.path.join(self.root, "tmp", uuid.uuid4().hex)

    def write_atomic(self, path, data):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = self._tmp()
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)

    def write_json(self, path, obj):
        self.write_atomic(path, json.dumps(obj, indent=1, sort_keys=True).encode())

    @staticmethod
    def read_json(path):
        try:
            with open(path, "rb") as f:
                return json.loads(f.read())
        except FileNotFoundError:
            return None

    # -- regular blobs (content addressed by git blob sha1)
    def blob_path(self, sha1):
        return os.path.join(self.root, "blobs", sha1[:2], sha1)

    def put_blob(self, data):
        sha1 = git_blob_sha1(data)
        p = self.blob_path(sha1)
        if not os.path.exists(p):
            self.write_atomic(p, data)
        return sha1

    # -- LFS objects (content addressed by sha256)
    def lfs_path(self, oid):
        return os.path.join(self.root, "lfs", "objects", oid[:2], oid[2:4], oid)

    def staging_path(self, oid):
        return os.path.join(self.root, "lfs", "staging", oid)

    def lfs_size(self, oid):
        try:
            return os.path.getsize(self.lfs_path(oid))
        except OSError:
            return None

    def promote_staged(self, oid, size=None):
        """Moves a staged (uploaded, unverified) object into the store if its sha256 matches.  Returns
        (ok, message)."""
        sp = self.staging_path(oid)
        if not os.path.exists(sp):
            return False, "object not uploaded"
        h = hashlib.sha256()
        n = 0
        with open(sp, "rb") as f:
            for chunk in iter(lambda: f.read(MiB), b""):
                h.update(chunk)
                n += len(chunk)
        if h.hexdigest() != oid:
            return False, f"sha256 mismatch: uploaded content hashes to {h.hexdigest()}"
        if size is not None and n != size:
            return False, f"size mismatch: uploaded {n} bytes, expected {size}"
        dst = self.lfs_path(oid)
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        os.replace(sp, dst)
        return True, "ok"

    def ingest_stream(self, chunks, expected_oid, md5_out=None):
        """Writes chunks to a temp file; if the sha256 equals expected_oid the file becomes the stored
        object, else it is kept in staging (verify then reports the mismatch).  Returns (sha256, size) and
        appends the md5 (the S3-style ETag) to `md5_out` when given."""
        tmp = self._tmp()
        h = hashlib.sha256()
        md5 = hashlib.md5()
        n = 0
        with open(tmp, "wb") as f:
            for chunk in chunks:
                h.update(chunk)
                md5.update(chunk)
                n += len(chunk)
                f.write(chunk)
        if md5_out is not None:
            md5_out.append(md5.hexdigest())
        digest = h.hexdigest()
        if digest == expected_oid:
            dst = self.lfs_path(digest)
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            os.replace(tmp, dst)
            try:
                os.unlink(self.staging_path(expected_oid))
            except OSError:
                pass
        else:
            os.replace(tmp, self.staging_path(expected_oid))
        return digest, n

    # -- repos
    def repo_dir(self, rtype, rid):
        ns, name = rid.split("/", 1)
        return os.path.join(self.root, "repos", rtype + "s", ns, name)

    def load_repo(self, rtype, rid):
        return self.read_json(os.path.join(self.repo_dir(rtype, rid), "repo.json"))

    def save_repo(self, repo):
        self.write_json(os.path.join(self.repo_dir(repo["type"], repo["id"]), "repo.json"), repo)

    def load_commit(self, repo, sha):
        key = (repo["type"], repo["id"], sha)
        c = self._commit_cache.get(key)
        if c is None:
            c = self.read_json(os.path.join(self.repo_dir(repo["type"], repo["id"]), "commits", sha + ".json"))
            if c is not None:
                self._commit_cache[key] = c
        return c

    def save_commit(self, repo, commit):
        self.write_json(os.path.join(self.repo_dir(repo["type"], repo["id"]), "commits", commit["id"] + ".json"), commit)
        self._commit_cache[(repo["type"], repo["id"], commit["id"])] = commit

    def tree_index(self, repo, commit):
        key = (repo["type"], repo["id"], commit["id"])
        idx = self._index_cache.get(key)
        if idx is None:
            idx = TreeIndex(commit["files"])
            self._index_cache[key] = idx
            while len(self._index_cache) > 256:
                self._index_cache.popitem(last=False)
        return idx

    def resolve_rev(self, repo, rev):
        if rev.startswith("refs/heads/"):
            rev = rev[len("refs/heads/"):]
        if rev in repo["refs"]:
            return repo["refs"][rev]
        if HEX_RE.match(rev):
            cdir = os.path.join(self.repo_dir(repo["type"], repo["id"]), "commits")
            if len(rev) == 40:
                return rev if os.path.exists(os.path.join(cdir, rev + ".json")) else None
            try:
                names = [n[:-5] for n in os.listdir(cdir) if n.startswith(rev) and n.endswith(".json")]
            except OSError:
                names = []
            if len(names) == 1:
                return names[0]
        return None

    def make_commit(self, repo, parents, files, summary, description, author, t=None):
        t = time.time() if t is None else t
        tree = TreeIndex(files).root()
        message = summary + ("\n\n" + description if description else "")
        ident = f"{author} <{author}@users.noreply.huggingface.co> {int(t)} +0000"
        text = f"tree {tree}\n" + "".join(f"parent {p}\n" for p in parents)
        text += f"author {ident}\ncommitter {ident}\n\n{message}\n"
        raw = text.encode()
        sha = hashlib.sha1(b"commit %d\0" % len(raw) + raw).hexdigest()
        return {"id": sha, "parents": parents, "tree": tree, "title": summary, "message": message,
                "date": iso_time(t), "author": author, "files": files}


# ----------------------------------------------------------------------------------------------------------
# faults, stats, rate limits


class Faults:
    REQUEST_KINDS = ("status", "delay")
    BODY_KINDS = ("drop", "truncate", "corrupt", "throttle", "oversize", "endless")
    HEADER_KINDS = ("headers",)
    LISTING_KINDS = ("listing_size",)
    BATCH_KINDS = ("lfs_href",)

    def __init__(self):
        self.lock = threading.Lock()
        self.rules = []
        self.next_id = 1

    def add(self, spec):
        if not isinstance(spec, dict):
            raise ValueError("a fault rule must be a JSON object")
        r = dict(spec)
        kind = r.get("kind")
        if kind is None:
            if "status" in r:
                kind = "status"
            elif "delay" in r:
                kind = "delay"
            else:
                raise ValueError("fault rule needs a kind (or a status / delay)")
        if kind == "commit_412":
            kind = "status"
            r.setdefault("status", 412)
            r.setdefault("route", "commit")
            r.setdefault("method", "POST")
            r.setdefault("message", "A commit has happened since. Please refresh and try again.")
        if kind not in self.REQUEST_KINDS + self.BODY_KINDS + self.HEADER_KINDS + self.LISTING_KINDS + self.BATCH_KINDS:
            raise ValueError(f"unknown fault kind {kind!r}")
        if kind == "headers" and not (isinstance(r.get("headers"), dict) and r["headers"]):
            raise ValueError("a headers fault needs a non-empty headers object")
        if r.get("on_status") is not None and not (kind == "headers" and isinstance(r["on_status"], int)
                                                   and 100 <= r["on_status"] <= 599):
            raise ValueError("on_status is an integer HTTP status, for a headers fault")
        if kind == "oversize" and not (isinstance(r.get("extra", 0), int) and r.get("extra", 0) >= 0):
            raise ValueError("extra must be a non-negative integer")
        if kind == "listing_size" and "size" not in r and not isinstance(r.get("raw_size"), str):
            raise ValueError("listing_size needs size or raw_size")
        if kind == "lfs_href" and not (isinstance(r.get("href"), str) and r.get("action", "verify") in ("verify", "upload")):
            raise ValueError("lfs_href needs an href string and action verify or upload")
        if r.get("entry_regex") is not None:
            re.compile(r["entry_regex"])
        r["kind"] = kind
        if kind == "status":
            st = r.get("status")
            if not isinstance(st, int) or not 100 <= st <= 599:
                raise ValueError("status must be an integer HTTP status")
        if kind == "delay" and not isinstance(r.get("delay"), (int, float)):
            raise ValueError("delay must be a number of seconds")
        if kind == "throttle" and not (isinstance(r.get("bytes_per_sec"), (int, float)) and r["bytes_per_sec"] > 0):
            raise ValueError("throttle needs bytes_per_sec > 0")
        count = r.get("count", 1)
        if count is None or count == -1:
            count = -1
        elif not isinstance(count, int) or count < 1:
            raise ValueError("count must be a positive integer, -1 or null")
        r["count"] = count
        r["skip"] = int(r.get("skip", 0))
        if r.get("path_regex") is not None:
            re.compile(r["path_regex"])
        if r.get("method"):
            r["method"] = str(r["method"]).upper()
        with self.lock:
            r["id"] = self.next_id
            self.next_id += 1
            r["fired"] = 0
            self.rules.append(r)
        return r

    def clear(self, rid=None):
        with self.lock:
            if rid is None:
                self.rules = []
            else:
                self.rules = [r for r in self.rules if r["id"] != rid]

    def snapshot(self):
        with self.lock:
            return [dict(r) for r in self.rules]

    @staticmethod
    def _matches(r, req, status=None):
        if r.get("on_status") is not None and r["on_status"] != status:
            return False
        if r.get("method") and r["method"] != req["method"]:
            return False
        if r.get("route") and r["route"] not in (req["route"], req["category"]):
            return False
        if r.get("path_regex") and not re.search(r["path_regex"], req["path"]):
            return False
        if r.get("oid") and r["oid"] not in req["path"]:
            return False
        return True

    def _fire(self, r):
        """Called under lock for a matching rule; returns True if it fires (skip/count bookkeeping)."""
        if r["skip"] > 0:
            r["skip"] -= 1
            return False
        r["fired"] += 1
        if r["count"] > 0:
            r["count"] -= 1
            if r["count"] == 0:
                self.rules.remove(r)
        return True

    def request_phase(self, req):
        delays, status_rule = [], None
        with self.lock:
            for r in list(self.rules):
                if r["kind"] not in self.REQUEST_KINDS or not self._matches(r, req):
                    continue
                if r["kind"] == "status" and status_rule is not None:
                    continue
                if not self._fire(r):
                    continue
                if r["kind"] == "delay":
                    delays.append(dict(r))
                else:
                    status_rule = dict(r)
        return delays, status_rule

    def body_phase(self, req):
        return self.take(self.BODY_KINDS, req)

    def take(self, kinds, req, status=None):
        """The first matching rule of one of kinds that fires (consumed), or None.  status: the
        response's, for rules that fire on one status only (on_status)."""
        rules = self.take_all(kinds, req, first=True, status=status)
        return rules[0] if rules else None

    def take_all(self, kinds, req, first=False, status=None):
        """Every matching rule of one of kinds that fires (each consumed once), in install order."""
        out = []
        with self.lock:
            for r in list(self.rules):
                if r["kind"] in kinds and self._matches(r, req, status) and self._fire(r):
                    out.append(dict(r))
                    if first:
                        break
        return out


class Stats:
    def __init__(self):
        self.lock = threading.Lock()
        self.seq = 0  # request sequence numbers keep growing across resets (GET /_sim/requests?since=)
        self.reset()

    def reset(self):
        with self.lock:
            self.total = 0
            self.categories = collections.Counter()
            self.routes = collections.Counter()
            self.route_ids = collections.Counter()
            self.statuses = collections.Counter()
            self.faults = collections.Counter()
            self.cdn_with_auth = 0
            self.upload_with_auth = 0
            self.commits = 0
            self.rate_limited = 0
            self.log = collections.deque(maxlen=5000)

    def begin(self, entry):
        with self.lock:
            self.seq += 1
            entry["seq"] = self.seq
            self.total += 1
            self.categories[entry["category"]] += 1
            self.routes[entry["template"]] += 1
            self.route_ids[entry["route"]] += 1
            if entry["auth"] and entry["category"] == "cdn":
                self.cdn_with_auth += 1
            if entry["auth"] and entry["route"] in ("lfs_upload", "lfs_part"):
                self.upload_with_auth += 1
            self.log.append(entry)

    def status(self, entry, status):
        with self.lock:
            if entry.get("status") is None:
                entry["status"] = status
                self.statuses[str(status)] += 1

    def fault(self, entry, kind):
        with self.lock:
            entry["fault"] = kind if not entry.get("fault") else entry["fault"] + "+" + kind
            self.faults[kind] += 1

    def snapshot(self):
        with self.lock:
            out = {
                "total": self.total,
                "api": self.categories["api"], "resolver": self.categories["resolver"],
                "cdn": self.categories["cdn"], "lfs": self.categories["lfs"], "other": self.categories["other"],
                "routes": dict(self.routes), "route_ids": dict(self.route_ids), "statuses": dict(self.statuses),
                "faults_fired": dict(self.faults), "cdn_with_auth": self.cdn_with_auth,
                "upload_with_auth": self.upload_with_auth, "commits": self.commits,
                "rate_limited": self.rate_limited,
            }
        return out

    def requests(self, since=0):
        with self.lock:
            return [dict(e) for e in self.log if e["seq"] > since]


class RateLimiter:
    def __init__(self, cfg):
        self.cfg = cfg
        self.lock = threading.Lock()
        self.window_start = time.time()
        self.counts = collections.Counter()

    def check(self, category):
        """Returns (limited, headers)."""
        limit = {"api": self.cfg["api_limit"], "resolver": self.cfg["resolver_limit"]}.get(category)
        if not limit:
            return False, {}
        resource = "api" if category == "api" else "resolvers"
        with self.lock:
            now = time.time()
            w = self.cfg["rate_window"]
            if now - self.window_start >= w:
                self.window_start = now
                self.counts.clear()
            reset = max(0, int(math.ceil(self.window_start + w - now)))
            if self.counts[category] >= limit:
                return True, {"RateLimit": f'"{resource}";r=0;t={reset}', "Retry-After": str(reset),
                              "RateLimit-Policy": f'"fixed window";"{resource}";q={limit};w={int(w)}'}
            self.counts[category] += 1
            remaining = limit - self.counts[category]
        return False, {"RateLimit": f'"{resource}";r={remaining};t={reset}',
                       "RateLimit-Policy": f'"fixed window";"{resource}";q={limit};w={int(w)}'}


class Sim:
    def __init__(self, args):
        self.store = Store(args.root)
        self.cfg = {
            "page_size": args.page_size, "commits_page_size": args.commits_page_size, "expand_page_size": 50,
            "lfs_threshold": args.lfs_threshold, "multipart_threshold": args.multipart_threshold,
            "chunk_size": args.chunk_size, "tokens": list(args.token or []), "api_limit": args.api_limit,
            "resolver_limit": args.resolver_limit, "rate_window": args.rate_window,
            "regular_checks": not args.no_regular_checks, "max_preupload_files": 256,
        }
        self.user = args.user
        self.api_host = args.api_host
        self.cdn_host = args.cdn_host
        self.verbose = args.verbose
        self.faults = Faults()
        self.stats = Stats()
        self.rate = RateLimiter(self.cfg)
        self.port = None
        self.servers = []
        for spec in args.fault or []:
            self.faults.add(json.loads(spec))
        if args.fail_next_commit:
            self.faults.add({"kind": "commit_412"})


# ----------------------------------------------------------------------------------------------------------
# bodies


class FileBody:
    def __init__(self, path, start=0, length=None):
        self.path = path
        self.start = start
        self.length = os.path.getsize(path) - start if length is None else length

    def __len__(self):
        return self.length

    def chunks(self, limit):
        with open(self.path, "rb") as f:
            f.seek(self.start)
            left = min(limit, self.length)
            while left > 0:
                b = f.read(min(256 * 1024, left))
                if not b:
                    break
                left -= len(b)
                yield b


def parse_range(header, size):
    """-> (start, end) inclusive, or None if unsatisfiable/invalid (strict: one `bytes=` range only)."""
    m = re.fullmatch(r"\s*bytes\s*=\s*(\d*)\s*-\s*(\d*)\s*", header)
    if not m or (m.group(1) == "" and m.group(2) == ""):
        return None
    a, b = m.groups()
    if a == "":
        n = int(b)
        if n == 0 or size == 0:
            return None
        return max(0, size - n), size - 1
    start = int(a)
    end = int(b) if b else size - 1
    if start >= size or end < start:
        return None
    return start, min(end, size - 1)


def truthy(v):
    return str(v).lower() in ("1", "true", "yes", "on")


# ----------------------------------------------------------------------------------------------------------
# HTTP handler


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "hubsim/1.0"

    # -- plumbing
    def log_message(self, fmt, *args):
        if self.server.sim.verbose:
            sys.stderr.write("hubsim: %s - %s\n" % (self.address_string(), fmt % args))

    def do_GET(self):
        self._dispatch()

    do_HEAD = do_POST = do_PUT = do_DELETE = do_PATCH = do_OPTIONS = do_GET

    @property
    def sim(self):
        return self.server.sim

    def _host(self):
        return self.headers.get("Host") or f"{self.sim.api_host}:{self.sim.port}"

    def base_url(self):
        return "http://" + self._host()

    def cdn_base(self):
        host = self._host()
        hostname = urlsplit("http://" + host).hostname or ""
        cdn = self.sim.cdn_host
        if hostname.lower() == cdn.lower():
            cdn = self.sim.api_host if self.sim.api_host.lower() != cdn.lower() else "localhost"
            if hostname.lower() == cdn.lower():
                cdn = "127.0.0.1" if hostname != "127.0.0.1" else "localhost"
        if ":" in cdn and not cdn.startswith("["):
            cdn = f"[{cdn}]"
        return f"http://{cdn}:{self.sim.port}"

    # request body
    def _has_body(self):
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            return True
        try:
            return int(self.headers.get("Content-Length") or 0) > 0
        except ValueError:
            return False

    def _read_exact(self, n):
        out = []
        while n > 0:
            b = self.rfile.read(min(n, MiB))
            if not b:
                raise ClientGone("client closed the connection while sending the body")
            out.append(b)
            n -= len(b)
        return b"".join(out)

    def iter_body(self):
        if self._body_consumed:
            return
        self._body_consumed = True
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            while True:
                line = self.rfile.readline(65537)
                if not line:
                    raise ClientGone("eof in chunked body")
                try:
                    size = int(line.split(b";", 1)[0].strip(), 16)
                except ValueError:
                    raise HubError(400, "bad chunked encoding")
                if size == 0:
                    while True:
                        t = self.rfile.readline(65537)
                        if t in (b"\r\n", b"\n", b""):
                            break
                    return
                while size > 0:
                    b = self._read_exact(min(size, MiB))
                    size -= len(b)
                    yield b
                self._read_exact(2)
        else:
            try:
                n = int(self.headers.get("Content-Length") or 0)
            except ValueError:
                raise HubError(400, "bad Content-Length")
            while n > 0:
                b = self.rfile.read(min(n, MiB))
                if not b:
                    raise ClientGone("client closed the connection while sending the body")
                n -= len(b)
                yield b

    def read_body(self, limit=2 * 1024 * MiB):
        out, n = [], 0
        for b in self.iter_body():
            n += len(b)
            if n > limit:
                raise HubError(413, "request body too large")
            out.append(b)
        return b"".join(out)

    def read_json(self):
        raw = self.read_body()
        try:
            return json.loads(raw or b"null")
        except ValueError:
            raise HubError(400, "invalid JSON body")

    def _drain(self):
        if self._body_consumed or not self._has_body():
            self._body_consumed = True
            return
        chunked = "chunked" in self.headers.get("Transfer-Encoding", "").lower()
        try:
            n = int(self.headers.get("Content-Length") or 0)
        except ValueError:
            n = 1 << 62
        if chunked or n > 16 * MiB:
            self.close_connection = True
            self._body_consumed = True
            return
        try:
            for _ in self.iter_body():
                pass
        except (HubError, ClientGone, OSError):
            self.close_connection = True

    # responses
    def respond(self, status, body=b"", headers=None, content_type="application/json"):
        self._drain()
        head = self.command == "HEAD"
        headers = dict(headers or {})
        for k, v in self._rl_headers.items():
            headers.setdefault(k, v)
        length = len(body)
        fault = None
        if self._req is not None:
            hfault = self.sim.faults.take(Faults.HEADER_KINDS, self._req, status=status)
            if hfault:
                self.sim.stats.fault(self._entry, hfault["kind"])
                headers.update(hfault["headers"])
        if not head and length > 0 and self._req is not None:
            fault = self.sim.faults.body_phase(self._req)
            if fault:
                self.sim.stats.fault(self._entry, fault["kind"])
        send_len = length
        if fault and fault["kind"] == "truncate":
            send_len = max(0, min(length - 1, int(fault.get("bytes", length // 2))))
        extra = int(fault.get("extra", 200 * MiB)) if fault and fault["kind"] == "oversize" else 0
        endless = fault is not None and fault["kind"] == "endless"
        # a body that outgrows any length we could announce ends with the connection
        close_delimited = endless or (extra > 0 and not fault.get("announce", True))
        if close_delimited:
            self.close_connection = True
        self.send_response(status)
        if content_type and "Content-Type" not in headers:
            headers["Content-Type"] = content_type
        for k, v in headers.items():
            self.send_header(k, str(v))
        if not close_delimited:
            self.send_header("Content-Length", str(send_len + extra))
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        if self._entry is not None:
            self.sim.stats.status(self._entry, status)
        if endless:
            return self._send_endless(int(fault.get("max_bytes", 1024 * MiB)))
        if head or send_len == 0:
            return
        limit = send_len
        drop = fault is not None and fault["kind"] == "drop"
        if drop:
            limit = max(0, min(send_len - 1, int(fault.get("after_bytes", send_len // 2))))
        corrupt_left = 64 if fault is not None and fault["kind"] == "corrupt" else 0
        bps = float(fault["bytes_per_sec"]) if fault is not None and fault["kind"] == "throttle" else 0
        chunks = body.chunks(limit) if isinstance(body, FileBody) else iter([body[:limit]])
        try:
            for chunk in chunks:
                if corrupt_left:
                    k = min(corrupt_left, len(chunk))
                    chunk = bytes(x ^ 0xFF for x in chunk[:k]) + chunk[k:]
                    corrupt_left -= k
                if bps:
                    step = max(1, int(bps / 20))
                    for i in range(0, len(chunk), step):
                        time.sleep(len(chunk[i:i + step]) / bps)
                        self.wfile.write(chunk[i:i + step])
                else:
                    self.wfile.write(chunk)
            if drop:
                self.wfile.flush()
                self.close_connection = True
                try:
                    self.connection.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
            if extra:
                filler = b"\0" * (256 * 1024)
                while extra > 0:
                    n = min(extra, len(filler))
                    self.wfile.write(filler[:n])
                    extra -= n
        except (BrokenPipeError, ConnectionResetError, ConnectionAbortedError):
            self.close_connection = True

    def _send_endless(self, max_bytes):
        """A JSON array that never closes: fake but well-formed file entries, as fast as the client reads."""
        entry = b'{"type":"file","oid":"' + b"0" * 40 + b'","size":1,"path":"nodes/evil/delta_1.safetensors"},'
        chunk = entry * max(1, (256 * 1024) // len(entry))
        sent = 0
        try:
            self.wfile.write(b"[")
            while sent < max_bytes:
                self.wfile.write(chunk)
                sent += len(chunk)
        except (BrokenPipeError, ConnectionResetError, ConnectionAbortedError, socket.timeout):
            pass
        self.close_connection = True

    def respond_json(self, status, obj, headers=None, content_type="application/json"):
        self.respond(status, json.dumps(obj).encode(), headers, content_type)

    def respond_error(self, status, message, code=None, headers=None):
        """code None: the status's usual X-Error-Code; "" sends none (the Hub's answer to a wrong token)."""
        if code is None:
            code = ERROR_CODES.get(status, "Error")
        h = {"X-Error-Message": message.encode("ascii", "replace").decode().replace("\n", " ").replace("\r", " ")}
        if code:
            h["X-Error-Code"] = code
        h.update(headers or {})
        self.respond_json(status, {"error": message}, h)

    # -- dispatch
    def _dispatch(self):
        self._body_consumed = False
        self._entry = None
        self._req = None
        self._rl_headers = {}
        try:
            split = urlsplit(self.path)
            raw_path = split.path or "/"
            self.query = parse_qsl(split.query, keep_blank_values=True)
            self.qd = {}
            for k, v in self.query:
                self.qd.setdefault(k, []).append(v)
            if raw_path == "/_sim" or raw_path.startswith("/_sim/"):
                return self._control(raw_path)
            route_id, template, fn, params = self._route(raw_path)
            category = ROUTE_CATEGORY[route_id]
            auth = self.headers.get("Authorization")
            self._entry = {
                "time": time.time(), "method": self.command, "path": self.path, "host": self.headers.get("Host"),
                "route": route_id, "template": f"{self.command} {template}", "category": category,
                "auth": auth is not None, "range": self.headers.get("Range"), "status": None, "fault": None,
            }
            self.sim.stats.begin(self._entry)
            self._req = {"method": self.command, "path": self.path, "route": route_id, "category": category}
            delays, status_rule = self.sim.faults.request_phase(self._req)
            for d in delays:
                self.sim.stats.fault(self._entry, "delay")
                time.sleep(float(d["delay"]))
            if status_rule:
                self.sim.stats.fault(self._entry, f"status_{status_rule['status']}")
                if status_rule.get("delay"):
                    time.sleep(float(status_rule["delay"]))
                return self._status_fault(status_rule, category)
            limited, rl_headers = self.sim.rate.check(category)
            self._rl_headers = rl_headers
            if limited:
                with self.sim.stats.lock:
                    self.sim.stats.rate_limited += 1
                return self.respond_error(429, "You have exceeded the rate limit, please retry later.",
                                          "RateLimited", rl_headers)
            if route_id not in NO_AUTH_ROUTES and self.sim.cfg["tokens"]:
                if auth is None:
                    raise HubError(401, "Repository not found (authentication required)", "RepoNotFound")
                tok = auth[7:].strip() if auth[:7].lower() == "bearer " else None
                if tok not in self.sim.cfg["tokens"]:
                    # the Hub names no error code here, so huggingface_hub does not take a wrong token
                    # for a missing repo (its hf_raise_for_status checks this exact message)
                    raise HubError(401, "Invalid credentials in Authorization header", "")
            fn(**params)
        except HubError as e:
            try:
                hdrs = dict(e.headers)
                self.respond_error(e.status, e.message, e.code, hdrs)
            except OSError:
                self.close_connection = True
        except ClientGone:
            self.close_connection = True
        except (BrokenPipeError, ConnectionResetError, ConnectionAbortedError, socket.timeout):
            self.close_connection = True
        except Exception as e:  # a bug in the emulator: report it loudly
            traceback.print_exc(file=sys.stderr)
            self.close_connection = True
            try:
                self.respond_error(500, f"hubsim internal error: {e!r}", "InternalError")
            except OSError:
                pass

    def _status_fault(self, rule, category):
        st = rule["status"]
        headers = dict(rule.get("headers") or {})
        if st == 429:
            t = int(rule.get("retry_after", 1))
            resource = "resolvers" if category == "resolver" else "api"
            headers.setdefault("Retry-After", str(t))
            headers.setdefault("RateLimit", f'"{resource}";r=0;t={t}')
            headers.setdefault("RateLimit-Policy", f'"fixed window";"{resource}";q=1000;w=300')
        msg = rule.get("message") or f"hubsim injected HTTP {st}"
        if st < 400:
            return self.respond_json(st, {"message": msg}, headers)
        self.respond_error(st, msg, rule.get("error_code"), headers)

    def _route(self, raw_path):
        """-> (route_id, template, handler, params)."""
        segs = raw_path.split("/")[1:]
        m = self.command
        if segs and segs[0] == "api":
            s = segs[1:]
            if s[:2] == ["repos", "create"] and len(s) == 2:
                return "create_repo", "/api/repos/create", self._only("POST", self.h_create_repo), {}
            if s[:2] == ["repos", "delete"] and len(s) == 2:
                return "delete_repo", "/api/repos/delete", self._only("DELETE", self.h_delete_repo), {}
            if s == ["validate-yaml"]:
                return "validate_yaml", "/api/validate-yaml", self._only("POST", self.h_validate_yaml), {}
            if s == ["whoami-v2"]:
                return "whoami", "/api/whoami-v2", self._only("GET", self.h_whoami), {}
            if s == ["complete_multipart"]:
                return "lfs_complete", "/api/complete_multipart", self._only("POST", self.h_lfs_complete), {}
            if len(s) >= 3 and s[0] in REPO_TYPES:
                rtype = REPO_TYPES[s[0]]
                rid = unquote(s[1]) + "/" + unquote(s[2])
                rest = s[3:]
                tp = f"/api/{s[0]}/{{repo}}"
                p = {"rtype": rtype, "rid": rid}
                if not rest or rest == [""]:
                    return "repo_info", tp, self._only("GET", self.h_repo_info), dict(p, rev=None)
                op, r = rest[0], rest[1:]
                if op == "revision" and r:
                    return "repo_info", tp + "/revision/{rev}", self._only("GET", self.h_repo_info), dict(p, rev=unquote("/".join(r)))
                if op == "tree" and r:
                    return "tree", tp + "/tree/{rev}", self._only("GET", self.h_tree), dict(p, rest=r)
                if op == "paths-info" and r:
                    return "paths_info", tp + "/paths-info/{rev}", self._only("POST", self.h_paths_info), dict(p, rev=unquote("/".join(r)))
                if op == "preupload" and r:
                    return "preupload", tp + "/preupload/{rev}", self._only("POST", self.h_preupload), dict(p, rev=unquote("/".join(r)))
                if op == "commit" and r:
                    return "commit", tp + "/commit/{rev}", self._only("POST", self.h_commit), dict(p, rev=unquote("/".join(r)))
                if op == "commits" and r:
                    return "commits", tp + "/commits/{rev}", self._only("GET", self.h_commits), dict(p, rev=unquote("/".join(r)))
                if op == "refs" and not r:
                    return "refs", tp + "/refs", self._only("GET", self.h_refs), p
                if op == "branch" and r:
                    return "branch", tp + "/branch/{branch}", self.h_branch, dict(p, branch=unquote("/".join(r)))
            return "api_other", "/api/<unknown>", self._not_found, {}
        if segs and segs[0] == "lfs-cdn" and len(segs) == 2:
            return "cdn", "/lfs-cdn/{oid}", self._only(("GET", "HEAD"), self.h_cdn), {"oid": segs[1]}
        if segs and segs[0] == "lfs-upload":
            if len(segs) == 2:
                return "lfs_upload", "/lfs-upload/{oid}", self._only("PUT", self.h_lfs_put), {"oid": segs[1]}
            if len(segs) == 4:
                return "lfs_part", "/lfs-upload/{oid}/{upload}/{part}", self._only("PUT", self.h_lfs_part), \
                    {"oid": segs[1], "upload_id": segs[2], "part": segs[3]}
        s = segs
        rtype = "model"
        if len(s) >= 3 and s[0] in ("datasets", "spaces"):
            rtype = REPO_TYPES[s[0]]
            s = s[1:]
        pre = "/" + URL_PREFIX[rtype]
        if len(s) >= 4 and s[2] == "resolve":
            rid = unquote(s[0]) + "/" + unquote(s[1])
            return "resolve", pre + "{repo}/resolve/{rev}/{path}", self._only(("GET", "HEAD"), self.h_resolve), \
                {"rtype": rtype, "rid": rid, "rest": s[3:]}
        if len(s) == 6 and s[1].endswith(".git") and s[2:5] == ["info", "lfs", "objects"]:
            rid = unquote(s[0]) + "/" + unquote(s[1][:-4])
            if s[5] == "batch":
                return "lfs_batch", pre + "{repo}.git/info/lfs/objects/batch", self._only("POST", self.h_lfs_batch), \
                    {"rtype": rtype, "rid": rid}
            if s[5] == "verify":
                return "lfs_verify", pre + "{repo}.git/info/lfs/objects/verify", self._only("POST", self.h_lfs_verify), \
                    {"rtype": rtype, "rid": rid}
        return "unknown", "<unknown>", self._not_found, {}

    def _only(self, methods, fn):
        methods = (methods,) if isinstance(methods, str) else methods

        def wrapped(**kw):
            if self.command not in methods:
                raise HubError(405, f"method {self.command} not allowed here", headers={"Allow": ", ".join(methods)})
            return fn(**kw)
        return wrapped

    def _not_found(self, **kw):
        raise HubError(404, f"no route for {self.command} {self.path}")

    # -- helpers on repos
    def _repo(self, rtype, rid):
        ns, _, name = rid.partition("/")
        if not (NAME_RE.match(ns) and NAME_RE.match(name)):
            raise HubError(404, f"Repository not found: {rid}", "RepoNotFound")
        with self.sim.store.lock:
            repo = self.sim.store.load_repo(rtype, rid)
        if repo is None:
            raise HubError(404, f"Repository not found: {rid}", "RepoNotFound")
        return repo

    def _commit_at(self, repo, rev):
        sha = self.sim.store.resolve_rev(repo, rev)
        if sha is None:
            raise HubError(404, f"Invalid rev id: {rev}", "RevisionNotFound")
        return self.sim.store.load_commit(repo, sha)

    def repo_url(self, repo):
        return f"{self.base_url()}/{URL_PREFIX[repo['type']]}{repo['id']}"

    def _split_rev_path(self, rest):
        """rev + path from the raw segments after /tree/ or /resolve/ (quoted or not)."""
        first = unquote(rest[0])
        if "/" not in first and first == "refs" and len(rest) >= 3:
            return "/".join(unquote(x) for x in rest[:3]), unquote("/".join(rest[3:]))
        return first, unquote("/".join(rest[1:]))

    def _upload_mode(self, files, path, size, sample):
        if size >= self.sim.cfg["lfs_threshold"]:
            return "lfs"
        ga = files.get(".gitattributes")
        if ga and not ga.get("lfs"):
            try:
                with open(self.sim.store.blob_path(ga["blob"]), "rb") as f:
                    text = f.read().decode("utf-8", "replace")
            except OSError:
                text = ""
            if lfs_patterns_match(text, path):
                return "lfs"
        if b"\0" in sample:
            return "lfs"
        return "regular"

    # -- control API
    def _control(self, raw_path):
        sim = self.sim
        parts = raw_path.split("/")[2:]
        op = parts[0] if parts else ""
        m = self.command
        try:
            if op == "health" and m == "GET":
                return self.respond_json(200, {"ok": True, "port": sim.port, "api": f"http://{sim.api_host}:{sim.port}",
                                               "cdn": f"http://{sim.cdn_host}:{sim.port}", "root": sim.store.root})
            if op == "stats" and m == "GET":
                return self.respond_json(200, sim.stats.snapshot())
            if op == "reset-stats" and m == "POST":
                sim.stats.reset()
                return self.respond_json(200, {"ok": True})
            if op == "requests" and m == "GET":
                since = int(self.qd.get("since", ["0"])[0])
                return self.respond_json(200, sim.stats.requests(since))
            if op == "faults":
                if m == "GET":
                    return self.respond_json(200, sim.faults.snapshot())
                if m == "DELETE":
                    sim.faults.clear(int(parts[1]) if len(parts) > 1 and parts[1] else None)
                    return self.respond_json(200, {"ok": True})
                if m == "POST":
                    spec = self.read_json()
                    if isinstance(spec, dict) and spec.get("clear"):
                        sim.faults.clear()
                        return self.respond_json(200, {"ok": True, "rules": []})
                    specs = spec if isinstance(spec, list) else [spec]
                    try:
                        added = [sim.faults.add(s) for s in specs]
                    except (ValueError, re.error) as e:
                        raise HubError(400, f"bad fault rule: {e}")
                    return self.respond_json(200, {"ok": True, "rules": added})
            if op == "config":
                if m == "POST":
                    upd = self.read_json()
                    if not isinstance(upd, dict):
                        raise HubError(400, "config must be an object")
                    for k, v in upd.items():
                        if k not in sim.cfg:
                            raise HubError(400, f"unknown config key {k}")
                        if k == "tokens":
                            v = list(v or [])
                        sim.cfg[k] = v
                if m in ("GET", "POST"):
                    return self.respond_json(200, sim.cfg)
            if op == "shutdown" and m == "POST":
                self.close_connection = True
                self.respond_json(200, {"ok": True})
                for s in sim.servers:
                    threading.Thread(target=s.shutdown, daemon=True).start()
                return
            raise HubError(404, f"unknown control endpoint {m} {raw_path}")
        except HubError as e:
            self.respond_error(e.status, e.message, e.code)

    # -- API handlers
    def h_whoami(self):
        u = self.sim.user
        self.respond_json(200, {"type": "user", "id": "0" * 24, "name": u, "fullname": u, "orgs": [],
                                "auth": {"type": "access_token", "accessToken": {"displayName": "hubsim", "role": "write"}}})

    def h_validate_yaml(self):
        self.read_body()
        self.respond_json(200, {"errors": [], "warnings": []})

    def h_create_repo(self):
        body = self.read_json()
        if not isinstance(body, dict) or not isinstance(body.get("name"), str):
            raise HubError(400, "body must be {\"name\": ..., \"organization\": ...}")
        ns = body.get("organization") or self.sim.user
        name = body["name"]
        rtype = body.get("type") or "model"
        if rtype not in URL_PREFIX:
            raise HubError(400, f"invalid repo type {rtype}")
        if not (NAME_RE.match(ns) and NAME_RE.match(name)) or name.endswith(".git"):
            raise HubError(400, f"invalid repo name {ns}/{name}")
        rid = f"{ns}/{name}"
        store = self.sim.store
        with store.lock:
            existing = store.load_repo(rtype, rid)
            if existing is not None:
                url = self.repo_url(existing)
                return self.respond_json(409, {"error": f"You already created this {rtype} repo", "url": url},
                                         {"X-Error-Code": "RepoExists",
                                          "X-Error-Message": f"You already created this {rtype} repo"})
            repo = {"type": rtype, "id": rid, "_id": uuid.uuid4().hex[:24], "private": bool(body.get("private")),
                    "createdAt": iso_time(time.time()), "refs": {}}
            blob = store.put_blob(DEFAULT_GITATTRIBUTES.encode())
            files = {".gitattributes": {"blob": blob, "size": len(DEFAULT_GITATTRIBUTES.encode()), "lfs": None}}
            c = store.make_commit(repo, [], files, "initial commit", "", self.sim.user)
            store.save_commit(repo, c)
            repo["refs"]["main"] = c["id"]
            store.save_repo(repo)
        self.respond_json(200, {"url": self.repo_url(repo), "name": rid, "id": repo["_id"]})

    def h_delete_repo(self):
        body = self.read_json()
        if not isinstance(body, dict) or not isinstance(body.get("name"), str):
            raise HubError(400, "body must be {\"name\": ..., \"organization\": ...}")
        rid = f"{body.get('organization') or self.sim.user}/{body['name']}"
        rtype = body.get("type") or "model"
        if rtype not in URL_PREFIX:
            raise HubError(400, f"invalid repo type {rtype}")
        self._repo(rtype, rid)
        with self.sim.store.lock:
            shutil.rmtree(self.sim.store.repo_dir(rtype, rid), ignore_errors=True)
            for k in [k for k in self.sim.store._commit_cache if k[:2] == (rtype, rid)]:
                del self.sim.store._commit_cache[k]
        self.respond(200, b"", content_type=None)

    def h_repo_info(self, rtype, rid, rev):
        repo = self._repo(rtype, rid)
        commit = self._commit_at(repo, rev or "main")
        blobs = truthy(self.qd.get("blobs", ["false"])[0])
        siblings = []
        for p in sorted(commit["files"]):
            e = commit["files"][p]
            s = {"rfilename": p}
            if blobs:
                s.update({"size": e["size"], "blobId": e["blob"]})
                if e.get("lfs"):
                    s["lfs"] = {"sha256": e["lfs"]["oid"], "size": e["lfs"]["size"], "pointerSize": e["lfs"]["pointerSize"]}
            siblings.append(s)
        ns = rid.split("/")[0]
        info = {"_id": repo["_id"], "id": rid, "author": ns, "sha": commit["id"], "lastModified": commit["date"],
                "createdAt": repo["createdAt"], "private": repo.get("private", False), "disabled": False,
                "gated": False, "downloads": 0, "likes": 0, "tags": [], "siblings": siblings,
                "usedStorage": sum(e["size"] for e in commit["files"].values())}
        if rtype == "model":
            info["modelId"] = rid
        if rtype == "space":
            info.update({"sdk": "static", "runtime": {"stage": "RUNNING"}})
        expand = self.qd.get("expand", []) + self.qd.get("expand[]", [])
        if expand:
            info = {k: v for k, v in info.items() if k in set(expand) | {"_id", "id"}}
        self.respond_json(200, info)

    def _listing(self, repo, commit, path, recursive):
        idx = self.sim.store.tree_index(repo, commit)
        files = commit["files"]
        if path and path not in idx.children:
            if path in files:
                raise HubError(404, f"{path} is a file, not a directory", "EntryNotFound")
            raise HubError(404, f"Entry not found: {path}", "EntryNotFound")

        def under(p):
            if recursive:
                return not path or p.startswith(path + "/")
            parent = p.rsplit("/", 1)[0] if "/" in p else ""
            return parent == path

        out = [{"type": "directory", "oid": idx.tree_sha[d], "size": 0, "path": d} for d in idx.dirs if under(d)]
        out += [file_entry_json(p, e) for p, e in files.items() if under(p)]
        out.sort(key=lambda e: e["path"])
        return out

    def _last_commits(self, repo, head, paths):
        """path -> {"id","title","date"} of the newest commit that changed it (walks first parents)."""
        store = self.sim.store
        want = set(paths)
        found = {}
        c = head
        while c is not None and want:
            parent = store.load_commit(repo, c["parents"][0]) if c["parents"] else None
            ci, pi = store.tree_index(repo, c), (store.tree_index(repo, parent) if parent else None)
            for p in list(want):
                def oid(idx, commit):
                    if idx is None:
                        return None
                    if p in commit["files"]:
                        return commit["files"][p]["blob"]
                    return idx.tree_sha.get(p)
                if oid(ci, c) != oid(pi, parent):
                    found[p] = {"id": c["id"], "title": c["title"], "date": c["date"]}
                    want.discard(p)
            c = parent
        return found

    def _cursor(self, commit_id):
        """(commit id, offset) from ?cursor= (which pins the commit listed), else (commit_id, 0)."""
        offset = 0
        cur = self.qd.get("cursor", [None])[0]
        if cur:
            try:
                d = json.loads(base64.urlsafe_b64decode(cur + "=" * (-len(cur) % 4)))
                commit_id, offset = d["c"], int(d["o"])
            except (ValueError, KeyError, TypeError, binascii.Error):
                raise HubError(400, "invalid cursor")
        return commit_id, offset

    def _link_next(self, commit_id, next_offset):
        cur = base64.urlsafe_b64encode(json.dumps({"c": commit_id, "o": next_offset}).encode()).decode().rstrip("=")
        q = [(k, v) for k, v in self.query if k != "cursor"] + [("cursor", cur)]
        url = self.base_url() + urlsplit(self.path).path + "?" + urlencode(q)
        return f'<{url}>; rel="next"'

    def h_tree(self, rtype, rid, rest):
        repo = self._repo(rtype, rid)
        rev, path = self._split_rev_path(rest)
        path = path.strip("/")
        commit = self._commit_at(repo, rev)
        recursive = truthy(self.qd.get("recursive", ["false"])[0])
        expand = truthy(self.qd.get("expand", ["false"])[0])
        ps = int(self.sim.cfg["page_size"])
        if expand:
            ps = min(ps, int(self.sim.cfg["expand_page_size"]))
        if self.qd.get("limit"):
            try:
                ps = max(1, min(ps, int(self.qd["limit"][0])))
            except ValueError:
                raise HubError(400, "invalid limit")
        cid, offset = self._cursor(commit["id"])
        if cid != commit["id"]:
            commit = self.sim.store.load_commit(repo, cid)
            if commit is None:
                raise HubError(400, "invalid cursor")
        entries = self._listing(repo, commit, path, recursive)
        page = entries[offset:offset + ps]
        if expand and page:
            lc = self._last_commits(repo, commit, [e["path"] for e in page])
            for e in page:
                if e["path"] in lc:
                    e["lastCommit"] = lc[e["path"]]
        headers = {}
        if offset + ps < len(entries):
            headers["Link"] = self._link_next(commit["id"], offset + ps)
        faults = self.sim.faults.take_all(Faults.LISTING_KINDS, self._req) if self._req is not None else []
        if not faults:
            return self.respond_json(200, page, headers)
        raw = {}
        for i, fault in enumerate(faults):
            self.sim.stats.fault(self._entry, fault["kind"])
            sentinel = -987654321987654 - i  # stands for raw_size in the dumped text
            value = sentinel if "raw_size" in fault else fault["size"]
            if "raw_size" in fault:
                raw[str(sentinel)] = fault["raw_size"]
            for e in page:
                if e["type"] == "file" and (not fault.get("entry_regex") or re.search(fault["entry_regex"], e["path"])):
                    e["size"] = value
                    if "lfs" in e:
                        e["lfs"]["size"] = value
        text = json.dumps(page)
        for k, v in raw.items():
            text = text.replace(k, v)
        self.respond(200, text.encode(), headers)

    def h_paths_info(self, rtype, rid, rev):
        repo = self._repo(rtype, rid)
        commit = self._commit_at(repo, rev)
        raw = self.read_body()
        ctype = self.headers.get("Content-Type", "")
        paths, expand = [], False
        if "json" in ctype:
            try:
                d = json.loads(raw or b"{}")
            except ValueError:
                raise HubError(400, "invalid JSON body")
            paths = d.get("paths") or []
            expand = bool(d.get("expand"))
        else:
            for k, v in parse_qsl(raw.decode("utf-8", "replace"), keep_blank_values=True):
                if k in ("paths", "paths[]"):
                    paths.append(v)
                elif k == "expand":
                    expand = truthy(v)
        if isinstance(paths, str):
            paths = [paths]
        idx = self.sim.store.tree_index(repo, commit)
        out = []
        for p in paths:
            p = str(p).strip("/")
            if p in commit["files"]:
                out.append(file_entry_json(p, commit["files"][p]))
            elif p in idx.children and p:
                out.append({"type": "directory", "oid": idx.tree_sha[p], "size": 0, "path": p})
        if expand and out:
            lc = self._last_commits(repo, commit, [e["path"] for e in out])
            for e in out:
                if e["path"] in lc:
                    e["lastCommit"] = lc[e["path"]]
        self.respond_json(200, out)

    def h_preupload(self, rtype, rid, rev):
        repo = self._repo(rtype, rid)
        commit = self._commit_at(repo, rev)
        body = self.read_json()
        if not isinstance(body, dict) or not isinstance(body.get("files"), list):
            raise HubError(400, "body must be {\"files\": [...]}")
        if len(body["files"]) > self.sim.cfg["max_preupload_files"]:
            raise HubError(400, f"too many files in one preupload call (max {self.sim.cfg['max_preupload_files']})")
        out = []
        for f in body["files"]:
            if not isinstance(f, dict) or not valid_repo_path(f.get("path")):
                raise HubError(400, f"invalid file entry {f!r}")
            try:
                sample = base64.b64decode(f.get("sample") or "", validate=True)
            except (binascii.Error, ValueError):
                raise HubError(400, f"invalid base64 sample for {f['path']}")
            size = f.get("size")
            if not isinstance(size, int) or size < 0:
                raise HubError(400, f"invalid size for {f['path']}")
            mode = self._upload_mode(commit["files"], f["path"], size, sample)
            item = {"path": f["path"], "uploadMode": mode, "shouldIgnore": False}
            cur = commit["files"].get(f["path"])
            if cur is not None:
                item["oid"] = cur["lfs"]["oid"] if cur.get("lfs") else cur["blob"]
            out.append(item)
        self.respond_json(200, {"files": out, "commitOid": commit["id"]})

    def _parse_commit_payload(self, raw):
        ctype = self.headers.get("Content-Type", "")
        text = raw.decode("utf-8", "replace")
        ops = []
        header = None
        if "ndjson" not in ctype and text.lstrip().startswith("{") and "\n{" not in text.strip():
            try:
                d = json.loads(text)
            except ValueError:
                raise HubError(400, "invalid JSON commit payload")
            if isinstance(d, dict) and "summary" in d:  # legacy JSON format
                header = {k: d.get(k) for k in ("summary", "description", "parentCommit")}
                ops += [("file", x) for x in d.get("files") or []]
                ops += [("lfsFile", x) for x in d.get("lfsFiles") or []]
                ops += [("deletedFile", x) for x in d.get("deletedFiles") or []]
                ops += [("deletedFolder", x) for x in d.get("deletedFolders") or []]
                return header, ops
        for n, line in enumerate(text.split("\n")):
            if not line.strip():
                continue
            try:
                item = json.loads(line)
            except ValueError:
                raise HubError(400, f"line {n + 1} of the commit payload is not JSON")
            if not isinstance(item, dict) or not isinstance(item.get("value"), dict):
                raise HubError(400, f"line {n + 1}: expected {{\"key\":..., \"value\": {{...}}}}")
            key = item.get("key")
            if key == "header":
                if header is not None or ops:
                    raise HubError(400, "the header must be the first line and appear once")
                header = item["value"]
            elif key in ("file", "lfsFile", "deletedFile", "deletedFolder"):
                if header is None:
                    raise HubError(400, "the first line must be the header")
                ops.append((key, item["value"]))
            else:
                raise HubError(400, f"line {n + 1}: unknown key {key!r}")
        if header is None:
            raise HubError(400, "missing commit header")
        return header, ops

    def h_commit(self, rtype, rid, rev):
        if truthy(self.qd.get("create_pr", ["0"])[0]):
            self.read_body()
            raise HubError(501, "hubsim does not emulate pull requests (create_pr)")
        repo = self._repo(rtype, rid)
        raw = self.read_body()
        header, ops = self._parse_commit_payload(raw)
        summary = header.get("summary")
        if not isinstance(summary, str) or not summary.strip():
            raise HubError(400, "the commit summary is required")
        description = header.get("description") or ""
        store = self.sim.store
        cfg = self.sim.cfg
        with store.lock:
            repo = self._repo(rtype, rid)
            branch = rev[len("refs/heads/"):] if rev.startswith("refs/heads/") else rev
            if branch not in repo["refs"]:
                if store.resolve_rev(repo, rev):
                    raise HubError(400, f"Invalid rev id: {rev} is not a branch")
                raise HubError(404, f"Invalid rev id: {rev}", "RevisionNotFound")
            head_id = repo["refs"][branch]
            parent_commit = header.get("parentCommit")
            if parent_commit:
                pc = str(parent_commit).lower()
                if not HEX_RE.match(pc):
                    raise HubError(400, f"invalid parentCommit {parent_commit!r}")
                if not head_id.startswith(pc):
                    raise HubError(412, f"A commit has happened since. Please refresh and try again. "
                                        f"(parentCommit {pc} is not the head {head_id} of {branch})")
            head = store.load_commit(repo, head_id)
            files = dict(head["files"])
            for key, v in ops:
                path = v.get("path")
                if key in ("deletedFolder",) and isinstance(path, str):
                    path = path.rstrip("/")
                if not valid_repo_path(path):
                    raise HubError(400, f"invalid path in commit: {path!r}")
                if key == "file":
                    enc = (v.get("encoding") or "base64").lower()
                    content = v.get("content")
                    if not isinstance(content, str):
                        raise HubError(400, f"missing content for {path}")
                    if enc == "base64":
                        try:
                            data = base64.b64decode(content, validate=True)
                        except (binascii.Error, ValueError):
                            raise HubError(400, f"invalid base64 content for {path}")
                    elif enc in ("utf-8", "utf8"):
                        data = content.encode()
                    else:
                        raise HubError(400, f"unknown encoding {enc}")
                    if cfg["regular_checks"] and data:
                        if len(data) >= cfg["lfs_threshold"]:
                            raise HubError(400, f"Your push was rejected because it contains files larger than "
                                                f"{cfg['lfs_threshold']} bytes ({path}). Please use LFS.")
                        if b"\0" in data[:8000]:
                            raise HubError(400, f"Your push was rejected because it contains binary files ({path}). "
                                                f"Please use LFS.")
                    files[path] = {"blob": store.put_blob(data), "size": len(data), "lfs": None}
                elif key == "lfsFile":
                    oid = str(v.get("oid") or "").lower()
                    if v.get("algo", "sha256") != "sha256" or not SHA256_RE.match(oid):
                        raise HubError(400, f"invalid LFS oid for {path}")
                    size = v.get("size")
                    have = store.lfs_size(oid)
                    if have is None:
                        ok, _ = store.promote_staged(oid, size if isinstance(size, int) else None)
                        have = store.lfs_size(oid) if ok else None
                    if have is None:
                        raise HubError(422, f"Your push was rejected because an LFS pointer pointed to a file that "
                                            f"does not exist: {path} (oid {oid})")
                    if size is not None and size != have:
                        raise HubError(422, f"LFS object {oid} has size {have}, commit says {size} ({path})")
                    ptr = lfs_pointer(oid, have)
                    files[path] = {"blob": git_blob_sha1(ptr), "size": have,
                                   "lfs": {"oid": oid, "size": have, "pointerSize": len(ptr)}}
                elif key == "deletedFile":
                    if path not in files:
                        raise HubError(404, f"A file with this name doesn't exist: {path}", "EntryNotFound")
                    del files[path]
                elif key == "deletedFolder":
                    gone = [p for p in files if p.startswith(path + "/")]
                    if not gone:
                        raise HubError(404, f"A folder with this name doesn't exist: {path}", "EntryNotFound")
                    for p in gone:
                        del files[p]
            dirs = set()
            for p in files:
                parts = p.split("/")
                for i in range(1, len(parts)):
                    dirs.add("/".join(parts[:i]))
            clash = sorted(dirs & set(files))
            if clash:
                raise HubError(400, f"path conflict: {clash[0]} is both a file and a directory")
            c = store.make_commit(repo, [head_id], files, summary, description, self.sim.user)
            store.save_commit(repo, c)
            repo["refs"][branch] = c["id"]
            store.save_repo(repo)
        with self.sim.stats.lock:
            self.sim.stats.commits += 1
        self.respond_json(200, {"success": True, "commitOid": c["id"],
                                "commitUrl": f"{self.repo_url(repo)}/commit/{c['id']}", "hookOutput": ""})

    def h_commits(self, rtype, rid, rev):
        repo = self._repo(rtype, rid)
        commit = self._commit_at(repo, rev)
        ps = int(self.sim.cfg["commits_page_size"])
        cid, offset = self._cursor(commit["id"])
        store = self.sim.store
        c = store.load_commit(repo, cid)
        if c is None:
            raise HubError(400, "invalid cursor")
        chain = []
        while c is not None:
            chain.append(c)
            c = store.load_commit(repo, c["parents"][0]) if c["parents"] else None
        formatted = "formatted" in (self.qd.get("expand[]", []) + self.qd.get("expand", []))
        page = []
        for c in chain[offset:offset + ps]:
            item = {"id": c["id"], "title": c["title"], "message": c["message"], "date": c["date"],
                    "authors": [{"user": c["author"], "avatar": ""}]}
            if formatted:
                item["formatted"] = {"title": c["title"], "message": c["message"]}
            page.append(item)
        headers = {}
        if offset + ps < len(chain):
            headers["Link"] = self._link_next(cid, offset + ps)
        self.respond_json(200, page, headers)

    def h_refs(self, rtype, rid):
        repo = self._repo(rtype, rid)
        branches = [{"name": b, "ref": f"refs/heads/{b}", "targetCommit": s} for b, s in sorted(repo["refs"].items())]
        self.respond_json(200, {"branches": branches, "tags": [], "converts": [], "pullRequests": []})

    def h_branch(self, rtype, rid, branch):
        if self.command not in ("POST", "DELETE"):
            raise HubError(405, "use POST or DELETE")
        store = self.sim.store
        body = self.read_json() if self.command == "POST" else (self.read_body() and None)
        with store.lock:
            repo = self._repo(rtype, rid)
            if self.command == "DELETE":
                if branch not in repo["refs"] or branch == "main":
                    raise HubError(404, f"Invalid rev id: {branch}", "RevisionNotFound")
                del repo["refs"][branch]
            else:
                if not NAME_RE.match(branch.replace("/", "-")):
                    raise HubError(400, f"invalid branch name {branch}")
                if branch in repo["refs"]:
                    raise HubError(409, f"Reference already exists: refs/heads/{branch}")
                start = (body or {}).get("startingPoint") or "main"
                sha = store.resolve_rev(repo, start)
                if sha is None:
                    raise HubError(404, f"Invalid rev id: {start}", "RevisionNotFound")
                repo["refs"][branch] = sha
            store.save_repo(repo)
        self.respond_json(200, {"ok": True})

    # -- resolve + CDN
    def h_resolve(self, rtype, rid, rest):
        repo = self._repo(rtype, rid)
        rev, path = self._split_rev_path(rest)
        commit = self._commit_at(repo, rev)
        rc = {"X-Repo-Commit": commit["id"]}
        e = commit["files"].get(path)
        if e is None:
            raise HubError(404, f"Entry not found: {path}", "EntryNotFound", rc)
        if e.get("lfs"):
            oid = e["lfs"]["oid"]
            loc = f"{self.cdn_base()}/lfs-cdn/{oid}?" + urlencode(
                {"repo": rid, "path": path, "X-Amz-Expires": "3600", "X-Amz-Signature": uuid.uuid4().hex})
            body = f"Found. Redirecting to {loc}".encode()
            hdrs = dict(rc, **{"Location": loc, "X-Linked-Etag": f'"{oid}"', "X-Linked-Size": str(e["size"]),
                               "ETag": f'"{e["blob"]}"', "Accept-Ranges": "bytes"})
            return self.respond(302, body, hdrs, "text/plain; charset=utf-8")
        src = self.sim.store.blob_path(e["blob"])
        hdrs = dict(rc, **{"ETag": f'"{e["blob"]}"', "Accept-Ranges": "bytes",
                           "Content-Disposition": self._disposition(path)})
        self._serve_file(src, e["size"], hdrs)

    @staticmethod
    def _disposition(path):
        name = path.rsplit("/", 1)[-1]
        ascii_name = name.encode("ascii", "replace").decode().replace('"', "_")
        return f"inline; filename*=UTF-8''{quote(name)}; filename=\"{ascii_name}\";"

    def _serve_file(self, src, size, hdrs):
        rng = self.headers.get("Range")
        if rng is not None:
            r = parse_range(rng, size)
            if r is None:
                raise HubError(416, f"Range Not Satisfiable: {rng} (size {size})", "RangeNotSatisfiable",
                               dict(hdrs, **{"Content-Range": f"bytes */{size}"}))
            start, end = r
            hdrs["Content-Range"] = f"bytes {start}-{end}/{size}"
            return self.respond(206, FileBody(src, start, end - start + 1), hdrs, "application/octet-stream")
        self.respond(200, FileBody(src, 0, size), hdrs, "application/octet-stream")

    def h_cdn(self, oid):
        oid = oid.lower()
        size = self.sim.store.lfs_size(oid) if SHA256_RE.match(oid) else None
        if size is None:
            raise HubError(404, "NoSuchKey: The specified key does not exist.", "NoSuchKey")
        name = self.qd.get("path", [oid])[0]
        hdrs = {"ETag": f'"{oid}"', "Accept-Ranges": "bytes", "Content-Disposition": self._disposition(name),
                "Cache-Control": "public, max-age=604800, immutable"}
        self._serve_file(self.sim.store.lfs_path(oid), size, hdrs)

    # -- LFS
    def h_lfs_batch(self, rtype, rid):
        repo = self._repo(rtype, rid)
        body = self.read_json()
        if not isinstance(body, dict) or not isinstance(body.get("objects"), list):
            raise HubError(400, "body must be a git-lfs batch request")
        operation = body.get("operation")
        if operation not in ("upload", "download"):
            raise HubError(400, f"unsupported operation {operation!r}")
        transfers = body.get("transfers") or ["basic"]
        if "basic" not in transfers and "multipart" not in transfers:
            raise HubError(422, f"no supported transfer adapter in {transfers}")
        if body.get("hash_algo", "sha256") != "sha256":
            raise HubError(422, "only sha256 is supported")
        cfg = self.sim.cfg
        store = self.sim.store
        api = self.base_url()
        cdn = self.cdn_base()
        chosen = "basic"
        objects = []
        for o in body["objects"]:
            oid = o.get("oid") if isinstance(o, dict) else None
            size = o.get("size") if isinstance(o, dict) else None
            if not isinstance(oid, str) or not SHA256_RE.match(oid) or not isinstance(size, int) or size < 0:
                objects.append({"oid": str(oid), "size": size if isinstance(size, int) else 0,
                                "error": {"code": 422, "message": "invalid oid or size"}})
                continue
            have = store.lfs_size(oid)
            item = {"oid": oid, "size": size, "authenticated": True}
            if operation == "download":
                if have is None:
                    item["error"] = {"code": 404, "message": "Object does not exist"}
                else:
                    item["actions"] = {"download": {"href": f"{cdn}/lfs-cdn/{oid}", "expires_in": 3600}}
                objects.append(item)
                continue
            if have is not None:
                if have != size:
                    item["error"] = {"code": 422, "message": f"object {oid} exists with size {have}, not {size}"}
                objects.append(item)  # already stored: no actions
                continue
            verify = {"href": f"{api}/{URL_PREFIX[rtype]}{rid}.git/info/lfs/objects/verify"}
            if "multipart" in transfers and size > int(cfg["multipart_threshold"]):
                chosen = "multipart"
                chunk = int(cfg["chunk_size"])
                nparts = max(1, math.ceil(size / chunk))
                upload_id = uuid.uuid4().hex
                udir = os.path.join(store.root, "uploads", upload_id)
                os.makedirs(udir, exist_ok=True)
                store.write_json(os.path.join(udir, "meta.json"),
                                 {"oid": oid, "size": size, "chunk_size": chunk, "parts": nparts, "repo": rid})
                header = {"chunk_size": str(chunk)}
                for i in range(1, nparts + 1):
                    header["%05d" % i] = f"{cdn}/lfs-upload/{oid}/{upload_id}/{i}?X-Amz-Signature=sim"
                complete = f"{api}/api/complete_multipart?" + urlencode({"uploadId": upload_id, "oid": oid, "size": size})
                item["actions"] = {"upload": {"href": complete, "header": header, "expires_in": 86400},
                                   "verify": verify}
            else:
                item["actions"] = {"upload": {"href": f"{cdn}/lfs-upload/{oid}?" + urlencode({"size": size, "X-Amz-Signature": "sim"}),
                                              "expires_in": 86400},
                                   "verify": verify}
            objects.append(item)
        fault = self.sim.faults.take(Faults.BATCH_KINDS, self._req) if self._req is not None else None
        if fault is not None:
            self.sim.stats.fault(self._entry, fault["kind"])
            for item in objects:
                action = (item.get("actions") or {}).get(fault.get("action", "verify"))
                if action is not None:
                    action["href"] = fault["href"]
        self.respond_json(200, {"transfer": chosen, "objects": objects, "hash_algo": "sha256"},
                          content_type="application/vnd.git-lfs+json")

    def h_lfs_put(self, oid):
        oid = oid.lower()
        if not SHA256_RE.match(oid):
            raise HubError(400, "invalid oid")
        md5 = []
        self.sim.store.ingest_stream(self.iter_body(), oid, md5)
        self.respond(200, b"", {"ETag": f'"{md5[0]}"'}, None)

    def h_lfs_part(self, oid, upload_id, part):
        udir = os.path.join(self.sim.store.root, "uploads", upload_id)
        meta = self.sim.store.read_json(os.path.join(udir, "meta.json")) if re.fullmatch(r"[0-9a-f]{32}", upload_id) else None
        if meta is None or meta["oid"] != oid.lower():
            raise HubError(404, "NoSuchUpload: the multipart upload does not exist", "NoSuchUpload")
        try:
            n = int(part)
        except ValueError:
            n = 0
        if not 1 <= n <= meta["parts"]:
            raise HubError(400, f"invalid part number {part}")
        tmp = self.sim.store._tmp()
        md5 = hashlib.md5()
        with open(tmp, "wb") as f:
            for b in self.iter_body():
                md5.update(b)
                f.write(b)
        os.replace(tmp, os.path.join(udir, "%05d" % n))
        self.respond(200, b"", {"ETag": f'"{md5.hexdigest()}"'}, None)

    def h_lfs_complete(self):
        upload_id = self.qd.get("uploadId", [""])[0]
        body = self.read_json()
        store = self.sim.store
        udir = os.path.join(store.root, "uploads", upload_id)
        meta = store.read_json(os.path.join(udir, "meta.json")) if re.fullmatch(r"[0-9a-f]{32}", upload_id) else None
        if meta is None:
            raise HubError(404, "NoSuchUpload: the multipart upload does not exist", "NoSuchUpload")
        if not isinstance(body, dict) or body.get("oid") != meta["oid"] or not isinstance(body.get("parts"), list):
            raise HubError(400, "completion body must be {\"oid\": <oid of the upload>, \"parts\": [...]}")
        parts = body["parts"]
        if len(parts) != meta["parts"]:
            raise HubError(400, f"expected {meta['parts']} parts, got {len(parts)}")
        paths = []
        for i, p in enumerate(parts, 1):
            if not isinstance(p, dict) or p.get("partNumber") != i:
                raise HubError(400, f"part {i}: partNumber must be {i}")
            pp = os.path.join(udir, "%05d" % i)
            if not os.path.exists(pp):
                raise HubError(400, f"part {i} was not uploaded")
            md5 = hashlib.md5()
            with open(pp, "rb") as f:
                for chunk in iter(lambda: f.read(MiB), b""):
                    md5.update(chunk)
            if str(p.get("etag", "")).strip().strip('"').lower() != md5.hexdigest():
                raise HubError(400, f"part {i}: etag mismatch")
            want = meta["chunk_size"] if i < meta["parts"] else meta["size"] - meta["chunk_size"] * (meta["parts"] - 1)
            if os.path.getsize(pp) != want:
                raise HubError(400, f"part {i}: {os.path.getsize(pp)} bytes, expected {want}")
            paths.append(pp)

        def chunks():
            for pp in paths:
                with open(pp, "rb") as f:
                    yield from iter(lambda: f.read(MiB), b"")
        digest, n = store.ingest_stream(chunks(), meta["oid"])
        if digest != meta["oid"] or n != meta["size"]:
            raise HubError(400, f"assembled object has sha256 {digest} and size {n}, expected {meta['oid']} / {meta['size']}")
        shutil.rmtree(udir, ignore_errors=True)
        self.respond_json(200, {"oid": digest, "size": n})

    def h_lfs_verify(self, rtype, rid):
        self._repo(rtype, rid)
        body = self.read_json()
        if not isinstance(body, dict) or not isinstance(body.get("oid"), str) or not isinstance(body.get("size"), int):
            raise HubError(400, "verify body must be {\"oid\": ..., \"size\": ...}")
        oid, size = body["oid"].lower(), body["size"]
        store = self.sim.store
        with store.lock:
            have = store.lfs_size(oid) if SHA256_RE.match(oid) else None
            if have is None and SHA256_RE.match(oid):
                ok, msg = store.promote_staged(oid, size)
                if not ok:
                    raise HubError(422 if msg != "object not uploaded" else 404, f"LFS verify failed for {oid}: {msg}")
                have = store.lfs_size(oid)
        if have is None:
            raise HubError(404, f"LFS object {oid} not found")
        if have != size:
            raise HubError(422, f"LFS verify failed for {oid}: size {have}, expected {size}")
        self.respond_json(200, {"oid": oid, "size": size}, content_type="application/vnd.git-lfs+json")


class SimServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 128

    def __init__(self, addr, sim, family=socket.AF_INET):
        self.address_family = family
        self.sim = sim
        super().__init__(addr, Handler)

    def handle_error(self, request, client_address):
        if self.sim.verbose:
            super().handle_error(request, client_address)


def size_arg(s):
    m = re.fullmatch(r"\s*(\d+)\s*([kKmMgG]i?[bB]?)?\s*", s)
    if not m:
        raise argparse.ArgumentTypeError(f"bad size {s!r}")
    n = int(m.group(1))
    unit = (m.group(2) or "").lower()[:1]
    return n * {"": 1, "k": 1024, "m": MiB, "g": 1024 * MiB}[unit]


def main(argv=None):
    ap = argparse.ArgumentParser(description="Hugging Face Hub emulator for tests (see module docstring)")
    ap.add_argument("--root", required=True)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--port-file")
    ap.add_argument("--token", action="append")
    ap.add_argument("--user", default="user")
    ap.add_argument("--api-host", default="localhost")
    ap.add_argument("--cdn-host", default="127.0.0.1")
    ap.add_argument("--page-size", type=int, default=1000)
    ap.add_argument("--commits-page-size", type=int, default=50)
    ap.add_argument("--lfs-threshold", type=size_arg, default=10 * MiB)
    ap.add_argument("--multipart-threshold", type=size_arg, default=8 * MiB)
    ap.add_argument("--chunk-size", type=size_arg, default=5 * MiB)
    ap.add_argument("--no-regular-checks", action="store_true")
    ap.add_argument("--api-limit", type=int, default=0)
    ap.add_argument("--resolver-limit", type=int, default=0)
    ap.add_argument("--rate-window", type=float, default=300)
    ap.add_argument("--fault", action="append")
    ap.add_argument("--fail-next-commit", action="store_true")
    ap.add_argument("--no-ipv6", action="store_true")
    ap.add_argument("--verbose", action="store_true")
    args = ap.parse_args(argv)
    if args.page_size < 1 or args.commits_page_size < 1 or args.chunk_size < 1:
        ap.error("page sizes and chunk size must be >= 1")
    try:
        sim = Sim(args)
    except (ValueError, re.error) as e:
        ap.error(f"bad --fault: {e}")
    family = socket.AF_INET6 if ":" in args.host else socket.AF_INET
    srv = SimServer((args.host, args.port), sim, family)
    sim.port = srv.server_address[1]
    sim.servers.append(srv)
    if args.host == "127.0.0.1" and not args.no_ipv6 and socket.has_ipv6:
        try:
            srv6 = SimServer(("::1", sim.port), sim, socket.AF_INET6)
            sim.servers.append(srv6)
            threading.Thread(target=srv6.serve_forever, daemon=True).start()
        except OSError:
            pass
    if args.port_file:
        with open(args.port_file + ".tmp", "w") as f:
            f.write(f"{sim.port}\n")
        os.replace(args.port_file + ".tmp", args.port_file)
    print(sim.port, flush=True)
    sys.stderr.write(f"hubsim: endpoint http://{sim.api_host}:{sim.port}  cdn http://{sim.cdn_host}:{sim.port}  "
                     f"root {sim.store.root}  tokens {'on' if sim.cfg['tokens'] else 'off'}\n")
    sys.stderr.flush()

    def stop(*_):
        raise SystemExit(0)
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    try:
        srv.serve_forever(poll_interval=0.2)
    except SystemExit:
        pass
    finally:
        for s in sim.servers:
            try:
                s.server_close()
            except OSError:
                pass


if __name__ == "__main__":
    main()
