"""Chaos soak of ``fusion run --max-restarts`` (issue 28's must-show): inject faults, check nothing is lost.

Run:  OMP_NUM_THREADS=1 python benchmarks/chaos.py [--faults 10] [--seed 0] [--out DIR]
      (from a checkout other than the installed one: PYTHONPATH=. in front; --faults 50 for the full figure)

Two runs of the tiny GPT (``examples/models/gpt.py:tiny``) on loopback, each beside an unfaulted twin:

  pipeline  a 4-part pipeline (4 stages, 1 replica)
  dp        a 2 x 2 data-parallel run (2 stages, 2 replicas; synchronous averaging, restarts cover replicas)

Both runs go at once (``--serial``: one after the other). Faults are drawn with ``--seed``, each run its own
draw; every fault fires once (a marker file, whose mtime is the fault's time):

  KILL@step / STOP@step    an executor (random CompNode) SIGKILLs or SIGSTOPs itself at the start of a step
  KILL@save / STOP@save    ... in the middle of writing its checkpoint (its parameters file written, its
                           optimizer file and sidecar not: ``FUSION_TEST_FAULT`` ``save-N``)
  KILL@start / STOP@start  ... during start-up (setup received, the part not yet ready: ``start-N``, the first
                           start-up resuming at step N or later; the first of them ``start-0``, the run's very
                           first start-up)
  coordinator-KILL+resume  ``fusion run`` itself SIGKILLed right after it committed a checkpoint and before
                           that step's metrics line; this script kills the orphaned executors and resumes with
                           ``--resume`` as a user would (one per run)
  link-cut                 the faulted run runs in its own network namespace; once it trains at a random step, its
                           loopback goes down (every link of the run: coordinator <-> executors and between
                           executors) for ``--peer-timeout`` + 1.5 s, then up again (one per run; skipped, and
                           said so, where namespaces cannot be made: not root, no ``ip``)

About half the executor faults hit a step, a quarter a checkpoint write, a quarter a start-up; SIGSTOP one in
three. Runs checkpoint every 2 steps with ``--max-restarts`` = their injected executor faults + link cut + 2
(spurious failures show in ``restart_events``, beyond the faults that fired).

Final line (JSON): ``faults`` (fired), ``recovered`` (fired faults after which a step was completed and the run
finished), ``lost_steps`` / ``duplicated_steps`` (step lines missing from, or repeated in, metrics.jsonl),
``final_weights_equal_unfaulted`` and ``losses_equal_unfaulted`` (bit for bit, every run), ``max_recovery_s``
(from a fault firing to the first step completed after it: detection, the peer timeout for a stopped one,
the restart's start-up, the replay of the steps since the checkpoint), ``max_detect_s`` (from an executor fault
or link cut firing to the first restart's failure being detected after it: the ``detected`` time of its line in
metrics.jsonl; ``detect_s`` per kind, ``detections`` per run with each reason), ``restart_events``, ``not_fired``
(drawn faults that never fired: a ``start-N`` with no start-up after step N), ``by_kind`` (injected, fired,
recovered, max_recovery_s, detect_s per kind above); one JSON line per run before it.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import shutil
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODEL = str(ROOT / "examples" / "models" / "gpt.py") + ":tiny"
CLUSTER = ROOT / "examples" / "clusters" / "local-4-one-site.yaml"
DEVICES = {"pipeline": [["cpu-0", "cpu-1", "cpu-2", "cpu-3"]], "dp": [["cpu-0", "cpu-1"], ["cpu-2", "cpu-3"]]}
EVERY = 2  # checkpoint every EVERY steps


def build_plan(kind: str, out: Path) -> tuple[Path, list[str]]:
    """The plan of ``kind`` (contiguous cut of the graph's node order into equal stages); its folder and parts."""
    from fusion.cluster import load_cluster
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


#: fault kinds of the breakdown: executor faults are (point, signal); the other two are run-level
KINDS = ("KILL@step", "STOP@step", "KILL@save", "STOP@save", "KILL@start", "STOP@start", "coordinator-KILL+resume",
         "link-cut")


def draw_faults(parts: list[str], n: int, steps: int, rng: random.Random, markers: Path) -> list[tuple]:
    """``n`` executor faults plus one coordinator kill after a checkpoint commit: ``(part, STEP, signal, marker,
    kind)`` with STEP as ``FUSION_TEST_FAULT`` spells it.

    About half fire at the start of a step (distinct steps 1 .. steps-2), a quarter in the middle of a checkpoint
    write (``save-N``, distinct checkpoint steps) and a quarter at start-up (``start-N``: the first start-up
    resuming at step N or later; the first of them ``start-0``, the run's very first start-up). SIGSTOP one in
    three."""
    n_save = min(n // 4, len(range(EVERY, steps - 1, EVERY)))
    n_start = n // 4
    n_step = n - n_save - n_start
    at = [("step", s) for s in rng.sample(range(1, steps - 1), n_step)]
    at += [("save", s) for s in rng.sample(range(EVERY, steps - 1, EVERY), n_save)]
    # a start-N fires at the first start-up resuming at step N or later: N at most the checkpoint that the
    # restart after the last step fault resumes from, so that every one of them fires
    last = max(s for p, s in at if p == "step") // EVERY * EVERY if n_step else EVERY
    at += [("start", 0)] + [("start", s) for s in sorted(rng.choices(range(EVERY, max(EVERY, last) + 1, EVERY),
                                                                    k=n_start - 1))] if n_start else []
    faults = []
    for point, s in at:
        sig = "STOP" if rng.random() < 1 / 3 else "KILL"
        spec = str(s) if point == "step" else f"{point}-{s}"
        faults.append((rng.choice(parts), spec, sig, f"{sig}@{point}"))
    commit = rng.choice([s for s in range(EVERY, steps, EVERY)])
    faults.append(("coordinator", str(commit), "KILL", "coordinator-KILL+resume"))
    return [(p, s, sig, str(markers / f"fault-{i}-{p}-{s}"), kind) for i, (p, s, sig, kind) in enumerate(faults)]


def fusion_run(plan: Path, out: Path, steps: int, extra: list[str], env: dict | None = None,
               timeout: float = 3000, netns: str | None = None) -> tuple[int, str]:
    cmd = [sys.executable, "-m", "fusion.cli", "run", str(plan), "--out", str(out), "--steps", str(steps),
           "--checkpoint-every", str(EVERY), "--no-progress", "--trace", "off", "--threads", "1", *extra]
    if netns:
        cmd = ["ip", "netns", "exec", netns, *cmd]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                       env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})
    return r.returncode, r.stderr


