"""Cluster files: YAML with units, scenario JSON, round trips, and errors that name file and field."""
import json
from pathlib import Path

import numpy as np
import pytest

from fusion.cluster import Cluster, ClusterError, load_cluster
from fusion.cluster.scenarios import load_scenario
from fusion.cluster.units import UnitError, parse_quantity

EXAMPLES = Path(__file__).resolve().parents[3] / "examples" / "clusters"


def test_units():
    assert parse_quantity("20 Mbit/s", "bandwidth") == 20e6
    assert parse_quantity("1 Gbps", "bandwidth") == 1e9
    assert parse_quantity("125 MB/s", "bandwidth") == 1e9
    assert parse_quantity("30 ms", "seconds") == pytest.approx(0.03)
    assert parse_quantity("16 GiB", "bytes") == 16 * 2**30
    assert parse_quantity("165.16 TFLOPS", "flops") == pytest.approx(165.16e12)
    assert parse_quantity("5e13", "flops") == 5e13
    for bad in ("fast", "3 parsecs", "1 mB"):
        with pytest.raises(UnitError):
            parse_quantity(bad, "bandwidth")


def test_example_yaml_files_load():
    for f in sorted(EXAMPLES.glob("*.yaml")):
        c = load_cluster(f)
        n = len(c)
        off = ~np.eye(n, dtype=bool)
        assert n >= 2 and np.all(c.beta[off] > 0) and np.all(c.alpha[off] >= 0), f


def test_yaml_rules_and_precedence():
    c = load_cluster(EXAMPLES / "three-regions.yaml")
    i, j = c.index("oregon-3"), c.index("ohio-0")
    assert c.bandwidth_bps(i, j) == pytest.approx(400e6) and c.alpha[i, j] == pytest.approx(0.060)  # one-way pair
    assert c.bandwidth_bps(j, i) == pytest.approx(1.10e9)  # reverse keeps the group rule
    assert c.bandwidth_bps(c.index("virginia-0"), c.index("virginia-1")) == pytest.approx(2e9)
    assert c.devices[c.index("oregon-0")].lam == 0.85
    assert c.devices[0].memory_speed == 900e9


def test_local_yaml_equals_scenario_json():
    a = load_cluster(EXAMPLES / "local-4-two-sites.yaml")
    b = load_cluster("local-4-two-sites")  # a shipped scenario, by name
    assert b.to_dict() == load_scenario("local-4-two-sites").to_dict()
    assert [d.name for d in a.devices] == [d.name for d in b.devices]
    np.testing.assert_allclose(a.alpha, b.alpha)
    np.testing.assert_allclose(a.beta, b.beta)


def test_round_trip_through_plain_data(tmp_path):
    c = load_cluster(EXAMPLES / "three-regions.yaml")
    p = tmp_path / "c.json"
    p.write_text(json.dumps(c.to_dict()))
    d = load_cluster(p)
    assert d.devices == c.devices
    np.testing.assert_allclose(d.alpha, c.alpha)
    np.testing.assert_allclose(d.beta, c.beta, rtol=1e-12)


def _yaml(tmp_path, text):
    p = tmp_path / "bad.yaml"
    p.write_text(text)
    return p


GOOD_DEV = "devices:\n  - {name: a, peak_flops: 1 TFLOPS, memory: 1 GB}\n  - {name: b, peak_flops: 1 TFLOPS, memory: 1 GB}\n"


@pytest.mark.parametrize("text, field", [
    ("devices:\n  - {name: a, memory: 1 GB}\nlinks: {default: {latency: 1 ms, bandwidth: 1 Gbps}}\n", "peak_flops"),
    (GOOD_DEV, "'links'"),
    (GOOD_DEV + "links: {default: {latency: 1 ms, bandwidth: 0 Gbps}}\n", "links.default.bandwidth"),
    (GOOD_DEV + "links: {default: {latency: 1 ms, bandwidth: -5 Mbps}}\n", "links.default.bandwidth"),
    (GOOD_DEV + "links: {default: {latency: -1 ms, bandwidth: 1 Gbps}}\n", "links.default.latency"),
    (GOOD_DEV + "links: {pairs: [{src: a, dst: zz, latency: 1 ms, bandwidth: 1 Gbps}]}\n", "links.pairs[0].dst"),
    (GOOD_DEV + "links: {pairs: [{src: a, dst: b, latency: 1 ms, bandwidth: 1 Gbps, symmetric: false}]}\n", "no link from b to a"),
    (GOOD_DEV + "links: {default: {latency: 1 ms, bandwidth: fast}}\n", "links.default.bandwidth"),
    ("devices:\n  - {name: a, peak_flops: 1 TFLOPS, memory: 1 GB}\n  - {name: a, peak_flops: 1 TFLOPS, memory: 1 GB}\n"
     "links: {default: {latency: 1 ms, bandwidth: 1 Gbps}}\n", "duplicate device name"),
    # a forgotten unit: 4 bytes of memory, 50 FLOP/s, 20 bit/s are not devices (line and column too)
    (GOOD_DEV.replace("memory: 1 GB}\n  - {name: b", "memory: 4}\n  - {name: b") +
     "links: {default: {latency: 1 ms, bandwidth: 1 Gbps}}\n", "bad.yaml:2:45: devices[0] (a).memory: 4 has no unit"),
    (GOOD_DEV.replace("peak_flops: 1 TFLOPS", "peak_flops: '50'", 1) +
     "links: {default: {latency: 1 ms, bandwidth: 1 Gbps}}\n", "peak_flops: '50' has no unit, so it reads as 50 FLOP/s"),
    (GOOD_DEV + "links: {default: {latency: 1 ms, bandwidth: 20}}\n", "links.default.bandwidth: 20 has no unit"),
])
def test_yaml_errors_name_file_and_field(tmp_path, text, field):
    with pytest.raises(ClusterError) as e:
        load_cluster(_yaml(tmp_path, text))
    msg = str(e.value)
    assert "bad.yaml" in msg and field in msg, msg
    assert "\n" not in msg


