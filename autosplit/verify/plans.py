"""Measure what is claimed: time the stages of candidate plans as they will run.

Block sums drive the search, but a stage's blocks run together are not the sum of the blocks
timed one by one (caches, allocator and kernel choices differ), and by a different amount at
each micro-batch size. So before a plan is printed or saved, each stage of the best few
candidates, and of every plan shown beside them, is timed as it will run: its contiguous
blocks together (:meth:`~autosplit.graph.BlockGraph.extract`), forward and backward, at the
plan's micro-batch size b, with as many micro-batches in flight as the plan's schedule keeps
on that stage (all m on a GPipe stage; :mod:`autosplit.verify.stage_timing` times them, taking turns
A B A B), and, on the stages of a zero-bubble schedule whose inputs need a gradient, with the
backward in two passes, input gradient then weight gradient, as torch runs it there
(:class:`~autosplit.verify.stage_timing.SplitBackward`: two passes cost more than one, by 10–13 % on
ResNet50 and GPT small, and the weight pass's share is the stage's own) — and in one pass too
where the schedule runs some of that stage's backwards whole (DualPipeV's ``B`` actions:
:attr:`~autosplit.records.Stage.whole_backward_ms`); a stage the plan checkpoints is timed
under activation checkpointing, its backward with the recomputation
(:class:`~autosplit.verify.stage_timing.Checkpointed`). Every other round a
stage starts without gradients, as a step's first micro-batch does (its backward makes them),
the others add into them; a step of m micro-batches is predicted with one of the first kind
and m − 1 of the second (:meth:`StageTime.per_step`).
Adding into gradients costs more: ResNet50's forward and backward at b = 24 (64×64) took 2–5 %
longer than starting without them.

On a CPU a plan's workers are processes on one machine, and they slow each other down while
they compute at the same time (:mod:`autosplit.measure.contention`): a stage of a plan with several
workers is timed beside the neighbouring worker's stage, which another process runs on another
core, and, for a pipeline, alone too. Replicas compute side by side all the step: their time
beside each other is theirs. A pipeline's ranks overlap only in part (the fill, the drain, the
waits): each stage's time is its time alone plus the share of its rank's work that overlaps
another rank's in the schedule's simulation times the difference to its time beside the
neighbour (:func:`_stage_times`). One device is timed alone. On GPT small's seven schedules
(2 workers, AMD EPYC, one job), the prediction from stages timed alone was −9 … +5 % of the
measured step (five of seven below), from stages timed beside the neighbour −1 … +12 %.

Each plan is then predicted again by the same simulator (:mod:`autosplit.simulator`) from
these stage times; transfers keep the plan's modelled link time. The best of several
candidates is chosen on one such session and predicted from a second one, with the plans
printed beside it (:func:`autosplit.verify.choice.verify_and_choose`): the fastest of noisy
figures is its luckiest.
The whole model is timed in one piece too, for the "over one device" figure: at the
profile's best micro-batch size, accumulated, and on a CPU also on the whole batch at once
(which is faster depends on the machine); on a GPU the whole batch may not fit.

Spreads are relative: half the interquartile range over the median (a fraction).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from autosplit import checks
from autosplit.cost import whole_update_ms
from autosplit.devices import resolve_device
from autosplit.graph import BlockGraph
from autosplit.measure import contention, steal_time
from autosplit.measure.contention import Neighbour
from autosplit.measure.profiler import check_inputs
from autosplit.records import Plan, Profile
from autosplit.simulator import overlap_fractions, simulate_plan
from autosplit.units import format_ms
from autosplit.verify.options import TimingOptions
from autosplit.verify.stage_timing import (
    Beside,
    Checkpointed,
    Item,
    SplitBackward,
    StageTime,
    time_stages,
    wrapped,
)
from autosplit.verify.timed_runs import (
    SESSION_START_S,
    depths,
    session_estimate_s,
    session_runs,
    stage_ranks,
    timed_items,
    whole_items,
)

__all__ = ["PlanTimes", "SESSION_START_S", "StageTime", "predict_verified", "session_estimate_s",
           "time_plans", "time_stages", "verify_plans"]


def _step_of(t: StageTime, m: int) -> float:
    """One device's step of m micro-batches run one after the other (ms)."""
    return m * t.per_step(m).compute_ms


