"""Training data for ``fusion run``: a generated text corpus and synthetic batches.

Nothing is downloaded. The text corpus is generated locally from a fixed
grammar and a seeded generator (small stories with consistent arithmetic,
so a language model has something to learn), tokenized byte-level (vocab
256) or character-level (vocab = the corpus's characters) to fit the
model's vocabulary. Every batch is a pure function of ``(seed, step)``, so a
resumed run sees exactly the batches an uninterrupted one would.

:func:`make_batches` looks at a plan's placeholders: one integer input of
shape ``[mb, T]`` plus one integer label of shape ``[mb, T]`` (or ``[mb*T]``)
is a language model and gets text; anything else gets synthetic batches of
the right shapes and dtypes (normal floats; integer labels within the
classes of the loss they feed; integer inputs within the embedding they feed).
"""
from __future__ import annotations

import logging
import math
import random
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from fusion.ir.errors import FusionError
from fusion.ir.feeds import feed_dtype, index_bound
from fusion.ir.node import NodeKind, TensorMeta
from fusion.ir.opdata import SAMPLE_IDS

log = logging.getLogger(__name__)

_NAMES = ["Ada", "Alan", "Grace", "Edsger", "Barbara", "Donald", "Frances", "John", "Radia", "Ken"]
_ITEMS = ["apple", "book", "coin", "shell", "stone", "card", "key", "cup"]
_NUMS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven", "twelve"]


def corpus_text(n_chars: int = 200_000, seed: int = 0) -> str:
    """A deterministic English-like corpus of about ``n_chars`` characters."""
    rng = random.Random(seed)
    out: list[str] = []
    size = 0
    while size < n_chars:
        a, b = rng.sample(_NAMES, 2)
        item = rng.choice(_ITEMS)
        n = rng.randint(2, 12)
        m = rng.randint(1, n)
        k = rng.randint(0, 12 - (n - m))
        s = (f"{a} has {_NUMS[n]} {item}s. {a} gives {_NUMS[m]} to {b}, so {a} has {_NUMS[n - m]} left. "
             f"Then {a} finds {_NUMS[k]} more and has {_NUMS[n - m + k]} {item}s.\n")
        if rng.random() < 0.3:
            x, y = rng.randint(0, 6), rng.randint(0, 6)
            s += f"{_NUMS[x]} plus {_NUMS[y]} is {_NUMS[x + y]}.\n"
        out.append(s)
        size += len(s)
    return "".join(out)


@dataclass(frozen=True)
class Tokenizer:
    """Byte-level (``chars`` empty, vocab 256) or character-level (vocab ``len(chars)``)."""

    chars: str = ""

    @property
    def vocab_size(self) -> int:
        return len(self.chars) if self.chars else 256

    def encode(self, text: str) -> np.ndarray:
        if not self.chars:
            return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int64)
        index = {c: i for i, c in enumerate(self.chars)}
        return np.array([index[c] for c in text], dtype=np.int64)

    def decode(self, ids) -> str:
        if not self.chars:
            return bytes(int(i) for i in ids).decode("utf-8", "replace")
        return "".join(self.chars[int(i)] for i in ids)


def tokenizer_for(vocab_size: int, text: str) -> Tokenizer:
    """Byte-level when the model has at least 256 tokens, else character-level if it fits."""
    if vocab_size >= 256:
        return Tokenizer()
    chars = "".join(sorted(set(text)))
    if len(chars) > vocab_size:
        raise FusionError(f"the model's vocabulary ({vocab_size}) is smaller than the corpus's {len(chars)} characters; "
                          "use a vocabulary of at least 256 (byte-level) or --data synthetic")
    return Tokenizer(chars)


