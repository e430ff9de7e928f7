"""The transport: ZeroMQ sockets carrying wire-encoded messages, one address per process.

Each process (a CompNode executor or the coordinator) binds one ROUTER socket
at its address; everything it receives arrives there, tagged by ZeroMQ with
the sender's identity (its part name). To talk to a peer it opens one DEALER
socket connected to that peer's address. ZeroMQ's own I/O thread moves the
bytes, so a send returns at once and overlaps the sender's compute. A link
is either *threaded* (a sender thread with a queue owns the socket; needed
for per-link emulation, :mod:`fusion.executors.runtime.linkemu`, and for sockets
shared by several threads) or *direct* (the one thread that uses it sends
itself, saving a thread hand-off per message).

Receiving, likewise, runs on a receive thread or in the caller's thread via
:meth:`Transport.pump`. Either way each message is decoded and checked
(:func:`fusion.ir.wire.decode`), then the sender identity is checked against
the allowed names; a message that fails is logged with the reason and
dropped, never raised. Good messages go to the ``on_message`` callback.

With a :class:`~fusion.executors.runtime.keys.Security` (CURVE, the default of
``fusion run`` and of multi-host runs) the ROUTER is a CURVE server whose ZAP
handler admits only keys of the run, and every DEALER is a CURVE client that
checks the peer's key: the sender of a message is then the name its
*authenticated key* has (ZeroMQ's ``User-Id`` frame property), checked before
its bytes are decoded; a DEALER's self-declared identity is not used at all.

Every wait has a timeout: sends give up after ``send_timeout_s`` on a peer
that does not take data, and receive loops wake up to notice ``close``.
"""
from __future__ import annotations

import heapq
from collections import deque
import itertools
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable

import zmq

from fusion.ir.errors import FusionError, WireError
from fusion.ir.wire import DEFAULT_MAX_MESSAGE_BYTES, MAX_TENSORS, Message, decode, frames_nbytes
from fusion.executors.runtime.keys import (HANDSHAKE_S, HandshakeMonitor, Security, ZapHandler, curve_client, curve_server,
                                           zap_gate)
from fusion.executors.runtime.connwatch import ConnectionWatch, SocketWatch
from fusion.executors.runtime.liveness import Heartbeat, LinkWatch, io_context, receiving, sending
from fusion.executors.runtime.linkemu import EmulatedLink
from fusion.executors.runtime.trace_events import Tracer

log = logging.getLogger(__name__)

#: a sender with more rejected messages than this within REJECT_WINDOW_S is cut off: named, and everything it sends
#: afterwards is dropped unread (a peer of the run cut off this way is reported through ``on_error``: the run stops)
REJECT_LIMIT = 100
REJECT_WINDOW_S = 10.0
#: senders whose recent rejects are remembered (an attacker rotating names cannot grow this without bound)
MAX_TRACKED_SENDERS = 1024
#: frames one received message may have: the ROUTER's identity frame, the header, at most MAX_TENSORS tensor frames
#: (what :func:`fusion.ir.wire.decode` accepts); frames past this are received and released one at a time, unkept
MAX_FRAMES = 2 + MAX_TENSORS
#: connections a CURVE socket keeps open at once beyond two per allowed sender (each takes a file descriptor; a
#: client that finishes no handshake is dropped after ZeroMQ's handshake interval, 30 s, but could open more meanwhile)
SPARE_CONNECTIONS = 64
#: bytes a frame may have over the message limit on the wire: ZMTP's and CURVE's own framing of it (ZMQ_MAXMSGSIZE)
FRAME_SLACK = 256


@dataclass(frozen=True)
class _Oversized:
    """A received message over the bounds: its first two frames (the ROUTER's identity frame and the first frame
    the peer sent, which carries the connection's ``User-Id``) and why; the rest of it was released frame by frame
    as it was read, never held."""

    head: list
    reason: str


