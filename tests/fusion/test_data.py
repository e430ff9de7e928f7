"""Training data for `fusion run`: generated corpus, tokenizers, deterministic batches fitted to a plan."""
import numpy as np
import pytest
import torch

from fusion.data.batches import Tokenizer, corpus_text, make_batches, tokenizer_for
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
    from fusion.data.batches import TextBatches

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
        with caplog.at_level(logging.WARNING, logger="fusion.data.batches"):
            batches = make_batches(plan, f"{tmp_path / 'data.py'}:with_ids")
            for step in range(7):
                batches(step)
        said = [r.getMessage() for r in caplog.records if "distinct sample ids" in r.getMessage()]
        assert len(said) == warned, said
        if warned:
            assert "step 2: more than 8 distinct sample ids" in said[0]


ITER_DATA = '''
import numpy as np
import torch
from torch.utils.data import DataLoader, TensorDataset

g = np.random.default_rng(7)
IDX = torch.from_numpy(g.integers(0, 5, (20, 8)))  # 20 samples: 5 steps of 4, then a new epoch
TGT = torch.from_numpy(g.integers(0, 5, (20, 8))).int()
MADE = []


def loader(batch_size=2, shuffle=False, split="train"):
    MADE.append(split)
    n = 8 if split == "val" else 20
    gen = torch.Generator().manual_seed(3) if shuffle else None
    return DataLoader(TensorDataset(IDX[:n], TGT[:n]), batch_size=batch_size, shuffle=shuffle, generator=gen)


def shuffled():
    return loader(shuffle=True)


def whole_steps():
    return loader(batch_size=4)


def by_step(step):
    """The step function the plain DataLoader amounts to (shuffle=False: 4 rows per step, 5 steps per epoch)."""
    i = (step % 5) * 4
    return {"idx": IDX[i:i + 4].numpy(), "targets": TGT[i:i + 4].numpy()}


def dicts():
    for i in range(0, 20, 2):
        yield {"idx": IDX[i:i + 2], "targets": TGT[i:i + 2]}


def short_tail():
    return [(IDX[i:min(i + 4, 18)], TGT[i:min(i + 4, 18)]) for i in range(0, 18, 4)]  # 4, 4, 4, 4, then 2 rows


def three_rows():
    return loader(batch_size=3)


def eight_rows():
    return loader(batch_size=8)


def three_values():
    return [(IDX[:4], TGT[:4], TGT[:4])]


def nothing():
    return []


def number():
    return 5
'''


def test_an_iterable_data_function_serves_consecutive_batches_by_step(tmp_path):
    """``--data file.py:fn`` where fn() returns a DataLoader (tuples), a generator (dicts) or a list: the steps are
    its consecutive batches (two DataLoader batches of 2 fill a global batch of 4), equal to a step function's,
    restarted for a new epoch; random access by step re-creates the iterable only when going back."""
    import sys

    (tmp_path / "data.py").write_text(ITER_DATA)
    model = _lm(5)
    plan = hand_plan(model, {n: "p0" for n in model.graph.nodes}, micro_batches=2)  # global batch 2 x 2 = 4 rows
    src = str(tmp_path / "data.py")
    ref = make_batches(plan, f"{src}:by_step")
    for name in ("loader", "whole_steps", "dicts"):
        fn = make_batches(plan, f"{src}:{name}")
        for step in range(12):  # past two epoch ends
            b, want = fn(step), ref(step)
            assert b["idx"].dtype == np.int64 and b["targets"].dtype == np.int64, name  # int32 -> the plan's int64
            for k in want:
                np.testing.assert_array_equal(b[k], want[k], err_msg=f"{name} step {step} {k}")
    fn = make_batches(plan, f"{src}:loader")
    seq = [fn(s) for s in range(8)]
    made = sys.modules["fusion_user_data"].MADE  # the module this make_batches imported
    assert made == ["train"]  # in order: one iterable, iter() again for the second epoch, never re-created
    np.testing.assert_array_equal(fn(3)["idx"], seq[3]["idx"])  # going back: re-created, steps 0..2 skipped
    np.testing.assert_array_equal(fn(4)["idx"], seq[4]["idx"])
    assert made == ["train", "train"]


