"""Chaos soak of ``fusion run --max-restarts`` (issue 28's must-show): inject faults, check nothing is lost.

Run:  OMP_NUM_THREADS=1 python benchmarks/chaos.py [--faults 10] [--seed 0] [--out DIR]
      (from a checkout other than the installed one: PYTHONPATH=. in front; --faults 50 for the full figure)

Two runs of the tiny GPT (``examples/models/gpt.py:tiny``) on loopback, each beside an unfaulted twin:

  pipeline  a 4-part pipeline (4 stages, 1 replica)
  dp        a 2 x 2 data-parallel run (2 stages, 2 replicas; synchronous averaging, restarts cover replicas)

Faults (``FUSION_TEST_FAULT``, ``executors/runtime/faults.py``) are drawn with ``--seed``: each at its own
step, on a random CompNode, SIGKILL or SIGSTOP (one in three), sent by the executor to itself at the start
of that step, plus in each run one SIGKILL of the coordinator (``fusion run`` itself) right after it
committed a checkpoint and before that step's metrics line, after which this script resumes the run with
``--resume``. Every fault fires once. The runs checkpoint every 2 steps with ``--max-restarts`` equal to
their executor faults, so one spurious failure more would end the run and show here.

Final line (JSON): ``faults`` (fired), ``recovered`` (faults after which training went on: restart events
plus coordinator resumes that finished), ``lost_steps`` / ``duplicated_steps`` (step lines missing from, or
repeated in, metrics.jsonl), ``final_weights_equal_unfaulted`` and ``losses_equal_unfaulted`` (bit for bit,
every run), ``max_recovery_s`` (from a fault firing, the marker file's time, to the first step completed
after it: detection, the peer timeout for a stopped one, start-up and the replay of steps since the
checkpoint), plus per-run details. Not injected (yet): faults inside a checkpoint write or during
start-up, and link cuts (network namespaces).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODEL = str(ROOT / "examples" / "models" / "gpt.py") + ":tiny"
CLUSTER = ROOT / "examples" / "clusters" / "local-4-one-site.yaml"
DEVICES = {"pipeline": [["cpu-0", "cpu-1", "cpu-2", "cpu-3"]], "dp": [["cpu-0", "cpu-1"], ["cpu-2", "cpu-3"]]}
EVERY = 2  # checkpoint every EVERY steps


def build_plan(kind: str, out: Path) -> tuple[Path, list[str]]:
    """The plan of ``kind`` (contiguous cut of the graph's node order into equal stages); its folder and parts."""
    from fusion.cluster.model import load_cluster
    from fusion.loader import load_model
    from fusion.plan import OptimizerConfig, save_plan
    from fusion.replicas import compile_replicated

    model = load_model(MODEL)
    grid = DEVICES[kind]
    names = list(model.graph.nodes)
    stages = len(grid[0])
    cut = {n: min(stages - 1, i * stages // len(names)) for i, n in enumerate(names)}
    plan = compile_replicated(model, load_cluster(CLUSTER), cut, grid, micro_batches=2,
                              optimizer=OptimizerConfig("adamw", lr=0.01))
    return save_plan(plan, out / f"{kind}.plan", params=model.params), list(plan.parts)


def draw_faults(parts: list[str], n: int, steps: int, rng: random.Random, markers: Path) -> list[tuple]:
    """``n`` executor faults at distinct steps 1 .. steps-2 plus one coordinator kill after a checkpoint commit."""
    at = sorted(rng.sample(range(1, steps - 1), n))
    faults = [(rng.choice(parts), s, "STOP" if rng.random() < 1 / 3 else "KILL") for s in at]
    commit = rng.choice([s for s in range(EVERY, steps, EVERY)])
    faults.append(("coordinator", commit, "KILL"))
    return [(p, s, sig, str(markers / f"fault-{i}-{p}-{s}")) for i, (p, s, sig) in enumerate(faults)]


def fusion_run(plan: Path, out: Path, steps: int, extra: list[str], env: dict | None = None,
               timeout: float = 3000) -> tuple[int, str]:
    cmd = [sys.executable, "-m", "fusion.cli", "run", str(plan), "--out", str(out), "--steps", str(steps),
           "--checkpoint-every", str(EVERY), "--no-progress", "--trace", "off", "--threads", "1", *extra]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                       env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})
    return r.returncode, r.stderr


def rows(run: Path) -> list[dict]:
    out = []
    for line in (run / "metrics.jsonl").read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            pass
    return out


def same_bits(a: Path, b: Path) -> bool:
    import numpy as np
    from safetensors.numpy import load_file

    if not (a.exists() and b.exists()):
        return False
    x, y = load_file(str(a)), load_file(str(b))
    return set(x) == set(y) and all(np.array_equal(x[k], y[k]) and x[k].dtype == y[k].dtype for k in x)


def soak(kind: str, n_faults: int, rng: random.Random, work: Path, peer_timeout: float) -> dict:
    plan, parts = build_plan(kind, work)
    steps = max(12, 2 * n_faults + 6)
    markers = work / f"{kind}-markers"
    markers.mkdir()
    faults = draw_faults(parts, n_faults, steps, rng, markers)
    env = {"FUSION_TEST_FAULT": ",".join(":".join(map(str, f)) for f in faults)}
    common = ["--peer-timeout", str(peer_timeout)]
    ref, run = work / f"{kind}-unfaulted", work / f"{kind}-faulted"
    t0 = time.monotonic()
    rc, err = fusion_run(plan, ref, steps, common)
    if rc:
        raise SystemExit(f"the unfaulted {kind} run failed:\n{err[-3000:]}")
    t_ref = time.monotonic() - t0
    t0 = time.monotonic()
    opts = [*common, "--max-restarts", str(n_faults)]
    rc, err = fusion_run(plan, run, steps, opts, env)
    attempts, resumes = 1, 0
    while rc != 0 and attempts < 4:  # the coordinator's own fault ends a run: resume it as a user would
        print(f"{kind}: fusion run ended with {rc}: {err.strip().splitlines()[-1] if err.strip() else ''}; resuming",
              file=sys.stderr, flush=True)
        _kill_orphans(run)
        rc, err = fusion_run(plan, run, steps, [*opts, "--resume"], env)
        attempts += 1
        resumes += rc == 0
    t_faulted = time.monotonic() - t0
    fired = {f[3]: os.path.getmtime(f[3]) for f in faults if os.path.exists(f[3])}
    lines = rows(run) if (run / "metrics.jsonl").exists() else []
    step_rows = [r for r in lines if "event" not in r]
    events = [r for r in lines if r.get("event") == "restart"]
    seen = [r["step"] for r in step_rows]
    ref_loss = {r["step"]: r["loss"] for r in rows(ref) if "event" not in r}
    recovery = []
    for t_fault in sorted(fired.values()):
        after = [r["time"] for r in step_rows if r["time"] > t_fault]
        if after:
            recovery.append(min(after) - t_fault)
    return {"kind": kind, "parts": len(parts), "steps": steps, "rc": rc, "faults": len(fired),
            "executor_faults": sum(1 for f in faults if f[0] != "coordinator" and f[3] in fired),
            "stops": sum(1 for f in faults if f[2] == "STOP" and f[3] in fired),
            "restart_events": len(events), "coordinator_resumes": resumes,
            "recovered": (len(events) + resumes) if rc == 0 else len(events),
            "lost_steps": len(set(range(steps)) - set(seen)), "duplicated_steps": len(seen) - len(set(seen)),
            "final_weights_equal_unfaulted": rc == 0 and same_bits(ref / "final.safetensors", run / "final.safetensors"),
            "losses_equal_unfaulted": rc == 0 and all(r["loss"] == ref_loss.get(r["step"]) for r in step_rows),
            "max_recovery_s": round(max(recovery), 2) if recovery else None,
            "mean_recovery_s": round(sum(recovery) / len(recovery), 2) if recovery else None,
            "unfaulted_s": round(t_ref, 1), "faulted_s": round(t_faulted, 1), "run": str(run),
            "error": "" if rc == 0 else err.strip().splitlines()[-1:]}


def _kill_orphans(run: Path) -> None:
    """The executors of a killed ``fusion run`` (they would exit by themselves once they miss the coordinator)."""
    import signal

    try:
        pids = json.loads((run / "pids.json").read_text()).values()
    except (OSError, ValueError):
        return
    for pid in set(pids):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--faults", type=int, default=10, help="faults in all, over both runs (default 10; 50 = full)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--peer-timeout", type=float, default=5.0, help="fusion run --peer-timeout (s)")
    ap.add_argument("--out", default=None, help="work folder (default: a temporary one, kept)")
    a = ap.parse_args()
    if a.faults < 4:
        raise SystemExit("--faults must be at least 4 (each run has one coordinator kill and one executor fault)")
    work = Path(a.out) if a.out else Path(tempfile.mkdtemp(prefix="fusion-chaos-"))
    work.mkdir(parents=True, exist_ok=True)
    rng = random.Random(a.seed)
    executor_faults = a.faults - 2  # one coordinator kill per run
    split = {"pipeline": (executor_faults + 1) // 2, "dp": executor_faults // 2}
    t0 = time.monotonic()
    runs = []
    for kind, n in split.items():
        r = soak(kind, n, rng, work, a.peer_timeout)
        print(json.dumps(r), flush=True)
        runs.append(r)
    rec = [r["max_recovery_s"] for r in runs if r["max_recovery_s"] is not None]
    print(json.dumps({"faults": sum(r["faults"] for r in runs), "recovered": sum(r["recovered"] for r in runs),
                      "lost_steps": sum(r["lost_steps"] for r in runs),
                      "duplicated_steps": sum(r["duplicated_steps"] for r in runs),
                      "final_weights_equal_unfaulted": all(r["final_weights_equal_unfaulted"] for r in runs),
                      "losses_equal_unfaulted": all(r["losses_equal_unfaulted"] for r in runs),
                      "max_recovery_s": max(rec) if rec else None, "seed": a.seed, "work": str(work),
                      "wall_s": round(time.monotonic() - t0, 1)}))


if __name__ == "__main__":
    main()
