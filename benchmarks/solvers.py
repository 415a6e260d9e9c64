"""Solver cost and baseline quality on the same partition problems.

For n blocks ∈ {20, 100, 1000} and p stages ∈ {2, 4, 8}: the wall time of the exact dynamic
program and of the PuLP MILP (CBC, with a time limit; its status and gap are reported), and the
bottleneck that each peer heuristic reaches relative to the optimum.

Problems are random but reproducible (seeded): block costs log-normal (a few heavy blocks, like
real networks), cut costs 0–20 % of a block, memory per block uniform, and a capacity that leaves
25 % headroom over the smallest feasible one.

    python benchmarks/solvers.py                 # full grid; writes benchmarks/results/solvers.{json,md}
    python benchmarks/solvers.py --smoke         # a small grid in seconds (used by the tests)
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, describe, machine, write_results

from autosplit.solve import (
    PartitionProblem,
    block_partition,
    by_parameters,
    evaluate,
    min_capacity,
    solve_dp,
    solve_milp,
    uniform,
)

try:  # optional peer: pip install torchgpipe==0.0.7
    from torchgpipe.balance.blockpartition import solve as torchgpipe_solve
except ImportError:  # pragma: no cover - depends on the machine
    torchgpipe_solve = None


def make_problem(n: int, p: int, seed: int) -> tuple[PartitionProblem, list[float]]:
    """A reproducible random problem with memory limits, and per-block parameter sizes."""
    rng = random.Random(seed)
    costs = [rng.lognormvariate(0.0, 0.6) for _ in range(n)]
    comm = [rng.uniform(0.0, 0.2) * (sum(costs) / n) for _ in range(n - 1)]
    memory = [rng.uniform(1.0, 10.0) for _ in range(n)]
    params = [rng.uniform(0.0, 5.0) for _ in range(n)]
    free = PartitionProblem((tuple(costs),) * p, tuple(comm), (tuple(memory),) * p, None)
    capacity = min_capacity(free).bottleneck * 1.25
    problem = PartitionProblem((tuple(costs),) * p, tuple(comm), (tuple(memory),) * p, (capacity,) * p)
    return problem, params


def timed(fn, *args, **kwargs):  # type: ignore[no-untyped-def]
    start = time.perf_counter()
    value = fn(*args, **kwargs)
    return value, time.perf_counter() - start


def run(sizes: list[int], stages: list[int], milp_limit_s: float, milp_max_n: int) -> list[dict]:
    rows = []
    for n in sizes:
        for p in stages:
            problem, params = make_problem(n, p, seed=1000 * n + p)
            dp, dp_s = timed(solve_dp, problem)
            row: dict = {"n": n, "p": p, "dp_seconds": dp_s, "optimum": dp.bottleneck}
            if n <= milp_max_n:
                milp, milp_s = timed(solve_milp, problem, time_limit_s=milp_limit_s)
                row.update(
                    milp_seconds=milp_s,
                    milp_status=milp.status,
                    milp_gap=milp.gap,
                    milp_vs_dp=milp.partition.bottleneck / dp.bottleneck,
                )
            else:
                row.update(milp_seconds=None, milp_status="not run", milp_gap=None, milp_vs_dp=None)
            costs = list(problem.costs[0])
            heuristics = {
                "uniform": lambda n=n, p=p: uniform(n, p),
                "parameters": lambda params=params, p=p: by_parameters(params, p),
                "torchgpipe": lambda costs=costs, p=p: block_partition(costs, p),
            }
            for name, heuristic in heuristics.items():
                bal, seconds = timed(heuristic)
                row[f"{name}_seconds"] = seconds
                row[f"{name}_vs_optimum"] = evaluate(problem, bal).bottleneck / dp.bottleneck
            row["torchgpipe_package_seconds"] = None
            row["torchgpipe_package_vs_optimum"] = None
            if torchgpipe_solve is not None:
                # torchgpipe 0.0.7's own block partition, on the same costs as integers (µs)
                blocks, seconds = timed(torchgpipe_solve, [round(c * 1000) for c in costs], p)
                bal = tuple(len(b) for b in blocks)
                row["torchgpipe_package_seconds"] = seconds
                row["torchgpipe_package_vs_optimum"] = evaluate(problem, bal).bottleneck / dp.bottleneck
            rows.append(row)
    return rows


def markdown(rows: list[dict], settings: dict) -> str:
    def fmt(v, spec=".3g"):  # type: ignore[no-untyped-def]
        return "–" if v is None else format(v, spec)

    lines = [
        "# Solver benchmark",
        "",
        f"Machine: {describe(settings['machine'])}. "
        f"MILP: PuLP/CBC with a {settings['milp_limit_s']} s limit. Command: `{settings['command']}`.",
        "",
        "Heuristic columns give the bottleneck stage time relative to the optimum (1.00 = optimal), "
        "ignoring memory limits (the heuristics do not see them). torchgpipe-style is autosplit's "
        "own rendering of the block-partition heuristic; torchgpipe 0.0.7 is the package's solver "
        "(run when installed: `pip install torchgpipe==0.0.7`).",
        "",
        "| n | p | DP (s) | MILP (s) | MILP status | MILP / DP | uniform | by parameters "
        "| torchgpipe-style | torchgpipe 0.0.7 (s) | torchgpipe 0.0.7 |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        gap = f" (gap {r['milp_gap']:.1%})" if r["milp_gap"] else ""
        lines.append(
            f"| {r['n']} | {r['p']} | {fmt(r['dp_seconds'])} | {fmt(r['milp_seconds'])} | "
            f"{r['milp_status']}{gap} | "
            f"{fmt(r['milp_vs_dp'], '.4f')} | {fmt(r['uniform_vs_optimum'], '.2f')} | "
            f"{fmt(r['parameters_vs_optimum'], '.2f')} | {fmt(r['torchgpipe_vs_optimum'], '.2f')} | "
            f"{fmt(r['torchgpipe_package_seconds'])} | {fmt(r['torchgpipe_package_vs_optimum'], '.2f')} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="a small grid that runs in seconds")
    parser.add_argument("--milp-limit", type=float, default=60.0, help="MILP time limit per problem (s)")
    parser.add_argument("--out", type=Path, default=RESULTS, help="folder for solvers.json and solvers.md")
    args = parser.parse_args()
    if args.smoke:
        sizes, stages, limit, milp_max_n = [20], [2, 4], 10.0, 20
    else:
        sizes, stages, limit, milp_max_n = [20, 100, 1000], [2, 4, 8], args.milp_limit, 1000
    settings = {
        "machine": machine(),
        "milp_limit_s": limit,
        "command": "python benchmarks/solvers.py" + (" --smoke" if args.smoke else ""),
        "sizes": sizes,
        "stages": stages,
    }
    rows = run(sizes, stages, limit, milp_max_n)
    text = markdown(rows, settings)
    stem = "solvers_smoke" if args.smoke else "solvers"
    write_results(args.out, stem, {"settings": settings, "rows": rows}, text)
    print(text)


if __name__ == "__main__":
    main()
