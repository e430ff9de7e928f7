"""Issue 29's headline: fusion against torch.distributed.pipelining over a real shaped network (two sites).

The network (:mod:`netns_sites`): three hosts in network namespaces, ``dev-a`` and the coordinator ``coord`` in
site A, ``dev-b`` in site B; 1 Gbit/s (tbf) from each host to its site's switch, ``20 Mbit/s`` (profile ``20mbit``)
or ``5 Mbit/s`` (``5mbit``) between the two sites, latency added with netem only where the kernel has it (the
JSON's ``latency``). One process per device, each in its namespace; every byte between the two stages crosses the
kernel's shaped veth pair (no in-process emulation on either side). Two stages, one device per site: the honest
minimum, which is where a two-site run must cut.

The model, data and optimizer: ``benchmarks/wan_model.py``'s :func:`gpt_setup` (beside the torch side), shared by
both sides: the char-level GPT of ``benchmarks/convergence.py`` (``small``: vocabulary 96, 2 layers, 2 heads, width
64, 32 characters, 32 rows per step in 4 micro-batches; ``tiny``, 8 rows in 2, for the test) initialised from the
seed, AdamW, random windows of the CPython-source corpus's training part as a pure function of (seed, step), and
held-out windows of its last 10 % (the same for every seed and side). fusion gets them as ``wan_model.py:model`` /
``wan_model.py:batches`` under the setup's environment.

Three sides per profile and seed, the same steps each:

1. ``torch``: ``benchmarks/wan_torch.py`` (torch.distributed.pipelining over gloo, its best schedule), one rank
   per device, called with its CLI contract (``--rank --world --master --steps --seed --micro-batches --batch
   --eval-every --eval-batches --model --out``);
2. ``fusion_dense``: ``fusion compile --strategy equal-flops`` (no compression), ``fusion keys``, one ``fusion
   executor`` per part in its device's namespace and ``fusion coordinator --bind`` in site A, CURVE on;
3. ``fusion_auto``: the same with ``--strategy opfence --compress auto`` (equal-flops where OP-Fence keeps the
   model on one device: the JSON's ``auto_strategy`` says which).

The cluster file the plans are compiled for describes this network (devices, sites, the links' alpha and beta),
with this host's speed and fixed costs fitted by ``fusion profile`` and the model's per-node times by
``fusion profile --model`` (``--node-times``), so the estimator prices the real links:
``predicted_over_measured`` is the plan's predicted step time over the median measured one (first 2 steps
dropped). Throughput: samples per second of the training steps (from the first step's start to the last step's
end, evaluations taken out, process start-up not counted), on both sides; ``wall_s`` (the time axis of the
validation curves) counts the evaluations. **The headline**, the JSON's first figure,
``time_to_torch_final_val_loss_ratio``: fusion auto trains until its held-out loss first is <= torch's final one
(``--stop-at-val-loss``; at most ``CAP_FACTOR`` = 2 x torch's steps), and its wall time to there over torch's whole
wall time is the ratio (median of the seeds; a seed that never gets there counts as infinite and is listed with its
gap). samples/s comes second. ``codec_cpu_over_link_saved``: the codecs' CPU seconds per step (the parts'
``codec_s``, thread CPU time in encode and decode, median over the steps after the first two) over the seconds of
the slow link the plan's codecs save per step (dense minus wire bytes of every compressed cut edge and direction,
per micro-batch, at the link's bandwidth): below 1 the codecs pay for themselves on an idle link. ``between_sites_bytes_per_step``: what crossed the
slow link (both ways, read from the inter-site veth's tc counters around each side's run, start-up and evaluations
included) over the steps.

    python benchmarks/bench_wan.py [--profiles 20mbit,5mbit] [--seeds 0,1,2] [--steps N] [--quick]

Needs root, ``ip`` and ``tc``; elsewhere it says so in one line and prints null figures (exit 0).
"""
from __future__ import annotations

