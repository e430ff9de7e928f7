"""SGD and AdamW in NumPy, with the update formulas of ``torch.optim`` (single-tensor path).

Each parameter is updated in place from its own gradient and state, so a part
stepping locally equals a single-process step (synchronous semantics).
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np


class NumpyOptimizer:
    """Steps the trainable parameters of a NumPy part.

    cfg:  an ``OptimizerConfig`` (name ``sgd`` or ``adamw``, lr, momentum,
          weight_decay, betas, eps).
    part: the part whose ``params`` / ``grads()`` / ``zero_grad()`` it drives.
    """

    NAMES = ("sgd", "adamw")  #: the optimizers it has (its engine's ``EngineSpec.optimizers``; no Muon)

    def __init__(self, cfg: Any, part: Any):
        if cfg.name not in self.NAMES:
            raise ValueError(f"the numpy engine has no optimizer {cfg.name!r}")
        self.cfg, self.part = cfg, part
        self.slots: dict[str, dict[str, Any]] = {}  #: per-parameter state (momentum, exp_avg, step, ...)
        self.lr: float = cfg.lr  #: the learning rate of the next step (:meth:`set_lr`; the schedule's)

    @classmethod
    def for_part(cls, part: Any, cfg: Any) -> "NumpyOptimizer":
        """The engine-factory signature ``(part, cfg)`` (see ``fusion.executors.engines.select``)."""
        return cls(cfg, part)

    def set_lr(self, lr: float) -> None:
        """The learning rate of the next steps (the schedule's ``lr * factor``, as torch's ``LambdaLR``)."""
        self.lr = lr

    def step(self) -> None:
        grads = self.part.grads()
        for name in self.part.trainable_names:
            g = grads.get(name)
            if g is None:  # torch skips parameters without a gradient
                continue
            p = self.part.params[name]
            st = self.slots.setdefault(name, {})
            if self.cfg.name == "sgd":
                self._sgd(p, g, st)
            else:
                self._adamw(p, g, st)

    def _sgd(self, p: np.ndarray, g: np.ndarray, st: dict) -> None:
        c = self.cfg
        d = p.dtype.type
        if c.weight_decay:
            g = g + d(c.weight_decay) * p
        if c.momentum:
            buf = st.get("momentum_buffer")
            buf = g.copy() if buf is None else buf * d(c.momentum) + g
            st["momentum_buffer"] = buf
            g = buf
        p -= d(self.lr) * g

    def _adamw(self, p: np.ndarray, g: np.ndarray, st: dict) -> None:
        c = self.cfg
        d = p.dtype.type
        b1, b2 = c.betas
        if not st:
            st.update(step=0, exp_avg=np.zeros_like(p), exp_avg_sq=np.zeros_like(p))
        st["step"] += 1
        t = st["step"]
        p *= d(1 - self.lr * c.weight_decay)
        m, v = st["exp_avg"], st["exp_avg_sq"]
        m += (g - m) * d(1 - b1)  # torch: exp_avg.lerp_(grad, 1 - beta1)
        v *= d(b2)
        v += d(1 - b2) * g * g
        step_size = self.lr / (1 - b1 ** t)
        denom = np.sqrt(v) / d(math.sqrt(1 - b2 ** t)) + d(c.eps)
        p -= d(step_size) * (m / denom)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.part.zero_grad()

    def state(self) -> tuple[dict[str, np.ndarray], dict]:
        """``(arrays, meta)`` for checkpoints: ``"<param>::<key>"`` -> array, as the torch engine's."""
        arrays = {f"{n}::{k}": np.asarray(v).copy() for n, st in self.slots.items() for k, v in st.items()}
        return arrays, {"optimizer": self.cfg.to_dict(), "params": list(self.part.trainable_names)}

    def load_state(self, arrays: Any, meta: Any) -> None:
        from fusion.ir.errors import FusionError

        saved = meta.get("optimizer")
        if saved is not None and saved.get("name") != self.cfg.name:
            raise FusionError(f"checkpoint holds {saved.get('name')} optimizer state, the plan uses {self.cfg.name}")
        self.slots = {}
        for key, v in arrays.items():
            name, sep, slot = key.rpartition("::")
            if not sep or name not in self.part.trainable_names:
                raise FusionError(f"checkpoint optimizer entry {key!r} names no parameter of this part")
            arr = np.array(v)
            self.slots.setdefault(name, {})[slot] = int(arr) if slot == "step" else arr
