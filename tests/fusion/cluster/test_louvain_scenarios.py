"""Louvain (python-louvain) on the bandwidth graph recovers the regions and machines of the scenarios."""
from pathlib import Path

import pytest

from fusion.cluster import load_cluster
from fusion.cluster.scenarios import synthetic_cluster
from fusion.cluster.topology import cluster_bandwidth, cluster_path, device_clusters, device_order

from fusion.cluster.scenarios import load_scenario as scenario


def _groups(cluster, clusters):
    """Each Louvain cluster as the set of file groups it contains."""
    return sorted(sorted({cluster.devices[i].group for i in c}) for c in clusters)


@pytest.mark.parametrize("name, n_groups", [
    ("dtfm-3-multi-dc", 2), ("dtfm-4-regional", 4), ("dtfm-5-worldwide", 8), ("fusionllm-24", 5), ("fusionllm-48", 10),
])
def test_louvain_recovers_regions_and_machines(name, n_groups):
    c = scenario(name)
    found = device_clusters(c, seed=0)
    groups = _groups(c, found)
    assert len(found) == n_groups
    assert all(len(g) == 1 for g in groups), groups  # no cluster mixes two regions / machines
    assert sorted(g[0] for g in groups) == sorted({d.group for d in c.devices})


def test_louvain_is_deterministic():
    c = scenario("dtfm-5-worldwide")
    assert device_clusters(c, seed=0) == device_clusters(c, seed=0)


def test_two_sites_of_the_local_example():
    c = load_cluster(Path(__file__).resolve().parents[3] / "examples" / "clusters" / "local-4-two-sites.yaml")
    assert device_clusters(c) == [[0, 1], [2, 3]]


def test_sparsified_louvain_on_many_devices_finds_sites():
    c = synthetic_cluster(512, site_size=8, seed=1)
    found = device_clusters(c, dense_limit=256, knn=32)
    assert all(len({c.devices[i].group for i in cl}) == 1 for cl in found)
    assert len(found) == 64


def test_cluster_path_prefers_strong_links():
    c = scenario("fusionllm-48")
    found = device_clusters(c)
    cbw = cluster_bandwidth(c, found)
    start = next(k for k, cl in enumerate(found) if c.devices[cl[0]].group == "A0")
    path = cluster_path(cbw, start)
    # from machine A0 the strongest neighbour is machine A1 (1 Gbit/s; B machines are 8-100 Mbit/s away)
    assert c.devices[found[path[1]][0]].group == "A1"
    order = device_order(c, found, path)
    assert sorted(order) == list(range(len(c))) and c.devices[order[0]].group == "A0"