import argparse
import json
import logging
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path.insert(0, str(BENCH))

from netns_sites import PROFILES, Sites, namespaces_available  # noqa: E402

log = logging.getLogger("bench_wan")
HOSTS = {"coord": "site-a", "dev-a": "site-a", "dev-b": "site-b"}
#: device -> host (namespace) of the two stages, in stage order
DEVICES = ("dev-a", "dev-b")
VAL_SEED = 12345
#: fusion auto trains until it reaches torch's final held-out loss, at most this many times torch's steps
CAP_FACTOR = 2


#: model -> (rows per step, micro-batches per step): what both sides train with (``wan_model.gpt_setup``)
SHAPES = {"small": (32, 4), "tiny": (8, 2)}


def wan_setup(torch_script: Path, model: str, seed: int):
    """The :class:`wan_model.WanSetup` of ``model`` and ``seed`` (``wan_model.py`` beside the torch side): the GPT,
    its batches and AdamW's hyper-parameters, shared by both sides."""
    sys.path.insert(0, str(torch_script.resolve().parent))
    import wan_model

    batch, micro = SHAPES[model]
    return wan_model.gpt_setup(model, seed, batch=batch, micro_batches=micro)


def _entry(setup) -> str:
    """``wan_model.py``, whose ``model``/``batches`` fusion calls (they read :attr:`WanSetup.env`)."""
    return str(Path(sys.modules[type(setup).__module__].__file__).resolve())


# -- the cluster file -------------------------------------------------------------------------

def cluster_yaml(sites: Sites, profile, peak_gflops: float, devices: tuple[str, ...] = DEVICES) -> str:
    """The shaped network as a cluster file: one device per stage host (``devices``), its site its group."""
    lat_between = profile.latency_ms if sites.latency_method.startswith("netem") else 0.1
    lines = [f"# written by benchmarks/bench_wan.py: profile {profile.name}, latency: {sites.latency_method}",
             f"name: wan-{profile.name}", "devices:"]
    for i, d in enumerate(devices):
        lines.append(f"  - {{name: {d}, group: {sites.hosts[d]}, peak_flops: {peak_gflops:g} GFLOPS, memory: 4 GB, "
                     f"address: \"tcp://{sites.ip[d]}:{6100 + i}\"}}")
    lines += ["links:",
              f"  default:      {{latency: {lat_between:g} ms, bandwidth: {profile.between_mbit:g} Mbit/s}}",
              f"  within_group: {{latency: 0.1 ms, bandwidth: {profile.within_mbit:g} Mbit/s}}", ""]
    return "\n".join(lines)


def _fusion(*args: str) -> list[str]:
    return [sys.executable, "-m", "fusion.cli", *args]


def _run(cmd: list[str], what: str, env: dict[str, str], timeout: float = 600) -> str:
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env={**_env(), **env})
    if r.returncode:
        raise RuntimeError(f"{what} failed ({r.returncode}): {(r.stderr or r.stdout).strip()[-2000:]}")
    return r.stdout


def _cli(args: list[str], what: str, env: dict[str, str]) -> None:
    """A short ``fusion`` command (compile, keys) in this process, under ``env`` (restored after): it saves a
    process start, which costs more than the command itself on a loaded host."""
    from fusion.cli import main as fusion_main

    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        rc = fusion_main(args)
    except SystemExit as e:  # argparse
        rc = e.code
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    if rc:
        raise RuntimeError(f"{what} failed ({rc}); its error is above")


def _env() -> dict[str, str]:
    path = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path}


def _wait_all(procs: list[subprocess.Popen], timeout: float, what: str, logf: Path) -> None:
    """Wait for every process; the first that fails (or the timeout) kills the others and raises with the log."""
    deadline = time.monotonic() + timeout
    try:
        while any(p.poll() is None for p in procs):
            if any(p.poll() for p in procs):
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"{what}: still running after {timeout:.0f} s; log {logf}")
            time.sleep(0.2)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)
    bad = [p.returncode for p in procs if p.returncode]
    if bad:
        raise RuntimeError(f"{what}: exit status {bad}: {logf.read_text(errors='replace')[-3000:]}")


