"""Subspace-confined residual streams (issue 35): lossless cuts by construction.

Pluralis' Subspace Networks ("Protocol Models: Scaling Decentralized Training with Communication-Efficient Model
Parallelism", Ramasinghe et al. 2025, arXiv 2506.01260) constrain every weight that *writes* into a transformer's
residual stream to write only into the span of one shared, seed-derived orthonormal basis U (d x k). The stream
after any block is then

    x = T[ids] + U c        (c: k coordinates per token)

where ``T`` is the part of the token embedding outside span(U): a fixed table, seeded, that either side of a cut
recomputes from the token ids. A cut on the stream therefore sends the k coordinates ``c = x U`` (and the ids),
and the receiver rebuilds ``x = c U^T + T[ids]`` exactly (up to float rounding): the cost is capacity, not lost
information (unlike a projection of an unconstrained stream, :mod:`fusion.compress.bottleneck`).

Two graph rewrites, both ``graph -> graph`` with plain nodes (``torch.nn.functional.linear``,
``torch.nn.functional.embedding``, ``torch.matmul``, ``operator.add``), so the estimator prices them like any
node and every engine that runs those ops runs them:

* :func:`confine_writers` (before partitioning): the residual stream is found (the residual sums of the graph's
  residual width, :func:`fusion.compress.bottleneck.is_residual`, and identity dropouts of them); each writer
  (a ``torch.nn.Linear`` or ``torch.nn.Embedding`` module whose output, through dropouts of p = 0, is a term of a
  residual sum that is not itself the stream) becomes ``W'`` of k outputs followed by the fixed U: a Linear
  ``y = h W^T + b`` becomes ``y = (h W'^T + b') U^T`` with ``W'`` (k x d_in), ``b'`` (k); an Embedding ``E[i]``
  becomes ``E'[i] U^T`` with ``E'`` (V x k); the token embedding (the Embedding indexed by a graph input) adds the
  fixed table, ``T[ids] + E'[ids] U^T``, and a Linear that reads the token table (a tied output layer) reads the
  same effective table ``T + E' U^T`` as ``h T^T + (h U) E'^T``. The writer node keeps its name (its users are
  unchanged); the new parameters are named ``subspace.<user key>``.
* :func:`rebuild_cut` (after partitioning): each cut edge on the stream is replaced, for its users on the other
  part, by ``c = x @ U`` on the sender and ``x' = linear(c, U) + embedding(ids, T)`` on each receiver. A float cut
  edge off the stream is refused (SubspaceError), since it would cross dense.

Initial values (:func:`initial_params`): ``U`` is the Q factor of a Gaussian d x k matrix from
``numpy.random.default_rng([seed, crc32("subspace.U")])``; each constrained weight starts as the projection of the
user's initial weight, ``W' = U^T W``, ``b' = U^T b``, ``E' = E U`` (orthonormal rows keep the initial weights'
distribution); ``T = (I - U U^T) G`` with G Gaussian from ``default_rng([seed, crc32("subspace.T")])`` scaled to
the user's token table's standard deviation. Export folds them back (:func:`fold_back`): ``W = U W'``,
``b = U b'``, ``E = E' U^T (+ T)``: the user's own keys, a plain model whose function is the trained one.
"""
from __future__ import annotations

import zlib
from dataclasses import dataclass, field
from typing import Any, Mapping

import numpy as np

from fusion.compress.bottleneck import ADD_TARGETS, FLOAT_DTYPES, residual_width
from fusion.ir.errors import FusionError
from fusion.ir.graph import OpGraph, ParamSpec
from fusion.ir.node import NodeKind, NodeMeta, OpNode, ParamRef, Ref, TensorMeta, map_refs
from fusion.ir.serialize import copy_graph
from fusion.plan import SUBSPACE_BASIS, SUBSPACE_TABLE

#: node targets that pass the stream through unchanged (with p = 0)
IDENTITY_TARGETS = ("torch.nn.Dropout", "torch.nn.functional.dropout")
#: casts, the identity where they cast to the stream's own dtype (a traced ``transformers`` model's ``.to(float32)``)
CAST_TARGETS = ("aten.to.dtype", "aten.to.dtype_layout", "aten._to_copy.default", "torch.Tensor.to")
#: the fixed parameters' names (the plan format's, which checks them on load: :func:`fusion.plan.check_subspace`)
BASIS, TABLE = SUBSPACE_BASIS, SUBSPACE_TABLE
#: the safetensors metadata key of ``fusion export``'s subspace file
EXPORT_KEY = "fusion.subspace"


