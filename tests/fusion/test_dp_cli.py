"""`fusion compile/run --replicas R --global-batch ROWS` through the real CLI; bad input exits 2 with one line."""
import json
from pathlib import Path

import numpy as np

from fusion.cli import main
from fusion.plan import OptimizerConfig, load_plan, load_weights
from tests.fusion.cli_helpers import cnn_model as _model, one_line as _one_line

ROOT = Path(__file__).resolve().parents[2]
LOCAL = str(ROOT / "examples" / "clusters" / "local-4-two-sites.yaml")


def _fusion(cli, argv, env=None):
    """``python -m fusion.cli ARGV`` in this folder, a process forked from the session's command server
    (tests/fusion/forked_cli.py); ``env``: variables added for this command."""
    return cli.run(argv, Path.cwd(), 300, env=env)


def test_compile_places_replicas_on_the_next_fastest_free_devices(tmp_path, capsys):
    out = tmp_path / "dp.plan"
    assert main(["compile", _model(tmp_path), "--cluster", LOCAL, "--replicas", "2", "--global-batch", "12",
                 "-o", str(out)]) == 0
    assert "2 replicas x 1 stage)" in capsys.readouterr().out
    plan = load_plan(out)
    assert plan.replicas == 2 and plan.global_batch == 12 and plan.micro_batches == 3  # 12 rows / 2 replicas / 2 rows
    assert {p: (x.device, x.replica, x.stage) for p, x in plan.parts.items()} == {
        "part0": ("cpu-0", 0, ""), "r1.part0": ("cpu-1", 1, "part0")}
    assert [r["devices"] for r in plan.predicted["replicas"]] == [["cpu-0"], ["cpu-1"]]
    assert main(["inspect", str(out)]) == 0
    text = capsys.readouterr().out
    assert "replica" in text and "r1.part0" in text


def test_replicas_fit_when_the_single_pipeline_took_every_device(tmp_path, capsys):
    """OP-Fence cuts GPT "small" over both devices of two-hosts; with --replicas 2 that left replica 1 nothing
    (exit 2, "no free device for replica 1"). Replica 0 is now cut again on its half of the devices."""
    gpt = f"{ROOT / 'examples' / 'models' / 'gpt.py'}:small"
    two_hosts = str(ROOT / "examples" / "clusters" / "two-hosts.yaml")
    assert main(["compile", gpt, "--cluster", two_hosts, "-o", str(tmp_path / "one")]) == 0
    assert len(load_plan(tmp_path / "one").parts) == 2  # the single pipeline: both devices
    capsys.readouterr()
    assert main(["compile", gpt, "--cluster", two_hosts, "--replicas", "2", "-o", str(tmp_path / "dp")]) == 0
    assert "2 replicas x 1 stage)" in capsys.readouterr().out
    plan = load_plan(tmp_path / "dp")
    assert {p: (x.device, x.replica) for p, x in plan.parts.items()} == {"part0": ("host-a", 0), "r1.part0": ("host-b", 1)}
    assert [d["name"] for d in plan.cluster["devices"]] == ["host-a", "host-b"]  # the whole cluster, not the share
    assert sorted(d for c in plan.predicted["clusters"] for d in c) == ["host-a", "host-b"]  # inspect draws both
    assert [r["devices"] for r in plan.predicted["replicas"]] == [["host-a"], ["host-b"]]


