#!/usr/bin/env bash
# The GPU checks of a lent machine in one script, within 8 minutes (issue 38).
#
#   benchmarks/gpu_check.sh [--dry-run] [OUT.json]      (run from anywhere; it cds to the repository root)
#
# On a machine with the repository copied and torch with CUDA in the project's environment as `python` (or
# $PYTHON), nothing installed from outside, it runs, each step under its own `timeout`:
#
#   device        nvidia-smi --query-gpu=name --format=csv,noheader (and torch.cuda.get_device_name)
#   cuda_tests    pytest tests/kernels/test_cuda_*.py tests/kernels/test_bench_gpu.py (NVRTC compiles, the CUDA
#                 emulation; test_bench_gpu skips itself where a GPU is present: the bench step times it)
#   device_tests  pytest of the tests that run on a CUDA device when one is there (Top-K on CuPy, quantisers
#                 on CUDA tensors, codecs on the engine's device), -k "cuda or cupy or device"
#   bench_gpu     python benchmarks/bench_gpu.py --reps 10: fused Top-K vs torch.topk, device vs host encode
#   fusion_run    fusion run examples/models/gpt.py:tiny, 2 CompNodes on loopback, --device cuda:0, 20 steps
#
# and writes one JSON file (OUT.json, default $OUT/gpu_check.json, or ./gpu_check.json without $OUT): the
# device name, and per step its status (passed / failed / timeout / skipped), seconds, exit code, the last lines
# of its output and its key figures (pytest counts; bench_gpu's speed and encode ratios; the run's final loss,
# median step and start-up time). With no GPU (no nvidia-smi, or torch sees no CUDA device) every step is
# "skipped" and the script exits 0. --dry-run lists the steps and their commands and runs nothing.
# Exit status: 0 when no step failed or timed out, 1 otherwise.
set -u
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
DRY=0
JSON=""
for a in "$@"; do
  case "$a" in
    --dry-run) DRY=1 ;;
    -h|--help) sed -n '2,23p' "$0"; exit 0 ;;
    *) JSON="$a" ;;
  esac
done
[ -n "$JSON" ] || JSON="${OUT:-.}/gpu_check.json"

WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX")
CLUSTER="$WORK/two-gpu-parts.yaml"
RUN="$WORK/run"

# name | timeout (s) | command; the budgets add up to 470 s of the 480
STEPS=(
  "device|15|nvidia-smi --query-gpu=name --format=csv,noheader"
  "cuda_tests|100|$PY -m pytest -q -p no:cacheprovider tests/kernels/test_cuda_source.py tests/kernels/test_cuda_emu.py tests/kernels/test_cuda_extras.py tests/kernels/test_bench_gpu.py"
  "device_tests|90|$PY -m pytest -q -p no:cacheprovider tests/kernels/test_topk_kernels.py tests/kernels/test_quant.py tests/executors/engines/test_device_codec.py -k \"cuda or cupy or device\""
  "bench_gpu|140|$PY benchmarks/bench_gpu.py --reps 10"
  "fusion_run|125|$PY -m fusion.cli run examples/models/gpt.py:tiny --cluster $CLUSTER --strategy equal-flops --device cuda:0 --steps 20 --no-progress --log-every 0 --out $RUN"
)

if [ "$DRY" = 1 ]; then
  echo "gpu_check (dry run): would write $JSON; budget 480 s"
  for s in "${STEPS[@]}"; do
    IFS='|' read -r name t cmd <<<"$s"
    printf '%-13s timeout %3ss  %s\n' "$name" "$t" "$cmd"
  done
  rm -rf "$WORK"
  exit 0
fi

cat >"$CLUSTER" <<'EOF'
# two CompNodes on one host (the run binds free loopback ports), both on cuda:0 via --device
name: two-gpu-parts
devices:
  - {name: gpu-0, group: site-a, peak_flops: 50 TFLOPS, memory: 16 GB, address: "tcp://127.0.0.1:6200"}
  - {name: gpu-1, group: site-a, peak_flops: 50 TFLOPS, memory: 16 GB, address: "tcp://127.0.0.1:6201"}
links:
  default: {latency: 1 ms, bandwidth: 10 Gbit/s}
EOF

GPU=1
NOGPU_REASON=""
if ! command -v nvidia-smi >/dev/null 2>&1; then
  GPU=0; NOGPU_REASON="no nvidia-smi on this machine"
elif ! timeout 60 "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" >/dev/null 2>&1; then
  GPU=0; NOGPU_REASON="torch sees no CUDA device"
fi

