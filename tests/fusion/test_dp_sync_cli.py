"""`fusion compile --strategy dp --dp-sync auto|diloco`: the planner writes Plan.dp_sync and its priced figures,
`fusion inspect` shows them; bad input exits 2 with one line."""
from pathlib import Path

from fusion.cli import main
from fusion.plan import load_plan
from tests.fusion.cli_helpers import cnn_model as _model, one_line as _one_line

ROOT = Path(__file__).resolve().parents[2]
LOCAL = str(ROOT / "examples" / "clusters" / "local-4-two-sites.yaml")


def test_diloco_planned_and_inspected(tmp_path, capsys):
    out = tmp_path / "d.plan"
    assert main(["compile", _model(tmp_path), "--cluster", LOCAL, "--strategy", "dp", "--dp-sync", "diloco",
                 "--inner-steps", "10,50", "--global-batch", "16", "-o", str(out)]) == 0
    capsys.readouterr()
    plan = load_plan(out)
    ds, pr = plan.dp_sync, plan.predicted["dp_sync"]
    assert ds.mode == "diloco" and ds.inner_steps in (10, 50) and plan.replicas >= 2
    from fusion.cost.dp import PSEUDO_CODECS, codec_label

    assert pr["inner_steps"] == ds.inner_steps and pr["codec"] in {codec_label(c) for c in PSEUDO_CODECS}
    assert plan.predicted["iteration_s"] == pr["iteration_s"] > 0
    assert sum(pr["micro_batches_per_replica"]) * 2 == 16  # 2 rows per traced micro-batch
    assert main(["inspect", str(out)]) == 0
    text = capsys.readouterr().out
    assert f"sync: DiLoCo, H = {ds.inner_steps} inner steps per outer step" in text
    assert "priced per outer step: sync" in text and "per inner step against" in text
    assert f"average their pseudo-gradients every {ds.inner_steps} inner steps" in text


def test_planner_with_sparseloco_writes_its_outer_step(tmp_path, capsys):
    """--pseudo-codec sparseloco with the DiLoCo planner: the plan gets the codec, error feedback on and no outer
    momentum (the codec registry's answers: SparseLoCo's error feedback replaces the momentum)."""
    out = tmp_path / "s.plan"
    assert main(["compile", _model(tmp_path), "--cluster", LOCAL, "--strategy", "dp", "--dp-sync", "diloco",
                 "--inner-steps", "20", "--pseudo-codec", "sparseloco:chunk=256,k=8", "--global-batch", "16",
                 "-o", str(out)]) == 0
    capsys.readouterr()
    ds = load_plan(out).dp_sync
    assert (ds.codec, ds.error_feedback, ds.outer_momentum) == ({"algo": "sparseloco", "chunk": 256, "k": 8}, True, 0.0)


def test_auto_writes_its_choice(tmp_path, capsys):
    out = tmp_path / "a.plan"
    assert main(["compile", _model(tmp_path), "--cluster", LOCAL, "--strategy", "dp", "--dp-sync", "auto",
                 "--global-batch", "16", "-o", str(out)]) == 0
    capsys.readouterr()
    plan = load_plan(out)
    planner = plan.predicted["dp_planner"]
    # microseconds of compute per step: synchronous DP pays the all-reduce's latencies every step, DiLoCo once per H
    assert plan.dp_sync.mode == "diloco" and planner["diloco_over_sync_dp"] >= 1.1
    assert planner["samples_per_s"] == plan.predicted["throughput_samples_s"]
    # the runtime runs the delayed outer step, so auto prices it: over the 20 Mbit/s link it hides the sync
    pr = plan.predicted["dp_sync"]
    assert plan.dp_sync.delay == 1 and pr["exposed_sync_s_per_outer_step"] < pr["sync_s_per_outer_step"]
    assert main(["inspect", str(out)]) == 0
    text = capsys.readouterr().out
    assert "x synchronous DP's best layout" in text and "delay 1" in text and "overlapped:" in text
    pinned = tmp_path / "p.plan"  # --outer-delay 0 narrows the search to the blocking outer step
    assert main(["compile", _model(tmp_path), "--cluster", LOCAL, "--strategy", "dp", "--dp-sync", "auto",
                 "--outer-delay", "0", "--global-batch", "16", "-o", str(pinned)]) == 0
    assert load_plan(pinned).dp_sync.delay == 0


def test_bad_dp_sync_input_exits_2_with_one_line(tmp_path, capsys):
    m = _model(tmp_path)
    one = tmp_path / "one.yaml"
    one.write_text("name: one\ndevices:\n  - {name: cpu-0, peak_flops: 50 GFLOPS, memory: 4 GB}\n"
                   "links:\n  default: {latency: 1 ms, bandwidth: 1 Gbit/s}\n")
    assert main(["compile", m, "--cluster", str(one), "--strategy", "dp", "--dp-sync", "auto", "--global-batch", "8",
                 "-o", str(tmp_path / "a")]) == 2
    assert "has one device; data parallelism needs 2 or more" in _one_line(capsys)
    assert main(["compile", m, "--cluster", LOCAL, "--strategy", "dp", "--dp-sync", "auto", "--inner-steps", "10,0",
                 "--global-batch", "8", "-o", str(tmp_path / "b")]) == 2
    assert "--inner-steps 0: DiLoCo takes at least one inner step" in _one_line(capsys)
    assert main(["compile", m, "--cluster", LOCAL, "--strategy", "dtfm", "--dp-sync", "auto", "--global-batch", "8",
                 "-o", str(tmp_path / "c")]) == 2
    assert "--dp-sync auto is the --strategy dp planner's choice (not dtfm)" in _one_line(capsys)
    assert not any((tmp_path / x).exists() for x in "abc")
