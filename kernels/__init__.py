"""Top-K compression kernels: torch path (CPU/GPU) and CuPy CUDA path; sparse wire encoding."""
