"""`transformers` models as they come: a ``file.py:fn`` may return a ``PreTrainedModel`` and an example batch.

fusion traces the model itself (no wrapper, so parameter names are the model's own ``state_dict`` names and
``fusion export`` weights load into it with ``strict=True``): it turns the key/value cache off in the model's
config (a ``DynamicCache`` in the output cannot be traced, and training never uses it), makes ``labels`` a label
placeholder, and minimises the ``.loss`` the model computes from them. Nothing here imports ``transformers``:
a model can only be one when the user's file has imported it.
"""
from __future__ import annotations

import logging
import sys
from typing import Any, Mapping

from fusion.ir.errors import FusionError

log = logging.getLogger(__name__)


def is_pretrained(module: Any) -> bool:
    """Whether ``module`` is a ``transformers.PreTrainedModel`` (False when transformers was never imported)."""
    tf = sys.modules.get("transformers")
    return tf is not None and isinstance(module, getattr(tf, "PreTrainedModel", ()))


def trace_options(module: Any, example: Mapping[str, Any], options: dict, spec: str) -> dict:
    """The :func:`fusion.ir.trace.trace` options for a ``PreTrainedModel`` (the user's own ``options`` win), after
    turning its cache off. Refuses an example without ``labels``: the model computes no loss without them."""
    turned = _cache_off(module)
    if turned:
        log.info("model %s: %s: use_cache=False (training keeps no key/value cache)%s", spec, type(module).__name__,
                 f" in {turned} configs" if turned > 1 else "")
    if "labels" not in example and "loss_index" not in options:
        raise FusionError(f"model {spec}: the {type(module).__name__} computes its .loss only from 'labels': add "
                          f"labels to the example batch (for a causal LM {{'input_ids': ids, 'labels': ids}}); "
                          f"it has {sorted(example)}")
    defaults = {"loss_index": "loss", "keep_outputs": False}
    if "labels" in example:
        defaults["labels"] = ("labels",)
    return {**defaults, **options}


def _cache_off(module: Any) -> int:
    """Set ``use_cache=False`` in every config the model and its submodules hold (what the model returns then has
    no ``DynamicCache``, which cannot be traced, and training never reads the cache). Encoder-decoders keep more
    than one: T5's decoder stack holds its own copy of the config, whose cache gave an ``EncoderDecoderCache``.
    Returns how many configs were changed."""
    seen, turned = set(), 0
    subs = module.modules() if hasattr(module, "modules") else [module]
    for m in subs:
        cfg = getattr(m, "config", None)
        if cfg is None or id(cfg) in seen:
            continue
        seen.add(id(cfg))
        if getattr(cfg, "use_cache", False):
            cfg.use_cache = False
            turned += 1
    return turned
