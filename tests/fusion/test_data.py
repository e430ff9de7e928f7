"""Training data for `fusion run`: generated corpus, tokenizers, deterministic batches fitted to a plan."""
import numpy as np
import pytest
import torch

from fusion.data import Tokenizer, corpus_text, make_batches, tokenizer_for
from fusion.executors.runtime.launcher import hand_plan
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


USER_DATA = '''
import numpy as np

def batches(step):
    g = np.random.default_rng(step)
    return {"idx": g.integers(0, 5, (4, 8)), "targets": g.integers(0, 5, (4, 8)).astype(np.int32)}

def wrong_shape(step):
    return {"idx": np.zeros((3, 8), np.int64), "targets": np.zeros((4, 8), np.int64)}

def wrong_kind(step):
    return {"idx": np.zeros((4, 8), np.float32), "targets": np.zeros((4, 8), np.int64)}

def missing(step):
    return {"idx": np.zeros((4, 8), np.int64), "labels": np.zeros((4, 8), np.int64)}

def not_a_dict(step):
    return [1, 2]

def fails(step):
    raise ValueError("disk is gone")

CALLS = []

def counted(step):
    CALLS.append(step)
    return batches(step)
'''


def test_user_data_function_is_checked_and_cast_to_the_plan(tmp_path):
    (tmp_path / "data.py").write_text(USER_DATA)
    model = _lm(5)
    plan = hand_plan(model, {n: "p0" for n in model.graph.nodes}, micro_batches=2)
    fn = make_batches(plan, f"{tmp_path / 'data.py'}:batches")
    b = fn(3)
    assert b["targets"].dtype == np.int64 and b["idx"].shape == (4, 8)  # int32 -> the plan's int64
    np.testing.assert_array_equal(b["idx"], np.random.default_rng(3).integers(0, 5, (4, 8)))
    for func, msg in [("wrong_shape", r"field 'idx' has shape \[3, 8\], the plan expects \[4, 8\] \(2 micro-batch"),
                      ("wrong_kind", "field 'idx' has dtype float32, the plan expects int64"),
                      ("missing", r"missing field\(s\) \['targets'\]; unknown field\(s\) \['labels'\]"),
                      ("not_a_dict", "returned list, expected a dict"),
                      ("fails", "step 0: ValueError: disk is gone"),
                      ("nope", "has no function 'nope'")]:
        with pytest.raises(FusionError, match=msg):
            make_batches(plan, f"{tmp_path / 'data.py'}:{func}")
    with pytest.raises(FusionError, match="no such file"):
        make_batches(plan, f"{tmp_path / 'none.py'}:batches")
    # the batch fetched to validate the function before training is the one step 0 trains on
    fn = make_batches(plan, f"{tmp_path / 'data.py'}:counted")
    np.testing.assert_array_equal(fn(0)["idx"], np.random.default_rng(0).integers(0, 5, (4, 8)))
    fn(1)
    fn(0)
    import sys
    assert sys.modules["fusion_user_data"].CALLS == [0, 1, 0]  # the module the loader imported


def test_bfloat16_placeholders_are_fed_float32():
    """NumPy has no bfloat16: synthetic and user batches for a bf16 input are float32 (the engine rounds)."""
    b = GraphBuilder()
    x, y = b.input("x"), b.label("y")
    o = b.module("fc", "torch.nn.Linear", x, in_features=4, out_features=3)
    o = b.function("up", "torch.Tensor.float", o)
    b.loss("loss", "torch.nn.functional.cross_entropy", o, y)
    model = b.build(example={"x": torch.zeros(2, 4, dtype=torch.bfloat16), "y": torch.zeros(2, dtype=torch.long)})
    plan = hand_plan(model, {n: "p0" for n in model.graph.nodes}, micro_batches=1)
    assert plan.example["x"]["dtype"] == "bfloat16"
    assert make_batches(plan, "synthetic")(0)["x"].dtype == np.float32


