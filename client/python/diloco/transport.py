"""Where globals come from and deltas go: dilocod over HTTP(S), or a shared directory (file://).

A transport hands the worker only validated files: every size, name and step a server or a tree
states is checked before it is believed (errors.HostileAnswer otherwise)."""
import errno
import json
import os
import random
import re
import time

import requests

from . import _st
from .errors import HostileAnswer, ServerError

MAX_JSON_ANSWER = 1 << 20          # an answer, /status or step_count.json: far above any real one
MAX_INDEX_BYTES = 10 << 20         # huggingface_hub's MAX_INDEX_FILE_SIZE, dilocod's cap too
MAX_RESUMES = 5                    # a download cut this many times in a row is given up
MAX_RECORD_BYTES = 4 << 20         # a step's signed record (dilocod's MANIFEST_MAX)
SIGNATURE_BYTES = 64               # Ed25519
SINGLE_FILE = "global/latest.safetensors"
INDEX_NAME = "latest.safetensors.index.json"
INDEX_SUFFIX = ".safetensors.index.json"
# A cluster's step (server/README.md, "Cluster mode"): global/steps/<s>/model.safetensors.index.json, or
# model.g<n>.safetensors.index.json for the n-th generation of a step whose delta set a refusal changed.
CLUSTER_INDEX = re.compile(r"global/steps/(0|[1-9][0-9]{0,15})/(model(?:\.g[1-9][0-9]{0,9})?)\.safetensors\.index\.json")
CANONICAL_INT = re.compile(r"^(0|[1-9][0-9]{0,15})$")


def parse_step(value, what):
    if not isinstance(value, str) or not CANONICAL_INT.match(value):
        raise HostileAnswer(f"{what} is not a canonical integer: {value!r:.40}")
    return int(value)


def parse_step_count(raw: bytes, what):
    """step_count.json -> (outer_step, model_file): model_file is global/latest.safetensors, its index, or
    a cluster step's own index global/steps/<outer_step>/model[.g<n>].safetensors.index.json, nothing else
    (a name from the store is a path the worker reads)."""
    try:
        doc = json.loads(raw)
    except ValueError:
        raise HostileAnswer(f"{what} is not JSON") from None
    if not isinstance(doc, dict) or type(doc.get("outer_step")) is not int or doc["outer_step"] < 0:
        raise HostileAnswer(f"{what} has no non-negative integer outer_step")
    step, mf = doc["outer_step"], doc.get("model_file", SINGLE_FILE)
    if mf in (SINGLE_FILE, "global/" + INDEX_NAME):
        return step, mf
    m = CLUSTER_INDEX.fullmatch(mf) if isinstance(mf, str) else None
    if m is None:
        raise HostileAnswer(f"{what} names model_file {mf!r:.80}, neither global/latest.safetensors, its index "
                            f"nor a cluster step's global/steps/<step>/model.safetensors.index.json")
    if int(m.group(1)) != step:
        # a reader trusts the step it is told: the files must be that step's
        raise HostileAnswer(f"{what} names model_file {mf!r:.80}, step {m.group(1)}'s, for outer_step {step}")
    return step, mf


HEX64 = re.compile(r"^[0-9a-f]{64}$")
VIEW_CHECKPOINT = re.compile(r"global/views/(0|[1-9][0-9]{0,15})\.safetensors")


def parse_downlink_info(raw: bytes, what):
    """step_count.json's downlink names (server/README.md, "The downlink") -> (outer_step, view_hash or None,
    view_file or None).  view_file is global/view.safetensors (HTTP) or a tree's view checkpoint
    global/views/<c>.safetensors with c <= outer_step, nothing else."""
    step, _ = parse_step_count(raw, what)
    doc = json.loads(raw)
    h, vf = doc.get("view_hash"), doc.get("view_file")
    if h is not None and (not isinstance(h, str) or not HEX64.match(h)):
        raise HostileAnswer(f"{what}: view_hash {h!r:.80} is not 64 hex digits")
    if vf is not None:
        m = VIEW_CHECKPOINT.fullmatch(vf) if isinstance(vf, str) else None
        if vf != "global/view.safetensors" and (m is None or int(m.group(1)) > step):
            raise HostileAnswer(f"{what}: view_file {vf!r:.80} is neither global/view.safetensors nor a view "
                                f"checkpoint global/views/<c>.safetensors of a step up to {step}")
    return step, h, vf


def index_place(model_file):
    """A model_file parse_step_count accepted -> None (the single file) or (its index's directory, the
    index's base): ("global", "latest"), ("global/steps/7", "model"), ("global/steps/7", "model.g1")."""
    if model_file == SINGLE_FILE:
        return None
    d, _, name = model_file.rpartition("/")
    return d, name[:-len(INDEX_SUFFIX)]


