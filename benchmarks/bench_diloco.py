"""DiLoCo measured: samples/s and DP bytes of two one-stage replicas, one per site of ``local-4-two-sites``.

Run:  OMP_NUM_THREADS=1 python benchmarks/bench_diloco.py [--steps 20] [--warmup 2] [--inner-steps 10] [--micro 4]
      [--outer-delay 0|1] [--cases 1x1,2x1_diloco,1x1_end]
      (from a checkout other than the installed one: PYTHONPATH=. in front)

The model is the tiny GPT of ``examples/models/gpt.py:tiny`` (micro-batches of 2 rows) as one stage. Every
run is real CompNode processes on loopback with ``--emulate-links`` (20 Mbit/s and 30 ms between the sites):

* ``1x1``: one replica on cpu-0 (site a), ``--micro`` micro-batches per step, measured first and again last
  (``1x1_end``); the ratios divide by the faster of the two (on a shared host the load changes);
* ``2x1_every``: a second replica on cpu-2 (site b), the same micro-batches per replica, gradients averaged
  every step across the slow link (synchronous DP);
* ``2x1_diloco``: the same grid with ``--dp-sync diloco --inner-steps H`` (exact pseudo-gradient average;
  ``--outer-delay 1``: the exchange overlaps the next H inner steps, for every DiLoCo case);
* ``2x1_diloco_q8``: the same with 8-bit pseudo-gradients and error feedback;
* ``2x1_diloco_f5``: exact, in 5 streaming fragments (``--sync-fragments 5``): the same bytes per H steps,
  a fifth of them at a time (``dp_peak_bytes``: the most one replica sent to the other in one step).

Two processes at most, so the 2 cores of the test host are not oversubscribed. samples/s = rows of all
measured steps / their summed iteration seconds (not a median: an outer step every H steps must count);
``--steps`` should be a multiple of H. DP bytes per step: bytes one replica sent to the other, per step.
Final JSON line: samples/s of each case, ``measured_2x1_over_1x1`` (DiLoCo, exact), the same for the other
two cases, and ``dp_bytes_ratio`` (synchronous DP's DP bytes per step over DiLoCo's, exact and 8-bit).

``--study convergence`` runs the convergence study instead (:mod:`diloco_study`: 4 replicas, synchronous DP
against DiLoCo at H = 20 and 50, optionally 8-bit pseudo-gradients, on the CPython-source corpus with a
held-out validation split, every seed reported); its final JSON line holds, for the first run (the first H,
or the first ``--variant``), ``steps_to_sync_loss_ratio`` (the median over the seeds),
``steps_to_sync_loss_ratio_max`` (the worst seed; null if any seed never reached synchronous DP's final loss) and
``steps_to_sync_loss_ratio_per_seed``; the same for every run under ``medians``; the settings and the host's
load average at the start and the end:

    OMP_NUM_THREADS=1 python benchmarks/bench_diloco.py --study convergence [--sync-steps 300]
        [--diloco-factor 3] [--min-rounds 50] [--seeds 0,1,2] [--h 10] [--quant8-h H] [--outer-lr 0.7]
        [--outer-momentum 0.6] [--outer-nesterov 1] [--diloco-lr LR] [--sync-warmup 150] [--jobs 2]
        [--overlap eager,delayed] [--variant NAME:h=20,outer_lr=1,outer_momentum=0.5,lr=1.5e-3,warmup=50 ...]

(``--diloco-lr``: the replicas' inner learning rate on their quarter of the batch, default 2e-3 for AdamW (tuned
on seeds 100-104; two thirds of ``--lr``, synchronous DP's) and ``--lr`` for Muon; ``--sync-warmup N``: DiLoCo's first N steps are synchronous DP, counted as steps, then DiLoCo from those
weights; ``--min-rounds``: DiLoCo runs at least that many outer rounds after the warm-up; ``--variant``,
repeatable: instead of the ``--h`` runs, DiLoCo runs with their own settings against the same synchronous DP.)

(``--overlap``: for every H also DiLoCo with the outer step overlapped, ``--outer-delay 1``, in the eager
variant, the naive delayed one or both, named ``diloco_h{H}_eager`` / ``_delayed``; docs/data-parallel.md.)

(docs/runtime.md "DiLoCo" gives the run measured there: ``--outer-momentum 0.5``, tuned on seed 0, ``--jobs 3``.)

``--study wan`` runs DiLoCo against synchronous DP over a real shaped 20 Mbit/s link instead (:mod:`diloco_wan`: two
network-namespace sites, one replica each, ``fusion executor`` / ``fusion coordinator`` processes as bench_wan.py
starts them; needs root, ``ip`` and ``tc``, else it says so and prints null figures); its final JSON line holds
``wall_to_sync_loss_ratio`` (DiLoCo's wall time to synchronous DP's final held-out loss over synchronous DP's wall
time, the median over the seeds, null if any seed misses; target <= 0.4), ``compute_utilisation`` (target >= 0.9),
per seed rows, the settings, the bytes between the sites per step and the load average at the start and the end:

    OMP_NUM_THREADS=1 python benchmarks/bench_diloco.py --study wan [--seeds 0,1,2] [--sync-steps 300]
        [--diloco-factor 3] [--h 20] [--outer-lr 1.0] [--outer-momentum 0] [--sync-warmup 10] [--outer-delay 1]
        [--sync-fragments 1] [--pseudo-codec sparseloco|quant:bits=8|none] [--warmup-codec quant:bits=4]
        [--sync-codec quant:bits=2] [--eval-every H] [--profile 20mbit] [--work DIR] [--quick]

``--study dpxpp`` runs issue 36's DP x PP row instead (:mod:`dpxpp_wan`: two sites of two network-namespace hosts
each; torch's ``torch.distributed.pipelining`` inside a site with DDP's gradient average across the sites, against
fusion's ``--strategy opfence --replicas 2 --compress auto`` plan with DiLoCo across them at the wan flags'
settings, run to torch's final held-out loss); its final JSON line holds ``wall_to_torch_loss_ratio`` (the median
over the seeds, null if any seed misses), ``steps_to_torch_loss_ratio``, fusion's ``compute_utilisation``, the
bytes between the sites per step of each side, per seed rows and the load average:

    OMP_NUM_THREADS=1 python benchmarks/bench_diloco.py --study dpxpp [--seeds 0,1,2] [--sync-steps 300]
        [--precision fp32|bf16] [--compress auto|none|CODEC] [the wan flags] [--work DIR] [--quick]

Not measured here: the planner's prediction on ``fusionllm-48``.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: --study wan: DiLoCo's synchronous warm-up steps and H, tuned on seeds 100-101 on a quiet host (warm-up 10 / 20 / 30
#: at H 10, then H 20: docs/data-parallel.md "Over a shaped link")
WAN_WARMUP = 10  # diloco_wan.WanStudy.sync_warmup (20 with an exact warm-up; 10 once it was 4-bit, seeds 100-101)
WAN_H = 20  # diloco_wan.WanStudy.h
#: --study wan, dpxpp: the warm-up's all-reduce in 4 bits (fusion compile --dp-codec) where there is a warm-up and a
#: pseudo-gradient codec: tuned on seeds 100-101 (DiLoCo to exact synchronous DP's loss in 0.107 / 0.096 of its wall
#: time with 10 such steps, 0.130 / 0.135 with 20 8-bit ones, 0.261 / 0.255 with 20 exact; docs/data-parallel.md)
WAN_WARMUP_CODEC = "quant:bits=4"
#: --study wan: the second synchronous baseline's all-reduce codec, the baseline's best on seeds 100-101 (2-bit
#: synchronous DP reached the exact run's loss in 4.5 / 2.3 s, 4-bit in 4.7 / 4.9 s, 8-bit in 8.8 / 7.5 s)
WAN_SYNC_CODEC = "quant:bits=2"
#: the outer step's settings of each study where the flags are not given: wan's were tuned on seeds 100-101 after
#: the runtime's per-step costs fell (SparseLoCo's own setting: chunk Top-k + 2-bit pseudo-gradients with error
#: feedback, no outer momentum, outer lr 1, the exchange overlapped with the next H inner steps; docs/data-parallel.md
#: "SparseLoCo on the shaped link"); the others keep the DiLoCo setting they were measured with
_DILOCO_OUTER = {"outer_lr": 0.7, "outer_momentum": 0.6, "outer_delay": 0, "pseudo_codec": "quant:bits=8"}
OUTER_DEFAULTS = {"wan": {"outer_lr": 1.0, "outer_momentum": 0.0, "outer_delay": 1, "pseudo_codec": "sparseloco"},
                  **dict.fromkeys(("dpxpp", "convergence", "throughput"), _DILOCO_OUTER)}
CLUSTER = ROOT / "examples" / "clusters" / "local-4-two-sites.yaml"
MODEL = f"{ROOT / 'examples' / 'models' / 'gpt.py'}:tiny"


def make_plan(grid: list[list[str]], micro: int, out: Path, sync=None) -> Path:
    from fusion.cluster import load_cluster
    from fusion.loader import load_model
    from fusion.plan import OptimizerConfig, save_plan
    from fusion.replicas import compile_replicated

    model = load_model(MODEL)
    cut = {n: 0 for n in model.graph.nodes}
    plan = compile_replicated(model, load_cluster(CLUSTER), cut, grid, micro_batches=micro,
                              global_batch=len(grid) * micro * 2, optimizer=OptimizerConfig("adamw", lr=1e-3))
    if sync is not None:
        plan.dp_sync = sync
        plan.check()
    return save_plan(plan, out, params=model.params)


def measure(plan_dir: Path, run_dir: Path, steps: int, warmup: int) -> dict:
    import numpy as np
    from local_runs import emulated_steps

    _, reports = emulated_steps(plan_dir, run_dir, steps, warmup)
    secs = sum(r.iteration_s for r in reports)
    rows = sum(r.samples for r in reports)
    per_step = [sum(s["sent"].get("r1.p0", s["sent"].get("r1.part0", {})).get("bytes", 0)
                    for p, s in r.parts.items() if p in ("p0", "part0")) for r in reports]
    outer = [r.iteration_s for r in reports if any("outer" in s for s in r.parts.values())]
    inner = [r.iteration_s for r in reports if not any("outer" in s for s in r.parts.values())]
    return {"parts": len(reports[0].parts), "rows_per_step": reports[0].samples, "samples_per_s": round(rows / secs, 3),
            # median seconds of a step that ends with an outer step and of one that does not (the exposed sync)
            "outer_step_s": round(float(np.median(outer)), 4) if outer else None,
            "inner_step_s": round(float(np.median(inner)), 4) if inner else None,
            "dp_bytes_per_step": round(sum(per_step) / len(reports), 1), "dp_peak_bytes": max(per_step),
            "losses": [round(r.loss, 4) for r in reports]}


def main(argv: list[str] | None = None) -> int:
    from fusion.plan import DPSync

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--inner-steps", type=int, default=10)
    ap.add_argument("--micro", type=int, default=4, help="micro-batches per replica")
    ap.add_argument("--study", choices=["throughput", "convergence", "wan", "dpxpp"], default="throughput",
                    help="throughput: the measured runs above (default); convergence: diloco_study.py's figure; "
                         "wan: diloco_wan.py's, over a real shaped link between two network-namespace sites; "
                         "dpxpp: dpxpp_wan.py's, 2 sites x 2 devices, fusion's plan against torch's pipelining + DDP "
                         "(the wan flags set fusion's DiLoCo; --sync-steps: torch's steps)")
    ap.add_argument("--sync-steps", type=int, default=None,
                    help="convergence, wan: synchronous DP's steps (default 300; wan --quick 10)")
    ap.add_argument("--diloco-factor", type=float, default=3.0,
                    help="convergence: DiLoCo's inner steps as a multiple of --sync-steps")
    ap.add_argument("--seeds", default="0,1,2", help="convergence: seeds (model init and data order)")
    ap.add_argument("--h", default=None,
                    help="convergence: the inner steps H of the DiLoCo runs (default 10, tuned on seeds 100-104); "
                         "wan: H (default %d, tuned on seeds 100-101)" % WAN_H)
    ap.add_argument("--quant8-h", type=int, default=0,
                    help="convergence: H of an 8-bit run with error feedback (0: none)")
    ap.add_argument("--lr", type=float, default=3e-3, help="convergence: the inner AdamW's learning rate")
    ap.add_argument("--inner", default="adamw", choices=("adamw", "muon"),
                    help="convergence: the optimizer of synchronous DP (the target) and of the replicas")
    ap.add_argument("--outer-lr", type=float, default=None,
                    help="convergence, wan, dpxpp: DiLoCo's outer learning rate (default: OUTER_DEFAULTS, 0.7; wan 1.0)")
    ap.add_argument("--outer-momentum", type=float, default=None,
                    help="convergence, wan, dpxpp: DiLoCo's outer momentum (default: OUTER_DEFAULTS, 0.6, tuned on "
                         "seeds 100-104; wan 0, SparseLoCo's)")
    ap.add_argument("--outer-nesterov", type=int, default=1, choices=(0, 1),
                    help="convergence: 1, Nesterov outer momentum; 0, heavy-ball")
    ap.add_argument("--diloco-lr", type=float, default=None,
                    help="convergence: the DiLoCo replicas' inner learning rate on their quarter batch (default: "
                         "AdamW 2e-3, tuned on seeds 100-104; Muon --lr)")
    ap.add_argument("--sync-warmup", type=int, default=None,
                    help="convergence, wan: DiLoCo's first N steps are synchronous DP, then DiLoCo from those weights "
                         "(convergence: default 150, tuned on seeds 100-104; wan: default %d)" % WAN_WARMUP)
    ap.add_argument("--min-rounds", type=int, default=50,
                    help="convergence: DiLoCo runs at least this many outer rounds after the warm-up")
    ap.add_argument("--variant", action="append", default=[], metavar="NAME:KEY=V,...",
                    help="convergence: a DiLoCo run with its own settings (repeatable; given, only the variants "
                         "run): keys h, outer_lr, outer_momentum, nesterov (0/1), lr (replicas' inner lr), "
                         "warmup, overlap (eager/delayed)")
    ap.add_argument("--jobs", type=int, default=2, help="convergence: seeds run at once, one process each")
    ap.add_argument("--overlap", default="", metavar="eager,delayed",
                    help="convergence: for every H also the overlapped outer step (dp_sync.delay 1) in these variants")
    ap.add_argument("--outer-delay", type=int, default=None, choices=(0, 1),
                    help="DiLoCo cases: 0, the outer exchange blocks (the default but for wan); 1, it overlaps the "
                         "next H inner steps (wan's default)")
    ap.add_argument("--sync-fragments", type=int, default=1, metavar="F",
                    help="wan: Streaming DiLoCo's fragments (fusion compile --sync-fragments; default 1)")
    ap.add_argument("--pseudo-codec", default=None, metavar="CODEC|none",
                    help="wan, dpxpp: DiLoCo's pseudo-gradient codec, with error feedback (default: wan sparseloco, "
                         "dpxpp quant:bits=8)")
    ap.add_argument("--warmup-codec", default=None, metavar="CODEC|none",
                    help="wan, dpxpp: the synchronous warm-up's all-reduce codec (fusion compile --dp-codec; default "
                         "%s where there is a warm-up and a pseudo-gradient codec, else none: exact)" % WAN_WARMUP_CODEC)
    ap.add_argument("--sync-codec", default=None, metavar="CODEC|none",
                    help="wan: a second synchronous baseline, synchronous DP with this all-reduce codec (its "
                         "--dp-codec), run to the exact one's final held-out loss (default %s; --quick and none: "
                         "only the exact one)" % WAN_SYNC_CODEC)
    ap.add_argument("--eval-every", type=int, default=None, help="wan: held-out loss every N steps (default H)")
    ap.add_argument("--eval-batches", type=int, default=None, help="wan: held-out batches per evaluation (default 4)")
    ap.add_argument("--profile", default="20mbit", help="wan: the network profile between the sites (20mbit, 5mbit)")
    ap.add_argument("--timeout", type=float, default=1800.0, help="wan: seconds one run may take")
    ap.add_argument("--steps-ahead", type=int, choices=[0, 1], default=1,
                    help="wan: the coordinators' --steps-ahead (default 1, as fusion's; 0: lock step)")
    ap.add_argument("--precision", choices=("fp32", "bf16"), default="fp32",
                    help="dpxpp: both sides' precision (bf16: torch under autocast sends bfloat16; default fp32)")
    ap.add_argument("--torch-dp-wire", choices=("fp32", "bf16"), default="bf16",
                    help="dpxpp: torch's gradient all-reduce across the sites (default bf16: DDP's bf16_compress_hook, "
                         "torch's best here, 1.8x faster at the same loss; fp32: DDP's default)")
    ap.add_argument("--compress", default="auto", metavar="auto|none|CODEC",
                    help="dpxpp: fusion's --compress on the pipeline's cut inside a site (default auto)")
    ap.add_argument("--work", type=Path, default=None, help="wan: keep plans, runs and logs here (default: a temp dir)")
    ap.add_argument("--quick", action="store_true",
                    help="wan: the tiny model, 10 synchronous steps, H 5, seed 0 only (the test's run)")
    ap.add_argument("--cases", default=None, metavar="A,B",
                    help="run only these cases (default all; measured_2x1_over_1x1 needs 1x1, 2x1_diloco, 1x1_end)")
    args = ap.parse_args(argv)
    for key, value in OUTER_DEFAULTS[args.study].items():  # the study's own where the flag is not given
        if getattr(args, key) is None:
            setattr(args, key, value)
    t0 = time.time()
    if args.study == "convergence":
        return convergence(args, t0)
    if args.study in ("wan", "dpxpp"):
        return wan(args)
    h = args.inner_steps
    two = [["cpu-0"], ["cpu-2"]]
    cases = {"1x1": ([["cpu-0"]], None), "2x1_every": (two, None),
             "2x1_diloco": (two, DPSync("diloco", inner_steps=h, delay=args.outer_delay)),
             "2x1_diloco_q8": (two, DPSync("diloco", inner_steps=h, codec={"algo": "quant", "bits": 8},
                                           error_feedback=True, delay=args.outer_delay)),
             "2x1_diloco_f5": (two, DPSync("diloco", inner_steps=h, fragments=min(5, h), delay=args.outer_delay)),
             "1x1_end": ([["cpu-0"]], None)}
    if args.cases:
        unknown = set(args.cases.split(",")) - set(cases)
        if unknown:
            ap.error(f"--cases: unknown {sorted(unknown)} (cases: {', '.join(cases)})")
        cases = {k: v for k, v in cases.items() if k in args.cases.split(",")}
    res = {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        for name, (grid, sync) in cases.items():
            plan = make_plan(grid, args.micro, tmp / f"{name}.plan", sync)
            res[name] = measure(plan, tmp / f"{name}.run", args.steps, args.warmup)
            print(f"{name}: {res[name]['parts']} CompNodes, {res[name]['rows_per_step']} rows/step, "
                  f"{res[name]['samples_per_s']:.1f} samples/s, {res[name]['dp_bytes_per_step']:.0f} DP bytes/step",
                  file=sys.stderr, flush=True)
    # the faster anchor: conservative
    anchor = max((res[k]["samples_per_s"] for k in ("1x1", "1x1_end") if k in res), default=None)
    every = res["2x1_every"]["dp_bytes_per_step"] if "2x1_every" in res else None

    def ratio(a, b, nd):  # None where a case was left out (--cases)
        return None if a is None or b is None else round(a / b, nd)

    sps = {k: v["samples_per_s"] for k, v in res.items()}
    dpb = {k: v["dp_bytes_per_step"] for k, v in res.items()}
    print(json.dumps({"bench": "diloco", "cluster": "local-4-two-sites", "emulate_links": True,
                      "model": "examples/models/gpt.py:tiny", "steps": args.steps, "inner_steps": h,
                      "outer_delay": args.outer_delay, "samples_per_s": sps, "dp_bytes_per_step": dpb,
                      "dp_peak_bytes": {k: v["dp_peak_bytes"] for k, v in res.items()},
                      "outer_step_s": {k: v["outer_step_s"] for k, v in res.items() if v["outer_step_s"] is not None},
                      "inner_step_s": {k: v["inner_step_s"] for k, v in res.items()},
                      "measured_2x1_over_1x1": ratio(sps.get("2x1_diloco"), anchor, 3),
                      "measured_2x1_q8_over_1x1": ratio(sps.get("2x1_diloco_q8"), anchor, 3),
                      "sync_2x1_over_1x1": ratio(sps.get("2x1_every"), anchor, 3),
                      "dp_bytes_ratio": ratio(every, dpb.get("2x1_diloco"), 2),
                      "dp_bytes_ratio_q8": ratio(every, dpb.get("2x1_diloco_q8"), 2),
                      "wall_s": round(time.time() - t0, 1)}))
    return 0


def convergence(args: argparse.Namespace, t0: float) -> int:
    """The convergence study (:mod:`diloco_study`); its final JSON line."""
    import logging

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from diloco_study import StudyConfig, study

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    import os

    load_start = os.getloadavg()
    args.sync_steps = args.sync_steps or 300
    args.h = args.h or "10"
    args.sync_warmup = 150 if args.sync_warmup is None else args.sync_warmup
    cfg = StudyConfig(steps=args.sync_steps, diloco_factor=args.diloco_factor, lr=args.lr, outer_lr=args.outer_lr,
                      outer_momentum=args.outer_momentum, diloco_lr=tuned_inner_lr(args), sync_warmup=args.sync_warmup,
                      min_rounds=args.min_rounds, outer_nesterov=bool(args.outer_nesterov), inner=args.inner)
    seeds = [int(s) for s in args.seeds.split(",")]
    try:
        variants = dict(parse_variant(v, cfg) for v in args.variant)
    except ValueError as e:
        print(f"bench_diloco.py: --variant: {e}", file=sys.stderr)
        return 2
    hs = [] if variants else [int(h) for h in args.h.split(",")]
    if (hs and min(hs) < 1) or args.sync_steps < 1 or len(seeds) < 1 or args.sync_warmup < 0:
        print("bench_diloco.py: --h, --sync-steps and --seeds need values >= 1", file=sys.stderr)
        return 2
    overlaps = [o for o in args.overlap.split(",") if o]
    if any(o not in ("eager", "delayed") for o in overlaps):
        print(f"bench_diloco.py: --overlap {args.overlap}: expected eager, delayed or both, comma-separated",
              file=sys.stderr)
        return 2
    res = (study(cfg, seeds, [], None, args.jobs, (), variants) if variants
           else study(cfg, seeds, hs, args.quant8_h or None, args.jobs, overlaps))
    runs = {name: {"h": v.sync.inner_steps, "outer_lr": v.sync.outer_lr, "outer_momentum": v.sync.outer_momentum,
                   "nesterov": v.sync.nesterov, "delay": v.sync.delay, "overlap": v.sync.overlap,
                   "codec": v.sync.codec, "error_feedback": v.sync.error_feedback, "inner": v.inner or cfg.inner,
                   "inner_lr": cfg.diloco_lr or cfg.lr if v.lr is None else v.lr,
                   "sync_warmup": cfg.sync_warmup if v.warmup is None else v.warmup}
            for name, v in variants.items()}
    print(json.dumps({"bench": "diloco", "study": "convergence", "corpus": "CPython stdlib source (convergence.py)",
                      "replicas": cfg.replicas, "global_batch": cfg.global_batch, "seq": cfg.seq,
                      "inner": {"optimizer": cfg.inner, "lr": cfg.lr, "diloco_lr": cfg.diloco_lr or cfg.lr},
                      "outer": {"optimizer": "nesterov-sgd" if args.outer_nesterov else "heavy-ball-sgd",
                                "lr": cfg.outer_lr, "momentum": cfg.outer_momentum},
                      "h": hs, "sync_warmup": cfg.sync_warmup, "min_rounds": cfg.min_rounds, "variants": runs,
                      "sync_steps": cfg.steps, "diloco_steps_factor": cfg.diloco_factor, "seeds": seeds,
                      "jobs": args.jobs, "loadavg_start": [round(x, 2) for x in load_start],
                      "loadavg_end": [round(x, 2) for x in os.getloadavg()],
                      **res, "wall_s": round(time.time() - t0, 1)}))
    return 0


def wan(args: argparse.Namespace) -> int:
    """The study over a real shaped link (:mod:`diloco_wan`, or :mod:`dpxpp_wan` for ``--study dpxpp``); its final
    JSON line."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    if args.study == "dpxpp":
        from functools import partial

        from dpxpp_wan import DpPpStudy, study_main
        WanStudy = partial(DpPpStudy, precision=args.precision, compress=args.compress,
                           torch_dp_wire=args.torch_dp_wire)
    else:
        from diloco_wan import WanStudy, study_main

    quick = args.quick
    try:
        h = int(args.h) if args.h else (5 if quick else WAN_H)
    except ValueError:
        print(f"bench_diloco.py: --study {args.study}: --h {args.h}: one integer", file=sys.stderr)
        return 2
    warmup = (0 if quick else WAN_WARMUP) if args.sync_warmup is None else args.sync_warmup
    pseudo = None if args.pseudo_codec == "none" else args.pseudo_codec
    warmup_codec = (WAN_WARMUP_CODEC if warmup and pseudo else None) if args.warmup_codec is None else (
        None if args.warmup_codec == "none" else args.warmup_codec)
    sync_codec = ((None if quick or args.study == "dpxpp" else WAN_SYNC_CODEC) if args.sync_codec is None
                  else None if args.sync_codec == "none" else args.sync_codec)
    study = WanStudy(model="tiny" if quick else "small", sync_steps=args.sync_steps or (10 if quick else 300),
                     cap_factor=args.diloco_factor, h=h, outer_lr=args.outer_lr, outer_momentum=args.outer_momentum,
                     sync_warmup=warmup,
                     nesterov=bool(args.outer_nesterov), outer_delay=args.outer_delay,
                     fragments=args.sync_fragments,
                     pseudo_codec=pseudo, warmup_codec=warmup_codec, sync_codec=sync_codec,
                     eval_every=args.eval_every or h, eval_batches=args.eval_batches or (2 if quick else 4),
                     profile=args.profile, timeout=args.timeout, steps_ahead=args.steps_ahead)
    seeds = [int(s) for s in args.seeds.split(",")]
    return study_main(study, seeds[:1] if quick else seeds, args.work)


