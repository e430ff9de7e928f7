"""``fusion executor PLAN --node PART --coordinator ADDR``: run one CompNode (one per host)."""
from __future__ import annotations

import dataclasses
import os
from typing import TYPE_CHECKING, Mapping

from fusion.executors.runtime.local_links import IPC

if TYPE_CHECKING:
    from fusion.options.commands import Executor


def default_threads(plan, names: list[str], cores: int, env: Mapping[str, str] | None = None) -> int | None:
    """Intra-op threads for the process running parts ``names`` when ``--threads`` is not given: the host's
    ``cores`` shared among the plan's CompNode processes (lanes) whose address names the same host as this one's,
    at least 1; None (torch's default) when the plan gives this part no address, or when ``env`` (default: this
    process's environment) sets ``OMP_NUM_THREADS``, which torch already honours: the user said how many. Several
    executors started by hand on one box, each with torch's default of every core, ran 27x slower per step than
    with one thread each (issue 38); ``fusion run`` divides the cores the same way (``LocalCluster.threads``).
    (Overriding ``OMP_NUM_THREADS=1`` with every core made two executors in network namespaces of one 2-core box,
    hosts of their own by address, run their parts 3.7x slower: bench_wan, issue 36.)"""
    from urllib.parse import urlsplit

    if (os.environ if env is None else env).get("OMP_NUM_THREADS"):
        return None

    def host(part: str) -> str | None:
        addr = plan.parts[part].address
        return urlsplit(addr.replace("tcp://", "http://", 1)).hostname if addr else None

    mine = host(names[0])
    if mine is None:
        return None
    lanes = {tuple(plan.lane_of(p)) for p in plan.parts if host(p) == mine}
    return max(1, cores // max(1, len(lanes)))


def _import_frozen() -> None:
    """Import what an executor runs with, the garbage collector off, then freeze it.

    Importing torch makes about a million long-lived objects and no garbage: the collections it triggers cost
    10-20% of the import. Frozen afterwards, they are left out of every later full collection too (torch._dynamo,
    which torch.optim imports at the first optimizer, is then about a second cheaper to import)."""
    import gc

    gc.disable()
    try:
        import fusion.commands.keys  # noqa: F401
        import fusion.executors.runtime.compnode  # noqa: F401
        import fusion.executors.runtime.plandigest  # noqa: F401
        import fusion.plan  # noqa: F401
    finally:
        gc.enable()
    gc.freeze()


def part_names(args: "Executor", plan) -> list[str]:
    """The parts of ``--node`` (one lane: one part, or all parts of one device under an interleaved schedule);
    FusionError naming the plan and the part for one it lacks or a set that is not one lane."""
    from fusion.ir.errors import FusionError

    names = [n for n in args.node.split(",") if n]
    for name in names:
        if name not in plan.parts:
            raise FusionError(f"{args.plan}: plan has no part {name!r} (parts: {', '.join(plan.parts)})")
    lane = plan.lane_of(names[0])
    if sorted(names) != sorted(lane):
        raise FusionError(f"{args.plan}: --node {args.node}: the interleaved schedule runs parts {','.join(lane)} of device "
                          f"{plan.parts[names[0]].device!r} in one process; pass --node {','.join(lane)}" if len(lane) > 1 else
                          f"{args.plan}: --node {args.node}: each of these parts runs in its own process; pass one")
    return names


def per_part(args: "Executor", names: list[str]) -> tuple[list, list]:
    """(the secret key file, the trace file) of each part: ``--key`` and ``--trace`` split by comma."""
    from fusion.ir.errors import FusionError

    keys = args.security.key.split(",") if args.security.key else [None] * len(names)
    if len(keys) != len(names):
        raise FusionError(f"--key: give one secret key file per part of --node ({len(names)}), comma-separated")
    if len(names) > 1 and (args.advertise or (args.bind and not args.bind.endswith(":*")
                                              and not args.bind.startswith(IPC))):
        raise FusionError("--node with several parts: each part listens on its own port; use the plan's addresses "
                          "or --bind with port * (e.g. tcp://10.0.0.1:*) or an ipc:// path (each part binds "
                          "PATH.<part>), and no --advertise")
    traces = args.trace.split(",") if args.trace else [None] * len(names)
    if len(traces) == 1 and len(names) > 1:  # one Chrome trace per part: NAME.json -> NAME.<part>.json
        traces = [f"{os.path.splitext(traces[0])[0]}.{n}{os.path.splitext(traces[0])[1]}" for n in names]
    if len(traces) != len(names):
        raise FusionError(f"--trace: give one file, or one per part of --node ({len(names)}), comma-separated")
    return keys, traces


def lane_bind(args: "Executor", name: str, parts: int) -> "Executor":
    """``args`` for part ``name`` of a process running ``parts`` parts: with an ``ipc://PATH`` bind and several parts
    each binds ``PATH.<name>`` (one socket file each; a TCP bind with port ``*`` gives each its own port already)."""
    if parts > 1 and args.bind and args.bind.startswith(IPC):
        return dataclasses.replace(args, bind=f"{args.bind}.{name}")
    return args


def executor_config(args: "Executor", plan, name: str, key, trace, device: str, digest: str):
    """The :class:`~fusion.executors.runtime.compnode.ExecutorConfig` of part ``name``."""
    from fusion.commands.keys import COORDINATOR, bind_address, security_from_args
    from fusion.executors.runtime.compnode import ExecutorConfig
    from fusion.ir.errors import FusionError

    plan_addr = plan.parts[name].address
    bind = args.bind or (bind_address(plan_addr) if plan_addr else None)
    advertise = args.advertise or (plan_addr if plan_addr and not args.bind else None)
    if args.dial_out:  # nothing reachable listens: a loopback port only, and peers are told to use the relay
        from fusion.executors.runtime.relay import dial_out_addresses

        bind, advertise = dial_out_addresses(args.dial_out, args.bind, args.security.insecure)
    if bind is None:
        raise FusionError(f"{args.plan}: part {name!r} has no address in the plan; pass --bind")
    security = security_from_args(dataclasses.replace(args.security, key=key), args.plan,
                                  [COORDINATOR, *plan.parts], name, bind)
    return ExecutorConfig(name, args.coordinator, bind, advertise, device, args.max_message_bytes,
                          peer_timeout_s=args.peer_timeout, data_timeout_s=args.data_timeout,
                          startup_timeout_s=args.startup_timeout, trace_path=trace,
                          engine_options={**({"compile": True} if args.compile_parts else {}),
                                          **({"compiled": False} if args.interpreted_parts else {}),
                                          **({"encode": args.encode} if args.encode else {})},
                          trust_plugins=args.trust_plugins, security=security, plan_digest=digest)


def _fast_exit(status: int) -> None:
    """Everything is flushed (trace written, sockets closed): skip the interpreter's slow teardown of torch."""
    import logging
    import sys

    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def run(args: "Executor") -> int:
    """``fusion executor`` with its options (:class:`fusion.options.commands.Executor`)."""
    if args.threads:
        os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = str(args.threads)
    _import_frozen()
    from fusion.executors.runtime.compnode import CompNode, run_lane
    from fusion.executors.runtime.plandigest import plan_digest
    from fusion.options.device import check_device
    from fusion.plan import load_plan

    device = check_device(args.device)  # before the plan and the sockets: a bad device is one line
    plan = load_plan(args.plan)
    names = part_names(args, plan)
    if not args.threads:
        threads = default_threads(plan, names, os.cpu_count() or 1)
        if threads is not None:
            import torch

            torch.set_num_threads(threads)
    keys, traces = per_part(args, names)
    digest = plan_digest(args.plan)
    cfgs = [executor_config(lane_bind(args, n, len(names)), plan, n, k, t, device, digest)
            for n, k, t in zip(names, keys, traces)]
    if args.heap == "steady":  # after the checks (a bad argument stays a one-line error), before the engines' tensors
        from fusion.executors.runtime.heap import steady_heap

        steady_heap()
    status = run_lane([CompNode(plan, args.plan, c) for c in cfgs])
    if args.fast_exit:
        _fast_exit(status)
    return status
