"""Staging of sharded sets over HTTP under attack (issue 21, items 1 and 9), with the real dilocod over
real sockets:

- an index whose body is held back while a shard of the set streams on another connection (it was a
  null load: the set had no shard array until the index was in);
- a shard of a larger count held back until an index of 2 shards is in (it was a heap overflow: the
  index sized the array, the shard indexed it by its own name's number);
- the 202 answer for a part of a large set is bounded: counts and at most 8 missing names;
- a seeded fuzzer of interleaved parts (valid, mis-numbered, mis-sized, duplicate, aborted, reset).

Each asserts the daemon stays alive and answers /healthz within a second, an honest node's set sent
beside the attack is taken in, and the published global is exact and finite (the torch oracle).
Under DILOCO_BUILD=build-address-undefined a sanitizer report aborts the daemon: its exit status and
its log are checked at the end of each test.
"""
import json
import os
import random
import socket
import struct
import time

import numpy as np
import requests
import torch

from dilocod_proc import Dilocod, Oracle, delta_metadata, load_torch, write_model
from test_shards_http import check_oracle, delta_of, hostile_shards, model, parts, put, save_set

MISSING_NAMED = 8           # what a 202 names of the missing parts at most (upload.c)


# ---- raw HTTP over a socket: a body held back, sent later, or cut off -------------------------------

def open_put(port, node, name, body, sent=0):
    """Sends a PUT's head with Content-Length len(body) and the first `sent` bytes of the body; the
    socket is returned with the rest held back."""
    s = socket.create_connection(("127.0.0.1", port), timeout=30)
    s.sendall(f"PUT /nodes/{node}/{name} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n\r\n".encode() +
              body[:sent])
    return s


def read_response(s):
    """(status, parsed JSON body, raw body) of one response on s."""
    buf = b""
    while b"\r\n\r\n" not in buf:
        chunk = s.recv(65536)
        if not chunk:
            raise AssertionError(f"connection closed before a response: {buf!r}")
        buf += chunk
    head, _, rest = buf.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    length = 0
    for line in lines[1:]:
        k, _, v = line.partition(":")
        if k.strip().lower() == "content-length":
            length = int(v.strip())
    while len(rest) < length:
        chunk = s.recv(65536)
        if not chunk:
            break
        rest += chunk
    body = rest[:length]
    return status, (json.loads(body) if body.strip() else None), body


def finish_put(s, body, sent=0):
    """Sends the rest of a held PUT and reads its answer."""
    try:
        s.sendall(body[sent:])
        return read_response(s)
    finally:
        s.close()


def reset_close(s):
    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    s.close()


# ---- what every test checks ------------------------------------------------------------------------

def uploads_in_progress(d):
    with requests.Session() as sess:
        sess.trust_env = False
        return sess.get(d.url + "/status", timeout=5).json()["uploads_in_progress"]


def wait_uploads(d, n):
    """Waits until the daemon reports n uploads being received (their heads are read)."""
    d.wait_until(lambda: uploads_in_progress(d) == n, f"{n} uploads in progress")


def healthz_within_a_second(d):
    t0 = time.monotonic()
    with requests.Session() as sess:
        sess.trust_env = False
        r = sess.get(d.url + "/healthz", timeout=1.0)
    took = time.monotonic() - t0
    assert r.status_code == 200 and took < 1.0, (r.status_code, took, d.log_text()[-3000:])


def no_sanitizer_report(d):
    text = d.log_text()
    for needle in ("AddressSanitizer", "UndefinedBehaviorSanitizer", "runtime error:", "LeakSanitizer"):
        assert needle not in text, text[text.index(needle) - 200:][:4000]


def assert_finite(path):
    for k, v in load_torch(path).items():
        if v.is_floating_point():
            assert torch.isfinite(v).all(), k


def honest_set(tmp, m, node="h", local=3, seed=21):
    """An honest node's delta, saved as huggingface_hub's set: (delta, shard paths, index path)."""
    dt = delta_of(seed, m)
    index = save_set(tmp / f"honest-{node}", node, 0, local, dt)
    shards, _ = parts(index)
    return dt, shards, index


def send_honest(d, node, shards, index):
    """The honest node's parts, shards first (202 each), the index last (201)."""
    for s in shards:
        code, ans = put(d.url, node, s)
        assert code == 202, ans
    code, ans = put(d.url, node, index)
    assert code == 201 and ans["result"] == "accepted", ans


def daemon(tmp, init, nodes=2):
    # the attacker's set never completes: the round closes by its timeout with the honest node alone
    return Dilocod(tmp, tmp / "hub", "--init-model", init, "--expected-nodes", str(nodes), "--min-nodes", "1",
                   "--round-timeout", "2").start()


