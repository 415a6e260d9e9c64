"""The numeric problems a plan search solves, built from a profile and the settings.

:func:`partition_problem` is the min-max problem of :mod:`autosplit.solve` (block times per
device, transfers, memory per stage in bytes); :func:`step_problem` adds what the simulated
step needs (:mod:`autosplit.solve.exact`). Times in ms, sizes in bytes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from autosplit.cost import (
    block_memory_bytes,
    block_time_ms,
    block_transient_bytes,
    in_flight,
    transfer_ms,
)
from autosplit.planner.settings import PlanSettings
from autosplit.records import Profile
from autosplit.sharding import gather_transient_bytes
from autosplit.solve import PartitionProblem
from autosplit.solve.step_problem import StepProblem

__all__ = ["counted_twice", "partition_problem", "runtime_action_ms", "slowest_update_ms",
           "stage_transient_bytes", "step_problem", "transient_bytes", "unit_transient_bytes",
           "update_table"]


def _costs(settings: PlanSettings, profile: Profile, b: int) -> tuple[tuple[float, ...], ...]:
    rows = []
    for s in range(settings.gpus):
        prof = settings.profiles[s]
        k = prof.size_index(b)
        rows.append(tuple(block_time_ms(blk, k) / settings.speeds[s] for blk in prof.blocks))
    return tuple(rows)


Table = tuple[tuple[float, ...], ...]


def _memory(settings: PlanSettings, profile: Profile, k: int, m: int) -> tuple[Table, Table, Table]:
    """Per-stage memory of each block, and the extra bytes when it is a stage's first block
    and when it is its last: torch.distributed.pipelining receives each of the m micro-batches
    into a buffer of its own, held all step — the input of a stage that starts after a cut
    (which is also the received copy the stage keeps for its backward) and the gradient of
    the output of a stage that ends before one.

    A shared parameter (tied weights) is counted in every block that uses it, so a stage
    holding any of its users counts its copy; a stage holding several users counts it more
    than once here (the search errs on the safe side; :func:`assemble` reports it once).
    """
    factor = settings.param_factor
    p = settings.gpus
    flights = [in_flight(settings.schedule, m, p, s) for s in range(p)]
    copies = _copy_bytes(profile)
    held = tuple(
        tuple(
            block_memory_bytes(blk, k, factor, flights[s]) + copies[i] * factor
            for i, blk in enumerate(profile.blocks)
        )
        for s in range(p)
    )
    cut = [float(c.bytes[k]) for c in profile.cuts]
    first = (tuple(m * x for x in [0.0, *cut]),) * p
    last = (tuple(m * x for x in [*cut, 0.0]),) * p
    return held, first, last


def _copy_bytes(profile: Profile) -> list[int]:
    """Bytes of shared parameters each block uses but does not count in ``param_bytes``."""
    copies = [0] * len(profile.blocks)
    for shared in profile.shared:
        for i in shared.blocks[1:]:
            copies[i] += shared.bytes
    return copies


def counted_twice(
    profile: Profile, bounds: Sequence[tuple[int, int]], factor: float
) -> list[float]:
    """Bytes per stage that :func:`_memory` counts more than once (shared parameters used by
    several blocks of one stage): the copy is held once."""
    extra = [0.0] * len(bounds)
    for shared in profile.shared:
        for s, (first, end) in enumerate(bounds):
            users = sum(first <= i < end for i in shared.blocks)
            extra[s] += max(users - 1, 0) * shared.bytes * factor
    return extra


def transient_bytes(profile: Profile, k: int) -> float:
    """The most any stage may need briefly at size index k, beyond the activations it keeps
    (bytes): the largest :func:`block_transient_bytes`, what the planner keeps free on every
    device whatever the cuts."""
    return max(block_transient_bytes(blk, k) for blk in profile.blocks)


def unit_transient_bytes(settings: PlanSettings, profile: Profile,
                         first: int = 0, end: int | None = None) -> float:
    """What sharded replicas need briefly beyond what they hold (bytes): the largest unit's
    gathered parameters (:func:`autosplit.sharding.gather_transient_bytes`; a unit is one
    block, with the shared parameters it uses) among blocks [first, end) — every block by
    default, what the search keeps free whatever the cuts; 0 for DDP."""
    copies = _copy_bytes(profile)
    largest = max((blk.param_bytes + copies[first + i]
                   for i, blk in enumerate(profile.blocks[first:end])), default=0)
    return gather_transient_bytes(settings.replica_mode, largest, settings.replicas)


def stage_transient_bytes(profile: Profile, k: int, first: int, end: int) -> float:
    """What a stage of blocks [first, end) needs briefly at size index k, beyond the
    activations it keeps for every micro-batch in flight (bytes).

    While block j runs a micro-batch, the blocks after it in the stage do not hold that
    micro-batch's activations yet (forward) or any more (backward), though the memory in
    flight counts them: block j's need (:func:`block_transient_bytes`) less what those later
    blocks save, the largest over the stage's blocks, and at least 0."""
    need, later = 0.0, 0.0
    for blk in reversed(profile.blocks[first:end]):
        need = max(need, block_transient_bytes(blk, k) - later)
        later += blk.saved_bytes[k]
    return need