class SubspaceError(FusionError):
    """A subspace rewrite that cannot be built (no residual stream, K >= width, a cut off the stream); one line."""


@dataclass(frozen=True)
class SubspaceRequest:
    """What ``fusion compile --subspace K|FRACTION`` asks for: ``k`` coordinates (an int >= 1) or a fraction of
    the residual width in (0, 1) (k = round(fraction d), at least 1)."""

    k: int | float

    def rank(self, width: int) -> int:
        k = int(self.k) if isinstance(self.k, int) else max(1, round(float(self.k) * width))
        if k >= width:
            raise SubspaceError(f"--subspace {self.k}: k = {k} must be smaller than the residual width {width}")
        return k


def parse_subspace(value: str) -> SubspaceRequest:
    """``K`` (an integer >= 1) or ``FRACTION`` (a number in (0, 1)); SubspaceError otherwise."""
    v = value.strip()
    try:
        k = int(v)
    except ValueError:
        try:
            f = float(v)
        except ValueError:
            raise SubspaceError(f"--subspace {value}: expected K (an integer >= 1) or a fraction in (0, 1)") from None
        if not 0 < f < 1:
            raise SubspaceError(f"--subspace {value}: a fraction of the width must lie in (0, 1)")
        return SubspaceRequest(f)
    if k < 1:
        raise SubspaceError(f"--subspace {value}: K must be an integer >= 1")
    return SubspaceRequest(k)


@dataclass(frozen=True)
class WriterChange:
    """One writer of the stream confined to span(U). kind: ``linear``, ``embedding`` or ``token-embedding`` (the
    Embedding of the ids, which adds the fixed table), or ``tied-reader`` (a Linear reading the token table).
    replaced: the user's keys it read (weight, bias); added: the new trainable parameters, same order; nodes:
    the nodes the rewrite added. removed_params / added_params: trainable numbers removed and added."""

    node: str
    kind: str
    replaced: tuple[str, ...]
    added: tuple[str, ...]
    nodes: tuple[str, ...]
    removed_params: int
    added_params: int

    def to_dict(self) -> dict[str, Any]:
        return {"node": self.node, "kind": self.kind, "replaced": list(self.replaced), "added": list(self.added),
                "nodes": list(self.nodes), "removed_params": self.removed_params, "added_params": self.added_params}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "WriterChange":
        return cls(str(d["node"]), str(d["kind"]), tuple(d["replaced"]), tuple(d["added"]), tuple(d["nodes"]),
                   int(d["removed_params"]), int(d["added_params"]))


@dataclass(frozen=True)
class CutRebuild:
    """One cut edge on the stream as :func:`rebuild_cut` left it: ``producer`` on ``src`` sends the coordinates
    node ``coords`` (k wide) and each part of ``dsts`` rebuilds the full activation in ``outputs`` (same order);
    nodes: every added node -> its part."""

    producer: str
    src: str
    dsts: tuple[str, ...]
    coords: str
    outputs: tuple[str, ...]
    nodes: dict[str, str] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"producer": self.producer, "src": self.src, "dsts": list(self.dsts), "coords": self.coords,
                "outputs": list(self.outputs), "nodes": dict(self.nodes)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "CutRebuild":
        return cls(str(d["producer"]), str(d["src"]), tuple(d["dsts"]), str(d["coords"]), tuple(d["outputs"]),
                   dict(d.get("nodes", {})))


