"""Last-use freeing in the graph walk (fusion.ir.walk): a value leaves the environment right after its
last reader; what the part sends stays; what the runner keeps (fed values, received activations, the
loss terms, whatever ``record`` or autograd holds) is the runner's and outlives the walk's reference.

Liveness is observed with weak references: each op, when called, notes which earlier outputs are still
alive, so the checks see the environment as the next node sees it. ``free_values = False`` (the walk
before last-use freeing) keeps them all; that the same checks then fail shows that they can.
"""
from __future__ import annotations

import weakref

import pytest

from fusion.ir.boundary import partition
from fusion.ir.graph import OpGraph
from fusion.ir.node import NodeKind, OpNode, Ref
from fusion.ir.walk import GraphWalk, last_uses


class Box:
    """A value a weak reference can follow (ints and tuples cannot be weakly referenced)."""

    __slots__ = ("v", "__weakref__")

    def __init__(self, v):
        self.v = v


class Watched(GraphWalk):
    """Calls FUNCS on Boxes; every output (and every Box inside a tuple output) is weakly referenced by
    name, and each call notes, under the node's name, which of them are alive when it runs."""

    def __init__(self, graph, sub=None, free=True):
        super().__init__(graph, sub)
        self.free_values = free
        self.refs: dict[str, weakref.ref] = {}
        self.alive_at: dict[str, set[str]] = {}

    def call(self, node):
        if node.kind == NodeKind.OUTPUT:
            return None
        fn, name = FUNCS[node.target], node.name

        def run(*args):
            self.alive_at[name] = {n for n, r in self.refs.items() if r() is not None}
            out = fn(*args)
            for i, box in enumerate(out if isinstance(out, tuple) else (out,)):
                self.refs[name if not isinstance(out, tuple) else f"{name}.{i}"] = weakref.ref(box)
            return out

        return run

    def fetch_placeholder(self, name, value):
        box = Box(value)
        self.refs[name] = weakref.ref(box)
        return box


FUNCS = {
    "inc": lambda a: Box(a.v + 1),
    "add": lambda a, b: Box(a.v + b.v),
    "pair": lambda a: (Box(a.v), Box(10 * a.v)),
    "total": lambda xs: Box(sum(x.v for x in xs)),
    "one": lambda: Box(1),
}


def _graph() -> OpGraph:
    """x -> p=(x, 10x) -> a=inc(p[1]) -> b=inc(a), k=one() -> dead=inc(b) (read by nobody) -> s=total([b, p[0]])
    -> c=add(s, x) -> loss=inc(c); y=inc(s) and z=inc(y) go to a second part (s is sent)."""
    g = OpGraph()
    g.add(OpNode("x", NodeKind.INPUT))
    g.add(OpNode("p", NodeKind.FUNCTION, "pair", args=(Ref("x"),)))
    g.add(OpNode("a", NodeKind.FUNCTION, "inc", args=(Ref("p", 1),)))
    g.add(OpNode("b", NodeKind.FUNCTION, "inc", args=(Ref("a"),)))
    g.add(OpNode("k", NodeKind.FUNCTION, "one"))  # reads nothing, read by nobody
    g.add(OpNode("dead", NodeKind.FUNCTION, "inc", args=(Ref("b"),)))
    g.add(OpNode("s", NodeKind.FUNCTION, "total", args=([Ref("b"), Ref("p", 0)],)))  # nested refs
    g.add(OpNode("c", NodeKind.FUNCTION, "add", args=(Ref("s"), Ref("x"))))
    g.add(OpNode("loss", NodeKind.LOSS, "inc", args=(Ref("c"),)))
    g.add(OpNode("y", NodeKind.FUNCTION, "inc", args=(Ref("s"),)))
    g.add(OpNode("z", NodeKind.FUNCTION, "inc", args=(Ref("y"),)))
    g.add(OpNode("out", NodeKind.OUTPUT, args=(Ref("z"),)))
    return g


def _parts(g: OpGraph):
    return partition(g, {**{n: "p0" for n in ("x", "p", "a", "b", "k", "dead", "s", "c", "loss")},
                         "y": "p1", "z": "p1", "out": "p1"})


def test_each_key_is_dropped_after_its_last_reader():
    g = _graph()
    walk = Watched(g, _parts(g)["p0"])
    drops = {s.name: s.drops for s in walk.steps}
    # a goes after b; b after s (a Ref nested in a list), and p with it (s reads p[0], a read p[1]); x after c;
    # k and dead are read by nobody: they go at once; s is sent: never dropped
    assert drops == {"x": (), "p": (), "a": (), "b": ("a",), "k": ("k",), "dead": ("dead",), "s": ("p", "b"),
                     "c": ("x",), "loss": ("c", "loss")}
    assert walk.send_keys == [("s", None)]
    assert last_uses(walk.steps, walk.env_key)[7] == ("x", "s")  # without keep, s would go after c


def test_a_value_is_freed_after_its_last_reader_and_sent_values_are_kept():
    g = _graph()
    walk = Watched(g, _parts(g)["p0"])
    fed = walk.feed({"x": 2})
    sent, losses = walk.run({}, fed)
    # a's last reader is b: gone before k runs; b's (and p's) is s: gone before c; dead is read by nobody
    assert walk.alive_at["b"] >= {"a", "p.0", "p.1"}
    assert "a" not in walk.alive_at["k"]  # k reads nothing: the loop itself must not hold b's argument
    assert "a" not in walk.alive_at["dead"] and "b" in walk.alive_at["dead"] and "k" not in walk.alive_at["dead"]
    assert "dead" not in walk.alive_at["s"]  # nor the output of the step before
    assert walk.alive_at["c"].isdisjoint({"a", "b", "dead", "p.0", "p.1"})
    assert walk.alive_at["loss"].isdisjoint({"a", "b", "dead", "p.0", "p.1"})
    # kept: the sent value s, though c was its last local reader; x in the runner's fed dict; the loss term
    assert "s" in walk.alive_at["loss"] and "x" in walk.alive_at["loss"]
    assert sent[("s", None)].v == 22 + 2 and sent[("s", None)] is walk.refs["s"]()
    assert [v.v for v in losses] == [24 + 2 + 1] and losses[0] is walk.refs["loss"]()
    assert walk.refs["c"]() is None and fed["x"] is walk.refs["x"]()  # c: dropped with its last reader, loss


def test_received_activations_stay_with_the_runner():
    g = _graph()
    p0, p1 = Watched(g, _parts(g)["p0"]), Watched(g, _parts(g)["p1"])
    sent, _ = p0.run({}, p0.feed({"x": 2}))
    leaves = p1.receive(sent)
    p1.refs["s"] = weakref.ref(leaves[("s", None)])
    p1.run(leaves, {})
    assert [s.drops for s in p1.steps] == [(("s", None),), ("y",), ("z", "out")]
    assert "s" in p1.alive_at["z"]  # the walk dropped it after y, but the runner's leaves dict holds it


@pytest.mark.parametrize("free", [True, False])
def test_free_values_false_keeps_every_value_as_before(free):
    g = _graph()
    walk = Watched(g, _parts(g)["p0"], free=free)
    sent, losses = walk.run({}, walk.feed({"x": 2}))
    assert (sent[("s", None)].v, losses[0].v) == (24, 27)  # the same values either way
    kept = walk.alive_at["loss"] & {"a", "b", "k", "dead", "p.0", "p.1"}
    assert kept == (set() if free else {"a", "b", "k", "dead", "p.0", "p.1"})
