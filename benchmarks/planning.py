"""What planning costs the user: time to trace and profile, and time to plan.

For examples/resnet50.py (batch 120, 3×128×128, the tutorial's input) and examples/gpt.py
("small", batch 16 × 64 tokens): the wall time of tracing, of profiling with the default
micro-batch sizes and budget (one CPU worker, one thread), and of planning for 2, 4 and 8
devices with the dynamic program and with the MILP. Solver scaling on synthetic problems up to
1,000 blocks, beside torchgpipe's own partitioner, is in ``benchmarks/solvers.py``.

    python benchmarks/planning.py            # writes benchmarks/results/planning.{json,md}
    python benchmarks/planning.py --smoke    # the toy model only, in seconds (used by the tests)
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, describe, load_example, machine, write_results

import autosplit
from autosplit import PlanOptions, ProfileOptions
from autosplit.capture.trace import trace
from autosplit.measure.profiler import profile_graph


def measure(name: str, model, inputs, stages: list[int], budget_s: float) -> dict:  # type: ignore[no-untyped-def]
    start = time.perf_counter()
    graph = trace(model)
    trace_s = time.perf_counter() - start
    start = time.perf_counter()
    prof = profile_graph(graph, inputs, options=ProfileOptions(budget_s=budget_s))
    profile_s = time.perf_counter() - start
    row = {
        "model": name,
        "blocks": len(graph.blocks),
        "input_shapes": [list(x.shape) for x in inputs],
        "microbatch_sizes": list(prof.microbatch_sizes),
        "trace_seconds": trace_s,
        "profile_seconds": profile_s,
        "plans": [],
    }
    for p in stages:
        if p > len(graph.blocks):
            continue
        entry = {"gpus": p}
        for solver in ("dp", "milp"):
            start = time.perf_counter()
            plan = autosplit.plan(prof, p, options=PlanOptions(solver=solver))
            entry[f"{solver}_seconds"] = time.perf_counter() - start
            entry[f"{solver}_step_ms"] = plan.predicted_step_ms
        row["plans"].append(entry)
    return row


def markdown(rows: list[dict], settings: dict) -> str:
    lines = [
        "# Planning cost",
        "",
        f"Machine: {describe(settings['machine'])}. Profiling on one CPU worker (1 thread), default "
        f"micro-batch sizes, budget {settings['budget_s']} s. Command: `{settings['command']}`.",
        "",
        "| model | blocks | input | sizes measured | trace (s) | profile (s) | p | DP plan (s) | MILP plan (s) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        for k, e in enumerate(r["plans"]):
            head = (
                f"| {r['model']} | {r['blocks']} | {' '.join('×'.join(map(str, s)) for s in r['input_shapes'])} | "
                f"{', '.join(map(str, r['microbatch_sizes']))} | {r['trace_seconds']:.2f} | "
                f"{r['profile_seconds']:.1f} |"
                if k == 0 else "| | | | | | |"
            )
            lines.append(f"{head} {e['gpus']} | {e['dp_seconds']:.3f} | {e['milp_seconds']:.2f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="the toy model only")
    parser.add_argument("--budget", type=float, default=40.0, help="profiling budget (s)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    rows = []
    if args.smoke:
        toy = load_example("toy")
        rows.append(measure("toy", toy.build_model(), toy.example_inputs(), [2], args.budget))
    else:
        resnet = load_example("resnet50")
        rows.append(measure("resnet50", resnet.build_model(), resnet.example_inputs(), [2, 4, 8], args.budget))
        gpt = load_example("gpt")
        rows.append(measure("gpt small", gpt.build_model("small"), gpt.example_inputs(16), [2, 4, 8], args.budget))
    settings = {
        "machine": machine(),
        "budget_s": args.budget,
        "command": "python benchmarks/planning.py" + (" --smoke" if args.smoke else ""),
    }
    text = markdown(rows, settings)
    write_results(args.out, "planning_smoke" if args.smoke else "planning", {"settings": settings, "rows": rows}, text)
    print(text)


if __name__ == "__main__":
    main()
