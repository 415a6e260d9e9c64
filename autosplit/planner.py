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
import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from autosplit import checks
from autosplit.cost import (
    OPTIMIZER_STATE,
    SCHEDULES,
    allreduce_ms,
    block_memory_bytes,
    block_time_ms,
    in_flight,
    optimizer_factor,
    single_device_ms,
    step_ms,
    transfer_ms,
)
from autosplit.devices import DEFAULT_LINK_BYTES_PER_S
from autosplit.errors import (
    ArgumentTypeError,
    InfeasiblePlanError,
    InvalidInputError,
    PlanMismatchError,
)
from autosplit.records import Plan, Profile, SharedWeight, Stage
from autosplit.simulator import simulate_plan
from autosplit.solve import PartitionProblem, evaluate, min_capacity, solve_dp
from autosplit.solve.exact import StepProblem, solve_step
from autosplit.units import format_bytes, parse_bytes

__all__ = ["plan", "plan_candidates", "plan_with_balance", "PlanSettings", "SOLVERS"]

SOLVERS = ("dp", "milp", "auto")

SETTING_NAMES = frozenset(
    ("batch_size", "devices", "memory_per_gpu", "schedule", "optimizer",
     "bandwidth_bytes_per_s", "speeds", "device_profiles")
)
"""The keyword arguments of :meth:`PlanSettings.check`, which :func:`plan_with_balance` takes."""


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
    def from_kwargs(cls, profile: Profile, gpus: int, kwargs: Mapping[str, object]) -> PlanSettings:
        """:meth:`check` on keyword arguments passed through (``**kwargs`` of the callers).

        Raises:
            ArgumentTypeError: an argument that :meth:`check` does not take; as :meth:`check`.
        """
        unknown = sorted(set(kwargs) - SETTING_NAMES)
        if unknown:
            raise ArgumentTypeError(
                f"unknown argument{'s' if len(unknown) > 1 else ''} {', '.join(unknown)}: "
                f"the device and memory arguments are {', '.join(sorted(SETTING_NAMES))}"
            )
        return cls.check(profile, gpus, **kwargs)  # type: ignore[arg-type]

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
        """Validate the planner's arguments (see :func:`plan`).

        Raises:
            ArgumentTypeError: an argument of the wrong type (e.g. ``gpus="2"``, ``gpus=2.0``).
            InvalidInputError: a value out of range; the message names the argument and value.
            PlanMismatchError: a device profile is of another model.
        """
        checks.instance_of("profile", profile, Profile, "an autosplit Profile")
        n = len(profile.blocks)
        gpus = checks.positive_int("gpus", gpus)
        if gpus > n:
            raise InvalidInputError(
                f"gpus={gpus} is more than the model's {n} blocks: use at most {n} devices, "
                "or trace with granularity='layer' for finer blocks"
            )
        batch = profile.batch_size if batch_size is None else batch_size
        batch = checks.positive_int("batch_size", batch)
        if devices is None:
            kind = profile.device.kind
            devices = [f"cuda:{s}" if kind == "cuda" else "cpu" for s in range(gpus)]
        names = checks.sequence_of("devices", devices, checks.device_name, length=gpus, per="stage")
        capacity = memory_sizes(memory_per_gpu, gpus)
        checks.one_of("optimizer", optimizer, OPTIMIZER_STATE)
        checks.one_of("schedule", schedule, SCHEDULES)
        if bandwidth_bytes_per_s is None:
            bandwidth = DEFAULT_LINK_BYTES_PER_S.get(profile.device.kind, 5e9)
        else:
            bandwidth = checks.positive_finite(
                "bandwidth_bytes_per_s", bandwidth_bytes_per_s, "bytes/s"
            )
        speed: tuple[float, ...] = (1.0,) * gpus
        if speeds is not None:
            speed = checks.sequence_of(
                "speeds", speeds, checks.positive_finite, length=gpus, per="device"
            )
        profs = (profile,) * gpus
        if device_profiles is not None:
            profs = checks.sequence_of(
                "device_profiles", device_profiles,
                lambda name, v: checks.instance_of(name, v, Profile, "an autosplit Profile"),
                length=gpus, per="device",
            )
        for other in profs:
            if other.fingerprint != profile.fingerprint:
                raise PlanMismatchError(
                    f"device profile of {other.model} (fingerprint {other.fingerprint}) is of "
                    f"another model than {profile.model} ({profile.fingerprint})"
                )
        return cls(gpus, batch, names, capacity, schedule, optimizer, bandwidth, speed, profs)


