"""One layout of p stages × d data-parallel replicas, planned exactly: DDP or FSDP2 along "dp".

Symbols: p stages, d replicas (d | B), B the batch, b the micro-batch size, m = ceil(B / (d · b))
micro-batches per replica, G_s the gradient bytes of stage s (= its parameter bytes P_s), W the
collective bandwidth (bytes/s), α its latency (ms), o the overlapped share.

Each replica of a stage runs B / d samples in micro-batches of b; every stage's d replicas keep
equal over their own group of devices, every stage at once, in one of three ways
(``replica_mode``, :data:`autosplit.sharding.REPLICA_MODES`):

* ``"ddp"``: whole copies, one ring all-reduce of the gradients after the last backward,
  step = pipeline_step(B / d; cuts, b) + (1 − o) · (α + 2 (d − 1)/d · max_s G_s / W)
  (:func:`autosplit.cost.replica_sync_ms`). o = 0 by default: on 2 gloo ranks of one CPU
  thread each DDP's step took longer than the backward and the all-reduce one after the other
  (``benchmarks/results/allreduce_overlap.md``); NCCL on GPUs overlaps in practice.
* ``"fsdp2"`` / ``"fsdp2-no-reshard"``: ``fully_shard`` with or without resharding after
  forward; a device holds 2 + (1 + state)/d parameter sizes per parameter byte instead of
  DDP's 2 + state, plus the largest unit's gathered bytes briefly, runs 1/d of its stage's
  optimizer update, and pays the all-gathers and the reduce-scatter of
  :func:`autosplit.sharding.fsdp_sync_ms` (what torch's ``PipelineStage`` does with FSDP2:
  :mod:`autosplit.sharding`).

W defaults to the all-reduce bandwidth measured on the real backend (``Profile.
allreduce_bytes_per_s``, :mod:`autosplit.measure.collectives`), with its latency α, else to the link
bandwidth (α = 0: a bandwidth given by hand comes without one); all-gathers and
reduce-scatters are costed at the same W (a ring moves (d − 1)/d of the bytes in each, half an
all-reduce). A pipeline of one stage runs on torch's runtime too, each replica its own: its
cost per action is ``Profile.one_stage_action`` (:mod:`autosplit.measure.runtime_cost`).

The search is exact over (mode, cuts, b) for each (p, d): the synchronisation grows with
max_s G_s, so for each mode and b the exact branch and bound
(:func:`autosplit.solve.exact.solve_step`) is run again under a limit on every stage's
gradient bytes, lowered below the last optimum's max_s G_s each time, until no balance under
the limit beats the best step so far (a balance with at least as many gradient bytes as the
last optimum cannot be faster than it). ``replica_mode="auto"`` takes the fastest mode (ties:
DDP, then FSDP2 resharding, then not).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence

from autosplit import checks
from autosplit.cost import replica_sync_ms, single_device_ms
from autosplit.errors import InfeasiblePlanError, InvalidInputError, ScheduleUnavailableError
from autosplit.planner.assembly import assemble, explain_infeasible
from autosplit.planner.options import PlanOptions
from autosplit.planner.problems import _copy_bytes, partition_problem, step_problem
from autosplit.planner.search import (
    SEARCH_LIMIT_S,
    _solve,
    candidate_sizes,
    plan,
    runnable_sizes,
)
from autosplit.planner.settings import PlanSettings
from autosplit.records import Plan, Profile
from autosplit.sharding import REPLICA_MODES, fsdp_sync_ms
from autosplit.solve.exact import TIE_RTOL, solve_step

__all__ = ["candidate_modes", "plan_replicated", "stage_grad_bytes"]


def stage_grad_bytes(profile: Profile) -> tuple[float, ...]:
    """Gradient bytes of each block: its parameters, plus every shared parameter it uses but
    does not own (a stage holding several users counts it more than once: on the safe side)."""
    copies = _copy_bytes(profile)
    return tuple(float(blk.param_bytes + copies[i]) for i, blk in enumerate(profile.blocks))


def plan_replicated(profile: Profile, stages: int, replicas: int,
                    options: PlanOptions = PlanOptions()) -> Plan:
    """The plan with the smallest predicted step for ``stages`` × ``replicas`` devices.

    See the module docstring for the formula and the search. ``replicas=1`` is
    :func:`autosplit.planner.plan` itself. Of ``options``
    (:class:`~autosplit.planner.options.PlanOptions`), ``allreduce_bandwidth_bytes_per_s``
    defaults to the profile's measured all-reduce bandwidth (``Profile.allreduce_bytes_per_s``),
    else to the link bandwidth (``bandwidth_bytes_per_s``, itself defaulting per device kind:
    :data:`autosplit.cost.DEFAULT_LINK_BYTES_PER_S`); ``allreduce_latency_ms`` (α, ms) to the
    profile's measured latency with its measured bandwidth, else 0; ``allreduce_overlap`` is o
    in [0, 1]. Devices of other names, speeds or profiles are for pipelines only.
    With replicas, ``schedule`` is ``"gpipe"``, ``"1f1b"`` or ``"auto"`` (the faster of the
    two; the joint search of other schedules covers pipelines without replicas only), and
    ``replica_mode`` one of :data:`autosplit.sharding.REPLICA_MODES` or ``"auto"`` (the
    fastest that fits; FSDP2 only where no weight is shared across stages, which the runtime
    keeps equal on plain tensors); the plan records it (``Plan.replica_mode``).

    Raises:
        InvalidInputError: ``replicas`` does not divide the batch, devices of other names,
            speeds or profiles with replicas, or a bad argument (as
            :func:`autosplit.planner.plan`).
        InfeasiblePlanError: no cut fits ``memory_per_gpu`` at any size.
    """
    checks.instance_of("profile", profile, Profile, "an autosplit Profile")
    checks.instance_of("options", options, PlanOptions, "an autosplit.PlanOptions")
    replicas = checks.positive_int("replicas", replicas)
    batch = options.batch_size or profile.batch_size
    if batch % replicas:
        raise InvalidInputError(f"replicas={replicas} does not divide the batch {batch}: each "
                                "replica runs an equal share; pick a divisor of the batch")
    if replicas == 1:
        return plan(profile, stages, dataclasses.replace(options, batch_size=batch))
    if not options.uniform_devices:
        raise InvalidInputError(
            "devices, speeds and device_profiles are planned for pipelines (replicas=1): "
            f"with replicas={replicas} every device is of the profile's kind")
    schedule, replica_mode = options.schedule, options.replica_mode

    def again(key: str) -> Callable[[str], Plan]:
        """This call once more, with the option ``key`` set to each value tried."""
        return lambda value: plan_replicated(profile, stages, replicas,
                                             dataclasses.replace(options, **{key: value}))

    if schedule == "auto":  # layouts with replicas: GPipe or 1F1B, the faster
        return _fastest(again("schedule"), ("gpipe", "1f1b"))
    if replica_mode == "auto":
        return _fastest(again("replica_mode"), candidate_modes(profile, stages))
    if replica_mode != "ddp" and not profile.fsdp_units:
        raise InvalidInputError(
            f"replica_mode={replica_mode!r}: a block of {profile.model} reads weights that no "
            "module its graph calls holds (a model captured by torch.export reads every one), "
            "so FSDP2 cannot shard it block by block: plan it with replica_mode='ddp' (or "
            "'auto')")
    if schedule not in ("gpipe", "1f1b"):
        raise InvalidInputError(f"schedule={schedule!r} with replicas={replicas}: layouts "
                                "with replicas run 'gpipe' or '1f1b' (or 'auto')")
    share = batch // replicas
    settings = dataclasses.replace(
        PlanSettings.check(profile, stages, dataclasses.replace(options, batch_size=share)),
        replica_mode=replica_mode, replicas=replicas)
    split_size, solver, time_limit_s = options.split_size, options.solver, options.time_limit_s
    overlap = options.allreduce_overlap
    latency = 0.0  # the measured latency goes with the measured bandwidth only
    allreduce = options.allreduce_bandwidth_bytes_per_s
    if allreduce is None:
        allreduce = profile.allreduce_bytes_per_s
        latency = profile.allreduce_latency_ms
    if options.allreduce_latency_ms is not None:
        latency = options.allreduce_latency_ms
    width = settings.bandwidth_bytes_per_s if allreduce is None else allreduce

    def sync(grad: float, m: int) -> float:
        if replica_mode == "ddp":
            return replica_sync_ms(grad, replicas, width, overlap, latency)
        return fsdp_sync_ms(replica_mode, grad, replicas, m, width, latency, overlap)

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
            total = found.step_ms + sync(g, m)
            if best is None or total < best[0] * (1 - TIE_RTOL):
                best = (total, k, found.balance, label)
            if sync(g, m) == sync(0.0, m) or not found.proven:  # fewer bytes cost no less
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
    synced = sync(_max_stage(grads, balance), piped.microbatches)
    single, single_split = single_device_ms(profile, batch, settings.optimizer)
    return dataclasses.replace(
        piped, batch_size=batch, replicas=replicas, replica_sync_ms=synced,
        allreduce_bytes_per_s=width,
        predicted_step_ms=piped.predicted_step_ms + synced,
        bound_step_ms=piped.bound_step_ms + synced, single_device_ms=single,
        single_device_split=single_split, replica_mode=replica_mode,
    )


def candidate_modes(profile: Profile, stages: int) -> tuple[str, ...]:
    """The replica modes worth planning ``stages`` stages with: DDP alone where FSDP2 cannot
    shard every block as a unit (:attr:`Profile.fsdp_units`) and where a weight is shared
    across several stages (torch's runtime keeps its copies equal on plain tensors); else
    every mode."""
    if not profile.fsdp_units or (profile.shared and stages > 1):
        return ("ddp",)
    return REPLICA_MODES


def _fastest(plan_with: Callable[[str], Plan], values: Sequence[str]) -> Plan:
    """The fastest of ``plan_with(value)`` over ``values`` (ties: the first); when none is
    found, what does not fit the memory (the smallest need) is said before what torch
    refuses."""
    found, failures = [], []
    for value in values:
        try:
            found.append(plan_with(value))
        except (InfeasiblePlanError, ScheduleUnavailableError) as exc:
            failures.append(exc)
    if not found:
        infeasible = [f for f in failures if isinstance(f, InfeasiblePlanError)]
        if infeasible:  # the smallest need over the modes
            raise min(infeasible, key=lambda e: e.min_capacity_bytes or math.inf)
        raise failures[-1]
    best = found[0]
    for q in found[1:]:
        if q.predicted_step_ms < best.predicted_step_ms * (1 - TIE_RTOL):
            best = q
    return best


def _max_stage(grads: Sequence[float], balance: Sequence[int]) -> float:
    """The most gradient bytes any stage of ``balance`` holds."""
    ends = [sum(balance[: s + 1]) for s in range(len(balance))]
    return max(math.fsum(grads[e - c:e]) for e, c in zip(ends, balance))


