"""schedule="auto": schedule, v, cuts, micro-batch size and recomputation searched together."""

from __future__ import annotations

import dataclasses
import itertools
import json
import random
from pathlib import Path

import pytest
from synthetic import format_1, make_profile

import autosplit
from autosplit import PlanOptions
from autosplit.cli import main
from autosplit.errors import InvalidInputError, ScheduleUnavailableError
from autosplit.planner.schedules import plan_schedules
from autosplit.planner.search import candidate_sizes, fixed_planner
from autosplit.planner.settings import PlanSettings
from autosplit.records import Plan, Profile
from autosplit.schedules import replay, torch_order
from autosplit.simulator import simulate_plan
from autosplit.solve.joint import JointProblem, brute_force_joint, solve_joint, stage_costs
from autosplit.solve.joint_problem import first_weight_pass, rank_static_bytes, rank_update_ms

ROOT = Path(__file__).resolve().parents[1]
PAIRS = [("gpipe", 1), ("1f1b", 1), ("looped-bfs", 2), ("interleaved-1f1b", 2),
         ("interleaved-zb", 2), ("zbv", 2), ("dualpipev", 2)]


def _random_problem(rng: random.Random, n: int, m: int, capacity: float | None) -> JointProblem:
    def row(low: float, high: float, k: int = n) -> tuple[float, ...]:
        return tuple(rng.uniform(low, high) for _ in range(k))

    grad_in, grad_w = row(0.1, 3), row(0.1, 3)
    cut = row(0, 30, n - 1) if rng.random() < 0.7 else None
    # a tied weight's static bytes and gradient, counted in every block that uses it
    shared = ((tuple(sorted(rng.sample(range(n), rng.randint(2, min(3, n))))),
               rng.uniform(0, 40), rng.uniform(0, 20)),) if rng.random() < 0.5 else ()
    grads = None if rng.random() < 0.5 else tuple(
        g + sum(w[2] for w in shared if i in w[0]) for i, g in enumerate(row(0, 30)))
    return JointProblem(
        # the backward in one pass (a B action) costs up to a quarter less than the two
        fwd_ms=row(0.1, 3), bwd_ms=tuple((a + b) * rng.uniform(0.75, 1.0)
                                         for a, b in zip(grad_in, grad_w)),
        input_grad_ms=grad_in, weight_grad_ms=grad_w, saved_bytes=row(1, 100),
        input_bytes=row(1, 20), static_bytes=row(1, 50),
        comm_fwd_ms=row(0, 0.5, n - 1), comm_bwd_ms=row(0, 0.5, n - 1), m=m,
        capacity_bytes=None if capacity is None else (capacity, capacity),
        split_held_bytes=row(1, 150) if rng.random() < 0.7 else None,
        cut_bytes=cut, output_saved_bytes=None if cut is None or rng.random() < 0.3 else tuple(
            rng.uniform(0, 1.2) * c for c in cut),
        final_output_bytes=rng.uniform(0, 20), transient_bytes=row(0, 80)
        if rng.random() < 0.7 else None,
        grad_bytes=grads, shared=shared,
        # each block's optimizer update after the last backward, up to several blocks' compute
        update_ms=row(0, 6) if rng.random() < 0.5 else None,
    )


