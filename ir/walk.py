"""One graph walk: run a graph's nodes (or one part's) in order, written once for every runner.

Shape inference (:mod:`fusion.ir.shapes`), the torch engine's interpreted forward and the NumPy
engine's forward all walk the nodes of a graph the same way; :class:`GraphWalk` is that walk, after
``torch.fx.Interpreter``. It owns

- the **environment**: a local node's output under its name, an activation received from another
  part under its ``(producer, index)`` key, so one lookup serves both (:meth:`GraphWalk.env_key`);
- **reference resolution**: ``Ref(node, index)`` (the whole output, or one item of a multi-output
  node), ``ParamRef`` (a graph parameter), literals, and references nested in lists, tuples and
  dicts;
- **what a part sends**: the values of its boundary's sent activations, by key;
- **the summed loss's terms**: the outputs of the loss nodes, in node order;
- **last-use freeing** (after ``torch.fx.Interpreter``'s ``garbage_collect_values``): every value
  leaves the environment right after the last step that reads it (see "What the walk keeps" below);
- **errors that name the node**: a missing placeholder value or received activation is a
  :class:`~fusion.ir.errors.GraphError` naming it; an exception raised while a node runs passes
  through :meth:`GraphWalk.failed`, which by default keeps it and adds a note naming the node (as
  ``torch.fx.Interpreter`` does).

A runner subclasses it and overrides only how a node is called and how values are fetched:

- :meth:`~GraphWalk.call`: the callable for a compute node, made once when the walk is built
  (torch: the op or the node's ``nn.Module``; NumPy: the op's kernel plus its tape; shape
  inference: the op on the meta device). The walk calls it with the resolved arguments and stores
  what it returns as the node's output. Returning None for an OUTPUT node passes its argument through.
- :meth:`~GraphWalk.param`: a graph parameter's value (resolved once into the step's argument template).
- :meth:`~GraphWalk.literals`: the node's arguments before resolution (torch: device literals
  mean the part's device).
- :meth:`~GraphWalk.fetch_placeholder` / :meth:`~GraphWalk.fetch_received`: a fed value or a
  received activation as the runner holds it (a tensor on its device, an array, a meta tensor).
- :meth:`~GraphWalk.failed`: the exception to raise when a node fails.

The per-node work of :meth:`GraphWalk.run` is what the torch engine's loop did before: arguments
without containers are a template with parameters already in place and a list of slots to fill
from the environment, so a node costs a few dict lookups and one call. This module imports no
framework (the NumPy engine must stay torch-free).

What the walk keeps
-------------------
A run's environment holds each value from the step that makes it (or from the start, for a received
activation or a fed placeholder) to the *last step that reads it*; right after that step (and after
``record``) the walk drops its reference (:attr:`Step.drops`, computed once when the walk is built, never
per run). A value no step reads is dropped right after the step that made it. The one exception is a
**value the part sends** (a producer in ``send_keys``): it stays to the end, since :meth:`GraphWalk.run`
returns it. Dropping the walk's reference frees a value only when nobody else holds it, so what a runner
keeps for later it keeps itself, outside the environment, and the walk need not know it:

- the **loss terms** are in the list :meth:`~GraphWalk.run` returns;
- **received activations and fed values** stay in the runner's own dicts (``leaves`` and ``fed`` are
  copied into the environment, never changed): the torch engine keeps ``leaves`` in its stash for the
  input gradients and, with recomputation, ``fed`` for the second forward;
- **what backward needs**: torch autograd's saved tensors, the NumPy engine's tape (each op's context);
- **sent activations encoded on the device** (compressed edges) are sent values, so kept to the end;
- **parameters** live in the step templates, never in the environment;
- ``record`` gets every output as it is made and keeps what it wants.

``free_values = False`` (on the class or one walk) keeps every value until the run returns, as the walk
did before; ``benchmarks/bench_walk_memory.py`` compares the two.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from fusion.ir.boundary import SubGraph
from fusion.ir.errors import GraphError
from fusion.ir.graph import OpGraph
from fusion.ir.node import PLACEHOLDER_KINDS, NodeKind, OpNode, ParamRef, Ref, map_refs

#: a value's address between parts: ``(producer node, output index or None for the whole output)``
Key = tuple[str, "int | None"]


@dataclass
class Step:
    """One node, prepared for the walk.

    node:     the graph's node.
    fn:       what :meth:`GraphWalk.call` returned: called as ``fn(*args, **kwargs)`` with the
              resolved arguments; None for a placeholder, and for an OUTPUT node whose argument
              passes through.
    args / kwargs: argument templates: literals (after :meth:`GraphWalk.literals`) and, when ``fast``,
              parameters already fetched.
    fast:     the arguments hold no list, tuple or dict: only ``arg_refs`` / ``kw_refs`` are filled
              per run; otherwise every reference is resolved per run through the nested containers.
    arg_refs / kw_refs: ``(slot, env key, index)`` of each top-level Ref (``fast`` steps).
    name, kind: the node's; placeholder / output / loss: whether it is an input or label node, the
              output marker, a loss node (its output is one term of the part's summed loss).
    drops:    environment keys whose last reader is this step (or, for its own output, nobody): the
              walk drops them right after the step runs (:func:`last_uses`; module docstring, "What the
              walk keeps").
    """

    node: OpNode
    fn: Callable[..., Any] | None
    args: tuple
    kwargs: dict
    fast: bool
    arg_refs: tuple = ()
    kw_refs: tuple = ()
    drops: tuple = ()
    name: str = field(init=False)
    kind: NodeKind = field(init=False)
    placeholder: bool = field(init=False)
    output: bool = field(init=False)
    loss: bool = field(init=False)

    def __post_init__(self) -> None:
        kind = self.node.kind
        self.name, self.kind = self.node.name, kind
        self.placeholder = kind in PLACEHOLDER_KINDS
        self.output = kind == NodeKind.OUTPUT
        self.loss = kind == NodeKind.LOSS


class GraphWalk:
    """The nodes of ``graph`` (all of them in topological order, or the part ``sub``), ready to run.

    recv_keys: activations the part receives from other parts -> whether any receiver needs their gradient.
    send_keys: activations the part sends to other parts, in boundary order.
    placeholders: names of the input/label nodes the walk is fed, in node order.
    """

    #: the message of the error naming a placeholder that :meth:`feed` got no value for
    missing_feed = "no data fed to this placeholder"
    #: drop each value from the environment after its last reader (:attr:`Step.drops`); False keeps every
    #: value until :meth:`run` returns (the walk before last-use freeing: benchmarks compare the two)
    free_values: bool = True

    def __init__(self, graph: OpGraph, sub: SubGraph | None = None):
        self.graph = graph
        names = list(sub.nodes) if sub is not None else graph.topo_order()
        self._local = frozenset(names)
        self.recv_keys: dict[Key, bool] = {}
        self.send_keys: list[Key] = []
        if sub is not None:
            for e in sub.boundary.required_acts:
                self.recv_keys[e.key] = self.recv_keys.get(e.key, False) or e.requires_grad
            self.send_keys = list(dict.fromkeys(e.key for e in sub.boundary.sent_acts))
        self.steps: list[Step] = [self._prepare(graph[n]) for n in names]
        for step, drops in zip(self.steps, last_uses(self.steps, self.env_key, {k[0] for k in self.send_keys})):
            step.drops = drops
        self.placeholders: tuple[str, ...] = tuple(s.name for s in self.steps if s.placeholder)

    # -- hooks: what a runner overrides -------------------------------------------------
    def call(self, node: OpNode) -> Callable[..., Any] | None:
        """The callable that computes ``node``'s output from its resolved arguments (None for an OUTPUT
        node: its first argument passes through). Called once per node when the walk is built."""
        if node.kind == NodeKind.OUTPUT:
            return None
        raise NotImplementedError(f"{type(self).__name__} does not say how to call node {node.name!r}")

    def param(self, name: str) -> Any:
        """The value of graph parameter ``name``."""
        raise NotImplementedError(f"{type(self).__name__} does not say how to fetch parameter {name!r}")

    def literals(self, node: OpNode) -> tuple[tuple, dict]:
        """``node``'s ``(args, kwargs)`` before references are resolved."""
        return node.args, dict(node.kwargs)

    def fetch_placeholder(self, name: str, value: Any) -> Any:
        """The value the walk uses for placeholder ``name`` fed ``value``."""
        return value

    def fetch_received(self, key: Key, value: Any, needs_grad: bool) -> Any:
        """The value the walk uses for activation ``key`` received from another part (``needs_grad``:
        some node of another part needs its gradient)."""
        return value

    def failed(self, step: Step, error: Exception) -> Exception:
        """The exception to raise when running ``step`` raised ``error``. A :class:`GraphError` (it names
        its node) is kept; any other keeps its type and gets a note naming the node."""
        if not isinstance(error, GraphError):
            error.add_note(f"while running node {step.name!r} ({step.node.target or step.kind.value})")
        return error

    # -- building ----------------------------------------------------------------------
    def env_key(self, r: Ref) -> tuple[Any, int | None]:
        """Where a Ref's value lives in the environment: ``(name, index)`` for a local output,
        ``((producer, index), None)`` for an activation received from another part."""
        return (r.node, r.index) if r.node in self._local else ((r.node, r.index), None)

    def _prepare(self, node: OpNode) -> Step:
        if node.kind in PLACEHOLDER_KINDS:
            return Step(node, None, (), {}, True)
        fn = self.call(node)
        args, kwargs = self.literals(node)
        fast = all(not isinstance(a, (list, tuple, dict)) for a in args) and \
            all(not isinstance(v, (list, tuple, dict)) for v in kwargs.values())
        if not fast:
            return Step(node, fn, tuple(args), kwargs, False)
        targs, arg_refs, kw_refs = list(args), [], []
        for i, a in enumerate(args):  # parameters now, slots for the values computed per run
            if isinstance(a, ParamRef):
                targs[i] = self.param(a.name)
            elif isinstance(a, Ref):
                arg_refs.append((i, *self.env_key(a)))
        for k, v in kwargs.items():
            if isinstance(v, ParamRef):
                kwargs[k] = self.param(v.name)
            elif isinstance(v, Ref):
                kw_refs.append((k, *self.env_key(v)))
        return Step(node, fn, tuple(targs), kwargs, True, tuple(arg_refs), tuple(kw_refs))

    # -- running -----------------------------------------------------------------------
    def feed(self, feeds: Mapping[str, Any]) -> dict[str, Any]:
        """The placeholders' values (:meth:`fetch_placeholder`), by name; a missing one is an error naming it."""
        fed: dict[str, Any] = {}
        for name in self.placeholders:
            if name not in feeds:
                raise GraphError(self.missing_feed, name)
            fed[name] = self.fetch_placeholder(name, feeds[name])
        return fed

    def receive(self, inputs: Mapping[Key, Any]) -> dict[Key, Any]:
        """The received activations (:meth:`fetch_received`), by key; a missing one is an error naming its producer."""
        leaves: dict[Key, Any] = {}
        for key, needs_grad in self.recv_keys.items():
            if key not in inputs:
                raise GraphError(f"missing activation {key} from another part", key[0])
            leaves[key] = self.fetch_received(key, inputs[key], needs_grad)
        return leaves

    def run(self, leaves: Mapping[Key, Any], fed: Mapping[str, Any],
            record: Callable[[str, Any], None] | None = None) -> tuple[dict[Key, Any], list]:
        """Run every node once: ``leaves`` from :meth:`receive`, ``fed`` from :meth:`feed`; ``record`` is
        called with every node's name and output. Returns the values to send, by key (``send_keys``),
        and the outputs of the loss nodes in node order."""
        env: dict[Any, Any] = dict(leaves)
        get = None
        losses: list = []
        free = self.free_values
        s = None
        try:
            for s in self.steps:
                if s.placeholder:
                    out = fed[s.name]
                else:
                    if s.fast:
                        args = s.args
                        if s.arg_refs:
                            args = list(args)
                            for i, key, idx in s.arg_refs:
                                v = env[key]
                                args[i] = v if idx is None else v[idx]
                        kwargs = s.kwargs
                        if s.kw_refs:
                            kwargs = dict(kwargs)
                            for k, key, idx in s.kw_refs:
                                v = env[key]
                                kwargs[k] = v if idx is None else v[idx]
                    else:
                        if get is None:
                            get = self.resolver(env)
                        args = map_refs(s.args, get)
                        kwargs = map_refs(s.kwargs, get)
                    fn = s.fn
                    if fn is None:
                        out = args[0]
                    else:
                        out = fn(*args, **kwargs)
                        if s.loss:
                            losses.append(out)
                    args = kwargs = v = None  # the loop's own references to the step's inputs
                env[s.name] = out
                if record is not None:
                    record(s.name, out)
                if free and s.drops:
                    for key in s.drops:
                        del env[key]
                out = None
        except Exception as e:
            err = self.failed(s, e)
            if err is e:
                raise
            raise err from None
        sent = {}
        for key in self.send_keys:
            v = env[key[0]]
            sent[key] = v if key[1] is None else v[key[1]]
        return sent, losses

    def resolver(self, env: Mapping[Any, Any]) -> Callable[[Ref | ParamRef], Any]:
        """Ref/ParamRef -> its value in ``env`` (the environment of one run)."""
        param, env_key = self.param, self.env_key

        def get(r):
            if isinstance(r, ParamRef):
                return param(r.name)
            key, idx = env_key(r)
            v = env[key]
            return v if idx is None else v[idx]

        return get


def last_uses(steps: list[Step], env_key: Callable[[Ref], tuple[Any, int | None]],
              keep: set | frozenset = frozenset()) -> list[tuple]:
    """For each step, the environment keys to drop right after it runs (``torch.fx``'s ``user_to_last_uses``).

    A key read by some step goes with the last step that reads it (a Ref anywhere in the step's argument
    templates, nested ones included; ``env_key`` says where the Ref's value lives); a step's own output
    that no step reads goes with that step. Keys in ``keep`` (the producers of sent values) are never dropped.
    """
    last: dict[Any, int] = {}
    for i, step in enumerate(steps):
        last[step.name] = i  # read by nobody (yet): dropped right after it is made
        if step.fast:
            reads = [key for _, key, _ in step.arg_refs + step.kw_refs]
        else:
            reads = [env_key(r)[0] for r in _refs((step.args, step.kwargs))]
        for key in reads:
            last[key] = i
    drops: list[list] = [[] for _ in steps]
    for key, i in last.items():
        if key not in keep:
            drops[i].append(key)
    return [tuple(d) for d in drops]


def _refs(value: Any) -> list[Ref]:
    """Every Ref in ``value``, nested in tuples, lists and dict values."""
    out: list[Ref] = []
    map_refs(value, lambda r: out.append(r) if isinstance(r, Ref) else None)
    return out


__all__ = ["GraphWalk", "Key", "Step", "last_uses"]
