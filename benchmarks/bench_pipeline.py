"""Pipeline benchmark: fusion's CompNode processes against torch.distributed.pipelining, and against its own plan.

All measured in one run, on this host, loopback only:

1. ``throughput_vs_torch_pipelining_{2,4}``: the same model (a stack of
   pre-norm MLP blocks with a classifier head), the same split into 2 and 4
   stages, the same 8 micro-batches, SGD, one thread per process; the best
   schedule of each side: fusion's ``gpipe``, ``1f1b`` and ``zb1`` against
   ``torch.distributed.pipelining``'s ``ScheduleGPipe``, ``Schedule1F1B``,
   ``ScheduleInterleaved1F1B`` and ``ScheduleInterleavedZeroBubble`` (the
   interleaved ones with two virtual stages per rank, i.e. the model cut
   into twice as many stages) on gloo. Each schedule's iteration time is the
   median over ``--rounds`` rounds (every round runs every schedule of both
   sides in turn, so load from other work on the host falls on all of them);
   the ratio is torch's best median over fusion's best median. Both train
   from the same weights on the same batches, and every schedule's losses
   are checked against fusion's GPipe. CPU seconds per iteration (median
   over rounds, torch/fusion, each side's fastest schedule) are reported too,
   as ``cpu_efficiency_vs_torch_pipelining_{2,4}``: less sensitive to load
   from other work on the host. The smaller of the two stage counts' ratios
   is the headline ``throughput_vs_torch_pipelining``.
2. ``predicted_over_measured``: the *compiler's* prediction against the
   measured iteration. ``local-4-two-sites`` (two sites, 1 Gbit/s inside,
   20 Mbit/s and 30 ms between) with every device's lambda fitted on this
   host by ``fusion profile --threads 1 --batch ROWS`` (with the per-node,
   per-message and per-iteration step costs it fits, :mod:`fusion.cost.profile`); the model (four
   pre-norm MLP blocks of width 1024 and a head, 16 rows x 16 micro-batches)
   is compiled by ``compile_model(strategy="equal-flops")`` into four parts
   on the four devices, with the model's per-node forward and backward times
   measured on this host (``fusion profile --model --threads 1``,
   :mod:`fusion.cost.node_times`, issue 17) so the estimator prices each node
   at its measured time, and ``plan.predicted["iteration_s"]`` (Eq. 1-4 of
   ``fusion/cost/estimate.py``) is divided by the iteration measured with
   ``--emulate-links`` (median of the steps of a round; the figure is the
   median over ``--rounds`` rounds). ``replay_over_measured`` is the runtime's schedule
   replay (:mod:`fusion.executors.runtime.replay`) with alpha-beta links and per-part
   compute times from a warm-up run without emulation. OP-Fence's own plan
   for the same cluster (two parts inside site a) is measured the same way,
   in the same rounds (``opfence_predicted_over_measured``). The same two cuts
   priced by FLOPs / lambda alone (no node times) give
   ``flops_predicted_over_measured`` and ``opfence_flops_predicted_over_measured``; for OP-Fence the
   benchmark also prints where the iteration goes (the executors' ``done``
   stats: forward, backward, waiting, optimizer, and the time outside every
   part's span) and its executors' CPU seconds against their busy wall time.
3. ``bottleneck_link_utilization``: bytes moved over the slowest link (both
   directions of the 20 Mbit/s pair, which GPipe uses in turn: activations
   forward, then gradients back) divided by its capacity times the measured
   iteration time.
4. ``curve_overhead``: the 2-stage throughput pipeline (as in 1.) with every
   link authenticated and encrypted by CURVE (``fusion run``'s default) over
   the same without (``--insecure``): samples/s with / without, the median
   over ``--rounds`` rounds that run both back to back (target >= 0.95);
   also the best rounds' ratio and the CPU-time ratio. The losses of the two
   must be the same bits.

Prints human lines, then one JSON line.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

CLASSES = 16
#: torch.distributed.pipelining schedules the throughput part runs: name -> (class, virtual stages per rank)
TORCH_SCHEDULES = {"gpipe": ("ScheduleGPipe", 1), "1f1b": ("Schedule1F1B", 1),
                   "interleaved1f1b": ("ScheduleInterleaved1F1B", 2),
                   "interleavedzb": ("ScheduleInterleavedZeroBubble", 2)}
#: fusion's schedules (ir/schedule.py); ``interleaved`` runs two virtual stages per process, as torch's interleaved
FUSION_SCHEDULES = ("gpipe", "1f1b", "zb1", "interleaved")
CLUSTER_YAML = Path(__file__).resolve().parents[1] / "examples" / "clusters" / "local-4-two-sites.yaml"


# -- the model, twice: op-node graph (fusion) and nn.Module stages (torch) -------------------------

def build_model(d: int, hidden: int, blocks: int, rows: int, seed: int = 0):
    import torch

    from fusion.ir.builder import GraphBuilder

    b = GraphBuilder()
    h, y = b.input("x"), b.label("y")
    for i in range(blocks):
        n = b.module(f"ln{i}", "torch.nn.LayerNorm", h, normalized_shape=d)
        m = b.module(f"fc1_{i}", "torch.nn.Linear", n, in_features=d, out_features=hidden)
        m = b.function(f"gelu{i}", "torch.nn.functional.gelu", m)
        m = b.module(f"fc2_{i}", "torch.nn.Linear", m, in_features=hidden, out_features=d)
        h = b.function(f"res{i}", "operator.add", h, m)
    h = b.module("lnf", "torch.nn.LayerNorm", h, normalized_shape=d)
    o = b.module("head", "torch.nn.Linear", h, in_features=d, out_features=CLASSES)
    b.loss("loss", "torch.nn.functional.cross_entropy", o, y)
    return b.build(example={"x": torch.randn(rows, d), "y": torch.randint(0, CLASSES, (rows,))}, seed=seed)


def split(blocks: int, stages: int) -> dict[str, str]:
    per = blocks // stages
    a = {"x": "p0"}
    for i in range(blocks):
        for n in (f"ln{i}", f"fc1_{i}", f"gelu{i}", f"fc2_{i}", f"res{i}"):
            a[n] = f"p{min(i // per, stages - 1)}"
    for n in ("y", "lnf", "head", "loss"):
        a[n] = f"p{stages - 1}"
    return a


def batch(step: int, rows: int, d: int) -> dict[str, np.ndarray]:
    g = np.random.default_rng([3, step])
    return {"x": g.standard_normal((rows, d)).astype(np.float32), "y": g.integers(0, CLASSES, rows).astype(np.int64)}


def torch_stage(weights: dict, d: int, hidden: int, blocks: int, stage: int, stages: int):
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self, i):
            super().__init__()
            self.ln, self.fc1, self.fc2 = nn.LayerNorm(d), nn.Linear(d, hidden), nn.Linear(hidden, d)
            for mod, name in ((self.ln, f"ln{i}"), (self.fc1, f"fc1_{i}"), (self.fc2, f"fc2_{i}")):
                mod.load_state_dict({k: torch.from_numpy(weights[f"{name}.{k}"].copy()) for k in ("weight", "bias")})

        def forward(self, x):
            return x + self.fc2(nn.functional.gelu(self.fc1(self.ln(x))))

    per = blocks // stages
    mods = [Block(i) for i in range(stage * per, (stage + 1) * per)]
    if stage == stages - 1:
        lnf, head = nn.LayerNorm(d), nn.Linear(d, CLASSES)
        lnf.load_state_dict({k: torch.from_numpy(weights[f"lnf.{k}"].copy()) for k in ("weight", "bias")})
        head.load_state_dict({k: torch.from_numpy(weights[f"head.{k}"].copy()) for k in ("weight", "bias")})
        mods += [lnf, head]
    return nn.Sequential(*mods)


def torch_pipeline_step(sched, rank: int, world: int, x, target, train: bool = True) -> float | None:
    """One step of a ``torch.distributed.pipelining`` schedule on this rank: the first rank feeds the whole batch's
    input ``x`` (the schedule cuts it into micro-batches), the last the ``target`` and returns the mean of its
    micro-batch losses (None on the other ranks); ``train=False``: forward only (``schedule.eval``)."""
    call = sched.step if train else sched.eval
    losses: list = []
    if rank == 0:
        call(x)
    elif rank == world - 1:
        call(target=target, losses=losses)
    else:
        call()
    return float(sum(float(v.detach()) for v in losses) / len(losses)) if rank == world - 1 else None


def torch_worker(args) -> None:
    """One rank of the torch.distributed.pipelining anchor."""
    import torch
    import torch.distributed as dist
    from safetensors.numpy import load_file
    from torch.distributed import pipelining as tp

    torch.set_num_threads(1)
    r, n = args.rank, args.world
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.port}", rank=r, world_size=n)
    weights = load_file(str(Path(args.plan) / "weights.safetensors"))
    cls, virtual = TORCH_SCHEDULES[args.schedule]
    total = n * virtual  # interleaved: stage s on rank s % n, as torch places them
    modules = [torch_stage(weights, args.d, args.hidden, args.blocks, s, total) for s in range(r, total, n)]
    stages = [tp.PipelineStage(m, s, total, torch.device("cpu")) for m, s in zip(modules, range(r, total, n))]
    loss_fn = lambda out, y: torch.nn.functional.cross_entropy(out, y)  # noqa: E731
    sched = getattr(tp, cls)(stages if virtual > 1 else stages[0], args.micro, loss_fn=loss_fn)
    opt = torch.optim.SGD([q for m in modules for q in m.parameters()], lr=0.01)
    losses = []
    t0 = time.perf_counter()
    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            dist.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
        b = batch(step, args.rows * args.micro, args.d)
        loss = torch_pipeline_step(sched, r, n, torch.from_numpy(b["x"]), torch.from_numpy(b["y"]))
        if loss is not None:
            losses.append(loss)
        opt.step()
        opt.zero_grad()
    cpu = (time.process_time() - c0) / args.steps
    dist.barrier()
    dt = (time.perf_counter() - t0) / args.steps
    Path(f"{args.out}.cpu{r}").write_text(json.dumps(cpu))
    if r == n - 1:
        Path(args.out).write_text(json.dumps({"iteration_s": dt, "losses": losses}))
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_torch(plan_dir: Path, stages: int, cfg, tmp: Path, schedule: str = "gpipe") -> dict:
    port, out = free_port(), tmp / f"torch-{stages}-{schedule}.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, __file__, "--torch-worker", "--rank", str(r), "--world", str(stages),
                               "--schedule", schedule,
                               "--port", str(port), "--plan", str(plan_dir), "--out", str(out), "--d", str(cfg.d),
                               "--hidden", str(cfg.hidden), "--blocks", str(cfg.blocks), "--rows", str(cfg.rows),
                               "--micro", str(cfg.micro), "--steps", str(cfg.steps), "--warmup", str(cfg.warmup)], env=env)
             for r in range(stages)]
    try:
        for p in procs:
            if p.wait(600) != 0:
                raise RuntimeError(f"torch pipelining rank exited with {p.returncode}")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    res = json.loads(out.read_text())
    res["cpu_per_iteration_s"] = sum(json.loads(Path(f"{out}.cpu{r}").read_text()) for r in range(stages)) / stages
    return res


def run_fusion(plan_dir: Path, run_dir: Path, steps: int, warmup: int, rows: int, d: int, emulate: bool = False,
               cpu: dict | None = None, curve: bool = False, heap: str = "steady") -> list:
    """Steps of a local run (after ``warmup``); ``cpu`` gets the executors' CPU seconds per measured iteration;
    ``heap`` is every executor's ``fusion executor --heap`` (``--heap`` of this benchmark)."""
    from fusion.executors.runtime.coordinator import CoordinatorConfig
    from fusion.executors.runtime.launcher import LocalCluster

    with LocalCluster(plan_dir, run_dir, CoordinatorConfig(emulate_links=emulate, peer_timeout_s=60), threads=1,
                      trace=True, verbose=0, curve=curve, executor_args=["--heap", heap]) as lc:
        lc.start()
        reports = [lc.coordinator.step(batch(s, rows, d)) for s in range(warmup)]
        pids = sorted({pr.pid for pr in lc.processes.values()})  # interleaved: one process runs several parts
        c0 = {pid: _proc_cpu_s(pid) for pid in pids}
        reports = [lc.coordinator.step(batch(s, rows, d)) for s in range(warmup, warmup + steps)]
        if cpu is not None:
            cpu["per_iteration_s"] = sum(_proc_cpu_s(pid) - c0[pid] for pid in pids) / steps / len(pids)
    return reports


