"""``metrics.jsonl``, a run's log of one JSON line per step (and per evaluation or restart event), read back.

``fusion run`` and ``fusion coordinator`` write it as they train (:mod:`fusion.commands.steploop`); the plot and trace
(:mod:`fusion.commands.report`) and the CSV and TensorBoard logs (:mod:`fusion.commands.metrics_log`) are made from it
by reading it here, one line at a time.
"""
from __future__ import annotations

import json
from pathlib import Path


def iter_metrics(path: Path):
    """The rows of ``metrics.jsonl`` one at a time (a torn last line of a killed run is skipped)."""
    if not path.exists():
        return
    with open(path) as f:
        for line in f:
            try:
                yield json.loads(line)
            except ValueError:
                continue


def read_metrics(path: Path) -> list[dict]:
    """The rows of ``metrics.jsonl`` (a torn last line of a killed run is skipped)."""
    return list(iter_metrics(path))