BLEND_ROUNDS = 2
"""How often a pipeline's overlaps are simulated again from the stage times they gave."""


def _stage_times(plan: Plan, timed: Sequence[StageTime], share: float | None = None,
                 whole: Sequence[StageTime] = ()
                 ) -> tuple[list[StageTime], str, list[StageTime] | None]:
    """Each stage's time for the prediction, from ``timed`` (as :func:`~autosplit.verify.timed_runs.timed_runs` lists),
    how it was made, in words for :attr:`Plan.verification`, and the same of each stage's
    backward run in one pass, from ``whole`` (as :func:`~autosplit.verify.timed_runs.whole_items` lists; ``None`` if
    empty), weighed with the same shares.

    One device: its time alone. Replicas compute side by side all the time: their time beside
    each other. A pipeline's stage computes beside another rank's work only for part of the
    step (the fill, the drain, waiting for inputs): its time is its time alone plus, for the
    share of its rank's work that overlaps another rank's in the schedule's simulation
    (:func:`~autosplit.simulator.overlap_fractions`, with DualPipeV's ``B`` actions as the one
    pass), the difference to its time beside its neighbour; the shares are simulated again from
    the times they give (:data:`BLEND_ROUNDS`). ``share`` fixes every rank's share instead
    (0: alone, 1: beside).
    """
    n = len(plan.stages)
    together, one = list(timed[:n]), list(whole[:n]) or None
    if not any(t.beside for t in together):
        return together, "", one
    if n == 1:
        return together, ", beside its replica running on another core", one
    ranks = stage_ranks(plan)

    def blend(shares: Sequence[float]) -> tuple[list[StageTime], list[StageTime] | None]:
        def mixed(rows: Sequence[StageTime]) -> list[StageTime]:
            return [a.blend(b, shares[ranks[s]])
                    for s, (a, b) in enumerate(zip(rows[n:], rows[:n]))]
        return mixed(timed), mixed(whole) if whole else None

    if share is not None:
        words = (f", alone and beside its neighbouring worker's stage running on another "
                 f"core, weighed {share:.0%} beside")
        times, one = blend([share] * n)
        return times, words, one
    times, one = list(timed[n:]), list(whole[n:]) or None
    shares: tuple[float, ...] = ()
    for _ in range(BLEND_ROUNDS):
        shares = overlap_fractions(simulate_plan(_scaled(plan, times, 0, whole=one)))
        times, one = blend(shares)
    overlap = "/".join(f"{x:.0%}" for x in shares)
    return times, (f", alone and beside its neighbouring worker's stage running on another "
                   f"core, weighed by the share of each rank's work that overlaps another's "
                   f"in the schedule ({overlap})"), one


def _scaled(plan: Plan, times: Sequence[StageTime], factor: int,
            action_spread_ms: float = 0.0, whole: Sequence[StageTime] | None = None) -> Plan:
    """The plan with each stage's time moved by ``factor`` (−1, 0, +1) times its spread, and
    the runtime's cost per action by ``factor`` times ``action_spread_ms`` (not below 0); a
    stage's weight-gradient part is the share its split backward was timed with
    (:attr:`StageTime.weight_share`), else the share the search gave it; a stage timed split
    and ``whole`` too (:func:`~autosplit.verify.timed_runs.whole_items`) keeps that backward as its one pass
    (:attr:`~autosplit.records.Stage.whole_backward_ms`; ``None`` otherwise). A checkpointed
    stage was timed so (:class:`Checkpointed`): its backward less its forward is the backward
    the simulation adds the recomputation to."""
    stages = []
    for k, (s, t) in enumerate(zip(plan.stages, times)):
        scale = max(1 + factor * t.spread, 0.0)
        forward = t.forward_ms * scale
        compute = forward + max(t.backward_ms * scale - (forward if s.checkpoint else 0.0), 0.0)
        backward_before = s.compute_ms - s.forward_ms
        share = (t.weight_share if t.weight_share is not None
                 else s.weight_grad_ms / backward_before if backward_before > 0 else 0.0)
        one_pass = (whole[k].backward_ms * max(1 + factor * whole[k].spread, 0.0)
                    if whole and t.weight_share is not None else None)
        stages.append(dataclasses.replace(
            s, compute_ms=compute, forward_ms=forward, whole_backward_ms=one_pass,
            weight_grad_ms=min(share, 1.0) * (compute - forward),
            block_sum_ms=s.compute_ms if s.block_sum_ms is None else s.block_sum_ms,
            verified_spread=t.spread,
        ))
    return dataclasses.replace(plan, stages=tuple(stages),
                               action_ms=max(plan.action_ms + factor * action_spread_ms, 0.0))


