"""``fusion executor`` without ``--threads``: the host's cores shared among the plan's CompNode processes on the
same host (issue 38: two executors started by hand on one box, each with every core, ran 27x slower per step)."""
from types import SimpleNamespace

from fusion.commands.executor import default_threads


def _plan(addresses: dict[str, str], lanes: list[list[str]] | None = None):
    lanes = lanes or [[p] for p in addresses]
    return SimpleNamespace(parts={p: SimpleNamespace(address=a) for p, a in addresses.items()},
                           lane_of=lambda p: next(lane for lane in lanes if p in lane))


def test_the_cores_are_shared_among_the_processes_on_this_host():
    two_hosts = _plan({"part0": "tcp://10.0.0.1:5601", "part1": "tcp://10.0.0.2:5602"})
    assert default_threads(two_hosts, ["part0"], 16, env={}) == 16  # alone on its host: every core
    one_box = _plan({"part0": "tcp://127.0.0.1:5601", "part1": "tcp://127.0.0.1:5602", "part2": "tcp://10.0.0.9:1"})
    assert default_threads(one_box, ["part1"], 16, env={}) == 8
    assert default_threads(one_box, ["part1"], 1, env={}) == 1  # never 0
    lanes = _plan({f"p{i}": "tcp://[::1]:600%d" % i for i in range(4)}, lanes=[["p0", "p2"], ["p1", "p3"]])
    assert default_threads(lanes, ["p0", "p2"], 8, env={}) == 4  # interleaved: two processes of two parts each
    assert default_threads(_plan({"part0": "", "part1": ""}), ["part0"], 8, env={}) is None  # no address: torch's default


def test_an_omp_num_threads_the_user_set_is_kept():
    """Two executors in network namespaces of one 2-core box are hosts of their own by address; with the user's
    ``OMP_NUM_THREADS=1`` overridden by every core they ran their parts 3.7x slower (bench_wan, issue 36)."""
    two_hosts = _plan({"part0": "tcp://10.0.0.1:5601", "part1": "tcp://10.0.0.2:5602"})
    assert default_threads(two_hosts, ["part0"], 2, env={"OMP_NUM_THREADS": "1"}) is None  # torch honours it
    assert default_threads(two_hosts, ["part0"], 2, env={}) == 2
    assert default_threads(two_hosts, ["part0"], 2, env={"OMP_NUM_THREADS": ""}) == 2  # set but empty: not a choice
