"""``--precision bf16`` prices what autocast sends: a tensor autocast makes bfloat16 costs 2 bytes an element on a
link (issue 36), one it leaves float32 (a residual sum, a LayerNorm) 4."""
import numpy as np
import pytest

from fusion.cluster.model import Cluster, Device
from fusion.compile import compile_model
from fusion.compress.policy import codec_prices, request
from fusion.cost.autocast import bf16_tensors, with_precision
from fusion.cost.estimate import CostModel
from fusion.cost.flops import measure_costs
from tests.testing_models import gpt_model


def _cm():
    model = gpt_model(2, 64, 4, 128, 32, 4, device="meta")
    devs = [Device(f"d{i}", 1e12, 1e9) for i in range(2)]
    alpha = np.full((2, 2), 1e-3) - np.eye(2) * 1e-3
    beta = np.full((2, 2), 8.0 / 20e6) - np.eye(2) * (8.0 / 20e6)
    cluster = Cluster("two", devs, alpha, beta, "t")
    return model, cluster, CostModel.build(model.graph, measure_costs(model.graph), cluster, 2)


def test_autocast_makes_matmul_outputs_bf16_and_leaves_sums_and_norms_float32():
    model, _, _ = _cm()
    g = model.graph
    bf16 = bf16_tensors(g)
    linear = [n for n, node in g.nodes.items() if node.target == "torch.nn.Linear"]
    assert linear and set(linear) <= bf16
    for n, node in g.nodes.items():
        if node.target in ("torch.nn.LayerNorm", "torch.nn.Embedding", "torch.nn.functional.cross_entropy"):
            assert n not in bf16
        if node.target == "operator.add":  # the residual stream: float32 + bfloat16 promotes to float32
            assert n not in bf16
        if node.target == "torch.nn.functional.gelu":  # keeps its Linear input's bfloat16
            assert n in bf16


def test_a_bf16_edge_is_priced_at_half_the_bytes():
    _, _, cm = _cm()
    bf = with_precision(cm, "bf16")
    assert with_precision(cm, "fp32") is cm
    for t, (producer, _) in enumerate(cm.t_key):
        want = cm.t_bytes[t] / 2 if producer in bf.bf16 else cm.t_bytes[t]
        assert bf.t_bytes[t] == want
    assert any(p in bf.bf16 for p, _ in cm.t_key)
    # a codec on a bf16 edge: priced on the bfloat16 tensor it encodes
    req = request("quant:bits=4,block=64")
    p32, p16 = codec_prices(cm, req), codec_prices(bf, req)
    for t, (producer, _) in enumerate(cm.t_key):
        if producer in bf.bf16 and np.isfinite(p32.fwd_s[0, t]):
            assert p16.fwd_s[0, t] == pytest.approx(p32.fwd_s[0, t] / 2)


def test_compile_with_bf16_predicts_less_link_time_for_a_matmul_cut():
    model, cluster, _ = _cm()
    kw = dict(strategy="equal-flops", micro_batches=2)
    p32 = compile_model(model, cluster, **kw)
    p16 = compile_model(model, cluster, precision="bf16", **kw)
    assert p16.predicted["iteration_s"] <= p32.predicted["iteration_s"]
    with pytest.raises(Exception, match="precision"):
        compile_model(model, cluster, precision="fp16", **kw)
