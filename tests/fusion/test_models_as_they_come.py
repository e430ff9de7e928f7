"""A `transformers` model returned as it comes trains its own ``.loss`` (issue 26); a model file's bug is named
by its own file and line, and ``--traceback`` shows the user's traceback.

Before: returning a ``PreTrainedModel`` failed to trace (a ``DynamicCache`` in its output) unless the user wrapped
it and passed ``use_cache=False``; a forward that fails pointed at torch's file (``__init__.py:1750``).
"""
import numpy as np
import pytest
import torch

from fusion.cli import main
from tests.fusion.cli_helpers import one_line

pytest.importorskip("transformers", reason="transformers is a test-only dependency (pip install -e .[test])")

GPT2_SRC = '''
import torch
import transformers

def gpt2():
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=16,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    ids = torch.randint(0, 64, (2, 8))
    return transformers.GPT2LMHeadModel(cfg), {"input_ids": ids, "labels": ids}

def no_labels():
    model, batch = gpt2()
    return model, {"input_ids": batch["input_ids"]}
'''

BUG_SRC = '''
import torch
from torch import nn

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.fc2 = nn.Linear(4, 3), nn.Linear(5, 3)

    def forward(self, x, y):
        h = self.fc(x)
        return nn.functional.cross_entropy(self.fc2(h), y)

def net():
    return Net(), {"x": torch.randn(2, 4), "y": torch.randint(0, 3, (2,))}
'''


def test_a_pretrained_model_as_it_comes_trains_its_own_loss(tmp_path):
    """No wrapper: the graph's parameters are the model's own names, and two SGD steps of the traced graph cut
    in two parts give the losses of the model in plain PyTorch (the example aliases input_ids and labels)."""
    from fusion.cluster import load_cluster
    from fusion.compile import compile_model
    from fusion.executors.reference import ReferenceExecutor
    from fusion.loader import load_function, load_model
    from fusion.plan import OptimizerConfig

    (tmp_path / "hf.py").write_text(GPT2_SRC)
    spec = f"{tmp_path / 'hf.py'}:gpt2"
    model = load_model(spec)
    module, example = load_function(spec)()
    assert module.config.use_cache  # fusion turned it off on its own copy only
    assert len(model.graph.loss_nodes()) == 1
    assert [n.name for n in model.graph.placeholders()] == ["input_ids", "labels"]
    assert set(model.params) <= set(module.state_dict())  # no wrapper prefix
    plan = compile_model(model, load_cluster("examples/clusters/local-4-one-site.yaml"), strategy="equal-count")
    assert len(set(plan.assignment.values())) >= 2
    ref = ReferenceExecutor(model, plan.assignment, OptimizerConfig(name="sgd", lr=0.5))
    opt = torch.optim.SGD(module.parameters(), lr=0.5)
    g = torch.Generator().manual_seed(1)
    for _ in range(2):
        ids = torch.randint(0, 64, (2, 8), generator=g)
        got = ref.step({"input_ids": ids.numpy(), "labels": ids.numpy()}).loss
        opt.zero_grad()
        want = module(input_ids=ids, labels=ids, use_cache=False).loss
        want.backward()
        opt.step()
        np.testing.assert_allclose(got, want.item(), rtol=2e-5)


def test_a_pretrained_model_without_labels_says_so(tmp_path, capsys):
    (tmp_path / "hf.py").write_text(GPT2_SRC)
    assert main(["compile", f"{tmp_path / 'hf.py'}:no_labels", "--cluster", "examples/clusters/local-4-one-site.yaml",
                 "-o", str(tmp_path / "plan")]) == 2
    err = one_line(capsys)
    assert "GPT2LMHeadModel computes its .loss only from 'labels'" in err, err


def test_a_failing_forward_names_the_users_line_and_traceback_shows_it(tmp_path, capsys):
    (tmp_path / "bug.py").write_text(BUG_SRC)
    argv = ["compile", f"{tmp_path / 'bug.py'}:net", "--cluster", "examples/clusters/local-4-one-site.yaml",
            "-o", str(tmp_path / "plan")]
    assert main(argv) == 2
    err = one_line(capsys)
    assert "(bug.py:12)" in err and "mat1 and mat2 shapes cannot be multiplied" in err, err
    for flag in (["--traceback"], ["-vv"]):
        assert main(argv + flag) == 2
        err = capsys.readouterr().err
        assert "Traceback (most recent call last)" in err and f'{tmp_path / "bug.py"}", line 12, in forward' in err, err
        assert err.strip().splitlines()[-1].startswith("fusion compile: error: model"), err
