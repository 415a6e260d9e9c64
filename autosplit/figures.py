"""Pictures of plans (matplotlib, written to PNG files; nothing is shown on screen).

* :func:`plan_figure`: the simulated pipeline timeline (one row per device, forward and backward
  boxes per micro-batch, idle time visible as gaps), compute per stage against the ideal level,
  and memory per device against its limit.
* :func:`comparison_figure`: each plan's predicted (and measured) step time side by side.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt
from matplotlib.patches import Patch

from autosplit.comparison import ComparisonRow
from autosplit.records import Plan
from autosplit.simulator import SimResult, simulate_plan
from autosplit.units import format_bytes, format_ms

__all__ = ["plan_figure", "comparison_figure"]

FORWARD = "#4C72B0"
BACKWARD = "#DD8452"
IDLE = "#EEEEEE"
LIMIT = "#C44E52"


def _time_unit(ms: float) -> tuple[float, str]:
    return (1000.0, "s") if ms >= 5000 else (1.0, "ms")


def plan_figure(plan: Plan, path: str | Path) -> SimResult:
    """Draw ``plan`` to a PNG at ``path``; returns the simulation it shows."""
    sim = simulate_plan(plan)
    p = len(plan.stages)
    scale, unit = _time_unit(sim.step_ms)
    fig = plt.figure(figsize=(11, 4.2 + 0.45 * p), dpi=110, layout="constrained")
    grid = fig.add_gridspec(2, 2, height_ratios=[1.2 + 0.25 * p, 1.6])
    ax = fig.add_subplot(grid[0, :])
    label_mb = plan.microbatches <= 24
    for s, events in enumerate(sim.events):
        row = p - 1 - s
        ax.broken_barh([(0, sim.step_ms / scale)], (row - 0.4, 0.8), color=IDLE)
        for e in events:
            color = FORWARD if e.kind == "F" else BACKWARD
            ax.broken_barh([(e.start_ms / scale, e.duration_ms / scale)], (row - 0.4, 0.8),
                           facecolor=color, edgecolor="white", linewidth=0.6)
            if label_mb and e.duration_ms / max(sim.step_ms, 1e-12) > 0.012:
                ax.text((e.start_ms + e.duration_ms / 2) / scale, row, str(e.microbatch),
                        ha="center", va="center", color="white", fontsize=8)
    ax.set_yticks(range(p))
    ax.set_yticklabels([f"stage {s}\n{plan.stages[s].device}" for s in reversed(range(p))])
    ax.set_xlim(0, sim.step_ms / scale * 1.01)
    ax.set_xlabel(f"time in one training step ({unit})")
    ax.legend(
        handles=[Patch(color=FORWARD, label="forward"), Patch(color=BACKWARD, label="backward"),
                 Patch(color=IDLE, label="idle (bubble)")],
        loc="upper right", ncols=3, fontsize=8, frameon=False, bbox_to_anchor=(1, -0.1),
    )
    ax.set_title(
        f"{plan.model} on {p} devices · batch {plan.batch_size} as {plan.microbatches} × "
        f"{plan.split_size} · {plan.schedule} · {plan.profile.split(',')[0]}"
        f"\npredicted step {format_ms(sim.step_ms)} (the schedule simulated below) · devices "
        f"idle {sim.bubble_fraction:.0%} of the time · slowest stage × (m + p − 1): "
        f"{format_ms(plan.bound_step_ms)}",
        loc="left", fontsize=10,
    )
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)

    bars = fig.add_subplot(grid[1, 0])
    compute = [s.compute_ms for s in plan.stages]
    sends = [s.send_ms for s in plan.stages]
    xs = list(range(p))
    bars.bar(xs, compute, color=FORWARD, label="compute (fwd + bwd)")
    bars.bar(xs, sends, bottom=compute, color="#8172B2", label="transfer")
    ideal = sum(compute) / p
    bars.set_ylim(0, max([c + t for c, t in zip(compute, sends)] + [ideal]) * 1.2)
    bars.axhline(ideal, color="black", linestyle="--", linewidth=1)
    bars.text(p - 0.5, ideal, f"ideal (even split) {format_ms(ideal)}", va="bottom", ha="right",
              fontsize=8)
    bars.set_xticks(xs, [f"{s}\n{plan.stages[s].blocks[0]}…" for s in xs], fontsize=8)
    bars.set_ylabel("ms per micro-batch")
    bars.set_title("time per micro-batch: compute (blue) + transfer (purple)\nthe slowest "
                   "stage sets the pace", loc="left", fontsize=9)

    mem = fig.add_subplot(grid[1, 1])
    gib = [s.memory_bytes / 2**30 for s in plan.stages]
    mem.bar(xs, gib, color="#55A868")
    for x, value in zip(xs, plan.stages):
        mem.text(x, value.memory_bytes / 2**30, format_bytes(value.memory_bytes), ha="center",
                 va="bottom", fontsize=8)
    if plan.memory_limit_bytes is not None:
        limit = plan.memory_limit_bytes / 2**30
        mem.axhline(limit, color=LIMIT, linewidth=1.5)
        mem.text(p - 0.5, limit, f" limit {format_bytes(plan.memory_limit_bytes)}",
                 color=LIMIT, va="bottom", ha="right", fontsize=8)
    mem.set_xticks(xs, [f"{s}\n{plan.stages[s].device}" for s in xs], fontsize=8)
    mem.set_ylabel("GiB")
    mem.set_title(f"predicted memory per device\n({plan.optimizer}, {plan.schedule})", loc="left",
                  fontsize=9)
    for a in (bars, mem):
        for side in ("top", "right"):
            a.spines[side].set_visible(False)
    fig.savefig(path)
    plt.close(fig)
    return sim


def comparison_figure(rows: Sequence[ComparisonRow], path: str | Path, title: str = "") -> None:
    """Bars of predicted (and, where measured, measured) step time per plan, to a PNG."""
    predicted = [r.predicted_step_ms for r in rows]
    measured = [r.measured_step_ms for r in rows]
    scale, unit = _time_unit(max(predicted + [m or 0 for m in measured]))
    fig, ax = plt.subplots(figsize=(max(6, 1.3 * len(rows) + 2), 4), dpi=110, layout="constrained")
    width = 0.38 if any(m is not None for m in measured) else 0.6
    xs = range(len(rows))
    offset = width / 2 if width < 0.5 else 0
    ax.bar([x - offset for x in xs], [v / scale for v in predicted], width, color=FORWARD,
           label="predicted")
    for x, v in zip(xs, predicted):
        ax.text(x - offset, v / scale, f"{v / scale:.3g}", ha="center", va="bottom", fontsize=8)
    if width < 0.5:
        ax.bar([x + offset for x in xs], [(m or 0) / scale for m in measured], width,
               color=BACKWARD, label="measured")
        for x, m in zip(xs, measured):
            if m is not None:
                ax.text(x + offset, m / scale, f"{m / scale:.3g}", ha="center", va="bottom",
                        fontsize=8)
    labels = [f"{r.name}\n{', '.join(r.plan.split_points) or '–'} · "
              f"{r.plan.microbatches}×{r.plan.split_size}" for r in rows]
    ax.set_xticks(list(xs), labels, fontsize=8)
    ax.set_ylabel(f"training step ({unit})")
    ax.set_title(title or "plans compared (lower is faster)", loc="left", fontsize=10)
    ax.legend(fontsize=8, frameon=False)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    fig.savefig(path)
    plt.close(fig)
