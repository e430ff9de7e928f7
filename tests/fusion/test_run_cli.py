"""`fusion run` on a MODEL (compiled first) and its error messages.

Each `fusion` command runs in a process of its own forked from one that has imported torch once
(tests/fusion/forked_cli.py; the session's `cli` fixture of tests/fusion/conftest.py): the argv, folder, output and exit status of `python -m fusion.cli`."""
import json
import re
from pathlib import Path

import numpy as np
import pytest

from fusion.cluster.scenarios import load_scenario
from tests.fusion.cli_helpers import CNN_SRC

MODEL_SRC = CNN_SRC


def _fusion(cli, *args, timeout=120, cwd=None):
    return cli.run(list(args), Path.cwd() if cwd is None else cwd, timeout)


def test_missing_plan_or_model_is_a_one_line_error(cli, tmp_path):
    r = _fusion(cli, "run", str(tmp_path / "nope.py:fn"), "--cluster", "x.json", "--out", str(tmp_path / "o"))
    assert r.returncode == 2 and r.stderr.startswith("fusion run: error:")
    r = _fusion(cli, "run", str(tmp_path / "model.py:fn"), "--out", str(tmp_path / "o"))
    assert r.returncode == 2 and "--cluster" in r.stderr


def _run_model(cli, tmp_path, *args):
    """``fusion run`` of MODEL_SRC's cnn on the two-site scenario into ``tmp_path/run``."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "model.py").write_text(MODEL_SRC)
    cluster = tmp_path / "cluster.json"
    cluster.write_text(json.dumps(load_scenario("local-4-two-sites").to_dict()))
    out = tmp_path / "run"
    r = _fusion(cli, "run", f"{tmp_path / 'model.py'}:cnn", "--cluster", str(cluster), "--out", str(out),
                "--no-progress", *args, timeout=240)
    return r, out


def test_run_compiles_a_model_then_trains_it(cli, tmp_path):
    r, out = _run_model(cli, tmp_path, "--steps", "2", "--micro-batches", "2")
    assert r.returncode == 0, r.stderr[-3000:]
    assert (out / "plan" / "plan.json").exists() and (out / "final.safetensors").exists()
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 2
    assert json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])["loss"] > 0


REPO = Path(__file__).resolve().parents[2]


def test_readme_main_job_gpt_on_four_compnodes(cli, tmp_path):
    """The README main job (fewer steps): the traced tiny GPT compiled with equal-flops onto all
    four CPUs of local-4-two-sites, trained on the generated corpus, with progress bar, metrics and traces."""
    out = tmp_path / "run"
    r = _fusion(cli, "run", "examples/models/gpt.py:tiny", "--cluster", "examples/clusters/local-4-two-sites.yaml",
                "--strategy", "equal-flops", "--steps", "4", "--out", str(out), timeout=240, cwd=REPO)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "train:" in r.stderr and "4/4" in r.stderr  # the tqdm progress bar
    # stderr is no terminal: the step log's last line, on a line of its own (not glued to the bar's)
    assert re.search(r"(^|[\r\n])step 4/4 loss \d", r.stderr), r.stderr[-2000:]
    plan = json.loads((out / "plan" / "plan.json").read_text())
    assert plan["strategy"] == "equal-flops"
    assert sorted(p["device"] for p in plan["parts"].values()) == ["cpu-0", "cpu-1", "cpu-2", "cpu-3"]
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [0, 1, 2, 3]
    assert all(set(m["parts"]) == set(plan["parts"]) for m in lines)
    for part in plan["parts"]:
        events = json.loads((out / "trace" / f"{part}.json").read_text())
        events = events["traceEvents"] if isinstance(events, dict) else events
        assert any(e.get("name", "").startswith(("forward", "F")) for e in events)
    # trained on the generated text corpus (character-level: the corpus has fewer characters than the vocab)
    from fusion.data.batches import corpus_text, make_batches
    from fusion.plan import load_plan
    batches = make_batches(load_plan(out / "plan"))
    text = batches.tokenizer.decode(batches(0)["idx"][0])
    assert batches.tokenizer.chars and text in corpus_text()
    assert lines[-1]["loss"] < lines[0]["loss"]


def test_run_rejects_an_unknown_strategy(cli, tmp_path):
    r = _fusion(cli, "run", "examples/models/gpt.py:tiny", "--cluster", "x.yaml", "--strategy", "bogus",
                "--out", str(tmp_path / "o"))
    assert r.returncode == 2 and "--strategy" in r.stderr


DATA_SRC = '''
import numpy as np

def templates(step):
    """Two fixed class templates plus noise: learnable, a pure function of the step."""
    g = np.random.default_rng(step)
    y = g.integers(0, 2, 8)
    t = np.random.default_rng(99).standard_normal((2, 3, 6, 6)).astype(np.float32)
    return {"x": t[y] + 0.1 * g.standard_normal((8, 3, 6, 6)).astype(np.float32), "y": y}

def bad(step):
    return {"x": np.zeros((8, 3, 6, 6), np.float32), "y": np.zeros((7,), np.int64)}
'''


def test_run_trains_on_the_users_data_function(cli, tmp_path):
    """--data file.py:function: the CompNodes train on the user's batches, exactly as the in-process reference does."""
    from fusion.plan import OptimizerConfig
    from fusion.executors.reference import ReferenceExecutor
    from fusion.loader import load_function, load_model
    from fusion.plan import load_plan

    (tmp_path / "data.py").write_text(DATA_SRC)
    r, out = _run_model(cli, tmp_path, "--steps", "4", "--micro-batches", "4", "--strategy", "equal-count",
                        "--data", f"{tmp_path / 'data.py'}:templates")
    assert r.returncode == 0, r.stderr[-3000:]
    losses = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    plan = load_plan(out / "plan")
    assert len(plan.parts) > 1
    ref = ReferenceExecutor(load_model(f"{tmp_path / 'model.py'}:cnn"), plan.assignment,
                            OptimizerConfig(**plan.optimizer), micro_batches=plan.micro_batches)
    templates = load_function(f"{tmp_path / 'data.py'}:templates")
    want = [ref.step(templates(s)).loss for s in range(4)]
    np.testing.assert_allclose(losses, want, rtol=1e-5)

    r = _fusion(cli, "run", str(out / "plan"), "--out", str(tmp_path / "bad"), "--steps", "1",
                "--data", f"{tmp_path / 'data.py'}:bad", "--no-progress")
    assert r.returncode == 2 and "field 'y' has shape [7], the plan expects [8]" in r.stderr, r.stderr


