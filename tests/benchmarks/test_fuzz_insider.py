"""``fuzz_wire.py``'s insider mode, small: malformed messages under the run's own keys (the coordinator's and the
other part's) reach the live executors of a CURVE run, are decoded there and refused, one count each, and the
steps trained meanwhile equal an undisturbed run's bit for bit."""
import importlib.util
from pathlib import Path

_spec = importlib.util.spec_from_file_location("fuzz_wire", Path(__file__).resolve().parents[2] / "benchmarks" / "fuzz_wire.py")
fuzz_wire = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fuzz_wire)


def test_malformed_messages_under_the_runs_own_keys_are_refused_and_change_nothing(tmp_path):
    plan_dir = fuzz_wire.mlp_plan(tmp_path / "plan")
    r = fuzz_wire.run_insider(24, 5, plan_dir, tmp_path)
    assert "failure" not in r, r
    assert r["insider_sent"] == 24 and sum(r["insider_sent_per_part"].values()) == 24
    # each message decoded by its executor as its authenticated sender's, and refused: counted, none lost
    assert all(r["insider_rejected"][p] >= n for p, n in r["insider_sent_per_part"].items()), r
    assert r["insider_escaped"] == 0 and r["executor_crashes"] == 0 and r["hangs_over_5s"] == 0
    assert r["insider_changed_steps"] == 0 and r["insider_steps"] > fuzz_wire.INSIDER_WARMUP


def test_only_malformed_mutants_are_sent_under_a_run_identity():
    from fusion.executors.runtime.control import Stop

    assert not fuzz_wire._malformed(fuzz_wire._bytes_frames(Stop().frames()), True)  # an order: never sent
    assert fuzz_wire._malformed([b"\x00garbage"], True)
