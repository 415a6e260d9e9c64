"""Layouts: p pipeline stages × d data-parallel replicas on N devices, each planned exactly.

Symbols: N devices, p stages, d replicas (p · d devices used, d | B), B the batch.

Each layout is planned by :func:`autosplit.planner.replicated.plan_replicated` (its cost of
keeping the replicas equal, DDP or FSDP2, and its exact search over cuts and b are there).
Pure data parallelism is p = 1, d = N: one device's step on B / N samples in micro-batches
of b (gradient accumulation when b < B / N) plus the replicas' synchronisation. Memory per
device is its stage's weights, gradients and optimizer state (whole, or sharded with FSDP2)
plus the activations in flight of its replica's B / d samples, as for a pipeline alone.
:func:`plan_layouts` compares every (p, d) with p · d = N, d | B and p ≤ blocks (fewer
devices only when no layout uses all N, and then it says why).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from autosplit import checks
from autosplit.errors import InfeasiblePlanError, InvalidInputError, ScheduleUnavailableError
from autosplit.planner.options import PlanOptions
from autosplit.planner.replicated import candidate_modes, plan_replicated, stage_grad_bytes
from autosplit.records import Plan, Profile
from autosplit.solve.exact import TIE_RTOL
from autosplit.topology import Topology, placements
from autosplit.units import format_bytes

__all__ = ["LayoutOption", "Layouts", "ModeOption", "layout_pairs", "plan_layouts",
           "plan_replicated", "stage_grad_bytes"]


@dataclass(frozen=True, slots=True)
class ModeOption:
    """The best plan of one layout with one replica mode, or why it has none.

    Attributes:
        mode: one of :data:`autosplit.sharding.REPLICA_MODES`.
        plan: its best plan, ``None`` when nothing fits or torch cannot run it.
        need_bytes: when nothing fits, the memory per device the smallest plan needs (bytes).
        why: when torch's schedule cannot run it, why.
    """

    mode: str
    plan: Plan | None
    need_bytes: float | None = None
    why: str = ""


@dataclass(frozen=True, slots=True)
class LayoutOption:
    """The best plan of one layout, or why it has none.

    Attributes:
        stages: p.
        replicas: d.
        plan: the best plan of this layout, ``None`` when nothing fits or torch cannot run it.
        need_bytes: when nothing fits, the memory per device the smallest plan needs (bytes).
        why: when torch's schedule cannot run the layout, why (``""``: it is the memory).
        modes: with replicas, the best plan of each replica mode tried
            (:data:`autosplit.sharding.REPLICA_MODES`: DDP, FSDP2 resharding, not), ``plan``
            the fastest of them; empty for one replica.
    """

    stages: int
    replicas: int
    plan: Plan | None
    need_bytes: float | None = None
    why: str = ""
    modes: tuple[ModeOption, ...] = ()

    @property
    def label(self) -> str:
        """``"data parallel ×2"``, ``"pipeline 2 stages"`` or ``"2 stages × 2 replicas"``."""
        if self.stages == 1 and self.replicas > 1:
            return f"data parallel ×{self.replicas}"
        if self.replicas == 1:
            return f"pipeline {self.stages} stage{'s' if self.stages > 1 else ''}"
        return f"{self.stages} stages × {self.replicas} replicas"


@dataclass(frozen=True, slots=True)
class Layouts:
    """Every layout considered, with its best plan.

    Attributes:
        best: the fastest plan over every layout that fits (ties: fewer replicas).
        options: one entry per layout, pure data parallel first, then the pipeline alone,
            then the hybrids by replicas, descending.
        devices: p · d, the devices every layout uses.
        note: why fewer devices than asked are used, or ``""``.
    """

    best: Plan
    options: tuple[LayoutOption, ...]
    devices: int
    note: str = ""

    def option(self, stages: int, replicas: int) -> LayoutOption | None:
        """The option of layout (p, d), or ``None`` when it was not considered."""
        for o in self.options:
            if (o.stages, o.replicas) == (stages, replicas):
                return o
        return None


def layout_pairs(devices: int, batch: int, blocks: int, smallest: int = 1
                 ) -> list[tuple[int, int]]:
    """Every (p, d) with p · d = ``devices``, d | ``batch``, p ≤ ``blocks`` and at least
    ``smallest`` samples per replica (the smallest micro-batch size): pure data parallel first,
    then the pipeline alone, then the hybrids by d descending."""
    pairs = [(devices // d, d) for d in range(devices, 0, -1)
             if devices % d == 0 and batch % d == 0 and devices // d <= blocks
             and batch // d >= smallest]
    return sorted(pairs, key=lambda pd: (pd[0] != 1, pd[1] != 1, -pd[1]))


def plan_layouts(
    profile: Profile,
    devices: int | None = None,
    options: PlanOptions = PlanOptions(),
    *,
    topology: Topology | None = None,
    replicas: int | None = None,
    max_stages: int | None = None,
    pipeline_only: bool = False,
) -> Layouts:
    """The best plan of every layout of ``devices`` devices as p stages × d replicas.

    Considers every p · d = N with d | B, p ≤ the profile's blocks and B / d at least the
    smallest micro-batch size (``replicas`` fixes d,
    ``pipeline_only`` fixes d = 1); when none uses all N devices, the largest count that has
    one, and ``note`` says why. Each layout is :func:`plan_replicated` with ``options``
    (``memory_per_gpu`` one size for every device; ``replica_mode="auto"``: every mode is
    planned, kept in ``LayoutOption.modes``, the fastest chosen).

    ``max_stages`` bounds p (default: the profile's blocks): the exact search of a 1F1B step
    takes long for tens of stages and hundreds of micro-batches (a minute per size for the
    7.5B GPT at p = 16), and few plans gain from so deep a pipeline; the layouts it leaves
    out are not in ``options``, and ``note`` says so.

    ``devices`` defaults to the topology's N, else 2. With a ``topology``
    (:class:`autosplit.topology.Topology`) each layout is planned for every placement worth
    trying (:func:`autosplit.topology.placements`: which of pp and dp is the inner mesh
    dimension), with the pipeline's transfers and the all-reduce at the bandwidth of the
    slowest link they cross; the faster placement is kept (ties: ``"pp-inner"``) and recorded
    in ``Plan.placement``. The link bandwidths then come from the topology:
    ``bandwidth_bytes_per_s`` cannot be given too; ``allreduce_bandwidth_bytes_per_s`` (a
    measured all-reduce) is the all-reduce's bandwidth inside a node.

    Raises:
        InvalidInputError: ``replicas`` does not divide the batch or the devices, ``devices``
            differs from the topology's, or a bad argument.
        InfeasiblePlanError: no layout fits ``memory_per_gpu`` (the smallest need is named).
    """
    checks.instance_of("profile", profile, Profile, "an autosplit Profile")
    if topology is not None:
        checks.instance_of("topology", topology, Topology, "an autosplit Topology")
        if devices is not None and devices != topology.devices:
            raise InvalidInputError(f"devices={devices} differs from the topology's "
                                    f"{topology.describe()} = {topology.devices} devices")
        if options.bandwidth_bytes_per_s is not None:
            raise InvalidInputError("bandwidth_bytes_per_s with a topology: its link "
                                    "bandwidths come from the topology; give them there")
    n_dev = checks.positive_int("devices", devices if devices is not None else (
        topology.devices if topology is not None else 2))
    checks.instance_of("options", options, PlanOptions, "an autosplit.PlanOptions")
    batch = options.batch_size or profile.batch_size
    blocks = len(profile.blocks)
    if max_stages is not None:
        blocks = min(blocks, checks.positive_int("max_stages", max_stages))
    note = ""
    if pipeline_only or replicas is not None:
        d = 1 if replicas is None else checks.positive_int("replicas", replicas)
        if n_dev % d or batch % d:
            raise InvalidInputError(
                f"replicas={d} must divide both the devices ({n_dev}) and the batch ({batch})")
        if pipeline_only and d != 1:
            raise InvalidInputError(f"pipeline_only with replicas={d}: give one of them")
        pairs = [(n_dev // d, d)]
    else:
        smallest = options.split_size or min(profile.microbatch_sizes)
        if smallest > batch:
            raise InvalidInputError(
                f"no profiled micro-batch size fits the batch {batch}: profiled sizes are "
                f"{list(profile.microbatch_sizes)}")
        used = n_dev
        pairs = layout_pairs(used, batch, blocks, smallest)
        while not pairs:
            used -= 1
            pairs = layout_pairs(used, batch, blocks, smallest)
        if used < n_dev:
            bound = (f"{blocks} blocks" if blocks == len(profile.blocks)
                     else f"max_stages {blocks}")
            note = (f"no layout uses all {n_dev} devices (p ≤ {bound}; d must divide "
                    f"the batch {batch} and leave each replica at least {smallest} samples): "
                    f"planning for {used}")
        deeper = [p for p in range(blocks + 1, len(profile.blocks) + 1) if used % p == 0]
        if deeper:
            note = "; ".join(filter(None, (note, f"layouts of {', '.join(map(str, deeper))} "
                                           f"stages not searched (max_stages {blocks})")))
    found: list[LayoutOption] = []
    failures: list[InfeasiblePlanError] = []
    refused: list[ScheduleUnavailableError] = []
    for p, d in pairs:
        modes = _modes(profile, p, d, options)
        tried: list[ModeOption] = []
        layout_failures: list[InfeasiblePlanError] = []
        layout_refused: list[ScheduleUnavailableError] = []
        for mode in modes:
            try:
                one = _plan_placed(profile, p, d, topology, dataclasses.replace(
                    options, batch_size=batch, replica_mode=mode))
            except InfeasiblePlanError as exc:
                layout_failures.append(exc)
                tried.append(ModeOption(mode, None, exc.min_capacity_bytes))
            except ScheduleUnavailableError as exc:  # e.g. 1F1B with fewer micro-batches than p
                layout_refused.append(exc)
                tried.append(ModeOption(mode, None, why=f"{exc.schedule}: {exc.reason}"))
            else:
                tried.append(ModeOption(mode, one))
        kept = tuple(tried) if d > 1 else ()
        fitted = [t for t in tried if t.plan is not None]
        if fitted:
            fastest = fitted[0]
            for t in fitted[1:]:  # ties: the first mode
                if t.plan.predicted_step_ms < (  # type: ignore[union-attr]
                        fastest.plan.predicted_step_ms * (1 - TIE_RTOL)):  # type: ignore
                    fastest = t
            found.append(LayoutOption(p, d, fastest.plan, modes=kept))
        elif layout_failures:  # what does not fit says more than what torch refuses
            smallest = min(layout_failures, key=lambda e: e.min_capacity_bytes or math.inf)
            failures.append(smallest)
            found.append(LayoutOption(p, d, None, smallest.min_capacity_bytes, modes=kept))
        else:
            exc = layout_refused[0]
            refused.append(exc)
            found.append(LayoutOption(p, d, None, why=f"{exc.schedule}: {exc.reason}",
                                      modes=kept))
    fits = [o for o in found if o.plan is not None]
    if not fits:
        if not failures:
            raise refused[0]
        if len(failures) == 1:
            raise failures[0]
        need = min(e.min_capacity_bytes or math.inf for e in failures)
        finding = (f"no layout of {pairs[0][0] * pairs[0][1]} devices fits: the smallest "
                   f"needs {format_bytes(need)} per device")
        raise InfeasiblePlanError(
            f"{finding}; try more devices, schedule='1f1b' or a larger memory_per_gpu",
            finding=finding, min_capacity_bytes=need)
    best = min(fits, key=lambda o: (o.plan.predicted_step_ms, o.replicas))  # type: ignore
    return Layouts(best.plan, tuple(found), pairs[0][0] * pairs[0][1], note)  # type: ignore


def _modes(profile: Profile, p: int, d: int, options: PlanOptions) -> tuple[str, ...]:
    """The replica modes to plan layout (p, d) with: the one given, else those worth it for
    replicas (:func:`~autosplit.planner.replicated.candidate_modes`), else DDP's (none)."""
    if options.replica_mode != "auto":
        return (options.replica_mode,)
    if d == 1:
        return ("ddp",)
    return candidate_modes(profile, p)


def _plan_placed(profile: Profile, p: int, d: int, topology: Topology | None,
                 options: PlanOptions) -> Plan:
    """The best plan of layout (p, d) over its placements on ``topology`` (none: as given)."""
    if topology is None:
        return plan_replicated(profile, p, d, options)
    given = options.allreduce_bandwidth_bytes_per_s
    measured = given or profile.allreduce_bytes_per_s
    latency = profile.allreduce_latency_ms if given is None else 0.0  # with its bandwidth
    best: Plan | None = None
    failure: InfeasiblePlanError | None = None
    for place in placements(topology, p, d, measured):  # type: ignore[arg-type]
        try:
            one = plan_replicated(profile, p, d, dataclasses.replace(
                options, bandwidth_bytes_per_s=place.link_bytes_per_s,
                allreduce_bandwidth_bytes_per_s=place.allreduce_bytes_per_s,
                allreduce_latency_ms=latency))
        except InfeasiblePlanError as exc:
            failure = exc
            continue
        one = dataclasses.replace(one, placement=place.order,
                                  devices_per_node=topology.per_node)
        if best is None or one.predicted_step_ms < best.predicted_step_ms * (1 - TIE_RTOL):
            best = one
    if best is None:
        assert failure is not None
        raise failure
    return best
