"""On a CPU, the stages of a plan with several workers are timed beside the neighbouring
worker's stage, run by another process; one device is timed with the other cores idle. Nothing
here depends on the machine's speed: the neighbour's work is seen in its CPU time, which grows
by whole tenths of a second a second while it works and hardly at all while it is idle."""

from __future__ import annotations

import dataclasses
import re
import sys
import time
from pathlib import Path

import pytest
import torch
from models import LongSkip
from torch import nn

import autosplit
from autosplit import PlanOptions, ProfileOptions
from autosplit.measure import contention
from autosplit.measure.contention import Neighbour
from autosplit.planner import plan_candidates, plan_with_balance
from autosplit.simulator import overlap_fractions, simulate, simulate_plan
from autosplit.verify import choice, plans, timed_runs
from autosplit.verify.options import TimingOptions
from autosplit.verify.stage_timing import StageTime, time_stages

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="reads a process's CPU time from /proc")


@pytest.fixture
def beside(monkeypatch: pytest.MonkeyPatch) -> None:
    """Stages timed beside a neighbour (the suite times them alone otherwise, for speed)."""
    monkeypatch.delenv(contention.ALONE, raising=False)
    assert contention.enabled()


def _cpu_s(pid: int) -> float:
    """User + system CPU time of process ``pid`` (s)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / 100  # utime, stime in clock ticks (USER_HZ)


def _busy(n: Neighbour, seconds: float) -> float:
    """CPU seconds the neighbour used over ``seconds`` of wall time."""
    before = _cpu_s(n._child.pid)
    time.sleep(seconds)
    return _cpu_s(n._child.pid) - before


def _wide() -> tuple[autosplit.BlockGraph, tuple[torch.Tensor]]:
    model = nn.Sequential(*[nn.Linear(256, 256) for _ in range(4)])
    x = torch.randn(32, 256)
    return autosplit.trace(model, example_inputs=(x,)), (x,)


def test_a_neighbour_works_while_told_to_and_rests_when_told_to() -> None:
    graph, inputs = _wide()
    with Neighbour(graph, inputs, [(0, 2, 16), (2, 4, 16)]) as n:
        n.beside((2, 4, 16))  # waits until it has loaded the model
        assert n.running
        working = _busy(n, 1.0)
        n.beside((0, 2, 16))
        switched = _busy(n, 1.0)
        n.beside(None)  # returns once it is idle
        resting = _busy(n, 1.0)
    assert working > 0.3 and switched > 0.3
    assert resting < working / 3
    assert n._child is None  # closed, and waited for


def test_stages_timed_beside_a_neighbour_say_so(beside: None) -> None:
    graph, inputs = _wide()
    runs = [(0, 2, 16), ((0, 2, 16), (2, 4, 16)), ((2, 4, 16), (0, 2, 16)), ((2, 4, 8), None)]
    times = time_stages(graph, inputs, runs, options=TimingOptions(rounds=2, max_rounds=2))
    assert list(times) == runs
    assert [t.beside for t in times.values()] == [False, True, True, False]
    assert all(t.forward_ms > 0 and t.backward_ms > 0 for t in times.values())


def test_with_the_switch_off_every_stage_is_timed_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(contention.ALONE, "1")
    graph, inputs = _wide()
    times = time_stages(graph, inputs, [((0, 2, 16), (2, 4, 16))],
                        options=TimingOptions(rounds=2, max_rounds=2))
    assert not times[(0, 2, 16), (2, 4, 16)].beside


class Unloadable(nn.Module):
    """A module of this test file: a fresh process cannot import its class."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x).relu()


def test_a_neighbour_that_cannot_load_the_model_leaves_the_stages_timed_alone(
        beside: None) -> None:
    model = nn.Sequential(Unloadable(), Unloadable())
    x = torch.randn(8, 6)
    graph = autosplit.trace(model, example_inputs=(x,), leaf_modules=[Unloadable])
    with pytest.warns(RuntimeWarning, match="other cores idle.*cannot load the model"):
        times = time_stages(graph, (x,), [((0, 1, 4), (1, 2, 4))],
                            options=TimingOptions(rounds=2, max_rounds=2))
    assert not times[(0, 1, 4), (1, 2, 4)].beside


