"""The pipeline runtime's cost per action: fitted through the replay, measured on 2 ranks, and
in every action of the plans that the schedule search makes and verifies."""

from __future__ import annotations

import dataclasses
import math
import random

import pytest
from synthetic import make_profile

import autosplit
from autosplit import PlanOptions, simulator
from autosplit.errors import ArgumentTypeError, InvalidInputError
from autosplit.measure.runtime_cost import (
    MEASURED,
    action_costs,
    measure_action_ms,
    measure_action_spread,
    measure_one_stage_action_ms,
)
from autosplit.measure.runtime_fit import fit_action_ms, fit_weighed_action_ms
from autosplit.planner import plan_with_balance
from autosplit.planner.schedules import plan_schedules
from autosplit.planner.search import candidate_sizes
from autosplit.planner.settings import PlanSettings
from autosplit.schedules import SPLIT_BACKWARD, StageCosts, simulate_schedule, torch_order
from autosplit.solve.joint import JointProblem, brute_force_joint, solve_joint


def test_every_action_costs_the_runtime_once() -> None:
    # GPipe, 2 stages, m = 2, F = 1, B = 2, 0.5 ms per action: rank 0 F F (0–3), rank 1 F
    # after rank 0's first (1.5–3), F (3–4.5), B (4.5–7), B (7–9.5); rank 0's backwards wait for
    # rank 1's: B (7–9.5), B (9.5–12)
    costs = StageCosts((1.0, 1.0), (2.0, 2.0), action_ms=0.5)
    timeline = simulate_schedule("gpipe", 2, 1, 2, costs)
    assert timeline.step_ms == pytest.approx(12.0)
    assert [(a.kind, a.start_ms, a.end_ms) for a in timeline.actions[1]] == [
        ("F", 1.5, 3.0), ("F", 3.0, 4.5), ("B", 4.5, 7.0), ("B", 7.0, 9.5)]


@pytest.mark.parametrize(("schedule", "v"), MEASURED)
def test_the_fitted_cost_replays_the_measured_step(schedule: str, v: int) -> None:
    o = fit_action_ms(schedule, v, 8, 30.0)
    n = 2 * v
    split = schedule in SPLIT_BACKWARD
    zero = (0.0,) * n
    costs = StageCosts(zero, zero, zero, action_ms=o)
    assert simulate_schedule(schedule, 2, v, 8, costs).step_ms == pytest.approx(30.0)
    # more actions per micro-batch (I and W), or more stages per rank: a smaller cost each
    assert o < fit_action_ms("gpipe", 1, 8, 30.0) or (not split and v == 1)


@pytest.mark.parametrize(("schedule", "v"), MEASURED)
def test_the_fitted_cost_with_stages_that_compute_replays_the_measured_step(
        schedule: str, v: int) -> None:
    rng = random.Random(3)
    n = 2 * v
    costs = StageCosts(tuple(rng.uniform(1, 3) for _ in range(n)),
                       tuple(rng.uniform(1, 3) for _ in range(n)),
                       tuple(rng.uniform(0.5, 2) for _ in range(n)), action_ms=5.0)
    bare = simulate_schedule(schedule, 2, v, 8, dataclasses.replace(costs, action_ms=0.0))
    o = fit_action_ms(schedule, v, 8, bare.step_ms + 12.0, costs=costs)
    assert o > 0.0
    with_o = simulate_schedule(schedule, 2, v, 8, dataclasses.replace(costs, action_ms=o))
    assert with_o.step_ms == pytest.approx(bare.step_ms + 12.0, abs=1e-4)
    # a step no longer than the stages' compute alone: no cost per action
    assert fit_action_ms(schedule, v, 8, bare.step_ms, costs=costs) == 0.0
    assert fit_action_ms(schedule, v, 8, bare.step_ms * 0.9, costs=costs) == 0.0


