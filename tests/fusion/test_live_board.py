"""TensorBoard scalars written as the run goes (issue 38: they were written only when the run ended)."""
import json

import pytest

pytest.importorskip("tensorboard", reason="the tensorboard extra (pip install 'fusion[tensorboard]')")


def _scalars(folder):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_each_line_is_readable_before_the_run_ends_and_a_resume_replays_cleanly(tmp_path):
    from fusion.commands.metrics_log import LiveBoard

    metrics, board_dir = tmp_path / "metrics.jsonl", tmp_path / "tensorboard"
    board = LiveBoard(metrics, board_dir)
    for s in range(3):
        board.add({"step": s, "loss": 3.0 - s, "lr": 0.01, "time": 100.0 + s, "parts": {}})
    board.add({"step": 1, "val_loss": 2.5, "time": 102.5})
    got = _scalars(board_dir)  # the writer is still open: what a user watching the run sees
    assert got["train/loss"] == [(0, 3.0), (1, 2.0), (2, 1.0)] and got["train/val_loss"] == [(1, 2.5)]
    assert [v for _, v in got["train/lr"]] == pytest.approx([0.01] * 3)
    board.close()
    # a resumed run: metrics.jsonl trimmed to steps 0-1; the board starts from those, then goes on
    metrics.write_text("".join(json.dumps({"step": s, "loss": 3.0 - s, "time": 100.0 + s}) + "\n" for s in range(2))
                       + json.dumps({"event": "restart", "restart": 1, "resumed_step": 2}) + "\n")  # no step: skipped
    board = LiveBoard(metrics, board_dir)
    board.add({"step": 2, "loss": 0.5, "time": 200.0})
    assert _scalars(board_dir)["train/loss"] == [(0, 3.0), (1, 2.0), (2, 0.5)]
    board.close()
