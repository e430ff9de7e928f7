"""Partitioners: OP-Fence and its chain DP, and the equal-count / equal-flops baselines."""
