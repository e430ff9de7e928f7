"""Dial-out only: CompNodes behind NAT reach each other through a relay they dial, end to end sealed.

A CompNode behind NAT cannot be dialled, but it can dial out. Started with ``fusion executor --dial-out
tcp://RELAY:PORT`` it advertises ``relay:tcp://RELAY:PORT`` as its address instead of one of its own; every
process that must send to it (a peer, the coordinator) then sends through the relay (``fusion relay``, on a
reachable host), while it sends to reachable peers directly. So direct links are used where the receiver is
reachable, relayed ones where it is not, chosen at start-up by the addresses the hellos carry.

Who holds what:

* The relay (:class:`RelayServer`) binds one ROUTER socket, a CURVE server whose ZAP handler admits only keys of
  the run (``relay`` has its own key pair in ``public_keys.json``: ``fusion keys PLAN --relay``). Each client
  process (:class:`RelayClient`) opens two DEALER connections to it, CURVE clients of the relay's key: one it only
  receives on (registered with ``H``: the relay routes messages for the name of its authenticated key there) and
  one it only sends on (``F DEST SEALED``). The relay forwards ``SEALED`` to DEST's receive connection tagged with
  the sender's *authenticated* name; it counts bytes and messages (:class:`RelayStats`).
* The payload is sealed end to end with libsodium's ``crypto_box`` (PyNaCl's :class:`nacl.public.Box`:
  X25519 + XSalsa20-Poly1305) between the two processes' own CURVE key pairs (CURVE is that same box construction,
  so the run's keys serve as they are). The relay holds neither secret key: it cannot read a payload, and any
  change it makes to one (or a payload it makes up) fails the receiver's authentication. Inside the box are
  the sender's and the receiver's names (a box sealed for B cannot be reflected back to its sender as B's, nor
  passed to C) and the frames (:mod:`fusion.executors.runtime.framing`). The nonce is a random 16-byte session
  of the sending process and an 8-byte counter: a receiver takes a session's counters only in increasing order
  and never an older session again, so the relay cannot replay, reorder or duplicate either. What it can do is
  drop or delay traffic, which the run sees as a silent peer (the peer timeout).

Why a sealed payload rather than CURVE sessions tunnelled through the relay: libzmq has no way to run a CURVE
handshake over a hop it does not own (a ZMQ_STREAM splice would mean framing ZMTP by hand), while ``crypto_box``
of a well-kept library is the same primitive with the same keys, one call each way.

The relayed plaintext reaches the transport's receive loop through an in-process PULL socket, so messages are
decoded and handled on the same thread as direct ones (:class:`~fusion.executors.runtime.transport.Transport`).
"""
from __future__ import annotations

import logging
import os
import struct
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import zmq
from zmq.utils import z85

from fusion.ir.errors import FusionError, WireError
from fusion.executors.runtime import framing
from fusion.executors.runtime.keys import HANDSHAKE_S, Security, ZapHandler, curve_client, curve_server
from fusion.executors.runtime.liveness import Heartbeat

log = logging.getLogger(__name__)

#: the scheme of an address reached through a relay: ``relay:tcp://HOST:PORT``
RELAY_SCHEME = "relay:"
#: the relay's name in the run's key list
RELAY = "relay"
#: bytes a sealed message adds to its framed plaintext besides the names: nonce (24) and MAC (16)
SEAL_OVERHEAD = 40
#: a relay's notice to a client, ``["", GONE, DEST]``: DEST's connection to the relay is gone (relayed messages
#: are two frames, so a three-frame message with an empty first frame is never one)
GONE = b"G"
#: old sessions of one sender a receiver remembers (refused if they come back)
MAX_SESSIONS = 64
_NAME = struct.Struct("<H")


def relay_overhead(max_frames: int) -> int:
    """Bytes a relayed message may have beyond its frames: framing of ``max_frames`` frames, names, nonce, MAC."""
    return framing.packed_nbytes([b""] * max_frames) + 2 * (2 + 256) + SEAL_OVERHEAD


def relay_target(address: str) -> str | None:
    """The relay's address of a relayed address (``relay:tcp://h:p`` -> ``tcp://h:p``), else None."""
    return address[len(RELAY_SCHEME):] if address.startswith(RELAY_SCHEME) else None


