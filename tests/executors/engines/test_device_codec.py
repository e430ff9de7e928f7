"""Compression on the torch engine's device (a table with a ``device``: each codec's device path, fusion/kernels/codecs).

The device path must give the host NumPy path's payload bytes for every codec, decode to the same
values, keep dense edges as NumPy arrays, and leave training bit for bit unchanged (in one process
and over real CompNode processes). GPU tests at the end skip with a reason when torch sees no CUDA device.
"""
import numpy as np
import pytest
import torch

from tests.executors.dist_models import CNN_SPLITS, branching_cnn, cnn_batch
from tests.executors.shared_setup import capture_sent
from fusion.executors.engines.torch.engine import to_array
from fusion.executors.reference import ReferenceExecutor
from fusion.executors.runtime.compression import CompressionTable, dense_payload
from fusion.ir.opdata import SAMPLE_IDS, OpData
from fusion.kernels import quant_torch
from fusion.kernels.codec import CODECS as CODECS_REGISTRY
from fusion.kernels.delta import DeltaPayload
from fusion.kernels.quant import QuantPayload
from fusion.kernels.sparse import SparsePayload
from fusion.kernels.staging import HostStaging
from fusion.plan import EdgeCompression, OptimizerConfig

KEY = ("x", None)
CODECS = {
    "topk": {"algo": "topk", "ratio": 10.0},
    "quant8": {"algo": "quant", "bits": 8, "block": 64},
    "quant4": {"algo": "quant", "bits": 4, "block": 32},
    "quant2-stochastic": {"algo": "quant", "bits": 2, "block": 16, "rounding": "stochastic"},
    "hadamard-quant": {"algo": "hadamard-quant", "bits": 4, "block": 16, "rounding": "stochastic"},
    "delta": {"algo": "delta", "bits": 4, "block": 32},
}
DTYPES = ["float32", "float16", "bfloat16", "float64"]
NO_CUDA = not torch.cuda.is_available()
NO_CUDA_REASON = "no CUDA device visible to torch: the device encode runs on CPU tensors only here"


class _Graph:
    """The two things ``CompressionTable.build`` asks a graph: node kinds and output dtypes."""

    def __init__(self, dtype):
        self.dtype = dtype
        self.nodes = {"x": None}

    def __getitem__(self, name):
        return type("N", (), {"kind": type("K", (), {"value": "call"})()})()

    def output_meta(self, name, index):
        return type("M", (), {"dtype": self.dtype})()


def _tables(codec: str, dtype: str, ef: bool = False, device="cpu", torch_on_cpu=True):
    """(host table, device table) of part "a" sending KEY to "b" forward (and its gradient back).

    torch_on_cpu: the torch codecs on CPU tensors (the CUDA code path); False: a CPU part's default."""
    cfg = CODECS[codec]
    e = EdgeCompression("x", None, "a", "b", error_feedback=ef, fwd_codec=cfg,
                        bwd_codec=None if codec == "delta" else cfg)
    host = CompressionTable.build("a", [e], _Graph(dtype))
    dev = CompressionTable.build("a", [e], _Graph(dtype), device=torch.device(device), torch_on_cpu=torch_on_cpu)
    return host, dev


def _tensor(step: int, dtype: str, shape=(4, 3, 40)) -> torch.Tensor:
    g = torch.Generator().manual_seed(step)
    x = torch.randn(shape, generator=g, dtype=torch.float64) * (1 + step)
    x[0, 0, :5] = 0.0  # ties at zero
    return x.to(getattr(torch, dtype))


def _frames(p):
    head, frames = p.to_msg()
    return head, [bytes(memoryview(f)) for f in frames]


