"""Run folders: one per run, never reused by accident.

``fusion run`` and ``fusion coordinator`` write a run's outputs (metrics,
traces, logs, checkpoints, weights, plots) into a folder of their own:
``runs/<name>-<YYYYmmdd-HHMMSS>`` by default, ``--out`` to choose. A folder
that already holds something is refused unless ``--resume`` (continue that
run: metrics from the resumed step on are rewritten, not appended twice) or
``--overwrite`` (replace a previous run; only a folder that a run wrote,
marked by ``run.json``, is ever emptied).
"""
from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path

from fusion.ir.errors import FusionError

#: the marker a run writes first; ``--overwrite`` empties only folders that hold it
MARKER = "run.json"


def default_run_dir(name: str, root: str | Path = "runs") -> Path:
    """``runs/<name>-<timestamp>``, with a counter when two runs start in the same second."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out = Path(root) / f"{name}-{stamp}"
    k = 1
    while out.exists():
        k += 1
        out = Path(root) / f"{name}-{stamp}-{k}"
    return out


def _inside(a: Path, b: Path) -> bool:
    a, b = a.resolve(), b.resolve()
    return a == b or b in a.parents


def check_run_dir(out: Path, *, resume: bool, overwrite: bool, plan_dir: Path | None = None) -> list[str]:
    """Raise FusionError (exit 2) when ``out`` may not receive this run: it is (or is inside) the plan
    folder, is a file, or is a non-empty folder given neither ``--resume`` nor ``--overwrite``, or
    ``--overwrite`` would empty a folder no run wrote. Changes nothing; returns the entries of ``out``."""
    if resume and overwrite:
        raise FusionError("--resume continues a run and --overwrite replaces it: give one of them")
    if plan_dir is not None and (_inside(out, plan_dir) or _inside(plan_dir, out) and overwrite):
        raise FusionError(f"--out {out}: that is (or holds) the plan folder {plan_dir}; "
                          "a run writes into a folder of its own (leave --out out for runs/<name>-<time>)")
    if out.exists() and not out.is_dir():
        raise FusionError(f"--out {out}: exists and is not a folder")
    entries = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
    if entries and not resume:
        if not overwrite:
            what = ", ".join(entries[:4]) + (f", ... ({len(entries)} entries)" if len(entries) > 4 else "")
            raise FusionError(f"--out {out} is not empty ({what}); pass --resume to continue that run, "
                              "--overwrite to replace it, or choose another --out")
        if MARKER not in entries:
            raise FusionError(f"--out {out}: --overwrite replaces only a folder written by a fusion run "
                              f"(it has no {MARKER}); choose another --out")
    return entries


def check_resumable(out: Path) -> None:
    """FusionError (one line) for ``--resume`` of a run that holds no complete checkpoint: it would start over
    from step 0 and overwrite the run's weights, metrics and plot (with another model or options, another run's
    under this one's name). The run is left as it is."""
    from fusion.executors.runtime.checkpoint import complete_steps

    if not complete_steps(out / "checkpoints"):
        raise FusionError(f"--resume {out}: nothing to resume: the run holds no complete checkpoint (it ran without "
                          "--checkpoint-every, or stopped before the first); its weights and metrics are kept. Start "
                          "it over with --overwrite, or choose another --out")


def recipe(target: str, compile: dict, data: str | None, val_split: float | None) -> dict:
    """What a run was started with that ``--resume`` must not change: the model target (its file made absolute)
    and every compile option (a MODEL is compiled once, into RUN/plan; a resume runs that plan; ``compile``: option
    name -> value, the cluster file included; empty under ``fusion coordinator``), the data source and its held-out
    split. JSON-able."""
    file, sep, fn = target.rpartition(":")
    if sep and file.endswith(".py"):
        target = f"{Path(file).resolve()}:{fn}"
    compile_opts = {k: compile[k] for k in sorted(compile)}
    return json.loads(json.dumps({"target": target, "compile": compile_opts, "data": data, "val_split": val_split},
                                 default=str))


def check_resume_recipe(out: Path, now: dict, is_plan: bool) -> None:
    """FusionError (one line naming the first difference) when ``--resume`` of ``out`` names another model, compile
    option or data source than the run was started with (they were silently ignored, or trained other data).
    With a PLAN target the plan's digest is judged instead (:func:`check_resume_plan`), so only the data is compared.
    Runs that recorded no recipe are not judged."""
    try:
        runs = json.loads((out / MARKER).read_text()).get("runs", [])
    except (OSError, ValueError, AttributeError):
        return
    was = next((r.get("recipe") for r in reversed(runs) if isinstance(r, dict) and r.get("recipe")), None)
    if not was:
        return
    pairs = [("--data", was.get("data"), now.get("data")), ("--val-split", was.get("val_split"), now.get("val_split"))]
    if not is_plan:
        pairs.insert(0, ("the model", was.get("target"), now.get("target")))
        for k in sorted(set(was.get("compile", {})) | set(now.get("compile", {}))):
            pairs.append((f"--{k.replace('_', '-')}", was.get("compile", {}).get(k), now.get("compile", {}).get(k)))
    for what, before, given in pairs:
        if before != given:
            raise FusionError(f"--resume {out}: the run was started with {what} {before}, this command says {given}; "
                              "resume with the options it was started with, or start a new --out")


