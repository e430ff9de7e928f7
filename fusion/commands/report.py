"""What a run leaves behind for humans: a loss/throughput plot and one merged trace.

Both are written at the end of ``fusion run`` / ``fusion coordinator`` and on
Ctrl-C, from the files the run already wrote (``metrics.jsonl`` and
``trace/<part>.json``), so they can also be rebuilt later.
"""
from __future__ import annotations

import logging
from pathlib import Path

from fusion.commands.metrics_file import iter_metrics
from fusion.commands.metrics_log import write_csv, write_tensorboard

log = logging.getLogger(__name__)


def _num(v) -> float:
    """A plotted number (NaN, a gap in the line, for a missing one)."""
    return float(v) if isinstance(v, (int, float)) else float("nan")


def _plot_columns(metrics: Path) -> dict:
    """What ``loss.png`` draws, read from ``metrics.jsonl`` one line at a time: per step only the numbers drawn
    (step, loss, samples/s as float arrays, 8 bytes each), plus the few marked steps (DiLoCo outer steps, replicas
    that left or joined, restarts, held-out losses). A long run's rows are never all held as dicts (issue 28)."""
    from array import array

    cols = {"step": array("d"), "loss": array("d"), "samples_per_s": array("d"), "outer": array("d"),
            "val_step": array("d"), "val_loss": array("d"), "marks": [], "restarts": []}
    for r in iter_metrics(metrics):
        if "event" in r:  # restarts (--max-restarts): drawn, not plotted as steps
            if r.get("event") == "restart" and isinstance(r.get("resumed_step"), int):
                cols["restarts"].append((r["resumed_step"], r.get("restart"), r.get("part")))
        elif "loss" in r:
            cols["step"].append(r["step"])
            cols["loss"].append(_num(r["loss"]))
            cols["samples_per_s"].append(_num(r.get("samples_per_s")))
            if r.get("outer"):
                cols["outer"].append(r["step"])
            for d in r.get("dropped") or []:
                cols["marks"].append((r["step"], "tab:red", f"replica {d.get('replica')} left"))
            for d in r.get("joined") or []:
                cols["marks"].append((r["step"], "tab:green", f"replica {d.get('replica')} joined"))
        elif "val_loss" in r:  # evaluation lines: {"step", "val_loss"}
            cols["val_step"].append(r["step"])
            cols["val_loss"].append(_num(r["val_loss"]))
    return cols


def loss_plot(metrics: Path, png: Path, title: str = "") -> Path | None:
    """Loss (and the held-out loss of ``--eval-every``) and samples/s per step as a PNG; None when there are no steps."""
    c = _plot_columns(metrics)
    if not c["step"]:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps, few = c["step"], len(c["step"]) < 60
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    a1.plot(steps, c["loss"], marker="." if few else None, color="tab:blue", label="train")
    if c["val_step"]:
        a1.plot(c["val_step"], c["val_loss"], marker="o", color="tab:orange", label="validation (held out)")
        a1.legend()
    for s in c["outer"]:  # DiLoCo's outer steps (faint)
        a1.axvline(s, color="0.85", lw=0.8, zorder=0)
    for s, color, text in c["marks"]:  # replicas that left (red) or joined (green, before the step they first trained)
        a1.axvline(s, color=color, ls="--", lw=1)
        a1.annotate(text, (s, 1), xycoords=("data", "axes fraction"), rotation=90, va="top", ha="right", fontsize=8,
                    color=color)
    for s, number, part in c["restarts"]:  # the run restarted its CompNodes and went back to a checkpoint's step
        a1.axvline(s, color="tab:orange", ls=":", lw=1.2)
        a1.annotate(f"restart {number} ({part})", (s, 1), xycoords=("data", "axes fraction"), rotation=90, va="top",
                    ha="right", fontsize=8, color="tab:orange")
    a1.set_xlabel("step")
    a1.set_ylabel("loss")
    a1.set_title("training loss")
    a1.grid(alpha=0.3)
    a2.plot(steps, c["samples_per_s"], marker="." if few else None, color="tab:green")
    a2.set_xlabel("step")
    a2.set_ylabel("samples/s")
    a2.set_title("throughput")
    a2.set_ylim(bottom=0)
    a2.grid(alpha=0.3)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    tmp = png.with_name(png.name + ".tmp")
    try:  # written beside, then renamed: a full disk leaves the previous plot, not a truncated one
        fig.savefig(tmp, dpi=100, format="png")
    finally:
        plt.close(fig)
    tmp.replace(png)
    return png


