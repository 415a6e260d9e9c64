"""Timings taken while the hypervisor took the CPUs are set aside: the rule on numbers, and the
profiler and the stage timing following it (the steal and the slow timings faked: no test here
depends on the machine)."""

from __future__ import annotations

from typing import ClassVar

import pytest
import torch
from torch import nn

import autosplit
from autosplit import PlanOptions, ProfileOptions
from autosplit.capture.trace import trace
from autosplit.measure import block_timing, steal_time
from autosplit.verify.options import TimingOptions
from autosplit.verify.stage_timing import time_stages


@pytest.mark.parametrize(
    ("stolen_s", "wall_s", "cores", "expected"),
    [
        (0.0, 1.0, 2, False),  # nothing stolen
        (0.1, 1.0, 2, False),  # exactly 5 % of 2 core-s: not more
        (0.11, 1.0, 2, True),  # over 5 %
        (0.04, 0.2, 2, False),  # 10 % of a short timing, but under 5 ticks: not judged
        (0.05, 0.2, 2, True),  # 5 ticks, 12.5 %
        (0.3, 4.0, 2, False),  # 3.75 % of a long timing
        (0.3, 4.0, 1, True),  # the same on one core: 7.5 %
    ],
)
def test_a_timing_is_disturbed_past_five_percent_of_every_core(stolen_s, wall_s, cores,
                                                               expected) -> None:
    assert steal_time.disturbed(stolen_s, wall_s, cores) is expected


def test_a_window_reads_the_steal_over_its_span(monkeypatch) -> None:
    readings = iter([(100.0, 7.0), (101.0, 9.5)])
    monkeypatch.setattr(steal_time, "cpu_seconds", lambda: next(readings))
    window = steal_time.Window()
    assert window.disturbed() is True  # 2.5 core-s stolen within a few microseconds
    monkeypatch.setattr(steal_time, "cpu_seconds", lambda: None)
    assert steal_time.Window().disturbed() is False  # unreadable (not Linux): nothing judged


def test_this_machine_reports_its_steal_or_nothing() -> None:
    reading = steal_time.cpu_seconds()
    assert reading is None or (reading[0] >= 0.0 and reading[1] >= 0.0)


class _Burst:
    """A fake :class:`steal_time.Window`: the windows numbered in ``hit`` (from 1, in the order
    opened) see the hypervisor take the CPUs."""

    hit: ClassVar[set[int]] = set()
    opened: ClassVar[int] = 0

    def __init__(self) -> None:
        _Burst.opened += 1
        self.number = _Burst.opened

    def disturbed(self, max_share: float = steal_time.MAX_SHARE) -> bool:
        return self.number in _Burst.hit


@pytest.fixture
def burst(monkeypatch):
    """Windows ``hit`` are disturbed, and the timings taken in them 1000 ms slower."""
    _Burst.opened, _Burst.hit = 0, set()
    monkeypatch.setattr(steal_time, "Window", _Burst)
    real = block_timing.timed_run

    def slowed(seg, args, dev, hooks=None, loss=None):
        outputs, f_ms, b_ms = real(seg, args, dev, hooks, loss)
        if _Burst.opened in _Burst.hit:
            return outputs, f_ms + 1000.0, b_ms + 1000.0
        return outputs, f_ms, b_ms

    monkeypatch.setattr(block_timing, "timed_run", slowed)
    return _Burst


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 6), nn.ReLU(), nn.Linear(6, 3))


def test_the_profiler_sets_aside_the_rounds_the_hypervisor_disturbed(burst) -> None:
    model, x = _model(), torch.randn(8, 6)
    blocks = len(trace(model).blocks)
    # one size: one window per round; block 0's rounds are windows 1 (warm-up), 2, 3, 4, …
    burst.hit = {2, 3}  # two of its three timed rounds: their median would be +1000 ms
    prof = autosplit.profile(model, x,
                             options=ProfileOptions(microbatch_sizes=[4], warmup=1, repeats=3,
                                                    max_repeats=3))
    assert prof.set_aside == 2
    assert prof.blocks[0].fwd_ms[0] < 1000.0 and prof.blocks[0].bwd_ms[0] < 1000.0
    # every round of every block disturbed: their timings, rather than none
    _Burst.opened, burst.hit = 0, set(range(1, 1000))
    prof = autosplit.profile(model, x,
                             options=ProfileOptions(microbatch_sizes=[4], warmup=1, repeats=3,
                                                    max_repeats=3))
    assert prof.set_aside == 3 * blocks
    assert all(b.fwd_ms[0] >= 1000.0 for b in prof.blocks)


def test_the_stage_timing_sets_aside_the_runs_the_hypervisor_disturbed(burst) -> None:
    model, x = _model(), torch.randn(8, 6)
    graph = trace(model)
    n = len(graph.blocks)
    # two runs taking turns, one window per run: A is windows 1, 3, 5, …, B 2, 4, 6, …
    runs = [(0, 1, 4), (1, n, 4)]
    burst.hit = {3, 5}  # A's first two timed runs (after its warm-up, window 1)
    times = time_stages(graph, x, runs, options=TimingOptions(warmup=1, rounds=3, max_rounds=3))
    a, b = times[runs[0]], times[runs[1]]
    assert (a.set_aside, b.set_aside) == (2, 0)
    assert a.rounds == 1 and b.rounds == 3
    assert a.forward_ms < 1000.0 and a.compute_ms < 1000.0
    _Burst.opened, burst.hit = 0, set(range(1, 1000))  # all of them: kept, rather than none
    times = time_stages(graph, x, runs, options=TimingOptions(warmup=1, rounds=2, max_rounds=2))
    assert all(t.set_aside == 2 and t.rounds == 2 and t.forward_ms >= 1000.0
               for t in times.values())


def test_a_verified_plan_says_how_many_timings_were_set_aside(burst) -> None:
    from autosplit.verify.plans import verify_plans

    model, x = _model(), torch.randn(8, 6)
    graph = trace(model)
    prof = autosplit.profile(model, x,
                             options=ProfileOptions(microbatch_sizes=[4], warmup=1, repeats=3,
                                                    max_repeats=3))
    plan = autosplit.plan(prof, 2, options=PlanOptions(schedule="gpipe"))
    quiet = verify_plans(graph, x, prof, {"plan": plan}, one_device=False,
                         options=TimingOptions(rounds=2, max_rounds=2))["plan"]
    assert "set aside" not in quiet.verification
    _Burst.opened, burst.hit = 0, {3}  # one timed run of the first stage
    checked = verify_plans(graph, x, prof, {"plan": plan}, one_device=False,
                           options=TimingOptions(rounds=2, max_rounds=2))["plan"]
    assert "1 timing(s) set aside, the hypervisor taking over 5% of the CPUs" \
        in checked.verification