#: a --variant's keys: its DiLoCo settings, then its pseudo-gradient codec's (codec=NAME and that codec's cfg keys;
#: ef=1: error feedback for a codec that does not turn it on itself)
KEYS = ("h", "outer_lr", "outer_momentum", "nesterov", "lr", "warmup", "overlap", "inner")
CODEC_KEYS = ("codec", "chunk", "k", "beta", "bits", "ratio", "ef")


#: the replicas' inner AdamW lr the study's tuning chose (seeds 100-104, docs/data-parallel.md)
TUNED_ADAMW_INNER_LR = 2e-3


def tuned_inner_lr(args) -> float | None:
    """``--diloco-lr``, else the tuned AdamW inner lr; Muon keeps ``--lr`` (None), the setting it was measured at."""
    if args.diloco_lr is not None:
        return args.diloco_lr
    return TUNED_ADAMW_INNER_LR if args.inner == "adamw" else None


def parse_variant(spec: str, cfg):
    """``NAME:KEY=V,...`` -> (NAME, diloco_study.Variant); unset keys take the study's settings."""
    from diloco_study import Variant
    from fusion.commands.compile import codec_outer
    from fusion.kernels.codecs import CODECS, Role
    from fusion.ir.errors import FusionError
    from fusion.plan import DPSync

    name, _, rest = spec.partition(":")
    if not name or not rest:
        raise ValueError(f"{spec!r}: expected NAME:KEY=V,...")
    kv = {}
    for item in rest.split(","):
        k, eq, v = item.partition("=")
        if not eq or k not in KEYS + CODEC_KEYS:
            raise ValueError(f"{spec!r}: {item!r} (keys: {', '.join(KEYS + CODEC_KEYS)})")
        kv[k] = v
    if "h" not in kv:
        raise ValueError(f"{spec!r}: h=H is required")
    overlap = kv.get("overlap")
    if overlap not in (None, "eager", "delayed"):
        raise ValueError(f"{spec!r}: overlap={overlap} (eager or delayed)")
    codec = None
    if "codec" in kv:  # the pseudo-gradient codec, its cfg from the numeric keys given
        codec = {"algo": kv["codec"], **{k: (float(v) if k in ("beta", "ratio") else int(v)) for k, v in kv.items()
                                         if k in CODEC_KEYS[1:-1]}}
        try:
            CODECS.check_role(codec, Role.PSEUDO_GRADIENT, f"codec={kv['codec']}")
        except FusionError as e:
            raise ValueError(str(e)) from None
    elif any(k in kv for k in CODEC_KEYS):
        raise ValueError(f"{spec!r}: {', '.join(CODEC_KEYS[1:])} need codec=NAME")
    sync = DPSync("diloco", inner_steps=int(kv["h"]), outer_lr=float(kv.get("outer_lr", cfg.outer_lr)),
                  outer_momentum=float(kv.get("outer_momentum", cfg.outer_momentum)),
                  nesterov=bool(int(kv.get("nesterov", int(cfg.outer_nesterov)))), codec=codec,
                  error_feedback=codec is not None and bool(int(kv.get("ef", 0))),
                  **({"delay": 1, "overlap": overlap} if overlap else {}))
    # the codec's own outer step (SparseLoCo: error feedback, no outer momentum unless outer_momentum= is given)
    sync = codec_outer(sync, "outer_momentum" in kv)
    if kv.get("inner") not in (None, "adamw", "muon", "sgd"):
        raise ValueError(f"{spec!r}: inner={kv['inner']} (adamw, muon or sgd)")
    return name, Variant(sync, lr=float(kv["lr"]) if "lr" in kv else None, inner=kv.get("inner"),
                         warmup=int(kv["warmup"]) if "warmup" in kv else None)


if __name__ == "__main__":
    raise SystemExit(main())
