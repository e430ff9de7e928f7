"""Per-edge compression of OP-Data payloads (FusionLLM §5, AdaTopK; quant; AQ-SGD deltas).

Codecs per direction: any codec of the registry that may serve the role (activations, gradients);
a stateful one (``delta``, AQ-SGD) keeps per-sample buffers at both ends of the edge
(:mod:`fusion.executors.runtime.delta_edges`).

A plan lists :class:`~fusion.plan.EdgeCompression` entries: one cut tensor
``(producer, index)`` on one link ``src -> dst`` with a ratio, the directions
it applies to (``"fwd"``: the activation ``src -> dst``; ``"bwd"``: its
gradient ``dst -> src``) and whether error feedback is on. One
:class:`CompressionTable` per part turns that list into what the part's
:class:`~fusion.executors.runtime.part.PartRuntime` needs: for each outgoing message,
encode it or not; for each incoming message, densify it if it is sparse.
Engines never see a sparse payload.

Backward of a compressed activation edge (straight-through). The receiver
computes with ``y = decompress(topk(x))`` and its engine returns ``dL/dy``.
That gradient is sent back to the producer *as is* — the selection is treated
as the identity in backward — and, when ``"bwd"`` is in the edge's
directions, it is Top-K compressed independently with the edge's ratio
(its own selection, not the forward mask). This is what FusionLLM does
(activations and gradients are sparsified separately); masking ``dL/dy``
with the forward selection would starve every element not sent in forward
of gradient (99 % of them at r = 100) and would need the forward mask kept
per micro-batch. See ``docs/compression.md``.

The table holds, per tensor and peer, a choice of codec (an object of the
registry, :mod:`fusion.kernels.codecs`), its cfg and whether error feedback is
on; it never branches on a codec's name. Each message is encoded by that codec
with one :class:`~fusion.kernels.codecs.CodecContext`: on the tensor's device
(the codec's device path) when the part's engine hands the table tensors
(``device``: the torch engine, ``encode="device"``/``"torch"``), else on a
NumPy array (the host path, torch-free, as on NumPy parts); a received payload
is decoded by the codec that made it. The payload bytes are the same either
way. User codecs (registered with :func:`fusion.kernels.codec.register_codec`
by a plugin file the plan lists) are decoded on arrival and checked against
the graph, rejecting a malformed one (:meth:`CompressionTable.check_incoming`);
a NumPy part refuses, at load, an edge whose codec has only a torch path.

Tied parameters (:class:`TiedCodec`): with ``Plan.tied_codec`` set, each owner of
a parameter held by several parts encodes its gradient once; every owner sums
the *decoded* gradients of all owners (its own included) in plan part order, so
all owners apply the same bits.

Everything here is NumPy unless the engine hands the table tensors, so
NumPy-engine processes stay torch-free. Only error feedback uses torch
(``kernels.error_feedback.ErrorFeedback``), imported when an edge asks for it.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Iterable, Mapping

import numpy as np

from fusion.ir.errors import FusionError, WireError
from fusion.ir.graph import OpGraph
from fusion.kernels.codecs import CODECS, FLOAT_DTYPES, Codec, CodecContext, CodecPayload, Counter, Role
from fusion.kernels.codecs.base import dtype_of, is_torch, to_numpy, to_tensor
from fusion.kernels.codecs.registry import decode_checked, numpy_path
from fusion.kernels.codecs.topk import densify, topk_numpy
from fusion.executors.runtime.delta_edges import DeltaEdges

log = logging.getLogger(__name__)

Key = tuple[str, "int | None"]

#: tensor dtypes a payload may be compressed in (the codecs' ``FLOAT_DTYPES``)
COMPRESSIBLE = FLOAT_DTYPES

__all__ = ["EdgeRule", "CompressionTable", "table_for", "check_edges", "check_plan_codecs", "dense_payload", "densify",
           "topk_numpy", "COMPRESSIBLE"]


@dataclass(frozen=True)
class EdgeRule:
    """How one direction of one cut edge is compressed: a codec of the registry and its cfg.

    codec:          the codec cfg (``{"algo": "topk", "ratio": r}``, ``{"algo": "quant", "bits": 4, ...}``).
    error_feedback: add the stream's unsent residual to the next message (codecs that allow it: Top-K).
    unit:           the codec itself (``CODECS.unit(codec["algo"])``).
    """

    codec: dict
    error_feedback: bool = False
    unit: Codec = field(default=None, compare=False, repr=False)  # type: ignore[assignment]

    def __post_init__(self):
        if self.unit is None:
            object.__setattr__(self, "unit", CODECS.unit(self.codec["algo"]))

    @property
    def algo(self) -> str:
        return self.codec["algo"]


@dataclass(frozen=True)
class _EdgeRules:
    """Both directions' rules of one plan entry (None: that direction is sent dense)."""

    producer: str
    index: int | None
    src: str
    dst: str
    fwd: EdgeRule | None
    bwd: EdgeRule | None


