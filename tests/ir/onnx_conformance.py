"""The onnx package's backend node tests, run through fusion's ONNX importer and torch engine.

A case is *eligible* when every op of its graph is one fusion claims (an
``onnx.<OpType>`` target of the torch engine, default domain). Each eligible
case must either

- pass: import, run forward in the reference executor, and match every
  expected output within the case's tolerance (rtol/atol, at least 1e-4 /
  1e-5 for float32 as torch kernels round differently from NumPy's), or
- be refused at load: :func:`fusion.ir.onnx.importer.load_onnx` raises a
  one-line :class:`~fusion.ir.errors.GraphError` naming the op and the
  attribute or dtype it does not support.

Anything else (an exception at run time, an output missing, a wrong value)
is a failure.

fusion needs shape-like inputs (Reshape's shape, Resize's scales, TopK's k,
Slice bounds: the positions of :data:`fusion.ir.onnx.ops.STATIC_INPUTS`) to
be constants, as they are in exported models; many backend cases feed them as
graph inputs instead. With ``bind_static=True`` (the default) such inputs are
bound as initializers holding the case's data before import; with False the
case is imported as written (and refused). Not a test module: ``tests/ir/test_onnx_conformance.py`` and
``benchmarks/trace_models.py`` use it.
"""
from __future__ import annotations

import contextlib
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np


@dataclass
class Outcome:
    name: str
    status: str  # "pass", "refused", "fail"
    detail: str = ""


def eligible_cases():
    """The onnx backend node test cases whose ops the torch engine claims (sorted by name)."""
    import onnx  # noqa: F401
    from onnx.backend.test.case.node import collect_testcases

    from fusion.ir.onnx.semantics import ONNX_OPS

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cases = collect_testcases(None)
    out = []
    for c in cases:
        if c.model is None or not c.data_sets:
            continue
        nodes = c.model.graph.node
        if nodes and all(n.domain in ("", "ai.onnx") and n.op_type in ONNX_OPS for n in nodes):
            out.append(c)
    return sorted(out, key=lambda c: c.name)


def _bind_static(model, feeds: dict[str, np.ndarray]):
    """A copy of ``model`` whose graph inputs that feed static input positions are initializers."""
    import onnx
    from onnx import numpy_helper

    from fusion.ir.onnx.ops import static_inputs

    static = {v for n in model.graph.node for i, v in enumerate(n.input) if v and i in static_inputs(n.op_type)}
    bind = [name for name in feeds if name in static]
    if not bind:
        return model
    m = onnx.ModelProto()
    m.CopyFrom(model)
    keep = [i for i in m.graph.input if i.name not in bind]
    del m.graph.input[:]
    m.graph.input.extend(keep)
    m.graph.initializer.extend(numpy_helper.from_array(np.asarray(feeds.pop(name)), name) for name in bind)
    return m


def run_case(case, folder: Path | None = None, bind_static: bool = True) -> Outcome:
    import onnx

    from fusion.executors.reference import ReferenceExecutor
    from fusion.ir.errors import GraphError
    from fusion.ir.node import NodeKind
    from fusion.ir.onnx.importer import load_onnx

    inputs, expected = case.data_sets[0]
    inputs, expected = [_array(v) for v in inputs], [_array(v) for v in expected]
    graph = case.model.graph
    init = {i.name for i in graph.initializer}
    in_names = [i.name for i in graph.input if i.name not in init]
    feeds = {n: np.asarray(v) for n, v in zip(in_names, inputs)}
    proto = _bind_static(case.model, feeds) if bind_static else case.model
    with (contextlib.nullcontext(str(folder)) if folder is not None else tempfile.TemporaryDirectory()) as d:
        path = Path(d) / f"{case.name}.onnx"  # one file per case, removed after loading (no folder per case)
        onnx.save(proto, str(path))
        try:
            model = load_onnx(path, example=feeds)
        except GraphError as e:
            msg = str(e)
            if "\n" in msg:
                return Outcome(case.name, "fail", f"refusal is not one line: {msg[:200]!r}")
            return Outcome(case.name, "refused", msg.split(": ", 1)[-1])
        except Exception as e:  # noqa: BLE001 - a raw exception at load is a failure
            return Outcome(case.name, "fail", f"load raised {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}")
        finally:
            path.unlink(missing_ok=True)
    try:
        ex = ReferenceExecutor(model)
        got = ex.forward_outputs({k: feeds[k] for k in model.example})
    except Exception as e:  # noqa: BLE001 - the point: nothing may raise at run time
        return Outcome(case.name, "fail", f"run raised {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}")
    g = model.graph
    loss = [n for n, node in g.nodes.items() if node.kind == NodeKind.LOSS]
    for o, want in zip([o.name for o in graph.output], expected):
        # the importer makes the first scalar float output the loss; the others are OUTPUT nodes
        key = f"output:{o}" if f"output:{o}" in got else (loss[0] if loss else None)
        if key is None or key not in got:
            return Outcome(case.name, "fail", f"output {o!r} missing")
        value, want = np.asarray(got[key]), np.asarray(want)
        if value.shape != want.shape:
            return Outcome(case.name, "fail", f"output {o!r}: shape {value.shape}, expected {want.shape}")
        if value.dtype != want.dtype and not (value.dtype.kind == want.dtype.kind == "f"):
            return Outcome(case.name, "fail", f"output {o!r}: dtype {value.dtype}, expected {want.dtype}")
        if want.dtype.kind in "fc":
            rtol, atol = max(case.rtol, 1e-4), max(case.atol, 1e-5)
            ok = np.allclose(value.astype(np.float64), want.astype(np.float64), rtol=rtol, atol=atol, equal_nan=True)
        else:
            ok = np.array_equal(value, want)
        if not ok:
            return Outcome(case.name, "fail", f"output {o!r}: values differ")
    return Outcome(case.name, "pass")


def _array(v):
    from onnx import TensorProto, numpy_helper

    return numpy_helper.to_array(v) if isinstance(v, TensorProto) else v


def run_all(folder: Path | None = None, bind_static: bool = True) -> list[Outcome]:
    return [run_case(c, folder, bind_static) for c in eligible_cases()]


if __name__ == "__main__":
    import collections
    import sys

    args = [a for a in sys.argv[1:] if a != "--as-written"]
    res = run_all(bind_static="--as-written" not in sys.argv[1:])
    counts = collections.Counter(r.status for r in res)
    for r in res:
        if r.status != "pass" and (not args or r.status in args):
            print(f"{r.status:8s} {r.name}: {r.detail}")
    print(dict(counts), f"of {len(res)} eligible")
