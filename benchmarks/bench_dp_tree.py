"""Measured ring vs tree all-reduce: samples/s of 4 replicas x 1 stage with each, on two emulated clusters.

Run:  OMP_NUM_THREADS=1 python benchmarks/bench_dp_tree.py [--steps 6] [--warmup 2]
      (from a checkout other than the installed one: PYTHONPATH=. in front)

The model is the tiny GPT of ``examples/models/gpt.py:tiny`` (one stage, 1 micro-batch of 2 rows per replica),
run as 4 real CompNode processes on loopback with ``--emulate-links`` (every message, all-reduce chunks
included, delayed and rate-limited by the cluster's alpha/beta):

* ``far``: 4 devices, every link 40 ms and 1 Gbit/s (latency dominates the all-reduce of ~0.1 MB);
* ``two-sites``: ``examples/clusters/local-4-two-sites.yaml`` (20 Mbit/s / 30 ms between the sites,
  1 Gbit/s / 1 ms inside; bandwidth dominates).

For each cluster the anchor is the ring (``Plan.dp_algo`` empty), measured in the same run; the tree is the
same plan with ``dp_algo = {"part0": "tree"}``. samples/s = rows per step / median iteration seconds over
``--steps`` steps after ``--warmup``. The estimator's prices (``fusion.cost.dp``) and ``auto``'s choice are
printed next to them. Final JSON line: samples/s, ``tree_over_ring`` per cluster, and the predicted times.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from bench_dp_measured import measure  # median step time of a plan with emulated links (same folder)

ROOT = Path(__file__).resolve().parents[1]
MODEL = f"{ROOT / 'examples' / 'models' / 'gpt.py'}:tiny"
FAR = """name: far-4
devices:
""" + "".join(f"  - {{name: cpu-{i}, peak_flops: 50 GFLOPS, memory: 4 GB}}\n" for i in range(4)) + """links:
  default: {latency: 40 ms, bandwidth: 1 Gbit/s}
"""


def make_plan(cluster_file: Path, algo: str, out: Path) -> tuple[Path, dict]:
    from fusion.cluster import load_cluster
    from fusion.commands.compile import set_dp_allreduce
    from fusion.loader import load_model
    from fusion.plan import OptimizerConfig, save_plan
    from fusion.replicas import compile_replicated

    model = load_model(MODEL)
    cluster = load_cluster(cluster_file)
    cut = {n: 0 for n in model.graph.nodes}
    plan = compile_replicated(model, cluster, cut, [[f"cpu-{r}"] for r in range(4)], micro_batches=1,
                              global_batch=8, optimizer=OptimizerConfig("sgd", lr=0.01))
    set_dp_allreduce(plan, cluster, "auto")  # records both prices and auto's choice ...
    priced = dict(plan.predicted["dp_allreduce"]["part0"])
    plan.dp_algo = {"part0": algo} if algo == "tree" else {}  # ... then runs the algorithm asked for
    return save_plan(plan, out, params=model.params), priced


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    args = ap.parse_args(argv)
    t0 = time.time()
    out: dict = {"bench": "dp_tree", "model": "examples/models/gpt.py:tiny", "grid": "4x1", "emulate_links": True,
                 "steps": args.steps, "samples_per_s": {}, "tree_over_ring": {}, "predicted": {}}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        (tmp / "far.yaml").write_text(FAR)
        clusters = {"far": tmp / "far.yaml", "two-sites": ROOT / "examples" / "clusters" / "local-4-two-sites.yaml"}
        for cname, cfile in clusters.items():
            res = {}
            for algo in ("ring", "tree"):
                plan, priced = make_plan(cfile, algo, tmp / f"{cname}-{algo}.plan")
                res[algo] = measure(plan, tmp / f"{cname}-{algo}.run", args.steps, args.warmup)
                print(f"{cname} {algo}: {res[algo]['iteration_s']:.4f} s/iteration, "
                      f"{res[algo]['samples_per_s']:.1f} samples/s", file=sys.stderr, flush=True)
            out["samples_per_s"][cname] = {a: r["samples_per_s"] for a, r in res.items()}
            out["tree_over_ring"][cname] = round(res["tree"]["samples_per_s"] / res["ring"]["samples_per_s"], 3)
            out["predicted"][cname] = {"ring_s": round(priced["ring_s"], 5), "tree_s": round(priced["tree_s"], 5),
                                       "auto": priced["algo"], "grad_bytes": priced["grad_bytes"]}
    out["wall_s"] = round(time.time() - t0, 1)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
