"""A plan as plain text: the stage table and the summary lines under it (``str(plan)``).

The terminal's rich tables are :mod:`autosplit.report`; this module sits below
:mod:`autosplit.records` (whose ``Plan.__str__`` and ``Plan.summary_lines`` call it) and
imports nothing of autosplit but claims and units.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from autosplit.measure.spread import PREDICTION_ERROR, ratio_with_spread, spread_text
from autosplit.units import format_bytes, format_ms

GROUPED = 3
"""The fewest shared weights with the same stages and handling said in one line (by the module
that holds them: ALBERT's one layer holds 16)."""

__all__ = ["plan_text", "summary_lines", "checkpoint_text", "one_device_way"]


def checkpoint_text(stage: Any) -> str:
    """The stage table's checkpoint cell: ``"yes"`` or ``"no"``."""
    return "yes" if getattr(stage, "checkpoint", False) else "no"


def plan_text(plan: Any) -> str:
    """The stage table and the summary lines, as ``str(plan)`` shows them; a checkpoint
    column when a stage runs under activation checkpointing."""
    recompute = any(getattr(s, "checkpoint", False) for s in plan.stages)
    rows = [("stage", "device", "blocks", "compute/mb", "memory", "sends/mb",
             *(("checkpoint",) if recompute else ()))]
    for s in plan.stages:
        span = s.blocks[0] if len(s.blocks) == 1 else f"{s.blocks[0]} … {s.blocks[-1]}"
        rows.append(
            (
                str(s.index),
                s.device,
                f"{span} ({len(s.blocks)})",
                format_ms(s.compute_ms) + spread_text(s.verified_spread),
                format_bytes(s.memory_bytes),
                format_bytes(s.send_bytes) if s.index < len(plan.stages) - 1 else "–",
                *((checkpoint_text(s),) if recompute else ()),
            )
        )
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in rows]
    return "\n".join(lines + summary_lines(plan))


def one_device_way(plan: Any) -> str:
    """How the one device the plan is compared with runs its batch: ``" (6×20 accumulated)"``
    (micro-batches, their gradients added up), ``" (120 at once)"``, or ``""`` when the plan
    does not say (:attr:`~autosplit.records.Plan.single_device_split`)."""
    b = getattr(plan, "single_device_split", None)
    if b is None:
        return ""
    if b >= plan.batch_size:
        return f" ({plan.batch_size} at once)"
    return f" ({-(-plan.batch_size // b)}×{b} accumulated)"


