"""`fusion compile --strategy dp --dp-sync auto|diloco`: the planner writes Plan.dp_sync and its priced figures,
`fusion inspect` shows them; bad input exits 2 with one line."""
from pathlib import Path

import pytest

from fusion.cli import main
from fusion.plan import load_plan
from tests.fusion.cli_helpers import cnn_model as _model, one_line as _one_line

ROOT = Path(__file__).resolve().parents[2]
LOCAL = str(ROOT / "examples" / "clusters" / "local-4-two-sites.yaml")


def _slow(tmp_path) -> str:
    """LOCAL with devices of 1 MFLOPS: the CNN's compute then outweighs DiLoCo's sync, and synchronous DP's all-reduce
    over the 20 Mbit/s / 30 ms link every step costs more than DiLoCo's convergence price (fusion.cost.convergence;
    on LOCAL itself one device alone is the fastest way to the loss for this microsecond model)."""
    path = tmp_path / "slow.yaml"
    path.write_text(Path(LOCAL).read_text().replace("50 GFLOPS", "0.001 GFLOPS"))
    return str(path)


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
    """auto chooses by predicted time to synchronous DP's loss (samples/s over the measured steps-to-loss ratio,
    fusion.cost.convergence): on slow devices across a slow link DiLoCo at a measured H wins; pinned to the
    overlapped outer step, whose eager variant needed 1.733x the steps, synchronous DP wins."""
    from fusion.cost.convergence import STEPS_TO_SYNC_LOSS

    out, slow = tmp_path / "a.plan", _slow(tmp_path)
    assert main(["compile", _model(tmp_path), "--cluster", slow, "--strategy", "dp", "--dp-sync", "auto",
                 "--global-batch", "16", "-o", str(out)]) == 0
    capsys.readouterr()
    plan = load_plan(out)
    planner = plan.predicted["dp_planner"]
    assert plan.dp_sync.mode == "diloco" and planner["diloco_to_loss_over_sync_dp"] >= 1.1
    assert planner["samples_per_s"] == plan.predicted["throughput_samples_s"]
    pr = plan.predicted["dp_sync"]
    ratio = STEPS_TO_SYNC_LOSS[plan.dp_sync.inner_steps, plan.dp_sync.delay]
    assert pr["steps_to_sync_loss_ratio"] == ratio
    assert planner["diloco_to_loss_over_sync_dp"] * ratio == pytest.approx(planner["diloco_over_sync_dp"])
    assert main(["inspect", str(out)]) == 0
    text = capsys.readouterr().out
    assert "x synchronous DP's best layout" in text and f"convergence: {ratio:g}x synchronous DP's steps" in text
    pinned = tmp_path / "p.plan"  # --outer-delay 1 narrows the search to the overlapped outer step
    assert main(["compile", _model(tmp_path), "--cluster", slow, "--strategy", "dp", "--dp-sync", "auto",
                 "--outer-delay", "1", "--global-batch", "16", "-o", str(pinned)]) == 0
    capsys.readouterr()
    kept = load_plan(pinned)
    assert kept.dp_sync.mode == "every" and kept.predicted["dp_planner"]["diloco_to_loss_over_sync_dp"] < 1.1


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


