"""Measure what is claimed: time the stages of candidate plans as they will run.

Block sums drive the search, but a stage's blocks run together are not the sum of the blocks
timed one by one (caches, allocator and kernel choices differ), and by a different amount at
each micro-batch size. So before a plan is printed or saved, each stage of the best few
candidates, and of every plan shown beside them, is timed as it will run: its contiguous
blocks together (:meth:`~autosplit.graph.BlockGraph.extract`), forward and backward, at the
plan's micro-batch size b. The stage runs take turns (A B A B …, round after round) so that
drift hits all of them alike, and rounds go on while a stage's interquartile range exceeds
5 % of its median, up to a cap and a time budget. Every other round a stage starts without
gradients, as a step's first micro-batch does (its backward makes them), the others add into
them, as the step's later micro-batches do; a step of m micro-batches is predicted with one of
the first kind and m − 1 of the second (:meth:`StageTime.per_step`). Adding into gradients
costs more: ResNet50's forward and backward at b = 24 (64×64) took 2–5 % longer than starting
without them.

Each plan is then predicted again by the same simulator (:mod:`autosplit.simulator`) from
these stage times; transfers keep the plan's modelled link time. The best of several
candidates is chosen on one such session and predicted from a second one, with the plans
printed beside it (:func:`verify_and_choose`): the fastest of noisy figures is its luckiest.
The whole model is timed in one piece too, for the "over one device" figure: at the
profile's best micro-batch size, accumulated, and on a CPU also on the whole batch at once
(which is faster depends on the machine); on a GPU the whole batch may not fit.

Spreads are relative: half the interquartile range over the median (a fraction).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from autosplit import checks, fresh_process, measurement
from autosplit.cost import single_device_ms
from autosplit.devices import resolve_device
from autosplit.errors import InvalidInputError
from autosplit.graph import BlockGraph, Segment
from autosplit.losses import timing_loss
from autosplit.profiler import check_inputs, check_microbatch_sizes
from autosplit.records import Plan, Profile
from autosplit.schedules import SPLIT_BACKWARD
from autosplit.simulator import simulate_plan
from autosplit.stages import block_ranges

__all__ = ["StageTime", "time_stages", "verify_and_choose", "verify_plans"]

StageRun = tuple[int, int, int]
"""``(first, end, b)``: blocks ``first … end-1`` run together on a micro-batch of b."""


@dataclass(frozen=True, slots=True)
class StageTime:
    """A stage timed as it runs.

    Attributes:
        forward_ms: median forward time of one micro-batch (ms).
        backward_ms: median backward time (ms), adding into the gradients of an earlier one.
        spread: half the interquartile range of forward + backward over its median (fraction).
        rounds: timed runs taken.
        first_backward_ms: median backward time when the stage's weights have no gradient
            yet (ms): a step's first micro-batch, whose gradients are new tensors, not a sum
            (``None``: not timed; then :attr:`backward_ms`).
    """

    forward_ms: float
    backward_ms: float
    spread: float
    rounds: int
    first_backward_ms: float | None = None

    def per_step(self, m: int) -> StageTime:
        """This stage's times averaged over a step's ``m`` micro-batches: the first
        backward makes the gradients, the m − 1 others add into them (ms)."""
        if self.first_backward_ms is None:
            return self
        mean = (self.first_backward_ms + (m - 1) * self.backward_ms) / m
        return dataclasses.replace(self, backward_ms=mean)

    @property
    def compute_ms(self) -> float:
        """Forward + backward (ms)."""
        return self.forward_ms + self.backward_ms


def _inputs_at(graph: BlockGraph, inputs: Sequence[torch.Tensor], b: int,
               runs: Sequence[StageRun], dev: torch.device) -> dict[str, Any]:
    """The values every stage run at size b reads, made by running the blocks before it."""
    needed = {name for first, end, size in runs if size == b
              for name in graph.extract(first, end).inputs}
    env: dict[str, Any] = {n: x[:b].to(dev).clone() for n, x in zip(graph.inputs, inputs)}
    kept = {n: v for n, v in env.items() if n in needed}
    last = max((first for first, _, size in runs if size == b), default=0)
    with torch.no_grad():
        for i in range(last):
            seg = graph.extract(i, i + 1)
            outputs = seg.module(*(env[n] for n in seg.inputs))
            env.update(zip(seg.outputs, outputs))
            kept.update({n: env[n] for n in seg.outputs if n in needed})
            live = set(graph.cuts[i].tensors) | set(graph.inputs)
            env = {n: v for n, v in env.items() if n in live}
    return kept


def _spread(values: Sequence[float]) -> float:
    if len(values) < 2:
        return 0.0
    q1, median, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return (q3 - q1) / 2 / median if median > 0 else 0.0


def time_stages(
    graph: BlockGraph,
    example_inputs: Any,
    runs: Sequence[StageRun],
    *,
    device: str | torch.device | None = None,
    threads: int = 1,
    warmup: int = 1,
    rounds: int = 3,
    max_rounds: int = 10,
    budget_s: float | None = 60.0,
    progress: Callable[[int, int, str], None] | None = None,
    loss: str = "none",
) -> dict[StageRun, StageTime]:
    """Time each stage run ``(first, end, b)``, taking turns round after round.

    A run that ends with the model's last block is timed with ``loss`` after it
    (:mod:`autosplit.losses`), as the profile it checks was.

    Works on a private copy of the model (the model is left as it was); on a CPU, in a fresh
    process, as the ranks run (:mod:`autosplit.fresh_process`). ``rounds`` timed rounds at
    least (2 at least: every other round starts without gradients, see
    :meth:`StageTime.per_step`), after ``warmup`` untimed ones; more, up to ``max_rounds``,
    while a run's IQR exceeds 5 % of its median and ``budget_s`` seconds are not spent.

    Raises:
        InvalidInputError: a block range outside the model, a b above the example batch.
    """
    inputs = check_inputs(example_inputs)
    runs = list(dict.fromkeys(runs))
    checks.positive_int("rounds", rounds)
    checks.non_negative_int("warmup", warmup)
    batch = int(inputs[0].shape[0])
    for first, end, b in runs:
        graph.extract(first, end)  # checks the range
        check_microbatch_sizes([b], batch, "b")
    timing_loss(loss)  # checks the name
    options = dict(device=device, threads=threads, warmup=warmup, rounds=rounds,
                   max_rounds=max_rounds, budget_s=budget_s, loss=loss)
    if resolve_device(device).type == "cpu" and fresh_process.enabled():
        return fresh_process.run_fresh(_time_here, graph, inputs, runs, progress=progress,
                                       **options)
    return _time_here(graph, inputs, runs, progress=progress, **options)


def _time_here(
    graph: BlockGraph,
    inputs: tuple[torch.Tensor, ...],
    runs: list[StageRun],
    *,
    device: str | torch.device | None,
    threads: int,
    warmup: int,
    rounds: int,
    max_rounds: int,
    budget_s: float | None,
    progress: Callable[[int, int, str], None] | None,
    loss: str,
) -> dict[StageRun, StageTime]:
    """:func:`time_stages` in this process, on checked arguments."""
    loss_fn = timing_loss(loss)
    dev = resolve_device(device)
    start = time.perf_counter()
    old_threads = torch.get_num_threads()
    rng = [dev.index or 0] if dev.type == "cuda" else []
    fwd: dict[StageRun, list[float]] = {r: [] for r in runs}
    bwd: dict[StageRun, list[float]] = {r: [] for r in runs}
    first: dict[StageRun, list[float]] = {r: [] for r in runs}  # backwards into no gradient
    sums: dict[tuple[StageRun, bool], list[float]] = {(r, new): [] for r in runs
                                                       for new in (True, False)}
    rounds = max(rounds, 2)  # both kinds of backward
    try:
        if dev.type == "cpu":
            torch.set_num_threads(threads)
        on_device = torch.cuda.device(dev) if dev.type == "cuda" else contextlib.nullcontext()
        with torch.random.fork_rng(devices=rng), on_device:
            work = measurement.private_copy(graph, dev)
            envs = {b: _inputs_at(work, inputs, b, runs, dev) for b in {r[2] for r in runs}}
            segments = {r: work.extract(r[0], r[1]) for r in runs}
            total = warmup + max(rounds, max_rounds)
            for k in range(total):
                if k >= warmup + rounds:
                    settled = all(measurement.spread_settled(x) for x in sums.values())
                    elapsed = time.perf_counter() - start
                    per_round = elapsed / k
                    if settled or (budget_s is not None and elapsed + per_round > budget_s):
                        break
                for j, r in enumerate(runs):  # A B A B …: every run once per round
                    seg: Segment = segments[r]
                    fresh = (k + j) % 2 == 0  # every other round, the gradients start anew
                    for param in seg.module.parameters():
                        if fresh:
                            param.grad = None
                        elif param.grad is None:  # (another run's fresh start took it)
                            param.grad = torch.zeros_like(param)
                    args = measurement.segment_args(work, envs[r[2]], seg)
                    last = loss_fn if r[1] == len(work.blocks) else None
                    _, f_ms, b_ms = measurement.timed_run(seg, args, dev, loss=last)
                    if k >= warmup:
                        fwd[r].append(f_ms)
                        (first[r] if fresh else bwd[r]).append(b_ms)
                        sums[r, fresh].append(f_ms + b_ms)
                    if progress is not None:
                        progress(k * len(runs) + j + 1, total * len(runs), f"round {k + 1}")
    finally:
        torch.set_num_threads(old_threads)
    return {
        r: StageTime(statistics.median(fwd[r]), statistics.median(bwd[r] or first[r]),
                     max(_spread(sums[r, True]), _spread(sums[r, False])), len(fwd[r]),
                     statistics.median(first[r] or bwd[r]))
        for r in runs
    }


def _step_of(t: StageTime, m: int) -> float:
    """One device's step of m micro-batches run one after the other (ms)."""
    return m * t.per_step(m).compute_ms