@pytest.mark.parametrize("schedule,v", PAIRS)
def test_search_equals_brute_force_on_random_instances(schedule: str, v: int) -> None:
    rng = random.Random(f"{schedule}-{v}")
    checked = 0
    for _ in range(8):
        # DualPipeV needs at least as many micro-batches as stages
        n, m = rng.randint(2 * v, 6), rng.choice([4, 6] if schedule == "dualpipev" else [2, 4])
        try:
            order = torch_order(schedule, 2, v, m)
        except ScheduleUnavailableError:
            continue
        problem = _random_problem(rng, n, m, rng.choice([None, rng.uniform(150, 900)]))
        checkpointing = rng.random() < 0.7
        # the ranks' cores copying the transfers (gloo between CPU workers), with long ones
        problem = dataclasses.replace(problem, transfers_on_cores=True, comm_fwd_ms=tuple(
            4 * c for c in problem.comm_fwd_ms)) if rng.random() < 0.5 else problem
        found = solve_joint(problem, order, checkpointing)
        oracle = brute_force_joint(problem, order, checkpointing)
        assert (found is None) == (oracle is None)
        if found is not None and oracle is not None:
            checked += 1
            assert found.step_ms == pytest.approx(oracle.step_ms, rel=1e-9)
            assert (found.balance, found.checkpoint) == (oracle.balance, oracle.checkpoint)
            assert found.memory_bytes == pytest.approx(oracle.memory_bytes)
    assert checked >= 3


@pytest.mark.parametrize("schedule", ["dualpipev", "zbv", "interleaved-zb"])
def test_a_whole_backward_costs_one_pass_in_the_search_and_the_replay(schedule: str) -> None:
    """DualPipeV runs most backwards whole (B), the other zero-bubble schedules none: a B
    action costs the one pass, cheaper than the input and weight passes, in the replay and in
    the search, which stays the brute force's optimum."""
    rng = random.Random(f"whole-{schedule}")
    for _ in range(25):
        n, m = rng.randint(4, 7), rng.choice([4, 6])
        order = torch_order(schedule, 2, 2, m)
        base = _random_problem(rng, n, m, None)
        problem = dataclasses.replace(base, bwd_ms=tuple(  # one pass: 30 … 100 % of two
            rng.uniform(0.3, 1.0) * (a + b)
            for a, b in zip(base.input_grad_ms, base.weight_grad_ms)))  # type: ignore[arg-type]
        found, oracle = solve_joint(problem, order), brute_force_joint(problem, order)
        assert found is not None and oracle is not None
        assert found.step_ms == pytest.approx(oracle.step_ms, rel=1e-9)
        assert found.balance == oracle.balance
        costs = stage_costs(problem, found.balance, (False,) * order.n, order)
        whole = [sum(problem.bwd_ms[a:b]) for a, b in itertools.pairwise(
            (0, *itertools.accumulate(found.balance)))]
        assert [costs.duration_ms("B", s) for s in range(order.n)] == pytest.approx(whole)
        two = dataclasses.replace(costs, bwd_whole_ms=None)  # B as the two passes
        longer = replay(order, two).step_ms
        kinds = {a.kind for row in order.actions for a in row}
        assert (longer > replay(order, costs).step_ms) == ("B" in kinds)


def test_the_search_waits_for_sends_where_torch_posts_them() -> None:
    """DualPipeV posts an overlapped forward's send after the pair's backward: the search
    times it there, as the replay does, and stays the brute force's optimum; with every send
    posted when its action ends the step would differ."""
    rng = random.Random("late-sends")
    differ = 0
    for _ in range(12):
        n, m = rng.randint(4, 6), rng.choice([4, 6])
        order = torch_order("dualpipev", 2, 2, m)
        problem = dataclasses.replace(_random_problem(rng, n, m, None),
                                      comm_fwd_ms=tuple(rng.uniform(0.5, 3) for _ in range(n - 1)))
        found, oracle = solve_joint(problem, order), brute_force_joint(problem, order)
        assert found is not None and oracle is not None
        assert found.step_ms == pytest.approx(oracle.step_ms, rel=1e-9)
        assert found.balance == oracle.balance
        costs = stage_costs(problem, found.balance, (False,) * order.n, order)
        update = rank_update_ms(problem, found.balance, order.stage_rank, order.p)
        assert replay(order, costs).step_ms + update == pytest.approx(found.step_ms, rel=1e-9)
        early = replay(dataclasses.replace(order, sends=()), costs).step_ms
        assert early <= found.step_ms + 1e-9
        differ += early < found.step_ms - 1e-9
    assert differ > 0


