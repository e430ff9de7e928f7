"""Issue 39: a client without a key holding idle TCP connections to an executor cannot lock the run's own peers out.

A real multi-process run over CURVE on loopback while a thread of the test keeps 200 plain TCP connections open to
one executor's port from the moment that executor said hello (each one the cap shuts down is opened again): every
step finishes, none takes as long as the peer timeout, the losses equal those of the same run without the held
connections bit for bit, and the executor's log counted the connections it shut down.
"""
import socket
import threading
import time

from tests.executors.dist_models import CNN_SPLITS, branching_cnn, cnn_batch, save_hand_plan, wait_for
from fusion.executors.runtime.coordinator import CoordinatorConfig
from fusion.executors.runtime.launcher import LocalCluster
from fusion.plan import OptimizerConfig

HELD = 200
PEER_TIMEOUT_S = 20.0


class Holder(threading.Thread):
    """Keeps up to ``HELD`` idle TCP connections open to part ``part``'s port (none sends a byte), opening again
    (at most 200 a second after the first 200) those the executor shut down, until :meth:`stop`."""

    def __init__(self, lc: LocalCluster, part: str):
        super().__init__(daemon=True)
        self.lc, self.part = lc, part
        self.socks: list[socket.socket] = []
        self.opened = self.peak = 0
        self._done = threading.Event()

    def _address(self):
        while not self._done.is_set():
            c = self.lc.coordinator
            addr = c.addresses.get(self.part) if c is not None else None
            if addr:
                host, port = addr.rpartition("/")[2].rsplit(":", 1)
                return host, int(port)
            time.sleep(0.005)
        return None

    @staticmethod
    def _open(s: socket.socket) -> bool:
        try:
            while True:  # drain the server's greeting; end of stream: shut down
                if not s.recv(4096, socket.MSG_DONTWAIT):
                    return False
        except BlockingIOError:
            return True
        except OSError:
            return False

    def run(self) -> None:
        where = self._address()
        while where is not None and not self._done.is_set():
            alive = []
            for s in self.socks:
                if self._open(s):
                    alive.append(s)
                else:
                    s.close()
            self.socks = alive
            for _ in range(HELD - len(self.socks) if not self.opened else min(50, HELD - len(self.socks))):
                try:
                    self.socks.append(socket.create_connection(where, timeout=2))
                    self.opened += 1
                except OSError:
                    break
            self.peak = max(self.peak, len(self.socks))
            self._done.wait(0.25)

    def stop(self) -> None:
        self._done.set()
        self.join(10)
        for s in self.socks:
            s.close()


def _train(plan_dir, run_dir, batches, hold: str | None = None):
    with LocalCluster(plan_dir, run_dir, CoordinatorConfig(peer_timeout_s=PEER_TIMEOUT_S), threads=1, trace=False,
                      curve=True) as lc:
        holder = Holder(lc, hold) if hold else None
        if holder is not None:
            holder.start()
        try:
            lc.start()
            if holder is not None:  # (the first 200 go at once, while the run's own links are being made)
                assert wait_for(lambda: holder.opened >= HELD, timeout=30), holder.opened
            reports = [lc.coordinator.step(b) for b in batches]
        finally:
            if holder is not None:
                holder.stop()
    return reports, holder


def test_held_idle_connections_do_not_delay_or_change_a_run(tmp_path):
    model = branching_cnn(mb=2)
    plan_dir = save_hand_plan(tmp_path, model, CNN_SPLITS[2], micro_batches=2, optimizer=OptimizerConfig("sgd", lr=0.1))
    batches = [cnn_batch(s, 4) for s in range(6)]
    clean, _ = _train(plan_dir, tmp_path / "clean", batches)
    held, holder = _train(plan_dir, tmp_path / "held", batches, hold="p1")
    assert holder.opened >= HELD, holder.opened  # the connections were made (and reopened once shut down)
    assert [r.loss for r in held] == [r.loss for r in clean]  # the same bits
    slow = [(r.step, round(r.iteration_s, 2)) for r in held if r.iteration_s >= PEER_TIMEOUT_S / 2]
    assert not slow, slow  # none delayed anywhere near the peer timeout (a lock-out lasted ~29 s)
    log = (tmp_path / "held" / "logs" / "p1.log").read_text()
    assert "without a finished handshake shut down" in log, log[-3000:]
