"""The one planning workflow: partition(), `autosplit plan` and `autosplit compare` agree on one
profile; candidates block sums separate are not verified; what verification changed is told."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Mapping, Sequence

import pytest
import torch
from synthetic import make_profile

import autosplit
from autosplit import PartitionOptions, PlanOptions, partitioning
from autosplit.cli import main
from autosplit.planner import plan_layouts
from autosplit.records import Plan, Profile
from autosplit.schedules import SEARCHED
from autosplit.workflow import (
    SEPARATED,
    Planned,
    PlanRequest,
    choose_plan,
    schedules_worth_measuring,
)

MODEL_FILE = '''
import torch
from torch import nn

def build_model():
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(8, 8) for _ in range(6)])

def example_inputs(batch_size=8):
    return torch.randn(batch_size, 8)
'''

COSTS = [[1.0, 0.8], [3.0, 2.2], [1.0, 0.9], [2.0, 1.9], [4.0, 2.0], [1.5, 1.4]]  # ms/sample


def _model_and_profile(tmp_path) -> tuple[str, torch.nn.Module, Profile]:
    """A model file, its model, and a profile of it with made-up block times (ms per sample
    ``COSTS``, at b = 2 and 4; batch 8)."""
    path = tmp_path / "six.py"
    path.write_text(MODEL_FILE)
    model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(6)])
    graph = autosplit.trace(model)
    prof = make_profile([2, 4], COSTS, batch_size=8, param_bytes=[288] * 6,
                        cut_bytes_per_sample=[32] * 5)
    blocks = tuple(dataclasses.replace(b, name=n) for b, n in zip(prof.blocks, graph.block_names))
    prof = dataclasses.replace(prof, model=graph.model_name, fingerprint=graph.fingerprint,
                               blocks=blocks, allreduce_bytes_per_s=1e9,
                               allreduce_latency_ms=0.5, link_bytes_per_s=2e9)
    return str(path), model, prof


def _shape(plan: Plan) -> tuple:
    return ([len(s.blocks) for s in plan.stages], plan.replicas, plan.split_size,
            plan.schedule, round(plan.predicted_step_ms, 6))


def test_partition_plan_and_compare_choose_the_same_plan_on_one_profile(
        tmp_path, capsys, monkeypatch) -> None:
    path, model, prof = _model_and_profile(tmp_path)
    saved = tmp_path / "profile.json"
    prof.save(saved)
    expected = choose_plan(prof, PlanRequest(devices=2, options=PlanOptions(schedule="gpipe"),
                                             pipeline_only=True)).plan

    monkeypatch.setattr(partitioning, "profile_graph", lambda *a, **k: prof)
    with pytest.warns(UserWarning, match="CPU stand-ins"):
        pm = autosplit.partition(model, torch.randn(8, 8), gpus=2,
                                 options=PartitionOptions(verify=False))
    assert _shape(pm.plan) == _shape(expected)

    out = tmp_path / "plan.json"
    assert main(["plan", path, "--gpus", "2", "--profile", str(saved), "--schedule", "gpipe",
                 "--pipeline-only", "-o", str(out)]) == 0
    assert _shape(Plan.load(out)) == _shape(expected)

    assert main(["compare", path, "--gpus", "2", "--profile", str(saved),
                 "--schedule", "gpipe"]) == 0
    printed = capsys.readouterr().out
    row = next(line for line in printed.splitlines() if line.strip().startswith("autosplit"))
    assert f"{expected.split_size}" in row

    # over every layout, the command's choice is the workflow's
    assert main(["plan", path, "--gpus", "2", "--profile", str(saved), "-o", str(out)]) == 0
    every = choose_plan(prof, PlanRequest(devices=2)).plan
    assert _shape(Plan.load(out)) == _shape(every)


class Recorder:
    """A verifier that times nothing: it keeps what it was given and chooses the last
    candidate, its step 10 % shorter (as a verification that disagrees with block sums)."""

    def __init__(self) -> None:
        self.candidates: list[Plan] = []
        self.others: dict[str, Plan] = {}

    def __call__(self, candidates: Sequence[Plan], others: Mapping[str, Plan]
                 ) -> tuple[Plan, dict[str, Plan]]:
        self.candidates, self.others = list(candidates), dict(others)
        chosen = candidates[-1]
        return (dataclasses.replace(chosen, predicted_step_ms=chosen.predicted_step_ms * 0.9),
                dict(others))


def test_candidates_block_sums_separate_are_not_verified(tmp_path) -> None:
    _, _, prof = _model_and_profile(tmp_path)
    recorder = Recorder()
    planned = choose_plan(prof, PlanRequest(devices=2), recorder)
    best = min(c.predicted_step_ms for c in planned.candidates)
    assert recorder.candidates, "something is verified"
    assert planned.set_aside, "the profile has a candidate block sums separate"
    for c in recorder.candidates:
        assert c.predicted_step_ms <= best * (1 + SEPARATED)
    for c in planned.set_aside:
        assert c.predicted_step_ms > best * (1 + SEPARATED)
    assert len(recorder.candidates) + len(planned.set_aside) == len(planned.candidates)
    assert planned.layouts is not None


def test_what_verification_changed_is_recorded(tmp_path) -> None:
    _, _, prof = _model_and_profile(tmp_path)
    recorder = Recorder()
    planned = choose_plan(prof, PlanRequest(devices=2, pipeline_only=True), recorder)
    assert planned.block_sum_choice is not None
    assert planned.block_sum_choice.predicted_step_ms == min(
        c.predicted_step_ms for c in planned.candidates)
    assert planned.changed == (len(recorder.candidates) > 1)
    assert planned.verify_s >= 0
    alone = choose_plan(prof, PlanRequest(devices=2, pipeline_only=True))
    assert not alone.changed and alone.verify_s == 0.0
    assert alone.plan == planned.block_sum_choice


def test_a_choice_with_replicas_is_shown_beside_the_best_pipeline(tmp_path) -> None:
    _, _, prof = _model_and_profile(tmp_path)

    def replicated_wins(candidates: Sequence[Plan], others: Mapping[str, Plan]
                        ) -> tuple[Plan, dict[str, Plan]]:
        return next(c for c in candidates if c.replicas > 1), dict(others)

    planned = choose_plan(prof, PlanRequest(devices=2), replicated_wins,
                          {"hand split": autosplit.plan(prof, 2,
                                                        options=PlanOptions(split_size=2))})
    labels = [label for label, _ in planned.references]
    assert labels == ["hand split", "the best pipeline"]
    assert planned.plan.replicas == 2
    assert all(p.replicas == 1 for _, p in planned.references)


def test_a_fixed_layout_is_verified_alone(tmp_path) -> None:
    _, _, prof = _model_and_profile(tmp_path)
    recorder = Recorder()
    planned = choose_plan(prof, PlanRequest(devices=2, replicas=2), recorder)
    assert [c.replicas for c in recorder.candidates] == [2]
    assert planned.references == () and planned.layouts is None
    with pytest.raises(autosplit.InvalidInputError, match="pipeline_only"):
        PlanRequest(devices=2, replicas=2, pipeline_only=True)


def test_planned_records_are_frozen(tmp_path) -> None:
    _, _, prof = _model_and_profile(tmp_path)
    planned = choose_plan(prof, PlanRequest(devices=2))
    assert isinstance(planned, Planned)
    with pytest.raises(dataclasses.FrozenInstanceError):
        planned.plan = planned.plan  # type: ignore[misc]


def _costs(profile: Profile, **action_ms: float) -> Profile:
    names = {k.replace("_", "-"): v for k, v in action_ms.items()}
    return dataclasses.replace(profile, action_ms=tuple(names.items()),
                               action_spread=tuple((n, 0.0) for n in names),
                               one_stage_action_ms=0.1, one_stage_action_spread=0.0)


def test_only_the_schedules_that_can_win_are_worth_measuring(tmp_path) -> None:
    _, _, light = _model_and_profile(tmp_path)
    light = _costs(light)
    request = PlanRequest(devices=2)
    # light weights: data parallelism is ahead; every schedule left out cannot beat it, even
    # at no runtime cost
    worth = schedules_worth_measuring(light, request, known=())
    best_known = plan_layouts(light, 2, replicas=2).best.predicted_step_ms
    checked = 0
    for name in sorted({n for n, _ in SEARCHED} - set(worth)):
        free = dataclasses.replace(light, action_ms=((name, 0.0),))
        with contextlib.suppress(autosplit.AutosplitError):  # not runnable on this profile
            assert autosplit.plan(free, 2,
                                  options=PlanOptions(schedule=name)).predicted_step_ms >= best_known
            checked += 1
    assert checked >= 2
    # heavy weights: the all-reduce is slow, pipelines can win; in the order of their bound
    heavy = dataclasses.replace(light, blocks=tuple(
        dataclasses.replace(b, param_bytes=50 * 10**6) for b in light.blocks))
    worth = schedules_worth_measuring(heavy, request, known=())
    assert len(worth) >= 2
    bounds = [autosplit.plan(dataclasses.replace(heavy, action_ms=((n, 0.0),)), 2,
                             options=PlanOptions(schedule=n)).predicted_step_ms for n in worth]
    assert bounds == sorted(bounds)
    # a schedule whose cost is known is not measured again; its plan lowers the bound
    known = _costs(heavy, **{worth[0].replace("-", "_"): 0.0})
    again = schedules_worth_measuring(known, request, known=(worth[0],))
    assert worth[0] not in again and set(again) < set(worth)


def test_data_parallelism_far_ahead_leaves_no_schedule_to_measure(tmp_path) -> None:
    _, _, prof = _model_and_profile(tmp_path)
    # every cut sends a lot: each pipeline is slow whatever the runtime costs
    cuts = tuple(dataclasses.replace(c, bytes=tuple(10**9 * b for b in c.bytes))
                 for c in prof.cuts)
    prof = _costs(dataclasses.replace(prof, cuts=cuts))
    assert schedules_worth_measuring(prof, PlanRequest(devices=2), known=()) == ()
    assert schedules_worth_measuring(prof, PlanRequest(devices=2, pipeline_only=True),
                                     known=()) != ()


def test_a_fixed_schedule_or_layout_needs_what_it_names(tmp_path) -> None:
    _, _, prof = _model_and_profile(tmp_path)
    assert schedules_worth_measuring(prof, PlanRequest(2, PlanOptions(schedule="1f1b")),
                                     ()) == ("1f1b",)
    assert schedules_worth_measuring(prof, PlanRequest(2, PlanOptions(schedule="1f1b")),
                                     ("1f1b",)) == ()
    every = schedules_worth_measuring(prof, PlanRequest(devices=2, replicas=2), ("gpipe",))
    assert "gpipe" not in every and "zbv" in every


def test_the_most_promising_schedule_is_measured_first_then_those_that_can_still_win(
        tmp_path, monkeypatch) -> None:
    import argparse
    import io
    import time

    from rich.console import Console

    from autosplit.cli import measuring
    from autosplit.measure import machine
    from autosplit.measure.machine_cache import MachineFigures, MachineKey, Measurers

    _, _, prof = _model_and_profile(tmp_path)
    heavy = _costs(dataclasses.replace(prof, blocks=tuple(
        dataclasses.replace(b, param_bytes=50 * 10**6) for b in prof.blocks)))
    request = PlanRequest(devices=2)
    worth = schedules_worth_measuring(heavy, request, known=())
    assert len(worth) > 2
    key = MachineKey("host", "gloo", "cpu", 2, 1, "test")
    asked: list[tuple[str, ...]] = []

    def actions(names):
        asked.append(tuple(names))
        return tuple((n, 0.0) for n in names), tuple((n, 0.0) for n in names)

    monkeypatch.setenv("AUTOSPLIT_CACHE", str(tmp_path / "machine.json"))
    monkeypatch.setattr(machine, "machine_measurers", lambda kind: (
        key, Measurers(lambda: (1e9, 0.5, 2e9), actions, lambda: (0.1, 0.0))))
    args = argparse.Namespace(schedule="auto", _machine_figures=[MachineFigures(
        key, time.time(), 1e9, 0.5, 2e9, one_stage_action_ms=0.1, one_stage_action_spread=0.0)])
    out = io.StringIO()
    priced = measuring.with_schedule_costs(args, heavy, request, Console(file=out, width=400))
    assert asked[0] == (worth[0],)  # the most promising, alone
    assert all(set(a) <= set(worth) for a in asked) and len(asked) <= 2
    rest = schedules_worth_measuring(priced, request, [n for n, _ in priced.action_ms])
    assert rest == ()  # nothing that can still win is left unmeasured
    assert "measured now: " + worth[0] in out.getvalue()
