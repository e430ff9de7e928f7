"""CURVE keys of a run: who may talk to whom, proven by public-key cryptography (ZeroMQ's CurveZMQ).

Every process of a run (each CompNode and the coordinator) has a key pair.
Public keys are listed in a file beside the plan (``PLAN/public_keys.json``,
``{name: z85 public key}``), made by ``fusion keys``; each secret key lives in
its own file (``<name>.secret``, JSON ``{"name", "public", "secret"}``) that
must be readable by its owner only (mode 0600): a group- or world-readable
one is refused with one line.

A process's ROUTER socket is a CURVE server; its ZAP handler
(:class:`ZapHandler`, ZeroMQ Authentication Protocol, RFC 27) accepts a
handshake only from a key in the list and names the peer by the name the
list gives that key. ZeroMQ then tags every frame from that connection with
the name as its ``User-Id`` property, which the transport uses as the
sender: a key not in the plan never gets a message through, and a peer
cannot speak under another's name. Outbound DEALER sockets are CURVE
clients that know the server's public key, so a process also proves the
peer it sends to holds that peer's secret key. All traffic is encrypted.
"""
from __future__ import annotations

import json
import logging
import os
import stat
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Mapping

import zmq
from zmq.utils import z85

from fusion.ir.errors import FusionError

log = logging.getLogger(__name__)

PUBLIC_KEYS_FILE = "public_keys.json"
ZAP_ENDPOINT = "inproc://zeromq.zap.01"
ZAP_DOMAIN = b"fusion"
_Z85_LEN = 40


class KeyFileError(FusionError):
    """A key file is missing, malformed, or not private."""


@dataclass(frozen=True)
class KeyPair:
    """One process's CURVE key pair; ``public`` and ``secret`` are 40-character Z85 text (32-byte keys)."""

    name: str
    public: str
    secret: str = field(repr=False)


@dataclass(frozen=True)
class Security:
    """What a transport needs to run CURVE: its own key pair and the public key of every process of the run.

    me:      this process's key pair.
    peers:   name -> Z85 public key of every process of the run (this one included).
    """

    me: KeyPair
    peers: Mapping[str, str]

    def public_of(self, name: str) -> str:
        key = self.peers.get(name)
        if key is None:
            raise FusionError(f"no public key for {name!r} in the run's key list (names: {', '.join(sorted(self.peers))})")
        return key

    def name_of(self) -> dict[str, str]:
        """Z85 public key -> name."""
        return {k: n for n, k in self.peers.items()}


def generate(name: str) -> KeyPair:
    """A fresh key pair for ``name``."""
    public, secret = zmq.curve_keypair()
    return KeyPair(name, public.decode("ascii"), secret.decode("ascii"))


def _check_z85(text: object, what: str) -> str:
    if not isinstance(text, str) or len(text) != _Z85_LEN:
        raise KeyFileError(f"{what}: expected a 40-character Z85 key, got {str(text)[:60]!r}")
    try:
        z85.decode(text.encode("ascii"))
    except (ValueError, UnicodeEncodeError, KeyError, TypeError):
        raise KeyFileError(f"{what}: {text!r} is not Z85 text") from None
    return text


