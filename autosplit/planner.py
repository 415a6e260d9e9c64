"""From a Profile to a Plan: choose the cut points and the micro-batch size together.

What is optimised: the plan's ``predicted_step_ms``, the event simulation of one training step
of the schedule (:func:`autosplit.simulator.simulate_plan`: GPipe or 1F1B, with each cut's
transfer, on devices of different speeds or profiles). The plan returned has the smallest
simulated step over every balance (contiguous, non-empty stages) and every measured
micro-batch size b ≤ B, among the balances that fit each device's memory; ties (within a
relative 1e-9) go to the smallest micro-batch size, then to the lexicographically smallest
balance. Only measured sizes are candidates: per-sample cost has cliffs, so nothing is
interpolated.

How: for each b, the min-max solver (the dynamic program, or the PuLP MILP with
``solver="milp"``) finds the cut that minimises the slowest stage t_max (the closed form
(m + p − 1) · t_max, saved as ``bound_step_ms``); that cut seeds an exact branch and bound on
the simulated step (:func:`autosplit.solve.exact.solve_step`), which makes the final choice.

Devices may differ: each has a speed factor (its block times are the profile's divided by it)
or its own profile of the same model, and its own memory. Stage s runs on device s.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass

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
from autosplit.errors import InfeasiblePlanError, InvalidInputError, PlanMismatchError
from autosplit.records import Plan, Profile, Stage
from autosplit.simulator import simulate_plan
from autosplit.solve import PartitionProblem, evaluate, min_capacity, solve_dp
from autosplit.solve.exact import StepProblem, solve_step
from autosplit.units import format_bytes, parse_bytes

__all__ = ["plan", "plan_with_balance", "PlanSettings", "SOLVERS"]

SOLVERS = ("dp", "milp", "auto")


@dataclass(frozen=True, slots=True)
class PlanSettings:
    """Everything besides the profile that a plan depends on, checked once.

    Attributes:
        gpus: number of stages p.
        batch_size: B.
        devices: device name of each stage.
        capacity_bytes: memory of each device (bytes), or ``None`` for no limit.
        schedule: ``"gpipe"`` or ``"1f1b"``.
        optimizer: name in :data:`autosplit.cost.OPTIMIZER_STATE`.
        bandwidth_bytes_per_s: link bandwidth between consecutive stages.
        speeds: relative speed of each device (block time = profiled time / speed).
        profiles: the profile each device's block times come from.
    """

    gpus: int
    batch_size: int
    devices: tuple[str, ...]
    capacity_bytes: tuple[float, ...] | None
    schedule: str
    optimizer: str
    bandwidth_bytes_per_s: float
    speeds: tuple[float, ...]
    profiles: tuple[Profile, ...]

    @classmethod
    def check(
        cls,
        profile: Profile,
        gpus: int,
        *,
        batch_size: int | None = None,
        devices: Sequence[str] | None = None,
        memory_per_gpu: int | float | str | Sequence[int | float | str] | None = None,
        schedule: str = "gpipe",
        optimizer: str = "sgd",
        bandwidth_bytes_per_s: float | None = None,
        speeds: Sequence[float] | None = None,
        device_profiles: Sequence[Profile] | None = None,
    ) -> PlanSettings:
        """Validate the planner's arguments (see :func:`plan`)."""
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
        names = tuple(str(d) for d in devices)
        if len(names) != gpus:
            raise InvalidInputError(f"{len(names)} devices given for {gpus} stages: give one per stage")
        capacity: tuple[float, ...] | None
        if memory_per_gpu is None:
            capacity = None
        elif isinstance(memory_per_gpu, (str, int, float)):
            capacity = (float(parse_bytes(memory_per_gpu)),) * gpus
        else:
            capacity = tuple(float(parse_bytes(v)) for v in memory_per_gpu)
            if len(capacity) != gpus:
                raise InvalidInputError(
                    f"{len(capacity)} memory sizes given for {gpus} devices: give one or one per device"
                )
        optimizer_factor(optimizer)
        in_flight(schedule, 1, 1, 0)  # validates the schedule name
        bandwidth = bandwidth_bytes_per_s or DEFAULT_LINK_BYTES_PER_S.get(profile.device.kind, 5e9)
        if not bandwidth > 0:
            raise InvalidInputError(f"bandwidth must be positive bytes/s, got {bandwidth_bytes_per_s!r}")
        speed = tuple(float(v) for v in speeds) if speeds is not None else (1.0,) * gpus
        if len(speed) != gpus or any(not (v > 0 and math.isfinite(v)) for v in speed):
            raise InvalidInputError(f"speeds must be {gpus} positive numbers, got {list(speed)}")
        profs = tuple(device_profiles) if device_profiles is not None else (profile,) * gpus
        if len(profs) != gpus:
            raise InvalidInputError(f"{len(profs)} device profiles for {gpus} devices: give one per device")
        for other in profs:
            if other.fingerprint != profile.fingerprint:
                raise PlanMismatchError(
                    f"device profile of {other.model} (fingerprint {other.fingerprint}) is of "
                    f"another model than {profile.model} ({profile.fingerprint})"
                )
        return cls(gpus, batch, names, capacity, schedule, optimizer, bandwidth, speed, profs)


