"""Micro-batch schedules as data (moved to :mod:`fusion.ir.schedule`, so that the compiler can price
schedules without importing the executors); the runtime's names, re-exported."""
from fusion.ir.schedule import (LANE_SCHEDULES, SCHEDULES, Action, ActionKind, TailKind, gpipe,  # noqa: F401
                                interleaved_1f1b, make_lanes, make_schedule, one_f_one_b, part_depths,
                                splits_backward, step_tail, zero_bubble)
