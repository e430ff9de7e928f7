"""Logs of a run's steps for other tools, written from ``metrics.jsonl`` (issue 26).

- ``metrics.csv``: one row per step (step, loss, iteration_s, samples_per_s, time, and any other scalar field a
  step line has, e.g. a validation loss), for a spreadsheet or pandas;
- ``tensorboard/``: TensorBoard event files (scalars ``train/loss``, ``train/samples_per_s``, ...) when the
  ``tensorboard`` package is importable; skipped, with a log line, otherwise.

Both are rebuilt from ``metrics.jsonl`` at the end of a run (and on Ctrl-C), like ``loss.png``
(``report.finish_run`` writes them all). TensorBoard's scalars are also written as the run goes
(:class:`LiveBoard`), so ``tensorboard --logdir RUN/tensorboard`` shows a run while it trains. The ``tensorboard``
package is the extra ``fusion[tensorboard]``.
"""
from __future__ import annotations

import csv
import logging
import math
from pathlib import Path

from fusion.commands.metrics_file import iter_metrics

log = logging.getLogger(__name__)

#: the columns every row has, first and in this order
FIRST = ("step", "loss", "iteration_s", "samples_per_s", "time")


def _scalars(row: dict) -> dict[str, float]:
    return {k: v for k, v in row.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


def write_csv(metrics: Path, out: Path) -> Path | None:
    """``metrics.csv`` from ``metrics.jsonl``: the scalar fields of each step line; None when there are no steps.

    Two passes over the file, one line at a time (the columns, then the rows): a long run's rows are never all in
    memory (issue 28)."""
    found: set[str] = set()
    n = 0
    for r in iter_metrics(metrics):
        found.update(_scalars(r))
        n += 1
    if not n:
        return None
    cols = [c for c in FIRST if c in found]
    cols += sorted(found - set(cols))
    tmp = out.with_name(out.name + ".tmp")
    with open(tmp, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=cols, restval="")
        w.writeheader()
        w.writerows(_scalars(r) for r in iter_metrics(metrics))
    tmp.replace(out)
    return out


def write_tensorboard(metrics: Path, out: Path) -> Path | None:
    """TensorBoard scalars of every step under ``out`` (one fresh event file); None without the tensorboard
    package or without steps."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        log.info("tensorboard is not installed: no TensorBoard log (metrics.csv and metrics.jsonl hold the same)")
        return None
    if next(iter_metrics(metrics), None) is None:
        return None
    import shutil

    if out.exists():
        shutil.rmtree(out)  # rebuilt whole from metrics.jsonl (a resumed run replays steps)
    w = SummaryWriter(str(out))
    try:
        for r in iter_metrics(metrics):  # one line at a time
            if "step" not in r:  # an event line (a restart): not a scalar of a step
                continue
            for k, v in _scalars(r).items():
                if k not in ("step", "time") and math.isfinite(v):
                    w.add_scalar(f"train/{k}", v, int(r["step"]), walltime=r.get("time"))
    finally:
        w.close()
    return out


class LiveBoard:
    """TensorBoard scalars of each metrics line as the run writes it, under ``out`` (``RUN/tensorboard``), flushed
    at once. At the start the folder is rebuilt from the lines ``metrics.jsonl`` already holds (a resumed run
    trimmed the steps it replays), then new lines are appended; at the end :func:`write_tensorboard` rebuilds it
    whole as before. Without the tensorboard package, nothing (one info line, from :func:`write_tensorboard`)."""

    def __init__(self, metrics: Path, out: Path):
        self.writer = None
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            return
        try:  # a log must never stop the run: without it, the end of the run still writes the board
            write_tensorboard(metrics, out)
            self.writer = SummaryWriter(str(out))
        except Exception as e:
            log.warning("no TensorBoard log as the run goes: %s", e)

    def add(self, line: dict) -> None:
        """One metrics line (a step's, or a validation line) as scalars ``train/<field>`` at its step."""
        if self.writer is None or "step" not in line:
            return
        for k, v in _scalars(line).items():
            if k not in ("step", "time") and math.isfinite(v):
                self.writer.add_scalar(f"train/{k}", v, int(line["step"]), walltime=line.get("time"))
        self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None
