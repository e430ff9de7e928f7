"""Partitioners: OP-Fence and its chain DP, the equal-count / equal-flops baselines, and the DP x PP planners (ours in dp.py, DT-FM's scheduler in dtfm.py)."""
