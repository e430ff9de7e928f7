"""Payload bytes of every built-in codec on every path, pinned to what the code produced before the codec
refactor (issue 24): ``codec_golden.json`` beside this file holds the SHA-256 of each payload's wire frames, and
``codec_golden_inputs.npz`` the fixed inputs they were computed from.

Golden bytes are codec(input) -> bytes of *stored* inputs, never of a forward or backward computed at test time:
torch picks kernels by the CPU's vector width (AVX2, AVX-512, ``ATEN_CPU_CAPABILITY=default``), so activations
and gradients differ in their last bits between machines, and bytes recorded from them pinned one CPU, not the
codec (issue 38). The inputs are the registry cases' seeded tensors, the tied-gradient and all-reduce chunk
inputs, and every encoder call of short training runs of a four-part branching model and a bfloat16 model
(recorded once, in the torch-host mode).

Paths: the registry's codec objects (``fusion.kernels.codec.CODECS``); the CompNodes' tables (built by the
in-process reference executor) on NumPy parts (the host NumPy table), torch parts with ``encode="host"``
(NumPy copies), ``encode="torch"`` (the torch codecs on CPU tensors: the CUDA code path) and
``encode="device"`` (a CPU part's default), fed the recorded encoder calls in their order (error feedback's
residuals, delta's per-sample state on both ends and the stochastic-rounding counters advance as in a run) and
each message decoded by the receiving table; a bfloat16 model; the tied-parameter gradient codec; the
data-parallel all-reduce chunk codec. ``test_replay_sends_what_a_live_run_sends`` checks that replaying a live
run's encoder inputs gives the bytes that run sent, on whatever CPU runs it.

Regenerate the bytes (only when payload bytes are meant to change, and say so in the commit):
``python -m tests.kernels.test_codec_golden``; ``--record-inputs`` records the inputs anew too (only when the
cases change).
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.executors.shared_setup import half_mlp
from fusion.executors.reference import ReferenceExecutor
from fusion.ir import wire
from fusion.ir.builder import GraphBuilder
from fusion.ir.opdata import SAMPLE_IDS, OpData
from fusion.kernels.codecs.base import as_torch, dtype_of, to_numpy
from fusion.plan import EdgeCompression, OptimizerConfig

GOLDEN = Path(__file__).with_name("codec_golden.json")
INPUTS = Path(__file__).with_name("codec_golden_inputs.npz")

TOPK = {"algo": "topk", "ratio": 10.0}
Q8 = {"algo": "quant", "bits": 8, "block": 64}
Q8S = {"algo": "quant", "bits": 8, "block": 32, "rounding": "stochastic"}
Q4 = {"algo": "quant", "bits": 4, "block": 32}
Q4S = {"algo": "quant", "bits": 4, "block": 16, "rounding": "stochastic", "seed": 3}
Q2 = {"algo": "quant", "bits": 2, "block": 16}
Q2S = {"algo": "quant", "bits": 2, "block": 16, "rounding": "stochastic"}
HQ = {"algo": "hadamard-quant", "bits": 4, "block": 16}
HQS = {"algo": "hadamard-quant", "bits": 8, "block": 32, "rounding": "stochastic"}
DELTA = {"algo": "delta", "bits": 4, "block": 32}
DELTA_S = {"algo": "delta", "bits": 2, "block": 16, "rounding": "stochastic", "first_visit": "dense"}


def _raw(frame) -> bytes:
    return frame if isinstance(frame, bytes) else np.ascontiguousarray(frame).tobytes() \
        if isinstance(frame, np.ndarray) else bytes(memoryview(frame))


def _digest(payload, cfg=None, kind="opdata") -> str:
    od = OpData("x", 0, ("y",), ("y",), False, 0, 0, src="a", dst="b", payload=payload, compress_cfg=cfg)
    h = hashlib.sha256()
    for f in wire.encode_opdata(od, kind):
        h.update(_raw(f))
    return h.hexdigest()


def _tensor(seed: int, dtype=torch.float32, shape=(4, 3, 40)) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g, dtype=torch.float64) * (1 + seed)
    x.view(-1)[:5] = 0.0  # ties at zero
    return x.to(dtype)


def _bits(t: torch.Tensor) -> np.ndarray:
    """A tensor as the runtime holds it: NumPy, bfloat16 as uint16 bits."""
    return t.view(torch.int16).numpy().view(np.uint16) if t.dtype == torch.bfloat16 else t.numpy()


# -- the registry's codec objects ------------------------------------------------------------------

REGISTRY_CASES = {
    "topk-ratio": (TOPK, torch.float32), "topk-k": ({"algo": "topk", "k": 17}, torch.float32),
    "topk-value-f16": ({**TOPK, "value_dtype": "float16"}, torch.float32),
    "topk-bf16": (TOPK, torch.bfloat16), "topk-f64": (TOPK, torch.float64),
    "quant8": (Q8, torch.float32), "quant8-stochastic": (Q8S, torch.float32), "quant4": (Q4, torch.float16),
    "quant4-stochastic": (Q4S, torch.float32), "quant2": (Q2, torch.bfloat16), "quant2-stochastic": (Q2S, torch.float32),
    "hadamard-quant": (HQ, torch.float32), "hadamard-quant-stochastic": (HQS, torch.bfloat16),
}


def registry_inputs() -> dict[str, np.ndarray]:
    """The registry cases' inputs as recorded (bfloat16 as uint16 bits)."""
    return {name: to_numpy(_tensor(len(name), dtype)).copy() for name, (_, dtype) in REGISTRY_CASES.items()}


