"""Tiny `transformers` models built from config objects (random init, no download).

Each family function returns ``(module, example, options)``, the form a
``file.py:function`` model file may return (``fusion run tests/ir/hf_models.py:llama``):
``module.forward`` takes the example's names and returns the model's own loss,
``options`` are :func:`fusion.ir.trace.trace` keyword arguments (the labels).
Dropout is off everywhere, so a partitioned run can match plain PyTorch.
Not a test module; the tracing tests and ``benchmarks/trace_models.py`` import it.
"""
from __future__ import annotations

import torch
from torch import nn

VOCAB = 64
BATCH, SEQ = 2, 8


class CausalLM(nn.Module):
    """``forward(input_ids, labels)`` -> the wrapped model's own loss (``use_cache=False``)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids, labels):
        return self.model(input_ids=input_ids, labels=labels, use_cache=False).loss


class MaskedLM(nn.Module):
    """BERT-style: no cache argument."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids, labels):
        return self.model(input_ids=input_ids, labels=labels).loss


class ImageClassifier(nn.Module):
    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, pixel_values, labels):
        return self.model(pixel_values=pixel_values, labels=labels).loss


def _tokens(seed: int, batch: int = BATCH, seq: int = SEQ) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"input_ids": torch.randint(0, VOCAB, (batch, seq), generator=g),
            "labels": torch.randint(0, VOCAB, (batch, seq), generator=g)}


def _images(seed: int, batch: int = BATCH) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"pixel_values": torch.randn(batch, 3, 16, 16, generator=g), "labels": torch.randint(0, 5, (batch,), generator=g)}


def _decoder(cls_name: str, cfg_name: str, **extra):
    import transformers as T

    cfg = getattr(T, cfg_name)(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                               num_attention_heads=4, max_position_embeddings=64, **extra)
    return CausalLM(getattr(T, cls_name)(cfg))


def build(family: str, seed: int = 0) -> nn.Module:
    """The wrapped tiny model of ``family`` (weights from ``torch.manual_seed(seed)``), in training mode."""
    import transformers as T

    torch.manual_seed(seed)
    if family == "gpt2":
        m = CausalLM(T.GPT2LMHeadModel(T.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                                                    resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)))
    elif family == "bert":
        m = MaskedLM(T.BertForMaskedLM(T.BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                                                    num_attention_heads=4, intermediate_size=64, hidden_dropout_prob=0.0,
                                                    attention_probs_dropout_prob=0.0)))
    elif family == "llama":
        m = _decoder("LlamaForCausalLM", "LlamaConfig", num_key_value_heads=2)
    elif family == "qwen2":
        m = _decoder("Qwen2ForCausalLM", "Qwen2Config", num_key_value_heads=2)
    elif family == "mistral":
        m = _decoder("MistralForCausalLM", "MistralConfig", num_key_value_heads=2)
    elif family == "gpt_neox":
        import transformers as T

        m = CausalLM(T.GPTNeoXForCausalLM(T.GPTNeoXConfig(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            max_position_embeddings=64, hidden_dropout=0.0, attention_dropout=0.0)))
    elif family == "t5":
        m = CausalLM(T.T5ForConditionalGeneration(T.T5Config(
            vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, dropout_rate=0.0,
            decoder_start_token_id=0, pad_token_id=0)))
    elif family == "vit":
        m = ImageClassifier(T.ViTForImageClassification(T.ViTConfig(
            image_size=16, patch_size=4, num_channels=3, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
            intermediate_size=64, num_labels=5, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)))
    else:
        raise ValueError(f"unknown family {family!r}; known: {FAMILIES}")
    return m.train()


FAMILIES = ("gpt2", "bert", "llama", "qwen2", "mistral", "gpt_neox", "t5", "vit")


def example(family: str, seed: int = 1, batch: int = BATCH) -> dict[str, torch.Tensor]:
    """One micro-batch of ``batch`` rows for ``family``."""
    return _images(seed, batch) if family == "vit" else _tokens(seed, batch)


def entry(family: str, seed: int = 0):
    """``(module, example, options)`` as a ``file.py:function`` model returns it."""
    return build(family, seed), example(family), {"labels": ("labels",)}


def llama():
    return entry("llama")


def qwen2():
    return entry("qwen2")


def t5():
    return entry("t5")


def gpt2():
    return entry("gpt2")


def vit():
    return entry("vit")
