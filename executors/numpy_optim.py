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

    def __init__(self, cfg: Any, part: Any):
        if cfg.name not in ("sgd", "adamw"):
            raise ValueError(f"the numpy engine has no optimizer {cfg.name!r}")
        self.cfg, self.part = cfg, part
        self.state: dict[str, dict[str, Any]] = {}

    def step(self) -> None:
        grads = self.part.grads()
        for name in self.part.trainable_names:
            g = grads.get(name)
            if g is None:  # torch skips parameters without a gradient
                continue
            p = self.part.params[name]
            st = self.state.setdefault(name, {})
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
        p -= d(c.lr) * g

    def _adamw(self, p: np.ndarray, g: np.ndarray, st: dict) -> None:
        c = self.cfg
        d = p.dtype.type
        b1, b2 = c.betas
        if not st:
            st.update(step=0, exp_avg=np.zeros_like(p), exp_avg_sq=np.zeros_like(p))
        st["step"] += 1
        t = st["step"]
        p *= d(1 - c.lr * c.weight_decay)
        m, v = st["exp_avg"], st["exp_avg_sq"]
        m += (g - m) * d(1 - b1)  # torch: exp_avg.lerp_(grad, 1 - beta1)
        v *= d(b2)
        v += d(1 - b2) * g * g
        step_size = c.lr / (1 - b1 ** t)
        denom = np.sqrt(v) / d(math.sqrt(1 - b2 ** t)) + d(c.eps)
        p -= d(step_size) * (m / denom)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.part.zero_grad()
