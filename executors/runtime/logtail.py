"""The reason a failed process gave, read from the end of its log file.

An executor that fails prints one line, ``fusion executor: error: <reason>``, to its stderr, which the local
launcher sends to ``RUN/logs/<part>.log``. The coordinator only sees the process exit; it quotes that line, so
the user reads the reason where the failure is reported instead of opening the log (issue 28).
"""
from __future__ import annotations

from pathlib import Path

#: how much of a log's end is read: a reason is the last thing a failing process writes
TAIL_BYTES = 16 << 10
MAX_REASON = 300


def last_error(path: str | Path | None) -> str | None:
    """The last ``...: error: ...`` line of the log at ``path`` (else its last ``Error``/``Exception`` line),
    shortened to :data:`MAX_REASON` characters; None when there is no such line or no readable file."""
    if path is None:
        return None
    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            f.seek(max(0, f.tell() - TAIL_BYTES))
            lines = f.read().decode("utf-8", "replace").splitlines()
    except OSError:
        return None
    for marks in ((": error: ",), ("Error: ", "Error", "Exception: ")):
        for line in reversed(lines):
            if any(m in line for m in marks):
                line = line.strip()
                return line if len(line) <= MAX_REASON else line[: MAX_REASON - 3] + "..."
    return None
