"""Stage s of a plan as a module for ``PipelineStage``, and the schedules that run them.

What a stage receives, sends and passes through is :mod:`autosplit.stages`'s
:class:`~autosplit.stages.StageLayout`; this module wraps it for
``torch.distributed.pipelining`` (positional tensors in, a tuple of tensors out).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from autosplit.checkpointing import checkpointed
from autosplit.errors import InvalidInputError
from autosplit.graph import BlockGraph, Granularity, Segment
from autosplit.launch import default_device, one_line
from autosplit.records import Plan
from autosplit.schedules import SPLIT_BACKWARD
from autosplit.schedules.placement import V_SCHEDULES, stage_indices, stage_ranks
from autosplit.stages import StageLayout, graph_for_plan, run_stage, stage_layout

SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B"}
"""The two schedules whose plans may run on any divisor of p ranks (one stage per rank here)."""
INTERLEAVED_SCHEDULES = {"gpipe": "ScheduleLoopedBFS", "1f1b": "ScheduleInterleaved1F1B"}
"""What "gpipe" and "1f1b" run as when a rank holds several stages."""
SPLIT_BACKWARD_SCHEDULES = SPLIT_BACKWARD
"""Schedules that run a stage's backward as input-gradient (I) then weight-gradient (W)."""


class StageModule(nn.Module):
    """Stage s of a plan as a module with positional tensor inputs and a tuple of outputs.

    ``forward(*received)`` takes the values crossing the cut before the stage, in the order of
    ``Cut.tensors`` (stage 0: the model's inputs), runs the stage's blocks, and returns the
    values crossing the cut after it, in ``Cut.tensors`` order; values that cross both cuts
    are passed through unchanged (see :func:`autosplit.stages.run_stage`). The last stage
    returns the model's output leaves: the output tensor itself when the model returns one
    tensor, else a tuple of its tensor leaves (:meth:`unflatten_output` rebuilds the model's
    structure).

    Attributes:
        index: the stage number s.
        body: the stage's blocks (a GraphModule sharing the model's submodules and parameters).
        input_names, output_names: fx value names received and sent.
        blocks: names of the stage's blocks.
        is_last: whether this is the last stage.
        checkpoint: whether the blocks run under activation checkpointing (the plan's
            ``Stage.checkpoint``; see :mod:`autosplit.checkpointing`).
        copy_sent: whether the values sent are copies. Schedules that split the backward
            (:data:`SPLIT_BACKWARD_SCHEDULES`) detach what a stage sent, in place, once its
            input gradients are computed; a value the stage's weight gradients still need (a
            skip connection's value, read by a layer of the stage and sent on) must then be
            a copy.
    """

    def __init__(self, layout: StageLayout, index: int, segment: Segment,
                 checkpoint: bool = False, copy_sent: bool = False) -> None:
        super().__init__()
        spec = layout.stages[index]
        assert (segment.first, segment.end) == (spec.first, spec.end)
        assert (segment.inputs, segment.outputs) == (spec.reads, spec.makes)
        self.index = index
        self.body = segment.module
        self.blocks = layout.block_names[spec.first : spec.end]
        self.input_names = spec.receives
        self.output_names = spec.sends
        self.is_last = index == len(layout.stages) - 1
        self.checkpoint = checkpoint
        self.copy_sent = copy_sent
        self._layout = layout

    def forward(self, *received: Any) -> Any:
        """The values this stage sends (see the class docstring).

        Raises:
            InvalidInputError: not one value per received name.
            CutValueError: a value to send is not a tensor (it names the value and the cut).
        """
        bools = self._layout.bools
        received = tuple(x.view(torch.bool) if name in bools and isinstance(x, torch.Tensor)
                         and x.dtype == torch.uint8 else x
                         for name, x in zip(self.input_names, received))
        body: Callable[..., Any] = self.body
        if self.checkpoint and not any(isinstance(x, torch.Tensor) and x.is_meta
                                       for x in received):  # shapes only: nothing to keep
            body = checkpointed(self.body, self.body)
        values = run_stage(self._layout, self.index, body, received)
        if self.is_last:
            single = len(values) == 1 and len(self._layout.output.leaves) == 1
            return values[0] if single else values
        values = tuple(v.view(torch.uint8) if v.dtype == torch.bool else v  # sent as bytes
                       for v in values)
        if self.copy_sent:
            return tuple(v.clone(memory_format=torch.contiguous_format) for v in values)
        return tuple(v.contiguous() for v in values)  # sent as is: no strided views

    def unflatten_output(self, output: Any) -> Any:
        """The model's output structure from the last stage's output (tensor or tuple)."""
        if not self.is_last:
            raise InvalidInputError(f"stage {self.index} is not the last stage")
        return self._layout.output.build((output,) if isinstance(output, torch.Tensor)
                                         else tuple(output))

    def extra_repr(self) -> str:
        span = self.blocks[0] if len(self.blocks) == 1 else f"{self.blocks[0]} … {self.blocks[-1]}"
        return (f"index={self.index}, blocks={span} ({len(self.blocks)}), "
                f"receives={len(self.input_names)}"
                + (", checkpoint=True" if self.checkpoint else ""))


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
    layout = stage_layout(graph, plan)
    copy_sent = plan.schedule in SPLIT_BACKWARD_SCHEDULES
    return [StageModule(layout, s.index, graph.extract(s.first, s.end),
                        plan.stages[s.index].checkpoint, copy_sent) for s in layout.stages]


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
    wrapped: dict[int, nn.Module] | None = None,
) -> list[Any]:
    """``PipelineStage`` objects for the stages in ``local``; with an example micro-batch
    their shapes are given up front (static metadata), else PyTorch infers them on the first
    micro-batch (which runs non-first stages on uninitialised tensors). ``wrapped[i]``, when
    given, is what stage i's ``PipelineStage`` runs instead of ``modules[i]`` (its DDP)."""
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
        module = (wrapped or {}).get(i, modules[i])
        stages.append(PipelineStage(module, i, len(modules), device, group=group, **kwargs))
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
    the world. Stage ``i`` goes to rank ``i % world_size`` (ZB-V, DualPipeV: a V, see
    :func:`stage_ranks`). ``example_inputs`` (one micro-batch of the model's inputs, any
    device, meta included) gives every stage its shapes up front (see :func:`stage_metadata`);
    without it PyTorch infers them during the first step.
    """
    if not dist.is_initialized():
        raise InvalidInputError(
            "no process group: call autosplit.distributed.init_distributed() first (under "
            "torchrun or autosplit.distributed.launch())"
        )
    dev = torch.device(device) if device is not None else default_device(group)
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    check_schedule(plan, world)
    mine = stage_indices(len(plan.stages), rank, world, plan.schedule in V_SCHEDULES)
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

    ``stages`` are this rank's ``PipelineStage`` objects, ascending. The class is
    :func:`autosplit.schedules.torch_class_name`'s: ``"gpipe"`` → ``ScheduleGPipe``,
    ``"1f1b"`` → ``Schedule1F1B`` (with several stages per rank ``ScheduleLoopedBFS`` and
    ``ScheduleInterleaved1F1B``), ``"looped-bfs"``, ``"interleaved-1f1b"``,
    ``"interleaved-zb"``, ``"zbv"`` (``ScheduleZBVZeroBubble``) and ``"dualpipev"`` their own.
    ``loss_fn(output, target)`` is called per micro-batch on the last stage (``None``: forward
    only).

    Raises:
        InvalidInputError: the schedule is unknown, or cannot run the plan on these ranks (see
            :func:`check_schedule`).
    """
    from torch.distributed.pipelining import schedules

    from autosplit.schedules import torch_class_name

    v = check_schedule(plan, stages[0].group_size)
    if len(stages) != v:
        raise InvalidInputError(f"schedule {plan.schedule!r} runs {v} stages per rank of this "
                                f"plan; got {len(stages)} stages")
    name = torch_class_name(plan.schedule, v)
    cls = getattr(schedules, name)
    m = plan.microbatches
    try:
        if name in SCHEDULES.values():
            return cls(stages[0], m, loss_fn=loss_fn, scale_grads=scale_grads)
        return cls(list(stages), m, loss_fn=loss_fn, scale_grads=scale_grads)
    except ValueError as exc:
        raise InvalidInputError(
            f"{cls.__name__} cannot run {m} micro-batches on {stages[0].group_size} processes "
            f"({one_line(str(exc))}): use one process per stage, or another split size"
        ) from None