class TextBatches:
    """Next-token batches: ``batch(step)`` gives random windows of ``seq_len + 1`` tokens."""

    def __init__(self, tokens: np.ndarray, rows: int, seq_len: int, seed: int = 0):
        if len(tokens) <= seq_len + 1:
            raise FusionError(f"corpus of {len(tokens)} tokens is too short for sequences of {seq_len}")
        self.tokens, self.rows, self.seq_len, self.seed = tokens, rows, seq_len, seed

    def _starts(self, step: int) -> np.ndarray:
        g = np.random.default_rng([self.seed, step])
        return g.integers(0, len(self.tokens) - self.seq_len - 1, self.rows)

    def batch(self, step: int) -> tuple[np.ndarray, np.ndarray]:
        w = np.stack([self.tokens[s:s + self.seq_len + 1] for s in self._starts(step)])
        return np.ascontiguousarray(w[:, :-1]), np.ascontiguousarray(w[:, 1:])

    def sample_ids(self, step: int) -> np.ndarray:
        """The sample id of each row of ``batch(step)``: its window's start token, so a window drawn again
        is the same sample (what ``delta`` edges key their buffers by). A window drawn twice in one batch
        gets ``start + k * len(tokens)`` for its k-th repeat, keeping the ids of a batch unique."""
        starts = self._starts(step).astype(np.int64)
        seen: dict[int, int] = {}
        out = np.empty_like(starts)
        for j, s in enumerate(starts.tolist()):
            k = seen.get(s, 0)
            seen[s] = k + 1
            out[j] = s + k * len(self.tokens)
        return out


def _shape(spec: dict) -> tuple[int, ...]:
    return tuple(int(s) for s in spec["shape"])


def _is_int(dtype: str) -> bool:
    return dtype.startswith(("int", "uint"))


def _int_high(graph, name: str, default: int | None = 2) -> int | None:
    """Exclusive upper bound for an integer placeholder: classes of the loss or rows of the embedding it feeds
    (``default`` when it feeds neither; ``fusion.ir.feeds.index_bound``)."""
    bound = index_bound(graph, name)
    return bound.high if bound is not None else default


def _delta_edges(plan) -> list[str]:
    """The plan's ``delta`` (AQ-SGD) edges as ``producer src->dst``: they need sample ids from the data."""
    from fusion.kernels.codecs import CODECS

    return [f"{e.producer} {e.src}->{e.dst}" for e in plan.compression or () if CODECS.needs_sample_ids(e.codec("fwd"))]


def _placeholder_specs(plan) -> dict[str, dict]:
    g = plan.graph
    specs = {n: plan.example.get(n) for n in g.nodes if g[n].kind in (NodeKind.INPUT, NodeKind.LABEL)}
    for n, s in specs.items():
        if s is None:
            raise FusionError(f"plan: field 'example' has no shape for placeholder {n!r}")
    return specs


