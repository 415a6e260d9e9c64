"""Time the hypervisor takes from this machine's virtual cores, and the timings it disturbed.

On a virtual machine the hypervisor may run other guests on the physical cores behind this
machine's: a thread ready to run waits, and ``/proc/stat`` counts the wait as *steal* time. A
timing taken during a burst of it is slower for a reason that has nothing to do with the work
timed. On the development machines (2 virtual cores, AMD EPYC) the hypervisor took 5.5 core-s of
one profile's 33 s of timed rounds in an accuracy run (8 % of both cores on average, in bursts),
and that profile's plans measured 10–29 % above their predictions; the other profiles, with under
2 core-s stolen each, 0–21 %.

:class:`Window` reads the steal before and after a timing; :meth:`Window.disturbed` says whether
the hypervisor took more than :data:`MAX_SHARE` of all cores' time meanwhile. The profiler
(:func:`autosplit.measure.block_timing.measure_interleaved`, per round of a block's sizes) and the stage
timing (:func:`autosplit.verify.stage_timing.time_stages`, per run) set such timings aside, and use them
only where no other timing of the same thing is left.

``/proc/stat`` counts in ticks (10 ms on Linux): below :data:`MIN_JUDGED_S` stolen, too few
ticks to tell, a timing is never judged disturbed. Where ``/proc/stat`` cannot be read (not
Linux), nothing is.
"""

from __future__ import annotations

import os
import time

__all__ = ["MAX_SHARE", "MIN_JUDGED_S", "Window", "cpu_seconds", "disturbed"]

MAX_SHARE = 0.05
"""The share of all cores' time the hypervisor may take during a timing (a fraction): 5 % of a
2-core machine is a tenth of the core the timing runs on."""

MIN_JUDGED_S = 0.05
"""Core-seconds stolen below which a timing is not judged (5 ticks of /proc/stat)."""


def cpu_seconds() -> tuple[float, float] | None:
    """CPU time of the whole machine so far, in core-seconds: (busy — user, nice, system, irq and
    softirq —, stolen by the hypervisor), from ``/proc/stat``; ``None`` where it cannot be read."""
    try:
        with open("/proc/stat") as fh:
            values = [int(v) for v in fh.readline().split()[1:9]]
        tick = os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, AttributeError):
        return None
    if len(values) < 8:
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = values
    return (user + nice + system + irq + softirq) / tick, steal / tick


def disturbed(stolen_s: float, wall_s: float, cores: int, max_share: float = MAX_SHARE) -> bool:
    """Whether ``stolen_s`` core-seconds stolen during ``wall_s`` seconds on ``cores`` cores is
    more than ``max_share`` of their time, and enough (≥ :data:`MIN_JUDGED_S`) to tell."""
    return stolen_s >= MIN_JUDGED_S and stolen_s > max_share * wall_s * max(cores, 1)


class Window:
    """A stretch of wall time, from its creation: how much the hypervisor stole during it."""

    def __init__(self) -> None:
        self._start = time.perf_counter()
        self._before = cpu_seconds()

    def stolen_s(self) -> float | None:
        """Core-seconds stolen since the window opened (``None``: not readable)."""
        after = cpu_seconds()
        if self._before is None or after is None:
            return None
        return max(0.0, after[1] - self._before[1])

    def disturbed(self, max_share: float = MAX_SHARE) -> bool:
        """Whether the hypervisor took more than ``max_share`` of all cores' time since the
        window opened (:func:`disturbed`); ``False`` where that cannot be read."""
        stolen = self.stolen_s()
        wall = time.perf_counter() - self._start
        return stolen is not None and disturbed(stolen, wall, os.cpu_count() or 1, max_share)
