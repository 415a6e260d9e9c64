"""``autosplit.partition()`` and PipelinedModule: build the pipelined module a Plan describes.

Each stage is a GraphModule cut from the traced model (blocks ``first … end-1``); it holds the
model's own submodules and parameters, moved to the stage's device with ``.to()`` exactly as
the hand-written tutorial does. ``PipelinedModule.forward`` generalises the tutorial's
``PipelineParallelResNet50.forward`` to p stages: split the batch into micro-batches of
``split_size``, run micro-batch i on stage s at clock tick i + s (GPipe's fill-drain order,
later stages first within a tick), move every crossing tensor (skip connections included) to the
next stage's device, and concatenate the outputs. On CUDA the launches are asynchronous, so the
stages overlap; backward overlaps through autograd's per-device threads.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from autosplit import checks
from autosplit.cost import OPTIMIZER_STATE, SCHEDULES
from autosplit.devices import default_devices, measure_link_bandwidth, resolve_device
from autosplit.errors import InvalidInputError
from autosplit.graph import BlockGraph, Granularity, Segment, leaf_module_list, trace
from autosplit.planner import memory_sizes
from autosplit.planner import plan as make_plan
from autosplit.profiler import check_inputs, profile_graph
from autosplit.records import Plan

__all__ = ["partition", "PipelinedModule"]


class PipelinedModule(nn.Module):
    """A model split into pipeline stages on several devices.

    The wrapped model is registered as ``module`` (its state dict keys gain a ``module.``
    prefix, as with DistributedDataParallel); the stages share its parameters.

    Attributes:
        module: the original model.
        plan: the plan in use, or ``None`` until the first call of a lazily planned module.
        devices: one device per stage.
        split_size: micro-batch size b used by ``forward``.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        plan: Plan | None,
        devices: Sequence[torch.device],
        split_size: int | None,
        options: dict[str, Any],
    ) -> None:
        super().__init__()
        self.module = model
        self.devices = list(devices)
        self._options = options
        self._graph: BlockGraph | None = None
        self._segments: list[Segment] = []
        self._borrowed: dict[int, dict[str, nn.Parameter]] = {}
        self._plan: Plan | None = None
        self._split_size = split_size
        if plan is not None:
            self._build(plan)

    @property
    def plan(self) -> Plan | None:
        """The plan in use (``None`` until the first forward of a lazily planned module)."""
        return self._plan

    @property
    def split_size(self) -> int | None:
        """Micro-batch size b used by ``forward``."""
        if self._split_size is not None:
            return self._split_size
        return self._plan.split_size if self._plan else None

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

    def _graph_of_model(self, inputs: Sequence[torch.Tensor] | None) -> BlockGraph:
        if self._graph is None:
            self._graph = trace(
                self.module,
                granularity=self._options.get("granularity", "block"),
                leaf_modules=self._options.get("leaf_modules", ()),
                example_inputs=inputs,
            )
        return self._graph

    def _build(self, plan: Plan) -> None:
        graph = self._graph_of_model(None)
        plan.check_model(graph.fingerprint, graph.model_name)
        plan.check_blocks(graph.block_names, graph.model_name)
        if len(self.devices) != len(plan.stages):
            raise InvalidInputError(
                f"{len(self.devices)} devices for a plan of {len(plan.stages)} stages: give one "
                "device per stage"
            )
        segments, first = [], 0
        for count, dev in zip(plan.balance, self.devices):
            seg = graph.extract(first, first + count)
            seg.module.to(dev)
            segments.append(seg)
            first += count
        self._segments = segments
        self._borrowed = _borrowed_weights(graph, plan.balance, self.devices, segments)
        self._plan = plan

    def _plan_from(self, inputs: tuple[torch.Tensor, ...]) -> Plan:
        opts = self._options
        graph = self._graph_of_model(inputs)
        sizes = opts.get("microbatch_sizes")
        if self._split_size is not None:
            sizes = sorted(set(sizes or []) | {min(self._split_size, int(inputs[0].shape[0]))})
        prof = profile_graph(
            graph,
            inputs,
            device=self.devices[0],
            microbatch_sizes=sizes,
            stages=len(self.devices),
            **opts.get("profile_options", {}),
        )
        bandwidth = opts.get("bandwidth_bytes_per_s")
        distinct_gpus = len({d for d in self.devices if d.type == "cuda"})
        if bandwidth is None and distinct_gpus == len(self.devices) > 1:
            # real GPUs: the slowest link between consecutive stages, measured
            bandwidth = min(
                measure_link_bandwidth(a, b) for a, b in zip(self.devices, self.devices[1:])
            )
        options = dict(
            bandwidth_bytes_per_s=bandwidth,
            devices=[str(d) for d in self.devices],
            memory_per_gpu=opts.get("memory_per_gpu"),
            schedule=opts.get("schedule", "gpipe"),
            optimizer=opts.get("optimizer", "sgd"),
            split_size=None if self._split_size is None else min(
                self._split_size, int(inputs[0].shape[0])
            ),
        )
        if not opts.get("verify", True):
            return make_plan(prof, len(self.devices), **options)  # type: ignore[arg-type]
        from autosplit.planner import plan_candidates
        from autosplit.verify import verify_and_choose

        candidates = plan_candidates(prof, len(self.devices), **options)  # type: ignore[arg-type]
        threads = opts.get("profile_options", {}).get("threads", 1)
        best, _ = verify_and_choose(graph, inputs, prof, candidates, device=self.devices[0],
                                    threads=threads)
        return best

    def forward(self, *inputs: torch.Tensor) -> Any:
        """Run the batch through the pipeline in micro-batches of ``split_size``."""
        if self._plan is None:
            self._build(self._plan_from(check_inputs(inputs)))
        graph = self._graph
        assert graph is not None and self._plan is not None
        if len(inputs) != len(graph.inputs):
            raise InvalidInputError(
                f"{graph.model_name} takes {len(graph.inputs)} inputs "
                f"({', '.join(graph.inputs)}), got {len(inputs)}"
            )
        inputs = check_inputs(inputs)
        split = self.split_size
        assert split is not None
        chunks = list(zip(*(x.split(split) for x in inputs)))
        envs: list[dict[str, Any]] = [dict(zip(graph.inputs, c)) for c in chunks]
        m, p = len(envs), len(self._segments)
        for tick in range(m + p - 1):
            for s in reversed(range(p)):
                i = tick - s
                if 0 <= i < m:
                    self._run_stage(s, envs[i])
        last = self.devices[-1]
        structure = graph.output_structure()
        per_mb = [
            torch.fx.node.map_arg(structure, lambda node, env=env: _to(env[node.name], last))
            for env in envs
        ]
        return _concat(per_mb)

    def _run_stage(self, s: int, env: dict[str, Any]) -> None:
        seg = self._segments[s]
        dev = self.devices[s]
        args = [_to(env[name], dev) for name in seg.inputs]
        borrowed = self._borrowed.get(s)
        if borrowed:
            moved = {name: param.to(dev) for name, param in borrowed.items()}
            outputs = torch.func.functional_call(seg.module, moved, tuple(args))
        else:
            outputs = seg.module(*args)
        env.update(zip(seg.outputs, outputs))

    def extra_repr(self) -> str:
        if self._plan is None:
            return f"devices={[str(d) for d in self.devices]}, plan=None (made on first call)"
        return (
            f"devices={[str(d) for d in self.devices]}, balance={list(self._plan.balance)}, "
            f"split_size={self.split_size}"
        )