def user_batches(plan, spec: str, split: str | None = None) -> Callable[[int], dict[str, np.ndarray]]:
    """``step -> batch`` from the user's ``file.py:function``; every batch is checked against the plan.

    The function takes the step number and returns a mapping placeholder name ->
    array holding all micro-batches of the iteration (dim 0 = micro-batch size x
    ``plan.micro_batches`` x ``plan.replicas``: the global batch); it should be a pure function of the step so that a
    resumed run sees the batches an uninterrupted one would. Arrays are cast to the
    plan's dtype when the kind (float, integer, bool) agrees; anything else is a
    :class:`FusionError` naming the function, the step and the field. ``split="val"``: the held-out batches of
    ``--eval-every``, from ``function(k, split="val")`` (:func:`make_eval_batches`).

    A function without a step argument returns an iterable of batches instead (a ``DataLoader``, a generator, a
    list): :class:`fusion.data.iterable.IterableSteps` takes consecutive items for each step (``function(split="val")``
    for the held-out batches), and its batches go through the same checks.
    """
    from fusion.data.iterable import IterableSteps, returns_iterable
    from fusion.loader import load_function

    fn = load_function(spec, "data")
    specs, nm = _placeholder_specs(plan), plan.micro_batches * plan.replicas
    want = {n: (_shape(s)[0] * nm, *_shape(s)[1:]) for n, s in specs.items()}
    delta = _delta_edges(plan)
    inputs = [n for n in specs if plan.graph[n].kind == NodeKind.INPUT]
    rows = want[inputs[0]][0] if inputs else next(iter(want.values()))[0]  # samples per iteration
    if returns_iterable(fn):  # fn() -> iterable of batches (fusion.data.iterable): consecutive items make the steps
        labels = [n for n in specs if plan.graph[n].kind == NodeKind.LABEL]
        make, kw = fn, ({} if split is None else {"split": split})
        steps = IterableSteps(lambda: make(**kw), f"data {spec!r}", inputs + labels, rows, (inputs + labels)[0])
        call: Callable[[int], Any] = steps
    else:
        call = fn if split is None else (lambda step: fn(step, split=split))  # a function of the step
    declared = (plan.predicted or {}).get("delta_samples") if delta else None  # what the buffers were sized for
    seen: set[int] = set()
    # the index range an integer input may take (ir.feeds: the same bound the coordinator checks every feed against)
    vocab = {n: b for n in inputs if _is_int(specs[n]["dtype"]) for b in [index_bound(plan.graph, n)] if b is not None}

    def batch(step: int) -> dict[str, np.ndarray]:
        try:
            got = call(step)
        except Exception as e:
            if isinstance(e, FusionError) and isinstance(call, IterableSteps):  # IterableSteps' own one-line errors
                raise
            from fusion.loader import user_error

            raise FusionError(f"data {spec!r}: step {step}: {user_error(e, spec.rpartition(':')[0])}") from None
        if not isinstance(got, dict):
            raise FusionError(f"data {spec!r}: step {step}: returned {type(got).__name__}, expected a dict "
                              f"of placeholder -> array ({', '.join(want)})")
        missing, extra = [n for n in want if n not in got], [n for n in got if n not in want and n != SAMPLE_IDS]
        if delta and SAMPLE_IDS not in got:
            missing.append(SAMPLE_IDS)
        if missing or extra:
            raise FusionError(f"data {spec!r}: step {step}: " + "; ".join(
                ([f"missing field(s) {missing}"] if missing else []) + ([f"unknown field(s) {extra}"] if extra else []))
                + f" (the plan's placeholders: {list(want)})")
        out = {}
        for n, shape in want.items():
            a = np.asarray(got[n])
            dt = feed_dtype(specs[n]["dtype"])
            if a.dtype.kind != dt.kind and not (a.dtype.kind in "iu" and dt.kind in "iu"):
                raise FusionError(f"data {spec!r}: step {step}: field {n!r} has dtype {a.dtype}, the plan expects {dt}")
            if a.shape != shape:
                raise FusionError(f"data {spec!r}: step {step}: field {n!r} has shape {list(a.shape)}, the plan expects "
                                  f"{list(shape)} ({nm} micro-batch(es) of {list(_shape(specs[n]))})")
            out[n] = np.ascontiguousarray(a, dtype=dt)
            hit = vocab[n].first_outside(a) if n in vocab and a.size else None
            if hit is not None:
                high = vocab[n].high
                raise FusionError(f"data {spec!r}: step {step}: field {n!r} holds id {hit[1]}, outside the model's "
                                  f"vocabulary of {high} (ids 0..{high - 1})")
        if SAMPLE_IDS in got:
            ids = np.asarray(got[SAMPLE_IDS])
            if ids.ndim != 1 or ids.dtype.kind not in "iu" or ids.size != rows or np.unique(ids).size != ids.size:
                raise FusionError(f"data {spec!r}: step {step}: field {SAMPLE_IDS!r} must be {rows} distinct integer "
                                  f"sample ids (one per row), got {ids.dtype}{list(ids.shape)}")
            out[SAMPLE_IDS] = ids.astype(np.int64)
            if declared and len(seen) <= declared:
                seen.update(out[SAMPLE_IDS].tolist())
                if len(seen) > declared:
                    log.warning("data %r: step %d: more than %d distinct sample ids, the --samples the plan sized its "
                                "delta (AQ-SGD) buffers for; they keep one activation per id and will outgrow the "
                                "predicted memory", spec, step, declared)
        return out

    first = {0: batch(0)}  # fail before any process starts; step 0 is then served from here, not fetched twice

    def checked(step: int) -> dict[str, np.ndarray]:
        return first.pop(step) if step in first else batch(step)

    return checked


