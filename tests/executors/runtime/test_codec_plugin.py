"""A new codec in one file, on every path (issue 24's Must show).

``plugins/sign_codec.py`` subclasses the codec unit and registers itself; nothing else in fusion names it.
It then carries activations and their gradients between parts, tied-parameter gradients
(``Plan.tied_codec``) and data-parallel gradients (``Plan.dp_codec``), on NumPy and torch CompNodes, with
the torch engine's ``--encode torch`` (its device path) and ``--encode host`` (its NumPy path).
"""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

from fusion.executors.reference import ReferenceExecutor
from fusion.executors.runtime.compression import CompressionTable
from fusion.ir.opdata import OpData
from fusion.kernels.codecs import CODECS, Role
from fusion.plan import EdgeCompression, OptimizerConfig
from tests.executors.dist_models import GPT_SPLITS, gpt_batch, tied_transformer

PLUGIN = Path(__file__).with_name("plugins") / "sign_codec.py"
SIGN = {"algo": "sign1"}
OPT = OptimizerConfig("sgd", lr=0.05)


@pytest.fixture(scope="module", autouse=True)
def plugin():
    """Import the plugin file as a plan's plugin is imported (by path); the registry is restored after."""
    before = dict(CODECS._codecs)
    spec = importlib.util.spec_from_file_location("fusion_test_sign_codec", PLUGIN)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    yield module
    CODECS._codecs.clear()
    CODECS._codecs.update(before)
    sys.modules.pop(spec.name, None)


def _edges(model, assignment):
    """Every cut edge of ``assignment``, activations and gradients through the sign codec."""
    cut = {(r.node, r.index, assignment[r.node], assignment[n]) for n in model.graph.nodes
           for r in model.graph[n].refs() if assignment[r.node] != assignment[n]}
    return [EdgeCompression(p, i, s, d, fwd_codec=SIGN, bwd_codec=SIGN) for p, i, s, d in sorted(cut, key=str)]


def test_the_registry_reads_the_new_codec_everywhere(plugin):
    assert "sign1" in CODECS and CODECS.user_module("sign1") == "fusion_test_sign_codec"
    for role in Role:
        assert "sign1" in CODECS.serving(role)
    assert CODECS.rate("sign1") == 200e6 and CODECS.unit("sign1").wire_nbytes(100, "float32", SIGN) == 21
    from fusion.plan import Plan

    plan = Plan.__new__(Plan)  # the dp_codec check asks the registry, not a list of names
    plan.dp_codec, plan.graph = SIGN, tied_transformer().graph
    plan._check_dp_codec("plan")
    with pytest.raises(Exception, match="delta cannot compress data-parallel gradients"):
        plan.dp_codec = {"algo": "delta"}
        plan._check_dp_codec("plan")


