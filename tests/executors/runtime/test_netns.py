"""Multi-host for real: each CompNode in its own network namespace, joined by a veth pair shaped with tc tbf.

The coordinator and part p0 run in namespace A (10.77.0.1), part p1 in B
(10.77.0.2); every link goes through the veth pair limited to 20 Mbit/s.
This is the README's two-host recipe (``fusion executor`` per host plus
``fusion coordinator``) with namespaces standing in for hosts. Skipped where
namespaces cannot be made (not root, no ``ip``/``tc``, no permission).
"""
import json
import os
import shutil
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from tests.executors.dist_models import GPT_SPLITS, gpt_plain_loss, plain_training, tied_transformer
from fusion.data import make_batches
from fusion.executors.runtime.launcher import hand_plan
from fusion.plan import OptimizerConfig
from fusion.plan import save_plan

TAG = f"fz{os.getpid() % 100000}"
NS_A, NS_B, VETH_A, VETH_B = f"{TAG}a", f"{TAG}b", f"{TAG}va", f"{TAG}vb"
IP_A, IP_B = "10.77.0.1", "10.77.0.2"


def _sh(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True, timeout=10)


def _namespaces_available() -> str | None:
    if os.geteuid() != 0:
        return "needs root"
    if not shutil.which("ip") or not shutil.which("tc"):
        return "needs ip and tc"
    probe = f"{TAG}p"
    try:
        _sh("ip", "netns", "add", probe)
        _sh("ip", "netns", "del", probe)
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired, OSError) as e:
        return f"cannot create network namespaces ({e})"
    return None


@pytest.fixture
def two_hosts():
    reason = _namespaces_available()
    if reason:
        pytest.skip(reason)
    try:
        _sh("ip", "netns", "add", NS_A)
        _sh("ip", "netns", "add", NS_B)
        _sh("ip", "link", "add", VETH_A, "type", "veth", "peer", "name", VETH_B)
        _sh("ip", "link", "set", VETH_A, "netns", NS_A)
        _sh("ip", "link", "set", VETH_B, "netns", NS_B)
        for ns, dev, ip in ((NS_A, VETH_A, IP_A), (NS_B, VETH_B, IP_B)):
            _sh("ip", "-n", ns, "addr", "add", f"{ip}/24", "dev", dev)
            _sh("ip", "-n", ns, "link", "set", dev, "up")
            _sh("ip", "-n", ns, "link", "set", "lo", "up")
            # 20 Mbit/s each way (this kernel has tbf and htb, no netem: latency would come from the transport)
            _sh("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf",
                "rate", "20mbit", "burst", "32kbit", "latency", "400ms")
    except subprocess.CalledProcessError as e:
        _cleanup()
        pytest.skip(f"cannot set up namespaces: {e.stderr.decode(errors='replace').strip()}")
    try:
        yield
    finally:
        _cleanup()


def _cleanup() -> None:
    for ns in (NS_A, NS_B):  # deleting a namespace deletes its end of the veth pair, and with it the pair
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=10)


def _in(ns: str, *args: str, log) -> subprocess.Popen:
    return subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, "-m", "fusion.cli", *args],
                            stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"})


def _sent_bytes(ns: str, dev: str) -> int:
    out = subprocess.run(["ip", "netns", "exec", ns, "tc", "-s", "qdisc", "show", "dev", dev],
                         capture_output=True, text=True, timeout=10).stdout
    return int(out.split("Sent ")[1].split(" bytes")[0])


def test_two_hosts_in_namespaces_train_like_pytorch(two_hosts, tmp_path):
    model = tied_transformer(mb=2)
    plan = hand_plan(model, GPT_SPLITS[2], schedule="1f1b", micro_batches=2, optimizer=OptimizerConfig("sgd", lr=0.1))
    plan.parts["p0"].address = f"tcp://{IP_A}:5601"
    plan.parts["p1"].address = f"tcp://{IP_B}:5602"
    plan_dir = save_plan(plan, tmp_path / "plan", params=model.params)
    run, steps = tmp_path / "run", 4
    keys = tmp_path / "keys"  # CURVE on every link, as a multi-host run must (the executors listen beyond loopback)
    subprocess.run([sys.executable, "-m", "fusion.cli", "keys", str(plan_dir), "--out", str(keys)], check=True, timeout=60)
    coord_addr = f"tcp://{IP_A}:5600"
    procs = []
    with open(tmp_path / "log.txt", "wb") as log:
        try:
            procs.append(_in(NS_A, "coordinator", str(plan_dir), "--bind", coord_addr, "--steps", str(steps), "--out", str(run),
                             "--data", "synthetic", "--no-progress", "--key", str(keys / "coordinator.secret"), log=log))
            for ns, part in ((NS_A, "p0"), (NS_B, "p1")):
                procs.append(_in(ns, "executor", str(plan_dir), "--node", part, "--coordinator", coord_addr,
                                 "--key", str(keys / f"{part}.secret"), log=log))
            deadline = time.monotonic() + 120
            for p in procs:
                p.wait(max(1.0, deadline - time.monotonic()))
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait(10)
    text = (tmp_path / "log.txt").read_text(errors="replace")
    assert [p.returncode for p in procs] == [0, 0, 0], text[-3000:]
    # the traffic crossed the shaped veth pair, both ways
    assert _sent_bytes(NS_A, VETH_A) > 10_000 and _sent_bytes(NS_B, VETH_B) > 10_000
    losses = [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    batch_fn = make_batches(plan, "synthetic", plan.seed)
    expected = plain_training(model, gpt_plain_loss, [batch_fn(s) for s in range(steps)], 2,
                              lambda ps: torch.optim.SGD(ps, lr=0.1))
    np.testing.assert_allclose(losses, [e[0] for e in expected], rtol=1e-5)
