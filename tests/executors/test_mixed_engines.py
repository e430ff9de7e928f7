"""A mixed pipeline across processes: CompNode A on the torch engine (this
process), CompNode B on the NumPy engine in a separate process that *cannot*
import torch (a ``sys.meta_path`` blocker makes ``import torch`` raise, and
the process is started with ``python -I``). The parts exchange OpData as
msgpack headers plus raw array bytes over a loopback ZeroMQ PAIR socket — no
pickle. Training equals single-process torch: losses rtol 1e-5, gradients
rtol 1e-4.

This is a small self-contained harness: the main process drives the real
schedule loop of :class:`ReferenceExecutor`, with part B replaced by a proxy
that forwards every call to the child. The distributed CompNode executor will
replace the harness.
"""
from __future__ import annotations

import importlib.util
import subprocess
import sys
import textwrap
from pathlib import Path

import msgpack
import numpy as np
import torch
import torch.nn.functional as F
import zmq

from fusion.executors.optim import OptimizerConfig
from fusion.executors.part import make_routes
from fusion.executors.reference import ReferenceExecutor
from fusion.ir.onnx_import import load_onnx
from fusion.ir.serialize import graph_to_dict

import tests.ir.onnx_models as onnx_models

TIMEOUT_MS = 60_000

# -- the wire: msgpack header + raw bytes, shared verbatim by parent and child ----------------------

CODEC = '''
import msgpack, numpy as np

def enc_value(v):
    if isinstance(v, np.ndarray) or type(v).__module__ == "numpy":
        a = np.array(v, order="C")  # (np.ascontiguousarray would turn 0-d arrays into 1-d)
        return {"__nd__": True, "dtype": a.dtype.str, "shape": list(a.shape), "data": a.tobytes()}
    if isinstance(v, dict):
        return {"__map__": [[enc_value(k), enc_value(x)] for k, x in v.items()]}
    if isinstance(v, (list, tuple)):
        return [enc_value(x) for x in v]
    return v

def dec_value(v):
    if isinstance(v, dict) and v.get("__nd__"):
        return np.frombuffer(v["data"], dtype=np.dtype(v["dtype"])).reshape(v["shape"]).copy()
    if isinstance(v, dict) and "__map__" in v:
        return {_key(dec_value(k)): dec_value(x) for k, x in v["__map__"]}
    if isinstance(v, list):
        return [dec_value(x) for x in v]
    return v

def _key(k):
    return tuple(k) if isinstance(k, list) else k

OPDATA_FIELDS = ("name", "index", "op_users", "actual_user", "is_grad", "local_iter", "micro_batch", "src", "dst",
                 "is_loss", "requires_grad", "compress_cfg")

def enc_opdata(m):
    d = {f: getattr(m, f) for f in OPDATA_FIELDS}
    d["op_users"], d["actual_user"] = list(m.op_users), list(m.actual_user)
    d["payload"] = enc_value(m.payload)
    return d

def dec_opdata(d, OpData):
    d = dict(d)
    d["op_users"], d["actual_user"] = tuple(d["op_users"]), tuple(d["actual_user"])
    d["payload"] = dec_value(d["payload"])
    return OpData(**d)

def send(sock, obj):
    sock.send(msgpack.packb(enc_value(obj), use_bin_type=True))

def recv(sock, timeout_ms, peer, alive=None):
    waited = 0
    while not sock.poll(200):
        waited += 200
        if alive is not None and not alive():
            raise RuntimeError(f"{peer} exited without answering")
        if waited >= timeout_ms:
            raise TimeoutError(f"{peer} did not answer within {timeout_ms} ms")
    return dec_value(msgpack.unpackb(sock.recv(), raw=False, strict_map_key=False))
'''

