"""Learned bottlenecks at the cut (issue 27): a graph rewrite that sends a low-rank code across a cut edge.

After partitioning, every chosen cut edge ``x`` (a float tensor of width D on its last dim, produced on part
``src`` and used on parts ``dst``) is replaced, for its users on the other side, by a residual bottleneck with an
explicit low-rank identity path (ResBM, "Residual Bottleneck Models", 2026; the fixed subspace is the idea of
Subspace / "Protocol" models, Ramasinghe et al. 2025):

    encoder, on src:  z = x @ P + x @ W_enc              (D -> R; z is what crosses the cut)
    decoder, on dst:  y = z @ P^T + z @ W_dec            (R -> D; y replaces x for every user on dst)

``P`` (D x R) is a fixed, non-trainable matrix with orthonormal columns (a graph buffer), the same in encoder
and decoder: ``x @ P @ P^T`` is the orthogonal projection of ``x`` onto a fixed R-dimensional subspace, the
low-rank identity path. ``W_enc`` (D x R) and ``W_dec`` (R x D, one per destination part) are new trainable
graph parameters, treated like any other (optimizer, checkpoints, clipping, data parallelism).

**Initialisation** (:func:`initial_values`): ``P`` is the Q factor of a Gaussian D x R matrix drawn from
``numpy.random.default_rng([seed, crc32(edge)])`` (so every part, the compiler and a one-process reference get
the same bits from the plan's seed); ``W_enc = 0`` and ``W_dec = 0``. With zeros the bottleneck starts as exactly
the projection ``x P P^T``, the identity path ResBM keeps explicit, and the learned encoder/decoder start as
zero residual corrections (as a zero-initialised residual branch: the model at step 0 is the projected model,
with no random perturbation of the stream). Both still get a gradient at the first step, since the identity
path carries it: ``dL/dW_dec = z^T dL/dy`` and ``dL/dW_enc = x^T (dL/dy (P + W_dec^T))``.

Users on ``src`` itself keep ``x``: the rest of the model is untouched. The new nodes are ordinary
``torch.matmul`` / ``torch.nn.functional.linear`` / ``operator.add`` nodes, so the estimator prices their FLOPs
and memory and the smaller wire bytes of ``z`` like any node and edge, every engine that runs those ops runs
them (the NumPy engine does), and a codec (``--compress``) applies to the code edge like to any edge.

The pass is a function ``graph -> graph`` (:func:`insert_bottlenecks`); the plan records what it inserted as
:class:`BottleneckSpec` entries (``plan.json`` field ``bottlenecks``).
"""
from __future__ import annotations

import zlib
from collections import Counter
from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np

from fusion.ir.errors import FusionError
from fusion.ir.graph import OpGraph, ParamSpec
from fusion.ir.node import NodeKind, NodeMeta, OpNode, ParamRef, Ref, TensorMeta, map_refs
from fusion.ir.serialize import copy_graph
from fusion.plan import BottleneckSpec

#: what ``--bottleneck auto`` tries: ranks D // k for these k (at least 1), see :func:`auto_ranks`
AUTO_DIVISORS = (64, 32, 16, 8)
#: dtypes a bottleneck is built for (NumPy holds the initial values in them)
FLOAT_DTYPES = ("float32", "float64", "float16")


class BottleneckError(FusionError):
    """A bottleneck that cannot be built (rank >= width, an edge that is not a float tensor, ...); one line."""


@dataclass(frozen=True)
class CutEdge:
    """One tensor that crosses the cut: output ``index`` of ``producer`` (None: its single output), computed on
    part ``src`` and used by the nodes ``users[dst]`` on each other part ``dst`` (in part order)."""

    producer: str
    index: int | None
    src: str
    users: tuple[tuple[str, tuple[str, ...]], ...]

    @property
    def name(self) -> str:
        """``producer`` or ``producer[index]``, how the CLI and the plan name the edge."""
        return self.producer if self.index is None else f"{self.producer}[{self.index}]"

    @property
    def dsts(self) -> tuple[str, ...]:
        return tuple(d for d, _ in self.users)


