"""autosplit.solve.milp: the MILP, the DP and brute force agree on small random instances."""

from __future__ import annotations

import dataclasses
import itertools
import math

import pulp
import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from autosplit.errors import AutosplitError, InfeasiblePlanError, InvalidInputError
from autosplit.solve import MilpResult, PartitionProblem, build_milp, evaluate, solve_dp, solve_milp
from autosplit.solve.milp import _best_bound, _solver


def compositions(n: int, p: int):
    """Every balance of n blocks on p non-empty stages."""
    for cuts in itertools.combinations(range(1, n), p - 1):
        bounds = (0, *cuts, n)
        yield tuple(b - a for a, b in itertools.pairwise(bounds))


def brute_force(problem: PartitionProblem) -> float | None:
    """The smallest bottleneck over every feasible balance, or None when none fits."""
    best = None
    for bal in compositions(problem.n, problem.p):
        part = evaluate(problem, bal)
        if problem.capacity is not None and any(
            mem > cap for mem, cap in zip(part.stage_memory, problem.capacity, strict=True)
        ):
            continue
        if best is None or part.bottleneck < best:
            best = part.bottleneck
    return best


def fits(problem: PartitionProblem, balance: tuple[int, ...]) -> bool:
    part = evaluate(problem, balance)
    caps = problem.capacity or (math.inf,) * problem.p
    return all(m <= c for m, c in zip(part.stage_memory, caps, strict=True))


# Costs on a 0.001 grid: distinct partitions differ by far more than the solvers' tolerances.
cost = st.integers(0, 100_000).map(lambda v: v / 1000)


@st.composite
def problems(draw: st.DrawFn) -> PartitionProblem:
    n = draw(st.integers(1, 8))
    p = draw(st.integers(1, min(4, n)))
    same_row = draw(st.booleans())
    if same_row:
        row = draw(st.lists(cost, min_size=n, max_size=n))
        costs = [row] * p
    else:  # heterogeneous devices: one cost row per stage
        costs = [draw(st.lists(cost, min_size=n, max_size=n)) for _ in range(p)]
    comm = draw(st.one_of(st.none(), st.lists(cost, min_size=n - 1, max_size=n - 1)))
    memory = capacity = None
    edges: dict[str, tuple[tuple[float, ...], ...]] = {}
    if draw(st.booleans()):
        memory = [draw(st.lists(st.integers(0, 50), min_size=n, max_size=n)) for _ in range(p)]
        # what a stage holds because it starts (ends) at a block: receive buffers
        for name in ("memory_first", "memory_last"):
            if draw(st.booleans()):
                edges[name] = tuple(tuple(float(x) for x in draw(
                    st.lists(st.integers(0, 30), min_size=n, max_size=n))) for _ in range(p))
        total = max(sum(row) for row in memory) + 60
        # from hopeless to roomy, so both feasible and infeasible instances come up
        capacity = [draw(st.integers(0, total)) for _ in range(p)]
    problem = PartitionProblem.build(costs, p, comm=comm, memory=memory, capacity=capacity)
    return dataclasses.replace(problem, **edges)


@settings(max_examples=150, deadline=None)
@given(problems())
def test_dp_milp_and_brute_force_agree(problem: PartitionProblem) -> None:
    best = brute_force(problem)
    event("infeasible" if best is None else "feasible")
    event("memory limits" if problem.capacity is not None else "no memory limits")
    event("first and last" if problem.memory_first and problem.memory_last else "not both")
    if best is None:
        with pytest.raises(InfeasiblePlanError) as dp_error:
            solve_dp(problem)
        with pytest.raises(InfeasiblePlanError) as milp_error:
            solve_milp(problem)
        assert milp_error.value.min_capacity_bytes == dp_error.value.min_capacity_bytes
        assert milp_error.value.stage == dp_error.value.stage
        assert str(milp_error.value) == str(dp_error.value)
        return
    dp = solve_dp(problem)
    milp = solve_milp(problem)
    assert math.isclose(dp.bottleneck, best, rel_tol=1e-6, abs_tol=1e-9)
    assert math.isclose(milp.partition.bottleneck, best, rel_tol=1e-6, abs_tol=1e-9)
    assert milp.status == "optimal"
    assert milp.gap == 0.0
    assert milp.solver == "PULP_CBC_CMD"
    assert milp.solve_seconds > 0
    assert fits(problem, milp.partition.balance)
    assert milp.partition == evaluate(problem, milp.partition.balance)


