"""The comparison's cases and results (``compare.py``): what a case is, and the rows, the oracle
and the goals assembled from the harness's timings and autosplit's predictions."""

from __future__ import annotations

import math
import statistics
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import ModelSpec, summary
from torchgpipe_peer import INSTALL_TORCHGPIPE

from autosplit.cost import block_time_ms
from autosplit.records import Plan, Profile

ONE = "one device"
HAND = "hand split"
AUTO = "autosplit"
ORDER = (ONE, HAND, "uniform", "by parameters", "torchgpipe", AUTO)


@dataclass(frozen=True)
class Case:
    """A model to compare on: its batch, the hand split (cut points, split size) if any."""

    label: str
    spec: ModelSpec
    hand: tuple[tuple[str, ...], int] | None
    hand_note: str
    max_m: int


def sizes_for(batch: int, max_m: int) -> list[int]:
    """Micro-batch sizes b = B / m for every m ≤ max_m that divides B, ascending."""
    return sorted(batch // m for m in range(1, min(max_m, batch) + 1) if batch % m == 0)


def single_predicted_ms(profile: Profile) -> float:
    """The whole batch in one micro-batch on one device: Σ block fwd + bwd at b = B."""
    k = profile.size_index(profile.batch_size)
    return math.fsum(block_time_ms(blk, k) for blk in profile.blocks)


def plan_key(plan: Plan) -> tuple[tuple[int, ...], int]:
    """What makes two plans the same measurement: their block counts and micro-batch size."""
    return plan.balance, plan.split_size


def _prediction(plan: Plan | None, profile: Profile) -> tuple[float, float]:
    if plan is None:
        single = single_predicted_ms(profile)
        return single, single
    return plan.predicted_step_ms, plan.bound_step_ms


def assemble_case(case: Case, profile: Profile, plans: dict[str, Plan], notes: dict[str, Any],
                  measured: dict[Any, str], result: dict[str, Any], on_gpus: bool) -> dict[str, Any]:
    times = result["times"]
    rows = []
    for name in ORDER:
        if name != ONE and name not in plans:
            continue
        plan = plans.get(name)
        source = ONE if plan is None else measured[plan_key(plan)]
        stats = summary(times[source])
        predicted, bound = _prediction(plan, profile)
        rows.append({
            "name": name,
            "same_as": None if source == name else source,
            "split_points": list(plan.split_points) if plan else [],
            "balance": list(plan.balance) if plan else [len(profile.blocks)],
            "split_size": plan.split_size if plan else case.spec.batch,
            "microbatches": plan.microbatches if plan else 1,
            "measured_s": times[source],
            **{f"{k}_s": v for k, v in stats.items()},
            "spread": (stats["max"] - stats["min"]) / stats["median"],
            "throughput": case.spec.batch / stats["median"],
            "predicted_ms": predicted,
            "bound_ms": bound,
            "predicted_error": predicted / 1000 / stats["median"] - 1,
            "bound_error": bound / 1000 / stats["median"] - 1,
            "stage_predicted_ms": [st.compute_ms for st in plan.stages] if plan else [],
            "stage_measured_ms": notes.get("stages", {}).get(source, []) if plan else [],
        })
    by = {r["name"]: r for r in rows}
    for r in rows:
        r["vs_one_device"] = by[ONE]["median_s"] / r["median_s"]
        r["vs_hand_split"] = by[HAND]["median_s"] / r["median_s"] if HAND in by else None
    auto = by[AUTO]
    others = [r for r in rows if r["name"] not in (AUTO, ONE)]
    result_notes = []
    if "torchgpipe" not in plans:  # torchgpipe_peer.balance_by_time is None
        result_notes.append(f"torchgpipe is not installed: its row is skipped ({INSTALL_TORCHGPIPE})")
    return {
        "model": case.label,
        "input": case.spec.describe,
        "batch": case.spec.batch,
        "blocks": len(profile.blocks),
        "hand_split": case.hand_note,
        "profile": {"microbatch_sizes": list(profile.microbatch_sizes), "seconds": profile.seconds,
                    "device": profile.device.name},
        "rows": rows,
        "autosplit_vs_best_other": min((r["median_s"] for r in others), default=math.nan) / auto["median_s"],
        "torchgpipe": notes.get("torchgpipe"),
        "notes": result_notes,
        "load": result.get("load", {}),
        "stage_error": _median_abs([p / m - 1 for r in rows if r["same_as"] is None and r["stage_measured_ms"]
                                    for p, m in zip(r["stage_predicted_ms"], r["stage_measured_ms"])]),
    }


def assemble_oracle(case: Case, profile: Profile, auto: Plan, hand: Plan | None, grid: list[dict],
                    result: dict[str, Any], max_m: int) -> dict[str, Any]:
    times, refined = result["times"], result["refined"]
    points = []
    for g in grid:
        plan = g["plan"]
        stats = summary(times[g["label"]])
        point = {k: g[k] for k in ("label", "cut", "before", "split_size", "microbatches")}
        point.update(
            measured_s=times[g["label"]], median_s=stats["median"], predicted_ms=plan.predicted_step_ms,
            bound_ms=plan.bound_step_ms, refined_s=refined.get(g["label"]),
            refined_median_s=statistics.median(refined[g["label"]]) if g["label"] in refined else None,
            autosplit=plan_key(plan) == plan_key(auto),
            hand=hand is not None and plan_key(plan) == plan_key(hand),
        )
        points.append(point)
    auto_point = next(p for p in points if p["autosplit"])
    coarse_best = min(points, key=lambda p: p["median_s"])
    refined_points = [p for p in points if p["refined_median_s"] is not None]
    out: dict[str, Any] = {
        "model": case.label,
        "input": case.spec.describe,
        "batch": case.spec.batch,
        "load": result.get("load", {}),
        "max_m": max_m,
        "microbatch_sizes": sizes_for(case.spec.batch, max_m),
        "points": points,
        "autosplit": {"before": auto_point["before"], "split_size": auto.split_size,
                      "microbatches": auto.microbatches, "predicted_ms": auto.predicted_step_ms},
        "coarse_best": {k: coarse_best[k] for k in ("label", "before", "split_size", "microbatches", "median_s")},
        "autosplit_vs_best_coarse": coarse_best["median_s"] / auto_point["median_s"],
    }
    if refined_points:
        best = min(refined_points, key=lambda p: p["refined_median_s"])
        out["refined_best"] = {k: best[k] for k in ("label", "before", "split_size", "microbatches",
                                                    "refined_median_s")}
        out["autosplit_vs_best"] = best["refined_median_s"] / auto_point["refined_median_s"]
    else:
        out["autosplit_vs_best"] = out["autosplit_vs_best_coarse"]
    best_median = min(p["median_s"] for p in points)
    per_m = {}
    for m in sorted({p["microbatches"] for p in points}):
        row = min((p for p in points if p["microbatches"] == m), key=lambda p: p["median_s"])
        per_m[str(m)] = {"best_before": row["before"], "median_s": row["median_s"],
                         "vs_best": row["median_s"] / best_median}
    out["best_per_m"] = per_m
    if hand is not None:
        hand_point = next(p for p in points if p["hand"])
        out["hand"] = {"before": hand_point["before"], "split_size": hand.split_size,
                       "median_s": hand_point["median_s"], "refined_median_s": hand_point["refined_median_s"]}
    return out


def _median_abs(values: Sequence[float]) -> float:
    return statistics.median(abs(v) for v in values) if values else math.nan


def error_summary(models: list[dict], oracle: dict) -> dict[str, Any]:
    rows = [r for m in models for r in m["rows"] if r["same_as"] is None]
    points = oracle["points"]

    def point_error(p: dict, key: str) -> float:
        return p[key] / 1000 / p["median_s"] - 1

    return {
        "compare_rows": len(rows),
        "compare_predicted": _median_abs([r["predicted_error"] for r in rows]),
        "compare_bound": _median_abs([r["bound_error"] for r in rows]),
        "compare_pipelined_predicted": _median_abs([r["predicted_error"] for r in rows if r["name"] != ONE]),
        "oracle_points": len(points),
        "oracle_predicted": _median_abs([point_error(p, "predicted_ms") for p in points]),
        "oracle_bound": _median_abs([point_error(p, "bound_ms") for p in points]),
    }


def goals(models: list[dict], oracle: dict, errors: dict, on_gpus: bool) -> list[dict[str, Any]]:
    hand_goal = 1.10 if on_gpus else 1.00
    out = [{"goal": f"{oracle['model']} oracle: autosplit ≥ 0.98× the sweep's best point",
            "value": oracle["autosplit_vs_best"], "target": 0.98,
            "met": oracle["autosplit_vs_best"] >= 0.98}]
    for m in models:
        by = {r["name"]: r for r in m["rows"]}
        if HAND in by:
            v = by[AUTO]["vs_hand_split"]
            out.append({"goal": f"{m['model']}: autosplit ≥ {hand_goal:.2f}× the hand split",
                        "value": v, "target": hand_goal, "met": v >= hand_goal})
        v = m["autosplit_vs_best_other"]
        out.append({"goal": f"{m['model']}: autosplit ≥ 1.00× every other plan", "value": v,
                    "target": 1.0, "met": v >= 1.0})
    v = errors["compare_predicted"]
    out.append({"goal": "cost model: median absolute error of the predicted step ≤ 10 % (compared plans)",
                "value": v, "target": 0.10, "met": v <= 0.10})
    return out