class RelayError(FusionError):
    """The relay could not be reached, or refused this process (the transport raises it as a TransportError)."""


def _raw(z: str) -> bytes:
    return z85.decode(z.encode("ascii"))


class Sealer:
    """Seals messages for, and opens messages from, the processes of the run with ``crypto_box`` (see the module
    docstring); a receiver's replay state per sender. Thread-safe."""

    def __init__(self, security: Security):
        from nacl.public import Box, PrivateKey, PublicKey  # libsodium (PyNaCl); needed only by relayed runs

        self.me = security.me.name
        self._sk = PrivateKey(_raw(security.me.secret))
        self._pk = {n: PublicKey(_raw(k)) for n, k in security.peers.items()}
        self._Box = Box
        self._boxes: dict[str, object] = {}
        self._session = os.urandom(16)
        self._counter: dict[str, int] = {}
        self._seen: dict[str, tuple[bytes, int, list[bytes]]] = {}  # sender -> (session, last counter, old sessions)
        self._lock = threading.Lock()

    def _box(self, peer: str):
        b = self._boxes.get(peer)
        if b is None:
            if peer not in self._pk:
                raise WireError(f"no public key for {peer!r} in the run's key list")
            b = self._boxes[peer] = self._Box(self._sk, self._pk[peer])  # the shared key, computed once
        return b

    def seal(self, dest: str, frames) -> bytes:
        box = self._box(dest)
        with self._lock:
            n = self._counter.get(dest, 0) + 1
            self._counter[dest] = n
        src, dst = self.me.encode(), dest.encode()
        plain = framing.pack(frames, _NAME.pack(len(src)) + src + _NAME.pack(len(dst)) + dst)
        return box.encrypt(bytes(plain), self._session + n.to_bytes(8, "big"))

    def open(self, src: str, sealed, max_frames: int) -> list[memoryview]:
        """The frames ``src`` sealed for this process; WireError if they were not, or were replayed."""
        from nacl.exceptions import CryptoError

        box = self._box(src)
        data = bytes(sealed)
        if len(data) < SEAL_OVERHEAD:
            raise WireError(f"sealed message of {len(data)} bytes is too short")
        nonce = data[:24]
        try:
            plain = memoryview(box.decrypt(data[24:], nonce))
        except CryptoError:
            raise WireError(f"sealed message does not open with {src}'s key (forged or changed on the way)") from None
        try:
            (ls,) = _NAME.unpack_from(plain, 0)
            s = bytes(plain[2:2 + ls]).decode()
            (ld,) = _NAME.unpack_from(plain, 2 + ls)
            d = bytes(plain[4 + ls:4 + ls + ld]).decode()
        except (struct.error, UnicodeDecodeError):
            raise WireError("sealed message without its names") from None
        if s != src or d != self.me:
            raise WireError(f"sealed message names {s!r} -> {d!r}, but came from {src!r} to {self.me!r}")
        session, counter = nonce[:16], int.from_bytes(nonce[16:], "big")
        with self._lock:
            cur = self._seen.get(src)
            if cur is None or cur[0] != session:
                old = cur[2] + [cur[0]] if cur is not None else []
                if session in old:
                    raise WireError(f"sealed message of an earlier session of {src} (replayed)")
                self._seen[src] = (session, counter, old[-MAX_SESSIONS:])
            elif counter <= cur[1]:
                raise WireError(f"sealed message {counter} of {src} after {cur[1]} (replayed or reordered)")
            else:
                self._seen[src] = (session, counter, cur[2])
        return framing.unpack(plain[4 + ls + ld:], max_frames)


@dataclass
class RelayStats:
    """What a relay forwarded: messages and bytes (sealed payloads), per (source, destination) too, and drops."""

    messages: int = 0
    bytes: int = 0
    dropped: int = 0
    refused_oversize: int = 0
    gone_notices: int = 0  # senders told that their destination's connection is gone
    pairs: dict[str, int] = field(default_factory=dict)  # "src->dst" -> bytes

    def to_dict(self) -> dict:
        return {"messages": self.messages, "bytes": self.bytes, "dropped": self.dropped,
                "refused_oversize": self.refused_oversize, "gone_notices": self.gone_notices,
                "pairs": dict(self.pairs)}