@dataclass(frozen=True)
class SubspaceSpec:
    """What the subspace passes did (``plan.json`` field ``subspace``): width d, rank k, dtype, seed, the token
    ids input, the stream nodes found, every writer changed and every cut edge rebuilt."""

    width: int
    rank: int
    dtype: str
    seed: int
    ids: str
    table_std: float
    stream: tuple[str, ...]
    writers: tuple[WriterChange, ...]
    cuts: tuple[CutRebuild, ...] = ()

    @property
    def params_removed(self) -> int:
        return sum(w.removed_params for w in self.writers)

    @property
    def params_added(self) -> int:
        return sum(w.added_params for w in self.writers)

    def to_dict(self) -> dict[str, Any]:
        return {"width": self.width, "rank": self.rank, "dtype": self.dtype, "seed": self.seed, "ids": self.ids,
                "table_std": self.table_std, "stream": list(self.stream),
                "writers": [w.to_dict() for w in self.writers], "cuts": [c.to_dict() for c in self.cuts]}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "SubspaceSpec":
        return cls(int(d["width"]), int(d["rank"]), str(d["dtype"]), int(d["seed"]), str(d["ids"]),
                   float(d["table_std"]), tuple(d["stream"]), tuple(WriterChange.from_dict(w) for w in d["writers"]),
                   tuple(CutRebuild.from_dict(c) for c in d.get("cuts", [])))


# -- finding the stream ----------------------------------------------------------------------------------------------
def _is_identity(node: OpNode, dtype: str | None = None) -> bool:
    if node.target in CAST_TARGETS:
        m = node.meta.outputs[0] if node.meta.outputs else None
        return dtype is not None and isinstance(m, TensorMeta) and m.dtype == dtype
    if node.target not in IDENTITY_TARGETS:
        return False
    p = node.attrs.get("p", node.kwargs.get("p", 0.5 if node.target.endswith("dropout") else 0.0))
    return float(p) == 0.0


def token_embedding(graph: OpGraph) -> str | None:
    """The ``torch.nn.Embedding`` module indexed by a graph input (the token embedding), None without exactly one."""
    inputs = {n.name for n in graph.placeholders(NodeKind.INPUT)}
    found = [n.name for n in graph.nodes.values() if n.kind == NodeKind.MODULE and n.target == "torch.nn.Embedding"
             and n.producers() and n.producers()[0] in inputs]
    return found[0] if len(found) == 1 else None


def _is_sum(graph: OpGraph, n: OpNode, d: int | None) -> bool:
    m = n.meta.outputs[0] if n.meta.outputs else None
    return (n.kind == NodeKind.FUNCTION and n.target in ADD_TARGETS and isinstance(m, TensorMeta)
            and m.dtype in FLOAT_DTYPES and len(m.shape) >= 2 and m.shape[-1] == d)


def find_stream(graph: OpGraph) -> tuple[int, list[str], dict[str, list[str]]]:
    """``(d, stream nodes, writers)``: the residual width, the nodes whose output is the stream (in graph order),
    and per writer node the residual sums it writes into. SubspaceError when there is none.

    With a token embedding (:func:`token_embedding`) the stream starts there and follows every sum of its width
    that has a stream node as a term (and identity dropouts of them): the token embedding is a writer, and so is
    the other term of each sum. Without one: every sum of the graph's most common width
    (:func:`fusion.compress.bottleneck.residual_width`)."""
    tok = token_embedding(graph)
    stream: list[str] = [tok] if tok is not None else []
    d = graph.output_meta(tok, None).shape[-1] if tok is not None else residual_width(graph)
    dtype = graph.output_meta(tok, None).dtype if tok is not None else None
    for n in graph.nodes.values():
        if n.name in stream:
            continue
        if _is_sum(graph, n, d) and (tok is None or any(r.node in stream for r in n.refs())):
            stream.append(n.name)
        elif _is_identity(n, dtype) and any(r.node in stream for r in n.refs()):
            stream.append(n.name)
    sums = [s for s in stream if graph[s].target in ADD_TARGETS]
    if len(sums) < 2:
        raise SubspaceError("--subspace: no residual stream found (it needs residual sums of the model's width; "
                            f"found {len(sums)})")
    writers: dict[str, list[str]] = {tok: []} if tok is not None else {}
    for s in sums:
        for r in graph[s].refs():
            w = r.node
            if w in stream:
                continue
            while _is_identity(graph[w], dtype):
                w = next(graph[w].refs()).node
            writers.setdefault(w, []).append(s)
    for w in writers:
        n = graph[w]
        if n.kind != NodeKind.MODULE or n.target not in ("torch.nn.Linear", "torch.nn.Embedding"):
            raise SubspaceError(f"--subspace: node {w} ({n.target or n.kind.value}) writes into the residual stream "
                                f"(sum {(writers[w] or ['-'])[0]}) and is not a Linear or Embedding module; not built")
        if n.target == "torch.nn.Linear" and len(n.producers()) != 1:
            raise SubspaceError(f"--subspace: writer {w} has {len(n.producers())} inputs; a Linear has one")
    return d, stream, writers


