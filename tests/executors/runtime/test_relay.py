"""Dial-out only (issue 39): messages through a relay arrive from the sender's key, and the relay can neither read
nor forge them.

Real sockets on loopback, real CURVE, real libsodium boxes. A hostile relay here is a :class:`RelayServer` whose
forwarding does what a compromised relay would (flip a byte, replay, relabel the sender, record the payloads).
"""
import threading
import time

import numpy as np
import pytest
import zmq

from tests.executors.dist_models import wait_for
from fusion.executors.runtime import framing
from fusion.executors.runtime.keys import Security, generate
from fusion.executors.runtime.relay import RELAY, RELAY_SCHEME, RelayServer, Sealer
from fusion.executors.runtime.transport import Transport, TransportError
from fusion.ir.errors import WireError
from fusion.ir.wire import encode

MARKER = b"plaintext-marker-0123456789"


def _keys(*names):
    pairs = {n: generate(n) for n in (*names, RELAY)}
    peers = {n: p.public for n, p in pairs.items()}
    return {n: Security(p, peers) for n, p in pairs.items()}


class _Relay:
    """A relay server on a thread of this process (``cls``: a hostile subclass)."""

    def __init__(self, sec, cls=RelayServer):
        self.server = cls("tcp://127.0.0.1:*", sec[RELAY], 1 << 20)
        self.address = self.server.start()
        self.thread = threading.Thread(target=self.server.serve, daemon=True)
        self.thread.start()

    def close(self):
        self.server.stop()
        self.thread.join(5)
        self.server.close()


def _pair(sec, relay_address):
    """Transport ``a`` (sends) and ``b`` (only dials out: reached through the relay); ``got``: what b received."""
    got = []
    a = Transport("a", "tcp://127.0.0.1:*", {"b"}, lambda s, m: None, security=sec["a"])
    b = Transport("b", "tcp://127.0.0.1:*", {"a"}, lambda s, m: got.append((s, m)), security=sec["b"])
    a.start()
    b.start()
    b.join_relay(relay_address)
    a.connect("b", RELAY_SCHEME + relay_address)
    return a, b, got


def _msg(i):
    return encode("ctrl", {"op": "note", "i": i, "text": MARKER.decode()}, [np.arange(16, dtype=np.float32) + i])


def test_messages_through_the_relay_arrive_from_the_sender_s_key_and_the_relay_sees_only_ciphertext():
    sec = _keys("a", "b")
    seen = []

    class Recording(RelayServer):
        def _forward(self, frames):
            seen.extend(bytes(f.buffer) for f in frames[1:])
            super()._forward(frames)

    relay = _Relay(sec, Recording)
    a, b, got = _pair(sec, relay.address)
    try:
        for i in range(5):
            a.send("b", _msg(i))
        assert wait_for(lambda: len(got) == 5, timeout=20), got
        assert [s for s, _ in got] == ["a"] * 5
        assert [m.header["i"] for _, m in got] == list(range(5))
        np.testing.assert_array_equal(got[4][1].arrays[0], np.arange(16, dtype=np.float32) + 4)
        assert relay.server.stats.messages == 5 and relay.server.stats.bytes > 5 * 64
        assert seen and not any(MARKER in s for s in seen)  # the relay never had the plaintext
        assert b.rejected == 0
    finally:
        a.close(linger_s=0)
        b.close(linger_s=0)
        relay.close()


