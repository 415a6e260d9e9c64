"""``schedule="auto"``: schedule, stages per rank, cuts, micro-batch size and recomputation.

Symbols: p ranks, v stages per rank, p·v stages, b the micro-batch size, m = ceil(B / b).
For every searched (schedule, v) (:data:`SEARCHED`) and every measured b ≤ B, the exact search
of :func:`autosplit.solve.joint.solve_joint` finds the cuts into p·v stages and the stages to
checkpoint with the smallest step of the replay of torch's own order
(:mod:`autosplit.schedules`, every action with the runtime's measured cost per action of that
schedule, ``Profile.action_ms``), within memory per rank: weights and optimizer state of the
rank's stages + torch's per micro-batch buffers at its cuts + the replay's peak bytes in flight
(activations, outputs, gradients, and a backward's transient on top of what is held when it
starts, from the blocks' measured peaks). The plan is
the fastest over all of them (ties: smaller b, then the order of :data:`SEARCHED`); each
schedule's best is kept for the "why" table.

What is not offered, and why (:attr:`ScheduleOption.why`): zero-bubble schedules when the
profile has no input/weight split of the backward (``input_grad_ms``), checkpointing when it
has no ``checkpoint_saved_bytes``, checkpointing with a split backward (:data:`NO_RECOMPUTE`:
torch's weight pass runs the checkpointed forward again once per group of parameters it
differentiates, so the stage's forward is paid many times over), a (schedule, v) that torch's
class refuses for (p, m), more stages than blocks, and more ways to cut than the joint search
enumerates (:func:`too_many_cuts`; GPipe and 1F1B on one stage per rank are then planned by
their own exact search, :func:`autosplit.planner.search.plan`, without recomputation). Devices of different speeds or profiles
are planned with GPipe and 1F1B only (:func:`autosplit.planner.plan`), as are layouts with replicas.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass

from autosplit.cost import block_transient_bytes, optimizer_factor, single_device_ms, transfer_ms
from autosplit.errors import AutosplitError, InfeasiblePlanError, InvalidInputError
from autosplit.planner.assembly import explain_infeasible, shared_weights
from autosplit.planner.problems import _copy_bytes
from autosplit.planner.settings import PlanSettings
from autosplit.records import Plan, Profile, Stage
from autosplit.schedules import SEARCHED, SPLIT_BACKWARD, torch_order
from autosplit.solve.joint import (
    MAX_BALANCES,
    JointProblem,
    JointSolution,
    solve_joint,
    stage_costs,
)
from autosplit.solve.joint_problem import rank_update_ms

__all__ = ["SEARCHED", "ScheduleChoice", "ScheduleOption", "joint_problem", "plan_schedules",
           "too_many_cuts"]


SPLIT = SPLIT_BACKWARD
"""Schedules that split the backward into input (I) and weight (W) gradients."""

JOINT_LIMIT_S = 60.0
"""Time limit (s) of one exact search (one schedule, v and b); reached: best found."""


NO_RECOMPUTE = ("no recomputation: torch's weight pass would run a checkpointed stage's "
                "forward again for each group of parameters")
"""The note of a split-backward schedule, planned without recomputation."""


@dataclass(frozen=True, slots=True)
class ScheduleOption:
    """The best plan of one (schedule, v), or why it has none.

    Attributes:
        schedule: the schedule's name; v: stages per rank.
        plan: its best plan over cuts, b and recomputation, ``None`` when none.
        why: why there is no plan (not offered, or nothing fits), or what its search left
            out (:data:`NO_RECOMPUTE`), else ``""``.
    """

    schedule: str
    v: int
    plan: Plan | None
    why: str = ""


@dataclass(frozen=True, slots=True)
class ScheduleChoice:
    """The chosen plan and every schedule's best (:data:`SEARCHED` order)."""

    best: Plan
    options: tuple[ScheduleOption, ...]


