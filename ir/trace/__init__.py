"""Trace a PyTorch module into an OP-DAG (the PyTorch front end of fusion).

    from fusion.ir.trace import trace
    model = trace(gpt, {"idx": idx, "targets": targets}, labels=("targets",))

Two front ends share one set of clean-up passes (:mod:`fusion.ir.trace.passes`):

- ``method="fx"`` (:mod:`fusion.ir.trace.fx`): ``torch.fx`` symbolic tracing;
  leaf modules become MODULE nodes, other calls FUNCTION nodes.
- ``method="export"`` (:mod:`fusion.ir.trace.export`): ``torch.export``; ATen
  nodes, regrouped into MODULE nodes per leaf module at granularity "module".
- ``method="auto"``: fx, and export when fx fails (the reason is logged).

Parameters are graph-level and named by their original ``state_dict`` names;
a tied weight is one graph parameter read by several nodes. Shapes are
static: the example micro-batch fixes them, and shape arithmetic is folded.
"""
from __future__ import annotations

import inspect
import logging
from typing import Any, Mapping

import torch
from torch import nn

from fusion.ir.errors import GraphError
from fusion.ir.model import Model
from fusion.ir.registry import REGISTRY, OpRegistry
from fusion.ir.trace.common import Traced
from fusion.ir.trace.passes import (detach_no_grad, eliminate_dead, fold_static_values, functionalize, index_multi_outputs,
                           mark_outputs)

log = logging.getLogger(__name__)

GRANULARITIES = ("module", "op")
METHODS = ("auto", "fx", "export")


def trace(module: nn.Module, example: Mapping[str, Any], *, labels: tuple[str, ...] = (),
          loss_index: int | str | None = None, granularity: str = "module", method: str = "auto",
          keep_outputs: bool = True) -> Model:
    """Trace ``module`` into a :class:`Model` (OP-DAG, initial weights, example).

    example:     forward argument name -> one micro-batch value. Tensors become
                 placeholders; other values (flags, ints, None) are baked in.
    labels:      argument names that become LABEL placeholders (targets: never
                 require grad, never compressed). Defaults to the module's
                 ``fusion_labels`` attribute when it has one, else none.
    loss_index:  when forward returns a tuple/list/dict, which element is the
                 loss (a position, or a key of a dict). Without it, a scalar
                 floating-point return value is the loss and anything else
                 makes an inference-only graph of OUTPUT nodes.
    granularity: ``"module"``: one node per leaf module (torch.nn built-ins and
                 registered types) and per other call; ``"op"``: one node per
                 ATen operator (uses torch.export).
    method:      ``"fx"``, ``"export"`` or ``"auto"`` (fx, then export).
    keep_outputs: keep the non-loss outputs as OUTPUT nodes (else they are dropped,
                 with the nodes only they needed).

    Leaf module types and functions are looked up in the process-wide op
    registry (``fusion.register_module`` / ``fusion.register_function``), the
    one the engines build nodes from.

    A module on the meta device traces without memory: ``Model.params`` is then
    empty (compile-only). Raises :class:`GraphError` naming the reason when the
    module cannot be traced.
    """
    if not isinstance(module, nn.Module):
        raise GraphError(f"trace() needs a torch.nn.Module, got {type(module).__name__}")
    if granularity not in GRANULARITIES:
        raise GraphError(f"granularity must be one of {GRANULARITIES}, got {granularity!r}")
    if method not in METHODS:
        raise GraphError(f"method must be one of {METHODS}, got {method!r}")
    labels = tuple(labels) or tuple(getattr(module, "fusion_labels", ()))
    _check_example(module, example, labels)
    example = unalias(example)
    cls = type(module).__name__
    if granularity == "op":
        if method == "fx":
            raise GraphError("granularity 'op' (ATen operators) needs method 'export' or 'auto', not 'fx'")
        method = "export"
    _warn_eval_mode(module)
    registry = REGISTRY

    traced: Traced | None = None
    fx_reason = None
    if method in ("fx", "auto"):
        from fusion.ir.trace.fx import trace_fx

        try:
            traced = trace_fx(module, example, labels, registry)
        except Exception as e:  # noqa: BLE001 - any fx failure is a reason to try export
            fx_reason = _reason(e)
            if method == "fx":
                raise GraphError(f"torch.fx cannot trace {cls}: {fx_reason}") from e
            log.info("torch.fx cannot trace %s (%s); falling back to torch.export", cls, fx_reason)
    if traced is None:
        from fusion.ir.trace.export import trace_export

        try:
            traced = trace_export(module, example, labels, granularity, registry)
        except Exception as e:  # noqa: BLE001 - reported with the reason
            # one reason: export's (it follows more than fx does); fx's reason was logged above
            raise GraphError(f"cannot trace {cls}: {_reason(e)}") from e
    return _finish(traced, example, loss_index, keep_outputs, registry)


