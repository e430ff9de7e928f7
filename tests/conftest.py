"""Test-session settings.

Tiny ops on a 2-core machine spend their time waiting on torch's second
intra-op thread; one thread makes the suite several times faster and its
timings steadier. Child processes get OMP_NUM_THREADS=1 from .ci/run.
"""
import torch

torch.set_num_threads(1)