@pytest.mark.parametrize("schedule,v,p", [("gpipe", 1, 3), ("1f1b", 1, 4), ("looped-bfs", 3, 2),
                                            ("interleaved-1f1b", 3, 2), ("zbv", 2, 2)])
def test_search_equals_brute_force_where_checkpointing_decides(schedule: str, v: int,
                                                               p: int) -> None:
    """Memory limits just below what the stages need without recomputation, on more ranks and
    more stages per rank: what fits is weighed per rank and pattern of checkpointed stages,
    and only each rank's smallest fitting patterns are replayed."""
    rng = random.Random(f"decides-{schedule}-{v}-{p}")
    checkpointed = 0
    for _ in range(6):
        n, m = rng.randint(p * v, p * v + 1), rng.choice([4, 6])  # 1F1B: m ≥ p
        order = torch_order(schedule, p, v, m)
        problem = _random_problem(rng, n, m, None)
        loose = brute_force_joint(problem, order)
        assert loose is not None
        cap = max(loose.memory_bytes) * rng.uniform(0.6, 1.0)
        problem = dataclasses.replace(problem, capacity_bytes=(cap,) * p,
                                      action_ms=rng.uniform(0, 0.5))
        checkpointing = order.splits_backward is False
        found = solve_joint(problem, order, checkpointing)
        oracle = brute_force_joint(problem, order, checkpointing)
        assert (found is None) == (oracle is None)
        if found is not None and oracle is not None:
            assert found.step_ms == pytest.approx(oracle.step_ms, rel=1e-9)
            assert (found.balance, found.checkpoint) == (oracle.balance, oracle.checkpoint)
            checkpointed += any(found.checkpoint)
    if schedule != "zbv":
        assert checkpointed >= 1


def _split(profile: Profile, weight_share: float = 0.5) -> Profile:
    """The profile with a measured-looking input/weight split and checkpoint bytes."""
    blocks = tuple(dataclasses.replace(
        b, input_grad_ms=tuple(x * (1 - weight_share) for x in b.bwd_ms),
        weight_grad_ms=tuple(x * weight_share for x in b.bwd_ms), recompute_ms=b.fwd_ms,
        checkpoint_saved_bytes=tuple(1 for _ in b.bwd_ms)) for b in profile.blocks)
    return dataclasses.replace(profile, blocks=blocks)


def _choose(profile: Profile, **kwargs: object):
    settings = PlanSettings.check(profile, 2, PlanOptions(**kwargs))  # type: ignore[arg-type]
    return plan_schedules(settings, profile, candidate_sizes(profile, None,
                                                             settings.batch_size, "the batch"))


def _steps(choice) -> dict[str, float]:
    return {o.schedule: o.plan.predicted_step_ms for o in choice.options if o.plan}


EVEN = [[1.0] * 3] * 8  # 8 equal blocks, 1 ms per sample at every size


def test_zero_bubble_wins_on_even_blocks() -> None:
    choice = _choose(_split(make_profile([1, 2, 4], EVEN, batch_size=8,
                                         saved_bytes_per_sample=[100] * 8)))
    steps = _steps(choice)
    # 8 samples × 8 ms per sample of work over 2 ranks is 32 ms; GPipe/1F1B bubble it to 36
    assert steps["gpipe"] == pytest.approx(36.0) and steps["1f1b"] == pytest.approx(36.0)
    assert choice.best.schedule in ("interleaved-zb", "zbv")
    assert choice.best.predicted_step_ms == pytest.approx(min(steps.values()))
    assert choice.best.predicted_step_ms < steps["interleaved-1f1b"] < steps["gpipe"]
    assert choice.best.stages_per_rank == 2 and len(choice.best.stages) == 4
    assert simulate_plan(choice.best).step_ms == pytest.approx(choice.best.predicted_step_ms)


