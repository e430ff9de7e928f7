"""Issue 36's DP x PP row: 2 sites x 2 devices, fusion's plan against torch's, time to torch's held-out loss.

``bench_diloco.py --study dpxpp``. The network is :mod:`netns_sites`' (as in :mod:`diloco_wan`): site A holds the
hosts ``a0``, ``a1`` and the coordinator, site B ``b0``, ``b1``; 1 Gbit/s tbf from each host to its site's switch,
the profile's rate (20 Mbit/s by default) between the sites. Four compute processes, one per host, one thread
each (the 2 cores of this box are shared by all four on both sides alike).

Two runs per seed, the same model, data, batches and AdamW (:func:`bench_wan.wan_setup`, the char GPT of
``wan_model.py`` on the CPython-source corpus, 32 rows a step):

1. **torch**, what a PyTorch user runs on two sites of two GPUs: ``torch.distributed.pipelining`` inside each site
   (2 stages, the fastest of GPipe / 1F1B / interleaved 1F1B by ``wan_torch.py``'s probe) and DDP across the sites
   (each stage's gradients averaged between its two replicas every step, over the slow link, in bfloat16 as DDP's
   ``bf16_compress_hook`` sends them unless ``--torch-dp-wire fp32``; ``wan_torch.py --replicas 2``, with fp32
   equal to one process on the whole batch: tests/benchmarks/test_wan_torch.py).
   ``--sync-steps`` steps; its final held-out loss is the **target**, its wall time the **anchor**;
2. **fusion**, its plan for the same four devices: ``fusion compile --strategy opfence --replicas 2 --compress auto``
   (each replica inside one site, one per site: the checked layout; OP-Fence cuts the ``small`` model into 2 stages
   per replica and ``auto`` puts a 4-bit codec on the cut, the ``tiny`` one of ``--quick`` stays one stage) with
   DiLoCo across the sites at :mod:`diloco_wan`'s settings (H, outer lr and Nesterov momentum, the synchronous
   warm-up and its codec, 8-bit pseudo-gradients with error feedback), run until its held-out loss is <= the target
   (``--stop-at-val-loss``) or ``cap_factor x`` the synchronous steps.

Figures (the final JSON line): ``wall_to_torch_loss_ratio``: fusion's wall time to the first evaluation at or below
the target over torch's wall time to its final evaluation (both from the first step's start, evaluations counted,
start-up not; the median over the seeds, null when any seed misses); ``steps_to_torch_loss_ratio``; fusion's
``compute_utilisation`` (:func:`diloco_wan.compute_utilisation`, over its 4 parts); the bytes between the sites per
step of each side; the load average at the start and the end.
"""
from __future__ import annotations

import logging
import os
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

import bench_wan  # noqa: E402
from diloco_wan import (ROWS, WanStudy, _median, codec_problem, compute_utilisation, metrics_lines,  # noqa: E402
                        rounded_val, run_study)
from netns_sites import PROFILES, Sites  # noqa: E402

log = logging.getLogger("dpxpp_wan")
#: host -> site: two devices per site, the coordinator in site A
HOSTS = {"coord": "site-a", "a0": "site-a", "a1": "site-a", "b0": "site-b", "b1": "site-b"}
#: torch's ranks in order: replica 0 (site A) is ranks 0-1, replica 1 (site B) ranks 2-3
DEVICES = ("a0", "a1", "b0", "b1")
REPLICAS = 2
#: the cluster file's device order: ``--replicas`` places a further replica's stage on the fastest free device,
#: ties by this order, so a one-stage replica 1 (``--quick``'s tiny model) lands in site B
CLUSTER_ORDER = ("a0", "b0", "a1", "b1")