# -- the three sides --------------------------------------------------------------------------

def run_torch(sites: Sites, script: Path, args, setup, work: Path, port: int, devices: tuple[str, ...] = DEVICES,
              replicas: int = 1, steps: int | None = None, extra: tuple[str, ...] = ()) -> dict:
    """torch's side (``wan_torch.py``): one rank per host of ``devices`` in order (``replicas`` pipelines of
    consecutive ranks), ``steps`` (default ``args.steps``) steps; ``extra``: more ``wan_torch.py`` options."""
    work.mkdir(parents=True, exist_ok=True)
    out, logf = work / "torch.json", work / "torch.log"
    with open(logf, "wb") as lf:
        procs = [subprocess.Popen(sites.cmd(d, [sys.executable, str(script), "--rank", str(r), "--world",
                                               str(len(devices)), "--replicas", str(replicas),
                                               "--master", f"{sites.ip[devices[0]]}:{port}",
                                               "--steps", str(steps or args.steps), "--seed", str(setup.seed),
                                               "--micro-batches", str(setup.micro_batches),
                                               "--batch", str(setup.batch),
                                               "--eval-every", str(args.eval_every), "--eval-batches",
                                               str(args.eval_batches), "--model", args.model, "--out", str(out),
                                               "--precision", args.precision, *extra]),
                                  stdout=lf, stderr=subprocess.STDOUT,
                                  env={**_env(), "GLOO_SOCKET_IFNAME": sites.dev[d]})  # the shaped link, not lo
                 for r, d in enumerate(devices)]
        _wait_all(procs, args.timeout, f"torch seed {setup.seed}", logf)
    res = json.loads(out.read_text())
    return {"samples_per_s": res["samples_per_s"], "wall_s": res["wall_s"], "val": res["val"],
            "losses": res["losses"], "schedule": res.get("schedule"), "stages": res.get("stages")}


def compile_plan(setup, cluster: Path, node_times: Path | None, strategy: str, compress: str, out: Path,
                 dp: tuple[str, ...] = (), precision: str = "fp32") -> dict:
    """``fusion compile`` of the setup's model, optimizer and seed. ``dp``: data-parallel options (``--replicas R
    --global-batch ROWS --dp-sync ...``, benchmarks/diloco_wan.py); the global batch then sets the micro-batches
    per replica, so ``--micro-batches`` is left out."""
    s = setup
    micro = [] if dp else ["--micro-batches", str(s.micro_batches)]
    cmd = ["compile", f"{_entry(s)}:model", "--cluster", str(cluster), "--strategy", strategy, *micro,
           "--optimizer", "adamw", "--lr", repr(s.lr), "--weight-decay", repr(s.weight_decay), "--seed", str(s.seed),
           "--compress", compress, "--precision", precision, "-o", str(out), "--force", *dp]
    if node_times is not None:
        cmd += ["--node-times", str(node_times)]
    _cli(cmd, f"fusion compile ({strategy}, --compress {compress})", s.env)
    return json.loads((out / "plan.json").read_text())


