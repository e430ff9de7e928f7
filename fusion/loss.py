"""Which value of a model ``fusion run`` minimises: refuse a model with no loss, or make a named output the loss.

A graph without a LOSS node has nothing to train: its pipeline runs forward and backward of nothing, and every
step reports loss 0.0. :func:`choose_loss` turns that silent wrong answer into one line saying how to name a loss
(``--loss NAME``, an output of the graph that is a floating-point scalar; for an ONNX file also ``:cross_entropy`` /
``:mse`` or exporting the model with its loss as an output).
"""
from __future__ import annotations

from fusion.ir.errors import FusionError
from fusion.ir.graph import OpGraph
from fusion.ir.model import Model
from fusion.ir.node import NodeKind, TensorMeta


def _how(spec: str) -> str:
    """How to give the model of ``spec`` a loss, besides ``--loss NAME``."""
    path = spec.partition(":")[0] if ".onnx:" in spec else spec
    if path.endswith(".onnx"):
        return (f"or append a loss to its single output with {path}:cross_entropy (labels fed as y) or {path}:mse, "
                "or export the model with its loss as a scalar graph output")
    return "or return the loss from forward (a single scalar, or trace option loss_index naming it)"


def output_names(graph: OpGraph) -> dict[str, str]:
    """Name a user may pass to ``--loss`` -> OUTPUT node: the node's own name (``output_logits``, ``output:y``)
    and the name it was returned under (``logits`` for a dict key, ``y`` for an ONNX output)."""
    out: dict[str, str] = {}
    for n in graph:
        if n.kind != NodeKind.OUTPUT:
            continue
        out[n.name] = n.name
        for prefix in ("output:", "output_"):
            if n.name.startswith(prefix) and n.name[len(prefix):]:
                out.setdefault(n.name[len(prefix):], n.name)
    return out


def _describe(graph: OpGraph, outputs: dict[str, str]) -> str:
    """``logits float32[2, 3], loss float32[]``: each OUTPUT under its shortest name, with its type."""
    short: dict[str, str] = {}
    for user, node in outputs.items():
        if node not in short or len(user) < len(short[node]):
            short[node] = user
    parts = []
    for node, user in sorted(short.items(), key=lambda kv: kv[1]):
        outs = graph[node].meta.outputs
        o = outs[0] if outs else None
        parts.append(f"{user} {o.dtype}{list(o.shape)}" if isinstance(o, TensorMeta) else user)
    return ", ".join(parts) or "none"


def choose_loss(model: Model, name: str | None, spec: str) -> Model:
    """``model`` with a loss to minimise, or a :class:`FusionError` saying how to give it one.

    name: ``--loss NAME`` (None: not given): an OUTPUT of the graph (by node name or the name it was returned
          under); its producer becomes the LOSS node and the OUTPUT marker is dropped. It must be a floating-point
          scalar computed by the model. A model that already has a loss takes ``--loss`` only naming that loss.
    spec: the MODEL as the user wrote it, for the messages.
    """
    g = model.graph
    losses = [n.name for n in g.loss_nodes()]
    outputs = output_names(g)
    if name is None:
        if losses:
            return model
        raise FusionError(f"model {spec}: has no loss (no scalar loss output; its outputs: {_describe(g, outputs)}), so training "
                          "would minimise nothing and report loss 0.0: name a scalar output to minimise with "
                          f"--loss NAME, {_how(spec)}")
    if losses:
        if name in losses:
            return model
        raise FusionError(f"--loss {name}: model {spec} already has the loss {losses[0]!r}; --loss names a loss only "
                          "for a model without one")
    if name not in outputs:
        raise FusionError(f"--loss {name}: model {spec} has no output {name!r}; its outputs: "
                          f"{_describe(g, outputs)}")
    out = g[outputs[name]]
    ref = out.args[0]
    src = g[ref.node]
    meta = out.meta.outputs[0] if out.meta.outputs else None
    if src.kind not in (NodeKind.FUNCTION, NodeKind.MODULE) or ref.index is not None:
        raise FusionError(f"--loss {name}: output {name!r} is not computed by a node of its own ({src.kind.value} "
                          f"{src.name}); return the loss as its own value")
    if not (isinstance(meta, TensorMeta) and meta.shape == () and meta.dtype.startswith(("float", "bfloat"))):
        got = f"{meta.dtype}{list(meta.shape)}" if isinstance(meta, TensorMeta) else repr(meta)
        raise FusionError(f"--loss {name}: output {name!r} is {got}; the loss must be a floating-point scalar "
                          "(reduce it, e.g. .mean())")
    if any(u != out.name for u in g.users().get(src.name, [])):
        raise FusionError(f"--loss {name}: {src.name} feeds other nodes too; the loss must be a final value")
    del g.nodes[out.name]
    src.kind = NodeKind.LOSS
    g.validate(check_targets=False)
    return model
