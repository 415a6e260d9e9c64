"""Trainer: one rank's part of pipelined training on ``torch.distributed.pipelining``.

Conventions shared with :mod:`autosplit.pipeline` (both from :mod:`autosplit.stages`): a batch
of B = m·b rows is split with ``tensor.split(b)`` into m micro-batches; BatchNorm sees
micro-batches, in order. With ``scale_grads=True`` (the schedules' default) the gradients are
those of the mean of the m micro-batch losses, and :meth:`Trainer.step` returns that mean.
A plan with d > 1 replicas runs on a 2-D DeviceMesh with DDP (or FSDP2) along "dp"
(:mod:`autosplit.distributed.replicas`): B = d·m·b, replica r takes rows [r·B/d, (r+1)·B/d),
and the gradients and the loss are those of the mean of all m·d micro-batch losses.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from autosplit.distributed.replicas import (
    broadcast_buffers,
    mesh_place,
    replica_rows,
    replicate_stages,
)
from autosplit.distributed.sharding import shard_stages
from autosplit.distributed.stage_module import (
    StageModule,
    _pipeline_stages,
    _stage_modules_of,
    build_schedule,
    check_schedule,
    run_schedule,
)
from autosplit.errors import InvalidInputError, PlanMismatchError
from autosplit.graph import BlockGraph, Granularity
from autosplit.launch import default_device
from autosplit.records import Plan
from autosplit.schedules.placement import V_SCHEDULES, stage_indices, stage_ranks
from autosplit.stages import graph_for_plan, move, split, stage_layout


class _LastStageLoss:
    """The user's loss on the model's output structure and the micro-batch's own target.

    The last stage sends the output's tensor leaves; the schedule hands each micro-batch's
    *index* as the target (``PipelineStage`` accepts only a tensor there), and the real
    target, any structure, is looked up here.
    """

    def __init__(
        self, loss_fn: Callable[[Any, Any], torch.Tensor], last: StageModule | None
    ) -> None:
        self.loss_fn = loss_fn
        self.last = last
        self.targets: list[Any] = []

    def __call__(self, output: Any, index: torch.Tensor) -> torch.Tensor:
        structure = self.last.unflatten_output(output) if self.last is not None else output
        return self.loss_fn(structure, self.targets[int(index)])


def plan_digest(plan: Plan) -> tuple[Any, ...]:
    """What every rank must agree on: the model, the cut points, b, m, the schedule, the
    replicas, the stages per rank, which stages are checkpointed and the replica mode."""
    return (
        plan.fingerprint,
        tuple(s.blocks[0] for s in plan.stages),
        plan.balance,
        plan.split_size,
        plan.microbatches,
        plan.schedule,
        plan.replicas,
        plan.stages_per_rank,
        tuple(s.index for s in plan.stages if s.checkpoint),
        plan.replica_mode,
    )


class Trainer:
    """One rank's part of pipelined training: its stages, the schedule and an optimizer.

    Every rank builds a ``Trainer`` from the same model (same architecture; each rank uses
    only its stages' parameters) and the same plan, then calls :meth:`step` with the same
    batch: the first stage's rank needs ``inputs``, the last stage's rank ``targets``; other
    ranks may pass ``None``. The first step sends one micro-batch's input shapes from stage 0's
    rank to every rank, which derive every stage's shapes on the meta device.

    A plan with d > 1 replicas runs on k · d ranks (k pipeline ranks: p, or a divisor of p)
    laid out on a ("dp", "pp") ``DeviceMesh``: every rank passes the whole batch of
    B = d·m·b rows and replica r trains on rows [r·B/d, (r+1)·B/d); each stage is wrapped in
    ``DistributedDataParallel`` over its replicas (see :mod:`autosplit.distributed.replicas`),
    or sharded with FSDP2's ``fully_shard`` where ``plan.replica_mode`` says so
    (:mod:`autosplit.distributed.sharding`: the parameters are then ``DTensor`` shards).

    Args:
        model: the model the plan was made for (its modules are shared, not copied).
        plan: the plan; every rank must hold the same one (checked at construction).
        loss_fn: ``loss_fn(output, target) -> scalar`` per micro-batch, ``output`` in the
            model's own output structure, ``target`` the micro-batch's slice of the targets.
        optimizer_factory: ``f(parameters) -> Optimizer`` over this rank's parameters; ``None``
            leaves the gradients in ``.grad`` and the parameters unchanged.
        device: this rank's device; default ``cuda:LOCAL_RANK`` on NCCL, else ``cpu``.
        group: the process group of the pipeline (default: the world; one replica only).
        mesh: for a plan with replicas, a ``DeviceMesh`` with dimensions ("dp", "pp") (default:
            one over the world, d × world / d).
        scale_grads: divide gradients by m (the loss is the mean over micro-batches); ``False``
            sums them.
        reduce_loss: with replicas, :meth:`step` returns the mean loss over every replica (an
            all-reduce of the loss per step, a synchronisation as long as a small gradient
            all-reduce's latency); ``False`` returns this replica's own, and the caller averages
            them when it needs to (``autosplit run`` does so once, after its steps).
        granularity, leaf_modules: how the plan's model was traced (default: found from the
            plan's fingerprint).
        example_inputs, example_kwargs: one call of the model, as :meth:`step` is given it:
            a model that only torch.export captures (a Hugging Face model, keyword inputs)
            is captured from it.

    Raises:
        PlanMismatchError: the plan is not this model's, or ranks hold different plans.
        InvalidInputError: no process group, or the world size or schedule does not fit the
            plan (with d replicas: not a multiple of d ranks, ``group=`` given, a ``mesh``
            without dimensions ("dp", "pp") of d replicas, or one parameter in two stages of
            one rank), or the model's modules already sharded by FSDP2 (an FSDP2 Trainer
            shards them in place: give each Trainer a model of its own).
    """

    def __init__(
        self,
        model: nn.Module,
        plan: Plan,
        loss_fn: Callable[[Any, Any], torch.Tensor],
        optimizer_factory: Callable[[Iterator[nn.Parameter]], torch.optim.Optimizer] | None = None,
        *,
        device: torch.device | str | None = None,
        group: Any = None,
        mesh: Any = None,
        scale_grads: bool = True,
        reduce_loss: bool = True,
        granularity: Granularity | None = None,
        leaf_modules: Sequence[type[nn.Module] | str] = (),
        example_inputs: Any = None,
        example_kwargs: dict[str, Any] | None = None,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise InvalidInputError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if not isinstance(plan, Plan):
            raise InvalidInputError(f"plan must be an autosplit Plan, got {type(plan).__name__}")
        if not callable(loss_fn):
            raise InvalidInputError(f"loss_fn must be callable, got {type(loss_fn).__name__}")
        if not dist.is_initialized():
            raise InvalidInputError(
                "no process group: call autosplit.distributed.init_distributed() first (under "
                "torchrun or autosplit.distributed.launch())"
            )
        self.plan = plan
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.scale_grads = scale_grads
        self.reduce_loss = reduce_loss
        self.device = torch.device(device) if device is not None else default_device(group)
        _check_not_sharded(model)
        graph = graph_for_plan(model, plan, granularity=granularity, leaf_modules=leaf_modules,
                               example_inputs=example_inputs, example_kwargs=example_kwargs)
        self.signature = graph.signature
        self.returns_loss = graph.returns_loss
        self._model_name = graph.model_name
        self._check_agreement(plan, graph.fingerprint, group)
        self.place = mesh_place(plan.replicas, self.device, group, mesh, plan.placement)
        self.group = self.place.pipeline_group
        check_schedule(plan, self.place.pipeline_size, replicas=plan.replicas)
        v_shape = plan.schedule in V_SCHEDULES
        self._local = stage_indices(len(plan.stages), self.place.pipeline_rank,
                                    self.place.pipeline_size, v_shape)
        self._all = _stage_modules_of(graph, plan)
        self.modules = [self._all[i].to(self.device) for i in self._local]
        self._shared = _shared_copies(graph, plan, self.place.pipeline_rank,
                                      stage_ranks(len(plan.stages), self.place.pipeline_size,
                                                  v_shape), self.group)
        if plan.replica_mode != "ddp":  # in place: the parameters become DTensor shards
            if self._shared:
                raise InvalidInputError(
                    f"replica_mode={plan.replica_mode!r} with a weight shared across ranks "
                    f"({self._shared[0].name}): plan it with replica_mode='ddp'")
            shard_stages(self.modules, self.place, plan.replica_mode)
        self._names = {id(p): name for name, p in graph.module.named_parameters()}
        self._replicated = (replicate_stages(self.modules, self.place, self.device)
                            if plan.replica_mode == "ddp" else {})
        last = next((m for m in self.modules if m.is_last), None)
        self._loss = _LastStageLoss(loss_fn, last)
        self.stages: list[Any] = []
        self.schedule: Any = None
        params = list(self.parameters())
        self.optimizer = optimizer_factory(iter(params)) if optimizer_factory and params else None

    def _check_agreement(self, plan: Plan, fingerprint: str, group: Any) -> None:
        mine = (fingerprint, plan_digest(plan))
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, mine, group=group)
        for rank, theirs in enumerate(gathered):
            if theirs == gathered[0]:
                continue
            model0, plan0 = gathered[0]
            modelr, planr = theirs
            what = (
                f"model fingerprint {model0} vs {modelr}" if model0 != modelr else
                f"plan {_describe_digest(plan0)} vs {_describe_digest(planr)}"
            )
            raise PlanMismatchError(
                f"rank {rank} holds another plan or model than rank 0 ({what}): give every "
                "rank the same model and plan file"
            )

    def _build(self, arg_mbs: list[tuple[Any, ...]] | None) -> None:
        """Make the PipelineStages and the schedule, with shapes from stage 0's rank."""
        meta = None
        if arg_mbs is not None:
            meta = [(tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor) else x
                    for x in arg_mbs[0]]
        box = [meta]
        source = dist.get_global_rank(self.group, 0) if self.group is not None else 0
        dist.broadcast_object_list(box, src=source, group=self.group, device=self.device)
        example = []
        for index, item in enumerate(box[0] or []):
            if not isinstance(item, tuple):
                raise InvalidInputError(
                    f"model input {index} is a {type(item).__name__}; pipelined inputs must be "
                    "tensors with the batch in dimension 0"
                )
            example.append(torch.empty(item[0], dtype=item[1], device="meta"))
        wrapped = {self._local[pos]: ddp for pos, ddp in self._replicated.items()}
        # shapes from meta tensors would start FSDP2's lazy initialisation on them: with
        # sharded replicas torch infers the shapes on the first micro-batch
        shapes = example if self.plan.replica_mode == "ddp" else None
        self.stages = _pipeline_stages(self._all, self._local, self.device, self.group, shapes,
                                       wrapped)
        # the gradients are scaled once per parameter in step(): a schedule scales each stage's
        # parameters, so a parameter that two stages of this rank use would be scaled twice
        self.schedule = build_schedule(self.stages, self.plan, self._loss, scale_grads=False)

    @property
    def holds_first(self) -> bool:
        """Whether this rank runs stage 0 (it needs the inputs)."""
        return 0 in self._local

    @property
    def holds_last(self) -> bool:
        """Whether this rank runs the last stage (it needs the targets and gets the loss)."""
        return len(self.plan.stages) - 1 in self._local

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """This rank's parameters, by their qualified names in the model (a tied weight by
        its first name, ``embed.weight`` for ``head.weight``, on every rank that holds it)."""
        seen: set[int] = set()
        for module in self.modules:
            for name, p in module.body.named_parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    yield self._names.get(id(p), name), p

    def parameters(self) -> Iterator[nn.Parameter]:
        """This rank's parameters."""
        return (p for _, p in self.named_parameters())

    def named_buffers(self) -> Iterator[tuple[str, torch.Tensor]]:
        """This rank's buffers (BatchNorm statistics …), by their qualified names."""
        for module in self.modules:
            yield from module.body.named_buffers()

    @property
    def replica(self) -> int:
        """This rank's replica r (0 for a pipeline alone)."""
        return self.place.replica

    def _split(self, values: Any, what: str) -> list[Any]:
        plan, place = self.plan, self.place
        rows = place.replicas * plan.microbatches * plan.split_size
        mine = replica_rows(values, place.replica, place.replicas, rows, what)
        moved = move(mine, self.device)
        return split(moved, plan.split_size, count=plan.microbatches, what=what)

    def step(self, inputs: Any = None, targets: Any = None, *,
             kwargs: dict[str, Any] | None = None) -> torch.Tensor | None:
        """One pipelined training step on every rank: zero grads, forward/backward, optimizer.

        Args:
            inputs: a tensor or tuple of the model's positional inputs, with B = d·m·b rows
                (needed on stage 0's ranks; with d replicas, each takes its B/d rows).
            targets: a tensor or a structure of tensors with B rows (needed on the last
                stage's ranks); each micro-batch's slice goes to ``loss_fn``. ``None`` hands
                ``loss_fn`` ``None`` (a model that computes its own loss from its labels).
            kwargs: the model's keyword inputs (``attention_mask``, ``labels`` …), B rows each.

        Returns:
            On the last stage's ranks, the loss: the mean of the m·d micro-batch losses (this
            replica's m with ``reduce_loss=False``; their sum with ``scale_grads=False``),
            detached; ``None`` on other ranks.
        """
        arg_mbs = None
        if self.holds_first:
            if inputs is None and not kwargs:
                raise InvalidInputError(f"rank {self.rank} runs stage 0: step() needs the inputs")
            inputs = (inputs,) if isinstance(inputs, torch.Tensor) else tuple(inputs or ())
            flat = self.signature.flatten(inputs, kwargs, self._model_name)
            arg_mbs = [tuple(mb) for mb in self._split(flat, "inputs")]
        target_mbs = None
        if self.holds_last:
            if targets is None and not self.returns_loss:
                raise InvalidInputError(
                    f"rank {self.rank} runs the last stage: step() needs the targets"
                )
            self._loss.targets = (self._split(targets, "targets") if targets is not None
                                  else [None] * self.plan.microbatches)
            target_mbs = [torch.tensor(i) for i in range(self.plan.microbatches)]
        if self.schedule is None:
            self._build(arg_mbs)
        for p in self.parameters():
            p.grad = None
        losses: list[torch.Tensor] = []
        try:
            run_schedule(self.schedule, arg_mbs, target_mbs, losses)
        finally:
            self._loss.targets = []
        self._finish_gradients()
        if self.optimizer is not None:
            self.optimizer.step()
        broadcast_buffers(self.modules, self.place)
        if not self.holds_last:
            return None
        total = torch.stack([loss.detach() for loss in losses]).sum()
        if not self.scale_grads:
            return total
        mean = total / len(losses)
        if self.reduce_loss and self.place.replica_group is not None:  # every replica's mean
            dist.all_reduce(mean, group=self.place.replica_group)
            mean /= self.place.replicas
        return mean

    def _finish_gradients(self) -> None:
        """Sum every shared parameter's gradient over the ranks of this pipeline holding a copy,
        then divide each gradient once by m (``scale_grads``): the gradients of the mean loss
        (DDP has averaged them over the replicas in the last backward)."""
        for shared in self._shared:
            if shared.param.grad is None:
                shared.param.grad = torch.zeros_like(shared.param)
            dist.all_reduce(shared.param.grad, group=shared.group)
        if self.scale_grads and self.plan.microbatches > 1:
            for p in self.parameters():
                if p.grad is not None:
                    p.grad.div_(self.plan.microbatches)


@dataclass(frozen=True, slots=True)
class _SharedCopy:
    """A parameter that stages on several ranks use (tied weights): this rank's copy.

    Attributes:
        name: its qualified name in the model.
        param: this rank's copy.
        ranks: the pipeline ranks holding a copy (this one included).
        group: the process group of those ranks.
    """

    name: str
    param: nn.Parameter
    ranks: tuple[int, ...]
    group: Any


def _shared_copies(
    graph: BlockGraph, plan: Plan, rank: int, ranks: Sequence[int], group: Any
) -> list[_SharedCopy]:
    """This rank's copies of parameters shared with other ranks, each with a process group.

    One group per shared parameter whose users lie on stages of two or more ranks (stage s on
    rank ``ranks[s]``); a rank holding every user needs nothing. Every rank calls
    ``new_group`` for every such parameter, in the graph's order (with a sub-group as the
    pipeline, only the members, with local synchronisation). The copies start equal: the
    first holder's values are broadcast to the others.
    """
    layout = stage_layout(graph, plan)
    params = dict(graph.module.named_parameters())
    copies = []
    for shared in graph.shared_params:
        holders = tuple(sorted({ranks[layout.stage_of_block(i)] for i in shared.blocks}))
        if len(holders) < 2:
            continue
        members = [r if group is None else dist.get_global_rank(group, r) for r in holders]
        if group is None:
            pg = dist.new_group(members)
        elif rank in holders:
            pg = dist.new_group(members, use_local_synchronization=True)
        if rank in holders:
            param = params[shared.name]
            with torch.no_grad():
                dist.broadcast(param.data, src=members[0], group=pg)
            copies.append(_SharedCopy(shared.name, param, holders, pg))
    return copies


def _check_not_sharded(model: nn.Module) -> None:
    """Refuse a model whose modules FSDP2 already sharded (an FSDP2 Trainer shards the model's
    own modules in place): it can be neither traced nor sharded again."""
    from torch.distributed.fsdp import FSDPModule

    name = next((n or "the model" for n, m in model.named_modules()
                 if isinstance(m, FSDPModule)), None)
    if name is not None:
        raise InvalidInputError(
            f"model: {name} is already sharded by FSDP2 (a Trainer with FSDP2 replicas shards "
            "the model's modules in place): build each Trainer from a model of its own, e.g. "
            "copy.deepcopy(model) before the first")


def _describe_digest(digest: tuple[Any, ...]) -> str:
    _, firsts, balance, b, m, schedule, d, v, checkpointed, mode = digest
    return (f"stages {list(balance)} (from {', '.join(firsts)}), {m}×{b}, {schedule}"
            + (f", {v} stages per rank" if v > 1 else "")
            + (f", {d} replicas ({mode})" if d > 1 else "")
            + (f", stages {list(checkpointed)} checkpointed" if checkpointed else ""))
