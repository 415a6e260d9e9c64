"""Per-stage activation checkpointing (``Stage.checkpoint``) in partition() and emitted code:
outputs, every parameter gradient and every buffer equal one process on the same
micro-batches, with dropout (the recomputation replays the RNG) and BatchNorm (its statistics
update once, not again in the recomputation)."""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path

import pytest
import torch
from conftest import assert_equivalent
from test_codegen import assert_ruff_clean, cut_at, load, make_plan, pipelined_class
from torch import nn

import autosplit
from autosplit.codegen import emit
from autosplit.errors import ArgumentTypeError, InvalidInputError, PlanFileError
from autosplit.modelfile import load_model_file
from autosplit.records import Plan, Stage

DROP_NORM_MODEL = '''
import torch
from torch import nn


class DropNorm(nn.Module):
    """BatchNorm early, dropout late (and, with early_dropout, early too)."""

    def __init__(self, early_dropout=False):
        super().__init__()
        self.inp = nn.Linear(6, 8)
        self.norm = nn.BatchNorm1d(8)
        self.early = nn.Dropout(0.3) if early_dropout else nn.Identity()
        self.mid = nn.Linear(8, 8)
        self.drop = nn.Dropout(0.5)
        self.out = nn.Linear(8, 3)

    def forward(self, x):
        h = self.early(torch.relu(self.norm(self.inp(x))))
        return self.out(self.drop(torch.tanh(self.mid(h))))


def build_model():
    return DropNorm()


def example_inputs(batch_size=12):
    return (torch.randn(batch_size, 6),)
'''


@pytest.fixture
def drop_norm(tmp_path: Path) -> object:
    (tmp_path / "dn.py").write_text(DROP_NORM_MODEL)
    return load_model_file(str(tmp_path / "dn.py"))


def checkpointing(plan: Plan, flags: tuple[bool, ...]) -> Plan:
    """``plan`` with ``Stage.checkpoint`` set to ``flags``."""
    stages = tuple(dataclasses.replace(s, checkpoint=f) for s, f in zip(plan.stages, flags))
    return dataclasses.replace(plan, stages=stages)


def two_stage_plan(model: nn.Module, x: torch.Tensor, split: int,
                   flags: tuple[bool, ...]) -> Plan:
    """Stage 0: inp, norm (the BatchNorm); stage 1: mid … out (the late dropout)."""
    return checkpointing(cut_at(make_plan(model, (x,), 2, split), ["mid"]), flags)


def count_forwards(*modules: nn.Module) -> list[int]:
    """A counter per module of how many times its forward ran (recomputations included)."""
    counts = [0] * len(modules)
    for k, module in enumerate(modules):
        def hook(*_: object, k: int = k) -> None:
            counts[k] += 1
        module.register_forward_hook(hook)
    return counts


@pytest.mark.parametrize("flags", [(True, True), (True, False), (False, True)])
def test_partition_checkpointed_stages_equal_one_process(drop_norm, flags) -> None:
    model = drop_norm.build()
    x = torch.randn(12, 6)
    plan = two_stage_plan(model, x, 4, flags)
    ref = copy.deepcopy(model)
    pm = autosplit.partition(model, plan=plan, devices=["cpu", "cpu"])
    assert pm.checkpointed == flags
    counts = count_forwards(model.norm, model.drop)
    assert_equivalent(model, pm, ref, (x,), 4)  # outputs, gradients, BatchNorm statistics
    # each checkpointed stage ran its forward again in the backward: 3 micro-batches each
    assert counts == [3 * (1 + f) for f in flags]


def test_dropout_in_every_stage_one_microbatch(tmp_path: Path, drop_norm) -> None:
    """With dropout on both stages and one micro-batch, the draws happen in the order of one
    process; the recomputation must draw the same masks again."""
    model = type(drop_norm.build())(early_dropout=True)
    x = torch.randn(8, 6)
    plan = checkpointing(cut_at(make_plan(model, (x,), 2, 8), ["mid"]), (True, True))
    ref = copy.deepcopy(model)
    pm = autosplit.partition(model, plan=plan, devices=["cpu", "cpu"])
    assert_equivalent(model, pm, ref, (x,), 8)


def test_partition_forces_checkpointing(drop_norm) -> None:
    model = drop_norm.build()
    x = torch.randn(12, 6)
    plan = two_stage_plan(model, x, 4, (False, False))
    ref = copy.deepcopy(model)
    pm = autosplit.partition(model, plan=plan, devices=["cpu", "cpu"], checkpoint=True)
    assert pm.checkpointed == (True, True)
    assert "checkpoint=[True, True]" in repr(pm)
    assert pm.plan is plan  # the plan (and its predictions) is left as it was
    assert_equivalent(model, pm, ref, (x,), 4)
    pm = autosplit.partition(drop_norm.build(), plan=checkpointing(plan, (True, True)),
                             devices=["cpu", "cpu"], checkpoint=[False, True])
    assert pm.checkpointed == (False, True)