def test_planner_chooses_warmup_and_inner_lr_and_inspect_says_why(tmp_path, capsys):
    """Issue 34: the DiLoCo planner chooses the synchronous warm-up (150 steps; a sixth of a known run) and the
    replicas' inner lr (AdamW: 2/3 of the plan's after a warm-up, the square-root rule without one), stores its reasons in
    ``predicted["diloco_choice"]`` and ``fusion inspect`` prints them; ``--sync-warmup`` / ``--inner-lr`` win."""
    import json
    import math

    m = _model(tmp_path)
    base = ["compile", m, "--cluster", _slow(tmp_path), "--strategy", "dp", "--dp-sync", "auto", "--global-batch", "16",
            "--optimizer", "adamw", "--lr", "0.003"]
    plans = {}
    for name, extra in [("auto", []), ("nowarm", ["--sync-warmup", "0"]), ("decay", ["--lr-schedule", "cosine",
                        "--lr-decay-steps", "50"]), ("given", ["--sync-warmup", "7", "--inner-lr", "0.002"])]:
        assert main([*base, *extra, "-o", str(tmp_path / name)]) == 0
        capsys.readouterr()
        plans[name] = load_plan(tmp_path / name)
    a = plans["auto"]
    assert a.dp_sync.mode == "diloco" and a.dp_sync.sync_warmup == 150 and a.dp_sync.inner_lr == 0.003 * 2 / 3
    why = a.predicted["diloco_choice"]
    assert why["warmup_reason"].startswith("150 steps: docs/data-parallel.md tuning")
    assert why["inner_lr_reason"].startswith("0.002 = lr 0.003 x 2/3: adamw after a synchronous warm-up")
    assert json.loads((tmp_path / "auto" / "plan.json").read_text())["dp_sync"]["inner_lr"] == a.dp_sync.inner_lr
    assert main(["inspect", str(tmp_path / "auto")]) == 0
    text = capsys.readouterr().out
    assert f"  warm-up (DP planner): {why['warmup_reason']}\n" in text
    assert f"  inner lr (DP planner): {why['inner_lr_reason']}\n" in text

    R = plans["nowarm"].replicas
    nowarm = plans["nowarm"].dp_sync
    assert nowarm.sync_warmup == 0 and nowarm.inner_lr == 0.003 * math.sqrt(1 / R)
    assert json.loads((tmp_path / "nowarm" / "plan.json").read_text())["dp_sync"]["inner_lr"] == nowarm.inner_lr
    assert main(["inspect", str(tmp_path / "nowarm")]) == 0
    text = capsys.readouterr().out
    assert "  warm-up (DP planner): none: given by the user (--sync-warmup 0)\n" in text
    assert f"  inner lr (DP planner): {nowarm.inner_lr:.4g} = lr 0.003 x sqrt(1/{R})" in text

    assert plans["decay"].dp_sync.sync_warmup == 8  # a sixth of the 50 steps the schedule spans
    assert "capped at a sixth of the 50 steps (--lr-decay-steps)" in plans["decay"].predicted["diloco_choice"][
        "warmup_reason"]
    assert (plans["given"].dp_sync.sync_warmup, plans["given"].dp_sync.inner_lr) == (7, 0.002)
    # without the planner (--replicas, --dp-sync diloco) the values are the options', and inspect shows them bare
    assert main(["compile", m, "--cluster", LOCAL, "--replicas", "2", "--dp-sync", "diloco", "--sync-warmup", "3",
                 "--inner-lr", "0.002", "-o", str(tmp_path / "hand")]) == 0
    hand = load_plan(tmp_path / "hand")
    assert (hand.dp_sync.sync_warmup, hand.dp_sync.inner_lr) == (3, 0.002) and "diloco_choice" not in hand.predicted
    capsys.readouterr()
    assert main(["inspect", str(tmp_path / "hand")]) == 0
    text = capsys.readouterr().out
    assert "  warm-up: 3 synchronous steps, then DiLoCo\n" in text and "  inner lr: 0.002\n" in text

    # fusion run's --steps caps it (and is then part of the compile's cache key)
    from fusion.cluster import load_cluster
    from fusion.commands.compile import compile_from_args
    from fusion.compile_key import compile_options
    from fusion.loader import load_model
    from fusion.options.compile import CompileJob, CompileOptions

    opts = CompileOptions(strategy="dp", dp_sync="auto", global_batch=16, optimizer="adamw", lr=0.003)
    job = CompileJob(m, _slow(tmp_path), opts, steps=30)
    plan = compile_from_args(job, load_model(m), load_cluster(_slow(tmp_path)))
    assert plan.dp_sync.sync_warmup == 5 and compile_options(job)["steps"] == 30  # 30 // 6
    assert "steps" not in compile_options(CompileJob(m, LOCAL, CompileOptions(), steps=30))


def test_bad_inner_lr_or_warmup_exits_2_with_one_line(tmp_path, capsys):
    m = _model(tmp_path)
    for opts, says in [
        (["--replicas", "2", "--dp-sync", "diloco", "--inner-lr", "-1"], "--inner-lr -1.0: must be a positive number"),
        (["--replicas", "2", "--dp-sync", "diloco", "--inner-lr", "nan"], "--inner-lr nan: must be a positive number"),
        (["--replicas", "2", "--inner-lr", "0.01"], "--inner-lr is an option of --dp-sync diloco"),
    ]:
        assert main(["compile", m, "--cluster", LOCAL, *opts, "-o", str(tmp_path / "x")]) == 2
        assert says in _one_line(capsys)
    assert not (tmp_path / "x").exists()
    # a planned warm-up of 150 steps and a run of 50: refused before anything starts, naming the plan's field
    plan = tmp_path / "p.plan"
    assert main(["compile", m, "--cluster", _slow(tmp_path), "--strategy", "dp", "--dp-sync", "auto",
                 "--global-batch", "16", "-o", str(plan)]) == 0
    capsys.readouterr()
    assert main(["run", str(plan), "--steps", "50", "--out", str(tmp_path / "run")]) == 2
    assert (f"{plan}: dp_sync.sync_warmup 150: the synchronous warm-up must be shorter than the run (--steps 50), "
            "or DiLoCo never starts; give --steps > 150 or recompile with --sync-warmup N" in _one_line(capsys))
    assert not (tmp_path / "run").exists()
    from fusion.plan import DPSync, PlanError
    import pytest

    with pytest.raises(PlanError, match=r"plan.dp_sync.inner_lr must be a finite number > 0"):
        DPSync.from_dict({"mode": "diloco", "inner_lr": 0})
    with pytest.raises(PlanError, match=r"sync_warmup and inner_lr are DiLoCo's"):
        DPSync.from_dict({"mode": "every", "inner_lr": 0.1})


def test_codec_label_is_the_cli_spelling_everywhere():
    """One spelling of a codec cfg for the compile summary, the planner's prediction and ``fusion inspect`` (there
    were two, one printing ``ratio=1000.0``, the other ``1e+03``); what it prints parses back to the same cfg."""
    from fusion.compress.policy import parse_spec
    from fusion.cost.dp import codec_label

    assert codec_label(None) == "dense"
    assert codec_label({"algo": "quant", "bits": 4}) == "quant:bits=4"
    assert codec_label({"algo": "topk", "ratio": 1000.0}) == "topk:ratio=1000"
    assert codec_label({"algo": "sparseloco", "chunk": 4096, "k": 64, "beta": 0.95}) == "sparseloco:chunk=4096,k=64,beta=0.95"
    for cfg in ({"algo": "quant", "bits": 8}, {"algo": "topk", "ratio": 100}):
        assert parse_spec(codec_label(cfg)) == cfg
