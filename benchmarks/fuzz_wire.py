"""Fuzz the wire: mutated messages decoded directly, then sent over sockets into a live training run.

Starts from valid messages of every kind (dense, sparse and value OP-Data for
a real part's boundary, tied-parameter gradients, every control op) and
mutates them: type confusion (lists, maps, ints, strings, None, bytes, floats
in every field of the header tree), huge and negative ints, deleted and
added keys, dropped, added, truncated, extended and swapped frames, random
and bit-flipped header bytes.

1. **direct**: each mutated message goes through ``decode`` and then the real
   handlers of a set-up CompNode (``CompNode._on_message``: control checks,
   OP-Data checks, the inbox's boundary checks) and of a Coordinator
   (``Coordinator._on_message``). Anything raised that is not a ``WireError``
   is an escape.
2. **over_socket**: a 2-part MLP trains on loopback (one executor process per
   part, the coordinator here) while a thread sends mutated messages to both
   executors and the coordinator, from unknown identities and (one in ten)
   from the identity of a real peer (ZeroMQ drops those while the real peer is
   connected). Then the same number of steps is run undisturbed: every loss
   must be the same bits.

3. **insider**: mutated messages under the run's *own* identities, into live executors of a CURVE run: this
   process holds the run's secret keys and connects to each executor as the coordinator and as the other part
   (a routing id of its own, so the real peer's connection stays), so each message is authenticated and decoded
   inside the executor as that peer's (:func:`run_insider`). Only mutants a stateless receiver refuses are sent
   (a well-formed control message from the coordinator is an order, not an attack), at a rate under the
   transport's cut-off of a misbehaving run peer, after a warm-up that makes the corpus's OP-Data stale; then
   the same steps undisturbed: same bits, every message counted as refused.

Final line: one JSON object, measured (nothing asserted)::

    {"direct": N, "over_socket": N, "insider": N, "insider_decoded_and_refused": N, "non_wire_error_escapes": 0, "executor_crashes": 0, "hangs_over_5s": 0,
     "malformed_accepted_changing_training": 0, "insider_changed_steps": 0, "peak_rss_mb": X, ...}

Run: ``OMP_NUM_THREADS=1 python benchmarks/fuzz_wire.py [--direct 30000] [--socket 1200] [--insider 300] [--seed 0]``
"""
from __future__ import annotations

import argparse
import copy
import json
import logging
import random
import resource
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import Any

import msgpack
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # a source checkout imports as the package

from fusion.ir.errors import WireError  # noqa: E402
from fusion.ir.opdata import OpData  # noqa: E402
from fusion.ir.wire import decode, encode, encode_opdata  # noqa: E402
from fusion.kernels.sparse import SparsePayload  # noqa: E402

# -- mutation -------------------------------------------------------------------------------------------

HOSTILE: list[Any] = [
    [], {}, None, "", "x", "opdata", "ctrl", "float32", "bfloat16", "object", "p0", "p1", "coordinator", "../../etc",
    -1, 0, 1, 2, 7, 2**31, 2**31 - 1, 2**32, 2**62, 2**63 - 1, 2**64 - 1, -(2**63), 1.5, -0.0, 1e308, float("nan"),
    float("inf"), True, False, b"", b"\x00" * 9, [0, 2**63 - 1], [-1], [2**62, 2**62], [1] * 40, [[[[[]]]]],
    {"a": []}, {"type": "sparse"}, {"type": "dense"}, {"type": "value", "value": [1], "tuple": 1},
    {"d": "float32", "s": [1]}, list(range(300)), "k" * 5000, [None], [{}], [[0, 1.0]], [["0", 1.0]],
]


def _paths(obj: Any, path: tuple = ()) -> list[tuple]:
    """Every path into a tree of maps and lists (the root is ``()``)."""
    out = [path]
    if isinstance(obj, dict):
        for k, v in obj.items():
            out += _paths(v, path + (k,))
    elif isinstance(obj, list) and len(obj) <= 64:
        for i, v in enumerate(obj):
            out += _paths(v, path + (i,))
    return out


