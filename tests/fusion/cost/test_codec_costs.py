"""The true price of a codec (issue 36): ``fusion profile`` measures encode + decode per message and per byte on
the host (``Device.codec_costs``), the cluster file keeps it, and the compiler prices codecs by it."""
from dataclasses import replace

import numpy as np
import pytest
import yaml

from fusion.cluster import load_cluster
from fusion.cluster.model import Cluster, Device
from fusion.compile import compile_model
from fusion.compress.policy import codec_prices, request
from fusion.cost.codec_costs import codec_seconds, cost_key, profile_codecs
from fusion.kernels.codecs import CODECS
from tests.fusion.cost.test_estimate_equations import _cm, _graph
from tests.testing_models import gpt_model

Q4 = {"algo": "quant", "bits": 4, "block": 64}


def test_keys_name_what_changes_the_cost():
    assert cost_key(Q4) == "quant-4"
    assert cost_key({"algo": "quant", "bits": 8, "rounding": "stochastic"}) == "quant-8-stochastic"
    assert cost_key({"algo": "hadamard-quant", "bits": 4}) == "hadamard-quant-4"
    assert cost_key({"algo": "topk", "ratio": 100}) == "topk"


def test_the_cluster_file_keeps_the_measured_costs(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text(yaml.safe_dump({"devices": [{"name": "a", "peak_flops": "1 TFLOPS", "memory": "1 GB", "codec_costs": {
        "quant-4": {"message_s": 5e-5, "byte_s": 1e-9}}}, {"name": "b", "peak_flops": "1 TFLOPS", "memory": "1 GB"}],
        "links": {"default": {"latency": "1 ms", "bandwidth": "20 Mbit/s"}}}))
    c = load_cluster(str(f))
    assert c.devices[0].codec_costs == (("quant-4", 5e-5, 1e-9),) and c.devices[1].codec_costs == ()
    assert c.devices[0].codec_seconds("quant-4", 1e6) == pytest.approx(5e-5 + 1e-3)
    assert c.devices[0].codec_seconds("quant-8", 1e6) is None
    assert codec_seconds(c.devices, Q4, 1e6) == pytest.approx(5e-5 + 1e-3)
    back = Cluster.from_dict(c.to_dict())
    assert back.devices[0].codec_costs == c.devices[0].codec_costs


def test_bad_codec_costs_are_refused(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text(yaml.safe_dump({"devices": [{"name": "a", "peak_flops": "1 TFLOPS", "memory": "1 GB", "codec_costs": {
        "quant-4": {"message_s": -1}}}], "links": {"default": {"latency": "1 ms", "bandwidth": "20 Mbit/s"}}}))
    with pytest.raises(Exception, match="codec_costs.quant-4"):
        load_cluster(str(f))


def test_the_estimator_prices_codecs_by_the_profiles_cost():
    cm = _cm(_graph())
    req = request("quant:bits=4,block=64")
    by_rate = codec_prices(cm, req)
    nbytes = np.array([float(m.nbytes) if (m := _meta(cm, t)) is not None else np.nan for t in range(len(cm.t_key))])
    ok = ~np.isnan(nbytes)
    assert np.allclose(by_rate.fwd_s[0, ok], nbytes[ok] / CODECS.rate("quant"))
    devs = [replace(d, codec_costs=(("quant-4", 1e-3, 2e-8),)) for d in cm.cluster.devices]
    devs[0] = replace(devs[0], codec_costs=(("quant-4", 2e-3, 2e-8),))  # the slowest device that measured it
    cm2 = cm.variant(cluster=Cluster(cm.cluster.name, devs, cm.cluster.alpha, cm.cluster.beta, "test"))
    measured = codec_prices(cm2, req)
    assert np.allclose(measured.fwd_s[0, ok], 2e-3 + 2e-8 * nbytes[ok])
    assert np.allclose(measured.bwd_s[0, ok], 2e-3 + 2e-8 * nbytes[ok])
    assert np.array_equal(measured.fwd_wire, by_rate.fwd_wire)  # the bytes do not change


def _meta(cm, t):
    from fusion.compress.policy import _meta as meta

    return meta(cm, t)


def test_a_compile_prices_the_plans_codecs_by_the_profile():
    """A slow measured codec makes compression not pay where the built-in rate said it did."""
    model = gpt_model(2, 64, 4, 128, 32, 4, device="meta")
    devs = [Device(f"d{i}", 1e12, 1e9) for i in range(2)]
    alpha = np.full((2, 2), 1e-3) - np.eye(2) * 1e-3
    beta = np.full((2, 2), 8.0 / 20e6) - np.eye(2) * (8.0 / 20e6)
    fast = compile_model(model, Cluster("fast", devs, alpha, beta, "t"), strategy="equal-flops", micro_batches=2,
                         compress=request("quant:bits=4"))
    assert fast.compression
    slow_devs = [replace(d, codec_costs=(("quant-4", 1.0, 0.0),)) for d in devs]  # one second per message
    slow = compile_model(model, Cluster("slow", slow_devs, alpha, beta, "t"), strategy="equal-flops",
                         micro_batches=2, compress=request("quant:bits=4"))
    assert not slow.compression


def test_profiling_measures_every_candidate_through_the_host_path():
    costs = profile_codecs([Q4, {"algo": "topk", "ratio": 100}], sizes=(4096, 32768), repeats=2, min_time=0.0)
    assert [k for k, _, _ in costs] == ["quant-4", "topk"]
    assert all(m >= 0 and b >= 0 and m + b * 4096 * 4 > 0 for _, m, b in costs)