def parse_index(raw: bytes, what, base="latest"):
    """A global's index (<base>.safetensors.index.json) -> {tensor: shard file name}; every shard name is
    <base>-i-of-N.safetensors, one N for all, nothing that could leave the index's directory."""
    try:
        doc = json.loads(raw)
    except ValueError:
        raise HostileAnswer(f"{what} is not JSON") from None
    wm = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(wm, dict) or not wm:
        raise HostileAnswer(f"{what} has no weight_map")
    counts, shard_name = set(), _st.shard_re(base)
    for name, shard in wm.items():
        m = shard_name.fullmatch(shard) if isinstance(shard, str) else None
        if m is None:
            raise HostileAnswer(f"{what}: tensor {name!r:.80} is in shard {shard!r:.80}, not a name "
                                f"{base}-0000i-of-0000N.safetensors")
        i, n = int(m.group(1)), int(m.group(2))
        if not 1 <= i <= n:
            raise HostileAnswer(f"{what}: shard {shard!r} is numbered outside 1..{n}")
        counts.add(n)
    if len(counts) != 1:
        raise HostileAnswer(f"{what}: shards of several counts {sorted(counts)}")
    return wm


def load_set(files, wm, what, max_header=_st.MAX_HEADER_BYTES):
    """files: {file name: validated bytes}; -> {name: tensor}: each tensor in the shard the index names."""
    out = {}
    for fname, buf in files.items():
        _, tensors = _st.parse(buf, max_header=max_header, what=f"{what} {fname}")
        for name, (dt, shape, b, e) in tensors.items():
            if wm is not None and wm.get(name) != fname:
                raise HostileAnswer(f"{what}: tensor {name!r:.80} is in {fname}, the index says {wm.get(name)!r:.80}")
            if name in out:
                raise HostileAnswer(f"{what}: tensor {name!r:.80} is in two shards")
            out[name] = _st.tensor_from(buf, dt, shape, b, e, name, f"{what} {fname}")
    if wm is not None and set(wm) != set(out):
        raise HostileAnswer(f"{what}: the index lists {len(wm)} tensors, the shards hold {len(out)}")
    return out


def backoff(attempt, cap):
    """Capped exponential backoff with jitter, so that workers cut off together do not return together."""
    return min(cap, 0.25 * 2 ** attempt) * (0.5 + random.random() / 2)


class _Body:
    """An upload body of known length, streamed: requests sends Content-Length, not chunked."""

    def __init__(self, delta):
        self.delta = delta

    def __len__(self):
        return len(self.delta)

    def __iter__(self):
        return self.delta.chunks()


# ---- GET /nodes/<id>: a node's verdicts --------------------------------------------------------------
VERDICT_KINDS = ("accepted", "queued", "aggregated", "quarantined", "replaced", "refused")
VERDICT_REASON = re.compile(r"^[a-z0-9_]{1,31}$")
MAX_VERDICTS = 32                   # dilocod keeps a node's last 32
MAX_VERDICT_REASONS = 24
MAX_VERDICT_ANSWER = 64 << 10       # 32 records of at most ~400 bytes, the counts: far below


def _count(v, what):
    if type(v) is not int or not 0 <= v <= 2 ** 53 - 1:
        raise HostileAnswer(f"{what} is not an integer in [0, 2^53 - 1]: {v!r:.40}")
    return v


