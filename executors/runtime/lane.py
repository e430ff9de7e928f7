"""The CompNode(s) of one executor process: one part, or the parts of one device under interleaved 1F1B, which
run the device's merged action list (each :class:`~.compnode.CompNode` in ``nodes``)."""
from __future__ import annotations

import logging

from fusion.executors.runtime.control import Abort, Fetch, State, Step, Stop
from fusion.executors.runtime.node_common import COORDINATOR, ExecutorAbort
from fusion.executors.runtime.schedule import make_lanes
from fusion.ir.boundary import part_links
from fusion.ir.errors import FusionError

log = logging.getLogger(__name__)


def _serve_lane(nodes: list) -> int:
    """Several parts in one process (the virtual stages of one device under interleaved 1F1B): each step
    runs the device's merged action list (:func:`fusion.ir.schedule.make_lanes`), one action at a time on
    the part it belongs to; the end of a step goes kind by kind (:func:`~fusion.ir.schedule.step_tail`) over the
    parts, so that no part waits for a tied gradient its neighbour in this process has not sent yet."""
    first = nodes[0]
    plan = first.plan
    devices = dict(first.spec.devices)
    links = part_links(first.graph, first.spec.assignment)
    lane = make_lanes(plan.schedule, list(first.spec.order), links, first.n_micro, devices)[devices[first.me]]
    by_part = {n.me: n for n in nodes}
    while True:
        steps: dict[str, Step] = {}
        stopped: list[str] = []
        while len(steps) + len(stopped) < len(nodes):  # every part's next step (or stop); fetches answered as they come
            (n, c), _ = first._wait(lambda: next(((m, m._ctrl.popleft()) for m in nodes if m._ctrl), None),
                                    "the coordinator", float("inf"))
            if isinstance(c, Abort):
                raise ExecutorAbort(f"aborted by the coordinator: {c.reason}")
            if isinstance(c, Fetch):
                n.transport.send(COORDINATOR, State(arrays=n._final_state()).frames())
            elif isinstance(c, Step) and n.me not in steps:
                steps[n.me] = c
            elif isinstance(c, Stop) and n.me not in stopped:
                stopped.append(n.me)
            else:
                log.warning("%s: ignoring control op %r", n.me, c.op)
        if stopped:
            if steps:
                raise ExecutorAbort(f"the coordinator stopped {', '.join(stopped)} but sent a step to "
                                    f"{', '.join(sorted(steps))} of the same process")
            log.info("%s: told to stop after %d steps", ", ".join(by_part), first.inbox.expected_iter)
            return 0
        sts = {p: by_part[p]._begin(c) for p, c in steps.items()}
        for p, a in lane:
            by_part[p]._act(sts[p], a)
        for kind in first._tail(sts[first.me]):  # (every part of a process runs the same tail)
            for n in nodes:
                n._run_tail(sts[n.me], kind)


def run_lane(nodes: list) -> int:
    """Run the CompNode(s) of one executor process until the coordinator stops them; the exit status.

    One node is the usual CompNode process. Several are the parts of one device under interleaved 1F1B
    (``Plan.lanes``): each keeps its own socket, inbox and engine, and the process runs the device's
    merged action list."""
    if len(nodes) > 1:
        lanes = nodes[0].plan.lanes()
        want = next((ps for ps in lanes.values() if nodes[0].me in ps), [])
        if sorted(n.me for n in nodes) != sorted(want):
            raise FusionError(f"parts {', '.join(n.me for n in nodes)} are not one device's parts; the plan's processes "
                              f"run {'; '.join(','.join(ps) for ps in lanes.values())}")
        nodes = sorted(nodes, key=lambda n: want.index(n.me))
    for n in nodes:
        n._siblings = [m for m in nodes if m is not n]
    addresses: list[str] = []
    try:
        for n in nodes:
            addresses.append(n._listen())
    except FusionError:
        for n in nodes[:len(addresses)]:
            n.transport.close(timeout_s=1.0, linger_s=0.0)
        raise
    status = 1
    try:
        for n, address in zip(nodes, addresses):
            n._hello(address)
        for n in nodes:
            n._ready()
        status = nodes[0]._serve() if len(nodes) == 1 else _serve_lane(nodes)
    except Exception as e:
        if not isinstance(e, ExecutorAbort):
            log.exception("%s: failed", ", ".join(n.me for n in nodes))
        for n in nodes:
            n._report(e)
    finally:
        for n in nodes:
            n._close(status)
    return status


