"""Run ``fusion`` commands as forked children of one process that has imported torch once.

Every ``python -m fusion.cli ...`` pays about 2 s of CPU to import torch, and 2 s more when it traces a model (torch
imports torch._dynamo on the first torch.export or torch.optim call), before doing anything; the docs' commands
are tens of such processes. :class:`ForkedCli` starts one server process that imports them, then runs each
command in a child forked from it: a process of its own, with the command's argv, working folder, stdout and
stderr files and exit status, exiting as ``python -m fusion.cli`` does (non-daemon threads joined, atexit
handlers run, streams flushed), and nothing passed from one command to the next but the modules already
imported. What a command does, prints and returns is therefore what the same command prints in a fresh process.

Not a test module.
"""
from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

#: the server: imports what most commands import, then forks a child per request line
#: ({"argv", "cwd", "env", "stdout", "stderr"}) and answers {"pid"} at the fork and {"rc"} at the child's exit
#: (and {} once it has imported them).
#: The child leaves the loop by sys.exit, so the interpreter exits it as it exits any script.
_SERVER = r'''
import json, os, sys
import numpy, torch, torch._dynamo, torch.export  # noqa: F401  what nearly every command imports
import matplotlib
matplotlib.use("Agg")  # what fusion's plots select before they import pyplot
import matplotlib.pyplot  # noqa: F401  every `fusion run` draws loss.png, `fusion inspect` plan.png
import fusion.cli, fusion.commands.compile, fusion.commands.run, fusion.compile  # noqa: F401
import fusion.executors.runtime.launcher  # noqa: F401  (imports zmq; no context exists before a fork)

import gc
gc.freeze()  # the imported modules' objects: never traversed by a child's collector, so never copied into it
reply = os.fdopen(os.dup(1), "w")
os.dup2(os.open(os.devnull, os.O_RDWR), 1)  # a stray print of the server's cannot corrupt the replies
reply.write("{}\n")
reply.flush()
while True:
    line = sys.stdin.readline()
    if not line:
        break
    req = json.loads(line)
    pid = os.fork()
    if pid == 0:
        reply.close()
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
        os.dup2(os.open(req["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), 1)
        os.dup2(os.open(req["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), 2)
        os.chdir(req["cwd"])
        os.environ.update(req["env"])  # what the test adds for this command (read at run time, as by the data code)
        sys.path[0] = os.getcwd()  # as `python -m` puts it
        sys.argv = [fusion.cli.__file__, *req["argv"]]
        numpy.random.seed()  # a fresh process's global NumPy state is drawn anew; Python's random reseeds at fork
        sys.exit(fusion.cli.main(req["argv"]))
    reply.write(json.dumps({"pid": pid}) + "\n")
    reply.flush()
    _, status = os.waitpid(pid, 0)
    reply.write(json.dumps({"rc": os.waitstatus_to_exitcode(status)}) + "\n")
    reply.flush()
'''


def fusion_env() -> dict[str, str]:
    """The environment of the `fusion` commands tests run: this checkout's fusion first on the path (whatever
    folder a command runs in), one intra-op thread."""
    root = str(Path(__file__).resolve().parents[2])
    return {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]),
            "OMP_NUM_THREADS": "1"}


class ForkedCli:
    """One server process (start it with a ``with`` block); :meth:`run` runs a command in a child forked from it."""

    def __init__(self, env: dict[str, str], scratch: Path):
        self.env, self.scratch, self.proc = env, scratch, None
        self._n, self._buf = 0, b""

    def __enter__(self) -> "ForkedCli":
        self.scratch.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen([sys.executable, "-c", _SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     env=self.env, cwd=self.scratch)
        try:
            self._reply(300)  # the imports done (slow on a loaded machine)
        except BaseException:
            self.proc.kill()
            self.proc.wait()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def _reply(self, timeout_s: float) -> dict:
        """The server's next reply line, read unbuffered (two replies may arrive in one read)."""
        fd, deadline = self.proc.stdout.fileno(), time.monotonic() + timeout_s
        while b"\n" not in self._buf:
            ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                raise subprocess.TimeoutExpired("fusion", timeout_s)
            chunk = os.read(fd, 4096)
            assert chunk, f"the fusion command server exited with status {self.proc.wait()}"
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return json.loads(line)

    def run(self, argv: list[str], cwd: Path, timeout: float,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
        """``fusion ARGV`` in ``cwd``: its exit status, stdout and stderr; killed (and TimeoutExpired raised) after
        ``timeout`` seconds, as subprocess.run does. ``env``: variables added to the server's environment for this
        command (and the executors it starts); only what is read at run time, since the interpreter has started."""
        self._n += 1
        out, err = self.scratch / f"{self._n}.out", self.scratch / f"{self._n}.err"
        self.proc.stdin.write(json.dumps({"argv": argv, "cwd": str(cwd), "env": dict(env or {}), "stdout": str(out),
                                          "stderr": str(err)}).encode() + b"\n")
        self.proc.stdin.flush()
        pid = self._reply(120)["pid"]
        try:
            rc = self._reply(timeout)["rc"]
        except subprocess.TimeoutExpired:
            os.kill(pid, signal.SIGKILL)
            self._reply(120)
            # the command and what it wrote, so that a hang names itself (TimeoutExpired's text shows the command)
            raise subprocess.TimeoutExpired(["fusion", *argv], timeout, output=out.read_text(errors="replace"),
                                            stderr=err.read_text(errors="replace")) from None
        return subprocess.CompletedProcess(["fusion", *argv], rc, out.read_text(), err.read_text())