def _costs(settings: PlanSettings, profile: Profile, b: int) -> tuple[tuple[float, ...], ...]:
    rows = []
    for s in range(settings.gpus):
        prof = settings.profiles[s]
        k = prof.size_index(b)
        rows.append(tuple(block_time_ms(blk, k) / settings.speeds[s] for blk in prof.blocks))
    return tuple(rows)


def _memory(
    settings: PlanSettings, profile: Profile, k: int, m: int
) -> tuple[tuple[tuple[float, ...], ...], tuple[tuple[float, ...], ...]]:
    """Per-stage memory of each block, and the extra bytes when it is a stage's first block."""
    factor = optimizer_factor(settings.optimizer)
    p = settings.gpus
    flights = [in_flight(settings.schedule, m, p, s) for s in range(p)]
    held = tuple(
        tuple(block_memory_bytes(blk, k, factor, flights[s]) for blk in profile.blocks)
        for s in range(p)
    )
    first = tuple(
        tuple((blk.saved_shared_bytes or (0,) * (k + 1))[k] * flights[s] for blk in profile.blocks)
        for s in range(p)
    )
    return held, first


def _transient(profile: Profile, k: int) -> float:
    """The largest single block output at size index k: memory a stage needs briefly."""
    return float(max(blk.output_bytes[k] for blk in profile.blocks))


def _problem(settings: PlanSettings, profile: Profile, k: int, m: int) -> PartitionProblem:
    b = profile.microbatch_sizes[k]
    comm = tuple(transfer_ms(cut.bytes[k], settings.bandwidth_bytes_per_s) for cut in profile.cuts)
    memory, first = _memory(settings, profile, k, m)
    capacity = None
    if settings.capacity_bytes is not None:
        transient = _transient(profile, k)
        capacity = tuple(max(c - transient, 0.0) for c in settings.capacity_bytes)
    return PartitionProblem(_costs(settings, profile, b), comm, memory, capacity, first)


def _solve(problem: PartitionProblem, solver: str, time_limit_s: float | None) -> tuple[tuple[int, ...], str]:
    if solver in ("dp", "auto"):
        return solve_dp(problem).balance, "dp"
    from autosplit.solve.milp import solve_milp

    result = solve_milp(problem, time_limit_s=time_limit_s)
    label = "milp" if result.status == "optimal" else f"milp ({result.status}, gap {result.gap})"
    return result.partition.balance, label


