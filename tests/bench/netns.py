"""Network namespaces with capped links, so that one machine shows what K hosts would do (issue 39).

NetnsLab(count, rate_mbit) makes `count` namespaces, each joined to one bridge in the host's namespace by a
veth pair.  Both directions of every pair are capped by a tbf qdisc (the host side's egress caps what the
namespace downloads, the namespace side's egress what it uploads), so each namespace is a host with its own
link of rate_mbit.  The addresses are in 198.18.0.0/15, the range RFC 2544 sets aside for benchmarks (it
cannot clash with a real network's private range); the namespaces get no default route, so their traffic
can only reach the bridge, that is this machine.  Nothing is forwarded: the host's ip_forward is not
touched.

The lab's names carry the owning process's id (dlb<pid>-<i>, dlb<pid>b, dlb<pid>h<i>): teardown() removes
exactly its own, and stale_labs() lists those whose process is gone (a harness killed by SIGKILL), which
setup() removes before it starts.  Without CAP_NET_ADMIN setup() raises NetnsUnavailable with a message
saying so.
"""
import ipaddress
import os
import re
import subprocess
from pathlib import Path

NET = ipaddress.ip_network("198.18.0.0/15")
NAME = re.compile(r"^dlb(\d+)(?:-(\d+)|b|h(\d+))$")


class NetnsUnavailable(RuntimeError):
    """The machine does not let this process make network namespaces, links or qdiscs."""


def _ip(*args, check=True):
    p = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and p.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: exit {p.returncode}: {p.stderr.strip()}")
    return p


