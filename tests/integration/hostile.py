"""What every hostile-input test checks after its attack (test_hostile_clients*.py): the daemon is
alive, a brand-new client is served within a couple of seconds, and its open descriptors and RSS are
back within a stated bound of their baseline."""
import os
import time
from pathlib import Path

import requests

SANITIZED = "-" in Path(os.environ.get("DILOCO_BUILD", "build")).name   # build-address-undefined


def open_fds(pid) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def proc_kib(pid, field="VmRSS") -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(f"{field} not in /proc/{pid}/status")


def wait_for(pred, timeout, what):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if pred():
            return
        time.sleep(0.02)
    raise AssertionError(f"{what} not reached within {timeout}s")


def served_quickly(d, within=2.0):
    """A brand-new client gets /healthz and /status answered within `within` seconds (retrying
    connects); returns the /status document."""
    deadline = time.monotonic() + within
    last = None
    while time.monotonic() < deadline:
        try:
            with requests.Session() as s:
                s.trust_env = False
                h = s.get(d.url + "/healthz", timeout=max(0.2, deadline - time.monotonic()))
                st = s.get(d.url + "/status", timeout=max(0.2, deadline - time.monotonic()))
            if h.status_code == 200 and st.status_code == 200:
                return st.json()
            last = (h.status_code, st.status_code)
        except requests.RequestException as e:
            last = e
        time.sleep(0.05)
    raise AssertionError(f"a new client was not served within {within}s (last: {last!r}); "
                         f"alive={d.alive()} exit={d.proc.poll()}\n{d.log_text()[-3000:]}")


class Baseline:
    """Descriptors and RSS before an attack; check() asserts the daemon is alive, serves, and is back
    within fd_slack descriptors and rss_slack_kib of them.  Returns (fds, rss KiB)."""

    def __init__(self, d, fd_slack, rss_slack_kib):
        self.d = d
        self.fd_slack, self.rss_slack_kib = fd_slack, rss_slack_kib
        self.fds = open_fds(d.proc.pid)
        self.rss = proc_kib(d.proc.pid)

    def check(self, fd_slack=None, rss_slack_kib=None, settle=10.0):
        d = self.d
        fd_slack = self.fd_slack if fd_slack is None else fd_slack
        rss_slack_kib = self.rss_slack_kib if rss_slack_kib is None else rss_slack_kib
        assert d.alive(), f"dilocod died (exit {d.proc.poll()}):\n{d.log_text()[-4000:]}"
        served_quickly(d)
        pid = d.proc.pid
        # descriptors of connections the attacker closed go as the daemon notices: allow it a moment
        wait_for(lambda: open_fds(pid) <= self.fds + fd_slack, settle,
                 f"open descriptors within {fd_slack} of the baseline {self.fds} (now {open_fds(pid)})")
        rss = proc_kib(pid)
        assert rss <= self.rss + rss_slack_kib, f"RSS {rss} KiB, baseline {self.rss} KiB (+{rss_slack_kib} allowed)"
        print(f"fds {self.fds} -> {open_fds(pid)}, VmRSS {self.rss} -> {rss} KiB")
        return open_fds(pid), rss