def _set(obj: Any, path: tuple, value: Any) -> Any:
    if not path:
        return value
    parent = obj
    for p in path[:-1]:
        parent = parent[p]
    parent[path[-1]] = value
    return obj


def _hostile(rng: random.Random) -> Any:
    v = rng.choice(HOSTILE)
    if rng.random() < 0.1:
        v = [v] * rng.randint(1, 4)
    elif rng.random() < 0.1:
        v = {rng.choice(["op", "k", "h", "t", "s", "d", "name", "type", "x"]): v}
    return copy.deepcopy(v)


def _mutate_tree(rng: random.Random, head: Any) -> Any:
    paths = _paths(head)
    path = rng.choice(paths)
    r = rng.random()
    if r < 0.7:
        return _set(head, path, _hostile(rng))
    target = head
    for p in path:
        target = target[p]
    if isinstance(target, dict) and target and r < 0.85:
        del target[rng.choice(list(target))]
    elif isinstance(target, dict):
        target[rng.choice(["op", "names", "payload", "it", "extra", "v", "k", "h", "t"])] = _hostile(rng)
    elif isinstance(target, list) and target:
        if rng.random() < 0.5:
            target.pop(rng.randrange(len(target)))
        else:
            target.append(_hostile(rng))
    else:
        return _set(head, path, _hostile(rng))
    return head


def mutate(rng: random.Random, frames: list[bytes]) -> list[bytes]:
    """One hostile variant of a valid message (a list of byte frames)."""
    frames = list(frames)
    r = rng.random()
    if r < 0.6:  # the header tree, one to three changes
        head = msgpack.unpackb(frames[0], raw=False)
        for _ in range(rng.choice((1, 1, 2, 3))):
            head = _mutate_tree(rng, head)
        try:
            frames[0] = msgpack.packb(head, use_bin_type=True)
        except (TypeError, ValueError, OverflowError):
            frames[0] = msgpack.packb(str(head)[:100], use_bin_type=True)
        if rng.random() < 0.2:
            frames = mutate_frames(rng, frames)
        return frames
    if r < 0.85:
        return mutate_frames(rng, frames)
    if r < 0.92:  # bit flips in the header
        b = bytearray(frames[0])
        for _ in range(rng.randint(1, 4)):
            if b:
                b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
        return [bytes(b), *frames[1:]]
    return [bytes(rng.getrandbits(8) for _ in range(rng.randint(0, 40)))] + (frames[1:] if rng.random() < 0.5 else [])


def mutate_frames(rng: random.Random, frames: list[bytes]) -> list[bytes]:
    op = rng.randrange(7)
    if op == 0 and len(frames) > 1:
        frames.pop(rng.randrange(1, len(frames)))
    elif op == 1:
        frames.append(bytes(rng.choice((0, 1, 4, 7, 64))))
    elif op == 2 and len(frames) > 1:
        i = rng.randrange(1, len(frames))
        frames[i] = frames[i][: rng.randrange(len(frames[i]) + 1)]
    elif op == 3 and len(frames) > 1:
        i = rng.randrange(1, len(frames))
        frames[i] = frames[i] + bytes(rng.choice((1, 3, 4, 8)))
    elif op == 4 and len(frames) > 2:
        i, j = rng.sample(range(1, len(frames)), 2)
        frames[i], frames[j] = frames[j], frames[i]
    elif op == 5:
        frames = [] if rng.random() < 0.3 else frames[:1]
    else:
        frames.insert(0, frames[0])
    return frames


def _bytes_frames(frames: list) -> list[bytes]:
    return [f if isinstance(f, bytes) else np.ascontiguousarray(f).tobytes() for f in frames]


