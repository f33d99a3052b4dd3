"""The dashboard (GET /, server/api/dashboard.html compiled into dilocod) in a real headless Chromium.

dilocod runs with --hub none, a small model, --expected-nodes 2 (with --nodes node-a,node-b, so the page
also has a `missing` list to show, and --round-timeout 600, so it has a deadline to count down; rounds
still close as soon as both nodes delivered).  Three rounds are uploaded over HTTP, then Chromium loads
the page: the DOM after the scripts ran (--dump-dom) is parsed with html.parser and checked through its
test hooks (#outer-step, #state, #round-nodes, the four plot SVGs whose data points have class "point",
data-series and data-step), and screenshots are taken in the light and the dark color scheme.  Plot
points are indexed by the round's BASE step (/rounds "step"): after three rounds, steps 0, 1, 2 (which
produced outer steps 1, 2, 3).  A second load while a round is half full checks #round-nodes.

The page must stay self-contained: no URL of any other origin in the served source (no "//" at all,
no src=/url()/@import, fetch() only of the relative same-origin paths "status" and "rounds").

Screenshots go to the test's tmp dir, or to $DASHBOARD_SCREENSHOT_DIR when set (to look at them)."""
import os
import re
import shutil
import subprocess
import time
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import requests
import torch
from safetensors.numpy import save as np_save

from dilocod_proc import Dilocod, delta_metadata, random_deltas, write_model