def rows(run: Path) -> list[dict]:
    out = []
    try:
        text = (run / "metrics.jsonl").read_text()
    except OSError:
        return out
    for line in text.splitlines():
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


# -- link cuts: the faulted run inside its own network namespace, its loopback taken down --------------------

def _sh(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True, timeout=20)


def make_netns(name: str) -> str | None:
    """A network namespace ``name`` with its loopback up, or the reason it cannot be made (None = made)."""
    if os.geteuid() != 0:
        return "needs root"
    if not shutil.which("ip"):
        return "needs the ip command"
    try:
        _sh("ip", "netns", "add", name)
        _sh("ip", "netns", "exec", name, "ip", "link", "set", "lo", "up")
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired, OSError) as e:
        drop_netns(name)
        return f"cannot create a network namespace ({getattr(e, 'stderr', b'') or e})"
    return None


def drop_netns(name: str) -> None:
    subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=20)


def cut_link_at(run: Path, netns: str, at_step: int, hold_s: float, marker: str, stop: threading.Event) -> None:
    """Once ``run`` is training live at step ``at_step`` or later (a new step line since the last look, under a
    second old: not restarting; no fault marker in the folder of ``marker`` newer than 10 s), take the namespace's loopback down (every link of the run: coordinator <->
    executors and executor <-> executor) for ``hold_s`` seconds, then up. ``marker`` is created when the link
    goes down (its mtime: the fault's time)."""
    last = None
    while not stop.is_set():
        done = [r for r in rows(run) if "event" not in r]
        quiet = all(time.time() - m.stat().st_mtime > 10 for m in Path(marker).parent.iterdir())  # no fault just now
        if done and last is not None and len(done) > last and max(r["step"] for r in done) >= at_step \
                and time.time() - done[-1]["time"] < 1.0 and quiet:
            break
        last = len(done)
        stop.wait(0.1)
    else:
        return
    Path(marker).touch()
    _sh("ip", "netns", "exec", netns, "ip", "link", "set", "lo", "down")
    log(f"link cut: {netns} lo down at step {done[-1]['step']} for {hold_s:.1f} s")
    time.sleep(hold_s)
    _sh("ip", "netns", "exec", netns, "ip", "link", "set", "lo", "up")


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def soak(kind: str, plan: Path, parts: list[str], n_faults: int, rng: random.Random, work: Path,
         peer_timeout: float, netns: str | None, link_timeout: float = 2.0) -> dict:
    """One run of ``kind`` (its saved ``plan`` of ``parts``) with ``n_faults`` faults in all (one coordinator
    kill, one link cut when ``netns``, the rest executor faults), beside its unfaulted twin."""
    n_exec = n_faults - 1 - (netns is not None)
    steps = max(12, 2 * n_exec + 6)
    markers = work / f"{kind}-markers"
    markers.mkdir()
    faults = draw_faults(parts, n_exec, steps, rng, markers)
    env = {"FUSION_TEST_FAULT": ",".join(":".join(f[:4]) for f in faults)}
    cut = None
    if netns is not None:
        near = {int(f[1]) + d for f in faults if f[1].isdigit() for d in (-1, 0, 1, 2)}  # away from step faults
        cut = (rng.choice([s for s in range(3, steps - 3) if s not in near] or [3]), str(markers / "link-cut"))
        faults.append(("every link", str(cut[0]), "lo down", cut[1], "link-cut"))
    common = ["--peer-timeout", str(peer_timeout), "--link-timeout", str(link_timeout)]
    ref, run = work / f"{kind}-unfaulted", work / f"{kind}-faulted"
    t0 = time.monotonic()
    rc, err = fusion_run(plan, ref, steps, common)
    if rc:
        raise SystemExit(f"the unfaulted {kind} run failed:\n{err[-3000:]}")
    t_ref = time.monotonic() - t0
    log(f"{kind}: unfaulted run of {steps} steps took {t_ref:.0f} s; faulted run with {len(faults)} faults starts")
    t0 = time.monotonic()
    slack = 2  # restarts beyond the injected faults: a spurious failure is counted (restart_events), not fatal
    opts = [*common, "--max-restarts", str(n_exec + (cut is not None) + slack)]
    stop = threading.Event()
    cutter = None
    if cut is not None:
        cutter = threading.Thread(target=cut_link_at, args=(run, netns, cut[0], peer_timeout + 1.5, cut[1], stop),
                                  daemon=True)
        cutter.start()
    rc, err = fusion_run(plan, run, steps, opts, env, netns=netns)
    attempts, resumes, errors = 1, 0, []
    while rc != 0 and attempts < 4:  # the coordinator's own fault ends a run: resume it as a user would
        errors.append(err.strip().splitlines()[-1] if err.strip() else f"status {rc}")
        log(f"{kind}: fusion run ended with {rc}: {errors[-1]}; resuming")
        _kill_orphans(run)
        rc, err = fusion_run(plan, run, steps, [*opts, "--resume"], env, netns=netns)
        attempts += 1
        resumes += rc == 0
    stop.set()
    if cutter is not None:
        cutter.join(30)
    t_faulted = time.monotonic() - t0
    (work / f"{kind}-faulted.stderr").write_text(err)
    fired = {f[3]: os.path.getmtime(f[3]) for f in faults if os.path.exists(f[3])}
    lines = rows(run)
    step_rows = [r for r in lines if "event" not in r]
    events = [r for r in lines if r.get("event") == "restart"]
    seen = [r["step"] for r in step_rows]
    ref_loss = {r["step"]: r["loss"] for r in rows(ref) if "event" not in r}
    per_kind: dict[str, dict] = {}
    recovery = []
    detections = []  # (kind, detect_s, the restart's reason)
    for f in faults:
        k = per_kind.setdefault(f[4], {"injected": 0, "fired": 0, "recovered": 0, "max_recovery_s": None,
                                       "detect_s": []})
        k["injected"] += 1
        if f[3] not in fired:
            continue
        k["fired"] += 1
        if f[0] != "coordinator":  # detection: from the fault firing to the first restart detected after it
            first = min((e for e in events if (e.get("detected") or 0) >= fired[f[3]]), default=None,
                        key=lambda e: e["detected"])
            if first is not None:
                dt = round(first["detected"] - fired[f[3]], 2)
                k["detect_s"].append(dt)
                detections.append((f[4], dt, first["reason"][:300]))
        after = [r["time"] for r in step_rows if r["time"] > fired[f[3]]]
        if after and rc == 0:
            k["recovered"] += 1
            dt = round(min(after) - fired[f[3]], 2)
            recovery.append(dt)
            k["max_recovery_s"] = max(dt, k["max_recovery_s"] or 0.0)
    ok = rc == 0
    cut_restart = None  # the restart the link cut caused: the first restart event after the cut, its reason
    if cut is not None and cut[1] in fired:
        after = [e for e in events if e["time"] > fired[cut[1]]]
        cut_restart = after[0]["reason"] if after else None
    return {"kind": kind, "parts": len(parts), "steps": steps, "rc": rc, "faults": len(fired),
            "injected": len(faults), "not_fired": [f"{f[0]}:{f[1]}:{f[2]}" for f in faults if f[3] not in fired],
            "recovered": sum(k["recovered"] for k in per_kind.values()),
            "restart_events": len(events), "coordinator_resumes": resumes,
            "lost_steps": len(set(range(steps)) - set(seen)), "duplicated_steps": len(seen) - len(set(seen)),
            "final_weights_equal_unfaulted": ok and same_bits(ref / "final.safetensors", run / "final.safetensors"),
            "losses_equal_unfaulted": ok and all(r["loss"] == ref_loss.get(r["step"]) for r in step_rows),
            "max_recovery_s": max(recovery) if recovery else None,
            "mean_recovery_s": round(sum(recovery) / len(recovery), 2) if recovery else None,
            "restart_recovery_s": [e["recovery_s"] for e in events], "by_kind": per_kind,
            "detections": detections,
            "link_cut_restart_reason": cut_restart,
            "unfaulted_s": round(t_ref, 1), "faulted_s": round(t_faulted, 1), "run": str(run),
            "ended": errors, "error": "" if ok else err.strip().splitlines()[-1:]}


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
    ap.add_argument("--link-timeout", type=float, default=2.0, help="fusion run --link-timeout (s; 0: off)")
    ap.add_argument("--no-netns", action="store_true", help="no link cuts (no network namespaces)")
    ap.add_argument("--serial", action="store_true", help="the two runs one after the other (default: at once)")
    ap.add_argument("--out", default=None, help="work folder (default: a temporary one, kept)")
    a = ap.parse_args()
    if a.faults < 6:
        raise SystemExit("--faults must be at least 6 (each run has one coordinator kill and executor faults)")
    work = Path(a.out) if a.out else Path(tempfile.mkdtemp(prefix="fusion-chaos-"))
    work.mkdir(parents=True, exist_ok=True)
    rng = random.Random(a.seed)
    split = {"pipeline": (a.faults + 1) // 2, "dp": a.faults // 2}
    names = {k: f"fzchaos{os.getpid() % 100000}{k[0]}" for k in split}
    why_not = "--no-netns" if a.no_netns else None
    made = []
    for k in split:
        why_not = why_not or make_netns(names[k])
        if why_not is None:
            made.append(names[k])
    if why_not:
        log(f"link cuts skipped: {why_not}")
    netns = {k: names[k] if not why_not else None for k in split}
    seeds = {k: rng.randrange(2 ** 31) for k in split}  # each run its own draw, the same whether serial or not
    t0 = time.monotonic()
    results: dict[str, dict] = {}
    plans = {k: build_plan(k, work) for k in split}  # here, one at a time: tracing a model is not thread-safe

    def one(k: str) -> None:
        results[k] = soak(k, *plans[k], split[k], random.Random(seeds[k]), work, a.peer_timeout, netns[k],
                            a.link_timeout)
        print(json.dumps(results[k]), flush=True)

    try:
        if a.serial:
            for k in split:
                one(k)
        else:
            threads = [threading.Thread(target=one, args=(k,)) for k in split]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
    finally:
        for n in made:
            drop_netns(n)
    runs = [results[k] for k in split if k in results]
    if len(runs) < len(split):
        raise SystemExit("a run did not finish (see above)")
    by_kind: dict[str, dict] = {}
    for r in runs:
        for k, v in r["by_kind"].items():
            b = by_kind.setdefault(k, {"injected": 0, "fired": 0, "recovered": 0, "max_recovery_s": None,
                                       "detect_s": []})
            for f in ("injected", "fired", "recovered"):
                b[f] += v[f]
            b["detect_s"] = sorted(b["detect_s"] + v["detect_s"])
            if v["max_recovery_s"] is not None:
                b["max_recovery_s"] = max(v["max_recovery_s"], b["max_recovery_s"] or 0.0)
    rec = [r["max_recovery_s"] for r in runs if r["max_recovery_s"] is not None]
    print(json.dumps({"faults": sum(r["faults"] for r in runs), "recovered": sum(r["recovered"] for r in runs),
                      "lost_steps": sum(r["lost_steps"] for r in runs),
                      "duplicated_steps": sum(r["duplicated_steps"] for r in runs),
                      "final_weights_equal_unfaulted": all(r["final_weights_equal_unfaulted"] for r in runs),
                      "losses_equal_unfaulted": all(r["losses_equal_unfaulted"] for r in runs),
                      "max_recovery_s": max(rec) if rec else None,
                      "max_detect_s": max((d for r in runs for v in r["by_kind"].values() for d in v["detect_s"]),
                                          default=None),
                      "restart_events": sum(r["restart_events"] for r in runs),
                      "not_fired": sum(len(r["not_fired"]) for r in runs), "by_kind": by_kind,
                      "link_cuts": why_not or "made", "seed": a.seed, "work": str(work),
                      "wall_s": round(time.monotonic() - t0, 1)}))


if __name__ == "__main__":
    main()
