"""Engines and executors: run sub-DAGs, exchange OP-Data, remote autodiff."""
