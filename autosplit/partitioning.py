"""``autosplit.partition()``: the policy in front of :class:`~autosplit.pipeline.PipelinedModule`.

Checks the arguments, picks the devices, traces the model, and — unless a plan is given —
profiles it, measures the links between GPUs, plans and verifies the best candidates through
the planning workflow that ``autosplit plan`` uses (:mod:`autosplit.workflow`), for a pipeline
in one process: the distributed runtime's cost per action and the replicas' all-reduce, which
``autosplit plan`` takes from the machine's figures, are not part of what it runs. With
example inputs that happens now; without, the :class:`PipelinedModule` is given a planner
that does it on its first batch.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from autosplit import checks
from autosplit.capture.signature import call_arguments
from autosplit.capture.trace import trace
from autosplit.cost import OPTIMIZER_STATE, SCHEDULES
from autosplit.devices import default_devices, measure_link_bandwidth, resolve_device
from autosplit.errors import InvalidInputError, TraceError
from autosplit.graph import BlockGraph, Granularity, leaf_module_list
from autosplit.measure import timing_process
from autosplit.measure.options import ProfileOptions
from autosplit.measure.profiler import check_inputs, profile_graph
from autosplit.one_process import require_pipeline_only
from autosplit.pipeline import PipelinedModule, checkpoint_flags
from autosplit.planner import PlanOptions, memory_sizes
from autosplit.records import Plan
from autosplit.verify.choice import verify_and_choose
from autosplit.verify.options import TimingOptions
from autosplit.workflow import PlanRequest, choose_plan

__all__ = ["partition", "PartitionOptions"]


@checks.known_options
@dataclass(frozen=True, slots=True)
class PartitionOptions:
    """How :func:`partition` captures, profiles and plans, checked when made (a bad value
    raises ``ArgumentTypeError`` or ``InvalidInputError`` naming it).

    Attributes:
        schedule, optimizer, memory_per_gpu: passed to :func:`autosplit.plan`. The
            PipelinedModule runs its stages in GPipe's order whatever the plan's schedule
            (a schedule changes the order and timing, not the result): ``"gpipe"`` (the
            default) keeps the prediction that of what runs; a plan of another schedule runs
            its cuts and checkpointed stages as planned.
        bandwidth_bytes_per_s: link bandwidth between stages (bytes/s); ``None``: measured
            between GPUs (peer-to-peer copies), else :data:`autosplit.cost.
            DEFAULT_LINK_BYTES_PER_S`.
        split_size: fix the micro-batch size b (``None``: the planner chooses); with a plan,
            it overrides the plan's.
        granularity, leaf_modules: passed to :func:`autosplit.capture.trace.trace`.
        profile: how the model is profiled (:class:`autosplit.ProfileOptions`); its
            ``stages`` is set to the number of devices.
        verify: when profiling, time the stages of the best few candidates as they run and
            choose among them on that (see :mod:`autosplit.verify.plans`); ``False`` plans
            from block sums alone.
    """

    schedule: str = "gpipe"
    optimizer: str = "sgd"
    memory_per_gpu: int | float | str | None = None
    bandwidth_bytes_per_s: float | None = None
    split_size: int | None = None
    granularity: Granularity = "block"
    leaf_modules: tuple[type[nn.Module] | str, ...] = ()
    profile: ProfileOptions = ProfileOptions()
    verify: bool = True

    def __post_init__(self) -> None:
        checks.one_of("schedule", self.schedule, ("auto", *SCHEDULES))
        checks.one_of("optimizer", self.optimizer, OPTIMIZER_STATE)
        if self.memory_per_gpu is not None:
            memory_sizes(self.memory_per_gpu, 1)
        checks.optional(checks.positive_finite, "bandwidth_bytes_per_s",
                        self.bandwidth_bytes_per_s, "bytes/s")
        checks.optional(checks.positive_int, "split_size", self.split_size)
        checks.one_of("granularity", self.granularity, ("block", "layer"))
        object.__setattr__(self, "leaf_modules", tuple(leaf_module_list(self.leaf_modules)))
        checks.instance_of("profile", self.profile, ProfileOptions,
                           "an autosplit.ProfileOptions")
        checks.instance_of("verify", self.verify, bool, "True or False")


def partition(
    model: nn.Module,
    example_inputs: Any = None,
    example_kwargs: dict[str, Any] | None = None,
    *,
    gpus: int | None = None,
    devices: Sequence[str | torch.device] | None = None,
    plan: Plan | None = None,
    options: PartitionOptions = PartitionOptions(),
    checkpoint: bool | Sequence[bool] | None = None,
) -> PipelinedModule:
    """Split ``model`` into a pipeline over several devices.

    With ``example_inputs`` the model is profiled and planned now; with ``plan`` nothing is
    profiled; with neither, planning happens on the first call, from its batch (``pm.plan`` is
    ``None`` until then). The model's own modules and parameters are used (no copies): an
    optimizer built on ``model.parameters()`` trains the pipeline.

    Args:
        model: the model to split.
        example_inputs: a tensor or tuple of the positional inputs of one call, tensors with
            the batch in dimension 0.
        example_kwargs: the keyword inputs of that call (``{"attention_mask": mask,
            "labels": ids}``); the pipelined module is called the same way.
        gpus: number of stages; default ``len(devices)``, else the CUDA device count when ≥ 2,
            else 2 (CPU stand-ins, with a warning).
        devices: one device per stage, e.g. ``["cuda:0", "cuda:1"]`` or ``["cpu", "cpu"]``.
        plan: a saved plan to use; its fingerprint must match the model.
        options: how the model is captured, profiled and planned (:class:`PartitionOptions`:
            schedule, memory, link bandwidth, micro-batch size, granularity, profiling,
            verification).
        checkpoint: run stages under activation checkpointing (``torch.utils.checkpoint``,
            non-reentrant, RNG state preserved; BatchNorm statistics updated once): ``None``
            as the plan says (``Stage.checkpoint``), ``True`` / ``False`` every stage or none,
            or one bool per stage. It changes what runs, not the plan or its predictions.

    Raises:
        ArgumentTypeError: an argument of the wrong type (``gpus="2"``, ``gpus=2.0``,
            ``devices="cuda:0"``, ``plan=<dict>``, ``split_size=True``, …); also a ``TypeError``.
        InvalidInputError: a bad value (``gpus=0``, an unknown device or schedule, a memory or
            bandwidth that is not finite and > 0, …); also a ``ValueError``.
        TraceError: the model cannot be traced.
        PlanMismatchError: ``plan`` was made for another model.
        InfeasiblePlanError: nothing fits in ``memory_per_gpu``.
    """
    checks.instance_of("model", model, nn.Module, "a torch.nn.Module")
    checks.optional(checks.instance_of, "plan", plan, Plan, "an autosplit Plan (Plan.load(path))")
    checks.optional(checks.positive_int, "gpus", gpus)
    checks.instance_of("options", options, PartitionOptions, "an autosplit.PartitionOptions")
    checkpoint_flags(checkpoint)
    devs = _devices(gpus, devices, plan)
    memory_sizes(options.memory_per_gpu, len(devs))
    split_size = options.split_size
    given = example_inputs is not None or bool(example_kwargs)
    args, kwargs = call_arguments(example_inputs, example_kwargs)
    capture = functools.partial(trace, model, granularity=options.granularity,
                                leaf_modules=options.leaf_modules)
    if plan is not None:
        require_pipeline_only(plan, "partition()")
        if not given:
            try:
                graph = capture()
            except TraceError:  # torch.export captures the model from its first call
                return PipelinedModule(
                    model, devs, split_size=split_size, checkpoint=checkpoint,
                    planner=functools.partial(_capture_for_plan, capture, plan))
        else:
            graph = capture(example_inputs=args, example_kwargs=kwargs)
        return PipelinedModule(model, devs, graph=graph, plan=plan, split_size=split_size,
                               checkpoint=checkpoint)
    if not given:
        try:
            traced: BlockGraph | Callable[..., BlockGraph] = capture()
        except TraceError:  # torch.export captures the model from its first call
            traced = capture
        if isinstance(traced, BlockGraph):
            _check_stages(len(devs), traced)
        planner = functools.partial(_graph_and_plan, traced, devices=devs, options=options)
        return PipelinedModule(model, devs, split_size=split_size, planner=planner,
                               checkpoint=checkpoint)
    graph = capture(example_inputs=args, example_kwargs=kwargs)
    inputs = check_inputs(graph.signature.flatten(args, kwargs, graph.model_name))
    _check_stages(len(devs), graph)
    made = plan_for_batch(graph, inputs, devs, options)
    return PipelinedModule(model, devs, graph=graph, plan=made, split_size=split_size,
                           checkpoint=checkpoint)


def plan_for_batch(
    graph: BlockGraph,
    inputs: tuple[torch.Tensor, ...],
    devices: Sequence[torch.device],
    options: PartitionOptions,
) -> Plan:
    """Profile ``graph`` on ``inputs`` on the first device and plan it for ``devices``, as
    the planning workflow does (:func:`autosplit.workflow.choose_plan`: a pipeline, one
    process).

    The bandwidth between real GPUs is measured (the slowest link between consecutive
    stages) unless ``options`` gives one; with ``options.verify`` the best candidates'
    stages are timed as they run and the fastest is chosen.
    """
    sizes = options.profile.microbatch_sizes
    split_size = None
    if options.split_size is not None:
        split_size = min(options.split_size, int(inputs[0].shape[0]))
        sizes = tuple(sorted(set(sizes or ()) | {split_size}))
    with timing_process.worker():  # one timing process: the profile, then the candidates
        return _plan_for_batch(graph, inputs, devices, options, sizes, split_size)


def _plan_for_batch(graph: BlockGraph, inputs: tuple[torch.Tensor, ...],
                    devices: Sequence[torch.device], options: PartitionOptions,
                    sizes: tuple[int, ...] | None, split_size: int | None) -> Plan:
    profiling = dataclasses.replace(options.profile, microbatch_sizes=sizes, stages=len(devices))
    prof = profile_graph(graph, inputs, device=devices[0], options=profiling)
    bandwidth = options.bandwidth_bytes_per_s
    distinct_gpus = len({d for d in devices if d.type == "cuda"})
    if bandwidth is None and distinct_gpus == len(devices) > 1:
        # real GPUs: the slowest link between consecutive stages, measured
        bandwidth = min(measure_link_bandwidth(a, b) for a, b in itertools.pairwise(devices))
    request = PlanRequest(len(devices), PlanOptions(
        memory_per_gpu=options.memory_per_gpu, schedule=options.schedule,
        optimizer=options.optimizer, bandwidth_bytes_per_s=bandwidth, split_size=split_size,
        devices=tuple(str(d) for d in devices)), pipeline_only=True)  # one process: a pipeline

    def verify(candidates: Sequence[Plan], others: Mapping[str, Plan]
               ) -> tuple[Plan, dict[str, Plan]]:
        return verify_and_choose(graph, inputs, prof, candidates, others,
                                 options=TimingOptions(device=devices[0],
                                                       threads=profiling.threads))

    return choose_plan(prof, request, verify if options.verify else None).plan


def _check_stages(stages: int, graph: BlockGraph) -> None:
    if stages > len(graph.blocks):
        raise InvalidInputError(
            f"gpus={stages} is more than the model's {len(graph.blocks)} blocks: use at "
            f"most {len(graph.blocks)} devices, or PartitionOptions(granularity='layer') for "
            "finer blocks"
        )


def _graph_and_plan(
    capture: BlockGraph | Callable[..., BlockGraph],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    devices: Sequence[torch.device],
    options: PartitionOptions,
) -> tuple[BlockGraph, Plan]:
    """The planner of a lazily planned module: capture (unless traced already) and plan on
    its first batch."""
    if isinstance(capture, BlockGraph):
        graph = capture
    else:
        graph = capture(example_inputs=args, example_kwargs=kwargs)
        _check_stages(len(devices), graph)
    inputs = check_inputs(graph.signature.flatten(args, kwargs, graph.model_name))
    return graph, plan_for_batch(graph, inputs, devices, options)


def _capture_for_plan(capture: Callable[..., BlockGraph], plan: Plan, args: tuple[Any, ...],
                      kwargs: dict[str, Any]) -> tuple[BlockGraph, Plan]:
    """The planner of a module given a plan that only torch.export captures: its first call."""
    return capture(example_inputs=args, example_kwargs=kwargs), plan


def _devices(
    gpus: int | None, devices: Sequence[str | torch.device] | None, plan: Plan | None
) -> list[torch.device]:
    """One device per stage, from ``devices``, else ``gpus`` (CUDA devices or CPU stand-ins)."""
    if devices is not None:
        devs = [resolve_device(d) for d in checks.as_sequence("devices", devices)]
        if not devs:
            raise InvalidInputError("devices is empty: give at least one device")
        if gpus is not None and gpus != len(devs):
            raise InvalidInputError(f"gpus={gpus} but {len(devs)} devices were given")
        return devs
    if gpus is None:
        gpus = plan and len(plan.stages) or max(torch.cuda.device_count(), 2)
    devs, stand_in = default_devices(gpus)
    if stand_in:
        warnings.warn(
            f"{torch.cuda.device_count()} CUDA device(s) found for {gpus} stages: "
            f"using {gpus} CPU stand-ins (devices={['cpu'] * gpus})",
            stacklevel=3,
        )
    return devs
