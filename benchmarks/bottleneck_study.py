"""Bottleneck convergence study (issue 27): dense vs quant4 vs learned bottlenecks at the cut, held-out loss.

Data: the char-level corpus of ``benchmarks/convergence.py`` (the source of a fixed list of CPython stdlib modules,
:func:`~convergence.text_corpus`), split by ``benchmarks/diloco_study.py`` into a training head and a held-out
validation tail (:func:`~diloco_study.split_corpus`, the last 10 %), of which a fixed set of windows is the
validation set of every run (:func:`~diloco_study.validation_set`); training batches are random windows of the head,
in the order of the seed (:func:`~diloco_study.train_batches`). The unigram cross-entropy of the validation
characters (:func:`~diloco_study.unigram_loss`, ~3.16 nats) is the plateau a model that ignores context sits on:
the dense run must end well below it, or the study says so (``dense_left_plateau``).

Model and cut: the GPT of ``examples/models/gpt.py`` (width ``d_model``, untied head, so that only the residual
stream crosses the cut), traced by fusion and compiled by :func:`fusion.compile.compile_model` for a two-site
cluster of two devices joined by a ``link_mbit`` Mbit/s / ``link_ms`` ms link (:func:`cluster_yaml`) by OP-Fence
(fusion's default partitioner), GPipe, ``micro_batches`` micro-batches. Each device holds ``device_mb`` MB, less
than the model needs for training (parameters, gradients, AdamW state and activations), so OP-Fence must cut it in
two, and it cuts where the fewest bytes cross the slow link: between two blocks, where only the residual stream
(width ``d_model``) crosses. (The ``equal-flops`` cut of ``convergence.py`` lands inside a block, where the
384-wide attention projection crosses too, which a residual bottleneck does not narrow.) The bottleneck runs compile the same model with ``bottleneck=BottleneckRequest(rank)``: the compiler
pass (:mod:`fusion.compress.bottleneck`) inserts ResBM's residual bottleneck ``z = x P + x W_enc`` /
``y = z P^T + z W_dec`` on every cut edge of the residual width; its initial values are
:func:`~fusion.compress.bottleneck.initial_values` of ``plan.bottlenecks``. The study checks that both plans cut
the original nodes identically.

Runs (every seed, same initial weights of the shared parameters and same batches): ``dense``; ``quant4`` (every
cut edge, both directions, 4-bit block quantisation, :data:`convergence.CODEC_RUNS`); ``bottleneck``;
``bottleneck+quant4`` (the code through the 4-bit codec); ``bottleneck+muon`` (``--optimizer muon``) and its
comparator ``dense+muon``. All with AdamW at ``lr`` (constant) except the two Muon runs.

Training and clock: in one process with fusion's :class:`~fusion.executors.reference.ReferenceExecutor`
(:func:`convergence.train`, the same ``PartRuntime`` codec path as the runtime): **the simulated clock** of
``convergence.py``, i.e. the measured compute of every part's forward and backward plus ``alpha + bytes / beta``
of every cross-part message from the cluster's link model, summed serially (no overlap). Compute is measured in
CPU seconds of the training thread (``time.thread_time``, one torch thread), what a dedicated core would take:
the host the study ran on was shared, and wall time would count the waits for a core. The JSON gives each run's
compute and communication seconds apart.

Figures (medians of the seeds; every seed's in ``per_seed``):

* ``bottleneck_wire_reduction``: activation + gradient bytes that crossed the cut edges in the whole run
  (payload bytes of every cross-part message, both directions), dense over bottleneck (target >= 64);
* ``bottleneck_val_loss_gap``: validation loss after the last step, bottleneck minus dense, at equal steps
  (target <= 0.03);
* ``time_to_dense_val_loss_ratio``: simulated seconds until the bottleneck run's validation loss (evaluated every
  ``eval_every`` steps) is <= dense's final one, over dense's simulated seconds for its whole run (target
  <= 0.25); a run that never gets there is a miss: it counts as +inf in the median, reported as null.

Validation: the mean cross-entropy of the validation windows through the trained graph
(``ReferenceExecutor.forward_outputs``: forward only; its exchange between parts is exact, so a codec run is
evaluated without its codec, while a bottleneck, part of the graph, is evaluated as trained).

    python benchmarks/bottleneck_study.py [--steps 200] [--seeds 0,1,2] [--runs ...] [--quick]
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import logging
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from convergence import CODEC_RUNS, codec_edges, train  # noqa: E402  (puts examples/models on sys.path)
from diloco_study import split_corpus, text_corpus, train_batches, unigram_loss, validation_set  # noqa: E402

from fusion.cluster import load_cluster# noqa: E402
from fusion.compile import compile_model  # noqa: E402
from fusion.compress.bottleneck import BottleneckRequest, initial_values  # noqa: E402
from fusion.ir.model import Model  # noqa: E402
from fusion.ir.node import NodeKind  # noqa: E402
from fusion.plan import OptimizerConfig  # noqa: E402

log = logging.getLogger("bottleneck_study")

#: the study's runs, in order: (uses the bottleneck plan, codec of every cut edge or None, optimizer name)
RUNS = {
    "dense": (False, None, "adamw"),
    "quant4": (False, "quant4", "adamw"),
    "bottleneck": (True, None, "adamw"),
    "bottleneck+quant4": (True, "quant4", "adamw"),
    "bottleneck+muon": (True, None, "muon"),
    "dense+muon": (False, None, "muon"),  # bottleneck+muon's comparator: the same optimizer without the bottleneck
}


@dataclasses.dataclass(frozen=True)
class StudyConfig:
    """One study's shape.

    d_model, n_layer, n_head: the GPT (examples/models/gpt.py; the corpus's 96 tokens, untied head).
    seq:            characters per window (the GPT's context).
    global_batch:   windows per step, ``micro_batches`` micro-batches of ``global_batch / micro_batches``.
    rank:           R of every bottleneck (the cut edges' width D over R is the bottleneck's wire reduction).
    lr:             AdamW's (and Muon's, matched RMS) learning rate, constant.
    steps:          optimizer steps of every run.
    eval_every:     steps between validation losses (and after the last step).
    val_windows:    windows in the fixed validation set (a multiple of ``global_batch``).
    link_mbit, link_ms: the link between the two sites (bandwidth, latency).
    device_mb:      memory of each device: below what the model needs, so the compiler cuts it in two.
    """

    d_model: int = 128
    n_layer: int = 2
    n_head: int = 4
    seq: int = 32
    global_batch: int = 16
    micro_batches: int = 2
    rank: int = 2
    lr: float = 3e-3
    steps: int = 200
    eval_every: int = 20
    val_windows: int = 64
    link_mbit: float = 5.0
    link_ms: float = 80.0
    device_mb: float = 8.0


#: ``--quick``: the machinery end to end in seconds (a test runs it); its figures mean nothing
QUICK = StudyConfig(d_model=64, n_layer=2, n_head=2, seq=16, global_batch=4, rank=1, steps=4, eval_every=2,
                    val_windows=8, device_mb=1.0)


def cluster_yaml(cfg: StudyConfig) -> str:
    """The two-site cluster: one CPU device of ``device_mb`` MB per site, ``link_mbit`` Mbit/s and ``link_ms`` ms
    between them."""
    return f"""# bottleneck study: two sites joined by a slow link
name: two-sites-{cfg.link_mbit:g}mbit-{cfg.link_ms:g}ms
devices:
  - {{name: cpu-0, group: site-a, peak_flops: 50 GFLOPS, memory: {cfg.device_mb:g} MB}}
  - {{name: cpu-1, group: site-b, peak_flops: 50 GFLOPS, memory: {cfg.device_mb:g} MB}}
links:
  default: {{latency: {cfg.link_ms:g} ms, bandwidth: {cfg.link_mbit:g} Mbit/s}}
"""


def traced_gpt(cfg: StudyConfig, seed: int) -> Model:
    """The study's GPT initialised from ``seed``, traced (one micro-batch as the example)."""
    from gpt import GPTConfig, gpt_model

    from fusion.ir.trace import trace

    gcfg = GPTConfig(vocab=96, n_layer=cfg.n_layer, n_head=cfg.n_head, d_model=cfg.d_model, seq_len=cfg.seq,
                     tie_embeddings=False)
    module, example = gpt_model(gcfg, batch=cfg.global_batch // cfg.micro_batches, seed=seed)
    return trace(module, example, labels=("targets",))


def plans(cfg: StudyConfig, model: Model, cluster, seed: int):
    """``{False: (dense model, plan), True: (bottleneck model, plan)}``, both cut by OP-Fence on ``cluster``."""
    kw = dict(strategy="opfence", micro_batches=cfg.micro_batches, seed=seed)
    dense = compile_model(model, cluster, **kw)
    bplan = compile_model(model, cluster, bottleneck=BottleneckRequest(rank=cfg.rank), **kw)
    if not bplan.bottlenecks:
        raise SystemExit("bottleneck_study.py: the compiler inserted no bottleneck on this cut")
    moved = {n: (p, bplan.assignment[n]) for n, p in dense.assignment.items() if bplan.assignment[n] != p}
    if moved:
        raise SystemExit(f"bottleneck_study.py: the bottleneck plan cut the model elsewhere: {moved}")
    bmodel = Model(bplan.graph, {**model.params, **initial_values(bplan.bottlenecks)}, model.example)
    return {False: (model, dense), True: (bmodel, bplan)}


def val_loss(ex, vset: dict[str, np.ndarray], rows: int) -> float:
    """Mean loss of the validation windows, ``rows`` at a time (one step's batch)."""
    loss_node = next(n for n, node in ex.graph.nodes.items() if node.kind == NodeKind.LOSS)
    n = next(iter(vset.values())).shape[0]
    vals = [float(ex.forward_outputs({k: v[i:i + rows] for k, v in vset.items()})[loss_node])
            for i in range(0, n, rows)]
    return float(np.mean(vals))


def one_run(cfg: StudyConfig, run: str, built, train_tokens: np.ndarray, vset, seed: int) -> dict[str, Any]:
    """Train ``run`` for ``cfg.steps`` steps; its losses, validation curve, clock and bytes."""
    use_b, codec, opt_name = RUNS[run]
    model, plan = built[use_b]
    comp = codec_edges(model, plan.assignment, CODEC_RUNS[codec]) if codec else None
    opt = OptimizerConfig(opt_name, lr=cfg.lr)
    curve: list[tuple[int, float]] = []

    def evaluate(step: int, ex) -> None:
        if step % cfg.eval_every == 0 or step == cfg.steps:
            curve.append((step, val_loss(ex, vset, cfg.global_batch)))

    batches = ({k: v.numpy() for k, v in b.items()} for b in train_batches(train_tokens, cfg, cfg.steps, seed))
    t0 = time.perf_counter()
    losses, times, clock = train(model, plan, comp, batches, cfg.lr, optimizer=opt, after_step=evaluate,
                                 timer=time.thread_time)
    out = {"final_train_loss": round(float(losses[-1]), 4), "final_val": round(curve[-1][1], 4),
           "val_curve": [[s, round(v, 4)] for s, v in curve],
           "sim_s": round(float(times[-1]), 2), "compute_s": round(clock["compute"], 2),
           "comm_s": round(clock["comm"], 2), "cut_bytes": int(clock["bytes"]),
           "times": [float(t) for t in times], "wall_s": round(time.perf_counter() - t0, 1)}
    log.info("seed %d %-18s val %.4f (train %.4f)  %.1f simulated s (compute %.1f, comm %.1f), %.3f MB across the "
             "cut, %.0f s wall", seed, run, out["final_val"], out["final_train_loss"], out["sim_s"],
             out["compute_s"], out["comm_s"], out["cut_bytes"] / 1e6, out["wall_s"])
    log.info("seed %d %s val curve %s, simulated s at those steps %s", seed, run, out["val_curve"],
             [round(out["times"][st - 1], 2) for st, _ in out["val_curve"]])
    return out


def time_to(run: dict, target: float) -> float | None:
    """Simulated seconds at the first evaluated step whose validation loss is <= ``target`` (None: never)."""
    for step, v in run["val_curve"]:
        if v <= target:
            return run["times"][step - 1]
    return None


def seed_row(cfg: StudyConfig, runs: Sequence[str], cluster_text: str, seed: int) -> dict[str, Any]:
    """One seed's runs and its figures against dense (a process of its own with ``--jobs``)."""
    torch.set_num_threads(1)
    torch.manual_seed(seed)
    train_tokens, val_tokens = split_corpus(text_corpus())
    vset = {k: v.numpy() for k, v in validation_set(val_tokens, cfg).items()}
    with tempfile.TemporaryDirectory(prefix="fusion-bottleneck-") as tmp:
        path = Path(tmp) / "cluster.yaml"
        path.write_text(cluster_text)
        cluster = load_cluster(path)
        built = plans(cfg, traced_gpt(cfg, seed), cluster, seed)
    res = {run: one_run(cfg, run, built, train_tokens, vset, seed) for run in runs}
    dense = res["dense"]
    for name, r in res.items():
        if name == "dense":
            continue
        t = time_to(r, dense["final_val"])
        r["val_gap"] = round(r["final_val"] - dense["final_val"], 4)
        r["wire_reduction"] = round(dense["cut_bytes"] / r["cut_bytes"], 2)
        r["time_to_dense_val_s"] = None if t is None else round(t, 2)
        r["time_to_dense_val_loss_ratio"] = None if t is None else round(t / dense["sim_s"], 4)
    for r in res.values():
        del r["times"]
    spec = built[True][1].bottlenecks
    res["bottlenecks"] = [{"edge": b.edge, "src": b.src, "dsts": list(b.dsts), "width": b.width, "rank": b.rank}
                          for b in spec]
    return res


def _median(values: list[float | None]) -> float | None:
    """The median, a None (a miss) counting as +inf; None when the median is a miss."""
    m = statistics.median([math.inf if v is None else v for v in values])
    return None if math.isinf(m) else round(m, 4)


def _child_logging() -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")


def seed_rows(job, seeds: Sequence[int], jobs: int = 1) -> list:
    """``job(seed)`` for every seed, in order: ``jobs`` seeds at a time, each in a process of its own (spawned,
    logging as the parent does), or here one after another when ``jobs`` is 1."""
    if jobs > 1:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        with ProcessPoolExecutor(min(jobs, len(seeds)), mp_context=multiprocessing.get_context("spawn"),
                                 initializer=_child_logging) as ex:
            rows = list(ex.map(job, seeds))
    else:
        rows = [job(s) for s in seeds]
    return rows


def study(cfg: StudyConfig, seeds: Sequence[int], runs: Sequence[str], jobs: int = 1) -> dict[str, Any]:
    """Every seed's runs (``jobs`` seeds at a time, each in its own process) and the medians."""
    train_tokens, val_tokens = split_corpus(text_corpus())
    uni = unigram_loss(train_tokens, val_tokens)
    log.info("corpus: %d training / %d validation characters; unigram validation loss %.3f", train_tokens.size,
             val_tokens.size, uni)
    rows = seed_rows(functools.partial(seed_row, cfg, runs, cluster_yaml(cfg)), seeds, jobs)
    per_seed = {str(s): row for s, row in zip(seeds, rows)}
    rows = [per_seed[str(s)] for s in seeds]
    med = {run: {k: _median([r[run][k] for r in rows])
                 for k in ("final_val", "val_gap", "wire_reduction", "time_to_dense_val_loss_ratio")
                 if k in rows[0][run]} for run in runs}
    dense_val = med["dense"]["final_val"]
    out: dict[str, Any] = {
        "benchmark": "bottleneck_study", "clock": "simulated (measured compute + alpha-beta link, serial)",
        "config": dataclasses.asdict(cfg), "seeds": list(seeds), "unigram_val_loss": round(uni, 4),
        "dense_final_val_median": dense_val, "dense_left_plateau": bool(dense_val < uni - 0.5),
    }
    if "bottleneck" in runs:
        b = [r["bottleneck"] for r in rows]
        out.update({
            "bottleneck_wire_reduction": med["bottleneck"]["wire_reduction"],
            "bottleneck_val_loss_gap": med["bottleneck"]["val_gap"],
            "time_to_dense_val_loss_ratio": med["bottleneck"]["time_to_dense_val_loss_ratio"],
            "per_seed_figures": {str(s): {k: r[k] for k in ("wire_reduction", "val_gap", "time_to_dense_val_loss_ratio")}
                                 for s, r in zip(seeds, b)},
            "targets": {"bottleneck_wire_reduction": ">= 64", "bottleneck_val_loss_gap": "<= 0.03",
                        "time_to_dense_val_loss_ratio": "<= 0.25"},
        })
    out["medians"] = med
    out["per_seed"] = per_seed
    return out


def table(res: dict[str, Any], runs: Sequence[str]) -> list[str]:
    """Markdown rows: per run, the medians and every seed's validation loss."""
    seeds = res["seeds"]
    lines = ["| run | val loss (median) | per seed | gap vs dense | wire reduction | time to dense val ratio | "
             "simulated s/step (seed 0: compute + comm) |", "|---|---|---|---|---|---|---|"]
    for run in runs:
        m = res["medians"][run]
        s0 = res["per_seed"][str(seeds[0])][run]
        steps = res["config"]["steps"]
        fmt = lambda v: "—" if v is None else f"{v}"  # noqa: E731
        lines.append(f"| {run} | {m['final_val']} | {', '.join(str(res['per_seed'][str(s)][run]['final_val']) for s in seeds)}"
                     f" | {fmt(m.get('val_gap'))} | {fmt(m.get('wire_reduction'))} | "
                     f"{fmt(m.get('time_to_dense_val_loss_ratio')) if run != 'dense' else '1'} | "
                     f"{s0['sim_s'] / steps:.3f} ({s0['compute_s'] / steps:.3f} + {s0['comm_s'] / steps:.3f}) |")
    return lines


def main(argv=None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=None, help="optimizer steps of every run (default 200)")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--runs", default="dense,quant4,bottleneck,bottleneck+quant4",
                    help=f"runs (dense always): {', '.join(RUNS)}")
    ap.add_argument("--rank", type=int, default=None, help="the bottleneck rank R (default 2: width 128 / 64)")
    ap.add_argument("--quick", action="store_true", help="a tiny model, 4 steps, one seed: the machinery only")
    ap.add_argument("--jobs", type=int, default=1, help="seeds trained at a time, each in its own process")
    args = ap.parse_args(argv)
    cfg = QUICK if args.quick else StudyConfig()
    if args.steps is not None:
        cfg = dataclasses.replace(cfg, steps=args.steps)
    if args.rank is not None:
        cfg = dataclasses.replace(cfg, rank=args.rank)
    runs = ["dense", *[r for r in args.runs.split(",") if r and r != "dense"]]
    unknown = sorted(set(runs) - set(RUNS))
    if unknown:
        raise SystemExit(f"bottleneck_study.py: unknown runs {unknown} (known: {', '.join(RUNS)})")
    seeds = [0] if args.quick else [int(s) for s in args.seeds.split(",")]
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.set_num_threads(1)
    res = study(cfg, seeds, runs, args.jobs)
    print("\n".join(table(res, runs)))
    print(json.dumps(res))
    return res


if __name__ == "__main__":
    main()