def _stage_runs(plan: Plan) -> list[StageRun]:
    return [(first, end, plan.split_size) for first, end in block_ranges(plan.balance)]


def _split_costs(profile: Profile, plan: Plan) -> list[float]:
    """Per stage, what splitting the backward costs over running it whole: the profile's
    input-gradient + weight-gradient time of the stage's blocks over their whole backward, at
    the plan's micro-batch size (1.0 where the schedule does not split it or the profile does
    not have both at that size).

    Stage runs are timed with the backward whole; zero-bubble schedules run it in two passes
    (+10–13 % on ResNet50 and GPT small), except on the first stage (no input gradient)."""
    ones = [1.0] * len(plan.stages)
    if plan.schedule not in SPLIT_BACKWARD or plan.split_size not in profile.microbatch_sizes:
        return ones
    k = profile.microbatch_sizes.index(plan.split_size)
    out = []
    for first, end in block_ranges(plan.balance):
        if first == 0:
            out.append(1.0)
            continue
        blocks = profile.blocks[first:end]
        if any(b.input_grad_ms is None or b.weight_grad_ms is None for b in blocks):
            return ones
        whole = math.fsum(b.bwd_ms[k] for b in blocks)
        split = math.fsum(b.input_grad_ms[k]  # type: ignore[index]
                          + b.weight_grad_ms[k] for b in blocks)  # type: ignore[index]
        out.append(split / whole if whole > 0 and split > 0 else 1.0)
    return out