CHILD = CODEC + '''
import sys

class BlockTorch:
    """Makes every import of torch fail in this process."""
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError(f"torch is blocked in this CompNode process ({name})")
        return None

sys.meta_path.insert(0, BlockTorch())
try:
    import torch  # noqa: F401
    torch_blocked = False
except ImportError:
    torch_blocked = True

import zmq
from fusion.executors.engines import make_engine_part, make_optimizer
from fusion.executors.optim import OptimizerConfig
from fusion.executors.part import PartRuntime
from fusion.ir.boundary import partition
from fusion.ir.opdata import OpData
from fusion.ir.serialize import graph_from_dict

sock = zmq.Context().socket(zmq.PAIR)
sock.setsockopt(zmq.LINGER, 0)
sock.connect(sys.argv[1])
setup = recv(sock, 60_000, "driver")
graph = graph_from_dict(setup["graph"]).validate(check_targets=False)
name, assignment = setup["part"], setup["assignment"]
sub = partition(graph, assignment)[name]
engine = make_engine_part(setup["engine"], graph, sub, setup["params"])
runtime = PartRuntime(graph, name, sub, assignment, engine)
opt = make_optimizer("numpy", engine, OptimizerConfig.from_dict(setup["optimizer"]))
calls = {"F": 0, "B": 0, "step": 0}
send(sock, {"engine": engine.engine, "torch_blocked": torch_blocked})
while True:
    cmd = recv(sock, 120_000, "driver")
    op = cmd["op"]
    if op == "F":
        out, loss = runtime.forward(cmd["it"], cmd["mb"], cmd["feeds"], [dec_opdata(m, OpData) for m in cmd["inbox"]])
        calls["F"] += 1
        send(sock, {"out": [enc_opdata(m) for m in out], "loss": loss})
    elif op == "B":
        out = runtime.backward(cmd["it"], cmd["mb"], [dec_opdata(m, OpData) for m in cmd["inbox"]], cmd["scale"])
        calls["B"] += 1
        send(sock, {"out": [enc_opdata(m) for m in out]})
    elif op == "grads":
        send(sock, {k: v for k, v in engine.grads().items()})
    elif op == "set_grad":
        engine.set_grad(cmd["name"], cmd["grad"])
        send(sock, {})
    elif op == "step":
        if opt is not None:
            opt.step()
            opt.zero_grad()
        calls["step"] += 1
        send(sock, {})
    elif op == "state":
        send(sock, engine.state())
    elif op == "stop":
        send(sock, {"calls": calls, "torch_in_modules": sorted(m for m in sys.modules if m == "torch" or m.startswith("torch."))})
        break
'''

_codec: dict = {}
exec(CODEC, _codec)  # the parent uses the very same codec text as the child


class RemotePart:
    """Part B as seen by the driver: PartRuntime, engine and optimizer calls forwarded to the child process."""

    def __init__(self, sock, child, name, sub, assignment, trainable_names):
        from fusion.ir.opdata import OpData

        self.sock, self.child, self.name, self._OpData = sock, child, name, OpData
        self.routes = make_routes(sub, assignment)
        self._trainable = list(trainable_names)

    def _call(self, **cmd):
        _codec["send"](self.sock, cmd)
        return _codec["recv"](self.sock, TIMEOUT_MS, f"part {self.name}", lambda: self.child.poll() is None)

    # PartRuntime
    def needs_acts(self):
        return set(self.routes.recv_from)

    def needs_grads(self):
        return self.routes.grads_from

    def forward(self, it, mb, feeds, inbox):
        feeds = {k: np.asarray(v) for k, v in feeds.items()}
        r = self._call(op="F", it=it, mb=mb, feeds=feeds, inbox=[_codec["enc_opdata"](m) for m in inbox])
        return [_codec["dec_opdata"](m, self._OpData) for m in r["out"]], r["loss"]

    def backward(self, it, mb, inbox, scale):
        r = self._call(op="B", it=it, mb=mb, scale=scale, inbox=[_codec["enc_opdata"](m) for m in inbox])
        return [_codec["dec_opdata"](m, self._OpData) for m in r["out"]]

    # engine
    def trainable(self):
        return dict.fromkeys(self._trainable)

    def grads(self):
        return self._call(op="grads")

    def set_grad(self, name, grad):
        self._call(op="set_grad", name=name, grad=np.asarray(grad))

    def state(self):
        return self._call(op="state")

    # optimizer
    def step(self):
        self._call(op="step")

    def zero_grad(self, set_to_none=True):
        pass  # the child zeroes after its step


def _run_two_processes(model, assignment, cfg, module, batches, feed, torch_loss, opt, tmp_path):
    ex = ReferenceExecutor(model, assignment, cfg, micro_batches=2, schedule="1f1b", engines={"A": "torch", "B": "numpy"})
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PAIR)
    sock.setsockopt(zmq.LINGER, 0)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    log = open(tmp_path / "child.log", "w")
    child = subprocess.Popen([sys.executable, "-I", "-c", CHILD, f"tcp://127.0.0.1:{port}"], stdout=log, stderr=subprocess.STDOUT)
    try:
        names_b = sorted({p for n, part in assignment.items() if part == "B" for p in model.graph[n].param_names()})
        _codec["send"](sock, {"graph": graph_to_dict(model.graph), "part": "B", "assignment": assignment, "engine": "numpy",
                              "params": {k: np.asarray(model.params[k]) for k in names_b}, "optimizer": cfg.to_dict()})
        hello = _codec["recv"](sock, TIMEOUT_MS, "part B", lambda: child.poll() is None)
        assert hello == {"engine": "numpy", "torch_blocked": True}
        local_b = ex.engines["B"]
        remote = RemotePart(sock, child, "B", ex.parts["B"].sub, assignment, local_b.trainable())
        ex.parts["B"] = ex.engines["B"] = ex.optimizers["B"] = remote  # B now lives only in the child
        onnx_models.assert_trains_like(ex, module, batches, feed, torch_loss, 2, opt)
        final = ex.state()
        for n, p in module.named_parameters():
            np.testing.assert_allclose(final[n], p.detach().numpy(), rtol=1e-4, atol=1e-6, err_msg=n)
        bye = remote._call(op="stop")
        assert bye["calls"] == {"F": 6, "B": 6, "step": 3}  # 3 steps x 2 micro-batches, all run by the child
        assert bye["torch_in_modules"] == []
        assert not local_b.stash  # the local stand-in was never used
        assert child.wait(timeout=30) == 0
    except BaseException:
        child.kill()
        child.wait(timeout=10)
        log.close()
        print((tmp_path / "child.log").read_text())
        raise
    finally:
        sock.close()
        ctx.term()
        log.close()


