"""Data-parallel synchronisation of a stage's replicas (``Plan.dp_sync``): the arithmetic of the ring or
tree all-reduce (allreduce.py), DiLoCo's outer loop (outer.py), replicas joining (join.py), tied-parameter
gradients (tied.py) and global-norm clipping (clip.py)."""
