"""Warm start: executor processes forked from one process that has imported torch and the executor once.

Every executor started as ``python -m fusion.cli executor ...`` pays ~2 s of CPU to import torch before it does
anything; four of them on a 2-core host took ~6 s to be ready (issue 38: ready <= 5 s). A :class:`WarmServer`
is one ``python`` process that imports torch and the executor's modules, then, per request, forks a child that
becomes ``fusion executor ARGV``: its own session (so the launcher's ``killpg`` reaches it and only it), its
own environment, stdout and stderr on the part's log file, and ``sys.exit(main(argv))`` as its end, so it exits
as the command does in a fresh process (threads joined, atexit handlers run; ``--fast-exit`` as usual). Nothing
passes from one executor to the next but the modules already imported, which hold no ZeroMQ context and have
run no parallel region (a fork is safe before either).

multiprocessing's forkserver is not used: it re-imports the launcher's ``__main__`` in every child, pickles the
target, and ends children with ``os._exit`` (no atexit), none of which a CLI command expects.

:class:`WarmProcess` is what :class:`~fusion.executors.runtime.launcher.LocalCluster` keeps per part, with the
part of :class:`subprocess.Popen`'s interface the launcher and the coordinator use (``pid``, ``poll``, ``wait``,
``returncode``): the server reaps its children and reports each exit status on its stdout.
"""
from __future__ import annotations

import json
import logging
import os
import subprocess
import threading
from pathlib import Path
from typing import Mapping

log = logging.getLogger(__name__)

#: The server: imports what an executor imports, says ``{}``, then reads one JSON request a line
#: ({"argv", "env", "log"}), forks a child per request and answers {"pid"} at the fork and {"pid", "rc"} when it
#: has reaped the child. It leaves when its stdin closes (the launcher is done or gone).
_SERVER = r'''
import json, os, select, sys
sys.path[0] = sys.argv.pop(1)  # fusion from the folder the launcher imported it from, never the cwd
import numpy, torch  # noqa: F401
import fusion.cli, fusion.commands.executor, fusion.executors.runtime.compnode  # noqa: F401
import fusion.executors.engines.torch.engine  # noqa: F401
import gc
gc.freeze()  # imported modules' objects are never traversed by a child's collector, so never copied into it
reply = os.fdopen(os.dup(1), "w")
os.dup2(os.open(os.devnull, os.O_RDWR), 1)  # a stray print of the server's cannot corrupt the replies
reply.write("{}\n")
reply.flush()
children, buf, stdin = set(), b"", sys.stdin.fileno()
while True:
    ready, _, _ = select.select([stdin], [], [], 0.05)
    if ready:
        chunk = os.read(stdin, 1 << 16)
        if not chunk:
            break
        buf += chunk
    while b"\n" in buf:
        line, buf = buf.split(b"\n", 1)
        req = json.loads(line)
        pid = os.fork()
        if pid == 0:
            reply.close()
            os.setsid()
            out = os.open(req["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
            os.dup2(out, 1)
            os.dup2(out, 2)
            os.close(out)
            sys.stdout = open(1, "w", buffering=1, closefd=False)  # line by line, as PYTHONUNBUFFERED logs
            sys.stderr = open(2, "w", buffering=1, closefd=False)
            os.environ.clear()
            os.environ.update(req["env"])
            sys.argv = ["fusion", *req["argv"]]
            numpy.random.seed()  # a fresh process draws its global NumPy state anew
            sys.exit(fusion.cli.main(req["argv"]))
        children.add(pid)
        reply.write(json.dumps({"pid": pid}) + "\n")
        reply.flush()
    while children:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            break
        children.discard(pid)
        reply.write(json.dumps({"pid": pid, "rc": os.waitstatus_to_exitcode(status)}) + "\n")
        reply.flush()
'''


def can_warm_start() -> bool:
    """Whether this platform can fork a warm server's children (POSIX ``fork`` and ``setsid``)."""
    return hasattr(os, "fork") and hasattr(os, "setsid")


class WarmServer:
    """One server process (:data:`_SERVER`), started at once; :meth:`spawn` waits for its imports the first time.

    python: the interpreter; root: the folder holding the ``fusion`` package to import; env: the server's
    environment (torch reads its thread settings, e.g. ``OMP_NUM_THREADS``, when it is imported)."""

    def __init__(self, python: str, root: str, env: Mapping[str, str]):
        self.proc = subprocess.Popen([python, "-c", _SERVER, root], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     env=dict(env), start_new_session=True)
        self._cond = threading.Condition()
        self._ready = False
        self._pids: list[int] = []  # pids answered, not yet taken by spawn
        self._rc: dict[int, int] = {}
        self._gone = False
        threading.Thread(target=self._read, name="warm-server", daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            msg = json.loads(line)
            with self._cond:
                if not msg:
                    self._ready = True
                elif "rc" in msg:
                    self._rc[msg["pid"]] = msg["rc"]
                else:
                    self._pids.append(msg["pid"])
                self._cond.notify_all()
        with self._cond:
            self._gone = True
            self._cond.notify_all()

    def spawn(self, argv: list[str], env: Mapping[str, str], log_path: Path, timeout_s: float = 120.0) -> "WarmProcess":
        """Fork ``fusion ARGV`` with environment ``env``, output appended to ``log_path``."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._ready or self._gone, timeout_s) or self._gone:
                raise RuntimeError(f"the warm executor server did not start (status {self.proc.poll()})")
            self.proc.stdin.write((json.dumps({"argv": argv, "env": dict(env), "log": str(log_path)}) + "\n").encode())
            self.proc.stdin.flush()
            if not self._cond.wait_for(lambda: self._pids or self._gone, timeout_s) or not self._pids:
                raise RuntimeError("the warm executor server did not fork")
            return WarmProcess(self, self._pids.pop(0))

    def status(self, pid: int, timeout_s: float | None) -> int | None:
        """The exit status of child ``pid`` once reaped, waiting up to ``timeout_s`` (None: no limit; 0: a poll).
        If the server is gone, a child no longer in /proc counts as exited with -1."""
        def known() -> bool:
            return pid in self._rc or self._gone

        with self._cond:
            if timeout_s != 0:
                self._cond.wait_for(known, timeout_s)
            if pid in self._rc:
                return self._rc[pid]
            if self._gone and not Path(f"/proc/{pid}").exists():
                return -1
            return None

    def close(self, timeout_s: float = 5.0) -> None:
        """End the server (its children are the launcher's to stop first)."""
        try:
            self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class WarmProcess:
    """A child of a :class:`WarmServer`, as the launcher and the coordinator see a process."""

    def __init__(self, server: WarmServer, pid: int):
        self.server, self.pid = server, pid
        self.args = ["fusion", "executor"]

    @property
    def returncode(self) -> int | None:
        return self.server.status(self.pid, 0)

    def poll(self) -> int | None:
        return self.server.status(self.pid, 0)

    def wait(self, timeout: float | None = None) -> int:
        rc = self.server.status(self.pid, timeout)
        if rc is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return rc
