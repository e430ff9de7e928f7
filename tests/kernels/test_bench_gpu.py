"""benchmarks/bench_gpu.py on a machine without a GPU: exits 0 with null GPU figures and measured CPU encodes."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present: the bench would time it (minutes)")
def test_bench_gpu_without_a_gpu_prints_null_figures():
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_gpu.py"), "--reps", "1", "--message", "2x8x64"],
                       capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    last = json.loads(r.stdout.strip().splitlines()[-1])
    assert last["device"] is None and last["cases"] is None
    assert last["speed_vs_torch_topk_16M_float32"] is None and last["speed_vs_torch_topk_1M_float32"] is None
    enc = last["encode_per_message"]
    assert enc["cuda"] is None and last["device_vs_host_encode_cuda"] is None
    cases = enc["cpu"]["cases"]
    assert [c["codec"] for c in cases] == ["topk", "quant8", "quant4", "quant2", "hadamard-quant4", "delta4"]
    assert enc["cpu"]["all_same_bytes"] and all(c["host_ms"] > 0 and c["device_ms"] > 0 for c in cases)
    assert last["device_vs_host_encode_cpu"] == enc["cpu"]["host_over_device_median"]
