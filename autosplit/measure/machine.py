"""A cold cache's figures for 2 CPU workers, measured on one launch of the ranks.

What :mod:`autosplit.measure.machine_cache` needs first on a machine it has not seen: DDP's
synchronisation at 32 MiB and at :data:`~autosplit.measure.collectives.LATENCY_BYTES`, the link
between the two ranks, and the one-stage runtime's cost per action. Each is measured as its
own measurer measures it (:func:`autosplit.measure.collectives.measure_collectives`,
:func:`autosplit.measure.runtime_cost.measure_one_stage_action_ms`), one after the other on the same
two ranks: one start of the ranks (each imports torch: seconds) instead of two.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any

from autosplit.measure.collectives import (
    LATENCY_BYTES,
    Collectives,
    collectives_of,
    link_seconds,
    sync_seconds,
)
from autosplit.measure.runtime_cost import one_stage_fits, one_stage_rounds
from autosplit.measure.spread import half_iqr

__all__ = ["CpuMachine", "measure_cpu_machine"]


@dataclass(frozen=True, slots=True)
class CpuMachine:
    """The figures of :func:`measure_cpu_machine`.

    Attributes:
        collectives: the all-reduce and the link.
        one_stage_action: the one-stage runtime's cost per action and its spread (ms).
    """

    collectives: Collectives
    one_stage_action: tuple[float, float]


def _rank(nbytes: int, link_bytes: int, repeats: int) -> Any:
    """On each of the 2 ranks: every figure in turn; rank 0 returns the times."""
    import torch
    import torch.distributed as dist

    rank, cpu = dist.get_rank(), torch.device("cpu")
    whole = sync_seconds(rank, "gloo", cpu, nbytes, repeats)
    small = sync_seconds(rank, "gloo", cpu, LATENCY_BYTES, 3 * repeats)
    link = link_seconds(rank, "gloo", cpu, link_bytes, repeats)
    rounds = one_stage_rounds()
    return (whole, small, link, rounds) if rank == 0 else None


def measure_cpu_machine(nbytes: int = 32 * 2**20, link_bytes: int = 16 * 2**20,
                        repeats: int = 7, timeout_s: float = 120.0) -> CpuMachine:
    """The all-reduce, the link and the one-stage runtime's cost of 2 gloo CPU workers of one
    thread each, on one launch (see the module docstring)."""
    from autosplit.launch import launch

    whole, small, link, rounds = launch(_rank, 2, nbytes, link_bytes, repeats,
                                        backend="gloo", timeout_s=timeout_s)[0]
    fits = one_stage_fits(rounds)
    return CpuMachine(collectives_of(2, nbytes, whole, small, link_bytes, link),
                      (statistics.median(fits), half_iqr(fits)))
