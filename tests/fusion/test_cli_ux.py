"""The CLI's rough edges of issue 16, each through real `python -m fusion.cli` processes.

Run folders (never reused by accident, metrics never appended twice), user errors as one line and
exit 2 (`--steps -1`, a model that raises, a taken port, an address without tcp://, a long engine
refusal), executors that say what they wait for and give up in time, `-v` after the command,
help with defaults, the bandwidth a user wrote kept as written, YAML errors with line and column,
`fusion graph` edges.
"""
import json
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.fusion.cli_helpers import CNN_SRC, sigint_default

ROOT = Path(__file__).resolve().parents[2]
LOCAL = str(ROOT / "examples" / "clusters" / "local-4-two-sites.yaml")

CNN = CNN_SRC + '''
def broken():
    width = 3
    raise ValueError(f"width {width} is not a multiple of 4")
'''


def fusion(cli, *args, cwd=None, timeout=180):
    """``python -m fusion.cli ARGS`` importing this checkout's fusion, in ``cwd`` (default: the checkout's root):
    a process of its own forked from the session's command server (the ``cli`` fixture, tests/fusion/forked_cli.py)."""
    return cli.run([str(a) for a in args], Path(cwd or ROOT), timeout)


def one_line_error(r, command):
    """Exit 2 and exactly one line on stderr, starting with `fusion COMMAND: error:`, no traceback."""
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    assert len(lines) == 1 and lines[0].startswith(f"fusion {command}: error:"), r.stderr[-2000:]
    return lines[0]


TWO = """
name: two
devices: [{name: cpu, count: 2, peak_flops: 50 GFLOPS, memory: 4 GB}]
links: {default: {latency: 1 ms, bandwidth: 1 Gbit/s}}
"""


@pytest.fixture(scope="module")
def cnn_plan(cli, tmp_path_factory):
    """A 2-part plan of the small CNN (equal-count on two CPUs), compiled once."""
    d = tmp_path_factory.mktemp("cnn")
    (d / "model.py").write_text(CNN)
    (d / "two.yaml").write_text(TWO)
    r = fusion(cli, "compile", f"{d / 'model.py'}:cnn", "--cluster", d / "two.yaml", "--strategy", "equal-count",
               "--micro-batches", "2", "-o", d / "cnn.plan")
    assert r.returncode == 0, r.stderr
    return d / "cnn.plan"


def steps_of(run: Path) -> list[int]:
    return [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()]


# -- run folders ---------------------------------------------------------------------------------

