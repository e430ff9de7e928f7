"""`fusion compile` / `fusion inspect` / `fusion profile` through the real CLI; bad input exits 2 with one line."""
import json
from pathlib import Path

import pytest

from fusion.cli import main
from fusion.plan import load_plan

ROOT = Path(__file__).resolve().parents[2]
LOCAL = str(ROOT / "examples" / "clusters" / "local-4-two-sites.yaml")

MODEL = '''
from tests.testing_models import gpt_model


def model():
    return gpt_model(2, 32, 4, 64, 8, 2, device="cpu")


def meta():
    return gpt_model(4, 64, 4, 128, 16, 2, device="meta")


def wrong():
    return 42
'''


@pytest.fixture()
def model_file(tmp_path):
    p = tmp_path / "mymodel.py"
    p.write_text(MODEL)
    return p


def _err(capsys):
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


def test_compile_then_inspect(tmp_path, model_file, capsys):
    out = tmp_path / "tiny.plan"
    rc = main(["compile", f"{model_file}:model", "--cluster", LOCAL, "--micro-batches", "2", "--compress-ratio", "10",
               "--optimizer", "adamw", "--lr", "1e-3", "-o", str(out)])
    assert rc == 0
    assert (out / "plan.json").is_file() and (out / "weights.safetensors").is_file()
    assert "wrote" in capsys.readouterr().out
    plan = load_plan(out)
    assert plan.optimizer["name"] == "adamw" and plan.micro_batches == 2
    assert main(["inspect", str(out)]) == 0
    text = capsys.readouterr().out
    assert "part0" in text and "cut edges" in text and "predicted iteration" in text
    png = out / "plan.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_compile_meta_model_writes_no_weights(tmp_path, model_file):
    out = tmp_path / "meta.plan"
    assert main(["compile", f"{model_file}:meta", "--cluster", LOCAL, "--strategy", "equal-flops", "-o", str(out)]) == 0
    assert (out / "plan.json").is_file() and not (out / "weights.safetensors").exists()
    assert load_plan(out).strategy == "equal-flops"


def _bad_cluster(tmp_path, text):
    p = tmp_path / "broken-cluster.yaml"
    p.write_text(text)
    return str(p)


DEV = "devices:\n  - {name: a, peak_flops: 1 TFLOPS, memory: 1 GB}\n  - {name: b, peak_flops: 1 TFLOPS, memory: 1 GB}\n"


@pytest.mark.parametrize("cluster_text, words", [
    (DEV, ["broken-cluster.yaml", "missing field 'links'"]),
    (DEV.replace("peak_flops: 1 TFLOPS, ", "", 1) + "links: {default: {latency: 1 ms, bandwidth: 1 Gbps}}\n",
     ["broken-cluster.yaml", "devices[0]", "peak_flops"]),
    (DEV + "links: {default: {latency: 1 ms, bandwidth: 0 Mbps}}\n", ["broken-cluster.yaml", "links.default.bandwidth", "> 0"]),
    (DEV + "links: {default: {latency: 1 ms, bandwidth: -3 Gbps}}\n", ["broken-cluster.yaml", "links.default.bandwidth"]),
    (DEV + "links: {default: {latency: 1 ms, bandwidth: 1 Gbps}, pairs: [{src: a, dst: gpu9, latency: 1 ms, bandwidth: 1 Gbps}]}\n",
     ["broken-cluster.yaml", "links.pairs[0].dst", "unknown device 'gpu9'"]),
    (DEV.replace("1 GB", "1 kB") + "links: {default: {latency: 1 ms, bandwidth: 1 Gbps}}\n",
     ["broken-cluster.yaml", "memory_bytes", "needs"]),
])
def test_bad_cluster_files_exit_2(tmp_path, model_file, capsys, cluster_text, words):
    rc = main(["compile", f"{model_file}:model", "--cluster", _bad_cluster(tmp_path, cluster_text), "-o", str(tmp_path / "x")])
    assert rc == 2
    err = _err(capsys)
    for w in words:
        assert w in err, err
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("spec, words", [
    ("{file}:nope", ["mymodel.py", "no function 'nope'"]),
    ("{dir}/missing.py:model", ["missing.py", "no such file"]),
    ("{file}", ["expected file.py:function"]),
    ("{file}:wrong", ["wrong()", "returned int"]),
])
def test_bad_model_specs_exit_2(tmp_path, model_file, capsys, spec, words):
    spec = spec.format(file=model_file, dir=tmp_path)
    rc = main(["compile", spec, "--cluster", LOCAL, "-o", str(tmp_path / "x")])
    assert rc == 2
    err = _err(capsys)
    for w in words:
        assert w in err, err


