"""One process per stage: a Plan's stages on ``torch.distributed.pipelining``.

autosplit writes no communication layer of its own. Stage s of a plan becomes a
:class:`StageModule` — the same blocks that :func:`autosplit.partition` runs, wrapped so that
it takes exactly the values crossing the cut before it and returns exactly the values crossing
the cut after it (a skip connection or a model input that jumps over the stage is passed
through) — and that module is handed to PyTorch's ``PipelineStage``; a ``ScheduleGPipe`` or
``Schedule1F1B`` (``ScheduleLoopedBFS`` / ``ScheduleInterleaved1F1B`` when a rank holds several
stages), or the class of another schedule the plan names (:func:`build_schedule`: interleaved
zero-bubble, ZB-V, DualPipeV …) runs the micro-batches. Processes are started by torchrun, or
on this machine by :func:`launch` (``torch.distributed.run``'s launcher, one rank per stage),
which turns any rank's death or exception into a :class:`RankFailedError` that names the
rank. A plan with d > 1 data-parallel replicas runs on d times the ranks, laid out on a 2-D
``DeviceMesh`` ("dp", "pp"): the stages along "pp" as above, each stage wrapped in
``DistributedDataParallel`` along "dp" (:mod:`~autosplit.distributed.replicas`).

Modules: :mod:`~autosplit.distributed.stage_module` (StageModule, PipelineStages, schedules),
:mod:`~autosplit.distributed.trainer` (Trainer), :mod:`~autosplit.launch`
(process groups, the local launcher), :mod:`~autosplit.distributed.replicas` (the mesh, DDP),
:mod:`~autosplit.distributed.job` (``autosplit run``),
:mod:`~autosplit.distributed.split_spec` (a plan as ``pipeline()``'s ``split_spec``).

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

from autosplit.distributed.job import (
    RunResult,
    RunSpec,
    measure_plans,
    train_model_file,
    tutorial_targets,
)
from autosplit.distributed.replicas import MESH_DIMS, MeshPlace, mesh_place
from autosplit.distributed.split_spec import split_spec_problems, to_split_spec
from autosplit.distributed.stage_module import (
    StageModule,
    build_schedule,
    build_stages,
    check_schedule,
    stage_metadata,
    stage_modules,
)
from autosplit.distributed.trainer import Trainer, plan_digest
from autosplit.errors import RankFailedError
from autosplit.launch import (
    DEFAULT_TIMEOUT_S,
    RankSettings,
    free_port,
    init_distributed,
    launch,
    run_rank,
)
from autosplit.measure.losses import tutorial_loss
from autosplit.schedules.placement import stage_indices, stage_ranks
from autosplit.stages import CutValueError, graph_for_plan

__all__ = [
    "StageModule",
    "Trainer",
    "RankFailedError",
    "CutValueError",
    "RunSpec",
    "RunResult",
    "stage_modules",
    "stage_indices",
    "build_stages",
    "stage_metadata",
    "build_schedule",
    "check_schedule",
    "stage_ranks",
    "init_distributed",
    "run_rank",
    "launch",
    "RankSettings",
    "graph_for_plan",
    "plan_digest",
    "free_port",
    "train_model_file",
    "measure_plans",
    "tutorial_loss",
    "tutorial_targets",
    "to_split_spec",
    "split_spec_problems",
    "DEFAULT_TIMEOUT_S",
    "MESH_DIMS",
    "MeshPlace",
    "mesh_place",
]