DELTA_DATA = '''
import numpy as np


def with_ids(step):
    g = np.random.default_rng(step)
    return {"idx": g.integers(0, 5, (4, 8)), "targets": g.integers(0, 5, (4, 8)),
            "#sample_ids": np.arange(4) + 4 * (step % 3)}


def without_ids(step):
    return {k: v for k, v in with_ids(step).items() if k != "#sample_ids"}


def repeated_ids(step):
    return {**with_ids(step), "#sample_ids": np.array([0, 1, 1, 2])}
'''


def test_a_delta_plan_takes_data_with_sample_ids_only(tmp_path):
    """AQ-SGD keys its buffers by sample: the text corpus gives each window's start (unique in a batch),
    a user function returns '#sample_ids' (checked), synthetic data and functions without ids are refused."""
    from fusion.ir.opdata import SAMPLE_IDS
    from fusion.plan import EdgeCompression

    (tmp_path / "data.py").write_text(DELTA_DATA)
    model = _lm(64)
    assign = {n: ("p1" if n in ("head", "flat", "flat_t", "targets", "loss") else "p0") for n in model.graph.nodes}
    plan = hand_plan(model, assign, micro_batches=2)
    assert SAMPLE_IDS not in make_batches(plan, "auto")(0)  # no delta edge: no ids asked for
    plan.compression = [EdgeCompression("wte", None, "p0", "p1", fwd_codec={"algo": "delta", "bits": 4})]
    text = make_batches(plan, "auto", seed=1)
    for step in range(20):
        ids = text(step)[SAMPLE_IDS]
        assert ids.dtype == np.int64 and ids.shape == (4,) and np.unique(ids).size == 4
    np.testing.assert_array_equal(text(3)[SAMPLE_IDS], text(3)[SAMPLE_IDS])  # stable: a pure function of the step
    np.testing.assert_array_equal(make_batches(plan, f"{tmp_path / 'data.py'}:with_ids")(4)[SAMPLE_IDS], [4, 5, 6, 7])
    with pytest.raises(FusionError, match=r"missing field\(s\) \['#sample_ids'\]"):
        make_batches(plan, f"{tmp_path / 'data.py'}:without_ids")
    with pytest.raises(FusionError, match="must be 4 distinct integer sample ids"):
        make_batches(plan, f"{tmp_path / 'data.py'}:repeated_ids")
    with pytest.raises(FusionError, match="synthetic batches never show a sample twice"):
        make_batches(plan, "synthetic")


def test_a_window_drawn_twice_in_one_batch_gets_distinct_ids():
    from fusion.data import TextBatches

    src = TextBatches(np.arange(12), rows=64, seq_len=4, seed=0)  # 7 windows, 64 rows: many repeats
    starts, ids = src._starts(0), src.sample_ids(0)
    assert np.unique(ids).size == 64 and np.array_equal(ids % 12, starts)


def test_more_sample_ids_than_the_plan_sized_its_delta_buffers_for_are_logged(tmp_path, caplog):
    """The compiler sized the delta buffers for --samples N (plan.predicted['delta_samples']); a --data
    function that names more distinct samples is said so, once."""
    import logging

    from fusion.plan import EdgeCompression

    (tmp_path / "data.py").write_text(DELTA_DATA)  # with_ids: 12 samples, 4 per step, in turn
    model = _lm(64)
    assign = {n: ("p1" if n in ("head", "flat", "flat_t", "targets", "loss") else "p0") for n in model.graph.nodes}
    plan = hand_plan(model, assign, micro_batches=2)
    plan.compression = [EdgeCompression("wte", None, "p0", "p1", fwd_codec={"algo": "delta", "bits": 4})]
    for declared, warned in ((12, False), (8, True)):
        plan.predicted = {"delta_samples": declared}
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="fusion.data"):
            batches = make_batches(plan, f"{tmp_path / 'data.py'}:with_ids")
            for step in range(7):
                batches(step)
        said = [r.getMessage() for r in caplog.records if "distinct sample ids" in r.getMessage()]
        assert len(said) == warned, said
        if warned:
            assert "step 2: more than 8 distinct sample ids" in said[0]
