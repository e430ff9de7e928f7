"""A ``--data file.py:function`` that returns an iterable of batches, served as ``step -> batch``.

The function takes no step argument and returns any iterable of batches: a ``torch.utils.data.DataLoader``, a
generator, a list, or any object with ``__iter__`` (a Hugging Face ``datasets`` iterable among them). Each item
is either a mapping placeholder name -> tensor/array, or a tuple/list matched to the model's inputs then labels,
in graph order (what a ``DataLoader`` over a ``TensorDataset`` yields).

Steps take consecutive items. A step of the plan takes the global batch (micro-batch x ``micro_batches`` x
``replicas`` rows); an item of ``b`` rows where ``b`` divides the global batch ``G`` fills a step with ``G / b``
consecutive items concatenated along dim 0; any other size is refused (by the caller's checks, naming both sizes).
Sample ``i`` of the stream is therefore row ``i % G`` of step ``i // G``, whatever the item size.

When the iterable is exhausted it starts again, a new epoch: ``iter()`` on the same object (a ``DataLoader`` draws
its next shuffle from its generator), or, for a one-shot iterator (a generator), the function is called again.
A short last item of an epoch (a ``DataLoader`` without ``drop_last``) is dropped, as ``drop_last=True`` would, and
said once in the log. Step ``s`` after step ``s - 1`` is the next items of the cached iterator; any other step
(``--resume`` at ``S``, a restart going back) calls the function again and skips the items of steps ``0..s-1``
(reading them: deterministic when the iterable is, e.g. a ``DataLoader`` with ``shuffle=False`` or a seeded
``generator``).
"""
from __future__ import annotations

import inspect
import logging
from typing import Any, Callable, Iterable, Iterator

import numpy as np

from fusion.ir.errors import FusionError

log = logging.getLogger(__name__)


