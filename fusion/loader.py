"""Load a model from ``file.py:function``.

The function returns a :class:`~fusion.ir.model.Model`, an
:class:`~fusion.ir.graph.OpGraph`, ``(torch.nn.Module, example_inputs)`` or
``(torch.nn.Module, example_inputs, options)`` (traced with
:func:`fusion.ir.trace.trace`; ``options`` are its keyword arguments, e.g.
``{"labels": ("labels",), "loss_index": "loss"}``). The file is the user's own code.

``model.onnx`` imports an ONNX file (:func:`fusion.ir.onnx.importer.load_onnx`);
``model.onnx:cross_entropy`` (or ``:mse``) appends that loss to its output.
"""
from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path
from typing import Any, Callable

from fusion.ir.errors import FusionError
from fusion.ir.graph import OpGraph
from fusion.ir.model import Model


_ONNX_SPEC = re.compile(r"^(?P<path>.+\.onnx)(?::(?P<loss>\w+))?$")


def load_model(spec: str) -> Model:
    m = _ONNX_SPEC.match(spec)
    if m:
        from fusion.ir.onnx.importer import load_onnx

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
        raise FusionError(f"{what} {spec!r}: importing {file} failed: {user_error(e, file)}") from e
    fn = getattr(mod, func, None)
    if not callable(fn):
        raise FusionError(f"{what} {spec!r}: {file} has no function {func!r}")
    return fn


def user_error(e: BaseException, file: str | Path) -> str:
    """``ValueError: message (model.py:12)``: an exception raised by the user's code, with the deepest line of
    ``file`` it passed through (or of the last frame), for a one-line error instead of a traceback."""
    import traceback

    frames = traceback.extract_tb(e.__traceback__)
    if isinstance(e, SyntaxError) and e.filename:
        where = f"{Path(e.filename).name}:{e.lineno}"
    else:
        target = str(Path(file).resolve())
        mine = [f for f in frames if str(Path(f.filename).resolve()) == target] or frames[-1:]
        where = f"{Path(mine[-1].filename).name}:{mine[-1].lineno}" if mine else ""
    msg = " ".join(str(e).split()) or "(no message)"
    return f"{type(e).__name__}: {msg}" + (f" ({where})" if where else "")


def _eager_failure(module, example) -> BaseException | None:
    """What running ``module`` on ``example`` in plain PyTorch raises (None if it runs): after a failed trace,
    an exception here is the user's own bug, with their file and line in its traceback."""
    import torch

    try:
        with torch.no_grad():
            module(**example)
    except Exception as e:  # noqa: BLE001 - reported to the user with their line
        return e
    return None


def _load_python(spec: str) -> Model:
    path, _, func = spec.rpartition(":")
    fn = load_function(spec)
    try:
        obj = fn()
    except FusionError:
        raise
    except Exception as e:
        raise FusionError(f"model {spec!r}: {func}() raised {user_error(e, path)}") from e
    if isinstance(obj, Model):
        return obj
    if isinstance(obj, OpGraph):
        return Model(obj)
    if isinstance(obj, tuple) and len(obj) in (2, 3):
        import inspect

        from fusion.ir.trace import trace

        module, example, options = (*obj, {}) if len(obj) == 2 else obj
        if not isinstance(options, dict):
            raise FusionError(f"model {spec!r}: the third value {func}() returns must be a dict of trace options, "
                              f"got {type(options).__name__}")
        known = [n for n, p in inspect.signature(trace).parameters.items() if p.kind == p.KEYWORD_ONLY]
        unknown = sorted(set(options) - set(known))
        if unknown:
            raise FusionError(f"model {spec!r}: unknown trace option(s) {unknown}; known: {known}")
        from fusion.hf import is_pretrained, trace_options

        if is_pretrained(module):  # a transformers model as it comes: its cache off, its own .loss trained
            options = trace_options(module, example, options, spec)
        try:
            return trace(module, example, **options)
        except Exception as e:
            eager = _eager_failure(module, example)
            if eager is not None:  # the user's forward itself fails: name their line, not the tracer's
                raise FusionError(f"model {spec!r}: the module {func}() returned fails on its example: "
                                  f"{user_error(eager, path)}") from eager
            if isinstance(e, FusionError):
                raise
            raise FusionError(f"model {spec!r}: tracing the module {func}() returned failed: {user_error(e, path)}") from e
    raise FusionError(f"model {spec!r}: {func}() returned {type(obj).__name__}; expected Model, OpGraph, "
                      "(module, example_inputs) or (module, example_inputs, trace options)")
