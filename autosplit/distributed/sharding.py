"""Sharded replicas: FSDP2's ``fully_shard`` along the DeviceMesh's "dp" dimension.

A plan whose ``replica_mode`` is ``"fsdp2"`` or ``"fsdp2-no-reshard"``
(:data:`autosplit.sharding.REPLICA_MODES`) runs each stage's d replicas as one FSDP2 group over
the mesh's "dp" sub-mesh, with torch's own ``torch.distributed.fsdp.fully_shard``: every block
of the stage that is a module with parameters is a unit of its own (``fully_shard(block)``),
then the stage module itself (``fully_shard(stage)``: the root, holding whatever parameters no
block owns). ``reshard_after_forward`` is ``True`` for ``"fsdp2"`` (torch's default: each unit
frees its gathered parameters after its forward and gathers them again in its backward) and
``False`` for ``"fsdp2-no-reshard"``.

torch's ``PipelineStage`` drives FSDP2 itself: every micro-batch's backward runs with gradient
sync and resharding after backward switched off, so gradients accumulate unsharded and the
gathered parameters stay gathered until the stage's ``perform_reduce_grad`` after the last
backward, which reduce-scatters the gradients once per step and reshards
(``torch/distributed/pipelining/stage.py``). What that costs in memory and time is
:mod:`autosplit.sharding`.

``fully_shard`` does not make the replicas' parameters equal (DDP broadcasts replica 0's at
construction): :func:`shard_stages` broadcasts them first, so every replica starts from replica
0's. Parameters become ``DTensor`` shards: ``Trainer.named_parameters`` yields this rank's
shards (``.full_tensor()`` gathers one).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from autosplit.errors import InvalidInputError
from autosplit.fsdp_units import block_units

__all__ = ["shard_stages"]


def shard_stages(modules: Sequence[nn.Module], place: Any, mode: str) -> None:
    """Shard ``modules`` (this rank's stage modules, each with its blocks' names in
    ``.blocks`` and their modules under ``.body``) in place with ``fully_shard`` over
    ``place.mesh["dp"]`` (``place``: :class:`autosplit.distributed.replicas.MeshPlace`).

    Raises:
        InvalidInputError: ``mode`` is not an FSDP2 mode, or the rank holds two stages that
            share a parameter (two FSDP2 roots cannot both shard it).
    """
    from torch.distributed.fsdp import fully_shard

    if mode not in ("fsdp2", "fsdp2-no-reshard"):
        raise InvalidInputError(f"mode={mode!r}: FSDP2 modes are 'fsdp2' and "
                                "'fsdp2-no-reshard'")
    if place.replica_group is None:
        return
    owner: dict[int, int] = {}
    for pos, module in enumerate(modules):
        for p in module.parameters():
            if owner.setdefault(id(p), pos) != pos:
                raise InvalidInputError(
                    f"with FSDP2 replicas, a parameter used by two stages of one rank cannot "
                    f"be sharded twice (rank {dist.get_rank()}, stage positions "
                    f"{owner[id(p)]} and {pos}): plan it with replica_mode='ddp'")
    source = dist.get_global_rank(place.replica_group, 0)
    mesh = place.mesh["dp"]
    reshard = mode == "fsdp2"
    for module in modules:
        with torch.no_grad():  # replica 0's values, as DDP's construction
            for p in module.parameters():
                dist.broadcast(p.data, src=source, group=place.replica_group)
        for unit in _units(module):
            fully_shard(unit, mesh=mesh, reshard_after_forward=reshard)
        fully_shard(module, mesh=mesh, reshard_after_forward=reshard)


def _units(module: nn.Module) -> list[nn.Module | list[nn.Module]]:
    """The stage's FSDP2 units (:func:`autosplit.fsdp_units.block_units`)."""
    return block_units(module.body, module.blocks)  # type: ignore[arg-type]
