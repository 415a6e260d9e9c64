"""Plans side by side: autosplit's optimum, a hand-written split and the peers' heuristics.

Every plan is scored by the same cost model (:func:`autosplit.planner.plan_with_balance`), so the
comparison is on equal terms. A heuristic that does not choose a micro-batch size is given the
best measured one for its own cut points (the most favourable reading of it).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from autosplit import checks
from autosplit.cost import block_time_ms
from autosplit.errors import InvalidInputError, ModelMismatchError
from autosplit.planner import PlanOptions, PlanSettings, plan_with_balance
from autosplit.records import Plan, Profile
from autosplit.solve import block_partition, by_parameters, manual, uniform

__all__ = ["BASELINES", "ComparisonRow", "baseline_plans", "manual_plan", "compare"]

BASELINES = ("uniform", "parameters", "torchgpipe")
"""uniform: equal block counts (DeepSpeed 'uniform'); parameters: balanced parameter bytes
(DeepSpeed 'parameters'); torchgpipe: the block-partition heuristic on measured block times."""


def _best_over_sizes(
    profile: Profile,
    balance_at: Callable[[int], Sequence[int]],
    label: str,
    batch: int,
    options: PlanOptions,
) -> Plan:
    plans = [
        plan_with_balance(profile, balance_at(k), b, options, solver=label)
        for k, b in enumerate(profile.microbatch_sizes)
        if b <= batch
    ]
    if not plans:
        raise InvalidInputError(
            f"no profiled micro-batch size fits the batch {batch}: profiled sizes are "
            f"{list(profile.microbatch_sizes)}"
        )
    return min(plans, key=lambda p: p.predicted_step_ms)


def manual_plan(
    profile: Profile,
    split_points: Sequence[str],
    split_size: int | None = None,
    options: PlanOptions = PlanOptions(),
) -> Plan:
    """A hand-written split (e.g. the tutorial's ``["layer3"]`` at split size 20), scored.

    ``split_size=None`` gives it the best measured size for those cut points; of ``options``,
    the batch, devices, memory, schedule, optimizer and link count
    (:func:`~autosplit.planner.plan_with_balance`).

    Raises:
        ArgumentTypeError: an argument of the wrong type (``split_points="layer3"``, …).
        InvalidInputError: an unknown or misplaced split point, an unprofiled ``split_size``,
            or a bad device argument.
    """
    checks.instance_of("profile", profile, Profile, "an autosplit Profile")
    balance = manual(profile.block_names, split_points)
    if split_size is not None:
        return plan_with_balance(profile, balance, split_size, options, solver="manual")
    batch = PlanSettings.check(profile, len(balance), options).batch_size
    return _best_over_sizes(profile, lambda k: balance, "manual", batch, options)


def baseline_plans(profile: Profile, gpus: int, options: PlanOptions = PlanOptions()
                   ) -> dict[str, Plan]:
    """The peers' plans for ``gpus`` stages, by name (see :data:`BASELINES`).

    Of ``options``, the batch, devices, memory, schedule, optimizer and link count
    (:func:`~autosplit.planner.plan_with_balance`).

    Raises:
        ArgumentTypeError: an argument of the wrong type (``gpus="2"``, …).
        InvalidInputError: a bad value (``gpus`` < 1 or above the blocks, …).
    """
    batch = PlanSettings.check(profile, gpus, options).batch_size
    n = len(profile.blocks)
    params = [float(blk.param_bytes) for blk in profile.blocks]
    fixed = {"uniform": uniform(n, gpus), "parameters": by_parameters(params, gpus)}
    plans = {
        name: _best_over_sizes(profile, lambda k, bal=bal: bal, name, batch, options)
        for name, bal in fixed.items()
    }
    plans["torchgpipe"] = _best_over_sizes(
        profile,
        lambda k: block_partition([block_time_ms(blk, k) for blk in profile.blocks], gpus),
        "torchgpipe",
        batch,
        options,
    )
    return plans


@dataclass(frozen=True, slots=True)
class ComparisonRow:
    """One plan in a comparison.

    Attributes:
        name: the plan's label.
        plan: the plan.
        predicted_step_ms: its predicted step time.
        vs_best: predicted step time divided by the best one in the comparison (≥ 1).
        bottleneck_stage: index of the slowest stage (compute + transfer).
        bottleneck_ms: that stage's time per micro-batch.
        bubble_fraction: idle share of device time.
        memory_bytes: predicted memory of each device.
        measured_step_ms: a measured step time, when one was taken.
    """

    name: str
    plan: Plan
    predicted_step_ms: float
    vs_best: float
    bottleneck_stage: int
    bottleneck_ms: float
    bubble_fraction: float
    memory_bytes: tuple[int, ...]
    measured_step_ms: float | None = None


def compare(
    profile: Profile,
    plans: Mapping[str, Plan],
    measured_ms: Mapping[str, float] | None = None,
) -> tuple[ComparisonRow, ...]:
    """Rows comparing ``plans`` (all of ``profile``'s model), in the given order.

    Raises:
        ArgumentTypeError: ``plans`` is not a mapping of names to Plans, or a measured time
            is not a number.
        InvalidInputError: no plan, or a measured time that is not finite and > 0 ms.
        ModelMismatchError: a plan is of another model than ``profile``.
    """
    checks.instance_of("profile", profile, Profile, "an autosplit Profile")
    checks.instance_of("plans", plans, Mapping, "a mapping of names to Plans")
    if not plans:
        raise InvalidInputError("nothing to compare: give at least one plan")
    for name, plan in plans.items():
        checks.instance_of(f"plans[{name!r}]", plan, Plan, "an autosplit Plan")
    if measured_ms is not None:
        checks.instance_of("measured_ms", measured_ms, Mapping, "a mapping of names to ms")
        for name, ms in measured_ms.items():
            checks.positive_finite(f"measured_ms[{name!r}]", ms, "ms")
    for name, plan in plans.items():
        if plan.fingerprint != profile.fingerprint:
            raise ModelMismatchError(
                f"plan {name!r} is for another model ({plan.model}, fingerprint "
                f"{plan.fingerprint}) than the profile ({profile.model}, {profile.fingerprint})"
            )
    best = min(p.predicted_step_ms for p in plans.values())
    rows = []
    for name, plan in plans.items():
        times = [s.compute_ms + s.send_ms for s in plan.stages]
        slowest = max(range(len(times)), key=lambda s: times[s])
        rows.append(
            ComparisonRow(
                name=name,
                plan=plan,
                predicted_step_ms=plan.predicted_step_ms,
                vs_best=plan.predicted_step_ms / best if best > 0 else 1.0,
                bottleneck_stage=slowest,
                bottleneck_ms=times[slowest],
                bubble_fraction=plan.bubble_fraction,
                memory_bytes=tuple(s.memory_bytes for s in plan.stages),
                measured_step_ms=(measured_ms or {}).get(name),
            )
        )
    return tuple(rows)
