"""What the profiler measures and for how long: the micro-batch sizes worth measuring, those
that fit the time budget, whether one more round of a block still fits, and when a figure's
spread has settled.

Policy only: :mod:`autosplit.measure.block_timing` times, this module decides when to stop.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence

from autosplit import checks

__all__ = ["SPREAD_TOLERANCE", "Deadline", "bracketing_count", "default_microbatch_sizes",
           "spread_settled", "within_budget"]

SPREAD_TOLERANCE = 0.05
"""Repeats go on (up to the cap) while a figure's interquartile range exceeds this share of its
median (or 0.01 ms, for tiny blocks)."""


def within_budget(sizes: Sequence[int], b0: int, estimate_ms: Sequence[float], runs: int,
                   elapsed_s: float, budget_s: float | None, always: int) -> list[int]:
    """The sizes, in order of preference, whose estimated measurement fits the budget (the
    first ``always`` are kept whatever it costs). Cost scales with b from the warm-up's."""
    if budget_s is None:
        return list(sizes)
    per_sample_s = sum(estimate_ms) / 1000.0 / b0 * runs
    chosen, total = [], elapsed_s
    for k, b in enumerate(sizes):
        if k >= always and total + per_sample_s * b > budget_s:
            break
        chosen.append(b)
        total += per_sample_s * b
    return chosen


class Deadline:
    """Whether one more round of repeats still fits the time budget, leaving the estimated
    time of the blocks not yet measured."""

    def __init__(self, start: float, budget_s: float | None, estimate_ms: Sequence[float],
                 scale: dict[int, float], runs: int) -> None:
        self.start, self.budget_s = start, budget_s
        per_block = [e / 1000.0 * sum(scale.values()) * runs for e in estimate_ms]
        self.rest_s = [sum(per_block[i + 1:]) for i in range(len(per_block))]

    def allows(self, block: int, round_s: float) -> bool:
        if self.budget_s is None:
            return True
        elapsed = time.perf_counter() - self.start
        return elapsed + round_s + self.rest_s[block] <= self.budget_s


def spread_settled(values: Sequence[float]) -> bool:
    """At least 3 values whose interquartile range is within :data:`SPREAD_TOLERANCE` of
    their median (or 0.01 ms)."""
    if len(values) < 3:
        return False
    q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q3 - q1 <= max(SPREAD_TOLERANCE * statistics.median(values), 0.01)


def default_microbatch_sizes(batch_size: int, stages: int = 2, max_count: int = 8) -> list[int]:
    """The micro-batch sizes worth measuring for a batch of B on p stages, most useful first.

    Sizes b that split B into m whole micro-batches, for m from 1 up to
    ``max(max_count, 4·p)``, ordered by how near m is to 3·p (enough micro-batches to hide the
    pipeline bubble, not so many that each is small and slow). The profiler measures them in
    this order until its time budget is spent.
    """
    batch_size = checks.positive_int("batch_size", batch_size)
    stages = checks.positive_int("stages", stages)
    max_count = checks.positive_int("max_count", max_count)
    top = max(max_count, 4 * stages)
    ms = [m for m in range(1, min(top, batch_size) + 1) if batch_size % m == 0]
    ms.sort(key=lambda m: (abs(m - 3 * stages), -m))
    return [batch_size // m for m in ms]


def bracketing_count(sizes: Sequence[int], batch_size: int, stages: int) -> int:
    """How many of ``sizes`` (in order) to measure whatever the budget: up to the first size
    of fewer micro-batches than 3·p and the first of more (m = ⌈B / b⌉), where the list has
    them, so that the planner weighs the bubble against the cost per sample from both sides
    (at least 1). For B = 120 on 2 stages: 20 (m = 6), 24 (m = 5), 15 (m = 8), i.e. 3."""
    target = 3 * stages
    fewer = next((k for k, b in enumerate(sizes) if -(-batch_size // b) < target), None)
    more = next((k for k, b in enumerate(sizes) if -(-batch_size // b) > target), None)
    return max(1, *(k + 1 for k in (fewer, more) if k is not None))