def _language_model(g, specs: dict[str, dict]) -> tuple[list[str], list[str], bool]:
    """(inputs, labels, whether they are one integer input [mb, T] and one integer label of its size)."""
    ins = [n for n in specs if g[n].kind == NodeKind.INPUT]
    labs = [n for n in specs if g[n].kind == NodeKind.LABEL]
    lm = (len(ins) == 1 and len(labs) == 1 and _is_int(specs[ins[0]]["dtype"]) and _is_int(specs[labs[0]]["dtype"])
          and len(_shape(specs[ins[0]])) == 2 and math.prod(_shape(specs[labs[0]])) == math.prod(_shape(specs[ins[0]])))
    return ins, labs, lm


def corpus_samples(graph, kind: str = "auto") -> int | None:
    """How many distinct samples the built-in text corpus gives ``graph`` with ``--data kind``: its windows
    of ``T + 1`` tokens (one per start token; what :meth:`TextBatches.sample_ids` names), or None when the
    data is not the corpus (synthetic data, a ``file.py:function``, a model that is not a language model).
    The compiler sizes the ``delta`` (AQ-SGD) buffers by it. A window drawn twice in one batch gets a
    further id (``start + k * len(tokens)``); such repeats are rare and not counted."""
    if kind not in ("auto", "text"):
        return None
    specs = {}
    for n in graph.placeholders():
        o = n.meta.outputs[0] if n.meta.outputs else None
        if not isinstance(o, TensorMeta):
            return None
        specs[n.name] = {"shape": list(o.shape), "dtype": o.dtype}
    _, _, lm = _language_model(graph, specs)
    if not lm:
        return None
    x = next(n for n in specs if graph[n].kind == NodeKind.INPUT)
    return max(0, len(corpus_text(seed=0)) - _shape(specs[x])[1] - 1)  # TextBatches._starts' range


def text_batches(plan, spec: str, seed: int = 0, val_fraction: float = 0.0) -> Callable[[int], dict[str, np.ndarray]]:
    """``step -> batch`` from the user's text (``text:PATH[?tokenizer=NAME&labels=next|same]``,
    :mod:`fusion.data.text`). The function has ``.validation``: ``k -> batch`` of the held-out last
    ``val_fraction`` of the text in order (None when nothing is held out), and ``.tokenizer``: its description."""
    from fusion.data.text import TextSpec, WindowBatches, split, tokenize

    ts = TextSpec.parse(spec)
    g, nm = plan.graph, plan.micro_batches * plan.replicas
    specs = _placeholder_specs(plan)
    ins, labs, lm = _language_model(g, specs)
    if not lm:
        raise FusionError(f"--data {spec} needs a language model: one integer input [micro_batch, T] and one integer "
                          f"label of the same size (the plan's placeholders: {list(specs)})")
    x, y = ins[0], labs[0]
    mb, T = _shape(specs[x])
    same = ts.labels == "same" or (ts.labels == "auto" and (x, y) == ("input_ids", "labels"))
    tokens, vocab, how = tokenize(ts)
    high = _int_high(g, x, default=None)
    if high is not None and len(tokens) and int(tokens.max()) >= high:
        raise FusionError(f"--data {spec}: field {x!r} gets token ids up to {int(tokens.max())} ({how}, vocabulary "
                          f"{vocab}), beyond the model's vocabulary of {high}; use a model with at least {vocab} "
                          "tokens or a tokenizer that fits (text:PATH?tokenizer=NAME)")
    if not 0.0 <= val_fraction < 1.0:
        raise FusionError(f"--val-split must be a percentage in [0, 100), got {val_fraction * 100:g}")
    train_tokens, val_tokens = split(tokens, val_fraction)
    rows = mb * nm
    src = WindowBatches(train_tokens, rows, T, seed, what=f"--data {spec} (training part)")
    val = (WindowBatches(val_tokens, rows, T, seed, shuffle=False, what=f"--data {spec} (validation part)")
           if val_fraction > 0 else None)
    lshape = (rows, *_shape(specs[y])[1:]) if len(_shape(specs[y])) > 1 else (rows * T,)
    delta = _delta_edges(plan)

    def fit(a, b, ids) -> dict[str, np.ndarray]:
        out = {x: a.astype(specs[x]["dtype"]), y: (a if same else b).reshape(lshape).astype(specs[y]["dtype"])}
        if delta:
            out[SAMPLE_IDS] = ids
        return out

    def batch(step: int) -> dict[str, np.ndarray]:
        return fit(*src.batch(step))

    batch.validation = (lambda k: fit(*val.batch(k))) if val else None  # type: ignore[attr-defined]
    batch.tokenizer = how  # type: ignore[attr-defined]
    log.info("--data %s: %d tokens (%s), %d training windows of %d%s; labels %s", spec, len(tokens), how,
             src.windows, T + 1, f", {val.windows} held out" if val else "", "= inputs" if same else "= next tokens")
    return batch


