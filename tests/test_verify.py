"""Claims come with their spread; stages are verified as they run, taking turns; profiles
measure sizes interleaved. No test here depends on the machine's speed: timings come from a
fake clock or are only checked to be positive."""

from __future__ import annotations

import dataclasses
import itertools
from pathlib import Path
from typing import Any

import pytest
import torch
from models import LongSkip, TiedLM
from torch import nn

import autosplit
from autosplit import PartitionOptions, PlanOptions, ProfileOptions
from autosplit.capture.trace import trace
from autosplit.cli import main
from autosplit.comparison import manual_plan
from autosplit.cost import single_device_ms, whole_update_ms
from autosplit.errors import InvalidInputError
from autosplit.measure import block_timing, contention, profiler
from autosplit.measure.spread import (
    PREDICTION_ERROR,
    half_iqr,
    ratio_with_spread,
    relative_spread,
    spread_text,
)
from autosplit.plan_text import one_device_way
from autosplit.planner import plan_candidates
from autosplit.records import Plan, Profile
from autosplit.simulator import simulate_plan
from autosplit.verify import choice, plans, stage_timing, timed_runs
from autosplit.verify.choice import RESOLVED_RATIO, steady_choice, verify_and_choose
from autosplit.verify.options import TimingOptions
from autosplit.verify.plans import SESSION_START_S, session_estimate_s, time_stages, verify_plans

# ------------------------------------------------------------------------ claims (hand numbers)


def test_a_clear_difference_reads_as_a_ratio_with_its_spread() -> None:
    claim = ratio_with_spread(150.0, 0.02, 100.0, 0.02)
    assert claim.ratio == pytest.approx(1.5)
    assert claim.low == pytest.approx(150 * 0.98 / (100 * 1.02))
    assert claim.high == pytest.approx(150 * 1.02 / (100 * 0.98))
    assert not claim.within_noise and claim.known
    assert claim.text == "×1.50 ± 0.06 faster"


def test_a_difference_inside_the_spread_is_within_noise() -> None:
    claim = ratio_with_spread(102.0, 0.03, 100.0, 0.03)
    assert claim.within_noise
    assert claim.text.startswith("within noise (×1.02")
    assert "faster" not in claim.text


def test_a_slower_plan_reads_the_other_way_round() -> None:
    claim = ratio_with_spread(100.0, 0.01, 200.0, 0.01)
    assert claim.ratio == pytest.approx(0.5)
    assert claim.text.startswith("×2.00 ± ") and claim.text.endswith(" slower")


def test_an_unknown_spread_says_it_is_not_verified() -> None:
    claim = ratio_with_spread(152.0, None, 100.0, 0.01)
    assert not claim.known and not claim.within_noise
    assert claim.low == claim.high == pytest.approx(1.52)
    assert "not verified" in claim.text


def test_a_spread_above_the_median_leaves_everything_open() -> None:
    claim = ratio_with_spread(150.0, 0.1, 100.0, 1.4)
    assert claim.within_noise and claim.high == float("inf")
    assert claim.text == "within noise (×1.50, ×0.56 … ∞)"
    claim = ratio_with_spread(300.0, 0.1, 100.0, 1.4)  # 270 / 240 at worst: still faster
    assert not claim.within_noise and claim.text == "at least ×1.12 faster"


def test_a_predicted_ratio_carries_the_prediction_error_beyond_the_spreads() -> None:
    bare = ratio_with_spread(150.0, 0.02, 100.0, 0.02)
    claim = ratio_with_spread(150.0, 0.02, 100.0, 0.02, error=0.03)
    assert claim.ratio == bare.ratio
    assert claim.low == pytest.approx(bare.low / 1.03)
    assert claim.high == pytest.approx(bare.high * 1.03)
    assert claim.text == "×1.50 ± 0.10 faster"  # ± 0.06 without
    # 4 % apart with 0.5 % spreads: told apart by the timings, not by a prediction
    assert not ratio_with_spread(104.0, 0.005, 100.0, 0.005).within_noise
    close = ratio_with_spread(104.0, 0.005, 100.0, 0.005, error=PREDICTION_ERROR)
    assert close.within_noise and close.text.startswith("within noise (×1.04")
    assert not ratio_with_spread(110.0, 0.005, 100.0, 0.005, error=PREDICTION_ERROR).within_noise


def test_the_prediction_error_does_not_apply_without_spreads() -> None:
    claim = ratio_with_spread(152.0, None, 100.0, 0.01, error=PREDICTION_ERROR)
    assert claim.low == claim.high == pytest.approx(1.52) and "not verified" in claim.text


def test_the_choice_acts_on_the_error_a_printed_ratio_allows() -> None:
    assert RESOLVED_RATIO == PREDICTION_ERROR


@pytest.mark.parametrize("error", [-0.01, float("inf"), float("nan")])
def test_claims_refuse_an_impossible_error(error: float) -> None:
    with pytest.raises(ValueError, match="error"):
        ratio_with_spread(150.0, 0.02, 100.0, 0.02, error=error)
    with pytest.raises(ValueError, match="error"):  # checked without spreads too
        ratio_with_spread(150.0, None, 100.0, 0.02, error=error)


@pytest.mark.parametrize("args", [(0.0, 0.1, 1.0, 0.1), (1.0, float("inf"), 1.0, 0.1),
                                  (1.0, -0.1, 1.0, 0.1), (float("nan"), 0.1, 1.0, 0.1)])
def test_claims_refuse_impossible_numbers(args: tuple) -> None:
    with pytest.raises(ValueError):
        ratio_with_spread(*args)


