"""Discrete-event simulation of pipeline schedules (pure numbers, no torch).

Symbols: p stages (one device each, stage s on device s), m micro-batches, i a micro-batch.
``F(s, i)`` is the forward of micro-batch i on stage s and ``B(s, i)`` its backward.

The model of one training step:

* Each device runs one op at a time, in the fixed order its schedule gives, and starts an op as
  soon as the device is free *and* the op's inputs have arrived.
* ``F(s, i)`` needs ``F(s-1, i)`` to have finished plus the forward transfer over cut s-1
  (``comm_fwd_ms[s-1]``); ``F(0, i)`` needs nothing.
* ``B(s, i)`` needs the stage's own ``F(s, i)`` and, unless s is the last stage, ``B(s+1, i)``
  plus the backward transfer over cut s (``comm_bwd_ms[s]``). The loss is part of the last
  stage's forward, so ``B(p-1, i)`` may follow ``F(p-1, i)`` directly.
* A transfer starts once both its send and its receive are posted, and delays the receiver's
  op by its time: gloo (and NCCL) match a send with its receive before moving the bytes —
  measured between 2 gloo CPU workers, a receive of 6 MiB posted 50 ms after its send still
  took 2.2–3.0 ms, the whole transfer. The send is posted when the sender's op ends; torch's
  GPipe and 1F1B loops post each receive right before the op that needs it, when the device is
  free: ``F(s, i)`` starts at ``max(free, end of F(s-1, i)) + comm_fwd_ms[s-1]``.
* ``transfers_on_cores`` (gloo between CPU workers, whose cores make the copies): a transfer
  costs both ends its time of compute. The sender is busy for it right after the op whose
  output or gradient it sends; the receiver for the part of the transfer, started at a, that
  is made before the device is free (``clamp(free − a, 0, t)``, added to the op that needs
  it; the receive is posted when the device's last op ends, which its own sends' copies may
  outlast). Otherwise a transfer occupies neither device's compute (NCCL between GPUs). The
  same model as :func:`autosplit.schedules.replay`'s.

Schedules (device order of ops):

* ``"gpipe"`` (GPipe, Huang et al. 2019): ``F(s, 0) … F(s, m-1)``, then
  ``B(s, m-1) … B(s, 0)`` (backward in reverse micro-batch order). With the same forward time f
  and backward time b on every stage and no transfers, the step takes exactly
  ``(m + p - 1) · (f + b)``.
* ``"1f1b"`` (PipeDream-flush, Narayanan et al. 2021): stage s runs ``w = min(m, p - s)``
  warm-up forwards ``F(s, 0) … F(s, w-1)``, then alternates ``B(s, j), F(s, w + j)`` for
  ``j = 0 … m-w-1``, then drains ``B(s, m-w) … B(s, m-1)``. Same step time as GPipe on balanced
  stages, but stage s holds at most ``min(m, p - s)`` micro-batches' activations instead of m.

Since every device's order is fixed, the simulation is exact: each op's start time is
``max(device free, inputs ready)``, evaluated in dependency order (an event loop that advances
each device while the inputs of its next op are known). The result does not depend on the order
in which independent devices are advanced, so there are no ties to break.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

from autosplit import checks
from autosplit.errors import InvalidInputError
from autosplit.records import Plan
from autosplit.validation import KNOWN_SCHEDULES

__all__ = [
    "SCHEDULES", "Event", "Interval", "SimResult", "copies_on_cores", "overlap_fractions",
    "overlap_shares", "schedule_order", "simulate", "simulate_plan", "warmup_forwards",
]


class Interval(Protocol):
    """Something that runs from ``start_ms`` to ``end_ms`` (ms)."""

    @property
    def start_ms(self) -> float: ...

    @property
    def end_ms(self) -> float: ...


SCHEDULES = KNOWN_SCHEDULES
"""Schedule names a plan may name: :func:`simulate_plan` replays the others (and any plan with
several stages per rank or a checkpointed stage) with :mod:`autosplit.schedules`."""

SIMULATED = ("gpipe", "1f1b")
"""Schedule names :func:`simulate` itself orders (one stage per device)."""


@dataclass(frozen=True, slots=True)
class Event:
    """One op of the simulated step.

    Attributes:
        stage: stage (= device) index s, 0-based.
        kind: ``"F"`` forward or ``"B"`` backward.
        microbatch: micro-batch index i, 0-based.
        start_ms: when the device starts the op (ms from the step's start).
        end_ms: when it finishes (ms).
    """

    stage: int
    kind: Literal["F", "B"]
    microbatch: int
    start_ms: float
    end_ms: float

    @property
    def duration_ms(self) -> float:
        """``end_ms - start_ms`` (ms)."""
        return self.end_ms - self.start_ms


@dataclass(frozen=True, slots=True)
class SimResult:
    """The simulated timeline of one training step.

    Attributes:
        schedule: ``"gpipe"`` or ``"1f1b"``.
        step_ms: makespan: the end of the last op on any device (ms).
        events: ``events[s]`` is stage s's ops in execution order.
        peak_in_flight: ``peak_in_flight[s]`` is the largest number of micro-batches whose
            activations stage s holds at one instant: micro-batch i counts on stage s from the
            end of ``F(s, i)`` until the end of ``B(s, i)`` (half-open ``[F.end, B.end)``: its
            saved tensors exist once the forward is done and are freed when its backward
            finishes). Because a device runs one op at a time, this is the maximum over
            prefixes of the stage's op order of (forwards done − backwards done); it depends
            only on the schedule: GPipe ``m``, 1F1B ``min(m, p - s)``.
        busy_ms: ``busy_ms[s]`` is the total compute time of stage s: ``m · (f_s + b_s)`` (ms).
        bubble_fraction: idle share of the p devices over the step,
            ``1 - Σ busy_ms / (p · step_ms)`` (0 when ``step_ms`` is 0).
    """

    schedule: str
    step_ms: float
    events: tuple[tuple[Event, ...], ...]
    peak_in_flight: tuple[int, ...]
    busy_ms: tuple[float, ...]
    bubble_fraction: float

    @property
    def p(self) -> int:
        """Number of stages."""
        return len(self.events)


def warmup_forwards(m: int, p: int, s: int) -> int:
    """1F1B's warm-up on stage s of p with m micro-batches: the forwards it runs before its
    first backward, ``min(m, p - s)``, which is also the most micro-batches it holds at once."""
    return min(m, p - s)


def schedule_order(schedule: str, m: int, p: int, s: int) -> tuple[tuple[str, int], ...]:
    """The order in which stage s runs its ops: ``(("F", 0), ("F", 1), …, ("B", 0))``.

    Raises:
        InvalidInputError: unknown schedule name.
    """
    if schedule == "gpipe":
        return tuple(("F", i) for i in range(m)) + tuple(("B", i) for i in reversed(range(m)))
    if schedule == "1f1b":
        w = warmup_forwards(m, p, s)
        order: list[tuple[str, int]] = [("F", i) for i in range(w)]
        for j in range(m - w):
            order += [("B", j), ("F", w + j)]
        order += [("B", i) for i in range(m - w, m)]
        return tuple(order)
    raise InvalidInputError(f"unknown schedule {schedule!r}: use one of {', '.join(SIMULATED)}")


def _times(
    values: Sequence[float], what: str, length: int | None, per: str = "stage"
) -> tuple[float, ...]:
    return checks.sequence_of(
        what, values, lambda name, v: checks.non_negative_finite(name, v, "ms"),
        length=length, per=per, allow_empty=length == 0,
    )


def simulate(
    fwd_ms: Sequence[float],
    bwd_ms: Sequence[float],
    m: int,
    schedule: str = "gpipe",
    comm_fwd_ms: Sequence[float] | None = None,
    comm_bwd_ms: Sequence[float] | None = None,
    transfers_on_cores: bool = False,
) -> SimResult:
    """Simulate one training step of a p-stage pipeline over m micro-batches.

    Args:
        fwd_ms: forward time of one micro-batch on each stage (ms), length p ≥ 1.
        bwd_ms: backward time of one micro-batch on each stage (ms), length p.
        m: number of micro-batches, ≥ 1.
        schedule: ``"gpipe"`` or ``"1f1b"`` (see the module docstring for the op orders).
        comm_fwd_ms: ``comm_fwd_ms[c]`` is the time to send one micro-batch's activations over
            cut c (from stage c to c+1), length p - 1; default no delay.
        comm_bwd_ms: ``comm_bwd_ms[c]`` is the time to send the gradients back over cut c
            (from stage c+1 to c), length p - 1; default no delay.
        transfers_on_cores: whether a transfer costs both devices compute (see the module
            docstring); default off.

    Returns:
        The timeline, step time, per-stage busy time, bubble fraction and peak in-flight count.

    Raises:
        ArgumentTypeError: a time that is not a number, times that are not a list, an ``m``
            that is not an int, a schedule that is not a string.
        InvalidInputError: a negative or non-finite time, no stage, mismatched lengths,
            m < 1 or an unknown schedule.
    """
    fwd = _times(fwd_ms, "fwd_ms", None)
    p = len(fwd)
    bwd = _times(bwd_ms, "bwd_ms", p)
    m = checks.positive_int("m (micro-batches)", m)
    checks.one_of("schedule", schedule, SIMULATED)
    none = (0.0,) * (p - 1)
    cf = none if comm_fwd_ms is None else _times(comm_fwd_ms, "comm_fwd_ms", p - 1, "cut")
    cb = none if comm_bwd_ms is None else _times(comm_bwd_ms, "comm_bwd_ms", p - 1, "cut")

    orders = [schedule_order(schedule, m, p, s) for s in range(p)]
    end: dict[tuple[str, int, int], float] = {}  # (kind, s, i) -> end time (ms)
    events: list[list[Event]] = [[] for _ in range(p)]
    cursor = [0] * p  # next op index per device
    free = [0.0] * p  # when each device is next free, its sends' copies made (ms)
    last = [0.0] * p  # when each device's last op ended: where it posts a receive (ms)
    on_cores = checks.instance_of("transfers_on_cores", transfers_on_cores, bool, "True or False")
    remaining = p * 2 * m
    while remaining:
        progressed = False
        for s in range(p):
            while cursor[s] < len(orders[s]):
                kind, i = orders[s][cursor[s]]
                # a receive is posted when the device reaches the op (torch's GPipe and 1F1B
                # loops post it right before), and the transfer starts once it is posted
                window: tuple[float, float] | None = None  # (start, time) of a transfer
                if kind == "F":
                    if s and ("F", s - 1, i) not in end:
                        break
                    if s:
                        window = (max(last[s], end["F", s - 1, i]), cf[s - 1])
                    ready, duration = 0.0, fwd[s]
                else:
                    if ("F", s, i) not in end or (s < p - 1 and ("B", s + 1, i) not in end):
                        break
                    ready, duration = end["F", s, i], bwd[s]
                    if s < p - 1:
                        window = (max(last[s], end["B", s + 1, i]), cb[s])
                if window is not None:
                    ready = max(ready, window[0] + window[1])
                    if on_cores:  # the part of the copy made while the device was busy
                        duration += min(max(free[s] - window[0], 0.0), window[1])
                start = max(free[s], ready)
                finish = start + duration
                end[kind, s, i] = finish
                last[s] = free[s] = finish
                if on_cores and kind == "F" and s < p - 1:
                    free[s] += cf[s]  # the copy of the send
                elif on_cores and kind == "B" and s > 0:
                    free[s] += cb[s - 1]
                events[s].append(Event(s, kind, i, start, finish))  # type: ignore[arg-type]
                cursor[s] += 1
                remaining -= 1
                progressed = True
        assert progressed, f"schedule {schedule!r} deadlocked at {cursor}"  # internal invariant

    step = max(last)
    busy = tuple(math.fsum(e.duration_ms for e in row) for row in events)
    peaks = []
    for row in events:
        held = peak = 0
        for e in row:
            held += 1 if e.kind == "F" else -1
            peak = max(peak, held)
        peaks.append(peak)
    bubble = 1.0 - math.fsum(busy) / (p * step) if step > 0 else 0.0
    return SimResult(
        schedule=schedule,
        step_ms=step,
        events=tuple(tuple(row) for row in events),
        peak_in_flight=tuple(peaks),
        busy_ms=busy,
        bubble_fraction=bubble,
    )


def simulate_plan(plan: Plan, transfers_on_cores: bool | None = None) -> SimResult:
    """Simulate one training step of a plan (each stage's transfer split evenly: half for the
    activations going forward, half for the gradients coming back), its transfers costing
    its ranks compute where ``transfers_on_cores`` says so (``None``: where its stages are
    on CPU workers, :func:`copies_on_cores`; ``False`` for stage times that include the
    copies already, as times taken inside torch's runtime do).

    GPipe and 1F1B with one stage per device and no checkpointed stage: :func:`simulate`,
    the runtime's cost per action (``Plan.action_ms``) added to every forward and backward
    (equal to the replay of torch's order wherever torch's class runs the plan). Any other
    plan: the replay of torch's own order (:func:`autosplit.schedules.replay`),
    one row of ``events`` per rank (``I`` and ``W`` shown as ``"B"``), each stage's
    recomputation and split backward (``Stage.weight_grad_ms``) included.

    Raises:
        ArgumentTypeError: ``plan`` is not a :class:`~autosplit.records.Plan`.
        ScheduleUnavailableError: torch's class cannot run the plan's ranks and micro-batches.
    """
    checks.instance_of("plan", plan, Plan, "an autosplit Plan")
    comm = [s.send_ms / 2 for s in plan.stages[:-1]]
    cores = copies_on_cores(plan) if transfers_on_cores is None else checks.instance_of(
        "transfers_on_cores", transfers_on_cores, bool, "True, False or None")
    if (plan.schedule not in SIMULATED or plan.stages_per_rank > 1
            or any(s.checkpoint for s in plan.stages)):
        return _replayed(plan, comm, cores)
    act = plan.action_ms  # the replay's cost per action, as tests/test_schedules.py checks
    return simulate(
        [s.forward_ms + act for s in plan.stages],
        [max(s.compute_ms - s.forward_ms, 0.0) + act for s in plan.stages],
        plan.microbatches,
        plan.schedule,
        comm,
        comm,
        transfers_on_cores=cores,
    )


def copies_on_cores(plan: Plan) -> bool:
    """Whether the plan's transfers cost its ranks compute: stages on CPU workers, which
    send to each other through gloo, their own cores copying the bytes (see the module
    docstring)."""
    return all(s.device.split(":")[0] == "cpu" for s in plan.stages)


def _replayed(plan: Plan, comm: list[float], cores: bool) -> SimResult:
    """:func:`simulate_plan` through :mod:`autosplit.schedules` (one row per rank)."""
    from autosplit.schedules import StageCosts, simulate_schedule

    v = plan.stages_per_rank
    costs = StageCosts(
        fwd_ms=tuple(s.forward_ms for s in plan.stages),
        bwd_input_ms=tuple(max(s.compute_ms - s.forward_ms - s.weight_grad_ms, 0.0)
                           for s in plan.stages),
        bwd_weight_ms=tuple(s.weight_grad_ms for s in plan.stages),
        checkpoint=tuple(s.checkpoint for s in plan.stages),
        comm_fwd_ms=tuple(comm), comm_bwd_ms=tuple(comm), action_ms=plan.action_ms,
        bwd_whole_ms=None if all(s.whole_backward_ms is None for s in plan.stages) else tuple(
            s.compute_ms - s.forward_ms if s.whole_backward_ms is None else s.whole_backward_ms
            for s in plan.stages),
        transfers_on_cores=cores,
    )
    timeline = simulate_schedule(plan.schedule, len(plan.stages) // v, v, plan.microbatches,
                                 costs)
    events = tuple(
        tuple(Event(t.rank, "F" if t.kind == "F" else "B", t.microbatch, t.start_ms, t.end_ms)
              for t in row)
        for row in timeline.actions
    )
    peaks = []
    for row in timeline.order.actions:
        held = peak = 0
        last = {(a.stage, a.microbatch): a.kind for a in row if a.kind in ("B", "W")}
        for a in row:
            held += 1 if a.kind == "F" else -(last[a.stage, a.microbatch] == a.kind)
            peak = max(peak, held)
        peaks.append(peak)
    return SimResult(plan.schedule, timeline.step_ms, events, tuple(peaks), timeline.busy_ms,
                     timeline.bubble_fraction)


def overlap_fractions(result: SimResult) -> tuple[float, ...]:
    """Per row of ``result.events`` (a device, or a rank), the share of its busy time during
    which another row is busy too (0 … 1; 0 for a row that does nothing).

    On a CPU the workers slow each other down while both compute (:mod:`autosplit.measure.contention`);
    this is how much of each one's work is exposed to that."""
    return overlap_shares(result.events)


def overlap_shares(rows: Sequence[Sequence[Interval]]) -> tuple[float, ...]:
    """Per row of intervals (anything with ``start_ms`` and ``end_ms``: a simulation's events,
    a replayed :class:`~autosplit.schedules.Timeline`'s actions; one at a time in each row),
    the share of the row's busy time during which another row is busy too (0 … 1; 0 for a
    row that does nothing)."""
    rows = [sorted(row, key=lambda e: e.start_ms) for row in rows]  # one op at a time
    edges = sorted({t for row in rows for e in row for t in (e.start_ms, e.end_ms)})
    busy = [0.0] * len(rows)
    shared = [0.0] * len(rows)
    at = [0] * len(rows)  # per row, the first op that has not ended before the current piece
    for lo, hi in itertools.pairwise(edges):
        mid = (lo + hi) / 2
        on = []
        for r, row in enumerate(rows):
            while at[r] < len(row) and row[at[r]].end_ms <= mid:
                at[r] += 1
            on.append(at[r] < len(row) and row[at[r]].start_ms <= mid)
        for r, yes in enumerate(on):
            if yes:
                busy[r] += hi - lo
                if sum(on) > 1:
                    shared[r] += hi - lo
    return tuple(sh / b if b > 0 else 0.0 for sh, b in zip(shared, busy))
