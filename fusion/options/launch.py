"""How ``fusion run`` starts its CompNodes (:class:`LocalLaunch`: processes on this host or Ray actors) and how
``fusion coordinator`` waits for executors started by hand (:class:`Listen`); what both do when a CompNode fails."""
from __future__ import annotations

import socket
from dataclasses import dataclass

from fusion.options.field import Section, option
from fusion.options.types import non_negative_int, positive_float, positive_int, zmq_address


def check_reachable(address: str, timeout_s: float = 10.0) -> None:
    """A ``--ray HOST:PORT`` that accepts no TCP connection is a one-line error, not a long Ray retry loop."""
    from fusion.ir.errors import FusionError

    if address in ("auto", "local") or "://" in address:
        return
    host, colon, port = address.rpartition(":")
    if not colon or not port.isdigit():
        raise FusionError(f"--ray {address!r}: expected HOST:PORT of the Ray head (e.g. 10.0.0.1:6379), "
                          "auto, or ray://HOST:10001")
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
    except OSError as e:
        raise FusionError(f"--ray {address}: no Ray head answers there ({e.strerror or e}); "
                          f"start one with `ray start --head --port={port}`") from None


@dataclass
class LocalLaunch(Section):
    """``fusion run``'s CompNodes: one executor process each on this host, or Ray actors (``--ray``)."""

    TITLE = "launching the CompNodes"

    threads: int | None = option("--threads", type=positive_int, help="threads per executor (default: cores / CompNodes; with --ray, torch's default on each node)")
    trace: str = option("--trace", default="on", choices=("on", "off"), help="write a Chrome trace per CompNode under OUT/trace (default on; spilled to disk as it grows)")
    links: str = option("--links", default="ipc", choices=("ipc", "curve"), help="how the processes of a run on this host talk (not with --ray, whose links are CURVE): ipc (default): Unix sockets in a fresh directory of mode 0700, which only your user's processes can open, no cipher; curve: loopback TCP authenticated and encrypted with fresh keys in OUT/keys (docs/runtime.md)")
    insecure: bool = option("--insecure", kind="flag", help="plain loopback TCP: links between the local processes are neither authenticated nor encrypted, and any process on this host can send them messages (default: --links)")
    trust_plugins: bool = option("--trust-plugins", kind="flag", help="let executors import the plugin files (Python code) the plan lists; without it such a plan is refused")
    device: str = option("--device", essential=True, default="cpu", metavar="DEV", help="torch device of every CompNode's engine (cpu, cuda, cuda:0, ...); CompNodes may share one GPU")
    compile_parts: bool = option("--compile-parts", kind="flag", exclusive="parts", help="torch engine: torch.compile each part's generated module (slow first step)")
    interpreted_parts: bool = option("--interpreted-parts", kind="flag", exclusive="parts", help="torch engine: walk each part node by node instead of one generated function")
    heap: str = option("--heap", default="steady", choices=("steady", "default"), help="every CompNode's C allocator (fusion executor --heap): steady (default) keeps freed tensor memory for the next step instead of unmapping and page-faulting it in again; default: as is")
    ray: str | None = option("--ray", metavar="ADDRESS", help="run each CompNode as a Ray actor on the node of an existing Ray cluster (HOST:PORT of its head, or auto) that has the resource fusion-dev:<device> of its device; needs pip install 'fusion[ray]' (see docs/runtime.md)")
    max_restarts: int = option("--max-restarts", default=0, type=non_negative_int, metavar="N", help="when a CompNode dies or stops answering, kill every executor, start them again from the latest complete checkpoint and train on, at most N times (needs --checkpoint-every; each restart is an event line in metrics.jsonl; default 0: the run ends at the first failure)")

    def check(self) -> None:
        """The device this host runs (a Ray node checks its own), and with ``--ray`` Ray itself and its head."""
        if not self.ray:
            from fusion.options.device import check_device

            check_device(self.device)
            return
        from fusion.executors.runtime.ray_cluster import import_ray

        import_ray()  # before a long compile: without Ray, one line saying how to install it
        check_reachable(self.ray)  # and a head that is not there is one line too

    def executor_flags(self, trust: bool) -> list[str]:
        """The ``fusion executor`` flags this run passes on to every CompNode."""
        flags = ["--trust-plugins"] if trust else []
        if self.device != "cpu":
            flags += ["--device", self.device]
        if self.compile_parts:
            flags.append("--compile-parts")
        if self.interpreted_parts:
            flags.append("--interpreted-parts")
        if self.heap != "steady":
            flags += ["--heap", self.heap]
        return flags


@dataclass
class Listen(Section):
    """``fusion coordinator``: where it listens for executors started by hand, and how long it waits for them."""

    TITLE = "listening for executors"

    bind: str = option("--bind", type=zmq_address, metavar="ADDR", required=True, help="address to listen on, tcp://HOST:PORT, e.g. tcp://*:5600")
    startup_timeout: float = option("--startup-timeout", default=120.0, type=positive_float, help="give up when the executors have not all said hello after this long (s)")
    max_restarts: int = option("--max-restarts", default=0, type=non_negative_int, metavar="N", help="when a CompNode dies or stops answering, tell every executor to stop, wait for a new executor of every part (started by you or a supervisor such as systemd with Restart=on-failure) and train on from the latest complete checkpoint, at most N times (needs --checkpoint-every; each restart is an event line in metrics.jsonl; default 0: the run ends at the first failure)")
    restart_wait: float = option("--restart-wait", default=300.0, type=positive_float, metavar="SECONDS", help="with --max-restarts: how long a restart waits for a new executor of every part (default 300)")


@dataclass
class Security(Section):
    """CURVE keys of a process started by hand (``fusion executor``, ``fusion coordinator``)."""

    TITLE = "links and security"

    key: str | None = option("--key", essential=True, metavar="FILE", help="this process's secret key file from `fusion keys` (owner-only permissions): authenticate and encrypt every link with CURVE")
    public_keys: str | None = option("--public-keys", metavar="FILE", help="the run's public keys (default: PLAN/public_keys.json, written by `fusion keys`)")
    insecure: bool = option("--insecure", kind="flag", help="no authentication or encryption: any process that reaches the address can send messages (loopback experiments only)")