def test_relative_spread_is_half_the_interquartile_range_over_the_median() -> None:
    assert relative_spread([8.0, 9.0, 10.0, 11.0, 12.0]) == pytest.approx(2.0 / 2 / 10.0)
    assert relative_spread([5.0]) == 0.0 and relative_spread([]) == 0.0
    assert relative_spread([0.0, 0.0, 1.0]) == 0.0  # no median to be relative to
    assert half_iqr([0.0, 0.0, 1.0]) == pytest.approx(0.25)  # but a spread all the same


def test_spread_text() -> None:
    assert spread_text(None) == ""
    assert spread_text(0.034) == " ± 3%"
    assert spread_text(0.001) == " ± <1%"


# ------------------------------------------------------------------ a fake clock and a recorder

CALLS: list[int] = []


class Recorder(nn.Module):
    """Records the batch size of every call (a leaf module, so it runs, not traced through)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        CALLS.append(int(x.shape[0]))
        return x * 1.0


class Recorded(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.rec = Recorder()
        self.b = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.rec(self.a(x)))


@pytest.fixture
def fake_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every timed interval lasts exactly 1 s: the timings no longer depend on the machine."""
    ticks = itertools.count()
    monkeypatch.setattr(block_timing, "clock", lambda dev: float(next(ticks)))
    CALLS.clear()


def test_profile_sizes_take_turns_round_after_round(fake_clock: None) -> None:
    model = Recorded()
    graph = trace(model, leaf_modules=[Recorder])
    prof = profiler.profile_graph(graph, torch.randn(6, 4),
                                  options=ProfileOptions(microbatch_sizes=[2, 3, 6], warmup=1,
                                                         repeats=3, budget_s=None))
    # the whole model once (untimed, at the first size), then the recorder's block: sizes take
    # turns, the order rotating each round (warm-up round, then three timed ones, whose spread
    # is 0: no more); right after each run of the first size, 2, its backward is timed again
    # in two passes (input, then weight gradient); last, one untimed run of each size for its
    # peak memory (the model's own input needs no gradient: no split backward to hold)
    assert CALLS == [2, 2, 2, 3, 6, 3, 6, 2, 2, 6, 2, 2, 3, 2, 2, 3, 6, 2, 3, 6]
    for block in prof.blocks:
        assert block.fwd_ms == block.bwd_ms == (1000.0, 1000.0, 1000.0)
        assert block.fwd_iqr_ms == block.bwd_iqr_ms == (0.0, 0.0, 0.0)
    assert prof.backward_split == "measured at b=2"
    assert prof.blocks[1].input_grad_ms == prof.blocks[1].weight_grad_ms == (1000.0,) * 3


def test_profile_repeats_until_the_spread_is_small_or_the_cap(monkeypatch) -> None:
    noisy = itertools.cycle([1.0, 5.0, 9.0])  # a wide spread: never settles
    ticks = [0.0]

    def clock(dev: torch.device) -> float:
        ticks[0] += next(noisy) / 1000.0
        return ticks[0]

    monkeypatch.setattr(block_timing, "clock", clock)
    CALLS.clear()
    graph = trace(Recorded(), leaf_modules=[Recorder])
    profiler.profile_graph(graph, torch.randn(4, 4),
                           options=ProfileOptions(microbatch_sizes=[2, 4], warmup=0, repeats=3,
                                                  max_repeats=5, budget_s=None))
    # 5 rounds: the cap; the backward split is timed at size 2 in the first 3 (repeats) only;
    # then one untimed run per size for its peak memory
    assert CALLS[1:] == [2, 2, 4, 4, 2, 2, 2, 2, 4, 4, 2, 2, 4, 2, 4]


def test_profiles_without_spreads_still_load(tmp_path) -> None:
    prof = autosplit.profile(LongSkip(), torch.randn(4, 6),
                             options=ProfileOptions(microbatch_sizes=[2, 4], warmup=0, repeats=1))
    assert all(len(b.fwd_iqr_ms) == 2 and min(b.fwd_iqr_ms) >= 0 for b in prof.blocks)
    path = tmp_path / "p.json"
    prof.save(path)
    text = path.read_text().replace('"fwd_iqr_ms"', '"_a"').replace('"bwd_iqr_ms"', '"_b"')
    import json

    data = json.loads(text)
    for block in data["blocks"]:
        block.pop("_a"), block.pop("_b")
    path.write_text(json.dumps(data))
    assert Profile.load(path).blocks[0].fwd_iqr_ms is None


# ------------------------------------------------------------------------------ verification


@pytest.fixture(scope="module")
def small() -> tuple:
    torch.manual_seed(0)
    model = LongSkip()
    x = torch.randn(8, 6)
    prof = autosplit.profile(model, x,
                             options=ProfileOptions(microbatch_sizes=[2, 4, 8], warmup=0,
                                                    repeats=1))
    return model, x, prof


def test_stage_runs_take_turns_a_b_a_b(small, monkeypatch) -> None:
    model, x, _ = small
    order: list[tuple[int, int, int]] = []
    real = block_timing.timed_run

    with_loss: list[bool] = []

    def recording(seg, args, dev, hooks=None, loss=None):
        order.append((seg.first, seg.end, int(args[0].shape[0])))
        with_loss.append(loss is not None)
        return real(seg, args, dev, hooks, loss)

    monkeypatch.setattr(block_timing, "timed_run", recording)
    runs = [(0, 3, 4), (3, 7, 4), (0, 7, 8)]
    graph = trace(model)
    assert len(graph.blocks) == 7
    times = time_stages(graph, x, runs,
                        options=TimingOptions(warmup=1, rounds=2, max_rounds=2, loss="mse"))
    assert order == runs * 3  # one warm-up round, then two timed: A B C A B C A B C
    assert with_loss == [False, True, True] * 3  # the runs that end with the last block
    assert all(t.forward_ms > 0 and t.backward_ms > 0 and t.rounds == 2 for t in times.values())


