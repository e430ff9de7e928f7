"""Reading an ONNX file for the importer: validation, shape inference,
normalised nodes, and constant folding (evaluating nodes whose inputs are all
constants with ONNX's own reference evaluator, at the model's opset, so shape
arithmetic becomes literals). See :mod:`fusion.ir.onnx.importer`.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

import numpy as np

from fusion.ir.errors import GraphError
from fusion.ir.onnx.ops import ATTR_TO_INPUT, COERCE_2D_BEFORE, static_inputs
from fusion.ir.onnx.resize import upsample_attrs


@dataclass
class OnnxNode:
    """An ONNX node, normalised: attributes decoded, attribute-inputs of old opsets moved to inputs."""

    name: str
    op: str
    domain: str
    inputs: list[str]
    outputs: list[str]
    attrs: dict[str, Any]
    proto: Any = None  # the NodeProto as read (its attributes as the model's opset means them)
    opset: int = 0  # the model's default-domain opset


def read_model(path: Path, example: Mapping[str, Any] | None):
    import onnx

    if not path.is_file():
        raise GraphError(f"{path}: no such ONNX file")
    try:
        mp = onnx.load(str(path))
        onnx.checker.check_model(mp)
    except Exception as e:  # protobuf DecodeError, ValidationError, ... : all mean a bad file
        raise GraphError(f"{path}: not a valid ONNX model ({type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else 'empty'})") from None
    inits = {i.name for i in mp.graph.initializer}
    for inp in mp.graph.input:
        if example and inp.name in example and inp.name not in inits:
            dims = inp.type.tensor_type.shape.dim
            shape = np.shape(example[inp.name])
            if len(dims) != len(shape):
                raise GraphError(f"{path}: example for input {inp.name!r} has rank {len(shape)}, the model expects {len(dims)}")
            for d, s in zip(dims, shape):
                d.ClearField("dim_param")
                d.dim_value = int(s)
    try:
        mp = onnx.shape_inference.infer_shapes(mp, check_type=True, strict_mode=True, data_prop=True)
    except Exception as e:
        raise GraphError(f"{path}: ONNX shape inference failed ({type(e).__name__}: {e})") from None
    return mp


def value_types(mp) -> dict[str, tuple[tuple[int, ...] | None, str]]:
    """value name -> (static shape or None, dtype name) from the graph and shape inference."""
    import onnx

    out: dict[str, tuple[tuple[int, ...] | None, str]] = {}
    for vi in list(mp.graph.input) + list(mp.graph.value_info) + list(mp.graph.output):
        t = vi.type
        if not t.HasField("tensor_type"):
            continue
        tt = t.tensor_type
        dtype = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(tt.elem_type)).name if tt.elem_type else "float32"
        shape = None
        if tt.HasField("shape") and all(d.HasField("dim_value") for d in tt.shape.dim):
            shape = tuple(int(d.dim_value) for d in tt.shape.dim)
        out[vi.name] = (shape, dtype)
    for init in mp.graph.initializer:
        out[init.name] = (tuple(int(d) for d in init.dims), np.dtype(onnx.helper.tensor_dtype_to_np_dtype(init.data_type)).name)
    return out


def attr_value(a) -> Any:
    import onnx
    from onnx import numpy_helper

    if a.type == onnx.AttributeProto.TENSOR:
        return numpy_helper.to_array(a.t)
    v = onnx.helper.get_attribute_value(a)
    if isinstance(v, bytes):
        return v.decode()
    if isinstance(v, list):
        return [x.decode() if isinstance(x, bytes) else x for x in v]
    return v


def normalise_nodes(mp, consts: dict[str, np.ndarray]) -> list[OnnxNode]:
    opset = next((o.version for o in mp.opset_import if o.domain in ("", "ai.onnx")), 0)
    return normalise_protos(mp.graph.node, opset, consts)


def normalise_protos(protos, opset: int, consts: dict[str, np.ndarray], prefix: str = "") -> list[OnnxNode]:
    """NodeProtos as :class:`OnnxNode` (``prefix`` names the nodes of an inlined subgraph)."""
    nodes, used = [], set()
    for i, n in enumerate(protos):
        name = prefix + (n.name or f"{n.op_type}_{i}")
        while name in used:
            name = f"{name}_{i}"
        used.add(name)
        attrs = {a.name: attr_value(a) for a in n.attribute}
        inputs = list(n.input)
        for attr, pos, since, dtype in ATTR_TO_INPUT.get(n.op_type, ()):
            if opset < since and attr in attrs:
                cname = f"{name}.{attr}"
                consts[cname] = np.asarray(attrs.pop(attr), dtype=dtype)
                inputs += [""] * (pos + 1 - len(inputs))
                inputs[pos] = cname
        if n.op_type in COERCE_2D_BEFORE and opset < COERCE_2D_BEFORE[n.op_type]:
            attrs.setdefault("axis", 1)  # the old default
            attrs["coerce_2d"] = 1
        if n.op_type == "Resize" and opset < 11:  # Resize-10 is Upsample-9 renamed: (X, scales), asymmetric, floor
            inputs = [inputs[0], "", *inputs[1:2]]
            attrs.update(upsample_attrs(attrs.get("mode", "nearest")))
        if n.op_type == "Dropout" and opset < 12:
            attrs.pop("ratio", None)  # an attribute before opset 12; inference Dropout is the identity either way
            attrs.pop("is_test", None)
        outputs = list(n.output)
        while outputs and outputs[-1] == "":
            outputs.pop()
        nodes.append(OnnxNode(name, n.op_type, n.domain, inputs, outputs, attrs, n, opset))
    return nodes


def constant_value(node: OnnxNode) -> np.ndarray:
    a = node.attrs
    for key, dtype in (("value_float", np.float32), ("value_floats", np.float32), ("value_int", np.int64), ("value_ints", np.int64)):
        if key in a:
            return np.asarray(a[key], dtype=dtype)
    if "value" in a:
        return np.asarray(a["value"])
    raise GraphError(f"Constant attribute {sorted(a)} is not supported", node.name)


def fold_node(node: OnnxNode, consts: dict[str, np.ndarray], types) -> tuple | None:
    """Output values of ``node`` when it can be evaluated now, else None."""
    ins = [v for v in node.inputs if v]
    if node.op == "Shape" and types.get(node.inputs[0], (None,))[0] is not None:
        shape = types[node.inputs[0]][0]
        return (np.asarray(shape[node.attrs.get("start", 0):node.attrs.get("end")], dtype=np.int64),)
    if node.op == "Size" and types.get(node.inputs[0], (None,))[0] is not None:
        return (np.asarray(int(np.prod(types[node.inputs[0]][0])), dtype=np.int64),)
    if node.op == "CastLike" and node.inputs[0] in consts and types.get(node.inputs[1]):
        return (consts[node.inputs[0]].astype(types[node.inputs[1]][1]),)
    if not ins or not all(v in consts for v in ins) or node.proto is None:
        return None
    from onnx import helper
    from onnx.reference import ReferenceEvaluator

    # a one-node model: the evaluator ignores ``opsets=`` for a bare NodeProto and would run the newest
    # version of the op (Unsqueeze-13 rejects Unsqueeze-1's axes attribute)
    ins = [v for v in node.proto.input if v]
    graph = helper.make_graph([node.proto], "fold", [helper.make_empty_tensor_value_info(v) for v in dict.fromkeys(ins)],
                              [helper.make_empty_tensor_value_info(v) for v in node.proto.output if v])
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", node.opset)])
    try:
        out = ReferenceEvaluator(proto).run(None, {v: consts[v] for v in ins})
    except Exception as e:
        raise GraphError(f"cannot evaluate constant {node.op} ({type(e).__name__}: {e})", node.name) from None
    return tuple(np.asarray(o) for o in out)


def onnx_dtype(dt) -> int:
    import onnx

    return int(onnx.helper.np_dtype_to_tensor_dtype(np.dtype(dt)))


def literal(a: np.ndarray) -> Any:
    a = np.asarray(a)
    return a.item() if a.ndim == 0 else a.tolist()


def fold_all(nodes: list[OnnxNode], consts: dict[str, np.ndarray], types,
             supports: Callable[[str], bool]) -> tuple[list[OnnxNode], list[str]]:
    """Evaluate constants into ``consts``; return the nodes left to run and the ones ``supports``
    (an engine's predicate on ``onnx.<Op>`` target names) refuses."""

    runtime: list[OnnxNode] = []
    problems: list[str] = []
    queue = list(reversed(nodes))
    while queue:
        n = queue.pop()
        if n.op == "If" and n.domain in ("", "ai.onnx"):
            if n.inputs[0] in consts:  # a condition known at load (exporters test static shapes): inline a branch
                queue.extend(reversed(inline_branch(n, bool(np.asarray(consts[n.inputs[0]]).reshape(-1)[0]), consts)))
            else:  # kept for shape inference, which may make the condition foldable; refused if it stays
                runtime.append(n)
            continue
        if n.op == "Constant" and n.domain in ("", "ai.onnx"):
            consts[n.outputs[0]] = constant_value(n)
            continue
        folded = fold_node(n, consts, types) if n.domain in ("", "ai.onnx") else None
        if folded is not None:
            consts.update(zip(n.outputs, folded))
            continue
        if n.domain not in ("", "ai.onnx") or not supports(f"onnx.{n.op}"):
            dom = f"{n.domain}." if n.domain not in ("", "ai.onnx") else ""
            problems.append(f"node {n.name!r} ({dom}{n.op})")
            continue
        runtime.append(n)
    return runtime, problems


def inline_branch(node: OnnxNode, cond: bool, consts: dict[str, np.ndarray]) -> list[OnnxNode]:
    """The nodes of an If's chosen branch, then Identity nodes from the branch outputs to the If's
    outputs; the branch's initializers become constants. Branch nodes read outer values by name."""
    from onnx import helper, numpy_helper

    branch = node.attrs["then_branch" if cond else "else_branch"]
    for init in branch.initializer:
        consts[init.name] = numpy_helper.to_array(init)
    nodes = normalise_protos(branch.node, node.opset, consts, prefix=f"{node.name}/")
    for i, (src, dst) in enumerate(zip([o.name for o in branch.output], node.outputs)):
        proto = helper.make_node("Identity", [src], [dst], name=f"{node.name}/output_{i}")
        nodes.append(OnnxNode(proto.name, "Identity", "", [src], [dst], {}, proto, node.opset))
    return nodes


def reinfer(path: Path, mp, runtime: list[OnnxNode], consts: dict[str, np.ndarray], inits, train: set[str]):
    """Shape inference on the graph of the runtime nodes with every constant as an initializer."""
    import onnx
    from onnx import helper, numpy_helper

    protos = [n.proto for n in runtime]  # as read (inlined If branches included)
    used = {v for p in protos for v in p.input if v}
    init = [numpy_helper.from_array(np.asarray(consts[v]), v) for v in sorted(used) if v in consts]
    init += [numpy_helper.from_array(np.asarray(inits[v]), v) for v in sorted(used & train)]
    inputs = [i for i in mp.graph.input if i.name not in inits]
    g = helper.make_graph(protos, mp.graph.name or "g", inputs, list(mp.graph.output), init)
    m2 = helper.make_model(g, opset_imports=list(mp.opset_import), ir_version=mp.ir_version)
    try:
        return onnx.shape_inference.infer_shapes(m2, check_type=True, strict_mode=True, data_prop=True)
    except Exception as e:
        raise GraphError(f"{path}: ONNX shape inference failed after folding constants ({type(e).__name__}: {e})") from None
