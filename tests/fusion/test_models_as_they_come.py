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

ENC_DEC_SRC = '''
import torch
import transformers

def _tokens(g, cfg):
    return {"input_ids": torch.randint(3, 64, (2, 8), generator=g), "labels": torch.randint(3, 64, (2, 6), generator=g)}

def _features(g, cfg):
    return {"input_features": torch.randn(2, 8, 16, generator=g), "labels": torch.randint(3, 64, (2, 6), generator=g)}

def t5(g=None):
    torch.manual_seed(0)
    cfg = transformers.T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2,
                                num_heads=4, dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0)
    return transformers.T5ForConditionalGeneration(cfg), _tokens(g or torch.Generator().manual_seed(0), cfg)

def bart(g=None):
    torch.manual_seed(0)
    cfg = transformers.BartConfig(vocab_size=64, d_model=32, encoder_layers=2, decoder_layers=2,
                                  encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
                                  decoder_ffn_dim=64, max_position_embeddings=32, dropout=0.0, attention_dropout=0.0,
                                  activation_dropout=0.0, pad_token_id=1, decoder_start_token_id=2)
    return transformers.BartForConditionalGeneration(cfg), _tokens(g or torch.Generator().manual_seed(0), cfg)

def whisper(g=None):
    torch.manual_seed(0)
    cfg = transformers.WhisperConfig(vocab_size=64, num_mel_bins=8, d_model=32, encoder_layers=1, decoder_layers=1,
                                     encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
                                     decoder_ffn_dim=64, max_source_positions=8, max_target_positions=16,
                                     dropout=0.0, pad_token_id=0, decoder_start_token_id=1)
    return transformers.WhisperForConditionalGeneration(cfg), _features(g or torch.Generator().manual_seed(0), cfg)
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


@pytest.mark.parametrize("fn", ["t5", "bart", "whisper"])
def test_an_encoder_decoder_as_it_comes_trains_its_own_loss(tmp_path, fn):
    """T5, BART and a Whisper-like ``...ForConditionalGeneration`` returned as the user has it: T5's decoder stack
    keeps its own copy of the config, whose cache gave an ``EncoderDecoderCache`` the trace could not take; every
    copy's cache is turned off, and two SGD steps of the graph cut in two parts give plain PyTorch's losses."""
    from fusion.executors.reference import ReferenceExecutor, contiguous_parts
    from fusion.loader import load_function, load_model
    from fusion.plan import OptimizerConfig

    (tmp_path / "encdec.py").write_text(ENC_DEC_SRC)
    spec = f"{tmp_path / 'encdec.py'}:{fn}"
    model = load_model(spec)
    make = load_function(spec)
    module, _ = make()
    assert module.config.use_cache and len(model.graph.loss_nodes()) == 1  # turned off on fusion's copy only
    # the model's own names; beyond them only constants torch.export lifted (never trained; fusion export leaves
    # them out)
    extra = set(model.params) - set(module.state_dict())
    assert all(not model.graph.params[k].trainable for k in extra), extra
    ref = ReferenceExecutor(model, contiguous_parts(model, 2), OptimizerConfig(name="sgd", lr=0.5))
    opt = torch.optim.SGD(module.parameters(), lr=0.5)
    for step in range(2):
        batch = make(torch.Generator().manual_seed(10 + step))[1]
        got = ref.step({k: v.numpy() for k, v in batch.items()}).loss
        opt.zero_grad()
        want = module(**batch, use_cache=False).loss
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
