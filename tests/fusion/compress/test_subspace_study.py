"""benchmarks/subspace_study.py --quick (issue 35): the study's machinery end to end on a tiny GPT, in process.

A 3-step run's losses mean nothing; what is checked is what the figures are made of: the compiler cut the model
on the stream, each subspace run's measured bytes are exactly k coordinates each way plus the int64 ids forward
per token (dense: d each way), the receiver's rebuild stayed within 1e-5 every step, and the final JSON line
carries the issue's fields with every seed's figures.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))
import subspace_study as ss  # noqa: E402


def test_quick_study_writes_the_issue_fields(capsys):
    res = ss.main(["--quick", "--runs", "sub/6,sub/16,sub/16+q8,bottleneck"])
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert json.loads(last) == json.loads(json.dumps(res))  # the final line is the JSON summary
    for key in ("cut_reconstruction_max_rel_err", "headline_setting", "medians", "per_seed", "targets"):
        assert key in res, key
    assert res["cut_reconstruction_max_rel_err"] <= ss.REBUILD_TOL
    d = ss.QUICK.d_model
    seed = res["per_seed"]["0"]
    for run, div in (("sub/6", 6), ("sub/16", 16)):
        k = d // div
        assert seed[run]["k"] == k and seed[run]["cuts"]
        # per token: d fp32 numbers each way dense; k each way + one int64 id forward with the subspace
        assert seed[run]["wire_reduction"] == round(2 * d * 4 / (2 * k * 4 + 8), 2)
    assert seed["sub/16+q8"]["wire_reduction"] > 2 * seed["sub/16"]["wire_reduction"]  # 8-bit coordinates
    assert seed["bottleneck"]["wire_reduction"] == ss.BOTTLENECK_DIVISOR
    assert [s for s, _ in seed["dense"]["val_curve"]] == [1, 2, 3]
    for run in ("sub/6", "sub/16", "sub/16+q8", "bottleneck"):  # the others train steps_factor x dense's steps
        assert [s for s, _ in seed[run]["val_curve"]] == [1, 2, 3, 4, 5, 6]
        assert seed[run]["val_gap"] == round(seed[run]["val_at_dense_steps"] - seed["dense"]["final_val"], 4)