def recv_bounded(sock, max_bytes: int, max_frames: int = MAX_FRAMES, flags: int = 0) -> "list | _Oversized":
    """One message from ``sock``, read frame by frame: its frames, or an :class:`_Oversized` as soon as the frame
    count passes ``max_frames`` or the bytes after the first frame pass ``max_bytes`` (the rest is then read and
    dropped one frame at a time, so this process never holds more than the bound of one message).

    libzmq hands a multipart message to the application only once all its frames have arrived, each checked
    against ``ZMQ_MAXMSGSIZE`` on its own; what this bounds is the memory the process keeps (and the Python
    objects it makes) for a message of many frames, not libzmq's own buffering of it."""
    first = sock.recv(flags, copy=False)
    frames, nbytes, reason = [first], 0, ""
    more = first.more
    while more:
        f = sock.recv(copy=False)  # the rest of a multipart message is already here: never blocks
        more = f.more
        if reason:
            continue  # released at once
        nbytes += len(f.buffer)
        if len(frames) + 1 > max_frames:
            reason = f"message of more than {max_frames} frames (the most a message of the run has)"
        elif nbytes > max_bytes:
            reason = f"message of at least {nbytes} bytes exceeds the maximum of {max_bytes} bytes"
        if reason:
            frames = (frames + [f])[:2]
            continue
        frames.append(f)
    return _Oversized(frames, reason) if reason else frames

@dataclass(frozen=True)
class _Stop:
    """Queued last: flush what is queued, then close the socket, waiting ``linger_s`` for unsent data."""

    linger_s: float


class TransportError(FusionError):
    """A peer could not be reached or the local address could not be bound."""


@dataclass
class LinkStats:
    """Bytes and messages sent to one peer, and seconds its link spent transmitting."""

    bytes: int = 0
    messages: int = 0
    busy_s: float = 0.0


@dataclass(order=True)
class _Pending:
    deliver_at: float
    seq: int
    frames: list = field(compare=False)
    nbytes: int = field(compare=False)
    label: str = field(compare=False)
    tx: tuple[float, float] = field(compare=False)


def _dealer(t: "Transport", address: str, peer: str):
    sock = sending(t.ctx.socket(zmq.DEALER))
    if t.security is not None:
        curve_client(sock, t.security, peer)  # the receiver names this socket by its key, not by an identity
    else:
        sock.setsockopt(zmq.IDENTITY, t.name.encode())
    sock.setsockopt(zmq.LINGER, int(t.linger_s * 1000))
    sock.setsockopt(zmq.SNDHWM, 10_000)
    sock.setsockopt(zmq.SNDTIMEO, int(t.send_timeout_s * 1000))
    if t.links is not None:  # ZeroMQ heartbeats and a monitor on the link (liveness.py)
        t.links.watch(peer, sock)
    sock.connect(address)
    return sock