def save_plan_for(model, stages: int, blocks: int, micro: int, tmp: Path, name: str, cluster=None,
                  schedule: str = "gpipe") -> Path:
    from fusion.executors.runtime.launcher import hand_plan
    from fusion.plan import OptimizerConfig
    from fusion.plan import save_plan

    devices = {f"p{i}": f"cpu-{i}" for i in range(stages)} if cluster else None
    parts = stages
    if schedule == "interleaved":  # two virtual stages per process: 2 x stages parts, round-robin over the devices
        from fusion.executors.runtime.launcher import local_cluster_dict

        parts = 2 * stages
        cluster = local_cluster_dict([f"d{i}" for i in range(stages)])
        devices = {f"p{i}": f"local-{i % stages}" for i in range(parts)}
    plan = hand_plan(model, split(blocks, parts), schedule=schedule, micro_batches=micro,
                     optimizer=OptimizerConfig("sgd", lr=0.01), cluster=cluster, devices=devices)
    return save_plan(plan, tmp / name, params=model.params)


def _proc_cpu_s(pid: int) -> float:
    f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")


def throughput(cfg, tmp: Path) -> dict:
    """Every schedule of both sides in every round; each schedule's median over rounds, each side's best
    schedule counts. Returns stages -> (time ratio torch/fusion, CPU ratio torch/fusion, details)."""
    model = build_model(cfg.d, cfg.hidden, cfg.blocks, cfg.rows)
    rows = cfg.rows * cfg.micro
    out = {}
    for stages in (2, 4):
        plans = {s: save_plan_for(model, stages, cfg.blocks, cfg.micro, tmp, f"plan-{stages}-{s}", schedule=s)
                 for s in cfg.fusion_schedules}
        ours_it: dict = {s: [] for s in cfg.fusion_schedules}
        ours_cpu: dict = {s: [] for s in cfg.fusion_schedules}
        theirs_it: dict = {s: [] for s in cfg.torch_schedules}
        theirs_cpu: dict = {s: [] for s in cfg.torch_schedules}
        reference = None  # fusion GPipe's losses: every schedule of both sides must train the same
        for rnd in range(cfg.rounds):
            for s in cfg.fusion_schedules:
                cpu: dict = {}
                ours = run_fusion(plans[s], tmp / f"run-{stages}-{s}-{rnd}", cfg.steps, cfg.warmup, rows, cfg.d, cpu=cpu,
                                  heap=cfg.heap)
                losses = [r.loss for r in ours]
                reference = losses if reference is None else reference
                np.testing.assert_allclose(losses, reference, rtol=1e-4, err_msg=f"fusion {s} trained differently")
                ours_it[s].append(sum(r.iteration_s for r in ours) / len(ours))
                ours_cpu[s].append(cpu["per_iteration_s"])
                print(f"[throughput] {stages} stages, round {rnd}: fusion {s:<16} {rows / ours_it[s][-1]:7.1f} samples/s "
                      f"({ours_cpu[s][-1]:.3f} CPU-s/iteration)", flush=True)
            for s in cfg.torch_schedules:
                theirs = run_torch(plans[cfg.fusion_schedules[0]], stages, cfg, tmp, s)
                np.testing.assert_allclose(theirs["losses"][cfg.warmup:], reference, rtol=1e-4,
                                           err_msg=f"torch pipelining {s} and fusion trained differently")
                theirs_it[s].append(theirs["iteration_s"])
                theirs_cpu[s].append(theirs["cpu_per_iteration_s"])
                print(f"[throughput] {stages} stages, round {rnd}: torch {TORCH_SCHEDULES[s][0]:<29} "
                      f"{rows / theirs_it[s][-1]:7.1f} samples/s ({theirs_cpu[s][-1]:.3f} CPU-s/iteration)", flush=True)
        med_ours = {s: statistics.median(v) for s, v in ours_it.items()}
        med_theirs = {s: statistics.median(v) for s, v in theirs_it.items()}
        best_ours, best_theirs = min(med_ours, key=med_ours.get), min(med_theirs, key=med_theirs.get)
        ratio = med_theirs[best_theirs] / med_ours[best_ours]
        cpu_ratio = statistics.median(theirs_cpu[best_theirs]) / statistics.median(ours_cpu[best_ours])
        detail = {"fusion_samples_per_s": {s: round(rows / t, 1) for s, t in med_ours.items()},
                  "torch_samples_per_s": {s: round(rows / t, 1) for s, t in med_theirs.items()},
                  "best_fusion": best_ours, "best_torch": best_theirs}
        out[stages] = (ratio, cpu_ratio, detail)
        print(f"[throughput] {stages} stages, medians of {cfg.rounds} rounds: fusion " +
              ", ".join(f"{s} {rows / t:.1f}" for s, t in med_ours.items()) + "; torch " +
              ", ".join(f"{s} {rows / t:.1f}" for s, t in med_theirs.items()) +
              f" samples/s; best {best_ours} vs best {best_theirs}: ratio {ratio:.3f}; CPU-s per iteration "
              f"torch/fusion {cpu_ratio:.3f}; losses agree to 1e-4", flush=True)
    return out


