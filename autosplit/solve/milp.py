"""The contiguous min-max partition as a mixed-integer program, solved with PuLP (no torch).

The same problem as :class:`~autosplit.solve.problem.PartitionProblem` and
:func:`~autosplit.solve.dp.solve_dp`; the MILP is an independent oracle for the DP and the
starting point for constraints a DP cannot express. Symbols: n blocks, p stages, block i,
stage s.

Variables:

* ``on_b{i}_s{s}`` binary, block i runs on stage s. Only pairs that can hold in some
  contiguous split with non-empty stages exist (``s ≤ i`` and ``p - 1 - s ≤ n - 1 - i``), so
  block 0 can only be on stage 0 and block n-1 only on stage p-1.
* ``cut_b{i}_s{s}`` binary, the cut after block i is stage s's outgoing cut (block i is the last
  block of stage s and block i+1 the first of stage s+1); stage s pays ``comm[i]``.
* ``bottleneck`` continuous, T, the objective.

Constraints (each named, so ``prob.writeLP("partition.lp")`` reads like this list):

* ``assign_b{i}``: Σ_s on[i][s] = 1, every block on exactly one stage.
* ``flow_b{i}_s{s}``: on[i+1][s] = on[i][s] − cut[i][s] + cut[i][s-1], block i+1 stays on block
  i's stage unless a cut after block i moves it to the next stage. With the assignment rows this
  makes the stage index a staircase from 0 to p-1 that rises by one at each cut: stages are
  contiguous, in order and (because every stage but the last must be left once) non-empty.
* ``cut_b{i}_s{s}_needs_b{i}_on_s{s}``: cut[i][s] ≤ on[i][s], only the stage holding block i can
  cut after it.
* ``stage{s}_cuts_once``: Σ_i cut[i][s] = 1 for s < p-1 (implied, but tightens the relaxation).
* ``time_stage{s}``: Σ_i costs[s][i]·on[i][s] + Σ_i comm[i]·cut[i][s] ≤ T.
* ``memory_stage{s}``: Σ_i memory[s][i]·on[i][s] + the first block's ``memory_first[s][i]``
  and the last block's ``memory_last[s][i]`` (through the cut variables) ≤ capacity[s] (only
  with memory limits).

The flow rows form a shortest-path structure over a (block × stage) grid, so the LP relaxation
without the time rows is integral and CBC closes small instances at the root.
"""

from __future__ import annotations

import itertools
import math
import os
import re
import tempfile
import time
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING

from autosplit import checks
from autosplit.errors import AutosplitError, InvalidInputError
from autosplit.solve.dp import infeasible_error
from autosplit.solve.problem import Partition, PartitionProblem, evaluate

if TYPE_CHECKING:
    import pulp

__all__ = ["SOLVERS", "MilpResult", "build_milp", "solve_milp"]

SOLVERS = ("cbc", "highs")
"""Solver names :func:`solve_milp` accepts: PuLP's bundled CBC, or HiGHS when installed."""


@dataclass(frozen=True, slots=True)
class MilpResult:
    """The MILP's answer.

    Attributes:
        partition: the best partition found, scored exactly with
            :func:`~autosplit.solve.problem.evaluate` (its ``bottleneck`` is in problem units).
        status: ``"optimal"`` (proven optimal) or ``"feasible"`` (the solver stopped at the time
            limit with an incumbent it did not prove optimal).
        solve_seconds: wall-clock time of the solver call, in seconds (model building excluded).
        gap: relative gap ``(incumbent − best bound) / incumbent`` at the end: 0.0 when optimal,
            ``None`` when the solver did not report a bound.
        solver: the PuLP solver that ran, e.g. ``"PULP_CBC_CMD"`` or ``"HiGHS"``.
    """

    partition: Partition
    status: str
    solve_seconds: float
    gap: float | None
    solver: str


def _on(i: int, s: int) -> str:
    return f"on_b{i}_s{s}"


def _cut(i: int, s: int) -> str:
    return f"cut_b{i}_s{s}"


def _variable(
    prob: pulp.LpProblem, name: str, cat: str, low: float | None = None
) -> pulp.LpVariable:
    """A variable of ``prob``: PuLP ≥ 3.3 wants ``prob.add_variable``, older ones the class."""
    import pulp

    if hasattr(prob, "add_variable"):
        return prob.add_variable(name, lowBound=low, cat=cat)
    return pulp.LpVariable(name, lowBound=low, cat=cat)


