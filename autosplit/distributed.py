"""One process per stage: a Plan's stages on ``torch.distributed.pipelining``.

autosplit writes no communication layer of its own. Stage s of a plan becomes a
:class:`StageModule` — the same blocks that :func:`autosplit.partition` runs, wrapped so that
it takes exactly the values crossing the cut before it and returns exactly the values crossing
the cut after it (a skip connection or a model input that jumps over the stage is passed
through) — and that module is handed to PyTorch's ``PipelineStage``; a ``ScheduleGPipe`` or
``Schedule1F1B`` (``ScheduleLoopedBFS`` / ``ScheduleInterleaved1F1B`` when a rank holds several
stages) runs the micro-batches. Processes are started by torchrun, or on this machine by
:func:`launch` (``torch.distributed.run``'s launcher, one rank per stage), which turns any rank's
death or exception into a :class:`RankFailedError` that names the rank.

Conventions shared with :mod:`autosplit.pipeline`: a batch of B = m·b rows is split with
``tensor.split(b)`` into m micro-batches; BatchNorm sees micro-batches, in order. With
``scale_grads=True`` (the schedules' default) the gradients are those of the mean of the m
micro-batch losses, and :meth:`Trainer.step` returns that mean.

    # every rank (torchrun sets RANK, WORLD_SIZE, MASTER_ADDR …)
    device = autosplit.distributed.init_distributed("gloo", timeout_s=60)
    trainer = Trainer(model, plan, loss_fn, lambda params: torch.optim.SGD(params, lr=1e-3))
    loss = trainer.step((x,), y)     # a tensor on the last stage's rank, None elsewhere
"""

from __future__ import annotations

import contextlib
import datetime
import faulthandler
import gc
import json
import logging
import math
import os
import signal
import socket
import statistics
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import fx, nn
from torch.utils import _pytree as pytree

from autosplit.errors import InvalidInputError, PlanMismatchError, RankFailedError
from autosplit.graph import BlockGraph, Granularity, Segment, trace
from autosplit.records import Plan

__all__ = [
    "StageModule",
    "Trainer",
    "RankFailedError",
    "RunSpec",
    "RunResult",
    "stage_modules",
    "stage_indices",
    "build_stages",
    "stage_metadata",
    "build_schedule",
    "init_distributed",
    "run_rank",
    "launch",
    "graph_for_plan",
    "plan_digest",
    "free_port",
    "train_model_file",
    "measure_plans",
    "tutorial_loss",
    "tutorial_targets",
    "split_spec_problems",
    "DEFAULT_TIMEOUT_S",
]

DEFAULT_TIMEOUT_S = 120.0
"""Process-group timeout (s): a collective or send/recv that waits longer raises on its rank."""

SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B"}
INTERLEAVED_SCHEDULES = {"gpipe": "ScheduleLoopedBFS", "1f1b": "ScheduleInterleaved1F1B"}


# ------------------------------------------------------------------------------ stage modules


class StageModule(nn.Module):
    """Stage s of a plan as a module with positional tensor inputs and a tuple of outputs.

    ``forward(*received)`` takes the values crossing the cut before the stage, in the order of
    ``Cut.tensors`` (stage 0: the model's inputs), runs the stage's blocks, and returns the
    values crossing the cut after it, in ``Cut.tensors`` order; values that cross both cuts
    are passed through unchanged. The last stage returns the model's output leaves: the output
    tensor itself when the model returns one tensor, else a tuple of its tensor leaves
    (:meth:`unflatten_output` rebuilds the model's structure).

    Attributes:
        index: the stage number s.
        body: the stage's blocks (a GraphModule sharing the model's submodules and parameters).
        input_names, output_names: fx value names received and sent.
        blocks: names of the stage's blocks.
    """

    def __init__(
        self,
        index: int,
        segment: Segment,
        graph: BlockGraph,
        input_names: Sequence[str],
        output_names: Sequence[str] | None,
    ) -> None:
        super().__init__()
        self.index = index
        self.body = segment.module
        self.blocks = tuple(b.name for b in graph.blocks[segment.first : segment.end])
        self.input_names = tuple(input_names)
        self._body_inputs = segment.inputs
        self._body_outputs = segment.outputs
        self.is_last = output_names is None
        self._output_spec: pytree.TreeSpec | None = None
        if output_names is None:
            leaves, self._output_spec = pytree.tree_flatten(graph.output_structure())
            self._output_leaves: tuple[Any, ...] = tuple(leaves)
            names = tuple(leaf.name for leaf in leaves if isinstance(leaf, fx.Node))
        else:
            self._output_leaves = ()
            names = tuple(output_names)
        self.output_names = names
        missing = [n for n in self._body_inputs if n not in self.input_names]
        assert not missing, f"stage {index} reads {missing} that do not cross into it"

    def forward(self, *received: Any) -> Any:
        if len(received) != len(self.input_names):
            raise InvalidInputError(
                f"stage {self.index} takes {len(self.input_names)} values "
                f"({', '.join(self.input_names)}), got {len(received)}"
            )
        env = dict(zip(self.input_names, received))
        outputs = self.body(*(env[name] for name in self._body_inputs))
        env.update(zip(self._body_outputs, outputs))
        values = tuple(env[name] for name in self.output_names)
        for name, value in zip(self.output_names, values):
            if not isinstance(value, torch.Tensor):
                where = "the model's output" if self.is_last else (
                    f"the cut after block {self.blocks[-1]!r} (stage {self.index} → "
                    f"{self.index + 1})"
                )
                raise InvalidInputError(
                    f"value {name!r} crossing {where} is a {type(value).__name__}, not a tensor: "
                    "torch.distributed.pipelining sends only tensors; choose cut points it does "
                    "not cross, or compute it from a tensor in the stage that uses it"
                )
        if self.is_last:
            return values[0] if len(values) == 1 and len(self._output_leaves) == 1 else values
        return tuple(v.contiguous() for v in values)  # sent as is: no strided views

    def unflatten_output(self, output: Any) -> Any:
        """The model's output structure from the last stage's output (tensor or tuple)."""
        if self._output_spec is None:
            raise InvalidInputError(f"stage {self.index} is not the last stage")
        tensors = iter((output,) if isinstance(output, torch.Tensor) else tuple(output))
        leaves = [next(tensors) if isinstance(x, fx.Node) else x for x in self._output_leaves]
        return pytree.tree_unflatten(leaves, self._output_spec)

    def extra_repr(self) -> str:
        span = self.blocks[0] if len(self.blocks) == 1 else f"{self.blocks[0]} … {self.blocks[-1]}"
        return f"index={self.index}, blocks={span} ({len(self.blocks)}), receives={len(self.input_names)}"