def curve_overhead(cfg, tmp: Path) -> dict:
    """Throughput of the 2-stage pipeline with CURVE on every link over the same without.

    Each round runs both back to back (which goes first alternates), so the two see about the same load from
    other work on the host; the median of the rounds' ratios is ``curve_overhead``. The best round of each
    side and the executors' CPU seconds per iteration (median; less sensitive to load) are reported too.
    """
    model = build_model(cfg.d, cfg.hidden, cfg.blocks, cfg.rows)
    rows = cfg.rows * cfg.micro
    plan_dir = save_plan_for(model, 2, cfg.blocks, cfg.micro, tmp, "plan-curve")
    its: dict[bool, list] = {True: [], False: []}
    cpus: dict[bool, list] = {True: [], False: []}
    for rnd in range(cfg.rounds):
        losses = {}
        for curve in ((True, False) if rnd % 2 == 0 else (False, True)):
            cpu: dict = {}
            rs = run_fusion(plan_dir, tmp / f"run-curve-{curve}-{rnd}", cfg.steps, cfg.warmup, rows, cfg.d, cpu=cpu,
                            curve=curve, heap=cfg.heap)
            its[curve].append(sum(r.iteration_s for r in rs) / len(rs))
            cpus[curve].append(cpu["per_iteration_s"])
            losses[curve] = [r.loss for r in rs]
            print(f"[curve] round {rnd}: {'CURVE   ' if curve else 'insecure'} {rows / its[curve][-1]:7.1f} samples/s "
                  f"({cpus[curve][-1]:.3f} CPU-s/iteration)", flush=True)
        assert losses[True] == losses[False], "CURVE changed what was trained"
    ratios = [b / a for a, b in zip(its[True], its[False])]
    out = {"curve_overhead": statistics.median(ratios), "best": min(its[False]) / min(its[True]),
           "cpu": statistics.median(cpus[False]) / statistics.median(cpus[True]), "rounds": ratios}
    print(f"[curve] samples/s with CURVE / without: median of {len(ratios)} paired rounds {out['curve_overhead']:.3f} "
          f"(rounds {', '.join(f'{r:.2f}' for r in ratios)}), best rounds {out['best']:.3f}; CPU-s per iteration "
          f"without / with {out['cpu']:.3f}; losses the same bits", flush=True)
    return out


