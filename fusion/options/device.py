"""``--device``: which torch device a CompNode's engine runs on, checked before any process starts."""
from __future__ import annotations


def check_device(spec: str) -> str:
    """The canonical name of torch device ``spec`` (``cpu``, ``cuda``, ``cuda:1``).

    Raises FusionError naming ``spec`` when torch does not know the device kind or this host
    lacks it (no CUDA, or fewer CUDA devices than the index), so a bad ``--device`` is one line,
    not an executor traceback. Several CompNodes may name the same device: one GPU can host them all.
    """
    if spec == "cpu":  # no torch import: a NumPy CompNode's process stays torch-free
        return "cpu"
    import torch

    from fusion.ir.errors import FusionError

    try:
        dev = torch.device(spec)
    except (RuntimeError, TypeError) as e:
        raise FusionError(f"--device {spec!r} is not a torch device (cpu, cuda, cuda:0, ...): {e}") from None
    if dev.type == "cpu":
        return "cpu"
    if dev.type != "cuda":
        raise FusionError(f"--device {spec!r}: fusion runs engines on cpu or cuda devices, not {dev.type}")
    if not torch.cuda.is_available():
        raise FusionError(f"--device {spec!r}: torch {torch.__version__} sees no CUDA device on this host")
    count = torch.cuda.device_count()
    if dev.index is not None and dev.index >= count:
        raise FusionError(f"--device {spec!r}: this host has {count} CUDA device{'s' if count != 1 else ''} "
                          f"(cuda:0 .. cuda:{count - 1})")
    return str(dev)