@dataclass(frozen=True)
class PlanTimes:
    """The stage runs of several plans, timed in one session (:func:`time_plans`).

    Attributes:
        times: each timed item (:data:`~autosplit.verify.stage_timing.Beside`, or one wrapped in
            :class:`~autosplit.verify.stage_timing.SplitBackward` or
            :class:`~autosplit.verify.stage_timing.Checkpointed`) and its time.
        depths: per plan name, the micro-batches in flight each stage was timed with.
        singles: per plan name, the ways one device was timed running its batch.
        beside: whether the stages of plans with several workers were timed beside a
            neighbour, and alone (:func:`~autosplit.verify.timed_runs.timed_runs`).
    """

    times: Mapping[Item, StageTime]
    depths: Mapping[str, tuple[int, ...]]
    singles: Mapping[str, tuple[Beside, ...]]
    beside: bool

    @property
    def rounds(self) -> int:
        """The fewest timed rounds of any item."""
        return min(t.rounds for t in self.times.values())

    @property
    def set_aside(self) -> int:
        """Timed runs set aside because the hypervisor took the CPUs meanwhile (all items)."""
        return sum(t.set_aside for t in self.times.values())


def time_plans(
    graph: BlockGraph,
    example_inputs: Any,
    profile: Profile,
    plans: Mapping[str, Plan],
    one_device: bool = True,
    *,
    options: TimingOptions = TimingOptions(),
    progress: Callable[[int, int, str], None] | None = None,
    neighbour: Neighbour | None = None,
) -> PlanTimes:
    """Time the stages of every plan as they run (and one device), taking turns in one
    session; :func:`predict_verified` predicts the plans from them. ``options``, ``progress``
    and ``neighbour`` are :func:`time_stages`'s (the loss, unless given: the profile's).

    Raises:
        ModelMismatchError: a plan is of another model than ``graph``.
        As :func:`time_stages`.
    """
    checks.instance_of("profile", profile, Profile, "an autosplit Profile")
    for plan in plans.values():
        plan.check_model(graph.fingerprint, graph.model_name)
    beside = resolve_device(options.device).type == "cpu" and contention.enabled()
    whole = _whole_batch_fits(example_inputs, options.device)
    runs, deepest, singles = session_runs(profile, plans, one_device, beside, whole)
    if options.loss is None:
        options = dataclasses.replace(options, loss=profile.loss)
    times = time_stages(graph, example_inputs, runs, options=options, progress=progress,
                        depths=deepest, neighbour=neighbour)
    return PlanTimes(times, {name: tuple(depths(plan)) for name, plan in plans.items()},
                     singles, beside)