def make_batches(plan, kind: str = "auto", seed: int = 0, val_fraction: float = 0.0) -> Callable[[int], dict[str, np.ndarray]]:
    """``step -> batch`` (placeholder -> array of all micro-batches) for ``plan``.

    ``kind``: ``auto``, ``text``, ``synthetic``, ``text:PATH[?tokenizer=NAME]`` (the user's text,
    :func:`text_batches`, with ``val_fraction`` of it held out), or the user's ``file.py:function``
    (:func:`user_batches`).
    """
    if kind.startswith("text:"):
        return text_batches(plan, kind, seed, val_fraction)
    if kind not in ("auto", "text", "synthetic"):
        if ":" in kind:
            return user_batches(plan, kind)
        raise FusionError(f"unknown data kind {kind!r} (auto, text, synthetic, or file.py:function)")
    g, nm = plan.graph, plan.micro_batches * plan.replicas  # the global batch: every replica's micro-batches
    specs = _placeholder_specs(plan)
    delta = _delta_edges(plan)
    ins, labs, lm = _language_model(g, specs)
    if kind == "text" and not lm:
        raise FusionError("--data text needs one integer input [micro_batch, T] and one integer label of the same size")
    if lm and kind != "synthetic":
        x, y = ins[0], labs[0]
        mb, T = _shape(specs[x])
        text = corpus_text(seed=0)
        tok = tokenizer_for(_int_high(g, x), text)
        src = TextBatches(tok.encode(text), mb * nm, T, seed)
        lshape = (mb * nm, *_shape(specs[y])[1:]) if len(_shape(specs[y])) > 1 else (mb * nm * T,)

        def text_batch(step: int) -> dict[str, np.ndarray]:
            a, b = src.batch(step)
            out = {x: a.astype(specs[x]["dtype"]), y: b.reshape(lshape).astype(specs[y]["dtype"])}
            if delta:
                out[SAMPLE_IDS] = src.sample_ids(step)
            return out

        text_batch.tokenizer = tok  # type: ignore[attr-defined]
        return text_batch
    if delta:
        raise FusionError(f"the plan compresses {delta[0]} with delta (AQ-SGD), which keeps a buffer per training "
                          "sample; synthetic batches never show a sample twice and carry no sample ids: use the text "
                          f"corpus or a --data function that returns {SAMPLE_IDS!r}")
    highs = {n: _int_high(g, n) for n, s in specs.items() if _is_int(s["dtype"])}

    def synthetic_batch(step: int) -> dict[str, np.ndarray]:
        r = np.random.default_rng([seed, step])
        out: dict[str, Any] = {}
        for n, s in specs.items():
            shape = (_shape(s)[0] * nm, *_shape(s)[1:])
            if _is_int(s["dtype"]):
                out[n] = r.integers(0, highs[n], shape).astype(s["dtype"])
            elif s["dtype"] == "bool":
                out[n] = r.random(shape) < 0.5
            else:
                out[n] = r.standard_normal(shape).astype(feed_dtype(s["dtype"]))
        return out

    return synthetic_batch


