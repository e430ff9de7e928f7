"""`fusion run ... --ray ADDRESS` on a real two-node Ray cluster started on this host.

The head node holds the resource of device host-a, the second node that of host-b; a two-part plan must
put part0 on the head and part1 on the second node, train over ZeroMQ, and give the same losses and weights
as `fusion run` without Ray, also when part1's executor is killed and `--max-restarts` starts both again. Both nodes run on this host (see ``ray_cluster``). Skips, saying why, where Ray is not installed or its nodes cannot start.
Each node is `ray start --block` in a session of its own, ended by its process group id (never
`ray stop`, which would end every Ray process of the machine).
"""
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest

from fusion.executors.runtime.faults import ENV as FAULT_ENV
from fusion.executors.runtime.ray_cluster import device_resource, missing_devices, part_resources
from tests.fusion.cli_helpers import free_ports, sigint_default

ROOT = Path(__file__).resolve().parents[2]
MODEL = str(ROOT / "examples" / "models" / "gpt.py") + ":tiny"
CLUSTER = str(ROOT / "examples" / "clusters" / "two-hosts.yaml")  # devices host-a and host-b


def test_part_resources_share_one_unit_per_device():
    """The mapping: a device's parts split one unit of fusion-dev:<device> (one node holds them all)."""
    res = part_resources({"part0": "cpu-0", "part1": "cpu-1", "part2": "cpu-1"})
    assert res == {"part0": {"fusion-dev:cpu-0": 1.0}, "part1": {"fusion-dev:cpu-1": 0.5},
                   "part2": {"fusion-dev:cpu-1": 0.5}}
    assert missing_devices({"part0": "cpu-0", "part1": "gpu-a"}, {device_resource("cpu-0"): 1.0, "CPU": 2.0}) == ["gpu-a"]


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
            "OMP_NUM_THREADS": "1", "RAY_USAGE_STATS_ENABLED": "0"}


def _fusion(*args: str, cwd: Path, timeout: float = 150, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fusion.cli", *args], cwd=cwd, env={**_env(), **(env or {})},
                          capture_output=True, text=True, timeout=timeout)


