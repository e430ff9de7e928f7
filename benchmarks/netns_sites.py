"""A real shaped network on one machine: hosts in network namespaces, grouped in sites, links shaped with ``tc``.

Each site is a switch namespace holding a Linux bridge; each host is a namespace with one veth to its site's switch
(address ``10.77.0.N/24``, one flat subnet); the switches of two sites are joined by a veth pair. Every veth end
is shaped on egress with ``tbf`` (token bucket): ``within_mbit`` on host <-> switch, ``between_mbit`` on
switch <-> switch, so a message between sites crosses the slow pair once each way. Latency (``latency_ms``, one way,
between sites) is added with ``netem`` only where the kernel has it (``tc qdisc add ... netem`` succeeds); otherwise
there is none beyond the kernel's own, and :attr:`Sites.latency_method` says so.

Names carry a per-run tag (process id + a counter), so two runs never collide; :meth:`Sites.close` deletes every
namespace it made (deleting a namespace deletes its veth ends, and with them the pairs), from ``__exit__`` and from
an ``atexit`` hook, so an interrupted run leaves nothing behind.

Used by ``benchmarks/bench_wan.py`` and ``tests/executors/runtime/test_netns.py``.
"""
from __future__ import annotations

import atexit
import itertools
import logging
import os
import shutil
import signal
import subprocess
from dataclasses import dataclass

log = logging.getLogger("netns_sites")
_COUNTER = itertools.count()
SUBNET = "10.77.0"


@dataclass(frozen=True)
class Profile:
    """A network profile.

    name:          what the benchmark calls it (``20mbit``).
    between_mbit:  rate of the link between two sites, each way (Mbit/s).
    within_mbit:   rate of a host's link to its site's switch, each way (Mbit/s).
    latency_ms:    one-way latency between sites, added only where ``netem`` exists.
    """

    name: str
    between_mbit: float
    within_mbit: float = 1000.0
    latency_ms: float = 30.0


PROFILES = {"20mbit": Profile("20mbit", 20.0), "5mbit": Profile("5mbit", 5.0)}


class SetupError(RuntimeError):
    """A command that builds the network failed (its message names the command and what it printed)."""


def _sh(*cmd: str) -> None:
    r = subprocess.run(cmd, capture_output=True, timeout=10)
    if r.returncode:
        raise SetupError(f"{' '.join(cmd)}: {r.stderr.decode(errors='replace').strip()}")


def namespaces_available() -> str | None:
    """None where namespaces can be made here, else why not (one line)."""
    if os.geteuid() != 0:
        return "needs root"
    if not shutil.which("ip") or not shutil.which("tc"):
        return "needs ip and tc"
    probe = f"fzp{os.getpid() % 100000}"
    try:
        _sh("ip", "netns", "add", probe)
        _sh("ip", "netns", "del", probe)
    except (SetupError, subprocess.TimeoutExpired, OSError) as e:
        return f"cannot create network namespaces ({e})"
    return None


def _burst(mbit: float) -> str:
    """tbf bucket: 1 ms of traffic, at least 4 KiB (a few MTU-sized packets)."""
    return f"{max(4096, int(mbit * 1e6 / 8 * 1e-3))}b"


def _terminated(signum, frame) -> None:
    raise SystemExit(128 + signum)