def joint_problem(settings: PlanSettings, profile: Profile, k: int, m: int) -> JointProblem:
    """The numbers of size index k for :func:`solve_joint` (ms, bytes): each block's
    transient need (:func:`~autosplit.cost.block_transient_bytes`) is part of the replay, so
    the capacity is each device's whole memory."""
    blocks = profile.blocks
    factor = optimizer_factor(settings.optimizer)
    copies = _copy_bytes(profile)
    split = all(b.input_grad_ms is not None and b.weight_grad_ms is not None for b in blocks)
    ckpt = all(b.checkpoint_saved_bytes is not None for b in blocks)
    half = tuple(transfer_ms(c.bytes[k], settings.bandwidth_bytes_per_s) / 2
                 for c in profile.cuts)
    capacity = None if settings.capacity_bytes is None else tuple(
        float(c) for c in settings.capacity_bytes)
    return JointProblem(
        fwd_ms=tuple(b.fwd_ms[k] for b in blocks),
        bwd_ms=tuple(b.bwd_ms[k] for b in blocks),
        split_held_bytes=tuple(float(b.split_held_bytes[k])  # type: ignore[index]
                               for b in blocks) if split and all(
            b.split_held_bytes is not None for b in blocks) else None,
        input_grad_ms=_row(blocks, "input_grad_ms", k) if split else None,
        weight_grad_ms=_row(blocks, "weight_grad_ms", k) if split else None,
        saved_bytes=tuple(float(b.saved_bytes[k]) for b in blocks),
        cut_bytes=tuple(float(c.bytes[k]) for c in profile.cuts),
        input_bytes=(float(blocks[0].checkpoint_saved_bytes[k]),  # type: ignore[index]
                     *(float(c.bytes[k]) for c in profile.cuts)) if ckpt else None,
        # the weight gradients come and go with each step (grad_bytes), the rest stays
        static_bytes=tuple(float((b.param_bytes + copies[i]) * (factor - 1) + b.buffer_bytes)
                           for i, b in enumerate(blocks)),
        grad_bytes=tuple(float(b.param_bytes + copies[i]) for i, b in enumerate(blocks)),
        comm_fwd_ms=half, comm_bwd_ms=half, m=m, capacity_bytes=capacity,
        # what crosses a cut and a block after it saves was saved before it, by the sender
        output_saved_bytes=tuple(float((b.saved_shared_bytes or (0,) * (k + 1))[k])
                                 for b in blocks[1:]),
        final_output_bytes=float(blocks[-1].output_bytes[k]),
        transient_bytes=tuple(block_transient_bytes(b, k) for b in blocks),
        shared=tuple((w.blocks, float(w.bytes * (factor - 1)), float(w.bytes))
                     for w in profile.shared),
        transfers_on_cores=settings.transfers_on_cores,
        update_ms=profile.update_ms_of(settings.optimizer),
    )


def _row(blocks: tuple, field: str, k: int) -> tuple[float, ...]:
    """Each block's ``field`` at size index k (a per-block measurement that is present)."""
    return tuple(getattr(b, field)[k] for b in blocks)


def _unavailable(profile: Profile, schedule: str, v: int, p: int) -> str:
    if p * v > len(profile.blocks):
        return f"{p * v} stages for {len(profile.blocks)} blocks"
    if schedule in SPLIT and any(b.input_grad_ms is None for b in profile.blocks):
        return "the profile has no input/weight split of the backward: profile again"
    return ""