def graph_for_plan(
    model: nn.Module,
    plan: Plan,
    *,
    granularity: Granularity | None = None,
    leaf_modules: Sequence[type[nn.Module] | str] = (),
) -> BlockGraph:
    """Trace ``model`` the way ``plan`` was made and check that the plan is this model's.

    ``granularity=None`` tries ``"block"`` and then ``"layer"`` and keeps the one whose
    fingerprint is the plan's.

    Raises:
        PlanMismatchError: the plan was made for another model, or its stages do not hold
            exactly the model's blocks in order.
    """
    choices: Sequence[Granularity] = (granularity,) if granularity else ("block", "layer")
    graph = None
    for choice in choices:
        graph = trace(model, granularity=choice, leaf_modules=leaf_modules)
        if graph.fingerprint == plan.fingerprint:
            break
    assert graph is not None
    plan.check_model(graph.fingerprint, graph.model_name)
    plan.check_blocks(graph.block_names, graph.model_name)
    return graph


def stage_modules(
    model: nn.Module,
    plan: Plan,
    *,
    granularity: Granularity | None = None,
    leaf_modules: Sequence[type[nn.Module] | str] = (),
) -> list[StageModule]:
    """Every stage of ``plan`` as a :class:`StageModule` (sharing ``model``'s parameters).

    Chained in one process, ``stages[-1](*…stages[0](*inputs))`` computes ``model(*inputs)``.
    Stage s's ``body`` is the module :func:`autosplit.partition` runs for stage s.
    """
    graph = graph_for_plan(model, plan, granularity=granularity, leaf_modules=leaf_modules)
    return _stage_modules_of(graph, plan)


def _stage_modules_of(graph: BlockGraph, plan: Plan) -> list[StageModule]:
    modules, first = [], 0
    for s, count in enumerate(plan.balance):
        end = first + count
        segment = graph.extract(first, end)
        received = graph.inputs if s == 0 else graph.cuts[first - 1].tensors
        sent = None if end == len(graph.blocks) else graph.cuts[end - 1].tensors
        modules.append(StageModule(s, segment, graph, received, sent))
        first = end
    return modules


def stage_indices(num_stages: int, rank: int, world_size: int) -> tuple[int, ...]:
    """The stages rank ``rank`` holds: ``rank, rank + w, rank + 2w …`` (w = world size).

    One stage per rank when ``world_size == num_stages``; several (interleaved schedules)
    when ``num_stages`` is a multiple of ``world_size``.
    """
    if world_size < 1 or not 0 <= rank < world_size:
        raise InvalidInputError(f"rank {rank} is outside a world of {world_size} processes")
    if num_stages % world_size:
        raise InvalidInputError(
            f"a plan of {num_stages} stages cannot be spread over {world_size} processes: use "
            f"{num_stages} processes (one per stage) or a divisor of {num_stages}"
        )
    return tuple(range(rank, num_stages, world_size))


def stage_metadata(
    modules: Sequence[StageModule], inputs: Sequence[torch.Tensor]
) -> list[tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]]:
    """Example inputs and outputs of every stage for one micro-batch, on the meta device.

    ``inputs`` is one micro-batch of the model's inputs (real or meta tensors); nothing is
    computed and no module changes. A stage's inputs require grad where the values they
    receive do, as ``PipelineStage`` makes them on the receiving rank.

    Raises:
        InvalidInputError: a value crossing a cut is not a tensor (the message names it).
    """
    values: tuple[torch.Tensor, ...] = tuple(
        torch.empty_like(x, device="meta").requires_grad_(False) for x in inputs
    )
    result = []
    with torch.enable_grad():
        for module in modules:
            state = {
                name: torch.empty_like(t, device="meta").requires_grad_(t.requires_grad)
                for name, t in [*module.named_parameters(), *module.named_buffers()]
            }
            received = tuple(
                torch.empty_like(v).requires_grad_(v.requires_grad and v.is_floating_point())
                for v in values
            )
            out = torch.func.functional_call(module, state, received)
            outputs = (out,) if isinstance(out, torch.Tensor) else tuple(out)
            result.append((received, outputs))
            values = outputs
    return result


