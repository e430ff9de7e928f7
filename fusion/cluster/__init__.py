"""The cluster model: devices and links (YAML or scenario JSON), units, Louvain topology, shipped scenarios."""
from fusion.cluster.load import load_cluster
from fusion.cluster.model import Cluster, ClusterError, Device

__all__ = ["Cluster", "ClusterError", "Device", "load_cluster"]
