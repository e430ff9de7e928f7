"""The codec interface as plugin files and docs use it (``fusion.kernels.codec``); the codecs themselves
live one per file in :mod:`fusion.kernels.codecs`.

Built-in codecs: ``topk`` (:class:`TopKCodec`), ``quant`` (:class:`QuantCodec`), ``hadamard-quant``
(:class:`HadamardQuantCodec`) and ``delta`` (:class:`DeltaCodec`, stateful). A plan's per-edge
``compress_cfg`` such as ``{"algo": "topk", "ratio": 100}`` names the codec by ``algo``; the codec reads the
rest of the dict.

A *user* codec (one registered with :func:`register_codec` by a plugin file) implements the plain protocol
(:class:`CodecProtocol`):

name:        the ``algo`` value in a ``compress_cfg``.
encode:      tensor + cfg -> payload for the wire.
decode:      payload -> dense torch tensor (on ``like``'s device).
wire_nbytes: bytes the payload of a ``numel``-element ``dtype`` tensor costs under ``cfg`` (what the
             compiler prices).

Its payloads must cross the wire without pickle: ``encode`` returns a *plain payload*, a dict of string
keys to ``bytes``, ``int``, ``float``, ``str``, ``bool``, ``None`` or flat lists of those scalars
(:func:`check_plain`); ``decode`` gets the same dict back (``bytes`` values as ``bytes``) and must raise on
a malformed one (lengths, counts, ranges): a receiving CompNode then rejects the message and keeps serving.
The payload must say everything decoding needs (shape, dtype); the runtime checks the decoded tensor against
the graph.

Optionally a codec also has a NumPy path, so that NumPy CompNodes (which never import torch) can run it:
``encode_numpy(array, cfg) -> payload`` and ``decode_numpy(payload) -> np.ndarray``, giving the same payloads
as the torch path. The runtime uses the NumPy path wherever a codec has one (its messages are NumPy arrays),
else the torch path, which a NumPy part refuses at load (:func:`numpy_path`). The registry adapts such a
codec to the unit's interface (:class:`~fusion.kernels.codecs.registry.PluginCodec`): it may serve
activations, gradients, tied-parameter, data-parallel and pseudo-gradients, without error feedback. A codec
may instead subclass :class:`Codec` (the unit: host and device paths, roles, rate, ``auto`` candidates).
"""
from __future__ import annotations

from fusion.kernels.codecs.base import Codec, CodecContext, Role
from fusion.kernels.codecs.delta import DeltaCodec
from fusion.kernels.codecs.plain import (MAX_PLAIN_KEY, MAX_PLAIN_KEYS, MAX_PLAIN_LIST, MAX_PLAIN_STR, WIRE_CODEC,
                                         CodecPayload, check_plain)
from fusion.kernels.codecs.quant import HadamardQuantCodec, QuantCodec
from fusion.kernels.codecs.registry import (BUILTIN, CODECS, CodecProtocol, CodecRegistry, numpy_path,
                                            register_codec)
from fusion.kernels.codecs.topk import TopKCodec, compress, decompress
from fusion.kernels.sparse import ratio_to_k

__all__ = ["Codec", "CodecContext", "CodecProtocol", "Role", "CodecRegistry", "CODECS", "BUILTIN", "CodecPayload",
           "check_plain", "numpy_path", "register_codec", "TopKCodec", "QuantCodec", "HadamardQuantCodec",
           "DeltaCodec", "compress", "decompress", "ratio_to_k", "WIRE_CODEC", "MAX_PLAIN_KEY", "MAX_PLAIN_KEYS",
           "MAX_PLAIN_LIST", "MAX_PLAIN_STR"]