class RelayServer:
    """The relay (``fusion relay``): forwards sealed messages between the authenticated processes of a run.

    bind:       where to listen, e.g. ``tcp://*:5700`` (a reachable address).
    security:   the relay's key pair and the run's public keys (its ZAP handler admits only these).
    max_bytes:  the largest sealed payload forwarded (ZeroMQ drops a larger frame when it reads its length).
    """

    def __init__(self, bind: str, security: Security, max_bytes: int, heartbeat: "Heartbeat | None" = None):
        self.bind_addr, self.security, self.max_bytes = bind, security, max_bytes
        #: ZeroMQ heartbeats on every client's connection (``--link-timeout``): a client that died, stopped or was
        #: cut off loses its connection within ``heartbeat.bound_s``, and the next message for it is answered with
        #: a gone notice (:data:`GONE`); None: only a closed connection (a process that died) tells
        self.heartbeat = heartbeat
        self.stats = RelayStats()
        self.routes: dict[str, bytes] = {}  # name -> routing id of its receive connection
        self.gone: set[str] = set()  # names whose receive connection closed and that have not registered again
        self.address = ""
        self.ctx = zmq.Context()
        self.zap = ZapHandler(self.ctx, RELAY, security)
        self._stop = threading.Event()
        self._sock = None

    def start(self) -> str:
        self.zap.start()
        sock = self.ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # an unroutable message raises (logged), never vanishes
        sock.setsockopt(zmq.SNDHWM, 100_000)
        sock.setsockopt(zmq.RCVHWM, 100_000)
        sock.setsockopt(zmq.SNDTIMEO, 30_000)
        sock.setsockopt(zmq.MAXMSGSIZE, self.max_bytes + 4096)
        sock.setsockopt(zmq.HANDSHAKE_IVL, int(HANDSHAKE_S * 1000))
        if self.heartbeat is not None:
            self.heartbeat.apply(sock)
        curve_server(sock, self.security)
        try:
            sock.bind(self.bind_addr)
        except zmq.ZMQError as e:
            sock.close()
            raise RelayError(f"relay: cannot bind {self.bind_addr}: {e}") from None
        self.address = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._sock = sock
        return self.address

    def serve(self, until: Callable[[], bool] = lambda: False, on_tick: Callable[[], None] | None = None) -> None:
        """Forward until :meth:`stop` (or ``until()``); ``on_tick`` runs about once a second."""
        sock, last = self._sock, time.monotonic()
        while not self._stop.is_set() and not until():
            if sock.poll(200):
                while True:
                    try:
                        frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    self._forward(frames)
            if on_tick is not None and time.monotonic() - last >= 1.0:
                last = time.monotonic()
                on_tick()

    def _forward(self, frames: list) -> None:
        try:
            src = frames[-1].get("User-Id")
        except Exception:  # noqa: BLE001 - not an authenticated connection (cannot happen under ZAP_ENFORCE_DOMAIN)
            self.stats.dropped += 1
            return
        rid, kind = frames[0].bytes, frames[1].bytes if len(frames) > 1 else b""
        if kind == b"H" and len(frames) == 2:
            self.routes[src] = rid
            self.gone.discard(src)
            log.info("relay: %s registered", src)
            self._send([rid, b"OK"], src)
            return
        if kind != b"F" or len(frames) != 4:
            self.stats.dropped += 1
            log.warning("relay: dropped a malformed message from %s (%d frames, kind %r)", src, len(frames), kind[:8])
            return
        dest = frames[2].bytes.decode("utf-8", "replace")
        route = self.routes.get(dest)
        if route is None:
            self.stats.dropped += 1
            if dest in self.gone:
                self._notify_gone(src, dest)
            else:
                log.warning("relay: %s sent to %r, which has not registered here; dropped", src, dest[:64])
            return
        n = len(frames[3].buffer)
        if not self._send([route, src.encode(), frames[3]], dest):
            if dest in self.gone:
                self._notify_gone(src, dest)
            return
        self.stats.messages += 1
        self.stats.bytes += n
        key = f"{src}->{dest}"
        self.stats.pairs[key] = self.stats.pairs.get(key, 0) + n

    def _send(self, frames: list, dest: str) -> bool:
        try:
            self._sock.send_multipart(frames, copy=False)
            return True
        except zmq.ZMQError as e:  # gone (EHOSTUNREACH), or not taking data for SNDTIMEO
            self.stats.dropped += 1
            if e.errno == zmq.EHOSTUNREACH and self.routes.get(dest) == frames[0]:
                self._lost(dest)
            else:
                log.warning("relay: cannot forward to %s (%s); dropped", dest, e)
            return False

    def _lost(self, dest: str) -> None:
        """``dest``'s receive connection is gone (its process died, or the heartbeats closed it): forget its route
        until it registers again; whoever sends to it meanwhile is told (:meth:`_notify_gone`)."""
        del self.routes[dest]
        self.gone.add(dest)
        log.warning("relay: %s's connection is gone (closed, or its heartbeats went unanswered)", dest)

    def _notify_gone(self, src: str, dest: str) -> None:
        """Tell ``src`` that ``dest`` is gone from this relay (a notice, :data:`GONE`): only as much as dropping
        its messages would tell, sooner. Nothing when ``src`` has no route here itself."""
        back = self.routes.get(src)
        if back is not None:
            self.stats.gone_notices += 1
            try:
                self._sock.send_multipart([back, b"", GONE, dest.encode()], zmq.NOBLOCK)
            except zmq.ZMQError:
                pass

    def stop(self) -> None:
        self._stop.set()

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        self.zap.stop()
        self.zap.join(1.0)
        self.ctx.term()


