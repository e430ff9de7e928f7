"""Dial-out only on real Linux NAT (issue 39): two homes behind MASQUERADE routers, one reachable site.

``benchmarks/netns_nat.py`` builds the network (namespaces, veths, ``iptables -t nat ... MASQUERADE`` and a
stateful firewall per home). ``p1`` and ``p2`` run in the homes with ``fusion executor --dial-out``; the
coordinator, ``fusion relay``, ``p0`` and ``p3`` run in the reachable site. Training must equal plain PyTorch, the
relay must have forwarded the traffic into the homes, and the routers must have translated the homes'
connections. Skipped where namespaces with NAT cannot be made; every namespace and rule is removed afterwards.
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
from fusion.plan import OptimizerConfig, save_plan

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))
from netns_nat import NatHomes, SetupError, nat_available  # noqa: E402


@pytest.fixture
def homes():
    reason = nat_available()
    if reason:
        pytest.skip(reason)
    try:
        net = NatHomes(2).__enter__()
    except SetupError as e:
        pytest.skip(f"cannot set up namespaces: {e}")
    try:
        yield net
    finally:
        net.close()
        left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        assert net.tag not in left


def _plan(tmp_path):
    model = tied_transformer(mb=2)
    plan = hand_plan(model, GPT_SPLITS[4], schedule="1f1b", micro_batches=2, optimizer=OptimizerConfig("sgd", lr=0.1))
    plan_dir = save_plan(plan, tmp_path / "plan", params=model.params)
    keys = tmp_path / "keys"
    subprocess.run([sys.executable, "-m", "fusion.cli", "keys", str(plan_dir), "--out", str(keys), "--relay"],
                   check=True, timeout=60, capture_output=True)
    return model, plan, plan_dir, keys


def test_homes_behind_nat_train_through_the_relay_like_pytorch(homes, tmp_path):
    model, plan, plan_dir, keys = _plan(tmp_path)
    pub = homes.ip["pub"]
    coord, relay = f"tcp://{pub}:5600", f"tcp://{pub}:5700"
    run, steps, stats = tmp_path / "run", 4, tmp_path / "relay.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = {}
    with open(tmp_path / "log.txt", "wb") as log:
        def start(name, host, *args):
            procs[name] = subprocess.Popen(homes.cmd(host, [sys.executable, "-m", "fusion.cli", *args]), stdout=log,
                                           stderr=subprocess.STDOUT, env=env)
        try:
            start("relay", "pub", "relay", str(plan_dir), "--bind", relay, "--key", str(keys / "relay.secret"),
                  "--stats", str(stats))
            start("coordinator", "pub", "coordinator", str(plan_dir), "--bind", coord, "--steps", str(steps), "--out",
                  str(run), "--data", "synthetic", "--no-progress", "--key", str(keys / "coordinator.secret"))
            for part, host in (("p0", "pub"), ("p1", "h1"), ("p2", "h2"), ("p3", "pub")):
                where = ["--dial-out", relay] if host != "pub" else ["--bind", f"tcp://{pub}:*"]
                start(part, host, "executor", str(plan_dir), "--node", part, "--coordinator", coord,
                      "--key", str(keys / f"{part}.secret"), *where)
            deadline = time.monotonic() + 180
            for name, p in procs.items():
                if name != "relay":
                    p.wait(max(1.0, deadline - time.monotonic()))
            procs["relay"].terminate()
            procs["relay"].wait(20)
        finally:
            for p in procs.values():
                if p.poll() is None:
                    p.kill()
                    p.wait(10)
    text = (tmp_path / "log.txt").read_text(errors="replace")
    assert {n: p.returncode for n, p in procs.items()} == dict.fromkeys(procs, 0), text[-3000:]
    forwarded = json.loads(stats.read_text())
    # into a home only through the relay; out of a home direct (p1 -> p0 gradients, p2 -> p3 activations)
    assert forwarded["bytes"] > 10_000  # (a word for a home that has already exited at the end is dropped: logged)
    assert {"p0->p1", "p2->p1", "p1->p2", "p3->p2", "coordinator->p1", "coordinator->p2"} <= set(forwarded["pairs"])
    assert not any(k.endswith("->p0") or k.endswith("->p3") for k in forwarded["pairs"])
    assert homes.masqueraded_packets(1) > 0 and homes.masqueraded_packets(2) > 0
    assert not homes.can_connect("pub", "h1") and not homes.can_connect("h2", "h1")  # the homes stay unreachable
    losses = [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    batch_fn = make_batches(plan, "synthetic", plan.seed)
    expected = plain_training(model, gpt_plain_loss, [batch_fn(s) for s in range(steps)], 2,
                              lambda ps: torch.optim.SGD(ps, lr=0.1))
    np.testing.assert_allclose(losses, [e[0] for e in expected], rtol=1e-5)


def _one_line(r):
    err = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(err) == 1, (r.returncode, r.stderr[-2000:])
    return err[0]


def test_dial_out_and_relay_refuse_bad_input_with_one_line(tmp_path):
    _, _, plan_dir, keys = _plan(tmp_path)
    cli = [sys.executable, "-m", "fusion.cli"]
    r = subprocess.run([*cli, "executor", str(plan_dir), "--node", "p1", "--coordinator", "tcp://127.0.0.1:9",
                        "--dial-out", "tcp://127.0.0.1:9", "--insecure"], capture_output=True, text=True, timeout=120)
    assert "--dial-out" in _one_line(r) and "--insecure" in _one_line(r)
    r = subprocess.run([*cli, "relay", str(plan_dir), "--bind", "tcp://127.0.0.1:*", "--key",
                        str(keys / "p1.secret")], capture_output=True, text=True, timeout=120)
    assert "relay" in _one_line(r)
    r = subprocess.run([*cli, "relay", str(plan_dir), "--bind", "nowhere", "--key", str(keys / "relay.secret")],
                       capture_output=True, text=True, timeout=120)
    assert "--bind" in r.stderr and r.returncode == 2
