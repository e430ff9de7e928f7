"""Per-edge compression of OP-Data payloads (FusionLLM §5, AdaTopK; quant; AQ-SGD deltas).

Codecs per direction: ``topk``, ``quant``, ``hadamard-quant`` (stateless) and
``delta`` (AQ-SGD, activations only, stateful: per-sample buffers at both ends
of the edge, :mod:`fusion.executors.runtime.delta_edges`).

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

User codecs (registered with :func:`fusion.kernels.codec.register_codec` by a
plugin file the plan lists) go through the :class:`~fusion.kernels.codec.Codec`
protocol: the sender encodes a message with the codec's NumPy path when it has
one, else its torch path; the plain payload travels as a
:class:`~fusion.kernels.codec.CodecPayload` (msgpack fields and raw byte frames,
never pickle); the receiver decodes it with the same path and checks the
tensor against the graph, rejecting a malformed one (:meth:`CompressionTable.check_incoming`).
A NumPy part refuses, at load, an edge whose codec has only a torch path.
The built-in codecs keep their NumPy fast paths below (byte-identical payloads).

Tied parameters (:class:`TiedCodec`): with ``Plan.tied_codec`` set, each owner of
a parameter held by several parts encodes its gradient once; every owner sums
the *decoded* gradients of all owners (its own included) in plan part order, so
all owners apply the same bits.

Everything here is NumPy: selection is ``kernels.topk_host`` (the same code
the torch codec runs for CPU tensors, so payloads are byte-identical to
``kernels.codec.compress``) and decoding is a NumPy scatter, so NumPy-engine
processes stay torch-free. Only error feedback uses torch
(``kernels.error_feedback.ErrorFeedback``), imported when an edge asks for it.
"""
from __future__ import annotations

import logging
import zlib
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

import numpy as np

from fusion.ir.errors import FusionError, WireError
from fusion.ir.graph import OpGraph
from fusion.kernels.codec import BUILTIN, CODECS, CodecPayload, check_plain, numpy_path
from fusion.kernels.delta import DeltaConfig, DeltaPayload
from fusion.executors.runtime.delta_edges import DeltaEdges
from fusion.kernels.dtypes import VALUE_DTYPES, index_dtype_for
from fusion.kernels.quant import QuantConfig, QuantPayload, dequantize, quantize
from fusion.kernels.sparse import SparsePayload, ratio_to_k
from fusion.kernels.topk_host import Wide
from fusion.kernels.topk_host import select as host_select

log = logging.getLogger(__name__)

Key = tuple[str, "int | None"]

#: tensor dtypes a payload may be compressed in; bfloat16 travels as uint16 bits, so
#: the table tells it from a real uint16 by the graph's dtype of the edge
COMPRESSIBLE = frozenset({"float16", "float32", "float64", "bfloat16"})


#: built-in codecs the runtime encodes and decodes with its own NumPy code (so NumPy CompNodes stay
#: torch-free); any other codec of the registry (``kernels.codec.CODECS``) runs through the Codec protocol
RUNTIME_CODECS = tuple(sorted(BUILTIN))


@dataclass(frozen=True)
class EdgeRule:
    """How one direction of one cut edge is compressed.

    codec:          the codec cfg (``{"algo": "topk", "ratio": r}``, ``{"algo": "quant", "bits": 4, ...}``).
    error_feedback: add the stream's unsent residual to the next message (Top-K only).
    """

    codec: dict
    error_feedback: bool = False

    @property
    def algo(self) -> str:
        return self.codec["algo"]

    @property
    def ratio(self) -> float:
        """The Top-K ratio r (k = ceil(numel / r), ``kernels.sparse.ratio_to_k``)."""
        return float(self.codec["ratio"])

    def cfg(self, k: int | None = None) -> dict:
        """The ``OpData.compress_cfg`` of a message encoded under this rule."""
        if self.algo == "topk":
            return {"algo": "topk", "ratio": self.ratio, "k": int(k)}
        return dict(self.codec)


