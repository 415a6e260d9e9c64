"""Layouts: p pipeline stages × d data-parallel replicas on N devices, each planned exactly.

Symbols: N devices, p stages, d replicas (p · d devices used, d | B), B the batch, b the
micro-batch size, m = ceil(B / (d · b)) micro-batches per replica, G_s the gradient bytes of
stage s, W the all-reduce bandwidth (bytes/s), o the overlapped share of the all-reduce.

Each replica of a stage runs B / d samples in micro-batches of b; afterwards each stage's d
replicas all-reduce that stage's gradients, every stage at once over its own group of devices:

    step(p, d) = pipeline_step(B / d; cuts, b) + (1 − o) · (α + 2 (d − 1)/d · max_s G_s / W)

(:func:`autosplit.cost.replica_sync_ms`; α the synchronisation's latency, measured with W,
``Profile.allreduce_latency_ms``; o = 0 by default: not overlapped. Measured on 2 gloo
ranks of one CPU thread each, DistributedDataParallel's step took longer than the backward and
the all-reduce one after the other (o from −0.2 to −2.5 over three sizes:
``benchmarks/results/allreduce_overlap.md``): on CPU workers nothing hides the all-reduce, so
o = 0 holds there; NCCL on GPUs overlaps in practice, which ``allreduce_overlap`` can say).
W defaults to the all-reduce bandwidth measured on the real backend (``Profile.
allreduce_bytes_per_s``, :mod:`autosplit.collectives`), with its latency α, else to the link
bandwidth (α = 0: a bandwidth given by hand comes without one).
A pipeline of one stage runs on torch's runtime too, each replica its own: its cost per action
is ``Profile.one_stage_action`` (:mod:`autosplit.runtime_cost`).
Pure data parallelism is p = 1, d = N: one device's step on B / N samples in
micro-batches of b (gradient accumulation when b < B / N) plus the all-reduce of every gradient.
Memory per device is its stage's weights, gradients and optimizer state plus the activations
in flight of its replica's B / d samples, as for a pipeline alone.

The search is exact over (cuts, b) for each (p, d): the all-reduce grows with max_s G_s, so
for each b the exact branch and bound (:func:`autosplit.solve.exact.solve_step`) is run again
under a limit on every stage's gradient bytes, lowered below the last optimum's max_s G_s each
time, until no balance under the limit beats the best step so far (a balance with at least as
many gradient bytes as the last optimum cannot be faster than it). :func:`plan_layouts`
compares every (p, d) with p · d = N, d | B and p ≤ blocks (fewer devices only when no layout
uses all N, and then it says why).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass

from autosplit import checks
from autosplit.cost import replica_sync_ms, single_device_ms
from autosplit.errors import InfeasiblePlanError, InvalidInputError, ScheduleUnavailableError
from autosplit.planner.assembly import assemble, explain_infeasible
from autosplit.planner.problems import _copy_bytes, partition_problem, step_problem
from autosplit.planner.search import (
    SEARCH_LIMIT_S,
    _solve,
    candidate_sizes,
    plan,
    runnable_sizes,
)
from autosplit.planner.settings import PlanSettings, check_search
from autosplit.records import Plan, Profile
from autosplit.solve.exact import TIE_RTOL, solve_step
from autosplit.topology import Topology, placements
from autosplit.units import format_bytes

__all__ = ["LayoutOption", "Layouts", "layout_pairs", "plan_layouts", "plan_replicated",
           "stage_grad_bytes"]


@dataclass(frozen=True, slots=True)
class LayoutOption:
    """The best plan of one layout, or why it has none.

    Attributes:
        stages: p.
        replicas: d.
        plan: the best plan of this layout, ``None`` when nothing fits or torch cannot run it.
        need_bytes: when nothing fits, the memory per device the smallest plan needs (bytes).
        why: when torch's schedule cannot run the layout, why (``""``: it is the memory).
    """

    stages: int
    replicas: int
    plan: Plan | None
    need_bytes: float | None = None
    why: str = ""

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


def stage_grad_bytes(profile: Profile) -> tuple[float, ...]:
    """Gradient bytes of each block: its parameters, plus every shared parameter it uses but
    does not own (a stage holding several users counts it more than once: on the safe side)."""
    copies = _copy_bytes(profile)
    return tuple(float(blk.param_bytes + copies[i]) for i, blk in enumerate(profile.blocks))


def layout_pairs(devices: int, batch: int, blocks: int, smallest: int = 1
                 ) -> list[tuple[int, int]]:
    """Every (p, d) with p · d = ``devices``, d | ``batch``, p ≤ ``blocks`` and at least
    ``smallest`` samples per replica (the smallest micro-batch size): pure data parallel first,
    then the pipeline alone, then the hybrids by d descending."""
    pairs = [(devices // d, d) for d in range(devices, 0, -1)
             if devices % d == 0 and batch % d == 0 and devices // d <= blocks
             and batch // d >= smallest]
    return sorted(pairs, key=lambda pd: (pd[0] != 1, pd[1] != 1, -pd[1]))


def plan_replicated(
    profile: Profile,
    stages: int,
    replicas: int,
    *,
    batch_size: int | None = None,
    memory_per_gpu: float | str | None = None,
    schedule: str = "gpipe",
    optimizer: str = "sgd",
    split_size: int | None = None,
    bandwidth_bytes_per_s: float | None = None,
    allreduce_bandwidth_bytes_per_s: float | None = None,
    allreduce_overlap: float = 0.0,
    solver: str = "dp",
    time_limit_s: float | None = None,
    allreduce_latency_ms: float | None = None,
) -> Plan:
    """The plan with the smallest predicted step for ``stages`` × ``replicas`` devices.

    See the module docstring for the formula and the search. ``replicas=1`` is
    :func:`autosplit.planner.plan` itself. ``allreduce_bandwidth_bytes_per_s`` defaults to the
    profile's measured all-reduce bandwidth (``Profile.allreduce_bytes_per_s``), else to the
    link bandwidth (``bandwidth_bytes_per_s``, itself defaulting per device kind:
    :data:`autosplit.cost.DEFAULT_LINK_BYTES_PER_S`); ``allreduce_latency_ms`` (α, ms) to the
    profile's measured latency with its measured bandwidth, else 0; ``allreduce_overlap`` is o
    in [0, 1].
    With replicas, ``schedule`` is ``"gpipe"``, ``"1f1b"`` or ``"auto"`` (the faster of the
    two; the joint search of other schedules covers pipelines without replicas only).

    Raises:
        InvalidInputError: ``replicas`` does not divide the batch, or a bad argument (as
            :func:`autosplit.planner.plan`).
        InfeasiblePlanError: no cut fits ``memory_per_gpu`` at any size.
    """
    checks.instance_of("profile", profile, Profile, "an autosplit Profile")
    replicas = checks.positive_int("replicas", replicas)
    batch = checks.positive_int("batch_size", profile.batch_size if batch_size is None
                                else batch_size)
    if batch % replicas:
        raise InvalidInputError(f"replicas={replicas} does not divide the batch {batch}: each "
                                "replica runs an equal share; pick a divisor of the batch")
    overlap = checks.non_negative_finite("allreduce_overlap", allreduce_overlap)
    if overlap > 1:
        raise InvalidInputError(f"allreduce_overlap={overlap} is above 1: it is the share of "
                                "the all-reduce hidden behind the backward, within [0, 1]")
    options = dict(memory_per_gpu=memory_per_gpu, schedule=schedule, optimizer=optimizer,
                   bandwidth_bytes_per_s=bandwidth_bytes_per_s)
    if replicas == 1:
        return plan(profile, stages, batch_size=batch, split_size=split_size, solver=solver,
                    time_limit_s=time_limit_s, **options)  # type: ignore[arg-type]
    if schedule == "auto":  # layouts with replicas: GPipe or 1F1B, the faster
        found, failures = [], []
        for name in ("gpipe", "1f1b"):
            try:
                found.append(plan_replicated(
                    profile, stages, replicas, batch_size=batch, memory_per_gpu=memory_per_gpu,
                    schedule=name, optimizer=optimizer, split_size=split_size,
                    bandwidth_bytes_per_s=bandwidth_bytes_per_s,
                    allreduce_bandwidth_bytes_per_s=allreduce_bandwidth_bytes_per_s,
                    allreduce_overlap=allreduce_overlap, solver=solver,
                    time_limit_s=time_limit_s, allreduce_latency_ms=allreduce_latency_ms))
            except (InfeasiblePlanError, ScheduleUnavailableError) as exc:
                failures.append(exc)
        if not found:  # what does not fit the memory says more than what torch refuses
            raise next((f for f in failures if isinstance(f, InfeasiblePlanError)), failures[-1])
        return min(found, key=lambda q: q.predicted_step_ms * (1 - TIE_RTOL))
    if schedule not in ("gpipe", "1f1b"):
        raise InvalidInputError(f"schedule={schedule!r} with replicas={replicas}: layouts "
                                "with replicas run 'gpipe' or '1f1b' (or 'auto')")
    share = batch // replicas
    settings = PlanSettings.check(profile, stages, batch_size=share, **options)  # type: ignore
    check_search(split_size, solver, time_limit_s)
    latency = 0.0  # the measured latency goes with the measured bandwidth only
    if allreduce_bandwidth_bytes_per_s is None:
        allreduce_bandwidth_bytes_per_s = profile.allreduce_bytes_per_s
        latency = profile.allreduce_latency_ms
    if allreduce_latency_ms is not None:
        latency = checks.non_negative_finite("allreduce_latency_ms", allreduce_latency_ms, "ms")
    width = settings.bandwidth_bytes_per_s if allreduce_bandwidth_bytes_per_s is None else (
        checks.positive_finite("allreduce_bandwidth_bytes_per_s",
                               allreduce_bandwidth_bytes_per_s, "bytes/s"))

    def sync(grad: float) -> float:
        return replica_sync_ms(grad, replicas, width, overlap, latency)

    sizes = runnable_sizes(profile, candidate_sizes(
        profile, split_size, share, f"the share {share} of each of {replicas} replicas"),
        share, stages, schedule)
    grads = stage_grad_bytes(profile)
    best: tuple[float, int, tuple[int, ...], str] | None = None
    failures: list[InfeasiblePlanError] = []
    unproven: list[int] = []
    for k in sizes:
        m = math.ceil(share / profile.microbatch_sizes[k])
        problem = partition_problem(settings, profile, k, m)
        try:
            seed: tuple[int, ...] | None
            seed, label = _solve(problem, solver, time_limit_s)
        except InfeasiblePlanError:
            failures.append(explain_infeasible(settings, profile, k, m))
            continue
        base = step_problem(settings, profile, k, m, problem, replicas)
        limit: float | None = None
        while True:  # lower the gradient limit below each optimum until nothing beats the best
            found = solve_step(dataclasses.replace(base, grad_bytes=grads, grad_limit=limit),
                               seed, cutoff=math.inf if best is None else best[0],
                               time_limit_s=SEARCH_LIMIT_S)
            if found is None:
                break
            if not found.proven:
                unproven.append(profile.microbatch_sizes[k])
            g = _max_stage(grads, found.balance)
            total = found.step_ms + sync(g)
            if best is None or total < best[0] * (1 - TIE_RTOL):
                best = (total, k, found.balance, label)
            if sync(g) == sync(0.0) or not found.proven:  # fewer bytes would cost no less
                break
            limit, seed = g - 0.5, None  # gradient bytes are whole numbers
    if best is None:
        raise min(failures, key=lambda e: e.min_capacity_bytes or math.inf)
    _, k, balance, label = best
    if unproven:
        label += (f" + search stopped after {SEARCH_LIMIT_S:g} s at b = "
                  f"{', '.join(map(str, sorted(set(unproven))))}: best found, not proven "
                  "optimal")
    candidates = tuple(profile.microbatch_sizes[c] for c in sizes)
    piped = assemble(settings, profile, balance, k, label, candidates, replicas)
    synced = sync(_max_stage(grads, balance))
    single, single_split = single_device_ms(profile, batch, settings.optimizer)
    return dataclasses.replace(
        piped, batch_size=batch, replicas=replicas, replica_sync_ms=synced,
        allreduce_bytes_per_s=width,
        predicted_step_ms=piped.predicted_step_ms + synced,
        bound_step_ms=piped.bound_step_ms + synced, single_device_ms=single,
        single_device_split=single_split,
    )


def _max_stage(grads: Sequence[float], balance: Sequence[int]) -> float:
    """The most gradient bytes any stage of ``balance`` holds."""
    ends = [sum(balance[: s + 1]) for s in range(len(balance))]
    return max(math.fsum(grads[e - c:e]) for e, c in zip(ends, balance))


def plan_layouts(
    profile: Profile,
    devices: int | None = None,
    *,
    topology: Topology | None = None,
    replicas: int | None = None,
    max_stages: int | None = None,
    pipeline_only: bool = False,
    batch_size: int | None = None,
    **options: object,
) -> Layouts:
    """The best plan of every layout of ``devices`` devices as p stages × d replicas.

    Considers every p · d = N with d | B, p ≤ the profile's blocks and B / d at least the
    smallest micro-batch size (``replicas`` fixes d,
    ``pipeline_only`` fixes d = 1); when none uses all N devices, the largest count that has
    one, and ``note`` says why. Each layout is :func:`plan_replicated`; ``options`` are its
    keyword arguments (``memory_per_gpu`` one size for every device, ``schedule``,
    ``optimizer``, ``split_size``, ``bandwidth_bytes_per_s``,
    ``allreduce_bandwidth_bytes_per_s``, ``allreduce_overlap``, ``solver``, ``time_limit_s``).

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
        if options.get("bandwidth_bytes_per_s") is not None:
            raise InvalidInputError("bandwidth_bytes_per_s with a topology: its link "
                                    "bandwidths come from the topology; give them there")
    n_dev = checks.positive_int("devices", devices if devices is not None else (
        topology.devices if topology is not None else 2))
    batch = checks.positive_int("batch_size", profile.batch_size if batch_size is None
                                else batch_size)
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
        split = options.get("split_size")
        smallest = split if isinstance(split, int) else min(profile.microbatch_sizes)
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
        try:
            one = _plan_placed(profile, p, d, batch, topology, options)
        except InfeasiblePlanError as exc:
            failures.append(exc)
            found.append(LayoutOption(p, d, None, exc.min_capacity_bytes))
            continue
        except ScheduleUnavailableError as exc:  # e.g. 1F1B with fewer micro-batches than p
            refused.append(exc)
            found.append(LayoutOption(p, d, None, why=f"{exc.schedule}: {exc.reason}"))
            continue
        found.append(LayoutOption(p, d, one))
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


def _plan_placed(profile: Profile, p: int, d: int, batch: int, topology: Topology | None,
                 options: dict[str, object]) -> Plan:
    """The best plan of layout (p, d) over its placements on ``topology`` (none: as given)."""
    if topology is None:
        return plan_replicated(profile, p, d, batch_size=batch, **options)  # type: ignore
    rest = {k: v for k, v in options.items()
            if k not in ("bandwidth_bytes_per_s", "allreduce_bandwidth_bytes_per_s")}
    measured = options.get("allreduce_bandwidth_bytes_per_s") or profile.allreduce_bytes_per_s
    latency = (profile.allreduce_latency_ms  # measured with the profile's bandwidth
               if options.get("allreduce_bandwidth_bytes_per_s") is None else 0.0)
    best: Plan | None = None
    failure: InfeasiblePlanError | None = None
    for place in placements(topology, p, d, measured):  # type: ignore[arg-type]
        try:
            one = plan_replicated(profile, p, d, batch_size=batch,
                                  bandwidth_bytes_per_s=place.link_bytes_per_s,
                                  allreduce_bandwidth_bytes_per_s=place.allreduce_bytes_per_s,
                                  allreduce_latency_ms=latency, **rest)  # type: ignore[arg-type]
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
