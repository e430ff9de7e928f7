"""Launch a plan's CompNodes on an existing Ray cluster (``fusion run PLAN --ray ADDRESS``).

Ray only places processes; the data plane stays ZeroMQ. Each part becomes one Ray actor
(:class:`ExecutorActor`, zero CPUs reserved) scheduled on the node that holds the custom
resource named after the part's device in the cluster file::

    part on device "host-a"  ->  actor resources {"fusion-dev:host-a": 1 / (parts on host-a)}

so a node started with ``ray start ... --resources='{"fusion-dev:host-a": 1}'`` hosts every part the
plan puts on ``host-a``, and a node without it hosts none. The actor writes the plan folder (shipped
once through Ray's object store) into a temporary folder of its node, then starts the same executor
entry point :class:`~fusion.executors.runtime.launcher.LocalCluster` starts (``fusion executor PLAN
--node P``) as its child process, bound to its node's IP (``tcp://NODE_IP:*``). The coordinator runs
in this process, bound to this host's IP as Ray sees it. The driver pulls every executor's log into
``RUN/logs/<part>.log`` twice a second, fetches the Chrome traces at the end, and on exit, error or
Ctrl-C stops the executors (stop, then SIGTERM, then SIGKILL), removes the temporary folders, kills the
actors and disconnects from Ray. Ray is imported only here, only when used.
"""
from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

from fusion.ir.errors import FusionError
from fusion.executors.runtime import faults
from fusion.executors.runtime.coordinator import Coordinator, CoordinatorConfig
from fusion.executors.runtime.keys import PUBLIC_KEYS_FILE
from fusion.executors.runtime.launcher import _ENTRY, package_root

log = logging.getLogger(__name__)

#: prefix of the Ray custom resource that marks the node(s) of a cluster-file device
RESOURCE_PREFIX = "fusion-dev:"
INSTALL_HINT = "pip install 'fusion[ray]'"
#: the largest chunk of log one poll brings back
LOG_CHUNK = 1 << 20


def device_resource(device: str) -> str:
    """The Ray custom resource naming the node(s) of cluster device ``device``."""
    return RESOURCE_PREFIX + device


def part_resources(devices: Mapping[str, str]) -> dict[str, dict[str, float]]:
    """part -> the Ray resources its actor asks for (parts -> their devices).

    A device's parts share one unit, so one node with ``{"fusion-dev:DEV": 1}`` holds all of them.
    """
    count = Counter(devices.values())
    return {p: {device_resource(d): 1.0 / count[d]} for p, d in devices.items()}


def import_ray():
    """``ray``, or a FusionError saying how to install it."""
    try:
        import ray
    except ImportError:
        raise FusionError(f"--ray needs Ray, which is not installed here: {INSTALL_HINT}") from None
    return ray


def missing_devices(devices: Mapping[str, str], resources: Mapping[str, float]) -> list[str]:
    """The devices (sorted) whose resource the Ray cluster (``ray.cluster_resources()``) lacks."""
    return sorted({d for d in devices.values() if resources.get(device_resource(d), 0) <= 0})