@dataclass(frozen=True)
class DpPpStudy(WanStudy):
    """:class:`diloco_wan.WanStudy`'s settings (fusion's DiLoCo across the sites, the run lengths, the network) and:

    precision: both sides' ``--precision`` (fp32, or bf16: torch's stages under autocast send bfloat16, fusion
               compiles ``--precision bf16``).
    compress:  fusion's ``--compress`` on the pipeline's cut inside a site (``auto``: the compiler's choice).
    torch_dp_wire: torch's gradient all-reduce across the sites: ``bf16`` (DDP's ``bf16_compress_hook``: half the
               bytes, the same held-out loss, torch's best here; ``wan_torch.py --dp-wire``) or ``fp32`` (DDP's
               default).
    """

    precision: str = "fp32"
    compress: str = "auto"
    torch_dp_wire: str = "bf16"

    def fusion_options(self) -> tuple[str, ...]:
        return self.diloco_options()


def check(study: DpPpStudy) -> str | None:
    """One line saying what is wrong with the settings (:func:`diloco_wan.check`'s and this row's own), or None."""
    from diloco_wan import check as wan_check

    problem = wan_check(study)
    if problem:
        return problem
    if study.precision not in ("fp32", "bf16"):
        return f"--precision {study.precision}: expected fp32 or bf16"
    if study.sync_codec is not None:
        return (f"--sync-codec {study.sync_codec}: the second synchronous baseline is --study wan's; this row's "
                "baseline is torch's (--torch-dp-wire bf16 for its compressed all-reduce)")
    if study.torch_dp_wire not in ("fp32", "bf16"):
        return f"--torch-dp-wire {study.torch_dp_wire}: expected fp32 or bf16"
    return codec_problem("--compress", study.compress, "ACTIVATION", allow=(None, "auto"))


def check_layout(plan: dict, sites: Sites) -> str | None:
    """Why ``plan`` is not 2 replicas with each replica inside one site and the replicas in different sites (None:
    it is). The stages per replica are OP-Fence's to choose: 2 for the ``small`` model, 1 for ``tiny``
    (``--quick``), whose compute is too small to pay for a cut."""
    by_replica: dict[int, list[str]] = {}
    for name, part in plan["parts"].items():
        by_replica.setdefault(int(part.get("replica") or 0), []).append(part["device"])
    if len(by_replica) != REPLICAS:
        return f"expected {REPLICAS} replicas, the plan has parts {sorted(plan['parts'])}"
    homes = [{sites.hosts[d] for d in devs} for devs in by_replica.values()]
    if any(len(h) != 1 for h in homes) or len({next(iter(h)) for h in homes}) != REPLICAS:
        return f"expected each replica inside one site, one per site; devices by replica {by_replica}"
    return None