@pytest.mark.parametrize("value, error, message", [
    (1, ArgumentTypeError, "checkpoint must be a list"),
    ("yes", ArgumentTypeError, "checkpoint must be a list"),
    ([True, 0], ArgumentTypeError, "checkpoint[1] must be True or False, got 0"),
    ([True], InvalidInputError, "checkpoint=[True] for a plan of 2 stages"),
])
def test_bad_checkpoint_argument(drop_norm, value, error, message) -> None:
    model = drop_norm.build()
    plan = two_stage_plan(model, torch.randn(12, 6), 4, (False, False))
    with pytest.raises(error, match=None) as caught:
        autosplit.partition(model, plan=plan, devices=["cpu", "cpu"], checkpoint=value)
    assert message in str(caught.value)


def test_emitted_module_checkpointed_stages_equal_one_process(tmp_path: Path, drop_norm) -> None:
    model = drop_norm.build()
    x = torch.randn(12, 6)
    plan = two_stage_plan(model, x, 4, (True, True))
    source = emit(plan, drop_norm.ref, model=model)
    assert "checkpointed(self.stage0, " in source and "checkpointed(self.stage1, " in source
    assert "from torch.utils.checkpoint import checkpoint" in source
    assert source.count(", checkpointed\n") == 2  # the header's stage lines say so
    module = load(source, tmp_path / "pipelined.py")
    ref = copy.deepcopy(model)
    pm = pipelined_class(module)(model=model, devices=["cpu", "cpu"])
    counts = count_forwards(model.norm, model.drop)
    assert_equivalent(model, pm, ref, (x,), 4)
    assert counts == [6, 6]
    assert_ruff_clean(tmp_path / "pipelined.py")


def test_emitted_module_without_checkpointing_has_no_helper(drop_norm) -> None:
    model = drop_norm.build()
    plan = two_stage_plan(model, torch.randn(12, 6), 4, (False, False))
    source = emit(plan, drop_norm.ref, model=model)
    assert "checkpoint" not in source


# ----------------------------------------------------------------------------- plan records


def test_plan_records_checkpoint_and_prints_it(tmp_path: Path, drop_norm) -> None:
    model = drop_norm.build()
    plain = two_stage_plan(model, torch.randn(12, 6), 4, (False, False))
    assert "checkpoint" not in str(plain).splitlines()[0]
    plan = checkpointing(plain, (False, True))
    header, row0, row1 = str(plan).splitlines()[:3]
    assert header.split()[-1] == "checkpoint"
    assert row0.split()[-1] == "no" and row1.split()[-1] == "yes"
    plan.save(tmp_path / "plan.json")
    assert Plan.load(tmp_path / "plan.json") == plan


def test_older_plan_files_load_without_checkpointing(tmp_path: Path, drop_norm) -> None:
    model = drop_norm.build()
    plan = two_stage_plan(model, torch.randn(12, 6), 4, (False, False))
    plan.save(tmp_path / "plan.json")
    data = json.loads((tmp_path / "plan.json").read_text())
    for stage in data["layout"]["stages"]:
        del stage["checkpoint"]
    (tmp_path / "old.json").write_text(json.dumps(data))
    old = Plan.load(tmp_path / "old.json")
    assert [s.checkpoint for s in old.stages] == [False, False] and old == plan


@pytest.mark.parametrize("value", [1, 0, "true", None])
def test_checkpoint_must_be_a_bool(tmp_path: Path, drop_norm, value: object) -> None:
    model = drop_norm.build()
    plan = two_stage_plan(model, torch.randn(12, 6), 4, (False, False))
    with pytest.raises(InvalidInputError, match="checkpoint is .*expected true or false"):
        Stage(**{**{f.name: getattr(plan.stages[0], f.name)
                    for f in dataclasses.fields(Stage)}, "checkpoint": value})
    plan.save(tmp_path / "plan.json")
    data = json.loads((tmp_path / "plan.json").read_text())
    data["layout"]["stages"][1]["checkpoint"] = value
    (tmp_path / "bad.json").write_text(json.dumps(data))
    with pytest.raises(PlanFileError, match=r"stages\[1\]\.checkpoint is .*expected true or"):
        Plan.load(tmp_path / "bad.json")


def test_torchs_weight_pass_recomputes_a_checkpointed_forward_per_parameter_group() -> None:
    # why the planner offers no recomputation with a split backward: if torch stops doing
    # this, recomputation can be searched with the zero-bubble schedules again
    from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight
    from torch.utils.checkpoint import checkpoint

    calls = [0]
    layers = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(3))

    def forward(x: torch.Tensor) -> torch.Tensor:
        calls[0] += 1
        for layer in layers:
            x = torch.relu(layer(x))
        return x

    x = torch.randn(2, 4, requires_grad=True)
    y = checkpoint(forward, x, use_reentrant=False)
    _, groups = stage_backward_input([y], [torch.ones_like(y)], [x], layers.parameters())
    assert calls[0] == 2  # the forward, and once for the input gradient
    stage_backward_weight(layers.parameters(), groups)
    assert len(groups) == 3 and calls[0] == 2 + 3  # once more per parameter group