def test_inspect_bad_plan_exits_2(tmp_path, capsys):
    (tmp_path / "plan.json").write_text(json.dumps({"format": "something-else"}))
    assert main(["inspect", str(tmp_path)]) == 2
    assert "plan.json" in _err(capsys)


def test_subprocess_exit_status_and_one_line(cli, tmp_path, model_file):
    bad = _bad_cluster(tmp_path, DEV + "links: {default: {latency: 1 ms, bandwidth: 0 Mbps}}\n")
    r = cli.run(["compile", f"{model_file}:model", "--cluster", bad, "-o", str(tmp_path / "x")], Path.cwd(), 120)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "broken-cluster.yaml" in lines[0] and "bandwidth" in lines[0], r.stderr


def test_profile_writes_lambda_into_a_cluster_copy(tmp_path, capsys):
    out = tmp_path / "profiled.json"
    rc = main(["profile", "--cluster", LOCAL, "--name", "cpu-1", "--sizes", "256,512,1024",
               "--threads", "1", "-o", str(out)])
    assert rc == 0
    result = json.loads(capsys.readouterr().out.splitlines()[0])
    assert result["lambda"] > 0 and result["peak_flops"] == 50e9 and len(result["samples"]) == 3
    data = json.loads(out.read_text())
    assert data["devices"][1]["lambda"] == pytest.approx(result["lambda"])
    assert "lambda" not in data["devices"][0]
    # the fitted fixed costs go with lambda (compiled parts' per-node cost by default); other devices keep none
    assert result["node_overhead_s"] > 0 and result["message_overhead_s"] > 0
    assert data["devices"][1]["node_overhead_s"] == pytest.approx(result["node_overhead_s"])
    assert data["devices"][1]["message_overhead_s"] == pytest.approx(result["message_overhead_s"])
    assert "node_overhead_s" not in data["devices"][0]
    # and the iteration's work outside the pipeline (fusion.cost.estimate's T_step)
    for key in ("step_overhead_s", "feed_overhead_s", "feed_byte_s"):
        assert data["devices"][1].get(key, 0.0) == pytest.approx(result[key]) and key not in data["devices"][0]
    assert all(v > 0 for v in result["optimizer_byte_s"].values())
    assert data["devices"][1]["optimizer_byte_s"] == pytest.approx(result["optimizer_byte_s"])
    # and what each codec the compiler may choose costs here (issue 36: the estimator's codec price)
    assert {"quant-4", "quant-8", "hadamard-quant-4", "topk"} <= set(result["codec_costs"])
    assert all(data["devices"][1]["codec_costs"][k] == pytest.approx(v) for k, v in result["codec_costs"].items())
    assert "codec_costs" not in data["devices"][0]
    # without a peak (the README's `fusion profile --threads 1`): the measured speed, and what lambda needs
    assert main(["profile", "--threads", "1", "--sizes", "256,512"]) == 0
    cap = capsys.readouterr()
    result = json.loads(cap.out.splitlines()[0])
    assert result["fitted_flops"] > 0 and result["lambda"] is None and "--peak-flops" in cap.err


