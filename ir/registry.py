"""The op registry: which target names exist and how they are called.

A target name is resolved in this order:

1. names registered by the user with :func:`register_module` /
   :func:`register_function` (FusionLLM Figure 7's ``TORCH_MODULES.register``);
2. ``torch.nn.<Module>`` module types;
3. ``torch.Tensor.<method>`` tensor methods;
4. ``aten.<op>.<overload>`` ATen operators (``torch.ops.aten``);
   ``onnx.<OpType>`` ONNX operators (the torch engine's implementations in
   ``fusion.executors.onnx_torch_ops``);
5. functions reachable under ``torch.``, ``operator.``, ``math.`` and a few
   harmless builtins.

Nothing else is imported: a plan or graph file cannot make an executor import
arbitrary code. User registrations live in modules the plan lists as plugins
(``OpGraph.plugins``), which the user wrote and the executor imports.
Resolution needs torch only for torch names; a process without torch can
still check user-registered names.
"""
from __future__ import annotations

import importlib
import inspect
import math
import operator
from dataclasses import dataclass
from typing import Any, Callable

_SAFE_BUILTINS = {"getattr": getattr, "len": len, "int": int, "float": float, "min": min, "max": max, "abs": abs}
_FUNCTION_ROOTS = ("torch.", "operator.", "math.", "builtins.")


@dataclass(frozen=True)
class OpSpec:
    """How a target is called.

    call: ``"module"`` (a class instantiated with ``attrs`` then called),
          ``"function"`` (called with args) or ``"method"`` (``args[0].<name>(*args[1:])``).
    min_args / max_args: positional arity when known; None when unknown or unbounded.
    """

    target: str
    call: str
    min_args: int | None = None
    max_args: int | None = None


class OpRegistry:
    """Maps target names to module classes and functions."""

    def __init__(self) -> None:
        self._modules: dict[str, type] = {}
        self._functions: dict[str, Callable] = {}

    # -- registration ---------------------------------------------------------
    def register_module(self, name: str, cls: type | None = None):
        """Register a module type under ``name``; usable as a decorator."""

        def deco(c: type) -> type:
            self._modules[name] = c
            return c

        return deco(cls) if cls is not None else deco

    def register_function(self, name: str, fn: Callable | None = None):
        """Register a function under ``name``; usable as a decorator."""

        def deco(f: Callable) -> Callable:
            self._functions[name] = f
            return f

        return deco(fn) if fn is not None else deco

    def registered_name(self, obj: Any) -> str | None:
        """The registered name of a class or function, if the user registered it."""
        for table in (self._modules, self._functions):
            for name, value in table.items():
                if value is obj:
                    return name
        return None

    def plugin_modules(self, targets: set[str]) -> list[str]:
        """Python modules defining the user-registered ``targets`` (to import on executors)."""
        mods = []
        for t in sorted(targets):
            obj = self._modules.get(t) or self._functions.get(t)
            if obj is not None and obj.__module__ not in ("__main__", "builtins"):
                mods.append(obj.__module__)
        return sorted(set(mods))

    # -- lookup -----------------------------------------------------------------
    def resolve(self, target: str) -> tuple[str, Any] | None:
        """``(call, object)`` for a target, or None when it is unknown."""
        if target in self._modules:
            return "module", self._modules[target]
        if target in self._functions:
            return "function", self._functions[target]
        if not target.startswith(_FUNCTION_ROOTS + ("aten.", "onnx.")):
            return None
        try:
            return _resolve_builtin(target)
        except ImportError:  # torch missing in this process: cannot say
            return None

    def lookup(self, target: str) -> OpSpec | None:
        found = self.resolve(target)
        if found is None:
            return None
        call, obj = found
        lo, hi = _arity(obj, call)
        return OpSpec(target, call, lo, hi)

    def is_known(self, target: str) -> bool:
        return self.resolve(target) is not None


def _resolve_builtin(target: str) -> tuple[str, Any] | None:
    head, _, rest = target.partition(".")
    if head == "builtins":
        fn = _SAFE_BUILTINS.get(rest)
        return ("function", fn) if fn else None
    if head in ("operator", "math"):
        fn = getattr(operator if head == "operator" else math, rest, None)
        return ("function", fn) if callable(fn) and "." not in rest else None
    if head == "onnx":
        from ..executors.onnx_torch_ops import ONNX_OPS  # needs torch, like every torch name

        fn = ONNX_OPS.get(rest)
        return ("function", fn) if fn else None
    import torch

    if head == "aten":
        parts = rest.split(".")
        obj: Any = torch.ops.aten
        try:
            for p in parts:
                obj = getattr(obj, p)
        except (AttributeError, RuntimeError):
            return None
        return "function", obj
    # torch.*
    if target.startswith("torch.Tensor."):
        name = target[len("torch.Tensor."):]
        return ("method", name) if hasattr(torch.Tensor, name) else None
    obj = torch
    for p in rest.split("."):
        if p.startswith("_") and p not in ("_C",):
            return None
        obj = getattr(obj, p, None)
        if obj is None:
            return None
    if inspect.isclass(obj) and issubclass(obj, torch.nn.Module):
        return "module", obj
    if callable(obj) and not inspect.isclass(obj):
        return "function", obj
    return None


def _arity(obj: Any, call: str) -> tuple[int | None, int | None]:
    if call == "method":
        return 1, None
    fn = obj.forward if call == "module" else obj
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return None, None
    params = list(sig.parameters.values())
    if call == "module":
        params = params[1:]  # self
    lo = hi = 0
    for p in params:
        if p.kind == p.VAR_POSITIONAL:
            hi = None
        elif p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            if hi is not None:
                hi += 1
            if p.default is p.empty:
                lo += 1
    return lo, hi


#: The process-wide registry users register into.
REGISTRY = OpRegistry()
register_module = REGISTRY.register_module
register_function = REGISTRY.register_function


def import_plugins(modules: list[str], base: str | None = None) -> None:
    """Import the user modules that register custom ops (listed in a graph or plan).

    An entry is a module name (``mypkg.ops``) or the path of a ``.py`` file the
    user wrote (relative paths resolve against ``base``, e.g. the plan folder).
    """
    import importlib.util
    import os
    import sys

    from .errors import FusionError

    for m in modules:
        if not m.endswith(".py"):
            importlib.import_module(m)
            continue
        path = m if os.path.isabs(m) or base is None else os.path.join(base, m)
        name = "fusion_user_" + os.path.splitext(os.path.basename(path))[0]
        if name in sys.modules:
            continue
        spec = importlib.util.spec_from_file_location(name, path)
        if spec is None or not os.path.isfile(path):
            raise FusionError(f"plugin {m!r}: no such file {path}")
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
