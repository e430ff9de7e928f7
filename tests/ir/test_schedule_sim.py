"""``fusion.ir.schedule.simulate``: the action-list simulation the runtime's replay and the compiler share."""
import pytest

from fusion.ir.schedule import Action, make_schedule, simulate


def test_messages_wait_for_their_delivery_and_split_backwards_take_half():
    acts = make_schedule("zb1", ["a", "b"], {("a", "b"): None}, 1)
    seen = []

    def deliver(src, dst, payload, ready):
        seen.append((src, dst, payload, ready))
        return ready + 10.0

    sim = simulate(acts, {"a": {"F": 1.0, "B": 2.0}, "b": {"F": 1.0, "B": 4.0}},
                   {("a", "F"): [("b", "act")], ("b", "B"): [("a", "grad")]}, deliver)
    # a: F [0,1]; b: F [11,12], B [12,14] (half of 4), W [14,16]; a: B [24,25], W [25,26]
    assert seen == [("a", "b", "act", 1.0), ("b", "a", "grad", 14.0)]
    assert sim.end_s == {"a": 26.0, "b": 16.0}
    assert [x[0] for x in sim.timeline["b"]] == ["F0", "B0", "W0"]


def test_a_deadlock_names_the_stuck_actions():
    acts = {"a": [Action("B", 0)], "b": [Action("F", 0)]}
    with pytest.raises(RuntimeError, match=r"deadlock at \[\('a', 0\), \('b', 0\)\]"):
        simulate(acts, {"a": {"F": 1, "B": 1}, "b": {"F": 1, "B": 1}},
                 {("b", "B"): [("a", None)], ("a", "F"): [("b", None)]}, lambda s, d, p, t: t)