# -- which edges --------------------------------------------------------------------------------------------------
def residual_width(graph: OpGraph) -> int | None:
    """D, the width of the residual stream: the most common last dim among the float tensors of >= 2 dims the
    graph's nodes output (a transformer's hidden states, LayerNorms, projections, residual sums); ties go to
    the wider. None for a graph without such tensors."""
    widths = Counter(o.shape[-1] for n in graph.nodes.values() if n.kind != NodeKind.OUTPUT
                     for o in n.meta.outputs
                     if isinstance(o, TensorMeta) and len(o.shape) >= 2 and o.dtype in (*FLOAT_DTYPES, "bfloat16"))
    if not widths:
        return None
    return max(widths, key=lambda w: (widths[w], w))


#: op targets of a residual sum: a default bottleneck edge is the output of one of these (the residual stream)
ADD_TARGETS = ("operator.add", "torch.add", "torch.Tensor.add", "aten.add.Tensor", "onnx.Add")


def is_residual(graph: OpGraph, producer: str, index: int | None, width: int | None) -> bool:
    """Whether ``(producer, index)`` is the residual stream as the default picks it: the output of a sum
    (:data:`ADD_TARGETS`), a float tensor of >= 2 dims whose last dim is ``width`` (:func:`residual_width`)."""
    m = graph.output_meta(producer, index)
    return (graph[producer].target in ADD_TARGETS and isinstance(m, TensorMeta) and m.dtype in FLOAT_DTYPES
            and len(m.shape) >= 2 and m.shape[-1] == width)


def cut_edges(graph: OpGraph, assignment: Mapping[str, str], names: list[str] | None = None) -> list[CutEdge]:
    """The edges to put a bottleneck on, for the cut ``assignment`` (node -> part), in the graph's order of
    their producers.

    names None: every cut edge carrying the residual stream (:func:`is_residual`: a sum's float output whose
    last dim is :func:`residual_width`); others (an attention's q, k, v, an MLP's hidden layer) stay as they are. names given (``--bottleneck-edges``): exactly those edges
    (``producer`` or ``producer[index]``); BottleneckError for one that is not cut or not a float tensor.
    ``["all"]``: every cut edge carrying a float tensor of >= 2 dims, whatever its width.
    """
    found: dict[tuple[str, int | None], dict[str, list[str]]] = {}
    for node in graph.nodes.values():
        for ref in node.refs():
            src, dst = assignment[ref.node], assignment[node.name]
            if src != dst:
                users = found.setdefault((ref.node, ref.index), {}).setdefault(dst, [])
                if node.name not in users:
                    users.append(node.name)
    position = {n: k for k, n in enumerate(graph.nodes)}
    edges = [CutEdge(p, i, assignment[p], tuple((d, tuple(u)) for d, u in by_dst.items()))
             for (p, i), by_dst in sorted(found.items(), key=lambda kv: (position[kv[0][0]], kv[0][1] or 0))]
    if names is None:
        width = residual_width(graph)
        return [e for e in edges if is_residual(graph, e.producer, e.index, width)]
    if list(names) == ["all"]:
        return [e for e in edges if _float_meta(graph, e) is not None]
    by_name = {e.name: e for e in edges}
    out = []
    for name in names:
        if name not in by_name:
            producer = name.split("[")[0]
            if producer not in graph.nodes:
                raise BottleneckError(f"--bottleneck-edges {name}: the graph has no node {producer!r}")
            cut = sorted(by_name)
            raise BottleneckError(f"--bottleneck-edges {name}: not a cut edge of this plan (cut edges: "
                                  f"{', '.join(cut[:8])}{', ...' if len(cut) > 8 else ''})")
        e = by_name[name]
        if _float_meta(graph, e) is None:
            m = graph.output_meta(e.producer, e.index)
            what = f"a tensor of dtype {m.dtype}, shape {list(m.shape)}" if isinstance(m, TensorMeta) else "not a tensor"
            raise BottleneckError(f"--bottleneck-edges {name}: edge {name} {src_dst(e)} is {what}; a bottleneck "
                                  "needs a float tensor of at least 2 dims (float32, float64 or float16)")
        out.append(e)
    return out