for s in "${STEPS[@]}"; do
  IFS='|' read -r name t cmd <<<"$s"
  echo "$cmd" >"$WORK/$name.cmd"
  if [ "$GPU" = 0 ]; then
    echo "skipped" >"$WORK/$name.status"; echo 0 >"$WORK/$name.seconds"
    echo "gpu_check: $name skipped ($NOGPU_REASON)" >&2
    continue
  fi
  echo "gpu_check: $name (timeout ${t}s): $cmd" >&2
  start=$(date +%s.%N)
  timeout --kill-after=5 "$t" bash -c "$cmd" >"$WORK/$name.log" 2>&1
  rc=$?
  end=$(date +%s.%N)
  echo "$rc" >"$WORK/$name.rc"
  "$PY" -c "print(round($end - $start, 1))" >"$WORK/$name.seconds" 2>/dev/null || echo 0 >"$WORK/$name.seconds"
  if [ "$rc" = 0 ]; then st=passed; elif [ "$rc" = 124 ] || [ "$rc" = 137 ]; then st=timeout; else st=failed; fi
  echo "$st" >"$WORK/$name.status"
  echo "gpu_check: $name $st in $(cat "$WORK/$name.seconds") s" >&2
done

mkdir -p "$(dirname "$JSON")"
"$PY" - "$WORK" "$JSON" "$GPU" "$NOGPU_REASON" "$RUN" <<'PYEOF'
import json, re, statistics, sys
from pathlib import Path

work, out, gpu, why, run = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3] == "1", sys.argv[4], Path(sys.argv[5])


def read(name, ext, default=""):
    p = work / f"{name}.{ext}"
    return p.read_text(errors="replace").strip() if p.exists() else default


def pytest_counts(log):
    tail = log.strip().splitlines()[-1] if log.strip() else ""
    return {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed|deselected)", tail)}


def last_json(log):
    for line in reversed(log.splitlines()):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except ValueError:
                return None
    return None


steps = {}
device = None
for name in ("device", "cuda_tests", "device_tests", "bench_gpu", "fusion_run"):
    log = read(name, "log")
    st = {"status": read(name, "status", "not run"), "seconds": float(read(name, "seconds", "0") or 0),
          "exit_code": int(read(name, "rc")) if read(name, "rc") else None, "command": read(name, "cmd")}
    if st["status"] == "skipped":
        st["reason"] = why
    else:
        st["output_tail"] = "\n".join(log.splitlines()[-15:])
    figures = {}
    if name == "device" and st["status"] == "passed":
        device = log.splitlines()[0].strip() if log else None
        figures["name"] = device
    elif name in ("cuda_tests", "device_tests") and log:
        figures = pytest_counts(log)
    elif name == "bench_gpu" and log:
        j = last_json(log)
        if j:
            figures = {k: j.get(k) for k in ("device", "cupy", "speed_vs_torch_topk_1M_float32",
                                              "speed_vs_torch_topk_16M_float32", "device_vs_host_encode_cuda",
                                              "device_vs_host_encode_cpu")}
    elif name == "fusion_run" and (run / "metrics.jsonl").exists():
        rows = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines() if l.strip()]
        rows = [r for r in rows if "iteration_s" in r]
        if rows:
            figures = {"steps": len(rows), "first_loss": rows[0]["loss"], "final_loss": rows[-1]["loss"],
                       "median_step_s": statistics.median(r["iteration_s"] for r in rows[1:] or rows)}
        m = re.search(r"all (\d+) CompNodes ready, ([\d.]+) s after launch", log)
        if m:
            figures["parts"], figures["ready_s"] = int(m.group(1)), float(m.group(2))
        logs = run / "logs"
        figures["cuda_in_executor_logs"] = any("cuda" in p.read_text(errors="replace")
                                               for p in logs.glob("*.log")) if logs.exists() else False
    st["figures"] = figures
    steps[name] = st

result = {"device": device, "gpu": gpu, "budget_s": 480,
          "total_s": round(sum(s["seconds"] for s in steps.values()), 1),
          "ok": all(s["status"] in ("passed", "skipped") for s in steps.values()), "steps": steps}
if not gpu:
    result["skipped_reason"] = why
out.write_text(json.dumps(result, indent=1) + "\n")
print(json.dumps({"gpu_check": str(out), "device": device, "ok": result["ok"],
                  "steps": {k: v["status"] for k, v in steps.items()}}))
sys.exit(0 if result["ok"] else 1)
PYEOF
rc=$?
rm -rf "$WORK"
exit $rc
