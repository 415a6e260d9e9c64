"""The machine's figures for 2 workers: measured on a cold cache, given to a profile.

What :mod:`autosplit.measure.machine_cache` needs first on a machine it has not seen: DDP's
synchronisation at 32 MiB and at :data:`~autosplit.measure.collectives.LATENCY_BYTES`, the link
between the two ranks, and the one-stage runtime's cost per action. Each is measured as its
own measurer measures it (:func:`autosplit.measure.collectives.measure_collectives`,
:func:`autosplit.measure.runtime_cost.measure_one_stage_action_ms`), one after the other on the same
two ranks: one start of the ranks (each imports torch: seconds) instead of two.

:func:`machine_measurers` says what measures a machine's figures for its kind of device, and
:func:`with_machine_figures` gives a profile those figures as ``autosplit plan`` does: from the
cache, else measured now.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from autosplit.measure.collectives import (
    LATENCY_BYTES,
    Collectives,
    collectives_of,
    link_seconds,
    sync_seconds,
)
from autosplit.measure.runtime_cost import one_stage_fits, one_stage_rounds
from autosplit.measure.spread import half_iqr

if TYPE_CHECKING:
    from autosplit.measure.machine_cache import MachineFigures, MachineKey, Measurers
    from autosplit.records import Profile

__all__ = ["CpuMachine", "machine_measurers", "measure_cpu_machine", "with_machine_figures"]


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


def machine_measurers(device_kind: str) -> tuple[MachineKey, Measurers]:
    """This machine's cache key for 2 workers of ``device_kind`` (``"cpu"``: gloo CPU workers of
    one thread, else NCCL between GPUs) and the measurers of its figures
    (:class:`~autosplit.measure.machine_cache.MachineKey`,
    :class:`~autosplit.measure.machine_cache.Measurers`): between CPU workers the collectives
    and the one-stage runtime's cost on one launch (:func:`measure_cpu_machine`) and the
    runtime's cost per action of the schedules asked for; between GPUs the collectives only."""
    from autosplit.measure.collectives import measure_collectives
    from autosplit.measure.machine_cache import MachineKey, Measurers
    from autosplit.measure.runtime_cost import action_costs, measure_one_stage_action_ms

    cpu = device_kind == "cpu"
    stash: list[tuple[float, float]] = []  # the one-stage cost, measured with the collectives

    def collectives() -> tuple[float, float, float]:
        if cpu:  # one start of the ranks for these and the one-stage runtime's cost
            machine = measure_cpu_machine()
            found = machine.collectives
            stash.append(machine.one_stage_action)
        else:
            found = measure_collectives(2)
        return (found.allreduce.bus_bytes_per_s, found.allreduce.latency_ms,
                found.link_bytes_per_s)

    def one_stage() -> tuple[float, float]:
        return stash.pop() if stash else measure_one_stage_action_ms()

    def actions(names: Sequence[str]) -> tuple[Any, Any]:
        costs = action_costs(schedules=names)
        return costs["action_ms"], costs["action_spread"]

    measurers = Measurers(collectives, actions if cpu else None,  # gloo only, so far
                          one_stage if cpu else None)
    # (the ranks that measure them run one thread each, RankSettings' default)
    return MachineKey.here("gloo" if cpu else "nccl", device_kind, threads=1), measurers


def with_machine_figures(profile: Profile, schedules: Sequence[str] | None = None, *,
                         remeasure: bool = False) -> tuple[Profile, MachineFigures, str]:
    """``profile`` with this machine's figures for 2 workers of its kind of device, as
    ``autosplit plan`` records them: the all-reduce, the link and, between CPU workers, the
    pipeline runtime's cost per action of ``schedules`` (``None``: every schedule the planner
    searches) and of one stage. From the cache (:mod:`autosplit.measure.machine_cache`), else
    measured now and cached (``remeasure``: measured in any case). Returns the profile, the
    :class:`~autosplit.measure.machine_cache.MachineFigures` and one line saying where they
    come from."""
    from autosplit.measure.machine_cache import figures_for
    from autosplit.measure.runtime_cost import MEASURED

    key, measurers = machine_measurers(profile.device.kind)
    wanted = tuple(schedules if schedules is not None else (name for name, _ in MEASURED))
    figures, note = figures_for(key, wanted, measurers, remeasure=remeasure)
    return dataclasses.replace(profile, **figures.profile_fields()), figures, note
