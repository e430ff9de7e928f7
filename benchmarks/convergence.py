"""Convergence study: dense vs uniform Top-K vs AdaTopK (FusionLLM §5, Fig. 10/11 in spirit).

Two models on the ``local-4-two-sites`` cluster (4 CPUs, two sites joined by a
20 Mbit/s / 30 ms link), partitioned by the compiler with ``equal-flops`` (OP-Fence
puts these small models on one device: no cut edge, nothing to compress):

* a small char-level GPT on real text shipped with Python (the docstrings and
  source of a fixed list of stdlib modules; nothing is downloaded);
* the branching CNN of ``examples/branching_cnn.py`` on synthetic images
  (class templates plus noise, so the task is learnable).

Four runs per model, same seed, same batches: ``dense`` (no compression),
``uniform`` (every cut edge, both directions, Top-K ratio r), ``adatopk``
(the compiler's per-edge ratios for ``compress_ratio=r``, Eq. (7)) and
``adatopk+ef`` (the same with error feedback).

Two clocks (``--clock``, both by default):

* ``emulated``: a real run, one executor process per part on loopback with
  ``--emulate-links`` (every message delayed by its link's alpha and rate-limited
  to its beta), timed by the coordinator: compute, communication and the
  pipeline overlap as they would on the cluster;
* ``simulated``: in one process with the :class:`ReferenceExecutor` (the same
  :class:`PartRuntime` compression path), the measured compute of every part
  plus ``alpha + beta * bytes`` of every cross-part message, summed serially
  (no overlap: an upper bound).

Both must train identically (the JSON's ``max_loss_diff_simulated_vs_emulated``).
Outputs PNG loss curves (against the last clock), a markdown table of the time
to a target loss, and a final JSON line.

Codec runs (``--runs``): ``quant8``, ``quant4``, ``hquant4`` (both directions through one codec) and
``delta4``, ``delta2`` (AQ-SGD activation deltas at 4 / 2 bits, gradients 4-bit ``quant``), and ``auto``:
the codecs ``fusion compile --compress auto --samples N`` gives the same cut (per edge and direction the
candidate the cost model prices fastest among those this study shows to converge, only where it pays;
``fusion.compress.policy``). Data: by
default a fixed dataset of ``--samples 512`` windows / images visited in epochs, each with its sample id,
so that ``delta`` sees every sample again (``--samples 0``: fresh random batches, the first edition's data).

    python benchmarks/convergence.py [--steps 300] [--ratio 100] [--out docs/img] [--clock both] [--samples 512]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "examples"), str(ROOT / "examples" / "models")]

from fusion.cluster import load_cluster# noqa: E402
from fusion.compile import compile_model  # noqa: E402
from fusion.executors.runtime.linkemu import link_model  # noqa: E402
from fusion.executors.runtime.packing import by_destination  # noqa: E402
from fusion.plan import OptimizerConfig  # noqa: E402
from fusion.executors.reference import ReferenceExecutor  # noqa: E402
from fusion.ir.boundary import partition  # noqa: E402
from fusion.plan import EdgeCompression  # noqa: E402
from fusion.ir.opdata import SAMPLE_IDS  # noqa: E402

log = logging.getLogger("convergence")
CLUSTER = ROOT / "examples" / "clusters" / "local-4-two-sites.yaml"
#: stdlib modules whose source is the GPT corpus (present in every CPython install)
CORPUS_MODULES = ("argparse", "collections/__init__", "dataclasses", "functools", "inspect", "logging/__init__",
                  "pathlib", "subprocess", "textwrap", "typing")


# -- data -----------------------------------------------------------------------------------

def text_corpus() -> np.ndarray:
    """Bytes of stdlib sources as char tokens: printable ASCII 32..126 -> 1..95, newline 0, else 95."""
    lib = Path(sysconfig.get_paths()["stdlib"])
    raw = b"".join((lib / f"{m}.py").read_bytes() for m in CORPUS_MODULES if (lib / f"{m}.py").exists())
    a = np.frombuffer(raw, np.uint8).astype(np.int64)
    tok = np.where((a >= 32) & (a <= 126), a - 31, 95)
    return np.where(a == 10, 0, tok)


def epoch_order(samples: int, steps: int, batch: int, seed: int):
    """Sample indices of each step's batch: a fresh permutation of the ``samples`` each epoch (a batch never
    holds a sample twice: ``samples`` must be a multiple of ``batch``)."""
    if samples % batch:
        raise SystemExit(f"convergence.py: --samples {samples} is not a multiple of the batch ({batch})")
    g = np.random.default_rng([seed, 99])
    order = np.empty(0, dtype=np.int64)
    for _ in range(steps):
        if order.size == 0:
            order = g.permutation(samples)
        yield order[:batch]
        order = order[batch:]


def gpt_batches(tokens: np.ndarray, steps: int, batch: int, seq: int, seed: int, samples: int = 0):
    """``samples`` = 0: random windows (the first edition's data, no sample revisited on purpose); else a fixed
    dataset of that many windows spread over the corpus, in epochs, each window's index its sample id
    (``#sample_ids``, what the ``delta`` runs key their buffers by; the other runs ignore it)."""
    if samples:
        starts = np.linspace(0, tokens.size - seq - 2, samples).astype(np.int64)
        for pick in epoch_order(samples, steps, batch, seed):
            win = np.stack([tokens[s:s + seq + 1] for s in starts[pick]])
            yield {"idx": np.ascontiguousarray(win[:, :-1]), "targets": np.ascontiguousarray(win[:, 1:]),
                   SAMPLE_IDS: pick.astype(np.int64)}
        return
    g = np.random.default_rng(seed)
    for _ in range(steps):
        start = g.integers(0, tokens.size - seq - 1, batch)
        win = np.stack([tokens[s:s + seq + 1] for s in start])
        yield {"idx": np.ascontiguousarray(win[:, :-1]), "targets": np.ascontiguousarray(win[:, 1:])}


def cnn_batches(steps: int, batch: int, seed: int, classes: int, image: int, samples: int = 0):
    """Class templates plus noise; ``samples`` > 0: a fixed dataset of that many images in epochs, with ids."""
    g = np.random.default_rng(seed)
    templates = np.random.default_rng(1234).standard_normal((classes, 3, image, image)).astype(np.float32)
    if samples:
        y_all = g.integers(0, classes, samples)
        x_all = templates[y_all] + 1.5 * g.standard_normal((samples, 3, image, image)).astype(np.float32)
        for pick in epoch_order(samples, steps, batch, seed):
            yield {"x": x_all[pick], "y": y_all[pick], SAMPLE_IDS: pick.astype(np.int64)}
        return
    for _ in range(steps):
        y = g.integers(0, classes, batch)
        x = templates[y] + 1.5 * g.standard_normal((batch, 3, image, image)).astype(np.float32)
        yield {"x": x, "y": y}


# -- models -------------------------------------------------------------------------------

def gpt_config(seq: int):
    """The study's char-level GPT: the corpus's 96 tokens, 2 layers, 2 heads, width 64, ``seq`` tokens."""
    from gpt import GPTConfig

    return GPTConfig(vocab=96, n_layer=2, n_head=2, d_model=64, seq_len=seq)


def gpt(mb: int, seq: int):
    from gpt import gpt_model

    from fusion.ir.trace import trace

    module, example = gpt_model(gpt_config(seq), batch=mb, seed=0)
    return trace(module, example, labels=("targets",))


def cnn(mb: int):
    import branching_cnn

    return branching_cnn.build(width=8, batch=mb, seed=0)


# -- runs ---------------------------------------------------------------------------------

def uniform_edges(model, assignment, ratio: float) -> list[EdgeCompression]:
    """Every cut edge (producer output -> consumer part), both directions, at ``ratio``."""
    out = {}
    for p, sub in partition(model.graph, assignment).items():
        for e in sub.boundary.sent_acts:
            dst = assignment[e.actual_user]
            out[(e.producer, e.index, p, dst)] = EdgeCompression(e.producer, e.index, p, dst, ratio)
    return list(out.values())


#: codec runs: every cut edge, activations and gradients through one codec (``--runs`` picks them); a pair is
#: (activations, gradients): AQ-SGD's delta is for activations, its gradients go through 4-bit quant as in quant4
_Q4 = {"algo": "quant", "bits": 4, "block": 64}
CODEC_RUNS = {
    "quant8": {"algo": "quant", "bits": 8, "block": 64},
    "quant4": _Q4,
    "quant2": {"algo": "quant", "bits": 2, "block": 64},
    "quant2fwd": ({"algo": "quant", "bits": 2, "block": 64}, _Q4),  # delta2's comparator: same bits each way
    "hquant4": {"algo": "hadamard-quant", "bits": 4, "block": 64},
    "delta4": ({"algo": "delta", "bits": 4, "block": 64}, _Q4),
    "delta2": ({"algo": "delta", "bits": 2, "block": 64}, _Q4),
}
#: runs that need a fixed dataset in epochs (``--samples``): their buffers are per training sample
DELTA_RUNS = ("delta4", "delta2")
TOPK_RUNS = ("uniform", "adatopk", "adatopk+ef")
#: the compiler's choice (``--compress auto``); with ``--samples 0`` it may not choose delta
AUTO_RUN = "auto"


def auto_edges(model, assignment, samples: int) -> list[EdgeCompression]:
    """What ``--compress auto`` gives the study's cut: compiled with the same partitioner, whose cut does not
    depend on codec prices (checked), and ``--samples`` as the data set's size (0: unknown, no delta)."""
    from fusion.compress.policy import request

    plan = compile_model(model, load_cluster(CLUSTER), strategy="equal-flops", micro_batches=2,
                         compress=request("auto", samples=samples or None))
    if plan.assignment != assignment:
        raise SystemExit("convergence.py: the auto plan cut the model elsewhere than the study's plan")
    log.info("auto: %s", {f"{c.producer}:{c.src}->{c.dst}": (c.codec("fwd"), c.codec("bwd")) for c in plan.compression})
    return list(plan.compression)


def codec_edges(model, assignment, cfg) -> list[EdgeCompression]:
    """Every cut edge (producer output -> consumer part), both directions, through codec ``cfg`` (a dict for
    both directions, or a (fwd, bwd) pair)."""
    fwd, bwd = cfg if isinstance(cfg, tuple) else (cfg, cfg)
    return [dataclasses.replace(e, ratio=1.0, fwd_codec=dict(fwd), bwd_codec=dict(bwd))
            for e in uniform_edges(model, assignment, 1.0)]


def train(model, plan, compression, batches, lr: float, optimizer: OptimizerConfig | None = None, after_step=None,
          timer=time.perf_counter):
    """Losses and simulated seconds per iteration (compute measured, communication from the link model).

    optimizer: the plan's optimizer (default AdamW at ``lr``); after_step: ``f(step, executor)`` called after
    every step (1-based), outside the clock (an evaluation's forward is not counted); timer: the clock compute is
    measured with (``time.thread_time``: CPU seconds of this thread, what a dedicated core would take, unaffected
    by other processes on a loaded host)."""
    ex = ReferenceExecutor(model, plan.assignment, optimizer or OptimizerConfig("adamw", lr=lr),
                           micro_batches=plan.micro_batches, compression=compression)
    links = {}
    for a in plan.parts.values():
        for b in plan.parts.values():
            links[(a.name, b.name)] = link_model(plan.cluster, a.device, b.device)
    clock = {"compute": 0.0, "comm": 0.0, "bytes": 0}

    def wrap(part):
        fwd, bwd = part.forward, part.backward

        def account(out, dt):
            clock["compute"] += dt
            for group in by_destination(out):  # one message per destination part, as the runtime sends them
                n = sum(int(m.payload.nbytes) if hasattr(m.payload, "nbytes") else 8 for m in group)  # dense, sparse, quant, delta
                clock["bytes"] += n
                clock["comm"] += links[(group[0].src, group[0].dst)].time(n)

        def f(*a, **kw):
            t = timer()
            out, loss = fwd(*a, **kw)
            account(out, timer() - t)
            return out, loss

        def b(*a, **kw):
            t = timer()
            out = bwd(*a, **kw)
            account(out, timer() - t)
            return out

        part.forward, part.backward = f, b

    for part in ex.parts.values():
        wrap(part)
    losses, times = [], []
    for step, batch in enumerate(batches, 1):
        losses.append(ex.step(batch).loss)
        times.append(clock["compute"] + clock["comm"])
        if after_step is not None:
            after_step(step, ex)
    return np.array(losses), np.array(times), clock


def train_emulated(model, plan, compression, batches, lr: float, run_dir: Path):
    """Losses and measured wall seconds per iteration of a real run with emulated links.

    One executor process per part on loopback (``LocalCluster``, as ``fusion run
    --emulate-links``): every cross-part message is delayed by the link's alpha and
    rate-limited to its beta by ``executors/runtime/linkemu.py``, and compute, communication
    and the pipeline schedule overlap as they would on the cluster. The clock is the
    coordinator's ``iteration_s`` (``step`` sent to last ``done``), summed.
    """
    from fusion.executors.runtime.coordinator import CoordinatorConfig
    from fusion.executors.runtime.launcher import LocalCluster
    from fusion.plan import save_plan

    p = dataclasses.replace(plan, compression=list(compression or []),
                            optimizer=OptimizerConfig("adamw", lr=lr).to_dict())
    plan_dir = save_plan(p, run_dir / "plan", params=model.params)
    losses, times, sent, clock = [], [], 0, 0.0
    with LocalCluster(plan_dir, run_dir, CoordinatorConfig(emulate_links=True, peer_timeout_s=120), threads=1,
                      trace=False, verbose=0) as lc:
        lc.start()
        for batch in batches:
            rep = lc.coordinator.step(batch)
            losses.append(rep.loss)
            clock += rep.iteration_s
            times.append(clock)
            sent += sum(v["bytes"] for st in rep.parts.values() for peer, v in st.get("sent", {}).items()
                        if peer in plan.parts)  # wire bytes between parts, control traffic excluded
    return np.array(losses), np.array(times), {"compute": float("nan"), "comm": float("nan"), "bytes": sent}


def ema(x: np.ndarray, beta: float = 0.9) -> np.ndarray:
    out, m = np.empty_like(x), x[0]
    for i, v in enumerate(x):
        m = beta * m + (1 - beta) * v
        out[i] = m
    return out


def _time_to(times: np.ndarray, e: np.ndarray, target: float) -> tuple[int | None, float | None]:
    hit = np.nonzero(e <= target)[0]
    return (int(hit[0]) + 1, float(times[hit[0]])) if hit.size else (None, None)


def study(name: str, model, batches_fn, steps: int, ratio: float, lr: float, out: Path, clocks: tuple[str, ...],
          work: Path, wanted: tuple[str, ...] = ("dense", *TOPK_RUNS), samples: int = 0):
    """Train every run under each clock; time-to-target and the curves' PNG."""
    plan = compile_model(model, load_cluster(CLUSTER), strategy="equal-flops", micro_batches=2, compress_ratio=ratio)
    runs = {"dense": None, "uniform": uniform_edges(model, plan.assignment, ratio), "adatopk": plan.compression,
            "adatopk+ef": [dataclasses.replace(c, error_feedback=True) for c in plan.compression],
            **{run: codec_edges(model, plan.assignment, cfg) for run, cfg in CODEC_RUNS.items()}}
    if AUTO_RUN in wanted:
        runs[AUTO_RUN] = auto_edges(model, plan.assignment, samples)
    runs = {run: comp for run, comp in runs.items() if run in wanted or run == "dense"}
    log.info("%s: parts %s; AdaTopK ratios %s", name, {p.name: p.device for p in plan.parts.values()},
             {f"{c.producer}:{c.src}->{c.dst}": round(c.ratio, 1) for c in plan.compression})
    res: dict[str, dict] = {}
    for run, comp in runs.items():
        r = res[run] = {}
        for clock in clocks:
            t0 = time.perf_counter()
            if clock == "simulated":
                losses, times, c = train(model, plan, comp, batches_fn(), lr)
            else:
                losses, times, c = train_emulated(model, plan, comp, batches_fn(), lr, work / f"{name}-{run}")
            if "losses" in r:  # the in-process and the multi-process run must train identically
                r["max_loss_diff"] = float(np.abs(r["losses"] - losses).max())
            r["losses"] = losses
            r[clock] = {"times": times, "bytes": c["bytes"], "wall_s": time.perf_counter() - t0}
            log.info("%s %-10s %-9s final loss %.3f (ema %.3f)  %.1f s for %d steps, %.2f MB between parts, "
                     "wall %.1f s", name, run, clock, losses[-1], ema(losses)[-1], times[-1], steps, c["bytes"] / 1e6,
                     r[clock]["wall_s"])
    # targets: the loss the dense run's smoothed curve reaches at 25 % ("early") and 80 % ("late") of the steps
    dense_ema = ema(res["dense"]["losses"])
    targets = {"early": float(dense_ema[int(0.25 * steps) - 1]), "late": float(dense_ema[int(0.8 * steps) - 1])}
    for r in res.values():
        e = ema(r["losses"])
        r["final_ema"] = float(e[-1])
        for clock in clocks:
            for tname, target in targets.items():
                r[f"steps_to_{tname}"], r[clock][f"time_to_{tname}_s"] = _time_to(r[clock]["times"], e, target)
    plot(name, res, targets, ratio, clocks[-1], out / f"convergence_{name}.png")
    return res, targets


def plot(name, res, targets, ratio, clock: str, path: Path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    label = {"dense": "dense", "uniform": f"uniform Top-K (r={ratio:g})", "adatopk": f"AdaTopK (r={ratio:g})",
             "adatopk+ef": f"AdaTopK + error feedback (r={ratio:g})"}
    for run, r in res.items():
        e = ema(r["losses"])
        axes[0].plot(np.arange(1, len(e) + 1), e, label=label.get(run, run))
        axes[1].plot(r[clock]["times"], e, label=label.get(run, run))
    xlabel = "measured time, emulated links (s)" if clock == "emulated" else "simulated time (s)"
    for ax, xl in zip(axes, ("iteration", xlabel)):
        for tname, target in targets.items():
            ax.axhline(target, color="grey", ls=":" if tname == "late" else "--", lw=1, label=f"{tname} target")
        ax.set_xlabel(xl)
        ax.set_ylabel("training loss (EMA 0.9)")
        ax.grid(alpha=0.3)
    axes[1].set_xscale("log")
    axes[0].legend(fontsize=8)
    fig.suptitle(f"{name}: local-4-two-sites, equal-flops partition")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def report(name: str, res: dict, clocks: tuple[str, ...]) -> tuple[dict, list[str]]:
    """JSON summary and markdown rows of one model's runs."""
    fmt = lambda v, f: "not reached" if v is None else f % v  # noqa: E731
    out, rows = {}, []
    for run, r in res.items():
        row = {"final_ema": round(r["final_ema"], 4), "steps_to_early": r["steps_to_early"],
               "steps_to_late": r["steps_to_late"]}
        if "max_loss_diff" in r:
            row["max_loss_diff_simulated_vs_emulated"] = r["max_loss_diff"]
        cells = []
        for clock in clocks:
            c = r[clock]
            row[clock] = {"s_per_step": round(float(c["times"][-1]) / len(c["times"]), 4),
                          "mbytes": round(c["bytes"] / 1e6, 3)}
            # what dense had reached when this run ended: is compression worth its cost at equal time?
            dt, de = res["dense"][clock]["times"], ema(res["dense"]["losses"])
            row[clock]["dense_ema_at_same_time"] = round(float(de[min(np.searchsorted(dt, c["times"][-1]), len(de) - 1)]), 4)
            _, t_final = _time_to(c["times"], ema(r["losses"]), float(de[-1]))  # to dense's final (smoothed) loss
            row[clock]["time_to_dense_final_s"] = None if t_final is None else round(t_final, 2)
            row[clock]["time_to_dense_final_ratio"] = None if t_final is None else round(t_final / float(dt[-1]), 3)
            for t in ("early", "late"):
                d, x = res["dense"][clock][f"time_to_{t}_s"], c[f"time_to_{t}_s"]
                row[clock][f"time_to_{t}_s"] = None if x is None else round(x, 2)
                row[clock][f"speedup_{t}"] = None if (x is None or d is None) else round(d / x, 3)
            cells.append(f"{fmt(row[clock]['time_to_early_s'], '%.1f')} / {fmt(row[clock]['time_to_late_s'], '%.1f')}"
                         f" | {row[clock]['s_per_step']:.3f} | {row[clock]['dense_ema_at_same_time']:.3f}")
        rows.append(f"| {name} | {run} | {r['final_ema']:.3f} | {fmt(row['steps_to_early'], '%d')} / "
                    f"{fmt(row['steps_to_late'], '%d')} | " + " | ".join(cells) +
                    f" | {row[clocks[-1]]['mbytes']:.2f} |")
        out[run] = row
    return out, rows


def best_codec(res: dict, clock: str) -> dict:
    """The compressed run that reaches dense's final (smoothed) loss soonest on ``clock``:
    ``time_to_dense_loss_ratio`` is its wall time to that loss over dense's whole run (None: no run reaches
    it), ``final_loss_rel_gap`` its final loss against dense's at the same step count."""
    dense = res["dense"]
    target = float(ema(dense["losses"])[-1])
    best, best_t = None, None
    for run, r in res.items():
        if run == "dense":
            continue
        _, t = _time_to(r[clock]["times"], ema(r["losses"]), target)
        if t is not None and (best_t is None or t < best_t):
            best, best_t = run, t
    pick = best or min((run for run in res if run != "dense"), key=lambda run: res[run]["final_ema"], default=None)
    if pick is None:
        return {}
    return {"best_codec": pick,
            "time_to_dense_loss_ratio": None if best_t is None else round(best_t / float(dense[clock]["times"][-1]), 3),
            "final_loss_rel_gap": round((res[pick]["final_ema"] - dense["final_ema"]) / dense["final_ema"], 4)}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--ratio", type=float, default=100.0)
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "img")
    ap.add_argument("--models", default="gpt,cnn")
    ap.add_argument("--clock", choices=["simulated", "emulated", "both"], default="both",
                    help="simulated: in-process, alpha-beta clock (about a minute); emulated: one process per part "
                         "with --emulate-links, measured time (about 10 minutes); both (default)")
    ap.add_argument("--work", type=Path, default=None, help="run directories of the emulated runs (default: a temp dir)")
    ap.add_argument("--runs", default=",".join(("dense", *TOPK_RUNS, *CODEC_RUNS, AUTO_RUN)),
                    help=f"runs to train (dense always): {', '.join((*TOPK_RUNS, *CODEC_RUNS, AUTO_RUN))}")
    ap.add_argument("--samples", type=int, default=512,
                    help="a fixed dataset of this many samples (GPT windows, CNN images) visited in epochs, each "
                         "with its sample id (the delta runs need it); 0: the first edition's fresh random batches")
    args = ap.parse_args(argv)
    wanted = tuple(args.runs.split(","))
    if args.samples == 0 and set(wanted) & set(DELTA_RUNS):
        raise SystemExit(f"convergence.py: runs {sorted(set(wanted) & set(DELTA_RUNS))} keep a buffer per training "
                         "sample and need a fixed dataset: --samples N (N > 0)")
    unknown = sorted(set(wanted) - {"dense", *TOPK_RUNS, *CODEC_RUNS, AUTO_RUN})
    if unknown:
        raise SystemExit(f"convergence.py: unknown runs {unknown}")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.set_num_threads(1)
    clocks = ("simulated", "emulated") if args.clock == "both" else (args.clock,)
    head = "| model | run | final loss (EMA) | steps to early / late target | " + " | ".join(
        f"{c} s to early / late target | {c} s/step | dense loss at this run's end ({c})" for c in clocks) + " | MB between parts |"
    table = [head, "|" + "---|" * (head.count("|") - 1)]
    summary = {}
    with tempfile.TemporaryDirectory(prefix="fusion-convergence-") as tmp:
        work = args.work or Path(tmp)
        for name in args.models.split(","):
            if name == "gpt":
                tokens = text_corpus()
                log.info("gpt corpus: %d characters of stdlib source", tokens.size)
                res, target = study("gpt", gpt(mb=8, seq=32), lambda: gpt_batches(tokens, args.steps, 16, 32, 1, args.samples),
                                    args.steps, args.ratio, 3e-3, args.out, clocks, work, wanted, args.samples)
            elif name == "cnn":
                res, target = study("cnn", cnn(mb=16), lambda: cnn_batches(args.steps, 32, 1, 10, 8, args.samples), args.steps,
                                    args.ratio, 3e-3, args.out, clocks, work, wanted, args.samples)
            else:
                raise SystemExit(f"convergence.py: unknown model {name!r} (gpt, cnn)")
            rows, lines = report(name, res, clocks)
            summary[name] = {"targets": {k: round(v, 4) for k, v in target.items()}, **rows,
                             **best_codec(res, clocks[-1])}
            table += lines
            log.info("%s: target losses %s", name, target)
    print("\n".join(table))
    print(json.dumps({"benchmark": "convergence", "ratio": args.ratio, "steps": args.steps, "clocks": list(clocks),
                      "samples": args.samples,
                      **summary}))


if __name__ == "__main__":
    main()
