"""Homes behind real Linux NAT on one machine: network namespaces, ``iptables -t nat ... MASQUERADE``.

One reachable site and ``homes`` homes::

    pub (10.79.0.1, bridge br0) ── wan ── r<i> (10.79.0.1<i>)  MASQUERADE ── lan ── h<i> (192.168.<i>.2)

``pub`` is the reachable host (coordinator, relay). Each home has a router namespace ``r<i>`` forwarding its LAN
out of its WAN veth with source NAT (MASQUERADE) and a stateful firewall that drops every new connection from the
WAN (a home router's default), and a host namespace ``h<i>`` whose default route is its router. So a home host
can dial ``pub`` (its connections leave as ``10.79.0.1<i>``), while nothing outside can open a connection to it,
nor can one home reach the other: ``pub`` has no route to any ``192.168.*`` LAN, and the firewall drops the rest.
Links may be shaped with ``tbf`` on each router's WAN veth (``wan_mbit``, each way).

Names carry a per-run tag; :meth:`NatHomes.close` flushes the routers' iptables rules and deletes every namespace
it made (which deletes their veths), from ``__exit__`` and an ``atexit`` hook. Used by ``benchmarks/bench_nat.py``
and ``tests/executors/runtime/test_nat.py``.
"""
from __future__ import annotations

import itertools
import os
import shutil
import subprocess

from netns_sites import NamespaceSet  # this folder: entering and leaving a set of namespaces

_COUNTER = itertools.count()
PUB_IP = "10.79.0.1"


class SetupError(RuntimeError):
    """A command that builds the network failed (its message names the command and what it printed)."""


def _sh(*cmd: str) -> str:
    r = subprocess.run(cmd, capture_output=True, timeout=20)
    if r.returncode:
        raise SetupError(f"{' '.join(cmd)}: {r.stderr.decode(errors='replace').strip()}")
    return r.stdout.decode(errors="replace")


def nat_available() -> str | None:
    """None where namespaces with NAT can be made here, else why not (one line)."""
    if os.geteuid() != 0:
        return "needs root"
    for tool in ("ip", "tc", "iptables"):
        if not shutil.which(tool):
            return f"needs {tool}"
    probe = f"fzn{os.getpid() % 100000}"
    try:
        _sh("ip", "netns", "add", probe)
        try:
            _sh("ip", "netns", "exec", probe, "iptables", "-t", "nat", "-A", "POSTROUTING", "-o", "lo", "-j",
                "MASQUERADE")
        finally:
            subprocess.run(["ip", "netns", "del", probe], capture_output=True, timeout=20)
    except (SetupError, subprocess.TimeoutExpired, OSError) as e:
        return f"cannot make namespaces with NAT ({e})"
    return None


