"""Issue 34's wall-clock figure: DiLoCo against synchronous DP over a real shaped link (``bench_diloco.py --study wan``).

The network and the processes are ``benchmarks/bench_wan.py``'s (:mod:`netns_sites`: hosts in network namespaces,
site A holding ``dev-a`` and the coordinator ``coord``, site B holding ``dev-b``, 1 Gbit/s tbf from each host to its
site's switch and the profile's rate, 20 Mbit/s by default, between the sites; no added latency where the kernel has
no ``netem``). Two replicas of the whole model, one stage each, ``part0`` on ``dev-a`` and ``r1.part0`` on ``dev-b``
(``fusion compile --replicas 2 --global-batch ROWS``): one ``fusion executor`` process per replica in its host's
namespace (``OMP_NUM_THREADS=1``: one thread each, so the two replicas are the only compute processes of a run on a
2-core host) and ``fusion coordinator --bind`` in site A, CURVE on, all started by :func:`bench_wan.run_fusion`.

The model and data are :func:`bench_wan.wan_setup`'s (``small``: the char GPT of ``wan_model.py``, vocabulary 96, 2
layers, width 64, 32 characters, on the CPython-source corpus; ``tiny`` for ``--quick``), AdamW at lr 3e-3, the
global batch of 32 rows (8 in ``--quick``) split over the two replicas; held-out loss by fusion's own evaluation
(``--eval-every``, ``--eval-batches`` held-out batches of the corpus's last 10 %, the same for every seed; each
replica evaluates its half of each batch with its own weights, the mean is the loss).

Two runs per seed, the same global batch:

1. **synchronous DP** (``--dp-sync every``, the exact ring all-reduce of the gradients every step, no codec):
   ``--sync-steps`` steps. Its final held-out loss is the **target** and its wall time the **anchor**;
2. **DiLoCo** (Douillard et al. 2023, arXiv 2311.08105) at the study's tuned setting (``bench_diloco.py``'s
   ``WAN_*`` and ``OUTER_DEFAULTS["wan"]``, tuned on seeds 100-101, docs/data-parallel.md): ``H`` inner steps (20),
   ``--sync-warmup`` (10) synchronous steps first with a 4-bit all-reduce, then SparseLoCo's outer step (Sarfi et
   al. 2025, arXiv 2508.15706: chunk Top-k + 2-bit pseudo-gradients with error feedback, ``--pseudo-codec
   sparseloco``, outer lr 1, no outer momentum) with the exchange overlapped with the next H inner steps
   (``--outer-delay 1``, the eager step); run until its held-out loss is <= the target (``--stop-at-val-loss``) or
   ``cap_factor`` x the synchronous steps.

Figures (the final JSON line):

* ``wall_to_sync_loss_ratio``: DiLoCo's wall time to the first evaluation at or below the target over synchronous
  DP's wall time to its final evaluation, both from the first step's start (the coordinator's metrics: the first
  step line's ``time`` minus its ``iteration_s``; process start-up is not counted, evaluations are, on the same
  grid of ``--eval-every`` steps on both sides); the median over the seeds, null when any seed misses (never
  reaches the target within the cap). Target <= 0.4.
* ``compute_utilisation``: over DiLoCo's replicas and steps (the warm-up's synchronous steps included), the seconds
  of compute, each part's ``forward_s + backward_s + weight_s + optimizer_s`` of every step line of ``metrics.jsonl`` (wall
  seconds inside the forward and backward actions, codecs of cut edges included, and the inner optimizer's step),
  over the replicas' training wall time, ``R x (last step line's time - first step's start - evaluation time)``
  (evaluation: from each step line to the held-out loss line that follows it, as bench_wan takes it out). What is
  not compute: waiting for the coordinator's next step and for the other replica, the outer step (pseudo-gradient,
  its codec, the outer Nesterov update, the exchange), the step's messages. The median over the seeds. Target
  >= 0.9. ``compute_utilisation_after_warmup`` counts only the steps after the synchronous warm-up; the
  synchronous side's own utilisation is reported for contrast.
* ``wall_to_best_sync_ratio`` (with ``--sync-codec``): a second synchronous baseline, synchronous DP with that
  all-reduce codec, runs to the same target (the exact run's final held-out loss, at most the cap); DiLoCo's time
  to the target over the faster baseline's (the exact run's wall time or the coded run's time to the target).
* ``between_sites_bytes_per_step``: what crossed the slow link (both ways, the inter-site veth's tc counters around
  each run, start-up, the coordinator's batches and evaluations included) over the run's steps.
"""
from __future__ import annotations

