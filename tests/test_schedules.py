"""Tests of autosplit.schedules: torch's action orders and their replay.

Hand-computed timelines are tables, one row per rank, each action as
``<stage><kind><micro-batch> start–end`` in ms (torch's notation: ``2I0`` is the input backward
of micro-batch 0 on stage 2), in the rank's execution order.
"""

from __future__ import annotations

import dataclasses
import itertools
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_simulator import table  # rows like "0F0 0–1, 0F1 1–2": name, start–end

from autosplit.errors import ArgumentTypeError, InvalidInputError, ScheduleUnavailableError
from autosplit.schedules import (
    SCHEDULES,
    Action,
    ScheduleOrder,
    StageCosts,
    Timeline,
    replay,
    simulate_schedule,
    torch_class_name,
    torch_order,
)
from autosplit.simulator import schedule_order, simulate


def timeline(result: Timeline) -> list[list[tuple[str, float, float]]]:
    """``[[("0F0", 0.0, 1.0), …] per rank]`` for comparison with the tables."""
    return [
        [(f"{t.stage}{t.kind}{t.microbatch}", t.start_ms, t.end_ms) for t in row]
        for row in result.actions
    ]


def costs(n: int, f: float, b: float, w: float = 0.0, **kw: object) -> StageCosts:
    return StageCosts((f,) * n, (b,) * n, (w,) * n, **kw)  # type: ignore[arg-type]


# -- torch's orders -------------------------------------------------------------------------------


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_every_order_torch_accepts_is_complete_placed_and_replays(schedule: str) -> None:
    rng = random.Random(schedule)
    built = 0
    for p, v, m in itertools.product((1, 2, 3, 4), (1, 2, 3), (1, 2, 3, 4, 5, 8)):
        try:
            order = torch_order(schedule, p, v, m)
        except ScheduleUnavailableError as exc:
            assert (exc.schedule, exc.p, exc.v, exc.m) == (schedule, p, v, m)
            assert exc.reason and exc.reason in str(exc)
            continue
        built += 1
        assert (order.p, order.v, order.m, order.n) == (p, v, m, p * v)
        seen: dict[tuple[str, int, int], int] = {}
        for r, row in enumerate(order.actions):
            for a in row:
                assert order.stage_rank[a.stage] == r
                assert 0 <= a.microbatch < m
                key = (a.kind, a.stage, a.microbatch)
                assert key not in seen
                seen[key] = r
        for s, i in itertools.product(range(p * v), range(m)):
            assert ("F", s, i) in seen
            assert (("B", s, i) in seen) != (("I", s, i) in seen and ("W", s, i) in seen)
        n = p * v
        random_costs = StageCosts(
            [rng.uniform(0, 3) for _ in range(n)], [rng.uniform(0, 3) for _ in range(n)],
            [rng.uniform(0, 3) for _ in range(n)], comm_fwd_ms=[rng.uniform(0, 1)] * (n - 1),
            comm_bwd_ms=[rng.uniform(0, 1)] * (n - 1),
        )
        result = replay(order, random_costs)  # no deadlock: every action gets a time
        assert sum(len(row) for row in result.actions) == len(seen)
    assert built > 0


def test_one_f_one_b_order_is_autosplit_simulator_order() -> None:
    for p, m in [(2, 2), (2, 5), (3, 3), (4, 7)]:
        order = torch_order("1f1b", p, 1, m)
        for s in range(p):
            assert [(a.kind, a.microbatch) for a in order.actions[s]] == list(
                schedule_order("1f1b", m, p, s))


def test_gpipe_runs_backwards_in_forward_micro_batch_order() -> None:
    # torch's ScheduleGPipe loops over i = 0 … m-1 for the backward too
    order = torch_order("gpipe", 2, 1, 3)
    assert [str(a) for a in order.actions[1]] == ["1F0", "1F1", "1F2", "1B0", "1B1", "1B2"]