def test_a_stage_run_in_flight_runs_every_forward_before_the_backwards() -> None:
    """d micro-batches in flight: F F F, then B B B in the same order, as a GPipe stage runs
    them; their gradients add up as d separate runs' do."""
    from autosplit.verify import stage_timing

    torch.manual_seed(0)
    model = LongSkip().eval()  # BatchNorm's statistics stay put: every run sees the same
    x = torch.randn(4, 6)
    seg = trace(model).extract(0, len(trace(model).blocks))
    log: list[str] = []
    model.out.register_forward_hook(lambda *_: log.append("F"))
    model.out.register_full_backward_hook(lambda *_: log.append("B"))
    f_ms, b_ms, _ = stage_timing._in_flight(seg, (x,), torch.device("cpu"), None, 3)
    assert log == ["F", "F", "F", "B", "B", "B"]
    assert len(f_ms) == len(b_ms) == 3 and all(t >= 0 for t in f_ms + b_ms)
    deep = [p.grad.clone() for p in seg.module.parameters()]
    seg.module.zero_grad(set_to_none=True)
    log.clear()
    for _ in range(3):
        stage_timing._in_flight(seg, (x,), torch.device("cpu"), None, 1)
    assert log == ["F", "B"] * 3
    for a, b in zip(deep, (p.grad for p in seg.module.parameters()), strict=True):
        torch.testing.assert_close(a, b)


def test_the_depth_in_flight_is_the_schedules_own() -> None:
    """GPipe keeps all m micro-batches in flight on every stage, 1F1B p − s on stage s; a stage
    whose m would take longer than the cap by block sums is timed one at a time."""
    from synthetic import make_profile

    prof = make_profile([2], [[1.0]] * 4, batch_size=8)  # m = 4 of b = 2
    gpipe = autosplit.plan(prof, 2, options=PlanOptions(schedule="gpipe"))
    assert timed_runs.depths(gpipe) == [4, 4]
    assert timed_runs.depths(autosplit.plan(prof, 2,
                                            options=PlanOptions(schedule="1f1b"))) == [2, 1]
    slow = dataclasses.replace(gpipe, stages=(dataclasses.replace(
        gpipe.stages[0], compute_ms=timed_runs.IN_FLIGHT_CAP_MS / 4 + 1), gpipe.stages[1]))
    assert timed_runs.depths(slow) == [1, 4]


def test_every_other_round_starts_without_gradients(small, monkeypatch) -> None:
    model, x, _ = small
    seen: list[tuple[int, bool]] = []  # (first block, gradients there before the run)
    real = block_timing.timed_run

    def recording(seg, args, dev, hooks=None, loss=None):
        grads = [p.grad is not None for p in seg.module.parameters()]
        assert all(grads) or not any(grads)  # all made anew, or all added into
        seen.append((seg.first, all(grads)))
        return real(seg, args, dev, hooks, loss)

    monkeypatch.setattr(block_timing, "timed_run", recording)
    runs = [(0, 3, 4), (3, 7, 4), (0, 7, 4)]  # the whole model shares the stages' weights
    times = time_stages(trace(model), x, runs,
                        options=TimingOptions(warmup=1, rounds=4, max_rounds=4))
    for k in range(5):  # A starts anew in even rounds, B in odd ones, C in even ones
        assert [added for _, added in seen[3 * k: 3 * k + 3]] == [k % 2 == 1, k % 2 == 0,
                                                                 k % 2 == 1]
    assert all(t.first_backward_ms is not None and t.rounds == 4 for t in times.values())


def test_a_step_has_one_first_backward_and_m_minus_one_adding_up() -> None:
    t = plans.StageTime(2.0, 5.0, 0.0, 4, first_backward_ms=3.0)
    assert t.per_step(1).backward_ms == 3.0
    assert t.per_step(4).backward_ms == pytest.approx((3.0 + 3 * 5.0) / 4)
    assert t.per_step(4).forward_ms == 2.0
    untimed = plans.StageTime(2.0, 5.0, 0.0, 4)
    assert untimed.per_step(4) == untimed


def test_verified_plans_record_their_stage_times(small, fake_clock) -> None:
    model, x, prof = small
    graph = trace(model)
    candidates = plan_candidates(prof, 2, top_k=3)
    assert len({c.split_size for c in candidates}) == len(candidates) == 3
    hand = manual_plan(prof, [prof.block_names[3]], 4)
    best, others = verify_and_choose(graph, x, prof, candidates, {"hand": hand},
                                     options=TimingOptions(rounds=3, max_rounds=3))
    assert best.split_size in {c.split_size for c in candidates}
    checked = others["hand"]
    for plan in (best, checked):
        assert plan.verification and plan.step_spread == 0.0
        # the fake clock makes every forward and every backward last 1 s
        assert all(s.compute_ms == 2000.0 and s.forward_ms == 1000.0 for s in plan.stages)
        assert all(s.block_sum_ms is not None and s.verified_spread == 0.0 for s in plan.stages)
        # one device: the faster of the whole batch (8 samples, all in x) in one piece on a
        # CPU and the best micro-batch size accumulated — here the whole batch, one run of 2 s,
        # then the whole model's update, as profiled (the stage runs do not time it)
        assert plan.batch_size == x.shape[0]
        assert plan.single_device_ms == pytest.approx(
            2000.0 + whole_update_ms(prof, plan.optimizer), rel=1e-12)
        assert 0 < plan.update_ms < whole_update_ms(prof, plan.optimizer)
    # equal stage times: the step is the simulation of them, (m + p − 1) · 2 s for GPipe, and
    # the slowest stage's update after it
    assert checked.predicted_step_ms == pytest.approx(
        (checked.microbatches + 1) * 2000.0 + checked.update_ms, abs=1)
    # the fewest micro-batches wins when every stage costs the same, whatever the block sums
    assert best.microbatches == min(c.microbatches for c in candidates)


