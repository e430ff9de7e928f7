"""The CompNode process around the steps: listening, hello and heartbeats to the coordinator, ready, the report of why
it stops, closing."""
from __future__ import annotations

import logging
import os
import threading
import time

from fusion.executors.runtime.control import Error, Hb, Hello, Ready, Setup, lasting_failure
from fusion.executors.runtime.keys import insecure_warning
from fusion.executors.runtime.local_links import is_private_ipc
from fusion.executors.runtime.limits import coordinator_message_limit
from fusion.executors.runtime.relay import relay_target
from fusion.executors.runtime.node_common import COORDINATOR, ExecutorAbort
from fusion.ir.errors import FusionError

log = logging.getLogger(__name__)

#: seconds between repeats of the hello while the coordinator has not answered: a hello that reached a coordinator
#: in the moment it closed (``fusion coordinator --max-restarts`` rebinding its address) is lost with its socket, and
#: ZeroMQ does not send a message twice; the coordinator takes a repeat from the same process as a heartbeat
HELLO_REPEAT_S = 2.0


class Process:
    """A part of :class:`~.compnode.CompNode` (mixed in): the CompNode process around the steps: listening, hello and
    heartbeats to the coordinator, ready, the report of why it stops, closing."""

    def _heartbeat(self) -> None:
        """A heartbeat to the coordinator every ``heartbeat_s``; until the coordinator is first heard, the hello
        again every :data:`HELLO_REPEAT_S` instead."""
        last_hello = time.monotonic()
        while not self._hb_stop.wait(self.cfg.heartbeat_s):
            if not self._heard_coord and time.monotonic() - last_hello >= HELLO_REPEAT_S:
                last_hello = time.monotonic()
                self.transport.send(COORDINATOR, self._hello_msg.frames())
            else:
                self.transport.send(COORDINATOR, Hb().frames())

    def _listen(self) -> str:
        """Check the plan's weights for this part and bind its socket. FusionError: the user's to fix (exit 2)."""
        self._t0 = time.monotonic()
        # a broken plan, and an address already in use, are the user's to fix: FusionError (one line, exit 2)
        self._weights = self.check_weights()
        try:
            return self.transport.start()
        except FusionError:
            self.transport.close(timeout_s=1.0, linger_s=0.0)
            raise

    def _hello(self, address: str) -> None:
        """Say hello to the coordinator (this part's name and address) and start heartbeating."""
        log.info("%s: plan and %d weights checked (%s engine); listening on %s", self.me, len(self._weights),
                 self.spec.engine, self.cfg.advertise or address)
        if self.cfg.security is None and is_private_ipc(address):
            log.info("%s: listening on a Unix socket only this user's processes can open (no CURVE needed)", self.me)
        elif self.cfg.security is None:
            log.warning("%s", insecure_warning(self.me, address))
        relay = relay_target(self.cfg.advertise or "")
        if relay:  # --dial-out: registered with the relay before anyone is told to reach this part there
            self.transport.join_relay(relay, self.cfg.startup_timeout_s)
        self.transport.connect(COORDINATOR, self.cfg.coordinator,
                               max_bytes=self.cfg.max_message_bytes or coordinator_message_limit(self.plan))
        self._hello_msg = Hello(part=self.me, address=self.cfg.advertise or address, pid=os.getpid(),
                                engine=self.spec.engine, digest=self.cfg.plan_digest)
        self.transport.send(COORDINATOR, self._hello_msg.frames())
        threading.Thread(target=self._heartbeat, name="heartbeat", daemon=True).start()
        log.info("%s: said hello to the coordinator at %s; waiting for its setup (gives up after %g s)",
                 self.me, self.cfg.coordinator, self.cfg.startup_timeout_s)

    def _ready(self) -> None:
        """Take the coordinator's setup (peers, resume), load the part, say ready."""
        c = self._next_ctrl(self.cfg.startup_timeout_s, while_heard=True)
        if not isinstance(c, Setup):
            raise ExecutorAbort(f"expected setup from the coordinator, got {c.op!r}")
        self._setup(c)
        self.transport.send(COORDINATOR, Ready(part=self.me).frames())
        log.info("%s: ready after %.1f s (%d peers: %s); waiting for steps", self.me, time.monotonic() - self._t0,
                 len(self._peers), ", ".join(sorted(self._peers)) or "none")

    def _report(self, e: BaseException) -> None:
        """Tell the coordinator why this part stops (unless the coordinator told it to)."""
        if isinstance(e, ExecutorAbort):
            log.error("%s: stopping: %s", self.me, e)
            reason = str(e)
            if reason.startswith("aborted by the coordinator"):
                return
        else:  # run_lane logged it with its traceback
            reason = f"{type(e).__name__}: {e}"
        if COORDINATOR in self.transport.senders:
            self.transport.send(COORDINATOR, Error(reason=reason, lasting=lasting_failure(e) or None).frames())

    def _close(self, status: int) -> None:
        self._hb_stop.set()
        if self.cfg.trace_path:
            try:
                self.tracer.write(self.cfg.trace_path)
            except OSError as e:
                log.error("%s: cannot write trace %s: %s", self.me, self.cfg.trace_path, e)
        self.transport.close(timeout_s=5.0 if status == 0 else 1.0)
        log.info("%s: exiting with status %d", self.me, status)
