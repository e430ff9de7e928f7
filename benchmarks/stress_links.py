"""Stress of the emulated links (issue 28: a run hung on a lost message under ``--emulate-links`` with Top-K edges).

Real runs, one executor process per part on loopback with every cross-part message delayed and rate-limited by
``executors/runtime/linkemu.py`` (as ``fusion run --emulate-links``), of the convergence study's char-level GPT
(``benchmarks/convergence.py``: 2 layers, width 64, the compiler's ``equal-flops`` cut of ``local-4-two-sites``)
with every codec on its cut edges: uniform Top-K, AdaTopK (the compiler's per-edge ratios), AdaTopK with error
feedback, 8- and 4-bit ``quant``, 4-bit ``hadamard-quant`` and AQ-SGD ``delta`` (4-bit, gradients 4-bit quant);
in 4 parts (the compiler's cut) and in 2 (the same cut merged into the two sites, so every message crosses the
slow link). The link between the sites is made as tight as asked (``--mbps``, ``--latency-ms``).

A run fails when a step raises (a CompNode named, or no ``done`` within ``--step-timeout``: a hang). Each run's
losses are also compared with the in-process :class:`ReferenceExecutor` on the same batches through the same
compression path (``--check``; the runs are deterministic, so they must agree to float rounding), and the receivers'
rejected-message counts are summed (0 expected). Prints one line per run and a final JSON line::

    {"benchmark": "stress_links", "runs": 14, "steps": 1400, "failures": 0, "rejected": 0, "wall_s": ...}

    python benchmarks/stress_links.py [--parts 2,4] [--codecs all] [--steps 100] [--repeats 1] [--mbps 5]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "benchmarks")]

import convergence as cv  # noqa: E402  (the study's model, corpus, batches and codec runs)

from fusion.cluster import load_cluster# noqa: E402
from fusion.compile import compile_model  # noqa: E402
from fusion.ir.errors import FusionError  # noqa: E402

log = logging.getLogger("stress_links")
CODECS = ("uniform", "adatopk", "adatopk+ef", "quant8", "quant4", "hquant4", "delta4")
LR = 3e-3


def tighten(cluster: dict, mbps: float, latency_ms: float) -> dict:
    """The cluster dict with every link between its two sites (the 20 Mbit/s / 30 ms ones) set to ``mbps`` / ``latency_ms``."""
    c = json.loads(json.dumps(cluster))
    bw, dl = c["bandwidth_bps"], c["delay_s"]
    slow = min(v for row in bw for v in row if v > 0)
    for i, row in enumerate(bw):
        for j, v in enumerate(row):
            if v == slow:
                bw[i][j], dl[i][j] = mbps * 1e6, latency_ms / 1e3
    return c


def edges(name: str, model, plan, ratio: float):
    """The compression of codec run ``name`` on ``plan``'s cut (as the convergence study builds it)."""
    if name == "adatopk":
        return list(plan.compression)
    if name == "adatopk+ef":
        return [dataclasses.replace(c, error_feedback=True) for c in plan.compression]
    if name == "uniform":
        return cv.uniform_edges(model, plan.assignment, ratio)
    return cv.codec_edges(model, plan.assignment, cv.CODEC_RUNS[name])


def two_sites(model, plan):
    """The 4-part plan merged into its two sites (part0+part1 -> part0, part2+part3 -> part1): every message crosses
    the slow link. Returns the plan and a function renaming a compression list's parts."""
    from fusion.executors.runtime.launcher import hand_plan

    merge = {p: f"part{i // 2}" for i, p in enumerate(sorted(plan.parts))}
    devices = {"part0": plan.parts["part0"].device, "part1": plan.parts["part2"].device}
    p2 = hand_plan(model, {n: merge[p] for n, p in plan.assignment.items()}, devices=devices, cluster=plan.cluster,
                   micro_batches=plan.micro_batches)

    def rename(comp):
        out = {}
        for c in comp:
            src, dst = merge[c.src], merge[c.dst]
            if src != dst:  # keeps the first rule of a tensor that now crosses once
                out.setdefault((c.producer, c.index, src, dst), dataclasses.replace(c, src=src, dst=dst))
        return list(out.values())

    return p2, rename