def test_class_names_follow_what_autosplit_run_builds() -> None:
    from autosplit.distributed.stage_module import INTERLEAVED_SCHEDULES
    from autosplit.distributed.stage_module import SCHEDULES as RUN_SCHEDULES

    for name, cls in RUN_SCHEDULES.items():
        assert torch_class_name(name, 1) == cls
        assert torch_class_name(name, 2) == INTERLEAVED_SCHEDULES[name]
        assert torch_order(name, 2, 2, 4).torch_class == INTERLEAVED_SCHEDULES[name]
    assert torch_class_name("zbv", 2) == "ScheduleZBVZeroBubble"


def test_v_schedules_place_stages_as_a_v() -> None:
    assert torch_order("zbv", 3, 2, 6).stage_rank == (0, 1, 2, 2, 1, 0)
    assert torch_order("dualpipev", 2, 2, 4).stage_rank == (0, 1, 1, 0)
    assert torch_order("interleaved-zb", 2, 3, 4).stage_rank == (0, 1, 0, 1, 0, 1)


@pytest.mark.parametrize(
    ("schedule", "p", "v", "m", "words"),
    [
        ("1f1b", 3, 1, 2, ["Schedule1F1B", "m=2", "(2) must be greater than or equal"]),
        ("zbv", 2, 3, 4, ["ScheduleZBVZeroBubble", "v=3", "exactly 2 stages per rank"]),
        ("dualpipev", 2, 2, 3, ["ScheduleDualPipeV", "at least as many microbatches"]),
    ],
)
def test_torch_refusal_becomes_a_clear_reason(
    schedule: str, p: int, v: int, m: int, words: list[str]
) -> None:
    with pytest.raises(ScheduleUnavailableError) as info:
        torch_order(schedule, p, v, m)
    assert all(w in str(info.value) for w in words), str(info.value)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    ("args", "error", "words"),
    [
        (("pipedream", 2, 1, 4), InvalidInputError, "unknown schedule 'pipedream'"),
        (("gpipe", 0, 1, 4), InvalidInputError, "p (ranks) must be a positive integer, got 0"),
        (("gpipe", 2, 1.0, 4), ArgumentTypeError, "v (stages per rank) must be an integer"),
        (("gpipe", 2, 1, -1), InvalidInputError, "m (micro-batches)"),
    ],
)
def test_bad_order_arguments(args: tuple, error: type, words: str) -> None:
    with pytest.raises(error, match=None) as info:
        torch_order(*args)
    assert words in str(info.value)


# -- cross-check with autosplit.simulator ---------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(
    p=st.integers(1, 4),
    m=st.integers(1, 8),
    data=st.data(),
)
def test_gpipe_and_1f1b_replay_equal_the_simulator(p: int, m: int, data: st.DataObject) -> None:
    times = st.lists(st.floats(0, 10), min_size=p, max_size=p)
    fwd, bwd, act = data.draw(times), data.draw(times), data.draw(times)
    share = data.draw(st.lists(st.floats(0, 1), min_size=p, max_size=p))
    cuts = st.lists(st.floats(0, 3), min_size=p - 1, max_size=p - 1)
    cf, cb = data.draw(cuts), data.draw(cuts)
    cost = data.draw(st.sampled_from([0.0, 0.3, 2.0]))  # the runtime's, per action (ms)
    cores = data.draw(st.booleans())  # whether the transfers cost the ranks compute
    c = StageCosts(fwd, [b * (1 - x) for b, x in zip(bwd, share)],
                   [b * x for b, x in zip(bwd, share)], activation_bytes=act,
                   comm_fwd_ms=cf, comm_bwd_ms=cb, action_ms=cost, transfers_on_cores=cores)
    for schedule in ("gpipe", "1f1b") if m >= p else ("gpipe",):
        ours = simulate_schedule(schedule, p, 1, m, c)
        theirs = simulate([f + cost for f in fwd], [b + cost for b in bwd], m, schedule, cf,
                          cb, transfers_on_cores=cores)
        assert ours.step_ms == pytest.approx(theirs.step_ms, rel=1e-9, abs=1e-9)
        assert ours.busy_ms == pytest.approx(theirs.busy_ms, rel=1e-9, abs=1e-9)
        for s in range(p):  # same busy intervals; GPipe's backward labels differ (reversed)
            spans = sorted(x for t in ours.actions[s] for x in (t.start_ms, t.end_ms))
            expected = sorted(x for e in theirs.events[s] for x in (e.start_ms, e.end_ms))
            assert spans == pytest.approx(expected, rel=1e-9, abs=1e-9)
            assert ours.peak_bytes[s] == pytest.approx(act[s] * theirs.peak_in_flight[s])


