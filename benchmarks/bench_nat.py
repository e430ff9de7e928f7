"""CompNodes behind real NAT, through the relay, against the same plan run direct (issue 39).

Network (``benchmarks/netns_nat.py``): a reachable host ``pub`` and two homes ``h1``, ``h2`` behind their own
MASQUERADE routers with stateful firewalls. Plan: the 4-stage tied transformer of the tests (``p0``..``p3``),
1F1B, 2 micro-batches, SGD.

* direct: the coordinator and every executor in ``pub``, each reachable (CURVE on every link).
* nat: the coordinator, the relay, ``p0`` and ``p3`` in ``pub``; ``p1`` in ``h1`` and ``p2`` in ``h2``, started
  with ``--dial-out``: links into a home go through the relay (sealed end to end), links out of one go direct.

The relay of the nat run is the library's :class:`RelayServer` in a process of its own in ``pub`` with one
addition: it inspects every payload it forwards for plaintext markers of the wire format (the msgpack header
bytes every message begins with, and the ``opdata`` kind) and counts any it sees; it also tries to open a sample
with its own key. The final line is JSON: ``nat_run_ok``, ``losses_equal_direct``, ``relayed_bytes``,
``curve_end_to_end``, the median step time of each run and ``relay_added_step_s`` (nat minus direct, the
median over ``--rounds`` pairs run back to back).

Run as root: ``python benchmarks/bench_nat.py [--steps 8]`` (about a minute on 2 shared cores).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from netns_nat import NatHomes, nat_available  # noqa: E402

PLACE = {"direct": {"p0": "pub", "p1": "pub", "p2": "pub", "p3": "pub"},
         "nat": {"p0": "pub", "p1": "h1", "p2": "h2", "p3": "pub"}}
COORD_PORT, RELAY_PORT = 5600, 5700


def make_plan(folder: Path) -> tuple[Path, Path]:
    """The plan and its keys (``fusion keys --relay``)."""
    from tests.executors.dist_models import GPT_SPLITS, tied_transformer
    from fusion.executors.runtime.launcher import hand_plan
    from fusion.plan import OptimizerConfig, save_plan

    model = tied_transformer(mb=2)
    plan = hand_plan(model, GPT_SPLITS[4], schedule="1f1b", micro_batches=2, optimizer=OptimizerConfig("sgd", lr=0.1))
    plan_dir = save_plan(plan, folder / "plan", params=model.params)
    keys = folder / "keys"
    subprocess.run([sys.executable, "-m", "fusion.cli", "keys", str(plan_dir), "--out", str(keys), "--relay"],
                   check=True, timeout=120, capture_output=True)
    return Path(plan_dir), keys


def inspecting_relay(plan_dir: str, bind: str, key: str, stats_path: str) -> int:
    """The relay of the nat run (a process of its own): RelayServer plus the plaintext inspection."""
    import signal

    import msgpack

    from fusion.commands.relay import relay_limit
    from fusion.executors.runtime.keys import security_for
    from fusion.executors.runtime.relay import RELAY, RelayServer, Sealer
    from fusion.ir.errors import WireError
    from fusion.plan import load_plan

    plan = load_plan(plan_dir)
    sec = security_for(key, Path(plan_dir) / "public_keys.json", ["coordinator", *plan.parts, RELAY], RELAY)
    markers = [msgpack.packb("opdata"), msgpack.packb("step")]  # in the header of every OP-Data and step message
    own = Sealer(sec)
    seen = {"inspected": 0, "plaintext_markers": 0, "opened_by_relay": 0}

    class Inspecting(RelayServer):
        def _forward(self, frames):
            if len(frames) == 4:
                payload = bytes(frames[3].buffer)
                seen["inspected"] += 1
                seen["plaintext_markers"] += sum(payload.count(m) for m in markers)
                try:
                    own.open(frames[-1].get("User-Id"), payload, 66)  # the relay's own key: must not open
                    seen["opened_by_relay"] += 1
                except WireError:
                    pass
            super()._forward(frames)

    server = Inspecting(bind, sec, relay_limit(plan))
    server.start()
    signal.signal(signal.SIGTERM, lambda *_: server.stop())

    def write():
        Path(stats_path).write_text(json.dumps({**server.stats.to_dict(), **seen}))

    try:
        server.serve(on_tick=write)
    finally:
        write()
        server.close()
    return 0


def run_once(net: NatHomes, plan_dir: Path, keys: Path, out: Path, mode: str, steps: int, round_: int = 0) -> dict:
    pub = net.ip["pub"]
    coord = f"tcp://{pub}:{COORD_PORT}"
    relay = f"tcp://{pub}:{RELAY_PORT}"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "FUSION_CACHE": "off", "PYTHONPATH": str(ROOT)}
    log = open(out / f"{mode}{round_}.log", "wb")
    procs: dict[str, subprocess.Popen] = {}

    def start(name, host, argv):
        procs[name] = subprocess.Popen(net.cmd(host, [sys.executable, *argv]), stdout=log, stderr=subprocess.STDOUT,
                                       env=env, cwd=str(ROOT))

    run_dir = out / f"run-{mode}{round_}"  # a fresh folder per run (a coordinator refuses to reuse one)
    stats = out / f"relay{round_}.json"
    t0 = time.monotonic()
    try:
        if mode == "nat":
            start("relay", "pub", [__file__, "--inspecting-relay", str(plan_dir), f"tcp://{pub}:{RELAY_PORT}",
                                   str(keys / "relay.secret"), str(stats)])
        start("coordinator", "pub", ["-m", "fusion.cli", "coordinator", str(plan_dir), "--bind", coord, "--steps",
                                     str(steps), "--out", str(run_dir), "--data", "synthetic", "--no-progress",
                                     "--key", str(keys / "coordinator.secret")])
        for part, host in PLACE[mode].items():
            argv = ["-m", "fusion.cli", "executor", str(plan_dir), "--node", part, "--coordinator", coord,
                    "--key", str(keys / f"{part}.secret"), "--fast-exit"]
            argv += (["--dial-out", relay] if host != "pub" else ["--bind", f"tcp://{net.ip[host]}:*"])
            start(part, host, argv)
        deadline = time.monotonic() + 300
        for name, p in procs.items():
            if name != "relay":
                p.wait(max(1.0, deadline - time.monotonic()))
    finally:
        if "relay" in procs:
            procs["relay"].terminate()
        for p in procs.values():
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(10)
        log.close()
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()] \
        if (run_dir / "metrics.jsonl").exists() else []
    lines = [x for x in lines if "loss" in x]
    return {"rc": {n: p.returncode for n, p in procs.items() if n != "relay"},
            "losses": [x["loss"] for x in lines],
            "step_s": statistics.median([x["iteration_s"] for x in lines[1:]]) if len(lines) > 1 else None,
            "wall_s": round(time.monotonic() - t0, 2),
            "relay": json.loads(stats.read_text()) if mode == "nat" and stats.exists() else None}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=1, help="direct + nat pairs, order alternating")
    ap.add_argument("--wan-mbit", type=float, default=None, help="shape each home's WAN link (tbf), Mbit/s each way")
    ap.add_argument("--out", default=None, help="folder for plans, logs, runs (default: a temporary one)")
    ap.add_argument("--inspecting-relay", nargs=4, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.inspecting_relay:
        return inspecting_relay(*args.inspecting_relay)
    why = nat_available()
    if why:
        print(json.dumps({"skipped": why}))
        return 0
    import tempfile

    out = Path(args.out or tempfile.mkdtemp(prefix="bench_nat-"))
    out.mkdir(parents=True, exist_ok=True)
    plan_dir, keys = make_plan(out)
    with NatHomes(2, args.wan_mbit) as net:
        rounds = []  # direct and nat back to back, the order alternating (the shared cores' load drifts)
        for r in range(args.rounds):
            pair = {}
            for mode in (("direct", "nat") if r % 2 == 0 else ("nat", "direct")):
                pair[mode] = run_once(net, plan_dir, keys, out, mode, args.steps, r)
            rounds.append(pair)
        direct, nat = rounds[0]["direct"], rounds[0]["nat"]
        masq = [net.masqueraded_packets(i) for i in (1, 2)]
        # nothing opens a connection into a home: pub -> h1 at the port p1's executor would have used
        inbound_blocked = (net.can_connect("h1", "h1") and not net.can_connect("pub", "h1")
                           and not net.can_connect("h2", "h1") and net.can_connect("h1", "pub"))
    relay = nat["relay"] or {}
    added = [p["nat"]["step_s"] - p["direct"]["step_s"] for p in rounds
             if p["nat"]["step_s"] is not None and p["direct"]["step_s"] is not None]
    result = {
        "nat_run_ok": all(all(rc == 0 for rc in p["nat"]["rc"].values()) and len(p["nat"]["losses"]) == args.steps
                          for p in rounds),
        "direct_run_ok": all(all(rc == 0 for rc in p["direct"]["rc"].values())
                             and len(p["direct"]["losses"]) == args.steps for p in rounds),
        "losses_equal_direct": all(bool(p["nat"]["losses"]) and p["nat"]["losses"] == p["direct"]["losses"]
                                   for p in rounds),
        "relayed_bytes": relay.get("bytes", 0),
        "relayed_messages": relay.get("messages", 0),
        "relayed_pairs": relay.get("pairs", {}),
        "curve_end_to_end": bool(relay.get("inspected")) and relay.get("plaintext_markers") == 0
        and relay.get("opened_by_relay") == 0,
        "relay_inspected_payloads": relay.get("inspected", 0),
        "masqueraded_connections": masq,
        "inbound_to_home_blocked": inbound_blocked,
        "direct_step_s": [p["direct"]["step_s"] for p in rounds], "nat_step_s": [p["nat"]["step_s"] for p in rounds],
        "relay_added_step_s": round(statistics.median(added), 6) if added else None,  # median over the rounds
        "relay_added_step_s_rounds": [round(a, 6) for a in added],
        "steps": args.steps, "losses": nat["losses"], "rc": {"direct": direct["rc"], "nat": nat["rc"]},
        "wan_mbit": args.wan_mbit, "out": str(out),
    }
    print(json.dumps(result))
    return 0 if result["nat_run_ok"] and result["losses_equal_direct"] else 1


if __name__ == "__main__":
    sys.exit(main())