def plan(
    profile: Profile,
    gpus: int = 2,
    *,
    batch_size: int | None = None,
    devices: Sequence[str] | None = None,
    memory_per_gpu: int | float | str | Sequence[int | float | str] | None = None,
    schedule: str = "gpipe",
    optimizer: str = "sgd",
    split_size: int | None = None,
    bandwidth_bytes_per_s: float | None = None,
    solver: str = "dp",
    speeds: Sequence[float] | None = None,
    device_profiles: Sequence[Profile] | None = None,
    time_limit_s: float | None = None,
) -> Plan:
    """The plan with the smallest simulated step time for ``profile`` on ``gpus`` devices.

    Exact over every balance and every measured micro-batch size b ≤ B within the memory
    limits (see the module docstring); ``predicted_step_ms`` is that simulated step (ms).

    Args:
        profile: the measured profile.
        gpus: number of stages p (one device each).
        batch_size: B; default the profile's example batch size.
        devices: device names for the stages (default ``cuda:0…`` or ``cpu``, as measured).
        memory_per_gpu: per-device memory limit, bytes or a string like ``"16GiB"``, or one per
            device.
        schedule: ``"gpipe"`` or ``"1f1b"`` (changes the activations held per stage).
        optimizer: ``"sgd"``, ``"sgd-momentum"``, ``"adam"`` … (state held per parameter).
        split_size: fix the micro-batch size b (must have been profiled); ``None`` chooses.
        bandwidth_bytes_per_s: link bandwidth between consecutive stages.
        solver: the min-max solver whose cut seeds the exact search: ``"dp"`` (dynamic
            program), ``"milp"`` (PuLP/CBC, same min-max optimum) or ``"auto"`` (the DP). The
            plan is the same either way: the exact search on the simulated step decides.
        speeds: relative speed of each device (default all 1.0).
        device_profiles: one profile per device (same model, same sizes) for devices of
            different kinds; block times then come from each device's own profile.
        time_limit_s: time limit of the MILP solver.

    Raises:
        InvalidInputError: bad counts, sizes or names.
        InfeasiblePlanError: nothing fits in ``memory_per_gpu``; says what would.
    """
    settings = PlanSettings.check(
        profile, gpus, batch_size=batch_size, devices=devices, memory_per_gpu=memory_per_gpu,
        schedule=schedule, optimizer=optimizer, bandwidth_bytes_per_s=bandwidth_bytes_per_s,
        speeds=speeds, device_profiles=device_profiles,
    )
    if solver not in SOLVERS:
        raise InvalidInputError(f"unknown solver {solver!r}: use one of {', '.join(SOLVERS)}")
    batch = settings.batch_size
    if split_size is not None:
        if split_size > batch:
            raise InvalidInputError(f"split_size {split_size} is larger than the batch {batch}")
        candidates = [profile.size_index(split_size)]
    else:
        candidates = [k for k, b in enumerate(profile.microbatch_sizes) if b <= batch]
        if not candidates:
            raise InvalidInputError(
                f"no profiled micro-batch size fits the batch {batch}: profiled sizes are "
                f"{list(profile.microbatch_sizes)}"
            )

    best: tuple[float, int, tuple[int, ...], str] | None = None
    failures: list[InfeasiblePlanError] = []
    for k in candidates:
        m = math.ceil(batch / profile.microbatch_sizes[k])
        problem = _problem(settings, profile, k, m)
        try:
            balance, label = _solve(problem, solver, time_limit_s)
        except InfeasiblePlanError:
            failures.append(_explain(settings, profile, k, m))
            continue
        found = solve_step(_step_problem(settings, profile, k, m, problem), balance,
                           cutoff=math.inf if best is None else best[0])
        if found is not None:  # strictly faster than every smaller size searched before
            best = (found.step_ms, k, found.balance, label)
    if best is None:
        raise min(failures, key=lambda e: e.min_capacity_bytes or math.inf)
    _, k, balance, label = best
    return _assemble(settings, profile, balance, k, label, tuple(profile.microbatch_sizes[c] for c in candidates))