def _pipeline_stages(
    modules: Sequence[StageModule],
    local: Sequence[int],
    device: torch.device,
    group: Any,
    example: Sequence[torch.Tensor] | None,
) -> list[Any]:
    """``PipelineStage`` objects for the stages in ``local``; with an example micro-batch
    their shapes are given up front (static metadata), else PyTorch infers them on the first
    micro-batch (which runs non-first stages on uninitialised tensors)."""
    from torch.distributed.pipelining import PipelineStage

    meta = None
    if example is not None:
        try:
            meta = stage_metadata(modules, example)
        except InvalidInputError:
            raise
        except Exception:  # noqa: BLE001 - an op without a meta kernel: PyTorch infers shapes
            meta = None
    stages = []
    for i in local:
        kwargs: dict[str, Any] = {}
        if meta is not None:
            kwargs = {"input_args": meta[i][0], "output_args": meta[i][1]}
        stages.append(PipelineStage(modules[i], i, len(modules), device, group=group, **kwargs))
    return stages


def build_stages(
    model: nn.Module,
    plan: Plan,
    *,
    example_inputs: Sequence[torch.Tensor] | None = None,
    device: torch.device | str | None = None,
    group: Any = None,
    granularity: Granularity | None = None,
    leaf_modules: Sequence[type[nn.Module] | str] = (),
) -> tuple[list[Any], list[StageModule]]:
    """This rank's ``PipelineStage`` objects and their modules (moved to ``device``).

    Needs an initialised process group (see :func:`init_distributed`); ``group`` defaults to
    the world. Stage ``i`` goes to rank ``i % world_size``. ``example_inputs`` (one
    micro-batch of the model's inputs, any device, meta included) gives every stage its
    shapes up front (see :func:`stage_metadata`); without it PyTorch infers them during the
    first step.
    """
    if not dist.is_initialized():
        raise InvalidInputError(
            "no process group: call autosplit.distributed.init_distributed() first (under "
            "torchrun or autosplit.distributed.launch)"
        )
    dev = torch.device(device) if device is not None else _default_device(group)
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    mine = stage_indices(len(plan.stages), rank, world)
    modules = stage_modules(model, plan, granularity=granularity, leaf_modules=leaf_modules)
    for i in mine:
        modules[i].to(dev)
    stages = _pipeline_stages(modules, mine, dev, group, example_inputs)
    return stages, [modules[i] for i in mine]


def build_schedule(
    stages: Sequence[Any],
    plan: Plan,
    loss_fn: Callable[[Any, Any], torch.Tensor] | None,
    *,
    scale_grads: bool = True,
) -> Any:
    """The schedule the plan names, over ``plan.microbatches`` micro-batches.

    ``"gpipe"`` → ``ScheduleGPipe``, ``"1f1b"`` → ``Schedule1F1B``; with several stages per
    rank ``ScheduleLoopedBFS`` and ``ScheduleInterleaved1F1B``. ``loss_fn(output, target)``
    is called per micro-batch on the last stage (``None``: forward only).

    Raises:
        InvalidInputError: the schedule is unknown, or cannot run the plan (1F1B needs at least
            as many micro-batches as stages).
    """
    from torch.distributed.pipelining import schedules

    _check_schedule(plan)
    m = plan.microbatches
    single = len(stages) == 1
    cls = getattr(schedules, (SCHEDULES if single else INTERLEAVED_SCHEDULES)[plan.schedule])
    try:
        if single:
            return cls(stages[0], m, loss_fn=loss_fn, scale_grads=scale_grads)
        return cls(list(stages), m, loss_fn=loss_fn, scale_grads=scale_grads)
    except ValueError as exc:
        raise InvalidInputError(
            f"{cls.__name__} cannot run {m} micro-batches on {stages[0].group_size} processes "
            f"({_one_line(str(exc))}): use one process per stage, or another split size"
        ) from None


# ----------------------------------------------------------------------------------- trainer


class _LastStageLoss:
    """The user's loss on the model's output structure and the micro-batch's own target.

    The last stage sends the output's tensor leaves; the schedule hands each micro-batch's
    *index* as the target (``PipelineStage`` accepts only a tensor there), and the real
    target, any structure, is looked up here.
    """

    def __init__(self, loss_fn: Callable[[Any, Any], torch.Tensor], last: StageModule | None) -> None:
        self.loss_fn = loss_fn
        self.last = last
        self.targets: list[Any] = []

    def __call__(self, output: Any, index: torch.Tensor) -> torch.Tensor:
        structure = self.last.unflatten_output(output) if self.last is not None else output
        return self.loss_fn(structure, self.targets[int(index)])


def plan_digest(plan: Plan) -> tuple[Any, ...]:
    """What every rank must agree on: the model, the cut points, b, m and the schedule."""
    return (
        plan.fingerprint,
        tuple(s.blocks[0] for s in plan.stages),
        plan.balance,
        plan.split_size,
        plan.microbatches,
        plan.schedule,
    )


