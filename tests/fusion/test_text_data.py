"""``--data text:PATH``: the user's text, byte-level or an offline tokenizer, a held-out validation split,
batches a pure function of the step (sharding over replicas, ``--resume``), ids beyond the vocabulary refused.

Before: ``--data`` took only auto|text|synthetic (the built-in corpus) or a ``file.py:function``; ``text:PATH``
was "unknown data kind"."""
import numpy as np
import pytest
import torch

from fusion.data.batches import make_batches
from fusion.executors.runtime.launcher import hand_plan
from fusion.ir.builder import GraphBuilder
from fusion.ir.errors import FusionError


def _lm(vocab: int, mb: int = 2, T: int = 8, names=("idx", "targets"), micro_batches: int = 2):
    b = GraphBuilder()
    idx, y = b.input(names[0]), b.label(names[1])
    h = b.module("wte", "torch.nn.Embedding", idx, num_embeddings=vocab, embedding_dim=8)
    o = b.module("head", "torch.nn.Linear", h, in_features=8, out_features=vocab)
    o = b.function("flat", "torch.Tensor.reshape", o, -1, vocab)
    t = b.function("flat_t", "torch.Tensor.reshape", y, -1)
    b.loss("loss", "torch.nn.functional.cross_entropy", o, t)
    model = b.build(example={names[0]: torch.zeros(mb, T, dtype=torch.long), names[1]: torch.zeros(mb, T, dtype=torch.long)})
    return hand_plan(model, {n: "p0" for n in model.graph.nodes}, micro_batches=micro_batches)


@pytest.fixture
def corpus(tmp_path):
    d = tmp_path / "corpus"
    (d / "sub").mkdir(parents=True)
    letters = np.random.default_rng(0).integers(0, 26, (500, 5))  # words of random letters: no two windows alike
    words = ["".join(chr(97 + c) for c in w) for w in letters]
    (d / "a.txt").write_text(" ".join(words[:300]) + " the quick brown fox")
    (d / "sub" / "b.py").write_text(" ".join(words[300:]))
    (d / "skip.bin").write_bytes(b"\xff" * 1000)
    return d


def test_a_text_folder_trains_byte_level_windows_in_epochs(corpus):
    plan = _lm(256)
    fn = make_batches(plan, f"text:{corpus}", seed=3)
    text = (corpus / "a.txt").read_text() + "\n" + (corpus / "sub" / "b.py").read_text()  # sorted, .bin skipped
    tokens = np.frombuffer(text.encode(), np.uint8).astype(np.int64)
    windows = (len(tokens) - 1) // 8
    rows = 4
    index = {tokens[w * 8:w * 8 + 8].tobytes(): w for w in range(windows)}
    assert len(index) == windows
    seen = []
    for step in range(windows // rows):  # one epoch: every window once
        b = fn(step)
        assert b["idx"].shape == (rows, 8) and b["targets"].shape == (rows, 8)
        np.testing.assert_array_equal(b["idx"][:, 1:], b["targets"][:, :-1])  # next tokens
        seen += [index[row.tobytes()] for row in b["idx"]]
    assert len(set(seen)) == len(seen) == windows // rows * rows  # distinct samples across the epoch
    np.testing.assert_array_equal(fn(5)["idx"], make_batches(plan, f"text:{corpus}", seed=3)(5)["idx"])  # resume
    assert not np.array_equal(fn(5)["idx"], make_batches(plan, f"text:{corpus}", seed=4)(5)["idx"])
    assert fn.validation is None and fn.tokenizer == "byte-level"


def test_the_rows_of_a_step_are_distinct_windows(corpus):
    """The global batch (every micro-batch of every replica; the coordinator hands each replica its rows) holds
    distinct windows, so no two replicas or micro-batches train on one sample in a step."""
    b = make_batches(_lm(256, micro_batches=8), f"text:{corpus}")(7)
    assert b["idx"].shape == (16, 8)
    assert len({r.tobytes() for r in b["idx"]}) == 16


def test_validation_split_holds_out_the_end_of_the_text(tmp_path):
    f = tmp_path / "t.txt"
    f.write_text("".join(chr(97 + i) for i in np.random.default_rng(0).integers(0, 26, 4000)))
    plan = _lm(256)
    fn = make_batches(plan, f"text:{f}", val_fraction=0.25)
    tokens = np.frombuffer(f.read_bytes(), np.uint8).astype(np.int64)
    cut = len(tokens) - len(tokens) // 4
    val = fn.validation(0)["idx"]
    np.testing.assert_array_equal(val[0], tokens[cut:cut + 8])  # the held-out part, in order
    train = np.concatenate([fn(s)["idx"] for s in range(100)])
    starts = {r.tobytes() for r in train}
    held = {tokens[cut + 8 * k:cut + 8 * k + 8].tobytes() for k in range((len(tokens) - cut - 1) // 8)}
    trainable = {tokens[8 * k:8 * k + 8].tobytes() for k in range((cut - 1) // 8)}
    assert starts <= trainable and held - trainable  # trains only on the first 75%


def test_transformers_placeholders_get_the_input_ids_as_labels(corpus):
    plan = _lm(256, names=("input_ids", "labels"))
    b = make_batches(plan, f"text:{corpus}")(0)
    np.testing.assert_array_equal(b["input_ids"], b["labels"])  # the model shifts them itself
    b = make_batches(plan, f"text:{corpus}?labels=next")(0)
    np.testing.assert_array_equal(b["input_ids"][:, 1:], b["labels"][:, :-1])


@pytest.mark.parametrize("spec, words", [
    ("text:{d}/nope", "no such file or folder"),
    ("text:{d}?tokenizer=no-such-tokenizer-anywhere", "not available offline"),
    ("text:{d}?labels=maybe", "labels='maybe'"),
    ("text:{d}?vocab=9", "unknown option(s) ['vocab']"),
])
def test_bad_text_specs_are_one_line(corpus, spec, words):
    with pytest.raises(FusionError, match=None) as e:
        make_batches(_lm(256), spec.format(d=corpus))
    assert words in str(e.value) and "\n" not in str(e.value)


def test_a_tokenizer_json_file_is_used_offline(corpus, tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import models, pre_tokenizers

    vocab = {w: i for i, w in enumerate(["[UNK]", "line", "the", "quick", "brown", "fox", "def", "return", "x"])}
    tok = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    fn = make_batches(_lm(16), f"text:{corpus}?tokenizer={tmp_path / 'tokenizer.json'}")
    assert fn(0)["idx"].max() < len(vocab) and fn.tokenizer.startswith("tokenizer ")


def test_ids_beyond_the_vocabulary_are_refused_naming_the_field(corpus, tmp_path):
    """Byte-level text for a 64-token model, and a data function feeding id 64: one line naming the field
    (before: the embedding failed inside an executor)."""
    with pytest.raises(FusionError, match=r"field 'idx' gets token ids up to \d+ .*beyond the model's vocabulary of 64"):
        make_batches(_lm(64), f"text:{corpus}")
    (tmp_path / "d.py").write_text("import numpy as np\n"
                                   "def f(step):\n    return {'idx': np.full((4, 8), 64), 'targets': np.zeros((4, 8), int)}\n")
    with pytest.raises(FusionError, match=r"step 0: field 'idx' holds id 64, outside the model's vocabulary of 64"):
        make_batches(_lm(64), f"{tmp_path / 'd.py'}:f")
