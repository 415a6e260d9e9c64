"""The runtime's cost per action fitted to a measured step: the cost o that makes the replay of
a schedule's order (:func:`autosplit.schedules.simulate_schedule`) last the step measured.

Arithmetic only, no torch: :mod:`autosplit.measure.runtime_cost` measures the steps and calls these.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from autosplit import checks
from autosplit.errors import InvalidInputError
from autosplit.schedules import StageCosts, simulate_schedule
from autosplit.simulator import overlap_shares

__all__ = ["BLEND_ROUNDS", "fit_action_ms", "fit_weighed_action_ms"]

BLEND_ROUNDS = 2
"""How often the overlaps are replayed again from the costs they weighed (as
:data:`autosplit.verify.plans.BLEND_ROUNDS`)."""


def fit_action_ms(schedule: str, v: int, m: int, step_ms: float, p: int = 2,
                  costs: StageCosts | None = None) -> float:
    """The cost of one action (ms) for which the replay of ``schedule``'s order (p ranks, v
    stages per rank, m micro-batches) with the stages' ``costs`` (their ``action_ms`` ignored;
    ``None``: stages that cost nothing) lasts ``step_ms``; 0 when the replay without a cost per
    action lasts that long already.

    Without ``costs`` every action costs the same ``o`` and nothing else costs time, so the
    replayed step is ``o`` times the step of actions that cost one unit each: ``o = step_ms /
    units`` (a DualPipeV full backward, ``B`` beside its split ``I`` and ``W``, is one action
    too). With ``costs`` the replayed step grows with ``o`` continuously and without bound, and
    ``o`` is found by bisection (to 1e-6 ms).

    Raises:
        ArgumentTypeError, InvalidInputError: a count that is not a positive integer, a step
            that is not a finite number ≥ 0, ``costs`` that is not a StageCosts of p·v stages.
        ScheduleUnavailableError: torch's class cannot run (p, v, m).
    """
    checks.non_negative_finite("step_ms", step_ms, "ms")
    n = checks.positive_int("p", p) * checks.positive_int("v", v)
    checks.positive_int("m", m)
    if costs is None:
        zero = (0.0,) * n
        units = simulate_schedule(schedule, p, v, m,
                                  StageCosts(zero, zero, zero, action_ms=1.0)).step_ms
        return step_ms / units
    checks.instance_of("costs", costs, StageCosts, "a StageCosts")

    def replayed(o: float) -> float:
        return simulate_schedule(schedule, p, v, m,
                                 dataclasses.replace(costs, action_ms=o)).step_ms

    if replayed(0.0) >= step_ms:
        return 0.0
    low, high = 0.0, max(step_ms, 1e-3)
    while replayed(high) < step_ms:  # each action costs at least 1 ms more per step: bounded
        high *= 2.0
    while high - low > 1e-6:
        mid = (low + high) / 2.0
        low, high = (mid, high) if replayed(mid) < step_ms else (low, mid)
    return high


def fit_weighed_action_ms(schedule: str, v: int, m: int, step_ms: float,
                          alone: StageCosts, together: StageCosts, p: int = 2) -> float:
    """The cost of one action (ms) for which the replay of ``schedule``'s order lasts
    ``step_ms``, with each stage's costs weighed as a verified prediction weighs its stage
    times (:mod:`autosplit.verify.plans`): its costs ``alone`` (the other ranks idle) plus, for the
    share of its rank's work that overlaps another rank's in the replay
    (:func:`~autosplit.simulator.overlap_shares`, with the cost per action in it), the
    difference to its costs ``together`` (every rank computing at once); the shares are
    replayed again from the costs they weighed (:data:`BLEND_ROUNDS`).

    So the cost is what a prediction made the planner's way misses on the measuring stages.

    Raises:
        ArgumentTypeError, InvalidInputError: as :func:`fit_action_ms`; ``alone`` and
            ``together`` not StageCosts of one length.
    """
    checks.instance_of("alone", alone, StageCosts, "a StageCosts")
    checks.instance_of("together", together, StageCosts, "a StageCosts")
    if alone.n != together.n:
        raise InvalidInputError(f"alone has {alone.n} stages but together has {together.n}: "
                                "give both for the same stages")
    costs = alone
    o = fit_action_ms(schedule, v, m, step_ms, p, costs=costs)
    for _ in range(BLEND_ROUNDS):
        timeline = simulate_schedule(schedule, p, v, m, dataclasses.replace(costs, action_ms=o))
        shares = overlap_shares(timeline.actions)
        share = [shares[r] for r in timeline.order.stage_rank]
        costs = _weighed(alone, together, share)
        o = fit_action_ms(schedule, v, m, step_ms, p, costs=costs)
    return o


def _weighed(alone: StageCosts, together: StageCosts, share: Sequence[float]) -> StageCosts:
    """Per stage s, ``alone + share[s] · (together − alone)`` for every time (ms)."""
    def mix(a: Sequence[float], t: Sequence[float]) -> tuple[float, ...]:
        return tuple(x + w * (y - x) for x, y, w in zip(a, t, share))

    return StageCosts(mix(alone.fwd_ms, together.fwd_ms),
                      mix(alone.bwd_input_ms, together.bwd_input_ms),
                      mix(alone.bwd_weight_ms, together.bwd_weight_ms),  # type: ignore[arg-type]
                      bwd_whole_ms=mix(alone.bwd_whole_ms,  # type: ignore[arg-type]
                                       together.bwd_whole_ms))  # type: ignore[arg-type]
