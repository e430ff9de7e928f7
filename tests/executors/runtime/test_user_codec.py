"""A user-registered codec end to end: registered by the model file (a plan plugin), chosen by
``fusion compile --compress``, imported by executors under ``--trust-plugins``, carried by the wire as a
plain payload (no pickle), decoded through the registry; unknown codecs and malformed payloads refused."""
import json
import logging
import sys
import string
import textwrap

import msgpack
import numpy as np
import pytest
import zmq

from fusion.executors.reference import ReferenceExecutor
from fusion.executors.runtime.compression import CompressionTable, TiedCodec
from fusion.executors.runtime.coordinator import CoordinatorConfig
from fusion.ir.errors import FusionError
from fusion.ir.opdata import OpData
from fusion.ir.wire import decode_opdata, encode_opdata
from fusion.kernels.codec import CODECS, CodecPayload
from fusion.plan import EdgeCompression, OptimizerConfig
from tests.executors.dist_models import TWO_SITES_YAML

#: a per-tensor int8 codec class with NumPy and torch paths, torch-free at import (its torch path imports
#: torch when called); :func:`int8_codec` gives its source under a class and codec name
INT8_CODEC = string.Template('''
class $cls:
    """Per-tensor symmetric int8: one float scale (max |x| / 127), one byte per element."""

    name = "$name"

    def wire_nbytes(self, numel, dtype, cfg):
        return numel + 8

    def encode_numpy(self, arr, cfg):
        a = np.asarray(arr, dtype=np.float32)
        scale = float(np.abs(a).max()) / 127.0 if a.size else 0.0
        q = np.clip(np.rint(a / scale), -127, 127).astype(np.int8) if scale > 0 else np.zeros(a.shape, np.int8)
        return {"scale": scale, "shape": list(a.shape), "q": q.tobytes()}

    def decode_numpy(self, p):
        shape = p["shape"]
        if not isinstance(shape, list) or not all(isinstance(s, int) and s >= 0 for s in shape):
            raise ValueError(f"bad shape {shape!r}")
        if not isinstance(p["q"], bytes) or len(p["q"]) != int(np.prod(shape, dtype=np.int64)):
            raise ValueError(f"{len(p['q'])} code bytes for shape {shape}")
        if not isinstance(p["scale"], float) or not np.isfinite(p["scale"]):
            raise ValueError("bad scale")
        return (np.frombuffer(p["q"], np.int8).astype(np.float32) * np.float32(p["scale"])).reshape(shape)

    def encode(self, tensor, cfg):
        return self.encode_numpy(tensor.detach().cpu().numpy(), cfg)

    def decode(self, payload, like=None):
        import torch

        return torch.from_numpy(self.decode_numpy(payload))
''')


def int8_codec(cls: str, name: str) -> str:
    return INT8_CODEC.substitute(cls=cls, name=name)


#: a model file that registers a per-tensor int8 codec (NumPy and torch paths) and a torch-only one
MODEL = textwrap.dedent('''
    import numpy as np
    import torch

    from fusion.ir.builder import GraphBuilder
    from fusion.kernels.codec import register_codec


''') + int8_codec("Int8Codec", "int8") + textwrap.dedent('''


    class TorchOnlyCodec(Int8Codec):
        name = "int8-torch"
        encode_numpy = None
        decode_numpy = None

        def encode(self, tensor, cfg):
            return Int8Codec.encode_numpy(self, tensor.detach().cpu().numpy(), cfg)

        def decode(self, payload, like=None):
            return torch.from_numpy(Int8Codec.decode_numpy(self, payload))


    register_codec(Int8Codec())
    register_codec(TorchOnlyCodec())


    def model():
        b = GraphBuilder()
        x, y = b.input("x"), b.label("y")
        h = b.module("fc1", "torch.nn.Linear", x, in_features=16, out_features=32)
        h = b.function("act", "torch.tanh", h)
        h = b.module("fc2", "torch.nn.Linear", h, in_features=32, out_features=32)
        h = b.function("act2", "torch.tanh", h)
        o = b.module("fc3", "torch.nn.Linear", h, in_features=32, out_features=4)
        b.loss("loss", "torch.nn.functional.cross_entropy", o, y)
        return b.build(example={"x": torch.randn(4, 16), "y": torch.tensor([0, 1, 2, 3])})
''')

