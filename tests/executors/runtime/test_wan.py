"""``benchmarks/bench_wan.py --quick``: torch.distributed.pipelining, fusion dense and fusion auto over real shaped
namespaces (one profile, one seed, the tiny GPT, 6 steps).

Checks that the final JSON carries every figure, finite, and that the torch side and fusion dense start from the same
loss (same init from the seed, same first batch: what makes the comparison one of systems, not of models).
Skipped where namespaces cannot be made (not root, no ``ip``/``tc``), as ``test_netns.py``, and where the torch
side (``benchmarks/wan_torch.py``, ``wan_model.py``) is absent.
"""
import json
import math
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[3] / "benchmarks"
sys.path.insert(0, str(BENCH))
from netns_sites import namespaces_available  # noqa: E402


@pytest.mark.timeout(600)  # 7 processes start one after another: ~1 min on a quiet host, several under heavy load
def test_bench_wan_quick(tmp_path, capsys):
    reason = namespaces_available()
    if reason:
        pytest.skip(reason)
    if not (BENCH / "wan_torch.py").exists() or not (BENCH / "wan_model.py").exists():
        pytest.skip("benchmarks/wan_torch.py / wan_model.py (the torch side, helper wantorch's) are absent")
    import bench_wan

    assert bench_wan.main(["--quick", "--work", str(tmp_path)]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    # the headline first (issue 36): time to torch's final held-out loss, then samples/s
    assert list(out)[1:3] == ["time_to_torch_final_val_loss_ratio", "time_to_torch_final_val_loss_ratio_5mbit"]
    assert out["cap_steps"] == 2 * out["steps"]
    for key in ("fusion_auto_vs_torch_samples_per_s", "fusion_dense_vs_torch_samples_per_s"):
        assert out[key] is not None and math.isfinite(out[key]) and out[key] > 0, (key, out)
    assert out["fusion_auto_vs_torch_samples_per_s_5mbit"] is None  # --quick: the first profile only
    assert set(out["predicted_over_measured"]) == {"20mbit/fusion_dense", "20mbit/fusion_auto"}
    assert all(math.isfinite(v) and v > 0 for v in out["predicted_over_measured"].values()), out
    assert out["latency"] and out["seeds"] == [0] and out["stages"] == 2
    (row,) = out["per_seed"]["20mbit"]
    ratio = row["time_to_torch_final_val_loss_ratio"]
    assert ratio is None and row["auto_val_gap"] > 0 or math.isfinite(ratio)
    for side in ("torch", "fusion_dense", "fusion_auto"):
        assert math.isfinite(row["final_val"][side]) and row["samples_per_s"][side] > 0
    assert 0 < row["fusion_auto_steps"] <= out["cap_steps"]
    if row["auto_compression"]:  # the codecs' CPU time over the link time they save, both measured per step
        assert row["codec_cpu_s_per_step"] > 0 and row["link_saved_s_per_step"] > 0
        assert row["codec_cpu_over_link_saved"] == pytest.approx(
            row["codec_cpu_s_per_step"] / row["link_saved_s_per_step"], rel=1e-3)
    first = row["first_loss"]
    assert first["fusion_dense"] == pytest.approx(first["torch"], rel=1e-4, abs=1e-4), first
