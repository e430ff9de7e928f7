"""Links between the processes of a run on one host (``fusion run`` without ``--ray``): ZeroMQ ``ipc://`` sockets
in a directory only this user can open.

Every process of such a run is a child of ``fusion run`` under the same user, and nothing they send leaves the
kernel. CURVE over loopback TCP (``--links curve``) authenticates each process by the run's keys in ``OUT/keys``
(files of mode 0600, which any process of the same user can read) and encrypts bytes that never reach a wire: on
GPT-2 small's 154 MB tied gradient each step that cost 0.44 s of a 3.67 s step on 2 cores (docs/testing.md). Unix
sockets in a fresh directory of mode 0700 (``private_socket_dir``) are opened only by processes of this user (and
root), the same set that could read the keys, without the cipher: the kernel checks who connects. A socket whose
directory others may enter is not treated as private (:func:`is_private_ipc`), and a process listening on one
warns as it would without CURVE. A process that runs several parts (the interleaved schedule) is given one path and
binds ``PATH.<part>`` for each (``fusion executor``'s ``lane_bind``).
"""
from __future__ import annotations

import os
import shutil
import stat
import tempfile
from pathlib import Path

#: the prefix of the socket path (``ipc://``)
IPC = "ipc://"
#: the longest socket path a Unix socket takes (``sun_path``, 108 bytes with its terminating NUL on Linux)
MAX_PATH = 107


def private_socket_dir() -> Path:
    """A fresh directory of mode 0700 for this run's sockets, under a short temporary folder (socket paths are
    limited to :data:`MAX_PATH` bytes, which a deep run folder would exceed)."""
    base = "/tmp" if os.path.isdir("/tmp") else tempfile.gettempdir()
    return Path(tempfile.mkdtemp(prefix="fusion-", dir=base))  # mkdtemp makes it 0700, owned by this user


def ipc_address(folder: Path, index: int | str) -> str:
    """The address of socket ``index`` (``"c"``, the coordinator's, or an executor process's number) in ``folder``."""
    path = f"{folder}/{index}"
    if len(path.encode()) > MAX_PATH:
        raise ValueError(f"socket path {path!r} is longer than a Unix socket takes ({MAX_PATH} bytes)")
    return IPC + path


def is_private_ipc(address: str) -> bool:
    """Whether ``address`` is an ``ipc://`` socket in a directory of this user that no one else may enter."""
    if not address.startswith(IPC):
        return False
    try:
        st = os.stat(os.path.dirname(address[len(IPC):]) or ".")
    except OSError:
        return False
    return st.st_uid == os.getuid() and stat.S_ISDIR(st.st_mode) and not st.st_mode & 0o077


def remove(folder: Path | None) -> None:
    """Remove the run's socket directory (its sockets are gone once their processes closed them)."""
    if folder is not None:
        shutil.rmtree(folder, ignore_errors=True)
