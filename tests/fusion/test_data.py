"""Training data for `fusion run`: generated corpus, tokenizers, deterministic batches fitted to a plan."""
import numpy as np
import pytest
import torch

from fusion.data import Tokenizer, corpus_text, make_batches, tokenizer_for
from fusion.executors.launcher import hand_plan
from fusion.ir.builder import GraphBuilder
from fusion.ir.errors import FusionError


def _lm(vocab: int, mb: int = 2, T: int = 8):
    b = GraphBuilder()
    idx, y = b.input("idx"), b.label("targets")
    h = b.module("wte", "torch.nn.Embedding", idx, num_embeddings=vocab, embedding_dim=8)
    o = b.module("head", "torch.nn.Linear", h, in_features=8, out_features=vocab)
    o = b.function("flat", "torch.Tensor.reshape", o, -1, vocab)
    t = b.function("flat_t", "torch.Tensor.reshape", y, -1)
    b.loss("loss", "torch.nn.functional.cross_entropy", o, t)
    return b.build(example={"idx": torch.zeros(mb, T, dtype=torch.long), "targets": torch.zeros(mb, T, dtype=torch.long)})


def test_corpus_is_deterministic_and_tokenizers_round_trip():
    text = corpus_text(20_000)
    assert text == corpus_text(20_000) and len(text) >= 20_000
    for tok in (Tokenizer(), tokenizer_for(64, text)):
        assert tok.decode(tok.encode(text[:500])) == text[:500]
    assert tokenizer_for(300, text).vocab_size == 256
    with pytest.raises(FusionError, match="vocabulary"):
        tokenizer_for(10, text)


def test_language_model_plans_get_shifted_text():
    model = _lm(64)
    plan = hand_plan(model, {n: "p0" for n in model.graph.nodes}, micro_batches=3)
    fn = make_batches(plan, "auto", seed=1)
    a, b = fn(5), fn(5)
    assert a["idx"].shape == (6, 8) and a["idx"].dtype == np.int64
    np.testing.assert_array_equal(a["idx"], b["idx"])  # a pure function of the step
    assert not np.array_equal(fn(6)["idx"], a["idx"])
    np.testing.assert_array_equal(a["idx"][:, 1:], a["targets"][:, :-1])  # next-token targets
    assert a["idx"].max() < 64
    text = fn.tokenizer.decode(a["idx"][0])
    assert text in corpus_text()


def test_synthetic_batches_respect_classes_and_embedding_rows():
    model = _lm(5)
    plan = hand_plan(model, {n: "p0" for n in model.graph.nodes}, micro_batches=2)
    with pytest.raises(FusionError, match="vocabulary"):
        make_batches(plan, "text")
    s = make_batches(plan, "synthetic")(0)
    assert s["idx"].shape == (4, 8) and 0 <= s["idx"].min() and s["idx"].max() < 5 and s["targets"].max() < 5
    with pytest.raises(FusionError, match="unknown data kind"):
        make_batches(plan, "imagenet")