def _tc(*args):
    p = subprocess.run(["tc", *args], capture_output=True, text=True, timeout=30)
    if p.returncode != 0:
        raise RuntimeError(f"tc {' '.join(args)}: exit {p.returncode}: {p.stderr.strip()}")
    return p


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def namespaces():
    """Every network namespace name on the machine."""
    out = _ip("netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def links():
    """Every link name in the host's namespace (without the @peer suffix)."""
    out = _ip("-o", "link", "show", check=False).stdout
    return [line.split(":")[1].strip().split("@")[0] for line in out.splitlines() if ":" in line]


def lab_names(pid):
    """The namespaces and host links of the lab owned by pid."""
    own = lambda n: (m := NAME.match(n)) is not None and int(m.group(1)) == pid  # noqa: E731
    return [n for n in namespaces() if own(n)], [n for n in links() if own(n)]


def stale_labs():
    """Owner pids of labs whose process is gone."""
    pids = set()
    for n in namespaces() + links():
        m = NAME.match(n)
        if m and not _alive(int(m.group(1))):
            pids.add(int(m.group(1)))
    return sorted(pids)


def remove_lab(pid):
    """Deletes the namespaces and host links named for pid (deleting one end of a veth deletes both)."""
    ns, ls = lab_names(pid)
    for n in ns:
        _ip("netns", "del", n, check=False)
    for n in ls:
        _ip("link", "del", n, check=False)


class NetnsLab:
    def __init__(self, count, rate_mbit=None, pid=None):
        if count < 1 or count > 200:
            raise ValueError(f"NetnsLab: count {count} is out of 1..200")
        if rate_mbit is not None and not 0 < rate_mbit <= 100000:
            raise ValueError(f"NetnsLab: rate {rate_mbit} Mbit/s is out of (0, 100000]")
        self.count, self.rate_mbit = count, rate_mbit
        self.pid = os.getpid() if pid is None else pid
        tag = f"dlb{self.pid}"
        if len(tag) + 4 > 15:
            raise ValueError(f"NetnsLab: pid {self.pid} makes link names over 15 characters")
        self.bridge = f"{tag}b"
        self.ns = [f"{tag}-{i}" for i in range(count)]
        self.host_veth = [f"{tag}h{i}" for i in range(count)]
        self.ns_veth = [f"{tag}n{i}" for i in range(count)]
        self.subnet = None
        self.up = False

    # -- addresses -------------------------------------------------------------------------------------
    def _pick_subnet(self):
        """A /24 of 198.18.0.0/15 that no address of the host's namespace is in (other labs run beside)."""
        used = _ip("-4", "-o", "addr", "show", check=False).stdout
        for i, net in enumerate(NET.subnets(new_prefix=24)):
            if i == 0:
                continue
            if str(net.network_address).rsplit(".", 1)[0] + "." not in used:
                return net
        raise RuntimeError("NetnsLab: every /24 of 198.18.0.0/15 is in use")

    @property
    def host_addr(self):
        return str(self.subnet.network_address + 1)

    def addr(self, i):
        return str(self.subnet.network_address + 10 + i)

    # -- set up, tear down -----------------------------------------------------------------------------
    def _check_rights(self):
        probe = f"dlb{self.pid}-probe"
        p = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True, timeout=30)
        if p.returncode != 0:
            raise NetnsUnavailable(
                f"this harness needs network namespaces, veth links and tc qdiscs (root or CAP_NET_ADMIN; "
                f"uid {os.geteuid()}): `ip netns add` said: {p.stderr.strip() or p.returncode}")
        _ip("netns", "del", probe, check=False)

    def _cap(self, ns, dev):
        """tbf at rate_mbit on dev's egress; a burst of 10 ms of the rate (at least 64 KiB) keeps the
        average at the rate with GSO packets on a veth, a queue of 50 ms keeps TCP from bufferbloat."""
        if self.rate_mbit is None:
            return
        burst = max(64 * 1024, int(self.rate_mbit * 1e6 / 8 / 100))
        cmd = ["qdisc", "replace", "dev", dev, "root", "tbf", "rate", f"{self.rate_mbit}mbit",
               "burst", str(burst), "latency", "50ms"]
        if ns is None:
            _tc(*cmd)
        else:
            _ip("netns", "exec", ns, "tc", *cmd)

    def setup(self):
        for pid in stale_labs():
            remove_lab(pid)
        self._check_rights()
        self.up = True   # from here on teardown() has something to remove
        try:
            self.subnet = self._pick_subnet()
            _ip("link", "add", self.bridge, "type", "bridge")
            _ip("addr", "add", f"{self.host_addr}/24", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
            for i in range(self.count):
                ns, hv, nv = self.ns[i], self.host_veth[i], self.ns_veth[i]
                _ip("netns", "add", ns)
                _ip("link", "add", hv, "type", "veth", "peer", "name", nv)
                _ip("link", "set", nv, "netns", ns)
                _ip("link", "set", hv, "master", self.bridge)
                _ip("link", "set", hv, "up")
                _ip("-n", ns, "link", "set", "lo", "up")
                _ip("-n", ns, "addr", "add", f"{self.addr(i)}/24", "dev", nv)
                _ip("-n", ns, "link", "set", nv, "up")
                self._cap(None, hv)
                self._cap(ns, nv)
        except BaseException:
            self.teardown()
            raise
        return self

    def teardown(self):
        if not self.up:
            return
        remove_lab(self.pid)
        self.up = False

    def __enter__(self):
        return self.setup()

    def __exit__(self, *exc):
        self.teardown()

    # -- use -------------------------------------------------------------------------------------------
    def exec_argv(self, i, argv):
        """argv run inside namespace i (`ip netns exec` execs it: the child's pid is argv's process)."""
        return ["ip", "netns", "exec", self.ns[i], *[str(a) for a in argv]]

    def link_bytes(self, i):
        """(bytes the host sent into namespace i, bytes it received from it), counted on the host side of
        its veth: what crossed the capped link, headers included."""
        base = Path("/sys/class/net") / self.host_veth[i] / "statistics"
        return int((base / "tx_bytes").read_text()), int((base / "rx_bytes").read_text())
