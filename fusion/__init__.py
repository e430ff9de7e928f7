"""fusion: train one model on many heterogeneous GPUs over slow links (FusionLLM).

Sub-packages: ``fusion.ir`` (OP-DAG, OP-Data, front ends), ``fusion.executors``
(engines, reference and distributed executors), ``fusion.kernels`` (Top-K codec).
Imports are lazy so that ``import fusion`` stays cheap.
"""
from __future__ import annotations

from pathlib import Path as _Path

_here = _Path(__file__).resolve().parent
if not (_here / "ir").is_dir() and (_here.parent / "ir" / "__init__.py").is_file():
    # A source checkout: the design card keeps ir/, executors/ and kernels/ beside fusion/, and an
    # installed wheel puts them inside it (pyproject's package-dir). Make the checkout importable as the
    # same package, so `python -m fusion.cli` from the checkout root works with any kind of install.
    __path__.append(str(_here.parent))  # noqa: F821 - the package's own __path__
del _Path, _here

__version__ = "0.1.0"

from fusion.ir.errors import FusionError  # noqa: E402  (cheap, no torch)
from fusion.ir.registry import register_function, register_module  # noqa: E402

__all__ = ["FusionError", "register_module", "register_function", "trace", "__version__"]


def __getattr__(name: str):
    """Lazy public API: ``fusion.trace`` (and later entry points) import torch only when used."""
    if name == "trace":
        from fusion.ir.trace import trace

        return trace
    raise AttributeError(f"module 'fusion' has no attribute {name!r}")
