"""Every schedule torch.distributed.pipelining runs, and checkpointed stages, on 2 gloo ranks.

One launch trains every plan in turn (``test_every_schedule_trains_like_one_process``): each of
autosplit's schedules (:data:`autosplit.schedules.SCHEDULES`: GPipe and 1F1B with one stage per
rank, looped BFS, interleaved 1F1B, interleaved zero-bubble, ZB-V and DualPipeV with two)
plainly and with every stage under activation checkpointing. The loss, every parameter's
gradient, the parameters after each SGD step and the BatchNorm statistics equal one process
on the same micro-batches (see :mod:`test_distributed`). The model (``DropNorm``) draws dropout
masks in stage 0 only, which sits on rank 0 in both the looped and the V placement: rank 0
draws them in micro-batch order from the same seed as the one process, so the masks agree, and
a checkpointed stage must draw the same masks again in its recomputation. A tied language
model (``TiedLM``, embedding and head on stages 0 and 3) runs the zero-bubble schedules too:
on one rank (ZB-V, DualPipeV) or on two that sum its gradient (interleaved zero-bubble).
"""

from __future__ import annotations

import argparse
import dataclasses

import pytest
from test_distributed import (
    TIMEOUT_S,
    assert_same_training,
    build,
    loss_fn,
    make_plan,
    one_rank_group,  # noqa: F401 - a fixture
    reference,
)
from test_hybrid import _worker
from test_tied import LR

from autosplit import distributed
from autosplit.cli import run as cli_run
from autosplit.distributed.stage_module import check_schedule
from autosplit.errors import InvalidInputError, ScheduleUnavailableError
from autosplit.records import Plan
from autosplit.schedules import SCHEDULES

V_PLACED = ("zbv", "dualpipev")


def schedule_plan(name: str, balance: tuple[int, ...], schedule: str, *, m: int = 4,
                  v: int = 1, checkpoint: bool = False) -> Plan:
    """A plan of ``balance`` stages, v per rank, under ``schedule``, micro-batches of 2.

    The schedule is set past the plan's validation, which may not know every schedule the
    runtime runs."""
    plan = make_plan(build(name), balance, 2, m)
    stages = tuple(dataclasses.replace(s, checkpoint=checkpoint) for s in plan.stages)
    plan = dataclasses.replace(plan, stages=stages, stages_per_rank=v)
    object.__setattr__(plan, "schedule", schedule)
    return plan


def every_schedule(name: str, two: tuple[int, ...], four: tuple[int, ...],
                   checkpoint: bool) -> list[Plan]:
    """Every schedule on 2 ranks: gpipe and 1f1b on ``two`` stages, the others on ``four``."""
    return [schedule_plan(name, two, s, checkpoint=checkpoint) if s in ("gpipe", "1f1b")
            else schedule_plan(name, four, s, v=2, checkpoint=checkpoint) for s in SCHEDULES]


def test_every_schedule_trains_like_one_process() -> None:
    plans = [*every_schedule("dropnorm", (2, 3), (1, 2, 1, 1), False),
             *every_schedule("dropnorm", (2, 3), (1, 2, 1, 1), True)]
    cases = [("dropnorm", plan, LR) for plan in plans]
    cases += [("tied", schedule_plan("tied", (2, 2, 2, 1), s, v=2), LR)
              for s in ("interleaved-zb", *V_PLACED)]
    results = distributed.launch(_worker, 2, cases, 2, timeout_s=TIMEOUT_S)
    for (name, plan, lr), got in zip(cases, results[0], strict=True):
        if plan.stages_per_rank == 1:
            expected_place = [[0], [1]]
        else:
            expected_place = [[0, 3], [1, 2]] if plan.schedule in V_PLACED else [[0, 2], [1, 3]]
        assert got["stages_per_rank"] == expected_place, plan.schedule
        assert_same_training(got, reference(name, plan, 2, lr))


def test_stage_placement_is_torchs() -> None:
    assert distributed.stage_indices(4, 0, 2, v_shape=True) == (0, 3)
    assert distributed.stage_indices(6, 1, 3, v_shape=True) == (1, 4)
    assert distributed.stage_indices(6, 1, 3) == (1, 4)
    assert distributed.stage_indices(6, 2, 3, v_shape=True) == (2, 3)


@pytest.mark.parametrize(("schedule", "ranks", "v", "m", "replicas", "words"), [
    ("zbv", 2, 1, 4, 1, (r"schedule 'zbv': the plan places 1 stage per rank \(4 stages on 4 "
                         r"ranks per replica\), not 2 on 2: run it on 4 ranks")),
    ("zbv", 1, 4, 4, 1, r"ScheduleZBVZeroBubble.*exactly 2 stages per rank, but got 4"),
    ("dualpipev", 2, 2, 3, 1, r"DualPipeV.*at least as many microbatches as stages"),
    ("interleaved-1f1b", 2, 2, 5, 1, r"ScheduleInterleaved1F1B.*multiple of the number of"),
    ("gpipe", 1, 2, 4, 1, r"places 2 stages per rank \(4 stages on 2 ranks per replica\), not"),
    ("interleaved-zb", 2, 2, 4, 2, r"'interleaved-zb' with 2 replicas: .* cannot all-reduce"),
    ("zbv", 2, 2, 4, 2, r"'zbv' with 2 replicas"),
])
def test_schedules_torch_cannot_run_are_refused(schedule: str, ranks: int, v: int, m: int,
                                                replicas: int, words: str) -> None:
    plan = schedule_plan("dropnorm", (1, 2, 1, 1), schedule, m=m, v=v)
    with pytest.raises(InvalidInputError, match=words):
        check_schedule(plan, ranks, replicas=replicas)


@pytest.mark.usefixtures("one_rank_group")
def test_trainer_refuses_before_building() -> None:
    model = build("dropnorm")
    plan = schedule_plan("dropnorm", (1, 2, 1, 1), "dualpipev", m=2, v=4)
    with pytest.raises(ScheduleUnavailableError, match="exactly 2 stages per rank") as info:
        distributed.Trainer(model, plan, loss_fn)
    assert (info.value.schedule, info.value.p, info.value.v) == ("dualpipev", 1, 4)
    unknown = schedule_plan("dropnorm", (2, 3), "zigzag")
    with pytest.raises(InvalidInputError, match="plan schedule 'zigzag' is not one of gpipe"):
        distributed.Trainer(model, unknown, loss_fn)


def test_run_starts_the_ranks_the_plan_places() -> None:
    """``autosplit run`` starts p / v ranks per replica by default."""
    args = argparse.Namespace(nproc=None)
    assert cli_run._ranks(args, schedule_plan("dropnorm", (1, 2, 1, 1), "zbv", v=2)) == 2
    assert cli_run._ranks(args, schedule_plan("dropnorm", (1, 2, 1, 1), "1f1b")) == 4
    with pytest.raises(InvalidInputError, match=r"--nproc 4: schedule 'zbv': the plan places 2"):
        cli_run._ranks(argparse.Namespace(nproc=4),
                       schedule_plan("dropnorm", (1, 2, 1, 1), "zbv", v=2))