def test_resuming_an_iterable_at_step_s_gives_the_uninterrupted_batches(tmp_path):
    """A shuffled DataLoader with a seeded generator: a fresh run's step S (``--resume``) skips exactly the batches
    of steps 0..S-1, through epoch ends (each epoch its own shuffle), so it sees what the uninterrupted run saw."""
    (tmp_path / "data.py").write_text(ITER_DATA)
    model = _lm(5)
    plan = hand_plan(model, {n: "p0" for n in model.graph.nodes}, micro_batches=2)
    spec = f"{tmp_path / 'data.py'}:shuffled"
    full = make_batches(plan, spec)
    seq = [full(s) for s in range(13)]
    assert not np.array_equal(seq[0]["idx"], seq[5]["idx"])  # the second epoch is shuffled anew
    assert sorted(np.concatenate([b["idx"] for b in seq[:5]]).tolist()) == sorted(seq[5]["idx"].tolist()
                                                                                   + np.concatenate([b["idx"] for b in seq[6:10]]).tolist())
    for s in (1, 4, 7, 12):
        resumed = make_batches(plan, spec)(s)
        for k in ("idx", "targets"):
            np.testing.assert_array_equal(resumed[k], seq[s][k], err_msg=f"resume at {s}")


def test_an_iterable_that_does_not_fit_the_plan_is_one_line(tmp_path, caplog):
    import logging

    (tmp_path / "data.py").write_text(ITER_DATA)
    model = _lm(5)
    plan = hand_plan(model, {n: "p0" for n in model.graph.nodes}, micro_batches=2)
    src = str(tmp_path / "data.py")
    for func, msg in [("three_rows", r"data '.*:three_rows': its iterable's batches have 3 rows, but a step of the "
                                     r"plan takes the global batch of 4 rows"),
                      ("eight_rows", "its iterable's batches have 8 rows, but a step of the plan takes the global batch of 4"),
                      ("three_values", r"an item of 3 values; .* inputs then labels \['idx', 'targets'\]"),
                      ("nothing", "the iterable yielded no batch"),
                      ("number", "returned int, expected an iterable of batches")]:
        with pytest.raises(FusionError, match=msg) as e:
            make_batches(plan, f"{src}:{func}")
        assert "\n" not in str(e.value)
    # a short last batch of an epoch (DataLoader without drop_last) is dropped, said once
    with caplog.at_level(logging.WARNING, logger="fusion.data.iterable"):
        fn = make_batches(plan, f"{src}:short_tail")
        steps = [fn(s) for s in range(9)]
    np.testing.assert_array_equal(steps[4]["idx"], steps[0]["idx"])  # 4 full batches, then the next epoch
    assert sum("short last batch" in r.getMessage() for r in caplog.records) == 1


def test_an_iterable_gives_the_held_out_batches_with_split_val(tmp_path):
    """--eval-every: fn(split="val") returning an iterable; its first K batches."""
    from fusion.data.batches import make_eval_batches

    (tmp_path / "data.py").write_text(ITER_DATA)
    model = _lm(5)
    plan = hand_plan(model, {n: "p0" for n in model.graph.nodes}, micro_batches=2)
    val = make_eval_batches(plan, f"{tmp_path / 'data.py'}:loader", count=3)
    ref = make_batches(plan, f"{tmp_path / 'data.py'}:by_step")
    for k, want in enumerate([0, 1, 0]):  # 8 held-out samples: 2 batches, then from the start again
        np.testing.assert_array_equal(val[k]["idx"], ref(want)["idx"])
    with pytest.raises(FusionError, match=r"called as shuffled\(split='val'\); it has no 'split' argument"):
        make_eval_batches(plan, f"{tmp_path / 'data.py'}:shuffled", count=1)


def test_which_data_functions_return_an_iterable():
    from fusion.data.iterable import returns_iterable

    def it(split="train"): ...
    def none(): ...
    def by_step(step): ...
    def step_default(step=0): ...
    def with_split(step, split=None): ...
    def star(*args): ...
    def k_only(k, split=None): ...

    assert [returns_iterable(f) for f in (it, none, by_step, step_default, with_split, star, k_only)] == [
        True, True, False, False, False, False, False]