@pytest.mark.parametrize("attack", ["flip", "replay", "relabel"])
def test_a_hostile_relay_cannot_forge_replay_or_relabel(attack):
    """Each forged message is refused by the receiver (logged, counted); the genuine ones still arrive, once."""
    sec = _keys("a", "b", "c")

    class Hostile(RelayServer):
        def _send(self, frames, dest):
            if len(frames) == 3:  # a forwarded message: [route, src, sealed]
                route, src, sealed = frames[0], frames[1], bytes(frames[2].buffer)
                if attack == "flip":
                    forged = bytearray(sealed)
                    forged[len(forged) // 2] ^= 1
                    super()._send([route, src, bytes(forged)], dest)
                elif attack == "replay":
                    super()._send([route, src, sealed], dest)
                elif attack == "relabel":  # claims c sent it (c is a peer b accepts)
                    super()._send([route, b"c", sealed], dest)
            return super()._send(frames, dest)

    relay = _Relay(sec, Hostile)
    got = []
    a = Transport("a", "tcp://127.0.0.1:*", {"b"}, lambda s, m: None, security=sec["a"])
    b = Transport("b", "tcp://127.0.0.1:*", {"a", "c"}, lambda s, m: got.append((s, m.header["i"])), security=sec["b"])
    try:
        a.start()
        b.start()
        b.join_relay(relay.address)
        a.connect("b", RELAY_SCHEME + relay.address)
        for i in range(3):
            a.send("b", _msg(i))
        assert wait_for(lambda: len(got) == 3 and b.rejected >= 3, timeout=20), (got, b.rejected)
        time.sleep(0.3)
        assert got == [("a", 0), ("a", 1), ("a", 2)]
        assert b.rejected == 3 and b.escaped == 0
    finally:
        a.close(linger_s=0)
        b.close(linger_s=0)
        relay.close()


def test_a_sealed_message_opens_only_for_its_receiver_from_its_sender():
    sec = _keys("a", "b", "c")
    sa, sb, sc = Sealer(sec["a"]), Sealer(sec["b"]), Sealer(sec["c"])
    sealed = sa.seal("b", [b"head", MARKER])
    assert [bytes(f) for f in sb.open("a", sealed, 8)] == [b"head", MARKER]
    with pytest.raises(WireError, match="does not open"):
        sc.open("a", sealed, 8)  # another receiver
    with pytest.raises(WireError, match="replayed"):
        sb.open("a", sealed, 8)
    with pytest.raises(WireError):  # reflected back to its sender as if b had sent it (the box key is symmetric)
        Sealer(sec["a"]).open("b", sealed, 8)
    with pytest.raises(WireError, match="frames"):
        framing.unpack(framing.pack([b"x"] * 9), 8)


def test_a_relayed_link_needs_keys_and_a_relay_that_answers():
    sec = _keys("a", "b")
    plain = Transport("a", "tcp://127.0.0.1:*", {"b"}, lambda s, m: None)
    keyed = Transport("a", "tcp://127.0.0.1:*", {"b"}, lambda s, m: None, security=sec["a"])
    try:
        plain.start()
        keyed.start()
        with pytest.raises(TransportError, match="needs CURVE keys"):
            plain.connect("b", RELAY_SCHEME + "tcp://127.0.0.1:9")
        t0 = time.monotonic()
        with pytest.raises(TransportError, match="did not answer"):
            keyed.join_relay("tcp://127.0.0.1:9", timeout_s=1.0)
        assert time.monotonic() - t0 < 5
    finally:
        plain.close(linger_s=0)
        keyed.close(linger_s=0)


def _sender_with_errors(sec, relay_address):
    errors = {}
    a = Transport("a", "tcp://127.0.0.1:*", {"b"}, lambda s, m: None, security=sec["a"],
                  on_error=lambda peer, why: errors.setdefault(peer, (time.monotonic(), why)))
    a.start()
    a.connect("b", RELAY_SCHEME + relay_address)
    return a, errors


def _send_until(a, errors, timeout_s):
    deadline, i = time.monotonic() + timeout_s, 0
    while "b" not in errors and time.monotonic() < deadline:
        a.send("b", _msg(i))  # as the coordinator's heartbeats do, every 0.1 s
        i += 1
        time.sleep(0.1)


def test_a_peer_whose_relay_connection_closes_is_reported_gone_to_whoever_sends_to_it():
    """The relay cannot route to a client whose connection closed: it tells the sender (a notice, no more than
    dropping the messages would tell) and the sender's transport reports the link failed, naming the relay."""
    from fusion.executors.runtime.liveness import Heartbeat

    sec = _keys("a", "b")
    relay = _Relay.__new__(_Relay)
    relay.server = RelayServer("tcp://127.0.0.1:*", sec[RELAY], 1 << 20, Heartbeat(1.0))
    relay.address = relay.server.start()
    relay.thread = threading.Thread(target=relay.server.serve, daemon=True)
    relay.thread.start()
    got = []
    b = Transport("b", "tcp://127.0.0.1:*", {"a"}, lambda s, m: got.append(m), security=sec["b"])
    b.start()
    b.join_relay(relay.address)
    a, errors = _sender_with_errors(sec, relay.address)
    try:
        a.send("b", _msg(0))
        assert wait_for(lambda: len(got) == 1, timeout=20)
        b.close(linger_s=0)  # b's process ends: its connections to the relay close
        t0 = time.monotonic()
        _send_until(a, errors, 10)
        assert "b" in errors, "the sender was never told"
        assert "relay" in errors["b"][1] and "gone" in errors["b"][1]
        assert errors["b"][0] - t0 < 5 and relay.server.stats.gone_notices >= 1
    finally:
        a.close(linger_s=0)
        relay.close()


def test_a_stopped_peer_behind_the_relay_is_reported_within_the_heartbeat_bound(tmp_path):
    """A SIGSTOPped process answers no heartbeat: the relay closes its connection after ``--link-timeout`` and the
    next message for it is answered with a gone notice (the coordinator's heartbeats send one every second)."""
    import os
    import signal
    import subprocess
    import sys

    from fusion.executors.runtime.keys import write_public, write_secret
    from fusion.executors.runtime.liveness import Heartbeat

    pairs = {n: generate(n) for n in ("a", "b", RELAY)}
    peers = {n: p.public for n, p in pairs.items()}
    sec = {n: Security(p, peers) for n, p in pairs.items()}
    write_secret(pairs["b"], tmp_path / "b.secret")
    write_public(peers, tmp_path / "public.json")
    relay = _Relay.__new__(_Relay)
    relay.server = RelayServer("tcp://127.0.0.1:*", sec[RELAY], 1 << 20, Heartbeat(1.0))
    relay.address = relay.server.start()
    relay.thread = threading.Thread(target=relay.server.serve, daemon=True)
    relay.thread.start()
    child = subprocess.Popen([sys.executable, "-c", f"""
import sys, time
from fusion.executors.runtime.keys import security_for
from fusion.executors.runtime.transport import Transport
sec = security_for({str(tmp_path / 'b.secret')!r}, {str(tmp_path / 'public.json')!r}, ["a", "b", "relay"], "b")
b = Transport("b", "tcp://127.0.0.1:*", {{"a"}}, lambda s, m: None, security=sec)
b.start()
b.join_relay({relay.address!r})
print("ready", flush=True)
time.sleep(120)
"""], stdout=subprocess.PIPE, text=True)
    a = None
    try:
        assert child.stdout.readline().strip() == "ready"
        a, errors = _sender_with_errors(sec, relay.address)
        a.send("b", _msg(0))
        time.sleep(0.5)
        assert "b" not in errors  # alive: no notice
        os.kill(child.pid, signal.SIGSTOP)
        t0 = time.monotonic()
        _send_until(a, errors, 15)
        assert "b" in errors, "a stopped peer was never reported"
        detect = errors["b"][0] - t0
        assert detect < 1.0 + 4.0, detect  # the bound, plus a margin for a loaded host
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.wait(10)
        if a is not None:
            a.close(linger_s=0)
        relay.close()
