"""What is timed to verify a plan: each stage's runs, beside what, with how many micro-batches
in flight, and what a session of them costs (see :mod:`autosplit.verify.plans`).

A plan's stages are timed as they run (:func:`timed_items`): each beside what the neighbouring
worker runs meanwhile, and, for a pipeline, alone too; on a zero-bubble schedule with the
backward in two passes, and under activation checkpointing where the plan checkpoints.
:func:`session_runs` gathers the runs of several plans timed in one session (a run two plans
share is timed once) and :func:`session_estimate_s` says, from block sums, about how long the
session takes.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

from autosplit.cost import single_device_ms
from autosplit.errors import AutosplitError
from autosplit.records import Plan, Profile
from autosplit.schedules import SPLIT_BACKWARD, ScheduleOrder, torch_order
from autosplit.stages import block_ranges
from autosplit.verify.stage_timing import (
    Beside,
    Checkpointed,
    Item,
    SplitBackward,
    StageRun,
    as_beside,
)

__all__ = ["IN_FLIGHT_CAP_MS", "SESSION_START_S", "depths", "order_of", "session_estimate_s",
           "session_runs", "stage_ranks", "stage_runs", "timed_items", "timed_runs",
           "whole_items"]

IN_FLIGHT_CAP_MS = 1000.0
"""A stage run is timed with its schedule's micro-batches in flight when they take at most this
long by block sums (ms), else one at a time: longer rounds would not fit the budget, and where
the effect was measured on such long runs (ResNet50's stages) it was within 0.5 %."""


def order_of(plan: Plan) -> ScheduleOrder | None:
    """torch's own action order for ``plan`` (``None`` where torch's class cannot run it)."""
    v = plan.stages_per_rank
    try:
        return torch_order(plan.schedule, len(plan.stages) // v, v, plan.microbatches)
    except AutosplitError:
        return None


def depths(plan: Plan) -> list[int]:
    """Per stage, the most micro-batches its schedule keeps in flight (forwards whose backward
    has not started, in torch's own order: m on every GPipe stage, 1 on 1F1B's last), or 1 where
    that many would take longer than :data:`IN_FLIGHT_CAP_MS` by block sums."""
    n = len(plan.stages)
    order = order_of(plan)
    if order is None:
        return [1] * n
    live, peak = [0] * n, [1] * n
    for row in order.actions:
        for a in row:
            live[a.stage] += 1 if a.kind == "F" else -1 if a.kind in ("B", "I") else 0
            peak[a.stage] = max(peak[a.stage], live[a.stage])
    return [d if d * s.compute_ms <= IN_FLIGHT_CAP_MS else 1 for d, s in zip(peak, plan.stages)]


def stage_runs(plan: Plan) -> list[StageRun]:
    return [(first, end, plan.split_size) for first, end in block_ranges(plan.balance)]


def timed_runs(plan: Plan, beside: bool = True) -> list[Beside]:
    """What is timed for ``plan``: each stage's run beside what a neighbouring worker runs
    meanwhile — the next stage on another rank (after the last stage, the first ones again:
    a V-shaped schedule's rank 0 runs the first and the last stage, which never run at the
    same time), the same stage for one stage on several replicas, nothing (the other cores
    idle) for one stage on one device — then, for a plan of several stages and with
    ``beside``, each stage's run alone (a pipeline's workers compute at the same time only for
    part of the step: :func:`autosplit.verify.plans._stage_times`)."""
    runs = stage_runs(plan)
    n = len(runs)
    if n == 1:
        return [(runs[0], runs[0] if plan.replicas > 1 else None)]
    ranks = stage_ranks(plan)
    out: list[Beside] = []
    for s, r in enumerate(runs):
        nxt = next((t % n for t in range(s + 1, s + n) if ranks[t % n] != ranks[s]),
                   (s + 1) % n)  # (every stage on one rank: the next one)
        out.append((r, runs[nxt]))
    return out + [(r, None) for r in runs] if beside else out


def timed_items(plan: Plan, beside: bool = True) -> list[Item]:
    """:func:`timed_runs`, each wrapped in :class:`SplitBackward` on a zero-bubble schedule
    (:data:`~autosplit.schedules.SPLIT_BACKWARD`) where the stage's inputs need a gradient (all
    stages but the model's first, whose backward torch runs whole, as weight work), and in
    :class:`Checkpointed` where the plan checkpoints the stage."""
    runs = timed_runs(plan, beside)
    n = len(plan.stages)
    items: list[Item] = []
    for k, r in enumerate(runs):
        item: Item = SplitBackward(r) if plan.schedule in SPLIT_BACKWARD and r[0][0] > 0 else r
        items.append(Checkpointed(item) if plan.stages[k % n].checkpoint else item)
    return items


def whole_items(plan: Plan, beside: bool = True) -> list[Beside]:
    """:func:`timed_runs` with the backward whole, for a zero-bubble schedule that runs some
    backwards of a stage timed split (:func:`timed_items`) in one pass (DualPipeV's ``B``
    actions: :attr:`~autosplit.records.Stage.whole_backward_ms`); else none."""
    order = order_of(plan) if plan.schedule in SPLIT_BACKWARD else None
    if order is None:
        return []
    whole = {a.stage for row in order.actions for a in row if a.kind == "B"}
    firsts = [first for first, _ in block_ranges(plan.balance)]
    return timed_runs(plan, beside) if any(firsts[s] > 0 for s in whole) else []


def stage_ranks(plan: Plan) -> list[int]:
    """The rank that runs each stage, as torch's class places it
    (:attr:`~autosplit.schedules.ScheduleOrder.stage_rank`; stage s on rank s mod p where
    torch's class cannot run the plan)."""
    order = order_of(plan)
    if order is None:
        n = len(plan.stages)
        return [s % max(n // plan.stages_per_rank, 1) for s in range(n)]
    return list(order.stage_rank)


def session_runs(profile: Profile, plans: Mapping[str, Plan], one_device: bool, beside: bool,
                 whole: Callable[[int], bool]
                 ) -> tuple[list[Any], dict[Any, int], dict[str, tuple[Beside, ...]]]:
    """What a session of :func:`autosplit.verify.plans.time_plans` times: the runs, the micro-batches each keeps in
    flight (a run two plans share: the deeper of the two), and the ways one device is timed
    per plan."""
    n = len(profile.blocks)
    singles: dict[str, tuple[Beside, ...]] = {}  # the ways one device may run each batch
    for name, plan in plans.items():
        _, b_one = single_device_ms(profile, plan.batch_size)
        ways: list[Beside] = [((0, n, b_one), None)] if one_device else []
        if one_device and whole(plan.batch_size) and b_one != plan.batch_size:
            ways.append(((0, n, plan.batch_size), None))
        singles[name] = tuple(ways)
    runs: list[Any] = [r for plan in plans.values()
                       for r in (*timed_items(plan, beside), *whole_items(plan, beside))]
    runs += [r for ways in singles.values() for r in ways]
    deepest: dict[Any, int] = {}
    for plan in plans.values():
        plan_depths = depths(plan)
        for items in (timed_items(plan, beside), whole_items(plan, beside)):
            for r, d in zip(items, plan_depths * 2):
                deepest[r] = max(deepest.get(r, 1), d)
    return list(dict.fromkeys(runs)), deepest, singles


SESSION_START_S = 3.0
"""What a session costs besides its rounds (s): the timing and neighbouring processes' start,
the model's copy (about 2 s each on the development machines)."""


def session_estimate_s(profile: Profile, plans: Mapping[str, Plan], one_device: bool = True,
                       *, beside: bool = True, whole_batch: bool = True, warmup: int = 1,
                       rounds: int = 3) -> float:
    """About how long a session of :func:`time_plans` takes (s), by block sums: ``warmup`` +
    ``rounds`` rounds of every run, each its blocks' forward and backward at its micro-batch
    size times the micro-batches it keeps in flight (the whole batch at once at the per-sample
    cost of the largest size measured), plus :data:`SESSION_START_S`."""
    sizes = profile.microbatch_sizes
    runs, deepest, _ = session_runs(profile, plans, one_device, beside, lambda batch: whole_batch)
    total = 0.0
    for item in runs:
        (first, end, b), _ = as_beside(item)
        k = sizes.index(b) if b in sizes else len(sizes) - 1
        ms = math.fsum(blk.fwd_ms[k] + blk.bwd_ms[k] for blk in profile.blocks[first:end])
        total += ms * (b / sizes[k]) * deepest.get(item, 1)
    return SESSION_START_S + (warmup + max(rounds, 2)) * total / 1000.0
