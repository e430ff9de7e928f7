"""Test-session settings.

Tiny ops on a 2-core machine spend their time waiting on torch's second
intra-op thread; one thread makes the suite several times faster and its
timings steadier. Child processes get OMP_NUM_THREADS=1 from .ci/run.

The compile cache is off (``FUSION_CACHE=off``) unless a test points it at a folder of its own.

The ``cli`` fixture runs `fusion` commands: each in a process of its own forked from one server that imported
torch once (tests/fusion/forked_cli.py). One server serves the whole session, since it keeps nothing between
commands but the modules it imported; its start costs about 5 s of CPU, each command it forks saves 2-4 s.
"""
import os

import pytest
import torch

torch.set_num_threads(1)
# the compile cache off in every test (and every `fusion` process a test starts): tests compile afresh as before,
# and never read or write the user's ~/.cache/fusion; tests/fusion/test_compile_cache.py points it at tmp_path
os.environ["FUSION_CACHE"] = "off"


@pytest.fixture(scope="session")
def cli(tmp_path_factory):
    """The session's forked-command server: ``cli.run(ARGV, CWD, TIMEOUT, env=...)`` runs ``fusion ARGV``."""
    from tests.fusion.forked_cli import ForkedCli, fusion_env

    with ForkedCli(fusion_env(), tmp_path_factory.mktemp("cli-outputs")) as server:
        yield server