def run_schedule(schedule: Any, arg_mbs: list[tuple[Any, ...]] | None,
                 target_mbs: list[torch.Tensor] | None, losses: list[torch.Tensor]) -> None:
    """One training step of ``schedule`` on micro-batches already split (no outputs kept).

    A release whose ``step`` takes ``arg_mbs`` (torch 2.14.1) gets them through
    ``step(arg_mbs=…, target_mbs=…)``; an earlier one (torch 2.11's ``step`` would split
    ``arg_mbs`` as a keyword input) through ``_step_microbatches``, after the per-step
    preparation its ``step`` makes.
    """
    if "arg_mbs" in inspect.signature(schedule.step).parameters:
        schedule.step(arg_mbs=arg_mbs, target_mbs=target_mbs, losses=losses,
                      return_outputs=False)
        return
    stages = getattr(schedule, "_stages", None) or [schedule._stage]
    for stage in stages:
        stage.has_backward = schedule._has_backward
        stage.clear_runtime_states()
    schedule._step_microbatches(arg_mbs, None, target_mbs, losses, False)


def check_schedule(plan: Plan, ranks: int, *, replicas: int = 1) -> int:
    """Check that torch can run ``plan``'s schedule on ``ranks`` pipeline ranks; return v.

    v, the stages each rank holds, is p / ``ranks``. ``"gpipe"`` and ``"1f1b"`` plans made
    for one stage per rank (``Plan.stages_per_rank`` = 1) run on any divisor of p ranks;
    every other plan runs on exactly p / ``Plan.stages_per_rank`` ranks per replica (the
    stages per rank it was planned for). Whether torch's class accepts (ranks, v, m) is
    asked of the class itself (:func:`autosplit.schedules.torch_order`).

    Raises:
        InvalidInputError: an unknown schedule; p not a multiple of ``ranks``; ``ranks`` other
            than the plan's; torch's class refuses (e.g. ZB-V and DualPipeV need exactly 2
            stages per rank, DualPipeV and 1F1B at least as many micro-batches as stages); a
            schedule splitting the backward (interleaved-zb, zbv, dualpipev) with replicas,
            which ``DistributedDataParallel`` cannot reduce.
    """
    from autosplit.schedules import SCHEDULES as ALL
    from autosplit.schedules import torch_order

    schedule, p, m = plan.schedule, len(plan.stages), plan.microbatches
    if schedule not in ALL:
        raise InvalidInputError(f"plan schedule {schedule!r} is not one of {', '.join(ALL)}")
    stage_ranks(p, ranks)  # p a multiple of the ranks
    v, planned = p // ranks, plan.stages_per_rank
    if (planned > 1 or schedule not in SCHEDULES) and v != planned:
        raise InvalidInputError(
            f"schedule {schedule!r}: the plan places {planned} stage{'s' if planned > 1 else ''}"
            f" per rank ({p} stages on {p // planned} ranks per replica), not {v} on {ranks}: "
            f"run it on {p // planned * replicas} ranks"
        )
    if schedule == "1f1b" and m < p:
        raise InvalidInputError(
            f"schedule 1f1b needs at least as many micro-batches as stages ({m} < {p}): use "
            "schedule gpipe, or a smaller split size"
        )
    if replicas > 1 and schedule in SPLIT_BACKWARD_SCHEDULES:
        raise InvalidInputError(
            f"schedule {schedule!r} with {replicas} replicas: it splits each backward into "
            "input and weight gradients, which DistributedDataParallel cannot all-reduce; use "
            "schedule interleaved-1f1b, 1f1b or gpipe with replicas, or one replica"
        )
    torch_order(schedule, ranks, v, m)  # ScheduleUnavailableError (an InvalidInputError)
    return v
