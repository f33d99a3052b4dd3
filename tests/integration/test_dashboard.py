"""The dashboard (GET /, server/api/dashboard.html compiled into dilocod) in a real headless Chromium.

dilocod runs with --hub none, a small model, --expected-nodes 2 (with --nodes node-a,node-b, so the page
also has a `missing` list to show, and --round-timeout 600, so it has a deadline to count down; rounds
still close as soon as both nodes delivered).  Three rounds are uploaded over HTTP, then Chromium loads
the page: the DOM after the scripts ran (--dump-dom) is parsed with html.parser and checked through its
test hooks (#outer-step, #state, #round-nodes, the five plot SVGs whose data points have class "point",
data-series and data-step; the deltas report a loss, and #plot-loss draws one series per node and their
mean), and screenshots are taken in the light and the dark color scheme.  Plot
points are indexed by the round's BASE step (/rounds "step"): after three rounds, steps 0, 1, 2 (which
produced outer steps 1, 2, 3).  A second load while a round is half full checks #round-nodes.

The page must stay self-contained: no URL of any other origin in the served source (no "//" at all,
no src=/url()/@import, fetch() only of the relative same-origin paths "status" and "rounds").

More than 8 nodes, a narrow viewport, dark mode and the "nothing yet" state (before any global model)
are checked in a live page driven over the DevTools protocol (chromium --remote-debugging-pipe, no
extra package): the layout through the DOM (nothing wider than the viewport, node ids and sizes on one
line), the series' colours and marker shapes, hover highlighting, and the screenshots' pixels (each
series' marker is drawn in its own colour, the colours differ, dark mode is dark, a dimmed series fades).

In async mode (--mode async) a live page shows the async panel: the mode, the Delayed Nesterov phase
(k of N), the queue depth (pending of max, non-zero while a long --grace-ms holds deltas), the staleness
histogram and each node's speed and recommended local steps, all as /status reports them.

The trainer's view (issue 36): at 1280x800 the first screen, unscrolled, holds the loss per worker and
their mean, the round wall-clock with the wait for the slowest worker and tokens per second (checked
through the DOM's boxes and the screenshot's pixels); tokens seen is the aggregated deltas' num_tokens; a
quarantined worker stays plotted and marked at its round; after a restart (one record rewritten as an
older dilocod wrote it, without times) the panels come back from /rounds and the counters say since when
they count.  A server string full of markup reaches the page as text.

Screenshots go to the test's tmp dir, or to $DASHBOARD_SCREENSHOT_DIR when set (to look at them)."""
import base64
import io
import itertools
import json
import os
import re
import select
import shutil
import subprocess
import time
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import requests
import torch
from PIL import Image
from safetensors.numpy import save as np_save

from dilocod_proc import Dilocod, delta_metadata, random_deltas, write_delta, write_model

CHROMIUM = Path("/usr/bin/chromium")
NODES = ("node-a", "node-b")
ROUNDS = 3
# the loss each node reports with its delta of each round, and their mean per round
LOSS = {(s, n): round(3.0 - 0.5 * s + 0.25 * i, 2) for s in range(ROUNDS) for i, n in enumerate(NODES)}
LOSS_MEAN = {s: sum(LOSS[(s, n)] for n in NODES) / len(NODES) for s in range(ROUNDS)}
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


def upload(url, node, base_step, local_step, tensors, metrics=None):
    blob = np_save(tensors, metadata=dict(delta_metadata(node, base_step, local_step), **(metrics or {})))
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
        assert len(r.content) < 64_000, len(r.content)   # one page, no external fetches, no minifier
        assert r.content == (Path(__file__).resolve().parents[2] / "server" / "api" / "dashboard.html").read_bytes(), \
            "dilocod serves another page than server/api/dashboard.html: rebuild (make)"
        check_self_contained(r.text)

        # three full rounds over HTTP
        rng = np.random.default_rng(3)
        for step in range(ROUNDS):
            for i, node in enumerate(NODES):
                t = random_deltas(rng, model, scale=0.01 * (i + 1))
                upload(url, node, step, 100 * (step + 1) + i, t, {"loss": str(LOSS[(step, node)]), "num_tokens": "512"})
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
        assert status(url)["mode"] == "sync" and "hidden" in dom.by_id("async").attrs   # sync: no async panel
        assert dom.by_id("h-round").text_content().strip() == "Current round"
        assert dom.by_id("state").text_content().strip() == "collecting deltas"
        assert dom.by_id("state").attrs.get("data-state") == "collecting"
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
        # the loss plot: one series per node and the mean, one point per round each, the mean dashed
        loss = dom.by_id("plot-loss")
        groups = {g.attrs["data-series"]: g for g in loss.iter() if "series" in g.classes()}
        assert set(groups) == {*NODES, "mean"}, groups.keys()
        assert "mean" in groups["mean"].classes() and not any("mean" in groups[n].classes() for n in NODES)
        assert sorted(dom.points("plot-loss")) == sorted(want_nodes + [("mean", str(s)) for s in range(ROUNDS)])
        for p in loss.iter():
            if "point" in p.classes():
                want = LOSS_MEAN[int(p.attrs["data-step"])] if p.attrs["data-series"] == "mean" else \
                    LOSS[(int(p.attrs["data-step"]), p.attrs["data-series"])]
                shown = float(p.text_content().rsplit(":", 1)[1])      # its title: "<series>, round s: value"
                assert abs(shown - want) <= 1e-4 * abs(want), (p.attrs, p.text_content(), want)
        lines = [g for g in groups["mean"].iter() if g.tag == "polyline"]
        assert len(lines) == 1 and len(lines[0].attrs["points"].split()) == ROUNDS, lines
        assert [c.text_content() for c in dom.by_id("leg-loss").children] == [*NODES, "mean"]
        # no /status robust.quarantined (no quarantine configured): no quarantine panel
        assert "robust" not in status(url) or not status(url)["robust"].get("quarantined")
        assert "hidden" in dom.by_id("quarantined").attrs

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


# ---- a live page over the DevTools protocol ------------------------------------------------------------