def _scaled(plan: Plan, times: Sequence[StageTime], factor: int,
            split_costs: Sequence[float] | None = None) -> Plan:
    """The plan with each stage's time moved by ``factor`` (−1, 0, +1) times its spread; a
    stage's weight-gradient part keeps its share of the stage's backward, and a split backward
    costs ``split_costs[s]`` times the whole one (:func:`_split_costs`)."""
    stages = []
    costs = split_costs or [1.0] * len(plan.stages)
    for s, t, split in zip(plan.stages, times, costs):
        scale = max(1 + factor * t.spread, 0.0)
        forward = t.forward_ms * scale
        compute = forward + t.backward_ms * scale * split
        backward_before = s.compute_ms - s.forward_ms
        share = s.weight_grad_ms / backward_before if backward_before > 0 else 0.0
        stages.append(dataclasses.replace(
            s, compute_ms=compute, forward_ms=forward,
            weight_grad_ms=min(share, 1.0) * (compute - forward),
            block_sum_ms=s.compute_ms if s.block_sum_ms is None else s.block_sum_ms,
            verified_spread=t.spread,
        ))
    return dataclasses.replace(plan, stages=tuple(stages))


def verify_plans(
    graph: BlockGraph,
    example_inputs: Any,
    profile: Profile,
    plans: Mapping[str, Plan],
    one_device: bool = True,
    **options: Any,
) -> dict[str, Plan]:
    """Every plan with its stages timed as they run and its step predicted again from them.

    Each returned plan's stages have ``compute_ms`` / ``forward_ms`` from the stage runs,
    ``block_sum_ms`` from the search and ``verified_spread``; ``predicted_step_ms`` is the
    schedule simulation of those times (plus the replicas' gradient all-reduce, from the cost
    model, for a plan with replicas), ``step_spread`` its spread (the simulation of every
    stage at median ± spread), ``single_device_ms`` the whole model timed in one piece (the
    faster of the profile's best micro-batch size, accumulated, and, on a CPU, the whole batch
    at once; ``one_device=False``: not timed, the plan's kept), and ``verification`` says
    how. ``options`` are :func:`time_stages`'s keyword arguments.

    Raises:
        ModelMismatchError: a plan is of another model than ``graph``.
        As :func:`time_stages`.
    """
    checks.instance_of("profile", profile, Profile, "an autosplit Profile")
    for plan in plans.values():
        plan.check_model(graph.fingerprint, graph.model_name)
    n = len(graph.blocks)
    whole = _whole_batch_fits(example_inputs, options.get("device"))
    singles: dict[str, list[StageRun]] = {}  # the ways one device may run each plan's batch
    for name, plan in plans.items():
        _, b_one = single_device_ms(profile, plan.batch_size)
        singles[name] = [(0, n, b_one)] if one_device else []
        if one_device and whole(plan.batch_size) and b_one != plan.batch_size:
            singles[name].append((0, n, plan.batch_size))
    runs = [r for plan in plans.values() for r in _stage_runs(plan)]
    runs += [r for ways in singles.values() for r in ways]
    times = time_stages(graph, example_inputs, runs, **{"loss": profile.loss, **options})
    rounds = min(t.rounds for t in times.values())
    distinct = len(dict.fromkeys(runs))
    out = {}
    for name, plan in plans.items():
        stage_times = [times[r].per_step(plan.microbatches) for r in _stage_runs(plan)]
        split = _split_costs(profile, plan)
        mid, low, high = (_scaled(plan, stage_times, f, split) for f in (0, -1, 1))
        sync = plan.replica_sync_ms if plan.replicas > 1 else 0.0  # not timed: the model's
        step = simulate_plan(mid).step_ms + sync
        spread = (simulate_plan(high).step_ms - simulate_plan(low).step_ms) / 2 / step
        one_ms, one = min(((_step_of(times[r], math.ceil(plan.batch_size / r[2])), times[r])
                           for r in singles[name]), key=lambda way: way[0],
                          default=(plan.single_device_ms, None))
        p = len(plan.stages)
        out[name] = dataclasses.replace(
            mid,
            predicted_step_ms=step,
            step_spread=spread,
            single_device_ms=one_ms,
            single_device_spread=plan.single_device_spread if one is None else one.spread,
            bound_step_ms=(plan.microbatches + p - 1)
            * max(s.compute_ms + s.send_ms for s in mid.stages),
            verification=(
                f"each stage's blocks timed together at b={plan.split_size}, forward and "
                f"backward, {distinct} stage runs taking turns over ≥ {rounds} rounds; "
                f"block sums gave {plan.predicted_step_ms:.0f} ms"
            ),
        )
    return out