def test_known_instance() -> None:
    """Blocks 3 1 4 1 5 9 2 6 on 3 stages with comm after each block; memory 1…8, cap 15.

    Memory forces stage 0 to hold at most blocks 0–4 (1+2+3+4+5 = 15) and the last stage at
    most block 7 alone or blocks 6–7 (7+8 = 15); the best bottleneck is stage 0's 3+1+4+1+5 + 1.
    """
    problem = PartitionProblem.build(
        [3, 1, 4, 1, 5, 9, 2, 6], 3,
        comm=[1, 0, 2, 0, 1, 3, 0], memory=[1, 2, 3, 4, 5, 6, 7, 8], capacity=15,
    )
    result = solve_milp(problem)
    assert result.partition.bottleneck == 15.0 == solve_dp(problem).bottleneck
    assert result.partition.balance[0] == 5
    assert isinstance(result, MilpResult)
    with pytest.raises(dataclasses.FrozenInstanceError):
        result.status = "x"  # type: ignore[misc]


def test_single_stage_and_one_block_per_stage() -> None:
    one = PartitionProblem.build([1.0, 2.0, 3.0], 1, comm=[5.0, 5.0])
    assert solve_milp(one).partition.balance == (3,)
    assert solve_milp(one).partition.bottleneck == 6.0  # the last stage sends nothing
    each = PartitionProblem.build([1.0, 2.0, 3.0], 3, comm=[5.0, 7.0])
    result = solve_milp(each)
    assert result.partition.balance == (1, 1, 1)
    assert result.partition.stage_times == (6.0, 9.0, 3.0)


def test_comm_is_charged_to_the_sending_stage() -> None:
    """Costs 1 1 1 1 on 2 stages; a cut after block 1 costs 10, elsewhere 0.

    Without comm (2, 2) is best (2); with it, cutting after block 0 or 2 gives 3.
    """
    problem = PartitionProblem.build([1, 1, 1, 1], 2, comm=[0, 10, 0])
    result = solve_milp(problem)
    assert result.partition.balance in {(1, 3), (3, 1)}
    assert result.partition.bottleneck == 3.0


def test_infeasible_raises_like_the_dp() -> None:
    problem = PartitionProblem.build([1, 1, 1, 1], 2, memory=[5, 5, 5, 5], capacity=9)
    with pytest.raises(InfeasiblePlanError, match=r"smallest feasible plan needs 10") as err:
        solve_milp(problem)
    assert err.value.min_capacity_bytes == 10.0
    with pytest.raises(InfeasiblePlanError):
        solve_dp(problem)


def test_write_lp_names_every_constraint(tmp_path) -> None:
    problem = PartitionProblem.build(
        [1, 2, 3, 4], 2, comm=[1, 1, 1], memory=[1, 1, 1, 1], capacity=3
    )
    prob = build_milp(problem)
    assert isinstance(prob, pulp.LpProblem)
    path = tmp_path / "partition.lp"
    prob.writeLP(str(path))
    text = path.read_text()
    assert "Minimize\nmax_stage_time: bottleneck" in text
    for name in [
        "assign_b0:", "assign_b3:", "flow_b0_s0:", "flow_b2_s1:",
        "cut_b1_s0_needs_b1_on_s0:", "stage0_cuts_once:",
        "time_stage0:", "time_stage1:", "memory_stage0:", "memory_stage1:",
    ]:
        assert name in text, name
    # no stage-1 cut on 2 stages, and block 0 can only sit on stage 0
    assert "stage1_cuts_once" not in text
    assert "on_b0_s1" not in text
    # every constraint has a name of its own (no PuLP default _C1, _C2 …)
    assert "_C1:" not in text
    # no memory rows without memory limits
    assert "memory_stage" not in _lp_text(build_milp(PartitionProblem.build([1, 2], 2)), tmp_path)


def _lp_text(prob: pulp.LpProblem, tmp_path) -> str:
    path = tmp_path / "other.lp"
    prob.writeLP(str(path))
    return path.read_text()