def test_the_chosen_candidate_is_predicted_from_a_second_session_not_the_one_that_chose_it(
        small, monkeypatch) -> None:
    model, x, prof = small
    graph = trace(model)
    candidates = plan_candidates(prof, 2, top_k=3)
    lucky = candidates[-1].split_size  # the last by block sums: drew the luckiest timings
    hand = manual_plan(prof, [prof.block_names[3]], 4)
    sessions: list[list[tuple[int, int, int]]] = []

    def stage_times(graph, inputs, runs, **options):
        sessions.append([run for run, _ in runs])  # (each run and what runs beside it)
        per_sample = [0.1 if len(sessions) == 1 and b == lucky else 1.0
                      for (_, _, b), _ in runs]
        return {r: plans.StageTime(c * r[0][2], c * r[0][2], 0.01, 3)
                for r, c in zip(runs, per_sample)}

    monkeypatch.setattr(plans, "time_stages", stage_times)
    best, others = verify_and_choose(graph, x, prof, candidates, {"hand": hand},
                                     options=TimingOptions(budget_s=30.0))
    assert best.split_size == lucky and len(sessions) == 2
    # the first session times the candidates only; the second the chosen one, the hand split
    # and one device, not the candidates left out
    assert {b for _, _, b in sessions[0]} >= {c.split_size for c in candidates}
    n = len(prof.blocks)
    assert not any(r[:2] == (0, n) for r in sessions[0])  # one device: the second session's
    assert any(r[:2] == (0, n) for r in sessions[1])
    assert {r[2] for r in sessions[1]} - {lucky, 4, x.shape[0]} == set()
    assert all(r in sessions[1] for r in timed_runs.stage_runs(best))
    # every printed figure comes from the second session, where the lucky draw is gone
    expected = verify_plans(graph, x, prof, {"c": candidates[-1]})["c"]
    assert best.predicted_step_ms == pytest.approx(expected.predicted_step_ms)
    assert others["hand"].predicted_step_ms == pytest.approx(
        verify_plans(graph, x, prof, {"h": hand})["h"].predicted_step_ms)
    assert "first verification" in best.verification


def _timed(plan: Plan, step_ms: float, spread: float | None) -> Plan:
    """``plan`` as a verification session might have timed it."""
    return dataclasses.replace(plan, predicted_step_ms=step_ms, step_spread=spread)


def test_a_clear_difference_chooses_the_fastest(small) -> None:
    _, _, prof = small
    by_size = {c.split_size: c for c in plan_candidates(prof, 2, top_k=3)}
    planned = {"2": _timed(by_size[2], 120.0, None), "8": _timed(by_size[8], 100.0, None)}
    first = {"2": _timed(by_size[2], 100.0, 0.01), "8": _timed(by_size[8], 110.0, 0.01)}
    assert steady_choice(first, planned) == ("2", ("2",))


@pytest.mark.parametrize("spread", [None, 0.001])
def test_a_difference_under_the_resolved_ratio_goes_to_the_block_sums(small, spread) -> None:
    """A first session that puts a candidate ahead by less than the accuracy claimed for a
    verified ratio (RESOLVED_RATIO), however small its spread, leaves the choice to the block
    sums; just over it, the faster verified is chosen."""
    _, _, prof = small
    by_size = {c.split_size: c for c in plan_candidates(prof, 2, top_k=3)}
    planned = {"2": _timed(by_size[2], 110.0, None), "4": _timed(by_size[4], 100.0, None)}
    under = 100.0 * (1 + RESOLVED_RATIO) - 0.01
    first = {"2": _timed(by_size[2], 100.0, spread), "4": _timed(by_size[4], under, spread)}
    assert steady_choice(first, planned) == ("4", ("2", "4"))
    over = 100.0 * (1 + RESOLVED_RATIO) + 0.01
    first = {"2": _timed(by_size[2], 100.0, spread), "4": _timed(by_size[4], over, spread)}
    assert steady_choice(first, planned) == ("2", ("2",))


def test_candidates_within_noise_go_to_the_best_by_block_sums_whichever_was_faster(
        small) -> None:
    """Two profiles of one model whose first sessions drew the two candidates' order the
    other way round choose the same plan: the one the block sums put first."""
    _, _, prof = small
    by_size = {c.split_size: c for c in plan_candidates(prof, 2, top_k=3)}
    planned = {"2": _timed(by_size[2], 105.0, None), "4": _timed(by_size[4], 100.0, None),
               "8": _timed(by_size[8], 90.0, None)}
    for two_ms, four_ms in [(100.0, 105.0), (105.0, 100.0)]:
        first = {"2": _timed(by_size[2], two_ms, 0.03), "4": _timed(by_size[4], four_ms, 0.03),
                 "8": _timed(by_size[8], 150.0, 0.03)}  # first by block sums, clearly slower
        assert steady_choice(first, planned) == ("4", ("2", "4"))
    # without a spread, only a difference under RESOLVED_RATIO is left to the block sums
    first = {"2": _timed(by_size[2], 100.0, None), "4": _timed(by_size[4], 104.0, None)}
    assert steady_choice(first, planned) == ("2", ("2",))
    # equal block sums: the faster verified
    level = {n: _timed(p, 100.0, None) for n, p in planned.items()}
    first = {"2": _timed(by_size[2], 101.0, 0.03), "4": _timed(by_size[4], 100.0, 0.03)}
    assert steady_choice(first, level)[0] == "4"
    with pytest.raises(InvalidInputError):
        steady_choice({}, planned)
    with pytest.raises(InvalidInputError, match="no planned step"):
        steady_choice(first, {"2": planned["2"]})