# -- hand-computed timelines ----------------------------------------------------------------------


def test_interleaved_1f1b_two_ranks_two_stages_each() -> None:
    # stages 0, 2 on rank 0 and 1, 3 on rank 1; F = 1, B = 2 (full backward), no transfers
    result = simulate_schedule("interleaved-1f1b", 2, 2, 2, costs(4, 1.0, 2.0))
    assert timeline(result) == table(
        "0F0 0–1, 0F1 1–2, 2F0 2–3, 2F1 3–4, 2B0 6–8, 2B1 9–11, 0B0 11–13, 0B1 13–15",
        "1F0 1–2, 1F1 2–3, 3F0 3–4, 3B0 4–6, 3F1 6–7, 3B1 7–9, 1B0 9–11, 1B1 11–13",
    )
    assert result.step_ms == 15.0
    assert result.busy_ms == (12.0, 12.0)
    assert result.idle_ms == (3.0, 3.0)
    assert result.bubble_fraction == pytest.approx(3 / 15)


def test_interleaved_zero_bubble_two_ranks_two_stages_each() -> None:
    # F = I = W = 1; stage s keeps 8, 4, 2, 1 bytes per micro-batch until its W
    result = simulate_schedule(
        "interleaved-zb", 2, 2, 2, costs(4, 1.0, 1.0, 1.0, activation_bytes=(8, 4, 2, 1)))
    assert timeline(result) == table(
        "0F0 0–1, 0F1 1–2, 2F0 2–3, 2F1 3–4, 2I0 5–6, 2W0 6–7, 2I1 7–8, 2W1 8–9, "
        "0I0 9–10, 0W0 10–11, 0I1 11–12, 0W1 12–13",
        "1F0 1–2, 1F1 2–3, 3F0 3–4, 3I0 4–5, 3F1 5–6, 3I1 6–7, 3W0 7–8, 1I0 8–9, "
        "3W1 9–10, 1I1 10–11, 1W0 11–12, 1W1 12–13",
    )
    assert result.step_ms == 13.0
    assert result.idle_ms == (1.0, 1.0)
    assert result.memory == (
        ((0, 0), (1, 8), (2, 16), (3, 18), (4, 20), (7, 18), (9, 16), (11, 8), (13, 0)),
        ((0, 0), (2, 4), (3, 8), (4, 9), (6, 10), (8, 9), (10, 8), (12, 4), (13, 0)),
    )
    assert result.peak_bytes == (20.0, 10.0)


def test_zero_bubble_holds_what_the_weight_pass_needs_between_its_two_passes() -> None:
    # the order above; between I and W stage s holds 16, 8, 4, 2 bytes instead of 8, 4, 2, 1
    result = simulate_schedule(
        "interleaved-zb", 2, 2, 2, costs(4, 1.0, 1.0, 1.0, activation_bytes=(8, 4, 2, 1),
                                         split_held_bytes=(16, 8, 4, 2)))
    assert result.memory == (
        ((0, 0), (1, 8), (2, 16), (3, 18), (4, 20), (6, 22), (7, 18), (8, 20), (9, 16),
         (10, 24), (11, 8), (12, 16), (13, 0)),
        ((0, 0), (2, 4), (3, 8), (4, 9), (5, 10), (6, 11), (7, 12), (8, 10), (9, 14),
         (10, 12), (11, 16), (12, 8), (13, 0)),
    )
    assert result.peak_bytes == (24.0, 16.0)
    # a full backward never splits: the same bytes change nothing for 1F1B
    plain = costs(2, 1.0, 2.0, activation_bytes=(8, 4))
    held = costs(2, 1.0, 2.0, activation_bytes=(8, 4), split_held_bytes=(80, 40))
    assert simulate_schedule("1f1b", 2, 1, 2, held).memory == \
        simulate_schedule("1f1b", 2, 1, 2, plain).memory


