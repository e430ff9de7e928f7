"""Per-node costs measured on the meta device: FLOPs, memory-bound bytes, saved activations."""
import torch

from fusion.cost.flops import measure_costs
from fusion.ir.builder import GraphBuilder


def _mlp(batch=4, d_in=16, d_h=32, d_out=8, device="meta"):
    b = GraphBuilder()
    x, y = b.input("x"), b.label("y")
    h = b.module("l1", "torch.nn.Linear", x, in_features=d_in, out_features=d_h)
    h = b.function("act", "torch.relu", h)
    h = b.module("ln", "torch.nn.LayerNorm", h, normalized_shape=d_h)
    h = b.function("view", "torch.Tensor.view", h, batch, d_h)
    o = b.module("l2", "torch.nn.Linear", h, in_features=d_h, out_features=d_out)
    b.loss("loss", "torch.nn.functional.cross_entropy", o, y)
    return b.build({"x": torch.zeros(batch, d_in), "y": torch.zeros(batch, dtype=torch.long)}, device=device)


def test_linear_flops_forward_and_measured_backward():
    m = _mlp()
    c = measure_costs(m.graph)
    # forward 2*B*in*out; the first layer's input needs no gradient, so backward is only dW (1x);
    # the second layer computes dX and dW (2x)
    assert c["l1"].flops_fwd == 2 * 4 * 16 * 32
    assert c["l1"].flops_bwd == 2 * 4 * 16 * 32
    assert c["l2"].flops_fwd == 2 * 4 * 32 * 8
    assert c["l2"].flops_bwd == 2 * 2 * 4 * 32 * 8
    assert m.graph["l2"].meta.flops_bwd == c["l2"].flops_bwd  # written into NodeMeta too
    assert m.graph["l1"].meta.param_bytes == (16 * 32 + 32) * 4


def test_zero_flop_operators_are_costed_as_memory_traffic():
    c = measure_costs(_mlp().graph)
    n = 4 * 32 * 4  # bytes of one (4, 32) float32 activation
    assert c["act"].flops_fwd == 0 and c["act"].mem_fwd == 2 * n  # relu reads and writes it once
    assert c["ln"].flops_fwd == 0 and c["ln"].mem_fwd > 2 * n and c["ln"].mem_bwd > 0
    assert c["view"].mem_fwd == 0 and c["view"].mem_bwd == 0  # views move nothing
    assert c["loss"].mem_fwd > 0
    assert c["x"].flops_fwd == 0 and c["x"].mem_fwd == 0  # placeholders cost nothing


def test_saved_activations_exclude_parameters():
    c = measure_costs(_mlp().graph)
    assert c["l2"].saved_bytes == 4 * 32 * 4  # its input, not its weight
    assert c["act"].saved_bytes == 4 * 32 * 4


def test_identical_signatures_share_one_measurement_and_nothing_is_allocated():
    from tests.testing_models import gpt_model

    m = gpt_model(4, 64, 4, 100, 16, 2, device="meta")
    assert not m.params  # built on meta: no weights
    c = measure_costs(m.graph)
    assert c["h0.attn"] == c["h3.attn"] and c["h1.fc"] == c["h2.fc"]
    assert all(v.measured for v in c.values())
    # attention: QKV + output projections and the two batched matmuls of SDPA
    b, t, d = 2, 16, 64
    assert c["h0.attn"].flops_fwd == 2 * b * t * d * 3 * d + 2 * b * t * d * d + 2 * 2 * b * t * t * d


def test_unmeasurable_node_falls_back_to_recorded_flops():
    m = _mlp(device="cpu")
    node = m.graph["act"]
    node.target = "torch.Tensor.numpy"  # cannot run on meta tensors
    node.meta.flops_fwd = 123.0
    c = measure_costs(m.graph)
    assert not c["act"].measured and c["act"].flops_fwd == 123.0 and c["act"].flops_bwd == 246.0


class _Cast(torch.nn.Module):
    """What transformers' rotary embeddings and masks do: a tensor moved to the input's device, and made there."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)

    def forward(self, x):
        h = self.fc(x).to(device=x.device, dtype=torch.float32)
        pos = torch.arange(x.shape[-1], device=x.device).to(torch.float32)
        return (h + pos.to(x.device)).sum()


def test_nodes_that_name_a_device_are_measured_on_meta(caplog):
    """``x.to(device=cpu)`` and ``torch.arange(..., device=cpu)`` traced on the CPU: measured on meta with the device
    made meta, no 'cannot measure' warning (three of them on every Llama / Qwen2 / GPT-2 compile before)."""
    import logging

    import fusion

    model = fusion.trace(_Cast(), {"x": torch.randn(2, 8)})
    with caplog.at_level(logging.WARNING, logger="fusion.cost.flops"):
        c = measure_costs(model.graph)
    assert "cannot measure" not in caplog.text, caplog.text
    assert all(v.measured for v in c.values())
    named = [n for n, node in model.graph.nodes.items() if "device" in repr((node.args, node.kwargs))]
    assert named, "the traced graph names no device: the test lost its point"
