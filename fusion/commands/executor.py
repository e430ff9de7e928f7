"""``fusion executor PLAN --node PART --coordinator ADDR``: run one CompNode (one per host)."""
from __future__ import annotations

import argparse
import os


def add_parser(sub) -> None:
    from fusion.commands.coordinator import positive_float, zmq_address

    p = sub.add_parser("executor", help="run one CompNode of a plan (one per host)",
                       description="Load PLAN, check it and its weights, run the part named by --node (part0, part1, "
                                   "...: see `fusion inspect PLAN`) and serve the coordinator at --coordinator ADDR "
                                   "until it says stop. Logs what it waits for. Exit status 0 after stop, 1 after a "
                                   "failure, an abort or a timeout, 2 for a bad plan, part name or address.")
    p.add_argument("plan", help="plan directory (plan.json + weights.safetensors)")
    p.add_argument("--node", required=True, metavar="PART[,PART...]",
                   help="the part (CompNode) to run: part0, part1, ...; under an interleaved schedule, all parts of one "
                        "device, comma-separated (`fusion inspect PLAN` lists them), run in this one process")
    p.add_argument("--coordinator", required=True, type=zmq_address, metavar="ADDR",
                   help="the coordinator's address, tcp://HOST:PORT, e.g. tcp://10.0.0.1:5600")
    p.add_argument("--bind", default=None, type=zmq_address, metavar="ADDR",
                   help="address to listen on (default: the plan's address for this part, on that address only; "
                        "tcp://127.0.0.1:* picks a free loopback port, tcp://*:PORT listens on every interface)")
    p.add_argument("--advertise", default=None, type=zmq_address, metavar="ADDR",
                   help="address peers connect to (default: the plan's address, else the bound one)")
    p.add_argument("--dial-out", default=None, type=zmq_address, metavar="RELAY_ADDR",
                   help="behind NAT: make only outbound connections; peers and the coordinator reach this CompNode "
                        "through `fusion relay` at RELAY_ADDR, sealed end to end (needs --key; docs/security.md)")
    p.add_argument("--device", default="cpu", help="torch device of this CompNode's engine (cpu, cuda, cuda:0, ...)")
    p.add_argument("--threads", type=int, default=None,
                   help="intra-op threads of the engine (default: the host's cores shared among the plan's CompNode "
                        "processes whose address names this part's host; torch's own default when the plan has no "
                        "addresses)")
    p.add_argument("--startup-timeout", type=positive_float, default=120.0,
                   help="give up when the coordinator has not answered after this long (s)")
    p.add_argument("--peer-timeout", type=positive_float, default=10.0,
                   help="once in touch, give up when the coordinator is silent this long (s)")
    p.add_argument("--data-timeout", type=positive_float, default=300.0, help="longest wait for one action's inputs (s)")
    p.add_argument("--max-message-bytes", type=int, default=None,
                   help="reject larger messages (default: the largest tensor the plan sends this part, x4, at least 8 MiB)")
    p.add_argument("--trace", default=None, metavar="FILE", help="write a Chrome trace (JSON) here at exit (several parts: one file per part, comma-separated, "
                        "or one name that gets .PART before its extension)")
    p.add_argument("--compile-parts", action="store_true",
                   help="torch engine: torch.compile the part's generated module (slow first step; off by default)")
    p.add_argument("--interpreted-parts", action="store_true",
                   help="torch engine: walk the part node by node instead of one generated function")
    p.add_argument("--encode", default=None, choices=["device", "torch", "host"],
                   help="torch engine: where compressed edges are encoded (same payload bytes): on the engine's "
                        "device, only payloads leave it (default); 'torch': the torch codecs even on a CPU device; "
                        "'host': from a NumPy copy of every dense tensor, as before")
    p.add_argument("--heap", default="steady", choices=["steady", "default"],
                   help="steady (default): raise glibc's mmap/trim thresholds so the tensors a step frees are reused "
                        "by the next step instead of being unmapped and page-faulted in again (the process keeps its "
                        "peak memory); default: leave the C allocator as it is. No effect without glibc")
    p.add_argument("--trust-plugins", action="store_true",
                   help="import the plugin files (Python code) the plan lists; without it such a plan is refused")
    from fusion.commands.keys import add_security_options

    add_security_options(p)
    p.add_argument("--fast-exit", action="store_true", help=argparse.SUPPRESS)
    p.set_defaults(run=run, default_verbosity=1)


