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

A run that ends normally removes its directory (:func:`remove`); one that is killed (SIGKILL, a power cut) cannot.
Each directory therefore holds an ``owner`` file naming the process that made it (its pid and start time, so a
reused pid is not mistaken for it), and the next run of this user removes the directories whose owner is gone
(:func:`sweep_stale`) before it makes its own. Directories without that file (another program's ``fusion-*``
folder) are never touched.
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


PREFIX = "fusion-"
#: the file in a socket directory that names the process which made it: ``"<pid> <start time> <pid namespace>"``
OWNER = "owner"


def _base() -> str:
    return "/tmp" if os.path.isdir("/tmp") else tempfile.gettempdir()


def _start_time(pid: int) -> str | None:
    """When process ``pid`` started (clock ticks since boot, ``/proc/PID/stat`` field 22); None if there is no such
    process; ``"?"`` where ``/proc`` cannot tell (not Linux) but the process exists."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
        return text[text.rindex(")") + 2:].split()[19]
    except (OSError, ValueError, IndexError):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:
            pass
        return "?"


def _pid_namespace() -> str:
    """This process's pid namespace (``/proc/self/ns/pid``; ``"?"`` where there is none): a pid means something only
    inside its namespace (two containers may share /tmp)."""
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return "?"


def private_socket_dir(base: str | None = None) -> Path:
    """A fresh directory of mode 0700 for this run's sockets, under a short temporary folder (socket paths are
    limited to :data:`MAX_PATH` bytes, which a deep run folder would exceed), with its :data:`OWNER` file; the
    directories of this user's runs that were killed are removed first (:func:`sweep_stale`)."""
    base = base or _base()
    sweep_stale(base)
    folder = Path(tempfile.mkdtemp(prefix=PREFIX, dir=base))  # mkdtemp makes it 0700, owned by this user
    (folder / OWNER).write_text(f"{os.getpid()} {_start_time(os.getpid())} {_pid_namespace()}\n")
    return folder


def sweep_stale(base: str | None = None) -> list[Path]:
    """Remove the socket directories under ``base`` (default /tmp) that this user's runs made (a ``fusion-*``
    directory of this user, mode 0700, with an :data:`OWNER` file) and whose owner process no longer runs (no such
    pid, or a pid now used by a process that started at another time). A directory made in another pid namespace
    is left alone: its pid cannot be looked up from here. Returns the removed ones."""
    removed = []
    ns = _pid_namespace()
    try:
        entries = list(os.scandir(base or _base()))
    except OSError:
        return removed
    for e in entries:
        if not e.name.startswith(PREFIX):
            continue
        try:
            st = e.stat(follow_symlinks=False)
            if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
                continue
            pid_text, started, owner_ns = Path(e.path, OWNER).read_text().split()
            pid = int(pid_text)
        except (OSError, ValueError):
            continue  # not one of ours, or being made right now (no owner file yet)
        if owner_ns != ns or ns == "?":
            continue
        now = _start_time(pid)
        if now is None or (now != started and "?" not in (now, started)):
            shutil.rmtree(e.path, ignore_errors=True)
            removed.append(Path(e.path))
    return removed


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
