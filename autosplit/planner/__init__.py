"""From a Profile to a Plan: choose the cut points and the micro-batch size together.

What is optimised: the plan's ``predicted_step_ms``, the event simulation of one training step
of the schedule (:func:`autosplit.simulator.simulate_plan`: GPipe or 1F1B, with each cut's
transfer and the pipeline runtime's measured cost per action (``Profile.action_ms``) in every
forward and backward, on devices of different speeds or profiles). The plan returned has the smallest
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

The package: :mod:`~autosplit.planner.options` (what the caller asks for, :class:`PlanOptions`),
:mod:`~autosplit.planner.settings` (those options resolved against the profile),
:mod:`~autosplit.planner.problems` (the numbers the solvers see),
:mod:`~autosplit.planner.search` (:func:`plan`, :func:`plan_with_balance`,
:func:`plan_candidates`), :mod:`~autosplit.planner.layouts` (stages × data-parallel replicas:
:func:`plan_layouts`, :func:`plan_replicated`) and :mod:`~autosplit.planner.assembly` (the Plan
record).
"""

from __future__ import annotations

from autosplit.planner.layouts import LayoutOption, Layouts, plan_layouts, plan_replicated
from autosplit.planner.options import SOLVERS, PlanOptions
from autosplit.planner.search import plan, plan_candidates, plan_with_balance
from autosplit.planner.settings import PlanSettings, memory_sizes

__all__ = [
    "plan",
    "PlanOptions",
    "plan_candidates",
    "plan_with_balance",
    "plan_layouts",
    "plan_replicated",
    "Layouts",
    "LayoutOption",
    "PlanSettings",
    "SOLVERS",
    "memory_sizes",
]
