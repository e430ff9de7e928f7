"""Start-up blames the right part (issue 28): plan digests are compared as each part says hello, and a part that is
up hears from the coordinator while it waits, so a late part or one with another copy of the plan is the one named.
It used to be the part that *did* connect that stopped ("no answer from the coordinator ... is that its address?")
after its own start-up timeout, and the plans were compared only once every part had connected."""
import re
import threading
import time

import pytest

from tests.executors.dist_models import CNN_SPLITS, branching_cnn, save_hand_plan
from fusion.executors.runtime.compnode import CompNode, ExecutorConfig, run_lane
from fusion.executors.runtime.control import Hello
from fusion.executors.runtime.coordinator import CompNodeFailure, Coordinator, CoordinatorConfig
from fusion.executors.runtime.transport import Transport
from fusion.ir.errors import FusionError
from fusion.plan import load_plan


def test_a_late_part_is_named_to_the_part_that_is_up_which_waits_for_the_coordinator(tmp_path, caplog):
    plan_dir = save_hand_plan(tmp_path, branching_cnn(mb=2), CNN_SPLITS[2], micro_batches=2)
    plan = load_plan(plan_dir)
    coord = Coordinator(plan, CoordinatorConfig(startup_timeout_s=10, heartbeat_s=0.2, peer_timeout_s=5))
    addr = coord.bind()
    # p0 is up and gives the coordinator 3 s to answer; p1 never comes
    node = CompNode(plan, plan_dir, ExecutorConfig("p0", addr, startup_timeout_s=3, heartbeat_s=0.2))
    status = {}
    t = threading.Thread(target=lambda: status.setdefault("rc", run_lane([node])), daemon=True)
    try:
        t.start()
        t0 = time.monotonic()
        with pytest.raises(CompNodeFailure, match=r"CompNode 'p1' failed: no 'hello' within 10 s .*still waiting for p1"):
            coord.start()
        t.join(20)
        assert status.get("rc") == 1 and time.monotonic() - t0 >= 9  # p0 waited past its own 3 s for the coordinator
    finally:
        coord.close()
    stops = [r.getMessage() for r in caplog.records if "stopping" in r.getMessage()]
    assert len(stops) == 1 and re.search(r"p0: stopping: aborted by the coordinator: CompNode 'p1' failed: no 'hello'",
                                         stops[0]), stops
    assert "no answer from the coordinator" not in caplog.text


def test_a_part_with_another_plan_is_named_at_its_hello_without_waiting_for_the_others(tmp_path):
    plan_dir = save_hand_plan(tmp_path, branching_cnn(mb=2), CNN_SPLITS[2], micro_batches=2)
    coord = Coordinator(load_plan(plan_dir), CoordinatorConfig(startup_timeout_s=60, plan_digest="a" * 64))
    addr = coord.bind()
    got = []
    p0 = Transport("p0", "tcp://127.0.0.1:*", {"coordinator"}, lambda s, m: got.append(m.header.get("op")))
    try:
        me = p0.start()
        p0.connect("coordinator", addr)
        p0.send("coordinator", Hello(part="p0", address=me, pid=1, engine="torch", digest="b" * 64).frames())
        t0 = time.monotonic()
        with pytest.raises(FusionError, match=re.escape(f"CompNode 'p0' runs another plan: its digest is {'b' * 16}")):
            coord.start()  # p1 has not said hello: it is not waited for
        assert time.monotonic() - t0 < 30  # HELLO_GRACE_S (5 s) for the others' hellos, not the 60 s start-up timeout
        deadline = time.monotonic() + 10
        while "abort" not in got and time.monotonic() < deadline:
            time.sleep(0.05)
        assert "abort" in got  # the mismatched part is told too
    finally:
        p0.close(timeout_s=1, linger_s=0)
        coord.close()
