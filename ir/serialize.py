"""OpGraph <-> plain data (JSON / msgpack), without pickle.

Values that JSON cannot carry are tagged one-key objects: ``{"$ref": [node,
index]}``, ``{"$param": name}``, ``{"$tuple": [...]}``, ``{"$slice": [start,
stop, step]}``, ``{"$ellipsis": 1}``, ``{"$dtype": "float32"}``, ``{"$float":
"inf"}``, ``{"$device": "cpu"}``, ``{"$memfmt": "contiguous_format"}``,
``{"$layout": "strided"}``, ``{"$complex": [re, im]}``. Symbolic ints, floats
and bools (``torch.SymInt``) are saved as their value when it is fixed (static
shapes), and refused otherwise. Anything else is rejected with the node named,
so a graph either round-trips exactly or fails to save.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from fusion.ir.errors import GraphError
from fusion.ir.graph import OpGraph, ParamSpec
from fusion.ir.node import NodeKind, NodeMeta, OpNode, ParamRef, Ref, TensorMeta, ValueMeta

FORMAT_VERSION = 1


def encode_value(v: Any, where: str = "") -> Any:
    """Encode one argument value as JSON-able data."""
    if isinstance(v, Ref):
        return {"$ref": [v.node, v.index]}
    if isinstance(v, ParamRef):
        return {"$param": v.name}
    if isinstance(v, bool) or v is None or isinstance(v, (int, str)):
        return v
    if isinstance(v, float):
        return v if math.isfinite(v) else {"$float": repr(v)}
    if isinstance(v, complex):
        return {"$complex": [encode_value(v.real, where), encode_value(v.imag, where)]}
    if isinstance(v, tuple):
        return {"$tuple": [encode_value(x, where) for x in v]}
    if isinstance(v, list):
        return [encode_value(x, where) for x in v]
    if isinstance(v, dict):
        if not all(isinstance(k, str) for k in v):
            raise GraphError(f"dict argument with non-string keys cannot be saved: {v!r}", where or None)
        return {k if not k.startswith("$") else "$$" + k: encode_value(x, where) for k, x in v.items()}
    if isinstance(v, slice):
        return {"$slice": [encode_value(v.start, where), encode_value(v.stop, where), encode_value(v.step, where)]}
    if v is Ellipsis:
        return {"$ellipsis": 1}
    mod = type(v).__module__
    if mod.startswith("torch"):
        import torch

        if isinstance(v, torch.dtype):
            return {"$dtype": str(v).removeprefix("torch.")}
        if isinstance(v, torch.device):
            return {"$device": str(v)}
        if isinstance(v, torch.Size):
            return {"$tuple": [int(x) for x in v]}
        if isinstance(v, torch.memory_format):
            return {"$memfmt": str(v).removeprefix("torch.")}
        if isinstance(v, torch.layout):
            return {"$layout": str(v).removeprefix("torch.")}
        if isinstance(v, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            fixed = static_symbol(v)
            if fixed is None:
                raise GraphError(f"symbolic value {v!r} depends on an input size; fusion graphs have static shapes",
                                 where or None)
            return encode_value(fixed, where)
    raise GraphError(f"argument of type {type(v).__name__} cannot be saved: {v!r}", where or None)


def static_symbol(v: Any) -> Any:
    """The fixed Python value of a ``torch.SymInt`` / ``SymFloat`` / ``SymBool``, or None when it is symbolic."""
    node = getattr(v, "node", None)
    if node is not None and getattr(node, "is_constant", lambda: False)():
        return node.constant
    try:
        expr = node._expr if hasattr(node, "_expr") else node.expr
    except Exception:  # noqa: BLE001 - not a SymNode
        expr = None
    if isinstance(expr, (bool, int, float)):
        return expr
    if getattr(expr, "is_number", False):
        return {int: int, float: float, bool: bool}.get(getattr(node, "pytype", int), int)(expr)
    for attr in ("maybe_as_int", "maybe_as_float", "maybe_as_bool"):
        fn = getattr(node, attr, None)
        try:
            got = fn() if fn is not None else None
        except Exception:  # noqa: BLE001 - not that kind of symbol
            got = None
        if got is not None:
            return got
    return None


def decode_value(v: Any) -> Any:
    if isinstance(v, list):
        return [decode_value(x) for x in v]
    if not isinstance(v, dict):
        return v
    if len(v) == 1:
        (k, x), = v.items()
        if k == "$ref":
            if not (isinstance(x, list) and len(x) == 2 and isinstance(x[0], str)
                    and (x[1] is None or (isinstance(x[1], int) and not isinstance(x[1], bool)))):
                raise ValueError(f"$ref must be [node name, index or null], got {x!r}")
            return Ref(x[0], x[1])
        if k == "$param":
            if not isinstance(x, str):
                raise ValueError(f"$param must be a parameter name, got {x!r}")
            return ParamRef(x)
        if k == "$tuple":
            if not isinstance(x, list):
                raise ValueError(f"$tuple must be a list, got {x!r}")
            return tuple(decode_value(y) for y in x)
        if k == "$slice":
            if not (isinstance(x, list) and len(x) == 3):
                raise ValueError(f"$slice must be [start, stop, step], got {x!r}")
            return slice(*(decode_value(y) for y in x))
        if k == "$ellipsis":
            return Ellipsis
        if k == "$float":
            return float(x)
        if k == "$complex":
            if not (isinstance(x, list) and len(x) == 2):
                raise ValueError(f"$complex must be [real, imag], got {x!r}")
            return complex(decode_value(x[0]), decode_value(x[1]))
        if k in ("$dtype", "$device", "$memfmt", "$layout"):
            import torch

            if k == "$device":
                return torch.device(x)
            obj = getattr(torch, x, None)
            want = {"$dtype": torch.dtype, "$memfmt": torch.memory_format, "$layout": torch.layout}[k]
            if not isinstance(obj, want):
                raise GraphError(f"unknown {k[1:]} {x!r}")
            return obj
    return {(k[2:] if k.startswith("$$") else k): decode_value(x) for k, x in v.items()}


def _meta_to_dict(m: NodeMeta) -> dict:
    outs = []
    for o in m.outputs:
        if isinstance(o, TensorMeta):
            outs.append({"shape": list(o.shape), "dtype": o.dtype, "requires_grad": o.requires_grad})
        else:
            outs.append({"value": encode_value(o.value)})
    return {
        "outputs": outs, "multi": m.multi, "flops_fwd": m.flops_fwd, "flops_bwd": m.flops_bwd,
        "mem_bytes_fwd": m.mem_bytes_fwd, "param_bytes": m.param_bytes,
    }


def _meta_from_dict(d: dict) -> NodeMeta:
    outs = []
    for o in d.get("outputs", []):
        if "value" in o:
            outs.append(ValueMeta(decode_value(o["value"])))
        else:
            outs.append(TensorMeta(tuple(int(s) for s in o["shape"]), str(o["dtype"]), bool(o.get("requires_grad", False))))
    return NodeMeta(
        outputs=tuple(outs), multi=bool(d.get("multi", False)),
        flops_fwd=float(d.get("flops_fwd", 0.0)), flops_bwd=float(d.get("flops_bwd", 0.0)),
        mem_bytes_fwd=float(d.get("mem_bytes_fwd", 0.0)), param_bytes=int(d.get("param_bytes", 0)),
    )


def graph_to_dict(g: OpGraph) -> dict:
    nodes = []
    for n in g.nodes.values():
        nodes.append({
            "name": n.name, "kind": n.kind.value, "target": n.target,
            "args": [encode_value(a, n.name) for a in n.args],
            "kwargs": {k: encode_value(v, n.name) for k, v in n.kwargs.items()},
            "attrs": {k: encode_value(v, n.name) for k, v in n.attrs.items()},
            "params": dict(n.params), "label": n.label, "meta": _meta_to_dict(n.meta),
        })
    params = [{"name": p.name, "shape": list(p.shape), "dtype": p.dtype, "trainable": p.trainable} for p in g.params.values()]
    return {"format": "fusion.opgraph", "version": FORMAT_VERSION, "nodes": nodes, "params": params, "plugins": list(g.plugins)}


def graph_from_dict(d: Any, source: str = "graph") -> OpGraph:
    """Rebuild a graph; errors name ``source`` and the field or node at fault."""
    if not isinstance(d, dict) or d.get("format") != "fusion.opgraph":
        raise GraphError(f"{source}: not a fusion OpGraph (field 'format' must be 'fusion.opgraph')")
    if d.get("version") != FORMAT_VERSION:
        raise GraphError(f"{source}: unsupported OpGraph version {d.get('version')!r} (this fusion reads {FORMAT_VERSION})")
    g = OpGraph(plugins=[str(p) for p in d.get("plugins", [])])
    for i, p in enumerate(d.get("params", [])):
        try:
            g.add_param(ParamSpec(str(p["name"]), tuple(int(s) for s in p["shape"]), str(p.get("dtype", "float32")), bool(p.get("trainable", True))))
        except (KeyError, TypeError, ValueError) as e:
            raise GraphError(f"{source}: params[{i}] is malformed ({e!r})") from None
    for i, nd in enumerate(d.get("nodes", [])):
        try:
            kind = NodeKind(nd["kind"])
            node = OpNode(
                name=str(nd["name"]), kind=kind, target=str(nd.get("target", "")),
                args=tuple(decode_value(a) for a in nd.get("args", [])),
                kwargs={k: decode_value(v) for k, v in nd.get("kwargs", {}).items()},
                attrs={k: decode_value(v) for k, v in nd.get("attrs", {}).items()},
                params={str(k): str(v) for k, v in nd.get("params", {}).items()},
                label=str(nd.get("label", "")), meta=_meta_from_dict(nd.get("meta", {})),
            )
        except (KeyError, TypeError, ValueError, IndexError, AttributeError, GraphError) as e:
            name = nd.get("name", f"#{i}") if isinstance(nd, dict) else f"#{i}"
            raise GraphError(f"{source}: nodes[{i}] ({name}) is malformed ({e!r})") from None
        if node.name in g.nodes:
            raise GraphError(f"{source}: nodes[{i}] ({node.name}) repeats the node name", node.name)
        g.add(node)
    return g


def copy_graph(g: OpGraph) -> OpGraph:
    """An independent copy of ``g``, made by the round trip through plain data: what a saved plan would hold
    (a graph that cannot be saved cannot be copied either; the error names the node)."""
    return graph_from_dict(graph_to_dict(g))


def save_graph(g: OpGraph, path: str | Path) -> None:
    Path(path).write_text(json.dumps(graph_to_dict(g), indent=1))


def load_graph(path: str | Path) -> OpGraph:
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise GraphError(f"{path}: cannot read graph ({e})") from None
    g = graph_from_dict(data, str(path))
    try:
        return g.validate()
    except GraphError as e:  # name the file as well as the node
        err = GraphError(f"{path}: {e}")
        err.node = e.node
        raise err from None