def _rule(e: Any, direction: str, part: str | None = None, engine: str = "torch") -> EdgeRule | None:
    """The rule of one direction of a plan's ``EdgeCompression``; FusionError (one line naming the edge and
    codec) for a codec the registry lacks, a bad cfg, or a torch-only codec on a NumPy end (``part``)."""
    cfg = e.codec(direction)
    if cfg is None:
        return None
    where = f"compression of {e.producer}[{e.index}] {e.src}->{e.dst} ({direction})"
    if cfg["algo"] not in CODECS:
        raise FusionError(f"{where}: unknown codec {cfg['algo']!r} (known: {', '.join(CODECS.names())}); a user codec "
                          "is registered by a plugin file the plan lists (fusion.kernels.codec.register_codec), "
                          "imported with --trust-plugins")
    if cfg["algo"] not in BUILTIN:
        codec = CODECS.get(cfg["algo"])
        if e.error_feedback:
            raise FusionError(f"{where}: error feedback is for Top-K only")
        if engine == "numpy" and part in (e.src, e.dst) and not numpy_path(codec):
            raise FusionError(f"{where}: codec {cfg['algo']!r} has only a torch path, and part {part} runs the numpy "
                              "engine (give the codec encode_numpy/decode_numpy, or run the part on torch)")
        return EdgeRule(cfg, False)
    if cfg["algo"] == "delta":
        if direction != "fwd":
            raise FusionError(f"{where}: delta (AQ-SGD) compresses activations only; give the gradients "
                              "another codec (--compress-bwd)")
        if e.error_feedback:
            raise FusionError(f"{where}: error feedback is for Top-K only")
        DeltaConfig.from_cfg(cfg)  # raises naming the bad key
        return EdgeRule(cfg, False)
    if cfg["algo"] == "topk":
        if not float(cfg.get("ratio", 0)) >= 1:
            raise FusionError(f"{where}: ratio {cfg.get('ratio')!r} < 1")
        if float(cfg["ratio"]) == 1:
            return None
    else:
        from fusion.kernels.quant import QuantConfig

        QuantConfig.from_cfg(cfg, cfg["algo"] == "hadamard-quant")  # raises naming the bad key
        if e.error_feedback:
            raise FusionError(f"{where}: error feedback is for Top-K only")
    return EdgeRule(cfg, bool(e.error_feedback))


# -- user codecs through the Codec protocol ---------------------------------------------------

def _np_dtype(dtype: str):
    return np.uint16 if dtype == "bfloat16" else VALUE_DTYPES[dtype].numpy


def user_encode(cfg: Mapping[str, Any], arr: np.ndarray, dtype: str) -> CodecPayload:
    """A user codec's payload of a NumPy message (``dtype`` its graph dtype; bfloat16 as uint16 bits):
    its NumPy path when it has one, else its torch path. FusionError when it returns no plain payload."""
    algo = cfg["algo"]
    codec = CODECS.get(algo)
    if numpy_path(codec):
        out = codec.encode_numpy(np.ascontiguousarray(arr), cfg)
    else:
        out = codec.encode(_as_torch(arr, dtype), cfg)
    return CodecPayload(algo, dict(check_plain(out, algo)))


def user_decode(p: CodecPayload, shape: tuple[int, ...] | None, dtype: str | None, what: str) -> np.ndarray:
    """The NumPy array of a user codec's payload, checked against the tensor's graph ``shape``/``dtype``
    (None: unchecked); WireError naming ``what`` for a payload the codec refuses or a tensor that does not fit."""
    if p.algo not in CODECS or p.algo in BUILTIN:
        raise WireError(f"{what}: codec payload names {p.algo!r}, not a user codec registered here")
    codec = CODECS.get(p.algo)
    try:
        if numpy_path(codec):
            out = np.asarray(codec.decode_numpy(dict(p.fields)))
        else:
            out = _to_numpy(codec.decode(dict(p.fields), None))
    except Exception as e:  # the codec's own checks (lengths, counts) or its bugs: a rejected message
        raise WireError(f"{what}: {p.algo} payload refused by its codec: {type(e).__name__}: {str(e)[:200]}") from None
    if shape is not None and (tuple(out.shape) != tuple(shape) or out.dtype != np.dtype(_np_dtype(dtype))):
        raise WireError(f"{what}: {p.algo} payload decodes to {out.dtype}{list(out.shape)}, the graph says "
                        f"{dtype}{list(shape)}")
    return out