# -- the writers ---------------------------------------------------------------------------------------------------
def confine_writers(graph: OpGraph, req: SubspaceRequest, seed: int,
                    table_std: float = 0.02) -> tuple[OpGraph, SubspaceSpec]:
    """A copy of ``graph`` with every writer of the residual stream confined to span(U) (the module docstring),
    and what changed. SubspaceError (one line) without a stream, for K >= width, or for a writer that is not a
    Linear or Embedding module. ``graph`` itself is not changed."""
    d, stream, writers = find_stream(graph)
    k = req.rank(d)
    g = copy_graph(graph)
    dtype = g.output_meta(stream[0], None).dtype
    inputs = {n.name for n in g.placeholders(NodeKind.INPUT)}
    g.add_param(ParamSpec(BASIS, (d, k), dtype, trainable=False))
    token = [w for w in writers if g[w].target == "torch.nn.Embedding" and g[w].producers()[0] in inputs]
    if len(token) > 1:
        raise SubspaceError(f"--subspace: {len(token)} embeddings of graph inputs write into the stream "
                            f"({', '.join(token)}); one token embedding is built")
    ids = g[token[0]].producers()[0] if token else ""
    token_weight = g[token[0]].params["weight"] if token else ""
    if token:
        g.add_param(ParamSpec(TABLE, (g.params[token_weight].shape[0], d), dtype, trainable=False))
    changes = [_confine(g, g[w], d, k, w in token) for w in writers]
    if token:
        changes += _tied_readers(g, token_weight, k)
    used = {p for n in g.nodes.values() for p in n.param_names()}
    for name in [p for p in g.params if p not in used]:
        del g.params[name]
    g.validate(check_targets=False)
    return g, SubspaceSpec(d, k, dtype, seed, ids, float(table_std), tuple(stream), tuple(changes))


def _node(g: OpGraph, name: str, target: str, args: tuple, meta: TensorMeta, label: str) -> Ref:
    g.add(OpNode(name, NodeKind.FUNCTION, target, args, label=label, meta=NodeMeta(outputs=(meta,))))
    return Ref(name)


def _confine(g: OpGraph, n: OpNode, d: int, k: int, token: bool) -> WriterChange:
    out = n.meta.outputs[0]
    lead = out.shape[:-1]
    coord_meta = TensorMeta((*lead, k), out.dtype, out.requires_grad)
    label = f"subspace writer {n.name}"
    weight = n.params["weight"]
    replaced = [weight]
    spec = g.params[weight]
    new_w = f"subspace.{weight}"
    added = [new_w]
    (x,) = n.args[:1]
    nodes = [f"{n.name}_sub"]
    if n.target == "torch.nn.Linear":
        g.add_param(ParamSpec(new_w, (k, spec.shape[1]), spec.dtype))
        args: tuple = (x, ParamRef(new_w))
        removed, add = spec.shape[0] * spec.shape[1], k * spec.shape[1]
        if "bias" in n.params:
            b = n.params["bias"]
            replaced.append(b)
            added.append(f"subspace.{b}")
            g.add_param(ParamSpec(f"subspace.{b}", (k,), g.params[b].dtype))
            args += (ParamRef(f"subspace.{b}"),)
            removed, add = removed + d, add + k
        sub = _node(g, nodes[0], "torch.nn.functional.linear", args, coord_meta, label)
        kind = "linear"
    else:
        g.add_param(ParamSpec(new_w, (spec.shape[0], k), spec.dtype))
        sub = _node(g, nodes[0], "torch.nn.functional.embedding", (x, ParamRef(new_w)), coord_meta, label)
        removed, add = spec.shape[0] * spec.shape[1], spec.shape[0] * k
        kind = "token-embedding" if token else "embedding"
    if token:
        span = _node(g, f"{n.name}_span", "torch.nn.functional.linear", (sub, ParamRef(BASIS)), out, label)
        fixed = _node(g, f"{n.name}_fixed", "torch.nn.functional.embedding", (x, ParamRef(TABLE)), out, label)
        nodes += [span.node, fixed.node]
        n.target, n.args = "operator.add", (span, fixed)
    else:
        n.target, n.args = "torch.nn.functional.linear", (sub, ParamRef(BASIS))
    n.kind, n.kwargs, n.attrs, n.params, n.label = NodeKind.FUNCTION, {}, {}, {}, label
    return WriterChange(n.name, kind, tuple(replaced), tuple(added), tuple(nodes), removed, add)


