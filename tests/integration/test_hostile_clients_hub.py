"""A hostile Hub against the real dilocod (issue 9: items 6 and 7, and the hf:// part of 9).

dilocod runs with --hub hf://org/model against the Hub emulator (tests/hubsim/hubsim.py) and its
fault switches; stock-client workers upload the deltas (see test_daemon_hf.py for the set-up and how
dilocod's requests are told from the workers').  One test per attack:

  * a listing's Link next page on another origin (userinfo trick, other port, other host, other
    scheme): a second real HTTP server stands where the Link points and records every request; it must
    receive none, and so never the token;
  * a resolve answered with a redirect to another port or host: curl follows it (the LFS CDN case),
    the second server must see the requests but never the token;
  * an LFS batch answer whose verify URL is on another port: called, but without the token;
  * a file download that streams 200 MiB past the listed size, with the length announced or not;
  * a listing that lies about a delta's size (the header's implied size must match it);
  * listing sizes that are not exact integers (1e30, -1, 1.5, 2^64, NaN, a string);
  * endless JSON answers (revision, tree listing, step file);
  * a Hub that trickles one byte a second, and one that never answers;
  * a delta whose safetensors header is over --max-delta-header-mib, and one whose header describes
    another size than the file's.

Each test asserts, during the attack and after it: dilocod is alive, GET /healthz and /status are served
within 2 s, no .part download grows past its listed size, open descriptors and RSS stay within the stated
bounds of their baseline (FD_SLACK, RSS_SLACK_MIB; more RSS slack under AddressSanitizer, whose
quarantine keeps freed memory), and once the fault is off a normal round completes and matches the
torch oracle."""
import os

os.environ["HF_HUB_DISABLE_XET"] = "1"
os.environ["HF_HUB_DISABLE_TELEMETRY"] = "1"
os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"

import json  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
import urllib.request  # noqa: E402
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
from safetensors.numpy import save as st_save  # noqa: E402

from dilocod_proc import Oracle, delta_metadata, part_sizes  # noqa: E402
from test_daemon_hf import (DELTA_CDN, REV, STEPFILE, TOKEN, TREE, FaultRun, HfDilocod, HubSim,  # noqa: E402,F401
                            Workers, _hf_home, dilocod_entries, fmt_requests, is_peek, procs, setup_run, sha256)

MiB = 1024 * 1024
FD_SLACK = 16           # descriptors over the baseline (curl's connections, a download, the pool's files)
RSS_SLACK_MIB = 32      # the biggest capped answer is 4 MiB; a download is streamed to disk
ASAN_RSS_SLACK_MIB = 96
RESOLVE_MAIN = r"^/org/model/resolve/main/"


# ---- a second server where the hostile Hub points ---------------------------------------------------

class Elsewhere:
    """A real HTTP server on another port: records every request and its Authorization header, and
    answers 200 with an empty JSON array (what a next listing page could look like)."""

    def __init__(self):
        self.requests = []
        seen = self.requests

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self):
                seen.append({"method": self.command, "path": self.path, "host": self.headers.get("Host"),
                             "auth": self.headers.get("Authorization")})
                body = b"[]"
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(body)

            do_HEAD = do_POST = do_PUT = do_GET

            def log_message(self, *a):
                pass

        self.srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.srv.daemon_threads = True
        self.port = self.srv.server_address[1]
        threading.Thread(target=self.srv.serve_forever, daemon=True).start()

    def with_token(self):
        return [r for r in self.requests if r["auth"] and TOKEN in r["auth"]]

    def stop(self):
        self.srv.shutdown()
        self.srv.server_close()


@pytest.fixture
def elsewhere():
    e = Elsewhere()
    yield e
    e.stop()


# ---- the daemon's health, descriptors, memory and downloads ------------------------------------------

def nfds(pid):
    return len(os.listdir(f"/proc/{pid}/fd"))