def test_child_process_cannot_import_torch_yet_imports_and_runs_onnx(tmp_path):
    """In the blocked process: import torch fails, while an ONNX file imports for the numpy engine and runs."""
    from onnx import TensorProto, helper, numpy_helper, save

    w = np.random.default_rng(0).standard_normal((3, 4)).astype(np.float32)
    nodes = [helper.make_node("Gemm", ["x", "w"], ["h"], name="fc", transB=1), helper.make_node("Relu", ["h"], ["out"], name="relu")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])],
                              [helper.make_tensor_value_info("out", TensorProto.FLOAT, [2, 3])], [numpy_helper.from_array(w, "w")])
    save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(tmp_path / "m.onnx"))
    probe = CHILD.split("import zmq")[0] + textwrap.dedent(f'''
        print("blocked" if torch_blocked else "imported")
        import numpy as np
        from fusion.ir.onnx_import import load_onnx
        from fusion.executors.engines import make_engine_part
        model = load_onnx({str(tmp_path / "m.onnx")!r}, loss="mse", engine="numpy")
        part = make_engine_part("numpy", model.graph, model.graph.subgraph(model.graph.nodes), model.params)
        x = np.ones((2, 4), np.float32)
        _, loss = part.forward(0, {{}}, {{"x": x, "y": np.zeros((2, 3), np.float32)}})
        part.backward(0, {{}})
        h = np.maximum(x @ model.params["w"].T, 0)
        assert abs(loss - float((h ** 2).mean())) < 1e-5 and part.grads()["w"] is not None
        assert "torch" not in sys.modules
        print("trained")
    ''')
    out = subprocess.run([sys.executable, "-I", "-c", probe], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["blocked", "trained"]


def test_onnx_transformer_torch_part_and_numpy_process_train_like_pytorch(tmp_path):
    tt = onnx_models.tiny_transformer_module()
    module, args = tt.model()
    path = onnx_models.export(module, args, tmp_path / "tt.onnx")
    model = load_onnx(path)
    ref = tt.TinyTransformer()
    ref.load_state_dict({**module.state_dict(), **{k: torch.as_tensor(np.array(v)) for k, v in model.params.items() if k in module.state_dict()}})
    assign = {n: ("A" if p == "a" else "B") for n, p in onnx_models.two_part_assignment(model.graph).items()}
    # SGD, not AdamW: the key bias of attention gets a mathematically zero gradient (softmax ignores a
    # per-row constant), so AdamW's m/sqrt(v) turns float32 rounding noise into full-size updates and
    # the final weights of that bias differ between engines (losses do not; AdamW is covered elsewhere).
    cfg = OptimizerConfig("sgd", lr=0.1, momentum=0.9, weight_decay=0.01)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01)
    g = torch.Generator().manual_seed(11)
    batches = [(torch.randint(0, 13, (4, 8), generator=g), torch.randint(0, 13, (4, 8), generator=g)) for _ in range(2)]
    _run_two_processes(model, assign, cfg, ref, batches, lambda b: {"idx": b[0], "targets": b[1]}, ref, opt, tmp_path)


def test_tied_embedding_across_processes_trains_like_pytorch(tmp_path):
    """The op-node model ties the embedding (part A, torch) to the LM head (part B, numpy process)."""
    from tests.executors.opnode_models import ASSIGN, Plain, opnode_model

    model = opnode_model()
    ref = Plain()
    ref.load_state_dict({k: torch.as_tensor(v) for k, v in model.params.items()})
    cfg = OptimizerConfig("sgd", lr=0.1, momentum=0.9)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(2)
    batches = [(torch.randint(0, 11, (4, 5), generator=g), torch.randint(0, 11, (4, 5), generator=g))]
    _run_two_processes(model, ASSIGN, cfg, ref, batches, lambda b: {"idx": b[0], "y": b[1]}, ref, opt, tmp_path)
