"""Which architecture ``fusion compile --compress auto --allow-architecture-change`` picks, and the predicted step
time of every candidate (issue 35, :mod:`fusion.passes.architecture`), for the tiny GPT and the subspace study's
GPT (d = 256) on a few clusters. Predicted by the estimator only (nothing is trained); one JSON line per
(model, cluster) and a markdown table at the end (docs/compression.md, "Subspace or bottleneck, chosen by
--compress auto").

    python benchmarks/architecture_auto.py [--models tiny,study] [--clusters NAME,...]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
sys.path.insert(0, str(REPO / "examples" / "models"))

from fusion.cluster import load_cluster  # noqa: E402
from fusion.compile import CompileError, compile_model  # noqa: E402
from fusion.compress.policy import request  # noqa: E402
from fusion.passes.architecture import ArchitectureRequest  # noqa: E402


def two_devices(mbit: float, ms: float, mb: float) -> str:
    """Two CPU devices of ``mb`` MB in two sites joined by ``mbit`` Mbit/s, ``ms`` ms (the subspace study's)."""
    return (f"name: two-sites-{mbit:g}mbit\ndevices:\n"
            f"  - {{name: cpu-0, group: site-a, peak_flops: 50 GFLOPS, memory: {mb:g} MB}}\n"
            f"  - {{name: cpu-1, group: site-b, peak_flops: 50 GFLOPS, memory: {mb:g} MB}}\n"
            f"links:\n  default: {{latency: {ms:g} ms, bandwidth: {mbit:g} Mbit/s}}\n")


#: cluster name -> (yaml text or a shipped file, what it is)
CLUSTERS = {
    "local-4-two-sites": ((REPO / "examples/clusters/local-4-two-sites.yaml").read_text(),
                          "4 x 50 GFLOP/s, 4 GB; 20 Mbit/s 30 ms between sites"),
    "5mbit-16MB": (two_devices(5, 80, 16), "2 x 50 GFLOP/s, 16 MB; 5 Mbit/s 80 ms (the subspace study's)"),
    "5mbit-0.25MB": (two_devices(5, 80, 0.25), "2 x 50 GFLOP/s, 0.25 MB (the tiny GPT must be cut); 5 Mbit/s 80 ms"),
    "1gbit-16MB": (two_devices(1000, 1, 16), "2 x 50 GFLOP/s, 16 MB; 1 Gbit/s 1 ms"),
}


def model_of(name: str):
    """(traced model, micro-batches): the tiny GPT of examples/models/gpt.py, or the subspace study's GPT."""
    from fusion.ir.trace import trace

    if name == "tiny":
        import gpt

        module, example = gpt.tiny()
        return trace(module, example), 4
    from subspace_study import StudyConfig

    from bottleneck_study import traced_gpt

    cfg = StudyConfig()
    return traced_gpt(cfg, 0), cfg.micro_batches


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="tiny,study")
    ap.add_argument("--clusters", default=",".join(CLUSTERS))
    args = ap.parse_args(argv)
    load = os.getloadavg()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for mname in args.models.split(","):
            model, micro = model_of(mname)
            for cname in args.clusters.split(","):
                path = Path(tmp) / f"{cname}.yaml"
                path.write_text(CLUSTERS[cname][0])
                t0 = time.perf_counter()
                try:
                    plan = compile_model(model, load_cluster(str(path)), strategy="opfence", micro_batches=micro,
                                         compress=request("auto"), architecture=ArchitectureRequest())
                except CompileError as e:  # the model does not fit this cluster at all
                    print(json.dumps({"model": mname, "cluster": cname, "error": str(e)[:160]}), flush=True)
                    continue
                info = plan.predicted["architecture"]
                row = {"model": mname, "cluster": cname, "chosen": info["chosen"],
                       "candidates": {c["name"]: c["iteration_s"] for c in info["candidates"]},
                       "notes": {c["name"]: c["note"] for c in info["candidates"]},
                       "compile_s": round(time.perf_counter() - t0, 2)}
                rows.append(row)
                print(json.dumps(row), flush=True)
    names = list(dict.fromkeys(n for r in rows for n in r["candidates"]))
    print(f"\nload average at the start {load[0]:.1f}, at the end {os.getloadavg()[0]:.1f}")
    print("| model | cluster | " + " | ".join(names) + " | chosen | compile s |")
    print("|---|---|" + "---|" * len(names) + "---|---|")
    for r in rows:
        cells = []
        for n in names:
            t = r["candidates"].get(n, "")
            cells.append("—" if t is None else (f"{t:.4g}" if t != "" else ""))
        print(f"| {r['model']} | {r['cluster']} | " + " | ".join(cells) + f" | {r['chosen']} | {r['compile_s']} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
