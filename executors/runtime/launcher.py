"""The local cluster launcher: one executor process per CompNode on loopback.

:class:`LocalCluster` starts ``python -m fusion.cli executor PLAN --node P``
for every part of a plan (under an interleaved schedule one process per
device, ``--node P0,P2``: the device's virtual stages), binds a coordinator in
this process, and tears everything down on exit (stop, then terminate, then
kill — every wait has a timeout). Executor logs go to ``RUN/logs/<part>.log``
(``<p0+p2>.log`` for a device's process), Chrome traces to
``RUN/trace/<part>.json``, process ids to ``RUN/pids.json``.

:func:`hand_plan` builds a :class:`~fusion.plan.Plan` from a model and a
hand-written assignment (tests, benchmarks, and plans written by hand).
"""
from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Mapping

from fusion.ir.errors import FusionError
from fusion.executors.runtime import local_links
from fusion.executors.runtime.coordinator import Coordinator, CoordinatorConfig
from fusion.executors.runtime.warm import WarmProcess, WarmServer, can_warm_start

log = logging.getLogger(__name__)


def _dtype_name(v: Any) -> str:
    return str(getattr(v, "dtype", "")).removeprefix("torch.")


def local_cluster_dict(parts: list[str]) -> dict:
    """A cluster of one device per part with no latency and unlimited bandwidth."""
    n = len(parts)
    return {"name": "local", "devices": [{"name": f"local-{i}", "group": "local"} for i in range(n)],
            "delay_s": [[0.0] * n for _ in range(n)], "bandwidth_bps": [[0.0] * n for _ in range(n)]}


def hand_plan(model, assignment: Mapping[str, str], *, devices: Mapping[str, str] | None = None,
              cluster: dict | None = None, schedule: str = "gpipe", micro_batches: int = 1,
              optimizer=None, seed: int = 0, engines: Mapping[str, str] | None = None, predicted: dict | None = None):
    """A plan with a hand-written ``assignment`` (node -> part).

    devices: part -> cluster device name (default: the i-th device of ``cluster`` for the i-th part).
    cluster: a cluster dict in the scenario format (default: :func:`local_cluster_dict`).
    """
    from fusion.ir.boundary import part_order
    from fusion.plan import Part, Plan
    from fusion.plan import OptimizerConfig

    order = part_order(model.graph, assignment)
    cluster = cluster if cluster is not None else local_cluster_dict(order)
    names = [d["name"] for d in cluster["devices"]]
    if devices is None:
        if len(names) < len(order):
            raise FusionError(f"cluster has {len(names)} devices for {len(order)} parts")
        devices = {p: names[i] for i, p in enumerate(order)}
    parts = {p: Part(p, devices[p], engine=(engines or {}).get(p, "torch")) for p in order}
    example = {k: {"shape": [int(s) for s in v.shape], "dtype": _dtype_name(v)} for k, v in model.example.items()}
    plan = Plan(model.graph, cluster, parts, dict(assignment), schedule=schedule, micro_batches=micro_batches,
                optimizer=(optimizer or OptimizerConfig()).to_dict(), seed=seed, predicted=dict(predicted or {}),
                example=example, strategy="manual")
    plan.check()
    return plan


