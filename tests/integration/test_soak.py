"""Soak: SOAK_ROUNDS rounds (default 100; `make soak` runs 1,000) of a small model through dilocod over
HTTP uploads and the file:// tree together, with the chaos client (chaos.py) misbehaving beside them the
whole time (capped at CHAOS_SECONDS when that is set).  Nodes h0 and h1 pull the global and PUT their
deltas over HTTP; f0 and f1 read <hub>/global/ and write <hub>/nodes/<id>/delta_<n>.safetensors (f0 with
temp file + rename, f1 in place every third round, so dilocod also sees files being written); a "junk"
writer drops one bad file per round into <hub>/nodes/junk/ (garbage, corrupt header, stale step, NaN).

Every round: the global published in the hub and the one served over HTTP equal the torch oracle
(dilocod_proc.Oracle) bit for bit, and only h0, h1, f0, f1 ever take part.  After every round the
daemon's open descriptors (all, and non-socket ones), RSS (VmRSS), CPU time and the state root's size
(du) are sampled; the curves go to <tmp>/soak.csv and a summary is printed.

Bounds, on the samples after a warm-up (the first WARMUP_FRACTION of rounds, at least 5), comparing the
mean of the last 20% with the mean of the first 20%:
  - non-socket descriptors: growth <= OTHER_FD_ALLOWANCE (8) (files, pipes: a leak would be a dup per
    response or a temp file per upload);
  - all descriptors: growth <= FD_ALLOWANCE (48) (sockets come and go with the chaos client);
  - RSS: growth <= RSS_ALLOWANCE_MIB (8 MiB; 64 on sanitizer builds, whose quarantine fills up);
  - state root: no retention policy exists yet, so each round leaves its deltas and step files behind;
    growth must be at most linear: the least-squares slope, and the per-round growth between the two
    windows, at most state_bound_kib() per round (stated in the output), and the last window's slope no
    more than 1.5x the first's (no acceleration).
After the soak: the chaos client saw no violation, every probe (a fresh client, each second) was served
within PROBE_SECONDS, descriptors return within 16 of the pre-soak baseline, no sanitizer report, and
SIGTERM exits 0."""
import csv
import math
import os
import random
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch
from safetensors.numpy import save_file as np_save_file
from safetensors.torch import load as torch_load_bytes

from conftest import BUILD
from dilocod_proc import Oracle, load_torch, write_delta
from test_chaos import (FD_SLACK, PROBE_SECONDS, SANITIZED, ChaosProcess, Prober, assert_matches_oracle,
                        cpu_seconds, du_kib, fd_kinds, get_global, get_global_after_status, open_fds, rss_kib,
                        sanitizer_reports, start_daemon, status, upload, wait_outer_step)

SOAK_ROUNDS = int(os.environ.get("SOAK_ROUNDS", "100"))
# a node "trains" for a random 0..2*PACE seconds between its pull and its push, so rounds stay open
# with partial deliveries while the chaos runs (a round takes ~1.6*PACE): ~2-3 min for 100 rounds
SOAK_PACE = float(os.environ.get("SOAK_PACE", "0.75"))
SOAK_CHAOS = os.environ.get("SOAK_CHAOS", "1") != "0"     # SOAK_CHAOS=0: a control run without the chaos
CHAOS_CAP = float(os.environ["CHAOS_SECONDS"]) if os.environ.get("CHAOS_SECONDS") else None
WARMUP_FRACTION = 0.1
WINDOW_FRACTION = 0.2
OTHER_FD_ALLOWANCE = 8
FD_ALLOWANCE = 48
RSS_ALLOWANCE_MIB = 64 if SANITIZED else 8
HTTP_NODES = ["h0", "h1"]
FILE_NODES = ["f0", "f1"]
NODES = HTTP_NODES + FILE_NODES


def soak_model():
    """A few KiB: F32, BF16, F16 weights and an I64 buffer."""
    g = torch.Generator().manual_seed(11)
    return {
        "layer.weight": torch.randn(32, 16, generator=g),
        "layer.bias": torch.randn(16, generator=g),
        "emb": torch.randn(10, 8, generator=g).to(torch.bfloat16),
        "head": torch.randn(8, 4, generator=g).to(torch.float16),
        "count": torch.tensor([3, -1, 1 << 40], dtype=torch.int64),
    }


