"""The end of a run reads ``metrics.jsonl`` a line at a time (issue 28, memory over 10,000 steps): ``loss.png``'s
numbers and ``metrics.csv`` used to hold every row as a dict (the whole file parsed, a few KB a step), so the
coordinator's memory at the end grew with the run's length."""
from __future__ import annotations

import csv
import json
import tracemalloc

import pytest

from fusion.commands.metrics_log import write_csv
from fusion.commands.report import _plot_columns, loss_plot

STEPS = 5_000


def _line(s: int) -> dict:
    parts = {f"part{k}": {"forward_s": 0.0031, "backward_s": 0.0024, "idle_s": 0.0061, "rejected": 0,
                          "bytes_sent": 26923 + s} for k in range(4)}
    return {"step": s, "loss": 4.0 / (1 + s), "iteration_s": 0.02, "samples_per_s": 100.0 + s % 7,
            "time": 1.7e9 + s, "parts": parts}


@pytest.fixture(scope="module")
def metrics(tmp_path_factory):
    path = tmp_path_factory.mktemp("m") / "metrics.jsonl"
    with open(path, "w") as f:
        for s in range(STEPS):
            f.write(json.dumps(_line(s)) + "\n")
            if s == 100:
                f.write(json.dumps({"event": "restart", "restart": 1, "part": "part1", "resumed_step": 90}) + "\n")
            if s % 1000 == 999:
                f.write(json.dumps({"step": s, "val_loss": 1.0 / (1 + s), "time": 1.7e9 + s}) + "\n")
        f.write('{"step": 5000, "lo')  # a torn last line is skipped
    return path


def _peak(fn):
    tracemalloc.start()
    try:
        out = fn()
        return out, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_plot_numbers_are_read_in_bounded_memory(metrics):
    cols, peak = _peak(lambda: _plot_columns(metrics))
    # 5,000 rows as dicts are ~12 MB; three float arrays of 5,000 are 120 kB
    assert peak < 1 << 20, peak
    assert list(cols["step"]) == list(range(STEPS))
    assert list(cols["loss"]) == [4.0 / (1 + s) for s in range(STEPS)]
    assert list(cols["samples_per_s"]) == [100.0 + s % 7 for s in range(STEPS)]
    assert list(cols["val_step"]) == list(range(999, STEPS, 1000))
    assert cols["restarts"] == [(90, 1, "part1")]


def test_csv_is_written_in_bounded_memory(metrics, tmp_path):
    out, peak = _peak(lambda: write_csv(metrics, tmp_path / "metrics.csv"))
    assert peak < 1 << 20, peak
    with open(out) as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0])[:5] == ["step", "loss", "iteration_s", "samples_per_s", "time"]
    steps = [r for r in rows if r["loss"]]
    assert len(steps) == STEPS and float(steps[-1]["loss"]) == 4.0 / STEPS
    assert sum(1 for r in rows if r["val_loss"]) == STEPS // 1000
    assert write_csv(tmp_path / "none.jsonl", tmp_path / "none.csv") is None


def test_loss_plot_draws_a_long_run(metrics, tmp_path):
    png = loss_plot(metrics, tmp_path / "loss.png", "long")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
