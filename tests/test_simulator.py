"""Tests of the pipeline schedule simulator (autosplit.simulator).

Hand-computed timelines are written as tables, one row per stage, each op as
``<kind><micro-batch> start–end`` in ms, in the device's execution order.
"""

from __future__ import annotations

import dataclasses
import itertools
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from autosplit import PlanOptions, simulator
from autosplit.errors import InvalidInputError
from autosplit.simulator import Event, SimResult, schedule_order, simulate


def timeline(result: SimResult) -> list[list[tuple[str, float, float]]]:
    """``[[("F0", 0.0, 1.0), …] per stage]`` for comparison with the tables."""
    return [
        [(f"{e.kind}{e.microbatch}", e.start_ms, e.end_ms) for e in row] for row in result.events
    ]


def table(*rows: str) -> list[list[tuple[str, float, float]]]:
    """Parse rows like ``"F0 0–1, F1 1–2"`` into the form :func:`timeline` returns."""
    out = []
    for row in rows:
        ops = []
        for item in row.split(","):
            name, span = item.split()
            start, end = span.split("–")
            ops.append((name, float(start), float(end)))
        out.append(ops)
    return out


# -- balanced stages ------------------------------------------------------------------------------


@pytest.mark.parametrize("p", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("m", [1, 2, 3, 5, 8, 12])
def test_balanced_gpipe_makespan_is_m_plus_p_minus_1_ticks(p: int, m: int) -> None:
    f, b = 1.5, 2.25  # exact in binary: the sums below are exact
    result = simulate([f] * p, [b] * p, m, "gpipe")
    assert result.step_ms == (m + p - 1) * (f + b)
    assert result.busy_ms == (m * (f + b),) * p
    assert result.peak_in_flight == (m,) * p
    assert math.isclose(result.bubble_fraction, (p - 1) / (m + p - 1))


@pytest.mark.parametrize("p", [2, 3, 4, 6])
@pytest.mark.parametrize("m", [1, 2, 4, 7, 16])
def test_balanced_1f1b_matches_gpipe_and_holds_fewer_micro_batches(p: int, m: int) -> None:
    f, b = 1.0, 2.0
    gpipe = simulate([f] * p, [b] * p, m, "gpipe")
    one = simulate([f] * p, [b] * p, m, "1f1b")
    assert one.step_ms == gpipe.step_ms == (m + p - 1) * (f + b)
    assert one.peak_in_flight == tuple(min(m, p - s) for s in range(p))
    if m > p:
        assert one.peak_in_flight[0] == p < gpipe.peak_in_flight[0] == m
    else:
        assert one.peak_in_flight[0] == gpipe.peak_in_flight[0] == m


def test_schedule_orders() -> None:
    assert schedule_order("gpipe", 3, 2, 0) == (
        ("F", 0), ("F", 1), ("F", 2), ("B", 2), ("B", 1), ("B", 0)
    )
    # p = 3, m = 4, stage 0: 3 warm-up forwards, one B/F pair, then 3 backwards.
    assert schedule_order("1f1b", 4, 3, 0) == (
        ("F", 0), ("F", 1), ("F", 2), ("B", 0), ("F", 3), ("B", 1), ("B", 2), ("B", 3)
    )
    # the last stage alternates from the start
    assert schedule_order("1f1b", 3, 3, 2) == (
        ("F", 0), ("B", 0), ("F", 1), ("B", 1), ("F", 2), ("B", 2)
    )
    with pytest.raises(InvalidInputError, match="'zb'"):
        schedule_order("zb", 3, 3, 0)


# -- hand-computed timelines ----------------------------------------------------------------------


def test_unbalanced_gpipe_timeline() -> None:
    """p = 2, m = 3, fwd = [1, 2], bwd = [2, 4] ms, no transfers, GPipe.

    Stage 1 is twice as slow, so stage 0 idles; backwards run in reverse micro-batch order
    and stage 0's B(i) waits for stage 1's B(i):

    ========  =====================================================
    stage 0   F0 0–1, F1 1–2, F2 2–3, B2 11–13, B1 15–17, B0 19–21
    stage 1   F0 1–3, F1 3–5, F2 5–7, B2 7–11, B1 11–15, B0 15–19
    ========  =====================================================

    step 21 ms; busy 9 and 18 ms; bubble 1 − 27 / 42.
    """
    result = simulate([1, 2], [2, 4], 3, "gpipe")
    assert timeline(result) == table(
        "F0 0–1, F1 1–2, F2 2–3, B2 11–13, B1 15–17, B0 19–21",
        "F0 1–3, F1 3–5, F2 5–7, B2 7–11, B1 11–15, B0 15–19",
    )
    assert result.step_ms == 21.0
    assert result.busy_ms == (9.0, 18.0)
    assert result.peak_in_flight == (3, 3)
    assert math.isclose(result.bubble_fraction, 1 - 27 / 42)


def test_unbalanced_1f1b_timeline() -> None:
    """The same stages under 1F1B: stage 0 warms up with 2 forwards, stage 1 with 1.

    ========  =====================================================
    stage 0   F0 0–1, F1 1–2, B0 7–9, F2 9–10, B1 13–15, B2 19–21
    stage 1   F0 1–3, B0 3–7, F1 7–9, B1 9–13, F2 13–15, B2 15–19
    ========  =====================================================

    Stage 1's F1 could start at 2 but its device runs B0 first (3–7); stage 0's F2 waits for
    B0 (7–9) and so reaches stage 1 at 10, after it became free at 13 anyway.
    """
    result = simulate([1, 2], [2, 4], 3, "1f1b")
    assert timeline(result) == table(
        "F0 0–1, F1 1–2, B0 7–9, F2 9–10, B1 13–15, B2 19–21",
        "F0 1–3, B0 3–7, F1 7–9, B1 9–13, F2 13–15, B2 15–19",
    )
    assert result.step_ms == 21.0
    assert result.peak_in_flight == (2, 1)


def test_heterogeneous_gpipe_with_transfers() -> None:
    """p = 3, m = 2, fwd = [2, 1, 3], bwd = [4, 2, 5], comm_fwd = [1, 0.5], comm_bwd = [2, 1].

    A receive is posted when its stage gets to the op (the device free), and the transfer
    starts once both its send and its receive are posted: F(s, i) starts at
    max(free, F(s−1, i).end) + comm_fwd[s−1]; B(s, i) at max(free, B(s+1, i).end) + comm_bwd[s]:

    ========  ====================================================
    stage 0   F0 0–2, F1 2–4, B1 21–25, B0 27–31
    stage 1   F0 3–4, F1 5–6, B1 17–19, B0 22–24
    stage 2   F0 4.5–7.5, F1 8–11, B1 11–16, B0 16–21
    ========  ====================================================

    e.g. stage 2's F1: its input was sent at 6, but stage 2 posts the receive only when its F0
    ends at 7.5, so it starts at 7.5 + 0.5; stage 0's B0 waits for its receive, posted at 25.
    Step 31 ms = Σ (f + b) + Σ transfers + (m − 1) · (max f' + max b') = 17 + 4.5 + 3.5 + 6
    (f' = [2, 2, 3.5], b' = [6, 3, 5]); busy 12, 6, 16 ms.
    """
    result = simulate([2, 1, 3], [4, 2, 5], 2, "gpipe", [1, 0.5], [2, 1])
    assert timeline(result) == table(
        "F0 0–2, F1 2–4, B1 21–25, B0 27–31",
        "F0 3–4, F1 5–6, B1 17–19, B0 22–24",
        "F0 4.5–7.5, F1 8–11, B1 11–16, B0 16–21",
    )
    assert result.step_ms == 31.0
    assert result.busy_ms == (12.0, 6.0, 16.0)
    assert math.isclose(result.bubble_fraction, 1 - 34 / (3 * 31.0))


def test_heterogeneous_1f1b_with_transfers() -> None:
    """The same pipeline, m = 3, 1F1B (warm-up 3, 2, 1 forwards):

    ========  ==========================================================================
    stage 0   F0 0–2, F1 2–4, F2 4–6, B0 17.5–21.5, B1 26–30, B2 34.5–38.5
    stage 1   F0 3–4, F1 5–6, B0 13.5–15.5, F2 16.5–17.5, B1 22–24, B2 30.5–32.5
    stage 2   F0 4.5–7.5, B0 7.5–12.5, F1 13–16, B1 16–21, F2 21.5–24.5, B2 24.5–29.5
    ========  ==========================================================================

    Stage 2's F1 input was sent at 6 but the device posts its receive when B0 ends, at 12.5,
    and starts at 12.5 + 0.5; stage 1's F2 input was sent at 6, its receive posted at 15.5.
    """
    result = simulate([2, 1, 3], [4, 2, 5], 3, "1f1b", [1, 0.5], [2, 1])
    assert timeline(result) == table(
        "F0 0–2, F1 2–4, F2 4–6, B0 17.5–21.5, B1 26–30, B2 34.5–38.5",
        "F0 3–4, F1 5–6, B0 13.5–15.5, F2 16.5–17.5, B1 22–24, B2 30.5–32.5",
        "F0 4.5–7.5, B0 7.5–12.5, F1 13–16, B1 16–21, F2 21.5–24.5, B2 24.5–29.5",
    )
    assert result.step_ms == 38.5
    assert result.peak_in_flight == (3, 2, 1)
    assert result.busy_ms == (18.0, 9.0, 24.0)


def test_transfers_start_when_the_receive_is_posted() -> None:
    """p = 2, m = 2, f = b = 1 ms, comm_fwd = [3], comm_bwd = [2], GPipe:

    ========  ====================================
    stage 0   F0 0–1, F1 1–2, B1 12–13, B0 15–16
    stage 1   F0 4–5, F1 8–9, B1 9–10, B0 10–11
    ========  ====================================

    A transfer starts once its receive is posted, when the receiving stage gets to the op: the
    second micro-batch's input, sent at 2, moves only after stage 1's F0 ends at 5. Every
    transfer is on the critical path: 6 (no transfers) + 2 · 3 + 2 · 2 = 16 ms (gloo measured
    so: a receive posted 50 ms after its send still took the whole transfer); the devices'
    busy time is unchanged.
    """
    plain = simulate([1, 1], [1, 1], 2, "gpipe")
    result = simulate([1, 1], [1, 1], 2, "gpipe", comm_fwd_ms=[3], comm_bwd_ms=[2])
    assert plain.step_ms == 6.0
    assert timeline(result) == table(
        "F0 0–1, F1 1–2, B1 12–13, B0 15–16",
        "F0 4–5, F1 8–9, B1 9–10, B0 10–11",
    )
    assert result.step_ms == 16.0
    assert result.busy_ms == plain.busy_ms == (4.0, 4.0)
    # one micro-batch: the whole critical path 1 + 3 + 1 + 1 + 2 + 1
    assert simulate([1, 1], [1, 1], 1, "1f1b", [3], [2]).step_ms == 9.0


def test_single_stage_runs_everything_back_to_back() -> None:
    result = simulate([2.0], [3.0], 4, "1f1b")
    assert result.step_ms == 20.0
    assert result.bubble_fraction == 0.0
    assert result.peak_in_flight == (1,)  # 1F1B with p = 1: F0 B0 F1 B1 …
    assert simulate([2.0], [3.0], 4, "gpipe").peak_in_flight == (4,)


def test_zero_times_give_zero_step_and_no_bubble() -> None:
    result = simulate([0, 0], [0, 0], 3)
    assert result.step_ms == 0.0
    assert result.bubble_fraction == 0.0


def test_results_are_frozen() -> None:
    result = simulate([1], [1], 1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        result.step_ms = 0.0  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        result.events[0][0].start_ms = 1.0  # type: ignore[misc]
    assert isinstance(result.events[0][0], Event)
    assert result.events[0][0].duration_ms == 1.0


# -- bad input ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"fwd_ms": [], "bwd_ms": []}, r"fwd_ms is empty"),
        ({"bwd_ms": [1.0]}, r"bwd_ms must have 2 entries \(one per stage\), got 1"),
        ({"fwd_ms": [1.0, -1.0]}, r"fwd_ms\[1\] must be a finite number ≥ 0 \(ms\), got -1.0"),
        ({"bwd_ms": [1.0, math.nan]}, r"bwd_ms\[1\] .* got nan"),
        ({"fwd_ms": [1.0, math.inf]}, r"fwd_ms\[1\] .* got inf"),
        ({"fwd_ms": "12"}, r"fwd_ms must be a list, got '12'"),
        ({"fwd_ms": [1.0, "fast"]}, r"fwd_ms\[1\] must be a number, got 'fast'"),
        ({"m": 0}, r"m \(micro-batches\) must be a positive integer, got 0"),
        ({"m": 2.0}, r"got 2.0"),
        ({"m": True}, r"got True"),
        ({"schedule": "interleaved"}, r"unknown schedule 'interleaved': use one of gpipe, 1f1b"),
        ({"comm_fwd_ms": [1.0, 2.0]}, r"comm_fwd_ms must have 1 entries \(one per cut\), got 2"),
        ({"comm_bwd_ms": [-0.5]}, r"comm_bwd_ms\[0\] must be a finite number ≥ 0 .*got -0.5"),
    ],
)
def test_bad_input_is_rejected_with_the_value(kwargs: dict, match: str) -> None:
    args = {"fwd_ms": [1.0, 1.0], "bwd_ms": [1.0, 1.0], "m": 2, **kwargs}
    with pytest.raises(InvalidInputError, match=match):
        simulate(**args)


