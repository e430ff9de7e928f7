"""Payload bytes of every built-in codec on every path, pinned to what the code produced before the codec
refactor (issue 24): ``codec_golden.json`` beside this file holds the SHA-256 of each payload's wire frames.

Paths: the registry's codec objects (``fusion.kernels.codec.CODECS``); the CompNodes' tables, through the
in-process reference executor, on NumPy parts (the host NumPy table), torch parts with ``encode="host"``
(NumPy copies), ``encode="torch"`` (the torch codecs on CPU tensors: the CUDA code path) and
``encode="device"`` (a CPU part's default); a bfloat16 model; the tied-parameter gradient codec; the
data-parallel all-reduce chunk codec. Every message a part sends over a compressed edge is hashed, so Top-K
with and without error feedback, quant 8/4/2 bits nearest and stochastic, hadamard-quant and delta (first
visits, then steady-state deltas, decoded at the other end, whose training the later messages depend on)
are all pinned. Inputs are seeded; the hashes are of the wire frames (``fusion.ir.wire.encode_opdata``).

Regenerate (only when payload bytes are meant to change, and say so in the commit):
``python -m tests.kernels.test_codec_golden``.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.executors.dist_models import GPT_SPLITS, gpt_batch, tied_transformer
from tests.executors.shared_setup import capture_sent, half_mlp
from fusion.executors.reference import ReferenceExecutor
from fusion.ir import wire
from fusion.ir.builder import GraphBuilder
from fusion.ir.opdata import SAMPLE_IDS, OpData
from fusion.plan import EdgeCompression, OptimizerConfig

GOLDEN = Path(__file__).with_name("codec_golden.json")

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


def registry_digests() -> dict[str, str]:
    from fusion.kernels.codec import CODECS

    out = {}
    for name, (cfg, dtype) in REGISTRY_CASES.items():
        codec = CODECS.get(cfg["algo"])
        x = _tensor(len(name), dtype)
        out[f"{name}/torch"] = _digest(codec.encode(x, cfg))
        if cfg["algo"] != "topk":  # the quantisers also take NumPy arrays (the torch-free path)
            out[f"{name}/numpy"] = _digest(codec.encode(_bits(x), cfg) if dtype != torch.bfloat16 else
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


def _messages(sent: list[OpData]) -> dict[str, str]:
    out = {}
    for m in sent:
        if m.compress_cfg is None:
            continue
        h = hashlib.sha256()
        for f in wire.encode_opdata(m):
            h.update(_raw(f))
        out[f"{m.local_iter}/{m.micro_batch}/{'B' if m.is_grad else 'F'}/{m.key[0]}/{m.src}->{m.dst}"] = h.hexdigest()
    return out


def _state_digest(state: dict[str, np.ndarray]) -> str:
    h = hashlib.sha256()
    for k in sorted(state):
        h.update(k.encode())
        h.update(np.ascontiguousarray(state[k]).tobytes())
    return h.hexdigest()


def table_digests(edge_set: str, mode: str) -> dict[str, str]:
    engines, options = MODES[mode]
    ex = ReferenceExecutor(branching_mlp(), SPLIT, OptimizerConfig("adamw", lr=0.01), micro_batches=2,
                           engines=engines, compression=EDGE_SETS[edge_set], engine_options=options)
    sent = capture_sent(ex)
    for s in range(STEPS):
        ex.step(mlp_batch(s % 2))
    out = _messages(sent)
    out["state"] = _state_digest(ex.state())
    return out


# -- a bfloat16 model ------------------------------------------------------------------------------

BF16_EDGES = {"topk-ef": dict(error_feedback=True, ratio=4.0, directions=("fwd", "bwd")),
              "quant4-stochastic": dict(fwd_codec=Q4S, bwd_codec=Q8),
              "hadamard-delta": dict(fwd_codec=DELTA, bwd_codec=HQ)}


def bf16_digests(edge: str, mode: str) -> dict[str, str]:
    _, model = half_mlp(torch.bfloat16)
    names = list(model.graph.nodes)
    assign = {n: "p0" if i < names.index("tanh") else "p1" for i, n in enumerate(names)}
    edges = [EdgeCompression("gelu", None, "p0", "p1", **BF16_EDGES[edge])]
    ex = ReferenceExecutor(model, assign, OptimizerConfig("sgd", lr=0.1), micro_batches=2, compression=edges,
                           engine_options=MODES[mode][1])
    sent = capture_sent(ex)
    for s in range(STEPS):
        g = torch.Generator().manual_seed(s % 2)
        ex.step({"x": torch.randn(4, 8, generator=g).numpy(), "y": torch.randint(0, 4, (4,), generator=g).numpy(),
                 SAMPLE_IDS: np.arange(4, dtype=np.int64) + 4 * (s % 2)})
    out = _messages(sent)
    out["state"] = _state_digest(ex.state())
    return out


# -- tied-parameter gradients and data-parallel chunks ---------------------------------------------

TIED_CASES = {"topk": TOPK, "quant8": Q8, "quant4-stochastic": Q4S, "quant2-stochastic": Q2S, "hadamard-quant": HQS}


def tied_digests() -> dict[str, str]:
    from fusion.executors.runtime.compression import TiedCodec

    out = {}
    for name, cfg in TIED_CASES.items():
        tc = TiedCodec.from_cfg(cfg)
        for dtype in (torch.float32, torch.bfloat16):
            g = _tensor(11, dtype, (17, 16))
            dt = "bfloat16" if dtype == torch.bfloat16 else "float32"
            for owner, it in (("p0", 0), ("p1", 0), ("p0", 1)):
                out[f"{name}/{dt}/{owner}/{it}"] = _digest(tc.encode(_bits(g), dt, "wte.weight", owner, it), kind="pgrad")
    return out


def tied_training_digest(cfg: dict) -> str:
    ex = ReferenceExecutor(tied_transformer(mb=2), GPT_SPLITS[2], OptimizerConfig("adamw", lr=0.01),
                           micro_batches=2, tied_codec=cfg)
    for s in range(2):
        ex.step(gpt_batch(s, 4))
    return _state_digest(ex.state())


DP_CASES = {"quant8": {"algo": "quant", "bits": 8}, "quant4-stochastic": Q4S, "quant2": Q2}


def dp_digests() -> dict[str, str]:
    from fusion.kernels.codecs import Role
    from fusion.kernels.codecs.registry import FlatCodec

    out = {}
    for name, cfg in DP_CASES.items():
        flat = FlatCodec(cfg, Role.DP_GRADIENT)  # what the all-reduce encodes its chunks with
        a = _tensor(5, torch.float32, (1000,)).numpy()
        p = flat.encode(a)
        out[name] = _digest(p)
        out[f"{name}/decoded"] = hashlib.sha256(np.asarray(flat.decode(p, name)).tobytes()).hexdigest()
    return out


def compute() -> dict:
    return {
        "registry": registry_digests(),
        "tables": {f"{e}/{m}": table_digests(e, m) for e in EDGE_SETS for m in MODES},
        "bf16": {f"{e}/{m}": bf16_digests(e, m) for e in BF16_EDGES for m in MODES if m != "numpy-parts"},
        "tied": tied_digests(),
        "tied-training": {name: tied_training_digest(cfg) for name, cfg in (("quant8", Q8), ("topk", TOPK))},
        "dp": dp_digests(),
    }


@pytest.fixture(scope="module")
def golden() -> dict:
    return json.loads(GOLDEN.read_text())


def test_registry_codec_objects_give_the_recorded_bytes(golden):
    assert registry_digests() == golden["registry"]


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("edge_set", list(EDGE_SETS))
def test_every_table_path_sends_the_recorded_bytes(golden, edge_set, mode):
    got, want = table_digests(edge_set, mode), golden["tables"][f"{edge_set}/{mode}"]
    assert len(want) > 20  # every compressed message of four steps, both directions
    assert {k for k in got if got[k] != want.get(k)} == set() and set(got) == set(want)


def test_the_host_and_device_paths_send_the_same_bytes(golden):
    """Not only as recorded: the three torch-part paths agree with each other (the device codecs are the NumPy
    ones' twins). NumPy parts compute the layers with other kernels, so their messages differ from torch's."""
    for e in EDGE_SETS:
        runs = [golden["tables"][f"{e}/{m}"] for m in MODES if m != "numpy-parts"]
        assert all(r == runs[0] for r in runs[1:]), e


@pytest.mark.parametrize("mode", [m for m in MODES if m != "numpy-parts"])
@pytest.mark.parametrize("edge", list(BF16_EDGES))
def test_bfloat16_edges_send_the_recorded_bytes(golden, edge, mode):
    assert bf16_digests(edge, mode) == golden["bf16"][f"{edge}/{mode}"]


def test_tied_gradient_codec_gives_the_recorded_bytes(golden):
    assert tied_digests() == golden["tied"]
    assert tied_training_digest(Q8) == golden["tied-training"]["quant8"]


def test_dp_chunk_codec_gives_the_recorded_bytes(golden):
    assert dp_digests() == golden["dp"]


if __name__ == "__main__":
    GOLDEN.write_text(json.dumps(compute(), indent=1, sort_keys=True) + "\n")
    print(f"wrote {GOLDEN}")
