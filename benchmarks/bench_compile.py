"""Compile a GPT-2 XL-sized graph with OP-Fence and with the paper's two baselines.

GPT-2 XL shape (48 layers, width 1600, 25 heads, vocab 50257, one 1024-token
sequence per micro-batch, tied LM head), built on the meta device (no weights),
4 micro-batches, GPipe, AdamW, fp32, no compression. For fusionllm-48 and
dtfm-5-worldwide (shipped scenarios) it prints the predicted iteration time
of each strategy and the ratio baseline / OP-Fence (the anchor is OP-Fence's
own prediction in this run), then times ``compile_model`` end to end (cost
measurement, Louvain, OP-Fence, plan assembly) on 64 devices (dtfm-5) and on
a 1024-device synthetic cluster.

Final line: JSON with ``opfence_vs_equal_flops``, ``opfence_vs_equal_count``
(fusionllm-48), ``compile_s_64``, ``compile_s_1024`` and more.
Targets: >= 1.45 against equal-flops on fusionllm-48 (the paper's lowest
reported speedup), compile < 10 s at 64 devices and < 60 s at 1024.

Run: python benchmarks/bench_compile.py
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from fusion.compile import compile_model
from fusion.plan import OptimizerConfig
from fusion.cluster.scenarios import load_scenario, synthetic_cluster
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout root: tests/ holds the op-node GPT
from tests.testing_models import gpt_model  # noqa: E402

KW = dict(micro_batches=4, schedule="gpipe", optimizer=OptimizerConfig("adamw", lr=1e-4))


def compare(model, cluster) -> dict[str, float]:
    out = {}
    for s in ("opfence", "equal-flops", "equal-count"):
        plan = compile_model(model, cluster, strategy=s, **KW)
        p = plan.predicted
        out[s] = p["iteration_s"]
        print(f"  {cluster.name:18s} {s:12s} predicted {p['iteration_s']:9.4f} s/iter (pipeline {p['pipeline_s']:.4f} + "
              f"tied sync {p['sync_s']:.4f}) on {len(plan.parts):3d} of {len(cluster)} devices "
              f"[{', '.join(sorted({pt.device for pt in plan.parts.values()}))[:60]}]")
    return out


def timed_compile(model, cluster) -> float:
    t = time.perf_counter()
    plan = compile_model(model, cluster, **KW)
    el = time.perf_counter() - t
    print(f"  compile {cluster.name}: {el:.2f} s ({len(plan.parts)} parts, partitioner {plan.predicted['partitioner']['seconds']:.2f} s)")
    return el


def main() -> int:
    t = time.perf_counter()
    model = gpt_model(48, 1600, 25, 50257, 1024, 1, tied=True, device="meta")
    n_params = sum(p.nbytes for p in model.graph.params.values()) / 4
    print(f"GPT-2 XL graph: {len(model.graph)} nodes, {n_params / 1e9:.3f} B parameters, built on meta in "
          f"{time.perf_counter() - t:.2f} s; 4 micro-batches of 1 x 1024 tokens, GPipe, AdamW, fp32")
    result: dict[str, float | bool] = {}
    for name, prefix in (("fusionllm-48", ""), ("dtfm-5-worldwide", "dtfm5_")):
        r = compare(model, load_scenario(name))
        result[prefix + "opfence_vs_equal_flops"] = round(r["equal-flops"] / r["opfence"], 3)
        result[prefix + "opfence_vs_equal_count"] = round(r["equal-count"] / r["opfence"], 3)
        result[prefix + "opfence_iteration_s"] = round(r["opfence"], 4)
    untied = gpt_model(48, 1600, 25, 50257, 1024, 1, tied=False, device="meta")
    print("untied LM head (no tied-gradient sync):")
    r = compare(untied, load_scenario("fusionllm-48"))
    result["untied_opfence_vs_equal_flops"] = round(r["equal-flops"] / r["opfence"], 3)
    result["untied_opfence_vs_equal_count"] = round(r["equal-count"] / r["opfence"], 3)
    print("compile time:")
    result["compile_s_64"] = round(timed_compile(model, load_scenario("dtfm-5-worldwide")), 2)
    result["compile_s_1024"] = round(timed_compile(model, synthetic_cluster(1024, site_size=8, seed=0)), 2)
    result["targets_met"] = bool(result["opfence_vs_equal_flops"] >= 1.45 and result["compile_s_64"] < 10
                                 and result["compile_s_1024"] < 60)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