#: the corpus seed of the held-out text (the training text is ``corpus_text(seed=0)``)
VAL_CORPUS_SEED = 1
#: added to the run's seed for held-out synthetic batches (the training batches draw from ``[seed, step]``)
VAL_SEED_OFFSET = 2**31


def make_eval_batches(plan, kind: str = "auto", seed: int = 0, count: int = 1) -> list[dict[str, np.ndarray]]:
    """The ``count`` held-out batches of ``--eval-every`` (each a global batch, as :func:`make_batches`'s).

    - the built-in text corpus: windows of another text of the same generator (``corpus_text(seed=1)``),
      tokenized with the training text's tokenizer, drawn as the training windows are;
    - synthetic data: the same distribution from another seed (``seed + 2**31``);
    - the user's ``file.py:function``: ``function(k, split="val")`` for ``k`` in ``0..count-1`` (a function without
      a ``split`` argument is refused in one line when the run starts).
    Pure functions of ``(seed, k)``: every evaluation of a run sees the same batches.
    """
    if kind not in ("auto", "text", "synthetic"):
        if ":" in kind:
            import inspect

            from fusion.loader import load_function

            fn = load_function(kind, "data")
            try:
                params = inspect.signature(fn).parameters
            except (TypeError, ValueError):
                params = {}
            if "split" not in params and not any(p.kind == p.VAR_KEYWORD for p in params.values()):
                from fusion.data.iterable import returns_iterable

                call = "(split='val')" if returns_iterable(fn) else "(k, split='val')"
                raise FusionError(f"data {kind!r}: --eval-every takes held-out batches from the function called as "
                                  f"{kind.rpartition(':')[2]}{call}; it has no 'split' argument")
            fn_val = user_batches(plan, kind, split="val")
            return [fn_val(k) for k in range(count)]
        raise FusionError(f"unknown data kind {kind!r} (auto, text, synthetic, or file.py:function)")
    train = make_batches(plan, kind, seed)
    tok = getattr(train, "tokenizer", None)
    if tok is None:  # synthetic
        held_out = make_batches(plan, kind, seed + VAL_SEED_OFFSET)
        return [held_out(k) for k in range(count)]
    g, nm = plan.graph, plan.micro_batches * plan.replicas
    specs = _placeholder_specs(plan)
    ins, labs, _ = _language_model(g, specs)
    x, y = ins[0], labs[0]
    mb, T = _shape(specs[x])
    text = corpus_text(seed=VAL_CORPUS_SEED)
    known = set(tok.chars) if tok.chars else None
    if known is not None:  # character-level: the held-out text keeps the training text's characters
        text = "".join(c for c in text if c in known)
    src = TextBatches(tok.encode(text), mb * nm, T, seed)
    lshape = (mb * nm, *_shape(specs[y])[1:]) if len(_shape(specs[y])) > 1 else (mb * nm * T,)
    out = []
    for k in range(count):
        a, b = src.batch(k)
        batch = {x: a.astype(specs[x]["dtype"]), y: b.reshape(lshape).astype(specs[y]["dtype"])}
        if _delta_edges(plan):
            batch[SAMPLE_IDS] = src.sample_ids(k)  # carried as a step's are; an evaluation touches no delta buffer
        out.append(batch)
    return out
