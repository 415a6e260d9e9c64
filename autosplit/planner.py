"""From a Profile to a Plan: choose the cut points and the micro-batch size together.

For every micro-batch size b that was measured (or the one the user fixed), the exact solver
finds the cut points that minimise the bottleneck stage time at that b, within each device's
memory; the plan is the (b, cuts) pair with the smallest predicted step time. Only measured sizes
are candidates: per-sample cost has cliffs, so nothing is interpolated.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from autosplit.cost import (
    block_memory_bytes,
    block_time_ms,
    in_flight,
    optimizer_factor,
    single_device_ms,
    step_ms,
    transfer_ms,
)
from autosplit.devices import DEFAULT_LINK_BYTES_PER_S
from autosplit.errors import InfeasiblePlanError, InvalidInputError
from autosplit.records import Plan, Profile, Stage
from autosplit.solve import Partition, PartitionProblem, min_capacity, solve_dp
from autosplit.units import format_bytes, parse_bytes

__all__ = ["plan", "build_problem"]


def build_problem(
    profile: Profile,
    k: int,
    p: int,
    m: int,
    *,
    schedule: str,
    optimizer: str,
    bandwidth_bytes_per_s: float,
    capacity_bytes: float | None,
) -> PartitionProblem:
    """The partition problem at micro-batch size index ``k`` with m micro-batches on p stages."""
    factor = optimizer_factor(optimizer)
    costs = tuple(block_time_ms(blk, k) for blk in profile.blocks)
    comm = tuple(transfer_ms(cut.bytes[k], bandwidth_bytes_per_s) for cut in profile.cuts)
    memory = None
    capacity = None
    if capacity_bytes is not None:
        transient = max(blk.output_bytes[k] for blk in profile.blocks)
        memory = tuple(
            tuple(
                block_memory_bytes(blk, k, factor, in_flight(schedule, m, p, s))
                for blk in profile.blocks
            )
            for s in range(p)
        )
        capacity = (max(capacity_bytes - transient, 0.0),) * p
    return PartitionProblem((costs,) * p, comm, memory, capacity)


def plan(
    profile: Profile,
    gpus: int = 2,
    *,
    batch_size: int | None = None,
    devices: Sequence[str] | None = None,
    memory_per_gpu: int | float | str | None = None,
    schedule: str = "gpipe",
    optimizer: str = "sgd",
    split_size: int | None = None,
    bandwidth_bytes_per_s: float | None = None,
) -> Plan:
    """The fastest predicted pipeline plan for ``profile`` on ``gpus`` devices.

    Args:
        profile: the measured profile.
        gpus: number of stages p (one device each).
        batch_size: B; default the profile's example batch size.
        devices: device names for the stages (default ``cuda:0…`` or ``cpu``, as measured).
        memory_per_gpu: per-device memory limit, bytes or a string like ``"16GiB"``.
        schedule: ``"gpipe"`` or ``"1f1b"`` (changes the activations held per stage).
        optimizer: ``"sgd"``, ``"sgd-momentum"``, ``"adam"`` … (state held per parameter).
        split_size: fix the micro-batch size b (must have been profiled); ``None`` chooses.
        bandwidth_bytes_per_s: link bandwidth between consecutive stages.

    Raises:
        InvalidInputError: bad counts, sizes or names.
        InfeasiblePlanError: nothing fits in ``memory_per_gpu``; says what would.
    """
    n = len(profile.blocks)
    if isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 1:
        raise InvalidInputError(f"gpus must be a positive integer (0 < 1), got {gpus!r}")
    if gpus > n:
        raise InvalidInputError(
            f"gpus={gpus} is more than the model's {n} blocks: use at most {n} devices, "
            "or trace with granularity='layer' for finer blocks"
        )
    batch = profile.batch_size if batch_size is None else batch_size
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise InvalidInputError(f"batch_size must be a positive integer, got {batch!r}")
    if devices is None:
        kind = profile.device.kind
        devices = [f"cuda:{s}" if kind == "cuda" else "cpu" for s in range(gpus)]
    devices = [str(d) for d in devices]
    if len(devices) != gpus:
        raise InvalidInputError(f"{len(devices)} devices given for {gpus} stages: give one per stage")
    capacity = None if memory_per_gpu is None else float(parse_bytes(memory_per_gpu))
    optimizer_factor(optimizer)
    in_flight(schedule, 1, 1, 0)  # validates the schedule name
    bandwidth = bandwidth_bytes_per_s or DEFAULT_LINK_BYTES_PER_S.get(profile.device.kind, 5e9)

    if split_size is not None:
        candidates = [profile.size_index(split_size)]
        if split_size > batch:
            raise InvalidInputError(f"split_size {split_size} is larger than the batch {batch}")
    else:
        candidates = [k for k, b in enumerate(profile.microbatch_sizes) if b <= batch]
        if not candidates:
            raise InvalidInputError(
                f"no profiled micro-batch size fits the batch {batch}: profiled sizes are "
                f"{list(profile.microbatch_sizes)}"
            )

    best: tuple[float, int, int, Partition] | None = None
    failures: list[InfeasiblePlanError] = []
    for k in candidates:
        b = profile.microbatch_sizes[k]
        m = math.ceil(batch / b)
        problem = build_problem(
            profile, k, gpus, m, schedule=schedule, optimizer=optimizer,
            bandwidth_bytes_per_s=bandwidth, capacity_bytes=capacity,
        )
        try:
            part = solve_dp(problem)
        except InfeasiblePlanError:
            failures.append(_explain(problem, profile, k, capacity or 0.0, gpus))
            continue
        t = step_ms(part.bottleneck, m, gpus)
        if best is None or t < best[0]:
            best = (t, k, m, part)
    if best is None:
        raise min(failures, key=lambda e: e.min_capacity_bytes or math.inf)

    t, k, m, part = best
    b = profile.microbatch_sizes[k]
    names = profile.block_names
    factor = optimizer_factor(optimizer)
    stages = []
    for s, (first, end) in enumerate(part.bounds):
        blocks = profile.blocks[first:end]
        last = s == gpus - 1
        send = 0 if last else profile.cuts[end - 1].bytes[k]
        memory = sum(
            block_memory_bytes(blk, k, factor, in_flight(schedule, m, gpus, s)) for blk in blocks
        ) + max(blk.output_bytes[k] for blk in blocks)
        stages.append(
            Stage(
                index=s,
                device=devices[s],
                blocks=names[first:end],
                compute_ms=sum(block_time_ms(blk, k) for blk in blocks),
                send_bytes=int(send),
                send_ms=0.0 if last else transfer_ms(send, bandwidth),
                memory_bytes=int(memory),
            )
        )
    single, _ = single_device_ms(profile, batch)
    return Plan(
        model=profile.model,
        fingerprint=profile.fingerprint,
        stages=tuple(stages),
        split_size=b,
        microbatches=m,
        batch_size=batch,
        schedule=schedule,
        predicted_step_ms=t,
        single_device_ms=single,
        solver="dp",
        candidates=tuple(profile.microbatch_sizes[c] for c in candidates),
        profile=profile.describe(),
        memory_limit_bytes=None if capacity is None else int(capacity),
        optimizer=optimizer,
    )


def _explain(
    problem: PartitionProblem,
    profile: Profile,
    k: int,
    capacity: float,
    p: int,
) -> InfeasiblePlanError:
    """Restate a solver's infeasibility in bytes, block names and things to try."""
    smallest = min_capacity(problem)
    transient = max(blk.output_bytes[k] for blk in profile.blocks)
    need = smallest.bottleneck + transient
    s = max(range(p), key=lambda i: smallest.stage_memory[i])
    first, end = smallest.bounds[s]
    names = profile.block_names
    return InfeasiblePlanError(
        f"the model does not fit on {p} devices of {format_bytes(capacity)}: the smallest "
        f"feasible plan needs {format_bytes(need)} on stage {s} ({names[first]} … "
        f"{names[end - 1]}). Try more devices, schedule='1f1b', a smaller split_size, or "
        f"memory_per_gpu of at least {format_bytes(need)}",
        min_capacity_bytes=need,
        stage=s,
        blocks=(names[first], names[end - 1]),
    )