def round_deltas(model, rnd):
    out = {}
    for i, node in enumerate(NODES):
        rng = np.random.default_rng([rnd, i, 5])
        out[node] = {k: np.asarray(rng.standard_normal(tuple(v.shape)) * 0.01 * (1 + (rnd + i) % 4), np.float32)
                     for k, v in model.items() if v.is_floating_point()}
    return out


def junk_file(hub: Path, model, rnd, step):
    """One bad file a round from a misbehaving shared-tree writer; none may ever be accepted."""
    d = hub / "nodes" / "junk"
    d.mkdir(parents=True, exist_ok=True)
    path = d / f"delta_{rnd + 1}.safetensors"
    kind = rnd % 4
    rng = np.random.default_rng(rnd)
    tensors = {k: np.asarray(rng.standard_normal(tuple(v.shape)) * 0.01, np.float32)
               for k, v in model.items() if v.is_floating_point()}
    meta = {"algorithm": "dumb_diloco", "base_outer_step": str(step), "local_step": str(rnd + 1), "node_id": "junk"}
    if kind == 0:
        path.write_bytes(rng.bytes(int(rng.integers(1, 4000))))
    elif kind == 1:
        tmp = d / ".junk.tmp"
        np_save_file(tensors, str(tmp), metadata=meta)
        blob = bytearray(tmp.read_bytes())
        blob[8:12] = b"{\"x\x00"
        tmp.write_bytes(bytes(blob))
        os.rename(tmp, path)
    elif kind == 2:
        meta["base_outer_step"] = str(max(0, step - 1)) if step > 0 else "999999999"
        np_save_file(tensors, str(d / ".junk.tmp"), metadata=meta)
        os.rename(d / ".junk.tmp", path)
    else:
        k = sorted(tensors)[0]
        tensors[k].reshape(-1)[rnd % tensors[k].size] = np.nan
        np_save_file(tensors, str(d / ".junk.tmp"), metadata=meta)
        os.rename(d / ".junk.tmp", path)


def state_bound_kib(model_bytes, delta_bytes, nodes):
    """What one round may add to the state root with every round's files kept: per node a cached delta
    (rounded up to 4 KiB blocks, plus a directory), the step's global and momentum files, the step's
    delta directory, a rounds.jsonl line and metadata; doubled for slack (block rounding, journals)."""
    blk = lambda n: 4 * math.ceil(n / 4096)   # noqa: E731
    per_round = nodes * (blk(delta_bytes) + 4) + 2 * blk(model_bytes) + 4 + 4
    return 2 * per_round


def mean(xs):
    return sum(xs) / len(xs)


def slope(xs, ys):
    n = len(xs)
    if n < 2:
        return 0.0
    mx, my = mean(xs), mean(ys)
    den = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / den if den else 0.0


