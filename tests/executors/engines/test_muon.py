"""``--optimizer muon`` (issue 27): torch.optim.Muon on the 2-D weights, AdamW on embeddings, norms and biases.

A 2-part run in real processes equals plain PyTorch in one process with the same split of optimizers, chosen here by
hand from the model's layers (rtol 1e-5; the reference steps on the run's gradients, see the test); a NumPy part is refused in one line naming it (exit 2); the optimizer names
of the plan, the torch engine and the NumPy engine agree.
"""
from pathlib import Path

import numpy as np
import pytest
import torch

from fusion.cli import main
from fusion.executors.engines.numpy.optim import NumpyOptimizer
from fusion.executors.engines.select import _ENGINES, check_optimizer
from fusion.executors.engines.torch.optimizer import TORCH_OPTIMIZERS
from fusion.ir.errors import FusionError
from fusion.plan import OPTIMIZER_NAMES, OptimizerConfig
from tests.executors.dist_models import MODELS, plain_training, run_distributed, save_hand_plan

ROOT = Path(__file__).resolve().parents[3]
LOCAL = str(ROOT / "examples" / "clusters" / "local-4-two-sites.yaml")
STEPS, MB, MICRO = 4, 2, 2
#: the tied transformer's hidden matrices (its embedding table, tied to the head, is AdamW's, as the 1-D tensors)
MATRICES = {"qkv.weight", "proj.weight", "fc1.weight", "fc2.weight"}


def test_optimizer_names_agree_across_the_plan_and_the_engines():
    assert set(TORCH_OPTIMIZERS) == set(OPTIMIZER_NAMES) == set(_ENGINES["torch"].optimizers)
    assert set(_ENGINES["numpy"].optimizers) == set(NumpyOptimizer.NAMES) == set(OPTIMIZER_NAMES) - {"muon"}
    assert OptimizerConfig("muon", lr=0.01).to_dict() == OptimizerConfig("adamw", lr=0.01).to_dict() | {"name": "muon"}
    cfg = OptimizerConfig("muon", lr=0.01, muon_momentum=0.9)
    assert OptimizerConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ValueError, match="muon_momentum"):
        OptimizerConfig("muon", muon_momentum=1.0)


def test_muon_in_processes_equals_plain_pytorch_with_the_same_split(tmp_path):
    build, splits, plain_loss, batch_fn = MODELS["gpt"]
    model = build(mb=MB)
    cfg = OptimizerConfig("muon", lr=0.02, weight_decay=0.01)
    plan_dir = save_hand_plan(tmp_path, model, splits[2], schedule="1f1b", micro_batches=MICRO, optimizer=cfg)
    batches = [batch_fn(s, MB * MICRO) for s in range(STEPS)]
    reports, state = run_distributed(plan_dir, tmp_path / "run", batches)

    names = list(model.params)
    assert MATRICES <= set(names) and all(model.params[n].ndim == 2 for n in MATRICES)
    assert all(model.graph.params[n].trainable for n in names)

    def split(P):  # the reference split, by hand: Muon on the hidden matrices, AdamW on the rest
        return [torch.optim.Muon([P[n] for n in names if n in MATRICES], lr=0.02, weight_decay=0.01, momentum=0.95,
                                 nesterov=True, adjust_lr_fn="match_rms_adamw"),
                torch.optim.AdamW([P[n] for n in names if n not in MATRICES], lr=0.02, weight_decay=0.01)]

    # torch's Muon orthogonalises in bfloat16, which turns the float rounding differences of any two
    # computations of one gradient (~1e-7) into update differences of ~2^-8: two free-running trajectories
    # part ways at that scale. So the reference is driven by the run's own gradients (teacher forcing):
    # every step, plain PyTorch's loss and gradients at the reference parameters must equal the run's
    # (rtol 1e-5), and the reference's two optimizers then step on the run's gradients; its parameters must
    # end where the run's did.
    P = {k: torch.tensor(np.asarray(v), requires_grad=True) for k, v in model.params.items()}
    opts = split(P)
    for step, (r, batch) in enumerate(zip(reports, batches)):
        for o in opts:
            o.zero_grad()
        loss = 0.0
        for i in range(MICRO):
            lc = plain_loss(P, {k: torch.as_tensor(v).chunk(MICRO)[i] for k, v in batch.items()}) / MICRO
            lc.backward()
            loss += lc.item()
        np.testing.assert_allclose(r.loss, loss, rtol=1e-5, err_msg=f"loss of step {step}")
        assert set(r.grads) == set(names)
        for k in names:
            np.testing.assert_allclose(r.grads[k], P[k].grad.numpy(), rtol=1e-5, atol=1e-7,
                                       err_msg=f"grad {k} at step {step}")
            P[k].grad = torch.tensor(np.asarray(r.grads[k]))
        for o in opts:
            o.step()
    for k in names:
        np.testing.assert_allclose(state[k], P[k].detach().numpy(), rtol=1e-5, atol=1e-7,
                                   err_msg=f"parameter {k} after {STEPS} steps")
        assert not np.allclose(state[k], np.asarray(model.params[k])), f"{k} never moved"
    # the split matters: all-AdamW lands elsewhere after the same steps
    adamw = plain_training(model, plain_loss, batches, MICRO,
                           lambda ps: torch.optim.AdamW(ps, lr=0.02, weight_decay=0.01))
    assert not np.allclose(adamw[-1][2]["fc1.weight"], state["fc1.weight"], rtol=1e-3)


def test_numpy_part_refuses_muon_in_one_line(tmp_path, capsys):
    with pytest.raises(FusionError, match="part 'p1' runs the numpy engine, which has no 'muon' optimizer"):
        check_optimizer("muon", {"p0": "torch", "p1": "numpy"})
    check_optimizer("adamw", {"p0": "torch", "p1": "numpy"})
    rc = main(["compile", str(ROOT / "examples/models/gpt.py") + ":tiny", "--cluster", LOCAL, "--optimizer", "muon",
               "--strategy", "equal-count", "--engine", "part1=numpy", "-o", str(tmp_path / "p")])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1, err
    assert "part 'part1' runs the numpy engine, which has no 'muon' optimizer" in err, err
    assert not (tmp_path / "p").exists()