def _finish(traced: Traced, example: Mapping[str, Any], loss_index, keep_outputs: bool, registry: OpRegistry) -> Model:
    from fusion.ir.shapes import infer_meta

    g = traced.graph
    functionalize(g, registry)
    g.validate(registry)
    feeds = {n.name: example[n.name] for n in g.placeholders()}
    infer_meta(g, feeds)
    returned = traced.returned
    if traced.no_grad:
        detached, returned = detach_no_grad(g, traced.no_grad, returned)
        if detached:
            infer_meta(g, feeds)  # requires_grad changes below the detached values
    loss = mark_outputs(g, returned, loss_index, keep_outputs)
    folded = fold_static_values(g)
    indexed = index_multi_outputs(g)
    dropped = eliminate_dead(g)
    g.plugins = registry.plugin_modules({n.target for n in g})
    g.validate(registry)  # the passes change arguments, never the shapes inferred above
    log.info("traced with %s: %d nodes, %d parameters, loss %s (%d static values folded, %d tuple items indexed, "
             "%d dead nodes dropped)", traced.method, len(g), len(g.params), loss, folded, indexed, dropped)
    tensors = {n: traced.tensors[n] for n in g.params}
    on_meta = any(t.device.type == "meta" for t in tensors.values())
    params = {} if on_meta else {n: t.detach().clone() for n, t in tensors.items()}
    return Model(g, params, dict(feeds))


def _check_example(module: nn.Module, example: Mapping[str, Any], labels: tuple[str, ...]) -> None:
    sig = inspect.signature(module.forward)
    known = {n for n, p in sig.parameters.items() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
    variadic_kw = any(p.kind == p.VAR_KEYWORD for p in sig.parameters.values())
    for name in example:
        if name not in known and not variadic_kw:
            raise GraphError(f"example names {name!r}, which is not an argument of {type(module).__name__}.forward{sig}")
    for name, p in sig.parameters.items():
        if name in known and p.default is p.empty and name not in example:
            raise GraphError(f"example lacks required forward argument {name!r} of {type(module).__name__}")
    for name in labels:
        if name not in example or not isinstance(example[name], torch.Tensor):
            raise GraphError(f"label {name!r} is not a tensor in the example")


def unalias(example: Mapping[str, Any]) -> dict[str, Any]:
    """``example`` with every tensor that shares memory with an earlier one (``{"input_ids": ids, "labels": ids}``)
    replaced by a copy, so each name becomes its own placeholder.

    Tracers see tensors, not names: torch.export lifts one tensor passed under two names into one graph input
    (the second name's), so the graph would feed every user of ``input_ids`` from ``labels`` and leave
    ``input_ids`` unused, a silently wrong model. A copy per name keeps the names apart; at run time each name
    is fed on its own, whatever the batches alias."""
    out: dict[str, Any] = {}
    seen: dict[tuple, str] = {}
    for name, v in example.items():
        if isinstance(v, torch.Tensor) and v.device.type != "meta" and v.numel():
            st = v.untyped_storage()
            key = (v.device, st.data_ptr())
            if key in seen:
                log.info("example inputs %r and %r are the same tensor; %r is traced from a copy, as its own input",
                         seen[key], name, name)
                v = v.clone()
            else:
                seen[key] = name
        out[name] = v
    return out


def _warn_eval_mode(module: nn.Module) -> None:
    stochastic = [n for n, m in module.named_modules() if isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0]
    if stochastic and module.training:
        log.warning("dropout with p>0 in %s: random masks differ between a partitioned run and plain PyTorch, "
                    "so only p=0 runs are comparable", stochastic[:3])
    if not module.training:
        log.warning("%s is in eval mode; executors build leaf modules in training mode", type(module).__name__)


def _reason(e: BaseException) -> str:
    from fusion.ir.trace.export import ExportFailure

    if isinstance(e, (GraphError, ExportFailure)):
        return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}".rstrip(": ")


__all__ = ["trace", "GRANULARITIES", "METHODS"]
