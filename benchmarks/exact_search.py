"""Time the exact planner: the committed ResNet50 profile on 2 … 8 stages, and a synthetic
1,000-block model on 8 stages (GPipe and 1F1B), each ``autosplit.plan`` call repeated; the
median and the range of the repeats, after one untimed call that imports the planner. Then the
joint search of ``schedule="auto"`` (schedule, stages per rank, cuts, micro-batch size and
recomputation) on a ResNet50 profile with the backward split and checkpointing measured, on
2, 4 and 8 ranks, without a memory limit and with one at 70 % of what its unlimited plan needs
(where recomputation decides).

    PYTHONPATH=. python benchmarks/exact_search.py [--repeats 5] [--smoke] [--out DIR]

Goals (issue 11): ResNet50 under 1 s for p ≤ 8, 1,000 blocks × 8 stages under 2 s, each a
proven optimum (a plan whose search stopped at its time limit says so in ``solver``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, command_line, describe, machine, write_results
from synthetic import make_profile

import autosplit
from autosplit import PlanOptions

GOALS_S = {"resnet50": 1.0, "1000 blocks": 2.0}
SCHEDULES_FIXTURE = "resnet50_schedules_profile.json"
"""ResNet50 at the tutorial's size (B=120, 3×128×128) on a CPU worker, with input/weight
gradients and checkpointing measured (AMD EPYC, 2 cores)."""


def thousand_blocks(n: int = 1000) -> autosplit.Profile:
    """n blocks of 0.5–1.5 ms per sample, a third of it forward, random cut sizes (seed 0)."""
    rng = np.random.default_rng(0)
    per_sample = rng.uniform(0.5, 1.5, n)
    return make_profile([4, 8], [[v, 0.9 * v] for v in per_sample], batch_size=64,
                        cut_bytes_per_sample=[int(x) for x in rng.integers(0, 10**6, n - 1)],
                        forward_share=rng.uniform(0.3, 0.4, n).tolist())


def timed(prof: autosplit.Profile, gpus: int, repeats: int, **kw: object) -> dict:
    """One row: the plan (its largest stage's memory in bytes) and the seconds of each of
    ``repeats`` calls."""
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        plan = autosplit.plan(prof, gpus=gpus, options=PlanOptions(**kw))
        seconds.append(time.perf_counter() - start)
    return {"gpus": gpus, "schedule": kw["schedule"], "seconds": seconds,
            "median_s": statistics.median(seconds), "split_size": plan.split_size,
            "balance": list(plan.balance), "predicted_step_ms": plan.predicted_step_ms,
            "proven": "not proven" not in plan.solver, "chosen": plan.schedule,
            "v": plan.stages_per_rank, "checkpointed": sum(s.checkpoint for s in plan.stages),
            "memory_per_gpu": kw.get("memory_per_gpu"),
            "stage_memory_bytes": max(s.memory_bytes for s in plan.stages)}


def joint_rows(prof: autosplit.Profile, ranks: list[int], repeats: int) -> list[dict]:
    """``schedule="auto"`` on each number of ranks, unlimited, then at 70 % of the memory per
    rank its unlimited plan needs."""
    rows = []
    for gpus in ranks:
        free = timed(prof, gpus, repeats, schedule="auto")
        rows.append({"model": "resnet50 (auto)", **free})
        print(rows[-1])
        rows.append({"model": "resnet50 (auto)", **timed(
            prof, gpus, repeats, schedule="auto",
            memory_per_gpu=int(0.7 * free["stage_memory_bytes"]))})
        print(rows[-1])
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--smoke", action="store_true",
                        help="p ≤ 3 for ResNet50 and 2 for the joint search, 1 repeat")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    repeats = 1 if args.smoke else args.repeats
    fixture = Path(__file__).resolve().parent.parent / "tests/fixtures/resnet50_profile.json"
    resnet = autosplit.Profile.load(fixture)
    autosplit.plan(resnet, gpus=2)  # imports the planner (torch): not part of planning
    rows = []
    for schedule in ("gpipe", "1f1b"):
        for gpus in range(2, 4 if args.smoke else 9):
            rows.append({"model": "resnet50", **timed(resnet, gpus, repeats, schedule=schedule)})
            print(rows[-1])
    big = thousand_blocks()  # in a smoke run too: 100 blocks took 7 s, these 2 s
    name = f"{len(big.blocks)} blocks"
    for schedule in ("gpipe", "1f1b"):
        rows.append({"model": name, **timed(big, 8, repeats, schedule=schedule,
                                            bandwidth_bytes_per_s=1e9)})
        print(rows[-1])
    joint = autosplit.Profile.load(fixture.parent / SCHEDULES_FIXTURE)
    autosplit.plan(joint, gpus=2,
                   options=PlanOptions(schedule="auto"))  # imports torch's schedules (their orders)
    rows += joint_rows(joint, [2] if args.smoke else [2, 4, 8], repeats)
    info = machine()
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    note = (f"Each `autosplit.plan` call timed {repeats}× after one untimed call that imports "
            "the planner; median and range (s). Every plan is the proven optimum of its "
            "predicted step over every cut and micro-batch size (the search's own `solver` "
            "says when not). The 1,000-block model: 0.5–1.5 ms per sample per block, "
            "micro-batch sizes 4 and 8 (m = 16 and 8), batch 64, cuts of 0–1 MB per sample "
            f"at 1 GB/s. Load average when done (1, 5, 15 min): {load}.")
    lines = [
        "# Exact planner: time to plan", "",
        (f"Machine: {describe(info)}. "
         f"Command: `{command_line('exact_search.py', sys.argv[1:])}`."),
        "", note, "",
        "| model | schedule | p | median (s) | range (s) | goal (s) | b | proven | balance |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r["schedule"] == "auto":
            continue
        goal = GOALS_S.get(r["model"], "–")
        balance = ", ".join(map(str, r["balance"])) if r["model"] == "resnet50" else "…"
        lines.append(
            f"| {r['model']} | {r['schedule']} | {r['gpus']} | {r['median_s']:.3f} | "
            f"{min(r['seconds']):.3f}–{max(r['seconds']):.3f} | {goal} | {r['split_size']} | "
            f"{'yes' if r['proven'] else 'no'} | {balance} |"
        )
    lines += [
        "", "## The joint search (`schedule=\"auto\"`)", "",
        (f"`tests/fixtures/{SCHEDULES_FIXTURE}`: ResNet50 at the tutorial's size on a CPU "
         "worker, the backward's input/weight split and checkpointing measured; every schedule "
         "torch runs, 1 or 2 stages per rank, every cut, micro-batch size and (within a memory "
         "limit) stage to recompute. The limit is 70 % of the memory per rank that the "
         "unlimited plan needs."), "",
        ("| p | memory limit | median (s) | range (s) | chosen | v | b | recomputed stages | "
         "predicted step (ms) | proven |"),
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r["schedule"] != "auto":
            continue
        limit = "–" if r["memory_per_gpu"] is None else f"{r['memory_per_gpu'] / 2**20:.0f} MiB"
        lines.append(
            f"| {r['gpus']} | {limit} | {r['median_s']:.3f} | "
            f"{min(r['seconds']):.3f}–{max(r['seconds']):.3f} | {r['chosen']} | {r['v']} | "
            f"{r['split_size']} | {r['checkpointed']} | {r['predicted_step_ms']:.0f} | "
            f"{'yes' if r['proven'] else 'no'} |"
        )
    write_results(args.out, "exact_search_smoke" if args.smoke else "exact_search",
                  {"machine": info, "repeats": repeats, "load": os.getloadavg(), "rows": rows}, "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