def test_recomputation_is_chosen_when_memory_is_short() -> None:
    profile = _split(make_profile([1, 2, 4], EVEN, batch_size=8,
                                  saved_bytes_per_sample=[100] * 8))
    free = _choose(profile)
    assert not any(s.checkpoint for s in free.best.stages)
    short = _choose(profile, memory_per_gpu=500)
    assert any(s.checkpoint for s in short.best.stages)
    assert max(s.memory_bytes for s in short.best.stages) <= 500
    assert short.best.predicted_step_ms > free.best.predicted_step_ms
    assert simulate_plan(short.best).step_ms == pytest.approx(short.best.predicted_step_ms)


def test_gpipe_wins_when_the_micro_batch_must_stay_whole() -> None:
    # b = 1 costs 10 ms per sample, b = 2 1 ms: one micro-batch, where only the cuts' transfers
    # differ: one cut between ranks for GPipe, three for the interleaved schedules
    profile = _split(make_profile([1, 2], [[10.0, 1.0]] * 6, batch_size=2,
                                  saved_bytes_per_sample=[100] * 6,
                                  cut_bytes_per_sample=[10**6] * 5))
    choice = _choose(profile, bandwidth_bytes_per_s=1e9)
    assert choice.best.schedule == "gpipe" and choice.best.split_size == 2
    assert all(step > choice.best.predicted_step_ms for name, step in _steps(choice).items()
               if name != "gpipe")


def test_zero_bubble_is_not_offered_without_the_backward_split() -> None:
    choice = _choose(make_profile([1, 2, 4], EVEN, batch_size=8))
    whys = {o.schedule: o.why for o in choice.options}
    assert "no input/weight split" in whys["zbv"] and "no input/weight split" in whys[
        "interleaved-zb"]
    assert whys["gpipe"] == "" and whys["interleaved-1f1b"] == ""


def test_library_plan_auto_and_fixed_schedules(tmp_path: Path) -> None:
    profile = _split(make_profile([1, 2, 4], EVEN, batch_size=8,
                                  saved_bytes_per_sample=[100] * 8))
    best = autosplit.plan(profile, 2, options=PlanOptions(schedule="auto"))
    assert best.schedule in ("interleaved-zb", "zbv")
    fixed = autosplit.plan(profile, 2, options=PlanOptions(schedule="interleaved-1f1b"))
    assert fixed.schedule == "interleaved-1f1b" and fixed.stages_per_rank == 2
    assert fixed.predicted_step_ms >= best.predicted_step_ms
    best.save(tmp_path / "plan.json")
    assert Plan.load(tmp_path / "plan.json") == best
    assert sum(s.weight_grad_ms for s in best.stages) > 0  # the split backward is recorded


def test_old_plan_files_load(tmp_path: Path) -> None:
    profile = make_profile([1, 2], [[1.0, 1.0]] * 4, batch_size=4)
    plan = autosplit.plan(profile, 2, options=PlanOptions(schedule="gpipe"))
    path = tmp_path / "plan.json"
    plan.save(path)
    data = format_1(json.loads(path.read_text()))
    data.pop("stages_per_rank", None)
    for stage in data["stages"]:
        stage.pop("weight_grad_ms", None)
        stage.pop("checkpoint", None)
    path.write_text(json.dumps(data))
    loaded = Plan.load(path)
    assert loaded == plan
    assert all(s.weight_grad_ms == 0.0 and not s.checkpoint for s in loaded.stages)


DEEP = """
import torch
from torch import nn

def build_model():
    return nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(6)])

def example_inputs(batch_size=8):
    return torch.randn(batch_size, 8)
"""