class NatHomes(NamespaceSet):
    """The reachable host ``pub`` and ``homes`` home hosts behind NAT (module docstring); a context manager."""

    def __init__(self, homes: int = 2, wan_mbit: float | None = None):
        self.tag = f"fn{os.getpid() % 100000}x{next(_COUNTER)}"
        self.n, self.wan_mbit = homes, wan_mbit
        self.ns = {"pub": f"{self.tag}p", **{f"h{i}": f"{self.tag}h{i}" for i in range(1, homes + 1)}}
        self.routers = {f"r{i}": f"{self.tag}r{i}" for i in range(1, homes + 1)}
        self.ip = {"pub": PUB_IP, **{f"h{i}": f"192.168.{i}.2" for i in range(1, homes + 1)}}
        self.public_ip = {f"h{i}": f"10.79.0.1{i}" for i in range(1, homes + 1)}  # what pub sees
        self._made: list[str] = []

    def close(self) -> None:
        """Flush the routers' iptables rules, delete every namespace made (idempotent)."""
        while self._made:
            ns = self._made.pop()
            if ns in self.routers.values():
                for table in ("nat", "filter"):
                    subprocess.run(["ip", "netns", "exec", ns, "iptables", "-t", table, "-F"], capture_output=True,
                                   timeout=20)
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=20)

    def _netns(self, name: str) -> None:
        _sh("ip", "netns", "add", name)
        self._made.append(name)
        _sh("ip", "-n", name, "link", "set", "lo", "up")

    def _veth(self, a_ns: str, a: str, b_ns: str, b: str) -> None:
        _sh("ip", "link", "add", a, "type", "veth", "peer", "name", b)
        _sh("ip", "link", "set", a, "netns", a_ns)
        _sh("ip", "link", "set", b, "netns", b_ns)

    def _build(self) -> None:
        pub = self.ns["pub"]
        self._netns(pub)
        _sh("ip", "-n", pub, "link", "add", "br0", "type", "bridge")
        _sh("ip", "-n", pub, "addr", "add", f"{PUB_IP}/24", "dev", "br0")
        _sh("ip", "-n", pub, "link", "set", "br0", "up")
        for i in range(1, self.n + 1):
            r, h = self.routers[f"r{i}"], self.ns[f"h{i}"]
            self._netns(r)
            self._netns(h)
            wan, wan_p, lan, lan_r = f"{self.tag}w{i}", f"{self.tag}w{i}p", f"{self.tag}l{i}", f"{self.tag}l{i}r"
            self._veth(r, wan, pub, wan_p)
            _sh("ip", "-n", pub, "link", "set", wan_p, "master", "br0")
            _sh("ip", "-n", pub, "link", "set", wan_p, "up")
            _sh("ip", "-n", r, "addr", "add", f"{self.public_ip[f'h{i}']}/24", "dev", wan)
            _sh("ip", "-n", r, "link", "set", wan, "up")
            self._veth(h, lan, r, lan_r)
            _sh("ip", "-n", r, "addr", "add", f"192.168.{i}.1/24", "dev", lan_r)
            _sh("ip", "-n", r, "link", "set", lan_r, "up")
            _sh("ip", "-n", h, "addr", "add", f"{self.ip[f'h{i}']}/24", "dev", lan)
            _sh("ip", "-n", h, "link", "set", lan, "up")
            _sh("ip", "-n", h, "route", "add", "default", "via", f"192.168.{i}.1")
            _sh("ip", "netns", "exec", r, "sysctl", "-qw", "net.ipv4.ip_forward=1")
            ipt = ["ip", "netns", "exec", r, "iptables"]
            _sh(*ipt, "-t", "nat", "-A", "POSTROUTING", "-s", f"192.168.{i}.0/24", "-o", wan, "-j", "MASQUERADE")
            _sh(*ipt, "-A", "FORWARD", "-i", wan, "-m", "conntrack", "--ctstate", "ESTABLISHED,RELATED", "-j", "ACCEPT")
            _sh(*ipt, "-A", "FORWARD", "-i", wan, "-j", "DROP")  # nothing from outside opens a connection in
            if self.wan_mbit:
                burst = f"{max(4096, int(self.wan_mbit * 1e6 / 8 * 1e-3))}b"
                for ns, dev in ((r, wan), (pub, wan_p)):
                    _sh("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate",
                        f"{self.wan_mbit:g}mbit", "burst", burst, "latency", "400ms")

    # -- use ---------------------------------------------------------------------------------
    def cmd(self, host: str, argv: list[str]) -> list[str]:
        """``argv`` run inside ``host``'s namespace (``pub``, ``h1``, ``h2``, ...)."""
        return ["ip", "netns", "exec", self.ns[host], *argv]

    def masqueraded_packets(self, home: int) -> int:
        """Packets the MASQUERADE rule of home ``home``'s router has translated (new connections leaving it)."""
        out = _sh("ip", "netns", "exec", self.routers[f"r{home}"], "iptables", "-t", "nat", "-L", "POSTROUTING", "-v",
                  "-n", "-x")
        for line in out.splitlines():
            if "MASQUERADE" in line:
                return int(line.split()[0])
        return 0

    def can_connect(self, src: str, dst: str, port: int = 7999, timeout_s: float = 2.0) -> bool:
        """Whether host ``src`` can open a TCP connection to a listener on every address of host ``dst``."""
        listen = (f"import socket,time\ns=socket.socket();s.setsockopt(socket.SOL_SOCKET,socket.SO_REUSEADDR,1)\n"
                  f"s.bind(('0.0.0.0',{port}));s.listen(4);print('up',flush=True);time.sleep({timeout_s + 10})")
        server = subprocess.Popen(self.cmd(dst, ["python3", "-c", listen]), stdout=subprocess.PIPE)
        try:
            server.stdout.readline()
            code = (f"import socket,sys\ns=socket.socket();s.settimeout({timeout_s})\n"
                    f"try:\n s.connect(({self.ip[dst]!r},{port}));sys.exit(0)\nexcept OSError:\n sys.exit(1)")
            r = subprocess.run(self.cmd(src, ["python3", "-c", code]), capture_output=True, timeout=timeout_s + 10)
            return r.returncode == 0
        finally:
            server.kill()
            server.wait(10)