def test_profile_writes_the_users_yaml_back_as_yaml(tmp_path, capsys):
    """-o x.yaml keeps the user's readable format and units (a `count` entry is split to hold one lambda)."""
    import yaml
    from fusion.cluster import load_cluster

    out = tmp_path / "profiled.yaml"
    assert main(["profile", "--cluster", LOCAL, "--name", "cpu-1", "--sizes", "256,512", "--threads", "1",
                 "-o", str(out)]) == 0
    result = json.loads(capsys.readouterr().out.splitlines()[0])
    lam = result["lambda"]
    text = out.read_text()
    assert "Mbit/s" in text and "bandwidth_bps" not in text, text
    data = yaml.safe_load(text)
    assert [d["name"] for d in data["devices"]][:2] == ["cpu-0", "cpu-1"]
    before, after = load_cluster(LOCAL), load_cluster(out)
    assert after.devices[1].lam == pytest.approx(lam, rel=1e-5) and after.devices[0].lam == 1.0
    assert after.devices[1].node_overhead_s == pytest.approx(result["node_overhead_s"], rel=1e-3)
    assert after.devices[1].message_overhead_s == pytest.approx(result["message_overhead_s"], rel=1e-3)
    assert after.devices[0].node_overhead_s == 0.0
    assert after.devices[1].feed_byte_s == pytest.approx(result["feed_byte_s"], rel=1e-3)
    assert after.devices[1].optimizer_byte_s == pytest.approx(tuple(result["optimizer_byte_s"].values()), rel=1e-3)
    assert after.devices[0].optimizer_byte_s == (0.0, 0.0, 0.0)
    q4 = result["codec_costs"]["quant-4"]
    assert after.devices[1].codec_seconds("quant-4", 65536) == pytest.approx(
        q4["message_s"] + 65536 * q4["byte_s"], rel=1e-3)
    assert after.devices[0].codec_costs == ()
    assert [d.group for d in after.devices] == [d.group for d in before.devices]
    assert after.to_dict()["bandwidth_bps"] == before.to_dict()["bandwidth_bps"]


