"""Engines: run one sub-DAG on one framework (``torch``, ``numpy``); ``select`` picks one by name.

Each engine is a sub-package with its op tables and optimizer; importing one never imports another,
so a NumPy CompNode stays torch-free.
"""