# -- properties -----------------------------------------------------------------------------------

times = st.floats(0.0, 50.0, allow_nan=False, allow_subnormal=False)


@st.composite
def pipelines(draw: st.DrawFn) -> dict:
    p = draw(st.integers(1, 5))
    return {
        "fwd_ms": draw(st.lists(times, min_size=p, max_size=p)),
        "bwd_ms": draw(st.lists(times, min_size=p, max_size=p)),
        "m": draw(st.integers(1, 8)),
        "schedule": draw(st.sampled_from(["gpipe", "1f1b"])),
        "comm_fwd_ms": draw(st.lists(times, min_size=p - 1, max_size=p - 1)),
        "comm_bwd_ms": draw(st.lists(times, min_size=p - 1, max_size=p - 1)),
    }


@settings(max_examples=200, deadline=None)
@given(pipelines())
def test_makespan_bounds_and_timeline_invariants(case: dict) -> None:
    result = simulate(**case)
    fwd, bwd, m = case["fwd_ms"], case["bwd_ms"], case["m"]
    cf, cb = case["comm_fwd_ms"], case["comm_bwd_ms"]
    p = len(fwd)
    tol = 1e-9 * (1 + result.step_ms)

    # lower bounds: the busiest device, and one micro-batch's critical path
    critical = sum(fwd) + sum(bwd) + sum(cf) + sum(cb)
    assert result.step_ms >= max(result.busy_ms) - tol
    assert result.step_ms >= critical - tol
    # upper bound: something is always running or in transit (no deadlock, no idle gap)
    assert result.step_ms <= m * critical + tol

    assert result.busy_ms == pytest.approx([m * (f + b) for f, b in zip(fwd, bwd)])
    assert 0.0 <= result.bubble_fraction <= 1.0
    if result.step_ms > 0:
        expected_bubble = 1 - sum(result.busy_ms) / (p * result.step_ms)
        assert math.isclose(result.bubble_fraction, expected_bubble, abs_tol=1e-12)
    expected_peak = [m if case["schedule"] == "gpipe" else min(m, p - s) for s in range(p)]
    assert list(result.peak_in_flight) == expected_peak

    end = {(e.kind, e.stage, e.microbatch): e.end_ms for row in result.events for e in row}
    for s, row in enumerate(result.events):
        assert [(e.kind, e.microbatch) for e in row] == list(
            schedule_order(case["schedule"], m, p, s)
        )
        for before, after in itertools.pairwise(row):
            assert after.start_ms >= before.end_ms  # one op at a time
        for e in row:
            assert e.stage == s
            assert e.end_ms == pytest.approx(e.start_ms + (fwd[s] if e.kind == "F" else bwd[s]))
            if e.kind == "F" and s > 0:
                assert e.start_ms >= end["F", s - 1, e.microbatch] + cf[s - 1] - tol
            if e.kind == "B":
                assert e.start_ms >= end["F", s, e.microbatch] - tol
                if s < p - 1:
                    assert e.start_ms >= end["B", s + 1, e.microbatch] + cb[s] - tol
    assert result.step_ms == max(e.end_ms for row in result.events for e in row)


