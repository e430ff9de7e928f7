"""``--inner-steps auto``: each DiLoCo replica's inner steps per round in proportion to its speed (issue 34).

After Async Local-SGD (Liu et al. 2024, arXiv 2401.09135: a worker's local steps in proportion to its speed), so
that in a round the slower replicas take fewer inner steps instead of the faster ones waiting for them.

The rule (:func:`inner_steps_by_speed`): with ``t_r`` replica r's predicted time of one inner step and H the
fastest replica's inner steps (``--inner-steps auto`` takes DiLoCo's default 20, ``auto:H`` takes H),

    H_r = max(1, floor(H * t_fastest / t_r + 1/2))

so the fastest takes H and a replica half as fast H/2. The speed estimate (:func:`replica_step_times`) is the
compiler's price of each replica's pipeline on its own devices (``plan.predicted["replicas"][r]["iteration_s"]``,
:func:`fusion.replicas._price_replicas`: the estimator with each device's ``peak_flops`` x ``lambda`` and the
per-node and per-step overheads ``fusion profile`` fits), scaled by the replica's micro-batches per step over the
plan's when ``--replica-shares`` gives it another share.

"Without a speed estimate" (refused, one line): a replica the compiler did not price (no finite, positive
predicted step time: a plan priced without a cluster), or a cluster whose replicas' devices mix measured and
nominal speeds (some with a ``lambda`` from ``fusion profile``, some without), whose predicted times do not
compare. Equal predicted speeds are not an error: every replica gets H.

The runtime's semantics of per-replica H are in ``executors/runtime/dp/inner_steps.py``; :func:`round_prices`
predicts one round's time with equal H and with these H_r under that runtime (the figure ``fusion inspect`` shows).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Sequence

from fusion.ir.errors import FusionError


def parse_auto(text: str | None, default_h: int) -> int | None:
    """``--inner-steps auto`` (the fastest replica's H: ``default_h``) or ``auto:H``; None for anything else."""
    if text is None or not str(text).startswith("auto"):
        return None
    rest = str(text)[len("auto"):]
    if not rest:
        return default_h
    try:
        if not rest.startswith(":"):
            raise ValueError
        h = int(rest[1:])
    except ValueError:
        raise FusionError(f"--inner-steps {text}: expected auto or auto:H (H the fastest replica's inner steps)") from None
    if h < 1:
        raise FusionError(f"--inner-steps {text}: the fastest replica takes at least one inner step per round")
    return h


def inner_steps_by_speed(step_s: Sequence[float], h: int) -> dict[int, int]:
    """Replica -> H_r for per-step times ``step_s`` (seconds, all finite and > 0) and the fastest's ``h``."""
    fastest = min(step_s)
    return {r: max(1, min(h, int(math.floor(h * fastest / t + 0.5)))) for r, t in enumerate(step_s)}


def replica_step_times(plan, counts: Sequence[int], cluster=None) -> list[float]:
    """Each replica's predicted time of one inner step (seconds) when it runs ``counts[r]`` micro-batches per step;
    FusionError, one line, without a speed estimate (see the module's docstring)."""
    per = plan.predicted.get("replicas")
    if not isinstance(per, list) or len(per) != plan.replicas:
        raise FusionError("--inner-steps auto: the plan holds no predicted step time per replica (the compiler did "
                          "not price the replicas on a cluster), so no replica has a speed estimate; give "
                          "--inner-steps H")
    if cluster is not None:
        dev = {d.name: d for d in cluster.devices}
        measured = {r: [d for d in row["devices"] if d in dev and (dev[d].lam != 1.0 or _profiled(dev[d]))]
                    for r, row in enumerate(per)}
        if any(measured.values()) and not all(len(measured[r]) == len(per[r]["devices"]) for r in measured):
            r = next(r for r in measured if len(measured[r]) != len(per[r]["devices"]))
            nominal = [d for d in per[r]["devices"] if d not in measured[r]]
            raise FusionError(f"--inner-steps auto: replica {r}'s device(s) {', '.join(nominal)} have no measured speed "
                              f"(no lambda or overheads from fusion profile in {cluster.source}) while other replicas' "
                              "devices have: their predicted step times do not compare, so there is no speed estimate; "
                              "profile every replica's devices or none")
    out = []
    for r, row in enumerate(per):
        t = row.get("iteration_s") if isinstance(row, dict) else None
        if not isinstance(t, (int, float)) or not math.isfinite(t) or t <= 0:
            raise FusionError(f"--inner-steps auto: replica {r} has no speed estimate (predicted step time {t!r}); "
                              "give --inner-steps H")
        out.append(float(t) * counts[r] / plan.micro_batches)
    return out


def _profiled(device) -> bool:
    """Whether ``fusion profile`` fitted any of the device's overheads (its cluster entry carries them)."""
    return any(getattr(device, k, 0.0) for k in ("node_overhead_s", "message_overhead_s", "step_overhead_s"))


def round_prices(step_s: Sequence[float], per: dict[int, int], h: int, micro_batches: Sequence[int]) -> dict:
    """One round's predicted time under the lock-step runtime (each global step lasts as long as the slowest
    replica stepping in it; replica r steps in the round's last H_r steps), with equal H and with ``per``: the
    round's seconds, the fastest replica's wait in it, and the samples per second (in micro-batches)."""
    def price(hs: dict[int, int]) -> tuple[float, float]:
        total = sum(max(t for r, t in enumerate(step_s) if p >= h - hs[r]) for p in range(h))
        return total, sum(hs[r] * m for r, m in enumerate(micro_batches)) / total

    equal_s, equal_rate = price({r: h for r in range(len(step_s))})
    auto_s, auto_rate = price(per)
    fastest = min(step_s)
    return {"round_s_equal_h": equal_s, "round_s": auto_s, "fastest_wait_s_equal_h": equal_s - h * fastest,
            "fastest_wait_s": auto_s - h * fastest, "micro_batches_per_s_equal_h": equal_rate,
            "micro_batches_per_s": auto_rate}


def apply_auto_inner_steps(plan, h: int, counts: Sequence[int], cluster=None) -> None:
    """Give ``plan.dp_sync`` (DiLoCo) per-replica inner steps by speed with the fastest's ``h`` (``counts``: each
    replica's micro-batches per step), and record the step times, H_r and the round's predicted prices in
    ``plan.predicted["inner_steps_auto"]``."""
    from fusion.plan import PlanError

    step_s = replica_step_times(plan, counts, cluster)
    per = inner_steps_by_speed(step_s, h)
    try:
        plan.dp_sync = dataclasses.replace(plan.dp_sync, inner_steps=h, inner_steps_per_replica=per)
        plan.check()
    except PlanError as e:
        raise FusionError(f"--inner-steps auto: {e}") from None
    plan.predicted["inner_steps_auto"] = {"step_s": step_s, "inner_steps": [per[r] for r in range(len(step_s))],
                                          **round_prices(step_s, per, h, counts)}
