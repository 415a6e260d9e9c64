"""How close the calibrated analytic cost model comes to measured stage times.

ResNet50 (batch 48, 3×64×64) on one CPU worker (one thread). Two measured profiles, A and B,
are taken in one run. The nominal ``cpu-core`` spec is calibrated on A at one micro-batch size
b; the calibrated analytic profile plans 2 stages at that b; its predicted per-stage compute
time is compared with the measured per-stage times of the same cut in A (the data it was fitted
on) and in B (an independent measurement). Repeated for several b: per-sample cost on these CPUs
has a cliff (b ≤ 12 is far slower per sample than b ≥ 16 in layer4), which one efficiency factor
per device cannot follow.

    python benchmarks/analytic.py            # writes benchmarks/results/analytic.{json,md}
    python benchmarks/analytic.py --smoke    # a small MLP, in seconds (used by the tests)
"""

from __future__ import annotations

if __name__ == "__main__":  # started again first, before the imports below pay twice: the C
    # allocator keeping freed memory, as the ranks run (see autosplit/measure/allocator.py)
    from autosplit.measure.allocator import restart_keeping_freed_memory

    restart_keeping_freed_memory()

import argparse
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch
import torchvision
from common import RESULTS, describe, machine, write_results
from torch import nn

import autosplit
from autosplit import PlanOptions, ProfileOptions
from autosplit.estimate.analytic import count_costs, profile_from_costs
from autosplit.estimate.options import EstimateOptions
from autosplit.specs import calibrate, get_spec


def stage_times(profile: autosplit.Profile, b: int, cut: int) -> list[float]:
    k = profile.size_index(b)
    ms = [blk.fwd_ms[k] + blk.bwd_ms[k] for blk in profile.blocks]
    return [math.fsum(ms[:cut]), math.fsum(ms[cut:])]


def run(model: nn.Module, x: torch.Tensor, sizes: list[int], repeats: int) -> dict:
    start = time.perf_counter()
    costs = count_costs(model, x, options=EstimateOptions(microbatch_sizes=sizes))
    count_s = time.perf_counter() - start
    runs = [
        autosplit.profile(model, x,
                          options=ProfileOptions(microbatch_sizes=sizes, warmup=1, repeats=repeats,
                                                 budget_s=None))
        for _ in range(2)
    ]
    nominal = get_spec("cpu-core")
    rows = []
    for b in sizes:
        spec = calibrate(nominal, runs[0], costs, sizes=[b])
        plan = autosplit.plan(profile_from_costs(costs, spec), 2, options=PlanOptions(split_size=b))
        cut = len(plan.stages[0].blocks)
        predicted = [s.compute_ms for s in plan.stages]
        row = {
            "b": b,
            "efficiency": spec.efficiency,
            "bandwidth_efficiency": spec.bandwidth_efficiency,
            "cut_before": plan.stages[1].blocks[0],
            "predicted_stage_ms": predicted,
            "measured_plan_cut_before": autosplit.plan(
                runs[0], 2, PlanOptions(split_size=b)).stages[1].blocks[0],
        }
        for name, measured in zip("AB", runs):
            times = stage_times(measured, b, cut)
            row[f"measured_{name}_stage_ms"] = times
            row[f"error_{name}"] = [p / m - 1 for p, m in zip(predicted, times)]
        rows.append(row)
    return {"count_seconds": count_s, "rows": rows}


def markdown(result: dict, settings: dict) -> str:
    lines = [
        "# Calibrated analytic model vs measured stage times",
        "",
        f"Machine: {describe(settings['machine'])}. Model: {settings['model']}, one CPU worker "
        f"(1 thread), {settings['repeats']} timed repeats per block. Counting FLOPs and bytes on the "
        f"meta device took {result['count_seconds']:.1f} s. Command: `{settings['command']}`.",
        "",
        "Calibrated on run A at size b; error = predicted / measured − 1 for stage 0 and stage 1 of "
        "the analytic plan's cut.",
        "",
        "| b | efficiency (compute, bandwidth) | cut before | predicted (ms) | measured A (ms) | error A | measured B (ms) | error B |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        def ms(v: list[float]) -> str:
            return ", ".join(f"{x:.3g}" for x in v)

        def err(v: list[float]) -> str:
            return ", ".join(f"{x:+.0%}" for x in v)

        lines.append(
            f"| {r['b']} | {r['efficiency']:.3f}, {r['bandwidth_efficiency']:.3f} | {r['cut_before']} | "
            f"{ms(r['predicted_stage_ms'])} | {ms(r['measured_A_stage_ms'])} | {err(r['error_A'])} | "
            f"{ms(r['measured_B_stage_ms'])} | {err(r['error_B'])} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="a small MLP instead of ResNet50")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    torch.manual_seed(0)
    if args.smoke:
        model: nn.Module = nn.Sequential(*[nn.Sequential(nn.Linear(256, 256), nn.ReLU()) for _ in range(4)])
        x, sizes, name, repeats = torch.randn(32, 256), [16, 32], "4 × Linear(256, 256)", 2
    else:
        model = torchvision.models.resnet50()
        x, sizes, name, repeats = torch.randn(48, 3, 64, 64), [12, 16, 24], "ResNet50, batch 48, 3×64×64", args.repeats
    result = run(model, x, sizes, repeats)
    settings = {
        "machine": machine(),
        "model": name,
        "sizes": sizes,
        "repeats": repeats,
        "command": "python benchmarks/analytic.py" + (" --smoke" if args.smoke else ""),
    }
    text = markdown(result, settings)
    write_results(args.out, "analytic_smoke" if args.smoke else "analytic", {"settings": settings, **result}, text)
    print(text)


if __name__ == "__main__":
    main()
