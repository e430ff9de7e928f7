"""fusion: train one model on many heterogeneous GPUs over slow links (FusionLLM).

Sub-packages: ``fusion.ir`` (OP-DAG, OP-Data, front ends), ``fusion.executors``
(engines, reference and distributed executors), ``fusion.kernels`` (Top-K codec).
Imports are lazy so that ``import fusion`` stays cheap.
"""
from __future__ import annotations

__version__ = "0.1.0"

from .ir.errors import FusionError  # noqa: E402  (cheap, no torch)
from .ir.registry import register_function, register_module  # noqa: E402

__all__ = ["FusionError", "register_module", "register_function", "trace", "__version__"]


def __getattr__(name: str):
    """Lazy public API: ``fusion.trace`` (and later entry points) import torch only when used."""
    if name == "trace":
        from .ir.trace import trace

        return trace
    raise AttributeError(f"module 'fusion' has no attribute {name!r}")