def end_checks(d, m, deltas):
    d.wait_step(1)
    healthz_within_a_second(d)
    latest = d.hub / "global" / "latest.safetensors"
    check_oracle(load_torch(latest), Oracle(m).step(deltas))
    assert_finite(latest)
    assert d.alive()
    no_sanitizer_report(d)
    assert d.stop() == 0
    no_sanitizer_report(d)


# ---- item 1: the two crashes -------------------------------------------------------------------------

def test_index_held_while_a_shard_streams(tmp_path):
    m = model()
    write_model(tmp_path / "init.safetensors", m)
    dt = delta_of(5, m)
    keys = sorted(dt)
    shards, index = hostile_shards(tmp_path / "a", "a", 1, dt, [keys[:3], keys[3:]])
    dh, hshards, hindex = honest_set(tmp_path, m)
    d = daemon(tmp_path, tmp_path / "init.safetensors")
    try:
        d.wait_step(0)
        ibody = index.read_bytes()
        held = open_put(d.port, "a", index.name, ibody)
        wait_uploads(d, 1)      # the index's head is read: the set is opened by it
        # a valid shard of the set on another connection while the index streams
        code, ans = put(d.url, "a", shards[0])
        assert d.alive(), d.log_text()[-3000:]
        assert code == 202 and ans["set"]["shards"] == 2, ans
        healthz_within_a_second(d)
        # the index, now in, agrees with the count the shard fixed
        code, ans, _ = finish_put(held, ibody)
        assert code == 202 and ans["set"]["shards"] == 2 and ans["set"]["missing"] == [shards[1].name], ans
        healthz_within_a_second(d)
        send_honest(d, "h", hshards, hindex)
        end_checks(d, m, {"h": dh})
    finally:
        if d.proc is not None:
            d.stop()


def test_shard_of_another_count_held_until_the_index_is_in(tmp_path):
    m = model()
    write_model(tmp_path / "init.safetensors", m)
    dt = delta_of(6, m)
    keys = sorted(dt)
    four, _ = hostile_shards(tmp_path / "four", "a", 1, dt, [keys[:2], keys[2:3], keys[3:4], keys[4:]])
    two, index = hostile_shards(tmp_path / "two", "a", 1, dt, [keys[:3], keys[3:]])
    dh, hshards, hindex = honest_set(tmp_path, m)
    d = daemon(tmp_path, tmp_path / "init.safetensors")
    try:
        d.wait_step(0)
        ibody, sbody = index.read_bytes(), four[3].read_bytes()
        held_index = open_put(d.port, "a", index.name, ibody)
        wait_uploads(d, 1)      # the index's head is read: the set is opened by it
        held_shard = open_put(d.port, "a", four[3].name, sbody)
        wait_uploads(d, 2)
        # the index (2 shards) completes while shard 4 of 4 is in flight: it disagrees with the count
        # that shard fixed and is refused, and the set starts over; the shard in flight is told so
        code, ans, _ = finish_put(held_index, ibody)
        assert d.alive(), d.log_text()[-3000:]
        assert code == 422 and ans["error"]["code"] == "invalid_path", ans
        assert "lists 2 shards" in ans["error"]["message"] and "has 4" in ans["error"]["message"], ans
        code, ans, _ = finish_put(held_shard, sbody)
        assert d.alive(), d.log_text()[-3000:]
        assert code == 409 and ans["error"]["code"] == "set_refused", ans
        healthz_within_a_second(d)
        # a new set: shard 4 of 4 fixes the count, a part whose name disagrees with it is refused
        assert put(d.url, "a", four[3])[0] == 202
        code, ans = put(d.url, "a", two[0])
        assert code == 422 and "has 4 shards" in ans["error"]["message"], ans
        send_honest(d, "h", hshards, hindex)
        end_checks(d, m, {"h": dh})
    finally:
        if d.proc is not None:
            d.stop()


def test_index_after_shards_is_reconciled(tmp_path):
    """Shards in before their index: an index of another count is refused and the shards stay; an
    index whose total_size is below what the shards in hold is refused (mis-sized)."""
    m = model()
    write_model(tmp_path / "init.safetensors", m)
    dt = delta_of(7, m)
    keys = sorted(dt)
    two, index2 = hostile_shards(tmp_path / "two", "a", 1, dt, [keys[:3], keys[3:]])
    _, index3 = hostile_shards(tmp_path / "three", "a", 1, dt, [keys[:2], keys[2:4], keys[4:]])
    dh, hshards, hindex = honest_set(tmp_path, m)
    d = daemon(tmp_path, tmp_path / "init.safetensors")
    try:
        d.wait_step(0)
        assert put(d.url, "a", two[0])[0] == 202
        code, ans = put(d.url, "a", index3)
        assert code == 422 and ans["error"]["code"] == "invalid_path", ans
        assert "lists 3 shards" in ans["error"]["message"] and "has 2" in ans["error"]["message"], ans
        d.wait_log("sharded upload discarded")      # the set starts over
        assert put(d.url, "a", two[0])[0] == 202
        small = tmp_path / "small" / index2.name
        small.parent.mkdir()
        ix = json.loads(index2.read_text())
        ix["metadata"]["total_size"] = 8
        small.write_text(json.dumps(ix))
        code, ans = put(d.url, "a", small)
        assert code == 422 and ans["error"]["code"] == "metadata_invalid", ans
        assert "total_size is 8" in ans["error"]["message"] and "already in hold" in ans["error"]["message"], ans
        d.wait_log("sharded upload discarded", count=2)
        healthz_within_a_second(d)
        send_honest(d, "h", hshards, hindex)
        end_checks(d, m, {"h": dh})
    finally:
        if d.proc is not None:
            d.stop()


