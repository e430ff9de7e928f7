"""Fast failure detection: ZeroMQ heartbeats on the links to the peers, and the links' socket monitors.

ZMTP 3.1 has PING and PONG commands (ZeroMQ RFC 37): with ``ZMQ_HEARTBEAT_IVL`` libzmq's I/O thread sends a PING
on the connection every interval, and with ``ZMQ_HEARTBEAT_TIMEOUT`` it closes the connection when nothing comes
back within the timeout of a PING. The peer's I/O thread answers: a native thread, so a CompNode whose Python is
busy (a long forward, or the GIL held for seconds) still answers (``tests/executors/runtime/test_liveness.py``).
A SIGKILLed peer's connections are closed by its kernel, which the link's monitor reports at once
(``EVENT_DISCONNECTED``); a SIGSTOPped one (every thread stopped) or one cut off answers nothing, and the
connection is closed when the timeout runs out. Either way the link is *down*; a link down for
:data:`GRACE_S` without coming back (libzmq reconnects by itself after 0.1 s) has failed, which bounds detection
by :class:`Heartbeat` ``.bound_s`` (``--link-timeout``), against the ``--peer-timeout`` of silence (10 s) that
the coordinator's application heartbeats need, since a Python thread of a loaded host can be late by seconds.

The coordinator watches its link to each CompNode (the DEALER it sends on): :meth:`LinkWatch.down` says whether
and why a part's link is down. After the disconnection the watch also reads how the reconnection fares (refused:
nothing listens there any more; connected but no handshake: the process is stopped or frozen) for the reason.

A heartbeat waits behind whatever the link is still sending: a link that needs longer than the timeout to send
one message (many MiB over a slow WAN link) needs a larger ``--link-timeout`` (or 0: off).

Each process's ZeroMQ context has two I/O threads, one for the bound socket that receives (the PONGs a peer's
PINGs get, its handshakes) and one for the links it sends on (:func:`io_context`): under CURVE, libzmq encrypts or
decrypts a whole frame in one call on the connection's I/O thread, so with one thread a part sending the
coordinator a large frame (a 1.5 GB frame takes over 1.25 s here) could not answer the coordinator's PING on the
other connection and was reported failed while alive (``bench_scale.py``'s final weights fetch at GPT-2 small;
``tests/executors/runtime/test_liveness.py``).
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

import zmq

log = logging.getLogger(__name__)

#: seconds a link may be down before its peer has failed: libzmq's reconnection (0.1 s) has its chance to come
#: back, and a local process's exit status (the better reason) to be read
GRACE_S = 0.25
#: the monitor events a watch reads: the link up (handshake done), down, and how its reconnection fares
EVENTS = (zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECTED | zmq.EVENT_CONNECT_RETRIED
          | zmq.EVENT_MONITOR_STOPPED)


#: a process's ZeroMQ I/O threads: the first serves the bound (receiving) socket, the second the links it sends on
IO_THREADS = 2
RECEIVING, SENDING = 0b01, 0b10  # ``ZMQ_AFFINITY`` masks of the two


def io_context() -> zmq.Context:
    """A process's ZeroMQ context: one I/O thread receives, one sends (module docstring); pass each socket through
    :func:`receiving` or :func:`sending` before it binds or connects."""
    return zmq.Context(io_threads=IO_THREADS)


def receiving(sock: zmq.Socket) -> zmq.Socket:
    """Serve the bound socket ``sock`` on the receiving I/O thread (before it binds)."""
    sock.setsockopt(zmq.AFFINITY, RECEIVING)
    return sock


def sending(sock: zmq.Socket) -> zmq.Socket:
    """Serve the outbound link ``sock`` on the sending I/O thread (before it connects)."""
    sock.setsockopt(zmq.AFFINITY, SENDING)
    return sock


@dataclass(frozen=True)
class Heartbeat:
    """ZeroMQ heartbeats of a link.

    bound_s: the most seconds from a peer's death or stop to its link being reported failed, on a quiet host
    (``--link-timeout``; 0: no heartbeats, no link watch). A PING every quarter of it; a PING unanswered for
    ``bound_s`` - interval - :data:`GRACE_S` closes the connection; the link is then failed :data:`GRACE_S` later.
    """

    bound_s: float

    @property
    def interval_s(self) -> float:
        return self.bound_s / 4

    @property
    def timeout_s(self) -> float:
        return max(0.1, self.bound_s - self.interval_s - GRACE_S)

    def apply(self, sock: zmq.Socket) -> None:
        """Set the heartbeat options of ``sock`` (before it connects)."""
        sock.setsockopt(zmq.HEARTBEAT_IVL, max(1, int(self.interval_s * 1000)))
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, max(1, int(self.timeout_s * 1000)))


@dataclass
class _Link:
    """One watched link: up (handshake done at least once since the last disconnection), when it went down, and
    what its reconnection did since."""

    mon: zmq.Socket
    up: bool = False
    down_at: float | None = None
    after: str = ""  # "refused" (reconnecting fails) or "silent" (a TCP connection but no handshake)


class LinkWatch(threading.Thread):
    """The monitors of one process's outbound links, read by one thread; :meth:`down` answers for a peer."""

    def __init__(self, owner: str, heartbeat: Heartbeat):
        super().__init__(name=f"links-{owner}", daemon=True)
        self.owner, self.heartbeat = owner, heartbeat
        self._links: dict[str, _Link] = {}
        self._new: list[tuple[str, zmq.Socket]] = []
        self._lock = threading.Lock()
        self._done = threading.Event()

    def watch(self, peer: str, sock: zmq.Socket) -> None:
        """Heartbeat and watch ``sock``, the link to ``peer``: call in the thread that owns it, before it
        connects."""
        self.heartbeat.apply(sock)
        mon = sock.get_monitor_socket(EVENTS)
        with self._lock:
            self._new.append((peer, mon))

    def down(self, peer: str, now: float | None = None) -> str | None:
        """Why ``peer``'s link has failed (down for :data:`GRACE_S` and not back), or None."""
        now = time.monotonic() if now is None else now
        with self._lock:
            link = self._links.get(peer)
            if link is None or link.down_at is None or now - link.down_at < GRACE_S:
                return None
            after, since = link.after, now - link.down_at
        how = {"refused": "; reconnecting fails (nothing listens there: the process is gone, or the host is cut off)",
               "silent": "; a new connection gets no handshake (the process is stopped or frozen)"}.get(after, "")
        return (f"its link from {self.owner} is down ({since:.1f} s): the connection closed, or ZeroMQ heartbeats "
                f"went unanswered for {self.heartbeat.timeout_s:.2f} s{how} (--link-timeout "
                f"{self.heartbeat.bound_s:g})")

    def run(self) -> None:
        from zmq.utils.monitor import recv_monitor_message

        poller = zmq.Poller()
        by_mon: dict[zmq.Socket, str] = {}
        try:
            while not self._done.is_set():
                with self._lock:
                    new, self._new = self._new, []
                    for peer, mon in new:
                        old = self._links.pop(peer, None)
                        if old is not None:  # a new link to the same peer (a reconnected sender)
                            poller.unregister(old.mon)
                            by_mon.pop(old.mon, None)
                            old.mon.close(linger=0)
                        self._links[peer] = _Link(mon)
                        by_mon[mon] = peer
                        poller.register(mon, zmq.POLLIN)
                if not by_mon:  # (pyzmq returns at once from a poll with nothing registered: it would spin)
                    self._done.wait(0.1)
                    continue
                for mon, _ in poller.poll(100):
                    ev = recv_monitor_message(mon)
                    self._event(by_mon[mon], mon, ev.get("event", 0), poller, by_mon)
        except zmq.ZMQError:
            pass  # the context is closing
        finally:
            with self._lock:
                for mon in [*by_mon, *(m for _, m in self._new)]:
                    mon.close(linger=0)
                self._new, self._links = [], {}

    def _event(self, peer: str, mon: zmq.Socket, kind: int, poller: zmq.Poller, by_mon: dict) -> None:
        now = time.monotonic()
        with self._lock:
            link = self._links.get(peer)
            if link is None or link.mon is not mon:
                return
            if kind == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                link.up, link.down_at, link.after = True, None, ""
            elif kind == zmq.EVENT_DISCONNECTED and link.up:
                link.up, link.down_at, link.after = False, now, ""
            elif kind == zmq.EVENT_CONNECT_RETRIED and link.down_at is not None:
                link.after = "refused"
            elif kind == zmq.EVENT_CONNECTED and link.down_at is not None:
                link.after = "silent"
            elif kind == zmq.EVENT_MONITOR_STOPPED:  # the socket closed: no longer watched
                self._links.pop(peer, None)
                poller.unregister(mon)
                by_mon.pop(mon, None)
                mon.close(linger=0)

    def stop(self) -> None:
        self._done.set()