def test_replica_zero_share_keeps_a_site_together(tmp_path):
    from fusion.cluster import load_cluster
    from fusion.replicas import replica_zero_share

    (tmp_path / "c.yaml").write_text(
        "name: interleaved\ndevices:\n"
        + "".join(f"  - {{name: {n}, group: site-{n[0]}, peak_flops: 50 GFLOPS, memory: 4 GB}}\n"
                  for n in ("a0", "b0", "a1", "b1", "c0", "c1"))
        + "links:\n  default: {latency: 30 ms, bandwidth: 20 Mbit/s}\n"
          "  within_group: {latency: 1 ms, bandwidth: 1 Gbit/s}\n")
    cluster = load_cluster(str(tmp_path / "c.yaml"))
    assert replica_zero_share(6, cluster, 2) == ["a0", "a1", "b0"]  # site a whole, then site b's first
    assert replica_zero_share(6, cluster, 3) == ["a0", "a1"]
    assert replica_zero_share(3, cluster, 2) is None  # 3 stages x 2 replicas fit in 6 devices
    assert replica_zero_share(2, cluster, 7) is None  # a share of no device: the grid's own error says so


def test_bad_global_batch_and_too_many_replicas_exit_2_with_one_line(tmp_path, capsys):
    m = _model(tmp_path)
    assert main(["compile", m, "--cluster", LOCAL, "--replicas", "2", "--global-batch", "13", "-o", str(tmp_path / "a")]) == 2
    assert "--global-batch 13 does not divide over 2 replicas" in _one_line(capsys)
    assert main(["compile", m, "--cluster", LOCAL, "--replicas", "2", "--global-batch", "6", "-o", str(tmp_path / "b")]) == 2
    assert "3 rows, not a multiple of the micro-batch of 2 rows" in _one_line(capsys)
    assert main(["compile", m, "--cluster", LOCAL, "--replicas", "2", "--global-batch", "8", "--micro-batches", "3",
                 "-o", str(tmp_path / "c")]) == 2
    assert "not --micro-batches 3" in _one_line(capsys)
    assert main(["compile", m, "--cluster", LOCAL, "--replicas", "5", "-o", str(tmp_path / "d")]) == 2
    assert "no free device for replica 4" in _one_line(capsys)
    assert main(["compile", m, "--cluster", LOCAL, "--replicas", "2", "--dp-codec", "topk:ratio=10", "-o",
                 str(tmp_path / "e")]) == 2
    assert "--dp-codec topk:ratio=10: the all-reduce takes quant" in _one_line(capsys)
    assert not any((tmp_path / x).exists() for x in "abcde")
    assert main(["compile", m, "--cluster", LOCAL, "--replicas", "2", "--dp-codec", "quant:bits=8", "-o",
                 str(tmp_path / "f")]) == 0
    assert load_plan(tmp_path / "f").dp_codec == {"algo": "quant", "bits": 8}


def test_run_with_replicas_trains_like_one_process_on_the_global_batch(cli, tmp_path):
    """`fusion run MODEL --replicas 2`: two CompNode processes, each on half of every global batch, average their
    gradients; the logged losses and the final weights equal the single-process reference on the whole batch."""
    from fusion.data.batches import make_batches
    from fusion.executors.reference import ReferenceExecutor
    from fusion.loader import load_model

    out = tmp_path / "run"
    r = _fusion(cli, ["run", _model(tmp_path), "--cluster", LOCAL, "--out", str(out),
                      "--replicas", "2", "--global-batch", "8", "--optimizer", "sgd", "--lr", "0.1", "--momentum", "0.9",
                      "--steps", "3", "--no-progress"])
    assert r.returncode == 0, r.stderr[-3000:]
    plan = load_plan(out / "plan")
    assert plan.replicas == 2 and plan.micro_batches == 2
    losses = [json.loads(x)["loss"] for x in (out / "metrics.jsonl").read_text().splitlines()]
    model = load_model(_model(tmp_path))
    ref = ReferenceExecutor(model, optimizer=OptimizerConfig("sgd", lr=0.1, momentum=0.9), micro_batches=4)
    batch = make_batches(plan, "auto", plan.seed)
    want = [ref.step(batch(s)).loss for s in range(3)]
    np.testing.assert_allclose(losses, want, rtol=1e-5)
    final = load_weights(out / "final.safetensors")
    for k, v in ref.state().items():
        np.testing.assert_allclose(final[k], v, rtol=1e-4, atol=1e-6, err_msg=k)


