"""A mixed pipeline on the real runtime: CompNode A on the torch engine and CompNode B
on the NumPy engine (``Part.engine = "numpy"`` in the plan), each a real
``fusion executor`` process driven by the real coordinator
(:class:`fusion.executors.runtime.launcher.LocalCluster`), exchanging OP-Data over
ZeroMQ. B's process *cannot* import torch: it starts with a test-only
``sitecustomize`` on its PYTHONPATH that puts a ``sys.meta_path`` blocker in
front of every import of ``torch``/``torch.*``, logs each attempt, checks
that ``import torch`` fails, and records which ``torch`` modules are in
``sys.modules`` when the executor exits. Training equals single-process
torch: losses rtol 1e-5, gradients rtol 1e-4, parameters after the run.

The last test also checks, in a blocked process, that an ONNX file imports
for the NumPy engine and trains there.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import torch

from fusion.plan import OptimizerConfig
from fusion.ir.onnx.importer import load_onnx

import tests.ir.onnx_models as onnx_models

# sitecustomize for B's process: the blocker plus a record of what happened (os._exit skips atexit,
# and the executor leaves through os._exit, so the record is written by a wrapper around it)
SITECUSTOMIZE = '''
import os, sys, json
_REC = os.environ["FUSION_TEST_TORCH_RECORD"]
class BlockTorch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            with open(_REC + ".attempts", "a") as f:
                f.write(name + "\\n")
            raise ImportError(f"torch is blocked in this CompNode process ({name})")
        return None
sys.meta_path.insert(0, BlockTorch())
try:
    import torch  # noqa: F401
    _blocked = False
except ImportError:
    _blocked = True
os.remove(_REC + ".attempts")  # the probe above is the only attempt we expect

def _record(status=None):
    with open(_REC, "w") as f:
        json.dump({"torch_blocked": _blocked, "pid": os.getpid(),
                   "torch_modules": sorted(m for m in sys.modules if m == "torch" or m.startswith("torch.")),
                   "numpy_engine_loaded": "fusion.executors.engines.numpy.engine" in sys.modules}, f)

_real_exit = os._exit
def _exit(status):
    _record()
    _real_exit(status)
os._exit = _exit
import atexit
atexit.register(_record)
'''


def _blocked_env(tmp_path: Path) -> tuple[dict[str, str], Path]:
    site = tmp_path / "blocked-site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    record = tmp_path / "torch-record.json"
    pp = os.pathsep.join([str(site), *filter(None, [os.environ.get("PYTHONPATH")])])
    return {"PYTHONPATH": pp, "FUSION_TEST_TORCH_RECORD": str(record)}, record


class _Distributed:
    """``step(batch) -> report with .loss and .grads``: the real coordinator's step."""

    def __init__(self, coordinator):
        self.coordinator = coordinator

    def step(self, batch):
        return self.coordinator.step({k: np.asarray(v) for k, v in batch.items()}, want_grads=True)


def _run_real_executors(model, assignment, cfg, module, batches, feed, opt, tmp_path, micro=2, schedule="1f1b"):
    from fusion.executors.runtime.coordinator import CoordinatorConfig
    from fusion.executors.runtime.launcher import LocalCluster, hand_plan
    from fusion.plan import load_plan, save_plan

    plan = hand_plan(model, assignment, schedule=schedule, micro_batches=micro, optimizer=cfg,
                     engines={"A": "torch", "B": "numpy"})
    plan_dir = save_plan(plan, tmp_path / "plan", params=model.params)
    assert {p: part.engine for p, part in load_plan(plan_dir).parts.items()} == {"A": "torch", "B": "numpy"}
    env_b, record = _blocked_env(tmp_path)
    with LocalCluster(plan_dir, tmp_path / "run", CoordinatorConfig(peer_timeout_s=30), threads=1,
                      part_env={"B": env_b}) as lc:
        lc.start()
        onnx_models.assert_trains_like(_Distributed(lc.coordinator), module, batches, feed, module, micro, opt)
        final = lc.coordinator.fetch_state()
        pid_b = lc.processes["B"].pid
    for n, p in module.named_parameters():
        np.testing.assert_allclose(final[n], p.detach().numpy(), rtol=1e-4, atol=1e-6, err_msg=n)
    rec = json.loads(record.read_text())
    assert rec["pid"] == pid_b  # the record is B's executor's own
    assert rec["torch_blocked"] is True, "import torch did not fail in B's process"
    assert rec["torch_modules"] == [], rec["torch_modules"]
    assert rec["numpy_engine_loaded"]
    attempts = record.with_name(record.name + ".attempts")
    assert not attempts.exists(), f"B's executor tried to import torch: {attempts.read_text()}"
    log_b = (tmp_path / "run" / "logs" / "B.log").read_text()
    assert "Traceback" not in log_b, log_b


