"""The cost model: FLOPs per node, the alpha-beta estimator (FusionLLM Eq. 1-4), host profiling."""