def run_fusion(sites: Sites, plan_dir: Path, setup, args, work: Path, port: int, steps: int | None = None,
               stop_at: float | None = None) -> dict:
    """One fusion side: ``steps`` (default ``--steps``) training steps, or fewer with ``stop_at``: the run ends after
    the first evaluation whose held-out loss is <= it (``fusion coordinator --stop-at-val-loss``)."""
    work.mkdir(parents=True, exist_ok=True)
    steps = steps or args.steps
    stop = ["--stop-at-val-loss", repr(stop_at)] if stop_at is not None else []
    plan = json.loads((plan_dir / "plan.json").read_text())
    keys, run, logf = work / "keys", work / "run", work / "fusion.log"
    _cli(["keys", str(plan_dir), "--out", str(keys), "--force"], "fusion keys", {})
    env = {**_env(), **setup.env}
    coord = f"tcp://{sites.ip['coord']}:{port}"
    with open(logf, "wb") as lf:
        procs = [subprocess.Popen(sites.cmd("coord", _fusion(
            "coordinator", str(plan_dir), "--bind", coord, "--steps", str(steps), *stop, "--out", str(run),
            "--overwrite", "--data", f"{_entry(setup)}:batches", "--no-progress", "--eval-every", str(args.eval_every),
            "--eval-batches", str(args.eval_batches), "--peer-timeout", "60", "--key", str(keys / "coordinator.secret"),
            "--steps-ahead", str(getattr(args, "steps_ahead", 1)))),
            stdout=lf, stderr=subprocess.STDOUT, env=env)]
        threads = emulated_host_threads(plan)
        for name, part in plan["parts"].items():
            procs.append(subprocess.Popen(sites.cmd(part["device"], _fusion(
                "executor", str(plan_dir), "--node", name, "--coordinator", coord, "--threads", str(threads),
                "--key", str(keys / f"{name}.secret"))), stdout=lf, stderr=subprocess.STDOUT, env=env))
        _wait_all(procs, args.timeout, f"fusion {plan_dir.name}", logf)
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    steps = steps_lines = [x for x in lines if "loss" in x]
    t0 = steps[0]["time"] - steps[0]["iteration_s"]
    wall = max(x["time"] for x in lines) - t0
    eval_s = eval_seconds(lines)
    it = [x["iteration_s"] for x in steps][2:] or [x["iteration_s"] for x in steps]
    measured = statistics.median(it)
    codec = [sum(p.get("codec_s", 0.0) for p in x["parts"].values()) for x in steps_lines][2:] or [0.0]
    predicted = float((plan.get("predicted") or {}).get("iteration_s", float("nan")))
    return {"samples_per_s": len(steps) * setup.batch / (wall - eval_s), "wall_s": wall, "eval_s": eval_s,
            "val": [[x["step"] + 1, x["time"] - t0, x["val_loss"]] for x in lines if "val_loss" in x],
            "losses": [x["loss"] for x in steps], "step_s_measured": measured, "step_s_predicted": predicted,
            "predicted_over_measured": predicted / measured, "steps": len(steps),
            "codec_cpu_s_per_step": statistics.median(codec),
            "parts": {n: p["device"] for n, p in plan["parts"].items()},
            "compression": plan.get("compression") or []}


