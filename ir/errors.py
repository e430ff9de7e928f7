"""Error types shared by every layer.

Every error a user can cause is a :class:`FusionError`: the CLI prints its
message on one line and exits with status 2. Messages name the file, field,
node or peer at fault.
"""
from __future__ import annotations


class FusionError(Exception):
    """A user-facing error: bad input, not a bug."""


class GraphError(FusionError):
    """A malformed OP-DAG. ``node`` names the offending node when there is one."""

    def __init__(self, message: str, node: str | None = None):
        super().__init__(f"node {node!r}: {message}" if node else message)
        self.node = node


class WireError(FusionError):
    """A malformed message or payload received from a peer or read from a file."""