def returns_iterable(fn: Callable[..., Any]) -> bool:
    """Whether a data function is the iterable kind: it takes no step, i.e. no required positional argument, no
    ``*args`` and no parameter named ``step`` (``def data(split="train")`` is; ``def data(step, split=None)``,
    ``def data(step=0)`` and a function whose signature cannot be read are functions of the step, as before)."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return False
    return not any((p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty)
                   or p.kind == p.VAR_POSITIONAL or p.name == "step" for p in params)


def to_numpy(value: Any) -> np.ndarray:
    """A tensor (torch, moved to the CPU and detached; bfloat16 as float32, which NumPy lacks) or array-like."""
    if hasattr(value, "detach") and hasattr(value, "cpu"):  # a torch tensor, without importing torch here
        t = value.detach().cpu()
        if str(t.dtype) == "torch.bfloat16":
            t = t.float()
        return t.numpy()
    return np.asarray(value)


class IterableSteps:
    """``step -> {name: array}`` over the iterables ``make()`` returns (see the module docstring).

    ``what``: how errors name the source (``data 'file.py:fn'``); ``fields``: the placeholders a tuple/list item is
    matched to, in order; ``rows``: the global batch ``G``; ``row_field``: the field whose dim 0 counts an item's rows.
    """

    def __init__(self, make: Callable[[], Iterable], what: str, fields: list[str], rows: int, row_field: str):
        self.make, self.what, self.fields, self.rows, self.row_field = make, what, fields, rows, row_field
        self.per_step: int | None = None  # items per step, fixed by the first item
        self.item_rows: int | None = None
        self._source: Iterable | None = None
        self._it: Iterator | None = None
        self._next_step = 0  # the step the cached iterator is positioned at
        self._epoch = 0
        self._dropped_said = False
        self._pending: dict[str, np.ndarray] | None = None  # an item read ahead, the next one to serve
        self._epoch_items = 0  # items read in the current epoch

    def _restart(self) -> None:
        self._source = self.make()
        if isinstance(self._source, dict) or not hasattr(self._source, "__iter__"):
            raise FusionError(f"{self.what}: returned {type(self._source).__name__}, expected an iterable of batches "
                              "(a DataLoader, a generator, a list) or, for a function of the step, a dict")
        self._it, self._next_step, self._epoch, self._epoch_items = iter(self._source), 0, 0, 0
        self._pending = None

    def _new_epoch(self) -> None:
        self._epoch, self._epoch_items = self._epoch + 1, 0
        if iter(self._source) is self._source:  # a one-shot iterator (a generator): ask the function for another
            self._source = self.make()
        self._it = iter(self._source)

    def _item(self, step: int) -> dict[str, np.ndarray]:
        """The next item as ``{name: array}``, starting a new epoch when the iterable is exhausted."""
        for attempt in range(2):
            try:
                item = next(self._it)
            except StopIteration:
                if attempt:
                    break
                self._new_epoch()
                continue
            self._epoch_items += 1
            return self._fields(item, step)
        raise FusionError(f"{self.what}: step {step}: the iterable yielded no batch (epoch {self._epoch})")

    def _fields(self, item: Any, step: int) -> dict[str, np.ndarray]:
        if isinstance(item, dict) or (hasattr(item, "keys") and hasattr(item, "__getitem__")):
            return {str(k): to_numpy(item[k]) for k in item.keys()}
        if isinstance(item, (tuple, list)):
            if len(item) != len(self.fields):
                raise FusionError(f"{self.what}: step {step}: an item of {len(item)} values; a tuple/list item is "
                                  f"matched to the model's inputs then labels {self.fields} ({len(self.fields)})")
            return {n: to_numpy(v) for n, v in zip(self.fields, item)}
        raise FusionError(f"{self.what}: step {step}: an item is {type(item).__name__}; expected a dict of "
                          f"placeholder -> tensor or a tuple matched to {self.fields}")

    def _rows_of(self, item: dict[str, np.ndarray], step: int) -> int:
        a = item.get(self.row_field)
        if a is None:  # the caller's field checks name what is missing
            return self.item_rows or self.rows
        return int(a.shape[0]) if a.ndim else 1

    def _fit(self, step: int) -> None:
        """Fix the items per step from the first item (steps are ``G / b`` items of ``b`` rows)."""
        first = self._item(step)
        b = self._rows_of(first, step)
        if b <= 0 or b > self.rows or self.rows % b:
            raise FusionError(f"{self.what}: its iterable's batches have {b} rows, but a step of the plan takes the "
                              f"global batch of {self.rows} rows; use a batch size that divides {self.rows}")
        self.item_rows, self.per_step = b, self.rows // b
        self._pending = first

    def _take(self, step: int) -> list[dict[str, np.ndarray]]:
        """The items of one step; a short item at the end of an epoch is dropped (``drop_last``)."""
        out = []
        while len(out) < self.per_step:
            item = self._pending if self._pending is not None else self._item(step)
            self._pending = None
            b = self._rows_of(item, step)
            if b != self.item_rows:
                epoch, alone = self._epoch, self._epoch_items == 1
                nxt = self._item(step)
                if self._epoch == epoch or alone:  # not the last item of its epoch, or its only one
                    raise FusionError(f"{self.what}: step {step}: an item of {b} rows among items of "
                                      f"{self.item_rows}; every batch but an epoch's last must have the same size")
                if not self._dropped_said:
                    log.warning("%s: the short last batch of an epoch (%d rows, not %d) is dropped, as "
                                "DataLoader(drop_last=True) would", self.what, b, self.item_rows)
                    self._dropped_said = True
                self._pending = nxt
                continue
            out.append(item)
        return out

    def _skip_to(self, step: int) -> None:
        if self._it is None or step < self._next_step:
            self._restart()
            if self.per_step is None:
                self._fit(0)
        while self._next_step < step:
            self._take(self._next_step)
            self._next_step += 1

    def __call__(self, step: int) -> dict[str, np.ndarray]:
        """The batch of ``step``: its items concatenated along dim 0 (a single item as it is)."""
        self._skip_to(step)
        items = self._take(step)
        self._next_step = step + 1
        if len(items) == 1:
            return items[0]
        names = list(items[0])
        for it in items[1:]:
            if list(it) != names:
                raise FusionError(f"{self.what}: step {step}: items with different fields ({names} and {list(it)})")
        try:
            return {n: np.concatenate([it[n] for it in items]) for n in names}
        except ValueError as e:
            raise FusionError(f"{self.what}: step {step}: the items of one step do not concatenate: {e}") from None
