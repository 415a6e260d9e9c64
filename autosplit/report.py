"""Show plans to people: rich tables for the terminal (figures live in ``figures.py``)."""

from __future__ import annotations

import statistics
from collections.abc import Collection, Sequence
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.table import Table

from autosplit.measure.spread import PREDICTION_ERROR, ratio_with_spread, spread_text
from autosplit.plan_text import checkpoint_text
from autosplit.records import Plan
from autosplit.sharding import mode_label
from autosplit.units import format_bytes, format_ms

if TYPE_CHECKING:
    from autosplit.planner.layouts import Layouts

__all__ = ["stage_table", "print_plan", "comparison_table", "layout_table"]


def _span(blocks: Sequence[str]) -> str:
    return blocks[0] if len(blocks) == 1 else f"{blocks[0]} … {blocks[-1]}"


def stage_table(plan: Plan) -> Table:
    """One row per stage: device, blocks, compute per micro-batch, memory, bytes sent (and
    whether it is checkpointed, when one is)."""
    table = Table(box=None, header_style="bold", pad_edge=False)
    recompute = any(s.checkpoint for s in plan.stages)
    for name, justify in (
        ("stage", "right"),
        ("device", "left"),
        ("blocks", "left"),
        ("compute/mb", "right"),
        ("memory", "right"),
        ("sends/mb", "right"),
        *([("checkpoint", "left")] if recompute else []),
    ):
        table.add_column(name, justify=justify)  # type: ignore[arg-type]
    last = len(plan.stages) - 1
    for s in plan.stages:
        table.add_row(
            str(s.index),
            s.device,
            f"{_span(s.blocks)} ({len(s.blocks)})",
            format_ms(s.compute_ms) + spread_text(s.verified_spread),
            format_bytes(s.memory_bytes),
            "–" if s.index == last else format_bytes(s.send_bytes),
            *([checkpoint_text(s)] if recompute else []),
        )
    return table


def print_plan(console: Console, plan: Plan,
               references: Sequence[tuple[str, Plan]] = ()) -> None:
    """The stage table and the summary, as the CLI shows them, with one "vs …" line per
    reference plan (a hand split; the best pipeline beside a plan with replicas)."""
    console.print(stage_table(plan))
    console.print()
    lines = plan.summary_lines()
    for k, (label, other) in enumerate(references):
        claim = ratio_with_spread(
            other.predicted_step_ms, other.step_spread, plan.predicted_step_ms, plan.step_spread,
            error=PREDICTION_ERROR,
        )
        lines.insert(
            3 + k, f"vs {label}: {claim.text} ({format_ms(other.predicted_step_ms)}"
            f"{spread_text(other.step_spread)})"
        )
    for line in lines:
        console.print(" " + line, highlight=False)


def comparison_table(rows: Sequence[tuple[str, Plan, float | Sequence[float] | None]]
                     ) -> Table:
    """One row per plan: cut points, split, predicted (and measured) step time, memory.

    A row's measurement is a step time (ms) or the step times taken (ms): then their median,
    and their range when there are several (``"5.2 ms (4.9–5.6 ms)"``)."""
    best_plan = min((plan for _, plan, _ in rows), key=lambda p: p.predicted_step_ms)
    measured_any = any(m is not None for _, _, m in rows)
    table = Table(box=None, header_style="bold", pad_edge=False)
    columns = [
        ("plan", "left"),
        ("cut before", "left"),
        ("split", "right"),
        ("predicted step", "right"),
        ("vs best", "right"),
        ("bottleneck", "right"),
        ("bubble", "right"),
        ("max memory", "right"),
    ]
    if measured_any:
        columns.append(("measured step", "right"))
    for name, justify in columns:
        table.add_column(name, justify=justify)  # type: ignore[arg-type]
    for label, plan, measured in rows:
        bottleneck = max(s.compute_ms + s.send_ms for s in plan.stages)
        cells = [
            label,
            ", ".join(plan.split_points) or "–",
            f"{plan.microbatches}×{plan.split_size}",
            format_ms(plan.predicted_step_ms) + spread_text(plan.step_spread),
            _vs_best(plan, best_plan),
            format_ms(bottleneck),
            f"{plan.bubble_fraction:.0%}",
            format_bytes(max(s.memory_bytes for s in plan.stages)),
        ]
        if measured_any:
            cells.append(_measured_cell(measured))
        table.add_row(*cells)
    return table


def _measured_cell(measured: float | Sequence[float] | None) -> str:
    """A measured step (ms), or the median of several and their range."""
    if measured is None:
        return "–"
    if isinstance(measured, (int, float)):
        return format_ms(measured)
    times = sorted(measured)
    if not times:
        return "–"
    text = format_ms(statistics.median(times))
    if len(times) > 1:
        low, high = format_ms(times[0]), format_ms(times[-1])
        if low[-3:] == high[-3:] == " ms" or low[-2:] == high[-2:] == " s":
            low = low.rsplit(" ", 1)[0]  # "4.9–5.6 ms": the unit once
        text += f" ({low}–{high})"
    return text