class _Sender(threading.Thread):
    """Owns the DEALER socket to one peer; emulates the link when given one."""

    def __init__(self, transport: "Transport", peer: str, address: str, link: EmulatedLink | None,
                 max_bytes: int | None = None):
        super().__init__(name=f"send-{peer}", daemon=True)
        self.t, self.peer, self.address, self.link = transport, peer, address, link
        #: the most bytes one message to this peer may have (the peer's receive limit; None: unchecked here)
        self.max_bytes = max_bytes
        #: why this link can send no more (its thread failed); a send after that raises instead of queueing unread
        self.failed: str | None = None
        self.q: queue.SimpleQueue = queue.SimpleQueue()
        self.stats = LinkStats()
        self._seq = itertools.count()

    def put(self, frames: list, label: str) -> None:
        self.q.put((frames, label))

    def stop(self, linger_s: float) -> None:
        self.q.put(_Stop(linger_s))

    def run(self) -> None:
        heap: list[_Pending] = []
        stopping: _Stop | None = None
        sock = None
        try:
            sock = _dealer(self.t, self.address, self.peer)
            while True:
                now = time.monotonic()
                while heap and heap[0].deliver_at <= now:
                    self._send(sock, heapq.heappop(heap))
                if stopping and not heap:
                    break
                timeout = max(0.0, heap[0].deliver_at - now) if heap else 0.2
                try:
                    item = self.q.get(timeout=timeout) if timeout > 0 else self.q.get_nowait()
                except queue.Empty:
                    continue
                if isinstance(item, _Stop):
                    stopping = item
                    continue
                frames, label = item
                nbytes = frames_nbytes(frames)
                now = time.monotonic()
                if self.link is None:
                    self._send(sock, _Pending(now, next(self._seq), frames, nbytes, label, (now, now)))
                else:
                    s, e, d = self.link.schedule(nbytes, now)
                    heapq.heappush(heap, _Pending(d, next(self._seq), frames, nbytes, label, (s, e)))
        except Exception as e:  # noqa: BLE001 - a dead sender thread would swallow every later message unsent
            lost = len(heap) + self.q.qsize()
            self.failed = (f"the link to {self.peer} at {self.address} failed ({type(e).__name__}: {str(e)[:200]}); "
                           f"{lost} queued message(s) were not sent")
            log.exception("%s: %s", self.t.name, self.failed)
            self.t.report_error(self.peer, self.failed)
        finally:
            if sock is not None:
                sock.close(linger=int((stopping.linger_s if stopping else self.t.linger_s) * 1000))

    def _send(self, sock, p: _Pending) -> None:
        t0 = time.monotonic()
        try:
            sock.send_multipart(p.frames, copy=False)
        except zmq.Again:
            reason = f"peer {self.peer} at {self.address} did not take a message within {self.t.send_timeout_s:.1f} s"
            log.error(reason)
            self.t.report_error(self.peer, reason)
            return
        except zmq.ZMQError as e:
            self.t.report_error(self.peer, f"sending to {self.peer} failed: {e}")
            return
        t1 = time.monotonic()
        s, e = p.tx if self.link is not None else (t0, t1)
        self.stats.bytes += p.nbytes
        self.stats.messages += 1
        self.stats.busy_s += e - s
        if self.t.tracer is not None and p.label:
            off = time.time() - time.monotonic()
            self.t.tracer.add(p.label, "send", (s + off) * 1e6, (e + off) * 1e6, f"send -> {self.peer}",
                              bytes=p.nbytes, delivered_ms=round((p.deliver_at - s) * 1e3, 3))


class _Direct(_Sender):
    """A link without emulation used by one thread only: the caller's thread sends (ZeroMQ's I/O thread still
    moves the bytes in the background), saving a thread hand-off per message. Created and used by that thread."""

    def __init__(self, transport: "Transport", peer: str, address: str, max_bytes: int | None = None):
        super().__init__(transport, peer, address, None, max_bytes)
        self._sock = None

    def start(self) -> None:  # no thread; connect now, so that this process holds its identity at the peer from
        # setup on (a ROUTER ignores a second connection under a taken identity: a squatter arriving later is ignored)
        if self._sock is None:
            self._sock = _dealer(self.t, self.address, self.peer)

    def is_alive(self) -> bool:
        return False

    def join(self, timeout: float | None = None) -> None:
        pass

    def put(self, frames: list, label: str) -> None:
        if self._sock is None:
            self._sock = _dealer(self.t, self.address, self.peer)
        now = time.monotonic()
        self._send(self._sock, _Pending(now, 0, frames, frames_nbytes(frames), label, (now, now)))

    def stop(self, linger_s: float) -> None:
        if self._sock is not None:
            self._sock.close(linger=int(linger_s * 1000))
            self._sock = None


