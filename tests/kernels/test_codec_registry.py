"""The codec registry's rules for user codecs (on registries of the test's own; ``CODECS`` is process-wide)."""
import sys

import pytest

from fusion.ir.errors import FusionError
from fusion.kernels.codec import CodecRegistry, QuantCodec, numpy_path


class Half:
    name = "half"

    def encode(self, tensor, cfg):
        return {"x": 1}

    def decode(self, payload, like=None):
        return None

    def wire_nbytes(self, numel, dtype, cfg):
        return numel * 2


class HalfNumpy(Half):
    def encode_numpy(self, arr, cfg):
        return {"x": 1}

    def decode_numpy(self, payload):
        return None


def test_user_codecs_register_once_by_name_and_say_where_they_come_from():
    reg = CodecRegistry.with_defaults()
    reg.register(Half())
    reg.register(Half())  # the same class again (a model file imported twice): replaces
    assert reg.user_module("half") == __name__ and reg.user_module("quant") is None
    other = type("Half", (Half,), {"__module__": "elsewhere"})
    with pytest.raises(FusionError, match="'half' is already registered"):
        reg.register(other())
    with pytest.raises(FusionError, match="'quant' is already registered"):
        reg.register(QuantCodec())  # a built-in is never replaced
    for bad in ("a:b", "x,y", "k=v", "two words", "none", "auto", ""):
        with pytest.raises(FusionError, match="codec name"):
            reg.register(type("C", (Half,), {"name": bad})())
    with pytest.raises(FusionError, match="does not implement"):
        reg.register(object())
    assert not numpy_path(Half()) and numpy_path(HalfNumpy())


def test_importing_the_registry_does_not_import_torch():
    import subprocess

    r = subprocess.run([sys.executable, "-c", "import sys, fusion.kernels.codec, fusion.executors.runtime.compression; "
                        "print('torch' in sys.modules)"], capture_output=True, text=True, timeout=120)
    assert r.stdout.strip() == "False", r.stderr
