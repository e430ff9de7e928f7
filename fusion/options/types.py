"""The value types of options: each parses one command-line (or ``--config``) string into a value and says what
was expected otherwise (``argparse.ArgumentTypeError``, which argparse turns into ``argument --steps: ...``)."""
from __future__ import annotations

import argparse
from typing import Callable


def _number(parse: Callable[[str], float], kind: str, ok: Callable[[float], bool], rule: str):
    """A type that parses with ``parse`` and accepts a value only when ``ok(value)``.

    ``kind`` names what was expected ("a whole number"), ``rule`` what ``ok`` checks ("must be at least 1")."""
    def check(text: str):
        try:
            v = parse(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {kind}, got {text!r}") from None
        if not ok(v):
            raise argparse.ArgumentTypeError(f"{rule}, got {text}")
        return v
    return check


#: an integer >= 1, an integer >= 0, a finite number of seconds > 0
positive_int = _number(int, "a whole number", lambda v: v >= 1, "must be at least 1")
non_negative_int = _number(int, "a whole number", lambda v: v >= 0, "must be 0 or more")
positive_float = _number(float, "a number", lambda v: 0 < v < float("inf"), "must be a positive number of seconds")
#: a finite number > 0 (not a time)
positive_finite = _number(float, "a number", lambda v: 0 < v < float("inf"), "must be a positive number")
#: a seed NumPy and torch both take: a whole number from 0 to 2**32 - 1
seed_int = _number(int, "a whole number", lambda v: 0 <= v < 2 ** 32, "must be 0 to 4294967295")
#: a finite number of seconds >= 0
non_negative_seconds = _number(float, "a number", lambda v: 0 <= v < float("inf"), "must be 0 or more seconds")
#: ``--steps-ahead``: 0 (lock step) up to executors/runtime/step_ahead.py's MAX_AHEAD (1; the options layer may not
#: import the executors: tests/fusion/test_step_ahead_option.py holds the two equal)
STEPS_AHEAD_MAX = 1
steps_ahead_count = _number(int, "a whole number", lambda v: 0 <= v <= STEPS_AHEAD_MAX,
                            f"must be 0 (lock step) to {STEPS_AHEAD_MAX}")
#: a percentage in [0, 100)
percentage = _number(float, "a percentage", lambda v: 0 <= v < 100, "must be in [0, 100)")


def zmq_address(text: str) -> str:
    """``tcp://HOST:PORT`` (or ``ipc://PATH``); says what is expected otherwise."""
    proto, sep, rest = text.partition("://")
    if not sep or proto not in ("tcp", "ipc", "inproc") or not rest:
        raise argparse.ArgumentTypeError(f"{text!r} is not an address: expected tcp://HOST:PORT "
                                         f"(e.g. tcp://*:5600 to listen, tcp://10.0.0.1:5600 to connect)")
    if proto == "tcp":
        host, colon, port = rest.rpartition(":")
        if not colon or not host or not (port == "*" or port.isdigit() and 0 < int(port) < 65536):
            raise argparse.ArgumentTypeError(f"{text!r}: expected tcp://HOST:PORT with a port 1-65535 (or *)")
    return text


def join_at(text: str) -> tuple[int, int]:
    """``STEP:REPLICA`` (replica REPLICA starts late and joins before step STEP)."""
    step, sep, rep = text.partition(":")
    if not sep or not step.isdigit() or not rep.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r}: expected STEP:REPLICA, e.g. 4:2 (replica 2 joins before step 4)")
    return int(step), int(rep)