def _borrowed_weights(
    graph: BlockGraph,
    balance: Sequence[int],
    devices: Sequence[torch.device],
    segments: Sequence[Segment],
) -> dict[int, dict[str, nn.Parameter]]:
    """Put each shared parameter on the device of the first stage using it; for every other
    stage on another device, the names under which its module reaches it.

    ``Module.to`` moves a shared parameter with each stage holding it (the last move wins), so
    it is moved back to its home here; stages elsewhere read it through ``.to()``.
    """
    stage_of = [s for s, count in enumerate(balance) for _ in range(count)]
    params = dict(graph.module.named_parameters())
    borrowed: dict[int, dict[str, nn.Parameter]] = {}
    for shared in graph.shared_params:
        param = params[shared.name]
        stages = sorted({stage_of[i] for i in shared.blocks})
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


def _to(value: Any, dev: torch.device) -> Any:
    if isinstance(value, torch.Tensor) and value.device != dev:
        return value.to(dev, non_blocking=True)
    return value


def _concat(per_microbatch: list[Any]) -> Any:
    """Concatenate micro-batch outputs leaf by leaf along dimension 0."""
    flat = [pytree.tree_flatten(out) for out in per_microbatch]
    leaves_per_mb = [leaves for leaves, _ in flat]
    spec = flat[0][1]
    joined = []
    for position, leaves in enumerate(zip(*leaves_per_mb)):
        first = leaves[0]
        if isinstance(first, torch.Tensor):
            if first.dim() == 0:
                raise InvalidInputError(
                    f"output leaf {position} is a 0-dimensional tensor; pipelined outputs must "
                    "have a batch dimension 0 (compute the loss outside the model)"
                )
            joined.append(torch.cat(leaves) if len(leaves) > 1 else first)
        else:
            joined.append(first)
    return pytree.tree_unflatten(joined, spec)