@pytest.mark.parametrize(("schedule", "v"), MEASURED)
def test_the_weighed_fit_lies_between_the_fits_alone_and_together(schedule: str, v: int) -> None:
    rng = random.Random(11)
    n = 2 * v
    alone = StageCosts(tuple(rng.uniform(1, 3) for _ in range(n)),
                       tuple(rng.uniform(1, 3) for _ in range(n)),
                       tuple(rng.uniform(0.5, 2) for _ in range(n)))
    together = StageCosts(*(tuple(1.25 * x for x in row)  # the ranks slow each other down
                            for row in (alone.fwd_ms, alone.bwd_input_ms, alone.bwd_weight_ms)))
    step = simulate_schedule(schedule, 2, v, 8, together).step_ms + 20.0
    on_alone = fit_action_ms(schedule, v, 8, step, costs=alone)
    on_together = fit_action_ms(schedule, v, 8, step, costs=together)
    weighed = fit_weighed_action_ms(schedule, v, 8, step, alone, together)
    # each stage's costs lie between alone and together, so the cost per action left does too,
    # strictly: the ranks overlap for part of the step, not all of it or none
    assert on_together < weighed < on_alone
    # the same costs alone and together: the weighing changes nothing
    assert fit_weighed_action_ms(schedule, v, 8, step, alone, alone) == pytest.approx(on_alone)


def test_a_weighed_fit_refuses_costs_of_other_stages() -> None:
    with pytest.raises(InvalidInputError, match="together"):
        fit_weighed_action_ms("gpipe", 1, 8, 30.0, StageCosts((1.0, 1.0), (1.0, 1.0)),
                              StageCosts((1.0,), (1.0,)))
    with pytest.raises(ArgumentTypeError, match="alone"):
        fit_weighed_action_ms("gpipe", 1, 8, 30.0, [1.0, 1.0],  # type: ignore[arg-type]
                              StageCosts((1.0, 1.0), (1.0, 1.0)))


def test_a_fit_refuses_costs_of_the_wrong_kind() -> None:
    with pytest.raises(ArgumentTypeError, match="costs"):
        fit_action_ms("gpipe", 1, 8, 30.0, costs=[1.0, 2.0])  # type: ignore[arg-type]


def test_the_search_with_a_cost_per_action_equals_brute_force() -> None:
    rng = random.Random(7)
    for schedule, v in MEASURED:
        n, m = 6, 4
        order = torch_order(schedule, 2, v, m)
        def row(k: int = n) -> tuple[float, ...]:
            return tuple(rng.uniform(0.1, 3) for _ in range(k))

        grad_in, grad_w = row(), row()
        problem = JointProblem(
            fwd_ms=row(), bwd_ms=tuple(a + b for a, b in zip(grad_in, grad_w)),
            input_grad_ms=grad_in, weight_grad_ms=grad_w, saved_bytes=row(), input_bytes=row(),
            static_bytes=row(), comm_fwd_ms=row()[:n - 1], comm_bwd_ms=row()[:n - 1], m=m,
            action_ms=rng.uniform(0.5, 2.0))
        ckpt = not order.splits_backward
        found, oracle = solve_joint(problem, order, ckpt), brute_force_joint(problem, order, ckpt)
        assert found is not None and oracle is not None
        assert found.step_ms == pytest.approx(oracle.step_ms, rel=1e-9)
        assert (found.balance, found.checkpoint) == (oracle.balance, oracle.checkpoint)
        cheaper = solve_joint(dataclasses.replace(problem, action_ms=0.0), order, ckpt)
        assert cheaper is not None and cheaper.step_ms < found.step_ms