def test_cli_prints_the_schedule_table(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    model, out = tmp_path / "deep.py", tmp_path / "plan.json"
    model.write_text(DEEP)
    code = main(["plan", str(model), "--gpus", "2", "--microbatch-sizes", "2,4", "--repeats",
                 "1", "--no-verify", "--pipeline-only", "-o", str(out)])
    text, err = capsys.readouterr()
    assert code == 0, err
    for name in ("gpipe", "1f1b", "interleaved-1f1b", "interleaved-zb", "zbv"):
        assert name in text
    assert "chosen" in text and "schedule " in text
    plan = Plan.load(out)
    assert plan.schedule in {name for name, _ in PAIRS}
    assert f"schedule {plan.schedule}" in text


def test_cli_bad_schedule_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    code = main(["plan", str(ROOT / "examples" / "toy.py"), "--gpus", "2",
                 "--schedule", "zigzag"])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1 and "zigzag" in err


def test_the_cli_offers_every_searched_schedule() -> None:
    from autosplit.cli.parser import PLAN_SCHEDULES
    from autosplit.schedules import SEARCHED

    assert PLAN_SCHEDULES == ("auto", *dict.fromkeys(name for name, _ in SEARCHED))


def test_a_cut_between_ranks_costs_m_receive_buffers_on_each_side() -> None:
    # 2 blocks on 2 ranks, GPipe, m = 2: rank 0 keeps its weights (100), 2 micro-batches of
    # activations (2 × 10), their outputs in its stage's cache until their backwards (2 × 7)
    # and 2 buffers for the gradients coming back (2 × 7); rank 1 its weights (200), 2 × 20
    # and 2 buffers for the activations coming in (2 × 7)
    def problem(cut_bytes: tuple[float, ...] | None) -> JointProblem:
        return JointProblem(
            fwd_ms=(1.0, 1.0), bwd_ms=(2.0, 2.0), input_grad_ms=None, weight_grad_ms=None,
            saved_bytes=(10.0, 20.0), input_bytes=None,
            static_bytes=(100.0, 200.0), comm_fwd_ms=(0.0,), comm_bwd_ms=(0.0,), m=2,
            cut_bytes=cut_bytes)

    order = torch_order("gpipe", 2, 1, 2)
    with_buffers = solve_joint(problem((7.0,)), order)
    assert with_buffers is not None and with_buffers.memory_bytes == (148.0, 254.0)
    assert brute_force_joint(problem((7.0,)), order).memory_bytes == (148.0, 254.0)
    without = solve_joint(problem(None), order)
    assert without is not None and without.memory_bytes == (120.0, 240.0)


def test_a_cut_inside_a_rank_keeps_its_buffers_too() -> None:
    # ZB-V on 2 ranks: stages 0 and 3 on rank 0, 1 and 2 on rank 1. Torch hands stage 1's
    # output to stage 2 (and the gradient back) by reference and keeps the last ones per
    # micro-batch until the next step, as it keeps receive buffers at a cut between ranks
    order = torch_order("zbv", 2, 2, 2)
    assert order.stage_rank == (0, 1, 1, 0)
    problem = JointProblem(
        fwd_ms=(1.0,) * 4, bwd_ms=(2.0,) * 4, input_grad_ms=(1.0,) * 4,
        weight_grad_ms=(1.0,) * 4, saved_bytes=(10.0,) * 4, input_bytes=None,
        static_bytes=(1.0, 2.0, 4.0, 8.0), comm_fwd_ms=(0.0,) * 3, comm_bwd_ms=(0.0,) * 3,
        m=2, cut_bytes=(3.0, 5.0, 7.0))
    # cut 0: gradients on rank 0, activations on rank 1; cut 1: both on rank 1; cut 2:
    # gradients on rank 1, activations on rank 0 — m = 2 buffers each
    assert rank_static_bytes(problem, (1, 1, 1, 1), order.stage_rank, 2) == [
        1 + 8 + 2 * 3 + 2 * 7, 2 + 4 + 2 * 3 + 2 * 5 + 2 * 5 + 2 * 7]
    found = solve_joint(problem, order)
    assert found is not None
    assert found.memory_bytes == brute_force_joint(problem, order).memory_bytes


def test_a_weight_shared_by_stages_of_one_rank_is_held_once_there() -> None:
    # ZB-V on 2 ranks: a weight used by blocks 0 and 3 (a tied embedding and output layer)
    # is on stages 0 and 3, both on rank 0: one copy there; on 1F1B, one copy per rank
    order = torch_order("zbv", 2, 2, 2)
    problem = JointProblem(
        fwd_ms=(1.0,) * 4, bwd_ms=(2.0,) * 4, input_grad_ms=(1.0,) * 4,
        weight_grad_ms=(1.0,) * 4, saved_bytes=(10.0,) * 4, input_bytes=None,
        static_bytes=(1.0, 2.0, 4.0, 8.0), comm_fwd_ms=(0.0,) * 3, comm_bwd_ms=(0.0,) * 3,
        m=2, grad_bytes=(3.0, 3.0, 3.0, 3.0), shared=(((0, 3), 0.5, 0.25),))
    assert rank_static_bytes(problem, (1, 1, 1, 1), order.stage_rank, 2) == [1 + 8 - 0.5, 2 + 4]
    assert rank_static_bytes(problem, (2, 2), (0, 1), 2) == [1 + 2, 4 + 8]
    assert rank_static_bytes(problem, (4,), (0,), 1) == [15 - 0.5]
    # the gradient: allocated by stage 3's weight pass (the backward starts at the last
    # stage), which stage 0's adds into
    first = first_weight_pass(order)
    assert first[3] < first[0]
    costs = stage_costs(problem, (1, 1, 1, 1), (False,) * 4, order)
    assert costs.grad_bytes == (3.0 - 0.25, 3.0, 3.0, 3.0)
    one_f_one_b = torch_order("1f1b", 2, 1, 2)
    assert stage_costs(problem, (2, 2), (False,) * 2, one_f_one_b).grad_bytes == (6.0, 6.0)
    found = solve_joint(problem, order)
    assert found is not None
    assert found.memory_bytes == brute_force_joint(problem, order).memory_bytes
    for bad in ((((0, 4), 1.0, 1.0),), (((0, 3), 1.0),), (((0, 3), 1.0, -1.0),)):
        with pytest.raises(InvalidInputError, match="shared"):
            dataclasses.replace(problem, shared=bad)


@pytest.mark.parametrize("schedule,v", [("gpipe", 1), ("zbv", 2), ("dualpipev", 2)])
def test_memory_limits_that_bind_without_cut_bytes(schedule: str, v: int) -> None:
    """Without ``cut_bytes`` no stage but the last has an output to keep (the replay's
    view); the search counted the model's output on every stage, refusing plans that fit
    (DualPipeV: 1 of 71 random instances was not the optimum) and under-stating each
    backward's brief need. Each capacity here is exactly one balance's replayed memory."""
    rng = random.Random(f"binding-{schedule}")
    compared = 0
    for _ in range(6):
        n, m = rng.randint(2 * v, 2 * v + 2), 4
        order = torch_order(schedule, 2, v, m)
        base = dataclasses.replace(_random_problem(rng, n, m, None), cut_bytes=None,
                                   output_saved_bytes=None)
        for cuts in itertools.combinations(range(1, n), 2 * v - 1):
            edges = (0, *cuts, n)
            balance = tuple(b - a for a, b in itertools.pairwise(edges))
            static = rank_static_bytes(base, balance, order.stage_rank, 2)
            peaks = replay(order, stage_costs(base, balance, (False,) * order.n, order)).peak_bytes
            cap = max(a + b for a, b in zip(static, peaks))
            problem = dataclasses.replace(base, capacity_bytes=(cap, cap))
            found, oracle = solve_joint(problem, order), brute_force_joint(problem, order)
            assert found is not None and oracle is not None  # that balance fits
            assert (found.balance, found.step_ms) == (oracle.balance, pytest.approx(oracle.step_ms))
            assert found.memory_bytes == pytest.approx(oracle.memory_bytes)
            compared += 1
    assert compared >= 8


def test_split_backward_schedules_are_planned_without_recomputation() -> None:
    # torch's weight pass would run a checkpointed stage's forward once per parameter group
    from autosplit.planner.schedules import NO_RECOMPUTE

    profile = _split(make_profile([1, 2, 4], EVEN, batch_size=8,
                                  saved_bytes_per_sample=[100] * 8))
    short = _choose(profile, memory_per_gpu=500)
    for option in short.options:
        if option.schedule in ("interleaved-zb", "zbv"):
            assert option.why.endswith(NO_RECOMPUTE)
            assert option.plan is None or not any(s.checkpoint for s in option.plan.stages)
        elif option.plan is not None:
            assert option.why == ""
    assert any(s.checkpoint for s in short.best.stages) and short.best.schedule not in (
        "interleaved-zb", "zbv")



def test_the_first_stage_runs_its_backward_whole_in_the_weight_pass() -> None:
    # torch's first stage has no input gradient to compute: its input pass does nothing and
    # its weight pass is the whole backward (2 + 2 ms, not the split parts' 2.5 + 2.5), with
    # nothing held in place of its activations in between
    problem = JointProblem(
        fwd_ms=(1.0,) * 5, bwd_ms=(2.0,) * 5, input_grad_ms=(0.0, 1.5, 1.5, 1.5, 1.5),
        weight_grad_ms=(2.5, 1.0, 1.0, 1.0, 1.0), saved_bytes=(10.0,) * 5, input_bytes=None,
        static_bytes=(0.0,) * 5, comm_fwd_ms=(0.0,) * 4, comm_bwd_ms=(0.0,) * 4, m=2,
        split_held_bytes=(30.0,) * 5)
    costs = stage_costs(problem, (2, 1, 1, 1), (False,) * 4, torch_order("zbv", 2, 2, 2))
    assert costs.bwd_input_ms == (0.0, 1.5, 1.5, 1.5)
    assert costs.bwd_weight_ms == (4.0, 1.0, 1.0, 1.0)
    assert costs.split_held_bytes == (20.0, 30.0, 30.0, 30.0)
    assert solve_joint(problem, torch_order("zbv", 2, 2, 2)) == brute_force_joint(
        problem, torch_order("zbv", 2, 2, 2))


def test_too_many_cuts_are_not_enumerated_and_gpipe_falls_back_on_its_exact_search(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Cuts beyond the joint search's enumeration: that (schedule, v) says why; GPipe and 1F1B
    on one stage per rank are planned by their own exact search, as schedule="gpipe" plans."""
    from autosplit.planner import schedules

    monkeypatch.setattr(schedules, "MAX_BALANCES", 10)  # 8 blocks: C(7, 3) = 35 > 10 ≥ C(7, 1)
    profile = make_profile([1, 2, 4], [[1.0, 0.9, 0.8], [2.0, 1.5, 1.2]] * 4, batch_size=8,
                           saved_bytes_per_sample=[100] * 8)
    assert "35 ways to cut 8 blocks into 4 stages" in schedules.too_many_cuts(8, 4)
    assert schedules.too_many_cuts(8, 2) == ""
    two = _choose(profile)  # 2 ranks: v = 1 enumerates 7 cuts, v = 2 would need 35
    why = {o.schedule: o.why for o in two.options if o.plan is None}
    assert "35 ways to cut 8 blocks into 4 stages" in why["interleaved-1f1b"]
    assert two.best.schedule in ("gpipe", "1f1b") and two.best.stages_per_rank == 1
    settings = PlanSettings.check(profile, 4,
                                  options=PlanOptions(schedule="auto"))  # 4 ranks: C(7, 3) at v = 1
    sizes = candidate_sizes(profile, None, 8, "the batch")
    four = plan_schedules(settings, profile, sizes, (("gpipe", 1), ("1f1b", 1)),
                          fixed=fixed_planner(settings, profile, sizes))
    for option in four.options:
        alone = autosplit.plan(profile, 4, options=PlanOptions(schedule=option.schedule))
        assert option.plan is not None and option.why == ""  # no recomputation to search
        assert (option.plan.balance, option.plan.split_size) == (alone.balance, alone.split_size)
        assert option.plan.predicted_step_ms == pytest.approx(alone.predicted_step_ms)
    auto = autosplit.plan(profile, 4,
                          options=PlanOptions(schedule="auto"))  # v = 2: 8 stages, one way to cut
    assert auto.predicted_step_ms <= four.best.predicted_step_ms * (1 + 1e-9)
    with pytest.raises(autosplit.InvalidInputError, match="35 ways to cut"):
        plan_schedules(settings, profile, sizes, (("gpipe", 1),))  # no fallback given
    with pytest.raises(autosplit.InvalidInputError, match=r"interleaved-1f1b \(v = 2\): 35 ways"):
        autosplit.plan(profile, 2, options=PlanOptions(schedule="interleaved-1f1b"))


def test_the_tables_mark_the_chosen_plan_and_what_verification_chose_instead() -> None:
    """The schedule and layout tables show each row's best plan by block sums; the chosen
    plan's row says "chosen", and what was chosen where verification took another of its
    plans (a v = 2 plan's 4 stages are the 2-stage pipeline's layout)."""
    from io import StringIO

    from rich.console import Console

    from autosplit.planner.layouts import LayoutOption, Layouts
    from autosplit.report import _chosen_note, layout_table

    profile = make_profile([2, 4], [[1.0, 0.8]] * 6, batch_size=8)
    row = autosplit.plan(profile, 2, options=PlanOptions(schedule="interleaved-1f1b"))
    assert len(row.stages) == 4 and row.stages_per_rank == 2
    assert _chosen_note(row, row) == "chosen"
    verified = dataclasses.replace(row, verification="stages timed together")
    assert _chosen_note(row, verified) == "chosen (verified above)"
    size = 2 if row.split_size == 4 else 4
    other = dataclasses.replace(verified, split_size=size, microbatches=8 // size)
    assert _chosen_note(row, other) == f"chosen: {8 // size}×{size}, verified above"
    recut = autosplit.plan(profile, 2,
                           options=PlanOptions(schedule="gpipe"))  # 2 stages: other cuts
    moved = dataclasses.replace(recut, verification="stages timed together")
    assert "on other cuts" in _chosen_note(row, moved)

    layouts = Layouts(best=row, options=(LayoutOption(1, 2, None, 1e9),
                                         LayoutOption(2, 1, row)), devices=2)
    out = StringIO()
    Console(file=out, width=200).print(layout_table(layouts, other))
    rows = {line.split("  ")[0]: line for line in out.getvalue().splitlines()}
    assert f"chosen: {8 // size}×{size}, verified above" in rows["pipeline 2 stages"]
    assert "chosen" not in rows["data parallel ×2"]


def test_the_switch_for_transfers_on_the_cores_takes_a_bool() -> None:
    """A switch that is not True or False is refused with its name, in both problems."""
    from autosplit.errors import ArgumentTypeError
    from autosplit.solve.step_problem import StepProblem

    rows = ((1.0, 1.0), (1.0, 1.0))
    with pytest.raises(ArgumentTypeError, match="transfers_on_cores must be True or False"):
        StepProblem(rows, rows, (0.0,), (0.0,), 2, "gpipe", transfers_on_cores=1)
    problem = _random_problem(random.Random(0), 3, 2, None)
    with pytest.raises(ArgumentTypeError, match="transfers_on_cores must be True or False"):
        dataclasses.replace(problem, transfers_on_cores="yes")
