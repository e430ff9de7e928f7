"""What a run leaves behind for humans: a loss/throughput plot and one merged trace.

Both are written at the end of ``fusion run`` / ``fusion coordinator`` and on
Ctrl-C, from the files the run already wrote (``metrics.jsonl`` and
``trace/<part>.json``), so they can also be rebuilt later.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

log = logging.getLogger(__name__)


def read_metrics(path: Path) -> list[dict]:
    """The rows of ``metrics.jsonl`` (a torn last line of a killed run is skipped)."""
    rows = []
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except ValueError:
                continue
    return rows


def loss_plot(metrics: Path, png: Path, title: str = "") -> Path | None:
    """Loss and samples/s per step as a PNG; None when there are no steps."""
    rows = read_metrics(metrics)
    if not rows:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in rows]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    a1.plot(steps, [r["loss"] for r in rows], marker="." if len(rows) < 60 else None, color="tab:blue")
    for r in rows:  # DiLoCo's outer steps (faint) and replicas that left (red), where the run had them
        if r.get("outer"):
            a1.axvline(r["step"], color="0.85", lw=0.8, zorder=0)
        for d in r.get("dropped") or []:
            a1.axvline(r["step"], color="tab:red", ls="--", lw=1)
            a1.annotate(f"replica {d.get('replica')} left", (r["step"], 1), xycoords=("data", "axes fraction"),
                        rotation=90, va="top", ha="right", fontsize=8, color="tab:red")
    a1.set_xlabel("step")
    a1.set_ylabel("loss")
    a1.set_title("training loss")
    a1.grid(alpha=0.3)
    a2.plot(steps, [r.get("samples_per_s", float("nan")) for r in rows], marker="." if len(rows) < 60 else None,
            color="tab:green")
    a2.set_xlabel("step")
    a2.set_ylabel("samples/s")
    a2.set_title("throughput")
    a2.set_ylim(bottom=0)
    a2.grid(alpha=0.3)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=100)
    plt.close(fig)
    return png


def merge_traces(trace_dir: Path, out: Path, metrics: Path | None = None) -> Path | None:
    """One Chrome/Perfetto trace of the whole run: every CompNode's events (one process row each), plus a
    ``coordinator`` row with one span per step from ``metrics.jsonl``. None when no CompNode trace exists."""
    events: list[dict] = []
    pids: set = set()
    for f in sorted(trace_dir.glob("*.json")):
        try:
            data = json.loads(f.read_text())
        except (OSError, ValueError) as e:
            log.warning("skipping trace %s: %s", f, e)
            continue
        evs = data["traceEvents"] if isinstance(data, dict) else data
        events += evs
        pids.update(e.get("pid") for e in evs)
    if not events:
        return None
    if metrics is not None:
        pid = max((p for p in pids if isinstance(p, int)), default=-1) + 1
        events.append({"name": "process_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": "coordinator"}})
        events.append({"name": "process_sort_index", "ph": "M", "pid": pid, "tid": 0, "args": {"sort_index": -1}})
        for r in read_metrics(metrics):
            if "time" in r and "iteration_s" in r:
                dur = r["iteration_s"] * 1e6
                events.append({"name": f"step {r['step']}", "cat": "step", "ph": "X", "pid": pid, "tid": 1,
                               "ts": round(r["time"] * 1e6 - dur, 1), "dur": round(dur, 1),
                               "args": {"loss": r.get("loss"), "samples_per_s": r.get("samples_per_s")}})
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))
    tmp.replace(out)
    return out


def finish_run(out: Path, title: str = "") -> dict[str, Path]:
    """Write ``loss.png`` and ``trace.json`` into the run folder; returns what was written."""
    written = {}
    for key, make in (("plot", lambda: loss_plot(out / "metrics.jsonl", out / "loss.png", title)),
                      ("trace", lambda: merge_traces(out / "trace", out / "trace.json", out / "metrics.jsonl"))):
        try:
            p = make()
        except Exception as e:  # a plot must never hide the run's own result
            log.warning("could not write the run's %s: %s", key, e)
            continue
        if p is not None:
            written[key] = p
    return written