@pytest.mark.parametrize("whole_per_sample", [3.0, 0.5])
def test_one_device_is_the_faster_of_the_whole_batch_and_accumulated_micro_batches(
        small, monkeypatch, whole_per_sample) -> None:
    model, x, _ = small
    prof = autosplit.profile(model, x,
                             options=ProfileOptions(microbatch_sizes=[2, 4], warmup=0, repeats=1))
    plan = autosplit.plan(prof, 2)
    b_one = single_device_ms(prof, plan.batch_size)[1]
    assert b_one < plan.batch_size == x.shape[0]
    assert plan.single_device_split == b_one  # by block sums: the best measured size
    timed: list[tuple[int, int, int]] = []

    def stage_times(graph, inputs, runs, **options):
        timed.extend(run for run, _ in runs)  # (each run and what runs beside it)
        # per sample, the whole batch at once costs whole_per_sample ms, micro-batches 1 ms
        return {r: plans.StageTime(b * (whole_per_sample if b == plan.batch_size else 1.0) / 2,
                                    b * (whole_per_sample if b == plan.batch_size else 1.0) / 2,
                                    0.0, 1) for r in runs for b in [r[0][2]]}

    monkeypatch.setattr(plans, "time_stages", stage_times)
    verified = verify_plans(trace(model), x, prof, {"p": plan})["p"]
    n = len(prof.blocks)
    assert (0, n, b_one) in timed and (0, n, plan.batch_size) in timed  # both ways timed
    per_sample = min(whole_per_sample, 1.0)
    assert verified.single_device_ms == pytest.approx(
        plan.batch_size * per_sample + whole_update_ms(prof, plan.optimizer))
    # the plan says which way its one-device figure runs, and prints it
    way = plan.batch_size if whole_per_sample < 1.0 else b_one
    assert verified.single_device_split == way
    m = plan.batch_size // b_one
    assert (f"vs one device ({plan.batch_size} at once)" if way == plan.batch_size
            else f"vs one device ({m}×{b_one} accumulated)") in str(verified)


def test_one_device_accumulates_where_the_examples_hold_less_than_the_batch(small,
                                                                            fake_clock) -> None:
    model, x, _ = small
    prof = autosplit.profile(model, x,
                             options=ProfileOptions(microbatch_sizes=[2, 4], warmup=0, repeats=1))
    plan = autosplit.plan(prof, 2)
    few = x[:4]  # the example inputs hold 4 samples of the batch of 8
    verified = verify_plans(trace(model), few, prof, {"p": plan},
                            options=TimingOptions(rounds=1, max_rounds=1))["p"]
    b_one = single_device_ms(prof, plan.batch_size)[1]
    assert b_one < plan.batch_size
    assert verified.single_device_ms == pytest.approx(
        2000.0 * plan.batch_size / b_one + whole_update_ms(prof, plan.optimizer), rel=1e-12)


def test_a_zero_bubble_stage_is_timed_with_its_backward_in_two_passes(small, fake_clock) -> None:
    model, x, prof = small
    # the profile says: input + weight gradient passes cost 1.2 × the backward run whole, the
    # weight pass 0.5 / 1.2 of it; the stages as timed say otherwise, and they are what counts
    blocks = tuple(dataclasses.replace(b, input_grad_ms=tuple(0.7 * t for t in b.bwd_ms),
                                       weight_grad_ms=tuple(0.5 * t for t in b.bwd_ms))
                   for b in prof.blocks)
    split = dataclasses.replace(prof, blocks=blocks)
    plans = {"zbv": autosplit.plan(split, 2, options=PlanOptions(schedule="zbv")),
             "gpipe": autosplit.plan(split, 2, options=PlanOptions(schedule="gpipe"))}
    verified = verify_plans(trace(model), x, split, plans,
                            options=TimingOptions(rounds=1, max_rounds=1))
    # the fake clock: every timed interval lasts 1 s — a forward, a whole backward, and each
    # of a split backward's two passes. The first stage's input needs no gradient: torch runs
    # its backward whole, as weight work
    first, *others = verified["zbv"].stages
    assert first.forward_ms == 1000.0 and first.compute_ms == pytest.approx(2000.0)
    assert first.weight_grad_ms == pytest.approx(1000.0)
    assert all(s.forward_ms == 1000.0 and s.compute_ms == pytest.approx(3000.0) for s in others)
    assert all(s.weight_grad_ms == pytest.approx(1000.0) for s in others)  # half, as timed
    assert all(s.compute_ms == 2000.0 for s in verified["gpipe"].stages)
    assert "backward in two passes" in verified["zbv"].verification
    assert "two passes" not in verified["gpipe"].verification
    assert all(s.whole_backward_ms is None for s in verified["zbv"].stages)  # no B action


def test_dualpipev_stages_are_timed_in_two_passes_and_in_one(small, fake_clock) -> None:
    """DualPipeV runs most backwards whole and some split: its stages are timed both ways, and
    a B action costs the one pass."""
    model, x, prof = small
    blocks = tuple(dataclasses.replace(b, input_grad_ms=tuple(0.7 * t for t in b.bwd_ms),
                                       weight_grad_ms=tuple(0.5 * t for t in b.bwd_ms))
                   for b in prof.blocks)
    split = dataclasses.replace(prof, blocks=blocks)
    plan = autosplit.plan(split, 2, options=PlanOptions(schedule="dualpipev", split_size=2))
    assert timed_runs.whole_items(plan) and not timed_runs.whole_items(
        autosplit.plan(split, 2, options=PlanOptions(schedule="zbv", split_size=2)))
    got = verify_plans(trace(model), x, split, {"d": plan},
                       options=TimingOptions(rounds=1, max_rounds=1))["d"]
    first, *others = got.stages
    assert first.whole_backward_ms is None and first.compute_ms == pytest.approx(2000.0)
    # the fake clock: a forward 1 s, a whole backward 1 s, each pass of a split one 1 s
    assert all(s.compute_ms == pytest.approx(3000.0) for s in others)
    assert all(s.whole_backward_ms == pytest.approx(1000.0) for s in others)
    assert "in one pass too" in got.verification
    as_two = dataclasses.replace(got, stages=tuple(
        dataclasses.replace(s, whole_backward_ms=None) for s in got.stages))
    assert simulate_plan(got).step_ms < simulate_plan(as_two).step_ms