class Trainer:
    """One rank's part of pipelined training: its stages, the schedule and an optimizer.

    Every rank builds a ``Trainer`` from the same model (same architecture; each rank uses
    only its stages' parameters) and the same plan, then calls :meth:`step` with the same
    batch: the first stage's rank needs ``inputs``, the last stage's rank ``targets``; other
    ranks may pass ``None``. The first step sends one micro-batch's input shapes from stage 0's
    rank to every rank, which derive every stage's shapes on the meta device.

    Args:
        model: the model the plan was made for (its modules are shared, not copied).
        plan: the plan; every rank must hold the same one (checked at construction).
        loss_fn: ``loss_fn(output, target) -> scalar`` per micro-batch, ``output`` in the
            model's own output structure, ``target`` the micro-batch's slice of the targets.
        optimizer_factory: ``f(parameters) -> Optimizer`` over this rank's parameters; ``None``
            leaves the gradients in ``.grad`` and the parameters unchanged.
        device: this rank's device; default ``cuda:LOCAL_RANK`` on NCCL, else ``cpu``.
        group: the process group of the pipeline (default: the world).
        scale_grads: divide gradients by m (the loss is the mean over micro-batches); ``False``
            sums them.
        granularity, leaf_modules: how the plan's model was traced (default: found from the
            plan's fingerprint).

    Raises:
        PlanMismatchError: the plan is not this model's, or ranks hold different plans.
        InvalidInputError: no process group, or the world size or schedule does not fit the plan.
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
        scale_grads: bool = True,
        granularity: Granularity | None = None,
        leaf_modules: Sequence[type[nn.Module] | str] = (),
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
                "torchrun or autosplit.distributed.launch)"
            )
        self.plan = plan
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.scale_grads = scale_grads
        self.device = torch.device(device) if device is not None else _default_device(group)
        graph = graph_for_plan(model, plan, granularity=granularity, leaf_modules=leaf_modules)
        self._check_agreement(plan, graph.fingerprint)
        self._local = stage_indices(len(plan.stages), self.rank, self.world_size)
        self._all = _stage_modules_of(graph, plan)
        self.modules = [self._all[i].to(self.device) for i in self._local]
        self._names = {id(p): name for name, p in graph.module.named_parameters()}
        self._shared = _shared_copies(graph, plan, self.rank, self.world_size, group)
        last = next((m for m in self.modules if m.is_last), None)
        self._loss = _LastStageLoss(loss_fn, last)
        _check_schedule(plan)
        self.stages: list[Any] = []
        self.schedule: Any = None
        params = list(self.parameters())
        self.optimizer = optimizer_factory(iter(params)) if optimizer_factory and params else None

    def _check_agreement(self, plan: Plan, fingerprint: str) -> None:
        mine = (fingerprint, plan_digest(plan))
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, mine, group=self.group)
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
        self.stages = _pipeline_stages(self._all, self._local, self.device, self.group, example)
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

    def _split(self, values: Any, what: str) -> list[Any]:
        b, m = self.plan.split_size, self.plan.microbatches
        leaves, spec = pytree.tree_flatten(values)
        tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
        if not tensors:
            raise InvalidInputError(f"the {what} hold no tensor to split into micro-batches")
        for x in tensors:
            if x.dim() == 0 or x.shape[0] != m * b:
                raise InvalidInputError(
                    f"the {what} have {x.shape[0] if x.dim() else 'no'} rows; the plan runs "
                    f"{m} micro-batches of {b} = {m * b} rows (torch.distributed.pipelining "
                    "needs equal micro-batches): give a batch of that size or make a plan for yours"
                )
        chunks = [list(x.to(self.device).split(b)) if isinstance(x, torch.Tensor) else [x] * m
                  for x in leaves]
        return [pytree.tree_unflatten([c[i] for c in chunks], spec) for i in range(m)]

    def step(self, inputs: Any = None, targets: Any = None) -> torch.Tensor | None:
        """One pipelined training step on every rank: zero grads, forward/backward, optimizer.

        Args:
            inputs: a tensor or tuple of tensors with B = m·b rows (needed on stage 0's rank).
            targets: a tensor or a structure of tensors with B rows (needed on the last
                stage's rank); each micro-batch's slice goes to ``loss_fn``.

        Returns:
            On the last stage's rank, the loss: the mean of the m micro-batch losses (the sum
            with ``scale_grads=False``), detached; ``None`` on other ranks.
        """
        arg_mbs = None
        if self.holds_first:
            if inputs is None:
                raise InvalidInputError(f"rank {self.rank} runs stage 0: step() needs the inputs")
            inputs = (inputs,) if isinstance(inputs, torch.Tensor) else tuple(inputs)
            arg_mbs = [tuple(mb) for mb in self._split(inputs, "inputs")]
        target_mbs = None
        if self.holds_last:
            if targets is None:
                raise InvalidInputError(
                    f"rank {self.rank} runs the last stage: step() needs the targets"
                )
            self._loss.targets = self._split(targets, "targets")
            target_mbs = [torch.tensor(i) for i in range(self.plan.microbatches)]
        if self.schedule is None:
            self._build(arg_mbs)
        for p in self.parameters():
            p.grad = None
        losses: list[torch.Tensor] = []
        try:
            self.schedule.step(
                arg_mbs=arg_mbs, target_mbs=target_mbs, losses=losses, return_outputs=False
            )
        finally:
            self._loss.targets = []
        self._finish_gradients()
        if self.optimizer is not None:
            self.optimizer.step()
        if not self.holds_last:
            return None
        total = torch.stack([loss.detach() for loss in losses]).sum()
        return total / len(losses) if self.scale_grads else total


    def _finish_gradients(self) -> None:
        """Sum every shared parameter's gradient over the ranks holding a copy, then divide
        each gradient once by m (``scale_grads``): the gradients of the mean loss."""
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
    graph: BlockGraph, plan: Plan, rank: int, world: int, group: Any
) -> list[_SharedCopy]:
    """This rank's copies of parameters shared with other ranks, each with a process group.

    One group per shared parameter whose users lie on stages of two or more ranks (stage s on
    rank s mod world); a rank holding every user needs nothing. Every rank calls
    ``new_group`` for every such parameter, in the graph's order (with a sub-group as the
    pipeline, only the members, with local synchronisation). The copies start equal: the
    first holder's values are broadcast to the others.
    """
    stage_of = [s for s, count in enumerate(plan.balance) for _ in range(count)]
    params = dict(graph.module.named_parameters())
    copies = []
    for shared in graph.shared_params:
        ranks = tuple(sorted({stage_of[i] % world for i in shared.blocks}))
        if len(ranks) < 2:
            continue
        members = [r if group is None else dist.get_global_rank(group, r) for r in ranks]
        if group is None:
            pg = dist.new_group(members)
        elif rank in ranks:
            pg = dist.new_group(members, use_local_synchronization=True)
        if rank in ranks:
            param = params[shared.name]
            with torch.no_grad():
                dist.broadcast(param.data, src=members[0], group=pg)
            copies.append(_SharedCopy(shared.name, param, ranks, pg))
    return copies


def _check_schedule(plan: Plan) -> None:
    if plan.schedule not in SCHEDULES:
        raise InvalidInputError(
            f"plan schedule {plan.schedule!r} is not one of {', '.join(SCHEDULES)}"
        )
    p, m = len(plan.stages), plan.microbatches
    if plan.schedule == "1f1b" and m < p:
        raise InvalidInputError(
            f"schedule 1f1b needs at least as many micro-batches as stages ({m} < {p}): use "
            "schedule gpipe, or a smaller split size"
        )


def _describe_digest(digest: tuple[Any, ...]) -> str:
    _, firsts, balance, b, m, schedule = digest
    return f"stages {list(balance)} (from {', '.join(firsts)}), {m}×{b}, {schedule}"


# ------------------------------------------------------------------------------ process groups


def _default_device(group: Any = None) -> torch.device:
    if dist.is_initialized() and dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def init_distributed(backend: str | None = None, timeout_s: float = DEFAULT_TIMEOUT_S) -> torch.device:
    """Join the process group described by the environment (torchrun's RANK, WORLD_SIZE …).

    Args:
        backend: ``"gloo"`` (CPU) or ``"nccl"`` (one GPU per rank, ``cuda:LOCAL_RANK``);
            default NCCL when CUDA is available, else gloo.
        timeout_s: how long (s) a collective or send/recv may wait for a peer before it
            raises; this bounds how long a dead or stuck peer can hold the others.

    Returns:
        This rank's device.
    """
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend not in ("gloo", "nccl"):
        raise InvalidInputError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
    if not timeout_s > 0:
        raise InvalidInputError(f"timeout_s must be positive, got {timeout_s!r}")
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing and not dist.is_initialized():
        raise InvalidInputError(
            f"{', '.join(missing)} not set: start the ranks with torchrun or "
            "autosplit.distributed.launch"
        )
    device = torch.device("cpu")
    kwargs: dict[str, Any] = {}
    if backend == "nccl":
        if not torch.cuda.is_available():
            raise InvalidInputError("backend 'nccl' needs CUDA GPUs; use --backend gloo on CPUs")
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        kwargs["device_id"] = device
    if not dist.is_initialized():
        dist.init_process_group(
            backend, timeout=datetime.timedelta(seconds=timeout_s), **kwargs
        )
    return device


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on ``host`` right now (bind to port 0 and read it back)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def run_rank(
    fn: Callable[..., Any],
    args: tuple[Any, ...] = (),
    backend: str | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    threads: int | None = 1,
    status_dir: str | None = None,
) -> Any:
    """Run ``fn(*args)`` as one rank: set the CPU threads, join the process group (see
    :func:`init_distributed`), call ``fn`` and destroy the group again.

    The body of every rank :func:`launch` starts; under torchrun, call it in each process.
    With ``status_dir``, a rank that raises first writes ``rank<N>.json`` there (its error and
    the time), so that the launcher can tell the rank that failed first from the peers that
    failed because it was gone.
    """
    faulthandler.enable()  # a rank that crashes in C++ leaves its stack on stderr
    if threads:
        torch.set_num_threads(threads)
    try:
        init_distributed(backend, timeout_s)
        result = fn(*args)
    except BaseException as exc:
        if status_dir is not None:
            _write_status(status_dir, exc)
        raise  # the process ends: its process group goes with it
    # stages and schedules hold reference cycles to pending work objects; collect them while
    # the group is alive (freed at interpreter exit instead, gloo's threads abort the process)
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()
    return result


def _write_status(status_dir: str, exc: BaseException) -> None:
    rank = int(os.environ.get("RANK", "-1"))
    while exc.__cause__ is not None:  # PipelineStage wraps the model's error: report that one
        exc = exc.__cause__
    text = _shorten(_one_line(f"{type(exc).__name__}: {exc}"), 400)
    record = {"rank": rank, "time": time.time(), "error": text}
    path = os.path.join(status_dir, f"rank{rank}.json")
    with contextlib.suppress(OSError):
        with open(path + ".tmp", "w") as fh:
            json.dump(record, fh)
        os.replace(path + ".tmp", path)


def _read_statuses(status_dir: str) -> dict[int, tuple[float, str]]:
    found = {}
    for name in os.listdir(status_dir):
        if name.startswith("rank") and name.endswith(".json"):
            with contextlib.suppress(OSError, ValueError, KeyError):
                with open(os.path.join(status_dir, name)) as fh:
                    record = json.load(fh)
                found[int(record["rank"])] = (float(record["time"]), str(record["error"]))
    return found


_QUIET_LOGGERS = ("torch.distributed.elastic", "torch.multiprocessing")


@contextlib.contextmanager
def _launcher_quiet() -> Iterator[None]:
    """Silence the launcher's own log lines (failures are reported by RankFailedError)."""
    loggers = [
        logging.getLogger(name) for name in list(logging.Logger.manager.loggerDict)
        if name.startswith(_QUIET_LOGGERS)
    ]
    saved = [(lg, lg.disabled) for lg in loggers]
    for lg in loggers:
        lg.disabled = True
    try:
        yield
    finally:
        for lg, disabled in saved:
            lg.disabled = disabled


@contextlib.contextmanager
def _signals_restored() -> Iterator[None]:
    """The launcher installs signal handlers; put the caller's back afterwards."""
    names = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")
    saved = {}
    for name in names:
        sig = getattr(signal, name, None)
        if sig is not None:
            with contextlib.suppress(ValueError):  # not the main thread
                saved[sig] = signal.getsignal(sig)
    try:
        yield
    finally:
        for sig, handler in saved.items():
            with contextlib.suppress(ValueError, TypeError):
                signal.signal(sig, handler)


def launch(
    fn: Callable[..., Any],
    nprocs: int,
    *args: Any,
    backend: str = "gloo",
    timeout_s: float = DEFAULT_TIMEOUT_S,
    threads: int | None = 1,
    host: str = "127.0.0.1",
    port: int | None = None,
    log_dir: str | None = None,
    quiet: bool = True,
) -> dict[int, Any]:
    """Run ``fn(*args)`` on ``nprocs`` ranks on this machine, one process each.

    Uses ``torch.distributed.run``'s launcher (an elastic agent with a c10d rendezvous on
    ``host:port``, no restarts). Every rank joins a process group first (see
    :func:`init_distributed`; ``timeout_s`` bounds every wait on a peer) and destroys it
    afterwards. When a rank dies or raises, the launcher stops the others and this function
    raises :class:`RankFailedError`.

    Args:
        fn: a module-level function (ranks are spawned and import it by name).
        nprocs: number of ranks.
        backend: ``"gloo"`` or ``"nccl"``.
        timeout_s: process-group timeout (s).
        threads: ``torch.set_num_threads`` in every rank (``None``: leave torch's default).
        host, port: where the rendezvous listens (default: a free port on 127.0.0.1).
        log_dir: where the ranks' stdout/stderr go (``None``: this process's terminal).
        quiet: keep the launcher's own log lines off the terminal.

    Returns:
        ``{rank: fn's return value}``.

    Raises:
        RankFailedError: a rank exited with a non-zero code or raised; the message names the
            rank that failed first and its error.
    """
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, SignalException, Std
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    if isinstance(nprocs, bool) or not isinstance(nprocs, int) or nprocs < 1:
        raise InvalidInputError(f"nprocs must be a positive integer, got {nprocs!r}")
    if backend not in ("gloo", "nccl"):
        raise InvalidInputError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
    if backend == "nccl" and torch.cuda.device_count() < nprocs:
        raise InvalidInputError(
            f"backend 'nccl' runs one GPU per rank: {nprocs} ranks but "
            f"{torch.cuda.device_count()} CUDA device(s); use --backend gloo"
        )
    port = port or free_port(host)
    status = tempfile.TemporaryDirectory(prefix="autosplit-launch-")
    status_dir = status.name
    logs = (DefaultLogsSpecs(log_dir=log_dir, redirects=Std.ALL) if log_dir
            else DefaultLogsSpecs(log_dir=os.path.join(status_dir, "elastic")))  # removed after
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nprocs,
        run_id=f"autosplit-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d",
        rdzv_endpoint=f"{host}:{port}",
        rdzv_configs={"timeout": int(max(timeout_s, 30))},
        max_restarts=0,
        monitor_interval=0.1,
        start_method="spawn",
        local_addr=host,
        logs_specs=logs,
    )
    quiet_ctx = _launcher_quiet() if quiet else contextlib.nullcontext()
    with status:
        try:
            with quiet_ctx, _signals_restored():
                results = elastic_launch(config, run_rank)(
                    fn, args, backend, timeout_s, threads, status_dir
                )
        except ChildFailedError as exc:
            raise _rank_failure(exc, _read_statuses(status_dir), nprocs, log_dir) from None
        except SignalException as exc:
            raise KeyboardInterrupt(f"stopped by signal {exc.sigval}") from None
    return dict(results)


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


