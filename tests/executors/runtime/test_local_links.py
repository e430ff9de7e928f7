"""Links of a run on one host (``fusion run --links ipc``, the default; ``executors/runtime/local_links.py``): Unix
sockets in a fresh directory of mode 0700 instead of CURVE over loopback TCP. The run is the same bits as with
``--links curve``; another user's process cannot connect; the directory is gone after the run; bad paths are refused."""
import json
import os
import pwd
import socket

import numpy as np
import pytest

from fusion.executors.runtime import local_links
from fusion.executors.runtime.connwatch import _peer
from tests.executors.dist_models import CNN_SPLITS, branching_cnn, save_hand_plan
from tests.executors.runtime.test_failure import _finish, _fusion


def _run(plan_dir, out, *extra):
    rc, err = _finish(_fusion("run", str(plan_dir), "--out", str(out), "--steps", "3", "--data", "synthetic",
                              "--no-progress", "--trace", "off", "--threads", "1", "-v", *extra,
                              env={**os.environ, "OMP_NUM_THREADS": "1"}), 240)
    assert rc == 0, err[-3000:]
    return err


def test_ipc_links_train_the_same_bits_as_curve_and_leave_nothing_behind(tmp_path):
    from safetensors.numpy import load_file

    plan_dir = save_hand_plan(tmp_path, branching_cnn(mb=2), CNN_SPLITS[2], micro_batches=2)
    before = {p for p in os.listdir("/tmp") if p.startswith("fusion-")}
    err = _run(plan_dir, tmp_path / "ipc")
    _run(plan_dir, tmp_path / "curve", "--links", "curve")
    logs = "".join(p.read_text() for p in (tmp_path / "ipc" / "logs").iterdir())
    assert "listening on ipc://" in logs and "only this user's processes can open" in logs, logs[-2000:]
    assert "without CURVE" not in logs + err  # no insecure warning: the kernel checks who connects
    assert not (tmp_path / "ipc" / "keys").exists() and (tmp_path / "curve" / "keys" / "p0.secret").exists()
    assert {p for p in os.listdir("/tmp") if p.startswith("fusion-")} <= before  # the socket directory is removed

    rows = lambda run: [(r["step"], r["loss"]) for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
                        if "loss" in r]
    assert rows(tmp_path / "ipc") == rows(tmp_path / "curve") and len(rows(tmp_path / "ipc")) == 3
    a, b = (load_file(str(tmp_path / r / "final.safetensors")) for r in ("ipc", "curve"))
    assert set(a) == set(b)
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


def _other_user() -> str | None:
    for name in ("nobody", "daemon"):
        try:
            pwd.getpwnam(name)
            return name
        except KeyError:
            continue
    return None


def _connect_as(uid: int | None, path: str) -> int:
    """0 if a process of user ``uid`` (None: this one) connects to the Unix socket at ``path``, 13 if refused."""
    pid = os.fork()
    if pid == 0:  # the child: no exec (another user may not be able to run this interpreter), plain syscalls only
        code = 1
        try:
            if uid is not None:
                os.setgroups([])
                os.setgid(uid)
                os.setuid(uid)
            s = socket.socket(socket.AF_UNIX)
            try:
                s.connect(path)
                code = 0
            except PermissionError:
                code = 13
        finally:
            os._exit(code)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


@pytest.mark.skipif(os.geteuid() != 0 or _other_user() is None, reason="needs root to run a process as another user")
def test_another_user_cannot_connect_to_a_private_socket():
    folder = local_links.private_socket_dir()
    server = socket.socket(socket.AF_UNIX)
    try:
        address = local_links.ipc_address(folder, "c")
        path = address[len(local_links.IPC):]
        server.bind(path)
        server.listen(4)
        os.chmod(path, 0o777)  # whatever the umask gave the socket file: the directory alone must keep others out
        assert local_links.is_private_ipc(address)
        other = pwd.getpwnam(_other_user()).pw_uid
        assert _connect_as(other, path) == 13  # the kernel refuses another user
        assert _connect_as(None, path) == 0  # and the probe itself can connect
        os.chmod(folder, 0o755)  # the control: a directory others may enter lets them in (so the check can fail)
        assert not local_links.is_private_ipc(address) and _connect_as(other, path) == 0
    finally:
        server.close()
        local_links.remove(folder)
    assert not folder.exists()