def registry_digests(inputs: dict[str, np.ndarray]) -> dict[str, str]:
    from fusion.kernels.codec import CODECS

    out = {}
    for name, (cfg, dtype) in REGISTRY_CASES.items():
        codec = CODECS.get(cfg["algo"])
        bits = inputs[name]
        x = as_torch(bits.copy(), "bfloat16" if dtype == torch.bfloat16 else bits.dtype.name)
        out[f"{name}/torch"] = _digest(codec.encode(x, cfg))
        if cfg["algo"] != "topk":  # the quantisers also take NumPy arrays (the torch-free path)
            out[f"{name}/numpy"] = _digest(codec.encode(bits.copy(), cfg) if dtype != torch.bfloat16 else
                                           codec.encode(x, cfg))
    return out


# -- the CompNodes' tables, through the reference executor -----------------------------------------

def branching_mlp():
    """The branching CNN of ``tests.executors.dist_models`` with linear layers (the NumPy engine has no
    convolution): conv1 on p0 feeds p1 and p2, whose relu_a and tanh_b meet with it on p3."""
    b = GraphBuilder()
    x, y = b.input("x"), b.label("y")
    h = b.module("conv1", "torch.nn.Linear", x, in_features=12, out_features=40)
    a = b.function("relu_a", "torch.relu", b.module("conv_a", "torch.nn.Linear", h, in_features=40, out_features=40))
    c = b.function("tanh_b", "torch.tanh", b.module("conv_b", "torch.nn.Linear", h, in_features=40, out_features=40))
    s = b.function("add_skip", "operator.add", b.function("add_ab", "operator.add", a, c), h)
    o = b.module("fc", "torch.nn.Linear", s, in_features=40, out_features=5)
    b.loss("loss", "torch.nn.functional.cross_entropy", o, y)
    return b.build(example={"x": torch.randn(2, 12), "y": torch.randint(0, 5, (2,))}, seed=0)


SPLIT = {"x": "p0", "conv1": "p0", "conv_a": "p1", "relu_a": "p1", "conv_b": "p2", "tanh_b": "p2",
         "y": "p3", "add_ab": "p3", "add_skip": "p3", "fc": "p3", "loss": "p3"}


def mlp_batch(step: int, rows: int = 4) -> dict[str, np.ndarray]:
    g = np.random.default_rng([7, step])
    return {"x": g.standard_normal((rows, 12)).astype(np.float32), "y": g.integers(0, 5, rows).astype(np.int64),
            SAMPLE_IDS: np.arange(rows, dtype=np.int64) + rows * step}


