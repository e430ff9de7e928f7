"""The torch engine's local optimizer, with its state as plain arrays (for checkpoints).

Optimizer state is keyed by graph parameter name, not by position, so a
checkpoint reads back correctly whatever order the part lists its
parameters in: ``"<param>::<state key>"`` -> array (``exp_avg``,
``momentum_buffer``, the ``step`` counter as a 0-d array, ...).
"""
from __future__ import annotations

from typing import Any, Iterable, Mapping

import numpy as np
import torch

from fusion.ir.errors import FusionError
from fusion.plan import OptimizerConfig
from fusion.executors.engines.torch.engine import TorchPart, dtype_name, from_wire, to_array

def torch_optimizer(cfg: OptimizerConfig, params: Iterable):
    """The torch optimizer ``cfg`` names over ``params`` (None when there are none)."""
    params = list(params)
    if not params:
        return None
    if cfg.name == "sgd":
        return torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
    return torch.optim.AdamW(params, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay)


SEP = "::"


class TorchOptimizer:
    """SGD/AdamW over a :class:`TorchPart`'s trainable parameters."""

    def __init__(self, part: TorchPart, cfg: OptimizerConfig):
        self.part, self.cfg = part, cfg
        self.names = list(part.trainable())
        self.opt = torch_optimizer(cfg, part.trainable().values())

    def set_lr(self, lr: float) -> None:
        """The learning rate of the next steps (the schedule's ``lr * factor``, set as ``LambdaLR`` sets it)."""
        if self.opt is not None:
            for group in self.opt.param_groups:
                group["lr"] = lr

    def step(self) -> None:
        if self.opt is not None:
            self.opt.step()

    def zero_grad(self) -> None:
        if self.opt is not None:
            self.opt.zero_grad(set_to_none=True)

    def state(self) -> tuple[dict[str, np.ndarray], dict]:
        arrays: dict[str, np.ndarray] = {}
        if self.opt is not None:
            sd = self.opt.state_dict()
            for idx, st in sd["state"].items():
                for key, v in st.items():
                    if isinstance(v, torch.Tensor):
                        arrays[f"{self.names[idx]}{SEP}{key}"] = to_array(v).copy()
                    elif v is not None:
                        arrays[f"{self.names[idx]}{SEP}{key}"] = np.asarray(v)
        return arrays, {"optimizer": self.cfg.to_dict(), "params": self.names}

    def load_state(self, arrays: Mapping[str, np.ndarray], meta: Mapping[str, Any]) -> None:
        if self.opt is None:
            return
        saved = meta.get("optimizer")
        if saved is not None and saved.get("name") != self.cfg.name:
            raise FusionError(f"checkpoint holds {saved.get('name')} optimizer state, the plan uses {self.cfg.name}")
        index = {n: i for i, n in enumerate(self.names)}
        params = self.part.trainable()
        state: dict[int, dict[str, Any]] = {}
        for k, v in arrays.items():
            pname, sep, key = k.rpartition(SEP)
            if not sep or pname not in index:
                raise FusionError(f"checkpoint optimizer entry {k!r} names no parameter of this part")
            # moments have the parameter's dtype (bfloat16 ones were saved as their bits); "step" is a counter
            dt = None if key == "step" else dtype_name(params[pname].dtype)
            state.setdefault(index[pname], {})[key] = from_wire(np.array(v), dt)
        sd = self.opt.state_dict()
        self.opt.load_state_dict({"state": state, "param_groups": sd["param_groups"]})