@pytest.mark.parametrize("limit", [0, -1.0, math.nan, math.inf, True, "10"])
def test_bad_time_limit(limit: object) -> None:
    problem = PartitionProblem.build([1, 2], 2)
    with pytest.raises(InvalidInputError, match=r"time_limit_s must be a (finite )?number"):
        solve_milp(problem, time_limit_s=limit)  # type: ignore[arg-type]


def test_unknown_solver_and_bad_problem() -> None:
    problem = PartitionProblem.build([1, 2], 2)
    with pytest.raises(InvalidInputError, match=r"unknown solver 'gurobi': use one of cbc, highs"):
        solve_milp(problem, solver="gurobi")
    with pytest.raises(InvalidInputError, match=r"problem must be a PartitionProblem.*\(list\)"):
        build_milp([1, 2])  # type: ignore[arg-type]


def test_highs_agrees_with_the_dp_when_installed() -> None:
    available = pulp.listSolvers(onlyAvailable=True)
    problem = PartitionProblem.build(
        [[3, 1, 4, 1, 5, 9], [2, 7, 1, 8, 2, 8]], 2, comm=[1, 2, 1, 2, 1],
        memory=[1, 2, 3, 4, 5, 6], capacity=[12, 15],
    )
    if "HiGHS" not in available and "HiGHS_CMD" not in available:
        with pytest.raises(InvalidInputError, match=r"solver='highs' is not available"):
            solve_milp(problem, solver="highs")
        return
    result = solve_milp(problem, solver="highs")
    assert result.solver.startswith("HiGHS")
    assert result.status == "optimal"
    assert result.partition.bottleneck == solve_dp(problem).bottleneck


def test_time_limit_returns_incumbent_with_gap() -> None:
    """A 100-block, 6-stage instance that CBC does not close in 0.5 s on these machines.

    Whatever the machine's speed, the answer must be consistent: a proven optimum equals the
    DP's; an incumbent is no better than the DP's optimum and its gap is a fraction consistent
    with it; no incumbent at all is a clear error.
    """
    n, p = 100, 6
    costs = [((i * 7919) % 997) / 100 for i in range(n)]
    comm = [((i * 104729) % 613) / 100 for i in range(n - 1)]
    problem = PartitionProblem.build(costs, p, comm=comm)
    best = solve_dp(problem).bottleneck
    try:
        result = solve_milp(problem, time_limit_s=0.5)
    except AutosplitError as err:
        assert not isinstance(err, InfeasiblePlanError)
        assert "found no partition within time_limit_s=0.5" in str(err)
        return
    assert result.partition.bottleneck >= best - 1e-9
    if result.status == "optimal":
        assert result.gap == 0.0
        assert math.isclose(result.partition.bottleneck, best, rel_tol=1e-6)
    else:
        assert result.status == "feasible"
        assert result.gap is not None
        assert 0.0 <= result.gap < 1.0
        # the bound behind the gap is a valid lower bound: it cannot exceed the true optimum
        bound = result.partition.bottleneck * (1 - result.gap)
        assert bound <= best + 1e-6 * best


def test_cbc_bound_is_read_from_its_log(tmp_path) -> None:
    log = tmp_path / "solver.log"
    log.write_text(
        "Cbc0020I Exiting on maximum time\n"
        "Cbc0005I Partial search - best objective 86.01159 (best possible 85.317828), "
        "took 4465 iterations and 939 nodes (1.00 seconds)\n\n"
        "Result - Stopped on time limit\n\nObjective value:                86.01158958\n"
        "Lower bound:                    85.318\nGap:                            0.01\n"
    )
    cbc = _solver("cbc", None, str(log))
    assert _best_bound(pulp.LpProblem(), cbc, str(log)) == 85.317828
    log.write_text("Result - Stopped on time limit\nLower bound:   12.5\n")
    assert _best_bound(pulp.LpProblem(), cbc, str(log)) == 12.5
    log.write_text("nothing useful\n")
    assert _best_bound(pulp.LpProblem(), cbc, str(log)) is None
    assert _best_bound(pulp.LpProblem(), cbc, str(tmp_path / "missing.log")) is None