#: edges of the four-part branching model: conv1 p0->p1 and p0->p2, relu_a p1->p3, tanh_b p2->p3
EDGE_SETS = {
    "ef-quant-delta": [
        EdgeCompression("conv1", None, "p0", "p2", error_feedback=True, ratio=20.0, directions=("fwd", "bwd")),
        EdgeCompression("relu_a", None, "p1", "p3", fwd_codec=Q4, bwd_codec=TOPK),
        EdgeCompression("conv1", None, "p0", "p1", fwd_codec=DELTA, bwd_codec=HQ),
        EdgeCompression("tanh_b", None, "p2", "p3", fwd_codec=Q2S, bwd_codec=Q8S)],
    "plain-stochastic": [
        EdgeCompression("conv1", None, "p0", "p2", fwd_codec=TOPK, bwd_codec=Q4S),
        EdgeCompression("relu_a", None, "p1", "p3", fwd_codec=HQS, bwd_codec=Q2),
        EdgeCompression("conv1", None, "p0", "p1", fwd_codec=DELTA_S, bwd_codec=Q8),
        EdgeCompression("tanh_b", None, "p2", "p3", ratio=5.0, directions=("fwd",))],
}
#: name -> (engines, engine_options) of the reference executor
MODES = {
    "numpy-parts": ({p: "numpy" for p in ("p0", "p1", "p2", "p3")}, None),
    "torch-host": (None, {"*": {"encode": "host"}}),
    "torch-on-cpu": (None, {"*": {"encode": "torch"}}),
    "torch-device": (None, {"*": {"encode": "device"}}),
}
STEPS = 4  # batches 0, 1, 0, 1: steps 2 and 3 revisit the samples of 0 and 1 (delta's steady state)


def _message_name(it: int, mb: int, is_grad: bool, key, src: str, dst: str) -> str:
    return f"{it}/{mb}/{'B' if is_grad else 'F'}/{key[0]}/{src}->{dst}"


def _array_digest(a) -> str:
    return hashlib.sha256(np.ascontiguousarray(to_numpy(a)).tobytes()).hexdigest()


class _Recorder:
    """Wraps every part table's ``encode`` of a reference executor: each call's input (a NumPy copy; bfloat16 as
    its uint16 bits), key, peer, direction, micro-batch, sample ids and iteration, in call order, and what it
    returned. ``step`` is set by the training loop (a gradient's ``encode`` is not told its iteration)."""

    def __init__(self, ex):
        self.calls: list[dict] = []
        self.step = 0
        for name, part in ex.parts.items():
            table = part.compression
            if table is None:
                continue

            def encode(payload, key, peer, is_grad, mb, ids=None, it=None, _t=table, _f=table.encode, _p=name):
                out = _f(payload, key, peer, is_grad, mb, ids=ids, it=it)
                self.calls.append({"part": _p, "key": [key[0], key[1]], "peer": peer, "is_grad": bool(is_grad),
                                   "mb": int(mb), "it": it, "step": self.step,
                                   "dtype": dtype_of(payload, key in _t.bfloat16),
                                   "x": to_numpy(payload).copy(), "ids": None if ids is None else to_numpy(ids).copy(),
                                   "sent": out})
                return out

            table.encode = encode


