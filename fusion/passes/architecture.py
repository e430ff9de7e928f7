"""``--compress auto --allow-architecture-change``: the compiler chooses whether to change the model, by predicted
step time (issue 35).

With the user's consent (and neither ``--subspace`` nor ``--bottleneck`` given) the compiler compiles a few
candidate architectures of the same model for the same cluster, each a full plan priced by the estimator (Eq. 3,
its own cut: a subspace-confined stream is cut where k / d of its bytes make a cut cheap):

* ``dense``: the model as it is, with ``--compress auto``'s codecs (what ``--compress auto`` alone gives);
* ``subspace k=K`` for K = d / 16 and d / 6 (:data:`SUBSPACE_DIVISORS`; Pluralis' Subspace Networks, Ramasinghe
  et al. 2025, arXiv 2506.01260: the stream confined to a fixed rank-K basis, the cut lossless,
  :mod:`fusion.compress.subspace`);
* ``bottleneck auto``: ResBM's residual bottleneck at the cut at its auto rank (:mod:`fusion.compress.bottleneck`;
  lossy: the learned code of an unconstrained stream).

It keeps the candidate with the shortest predicted iteration; the model changes only where a changed one is
strictly shorter than ``dense`` (a tie keeps the model). A candidate that cannot be built for this model or cut
(no residual stream, a cut off the stream, ...) is listed with the reason and left out. Every candidate's
predicted iteration and the reason for the choice go to ``plan.predicted["architecture"]``, which
``fusion inspect`` prints (:func:`inspect_lines`).

Predicted time only: the capacity a change costs (a subspace's fewer trainable writer weights, a bottleneck's lossy
code) is not priced; ``docs/compression.md`` ("Subspace: measured", "Bottlenecks: measured") has what each costs
in loss on the studies' models.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Callable

from fusion.ir.errors import FusionError
from fusion.passes.state import SUBSPACE_DIVISORS, ArchitectureRequest, CompileError, CompileRequest

__all__ = ["ArchitectureRequest", "SUBSPACE_DIVISORS", "candidates", "choose", "inspect_lines"]

if TYPE_CHECKING:
    from fusion.cluster.model import Cluster
    from fusion.ir.model import Model
    from fusion.plan import Plan

log = logging.getLogger("fusion.compile")

#: the plan's ``predicted`` key of the choice
PREDICTED_KEY = "architecture"


@dataclass(frozen=True)
class Candidate:
    """One architecture priced: ``name`` (``dense``, ``subspace k=K``, ``bottleneck auto``) and the request it is
    compiled with (``request`` with ``architecture`` cleared and the change set)."""

    name: str
    request: CompileRequest


def residual_width(model: "Model") -> int | None:
    """d of the model's residual stream (:func:`fusion.compress.subspace.find_stream`), None without one."""
    from fusion.compress.subspace import SubspaceError, find_stream

    try:
        return find_stream(model.graph)[0]
    except SubspaceError:
        return None


def candidates(request: CompileRequest, width: int | None) -> list[Candidate]:
    """The architectures to price: dense first, then each subspace rank below ``width`` (none without a stream),
    then the bottleneck at its auto rank."""
    from fusion.compress.bottleneck import BottleneckRequest
    from fusion.compress.subspace import SubspaceRequest

    arch = request.architecture
    base = replace(request, architecture=None)
    out = [Candidate("dense", base)]
    ks = sorted({max(1, width // n) for n in arch.subspace_divisors} if width else set())
    out += [Candidate(f"subspace k={k}", replace(base, subspace=SubspaceRequest(k))) for k in ks if k < width]
    out.append(Candidate("bottleneck auto", replace(base, bottleneck=BottleneckRequest("auto", arch.bottleneck_edges))))
    return out


def choose(model: "Model", cluster: "Cluster", request: CompileRequest,
           compile_one: Callable[["Model", "Cluster", CompileRequest], "Plan"]) -> "Plan":
    """The plan of the candidate (:func:`candidates`) with the shortest predicted iteration, ``dense`` unless a
    change is strictly shorter; ``plan.predicted["architecture"]`` lists every candidate. ``compile_one`` compiles
    one request (the compiler's passes). CompileError from ``dense`` is raised as it is (nothing fits); another
    candidate's error only leaves it out."""
    from fusion.passes.steps import ensure_shapes

    if request.precision != "fp32":
        raise CompileError("--compress auto --allow-architecture-change: the subspace and bottleneck candidates are "
                           f"fp32 only (--precision {request.precision}); leave out --allow-architecture-change")
    ensure_shapes(model)
    rows: list[dict[str, Any]] = []
    plans: dict[str, "Plan"] = {}
    for c in candidates(request, residual_width(model)):
        try:
            plan = compile_one(model, cluster, c.request)
        except FusionError as e:
            if c.name == "dense":
                raise
            rows.append({"name": c.name, "iteration_s": None, "note": f"not built: {e}"})
            log.info("architecture %s: not built (%s)", c.name, e)
            continue
        plans[c.name] = plan
        rows.append({"name": c.name, "iteration_s": float(plan.predicted["iteration_s"]), "note": _note(plan)})
    dense_s = plans["dense"].predicted["iteration_s"]
    best = min(plans, key=lambda n: (plans[n].predicted["iteration_s"], n != "dense"))
    best_s = plans[best].predicted["iteration_s"]
    reason = ("no change predicts a shorter iteration than the model as it is" if best == "dense" else
              f"shortest predicted iteration: {best_s:.4g} s against {dense_s:.4g} s dense "
              f"({dense_s / best_s:.3g}x)")
    plan = plans[best]
    plan.predicted[PREDICTED_KEY] = {"candidates": rows, "chosen": best, "reason": reason}
    log.info("architecture auto: %s (%s)", best, reason)
    return plan


def _note(plan: "Plan") -> str:
    """What a candidate plan changed, in a few words (its cut edges' bytes are in its estimate)."""
    if plan.subspace is not None:
        cuts, d, k = plan.subspace.get("cuts", []), plan.subspace["width"], plan.subspace["rank"]
        if not cuts:
            return f"stream {d} -> {k}; no cut on it ({len(plan.parts)} part{'s' if len(plan.parts) > 1 else ''})"
        return f"stream {d} -> {k} coordinates + ids on {len(cuts)} cut edge{'s' if len(cuts) != 1 else ''}"
    if plan.bottlenecks:
        return ", ".join(f"{b.edge} {b.width}->{b.rank}" for b in plan.bottlenecks)
    return f"{len(plan.compression)} compressed edge{'s' if len(plan.compression) != 1 else ''}"


def inspect_lines(plan: "Plan") -> list[str]:
    """``fusion inspect``'s section: every candidate with its predicted iteration, the one kept and why."""
    info = plan.predicted.get(PREDICTED_KEY)
    if not isinstance(info, dict):
        return []
    lines = ["", f"architecture chosen by the compiler (--compress auto --allow-architecture-change): "
                 f"{info.get('chosen')} ({info.get('reason')}):"]
    lines.append(f"  {'candidate':<18} {'predicted s/iter':>16}  what")
    for row in info.get("candidates", []):
        t = row.get("iteration_s")
        mark = "*" if row.get("name") == info.get("chosen") else " "
        lines.append(f"{mark} {str(row.get('name'))[:18]:<18} {'-' if t is None else f'{t:.4g}':>16}  {row.get('note')}")
    return lines
