"""``--data text:PATH[?tokenizer=NAME&labels=next|same]``: the user's own text as training data.

PATH is a text file, or a folder whose ``.txt``, ``.md`` and ``.py`` files (found recursively, in sorted path
order, joined by a newline) make one text. It is tokenized once:

- byte-level by default (ids 0..255, so the model's vocabulary must hold 256);
- ``tokenizer=NAME``: a ``tokenizer.json`` file (the ``tokenizers`` package), or a ``transformers`` tokenizer
  (a folder, or a hub name already in the local cache). Nothing is downloaded: a tokenizer that is not
  available offline is one line saying so.

The tokens are cut into non-overlapping windows of ``T + 1`` (T: the model's sequence length). The last
``val_fraction`` of the text (``--val-split PCT``) is held out for validation and never trained on. Training visits
the windows epoch by epoch, each epoch in its own seeded order: sample ``i = step * rows + row`` is window
``order(epoch = i // W)[i % W]``. A batch is therefore a pure function of the step, which gives

- deterministic sharding over data-parallel replicas: the rows of one step are distinct windows, and whichever
  replica the coordinator hands a row to, it is the same window in every run; no two replicas see one window in
  an epoch;
- ``--resume``: a run resumed at step s continues at sample ``s * rows``, exactly where the first run stopped.

Labels are the next tokens (``labels=next``, a model that computes its loss on ``idx -> targets``), or the input
ids themselves for a model that shifts them inside (``labels=same``: the ``transformers`` convention, the default
when the placeholders are named ``input_ids`` and ``labels``).
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable
from urllib.parse import parse_qs

import numpy as np

from fusion.ir.errors import FusionError

log = logging.getLogger(__name__)

#: file suffixes a folder of text contributes
TEXT_SUFFIXES = (".txt", ".md", ".py")


@dataclass(frozen=True)
class TextSpec:
    """``text:PATH?tokenizer=NAME&labels=...`` parsed. tokenizer: None for byte-level; labels: next, same or auto."""

    path: Path
    tokenizer: str | None = None
    labels: str = "auto"

    @classmethod
    def parse(cls, spec: str) -> "TextSpec":
        body = spec[len("text:"):]
        path, _, query = body.partition("?")
        if not path:
            raise FusionError(f"--data {spec}: name a text file or folder (text:PATH)")
        opts = {k: v[-1] for k, v in parse_qs(query, keep_blank_values=True).items()}
        unknown = sorted(set(opts) - {"tokenizer", "labels"})
        if unknown:
            raise FusionError(f"--data {spec}: unknown option(s) {unknown}; known: tokenizer, labels")
        labels = opts.get("labels", "auto")
        if labels not in ("auto", "next", "same"):
            raise FusionError(f"--data {spec}: labels={labels!r}; choose next (next tokens) or same (the input ids)")
        return cls(Path(path), opts.get("tokenizer") or None, labels)


def read_text(path: Path) -> str:
    """The text of a file, or of a folder's text files (sorted, newline-joined); refuses what holds none."""
    if path.is_file():
        files = [path]
    elif path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in TEXT_SUFFIXES)
        if not files:
            raise FusionError(f"--data text:{path}: the folder holds no {', '.join(TEXT_SUFFIXES)} files")
    else:
        raise FusionError(f"--data text:{path}: no such file or folder")
    parts = []
    for f in files:
        try:
            parts.append(f.read_text(encoding="utf-8", errors="replace"))
        except OSError as e:
            raise FusionError(f"--data text:{path}: cannot read {f} ({e.strerror})") from None
    return "\n".join(parts)


def load_tokenizer(name: str) -> tuple[Callable[[str], list[int]], int]:
    """``(encode, vocab_size)`` of tokenizer ``name``, from local files only."""
    p = Path(name)
    if p.is_file():
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise FusionError(f"tokenizer={name}: reading a tokenizer.json needs the tokenizers package "
                              "(pip install tokenizers)") from None
        try:
            tok = Tokenizer.from_file(str(p))
        except Exception as e:  # tokenizers' own error type
            raise FusionError(f"tokenizer={name}: cannot read it ({' '.join(str(e).split())[:200]})") from None
        return (lambda t: tok.encode(t).ids), tok.get_vocab_size()
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise FusionError(f"tokenizer={name}: not a tokenizer.json file, and a tokenizer by name needs the "
                          "transformers package") from None
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # fusion downloads nothing
    try:
        tok = AutoTokenizer.from_pretrained(name, local_files_only=True)
    except Exception:  # noqa: BLE001 - any failure means: not here
        raise FusionError(f"tokenizer={name}: not available offline (not a tokenizer.json file, not a tokenizer "
                          "folder, not in the local Hugging Face cache); fusion downloads nothing") from None
    return (lambda t: tok(t, add_special_tokens=False)["input_ids"]), len(tok)


def tokenize(spec: TextSpec) -> tuple[np.ndarray, int, str]:
    """The tokens of ``spec``'s text, its vocabulary size, and a description of the tokenizer."""
    text = read_text(spec.path)
    if spec.tokenizer is None:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int64), 256, "byte-level"
    encode, vocab = load_tokenizer(spec.tokenizer)
    return np.asarray(encode(text), dtype=np.int64), vocab, f"tokenizer {spec.tokenizer}"


class WindowBatches:
    """Non-overlapping windows of ``seq_len + 1`` tokens, visited epoch by epoch in a seeded order.

    ``batch(step)`` -> ``(inputs, next_tokens, sample_ids)`` for the ``rows`` windows of that step; the sample id
    of a row is its window's index. ``shuffle=False`` visits the windows in text order (validation).
    """

    def __init__(self, tokens: np.ndarray, rows: int, seq_len: int, seed: int = 0, shuffle: bool = True,
                 what: str = "text"):
        self.windows = (len(tokens) - 1) // seq_len
        if self.windows < 1:
            raise FusionError(f"{what}: {len(tokens)} tokens are too few for one window of {seq_len + 1}")
        self.tokens, self.rows, self.seq_len, self.seed, self.shuffle = tokens, rows, seq_len, seed, shuffle
        self._orders: dict[int, np.ndarray] = {}

    def _order(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(self.windows)
        if epoch not in self._orders:
            self._orders = {epoch: np.random.default_rng([self.seed, epoch]).permutation(self.windows)}
        return self._orders[epoch]

    def window_ids(self, step: int) -> np.ndarray:
        i = step * self.rows + np.arange(self.rows)
        out = np.empty(self.rows, np.int64)
        for epoch in np.unique(i // self.windows):
            sel = i // self.windows == epoch
            out[sel] = self._order(int(epoch))[i[sel] % self.windows]
        return out

    def batch(self, step: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        ids = self.window_ids(step)
        T = self.seq_len
        w = np.stack([self.tokens[k * T:k * T + T + 1] for k in ids])
        return np.ascontiguousarray(w[:, :-1]), np.ascontiguousarray(w[:, 1:]), ids


def split(tokens: np.ndarray, val_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """(train, validation): the last ``val_fraction`` of the tokens held out."""
    cut = len(tokens) - int(round(len(tokens) * val_fraction))
    return tokens[:cut], tokens[cut:]
