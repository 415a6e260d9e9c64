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
    """The stage's blocks that are modules holding parameters, outermost first and none
    inside another (a block inside a wrapped block is already in its unit). FSDP2 gathers a
    unit's parameters in the forward hooks of its modules, so a unit is what the stage's graph
    calls: the block itself where the graph calls it, else the modules of the block that the
    graph calls (one unit of several modules, ``fully_shard([...])``: gathered when the first
    runs, resharded after the last).

    Raises:
        InvalidInputError: a block's graph reads parameters of it that no called module holds
            (a model captured by torch.export reads every weight directly).
    """
    body: nn.Module = module.body  # type: ignore[assignment]
    graph = getattr(body, "graph", None)
    called = [str(n.target) for n in graph.nodes if n.op == "call_module"] if graph else []
    units: list[nn.Module | list[nn.Module]] = []
    taken: list[str] = []
    for name in module.blocks:  # type: ignore[attr-defined]
        try:
            block = body.get_submodule(name)
        except AttributeError:
            continue  # a block of functions, not a module: the root holds its parameters
        if any(name.startswith(t + ".") for t in taken):
            continue
        params = {id(p) for p in block.parameters()}
        if not params:
            continue
        taken.append(name)
        if name in called:
            units.append(block)
            continue
        inner = _outermost([c for c in called if c.startswith(name + ".")])
        modules = [body.get_submodule(c) for c in inner]
        modules = [m for m in modules if any(True for _ in m.parameters())]
        if {id(p) for m in modules for p in m.parameters()} != params:
            raise InvalidInputError(
                f"block {name!r}: its graph reads parameters that none of its called modules "
                "holds (as in a model captured by torch.export), so FSDP2 cannot gather them "
                "per block: plan it with replica_mode='ddp'")
        units.append(modules[0] if len(modules) == 1 else modules)
    return units


def _outermost(names: list[str]) -> list[str]:
    """``names`` (module paths) less those inside another of them, in their order."""
    return [n for n in dict.fromkeys(names)
            if not any(n.startswith(o + ".") for o in names if o != n)]
