"""Devices behind NAT priced through the relay (``fusion/cluster/relayed.py``): a link into a home is the two hops
through the relay's host (latencies add, seconds per byte add), links out of a home and the relay's own link into
it stay as written, and a relay entry the loader cannot use is one line naming the file and field, exit 2."""
from pathlib import Path

import numpy as np
import pytest

from fusion.cli import main
from fusion.cluster import load_cluster
from fusion.cluster.model import ClusterError

GPT = f"{Path(__file__).resolve().parents[3] / 'examples' / 'models' / 'gpt.py'}:tiny"  # from any working folder
BASE = """name: homes
devices:
  - {name: lab, count: 2, peak_flops: 50 GFLOPS, memory: 4 GB}
  - {name: home-a, group: homes, peak_flops: 20 GFLOPS, memory: 4 GB}
  - {name: home-b, group: homes, peak_flops: 20 GFLOPS, memory: 4 GB}
links:
  default: {latency: 30 ms, bandwidth: 20 Mbit/s}
  within_group: {latency: 1 ms, bandwidth: 1 Gbit/s}
"""


def _load(tmp_path, relay):
    p = tmp_path / "homes.yaml"
    p.write_text(BASE + relay)
    return load_cluster(str(p))


def test_links_into_a_home_are_the_relays_two_hops(tmp_path):
    plain = _load(tmp_path, "")
    c = _load(tmp_path, "relay: {via: lab-0, behind_nat: [homes]}\n")
    ix = {d.name: i for i, d in enumerate(c.devices)}
    lab0, lab1, a, b = ix["lab-0"], ix["lab-1"], ix["home-a"], ix["home-b"]
    # lab-1 -> home-a: lab-1 -> lab-0 (1 ms, 1 Gbit/s) then lab-0 -> home-a (30 ms, 20 Mbit/s)
    assert c.alpha[lab1, a] == pytest.approx(0.031)
    assert c.beta[lab1, a] == pytest.approx(8 / 1e9 + 8 / 20e6)
    # home-b -> home-a: home-b dials the relay (30 ms), the relay's connection into home-a (30 ms)
    assert c.alpha[b, a] == pytest.approx(0.060) and c.beta[b, a] == pytest.approx(2 * 8 / 20e6)
    for i, j in [(lab0, a), (a, lab1), (a, lab0), (lab1, lab0)]:  # the relay's own hop, links out of a home, the rest
        assert c.alpha[i, j] == plain.alpha[i, j] and c.beta[i, j] == plain.beta[i, j]


@pytest.mark.parametrize("relay,words", [
    ("relay: {via: nowhere, behind_nat: [home-a]}\n", "relay.via: 'nowhere' is not a device"),
    ("relay: {via: lab-0, behind_nat: [home-c]}\n", "relay.behind_nat[0]: 'home-c' is neither a device nor a group"),
    ("relay: {via: home-a, behind_nat: [homes]}\n", "relay.via: 'home-a' is listed behind NAT too"),
    ("relay: {via: lab-0}\n", "relay.behind_nat: must list"),
    ("relay: {via: lab-0, behind_nat: [home-a], hops: 2}\n", "relay: unknown field 'hops'"),
])
def test_a_relay_entry_that_cannot_be_used_is_one_line_exit_2(tmp_path, capsys, relay, words):
    with pytest.raises(ClusterError, match="homes.yaml"):
        _load(tmp_path, relay)
    assert main(["compile", GPT, "--cluster", str(tmp_path / "homes.yaml"),
                 "-o", str(tmp_path / "plan")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "homes.yaml" in err[0] and words in err[0], err
    assert not (tmp_path / "plan").exists()


def test_the_compiler_prices_a_cut_into_a_home_through_the_relay(tmp_path):
    """The same equal-count plan of the tiny GPT (lab-1 | home-a) costs more when home-a is behind NAT."""
    from fusion.compile import compile_model
    from fusion.loader import load_model

    model = load_model(GPT)
    times = {}
    for tag, relay in (("direct", ""), ("relayed", "relay: {via: lab-0, behind_nat: [home-a]}\n")):
        c = _load(tmp_path, relay)
        plan = compile_model(model, c.subset(["lab-1", "home-a"]), strategy="equal-count", micro_batches=2)
        times[tag] = plan.predicted["iteration_s"]
    assert times["relayed"] > times["direct"]
    assert np.isfinite(times["relayed"])
