"""compile_model -> plan file -> load_plan round trip; the compiled assignment trains like plain PyTorch."""
import json

import numpy as np
import pytest
import torch

from fusion.cluster import load_cluster
from fusion.compile import CompileError, compile_model
from fusion.plan import OptimizerConfig
from fusion.executors.reference import ReferenceExecutor
from fusion.plan import PlanError, load_plan, load_weights, save_plan
from tests.testing_models import gpt_model


def _cluster(tmp_path, memory="300 kB", n=6, far="5 Mbit/s"):
    p = tmp_path / "cluster.yaml"
    p.write_text(f"""name: tight
devices:
  - {{name: a, count: {n // 2}, peak_flops: 20 GFLOPS, memory: {memory}}}
  - {{name: b, count: {n - n // 2}, peak_flops: 20 GFLOPS, memory: {memory}}}
links:
  default: {{latency: 20 ms, bandwidth: {far}}}
  within_group: {{latency: 0.2 ms, bandwidth: 1 Gbit/s}}
""")
    return load_cluster(p)


@pytest.fixture(scope="module")
def tiny():
    return gpt_model(2, 32, 4, 64, 8, 2, device="cpu", seed=3)


def test_plan_round_trips_and_carries_everything(tmp_path, tiny):
    cluster = _cluster(tmp_path)
    plan = compile_model(tiny, cluster, micro_batches=2, compress_ratio=20, schedule="1f1b",
                         optimizer=OptimizerConfig("adamw", 1e-3), seed=7)
    assert len(plan.parts) >= 3  # 300 kB per device forces a split
    for name, part in plan.parts.items():
        assert part.memory_bytes <= 300e3 and part.device in {d.name for d in cluster.devices}
    assert plan.strategy == "opfence" and plan.schedule == "1f1b" and plan.micro_batches == 2 and plan.seed == 7
    assert plan.optimizer["name"] == "adamw"
    assert set(plan.boundaries) == set(plan.parts)
    assert plan.example == {"idx": {"shape": [2, 8], "dtype": "int64"}, "labels": {"shape": [2, 8], "dtype": "int64"}}
    pr = plan.predicted
    assert pr["iteration_s"] > 0 and set(pr["parts"]) == set(plan.parts) and pr["links"]
    assert pr["iteration_s"] <= pr["dense_iteration_s"]
    out = save_plan(plan, tmp_path / "p.plan", tiny.params)
    text = (out / "plan.json").read_text()
    assert "pickle" not in text
    back = load_plan(out)
    assert back.to_dict() == plan.to_dict()
    w = load_weights(out / "weights.safetensors")
    assert set(w) == set(tiny.params)
    for k, v in tiny.params.items():
        np.testing.assert_array_equal(w[k], v.numpy())


def test_compiled_assignment_trains_like_pytorch(tmp_path, tiny):
    plan = compile_model(tiny, _cluster(tmp_path, memory="150 kB"), micro_batches=2, schedule="1f1b")
    assert len(plan.parts) >= 3
    g = torch.Generator().manual_seed(0)
    batch = {"idx": torch.randint(0, 64, (4, 8), generator=g), "labels": torch.randint(0, 64, (4, 8), generator=g)}
    opt = OptimizerConfig("sgd", lr=0.05)
    whole = ReferenceExecutor(tiny, None, opt, micro_batches=2)
    parted = ReferenceExecutor(tiny, plan.assignment, opt, micro_batches=plan.micro_batches, schedule=plan.schedule)
    for _ in range(2):
        a, b = whole.step(batch), parted.step(batch)
        np.testing.assert_allclose(b.loss, a.loss, rtol=1e-5)
        for k in a.grads:
            np.testing.assert_allclose(b.grads[k], a.grads[k], rtol=1e-4, atol=1e-6)


def _tamper(tmp_path, tiny, edit):
    plan = compile_model(tiny, _cluster(tmp_path), micro_batches=2)
    d = tmp_path / "t.plan"
    save_plan(plan, d)
    data = json.loads((d / "plan.json").read_text())
    edit(data, plan)
    (d / "plan.json").write_text(json.dumps(data))
    with pytest.raises(PlanError) as e:
        load_plan(d)
    return str(e.value)


def test_plan_validation_names_the_field(tmp_path, tiny):
    def bad_device(data, plan):
        data["parts"]["part0"]["device"] = "gpu-42"

    assert "parts.part0.device" in _tamper(tmp_path, tiny, bad_device)

    def bad_boundary(data, plan):
        data["boundaries"]["part0"]["sent_acts"] = []

    assert "boundaries.part0" in _tamper(tmp_path, tiny, bad_boundary)

    def cycle(data, plan):  # put a late node on the first part: part0 feeds and consumes part1
        data["assignment"]["ln_f"] = "part0"

    msg = _tamper(tmp_path, tiny, cycle)
    assert "assignment" in msg and "cycle" in msg

    def missing(data, plan):
        del data["assignment"]

    assert "missing field 'assignment'" in _tamper(tmp_path, tiny, missing)


def test_model_that_cannot_fit_names_cluster_file_and_field(tmp_path, tiny):
    with pytest.raises(CompileError) as e:
        compile_model(tiny, _cluster(tmp_path, memory="20 kB"), micro_batches=2)
    msg = str(e.value)
    assert "cluster.yaml" in msg and "memory_bytes" in msg


def test_strategies_and_arguments_are_checked(tmp_path, tiny):
    cluster = _cluster(tmp_path, memory="10 MB")
    for s in ("equal-count", "equal-flops"):
        plan = compile_model(tiny, cluster, strategy=s, micro_batches=2)
        assert plan.strategy == s and len(plan.parts) == 6
    with pytest.raises(CompileError, match="strategy"):
        compile_model(tiny, cluster, strategy="random")
    with pytest.raises(CompileError, match="micro_batches"):
        compile_model(tiny, cluster, micro_batches=0)
    with pytest.raises(CompileError, match="compress_ratio"):
        compile_model(tiny, cluster, compress_ratio=0.5)


def test_bfloat16_weights_round_trip_without_torch_on_the_reading_side(tmp_path):
    """bf16 tensors are stored as BF16 (torch reads bfloat16) and read back by fusion as their uint16 bits."""
    from safetensors.torch import load_file

    from fusion.plan import save_arrays

    w = torch.randn(3, 4).to(torch.bfloat16)
    bits = w.view(torch.int16).numpy().view(np.uint16)
    save_arrays({"w": bits, "b": np.arange(3, dtype=np.float32), "u": bits}, tmp_path / "x.safetensors",
                {"w": "bfloat16", "b": "float32"})
    t = load_file(str(tmp_path / "x.safetensors"))
    assert t["w"].dtype == torch.bfloat16 and torch.equal(t["w"], w)
    assert t["u"].dtype == torch.uint16  # not declared bfloat16: kept as plain uint16
    back = load_weights(tmp_path / "x.safetensors")
    np.testing.assert_array_equal(back["w"], bits)
    assert back["w"].dtype == np.uint16 and back["b"].dtype == np.float32
    assert load_weights(tmp_path / "x.safetensors", ["w"]).keys() == {"w"}
    with pytest.raises(PlanError, match="cannot store 'c'"):
        save_arrays({"c": np.zeros(2, dtype=np.complex128)}, tmp_path / "y.safetensors")