_KNOCK_ON = ("connection closed", "connection reset", "broken pipe", "timed out", "timeout",
             "remote worker")


def _is_knock_on(text: str) -> bool:
    """Whether an error is what a rank sees when a peer is gone or stuck."""
    lower = text.lower()
    return any(w in lower for w in _KNOCK_ON)


def _rank_failure(
    exc: Any, statuses: dict[int, tuple[float, str]], nprocs: int, log_dir: str | None
) -> RankFailedError:
    """Name the rank that failed first.

    The launcher reports one failed process, not necessarily the first: when rank 1 dies, rank
    0 fails a moment later with "connection closed by peer", and either may be seen first. The
    ranks' own records (:func:`run_rank`) settle it: the earliest error that is not such a
    knock-on error; else a rank that died without raising (exit code or signal); else the
    rank that left no record while its peers failed waiting for it.
    """
    reasons = {rank: text for rank, (_, text) in statuses.items()}
    hard: dict[int, str] = {}
    for rank, failure in exc.failures.items():
        if rank in statuses:
            continue
        message = failure.message
        if isinstance(message, dict):
            message = message.get("message", "")
        text = _one_line(message or "")
        if failure.exitcode and (not text or text.startswith("To enable traceback")):
            code = failure.exitcode
            text = f"exited with code {code}" if code > 0 else f"killed by signal {-code}"
        hard[rank] = text or "failed"
    reasons.update(hard)
    primary = sorted((t, r) for r, (t, text) in statuses.items() if not _is_knock_on(text))
    silent = [r for r in range(nprocs) if r not in reasons]
    if primary:
        first = primary[0][1]
    elif hard:
        first = min(hard)
    elif silent:
        first = silent[0]
        who = " or ".join(f"rank {r}" for r in silent)
        reasons[first] = (
            f"stopped without an error (crashed, killed or stuck) — {who}"
            if len(silent) > 1 else "stopped without an error (crashed, killed or stuck)"
        )
    else:
        first = min(statuses, key=lambda r: statuses[r][0])
    others = sorted(r for r in reasons if r != first)
    message = f"rank {first} failed: {reasons[first]}"
    if others:
        message += " (then " + "; ".join(f"rank {r}: {_shorten(reasons[r])}" for r in others) + ")"
    if log_dir:
        message += f"; logs in {log_dir}"
    return RankFailedError(message, rank=first, failures=reasons)


