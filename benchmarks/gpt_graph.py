"""GPT-style models for ``fusion compile`` examples and benchmarks (op-node API, no tracer needed).

``fusion compile benchmarks/gpt_graph.py:gpt2_xl --cluster ... -o PLAN`` compiles a
GPT-2 XL-sized graph built on the meta device (no weights allocated);
``gpt_tiny`` has real weights and is small enough to run.
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout root: tests/ holds the op-node GPT
from tests.testing_models import gpt_model  # noqa: E402


def gpt2_xl():
    """48 layers, width 1600, 25 heads, vocab 50257, one 1024-token sequence per micro-batch (meta)."""
    return gpt_model(48, 1600, 25, 50257, 1024, 1, device="meta")


def gpt2_small():
    """12 layers, width 768, 12 heads, vocab 50257, one 1024-token sequence per micro-batch (meta)."""
    return gpt_model(12, 768, 12, 50257, 1024, 1, device="meta")


def gpt_tiny():
    """2 layers, width 64, real weights: compiles and runs on a laptop."""
    return gpt_model(2, 64, 4, 512, 32, 4, device="cpu")
