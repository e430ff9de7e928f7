"""``fusion profile``: fit lambda_p (actual / peak speed) for this host (FusionLLM §3.5)."""
from __future__ import annotations

import argparse


def add_parser(sub) -> None:
    p = sub.add_parser("profile", help="fit this host's speed factor lambda from a short warm-up",
                       description="Time a few Linear forward+backward steps, fit time = t0 + FLOPs / S and print "
                                   "lambda = S / S* as JSON. With --cluster and --name, write a copy of the cluster "
                                   "(scenario JSON format) with that device's lambda set.")
    p.add_argument("--peak-flops", help="S*, the peak FLOP/s to compare against (e.g. '50 GFLOPS'); "
                                        "default: the --name device's peak_flops")
    p.add_argument("--device", default="cpu", help="torch device to time (default cpu)")
    p.add_argument("--sizes", default="256,512,768,1024", help="Linear widths to time (comma-separated)")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5, help="at least this many timed rounds (default 5)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads while timing (default: unchanged)")
    p.add_argument("--cluster", help="cluster file whose device gets the fitted lambda")
    p.add_argument("--name", help="device name in --cluster")
    p.add_argument("-o", "--output", help="where to write the updated cluster (.json)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    import json
    from dataclasses import replace
    from pathlib import Path

    from ..cluster import ClusterError, load_cluster
    from ..ir.errors import FusionError
    from ..profile import profile_host
    from ..units import UnitError, parse_quantity

    cluster = dev_index = None
    if args.cluster or args.output or args.name:
        if not (args.cluster and args.name):
            raise FusionError("profile: --cluster and --name go together (and -o needs both)")
        cluster = load_cluster(args.cluster)
        dev_index = cluster.index(args.name)
    if args.peak_flops:
        try:
            peak = parse_quantity(args.peak_flops, "flops")
        except UnitError as e:
            raise FusionError(f"--peak-flops: {e}") from None
    elif cluster is not None:
        peak = cluster.devices[dev_index].peak_flops
    else:
        raise FusionError("profile: give --peak-flops, or --cluster and --name to take the device's peak_flops")
    try:
        sizes = tuple(int(s) for s in args.sizes.split(",") if s.strip())
        prof = profile_host(peak, args.device, sizes, args.batch, args.repeats, threads=args.threads)
    except ValueError as e:
        raise FusionError(f"profile: {e}") from None
    print(json.dumps(prof.to_dict()))
    if cluster is not None and args.output:
        if prof.lam <= 0:
            raise ClusterError(f"{args.cluster}: fitted lambda {prof.lam} is not positive")
        cluster.devices[dev_index] = replace(cluster.devices[dev_index], lam=prof.lam)
        Path(args.output).write_text(json.dumps(cluster.to_dict(), indent=1))
        print(f"wrote {args.output} with {args.name}.lambda = {prof.lam:.4g}")
    return 0
