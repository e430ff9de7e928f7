"""Durable file writes: the file plumbing the plan format, checkpoints and key files share.

A file is written whole or not at all (:func:`atomic_write`: a temporary next to it, fsync, rename,
fsync of the folder); what a crash leaves behind is cleaned up by :func:`remove_stale_tmp`, and a
file's SHA-256 is what checkpoint manifests record (:func:`sha256_file`). It imports nothing of the
project, so it lives in the lowest layer, where the plan format (``fusion.plan``), the executors and
the compiler may all import it.
"""
from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any, Callable


def fsync_dir(path: str | Path) -> None:
    """Make a rename in ``path`` durable (POSIX: the directory entry is data of the directory)."""
    try:
        fd = os.open(str(path), os.O_RDONLY)
    except OSError:
        return  # e.g. Windows: directories cannot be opened; os.replace is as durable as it gets there
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write(path: str | Path, write: Callable[[Path], Any]) -> str:
    """Write ``path`` through ``write(tmp_path)``, fsync, rename into place, fsync the folder.

    A crash leaves the old file or the new one, never half of one. Returns
    the SHA-256 (hex) of what was written. The temporary name is
    ``<name>.tmp<pid>``; :func:`remove_stale_tmp` cleans up after a crash.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    try:
        write(tmp)
        h = hashlib.sha256()
        with open(tmp, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)
    return h.hexdigest()


def sha256_file(path: str | Path) -> str:
    """The SHA-256 (hex) of the file at ``path``, read in 1 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def remove_stale_tmp(folder: str | Path, prefix: str = "") -> list[Path]:
    """Delete ``<prefix>*.tmp<pid>`` files in ``folder`` whose writer process is gone (left by a crash)."""
    gone = []
    for f in Path(folder).glob(f"{prefix}*.tmp*"):
        pid = f.name.rpartition(".tmp")[2]
        if pid.isdigit() and (int(pid) == os.getpid() or _alive(int(pid))):
            continue  # a live process (maybe this one) is writing it
        f.unlink(missing_ok=True)
        gone.append(f)
    return gone


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True