def _whole_batch_fits(example_inputs: Any, device: Any) -> Callable[[int], bool]:
    """Whether one device's step is timed on the whole batch B in one piece (as it is run):
    on a CPU when the example inputs hold B samples. On a GPU the whole batch may not fit in
    its memory: the profile's best micro-batch size, accumulated, is timed instead."""
    if resolve_device(device).type != "cpu":
        return lambda batch: False
    available = int(check_inputs(example_inputs)[0].shape[0])
    return lambda batch: batch <= available


def verify_and_choose(
    graph: BlockGraph,
    example_inputs: Any,
    profile: Profile,
    candidates: Sequence[Plan],
    others: Mapping[str, Plan] | None = None,
    **options: Any,
) -> tuple[Plan, dict[str, Plan]]:
    """Choose the candidate with the shortest verified step and predict it, and the plans
    shown beside it, from a second verification; return the chosen plan and the others, by
    name.

    The fastest of noisy figures is the luckiest: predicted from the timings that chose it, a
    plan would look better than the plans beside it. So the best candidate (ties: the better by
    block sums) is chosen on one session and predicted, with the others and one device, from a
    second (both in one fresh process on a CPU); ``budget_s`` (default 60 s) is shared by their
    stage runs. A single candidate is timed once, with the others.

    Raises:
        InvalidInputError: no candidate; as :func:`verify_plans`.
    """
    if not candidates:
        raise InvalidInputError("no candidate plan to verify")
    checks.instance_of("profile", profile, Profile, "an autosplit Profile")
    for plan in [*candidates, *(others or {}).values()]:  # before any process starts
        plan.check_model(graph.fingerprint, graph.model_name)
    if (len(candidates) > 1 and resolve_device(options.get("device")).type == "cpu"
            and fresh_process.enabled()):  # both sessions in one fresh process
        progress = options.pop("progress", None)
        return fresh_process.run_fresh(_choose_here, graph, example_inputs, profile,
                                       list(candidates), dict(others or {}),
                                       progress=progress, **options)
    return _choose_here(graph, example_inputs, profile, candidates, others, **options)