CHROMIUM = Path("/usr/bin/chromium")
NODES = ("node-a", "node-b")
ROUNDS = 3
VOID = {"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "source", "track", "wbr"}


# ---- a small DOM built with html.parser ------------------------------------------------------------

class Node:
    def __init__(self, tag, attrs, parent):
        self.tag, self.attrs, self.parent, self.children, self.text = tag, dict(attrs), parent, [], []

    def iter(self):
        yield self
        for c in self.children:
            yield from c.iter()

    def text_content(self):
        return "".join(self.text) + "".join(c.text_content() for c in self.children)

    def classes(self):
        return (self.attrs.get("class") or "").split()


class Dom(HTMLParser):
    def __init__(self, html):
        super().__init__(convert_charrefs=True)
        self.root = Node("#document", [], None)
        self.cur = self.root
        self.feed(html)
        self.close()

    def handle_starttag(self, tag, attrs):
        node = Node(tag, attrs, self.cur)
        self.cur.children.append(node)
        if tag not in VOID:
            self.cur = node

    def handle_startendtag(self, tag, attrs):
        self.cur.children.append(Node(tag, attrs, self.cur))

    def handle_endtag(self, tag):
        n = self.cur
        while n is not None and n.tag != tag:
            n = n.parent
        if n is not None and n.parent is not None:
            self.cur = n.parent

    def handle_data(self, data):
        self.cur.text.append(data)

    def by_id(self, ident):
        found = [n for n in self.root.iter() if n.attrs.get("id") == ident]
        assert len(found) == 1, f"#{ident}: {len(found)} elements"
        return found[0]

    def points(self, ident):
        svg = self.by_id(ident)
        assert svg.tag == "svg", (ident, svg.tag)
        return [(p.attrs.get("data-series"), p.attrs.get("data-step")) for p in svg.iter() if "point" in p.classes()]


# ---- chromium ----------------------------------------------------------------------------------------

def chromium_binary():
    """Chromium may still be being installed by apt: wait up to 10 minutes for it."""
    deadline = time.time() + 600
    while not (CHROMIUM.exists() and os.access(CHROMIUM, os.X_OK)):
        assert time.time() < deadline, f"{CHROMIUM} did not appear within 10 minutes"
        time.sleep(2)
    return CHROMIUM


def chromium(tmp: Path, url: str, *args, timeout=90):
    profile = tmp / f"profile-{time.monotonic_ns()}"
    profile.mkdir()
    cmd = [str(chromium_binary()), "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
           "--disable-background-networking", "--disable-component-update", "--disable-sync",
           f"--user-data-dir={profile}", *args, url]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    finally:
        shutil.rmtree(profile, ignore_errors=True)
    assert p.returncode == 0, f"chromium exited {p.returncode}:\n{p.stderr[-3000:]}"
    return p


def dump_dom(tmp, url):
    """The DOM after 5 s of (virtual) time; the page must log nothing to the console: no script error,
    no Content-Security-Policy violation (a request to another origin would be one)."""
    p = chromium(tmp, url, "--dump-dom", "--virtual-time-budget=5000", "--enable-logging=stderr", "--v=0")
    assert "<html" in p.stdout, (p.stdout[:500], p.stderr[-2000:])
    console = [line for line in p.stderr.splitlines() if ":CONSOLE" in line]
    assert not console, "\n".join(console)
    return p.stdout


def screenshot(tmp, url, out: Path, dark=False):
    out.unlink(missing_ok=True)
    chromium(tmp, url, f"--screenshot={out}", "--window-size=1280,900", "--virtual-time-budget=5000",
             "--hide-scrollbars", *(["--force-dark-mode"] if dark else []))
    assert out.exists(), f"no screenshot at {out}"
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", data[:16]
    assert len(data) > 10_000, f"{out}: only {len(data)} bytes"
    return data


# ---- dilocod -------------------------------------------------------------------------------------------

def session():
    s = requests.Session()
    s.trust_env = False
    return s


def status(url):
    with session() as s:
        r = s.get(url + "/status", timeout=10)
    assert r.status_code == 200, r.text
    return r.json()


def wait_status(url, pred, what, timeout=30):
    deadline = time.time() + timeout
    while True:
        st = status(url)
        if pred(st):
            return st
        assert time.time() < deadline, f"{what} not reached within {timeout}s: {st}"
        time.sleep(0.02)


def upload(url, node, base_step, local_step, tensors):
    blob = np_save(tensors, metadata=delta_metadata(node, base_step, local_step))
    with session() as s:
        r = s.put(f"{url}/nodes/{node}/delta_{local_step}.safetensors", data=blob, timeout=30)
    assert r.status_code == 201, (r.status_code, r.text)
    return r.json()


def route_counts(url):
    """{(route, status class): count} from dilocod_http_requests_total."""
    with session() as s:
        text = s.get(url + "/metrics", timeout=10).text
    return {(m[0], m[1]): int(float(m[2])) for m in
            re.findall(r'^dilocod_http_requests_total\{route="([^"]+)",code="([^"]+)"\} (\S+)$', text, re.M)}


def small_model():
    g = torch.Generator().manual_seed(5)
    return {"layer.weight": torch.randn(64, 32, generator=g), "layer.bias": torch.randn(32, generator=g),
            "head": torch.randn(32, 8, generator=g).to(torch.float16)}


def check_self_contained(html: str):
    """No URL of another origin anywhere in the served page, and it fetches only status and rounds."""
    assert "http://" not in html and "https://" not in html, "absolute URL in the page"
    assert "//" not in html, [html[max(0, m.start() - 60):m.end() + 60] for m in re.finditer("//", html)]
    for needle in ("src=", "url(", "@import", "<iframe", "<object", "<embed", "<base", "XMLHttpRequest",
                   "WebSocket", "EventSource", "sendBeacon", "import("):
        assert needle not in html, needle
    for m in re.finditer(r"<link\b[^>]*>", html):
        assert re.search(r'href="data:[^"]*"', m.group(0)), m.group(0)
    fetched = re.findall(r"\bfetch\(\s*([^,)]*)", html)
    assert fetched, "the page fetches nothing"
    literals = set(re.findall(r"""getJSON\(\s*(['"][^'"]*['"])""", html))
    assert fetched == ["path"] and literals == {"'status'", "'rounds'"}, (fetched, literals)


# ---- the test --------------------------------------------------------------------------------------------

def test_dashboard_in_headless_chromium(tmp_path):
    chromium_binary()
    shots = Path(os.environ.get("DASHBOARD_SCREENSHOT_DIR") or tmp_path)
    shots.mkdir(parents=True, exist_ok=True)
    model = small_model()
    write_model(tmp_path / "init.safetensors", model)
    d = Dilocod(tmp_path, None, "--init-model", str(tmp_path / "init.safetensors"), "--expected-nodes", "2",
                "--nodes", ",".join(NODES), "--round-timeout", "600").start()
    try:
        url = d.url
        wait_status(url, lambda s: s["outer_step"] == 0 and s["state"] == "collecting", "bootstrap")

        # the page as served: self-contained, small, with the CSP
        with session() as s:
            r = s.get(url + "/", timeout=10)
        assert r.status_code == 200 and r.headers["Content-Type"].startswith("text/html"), r.headers
        assert "default-src 'self'" in r.headers["Content-Security-Policy"], r.headers
        assert len(r.content) < 40_000, len(r.content)
        assert r.content == (Path(__file__).resolve().parents[2] / "server" / "api" / "dashboard.html").read_bytes(), \
            "dilocod serves another page than server/api/dashboard.html: rebuild (make)"
        check_self_contained(r.text)

        # three full rounds over HTTP
        rng = np.random.default_rng(3)
        for step in range(ROUNDS):
            for i, node in enumerate(NODES):
                t = random_deltas(rng, model, scale=0.01 * (i + 1))
                upload(url, node, step, 100 * (step + 1) + i, t)
            wait_status(url, lambda s, n=step + 1: s["outer_step"] == n and s["last_round"] is not None
                        and s["last_round"]["outer_step"] == n, f"outer step {step + 1}")
        with session() as s:
            rounds = s.get(url + "/rounds", timeout=10).json()["rounds"]
        assert [(r["step"], r["outer_step"]) for r in rounds] == [(0, 1), (1, 2), (2, 3)], rounds

        # the DOM after the scripts ran; the page asked dilocod for itself, /status and /rounds, nothing else
        before = route_counts(url)
        html = dump_dom(tmp_path, url + "/")
        after = route_counts(url)
        grew = {k: after.get(k, 0) - before.get(k, 0) for k in after if after.get(k, 0) != before.get(k, 0)}
        grew.pop(("metrics", "200"), None)
        assert set(grew) == {("dashboard", "200"), ("status", "200"), ("rounds", "200")}, grew
        assert grew[("dashboard", "200")] == 1, grew
        assert "http://" not in html and "https://" not in html, "absolute URL in the rendered DOM"
        dom = Dom(html)
        assert dom.by_id("outer-step").text_content().strip() == str(ROUNDS)
        assert dom.by_id("state").text_content().strip() == "collecting"
        assert [c for c in dom.by_id("round-nodes").children] == []
        want_nodes = sorted((n, str(s)) for n in NODES for s in range(ROUNDS))
        for plot in ("plot-norm", "plot-cosine"):
            pts = dom.points(plot)
            assert sorted(pts) == want_nodes, (plot, pts)
        assert sorted(dom.points("plot-agg-time")) == [("time", str(s)) for s in range(ROUNDS)]
        assert sorted(dom.points("plot-throughput")) == [("gbps", str(s)) for s in range(ROUNDS)]
        for plot in ("plot-norm", "plot-cosine", "plot-agg-time", "plot-throughput"):
            svg = dom.by_id(plot)
            assert svg.attrs.get("role") == "img" and svg.attrs.get("aria-label"), (plot, svg.attrs)
            assert any(c.tag == "title" and c.text_content().strip() for c in svg.children), plot
        legend = dom.by_id("leg-norm").text_content()
        assert all(n in legend for n in NODES), legend

        # a half-full round: node-a delivered, node-b missing, a deadline counting down
        upload(url, "node-a", ROUNDS, 1000, random_deltas(rng, model))
        st = wait_status(url, lambda s: len(s["round"]["received"]) == 1, "one delta in the open round")
        assert st["outer_step"] == ROUNDS and st["round"]["missing"] == ["node-b"], st["round"]
        dom = Dom(dump_dom(tmp_path, url + "/"))
        assert dom.by_id("outer-step").text_content().strip() == str(ROUNDS)
        items = dom.by_id("round-nodes").children
        assert len(items) == 1, [c.text_content() for c in items]
        assert items[0].attrs.get("data-node") == "node-a" and "node-a" in items[0].text_content(), items[0].attrs
        assert "1000" in items[0].text_content(), items[0].text_content()
        assert [c.text_content().strip() for c in dom.by_id("round-missing").children] == ["node-b"]
        assert re.search(r"in \d+ min", dom.by_id("round-deadline").text_content()), \
            dom.by_id("round-deadline").text_content()
        assert len(dom.points("plot-norm")) == 2 * ROUNDS

        # screenshots, light and dark
        for name, dark in (("dashboard-light.png", False), ("dashboard-dark.png", True)):
            screenshot(tmp_path, url + "/", shots / name, dark=dark)
        assert status(url)["outer_step"] == ROUNDS
    finally:
        assert d.stop(timeout=30) == 0, d.log_text()[-3000:]