def parse_node_verdicts(raw: bytes, node_id):
    """GET /nodes/<node_id>'s answer, checked as hostile: {"node_id", "total", "counts": {reason: n},
    "deltas": [{"verdict", "reason", "status", "local_step", "base_outer_step", "step", "time",
    "message"}, ...] newest first} with every type, size and bound the server keeps; the counts add up
    to total.  -> the document (a dict of plain values)."""
    try:
        doc = json.loads(raw)
    except ValueError:
        raise HostileAnswer("GET /nodes/: the answer is not JSON") from None
    if not isinstance(doc, dict) or doc.get("node_id") != node_id:
        raise HostileAnswer(f"GET /nodes/{node_id}: not this node's document")
    counts, deltas = doc.get("counts"), doc.get("deltas")
    total = _count(doc.get("total"), "total")
    if not isinstance(counts, dict) or len(counts) > MAX_VERDICT_REASONS:
        raise HostileAnswer("GET /nodes/: counts is not an object of at most 24 reasons")
    for k, v in counts.items():
        if not VERDICT_REASON.match(k):
            raise HostileAnswer(f"GET /nodes/: reason {k!r:.40} is not [a-z0-9_]{{1,31}}")
        _count(v, f"count of {k}")
    if sum(counts.values()) != total:
        raise HostileAnswer("GET /nodes/: the counts do not add up to total")
    if not isinstance(deltas, list) or len(deltas) > MAX_VERDICTS:
        raise HostileAnswer("GET /nodes/: deltas is not a list of at most 32 records")
    out = []
    for r in deltas:
        if not isinstance(r, dict) or r.get("verdict") not in VERDICT_KINDS:
            raise HostileAnswer(f"GET /nodes/: a record's verdict is not one of {VERDICT_KINDS}")
        reason, status, message = r.get("reason"), r.get("status"), r.get("message")
        if not isinstance(reason, str) or not VERDICT_REASON.match(reason):
            raise HostileAnswer(f"GET /nodes/: a record's reason {reason!r:.40} is not [a-z0-9_]{{1,31}}")
        if status is not None and (type(status) is not int or not 100 <= status <= 599):
            raise HostileAnswer(f"GET /nodes/: a record's status {status!r:.40} is not an HTTP status")
        if not isinstance(message, str) or len(message) > 240:
            raise HostileAnswer("GET /nodes/: a record's message is not a string of at most 240 characters")
        ls, bs = r.get("local_step"), r.get("base_outer_step")
        if (ls is None) != (bs is None):
            raise HostileAnswer("GET /nodes/: a record has one of local_step and base_outer_step")
        t = r.get("time")
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 <= t < 1e11:
            raise HostileAnswer(f"GET /nodes/: a record's time {t!r:.40} is not a Unix time")
        out.append({"verdict": r["verdict"], "reason": reason, "status": status,
                    "local_step": None if ls is None else _count(ls, "local_step"),
                    "base_outer_step": None if bs is None else _count(bs, "base_outer_step"),
                    "step": _count(r.get("step"), "step"), "time": float(t), "message": message})
    return {"node_id": node_id, "total": total, "counts": dict(counts), "deltas": out}


