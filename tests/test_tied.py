"""Shared (tied) parameters: traced once, recorded in the plan, trained as one in every runtime.

A tied language model (``head.weight is embed.weight``) split so that the embedding and the
head sit on different stages: one process (partition(), the emitted module) keeps one
parameter; ``autosplit run``'s ranks each keep a copy and sum its gradient after every step.
Every run is compared with the unsplit model on the same micro-batches.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from conftest import assert_equivalent
from models import ReusedLayer, TiedFunctional, TiedLM, TokenModel
from synthetic import format_1
from test_distributed import (
    TIMEOUT_S,
    assert_same_training,
    build,
    make_plan,
    reference,
    train_and_gather,
)

import autosplit
from autosplit import PlanOptions, ProfileOptions, distributed
from autosplit.codegen import emit
from autosplit.cost import optimizer_factor
from autosplit.planner import plan_with_balance
from autosplit.records import Plan, SharedParam, SharedWeight
from autosplit.simulator import simulate_plan

LR = 0.5  # large: copies trained apart drift visibly after one step


def _ids(rows: int) -> tuple[torch.Tensor]:
    return (torch.randint(0, 11, (rows, 5), generator=torch.Generator().manual_seed(3)),)


def _plan(model: torch.nn.Module, stages: int, split: int = 2) -> Plan:
    prof = autosplit.profile(model, _ids(8),
                             options=ProfileOptions(microbatch_sizes=[split], warmup=0, repeats=1))
    return autosplit.plan(prof, gpus=stages, options=PlanOptions(split_size=split))


# ------------------------------------------------------------------------------ the trace


def test_trace_finds_tied_weights_used_through_a_module_or_directly() -> None:
    assert autosplit.trace(TiedLM()).shared_params == (SharedParam("embed.weight", (0, 6), 352),)
    assert autosplit.trace(TiedFunctional()).shared_params == (
        SharedParam("embed.weight", (0, 2), 352),
    )
    reused = autosplit.trace(ReusedLayer())
    assert [(s.name, s.blocks) for s in reused.shared_params] == [
        ("shared.weight", (1, 4)), ("shared.bias", (1, 4)),
    ]
    assert autosplit.trace(TokenModel()).shared_params == ()


# ------------------------------------------------------------------------------- the plan


def test_plan_records_the_shared_weight_and_round_trips(tmp_path: Path) -> None:
    model = TiedLM()
    plan = _plan(model, 3)
    (weight,) = plan.shared
    assert weight.name == "embed.weight" and weight.bytes == 352
    assert weight.stages == (0, 2) and weight.mode == "all-reduce" and weight.sync_ms > 0
    line = "shared weight embed.weight: stages 0 and 2, gradients all-reduced each step"
    assert line in str(plan)
    plan.save(tmp_path / "plan.json")
    assert Plan.load(tmp_path / "plan.json") == plan
    one = _plan(model, 1)
    assert one.shared == (SharedWeight("embed.weight", (0,), "one stage", 352, 0.0),)
    assert "shared weight embed.weight: stage 0, one copy" in str(one)


def test_the_weights_of_one_shared_layer_are_said_in_one_line() -> None:
    """ALBERT's one layer holds 16 weights that its calls share: one line names the layer,
    the tensors counted and their bytes and all-reduce times summed; two weights keep a line
    each."""
    from autosplit.plan_text import shared_lines

    layer = [SharedWeight(f"encoder.layer.{name}.weight", (0, 1), "all-reduce", 1024, 0.25)
             for name in ("query", "key", "value")]
    tied = SharedWeight("embed.weight", (0, 1), "one rank", 2048, 0.0)
    assert shared_lines([*layer, tied]) == [
        "shared weights of encoder.layer (3 tensors): stages 0 and 1, gradients all-reduced "
        "each step (3.0 KiB, 0.750 ms)",
        "shared weight embed.weight: stages 0 and 1, on one rank: one copy (2.0 KiB)",
    ]
    assert len(shared_lines(layer[:2])) == 2


@pytest.mark.parametrize("schedule", ["zbv", "dualpipev"])
def test_a_weight_shared_by_stages_of_one_rank_costs_no_all_reduce(schedule: str,
                                                                   tmp_path: Path) -> None:
    prof = autosplit.profile(TiedLM(), _ids(8),
                             options=ProfileOptions(microbatch_sizes=[2], warmup=0, repeats=1))
    # V-shaped: 4 stages on 2 ranks, rank 0 holds the first and the last (embedding and head)
    v_shaped = autosplit.plan(prof, gpus=2, options=PlanOptions(split_size=2, schedule=schedule))
    (weight,) = v_shaped.shared
    assert weight.stages == (0, 3) and weight.mode == "one rank" and weight.sync_ms == 0.0
    assert v_shaped.predicted_step_ms == simulate_plan(v_shaped).step_ms + v_shaped.update_ms
    assert "shared weight embed.weight: stages 0 and 3, on one rank: one copy" in str(v_shaped)
    v_shaped.save(tmp_path / "plan.json")
    assert Plan.load(tmp_path / "plan.json") == v_shaped
    # looped: stage 0 on rank 0, stage 3 on rank 1, the copies summed after each step
    looped = autosplit.plan(prof, gpus=2,
                            options=PlanOptions(split_size=2, schedule="interleaved-1f1b"))
    (weight,) = looped.shared
    assert weight.stages == (0, 3) and weight.mode == "all-reduce" and weight.sync_ms > 0
    assert looped.predicted_step_ms == pytest.approx(simulate_plan(looped).step_ms
                                                     + weight.sync_ms + looped.update_ms)


def test_plans_saved_before_shared_weights_load_with_none(tmp_path: Path) -> None:
    plan = _plan(TiedLM(), 2)
    plan.save(tmp_path / "new.json")
    data = format_1(json.loads((tmp_path / "new.json").read_text()))
    del data["shared"]
    (tmp_path / "old.json").write_text(json.dumps(data))
    assert Plan.load(tmp_path / "old.json") == dataclasses.replace(plan, shared=())


def test_a_bad_mode_is_refused() -> None:
    with pytest.raises(autosplit.errors.InvalidInputError, match="mode"):
        SharedWeight("embed.weight", (0, 1), "copy", 4)


def test_memory_counts_the_copy_on_every_stage_that_holds_it() -> None:
    model = TiedLM()
    prof = autosplit.profile(model, _ids(8),
                             options=ProfileOptions(microbatch_sizes=[2], warmup=0, repeats=1))
    split = plan_with_balance(prof, (6, 1), 2)  # head alone: it holds a copy
    alone = dataclasses.replace(prof, shared=())  # as if nothing were shared
    untied = plan_with_balance(alone, (6, 1), 2)
    held = 352 * optimizer_factor("sgd")  # the weight and its gradient
    assert split.stages[1].memory_bytes == untied.stages[1].memory_bytes + held
    assert split.stages[0].memory_bytes == untied.stages[0].memory_bytes
    whole = plan_with_balance(prof, (7,), 2)  # one copy, counted once
    once = plan_with_balance(alone, (7,), 2)
    assert whole.stages[0].memory_bytes == once.stages[0].memory_bytes
    sync_ms = split.shared[0].sync_ms
    assert split.predicted_step_ms == pytest.approx(untied.predicted_step_ms + sync_ms)


# ----------------------------------------------------------------------- one process


@pytest.mark.parametrize("stages", [2, 3])
def test_partition_trains_the_one_tied_weight(stages: int) -> None:
    model = TiedLM()
    ref = copy.deepcopy(model)
    plan = _plan(model, stages)
    assert plan.shared[0].mode == "all-reduce"
    pm = autosplit.partition(model, plan=plan, devices=["cpu"] * stages)
    assert_equivalent(model, pm, ref, _ids(8), plan.split_size)
    assert model.head.weight is model.embed.weight


def test_partition_reads_a_tied_weight_on_another_device_through_to() -> None:
    # "cpu:0" is not "cpu" for torch.device equality: the head's stage counts as another
    # device and uses the embedding's weight through .to(), the path GPUs take
    model = TiedLM()
    ref = copy.deepcopy(model)
    plan = _plan(model, 3)
    pm = autosplit.partition(model, plan=plan, devices=["cpu", "cpu", "cpu:0"])
    assert pm.borrowed_weights == {2: ("head.weight",)}
    assert_equivalent(model, pm, ref, _ids(8), plan.split_size)


@pytest.mark.parametrize("last", ["cpu", "cpu:0"])  # cpu:0: another device, as above
def test_emitted_module_trains_the_one_tied_weight(tmp_path: Path, last: str) -> None:
    (tmp_path / "tied_lm.py").write_text(TIED_FILE)
    mf = autosplit.modelfile.load_model_file(str(tmp_path / "tied_lm.py"))
    model = mf.build()
    ref = copy.deepcopy(model)
    plan = _plan(model, 3)
    path = tmp_path / "pipelined.py"
    path.write_text(emit(plan, mf.ref, model=model))
    spec = importlib.util.spec_from_file_location(f"tied_pipelined_{last[-1]}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    pm = module.PipelinedTiedLM(model=model, devices=["cpu", "cpu", last])
    assert list(pm.borrowed) == ([] if last == "cpu" else [2])
    assert_equivalent(model, pm, ref, _ids(8), plan.split_size)


TIED_FILE = f'''
import sys
sys.path.insert(0, {str(Path(__file__).resolve().parent)!r})
from models import TiedLM


def build_model():
    return TiedLM()
'''


# ------------------------------------------------------------------------- many processes


def _tied_worker(name: str, plans: list[Plan], steps: int) -> Any:
    """Train ``steps`` SGD steps per plan; rank 0 merges the ranks' snapshots, checking that
    every parameter that two ranks hold is identical on both."""
    merged = []
    for plan in plans:
        gathered = train_and_gather(name, plan, steps, LR)
        if gathered is not None:
            merged.append(_merge(gathered, len(plan.stages) - 1, steps))
    return merged if dist.get_rank() == 0 else None


def _merge(gathered: list[Any], last: int, steps: int) -> dict[str, Any]:
    result: dict[str, Any] = {
        "losses": next(ls for ls, _, idx in gathered if last in idx), "steps": [], "copies": set(),
    }
    for step in range(steps):
        part: dict[str, dict[str, torch.Tensor]] = {"grads": {}, "params": {}, "buffers": {}}
        for _, rank_snaps, _ in gathered:
            for key, values in part.items():
                for n, value in rank_snaps[step][key].items():
                    if n in values:  # a copy: bit for bit the other rank's
                        assert torch.equal(values[n], value), f"{key} {n} differ at step {step}"
                        result["copies"].add(n)
                    values[n] = value
        result["steps"].append(part)
    result["stages_per_rank"] = [idx for _, _, idx in gathered]
    return result


TIED_CASES = {
    # name: (model, blocks per stage, ranks, copies held by two ranks or more)
    "tied-2": ("tied", (3, 4), 2, {"embed.weight"}),
    "tied-3": ("tied", (2, 3, 2), 3, {"embed.weight"}),
    "tied-4-stages-on-2": ("tied", (2, 2, 2, 1), 2, {"embed.weight"}),
    "reused-3": ("reused", (1, 3, 2), 3, {"shared.weight", "shared.bias"}),  # ranks 1 and 2
    "reused-4-stages-on-2": ("reused", (1, 1, 2, 2), 2, set()),  # stages 1 and 3: one rank
}


@pytest.mark.parametrize("case", list(TIED_CASES))
def test_ranks_train_shared_weights_as_one(case: str) -> None:
    name, balance, ranks, copies = TIED_CASES[case]
    model = build(name)
    plans = [make_plan(model, balance, 2, 4, schedule) for schedule in ("gpipe", "1f1b")]
    results = distributed.launch(_tied_worker, ranks, name, plans, 2, timeout_s=TIMEOUT_S)
    for plan, got in zip(plans, results[0], strict=True):
        assert got["copies"] == copies
        assert_same_training(got, reference(name, plan, 2, lr=LR))