def memory_sizes(
    memory_per_gpu: int | float | str | Sequence[int | float | str] | None, gpus: int
) -> tuple[float, ...] | None:
    """Per-device memory (bytes) from one size or one per device; ``None``: no limit.

    Raises:
        ArgumentTypeError: not a number, string or list of them.
        InvalidInputError: a size that is not finite and ≥ 1 byte, or the wrong count.
    """
    if memory_per_gpu is None:
        return None
    if isinstance(memory_per_gpu, (str, numbers.Real)):
        return (float(parse_bytes(memory_per_gpu, "memory_per_gpu")),) * gpus
    return checks.sequence_of(
        "memory_per_gpu", memory_per_gpu, lambda name, v: float(parse_bytes(v, name)),
        length=gpus, per="device",
    )


def _check_search(split_size: object, solver: object, time_limit_s: object) -> None:
    """The search arguments of :func:`plan` (the rest is :meth:`PlanSettings.check`)."""
    checks.optional(checks.positive_int, "split_size", split_size)
    checks.one_of("solver", solver, SOLVERS)
    checks.optional(checks.positive_finite, "time_limit_s", time_limit_s, "s")


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
    """Per-stage memory of each block, and the extra bytes when it is a stage's first block.

    A shared parameter (tied weights) is counted in every block that uses it, so a stage
    holding any of its users counts its copy; a stage holding several users counts it more
    than once here (the search errs on the safe side; :func:`_assemble` reports it once).
    """
    factor = optimizer_factor(settings.optimizer)
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
    first = tuple(
        tuple((blk.saved_shared_bytes or (0,) * (k + 1))[k] * flights[s] for blk in profile.blocks)
        for s in range(p)
    )
    return held, first


def _copy_bytes(profile: Profile) -> list[int]:
    """Bytes of shared parameters each block uses but does not count in ``param_bytes``."""
    copies = [0] * len(profile.blocks)
    for shared in profile.shared:
        for i in shared.blocks[1:]:
            copies[i] += shared.bytes
    return copies


def _shared_weights(
    settings: PlanSettings, profile: Profile, bounds: Sequence[tuple[int, int]]
) -> tuple[SharedWeight, ...]:
    """Where each shared parameter is used, and how ``autosplit run`` keeps it equal.

    Used on one stage: nothing to do. On several: every holder's gradient is summed with a
    ring all-reduce over those stages' ranks after each step (``sync_ms``, at the link
    bandwidth, assuming one stage per rank).
    """
    stage_of = [s for s, (first, end) in enumerate(bounds) for _ in range(first, end)]
    weights = []
    for shared in profile.shared:
        stages = tuple(sorted({stage_of[i] for i in shared.blocks}))
        mode = "one stage" if len(stages) == 1 else "all-reduce"
        sync = allreduce_ms(shared.bytes, len(stages), settings.bandwidth_bytes_per_s)
        weights.append(SharedWeight(shared.name, stages, mode, shared.bytes, sync))
    return tuple(weights)