class LocalCluster:
    """Executors on loopback plus a coordinator in this process.

    plan_dir:  a saved plan (``plan.json`` + ``weights.safetensors``).
    run_dir:   logs, traces, checkpoints (``run_dir/checkpoints`` unless the config names one).
    threads:   intra-op threads per executor (default: cores / parts, at least 1).
    part_env:  extra environment variables for the executor of a part (part -> {name: value}),
               e.g. a PYTHONPATH that changes what that process can import.
    report:    called with one line per start-up event (each CompNode up, ready); default: the log.
    curve:     authenticate and encrypt every link with CURVE: fresh key pairs for this run in
               ``run_dir/keys`` (secret files 0600), the executors get theirs with ``--key``; False runs
               plain TCP on loopback (``--insecure``).
    ipc:       link the processes by Unix sockets in a fresh directory of mode 0700 instead of loopback TCP
               (:mod:`~fusion.executors.runtime.local_links`; ``fusion run``'s default, ``--links ipc``): only this
               user's processes can connect, and no cipher runs; ``curve`` is then not used.
    warm:      fork the executors of torch parts from one process that imported torch once
               (:mod:`~fusion.executors.runtime.warm`) where the platform allows; a part with its own environment
               (``part_env``), another engine or another ``python`` gets a process of its own as before.
    """

    def __init__(self, plan_dir: str | Path, run_dir: str | Path, cfg: CoordinatorConfig | None = None, *,
                 threads: int | None = None, trace: bool = True, python: str = sys.executable,
                 executor_args: list[str] | None = None, verbose: int = 1,
                 part_env: Mapping[str, Mapping[str, str]] | None = None,
                 report: Callable[[str], None] | None = None, curve: bool = False, warm: bool = True,
                 ipc: bool = False):
        from fusion.plan import load_plan

        self.plan_dir, self.run_dir = Path(plan_dir), Path(run_dir)
        self.plan = load_plan(self.plan_dir)
        from fusion.executors.runtime.compression import check_plan_codecs

        check_plan_codecs(self.plan)  # an unknown codec is one line here, not an executor's exit status
        self.cfg = cfg or CoordinatorConfig()
        if self.cfg.checkpoint_dir is None:
            self.cfg.checkpoint_dir = str(self.run_dir / "checkpoints")
        n = len(self.plan.lanes())  # executor processes
        self.threads = threads or max(1, (os.cpu_count() or 1) // n)
        self.trace, self.python, self.verbose = trace, python, verbose
        self.executor_args = list(executor_args or [])
        self.part_env = {p: dict(e) for p, e in (part_env or {}).items()}
        self.processes: dict[str, subprocess.Popen | WarmProcess] = {}
        self.coordinator: Coordinator | None = None
        self._logs: list = []
        self.report = report
        self.curve = curve and not ipc
        #: the run's private socket directory (``ipc``), made at the first start; one subfolder per start
        self.ipc, self._sockets, self._start_dir = ipc, None, None
        self._warm = None
        if warm and python == sys.executable and can_warm_start() and any(
                p.engine == "torch" and not self.part_env.get(n) for n, p in self.plan.parts.items()):
            # started now: its imports overlap the coordinator's start and the keys
            self._warm = WarmServer(python, package_root(), self._env())

    def start(self, resume: bool = False) -> int:
        """Spawn the executors and wait until they are ready; returns the first step to run."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "logs").mkdir(exist_ok=True)
        from fusion.executors.runtime.plandigest import plan_digest

        self.cfg.plan_digest = self.cfg.plan_digest or plan_digest(self.plan_dir)
        key_args = self._keys()
        if self.ipc:  # a subfolder per start: a restart's coordinator and executors bind fresh paths
            if self._sockets is None:
                self._sockets = local_links.private_socket_dir()
            self._start_dir = Path(tempfile.mkdtemp(prefix="", dir=self._sockets))
            self.cfg.bind = local_links.ipc_address(self._start_dir, "c")
        self.coordinator = Coordinator(self.plan, self.cfg, self.processes, report=self.report)
        self._addr = self.coordinator.bind()
        self._key_args = key_args
        # DiLoCo replicas that join later (cfg.joins) start when the coordinator admits them
        from fusion.executors.runtime import checkpoint

        late = self.coordinator.late_replicas(checkpoint.latest(self.cfg.checkpoint_dir) if resume else None)
        self.coordinator.spawn = self._spawn
        self._spawn([p for p in self.plan.parts if self.plan.parts[p].replica not in late])
        return self.coordinator.start(resume=resume)

    def _env(self) -> dict[str, str]:
        return {**os.environ, "OMP_NUM_THREADS": str(self.threads), "MKL_NUM_THREADS": str(self.threads),
                "PYTHONUNBUFFERED": "1"}

    def _spawn(self, only: list[str]) -> None:
        """Start the executor processes of the parts in ``only`` (whole lanes) and record their pids."""
        addr, key_args = self._addr, self._key_args
        env = self._env()
        for lane, parts in enumerate(self.plan.lanes().values()):  # one process per part; under interleaved, per device
            if parts[0] not in only:
                continue
            bind = "tcp://127.0.0.1:*"
            if self.ipc:
                bind = local_links.ipc_address(self._start_dir, lane)
            name = ",".join(parts)
            keys = [key_args[p] for p in parts]
            key = keys[0] if len(parts) == 1 or keys[0] == ["--insecure"] else \
                ["--key", ",".join(k[1] for k in keys), *keys[0][2:]]
            argv = [*(["-" + "v" * (self.verbose - 1)] if self.verbose > 1 else []), "executor",
                    str(self.plan_dir), "--node", name, "--coordinator", addr, "--bind", bind,
                    "--threads", str(self.threads), "--peer-timeout", str(self.cfg.peer_timeout_s),
                    *(["--max-message-bytes", str(self.cfg.max_message_bytes)] if self.cfg.max_message_bytes else []),
                    "--fast-exit", *key, *self.executor_args]
            if self.trace:
                argv += ["--trace", ",".join(str(self.run_dir / "trace" / f"{p}.json") for p in parts)]
            log_path = self.run_dir / "logs" / f"{'+'.join(parts)}.log"
            self.coordinator.logs.update(dict.fromkeys(parts, log_path))
            part_env = {k: v for p in parts for k, v in self.part_env.get(p, {}).items()}
            if self._warm is not None and not part_env and all(self.plan.parts[p].engine == "torch" for p in parts):
                proc = self._warm.spawn(argv, env, log_path)
            else:
                f = open(log_path, "ab")
                self._logs.append(f)
                proc = subprocess.Popen([self.python, "-c", _ENTRY, package_root(), *argv], stdout=f,
                                        stderr=subprocess.STDOUT, env={**env, **part_env}, start_new_session=True)
            for p in parts:
                self.processes[p] = proc
        (self.run_dir / "pids.json").write_text(json.dumps({p: pr.pid for p, pr in self.processes.items()}))

    def restart(self) -> int:
        """Kill every executor and start them all again from the latest complete checkpoint (``--max-restarts``).

        Every process is killed with SIGKILL, which also ends a stopped (SIGSTOP) one without continuing
        it first, so a frozen executor can never wake up beside its replacement; the coordinator's sockets
        are released and a new coordinator waits for the new processes. All parts restart, not only the
        failed one: each must reload the same checkpoint (as torchelastic restarts every worker). Returns
        the step the run resumes at (0 when no checkpoint was complete yet)."""
        for proc in {id(pr): pr for pr in self.processes.values()}.values():
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        left = [p for p, rc in _wait_all(self.processes, 10.0).items() if rc is None]
        if left:
            raise FusionError(f"could not kill the executor of {', '.join(left)} to restart it")
        if self.coordinator is not None:
            self.coordinator.close(linger_s=0.0)
        for f in self._logs:
            f.close()
        self._logs.clear()
        return self.start(resume=True)

    def _keys(self) -> dict[str, list[str]]:
        """Each executor's security arguments; with CURVE, fresh keys for this run (the coordinator's set in cfg)."""
        if not self.curve:  # plain TCP on loopback, or Unix sockets only this user can open (ipc)
            return {p: ["--insecure"] for p in self.plan.parts}
        from fusion.executors.runtime.keys import coordinator_run_keys

        self.cfg.security, secrets, public = coordinator_run_keys(self.plan.parts, self.run_dir / "keys")
        return {p: ["--key", str(secrets[p]), "--public-keys", str(public)] for p in self.plan.parts}

    def close(self, graceful: bool = True, timeout_s: float = 10.0) -> dict[str, int | None]:
        """Stop the executors (gracefully when asked), then terminate and kill what is left."""
        if self.coordinator is not None and graceful:
            self.coordinator.stop()
        status = _wait_all(self.processes, timeout_s if graceful else 0.5)
        if graceful and self.trace:  # a long run's traces take a while to write: wait while they still grow
            status = _wait_while_writing(self.processes, status, self.run_dir / "trace", timeout_s)
        for sig, grace in ((signal.SIGTERM, 3.0), (signal.SIGKILL, 3.0)):
            left = [p for p, rc in status.items() if rc is None]
            if not left:
                break
            for p in left:
                try:
                    os.killpg(self.processes[p].pid, sig)
                    if sig == signal.SIGTERM:  # a stopped (SIGSTOP) executor acts on SIGTERM only once continued
                        os.killpg(self.processes[p].pid, signal.SIGCONT)
                except ProcessLookupError:
                    pass
            status.update(_wait_all({p: self.processes[p] for p in left}, grace))
        if self.coordinator is not None:
            self.coordinator.close()
        for f in self._logs:
            f.close()
        self._logs.clear()
        if self._warm is not None:
            self._warm.close()
        if self._sockets is not None:
            local_links.remove(self._sockets)
            self._sockets = None
        return status

    def __enter__(self) -> "LocalCluster":
        return self

    def __exit__(self, et, ev, tb) -> None:
        self.close(graceful=et is None)


#: Executor entry point: import fusion from the folder the launching process imported it from, never from
#: the current directory (``python -m`` would put the cwd first, where a source ``fusion/`` may hide the install).
_ENTRY = "import sys; sys.path[0] = sys.argv.pop(1); sys.argv[0] = 'fusion'; from fusion.cli import main; raise SystemExit(main())"


def package_root() -> str:
    """The folder holding the ``fusion`` package this process runs (site-packages, or a source checkout)."""
    import fusion

    return str(Path(fusion.__file__).resolve().parent.parent)


def _wait_while_writing(processes: Mapping[str, subprocess.Popen | WarmProcess], status: dict[str, int | None], folder: Path,
                        idle_s: float, cap_s: float = 900.0) -> dict[str, int | None]:
    """Wait on for the executors still running after a stop while a file in ``folder`` (their traces) was written to
    within the last ``idle_s`` seconds, at most ``cap_s``: a long run's trace (tens of MB streamed from its spill
    file) can take longer than the stop's grace under load, and was cut off by SIGTERM (issue 28, 10,000 steps)."""
    deadline = time.monotonic() + cap_s
    while any(rc is None for rc in status.values()) and time.monotonic() < deadline:
        try:
            newest = max((f.stat().st_mtime for f in folder.iterdir()), default=0.0)
        except OSError:
            newest = 0.0
        if time.time() - newest > idle_s:
            break  # nothing written for idle_s: the executors are not writing traces, they hang
        left = {p: processes[p] for p, rc in status.items() if rc is None}
        status.update(_wait_all(left, 1.0))
    return status


def _wait_all(processes: Mapping[str, subprocess.Popen | WarmProcess], timeout_s: float) -> dict[str, int | None]:
    deadline = time.monotonic() + timeout_s
    out: dict[str, int | None] = {}
    for p, proc in processes.items():
        try:
            out[p] = proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            out[p] = None
    return out
