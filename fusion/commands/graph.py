"""``fusion graph MODEL``: print a model's OP-DAG (nodes, shapes, parameters)."""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fusion.options.commands import Graph


def run(args: "Graph") -> int:
    """``fusion graph`` with its options (:class:`fusion.options.commands.Graph`)."""
    from fusion.loader import load_model
    from fusion.ir.serialize import save_graph

    model = load_model(args.model)
    g = model.graph
    n_edges = sum(len(list(n.refs())) for n in g.nodes.values())
    print(f"{args.model}: {len(g.nodes)} nodes, {n_edges} edges, {len(g.params)} parameters "
          f"({sum(p.nbytes for p in g.params.values()) / 1e6:.2f} MB)")
    rows = []
    for n in g.nodes.values():
        shapes = ", ".join(str(list(o.shape)) if hasattr(o, "shape") else repr(o.value) for o in n.meta.outputs)
        inputs = ", ".join(r.node if r.index is None else f"{r.node}[{r.index}]" for r in n.refs()) or "-"
        rows.append((n.name, n.kind.value, n.target or "", shapes, inputs))
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(("node", "kind", "op", "output shape"))]
    widths = [min(w, cap) for w, cap in zip(widths, (32, 8, 44, 24))]
    head = ("node", "kind", "op", "output shape", "inputs (edges into the node)")
    print("  ".join(h.ljust(w) for h, w in zip(head, widths)) + "  " + head[-1])
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[-1])
    if args.output:
        save_graph(g, args.output)
    return 0