def test_a_plans_stages_are_timed_beside_the_next_stage_and_one_device_alone(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(contention.ALONE, "1")
    x = torch.randn(8, 6)
    profile = autosplit.profile(LongSkip(), (x,),
                                options=ProfileOptions(microbatch_sizes=[2, 4], repeats=2))
    two = next(iter(plan_candidates(profile, 2)))
    assert len(two.stages) == 2
    (s0, s1) = timed_runs.stage_runs(two)
    assert timed_runs.timed_runs(two) == [(s0, s1), (s1, s0), (s0, None), (s1, None)]
    assert timed_runs.timed_runs(two, beside=False) == [(s0, s1), (s1, s0)]
    one = plan_with_balance(profile, [len(profile.blocks)], 4)
    assert timed_runs.timed_runs(one) == [((0, len(profile.blocks), 4), None)]
    replicated = dataclasses.replace(plan_with_balance(profile, [len(profile.blocks)], 2),
                                     replicas=2, microbatches=2)
    assert timed_runs.timed_runs(replicated) == [((0, len(profile.blocks), 2),) * 2]


def test_a_v_shaped_plans_stages_are_timed_beside_a_stage_of_the_other_rank() -> None:
    graph, inputs = _wide()
    profile = autosplit.profile(graph.module, inputs,
                                options=ProfileOptions(microbatch_sizes=[8], repeats=2))
    zbv = autosplit.plan(profile, gpus=2, options=PlanOptions(split_size=8, schedule="zbv"))
    assert timed_runs.stage_ranks(zbv) == [0, 1, 1, 0]  # rank 0 runs the first and the last
    s0, s1, s2, s3 = timed_runs.stage_runs(zbv)
    assert timed_runs.timed_runs(zbv, beside=False) == [(s0, s1), (s1, s3), (s2, s3), (s3, s1)]
    looped = autosplit.plan(profile, gpus=2,
                            options=PlanOptions(split_size=8, schedule="interleaved-1f1b"))
    assert timed_runs.stage_ranks(looped) == [0, 1, 0, 1]
    s0, s1, s2, s3 = timed_runs.stage_runs(looped)
    assert timed_runs.timed_runs(looped, beside=False) == [(s0, s1), (s1, s2), (s2, s3), (s3, s0)]


def test_a_verified_plan_says_its_stages_ran_beside_each_other(beside: None) -> None:
    graph, inputs = _wide()
    profile = autosplit.profile(graph.module, inputs,
                                options=ProfileOptions(microbatch_sizes=[8, 16], repeats=2))
    plan = next(iter(plan_candidates(profile, 2)))
    out = plans.verify_plans(graph, inputs, profile, {"p": plan},
                             options=TimingOptions(rounds=2, max_rounds=2))
    assert "beside its neighbouring worker" in out["p"].verification
    monkeypatch = pytest.MonkeyPatch()
    try:
        monkeypatch.setenv(contention.ALONE, "1")
        alone = plans.verify_plans(graph, inputs, profile, {"p": plan},
                                   options=TimingOptions(rounds=2, max_rounds=2))
    finally:
        monkeypatch.undo()
    assert "beside" not in alone["p"].verification


def test_overlap_is_the_share_of_a_ranks_work_while_another_works() -> None:
    # GPipe, 2 stages, 4 micro-batches, f = 1, b = 2 ms: rank 0 works 0-4 and 7-15, rank 1
    # works 1-13; each overlaps the other for 9 of its 12 ms
    result = simulate([1.0, 1.0], [2.0, 2.0], 4, "gpipe")
    assert overlap_fractions(result) == pytest.approx((0.75, 0.75))
    assert overlap_fractions(simulate([1.0], [2.0], 4, "gpipe")) == (0.0,)


def _time(ms: float, beside: bool) -> StageTime:
    return StageTime(ms / 3, 2 * ms / 3, 0.01 if beside else 0.02, 5, 2 * ms / 3, beside=beside)


def test_a_pipeline_stage_is_its_time_alone_plus_the_overlapping_share_of_the_difference(
        ) -> None:
    x = torch.randn(8, 6)
    profile = autosplit.profile(LongSkip(), (x,),
                                options=ProfileOptions(microbatch_sizes=[2], repeats=2))
    plan = next(iter(plan_candidates(profile, 2, options=PlanOptions(schedule="gpipe"))))
    alone = [_time(30.0, False), _time(30.0, False)]
    together = [_time(36.0, True), _time(33.0, True)]
    times, words, whole = plans._stage_times(plan, together + alone)
    assert whole is None  # GPipe runs no backward in one pass beside split ones
    shares = overlap_fractions(simulate_plan(plans._scaled(plan, times, 0)))
    assert 0 < min(shares) and max(shares) < 1  # a pipeline's ranks overlap in part
    for t, a, b, share in zip(times, alone, together, shares):
        assert t.compute_ms == pytest.approx(a.compute_ms + share * (b.compute_ms - a.compute_ms),
                                             rel=0.02)  # the shares simulated again once more
        assert a.compute_ms < t.compute_ms < b.compute_ms
    assert "alone and beside" in words and re.search(r"\(\d+%/\d+%\)", words)


def test_dualpipev_weighs_its_one_pass_backwards_with_the_same_shares() -> None:
    """DualPipeV's stages are timed split and in one pass, each alone and beside: both are
    weighed by the shares of a simulation that runs its B actions as the one pass."""
    x = torch.randn(8, 6)
    profile = autosplit.profile(LongSkip(), (x,),
                                options=ProfileOptions(microbatch_sizes=[2], repeats=2))
    blocks = tuple(dataclasses.replace(b, input_grad_ms=tuple(0.7 * t for t in b.bwd_ms),
                                       weight_grad_ms=tuple(0.5 * t for t in b.bwd_ms))
                   for b in profile.blocks)
    plan = autosplit.plan(dataclasses.replace(profile, blocks=blocks), 2,
                          options=PlanOptions(schedule="dualpipev", split_size=2))
    n = len(plan.stages)

    def split(ms: float, beside: bool) -> StageTime:
        return dataclasses.replace(_time(ms, beside), weight_share=0.5)

    alone, together = [split(30.0, False)] * n, [split(36.0 + s, True) for s in range(n)]
    one_alone, one_beside = [_time(24.0, False)] * n, [_time(30.0 + s, True) for s in range(n)]
    times, _, one = plans._stage_times(plan, together + alone, whole=one_beside + one_alone)
    assert one is not None
    shares = overlap_fractions(simulate_plan(plans._scaled(plan, times, 0, whole=one)))
    ranks = timed_runs.stage_ranks(plan)
    for s in range(n):
        weighed = ((times[s].compute_ms - alone[s].compute_ms)
                   / (together[s].compute_ms - alone[s].compute_ms))
        assert 0 < weighed < 1
        assert weighed == pytest.approx((one[s].compute_ms - one_alone[s].compute_ms)
                                        / (one_beside[s].compute_ms - one_alone[s].compute_ms))
        assert weighed == pytest.approx(shares[ranks[s]], abs=0.02)


def test_replicas_take_their_time_beside_each_other_and_one_device_alone() -> None:
    x = torch.randn(8, 6)
    profile = autosplit.profile(LongSkip(), (x,),
                                options=ProfileOptions(microbatch_sizes=[2], repeats=2))
    one = plan_with_balance(profile, [len(profile.blocks)], 2)
    replicated = dataclasses.replace(one, replicas=2, microbatches=2)
    beside = _time(36.0, True)
    assert plans._stage_times(replicated, [beside])[0] == [beside]
    alone = _time(30.0, False)
    assert plans._stage_times(one, [alone]) == ([alone], "", None)


def test_a_neighbour_that_dies_is_said_and_the_rest_is_timed_alone() -> None:
    graph, inputs = _wide()
    with Neighbour(graph, inputs, [(0, 2, 16), (2, 4, 16)]) as n:
        n.beside((0, 2, 16))
        assert n.running
        n._child.kill()
        n._child.wait()
        with pytest.warns(RuntimeWarning, match="neighbouring worker stopped"):
            n.beside((2, 4, 16))
        assert not n.running
        n.beside(None)  # nothing more to say


def test_both_verification_sessions_share_one_neighbour(beside: None,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    graph, inputs = _wide()
    profile = autosplit.profile(graph.module, inputs,
                                options=ProfileOptions(microbatch_sizes=[8, 16], repeats=2))
    candidates = plan_candidates(profile, 2, top_k=2)
    assert len(candidates) == 2
    hand = plan_with_balance(profile, [1, 3], 8)
    started: list[Neighbour] = []
    init = Neighbour.__init__

    def counted(self: Neighbour, *args: object, **kwargs: object) -> None:
        init(self, *args, **kwargs)  # type: ignore[arg-type]
        started.append(self)

    monkeypatch.setattr(Neighbour, "__init__", counted)
    best, others = choice.verify_and_choose(graph, inputs, profile, candidates, {"hand": hand},
                                            options=TimingOptions(rounds=2, max_rounds=2))
    assert len(started) == 1  # one process for the choosing and the predicting sessions
    (shared,) = started
    assert {o for p in [*candidates, hand] for _, o in timed_runs.timed_runs(p) if o} \
        == set(shared.runs)
    assert shared._child is None  # closed, and waited for
    assert "beside its neighbouring worker" in best.verification
    assert "beside its neighbouring worker" in others["hand"].verification


def test_a_shared_neighbour_must_be_started_for_every_run_beside_it(beside: None) -> None:
    graph, inputs = _wide()
    with Neighbour(graph, inputs, [(2, 4, 16)]) as n:
        with pytest.raises(autosplit.InvalidInputError, match=r"neighbour.*\(0, 2, 16\)"):
            time_stages(graph, inputs, [((2, 4, 16), (0, 2, 16))], neighbour=n)
        times = time_stages(graph, inputs, [((0, 2, 16), (2, 4, 16))],
                            neighbour=n, options=TimingOptions(rounds=2, max_rounds=2))
        assert times[(0, 2, 16), (2, 4, 16)].beside
        assert n.running and n._current is None  # left idle for the next session