def test_soak_http_and_files_with_chaos(tmp_path):
    model = soak_model()
    hub = tmp_path / "hub"
    hub.mkdir()
    d, url = start_daemon(tmp_path, model, hub=hub, nodes=NODES)
    pid = d.proc.pid
    oracle = Oracle(model)
    want = {k: v.clone() for k, v in model.items()}
    lagging = []
    samples = []
    chaos = prober = None
    # /healthz answers before the bootstrap job has read --init-model's header: wait for the model
    deadline = time.monotonic() + 30
    while (st0 := status(url))["model"] is None:
        assert time.monotonic() < deadline and d.alive(), d.log_text()[-3000:]
        time.sleep(0.02)
    model_bytes, delta_bytes = st0["model"]["bytes"], st0["model"]["delta_bytes"]
    bound = state_bound_kib(model_bytes, delta_bytes, len(NODES))

    def anon_kib(p):
        """RssAnon: the heap and stacks, without the library pages a new code path touches once."""
        for line in Path(f"/proc/{p}/status").read_text().splitlines():
            if line.startswith("RssAnon:"):
                return int(line.split()[1])
        return 0

    def sample(rnd, t0):
        socks, other = fd_kinds(pid)
        samples.append({"round": rnd, "seconds": round(time.monotonic() - t0, 3), "fds": socks + other,
                        "socket_fds": socks, "other_fds": other, "rss_kib": rss_kib(pid),
                        "anon_kib": anon_kib(pid),
                        "state_kib": du_kib(d.state_root), "hub_kib": du_kib(hub),
                        "cpu_s": round(cpu_seconds(pid), 2)})

    def check_published(step):
        """The hub's global (published after the commit) and the HTTP one are the oracle's."""
        d.wait_step(step, timeout=60)
        got = load_torch(hub / "global" / "latest.safetensors")
        try:
            assert_matches_oracle(got, want)
        except AssertionError as e:
            raise AssertionError(f"step {step}: the global published in the hub differs from the oracle: {e}")
        s, blob = get_global_after_status(url, step, lagging)
        try:
            assert_matches_oracle(torch_load_bytes(blob), want)
        except AssertionError as e:
            raise AssertionError(f"step {step}: the global served over HTTP differs from the oracle: {e}")

    def train(node, rnd):
        time.sleep(random.Random(f"{node}/{rnd}").uniform(0, 2 * SOAK_PACE))

    def http_node(node, rnd, delta):
        s, _ = get_global(url)
        assert s == rnd, (node, s, rnd)
        train(node, rnd)
        upload(url, node, rnd, 10 * (rnd + 1), delta)

    def file_node(node, rnd, delta):
        import json
        sc = json.loads((hub / "global" / "step_count.json").read_text())
        assert sc["outer_step"] == rnd, (node, sc, rnd)
        atomic = not (node == "f1" and rnd % 3 == 0)
        train(node, rnd)
        write_delta(hub, node, rnd, 10 * (rnd + 1), delta, atomic=atomic)

    def do_round(rnd, pool):
        nonlocal want
        check_published(rnd)
        deltas = round_deltas(model, rnd)
        futs = [pool.submit(http_node, n, rnd, deltas[n]) for n in HTTP_NODES]
        futs += [pool.submit(file_node, n, rnd, deltas[n]) for n in FILE_NODES]
        junk_file(hub, model, rnd, rnd)
        for f in futs:
            f.result()
        wait_outer_step(d, url, rnd + 1, timeout=120)
        want = {k: v.clone() for k, v in oracle.step(deltas).items()}

    try:
        with ThreadPoolExecutor(len(NODES)) as pool:
            t0 = time.monotonic()
            do_round(0, pool)                            # warm-up round before the chaos
            base_fds = open_fds(pid)
            seconds = CHAOS_CAP if CHAOS_CAP is not None else 24 * 3600
            if SOAK_CHAOS:
                chaos = ChaosProcess(url, seconds, seed=int(os.environ.get("CHAOS_SEED", "2")), out=tmp_path,
                                     threads=12, victims=NODES)
            prober = Prober(d, url).start()
            sample(1, t0)
            for rnd in range(1, SOAK_ROUNDS):
                assert d.alive(), f"dilocod died at round {rnd} (exit {d.proc.poll()}):\n{d.log_text()[-4000:]}"
                do_round(rnd, pool)
                sample(rnd + 1, t0)
                if rnd % 100 == 0:
                    s = samples[-1]
                    print(f"soak: round {rnd}: {s['fds']} fds ({s['other_fds']} non-socket), RSS {s['rss_kib']} KiB,"
                          f" state {s['state_kib']} KiB, {s['seconds']:.0f} s", flush=True)
            check_published(SOAK_ROUNDS)
        elapsed = time.monotonic() - t0
        stats = {"actions": {}, "statuses": {}, "net_errors": {}, "violation_count": 0, "violations": [],
                 "sockets": 0}
        if chaos is not None:
            chaos.stop()
            stats, _ = chaos.wait(timeout=60)
        prober.stop()

        # ---- the curves
        csv_path = tmp_path / "soak.csv"
        warm = max(5, int(len(samples) * WARMUP_FRACTION))
        post = samples[warm:]
        k = max(3, int(len(post) * WINDOW_FRACTION))
        first, last = post[:k], post[-k:]
        rows = {}
        for i, smp in enumerate(samples):
            smp["cpu_ms_round"] = round(1000 * (smp["cpu_s"] - samples[i - 1]["cpu_s"]), 1) if i else 0.0
        for key in ("fds", "other_fds", "rss_kib", "anon_kib", "state_kib", "hub_kib", "cpu_ms_round"):
            a, b = mean([s[key] for s in first]), mean([s[key] for s in last])
            rows[key] = (a, b, (b - a) / max(1, last[-1]["round"] - first[-1]["round"]),
                         slope([s["round"] for s in post], [s[key] for s in post]),
                         min(s[key] for s in post), max(s[key] for s in post))
        from chaos import summary
        with open(csv_path, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(samples[0]))
            w.writeheader()
            w.writerows(samples)
        print(f"\nsoak: {SOAK_ROUNDS} rounds ({len(HTTP_NODES)} over HTTP, {len(FILE_NODES)} by files) in "
              f"{elapsed:.1f} s ({elapsed / SOAK_ROUNDS * 1000:.0f} ms a round), chaos beside; curves in {csv_path}")
        print(f"soak: warm-up {warm} samples; windows of {k}: rounds {first[0]['round']}-{first[-1]['round']} "
              f"and {last[0]['round']}-{last[-1]['round']}")
        print(f"soak: {'metric':12} {'first':>10} {'last':>10} {'per round':>10} {'slope':>10} {'min':>8} {'max':>8}")
        for key, (a, b, per, sl, lo, hi) in rows.items():
            print(f"soak: {key:12} {a:10.1f} {b:10.1f} {per:10.3f} {sl:10.3f} {lo:8} {hi:8}")
        print(f"soak: state bound {bound} KiB a round (model {model_bytes} B, delta {delta_bytes} B, "
              f"{len(NODES)} nodes); CPU {samples[-1]['cpu_s']} s")
        print(summary(stats))
        print(prober.summary())

        # ---- the bounds
        assert prober.dead is None, f"dilocod died (exit {prober.dead})"
        assert not prober.failures, f"probes not served within {PROBE_SECONDS}s: {prober.failures[:10]}"
        assert stats["violation_count"] == 0, "chaos client saw violations:\n" + "\n".join(stats["violations"])
        assert not lagging, (f"{len(lagging)} times /status named a step before GET /global served it "
                             f"(step, served, seconds until served): {lagging[:10]}")
        a, b = rows["other_fds"][:2]
        assert b - a <= OTHER_FD_ALLOWANCE, f"non-socket descriptors grew {a:.1f} -> {b:.1f} (see {csv_path})"
        a, b = rows["fds"][:2]
        assert b - a <= FD_ALLOWANCE, f"descriptors grew {a:.1f} -> {b:.1f} (see {csv_path})"
        a, b = rows["rss_kib"][:2]
        assert b - a <= RSS_ALLOWANCE_MIB * 1024, f"RSS grew {a:.0f} -> {b:.0f} KiB (see {csv_path})"
        a, b, per, sl = rows["state_kib"][:4]
        assert per <= bound and sl <= bound, \
            f"state root grows {per:.1f} KiB a round (slope {sl:.1f}), bound {bound} (see {csv_path})"
        xs = [s["round"] for s in post]
        ys = [s["state_kib"] for s in post]
        s1, s2 = slope(xs[:len(xs) // 2], ys[:len(ys) // 2]), slope(xs[len(xs) // 2:], ys[len(ys) // 2:])
        assert s2 <= 1.5 * s1 + 4, f"state root growth accelerates: {s1:.1f} then {s2:.1f} KiB a round"

        st = status(url)
        assert st["counters"]["rounds"] >= SOAK_ROUNDS, st["counters"]
        from test_chaos import http_get
        for entry in http_get(url, "/rounds").json()["rounds"]:
            got = sorted(n["node_id"] for n in entry.get("nodes", []))
            assert got == sorted(NODES), f"round {entry.get('step')} aggregated {got}"
        deadline = time.monotonic() + 15
        while open_fds(pid) > base_fds + FD_SLACK and time.monotonic() < deadline:
            time.sleep(0.1)
        assert open_fds(pid) <= base_fds + FD_SLACK, f"{open_fds(pid)} descriptors after the soak, baseline {base_fds}"
        reports = sanitizer_reports(d)
        assert not reports, "sanitizer reports:\n" + "\n".join(reports[:20])
        rc = d.stop(timeout=60)
        assert rc == 0, f"SIGTERM: exit {rc}\n{d.log_text()[-3000:]}"
        assert not sanitizer_reports(d), "\n".join(sanitizer_reports(d)[:20])
    finally:
        if samples and not (tmp_path / "soak.csv").exists():
            with open(tmp_path / "soak.csv", "w", newline="") as f:      # the curves up to a failure
                w = csv.DictWriter(f, fieldnames=list(samples[0]))
                w.writeheader()
                w.writerows(samples)
            print(f"soak: {len(samples)} samples in {tmp_path / 'soak.csv'}")
        if chaos is not None:
            chaos.stop()
            try:
                chaos.proc.wait(timeout=30)
            except Exception:
                chaos.proc.kill()
        if prober is not None:
            prober.stop()
        if d.alive():
            d.kill9()