def corpus(graph, me: str, routes, n_micro: int) -> list[tuple[str, list[bytes]]]:
    """(sender, frames) of valid messages for part ``me``: its real activations and gradients, and every control op."""
    from fusion.executors.runtime.control import Abort, Done, Error, Fetch, Hb, Hello, Ready, Setup, State, Step, Stop

    out: list[tuple[str, list[bytes]]] = []
    for key, src in routes.recv_from.items():
        m = graph.output_meta(*key)
        x = np.zeros(m.shape, np.float32)
        od = OpData(key[0], key[1], (), (), False, 0, 0, src, me, x, requires_grad=True)
        out.append((src, encode_opdata(od)))
        flat = x.reshape(-1)
        sp = SparsePayload(flat[:3].copy(), np.arange(3, dtype=np.int32), tuple(m.shape), "float32")
        out.append((src, encode_opdata(OpData(key[0], key[1], (), (), False, 0, 1 % n_micro, src, me, sp,
                                              compress_cfg={"algo": "topk", "ratio": 4}))))
    for key, srcs in routes.grads_from.items():
        m = graph.output_meta(*key)
        for src in srcs:
            out.append((src, encode_opdata(OpData(key[0], key[1], (), (), True, 0, 0, src, me, np.zeros(m.shape, np.float32)))))
    out.append(("p0", encode_opdata(OpData("w", None, (), (), True, 0, -1, "p0", me, (1, 2.5)), kind="pgrad")))
    c = "coordinator"
    out += [
        (c, Step(arrays={"0/x": np.zeros((2, 8), np.float32), "0/y": np.zeros(2, np.int64)}, it=0, want_grads=True,
                 checkpoint=False).frames()),
        (c, Setup(peers={"p0": "tcp://127.0.0.1:9"}, emulate_links=False, resume_step=None, checkpoint_dir=None,
                  digest="").frames()),
        (c, Fetch().frames()), (c, Stop().frames()), (c, Abort(reason="x").frames()), (c, Hb().frames()),
        ("p0", Hello(part="p0", address="tcp://127.0.0.1:9", pid=1, engine="torch", digest="").frames()),
        ("p0", Ready(part="p0").frames()),
        ("p0", Done(arrays={"w": np.zeros(3, np.float32)}, it=0, losses=[[0, 1.5]], stats={"rejected": 0}).frames()),
        ("p0", State(arrays={"w": np.zeros(3, np.float32)}).frames()), ("p0", Error(reason="x").frames()),
    ]
    return [(s, _bytes_frames(f)) for s, f in out]


# -- the model --------------------------------------------------------------------------------------------

def mlp_plan(folder: Path) -> Path:
    """A 2-part MLP (p0: two linears, p1: linear + loss), 2 micro-batches, SGD: a plan folder."""
    import torch

    from fusion.executors.runtime.launcher import hand_plan
    from fusion.ir.builder import GraphBuilder
    from fusion.plan import OptimizerConfig, save_plan

    b = GraphBuilder()
    x, y = b.input("x"), b.label("y")
    h = b.module("fc1", "torch.nn.Linear", x, in_features=8, out_features=16)
    h = b.function("act1", "torch.tanh", h)
    h = b.module("fc2", "torch.nn.Linear", h, in_features=16, out_features=16)
    o = b.module("fc3", "torch.nn.Linear", h, in_features=16, out_features=4)
    b.loss("loss", "torch.nn.functional.cross_entropy", o, y)
    model = b.build(example={"x": torch.randn(2, 8), "y": torch.randint(0, 4, (2,))}, seed=0)
    assign = {"x": "p0", "fc1": "p0", "act1": "p0", "fc2": "p0", "y": "p1", "fc3": "p1", "loss": "p1"}
    plan = hand_plan(model, assign, micro_batches=2, optimizer=OptimizerConfig("sgd", lr=0.1))
    return save_plan(plan, folder, params=model.params)


def batch(step: int) -> dict[str, np.ndarray]:
    g = np.random.default_rng([3, step])
    return {"x": g.standard_normal((4, 8)).astype(np.float32), "y": g.integers(0, 4, 4).astype(np.int64)}


# -- 1. direct --------------------------------------------------------------------------------------------