def replay(ex, calls: list[dict]) -> dict[str, str]:
    """What the part tables of ``ex`` (one mode's CompNode tables, built by the reference executor and never
    trained) send for the recorded encoder inputs ``calls``, fed in their order: the SHA-256 of each compressed
    message's wire frames, and of what the receiving part's table decodes from it (``.../decoded``; delta's
    receiving state and error feedback's residuals advance as in a run). A payload is handed over as a tensor
    where the engine would hand one (a table on a device, for the keys it asks the engine to keep as tensors),
    else as a NumPy array."""
    out = {}
    for c in calls:
        key = (c["key"][0], c["key"][1])
        table, peer = ex.parts[c["part"]].compression, c["peer"]
        x = c["x"]
        if table.device is not None and key in (table.grad_keys() if c["is_grad"] else table.sent_keys()):
            x = as_torch(x.copy(), c["dtype"]).to(table.device)
        payload, cfg = table.encode(x, key, peer, c["is_grad"], c["mb"], ids=c["ids"], it=c["it"])
        if cfg is None:
            continue
        name = _message_name(c["step"], c["mb"], c["is_grad"], key, c["part"], peer)
        od = OpData(name=key[0], index=key[1], op_users=(), actual_user=(), is_grad=c["is_grad"],
                    local_iter=c["step"], micro_batch=c["mb"], src=c["part"], dst=peer, payload=payload,
                    compress_cfg=cfg)
        h = hashlib.sha256()
        for f in wire.encode_opdata(od):
            h.update(_raw(f))
        out[name] = h.hexdigest()
        receiver = ex.parts[peer]
        got = receiver.compression.decode_grad(od) if c["is_grad"] else \
            receiver.compression.decode(od, receiver._shape(key))
        out[f"{name}/decoded"] = _array_digest(got)
    return out


def table_executor(edge_set: str, mode: str) -> ReferenceExecutor:
    engines, options = MODES[mode]
    return ReferenceExecutor(branching_mlp(), SPLIT, OptimizerConfig("adamw", lr=0.01), micro_batches=2,
                             engines=engines, compression=EDGE_SETS[edge_set], engine_options=options)


def record_tables(edge_set: str, mode: str = "torch-host") -> list[dict]:
    """Train the four-part model ``STEPS`` steps in ``mode`` and record every encoder call (the golden inputs are
    recorded once, on one machine, in the torch-host mode; the backward that produced them is then never run
    again by the golden tests)."""
    ex = table_executor(edge_set, mode)
    rec = _Recorder(ex)
    for s in range(STEPS):
        rec.step = s
        ex.step(mlp_batch(s % 2))
    return rec.calls


# -- a bfloat16 model ------------------------------------------------------------------------------

BF16_EDGES = {"topk-ef": dict(error_feedback=True, ratio=4.0, directions=("fwd", "bwd")),
              "quant4-stochastic": dict(fwd_codec=Q4S, bwd_codec=Q8),
              "hadamard-delta": dict(fwd_codec=DELTA, bwd_codec=HQ)}


def bf16_executor(edge: str, mode: str) -> ReferenceExecutor:
    _, model = half_mlp(torch.bfloat16)
    names = list(model.graph.nodes)
    assign = {n: "p0" if i < names.index("tanh") else "p1" for i, n in enumerate(names)}
    edges = [EdgeCompression("gelu", None, "p0", "p1", **BF16_EDGES[edge])]
    return ReferenceExecutor(model, assign, OptimizerConfig("sgd", lr=0.1), micro_batches=2, compression=edges,
                             engine_options=MODES[mode][1])


def bf16_batch(s: int) -> dict:
    g = torch.Generator().manual_seed(s % 2)
    return {"x": torch.randn(4, 8, generator=g).numpy(), "y": torch.randint(0, 4, (4,), generator=g).numpy(),
            SAMPLE_IDS: np.arange(4, dtype=np.int64) + 4 * (s % 2)}


def record_bf16(edge: str, mode: str = "torch-host") -> list[dict]:
    ex = bf16_executor(edge, mode)
    rec = _Recorder(ex)
    for s in range(STEPS):
        rec.step = s
        ex.step(bf16_batch(s))
    return rec.calls


# -- tied-parameter gradients and data-parallel chunks ---------------------------------------------

TIED_CASES = {"topk": TOPK, "quant8": Q8, "quant4-stochastic": Q4S, "quant2-stochastic": Q2S, "hadamard-quant": HQS}


def tied_inputs() -> dict[str, np.ndarray]:
    return {dt: to_numpy(_tensor(11, dtype, (17, 16))).copy()
            for dt, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16))}