INT8 = {"algo": "int8"}


@pytest.fixture(scope="module", autouse=True)
def _registry_restored():
    """The codecs these tests register go away with them (the registry is process-wide, like the op registry)."""
    before = dict(CODECS._codecs)
    yield
    CODECS._codecs.clear()
    CODECS._codecs.update(before)
    for m in ("fusion_user_int8_model", "fusion_user_npint8"):
        sys.modules.pop(m, None)


@pytest.fixture(scope="module")
def model_file(tmp_path_factory):
    d = tmp_path_factory.mktemp("usercodec")
    f = d / "int8_model.py"
    f.write_text(MODEL)
    from fusion.loader import load_model

    load_model(f"{f}:model")  # registers int8 in this process, as `fusion compile` does
    return f


def _batches(steps: int):
    g = np.random.default_rng(3)
    return [{"x": g.standard_normal((8, 16)).astype(np.float32), "y": g.integers(0, 4, 8)} for _ in range(steps)]


def _compile(cli, tmp_path, model_file, *extra):
    """``fusion compile`` of the model file on two sites (forked from the session's command server)."""
    out = tmp_path / "plan"
    (tmp_path / "c.yaml").write_text(TWO_SITES_YAML)
    r = cli.run(["compile", f"{model_file}:model", "--cluster", str(tmp_path / "c.yaml"), "--strategy", "equal-count",
                 "--micro-batches", "2", "--optimizer", "adamw", "--lr", "0.01", "-o", str(out), *extra],
                tmp_path, 120)
    return r, out


def test_compile_names_the_user_codec_and_carries_its_plugin_then_processes_equal_the_reference(cli, tmp_path,
                                                                                                 model_file):
    from fusion.executors.runtime.launcher import LocalCluster
    from fusion.loader import load_model
    from fusion.plan import load_plan

    r, out = _compile(cli, tmp_path, model_file, "--compress", "int8")
    assert r.returncode == 0, r.stderr
    plan = load_plan(out)
    assert plan.graph.plugins == ["plugins/int8_model.py"] and (out / "plugins" / "int8_model.py").is_file()
    assert plan.compression and all(e.fwd_codec == INT8 and e.bwd_codec == INT8 for e in plan.compression)

    steps = 4
    batches = _batches(steps)
    with LocalCluster(out, tmp_path / "run", CoordinatorConfig(peer_timeout_s=20), threads=1, trace=False,
                      executor_args=["--trust-plugins"]) as lc:
        lc.start()
        losses = [lc.coordinator.step(b).loss for b in batches]
        state = lc.coordinator.fetch_state() if hasattr(lc.coordinator, "fetch_state") else None
    model = load_model(f"{model_file}:model")
    ref = ReferenceExecutor(model, plan.assignment, OptimizerConfig("adamw", lr=0.01), micro_batches=2,
                            compression=plan.compression)
    expected = [ref.step(b).loss for b in batches]
    dense = ReferenceExecutor(load_model(f"{model_file}:model"), plan.assignment, OptimizerConfig("adamw", lr=0.01),
                              micro_batches=2)
    assert [dense.step(b).loss for b in batches] != expected  # the codec really ran
    assert losses == expected  # exactly: the same NumPy codec on the same bytes in every process
    if state is not None:
        for k, v in ref.state().items():
            np.testing.assert_array_equal(state[k], v)