def _vs_best(plan: Plan, best: Plan) -> str:
    """How much slower than the best plan, or "within noise" when the spreads and a predicted
    ratio's error (:data:`~autosplit.measure.spread.PREDICTION_ERROR`) allow the two to be equal."""
    if plan is best:
        return "best"
    claim = ratio_with_spread(
        plan.predicted_step_ms, plan.step_spread, best.predicted_step_ms, best.step_spread,
        error=PREDICTION_ERROR,
    )
    if claim.within_noise:
        return "within noise"
    if not claim.known:
        return f"×{claim.ratio:.2f}"
    return f"×{claim.ratio:.2f} ± {(claim.high - claim.low) / 2:.2f}"


def schedule_table(choice: Any, chosen: Plan, unmeasured: Collection[str] = ()) -> Table:
    """One row per schedule searched (:class:`autosplit.planner.schedules.ScheduleChoice`):
    its best plan's stages per rank, micro-batches, recomputed stages, predicted step and the
    most memory on a rank, or why it is not offered; ``unmeasured``: schedules whose runtime
    cost was not measured because they cannot win (their step is said to be a bound)."""
    table = Table(box=None, header_style="bold", pad_edge=False)
    for name, justify in (("schedule", "left"), ("v", "right"), ("split", "right"),
                          ("recompute", "right"), ("step (block sums)", "right"),
                          ("memory/rank", "right"), ("note", "left")):
        table.add_column(name, justify=justify)  # type: ignore[arg-type]
    for option in choice.options:
        plan = option.plan
        if plan is None:
            table.add_row(option.schedule, str(option.v), "–", "–", "–", "–", option.why)
            continue
        mine = (chosen.replicas == 1 and len(plan.stages) == len(chosen.stages)
                and (plan.schedule, plan.stages_per_rank)
                == (chosen.schedule, chosen.stages_per_rank))
        table.add_row(
            option.schedule, str(option.v), f"{plan.microbatches}×{plan.split_size}",
            f"{sum(s.checkpoint for s in plan.stages)}/{len(plan.stages)}",
            format_ms(plan.predicted_step_ms),
            format_bytes(max(s.memory_bytes for s in plan.stages)),
            "; ".join(x for x in (_chosen_note(plan, chosen) if mine else "", option.why,
                                  UNMEASURED_NOTE if option.schedule in unmeasured else "")
                      if x),
        )
    return table


UNMEASURED_NOTE = "runtime cost not measured: it cannot win even at none"


def _chosen_note(row: Plan, chosen: Plan) -> str:
    """"chosen" on the row of the chosen plan's schedule or layout; where verification chose
    another of its plans than the row's best by block sums (other cuts or micro-batches),
    what was chosen."""
    same = ((row.microbatches, row.split_size, row.balance)
            == (chosen.microbatches, chosen.split_size, chosen.balance))
    if same:
        return "chosen (verified above)" if chosen.verification else "chosen"
    cuts = "" if row.balance == chosen.balance else " on other cuts"
    return f"chosen: {chosen.microbatches}×{chosen.split_size}{cuts}, verified above"


def _mode_note(option: Any) -> str:
    """A replica mode not chosen for its layout (a :class:`~autosplit.planner.layouts.
    ModeOption`): ``"DDP 12.1 ms, 3.2 GiB"`` or ``"DDP does not fit: needs 120 GiB"``."""
    name = mode_label(option.mode)
    if option.plan is None:
        if option.why:
            return f"{name}: {option.why}"
        need = "" if option.need_bytes is None else f": needs {format_bytes(option.need_bytes)}"
        return f"{name} does not fit{need}"
    held = format_bytes(max(s.memory_bytes for s in option.plan.stages))
    return f"{name} {format_ms(option.plan.predicted_step_ms)}, {held}"


def layout_table(layouts: Layouts, chosen: Plan) -> Table:
    """One row per layout (p stages × d replicas): its best plan's micro-batches, predicted
    step (block sums) and memory per device, or "does not fit" and what it would need."""
    table = Table(box=None, header_style="bold", pad_edge=False)
    for name, justify in (("other layouts", "left"), ("split", "right"),
                          ("step (block sums)", "right"), ("memory/device", "right"),
                          ("note", "left")):
        table.add_column(name, justify=justify)  # type: ignore[arg-type]
    shape = (len(chosen.stages) // chosen.stages_per_rank, chosen.replicas)  # ranks per replica
    for option in layouts.options:
        mine = (option.stages, option.replicas) == shape
        if option.plan is None:
            need = "" if option.need_bytes is None else f": needs {format_bytes(option.need_bytes)}"
            table.add_row(option.label, "–", "–", "–", " · ".join(
                [_mode_note(m) for m in option.modes] or [option.why or f"does not fit{need}"]))
            continue
        plan = option.plan
        notes = [_chosen_note(plan, chosen) if mine else ""]
        if plan.replicas > 1:
            notes.append(f"{mode_label(plan.replica_mode)} "
                         f"{'all-reduce' if plan.replica_mode == 'ddp' else 'gathers'} "
                         f"{format_ms(plan.replica_sync_ms)}")
            notes += [_mode_note(m) for m in option.modes if m.mode != plan.replica_mode]
            if plan.placement and plan.stages[1:]:
                notes.append(plan.placement)
        table.add_row(
            option.label,
            f"{plan.microbatches}×{plan.split_size}",
            format_ms(plan.predicted_step_ms),
            format_bytes(max(s.memory_bytes for s in plan.stages)),
            " · ".join(n for n in notes if n),
        )
    return table


