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


# -- interleaved 1F1B (virtual stages): one lane per device ------------------------------------------
from fusion.ir.schedule import Action, interleaved_1f1b, make_lanes, make_schedule, virtual_stages  # noqa: E402


def _chain(d: int, v: int):
    order = [f"p{i}" for i in range(d * v)]
    devices = {p: f"d{i % d}" for i, p in enumerate(order)}
    edges = {(order[i], order[i + 1]): 1 for i in range(len(order) - 1)}
    sends = {(a, "F"): [(b, 0)] for a, b in edges} | {(b, "B"): [(a, 0)] for a, b in edges}
    return order, devices, edges, sends


def test_interleaved_order_is_megatrons():
    """D = 2, v = 2, 4 micro-batches: hand-written from Megatron-LM's rule (warm-up 2(D-r-1) + (v-1)D)."""
    got = {r: " ".join(f"{a}c{c}" for c, a in interleaved_1f1b(4, 2, 2, r)) for r in range(2)}
    assert got[0] == "F0c0 F1c0 F0c1 F1c1 F2c0 B0c1 F3c0 B1c1 F2c1 B0c0 F3c1 B1c0 B2c1 B3c1 B2c0 B3c0"
    assert got[1] == "F0c0 F1c0 F0c1 B0c1 F1c1 B1c1 F2c0 B0c0 F3c0 B1c0 F2c1 B2c1 F3c1 B3c1 B2c0 B3c0"


@pytest.mark.parametrize("d,v,n", [(2, 2, 8), (4, 2, 8), (3, 3, 6), (4, 4, 4)])
def test_interleaved_cuts_the_bubble_by_v(d, v, n):
    """Free links, F = 1/v and B = 2/v per chunk (the device's work equals 1F1B's F = 1, B = 2):
    1F1B takes 3n + 3(D-1), interleaved 3n + 3(D-1)/v (Narayanan et al. 2021, Sec. 2.2)."""
    order, devices, edges, sends = _chain(d, v)
    lanes = make_lanes("interleaved", order, edges, n, devices)
    acts = make_schedule("interleaved", order, edges, n, devices)
    assert set(lanes) == {f"d{r}" for r in range(d)}
    assert all(len(acts[p]) == 2 * n for p in order)
    assert all(sorted(str(a) for a in acts[p]) == sorted([f"F{m}" for m in range(n)] + [f"B{m}" for m in range(n)])
               for p in order)
    sim = simulate(acts, {p: {"F": 1 / v, "B": 2 / v} for p in order}, sends, lambda s, dst, x, t: t, lanes=lanes)
    assert max(sim.end_s.values()) == pytest.approx(3 * n + 3 * (d - 1) / v)
    o1, _, e1, s1 = _chain(d, 1)
    flat = simulate(make_schedule("1f1b", o1, e1, n), {p: {"F": 1, "B": 2} for p in o1}, s1, lambda s, dst, x, t: t)
    assert max(flat.end_s.values()) == pytest.approx(3 * n + 3 * (d - 1))


def test_interleaved_lane_serialises_its_parts():
    """Two chunks on one device never overlap in time."""
    order, devices, edges, sends = _chain(2, 2)
    lanes = make_lanes("interleaved", order, edges, 4, devices)
    sim = simulate(make_schedule("interleaved", order, edges, 4, devices), {p: {"F": 1.0, "B": 2.0} for p in order},
                   sends, lambda s, dst, x, t: t + 0.3, lanes=lanes)
    spans = sorted(sim.timeline["p0"][i][1:] for i in range(8)) + sorted(sim.timeline["p2"][i][1:] for i in range(8))
    spans.sort()
    assert all(b[0] >= a[1] - 1e-12 for a, b in zip(spans, spans[1:]))


def test_interleaved_bad_placement_and_counts():
    order, devices, edges, _ = _chain(2, 2)
    with pytest.raises(ValueError, match=r"part 'p2' \(position 2 of the part order\) runs on device 'd1', but virtual stage 2 belongs on 'd0'"):
        virtual_stages(order, {**devices, "p2": "d1", "p3": "d0"})
    with pytest.raises(ValueError, match=r"3 parts do not split evenly over 2 devices"):
        virtual_stages(order[:3], devices)
    with pytest.raises(ValueError, match=r"micro_batches a multiple of the devices \(2\), got 3"):
        make_lanes("interleaved", order, edges, 3, devices)
    with pytest.raises(ValueError, match=r"needs each part's device"):
        make_schedule("interleaved", order, edges, 4)
    assert make_lanes("1f1b", order[:2], {("p0", "p1"): 1}, 2) == {"p0": [("p0", Action("F", 0)), ("p0", Action("F", 1)), ("p0", Action("B", 0)), ("p0", Action("B", 1))],
                                                                   "p1": [("p1", Action("F", 0)), ("p1", Action("B", 0)), ("p1", Action("F", 1)), ("p1", Action("B", 1))]}


# -- action kinds: an enum with a text form that parses back ----------------------------------------------

def test_action_kinds_are_an_enum_whose_text_parses_back():
    from fusion.ir.schedule import ActionKind

    assert [str(k) for k in ActionKind] == ["F", "B", "W"]
    for name in ("gpipe", "1f1b", "zb1"):
        for acts in make_schedule(name, ["a", "b", "c"], {("a", "b"): None, ("b", "c"): None}, 4).values():
            for a in acts:
                assert isinstance(a.kind, ActionKind)
                assert ActionKind.parse(str(a.kind)) is a.kind and Action.parse(str(a)) == a
    assert str(Action(ActionKind.W, 12)) == f"{Action(ActionKind.W, 12)}" == "W12"
    assert Action("B", 3) == Action(ActionKind.B, 3)  # a letter is parsed
    for bad in ("X", "f", "", "FB"):
        with pytest.raises(ValueError, match="unknown action kind"):
            ActionKind.parse(bad)
    with pytest.raises(ValueError, match="unknown action kind 'Q'"):
        Action("Q", 0)
    for bad in ("F", "F-1", "F01", "0F", "X3", "F1 "):
        with pytest.raises(ValueError):
            Action.parse(bad)
