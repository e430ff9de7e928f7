"""The op registry: which target names exist and how they are called.

A plan is data: its node targets come from an allow-list, so a plan file
cannot make an executor reach ``exec``, ``eval``, ``open`` or an import. A
target name is resolved in this order:

1. names registered by the user with :func:`register_module` /
   :func:`register_function` (FusionLLM Figure 7's ``TORCH_MODULES.register``);
2. ``torch.nn.<Module>`` module types (one level, subclasses of ``nn.Module``);
3. ``torch.Tensor.<method>``: public tensor methods except those that take
   callables or touch storage (:data:`TENSOR_METHOD_DENY`), and the operator
   dunders (:data:`TENSOR_DUNDERS`);
4. ``aten.<op>[.<overload>]`` ATen operators (``torch.ops.aten``, not
   ``from_file``); ``onnx.<OpType>`` ONNX operators (the torch engine's
   implementations in ``fusion.ir.onnx.semantics``);
5. ``torch.nn.functional.<fn>``; ``torch.special.*``, ``torch.linalg.*``,
   ``torch.fft.*`` functions; ``torch.<fn>`` when ``fn`` is a native tensor
   function (``torch._C._VariableFunctions``, not ``from_file``) or one of
   :data:`TORCH_PY_MATH`; ``operator.*`` (not ``call``, ``attrgetter``,
   ``itemgetter``, ``methodcaller``); ``math.*``; and the builtins of
   :data:`_SAFE_BUILTINS`. ``builtins.getattr`` is allowed only with a literal
   attribute name from :data:`SAFE_ATTRS` (checked by :func:`check_targets`).

Nothing else resolves, and nothing is walked: ``torch.hub.load``,
``torch.load``, ``torch._C.*`` are not op names. User registrations live in
plugin files inside the plan folder, which executors import only when told
to trust them (:func:`import_plugins`). Resolution needs torch only for torch
names; a process without torch checks names syntactically
(:func:`target_problem`).
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
_BUILTIN_ROOTS = _FUNCTION_ROOTS + ("aten.", "onnx.")
#: the attributes ``builtins.getattr`` may read (tensor metadata; no callables, no dunders)
SAFE_ATTRS = frozenset({"shape", "dtype", "device", "ndim", "T", "mT", "H", "mH", "real", "imag", "is_cuda",
                        "requires_grad", "layout", "is_leaf"})
#: operator functions that build or call callables
OPERATOR_DENY = frozenset({"call", "attrgetter", "itemgetter", "methodcaller"})
#: tensor methods that take callables, expose storage or memory, or run autograd from inside an op
TENSOR_METHOD_DENY = frozenset({"apply_", "map_", "map2_", "register_hook", "register_post_accumulate_grad_hook",
                                "storage", "untyped_storage", "share_memory_", "set_", "backward", "data_ptr",
                                "record_stream", "module_load", "as_subclass", "pin_memory", "storage_offset"})
#: operator dunders of torch.Tensor a traced graph may call as methods
TENSOR_DUNDERS = frozenset(f"__{n}__" for n in (
    "getitem setitem len neg pos abs invert add radd iadd sub rsub isub mul rmul imul truediv rtruediv itruediv "
    "floordiv rfloordiv ifloordiv mod rmod matmul rmatmul pow rpow ipow and rand iand or ror ior xor rxor ixor "
    "lshift rlshift rshift rrshift eq ne lt le gt ge").split())
#: Python-level tensor math under ``torch.`` (the native ones are found in torch._C._VariableFunctions)
TORCH_PY_MATH = frozenset({
    "einsum", "split", "stft", "istft", "meshgrid", "broadcast_tensors", "broadcast_shapes", "tensordot", "norm",
    "cdist", "unique", "unique_consecutive", "atleast_1d", "atleast_2d", "atleast_3d", "block_diag", "cartesian_prod",
    "chain_matmul", "lu", "unravel_index", "chunk", "flatten",
})
#: functions under torch.nn.functional that dispatch to callables rather than compute
FUNCTIONAL_DENY = frozenset({"handle_torch_function", "boolean_dispatch", "has_torch_function",
                             "has_torch_function_unary", "has_torch_function_variadic"})
#: native functions that read files
NATIVE_DENY = frozenset({"from_file"})
_TORCH_SUBSPACES = ("torch.special.", "torch.linalg.", "torch.fft.", "torch.nn.functional.")


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
        if not target.startswith(_BUILTIN_ROOTS) or target_problem(target) is not None:
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


def _ident(name: str) -> bool:
    return name.isidentifier() and not name.startswith("_")


def target_problem(target: str) -> str | None:
    """Why a built-in-rooted target name is not allowed (None: allowed by name; torch names are also checked
    on the object when torch is present). Names outside the built-in roots are user names: allowed when registered."""
    if not isinstance(target, str) or not target.startswith(_BUILTIN_ROOTS):
        return None
    head, _, rest = target.partition(".")
    parts = rest.split(".")
    if head == "builtins":
        return None if rest in _SAFE_BUILTINS else f"builtins allowed: {sorted(_SAFE_BUILTINS)}"
    if head in ("operator", "math"):
        if len(parts) != 1 or not _ident(rest) or rest in OPERATOR_DENY:
            return f"{head}.{rest} is not an arithmetic function" + (f" (denied: {sorted(OPERATOR_DENY)})" if head == "operator" else "")
        return None
    if head == "onnx":
        return None if len(parts) == 1 and rest.isidentifier() else "onnx ops are onnx.<OpType>"
    if head == "aten":
        # operator dunders (aten.__and__.Tensor, from ``mask & mask``) are ops like any other
        ok = [p.isidentifier() and (not p.startswith("__") or (i == 0 and p in TENSOR_DUNDERS)) for i, p in enumerate(parts)]
        if not 1 <= len(parts) <= 2 or not all(ok) or parts[0] in NATIVE_DENY:
            return "aten ops are aten.<op>[.<overload>]"
        return None
    # torch.*
    if target.startswith("torch.Tensor."):
        m = target[len("torch.Tensor."):]
        if m in TENSOR_DUNDERS or (_ident(m) and m not in TENSOR_METHOD_DENY):
            return None
        return "not an allowed tensor method"
    for space in _TORCH_SUBSPACES:
        if target.startswith(space):
            fn = target[len(space):]
            if _ident(fn) and fn not in FUNCTIONAL_DENY:
                return None
            return f"not a public function of {space[:-1]}"
    if target.startswith("torch.nn."):
        cls = target[len("torch.nn."):]
        return None if _ident(cls) else "torch.nn.<Module> names one module class"
    if len(parts) == 1 and _ident(rest) and rest not in NATIVE_DENY:
        return None
    return "torch names are torch.<tensor function>, torch.nn.<Module>, torch.nn.functional.<fn>, torch.Tensor.<method>"


def _resolve_builtin(target: str) -> tuple[str, Any] | None:
    """The object of an allowed built-in target (the name passed :func:`target_problem`)."""
    head, _, rest = target.partition(".")
    if head == "builtins":
        fn = _SAFE_BUILTINS.get(rest)
        return ("function", fn) if fn else None
    if head in ("operator", "math"):
        fn = getattr(operator if head == "operator" else math, rest, None)
        return ("function", fn) if callable(fn) and not inspect.isclass(fn) else None
    if head == "onnx":
        from fusion.ir.onnx.semantics import ONNX_OPS  # needs torch, like every torch name

        fn = ONNX_OPS.get(rest)
        return ("function", fn) if fn else None
    import torch

    if head == "aten":
        obj: Any = torch.ops.aten
        try:
            for p in rest.split("."):
                obj = getattr(obj, p)
        except (AttributeError, RuntimeError):
            return None
        ok = isinstance(obj, (torch._ops.OpOverload, torch._ops.OpOverloadPacket))
        return ("function", obj) if ok else None
    if target.startswith("torch.Tensor."):
        name = target[len("torch.Tensor."):]
        return ("method", name) if callable(getattr(torch.Tensor, name, None)) else None
    for space in _TORCH_SUBSPACES:
        if target.startswith(space):
            ns = {"torch.special.": torch.special, "torch.linalg.": torch.linalg, "torch.fft.": torch.fft,
                  "torch.nn.functional.": torch.nn.functional}[space]
            obj = getattr(ns, target[len(space):], None)
            ok = (inspect.isfunction(obj) or inspect.isbuiltin(obj)) and (getattr(obj, "__module__", None) or "torch").startswith("torch")
            return ("function", obj) if ok else None
    if target.startswith("torch.nn."):
        obj = getattr(torch.nn, target[len("torch.nn."):], None)
        return ("module", obj) if inspect.isclass(obj) and issubclass(obj, torch.nn.Module) else None
    name = rest
    obj = getattr(torch, name, None)
    if obj is None or inspect.isclass(obj) or not callable(obj):
        return None
    native = getattr(torch._C._VariableFunctions, name, None) is obj or name in dir(torch._C._VariableFunctions)
    return ("function", obj) if native or name in TORCH_PY_MATH else None


def check_targets(graph: Any, registry: "OpRegistry | None" = None) -> None:
    """Refuse a graph whose nodes name ops outside the allow-list (a plan is data, not code).

    Raises GraphError naming the node and its target. ``builtins.getattr``
    nodes must read a literal attribute of :data:`SAFE_ATTRS`. Names outside
    the built-in roots are user names; they resolve only once a plugin has
    registered them.
    """
    from fusion.ir.errors import GraphError

    registry = registry or REGISTRY
    for node in graph.nodes.values():
        t = node.target
        if not t:
            continue
        if not isinstance(t, str):
            raise GraphError(f"target {t!r} is not a name", node.name)
        if t in registry._modules or t in registry._functions:
            continue
        why = target_problem(t)
        if why is not None:
            raise GraphError(f"target {t!r} is not an allowed op ({why})", node.name)
        if t == "builtins.getattr":
            a = node.args
            if len(a) != 2 or node.kwargs or not isinstance(a[1], str) or a[1] not in SAFE_ATTRS:
                raise GraphError(f"builtins.getattr may only read a literal attribute of {sorted(SAFE_ATTRS)}", node.name)


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


TRUST_HINT = ("plugins are Python files that run with this process's rights; pass --trust-plugins to import them "
              "(only for plans you trust)")


def import_plugins(modules: list[str], base: str | None = None, trusted: bool = False) -> None:
    """Import the user op files a graph or plan lists as plugins.

    An entry is the path of a ``.py`` file relative to ``base`` (the plan
    folder), and must stay inside it; absolute paths, ``..`` escapes and
    module names are refused. Entries naming a module this process has
    already imported (the user's own process, which defined the ops) run
    nothing and are skipped. Anything else is imported only when
    ``trusted`` (``--trust-plugins``): a plugin is code.
    """
    import importlib.util
    import os
    import sys
    from pathlib import Path

    from fusion.ir.errors import FusionError

    todo = []
    for m in modules:
        if not isinstance(m, str) or not m:
            raise FusionError(f"plugin entry {m!r} is not a file name")
        if not m.endswith(".py"):
            if m in sys.modules:
                continue  # already imported here: nothing runs
            raise FusionError(f"plugin {m!r}: plugins are .py files inside the plan folder, not module names")
        name = "fusion_user_" + os.path.splitext(os.path.basename(m))[0]
        if name in sys.modules:
            continue
        if base is None:
            raise FusionError(f"plugin {m!r}: plugin files resolve against the plan folder, and none was given")
        root = Path(base).resolve()
        path = (root / m).resolve()
        if os.path.isabs(m) or not path.is_relative_to(root):
            raise FusionError(f"plugin {m!r}: plugin files must lie inside the plan folder {root}")
        if not path.is_file():
            raise FusionError(f"plugin {m!r}: no such file {path}")
        todo.append((m, name, path))
    if todo and not trusted:
        raise FusionError(f"the plan lists plugins {[m for m, _, _ in todo]}: {TRUST_HINT}")
    for m, name, path in todo:
        spec = importlib.util.spec_from_file_location(name, path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        try:
            spec.loader.exec_module(mod)
        except Exception:
            del sys.modules[name]
            raise