class HttpTransport:
    def __init__(self, url, token=None, timeout=600, retries=8, max_backoff=30.0):
        self.url = url.rstrip("/")
        self.s = requests.Session()
        self.auth = {"Authorization": f"Bearer {token}"} if token else {}
        self.timeout, self.retries, self.max_backoff = timeout, retries, max_backoff

    # ---- downloads --------------------------------------------------------------------------
    def _json(self, path, cap=MAX_JSON_ANSWER):
        r = self.s.get(self.url + path, timeout=self.timeout, stream=True)
        try:
            body = self._read_capped(r, cap, path)
        finally:
            r.close()
        if r.status_code != 200:
            raise ServerError(r.status_code, *self._error_of(body))
        return body

    @staticmethod
    def _read_capped(r, cap, what):
        n = r.headers.get("Content-Length")
        if n is not None and (not n.isdigit() or int(n) > cap):
            raise HostileAnswer(f"{what}: Content-Length {n!r:.40} over the cap of {cap} bytes")
        out = bytearray()
        for chunk in r.iter_content(65536):
            out += chunk
            if len(out) > cap:
                raise HostileAnswer(f"{what}: answer over the cap of {cap} bytes")
        return bytes(out)

    @staticmethod
    def _error_of(body):
        try:
            err = json.loads(body)["error"]
            return str(err.get("code", "?"))[:64], str(err.get("message", ""))[:1024]
        except (ValueError, KeyError, TypeError, AttributeError):
            return "?", body[:200].decode("utf-8", "replace")

    def _download(self, path, cap, etag=None):
        """GET path whole, resuming a cut transfer with Range/If-Range -> (304: None) or
        (bytearray, ETag, X-Outer-Step).  The body must be exactly Content-Length bytes.  The buffer is
        allocated once at that length (a growing one would hold two copies while it moves)."""
        buf, got, total, file_etag, step, cuts = None, 0, None, None, None, 0
        while True:
            h = {}
            if got:
                h["Range"] = f"bytes={got}-"
                h["If-Range"] = file_etag
            elif etag:
                h["If-None-Match"] = etag
            try:
                r = self.s.get(self.url + path, headers=h, timeout=self.timeout, stream=True)
            except requests.RequestException as e:
                cuts += 1
                if cuts > MAX_RESUMES:
                    raise HostileAnswer(f"{path}: download failed {cuts} times: {e}") from None
                time.sleep(backoff(cuts, self.max_backoff))
                continue
            with r:
                if r.status_code == 304 and not got:
                    return None
                if r.status_code == 404:
                    raise FileNotFoundError(path)
                if r.status_code == 200 and got:
                    buf, got, total = None, 0, None         # the file changed meanwhile: from the start
                elif r.status_code == 206 and got:
                    cr = r.headers.get("Content-Range", "")
                    if cr != f"bytes {got}-{total - 1}/{total}":
                        raise HostileAnswer(f"{path}: Content-Range {cr!r:.80} does not continue byte {got} "
                                            f"of {total}")
                elif r.status_code != 200:
                    raise ServerError(r.status_code, *self._error_of(r.content[:MAX_JSON_ANSWER]))
                s = parse_step(r.headers.get("X-Outer-Step"), f"{path}: X-Outer-Step")
                if step is not None and s != step:
                    buf, got, total = None, 0, None
                step = s
                n = r.headers.get("Content-Length")
                if n is None or not n.isdigit():
                    raise HostileAnswer(f"{path}: no valid Content-Length ({n!r:.40})")
                if total is None:
                    total = int(n)
                    if total > cap:
                        raise HostileAnswer(f"{path}: {total} bytes, over the {cap} this model can take")
                    file_etag = r.headers.get("ETag")
                    buf = bytearray(total)
                elif got + int(n) != total:
                    raise HostileAnswer(f"{path}: a resumed part of {n} bytes does not end at {total}")
                view = memoryview(buf)
                try:
                    for chunk in r.iter_content(1 << 20):
                        if got + len(chunk) > total:
                            raise HostileAnswer(f"{path}: more bytes than its Content-Length of {total}")
                        view[got:got + len(chunk)] = chunk
                        got += len(chunk)
                except requests.RequestException:
                    pass                                        # cut: resumed below
                finally:
                    view.release()
            if got == total:
                return buf, file_etag, step         # the bytearray itself: tensors are views of it
            cuts += 1
            if cuts > MAX_RESUMES or not file_etag:
                raise HostileAnswer(f"{path}: the body ended after {got} of its {total} bytes "
                                    f"(Content-Length), {cuts} times")

    def fetch_global(self, etag, cap, max_header=_st.MAX_HEADER_BYTES, check=None):
        """-> None (unchanged since etag) or (step, etag, {name: tensor}).  check(step, files, weight_map),
        when given, sees the files' bytes before they are parsed (and may raise to refuse them)."""
        try:
            got = self._download("/global/latest.safetensors", cap, etag)
            if got is None:
                return None
            buf, tag, step = got
            if check is not None:
                check(step, {"latest.safetensors": buf}, None)
            return step, tag, load_set({"latest.safetensors": buf}, None, "global", max_header)
        except FileNotFoundError:
            pass
        # a sharded global: the index (its ETag stands for the set), then each shard it names
        got = self._download("/global/" + INDEX_NAME, MAX_INDEX_BYTES, etag)
        if got is None:
            return None
        raw, tag, step = got
        wm = parse_index(raw, "global index")
        files = {}
        for shard in sorted(set(wm.values())):
            buf, _, s = self._download("/global/" + shard, cap)
            if s != step:
                raise HostileAnswer(f"global shard {shard} is of step {s}, its index of {step}")
            files[shard] = buf
        if check is not None:
            check(step, files, wm)
        return step, tag, load_set(files, wm, "global", max_header)

    def fetch_record(self, step):
        """A step's signed record and its signature -> (json bytes, signature bytes), or None when the
        server has none (404)."""
        try:
            rec = self._json(f"/global/rounds/{step}.json", MAX_RECORD_BYTES)
            sig = self._json(f"/global/rounds/{step}.json.sig", SIGNATURE_BYTES)
        except ServerError as e:
            if e.status == 404:
                return None
            raise
        return rec, sig
    # ---- the downlink (Worker(downlink=True)) --------------------------------------------------
    def downlink_info(self):
        """-> (outer_step, view_hash or None, view_file or None), from GET /global/step_count.json."""
        return parse_downlink_info(self._json("/global/step_count.json"), "global/step_count.json")

    def fetch_view(self, cap):
        """-> (step, bytearray) of GET /global/view.safetensors."""
        try:
            buf, _, step = self._download("/global/view.safetensors", cap)
        except FileNotFoundError:
            raise ServerError(404, "no_downlink", "the server runs --downlink none: no view to pull "
                              "(Worker(downlink=False) downloads the global)") from None
        return step, buf

    def fetch_update(self, step, cap):
        """-> the bytes of step's update, or None when the server does not keep it (404)."""
        path = f"/global/updates/{int(step)}.safetensors"
        try:
            buf, _, s = self._download(path, cap)
        except FileNotFoundError:
            return None
        if s != step:
            raise HostileAnswer(f"{path}: X-Outer-Step {s}")
        return buf

    def outer_step(self):
        try:
            doc = json.loads(self._json("/status"))
        except (requests.RequestException, ServerError, ValueError):
            return None                     # restarting, or no global yet: keep waiting
        s = doc.get("outer_step") if isinstance(doc, dict) else None
        return s if type(s) is int else None

    def node_verdicts(self, node):
        """GET /nodes/<node>, checked (parse_node_verdicts); None while the server knows no verdict of
        the node (404 unknown_node)."""
        try:
            raw = self._json(f"/nodes/{node}", MAX_VERDICT_ANSWER)
        except ServerError as e:
            if e.status == 404 and e.code == "unknown_node":
                return None
            raise
        return parse_node_verdicts(raw, node)

    # ---- uploads ----------------------------------------------------------------------------
    def put_delta(self, node, local_step, delta):
        """-> (outcome, HTTP status, answer, X-Recommended-Local-Steps or None); outcome is the
        answer's result, 'stale', or 'accepted' for a retry answered not_newer (the first landed)."""
        path = f"{self.url}/nodes/{node}/delta_{local_step}.safetensors"
        retried = False
        for attempt in range(self.retries + 1):
            try:
                r = self.s.put(path, data=_Body(delta), headers=self.auth, timeout=self.timeout, stream=True)
                with r:
                    body = self._read_capped(r, MAX_JSON_ANSWER, "upload answer")
            except requests.RequestException:
                retried = True
                time.sleep(backoff(attempt, self.max_backoff))
                continue
            code, message = self._error_of(body) if r.status_code >= 400 else (None, None)
            if r.status_code == 503:
                retried = True
                ra = r.headers.get("Retry-After", "")
                time.sleep(min(float(ra), self.max_backoff) if ra.isdigit() else backoff(attempt, self.max_backoff))
                continue
            rec = r.headers.get("X-Recommended-Local-Steps")
            rec = int(rec) if rec is not None and CANONICAL_INT.match(rec) and int(rec) > 0 else None
            if r.status_code in (201, 202):
                try:
                    answer = json.loads(body)
                except ValueError:
                    raise HostileAnswer(f"upload answer {r.status_code} is not JSON") from None
                result = answer.get("result") if isinstance(answer, dict) else None
                if result not in ("accepted", "replaced", "queued", "incomplete"):
                    raise HostileAnswer(f"upload answer {r.status_code} has result {result!r:.40}")
                return ("accepted" if result == "queued" else result), r.status_code, answer, rec
            if r.status_code == 409 and code == "stale":
                return "stale", 409, json.loads(body), rec
            if r.status_code == 409 and code == "not_newer" and retried:
                return "accepted", 409, json.loads(body), rec
            if r.status_code == 422:
                from .errors import DeltaRefused
                raise DeltaRefused(422, code, message, body)
            raise ServerError(r.status_code, code, message, body)
        raise ServerError(None, "unreachable", f"upload of {path} failed after {self.retries + 1} attempts")