class Page:
    """One headless Chromium tab driven over --remote-debugging-pipe (fd 3: our commands, fd 4: its
    answers, NUL-terminated JSON)."""

    def __init__(self, tmp: Path, width, height, dark=False):
        self.profile = tmp / f"cdp-{time.monotonic_ns()}"
        self.profile.mkdir()
        cmd_r, self.cmd_w = os.pipe()
        self.ans_r, ans_w = os.pipe()

        def fds():
            # copies first: a pipe end may already be fd 3 or 4, and dup2 onto itself would keep CLOEXEC
            a, b = os.dup(cmd_r), os.dup(ans_w)
            os.dup2(a, 3)
            os.dup2(b, 4)
        self.proc = subprocess.Popen(
            [str(chromium_binary()), "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync", "--hide-scrollbars",
             "--remote-debugging-pipe", f"--user-data-dir={self.profile}", "about:blank"],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, close_fds=False,
            preexec_fn=fds)
        os.close(cmd_r)
        os.close(ans_w)
        self.buf, self.next_id, self.session = b"", 0, None
        target = self.call("Target.createTarget", url="about:blank")["targetId"]
        self.session = self.call("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]
        self.call("Emulation.setDeviceMetricsOverride", width=width, height=height, deviceScaleFactor=1, mobile=False)
        self.call("Emulation.setEmulatedMedia", features=[{"name": "prefers-color-scheme",
                                                            "value": "dark" if dark else "light"}])
        self.call("Runtime.enable")

    def call(self, method, timeout=60, **params):
        self.next_id += 1
        msg = {"id": self.next_id, "method": method, "params": params}
        if self.session and not method.startswith("Target."):
            msg["sessionId"] = self.session
        os.write(self.cmd_w, json.dumps(msg).encode() + b"\0")
        deadline = time.time() + timeout
        while True:
            while b"\0" in self.buf:
                raw, self.buf = self.buf.split(b"\0", 1)
                m = json.loads(raw)
                if m.get("method") == "Runtime.exceptionThrown":
                    raise AssertionError(f"script error in the page: {m['params']}")
                if m.get("method") == "Runtime.consoleAPICalled":
                    raise AssertionError(f"the page logged to the console: {m['params']}")
                if m.get("id") == self.next_id:
                    assert "error" not in m, (method, m["error"])
                    return m["result"]
            left = deadline - time.time()
            assert left > 0, f"{method}: no answer from chromium"
            ready, _, _ = select.select([self.ans_r], [], [], left)
            if ready:
                chunk = os.read(self.ans_r, 1 << 20)
                assert chunk, f"chromium closed the pipe: {self.proc.stderr.read().decode()[-2000:]}"
                self.buf += chunk

    def js(self, expr):
        r = self.call("Runtime.evaluate", expression=expr, returnByValue=True, awaitPromise=True)
        assert "exceptionDetails" not in r, r
        return r["result"].get("value")

    def open(self, url, ready):
        """Loads url and waits (up to a minute) until the JS expression `ready` holds."""
        self.call("Page.navigate", url=url)
        deadline = time.time() + 60
        while not self.js("(() => { try { return !!(%s); } catch (e) { return false; } })()" % ready):
            assert time.time() < deadline, f"page not ready: {ready}"
            time.sleep(0.1)

    def hover(self, x, y):
        self.call("Input.dispatchMouseEvent", type="mouseMoved", x=x, y=y)

    def screenshot(self, out: Path) -> Image.Image:
        data = base64.b64decode(self.call("Page.captureScreenshot", format="png")["data"])
        assert data[:8] == b"\x89PNG\r\n\x1a\n", data[:16]
        out.write_bytes(data)
        return Image.open(io.BytesIO(data)).convert("RGB")

    def close(self):
        try:
            self.call("Browser.close", timeout=10)
        except AssertionError:
            pass
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        os.close(self.cmd_w)
        os.close(self.ans_r)
        shutil.rmtree(self.profile, ignore_errors=True)


# What the page must not show a person: raw state names, NaN, undefined, an invented round.
LAYOUT_JS = r"""(() => {
  const vw = document.documentElement.clientWidth, out = [];
  for (const el of document.querySelectorAll('main *, header *')) {
    if (el.closest('.tablewrap') || el.closest('[hidden]') || el.closest('svg') && el.tagName !== 'svg') continue;
    const r = el.getBoundingClientRect();
    if (r.width && r.right > vw + 0.5) out.push(el.tagName + '#' + el.id + '.' + el.className + ' right=' + r.right);
  }
  /* the lines an element's text occupies: its text nodes' boxes, a new line when a box starts lower */
  const lines = sel => [...document.querySelectorAll(sel)].filter(e => e.textContent.trim()).map(e => {
    const tops = [], walk = document.createTreeWalker(e, NodeFilter.SHOW_TEXT);
    for (let t = walk.nextNode(); t; t = walk.nextNode()) {
      const range = document.createRange(); range.selectNodeContents(t);
      for (const q of range.getClientRects()) if (q.width > 0) tops.push(q.top);
    }
    tops.sort((a, b) => a - b);
    let n = tops.length ? 1 : 0;
    for (let i = 1; i < tops.length; i++) if (tops[i] > tops[i - 1] + 4) n++;
    return [e.textContent.trim(), n];
  });
  /* a node id may end in an ellipsis (its title holds it); a step, a size, an age, a number never */
  const clipped = [...document.querySelectorAll('#round-nodes li > span, #last td:not(.id), .nodes-head > span')]
    .filter(e => e.scrollWidth > e.clientWidth + 1).map(e => e.textContent);
  const untitled = [...document.querySelectorAll('#round-nodes li > b, #last td.id, ul.legend li')]
    .filter(e => e.scrollWidth > e.clientWidth + 1 && e.getAttribute('title') !== e.textContent.trim()).map(e => e.textContent);
  return {viewport: vw, page: document.documentElement.scrollWidth, overflow: out, clipped: clipped, untitled: untitled,
          ids: lines('#round-nodes li > *, #last td, #leg-norm li, #round-missing li'),
          text: document.body.innerText};
})()"""

SERIES_JS = r"""(id => {
  const pts = [...document.querySelectorAll('#' + id + ' .point')];
  const top = {};
  for (const p of pts) {
    const r = p.getBoundingClientRect(), cx = r.left + r.width / 2, cy = r.top + r.height / 2;
    const s = p.getAttribute('data-series');
    if (!(s in top) && document.elementFromPoint(cx, cy) === p) top[s] = [cx, cy];
  }
  return pts.map(p => ({series: p.getAttribute('data-series'), fill: p.getAttribute('fill'),
                        shape: p.getAttribute('data-shape'), at: top[p.getAttribute('data-series')] || null}));
})"""


def rgb(hexcolor):
    return tuple(int(hexcolor[i:i + 2], 16) for i in (1, 3, 5))


def dist(a, b):
    return sum((x - y) ** 2 for x, y in zip(a, b)) ** 0.5


def check_layout(page, where):
    lay = page.js(LAYOUT_JS)
    assert lay["page"] <= lay["viewport"], (where, lay["page"], lay["viewport"], lay["overflow"][:10])
    assert not lay["overflow"], (where, lay["overflow"][:10])
    assert not lay["clipped"], (where, "cut short:", lay["clipped"])
    assert not lay["untitled"], (where, "cut short without the full text in a title:", lay["untitled"])
    wrapped = [t for t, n in lay["ids"] if n != 1]
    assert not wrapped, (where, "broken over lines:", wrapped)
    for bad in ("waiting_for_global", "retry_wait", "NaN", "undefined", "null"):
        assert bad not in lay["text"], (where, bad, lay["text"][:2000])
    return lay


NODES_MANY = [f"node-{i:02d}" for i in range(1, 17)] + ["gpu-host-with-a-rather-long-name-000017.cluster"]


def test_dashboard_many_nodes_narrow_and_dark(tmp_path):
    """17 nodes (past any 8- or 16-colour palette, one with a long id), two rounds: each series has its own
    colour and shape, drawn so in the screenshot; hovering one series dims the others; at 360 px wide
    nothing overflows and no node id or size breaks over lines; dark mode is dark."""
    shots = Path(os.environ.get("DASHBOARD_SCREENSHOT_DIR") or tmp_path)
    shots.mkdir(parents=True, exist_ok=True)
    model = small_model()
    write_model(tmp_path / "init.safetensors", model)
    n = len(NODES_MANY)
    d = Dilocod(tmp_path, None, "--init-model", str(tmp_path / "init.safetensors"), "--expected-nodes", str(n),
                "--nodes", ",".join(NODES_MANY), "--round-timeout", "600").start()
    try:
        url = d.url
        wait_status(url, lambda s: s["outer_step"] == 0, "bootstrap")
        rng = np.random.default_rng(9)
        for step in range(2):
            for i, node in enumerate(NODES_MANY):
                upload(url, node, step, 10 * (step + 1) + i, random_deltas(rng, model, scale=0.002 * (i + 1)))
            wait_status(url, lambda s, k=step + 1: s["outer_step"] == k, f"outer step {step + 1}")
        # a half-full round, so the delivered list holds the long id and a size
        upload(url, NODES_MANY[-1], 2, 99, random_deltas(rng, model))
        upload(url, NODES_MANY[0], 2, 98, random_deltas(rng, model))
        wait_status(url, lambda s: len(s["round"]["received"]) == 2, "two deltas in the open round")
        ready = "document.querySelectorAll('#plot-norm .point').length === %d && " \
                "document.querySelectorAll('#round-nodes li').length === 2" % (2 * n)
        for dark in (False, True):
            scheme = "dark" if dark else "light"
            page = Page(tmp_path, 1280, 1400, dark=dark)
            try:
                page.open(url + "/", ready)
                check_layout(page, f"1280 px {scheme}")
                pts = page.js(SERIES_JS + "('plot-norm')")
                looks = {(p["series"], p["fill"], p["shape"]) for p in pts}
                assert len(looks) == n and len({(f, sh) for _, f, sh in looks}) == n, looks   # one look per node
                fills = {f for _, f, _ in looks}
                assert len(fills) == n, f"{len(fills)} colours for {n} nodes"
                for a, b in itertools.combinations(sorted(fills), 2):
                    assert dist(rgb(a), rgb(b)) > 30, (a, b)
                assert len({sh for _, _, sh in looks}) >= 2, looks
                img = page.screenshot(shots / f"dashboard-{n}-nodes-{scheme}.png")
                bg = img.getpixel((3, img.height - 3))
                lum = sum(bg) / 3
                assert (lum < 60) if dark else (lum > 200), (scheme, bg)
                # each series' topmost marker is drawn in its own colour in the PNG
                tops = {p["series"]: (p["fill"], p["at"]) for p in pts if p["at"]}
                assert len(tops) >= n - 2, f"only {len(tops)} series have a visible marker"
                for series, (fill, (x, y)) in tops.items():
                    px = img.getpixel((int(x), int(y)))
                    assert dist(px, rgb(fill)) < 12, (scheme, series, fill, px)
                # hover the first series' marker: it is highlighted, the others fade towards the background
                first = sorted(tops)[0]
                other = sorted(tops)[-1]
                page.hover(*tops[first][1])
                state = page.js("""({hl: document.getElementById('plot-norm').classList.contains('hl'),
                    on: [...document.querySelectorAll('#plot-norm .series.on')].map(g => g.getAttribute('data-series')),
                    legend: [...document.querySelectorAll('#leg-norm li.on')].map(l => l.getAttribute('data-series')),
                    cos: [...document.querySelectorAll('#plot-cosine .series.on')].map(g => g.getAttribute('data-series'))})""")
                assert state == {"hl": True, "on": [first], "legend": [first], "cos": [first]}, state
                img2 = page.screenshot(shots / f"dashboard-{n}-nodes-{scheme}-hover.png")
                ox, oy = tops[other][1]
                faded = img2.getpixel((int(ox), int(oy)))
                assert dist(faded, rgb(tops[other][0])) > 20, (other, faded, tops[other][0])
                kept = img2.getpixel((int(tops[first][1][0]), int(tops[first][1][1])))
                assert dist(kept, rgb(tops[first][0])) < 12, (first, kept)
            finally:
                page.close()
        # narrow: a phone-sized viewport, light and dark
        for dark in (False, True):
            scheme = "dark" if dark else "light"
            page = Page(tmp_path, 360, 2400, dark=dark)
            try:
                page.open(url + "/", ready)
                lay = check_layout(page, f"360 px {scheme}")
                assert any(t.startswith("gpu-host-with") for t, _ in lay["ids"]), lay["ids"]
                page.screenshot(shots / f"dashboard-narrow-{scheme}.png")
            finally:
                page.close()
        # aggregation times under a second are shown in ms
        page = Page(tmp_path, 1280, 900)
        try:
            page.open(url + "/", ready)
            title = page.js("document.getElementById('t-time').textContent")
            rounds = requests.get(url + "/rounds", timeout=10).json()["rounds"]
            assert title == ("Aggregation time per round (ms)" if max(r["seconds"] for r in rounds) < 1
                             else "Aggregation time per round (s)"), title
            assert re.search(r"aggregation\s+[\d.]+ ms", page.js("document.getElementById('last').innerText")), \
                page.js("document.getElementById('last').innerText")
        finally:
            page.close()
    finally:
        assert d.stop(timeout=30) == 0, d.log_text()[-3000:]


def test_dashboard_before_any_global(tmp_path):
    """No global model yet (a file:// hub with nothing in it): the page says so in words, shows no
    invented round and no raw state name, in light and dark, wide and narrow."""
    shots = Path(os.environ.get("DASHBOARD_SCREENSHOT_DIR") or tmp_path)
    shots.mkdir(parents=True, exist_ok=True)
    hub = tmp_path / "hub"
    hub.mkdir()
    d = Dilocod(tmp_path, hub, "--expected-nodes", "2", "--nodes", "a,b").start()
    try:
        url = d.url
        assert status(url)["outer_step"] is None
        for (w, h), dark in itertools.product(((1280, 900), (360, 1600)), (False, True)):
            where = f"{w} px {'dark' if dark else 'light'}"
            page = Page(tmp_path, w, h, dark=dark)
            try:
                page.open(url + "/", "document.getElementById('state').getAttribute('data-state') !== null")
                lay = check_layout(page, where)
                got = page.js("""({state: document.getElementById('state').textContent,
                    step: document.getElementById('outer-step').textContent,
                    round: document.getElementById('round-summary').innerText,
                    bar: document.getElementById('round-bar').hidden,
                    hub: document.getElementById('hub').innerText})""")
                assert got["state"] == "waiting for a global model", (where, got)
                assert got["step"] == "none yet", (where, got)
                assert got["round"].startswith("No global model yet") and "--init-model" in got["round"], (where, got)
                assert "global/latest.safetensors" in got["round"] and got["bar"] is True, (where, got)
                assert not re.search(r"Round \d", lay["text"]), (where, lay["text"][:1500])
                assert "nothing yet" in got["hub"], (where, got)
                img = page.screenshot(shots / f"dashboard-nothing-yet-{w}-{'dark' if dark else 'light'}.png")
                lum = sum(img.getpixel((2, img.height - 2))) / 3
                assert (lum < 60) if dark else (lum > 200), (where, lum)
            finally:
                page.close()
    finally:
        assert d.stop(timeout=30) == 0, d.log_text()[-3000:]



ASYNC_JS = r"""(() => {
  const t = id => document.getElementById(id).textContent.trim();
  return {hidden: document.getElementById('async').hidden, mode: t('async-mode'), dn: t('async-dn'), queue: t('async-queue'),
          round: document.getElementById('round-summary').innerText, title: t('h-round'),
          kv: document.getElementById('async-kv').innerText,
          bars: [...document.querySelectorAll('#plot-staleness rect.hbar')].map(r => [r.getAttribute('data-le'), +r.getAttribute('data-count')]),
          nodes: [...document.querySelectorAll('#async-nodes tr')].map(tr => ({node: tr.getAttribute('data-node'),
            rec: tr.querySelector('td.rec').textContent, cells: [...tr.children].map(c => c.textContent)}))};
})()"""


def test_dashboard_async_panel(tmp_path):
    """--mode async, five updates from two nodes at different speeds (three deltas written into the
    file:// hub, two PUT), with mixed staleness: the panel shows the mode, the DN phase "2 of 3", the
    queue "0 of 5", the staleness histogram bucket by bucket and each node's deltas, speed and
    recommended local steps, as /status has them; nothing overflows at 1280 or 360 px.  Then a second
    dilocod with a grace window of an hour holds two PUT deltas: the queue shows "2 of 5"."""
    shots = Path(os.environ.get("DASHBOARD_SCREENSHOT_DIR") or tmp_path)
    shots.mkdir(parents=True, exist_ok=True)
    model = small_model()
    write_model(tmp_path / "init.safetensors", model)
    hub = tmp_path / "hub"
    d = Dilocod(tmp_path, hub, "--init-model", str(tmp_path / "init.safetensors"), "--mode", "async",
                "--expected-nodes", "2", "--dn-period", "3", "--grace-ms", "0", "--async-queue", "5",
                "--max-staleness", "4", "--dylu-base-steps", "40").start()
    try:
        url = d.url
        wait_status(url, lambda s: s["outer_step"] == 0, "bootstrap")
        rng = np.random.default_rng(4)
        # (node, base step, local step): node-a does 10 local steps per delta, node-b 5; taus 0, 1, 1, 1, 3
        plan = [("node-a", 0, 10), ("node-b", 0, 5), ("node-a", 1, 20), ("node-a", 2, 30), ("node-b", 1, 10)]
        for i, (node, base, local) in enumerate(plan):
            tensors = random_deltas(rng, model, scale=0.01)
            if i < 3:
                write_delta(hub, node, base, local, tensors)
            else:
                assert upload(url, node, base, local, tensors)["result"] == "accepted"
            wait_status(url, lambda s, k=i + 1: s["outer_step"] == k and s["async"]["updates"] == k, f"update {i + 1}")
        st = status(url)
        a = st["async"]
        assert st["mode"] == "async" and a["dn"]["k"] == 2 and a["dn"]["period"] == 3, a
        assert a["queue"]["pending"] == 0 and a["queue"]["max"] == 5, a["queue"]
        hist = a["staleness"]["histogram"]
        assert (hist["0"], hist["1"], hist["3"], sum(hist.values())) == (1, 3, 1, 5), hist
        want_rec = {n["node_id"]: n["recommended_local_steps"] for n in a["nodes"]}
        assert want_rec["node-a"] >= 1 and want_rec["node-b"] >= 1 and set(want_rec) == {"node-a", "node-b"}, a["nodes"]
        ready = "document.querySelectorAll('#async-nodes tr').length === 2 && " \
                "document.querySelectorAll('#plot-staleness rect.hbar').length === 9"
        for (w, h), dark in (((1280, 1400), False), ((360, 2600), True)):
            where = f"{w} px {'dark' if dark else 'light'}"
            page = Page(tmp_path, w, h, dark=dark)
            try:
                page.open(url + "/", ready)
                check_layout(page, where)
                got = page.js(ASYNC_JS)
                assert got["hidden"] is False and got["mode"] == "async", (where, got)
                assert got["dn"] == "2 of 3" and got["queue"] == "0 of 5", (where, got)
                assert got["title"] == "Open update" and got["round"].startswith("Update 5"), (where, got)
                assert "max τ\t4" in got["kv"] or "max τ\n4" in got["kv"], (where, got["kv"])
                assert dict(got["bars"]) == hist and [le for le, _ in got["bars"]] == \
                    ["0", "1", "2", "3", "7", "15", "31", "63", "+Inf"], (where, got["bars"])
                rows = {r["node"]: r for r in got["nodes"]}
                assert {n: r["rec"] for n, r in rows.items()} == {n: str(v) for n, v in want_rec.items()}, (where, rows)
                # node, deltas, local step, last tau, steps/delta, speed, recommended, last delta
                assert rows["node-a"]["cells"][1:5] == ["3", "30", "1", "10"], rows["node-a"]
                assert rows["node-b"]["cells"][1:5] == ["2", "10", "3", "5"], rows["node-b"]
                assert all(re.fullmatch(r"[\d.e+]+/s", r["cells"][5]) for r in rows.values()), rows
                # the history speaks of updates, not rounds
                words = page.js("""({wall: document.getElementById('t-wall').textContent, card: document.getElementById('l-wall').textContent,
                    loss: document.getElementById('l-loss').textContent, hist: document.getElementById('hist-n').textContent,
                    axis: [...document.querySelectorAll('#plot-norm text')].map(t => t.textContent),
                    counters: document.getElementById('counters').innerText, train: document.getElementById('training').innerText})""")
                assert words["wall"] == "Update wall-clock" and words["card"] == "Update wall-clock", (where, words)
                assert words["loss"] == "Mean loss, last update" and words["hist"] == "(last 5 updates, from the history)", (where, words)
                assert "update (base outer step)" in words["axis"], (where, words["axis"])
                assert re.search(r"updates committed\s+5\b", words["counters"]), (where, words["counters"])
                assert not re.search(r"\bround", words["train"], re.I), (where, words["train"])
                page.screenshot(shots / f"dashboard-async-{w}-{'dark' if dark else 'light'}.png")
            finally:
                page.close()
    finally:
        assert d.stop(timeout=30) == 0, d.log_text()[-3000:]

    # deltas held by a long grace window: the queue depth is theirs
    tmp2 = tmp_path / "held"
    tmp2.mkdir()
    d = Dilocod(tmp2, None, "--init-model", str(tmp_path / "init.safetensors"), "--mode", "async",
                "--expected-nodes", "2", "--dn-period", "2", "--grace-ms", "3600000", "--async-queue", "5").start()
    try:
        url = d.url
        wait_status(url, lambda s: s["outer_step"] == 0, "bootstrap")
        for node in ("node-a", "node-b"):
            assert upload(url, node, 0, 7, random_deltas(rng, model))["result"] == "accepted"
        st = wait_status(url, lambda s: s["async"]["queue"]["pending"] == 2, "two deltas pending")
        assert st["outer_step"] == 0 and st["async"]["updates"] == 0, st["async"]
        page = Page(tmp_path, 1280, 1000)
        try:
            page.open(url + "/", "document.getElementById('async-queue').textContent === '2 of 5'")
            got = page.js(ASYNC_JS)
            assert got["dn"] == "0 of 2" and got["round"].startswith("Update 0") and "2 deltas" in got["round"], got
            # the histogram counts deltas when they are accepted, before their update
            assert st["async"]["staleness"]["histogram"]["0"] == 2, st["async"]
            assert dict(got["bars"]) == st["async"]["staleness"]["histogram"], got["bars"]
            check_layout(page, "held deltas")
        finally:
            page.close()
    finally:
        assert d.stop(timeout=30) == 0, d.log_text()[-3000:]


def test_dashboard_shows_a_quarantined_node_and_the_loss_plot(tmp_path):
    """--max-norm-ratio 10 and three nodes, one sending its delta x 100 (refused 422 outlier): the page
    shows the quarantined panel with that node, its norm above its bound and the reason, and the loss
    plot still draws the honest nodes' series and their mean."""
    chromium_binary()
    model = small_model()
    write_model(tmp_path / "init.safetensors", model)
    d = Dilocod(tmp_path, None, "--init-model", str(tmp_path / "init.safetensors"), "--expected-nodes", "3",
                "--round-timeout", "0.5", "--min-nodes", "2", "--max-norm-ratio", "10").start()
    try:
        url = d.url
        wait_status(url, lambda s: s["outer_step"] == 0, "bootstrap")
        rng = np.random.default_rng(4)
        for step in range(2):
            for i, node in enumerate(("n0", "n1")):
                upload(url, node, step, step + 1, random_deltas(rng, model), {"loss": str(2.0 - step + i / 10)})
            bad = {k: v * np.float32(100) for k, v in random_deltas(rng, model).items()}
            blob = np_save(bad, metadata=dict(delta_metadata("bad", step, step + 1), loss="2.0"))
            with session() as s:
                r = s.put(f"{url}/nodes/bad/delta_{step + 1}.safetensors", data=blob, timeout=30)
            assert r.status_code == 422 and r.json()["error"]["code"] == "outlier", r.text
            wait_status(url, lambda s, n=step + 1: s["outer_step"] == n, f"outer step {step + 1}")
        st = status(url)["robust"]
        assert st["quarantined_total"] == 2 and {q["node_id"] for q in st["quarantined"]} == {"bad"}
        dom = Dom(dump_dom(tmp_path, url + "/"))
        panel = dom.by_id("quarantined")
        assert panel is not None and "hidden" not in panel.attrs, panel.attrs if panel else None
        assert dom.by_id("quar-n").text_content().strip() == "2"
        rows = [n for n in dom.by_id("quar-rows").iter() if n.tag == "tr"]
        assert [r.attrs.get("data-node") for r in rows] == ["bad", "bad"]
        # the Deltas card counts the two 422 outliers as refused (it once summed four reasons and said 0)
        card = [n.text_content().strip() for n in dom.by_id("counters").iter() if n.tag in ("dt", "dd")]
        shown = dict(zip(card[0::2], card[1::2]))
        assert shown["refused"] == "2" and shown["rejected"] == "0", shown
        assert status(url)["counters"]["refused"] == status(url)["counters"]["outlier"] == 2
        with session() as s:
            doc = s.get(f"{url}/nodes/bad", timeout=30).json()
        assert doc["counts"] == {"outlier": 2} and [r["verdict"] for r in doc["deltas"]] == ["quarantined"] * 2, doc
        cells = [c.text_content() for c in rows[0].children]
        assert "norm ratio" in cells and float(cells[3]) > float(cells[4]) > 0, cells
        series = {p.attrs.get("data-series") for p in dom.by_id("plot-loss").iter() if "point" in p.classes()}
        assert {"n0", "n1"} <= series and "bad" not in series, series
        assert len(series) == 3, series          # n0, n1 and their mean: points are aggregated deltas
        # "bad" never had a delta aggregated, yet it stays on the loss plot: its series, marked at each round
        groups = {g.attrs["data-series"]: g for g in dom.by_id("plot-loss").iter() if "series" in g.classes()}
        marks = sorted(g.attrs["data-step"] for g in groups["bad"].iter() if "qmark" in g.classes())
        assert marks == ["0", "1"], marks
        assert "bad" in [c.text_content() for c in dom.by_id("leg-loss").children]
        # the records keep the deltas refused at their offer (422), so a restart still shows them
        with session() as s:
            rounds = s.get(url + "/rounds", timeout=10).json()["rounds"]
        assert [[q["node_id"] for q in r.get("refused", [])] for r in rounds] == [["bad"], ["bad"]], rounds
        assert [r["quarantined"] for r in rounds] == [[], []], rounds       # never in the round: refused
    finally:
        assert d.stop(timeout=30) == 0, d.log_text()[-3000:]


def test_dashboard_shows_each_nodes_encoding_and_bytes(tmp_path):
    """A round of one mxfp4 node (diloco's format, compress_oracle.py) and one F32 node: the last round's
    table names each node's encoding ("plain" for F32) and its bytes on the wire."""
    import compress_oracle as co
    chromium_binary()
    model = small_model()
    write_model(tmp_path / "init.safetensors", model)
    d = Dilocod(tmp_path, None, "--init-model", str(tmp_path / "init.safetensors"), "--expected-nodes", "2").start()
    try:
        url = d.url
        wait_status(url, lambda s: s["outer_step"] == 0, "bootstrap")
        rng = np.random.default_rng(8)
        upload(url, "f32", 0, 1, random_deltas(rng, model))
        blob, _ = co.compressed_delta("mxfp4", 32, random_deltas(rng, model), delta_metadata("fp4", 0, 1))
        with session() as s:
            r = s.put(f"{url}/nodes/fp4/delta_1.safetensors", data=blob, timeout=30)
        assert r.status_code == 201, r.text
        wait_status(url, lambda s: s["outer_step"] == 1, "outer step 1")
        dom = Dom(dump_dom(tmp_path, url + "/"))
        rows = {r.attrs.get("data-node"): r for r in dom.by_id("last-nodes").iter() if r.tag == "tr" and r.attrs.get("data-node")}
        assert set(rows) == {"f32", "fp4"}, rows
        enc = {n: [c for c in r.children if "enc" in c.classes()][0].text_content() for n, r in rows.items()}
        assert enc == {"f32": "plain", "fp4": "mxfp4"}, enc
        sizes = {n: int([c for c in r.children if c.attrs.get("title", "").endswith(" bytes")][0].attrs["title"].split()[0])
                 for n, r in rows.items()}
        assert sizes["fp4"] == len(blob) and sizes["fp4"] * 5 < sizes["f32"], sizes
    finally:
        assert d.stop(timeout=30) == 0, d.log_text()[-3000:]


# ---- the trainer's view: the first screen, quarantines kept on the plots, a restart ------------------------

TRAINERS = ("w0", "w1", "w2")
T_ROUNDS = 4
T_QUARANTINED = ("w2", 2)           # w2's delta of round 2 is 100 x too large: refused 422 outlier
T_LOSS = {(s, w): round(4.0 - 0.4 * s + 0.15 * i * i, 3) for s in range(T_ROUNDS) for i, w in enumerate(TRAINERS)}
T_TOKENS = {(s, w): 1000 * (i + 1) + 7 * s for s in range(T_ROUNDS) for i, w in enumerate(TRAINERS)}
T_GAP = 0.25                        # seconds between one worker's delta and the next one's

TRAINER_JS = r"""(() => {
  const t = id => document.getElementById(id).textContent.trim();
  const box = id => { const r = document.getElementById(id).getBoundingClientRect();
                      return {left: r.left, top: r.top, right: r.right, bottom: r.bottom}; };
  const center = e => { const r = e.getBoundingClientRect(); return [r.left + r.width / 2, r.top + r.height / 2]; };
  return {
    vw: document.documentElement.clientWidth, vh: window.innerHeight, loss: box('plot-loss'), wall: box('plot-wall'), tps: box('plot-tps'),
    points: [...document.querySelectorAll('#plot-loss .point')].map(p => ({series: p.getAttribute('data-series'),
      step: +p.getAttribute('data-step'), fill: p.getAttribute('fill'), title: p.textContent, at: center(p),
      top: document.elementFromPoint(...center(p)) === p})),
    qmarks: Object.fromEntries(['plot-loss', 'plot-norm'].map(id => [id, [...document.querySelectorAll('#' + id + ' g.qmark')].map(g =>
      ({series: g.getAttribute('data-series'), step: +g.getAttribute('data-step'), title: g.textContent, at: center(g.querySelector('path.qx')),
        ring: g.querySelector('circle').getAttribute('stroke'), inSeries: g.parentNode.getAttribute('data-series')}))])),
    legend: [...document.querySelectorAll('#leg-loss li')].map(l => l.textContent),
    stacks: [...document.querySelectorAll('#plot-wall g.stack')].map(g => ({step: +g.getAttribute('data-step'), seconds: +g.getAttribute('data-seconds'),
      parts: Object.fromEntries([...g.querySelectorAll('rect.seg')].map(r => [r.getAttribute('data-part'), +r.getAttribute('data-seconds')]))})),
    tpsPts: [...document.querySelectorAll('#plot-tps .point')].map(p => ({series: p.getAttribute('data-series'), step: +p.getAttribute('data-step')})),
    tokens: t('tokens-seen'), tokensExact: document.getElementById('tokens-seen').title, lossNow: t('loss-now'),
    tpsNow: t('tps-now'), wallNow: t('wall-now'), waitNow: t('wait-now'), since: t('since'), counters: document.getElementById('counters').innerText,
    quarRows: [...document.querySelectorAll('#quar-rows tr')].map(r => [r.getAttribute('data-node'), r.getAttribute('data-step')]),
    quarHidden: document.getElementById('quarantined').hidden,
    order: ['training', 'deltas', 'h-pass', 'h-config'].map(id => document.getElementById(id).getBoundingClientRect().top + window.scrollY),
  };
})()"""


def trainer_round(url, rng, model, step):
    """One round: each worker's delta T_GAP after the previous one's, its loss and num_tokens in the metadata;
    the quarantined one 100 x too large (422 outlier).  Returns when the round is committed."""
    for i, w in enumerate(TRAINERS):
        if i:
            time.sleep(T_GAP)
        t = random_deltas(rng, model, scale=0.01)
        meta = {"loss": str(T_LOSS[(step, w)]), "num_tokens": str(T_TOKENS[(step, w)])}
        if (w, step) == T_QUARANTINED:
            t = {k: v * np.float32(100) for k, v in t.items()}
            blob = np_save(t, metadata=dict(delta_metadata(w, step, 10 * (step + 1) + i), **meta))
            with session() as s:
                r = s.put(f"{url}/nodes/{w}/delta_{10 * (step + 1) + i}.safetensors", data=blob, timeout=30)
            assert r.status_code == 422 and r.json()["error"]["code"] == "outlier", r.text
        else:
            upload(url, w, step, 10 * (step + 1) + i, t, meta)
    wait_status(url, lambda s: s["outer_step"] == step + 1, f"outer step {step + 1}")


def check_trainer_page(page, shots, name, want_tokens, timed_steps):
    """The trainer's first screen at 1280x800 and what the plots hold; returns what the page showed."""
    got = page.js(TRAINER_JS)
    # the first screen holds the loss plot (and the wall-clock and tokens/s plots), not scrolled to
    assert got["vw"] == 1280 and got["vh"] == 800, got
    for plot in ("loss", "wall", "tps"):
        b = got[plot]
        assert 0 <= b["left"] < b["right"] <= 1280 and 0 <= b["top"] < b["bottom"] <= 800, (name, plot, b)
    assert got["order"] == sorted(got["order"]), (name, "sections out of order", got["order"])
    img = page.screenshot(shots / f"dashboard-trainer-{name}.png")
    assert img.size == (1280, 800), img.size
    b = got["loss"]
    crop = img.crop((int(b["left"]), int(b["top"]), int(b["right"]), int(b["bottom"])))
    bg = crop.getpixel((2, 2))
    px = np.asarray(crop).reshape(-1, 3).astype(int)
    inked = (np.abs(px - np.array(bg)).sum(axis=1) > 60).mean()
    assert inked > 0.01, (name, "the loss plot is blank in the screenshot", inked)
    # per-worker loss: every value each worker sent for an aggregated delta, at its round, and the mean
    pts = {(p["series"], p["step"]): p for p in got["points"]}
    want = {(w, s): v for (s, w), v in T_LOSS.items() if (w, s) != T_QUARANTINED}
    assert set(pts) == set(want) | {("mean", s) for s in range(T_ROUNDS)}, (name, sorted(pts))
    for key, v in want.items():
        shown = float(pts[key]["title"].rsplit(":", 1)[1])
        assert abs(shown - v) <= 1e-6 * abs(v), (name, key, pts[key]["title"], v)
    for s in range(T_ROUNDS):
        vals = [v for (st_, w), v in T_LOSS.items() if st_ == s and (w, s) != T_QUARANTINED]
        assert abs(float(pts[("mean", s)]["title"].rsplit(":", 1)[1]) - sum(vals) / len(vals)) < 1e-4, (name, s)
    # each worker's markers are drawn in the screenshot in its colour
    for w in TRAINERS:
        p = next(p for p in got["points"] if p["series"] == w and p["top"])
        x, y = p["at"]
        near = min(dist(img.getpixel((int(x) + dx, int(y) + dy)), rgb(p["fill"])) for dx in (-1, 0, 1) for dy in (-1, 0, 1))
        assert near < 25, (name, w, p["fill"], img.getpixel((int(x), int(y))))
    # the quarantined worker stays on the plots: its series goes on after the round, marked at that round
    w, s = T_QUARANTINED
    assert w in got["legend"], (name, got["legend"])
    assert {st_ for (ser, st_) in pts if ser == w} == {x for x in range(T_ROUNDS) if x != s}, (name, sorted(pts))
    for plot in ("plot-loss", "plot-norm"):
        marks = got["qmarks"][plot]
        assert [(m["series"], m["step"], m["inSeries"]) for m in marks] == [(w, s, w)], (name, plot, marks)
        assert "quarantined" in marks[0]["title"] and "norm ratio" in marks[0]["title"], (name, plot, marks[0])
    m = got["qmarks"]["plot-loss"][0]
    assert m["ring"] == next(p["fill"] for p in got["points"] if p["series"] == w), (name, m)
    x, y = m["at"]
    red = min(dist(img.getpixel((int(x) + dx, int(y) + dy)), (0xb3, 0x26, 0x1e)) for dx in (-1, 0, 1) for dy in (-1, 0, 1))
    assert red < 40, (name, "no quarantine cross drawn at", m["at"], img.getpixel((int(x), int(y))))
    assert not got["quarHidden"] and (w, str(s)) in [tuple(r) for r in got["quarRows"]], (name, got["quarRows"])
    # tokens seen: the num_tokens of every aggregated delta (the quarantined one's never trained)
    assert int(got["tokensExact"].split()[0]) == want_tokens, (name, got["tokens"], got["tokensExact"], want_tokens)
    # the round wall-clock: a bar per timed round; the wait for the slowest is the workers' spread
    bars = {b["step"]: b for b in got["stacks"]}
    assert set(timed_steps) <= set(bars), (name, sorted(bars), timed_steps)
    for step in timed_steps:
        parts = bars[step]["parts"]
        # the last delta is the third worker's, refused or not (the refused one's arrival is in the record)
        assert 2 * T_GAP * 0.9 <= parts["wait"] < 2 * T_GAP + 5, (name, step, parts)
        assert abs(sum(parts.values()) - bars[step]["seconds"]) < 1e-6, (name, step, parts)
    # round 2 waited for a third delta until its timeout (2 s after its first delta); the others closed at once
    if s in timed_steps:
        assert bars[s]["parts"]["close"] >= 0.5, (name, bars[s])
        assert all(bars[x]["parts"]["close"] < 0.5 for x in timed_steps if x != s), (name, bars)
    assert {p["series"] for p in got["tpsPts"]} == {"tps"} and len(got["tpsPts"]) >= len(timed_steps) - 1, (name, got["tpsPts"])
    assert re.fullmatch(r"[\d,.]+( [MB])?", got["tpsNow"]) and re.fullmatch(r"[\d.]+ (ms|s)", got["wallNow"]), (name, got)
    return got


def test_dashboard_for_trainers_first_screen_quarantine_and_restart(tmp_path):
    """Three workers, four rounds, each worker's delta a quarter of a second after the previous one's, each
    reporting its loss and num_tokens; w2's delta of round 2 is refused as an outlier.  At 1280x800 the first
    screen (no scrolling) holds the loss, round wall-clock and tokens/s plots: the loss plot's box lies in the
    viewport and its pixels are not blank in the screenshot; the loss plot holds every value the workers sent,
    at its round, with their mean; w2 stays plotted, marked at round 2 (a red cross in its series' ring, on the
    loss and the norm plots); tokens seen is the sum of the aggregated deltas' num_tokens; each round's bar has
    the wait for the slowest worker (the workers' spread).  Then dilocod restarts (its first record rewritten
    as an older dilocod wrote it, without times): the same panels come back from the history, the record
    without times keeps its loss points, and the counters say they count since the new start."""
    chromium_binary()
    shots = Path(os.environ.get("DASHBOARD_SCREENSHOT_DIR") or tmp_path)
    shots.mkdir(parents=True, exist_ok=True)
    model = small_model()
    write_model(tmp_path / "init.safetensors", model)
    args = ("--init-model", str(tmp_path / "init.safetensors"), "--expected-nodes", "3", "--min-nodes", "2",
            "--round-timeout", "2", "--max-norm-ratio", "10")
    d = Dilocod(tmp_path, None, *args).start()
    ready = "document.querySelectorAll('#plot-loss .point').length === %d && " \
            "document.querySelectorAll('#plot-loss g.qmark').length === 1 && " \
            "document.getElementById('tokens-seen').title !== ''" % (len(T_LOSS) - 1 + T_ROUNDS)
    want_tokens = sum(v for (s, w), v in T_TOKENS.items() if (w, s) != T_QUARANTINED)
    try:
        url = d.url
        wait_status(url, lambda s: s["outer_step"] == 0, "bootstrap")
        rng = np.random.default_rng(36)
        for step in range(T_ROUNDS):
            trainer_round(url, rng, model, step)
        with session() as s:
            rounds = s.get(url + "/rounds", timeout=10).json()["rounds"]
        assert [r["step"] for r in rounds] == list(range(T_ROUNDS))
        # the records hold the times: opened (not the first round of the process), closed, each arrival
        assert "opened_unix" not in rounds[0] and all("opened_unix" in r for r in rounds[1:]), rounds
        for r in rounds:
            arr = [n["received_unix"] for n in r["nodes"]] + [q["received_unix"] for q in r.get("refused", [])]
            assert len(arr) == 3 and max(arr) - min(arr) >= 2 * T_GAP * 0.9, r
            assert r.get("opened_unix", min(arr)) <= min(arr) <= max(arr) <= r["closed_unix"], r
        assert [(q["node_id"], q["reason"]) for q in rounds[2]["refused"]] == [("w2", "norm_ratio")], rounds[2]
        assert all(r["quarantined"] == [] for r in rounds) and all("refused" not in r for r in rounds if r["step"] != 2), rounds
        before = status(url)
        assert sum(w["tokens_total"] for w in before["workers"]) == want_tokens, before["workers"]
        page = Page(tmp_path, 1280, 800)
        try:
            page.open(url + "/", ready)
            check_layout(page, "trainer 1280 px")
            got = check_trainer_page(page, shots, "live", want_tokens, range(T_ROUNDS))
            assert before["started_at"][:19].replace("T", " ") in got["since"], (got["since"], before["started_at"])
            assert re.search(r"accepted\s+11\b", got["counters"]) and re.search(r"quarantined\s+1\b", got["counters"]), got["counters"]
        finally:
            page.close()
    finally:
        assert d.stop(timeout=30) == 0, d.log_text()[-3000:]

    # the first record as a dilocod before the times were kept wrote it
    path = d.state_dir / "rounds.jsonl"
    lines = path.read_text().splitlines()
    old = json.loads(lines[0])
    for n in old["nodes"]:
        del n["received_unix"]
    del old["closed_unix"]
    lines[0] = json.dumps(old, separators=(",", ":"))
    path.write_text("\n".join(lines) + "\n")
    time.sleep(1.1)                     # a start time another second than the first process's
    d.start()
    try:
        url = d.url
        after = wait_status(url, lambda s: s["outer_step"] == T_ROUNDS, "restart")
        assert after["started_at"] != before["started_at"] and after["counters"]["accepted"] == 0, after["counters"]
        page = Page(tmp_path, 1280, 800)
        try:
            page.open(url + "/", ready)
            got = check_trainer_page(page, shots, "restarted", want_tokens, range(1, T_ROUNDS))
            assert 0 not in {b["step"] for b in got["stacks"]}, got["stacks"]    # no times in that record: no bar
            assert after["started_at"][:19].replace("T", " ") in got["since"], (got["since"], after["started_at"])
            assert re.search(r"accepted\s+0\b", got["counters"]), got["counters"]
            assert re.search(r"rounds committed\s+0\b", got["counters"]), got["counters"]
        finally:
            page.close()
    finally:
        assert d.stop(timeout=30) == 0, d.log_text()[-3000:]


def test_dashboard_writes_server_strings_as_text(tmp_path):
    """A string the server passes through (the hub's URL, a path the operator chose) full of markup reaches
    the page as text: no element made of it, no script run, the text shown as it is."""
    chromium_binary()
    model = small_model()
    write_model(tmp_path / "init.safetensors", model)
    evil = "<img src=x onerror=\"window.__xss=1\">&amp;<b id=xss>"
    hub = tmp_path / evil
    hub.mkdir()
    d = Dilocod(tmp_path, hub, "--init-model", str(tmp_path / "init.safetensors"), "--expected-nodes", "1").start()
    try:
        url = d.url
        wait_status(url, lambda s: s["outer_step"] == 0, "bootstrap")
        assert evil in status(url)["hub"]["url"]
        upload(url, "n0", 0, 1, random_deltas(np.random.default_rng(1), model), {"loss": "1.5", "num_tokens": "10"})
        wait_status(url, lambda s: s["outer_step"] == 1, "outer step 1")
        page = Page(tmp_path, 1280, 900)
        try:
            page.open(url + "/", "document.querySelectorAll('#plot-loss .point').length === 2")
            time.sleep(0.5)
            got = page.js("""({xss: window.__xss === undefined ? null : window.__xss, imgs: document.querySelectorAll('img').length,
                               b: document.getElementById('xss') === null, hub: document.getElementById('hub').textContent})""")
            assert got["xss"] is None and got["imgs"] == 0 and got["b"], got
            assert evil in got["hub"], got["hub"]
        finally:
            page.close()
    finally:
        assert d.stop(timeout=30) == 0, d.log_text()[-3000:]