def test_run_folders_are_never_reused_by_accident(cli, cnn_plan, tmp_path):
    run = tmp_path / "run"
    common = ["--no-progress", "--data", "synthetic"]
    r = fusion(cli, "run", cnn_plan, "--out", run, "--steps", "3", "--checkpoint-every", "2", *common)
    assert r.returncode == 0, r.stderr[-3000:]
    assert steps_of(run) == [0, 1, 2]
    # the outputs of a finished run: metrics, the loss plot, one merged trace beside the per-CompNode ones
    assert (run / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and (run / "loss.png").stat().st_size > 10_000
    merged = json.loads((run / "trace.json").read_text())["traceEvents"]
    names = {e["args"]["name"] for e in merged if e.get("name") == "process_name"}
    assert {"CompNode part0", "CompNode part1", "coordinator"} <= names, names
    assert sum(e.get("cat") == "step" for e in merged) == 3
    assert (run / "final.safetensors").exists() and (run / "run.json").exists()
    # start-up lines: one per CompNode as it comes up, then when all are ready
    assert "part0 up: pid" in r.stderr and "part1 ready" in r.stderr and "all 2 CompNodes ready" in r.stderr

    # the same --out again: refused, nothing touched
    before = (run / "metrics.jsonl").read_text()
    r = fusion(cli, "run", cnn_plan, "--out", run, "--steps", "2", *common)
    assert "is not empty" in one_line_error(r, "run") and "--resume" in r.stderr and "--overwrite" in r.stderr
    assert (run / "metrics.jsonl").read_text() == before

    # --resume continues from the checkpoint of step 2: step 2 is replayed, its line replaced, not appended
    r = fusion(cli, "run", cnn_plan, "--out", run, "--steps", "4", "--resume", *common)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resuming at step 2" in r.stderr
    assert steps_of(run) == [0, 1, 2, 3]

    # --resume with a plan that did not write the run folder failed deep in an executor ("no initial value for
    # parameter ..."); now the plan's digest is compared with the one recorded in run.json (issue 28)
    other = tmp_path / "other.plan"
    shutil.copytree(cnn_plan, other)
    doc = json.loads((other / "plan.json").read_text())
    doc["seed"] = doc.get("seed", 0) + 1  # another plan: same graph, another seed
    (other / "plan.json").write_text(json.dumps(doc))
    r = fusion(cli, "run", other, "--out", run, "--steps", "5", "--resume", *common)
    line = one_line_error(r, "run")
    assert "written by another plan" in line and str(other) in line, line
    assert steps_of(run) == [0, 1, 2, 3]  # nothing of the run was touched

    # other data than the run's: refused (it trained other batches from the resumed step on, exit 0; issue 39)
    r = fusion(cli, "run", cnn_plan, "--out", run, "--steps", "5", "--resume", "--no-progress", "--data", "auto")
    line = one_line_error(r, "run")
    assert "was started with --data synthetic, this command says auto" in line, line
    assert steps_of(run) == [0, 1, 2, 3]

    # a checkpoint written by another plan (run.json's record lost or edited): the checkpoint itself says so
    complete = run / "checkpoints" / "step-00000002" / "COMPLETE.json"
    doc = json.loads(complete.read_text())
    assert len(doc["plan_digest"]) == 64
    complete.write_text(json.dumps({**doc, "plan_digest": "f" * 64}))
    r = fusion(cli, "run", cnn_plan, "--out", run, "--steps", "5", "--resume", *common)
    assert r.returncode == 2 and "checkpoint was written by another plan (digest ffffffffffffffff)" in r.stderr, \
        r.stderr[-2000:]
    assert steps_of(run) == [0, 1, 2, 3]
    complete.write_text(json.dumps(doc))

    # --overwrite replaces a previous run
    r = fusion(cli, "run", cnn_plan, "--out", run, "--steps", "1", "--overwrite", *common)
    assert r.returncode == 0, r.stderr[-3000:]
    assert steps_of(run) == [0] and not (run / "checkpoints").exists()

    # nothing to resume (no checkpoint): refused, the run's weights and metrics kept (it started over at step 0
    # and overwrote them, also with another model; issue 39)
    weights = (run / "final.safetensors").read_bytes()
    r = fusion(cli, "run", cnn_plan, "--out", run, "--steps", "3", "--resume", *common)
    assert "nothing to resume: the run holds no complete checkpoint" in one_line_error(r, "run")
    assert steps_of(run) == [0] and (run / "final.safetensors").read_bytes() == weights

    # ... but never empties a folder that no run wrote, nor the plan folder
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    r = fusion(cli, "run", cnn_plan, "--out", mine, "--steps", "1", "--overwrite", *common)
    assert "no run.json" in one_line_error(r, "run") and (mine / "notes.txt").exists()
    r = fusion(cli, "run", cnn_plan, "--out", cnn_plan, "--steps", "1", *common)
    assert "plan folder" in one_line_error(r, "run")


def test_resume_of_a_model_run_refuses_other_compile_options(cli, cnn_plan, tmp_path):
    """A MODEL run compiles once into RUN/plan; a --resume that names another model or compile option had it
    silently ignored (issue 39): now refused, naming the option, the run untouched."""
    model = cnn_plan.parent / "model.py"
    run = tmp_path / "run"
    common = ["--cluster", cnn_plan.parent / "two.yaml", "--strategy", "equal-count", "--micro-batches", "2",
              "--no-progress", "--data", "synthetic", "--out", run, "--checkpoint-every", "1"]
    r = fusion(cli, "run", f"{model}:cnn", "--steps", "2", *common)
    assert r.returncode == 0, r.stderr[-3000:]
    for extra, words in ((["--lr", "0.5"], "was started with --lr 0.01, this command says 0.5"),
                         (["--seed", "7"], "was started with --seed 0, this command says 7")):
        r = fusion(cli, "run", f"{model}:cnn", "--steps", "3", "--resume", *common, *extra)
        assert words in one_line_error(r, "run")
    r = fusion(cli, "run", f"{model}:broken", "--steps", "3", "--resume", *common)
    assert "was started with the model" in one_line_error(r, "run")
    assert steps_of(run) == [0, 1]
    r = fusion(cli, "run", f"{model}:cnn", "--steps", "3", "--resume", *common)  # the same options: continues
    assert r.returncode == 0 and "resuming at step 2" in r.stderr, r.stderr[-3000:]
    assert steps_of(run) == [0, 1, 2]


def test_run_of_a_plan_writes_into_a_new_timestamped_folder_not_the_plan(cli, cnn_plan, tmp_path):
    r = fusion(cli, "run", cnn_plan, "--steps", "1", "--no-progress", "--data", "synthetic", cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    runs = list((tmp_path / "runs").iterdir())
    assert len(runs) == 1 and runs[0].name.startswith("cnn-") and steps_of(runs[0]) == [0]
    assert sorted(p.name for p in cnn_plan.iterdir()) == ["plan.json", "weights.safetensors"]


def test_compile_refuses_to_write_into_an_unrelated_folder(cli, tmp_path):
    (tmp_path / "model.py").write_text(CNN)
    other = tmp_path / "photos"
    other.mkdir()
    (other / "cat.jpg").write_bytes(b"x")
    r = fusion(cli, "compile", f"{tmp_path / 'model.py'}:cnn", "--cluster", LOCAL, "-o", other)
    assert "not a plan and not empty" in one_line_error(r, "compile")
    assert sorted(p.name for p in other.iterdir()) == ["cat.jpg"]
    # a plan folder is replaced only with --force (issue 26: it was overwritten silently)
    plan = tmp_path / "p.plan"
    r = fusion(cli, "compile", f"{tmp_path / 'model.py'}:cnn", "--cluster", LOCAL, "-o", plan)
    assert r.returncode == 0, r.stderr
    before = (plan / "plan.json").read_bytes()
    r = fusion(cli, "compile", f"{tmp_path / 'model.py'}:cnn", "--cluster", LOCAL, "-o", plan, "--lr", "0.5")
    assert "holds a plan already; give --force" in one_line_error(r, "compile")
    assert (plan / "plan.json").read_bytes() == before
    r = fusion(cli, "compile", f"{tmp_path / 'model.py'}:cnn", "--cluster", LOCAL, "-o", plan, "--lr", "0.5", "--force")
    assert r.returncode == 0, r.stderr
    assert (plan / "plan.json").read_bytes() != before


# -- user errors: one line, exit 2 ----------------------------------------------------------------

@pytest.mark.parametrize("steps", ["-1", "0", "ten"])
def test_steps_must_be_positive(cli, tmp_path, steps):
    r = fusion(cli, "run", "examples/models/gpt.py:tiny", "--cluster", LOCAL, "--steps", steps, "--out", tmp_path / "o")
    assert "--steps" in one_line_error(r, "run")
    assert not (tmp_path / "o").exists()


def test_a_model_that_raises_is_one_line_naming_the_line(cli, tmp_path):
    (tmp_path / "model.py").write_text(CNN)
    r = fusion(cli, "compile", f"{tmp_path / 'model.py'}:broken", "--cluster", LOCAL, "-o", tmp_path / "p")
    line = one_line_error(r, "compile")
    assert "broken() raised ValueError: width 3 is not a multiple of 4 (model.py:16)" in line, line


def test_addresses_must_say_tcp(cli, tmp_path, cnn_plan):
    r = fusion(cli, "coordinator", cnn_plan, "--bind", "localhost:5600", "--out", tmp_path / "o")
    assert "expected tcp://HOST:PORT" in one_line_error(r, "coordinator")
    r = fusion(cli, "executor", cnn_plan, "--node", "part0", "--coordinator", "10.0.0.1:5600")
    assert "expected tcp://HOST:PORT" in one_line_error(r, "executor")


def test_executor_with_an_unknown_part_names_the_parts(cli, cnn_plan):
    r = fusion(cli, "executor", cnn_plan, "--node", "p0", "--coordinator", "tcp://127.0.0.1:5600")
    assert "no part 'p0' (parts: part0, part1)" in one_line_error(r, "executor")


def test_executor_whose_port_is_taken_says_so_in_one_line(cli, cnn_plan):
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    port = s.getsockname()[1]
    try:
        r = fusion(cli, "executor", cnn_plan, "--node", "part0", "--coordinator", "tcp://127.0.0.1:1",
                   "--bind", f"tcp://127.0.0.1:{port}", "--insecure", timeout=60)
    finally:
        s.close()
    line = one_line_error(r, "executor")
    assert f"cannot bind tcp://127.0.0.1:{port}" in line and "in use" in line, line


def test_executor_checks_its_weights_before_listening(cli, cnn_plan, tmp_path):
    bad = tmp_path / "bad.plan"
    shutil.copytree(cnn_plan, bad)
    w = bad / "weights.safetensors"
    w.write_bytes(w.read_bytes()[:-40])  # truncated
    r = fusion(cli, "executor", bad, "--node", "part0", "--coordinator", "tcp://127.0.0.1:1",
               "--bind", "tcp://127.0.0.1:*",
               "--insecure", "--startup-timeout", "60", timeout=60)
    assert "weights.safetensors" in one_line_error(r, "executor")


def test_executor_without_a_coordinator_says_what_it_waits_for_and_gives_up(cli, cnn_plan):
    """No coordinator ever appears: the executor logs what it waits for, then stops with a one-line reason
    within its --startup-timeout (it used to wait in silence)."""
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    t0 = time.monotonic()
    r = fusion(cli, "executor", cnn_plan, "--node", "part1", "--coordinator", f"tcp://127.0.0.1:{port}",
               "--bind", "tcp://127.0.0.1:*", "--insecure", "--startup-timeout", "3", timeout=90)
    took = time.monotonic() - t0
    assert r.returncode == 1, r.stderr
    assert "part1: said hello to the coordinator at" in r.stderr and "waiting for its setup" in r.stderr
    stop = [x for x in r.stderr.splitlines() if "stopping" in x]
    assert len(stop) == 1 and f"no answer from the coordinator at tcp://127.0.0.1:{port} within 3 s" in stop[0], r.stderr
    assert "Traceback" not in r.stderr
    assert took < 40, took  # 3 s of waiting plus interpreter and plan start-up on a loaded 2-core host


def test_long_engine_refusal_is_summarised(cli, tmp_path):
    """A part full of ops its engine lacks: the count, the ops and a few names, on one short line."""
    (tmp_path / "many.py").write_text('''
import torch
import fusion
from fusion.ir.builder import GraphBuilder

@fusion.register_function("many.wiggle")
def wiggle(x):
    return x * 1.5

def model():
    b = GraphBuilder()
    x, y = b.input("x"), b.label("y")
    h = x
    for i in range(40):
        h = b.function(f"w{i}", wiggle, h)
    o = b.module("fc", "torch.nn.Linear", h, in_features=4, out_features=3)
    b.loss("loss", "torch.nn.functional.cross_entropy", o, y)
    return b.build(example={"x": torch.randn(2, 4), "y": torch.randint(0, 3, (2,))}, seed=0)
''')
    r = fusion(cli, "compile", f"{tmp_path / 'many.py'}:model", "--cluster", LOCAL, "--engine", "numpy",
               "-o", tmp_path / "p")
    line = one_line_error(r, "compile")
    assert "40 node(s) placed on an engine that lacks their op (1 op(s))" in line, line
    assert "node 'w0', node 'w1', node 'w2', ... (40 nodes)" in line and "w39" not in line
    assert len(line) < 400, len(line)


# -- flags ------------------------------------------------------------------------------------------

def test_verbose_after_the_command(cli, tmp_path):
    r = fusion(cli, "graph", "examples/models/gpt.py:tiny", "-v")
    assert r.returncode == 0 and " INFO " in r.stderr, r.stderr[-2000:]
    r = fusion(cli, "graph", "examples/models/gpt.py:tiny")
    assert r.returncode == 0 and " INFO " not in r.stderr


def test_help_shows_defaults_and_one_micro_batches_default():
    from fusion.cli import build_parser

    p = build_parser()
    sub = next(a for a in p._actions if isinstance(a, __import__("argparse")._SubParsersAction))
    for name in ("compile", "run"):
        assert "n_b: micro-batches per iteration (default: 4)" in " ".join(sub.choices[name].format_help().split())
    h = " ".join(sub.choices["executor"].format_help().split())
    assert "--node PART" in h and "--coordinator ADDR" in h and "(default: 10.0)" in h and "(default: 120.0)" in h
    assert "part0, part1" in h
    assert sub.choices["compile"].get_default("micro_batches") == sub.choices["run"].get_default("micro_batches") == 4


@pytest.mark.parametrize("argv, line", [
    (["run", "x.plan", "--batch-size", "8"],
     "fusion run: error: unrecognized arguments: --batch-size 8 (did you mean --global-batch?)"),
    (["run", "x.plan", "--stepz=3"], "fusion run: error: unrecognized arguments: --stepz=3 (did you mean --steps?)"),
    (["graph", "m.py:f", "--qqqq"], "fusion graph: error: unrecognized arguments: --qqqq (see"),
    (["--bogus-top"], "fusion: error: unrecognized arguments: --bogus-top"),
    (["run", "m.py:f", "--seed", "-1"], "fusion run: error: argument --seed: must be 0 to 4294967295, got -1"),
    (["compile", "m.py:f", "--seed", "4294967296"], "fusion compile: error: argument --seed: must be 0 to"),
])
def test_a_bad_option_is_one_line_from_its_command_before_any_work(capsys, argv, line):
    from fusion.cli import main

    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith(line) and err.count("\n") == 1, err


@pytest.mark.parametrize("extra, line", [
    (["--data", "text:no/such/corpus.txt"], "fusion run: error: --data text:no/such/corpus.txt: no such file or folder"),
    (["--data", "no_such_data.py:batches"], "fusion run: error: --data no_such_data.py:batches: no such file"),
    (["--val-split", "10"], "fusion run: error: --val-split 10 holds out part of --data text:PATH, but --data is auto"),
    (["--data", "synthetic", "--val-split", "5"], "fusion run: error: --val-split 5 holds out part of --data text:PATH"),
])
def test_data_options_are_checked_before_the_compile(capsys, tmp_path, extra, line):
    """A missing data file or an ignored --val-split is one line at once, before any trace or compile (the model
    file does not even exist here: nothing was imported)."""
    from fusion.cli import main

    assert main(["run", str(tmp_path / "never_read.py:model"), "--cluster", "c.yaml", *extra]) == 2
    err = capsys.readouterr().err
    assert err.startswith(line) and err.count("\n") == 1, err


# -- clusters ---------------------------------------------------------------------------------------

def test_bandwidth_round_trips_as_written(cli, tmp_path):
    from fusion.cluster import Cluster, load_cluster
    from fusion.cluster.units import format_bandwidth

    c = load_cluster(LOCAL)
    d = c.to_dict()
    assert d["bandwidth_bps"][0][1] == 1e9 and d["bandwidth_bps"][0][2] == 20e6  # 1 Gbit/s, 20 Mbit/s exactly
    again = Cluster.from_dict(json.loads(json.dumps(d)))
    assert again.to_dict()["bandwidth_bps"] == d["bandwidth_bps"]
    assert c.bandwidth_bps(0, 1) == 1e9
    assert [format_bandwidth(b) for b in (1e9, 20e6, 999.5e6, 1.5e3, 12)] == \
        ["1 Gbit/s", "20 Mbit/s", "999.5 Mbit/s", "1.5 kbit/s", "12 bit/s"]
    # and what `fusion inspect` prints for the 1 Gbit/s link
    r = fusion(cli, "compile", "examples/models/gpt.py:tiny", "--cluster", LOCAL, "--strategy", "equal-flops",
               "-o", tmp_path / "t.plan")
    assert r.returncode == 0, r.stderr
    r = fusion(cli, "inspect", tmp_path / "t.plan", "--no-png")
    assert "1 Gbit/s" in r.stdout and "1e+03" not in r.stdout and "20 Mbit/s" in r.stdout, r.stdout


@pytest.mark.parametrize("text,where,words", [
    ("name: x\ndevices:\n  - {name: a, peak_flops: 1 TFLOPS, memory: 4 GB\nlinks: {}\n", ":4:6:", "not valid YAML"),
    ("name: x\ndevices:\n  - {name: a, peak_flops: 1 TFLOPS, memory: 4 GB}\n  - name: b\n    peak_flops: 5 furlongs\n"
     "    memory: 4 GB\nlinks:\n  default: {latency: 1 ms, bandwidth: 1 Gbit/s}\n", ":5:17:", "unknown unit 'furlongs'"),
    ("name: x\ndevices:\n  - {name: a, count: 2, peak_flops: 1 TFLOPS, memory: 4 GB}\nlinks:\n"
     "  default: {latency: 1 ms}\n", ":5:12:", "missing field 'bandwidth'"),
])
def test_yaml_errors_give_line_and_column(cli, tmp_path, text, where, words):
    f = tmp_path / "c.yaml"
    f.write_text(text)
    r = fusion(cli, "compile", "examples/models/gpt.py:tiny", "--cluster", f, "-o", tmp_path / "p")
    line = one_line_error(r, "compile")
    assert f"{f}{where}" in line and words in line, line


# -- graph ------------------------------------------------------------------------------------------

def test_graph_prints_a_header_and_the_edges(cli):
    r = fusion(cli, "graph", "examples/cnn_fig7.py:model")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].startswith("examples/cnn_fig7.py:model: 10 nodes, 9 edges")
    assert lines[1].split()[:4] == ["node", "kind", "op", "output"] and "inputs" in lines[1]
    loss = next(x for x in lines if x.startswith("loss "))
    assert loss.rstrip().endswith("fc, y")


# -- plan.png -----------------------------------------------------------------------------------------

def _png_stats(path):
    import matplotlib.image as mpimg
    import numpy as np

    img = mpimg.imread(str(path))[..., :3]
    ink = (img < 0.97).any(axis=2)
    h, w = ink.shape
    # the widest stretch of columns with no ink at all (a panel left empty)
    empty, run = 0, 0
    for col in ink.any(axis=0):
        run = 0 if col else run + 1
        empty = max(empty, run)
    return w, h, empty / w


@pytest.mark.parametrize("n_layers,strategy,cluster,labelled", [
    (None, "equal-count", LOCAL, True),                           # the Figure 7 CNN: 10 nodes
    (120, "opfence", "fusionllm-48", False),                      # a 120-block GPT on the meta device: ~970 nodes
])
def test_plan_png_is_readable_small_and_large(cli, tmp_path, n_layers, strategy, cluster, labelled):
    from fusion.inspect import dag_layout, draw_plan, part_colors
    from fusion.plan import load_plan

    if n_layers is None:
        spec = "examples/cnn_fig7.py:model"
    else:
        (tmp_path / "big.py").write_text(
            "from tests.testing_models import gpt_model\n\n"
            f"def model():\n    return gpt_model({n_layers}, 64, 4, 128, 16, 1, device='meta')\n")
        spec = f"{tmp_path / 'big.py'}:model"
    r = fusion(cli, "compile", spec, "--cluster", cluster, "--strategy", strategy, "-o", tmp_path / "p.plan")
    assert r.returncode == 0, r.stderr
    plan = load_plan(tmp_path / "p.plan")
    png = draw_plan(plan, tmp_path / "plan.png")
    w, h, empty = _png_stats(png)
    assert 800 <= w <= 4500 and 400 <= h <= 3000, (w, h)
    assert empty < 0.2, f"{empty:.0%} of the picture's width is blank"
    # a layered layout: every edge goes down (to a later layer), no two nodes share a place
    xy, _, _ = dag_layout(plan.graph)
    assert len(set(xy.values())) == len(xy) == len(plan.graph.nodes) and (len(xy) > 900) == (not labelled)
    # part colours differ clearly (the old tab20 gave part0 and part1 two near-identical blues)
    import colorsys

    import numpy as np
    cs = np.array(part_colors(10))
    dist = np.sqrt(((cs[:, None, :] - cs[None, :, :]) ** 2).sum(-1)) + np.eye(10) * 9
    assert dist.min() > 0.2, dist.min()
    hues = [colorsys.rgb_to_hsv(*c)[0] for c in part_colors(4)]
    assert min(min(abs(a - b), 1 - abs(a - b)) for i, a in enumerate(hues) for b in hues[i + 1:]) > 0.05, hues
    assert len({tuple(c) for c in part_colors(40)}) == 40


def test_ctrl_c_still_writes_weights_plot_and_trace(cnn_plan, tmp_path):
    import os
    import signal

    run = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "fusion.cli", "run", str(cnn_plan), "--out", str(run), "--steps",
                             "100000", "--no-progress", "--data", "synthetic"], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=sigint_default)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:
            m = run / "metrics.jsonl"
            if m.exists() and len(m.read_text().splitlines()) >= 3:
                break
            time.sleep(0.2)
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        proc.send_signal(signal.SIGINT)  # what Ctrl-C sends to the foreground process
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err[-3000:]
    assert "interrupted after" in err and "Traceback" not in err, err[-3000:]
    assert "no checkpoints were written (--checkpoint-every 0), so this run cannot be resumed" in err
    n = len(steps_of(run))
    assert n >= 3 and (run / "final.safetensors").exists() and (run / "loss.png").exists()
    merged = json.loads((run / "trace.json").read_text())["traceEvents"]
    assert any(e.get("cat") == "forward" for e in merged)  # the executors were stopped cleanly and wrote traces
    assert sorted(p.name for p in (run / "trace").iterdir()) == ["part0.json", "part1.json"]


def test_run_quotes_the_reason_an_executor_failed_at_start_up(cli, cnn_plan, tmp_path):
    """An executor that fails at start-up (here: a truncated weights file) used to be reported as only "exited with
    status 2", its reason left in logs/ (issue 28); fusion run now quotes the executor's own error line."""
    bad = tmp_path / "bad.plan"
    shutil.copytree(cnn_plan, bad)
    w = bad / "weights.safetensors"
    w.write_bytes(w.read_bytes()[:-40])  # truncated
    r = fusion(cli, "run", bad, "--out", tmp_path / "run", "--steps", "2", "--no-progress", "--data", "synthetic",
               timeout=240)
    assert r.returncode == 2, r.stderr[-2000:]
    line = r.stderr.strip().splitlines()[-1]  # after the start-up lines: the one error line
    assert line.startswith("fusion run: error:") and "exited with status 2" in line and "weights.safetensors" in line and "logs" in line, line


def test_a_mistyped_plan_folder_is_named_as_such(cli, tmp_path):
    r = fusion(cli, "run", tmp_path / "no-such.plan", "--steps", "1")
    line = one_line_error(r, "run")
    assert "not a plan folder" in line and "no-such.plan" in line, line
