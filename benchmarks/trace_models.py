"""Which model families fusion traces, and whether they train like PyTorch (the table in docs/tracing.md).

    python benchmarks/trace_models.py            # every family in tests/ir/hf_models.py
    python benchmarks/trace_models.py llama t5   # some
    python benchmarks/trace_models.py --onnx     # also the ONNX backend-test conformance numbers

Each family: a tiny `transformers` model built from a config (random init, no
download, dropout 0), ``forward(input_ids or pixel_values, labels) -> loss``,
traced with :func:`fusion.ir.trace.trace`, saved and reloaded through the
plan encoding, then 3 AdamW steps as 2 and as 4 contiguous parts in the
reference executor against plain PyTorch (losses rtol 1e-5, gradients rtol
1e-4). Prints a Markdown table: front end used, node counts (all, MODULE
nodes, ATen/function nodes), parameters, trace time and the result.
"""
from __future__ import annotations

import json
import logging
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fusion.plan import OptimizerConfig  # noqa: E402
from fusion.executors.reference import ReferenceExecutor, contiguous_parts  # noqa: E402
from fusion.ir.model import Model  # noqa: E402
from fusion.ir.node import NodeKind  # noqa: E402
from fusion.ir.serialize import graph_from_dict, graph_to_dict  # noqa: E402
from fusion.ir.trace import trace  # noqa: E402
from tests.ir import hf_models  # noqa: E402

LR = 1e-3


def check(family: str) -> dict:
    row = {"family": family}
    module, example, options = hf_models.entry(family)
    t = time.perf_counter()
    try:
        model = trace(module, example, **options)
    except Exception as e:  # noqa: BLE001 - reported in the table
        row.update(result=f"cannot trace: {str(e).splitlines()[0]}")
        return row
    row["trace_s"] = time.perf_counter() - t
    g = graph_from_dict(json.loads(json.dumps(graph_to_dict(model.graph))))
    model = Model(g, model.params, model.example)
    kinds = [n.kind for n in g.nodes.values()]
    row.update(nodes=len(g), module_nodes=kinds.count(NodeKind.MODULE),
               function_nodes=kinds.count(NodeKind.FUNCTION) + kinds.count(NodeKind.LOSS),
               params=sum(int(np.prod(p.shape)) for p in g.params.values() if p.trainable))
    targets = {n.target for n in g.nodes.values()}
    row["front_end"] = "export" if any(t.startswith("aten.") for t in targets) else "fx"
    worst = 0.0
    for parts in (2, 4):
        ex = ReferenceExecutor(model, contiguous_parts(model, parts), OptimizerConfig("adamw", lr=LR, weight_decay=0.01))
        ref = hf_models.build(family, seed=0)
        opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=0.01)
        for s in range(3):
            batch = hf_models.example(family, seed=100 + s)
            r = ex.step(batch)
            opt.zero_grad(set_to_none=True)
            loss = ref(**batch)
            loss.backward()
            opt.step()
            worst = max(worst, abs(r.loss - loss.item()) / abs(loss.item()))
    row["max_rel_loss_diff"] = worst
    row["result"] = "trains like PyTorch (2 and 4 parts)" if worst <= 1e-5 else f"loss differs ({worst:.1e})"
    return row


def table(rows: list[dict]) -> str:
    lines = ["| family | front end | nodes | MODULE | ATen/function | trainable params | trace s | result |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "nodes" not in r:
            lines.append(f"| {r['family']} | | | | | | | {r['result']} |")
            continue
        lines.append(f"| {r['family']} | {r['front_end']} | {r['nodes']} | {r['module_nodes']} | {r['function_nodes']} | "
                     f"{r['params']:,} | {r['trace_s']:.2f} | {r['result']} |")
    return "\n".join(lines)


def timm_status() -> str:
    """Whether timm imports here (it needs a torchvision built for the installed torch; docs/tracing.md)."""
    try:
        import timm
    except Exception as e:  # noqa: BLE001 - ImportError, or torchvision's RuntimeError on a mismatched torch
        return f"timm: not importable here ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); not checked"
    return f"timm {timm.__version__}: importable, but not checked by this script yet"


def main(argv: list[str]) -> None:
    logging.basicConfig(level=logging.ERROR)
    torch.set_num_threads(1)
    families = [a for a in argv if not a.startswith("-")] or list(hf_models.FAMILIES)
    rows = [check(f) for f in families]
    print(table(rows))
    print(f"\n{timm_status()}")
    if "--onnx" in argv:
        import collections

        from tests.ir.onnx_conformance import run_all

        for bind, how in ((True, "shape-like inputs bound as constants"), (False, "as written")):
            res = run_all(bind_static=bind)
            c = collections.Counter(o.status for o in res)
            print(f"ONNX backend node tests (onnx package, {how}): {c['pass']} pass, {c['refused']} refused at load, "
                  f"{c['fail']} fail, of {len(res)} eligible ({100 * c['pass'] / len(res):.1f}% pass)")


if __name__ == "__main__":
    main(sys.argv[1:])