def test_a_run_is_timed_whole_and_split_apart(small, fake_clock) -> None:
    from autosplit.verify.stage_timing import SplitBackward

    model, x, _ = small
    run = (3, 7, 4)  # ends with the last block: the split backward starts from the loss
    times = time_stages(trace(model), x, [run, SplitBackward(run), SplitBackward((0, 3, 4))],
                        options=TimingOptions(rounds=2, max_rounds=2, loss="mse"))
    assert times[run].backward_ms == 1000.0 and times[run].weight_share is None
    assert times[SplitBackward(run)].backward_ms == 2000.0
    assert times[SplitBackward(run)].weight_share == 0.5
    # the model's input needs no gradient: no input pass, the whole backward is weight work
    first = times[SplitBackward((0, 3, 4))]
    assert first.backward_ms == 1000.0 and first.weight_share == 1.0


def _skip_stage() -> tuple:
    """LongSkip's stage from block 2 on (a skip crosses into it), and its inputs at b = 4."""
    torch.manual_seed(0)
    graph = trace(LongSkip().eval())
    end = len(graph.blocks)
    seg = graph.extract(2, end)
    env = block_timing.stage_inputs(graph, (torch.randn(4, 6),), 4, [(2, end, 4)],
                                   torch.device("cpu"))
    return graph, seg, env


@pytest.mark.parametrize("depth", [1, 3])
@pytest.mark.parametrize("with_loss", [False, True])
def test_a_split_backward_makes_the_gradients_a_whole_one_does(depth: int,
                                                                with_loss: bool) -> None:
    from autosplit.measure.losses import timing_loss
    from autosplit.verify import stage_timing

    graph, seg, env = _skip_stage()
    cpu = torch.device("cpu")
    loss = timing_loss("mse") if with_loss else None
    grads = []
    for split in (False, True):
        seg.module.zero_grad(set_to_none=True)
        args = block_timing.segment_args(graph, env, seg)  # leaves that need a gradient
        assert len(args) == 2 and all(a.requires_grad for a in args)  # the skip crosses
        f_ms, b_ms, w_ms = stage_timing._in_flight(seg, args, cpu, loss, depth, split)
        assert len(f_ms) == len(b_ms) == depth and len(w_ms) == (depth if split else 0)
        assert all(0 <= w <= b for w, b in zip(w_ms, b_ms))
        grads.append([*(a.grad for a in args), *(p.grad for p in seg.module.parameters())])
    assert all(g is not None for g in grads[0])
    for whole, two_passes in zip(*grads, strict=True):
        torch.testing.assert_close(two_passes, whole)


def test_a_checkpointed_run_recomputes_its_forward_in_its_backward() -> None:
    from autosplit.verify.stage_timing import Checkpointed

    torch.manual_seed(0)
    model = LongSkip().eval()
    graph = trace(model)
    run = (0, len(graph.blocks), 4)
    log: list[str] = []
    model.inp.register_forward_hook(lambda *_: log.append("F"))  # (the recomputation
    x = torch.randn(4, 6)  # stops early: the last layer's input is all it needs of it)
    plain = time_stages(graph, x, [run], options=TimingOptions(warmup=0, rounds=2, max_rounds=2))
    assert log == ["F"] * 2
    log.clear()
    again = time_stages(graph, x, [Checkpointed(run)],
                        options=TimingOptions(warmup=0, rounds=2, max_rounds=2))
    assert log == ["F", "F"] * 2  # each round's forward, and again in its backward
    assert set(plain) == {run} and set(again) == {Checkpointed(run)}


@pytest.mark.parametrize("split", [False, True])
def test_a_checkpointed_run_makes_the_gradients_a_plain_one_does(split: bool) -> None:
    from autosplit.verify import stage_timing

    graph, seg, env = _skip_stage()
    cpu = torch.device("cpu")
    grads = []
    for recompute in (False, True):
        seg.module.zero_grad(set_to_none=True)
        args = block_timing.segment_args(graph, env, seg)
        ran = dataclasses.replace(seg, module=stage_timing._Recomputed(seg.module)) \
            if recompute else seg
        stage_timing._in_flight(ran, args, cpu, None, 2, split)
        grads.append([*(a.grad for a in args), *(p.grad for p in seg.module.parameters())])
    assert all(g is not None for g in grads[0])
    for plain, recomputed in zip(*grads, strict=True):
        torch.testing.assert_close(recomputed, plain)


def test_a_checkpointed_stage_is_verified_with_its_recomputation(small, fake_clock) -> None:
    model, x, prof = small
    plan = autosplit.plan(prof, 2, options=PlanOptions(schedule="gpipe", split_size=4))
    marked = dataclasses.replace(plan, stages=(
        dataclasses.replace(plan.stages[0], checkpoint=True), plan.stages[1]))
    assert isinstance(timed_runs.timed_items(marked)[0], stage_timing.Checkpointed)
    assert not any(isinstance(r, stage_timing.Checkpointed) for r in timed_runs.timed_items(plan))
    both = verify_plans(trace(model), x, prof, {"c": marked, "p": plan},
                        options=TimingOptions(rounds=1, max_rounds=1))
    got = both["c"]
    # the fake clock: a forward 1 s, a backward 1 s, the recomputation inside the backward
    # (untimed by a fake clock): the checkpointed stage's backward less its forward is what
    # the simulation adds the recomputation to
    first, second = got.stages
    assert (first.forward_ms, first.compute_ms) == (1000.0, pytest.approx(1000.0))
    assert (second.forward_ms, second.compute_ms) == (1000.0, pytest.approx(2000.0))
    assert "under activation checkpointing" in got.verification
    assert "checkpointing" not in both["p"].verification
    # the first stage's backward: the recomputation 1 s + 0 s, as the plain stage's 1 s
    assert got.predicted_step_ms == pytest.approx(both["p"].predicted_step_ms)