def _shorten(text: str, limit: int = 160) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


# --------------------------------------------------------------------------- autosplit run


def tutorial_loss(output: Any, target: Any) -> torch.Tensor:
    """The tutorial's loss: MSE of every floating output tensor against its target.

    ``target`` holds one tensor per floating output leaf, in order (see
    :func:`tutorial_targets`); integer outputs are ignored.
    """
    leaves = [x for x in pytree.tree_leaves(output) if isinstance(x, torch.Tensor) and x.is_floating_point()]
    targets = pytree.tree_leaves(target)
    if len(leaves) != len(targets):
        raise InvalidInputError(
            f"the model returns {len(leaves)} floating tensors but {len(targets)} targets were given"
        )
    losses = [nn.functional.mse_loss(x, t.to(x.dtype)) for x, t in zip(leaves, targets)]
    return torch.stack(losses).sum()


def tutorial_targets(model: nn.Module, inputs: Sequence[torch.Tensor], seed: int = 0) -> tuple[torch.Tensor, ...]:
    """Targets for :func:`tutorial_loss` and a batch of ``inputs``: one-hot labels over the last
    dimension of every floating output with two or more dimensions (the tutorial's MSE on
    one-hot labels), random values for 1-D outputs.

    The output shapes come from a run on the meta device (nothing is computed; ``model`` is
    not changed); an operation without a meta kernel falls back to one real sample in eval mode.
    """
    gen = torch.Generator().manual_seed(seed)
    targets = []
    for shape in _output_shapes(model, inputs):
        if len(shape) >= 2:
            labels = torch.randint(0, shape[-1], tuple(shape[:-1]), generator=gen)
            targets.append(nn.functional.one_hot(labels, shape[-1]).float())
        else:
            targets.append(torch.randn(tuple(shape), generator=gen))
    return tuple(targets)