def _role(direction: str) -> Role:
    return Role.ACTIVATION if direction == "fwd" else Role.GRADIENT


def _rule(e: Any, direction: str, part: str | None = None, engine: str = "torch") -> EdgeRule | None:
    """The rule of one direction of a plan's ``EdgeCompression``; FusionError (one line naming the edge and
    codec) for a codec the registry lacks, one that cannot serve the direction, a bad cfg, or a torch-only
    codec on a NumPy end (``part``)."""
    cfg = e.codec(direction)
    if cfg is None:
        return None
    where = f"compression of {e.producer}[{e.index}] {e.src}->{e.dst} ({direction})"
    if cfg["algo"] not in CODECS:
        raise FusionError(f"{where}: unknown codec {cfg['algo']!r} (known: {', '.join(CODECS.names())}); a user codec "
                          "is registered by a plugin file the plan lists (fusion.kernels.codec.register_codec), "
                          "imported with --trust-plugins")
    unit = CODECS.unit(cfg["algo"])
    try:
        unit.check(cfg, _role(direction), bool(e.error_feedback))
    except FusionError as err:
        raise FusionError(f"{where}: {err}") from None
    if engine == "numpy" and part in (e.src, e.dst) and not numpy_path(unit):
        raise FusionError(f"{where}: codec {cfg['algo']!r} has only a torch path, and part {part} runs the numpy "
                          "engine (give the codec encode_numpy/decode_numpy, or run the part on torch)")
    if getattr(unit, "is_dense", None) is not None and unit.is_dense(cfg):
        return None
    return EdgeRule(cfg, bool(e.error_feedback), unit)


def _plain(unit: Codec) -> bool:
    """Whether a codec's payloads are plain payloads (user codecs): decoded on arrival, checked against the graph."""
    return CodecPayload in unit.payload_types


def dense_payload(payload: Any) -> Any:
    """What an engine gets for a received payload: a stateless codec's payload decoded (NumPy), others unchanged.
    (A user codec's payload needs its edge's table: :meth:`CompressionTable.decode`.)"""
    if isinstance(payload, CodecPayload):
        raise WireError(f"a {payload.algo} codec payload on an edge this part does not decode with that codec")
    unit = CODECS.for_payload(payload)
    if unit is None or unit.stateful:
        return payload
    return unit.decode_host(payload)


