"""An op's torch semantics: turn OpNodes into torch callables (the torch engine and shape inference build on it).

Module nodes are instantiated from ``target`` + ``attrs`` on the meta device
(no memory, no random init), then their parameters are replaced by the part's
real tensors, looked up by graph parameter name. Two nodes that reference the
same graph parameter (tied embeddings) therefore share one ``nn.Parameter``.
"""
from __future__ import annotations

import inspect
from typing import Any, Callable

import torch
from torch import nn

from fusion.ir.errors import GraphError
from fusion.ir.node import IDLE_KINDS, OpNode, map_nested
from fusion.ir.registry import REGISTRY, OpRegistry

TORCH_DTYPES = {
    "float64": torch.float64, "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
    "int64": torch.int64, "int32": torch.int32, "int16": torch.int16, "int8": torch.int8,
    "uint8": torch.uint8, "bool": torch.bool,
}


def dtype_name(dt: torch.dtype) -> str:
    return str(dt).removeprefix("torch.")


_SKIP_CTOR = {"self", "device", "dtype", "_weight", "_freeze"}


def module_attrs(mod: nn.Module) -> dict[str, Any]:
    """Constructor kwargs that rebuild ``mod`` (torch.nn built-ins and most user modules).

    Reads each ``__init__`` argument from the attribute of the same name; a
    ``bias`` argument becomes ``bias is not None``. Raises GraphError when
    the rebuilt module's parameter shapes differ from ``mod``'s.
    """
    cls = type(mod)
    attrs: dict[str, Any] = {}
    for name, p in inspect.signature(cls.__init__).parameters.items():
        if name in _SKIP_CTOR or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        if name == "bias" and hasattr(mod, "bias") and (mod.bias is None or isinstance(mod.bias, torch.Tensor)):
            attrs[name] = mod.bias is not None
        elif name == "elementwise_affine" and hasattr(mod, "weight"):
            attrs[name] = mod.weight is not None
        elif hasattr(mod, name):
            v = getattr(mod, name)
            if isinstance(v, torch.Tensor):
                continue  # e.g. CrossEntropyLoss(weight=None) stored as buffer
            attrs[name] = list(v) if isinstance(v, torch.Size) else v
        elif p.default is p.empty:
            raise GraphError(f"cannot recover constructor argument {name!r} of {cls.__name__}; register it as a custom op")
    return attrs


def build_module(node: OpNode, cls: type) -> nn.Module:
    """Instantiate a module node's class on the meta device."""
    try:
        with torch.device("meta"):
            return cls(**node.attrs)
    except TypeError as e:
        raise GraphError(f"cannot build {node.target} with attrs {node.attrs}: {e}", node.name) from None


def set_module_tensor(mod: nn.Module, path: str, value: torch.Tensor, trainable: bool) -> None:
    """Put ``value`` at dotted attribute ``path`` as a parameter (trainable) or a buffer, in place of what the module
    had there: a frozen parameter (``requires_grad=False``, as Whisper's sinusoidal position table) becomes a buffer,
    and the module keeps no second, meta copy of it under its parameters."""
    *parents, leaf = path.split(".")
    owner = mod
    for p in parents:
        owner = getattr(owner, p)
    if trainable:
        owner._buffers.pop(leaf, None)
        owner._parameters[leaf] = value
    else:
        owner._parameters.pop(leaf, None)
        owner._buffers[leaf] = value


def node_callable(node: OpNode, registry: OpRegistry = REGISTRY) -> tuple[str, Any]:
    """``(call, obj)``: for modules the class, for functions the function, for methods the name."""
    if node.kind in IDLE_KINDS:
        return node.kind.value, None
    found = registry.resolve(node.target)
    if found is None:
        raise GraphError(f"unknown op type {node.target!r}", node.name)
    return found


def make_call(call: str, obj: Any, module: nn.Module | None) -> Callable[..., Any]:
    """A uniform ``fn(*args, **kwargs)`` for a node."""
    if call == "module":
        return module
    if call == "method":
        name = obj
        return lambda self, *a, **k: getattr(self, name)(*a, **k)
    return obj


def on_device(v: Any, device: torch.device) -> Any:
    """Device literals in a graph mean "the device this part runs on" (graphs are device-neutral:
    a traced ``torch.arange(T, device=x.device)`` must follow its part to a GPU or the meta device)."""
    return map_nested(v, lambda x: device if isinstance(x, torch.device) else x)