def fitted_cluster(cfg):
    """local-4-two-sites with every device's lambda fitted on this host
    (``fusion profile --threads 1 --batch ROWS``, ROWS = the micro-batch's rows: small GEMMs run slower
    than the default batch of 64 suggests): the four CPU "devices" are this host's cores, each
    executor runs one thread."""
    from dataclasses import replace

    from fusion.cluster import load_cluster
    from fusion.cost.profile import profile_host

    cluster = load_cluster(str(CLUSTER_YAML))
    prof = profile_host(cluster.devices[0].peak_flops, "cpu", batch=cfg.emu_rows, threads=1)
    over = {"node_overhead_s": prof.node_overhead_s, "message_overhead_s": prof.message_overhead_s,
            "step_overhead_s": prof.step_overhead_s, "feed_overhead_s": prof.feed_overhead_s,
            "feed_byte_s": prof.feed_byte_s, "optimizer_byte_s": tuple(prof.optimizer_byte_s)} if cfg.overheads else {}
    cluster.devices = [replace(d, lam=prof.lam, **over) for d in cluster.devices]
    print(f"[emulated] fusion profile --threads 1 --batch {cfg.emu_rows}: {prof.fitted_flops / 1e9:.2f} GFLOP/s of a nominal "
          f"{prof.peak_flops / 1e9:.0f} GFLOPS, lambda {prof.lam:.3f} (R^2 {prof.r2:.4f}, t0 {prof.overhead_s * 1e6:.0f} us); "
          f"{prof.node_overhead_s * 1e6:.1f} us per node (interpreted {prof.node_overhead_interpreted_s * 1e6:.1f}), "
          f"{prof.message_overhead_s * 1e6:.1f} us per message; step round trip {prof.step_overhead_s * 1e6:.0f} us "
          f"+ {prof.feed_overhead_s * 1e6:.1f} us per fed array + {prof.feed_byte_s * 1e9:.2f} ns per fed byte; "
          f"SGD step {prof.optimizer_byte_s[0] * 1e12:.0f} ps per parameter byte"
          + ("" if cfg.overheads else " (not used: --no-overheads)"),
          flush=True)
    return cluster, prof


def _without_overheads(cluster):
    """A copy of ``cluster`` with every device's fitted fixed costs at 0 (lambda kept): per node, per message,
    and the step terms (round trip, feeds, optimizer)."""
    from copy import copy
    from dataclasses import replace

    out = copy(cluster)
    out.devices = [replace(d, node_overhead_s=0.0, message_overhead_s=0.0, step_overhead_s=0.0, feed_overhead_s=0.0,
                           feed_byte_s=0.0, optimizer_byte_s=(0.0, 0.0, 0.0)) for d in cluster.devices]
    return out