@pytest.mark.parametrize("torch_on_cpu", [True, False], ids=["torch-codecs", "cpu-default"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("codec", list(CODECS))
def test_device_encode_gives_the_host_paths_bytes(codec, dtype, torch_on_cpu):
    """Several messages in turn (stochastic seeds, delta buffers: first visit then deltas) on one edge."""
    host, dev = _tables(codec, dtype, torch_on_cpu=torch_on_cpu)
    ids = np.arange(4, dtype=np.int64)
    for step in range(3):
        x = _tensor(step, dtype)
        want, cfg_h = host.encode(to_array(x), KEY, "b", False, step % 2, ids=ids, it=step)
        got, cfg_d = dev.encode(x, KEY, "b", False, step % 2, ids=ids, it=step)
        assert cfg_h == cfg_d and cfg_d is not None
        assert type(got) is type(want) and isinstance(got, (SparsePayload, QuantPayload, DeltaPayload))
        assert _frames(got) == _frames(want), f"{codec} {dtype} message {step}"
    if codec == "delta":  # both ends' buffers: the same rows as the NumPy buffers
        a = host.delta.buffers[("send", KEY, "b")].state_dict()
        b = dev.delta.buffers[("send", KEY, "b")].state_dict()
        assert sorted(a) == sorted(b) == [0, 1, 2, 3]
        for i in a:
            np.testing.assert_array_equal(a[i], b[i])
    else:  # gradients back over the edge: the bwd rule, on the receiving part's table
        e = EdgeCompression("x", None, "a", "b", fwd_codec=CODECS[codec], bwd_codec=CODECS[codec])
        hb = CompressionTable.build("b", [e], _Graph(dtype))
        db = CompressionTable.build("b", [e], _Graph(dtype), device=torch.device("cpu"), torch_on_cpu=torch_on_cpu)
        g = _tensor(7, dtype)
        assert _frames(db.encode(g, KEY, "a", True, 0)[0]) == _frames(hb.encode(to_array(g), KEY, "a", True, 0)[0])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_error_feedback_on_the_device_matches_the_host_and_keeps_its_residual(dtype):
    host, dev = _tables("topk", dtype, ef=True)
    for step in range(3):
        x = _tensor(step, dtype)
        want, _ = host.encode(to_array(x), KEY, "b", False, 0)
        got, _ = dev.encode(x, KEY, "b", False, 0)
        assert _frames(got) == _frames(want)
    r_host, r_dev = host.residual(KEY, "b", "fwd", 0), dev.residual(KEY, "b", "fwd", 0)
    assert r_dev is not None and torch.equal(r_host, r_dev)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("codec", ["topk", "quant4", "hadamard-quant", "delta"])
def test_decode_fills_a_device_tensor_with_the_host_decodes_values(codec, dtype):
    host_a, dev_a = _tables(codec, dtype)
    e = EdgeCompression("x", None, "a", "b", fwd_codec=CODECS[codec])
    host_b = CompressionTable.build("b", [e], _Graph(dtype))
    dev_b = CompressionTable.build("b", [e], _Graph(dtype), device=torch.device("cpu"), torch_on_cpu=True)
    ids = np.arange(4, dtype=np.int64)
    for step in range(2):
        x = _tensor(step, dtype)
        p, cfg = host_a.encode(to_array(x), KEY, "b", False, 0, ids=ids, it=step)
        od = OpData("x", None, ("y",), ("y",), False, step, 0, src="a", dst="b", payload=p, compress_cfg=cfg)
        want = host_b.decode(od, tuple(x.shape))
        got = dev_b.decode(od, tuple(x.shape))
        assert isinstance(got, torch.Tensor) and got.device.type == "cpu" and got.dtype == x.dtype
        np.testing.assert_array_equal(to_array(got), np.asarray(want))


def test_a_dense_or_integer_tensor_leaves_as_a_numpy_array():
    _, dev = _tables("topk", "float32")
    x = _tensor(0, "float32")
    out, cfg = dev.encode(x, KEY, "c", False, 0)  # no rule towards c
    assert cfg is None and isinstance(out, np.ndarray) and np.array_equal(out, x.numpy())
    i = torch.arange(12).reshape(3, 4)
    out, cfg = dev.encode(i, KEY, "b", False, 0)  # a rule, but not a float tensor
    assert cfg is None and isinstance(out, np.ndarray) and out.dtype == np.int64


class _HalfCodec:
    """A user codec for the test: float16 values, one frame (NumPy path only)."""

    name = "test-half"

    def wire_nbytes(self, numel, dtype, cfg):
        return 2 * numel

    def encode_numpy(self, arr, cfg):
        a = np.asarray(arr)
        return {"shape": list(a.shape), "h": a.astype(np.float16).tobytes()}

    def decode_numpy(self, p):
        return np.frombuffer(p["h"], np.float16).astype(np.float32).reshape(p["shape"])

    def encode(self, tensor, cfg):
        return self.encode_numpy(tensor.detach().cpu().numpy(), cfg)

    def decode(self, payload, like=None):
        return torch.from_numpy(self.decode_numpy(payload))


def test_a_registered_codec_without_a_device_path_goes_to_the_host_table():
    """A user-registered codec has no device implementation: the device table hands the host table a NumPy
    copy, and the payload is the one the host table makes of the same values."""
    from fusion.kernels.codec import register_codec

    before = dict(CODECS_REGISTRY._codecs)
    try:
        register_codec(_HalfCodec())
        cfg = {"algo": "test-half"}
        e = EdgeCompression("x", None, "a", "b", fwd_codec=cfg, bwd_codec=cfg)
        host = CompressionTable.build("a", [e], _Graph("float32"))
        dev = CompressionTable.build("a", [e], _Graph("float32"), device=torch.device("cpu"), torch_on_cpu=True)
        x = _tensor(0, "float32")
        got, got_cfg = dev.encode(x, KEY, "b", False, 0)
        want, want_cfg = host.encode(x.numpy(), KEY, "b", False, 0)
        assert got_cfg == want_cfg == cfg and type(got) is type(want) and not isinstance(got, torch.Tensor)
        assert got == want and got.fields["h"] == x.numpy().astype(np.float16).tobytes()
    finally:
        CODECS_REGISTRY._codecs.clear()
        CODECS_REGISTRY._codecs.update(before)


def test_quant_frames_through_a_reused_staging_buffer_are_the_same_bytes():
    st = HostStaging(pin=False)
    cfg = CODECS["quant4"]
    for step in range(4):
        x = _tensor(step, "float32", (8, 5, 20))
        assert _frames(quant_torch.quantize(x, cfg, staging=st)) == _frames(quant_torch.quantize(x, cfg))
    assert st.allocations == 1  # reused across messages, never handed out


def _reference(compression, encode: str, steps=3, ids=False):
    ex = ReferenceExecutor(branching_cnn(mb=2), CNN_SPLITS[4], OptimizerConfig("adamw", lr=0.01), micro_batches=2,
                           compression=compression, engine_options={"*": {"encode": encode}})
    losses = []
    for s in range(steps):
        b = cnn_batch(s % 2, 4)
        if ids:
            b[SAMPLE_IDS] = np.arange(4, dtype=np.int64) + 4 * (s % 2)
        losses.append(ex.step(b).loss)
    return ex, losses


MIXED = [EdgeCompression("relu_a", None, "p1", "p3", fwd_codec=CODECS["quant4"], bwd_codec=CODECS["topk"]),
         EdgeCompression("conv1", None, "p0", "p2", error_feedback=True, ratio=20.0, directions=("fwd", "bwd")),
         EdgeCompression("conv1", None, "p0", "p1", fwd_codec=CODECS["delta"], bwd_codec=CODECS["hadamard-quant"])]


@pytest.mark.parametrize("encode", ["torch", "device"])
def test_training_on_the_device_path_equals_the_host_path_bit_for_bit(encode):
    dev, on_device = _reference(MIXED, encode, ids=True)
    host, on_host = _reference(MIXED, "host", ids=True)
    assert all(p.compression.device is not None for p in dev.parts.values() if p.compression)
    assert not any(p.compression.device is not None for p in host.parts.values() if p.compression)
    assert dev.parts["p0"].engine.tensor_out == {("conv1", None)}
    assert on_device == on_host
    _, dense = _reference([], encode)
    assert on_device != dense  # the codecs ran
    dev_state = dev.state()
    for name, v in host.state().items():
        np.testing.assert_array_equal(dev_state[name], v, err_msg=name)


def test_the_engine_hands_tensors_only_for_edges_encoded_on_the_device():
    """What leaves the torch engine: the tensor of a compressed edge (no NumPy copy of it), arrays otherwise;
    and what the runtime puts on the wire: arrays and payloads only, never a tensor."""
    ex = ReferenceExecutor(branching_cnn(mb=2), CNN_SPLITS[4], OptimizerConfig("sgd", lr=0.1), micro_batches=1,
                           compression=MIXED[:2], engine_options={"*": {"encode": "torch"}})
    seen, sent = {}, capture_sent(ex)
    for name, part in ex.parts.items():
        eng = part.engine

        def fwd(*a, _f=eng.forward, _n=name, **kw):
            out, loss = _f(*a, **kw)
            seen.update({(_n, k): type(v) for k, v in out.items()})
            return out, loss

        def bwd(*a, _b=eng.backward, _n=name, **kw):
            out = _b(*a, **kw)
            seen.update({(_n, "grad", k): type(v) for k, v in out.items()})
            return out

        eng.forward, eng.backward = fwd, bwd
    ex.step(cnn_batch(0, 2))
    assert seen[("p0", ("conv1", None))] is torch.Tensor  # compressed towards p2 (and dense towards p1)
    assert seen[("p1", ("relu_a", None))] is torch.Tensor
    assert seen[("p2", ("tanh_b", None))] is np.ndarray  # not compressed
    assert seen[("p3", "grad", ("relu_a", None))] is torch.Tensor  # its gradient goes back Top-K'd
    assert seen[("p2", "grad", ("conv1", None))] is torch.Tensor
    assert seen[("p1", "grad", ("conv1", None))] is np.ndarray
    assert sent and not any(isinstance(m.payload, torch.Tensor) for m in sent)
    dense_conv1 = [m for m in sent if m.key == ("conv1", None) and m.dst == "p1" and not m.is_grad]
    assert dense_conv1 and isinstance(dense_conv1[0].payload, np.ndarray) and dense_conv1[0].compress_cfg is None


def test_a_bad_encode_option_is_one_line():
    from fusion.ir.errors import FusionError

    with pytest.raises(FusionError, match="encode='gpu': one of device, torch, host"):
        _reference([], "gpu")


def test_distributed_run_on_the_device_path_equals_the_host_path(tmp_path):
    """Real CompNode processes: ``fusion executor --encode torch`` (the torch codecs, the CUDA code path, on
    CPU tensors) and ``--encode host`` (NumPy copies, the path before) give the same losses and weights, exactly."""
    from tests.executors.dist_models import run_distributed
    from fusion.executors.runtime.launcher import hand_plan
    from fusion.plan import save_plan

    model = branching_cnn(mb=2)
    plan = hand_plan(model, CNN_SPLITS[4], micro_batches=2, optimizer=OptimizerConfig("sgd", lr=0.1))
    plan.compression = MIXED[:2]
    plan_dir = save_plan(plan, tmp_path / "plan", params=model.params)
    batches = [cnn_batch(s, 4) for s in range(2)]
    dev, dev_state = run_distributed(plan_dir, tmp_path / "dev", batches, want_grads=False,
                                     executor_args=["--encode", "torch"])
    host, host_state = run_distributed(plan_dir, tmp_path / "host", batches, want_grads=False,
                                       executor_args=["--encode", "host"])
    logs = {run: (tmp_path / run / "logs" / "p0.log").read_text() for run in ("dev", "host")}
    assert "compressed edges encoded on cpu with the torch codecs" in logs["dev"] and "encoded on" not in logs["host"]
    assert [r.loss for r in dev] == [r.loss for r in host]
    assert set(dev_state) == set(host_state)
    for name, v in host_state.items():
        np.testing.assert_array_equal(dev_state[name], v, err_msg=name)


# -- on a GPU -----------------------------------------------------------------------------------


@pytest.mark.skipif(NO_CUDA, reason=NO_CUDA_REASON)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("codec", list(CODECS))
def test_cuda_encode_gives_the_cpu_bytes_and_decodes_on_the_gpu(codec, dtype):
    host, dev = _tables(codec, dtype, device="cuda")
    ids = np.arange(4, dtype=np.int64)
    for step in range(3):
        x = _tensor(step, dtype)
        want, _ = host.encode(to_array(x), KEY, "b", False, 0, ids=ids, it=step)
        got, _ = dev.encode(x.cuda(), KEY, "b", False, 0, ids=ids, it=step)
        assert _frames(got) == _frames(want), f"{codec} {dtype} message {step}"
    if codec != "delta":
        y = dev.decode(OpData("x", None, ("y",), ("y",), False, 0, 0, src="b", dst="a", payload=got))
        assert y.is_cuda
        np.testing.assert_array_equal(to_array(y), np.asarray(dense_payload(want)))


@pytest.mark.skipif(NO_CUDA, reason=NO_CUDA_REASON)
def test_cuda_staging_is_pinned_and_reused_across_messages():
    from fusion.kernels.staging import staging_for

    for codec in ("topk", "quant4"):
        _, dev = _tables(codec, "float32", device="cuda")
        x = _tensor(0, "float32").cuda()
        dev.encode(x, KEY, "b", False, 0)
        st = staging_for(x.device)
        before = st.allocations
        for step in range(1, 4):
            dev.encode(_tensor(step, "float32").cuda(), KEY, "b", False, 0)
        assert st.pin and st.buffer.is_pinned() and st.allocations == before, codec


@pytest.mark.skipif(NO_CUDA, reason=NO_CUDA_REASON)
def test_distributed_run_on_cuda_equals_the_cpu_run(tmp_path):
    """Four CompNodes on one GPU: encoding on the GPU gives the losses of ``--encode host`` on the GPU (same
    bytes; rtol 1e-5, not exact, as cuDNN's backward may sum in any order), and of the CPU run within rtol 1e-3
    (the GPU's convolutions round differently, which can move a Top-K pick or a quantisation step)."""
    from tests.executors.dist_models import run_distributed
    from fusion.executors.runtime.launcher import hand_plan
    from fusion.plan import save_plan

    model = branching_cnn(mb=2)
    plan = hand_plan(model, CNN_SPLITS[4], micro_batches=2, optimizer=OptimizerConfig("sgd", lr=0.1))
    plan.compression = MIXED[:2]
    plan_dir = save_plan(plan, tmp_path / "plan", params=model.params)
    batches = [cnn_batch(s, 4) for s in range(2)]
    gpu, _ = run_distributed(plan_dir, tmp_path / "gpu", batches, want_grads=False, executor_args=["--device", "cuda:0"])
    gpu_host, _ = run_distributed(plan_dir, tmp_path / "gpu-host", batches, want_grads=False,
                                  executor_args=["--device", "cuda:0", "--encode", "host"])
    cpu, _ = run_distributed(plan_dir, tmp_path / "cpu", batches, want_grads=False)
    assert "compressed edges encoded on cuda:0 with the torch codecs" in (tmp_path / "gpu" / "logs" / "p0.log").read_text()
    np.testing.assert_allclose([r.loss for r in gpu], [r.loss for r in gpu_host], rtol=1e-5)
    np.testing.assert_allclose([r.loss for r in gpu], [r.loss for r in cpu], rtol=1e-3)