class ExecutorActor:
    """One CompNode on a Ray node (a Ray actor; ``ray.remote`` is applied by :class:`RayCluster`).

    Holds the executor child process, its log file and a temporary folder with the plan.
    """

    def __init__(self, part: str):
        self.part = part
        self.dir: Path | None = None
        self.proc: subprocess.Popen | None = None
        self.log_path: Path | None = None
        self.trace_path: Path | None = None

    def node(self) -> dict[str, Any]:
        """Where this actor runs: ``{"host", "node_id"}``."""
        import ray

        return {"host": socket.gethostname(), "node_id": ray.get_runtime_context().get_node_id()}

    def start(self, files: Mapping[str, bytes], argv: list[str], env: Mapping[str, str], ip: str,
              keys: Mapping[str, bytes] | None = None) -> int:
        """Write the plan ``files`` (relative path -> bytes) here and start the executor; returns its pid.

        ``keys``: this part's CURVE key files (file name -> bytes), written owner-only into ``{keys}``.
        In ``argv``, ``{plan}``, ``{keys}``, ``{trace}`` and ``{ip}`` become the plan folder, the key folder,
        a trace file and ``ip`` (this node's address as registered with Ray).
        """
        self.dir = Path(tempfile.mkdtemp(prefix=f"fusion-{self.part}-"))
        key_dir = self.dir / "keys"
        if keys:
            key_dir.mkdir(mode=0o700)
            for name, data in keys.items():
                if "/" in name or name.startswith("."):
                    raise FusionError(f"key file name {name!r} is not a plain file name")
                fd = os.open(key_dir / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                with os.fdopen(fd, "wb") as f:
                    f.write(data)
        plan = self.dir / "plan"
        for rel, data in files.items():
            target = (plan / rel).resolve()
            if plan.resolve() not in target.parents:
                raise FusionError(f"plan file {rel!r} is outside the plan folder")
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data)
        self.trace_path = self.dir / "trace.json"
        self.log_path = self.dir / "executor.log"
        subst = {"{plan}": str(plan), "{keys}": str(key_dir), "{trace}": str(self.trace_path), "{ip}": ip}
        cmd = [sys.executable, "-c", _ENTRY, package_root()]
        for a in argv:
            for k, v in subst.items():
                a = a.replace(k, v)
            cmd.append(a)
        with open(self.log_path, "ab") as f:
            self.proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env={**os.environ, **env},
                                         start_new_session=True, cwd=self.dir)
        return self.proc.pid

    def poll(self) -> int | None:
        return self.proc.poll() if self.proc is not None else None

    def read_log(self, offset: int) -> tuple[bytes, int | None]:
        """(the executor's log from byte ``offset`` on, at most 1 MiB; its exit status or None)."""
        rc = self.poll()
        if self.log_path is None or not self.log_path.exists():
            return b"", rc
        with open(self.log_path, "rb") as f:
            f.seek(offset)
            return f.read(LOG_CHUNK), rc

    def wait(self, timeout_s: float) -> int | None:
        """The executor's exit status once it exits, None if it still runs after ``timeout_s``."""
        if self.proc is None:
            return None
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            return None

    def signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                pass

    def trace(self) -> bytes | None:
        """The executor's Chrome trace (written when it stops), if any."""
        if self.trace_path is not None and self.trace_path.exists():
            return self.trace_path.read_bytes()
        return None

    def cleanup(self) -> None:
        """Kill what is left of the executor and remove the temporary folder."""
        self.signal(signal.SIGKILL)
        if self.proc is not None:
            try:
                self.proc.wait(3.0)
            except subprocess.TimeoutExpired:
                pass
        if self.dir is not None:
            shutil.rmtree(self.dir, ignore_errors=True)


@dataclass
class RayProcess:
    """What the coordinator polls for a part placed on Ray: the executor's pid and last known status.

    ``returncode`` is refreshed by :class:`RayCluster`'s log thread (the coordinator polls every 50 ms
    under its lock, too often for a remote call).
    """

    pid: int
    node_ip: str
    returncode: int | None = None

    def poll(self) -> int | None:
        return self.returncode


def plan_files(plan_dir: Path) -> dict[str, bytes]:
    """Every file under a plan folder (relative path -> bytes): what each Ray node writes back."""
    return {str(f.relative_to(plan_dir)): f.read_bytes() for f in sorted(plan_dir.rglob("*"))
            if f.is_file() and not f.name.endswith(".tmp")}


