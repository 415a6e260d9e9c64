"""autosplit.plan(): joint choice of cut points and micro-batch size; Plan files; bad input."""

from __future__ import annotations

import json

import pytest
import torch
from models import LongSkip, ToyModel
from synthetic import make_profile

import autosplit
from autosplit import PartitionOptions, PlanOptions, ProfileOptions
from autosplit.errors import (
    InfeasiblePlanError,
    InvalidInputError,
    ModelMismatchError,
    RecordFileError,
)


def test_balanced_cut_and_predicted_step() -> None:
    # four blocks of equal cost: 2 + 2; step = (m + p − 1) · bottleneck
    prof = make_profile([4], [[1.0]] * 4, batch_size=8)
    plan = autosplit.plan(prof, gpus=2)
    assert plan.balance == (2, 2)
    assert plan.split_size == 4 and plan.microbatches == 2
    assert plan.stages[0].compute_ms == pytest.approx(8.0)  # 2 blocks × 1 ms/sample × 4
    assert plan.predicted_step_ms == pytest.approx((2 + 2 - 1) * 8.0)  # balanced: exact
    assert plan.bound_step_ms == pytest.approx(plan.predicted_step_ms)
    assert plan.single_device_ms == pytest.approx(2 * 16.0)
    assert plan.single_device_split == 4  # 2 micro-batches of 4, accumulated
    assert plan.split_points == ("block2",)


def test_prefers_sizes_without_a_per_sample_cliff() -> None:
    # per-sample cost is 2× at b ≤ 12 (a cliff), flat above: b = 16 beats the smaller sizes
    sizes = [8, 12, 16, 24, 48]
    per_sample = [2.0, 2.0, 1.0, 1.0, 1.0]
    prof = make_profile(sizes, [per_sample] * 4, batch_size=48)
    plan = autosplit.plan(prof, gpus=2)
    assert plan.split_size == 16 and plan.microbatches == 3
    assert plan.candidates == tuple(sizes)


def test_chosen_size_is_always_a_measured_one() -> None:
    prof = make_profile([3, 5], [[1.0, 1.0]] * 3, batch_size=15)
    assert autosplit.plan(prof, gpus=2).split_size in (3, 5)
    with pytest.raises(InvalidInputError, match=r"not profiled; measured sizes are \[3, 5\]"):
        autosplit.plan(prof, gpus=2, options=PlanOptions(split_size=4))


def test_comm_moves_the_cut() -> None:
    prof = make_profile([2], [[1.0]] * 4, batch_size=4, cut_bytes_per_sample=[0, 10**9, 0])
    plan = autosplit.plan(prof, gpus=2, options=PlanOptions(bandwidth_bytes_per_s=1e9))
    assert plan.balance in ((1, 3), (3, 1))
    assert plan.stages[0].send_bytes == 0


def test_memory_limit_and_infeasibility_message() -> None:
    prof = make_profile([2], [[1.0]] * 4, batch_size=4, param_bytes=[10 * 2**20, 0, 0, 0])
    # SGD: weights + gradients = 20 MiB for block 0
    plan = autosplit.plan(prof, gpus=2, options=PlanOptions(memory_per_gpu="25MiB"))
    assert plan.memory_limit_bytes == 25 * 2**20
    assert all(s.memory_bytes <= 25 * 2**20 for s in plan.stages)
    with pytest.raises(InfeasiblePlanError, match=r"needs 40\.0 MiB on stage 0 \(block0 … block0\)") as info:
        autosplit.plan(prof, gpus=2, options=PlanOptions(memory_per_gpu="25MiB", optimizer="adam"))
    assert info.value.min_capacity_bytes == 40 * 2**20
    # what does not fit, without the advice (the command line words that its own way)
    assert info.value.finding == "the model does not fit on 2 devices of 25.0 MiB: the " \
        "smallest feasible plan needs 40.0 MiB on stage 0 (block0 … block0)"
    assert str(info.value).startswith(info.value.finding + ". Try more devices")


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"gpus": 0}, "gpus must be a positive integer, got 0"),
        ({"gpus": 5}, "more than the model's 4 blocks"),
        ({"gpus": 2, "memory_per_gpu": "lots"}, "cannot read 'lots'"),
        ({"gpus": 2, "memory_per_gpu": "3XB"}, "unknown unit"),
        ({"gpus": 2, "schedule": "zigzag"}, "unknown schedule 'zigzag'"),
        ({"gpus": 2, "optimizer": "lion"}, "unknown optimizer 'lion'"),
        ({"gpus": 2, "batch_size": 0}, "batch_size must be a positive integer"),
        ({"gpus": 2, "devices": ["cpu"]}, r"devices must have 2 entries \(one per stage\), got 1"),
    ],
)
def test_bad_plan_arguments(kwargs, match) -> None:
    prof = make_profile([2], [[1.0]] * 4, batch_size=4)
    with pytest.raises(InvalidInputError, match=match):
        options = {k: v for k, v in kwargs.items() if k != "gpus"}
        autosplit.plan(prof, kwargs["gpus"], PlanOptions(**options))


