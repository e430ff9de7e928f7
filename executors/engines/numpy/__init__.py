"""The NumPy engine: sub-DAGs with hand-written forward/backward kernels, torch-free."""