def test_plans_carry_the_cost_and_predict_with_it() -> None:
    prof = make_profile([2, 4], [[1.0, 1.0]] * 6, batch_size=8)
    costly = dataclasses.replace(prof, action_ms=(("gpipe", 3.0), ("1f1b", 2.0)))
    settings = PlanSettings.check(costly, 2, options=PlanOptions(schedule="auto"))
    sizes = candidate_sizes(costly, None, settings.batch_size, "the batch")
    choice = plan_schedules(settings, costly, sizes, (("gpipe", 1), ("1f1b", 1)))
    free = plan_schedules(PlanSettings.check(prof, 2,
                                             options=PlanOptions(schedule="auto")), prof, sizes,
                          (("gpipe", 1), ("1f1b", 1)))
    for option, plain in zip(choice.options, free.options):
        assert option.plan is not None and plain.plan is not None
        assert option.plan.action_ms == costly.action_ms_of(option.schedule)
        # the plan's own prediction is the simulation of the plan, with the cost in it
        assert simulator.simulate_plan(option.plan).step_ms == pytest.approx(
            option.plan.predicted_step_ms)
        assert option.plan.predicted_step_ms > plain.plan.predicted_step_ms


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_the_fixed_schedules_search_and_a_given_split_carry_the_cost(schedule: str) -> None:
    prof = make_profile([2, 4], [[1.0, 1.5], [2.0, 3.0], [0.5, 1.0], [1.0, 2.0]], batch_size=8)
    costly = dataclasses.replace(prof, action_ms=(("gpipe", 3.0), ("1f1b", 2.0)))
    a = costly.action_ms_of(schedule)
    chosen = autosplit.plan(costly, 2,
                            options=PlanOptions(schedule=schedule))  # the exact search, cost included
    given = plan_with_balance(costly, chosen.balance, chosen.split_size,
                              options=PlanOptions(schedule=schedule))
    for plan in (chosen, given):
        assert plan.action_ms == a
        f = [s.forward_ms + a for s in plan.stages]
        b = [s.compute_ms - s.forward_ms + a for s in plan.stages]
        comm = [s.send_ms / 2 for s in plan.stages[:-1]]
        want = simulator.simulate(f, b, plan.microbatches, schedule, comm, comm,
                                  transfers_on_cores=True).step_ms  # CPU workers
        assert plan.predicted_step_ms == pytest.approx(want, rel=1e-12)
    # one stage alone trains without the pipeline runtime: no cost per action (a replica of
    # one stage runs on it: tests/test_layouts.py)
    assert autosplit.plan(costly, 1, options=PlanOptions(schedule=schedule)).action_ms == 0.0


@pytest.mark.long
def test_measured_on_two_ranks(monkeypatch) -> None:
    # stages that compute, on 2 gloo ranks: the runtime's messages and bookkeeping cost some
    # time beyond the stages' own (0 only where a schedule's replay already lasted as long);
    # the suite's smaller stages (tests/conftest.py), and the fewest rounds that give each cost
    # a spread: 2 timed after 1 untimed (14 s here against 25 s with the suite's 5 after 2)
    from autosplit.measure import runtime_cost

    monkeypatch.setattr(runtime_cost, "_CACHE", {})
    monkeypatch.setattr(runtime_cost, "ROUNDS", 2)
    monkeypatch.setattr(runtime_cost, "WARMUP_ROUNDS", 1)
    measured = dict(measure_action_ms())
    assert set(measured) == {schedule for schedule, _ in MEASURED}
    assert all(0.0 <= ms < 1000.0 for ms in measured.values())
    assert any(ms > 0.0 for ms in measured.values())
    # from the same rounds (measured once per process): each cost's spread over them
    spreads = dict(measure_action_spread())
    assert set(spreads) == set(measured)
    assert all(0.0 <= s < math.inf for s in spreads.values())
    prof = dataclasses.replace(make_profile([2], [[1.0]] * 2, batch_size=4),
                               **action_costs())  # as `autosplit plan` sets them
    assert prof.action_ms == tuple(measured.items())
    assert prof.action_spread == tuple(spreads.items())