# ---- item 9: a bounded 202 ---------------------------------------------------------------------------

def wide_model(n=40):
    g = torch.Generator().manual_seed(3)
    return {f"t{i:03d}": torch.randn(32, 32, generator=g) for i in range(n)}


def test_a_202_names_at_most_a_few_missing_parts(tmp_path):
    m = wide_model()
    write_model(tmp_path / "init.safetensors", m)
    dh = delta_of(9, m)
    index = save_set(tmp_path / "h", "h", 0, 4, dh, max_shard=4096)     # one 4 KiB tensor a shard
    shards, _ = parts(index)
    assert len(shards) == len(m)
    d = daemon(tmp_path, tmp_path / "init.safetensors", nodes=1)
    try:
        d.wait_step(0)
        sizes = []
        code, ans = put(d.url, "h", index)
        assert code == 202, ans
        for k, s in enumerate(shards):
            code, ans, raw = finish_put(open_put(d.port, "h", s.name, s.read_bytes()), s.read_bytes())
            if k == len(shards) - 1:
                assert code == 201 and ans["result"] == "accepted", ans
                break
            assert code == 202, ans
            left = len(shards) - k - 1
            st = ans["set"]
            assert st["shards"] == len(shards) and st["received"] == k + 2 and st["index"] is True, st
            assert st["missing_count"] == left, st
            assert len(st["missing"]) == min(left, MISSING_NAMED), st
            assert st["missing"][0] == shards[k + 1].name, st
            sizes.append(len(raw))
        # 40 shards' names were 1.9 KB in one answer; bounded, an answer is the same size whatever the set
        assert max(sizes) < 1024, max(sizes)
        print(f"202 answers for a {len(shards)}-shard set: at most {max(sizes)} bytes")
        healthz_within_a_second(d)
        end_checks(d, m, {"h": dh})
    finally:
        if d.proc is not None:
            d.stop()


# ---- the set-staging fuzzer ----------------------------------------------------------------------------