@dataclass
class CompressionTable:
    """One part's compression rules, from the plan's ``EdgeCompression`` list.

    fwd:  (tensor key, dst part) -> rule for activations this part sends.
    bwd:  (tensor key, src part) -> rule for gradients this part sends back.
    recv: (tensor key, src part) -> rule of a *stateful* codec (``delta``) of activations this part receives
          (the receiving end keeps its state too; other codecs decode statelessly).
    user_in: (tensor key, peer part, is_grad) -> rule of a codec with plain payloads (a *user* codec) this part
          decodes on arrival: activations
          from ``peer`` (is_grad False) or gradients back from ``peer`` (True).
    delta: the per-edge state of this part's stateful edges (:mod:`.delta_edges`).
    device: where tensors handed to the table are encoded (the torch engine's device; None: the table only ever
          sees NumPy arrays). torch_on_cpu: the codecs' device paths run on a CPU device too (``encode="torch"``).
    """

    part: str
    fwd: dict[tuple[Key, str], EdgeRule] = field(default_factory=dict)
    bwd: dict[tuple[Key, str], EdgeRule] = field(default_factory=dict)
    recv: dict[tuple[Key, str], EdgeRule] = field(default_factory=dict)
    user_in: dict[tuple[Key, str, bool], EdgeRule] = field(default_factory=dict)
    delta: DeltaEdges = None  # type: ignore[assignment]  # set in __post_init__
    bfloat16: set[Key] = field(default_factory=set)  # compressed tensors whose uint16 payloads are bfloat16 bits
    #: compressed float32/float64 tensors of the graph that travel as bfloat16 where autocast made them so
    #: (``Plan.precision == "bf16"``: the engine runs under ``torch.autocast``, which gives a matmul's output
    #: bfloat16 and a residual sum's float32): a uint16 payload of one of these holds bfloat16 bits, a float
    #: one is its graph dtype. Empty unless the table is built with ``autocast=True``.
    autocast: set[Key] = field(default_factory=set)
    graph: OpGraph | None = field(default=None, repr=False)  # to check decoded user payloads against
    device: Any = None
    torch_on_cpu: bool = False
    #: CPU seconds (this thread's, ``time.thread_time``) spent in the codecs' encode and decode so far: what a step
    #: pays for its wire savings (``codec_s`` in the step's stats, issue 36)
    codec_s: float = 0.0
    _ef: Any = field(default=None, repr=False)
    _counter: Counter = field(default_factory=Counter, repr=False)  # messages sent (seeds stochastic rounding)
    _dense_warned: set = field(default_factory=set, repr=False)
    _edges: list = field(default_factory=list, repr=False)  # _EdgeRules of the entries that touch this part

    def __post_init__(self):
        if self.delta is None:  # a stateful codec's state lives where its device path runs
            self.delta = DeltaEdges(self.part, device=self.device if self.torch_codecs else None)

    @property
    def torch_codecs(self) -> bool:
        """Whether the codecs' device paths run for every codec (a non-CPU device, or ``torch_on_cpu``)."""
        return self.device is not None and (getattr(self.device, "type", self.device) != "cpu" or self.torch_on_cpu)

    def travels_as_bf16(self, key: Key) -> bool:
        """Whether a uint16 payload of tensor ``key`` holds bfloat16 bits: a bfloat16 tensor of the graph, or a
        float one that autocast may have made bfloat16 (:attr:`autocast`)."""
        return key in self.bfloat16 or key in self.autocast

    @classmethod
    def build(cls, part: str, edges: Iterable[Any], graph: OpGraph | None = None, engine: str = "torch",
              device: Any = None, torch_on_cpu: bool = False, autocast: bool = False) -> "CompressionTable":
        """Rules of ``part`` (whose engine is ``engine``, encoding tensors on ``device``); ratio-1 entries, and
        tensors of loss/label/input nodes, are dropped. ``autocast``: the parts run under bfloat16 autocast
        (``Plan.precision == "bf16"``): a float tensor of the graph is encoded, and decoded, in the dtype
        autocast gave it (bfloat16 or float32), as the dense path sends it."""
        t = cls(part, graph=graph, device=device, torch_on_cpu=torch_on_cpu)
        for e in edges:
            bad = set(e.directions) - {"fwd", "bwd"}
            if bad:
                raise FusionError(f"compression of {e.producer}[{e.index}] {e.src}->{e.dst}: unknown directions {sorted(bad)}")
            if not e.ratio >= 1:
                raise FusionError(f"compression of {e.producer}[{e.index}] {e.src}->{e.dst}: ratio {e.ratio!r} < 1")
            fwd, bwd = _rule(e, "fwd", part, engine), _rule(e, "bwd", part, engine)
            if fwd is None and bwd is None:
                continue
            if graph is not None:
                if e.producer not in graph.nodes:
                    raise FusionError(f"compression names unknown node {e.producer!r}")
                if graph[e.producer].kind.value in ("loss", "label", "input"):
                    log.info("compression of %s (%s) ignored: losses, labels and inputs are sent dense",
                             e.producer, graph[e.producer].kind.value)
                    continue
            key = (e.producer, e.index)
            if part in (e.src, e.dst):
                t._edges.append(_EdgeRules(e.producer, e.index, e.src, e.dst, fwd, bwd))
            graph_dtype = getattr(graph.output_meta(*key), "dtype", None) if graph is not None else None
            if graph_dtype == "bfloat16":
                t.bfloat16.add(key)
            elif autocast and graph_dtype in (None, "float32", "float64"):
                t.autocast.add(key)
            if e.src == part and fwd is not None:
                t.fwd[(key, e.dst)] = fwd
            if e.dst == part and bwd is not None:
                t.bwd[(key, e.src)] = bwd
            if e.dst == part and fwd is not None and fwd.unit.stateful:
                t.recv[(key, e.src)] = fwd
            if e.dst == part and fwd is not None and _plain(fwd.unit):
                t.user_in[(key, e.src, False)] = fwd
            if e.src == part and bwd is not None and _plain(bwd.unit):
                t.user_in[(key, e.dst, True)] = bwd
        return t

    def __bool__(self) -> bool:
        return bool(self.fwd or self.bwd or self.recv or self.user_in)

    # -- which tensors an engine keeps on its device -------------------------------------------
    def sent_keys(self) -> frozenset:
        """Activations this part sends compressed to at least one part (an engine hands them as tensors)."""
        return frozenset(k for k, _ in self.fwd)

    def grad_keys(self) -> frozenset:
        """Received activations whose gradient this part sends back compressed."""
        return frozenset(k for k, _ in self.bwd)

    def delta_cfgs(self) -> dict[tuple[str, Key, str], dict]:
        """(role, tensor key, peer) -> codec cfg of every stateful edge of this part, both ends."""
        out = {("send", k, p): r.codec for (k, p), r in self.fwd.items() if r.unit.stateful}
        out.update({("recv", k, p): r.codec for (k, p), r in self.recv.items()})
        return out

    # -- receiving -------------------------------------------------------------------------------
    def incoming_codecs(self) -> dict[tuple[Key, str, bool], Codec]:
        """(tensor key, peer part, is_grad) -> the codec the plan compiled for what this part receives from that
        peer: activations of an edge into this part (its ``fwd`` codec), gradients of an edge out of it (its
        ``bwd`` codec, as the consumer sends them back). What is not listed arrives dense."""
        out: dict[tuple[Key, str, bool], Codec] = {}
        for e in self._edges:
            key = (e.producer, e.index)
            if e.dst == self.part and e.fwd is not None:
                out[(key, e.src, False)] = e.fwd.unit
            if e.src == self.part and e.bwd is not None:
                out[(key, e.dst, True)] = e.bwd.unit
        return out

    def check_incoming(self, od: Any) -> None:
        """WireError for a stateful codec's payload this part cannot decode: on a gradient or an edge without
        such a rule here, or a row whose sample has no state here (cache miss). A user codec's payload is
        decoded here (the codec checks it, then its tensor is checked against the graph) and ``od.payload``
        becomes the dense array. Other payloads pass."""
        if isinstance(od.payload, CodecPayload):
            od.payload = self._user_decode(od)
            return
        unit = CODECS.for_payload(od.payload)
        if unit is None or not unit.stateful:
            return
        if od.is_grad or (od.key, od.src) not in self.recv:
            raise WireError(f"{unit.name} payload of {od.key[0]}[{od.key[1]}] from {od.src}: the plan does not "
                            f"compress that {'gradient' if od.is_grad else 'activation'} with {unit.name} towards "
                            f"{self.part}")
        self.delta.check(od.payload, od.key, od.src, od.micro_batch)

    def decode(self, od: Any, shape: tuple[int, ...] | None = None) -> Any:
        """What the engine gets for a received message: the payload decoded by the codec that made it (a tensor on
        the device when the table runs the device paths), a stateful codec's through this end's state (which it
        updates), reshaped to ``shape``; dense payloads unchanged."""
        t0 = time.thread_time()
        try:
            return self._decode(od, shape)
        finally:
            self.codec_s += time.thread_time() - t0

    def _decode(self, od: Any, shape: tuple[int, ...] | None) -> Any:
        p = od.payload
        if isinstance(p, CodecPayload):
            return self._user_decode(od)
        unit = CODECS.for_payload(p)
        if unit is None:
            return p
        if unit.stateful:
            self.check_incoming(od)
            rule = self.recv[(od.key, od.src)]
            ctx = CodecContext(Role.ACTIVATION, self.part, od.key, od.src, od.micro_batch,
                               state=partial(self.delta.buffer, "recv", od.key, od.src, rule.codec))
            out = unit.decode_host(p, ctx)
            return out.reshape(shape) if shape is not None else out
        if self.torch_codecs and unit.has_device:
            return unit.decode_device(p, self.device)
        return unit.decode_host(p)

    def decode_grad(self, od: Any) -> Any:
        """A received gradient: a tensor on the device when the table has one (dense ones too, so the sum over
        consumer parts is one torch sum in the host path's order), else a NumPy array."""
        g = self.decode(od)
        if self.device is None:
            return np.asarray(g)
        dtype = getattr(self.graph.output_meta(*od.key), "dtype", None) if self.graph is not None else None
        if od.key in self.autocast and isinstance(g, np.ndarray) and g.dtype == np.uint16:
            dtype = "bfloat16"  # the consumer's backward under autocast gave a bfloat16 gradient: it stays so
        return to_tensor(g, dtype, self.device)

    def _user_decode(self, od: Any) -> np.ndarray:
        what = f"{'gradient' if od.is_grad else 'activation'} {od.key[0]}[{od.key[1]}] from {od.src}"
        rule = self.user_in.get((od.key, od.src, bool(od.is_grad)))
        if rule is None or rule.algo != od.payload.algo:
            raise WireError(f"{what}: {od.payload.algo} payload, but the plan does not compress it with that codec "
                            f"towards {self.part}")
        shape = dtype = None
        if self.graph is not None:
            meta = self.graph.output_meta(*od.key)
            shape, dtype = tuple(getattr(meta, "shape", ())), getattr(meta, "dtype", None)
            if dtype not in COMPRESSIBLE:
                raise WireError(f"{what}: {od.payload.algo} payload for a {dtype} tensor (floating tensors only)")
            if od.key in self.autocast:  # under autocast the sender may have encoded bfloat16 values
                dtype = (dtype, "bfloat16")
        return decode_checked(rule.unit, od.payload, shape, dtype, what)

    # -- sending ---------------------------------------------------------------------------------
    def encode(self, payload: Any, key: Key, peer: str, is_grad: bool, mb: int, ids: Any = None,
               it: int | None = None) -> tuple[Any, dict | None]:
        """(payload to send, compress_cfg) for one outgoing message; dense and None when not compressed.

        ``payload``: a NumPy array, or a tensor (encoded on its device by the codec's device path where the
        table runs it, else on a NumPy view/copy; a tensor sent dense leaves as a NumPy array).
        ids: the micro-batch's sample ids (per-sample codecs need them); it: the iteration."""
        t0 = time.thread_time()
        try:
            return self._encode(payload, key, peer, is_grad, mb, ids, it)
        finally:
            self.codec_s += time.thread_time() - t0

    def _encode(self, payload: Any, key: Key, peer: str, is_grad: bool, mb: int, ids: Any,
                it: int | None) -> tuple[Any, dict | None]:
        rule = (self.bwd if is_grad else self.fwd).get((key, peer))
        tensor = is_torch(payload)
        dtype = dtype_of(payload, self.travels_as_bf16(key))
        if rule is None or dtype not in COMPRESSIBLE:
            if rule is not None:
                log.debug("%s: %s to %s sent dense (payload %s)", self.part, key, peer, dtype or type(payload).__name__)
            return (to_numpy(payload) if tensor else payload), None
        unit = rule.unit
        ctx = CodecContext(Role.GRADIENT if is_grad else Role.ACTIVATION, self.part, key, peer, mb, ids, it,
                           self._counter, self._feedback() if rule.error_feedback else None,
                           partial(self.delta.buffer, "send", key, peer, rule.codec) if unit.stateful else None)
        if tensor and unit.runs_on_device(payload.device.type, self.torch_on_cpu):
            p = unit.encode_device(payload.detach(), dtype, rule.codec, ctx)
        else:
            p = unit.encode_host(to_numpy(payload) if tensor else payload, dtype, rule.codec, ctx)
        if p is None:
            if (key, peer) not in self._dense_warned:
                self._dense_warned.add((key, peer))
                log.warning("%s: %s[%s] -> %s has shape %s, which %s cannot encode (for delta: its leading dimension "
                            "is not a multiple of the samples of a micro-batch): sent dense", self.part, key[0], key[1],
                            peer, list(payload.shape), unit.name)
            return (to_numpy(payload) if tensor else payload), None
        return p, unit.message_cfg(rule.codec, p)

    def _feedback(self):
        if self._ef is None:
            from fusion.kernels.error_feedback import ErrorFeedback

            self._ef = ErrorFeedback(enabled=True)
        return self._ef

    def residual(self, key: Key, peer: str, direction: str, mb: int):
        """Error-feedback residual of one stream (None when there is none yet)."""
        return None if self._ef is None else self._ef.residual((key, peer, direction, mb))


