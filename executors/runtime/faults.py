"""Deterministic fault injection for tests and ``benchmarks/chaos.py``: a process that kills or stops itself.

``FUSION_TEST_FAULT=PART:STEP:SIGNAL[:MARKER][,...]`` in the environment of ``fusion run`` (its executors
inherit it) makes the process that runs ``PART`` send itself ``SIGNAL`` (``KILL`` or ``STOP``):

- ``STEP`` = ``N``: an executor, when the coordinator asks it for iteration ``N``, before it computes anything
  of it; ``PART`` = ``coordinator`` (the ``fusion run`` process itself), right after it committed the
  checkpoint of step ``N`` and before the step's metrics line is written (the window of issue 28);
- ``STEP`` = ``save-N``: an executor in the middle of writing its checkpoint of step ``N`` (``N`` completed
  steps): its parameters file is in place, its optimizer file and JSON sidecar are not (``checkpoint.save_part``);
  ``SIGNAL`` may also be ``ENOSPC`` there: the write fails as on a full disk (``OSError`` errno 28), no signal;
- ``STEP`` = ``start-N``: an executor during start-up (the coordinator's setup received, the part not yet
  built nor ready), in a start that resumes at step ``N`` or later (``start-0``: the first start too).
  Without a marker such a fault fires at every later start, so give it one.

With ``MARKER`` (a file path) a fault fires once: the marker is created first, and a process that finds it
already there (an executor restarted by ``--max-restarts``, a resumed run) carries on. Several faults are
separated by commas. Unset, nothing happens; the variable is read once per process.
"""
from __future__ import annotations

import logging
import os
import signal
from dataclasses import dataclass
from functools import lru_cache

from fusion.ir.errors import FusionError

log = logging.getLogger(__name__)

ENV = "FUSION_TEST_FAULT"
SIGNALS = {"KILL": signal.SIGKILL, "STOP": signal.SIGSTOP}
#: faults that raise instead of sending a signal: a write that finds the disk full
RAISES = {"ENOSPC"}


@dataclass(frozen=True)
class Fault:
    """part: the CompNode that fails; step: the step it fails at (see ``point``); signal: KILL or STOP;
    marker: a file that makes the fault fire once ('' = every time); point: where in that step ("step": the
    start of iteration ``step``, "save": inside the checkpoint write of ``step`` completed steps, "start":
    start-up of a run resuming at ``step`` or later)."""

    part: str
    step: int
    signal: str
    marker: str = ""
    point: str = "step"


#: the points a fault can fire at: ``STEP`` prefixes (``save-4``, ``start-0``) -> point names
POINTS = ("save", "start")


def parse_faults(text: str) -> tuple[Fault, ...]:
    """``PART:STEP:SIGNAL[:MARKER][,...]`` -> the faults; FusionError naming the variable otherwise."""
    out = []
    for item in text.split(","):
        bits = item.split(":", 3)
        point, _, n = bits[1].rpartition("-") if len(bits) > 1 else ("", "", "")
        if len(bits) < 3 or not bits[0] or not n.isdigit() or point not in ("", *POINTS) or bits[2] not in (*SIGNALS, *RAISES) \
                or bits[2] in RAISES and point != "save":
            raise FusionError(f"{ENV}={text!r}: expected PART:[save-|start-]STEP:KILL|STOP[:MARKER] (or "
                              "PART:save-STEP:ENOSPC), comma-separated")
        out.append(Fault(bits[0], int(n), bits[2], bits[3] if len(bits) > 3 else "", point or "step"))
    return tuple(out)


@lru_cache(maxsize=1)
def _configured() -> tuple[Fault, ...]:
    text = os.environ.get(ENV, "")
    return parse_faults(text) if text else ()


def maybe_fail(part: str, step: int, point: str = "step") -> None:
    """Send this process the signal of a fault configured for ``part`` at ``step`` and ``point`` (see the module
    doc; at "start", ``step`` is the step the run resumes at and a fault of that step or an earlier one fires)."""
    for f in _configured():
        if f.part != part or f.point != point or (f.step > step if point == "start" else f.step != step):
            continue
        if f.marker:
            try:
                fd = os.open(f.marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            except FileExistsError:
                continue  # fired already (this is the restarted executor, or the resumed run)
            os.close(fd)
        if f.signal == "ENOSPC":
            import errno

            log.warning("%s: %s: a full disk at %s %d", part, ENV, point, step)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), f"step {step} of {part} ({ENV})")
        log.warning("%s: %s: sending myself SIG%s at %s %d", part, ENV, f.signal, point, step)
        os.kill(os.getpid(), SIGNALS[f.signal])
