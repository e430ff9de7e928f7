"""Convergence study: dense vs uniform Top-K vs AdaTopK (FusionLLM §5, Fig. 10/11 in spirit).

Two models on the ``local-4-two-sites`` cluster (4 CPUs, two sites joined by a
20 Mbit/s / 30 ms link), partitioned by the compiler with ``equal-flops`` (OP-Fence
puts these small models on one device: no cut edge, nothing to compress):

* a small char-level GPT on real text shipped with Python (the docstrings and
  source of a fixed list of stdlib modules; nothing is downloaded);
* the branching CNN of ``examples/branching_cnn.py`` on synthetic images
  (class templates plus noise, so the task is learnable).

Three runs per model, same seed, same batches: ``dense`` (no compression),
``uniform`` (every cut edge, both directions, Top-K ratio r), ``adatopk``
(the compiler's per-edge ratios for ``compress_ratio=r``, Eq. (7)).

Training runs in one process with the :class:`ReferenceExecutor` (the same
:class:`PartRuntime` compression path the distributed CompNodes use). "Time"
is a *simulated clock*: per iteration, the measured compute of every part
plus ``alpha + beta * bytes`` of every cross-part message on its link of the
plan's cluster (the alpha-beta model of ``executors/linkemu.py``), summed
serially — no overlap of compute and communication, so it is an upper bound
that exaggerates neither method. Outputs PNG loss curves, a markdown table of
the simulated time to a target loss, and a final JSON line.

    python benchmarks/convergence.py [--steps 300] [--ratio 100] [--out docs/img]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
import sysconfig
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "examples"), str(ROOT / "examples" / "models")]

from fusion.cluster import load_cluster  # noqa: E402
from fusion.compile import compile_model  # noqa: E402
from fusion.executors.linkemu import link_model  # noqa: E402
from fusion.executors.optim import OptimizerConfig  # noqa: E402
from fusion.executors.reference import ReferenceExecutor  # noqa: E402
from fusion.ir.boundary import partition  # noqa: E402
from fusion.kernels.sparse import SparsePayload  # noqa: E402
from fusion.plan import EdgeCompression  # noqa: E402

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


def gpt_batches(tokens: np.ndarray, steps: int, batch: int, seq: int, seed: int):
    g = np.random.default_rng(seed)
    for _ in range(steps):
        start = g.integers(0, tokens.size - seq - 1, batch)
        win = np.stack([tokens[s:s + seq + 1] for s in start])
        yield {"idx": np.ascontiguousarray(win[:, :-1]), "targets": np.ascontiguousarray(win[:, 1:])}


def cnn_batches(steps: int, batch: int, seed: int, classes: int, image: int):
    g = np.random.default_rng(seed)
    templates = np.random.default_rng(1234).standard_normal((classes, 3, image, image)).astype(np.float32)
    for _ in range(steps):
        y = g.integers(0, classes, batch)
        x = templates[y] + 1.5 * g.standard_normal((batch, 3, image, image)).astype(np.float32)
        yield {"x": x, "y": y}


# -- models -------------------------------------------------------------------------------

def gpt(mb: int, seq: int):
    from gpt import GPTConfig, gpt_model

    from fusion.ir.trace import trace

    cfg = GPTConfig(vocab=96, n_layer=2, n_head=2, d_model=64, seq_len=seq)
    module, example = gpt_model(cfg, batch=mb, seed=0)
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


def train(model, plan, compression, batches, lr: float):
    """Losses and simulated seconds per iteration (compute measured, communication from the link model)."""
    ex = ReferenceExecutor(model, plan.assignment, OptimizerConfig("adamw", lr=lr), micro_batches=plan.micro_batches,
                           compression=compression)
    links = {}
    for a in plan.parts.values():
        for b in plan.parts.values():
            links[(a.name, b.name)] = link_model(plan.cluster, a.device, b.device)
    clock = {"compute": 0.0, "comm": 0.0, "bytes": 0}

    def wrap(part):
        fwd, bwd = part.forward, part.backward

        def account(out, dt):
            clock["compute"] += dt
            for m in out:
                n = m.payload.nbytes if isinstance(m.payload, (np.ndarray, SparsePayload)) else 8
                clock["bytes"] += n
                clock["comm"] += links[(m.src, m.dst)].time(n)

        def f(*a, **kw):
            t = time.perf_counter()
            out, loss = fwd(*a, **kw)
            account(out, time.perf_counter() - t)
            return out, loss

        def b(*a, **kw):
            t = time.perf_counter()
            out = bwd(*a, **kw)
            account(out, time.perf_counter() - t)
            return out

        part.forward, part.backward = f, b

    for part in ex.parts.values():
        wrap(part)
    losses, times = [], []
    for batch in batches:
        losses.append(ex.step(batch).loss)
        times.append(clock["compute"] + clock["comm"])
    return np.array(losses), np.array(times), clock


def ema(x: np.ndarray, beta: float = 0.9) -> np.ndarray:
    out, m = np.empty_like(x), x[0]
    for i, v in enumerate(x):
        m = beta * m + (1 - beta) * v
        out[i] = m
    return out


def study(name: str, model, batches_fn, steps: int, ratio: float, mb: int, lr: float, out: Path):
    plan = compile_model(model, load_cluster(CLUSTER), strategy="equal-flops", micro_batches=2, compress_ratio=ratio)
    runs = {"dense": None, "uniform": uniform_edges(model, plan.assignment, ratio), "adatopk": plan.compression,
            "adatopk+ef": [dataclasses.replace(c, error_feedback=True) for c in plan.compression]}
    log.info("%s: parts %s; AdaTopK ratios %s", name, {p.name: p.device for p in plan.parts.values()},
             {f"{c.producer}:{c.src}->{c.dst}": round(c.ratio, 1) for c in plan.compression})
    res = {}
    for run, comp in runs.items():
        t0 = time.perf_counter()
        losses, times, clock = train(model, plan, comp, batches_fn(), lr)
        res[run] = {"losses": losses, "times": times, "bytes": clock["bytes"], "comm_s": clock["comm"],
                    "compute_s": clock["compute"], "wall_s": time.perf_counter() - t0}
        log.info("%s %-8s final loss %.3f (ema %.3f)  simulated %.1f s (comm %.1f s, %.2f MB)  wall %.1f s", name, run,
                 losses[-1], ema(losses)[-1], times[-1], clock["comm"], clock["bytes"] / 1e6, res[run]["wall_s"])
    # targets: the loss the dense run's smoothed curve reaches at 25 % ("early") and 80 % ("late") of the steps
    dense_ema = ema(res["dense"]["losses"])
    targets = {"early": float(dense_ema[int(0.25 * steps) - 1]), "late": float(dense_ema[int(0.8 * steps) - 1])}
    for run, r in res.items():
        e = ema(r["losses"])
        for tname, target in targets.items():
            hit = np.nonzero(e <= target)[0]
            r[f"steps_to_{tname}"] = int(hit[0]) + 1 if hit.size else None
            r[f"time_to_{tname}_s"] = float(r["times"][hit[0]]) if hit.size else None
        r["final_ema"] = float(e[-1])
    target = targets["late"]
    plot(name, res, targets, ratio, out / f"convergence_{name}.png")
    return res, targets


def plot(name, res, targets, ratio, path: Path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    label = {"dense": "dense", "uniform": f"uniform Top-K (r={ratio:g})", "adatopk": f"AdaTopK (r={ratio:g})",
             "adatopk+ef": f"AdaTopK + error feedback (r={ratio:g})"}
    for run, r in res.items():
        e = ema(r["losses"])
        axes[0].plot(np.arange(1, len(e) + 1), e, label=label[run])
        axes[1].plot(r["times"], e, label=label[run])
    for ax, xl in zip(axes, ("iteration", "simulated time (s)")):
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


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--ratio", type=float, default=100.0)
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "img")
    ap.add_argument("--models", default="gpt,cnn")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.set_num_threads(1)
    summary, table = {}, ["| model | run | final loss (EMA) | steps to early / late target | simulated s to early / late target "
                          "| MB sent | speed-up vs dense (early / late) |", "|---|---|---|---|---|---|---|"]
    for name in args.models.split(","):
        if name == "gpt":
            tokens = text_corpus()
            log.info("gpt corpus: %d characters of stdlib source", tokens.size)
            model = gpt(mb=8, seq=32)
            res, target = study("gpt", model, lambda: gpt_batches(tokens, args.steps, 16, 32, 1), args.steps,
                                args.ratio, 8, 3e-3, args.out)
        else:
            model = cnn(mb=16)
            res, target = study("cnn", model, lambda: cnn_batches(args.steps, 32, 1, 10, 8), args.steps,
                                args.ratio, 16, 3e-3, args.out)
        summary[name] = {"targets": {k: round(v, 4) for k, v in target.items()}}
        fmt = lambda v, f: "not reached" if v is None else f % v  # noqa: E731
        for run, r in res.items():
            row = {"final_ema": round(r["final_ema"], 4), "mbytes": round(r["bytes"] / 1e6, 3)}
            for t in ("early", "late"):
                d, x = res["dense"][f"time_to_{t}_s"], r[f"time_to_{t}_s"]
                row[f"steps_to_{t}"] = r[f"steps_to_{t}"]
                row[f"time_to_{t}_s"] = None if x is None else round(x, 2)
                row[f"speedup_{t}"] = None if (x is None or d is None) else round(d / x, 3)
            table.append(f"| {name} | {run} | {r['final_ema']:.3f} | {fmt(row['steps_to_early'], '%d')} / "
                         f"{fmt(row['steps_to_late'], '%d')} | {fmt(row['time_to_early_s'], '%.1f')} / "
                         f"{fmt(row['time_to_late_s'], '%.1f')} | {row['mbytes']:.2f} | "
                         f"{fmt(row['speedup_early'], '%.2fx')} / {fmt(row['speedup_late'], '%.2fx')} |")
            summary[name][run] = row
        log.info("%s: target losses %s", name, target)
    print("\n".join(table))
    print(json.dumps({"benchmark": "convergence", "ratio": args.ratio, "steps": args.steps, **summary}))


if __name__ == "__main__":
    main()
