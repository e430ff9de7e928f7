"""``fusion executor PLAN --node NAME --coordinator ADDR``: run one CompNode (one per host)."""
from __future__ import annotations

import argparse
import os


def add_parser(sub) -> None:
    p = sub.add_parser("executor", help="run one CompNode of a plan (one per host)",
                       description="Load PLAN, run part NAME, and serve the coordinator at ADDR until it says stop. "
                                   "Exit status 0 after stop, 1 after a failure or abort.")
    p.add_argument("plan", help="plan directory (plan.json + weights.safetensors)")
    p.add_argument("--node", required=True, help="the part (CompNode) name in the plan")
    p.add_argument("--coordinator", required=True, help="coordinator address, e.g. tcp://10.0.0.1:5555")
    p.add_argument("--bind", default=None, help="address to bind (default: the plan's address for this part, "
                                                "on all interfaces; tcp://127.0.0.1:* picks a free loopback port)")
    p.add_argument("--advertise", default=None, help="address peers connect to (default: the plan's address, else the bound one)")
    p.add_argument("--device", default="cpu", help="engine device (cpu, cuda:0, ...)")
    p.add_argument("--threads", type=int, default=None, help="intra-op threads of the engine")
    p.add_argument("--peer-timeout", type=float, default=10.0, help="exit when the coordinator is silent this long (s)")
    p.add_argument("--data-timeout", type=float, default=300.0, help="longest wait for one action's inputs (s)")
    p.add_argument("--max-message-bytes", type=int, default=1 << 30, help="reject larger messages")
    p.add_argument("--trace", default=None, help="write a Chrome trace (JSON) here at exit")
    p.add_argument("--fast-exit", action="store_true", help=argparse.SUPPRESS)
    p.set_defaults(run=run)


def bind_address(plan_address: str) -> str:
    """``tcp://host:port`` -> ``tcp://*:port`` (listen on every interface of this host)."""
    proto, _, rest = plan_address.partition("://")
    port = rest.rpartition(":")[2]
    return f"{proto}://*:{port}"


def run(args: argparse.Namespace) -> int:
    if args.threads:
        os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = str(args.threads)
    from ..executors.compnode import CompNode, ExecutorConfig
    from ..ir.errors import FusionError
    from ..plan import load_plan

    plan = load_plan(args.plan)
    if args.node not in plan.parts:
        raise FusionError(f"{args.plan}: plan has no part {args.node!r} (parts: {sorted(plan.parts)})")
    plan_addr = plan.parts[args.node].address
    bind = args.bind or (bind_address(plan_addr) if plan_addr else None)
    if bind is None:
        raise FusionError(f"{args.plan}: part {args.node!r} has no address in the plan; pass --bind")
    advertise = args.advertise or (plan_addr if plan_addr and not args.bind else None)
    cfg = ExecutorConfig(args.node, args.coordinator, bind, advertise, args.device, args.max_message_bytes,
                         peer_timeout_s=args.peer_timeout, data_timeout_s=args.data_timeout, trace_path=args.trace)
    status = CompNode(plan, args.plan, cfg).run()
    if args.fast_exit:
        # everything is flushed (trace written, sockets closed); skip the interpreter's slow teardown of torch
        import logging
        import sys

        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    return status