def test_each_input_pass_leaves_the_inputs_gradient_until_the_step_ends() -> None:
    # the order above; each I of stages 1, 2, 3 leaves 1 byte (torch keeps the gradient of a
    # received input as its buffer's .grad until the next step)
    result = simulate_schedule(
        "interleaved-zb", 2, 2, 2, costs(4, 1.0, 1.0, 1.0, activation_bytes=(8, 4, 2, 1),
                                         input_grad_bytes=(0, 1, 1, 1)))
    assert result.memory == (
        ((0, 0), (1, 8), (2, 16), (3, 18), (4, 20), (6, 21), (7, 19), (8, 20), (9, 18),
         (11, 10), (13, 2)),
        ((0, 0), (2, 4), (3, 8), (4, 9), (5, 10), (6, 11), (7, 12), (8, 11), (9, 12),
         (10, 11), (11, 12), (12, 8), (13, 4)),
    )
    assert result.peak_bytes == (21.0, 12.0)


def test_zbv_with_transfers_free_at_the_turn_of_the_v() -> None:
    # stages 0, 3 on rank 0 and 1, 2 on rank 1; F = I = W = 1; 0.5 ms over cuts 0 and 2,
    # nothing over cut 1 (stages 1 and 2 share rank 1) although 0.5 is given
    c = costs(4, 1.0, 1.0, 1.0, comm_fwd_ms=(0.5,) * 3, comm_bwd_ms=(0.5,) * 3)
    result = simulate_schedule("zbv", 2, 2, 2, c)
    assert timeline(result) == table(
        "0F0 0–1, 0F1 1–2, 3F0 4–5, 3I0 5–6, 3W0 6–7, 3F1 7–8, 3I1 8–9, 3W1 9–10, "
        "0I0 10–11, 0W0 11–12, 0I1 14–15, 0W1 15–16",
        "1F0 1.5–2.5, 2F0 2.5–3.5, 1F1 3.5–4.5, 2F1 4.5–5.5, 2I0 6.5–7.5, 2W0 7.5–8.5, "
        "1I0 8.5–9.5, 1W0 9.5–10.5, 2I1 10.5–11.5, 2W1 11.5–12.5, 1I1 12.5–13.5, 1W1 13.5–14.5",
    )
    assert result.step_ms == 16.0
    assert result.busy_ms == (12.0, 12.0)


def test_a_transfer_starts_when_its_send_is_posted() -> None:
    """p = 2, m = 2, F = 1, B = 2, 0.5 ms over the cut each way; rank 0 runs 0F0 0F1 0B0 0B1,
    rank 1 1F0 1B0 1F1 1B1 (receives posted right before the action that needs them).

    Sends posted right after their action (the default):

    ========  ==================================
    rank 0    0F0 0–1, 0F1 1–2, 0B0 5–7, 0B1 8.5–10.5
    rank 1    1F0 1.5–2.5, 1B0 2.5–4.5, 1F1 5–6, 1B1 6–8
    ========  ==================================

    Rank 0 posting both forward sends after 0F1 (as DualPipeV posts an overlapped forward's
    send after the pair's backward): 1F0's input moves from 2, and everything after moves by
    one: 1F0 2.5–3.5, 1B0 3.5–5.5, 1F1 6–7, 1B1 7–9; 0B0 6–8, 0B1 9.5–11.5.
    """
    order = ScheduleOrder(
        "1f1b", "by hand", 2, 1, 2, (0, 1),
        ((Action("F", 0, 0), Action("F", 0, 1), Action("B", 0, 0), Action("B", 0, 1)),
         (Action("F", 1, 0), Action("B", 1, 0), Action("F", 1, 1), Action("B", 1, 1))))
    c = costs(2, 1.0, 2.0, comm_fwd_ms=(0.5,), comm_bwd_ms=(0.5,))
    assert timeline(replay(order, c)) == table(
        "0F0 0–1, 0F1 1–2, 0B0 5–7, 0B1 8.5–10.5",
        "1F0 1.5–2.5, 1B0 2.5–4.5, 1F1 5–6, 1B1 6–8",
    )
    late = dataclasses.replace(order, sends=((("F", 0, 0, 2), ("F", 0, 1, 2)), ()))
    result = replay(late, c)
    assert timeline(result) == table(
        "0F0 0–1, 0F1 1–2, 0B0 6–8, 0B1 9.5–11.5",
        "1F0 2.5–3.5, 1B0 3.5–5.5, 1F1 6–7, 1B1 7–9",
    )
    assert result.step_ms == 11.5