def test_onnx_transformer_torch_executor_and_numpy_executor_train_like_pytorch(tmp_path):
    tt = onnx_models.tiny_transformer_module()
    module, args = tt.model()
    path = onnx_models.export(module, args, tmp_path / "tt.onnx")
    model = load_onnx(path)
    assert all(isinstance(v, np.ndarray) for v in model.params.values())  # ONNX weights are NumPy arrays
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
    _run_real_executors(model, assign, cfg, ref, batches, lambda b: {"idx": b[0], "targets": b[1]}, opt, tmp_path)


def test_tied_embedding_across_torch_and_numpy_executors_trains_like_pytorch(tmp_path):
    """The op-node model ties the embedding (part A, torch) to the LM head (part B, numpy, no torch)."""
    from tests.executors.opnode_models import ASSIGN, Plain, opnode_model

    model = opnode_model()
    ref = Plain()
    ref.load_state_dict({k: torch.as_tensor(v) for k, v in model.params.items()})
    cfg = OptimizerConfig("sgd", lr=0.1, momentum=0.9)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(2)
    batches = [(torch.randint(0, 11, (4, 5), generator=g), torch.randint(0, 11, (4, 5), generator=g))]
    _run_real_executors(model, ASSIGN, cfg, ref, batches, lambda b: {"idx": b[0], "y": b[1]}, opt, tmp_path,
                        schedule="gpipe")


def test_child_process_cannot_import_torch_yet_imports_and_runs_onnx(tmp_path):
    """In the blocked process: import torch fails, while an ONNX file imports for the numpy engine and runs."""
    from onnx import TensorProto, helper, numpy_helper, save

    w = np.random.default_rng(0).standard_normal((3, 4)).astype(np.float32)
    nodes = [helper.make_node("Gemm", ["x", "w"], ["h"], name="fc", transB=1), helper.make_node("Relu", ["h"], ["out"], name="relu")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])],
                              [helper.make_tensor_value_info("out", TensorProto.FLOAT, [2, 3])], [numpy_helper.from_array(w, "w")])
    save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(tmp_path / "m.onnx"))
    probe = textwrap.dedent(f'''
        import sys
        try:
            import torch  # noqa: F401
            print("imported")
        except ImportError:
            print("blocked")
        import numpy as np
        from fusion.ir.onnx.importer import load_onnx
        from fusion.executors.engines.numpy.engine import supports
        from fusion.executors.engines.select import make_engine_part
        from fusion.ir.boundary import subgraph
        model = load_onnx({str(tmp_path / "m.onnx")!r}, loss="mse", engine="numpy", supports=supports)
        part = make_engine_part("numpy", model.graph, subgraph(model.graph, model.graph.nodes), model.params)
        x = np.ones((2, 4), np.float32)
        _, loss = part.forward(0, {{}}, {{"x": x, "y": np.zeros((2, 3), np.float32)}})
        part.backward(0, {{}})
        h = np.maximum(x @ model.params["w"].T, 0)
        assert abs(loss - float((h ** 2).mean())) < 1e-5 and part.grads()["w"] is not None
        assert "torch" not in sys.modules
        print("trained")
    ''')
    env, record = _blocked_env(tmp_path)
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60,
                         env={**os.environ, **env})
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["blocked", "trained"]
    assert json.loads(record.read_text())["torch_modules"] == []
