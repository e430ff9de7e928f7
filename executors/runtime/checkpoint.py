"""Checkpoints: each CompNode writes its own parameters and optimizer state.

Layout under a checkpoint directory::

    step-00000010/<part>.params.safetensors   parameters of the part (after 10 steps)
    step-00000010/<part>.optim.safetensors    optimizer tensors (``param::key``)
    step-00000010/<part>.delta.safetensors    AQ-SGD buffers of the part's delta edges (only when it has some)
    step-00000010/<part>.outer.safetensors    DiLoCo's outer state (global weights, outer momentum, error-feedback
                                              residual; ``executors.runtime.dp.outer``), only in diloco runs
    step-00000010/<part>.json                 optimizer meta, step, part name
    step-00000010/COMPLETE.json               written by the coordinator once every part has saved
    latest.json                               {"step": 10}: the newest complete checkpoint

Every file is written to a temporary name, fsynced, renamed into place and
the folder fsynced, so a crash leaves either the old file or the new one;
temporary files a crashed writer left behind are removed by the next save.
``<part>.json`` holds the SHA-256 of the part's two tensor files; they are
verified on resume (by the coordinator when the files are on its disk, and by
each executor). A checkpoint that does not verify is passed over, in one log
line naming its bad file, for the previous complete one
(:func:`newest_verified`); when none verifies, resuming is refused with the
newest one's bad file. A step directory without ``COMPLETE.json`` is ignored
on resume. No pickle: tensors
are safetensors, the rest is JSON.

``COMPLETE.json`` lists the parts that saved the step. In a replicated plan
that lost a replica (``--drop-failed-replicas``) only the survivors save;
their copy of each stage stands for every replica of it, because the
replicas of a stage hold the same bits after every all-reduce. On resume,
:func:`resume_sources` maps each part of the (full) plan to the saved part
of its stage whose files it loads.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any, Callable, Mapping

import numpy as np

from fusion.executors.runtime import faults
from fusion.ir.errors import FusionError
from fusion.ir.files import atomic_write, fsync_dir, remove_stale_tmp, sha256_file

LATEST = "latest.json"
COMPLETE = "COMPLETE.json"


class CheckpointError(FusionError):
    """A checkpoint is missing or unreadable; the message names the file."""


def step_dir(root: str | Path, step: int) -> Path:
    return Path(root) / f"step-{step:08d}"


def _atomic_json(path: Path, data: Any) -> str:
    return atomic_write(path, lambda p: p.write_text(json.dumps(data, indent=1)))


def _save_arrays(path: Path, arrays: Mapping[str, np.ndarray]) -> str:
    from safetensors.numpy import save_file

    return atomic_write(path, lambda p: save_file({k: np.require(v, requirements="C") for k, v in arrays.items()}, str(p)))


def _load_arrays(path: Path) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    try:
        return load_file(str(path))
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing") from None
    except Exception as e:  # safetensors raises its own types
        raise CheckpointError(f"{path}: unreadable ({e})") from None


DELTA = "delta.safetensors"
OUTER = "outer.safetensors"


def save_part(root: str | Path, step: int, part: str, params: Mapping[str, np.ndarray],
              opt_arrays: Mapping[str, np.ndarray], opt_meta: Mapping[str, Any],
              delta: Mapping[str, np.ndarray] | None = None, outer: Mapping[str, np.ndarray] | None = None) -> Path:
    """Write one part's state after ``step`` completed steps.

    delta: the part's AQ-SGD buffers (``DeltaEdges.state_arrays``); written, and listed in the SHA-256
    manifest, when given (even empty: a part whose delta edges saw no sample yet). outer: the part's DiLoCo
    outer state (``OuterLoop.state_arrays``), written and listed the same way."""
    d = step_dir(root, step)
    d.mkdir(parents=True, exist_ok=True)
    remove_stale_tmp(d, f"{part}.")
    sums = {f"{part}.params.safetensors": _save_arrays(d / f"{part}.params.safetensors", params)}
    faults.maybe_fail(part, step, "save")  # FUSION_TEST_FAULT save-N: a crash or freeze in the middle of the write
    sums[f"{part}.optim.safetensors"] = _save_arrays(d / f"{part}.optim.safetensors", opt_arrays)
    if delta is not None:
        sums[f"{part}.{DELTA}"] = _save_arrays(d / f"{part}.{DELTA}", delta)
    if outer is not None:
        sums[f"{part}.{OUTER}"] = _save_arrays(d / f"{part}.{OUTER}", outer)
    _atomic_json(d / f"{part}.json", {"part": part, "step": step, "optimizer": dict(opt_meta), "sha256": sums})
    fsync_dir(d.parent)  # the step folder itself
    return d


def prune_part(root: str | Path, part: str, keep: int = 2) -> None:
    """Delete ``part``'s files of old saves (an executor on its own host cleans up after itself), keeping what a
    fallback may need: its saves of the ``keep`` newest *complete* steps and every save newer than them (a save
    is pruned right after it is written, before the coordinator commits it, and a fault may keep it from ever
    being complete). Where this disk holds no ``COMPLETE.json`` (the coordinator writes those on its own host),
    the ``keep + 1`` newest saves: the one in progress and the ``keep`` before it. Counting the incomplete save
    as one of ``keep`` had pruned the previous complete step on most parts, leaving a corrupt newest checkpoint
    nothing to fall back to."""
    for d in Path(root).glob("step-*"):
        remove_stale_tmp(d, f"{part}.")
    mine = sorted(p for p in Path(root).glob("step-*") if (p / f"{part}.json").exists())
    complete = [d for d in mine if (d / COMPLETE).exists()]
    if keep <= 0:
        drop: list[Path] = []
    elif complete:
        oldest_kept = complete[-keep] if len(complete) >= keep else complete[0]
        drop = [d for d in mine if d.name < oldest_kept.name]
    else:
        drop = mine[:-(keep + 1)]
    for d in drop:
        for suffix in (".params.safetensors", ".optim.safetensors", f".{DELTA}", f".{OUTER}", ".json"):
            (d / f"{part}{suffix}").unlink(missing_ok=True)
        if not any(d.iterdir()):
            d.rmdir()


def load_part(root: str | Path, step: int, part: str) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray], dict]:
    """``(params, optimizer arrays, optimizer meta)`` of ``part`` at ``step``."""
    d, meta = _part_meta(root, step, part)
    return _load_arrays(d / f"{part}.params.safetensors"), _load_arrays(d / f"{part}.optim.safetensors"), meta["optimizer"]


def load_delta(root: str | Path, step: int, part: str) -> dict[str, np.ndarray] | None:
    """The AQ-SGD buffers ``part`` saved at ``step`` (verified), or None when it saved none."""
    d, meta = _part_meta(root, step, part)
    if f"{part}.{DELTA}" not in meta["sha256"]:
        return None
    return _load_arrays(d / f"{part}.{DELTA}")


def load_outer(root: str | Path, step: int, part: str) -> dict[str, np.ndarray]:
    """The DiLoCo outer state ``part`` saved at ``step`` (verified); CheckpointError when it saved none."""
    d, meta = _part_meta(root, step, part)
    if f"{part}.{OUTER}" not in meta["sha256"]:
        raise CheckpointError(f"{d / (part + '.' + OUTER)}: missing (step {step} was saved without DiLoCo's outer "
                              "state; resume it with the plan that wrote it)")
    return _load_arrays(d / f"{part}.{OUTER}")


def _part_meta(root: str | Path, step: int, part: str) -> tuple[Path, dict]:
    d = step_dir(root, step)
    try:
        meta = json.loads((d / f"{part}.json").read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{d / (part + '.json')}: missing (part {part!r} has no checkpoint at step {step})") from None
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{d / (part + '.json')}: unreadable ({e})") from None
    if not isinstance(meta, dict) or meta.get("part") != part or meta.get("step") != step:
        raise CheckpointError(f"{d / (part + '.json')}: belongs to part {meta.get('part')!r} step {meta.get('step')!r}")
    _verify(d, part, meta)
    return d, meta


def _verify(d: Path, part: str, meta: dict) -> None:
    sums = meta.get("sha256")
    if not isinstance(sums, dict):
        raise CheckpointError(f"{d / (part + '.json')}: no SHA-256 manifest (written by an older fusion?); cannot verify")
    extra = [n for n in sums if n in (f"{part}.{DELTA}", f"{part}.{OUTER}")]
    for name in (f"{part}.params.safetensors", f"{part}.optim.safetensors", *extra):
        want = sums.get(name)
        try:
            got = sha256_file(d / name)
        except FileNotFoundError:
            raise CheckpointError(f"{d / name}: missing") from None
        if got != want:
            raise CheckpointError(f"{d / name}: checksum mismatch (SHA-256 {got[:16]}..., {part}.json says "
                                  f"{str(want)[:16]}...): the file is corrupt; refusing to resume from it")


def verify(root: str | Path, step: int, parts: list[str]) -> None:
    """Check the SHA-256 of every part's files of ``step`` that are on this disk (parts on other hosts are
    checked by their executors). Raises CheckpointError naming the first bad file."""
    d = step_dir(root, step)
    for part in parts:
        f = d / f"{part}.json"
        if not f.exists():
            continue
        try:
            meta = json.loads(f.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise CheckpointError(f"{f}: unreadable ({e})") from None
        _verify(d, part, meta if isinstance(meta, dict) else {})


def commit(root: str | Path, step: int, parts: list[str], extra: Mapping[str, Any] | None = None, keep: int = 2,
           check_files: bool = True) -> None:
    """Mark ``step`` complete (every part saved) and make it the latest; keep the newest ``keep``.

    check_files: verify every part's files are here; a coordinator whose
    executors run on other hosts (each writes its own disk) passes False and
    relies on their confirmations instead.
    """
    d = step_dir(root, step)
    missing = [p for p in parts if not (d / f"{p}.json").exists()] if check_files else []
    if missing:
        raise CheckpointError(f"{d}: parts {missing} did not save step {step}")
    d.mkdir(parents=True, exist_ok=True)
    remove_stale_tmp(d, COMPLETE)
    remove_stale_tmp(root, LATEST)
    _atomic_json(d / COMPLETE, {"step": step, "parts": parts, **(extra or {})})
    _atomic_json(Path(root) / LATEST, {"step": step})
    complete = sorted(int(p.name[5:]) for p in Path(root).glob("step-*") if (p / COMPLETE).exists())
    for old in complete[:-keep] if keep > 0 else []:
        shutil.rmtree(step_dir(root, old), ignore_errors=True)


def saved_parts(root: str | Path, step: int) -> list[str]:
    """The parts that saved complete ``step`` (``COMPLETE.json``'s ``parts``)."""
    f = step_dir(root, step) / COMPLETE
    try:
        parts = json.loads(f.read_text())["parts"]
    except FileNotFoundError:
        raise CheckpointError(f"{f}: missing (step {step} is not a complete checkpoint)") from None
    except (OSError, KeyError, TypeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{f}: unreadable ({e})") from None
    if not isinstance(parts, list) or not all(isinstance(p, str) for p in parts):
        raise CheckpointError(f"{f}: 'parts' must be a list of part names")
    return parts


def resume_sources(root: str | Path, step: int, stage_of: Mapping[str, str]) -> dict[str, str]:
    """Part -> the saved part whose files it loads to resume ``step``.

    stage_of: every part of the plan that resumes -> its stage (``Plan.stage_of``). A part that saved the
    step loads its own files; one that did not (its replica was dropped before the step) loads those of the
    first saved part of its stage, in saved order. A stage with no saved part raises CheckpointError naming it.
    """
    saved = saved_parts(root, step)
    out: dict[str, str] = {}
    for part, stage in stage_of.items():
        if part in saved:
            out[part] = part
            continue
        copy = next((q for q in saved if stage_of.get(q) == stage), None)
        if copy is None:
            raise CheckpointError(f"{step_dir(root, step) / COMPLETE}: no part of stage {stage!r} saved step {step} "
                                  f"(saved: {', '.join(saved) or 'none'}); part {part!r} cannot resume from it")
        out[part] = copy
    return out


def complete_steps(root: str | Path) -> list[int]:
    """The steps under ``root`` that have a ``COMPLETE.json``, newest first (``latest.json`` names the first of
    them unless a crash fell between a step's ``COMPLETE.json`` and ``latest.json``)."""
    steps = []
    for d in Path(root).glob("step-*"):
        if (d / COMPLETE).exists() and d.name[5:].isdigit():
            steps.append(int(d.name[5:]))
    return sorted(steps, reverse=True)


def newest_verified(root: str | Path, stage_of: Mapping[str, str],
                    skipped: Callable[[int | None, str], None] | None = None) -> tuple[int | None, dict[str, str]]:
    """The newest complete checkpoint whose files on this disk verify, and its :func:`resume_sources`.

    Steps are tried newest first; one that does not verify (a flipped byte, a missing or unreadable file) is
    passed over with ``skipped(step, reason)`` and the previous complete one is tried. ``(None, {})`` when
    there is no complete checkpoint at all; when there are some but none verifies, the newest one's
    CheckpointError (naming its bad file) is raised: a run never silently starts over from step 0.
    """
    if not Path(root).is_dir():
        return None, {}
    steps = complete_steps(root)
    try:
        pointed = latest(root)
    except CheckpointError as e:
        if not steps:
            raise
        if skipped is not None:
            skipped(None, str(e))
        pointed = None
    if pointed is not None and pointed not in steps:
        steps.insert(0, pointed)
    first_error: CheckpointError | None = None
    for step in steps:
        try:
            sources = resume_sources(root, step, stage_of)
            verify(root, step, sorted(set(sources.values())))
            return step, sources
        except CheckpointError as e:
            first_error = first_error or e
            if skipped is not None:
                skipped(step, str(e))
    if first_error is not None:
        raise first_error
    return None, {}


def latest(root: str | Path) -> int | None:
    """The newest complete checkpoint step under ``root``, or None."""
    f = Path(root) / LATEST
    try:
        step = int(json.loads(f.read_text())["step"])
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{f}: unreadable ({e})") from None
    if not (step_dir(root, step) / COMPLETE).exists():
        raise CheckpointError(f"{f} points at step {step}, which is not complete")
    return step
