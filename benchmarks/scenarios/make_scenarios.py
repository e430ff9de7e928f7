#!/usr/bin/env python3
"""Build the shipped scenario clusters (fusion/cluster/data/*.json) from aws_regions.csv beside this script.

Each scenario is a JSON file:
  {"name": str, "source": str,
   "devices": [{"name", "peak_flops", "memory_bytes", "group"}],
   "delay_s": N x N list, "bandwidth_bps": N x N list}
delay_s[i][j] is the one-way latency alpha from device i to j in seconds;
bandwidth_bps[i][j] is in bits per second (beta = 8 / bandwidth_bps s/byte).
The diagonal is 0 delay and 0 bandwidth (no self link).

Run: python3 benchmarks/scenarios/make_scenarios.py   (rewrites fusion/cluster/data/*.json; deterministic)
"""
import csv
import itertools
import json
import math
import random
from pathlib import Path

HERE = Path(__file__).resolve().parent
OUT = HERE.parents[1] / "fusion" / "cluster" / "data"
GB = 1e9

# Peak dense throughputs. V100 from the DT-FM paper text ("V100 GPUs peak at 125
# TeraFLOPS"); RTX 4090 from FusionLLM Table 1; RTX 2080 is an approximate
# fp16 tensor-core figure (fp32 accumulate), good enough for scheduling studies.
V100 = dict(peak_flops=125e12, memory_bytes=16e9)
RTX4090 = dict(peak_flops=165.16e12, memory_bytes=24e9)
RTX2080 = dict(peak_flops=40e12, memory_bytes=8e9)


def region_table():
    table = {}
    with open(HERE / "aws_regions.csv") as f:
        for row in csv.DictReader(f):
            key = frozenset((row["region_a"], row["region_b"]))
            table[key] = (float(row["delay_ms"]) / 1e3, float(row["bandwidth_gbps"]) * GB)
    return table


def build(name, source, groups, link):
    """groups: list of (group_name, count, device_spec); link(gi, gj) -> (delay_s, bps)."""
    devices, owner = [], []
    for gi, (gname, count, spec) in enumerate(groups):
        for k in range(count):
            devices.append({"name": f"{gname}-{k}", "group": gname, **spec})
            owner.append(gi)
    n = len(devices)
    delay = [[0.0] * n for _ in range(n)]
    bw = [[0.0] * n for _ in range(n)]
    for i, j in itertools.permutations(range(n), 2):
        d, b = link(owner[i], owner[j], i, j)
        delay[i][j], bw[i][j] = d, b
    out = {"name": name, "source": source, "devices": devices, "delay_s": delay, "bandwidth_bps": bw}
    (OUT / f"{name}.json").write_text(json.dumps(out))
    return n