def test_plan_json_round_trip_is_exact(tmp_path) -> None:
    prof = autosplit.profile(LongSkip(), torch.randn(8, 6),
                             options=ProfileOptions(microbatch_sizes=[2, 4], warmup=0, repeats=1))
    plan = autosplit.plan(prof, gpus=3)
    path = tmp_path / "plan.json"
    plan.save(path)
    again = autosplit.Plan.load(path)
    assert again == plan
    assert again.balance == plan.balance and again.split_points == plan.split_points
    assert json.loads(path.read_text())["kind"] == "plan"


def test_a_plan_for_another_model_is_refused(tmp_path) -> None:
    prof = autosplit.profile(LongSkip(), torch.randn(8, 6),
                             options=ProfileOptions(microbatch_sizes=[4], warmup=0, repeats=1))
    autosplit.plan(prof, gpus=2).save(tmp_path / "plan.json")
    plan = autosplit.Plan.load(tmp_path / "plan.json")
    with pytest.raises(ModelMismatchError, match="made for another model \\(LongSkip"):
        autosplit.partition(ToyModel(), plan=plan)


def test_corrupt_and_foreign_plan_files(tmp_path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text('{"kind": "plan", "format_version": 1, "stages": 3}')
    with pytest.raises(RecordFileError, match="bad.json': stages is 3: expected a list"):
        autosplit.Plan.load(bad)
    bad.write_text('{"kind": "profile", "format_version": 1}')
    with pytest.raises(RecordFileError, match="not an autosplit plan file"):
        autosplit.Plan.load(bad)


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: autosplit.partition(ToyModel(), torch.randn(4, 10), gpus=0), "gpus .* got 0"),
        (lambda: autosplit.partition(ToyModel(), torch.randn(4, 10), gpus=3), "model's 2 blocks"),
        (lambda: autosplit.partition(ToyModel(), ("x",), gpus=2), "not a tensor"),
        (lambda: autosplit.partition(
            ToyModel(), torch.randn(4, 3), gpus=2,
            options=PartitionOptions(profile=ProfileOptions(microbatch_sizes=[2]))),
         r"shape \(4, 3\)"),
        (lambda: autosplit.partition("model"), "torch.nn.Module"),
        (lambda: autosplit.partition(ToyModel(), gpus=2,
                                     options=PartitionOptions(split_size=0)), "split_size"),
        (lambda: autosplit.partition(ToyModel(), devices=["tpu:0", "cpu"]), "tpu"),
        (lambda: autosplit.partition(torch.nn.Sequential(), torch.randn(2, 2)), "empty model"),
    ],
)
def test_bad_partition_arguments(call, match) -> None:
    with pytest.raises(InvalidInputError, match=match):
        call()


def test_wrong_number_of_inputs_at_call_time() -> None:
    quick = ProfileOptions(microbatch_sizes=[2], warmup=0, repeats=1)
    pm = autosplit.partition(ToyModel(), torch.randn(4, 10), gpus=2,
                             options=PartitionOptions(profile=quick))
    with pytest.raises(InvalidInputError, match="takes 1 inputs \\(x\\), got 2"):
        pm(torch.randn(4, 10), torch.randn(4, 10))
