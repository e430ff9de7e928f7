"""Sub-DAG boundaries: FusionLLM Table 3 for the Figure 3 example DAG.

Figure 3 / Table 2:

    Input ─► Conv ──────────┐
                            Add ─► Linear ─► CE ◄─ Label
    Tensor A ─► ReLu ───────┘

    part 1: Input, Conv      part 2: Tensor A, ReLu      part 3: Add, Linear, Label, CE

"Tensor A" is a trainable variable with no inputs. We model it as a module
node of a user-registered type ``TensorVariable`` that owns one parameter and
takes no arguments, so it is a node of the DAG (as in Table 2) placed on
part 2, rather than a ParamRef argument of ReLu (which would not be a node).

Placeholders are fed from the data set on the part that holds them, so
Table 3's "Input" and "Label" requirements are feeds, not boundary edges.
"""
import numpy as np
import pytest
import torch
from torch import nn

import fusion
from fusion.plan import OptimizerConfig
from fusion.executors.reference import ReferenceExecutor
from fusion.ir.boundary import BoundaryEdge, partition, part_links, part_order, subgraph
from fusion.ir.builder import GraphBuilder
from fusion.ir.errors import GraphError
from fusion.ir.node import Ref


@fusion.register_module("test_boundary.TensorVariable")
class TensorVariable(nn.Module):
    """A free trainable tensor as a DAG node (Figure 3's "Tensor A")."""

    def __init__(self, shape):
        super().__init__()
        self.value = nn.Parameter(torch.randn(*shape))

    def forward(self):
        return self.value


FIG3_PARTS = {"Input": "1", "Conv": "1", "TensorA": "2", "ReLu": "2",
              "Add": "3", "Linear": "3", "Label": "3", "CE": "3"}


def figure3(device: str = "cpu"):
    b = GraphBuilder()
    x = b.input("Input")
    conv = b.module("Conv", "torch.nn.Conv2d", x, in_channels=2, out_channels=3, kernel_size=3, padding=1)
    a = b.module("TensorA", TensorVariable, shape=(3, 4, 4))
    r = b.function("ReLu", "torch.relu", a)
    h = b.function("Add", "operator.add", r, conv)
    h = b.function("Flat", "torch.flatten", h, 1)
    o = b.module("Linear", "torch.nn.Linear", h, in_features=48, out_features=5)
    y = b.label("Label")
    b.loss("CE", "torch.nn.functional.cross_entropy", o, y)
    return b.build({"Input": torch.randn(2, 2, 4, 4), "Label": torch.tensor([1, 3])}, seed=0, device=device)


def _assignment(graph):
    return {n: FIG3_PARTS.get(n, "3") for n in graph.nodes}  # Flat sits with Add on part 3


def _labels(edges):
    return sorted(e.label() for e in edges)


def test_table3_of_figure3():
    g = figure3(device="meta").graph
    subs = partition(g, _assignment(g))
    assert sorted(subs) == ["1", "2", "3"]
    assert subs["1"].nodes == ["Input", "Conv"]
    assert subs["2"].nodes == ["TensorA", "ReLu"]
    assert set(subs["3"].nodes) == {"Add", "Flat", "Linear", "Label", "CE"}

    one, two, three = subs["1"].boundary, subs["2"].boundary, subs["3"].boundary
    # sub-DAG 1: sends Conv to Add, waits for the gradient Conv-Add, sends no gradient
    assert one.required_acts == []
    assert one.sent_acts == [BoundaryEdge("Conv", None, "Add", True)]
    assert _labels(one.required_grads) == ["Conv-Add"]
    assert one.sent_grads == []
    # sub-DAG 2: sends ReLu to Add, waits for the gradient ReLu-Add
    assert two.required_acts == []
    assert two.sent_acts == [BoundaryEdge("ReLu", None, "Add", True)]
    assert _labels(two.required_grads) == ["ReLu-Add"]
    assert two.sent_grads == []
    # sub-DAG 3: requires Conv and ReLu, sends their gradients back
    assert _labels(three.required_acts) == ["Conv-Add", "ReLu-Add"]
    assert three.sent_acts == [] and three.required_grads == []
    assert _labels(three.sent_grads) == ["Conv-Add", "ReLu-Add"]

    assert part_order(g, _assignment(g)) == ["1", "2", "3"]
    links = part_links(g, _assignment(g))
    assert {k: _labels(v) for k, v in links.items()} == {("1", "3"): ["Conv-Add"], ("2", "3"): ["ReLu-Add"]}


def test_runtime_messages_follow_table3():
    """The reference executor exchanges exactly the Table 3 activations and gradients."""
    model = figure3()
    ex = ReferenceExecutor(model, _assignment(model.graph), OptimizerConfig("sgd", lr=0.1), micro_batches=2)
    log = []
    for p, part in ex.parts.items():
        def wrap(fn, kind):
            def run(*a, **k):
                res = fn(*a, **k)
                msgs = res[0] if kind == "F" else res
                log.extend((kind, m.src, m.dst, m.name, m.actual_user, m.is_grad, m.requires_grad, m.micro_batch)
                           for m in msgs)
                return res
            return run
        part.forward, part.backward = wrap(part.forward, "F"), wrap(part.backward, "B")
    batch = {"Input": torch.randn(4, 2, 4, 4), "Label": torch.tensor([0, 1, 2, 3])}
    ex.step(batch)
    want = set()
    for mb in (0, 1):
        want |= {("F", "1", "3", "Conv", ("Add",), False, True, mb), ("F", "2", "3", "ReLu", ("Add",), False, True, mb),
                 ("B", "3", "1", "Conv", ("Add",), True, False, mb), ("B", "3", "2", "ReLu", ("Add",), True, False, mb)}
    assert sorted(log) == sorted(want)


