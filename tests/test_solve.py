"""autosplit.solve.balance: exact against brute force, with and without memory limits."""

from __future__ import annotations

import itertools
import math
import subprocess
import sys
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from autosplit.errors import InfeasiblePlanError, InvalidInputError
from autosplit.solve import balance


def compositions(n: int, p: int):
    for cuts in itertools.combinations(range(1, n), p - 1):
        bounds = (0, *cuts, n)
        yield [bounds[i + 1] - bounds[i] for i in range(p)]


def stage_sums(values, bal):
    out, start = [], 0
    for c in bal:
        out.append(math.fsum(values[start:start + c]))
        start += c
    return out


def objective(costs, comm, bal):
    times, start = [], 0
    for s, c in enumerate(bal):
        t = math.fsum(costs[start:start + c])
        if s < len(bal) - 1:
            t += comm[start + c - 1]
        times.append(t)
        start += c
    return max(times)


def brute(costs, p, comm, memory=None, capacity=None):
    best = None
    for bal in compositions(len(costs), p):
        if memory is not None and max(stage_sums(memory, bal)) > capacity:
            continue
        value = objective(costs, comm, bal)
        if best is None or value < best:
            best = value
    return best


numbers = st.floats(min_value=0, max_value=100, allow_nan=False, allow_infinity=False)


@st.composite
def instances(draw):
    n = draw(st.integers(1, 8))
    p = draw(st.integers(1, n))
    costs = draw(st.lists(numbers, min_size=n, max_size=n))
    comm = draw(st.lists(numbers, min_size=n - 1, max_size=n - 1))
    memory = draw(st.lists(st.integers(0, 50), min_size=n, max_size=n))
    capacity = draw(st.integers(0, 200))
    with_memory = draw(st.booleans())
    return costs, p, comm, (memory if with_memory else None), (capacity if with_memory else None)


@settings(max_examples=300, deadline=None)
@given(instances())
def test_balance_equals_brute_force(instance) -> None:
    costs, p, comm, memory, capacity = instance
    expected = brute(costs, p, comm, memory, capacity)
    if expected is None:
        with pytest.raises(InfeasiblePlanError) as info:
            balance(costs, p, comm=comm, memory=memory, capacity=capacity)
        # the error names the smallest capacity that works, and it does work
        need = info.value.min_capacity_bytes
        assert need == min(max(stage_sums(memory, b)) for b in compositions(len(costs), p))
        assert need > capacity
        balance(costs, p, comm=comm, memory=memory, capacity=need)
        return
    bal = balance(costs, p, comm=comm, memory=memory, capacity=capacity)
    assert len(bal) == p and sum(bal) == len(costs) and min(bal) >= 1
    if memory is not None:
        assert max(stage_sums(memory, bal)) <= capacity
    assert math.isclose(objective(costs, comm, bal), expected, rel_tol=1e-9, abs_tol=1e-9)


def test_examples() -> None:
    assert balance([1, 2, 3, 4, 5], 2) == [3, 2]
    assert balance([1, 1, 1, 1], 2, comm=[0, 10, 0]) == [1, 3]  # avoid the expensive cut
    assert balance([1, 1, 1, 1], 2, memory=[5, 1, 1, 1], capacity=6) == [2, 2]
    assert balance([3, 3, 3], 3) == [1, 1, 1]


def test_infeasible_names_the_minimum_capacity() -> None:
    with pytest.raises(InfeasiblePlanError, match="stage 0") as info:
        balance([1, 1, 1], 2, memory=[10, 1, 1], capacity=5)
    assert info.value.min_capacity_bytes == 10
    assert info.value.stage == 0


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"costs": [1, 2], "parts": 0}, "parts must be a positive integer, got 0"),
        ({"costs": [1, 2], "parts": 3}, "at most 2 stages"),
        ({"costs": [], "parts": 1}, "at least one block"),
        ({"costs": [1, -2], "parts": 1}, r"costs\[1\]"),
        ({"costs": [1, 2], "parts": 1, "comm": [1, 2]}, "len\\(comm\\) == 1"),
        ({"costs": [1, 2], "parts": 1, "memory": [1, 1]}, "capacity"),
    ],
)
def test_bad_arguments(kwargs, match) -> None:
    with pytest.raises(InvalidInputError, match=match):
        balance(**kwargs)


def test_solve_imports_without_torch() -> None:
    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'torch' or name.startswith('torch.'):\n"
        "            raise ImportError('torch is blocked')\n"
        "sys.meta_path.insert(0, Block())\n"
        "from autosplit.solve import balance\n"
        "print(balance([1, 2, 3], 2))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[2, 1]"


def test_large_instance_is_fast_enough_to_use() -> None:
    # not a timing assertion: a sanity bound that catches an accidental exponential solver
    costs = [float(i % 7 + 1) for i in range(400)]
    start = time.perf_counter()
    bal = balance(costs, 8, comm=[0.5] * 399)
    assert sum(bal) == 400 and len(bal) == 8
    assert time.perf_counter() - start < 60


@st.composite
def problems_with_first_block_memory(draw):
    from autosplit.solve import PartitionProblem

    n = draw(st.integers(1, 7))
    p = draw(st.integers(1, min(n, 3)))
    rows = lambda: tuple(
        tuple(draw(st.lists(st.integers(0, 20), min_size=n, max_size=n))) for _ in range(p)
    )
    costs, memory, first = rows(), rows(), rows()
    comm = tuple(draw(st.lists(st.integers(0, 20), min_size=n - 1, max_size=n - 1)))
    capacity = tuple(draw(st.lists(st.integers(0, 120), min_size=p, max_size=p)))
    return PartitionProblem(costs, comm, memory, capacity, first)


@settings(max_examples=60, deadline=None)
@given(problems_with_first_block_memory())
def test_first_block_memory_dp_equals_brute_force_and_milp(problem) -> None:
    from autosplit.solve import evaluate, min_capacity, solve_dp, solve_milp

    scored = [evaluate(problem, b) for b in compositions(problem.n, problem.p)]
    feasible = [s for s in scored
                if all(m <= c for m, c in zip(s.stage_memory, problem.capacity))]
    smallest = min(max(s.stage_memory) for s in scored)
    assert min_capacity(problem).bottleneck == smallest
    if not feasible:
        with pytest.raises(InfeasiblePlanError):
            solve_dp(problem)
        return
    best = min(s.bottleneck for s in feasible)
    assert solve_dp(problem).bottleneck == best
    assert solve_milp(problem).partition.bottleneck == best
