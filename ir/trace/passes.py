"""Clean-up passes the tracer runs on a freshly traced graph.

Each pass is a function over an :class:`OpGraph`, in the order
:func:`fusion.ir.trace.trace` applies them:

1. :func:`functionalize`: rewrite in-place ops (``x.add_(y)``, ``x += y``,
   ``inplace=True``) out of place, or refuse them when the mutation is observable.
2. :func:`mark_outputs`: turn forward's return value into a LOSS node and OUTPUT nodes.
3. :func:`fold_static_values`: replace ints/shapes computed from static shapes
   (``x.size(1)``, ``C // n_head``) by literals; shapes are fixed by the example.
4. :func:`index_multi_outputs`: ``getitem(split, 1)`` becomes ``Ref(split, 1)``,
   so a tuple output never crosses a part boundary whole.
5. :func:`eliminate_dead`: drop nodes and parameters nothing depends on.
"""
from __future__ import annotations

import logging
import re
from typing import Any

from fusion.ir.errors import GraphError
from fusion.ir.graph import OpGraph
from fusion.ir.node import NodeKind, OpNode, ParamRef, Ref, TensorMeta, ValueMeta, map_refs
from fusion.ir.registry import REGISTRY, OpRegistry

log = logging.getLogger(__name__)

_COMPUTE = (NodeKind.FUNCTION, NodeKind.MODULE)
_INPLACE_OPERATORS = {f"operator.i{n}": f"operator.{n}" for n in
                      ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "and_", "or_", "xor", "lshift",
                       "rshift", "matmul")}
_VIEW_OPS = {"view", "reshape", "transpose", "permute", "getitem", "split", "chunk", "unsqueeze", "squeeze", "expand",
             "narrow", "select", "t", "flatten", "unflatten", "as_strided", "contiguous", "detach", "view_as",
             "unbind", "slice", "alias", "_unsafe_view", "diagonal", "movedim", "swapaxes", "expand_as"}


def _op_name(target: str) -> str:
    """``torch.Tensor.add_`` -> ``add_``; ``aten.add_.Tensor`` -> ``add_``; ``operator.iadd`` -> ``iadd``."""
    if target.startswith("aten."):
        return target.split(".")[1]
    return target.rsplit(".", 1)[-1]


def _out_of_place(node: OpNode, registry: OpRegistry) -> str | None:
    """The out-of-place target of an in-place FUNCTION node, '' when not in place, None when unknown."""
    t = node.target
    if t in _INPLACE_OPERATORS:
        return _INPLACE_OPERATORS[t]
    name = _op_name(t)
    if not name.endswith("_") or name.endswith("__") or t.startswith("operator."):
        return ""
    if t.startswith("aten."):
        parts = t.split(".")
        new = ".".join([parts[0], parts[1][:-1], *parts[2:]])
    else:
        new = t[:-1]
    return new if registry.resolve(new) is not None else None


def functionalize(g: OpGraph, registry: OpRegistry = REGISTRY) -> None:
    """Rewrite in-place ops out of place, keeping what every node reads.

    The graph must still be in program order (straight from a front end).
    ``h.add_(1)`` becomes ``add(h, 1)`` and the nodes that read ``h`` after it
    read the new node instead (an in-place op returns the tensor it changed).
    Mutating a trainable parameter, or a value that a view aliases (so the
    change would show through another name), is an error naming the node. A
    buffer update (a counter, running statistics) is dropped with a warning.
    """
    order = {n: i for i, n in enumerate(g.nodes)}
    users = g.users()
    for node in list(g.nodes.values()):
        if node.kind == NodeKind.MODULE:
            if node.attrs.get("inplace") is True:
                users = _redirect_readers(g, node, users, order)
                node.attrs["inplace"] = False
            continue
        if node.kind != NodeKind.FUNCTION:
            continue
        new = _out_of_place(node, registry)
        inplace_kw = node.kwargs.get("inplace") is True
        if new == "" and not inplace_kw:
            continue
        if new is None:
            raise GraphError(f"in-place op {node.target} has no out-of-place form; write it out of place", node.name)
        users = _redirect_readers(g, node, users, order)
        if new:
            node.target = new
        if inplace_kw:
            node.kwargs["inplace"] = False