@settings(max_examples=100, deadline=None)
@given(
    st.integers(1, 6),
    st.integers(1, 10),
    st.floats(0.0, 20.0, allow_subnormal=False),
    st.floats(0.0, 20.0, allow_subnormal=False),
)
def test_balanced_schedules_agree_for_any_sizes(p: int, m: int, f: float, b: float) -> None:
    gpipe = simulate([f] * p, [b] * p, m, "gpipe")
    one = simulate([f] * p, [b] * p, m, "1f1b")
    assert math.isclose(gpipe.step_ms, (m + p - 1) * (f + b), rel_tol=1e-9, abs_tol=1e-9)
    assert math.isclose(one.step_ms, gpipe.step_ms, rel_tol=1e-9, abs_tol=1e-9)


def test_overlap_shares_count_the_time_another_row_is_busy_too() -> None:
    class Span:
        def __init__(self, start_ms: float, end_ms: float) -> None:
            self.start_ms, self.end_ms = start_ms, end_ms

    # row 0 busy 0–4, row 1 busy 2–3 and 5–6, row 2 idle
    shares = simulator.overlap_shares([[Span(0, 4)], [Span(5, 6), Span(2, 3)], []])
    assert shares == pytest.approx((0.25, 0.5, 0.0))
    # the simulation's rows give what overlap_fractions gives
    result = simulator.simulate([1.0, 2.0], [2.0, 3.0], 4, "gpipe")
    assert simulator.overlap_shares(result.events) == simulator.overlap_fractions(result)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved-1f1b"])
