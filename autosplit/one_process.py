"""Which plans one process can run: one refusal, for :func:`autosplit.partition` and the
emitted code (no torch import).

A plan of p stages × d > 1 data-parallel replicas (:mod:`autosplit.planner.layouts`) needs
p·d processes: ``autosplit run`` (or :class:`autosplit.distributed.Trainer` under torchrun)
runs it on a 2-D DeviceMesh, stages on torch.distributed.pipelining and the replicas on
DistributedDataParallel.
"""

from __future__ import annotations

from typing import Any

from autosplit.errors import InvalidInputError

__all__ = ["require_pipeline_only"]


def require_pipeline_only(plan: Any, where: str) -> None:
    """Raise :class:`InvalidInputError` when ``plan`` has data-parallel replicas.

    Args:
        plan: a :class:`~autosplit.records.Plan` (anything with ``replicas``; older objects
            without it count as one replica).
        where: what refuses it, e.g. ``"partition()"``.
    """
    d = getattr(plan, "replicas", 1)
    if d > 1:
        p = len(plan.stages)
        raise InvalidInputError(
            f"{where} runs one pipeline in one process; this plan is {p} "
            f"stage{'s' if p != 1 else ''} × {d} replicas, which needs {p * d} processes: train "
            f"it with `autosplit run MODEL.py --plan PLAN.json` (or autosplit.distributed.Trainer "
            f"under torchrun), or make a pipeline-only plan (autosplit plan without --replicas)"
        )