def partition_problem(settings: PlanSettings, profile: Profile, k: int, m: int) -> PartitionProblem:
    b = profile.microbatch_sizes[k]
    comm = tuple(transfer_ms(cut.bytes[k], settings.bandwidth_bytes_per_s) for cut in profile.cuts)
    memory, first, last = _memory(settings, profile, k, m)
    capacity = None
    if settings.capacity_bytes is not None:
        transient = transient_bytes(profile, k) + unit_transient_bytes(settings, profile)
        capacity = tuple(max(c - transient, 0.0) for c in settings.capacity_bytes)
    return PartitionProblem(_costs(settings, profile, b), comm, memory, capacity, first, last)


def step_problem(settings: PlanSettings, profile: Profile, k: int, m: int,
                 problem: PartitionProblem, replicas: int = 1) -> StepProblem:
    """The simulated-step problem at size index k: each device's block times from its own
    profile and speed, each cut's transfer split evenly between forward and backward (as
    :func:`autosplit.simulator.simulate_plan` does), the min-max problem's memory, and the
    runtime's cost per action for ``replicas`` of each stage (:func:`runtime_action_ms`)."""
    b = profile.microbatch_sizes[k]
    fwd, bwd = [], []
    for s in range(settings.gpus):
        prof, speed = settings.profiles[s], settings.speeds[s]
        kk = prof.size_index(b)
        fwd.append(tuple(blk.fwd_ms[kk] / speed for blk in prof.blocks))
        bwd.append(tuple(blk.bwd_ms[kk] / speed for blk in prof.blocks))
    half = tuple(c / 2 for c in problem.comm)
    return StepProblem(tuple(fwd), tuple(bwd), half, half, m, settings.schedule,
                       problem.memory, problem.memory_first, problem.capacity,
                       problem.memory_last,
                       action_ms=runtime_action_ms(settings, profile, replicas),
                       transfers_on_cores=settings.transfers_on_cores,
                       update=update_table(settings))


def update_table(settings: PlanSettings) -> tuple[tuple[float, ...], ...] | None:
    """``[s][i]``: the optimizer's update of block i on device s (ms per step, from that
    device's profile and speed: :meth:`Profile.update_ms_of` of ``settings.optimizer``; a
    sharded replica updates its 1/d: :attr:`PlanSettings.update_share`);
    ``None`` when a profile did not time it (the update then counts as 0)."""
    rows = []
    for prof, speed in zip(settings.profiles, settings.speeds):
        row = prof.update_ms_of(settings.optimizer)
        if row is None:
            return None
        rows.append(tuple(u * settings.update_share / speed for u in row))
    return tuple(rows)


def slowest_update_ms(table: tuple[tuple[float, ...], ...] | None,
                      ranges: Sequence[Sequence[tuple[int, int]]]) -> float:
    """The slowest rank's update (ms): max over ranks r of Σ over r's stages' block ranges
    ``ranges[r]`` (first, end) of ``table[r]``; 0 without a table."""
    if table is None:
        return 0.0
    return max((math.fsum(u for a, e in spans for u in table[r][a:e])
                for r, spans in enumerate(ranges)), default=0.0)


def runtime_action_ms(settings: PlanSettings, profile: Profile, replicas: int = 1) -> float:
    """What torch's pipeline runtime costs per forward or backward of a stage beyond its
    compute (ms; 0 when not measured): :attr:`Profile.action_ms` of the schedule for a
    pipeline of several stages, :meth:`Profile.one_stage_action` for one stage with
    ``replicas`` > 1 (``autosplit run`` runs each replica on the same runtime); 0 for one stage
    alone (one device trains without it)."""
    if settings.gpus > 1:
        return profile.action_ms_of(settings.schedule)
    return profile.one_stage_action()[0] if replicas > 1 else 0.0
