"""Split backward for zero-bubble schedules: input gradients now, weight gradients later.

A zero-bubble pipeline (Qi et al., 2023) splits a stage's backward into
``B`` (the gradients of the stage's inputs, which the previous stage waits
for) and ``W`` (the gradients of its parameters, which nobody waits for), so
``W`` can fill what would be a bubble. ``input_grads`` does ``B`` and returns
a closure doing ``W``.

The split follows ``torch.distributed.pipelining``'s: the autograd graph is
walked from the roots; for each parameter, the *intermediate* autograd nodes
where its path meets the path of the inputs are found; ``B`` runs
``autograd.grad`` for the inputs with hooks capturing the gradients arriving
at those intermediates, and ``W`` continues from the captured gradients to
the parameters only, so no vector-Jacobian product is computed twice. Where
that cannot cover every parameter (a parameter whose path to the outputs
never meets the inputs', or a part that receives nothing needing a
gradient, as the first stage) ``W`` runs the parameter part of backward from
the roots instead (``autograd.backward(..., inputs=params)``), which is
still exact.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch

try:  # torch's own helpers (private; present since torch 2.4)
    from torch.distributed.pipelining import _backward as _zb
except ImportError:  # pragma: no cover - an older or stripped torch: the exact fallback only
    _zb = None


def input_grads(roots: Sequence[torch.Tensor], seeds: Sequence[torch.Tensor], leaves: Sequence[torch.Tensor],
                params: Sequence[torch.Tensor]) -> Callable[[], None]:
    """Accumulate ``d roots / d leaves`` (seeded by ``seeds``) into each leaf's ``.grad``;
    return the closure that accumulates the parameters' gradients into their ``.grad``."""
    params = [p for p in params if p.requires_grad]
    if not roots:
        return lambda: None
    if not leaves:  # nothing to send back: all of backward is weight gradient
        return lambda: torch.autograd.backward(list(roots), list(seeds), inputs=params) if params else None
    groups = _param_groups(roots, leaves, params) if _zb is not None else None
    if groups is None:  # exact fallback: input grads now (graph kept), the parameter half later
        _accumulate(leaves, torch.autograd.grad(roots, leaves, seeds, retain_graph=True, allow_unused=True))
        return lambda: torch.autograd.backward(list(roots), list(seeds), inputs=params) if params else None
    handles = []
    try:
        for group in groups:
            group["intermediates"] = list(group["intermediates"])
            for i, node in enumerate(group["intermediates"]):
                handles.append(node.register_prehook(_capture(group, i)))
        _accumulate(leaves, torch.autograd.grad(roots, leaves, seeds, retain_graph=True, allow_unused=True))
    finally:
        for h in handles:
            h.remove()
    if any(g.get("grads") is None for g in groups):  # an intermediate B never reached: W from the roots
        return lambda: torch.autograd.backward(list(roots), list(seeds), inputs=params)
    # the closure keeps only the intermediates: the output side of the graph is freed with the roots

    def weight() -> None:
        _zb.stage_backward_weight(iter(params), groups)

    return weight


def _capture(group: dict, i: int):
    def hook(grad_outputs):
        if group.get("grads") is None:
            group["grads"] = [None] * len(group["intermediates"])
        group["grads"][i] = grad_outputs
    return hook


def _accumulate(leaves, grads) -> None:
    for leaf, g in zip(leaves, grads):
        if g is not None:
            leaf.grad = g if leaf.grad is None else leaf.grad + g


def _param_groups(roots, leaves, params) -> list[dict] | None:
    """torch's parameter groups, or None when they do not cover every parameter the roots reach."""
    out_fns = [f for f in (_zb._get_grad_fn_or_grad_acc(r) for r in roots) if f is not None]
    in_fns = [f for f in (_zb._get_grad_fn_or_grad_acc(l) for l in leaves) if f is not None]
    w_fns = [_zb._get_grad_fn_or_grad_acc(p) for p in params]
    rev = _zb.construct_reverse_graph(out_fns)
    reached = {f for f in w_fns if f in rev}
    groups = _zb.get_param_groups(in_fns, [f for f in w_fns if f in reached], rev)
    covered = set().union(*(g["params"] for g in groups)) if groups else set()
    if covered != reached:
        return None
    return groups