def src_dst(e: CutEdge) -> str:
    return f"({e.src} -> {', '.join(e.dsts)})"


def _float_meta(graph: OpGraph, e: CutEdge) -> TensorMeta | None:
    m = graph.output_meta(e.producer, e.index)
    if isinstance(m, TensorMeta) and m.dtype in FLOAT_DTYPES and len(m.shape) >= 2:
        return m
    return None


def auto_ranks(width: int) -> list[int]:
    """``--bottleneck auto``'s candidates for width D: D/64, D/32, D/16, D/8 rounded down, at least 1, below D,
    without repeats, smallest first."""
    return sorted({max(1, width // k) for k in AUTO_DIVISORS} - set(range(width, width + 1)))


# -- the pass -------------------------------------------------------------------------------------------------------
def insert_bottlenecks(graph: OpGraph, cut_edges: list[CutEdge], rank: int | Mapping[str, int],
                       seed: int) -> tuple[OpGraph, list[BottleneckSpec]]:
    """A copy of ``graph`` with a residual bottleneck on each of ``cut_edges`` (see the module docstring), and
    what was inserted. ``rank``: R for every edge, or edge name -> R. ``seed``: the plan's seed; the initial
    values are :func:`initial_values` of the returned specs. The new nodes carry their shapes (``meta.outputs``);
    their costs are the estimator's to fill. BottleneckError (one line) for R >= D, R < 1, or an edge that is not
    a float tensor of >= 2 dims. ``graph`` itself is not changed."""
    g = copy_graph(graph)
    specs = []
    for e in cut_edges:
        r = rank[e.name] if isinstance(rank, Mapping) else rank
        m = _float_meta(g, e)
        if m is None:
            meta = g.output_meta(e.producer, e.index)
            what = f"a tensor of dtype {meta.dtype}" if isinstance(meta, TensorMeta) else "not a tensor"
            raise BottleneckError(f"bottleneck on edge {e.name} {src_dst(e)}: it is {what}; a bottleneck needs a "
                                  "float tensor of at least 2 dims (float32, float64 or float16)")
        d = m.shape[-1]
        if not isinstance(r, int) or isinstance(r, bool) or r < 1:
            raise BottleneckError(f"--bottleneck {r!r}: the rank must be an integer >= 1 (or auto)")
        if r >= d:
            raise BottleneckError(f"--bottleneck {r}: the rank must be smaller than the width of edge {e.name} "
                                  f"{src_dst(e)}, which is {d} (a bottleneck sends R of D numbers per row)")
        specs.append(_insert(g, e, m, r, seed))
    g.validate(check_targets=False)
    return g, specs


def _insert(g: OpGraph, e: CutEdge, m: TensorMeta, r: int, seed: int) -> BottleneckSpec:
    base = "bneck." + e.name.replace("[", ".").replace("]", "")
    node = "bneck_" + "".join(c if c.isalnum() else "_" for c in e.name)
    d, lead, grad = m.shape[-1], m.shape[:-1], True
    P, W_enc = f"{base}.P", f"{base}.W_enc"
    g.add_param(ParamSpec(P, (d, r), m.dtype, trainable=False))
    g.add_param(ParamSpec(W_enc, (d, r), m.dtype))
    x = Ref(e.producer, e.index)
    code_meta = TensorMeta((*lead, r), m.dtype, grad)
    full_meta = TensorMeta((*lead, d), m.dtype, grad)
    nodes: dict[str, str] = {}

    def add(name: str, target: str, args: tuple, meta: TensorMeta, part: str) -> Ref:
        g.add(OpNode(name, NodeKind.FUNCTION, target, args, label=f"bottleneck {e.name}",
                     meta=NodeMeta(outputs=(meta,))))
        nodes[name] = part
        return Ref(name)

    z_id = add(f"{node}_enc_id", "torch.matmul", (x, ParamRef(P)), code_meta, e.src)
    z_lr = add(f"{node}_enc", "torch.matmul", (x, ParamRef(W_enc)), code_meta, e.src)
    z = add(f"{node}_code", "operator.add", (z_id, z_lr), code_meta, e.src)
    decoders, outputs = [], []
    for dst, users in e.users:
        W_dec = f"{base}.W_dec.{dst}"
        g.add_param(ParamSpec(W_dec, (r, d), m.dtype))
        y_id = add(f"{node}_dec_id_{dst}", "torch.nn.functional.linear", (z, ParamRef(P)), full_meta, dst)
        y_lr = add(f"{node}_dec_{dst}", "torch.matmul", (z, ParamRef(W_dec)), full_meta, dst)
        y = add(f"{node}_out_{dst}", "operator.add", (y_id, y_lr), full_meta, dst)
        for u in users:
            n = g[u]
            swap = lambda v: y if isinstance(v, Ref) and v.node == e.producer and v.index == e.index else v  # noqa: E731
            n.args, n.kwargs = map_refs(n.args, swap), map_refs(n.kwargs, swap)
        decoders.append(W_dec)
        outputs.append(y.node)
    return BottleneckSpec(e.producer, e.index, e.src, e.dsts, d, r, m.dtype, P, W_enc, tuple(decoders), z.node,
                          tuple(outputs), nodes, seed)


def with_bottleneck_nodes(assignment: Mapping[str, str], specs: list[BottleneckSpec]) -> dict[str, str]:
    """``assignment`` (node -> part) with every inserted node on its part: encoders on ``src``, decoders on
    their ``dst``."""
    out = dict(assignment)
    for s in specs:
        out.update(s.nodes)
    return out


def initial_values(specs: list[BottleneckSpec]) -> dict[str, np.ndarray]:
    """The initial value of every parameter the pass added (see the module docstring): P orthonormal from
    ``default_rng([seed, crc32(edge)])``, W_enc and every W_dec zero. Deterministic: the same specs give the
    same bits in any process."""
    out = {}
    for s in specs:
        rng = np.random.default_rng([s.seed & 0xFFFFFFFF, zlib.crc32(s.edge.encode())])
        q, rr = np.linalg.qr(rng.standard_normal((s.width, s.rank)))
        q = q * np.where(np.diag(rr) < 0, -1.0, 1.0)  # a unique Q (positive diagonal of R)
        out[s.projection] = q.astype(s.dtype)
        out[s.encoder] = np.zeros((s.width, s.rank), s.dtype)
        for name in s.decoders:
            out[name] = np.zeros((s.rank, s.width), s.dtype)
    return out


@dataclass(frozen=True)
class BottleneckRequest:
    """What ``fusion compile --bottleneck`` asks for.

    rank:     R for every chosen edge, or ``"auto"``: the compiler prices, for k in :data:`AUTO_DIVISORS`, every
              edge at rank ``max(1, D // k)`` and keeps the smallest ranks whose predicted iteration is within
              :data:`AUTO_SLACK` of the best (one k for all edges).
    edges:    ``--bottleneck-edges``: edge names (``producer`` or ``producer[index]``); None: every cut edge of
              the residual width (:func:`cut_edges`).
    optional: the bottleneck is kept only where the predicted iteration on the same cut is shorter than without
              it (library use; ``--compress auto --allow-architecture-change`` prices it against the subspace and
              the model as it is instead, :mod:`fusion.passes.architecture`).
    """

    rank: int | str
    edges: tuple[str, ...] | None = None
    optional: bool = False


#: ``auto`` keeps the smallest rank whose predicted iteration is within this fraction of the best
AUTO_SLACK = 0.05


def parse_rank(value: str, flag: str = "--bottleneck") -> int | str:
    """``auto`` or an integer >= 1; BottleneckError otherwise."""
    if value.strip() == "auto":
        return "auto"
    try:
        r = int(value)
    except ValueError:
        raise BottleneckError(f"{flag} {value}: expected a rank (an integer >= 1) or auto") from None
    if r < 1:
        raise BottleneckError(f"{flag} {value}: the rank must be an integer >= 1 (or auto)")
    return r


# -- export: the trained bottlenecks and where they sit ------------------------------------------------------------
#: the safetensors metadata key of ``fusion export``'s bottleneck file: JSON, one entry per bottleneck
EXPORT_KEY = "fusion.bottlenecks"


def export_description(graph: OpGraph, specs: list[BottleneckSpec]) -> list[dict[str, Any]]:
    """Where each bottleneck sits, as plain data: its :class:`BottleneckSpec` fields plus ``users`` (dst part
    -> the graph nodes that read the decoder's output there, i.e. the users of x the bottleneck stands in for)."""
    out = []
    for s in specs:
        users = {dst: [n.name for n in graph.nodes.values() if y in n.producers()] for dst, y in zip(s.dsts, s.outputs)}
        out.append({**s.to_dict(), "users": users})
    return out


def apply_export(model, description: list[dict[str, Any]], tensors: Mapping[str, Any]):
    """``model`` (a fusion ``Model`` of the graph the run was compiled from, e.g. the user's module loaded with the
    exported ``state_dict`` and traced again) with the exported bottlenecks put back where they sat and their
    trained values: the model the run trained, for inference through fusion. BottleneckError naming the edge
    when the graph has no such producer or user (another model than the one the run trained)."""
    from fusion.ir.model import Model

    edges, ranks = [], {}
    for d in description:
        for n in (d["producer"], *(u for us in d["users"].values() for u in us)):
            if n not in model.graph.nodes:
                raise BottleneckError(f"bottleneck {d['producer']}: the model has no node {n!r}; is this the model "
                                      "the run trained?")
        e = CutEdge(d["producer"], d.get("index"), d["src"], tuple((k, tuple(v)) for k, v in d["users"].items()))
        edges.append(e)
        ranks[e.name] = int(d["rank"])
    seeds = {int(d.get("seed", 0)) for d in description} or {0}
    g, specs = insert_bottlenecks(model.graph, edges, ranks, seeds.pop())
    params = dict(model.params)
    for s in specs:
        for name in s.param_names:
            if name not in tensors:
                raise BottleneckError(f"bottleneck {s.edge}: no tensor {name!r} in the exported bottlenecks")
            params[name] = tensors[name]
    return Model(g, params, dict(model.example)), specs


def partition_prices(cm, req: BottleneckRequest):
    """What a bottleneck would make each tensor of ``cm`` cost on the wire, as the estimator's candidate codec
    prices (:class:`fusion.cost.estimate.CodecPrices`, one candidate per direction), so that OP-Fence prices
    every candidate cut as it would be after the pass: a tensor the pass would bottleneck (the residual stream,
    :func:`is_residual`, or a named edge) sends R / D of its bytes both ways (``auto``: its smallest candidate,
    D / 64); others stay dense. The encoder and decoder's few FLOPs are left out here; the plan prices the real
    nodes after the pass."""
    from fusion.cost.estimate import CodecPrices

    n = len(cm.t_key)
    wire = np.full(n, np.inf)
    width = residual_width(cm.graph)
    names = set(req.edges) if req.edges is not None else None
    for t, (producer, index) in enumerate(cm.t_key):
        m = cm.graph.output_meta(producer, index)
        if not (isinstance(m, TensorMeta) and m.dtype in FLOAT_DTYPES and len(m.shape) >= 2):
            continue
        name = producer if index is None else f"{producer}[{index}]"
        if names is None and not is_residual(cm.graph, producer, index, width) \
                or names is not None and names != {"all"} and name not in names:
            continue
        d = m.shape[-1]
        r = max(1, d // AUTO_DIVISORS[0]) if req.rank == "auto" else int(req.rank)
        if r < d:
            wire[t] = m.nbytes * r / d
    zeros = np.zeros(n)
    cfg = [{"algo": "bottleneck"}]
    return CodecPrices(wire, zeros, wire.copy(), zeros.copy(), None, cfg, list(cfg))