class RelayClient:
    """One process's two connections to the relay (see the module docstring).

    ctx:        the transport's ZeroMQ context (the in-process PULL endpoint lives in it).
    security:   this process's keys; the relay's public key must be in its list.
    address:    the relay's address, ``tcp://HOST:PORT``.
    max_frames: the most frames a relayed message may have (the transport's bound).
    on_reject:  ``fn(sender, reason)`` for a relayed message that does not open (forged, replayed, malformed).
    """

    def __init__(self, ctx: zmq.Context, security: Security, address: str, max_frames: int,
                 on_reject: Callable[[str, str], None], send_timeout_s: float = 30.0, max_bytes: int | None = None,
                 on_gone: Callable[[str], None] | None = None):
        if RELAY not in security.peers:
            raise RelayError(f"the run's key list has no key for {RELAY!r}: make the keys with `fusion keys PLAN "
                             "--relay` and start `fusion relay` with relay.secret")
        self.ctx, self.security, self.address = ctx, security, address
        self.me = security.me.name
        self.max_frames, self.on_reject, self.on_gone = max_frames, on_reject, on_gone
        #: the largest sealed message taken from the relay (ZMQ_MAXMSGSIZE of the receive connection): this
        #: process's own limit, framed and sealed; None: unbounded
        self.max_bytes = max_bytes
        self.sealer = Sealer(security)
        self.inproc = f"inproc://relay-{self.me}-{id(self):x}"
        self.sent_bytes = 0
        self._send_lock = threading.Lock()
        self._send_sock = self._dealer(send_timeout_s)
        self._registered = threading.Event()
        self._stop = threading.Event()
        self._failed: str | None = None
        self._thread = threading.Thread(target=self._recv_loop, name=f"relay-recv-{self.me}", daemon=True)

    def _dealer(self, send_timeout_s: float = 30.0, max_bytes: int | None = None):
        s = self.ctx.socket(zmq.DEALER)
        if max_bytes is not None:
            s.setsockopt(zmq.MAXMSGSIZE, max_bytes)
        curve_client(s, self.security, RELAY)
        s.setsockopt(zmq.LINGER, 2000)
        s.setsockopt(zmq.SNDHWM, 10_000)
        s.setsockopt(zmq.SNDTIMEO, int(send_timeout_s * 1000))
        s.connect(self.address)
        return s

    def start(self, timeout_s: float = 30.0) -> None:
        """Connect and register; RelayError when the relay has not answered within ``timeout_s``."""
        self._thread.start()
        if not self._registered.wait(timeout_s):
            raise RelayError(f"{self.me}: the relay at {self.address} did not answer within {timeout_s:g} s (is "
                             "`fusion relay` running there, with this run's public keys?)")

    def send(self, dest: str, frames) -> int:
        """Seal ``frames`` for ``dest`` and hand them to the relay; returns the sealed bytes."""
        sealed = self.sealer.seal(dest, frames)
        with self._send_lock:  # several threads of the process may send (heartbeats, the engine loop)
            self._send_sock.send_multipart([b"F", dest.encode(), sealed], copy=False)
            self.sent_bytes += len(sealed)
        return len(sealed)

    def _recv_loop(self) -> None:
        sock = self._dealer(max_bytes=self.max_bytes)
        push = self.ctx.socket(zmq.PUSH)
        push.setsockopt(zmq.LINGER, 0)
        push.setsockopt(zmq.SNDHWM, 100_000)
        push.bind(self.inproc)
        try:
            sock.send(b"H")
            while not self._stop.is_set():
                if not sock.poll(100):
                    continue
                frames = sock.recv_multipart(copy=False)
                if not self._registered.is_set():
                    if len(frames) == 1 and frames[0].bytes == b"OK":
                        self._registered.set()
                    continue
                if len(frames) == 3 and not frames[0].bytes and frames[1].bytes == GONE:
                    if self.on_gone is not None:
                        self.on_gone(frames[2].bytes[:256].decode("utf-8", "replace"))
                    continue
                if len(frames) != 2:
                    self.on_reject("?relay", f"relayed message of {len(frames)} frames (2 expected)")
                    continue
                src = frames[0].bytes[:256].decode("utf-8", "replace")
                try:
                    inner = self.sealer.open(src, frames[1].buffer, self.max_frames)
                except WireError as e:
                    self.on_reject(src, f"relayed: {e}")
                    continue
                push.send_multipart([src.encode(), *inner], copy=False)
        except zmq.ZMQError as e:
            if not self._stop.is_set():
                self._failed = str(e)
                log.error("%s: the relay connection failed: %s", self.me, e)
        finally:
            sock.close(linger=0)
            push.close(linger=0)

    def close(self) -> None:
        self._stop.set()
        if self._thread.ident is not None:
            self._thread.join(2.0)
        with self._send_lock:
            self._send_sock.close()


