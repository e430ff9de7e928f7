"""Equivalence: CompNode processes over sockets train exactly like single-process PyTorch.

Each case starts one real executor process per part (2 or 4), runs 5 steps
with GPipe, 1F1B or zero bubble (zb1) over 4 micro-batches, and compares every step's loss and
parameter gradients and the final parameters with plain PyTorch (gradient
accumulation over the same micro-batches). The transformer's embedding and
output projection share one weight held by the first and last parts: its
gradient is summed across the two owner processes before the step.
"""
import json

import pytest
import torch

from tests.executors.dist_models import MODELS, plain_training, run_distributed, save_hand_plan, assert_matches_plain
from fusion.plan import OptimizerConfig

STEPS, MICRO, MB = 5, 4, 2
OPTIMIZERS = {  # (fusion config, the same in torch)
    "cnn": (OptimizerConfig("adamw", lr=0.01, weight_decay=0.01),
            lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.01)),
    # SGD for the transformer: Adam would turn the rounding noise of the (exactly zero) gradient of the key bias into
    # full-size steps, so its parameters would differ by lr whatever the executor did
    "gpt": (OptimizerConfig("sgd", lr=0.1, momentum=0.9, weight_decay=0.01),
            lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=0.01)),
}


CASES = [(name, n, s) for name in ("cnn", "gpt") for n in (2, 4) for s in ("gpipe", "1f1b")]
CASES += [("cnn", 4, "zb1"), ("gpt", 2, "zb1")]  # zero bubble: backward split into B and W actions
# interleaved 1F1B: 4 parts over 2 devices (p0, p2 in one process; p1, p3 in another), and 2 parts on one
# device (the transformer's tied weight then has both owners in one process)
CASES += [("cnn", 4, "interleaved"), ("gpt", 4, "interleaved"), ("gpt", 2, "interleaved")]


@pytest.mark.parametrize("name,n_parts,schedule", CASES)
def test_processes_match_single_process_pytorch(tmp_path, name, n_parts, schedule):
    build, splits, plain_loss, batch_fn = MODELS[name]
    model = build(mb=MB)
    cfg, torch_opt = OPTIMIZERS[name]
    placement = {}
    if schedule == "interleaved":
        from fusion.executors.runtime.launcher import local_cluster_dict

        n_dev = n_parts // 2
        placement = {"cluster": local_cluster_dict([f"d{i}" for i in range(n_dev)]),
                     "devices": {f"p{i}": f"local-{i % n_dev}" for i in range(n_parts)}}
    plan_dir = save_hand_plan(tmp_path, model, splits[n_parts], schedule=schedule, micro_batches=MICRO, optimizer=cfg,
                              **placement)
    batches = [batch_fn(s, MB * MICRO) for s in range(STEPS)]
    reports, state = run_distributed(plan_dir, tmp_path / "run", batches)
    expected = plain_training(model, plain_loss, batches, MICRO, torch_opt)
    assert_matches_plain(reports, state, expected)
    # every CompNode wrote a Chrome trace with forward and backward spans
    for p in {v for v in splits[n_parts].values()}:
        trace = json.loads((tmp_path / "run" / "trace" / f"{p}.json").read_text())
        cats = {e.get("cat") for e in trace["traceEvents"] if e["ph"] == "X"}
        assert {"forward", "backward"} <= cats
        if schedule == "zb1":  # the weight-gradient actions ran as their own spans, and the step line counts them
            assert any(e["name"].startswith("W") for e in trace["traceEvents"] if e["ph"] == "X")
            assert all(r.metrics_line()["parts"][p]["weight_s"] > 0 for r in reports)
    if schedule == "interleaved":  # one process per device runs that device's parts
        pids = json.loads((tmp_path / "run" / "pids.json").read_text())
        n_dev = n_parts // 2
        assert len(set(pids.values())) == n_dev
        assert all(pids[f"p{i}"] == pids[f"p{i % n_dev}"] for i in range(n_parts))


def test_compnode_side_imports_no_torch():
    """A CompNode on a non-torch engine must run without torch: nothing it imports may pull torch in."""
    import subprocess
    import sys

    code = ("import sys; import fusion.cli, fusion.ir.wire, fusion.executors.runtime.transport, fusion.executors.runtime.compnode, "
            "fusion.executors.runtime.coordinator, fusion.executors.runtime.launcher, fusion.executors.runtime.checkpoint, fusion.data.batches, "
            "fusion.commands.run, fusion.commands.executor, fusion.commands.coordinator; "
            "assert 'torch' not in sys.modules, 'torch was imported'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
