"""The planner is exact on its own prediction: brute force over every balance and every
measured micro-batch size agrees; the GPipe closed form and the vectorised simulation equal
the event simulation."""

from __future__ import annotations

import dataclasses
import itertools
import math
import random

import numpy as np
import pytest
from synthetic import make_profile

import autosplit
from autosplit import PlanOptions
from autosplit.cost import in_flight, optimizer_factor, transfer_ms
from autosplit.errors import ScheduleUnavailableError
from autosplit.schedules import StageCosts, simulate_schedule
from autosplit.simulator import simulate
from autosplit.solve import exact
from autosplit.solve.exact import TIE_RTOL, StepProblem, solve_step, step_times
from autosplit.solve.step_bounds import pair_gain


@pytest.fixture(params=["search", "exhaustive"])
def method(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run a test with the branch and bound (no instance is small enough to be simulated
    whole), then with small instances simulated whole (the default)."""
    if request.param == "search":
        monkeypatch.setattr(exact, "_EXHAUSTIVE_MAX", 0)
    return request.param


def compositions(n: int, p: int):
    """Every balance of n blocks on p non-empty stages, in lexicographic order."""
    for cuts in itertools.combinations(range(1, n), p - 1):
        yield tuple(b - a for a, b in itertools.pairwise((0, *cuts, n)))


def stage_ranges(balance: tuple[int, ...]):
    """(first, end) block range of each stage."""
    return itertools.pairwise(itertools.accumulate(balance, initial=0))


def random_pipeline(rng: random.Random, schedule: str):
    p, m = rng.randint(1, 6), rng.randint(1, 9)
    scale = lambda: rng.choice([0.1, 1.0, 3.0])
    f = [rng.random() * scale() for _ in range(p)]
    b = [rng.random() * scale() for _ in range(p)]
    cf = [rng.random() * rng.choice([0.0, 0.5, 2.0]) for _ in range(p - 1)]
    cb = [rng.random() * rng.choice([0.0, 0.5, 2.0]) for _ in range(p - 1)]
    return f, b, m, cf, cb


def test_gpipe_step_has_a_closed_form() -> None:
    """step = Σ (f + b) + Σ transfers + (m − 1) · (max f' + max b'), 1,000 random pipelines:
    each receive is posted when its device gets to the op, so a stage's forward pays its
    incoming transfer (f'_s = f_s + cf_{s-1}) and its backward the gradient's (b'_s = b_s +
    cb_s)."""
    rng = random.Random(0)
    for _ in range(1000):
        f, b, m, cf, cb = random_pipeline(rng, "gpipe")
        f2 = [x + (cf[s - 1] if s else 0.0) for s, x in enumerate(f)]
        b2 = [x + (cb[s] if s < len(b) - 1 else 0.0) for s, x in enumerate(b)]
        closed = sum(f) + sum(b) + sum(cf) + sum(cb) + (m - 1) * (max(f2) + max(b2))
        assert simulate(f, b, m, "gpipe", cf, cb).step_ms == pytest.approx(closed, rel=1e-12)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_vectorised_simulation_equals_the_simulator(schedule: str) -> None:
    rng = random.Random(1)
    for _ in range(40):
        n, p, m = rng.randint(2, 8), rng.randint(1, 4), rng.randint(1, 7)
        p = min(p, n)
        fwd = tuple(tuple(rng.random() for _ in range(n)) for _ in range(p))
        bwd = tuple(tuple(rng.random() * 2 for _ in range(n)) for _ in range(p))
        cf = tuple(rng.random() for _ in range(n - 1))
        cb = tuple(rng.random() for _ in range(n - 1))
        act = rng.choice([0.0, rng.random()])  # the runtime's cost per action (ms)
        cores = rng.random() < 0.5  # whether the transfers cost the devices compute
        problem = StepProblem(fwd, bwd, cf, cb, m, schedule, action_ms=act,
                              transfers_on_cores=cores)
        balances = list(compositions(n, p))
        got = step_times(problem, balances)
        for bal, value in zip(balances, got):
            bounds = list(itertools.accumulate(bal, initial=0))
            stages = list(itertools.pairwise(bounds))
            want = simulate([sum(fwd[s][a:e]) + act for s, (a, e) in enumerate(stages)],
                            [sum(bwd[s][a:e]) + act for s, (a, e) in enumerate(stages)], m,
                            schedule,
                            [cf[e - 1] for e in bounds[1:-1]], [cb[e - 1] for e in bounds[1:-1]],
                            transfers_on_cores=cores)
            assert value == pytest.approx(want.step_ms, rel=1e-12)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_vectorised_simulation_equals_the_replay_of_torchs_order(schedule: str) -> None:
    """The vectorised step of every balance equals the reference, torch's own order replayed
    (:func:`autosplit.schedules.simulate_schedule`), with the runtime's cost per action and
    transfers on or off the cores."""
    rng = random.Random(2)
    for _ in range(30):
        n, p = rng.randint(2, 7), rng.randint(1, 4)
        p = min(p, n)
        m = rng.randint(p, 7) if schedule == "1f1b" else rng.randint(1, 7)  # torch: m ≥ p
        fwd = tuple(tuple(rng.random() for _ in range(n)) for _ in range(p))
        bwd = tuple(tuple(rng.random() * 2 for _ in range(n)) for _ in range(p))
        cf = tuple(rng.random() for _ in range(n - 1))
        cb = tuple(rng.random() for _ in range(n - 1))
        act = rng.choice([0.0, rng.random()])
        cores = rng.random() < 0.5
        problem = StepProblem(fwd, bwd, cf, cb, m, schedule, action_ms=act,
                              transfers_on_cores=cores)
        balances = list(compositions(n, p))
        for bal, value in zip(balances, step_times(problem, balances)):
            stages = list(stage_ranges(bal))
            ends = [e for _, e in stages[:-1]]
            costs = StageCosts([sum(fwd[s][a:e]) for s, (a, e) in enumerate(stages)],
                               [sum(bwd[s][a:e]) for s, (a, e) in enumerate(stages)],
                               comm_fwd_ms=[cf[e - 1] for e in ends],
                               comm_bwd_ms=[cb[e - 1] for e in ends],
                               action_ms=act, transfers_on_cores=cores)
            want = simulate_schedule(schedule, p, 1, m, costs).step_ms
            assert value == pytest.approx(want, rel=1e-9, abs=1e-9), (bal, m)


def brute_force(prof: autosplit.Profile, p: int, kw: dict) -> tuple[float, int, tuple[int, ...]]:
    """(step, b, balance): the smallest simulated step over every size and balance that fits,
    ties to the smallest size, then the lexicographically smallest balance; the same numbers
    as a printed plan (stage sums with fsum, transfers split evenly)."""
    speeds, caps = kw["speeds"], kw.get("memory_per_gpu")
    factor = optimizer_factor("sgd")
    found = []
    for k, b in enumerate(prof.microbatch_sizes):
        m = math.ceil(prof.batch_size / b)
        if kw["schedule"] == "1f1b" and m < p:
            continue  # torch's Schedule1F1B refuses fewer micro-batches than stages
        for bal in compositions(len(prof.blocks), p):
            bounds = list(itertools.accumulate(bal, initial=0))
            stages = list(itertools.pairwise(bounds))
            # each stage: weights and gradients, activations in flight, and m receive buffers
            # for its input (after a cut) and for its output's gradient (before one)
            if caps is not None and any(
                math.fsum(blk.param_bytes * factor + blk.saved_bytes[k]
                          * in_flight(kw["schedule"], m, p, s) for blk in prof.blocks[a:e])
                + m * ((prof.cuts[a - 1].bytes[k] if a else 0)
                       + (prof.cuts[e - 1].bytes[k] if e < len(prof.blocks) else 0))
                > caps[s] for s, (a, e) in enumerate(stages)
            ):
                continue
            fwd = [math.fsum(blk.fwd_ms[k] / speeds[s] for blk in prof.blocks[a:e])
                   for s, (a, e) in enumerate(stages)]
            total = [math.fsum((blk.fwd_ms[k] + blk.bwd_ms[k]) / speeds[s]
                               for blk in prof.blocks[a:e]) for s, (a, e) in enumerate(stages)]
            comm = [transfer_ms(prof.cuts[e - 1].bytes[k], kw["bandwidth_bytes_per_s"]) / 2
                    for e in bounds[1:-1]]
            bwd = [max(t - f, 0.0) for t, f in zip(total, fwd)]
            act = prof.action_ms_of(kw["schedule"]) if p > 1 else 0.0  # per action (ms)
            fwd, bwd = [x + act for x in fwd], [x + act for x in bwd]
            cores = prof.device.kind == "cpu"  # gloo between CPU workers: the cores copy
            update = prof.update_ms_of("sgd") or (0.0,) * len(prof.blocks)
            slowest = max(math.fsum(u / speeds[s] for u in update[a:e])
                          for s, (a, e) in enumerate(stages))  # after the last backward
            found.append((simulate(fwd, bwd, m, kw["schedule"], comm, comm,
                                   transfers_on_cores=cores).step_ms + slowest, b, bal))
    best = min(v for v, _, _ in found)
    return next(x for x in found if x[0] <= best * (1 + TIE_RTOL))


def random_case(rng: random.Random) -> tuple[autosplit.Profile, int, dict]:
    n = rng.randint(5, 8)
    p = rng.randint(2, min(5, n))
    sizes = sorted(rng.sample([1, 2, 3, 4], rng.randint(1, 2)))
    grid = lambda: rng.randint(1, 12) / 4
    prof = make_profile(
        sizes, [[grid() for _ in sizes] for _ in range(n)], batch_size=rng.choice([4, 6, 8]),
        param_bytes=[rng.randint(0, 4) * 2**20 for _ in range(n)],
        saved_bytes_per_sample=[rng.randint(0, 2) * 2**18 for _ in range(n)],
        cut_bytes_per_sample=[rng.choice([0, 10**5, 10**6]) for _ in range(n - 1)],
        forward_share=[rng.choice([0.25, 0.5, 0.75]) for _ in range(n)],
    )
    if rng.random() < 0.5:  # the runtime's cost per action, measured (ms)
        prof = dataclasses.replace(prof, action_ms=(("gpipe", rng.randint(1, 4) / 8),
                                                    ("1f1b", rng.randint(1, 4) / 8)))
    if rng.random() < 0.5:  # the optimizer's update of each block, timed (ms per step)
        prof = dataclasses.replace(prof, blocks=tuple(
            dataclasses.replace(blk, update_ms=(("sgd", rng.randint(0, 8) / 4),))
            for blk in prof.blocks))
    kw: dict = {
        "schedule": rng.choice(["gpipe", "1f1b"]),
        "speeds": [rng.choice([0.5, 1.0, 2.0]) for _ in range(p)],
        "bandwidth_bytes_per_s": 1e9,
    }
    if rng.random() < 0.4:
        kw["memory_per_gpu"] = [rng.randint(6, 40) * 2**20 for _ in range(p)]
    return prof, p, kw


def test_planner_equals_brute_force_on_random_profiles(method: str) -> None:
    """p = 2 … 5, 5–8 blocks, 1–2 sizes, transfers, speeds, memory limits, both schedules,
    with and without the runtime's cost per action and the optimizer's update."""
    rng = random.Random(2024)
    checked = 0
    while checked < 500:
        prof, p, kw = random_case(rng)
        try:
            plan = autosplit.plan(prof, gpus=p, options=PlanOptions(**kw))
        except autosplit.InfeasiblePlanError:
            continue  # brute force agrees nothing fits: checked below on the feasible ones
        except ScheduleUnavailableError:  # 1F1B: every size leaves fewer micro-batches than p
            assert kw["schedule"] == "1f1b" and all(
                math.ceil(prof.batch_size / b) < p for b in prof.microbatch_sizes)
            continue
        step, b, balance = brute_force(prof, p, kw)
        assert plan.predicted_step_ms == pytest.approx(step, rel=1e-9), (kw, plan.balance)
        assert (plan.split_size, plan.balance) == (b, balance), kw
        checked += 1


def test_search_finds_the_lexicographically_first_optimum_from_any_seed(method: str) -> None:
    rng = random.Random(7)
    for _ in range(100):
        n, p, m = rng.randint(3, 8), rng.randint(2, 4), rng.randint(1, 6)
        p = min(p, n)
        row = lambda n=n: tuple(float(rng.randint(0, 2)) for _ in range(n))
        comm = tuple(float(rng.randint(0, 2)) for _ in range(n - 1))
        problem = StepProblem((row(),) * p, (row(),) * p, comm, comm, m,
                              rng.choice(["gpipe", "1f1b"]))
        balances = list(compositions(n, p))
        steps = step_times(problem, balances)
        want = balances[int(np.flatnonzero(steps <= steps.min() * (1 + TIE_RTOL))[0])]
        for seed in (None, *rng.sample(balances, min(3, len(balances)))):
            assert solve_step(problem, seed).balance == want


def test_cutoff_and_memory_leave_nothing(method: str) -> None:
    one = ((1.0, 1.0),)
    problem = StepProblem(one * 2, one * 2, (0.0,), (0.0,), 2, "gpipe")
    assert solve_step(problem, cutoff=1.0) is None  # no balance beats 1 ms
    tight = StepProblem(one * 2, one * 2, (0.0,), (0.0,), 2, "gpipe",
                        memory=((5.0, 5.0),) * 2, capacity=(4.0, 4.0))
    assert solve_step(tight) is None


def _large_1f1b_problem() -> StepProblem:
    """120 blocks on 8 stages, 1F1B: enough branching that the search expands many nodes."""
    rng = random.Random(3)
    n, p = 120, 8
    row = tuple(rng.uniform(0.5, 2.0) for _ in range(n))
    comm = tuple(rng.uniform(0.0, 0.3) for _ in range(n - 1))
    return StepProblem((row,) * p, (tuple(2 * v for v in row),) * p, comm, comm, 16, "1f1b")


def test_a_search_stopped_by_its_time_limit_says_it_is_not_proven() -> None:
    problem = _large_1f1b_problem()
    seed = (15,) * 8
    stopped = solve_step(problem, seed, time_limit_s=0.0)
    assert stopped is not None and not stopped.proven
    assert stopped.step_ms <= float(step_times(problem, [seed])[0])  # never worse than the seed
    finished = solve_step(problem, seed)
    assert finished.proven and finished.step_ms <= stopped.step_ms


def test_the_plan_says_when_the_search_stopped_early(monkeypatch: pytest.MonkeyPatch) -> None:
    from autosplit.planner import search

    monkeypatch.setattr(search, "SEARCH_LIMIT_S", 0.0)
    prof = make_profile([4], [[1.0 + (i % 7) / 3] for i in range(120)], batch_size=64)
    plan = autosplit.plan(prof, 8, options=PlanOptions(schedule="1f1b"))
    assert "not proven optimal" in plan.solver
    monkeypatch.setattr(search, "SEARCH_LIMIT_S", 60.0)
    assert "not proven" not in autosplit.plan(prof, 2, options=PlanOptions(schedule="1f1b")).solver


def test_1f1b_step_is_at_least_the_sum_plus_the_slowest_steady_stage() -> None:
    """The search's 1F1B bound: step ≥ Σ (f + b) + Σ transfers + max_s g_s with
    g_s = (m − 1) · max(f_s, b_s) + (m − w_s) · min(f_s, b_s), w_s = min(m, p − s) (a path down
    with micro-batch 0, through stage s's ops, back up with micro-batch m − 1)."""
    rng = random.Random(5)
    tight = 0
    for _ in range(1000):
        f, b, m, cf, cb = random_pipeline(rng, "1f1b")
        p = len(f)
        g = max((m - 1) * max(f[s], b[s]) + (m - min(m, p - s)) * min(f[s], b[s])
                for s in range(p))
        bound = sum(f) + sum(b) + sum(cf) + sum(cb) + g
        step = simulate(f, b, m, "1f1b", cf, cb).step_ms
        assert bound <= step * (1 + 1e-12)
        tight += bound >= step * (1 - 1e-12)
    assert tight > 100  # the bound is often the step itself, not merely below it


def test_1f1b_step_is_at_least_the_sum_plus_any_two_device_path() -> None:
    """The search's pair bound (:func:`pair_gain`): for every s2 < s1, step ≥ Σ (f + b) +
    Σ transfers + the gain of the path through device s1's pairs and device s2's drain."""
    rng = random.Random(6)
    tight = 0
    for _ in range(1000):
        f, b, m, cf, cb = random_pipeline(rng, "1f1b")
        p = len(f)
        w = [min(m, p - s) for s in range(p)]
        gain = max((float(pair_gain(f[s1] + b[s1], m - w[s1], f[s2], b[s2], m, w[s2]))
                    for s1 in range(p) for s2 in range(s1)), default=0.0)
        bound = sum(f) + sum(b) + sum(cf) + sum(cb) + gain
        step = simulate(f, b, m, "1f1b", cf, cb).step_ms
        assert bound <= step * (1 + 1e-12)
        tight += bound >= step * (1 - 1e-12)
    assert tight > 100


def test_search_equals_brute_force_on_larger_1f1b_problems(method: str) -> None:
    """9–13 blocks, p = 3 … 6, m up to 12, per-device times, transfers and memory limits:
    deep enough that every bound of the search prunes."""
    rng = random.Random(11)
    for _ in range(60):
        n, p, m = rng.randint(9, 13), rng.randint(3, 6), rng.randint(1, 12)
        speed = [rng.choice([0.5, 1.0, 2.0]) for _ in range(p)]
        base = [rng.uniform(0.2, 2.0) for _ in range(n)]
        share = [rng.uniform(0.2, 0.6) for _ in range(n)]
        fwd = tuple(tuple(c * a / v for c, a in zip(base, share)) for v in speed)
        bwd = tuple(tuple(c * (1 - a) / v for c, a in zip(base, share)) for v in speed)
        comm = tuple(rng.uniform(0.0, 0.5) * rng.choice([0, 1]) for _ in range(n - 1))
        memory = capacity = None
        if rng.random() < 0.3:
            memory = (tuple(float(rng.randint(1, 4)) for _ in range(n)),) * p
            capacity = tuple(float(rng.randint(n // p + 2, n)) for _ in range(p))
        problem = StepProblem(fwd, bwd, comm, comm, m, "1f1b", memory=memory,
                              capacity=capacity)
        balances = [bal for bal in compositions(n, p) if capacity is None or all(
            sum(memory[s][a:e]) <= capacity[s] for s, (a, e) in enumerate(stage_ranges(bal)))]
        found = solve_step(problem, balances[len(balances) // 2] if balances else None)
        if not balances:
            assert found is None
            continue
        steps = step_times(problem, balances)
        want = balances[int(np.flatnonzero(steps <= steps.min() * (1 + TIE_RTOL))[0])]
        assert found is not None and found.balance == want


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_search_with_a_cost_per_action_equals_brute_force(method: str, schedule: str) -> None:
    """The runtime's cost per action lengthens every stage's forward and backward; the
    search's bounds of the unfixed stages leave it out and stay exact."""
    rng = random.Random(12)
    for _ in range(40):
        n, p, m = rng.randint(7, 11), rng.randint(2, 5), rng.randint(1, 10)
        fwd = tuple(tuple(rng.uniform(0.1, 2.0) for _ in range(n)) for _ in range(p))
        bwd = tuple(tuple(rng.uniform(0.1, 3.0) for _ in range(n)) for _ in range(p))
        comm = tuple(rng.uniform(0.0, 0.5) * rng.choice([0, 1]) for _ in range(n - 1))
        act = rng.choice([0.05, 0.5, 3.0])  # from negligible to larger than a block
        problem = StepProblem(fwd, bwd, comm, comm, m, schedule, action_ms=act)
        balances = list(compositions(n, p))
        steps = step_times(problem, balances)
        want = balances[int(np.flatnonzero(steps <= steps.min() * (1 + TIE_RTOL))[0])]
        found = solve_step(problem, balances[rng.randrange(len(balances))])
        assert found is not None and found.balance == want
        assert found.step_ms == pytest.approx(float(steps.min()), rel=1e-9)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_search_with_an_update_equals_the_simulator_plus_the_slowest_update(
        method: str, schedule: str) -> None:
    """Every stage updates its parameters after the last backward: the objective is the event
    simulation plus the slowest stage's update (the oracle here: :func:`simulate` of every
    balance, independent of the vectorised form); the search's bounds leave it out."""
    rng = random.Random(31)
    for _ in range(40):
        n, p, m = rng.randint(6, 10), rng.randint(2, 4), rng.randint(1, 8)
        fwd = tuple(tuple(rng.uniform(0.1, 2.0) for _ in range(n)) for _ in range(p))
        bwd = tuple(tuple(rng.uniform(0.1, 3.0) for _ in range(n)) for _ in range(p))
        comm = tuple(rng.uniform(0.0, 0.5) * rng.choice([0, 1]) for _ in range(n - 1))
        # from negligible to an update that outweighs the blocks' compute
        update = tuple(tuple(rng.uniform(0.0, 1.0) * rng.choice([0.1, 1.0, 10.0])
                             for _ in range(n)) for _ in range(p))
        problem = StepProblem(fwd, bwd, comm, comm, m, schedule, update=update)
        found = solve_step(problem)
        oracle = []
        for bal in compositions(n, p):
            stages = list(stage_ranges(bal))
            f = [math.fsum(fwd[s][a:e]) for s, (a, e) in enumerate(stages)]
            b = [math.fsum(bwd[s][a:e]) for s, (a, e) in enumerate(stages)]
            cuts = [comm[e - 1] for _, e in stages[:-1]]
            slowest = max(math.fsum(update[s][a:e]) for s, (a, e) in enumerate(stages))
            oracle.append((simulate(f, b, m, schedule, cuts, cuts).step_ms + slowest, bal))
        best = min(v for v, _ in oracle)
        want = next(bal for v, bal in oracle if v <= best * (1 + TIE_RTOL))
        assert found is not None and found.balance == want
        assert found.step_ms == pytest.approx(best, rel=1e-9)


def test_a_bad_update_table_is_named() -> None:
    one = ((1.0, 1.0),)
    with pytest.raises(autosplit.InvalidInputError, match="update"):
        StepProblem(one * 2, one * 2, (0.0,), (0.0,), 2, "gpipe", update=((1.0,),) * 2)


def test_a_bad_cost_per_action_is_named() -> None:
    one = ((1.0, 1.0),)
    with pytest.raises(autosplit.InvalidInputError, match="action_ms"):
        StepProblem(one * 2, one * 2, (0.0,), (0.0,), 2, "gpipe", action_ms=-1.0)