def build_milp(problem: PartitionProblem) -> pulp.LpProblem:
    """The MILP of ``problem`` (see the module docstring for its variables and constraints).

    Write it with ``build_milp(problem).writeLP("partition.lp")`` to read or hand it to
    another solver. Variables are named ``on_b{i}_s{s}``, ``cut_b{i}_s{s}`` and ``bottleneck``.
    """
    import pulp

    checks.instance_of(
        "problem", problem, PartitionProblem,
        "a PartitionProblem: build one with PartitionProblem.build(costs, parts, …)",
    )
    n, p = problem.n, problem.p
    slack = n - p  # how far past its own index a stage's first block may start
    prob = pulp.LpProblem("autosplit_partition", pulp.LpMinimize)
    on = {
        (i, s): _variable(prob, _on(i, s), pulp.LpBinary)
        for s in range(p)
        for i in range(s, s + slack + 1)
    }
    # cut after block i from stage s to s+1: block i on s and block i+1 on s+1.
    cut = {
        (i, s): _variable(prob, _cut(i, s), pulp.LpBinary)
        for s in range(p - 1)
        for i in range(s, s + slack + 1)
    }
    bottleneck = _variable(prob, "bottleneck", pulp.LpContinuous, low=0.0)
    prob += bottleneck, "max_stage_time"

    for i in range(n):
        prob += (
            pulp.lpSum(on[i, s] for s in range(p) if (i, s) in on) == 1,
            f"assign_b{i}",
        )
    for i in range(n - 1):
        for s in range(p):
            terms = [(on, (i + 1, s), 1), (on, (i, s), -1), (cut, (i, s), 1), (cut, (i, s - 1), -1)]
            expr = pulp.lpSum(coef * table[key] for table, key, coef in terms if key in table)
            if any(key in table for table, key, _ in terms):
                prob += expr == 0, f"flow_b{i}_s{s}"
    for (i, s), var in cut.items():
        prob += var <= on[i, s], f"cut_b{i}_s{s}_needs_b{i}_on_s{s}"
    for s in range(p - 1):
        prob += (
            pulp.lpSum(var for (_, t), var in cut.items() if t == s) == 1,
            f"stage{s}_cuts_once",
        )
    for s in range(p):
        compute = pulp.lpSum(problem.costs[s][i] * var for (i, t), var in on.items() if t == s)
        send = pulp.lpSum(problem.comm[i] * var for (i, t), var in cut.items() if t == s)
        prob += compute + send - bottleneck <= 0, f"time_stage{s}"
    if problem.memory is not None and problem.capacity is not None:
        for s in range(p):
            held = pulp.lpSum(problem.memory[s][i] * var for (i, t), var in on.items() if t == s)
            if problem.memory_first is not None:
                # block i starts stage s > 0 exactly when the cut after block i-1 leaves s-1
                starts = [problem.memory_first[s][i + 1] * var
                          for (i, t), var in cut.items() if t == s - 1]
                if s == 0:
                    starts.append(problem.memory_first[0][0])
                held = held + pulp.lpSum(starts)
            if problem.memory_last is not None:
                # block i ends stage s < p-1 exactly when the cut after it leaves s
                ends = [problem.memory_last[s][i] * var
                        for (i, t), var in cut.items() if t == s]
                if s == p - 1:
                    ends.append(problem.memory_last[s][n - 1])
                held = held + pulp.lpSum(ends)
            prob += held <= problem.capacity[s], f"memory_stage{s}"
    return prob


def _solver(name: str, time_limit_s: float | None, log_path: str) -> pulp.LpSolver:
    import pulp

    available = pulp.listSolvers(onlyAvailable=True)
    if name == "cbc":
        with warnings.catch_warnings():
            # PuLP 3.3 warns that PuLP 4 drops the bundled CBC; pyproject pins pulp < 4.
            warnings.filterwarnings("ignore", "PULP_CBC_CMD is deprecated", DeprecationWarning)
            return pulp.PULP_CBC_CMD(
                msg=False, timeLimit=time_limit_s, gapRel=0.0, logPath=log_path
            )
    if name == "highs":
        if "HiGHS" in available:
            return pulp.HiGHS(msg=False, timeLimit=time_limit_s, gapRel=0.0)
        if "HiGHS_CMD" in available:
            return pulp.HiGHS_CMD(msg=False, timeLimit=time_limit_s, gapRel=0.0)
        raise InvalidInputError(
            f"solver='highs' is not available (PuLP finds {available}): "
            "pip install highspy, or use solver='cbc'"
        )
    raise InvalidInputError(f"unknown solver {name!r}: use one of {', '.join(SOLVERS)}")


