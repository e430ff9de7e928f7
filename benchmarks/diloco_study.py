"""DiLoCo's convergence study (issue 25, ``steps_to_sync_loss_ratio``): 4 replicas, synchronous DP against DiLoCo.

``python benchmarks/bench_diloco.py --study convergence`` runs it. Data and model are those of
``benchmarks/convergence.py`` (:func:`~convergence.text_corpus`, :func:`~convergence.gpt_batches`,
:func:`~convergence.gpt_config`): the char-level GPT on the source of a fixed list of CPython stdlib modules, cut
into a training part (the first 90 % of the characters) and a held-out validation part (the last 10 %), of which
a fixed set of windows is the validation set every run is measured on.

Every global batch is split into 4 contiguous quarters, one per replica.

* ``sync``: synchronous data parallelism, the gradients of the 4 quarters averaged every step, which is the
  gradient of the global batch's mean loss: one model takes the global batch (inner optimizer, e.g. AdamW).
* ``diloco``: 4 torch model copies, each with its own inner optimizer on its quarter; after every H-th step
  each of the 4 replicas runs **fusion's own outer step**, :meth:`fusion.executors.runtime.dp.outer.OuterLoop.step`
  (the object and method the CompNode calls: pseudo-gradient ``theta_global - theta_r``, the ring all-reduce of
  :mod:`~fusion.executors.runtime.dp.allreduce` or, with a codec, :func:`~fusion.executors.runtime.dp.outer.encode_pseudo`
  / ``decode_pseudo`` with error feedback, then the outer Nesterov SGD), one thread per replica, their wire
  messages encoded and decoded by :mod:`fusion.ir.wire` and handed to each other's inboxes in this process
  (:class:`LocalWire`) instead of a socket. The replicas continue from the new global weights with their
  inner optimizer state kept, as the runtime does.

The study runs the algorithm in one process; ``tests/executors/runtime/test_diloco.py`` proves that the
multi-process runtime computes the same losses as a plain-PyTorch DiLoCo of R model copies at rtol 1e-5, and
``tests/executors/runtime/test_diloco_study.py`` that this study's DiLoCo with H = 1, SGD, outer lr 1 and momentum 0
equals its synchronous DP.

Validation loss: the mean cross-entropy of the validation set, every ``eval_every`` steps for ``sync`` (and at
its last step) and at every outer step for DiLoCo, of the *global* weights (the model DiLoCo produces; between
outer steps the replicas' weights differ). ``steps_to_sync_loss_ratio``: the first evaluated step at which
DiLoCo's validation loss is <= synchronous DP's final one, over synchronous DP's steps; DiLoCo runs
``diloco_factor`` times as many steps, and a run that does not get there within them is ``null`` with its gap
(its best validation loss minus the target).
"""
from __future__ import annotations

import logging
import math
import statistics
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from convergence import gpt_batches, gpt_config, text_corpus  # noqa: E402

log = logging.getLogger("diloco_study")

#: fraction of the corpus's characters (its tail) held out for validation
VAL_FRACTION = 0.1


@dataclass(frozen=True)
class StudyConfig:
    """One study's shape.

    replicas:       data-parallel replicas (each on its ``1/replicas`` of the global batch).
    global_batch:   rows (windows of ``seq`` characters) per step, all replicas together.
    seq:            characters per window.
    inner:          the inner optimizer, ``"adamw"`` or ``"sgd"`` (synchronous DP uses the same).
    lr:             its learning rate (constant).
    steps:          synchronous DP's steps (its final validation loss is the target).
    diloco_factor:  DiLoCo runs ``ceil(steps * diloco_factor)`` inner steps, rounded up to a multiple of H.
    eval_every:     synchronous DP's evaluation interval (DiLoCo: every outer step).
    val_windows:    windows in the fixed validation set.
    outer_lr:       DiLoCo's outer learning rate (the paper's 0.7).
    outer_momentum: DiLoCo's outer Nesterov momentum (the paper's 0.9).
    outer_nesterov: Nesterov outer momentum (the paper's) or heavy-ball.
    diloco_lr:      the DiLoCo replicas' inner learning rate on their 1/``replicas`` of the batch (None: ``lr``,
                    synchronous DP's on the whole batch).
    sync_warmup:    DiLoCo's first N steps are synchronous DP (one model on the global batch, ``lr``; they count
                    as steps at equal tokens), then the replicas start from those weights and that optimizer
                    state (their own ``diloco_lr``) and step the outer loop every H steps after them.
    min_rounds:     DiLoCo runs at least this many outer rounds (after the warm-up), beyond ``diloco_factor``.
    """

    replicas: int = 4
    global_batch: int = 32
    seq: int = 32
    inner: str = "adamw"
    lr: float = 3e-3
    steps: int = 300
    diloco_factor: float = 3.0
    eval_every: int = 20
    val_windows: int = 256
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    outer_nesterov: bool = True
    diloco_lr: float | None = None
    sync_warmup: int = 0
    min_rounds: int = 0