import json
import logging
import os
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

import bench_wan  # noqa: E402
from netns_sites import PROFILES, Sites, namespaces_available  # noqa: E402

log = logging.getLogger("diloco_wan")
#: global batch rows of each model: the rows bench_wan trains a step with, now over both replicas
ROWS = {model: rows for model, (rows, _) in bench_wan.SHAPES.items()}


@dataclass(frozen=True)
class WanStudy:
    """The study's settings.

    model:          ``small`` (the study) or ``tiny`` (``--quick``), :data:`bench_wan.SHAPES`.
    sync_steps:     synchronous DP's steps; its final held-out loss is the target.
    cap_factor:     DiLoCo stops at the target or after ``cap_factor x sync_steps`` steps.
    h:              DiLoCo's inner steps per outer step (``--inner-steps``).
    outer_lr, outer_momentum: the outer SGD's (``--outer-lr``, ``--outer-momentum``).
    nesterov:       Nesterov outer momentum (False: heavy-ball, ``--no-nesterov``).
    sync_warmup:    DiLoCo's first steps that are synchronous DP (``--sync-warmup``; 0: none).
    outer_delay:    1: the outer exchange overlaps the next H inner steps; 0: it blocks.
    fragments:      Streaming DiLoCo's fragments (``--sync-fragments``): the parameters in F runs, each exchanged
                    at its own step of the H, so the slow link carries 1/F of the pseudo-gradient at a time.
    pseudo_codec:   the pseudo-gradients' codec (``--pseudo-codec``, with error feedback); None: exact float32.
    sync_codec:     a second synchronous baseline: synchronous DP with this all-reduce codec (``--dp-codec``, e.g.
                    ``quant:bits=8``: a quarter of the bytes a step), run like DiLoCo until the exact run's final
                    held-out loss or the cap; None: only the exact one.
    warmup_codec:   the synchronous warm-up's all-reduce codec (``--dp-codec``, e.g. ``quant:bits=8``: a quarter of
                    the bytes); None: exact. Needs a warm-up and a pseudo-gradient codec.
    eval_every, eval_batches: held-out loss every N steps over so many held-out batches (fusion's ``--eval-every``).
    profile:        the network profile (:data:`netns_sites.PROFILES`).
    timeout:        seconds one run may take before it is killed and reported.
    steps_ahead:    the coordinators' ``--steps-ahead`` on both sides (1, fusion's default: each step sent before the
                    previous one is done; 0: lock step).
    """

    model: str = "small"
    sync_steps: int = 300
    cap_factor: float = 3.0
    h: int = 20
    outer_lr: float = 0.7
    outer_momentum: float = 0.6
    nesterov: bool = True
    sync_warmup: int = 20
    outer_delay: int = 0
    fragments: int = 1
    pseudo_codec: str | None = "quant:bits=8"
    warmup_codec: str | None = None
    sync_codec: str | None = None
    eval_every: int = 10
    eval_batches: int = 4
    profile: str = "20mbit"
    timeout: float = 1800.0
    steps_ahead: int = 1

    @property
    def steps(self) -> int:
        """What :func:`bench_wan.run_fusion` runs when not told otherwise: synchronous DP's steps."""
        return self.sync_steps

    @property
    def cap_steps(self) -> int:
        return int(self.cap_factor * self.sync_steps)

    def sync_options(self) -> tuple[str, ...]:
        return ("--replicas", "2", "--global-batch", str(ROWS[self.model]), "--dp-sync", "every")

    def coded_sync_options(self) -> tuple[str, ...]:
        return (*self.sync_options(), "--dp-codec", self.sync_codec)

    def diloco_options(self) -> tuple[str, ...]:
        codec = ("--pseudo-codec", self.pseudo_codec, "--pseudo-error-feedback") if self.pseudo_codec else ()
        codec += ("--dp-codec", self.warmup_codec) if self.warmup_codec else ()
        return ("--replicas", "2", "--global-batch", str(ROWS[self.model]), "--dp-sync", "diloco",
                "--inner-steps", str(self.h), "--outer-lr", repr(self.outer_lr), "--outer-momentum",
                repr(self.outer_momentum), *(() if self.nesterov else ("--no-nesterov",)),
                "--outer-delay", str(self.outer_delay), "--sync-fragments", str(self.fragments),
                "--sync-warmup", str(self.sync_warmup), *codec)


