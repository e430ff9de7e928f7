"""PartRuntime: one CompNode's sub-DAG seen from the outside — OpData in, OpData out.

It wraps an engine part (torch, numpy, ...) that works on plain arrays, and
does the bookkeeping of FusionLLM §3.3: which activations a part waits for,
where its outputs go (and for which actual users), how gradients from several
consumer parts are summed per tensor, and where input gradients are returned.
The single-process reference executor and the distributed CompNode executor
both drive this class; only how OpData travels differs.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

import numpy as np

from fusion.executors.engines.base import EnginePart
from fusion.ir.boundary import SubGraph
from fusion.ir.errors import GraphError
from fusion.ir.graph import OpGraph
from fusion.ir.opdata import SAMPLE_IDS, OpData
from fusion.executors.runtime.compression import dense_payload, table_for

Key = tuple[str, "int | None"]


@dataclass
class Routes:
    """Static message routing of one part, derived from the boundary tables.

    send_to:     tensor key -> {dst part: actual users there}
    recv_from:   tensor key -> src part (each required tensor has one producer part)
    recv_users:  tensor key -> local actual users
    grads_from:  tensor key -> parts that will return a gradient for it
    grads_to:    tensor key -> src part to return a gradient to
    """

    send_to: dict[Key, dict[str, tuple[str, ...]]] = field(default_factory=dict)
    recv_from: dict[Key, str] = field(default_factory=dict)
    recv_users: dict[Key, tuple[str, ...]] = field(default_factory=dict)
    grads_from: dict[Key, set[str]] = field(default_factory=dict)
    grads_to: dict[Key, str] = field(default_factory=dict)


def make_routes(sub: SubGraph, assignment: Mapping[str, str]) -> Routes:
    r = Routes()
    for e in sub.boundary.sent_acts:
        dst = assignment[e.actual_user]
        users = r.send_to.setdefault(e.key, {})
        users[dst] = tuple(sorted(set(users.get(dst, ())) | {e.actual_user}))
        if e.requires_grad:
            r.grads_from.setdefault(e.key, set()).add(dst)
    for e in sub.boundary.required_acts:
        r.recv_from[e.key] = assignment[e.producer]
        r.recv_users[e.key] = tuple(sorted(set(r.recv_users.get(e.key, ())) | {e.actual_user}))
        if e.requires_grad:
            r.grads_to[e.key] = assignment[e.producer]
    return r


def _bits_as_float(a: Any) -> Any:
    """A bfloat16 gradient that travelled as its raw uint16 bits as the float32 array of the same values."""
    if isinstance(a, np.ndarray) and a.dtype == np.uint16:
        return (a.astype(np.uint32) << 16).view(np.float32)
    return a


def grad_sum(a: Any, b: Any) -> Any:
    """The sum of two gradients of one tensor from different consumer parts. bfloat16 ones (uint16 bits on
    the wire) are added as float32 values, which the producing torch part rounds back to bfloat16, as the
    bfloat16 addition of autograd's accumulation does; adding the bits themselves would be garbage."""
    if isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and np.uint16 in (a.dtype, b.dtype):
        return _bits_as_float(a) + _bits_as_float(b)
    return a + b