def node_times_for(model, prof):
    """(table, seconds it took): ``fusion profile --model --threads 1`` on this host for ``model``, recorded at
    the fitted speed ``prof.fitted_flops`` (the speed of every device of :func:`fitted_cluster`)."""
    from fusion.compile import _ensure_shapes
    from fusion.cost.node_times import measure_node_times

    _ensure_shapes(model)
    t0 = time.perf_counter()
    table = measure_node_times(model.graph, "cpu", 1, speed_flops=prof.fitted_flops, progress=False)
    return table, time.perf_counter() - t0


def price_cut(model, cluster, plan, micro: int, opt) -> dict:
    """The FLOP-only estimator (FLOPs / lambda plus the cluster's fitted overheads, no node times) on ``plan``'s
    cut, devices and recomputation: ``{"iteration_s", "compute_s": {part: s per micro-batch}}``. The iteration is
    priced as the plan reports its own: the schedule simulated with the estimator's numbers when the plan keeps
    Eq. 3 apart (``predicted["eq3_iteration_s"]``, cost model 2), else Eq. 1-4."""
    from fusion.cost.estimate import CostModel, optimizer_slots, samples_per_micro_batch
    from fusion.cost.flops import measure_costs
    from fusion.cost.schedules import price_schedule

    cm = CostModel.build(model.graph, measure_costs(model.graph), cluster, micro, plan.schedule,
                         optimizer_slots(opt.name, opt.momentum), samples_per_micro_batch(model.graph))
    names = list(plan.parts)
    node_part = np.array([names.index(plan.assignment[n]) for n in cm.names], dtype=np.int64)
    devices = [cluster.index(plan.parts[p].device) for p in names]
    rc = np.array([plan.parts[p].recompute for p in names], dtype=bool)
    price, est = price_schedule(cm, plan.schedule, node_part, devices, rc)
    simulated = "eq3_iteration_s" in plan.predicted
    return {"iteration_s": float(price.iteration_s if simulated else est.iteration_s),
            "compute_s": {p: pe.compute_s for p, pe in zip(names, est.parts)}}


def same_cut(a, b) -> bool:
    """Whether two plans put every node on the same device."""
    return all(a.parts[a.assignment[n]].device == b.parts[b.assignment[n]].device for n in a.assignment)


def breakdown(reports) -> dict:
    """Where an iteration's wall time goes, from the executors' ``done`` stats: per part the medians over the
    steps of its forward, backward, idle (waiting for data), tied-gradient sync and optimizer seconds and its
    span (first action to ``done``); ``coordinator.outside_s``: the step's time outside every part's span (the
    step message out, feeds decoded, ``done`` back)."""
    out: dict = {}
    for p in reports[0].parts:
        rows = [r.parts[p] for r in reports]
        out[p] = {k: statistics.median(f(x) for x in rows) for k, f in (
            ("forward_s", lambda x: sum(x["forward_s"])), ("backward_s", lambda x: sum(x["backward_s"])),
            ("idle_s", lambda x: x["idle_s"]), ("sync_s", lambda x: x["sync_s"]),
            ("optimizer_s", lambda x: x["optimizer_s"]), ("span_s", lambda x: x["t_end"] - x["t_start"]))}
    out["coordinator"] = {"outside_s": statistics.median(
        r.iteration_s - (max(v["t_end"] for v in r.parts.values()) - min(v["t_start"] for v in r.parts.values()))
        for r in reports)}
    return out