def _step_problem(settings: PlanSettings, profile: Profile, k: int, m: int,
                  problem: PartitionProblem) -> StepProblem:
    """The simulated-step problem at size index k: each device's block times from its own
    profile and speed, each cut's transfer split evenly between forward and backward (as
    :func:`autosplit.simulator.simulate_plan` does), and the min-max problem's memory."""
    b = profile.microbatch_sizes[k]
    fwd, bwd = [], []
    for s in range(settings.gpus):
        prof, speed = settings.profiles[s], settings.speeds[s]
        kk = prof.size_index(b)
        fwd.append(tuple(blk.fwd_ms[kk] / speed for blk in prof.blocks))
        bwd.append(tuple(blk.bwd_ms[kk] / speed for blk in prof.blocks))
    half = tuple(c / 2 for c in problem.comm)
    return StepProblem(tuple(fwd), tuple(bwd), half, half, m, settings.schedule,
                       problem.memory, problem.memory_first, problem.capacity)


def plan_with_balance(
    profile: Profile,
    balance: Sequence[int],
    split_size: int,
    *,
    solver: str = "manual",
    **kwargs: object,
) -> Plan:
    """Score a given split (blocks per stage) and micro-batch size with the same cost model.

    Used for hand-written splits and the peers' heuristics, so that every plan is compared on
    equal terms. ``kwargs`` are :func:`plan`'s device and memory arguments (``batch_size``,
    ``devices``, ``memory_per_gpu``, ``schedule``, ``optimizer``, ``bandwidth_bytes_per_s``,
    ``speeds``, ``device_profiles``); memory limits are reported, not enforced.
    """
    balance = tuple(int(c) for c in balance)
    settings = PlanSettings.check(profile, len(balance), **kwargs)  # type: ignore[arg-type]
    if sum(balance) != len(profile.blocks) or min(balance) < 1:
        raise InvalidInputError(
            f"balance {list(balance)} must be positive and sum to the {len(profile.blocks)} blocks"
        )
    k = profile.size_index(split_size)
    return _assemble(settings, profile, balance, k, solver, (split_size,))


def _assemble(
    settings: PlanSettings,
    profile: Profile,
    balance: tuple[int, ...],
    k: int,
    solver: str,
    candidates: tuple[int, ...],
) -> Plan:
    b = profile.microbatch_sizes[k]
    m = math.ceil(settings.batch_size / b)
    p = settings.gpus
    problem = _problem(settings, profile, k, m)
    part = evaluate(problem, balance)
    names = profile.block_names
    stages = []
    for s, (first, end) in enumerate(part.bounds):
        last = s == p - 1
        send = 0 if last else profile.cuts[end - 1].bytes[k]
        held = part.stage_memory[s] + max(blk.output_bytes[k] for blk in profile.blocks[first:end])
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
    single, _ = single_device_ms(profile, settings.batch_size)
    capacity = settings.capacity_bytes
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
        solver=solver,
        candidates=candidates,
        profile=profile.describe(),
        memory_limit_bytes=None if capacity is None else int(min(capacity)),
        optimizer=settings.optimizer,
    )
    simulated = simulate_plan(plan).step_ms
    return dataclasses.replace(
        plan, predicted_step_ms=simulated, bound_step_ms=step_ms(part.bottleneck, m, p)
    )


def _explain(settings: PlanSettings, profile: Profile, k: int, m: int) -> InfeasiblePlanError:
    """Say in bytes and block names what the smallest feasible plan at size index k needs."""
    smallest = min_capacity(_problem(settings, profile, k, m))
    need = smallest.bottleneck + _transient(profile, k)
    s = max(range(settings.gpus), key=lambda i: smallest.stage_memory[i])
    first, end = smallest.bounds[s]
    names = profile.block_names
    p = settings.gpus
    have = format_bytes(min(settings.capacity_bytes or (0.0,)))
    return InfeasiblePlanError(
        f"the model does not fit on {p} devices of {have}: the smallest feasible plan needs "
        f"{format_bytes(need)} on stage {s} ({names[first]} … {names[end - 1]}). Try more "
        f"devices, schedule='1f1b', a smaller split_size, or memory_per_gpu of at least "
        f"{format_bytes(need)}",
        min_capacity_bytes=need,
        stage=s,
        blocks=(names[first], names[end - 1]),
    )