@pytest.mark.parametrize("strategy", ["opfence", "equal-flops"])
def test_inspect_draws_every_layout_of_the_two_site_cluster(tmp_path, strategy):
    """Two Louvain clusters of two devices lie on one line; the picture must still render."""
    gpt = Path(__file__).resolve().parents[2] / "examples" / "models" / "gpt.py"
    out = tmp_path / f"{strategy}.plan"
    assert main(["compile", f"{gpt}:tiny", "--cluster", LOCAL, "--strategy", strategy, "--micro-batches", "4", "-o", str(out)]) == 0
    assert main(["inspect", str(out)]) == 0
    assert (out / "plan.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# -- engines per part (--engine), checked at compile time ----------------------------------------------

NUMPY_OK = '''
from tests.executors.opnode_models import opnode_model


def model():
    return opnode_model()
'''


def test_compile_assigns_engines_per_part(tmp_path, capsys):
    (tmp_path / "m.py").write_text(NUMPY_OK)
    out = tmp_path / "mixed.plan"
    rc = main(["compile", f"{tmp_path / 'm.py'}:model", "--cluster", LOCAL, "--strategy", "equal-count",
               "--engine", "numpy", "--engine", "part0=torch", "-o", str(out)])
    assert rc == 0
    parts = load_plan(out).parts
    assert len(parts) == 4
    assert {p: part.engine for p, part in parts.items()} == {"part0": "torch", "part1": "numpy", "part2": "numpy",
                                                              "part3": "numpy"}
    assert "part1=numpy" in capsys.readouterr().out


@pytest.mark.parametrize("engine_args,words", [
    (["--engine", "numpy"], ["node 'scaled_dot_product_attention'", "op torch.nn.functional.scaled_dot_product_attention",
                             "part 'part0'"]),
    (["--engine", "part7=numpy"], ["no part 'part7'", "part0"]),
    (["--engine", "jax"], ["unknown engine 'jax'", "numpy, torch"]),
])
def test_compile_rejects_engines_that_cannot_run_the_part(tmp_path, capsys, engine_args, words):
    rc = main(["compile", str(ROOT / "examples/models/gpt.py") + ":tiny", "--cluster", LOCAL, *engine_args,
               "-o", str(tmp_path / "p")])
    err = _err(capsys)
    assert rc == 2 and err.startswith("fusion compile: error:"), err
    for w in words:
        assert w in err, (w, err)
    assert not (tmp_path / "p").exists()


# -- fusion compile on the traced GPT and on an ONNX file ------------------------------------------

def test_compile_traced_gpt_example(tmp_path, capsys):
    import numpy as np
    from fusion.plan import load_weights

    out = tmp_path / "gpt.plan"
    rc = main(["compile", str(ROOT / "examples/models/gpt.py") + ":tiny", "--cluster", LOCAL, "--strategy", "equal-flops",
               "--micro-batches", "4", "-o", str(out)])
    assert rc == 0, capsys.readouterr().err
    plan = load_plan(out)
    assert len(plan.parts) == 4 and plan.predicted["iteration_s"] > 0
    w = load_weights(out / "weights.safetensors")
    assert w["transformer.wte.weight"].shape == (64, 32) and isinstance(w["transformer.wte.weight"], np.ndarray)
    assert "lm_head.weight" not in w  # tied: one parameter, held by two parts
    owners = {plan.assignment[n] for n in plan.graph.param_users()["transformer.wte.weight"]}
    assert owners == {"part0", "part3"}


def test_compile_onnx_file_with_numpy_weights(tmp_path, capsys):
    import numpy as np
    import torch
    from fusion.ir.onnx.importer import load_onnx
    from fusion.plan import load_weights
    from tests.ir.onnx_models import export

    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 5))
    path = export(mlp, (torch.randn(4, 8),), tmp_path / "mlp.onnx")
    model = load_onnx(path, loss="cross_entropy")
    assert model.params and all(isinstance(v, np.ndarray) for v in model.params.values())
    out = tmp_path / "onnx.plan"
    rc = main(["compile", f"{path}:cross_entropy", "--cluster", LOCAL, "--strategy", "equal-count",
               "--engine", "part1=numpy", "-o", str(out)])
    assert rc == 0, capsys.readouterr().err
    plan = load_plan(out)
    assert len(plan.parts) >= 2 and plan.parts["part1"].engine == "numpy"
    w = load_weights(out / "weights.safetensors")
    assert set(w) == set(model.params)
    for k, v in model.params.items():
        np.testing.assert_array_equal(w[k], v)


def test_profile_names_the_file_and_field_of_a_bad_step_cost(tmp_path, capsys):
    """A bad fitted cost in the cluster file stops `fusion profile` before it times anything: exit 2, one line."""
    from tests.fusion.cli_helpers import one_line

    bad = tmp_path / "bad-cluster.yaml"
    bad.write_text(Path(LOCAL).read_text().replace("memory: 4 GB, address: \"tcp://127.0.0.1:6101\"",
                                                   "memory: 4 GB, address: \"tcp://127.0.0.1:6101\", "
                                                   "optimizer_byte_s: {adamw: -1.0e-9}"))
    assert "optimizer_byte_s" in bad.read_text()
    assert main(["profile", "--cluster", str(bad), "--name", "cpu-1", "-o", str(tmp_path / "out.yaml")]) == 2
    err = one_line(capsys)
    assert "bad-cluster.yaml" in err and "optimizer_byte_s.adamw" in err and "cpu-1" in err, err
    assert not (tmp_path / "out.yaml").exists()


def test_inspect_into_a_closed_pipe_exits_quietly(tmp_path, model_file):
    """`fusion inspect PLAN | head -1`: the reader leaves before the table is written; no traceback, status 141."""
    import subprocess
    import sys

    out = tmp_path / "tiny.plan"
    assert main(["compile", f"{model_file}:model", "--cluster", LOCAL, "-o", str(out)]) == 0
    p = subprocess.Popen([sys.executable, "-m", "fusion.cli", "inspect", str(out)], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE)
    p.stdout.close()  # the reader is gone before anything is written
    err = p.stderr.read().decode()
    assert p.wait(timeout=120) == 141 and err == "", err
