"""Data-parallel replicas of a pipeline: a 2-D ``DeviceMesh`` ("dp", "pp") and DDP along "dp".

A plan of p stages × d replicas runs on d · k ranks, k the pipeline ranks (k = p, or a divisor
of p when a rank holds several stages). ``init_device_mesh(…, (d, k), mesh_dim_names=("dp",
"pp"))`` lays them out row by row: rank ``r · k + j`` is pipeline rank j of replica r, so the
ranks of replica 0 are 0 … k − 1, as in a pipeline alone. Along "pp" the stages run on
``torch.distributed.pipelining`` (the pipeline's process group is the mesh's "pp" group);
along "dp" every stage module is wrapped in ``DistributedDataParallel`` over the mesh's "dp"
group. ``PipelineStage`` knows DDP: it runs every micro-batch's forward and backward under
``no_sync()`` except the last backward, which all-reduces the accumulated gradients once per
step (averaged over the d replicas).

A plan whose ``replica_mode`` is FSDP2's shards every stage with ``fully_shard`` along "dp"
instead (:mod:`autosplit.distributed.sharding`); the mesh, the rows and the buffers are as
here. DDP keeps parameters plain tensors, so only it keeps the tied weights' copies across
ranks equal (their all-reduce runs on plain gradients).

Replica r takes the contiguous rows [r·B/d, (r+1)·B/d) of the batch, in m micro-batches of b
(B = d·m·b). The gradients are those of the mean of the m·d micro-batch losses: the schedule
sums each replica's m micro-batches, DDP averages over the d replicas, the Trainer divides by
m. BatchNorm statistics (buffers): DDP's ``broadcast_buffers`` copies rank 0's buffers to the
other replicas only in a forward that synchronises, and ``PipelineStage`` runs every forward
under ``no_sync()``: after DDP's construction (and its first forward), each replica's running
statistics would follow its own micro-batches only and drift apart. So after every step the
Trainer broadcasts replica 0's buffers to the other replicas (:func:`broadcast_buffers`, what
DDP's ``broadcast_buffers`` does before a synchronising forward): every replica holds replica
0's statistics, which saw replica 0's m micro-batches (not all m·d, as one process would).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils import _pytree as pytree

from autosplit.errors import InvalidInputError

MESH_DIMS = ("dp", "pp")
"""Names of the mesh's dimensions: data-parallel replicas, pipeline ranks."""


@dataclass(frozen=True, slots=True)
class MeshPlace:
    """Where this rank sits: its pipeline and its replica.

    Attributes:
        mesh: the 2-D ``DeviceMesh`` ("dp", "pp"), ``None`` for a pipeline alone.
        replica: r, this rank's replica (its "dp" coordinate), 0 … d − 1.
        replicas: d.
        pipeline_rank: this rank's place in its pipeline (its "pp" coordinate).
        pipeline_size: k, the ranks of one pipeline.
        pipeline_group: the process group of this rank's pipeline (``None``: the world).
        replica_group: the process group of this rank's stage replicas (``None`` for d = 1).
    """

    mesh: Any
    replica: int
    replicas: int
    pipeline_rank: int
    pipeline_size: int
    pipeline_group: Any
    replica_group: Any


