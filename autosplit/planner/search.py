"""The search: the best plan over balances and measured micro-batch sizes.

See :mod:`autosplit.planner` for what is optimised and how.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence

from autosplit import checks
from autosplit.errors import (
    InfeasiblePlanError,
    InvalidInputError,
    ScheduleUnavailableError,
)
from autosplit.planner.assembly import assemble, explain_infeasible
from autosplit.planner.options import PlanOptions
from autosplit.planner.problems import partition_problem, step_problem
from autosplit.planner.settings import PlanSettings
from autosplit.record_invariants import MAX_MICROBATCHES
from autosplit.records import Plan, Profile
from autosplit.solve import PartitionProblem, solve_dp
from autosplit.solve.exact import solve_step

__all__ = ["fixed_planner", "plan", "plan_candidates", "plan_with_balance", "SEARCH_LIMIT_S"]

SEARCH_LIMIT_S = 60.0
"""Time limit (s) of the exact search per micro-batch size. Every plan of the test suite and
the benchmarks finishes far below it (ResNet50 on 8 stages and 1,000 blocks on 8 stages: about
a second or less, ``benchmarks/exact_search.py``); when it is reached the plan's ``solver``
says so: the plan is then the best found, not a proven optimum."""


def _solve(
    problem: PartitionProblem, solver: str, time_limit_s: float | None
) -> tuple[tuple[int, ...], str]:
    if solver in ("dp", "auto"):
        return solve_dp(problem).balance, "dp"
    from autosplit.solve.milp import solve_milp

    result = solve_milp(problem, time_limit_s=time_limit_s)
    label = "milp" if result.status == "optimal" else f"milp ({result.status}, gap {result.gap})"
    return result.partition.balance, label


def candidate_sizes(profile: Profile, split_size: int | None, batch: int, what: str) -> list[int]:
    """Indices of the measured micro-batch sizes b ≤ ``batch`` that make at most
    :data:`~autosplit.record_invariants.MAX_MICROBATCHES` micro-batches (only ``split_size`` when
    given); ``what`` names the batch in messages (``"the batch 8"``).

    Raises:
        InvalidInputError: ``split_size`` is above the batch or was not profiled, or no
            profiled size fits.
    """
    if split_size is not None:
        if split_size > batch:
            raise InvalidInputError(f"split_size {split_size} is larger than {what}")
        sizes = [profile.size_index(split_size)]
    else:
        sizes = [k for k, b in enumerate(profile.microbatch_sizes) if b <= batch]
    if not sizes:
        raise InvalidInputError(f"no profiled micro-batch size fits {what}: profiled sizes "
                                f"are {list(profile.microbatch_sizes)}")
    kept = [k for k in sizes if -(-batch // profile.microbatch_sizes[k]) <= MAX_MICROBATCHES]
    if not kept:
        raise InvalidInputError(
            f"{what} in micro-batches of {profile.microbatch_sizes[sizes[-1]]} makes more than "
            f"the {MAX_MICROBATCHES:,} micro-batches a step may have: give a smaller batch, or "
            "profile larger micro-batch sizes")
    return kept


def runnable_sizes(profile: Profile, candidates: list[int], batch: int, stages: int,
                   schedule: str) -> list[int]:
    """The candidate size indices whose m = ⌈batch / b⌉ micro-batches torch's class runs on
    ``stages`` ranks: 1F1B needs m ≥ p (``Schedule1F1B`` refuses fewer); GPipe runs any m.

    Raises:
        ScheduleUnavailableError: no candidate size leaves 1F1B enough micro-batches.
    """
    if schedule != "1f1b":
        return candidates
    kept = [k for k in candidates if math.ceil(batch / profile.microbatch_sizes[k]) >= stages]
    if not kept:
        m = max(math.ceil(batch / profile.microbatch_sizes[k]) for k in candidates)
        sizes = ", ".join(str(profile.microbatch_sizes[k]) for k in candidates)
        raise ScheduleUnavailableError(
            f"schedule 1f1b needs at least as many micro-batches as stages ({stages}), and "
            f"the batch {batch} in micro-batches of {sizes} makes at most {m}: use schedule "
            "gpipe, or a smaller micro-batch size",
            schedule="1f1b", p=stages, v=1, m=m,
            reason="fewer micro-batches than stages")
    return kept


def plan(profile: Profile, gpus: int = 2, options: PlanOptions = PlanOptions()) -> Plan:
    """The plan with the smallest simulated step time for ``profile`` on ``gpus`` devices.

    Exact over every balance and every measured micro-batch size b ≤ B within the memory
    limits (see the module docstring); ``predicted_step_ms`` is that simulated step (ms).

    Args:
        profile: the measured profile.
        gpus: number of stages p (one device each).
        options: batch, memory, schedule, optimizer, micro-batch size, link, solver and
            devices (:class:`~autosplit.planner.options.PlanOptions`; its all-reduce and
            replica fields concern replicas, :func:`~autosplit.planner.plan_replicated`).

    Raises:
        ArgumentTypeError: an argument of the wrong type (``gpus="2"``, ``gpus=2.0``,
            ``gpus=True``, ``devices="cpu"``, ``speeds=[None]`` …); also a ``TypeError``.
        InvalidInputError: a bad value: a count < 1 or above the blocks, a memory or bandwidth
            that is not finite and > 0, a length that does not match ``gpus``, an unknown
            name, or a ``split_size`` that was not profiled; also a ``ValueError``.
        ModelMismatchError: a device profile is of another model.
        InfeasiblePlanError: nothing fits in ``memory_per_gpu``; says what would.
    """
    settings = PlanSettings.check(profile, gpus, options)
    split_size, solver, time_limit_s = options.split_size, options.solver, options.time_limit_s
    batch = settings.batch_size
    candidates = candidate_sizes(profile, split_size, batch, f"the batch {batch}")
    if settings.schedule not in ("gpipe", "1f1b"):
        return _joint(settings, profile, candidates, solver, time_limit_s)
    candidates = runnable_sizes(profile, candidates, batch, settings.gpus, settings.schedule)

    best: tuple[float, int, tuple[int, ...], str] | None = None
    failures: list[InfeasiblePlanError] = []
    unproven: list[int] = []  # sizes whose exact search stopped at SEARCH_LIMIT_S
    for k in candidates:
        m = math.ceil(batch / profile.microbatch_sizes[k])
        problem = partition_problem(settings, profile, k, m)
        try:
            balance, label = _solve(problem, solver, time_limit_s)
        except InfeasiblePlanError:
            failures.append(explain_infeasible(settings, profile, k, m))
            continue
        found = solve_step(step_problem(settings, profile, k, m, problem), balance,
                           cutoff=math.inf if best is None else best[0],
                           time_limit_s=SEARCH_LIMIT_S)
        if found is not None and not found.proven:
            unproven.append(profile.microbatch_sizes[k])
        if found is not None:  # strictly faster than every smaller size searched before
            best = (found.step_ms, k, found.balance, label)
    if best is None:
        raise min(failures, key=lambda e: e.min_capacity_bytes or math.inf)
    _, k, balance, label = best
    if unproven:
        label += (f" + search stopped after {SEARCH_LIMIT_S:g} s at b = "
                  f"{', '.join(map(str, unproven))}: best found, not proven optimal")
    sizes = tuple(profile.microbatch_sizes[c] for c in candidates)
    return assemble(settings, profile, balance, k, label, sizes)


def _joint(settings: PlanSettings, profile: Profile, candidates: list[int], solver: str,
           time_limit_s: float | None) -> Plan:
    """:func:`plan` for ``"auto"`` and the schedules only the joint search plans."""
    from autosplit.planner.schedules import plan_schedules
    from autosplit.schedules import SEARCHED

    uniform = len(set(settings.speeds)) == 1 and all(q is profile for q in settings.profiles)
    if settings.schedule == "auto" and not uniform:  # GPipe and 1F1B, this module's search
        plans, failures = [], []
        for name in ("gpipe", "1f1b"):
            try:
                plans.append(_fixed(settings, profile, candidates, name, solver, time_limit_s))
            except (InfeasiblePlanError, ScheduleUnavailableError) as exc:
                failures.append(exc)
        if not plans:  # what does not fit the memory says more than what torch refuses
            raise next((f for f in failures if isinstance(f, InfeasiblePlanError)), failures[-1])
        return min(plans, key=lambda q: q.predicted_step_ms * (1 - 1e-9))
    searched = SEARCHED if settings.schedule == "auto" else tuple(
        (name, v) for name, v in SEARCHED if name == settings.schedule)
    if not searched:
        raise InvalidInputError(f"schedule={settings.schedule!r} is not planned: plan with "
                                f"one of auto, {', '.join(name for name, _ in SEARCHED)}")
    fixed = fixed_planner(settings, profile, candidates, solver, time_limit_s)
    return plan_schedules(settings, profile, candidates, searched, fixed).best


def fixed_planner(settings: PlanSettings, profile: Profile, candidates: list[int],
                  solver: str = "dp", time_limit_s: float | None = None
                  ) -> Callable[[str], Plan]:
    """``schedule ↦`` the plan of :func:`plan` for GPipe or 1F1B (one stage per rank) with
    these settings: what :func:`~autosplit.planner.schedules.plan_schedules` falls back on
    where the joint search has too many cuts to enumerate."""
    return lambda schedule: _fixed(settings, profile, candidates, schedule, solver,
                                   time_limit_s)


def _fixed(settings: PlanSettings, profile: Profile, candidates: list[int], schedule: str,
           solver: str, time_limit_s: float | None) -> Plan:
    sizes = [profile.microbatch_sizes[k] for k in candidates]
    return plan(profile, settings.gpus, PlanOptions(
        batch_size=settings.batch_size, devices=settings.devices,
        memory_per_gpu=settings.capacity_bytes, schedule=schedule,
        optimizer=settings.optimizer, split_size=sizes[0] if len(sizes) == 1 else None,
        bandwidth_bytes_per_s=settings.bandwidth_bytes_per_s, solver=solver,
        speeds=settings.speeds, device_profiles=settings.profiles, time_limit_s=time_limit_s))


def plan_with_balance(
    profile: Profile,
    balance: Sequence[int],
    split_size: int,
    options: PlanOptions = PlanOptions(),
    *,
    solver: str = "manual",
) -> Plan:
    """Score a given split (blocks per stage) and micro-batch size with the same cost model.

    Used for hand-written splits and the peers' heuristics, so that every plan is compared on
    equal terms. Of ``options``, the batch, devices, memory, schedule, optimizer and link
    count (as in :func:`plan`); memory limits are reported, not enforced. ``solver`` is the
    label the plan carries (``"manual"``, ``"uniform"`` …).

    Raises:
        ArgumentTypeError: an argument of the wrong type, e.g. a balance entry that is not an
            int (``1.5``, ``True``).
        InvalidInputError: a balance entry < 1, a balance that does not sum to the profile's
            blocks, a ``split_size`` that was not profiled, or a bad device argument.
        ModelMismatchError: a device profile is of another model.
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
    checks.instance_of("options", options, PlanOptions, "an autosplit.PlanOptions")
    if options.schedule == "auto":  # a hand split is scored as written: GPipe
        options = dataclasses.replace(options, schedule="gpipe")
    settings = PlanSettings.check(profile, len(balance), options)
    if settings.schedule not in ("gpipe", "1f1b"):
        raise InvalidInputError(f"schedule={settings.schedule!r}: a given balance is scored "
                                "with 'gpipe' or '1f1b' (one stage per device)")
    k = profile.size_index(split_size)
    return assemble(settings, profile, balance, k, solver, (split_size,))