def run_direct(n: int, seed: int, plan_dir: Path) -> dict:
    from fusion.executors.runtime.compnode import CompNode, ExecutorConfig
    from fusion.executors.runtime.control import Setup
    from fusion.executors.runtime.coordinator import Coordinator, CoordinatorConfig
    from fusion.plan import load_plan

    plan = load_plan(plan_dir)
    node = CompNode(plan, plan_dir, ExecutorConfig("p1", "tcp://127.0.0.1:9"))
    node._setup(Setup(peers={"p0": "tcp://127.0.0.1:9"}, emulate_links=False, resume_step=None,
                      checkpoint_dir=None))
    coord = Coordinator(plan, CoordinatorConfig())
    seeds = corpus(plan.graph, "p1", node.inbox.routes, plan.micro_batches)
    rng = random.Random(seed)
    stats = {"direct": 0, "rejected": 0, "accepted": 0, "escapes": 0}
    examples: list[str] = []
    t0 = time.perf_counter()
    try:
        for i in range(n):
            sender, frames = rng.choice(seeds)
            frames = mutate(rng, frames)
            stats["direct"] += 1
            try:
                msg = decode(frames)
                if msg.kind == "ctrl":
                    try:
                        coord._on_message("p0", msg)
                    except WireError:
                        pass
                node._on_message(sender, msg)
                stats["accepted"] += 1
            except WireError:
                stats["rejected"] += 1
            except Exception as e:  # noqa: BLE001 - what we are counting
                stats["escapes"] += 1
                if len(examples) < 5:
                    examples.append(f"{type(e).__name__}: {e} <- {frames[:1]!r}"[:400] + "\n" + traceback.format_exc(limit=3)[-600:])
            if i % 256 == 0:  # keep the accepted ones from piling up
                node._ctrl.clear()
                node.inbox._data.clear()
                node.inbox._pgrads.clear()
                for box in coord._inbox.values():
                    box.clear()
    finally:
        node.transport.close(timeout_s=1, linger_s=0)
        coord.transport.close(timeout_s=1, linger_s=0)
    stats["direct_s"] = round(time.perf_counter() - t0, 2)
    stats["examples"] = examples
    return stats


# -- 2. over sockets, during training -----------------------------------------------------------------------

