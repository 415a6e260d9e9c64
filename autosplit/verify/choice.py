"""Choose among candidate plans on their verified steps, and predict the choice unbiased.

The fastest of noisy figures is the luckiest: predicted from the timings that chose it, a plan
would look better than the plans printed beside it. So the best candidate is chosen on one
verification session (:func:`autosplit.verify.plans.verify_plans`) and predicted, with the plans
shown beside it and one device, from a second one; on a CPU both sessions run in one fresh
process (:mod:`autosplit.measure.timing_process`) beside one neighbouring worker
(:mod:`autosplit.measure.contention`).

Candidates that the first session cannot tell apart would be chosen by the noise alone, a
different one from each profile of the same model: those whose steps are within each other's
spread (as a printed ratio reads "within noise": :func:`autosplit.measure.spread.ratio_with_spread`),
or within :data:`RESOLVED_RATIO` of the fastest, the accuracy autosplit claims for a verified
ratio. Among those, the choice is the one the profile's block sums predict fastest
(:func:`steady_choice`): an independent measurement of the same plans, every block timed over
many interleaved rounds.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from autosplit import checks
from autosplit.devices import resolve_device
from autosplit.errors import InvalidInputError
from autosplit.graph import BlockGraph
from autosplit.measure import contention, timing_process
from autosplit.measure.profiler import check_inputs
from autosplit.measure.spread import PREDICTION_ERROR, ratio_with_spread
from autosplit.records import Plan, Profile
from autosplit.units import format_ms
from autosplit.verify.options import TimingOptions
from autosplit.verify.plans import verify_plans
from autosplit.verify.timed_runs import session_estimate_s, stage_runs, timed_runs

__all__ = ["RESOLVED_RATIO", "VerificationSkipped", "describe_shape", "steady_choice",
           "verify_and_choose"]

Progress = Callable[[int, int, str], None]
"""``progress(done, total, what)`` after each timed run."""

RESOLVED_RATIO = PREDICTION_ERROR
"""The smallest difference between two verified steps (a fraction of the faster) that the
choice acts on alone: the error a printed ratio of two verified steps allows
(:data:`autosplit.measure.spread.PREDICTION_ERROR`). A verified ratio is claimed within ±3 % of the
measured one (the README's Results, "How far the predictions hold"), and
benchmarks/accuracy.py measured its errors at 1–3 % in the median and up to 4.4–10 % per
run, wider than one session's spread of 0.5–2 %: one profile of ResNet101 chose b = 12 on a
session that put it clearly ahead of b = 16 (the choice of the other two profiles, and first
by block sums in all three), and b = 16 then measured 4 % faster."""


class VerificationSkipped(Exception):
    """Verifying would take longer than the budget left (:func:`verify_and_choose` with
    ``fit_budget``): nothing was timed.

    Attributes:
        needed_s: about how long the least verification would take (s).
        left_s: the budget left (s).
    """

    def __init__(self, needed_s: float, left_s: float) -> None:
        super().__init__(f"verifying would take about {needed_s:.0f} s; {left_s:.0f} s are left")
        self.needed_s, self.left_s = needed_s, left_s


def verify_and_choose(
    graph: BlockGraph,
    example_inputs: Any,
    profile: Profile,
    candidates: Sequence[Plan],
    others: Mapping[str, Plan] | None = None,
    *,
    fit_budget: bool = False,
    options: TimingOptions = TimingOptions(),
    progress: Callable[[int, int, str], None] | None = None,
) -> tuple[Plan, dict[str, Plan]]:
    """Choose the candidate with the shortest verified step and predict it, and the plans
    shown beside it, from a second verification; return the chosen plan and the others, by
    name.

    The fastest of noisy figures is the luckiest: predicted from the timings that chose it, a
    plan would look better than the plans beside it. So the best candidate is chosen on one
    session (:func:`steady_choice`: among those within noise of the fastest, the best by block
    sums) and
    predicted, with the others and one device, from a second (both in one fresh process on a
    CPU); ``options.budget_s`` (default 60 s) is shared by their stage runs. A single
    candidate is timed once, with the others. ``options`` and ``progress`` are
    :func:`~autosplit.verify.plans.verify_plans`'s.

    ``fit_budget``: ``options.budget_s`` bounds the whole verification, as estimated from block sums
    beforehand (:func:`~autosplit.verify.timed_runs.session_estimate_s`): both sessions when they fit,
    else one, of block sums' best candidate with the others (the choice then is block sums'),
    else none (:class:`VerificationSkipped`).

    Raises:
        InvalidInputError: no candidate; as :func:`~autosplit.verify.plans.verify_plans`.
        VerificationSkipped: with ``fit_budget``, not even one session fits ``budget_s``.
    """
    if not candidates:
        raise InvalidInputError("no candidate plan to verify")
    checks.instance_of("profile", profile, Profile, "an autosplit Profile")
    for plan in [*candidates, *(others or {}).values()]:  # before any process starts
        plan.check_model(graph.fingerprint, graph.model_name)
    checks.instance_of("options", options, TimingOptions, "an autosplit TimingOptions")
    if fit_budget and options.budget_s is not None:
        return _within_budget(graph, example_inputs, profile, candidates, others or {},
                              options, progress)
    if (len(candidates) > 1 and resolve_device(options.device).type == "cpu"
            and timing_process.enabled()):  # both sessions in one fresh process
        return timing_process.run_fresh(_choose_here, graph, example_inputs, profile,
                                       list(candidates), dict(others or {}), options,
                                       progress=progress)
    return _choose_here(graph, example_inputs, profile, candidates, others, options,
                        progress=progress)


def _choose_here(graph: BlockGraph, example_inputs: Any, profile: Profile,
                 candidates: Sequence[Plan], others: Mapping[str, Plan] | None,
                 options: TimingOptions, *, progress: Progress | None = None
                 ) -> tuple[Plan, dict[str, Plan]]:
    """:func:`verify_and_choose` here (timings in a fresh process unless this is one)."""
    named = {f"candidate {i}": c for i, c in enumerate(candidates)}
    others = dict(others or {})
    if len(named) == 1:
        verified = verify_plans(graph, example_inputs, profile, {**named, **others},
                                options=options, progress=progress)
        return verified["candidate 0"], {name: verified[name] for name in others}
    budget = options.budget_s
    first_runs = _run_count(named.values())
    second_runs = _run_count([*named.values()][:1] + [*others.values()]) + 1

    def session(share: float) -> TimingOptions:  # its share of the budget
        return dataclasses.replace(options, budget_s=None if budget is None else budget * share)

    def part(k: int) -> Progress | None:  # session k's progress, as half of the whole
        if progress is None:
            return None
        return lambda done, total, what: progress(k * total + done, 2 * total, what)

    share = first_runs / (first_runs + second_runs)
    with _shared_neighbour(graph, example_inputs, profile, [*named.values(), *others.values()],
                           options) as shared:
        chosen = verify_plans(graph, example_inputs, profile, named, one_device=False,
                              options=session(share), progress=part(0),
                              neighbour=shared)  # one device: in the second only
        name, close = steady_choice(chosen, named)
        verified = verify_plans(graph, example_inputs, profile, {name: named[name], **others},
                                options=session(1 - share), progress=part(1), neighbour=shared)
    best = verified[name]
    shapes = ", ".join(describe_shape(c) for c in candidates)
    fastest = min(chosen, key=lambda n: chosen[n].predicted_step_ms)
    there = format_ms(chosen[name].predicted_step_ms)
    top = ("the fastest" if name == fastest else
           f"beside the fastest ({format_ms(chosen[fastest].predicted_step_ms)})")
    how = (f"the fastest there, {there}" if len(close) == 1 else
           f"{there} there, {top}, of {len(close)} within noise or "
           f"{RESOLVED_RATIO:.0%} of the fastest: the best of "
           f"those by block sums, {format_ms(named[name].predicted_step_ms)}")
    best = dataclasses.replace(
        best, verification=f"{best.verification}; chosen among the {len(named)} best "
        f"candidates by block sums ({shapes}) on a first verification ({how}), predicted "
        "from a second one",
    )
    return best, {n: verified[n] for n in others}


def _within_budget(graph: BlockGraph, example_inputs: Any, profile: Profile,
                   candidates: Sequence[Plan], others: Mapping[str, Plan],
                   options: TimingOptions, progress: Progress | None
                   ) -> tuple[Plan, dict[str, Plan]]:
    """:func:`verify_and_choose` in the sessions that fit ``options.budget_s``."""
    assert options.budget_s is not None
    left = float(options.budget_s)
    cpu = resolve_device(options.device).type == "cpu"
    how = {"beside": cpu and contention.enabled(), "whole_batch": cpu}
    named = {f"candidate {i}": c for i, c in enumerate(candidates)}
    second = session_estimate_s(profile, {"candidate 0": candidates[0], **others}, **how)
    first = session_estimate_s(profile, named, False, **how) if len(named) > 1 else 0.0
    if second > left:
        raise VerificationSkipped(second, left)
    if first + second <= left:
        return verify_and_choose(graph, example_inputs, profile, candidates, others,
                                 options=options, progress=progress)
    best, verified = verify_and_choose(graph, example_inputs, profile, candidates[:1], others,
                                       options=options, progress=progress)
    best = dataclasses.replace(best, verification=(
        f"{best.verification}; chosen by block sums among the {len(named)} best candidates: "
        f"a session to choose among them by their stage runs would take about "
        f"{first:.0f} s more than the {left:.0f} s left"))
    return best, verified


def steady_choice(first: Mapping[str, Plan],
                  planned: Mapping[str, Plan]) -> tuple[str, tuple[str, ...]]:
    """The candidate to choose on a first verification session, and the names within noise of
    the fastest there, in the order given.

    ``first``: the candidates by name, each with its verified ``predicted_step_ms`` and
    ``step_spread``; ``planned``: the same names as planned, ``predicted_step_ms`` from the
    profile's block sums. Within noise: a verified step at most :data:`RESOLVED_RATIO` longer
    than the fastest's, or the ratio of the two, each at its median ± its spread, can be 1
    (:func:`autosplit.measure.spread.ratio_with_spread`; a plan without a spread is told apart
    by the first rule alone). Among those, the choice goes to the shortest
    step by block sums (an independent measurement, steadier from one profile to the next than
    a few rounds of stage runs), then the shorter verified step. On clear differences the
    fastest verified is chosen.

    Raises:
        InvalidInputError: no plan, or a name of ``first`` missing from ``planned``.
    """
    if not first:
        raise InvalidInputError("no candidate plan to choose among")
    missing = [n for n in first if n not in planned]
    if missing:
        raise InvalidInputError(f"candidates {missing} have no planned step to choose by")
    fastest = min(first, key=lambda n: first[n].predicted_step_ms)
    top = first[fastest]

    def within(plan: Plan) -> bool:
        if plan.predicted_step_ms <= top.predicted_step_ms * (1 + RESOLVED_RATIO):
            return True
        if plan.step_spread is None or top.step_spread is None:
            return False
        return ratio_with_spread(plan.predicted_step_ms, plan.step_spread,
                                 top.predicted_step_ms, top.step_spread).within_noise

    close = tuple(n for n, plan in first.items() if within(plan))
    name = min(close, key=lambda n: (planned[n].predicted_step_ms, first[n].predicted_step_ms))
    return name, close


def _shared_neighbour(graph: BlockGraph, example_inputs: Any, profile: Profile,
                      plans: Sequence[Plan], options: TimingOptions
                      ) -> contextlib.AbstractContextManager[contention.Neighbour | None]:
    """One neighbouring worker for both sessions of :func:`verify_and_choose` (on a CPU, with
    stages to time beside it: else ``None``), started for every run it may be asked for; a
    process started once, not once per session (its start, loading torch and the model, took
    about 2 s of each session on the development machines)."""
    beside = resolve_device(options.device).type == "cpu" and contention.enabled()
    runs = [other for plan in plans for _, other in timed_runs(plan, beside) if other]
    if not runs or not beside:
        return contextlib.nullcontext()
    return contention.Neighbour(graph, check_inputs(example_inputs), runs,
                               options.loss or profile.loss, options.threads)


def _run_count(plans: Any) -> int:
    """Distinct stage runs of ``plans`` (a verification session takes turns over them)."""
    return len({r for plan in plans for r in stage_runs(plan)}) or 1


def describe_shape(plan: Plan) -> str:
    """``2 stages b=15``, ``1 stage × 2 replicas b=15``: a candidate in a few words."""
    p = len(plan.stages)
    replicas = f" × {plan.replicas} replicas" if plan.replicas > 1 else ""
    return f"{p} stage{'s' if p != 1 else ''}{replicas} b={plan.split_size}"