def test_plain_numbers_in_base_units_still_load(tmp_path):
    """Above the floors a unitless number is base units, as the JSON format writes them (4e9 bytes)."""
    c = load_cluster(_yaml(tmp_path, "devices:\n  - {name: a, peak_flops: 1e12, memory: 4000000000}\n"
                                     "  - {name: b, peak_flops: 1e12, memory: 4e9}\n"
                                     "links: {default: {latency: 0.001, bandwidth: 1e9}}\n"))
    assert [d.memory_bytes for d in c.devices] == [4e9, 4e9]


def test_scenario_json_errors(tmp_path):
    base = {"name": "x", "devices": [{"name": "a", "peak_flops": 1e12, "memory_bytes": 1e9},
                                     {"name": "b", "peak_flops": 1e12, "memory_bytes": 1e9}],
            "delay_s": [[0, 0.01], [0.01, 0]], "bandwidth_bps": [[0, 1e9], [1e9, 0]]}
    Cluster.from_dict(base, "x.json")
    cases = [
        ({**base, "bandwidth_bps": [[0, 0.0], [1e9, 0]]}, "bandwidth_bps[0][1] (a -> b) must be > 0"),
        ({**base, "bandwidth_bps": [[0, -1e9], [1e9, 0]]}, "bandwidth_bps[0][1]"),
        ({k: v for k, v in base.items() if k != "delay_s"}, "missing field 'delay_s'"),
        ({**base, "devices": [{"name": "a", "memory_bytes": 1e9}, base["devices"][1]]}, "devices[0]: missing field 'peak_flops'"),
        ({**base, "devices": [{"name": "a", "peak_flops": 0, "memory_bytes": 1e9}, base["devices"][1]]}, "devices[0].peak_flops"),
        ({**base, "delay_s": [[0, 0.01]]}, "delay_s: must be a 2 x 2"),
    ]
    for data, want in cases:
        p = tmp_path / "s.json"
        p.write_text(json.dumps(data))
        with pytest.raises(ClusterError) as e:
            load_cluster(p)
        assert str(e.value).startswith(str(p)) and want in str(e.value), str(e.value)


def test_missing_and_unparsable_files(tmp_path):
    with pytest.raises(ClusterError, match="no such cluster file"):
        load_cluster(tmp_path / "nope.yaml")
    p = tmp_path / "broken.json"
    p.write_text("{not json")
    with pytest.raises(ClusterError, match="broken.json: not valid JSON"):
        load_cluster(p)


def test_unknown_device_lookup():
    c = load_cluster(EXAMPLES / "local-4-two-sites.yaml")
    with pytest.raises(ClusterError, match="unknown device 'gpu-9'"):
        c.index("gpu-9")


def test_fitted_overheads_load_round_trip_and_default_to_zero(tmp_path):
    """Profiles written before the per-node / per-message fit load with both at 0; written ones come back."""
    import json

    from fusion.cluster import Cluster, ClusterError, load_cluster

    old = {"name": "old", "devices": [{"name": "a", "peak_flops": 1e10, "memory_bytes": 1e9, "lambda": 0.9},
                                      {"name": "b", "peak_flops": 1e10, "memory_bytes": 1e9}],
           "delay_s": [[0, 0.001], [0.001, 0]], "bandwidth_bps": [[0, 1e9], [1e9, 0]]}
    f = tmp_path / "old.json"
    f.write_text(json.dumps(old))
    cl = load_cluster(f)
    assert [(d.node_overhead_s, d.message_overhead_s) for d in cl.devices] == [(0.0, 0.0), (0.0, 0.0)]
    assert "node_overhead_s" not in json.dumps(cl.to_dict())  # nothing written that was not fitted
    old["devices"][0].update(node_overhead_s=2e-5, message_overhead_s=1e-5)
    cl = Cluster.from_dict(json.loads(json.dumps(Cluster.from_dict(old).to_dict())))
    assert (cl.devices[0].node_overhead_s, cl.devices[0].message_overhead_s) == (2e-5, 1e-5)
    y = tmp_path / "c.yaml"
    y.write_text("name: c\ndevices:\n  - {name: cpu, count: 2, peak_flops: 50 GFLOPS, memory: 4 GB, node_overhead_s: 3.0e-5}\n"
                 "links:\n  default: {latency: 1 ms, bandwidth: 1 Gbit/s}\n")
    assert [d.node_overhead_s for d in load_cluster(y).devices] == [3e-5, 3e-5]
    y.write_text(y.read_text().replace("3.0e-5", "-1.0"))
    with pytest.raises(ClusterError, match=r"c.yaml.*devices\[0\].*node_overhead_s.*>= 0"):
        load_cluster(y)