class PartRuntime:
    """A part's forward/backward in terms of OpData messages."""

    def __init__(self, graph: OpGraph, name: str, sub: SubGraph, assignment: Mapping[str, str], engine: EnginePart,
                 compression: "Iterable[Any] | None" = None):
        """compression: the plan's ``EdgeCompression`` list (None/empty: every payload dense)."""
        self.graph, self.name, self.sub, self.engine = graph, name, sub, engine
        # an engine that encodes on its device (torch) says which device and hands those edges' tensors over;
        # one under bfloat16 autocast (precision bf16) sends float tensors in the dtype autocast gave them
        placement = engine.codec_device
        self.compression = table_for(name, compression, graph, engine.engine, *(placement or (None, False)),
                                     autocast=bool(getattr(engine, "autocast", False)))
        if self.compression is not None and placement is not None:
            engine.keep_tensors(self.compression.sent_keys(), self.compression.grad_keys())
        self.routes = make_routes(sub, assignment)
        self._users = {n: tuple(u) for n, u in graph.users().items()}
        self.placeholders = [n for n in sub.nodes if graph[n].kind.value in ("input", "label")]
        self.has_loss = any(graph[n].kind.value == "loss" for n in sub.nodes)

    # -- what a part waits for -------------------------------------------------------
    def needs_acts(self) -> set[Key]:
        return set(self.routes.recv_from)

    def needs_grads(self) -> dict[Key, set[str]]:
        return self.routes.grads_from

    # -- forward ------------------------------------------------------------------
    def forward(self, it: int, mb: int, feeds: Mapping[str, Any], inbox: list[OpData]) -> tuple[list[OpData], float | None]:
        inputs: dict[Key, Any] = {}
        for msg in inbox:
            if msg.is_grad or msg.key not in self.routes.recv_from:
                raise GraphError(f"part {self.name} got an unexpected activation {msg.key} from {msg.src}", msg.name)
            inputs[msg.key] = dense_payload(msg.payload) if self.compression is None else \
                self.compression.decode(msg, self._shape(msg.key))
        sent, loss = self.engine.forward((it, mb), inputs, {k: feeds[k] for k in self.placeholders if k in feeds})
        out = []
        for key, dsts in self.routes.send_to.items():
            for dst, users in dsts.items():
                payload, cfg = sent[key], None
                if self.compression is not None:
                    payload, cfg = self.compression.encode(payload, key, dst, False, mb, ids=feeds.get(SAMPLE_IDS), it=it)
                out.append(OpData(
                    name=key[0], index=key[1], op_users=self._users.get(key[0], ()), actual_user=users,
                    is_grad=False, local_iter=it, micro_batch=mb, src=self.name, dst=dst, payload=payload,
                    requires_grad=dst in self.routes.grads_from.get(key, ()), compress_cfg=cfg,
                ))
        return out, loss

    def evaluate(self, it: int, mb: int, feeds: Mapping[str, Any], inbox: list[OpData]) -> tuple[list[OpData], float | None]:
        """Forward of micro-batch ``mb`` for evaluation (:meth:`EnginePart.evaluate`): nothing kept for a backward,
        and the sent activations dense, so no codec's state (error feedback, delta buffers) changes."""
        inputs: dict[Key, Any] = {}
        for msg in inbox:
            if msg.is_grad or msg.key not in self.routes.recv_from:
                raise GraphError(f"part {self.name} got an unexpected activation {msg.key} from {msg.src}", msg.name)
            inputs[msg.key] = dense_payload(msg.payload)
        sent, loss = self.engine.evaluate(inputs, {k: feeds[k] for k in self.placeholders if k in feeds})
        out = [OpData(name=key[0], index=key[1], op_users=self._users.get(key[0], ()), actual_user=users, is_grad=False,
                      local_iter=it, micro_batch=mb, src=self.name, dst=dst, payload=sent[key], requires_grad=False)
               for key, dsts in self.routes.send_to.items() for dst, users in dsts.items()]
        return out, loss

    def _shape(self, key: Key) -> tuple[int, ...] | None:
        meta = self.graph.output_meta(*key)
        return tuple(meta.shape) if hasattr(meta, "shape") else None

    # -- backward -----------------------------------------------------------------
    def backward(self, it: int, mb: int, inbox: list[OpData], loss_scale: float, split: bool = False) -> list[OpData]:
        """Sum received gradients per tensor (over actual users), run local BP, return input grads.

        split: the schedule has a ``W`` action for this micro-batch: compute only the input
               gradients now (``EnginePart.backward_input``; an engine that cannot split does all
               of backward here and nothing in :meth:`weight`)."""
        summed: dict[Key, Any] = {}
        for msg in sorted(inbox, key=lambda m: m.src):  # one summation order whatever the arrival order: same bits
            # on every run (a resumed run equals an uninterrupted one), and the reference executor's order
            if not msg.is_grad or msg.key not in self.routes.grads_from:
                raise GraphError(f"part {self.name} got an unexpected gradient {msg.key} from {msg.src}", msg.name)
            # a table on a device gives a device tensor, else a NumPy array
            g = np.asarray(dense_payload(msg.payload)) if self.compression is None else self.compression.decode_grad(msg)
            summed[msg.key] = g if msg.key not in summed else grad_sum(summed[msg.key], g)
        if split:
            grads_in = self.engine.backward_input((it, mb), summed, loss_scale)
        else:
            grads_in = self.engine.backward((it, mb), summed, loss_scale)
        out = []
        for key, g in grads_in.items():
            dst, cfg = self.routes.grads_to[key], None
            if self.compression is not None:  # straight-through: dL/dy itself, Top-K'd on its own (compression.py)
                g, cfg = self.compression.encode(g, key, dst, True, mb)
            out.append(OpData(
                name=key[0], index=key[1], op_users=self._users.get(key[0], ()), actual_user=self.routes.recv_users[key],
                is_grad=True, local_iter=it, micro_batch=mb, src=self.name, dst=dst, payload=g, compress_cfg=cfg,
            ))
        return out

    def weight(self, it: int, mb: int) -> None:
        """The ``W`` action of a split backward: accumulate the parameter gradients of micro-batch ``mb``."""
        self.engine.backward_weight((it, mb))
