"""Memory over a long run (issue 28): the RSS of the coordinator and of each executor over ``--steps`` steps.

Run:  OMP_NUM_THREADS=1 python benchmarks/bench_rss.py [--steps 10000] [--warmup 500] [--out DIR]
      (from a checkout other than the installed one: PYTHONPATH=. in front)

One ``fusion run`` of the tiny GPT (``examples/models/gpt.py:tiny``) cut into 2 parts, trace on (the default),
checkpoints every ``--checkpoint-every`` steps, metrics on, as a user would start it. This script samples each
process's ``/proc/PID/status`` every ``--interval`` seconds (psutil is not needed) until the run has ended,
so the end of the run is included: each executor writing its trace, the coordinator merging them into
``trace.json``, writing ``metrics.csv`` and drawing ``loss.png``.

The peak is the kernel's high-water mark ``VmHWM``, reset (``/proc/PID/clear_refs``: 5) once the run has
done ``--warmup`` steps, so a spike between two samples is counted too; only a spike in the last
``--interval`` before a process exits could be missed (the exit itself frees memory).

Final line (JSON): per process (``coordinator``, ``part0``, ``part1``) ``rss_start`` (MB, the RSS when the run
had done ``--warmup`` steps), ``rss_peak`` (MB, the high-water mark from then to the process's end),
``rss_end`` (MB, the last RSS read, at the end of the run), ``growth_pct`` ((peak - start) / start, in %; the
target is < 5) and ``last_step_s`` (the time of the last sample relative to the end of the last step), plus
``steps``, ``seconds`` and ``target_met``.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODEL = str(ROOT / "examples" / "models" / "gpt.py") + ":tiny"
CLUSTER = ROOT / "examples" / "clusters" / "local-4-one-site.yaml"


def build_plan(out: Path) -> Path:
    """The tiny GPT cut into 2 equal stages (contiguous in the graph's node order) on cpu-0 and cpu-1."""
    from fusion.cluster import load_cluster
    from fusion.loader import load_model
    from fusion.plan import OptimizerConfig, save_plan
    from fusion.replicas import compile_replicated

    model = load_model(MODEL)
    names = list(model.graph.nodes)
    cut = {n: min(1, i * 2 // len(names)) for i, n in enumerate(names)}
    plan = compile_replicated(model, load_cluster(CLUSTER), cut, [["cpu-0", "cpu-1"]], micro_batches=2,
                              optimizer=OptimizerConfig("adamw", lr=0.01))
    return save_plan(plan, out / "tiny2.plan", params=model.params)


def status_kb(pid: int) -> dict[str, int]:
    """VmRSS and VmHWM of ``pid`` in kB ({} once it has exited)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return {k: int(v.split()[0]) for k, _, v in (line.partition(":") for line in f) if k in ("VmRSS", "VmHWM")}
    except (OSError, ValueError):
        return {}


def children(pid: int) -> dict[int, str]:
    """The child processes of ``pid`` that run a CompNode: pid -> its part (``--node``)."""
    out = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                ppid = int(f.read().rpartition(")")[2].split()[1])
            if ppid != pid:
                continue
            with open(f"/proc/{d}/cmdline", "rb") as f:
                argv = f.read().decode(errors="replace").split("\0")
        except (OSError, ValueError, IndexError):
            continue
        if "--node" in argv:
            out[int(d)] = argv[argv.index("--node") + 1]
    return out


def reset_peak(pid: int) -> bool:
    """Reset the kernel's high-water mark of ``pid`` to its current RSS (Linux >= 4.0)."""
    try:
        with open(f"/proc/{pid}/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class Steps:
    """The number of step lines in a growing ``metrics.jsonl``, read incrementally."""

    def __init__(self, path: Path):
        self.path, self.offset, self.n, self.last_step_t = path, 0, 0, None

    def poll(self) -> int:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except OSError:
            return self.n
        whole = data.rpartition(b"\n")[0]
        if whole:
            self.offset += len(whole) + 1
            got = sum(1 for line in whole.split(b"\n") if b'"loss"' in line and b'"event"' not in line)
            if got:
                self.n += got
                self.last_step_t = time.monotonic()
        return self.n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=10_000)
    ap.add_argument("--warmup", type=int, default=500, help="rss_start is read after this many steps")
    ap.add_argument("--checkpoint-every", type=int, default=1000)
    ap.add_argument("--interval", type=float, default=0.05, help="seconds between samples")
    ap.add_argument("--out", default=None, help="work folder (default: a temporary one)")
    args = ap.parse_args()
    work = Path(args.out or tempfile.mkdtemp(prefix="bench_rss-"))
    work.mkdir(parents=True, exist_ok=True)
    plan = build_plan(work)
    run = work / "run"
    cmd = [sys.executable, "-m", "fusion.cli", "run", str(plan), "--out", str(run), "--overwrite", "--steps",
           str(args.steps), "--checkpoint-every", str(args.checkpoint_every), "--threads", "1", "--no-progress",
           "--trace", "on"]
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=open(work / "run.stderr", "w"))
    names: dict[int, str] = {proc.pid: "coordinator"}
    seen: dict[str, dict] = {}
    steps = Steps(run / "metrics.jsonl")
    started = False
    next_note = args.warmup
    while True:
        for pid, part in children(proc.pid).items():
            names.setdefault(pid, part)
        n = steps.poll()
        if not started and n >= args.warmup:
            started = True
            for pid, name in names.items():
                st = status_kb(pid)
                if st and reset_peak(pid):
                    seen[name] = {"pid": pid, "start": st["VmRSS"], "peak": st["VmRSS"], "end": st["VmRSS"],
                                  "samples": 0}
        if started:
            for pid, name in names.items():
                s = seen.get(name)
                st = status_kb(pid) if s is not None and s["pid"] == pid else {}
                if st:
                    s["peak"] = max(s["peak"], st["VmHWM"], st["VmRSS"])
                    s["end"] = st["VmRSS"]
                    s["samples"] += 1
                    s["t_end"] = time.monotonic()
        if started and n >= next_note:  # progress on stderr: the RSS now of each process, MB
            next_note += 1000
            print(json.dumps({"step": n, **{k: round(v["end"] / 1024, 1) for k, v in seen.items()}}), file=sys.stderr,
                  flush=True)
        if proc.poll() is not None:
            break
        time.sleep(args.interval)
    if proc.returncode != 0:
        sys.exit(f"the run failed (status {proc.returncode}); see {work / 'run.stderr'}")
    if not started:
        sys.exit(f"the run ended after {steps.n} steps, before --warmup {args.warmup}")
    procs = {}
    for name, s in sorted(seen.items()):
        procs[name] = {"rss_start_mb": round(s["start"] / 1024, 1), "rss_peak_mb": round(s["peak"] / 1024, 1),
                       "rss_end_mb": round(s["end"] / 1024, 1),
                       "growth_pct": round(100 * (s["peak"] - s["start"]) / s["start"], 2),
                       "last_sample_after_last_step_s": round(s["t_end"] - steps.last_step_t, 2),
                       "samples": s["samples"]}
    print(json.dumps({"steps": steps.n, "warmup": args.warmup, "seconds": round(time.monotonic() - t0, 1),
                      "trace_mb": round(os.path.getsize(run / "trace.json") / 2**20, 1)
                      if (run / "trace.json").exists() else None,
                      "processes": procs, "target_met": all(p["growth_pct"] < 5 for p in procs.values())}))


if __name__ == "__main__":
    main()