class Transport:
    """One process's messaging endpoint.

    name:        this process's identity (a part name or ``"coordinator"``).
    bind:        ZeroMQ endpoint to bind, e.g. ``tcp://127.0.0.1:*`` (ephemeral port) or ``tcp://*:5555``.
    allowed:     names whose messages are accepted; others are logged and dropped.
    on_message:  ``fn(sender, Message)`` called for each good message.
    on_reject:   ``fn(sender, reason)`` called for each dropped message (after logging).
    security:    CURVE keys (this process's pair, every peer's public key); None: plain TCP, senders name
                 themselves (``--insecure``).
    max_connections: with CURVE, the cap on connections open at once on the bound socket (default: two per
                 allowed sender plus SPARE_CONNECTIONS); connections accepted beyond it are shut down at once and
                 counted in the log (:class:`~fusion.executors.runtime.keys.HandshakeMonitor`).
    heartbeat:   ZeroMQ heartbeats on every outbound link, each watched (:attr:`links`,
                 :class:`~fusion.executors.runtime.liveness.LinkWatch`): a peer that dies, stops or is cut off is
                 known within ``heartbeat.bound_s``; None: no heartbeats (the coordinator sets it).
    recv_thread: receive on a thread of the transport (``on_message`` runs there); False: the thread that
                 called :meth:`start` receives by calling :meth:`pump` while it waits (a CompNode's engine
                 loop, which saves a thread hand-off per message; ZeroMQ's I/O thread still receives the
                 bytes in the background).
    """

    def __init__(self, name: str, bind: str, allowed: Iterable[str], on_message: Callable[[str, Message], None],
                 *, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES, tracer: Tracer | None = None,
                 on_reject: Callable[[str, str], None] | None = None, on_error: Callable[[str, str], None] | None = None,
                 send_timeout_s: float = 30.0, linger_s: float = 2.0, recv_thread: bool = True,
                 security: Security | None = None, max_connections: int | None = None,
                 heartbeat: Heartbeat | None = None):
        self.name, self.bind_addr = name, bind
        #: the outbound links' heartbeats and monitors (None without ``heartbeat``)
        self.links = LinkWatch(name, heartbeat) if heartbeat is not None else None
        if self.links is not None:
            self.links.start()
        self.security = security
        self.allowed = set(allowed)
        #: with CURVE, connections open at once on the bound socket beyond which new ones are shut down
        self.max_connections = max_connections or 2 * len(self.allowed) + SPARE_CONNECTIONS
        self.on_message, self.on_reject, self.on_error = on_message, on_reject, on_error
        self.max_message_bytes, self.tracer = max_message_bytes, tracer
        self.send_timeout_s, self.linger_s = send_timeout_s, linger_s
        self.ctx = io_context()  # one I/O thread receives, one sends (liveness.py)
        self.monitor: HandshakeMonitor | None = None
        self.watch: SocketWatch | None = None  # keyless sockets: who closed a connection (connwatch.py)
        # the ZAP handler is bound in this context before any socket binds; keyless, it only orders (keys.py)
        self.zap = ZapHandler(self.ctx, name, security, on_reject=self._on_refused)
        self.zap.start()
        self.senders: dict[str, _Sender] = {}
        self.address = ""
        self.rejected = 0
        self.escaped = 0  # rejects whose reason was not a WireError (a check missing somewhere): should stay 0
        self.cut_off: dict[str, str] = {}  # sender -> why its messages are dropped unread
        self._recent_rejects: dict[str, deque] = {}
        self._reject_lock = threading.Lock()
        self._stop = threading.Event()
        self._bound = threading.Event()
        self._bind_error: str | None = None
        self._recv = threading.Thread(target=self._recv_loop, name=f"recv-{name}", daemon=True) if recv_thread else None
        self._sock = None  # the ROUTER socket when pumped by the caller
        self.relay = None  # the RelayClient once a relayed link or --dial-out needs one (relay.py)
        self._pull = None  # relayed messages, opened, from the relay client's thread (made by the receiving thread)

    # -- lifecycle ---------------------------------------------------------------------
    def start(self, timeout_s: float = 10.0) -> str:
        """Bind and start receiving; returns the bound address (ephemeral port resolved)."""
        if self._recv is None:
            self._sock = self._bind()
            if self._sock is None:
                raise TransportError(f"{self.name}: cannot bind {self.bind_addr}: {self._bind_error}")
            return self.address
        self._recv.start()
        if not self._bound.wait(timeout_s):
            raise TransportError(f"{self.name}: binding {self.bind_addr} did not finish within {timeout_s} s")
        if self._bind_error:
            raise TransportError(f"{self.name}: cannot bind {self.bind_addr}: {self._bind_error}")
        return self.address

    def connect(self, peer: str, address: str, link: EmulatedLink | None = None, direct: bool = False,
                max_bytes: int | None = None) -> None:
        """Open the outbound link to ``peer`` (idempotent).

        direct: the link is used by one thread only and not emulated; that
        thread then hands messages to ZeroMQ itself instead of through a
        sender thread (ZeroMQ's own I/O thread still sends in the background).
        max_bytes: the peer's receive limit (``limits.py``, the same function of the plan on both ends): a larger
        message is refused here by :meth:`send`, naming it, instead of being dropped by the receiver (ZeroMQ drops
        a frame over ``ZMQ_MAXMSGSIZE`` and the connection without a word to either side).
        """
        if peer in self.senders:
            return
        from fusion.executors.runtime.relay import RelayedLink, relay_target

        if relay_target(address) is not None:  # a peer that only dials out: through the relay, sealed (relay.py)
            self.join_relay(relay_target(address))
            s: _Sender = RelayedLink(self, peer, address, max_bytes, LinkStats())
        else:
            s = (_Direct(self, peer, address, max_bytes) if direct and link is None
                 else _Sender(self, peer, address, link, max_bytes))
        self.senders[peer] = s
        s.start()

    def join_relay(self, address: str, timeout_s: float = 30.0) -> None:
        """Register with the relay at ``address`` (idempotent): messages sealed for this process reach it through
        there (:mod:`fusion.executors.runtime.relay`). Needs CURVE keys; one relay per transport."""
        from fusion.executors.runtime.relay import RelayClient, relay_overhead

        if self.relay is not None:
            if self.relay.address != address:
                raise TransportError(f"{self.name}: already using the relay at {self.relay.address}, not {address}")
            return
        if self.security is None:
            raise TransportError(f"{self.name}: a link through the relay at {address} needs CURVE keys (--key), not "
                                 "--insecure: the relay must not be able to read or forge the traffic")
        try:
            client = RelayClient(self.ctx, self.security, address, MAX_FRAMES - 1,
                                 on_reject=lambda who, why: self.reject(who, why), send_timeout_s=self.send_timeout_s,
                                 max_bytes=self.max_message_bytes + FRAME_SLACK + relay_overhead(MAX_FRAMES),
                                 on_gone=self._relay_gone)
        except FusionError as e:
            raise TransportError(str(e)) from None
        try:
            client.start(timeout_s)
        except BaseException as e:
            client.close()
            if isinstance(e, FusionError):
                raise TransportError(str(e)) from None
            raise
        self.relay = client

    def _relay_gone(self, peer: str) -> None:
        """The relay says ``peer``'s connection to it is gone (the peer died, stopped or was cut off, and its
        heartbeats went unanswered): a link this transport sends on through the relay has failed, reported through
        ``on_error`` like any failed link (each notice; the owner keeps the first). The link is not marked failed:
        :meth:`send` would then raise in the sender's thread (the coordinator's heartbeats) instead of the run
        stopping by its failure path. (A relay could only lie here as it could drop the peer's traffic.)"""
        from fusion.executors.runtime.relay import RelayedLink

        if isinstance(self.senders.get(peer), RelayedLink) and self.relay is not None:
            self.report_error(peer, f"its connection to the relay at {self.relay.address} is gone (closed, or its "
                                    "heartbeats went unanswered: the process died, stopped or was cut off)")

    def send(self, peer: str, frames: list, label: str = "") -> None:
        """Send a message to ``peer`` without waiting for it to leave. ``label`` names its trace span."""
        s = self.senders.get(peer)
        if s is None:
            raise TransportError(f"{self.name}: no link to {peer!r}")
        if s.failed:
            raise TransportError(f"{self.name}: cannot send {label or 'a message'} to {peer}: {s.failed}")
        if len(frames) > MAX_FRAMES - 1:  # (the receiver's count includes the ROUTER's identity frame)
            raise TransportError(f"{self.name}: {label or 'a message'} to {peer} has {len(frames)} frames, more than "
                                 f"the {MAX_FRAMES - 1} a receiver takes")
        if s.max_bytes is not None:
            nbytes = frames_nbytes(frames)
            if nbytes > s.max_bytes:
                raise TransportError(f"{self.name}: {label or 'a message'} to {peer} is {nbytes} bytes, over {peer}'s "
                                     f"limit of {s.max_bytes} bytes (executors/runtime/limits.py); the receiver would "
                                     "drop it")
        s.put(frames, label)

    def close(self, timeout_s: float = 5.0, linger_s: float | None = None) -> None:
        """Flush queued sends (up to ``timeout_s``), stop threads, release sockets.

        linger_s: how long a closing socket may keep trying to deliver what is
        still unsent (default: the transport's ``linger_s``); short when the
        peers may be gone already.
        """
        for t in (self.watch, self.monitor, self.links):  # first: the closing sockets' own disconnections are no
            # refusals nor failed links
            if t is not None:
                t.stop()
        for s in self.senders.values():
            s.stop(self.linger_s if linger_s is None else linger_s)
        deadline = time.monotonic() + timeout_s
        for s in self.senders.values():
            s.join(max(0.0, deadline - time.monotonic()))
        self._stop.set()
        if self._recv is not None and self._recv.ident is not None:
            self._recv.join(max(0.5, deadline - time.monotonic()))
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        if self.relay is not None:
            self.relay.close()
        if self._pull is not None:
            self._pull.close(linger=0)
            self._pull = None
        for t in (self.zap, self.links):
            if t is not None:
                t.stop()
                t.join(1.0)
        helpers = [t for t in (self._recv, self.zap, self.links) if t is not None]
        if not any(s.is_alive() for s in self.senders.values()) and not any(t.is_alive() for t in helpers):
            self.ctx.term()  # a thread still stuck in a socket call would make term() block; daemons die with the process

    def stats(self) -> dict[str, LinkStats]:
        return {p: s.stats for p, s in self.senders.items()}

    def report_error(self, peer: str, reason: str) -> None:
        if self.on_error is not None:
            self.on_error(peer, reason)

    # -- receiving --------------------------------------------------------------------
    def _bind(self):
        """The bound ROUTER socket, or None (``_bind_error`` says why)."""
        sock = receiving(self.ctx.socket(zmq.ROUTER))
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, 100_000)
        # libzmq refuses a frame over the limit when it reads its length, before buffering a byte of it, and closes
        # the connection; the watch below tells that apart from a peer leaving and logs it (connwatch.py)
        sock.setsockopt(zmq.MAXMSGSIZE, min(self.max_message_bytes + FRAME_SLACK, (1 << 62)))
        watch = ConnectionWatch(self.name, self.max_message_bytes + FRAME_SLACK,
                                on_refused=lambda why: self.reject("?refused connection", why, quiet=True))
        # the monitor exists before the first connection and is read by the ZAP handler, which drains it before each
        # handshake's answer: the watch holds every connection before a frame of it is read (keys.ZapHandler)
        if self.security is not None:
            # a connection that has not finished its CURVE handshake by then is dropped (libzmq's default: 30 s)
            sock.setsockopt(zmq.HANDSHAKE_IVL, int(HANDSHAKE_S * 1000))
            curve_server(sock, self.security)
            self.monitor = HandshakeMonitor(sock, self.name, on_fail=lambda why: self.reject("?unauthenticated", why,
                                                                                          quiet=True),
                                            max_connections=self.max_connections, watch=watch)
            reader = self.monitor
        else:
            zap_gate(sock)
            self.watch = reader = SocketWatch(sock, watch)
        try:
            sock.bind(self.bind_addr)
            self.address = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        except zmq.ZMQError as e:
            self._bind_error = str(e)
            reader.close()
            sock.close()
            return None
        if self.monitor is not None:
            self.monitor.local = self.address
        self.zap.attach(reader)
        return sock

    def pump(self, timeout_s: float) -> int:
        """Handle what has arrived, waiting up to ``timeout_s`` for the first message (caller-receives mode)."""
        if self._sock is None:
            time.sleep(timeout_s)
            return 0
        pull = self._relay_pull()
        if pull is not None:
            zmq.select([self._sock, pull], [], [], max(0.0, timeout_s))
            return self._drain(self._sock) + self._drain(pull)
        if self._sock.poll(max(0, int(timeout_s * 1000))):
            return self._drain(self._sock)
        return 0

    def _drain(self, sock) -> int:
        """Handle every message waiting on ``sock`` (the ROUTER, or the relay's PULL) without blocking."""
        n = 0
        while True:
            try:
                if sock is self._pull:
                    frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
                    self._handle_relayed(frames)
                else:
                    self._handle(recv_bounded(sock, self.max_message_bytes, flags=zmq.NOBLOCK))
            except zmq.Again:
                break
            n += 1
        return n

    def _relay_pull(self):
        """The PULL socket of relayed messages (None without a relay), made by the receiving thread that asks
        first: the relay client's thread opens each sealed message and hands its frames on through it."""
        if self.relay is None:
            return None
        if self._pull is None:
            pull = self.ctx.socket(zmq.PULL)
            pull.setsockopt(zmq.LINGER, 0)
            pull.setsockopt(zmq.RCVHWM, 100_000)
            pull.connect(self.relay.inproc)
            self._pull = pull
        return self._pull

    def recv_sockets(self) -> list:
        """The sockets the receiving thread polls: the ROUTER, and the relay's PULL when there is a relay."""
        if self._sock is None:
            return []
        pull = self._relay_pull()
        return [self._sock] if pull is None else [self._sock, pull]

    def _recv_loop(self) -> None:
        sock = self._bind()
        self._bound.set()
        if sock is None:
            return
        sock.setsockopt(zmq.RCVTIMEO, 100)  # wake up now and then to notice close()
        try:
            while not self._stop.is_set():
                pull = self._relay_pull()
                if pull is not None:  # a relay joined: wait on both sockets
                    zmq.select([sock, pull], [], [], 0.1)
                    self._drain(sock)
                    self._drain(pull)
                    continue
                try:
                    frames = recv_bounded(sock, self.max_message_bytes)
                except zmq.Again:
                    continue
                self._handle(frames)
        finally:
            sock.close()
            if self._pull is not None:
                self._pull.close(linger=0)
                self._pull = None

    def _sender(self, frames: list) -> str:
        """Who sent ``frames``: the name of its authenticated key (CURVE), else the identity it declared."""
        if self.security is not None:
            try:
                return frames[-1].get("User-Id")  # set by ZeroMQ from the ZAP handler's answer, per connection
            except Exception:  # noqa: BLE001 - no such property: not an authenticated connection
                return "?unauthenticated"
        try:
            return bytes(frames[0].buffer[:256]).decode("utf-8", "replace") if frames else "?"
        except Exception:  # noqa: BLE001 - a frame without a buffer
            return "?"

    def _count_reject(self, sender: str, reason: str) -> None:
        now = time.monotonic()
        with self._reject_lock:
            if sender in self.cut_off:
                return
            recent = self._recent_rejects.get(sender)
            if recent is None:
                if len(self._recent_rejects) >= MAX_TRACKED_SENDERS:
                    self._recent_rejects.clear()
                recent = self._recent_rejects[sender] = deque()
            recent.append(now)
            while recent and recent[0] < now - REJECT_WINDOW_S:
                recent.popleft()
            if len(recent) <= REJECT_LIMIT:
                return
            why = (f"{sender} sent {len(recent)} rejected messages within {REJECT_WINDOW_S:g} s (the last: "
                   f"{reason[:200]}); everything it sends is dropped from now on")
            self.cut_off[sender] = why
            del self._recent_rejects[sender]
        log.error("%s: %s", self.name, why)
        if sender in self.allowed:  # a peer of the run that misbehaves: the run cannot go on exactly; say who
            self.report_error(sender, f"peer {why}")

    def _on_refused(self, address: str, key: str) -> None:
        self.reject(f"key {key} at {address or '?'}", "refused at the CURVE handshake: its key is not in the run's key list",
                    quiet=True)  # the ZAP handler logged it

    def _handle(self, frames: "list | _Oversized") -> None:
        """Check the sender, decode, check and hand on one received message; nothing a peer sends raises out of here."""
        if isinstance(frames, _Oversized):
            sender = self._sender(frames.head)
            if sender in self.cut_off:
                self.rejected += 1
            else:
                self.reject(sender, frames.reason)
            return
        if self.monitor is not None and len(frames) > 1:  # this connection holds a key of the run: never shut down
            try:
                self.monitor.admit(frames[1].get(zmq.SRCFD))
            except zmq.ZMQError:  # (a libzmq without ZMQ_SRCFD: the handshake interval alone tells)
                pass
        self._deliver(self._sender(frames), frames[1:])

    def _handle_relayed(self, frames: list) -> None:
        """A relayed message: the sender's name (its box opened with that sender's key: relay.py), then its frames."""
        self._deliver(bytes(frames[0].buffer[:256]).decode("utf-8", "replace"), frames[1:])

    def _deliver(self, sender: str, frames: list) -> None:
        if sender in self.cut_off:  # named once already; its messages are not even decoded any more
            self.rejected += 1
            return
        t0 = time.time()
        try:
            if sender not in self.allowed:  # before a byte is decoded
                raise WireError(f"unknown sender {sender!r} (expected one of {sorted(self.allowed)})")
            msg = decode(frames, self.max_message_bytes)
        except WireError as e:
            self.reject(sender, str(e))
            return
        except Exception as e:  # noqa: BLE001 - a decoder bug must not kill the receive loop either
            self.escaped += 1
            log.exception("%s: decoding a message from %s raised %s", self.name, sender, type(e).__name__)
            self.reject(sender, f"undecodable message ({type(e).__name__}: {str(e)[:200]})")
            return
        if self.tracer is not None and msg.kind != "ctrl":
            self.tracer.add(f"recv {msg.header.get('name', msg.kind)}", "recv", t0 * 1e6, time.time() * 1e6, "recv",
                            src=sender, bytes=msg.nbytes)
        try:
            self.on_message(sender, msg)
        except WireError as e:
            self.reject(sender, str(e))
        except Exception as e:  # noqa: BLE001 - a bug in a handler must not kill the receive thread
            self.escaped += 1
            log.exception("%s: handling a message from %s failed", self.name, sender)
            self.reject(sender, f"handler failed ({type(e).__name__}: {str(e)[:200]})")

    def reject(self, sender: str, reason: str, quiet: bool = False) -> None:
        """Log (unless ``quiet``: the caller logged it) and count a dropped message; cut off a sender whose rejects
        come faster than REJECT_LIMIT per REJECT_WINDOW_S."""
        self.rejected += 1
        if not quiet:
            log.warning("%s: rejected message from %r: %s", self.name, sender, reason)
        self._count_reject(sender, reason)
        if self.on_reject is not None:
            try:
                self.on_reject(sender, reason)
            except Exception:  # noqa: BLE001
                log.exception("%s: on_reject failed", self.name)


def pump_any(transports: "list[Transport]", timeout_s: float) -> int:
    """Caller-receives mode over the transports of one process (the parts of one device under interleaved
    1F1B): wait up to ``timeout_s`` until any has a message, then handle what arrived on each."""
    socks = [s for t in transports for s in t.recv_sockets()]
    if socks:
        poller = zmq.Poller()
        for sock in socks:
            poller.register(sock, zmq.POLLIN)
        poller.poll(max(0, int(timeout_s * 1000)))
    else:
        time.sleep(timeout_s)
    return sum(t.pump(0) for t in transports)