def _tied_readers(g: OpGraph, token_weight: str, k: int) -> list[WriterChange]:
    """Every other node that read the token table (a tied output layer) now reads ``T + E' U^T``:
    ``h T^T + (h U) E'^T (+ b)``, without forming the table."""
    out = []
    for n in list(g.nodes.values()):
        if token_weight not in n.params.values():
            continue
        if n.kind != NodeKind.MODULE or n.target != "torch.nn.Linear" or n.params.get("weight") != token_weight:
            raise SubspaceError(f"--subspace: node {n.name} ({n.target}) reads the token table {token_weight}; only "
                                "a Linear (a tied output layer) is built")
        m = n.meta.outputs[0]
        (h,) = n.args[:1]
        label = f"subspace tied reader {n.name}"
        hm = g.output_meta(h.node, h.index)
        coords = _node(g, f"{n.name}_coords", "torch.matmul", (h, ParamRef(BASIS)),
                       TensorMeta((*hm.shape[:-1], k), hm.dtype, True), label)
        fixed = _node(g, f"{n.name}_fixed", "torch.nn.functional.linear", (h, ParamRef(TABLE)), m, label)
        span_args: tuple = (coords, ParamRef(f"subspace.{token_weight}"))
        if "bias" in n.params:
            span_args += (ParamRef(n.params["bias"]),)
        span = _node(g, f"{n.name}_span", "torch.nn.functional.linear", span_args, m, label)
        n.kind, n.target, n.args, n.kwargs, n.attrs, n.params, n.label = (
            NodeKind.FUNCTION, "operator.add", (fixed, span), {}, {}, {}, label)
        out.append(WriterChange(n.name, "tied-reader", (token_weight,), (f"subspace.{token_weight}",),
                                (coords.node, fixed.node, span.node), 0, 0))
    return out


# -- the cut -------------------------------------------------------------------------------------------------------
def rebuild_cut(graph: OpGraph, spec: SubspaceSpec, assignment: Mapping[str, str]) -> tuple[OpGraph, SubspaceSpec]:
    """A copy of ``graph`` (already through :func:`confine_writers`) where every cut edge of ``assignment``
    (node -> part) on the stream sends its k coordinates and each receiver rebuilds the full activation (the
    module docstring); ``spec`` with the rebuilt cuts. SubspaceError naming the edge for a float cut edge off the
    stream. Integer edges (the ids, the labels) and tensors that do not depend on the batch (a rotary embedding's
    cos/sin tables, computed from positions and a buffer) cross as they are."""
    g = copy_graph(graph)
    stream = set(spec.stream)
    found: dict[tuple[str, int | None], dict[str, list[str]]] = {}
    for node in g.nodes.values():
        for ref in node.refs():
            src, dst = assignment[ref.node], assignment[node.name]
            if src != dst:
                found.setdefault((ref.node, ref.index), {}).setdefault(dst, [])
                if node.name not in found[(ref.node, ref.index)][dst]:
                    found[(ref.node, ref.index)][dst].append(node.name)
    per_batch: set[str] = set()  # nodes whose value depends on the batch (a placeholder upstream)
    for n in g.nodes.values():
        if n.kind in (NodeKind.INPUT, NodeKind.LABEL) or any(r.node in per_batch for r in n.refs()):
            per_batch.add(n.name)
    cuts = []
    for (p, index), by_dst in found.items():
        m = g.output_meta(p, index)
        if p in stream and index is None:
            cuts.append(_rebuild(g, spec, p, assignment[p], by_dst))
        elif (isinstance(m, TensorMeta) and m.dtype in (*FLOAT_DTYPES, "bfloat16") and g[p].kind != NodeKind.INPUT
              and p in per_batch):
            name = p if index is None else f"{p}[{index}]"
            raise SubspaceError(f"--subspace: cut edge {name} ({assignment[p]} -> {', '.join(by_dst)}) is not on the "
                                "residual stream, so it would cross dense; cut between blocks (e.g. --strategy "
                                "opfence) or leave out --subspace")
    g.validate(check_targets=False)
    return g, SubspaceSpec(spec.width, spec.rank, spec.dtype, spec.seed, spec.ids, spec.table_std, spec.stream,
                           spec.writers, tuple(cuts))