class RayCluster:
    """Executors as Ray actors on the nodes matching their devices, plus a coordinator in this process.

    Same use as :class:`~fusion.executors.runtime.launcher.LocalCluster`: ``start()`` returns the first
    step, ``coordinator`` trains, ``restart()`` starts every part again from the latest checkpoint
    (``--max-restarts``), ``close(graceful)`` tears everything down.

    address:   the Ray cluster (``HOST:PORT`` of the head's GCS, ``auto``, or ``ray://HOST:PORT``).
    plan_dir:  a saved plan; its files are shipped to every node through Ray's object store.
    run_dir:   logs, traces and checkpoints on this host (executors write checkpoints to the same path
               on their own disks, as in the manual two-host recipe).
    threads:   intra-op threads per executor (default: unchanged, i.e. the node's cores).
    connect_timeout_s: longest wait to connect to Ray and for every actor to be placed and started.
    """

    def __init__(self, address: str, plan_dir: str | Path, run_dir: str | Path, cfg: CoordinatorConfig | None = None,
                 *, threads: int | None = None, trace: bool = True, executor_args: list[str] | None = None,
                 verbose: int = 1, report: Callable[[str], None] | None = None, connect_timeout_s: float = 60.0,
                 curve: bool = False):
        from fusion.plan import load_plan

        self.address = address
        self.plan_dir, self.run_dir = Path(plan_dir), Path(run_dir)
        self.plan = load_plan(self.plan_dir)
        shared = [ps for ps in self.plan.lanes().values() if len(ps) > 1]
        if shared:  # an actor runs one part; a device's virtual stages must share one process
            raise FusionError(f"--ray runs one part per actor; the interleaved schedule puts {','.join(shared[0])} in one "
                              "process: run this plan with `fusion run PLAN` on one host, or with `fusion coordinator` and "
                              f"`fusion executor --node {','.join(shared[0])}` on each host")
        self.cfg = cfg or CoordinatorConfig()
        if self.cfg.checkpoint_dir is None:
            self.cfg.checkpoint_dir = str(self.run_dir / "checkpoints")
        self.threads, self.trace, self.verbose = threads, trace, verbose
        self.executor_args = list(executor_args or [])
        self.report = report or log.info
        self.connect_timeout_s = connect_timeout_s
        self.curve = curve  # CURVE on every link: fresh keys in RUN/keys, each actor gets its own pair
        self.devices = {p: part.device for p, part in self.plan.parts.items()}
        self.processes: dict[str, RayProcess] = {}
        self.actors: dict[str, Any] = {}
        self.coordinator: Coordinator | None = None
        self._ray = None
        self._offsets: dict[str, int] = {}
        self._log_lock = threading.Lock()
        self._stop_logs = threading.Event()
        self._log_thread: threading.Thread | None = None

    # -- start ----------------------------------------------------------------------
    def connect(self):
        """Connect to the Ray cluster and check it has a node for every device of the plan."""
        ray = import_ray()
        try:
            ray.init(address=self.address, log_to_driver=False, logging_level=logging.WARNING,
                     configure_logging=False, namespace="fusion")
        except Exception as e:  # ConnectionError, RuntimeError, ...: Ray's own message, on one line
            raise FusionError(f"--ray {self.address}: cannot connect to the Ray cluster: {e}") from None
        self._ray = ray
        resources = ray.cluster_resources()
        missing = missing_devices(self.devices, resources)
        if missing:
            ray.shutdown()
            self._ray = None
            have = sorted(k for k in resources if k.startswith(RESOURCE_PREFIX))
            example = device_resource(missing[0])
            raise FusionError(f"--ray {self.address}: no Ray node has the resource {device_resource(missing[0])!r} "
                              f"for device {missing[0]!r}" + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
                              + f"; start that device's node with `ray start --address=HEAD:PORT "
                              f"--resources='{{\"{example}\": 1}}'` (the cluster has: {', '.join(have) or 'none'})")
        return ray

    def start(self, resume: bool = False) -> int:
        """Place the actors, start the executors, wait until the coordinator has them all; returns the first step."""
        ray = self._ray or self.connect()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "logs").mkdir(exist_ok=True)
        node_ip = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes() if n.get("Alive")}
        if self.cfg.bind == CoordinatorConfig.bind:  # the loopback default: executors on other nodes need a real IP
            here = node_ip.get(ray.get_runtime_context().get_node_id())  # None for a Ray Client (ray://) driver
            self.cfg.bind = f"tcp://{here or socket.gethostbyname(socket.gethostname())}:*"
        from fusion.executors.runtime.plandigest import plan_digest

        self.cfg.plan_digest = self.cfg.plan_digest or plan_digest(self.plan_dir)
        keys = self._keys()  # sets the coordinator's security before it binds
        self.coordinator = Coordinator(self.plan, self.cfg, self.processes, report=self.report)
        addr = self.coordinator.bind()
        actor_cls = ray.remote(num_cpus=0, max_restarts=0)(ExecutorActor)
        resources = part_resources(self.devices)
        for p in self.plan.parts:
            self.actors[p] = actor_cls.options(resources=resources[p]).remote(p)
        nodes = self._get({p: a.node.remote() for p, a in self.actors.items()}, self.connect_timeout_s,
                          "being placed on the Ray nodes of their devices")
        files = ray.put(plan_files(self.plan_dir))
        env = {"PYTHONUNBUFFERED": "1", **({"OMP_NUM_THREADS": str(self.threads), "MKL_NUM_THREADS": str(self.threads)}
                                           if self.threads else {}),
               # FUSION_TEST_FAULT reaches the executors as it does those of a local run (only this variable:
               # an executor otherwise has its Ray node's environment, not this process's)
               **({faults.ENV: os.environ[faults.ENV]} if os.environ.get(faults.ENV) else {})}
        node_ip.update({n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes() if n.get("Alive")})
        ips = {p: node_ip[n["node_id"]] for p, n in nodes.items()}
        pids = self._get({p: a.start.remote(files, self._argv(p, addr), env, ips[p], keys.get(p))
                          for p, a in self.actors.items()},
                         self.connect_timeout_s, "writing the plan and starting the executor")
        for p in self.plan.parts:
            n = nodes[p]
            self.processes[p] = RayProcess(pids[p], ips[p])
            self.report(f"{p} placed on Ray node {ips[p]} (host {n['host']}, node id {n['node_id'][:12]}, device "
                        f"{self.devices[p]}): executor pid {pids[p]}")
        self._log_thread = threading.Thread(target=self._stream_logs, name="ray-logs", daemon=True)
        self._log_thread.start()
        return self.coordinator.start(resume=resume)

    def restart(self) -> int:
        """Kill every executor and start them all again on new actors from the latest complete checkpoint
        (``fusion run --ray ... --max-restarts N``, as :meth:`LocalCluster.restart
        <fusion.executors.runtime.launcher.LocalCluster.restart>` does on one host).

        Every executor is SIGKILLed by its actor (a stopped one too, never continued first), the logs so far
        are pulled, the actors are killed and the coordinator's sockets released; :meth:`start` then places
        new actors by their device's resource, on whichever live node declares it (so a second node started
        with the same ``fusion-dev:<device>`` resource is the spare of a lost one), and every part reloads the
        newest complete checkpoint. The Ray connection is kept. Returns the step the run resumes at."""
        ray = self._ray
        for a in self.actors.values():
            a.signal.remote(int(signal.SIGKILL))
        refs = {p: a.wait.remote(10.0) for p, a in self.actors.items()}
        left = []
        for p, r in refs.items():
            try:
                if ray.get(r, timeout=15.0) is None:
                    left.append(p)
            except Exception:  # the actor (or its node) is gone, and its executor with it
                pass
        if left:
            raise FusionError(f"could not kill the executor of {', '.join(sorted(left))} to restart it")
        self._stop_logs.set()
        if self._log_thread is not None:
            self._log_thread.join(timeout=15.0)
            self._log_thread = None
        self._stop_logs = threading.Event()  # for the next start's log thread
        try:
            self._pull_logs()
        except Exception as e:
            log.warning("the executor logs before the restart could not all be fetched: %s", e)
        self._free_actors(ray)
        if self.coordinator is not None:
            self.coordinator.close(linger_s=0.0)
        self.actors.clear()
        self.processes.clear()  # (the dict the next coordinator polls)
        self._offsets.clear()  # the new actors' log files start empty; RUN/logs/<part>.log is appended to
        return self.start(resume=True)

    def _keys(self) -> dict[str, dict[str, bytes]]:
        """With CURVE: fresh key pairs for this run in RUN/keys (the coordinator's in ``cfg.security``) and
        each part's own secret key plus the public key list, as the bytes its actor writes (they travel
        through Ray, like the plan). Without: nothing."""
        if not self.curve:
            return {}
        from fusion.executors.runtime.keys import coordinator_run_keys

        self.cfg.security, secrets, public = coordinator_run_keys(self.plan.parts, self.run_dir / "keys")
        pub = public.read_bytes()
        return {p: {f"{p}.secret": secrets[p].read_bytes(), PUBLIC_KEYS_FILE: pub} for p in self.plan.parts}

    def _argv(self, part: str, coordinator: str) -> list[str]:
        argv = [*(["-" + "v" * (self.verbose - 1)] if self.verbose > 1 else []), "executor", "{plan}", "--node", part,
                "--coordinator", coordinator, "--bind", "tcp://{ip}:*", "--peer-timeout", str(self.cfg.peer_timeout_s),
                "--startup-timeout", str(self.cfg.startup_timeout_s),
                *(["--max-message-bytes", str(self.cfg.max_message_bytes)] if self.cfg.max_message_bytes else []),
                *(["--threads", str(self.threads)] if self.threads else []), "--fast-exit",
                *(["--key", f"{{keys}}/{part}.secret", "--public-keys", f"{{keys}}/{PUBLIC_KEYS_FILE}"]
                  if self.curve else ["--insecure"]), *self.executor_args]
        return argv + (["--trace", "{trace}"] if self.trace else [])

    def _get(self, refs: Mapping[str, Any], timeout_s: float, what: str) -> dict[str, Any]:
        """``ray.get`` of one call per part, with a timeout and a one-line error naming the parts."""
        ray = self._ray
        by_ref = {r: p for p, r in refs.items()}
        ready, pending = ray.wait(list(refs.values()), num_returns=len(refs), timeout=timeout_s)
        if pending:
            late = sorted(by_ref[r] for r in pending)
            raise FusionError(f"--ray {self.address}: {', '.join(late)} not done {what} after {timeout_s:.0f} s "
                              f"(is the node of device {self.devices[late[0]]!r} alive, with enough memory?)")
        out = {}
        for r in ready:
            try:
                out[by_ref[r]] = ray.get(r, timeout=timeout_s)
            except Exception as e:
                raise FusionError(f"--ray: {by_ref[r]} failed {what}: {str(e).strip().splitlines()[-1]}") from None
        return out

    # -- logs -----------------------------------------------------------------------
    def _pull_logs(self) -> None:
        """Append what each executor logged since the last pull to RUN/logs/<part>.log; refresh exit statuses."""
        ray = self._ray
        with self._log_lock:
            refs = {p: a.read_log.remote(self._offsets.get(p, 0)) for p, a in self.actors.items()}
            for p, r in refs.items():
                try:
                    data, rc = ray.get(r, timeout=10.0)
                except Exception as e:  # the actor (or its node) died: the coordinator names the part
                    proc = self.processes.get(p)
                    if proc is not None and proc.returncode is None:
                        proc.returncode = -1
                        log.warning("%s: its Ray actor is gone (%s)", p, type(e).__name__)
                    continue
                if data:
                    with open(self.run_dir / "logs" / f"{p}.log", "ab") as f:
                        f.write(data)
                    self._offsets[p] = self._offsets.get(p, 0) + len(data)
                if rc is not None and p in self.processes:
                    self.processes[p].returncode = rc

    def _stream_logs(self) -> None:
        while not self._stop_logs.wait(0.5):
            try:
                self._pull_logs()
            except Exception as e:  # never let the log thread die silently
                log.warning("pulling executor logs failed: %s", e)

    # -- teardown -------------------------------------------------------------------
    def close(self, graceful: bool = True, timeout_s: float = 10.0) -> dict[str, int | None]:
        """Stop the executors (gracefully when asked; then SIGTERM, SIGKILL), fetch logs and traces, free Ray."""
        ray = self._ray
        status: dict[str, int | None] = {p: None for p in self.actors}
        if self.coordinator is not None and graceful:
            self.coordinator.stop()
        if ray is not None and self.actors:
            wait = timeout_s if graceful else 0.5
            for sig, grace in ((None, wait), (signal.SIGTERM, 3.0), (signal.SIGKILL, 3.0)):
                left = [p for p, rc in status.items() if rc is None]
                if not left:
                    break
                if sig is not None:
                    for p in left:
                        self.actors[p].signal.remote(int(sig))
                refs = {p: self.actors[p].wait.remote(grace) for p in left}
                for p, r in refs.items():
                    try:
                        status[p] = ray.get(r, timeout=grace + 5.0)
                    except Exception:
                        status[p] = -1 if sig == signal.SIGKILL else None
            self._stop_logs.set()
            if self._log_thread is not None:
                self._log_thread.join(timeout=15.0)
            try:
                self._pull_logs()
            except Exception as e:
                log.warning("the last executor logs could not be fetched: %s", e)
            if self.trace:
                self._fetch_traces()
            self._free_actors(ray)
        if self.coordinator is not None:
            self.coordinator.close()
        if ray is not None:
            ray.shutdown()
            self._ray = None
        self.actors.clear()
        return status

    def _free_actors(self, ray) -> None:
        """Each actor removes its temporary plan folder, then is killed; best effort (a lost node's actor is gone)."""
        for a in self.actors.values():
            try:
                ray.get(a.cleanup.remote(), timeout=10.0)
            except Exception:
                pass
            try:
                ray.kill(a)
            except Exception:
                pass

    def _fetch_traces(self) -> None:
        ray = self._ray
        refs = {p: a.trace.remote() for p, a in self.actors.items()}
        for p, r in refs.items():
            try:
                data = ray.get(r, timeout=30.0)
            except Exception as e:
                log.warning("%s: no trace fetched (%s)", p, type(e).__name__)
                continue
            if data:
                (self.run_dir / "trace").mkdir(exist_ok=True)
                (self.run_dir / "trace" / f"{p}.json").write_bytes(data)

    def __enter__(self) -> "RayCluster":
        return self

    def __exit__(self, et, ev, tb) -> None:
        self.close(graceful=et is None)
