"""The cluster model: devices and links (YAML or scenario JSON), units, Louvain topology, shipped scenarios."""
from fusion.cluster.model import Cluster, ClusterError, Device, load_cluster

__all__ = ["Cluster", "ClusterError", "Device", "load_cluster"]