def _to_numpy(t: Any) -> np.ndarray:
    import torch

    if not isinstance(t, torch.Tensor):
        return np.asarray(t)
    t = t.detach().cpu()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16)
    return t.numpy()


def topk_numpy(arr: np.ndarray, k: int, dtype: str | None = None) -> SparsePayload:
    """Top-k of a float NumPy array as a :class:`SparsePayload` (same bytes as ``kernels.codec.compress``).

    ``dtype="bfloat16"``: ``arr`` holds bfloat16 bits (uint16); magnitudes are ranked on their
    exact float32 widening and the kept values stay bfloat16 bits.
    """
    a = np.ascontiguousarray(arr)
    flat = a.reshape(-1)
    name = dtype or a.dtype.name
    wide = (flat.astype(np.uint32) << 16).view(np.float32) if name == "bfloat16" else flat
    idx = host_select(Wide(wide), k)
    it = np.int32 if index_dtype_for(flat.size) == "int32" else np.int64
    return SparsePayload(flat[idx], idx.astype(it), tuple(a.shape), name, name)


def densify(p: SparsePayload) -> np.ndarray:
    """The dense NumPy array of a sparse payload (zeros where nothing was sent); validates first.

    bfloat16 values/tensors are handled as their uint16 bits, as everywhere in fusion.
    """
    p.validate()
    vals = p.values
    if p.value_dtype != p.dtype:
        if p.value_dtype == "bfloat16":
            vals = (vals.astype(np.uint32) << 16).view(np.float32)
        if p.dtype == "bfloat16":
            raise FusionError("sparse payload: a bfloat16 tensor must carry bfloat16 values")
        vals = vals.astype(VALUE_DTYPES[p.dtype].numpy)
    out = np.zeros(p.numel, dtype=VALUE_DTYPES[p.dtype].numpy)
    out[p.indices] = vals
    return out.reshape(p.shape)


def dense_payload(payload: Any) -> Any:
    """What an engine gets for a received payload: sparse and quantised ones decoded, others unchanged.
    (A user codec's payload needs its edge's table: :meth:`CompressionTable.decode`.)"""
    if isinstance(payload, CodecPayload):
        raise WireError(f"a {payload.algo} codec payload on an edge this part does not decode with that codec")
    if isinstance(payload, SparsePayload):
        return densify(payload)
    if isinstance(payload, QuantPayload):
        return dequantize(payload)
    return payload