def one_run(model, plan, comp, batches, run_dir: Path, step_timeout_s: float, check: bool) -> dict:
    """Train ``plan`` with compression ``comp`` on emulated links; what happened."""
    from fusion.executors.runtime.coordinator import CoordinatorConfig
    from fusion.executors.runtime.launcher import LocalCluster
    from fusion.plan import OptimizerConfig, save_plan

    p = dataclasses.replace(plan, compression=list(comp), optimizer=OptimizerConfig("adamw", lr=LR).to_dict())
    plan_dir = save_plan(p, run_dir / "plan", params=model.params)
    losses, failure, rejected = [], None, 0
    t0 = time.perf_counter()
    cfg = CoordinatorConfig(emulate_links=True, peer_timeout_s=60, step_timeout_s=step_timeout_s)
    try:
        with LocalCluster(plan_dir, run_dir, cfg, threads=1, trace=False, verbose=0) as lc:
            lc.start()
            for batch in batches:
                rep = lc.coordinator.step(batch)
                losses.append(rep.loss)
                rejected = sum(int(st.get("rejected", 0)) for st in rep.parts.values())
    except FusionError as e:
        failure = str(e)[:500]
    out = {"steps": len(losses), "failure": failure, "rejected": rejected, "wall_s": round(time.perf_counter() - t0, 1)}
    if check and losses:
        ref, _, _ = cv.train(model, plan, comp, batches[:len(losses)], LR)
        out["max_loss_diff_vs_reference"] = float(np.abs(ref - np.array(losses)).max())
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--parts", default="2,4", help="2 (the two sites), 4 (the compiler's cut), or both")
    ap.add_argument("--codecs", default="all", help=f"comma-separated of {', '.join(CODECS)}, or all")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--mbps", type=float, default=5.0, help="bandwidth between the sites (Mbit/s)")
    ap.add_argument("--latency-ms", type=float, default=30.0, help="latency between the sites (ms)")
    ap.add_argument("--ratio", type=float, default=100.0, help="Top-K ratio (uniform; AdaTopK's compress_ratio)")
    ap.add_argument("--samples", type=int, default=64, help="a fixed dataset of this many windows (delta needs one)")
    ap.add_argument("--step-timeout", type=float, default=120.0, help="a step taking longer is a failure (a hang)")
    ap.add_argument("--check", action="store_true", help="compare each run's losses with the in-process reference")
    ap.add_argument("--work", type=Path, default=None, help="run directories (default: a temp dir)")
    args = ap.parse_args(argv)
    codecs = CODECS if args.codecs == "all" else tuple(args.codecs.split(","))
    unknown = sorted(set(codecs) - set(CODECS))
    if unknown:
        raise SystemExit(f"stress_links.py: unknown codecs {unknown} (known: {', '.join(CODECS)})")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    import torch

    torch.set_num_threads(1)
    model = cv.gpt(mb=8, seq=32)
    cluster = load_cluster(cv.CLUSTER)
    plan4 = compile_model(model, cluster, strategy="equal-flops", micro_batches=2, compress_ratio=args.ratio)
    plan4 = dataclasses.replace(plan4, cluster=tighten(plan4.cluster, args.mbps, args.latency_ms))
    plan2, rename = two_sites(model, plan4)
    tokens = cv.text_corpus()
    runs, t_all = [], time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="fusion-stress-") as tmp:
        work = args.work or Path(tmp)
        for rep in range(args.repeats):
            for parts in (int(p) for p in args.parts.split(",")):
                plan = plan4 if parts == 4 else plan2
                for codec in codecs:
                    comp = edges(codec, model, plan4, args.ratio)
                    comp = comp if parts == 4 else rename(comp)
                    batches = list(cv.gpt_batches(tokens, args.steps, 16, 32, 1 + rep, args.samples))
                    r = one_run(model, plan, comp, batches, work / f"{parts}-{codec}-{rep}", args.step_timeout,
                                args.check)
                    r.update(parts=parts, codec=codec, repeat=rep)
                    runs.append(r)
                    log.info("%d parts %-10s repeat %d: %d steps, %s, rejected %d, wall %.1f s%s", parts, codec, rep,
                             r["steps"], "FAILED: " + r["failure"] if r["failure"] else "ok", r["rejected"], r["wall_s"],
                             f", max loss diff vs reference {r['max_loss_diff_vs_reference']:.2e}"
                             if "max_loss_diff_vs_reference" in r else "")
    print(json.dumps({"benchmark": "stress_links", "runs": len(runs), "steps": sum(r["steps"] for r in runs),
                      "failures": sum(1 for r in runs if r["failure"]), "rejected": sum(r["rejected"] for r in runs),
                      "wall_s": round(time.perf_counter() - t_all, 1), "mbps": args.mbps, "latency_ms": args.latency_ms,
                      "per_run": runs}))


if __name__ == "__main__":
    main()
