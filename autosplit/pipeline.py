"""PipelinedModule: run the stages of a plan on several devices in one process (mechanism).

Each stage is a GraphModule cut from the traced model (blocks ``first … end-1``, see
:mod:`autosplit.stages`); it holds the model's own submodules and parameters, moved to the
stage's device with ``.to()`` exactly as the hand-written tutorial does.
``PipelinedModule.forward`` generalises the tutorial's ``PipelineParallelResNet50.forward`` to p
stages: split the batch into micro-batches of ``split_size``, run micro-batch i on stage s at
clock tick i + s (GPipe's fill-drain order, later stages first within a tick), hand each stage's
sent values (skip connections included) to the next stage's device, and concatenate the
outputs. On CUDA the launches are asynchronous, so the stages overlap; backward overlaps
through autograd's per-device threads. A stage the plan marks ``checkpoint`` (or all, or
those chosen with ``checkpoint=``) runs under activation checkpointing
(:mod:`autosplit.checkpointing`).

This module runs the graph and plan it is given: it never traces, profiles or plans. That
policy is :func:`autosplit.partition` (:mod:`autosplit.partitioning`), which may hand over a
``planner`` callback to be run on the first batch instead of a plan.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from autosplit import checks
from autosplit.checkpointing import checkpointed
from autosplit.errors import InvalidInputError
from autosplit.graph import BlockGraph, Segment
from autosplit.measure.profiler import check_inputs
from autosplit.records import Plan
from autosplit.stages import StageLayout, concat, move, run_stage, split, stage_layout

__all__ = ["PipelinedModule", "Planner", "checkpoint_flags"]

Planner = Callable[[tuple[Any, ...], dict[str, Any]], tuple[BlockGraph, Plan]]
"""Policy called on the first batch of a lazily planned module:
``(args, kwargs) -> (graph, plan)``."""


class PipelinedModule(nn.Module):
    """A model split into pipeline stages on several devices.

    The wrapped model is registered as ``module`` (its state dict keys gain a ``module.``
    prefix, as with DistributedDataParallel); the stages share its parameters.

    Args:
        model: the model (its modules and parameters are used, not copied).
        devices: one device per stage.
        graph, plan: the traced model and the plan to run (the plan must be the graph's).
        split_size: micro-batch size b; ``None``: the plan's.
        planner: instead of ``graph`` and ``plan``, a callback that makes both from the
            first batch (called once, on the first forward).
        checkpoint: which stages run under activation checkpointing: ``None`` those the plan
            marks (``Stage.checkpoint``), ``True`` / ``False`` all or none, or one bool per
            stage. Forcing it changes what runs, not the plan's predictions.

    Attributes:
        module: the original model.
        devices: one device per stage.

    Raises:
        PlanMismatchError: the plan is not the graph's model's.
        InvalidInputError: not one device per stage, neither a plan nor a planner, or not
            one ``checkpoint`` flag per stage.
    """

    def __init__(
        self,
        model: nn.Module,
        devices: Sequence[torch.device],
        *,
        graph: BlockGraph | None = None,
        plan: Plan | None = None,
        split_size: int | None = None,
        planner: Planner | None = None,
        checkpoint: bool | Sequence[bool] | None = None,
    ) -> None:
        super().__init__()
        self._force_checkpoint = checkpoint_flags(checkpoint)
        self._checkpoint: tuple[bool, ...] = ()
        self.module = model
        self.devices = list(devices)
        self._planner = planner
        self._graph: BlockGraph | None = None
        self._by_mode: dict[bool, BlockGraph] = {}  # captures in the other mode, kept
        self._layout: StageLayout | None = None
        self._segments: list[Segment] = []
        self._borrowed: dict[int, dict[str, nn.Parameter]] = {}
        self._plan: Plan | None = None
        self._split_size = split_size
        if plan is not None and graph is not None:
            self._build(graph, plan)
        elif planner is None:
            raise InvalidInputError("PipelinedModule needs a graph and a plan, or a planner")

    @property
    def plan(self) -> Plan | None:
        """The plan in use (``None`` until the first forward of a lazily planned module)."""
        return self._plan

    @property
    def layout(self) -> StageLayout | None:
        """What each stage receives, sends and passes through (``None`` before planning)."""
        return self._layout

    @property
    def split_size(self) -> int | None:
        """Micro-batch size b used by ``forward``."""
        if self._split_size is not None:
            return self._split_size
        return self._plan.split_size if self._plan else None

    @property
    def checkpointed(self) -> tuple[bool, ...]:
        """Whether each stage runs under activation checkpointing (empty before planning)."""
        return self._checkpoint

    @property
    def stages(self) -> list[nn.Module]:
        """The stage modules, in pipeline order (they share the model's parameters)."""
        return [seg.module for seg in self._segments]

    @property
    def borrowed_weights(self) -> dict[int, tuple[str, ...]]:
        """Stage s → the names (in its module) of the shared parameters it reads from another
        device: a tied weight lives once, on the first stage using it, and other devices
        use it through a differentiable ``.to()``, so its gradient reaches the one parameter."""
        return {s: tuple(names) for s, names in self._borrowed.items()}

    def _build(self, graph: BlockGraph, plan: Plan) -> None:
        plan.check_model(graph.fingerprint, graph.model_name)
        plan.check_blocks(graph.block_names, graph.model_name)
        if len(self.devices) != len(plan.stages):
            raise InvalidInputError(
                f"{len(self.devices)} devices for a plan of {len(plan.stages)} stages: give one "
                "device per stage"
            )
        force = self._force_checkpoint
        if isinstance(force, tuple) and len(force) != len(plan.stages):
            raise InvalidInputError(
                f"checkpoint={list(force)} for a plan of {len(plan.stages)} stages: give one "
                "flag per stage, or True or False for all"
            )
        layout = stage_layout(graph, plan)
        segments = []
        for spec, dev in zip(layout.stages, self.devices):
            seg = graph.extract(spec.first, spec.end)
            seg.module.to(dev)
            segments.append(seg)
        self._graph, self._layout, self._segments = graph, layout, segments
        self._borrowed = _borrowed_weights(graph, layout, self.devices, segments)
        self._checkpoint = (
            tuple(s.checkpoint for s in plan.stages) if force is None
            else force if isinstance(force, tuple) else (force,) * len(plan.stages)
        )
        self._plan = plan
        self._planner = None

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the batch through the pipeline in micro-batches of ``split_size``; the output
        is the model's own type (a tensor, tuple, dict, ModelOutput …), with the model's own
        loss, where it returns one, the mean of the micro-batches' losses weighted by rows.

        Raises:
            InvalidInputError: inputs that are not those of the captured call (another
                number, a keyword missing or unknown), or tensors without one batch
                dimension 0.
            CutValueError: a value that is not a tensor crosses a cut (see
                :mod:`autosplit.stages`).
        """
        if self._plan is None:
            assert self._planner is not None
            self._build(*self._planner(args, kwargs))
        assert self._graph is not None and self._plan is not None
        mode = self.module.training
        if self._graph.training is not None and self._graph.training != mode:
            other = self._by_mode.pop(mode, None) or _in_mode(self._graph, mode)
            self._by_mode[not mode] = self._graph
            self._build(other, self._plan)
        layout = self._layout
        assert layout is not None and self._graph is not None
        flat = self._graph.signature.flatten(args, kwargs, self._graph.model_name)
        if len(flat) != len(layout.inputs):
            raise InvalidInputError(
                f"{self._graph.model_name} takes {len(layout.inputs)} inputs "
                f"({', '.join(layout.inputs)}), got {len(flat)}"
            )
        split_size = self.split_size
        assert split_size is not None
        values: list[tuple[Any, ...]] = split(check_inputs(flat), split_size)
        rows = [int(v[0].shape[0]) for v in values]
        m, p = len(values), len(self._segments)
        for tick in range(m + p - 1):
            for s in reversed(range(p)):
                i = tick - s
                if 0 <= i < m:
                    values[i] = self._run_stage(s, values[i])
        last = self.devices[-1]
        return concat([layout.output.build(move(v, last)) for v in values], rows)

    def _run_stage(self, s: int, received: tuple[Any, ...]) -> tuple[Any, ...]:
        module = self._segments[s].module
        dev = self.devices[s]
        borrowed = self._borrowed.get(s)
        body: Callable[..., Any] = module
        if borrowed:
            moved = {name: param.to(dev) for name, param in borrowed.items()}

            def body(*args: Any) -> Any:
                return torch.func.functional_call(module, moved, args)

        if self._checkpoint[s]:
            body = checkpointed(body, module)
        assert self._layout is not None
        return run_stage(self._layout, s, body, move(received, dev))

    def extra_repr(self) -> str:
        if self._plan is None:
            return f"devices={[str(d) for d in self.devices]}, plan=None (made on first call)"
        return (
            f"devices={[str(d) for d in self.devices]}, balance={list(self._plan.balance)}, "
            f"split_size={self.split_size}"
            + (f", checkpoint={list(self._checkpoint)}" if any(self._checkpoint) else "")
        )


def _in_mode(graph: BlockGraph, training: bool) -> BlockGraph:
    """``graph`` captured again in the mode ``training`` (torch.export fixes dropout and
    BatchNorm to the mode of the capture; the blocks, and so the plan, stay the same)."""
    assert graph.capture is not None and graph.capture.model is not None
    return graph.capture.rebuild(dataclasses.replace(graph.capture, training=training))


def checkpoint_flags(value: Any) -> bool | tuple[bool, ...] | None:
    """The ``checkpoint`` argument checked: ``None``, a bool, or a tuple of bools.

    Raises:
        ArgumentTypeError: anything else (``1``, ``"yes"``, ``[True, 0]`` …).
    """
    if value is None or isinstance(value, bool):
        return value
    return tuple(checks.sequence_of(
        "checkpoint", value,
        lambda name, v: checks.instance_of(name, v, bool, "True or False")))


def _borrowed_weights(
    graph: BlockGraph,
    layout: StageLayout,
    devices: Sequence[torch.device],
    segments: Sequence[Segment],
) -> dict[int, dict[str, nn.Parameter]]:
    """Put each shared parameter on the device of the first stage using it; for every other
    stage on another device, the names under which its module reaches it.

    ``Module.to`` moves a shared parameter with each stage holding it (the last move wins), so
    it is moved back to its home here; stages elsewhere read it through ``.to()``.
    """
    params = dict(graph.module.named_parameters())
    borrowed: dict[int, dict[str, nn.Parameter]] = {}
    for shared in graph.shared_params:
        param = params[shared.name]
        stages = sorted({layout.stage_of_block(i) for i in shared.blocks})
        home = devices[stages[0]]
        with torch.no_grad():
            param.data = param.data.to(home)
            if param.grad is not None:
                param.grad = param.grad.to(home)
        for s in stages[1:]:
            if devices[s] == home:
                continue
            names = [n for n, p in segments[s].module.named_parameters(remove_duplicate=False)
                     if p is param]
            borrowed.setdefault(s, {}).update((n, param) for n in names)
    return borrowed