@pytest.mark.parametrize("dtype", ["float32", "float64", "float16", "bfloat16"])
def test_host_and_device_paths_give_the_same_bytes_and_decode_to_signs_times_the_scale(dtype):
    import torch

    e = EdgeCompression("x", None, "a", "b", fwd_codec=SIGN, bwd_codec=SIGN)
    host = CompressionTable.build("a", [e])
    dev = CompressionTable.build("a", [e], device=torch.device("cpu"), torch_on_cpu=True)
    x = torch.randn(3, 37, generator=torch.Generator().manual_seed(1)).to(getattr(torch, dtype))
    arr = x.view(torch.int16).numpy().view(np.uint16) if dtype == "bfloat16" else x.numpy()
    host.bfloat16.add(("x", None))
    p_host, cfg = host.encode(arr, ("x", None), "b", False, 0)
    p_dev, _ = dev.encode(x, ("x", None), "b", False, 0)
    assert cfg == SIGN and p_host == p_dev and len(p_host.fields["bits"]) == -(-x.numel() // 8)
    recv = CompressionTable.build("b", [e])
    got = recv.decode(OpData("x", None, ("y",), ("y",), False, 0, 0, src="a", dst="b", payload=p_host))
    want = torch.where(x < 0, -x.abs().max(), x.abs().max())
    if dtype == "bfloat16":
        got = torch.from_numpy(got.view(np.int16)).view(torch.bfloat16)
    else:
        got = torch.from_numpy(got)
    assert torch.equal(got, want)


def _reference(encode: str, engines=None, steps=2):
    model = tied_transformer(mb=2)
    ex = ReferenceExecutor(model, GPT_SPLITS[2], OPT, micro_batches=2, engines=engines,
                           compression=_edges(model, GPT_SPLITS[2]), tied_codec=SIGN,
                           engine_options={"*": {"encode": encode}})
    return ex, [ex.step(gpt_batch(s, 4)).loss for s in range(steps)]


def test_one_process_cut_edges_and_tied_gradients_on_every_engine_path():
    """Activations, their gradients and the tied embedding/head gradient go through the codec: on torch
    parts encoding on the device (``encode="torch"``) and in NumPy (``"host"``), bit for bit the same, and
    with the head's part on the NumPy engine."""
    dev, on_dev = _reference("torch")
    host, on_host = _reference("host")
    plain = ReferenceExecutor(tied_transformer(mb=2), GPT_SPLITS[2], OPT, micro_batches=2)
    assert on_dev == on_host and on_dev != [plain.step(gpt_batch(s, 4)).loss for s in range(2)]
    for k, v in host.state().items():
        np.testing.assert_array_equal(dev.state()[k], v, err_msg=k)
    _, on_numpy = _reference("host", engines={"p1": "numpy"})
    np.testing.assert_allclose(on_numpy, on_host, rtol=1e-4)


def test_processes_use_the_new_codec_on_every_path(tmp_path):
    """Two replicas of a two-stage pipeline (four CompNodes; stage p1's replica r1.p1 on the NumPy engine,
    the torch parts with ``--encode torch``): cut edges both ways, the tied gradient and the all-reduce all
    carry sign1 payloads, as each process's log says; the torch replicas of p0 end with the same bits."""
    from fusion.commands.compile import record_codec_plugins
    from fusion.executors.runtime.coordinator import CoordinatorConfig
    from fusion.executors.runtime.launcher import LocalCluster, hand_plan, local_cluster_dict
    from fusion.plan import save_plan
    from fusion.replicas import replicate

    model = tied_transformer(mb=2)
    plan = hand_plan(model, GPT_SPLITS[2], cluster=local_cluster_dict(["d0", "d1", "d2", "d3"]), micro_batches=2,
                     optimizer=OPT)
    plan.compression, plan.tied_codec = _edges(model, GPT_SPLITS[2]), SIGN
    plan = replicate(plan, None, [["local-0", "local-1"], ["local-2", "local-3"]], global_batch=8,
                     engines={"r1.p1": "numpy"}, dp_codec=SIGN)
    assert record_codec_plugins(plan) == [str(PLUGIN.resolve())]
    plan_dir = save_plan(plan, tmp_path / "plan", params=model.params)
    with LocalCluster(plan_dir, tmp_path / "run", CoordinatorConfig(peer_timeout_s=30), threads=1, trace=False,
                      executor_args=["--trust-plugins", "--encode", "torch"]) as lc:
        lc.start()
        losses = [lc.coordinator.step(gpt_batch(s, 8)).loss for s in range(2)]
        states = [lc.coordinator.fetch_state(replica=r) for r in range(2)]
    assert all(np.isfinite(losses))
    logs = {p: (tmp_path / "run" / "logs" / f"{p}.log").read_text() for p in ("p0", "p1", "r1.p0", "r1.p1")}
    for p in ("p0", "r1.p0"):  # torch parts: the cut edge's activation on the device; tied and DP on the host
        for line in ("activation on the device", "tied-gradient on the host", "dp-gradient on the host"):
            assert f"sign1 codec: {line} path" in logs[p], (p, line, logs[p][-2000:])
    assert "sign1 codec: gradient on the device path" in logs["p1"]
    for line in ("gradient on the host", "tied-gradient on the host", "dp-gradient on the host"):
        assert f"sign1 codec: {line} path" in logs["r1.p1"], (line, logs["r1.p1"][-2000:])
    for k in states[0]:
        if k in states[1] and "wte" not in k and k.startswith(("ln1", "qkv", "proj")):
            np.testing.assert_array_equal(states[0][k], states[1][k], err_msg=k)
