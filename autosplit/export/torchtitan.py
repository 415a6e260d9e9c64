"""A plan as the parallelism of a torchtitan job: the TOML sections torchtitan reads.

torchtitan (0.2, ``--job.config_file job.toml``) takes the pipeline's degree, schedule and
micro-batch size, the modules of each model part (``module_fqns_per_model_part``), the
data-parallel degrees and activation checkpointing from its job config, and has no planner:
:func:`torchtitan_config` writes them from an autosplit plan. The model, data, optimizer and
the rest of the job stay the user's own config.

What torchtitan can express, and is checked here:

- its pipeline runs torch's schedule classes, the ones autosplit plans with
  (:data:`TORCHTITAN_SCHEDULES`);
- it builds each model part from a copy of the whole model, keeping the top-level modules the
  part names and, of a top-level ``ModuleList``/``ModuleDict``, the entries it names
  (``layers.3``): every stage must be such modules, and every top-level module and entry must
  be in exactly one part;
- its activation checkpointing is one mode for the whole model: a plan that checkpoints some
  stages and not others cannot be written;
- its data parallelism is replication (DDP: ``data_parallel_replicate_degree`` = d,
  ``data_parallel_shard_degree = 1``) or FSDP2 (``data_parallel_shard_degree`` = d, with
  ``fsdp_reshard_after_forward`` ``"always"`` or ``"never"`` as the plan's ``replica_mode``).

A plan it cannot express is refused with a :class:`~autosplit.errors.CodegenError` that says
why.
"""

from __future__ import annotations

import json

from torch import nn

from autosplit.errors import CodegenError
from autosplit.records import Plan
from autosplit.schedules import torch_class_name

__all__ = ["TORCHTITAN_SCHEDULES", "torchtitan_config", "model_parts"]

TORCHTITAN_SCHEDULES = ("GPipe", "1F1B", "LoopedBFS", "Interleaved1F1B",
                        "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")
"""The schedule names torchtitan's ``pipeline_parallel_schedule`` takes (torch's classes,
without ``Schedule``)."""


def model_parts(plan: Plan, model: nn.Module) -> list[list[str]]:
    """``module_fqns_per_model_part``: each stage's modules, in stage order.

    Raises:
        CodegenError: a stage holds something torchtitan cannot keep apart (a module deeper
            than a top-level module or an entry of a top-level ModuleList/ModuleDict, or no
            module at all), or a top-level module is in no part or in several.
    """
    children = dict(model.named_children())
    units: dict[str, int] = {}  # what torchtitan keeps or drops per part: its index there
    for name, child in children.items():
        if isinstance(child, nn.ModuleList | nn.ModuleDict):
            keys = [str(i) for i in range(len(child))] if isinstance(child, nn.ModuleList) \
                else list(child.keys())
            units.update({f"{name}.{key}": 0 for key in keys})
        else:
            units[name] = 0
    parts = [list(stage.blocks) for stage in plan.stages]
    for s, blocks in enumerate(parts):
        for block in blocks:
            if block not in units:
                raise CodegenError(
                    f"stage {s} holds {block!r}, which torchtitan cannot keep apart: it builds "
                    "a model part from the model's top-level modules and the entries of a "
                    f"top-level ModuleList or ModuleDict ({', '.join(list(units)[:4])}, …); "
                    "plan with --granularity block, or with blocks of such modules")
            units[block] += 1
    missing = [name for name, count in units.items() if count == 0]
    if missing:
        raise CodegenError(
            f"{', '.join(missing[:3])} {'is' if len(missing) == 1 else 'are'} in no stage of the "
            "plan: torchtitan would drop it from every model part")
    return parts


def torchtitan_config(plan: Plan, model: nn.Module, *, source: str = "") -> str:
    """The TOML text of torchtitan's ``[parallelism]``, ``[training]`` and
    ``[activation_checkpoint]`` sections for ``plan`` of ``model``; ``source`` is said in the
    header (the command that planned it).

    Raises:
        CodegenError: the plan cannot be expressed in torchtitan's config (see the module
            docstring).
    """
    v = plan.stages_per_rank
    pp = len(plan.stages) // v
    name = torch_class_name(plan.schedule, v).removeprefix("Schedule")
    if name not in TORCHTITAN_SCHEDULES:
        raise CodegenError(f"schedule {plan.schedule!r} (torch's {name}) is not one torchtitan "
                           f"runs ({', '.join(TORCHTITAN_SCHEDULES)})")
    local = plan.batch_size // plan.replicas
    if local != plan.microbatches * plan.split_size or local * plan.replicas != plan.batch_size:
        raise CodegenError(
            f"batch {plan.batch_size} is not {plan.replicas} replica(s) × {plan.microbatches} "
            f"micro-batches of {plan.split_size}: torchtitan's micro-batches are all of one "
            "size; plan with a batch they divide")
    flags = {stage.checkpoint for stage in plan.stages}
    if len(flags) > 1:
        raise CodegenError(
            "the plan checkpoints some stages and not others: torchtitan's activation "
            "checkpointing is one mode for the whole model; plan with --schedule "
            f"{plan.schedule} and the memory to spare, or checkpoint every stage")
    parts = model_parts(plan, model)
    mode = "full" if flags == {True} else "none"
    header = [f"# torchtitan job config: the parallelism autosplit planned for {plan.model}",
              f"# ({pp} pipeline rank(s) × {plan.replicas} replica(s), {len(plan.stages)} "
              f"model parts, {plan.microbatches} micro-batches of {plan.split_size}; predicted "
              f"step {plan.predicted_step_ms:.1f} ms).",
              "# Give it to torchtitan with your own config: the model, data, optimizer and",
              "# the rest stay yours (torchtitan 0.2: --job.config_file).",
              *([f"# made by: {source}"] if source else [])]
    lines = [*header, "", "[training]", f"local_batch_size = {local}", "",
             "[parallelism]",
             f"pipeline_parallel_degree = {pp}",
             f"pipeline_parallel_schedule = {json.dumps(name)}",
             f"pipeline_parallel_microbatch_size = {plan.split_size}",
             "module_fqns_per_model_part = [",
             *(f"    {json.dumps(part)}," for part in parts),
             "]",
             *_data_parallel(plan),
             "tensor_parallel_degree = 1",
             "context_parallel_degree = 1",
             "", "[activation_checkpoint]", f"mode = {json.dumps(mode)}", ""]
    return "\n".join(lines)


def _data_parallel(plan: Plan) -> list[str]:
    """The ``[parallelism]`` lines of the plan's replicas: replicated (DDP) or sharded (FSDP2,
    with its resharding after forward)."""
    if plan.replica_mode == "ddp" or plan.replicas == 1:
        return [f"data_parallel_replicate_degree = {plan.replicas}",
                "data_parallel_shard_degree = 1"]
    policy = "always" if plan.replica_mode == "fsdp2" else "never"
    return ["data_parallel_replicate_degree = 1",
            f"data_parallel_shard_degree = {plan.replicas}",
            f"fsdp_reshard_after_forward = {json.dumps(policy)}"]
