"""A CompNode's inbox: which OP-Data it accepts, and what it holds until an action consumes it.

Every arriving activation or gradient is checked against the part's boundary
tables (FusionLLM Table 3) before it is kept: it must come from the part
that produces (or consumes) that tensor, for this part, for the current
iteration, for a micro-batch of the schedule, not twice, and with the dtype
and shape the graph says. Gradients of tied parameters must come from a
co-owner with the parameter's shape. Anything else raises
:class:`~fusion.ir.errors.WireError` with the reason; the transport logs it
and drops the message.

The inbox is not thread-safe by itself: the CompNode guards it with its lock.
"""
from __future__ import annotations

from typing import Any, Callable, Mapping

import numpy as np

from fusion.ir.errors import WireError
from fusion.kernels.codecs import CODECS, CodecPayload
from fusion.ir.graph import OpGraph
from fusion.ir.node import TensorMeta
from fusion.ir.opdata import OpData
from fusion.executors.runtime.exact_zeros import unpack
from fusion.executors.runtime.part import Key, Routes
from fusion.executors.runtime.step_ahead import accepts, expected_text


class Inbox:
    """graph, me: the plan's graph and this part's name; routes: its boundary routing;
    n_micro: micro-batches per iteration; shared: tied parameter -> owner parts (this one included).

    check: called with each activation or gradient that passed the routing checks, before it is kept; it
    raises WireError to refuse it (the CompNode sets it to the compression table's ``check_incoming``,
    which refuses an AQ-SGD delta this end has no buffer for, and decodes a user codec's payload).
    decode_pgrad: with a tied-parameter codec (``Plan.tied_codec``), turns a received tied gradient's
    payload into the dense gradient, raising WireError for one it cannot decode; without one a tied gradient
    arrives dense or as its nonzero elements (:mod:`.exact_zeros`)."""

    def __init__(self, graph: OpGraph, me: str, routes: Routes, n_micro: int, shared: Mapping[str, list[str]]):
        self.graph, self.me, self.routes, self.n_micro, self.shared = graph, me, routes, n_micro, shared
        self.expected_iter = 0
        self.open = False  # set once the part is built; nothing is accepted before
        self._data: dict[tuple[int, str, int], list[OpData]] = {}
        self._pgrads: dict[tuple[int, str], dict[str, Any]] = {}
        self.check: Callable[[OpData], None] | None = None
        #: (tensor key, sender, is_grad) -> the codec the plan compiled for that stream (what is not listed arrives
        #: dense): a payload of another codec is refused, e.g. a quantised payload on a Top-K edge
        self.codecs: Mapping[tuple[Key, str, bool], Any] = {}
        self.decode_pgrad: Callable[[OpData], Any] | None = None
        #: the plan runs under bfloat16 autocast (``Plan.precision == "bf16"``): a float32 tensor of the graph may
        #: arrive as bfloat16 bits (uint16), the dtype autocast gave it in its producer
        self.autocast = False

    # -- accepting --------------------------------------------------------------------
    def accept(self, sender: str, od: OpData, param_grad: bool = False) -> None:
        """Keep ``od`` from ``sender`` or raise WireError saying why not."""
        if od.src != sender:
            raise WireError(f"message claims to come from {od.src!r} but was sent by {sender!r}")
        if od.dst != self.me:
            raise WireError(f"message for {od.dst!r} arrived at {self.me!r}")
        if not self.open:
            raise WireError("OP-Data before this part is set up")
        if not accepts(od.local_iter, self.expected_iter):  # (a part one step ahead: .step_ahead)
            raise WireError(f"{od.key} for iteration {od.local_iter}, {expected_text(self.expected_iter)}")
        if param_grad:
            self._accept_pgrad(sender, od)
        else:
            self._accept_data(sender, od)

    def _accept_data(self, sender: str, od: OpData) -> None:
        r = self.routes
        if not 0 <= od.micro_batch < self.n_micro:
            raise WireError(f"micro-batch {od.micro_batch} out of range [0, {self.n_micro})")
        if od.is_grad:
            if sender not in r.grads_from.get(od.key, ()):
                raise WireError(f"unexpected gradient of {od.key} (this part takes gradients of {sorted(r.grads_from)} "
                                "from their consumers)")
        elif r.recv_from.get(od.key) != sender:
            raise WireError(f"unexpected activation {od.key} (this part takes {sorted(r.recv_from)} from their producer parts)")
        self._check_payload(od)
        if self.check is not None:
            self.check(od)
        box = self._data.setdefault((od.local_iter, "B" if od.is_grad else "F", od.micro_batch), [])
        if any(m.key == od.key and m.src == od.src for m in box):
            raise WireError(f"duplicate {'gradient' if od.is_grad else 'activation'} {od.key} micro-batch {od.micro_batch}")
        box.append(od)

    def _meta(self, od: OpData):
        return self.graph.output_meta(od.name, od.index)

    def _check_payload(self, od: OpData) -> None:
        m = self._meta(od)
        if isinstance(od.payload, CodecPayload):
            if self.check is None:  # only a part with user-codec edges decodes one (check_incoming, then checked)
                raise WireError(f"{od.key}: {od.payload.algo} codec payload, but {self.me} decodes no edge with it")
            return
        codec = CODECS.for_payload(od.payload)  # the codec that made it (None: a dense array or value)
        if codec is not None and codec.stateful:
            if self.check is None:  # only a part with such edges has the state to decode one with
                raise WireError(f"{od.key}: {codec.name} payload, but {self.me} has no {codec.title or codec.name} edge")
            if not isinstance(m, TensorMeta):
                raise WireError(f"{od.key}: {codec.name} payload for a value that is not a tensor")
        if codec is not None:  # the codec the plan compiled for this stream, no other
            compiled = self.codecs.get((od.key, od.src, bool(od.is_grad)))
            if compiled is None or not compiled.owns(od.payload):
                what = "gradient" if od.is_grad else "activation"
                raise WireError(f"{what} {od.key} from {od.src}: a {codec.name} payload, but the plan "
                                + (f"compresses it with {compiled.name}" if compiled is not None else "sends it dense")
                                + f" towards {self.me}")
        if codec is not None and isinstance(m, TensorMeta):
            # frames/lengths/dtypes were checked by the wire codec; here: the tensor it describes
            dtype = m.dtype
            if self.autocast and dtype in ("float32", "float64") and getattr(od.payload, "dtype", None) == "bfloat16":
                dtype = "bfloat16"  # encoded from the bfloat16 tensor autocast made in the producer
            why = codec.check_payload(od.payload, tuple(m.shape), dtype)
            if why is not None:
                raise WireError(f"{od.key}: {why}")
            return
        if not isinstance(m, TensorMeta):
            return  # values have no static shape
        if not isinstance(od.payload, np.ndarray):
            raise WireError(f"{od.key}: expected a tensor payload, got {type(od.payload).__name__}")
        want_dtype = "uint16" if m.dtype == "bfloat16" else m.dtype
        autocast_bits = self.autocast and m.dtype in ("float32", "float64") and od.payload.dtype.name == "uint16"
        if tuple(od.payload.shape) != tuple(m.shape) or (od.payload.dtype.name != want_dtype and not autocast_bits):
            raise WireError(f"{od.key}: payload {od.payload.dtype.name}{list(od.payload.shape)} does not match "
                            f"the graph's {m.dtype}{list(m.shape)}")

    def _accept_pgrad(self, sender: str, od: OpData) -> None:
        owners = self.shared.get(od.name)
        if owners is None or sender not in owners:
            raise WireError(f"unexpected gradient of parameter {od.name!r} from {sender!r}")
        spec = self.graph.params[od.name]
        if od.payload is not None and self.decode_pgrad is not None:
            od.payload = self.decode_pgrad(od)
        elif od.payload is not None:  # dense exchange: a mostly-zero gradient comes as its nonzero elements
            od.payload = unpack(od.payload, tuple(spec.shape), spec.dtype, f"gradient of parameter {od.name!r}")
        if od.payload is not None and (not isinstance(od.payload, np.ndarray) or tuple(od.payload.shape) != tuple(spec.shape)):
            raise WireError(f"gradient of parameter {od.name!r} has the wrong shape (expected {list(spec.shape)})")
        want = "uint16" if spec.dtype == "bfloat16" else spec.dtype
        if od.payload is not None and od.payload.dtype.name != want:
            raise WireError(f"gradient of parameter {od.name!r} has dtype {od.payload.dtype.name} (expected {spec.dtype})")
        got = self._pgrads.setdefault((od.local_iter, od.name), {})
        if sender in got:
            raise WireError(f"duplicate gradient of parameter {od.name!r}")
        got[sender] = od.payload

    # -- consuming ----------------------------------------------------------------------
    def activations(self, it: int, mb: int) -> list[OpData] | None:
        """Every activation forward ``mb`` needs, or None while some are missing."""
        box = self._data.get((it, "F", mb), [])
        return box if {m.key for m in box} == set(self.routes.recv_from) else None

    def gradients(self, it: int, mb: int) -> list[OpData] | None:
        """A gradient from every consumer part of every sent tensor for backward ``mb``, or None."""
        box = self._data.get((it, "B", mb), [])
        have: dict[Key, set[str]] = {}
        for m in box:
            have.setdefault(m.key, set()).add(m.src)
        return box if have == self.routes.grads_from else None

    def param_grads(self, it: int) -> dict[str, dict[str, Any]] | None:
        """Tied-parameter gradients from every other owner, or None while some are missing."""
        out = {}
        for name, owners in self.shared.items():
            got = self._pgrads.get((it, name), {})
            if len(got) < len(owners) - 1:
                return None
            out[name] = got
        return out

    def consume(self, it: int, kind: str, mb: int) -> None:
        self._data.pop((it, kind, mb), None)

    def discard(self, it: int) -> None:
        """An evaluation at iteration ``it`` is over: drop what is left of its activations; ``it`` stays the
        iteration expected (the training step comes next)."""
        for k in [k for k in self._data if k[0] == it]:
            del self._data[k]

    def finish(self, it: int) -> None:
        """Iteration ``it`` is over: from now on messages of ``it + 1`` are accepted (and of the step after it,
        :mod:`.step_ahead`); what arrived early for ``it + 1`` is kept."""
        self.expected_iter = it + 1
        for k in [k for k in self._pgrads if k[0] <= it]:
            del self._pgrads[k]
        for k in [k for k in self._data if k[0] <= it]:
            del self._data[k]
