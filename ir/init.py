"""Deterministic initial weights for graphs built with the op-node API."""
from __future__ import annotations

import torch

from fusion.ir.graph import OpGraph
from fusion.ir.node import NodeKind
from fusion.ir.torch_ops import node_callable


def init_params(graph: OpGraph, seed: int) -> dict[str, torch.Tensor]:
    """Instantiate every module node for real, in topological order, under
    one generator seeded with ``seed``, and take its parameters and buffers.
    A parameter shared by several nodes takes the value of its first user."""
    out: dict[str, torch.Tensor] = {}
    gen_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        for node in graph.nodes.values():
            if not node.params:
                continue
            call, cls = node_callable(node)
            if call != "module" or node.kind not in (NodeKind.MODULE, NodeKind.LOSS):
                continue
            mod = cls(**node.attrs)
            tensors = dict(mod.named_parameters(remove_duplicate=False)) | dict(mod.named_buffers())
            for path, pname in node.params.items():
                if pname not in out:
                    out[pname] = tensors[path].detach().clone()
    finally:
        torch.random.set_rng_state(gen_state)
    return out