def _output_shapes(model: nn.Module, inputs: Sequence[torch.Tensor]) -> list[tuple[int, ...]]:
    def floating(out: Any) -> list[tuple[int, ...]]:
        return [tuple(x.shape) for x in pytree.tree_leaves(out)
                if isinstance(x, torch.Tensor) and x.is_floating_point()]

    try:
        state = {k: torch.empty_like(v, device="meta")
                 for k, v in [*model.named_parameters(), *model.named_buffers()]}
        meta_inputs = tuple(x.to("meta") for x in inputs)
        return floating(torch.func.functional_call(model, state, meta_inputs))
    except Exception:  # noqa: BLE001 - an op without a meta kernel: run one real sample
        batch = int(inputs[0].shape[0])
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad():
                shapes = floating(model(*(x[:1] for x in inputs)))
        finally:
            model.train(was_training)
        return [(batch, *shape[1:]) for shape in shapes]


@dataclass(frozen=True, slots=True)
class RunSpec:
    """What ``autosplit run`` trains: a model file, a plan and the batch.

    Attributes:
        model: the model file (path or module) and ``entry`` its factory, as for the CLI.
        plan: the plan (every rank gets this one).
        steps: training steps to run.
        input_shape: one float input of this per-sample shape instead of ``example_inputs``.
        lr: SGD learning rate (the tutorial's 0.001).
        seed: seeds the model's initial weights, the inputs and the targets on every rank.
        model_args: keyword arguments for the model file's factory and example inputs.
    """

    model: str
    entry: str | None
    plan: Plan
    steps: int = 3
    input_shape: tuple[int, ...] | None = None
    lr: float = 0.001
    seed: int = 0
    model_args: tuple[tuple[str, Any], ...] = ()


@dataclass(frozen=True, slots=True)
class RunResult:
    """What ``autosplit run`` measured.

    Attributes:
        world_size: number of ranks.
        step_s: wall time of each step (s): the slowest rank's, all ranks starting together.
        rank_step_s: ``rank_step_s[r][i]`` is rank r's time for step i (s).
        losses: the loss of each step (mean over micro-batches), from the last stage's rank.
        device: the devices, e.g. ``"cpu"`` or ``"cuda:0, cuda:1"``.
        threads: intra-op threads per rank.
    """

    world_size: int
    step_s: tuple[float, ...]
    rank_step_s: tuple[tuple[float, ...], ...]
    losses: tuple[float, ...]
    device: str
    threads: int

    @property
    def steady_step_s(self) -> float:
        """Median step time without the first step (which infers the stages' shapes)."""
        rest = self.step_s[1:] or self.step_s
        return statistics.median(rest)