def partition(
    model: nn.Module,
    example_inputs: Any = None,
    *,
    gpus: int | None = None,
    devices: Sequence[str | torch.device] | None = None,
    plan: Plan | None = None,
    split_size: int | None = None,
    schedule: str = "gpipe",
    optimizer: str = "sgd",
    memory_per_gpu: int | float | str | None = None,
    bandwidth_bytes_per_s: float | None = None,
    microbatch_sizes: Sequence[int] | None = None,
    granularity: Granularity = "block",
    leaf_modules: Sequence[type[nn.Module] | str] = (),
    profile_options: dict[str, Any] | None = None,
    verify: bool = True,
) -> PipelinedModule:
    """Split ``model`` into a pipeline over several devices.

    With ``example_inputs`` the model is profiled and planned now; with ``plan`` nothing is
    profiled; with neither, planning happens on the first call, from its batch (``pm.plan`` is
    ``None`` until then). The model's own modules and parameters are used (no copies): an
    optimizer built on ``model.parameters()`` trains the pipeline.

    Args:
        model: the model to split.
        example_inputs: a tensor or tuple of tensors with the batch in dimension 0.
        gpus: number of stages; default ``len(devices)``, else the CUDA device count when ≥ 2,
            else 2 (CPU stand-ins, with a warning).
        devices: one device per stage, e.g. ``["cuda:0", "cuda:1"]`` or ``["cpu", "cpu"]``.
        plan: a saved plan to use; its fingerprint must match the model.
        split_size: fix the micro-batch size b (``None``: the planner chooses).
        schedule, optimizer, memory_per_gpu: passed to :func:`autosplit.plan`.
        bandwidth_bytes_per_s: link bandwidth between stages; default measured between GPUs
            (peer-to-peer copies), else :data:`autosplit.devices.DEFAULT_LINK_BYTES_PER_S`.
        microbatch_sizes: sizes to profile (default chosen from the batch).
        granularity, leaf_modules: passed to :func:`autosplit.graph.trace`.
        profile_options: extra keyword arguments for :func:`autosplit.profile`.
        verify: when profiling, time the stages of the best few candidates as they run and
            choose among them on that (see :mod:`autosplit.verify`); ``False`` plans from
            block sums alone.

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
    checks.optional(checks.positive_int, "split_size", split_size)
    checks.optional(checks.positive_int, "gpus", gpus)
    checks.one_of("schedule", schedule, SCHEDULES)
    checks.one_of("optimizer", optimizer, OPTIMIZER_STATE)
    checks.optional(
        checks.positive_finite, "bandwidth_bytes_per_s", bandwidth_bytes_per_s, "bytes/s"
    )
    checks.optional(checks.sequence_of, "microbatch_sizes", microbatch_sizes, checks.positive_int)
    checks.one_of("granularity", granularity, ("block", "layer"))
    leaf_modules = leaf_module_list(leaf_modules)
    checks.optional(checks.instance_of, "profile_options", profile_options, dict, "a dict")
    if devices is not None:
        devs = [resolve_device(d) for d in checks.as_sequence("devices", devices)]
        if not devs:
            raise InvalidInputError("devices is empty: give at least one device")
        if gpus is not None and gpus != len(devs):
            raise InvalidInputError(f"gpus={gpus} but {len(devs)} devices were given")
    else:
        if gpus is None:
            gpus = plan and len(plan.stages) or max(torch.cuda.device_count(), 2)
        devs, stand_in = default_devices(gpus)
        if stand_in:
            warnings.warn(
                f"{torch.cuda.device_count()} CUDA device(s) found for {gpus} stages: "
                f"using {gpus} CPU stand-ins (devices={['cpu'] * gpus})",
                stacklevel=2,
            )
    memory_sizes(memory_per_gpu, len(devs))
    options = {
        "schedule": schedule,
        "optimizer": optimizer,
        "memory_per_gpu": memory_per_gpu,
        "bandwidth_bytes_per_s": bandwidth_bytes_per_s,
        "microbatch_sizes": microbatch_sizes,
        "granularity": granularity,
        "leaf_modules": tuple(leaf_modules),
        "profile_options": dict(profile_options or {}),
        "verify": checks.instance_of("verify", verify, bool, "True or False"),
    }
    pm = PipelinedModule(model, plan=plan, devices=devs, split_size=split_size, options=options)
    if plan is None:
        graph = pm._graph_of_model(None if example_inputs is None else check_inputs(example_inputs))
        if len(devs) > len(graph.blocks):
            raise InvalidInputError(
                f"gpus={len(devs)} is more than the model's {len(graph.blocks)} blocks: use at "
                f"most {len(graph.blocks)} devices, or granularity='layer' for finer blocks"
            )
        if example_inputs is not None:
            pm._build(pm._plan_from(check_inputs(example_inputs)))
    return pm