def _rebuild(g: OpGraph, spec: SubspaceSpec, p: str, src: str, by_dst: Mapping[str, list[str]]) -> CutRebuild:
    m = g.output_meta(p, None)
    label = f"subspace cut {p}"
    nodes = {f"{p}_coords": src}
    c = _node(g, f"{p}_coords", "torch.matmul", (Ref(p), ParamRef(BASIS)),
              TensorMeta((*m.shape[:-1], spec.rank), m.dtype, m.requires_grad), label)
    outputs = []
    for dst, users in by_dst.items():
        span = _node(g, f"{p}_span_{dst}", "torch.nn.functional.linear", (c, ParamRef(BASIS)), m, label)
        parts = [span]
        if spec.ids:
            parts.append(_node(g, f"{p}_fixed_{dst}", "torch.nn.functional.embedding",
                               (Ref(spec.ids), ParamRef(TABLE)), m, label))
            y = _node(g, f"{p}_rebuilt_{dst}", "operator.add", tuple(parts), m, label)
        else:
            y = span
        nodes.update({r.node: dst for r in {*parts, y}})
        for u in users:
            n = g[u]
            swap = lambda v: y if isinstance(v, Ref) and v.node == p and v.index is None else v  # noqa: E731
            n.args, n.kwargs = map_refs(n.args, swap), map_refs(n.kwargs, swap)
        outputs.append(y.node)
    return CutRebuild(p, src, tuple(by_dst), c.node, tuple(outputs), nodes)


def with_cut_nodes(assignment: Mapping[str, str], spec: SubspaceSpec) -> dict[str, str]:
    """``assignment`` with every node :func:`rebuild_cut` added on its part."""
    out = dict(assignment)
    for c in spec.cuts:
        out.update(c.nodes)
    return out


# -- values --------------------------------------------------------------------------------------------------------
def basis(spec: SubspaceSpec) -> np.ndarray:
    """U (d x k, orthonormal columns) from the seed: the same bits in every process."""
    rng = np.random.default_rng([spec.seed & 0xFFFFFFFF, zlib.crc32(BASIS.encode())])
    q, r = np.linalg.qr(rng.standard_normal((spec.width, spec.rank)))
    return q * np.where(np.diag(r) < 0, -1.0, 1.0)  # a unique Q (positive diagonal of R)


def table(spec: SubspaceSpec, rows: int, U: np.ndarray | None = None) -> np.ndarray:
    """T (rows x d): a seeded Gaussian table with std ``spec.table_std``, its part in span(U) removed."""
    U = basis(spec) if U is None else U
    rng = np.random.default_rng([spec.seed & 0xFFFFFFFF, zlib.crc32(TABLE.encode())])
    G = rng.standard_normal((rows, spec.width)) * spec.table_std
    return G - (G @ U) @ U.T


def token_std(graph: OpGraph, params: Mapping[str, Any]) -> float:
    """The standard deviation of the user's initial token table (0.02, GPT-2's, without weights)."""
    try:
        _, _, writers = find_stream(graph)
    except SubspaceError:
        return 0.02
    inputs = {n.name for n in graph.placeholders(NodeKind.INPUT)}
    for w in writers:
        n = graph[w]
        if n.target == "torch.nn.Embedding" and n.producers()[0] in inputs and n.params["weight"] in params:
            return float(np.asarray(_np(params[n.params["weight"]]), np.float64).std())
    return 0.02


def _np(v) -> np.ndarray:
    return v.detach().cpu().numpy() if hasattr(v, "detach") else np.asarray(v)