@dataclass
class CompressionTable:
    """One part's compression rules, from the plan's ``EdgeCompression`` list.

    fwd:  (tensor key, dst part) -> rule for activations this part sends.
    bwd:  (tensor key, src part) -> rule for gradients this part sends back.
    recv: (tensor key, src part) -> ``delta`` rule of activations this part receives (the receiving
          end of an AQ-SGD edge keeps buffers too; other codecs decode statelessly).
    user_in: (tensor key, peer part, is_grad) -> rule of a *user* codec this part decodes: activations
          from ``peer`` (is_grad False) or gradients back from ``peer`` (True).
    delta: the AQ-SGD buffers of this part's delta edges (:mod:`.delta_edges`).
    """

    part: str
    fwd: dict[tuple[Key, str], EdgeRule] = field(default_factory=dict)
    bwd: dict[tuple[Key, str], EdgeRule] = field(default_factory=dict)
    recv: dict[tuple[Key, str], EdgeRule] = field(default_factory=dict)
    user_in: dict[tuple[Key, str, bool], EdgeRule] = field(default_factory=dict)
    delta: DeltaEdges = None  # type: ignore[assignment]  # set in __post_init__
    bfloat16: set[Key] = field(default_factory=set)  # compressed tensors whose uint16 payloads are bfloat16 bits
    graph: OpGraph | None = field(default=None, repr=False)  # to check decoded user payloads against
    _ef: Any = field(default=None, repr=False)
    _sent: int = field(default=0, repr=False)  # quantised messages sent (seeds stochastic rounding)

    def __post_init__(self):
        if self.delta is None:
            self.delta = DeltaEdges(self.part)

    @classmethod
    def build(cls, part: str, edges: Iterable[Any], graph: OpGraph | None = None,
              engine: str = "torch") -> "CompressionTable":
        """Rules of ``part`` (whose engine is ``engine``); ratio-1 entries, and tensors of loss/label/input
        nodes, are dropped."""
        t = cls(part, graph=graph)
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
            if graph is not None and getattr(graph.output_meta(*key), "dtype", None) == "bfloat16":
                t.bfloat16.add(key)
            if e.src == part and fwd is not None:
                t.fwd[(key, e.dst)] = fwd
            if e.dst == part and bwd is not None:
                t.bwd[(key, e.src)] = bwd
            if e.dst == part and fwd is not None and fwd.algo == "delta":
                t.recv[(key, e.src)] = fwd
            if e.dst == part and fwd is not None and fwd.algo not in BUILTIN:
                t.user_in[(key, e.src, False)] = fwd
            if e.src == part and bwd is not None and bwd.algo not in BUILTIN:
                t.user_in[(key, e.dst, True)] = bwd
        return t

    def __bool__(self) -> bool:
        return bool(self.fwd or self.bwd or self.recv or self.user_in)

    def delta_cfgs(self) -> dict[tuple[str, Key, str], dict]:
        """(role, tensor key, peer) -> codec cfg of every delta edge of this part, both ends."""
        out = {("send", k, p): r.codec for (k, p), r in self.fwd.items() if r.algo == "delta"}
        out.update({("recv", k, p): r.codec for (k, p), r in self.recv.items()})
        return out

    def check_incoming(self, od: Any) -> None:
        """WireError for a delta payload this part cannot decode: on a gradient or an edge without a delta
        rule here, or a delta row whose sample has no buffer (cache miss). A user codec's payload is decoded
        here (the codec checks it, then its tensor is checked against the graph) and ``od.payload`` becomes
        the dense array. Other payloads pass."""
        if isinstance(od.payload, CodecPayload):
            od.payload = self._user_decode(od)
            return
        if not isinstance(od.payload, DeltaPayload):
            return
        if od.is_grad or (od.key, od.src) not in self.recv:
            raise WireError(f"delta payload of {od.key[0]}[{od.key[1]}] from {od.src}: the plan does not compress "
                            f"that {'gradient' if od.is_grad else 'activation'} with delta towards {self.part}")
        self.delta.check(od.payload, od.key, od.src, od.micro_batch)

    def decode(self, od: Any, shape: tuple[int, ...] | None = None) -> Any:
        """What the engine gets for a received message: :func:`dense_payload`, and for a delta payload the
        activation rebuilt from this end's buffers (which it updates), reshaped to ``shape``."""
        if isinstance(od.payload, DeltaPayload):
            self.check_incoming(od)
            return self.delta.decode(od.payload, od.key, od.src, self.recv[(od.key, od.src)].codec, shape)
        if isinstance(od.payload, CodecPayload):
            return self._user_decode(od)
        return dense_payload(od.payload)

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
        return user_decode(od.payload, shape, dtype, what)

    def encode(self, payload: Any, key: Key, peer: str, is_grad: bool, mb: int, ids: Any = None,
               it: int | None = None) -> tuple[Any, dict | None]:
        """(payload to send, compress_cfg) for one outgoing message; dense and None when not compressed.

        ids: the micro-batch's sample ids (``delta`` edges need them); it: the iteration (seeds a
        delta edge's stochastic rounding)."""
        rule = (self.bwd if is_grad else self.fwd).get((key, peer))
        dtype = None
        if isinstance(payload, np.ndarray):
            dtype = "bfloat16" if payload.dtype == np.uint16 and key in self.bfloat16 else payload.dtype.name
        if rule is None or dtype not in COMPRESSIBLE:
            if rule is not None:
                log.debug("%s: %s to %s sent dense (payload %s)", self.part, key, peer, type(payload).__name__)
            return payload, None
        if rule.algo == "delta":
            p = self.delta.encode(payload, dtype, key, peer, rule.codec, ids, it, mb)
            return (payload, None) if p is None else (p, rule.cfg())
        if rule.algo not in BUILTIN:
            return user_encode(rule.codec, payload, dtype), rule.cfg()
        if rule.algo != "topk":
            cfg = QuantConfig.from_cfg(rule.codec, rule.algo == "hadamard-quant")
            if cfg.rounding == "stochastic":  # fresh noise per message, the same on every run of the plan
                self._sent += 1
                cfg = cfg.with_seed(zlib.crc32(repr((self.part, key, peer, is_grad, mb, self._sent)).encode()))
            return quantize(payload, cfg, dtype=dtype), rule.cfg()
        k = ratio_to_k(payload.size, rule.ratio)
        if rule.error_feedback:
            sp = self._feedback().compress((key, peer, "bwd" if is_grad else "fwd", mb), _as_torch(payload, dtype), k)
        else:
            sp = topk_numpy(payload, k, dtype)
        return sp, rule.cfg(k)

    def _feedback(self):
        if self._ef is None:
            from fusion.kernels.error_feedback import ErrorFeedback

            self._ef = ErrorFeedback(enabled=True)
        return self._ef

    def residual(self, key: Key, peer: str, direction: str, mb: int):
        """Error-feedback residual of one stream (None when there is none yet)."""
        return None if self._ef is None else self._ef.residual((key, peer, direction, mb))