def table_for(part: str, edges: Iterable[Any] | None, graph: OpGraph | None = None, engine: str = "torch",
              device: Any = None, torch_on_cpu: bool = False, autocast: bool = False) -> CompressionTable | None:
    """The part's table, or None when nothing it sends is compressed (the dense path stays untouched)."""
    t = CompressionTable.build(part, edges or (), graph, engine, device, torch_on_cpu, autocast)
    return t if t else None


def check_edges(edges: Iterable[Any], assignment: Mapping[str, str]) -> None:
    """Every entry names a node on its ``src`` part and a part that exists."""
    parts = set(assignment.values())
    for e in edges:
        if e.producer not in assignment:
            raise FusionError(f"compression names unknown node {e.producer!r}")
        if assignment[e.producer] != e.src:
            raise FusionError(f"compression of {e.producer!r}: src {e.src!r} but the node runs on {assignment[e.producer]!r}")
        if e.dst not in parts:
            raise FusionError(f"compression of {e.producer!r}: unknown dst part {e.dst!r}")


def check_plan_codecs(plan: Any) -> None:
    """Refuse (FusionError, one line naming the edge and codec) a plan whose codecs this process can judge
    before any executor starts: every part's rules (unknown codec, bad cfg, a torch-only codec on a NumPy
    part), ``tied_codec`` and ``dp_codec``. When the plan names codecs this process does not know and lists
    plugins, a plugin may register them: each executor checks after importing its plugins instead."""
    names = {cfg["algo"] for e in plan.compression for cfg in (e.codec("fwd"), e.codec("bwd")) if cfg is not None}
    for extra in (plan.tied_codec, plan.dp_codec):
        if extra is not None:
            names.add(extra.get("algo"))
    if any(n not in CODECS for n in names) and plan.graph.plugins:
        return
    for name, part in plan.parts.items():
        table_for(name, plan.replica_compression(part.replica), plan.graph, part.engine)
    from fusion.executors.runtime.dp.tied import TiedCodec

    tied = TiedCodec.from_cfg(plan.tied_codec)
    if tied is not None:
        for name, part in plan.parts.items():
            tied.check_engine(name, part.engine)
    if plan.dp_codec is not None:
        CODECS.check_role(plan.dp_codec, Role.DP_GRADIENT, "plan.dp_codec")


def __getattr__(name: str):  # the tied-gradient codec's old home (its module is .tied)
    if name in ("TiedCodec", "sum_in_order"):
        from fusion.executors.runtime.dp import tied

        return getattr(tied, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