def one_seed(sites: Sites, study: DpPpStudy, seed: int, work: Path, cluster: Path, port: int) -> dict:
    work.mkdir(parents=True, exist_ok=True)
    setup = bench_wan.wan_setup(BENCH / "wan_torch.py", study.model, seed)
    log.info("seed %d: torch, pipelining inside the sites and DDP across, %d steps", seed, study.sync_steps)
    b0 = sites.between_sent_bytes()
    torch_res = bench_wan.run_torch(sites, BENCH / "wan_torch.py", study, setup, work / "torch", port, DEVICES,
                                    REPLICAS, study.sync_steps, ("--dp-wire", study.torch_dp_wire))
    torch_bytes = (sites.between_sent_bytes() - b0) / study.sync_steps
    target = torch_res["val"][-1][2]
    plan_dir = work / "fusion.plan"
    plan = bench_wan.compile_plan(setup, cluster, None, "opfence", study.compress, plan_dir, dp=study.fusion_options(),
                                  precision=study.precision)
    problem = check_layout(plan, sites)
    if problem:
        raise RuntimeError(f"fusion compile: {problem}")
    log.info("seed %d: fusion until torch's final held-out loss %.4f, at most %d steps", seed, target, study.cap_steps)
    b0 = sites.between_sent_bytes()
    fus = bench_wan.run_fusion(sites, plan_dir, setup, study, work / "fusion", port + 1, steps=study.cap_steps,
                               stop_at=target)
    fusion_bytes = (sites.between_sent_bytes() - b0) / fus["steps"]
    lines = metrics_lines(work / "fusion" / "run")
    hit = bench_wan.time_to(fus["val"], target)
    row = {"seed": seed, "torch_final_val_loss": target,
           "wall_to_torch_loss_ratio": None if hit is None else hit / torch_res["wall_s"],
           "steps_to_torch_loss_ratio": None if hit is None else fus["steps"] / study.sync_steps,
           "fusion_val_gap": None if hit is not None else min(v for _, _, v in fus["val"]) - target,
           "torch": {"steps": study.sync_steps, "wall_s": round(torch_res["wall_s"], 3),
                     "schedule": torch_res["schedule"], "first_loss": torch_res["losses"][0],
                     "samples_per_s": round(torch_res["samples_per_s"], 3),
                     "between_sites_bytes_per_step": round(torch_bytes),
                     "val": rounded_val(torch_res["val"])},
           "fusion": {"steps": fus["steps"], "wall_s": round(fus["wall_s"], 3), "eval_s": round(fus["eval_s"], 3),
                      "time_to_target_s": None if hit is None else round(hit, 3), "first_loss": fus["losses"][0],
                      "samples_per_s": round(fus["samples_per_s"], 3), "parts": fus["parts"],
                      "stages": len(plan["parts"]) // REPLICAS,
                      "compression": fus["compression"],
                      "compute_utilisation": round(compute_utilisation(lines), 4),
                      "compute_utilisation_after_warmup": (round(compute_utilisation(lines, study.sync_warmup), 4)
                                                           if fus["steps"] > study.sync_warmup else None),
                      "between_sites_bytes_per_step": round(fusion_bytes),
                      "val": rounded_val(fus["val"])}}
    log.info("seed %d: fusion reached %.4f in %s s (%d steps) vs torch's %.1f s (%d steps): ratio %s", seed, target,
             row["fusion"]["time_to_target_s"], fus["steps"], torch_res["wall_s"], study.sync_steps,
             row["wall_to_torch_loss_ratio"])
    return row


def summarise(rows: list[dict], study: DpPpStudy, load_start, latency: str | None, skipped: str | None = None) -> dict:
    return {"bench": "diloco", "study": "dpxpp",
            # the headline: fusion's wall time to torch's final held-out loss over torch's wall time
            "wall_to_torch_loss_ratio": _median([r["wall_to_torch_loss_ratio"] for r in rows]),
            "steps_to_torch_loss_ratio": _median([r["steps_to_torch_loss_ratio"] for r in rows]),
            "compute_utilisation": _median([r["fusion"]["compute_utilisation"] for r in rows]),
            "between_sites_bytes_per_step": {
                side: _median([r[side]["between_sites_bytes_per_step"] for r in rows]) for side in ("torch", "fusion")},
            "settings": {**asdict(study), "cap_steps": study.cap_steps, "replicas": REPLICAS, "torch_stages": 2,
                         "global_batch": ROWS[study.model], "between_mbit": PROFILES[study.profile].between_mbit,
                         "within_mbit": PROFILES[study.profile].within_mbit, "latency": latency,
                         "topology": "2 sites x 2 devices, coordinator in site A",
                         "fusion": (f"fusion compile --strategy opfence --compress {study.compress} "
                                    + " ".join(study.fusion_options())),
                         "torch": (f"wan_torch.py --world 4 --replicas 2 --dp-wire {study.torch_dp_wire} "
                                   "(pipelining inside a site, DDP across)")},
            "seeds": [r["seed"] for r in rows], "per_seed": rows, "skipped": skipped,
            "loadavg_start": [round(x, 2) for x in load_start],
            "loadavg_end": [round(x, 2) for x in os.getloadavg()]}


def study_main(study: DpPpStudy, seeds: list[int], work: Path | None = None) -> int:
    """Run the row over ``seeds``; a JSON line per seed and the summary as the last line."""
    return run_study("dpxpp", study, seeds, work, problem=check(study), hosts=HOSTS, devices=CLUSTER_ORDER,
                     port=29800, one_seed=one_seed, summarise=summarise)