def _is_view(node: OpNode) -> bool:
    return node.kind == NodeKind.FUNCTION and _op_name(node.target).rstrip("_") in _VIEW_OPS


def _redirect_readers(g: OpGraph, node: OpNode, users: dict[str, list[str]], order: dict[str, int]) -> dict[str, list[str]]:
    """Point later readers of the value ``node`` mutates at ``node``; returns the updated users map."""
    first = node.args[0] if node.args else None
    if isinstance(first, ParamRef):
        _check_param_mutation(g, node, first)
        return users
    if not isinstance(first, Ref):
        return users
    here = order[node.name]
    producer = g.nodes[first.node]
    later = [u for u in users[first.node] if order[u] > here]
    if _is_view(producer):  # the change shows through the base and its other views: refuse if anyone looks
        base = producer.args[0] if producer.args else None
        if isinstance(base, ParamRef):
            _check_param_mutation(g, node, base)
        if later or (isinstance(base, Ref) and any(order[u] > here for u in users[base.node])):
            raise GraphError(f"in-place op {node.target} changes view {first.node!r} of a value read later; "
                             "write it out of place", node.name)
        return users
    for alias in users[first.node]:
        if order[alias] < here and _is_view(g.nodes[alias]) and any(order[u] > here for u in users[alias]):
            raise GraphError(f"in-place op {node.target} changes {first.node!r}, which view {alias!r} shows to a "
                             "later node; write it out of place", node.name)
    if not later:
        return users
    new_ref = Ref(node.name)
    for u in later:
        reader = g.nodes[u]
        fn = lambda r: new_ref if r == first else r  # noqa: E731
        reader.args, reader.kwargs = map_refs(reader.args, fn), map_refs(reader.kwargs, fn)
    return g.users()


def _check_param_mutation(g: OpGraph, node: OpNode, ref: ParamRef) -> None:
    if g.params[ref.name].trainable:
        raise GraphError(f"modifies trainable parameter {ref.name!r} in place", node.name)
    log.warning("node %s updates buffer %s in place; fusion does not replay buffer updates", node.name, ref.name)


def detach_no_grad(g: OpGraph, no_grad: set[str], returned: Any) -> tuple[int, Any]:
    """Detach every grad-carrying tensor that leaves a no-grad region (after shapes are known).

    ``no_grad`` names the nodes computed with grad mode off. A tensor output of
    such a node that would carry a gradient and is read by a node outside the
    region (or returned) gets a ``torch.Tensor.detach`` node right after its
    producer, and the outside readers read that instead: what PyTorch's
    ``torch.no_grad()`` means for them. Returns (detach nodes added, the
    returned value with its references redirected); shapes must be inferred
    again afterwards (requires_grad changes downstream).
    """
    repl: dict[Ref, Ref] = {}
    added: dict[str, list[OpNode]] = {}
    users = g.users()
    returned_refs = set(_refs_in(returned))
    for name in [n for n in g.nodes if n in no_grad]:
        node = g.nodes[name]
        outside = [u for u in users[name] if u not in no_grad]
        for i, o in enumerate(node.meta.outputs):
            if not (isinstance(o, TensorMeta) and o.requires_grad):
                continue
            ref = Ref(name, i if node.meta.multi else None)
            read = any(ref in set(g.nodes[u].refs()) for u in outside) or ref in returned_refs
            if not read:
                continue
            new = OpNode(f"{name}_detached" + (f"_{i}" if node.meta.multi else ""), NodeKind.FUNCTION,
                         "torch.Tensor.detach", (ref,), label="no_grad region output")
            new.meta.outputs = (TensorMeta(o.shape, o.dtype, False),)
            added.setdefault(name, []).append(new)
            repl[ref] = Ref(new.name)
    if not repl:
        return 0, returned
    nodes = {}
    for name, node in g.nodes.items():
        if name not in no_grad:
            node.args = map_refs(node.args, lambda r: repl.get(r, r))
            node.kwargs = map_refs(node.kwargs, lambda r: repl.get(r, r))
        nodes[name] = node
        for new in added.get(name, []):
            if new.name in g.nodes:
                raise GraphError(f"node name {new.name!r} is taken", new.name)
            nodes[new.name] = new
    g.nodes = nodes
    from torch.utils import _pytree as pytree

    returned = pytree.tree_map(lambda v: repl.get(v, v) if isinstance(v, Ref) else v, returned)
    return len(repl), returned