def _vm_hwm_mb(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


def timed_step(lc, losses: list, step_times: list, res: dict):
    """One training step of the live run (its loss and seconds appended); None when a CompNode failed (counted in
    ``res`` with the failure's line)."""
    from fusion.executors.runtime.coordinator import CompNodeFailure

    t0 = time.monotonic()
    try:
        r = lc.coordinator.step(batch(len(losses)))
    except CompNodeFailure as e:
        res["executor_crashes"] += 1
        res["failure"] = str(e)
        return None
    step_times.append(time.monotonic() - t0)
    losses.append(r.loss)
    return r


def run_over_socket(n: int, seed: int, plan_dir: Path, run_root: Path, min_steps: int = 10) -> dict:
    import zmq

    from fusion.executors.runtime.coordinator import CoordinatorConfig
    from fusion.executors.runtime.launcher import LocalCluster
    from fusion.plan import load_plan

    plan = load_plan(plan_dir)
    # valid seeds for both parts (p0 takes p1's gradients, p1 takes p0's activations) and the coordinator
    from fusion.executors.runtime.part import make_routes
    from fusion.ir.boundary import partition

    subs = partition(plan.graph, plan.assignment)
    seeds = {p: corpus(plan.graph, p, make_routes(subs[p], plan.assignment), plan.micro_batches) for p in plan.parts}
    rng = random.Random(seed)
    res = {"over_socket": 0, "squat_attempts": 0, "executor_crashes": 0, "hangs_over_5s": 0, "steps": 0}
    sent_unknown = {"p0": 0, "p1": 0, "coordinator": 0}
    losses: list[float] = []
    cfg = CoordinatorConfig(peer_timeout_s=20)
    ctx = zmq.Context()
    lc = LocalCluster(plan_dir, run_root / "fuzzed", cfg, threads=1, trace=False)
    try:
        lc.start()
        targets = {"p0": lc.coordinator.addresses["p0"], "p1": lc.coordinator.addresses["p1"], "coordinator": lc.coordinator.address}
        done = threading.Event()

        def fuzz():
            socks = {}
            for i in range(n):
                t = ("p0", "p1", "coordinator")[i % 3]
                squat = rng.random() < 0.1
                ident = (("p0" if t != "p0" else "coordinator") if t != "coordinator" else "p1") if squat else f"mallory-{i % 7}"
                s = socks.get((t, ident))
                if s is None:
                    s = socks[(t, ident)] = ctx.socket(zmq.DEALER)
                    s.setsockopt(zmq.IDENTITY, ident.encode())
                    s.setsockopt(zmq.LINGER, 1000)
                    s.connect(targets[t])
                frames = mutate(rng, rng.choice(seeds["p0" if t == "coordinator" else t])[1])
                if not frames:
                    frames = [b""]  # ZeroMQ cannot send zero frames; the routing frame plus an empty one is the least
                s.send_multipart(frames)
                res["over_socket"] += 1
                if squat:
                    res["squat_attempts"] += 1
                else:
                    sent_unknown[t] += 1
                if i % 4 == 0:
                    time.sleep(0.002)  # spread the messages over the steps
            for s in socks.values():
                s.close()
            done.set()

        th = threading.Thread(target=fuzz, daemon=True)
        th.start()
        step_times = []
        rejected: dict = {}
        escaped = 0
        while not done.is_set() or len(losses) < min_steps:
            r = timed_step(lc, losses, step_times, res)
            if r is None:
                break
            rejected = {p: r.parts[p]["rejected"] for p in plan.parts}
            escaped = sum(r.parts[p].get("escaped", 0) for p in plan.parts)
        th.join()
        # every message from an unknown identity must be seen (and rejected) within 5 s of the last send
        deadline = time.monotonic() + 5
        while "failure" not in res and time.monotonic() < deadline:
            r = lc.coordinator.step(batch(len(losses)))
            losses.append(r.loss)
            step_times.append(0.0)
            rejected = {p: r.parts[p]["rejected"] for p in plan.parts}
            escaped = sum(r.parts[p].get("escaped", 0) for p in plan.parts)
            if all(rejected[p] >= sent_unknown[p] for p in plan.parts) and \
                    lc.coordinator.transport.rejected >= sent_unknown["coordinator"]:
                break
        else:
            res["hangs_over_5s"] += 0 if "failure" in res else 1
        rejected["coordinator"] = lc.coordinator.transport.rejected
        res["hangs_over_5s"] += sum(1 for s in step_times if s > 5.0)
        res["rejected"] = rejected
        res["sent_from_unknown_identities"] = dict(sent_unknown)
        res["escaped"] = escaped + lc.coordinator.transport.escaped
        res["executor_peak_rss_mb"] = round(max(_vm_hwm_mb(p.pid) for p in lc.processes.values()), 1)
        res["executor_crashes"] += sum(1 for p in lc.processes.values() if p.poll() is not None)
    finally:
        lc.close(graceful=True)
        ctx.term()
    res["steps"] = len(losses)
    # the same steps, undisturbed
    with LocalCluster(plan_dir, run_root / "clean", cfg, threads=1, trace=False) as clean:
        clean.start()
        ref = [clean.coordinator.step(batch(i)).loss for i in range(len(losses))]
    res["malformed_accepted_changing_training"] = sum(1 for a, b in zip(losses, ref) if a != b)
    res["changed_steps"] = [(i, a, b) for i, (a, b) in enumerate(zip(losses, ref)) if a != b][:10]
    return res


# -- 3. from the run's own identities, into live executors ------------------------------------------------

#: messages per second from one insider identity to one executor: under the transport's cut-off of a run peer
#: (``REJECT_LIMIT`` refusals in ``REJECT_WINDOW_S``), which would end the run naming it (a misbehaving peer)
INSIDER_RATE = 6.0
#: steps trained before the first insider message: the corpus's iteration-0 messages are then stale, so no mutant
#: can be an input the executor waits for (one it refuses would stop the part, naming it: receiving.py)
INSIDER_WARMUP = 12


def _malformed(frames: list[bytes], to_executor: bool) -> bool:
    """Whether a stateless receiver refuses ``frames`` (decode, OP-Data fields, control op): only those are sent
    under a run identity, since a well-formed control message from the coordinator (a Stop, an Abort) is an order."""
    from fusion.executors.runtime.control import TO_EXECUTOR, decode_ctrl
    from fusion.ir.wire import opbatch_from_message, opdata_from_message

    try:
        msg = decode(frames)
        if msg.kind == "ctrl":
            decode_ctrl(msg, TO_EXECUTOR) if to_executor else None
        elif msg.kind == "opbatch":
            opbatch_from_message(msg)
        elif msg.kind in ("opdata", "pgrad"):
            opdata_from_message(msg)
        return False
    except WireError:
        return True
    except Exception:  # noqa: BLE001 - a decoder bug: send it, the live executor must survive it too
        return True


def run_insider(n: int, seed: int, plan_dir: Path, run_root: Path) -> dict:
    """Mutated messages from the run's own identities into its live executors, over CURVE.

    A CURVE run of the 2-part MLP; this process holds the run's secret keys (``RUN/keys``) and opens, for each
    executor, one connection under each other identity of the run (the coordinator and the other part) with a
    routing id of its own, so ZeroMQ keeps the real peer's connection and the executor decodes each message as
    coming from that authenticated identity (the key decides the sender, ``Transport._sender``). Each message is a
    mutant of a valid message that identity could send (its OP-Data for the part, stale after the warm-up; the
    coordinator's control messages), kept only when a stateless receiver refuses it (:func:`_malformed`). Steps run
    while they are sent; then the same steps run undisturbed: every loss must be the same bits, every message must
    be counted as refused by its executor, nothing may escape as another exception."""
    import zmq

    from fusion.executors.runtime.coordinator import CoordinatorConfig
    from fusion.executors.runtime.keys import curve_client, security_for
    from fusion.executors.runtime.launcher import LocalCluster
    from fusion.executors.runtime.part import make_routes
    from fusion.ir.boundary import partition
    from fusion.plan import load_plan

    plan = load_plan(plan_dir)
    subs = partition(plan.graph, plan.assignment)
    seeds = {p: corpus(plan.graph, p, make_routes(subs[p], plan.assignment), plan.micro_batches) for p in plan.parts}
    names = ["coordinator", *plan.parts]
    rng = random.Random(seed)
    res = {"insider_sent": 0, "insider_well_formed_skipped": 0, "executor_crashes": 0, "hangs_over_5s": 0}
    sent: dict[str, int] = {p: 0 for p in plan.parts}
    losses: list[float] = []
    cfg = CoordinatorConfig(peer_timeout_s=20)
    ctx = zmq.Context()
    lc = LocalCluster(plan_dir, run_root / "insider", cfg, threads=1, trace=False, curve=True)
    socks: dict[tuple[str, str], Any] = {}
    try:
        lc.start()
        keys = run_root / "insider" / "keys"
        while len(losses) < INSIDER_WARMUP:
            losses.append(lc.coordinator.step(batch(len(losses))).loss)
        for target in plan.parts:
            for ident in names:
                if ident == target:
                    continue
                s = ctx.socket(zmq.DEALER)
                curve_client(s, security_for(keys / f"{ident}.secret", keys / "public_keys.json", names, ident), target)
                s.setsockopt(zmq.IDENTITY, f"insider-{ident}".encode())
                s.setsockopt(zmq.LINGER, 1000)
                s.connect(lc.coordinator.addresses[target])
                socks[(target, ident)] = s
        pairs = sorted(socks)
        # every mutant first: a well-formed one is skipped, so what goes out is n malformed ones
        queue: list[tuple[str, str, list[bytes]]] = []
        tries = 0
        while len(queue) < n and tries < 50 * n:
            tries += 1
            target, ident = pairs[len(queue) % len(pairs)]
            own = [f for who, f in seeds[target] if who == ident] or [f for who, f in seeds[target]]
            frames = mutate(rng, rng.choice(own)) or [b""]
            if _malformed(frames, ident == "coordinator"):
                queue.append((target, ident, frames))
            else:
                res["insider_well_formed_skipped"] += 1
        interval = 1.0 / (INSIDER_RATE * len(pairs))
        step_times: list[float] = []
        next_send = time.monotonic()
        i = 0
        while i < len(queue):
            while i < len(queue) and time.monotonic() >= next_send:
                target, ident, frames = queue[i]
                socks[(target, ident)].send_multipart(frames)
                sent[target] += 1
                i += 1
                next_send += interval
            if timed_step(lc, losses, step_times, res) is None:
                break
        res["insider_sent"] = i
        # every message must be counted as refused within 5 s of the last send
        base = {p: 0 for p in plan.parts}
        deadline = time.monotonic() + 5
        rejected = dict(base)
        escaped = 0
        while "failure" not in res:
            r = lc.coordinator.step(batch(len(losses)))
            losses.append(r.loss)
            rejected = {p: r.parts[p]["rejected"] for p in plan.parts}
            escaped = sum(r.parts[p].get("escaped", 0) for p in plan.parts)
            if all(rejected[p] >= sent[p] for p in plan.parts):
                break
            if time.monotonic() > deadline:
                res["hangs_over_5s"] += 1
                break
        res["hangs_over_5s"] += sum(1 for s in step_times if s > 5.0)
        res["insider_rejected"] = rejected
        res["insider_sent_per_part"] = dict(sent)
        res["insider_escaped"] = escaped
        res["executor_crashes"] += sum(1 for p in lc.processes.values() if p.poll() is not None)
    finally:
        for s in socks.values():
            s.close(linger=0)
        lc.close(graceful=True)
        ctx.term()
    res["insider_steps"] = len(losses)
    with LocalCluster(plan_dir, run_root / "insider-clean", cfg, threads=1, trace=False, curve=True) as clean:
        clean.start()
        ref = [clean.coordinator.step(batch(i)).loss for i in range(len(losses))]
    res["insider_changed_steps"] = sum(1 for a, b in zip(losses, ref) if a != b)
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--direct", type=int, default=30_000)
    ap.add_argument("--socket", type=int, default=1200)
    ap.add_argument("--insider", type=int, default=300, help="mutants sent under the run's own identities (CURVE)")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.CRITICAL)  # tens of thousands of rejects: count them, do not print them
    with tempfile.TemporaryDirectory() as tmp:
        plan_dir = mlp_plan(Path(tmp) / "plan")
        d = run_direct(a.direct, a.seed, plan_dir)
        print(f"direct: {d['direct']} messages in {d['direct_s']} s: {d['rejected']} rejected, {d['accepted']} accepted, "
              f"{d['escapes']} escapes", flush=True)
        for ex in d["examples"]:
            print("  escape:", ex)
        s = run_over_socket(a.socket, a.seed + 1, plan_dir, Path(tmp))
        print(f"over sockets: {s['over_socket']} messages ({s['squat_attempts']} under a real peer's identity) during "
              f"{s['steps']} steps; rejected {s.get('rejected')}, sent from unknown identities {s.get('sent_from_unknown_identities')}",
              flush=True)
        if s["changed_steps"]:
            print("  changed steps (step, fuzzed loss, clean loss):", s["changed_steps"])
        if "failure" in s:
            print("  failure:", s["failure"])
        ins = run_insider(a.insider, a.seed + 2, plan_dir, Path(tmp))
        print(f"insider: {ins['insider_sent']} malformed messages under the run's own keys during {ins['insider_steps']} "
              f"steps (sent per part {ins.get('insider_sent_per_part')}, refused {ins.get('insider_rejected')}; "
              f"{ins['insider_well_formed_skipped']} well-formed mutants not sent)", flush=True)
        if "failure" in ins:
            print("  failure:", ins["failure"])
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({
        "direct": d["direct"], "over_socket": s["over_socket"],
        "insider": ins["insider_sent"],
        "insider_decoded_and_refused": sum((ins.get("insider_rejected") or {}).values()),
        "non_wire_error_escapes": d["escapes"] + s.get("escaped", 0) + ins.get("insider_escaped", 0),
        "executor_crashes": s["executor_crashes"] + ins["executor_crashes"],
        "hangs_over_5s": s["hangs_over_5s"] + ins["hangs_over_5s"],
        "malformed_accepted_changing_training": s["malformed_accepted_changing_training"],
        "insider_changed_steps": ins["insider_changed_steps"],
        "peak_rss_mb": round(peak, 1), "executor_peak_rss_mb": s.get("executor_peak_rss_mb"),
        "direct_accepted": d["accepted"], "steps": s["steps"],
    }))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
