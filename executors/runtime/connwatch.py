"""Who closed a connection: the peer, or ZeroMQ refusing what it sent (a frame over ``ZMQ_MAXMSGSIZE``).

A bound socket's ``ZMQ_MAXMSGSIZE`` is the receiver's message limit (``limits.py``), so libzmq refuses an
over-limit frame when it reads the frame's length, before a byte of it is buffered: a 960 MiB message of
60 x 16 MiB frames costs the receiver nothing. But libzmq refuses by closing the connection, and its monitor
reports that as ``DISCONNECTED``, the same event as a peer that left.

:class:`ConnectionWatch` tells them apart truthfully: it keeps a duplicate of each accepted connection's
descriptor (the kernel socket then outlives libzmq's close), and when the connection is reported closed it peeks
at the duplicate: end of stream (or a reset) means the peer closed it; anything else (unread bytes, or nothing
yet with the stream still open) means this side closed it on a peer still sending: refused by ZeroMQ (an
over-limit frame or a ZMTP protocol error). A refusal is counted, handed to ``on_refused`` and logged as counts
(at most one line per interval, :class:`~fusion.executors.runtime.keys.RefusalLog`); then the duplicate is closed.

Used by the transport's keyless sockets (``--insecure``, :class:`SocketWatch`) and by the CURVE sockets'
:class:`~fusion.executors.runtime.keys.HandshakeMonitor` (one monitor per socket), both read by the context's
ZAP handler's thread, which drains them before each handshake's answer: the watch holds a connection before
libzmq can read a frame of it (a separate reading thread lagged behind libzmq under load and missed refusals).
"""
from __future__ import annotations

import os
import socket
import struct
import threading
import time
from typing import Callable

import zmq

from fusion.executors.runtime.keys import RefusalLog

#: the monitor events a watch needs
WATCH_EVENTS = zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_CLOSED
#: descriptors a watch duplicates at most (beyond, connections are not told apart; libzmq still bounds them)
MAX_WATCHED = 4096


class ConnectionWatch:
    """Duplicated descriptors of the open connections of one bound socket, and the verdict when one closes."""

    def __init__(self, owner: str, limit_bytes: int, on_refused: Callable[[str], None] | None = None,
                 log_interval_s: float = 10.0):
        self.owner, self.limit_bytes, self.on_refused = owner, limit_bytes, on_refused
        self.refused = 0
        self.log = RefusalLog(owner, f"connection(s) closed by ZeroMQ while the peer was still sending (a frame over "
                                     f"this socket's limit of {limit_bytes} bytes, ZMQ_MAXMSGSIZE, or a protocol "
                                     "error): refused", log_interval_s)
        self._dups: dict[int, tuple[socket.socket, str]] = {}

    def accepted(self, fd: int) -> None:
        if fd < 0 or len(self._dups) >= MAX_WATCHED:
            return
        try:
            s = socket.socket(fileno=os.dup(fd))
        except OSError:
            return
        who = _peer(s)
        old = self._dups.pop(fd, None)
        if old is not None:
            old[0].close()
        self._dups[fd] = (s, who)

    def closed(self, fd: int, now: float | None = None) -> None:
        entry = self._dups.pop(fd, None)
        if entry is None:
            return
        s, who = entry
        try:
            try:
                peer_closed = s.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
            except BlockingIOError:
                peer_closed = False  # the stream is open: this side closed it
            except OSError:
                peer_closed = True  # reset by the peer
        finally:
            s.close()
        if peer_closed:
            return
        self.refused += 1
        reason = (f"connection from {who} closed by ZeroMQ while it was still sending: a frame over the limit of "
                  f"{self.limit_bytes} bytes (ZMQ_MAXMSGSIZE) or a protocol error; refused unread")
        if self.on_refused is not None:
            self.on_refused(reason)
        self.log.note(f"from {who}", time.monotonic() if now is None else now)

    def forget(self, fd: int) -> None:
        """Connection ``fd`` closed for a reason known elsewhere (a handshake that timed out): no verdict."""
        entry = self._dups.pop(fd, None)
        if entry is not None:
            entry[0].close()

    def event(self, kind: int, value: int) -> None:
        """Hand on one monitor event."""
        if kind == zmq.EVENT_ACCEPTED:
            self.accepted(int(value))
        elif kind in (zmq.EVENT_DISCONNECTED, zmq.EVENT_CLOSED):
            self.closed(int(value))

    def close(self) -> None:
        for s, _ in self._dups.values():
            s.close()
        self._dups.clear()


class SocketWatch:
    """The monitor reader of a keyless bound socket, running a :class:`ConnectionWatch`. Create it before ``sock``
    binds and attach it to the context's ZAP handler (:meth:`~fusion.executors.runtime.keys.ZapHandler.attach`),
    which reads it and drains it before each handshake's answer, so the watch holds every connection before a
    frame of it is read (module docstring of ``keys.ZapHandler``)."""

    def __init__(self, sock: zmq.Socket, watch: ConnectionWatch):
        self.watch = watch
        self.sock = sock.get_monitor_socket(WATCH_EVENTS)
        self._done = threading.Event()

    def handle(self, ev: dict, now: float) -> None:
        if not self._done.is_set():
            self.watch.event(ev.get("event", 0), ev.get("value", -1))

    def tick(self, now: float) -> None:
        self.watch.log.flush(now)

    def close(self) -> None:
        self.sock.close(linger=0)
        self.watch.close()

    def stop(self) -> None:
        """Hand on no more events (the socket is closing: its own disconnections are no refusals)."""
        self._done.set()


def _peer(s: socket.socket) -> str:
    """Who is at the other end of connection ``s``: ``host:port`` over TCP, the process over a Unix socket (its pid
    and user, from the kernel: ``SO_PEERCRED``), else ``?``."""
    try:
        if s.family == socket.AF_UNIX:
            pid, uid, _ = struct.unpack("3i", s.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
            return f"pid {pid} (uid {uid})"
        host, port = s.getpeername()[:2]
        return f"{host}:{port}"
    except (OSError, ValueError, struct.error):
        return "?"