def initial_params(spec: SubspaceSpec, params: Mapping[str, Any]) -> dict[str, Any]:
    """The rewritten model's initial weights from the user's ``params``: the user's replaced keys dropped, each new
    weight the projection of the user's (``W' = U^T W``, ``b' = U^T b``, ``E' = E U``), U and T added (module
    docstring). Empty without weights (a meta model)."""
    if not params:
        return {}
    U = basis(spec)
    out = {n: v for n, v in params.items()}
    for w in spec.writers:
        if w.kind == "tied-reader":
            continue
        for old, new in zip(w.replaced, w.added):
            v = np.asarray(_np(params[old]), np.float64)
            out[new] = (v @ U if w.kind.endswith("embedding") else U.T @ v).astype(spec.dtype)
    for w in spec.writers:
        for old in w.replaced:
            out.pop(old, None)
    out[BASIS] = U.astype(spec.dtype)
    if spec.ids:
        tok = next(w for w in spec.writers if w.kind == "token-embedding")
        out[TABLE] = table(spec, np.asarray(_np(params[tok.replaced[0]])).shape[0], U).astype(spec.dtype)
    return out


def fold_back(spec: SubspaceSpec, trained: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """The user's keys from the trained rewritten weights: ``W = U W'``, ``b = U b'``, ``E = E' U^T`` (+ T for the
    token table); the other trained weights as they are, U and T dropped. A plain model that loads these with
    ``strict=True`` computes what the rewritten model computes (up to float rounding)."""
    U = np.asarray(_np(trained[BASIS]), np.float64)
    out = {n: _np(v) for n, v in trained.items() if n not in (BASIS, TABLE)}
    for w in spec.writers:
        if w.kind == "tied-reader":
            continue
        for old, new in zip(w.replaced, w.added):
            v = np.asarray(_np(trained[new]), np.float64)
            folded = v @ U.T if w.kind.endswith("embedding") else U @ v
            if w.kind == "token-embedding":
                folded = folded + np.asarray(_np(trained[TABLE]), np.float64)
            out[old] = folded.astype(spec.dtype)
            out.pop(new, None)
    return out


def partition_prices(cm, spec: SubspaceSpec):
    """What the stream would cost on the wire after :func:`rebuild_cut`, as the estimator's candidate codec prices
    (:class:`fusion.cost.estimate.CodecPrices`): each stream tensor (``spec.stream``) k / d of its bytes both ways
    (the ids, a few bytes per token, left out), so OP-Fence prices every candidate cut as the pass leaves it; others
    dense."""
    from fusion.cost.estimate import CodecPrices

    n = len(cm.t_key)
    wire = np.full(n, np.inf)
    names = set(spec.stream)
    for t, (producer, index) in enumerate(cm.t_key):
        if producer in names and index is None:
            wire[t] = cm.graph.output_meta(producer, None).nbytes * spec.rank / spec.width
    zeros = np.zeros(n)
    cfg = [{"algo": "subspace"}]
    return CodecPrices(wire, zeros, wire.copy(), zeros.copy(), None, cfg, list(cfg))


# -- what fusion inspect and fusion export show ----------------------------------------------------------------------
def inspect_lines(spec: SubspaceSpec) -> list[str]:
    """``fusion inspect``'s section: every writer changed (kind, k, parameters removed and added) and every cut
    edge rebuilt from its coordinates."""
    lines = ["", f"subspace-confined residual stream (the model is changed: width {spec.width}, k = {spec.rank}, seed "
                 f"{spec.seed}; {spec.params_removed} trainable parameters removed, {spec.params_added} added; fixed "
                 f"{BASIS} {spec.width}x{spec.rank}" + (f" and token table {TABLE} from the ids '{spec.ids}'"
                                                         if spec.ids else "") + "):"]
    lines.append(f"{'writer':<36} {'kind':<16} {'k':>5} {'removed':>9} {'added':>9}  parameters")
    for w in spec.writers:
        lines.append(f"{w.node[:36]:<36} {w.kind:<16} {spec.rank:>5} {w.removed_params:>9} {w.added_params:>9}  "
                     f"{', '.join(w.replaced)} -> {', '.join(w.added)}")
    for c in spec.cuts:
        lines.append(f"  cut {c.producer} {c.src}->{','.join(c.dsts)}: sends {c.coords} ({spec.rank} of {spec.width} "
                     f"per token){' + the ids' if spec.ids else ''}; rebuilt exactly in {', '.join(c.outputs)}")
    return lines


def export_tensors(spec: SubspaceSpec, trained: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """What rebuilds the subspace beside the folded-back model (``fusion export``'s side file): U and T."""
    return {n: _np(trained[n]) for n in (BASIS, TABLE) if n in trained}