def rss_mib(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def under_asan(pid):
    with open(f"/proc/{pid}/maps") as f:
        return "asan" in f.read()


def served_within(d, limit=2.0):
    """GET /healthz and /status, each within limit seconds.  -> the slower one's time."""
    worst = 0.0
    for path in ("/healthz", "/status"):
        t0 = time.monotonic()
        with urllib.request.urlopen(d.url + path, timeout=limit + 1) as r:
            r.read()
            assert r.status == 200, (path, r.status)
        dt = time.monotonic() - t0
        assert dt < limit, f"{path} took {dt:.2f}s while the Hub misbehaves"
        worst = max(worst, dt)
    return worst


def incoming_parts(d):
    return part_sizes(d.state_dir / "cache" / "incoming", "hf-*.part")


def tree_bytes(path: Path):
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            try:
                total += os.lstat(os.path.join(root, f)).st_size
            except FileNotFoundError:
                pass
    return total


class Guard:
    """Baseline at creation; sample() (also from a background thread while an attack runs) records the
    worst descriptors, RSS, .part size and response time seen; check() asserts the bounds."""

    def __init__(self, d, max_part):
        self.d = d
        self.pid = d.proc.pid
        self.max_part = max_part      # the largest listed size of the round's deltas
        self.fd0 = nfds(self.pid)
        self.rss0 = rss_mib(self.pid)
        self.state0 = tree_bytes(d.state_dir)
        self.rss_slack = ASAN_RSS_SLACK_MIB if under_asan(self.pid) else RSS_SLACK_MIB
        self.fd_max, self.rss_max, self.part_max, self.slowest = self.fd0, self.rss0, 0, 0.0
        self.samples = 0
        self._stop = threading.Event()
        self._thread = None
        self.error = None

    def sample(self):
        self.d.check_alive()
        self.fd_max = max(self.fd_max, nfds(self.pid))
        self.rss_max = max(self.rss_max, rss_mib(self.pid))
        self.part_max = max([self.part_max, *incoming_parts(self.d).values()])
        self.slowest = max(self.slowest, served_within(self.d))
        self.samples += 1

    def __enter__(self):
        def loop():
            while not self._stop.is_set():
                try:
                    self.sample()
                except Exception as e:  # noqa: BLE001 - reported by check()
                    self.error = e
                    return
                self._stop.wait(0.1)
        self._thread = threading.Thread(target=loop, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(10)

    def check(self, state_slack=0):
        if self.error is not None:
            raise AssertionError(f"while the Hub misbehaved: {self.error}\n{self.d.diag()}")
        self.sample()
        report = (f"fds {self.fd0} -> max {self.fd_max} (bound +{FD_SLACK}), RSS {self.rss0:.1f} -> max "
                  f"{self.rss_max:.1f} MiB (bound +{self.rss_slack}), largest .part {self.part_max} B (listed "
                  f"max {self.max_part} B), slowest /healthz|/status {self.slowest * 1000:.0f} ms, "
                  f"{self.samples} samples")
        print(report)
        assert self.fd_max <= self.fd0 + FD_SLACK, report
        assert self.rss_max <= self.rss0 + self.rss_slack, report
        assert self.part_max <= self.max_part, report
        # the state dir grows by what the rounds commit (globals, momentum, cached deltas), nothing more
        grown = tree_bytes(self.d.state_dir) - self.state0
        assert grown <= state_slack, f"state dir grew by {grown} B (bound {state_slack} B)\n{report}"
        return report


class Run(FaultRun):
    """FaultRun (3 stock-client workers, dilocod at step 0, torch oracle) with extra dilocod options."""

    def __init__(self, tmp, procs, *args):  # noqa: F811 - procs is the fixture's list
        self.nodes = ["w0", "w1", "w2"]
        self.hub, self.api, self.d, init = setup_run(tmp, self.nodes, *args)
        procs += [self.hub, self.d]
        self.d.start()
        self.d.wait_published(0)
        self.oracle = Oracle(init)
        self.workers = Workers(self.hub, tmp, self.nodes)
        self.step = 0
        self.seq0 = self.hub.last_seq()
        self.rules = []

    def guard(self, prepared):
        # a round commits a global and a momentum file and caches each delta; room for two rounds
        self.delta_max = max(len(p[2]) for p in prepared)
        return Guard(self.d, self.delta_max)

    def state_slack(self, rounds):
        return rounds * (2 * self.delta_max + self.W * self.delta_max) + 4 * self.delta_max + MiB

    def log_count(self, needle):
        return self.d.log_text().count(needle)

    def transport_errors(self):
        """dilocod_hub_transport_errors_total: every failed request counts, although a failure that
        repeats the last one is logged only once."""
        with urllib.request.urlopen(self.d.url + "/metrics", timeout=10) as r:
            for line in r.read().decode().splitlines():
                if line.startswith("dilocod_hub_transport_errors_total "):
                    return int(line.split()[1])
        raise AssertionError("no dilocod_hub_transport_errors_total in /metrics")


def wait_fired(run, rule_ids, what, timeout=60):
    """Waits until hubsim dropped these (count-limited) rules, i.e. every one fired."""
    run.d.wait(lambda: not {r["id"] for r in run.hub.faults()} & set(rule_ids), what, timeout)


# ---- 6. the token never leaves the endpoint -----------------------------------------------------------

def test_link_to_another_origin_is_not_followed(tmp_path, procs, elsewhere):
    run = Run(tmp_path, procs)
    hp, ep = run.hub.port, elsewhere.port
    tail = "/api/models/org/model/tree/main/nodes?recursive=true&expand=false&cursor=eyJjIjoiIn0"
    links = {
        "userinfo": f"http://localhost:{hp}@127.0.0.1:{ep}{tail}",          # passed the old prefix check
        "userinfo_same_host": f"http://user:pw@localhost:{hp}{tail}",
        "other_port": f"http://localhost:{ep}{tail}",
        "other_host": f"http://127.0.0.1:{ep}{tail}",
        "other_scheme": f"https://localhost:{hp}{tail}",
        "suffix_host": f"http://localhost.:{hp}{tail}",
    }
    prepared = run.prepare()
    g = run.guard(prepared)
    refused0 = run.log_count("is not on the endpoint")
    # on a listing's 200 only: the daemon's first listing after its bootstrap publish can meet a nodes/
    # that no worker made yet (404), where a Link means nothing and the rule would be used up unseen
    ids = [run.fault(kind="headers", route="tree", path_regex=TREE, headers={"Link": f'<{u}>; rel="next"'},
                     on_status=200, count=1)["id"] for u in links.values()]
    with g:
        run.upload(prepared)
        wait_fired(run, ids, "every hostile Link served")
        run.finish(prepared, timeout=90)
    assert elsewhere.requests == [], f"dilocod followed a Link elsewhere: {elsewhere.requests}"
    run.d.wait(lambda: run.log_count("is not on the endpoint") - refused0 >= len(links), "every Link refused")
    # the listings themselves carried the token to the endpoint (the fault did not stop them)
    tree = dilocod_entries(run.hub, run.seq0, "tree")
    assert sum(1 for e in tree if e["fault"] == "headers") == len(links), fmt_requests(tree)
    assert all(e["auth"] for e in tree), fmt_requests(tree)
    g.check(state_slack=run.state_slack(2))
    run.check()
    g.check(state_slack=run.state_slack(2))
    assert run.d.stop() == 0


def test_redirect_elsewhere_carries_no_token(tmp_path, procs, elsewhere):
    """A resolve answered 302 to another port of the same host, then to another host (how the LFS CDN
    is reached): curl follows, the token stays behind."""
    run = Run(tmp_path, procs)
    prepared = run.prepare()
    g = run.guard(prepared)
    ids = []
    for host in ("localhost", "127.0.0.1"):
        loc = f"http://{host}:{elsewhere.port}/lfs-cdn/0000?X-Amz-Signature=x"
        ids.append(run.fault(status=302, method="GET", path_regex=RESOLVE_MAIN, headers={"Location": loc},
                             count=2)["id"])
    with g:
        run.upload(prepared)
        wait_fired(run, ids, "the redirects served")
        run.finish(prepared, timeout=90)
    assert len(elsewhere.requests) >= 4, ("the redirects were not followed", elsewhere.requests)
    assert elsewhere.with_token() == [], f"the token followed a redirect: {elsewhere.with_token()}"
    hosts = {r["host"].split(":")[0] for r in elsewhere.requests}
    assert hosts == {"localhost", "127.0.0.1"}, elsewhere.requests
    g.check(state_slack=run.state_slack(2))
    run.check()
    assert run.d.stop() == 0


def test_lfs_verify_url_elsewhere_gets_no_token(tmp_path, procs, elsewhere):
    """dilocod's LFS batch answer names a verify URL on another port: the verify call goes there (the
    protocol says to call it) but without the token; the unverified object then fails the commit, and
    the next publish attempt, on an honest answer, completes."""
    run = Run(tmp_path, procs)
    prepared = run.prepare()
    g = run.guard(prepared)
    href = f"http://localhost:{elsewhere.port}/org/model.git/info/lfs/objects/verify"
    # skip=W: the workers' own uploads make one batch call each first
    rule = run.fault(kind="lfs_href", route="lfs_batch", action="verify", href=href, skip=run.W, count=1)
    with g:
        run.upload(prepared)
        wait_fired(run, [rule["id"]], "the hostile batch answer served")
        run.finish(prepared, timeout=90)
    posts = [r for r in elsewhere.requests if r["method"] == "POST"]
    assert posts, ("the verify call did not happen", elsewhere.requests)
    assert elsewhere.with_token() == [], f"the token went to the verify URL: {elsewhere.with_token()}"
    g.check(state_slack=run.state_slack(2))
    run.check()
    assert run.d.stop() == 0


# ---- 7. no download past its listed size; sizes are exact integers -------------------------------

@pytest.mark.parametrize("announce", [True, False], ids=["length_announced", "close_delimited"])
def test_download_streaming_past_listed_size_is_cut(tmp_path, procs, announce):
    run = Run(tmp_path, procs)
    prepared = run.prepare()
    g = run.guard(prepared)
    node, path, data, tensors = prepared[0]
    cut0 = run.log_count("download larger than the listing")
    # skip=1: the header peek; then two downloads of this delta stream 200 MiB more than it has
    rule = run.fault(kind="oversize", route="cdn", oid=sha256(data), skip=1, count=2, extra=200 * MiB,
                     announce=announce)
    with g:
        run.upload(prepared)
        wait_fired(run, [rule["id"]], "both oversized downloads served", timeout=120)
        run.finish(prepared, timeout=120)
    run.d.wait(lambda: run.log_count("download larger than the listing") - cut0 >= 2, "both downloads cut")
    cdn = [e for e in dilocod_entries(run.hub, run.seq0, "cdn") if sha256(data) in e["path"] and not is_peek(e)]
    assert sum(1 for e in cdn if e["fault"] == "oversize") == 2, fmt_requests(cdn)
    g.check(state_slack=run.state_slack(2))
    run.check()
    assert run.d.stop() == 0


def test_listing_that_lies_about_a_size_gets_nothing_downloaded(tmp_path, procs):
    """The listing says 1,000 bytes (or 1 MiB more) for a delta: its header, read with a Range capped at
    the listed size, describes another size, so the delta is refused before any download."""
    run = Run(tmp_path, procs)
    prepared = run.prepare()
    g = run.guard(prepared)
    (n0, p0, d0, t0), (n1, p1, d1, t1) = prepared[0], prepared[1]
    refused0 = run.log_count("delta refused before download")
    r0 = run.fault(kind="listing_size", route="tree", entry_regex=p0, size=1000, count=-1)
    r1 = run.fault(kind="listing_size", route="tree", entry_regex=p1, size=len(d1) + MiB, count=-1)
    with g:
        run.upload(prepared)
        run.d.wait(lambda: run.log_count("delta refused before download") - refused0 >= 2, "both refused")
    run.hub.ctl("DELETE", f"/_sim/faults/{r0['id']}")
    run.hub.ctl("DELETE", f"/_sim/faults/{r1['id']}")
    log = run.d.log_text()
    assert f"path={p0}" in log and "listing says 1000" in log, run.d.diag()
    cdn = dilocod_entries(run.hub, run.seq0, "cdn")
    for data in (d0, d1):
        got = [e for e in cdn if sha256(data) in e["path"]]
        assert got and all(is_peek(e) for e in got), fmt_requests(got)
        assert all(e["range"] in ("bytes=0-999", "bytes=0-65535") for e in got), fmt_requests(got)
    # the two refused nodes push again (new local steps); the round completes with those deltas
    redo = []
    for node in (n0, n1):
        g_state = run.workers.global_state(node)
        redo.append((node, *run.workers.prepare(node, run.step, g_state)))
    with g:
        run.upload(redo)
        run.finish([prepared[2], *redo], timeout=90)
    g.check(state_slack=run.state_slack(2))
    run.check()
    assert run.d.stop() == 0


RAW_SIZES = ["1e30", "-1", "1.5", "18446744073709551616", "9007199254740993", "NaN", '"1000"', "null"]


def test_listing_sizes_that_are_not_exact_integers_are_refused(tmp_path, procs):
    run = Run(tmp_path, procs)
    prepared = run.prepare()
    g = run.guard(prepared)
    errors0 = run.transport_errors()
    # every rule matches every listing: rule i lets i listings pass first, so each listing has one
    ids = [run.fault(kind="listing_size", route="tree", raw_size=raw, skip=i, count=1)["id"]
           for i, raw in enumerate(RAW_SIZES)]
    with g:
        run.upload(prepared)
        wait_fired(run, ids, "every bad listing served")
        run.finish(prepared, timeout=90)
    log = run.d.log_text()
    # NaN is not JSON: that whole page is refused; the others are skipped entry by entry.  Each bad
    # listing counts as a failure; one that repeats the last failure's words is not logged again.
    assert "with an unusable size or oid ignored" in log, run.d.diag()
    assert "tree listing is not a JSON array" in log, run.d.diag()
    assert run.transport_errors() - errors0 >= len(RAW_SIZES), run.d.diag()
    g.check(state_slack=run.state_slack(2))
    run.check()
    assert run.d.stop() == 0


def test_endless_answers_are_capped(tmp_path, procs):
    """The revision answer, a tree listing and step_count.json each stream JSON without end."""
    run = Run(tmp_path, procs)
    prepared = run.prepare()
    g = run.guard(prepared)
    capped0, errors0 = run.log_count("the answer is larger than allowed"), run.transport_errors()
    ids = [run.fault(kind="endless", path_regex=REV, count=2)["id"],
           run.fault(kind="endless", path_regex=STEPFILE, count=1)["id"],
           run.fault(kind="endless", path_regex=TREE, count=2)["id"]]
    with g:
        run.upload(prepared)
        wait_fired(run, ids, "every endless answer served", timeout=90)
        run.finish(prepared, timeout=90)
    # each of the three routes' endless answer is said (a repeat of the same failure is not logged
    # again), and every one of the five is counted as a failure
    assert run.log_count("the answer is larger than allowed") - capped0 >= 3, run.d.diag()
    assert run.transport_errors() - errors0 >= 5, run.d.diag()
    g.check(state_slack=run.state_slack(2))
    run.check()
    assert run.d.stop() == 0


# ---- a Hub that trickles or never answers ---------------------------------------------------------------

@pytest.mark.parametrize("how", ["trickle", "silent"])
def test_trickling_or_silent_hub_is_cut_off(tmp_path, procs, how):
    """The revision poll is answered at 1 byte/s (or never): curl's low-speed limit (1 KiB/s over 30 s)
    gives up on it, the daemon serves clients meanwhile, and polling resumes."""
    run = Run(tmp_path, procs)
    prepared = run.prepare()
    g = run.guard(prepared)
    since = run.hub.last_seq()
    if how == "trickle":
        rule = run.fault(kind="throttle", bytes_per_sec=1, path_regex=REV, count=1)
    else:
        rule = run.fault(kind="delay", delay=600, path_regex=REV, count=1)
    with g:
        wait_fired(run, [rule["id"]], "the poll held")
        run.upload(prepared)
        t0 = time.time()
        run.d.wait(lambda: any(e["seq"] > min(x["seq"] for x in dilocod_entries(run.hub, since, "repo_info")
                                              if x["fault"])
                               for e in dilocod_entries(run.hub, since, "repo_info")),
                   "a poll after the held one", timeout=75)
        waited = time.time() - t0
        run.finish(prepared, timeout=90)
    revs = dilocod_entries(run.hub, since, "repo_info")
    held = [e for e in revs if e["fault"]]
    assert len(held) == 1, fmt_requests(revs)
    after = [e for e in revs if e["seq"] > held[0]["seq"]]
    gap = after[0]["time"] - held[0]["time"]
    print(f"{how}: the held poll was given up after {gap:.1f}s")
    assert 25 <= gap <= 45, (gap, fmt_requests(revs))
    assert waited < 60
    g.check(state_slack=run.state_slack(2))
    run.check()
    assert run.d.stop() == 0


# ---- 9. one header cap for every intake path (the Hub's peek) ----------------------------------------

def test_header_over_cap_or_with_another_size_is_not_downloaded(tmp_path, procs):
    """With --max-delta-header-mib 1, a delta whose header is 1.5 MiB is refused at its peek; a delta
    whose header describes fewer bytes than the file has (junk appended) is refused too."""
    run = Run(tmp_path, procs, "--max-delta-header-mib", "1")
    prepared = run.prepare()
    (n0, p0, d0, t0), (n1, p1, d1, t1) = prepared[0], prepared[1]
    big_meta = dict(delta_metadata(n0, run.step, int(p0.split("_")[-1].split(".")[0])), pad="x" * (3 * MiB // 2))
    bad0 = st_save(t0, metadata=big_meta)
    bad1 = d1 + b"\0" * 4096
    g = Guard(run.d, max(len(bad0), len(bad1), *(len(p[2]) for p in prepared)))
    run.delta_max = g.max_part
    refused0 = run.log_count("delta refused before download")
    with g:
        run.upload([(n0, p0, bad0, t0), (n1, p1, bad1, t1), prepared[2]])
        run.d.wait(lambda: run.log_count("delta refused before download") - refused0 >= 2, "both refused")
    log = run.d.log_text()
    assert "the cap is 1048576" in log, run.d.diag()
    assert f"describes a file of {len(d1)} bytes, the listing says {len(bad1)}" in log, run.d.diag()
    cdn = dilocod_entries(run.hub, run.seq0, "cdn")
    for data in (bad0, bad1):
        got = [e for e in cdn if sha256(data) in e["path"]]
        assert got and all(is_peek(e) for e in got), fmt_requests(got)
    # the two nodes push proper deltas; the round completes with them
    redo = []
    for node in (n0, n1):
        redo.append((node, *run.workers.prepare(node, run.step, run.workers.global_state(node))))
    with g:
        run.upload(redo)
        run.finish([prepared[2], *redo], timeout=90)
    g.check(state_slack=run.state_slack(2) + len(bad0))
    run.check(min_faults=0)
    assert run.d.stop() == 0