def codec_problem(flag: str, spec: str, role: str, allow: tuple = ()) -> str | None:
    """One line if ``spec`` (``flag``'s codec spec) names no codec the registry lets carry ``role`` (a
    :class:`Role` name) with that cfg, or None; ``allow``: what :func:`parse_spec` may also return (None for
    ``none``, ``"auto"``) without a check."""
    from fusion.compress.policy import parse_spec
    from fusion.ir.errors import FusionError
    from fusion.kernels.codecs import CODECS, Role

    try:
        cfg = parse_spec(spec, flag)
        if cfg not in allow:
            CODECS.check_role(cfg, getattr(Role, role), f"{flag} {spec}")
    except (FusionError, ValueError) as e:
        return str(e)
    return None


def check(study: WanStudy) -> str | None:
    """One line saying what is wrong with the settings, or None."""
    if study.sync_steps < 1 or study.h < 1 or study.eval_every < 1 or study.eval_batches < 1:
        return "--sync-steps, --h, --eval-every and --eval-batches need values >= 1"
    if not 0 <= study.sync_warmup < study.cap_steps:
        return f"--sync-warmup {study.sync_warmup}: expected 0 <= N < the cap of {study.cap_steps} steps"
    if study.cap_factor < 1:
        return f"--diloco-factor {study.cap_factor}: DiLoCo needs at least synchronous DP's steps (>= 1)"
    if study.profile not in PROFILES:
        return f"--profile {study.profile}: unknown (known: {', '.join(PROFILES)})"
    if study.warmup_codec is not None and not (study.sync_warmup and study.pseudo_codec):
        return (f"--warmup-codec {study.warmup_codec}: compresses the synchronous warm-up's all-reduce; needs "
                "--sync-warmup N > 0 and a --pseudo-codec")
    for flag, spec, role in (("--warmup-codec", study.warmup_codec, "DP_GRADIENT"),
                             ("--sync-codec", study.sync_codec, "DP_GRADIENT"),
                             ("--pseudo-codec", study.pseudo_codec, "PSEUDO_GRADIENT")):
        problem = None if spec is None else codec_problem(flag, spec, role)
        if problem:
            return problem
    return None


# -- what a run's metrics say -------------------------------------------------------------------