def write_secret(pair: KeyPair, path: str | Path) -> Path:
    """Write ``pair`` to ``path`` readable and writable by the owner only (0600), atomically."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.fchmod(fd, 0o600)  # O_CREAT's mode is cut by the umask only; never widened
        os.write(fd, (json.dumps({"name": pair.name, "public": pair.public, "secret": pair.secret}) + "\n").encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    return path


def load_secret(path: str | Path) -> KeyPair:
    """The key pair in ``path``; refused (one line) when the file is readable by group or others."""
    path = Path(path)
    try:
        st = path.stat()
    except OSError as e:
        raise KeyFileError(f"{path}: cannot read the secret key file ({e.strerror}); make one with `fusion keys`") from None
    if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise KeyFileError(f"{path}: secret key file is readable by others (mode {stat.S_IMODE(st.st_mode):04o}); "
                        f"run `chmod 600 {path}`")
    try:
        d = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise KeyFileError(f"{path}: not a secret key file ({e})") from None
    if not isinstance(d, dict) or not isinstance(d.get("name"), str):
        raise KeyFileError(f"{path}: not a secret key file (expected JSON with name, public, secret)")
    secret = _check_z85(d.get("secret"), f"{path}: field 'secret'")
    public = _check_z85(d.get("public"), f"{path}: field 'public'")
    if zmq.curve_public(secret.encode("ascii")).decode("ascii") != public:
        raise KeyFileError(f"{path}: the public key does not belong to the secret key")
    return KeyPair(d["name"], public, secret)


def write_public(keys: Mapping[str, str], path: str | Path) -> Path:
    """Write the public key list (name -> Z85) to ``path``, atomically."""
    from fusion.ir.files import atomic_write

    path = Path(path)
    atomic_write(path, lambda tmp: tmp.write_text(json.dumps(dict(sorted(keys.items())), indent=1) + "\n"))
    return path


def load_public(path: str | Path, names: Iterable[str] | None = None) -> dict[str, str]:
    """The public key list in ``path``; with ``names``, every one of them must have a key."""
    path = Path(path)
    try:
        d = json.loads(path.read_text())
    except OSError as e:
        raise KeyFileError(f"{path}: cannot read the public key list ({e.strerror}); make it with `fusion keys`") from None
    except ValueError as e:
        raise KeyFileError(f"{path}: not JSON ({e})") from None
    if not isinstance(d, dict):
        raise KeyFileError(f"{path}: expected {{name: public key}}")
    keys = {str(n): _check_z85(k, f"{path}: key of {n!r}") for n, k in d.items()}
    if len(set(keys.values())) != len(keys):
        raise KeyFileError(f"{path}: two names share one public key")
    missing = sorted(set(names or ()) - set(keys))
    if missing:
        raise KeyFileError(f"{path}: no public key for {', '.join(missing)} (run `fusion keys` for this plan)")
    return keys


def security_for(secret_path: str | Path, public_path: str | Path, names: Iterable[str], me: str) -> Security:
    """Load this process's key pair and the run's public keys; the pair must be the one listed for ``me``."""
    names = list(names)
    pair = load_secret(secret_path)
    peers = load_public(public_path, names)
    if peers[me] != pair.public:
        raise KeyFileError(f"{secret_path}: this key pair ({pair.name!r}) is not the one {public_path} lists for {me!r}")
    return Security(pair, peers)


def coordinator_run_keys(parts: Iterable[str], folder: str | Path) -> tuple[Security, dict[str, Path], Path]:
    """Fresh keys for one run in ``folder``: the coordinator's :class:`Security`, each part's secret key
    file and the public key list (what a launcher hands its executors as ``--key``/``--public-keys``)."""
    names = ["coordinator", *parts]
    secrets, public = make_run_keys(names, folder)
    return security_for(secrets["coordinator"], public, names, "coordinator"), secrets, public


def make_run_keys(names: Iterable[str], folder: str | Path) -> tuple[dict[str, Path], Path]:
    """Fresh key pairs for ``names`` in ``folder`` (``<name>.secret``, 0600) plus ``public_keys.json``.

    Returns (name -> secret key file, public key list file).
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    os.chmod(folder, 0o700)
    pairs = {n: generate(n) for n in names}
    secrets = {n: write_secret(p, folder / f"{n}.secret") for n, p in pairs.items()}
    public = write_public({n: p.public for n, p in pairs.items()}, folder / PUBLIC_KEYS_FILE)
    return secrets, public


class RefusalLog:
    """Refused handshakes logged as counts per interval: at most one warning line every ``interval_s`` seconds,
    whatever the refused clients do (an attacker rotating keys or addresses cannot grow a log or this object), with
    how many were refused since the previous line and the first :attr:`SHOWN` of them.

    The first refusal after a quiet interval is logged at once; later ones are counted and written by the next
    :meth:`flush` after the interval (the handler calls it from its poll loop, so a count is never held back long).
    """

    SHOWN = 3

    def __init__(self, owner: str, what: str, interval_s: float = 10.0, emit=None):
        self.owner, self.what, self.interval_s = owner, what, interval_s
        self.emit = emit or (lambda line: log.warning("%s", line))
        self.total = 0  # every refusal ever noted
        self.lines = 0  # lines written
        self._count, self._first, self._since, self._last = 0, [], 0.0, -1e18
        self._lock = threading.Lock()

    def note(self, who: str, now: float) -> None:
        """Count one refusal; ``who`` says which client and why (cut to 200 characters)."""
        with self._lock:
            self.total += 1
            if self._count == 0:
                self._since = now
            self._count += 1
            if len(self._first) < self.SHOWN:
                self._first.append(who[:200])
        self.flush(now)

    def flush(self, now: float) -> None:
        """Write the pending count when the last line is at least ``interval_s`` old."""
        with self._lock:
            if not self._count or now - self._last < self.interval_s:
                return
            n, first, since = self._count, self._first, self._since
            self._count, self._first, self._last = 0, [], now
            self.lines += 1
        more = f"; {n - len(first)} more" if n > len(first) else ""
        self.emit(f"{self.owner}: {n} {self.what} in {max(0.0, now - since):.0f} s: {'; '.join(first)}{more}")


