"""Micro-batch schedules as data (moved to :mod:`fusion.ir.schedule`, so that the compiler can price
schedules without importing the executors); the runtime's names, re-exported."""
from fusion.ir.schedule import (SCHEDULES, Action, gpipe, make_schedule, one_f_one_b, part_depths,  # noqa: F401
                                splits_backward, zero_bubble)
