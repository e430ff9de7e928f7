"""``benchmarks/bench_diloco.py --study dpxpp --quick`` (issue 36's DP x PP row): torch's pipelining inside two
network-namespace sites with DDP across them against fusion's plan for the same four hosts, over a tc-shaped
20 Mbit/s link (the tiny GPT, 10 torch steps, H = 5, seed 0).

Checks the final JSON (finite figures, null only where the definition says so), that both sides start from the same
loss (same model, init and first batch), that fusion's replicas sit one per site and send fewer bytes between the
sites per step than torch's DDP, and the layout check on hand-written plans. The network part is skipped where
namespaces cannot be made (not root, no ``ip``/``tc``)."""
import json
import math
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))
from netns_sites import namespaces_available  # noqa: E402


class _Sites:
    hosts = {"coord": "site-a", "a0": "site-a", "a1": "site-a", "b0": "site-b", "b1": "site-b"}


def _plan(*parts):
    return {"parts": {n: {"device": d, "replica": r} for n, d, r in parts}}


def test_layout_check_wants_one_replica_per_site():
    from dpxpp_wan import check_layout

    assert check_layout(_plan(("part0", "a0", 0), ("part1", "a1", 0), ("r1.part0", "b0", 1), ("r1.part1", "b1", 1)),
                        _Sites()) is None
    assert check_layout(_plan(("part0", "a0", 0), ("r1.part0", "b0", 1)), _Sites()) is None  # one stage each
    assert "one per site" in check_layout(_plan(("part0", "a0", 0), ("r1.part0", "a1", 1)), _Sites())
    assert "inside one site" in check_layout(
        _plan(("part0", "a0", 0), ("part1", "b1", 0), ("r1.part0", "a1", 1), ("r1.part1", "b0", 1)), _Sites())
    assert "expected 2 replicas" in check_layout(_plan(("part0", "a0", 0), ("part1", "a1", 0)), _Sites())


def test_bad_settings_exit_2_with_one_line(capsys):
    import bench_diloco

    for argv, words in ((["--compress", "nosuchcodec"], "nosuchcodec"), (["--compress", "quant:bits=99"], "bits"),
                        (["--pseudo-codec", "nosuchcodec"], "nosuchcodec"), (["--sync-warmup", "900"], "--sync-warmup"),
                        (["--sync-codec", "quant:bits=8"], "this row's baseline is torch's")):
        assert bench_diloco.main(["--study", "dpxpp", *argv]) == 2, argv
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and words in err and "dpxpp" in err, (argv, err)


@pytest.mark.timeout(600)  # torch's 4 ranks, then fusion's 3 processes: ~15 s on a quiet host
def test_study_dpxpp_quick(tmp_path, capsys):
    reason = namespaces_available()
    if reason:
        pytest.skip(f"network namespaces unavailable: {reason}")
    import bench_diloco

    assert bench_diloco.main(["--study", "dpxpp", "--quick", "--work", str(tmp_path)]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["study"] == "dpxpp" and out["seeds"] == [0] and out["skipped"] is None
    st = out["settings"]
    assert (st["model"], st["sync_steps"], st["h"], st["replicas"], st["torch_stages"]) == ("tiny", 10, 5, 2, 2)
    (row,) = out["per_seed"]
    torch_side, fusion = row["torch"], row["fusion"]
    assert torch_side["steps"] == 10 and 0 < fusion["steps"] <= st["cap_steps"] == 30
    # fusion's replicas: one per site (the plan's devices), whatever stages OP-Fence chose
    sites = {d[0] for d in fusion["parts"].values()}
    assert sites == {"a", "b"} and len(fusion["parts"]) == 2 * fusion["stages"]
    for side in (torch_side, fusion):
        assert side["val"] and all(math.isfinite(v) for _, _, v in side["val"]), side
        assert side["wall_s"] > 0 and side["between_sites_bytes_per_step"] > 0
    assert 0 < fusion["compute_utilisation"] <= 1.0 + 1e-9
    assert row["torch_final_val_loss"] == pytest.approx(torch_side["val"][-1][2], abs=1e-4)
    # the same model, init and first batch on both sides: step 0's loss (no update yet)
    assert fusion["first_loss"] == pytest.approx(torch_side["first_loss"], rel=1e-5)
    # DiLoCo across the sites sends far less over the slow link than DDP's every-step all-reduce
    assert fusion["between_sites_bytes_per_step"] < torch_side["between_sites_bytes_per_step"] / 4
    if row["wall_to_torch_loss_ratio"] is None:  # a miss: the gap is said, the headline is null
        assert row["fusion_val_gap"] > 0 and out["wall_to_torch_loss_ratio"] is None
    else:
        assert row["wall_to_torch_loss_ratio"] > 0 and row["fusion_val_gap"] is None
        assert fusion["val"][-1][2] <= row["torch_final_val_loss"] + 1e-9
        assert out["wall_to_torch_loss_ratio"] == pytest.approx(row["wall_to_torch_loss_ratio"])
