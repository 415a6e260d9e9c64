"""Sharded replicas at run time: FSDP2's ``fully_shard`` along the mesh's "dp" (gloo, CPU).

Each launched run is compared with one process training the same model on the same m·d
micro-batches (:func:`test_distributed.reference`): the loss, every parameter's gradient and
the parameters after each SGD step, gathered from the shards (``DTensor.full_tensor``). Both
FSDP2 modes run in one launch: resharding after forward (torch's default) and not.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from test_distributed import (
    ROOT,
    TIMEOUT_S,
    assert_same_training,
    batch,
    build,
    loss_fn,
    make_plan,
    reference,
)
from test_hybrid import hybrid_plan

from autosplit import distributed
from autosplit.cli import main
from autosplit.errors import InvalidInputError
from autosplit.records import Plan

MODES = ("fsdp2", "fsdp2-no-reshard")


def _whole(t: torch.Tensor) -> torch.Tensor:
    """A tensor gathered from its shards when it is a ``DTensor``, on the CPU."""
    full = t.full_tensor() if hasattr(t, "full_tensor") else t
    return full.detach().cpu().clone()


def _train(name: str, cases: list[Plan], steps: int) -> Any:
    """Train model ``name`` with each plan ``steps`` SGD steps; rank 0 gets, per plan, the last stage's losses
    and each step's whole gradients and parameters, every rank's merged."""
    found = []
    for plan in cases:
        model = build(name)
        trainer = distributed.Trainer(model, plan, loss_fn,
                                      lambda ps: torch.optim.SGD(ps, lr=0.1))
        assert all(type(p).__name__ == "DTensor" for p in trainer.parameters())
        # FSDP2 sharded the model's own modules: a second Trainer on it is refused in words
        with pytest.raises(InvalidInputError, match="already sharded by FSDP2.*deepcopy"):
            distributed.Trainer(model, plan, loss_fn)
        inputs, targets = batch(name, plan.batch_size)
        losses, snaps = [], []
        for _ in range(steps):
            loss = trainer.step(inputs if trainer.holds_first else None,
                                targets if trainer.holds_last else None)
            losses.append(None if loss is None else loss.cpu())
            # full_tensor() is a collective: every rank gathers every one of its parameters
            snaps.append({"grads": {n: _whole(p.grad) for n, p in trainer.named_parameters()},
                          "params": {n: _whole(p) for n, p in trainer.named_parameters()}})
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, (losses, snaps))
        found.append(gathered)
    return found if dist.get_rank() == 0 else None


def _check(cases: list[Plan], ranks: int, steps: int = 2, name: str = "toy",
           **tol: float) -> None:
    results = distributed.launch(_train, ranks, name, cases, steps, timeout_s=TIMEOUT_S)[0]
    for plan, gathered in zip(cases, results, strict=True):
        losses = next(ls for ls, _ in gathered if ls[0] is not None)
        merged = []
        for step in range(steps):
            part: dict[str, Any] = {"grads": {}, "params": {}, "buffers": {}}
            for _, snaps in gathered:
                for key in ("grads", "params"):
                    part[key].update(snaps[step][key])
            merged.append(part)
        expected = reference(name, plan, steps)
        for step in expected["steps"]:
            step["buffers"] = {}  # not compared: each replica keeps its own (BatchNorm's)
        assert_same_training({"losses": losses, "steps": merged}, expected, **tol)


def test_fsdp2_data_parallel_trains_like_one_process() -> None:
    """p = 1, d = 2: each rank holds half of every parameter; 3 micro-batches accumulate."""
    plan = hybrid_plan("toy", (2,), 2, m=3)
    _check([dataclasses.replace(plan, replica_mode=mode) for mode in MODES], 2)


def test_fsdp2_units_are_the_modules_the_graph_calls() -> None:
    """ResNet18, p = 1, d = 2: the graph calls a residual block's convolutions and norms, not
    the block, so each block is one FSDP2 unit of the modules it calls."""
    plan = hybrid_plan("resnet18", (11,), 2, m=2)
    # the reduce-scatter sums the two replicas' gradients in another order than one process's
    # backward, and BatchNorm over micro-batches of 2 amplifies the rounding (1 of 9,408 of
    # conv1's gradients 1.5e-5 apart)
    _check([dataclasses.replace(plan, replica_mode="fsdp2")], 2, steps=1, name="resnet18",
           rtol=1e-4, atol=1e-4)


def test_pipeline_with_fsdp2_replicas_trains_like_one_process() -> None:
    """2 stages × 2 replicas on 4 ranks: torch's PipelineStage drives FSDP2 along "dp"."""
    _check([dataclasses.replace(hybrid_plan("toy", (1, 1), 2, schedule=schedule),
                                replica_mode=mode)
            for schedule, mode in (("gpipe", "fsdp2"), ("1f1b", "fsdp2-no-reshard"))], 4)


def test_cli_run_trains_an_fsdp2_plan(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import sys

    sys.path.insert(0, str(ROOT / "examples"))
    try:
        import toy  # examples/toy.py

        model = toy.build_model()
    finally:
        sys.path.remove(str(ROOT / "examples"))
    plan = make_plan(model, (2,), 2, 2)
    path = tmp_path / "plan.json"
    dataclasses.replace(plan, replicas=2, batch_size=8, replica_mode="fsdp2").save(path)
    code = main(["run", str(ROOT / "examples" / "toy.py"), "--plan", str(path), "--steps", "2"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "1 stage × 2 replicas (FSDP2)" in out and "2 ranks" in out and "step 2" in out