def test_executors_refuse_the_plan_without_trust_and_an_unknown_codec_with_one_line(cli, tmp_path, model_file):
    from fusion.plan import load_plan, save_plan

    r, out = _compile(cli, tmp_path, model_file, "--compress", "int8")
    assert r.returncode == 0, r.stderr
    run = ["executor", str(out), "--node", "part1", "--coordinator",
           "tcp://127.0.0.1:9", "--bind", "tcp://127.0.0.1:*", "--insecure", "--startup-timeout", "5"]
    p = cli.run(run, tmp_path, 120)
    assert p.returncode == 2 and "--trust-plugins" in p.stderr
    plan = load_plan(out)
    plan.compression = [EdgeCompression(e.producer, e.index, e.src, e.dst, fwd_codec={"algo": "nosuch"},
                                        bwd_codec=e.bwd_codec) for e in plan.compression]
    save_plan(plan, out)
    p = cli.run([*run, "--trust-plugins"], tmp_path, 120)
    lines = [ln for ln in p.stderr.splitlines() if ln.strip() and "WARNING" not in ln and "INFO" not in ln]
    assert p.returncode == 2, p.stderr
    assert len(lines) == 1 and "unknown codec 'nosuch'" in lines[0] and "->part1 (fwd)" in lines[0], p.stderr


def test_compile_refuses_an_unknown_codec_with_one_line(cli, tmp_path, model_file):
    r, _ = _compile(cli, tmp_path, model_file, "--compress", "nosuch:bits=3")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "unknown codec 'nosuch'" in r.stderr


def test_a_numpy_part_refuses_a_torch_only_codec_at_load(model_file):
    edges = [EdgeCompression("fc1", None, "p0", "p1", fwd_codec={"algo": "int8-torch"})]
    CompressionTable.build("p1", edges, engine="torch")  # a torch part runs it
    with pytest.raises(FusionError, match=r"compression of fc1\[None\] p0->p1 \(fwd\): codec 'int8-torch' has only a "
                                          r"torch path, and part p1 runs the numpy engine"):
        CompressionTable.build("p1", edges, engine="numpy")
    CompressionTable.build("p1", [EdgeCompression("fc1", None, "p0", "p1", fwd_codec=INT8)], engine="numpy")
    with pytest.raises(FusionError, match="has only a torch path"):
        TiedCodec.from_cfg({"algo": "int8-torch"}).check_engine("p0", "numpy")


def test_a_user_payload_crosses_the_wire_as_msgpack_and_frames_and_bad_ones_are_refused():
    from fusion.ir.errors import WireError

    p = CodecPayload("int8", {"scale": 0.5, "shape": [2, 3], "q": bytes(range(6))})
    od = OpData("fc1", None, ("act",), ("act",), False, 0, 0, "p0", "p1", p, compress_cfg=INT8)
    frames = encode_opdata(od)
    assert b"\x80\x04" not in bytes(memoryview(frames[0]))  # no pickle protocol header anywhere
    assert decode_opdata(frames).payload == p
    head = msgpack.unpackb(bytes(memoryview(frames[0])), raw=False)
    for change, why in [({"b": ["scale"]}, "named twice"), ({"b": []}, "1 frames sent"),
                        ({"f": {"scale": {"x": 1}, "shape": [2, 3]}}, "has a dict"), ({"algo": 7}, "codec name")]:
        h = {**head, "h": {**head["h"], "payload": {**head["h"]["payload"], **change}}}
        with pytest.raises(WireError, match=why):
            decode_opdata([msgpack.packb(h), *frames[1:]])
    with pytest.raises(FusionError, match="plain values"):
        from fusion.kernels.codec import check_plain

        check_plain(np.zeros(3), "int8")


