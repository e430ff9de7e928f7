"""A steady C heap for training processes (glibc ``mallopt``).

glibc serves allocations above ``M_MMAP_THRESHOLD`` with a fresh ``mmap`` and
returns them with ``munmap``, and it gives memory above ``M_TRIM_THRESHOLD``
at the top of the heap back to the kernel. A training step allocates and frees
the same large tensors (activations, gradients) every iteration, so with the
defaults the process can page-fault its working set in anew every step:
hundreds to a thousand minor faults per step, each a kernel entry and a zeroed
page (``benchmarks/bench_executor.py`` prints them per side). Raising both
thresholds keeps freed memory in the heap for the next step to reuse.

The arena count (``M_ARENA_MAX``) is left alone. Memory freed by a step stays
reserved by the process (its resident size stays at the peak of a step), which
is what a process that runs steps in a loop wants anyway. Measured on GPT small
(``ReferenceExecutor``, one part): 750–1600 minor faults a step with the
defaults, 0–27 steady; the resident size grew 2–3 MB over the first ~250 steps
(eager PyTorch alike), then stayed flat up to step 2000.

``fusion executor`` calls :func:`steady_heap` at start unless ``--heap default``;
the reference executor does not (a library call should not change the process's
allocator behind the caller's back); ``benchmarks/bench_executor.py`` does for both sides.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import logging
import sys

log = logging.getLogger(__name__)

#: glibc's mallopt parameter numbers (malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
#: tried in order: older glibc refuses an mmap threshold above half its heap size (32 MiB on 64-bit)
THRESHOLDS = (1 << 30, 32 << 20)

_done: bool | None = None
#: the threshold the first successful call set (bytes), None before or where none was set
threshold: int | None = None


def _libc():
    """glibc's ``mallopt``, or None on another C library / platform."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        import platform

        if platform.libc_ver()[0] != "glibc":
            return None
        lib = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        fn = lib.mallopt
    except (OSError, AttributeError):
        return None
    fn.argtypes = (ctypes.c_int, ctypes.c_int)
    fn.restype = ctypes.c_int
    return fn


def steady_heap() -> bool:
    """Raise glibc's mmap and trim thresholds for this process; True if both were set.

    Returns False (and changes nothing) where there is no glibc. Idempotent: later
    calls return the first call's result without calling ``mallopt`` again. Logs once, at debug level
    (a command's failure stays one line on stderr); a warning only if glibc refuses.
    """
    global _done, threshold
    if _done is not None:
        return _done
    mallopt = _libc()
    if mallopt is None:
        log.debug("heap: not glibc (%s); allocator thresholds left as they are", sys.platform)
        _done = False
        return _done
    for value in THRESHOLDS:
        if mallopt(M_MMAP_THRESHOLD, value) == 1 and mallopt(M_TRIM_THRESHOLD, value) == 1:
            log.debug("heap: steady (glibc M_MMAP_THRESHOLD and M_TRIM_THRESHOLD = %d MiB): freed tensors stay "
                     "in the heap for the next step", value >> 20)
            _done, threshold = True, value
            return _done
    log.warning("heap: glibc refused mallopt(M_MMAP_THRESHOLD/M_TRIM_THRESHOLD); allocator left as it is")
    _done = False
    return _done
