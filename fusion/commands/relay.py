"""``fusion relay PLAN --bind ADDR --key relay.secret``: forward sealed OP-Data for CompNodes behind NAT.

Run it on a host every process of the run can reach (the coordinator's, say); CompNodes started with
``fusion executor ... --dial-out tcp://THIS_HOST:PORT`` make only outbound connections and are reached through it.
It authenticates every connection with the run's CURVE keys, cannot read or forge what it forwards
(:mod:`fusion.executors.runtime.relay`), and stops on SIGTERM or Ctrl-C, printing what it forwarded.
"""
from __future__ import annotations

import json
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fusion.options.commands import Relay


def relay_limit(plan) -> int:
    """The largest sealed message the relay forwards: the largest any process of the plan receives, sealed."""
    from fusion.executors.runtime.limits import coordinator_message_limit, part_message_limit
    from fusion.executors.runtime.relay import relay_overhead
    from fusion.executors.runtime.transport import FRAME_SLACK, MAX_FRAMES

    biggest = max([coordinator_message_limit(plan), *(part_message_limit(plan, plan.stage_of(p)) for p in plan.parts)])
    return biggest + FRAME_SLACK + relay_overhead(MAX_FRAMES)


def run(args: "Relay") -> int:
    """``fusion relay`` with its options (:class:`fusion.options.commands.Relay`)."""
    from fusion.executors.runtime.keys import PUBLIC_KEYS_FILE, security_for
    from fusion.executors.runtime.liveness import Heartbeat
    from fusion.executors.runtime.relay import RELAY, RelayServer
    from fusion.plan import load_plan

    plan = load_plan(args.plan)
    plan_dir = Path(args.plan).parent if Path(args.plan).name == "plan.json" else Path(args.plan)
    public = Path(args.public_keys) if args.public_keys else plan_dir / PUBLIC_KEYS_FILE
    security = security_for(args.key, public, ["coordinator", *plan.parts, RELAY], RELAY)
    heartbeat = Heartbeat(args.link_timeout) if args.link_timeout > 0 else None
    server = RelayServer(args.bind, security, args.max_message_bytes or relay_limit(plan), heartbeat)
    address = server.start()

    def write_stats() -> None:
        if args.stats:
            tmp = Path(args.stats).with_suffix(".tmp")
            tmp.write_text(json.dumps(server.stats.to_dict()) + "\n")
            tmp.replace(args.stats)

    signal.signal(signal.SIGTERM, lambda *_: server.stop())
    print(f"relay listening on {address} for {len(plan.parts)} CompNodes and the coordinator", file=sys.stderr,
          flush=True)
    try:
        server.serve(on_tick=write_stats)
    except KeyboardInterrupt:
        pass
    finally:
        write_stats()
        server.close()
    st = server.stats
    print(f"relay: forwarded {st.messages} messages, {st.bytes} bytes; dropped {st.dropped}", file=sys.stderr)
    return 0
