"""A plan's digest: one SHA-256 over everything of a plan that decides what runs (graph, weights, plugins).

Every host of a run holds its own copy of the plan folder. The executors and
the coordinator compare digests at hello (the executor sends its own in
``hello``, the coordinator its own in ``setup``), so a host with a stale or
altered copy — another graph, other initial weights, other plugin code — is
refused before a step runs, with one line naming both digests.
"""
from __future__ import annotations

import hashlib
from pathlib import Path

from fusion.ir.errors import FusionError


def plan_digest(plan_dir: str | Path) -> str:
    """SHA-256 (hex) over ``plan.json``, ``weights.safetensors`` (when present) and the plan's plugin files.

    Each file enters as its name, its length and its bytes, in a fixed order, so two folders have the same
    digest exactly when those files are byte for byte the same.
    """
    plan_dir = Path(plan_dir)
    if plan_dir.name == "plan.json":
        plan_dir = plan_dir.parent
    files = [plan_dir / "plan.json", plan_dir / "weights.safetensors"]
    plugins = plan_dir / "plugins"
    if plugins.is_dir():
        files += sorted(f for f in plugins.rglob("*") if f.is_file() and "__pycache__" not in f.parts)
    h = hashlib.sha256()
    for f in files:
        if not f.exists():
            continue
        h.update(f.relative_to(plan_dir).as_posix().encode() + b"\0")
        try:
            with open(f, "rb") as fh:
                h.update(str(f.stat().st_size).encode() + b"\0")
                for chunk in iter(lambda: fh.read(1 << 20), b""):
                    h.update(chunk)
        except OSError as e:
            raise FusionError(f"{f}: cannot read it to compute the plan's digest ({e.strerror})") from None
    return h.hexdigest()


def digest_mismatch(mine: str, theirs: str, who: str, whose_mine: str) -> str | None:
    """The one-line refusal when two plan digests differ (None when they agree or either is unknown)."""
    if not mine or not theirs or mine == theirs:
        return None
    return (f"{who} runs another plan: its digest is {theirs[:16]}, {whose_mine} is {mine[:16]}; copy the same "
            f"plan folder to every host (`fusion inspect PLAN` prints a plan's digest)")