def tied_digests(inputs: dict[str, np.ndarray]) -> dict[str, str]:
    from fusion.executors.runtime.compression import TiedCodec

    out = {}
    for name, cfg in TIED_CASES.items():
        tc = TiedCodec.from_cfg(cfg)
        for dt in ("float32", "bfloat16"):
            for owner, it in (("p0", 0), ("p1", 0), ("p0", 1)):
                out[f"{name}/{dt}/{owner}/{it}"] = _digest(tc.encode(inputs[dt].copy(), dt, "wte.weight", owner, it),
                                                           kind="pgrad")
    return out


DP_CASES = {"quant8": {"algo": "quant", "bits": 8}, "quant4-stochastic": Q4S, "quant2": Q2}


def dp_digests(a: np.ndarray) -> dict[str, str]:
    from fusion.kernels.codecs import Role
    from fusion.kernels.codecs.registry import FlatCodec

    out = {}
    for name, cfg in DP_CASES.items():
        flat = FlatCodec(cfg, Role.DP_GRADIENT)  # what the all-reduce encodes its chunks with
        p = flat.encode(a.copy())
        out[name] = _digest(p)
        out[f"{name}/decoded"] = hashlib.sha256(np.asarray(flat.decode(p, name)).tobytes()).hexdigest()
    return out


# -- the recorded inputs ---------------------------------------------------------------------------

def record_inputs() -> dict:
    """Every golden input, computed once: the seeded tensors, and the encoder calls of short training runs.
    Stored in ``codec_golden_inputs.npz``; only :func:`compute` of the stored inputs runs in the tests."""
    return {"registry": registry_inputs(), "tied": tied_inputs(), "dp": to_numpy(_tensor(5, torch.float32, (1000,))).copy(),
            "tables": {e: record_tables(e) for e in EDGE_SETS}, "bf16": {e: record_bf16(e) for e in BF16_EDGES}}


def _save_calls(arrays: dict, prefix: str, calls: list[dict]) -> list[dict]:
    meta = []
    for i, c in enumerate(calls):
        arrays[f"{prefix}/{i}/x"] = c["x"]
        if c["ids"] is not None:
            arrays[f"{prefix}/{i}/ids"] = c["ids"]
        meta.append({k: v for k, v in c.items() if k not in ("x", "ids", "sent")} | {"ids": c["ids"] is not None})
    return meta


def save_inputs(inputs: dict, path: Path = INPUTS) -> None:
    arrays: dict[str, np.ndarray] = {f"registry/{k}": v for k, v in inputs["registry"].items()}
    arrays |= {f"tied/{k}": v for k, v in inputs["tied"].items()}
    arrays["dp"] = inputs["dp"]
    meta = {"tables": {e: _save_calls(arrays, f"tables/{e}", c) for e, c in inputs["tables"].items()},
            "bf16": {e: _save_calls(arrays, f"bf16/{e}", c) for e, c in inputs["bf16"].items()}}
    with open(path, "wb") as f:
        np.savez_compressed(f, meta=np.array(json.dumps(meta, sort_keys=True)), **arrays)


def load_inputs(path: Path = INPUTS) -> dict:
    with np.load(path, allow_pickle=False) as z:
        arrays = {k: z[k] for k in z.files}
    meta = json.loads(str(arrays.pop("meta")))

    def calls(section: str, name: str) -> list[dict]:
        return [c | {"x": arrays[f"{section}/{name}/{i}/x"],
                     "ids": arrays[f"{section}/{name}/{i}/ids"] if c["ids"] else None}
                for i, c in enumerate(meta[section][name])]

    return {"registry": {k.split("/", 1)[1]: v for k, v in arrays.items() if k.startswith("registry/")},
            "tied": {k.split("/", 1)[1]: v for k, v in arrays.items() if k.startswith("tied/")},
            "dp": arrays["dp"],
            "tables": {e: calls("tables", e) for e in meta["tables"]},
            "bf16": {e: calls("bf16", e) for e in meta["bf16"]}}