_CBC_BOUND = re.compile(r"best possible\s+(-?[0-9.eE+-]+)")
_CBC_LOWER = re.compile(r"^Lower bound:\s+(-?[0-9.eE+-]+)", re.MULTILINE)


def _best_bound(prob: pulp.LpProblem, solver: pulp.LpSolver, log_path: str) -> float | None:
    """The solver's proven lower bound on T, when it reports one."""
    if solver.name == "HiGHS":
        info = prob.solverModel.getInfo()
        bound = float(info.mip_dual_bound)
        return bound if math.isfinite(bound) else None
    if not os.path.exists(log_path):
        return None
    with open(log_path, encoding="utf-8", errors="replace") as f:
        log = f.read()
    found = _CBC_BOUND.findall(log) or _CBC_LOWER.findall(log)
    if not found:
        return None
    try:
        return float(found[-1])
    except ValueError:
        return None


def _balance(prob: pulp.LpProblem, problem: PartitionProblem) -> tuple[int, ...]:
    values = {v.name: v.varValue for v in prob.variables()}
    stages = []
    for i in range(problem.n):
        held = [s for s in range(problem.p) if (values.get(_on(i, s)) or 0.0) > 0.5]
        if len(held) != 1:
            raise AutosplitError(f"the MILP solver put block {i} on stages {held}: use solve_dp")
        stages.append(held[0])
    steps = [b - a for a, b in itertools.pairwise(stages)]
    if stages[0] != 0 or stages[-1] != problem.p - 1 or any(d not in (0, 1) for d in steps):
        raise AutosplitError(
            f"the MILP solver returned a non-contiguous split {stages}: use solve_dp"
        )
    return tuple(stages.count(s) for s in range(problem.p))


def solve_milp(
    problem: PartitionProblem,
    *,
    time_limit_s: float | None = None,
    solver: str = "cbc",
) -> MilpResult:
    """Solve ``problem`` exactly as a MILP (see :func:`build_milp`).

    Args:
        problem: the partition problem.
        time_limit_s: stop the solver after this many seconds and return its incumbent
            (``status="feasible"`` with the remaining ``gap``); ``None`` runs to optimality.
        solver: ``"cbc"`` (PuLP's bundled CBC) or ``"highs"`` (needs ``highspy``).

    Among several optimal balances the solver picks one (not necessarily the DP's
    earliest-cut choice); the optimum value is the same. Much slower than the DP beyond a few
    dozen blocks: a min-max objective has a weak LP relaxation.

    Raises:
        InvalidInputError: unknown or unavailable solver, or a bad time limit.
        InfeasiblePlanError: no partition fits the capacities; carries the smallest per-device
            capacity that would, as :func:`~autosplit.solve.dp.solve_dp` does.
        AutosplitError: the solver stopped without any solution (raise ``time_limit_s``).
    """
    import pulp

    checks.optional(checks.positive_finite, "time_limit_s", time_limit_s, "s")
    prob = build_milp(problem)
    with tempfile.TemporaryDirectory(prefix="autosplit-milp-") as tmp:
        log_path = os.path.join(tmp, "solver.log")
        engine = _solver(solver, time_limit_s, log_path)
        start = time.perf_counter()
        prob.solve(engine)
        seconds = time.perf_counter() - start
        status = pulp.LpStatus[prob.status]
        found = prob.sol_status in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible)
        if status == "Infeasible":
            raise infeasible_error(problem)
        if status != "Optimal" or not found:
            limit = "" if time_limit_s is None else f" within time_limit_s={time_limit_s}"
            raise AutosplitError(
                f"{engine.name} found no partition{limit} (status {status!r}): "
                "raise time_limit_s or use solve_dp"
            )
        partition = evaluate(problem, _balance(prob, problem))
        if prob.sol_status == pulp.LpSolutionOptimal:
            return MilpResult(partition, "optimal", seconds, 0.0, engine.name)
        bound = _best_bound(prob, engine, log_path)
    gap = None
    if bound is not None:
        top = partition.bottleneck
        gap = 0.0 if top <= 0 else max(0.0, (top - bound) / top)
    return MilpResult(partition, "feasible", seconds, gap, engine.name)
