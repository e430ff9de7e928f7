"""``benchmarks/bench_diloco.py --study wan --quick`` (issue 34): synchronous DP, then DiLoCo to its final held-out
loss, two replicas in two network-namespace sites over a tc-shaped 20 Mbit/s link (the tiny GPT, 10 synchronous
steps, H = 5, seed 0).

Checks the final JSON's figures (finite where they must be, null only where the definition says so), that both
runs start from the same loss (same init from the seed, same first batch: the comparison is of the sync methods,
not of models), that DiLoCo sends fewer bytes between the sites per step than synchronous DP, and the definition
of ``compute_utilisation`` on hand-written metrics lines. The network part is skipped where namespaces cannot be
made (not root, no ``ip``/``tc``), as ``tests/executors/runtime/test_wan.py``.
"""
import json
import math
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))
from netns_sites import namespaces_available  # noqa: E402


def _step(step, time, iteration_s, parts):
    return {"step": step, "loss": 1.0, "iteration_s": iteration_s, "time": time,
            "parts": {p: {"forward_s": f, "backward_s": b, "optimizer_s": o, "idle_s": 0.0} for p, (f, b, o) in parts.items()}}


def test_compute_utilisation_is_compute_over_replicas_times_training_wall():
    from diloco_wan import compute_utilisation

    lines = [_step(0, 11.0, 1.0, {"a": (0.2, 0.4, 0.1), "b": (0.3, 0.3, 0.1)}),   # starts at 10.0
             _step(1, 12.0, 1.0, {"a": (0.2, 0.4, 0.1), "b": (0.1, 0.1, 0.0)}),
             {"step": 1, "val_loss": 3.0, "time": 15.0},                          # 3 s of evaluation, not counted
             _step(2, 16.0, 1.0, {"a": (0.3, 0.5, 0.2), "b": (0.5, 0.4, 0.1)})]
    # compute 0.7 + 0.7 + 0.7 + 0.2 + 1.0 + 1.0 = 4.3 s; wall 16 - 10 - 3 = 3 s, times 2 replicas
    assert compute_utilisation(lines) == pytest.approx(4.3 / 6.0, rel=1e-12)
    # from step 2 on (after a warm-up of 2): its own start 15.0, no evaluation after it
    assert compute_utilisation(lines, first_step=2) == pytest.approx(2.0 / 2.0, rel=1e-12)
    with pytest.raises(ValueError, match="no step line at or after step 3"):
        compute_utilisation(lines, first_step=3)


def test_bad_settings_exit_2_with_one_line(capsys):
    import bench_diloco

    for argv, words in ((["--pseudo-codec", "nosuchcodec"], "nosuchcodec"),
                        (["--sync-warmup", "900"], "--sync-warmup 900"), (["--h", "x"], "--h x"),
                        (["--profile", "9mbit"], "--profile 9mbit"),
                        (["--sync-codec", "nosuchcodec"], "nosuchcodec"),
                        (["--warmup-codec", "quant:bits=8", "--pseudo-codec", "none"], "needs --sync-warmup N > 0 and"),
                        (["--warmup-codec", "quant:bits=8", "--sync-warmup", "0"], "needs --sync-warmup N > 0 and")):
        assert bench_diloco.main(["--study", "wan", *argv]) == 2, argv
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and words in err, (argv, err)


@pytest.mark.timeout(600)  # 2 runs x 3 processes that import torch: ~1 min on a quiet host, more under heavy load
def test_study_wan_quick(tmp_path, capsys):
    reason = namespaces_available()
    if reason:
        pytest.skip(f"network namespaces unavailable: {reason}")
    import bench_diloco

    assert bench_diloco.main(["--study", "wan", "--quick", "--work", str(tmp_path)]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["study"] == "wan" and out["seeds"] == [0] and out["skipped"] is None
    st = out["settings"]
    assert (st["model"], st["sync_steps"], st["h"], st["replicas"], st["between_mbit"]) == ("tiny", 10, 5, 2, 20.0)
    assert "--dp-sync diloco --inner-steps 5" in st["diloco_options"] and "--outer-delay 1" in st["diloco_options"]
    assert "--pseudo-codec sparseloco" in st["diloco_options"] and "--outer-momentum 0.0" in st["diloco_options"]
    (row,) = out["per_seed"]
    sync, dil = row["sync"], row["diloco"]
    assert sync["steps"] == 10 and 0 < dil["steps"] <= st["cap_steps"] == 30
    for side in (sync, dil):
        assert all(math.isfinite(v) for _, _, v in side["val"]) and side["val"], side
        assert math.isfinite(side["first_loss"]) and side["wall_s"] > 0
        assert 0 < side["compute_utilisation"] <= 1.0 + 1e-9, side
    assert row["sync_final_val_loss"] == pytest.approx(sync["val"][-1][2], abs=1e-4)
    # the same model, init and first batch: step 0's loss is the same on both sides (no update has happened yet)
    assert dil["first_loss"] == pytest.approx(sync["first_loss"], rel=1e-6)
    assert dil["outer_rounds"] >= dil["steps"] // 5 - 1
    if row["wall_to_sync_loss_ratio"] is None:  # a miss: the gap is said, the headline is null
        assert row["diloco_val_gap"] > 0 and dil["steps"] == st["cap_steps"] and out["wall_to_sync_loss_ratio"] is None
    else:
        assert row["wall_to_sync_loss_ratio"] == pytest.approx(dil["time_to_target_s"] / sync["wall_s"], rel=1e-3, abs=5e-3)  # both rounded to 1 ms
        assert out["wall_to_sync_loss_ratio"] == pytest.approx(row["wall_to_sync_loss_ratio"])
        assert dil["val"][-1][2] <= row["sync_final_val_loss"]
    assert out["compute_utilisation"] == dil["compute_utilisation"]
    # every step's gradients crossing the link against a few sparse 2-bit pseudo-gradients: several times fewer bytes
    assert 0 < out["between_sites_bytes_per_step"]["diloco"] < out["between_sites_bytes_per_step"]["sync"] / 3
    assert len(out["loadavg_start"]) == len(out["loadavg_end"]) == 3
    lines = [json.loads(x) for x in (tmp_path / "seed0" / "diloco" / "run" / "metrics.jsonl").read_text().splitlines()]
    assert all("optimizer_s" in p for x in lines if "loss" in x for p in x["parts"].values())