def _read_nofollow(path, cap, dir_fd=None):
    """A file of a tree others write: no symlink followed, a regular file, at most cap bytes."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    try:
        st = os.fstat(fd)
        if not (st.st_mode & 0o170000 == 0o100000):
            raise HostileAnswer(f"{path} is not a regular file")
        if st.st_size > cap:
            raise HostileAnswer(f"{path}: {st.st_size} bytes, over the cap of {cap}")
        out = bytearray()
        while True:
            chunk = os.read(fd, min(1 << 24, cap + 1 - len(out)))
            if not chunk:
                break
            out += chunk
            if len(out) > cap:
                raise HostileAnswer(f"{path}: over the cap of {cap} bytes")
        return out, (st.st_ino, st.st_mtime_ns, st.st_size)
    finally:
        os.close(fd)


class FileTransport:
    """A shared directory dilocod publishes into (--hub file://DIR): reads global/, writes nodes/.  A copy of
    a cluster bucket's tree reads the same (global/steps/<s>/, as its step_count.json names it)."""

    def __init__(self, root):
        self.root = root

    def _p(self, *parts):
        return os.path.join(self.root, *parts)

    def _read(self, rel, cap):
        """rel (a name parse_step_count or parse_index let through: no '..', no empty part) under the root,
        each directory on the way opened from its parent's descriptor, no symlink followed."""
        *dirs, name = rel.split("/")
        dfd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            for d in dirs:
                sub = os.open(d, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dfd)
                os.close(dfd)
                dfd = sub
            return _read_nofollow(name, cap, dir_fd=dfd)
        finally:
            os.close(dfd)

    def _step_count(self):
        raw, _ = self._read("global/step_count.json", MAX_JSON_ANSWER)
        return parse_step_count(raw, "global/step_count.json")

    def fetch_global(self, etag, cap, max_header=_st.MAX_HEADER_BYTES, check=None):
        # step_count.json is written last: the same before and after reading the model means the model
        # read is that step's (or a newer one being published this instant: the next pull corrects it)
        for _ in range(10):
            step, mf = self._step_count()
            place = index_place(mf)
            try:
                if place is None:
                    buf, ident = self._read(mf, cap)
                    files, wm = {"latest.safetensors": buf}, None
                else:
                    raw, ident = self._read(mf, MAX_INDEX_BYTES)
                    wm = parse_index(raw, mf, place[1])
                    files = {sh: self._read(f"{place[0]}/{sh}", cap)[0] for sh in sorted(set(wm.values()))}
            except FileNotFoundError:
                if self._step_count()[0] != step:
                    continue        # a cluster removed the step's files once two newer were published
                raise
            tag = f"{step}:{mf}:{ident}"
            if self._step_count()[0] == step:
                if tag == etag:
                    return None
                if check is not None:
                    check(step, files, wm)
                return step, tag, load_set(files, wm, "global", max_header)
        raise HostileAnswer("global/step_count.json changed under every read")

    def fetch_record(self, step):
        """global/rounds/<step>.json and its .sig -> (json bytes, signature bytes), or None if absent."""
        try:
            rec, _ = self._read(f"global/rounds/{step}.json", MAX_RECORD_BYTES)
            sig, _ = self._read(f"global/rounds/{step}.json.sig", SIGNATURE_BYTES)
        except FileNotFoundError:
            return None
        return bytes(rec), bytes(sig)

    def outer_step(self):
        try:
            return self._step_count()[0]
        except (OSError, HostileAnswer):
            return None

    # ---- the downlink: global/views/<c>.safetensors checkpoints and global/updates/<s>.safetensors ----
    def downlink_info(self):
        raw, _ = self._read("global/step_count.json", MAX_JSON_ANSWER)
        return parse_downlink_info(raw, "global/step_count.json")

    def fetch_view(self, cap):
        """-> (c, bytearray) of the newest view checkpoint step_count.json names (the worker replays the
        updates after c)."""
        _, _, vf = self.downlink_info()
        m = VIEW_CHECKPOINT.fullmatch(vf or "")
        if m is None:
            raise HostileAnswer(f"global/step_count.json names no view checkpoint (view_file {vf!r:.80})")
        buf, _ = self._read(vf, cap)
        return int(m.group(1)), buf

    def fetch_update(self, step, cap):
        try:
            return self._read(f"global/updates/{int(step)}.safetensors", cap)[0]
        except FileNotFoundError:
            return None

    def put_delta(self, node, local_step, delta):
        """Written under a dot name, fsynced, renamed into place: dilocod never lists a half file."""
        d = self._p("nodes", node)
        os.makedirs(d, exist_ok=True)
        final = os.path.join(d, f"delta_{local_step}.safetensors")
        if os.path.lexists(final):
            raise ServerError(None, "not_newer", f"{final} exists: local_step must increase")
        self._write_once(d, f"delta_{local_step}.safetensors", delta.write_to)
        return "written", None, None, None

    def put_delta_set(self, node, local_step, parts, index):
        """A sharded delta (encode.split_delta): each shard written as a single delta is, then the index last
        (dilocod takes a set once its index is there beside every shard it names)."""
        d = self._p("nodes", node)
        os.makedirs(d, exist_ok=True)
        for name in (f"delta_{local_step}.safetensors", f"delta_{local_step}.safetensors.index.json"):
            if os.path.lexists(os.path.join(d, name)):
                raise ServerError(None, "not_newer", f"{os.path.join(d, name)} exists: local_step must increase")
        for name, part in parts:
            self._write_once(d, name, part.write_to)
        self._write_once(d, f"delta_{local_step}.safetensors.index.json", lambda f: f.write(index))
        return "written", None, None, None

    @staticmethod
    def _write_once(d, name, write):
        final = os.path.join(d, name)
        tmp = os.path.join(d, f".{name}.tmp-{os.getpid()}")
        try:
            with open(tmp, "xb") as f:
                write(f)
                f.flush()
                os.fsync(f.fileno())
            os.rename(tmp, final)
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError as e:
                if e.errno != errno.ENOENT:
                    raise
            raise
        dfd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)