def compute(inputs: dict) -> dict:
    return {
        "registry": registry_digests(inputs["registry"]),
        "tables": {f"{e}/{m}": replay(table_executor(e, m), inputs["tables"][e]) for e in EDGE_SETS for m in MODES},
        "bf16": {f"{e}/{m}": replay(bf16_executor(e, m), inputs["bf16"][e])
                 for e in BF16_EDGES for m in MODES if m != "numpy-parts"},
        "tied": tied_digests(inputs["tied"]),
        "dp": dp_digests(inputs["dp"]),
    }


@pytest.fixture(scope="module")
def golden() -> dict:
    return json.loads(GOLDEN.read_text())


@pytest.fixture(scope="module")
def inputs() -> dict:
    return load_inputs()


def test_registry_codec_objects_give_the_recorded_bytes(golden, inputs):
    assert registry_digests(inputs["registry"]) == golden["registry"]


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("edge_set", list(EDGE_SETS))
def test_every_table_path_sends_the_recorded_bytes(golden, inputs, edge_set, mode):
    got, want = replay(table_executor(edge_set, mode), inputs["tables"][edge_set]), golden["tables"][f"{edge_set}/{mode}"]
    assert len(want) > 40  # every compressed message of four steps, both directions, and its decoding
    assert {k for k in got if got[k] != want.get(k)} == set() and set(got) == set(want)


def test_the_host_and_device_paths_send_the_same_bytes(golden):
    """Not only as recorded: on the same inputs, the four table paths (NumPy parts, and torch parts encoding in
    NumPy, with the torch codecs, on the device) send and decode the same bytes (the device codecs are the NumPy
    ones' twins)."""
    for e in EDGE_SETS:
        runs = [golden["tables"][f"{e}/{m}"] for m in MODES]
        assert all(r == runs[0] for r in runs[1:]), e
    for e in BF16_EDGES:
        runs = [golden["bf16"][f"{e}/{m}"] for m in MODES if m != "numpy-parts"]
        assert all(r == runs[0] for r in runs[1:]), e


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("edge_set", list(EDGE_SETS))
def test_replay_sends_what_a_live_run_sends(edge_set, mode):
    """The replay harness is the runtime's path: a live run on this machine's CPU, its encoder inputs replayed
    through fresh tables of the same mode, gives the bytes the run sent (so the golden bytes, replayed from
    stored inputs, pin what a run sends)."""
    calls = record_tables(edge_set, mode)
    live = {}
    for c in calls:
        payload, cfg = c["sent"]
        if cfg is None:
            continue
        od = OpData(name=c["key"][0], index=c["key"][1], op_users=(), actual_user=(), is_grad=c["is_grad"],
                    local_iter=c["step"], micro_batch=c["mb"], src=c["part"], dst=c["peer"], payload=payload,
                    compress_cfg=cfg)
        h = hashlib.sha256()
        for f in wire.encode_opdata(od):
            h.update(_raw(f))
        live[_message_name(c["step"], c["mb"], c["is_grad"], c["key"], c["part"], c["peer"])] = h.hexdigest()
    got = {k: v for k, v in replay(table_executor(edge_set, mode), calls).items() if not k.endswith("/decoded")}
    assert len(live) > 20 and got == live


@pytest.mark.parametrize("mode", [m for m in MODES if m != "numpy-parts"])
@pytest.mark.parametrize("edge", list(BF16_EDGES))
def test_bfloat16_edges_send_the_recorded_bytes(golden, inputs, edge, mode):
    assert replay(bf16_executor(edge, mode), inputs["bf16"][edge]) == golden["bf16"][f"{edge}/{mode}"]


def test_tied_gradient_codec_gives_the_recorded_bytes(golden, inputs):
    assert tied_digests(inputs["tied"]) == golden["tied"]


def test_dp_chunk_codec_gives_the_recorded_bytes(golden, inputs):
    assert dp_digests(inputs["dp"]) == golden["dp"]


if __name__ == "__main__":
    import sys

    if "--record-inputs" in sys.argv or not INPUTS.exists():
        save_inputs(record_inputs())
        print(f"wrote {INPUTS}")
    GOLDEN.write_text(json.dumps(compute(load_inputs()), indent=1, sort_keys=True) + "\n")
    print(f"wrote {GOLDEN}")
