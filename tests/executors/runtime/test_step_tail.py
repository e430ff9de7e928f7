"""The end of a step as schedule data (fusion.ir.schedule.step_tail): one list of TailKind that the CompNode
runs kind by kind (a handler per kind) and the coordinator reads for its own kinds. The runs that check the
tail's effect against plain PyTorch (clipping, failover commits, checkpoints, DiLoCo's outer step) are
test_knobs.py, test_failure.py, test_checkpoint.py, test_diloco.py and test_distributed.py."""
from __future__ import annotations

from fusion.executors.runtime.step_loop import StepLoop
from fusion.ir.schedule import TailKind as K, step_tail


def test_the_tail_in_order_with_the_kinds_a_run_adds():
    assert step_tail(False, False, False) == [K.SEND_TIED, K.SUM_TIED, K.REDUCE, K.OPTIMIZER, K.OUTER, K.DONE]
    assert step_tail(True, True, True) == [K.SEND_TIED, K.SUM_TIED, K.REDUCE, K.GRAD_NORM, K.CLIP, K.REDUCED,
                                           K.COMMIT, K.OPTIMIZER, K.OUTER, K.CHECKPOINT, K.DONE]
    assert step_tail(False, True, False) == [K.SEND_TIED, K.SUM_TIED, K.REDUCE, K.REDUCED, K.COMMIT, K.OPTIMIZER,
                                             K.OUTER, K.DONE]
    assert str(K.GRAD_NORM) == "grad-norm"


def test_the_compnode_has_one_handler_per_kind():
    handlers = StepLoop()._tail_handlers()
    assert set(handlers) == set(K)
    assert len({h.__func__ for h in handlers.values()}) == len(K)  # no kind shares another's work


def test_the_simulator_runs_the_tail_after_the_actions():
    from fusion.ir.schedule import gpipe, simulate

    actions = {"p0": gpipe(2), "p1": gpipe(2)}
    compute = {"p0": {"F": 1.0, "B": 2.0, "optimizer": 0.5, "reduce": 3.0}, "p1": {"F": 1.0, "B": 2.0}}
    sends = {("p0", "F"): [("p1", None)], ("p1", "B"): [("p0", None)]}

    def deliver(src, dst, payload, ready_s):
        return ready_s

    plain = simulate(actions, compute, sends, deliver)
    tailed = simulate(actions, compute, sends, deliver, tail=step_tail(False, False, False))
    assert tailed.end_s["p0"] == plain.end_s["p0"] + 3.0 + 0.5  # reduce, then the optimizer
    assert [t[0] for t in tailed.timeline["p0"][-2:]] == ["reduce", "optimizer"]
    assert tailed.end_s["p1"] == plain.end_s["p1"]  # no seconds given for p1's tail: nothing added
