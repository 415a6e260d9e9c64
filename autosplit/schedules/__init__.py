"""Every schedule torch.distributed.pipelining can run, simulated from torch's own order.

:mod:`~autosplit.schedules.torch_order` gets each rank's action order from torch's schedule
classes (no process group); :mod:`~autosplit.schedules.replay` replays it as a discrete-event
simulation with per-stage costs and reports the step time, each rank's busy and idle time, and
the memory in flight on each rank over time. The planner's ``schedule="auto"`` searches with it
(:mod:`autosplit.planner.schedules`, :mod:`autosplit.solve.joint`); GPipe and 1F1B fixed by
name are still planned with :mod:`autosplit.simulator`.
"""

from autosplit.schedules.replay import StageCosts, TimedAction, Timeline, replay, simulate_schedule
from autosplit.schedules.torch_order import (
    SCHEDULES,
    SEARCHED,
    SPLIT_BACKWARD,
    Action,
    ScheduleOrder,
    torch_class_name,
    torch_order,
)

__all__ = [
    "SCHEDULES",
    "SEARCHED",
    "SPLIT_BACKWARD",
    "Action",
    "ScheduleOrder",
    "StageCosts",
    "TimedAction",
    "Timeline",
    "replay",
    "simulate_schedule",
    "torch_class_name",
    "torch_order",
]