def train_model_file(spec: RunSpec) -> RunResult:
    """One rank of ``autosplit run``: build the model and batch, train ``spec.steps`` steps.

    Runs inside an initialised process group (torchrun or :func:`launch`); every rank returns
    the same :class:`RunResult`.
    """

    plan = spec.plan
    model, inputs = _model_and_batch(spec, plan.microbatches * plan.split_size)
    trainer, targets = _trainer(spec, model, inputs, plan)
    times, losses = [], []
    for _ in range(spec.steps):
        seconds, loss = _timed_step(trainer, inputs, targets)
        times.append(seconds)
        losses.append(loss)
    gathered: list[Any] = [None] * trainer.world_size
    dist.all_gather_object(gathered, (trainer.rank, str(trainer.device), times, losses,
                                      trainer.holds_last, torch.get_num_threads()))
    gathered.sort(key=lambda g: g[0])
    per_rank = tuple(tuple(g[2]) for g in gathered)
    last = next(g for g in gathered if g[4])
    devices = sorted({g[1] for g in gathered})
    return RunResult(
        world_size=trainer.world_size,
        step_s=tuple(max(col) for col in zip(*per_rank)),
        rank_step_s=per_rank,
        losses=tuple(last[3]),
        device=", ".join(devices),
        threads=int(gathered[0][5]),
    )


def _model_and_batch(spec: RunSpec, batch: int) -> tuple[nn.Module, tuple[Any, ...]]:
    """The model file's model (seeded) and a batch of ``batch`` rows of its inputs."""
    from autosplit.modelfile import load_model_file

    source = load_model_file(spec.model, spec.entry)
    kwargs = dict(spec.model_args)
    torch.manual_seed(spec.seed)
    model = source.build(**kwargs)
    torch.manual_seed(spec.seed + 1)
    if spec.input_shape:
        inputs: Any = (torch.randn(batch, *spec.input_shape),)
    else:
        inputs = source.example_inputs(batch, **kwargs)
    return model, (inputs,) if isinstance(inputs, torch.Tensor) else tuple(inputs)


def _trainer(spec: RunSpec, model: nn.Module, inputs: tuple[Any, ...], plan: Plan) -> tuple[Trainer, Any]:
    lr = spec.lr
    trainer = Trainer(model, plan, tutorial_loss, lambda params: torch.optim.SGD(params, lr=lr))
    targets = tutorial_targets(model, inputs, spec.seed + 2) if trainer.holds_last else None
    return trainer, targets


def _timed_step(trainer: Trainer, inputs: tuple[Any, ...], targets: Any) -> tuple[float, float]:
    """One training step on every rank, started together: (seconds on this rank, loss)."""
    dist.barrier()
    start = time.perf_counter()
    loss = trainer.step(inputs if trainer.holds_first else None, targets)
    return time.perf_counter() - start, float(loss) if loss is not None else math.nan


def measure_plans(spec: RunSpec, plans: Sequence[Plan], rounds: int = 2) -> list[list[float]]:
    """One rank of a side-by-side measurement: every plan trained in turn, A B A B ….

    All plans must have the same number of stages (one rank each here) and batch. Each plan
    first runs one untimed step (the stages' shapes are settled then); then ``rounds`` rounds
    time one step of each plan in turn, so drift in the machine's speed hits all alike.

    Returns:
        ``times[i]``: plan i's step times (s), the slowest rank's each, on every rank.
    """
    batch = {p.microbatches * p.split_size for p in plans}
    if len(batch) != 1 or len({len(p.stages) for p in plans}) != 1:
        raise InvalidInputError("measure_plans needs plans of one batch size and stage count")
    model, inputs = _model_and_batch(spec, batch.pop())
    runs = [_trainer(spec, model, inputs, plan) for plan in plans]
    for trainer, targets in runs:
        _timed_step(trainer, inputs, targets)
    mine: list[list[float]] = [[] for _ in plans]
    for _ in range(rounds):
        for i, (trainer, targets) in enumerate(runs):
            mine[i].append(_timed_step(trainer, inputs, targets)[0])
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    return [[max(rank[i][r] for rank in gathered) for r in range(rounds)] for i in range(len(plans))]


# ------------------------------------------------------------------------- split_spec checks


def split_spec_problems(model: nn.Module, plan: Plan) -> list[str]:
    """Why ``plan``'s cuts are not all module boundaries of ``model`` (empty: they are).

    A cut is a module boundary for ``torch.distributed.pipelining.pipeline`` when the stage
    after it begins with the first operation of a submodule that is called once: splitting
    "at the beginning of" that submodule then cuts the same place.
    """
    graph = graph_for_plan(model, plan)
    from autosplit.graph import _module_path

    nodes = [n for n in graph.module.graph.nodes if n.op not in ("placeholder", "output")]
    position = {n.name: i for i, n in enumerate(nodes)}
    problems = []
    first = 0
    for s, count in enumerate(plan.balance):
        if s > 0:
            block = graph.blocks[first]
            fqn = block.name
            try:
                model.get_submodule(fqn)
            except AttributeError:
                problems.append(f"stage {s} begins with block {fqn!r}, which is not a submodule")
                first += count
                continue
            inside = [position[n.name] for n in nodes
                      if (p := _module_path(graph.module, n)) == fqn or p.startswith(fqn + ".")]
            if not inside or inside[0] != position[block.nodes[0]]:
                problems.append(
                    f"stage {s} begins inside module {fqn!r}, not where its forward begins"
                )
            elif inside != list(range(inside[0], inside[0] + len(inside))):
                problems.append(
                    f"stage {s} begins at module {fqn!r}, which is called more than once or "
                    "interleaved with other operations"
                )
        first += count
    return problems
