"""Option values checked before a model is traced (issue 26): a wrong number is one line at once, not after a
trace and compile of many seconds. Each check names the option and says what it must be."""
from __future__ import annotations

import argparse
import math

from fusion.ir.errors import FusionError


def _finite(v) -> bool:
    return isinstance(v, (int, float)) and math.isfinite(v)


def check_compile_options(args: argparse.Namespace) -> None:
    """The compile options of ``fusion compile`` / ``fusion run MODEL`` whose values cannot be right, refused.
    (The DiLoCo options are checked as early by ``DPSync``'s own rules, through compile's option parsing.)"""
    rules = [
        ("lr", lambda v: _finite(v) and v > 0, "must be a positive number"),
        ("momentum", lambda v: _finite(v) and 0 <= v < 1, "must be in [0, 1)"),
        ("weight_decay", lambda v: _finite(v) and v >= 0, "must be 0 or more"),
        ("compress_ratio", lambda v: v is None or (_finite(v) and v >= 1),
         "must be at least 1 (AdaTopK keeps 1/R of the values, Eq. 7)"),
    ]
    for dest, ok, rule in rules:
        if hasattr(args, dest) and not ok(getattr(args, dest)):
            raise FusionError(f"--{dest.replace('_', '-')} {getattr(args, dest)}: {rule}")
    # --precision bf16 with --compress/--compress-bwd/--compress-ratio: each codec encodes a cut tensor in the
    # dtype autocast gave it (bfloat16 or float32) and the receiver decodes to that dtype (docs/training.md)
    specs = getattr(args, "engine", None) or []
    if specs:
        from fusion.executors.engines.select import engine_names

        for spec in specs:
            engine = spec.rpartition("=")[2]
            if engine not in engine_names():
                raise FusionError(f"--engine {spec}: unknown engine {engine!r} (known: {', '.join(engine_names())})")
            if engine != "torch" and getattr(args, "precision", "fp32") == "bf16":
                raise FusionError(f"--precision bf16 with --engine {spec}: mixed precision is torch autocast; "
                                  f"the {engine} engine runs fp32 only")


def check_data_options(args: argparse.Namespace) -> None:
    """``--data`` and ``--val-split`` of ``fusion run`` / ``fusion coordinator``, checked before anything is traced,
    compiled or started: a text file or a data function's file that does not exist, and a ``--val-split`` that
    would be silently ignored (only ``--data text:PATH`` holds part of its text out)."""
    data = getattr(args, "data", "auto") or "auto"
    val = getattr(args, "val_split", 0.0) or 0.0
    if data.startswith("text:"):
        from fusion.data.text import TextSpec

        path = TextSpec.parse(data).path
        if not path.exists():
            raise FusionError(f"--data {data}: no such file or folder {str(path)!r}")
    elif data not in ("auto", "text", "synthetic") and ":" in data:
        from pathlib import Path

        file = data.rpartition(":")[0]
        if file.endswith(".py") and not Path(file).is_file():
            raise FusionError(f"--data {data}: no such file {file!r}")
    if val > 0 and not data.startswith("text:"):
        raise FusionError(f"--val-split {val:g} holds out part of --data text:PATH, but --data is {data}: nothing "
                          "would be held out (--eval-every takes its held-out batches from the data source: "
                          "docs/training.md)")
