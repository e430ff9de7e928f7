"""The model, data and optimizer of the WAN comparison (issue 29), one definition for fusion and its torch baseline.

The char-level GPT of ``benchmarks/convergence.py`` (:func:`convergence.gpt_config`, ``examples/models/gpt.py``) on the
CPython-source corpus (:func:`convergence.text_corpus`) split as ``benchmarks/diloco_study.py`` splits it
(:func:`diloco_study.split_corpus`: the last 10 % of the characters held out). Both sides get the same
initial weights (``gpt_model(config, seed=SEED)``), the same batches and the same AdamW.

Python entry point (what an orchestrator such as ``bench_wan.py`` calls)::

    from wan_model import gpt_setup
    s = gpt_setup("small", seed=1, batch=32, micro_batches=4)   # -> WanSetup
    s.config, s.lr, s.betas, s.eps, s.weight_decay             # GPTConfig and AdamW's hyper-parameters
    s.train_batch(step), s.val_batch(k)                        # {"idx", "targets"}: int64 [batch, seq_len]
    s.module()                                                 # the GPT (torch.nn.Module) with the seed's init
    s.env, s.fusion_args()                                     # how to give fusion the same (below)

fusion entry points (``fusion run|compile MODEL --data DATA``): fusion calls ``model()`` and ``batches(step)``
(``batches(k, split="val")`` for ``--eval-every``) without other arguments, so they read the setup from the
environment, ``s.env``: ``WAN_MODEL`` (small|tiny), ``WAN_SEED``, ``WAN_BATCH`` (rows per step, all micro-batches),
``WAN_MICRO`` (micro-batches per step), ``WAN_LR``. ``s.fusion_args()`` is the rest of the command line::

    env WAN_MODEL=small WAN_SEED=1 WAN_BATCH=32 WAN_MICRO=4 WAN_LR=0.003 \\
      fusion run benchmarks/wan_model.py:model --data benchmarks/wan_model.py:batches \\
      --micro-batches 4 --optimizer adamw --lr 0.003 --seed 1 --cluster ... --strategy equal-flops
"""
from __future__ import annotations

import functools
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # convergence.py, diloco_study.py (they add examples/models for gpt.py)
from convergence import gpt_config, text_corpus  # noqa: E402
from diloco_study import split_corpus  # noqa: E402
from gpt import GPT, GPTConfig, gpt_model  # noqa: E402

#: model name -> GPT shape. ``small``: the convergence study's GPT (vocabulary 96, 2 layers, 2 heads, width 64,
#: 32 characters), which leaves the unigram plateau (about 3.16 nats on the held-out part) within a few hundred
#: steps; ``tiny``: the same corpus and vocabulary at width 16 and 8 characters, for fast tests.
MODELS = {"small": gpt_config(32), "tiny": GPTConfig(vocab=96, n_layer=2, n_head=2, d_model=16, seq_len=8)}
#: the convergence study's learning rate (AdamW; fusion's --lr for the same run)
DEFAULT_LR = 3e-3
#: seed of the held-out batches: the same validation windows for every training seed
VAL_SEED = 12345
#: the environment variables fusion's entry points read (``WanSetup.env``)
ENV = ("WAN_MODEL", "WAN_SEED", "WAN_BATCH", "WAN_MICRO", "WAN_LR")


@functools.lru_cache(maxsize=1)
def corpus() -> tuple[np.ndarray, np.ndarray]:
    """(training tokens, held-out tokens) of the CPython-source corpus: its head and its last 10 %."""
    return split_corpus(text_corpus())


def _windows(tokens: np.ndarray, rng: np.random.Generator, rows: int, seq: int) -> dict[str, np.ndarray]:
    start = rng.integers(0, tokens.size - seq - 1, rows)
    win = np.stack([tokens[s:s + seq + 1] for s in start])
    return {"idx": np.ascontiguousarray(win[:, :-1]), "targets": np.ascontiguousarray(win[:, 1:])}