class Fuzz:
    """Random interleavings of the parts of sharded sets over real sockets, from one thread: each op
    sends a whole part, starts one and holds it (its head, part of its body), or finishes, cuts off or
    resets one held.  Parts: valid shards and indexes, shards under another number or count, indexes of
    another count or total_size, garbage, duplicates, two local steps.  The withheld shard of every set
    is never sent under its own name, so no fuzzed set is ever taken in: the round holds the honest
    node's delta alone."""

    NODES = ("f0", "f1")

    def __init__(self, d, rng, tmp, m):
        self.d, self.rng = d, rng
        self.held = []
        self.codes = {}
        keys = sorted(k for k, v in m.items() if v.is_floating_point())
        self.parts = []             # (node, local, name, body)
        for node in self.NODES:
            for local in (1, 2):
                for n in (2, 3, 4):
                    split = [keys[i * len(keys) // n:(i + 1) * len(keys) // n] for i in range(n)]
                    dt = delta_of(100 + n + local, m)
                    shards, index = hostile_shards(tmp / f"fz-{node}-{local}-{n}", node, local, dt, split)
                    withheld = rng.randrange(n)
                    for i, s in enumerate(shards):
                        body = s.read_bytes()
                        if i != withheld:
                            self.parts.append((node, local, s.name, body))
                        # a shard under another number or count (never the withheld one's own name)
                        j, c = rng.randrange(1, 8), rng.randrange(1, 9)
                        name = f"delta_{local}-{j:05d}-of-{c:05d}.safetensors"
                        if name != shards[withheld].name:
                            self.parts.append((node, local, name, body))
                        # mis-sized: cut short, or with bytes over
                        self.parts.append((node, local, s.name if i != withheld else shards[0].name,
                                           body[:rng.randrange(8, len(body))] if rng.random() < 0.5 else body + b"\0" * 8))
                    ibody = index.read_bytes()
                    self.parts.append((node, local, index.name, ibody))
                    ix = json.loads(ibody)
                    ix["metadata"]["total_size"] = rng.choice([0, 8, ix["metadata"]["total_size"] + 4])
                    self.parts.append((node, local, index.name, json.dumps(ix).encode()))
                    self.parts.append((node, local, index.name, ibody[:rng.randrange(1, len(ibody))]))

    def count(self, code):
        self.codes[code] = self.codes.get(code, 0) + 1

    def answer(self, s, body, sent):
        try:
            s.settimeout(20)
            s.sendall(body[sent:])
            code = read_response(s)[0]
        except (OSError, AssertionError):
            code = "closed"         # refused before the body was read, and the connection closed
        finally:
            s.close()
        self.count(code)

    def op(self):
        r = self.rng.random()
        if self.held and (r < 0.35 or len(self.held) >= 8):
            s, body, sent = self.held.pop(self.rng.randrange(len(self.held)))
            r2 = self.rng.random()
            if r2 < 0.6:
                self.answer(s, body, sent)
            elif r2 < 0.8:
                s.close()           # the client goes away mid-body
                self.count("aborted")
            else:
                reset_close(s)      # connection reset
                self.count("reset")
            return
        node, local, name, body = self.rng.choice(self.parts)
        try:
            s = socket.create_connection(("127.0.0.1", self.d.port), timeout=20)
            sent = self.rng.randrange(len(body)) if self.rng.random() < 0.5 else 0
            s.sendall(f"PUT /nodes/{node}/{name} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n\r\n".encode()
                      + body[:sent])
        except OSError:
            self.count("connect")
            return
        if self.rng.random() < 0.5:
            self.held.append((s, body, sent))
        else:
            self.answer(s, body, sent)

    def close_all(self):
        for s, _, _ in self.held:
            s.close()
        self.held = []


def fuzz_run(tmp, seed, ops=400, seconds=15.0):
    import threading
    m = model()
    tmp.mkdir(parents=True, exist_ok=True)
    write_model(tmp / "init.safetensors", m)
    rng = random.Random(seed)
    fz = Fuzz(None, rng, tmp, m)
    dh, hshards, hindex = honest_set(tmp, m)
    d = Dilocod(tmp, tmp / "hub", "--init-model", tmp / "init.safetensors", "--expected-nodes", "3",
                "--min-nodes", "1", "--round-timeout", "2").start()
    fz.d = d
    slow, stop, honest = [], threading.Event(), {}

    def watch():
        while not stop.is_set():
            try:
                healthz_within_a_second(d)
            except (AssertionError, requests.RequestException) as e:
                slow.append(repr(e)[:300])
            stop.wait(0.2)

    def send_honest_thread():
        try:
            send_honest(d, "h", hshards, hindex)
            honest["ok"] = True
        except AssertionError as e:
            honest["error"] = str(e)[:2000]

    try:
        d.wait_step(0)
        w = threading.Thread(target=watch, daemon=True)
        w.start()
        h = None
        t0 = time.monotonic()
        for k in range(ops):
            if k == ops // 3:
                h = threading.Thread(target=send_honest_thread, daemon=True)
                h.start()
            fz.op()
            assert d.alive(), f"seed {seed} op {k}: dilocod died\n{d.log_text()[-4000:]}"
            if time.monotonic() - t0 > seconds:
                break
        fz.close_all()
        h.join(60)
        assert honest.get("ok"), (seed, honest)
        d.wait_step(1)
        stop.set()
        w.join(5)
        assert not slow, (seed, slow[:5])
        assert not [c for c in fz.codes if isinstance(c, int) and c >= 500 and c != 503], (seed, fz.codes)
        assert fz.codes.get(202, 0) > 0 and sum(v for c, v in fz.codes.items() if c in (409, 413, 422, 400)) > 0, \
            (seed, fz.codes)
        latest = d.hub / "global" / "latest.safetensors"
        check_oracle(load_torch(latest), Oracle(m).step({"h": dh}))
        assert_finite(latest)
        healthz_within_a_second(d)
        no_sanitizer_report(d)
        assert d.stop() == 0, f"seed {seed}: exit status\n{d.log_text()[-4000:]}"
        no_sanitizer_report(d)
        return fz.codes
    finally:
        stop.set()
        fz.close_all()
        if d.proc is not None:
            d.stop()


def test_set_staging_fuzz(tmp_path):
    """A bounded run: a fixed seed and two random ones (printed for a rerun: FUZZ_SEEDS=a,b,c), each at
    most 400 ops and 15 s (a minute in all, under ASan too)."""
    seeds = [int(s) for s in os.environ["FUZZ_SEEDS"].split(",")] if os.environ.get("FUZZ_SEEDS") else \
        [21, *(random.SystemRandom().randrange(1 << 30) for _ in range(2))]
    for seed in seeds:
        print(f"set-staging fuzz seed {seed}")
        codes = fuzz_run(tmp_path / f"seed-{seed}", seed)
        print(f"seed {seed}: {codes}")