def test_ray_missing_says_how_to_install(tmp_path):
    """Without ray importable, --ray is one line naming the extra, exit 2 (ray hidden by a shadowing module)."""
    shadow = tmp_path / "shadow"
    shadow.mkdir()
    (shadow / "ray.py").write_text("raise ImportError('no ray here')\n")
    env = {**_env(), "PYTHONPATH": os.pathsep.join([str(shadow), str(ROOT)])}
    r = subprocess.run([sys.executable, "-m", "fusion.cli", "run", MODEL, "--cluster", CLUSTER, "--ray", "127.0.0.1:1",
                        "--out", str(tmp_path / "run")], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().splitlines() == ["fusion run: error: --ray needs Ray, which is not installed here: "
                                             "pip install 'fusion[ray]'"]
    assert not (tmp_path / "run").exists()


def test_ray_address_where_no_head_answers_is_one_line(tmp_path):
    """Nothing listening at --ray HOST:PORT: one line naming it and how to start a head, before any compile."""
    pytest.importorskip("ray", reason="Ray is not installed (pip install 'fusion[ray]')")
    (port,) = free_ports(1)
    r = _fusion("run", MODEL, "--cluster", CLUSTER, "--ray", f"127.0.0.1:{port}", "--out", str(tmp_path / "run"),
                cwd=tmp_path, timeout=60)
    assert r.returncode == 2, r.stderr
    (line,) = r.stderr.strip().splitlines()
    assert line.startswith(f"fusion run: error: --ray 127.0.0.1:{port}: no Ray head answers there") and \
        f"ray start --head --port={port}" in line, line
    assert not (tmp_path / "run").exists()
    r = _fusion("run", MODEL, "--cluster", CLUSTER, "--ray", "headnode", cwd=tmp_path, timeout=60)
    assert r.returncode == 2 and "expected HOST:PORT" in r.stderr, r.stderr


def _stop(proc: subprocess.Popen) -> None:
    """End one `ray start --block` and every process it started (its own session), by process group id."""
    for sig, grace in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            continue
        if sig == signal.SIGTERM:  # the leader left; make sure its children did too
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return


def _node(args: list[str], log: Path, env: dict) -> subprocess.Popen:
    ray_bin = shutil.which("ray") or str(Path(sys.executable).parent / "ray")
    with open(log, "wb") as f:
        return subprocess.Popen([ray_bin, "start", "--block", *args], stdout=f, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)


def _wait_nodes(address: str, n: int, procs: list, logs: list[Path], timeout_s: float) -> None:
    """Until ``n`` nodes are alive (asked with `ray status`), or skip with the reason."""
    deadline = time.monotonic() + timeout_s
    ray_bin = shutil.which("ray") or str(Path(sys.executable).parent / "ray")
    while time.monotonic() < deadline:
        for p, log in zip(procs, logs):
            if p.poll() is not None:
                pytest.skip(f"a Ray node could not start (exit {p.returncode}): {log.read_text()[-400:]}")
        try:
            r = subprocess.run([ray_bin, "status", "--address", address], capture_output=True, text=True,
                               timeout=20, env=_env())
            if r.returncode == 0 and r.stdout.count("node_") >= n:
                return
        except subprocess.TimeoutExpired:
            pass
        time.sleep(1.0)
    pytest.skip(f"the local Ray cluster did not come up within {timeout_s:.0f} s")


@pytest.fixture(scope="module")
def ray_cluster():
    """A head with fusion-dev:host-a and a second node with fusion-dev:host-b, both on this host.

    (On Linux Ray registers a node under the host's own IP even when told 127.0.0.1, so the address is
    127.0.0.1 and the nodes' IP is the host's: all traffic stays on this machine.)
    """
    pytest.importorskip("ray", reason="Ray is not installed (pip install 'fusion[ray]')")
    temp = Path(tempfile.mkdtemp(prefix="fray", dir="/tmp"))  # short: Ray's socket paths have a length limit
    gcs, agent0, agent1, grpc0, grpc1, metrics0, metrics1, rt0, rt1 = free_ports(9)
    address = f"127.0.0.1:{gcs}"
    common = ["--num-cpus=1", "--object-store-memory=100000000",
              "--disable-usage-stats"]
    env = _env()
    procs, logs = [], [temp / "head.log", temp / "node1.log"]
    try:
        procs.append(_node(["--head", f"--port={gcs}", "--include-dashboard=false",
                            f"--temp-dir={temp}", f"--dashboard-agent-listen-port={agent0}",
                            f"--dashboard-agent-grpc-port={grpc0}", f"--metrics-export-port={metrics0}",
                            f"--runtime-env-agent-port={rt0}",
                            "--resources=" + json.dumps({device_resource("host-a"): 1}), *common], logs[0], env))
        _wait_nodes(address, 1, procs, logs, 60)
        procs.append(_node([f"--address={address}", f"--dashboard-agent-listen-port={agent1}",
                            f"--dashboard-agent-grpc-port={grpc1}", f"--metrics-export-port={metrics1}",
                            f"--runtime-env-agent-port={rt1}",
                            "--resources=" + json.dumps({device_resource("host-b"): 1}), *common], logs[1], env))
        _wait_nodes(address, 2, procs, logs, 60)
        yield address
    finally:
        for p in reversed(procs):
            _stop(p)
        shutil.rmtree(temp, ignore_errors=True)


def _rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _final(run: Path) -> dict:
    from safetensors.numpy import load_file

    return load_file(str(run / "final.safetensors"))


def ray_recipe(md: Path) -> list[str]:
    """The lines of ``md``'s code block that holds `--ray` (the real-cluster recipe), comments dropped."""
    for m in re.finditer(r"```[a-z]*\n(.*?)```", md.read_text(), re.S):
        lines = [ln.strip() for ln in m.group(1).replace("\\\n", " ").splitlines()]
        lines = [shlex.join(shlex.split(ln, comments=True)) for ln in lines if ln and not ln.startswith("#")]
        if any("--ray" in ln for ln in lines):
            return lines
    raise AssertionError(f"{md.name} has no --ray block")


def test_the_ray_recipe_is_the_one_tested():
    """docs/runtime.md's recipe starts one node per device of two-hosts.yaml; docs/running.md shows the same commands."""
    doc = ray_recipe(ROOT / "docs" / "runtime.md")
    starts = [ln for ln in doc if ln.startswith("ray start")]
    assert len(starts) == 2 and device_resource("host-a") in starts[0] and device_resource("host-b") in starts[1]
    assert [ln.split()[1] for ln in doc if ln.startswith("fusion ")] == ["compile", "run"]
    running = ray_recipe(ROOT / "docs" / "running.md")
    assert [ln for ln in running if ln.startswith("fusion ")] == [ln for ln in doc if ln.startswith("fusion ")]


def test_run_on_a_two_node_ray_cluster_equals_local_run(request, tmp_path):
    """docs/runtime.md's recipe as written (address, --out, --steps 5 substituted; one thread, no progress bar,
    a checkpoint every 2 steps) against the same `fusion run` without `--ray`. The Ray run also has
    `--max-restarts 1` and FUSION_TEST_FAULT: part1's executor SIGKILLs itself at step 3, RayCluster.restart
    places both parts on new actors, they reload the checkpoint of step 2, and the run still ends with the
    local run's losses and weights, bit for bit."""
    pytest.importorskip("ray", reason="Ray is not installed (pip install 'fusion[ray]')")
    t0 = time.monotonic()
    compile_cmd, run_cmd = [shlex.split(ln) for ln in ray_recipe(ROOT / "docs" / "runtime.md") if ln.startswith("fusion ")]
    shutil.copytree(ROOT / "examples", tmp_path / "examples", ignore=shutil.ignore_patterns("__pycache__"))
    r = _fusion(*compile_cmd[1:], cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    plan = tmp_path / compile_cmd[compile_cmd.index("-o") + 1]
    parts = json.loads((plan / "plan.json").read_text())["parts"]
    assert sorted(p["device"] for p in parts.values()) == ["host-a", "host-b"], parts

    def as_here(out: str, ray: str | None) -> list[str]:
        cmd = list(run_cmd[1:])
        cmd[cmd.index("--steps") + 1] = "5"
        cmd[cmd.index("--out") + 1] = str(tmp_path / out)
        i = cmd.index("--ray")
        if ray:
            cmd[i + 1] = ray
        else:
            del cmd[i:i + 2]
        return [*cmd, "--threads", "1", "--no-progress", "--checkpoint-every", "2",
                *(["--max-restarts", "1"] if ray else [])]

    local = subprocess.Popen([sys.executable, "-m", "fusion.cli", *as_here("local", None)], cwd=tmp_path, env=_env(),
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        address = request.getfixturevalue("ray_cluster")
        t_ray = time.monotonic()
        marker = tmp_path / "fired-part1"  # (the executor on the Ray node creates it: the same host here)
        on_ray = _fusion(*as_here("ray", address), cwd=tmp_path, timeout=240,
                         env={FAULT_ENV: f"part1:3:KILL:{marker}"})
        wall = time.monotonic() - t_ray
        _, local_err = local.communicate(timeout=120)
    finally:
        if local.poll() is None:
            local.kill()
            local.wait(10)
    assert local.returncode == 0, local_err
    assert on_ray.returncode == 0, on_ray.stderr
    assert marker.exists(), on_ray.stderr  # the fault reached the executor on its Ray node and fired
    assert "CompNode 'part1' failed" in on_ray.stderr and "restart 1 of 1" in on_ray.stderr, on_ray.stderr
    rows, local_rows = _rows(tmp_path / "ray"), _rows(tmp_path / "local")
    events = [r for r in rows if "event" in r]
    assert [(e["event"], e["part"], e["resumed_step"]) for e in events] == [("restart", "part1", 2)], events
    # 3, or 2 when the SIGKILL at the start of step 3 (sent ahead, --steps-ahead 1) took part1's unsent done of step 2
    # with it (tests/executors/runtime/test_restart.py says more); the checkpoint and the bits are the same either way
    assert events[0]["failed_step"] in (2, 3), events
    steps = [r for r in rows if "event" not in r]
    assert [r["step"] for r in steps] == list(range(5)), rows  # each step exactly once
    assert [r["loss"] for r in steps] == [r["loss"] for r in local_rows], (steps, local_rows)
    fr, fl = _final(tmp_path / "ray"), _final(tmp_path / "local")
    assert set(fr) == set(fl)
    for k in fl:  # restarted on new actors from the checkpoint: the same bits as the local run
        np.testing.assert_array_equal(fr[k], fl[k], err_msg=k)
    # each part on the node holding its device's resource, announced as it is placed
    placed = re.findall(r"(part\d) placed on Ray node [\d.]+ \(host \S+, node id (\w+), device", on_ray.stderr)
    nodes = dict(placed)
    assert set(nodes) == {"part0", "part1"} and nodes["part0"] != nodes["part1"], on_ray.stderr
    assert len(placed) == 4 and dict(placed[:2]) == nodes, placed  # the restart: on the same devices' nodes
    run = tmp_path / "ray"
    for p in ("part0", "part1"):  # logs streamed back, traces fetched, the merged trace written
        assert "said hello to the coordinator" in (run / "logs" / f"{p}.log").read_text()
        assert json.loads((run / "trace" / f"{p}.json").read_text())
    assert (run / "trace.json").exists() and (run / "final.safetensors").exists()
    pids = list(map(int, re.findall(r"executor pid (\d+)", on_ray.stderr)))
    assert len(pids) == 4, on_ray.stderr
    for pid in pids:  # nothing outlives the run, the executors killed by the restart included
        assert not _alive(pid), pid
    print(f"fusion run --ray: 5 steps and one restart in {wall:.1f} s (restart line: {events[0]}); "
          f"the whole test {time.monotonic() - t0:.1f} s")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is gone for our purposes
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def test_ray_cluster_without_the_device_resource_is_one_line(ray_cluster, tmp_path):
    """A plan for devices no Ray node declares: exit 2, naming the resource and how to start its node."""
    r = _fusion("run", MODEL, "--cluster", str(ROOT / "examples" / "clusters" / "local-4-two-sites.yaml"),
                "--strategy", "equal-flops", "--steps", "2", "--out", str(tmp_path / "run"), "--ray", ray_cluster,
                cwd=tmp_path, timeout=120)
    assert r.returncode == 2, r.stderr
    err = r.stderr.strip().splitlines()[-1]
    assert err.startswith("fusion run: error: --ray ") and "'fusion-dev:cpu-0'" in err and "ray start" in err, err
    assert "fusion-dev:host-a" in err  # what the cluster does have


def test_ctrl_c_tears_the_ray_run_down(ray_cluster, tmp_path):
    """SIGINT while the CompNodes start on their Ray nodes: exit 130, no executor left running.

    (Interrupted during start-up, the costliest moment to leave things behind and the quickest to reach
    on a loaded host; the end-of-run teardown is checked by the run above.)
    """
    plan = tmp_path / "tiny.plan"
    r = _fusion("compile", MODEL, "--cluster", CLUSTER, "--strategy", "equal-flops", "-o", str(plan), cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    proc = subprocess.Popen([sys.executable, "-m", "fusion.cli", "run", str(plan), "--steps", "100000", "--threads", "1",
                             "--out", str(tmp_path / "run"), "--no-progress", "--ray", ray_cluster], cwd=tmp_path,
                            env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            preexec_fn=sigint_default)
    lines = []
    try:
        deadline = time.monotonic() + 120
        for line in proc.stderr:  # ends when the process closes stderr
            lines.append(line)
            if "part1 placed on Ray node" in line or time.monotonic() > deadline:
                break
        time.sleep(2.0)  # the executors are running Python by now
        pids = list(map(int, re.findall(r"executor pid (\d+)", "".join(lines))))
        assert len(pids) == 2 and all(_alive(p) for p in pids), "".join(lines)
        proc.send_signal(signal.SIGINT)
        _, rest = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    err = "".join(lines) + rest
    assert proc.returncode == 130, err
    assert err.strip().splitlines()[-1] == "interrupted", err
    assert not any(_alive(p) for p in pids), err
