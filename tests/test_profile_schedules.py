"""What the profile records for the schedules: the backward split into input-gradient (B) and
weight-gradient (W) time, the recomputation under checkpointing and the bytes it keeps;
measured and analytic, saved and loaded; older profile files load without them."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch
from torch import nn

import autosplit
from autosplit import ProfileOptions
from autosplit.errors import InvalidInputError, PlanFileError
from autosplit.estimate.analytic import analytic_profile
from autosplit.estimate.options import EstimateOptions
from autosplit.records import BlockProfile, Profile
from autosplit.specs import get_spec

FIXTURES = Path(__file__).resolve().parent / "fixtures"


def mlp() -> nn.Module:
    """Three blocks: inp (reads the model's input only), mid, out."""
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                         nn.Linear(16, 3))


@pytest.fixture(scope="module")
def measured() -> Profile:
    torch.manual_seed(0)
    return autosplit.profile(mlp(), (torch.randn(8, 6),),
                             options=ProfileOptions(microbatch_sizes=[4, 8], warmup=0, repeats=2))


def test_measured_profile_splits_the_backward(measured: Profile) -> None:
    # explicit sizes are measured in the order given: the split is timed at the first
    assert measured.backward_split == "measured at b=4"
    first, *rest = measured.blocks
    assert first.input_grad_ms == (0.0, 0.0)  # its input is the model's: no input gradient
    assert first.weight_grad_ms is not None and all(w > 0 for w in first.weight_grad_ms)
    for block in rest:
        assert block.input_grad_ms is not None and block.weight_grad_ms is not None
        assert all(x > 0 for x in block.input_grad_ms)
        assert all(w > 0 for w in block.weight_grad_ms)
        # at b=8, not timed: b=4's figures scaled by the ratio of the measured backwards
        ratio = block.bwd_ms[1] / block.bwd_ms[0]
        assert block.input_grad_ms[1] == pytest.approx(block.input_grad_ms[0] * ratio)
        assert block.weight_grad_ms[1] == pytest.approx(block.weight_grad_ms[0] * ratio)


def test_measured_recomputation_and_checkpointed_bytes(measured: Profile) -> None:
    for block in measured.blocks:
        assert block.recompute_ms == block.fwd_ms  # the forward again
    # a checkpointed block keeps its input only: b × features × 4 bytes (float32)
    assert [b.checkpoint_saved_bytes for b in measured.blocks] == [
        (4 * 6 * 4, 8 * 6 * 4), (4 * 16 * 4, 8 * 16 * 4), (4 * 16 * 4, 8 * 16 * 4)]


def test_analytic_profile_estimates_the_split() -> None:
    prof = analytic_profile(mlp(), (torch.randn(8, 6),), get_spec("h100-80gb"),
                            options=EstimateOptions(microbatch_sizes=[4, 8]))
    assert prof.backward_split == "estimated"
    first, *rest = prof.blocks
    assert first.input_grad_ms == (0.0, 0.0) and first.weight_grad_ms == first.bwd_ms
    for block in rest:
        assert block.input_grad_ms == block.weight_grad_ms
        assert block.input_grad_ms is not None
        assert [x + w for x, w in zip(block.input_grad_ms, block.weight_grad_ms)] == \
            pytest.approx(list(block.bwd_ms))
        assert block.recompute_ms == block.fwd_ms
    # counted on meta, the bytes a checkpointed block keeps are the measured ones
    assert [b.checkpoint_saved_bytes for b in prof.blocks] == [
        (4 * 6 * 4, 8 * 6 * 4), (4 * 16 * 4, 8 * 16 * 4), (4 * 16 * 4, 8 * 16 * 4)]


def test_profile_round_trip(tmp_path: Path, measured: Profile) -> None:
    measured.save(tmp_path / "profile.json")
    assert Profile.load(tmp_path / "profile.json") == measured


def test_older_profile_files_load_without_the_new_figures() -> None:
    old = Profile.load(FIXTURES / "resnet50_profile.json")
    assert old.backward_split == ""
    for block in old.blocks:
        assert (block.input_grad_ms, block.weight_grad_ms, block.recompute_ms,
                block.checkpoint_saved_bytes) == (None, None, None, None)


def test_split_is_given_for_every_block_or_none(measured: Profile) -> None:
    blocks = (dataclasses.replace(measured.blocks[0], input_grad_ms=None,
                                  weight_grad_ms=None), *measured.blocks[1:])
    with pytest.raises(InvalidInputError, match="for every block or for none"):
        dataclasses.replace(measured, blocks=blocks)


@pytest.mark.parametrize("field, value, problem", [
    ("input_grad_ms", [0.1], "has 1 values for 2 values in fwd_ms"),
    ("weight_grad_ms", [0.1, -1.0], "is -1.0: times must be finite and ≥ 0"),
    ("recompute_ms", [0.1, "x"], "expected a number"),
    ("checkpoint_saved_bytes", [1, 2.5], "expected an integer"),
])
def test_bad_figures_in_a_file_are_named(tmp_path: Path, measured: Profile, field: str,
                                         value: object, problem: str) -> None:
    measured.save(tmp_path / "profile.json")
    data = json.loads((tmp_path / "profile.json").read_text())
    data["blocks"][1][field] = value
    (tmp_path / "bad.json").write_text(json.dumps(data))
    with pytest.raises(PlanFileError, match=None) as caught:
        Profile.load(tmp_path / "bad.json")
    assert f"blocks[1].{field}" in str(caught.value) and problem in str(caught.value)


def test_block_profile_checks_the_new_rows() -> None:
    with pytest.raises(InvalidInputError, match=r"recompute_ms has 1 values for 2 values"):
        BlockProfile("a", 0, 0, (1.0, 2.0), (1.0, 2.0), (0, 0), (0, 0), recompute_ms=(1.0,))


def test_the_synchronisation_figures_round_trip_and_older_files_load(
        tmp_path: Path, measured: Profile) -> None:
    old = Profile.load(FIXTURES / "resnet50_profile.json")
    assert (old.allreduce_latency_ms, old.one_stage_action_ms,
            old.one_stage_action_spread) == (0.0, None, None)
    timed = dataclasses.replace(measured, allreduce_latency_ms=0.4, one_stage_action_ms=0.25,
                                one_stage_action_spread=0.05)
    timed.save(tmp_path / "profile.json")
    again = Profile.load(tmp_path / "profile.json")
    assert again == timed and again.one_stage_action() == (0.25, 0.05)
    data = json.loads((tmp_path / "profile.json").read_text())
    for field, value in (("allreduce_latency_ms", -0.4), ("one_stage_action_ms", "x"),
                         ("one_stage_action_spread", math.inf)):
        bad = {**data, field: value}
        (tmp_path / "bad.json").write_text(json.dumps(bad))
        with pytest.raises(PlanFileError, match=field):
            Profile.load(tmp_path / "bad.json")