def _assemble(settings: PlanSettings, profile: Profile, k: int, schedule: str, v: int,
              found: JointSolution, label: str, sizes: tuple[int, ...]) -> Plan:
    """The Plan of a joint solution: its stages on their ranks, the replayed step."""
    b = profile.microbatch_sizes[k]
    m = math.ceil(settings.batch_size / b)
    p = settings.gpus
    order = torch_order(schedule, p, v, m)
    problem = joint_problem(settings, profile, k, m)
    costs = stage_costs(problem, found.balance, found.checkpoint, order)
    bounds = [(sum(found.balance[:s]), sum(found.balance[:s + 1]))
              for s in range(len(found.balance))]
    names, stages, start = profile.block_names, [], 0
    for s, count in enumerate(found.balance):
        end, last = start + count, s == len(found.balance) - 1
        rank = order.stage_rank[s]
        stages.append(Stage(
            index=s, device=settings.devices[rank], blocks=names[start:end],
            compute_ms=costs.fwd_ms[s] + costs.bwd_input_ms[s] + costs.bwd_weight_ms[s],
            forward_ms=costs.fwd_ms[s],
            send_bytes=0 if last else int(profile.cuts[end - 1].bytes[k]),
            send_ms=0.0 if last else 2 * costs.comm_fwd_ms[s],
            memory_bytes=int(found.memory_bytes[rank]),
            checkpoint=found.checkpoint[s], weight_grad_ms=costs.bwd_weight_ms[s],
            whole_backward_ms=costs.bwd_whole_ms[s] if order.splits_backward  # type: ignore[index]
            else None))
        start = end
    shared = shared_weights(settings, profile, bounds, order.stage_rank)
    single, single_split = single_device_ms(profile, settings.batch_size, settings.optimizer)
    capacity = settings.capacity_bytes
    plan = Plan(
        model=profile.model, fingerprint=profile.fingerprint, stages=tuple(stages),
        split_size=b, microbatches=m, batch_size=settings.batch_size, schedule=schedule,
        predicted_step_ms=found.step_ms, single_device_ms=single,
        single_device_split=single_split, solver=label,
        candidates=sizes, profile=profile.describe(),
        memory_limit_bytes=None if capacity is None else int(min(capacity)),
        optimizer=settings.optimizer, shared=shared, stages_per_rank=v,
        action_ms=profile.action_ms_of(schedule),
        update_ms=rank_update_ms(problem, found.balance, order.stage_rank, p),
    )  # the replayed step has the update in it already
    return dataclasses.replace(plan, predicted_step_ms=found.step_ms + plan.sync_after_ms)


def too_many_cuts(blocks: int, stages: int) -> str:
    """Why the joint search does not enumerate the cuts of ``blocks`` blocks into ``stages``
    stages (C(N − 1, S − 1) > :data:`~autosplit.solve.joint.MAX_BALANCES`), else ``""``."""
    count = math.comb(blocks - 1, stages - 1)
    if count <= MAX_BALANCES:
        return ""
    return (f"{count:,} ways to cut {blocks} blocks into {stages} stages: more than the "
            f"{MAX_BALANCES:,} the joint search enumerates")


def _fixed_option(fixed: Callable[[str], Plan], schedule: str, too_many: str,
                  checkpointing: bool) -> ScheduleOption:
    """GPipe or 1F1B on one stage per rank by ``fixed`` (the exact search of that schedule's
    cuts and b, without recomputation) where the joint search has ``too_many`` cuts."""
    try:
        plan = fixed(schedule)
    except InfeasiblePlanError:
        return ScheduleOption(schedule, 1, None, "does not fit")
    note = f"recomputation not searched: {too_many}" if checkpointing else ""
    return ScheduleOption(schedule, 1, plan, note)