def test_a_plan_on_cpu_workers_pays_its_copies_and_one_on_gpus_does_not(schedule: str) -> None:
    """Stages on CPUs (gloo between the workers) copy their transfers on their own cores: the
    plan's simulated step is longer than with its transfers as delays only, and the plan's
    prediction is that longer one; the same stages on GPUs simulate as delays only."""
    from synthetic import make_profile

    import autosplit

    # uneven blocks: on even GPipe stages the receiver waits for each transfer as long as the
    # sender copies it, and the step is the same either way
    prof = make_profile([2, 4], [[1.0, 1.0], [2.0, 2.0], [1.0, 1.0], [0.5, 0.5], [1.0, 1.0],
                                 [3.0, 3.0]], batch_size=8, cut_bytes_per_sample=[2 * 10**6] * 5)
    plan = autosplit.plan(prof, 2,
                          options=PlanOptions(schedule=schedule, bandwidth_bytes_per_s=1e9))
    assert simulator.copies_on_cores(plan)
    on = simulator.simulate_plan(plan).step_ms
    off = simulator.simulate_plan(plan, transfers_on_cores=False).step_ms
    assert plan.predicted_step_ms == pytest.approx(on) and on > off
    gpus = dataclasses.replace(plan, stages=tuple(
        dataclasses.replace(s, device=f"cuda:{s.index % 2}") for s in plan.stages))
    assert not simulator.copies_on_cores(gpus)
    assert simulator.simulate_plan(gpus).step_ms == pytest.approx(off)
