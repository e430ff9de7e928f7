"""``--compress auto --allow-architecture-change`` (:mod:`fusion.passes.architecture`, issue 35): the compiler
prices dense, the subspace at d/16 and d/6 and the bottleneck at its auto rank on the tiny GPT and keeps the
fastest; without consent it never changes the model."""
from __future__ import annotations

import pytest

from fusion.cluster import load_cluster
from fusion.compile import CompileError, compile_model
from fusion.compress.bottleneck import BottleneckRequest
from fusion.compress.policy import request
from fusion.compress.subspace import SubspaceRequest
from fusion.ir.trace import trace
from fusion.passes.architecture import ArchitectureRequest
from tests.executors.runtime.test_distributed_gpt import REPO, _gpt_module


def two_sites(mbit: float, memory_mb: float) -> str:
    """Two CPU devices of ``memory_mb`` in two sites joined by ``mbit`` Mbit/s, 80 ms (0.25 MB: OP-Fence must cut
    the tiny GPT in two, between blocks)."""
    return (f"name: two-{mbit:g}\ndevices:\n  - {{name: cpu-0, group: a, peak_flops: 50 GFLOPS, memory: {memory_mb} MB}}\n"
            f"  - {{name: cpu-1, group: b, peak_flops: 50 GFLOPS, memory: {memory_mb} MB}}\n"
            f"links:\n  default: {{latency: 80 ms, bandwidth: {mbit:g} Mbit/s}}\n")


@pytest.fixture(scope="module")
def tiny():
    module, example = _gpt_module().tiny()
    return trace(module, example)


def _cluster(tmp_path, mbit, memory_mb):
    path = tmp_path / f"c{mbit}-{memory_mb}.yaml"
    path.write_text(two_sites(mbit, memory_mb))
    return load_cluster(str(path))


KW = dict(strategy="opfence", micro_batches=4)


def test_auto_keeps_the_fastest_candidate(tmp_path, tiny):
    slow = _cluster(tmp_path, 5, 0.25)
    plan = compile_model(tiny, slow, compress=request("auto"), architecture=ArchitectureRequest(), **KW)
    info = plan.predicted["architecture"]
    rows = {r["name"]: r for r in info["candidates"]}
    assert list(rows) == ["dense", "subspace k=2", "subspace k=5", "bottleneck auto"]  # d = 32: d/16, d/6
    priced = {n: r["iteration_s"] for n, r in rows.items()}
    assert all(t is not None for t in priced.values()), rows
    # each candidate's price is the plan compiled with that change alone (same estimator, same cut search)
    alone = {"dense": compile_model(tiny, slow, compress=request("auto"), **KW),
             "subspace k=2": compile_model(tiny, slow, compress=request("auto"), subspace=SubspaceRequest(2), **KW),
             "bottleneck auto": compile_model(tiny, slow, compress=request("auto"),
                                              bottleneck=BottleneckRequest("auto"), **KW)}
    for name, p in alone.items():
        assert priced[name] == pytest.approx(p.predicted["iteration_s"], rel=1e-9), name
    best = min(priced, key=priced.get)
    assert info["chosen"] == best == "subspace k=2"  # on 5 Mbit/s the 2 coordinates (+ ids) win
    assert priced[best] < priced["dense"]
    assert plan.predicted["iteration_s"] == pytest.approx(priced[best])
    assert plan.subspace is not None and plan.subspace["rank"] == 2 and plan.subspace["cuts"]
    assert not plan.bottlenecks and "shortest predicted iteration" in info["reason"]


def test_auto_keeps_the_model_where_no_change_pays(tmp_path, tiny):
    fast = _cluster(tmp_path, 1000, 16)  # one device holds it all: nothing crosses, a change only adds nodes
    plan = compile_model(tiny, fast, compress=request("auto"), architecture=ArchitectureRequest(), **KW)
    info = plan.predicted["architecture"]
    assert info["chosen"] == "dense" and plan.subspace is None and not plan.bottlenecks
    rows = {r["name"]: r for r in info["candidates"]}
    assert rows["bottleneck auto"]["iteration_s"] is None and "not built" in rows["bottleneck auto"]["note"]
    assert all(r["iteration_s"] >= rows["dense"]["iteration_s"] for r in rows.values() if r["iteration_s"])
    with pytest.raises(CompileError, match="not both"):
        compile_model(tiny, fast, compress=request("auto"), architecture=ArchitectureRequest(),
                      subspace=SubspaceRequest(2), **KW)


def test_cli_consent_inspect_and_bad_input(tmp_path, capsys):
    from fusion.cli import main
    from fusion.plan import load_plan
    from tests.fusion.cli_helpers import one_line

    (tmp_path / "c.yaml").write_text(two_sites(5, 0.25))
    base = ["compile", f"{REPO / 'examples/models/gpt.py'}:tiny", "--cluster", str(tmp_path / "c.yaml"),
            "--micro-batches", "4", "--compress", "auto"]
    # without consent auto never changes the architecture, even where a change would price shorter
    assert main([*base, "-o", str(tmp_path / "plain")]) == 0
    assert "subspace" not in capsys.readouterr().out
    plain = load_plan(tmp_path / "plain")
    assert plain.subspace is None and not plain.bottlenecks and "architecture" not in plain.predicted
    assert main([*base, "--allow-architecture-change", "-o", str(tmp_path / "auto")]) == 0
    assert "subspace-confined stream (width 32 -> k = 2), architecture chosen by price: subspace k=2" in \
        capsys.readouterr().out
    auto = load_plan(tmp_path / "auto")
    assert auto.subspace["rank"] == 2 and auto.predicted["iteration_s"] < plain.predicted["iteration_s"]
    assert main(["inspect", str(tmp_path / "auto"), "--no-png"]) == 0
    out = capsys.readouterr().out
    assert "architecture chosen by the compiler (--compress auto --allow-architecture-change): subspace k=2" in out
    for row in auto.predicted["architecture"]["candidates"]:
        assert any(line[2:].startswith(row["name"]) and f"{row['iteration_s']:.4g}" in line
                   for line in out.splitlines()), row
    assert main([*base, "--allow-architecture-change", "--precision", "bf16", "-o", str(tmp_path / "bad")]) == 2
    assert "fp32 only" in one_line(capsys)