@dataclass(frozen=True)
class Variant:
    """A DiLoCo run of the study whose inner learning rate or synchronous warm-up differ from the config's
    (None: the config's ``diloco_lr`` / ``sync_warmup``)."""

    sync: Any  #: its fusion.plan.DPSync
    lr: float | None = None
    warmup: int | None = None
    inner: str | None = None  #: the replicas' inner optimizer (None: the config's; ``muon``: MuLoCo's)


@dataclass
class Curve:
    """A run's validation curve: ``steps[i]`` inner steps done, ``val[i]`` the validation loss then."""

    steps: list[int] = field(default_factory=list)
    val: list[float] = field(default_factory=list)
    train: list[float] = field(default_factory=list)  #: mean training loss of every step (all replicas)
    sent_bytes: int = 0  #: pseudo-gradient tensor bytes replica 0 sent in all (DiLoCo)
    payload_bytes: int = 0  #: bytes of replica 0's pseudo-gradient payloads, once per round (DiLoCo)
    dense_bytes: int = 0  #: what those rounds' pseudo-gradients are dense (float32 buffers)
    wall_s: float = 0.0


# -- data and model ------------------------------------------------------------------------------------------

def split_corpus(tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(training characters, held-out validation characters): the head and the last ``VAL_FRACTION``."""
    cut = int(tokens.size * (1 - VAL_FRACTION))
    return tokens[:cut], tokens[cut:]


def unigram_loss(train: np.ndarray, val: np.ndarray, vocab: int = 96) -> float:
    """Cross-entropy (nats) of the validation characters under the training characters' unigram frequencies
    (add-one smoothed): the plateau a model that ignores context sits on."""
    p = (np.bincount(train, minlength=vocab) + 1.0) / (train.size + vocab)
    return float(-np.log(p[val]).mean())


def validation_set(val: np.ndarray, cfg: StudyConfig) -> dict[str, torch.Tensor]:
    """The fixed validation windows (random windows of the held-out part, seed 12345, the same for every run)."""
    b = next(gpt_batches(val, 1, cfg.val_windows, cfg.seq, seed=12345))
    return {k: torch.from_numpy(v) for k, v in b.items()}


def train_batches(train: np.ndarray, cfg: StudyConfig, steps: int, seed: int) -> Iterator[dict[str, torch.Tensor]]:
    """Global batches of random training windows (the data order is ``seed``'s)."""
    for b in gpt_batches(train, steps, cfg.global_batch, cfg.seq, seed=1000 + seed):
        yield {k: torch.from_numpy(v) for k, v in b.items()}


def make_model(cfg: StudyConfig, seed: int) -> torch.nn.Module:
    """The study's GPT initialised from ``seed``."""
    from gpt import gpt_model

    return gpt_model(gpt_config(cfg.seq), batch=1, seed=seed)[0]


class MuonAdamW:
    """Muon (torch.optim.Muon, Nesterov momentum 0.95, its step scaled to AdamW's RMS: ``match_rms_adamw``) on the
    2-D weights that are not embeddings, AdamW on the rest, one learning rate: the torch engine's ``muon``
    optimizer (``executors/engines/torch/optimizer.py``) on the study's GPT, as MuLoCo (arXiv 2505.23725) runs it
    inside the replicas. The optimizer protocol the study uses: zero_grad, step, param_groups, state_dict."""

    def __init__(self, model: torch.nn.Module, lr: float):
        named = dict(model.named_parameters())
        mats = [n for n, p in named.items() if p.ndim == 2 and not n.endswith(("wte.weight", "wpe.weight"))]
        self.opts = [torch.optim.Muon([named[n] for n in mats], lr=lr, weight_decay=0.01, momentum=0.95,
                                      nesterov=True, adjust_lr_fn="match_rms_adamw"),
                     torch.optim.AdamW([p for n, p in named.items() if n not in set(mats)], lr=lr)]

    @property
    def param_groups(self) -> list:
        return [g for o in self.opts for g in o.param_groups]

    def zero_grad(self, set_to_none: bool = True) -> None:
        for o in self.opts:
            o.zero_grad(set_to_none=set_to_none)

    def step(self) -> None:
        for o in self.opts:
            o.step()

    def state_dict(self) -> list:
        return [o.state_dict() for o in self.opts]

    def load_state_dict(self, state: list) -> None:
        for o, s in zip(self.opts, state):
            o.load_state_dict(s)


def make_optimizer(cfg: StudyConfig, params, lr: float | None = None, inner: str | None = None, model=None):
    """The inner optimizer (``inner``, default ``cfg.inner``) over ``params``; ``muon`` needs ``model`` (names)."""
    lr = cfg.lr if lr is None else lr
    if (inner or cfg.inner) == "muon":
        return MuonAdamW(model, lr)
    if (inner or cfg.inner) == "adamw":
        return torch.optim.AdamW(params, lr=lr)
    if (inner or cfg.inner) == "sgd":
        return torch.optim.SGD(params, lr=lr)
    raise SystemExit(f"diloco_study: inner optimizer {inner or cfg.inner!r}: expected adamw, muon or sgd")


@torch.no_grad()
def val_loss(model: torch.nn.Module, vset: Mapping[str, torch.Tensor]) -> float:
    return float(model(vset["idx"], vset["targets"]))


def quarters(batch: Mapping[str, torch.Tensor], replicas: int) -> list[dict[str, torch.Tensor]]:
    """Replica r's contiguous share of a global batch."""
    n = next(iter(batch.values())).shape[0]
    if n % replicas:
        raise SystemExit(f"diloco_study: a global batch of {n} rows does not split over {replicas} replicas")
    k = n // replicas
    return [{name: t[r * k:(r + 1) * k] for name, t in batch.items()} for r in range(replicas)]


# -- synchronous DP ------------------------------------------------------------------------------------------

def run_sync(cfg: StudyConfig, seed: int, train: np.ndarray, vset, steps: int | None = None) -> Curve:
    """Synchronous DP: the replicas' averaged gradient every step, i.e. one model on the global batch."""
    steps = cfg.steps if steps is None else steps
    model = make_model(cfg, seed)
    opt = make_optimizer(cfg, model.parameters(), model=model)
    c, t0 = Curve(), time.perf_counter()
    for s, batch in enumerate(train_batches(train, cfg, steps, seed), 1):
        opt.zero_grad(set_to_none=True)
        loss = model(batch["idx"], batch["targets"])
        loss.backward()
        opt.step()
        c.train.append(float(loss.detach()))
        if s % cfg.eval_every == 0 or s == steps:
            c.steps.append(s)
            c.val.append(val_loss(model, vset))
    c.wall_s = time.perf_counter() - t0
    return c


# -- DiLoCo through fusion's outer step ----------------------------------------------------------------------

class LocalWire:
    """The replicas' wire in one process: ``send`` encodes nothing new (it takes the frames fusion's outer step
    made), decodes them with :func:`fusion.ir.wire.decode` and hands the message to the receiver's all-reduce or
    pseudo-gradient inbox, which checks it as a CompNode's would; ``wait`` blocks until the caller's ``ready()``
    has something (or raises after ``timeout_s``)."""

    def __init__(self, rings: Mapping[str, Any], pseudos: Mapping[str, Any], timeout_s: float = 60.0,
                 delayed: Mapping[str, Any] | None = None):
        self.rings, self.pseudos, self.timeout_s = rings, pseudos, timeout_s
        self.delayed = delayed or {}
        self.cv = threading.Condition()

    def sender(self, me: str) -> Callable[[str, list, str], None]:
        from fusion.ir.wire import decode

        def send(peer: str, frames: list, label: str) -> None:
            msg = decode(frames)
            with self.cv:
                if msg.header.get("delayed") is True:  # a round of an overlapped outer step (dp_sync.delay 1)
                    self.delayed[peer].accept(me, msg)
                elif msg.header.get("gather") is True:
                    self.pseudos[peer].accept(me, msg)
                else:
                    self.rings[peer].accept(me, msg)
                self.cv.notify_all()
        return send

    def wait(self, ready: Callable[[], Any], what: str) -> Any:
        deadline = time.monotonic() + self.timeout_s
        with self.cv:
            while (got := ready()) is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"diloco_study: no {what} within {self.timeout_s:g} s")
                self.cv.wait(left)
        return got


def trainable(model: torch.nn.Module) -> dict[str, np.ndarray]:
    """The model's parameters by name (tied ones once), as NumPy views."""
    return {n: p.detach().numpy() for n, p in model.named_parameters()}


class DiLoCoReplicas:
    """R model copies, each with its inner optimizer, and each replica's :class:`OuterLoop` (fusion's)."""

    def __init__(self, cfg: StudyConfig, seed: int, sync, lr: float | None = None,
                 start: tuple[dict, dict] | None = None, inner: str | None = None):
        """``lr``: the replicas' inner learning rate (None: ``cfg.diloco_lr`` or else ``cfg.lr``); ``start``:
        (model state, optimizer state) every replica starts from (a synchronous warm-up's), else ``seed``'s init."""
        import copy

        from fusion.executors.runtime.dp.allreduce import RingInbox, make_buckets
        from fusion.executors.runtime.dp.outer import DelayedInbox, OuterLoop, PseudoInbox
        from fusion.kernels.codecs import CODECS, Role

        if sync.codec is not None:
            CODECS.check_role(sync.codec, Role.PSEUDO_GRADIENT, "dp_sync.codec")
        self.cfg, self.sync = cfg, sync
        first = make_model(cfg, seed)
        self.models = [first] + [make_model(cfg, seed) for _ in range(cfg.replicas - 1)]
        lr = (cfg.lr if cfg.diloco_lr is None else cfg.diloco_lr) if lr is None else lr
        self.opts = [make_optimizer(cfg, m.parameters(), lr, inner, m) for m in self.models]
        if start is not None:
            for m, opt in zip(self.models, self.opts):
                m.load_state_dict(start[0])
                opt.load_state_dict(copy.deepcopy(start[1]))
                for g in opt.param_groups:  # the state's moments, the replicas' own learning rate
                    g["lr"] = lr
        params = trainable(first)
        buckets = make_buckets({n: (a.shape, a.dtype.name) for n, a in params.items()})
        self.names = [f"r{r}" for r in range(cfg.replicas)]
        self.rings = {me: RingInbox(me, self.names, buckets) for me in self.names}
        self.pseudos = {me: PseudoInbox(self.rings[me], sync.codec) for me in self.names}
        self.delayed = ({me: DelayedInbox(me, self.names, buckets, sync.codec) for me in self.names}
                        if sync.delay else {})
        self.wire = LocalWire(self.rings, self.pseudos, delayed=self.delayed)
        self.loops = [OuterLoop(sync, buckets, params) for _ in self.names]
        self.outer_steps = 0
        self.steps_done = 0  #: completed inner steps (the round number of an overlapped outer step)
        self._eval = make_model(cfg, seed) if sync.delay else None
        self.sent_bytes = self.payload_bytes = self.dense_bytes = 0

    def inner_step(self, batch: Mapping[str, torch.Tensor]) -> float:
        """Every replica's inner step on its share; the mean of their losses."""
        losses = []
        for m, opt, part in zip(self.models, self.opts, quarters(batch, self.cfg.replicas)):
            opt.zero_grad(set_to_none=True)
            loss = m(part["idx"], part["targets"])
            loss.backward()
            opt.step()
            losses.append(float(loss.detach()))
        return float(np.mean(losses))

    def outer_step(self) -> None:
        """Every replica's :meth:`OuterLoop.step` (one thread each, as one CompNode each), then each copy takes
        the new global weights."""
        it = self.outer_steps
        results: list[Any] = [None] * len(self.names)
        errors: list[BaseException] = []

        def one(r: int) -> None:
            me = self.names[r]
            try:
                if self.sync.delay:  # the runtime's overlapped step: eager or naive delayed (dp_sync.overlap)
                    results[r] = self.loops[r].overlapped_step(me, self.names, self.delayed[me], self.steps_done,
                                                               trainable(self.models[r]), self.wire.sender(me),
                                                               self.wire.wait)
                else:
                    results[r] = self.loops[r].step(me, self.rings[me], self.pseudos[me], it,
                                                    trainable(self.models[r]), self.wire.sender(me), self.wire.wait)
            except BaseException as e:  # re-raised in the caller
                errors.append(e)
                with self.wire.cv:
                    self.wire.cv.notify_all()

        threads = [threading.Thread(target=one, args=(r,), name=f"outer-{r}") for r in range(len(self.names))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        if not self.sync.delay:
            for ring in self.rings.values():
                ring.finish(it)
        for m, (new, stats) in zip(self.models, results):
            with torch.no_grad():
                for name, p in m.named_parameters():
                    p.copy_(torch.from_numpy(np.ascontiguousarray(new[name])))
        self.sent_bytes += results[0][1]["sent_bytes"]
        self.payload_bytes += results[0][1]["payload_bytes"]
        self.dense_bytes += sum(t.nbytes for t in self.loops[0].theta)
        self.outer_steps += 1

    def global_model(self) -> torch.nn.Module:
        """Replica 0's copy (after an outer step every copy holds the global weights). With ``dp_sync.delay`` 1,
        what a run that ended here would return: replica 0's weights with the round in flight applied
        (:meth:`OuterLoop.flushed`, on copies: delayed, the global weights; eager, replica 0's copy of them)."""
        if not self.sync.delay:
            return self.models[0]
        new = self.loops[0].flushed(self.names[0], self.names, self.delayed[self.names[0]],
                                    trainable(self.models[0]), self.wire.wait)
        with torch.no_grad():
            for name, p in self._eval.named_parameters():
                p.copy_(torch.from_numpy(np.ascontiguousarray(new[name])))
        return self._eval


def diloco_steps(cfg: StudyConfig, h: int, warmup: int = 0) -> int:
    """DiLoCo's steps in all: the warm-up, then whole rounds of H up to ``cfg.steps * cfg.diloco_factor`` (rounded
    up), at least ``cfg.min_rounds`` of them."""
    rounds = max(int(math.ceil((cfg.steps * cfg.diloco_factor - warmup) / h)), cfg.min_rounds, 1)
    return warmup + rounds * h


def run_diloco(cfg: StudyConfig, seed: int, sync, train: np.ndarray, vset, steps: int | None = None,
               lr: float | None = None, warmup: int | None = None, inner: str | None = None) -> Curve:
    """DiLoCo over ``cfg.replicas`` copies, ``steps`` steps in all (default :func:`diloco_steps`), evaluated at
    every outer step. ``warmup`` (None: ``cfg.sync_warmup``): the first steps are synchronous DP (as
    :func:`run_sync`'s, evaluated at the last), the replicas start from its weights and optimizer state; ``lr``:
    the replicas' inner learning rate (None: ``cfg.diloco_lr``, else ``cfg.lr``); ``inner``: the replicas' inner
    optimizer (None: ``cfg.inner``; the warm-up uses it too, at ``cfg.lr``; synchronous DP's target is ``cfg.inner``'s)."""
    h = sync.inner_steps
    warmup = cfg.sync_warmup if warmup is None else warmup
    if steps is None:
        steps = diloco_steps(cfg, h, warmup)
    c, t0 = Curve(), time.perf_counter()
    batches = train_batches(train, cfg, steps, seed)
    start = None
    if warmup:
        model = make_model(cfg, seed)
        opt = make_optimizer(cfg, model.parameters(), inner=inner, model=model)  # the replicas' optimizer kind
        for _, batch in zip(range(warmup), batches):
            opt.zero_grad(set_to_none=True)
            loss = model(batch["idx"], batch["targets"])
            loss.backward()
            opt.step()
            c.train.append(float(loss.detach()))
        c.steps.append(warmup)
        c.val.append(val_loss(model, vset))
        start = (model.state_dict(), opt.state_dict())
    reps = DiLoCoReplicas(cfg, seed, sync, lr=lr, start=start, inner=inner)
    for s, batch in enumerate(batches, warmup + 1):
        c.train.append(reps.inner_step(batch))
        reps.steps_done = s - warmup
        if (s - warmup) % h == 0:
            reps.outer_step()
            c.steps.append(s)
            c.val.append(val_loss(reps.global_model(), vset))
    c.sent_bytes, c.payload_bytes, c.dense_bytes = reps.sent_bytes, reps.payload_bytes, reps.dense_bytes
    c.wall_s = time.perf_counter() - t0
    return c


# -- the figure ----------------------------------------------------------------------------------------------

def steps_to(curve: Curve, target: float) -> int | None:
    """The first evaluated step with validation loss <= ``target`` (None: never)."""
    return next((s for s, v in zip(curve.steps, curve.val) if v <= target), None)


def diloco_syncs(cfg: StudyConfig, h_values: Sequence[int], quant8_h: int | None, overlaps: Sequence[str] = ()):
    """The DiLoCo runs of the study: ``name -> DPSync`` (outer Nesterov SGD at ``cfg.outer_lr`` and
    ``cfg.outer_momentum``; ``quant8_h``: one more run at that H with 8-bit pseudo-gradients and error feedback;
    ``overlaps``: for every H one more run per variant of the overlapped outer step, ``dp_sync.delay`` 1 with
    that ``overlap``, named ``diloco_h{H}_{overlap}``)."""
    from fusion.plan import DPSync

    outer = dict(outer_lr=cfg.outer_lr, outer_momentum=cfg.outer_momentum, nesterov=cfg.outer_nesterov)
    runs: dict[str, Any] = {f"diloco_h{h}": DPSync("diloco", inner_steps=h, **outer) for h in h_values}
    for h in h_values:
        for o in overlaps:
            runs[f"diloco_h{h}_{o}"] = DPSync("diloco", inner_steps=h, delay=1, overlap=o, **outer)
    if quant8_h:
        runs[f"diloco_h{quant8_h}_q8"] = DPSync("diloco", inner_steps=quant8_h, codec={"algo": "quant", "bits": 8},
                                                error_feedback=True, **outer)
    return runs


def _child_logging() -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")


def seed_row(cfg: StudyConfig, seed: int, runs: Mapping[str, Any]) -> dict:
    """One seed's runs: synchronous DP, then every DiLoCo run of ``runs`` (name -> DPSync) against its final
    validation loss."""
    torch.set_num_threads(1)
    train, val = split_corpus(text_corpus())
    vset = validation_set(val, cfg)
    sync_c = run_sync(cfg, seed, train, vset)
    target = sync_c.val[-1]
    log.info("seed %d sync: %d steps, final validation loss %.4f (%.0f s)", seed, cfg.steps, target, sync_c.wall_s)
    row: dict[str, Any] = {"sync": {"steps": cfg.steps, "final_val": round(target, 4),
                                    "val_curve": [[s, round(v, 4)] for s, v in zip(sync_c.steps, sync_c.val)],
                                    "wall_s": round(sync_c.wall_s, 1)}}
    for name, run in runs.items():
        v = run if isinstance(run, Variant) else Variant(run)
        sync = v.sync
        c = run_diloco(cfg, seed, sync, train, vset, lr=v.lr, warmup=v.warmup, inner=v.inner)
        reached = steps_to(c, target)
        best = min(c.val)
        warm = cfg.sync_warmup if v.warmup is None else v.warmup
        row[name] = {"inner_steps": sync.inner_steps, "steps_run": c.steps[-1], "sync_warmup": warm,
                     "outer_rounds": (c.steps[-1] - warm) // sync.inner_steps,
                     "steps_to_sync_loss": reached,
                     "steps_to_sync_loss_ratio": None if reached is None else round(reached / cfg.steps, 3),
                     "gap_at_end": None if reached is not None else round(best - target, 4),
                     "val_at_sync_steps": round(c.val[max(i for i, s in enumerate(c.steps) if s <= cfg.steps)], 4),
                     "final_val": round(c.val[-1], 4), "pseudo_gradient_bytes_sent": c.sent_bytes,
                     # a round's payload over its dense float32 pseudo-gradient (1: exact averaging)
                     "pseudo_gradient_bytes_ratio": round(c.payload_bytes / c.dense_bytes, 5) if c.dense_bytes else None,
                     "val_curve": [[s, round(v, 4)] for s, v in zip(c.steps, c.val)],
                     "wall_s": round(c.wall_s, 1)}
        log.info("seed %d %s: steps to %.4f: %s (ratio %s), validation loss at %d steps %.4f, best %.4f (%.0f s)",
                 seed, name, target, reached, row[name]["steps_to_sync_loss_ratio"], cfg.steps,
                 row[name]["val_at_sync_steps"], best, c.wall_s)
    return row


def study(cfg: StudyConfig, seeds: Sequence[int], h_values: Sequence[int], quant8_h: int | None,
          jobs: int = 1, overlaps: Sequence[str] = (), variants: Mapping[str, Variant] | None = None) -> dict:
    """Every seed's sync and DiLoCo runs (``jobs`` seeds at a time, each in its own process: the runs of a
    seed are sequential and single-threaded); the per-seed figures and their medians (the final JSON's fields)."""
    train, val = split_corpus(text_corpus())
    uni = unigram_loss(train, val)
    log.info("corpus: %d training / %d validation characters; unigram validation loss %.3f", train.size, val.size, uni)
    runs: dict[str, Any] = dict(diloco_syncs(cfg, h_values, quant8_h, overlaps))
    runs.update(variants or {})
    if not runs:
        raise SystemExit("diloco_study: no DiLoCo run (no H and no variant)")
    if jobs > 1:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor
        from functools import partial

        with ProcessPoolExecutor(min(jobs, len(seeds)), mp_context=multiprocessing.get_context("spawn"),
                                 initializer=_child_logging) as ex:
            rows = list(ex.map(partial(seed_row, cfg, runs=runs), seeds))
    else:
        rows = [seed_row(cfg, seed, runs) for seed in seeds]
    per_seed = {str(seed): row for seed, row in zip(seeds, rows)}
    medians: dict[str, Any] = {}
    for name in runs:
        ratios = [per_seed[str(s)][name]["steps_to_sync_loss_ratio"] for s in seeds]
        # a miss counts as +inf in the median (never reached within the run), reported as null
        med = statistics.median([math.inf if r is None else r for r in ratios])
        worst = max(math.inf if r is None else r for r in ratios)
        medians[name] = {"steps_to_sync_loss_ratio": None if math.isinf(med) else round(med, 3),
                         # the worst seed (null: some seed never reached)
                         "steps_to_sync_loss_ratio_max": None if math.isinf(worst) else round(worst, 3),
                         "per_seed": ratios, "reached": sum(r is not None for r in ratios)}
    first = next(iter(runs))  # the headline: the first run (the first H, or the first --variant)
    return {"unigram_val_loss": round(uni, 4), "primary_run": first,
            "steps_to_sync_loss_ratio": medians[first]["steps_to_sync_loss_ratio"],
            "steps_to_sync_loss_ratio_max": medians[first]["steps_to_sync_loss_ratio_max"],
            "steps_to_sync_loss_ratio_per_seed": {str(s): r for s, r in zip(seeds, medians[first]["per_seed"])},
            "sync_final_val_median": round(statistics.median(per_seed[str(s)]["sync"]["final_val"] for s in seeds), 4),
            "medians": medians, "per_seed": per_seed}