def test_edges_without_gradient_are_left_out_of_the_gradient_tables():
    b = GraphBuilder()
    x, y = b.input("x"), b.label("y")
    h = b.module("fc", "torch.nn.Linear", x, in_features=4, out_features=3)
    xs = b.function("xs", "torch.mul", x, 2.0)  # data only: no gradient flows back
    z = b.function("z", "operator.add", h, b.function("slice", "torch.narrow", xs, 1, 0, 3))
    b.loss("loss", "torch.nn.functional.cross_entropy", z, y)
    g = b.build({"x": torch.zeros(2, 4), "y": torch.zeros(2, dtype=torch.long)}, device="meta").graph
    a = {"x": "p", "fc": "p", "xs": "p", "y": "p", "slice": "q", "z": "q", "loss": "q"}
    subs = partition(g, a)
    assert _labels(subs["p"].boundary.sent_acts) == ["fc-z", "xs-slice", "y-loss"]
    assert _labels(subs["p"].boundary.required_grads) == ["fc-z"]
    assert _labels(subs["q"].boundary.sent_grads) == ["fc-z"]
    # the label crosses parts as an activation without gradient
    assert [e.requires_grad for e in subs["q"].boundary.required_acts if e.producer == "y"] == [False]


def test_boundary_without_shape_metadata_assumes_gradients_except_placeholders():
    g = figure3(device="meta").graph
    for n in g:
        n.meta.outputs = ()
    sg = subgraph(g, ["Add", "Flat", "Linear", "CE"])
    assert [(e.label(), e.requires_grad) for e in sg.boundary.required_acts] == \
        [("ReLu-Add", True), ("Conv-Add", True), ("Label-CE", False)]


def test_multi_output_edges_are_keyed_by_index():
    b = GraphBuilder()
    x = b.input("x")
    h = b.module("fc", "torch.nn.Linear", x, in_features=4, out_features=4)
    b.function("parts", "torch.chunk", h, 2, 1)
    u = b.function("u", "torch.tanh", Ref("parts", 0))
    v = b.function("v", "torch.sin", Ref("parts", 1))
    w = b.function("w", "torch.cos", Ref("parts", 1))
    b.loss("loss", "torch.sum", b.function("s", "operator.add", u, b.function("vw", "operator.mul", v, w)))
    g = b.build({"x": torch.zeros(2, 4)}, device="meta").graph
    sg = subgraph(g, ["x", "fc", "parts"])
    assert _labels(sg.boundary.sent_acts) == ["parts[0]-u", "parts[1]-v", "parts[1]-w"]
    assert {e.key for e in sg.boundary.sent_acts} == {("parts", 0), ("parts", 1)}


def test_cyclic_part_assignment_is_rejected_with_the_parts_named():
    g = figure3(device="meta").graph
    a = _assignment(g)
    a["Linear"] = "1"  # 1 feeds 3 (Conv->Add) and 3 feeds 1 (Flat->Linear) and 1 feeds 3 (Linear->CE)
    with pytest.raises(GraphError, match=r"parts \[.*\] form a cycle") as info:
        part_order(g, a)
    assert "'1'" in str(info.value) and "'3'" in str(info.value) and "'2'" not in str(info.value)
    with pytest.raises(GraphError, match="cycle"):
        ReferenceExecutor(figure3(), a)


def test_partition_errors_name_the_node():
    g = figure3(device="meta").graph
    a = _assignment(g)
    del a["ReLu"]
    for fn in (partition, part_order, part_links):
        with pytest.raises(GraphError, match="node 'ReLu': node is not assigned to any part"):
            fn(g, a)
    a = _assignment(g)
    a["Ghost"] = "2"
    with pytest.raises(GraphError, match="node 'Ghost': assignment names a node that is not in the graph"):
        partition(g, a)
    with pytest.raises(GraphError, match="node 'Nope': subgraph names a node"):
        subgraph(g, ["Conv", "Nope"])


def test_figure3_trains_as_partitioned_like_unpartitioned():
    model = figure3()
    batch = {"Input": torch.randn(4, 2, 4, 4), "Label": torch.tensor([0, 1, 2, 3])}
    whole = ReferenceExecutor(model, None, OptimizerConfig("sgd", lr=0.1, momentum=0.9), micro_batches=2)
    split = ReferenceExecutor(model, _assignment(model.graph), OptimizerConfig("sgd", lr=0.1, momentum=0.9),
                              micro_batches=2, schedule="1f1b")
    for _ in range(3):
        a, b = whole.step(batch), split.step(batch)
        np.testing.assert_allclose(b.loss, a.loss, rtol=1e-5)
        assert set(a.grads) == set(b.grads) == set(model.params)
        for n in a.grads:
            np.testing.assert_allclose(b.grads[n], a.grads[n], rtol=1e-4, atol=1e-7)