def test_a_socket_others_may_reach_is_not_private_and_long_paths_are_refused(tmp_path):
    open_dir = tmp_path / "open"
    open_dir.mkdir()
    os.chmod(open_dir, 0o755)
    assert not local_links.is_private_ipc(f"ipc://{open_dir}/c")
    assert not local_links.is_private_ipc("tcp://127.0.0.1:5600")
    assert not local_links.is_private_ipc(f"ipc://{tmp_path}/missing/c")
    folder = local_links.private_socket_dir()
    try:
        assert oct(folder.stat().st_mode & 0o777) == "0o700" and local_links.is_private_ipc(f"ipc://{folder}/c")
        with pytest.raises(ValueError, match="longer than a Unix socket takes"):
            local_links.ipc_address(folder, "x" * 120)
    finally:
        local_links.remove(folder)


def test_a_unix_socket_peer_is_named_by_its_process():
    a, b = socket.socketpair(socket.AF_UNIX)
    try:
        assert _peer(a) == f"pid {os.getpid()} (uid {os.getuid()})"
    finally:
        a.close()
        b.close()
    t = socket.socket()
    try:
        assert _peer(t) == "?"  # not connected
    finally:
        t.close()


def test_an_unknown_links_value_is_one_line_exit_2(tmp_path, capsys):
    from fusion.cli import main
    from tests.fusion.cli_helpers import one_line

    with pytest.raises(SystemExit) as exit_:
        main(["run", str(tmp_path / "plan"), "--links", "tcp", "--out", str(tmp_path / "run")])
    assert exit_.value.code == 2
    line = one_line(capsys)
    assert "--links" in line and "'tcp'" in line and "ipc" in line and "curve" in line, line
    assert not (tmp_path / "run").exists()  # refused before anything is made


def test_the_socket_folders_of_killed_runs_are_swept_and_nothing_else(tmp_path):
    """A run killed with SIGKILL cannot remove its socket folder; the next run of this user does, by the folder's
    owner file: a dead owner, or a pid since reused by another process, is swept; a live owner, a folder of another
    pid namespace, one without the owner file (another program's) or one others may enter is left alone."""
    import subprocess
    import sys
    from pathlib import Path

    base = str(tmp_path)
    dead = Path(subprocess.run(
        [sys.executable, "-c", "import sys; from fusion.executors.runtime import local_links as l; "
                               "print(l.private_socket_dir(sys.argv[1]))", base],
        capture_output=True, text=True, check=True).stdout.strip())
    (dead / "abcd1234").mkdir()  # a start's folder, as the launcher makes them
    assert (dead / local_links.OWNER).exists()

    def made(name: str, owner: str | None, mode: int = 0o700) -> Path:
        d = tmp_path / name
        d.mkdir()
        if owner is not None:
            (d / local_links.OWNER).write_text(owner + "\n")
        os.chmod(d, mode)
        return d

    me, started, ns = os.getpid(), local_links._start_time(os.getpid()), local_links._pid_namespace()
    reused = made("fusion-reused", f"{me} 1 {ns}")  # our pid, but another start time: the pid was reused
    other_ns = made("fusion-otherns", "999999 1 pid:[1]")
    foreign = made("fusion-wan-bench", None)  # a benchmark's temporary folder: no owner file
    opened = made("fusion-open", f"999999 1 {ns}", 0o755)
    live = local_links.private_socket_dir(base)  # sweeps first, then makes its own
    try:
        assert not dead.exists() and not reused.exists()
        assert other_ns.exists() and foreign.exists() and opened.exists() and live.exists()
        assert (live / local_links.OWNER).read_text().split() == [str(me), str(started), ns]
        assert local_links.sweep_stale(base) == []  # its own owner (this process) is alive
        assert live.exists()
    finally:
        local_links.remove(live)