def metrics_lines(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


def rounded_val(val: list) -> list:
    """A run's ``[step, seconds, held-out loss]`` rows as the JSON gives them (ms, 4 decimals)."""
    return [[s, round(t, 3), round(v, 4)] for s, t, v in val]


def compute_utilisation(lines: list[dict], first_step: int = 0) -> float:
    """Compute seconds of every part over the parts' training wall time (the module docstring's definition), over
    the step lines of steps >= ``first_step``; the wall time runs from the start of the first of them."""
    steps = [x for x in lines if "loss" in x]
    kept = [x for x in steps if x["step"] >= first_step]
    if not kept:
        raise ValueError(f"no step line at or after step {first_step}")
    t0 = kept[0]["time"] - kept[0]["iteration_s"]
    tail = [x for x in lines if x["time"] >= t0]
    wall = max(x["time"] for x in tail) - t0
    eval_s = bench_wan.eval_seconds(tail)
    parts = kept[0]["parts"]
    compute = sum(p["forward_s"] + p["backward_s"] + p.get("weight_s", 0.0) + p.get("optimizer_s", 0.0)
                  for x in kept for p in x["parts"].values())
    return compute / (len(parts) * (wall - eval_s))


# -- one seed -----------------------------------------------------------------------------------

def run_side(sites: Sites, study: WanStudy, setup, cluster: Path, work: Path, name: str, dp: tuple[str, ...],
             port: int, steps: int, stop_at: float | None = None) -> dict:
    """Compile and run one side (``bench_wan.run_fusion``); its figures, its metrics' utilisation, its bytes."""
    plan_dir = work / f"{name}.plan"
    plan = bench_wan.compile_plan(setup, cluster, None, "opfence", "none", plan_dir, dp=dp)
    stages = {p.get("stage") or n for n, p in plan["parts"].items()}
    if len(plan["parts"]) != 2 or len(stages) != 1:
        raise RuntimeError(f"{name}: expected 2 replicas of one stage, the plan has parts {sorted(plan['parts'])}")
    b0 = sites.between_sent_bytes()
    res = bench_wan.run_fusion(sites, plan_dir, setup, study, work / name, port, steps=steps, stop_at=stop_at)
    res["between_sites_bytes_per_step"] = (sites.between_sent_bytes() - b0) / res["steps"]
    lines = metrics_lines(work / name / "run")
    res["compute_utilisation"] = compute_utilisation(lines)
    warm = study.sync_warmup if name == "diloco" else 0
    res["compute_utilisation_after_warmup"] = (compute_utilisation(lines, warm) if res["steps"] > warm else None)
    res["outer_rounds"] = sum(1 for x in lines if "outer" in x)
    return res


def one_seed(sites: Sites, study: WanStudy, seed: int, work: Path, cluster: Path, port: int) -> dict:
    work.mkdir(parents=True, exist_ok=True)
    setup = bench_wan.wan_setup(BENCH / "wan_torch.py", study.model, seed)
    log.info("seed %d: synchronous DP, %d steps", seed, study.sync_steps)
    sync = run_side(sites, study, setup, cluster, work, "sync", study.sync_options(), port, study.sync_steps)
    target = sync["val"][-1][2]
    log.info("seed %d: DiLoCo until synchronous DP's final held-out loss %.4f, at most %d steps", seed, target,
             study.cap_steps)
    dil = run_side(sites, study, setup, cluster, work, "diloco", study.diloco_options(), port + 1, study.cap_steps,
                   stop_at=target)
    hit = bench_wan.time_to(dil["val"], target)
    row = {"seed": seed, "sync_final_val_loss": target,
           "wall_to_sync_loss_ratio": None if hit is None else hit / sync["wall_s"],
           "steps_to_sync_loss_ratio": None if hit is None else dil["steps"] / study.sync_steps,
           "diloco_val_gap": None if hit is not None else min(v for _, _, v in dil["val"]) - target}
    for side, r in (("sync", sync), ("diloco", dil)):
        row[side] = {"steps": r["steps"], "wall_s": round(r["wall_s"], 3), "eval_s": round(r["eval_s"], 3),
                     "samples_per_s": round(r["samples_per_s"], 3), "final_val_loss": round(r["val"][-1][2], 4),
                     "first_loss": r["losses"][0], "compute_utilisation": round(r["compute_utilisation"], 4),
                     "compute_utilisation_after_warmup": (None if r["compute_utilisation_after_warmup"] is None
                                                          else round(r["compute_utilisation_after_warmup"], 4)),
                     "between_sites_bytes_per_step": round(r["between_sites_bytes_per_step"]),
                     "outer_rounds": r["outer_rounds"], "val": rounded_val(r["val"])}
    row["diloco"]["time_to_target_s"] = None if hit is None else round(hit, 3)
    if study.sync_codec:  # the second baseline races to the same target; the faster baseline is the anchor
        log.info("seed %d: synchronous DP with --dp-codec %s until %.4f, at most %d steps", seed, study.sync_codec,
                 target, study.cap_steps)
        coded = run_side(sites, study, setup, cluster, work, "sync_coded", study.coded_sync_options(), port + 2,
                         study.cap_steps, stop_at=target)
        coded_hit = bench_wan.time_to(coded["val"], target)
        row["sync_coded"] = {"codec": study.sync_codec, "steps": coded["steps"], "wall_s": round(coded["wall_s"], 3),
                             "time_to_target_s": None if coded_hit is None else round(coded_hit, 3),
                             "final_val_loss": round(coded["val"][-1][2], 4),
                             "between_sites_bytes_per_step": round(coded["between_sites_bytes_per_step"]),
                             "val": rounded_val(coded["val"])}
        best = min(sync["wall_s"], coded_hit if coded_hit is not None else float("inf"))
        row["wall_to_best_sync_ratio"] = None if hit is None else hit / best
    log.info("seed %d: DiLoCo reached %.4f in %s s (%d steps) vs synchronous DP's %.1f s (%d steps): ratio %s; "
             "utilisation %.3f", seed, target, row["diloco"]["time_to_target_s"], dil["steps"], sync["wall_s"],
             sync["steps"], row["wall_to_sync_loss_ratio"], dil["compute_utilisation"])
    return row


def _median(xs: list) -> float | None:
    """The median, null when any value is null (a seed that missed)."""
    return None if not xs or any(x is None for x in xs) else statistics.median(xs)


def summarise(rows: list[dict], study: WanStudy, load_start, latency: str | None, skipped: str | None = None) -> dict:
    util = [r["diloco"]["compute_utilisation"] for r in rows]
    util_after = [r["diloco"]["compute_utilisation_after_warmup"] for r in rows]
    return {"bench": "diloco", "study": "wan",
            # the headline: DiLoCo's wall time to synchronous DP's final held-out loss over synchronous DP's wall time
            "wall_to_sync_loss_ratio": _median([r["wall_to_sync_loss_ratio"] for r in rows]),
            # with --sync-codec: over the faster of the two synchronous baselines to the same (exact) target
            "wall_to_best_sync_ratio": (_median([r.get("wall_to_best_sync_ratio") for r in rows])
                                        if study.sync_codec else None),
            "compute_utilisation": _median(util),
            "compute_utilisation_after_warmup": _median(util_after),
            "sync_compute_utilisation": _median([r["sync"]["compute_utilisation"] for r in rows]),
            "steps_to_sync_loss_ratio": _median([r["steps_to_sync_loss_ratio"] for r in rows]),
            "between_sites_bytes_per_step": {
                side: _median([r[side]["between_sites_bytes_per_step"] for r in rows]) for side in ("sync", "diloco")},
            "targets": {"wall_to_sync_loss_ratio": 0.4, "compute_utilisation": 0.9},
            "sync_compute_utilisation_note": "synchronous DP's own utilisation, for contrast",
            "settings": {**asdict(study), "cap_steps": study.cap_steps, "replicas": 2, "global_batch": ROWS[study.model],
                         "between_mbit": PROFILES[study.profile].between_mbit,
                         "within_mbit": PROFILES[study.profile].within_mbit, "latency": latency,
                         "diloco_options": " ".join(study.diloco_options()),
                         "sync_options": " ".join(study.sync_options())},
            "seeds": [r["seed"] for r in rows], "per_seed": rows, "skipped": skipped,
            "loadavg_start": [round(x, 2) for x in load_start],
            "loadavg_end": [round(x, 2) for x in os.getloadavg()]}


def run_study(name: str, study, seeds: list[int], work: Path | None, *, problem: str | None, hosts: dict[str, str],
              devices: tuple[str, ...], port: int, one_seed, summarise) -> int:
    """A study over a shaped two-site network (``--study wan`` and ``dpxpp``): ``problem`` (the settings' check) is
    one line, exit 2; without namespaces the summary says why, exit 0; else the sites of ``hosts`` (the cluster file
    lists ``devices`` in that order), ``one_seed(sites, study, seed, work, cluster, port)`` per seed, a JSON line
    each, and ``summarise(rows, study, load_start, latency)`` as the last line."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    load_start = os.getloadavg()
    if problem:
        print(f"bench_diloco.py: --study {name}: {problem}", file=sys.stderr)
        return 2
    reason = namespaces_available()
    if reason:
        print(f"bench_diloco.py: --study {name}: skipped: {reason}")
        print(json.dumps(summarise([], study, load_start, None, skipped=reason)))
        return 0
    rows: list[dict] = []
    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix=f"fusion-diloco-{name}-") as tmp:
        base = work or Path(tmp)
        base.mkdir(parents=True, exist_ok=True)
        with Sites(hosts, PROFILES[study.profile]) as sites:
            cluster = base / "cluster.yaml"
            cluster.write_text(bench_wan.cluster_yaml(sites, PROFILES[study.profile], 50.0, devices))
            for i, seed in enumerate(seeds):
                rows.append(one_seed(sites, study, seed, base / f"seed{seed}", cluster, port=port + 10 * i))
                print(json.dumps(rows[-1]), flush=True)
            latency = sites.latency_method
    out = summarise(rows, study, load_start, latency)
    out["wall_s"] = round(time.time() - t0, 1)
    print(json.dumps(out))
    return 0


def study_main(study: WanStudy, seeds: list[int], work: Path | None = None) -> int:
    """Run the study over ``seeds``; print a JSON line per seed and the summary as the last line."""
    return run_study("wan", study, seeds, work, problem=check(study), hosts=bench_wan.HOSTS,
                     devices=bench_wan.DEVICES, port=29700, one_seed=one_seed, summarise=summarise)