def _read_stream(body, n, cap, what):
    """Reads a storage answer's body of announced length n (<= cap), in full or not at all."""
    if n > cap:
        raise HostileAnswer(f"{what}: {n} bytes, over the {cap} this model can take")
    out = bytearray()
    while True:
        chunk = body.read(min(1 << 24, cap + 1 - len(out)))
        if not chunk:
            break
        out += chunk
        if len(out) > n:
            raise HostileAnswer(f"{what}: more bytes than its Content-Length of {n}")
    if len(out) != n:
        raise HostileAnswer(f"{what}: the body ended after {len(out)} of its {n} bytes (Content-Length)")
    return out


class S3Transport:
    """An S3-compatible bucket dilocod publishes into (--hub s3://bucket/prefix).  Credentials, region and
    endpoint come from boto3's usual environment (AWS_ACCESS_KEY_ID, AWS_ENDPOINT_URL, ~/.aws, ...);
    path-style addressing with a custom endpoint, as MinIO and SeaweedFS need.  A cluster's bucket (dilocod
    --cluster-shards) is read and written the same way: its step_count.json names the step's own index,
    global/steps/<s>/model.safetensors.index.json, and the uploads go to nodes/ as for one dilocod."""

    def __init__(self, bucket, prefix):
        try:
            import boto3
            from botocore.config import Config
        except ImportError:
            raise ImportError("s3:// needs boto3: pip install './client/python[s3]'") from None
        self.bucket, self.prefix = bucket, prefix.strip("/")
        cfg = Config(s3={"addressing_style": "path"}, retries={"max_attempts": 8, "mode": "standard"})
        self.client = boto3.client("s3", endpoint_url=os.environ.get("AWS_ENDPOINT_URL_S3") or
                                   os.environ.get("AWS_ENDPOINT_URL") or None, config=cfg)

    def _key(self, rel):
        return f"{self.prefix}/{rel}" if self.prefix else rel

    def _get(self, rel, cap, if_none_match=None):
        """-> (bytes, ETag), or None for 304; a cut download is tried again from its start."""
        from botocore.exceptions import ClientError
        kw = {"IfNoneMatch": if_none_match} if if_none_match else {}
        for attempt in range(MAX_RESUMES + 1):
            try:
                r = self.client.get_object(Bucket=self.bucket, Key=self._key(rel), **kw)
            except ClientError as e:
                status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
                if status == 304:
                    return None
                if status == 404 or e.response.get("Error", {}).get("Code") in ("NoSuchKey", "404"):
                    raise FileNotFoundError(rel) from None
                raise
            try:
                return _read_stream(r["Body"], int(r["ContentLength"]), cap, rel), r.get("ETag")
            except HostileAnswer:
                if attempt == MAX_RESUMES:
                    raise
            except Exception:       # a connection cut mid-body (botocore's IncompleteRead and kin)
                if attempt == MAX_RESUMES:
                    raise
            time.sleep(backoff(attempt, 5.0))

    def _step_count(self):
        raw, _ = self._get("global/step_count.json", MAX_JSON_ANSWER)
        return parse_step_count(raw, "global/step_count.json")

    def fetch_global(self, etag, cap, max_header=_st.MAX_HEADER_BYTES, check=None):
        for _ in range(10):
            step, mf = self._step_count()
            place = index_place(mf)
            # a tag stands for one step's model file: an index's bytes (so its ETag) can be the same at
            # every step while its shards change
            key = f"{step}:{mf}:"
            try:
                got = self._get(mf, cap if place is None else MAX_INDEX_BYTES,
                                etag[len(key):] if etag and etag.startswith(key) else None)
                if got is None:
                    return None
                tag = key + (got[1] or "")
                if place is None:
                    files, wm = {"latest.safetensors": got[0]}, None
                else:
                    wm = parse_index(got[0], mf, place[1])
                    files = {sh: self._get(f"{place[0]}/{sh}", cap)[0] for sh in sorted(set(wm.values()))}
            except FileNotFoundError:
                if self._step_count()[0] != step:
                    continue        # a cluster removed the step's files once two newer were published
                raise
            # step_count.json is written last: unchanged across the read, the model is that step's
            if self._step_count()[0] == step:
                if check is not None:
                    check(step, files, wm)
                return step, tag, load_set(files, wm, "global", max_header)
        raise HostileAnswer("global/step_count.json changed under every read")

    def fetch_record(self, step):
        """global/rounds/<step>.json and its .sig -> (json bytes, signature bytes), or None if absent."""
        try:
            rec, _ = self._get(f"global/rounds/{step}.json", MAX_RECORD_BYTES)
            sig, _ = self._get(f"global/rounds/{step}.json.sig", SIGNATURE_BYTES)
        except FileNotFoundError:
            return None
        return bytes(rec), bytes(sig)

    def outer_step(self):
        try:
            return self._step_count()[0]
        except Exception:       # not published yet, or the store unreachable: keep waiting
            return None

    def put_delta(self, node, local_step, delta):
        """One PUT: an S3 object is listed whole or not at all."""
        self.client.put_object(Bucket=self.bucket, Key=self._key(f"nodes/{node}/delta_{local_step}.safetensors"),
                               Body=bytes(delta), ContentLength=len(delta))
        return "written", None, None, None

    def put_delta_set(self, node, local_step, parts, index):
        """A sharded delta (encode.split_delta): one PUT per shard, then the index last (dilocod, one or a
        cluster, takes a set once its index is listed beside every shard it names)."""
        for name, part in parts:
            self.client.put_object(Bucket=self.bucket, Key=self._key(f"nodes/{node}/{name}"), Body=bytes(part),
                                   ContentLength=len(part))
        self.client.put_object(Bucket=self.bucket,
                               Key=self._key(f"nodes/{node}/delta_{local_step}.safetensors.index.json"),
                               Body=index, ContentLength=len(index))
        return "written", None, None, None


