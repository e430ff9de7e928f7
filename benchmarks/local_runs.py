"""One measured run of a saved plan: real CompNode processes on loopback with ``--emulate-links``.

The measured benchmarks (``bench_dp_measured.py``, ``bench_diloco.py``) start a :class:`LocalCluster` on a
plan, take ``warmup`` steps of the plan's ``auto`` batches, then ``steps`` measured ones; each turns the
coordinator's step reports into its own figures.
"""
from __future__ import annotations

from pathlib import Path


def emulated_steps(plan_dir: Path, run_dir: Path, steps: int, warmup: int) -> tuple[object, list]:
    """``(plan, reports)``: the coordinator's :class:`StepReport` of each measured step (warm-up steps dropped)
    of a run of ``plan_dir`` in ``run_dir`` (one thread per CompNode, emulated links, 60 s peer timeout)."""
    from fusion.data.batches import make_batches
    from fusion.executors.runtime.coordinator import CoordinatorConfig
    from fusion.executors.runtime.launcher import LocalCluster

    with LocalCluster(plan_dir, run_dir, CoordinatorConfig(emulate_links=True, peer_timeout_s=60), threads=1,
                      trace=False, verbose=0) as lc:
        lc.start()
        batch = make_batches(lc.plan, "auto", 0)
        reports = [lc.coordinator.step(batch(s)) for s in range(warmup + steps)][warmup:]
    return lc.plan, reports
