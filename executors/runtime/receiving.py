"""Receiving what peers and the coordinator send (called by the transport from the engine loop's waits): control
messages queued for the engine loop, data-parallel messages handed to the sync, OP-Data checked against the part's
boundary tables; a refused input this part waits for stops it at once."""
from __future__ import annotations

import logging
import time

import numpy as np

from fusion.executors.runtime.control import Abort, Eval, Hb, Regroup as RegroupMsg, Step, TO_EXECUTOR, decode_ctrl
from fusion.executors.runtime.feeds import feed_problem
from fusion.executors.runtime.node_common import COORDINATOR, MAX_QUEUED_CTRL
from fusion.ir.errors import WireError
from fusion.ir.opdata import OpData, SAMPLE_IDS
from fusion.ir.wire import Message, opbatch_from_message, opdata_from_message

log = logging.getLogger(__name__)


class Receiving:
    """A part of :class:`~.compnode.CompNode` (mixed in): receiving what peers and the coordinator send (called by the
    transport from the engine loop's waits): control messages queued for the engine loop, data-parallel messages
    handed to the sync, OP-Data checked against the part's boundary tables; a refused input this part waits for
    stops it at once."""

    def _on_message(self, sender: str, msg: Message) -> None:
        if sender == COORDINATOR:
            self._last_coord = time.monotonic()
            self._heard_coord = True
        if msg.kind == "ctrl":
            if sender != COORDINATOR:
                raise WireError(f"control message from {sender!r}; only the coordinator sends those")
            c = decode_ctrl(msg, TO_EXECUTOR)
            if isinstance(c, Hb):
                return
            if isinstance(c, (Step, Eval)):  # (a step's save_step was checked when decoded)
                self._check_feeds(c)
            if isinstance(c, RegroupMsg):
                with self._cv:
                    self._regroup = c
                    self._cv.notify_all()
                return
            with self._cv:
                if len(self._ctrl) >= MAX_QUEUED_CTRL and not isinstance(c, Abort):
                    raise WireError(f"{len(self._ctrl)} control messages already queued; dropping {c.op!r}")
                if isinstance(c, Abort):
                    self._aborted = f"aborted by the coordinator: {c.reason}"
                self._ctrl.append(c)
                self._cv.notify_all()
            return
        if msg.kind == "allreduce":
            with self._cv:
                if self.sync is None:
                    raise WireError(f"all-reduce message from {sender!r}, but {self.me} has no data-parallel group")
                self.sync.accept(sender, msg)  # routed by its header's type (dp/header.py)
                self._cv.notify_all()
            return
        heads = msg.header.get("items") if msg.kind == "opbatch" else [msg.header]  # one action's OP-Data to us
        try:
            ods = opbatch_from_message(msg) if msg.kind == "opbatch" else [opdata_from_message(msg)]
        except WireError as e:  # (its payload, say): what the header says it is may still be an input this part awaits
            for h in heads if isinstance(heads, list) else []:
                self._refused_input(sender, msg.kind == "pgrad", h if isinstance(h, dict) else {}, str(e))
            raise
        with self._cv:
            for od in ods:
                try:
                    self.inbox.accept(sender, od, param_grad=msg.kind == "pgrad")
                except WireError as e:
                    self._refused_input(sender, msg.kind == "pgrad", od, str(e))
                    raise
            self._cv.notify_all()

    def _refused_input(self, sender: str, pgrad: bool, od: "OpData | dict", reason: str) -> None:
        """A refused OP-Data message that this part's schedule waits for stops the part at once, naming the message,
        its sender and why (the coordinator then ends the step with that line) instead of waiting ``--data-timeout``
        for a message its sender believes delivered. It is one when it comes from the part that sends it (``src`` is
        the sender), to this part, for the iteration under way or the next (one that arrives early is lost as well),
        on a route this part takes (a producer's activation, a consumer's gradient, a co-owner's tied gradient), and
        is not a second copy. Anything else is only logged and counted, as before: a stranger's packets, another
        part's claims, stale messages of an iteration that is over."""
        get = od.get if isinstance(od, dict) else (lambda k: getattr(od, k, None))
        src, dst, name, index = get("src"), get("dst"), get("name"), get("index")
        it, mb, is_grad = get("local_iter"), get("micro_batch"), get("is_grad")
        if not (isinstance(src, str) and src == sender and dst == self.me and isinstance(name, str)
                and type(it) is int and type(mb) is int and type(is_grad) is bool
                and (index is None or type(index) is int)):
            return
        if reason.startswith("duplicate "):  # the first copy arrived: nothing is missing
            return
        with self._cv:
            inbox = self.inbox
            if not inbox.open or it not in (inbox.expected_iter, inbox.expected_iter + 1):
                return
            if pgrad:
                ours = sender in inbox.shared.get(name, ())
                what = f"gradient of tied parameter {name!r}"
            else:
                key = (name, index)
                ours = 0 <= mb < inbox.n_micro and (sender in inbox.routes.grads_from.get(key, ()) if is_grad
                                                    else inbox.routes.recv_from.get(key) == sender)
                what = (f"{'gradient' if is_grad else 'activation'} {name}{'' if index is None else f'[{index}]'} "
                        f"of micro-batch {mb}")
            if not ours:
                return
            why = f"refused the {what} of iteration {it} from {sender}, which this part waits for: {reason}"
            log.error("%s: %s", self.me, why)
            self._aborted = self._aborted or why
            self._cv.notify_all()

    def _check_feeds(self, c: "Step | Eval") -> None:
        """A step's tensors are named ``<micro-batch>/<placeholder>`` for placeholders of this part, and each is what
        the plan says that placeholder takes (:mod:`.feeds`: dimensions, dtype kind, finite, index range). A step
        that fails is refused and this part stops naming the field and node: the coordinator checked the same
        before sending, so a step that fails here cannot be trained on, and waiting for another would hang."""
        mine = self.spec.feed_specs  # this part's placeholders (input and label nodes)
        for name, arr in c.arrays.items():
            mb, _, ph = name.partition("/")
            if ph == SAMPLE_IDS and (arr.ndim != 1 or arr.dtype != np.int64):  # every part gets the sample ids
                raise WireError(f"step {c.it}: {name!r} must be a 1-D int64 array, got {arr.dtype}{list(arr.shape)}")
            if not (mb.isdigit() and int(mb) < self.n_micro and (ph in mine or ph == SAMPLE_IDS)):
                raise WireError(f"step {c.it}: tensor {name[:80]!r} is not '<micro-batch>/<placeholder>' "
                                f"of this part (micro-batches 0..{self.n_micro - 1}, placeholders {sorted(mine)})")
            why = feed_problem(self.spec.feed_specs[ph], arr) if ph != SAMPLE_IDS else None
            if why:
                reason = f"step {c.it}: feed {ph!r} (micro-batch {mb}) {why}"
                with self._cv:
                    self._aborted = self._aborted or reason
                    self._cv.notify_all()
                raise WireError(reason)

    def _on_send_error(self, peer: str, reason: str) -> None:
        with self._cv:
            self._aborted = self._aborted or reason
            self._cv.notify_all()