def mesh_place(replicas: int, device: torch.device, group: Any = None, mesh: Any = None,
               placement: str = "") -> MeshPlace:
    """This rank's place: a pipeline over ``group`` for one replica, else a 2-D mesh.

    Args:
        replicas: d, the plan's replicas.
        device: this rank's device (its type names the mesh's device type).
        group: the pipeline's process group when d = 1 (default: the world).
        mesh: for d > 1, a ``DeviceMesh`` with dimensions "dp" and "pp" (either order) and d
            replicas; default one over the whole world (every rank must then build its
            Trainer together), laid out by ``placement``.
        placement: the plan's (:attr:`autosplit.records.Plan.placement`): ``"dp-inner"`` puts
            a stage's replicas on consecutive ranks (mesh ("pp", "dp"): rank ``j · d + r``);
            otherwise a replica's stages are consecutive (mesh ("dp", "pp"): rank
            ``r · k + j``).

    Raises:
        InvalidInputError: the world (or ``mesh``) does not hold d replicas, or ``group`` is
            given with d > 1.
    """
    if replicas == 1 and mesh is None:
        return MeshPlace(None, 0, 1, dist.get_rank(group), dist.get_world_size(group), group,
                         None)
    if group is not None:
        raise InvalidInputError(
            f"group= is for a pipeline alone; a plan with {replicas} replicas runs on a 2-D "
            "DeviceMesh: pass mesh= (dimensions 'dp', 'pp') or neither")
    if mesh is None:
        world = dist.get_world_size()
        if world % replicas:
            raise InvalidInputError(
                f"a plan with {replicas} replicas runs on a multiple of {replicas} ranks "
                f"(stages × replicas), got {world}")
        from torch.distributed.device_mesh import init_device_mesh

        if placement == "dp-inner":
            mesh = init_device_mesh(device.type, (world // replicas, replicas),
                                    mesh_dim_names=MESH_DIMS[::-1])
        else:
            mesh = init_device_mesh(device.type, (replicas, world // replicas),
                                    mesh_dim_names=MESH_DIMS)
    names = tuple(mesh.mesh_dim_names or ())
    if sorted(names) != sorted(MESH_DIMS) or mesh["dp"].size() != replicas:
        raise InvalidInputError(
            f"mesh must have dimensions {MESH_DIMS} with {replicas} replicas along 'dp', got "
            f"dimensions {mesh.mesh_dim_names} of sizes {tuple(mesh.shape)}")
    return MeshPlace(mesh, mesh.get_local_rank("dp"), replicas, mesh.get_local_rank("pp"),
                     mesh["pp"].size(), mesh.get_group("pp"), mesh.get_group("dp"))


def replicate_stages(
    modules: Sequence[nn.Module], place: MeshPlace, device: torch.device
) -> dict[int, nn.Module]:
    """``modules`` (this rank's stages, by position) wrapped in DDP over the replica group.

    A stage without trainable parameters is not wrapped (DDP refuses it; it has nothing to
    synchronise). DDP's construction broadcasts replica 0's parameters and buffers.

    Raises:
        InvalidInputError: one parameter is used by two stages of this rank (two DDP wrappers
            cannot both reduce it): give every stage its own rank.
    """
    from torch.nn.parallel import DistributedDataParallel

    if place.replica_group is None:
        return {}
    owner: dict[int, int] = {}
    wrapped: dict[int, nn.Module] = {}
    for pos, module in enumerate(modules):
        params = [p for p in module.parameters() if p.requires_grad]
        for p in params:
            if owner.setdefault(id(p), pos) != pos:
                raise InvalidInputError(
                    f"with replicas, a parameter used by two stages of one rank cannot be "
                    f"replicated by DistributedDataParallel (rank {dist.get_rank()}, stage "
                    f"positions {owner[id(p)]} and {pos}): run one rank per stage")
        if params:
            ids = [device.index] if device.type == "cuda" else None
            wrapped[pos] = DistributedDataParallel(module, device_ids=ids,
                                                   process_group=place.replica_group)
    return wrapped


def replica_rows(values: Any, replica: int, replicas: int, rows: int, what: str) -> Any:
    """Replica r's rows [r·B/d, (r+1)·B/d) of every tensor leaf of ``values`` (B = ``rows``).

    Raises:
        InvalidInputError: a tensor leaf does not have B rows.
    """
    if replicas == 1:
        return values
    share = rows // replicas

    def take(x: Any) -> Any:
        if not isinstance(x, torch.Tensor):
            return x
        if x.dim() == 0 or x.shape[0] != rows:
            got = "no" if x.dim() == 0 else str(x.shape[0])
            raise InvalidInputError(
                f"the {what} have {got} rows; the plan runs {replicas} replicas × {share} rows "
                f"= {rows} rows: give a batch of that size or make a plan for yours")
        return x[replica * share:(replica + 1) * share]

    return pytree.tree_map(take, values)


def broadcast_buffers(modules: Sequence[nn.Module], place: MeshPlace) -> None:
    """Replica 0's buffers (BatchNorm statistics …) copied into every other replica's, in
    place: DDP's ``broadcast_buffers`` for a pipeline, whose forwards never synchronise. The
    buffers of one dtype travel as one flat tensor (ResNet50 has 159 of them)."""
    if place.replica_group is None:
        return
    source = dist.get_global_rank(place.replica_group, 0)
    groups: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for module in modules:
        for buffer in module.buffers():
            groups.setdefault((buffer.dtype, buffer.device), []).append(buffer)
    for buffers in groups.values():  # one broadcast per dtype, not one per buffer
        flat = torch.cat([b.reshape(-1) for b in buffers])
        dist.broadcast(flat, src=source, group=place.replica_group)
        with torch.no_grad():
            for buffer, value in zip(buffers, flat.split([b.numel() for b in buffers])):
                buffer.copy_(value.view_as(buffer))