def _choose_here(graph: BlockGraph, example_inputs: Any, profile: Profile,
                 candidates: Sequence[Plan], others: Mapping[str, Plan] | None = None,
                 **options: Any) -> tuple[Plan, dict[str, Plan]]:
    """:func:`verify_and_choose` here (timings in a fresh process unless this is one)."""
    named = {f"candidate {i}": c for i, c in enumerate(candidates)}
    others = dict(others or {})
    if len(named) == 1:
        verified = verify_plans(graph, example_inputs, profile, {**named, **others}, **options)
        return verified["candidate 0"], {name: verified[name] for name in others}
    budget = options.get("budget_s", 60.0)
    first_runs = _run_count(named.values())
    second_runs = _run_count([*named.values()][:1] + [*others.values()]) + 1
    progress = options.get("progress")

    def session(share: float, part: int) -> dict[str, Any]:  # its budget, its progress
        out = {**options, "budget_s": None if budget is None else budget * share}
        if progress is not None:
            out["progress"] = lambda done, total, what: progress(part * total + done,
                                                                 2 * total, what)
        return out

    share = first_runs / (first_runs + second_runs)
    chosen = verify_plans(graph, example_inputs, profile, named, one_device=False,
                          **session(share, 0))  # one device: in the second only
    name = min(named, key=lambda n: chosen[n].predicted_step_ms)
    verified = verify_plans(graph, example_inputs, profile, {name: named[name], **others},
                            **session(1 - share, 1))
    best = verified[name]
    shapes = ", ".join(_shape(c) for c in candidates)
    best = dataclasses.replace(
        best, verification=f"{best.verification}; chosen among the {len(named)} best "
        f"candidates by block sums ({shapes}) on a first verification "
        f"({chosen[name].predicted_step_ms:.0f} ms there), predicted from a second one",
    )
    return best, {n: verified[n] for n in others}


def _run_count(plans: Any) -> int:
    """Distinct stage runs of ``plans`` (a verification session takes turns over them)."""
    return len({r for plan in plans for r in _stage_runs(plan)}) or 1


def _shape(plan: Plan) -> str:
    """``2 stages b=15``, ``1 stage × 2 replicas b=15``: a candidate in a few words."""
    p = len(plan.stages)
    replicas = f" × {plan.replicas} replicas" if plan.replicas > 1 else ""
    return f"{p} stage{'s' if p != 1 else ''}{replicas} b={plan.split_size}"
