"""What the rooms of a CompNode share: the coordinator's name as a peer, the bound on queued control messages
and the exception that stops an executor."""
from __future__ import annotations

from fusion.ir.errors import FusionError

COORDINATOR = "coordinator"
#: control messages waiting for the engine loop (the coordinator sends one at a time; more is a flood)
MAX_QUEUED_CTRL = 64


class ExecutorAbort(FusionError):
    """The executor stops: told to abort, coordinator gone, or a wait timed out."""