class ZapHandler(threading.Thread):
    """The gate of one ZeroMQ context's bound sockets: the one thread that answers their ZAP requests (ZeroMQ
    Authentication Protocol, RFC 27) and reads their monitors (:meth:`attach`).

    With ``security`` it accepts CURVE clients whose key is listed and names them; without (a keyless socket,
    ``--insecure``, made a gate by :func:`zap_gate`) it admits every NULL client: there the ZAP round trip only
    orders things. ZeroMQ reads no message frame from a connection before its handshake is over, and the
    handshake waits for this handler's answer; the connection's ``ACCEPTED`` event was queued on the socket's
    monitor before its handshake began. So the handler drains every attached monitor before it answers: a reader
    (the connection watch, ``connwatch.py``) holds each connection before any frame of it can be read or refused.
    Two threads, one answering and one reading, raced: under load libzmq refused a 960 MiB message and closed the
    connection before the reading thread had seen it accepted, and the refusal went uncounted. (A hostile client
    that sends frames before the server's handshake reply is cut off by libzmq as a protocol error; its count can
    still be missed, never its memory bound.)

    ``on_reject(address, key)`` is called for each refused handshake; refusals are logged as counts, at most one
    line per ``log_interval_s`` (:class:`RefusalLog`).
    """

    #: seconds between two calls of the readers' ``tick`` (their log flushes) while events keep coming
    TICK_S = 0.1

    def __init__(self, ctx: zmq.Context, owner: str, security: Security | None, on_reject=None,
                 log_interval_s: float = 10.0):
        super().__init__(name=f"zap-{owner}", daemon=True)
        self.owner, self.on_reject = owner, on_reject
        self.names = security.name_of() if security is not None else None
        self.refused = 0
        self.log = RefusalLog(owner, "connection(s) refused at the CURVE handshake", log_interval_s)
        self._done = threading.Event()
        self._readers: list = []  # MonitorReader: .sock (a monitor socket), .handle(event, now), .tick(now), .close()
        self._lock = threading.Lock()
        self._sock = ctx.socket(zmq.REP)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(ZAP_ENDPOINT)  # bound before the ROUTER binds: no handshake is ever let through unchecked

    def attach(self, reader) -> None:
        """Read ``reader.sock`` (a monitor socket, made before its socket binds) on this thread from now on, and
        drain it before every answer. The reader's socket belongs to this thread after the call."""
        with self._lock:
            self._readers.append(reader)

    def run(self) -> None:
        import time

        from zmq.utils.monitor import recv_monitor_message

        def drain(readers, now):
            for r in readers:
                while True:
                    try:
                        ev = recv_monitor_message(r.sock, zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    r.handle(ev, now)

        last_tick = time.monotonic()
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        polled = 0  # readers registered with the poller
        try:
            while not self._done.is_set():
                ready = dict(poller.poll(int(self.TICK_S * 1000)))
                now = time.monotonic()
                if self._done.is_set():
                    break
                with self._lock:  # taken after the poll: a reader attached meanwhile is drained too
                    readers = list(self._readers)
                for r in readers[polled:]:
                    poller.register(r.sock, zmq.POLLIN)
                polled = len(readers)
                drain([r for r in readers if r.sock in ready], now)
                if self._sock in ready:
                    req = self._sock.recv_multipart()
                    drain(readers, now)  # this connection's ACCEPTED event is queued already: its reader holds it
                    try:
                        reply = self._reply(req, now)
                    except Exception:  # noqa: BLE001 - whatever went wrong, the handshake is refused, never let through
                        log.exception("%s: ZAP handler failed; refusing the handshake", self.owner)
                        reply = [b"1.0", req[1] if len(req) > 1 else b"", b"500", b"internal error", b"", b""]
                    self._sock.send_multipart(reply)
                if now - last_tick >= self.TICK_S:
                    last_tick = now
                    self.log.flush(now)
                    for r in readers:
                        r.tick(now)
        except zmq.ZMQError:
            pass  # the context is closing
        finally:
            self._sock.close(linger=0)
            with self._lock:
                for r in self._readers:
                    r.close()

    def _reply(self, req: list[bytes], now: float) -> list[bytes]:
        if len(req) < 6:
            return [b"1.0", req[1] if len(req) > 1 else b"", b"400", b"malformed ZAP request", b"", b""]
        version, rid, domain, address, _identity, mechanism, *creds = req
        if self.names is None and mechanism == b"NULL":  # a keyless socket: the gate only orders (class docstring)
            return [b"1.0", rid, b"200", b"OK", b"", b""]
        addr = address.decode("utf-8", "replace")
        if mechanism != b"CURVE" or len(creds) != 1 or len(creds[0]) != 32 or self.names is None:
            reason = f"mechanism {mechanism.decode('ascii', 'replace')} refused (CURVE only)"
            key = "?"
        else:
            key = z85.encode(creds[0]).decode("ascii")
            name = self.names.get(key)
            if name is not None:
                return [b"1.0", rid, b"200", b"OK", name.encode(), b""]
            reason = "its key is not in the run's key list"
        self.refused += 1
        self.log.note(f"from {addr or '?'} with public key {key} ({reason})", now)
        if self.on_reject is not None:
            try:
                self.on_reject(addr, key)
            except Exception:  # noqa: BLE001
                log.exception("%s: on_reject failed", self.owner)
        return [b"1.0", rid, b"400", reason.encode(), b"", b""]

    def stop(self) -> None:
        self._done.set()


def insecure_warning(me: str, address: str) -> str:
    """The warning a process without CURVE logs once it listens."""
    return (f"{me}: listening on {address} without CURVE (--insecure or no --key): links are neither authenticated "
            f"nor encrypted, and any process that reaches this address can send messages here (make keys with "
            f"`fusion keys PLAN`)")


#: handshake failures a CURVE server reports on its monitor socket (ZAP refusals are logged by the ZAP handler)
HANDSHAKE_FAILED = zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
#: connections opened and closed on a socket (the value of each event is the connection's file descriptor)
CONNECTION_EVENTS = zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_CLOSED
#: seconds a connection to a CURVE server may take to finish its handshake before libzmq drops it
#: (``ZMQ_HANDSHAKE_IVL``; libzmq's default is 30 s). A handshake is four small messages: well under a second
#: even over a 300 ms, 1 Mbit/s link. So a connection open longer than this has a key.
HANDSHAKE_S = 5.0
#: connections one source address may hold on a capped CURVE socket that have not finished their handshake (the
#: run's own peers finish theirs in milliseconds; on one host every part has the same address)
PENDING_PER_SOURCE = 16


def _source(fd: int) -> str:
    """The peer host of connection ``fd`` ('' when it cannot be read: the connection is gone already)."""
    import socket

    try:
        s = socket.socket(fileno=os.dup(fd))
    except OSError:
        return ""
    try:
        peer = s.getpeername()
        return str(peer[0]) if isinstance(peer, tuple) else "local"  # a Unix socket's peer has no address
    except OSError:
        return ""
    finally:
        s.close()


def _handshake_reason(event: int | None, code: int | None) -> str:
    """Why a handshake failed, from a monitor event: a protocol error code (a client without CURVE shows as a
    mechanism mismatch) or, without detail, the errno of a connection that ended mid-handshake."""
    if event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
        if code == getattr(zmq, "PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH", None):
            return "not a CURVE client"
        return f"protocol error {code:#x}" if isinstance(code, int) else "protocol error"
    import os

    return f"the connection ended during the handshake ({os.strerror(code) if isinstance(code, int) else code})"


class HandshakeMonitor:
    """Logs connections to a CURVE server that fail the handshake before ZAP is asked (a client without CURVE,
    a client that does not know this server's key, garbage): ``on_fail(reason)`` once per failure, counts logged
    at most once per ``log_interval_s`` (:class:`RefusalLog`). With ``max_connections`` it also bounds the
    connections that have not finished their handshake (:meth:`_accepted`). A reader of the socket's monitor:
    create it before ``sock`` binds and :meth:`ZapHandler.attach` it (the ZAP handler's thread reads it)."""

    def __init__(self, sock: zmq.Socket, owner: str, on_fail=None, log_interval_s: float = 10.0,
                 max_connections: int | None = None, watch=None, per_source: int = PENDING_PER_SOURCE):
        self.owner, self.on_fail = owner, on_fail
        #: a connwatch.ConnectionWatch told of every connection (libzmq allows one monitor per socket: this one)
        self.watch = watch
        self.failed = 0
        self.log = RefusalLog(owner, "connection(s) failed the handshake (a client must use this server's key and "
                                     "its own)", log_interval_s)
        #: the cap on connections open at once on this socket (None: no cap); beyond it a connection that has not
        #: finished its handshake is shut down (:meth:`_accepted`), so held connections cannot take every file
        #: descriptor; a connection whose key the ZAP handler admitted is never shut down
        self.max_connections = max_connections
        #: connections one source address may hold that have not finished their handshake (with a cap)
        self.per_source = per_source
        self.capped = 0  # connections shut down (over the cap or over the per-source bound)
        self.cap_log = RefusalLog(owner, f"connection(s) without a finished handshake shut down (over the cap of "
                                         f"{max_connections} open at once, or over {per_source} pending from one "
                                         "address)", log_interval_s)
        #: descriptor -> (when it was accepted, its source address), oldest first
        self._open: dict[int, tuple[float, str]] = {}
        #: descriptors a message arrived from (:meth:`admit`): the ZAP handler admitted their key
        self._admitted: set[int] = set()
        #: the socket's bound endpoint (set once it is bound): only connections accepted there are shut down
        self.local = ""
        capped = max_connections is not None
        events = HANDSHAKE_FAILED | (CONNECTION_EVENTS if capped or watch is not None else 0)
        self._done = threading.Event()
        self.sock = sock.get_monitor_socket(events)

    def handle(self, ev: dict, now: float) -> None:
        """One monitor event."""
        kind = ev.get("event")
        if self._done.is_set():
            return
        if self.watch is not None:
            if self._timed_out(kind, int(ev.get("value", -1)), now):
                self.watch.forget(int(ev.get("value", -1)))  # (its HANDSHAKE_FAILED event logged it)
            else:
                self.watch.event(kind, ev.get("value", -1))
        if kind == zmq.EVENT_ACCEPTED:
            self._accepted(int(ev.get("value", -1)), now)
            return
        if kind in (zmq.EVENT_DISCONNECTED, zmq.EVENT_CLOSED):
            fd = int(ev.get("value", -1))
            self._open.pop(fd, None)
            self._admitted.discard(fd)
            return
        if not kind & HANDSHAKE_FAILED:
            return
        self.failed += 1
        why = _handshake_reason(ev.get("event"), ev.get("value"))
        reason = f"refused at the CURVE handshake: {why} (a client must use this server's key and its own)"
        if self.on_fail is not None:
            self.on_fail(reason)
        self.log.note(why, now)

    def tick(self, now: float) -> None:
        """Write pending log counts."""
        self.log.flush(now)
        self.cap_log.flush(now)
        if self.watch is not None:
            self.watch.log.flush(now)

    def close(self) -> None:
        self.sock.close(linger=0)
        if self.watch is not None:
            self.watch.close()

    def _timed_out(self, kind: int, fd: int, now: float) -> bool:
        """Whether a closing event is libzmq dropping a connection that did not finish its handshake within
        :data:`HANDSHAKE_S` (an idle client): not a refused frame, which the connection watch would call it (the
        stream is open and nothing is unread), since a client gets no data frame through before its handshake."""
        if kind not in (zmq.EVENT_DISCONNECTED, zmq.EVENT_CLOSED) or fd not in self._open or fd in self._admitted:
            return False
        return now - self._open[fd][0] >= 0.9 * HANDSHAKE_S

    def admit(self, fd: int) -> None:
        """A message arrived from connection ``fd`` (``ZMQ_SRCFD`` of its frame; on a CURVE socket only a key of the
        run's list gets one delivered): it is never shut down. (libzmq's ``EVENT_HANDSHAKE_SUCCEEDED`` carries no
        descriptor, so the message is the first sign of which connection it was.)"""
        if fd in self._open:
            self._admitted.add(fd)

    def _pending(self, now: float) -> list[int]:
        """Connections that may still be without a key, oldest first: no message arrived from them and they are
        younger than :data:`HANDSHAKE_S` (libzmq drops a connection whose handshake has not finished by then)."""
        return [f for f, (t, _) in self._open.items() if f not in self._admitted and now - t < HANDSHAKE_S]

    def _accepted(self, fd: int, now: float) -> None:
        """A connection was accepted on ``fd``: count it and bound the connections that may be without a key.

        A connection a message came from (:meth:`admit`) or older than the handshake interval has a key of the
        run's list and is never shut down: a peer of the run is always admitted. Of the others (pending), when one
        source address holds more than ``per_source``, the oldest of that address goes (one address cannot crowd
        the others out); when the socket holds more than ``max_connections`` in all, the oldest pending one of any
        address goes. The oldest, not the newest: a real peer finishes its handshake in milliseconds (four small
        messages), a client holding connections without a key never does. Shutting the newest down had let 69
        idle keyless connections lock a real peer's reconnection out until ZeroMQ's 30 s handshake timeout cleared
        them (issue 39). A peer's fresh connection that has not delivered a message yet can still be the oldest
        pending one; shutting it loses nothing (nothing was sent on it) and its DEALER reconnects in 0.1 s."""
        if self.max_connections is None:
            return
        self._admitted.discard(fd)  # (a descriptor number libzmq reused)
        self._open[fd] = (now, _source(fd))
        source = self._open[fd][1]
        pending = self._pending(now)
        same = [f for f in pending if self._open[f][1] == source]
        if source and len(same) > self.per_source:
            self._shut(same[0], now)
            pending.remove(same[0])
        if len(self._open) > self.max_connections:
            self._shut(next((f for f in pending if f != fd), fd), now)

    def _shut(self, fd: int, now: float) -> None:
        """Shut connection ``fd`` of this socket down (counted and logged)."""
        import socket

        try:  # a duplicate of libzmq's descriptor: shutting it down ends the connection, libzmq then closes its own
            s = socket.socket(fileno=os.dup(fd))
        except OSError:
            self._open.pop(fd, None)
            return
        try:
            here = s.getsockname()
            # only a connection accepted on this socket's address (never a descriptor reused for something else)
            if self.local and self.local.rpartition(":")[2] == str(here[1]) and not s.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                peer = s.getpeername()
                s.shutdown(socket.SHUT_RDWR)
                self.capped += 1
                self.cap_log.note(f"from {peer[0]}:{peer[1]}", now)
        except OSError:
            pass
        finally:
            s.close()  # the duplicate only
            self._open.pop(fd, None)  # (its closing event follows; it is not chosen twice meanwhile)

    def stop(self) -> None:
        self._done.set()


def curve_server(sock: zmq.Socket, security: Security) -> None:
    """Make ``sock`` (before bind) a CURVE server with this process's keys, checked by the ZAP handler."""
    sock.setsockopt(zmq.CURVE_SERVER, 1)
    sock.setsockopt(zmq.CURVE_SECRETKEY, security.me.secret.encode("ascii"))
    sock.setsockopt(zmq.CURVE_PUBLICKEY, security.me.public.encode("ascii"))
    sock.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN)
    sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)  # no ZAP handler answering: refuse, never accept


def zap_gate(sock: zmq.Socket) -> None:
    """Make a keyless ``sock`` (before bind) ask the context's ZAP handler before any handshake ends: the handler
    admits every NULL client, after its monitor readers have seen the connection (:class:`ZapHandler`)."""
    sock.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN)
    sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)  # no ZAP handler answering: refuse, never admit unseen


def curve_client(sock: zmq.Socket, security: Security, peer: str) -> None:
    """Make ``sock`` (before connect) a CURVE client of ``peer``, whose public key the run lists."""
    sock.setsockopt(zmq.CURVE_SERVERKEY, security.public_of(peer).encode("ascii"))
    sock.setsockopt(zmq.CURVE_PUBLICKEY, security.me.public.encode("ascii"))
    sock.setsockopt(zmq.CURVE_SECRETKEY, security.me.secret.encode("ascii"))