def test_transfers_on_the_cores_cost_the_sender_and_a_busy_receiver() -> None:
    """GPipe, 2 ranks, 2 micro-batches: F = 2, 4 ms, B = 4, 5 ms, every transfer 2 ms, the
    ranks' cores making the copies (gloo between CPU workers), worked by hand.

    Rank 0: F(0,0) [0, 2], then its send's copy until 4; F(0,1) [4, 6], copy until 8.
    Rank 1 posts each receive when its last action ends: F(1,0)'s transfer starts at 2,
    [4, 8]; F(1,1)'s at 8, [10, 14]; B(1,0) [14, 19], copy until 21; B(1,1) [21, 26], copy
    until 28. Rank 0's B(0,0): its gradient's transfer starts at 19, [21, 25]; B(0,1)'s at 26,
    [28, 32]. Without the copies the step is 31: only B(1,1) waits for one (B(1,0)'s).

    With rank 1's forward receives posted at once instead, F(1,1)'s transfer starts at 6,
    while F(1,0) runs: rank 1 pays the 2 ms of it made before it is free at 8, F(1,1) [8, 14]
    and the same step, 32; without the copies F(1,1) [8, 12] and the step is 29."""
    order = torch_order("gpipe", 2, 1, 2)
    early = dataclasses.replace(order, posts=(order.posts[0], (("F", 1, 0, 0), ("F", 1, 1, 0))))
    costs = StageCosts((2.0, 4.0), (4.0, 5.0), comm_fwd_ms=(2.0,), comm_bwd_ms=(2.0,))
    cores = dataclasses.replace(costs, transfers_on_cores=True)
    spans = lambda t: [[(a.start_ms, a.end_ms) for a in row] for row in t.actions]
    on = replay(order, cores)
    assert spans(on) == [[(0, 2), (4, 6), (21, 25), (28, 32)],
                         [(4, 8), (10, 14), (14, 19), (21, 26)]]
    assert on.step_ms == 32.0 and replay(order, costs).step_ms == 31.0
    assert simulate([2.0, 4.0], [4.0, 5.0], 2, "gpipe", [2.0], [2.0],
                    transfers_on_cores=True).step_ms == 32.0
    early_on, early_off = replay(early, cores), replay(early, costs)
    assert spans(early_on)[1][1] == (8.0, 14.0) and early_on.step_ms == 32.0
    assert spans(early_off)[1][1] == (8.0, 12.0) and early_off.step_ms == 29.0


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_sends_are_posted_where_torch_posts_them(schedule: str) -> None:
    """Every send crossing ranks is listed once, posted right after the action that computed
    it, except DualPipeV's overlapped pairs: the forward's send waits for the pair's backward."""
    v = 1 if schedule in ("gpipe", "1f1b") else 2
    order = torch_order(schedule, 2, v, 6)
    late = 0
    for r, row in enumerate(order.sends):
        listed = {(what, s, i) for what, s, i, _ in row}
        assert len(listed) == len(row)
        for what, s, i, after in row:
            made = order.actions[r][after - 1]
            to = s + 1 if what == "F" else s - 1
            assert order.stage_rank[s] == r != order.stage_rank[to]
            if (made.stage, made.microbatch) == (s, i):
                assert made.kind == what or (what == "G" and made.kind in ("B", "I"))
            else:  # the backward of an overlapped pair, right after the forward
                late += 1
                assert what == "F" and made.kind == "B"
                assert order.actions[r][after - 2] == Action("F", s, i)
        crossing = {("F", a.stage, a.microbatch) if a.kind == "F" else ("G", a.stage, a.microbatch)
                    for a in order.actions[r] if a.kind != "W"
                    and 0 <= (to := a.stage + 1 if a.kind == "F" else a.stage - 1) < order.n
                    and order.stage_rank[to] != r}
        assert listed == crossing
    assert (late > 0) == (schedule == "dualpipev")


