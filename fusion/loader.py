"""Load a model from ``file.py:function``.

The function returns a :class:`~fusion.ir.model.Model`, an
:class:`~fusion.ir.graph.OpGraph`, or ``(torch.nn.Module, example_inputs)``
(traced with :func:`fusion.ir.trace.trace`). The file is the user's own code.

``model.onnx`` imports an ONNX file (:func:`fusion.ir.onnx_import.load_onnx`);
``model.onnx:cross_entropy`` (or ``:mse``) appends that loss to its output.
"""
from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path
from typing import Any, Callable

from .ir.errors import FusionError
from .ir.graph import OpGraph
from .ir.model import Model


_ONNX_SPEC = re.compile(r"^(?P<path>.+\.onnx)(?::(?P<loss>\w+))?$")


def load_model(spec: str) -> Model:
    m = _ONNX_SPEC.match(spec)
    if m:
        from .ir.onnx_import import load_onnx

        return load_onnx(m["path"], loss=m["loss"])
    model = _load_python(spec)
    # user op types registered by the model file: executors import it by path
    name = f"fusion_user_{Path(spec.rpartition(':')[0]).stem}"
    model.graph.plugins = [str(Path(spec.rpartition(":")[0]).resolve()) if p == name else p for p in model.graph.plugins]
    return model


def load_function(spec: str, what: str = "model") -> Callable[..., Any]:
    """The function named by ``file.py:function`` (the user's own file, imported by path)."""
    path, sep, func = spec.rpartition(":")
    if not sep or not path or not func:
        raise FusionError(f"{what} {spec!r}: expected file.py:function")
    file = Path(path)
    if not file.is_file():
        raise FusionError(f"{what} {spec!r}: no such file {file}")
    name = f"fusion_user_{file.stem}"
    modspec = importlib.util.spec_from_file_location(name, file)
    mod = importlib.util.module_from_spec(modspec)
    sys.modules[name] = mod
    sys.path.insert(0, str(file.parent.resolve()))
    try:
        modspec.loader.exec_module(mod)
    except Exception as e:
        raise FusionError(f"{what} {spec!r}: importing {file} failed: {type(e).__name__}: {e}") from None
    fn = getattr(mod, func, None)
    if not callable(fn):
        raise FusionError(f"{what} {spec!r}: {file} has no function {func!r}")
    return fn


def _load_python(spec: str) -> Model:
    path, _, func = spec.rpartition(":")
    fn = load_function(spec)
    obj = fn()
    if isinstance(obj, Model):
        return obj
    if isinstance(obj, OpGraph):
        return Model(obj)
    if isinstance(obj, tuple) and len(obj) == 2:
        from .ir.trace import trace

        module, example = obj
        return trace(module, example)
    raise FusionError(f"model {spec!r}: {func}() returned {type(obj).__name__}; expected Model, OpGraph or (module, example_inputs)")