def emulated(cfg, tmp: Path) -> tuple[float, float, float, dict]:
    """Compile with the compiler on the fitted cluster, then measure with emulated links.

    Returns (compiler prediction / measured, replay prediction / measured, bottleneck utilization, details).
    """
    from fusion.compile import compile_model
    from fusion.plan import OptimizerConfig
    from fusion.executors.runtime.replay import replay
    from fusion.plan import load_plan, save_plan

    cluster, prof = fitted_cluster(cfg)
    model = build_model(cfg.emu_d, cfg.emu_d, 4, cfg.emu_rows)
    # per-node forward/backward seconds on this host (fusion profile --model --threads 1), at the fitted speed
    # of the cluster's devices, so the estimator prices each node at its measured time (factor 1)
    times, t_prof = node_times_for(model, prof)
    opt = OptimizerConfig("sgd", lr=0.01)
    # equal-flops: four parts on the four devices (OP-Fence, which also weighs the 20 Mbit/s link, is reported below)
    plan = compile_model(model, cluster, strategy="equal-flops", micro_batches=cfg.emu_micro, schedule="gpipe",
                         optimizer=opt, node_times=times)
    plan_dir = save_plan(plan, tmp / "plan-emu", params=model.params)
    plan = load_plan(plan_dir)
    compiler_pred = float(plan.predicted["iteration_s"])
    rows = cfg.emu_rows * cfg.emu_micro
    # the runtime's replay predictor: per-part compute times from a warm-up run without emulation
    prof_run = run_fusion(plan_dir, tmp / "run-profile", cfg.emu_steps, cfg.warmup, rows, cfg.emu_d, heap=cfg.heap)
    compute, tail = {}, {}
    for p in plan.parts:
        compute[p] = {"F": statistics.median(x for r in prof_run for x in r.parts[p]["forward_s"]),
                      "B": statistics.median(x for r in prof_run for x in r.parts[p]["backward_s"])}
        tail[p] = statistics.median(r.parts[p]["sync_s"] + r.parts[p]["optimizer_s"] for r in prof_run)
    pred = replay(plan, compute, tail_s=tail)
    # the plan OP-Fence itself picks on this cluster, measured the same way, in the same rounds
    of = compile_model(model, cluster, strategy="opfence", micro_batches=cfg.emu_micro, schedule="gpipe",
                       optimizer=opt, node_times=times)
    of_dir = save_plan(of, tmp / "plan-emu-opfence", params=model.params)
    of_pred = float(of.predicted["iteration_s"])
    # the FLOP-only estimator (FLOPs / lambda + the fitted overheads) on the same two cuts, and the plans it picks
    ef_flops, of_flops = (price_cut(model, cluster, p, cfg.emu_micro, opt) for p in (plan, of))
    ef_flops_plan, of_flops_plan = (compile_model(model, cluster, strategy=s, micro_batches=cfg.emu_micro,
                                                  schedule="gpipe", optimizer=opt) for s in ("equal-flops", "opfence"))
    # the same two compiles with lambda only (no per-node / per-message term), for comparison
    bare = lambda strategy: compile_model(  # noqa: E731
        model, _without_overheads(cluster),
        strategy=strategy, micro_batches=cfg.emu_micro, schedule="gpipe", optimizer=opt)
    bare_ef, bare_of = bare("equal-flops"), bare("opfence")
    rounds, of_rounds, of_reports, of_cpu = [], [], [], []
    for rnd in range(cfg.rounds):
        meas = run_fusion(plan_dir, tmp / f"run-emulated-{rnd}", cfg.emu_steps, cfg.warmup, rows, cfg.emu_d, emulate=True,
                          heap=cfg.heap)
        rounds.append(statistics.median(r.iteration_s for r in meas))
        cpu: dict = {}
        of_meas_r = run_fusion(of_dir, tmp / f"run-emulated-opfence-{rnd}", cfg.emu_steps, cfg.warmup, rows, cfg.emu_d,
                               emulate=True, cpu=cpu, heap=cfg.heap)
        of_cpu.append(cpu["per_iteration_s"])
        of_reports += of_meas_r
        of_rounds.append(statistics.median(r.iteration_s for r in of_meas_r))
        print(f"[emulated] round {rnd}: equal-flops measured {rounds[-1] * 1e3:.1f} ms (predicted/measured "
              f"{compiler_pred / rounds[-1]:.3f}, FLOP-only {ef_flops['iteration_s'] / rounds[-1]:.3f}), OP-Fence "
              f"measured {of_rounds[-1] * 1e3:.1f} ms (predicted/measured {of_pred / of_rounds[-1]:.3f}, FLOP-only "
              f"{of_flops['iteration_s'] / of_rounds[-1]:.3f})", flush=True)
    measured = statistics.median(rounds)
    of_meas = statistics.median(of_rounds)
    # the compiler's compute prediction per part and micro-batch against the warm-up's measured F + B
    comp_pred = {p: plan.predicted["parts"][p]["compute_s"] for p in plan.parts}
    comp_meas = {p: compute[p]["F"] + compute[p]["B"] for p in plan.parts}
    # the slowest link among the part pairs that carry traffic (both directions)
    cdict = plan.cluster
    devs = [d["name"] for d in cdict["devices"]]
    bw = lambda a, b: cdict["bandwidth_bps"][devs.index(plan.parts[a].device)][devs.index(plan.parts[b].device)]  # noqa: E731
    used = {tuple(sorted(k)) for k in pred.link_bytes}
    slow = min(used, key=lambda k: bw(*k))
    moved = sum(r.parts[a]["sent"].get(b, {}).get("bytes", 0) for r in meas for a, b in (slow, slow[::-1])) / len(meas)
    # (meas: the last equal-flops round's steps)
    capacity = bw(*slow) / 8
    util = moved / (capacity * measured)
    print(f"[emulated] local-4-two-sites (fitted lambda), equal-flops: {len(plan.parts)} parts on "
          f"{', '.join(p.device for p in plan.parts.values())}, GPipe x{cfg.emu_micro}", flush=True)
    print(f"[emulated] compiler (plan.predicted: the schedule simulated with Eq. 1-2, T_step) predicted {compiler_pred * 1e3:.1f} ms, replay predicted "
          f"{pred.iteration_s * 1e3:.1f} ms, measured {measured * 1e3:.1f} ms (median of {len(rounds)} rounds): "
          f"compiler/measured {compiler_pred / measured:.3f}, replay/measured {pred.iteration_s / measured:.3f}", flush=True)
    print("[emulated] compute per micro-batch (F+B), compiler with node times / FLOP-only vs measured without "
          "emulation: " + ", ".join(f"{p} {comp_pred[p] * 1e3:.2f} / {ef_flops['compute_s'][p] * 1e3:.2f} vs "
                                    f"{comp_meas[p] * 1e3:.2f} ms" for p in plan.parts), flush=True)
    print(f"[emulated] node times (fusion profile --model --threads 1, {t_prof:.1f} s): forward "
          f"{times.summary()['fwd_s'] * 1e3:.2f} ms + backward {times.summary()['bwd_s'] * 1e3:.2f} ms per micro-batch "
          f"over {len(times.nodes)} nodes; predicted/measured with node times: equal-flops "
          f"{compiler_pred / measured:.3f}, OP-Fence {of_pred / of_meas:.3f}; FLOP-only on the same cuts: "
          f"{ef_flops['iteration_s'] / measured:.3f}, {of_flops['iteration_s'] / of_meas:.3f} (FLOP-only plans: "
          f"equal-flops {'the same cut' if same_cut(ef_flops_plan, plan) else 'another cut'}, OP-Fence "
          f"{len(of_flops_plan.parts)} parts, {'the same cut' if same_cut(of_flops_plan, of) else 'another cut'})",
          flush=True)
    print(f"[emulated] slowest link {slow[0]}<->{slow[1]} ({bw(*slow) / 1e6:.0f} Mbit/s): {moved / 1e3:.1f} kB per iteration, "
          f"utilization {util:.3f}", flush=True)
    print(f"[emulated] OP-Fence on the same cluster: {len(of.parts)} part(s) on "
          f"{', '.join(p.device for p in of.parts.values())}, predicted {of_pred * 1e3:.1f} ms, measured "
          f"{of_meas * 1e3:.1f} ms (median of {len(of_rounds)} rounds), ratio {of_pred / of_meas:.3f} "
          f"(equal-flops measured {measured * 1e3:.1f} ms: "
          f"OP-Fence is {measured / of_meas:.1f}x faster)", flush=True)
    of_comp = {p: of.predicted["parts"][p]["compute_s"] for p in of.parts}
    print("[emulated] OP-Fence compute per micro-batch predicted (node times / FLOP-only): " +
          ", ".join(f"{p} {v * 1e3:.2f} / {of_flops['compute_s'][p] * 1e3:.2f} ms" for p, v in of_comp.items()),
          flush=True)
    print(f"[emulated] lambda only (no per-node / per-message term): equal-flops predicted "
          f"{bare_ef.predicted['iteration_s'] * 1e3:.1f} ms ({bare_ef.predicted['iteration_s'] / measured:.3f} of measured), "
          f"OP-Fence predicted {bare_of.predicted['iteration_s'] * 1e3:.1f} ms ({len(bare_of.parts)} parts; "
          f"{bare_of.predicted['iteration_s'] / of_meas:.3f} of measured)", flush=True)
    of_break = breakdown(of_reports)
    print("[emulated] OP-Fence iteration, where the time goes (ms, medians over the measured steps): " +
          "; ".join(f"{p} " + ", ".join(f"{k} {v * 1e3:.1f}" for k, v in b.items()) for p, b in of_break.items()
                    if p != "coordinator") + f"; outside the parts {of_break['coordinator']['outside_s'] * 1e3:.1f}; "
          f"predicted T_step {of.predicted.get('step_s', 0.0) * 1e3:.2f} (optimizer "
          + ", ".join(f"{p} {v.get('optimizer_s', 0.0) * 1e3:.2f}" for p, v in of.predicted["parts"].items()) + ")",
          flush=True)
    # CPU seconds an executor process used per iteration (all its threads; mean over the parts) against the wall time
    # of its forward + backward + optimizer: what is left is time waiting for a core (2 cores, other work on the host)
    of_cpu_s = statistics.median(of_cpu)
    of_busy = statistics.mean(b["forward_s"] + b["backward_s"] + b["optimizer_s"] for p, b in of_break.items()
                              if p != "coordinator")
    of_pred_busy = statistics.mean(cfg.emu_micro * v["compute_s"] + v.get("optimizer_s", 0.0)
                                   for v in of.predicted["parts"].values())
    print(f"[emulated] OP-Fence executors per iteration (mean over parts): CPU {of_cpu_s * 1e3:.1f} ms, wall in "
          f"forward + backward + optimizer {of_busy * 1e3:.1f} ms, predicted {of_pred_busy * 1e3:.1f} ms", flush=True)
    sim = float(plan.predicted["schedules"]["gpipe"]["iteration_s"])
    of_sim = float(of.predicted["schedules"]["gpipe"]["iteration_s"])
    print(f"[emulated] schedule simulation (fusion/cost/schedules.py) instead of Eq. 3: equal-flops {sim * 1e3:.1f} ms "
          f"({sim / measured:.3f} of measured), OP-Fence {of_sim * 1e3:.1f} ms ({of_sim / of_meas:.3f})", flush=True)
    detail = {"compiler_predicted_s": compiler_pred, "replay_predicted_s": pred.iteration_s, "measured_s": measured,
              "measured_rounds_s": rounds, "opfence_measured_rounds_s": of_rounds,
              "lambda": prof.lam, "node_overhead_s": prof.node_overhead_s, "message_overhead_s": prof.message_overhead_s,
              "overheads_used": bool(cfg.overheads), "slow_link": list(slow), "bytes_per_iteration": moved,
              "compiler_compute_s": comp_pred, "measured_compute_s": comp_meas,
              "lambda_only_predicted_s": float(bare_ef.predicted["iteration_s"]),
              "opfence_lambda_only_predicted_s": float(bare_of.predicted["iteration_s"]),
              "opfence_lambda_only_parts": len(bare_of.parts),
              "opfence_parts": len(of.parts), "opfence_predicted_s": of_pred, "opfence_measured_s": of_meas,
              "opfence_predicted_over_measured": of_pred / of_meas,
              "flops_predicted_s": ef_flops["iteration_s"], "opfence_flops_predicted_s": of_flops["iteration_s"],
              "flops_predicted_over_measured": ef_flops["iteration_s"] / measured,
              "opfence_flops_predicted_over_measured": of_flops["iteration_s"] / of_meas,
              "flops_compute_s": ef_flops["compute_s"], "opfence_flops_compute_s": of_flops["compute_s"],
              "opfence_compute_s": of_comp,
              "flops_plans_same_cut": [same_cut(ef_flops_plan, plan), same_cut(of_flops_plan, of)],
              "node_times_fwd_s": times.summary()["fwd_s"], "node_times_bwd_s": times.summary()["bwd_s"],
              "node_times_profile_s": t_prof,
              "step_predicted_s": float(plan.predicted.get("step_s", 0.0)),
              "opfence_step_predicted_s": float(of.predicted.get("step_s", 0.0)),
              "simulated_over_measured": sim / measured, "opfence_simulated_over_measured": of_sim / of_meas,
              "opfence_breakdown_s": of_break, "opfence_cpu_per_iteration_s": of_cpu_s,
              "opfence_busy_wall_s": of_busy, "opfence_busy_predicted_s": of_pred_busy,
              "without_step_predicted_over_measured":
                  (compiler_pred - float(plan.predicted.get("step_s", 0.0))) / measured,
              "opfence_without_step_predicted_over_measured":
                  (of_pred - float(of.predicted.get("step_s", 0.0))) / of_meas}
    return compiler_pred / measured, pred.iteration_s / measured, util, detail


