"""Optimizer configuration (plain data, stored in plans) and its torch realisation.

SGD and AdamW update each parameter from its own gradient and state, so a
partitioned model stepping each part locally equals a single-process step.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Iterable


@dataclass(frozen=True)
class OptimizerConfig:
    """name: ``"sgd"`` or ``"adamw"``; the rest are the usual hyper-parameters."""

    name: str = "sgd"
    lr: float = 0.01
    momentum: float = 0.0
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8

    def __post_init__(self):
        if self.name not in ("sgd", "adamw"):
            raise ValueError(f"optimizer.name must be 'sgd' or 'adamw', got {self.name!r}")
        if not self.lr > 0:
            raise ValueError(f"optimizer.lr must be > 0, got {self.lr}")

    def to_dict(self) -> dict:
        d = asdict(self)
        d["betas"] = list(self.betas)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "OptimizerConfig":
        d = dict(d)
        if "betas" in d:
            d["betas"] = tuple(d["betas"])
        return cls(**d)


def torch_optimizer(cfg: OptimizerConfig, params: Iterable):
    import torch

    params = list(params)
    if not params:
        return None
    if cfg.name == "sgd":
        return torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
    return torch.optim.AdamW(params, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay)
