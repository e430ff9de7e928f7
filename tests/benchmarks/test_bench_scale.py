"""benchmarks/bench_scale.py --quick (issue 38): 4 CompNodes of a small GPT, a checkpoint, a stop and ``--resume``
equal to the uninterrupted run bit for bit, ``fusion export`` loading with ``strict=True``, and the losses of plain
PyTorch in one process. About 55 s on the shared 2-core host (3 ``fusion run``s, an export, 2 baseline processes)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_quick_mode_resumes_bit_exact_and_exports_strict(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_scale.py"), "--quick", "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=240, env=env, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    j = json.loads(r.stdout.strip().splitlines()[-1])
    assert j["errors"] == []
    assert j["resume_bit_exact"] is True and j["resumed_at"] == "1" and j["tensors_compared"] > 0
    assert j["export_loads_strict"] is True
    assert sorted(j["peak_rss_mb_per_part"]) == ["part0", "part1", "part2", "part3"]
    assert all(v > 0 for v in j["peak_rss_mb_per_part"].values())
    assert j["ready_s_4_parts"] > 0 and j["step_s"] > 0 and j["one_process_step_s"] > 0
    assert j["checkpoint_mb"] > 0 and j["checkpoint_write_s"] is not None
    assert j["one_process_loss_max_rel_diff"] < 1e-5  # fusion's 4 parts train what one process trains
    assert j["params"] == 234880 and len(j["load"]["before"]) == 3