def prepare_run_dir(out: Path, *, resume: bool, overwrite: bool, plan_dir: Path | None = None,
                    argv: list[str] | None = None, run_recipe: dict | None = None) -> None:
    """:func:`check_run_dir`, then empty ``out`` for ``--overwrite``, create it and write ``run.json`` (this run's
    entry with its :func:`recipe`, ``run_recipe``, for a later ``--resume`` to compare)."""
    entries = check_run_dir(out, resume=resume, overwrite=overwrite, plan_dir=plan_dir)
    if entries and not resume:
        for name in entries:
            p = out / name
            shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()
    out.mkdir(parents=True, exist_ok=True)
    info = {"argv": list(argv if argv is not None else sys.argv), "cwd": os.getcwd(), "started": time.time(),
            "plan": str(plan_dir) if plan_dir is not None else None}
    if run_recipe is not None:
        info["recipe"] = run_recipe
    runs = []
    if resume and (out / MARKER).exists():
        try:
            prev = json.loads((out / MARKER).read_text())
            runs = prev.get("runs", [prev])
        except (OSError, ValueError):
            runs = []
    (out / MARKER).write_text(json.dumps({**info, "runs": [*runs, info][-20:]}, indent=1))


def resume_hint(out: Path, checkpoint_every: int) -> str:
    """What ``--resume`` will do with the run in ``out`` after an interruption: continue from its last complete
    checkpoint, or, with no checkpoints (``--checkpoint-every 0``, the default), start over from step 0."""
    if not checkpoint_every:
        return (f"no checkpoints were written (--checkpoint-every 0), so this run cannot be resumed: final.safetensors "
                f"holds the latest weights; --overwrite --out {out} starts it over")
    return f"--resume --out {out} continues from the last complete checkpoint (one every {checkpoint_every} steps)"


def record_plan_digest(out: Path, digest: str) -> None:
    """Note in ``run.json`` (this run's entry) the digest of the plan the run executes, for ``--resume`` to compare."""
    try:
        info = json.loads((out / MARKER).read_text())
    except (OSError, ValueError):
        return
    info["plan_digest"] = digest
    if info.get("runs"):
        info["runs"][-1]["plan_digest"] = digest
    (out / MARKER).write_text(json.dumps(info, indent=1))


def check_resume_plan(out: Path, digest: str, plan_dir: Path) -> None:
    """FusionError (one line) when the run in ``out`` was written by a plan other than the one at ``plan_dir``
    (digest ``digest``): its checkpoints hold another cut's parameters, which used to fail deep in an executor
    (``no initial value for parameter ...``). Runs that recorded no digest are not judged."""
    try:
        runs = json.loads((out / MARKER).read_text()).get("runs", [])
    except (OSError, ValueError, AttributeError):
        return
    prev = next((r.get("plan_digest") for r in reversed(runs) if isinstance(r, dict) and r.get("plan_digest")), None)
    if prev and prev != digest:
        raise FusionError(f"--resume {out}: the run was written by another plan (digest {prev[:16]}), {plan_dir} is "
                          f"{digest[:16]}; resume it with the plan that wrote it ({out / 'plan'} when the run "
                          "compiled its own) or start a new --out")


def trim_metrics(path: Path, first: int) -> int:
    """Keep the lines of ``metrics.jsonl`` for steps before ``first`` (a resumed run rewrites the rest).

    Lines of events (``{"event": "restart", ...}``) are kept whatever their step. Returns how many lines
    were kept.
    """
    if not path.exists():
        return 0
    kept = []
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
            if "event" in row or int(row["step"]) < first:  # events (restarts) are history: always kept
                kept.append(line)
        except (ValueError, KeyError, TypeError):
            continue  # a torn last line from a killed run
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(x + "\n" for x in kept))
    tmp.replace(path)
    return len(kept)


def restore_committed_line(path: Path, checkpoint_dir: str | Path | None, first: int) -> bool:
    """Append step ``first - 1``'s metrics line to ``path`` when it is missing and the checkpoint of step
    ``first`` recorded it (``COMPLETE.json``'s ``metrics``).

    The coordinator commits a checkpoint before ``train`` writes the step's line; a crash in between used to
    lose that line for good. Lines of earlier steps were flushed before this step began. Returns whether a
    line was restored."""
    from fusion.executors.runtime.checkpoint import COMPLETE, step_dir

    if first <= 0 or checkpoint_dir is None:
        return False
    try:
        line = json.loads((step_dir(checkpoint_dir, first) / COMPLETE).read_text()).get("metrics")
    except (OSError, ValueError, AttributeError):
        return False
    if not isinstance(line, dict) or line.get("step") != first - 1:
        return False
    if path.exists():
        for text in path.read_text().splitlines():
            try:
                row = json.loads(text)
            except ValueError:
                continue
            if "event" not in row and row.get("step") == first - 1:
                return False
    with open(path, "a") as f:
        f.write(json.dumps(line) + "\n")
    return True
