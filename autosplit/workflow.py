"""One planning workflow, for ``autosplit.partition()``, ``autosplit plan`` and ``autosplit compare``.

From a profile (measured, read or estimated by the caller, with the machine's figures in it) to
the plan: the candidates by block sums, their stages verified as they run, the choice, and the
plans printed beside it. Each step runs once, in this order:

1. **Layouts** (:func:`~autosplit.planner.plan_layouts`): the best plan of every stages ×
   replicas layout, unless the request is for pipelines only.
2. **Candidates**: the best pipelines of N stages at distinct micro-batch sizes
   (:func:`~autosplit.planner.plan_candidates`; three when verifying, else one) and the best
   plan of every layout with replicas. A candidate whose block-sum step is more than
   :data:`SEPARATED` above the best's is not verified: block sums cannot be that far off.
3. **Verification** (a :data:`Verifier`, the caller's mechanism: it times stages): the
   candidates and the plans shown beside them (a hand split, the baselines) timed as they run;
   the best verified one is chosen (:func:`autosplit.verify.choice.verify_and_choose`).
4. **The plans beside it**: those the caller gave, and, when the choice has replicas, the best
   pipeline by block sums (verified like them).

Before the candidates, the runtime's cost per action is measured only for the schedules that
can win (:func:`schedules_worth_measuring`): a schedule whose best plan, with no runtime cost
at all, is no faster than the best plan already known (one replicated over every device, or of
a schedule whose cost is known) cannot be chosen whatever its cost, so its cost is not measured.

The workflow is policy on numbers: it measures nothing itself. Its callers give it the profile
and the verifier, and print what it returns.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from autosplit.errors import AutosplitError, InfeasiblePlanError, InvalidInputError
from autosplit.planner import Layouts, PlanOptions, plan, plan_candidates, plan_layouts
from autosplit.records import Plan, Profile
from autosplit.schedules import SEARCHED
from autosplit.topology import Topology

__all__ = ["SEPARATED", "PlanRequest", "Planned", "Verifier", "choose_plan",
           "schedules_worth_measuring"]

SEPARATED = 0.25
"""A candidate whose block-sum step exceeds the best candidate's by more than this fraction is
not verified. Block sums misjudge one layout against another by up to about 20 %: in
benchmarks/results/transformers.md pipelines were predicted 4–13 % long and data parallelism
7 % short of their measured steps."""

Verifier = Callable[[Sequence[Plan], Mapping[str, Plan]], tuple[Plan, dict[str, Plan]]]
"""``verify(candidates, others) -> (chosen, others verified)``: times the plans' stages as they
run and chooses among the candidates (:func:`autosplit.verify.choice.verify_and_choose`)."""

PIPELINE_AGAIN = "pipeline candidate "
"""Names of pipeline candidates given again among the other plans (timed once, not listed)."""


@dataclass(frozen=True, slots=True)
class PlanRequest:
    """What to plan for: the devices, and what the search may choose.

    Attributes:
        devices: N, the devices (pipeline stages × replicas).
        options: the batch, memory, schedule (``"auto"``: search them all), optimizer, link,
            micro-batch size, solver, all-reduce and replica mode
            (:class:`~autosplit.planner.options.PlanOptions`); its ``devices`` names one
            device per stage (``partition()``'s), for pipelines only.
        max_stages: bound on the pipeline's depth (``None``: the blocks).
        topology: nodes × devices per node, or ``None`` (one node).
        replicas: fix d, the data-parallel replicas (``None``: every layout is weighed).
        pipeline_only: weigh pipelines of N stages only (no replicas).
    """

    devices: int
    options: PlanOptions = PlanOptions(schedule="auto")
    max_stages: int | None = None
    topology: Topology | None = None
    replicas: int | None = None
    pipeline_only: bool = False

    def __post_init__(self) -> None:
        if self.replicas is not None and self.replicas > 1 and self.pipeline_only:
            raise InvalidInputError(f"pipeline_only with replicas={self.replicas}: give one "
                                    "of them")

    @property
    def schedule(self) -> str:
        """The schedule asked for (``"auto"``: every one searched)."""
        return self.options.schedule

    def planning(self, profile: Profile) -> PlanOptions:
        """The options of :func:`~autosplit.planner.plan` for a pipeline of N stages."""
        return dataclasses.replace(self.options,
                                   batch_size=self.options.batch_size or profile.batch_size)

    def searched(self, profile: Profile) -> PlanOptions:
        """The options of :func:`~autosplit.planner.plan_layouts` (one kind of device; with a
        topology, its links)."""
        out = dataclasses.replace(self.planning(profile), devices=None)
        if self.topology is not None:
            out = dataclasses.replace(out, bandwidth_bytes_per_s=None)
        return out

    def layouts(self, profile: Profile, replicas: int | None = None) -> Layouts:
        """:func:`~autosplit.planner.plan_layouts` as this request asks (``replicas`` fixes
        d)."""
        return plan_layouts(profile, self.devices, self.searched(profile),
                            topology=self.topology, replicas=replicas,
                            max_stages=self.max_stages)


@dataclass(frozen=True)
class Planned:
    """What the workflow chose, and what a caller shows beside it.

    Attributes:
        plan: the chosen plan (verified when a verifier was given).
        references: the plans printed beside it, by label (the caller's, then "the best
            pipeline" when the choice has replicas), verified like it.
        layouts: every stages × replicas layout with its best plan by block sums, or
            ``None`` (pipelines only, or nothing fits a layout).
        candidates: the plans the choice was made among, by block sums, best first.
        set_aside: candidates not verified, their block sums more than :data:`SEPARATED`
            above the best's.
        verify_s: seconds spent verifying (0 when nothing was).
        block_sum_choice: the candidate block sums ranked first.
    """

    plan: Plan
    references: tuple[tuple[str, Plan], ...]
    layouts: Layouts | None
    candidates: tuple[Plan, ...]
    set_aside: tuple[Plan, ...] = ()
    verify_s: float = 0.0
    block_sum_choice: Plan | None = field(default=None)

    @property
    def changed(self) -> bool:
        """Whether verification chose another plan than block sums alone would have."""
        first = self.block_sum_choice
        return first is not None and _shape(first) != _shape(self.plan)


def _shape(plan: Plan) -> tuple[Any, ...]:
    return (plan.balance, plan.replicas, plan.split_size, plan.schedule)


def choose_plan(profile: Profile, request: PlanRequest, verify: Verifier | None = None,
                others: Mapping[str, Plan] | None = None) -> Planned:
    """Plan ``profile`` as ``request`` asks: the candidates, verified by ``verify`` (``None``:
    chosen by block sums), and ``others`` (plans to show beside the choice, by label).

    Raises:
        InfeasiblePlanError: nothing fits.
        InvalidInputError: as the planner.
    """
    planning = request.planning(profile)
    layouts = None
    if request.replicas is not None and request.replicas > 1:  # one layout, fixed
        fixed = request.layouts(profile, request.replicas)
        return _verified(fixed.best, [fixed.best], (), {}, None, verify)
    if not request.pipeline_only:
        try:
            layouts = request.layouts(profile)
        except InfeasiblePlanError:  # nothing fits: the pipeline's planner says why
            layouts = None
    replicated = [] if layouts is None else [
        o.plan for o in layouts.options if o.plan is not None and o.replicas > 1]
    deepest = min(len(profile.blocks), request.max_stages or request.devices)
    pipelines: tuple[Plan, ...] = ()
    if request.devices <= deepest or not replicated:  # else no pipeline of N stages
        try:
            pipelines = plan_candidates(profile, request.devices, planning,
                                        top_k=3 if verify else 1)
        except InfeasiblePlanError:
            if not replicated:
                raise
    candidates = sorted([*pipelines, *replicated], key=lambda c: c.predicted_step_ms)
    best = candidates[0].predicted_step_ms
    kept = [c for c in candidates if c.predicted_step_ms <= best * (1 + SEPARATED)]
    aside = tuple(c for c in candidates if c not in kept)
    shown = dict(others or {})
    # the best pipeline by block sums, verified with the plans shown (a second time when it
    # is a candidate): printed beside a choice with replicas
    piped = {f"{PIPELINE_AGAIN}0": pipelines[0]} if replicated and pipelines else {}
    return _verified(candidates[0], kept, aside, {**shown, **piped}, layouts, verify,
                     tuple(candidates))


def _verified(first: Plan, kept: Sequence[Plan], aside: tuple[Plan, ...],
              others: dict[str, Plan], layouts: Layouts | None, verify: Verifier | None,
              candidates: tuple[Plan, ...] | None = None) -> Planned:
    """The choice among ``kept`` (verified when ``verify`` is given), with ``others``."""
    start = time.perf_counter()
    if verify is not None:
        plan, others = verify(list(kept), others)
    else:
        plan = first
    seconds = time.perf_counter() - start if verify is not None else 0.0
    piped = [name for name in others if name.startswith(PIPELINE_AGAIN)]
    best_piped = min((others.pop(name) for name in piped), key=lambda c: c.predicted_step_ms,
                     default=None)
    references = list(others.items())
    if best_piped is not None and plan.replicas > 1:
        references.append(("the best pipeline", best_piped))
    return Planned(plan, tuple(references), layouts, candidates or tuple(kept), aside,
                   seconds, first)


def schedules_worth_measuring(profile: Profile, request: PlanRequest,
                              known: Sequence[str]) -> tuple[str, ...]:
    """The schedules whose runtime cost per action may change the choice and is not
    ``known`` (measured), the most promising first.

    A schedule's best plan with no runtime cost is a lower bound on its best plan (the cost
    only adds to each action). The upper bound is the best plan known: data parallelism over
    every device (its one-stage cost is measured with the collectives) and the best plan of
    each ``known`` schedule, at its measured cost. A schedule whose lower bound is not below
    the upper bound cannot be chosen. A request for one schedule needs that one; a request
    with a topology or fixed replicas, every schedule not known.
    """
    names = list(dict.fromkeys(name for name, _ in SEARCHED))
    if request.schedule != "auto":
        return tuple(n for n in (request.schedule,) if n not in known)
    if request.topology is not None or request.replicas is not None:
        return tuple(n for n in names if n not in known)
    planning = request.planning(profile)
    bounds = []
    for name in names:
        if name in known:
            continue
        free = dataclasses.replace(profile, action_ms=((name, 0.0),), action_spread=())
        with contextlib.suppress(AutosplitError):  # not runnable here, or nothing fits
            bounds.append((plan(free, request.devices,
                                dataclasses.replace(planning, schedule=name))
                           .predicted_step_ms, name))
    best = math.inf
    if not request.pipeline_only:
        with contextlib.suppress(AutosplitError):  # the batch does not divide, nothing fits
            best = request.layouts(profile, request.devices).best.predicted_step_ms
    for name in known:
        with contextlib.suppress(AutosplitError):
            best = min(best, plan(profile, request.devices,
                                  dataclasses.replace(planning, schedule=name)
                                  ).predicted_step_ms)
    return tuple(name for bound, name in sorted(bounds) if bound < best)