def _refs_in(value: Any):
    if isinstance(value, Ref):
        yield value
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _refs_in(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from _refs_in(v)


def _identifier(path: str) -> str:
    return re.sub(r"[^0-9A-Za-z_]+", "_", path).strip("_")


def _is_scalar_loss(g: OpGraph, ref: Ref) -> bool:
    outs = g[ref.node].meta.outputs
    i = ref.index or 0
    if i >= len(outs) or not isinstance(outs[i], TensorMeta):
        return False
    o = outs[i]
    return o.shape == () and o.dtype.startswith(("float", "bfloat"))


def mark_outputs(g: OpGraph, returned: Any, loss_index: int | str | None, keep_outputs: bool = True) -> str | None:
    """Make forward's loss a LOSS node and its other tensors OUTPUT nodes.

    With ``loss_index=None`` a single scalar floating-point return value is
    the loss; anything else is inference-only (OUTPUT nodes). With
    ``loss_index`` set, forward must return a tuple, list or dict: element
    ``loss_index`` (a position, or a key for dicts) is the loss and the other
    tensors become OUTPUT nodes unless ``keep_outputs`` is False.
    Returns the loss node's name (None for inference graphs).
    """
    loss, others = None, returned
    if loss_index is None:
        if isinstance(returned, Ref) and _is_scalar_loss(g, returned):
            loss, others = returned, None
    elif isinstance(returned, (tuple, list)):
        if not isinstance(loss_index, int) or not -len(returned) <= loss_index < len(returned):
            raise GraphError(f"loss_index {loss_index!r} is out of range: forward returns {len(returned)} values")
        i = loss_index % len(returned)
        loss, others = returned[i], [v for j, v in enumerate(returned) if j != i]
    elif isinstance(returned, dict):
        keys = list(returned)
        key = loss_index if isinstance(loss_index, str) else (keys[loss_index] if -len(keys) <= loss_index < len(keys) else None)
        if key not in returned:
            raise GraphError(f"loss_index {loss_index!r} names no output: forward returns keys {keys}")
        loss, others = returned[key], {k: v for k, v in returned.items() if k != key}
    else:
        raise GraphError(f"loss_index={loss_index!r} given but forward returns a single value, not a tuple, list or dict")
    if loss is not None:
        if not isinstance(loss, Ref) or loss.index is not None:
            raise GraphError(f"the loss must be a tensor computed by the model, got {loss!r}")
        node = g[loss.node]
        if node.kind not in _COMPUTE:
            raise GraphError(f"the loss is a {node.kind.value} node; it must be computed by the model", node.name)
        if not _is_scalar_loss(g, loss):
            raise GraphError(f"the loss must be a floating-point scalar, got {node.meta.outputs}", node.name)
        node.kind = NodeKind.LOSS
    if loss is not None and not keep_outputs:
        others = None
    from torch.utils import _pytree as pytree

    leaves = pytree.tree_flatten_with_path(others)[0] if others is not None else []
    single = isinstance(others, Ref)
    for path, value in leaves:
        if not isinstance(value, Ref):
            log.info("forward returns the constant %r at %s; it is not part of the graph", value, pytree.keystr(path))
            continue
        base = "output" if single else "output_" + (_identifier(pytree.keystr(path)) or "0")
        name, k = base, 1
        while name in g.nodes:
            name, k = f"{base}_{k}", k + 1
        out = g.add(OpNode(name, NodeKind.OUTPUT, args=(value,)))
        src = g[value.node].meta
        out.meta.outputs = src.outputs if value.index is None else (src.outputs[value.index],)
        out.meta.multi = src.multi and value.index is None
    if loss is None and not any(n.kind == NodeKind.OUTPUT for n in g):
        raise GraphError("forward returns no tensor: nothing to train or output")
    return loss.node if loss is not None else None


def _static(v: Any) -> bool:
    import torch

    if isinstance(v, (bool, int, float, str, type(None), torch.device, torch.dtype)):
        return True
    return isinstance(v, (tuple, list)) and all(_static(x) for x in v)


def _replace_refs(g: OpGraph, fn) -> None:
    for node in g.nodes.values():
        node.args = map_refs(node.args, fn)
        node.kwargs = map_refs(node.kwargs, fn)


def fold_static_values(g: OpGraph) -> int:
    """Replace every use of a non-tensor FUNCTION output (an int, a shape) by its value.

    Shapes are static (fixed by the example micro-batch), so ``B, T, C =
    x.size()`` and the arithmetic on them are constants. ``x.device`` folds to
    a device literal, which the engine reads as "this part's device". Returns
    the number of nodes folded; they lose all users and :func:`eliminate_dead`
    drops them.
    """
    import torch

    folded: dict[str, Any] = {}
    for node in g.nodes.values():
        outs = node.meta.outputs
        if node.kind == NodeKind.FUNCTION and len(outs) == 1 and isinstance(outs[0], ValueMeta) and _static(outs[0].value):
            v = outs[0].value
            folded[node.name] = torch.device("cpu") if isinstance(v, torch.device) else v  # any device literal reads as "this part's"

    def fn(r):
        if isinstance(r, Ref) and r.node in folded:
            v = folded[r.node]
            return v if r.index is None else v[r.index]
        return r

    _replace_refs(g, fn)
    return len(folded)


def index_multi_outputs(g: OpGraph) -> int:
    """Replace ``operator.getitem(node, i)`` on a multi-output node by ``Ref(node, i)``."""
    repl: dict[str, Ref] = {}
    for node in g.nodes.values():
        if node.kind != NodeKind.FUNCTION or node.target != "operator.getitem" or node.kwargs or len(node.args) != 2:
            continue
        src, i = node.args
        if not isinstance(src, Ref) or src.index is not None or isinstance(i, bool) or not isinstance(i, int):
            continue
        prod = g[src.node]
        n = len(prod.meta.outputs)
        if prod.meta.multi and -n <= i < n:
            repl[node.name] = Ref(prod.name, i % n)
    if any(r.node in repl and r.index is not None for n in g.nodes.values() for r in n.refs()):
        repl = {k: v for k, v in repl.items()
                if not any(r.node == k and r.index is not None for n in g.nodes.values() for r in n.refs())}
    _replace_refs(g, lambda r: repl.get(r.node, r) if isinstance(r, Ref) and r.index is None else r)
    return len(repl)


def eliminate_dead(g: OpGraph) -> int:
    """Drop compute nodes no LOSS/OUTPUT depends on, and parameters no node reads.

    Placeholders stay (the data loader feeds them). Returns the number of nodes dropped.
    """
    live: set[str] = set()
    stack = [n.name for n in g.nodes.values() if n.kind in (NodeKind.LOSS, NodeKind.OUTPUT)]
    while stack:
        name = stack.pop()
        if name in live:
            continue
        live.add(name)
        stack.extend(g.nodes[name].producers())
    dead = [n for n, node in g.nodes.items() if n not in live and node.kind in _COMPUTE]
    for n in dead:
        del g.nodes[n]
    used = {p for node in g.nodes.values() for p in node.param_names()}
    for p in [p for p in g.params if p not in used]:
        del g.params[p]
    return len(dead)