DATA_SRC = '''
import json, os, signal
from pathlib import Path
import numpy as np

def batches(step):
    if step == 2:  # before step 2: kill replica 1's CompNode, as a crash would
        pids = json.loads((Path(os.environ["DP_TEST_RUN"]) / "pids.json").read_text())
        os.killpg(pids["r1.part0"], signal.SIGKILL)
    g = np.random.default_rng([3, step])
    return {"x": g.standard_normal((8, 3, 6, 6)).astype(np.float32), "y": g.integers(0, 5, 8).astype(np.int64)}
'''


def test_run_drops_a_dead_replica_and_records_it(cli, tmp_path):
    """`fusion run --drop-failed-replicas`: replica 1's CompNode is killed before step 2; the run goes on with
    replica 0, metrics.jsonl records the drop at step 2, and every loss equals the reference on the global batch."""
    from fusion.executors.reference import ReferenceExecutor
    from fusion.loader import load_function, load_model

    (tmp_path / "data.py").write_text(DATA_SRC)
    out = tmp_path / "run"
    r = _fusion(cli, ["run", _model(tmp_path), "--cluster", LOCAL, "--out", str(out),
                      "--replicas", "2", "--global-batch", "8", "--optimizer", "sgd", "--lr", "0.1", "--momentum", "0.9",
                      "--steps", "4", "--no-progress", "--drop-failed-replicas",
                      "--data", f"{tmp_path / 'data.py'}:batches"], env={"DP_TEST_RUN": str(out)})
    assert r.returncode == 0, r.stderr[-3000:]
    assert "dropped replica 1 at step 2" in r.stderr
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [0, 1, 2, 3]
    (drop,) = lines[2]["dropped"]
    assert drop["replica"] == 1 and drop["step"] == 2 and drop["part"] == "r1.part0" and drop["redone"]
    assert "dropped" not in lines[3] and set(lines[3]["parts"]) == {"part0"}
    ref = ReferenceExecutor(load_model(_model(tmp_path)), optimizer=OptimizerConfig("sgd", lr=0.1, momentum=0.9),
                            micro_batches=4)
    fn = load_function(f"{tmp_path / 'data.py'}:batches", "data")
    want = [ref.step(fn(s) if s != 2 else _no_kill(s)).loss for s in range(4)]
    np.testing.assert_allclose([x["loss"] for x in lines], want, rtol=1e-5)
    final = load_weights(out / "final.safetensors")
    for k, v in ref.state().items():
        np.testing.assert_allclose(final[k], v, rtol=1e-4, atol=1e-6, err_msg=k)


def _no_kill(step):
    g = np.random.default_rng([3, step])
    return {"x": g.standard_normal((8, 3, 6, 6)).astype(np.float32), "y": g.integers(0, 5, 8).astype(np.int64)}


def test_dp_planners_need_a_global_batch_and_choose_the_replicas(tmp_path, capsys):
    m = _model(tmp_path)
    assert main(["compile", m, "--cluster", LOCAL, "--strategy", "dp", "-o", str(tmp_path / "a")]) == 2
    assert "--strategy dp plans data-parallel replicas" in _one_line(capsys)
    assert main(["compile", m, "--cluster", LOCAL, "--strategy", "dtfm", "--global-batch", "8", "--replicas", "2",
                 "-o", str(tmp_path / "b")]) == 2
    assert "--strategy dtfm chooses the number of replicas" in _one_line(capsys)
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_run_with_the_dp_and_dtfm_planners_trains_like_one_process(cli, tmp_path):
    """`fusion run MODEL --strategy dp|dtfm --global-batch 8`: the planner picks replicas, cut and devices, the
    plan carries its prediction (all-reduce included), and the CompNodes train like one process on the global batch."""
    from fusion.data.batches import make_batches
    from fusion.executors.reference import ReferenceExecutor
    from fusion.loader import load_model

    for strategy in ("dp", "dtfm"):
        out = tmp_path / strategy
        r = _fusion(cli, ["run", _model(tmp_path), "--cluster", LOCAL, "--out",
                          str(out), "--strategy", strategy, "--global-batch", "8", "--lr", "0.1", "--steps", "2",
                          "--no-progress"])
        assert r.returncode == 0, r.stderr[-3000:]
        plan = load_plan(out / "plan")
        assert plan.strategy == strategy and plan.global_batch == 8
        assert plan.replicas * plan.micro_batches * 2 == 8  # 2 rows per micro-batch, as traced
        assert plan.predicted["iteration_s"] == plan.predicted["dp_planner"]["iteration_s"] > 0
        losses = [json.loads(x)["loss"] for x in (out / "metrics.jsonl").read_text().splitlines()]
        ref = ReferenceExecutor(load_model(_model(tmp_path)), optimizer=OptimizerConfig("sgd", lr=0.1), micro_batches=4)
        batch = make_batches(plan, "auto", plan.seed)
        np.testing.assert_allclose(losses, [ref.step(batch(s)).loss for s in range(2)], rtol=1e-5, err_msg=strategy)