def test_only_the_schedules_asked_for_are_measured(monkeypatch) -> None:
    # a plan of one schedule needs that schedule's cost only: the others are not run (the ranks
    # faked here: test_measured_on_two_ranks runs them); each round's step of 100 ms on stages
    # that cost nothing fits 100 ms / the replay's units per action
    from autosplit import launch as launching
    from autosplit.measure import runtime_cost

    monkeypatch.setattr(runtime_cost, "_CACHE", {})
    launched: list[tuple[tuple[str, int], ...]] = []

    def fake(fn, nprocs, pairs, rounds, warmup, layers, **kwargs):
        assert fn is runtime_cost._rank and nprocs == 2
        assert (rounds, warmup, layers) == (runtime_cost.ROUNDS, runtime_cost.WARMUP_ROUNDS,
                                            runtime_cost.LAYERS)
        launched.append(tuple(pairs))
        zero = StageCosts((0.0,) * 2, (0.0,) * 2, (0.0,) * 2)
        return {0: {name: [(100.0, zero, zero), (100.0, zero, zero), (120.0, zero, zero)]
                    for name, v in pairs}}  # (step, stages alone, together) per round

    monkeypatch.setattr(launching, "launch", fake)
    costs = action_costs(schedules=("1f1b",))
    assert [name for name, _ in costs["action_ms"]] == ["1f1b"]
    assert [name for name, _ in costs["action_spread"]] == ["1f1b"]
    assert launched == [(("1f1b", 1),)]
    assert dict(costs["action_ms"])["1f1b"] == pytest.approx(
        fit_action_ms("1f1b", 1, 8, 100.0))  # the median round
    # asked again with another: only the new one runs; the first comes from the same rounds
    both = dict(measure_action_ms(schedules=("gpipe", "1f1b")))
    assert launched == [(("1f1b", 1),), (("gpipe", 1),)]
    assert list(both) == ["gpipe", "1f1b"] and both["1f1b"] == dict(costs["action_ms"])["1f1b"]
    assert dict(measure_action_ms(schedules="gpipe")) == {"gpipe": both["gpipe"]}  # one name
    assert len(launched) == 2
    runtime_cost.forget_measurements()  # then measured again, as a new process would
    assert [name for name, _ in measure_action_ms(schedules="gpipe")] == ["gpipe"]
    assert launched[2:] == [(("gpipe", 1),)]
    # a profile with some schedules measured gives the others the largest cost it has
    prof = dataclasses.replace(make_profile([2], [[1.0]] * 2, batch_size=4), **costs)
    assert prof.action_ms_of("zbv") == prof.action_ms_of("1f1b")


@pytest.mark.parametrize("bad", [("gpipe", "pipedream"), ("interleaved",)])
def test_an_unknown_schedule_is_named(bad) -> None:
    with pytest.raises(InvalidInputError, match=f"unknown schedules '{bad[-1]}'"):
        measure_action_ms(schedules=bad)


def test_the_one_stage_runtime_is_measured_on_two_ranks_at_once() -> None:
    # a plan's replicas run one stage each on torch's runtime, side by side
    ms, spread = measure_one_stage_action_ms()
    assert 0.0 <= ms < 1000.0 and 0.0 <= spread < math.inf
    assert measure_one_stage_action_ms() == (ms, spread)  # kept for the process


def test_the_one_stage_fit_takes_every_rank_s_rounds(monkeypatch) -> None:
    # the ranks faked: each round's one-stage step of m·(f + b) + 2·m·o with f = 1, b = 2 and
    # o = 0.5 ms fits o again; the median over both ranks' rounds, their spread half the IQR
    from autosplit import launch as launching
    from autosplit.measure import runtime_cost

    monkeypatch.setattr(runtime_cost, "_CACHE", {})
    costs = StageCosts((1.0,), (2.0,))
    steps = [8 * 3.0 + 16 * o for o in (0.4, 0.5, 0.5, 0.6)]

    def fake(fn, nprocs, **kwargs):
        assert fn is runtime_cost.one_stage_rounds and nprocs == 2
        return {0: [(step, costs) for step in steps], 1: None}

    monkeypatch.setattr(launching, "launch", fake)
    ms, spread = measure_one_stage_action_ms()
    assert ms == pytest.approx(0.5, abs=1e-5)
    assert spread == pytest.approx((0.525 - 0.475) / 2, abs=1e-5)  # quartiles 0.475, 0.525


@pytest.mark.parametrize("split,whole", [(False, False), (True, False), (True, True)])
def test_plain_runs_time_the_one_pass_backward_where_the_schedule_runs_it(split: bool,
                                                                         whole: bool) -> None:
    """Per stage (forward, input pass, weight pass, one pass) ms: the one pass is timed apart
    where a split schedule runs some backwards whole (DualPipeV), else it is the two passes;
    the first stage's split backward is all weight work."""
    from autosplit.measure import runtime_cost

    modules = {0: runtime_cost._stage_module(), 1: runtime_cost._stage_module()}
    got = runtime_cost._plain_times(modules, 1, split, runs=1, whole=whole)
    for s, (fwd, grad_in, grad_w, one) in got.items():
        assert fwd > 0 and one > 0
        if not split:
            assert (grad_w, one) == (0.0, grad_in)
        elif s == 0:
            assert (grad_in, one) == (0.0, grad_w)
        elif not whole:
            assert one == grad_in + grad_w
        else:
            assert grad_in > 0 and grad_w > 0 and one != grad_in + grad_w  # timed on its own