# -- memory ---------------------------------------------------------------------------------------


def test_gpipe_and_1f1b_memory_peaks() -> None:
    c = costs(2, 1.0, 2.0, activation_bytes=(100, 10))
    assert simulate_schedule("gpipe", 2, 1, 3, c).peak_bytes == (300, 30)
    one = simulate_schedule("1f1b", 2, 1, 3, c)
    assert timeline(one) == table(
        "0F0 0–1, 0F1 1–2, 0B0 4–6, 0F2 6–7, 0B1 7–9, 0B2 10–12",
        "1F0 1–2, 1B0 2–4, 1F1 4–5, 1B1 5–7, 1F2 7–8, 1B2 8–10",
    )
    assert one.memory == (
        ((0, 0), (1, 100), (2, 200), (6, 100), (7, 200), (9, 100), (12, 0)),
        ((0, 0), (2, 10), (4, 0), (5, 10), (7, 0), (8, 10), (10, 0)),
    )
    assert one.peak_bytes == (200, 10)


def test_checkpointing_keeps_the_input_and_recomputes_in_the_backward() -> None:
    # stage 0 checkpointed: keeps its 4-byte input, recomputes (F = 1) inside B (2): B takes 3
    # and holds the 100 recomputed bytes from its start until its end
    c = costs(2, 1.0, 2.0, activation_bytes=(100, 10), input_bytes=(4, 50),
              checkpoint=(True, False))
    result = simulate_schedule("gpipe", 2, 1, 2, c)
    assert timeline(result) == table(
        "0F0 0–1, 0F1 1–2, 0B0 5–8, 0B1 8–11",
        "1F0 1–2, 1F1 2–3, 1B0 3–5, 1B1 5–7",
    )
    assert result.busy_ms == (8.0, 6.0)
    assert result.memory == (
        ((0, 0), (1, 4), (2, 8), (5, 108), (8, 104), (11, 0)),
        ((0, 0), (2, 10), (3, 20), (5, 10), (7, 0)),
    )
    assert result.peak_bytes == (108, 20)


def test_checkpointing_adds_the_forward_to_the_input_backward_only() -> None:
    c = StageCosts((1.5,), (2.0,), (0.25,), checkpoint=(True,))
    assert (c.duration_ms("F", 0), c.duration_ms("I", 0), c.duration_ms("W", 0),
            c.duration_ms("B", 0)) == (1.5, 3.5, 0.25, 3.75)


# -- bad costs ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "error", "words"),
    [
        ({"fwd_ms": (1.0, -1.0)}, InvalidInputError, "fwd_ms[1] must be a finite number ≥ 0"),
        ({"bwd_input_ms": (1.0,)}, InvalidInputError, "bwd_input_ms must have 2 entries"),
        ({"comm_fwd_ms": (1.0, 1.0)}, InvalidInputError, "comm_fwd_ms must have 1 entries"),
        ({"activation_bytes": (1.0, float("nan"))}, InvalidInputError, "activation_bytes[1]"),
        ({"checkpoint": (1, 0)}, ArgumentTypeError, "checkpoint[0] must be True or False"),
        ({"transfers_on_cores": 1}, ArgumentTypeError, "transfers_on_cores must be True or"),
        ({"fwd_ms": "12"}, ArgumentTypeError, "fwd_ms must be a list"),
    ],
)
def test_bad_costs(kwargs: dict, error: type, words: str) -> None:
    given_ = {"fwd_ms": (1.0, 1.0), "bwd_input_ms": (1.0, 1.0), **kwargs}
    with pytest.raises(error) as info:
        StageCosts(**given_)
    assert words in str(info.value)