def dtfm_cases():
    regions = region_table()
    # Case 1: 8 x p3.16xlarge (8 V100 each): 100 Gbps inside an instance, 25 Gbps across.
    build("dtfm-1-datacenter", "DT-FM paper, case 1", [(f"inst{g}", 8, V100) for g in range(8)],
          lambda a, b, i, j: (0.0, 100 * GB) if a == b else (0.0, 25 * GB))
    # Case 2: 8 x p3.8xlarge (4 V100) + 32 x p3.2xlarge (1 V100), as in DT-FM's scheduler config: 100 Gbps inside, 10 Gbps across.
    groups = [(f"p38-{g}", 4, V100) for g in range(8)] + [(f"p32-{g}", 1, V100) for g in range(32)]
    build("dtfm-2-spot", "DT-FM paper, case 2", groups,
          lambda a, b, i, j: (0.0, 100 * GB) if a == b else (0.0, 10 * GB))
    # Case 3: Ohio + Virginia, 32 GPUs each: 10 Gbps inside a site, 10 ms / 1.12 Gbps across.
    build("dtfm-3-multi-dc", "DT-FM paper, case 3", [("ohio", 32, V100), ("virginia", 32, V100)],
          lambda a, b, i, j: (0.0, 10 * GB) if a == b else (0.010, 1.12 * GB))
    # Case 4: four US regions x 16: 5 ms / 2 Gbps inside a region; pairs from DT-FM's scheduler config.
    us = ["virginia", "oregon", "california", "ohio"]
    us_pairs = {frozenset(p): (d / 1e3, g * GB) for p, d, g in [
        (("virginia", "oregon"), 67, 1.15), (("virginia", "california"), 59, 1.05),
        (("virginia", "ohio"), 11, 1.12), (("oregon", "california"), 12, 1.25),
        (("oregon", "ohio"), 49, 1.10), (("california", "ohio"), 52, 1.02)]}
    build("dtfm-4-regional", "DT-FM paper + scheduler config, case 4", [(r, 16, V100) for r in us],
          lambda a, b, i, j: (0.005, 2 * GB) if a == b else us_pairs[frozenset((us[a], us[b]))])
    # Case 5: eight regions x 8 worldwide: 5 ms / 2 Gbps inside; pairs from aws_regions.csv.
    world = ["oregon", "virginia", "ohio", "tokyo", "seoul", "london", "frankfurt", "ireland"]
    build("dtfm-5-worldwide", "DT-FM paper + aws_regions.csv, case 5", [(r, 8, V100) for r in world],
          lambda a, b, i, j: (0.005, 2 * GB) if a == b else regions[frozenset((world[a], world[b]))])


def fusionllm_testbeds():
    """Synthetic testbeds shaped like FusionLLM's (Table 5): cluster A machines with
    8 RTX 4090, cluster B machines with 4 RTX 2080; links span 8 Mbit/s to 10 Gbit/s.
    The paper's measured matrix (its Figure 9) is not public, so cross-machine
    links are drawn from a fixed seed: same machine 10 Gbps / 0.1 ms (no NCCL);
    same cluster 1 Gbps / 0.5 ms; across clusters log-uniform 8-100 Mbit/s, 20-60 ms."""
    for name, a_nodes, b_nodes in [("fusionllm-24", 1, 4), ("fusionllm-48", 2, 8)]:
        groups = [(f"A{m}", 8, RTX4090) for m in range(a_nodes)] + [(f"B{m}", 4, RTX2080) for m in range(b_nodes)]
        rng = random.Random(2024)
        n_groups = len(groups)
        cross = {}
        for ga, gb in itertools.combinations(range(n_groups), 2):
            same_cluster = groups[ga][0][0] == groups[gb][0][0]
            if same_cluster:
                cross[(ga, gb)] = (0.0005, 1 * GB)
            else:
                bps = math.exp(rng.uniform(math.log(8e6), math.log(100e6)))
                cross[(ga, gb)] = (rng.uniform(0.020, 0.060), bps)

        def link(a, b, i, j):
            if a == b:
                return (0.0001, 10 * GB)
            return cross[(min(a, b), max(a, b))]

        build(name, "synthetic, shaped after FusionLLM Table 5 and its 8 Mbps-10 Gbps range", groups, link)


def local_small():
    """Small clusters that a 2-core machine can actually run, one process per device."""
    # 4 devices, two fast pairs joined by one slow link: the textbook OP-Fence case.
    pair = {(0, 1): (0.001, 1 * GB), (2, 3): (0.001, 1 * GB)}

    def link(a, b, i, j):
        key = (min(i, j), max(i, j))
        return pair.get(key, (0.030, 20e6))

    build("local-4-two-sites", "synthetic: two sites of two devices, 20 Mbit/s between sites",
          [("cpu", 4, dict(peak_flops=50e9, memory_bytes=4e9))], link)


if __name__ == "__main__":
    dtfm_cases()
    fusionllm_testbeds()
    local_small()
    for p in sorted(HERE.glob("*.json")):
        d = json.loads(p.read_text())
        print(f"{p.name}: {len(d['devices'])} devices")