def test_a_run_that_lost_a_replica_resumes_the_full_plan_from_the_survivors_checkpoint(cli, tmp_path):
    """`fusion run --drop-failed-replicas --checkpoint-every 2`: replica 1 dies before step 2, the checkpoint after
    step 4 is written by replica 0 alone, step 4 runs and the run ends. `fusion run OUT/plan --out OUT --resume`
    brings both replicas back from that checkpoint (r1.part0 loads part0's copy) and trains steps 4..6:
    metrics.jsonl holds steps 0..6 once each, every loss equals the one-process reference on the global batches,
    and both replicas' saved weights after step 6 are the same bits."""
    from safetensors.numpy import load_file

    from fusion.executors.reference import ReferenceExecutor
    from fusion.loader import load_model

    (tmp_path / "data.py").write_text(DATA_SRC)
    out = tmp_path / "run"
    common = ["--out", str(out), "--no-progress", "--drop-failed-replicas", "--checkpoint-every", "2",
              "--data", f"{tmp_path / 'data.py'}:batches"]
    env = {"DP_TEST_RUN": str(out)}
    r = _fusion(cli, ["run", _model(tmp_path), "--cluster", LOCAL, "--replicas", "2",
                      "--global-batch", "8", "--optimizer", "sgd", "--lr", "0.1", "--momentum", "0.9", "--steps", "5",
                      *common], env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "dropped replica 1 at step 2" in r.stderr
    complete = json.loads((out / "checkpoints" / "step-00000004" / "COMPLETE.json").read_text())
    assert complete["parts"] == ["part0"] and complete["dropped"][0]["replica"] == 1
    r = _fusion(cli, ["run", str(out / "plan"), "--steps", "7", "--resume", *common], env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resuming at step 4" in r.stderr and "r1.part0 loads part0's copy" in r.stderr
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == list(range(7))  # run 1's unsaved step 4 was replaced, not kept twice
    assert [bool(x.get("dropped")) for x in lines] == [False, False, True, False, False, False, False]
    assert all(set(x["parts"]) == {"part0", "r1.part0"} for x in lines[4:])  # both replicas again
    ref = ReferenceExecutor(load_model(_model(tmp_path)), optimizer=OptimizerConfig("sgd", lr=0.1, momentum=0.9),
                            micro_batches=4)
    want = [ref.step(_no_kill(s)).loss for s in range(7)]
    np.testing.assert_allclose([x["loss"] for x in lines], want, rtol=1e-5)
    final = load_weights(out / "final.safetensors")
    for k, v in ref.state().items():
        np.testing.assert_allclose(final[k], v, rtol=1e-4, atol=1e-6, err_msg=k)
    step6 = out / "checkpoints" / "step-00000006"
    a, b = load_file(str(step6 / "part0.params.safetensors")), load_file(str(step6 / "r1.part0.params.safetensors"))
    assert set(a) == set(b)
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=f"replicas differ in {k} after the resume")


def test_a_plan_whose_replicas_differ_in_cut_exits_2_with_one_line(tmp_path, capsys):
    """A replicated plan edited so replica 1 runs a stage the cut does not have: `fusion inspect` and `fusion run`
    refuse it with one line naming the part and field (exit 2), before any process starts."""
    out = tmp_path / "dp.plan"
    assert main(["compile", _model(tmp_path), "--cluster", LOCAL, "--replicas", "2", "--global-batch", "8",
                 "-o", str(out)]) == 0
    capsys.readouterr()
    d = json.loads((out / "plan.json").read_text())
    d["parts"]["r1.part0"]["stage"] = "part7"
    (out / "plan.json").write_text(json.dumps(d))
    for cmd in (["inspect", str(out)], ["run", str(out), "--out", str(tmp_path / "run"), "--steps", "1"]):
        assert main(cmd) == 2
        assert "parts.r1.part0.stage 'part7' is not a stage of the assignment" in _one_line(capsys)
    assert not (tmp_path / "run").exists()


def test_a_batch_that_is_not_the_global_batch_exits_2_with_one_line(cli, tmp_path):
    """A data function whose batch has 6 rows for a plan of global batch 8 (2 replicas x 2 micro-batches of 2 rows):
    the run stops at step 0 with one line naming the field and both shapes (exit 2); nothing hangs."""
    (tmp_path / "data.py").write_text(
        "import numpy as np\n"
        "def batches(step):\n"
        "    g = np.random.default_rng(step)\n"
        "    return {'x': g.standard_normal((6, 3, 6, 6)).astype(np.float32), 'y': g.integers(0, 5, 6).astype(np.int64)}\n")
    r = _fusion(cli, ["run", _model(tmp_path), "--cluster", LOCAL, "--out",
                      str(tmp_path / "run"), "--replicas", "2", "--global-batch", "8", "--steps", "2", "--no-progress",
                      "--data", f"{tmp_path / 'data.py'}:batches"])
    assert r.returncode == 2, r.stderr[-3000:]
    last = r.stderr.strip().splitlines()[-1]
    assert "step 0: field 'x' has shape [6, 3, 6, 6], the plan expects [8, 3, 6, 6] (4 micro-batch(es) of [2, 3, 6, 6])" \
        in last, r.stderr[-2000:]


def test_a_dp_plan_says_what_it_is_worth_against_one_pipeline(tmp_path, capsys):
    """Issue 34: ``predicted.dp_vs_single_pipeline`` in plan.json, the plan's samples/s over OP-Fence's best
    single pipeline priced on the same cluster and global batch (fusion.partition.dp.single_pipeline), in inspect."""
    from fusion.cost.estimate import optimizer_slots
    from fusion.cluster.load import load_cluster
    from fusion.loader import load_model
    from fusion.partition.dp import build_cost_model, single_pipeline

    m, out = _model(tmp_path), tmp_path / "dp.plan"
    assert main(["compile", m, "--cluster", LOCAL, "--strategy", "dp", "--global-batch", "8", "--optimizer", "sgd",
                 "-o", str(out)]) == 0
    capsys.readouterr()
    pr = load_plan(out).predicted
    cm = build_cost_model(load_model(m).graph, load_cluster(LOCAL), schedule="gpipe",
                          optimizer_slots=optimizer_slots("sgd", 0.0))
    single, parts = single_pipeline(cm, 8)
    assert single > 0 and parts == pr["single_pipeline_parts"]
    assert pr["single_pipeline_samples_per_s"] == single
    assert pr["dp_vs_single_pipeline"] == pr["throughput_samples_s"] / single
    assert main(["inspect", str(out)]) == 0
    assert f"{pr['dp_vs_single_pipeline']:.3g}x the samples/s of OP-Fence's best single pipeline" in capsys.readouterr().out