LOADER_SRC = '''
import numpy as np
import torch
from torch.utils.data import DataLoader, TensorDataset

g = np.random.default_rng(5)
Y = g.integers(0, 5, 12)
X = (np.random.default_rng(99).standard_normal((5, 3, 6, 6))[Y] + 0.1 * g.standard_normal((12, 3, 6, 6))).astype(np.float32)


def loader():
    """12 samples in DataLoader batches of 2: a step of 4 rows takes two of them."""
    return DataLoader(TensorDataset(torch.from_numpy(X), torch.from_numpy(Y)), batch_size=2)


def by_step(step):
    i = (step % 3) * 4
    return {"x": X[i:i + 4], "y": Y[i:i + 4]}
'''


def test_run_trains_on_a_dataloader_as_on_the_same_step_function(cli, tmp_path):
    """--data file.py:fn returning a torch DataLoader (tuples of a TensorDataset, batches of 2 filling a global batch
    of 4): a 2-part, 3-step run gives the losses of the same steps from the equivalent step function, in plain PyTorch."""
    from fusion.data.batches import make_batches
    from fusion.executors.reference import ReferenceExecutor
    from fusion.loader import load_model
    from fusion.plan import OptimizerConfig, load_plan

    (tmp_path / "model.py").write_text(MODEL_SRC)
    (tmp_path / "data.py").write_text(LOADER_SRC)
    cluster = tmp_path / "two.yaml"
    cluster.write_text("name: two\ndevices:\n"
                       "  - {name: cpu-0, peak_flops: 50 GFLOPS, memory: 4 GB}\n"
                       "  - {name: cpu-1, peak_flops: 50 GFLOPS, memory: 4 GB}\n"
                       "links:\n  default: {latency: 1 ms, bandwidth: 1 Gbit/s}\n")
    out = tmp_path / "run"
    r = _fusion(cli, "run", f"{tmp_path / 'model.py'}:cnn", "--cluster", str(cluster), "--out", str(out),
                "--no-progress", "--steps", "3", "--micro-batches", "2", "--strategy", "equal-count",
                "--data", f"{tmp_path / 'data.py'}:loader", timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    losses = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    plan = load_plan(out / "plan")
    assert len(plan.parts) == 2 and len(losses) == 3
    ref = ReferenceExecutor(load_model(f"{tmp_path / 'model.py'}:cnn"), plan.assignment,
                            OptimizerConfig(**plan.optimizer), micro_batches=plan.micro_batches)
    by_step = make_batches(plan, f"{tmp_path / 'data.py'}:by_step")
    np.testing.assert_allclose(losses, [ref.step(by_step(s)).loss for s in range(3)], rtol=1e-5)


def test_run_compiles_with_the_optimizer_and_compression_options(cli, tmp_path):
    """`fusion run MODEL` takes the same compile options as `fusion compile`; a PLAN refuses them."""
    from fusion.plan import load_plan

    r, out = _run_model(cli, tmp_path, "--steps", "1", "--micro-batches", "2", "--strategy", "equal-count",
                        "--optimizer", "adamw", "--lr", "0.003", "--weight-decay", "0.1", "--compress-ratio", "10",
                        "--schedule", "1f1b", "--seed", "7")
    assert r.returncode == 0, r.stderr[-3000:]
    plan = load_plan(out / "plan")
    assert plan.optimizer["name"] == "adamw" and plan.optimizer["lr"] == 0.003 and plan.optimizer["weight_decay"] == 0.1
    assert plan.schedule == "1f1b" and plan.seed == 7 and plan.micro_batches == 2 and plan.compression
    r = _fusion(cli, "run", str(out / "plan"), "--out", str(tmp_path / "again"), "--lr", "0.1", "--schedule", "gpipe")
    assert r.returncode == 2 and "--lr" in r.stderr and "only apply when compiling a MODEL" in r.stderr, r.stderr


def test_bfloat16_gpt_trains_on_four_compnodes_and_saves_bfloat16(cli, tmp_path):
    """`fusion run examples/models/gpt.py:tiny_bf16`: bf16 weights, activations and gradients across
    four processes; the loss falls and final.safetensors holds bfloat16 tensors torch can load."""
    import torch
    from safetensors.torch import load_file

    out = tmp_path / "run"
    r = _fusion(cli, "run", "examples/models/gpt.py:tiny_bf16", "--cluster", "examples/clusters/local-4-two-sites.yaml",
                "--strategy", "equal-flops", "--steps", "12", "--optimizer", "adamw", "--lr", "0.01", "--out", str(out),
                "--no-progress", timeout=240, cwd=REPO)
    assert r.returncode == 0, r.stderr[-3000:]
    losses = [json.loads(x)["loss"] for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert np.isfinite(losses).all() and np.mean(losses[-3:]) < losses[0] - 0.3, losses
    final = load_file(str(out / "final.safetensors"))
    assert final and all(t.dtype == torch.bfloat16 for t in final.values())


def _losses(out):
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_device_and_part_flags_reach_every_compnode(cli, tmp_path):
    """``--device cpu --interpreted-parts`` is passed to each executor: they log it, and losses equal the default run."""
    a, out_a = _run_model(cli, tmp_path / "a", "--steps", "2")
    b, out_b = _run_model(cli, tmp_path / "b", "--steps", "2", "--device", "cpu", "--interpreted-parts")
    assert a.returncode == 0 and b.returncode == 0, (a.stderr[-2000:], b.stderr[-2000:])
    assert np.allclose(_losses(out_a), _losses(out_b), rtol=1e-6, atol=0)
    logs = [p.read_text() for p in sorted((out_b / "logs").glob("*.log"))]
    assert logs and all("engine on cpu, compiled=False" in log for log in logs), logs[0][-2000:]


def test_a_device_this_host_lacks_is_one_line_before_anything_starts(cli, tmp_path):
    import torch

    cases = ["tpu9", "cuda:x"] + ([] if torch.cuda.is_available() else ["cuda:0"]) + \
        (["cuda:%d" % torch.cuda.device_count()] if torch.cuda.is_available() else [])
    for dev in cases:
        r, out = _run_model(cli, tmp_path / dev.replace(":", "_"), "--steps", "1", "--device", dev)
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2 and len(lines) == 1 and dev in lines[0], r.stderr
        assert not out.exists()
    r = _fusion(cli, "executor", str(tmp_path / "noplan"), "--node", "part0", "--coordinator", "tcp://127.0.0.1:1",
                "--device", "tpu9")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "tpu9" in r.stderr, r.stderr


def test_run_passes_the_heap_mode_on_to_every_executor():
    """``fusion run --heap default`` reaches each ``fusion executor``; the default (steady) is the executor's own."""
    from fusion.options import parse

    assert parse(["run", "plan-dir", "--heap", "default"])[1].launch.executor_flags(False)[-2:] == ["--heap", "default"]
    assert "--heap" not in parse(["run", "plan-dir"])[1].launch.executor_flags(False)
    with pytest.raises(SystemExit):
        parse(["run", "plan-dir", "--heap", "tcmalloc"])