def _counted_twice(
    profile: Profile, bounds: Sequence[tuple[int, int]], factor: int
) -> list[float]:
    """Bytes per stage that :func:`_memory` counts more than once (shared parameters used by
    several blocks of one stage): the copy is held once."""
    extra = [0.0] * len(bounds)
    for shared in profile.shared:
        for s, (first, end) in enumerate(bounds):
            users = sum(first <= i < end for i in shared.blocks)
            extra[s] += max(users - 1, 0) * shared.bytes * factor
    return extra


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
        ArgumentTypeError: an argument of the wrong type (``gpus="2"``, ``gpus=2.0``,
            ``gpus=True``, ``devices="cpu"``, ``speeds=[None]`` …); also a ``TypeError``.
        InvalidInputError: a bad value: a count < 1 or above the blocks, a memory or bandwidth
            that is not finite and > 0, a length that does not match ``gpus``, an unknown
            name, or a ``split_size`` that was not profiled; also a ``ValueError``.
        PlanMismatchError: a device profile is of another model.
        InfeasiblePlanError: nothing fits in ``memory_per_gpu``; says what would.
    """
    settings = PlanSettings.check(
        profile, gpus, batch_size=batch_size, devices=devices, memory_per_gpu=memory_per_gpu,
        schedule=schedule, optimizer=optimizer, bandwidth_bytes_per_s=bandwidth_bytes_per_s,
        speeds=speeds, device_profiles=device_profiles,
    )
    _check_search(split_size, solver, time_limit_s)
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

    Raises:
        ArgumentTypeError: an argument of the wrong type, e.g. a balance entry that is not an
            int (``1.5``, ``True``), or an unknown keyword argument.
        InvalidInputError: a balance entry < 1, a balance that does not sum to the profile's
            blocks, a ``split_size`` that was not profiled, or a bad device argument.
        PlanMismatchError: a device profile is of another model.
    """
    checks.instance_of("profile", profile, Profile, "an autosplit Profile")
    balance = checks.sequence_of("balance", balance, checks.positive_int)
    n = len(profile.blocks)
    if sum(balance) != n:
        raise InvalidInputError(
            f"balance {list(balance)} sums to {sum(balance)} blocks, but the model has {n}: "
            "give the number of blocks of each stage, summing to the model's blocks"
        )
    split_size = checks.positive_int("split_size", split_size)
    checks.text("solver", solver)
    settings = PlanSettings.from_kwargs(profile, len(balance), kwargs)
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
    """The Plan for ``balance`` at size index ``k``: stages with their predicted times and
    memory, and the shared weights. The predicted step is the schedule's simulation plus the
    all-reduce of every weight shared across stages (``SharedWeight.sync_ms``, ms): it runs
    after the last backward, so nothing hides it. The search itself does not weigh it."""
    b = profile.microbatch_sizes[k]
    m = math.ceil(settings.batch_size / b)
    p = settings.gpus
    problem = _problem(settings, profile, k, m)
    part = evaluate(problem, balance)
    names = profile.block_names
    twice = _counted_twice(profile, part.bounds, optimizer_factor(settings.optimizer))
    stages = []
    for s, (first, end) in enumerate(part.bounds):
        last = s == p - 1
        send = 0 if last else profile.cuts[end - 1].bytes[k]
        held = part.stage_memory[s] - twice[s] + max(
            blk.output_bytes[k] for blk in profile.blocks[first:end]
        )
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
    shared = _shared_weights(settings, profile, part.bounds)
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
        shared=shared,
    )
    # the shared weights' all-reduce runs after the pipeline's last backward: it adds up
    simulated = simulate_plan(plan).step_ms + math.fsum(w.sync_ms for w in shared)
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


def plan_candidates(profile: Profile, gpus: int = 2, *, top_k: int = 3,
                    **options: object) -> tuple[Plan, ...]:
    """The ``top_k`` best plans by block sums, at distinct micro-batch sizes, best first.

    The first is :func:`plan`'s own choice; the others are :func:`plan` with ``split_size``
    fixed to each other measured size, ranked by predicted step. Block sums misjudge sizes by
    different amounts, so these are the candidates worth timing stage by stage
    (:mod:`autosplit.verify`) before one is chosen. ``options`` are :func:`plan`'s keyword
    arguments; with ``split_size`` given there is one candidate.

    Raises:
        As :func:`plan`.
    """
    top_k = checks.positive_int("top_k", top_k)
    best = plan(profile, gpus, **options)  # type: ignore[arg-type]
    if options.get("split_size") is not None or top_k == 1:
        return (best,)
    batch = best.batch_size
    others = []
    for b in profile.microbatch_sizes:
        if b == best.split_size or b > batch:
            continue
        try:
            other = plan(profile, gpus, **{**options, "split_size": b})  # type: ignore[arg-type]
        except InfeasiblePlanError:
            continue
        others.append(dataclasses.replace(other, candidates=best.candidates))
    others.sort(key=lambda p: (p.predicted_step_ms, p.split_size))
    return (best, *others[: top_k - 1])