def test_verified_times_are_measured_and_round_trip(small, tmp_path) -> None:
    model, x, prof = small
    plan = autosplit.plan(prof, 2)
    verified = verify_plans(trace(model), x, prof, {"p": plan},
                            options=TimingOptions(rounds=3, max_rounds=3))["p"]
    assert all(s.compute_ms > 0 and 0 <= s.verified_spread for s in verified.stages)
    assert verified.predicted_step_ms > 0 and verified.single_device_ms > 0
    assert "b=" in verified.verification
    verified.save(tmp_path / "plan.json")
    assert Plan.load(tmp_path / "plan.json") == verified
    assert "verified stage times" in str(verified)


def test_verification_leaves_the_model_as_it_was(small) -> None:
    model, x, prof = small
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    verify_plans(trace(model), x, prof, {"p": autosplit.plan(prof, 2)},
                 options=TimingOptions(rounds=1, max_rounds=1))
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # BatchNorm statistics too
    assert all(p.grad is None for p in model.parameters())
    assert torch.equal(rng, torch.get_rng_state())


def test_partition_verifies_unless_told_not_to() -> None:
    torch.manual_seed(0)
    x = torch.randn(8, 6)
    options = PartitionOptions(profile=ProfileOptions(warmup=0, repeats=1))
    pm = autosplit.partition(LongSkip(), x, devices=["cpu", "cpu"], options=options)
    assert pm.plan.verification and pm.plan.step_spread is not None
    pm = autosplit.partition(LongSkip(), x, devices=["cpu", "cpu"],
                             options=dataclasses.replace(options, verify=False))
    assert pm.plan.verification == "" and pm.plan.step_spread is None
    assert all(s.block_sum_ms is None for s in pm.plan.stages)


# ------------------------------------------------------------------------------ command line

TOY = str(Path(__file__).resolve().parent.parent / "examples" / "toy.py")
FAST = ["--microbatch-sizes", "2,4", "--repeats", "1", "--budget", "5"]


def test_cli_plan_verifies_and_no_verify_skips(tmp_path, capsys) -> None:
    out_plan = tmp_path / "plan.json"
    assert main(["plan", TOY, "--gpus", "2", *FAST, "-o", str(out_plan)]) == 0
    out = capsys.readouterr().out
    saved = Plan.load(out_plan)
    assert "verified stage times" in out and f"vs one device{one_device_way(saved)}:" in out
    assert saved.verification and saved.single_device_split is not None
    assert main(["plan", TOY, "--gpus", "2", *FAST, "--no-verify", "-o", str(out_plan)]) == 0
    out = capsys.readouterr().out
    assert "(block sums)" in out and "verified:" not in out
    assert Plan.load(out_plan).verification == ""
    prof = tmp_path / "profile.json"
    assert main(["profile", TOY, *FAST, "-o", str(prof)]) == 0
    capsys.readouterr()
    assert main(["plan", TOY, "--gpus", "2", "--profile", str(prof), "-o", str(out_plan)]) == 0
    assert "(block sums)" in capsys.readouterr().out  # a saved profile: not verified here


def test_cli_compare_verifies_every_plan(tmp_path, capsys) -> None:
    assert main(["compare", TOY, "--gpus", "2", *FAST, "--manual", "net2"]) == 0
    out = capsys.readouterr().out
    assert "stage times verified" in out
    assert "±" in out or "within noise" in out


def test_a_verified_plan_keeps_the_all_reduce_of_its_shared_weights(fake_clock) -> None:
    # a tied embedding on stages 0 and 1: its gradients are all-reduced after the last
    # backward; the stage runs do not time that, so the verified step adds it as planned
    torch.manual_seed(0)
    model = TiedLM()
    ids = (torch.randint(0, 11, (8, 5), generator=torch.Generator().manual_seed(3)),)
    prof = autosplit.profile(model, ids,
                             options=ProfileOptions(microbatch_sizes=[2, 4], warmup=0, repeats=1))
    plan = autosplit.plan(prof, gpus=2,
                          options=PlanOptions(split_size=4, bandwidth_bytes_per_s=1000.0))  # 1 kB/s
    (weight,) = plan.shared
    assert weight.stages == (0, 1) and plan.sync_after_ms == weight.sync_ms > 100.0
    verified = verify_plans(trace(model), ids, prof, {"p": plan}, one_device=False,
                            options=TimingOptions(rounds=2, max_rounds=2))["p"]
    # every forward and backward lasts 1 s (fake clock); the slow link's transfers are in the
    # simulation, the all-reduce after it
    assert all(s.compute_ms == 2000.0 for s in verified.stages)
    simulated = simulate_plan(verified).step_ms
    assert simulated > (verified.microbatches + 1) * 2000.0
    assert verified.predicted_step_ms == pytest.approx(
        simulated + weight.sync_ms + verified.update_ms, rel=1e-12)