def test_a_compnode_rejects_malformed_user_payloads_and_keeps_serving(tmp_path, model_file, caplog):
    from fusion.executors.runtime.compnode import CompNode, ExecutorConfig
    from fusion.executors.runtime.control import Setup
    from fusion.executors.runtime.launcher import hand_plan
    from fusion.executors.reference import contiguous_parts
    from fusion.commands.compile import record_codec_plugins
    from fusion.loader import load_model
    from fusion.plan import load_plan, save_plan

    model = load_model(f"{model_file}:model")
    assign = contiguous_parts(model, 2)
    plan = hand_plan(model, assign, micro_batches=2)
    (edge,) = {(r.node, r.index) for n, p in assign.items() if p == "p1"
               for r in model.graph[n].refs() if assign[r.node] == "p0"}
    plan.compression = [EdgeCompression(edge[0], edge[1], "p0", "p1", fwd_codec=INT8, bwd_codec=INT8)]
    assert record_codec_plugins(plan) == [str(model_file.resolve())]
    plan_dir = save_plan(plan, tmp_path / "plan", params=model.params)
    node = CompNode(load_plan(plan_dir), plan_dir, ExecutorConfig("p1", "tcp://127.0.0.1:9", trust_plugins=True))
    node._setup(Setup(peers={"p0": "tcp://127.0.0.1:9"}, emulate_links=False, resume_step=None,
                      checkpoint_dir=None))
    try:
        shape = tuple(model.graph.output_meta(*edge).shape)
        x = np.random.default_rng(1).standard_normal(shape).astype(np.float32)
        codec = CODECS.get("int8")
        good_fields = codec.encode_numpy(x, INT8)

        def frames(fields, algo="int8", mb=0):
            users = tuple(u for u in model.graph.users()[edge[0]] if assign[u] == "p1")
            return encode_opdata(OpData(edge[0], edge[1], users, users, False, 0, mb, src="p0", dst="p1",
                                        payload=CodecPayload(algo, fields), requires_grad=True, compress_cfg=INT8))

        bad = {"short codes": frames({**good_fields, "q": good_fields["q"][:-1]}),
               "wrong shape": frames({**good_fields, "shape": [shape[0], shape[1] // 2], "q": good_fields["q"][:x.size // 2]}),
               "other codec": frames(good_fields, algo="int8-torch"),
               "scale not a float": frames({**good_fields, "scale": "big"})}
        caplog.set_level(logging.WARNING)
        before = node.transport.rejected
        for f in bad.values():
            node.transport._handle([zmq.Frame(b"p0"), *[zmq.Frame(bytes(memoryview(b))) for b in f]])
        assert node.transport.rejected - before == len(bad), caplog.text
        assert node.transport.escaped == 0
        assert "payload refused by its codec: ValueError" in caplog.text
        assert "decodes to float32" in caplog.text and "does not compress it with that codec" in caplog.text
        node.transport._handle([zmq.Frame(b"p0"), *[zmq.Frame(bytes(memoryview(b))) for b in frames(good_fields)]])
        assert node.transport.rejected - before == len(bad)  # the good one is accepted, decoded on arrival
        (od,) = node.inbox._data[(0, "F", 0)]
        np.testing.assert_array_equal(od.payload, codec.decode_numpy(good_fields))
    finally:
        node.transport.close(timeout_s=1, linger_s=0)


def test_fusion_run_refuses_a_plan_naming_an_unknown_codec_with_one_line(cli, tmp_path):
    """A plan without plugins cannot get the codec from anywhere: refused before any executor starts."""
    from fusion.executors.runtime.launcher import hand_plan
    from fusion.plan import save_plan
    from tests.executors.dist_models import CNN_SPLITS, branching_cnn

    model = branching_cnn(mb=2)
    plan = hand_plan(model, CNN_SPLITS[4], micro_batches=2)
    plan.compression = [EdgeCompression("relu_a", None, "p1", "p3", fwd_codec={"algo": "nosuch"})]
    out = save_plan(plan, tmp_path / "plan", params=model.params)
    r = cli.run(["run", str(out), "--steps", "1", "--out", str(tmp_path / "run")], tmp_path, 120)
    assert r.returncode == 2, r.stderr
    errors = [ln for ln in r.stderr.splitlines() if "error" in ln]
    assert len(errors) == 1 and "compression of relu_a[None] p1->p3 (fwd): unknown codec 'nosuch'" in errors[0]
    assert not list((tmp_path / "run").glob("logs/*.log"))  # no executor was started


#: a plugin file that only registers a codec, torch-free (its torch path imports torch when called)
NUMPY_CODEC = "import numpy as np\n\nfrom fusion.kernels.codec import register_codec\n\n" \
    + int8_codec("NpInt8Codec", "npint8") + "\n\nregister_codec(NpInt8Codec())\n"


def test_a_numpy_compnode_without_torch_runs_a_user_codec_from_a_plugin(tmp_path):
    """A torch CompNode and a NumPy CompNode whose process cannot import torch exchange activations and
    gradients through a user codec registered by a torch-free plugin file: the run equals the reference
    executor exactly, and the NumPy process never loaded torch."""
    import importlib.util
    import json

    import tests.ir.onnx_models as onnx_models
    from tests.executors.test_mixed_engines import _blocked_env
    from fusion.executors.runtime.launcher import LocalCluster, hand_plan
    from fusion.ir.boundary import partition
    from fusion.ir.onnx.importer import load_onnx
    from fusion.plan import load_plan, save_plan

    src = tmp_path / "npint8.py"
    src.write_text(NUMPY_CODEC)
    if "fusion_user_npint8" not in sys.modules:  # as `fusion compile` imports a model file
        spec = importlib.util.spec_from_file_location("fusion_user_npint8", src)
        mod = importlib.util.module_from_spec(spec)
        sys.modules["fusion_user_npint8"] = mod
        spec.loader.exec_module(mod)
    tt = onnx_models.tiny_transformer_module()
    module, args = tt.model()
    model = load_onnx(onnx_models.export(module, args, tmp_path / "tt.onnx"))
    assign = {n: ("A" if p == "a" else "B") for n, p in onnx_models.two_part_assignment(model.graph).items()}
    codec = {"algo": "npint8"}
    comp = [EdgeCompression(e.producer, e.index, "A", "B", fwd_codec=codec, bwd_codec=codec)
            for e in {(e.producer, e.index): e for e in partition(model.graph, assign)["A"].boundary.sent_acts}.values()]
    g = np.random.default_rng(5)
    batches = [{"idx": g.integers(0, 13, (4, 8)), "targets": g.integers(0, 13, (4, 8))} for _ in range(3)]
    opt = OptimizerConfig("sgd", lr=0.1, momentum=0.9)
    engines = {"A": "torch", "B": "numpy"}
    ref = ReferenceExecutor(model, assign, opt, micro_batches=2, schedule="1f1b", engines=engines, compression=comp)
    expected = [ref.step(b).loss for b in batches]
    dense = ReferenceExecutor(model, assign, opt, micro_batches=2, schedule="1f1b", engines=engines)
    assert [dense.step(b).loss for b in batches] != expected  # the codec really ran
    plan = hand_plan(model, assign, schedule="1f1b", micro_batches=2, optimizer=opt, engines=engines)
    plan.compression = comp
    from fusion.commands.compile import record_codec_plugins

    assert record_codec_plugins(plan) == [str(src.resolve())]
    plan_dir = save_plan(plan, tmp_path / "plan", params=model.params)
    assert load_plan(plan_dir).graph.plugins == ["plugins/npint8.py"]
    env_b, record = _blocked_env(tmp_path)
    with LocalCluster(plan_dir, tmp_path / "run", CoordinatorConfig(peer_timeout_s=30), threads=1, trace=False,
                      part_env={"B": env_b}, executor_args=["--trust-plugins"]) as lc:
        lc.start()
        losses = [lc.coordinator.step(b).loss for b in batches]
    assert losses == expected
    rec = json.loads(record.read_text())
    assert rec["torch_blocked"] is True and rec["torch_modules"] == [] and rec["numpy_engine_loaded"]


def test_a_user_codec_can_carry_tied_gradients(model_file):
    from fusion.ir.errors import WireError

    t = TiedCodec.from_cfg(INT8)
    g = np.random.default_rng(4).standard_normal((16, 8)).astype(np.float32)
    p = t.encode(g, "float32", "w", "p0", 0)
    assert isinstance(p, CodecPayload) and p.algo == "int8"
    d = t.decode(decode_opdata(encode_opdata(OpData("w", None, (), (), True, 0, -1, "p0", "p1", p))).payload,
                 (16, 8), "float32", "gradient of 'w' from p0")
    np.testing.assert_array_equal(d, CODECS.get("int8").decode_numpy(p.fields))
    assert np.abs(d - g).max() <= np.abs(g).max() / 127 * 0.5 + 1e-6
    with pytest.raises(WireError, match=r"decodes to float32\[16, 8\], the graph says float32\[8, 16\]"):
        t.decode(p, (8, 16), "float32", "gradient of 'w' from p0")
    with pytest.raises(WireError, match="expected a int8 payload"):
        t.decode(CodecPayload("int8-torch", p.fields), (16, 8), "float32", "gradient of 'w' from p0")