@dataclass(frozen=True)
class WanSetup:
    """One side's model, data and optimizer; both sides built from the same one train the same.

    model:          ``small`` or ``tiny`` (:data:`MODELS`).
    seed:           initialisation seed of the GPT (``gpt_model(config, seed=seed)``) and of the training windows.
    batch:          rows (windows of ``config.seq_len`` characters) per step, all micro-batches together.
    micro_batches:  micro-batches per step (``batch`` is a multiple of it); the loss of a step is the mean over
                    all its rows, so the gradient does not depend on the split.
    lr, betas, eps, weight_decay: AdamW's (torch's formulas; fusion's ``OptimizerConfig("adamw")`` defaults
                    for everything but ``lr``, i.e. no weight decay).
    config:         the GPT's shape.
    """

    model: str
    seed: int
    batch: int
    micro_batches: int
    lr: float
    config: GPTConfig
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0

    @property
    def micro_batch(self) -> int:
        """Rows per micro-batch."""
        return self.batch // self.micro_batches

    def module(self) -> GPT:
        """The GPT with this seed's initial weights (tied embedding and head, as the study's)."""
        return gpt_model(self.config, batch=1, seed=self.seed)[0]

    def train_batch(self, step: int) -> dict[str, np.ndarray]:
        """Step ``step``'s batch: ``batch`` random windows of the training part, a pure function of (seed, step)."""
        return _windows(corpus()[0], np.random.default_rng([self.seed, step]), self.batch, self.config.seq_len)

    def val_batch(self, k: int) -> dict[str, np.ndarray]:
        """Held-out batch ``k``: ``batch`` random windows of the last 10 %, the same for every seed."""
        return _windows(corpus()[1], np.random.default_rng([VAL_SEED, k]), self.batch, self.config.seq_len)

    @property
    def env(self) -> dict[str, str]:
        """The environment under which :func:`model` and :func:`batches` give fusion this setup."""
        return {"WAN_MODEL": self.model, "WAN_SEED": str(self.seed), "WAN_BATCH": str(self.batch),
                "WAN_MICRO": str(self.micro_batches), "WAN_LR": repr(self.lr)}

    def fusion_args(self) -> list[str]:
        """``fusion run|compile`` arguments for the same model, data and optimizer (with :attr:`env` set); the
        caller adds the cluster, strategy, steps, compression."""
        me = str(Path(__file__).resolve())
        return [f"{me}:model", "--data", f"{me}:batches", "--micro-batches", str(self.micro_batches),
                "--optimizer", "adamw", "--lr", repr(self.lr), "--seed", str(self.seed)]


def gpt_setup(model: str, seed: int, batch: int = 32, micro_batches: int = 4, lr: float | None = None) -> WanSetup:
    """The comparison's setup; ``ValueError`` with one line for a model, batch or split that does not exist."""
    if model not in MODELS:
        raise ValueError(f"model {model!r}: expected one of {', '.join(MODELS)}")
    if micro_batches < 1 or batch < 1 or batch % micro_batches:
        raise ValueError(f"batch {batch} does not split into {micro_batches} equal micro-batches")
    if lr is not None and not lr > 0:
        raise ValueError(f"lr must be > 0, got {lr}")
    return WanSetup(model, seed, batch, micro_batches, DEFAULT_LR if lr is None else lr, MODELS[model])


def setup_from_env() -> WanSetup:
    """The :class:`WanSetup` named by ``WAN_MODEL``, ``WAN_SEED``, ``WAN_BATCH``, ``WAN_MICRO``, ``WAN_LR``
    (defaults: small, 0, 32, 4, the study's lr)."""
    e = os.environ
    try:
        return gpt_setup(e.get("WAN_MODEL", "small"), int(e.get("WAN_SEED", "0")), int(e.get("WAN_BATCH", "32")),
                         int(e.get("WAN_MICRO", "4")), float(e["WAN_LR"]) if e.get("WAN_LR") else None)
    except ValueError as err:
        raise ValueError(f"wan_model.py: environment {', '.join(f'{k}={e.get(k)}' for k in ENV if k in e)}: "
                         f"{err}") from None


def model():
    """fusion's model entry: the setup's GPT and one micro-batch (the first of step 0's batch) as its example."""
    s = setup_from_env()
    import torch

    b = s.train_batch(0)
    return s.module(), {k: torch.from_numpy(v[:s.micro_batch].copy()) for k, v in b.items()}


def batches(step: int, split: str | None = None) -> dict[str, np.ndarray]:
    """fusion's data entry: the setup's training batch of ``step``, or held-out batch ``step`` with
    ``split="val"`` (``--eval-every``)."""
    s = setup_from_env()
    if split == "val":
        return s.val_batch(step)
    if split is not None:
        raise ValueError(f"split {split!r}: expected 'val' or none")
    return s.train_batch(step)
