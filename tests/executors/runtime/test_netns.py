"""Multi-host for real: each CompNode in its own network namespace, two sites joined by a veth pair shaped with tc tbf.

The coordinator and part p0 run in host namespace ``a`` (site A, 10.77.0.1), part p1 in ``b`` (site B,
10.77.0.2); ``benchmarks/netns_sites.py`` builds the network: every link between the sites goes through the
switches' veth pair limited to 20 Mbit/s.
This is the README's two-host recipe (``fusion executor`` per host plus
``fusion coordinator``) with namespaces standing in for hosts. Skipped where
namespaces cannot be made (not root, no ``ip``/``tc``, no permission).
"""
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.executors.dist_models import GPT_SPLITS, gpt_plain_loss, plain_training, tied_transformer
from fusion.data.batches import make_batches
from fusion.executors.runtime.launcher import hand_plan
from fusion.plan import OptimizerConfig
from fusion.plan import save_plan

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))
from netns_sites import PROFILES, SetupError, Sites, namespaces_available  # noqa: E402


@pytest.fixture
def two_hosts():
    """Host ``a`` in site A, ``b`` in site B, 20 Mbit/s between them (``benchmarks/netns_sites.py``)."""
    reason = namespaces_available()
    if reason:
        pytest.skip(reason)
    try:
        sites = Sites({"a": "site-a", "b": "site-b"}, PROFILES["20mbit"]).__enter__()
    except SetupError as e:
        pytest.skip(f"cannot set up namespaces: {e}")
    try:
        yield sites
    finally:
        sites.close()


def _in(sites: Sites, host: str, *args: str, log) -> subprocess.Popen:
    return subprocess.Popen(sites.cmd(host, [sys.executable, "-m", "fusion.cli", *args]),
                            stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"})


def test_two_hosts_in_namespaces_train_like_pytorch(two_hosts, tmp_path):
    model = tied_transformer(mb=2)
    plan = hand_plan(model, GPT_SPLITS[2], schedule="1f1b", micro_batches=2, optimizer=OptimizerConfig("sgd", lr=0.1))
    ip = two_hosts.ip
    plan.parts["p0"].address = f"tcp://{ip['a']}:5601"
    plan.parts["p1"].address = f"tcp://{ip['b']}:5602"
    plan_dir = save_plan(plan, tmp_path / "plan", params=model.params)
    run, steps = tmp_path / "run", 4
    keys = tmp_path / "keys"  # CURVE on every link, as a multi-host run must (the executors listen beyond loopback)
    subprocess.run([sys.executable, "-m", "fusion.cli", "keys", str(plan_dir), "--out", str(keys)], check=True, timeout=60)
    coord_addr = f"tcp://{ip['a']}:5600"
    procs = []
    with open(tmp_path / "log.txt", "wb") as log:
        try:
            procs.append(_in(two_hosts, "a", "coordinator", str(plan_dir), "--bind", coord_addr, "--steps", str(steps), "--out", str(run),
                             "--data", "synthetic", "--no-progress", "--key", str(keys / "coordinator.secret"), log=log))
            for host, part in (("a", "p0"), ("b", "p1")):
                procs.append(_in(two_hosts, host, "executor", str(plan_dir), "--node", part, "--coordinator", coord_addr,
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
    assert two_hosts.sent_bytes("a") > 10_000 and two_hosts.sent_bytes("b") > 10_000
    assert two_hosts.between_sent_bytes() > 20_000
    losses = [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    batch_fn = make_batches(plan, "synthetic", plan.seed)
    expected = plain_training(model, gpt_plain_loss, [batch_fn(s) for s in range(steps)], 2,
                              lambda ps: torch.optim.SGD(ps, lr=0.1))
    np.testing.assert_allclose(losses, [e[0] for e in expected], rtol=1e-5)
