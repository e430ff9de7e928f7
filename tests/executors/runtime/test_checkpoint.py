"""Checkpoints: per-part files, atomic commit, latest complete step, optimizer state by parameter name."""
import numpy as np
import pytest
import torch

from tests.executors.dist_models import CNN_SPLITS, branching_cnn, cnn_batch
from fusion.executors.runtime import checkpoint
from fusion.executors.runtime.checkpoint import CheckpointError
from fusion.executors.engines.select import make_engine_part, make_optimizer
from fusion.plan import OptimizerConfig
from fusion.ir.boundary import partition


def test_commit_latest_and_pruning(tmp_path):
    w = {"a": np.arange(3, dtype=np.float32)}
    assert checkpoint.latest(tmp_path) is None
    for step in (2, 4, 6):
        for p in ("p0", "p1"):
            checkpoint.save_part(tmp_path, step, p, w, {"a::step": np.array(1.0, np.float32)}, {"optimizer": {"name": "sgd"}})
        checkpoint.commit(tmp_path, step, ["p0", "p1"])
    checkpoint.save_part(tmp_path, 8, "p0", w, {}, {})  # p1 never saved step 8: not complete
    with pytest.raises(CheckpointError, match=r"parts \['p1'\] did not save step 8"):
        checkpoint.commit(tmp_path, 8, ["p0", "p1"])
    assert checkpoint.latest(tmp_path) == 6
    assert not checkpoint.step_dir(tmp_path, 2).exists()  # only the newest two complete ones are kept
    params, opt, meta = checkpoint.load_part(tmp_path, 6, "p1")
    np.testing.assert_array_equal(params["a"], w["a"])
    assert opt["a::step"].shape == () and meta == {"optimizer": {"name": "sgd"}}
    with pytest.raises(CheckpointError, match="part 'p2' has no checkpoint at step 6"):
        checkpoint.load_part(tmp_path, 6, "p2")
    assert not list(tmp_path.rglob("*.tmp*"))


@pytest.mark.parametrize("cfg", [OptimizerConfig("adamw", lr=0.01), OptimizerConfig("sgd", lr=0.1, momentum=0.9),
                                 OptimizerConfig("muon", lr=0.01)])  # muon: fc.weight on Muon, the rest on AdamW
def test_optimizer_state_round_trip_continues_identically(tmp_path, cfg):
    model = branching_cnn(mb=2)
    sub = partition(model.graph, CNN_SPLITS[2])["p1"]
    y = torch.as_tensor(cnn_batch(0, 2)["y"])
    h = {("conv1", None): np.ones((2, 4, 6, 6), np.float32), ("relu_a", None): np.ones((2, 4, 6, 6), np.float32)}

    def train(part, opt, steps):
        for s in range(steps):
            part.forward(s, h, {"y": y.numpy()})
            part.backward(s, {}, 1.0)
            opt.step()
            opt.zero_grad()

    a = make_engine_part("torch", model.graph, sub, model.params)
    oa = make_optimizer("torch", a, cfg)
    train(a, oa, 2)
    arrays, meta = oa.state()
    checkpoint.save_part(tmp_path, 2, "p1", a.state(), arrays, meta)
    params, arrays2, meta2 = checkpoint.load_part(tmp_path, 2, "p1")
    b = make_engine_part("torch", model.graph, sub, params)
    ob = make_optimizer("torch", b, cfg)
    ob.load_state(arrays2, meta2)
    train(a, oa, 2)
    train(b, ob, 2)
    for k, v in a.state().items():
        np.testing.assert_array_equal(b.state()[k], v, err_msg=k)


def test_each_part_prunes_its_own_files(tmp_path):
    """A disk without COMPLETE.json (the coordinator's is elsewhere): the save just written and the two before it."""
    w = {"a": np.zeros(2, np.float32)}
    for step in (3, 6, 9, 12):
        checkpoint.save_part(tmp_path, step, "p0", w, {}, {})
        checkpoint.prune_part(tmp_path, "p0", keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000006", "step-00000009", "step-00000012"]


def test_a_save_that_never_completes_leaves_two_complete_steps_to_fall_back_to(tmp_path):
    """Steps 3 and 6 complete, then the save of 9 is made but never committed (another part faulted), and 6 turns
    out corrupt: every part still holds 3, and --resume falls back to it. Before, the part pruned right after its
    save of 9 kept {6, 9} (the incomplete save counted as one of two) and the fallback found nothing."""
    w = {"a": np.arange(4, dtype=np.float32)}
    for step in (3, 6):
        for p in ("p0", "p1"):
            checkpoint.save_part(tmp_path, step, p, {"a": w["a"] + step}, {}, {})
            checkpoint.prune_part(tmp_path, p, keep=2)
        checkpoint.commit(tmp_path, step, ["p0", "p1"])
    checkpoint.save_part(tmp_path, 9, "p0", w, {}, {})  # p1 faults during its save of 9: 9 is never complete
    checkpoint.prune_part(tmp_path, "p0", keep=2)
    assert all((checkpoint.step_dir(tmp_path, 3) / f"{p}.params.safetensors").exists() for p in ("p0", "p1"))
    victim = checkpoint.step_dir(tmp_path, 6) / "p1.params.safetensors"
    data = bytearray(victim.read_bytes())
    data[-3] ^= 0x40
    victim.write_bytes(bytes(data))
    skipped = []
    step, sources = checkpoint.newest_verified(tmp_path, {"p0": "p0", "p1": "p1"}, lambda *a: skipped.append(a))
    assert step == 3 and skipped, (step, skipped)
    params, _, _ = checkpoint.load_part(tmp_path, 3, "p1")
    np.testing.assert_array_equal(params["a"], w["a"] + 3)
