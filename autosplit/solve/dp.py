"""Exact dynamic program for the contiguous min-max partition (no torch).

D[k][j] = the smallest possible bottleneck when the first j blocks form k stages:

    D[k][j] = min over i < j of max(D[k-1][i], T_k(i, j))    with memory M_k(i, j) ≤ cap_k

where T_k(i, j) is the time of stage k-1 holding blocks i … j-1 (its costs plus the comm of the
cut after block j-1, unless it is the last stage). The inner minimum is vectorised with numpy,
so the work is O(n²·p) element operations but only O(n·p) Python steps: 1,000 blocks × 8
stages takes a fraction of a second. Ties break towards the smallest i (deterministic plans).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from autosplit import checks
from autosplit.errors import InfeasiblePlanError, InvalidInputError
from autosplit.solve.problem import Partition, PartitionProblem, evaluate

__all__ = ["solve_dp", "balance", "min_capacity", "infeasible_error"]


def _prefix(row: Sequence[float]) -> np.ndarray:
    out = np.zeros(len(row) + 1, dtype=np.float64)
    np.cumsum(np.asarray(row, dtype=np.float64), out=out[1:])
    return out


StageValue = Callable[[int, int, np.ndarray], np.ndarray]
"""``value(s, j, starts)``: a stage quantity of stage s ending before block j, per start."""


def _minmax(p: int, n: int, value: StageValue, held: StageValue | None = None,
            capacity: Sequence[float] | None = None) -> tuple[int, ...] | None:
    """Balance minimising max over stages of ``value`` with ``held`` ≤ ``capacity`` per stage."""
    prev = np.full(n + 1, np.inf)
    prev[0] = 0.0
    choice = np.zeros((p + 1, n + 1), dtype=np.int64)
    for k in range(1, p + 1):
        cur = np.full(n + 1, np.inf)
        ends = range(n, n + 1) if k == p else range(k, n - (p - k) + 1)
        for j in ends:
            starts = np.arange(k - 1, j)
            best_here = np.maximum(prev[starts], value(k - 1, j, starts))
            if held is not None and capacity is not None:
                fits = held(k - 1, j, starts) <= capacity[k - 1] * (1 + 1e-12)
                best_here = np.where(fits, best_here, np.inf)
            best = int(np.argmin(best_here))  # first minimum: ties break towards smaller i
            cur[j] = best_here[best]
            choice[k, j] = starts[best]
        prev = cur
    if not np.isfinite(prev[n]):
        return None
    balance, j = [], n
    for k in range(p, 0, -1):
        i = int(choice[k, j])
        balance.append(j - i)
        j = i
    return tuple(reversed(balance))


def _stage_time(problem: PartitionProblem) -> StageValue:
    cost = [_prefix(row) for row in problem.costs]
    comm = np.append(np.asarray(problem.comm, dtype=np.float64), 0.0)  # comm[n-1] = 0: no cut
    last = problem.p - 1
    return lambda s, j, starts: cost[s][j] - cost[s][starts] + (0.0 if s == last else comm[j - 1])


def _stage_memory(problem: PartitionProblem) -> StageValue:
    assert problem.memory is not None
    mem = [_prefix(row) for row in problem.memory]
    if problem.memory_first is None and problem.memory_last is None:
        return lambda s, j, starts: mem[s][j] - mem[s][starts]
    zeros = [np.zeros(problem.n)] * problem.p
    first = zeros if problem.memory_first is None else [
        np.asarray(row, dtype=np.float64) for row in problem.memory_first]
    last = zeros if problem.memory_last is None else [
        np.asarray(row, dtype=np.float64) for row in problem.memory_last]
    # blocks starts … j-1 on stage s: the first is block `starts`, the last block j - 1
    return lambda s, j, starts: mem[s][j] - mem[s][starts] + first[s][starts] + last[s][j - 1]


def _solve(problem: PartitionProblem, use_memory: bool) -> tuple[int, ...] | None:
    limited = use_memory and problem.memory is not None and problem.capacity is not None
    return _minmax(
        problem.p, problem.n, _stage_time(problem),
        _stage_memory(problem) if limited else None,
        problem.capacity if limited else None,
    )


def _check_problem(problem: object) -> None:
    checks.instance_of(
        "problem", problem, PartitionProblem,
        "a PartitionProblem: build one with PartitionProblem.build(costs, parts, …)",
    )


def min_capacity(problem: PartitionProblem) -> Partition:
    """The partition whose largest stage memory is smallest (ignoring time).

    Its ``bottleneck`` and ``stage_times`` are stage memories (bytes): ``bottleneck`` is the
    smallest per-device memory with which any partition exists.

    Raises:
        ArgumentTypeError: ``problem`` is not a :class:`PartitionProblem`.
        InvalidInputError: the problem has no memory table.
    """
    _check_problem(problem)
    if problem.memory is None:
        raise InvalidInputError("min_capacity needs a problem with memory")
    found = _minmax(problem.p, problem.n, _stage_memory(problem))
    assert found is not None
    part = evaluate(problem, found)
    return Partition(part.balance, part.stage_memory, part.stage_memory, max(part.stage_memory))


def solve_dp(problem: PartitionProblem) -> Partition:
    """The exact min-max partition of ``problem`` within its memory capacities.

    Raises:
        ArgumentTypeError: ``problem`` is not a :class:`PartitionProblem`.
        InfeasiblePlanError: no partition fits the capacities; the error carries the smallest
            per-device capacity (bytes) that would work and the stage that needs it.
    """
    _check_problem(problem)
    found = _solve(problem, use_memory=True)
    if found is None:
        raise infeasible_error(problem)
    return evaluate(problem, found)


def infeasible_error(problem: PartitionProblem) -> InfeasiblePlanError:
    """The error for a problem no partition of which fits: it names the smallest capacity."""
    smallest = min_capacity(problem)
    stage = max(range(problem.p), key=lambda s: smallest.stage_memory[s])
    return InfeasiblePlanError(
        f"no split into {problem.p} stages fits the memory limits "
        f"{[round(c) for c in problem.capacity or ()]}; the smallest feasible plan needs "
        f"{smallest.bottleneck:.6g} per device (stage {stage}): raise the capacity or add stages",
        min_capacity_bytes=smallest.bottleneck,
        stage=stage,
    )


def balance(
    costs: Sequence[float],
    parts: int,
    *,
    memory: Sequence[float] | None = None,
    capacity: float | None = None,
    comm: Sequence[float] | None = None,
) -> list[int]:
    """Blocks per stage minimising max over stages of (Σ costs + comm at the outgoing cut).

    Args:
        costs: time of each block (any unit).
        parts: number of stages, 1 ≤ parts ≤ len(costs).
        memory: bytes of each block; with ``capacity``, each stage's sum must stay ≤ capacity.
        capacity: bytes per stage.
        comm: ``comm[i]`` is the cost of cutting after block i (``len(costs) - 1`` entries).

    Returns:
        torchgpipe's balance form, e.g. ``[3, 2]``.

    Raises:
        ArgumentTypeError: a value that is not a number, a list that is not a list, a
            ``parts`` that is not an int.
        InvalidInputError: bad sizes or values (negative, NaN, infinite, mismatched lengths).
        InfeasiblePlanError: no split fits; ``min_capacity_bytes`` is the smallest that does.
    """
    if memory is not None and capacity is None:
        raise InvalidInputError("memory was given without capacity: pass capacity=… (bytes)")
    problem = PartitionProblem.build(
        costs, parts, comm=comm, memory=memory, capacity=capacity if memory is not None else None
    )
    return list(solve_dp(problem).balance)