class HfTransport:
    """A Hugging Face Hub repo dilocod publishes into (--hub hf://ns/repo), through the stock
    huggingface_hub client: HF_TOKEN and HF_ENDPOINT from the environment (a Hub without Xet, like the
    emulator, also needs HF_HUB_DISABLE_XET=1)."""

    def __init__(self, repo, token=None):
        try:
            from huggingface_hub import HfApi
        except ImportError:
            raise ImportError("hf:// needs huggingface_hub: pip install './client/python[hf]'") from None
        self.repo = repo
        self.endpoint = os.environ.get("HF_ENDPOINT") or None
        self.token = token or os.environ.get("HF_TOKEN") or None
        self.api = HfApi(endpoint=self.endpoint, token=self.token)

    def _download(self, rel, revision, size, cap):
        """One file of one commit, checked against the size the listing gives, read whole."""
        import shutil
        import tempfile
        from huggingface_hub import hf_hub_download
        if size is None or size > cap:
            raise HostileAnswer(f"{rel}: {size} bytes, over the {cap} this model can take")
        d = tempfile.mkdtemp(prefix="diloco-hf-")
        try:
            path = hf_hub_download(self.repo, rel, revision=revision, endpoint=self.endpoint, token=self.token,
                                   local_dir=d)
            raw, _ = _read_nofollow(os.path.realpath(path), cap)
        finally:
            shutil.rmtree(d, ignore_errors=True)
        if len(raw) != size:
            raise HostileAnswer(f"{rel}: {len(raw)} bytes, the Hub's listing says {size}")
        return raw

    def _infos(self, revision, paths):
        return {p.path: p for p in self.api.get_paths_info(self.repo, paths, revision=revision)}

    def fetch_global(self, etag, cap, max_header=_st.MAX_HEADER_BYTES):
        # one commit holds a whole step (dilocod publishes each as one): read everything at its sha
        sha = self.api.repo_info(self.repo).sha
        sc_info = self._infos(sha, ["global/step_count.json"]).get("global/step_count.json")
        if sc_info is None:
            raise FileNotFoundError("global/step_count.json")
        step, mf = parse_step_count(self._download("global/step_count.json", sha, sc_info.size, MAX_JSON_ANSWER),
                                    "global/step_count.json")
        info = self._infos(sha, [mf]).get(mf)
        if info is None:
            raise HostileAnswer(f"step_count.json names {mf}, which commit {sha} does not hold")
        # the step too: an index's bytes can be the same at every step while its shards change
        tag = f"{step}:{mf}:{info.lfs.sha256 if info.lfs else info.blob_id}"
        if tag == etag:
            return None
        place = index_place(mf)
        if place is None:
            files, wm = {"latest.safetensors": self._download(mf, sha, info.size, cap)}, None
        else:
            wm = parse_index(self._download(mf, sha, info.size, MAX_INDEX_BYTES), mf, place[1])
            shards = sorted(set(wm.values()))
            infos = self._infos(sha, [f"{place[0]}/{s}" for s in shards])
            files = {}
            for s in shards:
                si = infos.get(f"{place[0]}/{s}")
                if si is None:
                    raise HostileAnswer(f"{mf} names shard {s}, which commit {sha} does not hold")
                files[s] = self._download(f"{place[0]}/{s}", sha, si.size, cap)
        return step, tag, load_set(files, wm, "global", max_header)

    def outer_step(self):
        from huggingface_hub import hf_hub_download
        try:
            path = hf_hub_download(self.repo, "global/step_count.json", endpoint=self.endpoint, token=self.token,
                                   force_download=True)
            # huggingface_hub's cache links a snapshot's file to its blob: that link is the client's own
            raw, _ = _read_nofollow(os.path.realpath(path), MAX_JSON_ANSWER)
            return parse_step_count(raw, "global/step_count.json")[0]
        except Exception:       # not published yet, or the Hub unreachable: keep waiting
            return None

    def put_delta(self, node, local_step, delta):
        """One commit: the Hub lists the file whole or not at all."""
        import io
        self.api.upload_file(path_or_fileobj=io.BytesIO(bytes(delta)),
                             path_in_repo=f"nodes/{node}/delta_{local_step}.safetensors", repo_id=self.repo,
                             commit_message=f"{node} delta_{local_step}")
        return "written", None, None, None
