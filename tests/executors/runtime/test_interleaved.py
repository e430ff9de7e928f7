"""Interleaved 1F1B in the runtime: one executor process per device runs its virtual stages.

The equivalence with plain PyTorch across processes is in ``test_distributed.py`` (cases
``interleaved``) and in process in ``tests/executors/test_equivalence.py``; here: the replay's
timeline of an interleaved plan, and the executor command's refusals (one line, exit 2).
"""
import pytest

from tests.executors.dist_models import CNN_SPLITS, GPT_SPLITS, branching_cnn, save_hand_plan, tied_transformer
from tests.fusion.cli_helpers import one_line

def _plan(tmp_path, n_dev=2, micro=4, build=tied_transformer, splits=GPT_SPLITS):
    from fusion.executors.runtime.launcher import local_cluster_dict

    return save_hand_plan(tmp_path, build(mb=2), splits[4], schedule="interleaved", micro_batches=micro,
                          cluster=local_cluster_dict([f"d{i}" for i in range(n_dev)]),
                          devices={f"p{i}": f"local-{i % n_dev}" for i in range(4)})


def test_plan_lanes_and_replay(tmp_path):
    """Free links, each chunk F = 0.5 s and B = 1 s: the device does 3 s of work per micro-batch, and the
    interleaved bubble is 3 (D - 1) / v = 1.5 s: 4 micro-batches take 13.5 s (1F1B on 2 devices: 15 s)."""
    from fusion.executors.runtime.replay import replay
    from fusion.plan import load_plan

    plan = load_plan(_plan(tmp_path))
    assert plan.lanes() == {"local-0": ["p0", "p2"], "local-1": ["p1", "p3"]}
    assert plan.lane_of("p2") == ["p0", "p2"]
    res = replay(plan, {p: {"F": 0.5, "B": 1.0} for p in plan.parts})
    assert res.iteration_s == pytest.approx(13.5)
    spans = sorted(s[1:] for p in ("p0", "p2") for s in res.timeline[p])  # one device: its chunks never overlap
    assert all(b[0] >= a[1] - 1e-12 for a, b in zip(spans, spans[1:]))


def test_plan_check_names_the_misplaced_part(tmp_path):
    from fusion.executors.runtime.launcher import hand_plan, local_cluster_dict
    from fusion.ir.errors import FusionError

    model = branching_cnn(mb=2)
    with pytest.raises(FusionError, match=r"part 'p2' \(position 2 of the part order\) runs on device 'local-1'"):
        hand_plan(model, CNN_SPLITS[4], schedule="interleaved", micro_batches=2, cluster=local_cluster_dict(["a", "b"]),
                  devices={"p0": "local-0", "p1": "local-1", "p2": "local-1", "p3": "local-0"})
    with pytest.raises(FusionError, match=r"micro_batches 3 must be a multiple of the 2 devices"):
        hand_plan(model, CNN_SPLITS[4], schedule="interleaved", micro_batches=3, cluster=local_cluster_dict(["a", "b"]),
                  devices={f"p{i}": f"local-{i % 2}" for i in range(4)})


def _executor(capsys, *args) -> str:
    """``fusion executor ARGS`` in process: exit status 2 and one line on stderr, which is returned."""
    from fusion.cli import main

    assert main(["executor", *map(str, args), "--coordinator", "tcp://127.0.0.1:1", "--startup-timeout", "5"]) == 2
    line = one_line(capsys)
    assert line.startswith("fusion executor: error:"), line
    return line


def test_executor_runs_a_whole_device_or_says_which(tmp_path, capsys):
    plan = _plan(tmp_path)
    assert "runs parts p0,p2 of device 'local-0' in one process; pass --node p0,p2" in _executor(capsys, plan, "--node", "p0")
    assert "pass --node p1,p3" in _executor(capsys, plan, "--node", "p1,p2")
    assert "no part 'p9'" in _executor(capsys, plan, "--node", "p0,p9")
    assert "one secret key file per part of --node (2)" in _executor(capsys, plan, "--node", "p0,p2", "--key", "a.secret")
    assert "each part listens on its own port" in _executor(capsys, plan, "--node", "p0,p2",
                                                           "--bind", "tcp://127.0.0.1:5999")


def test_ray_refuses_a_device_with_several_parts(tmp_path):
    """A Ray actor runs one part: an interleaved plan is refused before Ray is touched, saying what to run."""
    from fusion.executors.runtime.ray_cluster import RayCluster
    from fusion.ir.errors import FusionError

    with pytest.raises(FusionError, match=r"interleaved schedule puts p0,p2 in one process.*fusion executor --node p0,p2"):
        RayCluster("127.0.0.1:1", _plan(tmp_path), tmp_path / "run")