def plan_candidates(profile: Profile, gpus: int = 2, options: PlanOptions = PlanOptions(), *,
                    top_k: int = 3) -> tuple[Plan, ...]:
    """The ``top_k`` best plans by block sums, at distinct micro-batch sizes, best first.

    The first is :func:`plan`'s own choice; the others are :func:`plan` with ``split_size``
    fixed to each other measured size, ranked by predicted step. Block sums misjudge sizes by
    different amounts, so these are the candidates worth timing stage by stage
    (:mod:`autosplit.verify.plans`) before one is chosen. ``options`` are :func:`plan`'s; with
    ``options.split_size`` given there is one candidate.

    Raises:
        As :func:`plan`.
    """
    top_k = checks.positive_int("top_k", top_k)
    best = plan(profile, gpus, options)
    if options.split_size is not None or top_k == 1:
        return (best,)
    batch = best.batch_size
    others = []
    for b in profile.microbatch_sizes:
        if b == best.split_size or b > batch:
            continue
        try:
            other = plan(profile, gpus, dataclasses.replace(options, split_size=b))
        except InfeasiblePlanError:
            continue
        others.append(dataclasses.replace(other, candidates=best.candidates))
    others.sort(key=lambda p: (p.predicted_step_ms, p.split_size))
    return (best, *others[: top_k - 1])
