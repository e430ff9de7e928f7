"""benchmarks/bottleneck_study.py --quick (issue 27): the study's machinery end to end on a tiny GPT, in process.

The figures of a 4-step run mean nothing for convergence; what is checked is what they are made of: the compiler
cut the model between its blocks (only the residual stream crosses), so the bottleneck's measured wire reduction is
exactly the width over the rank, the codec on the code shrinks it further, and the final JSON line carries the
issue's three fields with every seed's figures.
"""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))
import bottleneck_study as bs  # noqa: E402


def test_quick_study_writes_the_issue_fields(capsys):
    res = bs.main(["--quick"])
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert json.loads(last) == json.loads(json.dumps(res))  # the final line is the JSON summary
    cfg = bs.QUICK
    for key in ("bottleneck_wire_reduction", "bottleneck_val_loss_gap", "time_to_dense_val_loss_ratio",
                "per_seed_figures", "unigram_val_loss", "dense_left_plateau", "per_seed", "medians"):
        assert key in res, key
    assert res["clock"].startswith("simulated")
    assert 3.0 < res["unigram_val_loss"] < 3.3  # the corpus's plateau (~3.16 nats)
    seed = res["per_seed"]["0"]
    # one bottleneck, on the residual stream between the blocks, and nothing else crossing the cut
    assert seed["bottlenecks"] == [{"edge": seed["bottlenecks"][0]["edge"], "src": "part0", "dsts": ["part1"],
                                    "width": cfg.d_model, "rank": cfg.rank}]
    assert res["bottleneck_wire_reduction"] == cfg.d_model / cfg.rank
    assert res["per_seed_figures"]["0"]["wire_reduction"] == res["bottleneck_wire_reduction"]
    assert seed["bottleneck+quant4"]["wire_reduction"] > 4 * res["bottleneck_wire_reduction"]
    assert 4 < seed["quant4"]["wire_reduction"] < 8  # 4 bits plus the block scales
    for run in bs.RUNS:
        if run in seed:
            r = seed[run]
            assert [s for s, _ in r["val_curve"]] == [2, 4] and all(math.isfinite(v) for _, v in r["val_curve"])
            assert r["final_val"] == r["val_curve"][-1][1] and r["sim_s"] > r["comm_s"] > 0
    gap = seed["bottleneck"]["final_val"] - seed["dense"]["final_val"]
    assert abs(res["bottleneck_val_loss_gap"] - gap) < 1e-3
    t = res["time_to_dense_val_loss_ratio"]
    assert t is None or 0 < t <= 1.5
    # the bottleneck's messages are smaller: less link time per step than dense's
    assert seed["bottleneck"]["comm_s"] < seed["dense"]["comm_s"]