class NamespaceSet:
    """The life cycle of a set of network namespaces a subclass builds (``_build``) and removes (``close``,
    idempotent): built on entering, removed on leaving, at exit, on SIGTERM, and when the build itself fails."""

    def __enter__(self):
        atexit.register(self.close)
        if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:  # `timeout`/`kill`: unwind, so that close() runs
            signal.signal(signal.SIGTERM, _terminated)
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class Sites(NamespaceSet):
    """Hosts in sites over a shaped network (see the module docstring); a context manager.

    ``hosts``: host name -> site name, in order (addresses ``10.77.0.1``, ``.2``, ... in that order).
    """

    def __init__(self, hosts: dict[str, str], profile: Profile):
        self.profile = profile
        self.tag = f"fz{os.getpid() % 100000}x{next(_COUNTER)}"
        self.sites = list(dict.fromkeys(hosts.values()))
        if len(self.sites) > 2:
            raise ValueError("netns_sites: at most two sites (one inter-site link)")
        self.hosts = dict(hosts)
        self.ip = {h: f"{SUBNET}.{i + 1}" for i, h in enumerate(hosts)}
        self.ns = {h: f"{self.tag}h{i}" for i, h in enumerate(hosts)}
        self.switch = {s: f"{self.tag}s{i}" for i, s in enumerate(self.sites)}
        self.dev = {h: f"{self.tag}v{i}" for i, h in enumerate(hosts)}  # a host's end of its veth
        self.latency_method = "none"
        self._made: list[str] = []

    # -- life cycle (entering and leaving: NamespaceSet) ---------------------------------------
    def close(self) -> None:
        """Delete every namespace made (idempotent)."""
        while self._made:
            subprocess.run(["ip", "netns", "del", self._made.pop()], capture_output=True, timeout=10)

    def _netns(self, name: str) -> None:
        _sh("ip", "netns", "add", name)
        self._made.append(name)
        _sh("ip", "-n", name, "link", "set", "lo", "up")

    def _shape(self, ns: str, dev: str, mbit: float, latency_ms: float = 0.0) -> None:
        tbf = ["tbf", "rate", f"{mbit:g}mbit", "burst", _burst(mbit), "latency", "400ms"]
        if latency_ms > 0:
            ok = subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "handle", "1:",
                                 "netem", "delay", f"{latency_ms:g}ms"], capture_output=True, timeout=10).returncode == 0
            if ok:
                self.latency_method = f"netem delay {latency_ms:g} ms each way between sites"
                _sh("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "parent", "1:", "handle", "2:", *tbf)
                return
            self.latency_method = "none (this kernel has no netem: only the kernel's own latency)"
        _sh("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", *tbf)

    def _build(self) -> None:
        p = self.profile
        for s, sw in self.switch.items():
            self._netns(sw)
            _sh("ip", "-n", sw, "link", "add", "br0", "type", "bridge")
            _sh("ip", "-n", sw, "link", "set", "br0", "up")
        for h, ns in self.ns.items():
            sw, dev, peer = self.switch[self.hosts[h]], self.dev[h], self.dev[h] + "s"
            self._netns(ns)
            _sh("ip", "link", "add", dev, "type", "veth", "peer", "name", peer)
            _sh("ip", "link", "set", dev, "netns", ns)
            _sh("ip", "link", "set", peer, "netns", sw)
            _sh("ip", "-n", ns, "addr", "add", f"{self.ip[h]}/24", "dev", dev)
            _sh("ip", "-n", ns, "link", "set", dev, "up")
            _sh("ip", "-n", sw, "link", "set", peer, "master", "br0")
            _sh("ip", "-n", sw, "link", "set", peer, "up")
            self._shape(ns, dev, p.within_mbit)
            self._shape(sw, peer, p.within_mbit)
        if len(self.sites) == 2:
            (sa, a), (sb, b) = self.switch.items()
            da, db = f"{self.tag}ia", f"{self.tag}ib"
            _sh("ip", "link", "add", da, "type", "veth", "peer", "name", db)
            for sw, d in ((a, da), (b, db)):
                _sh("ip", "link", "set", d, "netns", sw)
                _sh("ip", "-n", sw, "link", "set", d, "master", "br0")
                _sh("ip", "-n", sw, "link", "set", d, "up")
                self._shape(sw, d, p.between_mbit, p.latency_ms)
        log.info("netns sites %s: %s, %g Mbit/s between sites, %g within, latency: %s", self.tag,
                 {h: (self.hosts[h], self.ip[h]) for h in self.hosts}, p.between_mbit, p.within_mbit,
                 self.latency_method)

    # -- use ---------------------------------------------------------------------------------
    def cmd(self, host: str, argv: list[str]) -> list[str]:
        """``argv`` run inside ``host``'s namespace."""
        return ["ip", "netns", "exec", self.ns[host], *argv]

    def sent_bytes(self, host: str) -> int:
        """Bytes ``host`` has sent through its shaped link (its veth end's root qdisc)."""
        out = subprocess.run(self.cmd(host, ["tc", "-s", "qdisc", "show", "dev", self.dev[host]]),
                             capture_output=True, text=True, timeout=10).stdout
        return int(out.split("Sent ")[1].split(" bytes")[0])

    def between_sent_bytes(self) -> int:
        """Bytes sent over the inter-site link, both ways together (0 with one site)."""
        if len(self.sites) < 2:
            return 0
        total = 0
        for sw, d in zip(self.switch.values(), (f"{self.tag}ia", f"{self.tag}ib")):
            out = subprocess.run(["ip", "netns", "exec", sw, "tc", "-s", "qdisc", "show", "dev", d],
                                 capture_output=True, text=True, timeout=10).stdout
            total += int(out.split("Sent ")[1].split(" bytes")[0])  # the root qdisc's line comes first
        return total
