"""A chosen balance and micro-batch size made into a :class:`~autosplit.records.Plan`.

The stages with their predicted times and memory, the shared weights and the simulated step
(:func:`assemble`); and, when nothing fits, what the smallest plan would need
(:func:`explain_infeasible`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from autosplit.cost import (
    allreduce_ms,
    single_device_ms,
    step_ms,
)
from autosplit.errors import (
    InfeasiblePlanError,
)
from autosplit.planner.problems import (
    counted_twice,
    partition_problem,
    runtime_action_ms,
    slowest_update_ms,
    stage_transient_bytes,
    transient_bytes,
    unit_transient_bytes,
    update_table,
)
from autosplit.planner.settings import PlanSettings
from autosplit.records import Plan, Profile, SharedWeight, Stage
from autosplit.simulator import simulate_plan
from autosplit.solve import evaluate, min_capacity
from autosplit.units import format_bytes

__all__ = ["assemble", "explain_infeasible", "shared_weights"]


def shared_weights(
    settings: PlanSettings, profile: Profile, bounds: Sequence[tuple[int, int]],
    ranks: Sequence[int] | None = None,
) -> tuple[SharedWeight, ...]:
    """Where each shared parameter is used, and how ``autosplit run`` keeps it equal.

    ``ranks[s]``: the rank that runs stage s (default: stage s on rank s). Used on one stage:
    nothing to do; on several stages of one rank (a V-shaped schedule's first and last
    stage): they use one parameter, nothing to do either. On several ranks: every holder's
    gradient is summed with a ring all-reduce over those ranks after each step (``sync_ms``,
    at the link bandwidth), as ``autosplit run`` does.
    """
    stage_of = [s for s, (first, end) in enumerate(bounds) for _ in range(first, end)]
    rank_of = list(range(len(bounds))) if ranks is None else list(ranks)
    weights = []
    for shared in profile.shared:
        stages = tuple(sorted({stage_of[i] for i in shared.blocks}))
        holders = len({rank_of[s] for s in stages})
        mode = ("one stage" if len(stages) == 1 else "one rank" if holders == 1
                else "all-reduce")
        sync = allreduce_ms(shared.bytes, holders, settings.bandwidth_bytes_per_s)
        weights.append(SharedWeight(shared.name, stages, mode, shared.bytes, sync))
    return tuple(weights)


def assemble(
    settings: PlanSettings,
    profile: Profile,
    balance: tuple[int, ...],
    k: int,
    solver: str,
    candidates: tuple[int, ...],
    replicas: int = 1,
) -> Plan:
    """The Plan for ``balance`` at size index ``k``: stages with their predicted times and
    memory, and the shared weights; ``replicas``: of each stage, for the runtime's cost per
    action (:func:`~autosplit.planner.problems.runtime_action_ms`; the caller adds their
    all-reduce). The predicted step is the schedule's simulation plus the
    all-reduce of every weight shared across stages (``SharedWeight.sync_ms``, ms) and the
    slowest stage's optimizer update (``Plan.update_ms``): they run after the last backward, so
    nothing hides them. The search weighs the update, not the shared weights' all-reduce."""
    b = profile.microbatch_sizes[k]
    m = math.ceil(settings.batch_size / b)
    p = settings.gpus
    problem = partition_problem(settings, profile, k, m)
    part = evaluate(problem, balance)
    names = profile.block_names
    twice = counted_twice(profile, part.bounds, settings.param_factor)
    stages = []
    for s, (first, end) in enumerate(part.bounds):
        last = s == p - 1
        send = 0 if last else profile.cuts[end - 1].bytes[k]
        held = (part.stage_memory[s] - twice[s] + stage_transient_bytes(profile, k, first, end)
                + unit_transient_bytes(settings, profile, first, end))
        stages.append(
            Stage(
                index=s,
                device=settings.devices[s],
                blocks=names[first:end],
                compute_ms=math.fsum(problem.costs[s][first:end]),
                forward_ms=math.fsum(
                    blk.fwd_ms[settings.profiles[s].size_index(b)] / settings.speeds[s]
                    for blk in settings.profiles[s].blocks[first:end]
                ),
                send_bytes=int(send),
                send_ms=0.0 if last else problem.comm[end - 1],
                memory_bytes=int(held),
            )
        )
    single, single_split = single_device_ms(profile, settings.batch_size, settings.optimizer)
    capacity = settings.capacity_bytes
    shared = shared_weights(settings, profile, part.bounds)
    plan = Plan(
        model=profile.model,
        fingerprint=profile.fingerprint,
        stages=tuple(stages),
        split_size=b,
        microbatches=m,
        batch_size=settings.batch_size,
        schedule=settings.schedule,
        predicted_step_ms=0.0,  # the schedule simulation, below
        single_device_ms=single / max(settings.speeds),
        single_device_split=single_split,
        solver=solver,
        candidates=candidates,
        profile=profile.describe(),
        memory_limit_bytes=None if capacity is None else int(min(capacity)),
        optimizer=settings.optimizer,
        shared=shared,
        action_ms=runtime_action_ms(settings, profile, replicas),
        update_ms=slowest_update_ms(update_table(settings), [[r] for r in part.bounds]),
    )
    # the shared weights' all-reduce and the update run after the pipeline's last backward
    simulated = simulate_plan(plan).step_ms + plan.after_pipeline_ms
    return dataclasses.replace(
        plan, predicted_step_ms=simulated, bound_step_ms=step_ms(part.bottleneck, m, p)
    )


def explain_infeasible(
    settings: PlanSettings, profile: Profile, k: int, m: int
) -> InfeasiblePlanError:
    """Say in bytes and block names what the smallest feasible plan at size index k needs."""
    smallest = min_capacity(partition_problem(settings, profile, k, m))
    need = smallest.bottleneck + transient_bytes(profile, k) + unit_transient_bytes(settings,
                                                                                    profile)
    s = max(range(settings.gpus), key=lambda i: smallest.stage_memory[i])
    first, end = smallest.bounds[s]
    names = profile.block_names
    p = settings.gpus
    have = format_bytes(min(settings.capacity_bytes or (0.0,)))
    finding = (f"the model does not fit on {p} devices of {have}: the smallest feasible plan "
               f"needs {format_bytes(need)} on stage {s} ({names[first]} … {names[end - 1]})")
    return InfeasiblePlanError(
        f"{finding}. Try more devices, schedule='1f1b', a smaller split_size, or "
        f"memory_per_gpu of at least {format_bytes(need)}",
        finding=finding,
        min_capacity_bytes=need,
        stage=s,
        blocks=(names[first], names[end - 1]),
    )