def predict_verified(profile: Profile, plans: Mapping[str, Plan], timed: PlanTimes,
                     share: float | None = None) -> dict[str, Plan]:
    """Every plan of :func:`time_plans` predicted again from its stage times.

    Each returned plan's stages have ``compute_ms`` / ``forward_ms`` from the stage runs,
    ``block_sum_ms`` from the search and ``verified_spread``; ``predicted_step_ms`` is the
    schedule simulation of those times plus the all-reduces and the update after the last
    backward, from the cost model (:attr:`Plan.after_pipeline_ms`: weights shared across
    stages, the replicas' gradients, the profile's timed update), ``step_spread`` its spread (the simulation of every
    stage at median ± spread and of the runtime's cost per action at its median ± spread,
    :attr:`Profile.action_spread`), ``single_device_ms`` the whole model timed in one piece (the
    faster of the profile's best micro-batch size, accumulated, and, on a CPU, the whole batch
    at once; not timed: the plan's kept) and ``single_device_split`` the micro-batch size of
    that faster way (the batch size: at once), and ``verification`` says how.

    ``share``: a pipeline's stages take this share (0 … 1) of the difference between their
    time alone and beside the neighbour, not the simulated overlap (:func:`_stage_times`;
    benchmarks compare the two).
    """
    distinct = len(timed.times)
    out = {}
    for name, plan in plans.items():
        items = timed_items(plan, timed.beside)
        stage_times, how, whole = _stage_times(
            plan, [timed.times[r].per_step(plan.microbatches) for r in items], share,
            [timed.times[r].per_step(plan.microbatches)
             for r in whole_items(plan, timed.beside)])
        if any(isinstance(r, Checkpointed) for r in items):
            how += ("; checkpointed stages timed under activation checkpointing, their "
                    "backward with the recomputation")
        if any(wrapped(r, SplitBackward) for r in items):
            how += ("; on stages whose inputs need a gradient, the backward in two passes, "
                    "input gradient then weight gradient, as the schedule runs it"
                    + (", and in one pass too, as it runs some" if whole else ""))
        action_spread = (  # the spread of the cost per action the plan carries
            profile.action_spread_of(plan.schedule) if len(plan.stages) > 1
            else profile.one_stage_action()[1] if plan.replicas > 1 else 0.0)
        mid, low, high = (_scaled(plan, stage_times, f, action_spread, whole)
                          for f in (0, -1, 1))
        step = simulate_plan(mid).step_ms + plan.after_pipeline_ms  # all-reduces, update
        spread = (simulate_plan(high).step_ms - simulate_plan(low).step_ms) / 2 / step
        one_ms, one, one_split = min(
            ((_step_of(timed.times[r], math.ceil(plan.batch_size / r[0][2]))
              + whole_update_ms(profile, plan.optimizer), timed.times[r], r[0][2])
             for r in timed.singles[name]),
            key=lambda way: way[0],
            default=(plan.single_device_ms, None, plan.single_device_split))
        p = len(plan.stages)
        out[name] = dataclasses.replace(
            mid,
            predicted_step_ms=step,
            step_spread=spread,
            single_device_ms=one_ms,
            single_device_spread=plan.single_device_spread if one is None else one.spread,
            single_device_split=one_split,
            bound_step_ms=(plan.microbatches + p - 1)
            * max(s.compute_ms + s.send_ms for s in mid.stages),
            verification=(
                f"each stage's blocks timed together at b={plan.split_size}, forward and "
                f"backward, micro-batches in flight per stage "
                f"{'/'.join(map(str, timed.depths[name]))}, {distinct} stage runs taking "
                f"turns over ≥ {timed.rounds} rounds{how}; "
                + (f"{timed.set_aside} timing(s) set aside, the hypervisor taking over "
                   f"{steal_time.MAX_SHARE:.0%} of the CPUs meanwhile; " if timed.set_aside else "")
                + (f"torch's runtime {plan.action_ms:.2f} ± {action_spread:.2f} ms per "
                   "action; " if plan.action_ms + action_spread > 0 else "")
                + f"block sums gave {format_ms(plan.predicted_step_ms)}"
            ),
        )
    return out


def verify_plans(
    graph: BlockGraph,
    example_inputs: Any,
    profile: Profile,
    plans: Mapping[str, Plan],
    one_device: bool = True,
    *,
    options: TimingOptions = TimingOptions(),
    progress: Callable[[int, int, str], None] | None = None,
    neighbour: Neighbour | None = None,
) -> dict[str, Plan]:
    """Every plan with its stages timed as they run (:func:`time_plans`) and its step
    predicted again from them (:func:`predict_verified`; ``one_device=False``: one device not
    timed). ``options``, ``progress`` and ``neighbour`` are :func:`time_plans`'s.

    Raises:
        ModelMismatchError: a plan is of another model than ``graph``.
        As :func:`time_stages`.
    """
    timed = time_plans(graph, example_inputs, profile, plans, one_device, options=options,
                       progress=progress, neighbour=neighbour)
    return predict_verified(profile, plans, timed)


def _whole_batch_fits(example_inputs: Any, device: Any) -> Callable[[int], bool]:
    """Whether one device's step is timed on the whole batch B in one piece (as it is run):
    on a CPU when the example inputs hold B samples. On a GPU the whole batch may not fit in
    its memory: the profile's best micro-batch size, accumulated, is timed instead."""
    if resolve_device(device).type != "cpu":
        return lambda batch: False
    available = int(check_inputs(example_inputs)[0].shape[0])
    return lambda batch: batch <= available
