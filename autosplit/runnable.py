"""Which plans the runtimes can run today: one refusal, shared by ``autosplit run`` and
:func:`autosplit.partition` (no torch import).

A plan of p stages × d > 1 data-parallel replicas (:mod:`autosplit.planner.layouts`) is a
prediction only until the runtimes place replicas (DDP or FSDP2 on a DeviceMesh).
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
        where: what refuses it, e.g. ``"autosplit run"`` or ``"partition()"``.
    """
    d = getattr(plan, "replicas", 1)
    if d > 1:
        p = len(plan.stages)
        raise InvalidInputError(
            f"{where} cannot run replicas yet: this plan is {p} stage{'s' if p != 1 else ''} × "
            f"{d} replicas; make a pipeline-only plan (autosplit plan without --replicas) or "
            f"train it with DistributedDataParallel"
        )