def test_costs_must_cover_every_stage_of_the_order() -> None:
    with pytest.raises(InvalidInputError, match=r"p·v = 2·2 = 4"):
        replay(torch_order("interleaved-1f1b", 2, 2, 2), costs(2, 1.0, 1.0))



def test_what_the_runtime_sends_is_kept_until_it_waits_for_the_sends() -> None:
    # ScheduleGPipe waits for its backward sends at the end of the step, Schedule1F1B one
    # step of its loop later (nothing kept), the action-list runtime for every send at the end;
    # every runtime keeps a stage's output in its cache from the forward to the backward
    sends = {"output_bytes": (5.0, 0.0), "input_grad_bytes": (0.0, 3.0)}
    gpipe = simulate_schedule("gpipe", 2, 1, 2, costs(2, 1.0, 2.0, **sends))
    # rank 0: both outputs cached after the forwards (10), gone after the backwards
    assert gpipe.peak_bytes == (10.0, 6.0)
    assert [curve[-1][1] for curve in gpipe.memory] == [0.0, 6.0]
    one_f_one_b = simulate_schedule("1f1b", 2, 1, 2, costs(2, 1.0, 2.0, **sends))
    assert one_f_one_b.peak_bytes == (10.0, 0.0)
    assert [curve[-1][1] for curve in one_f_one_b.memory] == [0.0, 0.0]
    # interleaved 1F1B: stages 0, 2 on rank 0 and 1, 3 on rank 1; each forward but the last
    # stage's sends 1 byte, each backward but stage 0's sends 1 byte back: all kept
    interleaved = simulate_schedule("interleaved-1f1b", 2, 2, 2, costs(
        4, 1.0, 2.0, output_bytes=(1, 1, 1, 0), input_grad_bytes=(0, 1, 1, 1)))
    assert interleaved.peak_bytes == (6.0, 6.0)
    assert [curve[-1][1] for curve in interleaved.memory] == [6.0, 6.0]


def test_an_output_the_stage_saves_is_counted_once() -> None:
    # stage 0 saves 8 bytes per micro-batch, its whole output (5 bytes) among them: GPipe
    # holds 2 × 8 after the forwards, not 2 × (8 + 5)
    saved = {"activation_bytes": (8.0, 0.0), "output_bytes": (5.0, 0.0),
             "output_saved_bytes": (5.0, 0.0)}
    assert simulate_schedule("gpipe", 2, 1, 2, costs(2, 1.0, 2.0, **saved)).peak_bytes == \
        (16.0, 0.0)
    # the action-list runtime keeps what it sent until the step ends: the 5 output bytes of
    # each of rank 0's 4 forwards (stages 0 and 2) and of rank 1's 2 (stage 1) outlive the
    # activations; at most 4 × 8 on rank 0 while the activations are held
    interleaved = simulate_schedule("interleaved-1f1b", 2, 2, 2, costs(
        4, 1.0, 2.0, activation_bytes=(8, 8, 8, 0), output_bytes=(5, 5, 5, 0),
        output_saved_bytes=(5, 5, 5, 0)))
    assert interleaved.peak_bytes == (32.0, 16.0)
    assert [curve[-1][1] for curve in interleaved.memory] == [20.0, 10.0]
    with pytest.raises(InvalidInputError, match=r"output_saved_bytes\[0\] = 6"):
        costs(2, 1.0, 1.0, activation_bytes=(8, 0), output_bytes=(5, 0),
              output_saved_bytes=(6, 0))


def test_a_backward_needs_its_transient_bytes_above_what_is_held_when_it_starts() -> None:
    # GPipe, m = 2: rank 0 holds 2 × 8 when its first backward starts (16 + 3); rank 1 2 × 4
    # (8 + 100); neither is held after the step
    timeline = simulate_schedule("gpipe", 2, 1, 2, costs(
        2, 1.0, 2.0, activation_bytes=(8.0, 4.0), transient_bytes=(3.0, 100.0)))
    assert timeline.peak_bytes == (19.0, 108.0)
    assert [max(level for _, level in curve) for curve in timeline.memory] == [16.0, 8.0]