def emulated_host_threads(plan: dict) -> int:
    """Intra-op threads of each executor: this host's cores shared among the emulated hosts (the plan's devices),
    at least 1, as torch's ranks get one each (``OMP_NUM_THREADS=1``). Left to itself an executor takes every core
    of its host (``fusion executor``'s default for a part whose address names a host of its own), so the two
    emulated hosts' executors ran 2 threads each on the 2 shared cores: forward + backward 0.030-0.033 s a step per
    part (bf16 auto, seed 8, 2026-11-28) against 0.008-0.009 s for the same model and precision on loopback with one
    thread each, a handicap torch's side did not carry."""
    return max(1, (os.cpu_count() or 1) // max(1, len({p["device"] for p in plan["parts"].values()})))


def eval_seconds(lines: list[dict]) -> float:
    """Evaluation time of a run's metrics lines: from the step line before each evaluation line to it (the torch
    side counts it apart too)."""
    return sum(b["time"] - a["time"] for a, b in zip(lines, lines[1:]) if "val_loss" in b and "loss" in a)


def link_saved_s_per_step(plan_dir: Path, between_mbit: float) -> float:
    """Seconds of the slow link the plan's codecs save per step: for every compressed cut edge and direction (each
    crosses the sites: one device per site), the dense bytes minus the codec's wire bytes, per micro-batch, over the
    link's bandwidth."""
    from fusion.kernels.codecs import CODECS
    from fusion.plan import load_plan

    plan = load_plan(plan_dir)
    saved = 0.0
    for e in plan.compression:
        meta = plan.graph.output_meta(e.producer, e.index)
        for d in ("fwd", "bwd"):
            cfg = e.codec(d)
            if cfg is None or meta is None:
                continue
            wire = CODECS.unit(cfg["algo"]).wire_nbytes(meta.numel, meta.dtype, cfg)
            saved += (meta.nbytes - wire) * plan.micro_batches
    return saved * 8 / (between_mbit * 1e6)


def time_to(val: list, target: float) -> float | None:
    return next((t for _, t, v in val if v <= target), None)


# -- the benchmark ----------------------------------------------------------------------------

def calibrate(work: Path, sites: Sites, profile, setup, quick: bool) -> tuple[Path, Path | None]:
    """The cluster file with this host's fitted speed and fixed costs, and the model's per-node times."""
    raw = work / "cluster-raw.yaml"
    raw.write_text(cluster_yaml(sites, profile, 50.0))
    cluster = work / "cluster.yaml"
    if quick:
        return raw, None
    _run(_fusion("profile", "--cluster", str(raw), "--name", DEVICES[0], "--threads", "1", "-o", str(cluster)),
         "fusion profile", {})
    import yaml

    fitted = yaml.safe_load(cluster.read_text())
    a = next(d for d in fitted["devices"] if d["name"] == DEVICES[0])
    for d in fitted["devices"]:  # every device is a process on this host: the same speed and fixed costs
        d.update({k: (dict(v) if isinstance(v, dict) else v) for k, v in a.items()
                  if k not in ("name", "group", "address")})
    cluster.write_text(yaml.safe_dump(fitted, sort_keys=False))
    node_times = work / "node_times.json"
    _run(_fusion("profile", "--model", f"{_entry(setup)}:model", "--cluster", str(cluster), "--name", DEVICES[0],
                 "--threads", "1", "-o", str(node_times)), "fusion profile --model", setup.env)
    return cluster, node_times


def cut_tensors(plan_dir: Path) -> list[str]:
    """The tensors that cross between the plan's parts (``fusion inspect``'s cut edges)."""
    from fusion.inspect import cut_edges
    from fusion.plan import load_plan

    return sorted({e["tensor"] for e in cut_edges(load_plan(plan_dir))})


def split_cluster(setup, cluster: Path, node_times, work: Path) -> Path:
    """``cluster`` with each device's memory set to 0.7 of what the whole model needs (the summed part memory
    of an equal-flops plan): the model no longer fits one device, as for any model one pipelines, so OP-Fence
    must cut it in two and chooses where (the cheapest edge it prices), instead of keeping it on one device."""
    import yaml

    probe = compile_plan(setup, cluster, node_times, "equal-flops", "none", work / "probe.plan")
    need = sum(p["memory_bytes"] for p in probe["parts"].values())
    c = yaml.safe_load(cluster.read_text())
    for d in c["devices"]:
        d["memory"] = f"{0.7 * need / 2**20:.3f} MB"
    out = work / "cluster-split.yaml"
    out.write_text(yaml.safe_dump(c, sort_keys=False))
    return out


def one_seed(sites: Sites, profile, args, seed: int, work: Path, cluster: Path, node_times, port: int) -> dict:
    work.mkdir(parents=True, exist_ok=True)
    setup = wan_setup(args.torch_script, args.model, seed)
    row: dict = {"seed": seed}
    log.info("%s seed %d: torch", profile.name, seed)
    b0 = sites.between_sent_bytes()
    row["torch"] = run_torch(sites, args.torch_script, args, setup, work / "torch", port)
    b1 = sites.between_sent_bytes()
    if args.split == "memory":  # the devices hold half the model: OP-Fence must cut, where it prices cheapest
        cluster = split_cluster(setup, cluster, node_times, work)
    strategy = "opfence" if args.split == "memory" else "equal-flops"
    dense = compile_plan(setup, cluster, node_times, strategy, "none", work / "dense.plan", precision=args.precision)
    row["dense_strategy"] = strategy
    row["dense_cut"] = cut_tensors(work / "dense.plan")
    log.info("%s seed %d: fusion dense (%s, %d parts, cut %s)", profile.name, seed, strategy, len(dense["parts"]),
             row["dense_cut"])
    row["fusion_dense"] = run_fusion(sites, work / "dense.plan", setup, args, work / "dense", port + 1)
    b2 = sites.between_sent_bytes()
    auto = compile_plan(setup, cluster, node_times, "opfence", args.compress, work / "auto.plan",
                        precision=args.precision)
    row["auto_strategy"] = "opfence"
    if len(auto["parts"]) < 2:
        row["auto_strategy"] = "equal-flops (OP-Fence kept the model on one device)"
        auto = compile_plan(setup, cluster, node_times, "equal-flops", args.compress, work / "auto.plan",
                            precision=args.precision)
    row["auto_cut"] = cut_tensors(work / "auto.plan")
    t = row["torch"]
    target = t["val"][-1][2]
    cap = CAP_FACTOR * args.steps
    log.info("%s seed %d: fusion auto (%s) until torch's final held-out loss %.4f, at most %d steps", profile.name,
             seed, row["auto_strategy"], target, cap)
    row["fusion_auto"] = run_fusion(sites, work / "auto.plan", setup, args, work / "auto", port + 2, steps=cap,
                                    stop_at=target)
    b3 = sites.between_sent_bytes()
    # bytes that crossed the slow link between the sites per training step, both ways, start-up and evaluations in
    for side, (x, y) in (("torch", (b0, b1)), ("fusion_dense", (b1, b2)), ("fusion_auto", (b2, b3))):
        row[side]["between_sites_bytes_per_step"] = (y - x) / row[side].get("steps", args.steps)
    auto = row["fusion_auto"]
    auto["link_saved_s_per_step"] = link_saved_s_per_step(work / "auto.plan", profile.between_mbit)
    row["codec_cpu_over_link_saved"] = (auto["codec_cpu_s_per_step"] / auto["link_saved_s_per_step"]
                                        if auto["link_saved_s_per_step"] > 0 else None)
    hit = time_to(row["fusion_auto"]["val"], target)
    row["torch_final_val_loss"] = target
    row["time_to_torch_final_val_loss_ratio"] = None if hit is None else hit / t["wall_s"]
    if hit is None:
        row["auto_val_gap"] = min(v for _, _, v in row["fusion_auto"]["val"]) - target
    for side in ("fusion_dense", "fusion_auto"):
        row[f"{side}_vs_torch_samples_per_s"] = row[side]["samples_per_s"] / t["samples_per_s"]
    row["first_loss"] = {s: row[s]["losses"][0] for s in ("torch", "fusion_dense", "fusion_auto")}
    log.info("%s seed %d: time to torch's final val loss %s of torch's (auto: %d steps); samples/s torch %.1f dense "
             "%.1f auto %.1f; val torch %.3f dense %.3f auto %.3f; codec CPU / link saved %s", profile.name, seed,
             row["time_to_torch_final_val_loss_ratio"], auto["steps"], t["samples_per_s"],
             row["fusion_dense"]["samples_per_s"], auto["samples_per_s"], target,
             row["fusion_dense"]["val"][-1][2], auto["val"][-1][2], row["codec_cpu_over_link_saved"])
    return row


def _median(xs: list) -> float | None:
    vals = [math.inf if x is None else x for x in xs]
    if not vals:
        return None
    m = statistics.median(vals)
    return None if math.isinf(m) else m


def summarise(results: dict, args, latency: str | None) -> dict:
    def med(profile, key):
        rows = results.get(profile, [])
        return _median([r[key] for r in rows]) if rows else None

    first = next(iter(results), None)
    head = "20mbit" if "20mbit" in results else first
    out = {"benchmark": "wan",
           # the headline: fusion auto's wall time to torch's final held-out loss over torch's wall time (median of
           # the seeds; a seed that never gets there within CAP_FACTOR x torch's steps counts as infinite)
           "time_to_torch_final_val_loss_ratio": med(head, "time_to_torch_final_val_loss_ratio") if first else None,
           "time_to_torch_final_val_loss_ratio_5mbit": med("5mbit", "time_to_torch_final_val_loss_ratio"),
           "fusion_auto_vs_torch_samples_per_s": med("20mbit", "fusion_auto_vs_torch_samples_per_s"),
           "codec_cpu_over_link_saved": med(head, "codec_cpu_over_link_saved") if first else None,
           "cap_steps": CAP_FACTOR * args.steps,
           "model": args.model, "steps": args.steps, "seeds": args.seeds, "precision": args.precision,
           "compress": args.compress,
           "stages": len(DEVICES), "topology": "2 sites x 1 device, coordinator in site A",
           "latency": latency,
           "profiles": {p: {"between_mbit": PROFILES[p].between_mbit, "within_mbit": PROFILES[p].within_mbit}
                        for p in args.profiles},
           "fusion_auto_vs_torch_samples_per_s_5mbit": med("5mbit", "fusion_auto_vs_torch_samples_per_s"),
           "fusion_dense_vs_torch_samples_per_s": med("20mbit" if "20mbit" in results else first,
                                                      "fusion_dense_vs_torch_samples_per_s") if first else None,
           "predicted_over_measured": {
               f"{p}/{side}": _median([r[side]["predicted_over_measured"] for r in rows])
               for p, rows in results.items() for side in ("fusion_dense", "fusion_auto")},
           "split": args.split,
           "per_seed": {p: [{"seed": r["seed"], "auto_strategy": r["auto_strategy"],
                             "dense_strategy": r["dense_strategy"], "dense_cut": r["dense_cut"],
                             "auto_cut": r["auto_cut"],
                             "torch_schedule": r["torch"]["schedule"],
                             "samples_per_s": {s: round(r[s]["samples_per_s"], 3)
                                               for s in ("torch", "fusion_dense", "fusion_auto")},
                             "fusion_auto_vs_torch_samples_per_s": round(r["fusion_auto_vs_torch_samples_per_s"], 3),
                             "fusion_dense_vs_torch_samples_per_s": round(r["fusion_dense_vs_torch_samples_per_s"], 3),
                             "time_to_torch_final_val_loss_ratio": r["time_to_torch_final_val_loss_ratio"],
                             "fusion_auto_steps": r["fusion_auto"]["steps"],
                             "codec_cpu_over_link_saved": r["codec_cpu_over_link_saved"],
                             "codec_cpu_s_per_step": round(r["fusion_auto"]["codec_cpu_s_per_step"], 6),
                             "link_saved_s_per_step": round(r["fusion_auto"]["link_saved_s_per_step"], 6),
                             "auto_val_gap": r.get("auto_val_gap"),
                             "final_val": {s: round(r[s]["val"][-1][2], 4)
                                           for s in ("torch", "fusion_dense", "fusion_auto")},
                             "first_loss": r["first_loss"],
                             "between_sites_bytes_per_step": {s: round(r[s]["between_sites_bytes_per_step"])
                                                              for s in ("torch", "fusion_dense", "fusion_auto")},
                             "step_s": {s: {"measured": round(r[s]["step_s_measured"], 4),
                                            "predicted": round(r[s]["step_s_predicted"], 4)}
                                        for s in ("fusion_dense", "fusion_auto")},
                             "auto_compression": r["fusion_auto"]["compression"]}
                            for r in rows]
                         for p, rows in results.items()}}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profiles", default="20mbit,5mbit", help=f"network profiles ({', '.join(PROFILES)})")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--steps", type=int, default=None, help="training steps of every side (default 300; --quick 6)")
    ap.add_argument("--model", choices=sorted(SHAPES), default=None, help="default small (--quick: tiny)")
    ap.add_argument("--eval-every", type=int, default=None, help="held-out loss every N steps (default steps/10)")
    ap.add_argument("--eval-batches", type=int, default=None, help="held-out batches per evaluation (default 4)")
    ap.add_argument("--torch-script", type=Path, default=BENCH / "wan_torch.py",
                    help="the torch.distributed.pipelining side (default benchmarks/wan_torch.py)")
    ap.add_argument("--timeout", type=float, default=None, help="seconds one side may take (900; --quick 400)")
    ap.add_argument("--work", type=Path, default=None, help="keep plans, runs and logs here (default: a temp dir)")
    ap.add_argument("--precision", choices=("fp32", "bf16"), default="fp32",
                    help="bf16: both sides under bfloat16 autocast; torch's stages send bfloat16 (its best wire), "
                         "fusion compiles with --precision bf16 (docs/wan.md)")
    ap.add_argument("--compress", default="auto",
                    help="the compressed side's --compress (default auto; a codec spec such as hadamard-quant:bits=4 "
                         "compares one codec against torch; the JSON keeps the side's name fusion_auto)")
    ap.add_argument("--split", choices=("memory", "equal-flops"), default="memory",
                    help="memory (default): devices hold 0.7 of the model, so OP-Fence cuts it where it prices "
                         "cheapest, for fusion dense (no compression) and auto; equal-flops: dense on the "
                         "equal-flops split, auto on OP-Fence's choice (the model may stay on one device)")
    ap.add_argument("--quick", action="store_true", help="1 profile, 1 seed, 6 steps, the tiny model, no profiling")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    args.profiles = args.profiles.split(",")
    args.seeds = [int(s) for s in args.seeds.split(",")]
    unknown = [p for p in args.profiles if p not in PROFILES]
    if unknown:
        print(f"bench_wan.py: --profiles: unknown profile(s) {unknown} (known: {', '.join(PROFILES)})", file=sys.stderr)
        return 2
    if args.quick:
        args.profiles, args.seeds = args.profiles[:1], args.seeds[:1]
    args.model = args.model or ("tiny" if args.quick else "small")
    args.steps = args.steps or (6 if args.quick else 300)
    args.timeout = args.timeout or (400.0 if args.quick else 900.0)
    args.eval_every = args.eval_every or max(1, args.steps // (2 if args.quick else 10))
    args.eval_batches = args.eval_batches or (2 if args.quick else 4)
    reason = namespaces_available()
    if reason is None and not args.torch_script.exists():
        reason = f"no torch side: {args.torch_script} does not exist"
    if reason:
        print(f"bench_wan.py: skipped: {reason}")
        print(json.dumps(summarise({}, args, None)))
        return 0
    results: dict[str, list] = {}
    latency = None
    with tempfile.TemporaryDirectory(prefix="fusion-wan-") as tmp:
        work = args.work or Path(tmp)
        for i, pname in enumerate(args.profiles):
            profile = PROFILES[pname]
            with Sites(HOSTS, profile) as sites:
                latency = sites.latency_method
                pw = work / pname
                pw.mkdir(parents=True, exist_ok=True)
                cluster, node_times = calibrate(pw, sites, profile, wan_setup(args.torch_script, args.model, 0),
                                                args.quick)
                rows = results.setdefault(pname, [])
                for seed in args.seeds:
                    rows.append(one_seed(sites, profile, args, seed, pw / f"seed{seed}", cluster, node_times,
                                         port=29500 + 10 * (len(args.seeds) * i + len(rows))))
                    print(json.dumps({"profile": pname, **summarise({pname: rows[-1:]}, args, latency)["per_seed"][pname][0]}),
                          flush=True)
    print(json.dumps(summarise(results, args, latency)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
