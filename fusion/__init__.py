"""fusion: train one model on many heterogeneous GPUs over slow links (FusionLLM).

Sub-packages: ``fusion.ir`` (OP-DAG, OP-Data, front ends), ``fusion.executors``
(engines, reference and distributed executors), ``fusion.kernels`` (Top-K codec).
Imports are lazy so that ``import fusion`` stays cheap.
"""
from __future__ import annotations

__version__ = "0.1.0"

from .ir.errors import FusionError  # noqa: E402  (cheap, no torch)
from .ir.registry import register_function, register_module  # noqa: E402

__all__ = ["FusionError", "register_module", "register_function", "__version__"]