def default_threads(plan, names: list[str], cores: int) -> int | None:
    """Intra-op threads for the process running parts ``names`` when ``--threads`` is not given: the host's
    ``cores`` shared among the plan's CompNode processes (lanes) whose address names the same host as this one's,
    at least 1; None (torch's default) when the plan gives this part no address. Several executors started by
    hand on one box, each with torch's default of every core, ran 27x slower per step than with one thread each
    (issue 38); ``fusion run`` divides the cores the same way (``LocalCluster.threads``)."""
    from urllib.parse import urlsplit

    def host(part: str) -> str | None:
        addr = plan.parts[part].address
        return urlsplit(addr.replace("tcp://", "http://", 1)).hostname if addr else None

    mine = host(names[0])
    if mine is None:
        return None
    lanes = {tuple(plan.lane_of(p)) for p in plan.parts if host(p) == mine}
    return max(1, cores // max(1, len(lanes)))


def run(args: argparse.Namespace) -> int:
    if args.threads:
        os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = str(args.threads)
    import gc

    # Importing torch makes about a million long-lived objects and no garbage: the collections it triggers cost
    # 10-20% of the import. Frozen afterwards, they are left out of every later full collection too (torch._dynamo,
    # which torch.optim imports at the first optimizer, is then about a second cheaper to import).
    gc.disable()
    try:
        from fusion.commands.keys import COORDINATOR, bind_address, security_from_args
        from fusion.executors.runtime.compnode import CompNode, ExecutorConfig, run_lane
        from fusion.executors.runtime.plandigest import plan_digest
        from fusion.ir.errors import FusionError
        from fusion.plan import load_plan

        from fusion.executors.engines.torch.device import check_device
    finally:
        gc.enable()
    gc.freeze()

    device = check_device(args.device)  # before the plan and the sockets: a bad device is one line
    plan = load_plan(args.plan)
    names = [n for n in args.node.split(",") if n]
    for name in names:
        if name not in plan.parts:
            raise FusionError(f"{args.plan}: plan has no part {name!r} (parts: {', '.join(plan.parts)})")
    if not args.threads:
        threads = default_threads(plan, names, os.cpu_count() or 1)
        if threads is not None:
            import torch

            torch.set_num_threads(threads)
    lane = plan.lane_of(names[0])
    if sorted(names) != sorted(lane):
        raise FusionError(f"{args.plan}: --node {args.node}: the interleaved schedule runs parts {','.join(lane)} of device "
                          f"{plan.parts[names[0]].device!r} in one process; pass --node {','.join(lane)}" if len(lane) > 1 else
                          f"{args.plan}: --node {args.node}: each of these parts runs in its own process; pass one")
    keys = args.key.split(",") if args.key else [None] * len(names)
    if len(keys) != len(names):
        raise FusionError(f"--key: give one secret key file per part of --node ({len(names)}), comma-separated")
    if len(names) > 1 and (args.advertise or (args.bind and not args.bind.endswith(":*"))):
        raise FusionError("--node with several parts: each part listens on its own port; use the plan's addresses "
                          "or --bind with port * (e.g. tcp://10.0.0.1:*), and no --advertise")
    traces = args.trace.split(",") if args.trace else [None] * len(names)
    if len(traces) == 1 and len(names) > 1:  # one Chrome trace per part: NAME.json -> NAME.<part>.json
        traces = [f"{os.path.splitext(traces[0])[0]}.{n}{os.path.splitext(traces[0])[1]}" for n in names]
    if len(traces) != len(names):
        raise FusionError(f"--trace: give one file, or one per part of --node ({len(names)}), comma-separated")
    digest = plan_digest(args.plan)
    cfgs = []
    for name, key in zip(names, keys):
        plan_addr = plan.parts[name].address
        bind = args.bind or (bind_address(plan_addr) if plan_addr else None)
        advertise = args.advertise or (plan_addr if plan_addr and not args.bind else None)
        if args.dial_out:  # nothing reachable listens: a loopback port only, and peers are told to use the relay
            from fusion.executors.runtime.relay import dial_out_addresses

            bind, advertise = dial_out_addresses(args.dial_out, args.bind, args.insecure)
        if bind is None:
            raise FusionError(f"{args.plan}: part {name!r} has no address in the plan; pass --bind")
        security = security_from_args(argparse.Namespace(**{**vars(args), "key": key}), args.plan,
                                      [COORDINATOR, *plan.parts], name, bind)
        trace = traces[names.index(name)]
        cfgs.append(ExecutorConfig(name, args.coordinator, bind, advertise, device, args.max_message_bytes,
                                   peer_timeout_s=args.peer_timeout, data_timeout_s=args.data_timeout,
                                   startup_timeout_s=args.startup_timeout, trace_path=trace,
                                   engine_options={**({"compile": True} if args.compile_parts else {}),
                                                   **({"compiled": False} if args.interpreted_parts else {}),
                                                   **({"encode": args.encode} if args.encode else {})},
                                   trust_plugins=args.trust_plugins, security=security, plan_digest=digest))
    if args.heap == "steady":  # after the checks (a bad argument stays a one-line error), before the engines' tensors
        from fusion.executors.runtime.heap import steady_heap

        steady_heap()
    status = run_lane([CompNode(plan, args.plan, c) for c in cfgs])
    if args.fast_exit:
        # everything is flushed (trace written, sockets closed); skip the interpreter's slow teardown of torch
        import logging
        import sys

        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    return status