def _as_torch(a: np.ndarray, dtype: str):
    import torch

    t = torch.from_numpy(np.ascontiguousarray(a))
    return t.view(torch.int16).view(torch.bfloat16) if dtype == "bfloat16" else t


def table_for(part: str, edges: Iterable[Any] | None, graph: OpGraph | None = None,
              engine: str = "torch") -> CompressionTable | None:
    """The part's table, or None when nothing it sends is compressed (the dense path stays untouched)."""
    t = CompressionTable.build(part, edges or (), graph, engine)
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


# -- tied-parameter gradients --------------------------------------------------------------------

#: codecs the tied-parameter exchange takes (stateless; ``delta`` is per-sample activations only)
TIED_BUILTIN = ("quant", "hadamard-quant", "topk")


@dataclass(frozen=True)
class TiedCodec:
    """How the owners of a tied parameter exchange its gradient (``Plan.tied_codec``).

    cfg: the codec cfg (``{"algo": "quant", "bits": 8}``; ``quant``, ``hadamard-quant``, ``topk`` or a user
         codec of the registry).

    Semantics (deterministic, the same on every owner): each owner encodes its own accumulated gradient
    once (:meth:`encode`), sends that payload to the other owners, and every owner sums the *decoded*
    gradients of all owners, its own included (:meth:`decode`, same NumPy code on every end), in plan
    part order (:func:`sum_in_order`). So every owner applies the same bits and the weights stay identical;
    the reference executor does the same in one process. A gradient whose dtype is not a float travels
    dense (and counts dense on every owner).
    """

    cfg: dict

    @classmethod
    def from_cfg(cls, cfg: Any, where: str = "plan.tied_codec") -> "TiedCodec | None":
        """None for no codec; FusionError (one line) for one the registry lacks or the exchange cannot use."""
        if cfg is None:
            return None
        if not isinstance(cfg, dict) or not isinstance(cfg.get("algo"), str):
            raise FusionError(f"{where}: expected a codec cfg with an 'algo' name, got {cfg!r}")
        algo = cfg["algo"]
        if algo not in CODECS:
            raise FusionError(f"{where}: unknown codec {algo!r} (known: {', '.join(CODECS.names())}); a user codec is "
                              "registered by a plugin file the plan lists, imported with --trust-plugins")
        if algo in BUILTIN and algo not in TIED_BUILTIN:
            raise FusionError(f"{where}: {algo} cannot compress tied-parameter gradients (use one of "
                              f"{', '.join(TIED_BUILTIN)} or a user codec)")
        if algo in ("quant", "hadamard-quant"):
            QuantConfig.from_cfg(cfg, algo == "hadamard-quant")
        elif algo == "topk" and not float(cfg.get("ratio", 0)) >= 1:
            raise FusionError(f"{where}: topk needs ratio >= 1, got {cfg.get('ratio')!r}")
        return cls(dict(cfg))

    @property
    def algo(self) -> str:
        return self.cfg["algo"]

    def check_engine(self, part: str, engine: str) -> None:
        """FusionError when a NumPy part would have to run a torch-only user codec."""
        if engine == "numpy" and self.algo not in BUILTIN and not numpy_path(CODECS.get(self.algo)):
            raise FusionError(f"plan.tied_codec: codec {self.algo!r} has only a torch path, and part {part} (an owner "
                              "of a tied parameter) runs the numpy engine")

    def encode(self, grad: np.ndarray, dtype: str, name: str, owner: str, it: int) -> Any:
        """The payload of ``owner``'s gradient of parameter ``name`` at iteration ``it`` (``dtype``: the graph's;
        bfloat16 as uint16 bits). Stochastic rounding is seeded by (name, owner, it): the same on every run."""
        if dtype not in COMPRESSIBLE:
            return grad
        if self.algo == "topk":
            return topk_numpy(grad, ratio_to_k(grad.size, float(self.cfg["ratio"])), dtype)
        if self.algo in ("quant", "hadamard-quant"):
            qc = QuantConfig.from_cfg(self.cfg, self.algo == "hadamard-quant")
            if qc.rounding == "stochastic":
                qc = qc.with_seed(zlib.crc32(repr(("tied", name, owner, it)).encode()))
            return quantize(grad, qc, dtype=dtype)
        return user_encode(self.cfg, grad, dtype)

    def decode(self, payload: Any, shape: tuple[int, ...], dtype: str, what: str) -> np.ndarray:
        """The dense gradient of a payload :meth:`encode` made; WireError naming ``what`` when it is not one
        (another codec, or a tensor of another shape or dtype)."""
        if isinstance(payload, np.ndarray) and dtype not in COMPRESSIBLE:
            return payload
        want = {"topk": SparsePayload, "quant": QuantPayload, "hadamard-quant": QuantPayload}.get(self.algo, CodecPayload)
        if not isinstance(payload, want) or (want is CodecPayload and payload.algo != self.algo) or \
                (want is QuantPayload and payload.hadamard != (self.algo == "hadamard-quant")):
            raise WireError(f"{what}: expected a {self.algo} payload (plan.tied_codec), got {type(payload).__name__}")
        if want is CodecPayload:
            return user_decode(payload, shape, dtype, what)
        if tuple(payload.shape) != tuple(shape) or payload.dtype != dtype:
            raise WireError(f"{what}: {self.algo} payload of {payload.dtype}{list(payload.shape)}, the parameter is "
                            f"{dtype}{list(shape)}")
        return np.asarray(densify(payload) if want is SparsePayload else dequantize(payload))


def sum_in_order(grads: list[np.ndarray]) -> np.ndarray:
    """The sum of ``grads`` left to right (the one order every owner and the reference executor use)."""
    total = np.array(grads[0], copy=True)
    for g in grads[1:]:
        total = total + g
    return total


def check_plan_codecs(plan: Any) -> None:
    """Refuse (FusionError, one line naming the edge and codec) a plan whose codecs this process can judge
    before any executor starts: every part's rules (unknown codec, bad cfg, a torch-only codec on a NumPy
    part) and ``tied_codec``. When the plan names codecs this process does not know and lists plugins, a
    plugin may register them: each executor checks after importing its plugins instead."""
    names = {cfg["algo"] for e in plan.compression for cfg in (e.codec("fwd"), e.codec("bwd")) if cfg is not None}
    if plan.tied_codec is not None:
        names.add(plan.tied_codec.get("algo"))
    if any(n not in CODECS for n in names) and plan.graph.plugins:
        return
    for name, part in plan.parts.items():
        table_for(name, plan.replica_compression(part.replica), plan.graph, part.engine)
    tied = TiedCodec.from_cfg(plan.tied_codec)
    if tied is not None:
        for name, part in plan.parts.items():
            tied.check_engine(name, part.engine)
