"""benchmarks/gpu_check.sh: --dry-run lists its steps and runs nothing; without a GPU every step is skipped, exit 0."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_check.sh"
STEPS = ["device", "cuda_tests", "device_tests", "bench_gpu", "fusion_run"]

pytestmark = pytest.mark.skipif(shutil.which("bash") is None or shutil.which("timeout") is None,
                                reason="needs bash and coreutils' timeout")


def test_dry_run_lists_every_step_within_eight_minutes(tmp_path):
    out = tmp_path / "g.json"
    r = subprocess.run(["bash", str(SCRIPT), "--dry-run", str(out)], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    rows = [line for line in r.stdout.splitlines() if re.match(r"^\w+ +timeout +\d+s ", line)]
    assert [line.split()[0] for line in rows] == STEPS
    assert sum(int(line.split()[2].rstrip("s")) for line in rows) <= 480
    text = r.stdout
    for needle in ("tests/kernels/test_cuda_source.py", "tests/kernels/test_cuda_emu.py",
                   "tests/kernels/test_cuda_extras.py", "tests/kernels/test_bench_gpu.py", "benchmarks/bench_gpu.py",
                   "examples/models/gpt.py:tiny", "--device cuda:0", "nvidia-smi --query-gpu=name --format=csv,noheader"):
        assert needle in text
    assert not out.exists()  # ran nothing, wrote nothing


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present: the script would run its checks")
def test_without_a_gpu_every_step_is_skipped_and_the_json_says_so(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path)}
    r = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stderr
    j = json.loads((tmp_path / "gpu_check.json").read_text())
    assert j["gpu"] is False and j["device"] is None and j["ok"] is True and j["skipped_reason"]
    assert list(j["steps"]) == STEPS
    assert all(s["status"] == "skipped" and s["command"] for s in j["steps"].values())
