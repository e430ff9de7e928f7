"""--compress: parsing codec specs, and compressing only the cut edges where the cost model says it pays."""
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from fusion.cluster.model import Cluster, Device
from fusion.compile import compile_model
from fusion.compress.policy import AUTO, CompressSpecError, parse_spec, request
from tests.testing_models import gpt_model

ROOT = Path(__file__).resolve().parents[3]


def test_specs_parse_into_codec_cfgs():
    assert parse_spec("quant:bits=4,block=32") == {"algo": "quant", "bits": 4, "block": 32}
    assert parse_spec("topk:ratio=100") == {"algo": "topk", "ratio": 100}
    assert parse_spec("none") is None and parse_spec("auto") == "auto"
    r = request("quant:bits=4", "none")
    assert r.fwd == {"algo": "quant", "bits": 4} and r.bwd is None
    assert request("auto").fwd == AUTO == request("auto").bwd
    assert request("hadamard-quant:bits=4").bwd == {"algo": "hadamard-quant", "bits": 4}  # bwd follows fwd
    assert request(None, None) is None and request("none") is None


@pytest.mark.parametrize("spec,match", [
    ("zip", "unknown codec 'zip'"), ("quant:bits=3", "bits must be one of"), ("quant:bits", "expected KEY=VALUE"),
    ("quant:colour=red", "colour"), ("delta:bits=3", "bits must be one of"), ("delta:first_visit=zip", "first_visit"),
])
def test_bad_specs_say_what_is_wrong(spec, match):
    with pytest.raises(CompressSpecError, match=match):
        parse_spec(spec)


def test_delta_is_for_activations_and_gives_the_gradients_8_bit_quant():
    r = request("delta:bits=2")
    assert r.fwd == {"algo": "delta", "bits": 2} and r.bwd == {"algo": "quant", "bits": 8, "block": 64}
    assert request("delta:bits=4", "none").bwd is None
    with pytest.raises(CompressSpecError, match="activations only"):
        request("quant:bits=8", "delta:bits=4")


def _two_devices(bandwidth_bps: float) -> Cluster:
    devs = [Device(f"d{i}", 1e12, 1e9) for i in range(2)]
    alpha = np.full((2, 2), 1e-3) - np.eye(2) * 1e-3
    beta = np.full((2, 2), 8.0 / bandwidth_bps) - np.eye(2) * (8.0 / bandwidth_bps)
    return Cluster(f"two-{bandwidth_bps:g}", devs, alpha, beta, "test")


@pytest.mark.parametrize("bandwidth,compressed", [(20e6, True), (100e9, False)])
def test_edges_are_compressed_only_where_it_pays(bandwidth, compressed):
    model = gpt_model(2, 64, 4, 128, 32, 4, device="meta")
    plan = compile_model(model, _two_devices(bandwidth), strategy="equal-flops", micro_batches=2,
                         compress=request("quant:bits=8"))
    assert len(plan.parts) == 2
    assert bool(plan.compression) is compressed
    if compressed:
        assert plan.predicted["iteration_s"] < plan.predicted["dense_iteration_s"]
        assert all(c.codec("fwd") == {"algo": "quant", "bits": 8} for c in plan.compression)


def test_cli_refuses_a_bad_compress_value_in_one_line(tmp_path):
    r = subprocess.run([sys.executable, "-m", "fusion.cli", "compile", str(ROOT / "examples/models/gpt.py:tiny"),
                        "--cluster", "local-4-two-sites", "--compress", "quant:bits=3", "-o", str(tmp_path / "p")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == ["fusion compile: error: --compress 'quant:bits=3': "
                                             "quant cfg: bits must be one of 2, 4, 8, got 3"]