def merge_traces(trace_dir: Path, out: Path, metrics: Path | None = None) -> Path | None:
    """One Chrome/Perfetto trace of the whole run: every CompNode's events (one process row each), plus a
    ``coordinator`` row with one span per step from ``metrics.jsonl``. None when no CompNode trace exists.

    Streamed: events go from each CompNode's file to the merged file one at a time, so merging a day-long
    run's traces takes the memory of one event, not of the run (issue 28)."""
    from fusion.executors.runtime.trace_events import iter_events, write_events

    files = sorted(trace_dir.glob("*.json"))
    if not files:
        return None
    pids: set = set()

    def parts():
        for f in files:
            try:
                for ev in iter_events(f):
                    pids.add(ev.get("pid"))
                    yield ev
            except (OSError, ValueError, KeyError, TypeError) as e:  # events already written stay: a torn file
                log.warning("skipping (the rest of) trace %s: %s", f, e)

    def coordinator():
        if metrics is None or not pids:
            return
        pid = max((p for p in pids if isinstance(p, int)), default=-1) + 1
        yield {"name": "process_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": "coordinator"}}
        yield {"name": "process_sort_index", "ph": "M", "pid": pid, "tid": 0, "args": {"sort_index": -1}}
        for r in iter_metrics(metrics):
            if "time" in r and "iteration_s" in r:
                dur = r["iteration_s"] * 1e6
                yield {"name": f"step {r['step']}", "cat": "step", "ph": "X", "pid": pid, "tid": 1,
                       "ts": round(r["time"] * 1e6 - dur, 1), "dur": round(dur, 1),
                       "args": {"loss": r.get("loss"), "samples_per_s": r.get("samples_per_s")}}

    tmp = out.with_name(out.name + ".tmp")
    with open(tmp, "w") as f:
        n = write_events(f, parts(), coordinator(), tail={"displayTimeUnit": "ms"})
    if not n:
        tmp.unlink()
        return None
    tmp.replace(out)
    return out


#: the files beside a run's outputs that :func:`finish_run`'s writers fill before renaming them into place
_PARTIAL = ("loss.png.tmp", "trace.json.tmp", "metrics.csv.tmp")


def finish_run(out: Path, title: str = "") -> dict[str, Path]:
    """Write ``loss.png``, ``trace.json``, ``metrics.csv`` and (when tensorboard is installed) ``tensorboard/``
    into the run folder, each from what the run left there; returns what was written."""
    written = {}
    for key, make in (("plot", lambda: loss_plot(out / "metrics.jsonl", out / "loss.png", title)),
                      ("trace", lambda: merge_traces(out / "trace", out / "trace.json", out / "metrics.jsonl")),
                      ("csv", lambda: write_csv(out / "metrics.jsonl", out / "metrics.csv")),
                      ("tensorboard", lambda: write_tensorboard(out / "metrics.jsonl", out / "tensorboard"))):
        try:
            p = make()
        except Exception as e:  # a plot or log must never hide the run's own result
            log.warning("could not write the run's %s: %s", key, e)
            for name in _PARTIAL:  # what it had half written beside its file (the file itself is untouched)
                (out / name).unlink(missing_ok=True)
            continue
        if p is not None:
            written[key] = p
    return written
