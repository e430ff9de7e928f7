"""Deterministic fault injection for tests and ``benchmarks/chaos.py``: a process that kills or stops itself.

``FUSION_TEST_FAULT=PART:STEP:SIGNAL[:MARKER][,...]`` in the environment of ``fusion run`` (its executors
inherit it) makes the process that runs ``PART`` send itself ``SIGNAL`` (``KILL`` or ``STOP``):

- an executor, when the coordinator asks it for iteration ``STEP``, before it computes anything of it;
- ``PART`` = ``coordinator`` (the ``fusion run`` process itself), right after it committed the checkpoint
  of step ``STEP`` and before the step's metrics line is written (the window of issue 28).

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


@dataclass(frozen=True)
class Fault:
    """part: the CompNode that fails; step: the executor iteration at whose start it fails; signal: KILL or
    STOP; marker: a file that makes the fault fire once ('' = every time)."""

    part: str
    step: int
    signal: str
    marker: str = ""


def parse_faults(text: str) -> tuple[Fault, ...]:
    """``PART:STEP:SIGNAL[:MARKER][,...]`` -> the faults; FusionError naming the variable otherwise."""
    out = []
    for item in text.split(","):
        bits = item.split(":", 3)
        if len(bits) < 3 or not bits[0] or not bits[1].isdigit() or bits[2] not in SIGNALS:
            raise FusionError(f"{ENV}={text!r}: expected PART:STEP:KILL|STOP[:MARKER], comma-separated")
        out.append(Fault(bits[0], int(bits[1]), bits[2], bits[3] if len(bits) > 3 else ""))
    return tuple(out)


@lru_cache(maxsize=1)
def _configured() -> tuple[Fault, ...]:
    text = os.environ.get(ENV, "")
    return parse_faults(text) if text else ()


def maybe_fail(part: str, step: int) -> None:
    """Send this process the signal of a fault configured for ``part`` at ``step`` (see the module doc)."""
    for f in _configured():
        if f.part != part or f.step != step:
            continue
        if f.marker:
            try:
                fd = os.open(f.marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            except FileExistsError:
                continue  # fired already (this is the restarted executor, or the resumed run)
            os.close(fd)
        log.warning("%s: %s: sending myself SIG%s at step %d", part, ENV, f.signal, step)
        os.kill(os.getpid(), SIGNALS[f.signal])