def _rounded(v):
    """``v`` with every float (in nested dicts and lists too) rounded to 6 decimals, for the JSON line."""
    if isinstance(v, float):
        return round(v, 6)
    if isinstance(v, dict):
        return {k: _rounded(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_rounded(x) for x in v]
    return v


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--torch-worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--plan", default="")
    ap.add_argument("--out", default="")
    ap.add_argument("--d", type=int, default=512, help="model width (throughput part)")
    ap.add_argument("--hidden", type=int, default=2048, help="MLP width (throughput part)")
    ap.add_argument("--blocks", type=int, default=8, help="blocks (throughput part; divisible by 4)")
    ap.add_argument("--rows", type=int, default=16, help="rows per micro-batch (throughput part)")
    ap.add_argument("--micro", type=int, default=8, help="micro-batches")
    ap.add_argument("--steps", type=int, default=6, help="measured steps (throughput part)")
    ap.add_argument("--warmup", type=int, default=2, help="unmeasured first steps")
    ap.add_argument("--rounds", type=int, default=3, help="alternating fusion/torch rounds (best round counts)")
    ap.add_argument("--emu-d", type=int, default=1024, help="model width (emulated part)")
    ap.add_argument("--emu-rows", type=int, default=16, help="rows per micro-batch (emulated part)")
    ap.add_argument("--emu-steps", type=int, default=5, help="measured steps (emulated part)")
    ap.add_argument("--emu-micro", type=int, default=16, help="micro-batches (emulated part)")
    ap.add_argument("--schedule", default="gpipe", help=argparse.SUPPRESS)
    ap.add_argument("--fusion-schedules", default=",".join(FUSION_SCHEDULES),
                    help="fusion schedules the throughput part runs (comma-separated; the first is the loss reference)")
    ap.add_argument("--torch-schedules", default=",".join(TORCH_SCHEDULES),
                    help=f"torch.distributed.pipelining schedules the throughput part runs ({', '.join(TORCH_SCHEDULES)})")
    ap.add_argument("--no-overheads", dest="overheads", action="store_false",
                    help="emulated part: predict with lambda only (no per-node / per-message overhead)")
    ap.add_argument("--only", choices=["throughput", "emulated", "curve"], help="run one part of the benchmark")
    ap.add_argument("--quick", action="store_true", help="small and short (a smoke run, not a measurement)")
    ap.add_argument("--heap", choices=["steady", "default"], default="steady",
                    help="fusion executor --heap of every executor (steady: the executors' default)")
    cfg = ap.parse_args()
    if cfg.torch_worker:
        return torch_worker(cfg)
    cfg.fusion_schedules = [s for s in cfg.fusion_schedules.split(",") if s]
    cfg.torch_schedules = [s for s in cfg.torch_schedules.split(",") if s]
    bad = [s for s in cfg.torch_schedules if s not in TORCH_SCHEDULES] + \
        [s for s in cfg.fusion_schedules if s not in FUSION_SCHEDULES]
    if bad or not cfg.fusion_schedules or not cfg.torch_schedules:
        ap.error(f"unknown or no schedules: {bad}")
    if cfg.quick:
        cfg.d, cfg.hidden, cfg.steps, cfg.emu_d, cfg.emu_steps, cfg.warmup, cfg.rounds = 128, 256, 2, 256, 2, 1, 1
    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix="fusion-bench-") as tmp:
        ratios = throughput(cfg, Path(tmp)) if cfg.only in (None, "throughput") else {}
        pom, rom, util, detail = emulated(cfg, Path(tmp)) if cfg.only in (None, "emulated") else (None,) * 4
        curve = curve_overhead(cfg, Path(tmp)) if cfg.only in (None, "curve") else None
    print(f"total {time.time() - t0:.0f} s on {os.cpu_count()} cores", flush=True)
    out: dict = {"executor_heap": cfg.heap}
    if ratios:
        out.update({
            "throughput_vs_torch_pipelining": round(min(r[0] for r in ratios.values()), 3),
            "throughput_vs_torch_pipelining_2": round(ratios[2][0], 3),
            "throughput_vs_torch_pipelining_4": round(ratios[4][0], 3),
            "cpu_efficiency_vs_torch_pipelining_2": round(ratios[2][1], 3),
            "cpu_efficiency_vs_torch_pipelining_4": round(ratios[4][1], 3),
            "throughput_schedules": {str(k): v[2] for k, v in ratios.items()},
        })
    if curve is not None:
        out["curve_overhead"] = round(curve["curve_overhead"], 3)  # samples/s with CURVE / without (target >= 0.95)
        out["curve_overhead_best_rounds"] = round(curve["best"], 3)
        out["curve_cpu_ratio"] = round(curve["cpu"], 3)  # executor CPU-s per iteration without / with CURVE
    if detail:
        out.update({
            "predicted_over_measured": round(pom, 3),  # the compiler's prediction (simulated schedule) on the fitted cluster (equal-flops)
            "opfence_predicted_over_measured": round(detail["opfence_predicted_over_measured"], 3),
            # the same cuts priced by FLOPs / lambda (no node times): what the compiler predicted before issue 17
            "flops_predicted_over_measured": round(detail["flops_predicted_over_measured"], 3),
            "opfence_flops_predicted_over_measured": round(detail["opfence_flops_predicted_over_measured"], 3),
            "replay_over_measured": round(rom, 3),  # the runtime's schedule replay with profiled compute
            "bottleneck_link_utilization": round(util, 3),
            "emulated": _rounded(detail),
        })
    print(json.dumps(out))


if __name__ == "__main__":
    main()
