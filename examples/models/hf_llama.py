"""A tiny `transformers` Llama, returned as the library gives it (no wrapper): fusion turns its cache off and
trains its own ``.loss`` (docs/training.md "Models as they come").

- ``tiny``: 2 layers, width 64, 4 heads (2 key-value heads), byte vocabulary (256 tokens, so ``--data text:PATH``
  feeds it bytes), 32-token windows, tied embeddings; built from a config, nothing downloaded.
"""
from __future__ import annotations

import torch
import transformers


def tiny():
    """The model and an example batch (``input_ids`` and ``labels``, the same ids: the model shifts them)."""
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   tie_word_embeddings=True)
    ids = torch.randint(0, 256, (2, 32))
    return transformers.LlamaForCausalLM(cfg), {"input_ids": ids, "labels": ids}