def summary_lines(plan: Any) -> list[str]:
    """The lines shown under the stage table: batch split, step time, bubble, speed-up."""
    p = len(plan.stages) // getattr(plan, "stages_per_rank", 1)  # ranks
    claim = ratio_with_spread(
        plan.single_device_ms, plan.single_device_spread, plan.predicted_step_ms,
        plan.step_spread, error=PREDICTION_ERROR,
    ) if plan.single_device_ms > 0 and plan.predicted_step_ms > 0 else None
    over_one = claim.text if claim else "–"
    how = "verified stage times" if plan.verification else "block sums"
    d = getattr(plan, "replicas", 1)
    per_replica = f" ({plan.batch_size // d} per replica)" if d > 1 else ""
    v = getattr(plan, "stages_per_rank", 1)
    per_rank = f" ({v} stages per rank: {p * v} stages)" if v > 1 else ""
    lines = [
        f"layout {p} stage{'s' if p != 1 else ''} × {d} replica{'s' if d != 1 else ''}",
        f"batch {plan.batch_size}{per_replica} → {plan.microbatches} micro-batch"
        f"{'es' if plan.microbatches != 1 else ''} of {plan.split_size} "
        f"(chosen from {', '.join(map(str, plan.candidates))}) · schedule {plan.schedule}"
        f"{per_rank}",
        f"predicted step {format_ms(plan.predicted_step_ms)}{spread_text(plan.step_spread)} "
        f"({how}) · bubble {plan.bubble_fraction:.0%} · "
        f"vs one device{one_device_way(plan)}: {over_one} (ideal ×{p * d:.2f})",
    ]
    mode = getattr(plan, "replica_mode", "ddp")
    if d > 1 and mode == "ddp":
        lines.append(f"replicas: DDP · gradient all-reduce among {d} replicas: "
                     f"{format_ms(plan.replica_sync_ms)} per step, after the last backward")
    elif d > 1:
        how = "resharding after forward" if mode == "fsdp2" else "no resharding after forward"
        lines.append(f"replicas: FSDP2 (fully_shard along dp, {how}) · all-gathers and "
                     f"gradient reduce-scatter among {d} replicas: "
                     f"{format_ms(plan.replica_sync_ms)} per step")
    if getattr(plan, "update_ms", 0.0) > 0:
        lines.append(f"optimizer step ({plan.optimizer}): {format_ms(plan.update_ms)} on the "
                     "slowest rank, after the last backward")
    if getattr(plan, "placement", ""):
        from autosplit.topology import placement_text

        lines.append(f"placement {placement_text(plan.placement, p, d, plan.devices_per_node)}"
                     f" (nodes of {plan.devices_per_node} devices)")
    if plan.verification:
        lines.append(f"verified: {plan.verification}")
    if plan.speedup < 1 and claim is not None and not claim.within_noise:
        lines.append(
            "pipelining does not pay off here: one device is predicted faster (transfers and "
            "the bubble cost more than the split saves); try fewer devices or a larger batch"
        )
    if plan.memory_limit_bytes is not None:
        lines.append(
            f"memory limit {format_bytes(plan.memory_limit_bytes)} per device · optimizer "
            f"{plan.optimizer}"
        )
    lines += shared_lines(plan.shared)
    lines.append(f"profile {plan.profile} · solver {plan.solver}")
    return lines


def shared_lines(weights: Sequence[Any]) -> list[str]:
    """One line per shared weight (a :class:`~autosplit.records.SharedWeight`), or per group of
    :data:`GROUPED` or more that the same stages use and keep equal the same way."""
    groups: dict[tuple[Any, ...], list[Any]] = {}
    for weight in weights:
        groups.setdefault((weight.stages, weight.mode), []).append(weight)
    lines = []
    for group in groups.values():
        if len(group) >= GROUPED:
            lines.append(describe_shared(group))
        else:
            lines += [describe_shared([weight]) for weight in group]
    return lines


def describe_shared(weights: Sequence[Any]) -> str:
    """One line for shared weights (:class:`~autosplit.records.SharedWeight`) that the same
    stages use and keep equal the same way: one weight by its name, several by the module
    that holds them all (ALBERT's shared layer), their bytes and all-reduce times summed."""
    first = weights[0]
    where = " and ".join(
        [", ".join(map(str, first.stages[:-1])), str(first.stages[-1])]
        if len(first.stages) > 1 else [str(first.stages[0])]
    )
    stages = f"stage{'s' if len(first.stages) > 1 else ''} {where}"
    if len(weights) == 1:
        what = f"shared weight {first.name}"
    else:
        parts = [w.name.split(".") for w in weights]
        common = next((parts[0][:k] for k in range(len(parts[0]), 0, -1)
                       if all(p[:k] == parts[0][:k] for p in parts)), [])
        holder = ".".join(common) or "the model"
        what = f"shared weights of {holder} ({len(weights)} tensors)"
    size = format_bytes(sum(w.bytes for w in weights))
    if first.mode == "one stage":
        return f"{what}: {stages}, one copy ({size})"
    if first.mode == "one rank":
        return f"{what}: {stages}, on one rank: one copy ({size})"
    return (f"{what}: {stages}, gradients all-reduced each step "
            f"({size}, {format_ms(sum(w.sync_ms for w in weights))})")