class RelayedLink:
    """A transport's link to a peer that only dials out: each message sealed for the peer and sent through the
    transport's :class:`RelayClient` (the same interface as the transport's direct links)."""

    def __init__(self, transport, peer: str, address: str, max_bytes: int | None, stats):
        self.t, self.peer, self.address, self.max_bytes = transport, peer, address, max_bytes
        self.link = None
        self.failed: str | None = None
        self.stats = stats  # the transport's LinkStats of this link

    def start(self) -> None:
        pass

    def is_alive(self) -> bool:
        return False

    def join(self, timeout: float | None = None) -> None:
        pass

    def stop(self, linger_s: float) -> None:
        pass

    def put(self, frames: list, label: str) -> None:
        from fusion.ir.wire import frames_nbytes

        t0 = time.monotonic()
        try:
            self.t.relay.send(self.peer, frames)
        except zmq.Again:
            reason = (f"the relay at {self.t.relay.address} did not take a message for {self.peer} within "
                      f"{self.t.send_timeout_s:.1f} s")
            log.error("%s: %s", self.t.name, reason)
            self.t.report_error(self.peer, reason)
            return
        except zmq.ZMQError as e:
            self.t.report_error(self.peer, f"sending to {self.peer} through the relay failed: {e}")
            return
        self.stats.bytes += frames_nbytes(frames)
        self.stats.messages += 1
        self.stats.busy_s += time.monotonic() - t0


def dial_out_addresses(relay: str, bind: str | None, insecure: bool) -> tuple[str, str]:
    """``fusion executor --dial-out RELAY``: (the address to bind, the address to advertise). FusionError (exit 2)
    without keys: a relay must never see plaintext."""
    if insecure:
        raise FusionError(f"--dial-out {relay}: relayed traffic is sealed with the run's CURVE keys; pass --key, "
                          "not --insecure")
    return bind or "tcp://127.0.0.1:*", RELAY_SCHEME + relay