def plan_schedules(settings: PlanSettings, profile: Profile, sizes: list[int],
                   searched: tuple[tuple[str, int], ...] = SEARCHED,
                   fixed: Callable[[str], Plan] | None = None) -> ScheduleChoice:
    """The best plan of every (schedule, v) in ``searched`` over the size indices ``sizes``,
    and the fastest of them (see the module docstring).

    A (schedule, v) whose cuts are too many to enumerate (:func:`too_many_cuts`) is not
    searched and says so, except GPipe and 1F1B on one stage per rank when ``fixed`` is given:
    ``fixed(schedule)`` plans them (:func:`autosplit.planner.search.plan`'s exact search of
    cuts and b, for any number of blocks; no recomputation).

    Raises:
        InvalidInputError: devices of different speeds or profiles; no (schedule, v) of
            ``searched`` can be planned (:class:`ScheduleUnavailableError` when torch refuses
            them): the reasons.
        InfeasiblePlanError: nothing fits the memory; says what would.
    """
    if len(set(settings.speeds)) > 1 or any(q is not profile for q in settings.profiles):
        raise InvalidInputError(
            "schedules other than gpipe and 1f1b are planned for devices of one kind and "
            "speed: give schedule='gpipe' or '1f1b' with speeds or device_profiles")
    p = settings.gpus
    checkpointing = all(b.checkpoint_saved_bytes is not None for b in profile.blocks)
    labels = tuple(profile.microbatch_sizes[k] for k in sizes)
    options: list[ScheduleOption] = []
    unfit = False  # some (schedule, v) could run but did not fit the memory
    for schedule, v in searched:
        why = _unavailable(profile, schedule, v, p)
        too_many = "" if why else too_many_cuts(len(profile.blocks), p * v)
        if too_many and fixed is not None and v == 1 and schedule in ("gpipe", "1f1b"):
            options.append(_fixed_option(fixed, schedule, too_many, checkpointing))
            unfit |= options[-1].plan is None
            continue
        why = why or too_many
        best: tuple[float, int, JointSolution] | None = None
        refused, unproven = [], []
        for k in [] if why else sizes:
            m = math.ceil(settings.batch_size / profile.microbatch_sizes[k])
            try:
                order = torch_order(schedule, p, v, m)
            except AutosplitError as exc:
                refused.append(f"b = {profile.microbatch_sizes[k]}: {exc}")
                continue
            problem = dataclasses.replace(joint_problem(settings, profile, k, m),
                                          action_ms=profile.action_ms_of(schedule))
            found = solve_joint(problem, order, checkpointing and not order.splits_backward,
                                JOINT_LIMIT_S)
            if found is not None and not found.proven:
                unproven.append(profile.microbatch_sizes[k])
            if found is not None and (best is None or found.step_ms < best[0] * (1 - 1e-9)):
                best = (found.step_ms, k, found)
        note = NO_RECOMPUTE if checkpointing and schedule in SPLIT else ""
        if best is None:
            unfit |= not why and len(refused) < len(sizes)
            why = why or (refused[0] if len(refused) == len(sizes) else
                          "; ".join(x for x in ("does not fit", note) if x))
            options.append(ScheduleOption(schedule, v, None, why))
            continue
        label = "joint search (schedule, v, cuts, b, recomputation; replay of torch's order)"
        if unproven:
            label += (f" + search stopped after {JOINT_LIMIT_S:g} s at b = "
                      f"{', '.join(map(str, unproven))}: best found, not proven optimal")
        options.append(ScheduleOption(schedule, v, _assemble(
            settings, profile, best[1], schedule, v, best[2], label, labels), note))
    planned = [o.plan for o in options if o.plan is not None]
    if not planned and not unfit:
        reasons = "; ".join(f"{o.schedule} (v = {o.v}): {o.why}" for o in options)
        raise InvalidInputError(f"no schedule of {p} ranks can be planned here: {reasons}")
    if not planned:
        k = sizes[-1]
        m = math.ceil(settings.batch_size / profile.microbatch_sizes[k])
        one = dataclasses.replace(settings, schedule="1f1b")
        raise explain_infeasible(one, profile, k, m)
    fastest = min(q.predicted_step_ms for q in planned)
    ties = [q for q in planned if q.predicted_step_ms <= fastest * (1 + 1e-9)]
    chosen = min(ties, key=lambda q: q.split_size)  # then the earlier schedule (stable)
    return ScheduleChoice(chosen, tuple(options))


def schedule_why(choice: ScheduleChoice) -> str:
    """One line: the chosen schedule and by how much it beats the next best schedule."""
    best = choice.best
    others = [o.plan for o in choice.options if o.plan is not None and o.plan is not best]
    name = f"{best.schedule}" + (f" (v = {best.stages_per_rank})" if best.stages_per_rank > 1
                                 else "")
    if not others:
        return f"schedule {name}: the only one that fits"
    runner = min(others, key=lambda q: q.predicted_step_ms)
    return (f"schedule {name}: predicted ×{runner.predicted_step_ms / best.predicted_step_ms:.2f}"
            f" over the next best, {runner.schedule}")