def test_the_runtime_cost_per_action_widens_the_step_by_its_spread(small, fake_clock) -> None:
    # every forward and backward lasts 1 s (fake clock): the stage times have no spread, so
    # the step's spread is the runtime's cost per action at its median ± its spread
    model, x, prof = small
    costly = dataclasses.replace(prof, action_ms=(("gpipe", 100.0),),
                                 action_spread=(("gpipe", 50.0),))
    plan = autosplit.plan(costly, gpus=2, options=PlanOptions(split_size=4, schedule="gpipe",
                                                              bandwidth_bytes_per_s=1e15))
    assert plan.action_ms == 100.0
    graph = trace(model)
    sure = dataclasses.replace(costly, action_spread=())
    verified, certain = (verify_plans(graph, x, p, {"p": plan}, one_device=False,
                                      options=TimingOptions(rounds=2,
                                                            max_rounds=2))["p"] for p in (costly,
                                                                                          sure))
    m = plan.microbatches
    # GPipe on 2 equal stages: (m + 1) · (f + b + 2 o); o = 100 ± 50 ms
    assert verified.predicted_step_ms == pytest.approx(
        (m + 1) * 2200.0 + verified.update_ms, rel=1e-6)
    assert verified.step_spread == pytest.approx(100.0 / 2200.0, rel=1e-3)
    assert certain.predicted_step_ms == verified.predicted_step_ms
    assert certain.step_spread == 0.0
    assert "torch's runtime 100.00 ± 50.00 ms per action" in verified.verification
    # a cost whose median is 0 still spreads: from 0 to 100 ms per action
    zero = dataclasses.replace(costly, action_ms=(("gpipe", 0.0),),
                               action_spread=(("gpipe", 100.0),))
    free = verify_plans(graph, x, zero, {"p": dataclasses.replace(plan, action_ms=0.0)},
                        one_device=False, options=TimingOptions(rounds=2, max_rounds=2))["p"]
    assert free.predicted_step_ms == pytest.approx((m + 1) * 2000.0 + free.update_ms,
                                                   rel=1e-6)
    assert free.step_spread == pytest.approx(100.0 / 2000.0, rel=1e-3)
    assert "torch's runtime 0.00 ± 100.00 ms per action" in free.verification


def test_a_replica_of_one_stage_carries_the_one_stage_runtime_cost(small, fake_clock) -> None:
    # every forward and backward lasts 1 s (fake clock); the one-stage runtime costs 100 ± 50
    # ms per action, DDP's synchronisation 7 ms whatever its bytes: both in the verified step
    from autosplit.planner import plan_replicated

    model, x, prof = small
    costly = dataclasses.replace(prof, one_stage_action_ms=100.0, one_stage_action_spread=50.0,
                                 allreduce_bytes_per_s=1e15, allreduce_latency_ms=7.0,
                                 action_ms=(("gpipe", 900.0),))
    dp = plan_replicated(costly, 1, 2, options=PlanOptions(split_size=4, schedule="gpipe"))
    assert (dp.replicas, dp.action_ms) == (2, 100.0)
    assert dp.replica_sync_ms == pytest.approx(7.0, abs=1e-6)
    verified = verify_plans(trace(model), x, costly, {"dp": dp}, one_device=False,
                            options=TimingOptions(rounds=2, max_rounds=2))["dp"]
    m = dp.microbatches  # one stage: m · (f + b + 2 o) one after the other, then the sync
    assert verified.predicted_step_ms == pytest.approx(
        m * 2200.0 + dp.replica_sync_ms + dp.update_ms, rel=1e-6)
    assert verified.step_spread == pytest.approx(m * 100.0 / verified.predicted_step_ms,
                                                 rel=1e-3)
    assert "torch's runtime 100.00 ± 50.00 ms per action" in verified.verification
    # one stage alone (one device) trains without the runtime
    assert autosplit.plan(costly, 1, options=PlanOptions(split_size=4)).action_ms == 0.0


def _long_skip_candidates() -> tuple[Any, Any, Profile, tuple[Plan, ...]]:
    model, x = LongSkip(), torch.randn(8, 6)
    prof = autosplit.profile(model, x,
                             options=ProfileOptions(microbatch_sizes=[2, 4, 8], warmup=0,
                                                    repeats=1))
    candidates = plan_candidates(prof, 2, top_k=3)
    assert len(candidates) > 1
    return autosplit.trace(model), x, prof, candidates


def test_a_session_is_estimated_from_block_sums() -> None:
    _, _, prof, candidates = _long_skip_candidates()
    one = session_estimate_s(prof, {"a": candidates[0]})
    assert one > SESSION_START_S
    more = session_estimate_s(prof, {"a": candidates[0], "b": candidates[1]})
    assert more > one  # another plan's stages are timed too
    assert session_estimate_s(prof, {"a": candidates[0]}, rounds=6) > one
    again = session_estimate_s(prof, {"a": candidates[0], "b": candidates[0]})
    assert again == pytest.approx(one)  # a run two plans share is timed once


def test_verification_takes_the_sessions_its_budget_allows() -> None:
    graph, x, prof, candidates = _long_skip_candidates()
    others = {"hand": candidates[-1]}
    how = {"beside": contention.enabled(), "whole_batch": True}
    second = session_estimate_s(prof, {"candidate 0": candidates[0], **others}, **how)
    first = session_estimate_s(prof, {f"candidate {i}": c for i, c in enumerate(candidates)},
                               False, **how)
    quick = TimingOptions(rounds=2, max_rounds=2)
    with pytest.raises(choice.VerificationSkipped) as skipped:
        verify_and_choose(graph, x, prof, candidates, others, fit_budget=True,
                          options=dataclasses.replace(quick, budget_s=second / 2))
    assert skipped.value.needed_s == pytest.approx(second)
    best, shown = verify_and_choose(graph, x, prof, candidates, others, fit_budget=True,
                                    options=dataclasses.replace(quick,
                                                                budget_s=second + first / 2))
    assert "chosen by block sums among the 3 best candidates" in best.verification
    assert best.balance == candidates[0].balance and shown["hand"].verification
    best, _ = verify_and_choose(graph, x, prof, candidates, others, fit_budget=True,
                                options=dataclasses.replace(quick, budget_s=2 * (first + second)))
    assert "first verification" in best.verification
