"""Where a pipeline step's time goes: autosplit's verified prediction against torch's runtime,
action by action, on 2 CPU workers.

For each model, autosplit plans it for 2 CPU workers with ``--schedule`` (GPipe by default;
the profile, the runtime's cost per action and the link measured as ``autosplit plan``
measures them) and verifies the plan's stages (``autosplit.verify.plans.verify_plans``). Then the
plan trains ``--steps`` steps on 2 gloo ranks, back to back after warm-up steps (more until a
step faults in no fresh memory: ``harness.settled``), with every
action of torch's runtime timed from inside it on a clock common to both ranks: each stage's
forward, backward and weight pass (``forward_one_chunk``, ``backward_one_chunk``,
``backward_weight_one_chunk``), the loss, the posting of sends and receives and the waits for
them (torch's private ``_batch_p2p`` / ``_wait_batch_p2p``, wrapped in the ranks only:
a diagnostic, not how autosplit runs).

Reported, per model: the predicted step (verified, and verified again right after the training:
the machine's drift) against the measured steps (median, IQR); each stage's forward and
backward as verified, timed the same way inside the ranks (``--in-rank`` times, interleaved:
alone, the other rank waiting, and together, the other rank timing its own stage: what the
other core's work costs) and inside the runtime (medians);
the replay of the plan with the runtime's own action times (the schedule simulation, with the
cost per action and the link as planned), which splits the gap in two: the stages computing
slower or faster in the runtime than when verified, and what the runtime spends outside the
actions that the model does not see — with the actions' medians, with their means (a step is
a sum of actions: skewed action times make the median step longer than the sum of the
medians), and each step replayed with its own actions' times (the median over the steps);
and each rank's step taken apart (actions, loss, posting, waiting, the rest) with the receives
that took over 1 ms.

    python benchmarks/runtime_gap.py        # writes benchmarks/results/runtime_gap.{json,md}
    python benchmarks/runtime_gap.py --models gpt-small --schedule 1f1b --out /tmp/gap
    python benchmarks/runtime_gap.py --models resnet50 bigvocab --out /tmp/gap  # not by default
    python benchmarks/runtime_gap.py --models bigvocab --balance 5,1 --split-size 16 --out /tmp/h
    python benchmarks/runtime_gap.py --smoke --out /tmp/gap   # a tiny model in seconds (tests)
"""

from __future__ import annotations

if __name__ == "__main__":  # started again first, before the imports below pay twice: the C
    # allocator keeping freed memory, as the ranks run (see autosplit/measure/allocator.py)
    from autosplit.measure.allocator import restart_keeping_freed_memory

    restart_keeping_freed_memory()

import dataclasses
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from accuracy_cases import Case, ExampleSpec
from common import describe, machine
from harness import ModelSpec, page_faults, settled
from run_options import benchmark_parser, chosen_cases, write_and_show

import autosplit
from autosplit import PlanOptions, ProfileOptions
from autosplit.errors import AutosplitError, InvalidInputError
from autosplit.measure.collectives import measure_link_bandwidth
from autosplit.measure.runtime_cost import action_costs
from autosplit.records import Plan
from autosplit.schedules import SPLIT_BACKWARD, torch_order
from autosplit.simulator import simulate_plan
from autosplit.validation import KNOWN_SCHEDULES
from autosplit.verify.options import TimingOptions
from autosplit.verify.plans import verify_plans

GIVEN = " (the cut given by --balance, not autosplit's plan)"
SLOW_RECEIVE_MS = 1.0  # a receive (posting + waiting) longer than this is counted as slow
WARMUP = 2  # untimed steps before the timed ones, at least
MAX_WARMUP = 60  # at most, while a step still faults in fresh memory (harness.settled)
KINDS = ("F", "B", "I", "W")
"""The actions timed: forward, backward whole, input pass, weight pass (torch's
``backward_one_chunk`` with ``full_backward`` true is B, false I)."""


DEFAULT = ("gpt-small", "resnet50-64")
"""The models a run without ``--models`` takes apart (the others are larger or slower)."""


def every_case() -> list[Case]:
    """The models ``--models`` may name: :data:`DEFAULT`, ResNet50 at the tutorial's size and
    the big-vocabulary transformer (examples/bigvocab.py)."""
    return [
        Case("gpt-small", "GPT small", ModelSpec("gpt-small", 64), None, None, 0.45),
        Case("resnet50-64", "ResNet50", ModelSpec("resnet50", 48, (3, 64, 64)), None, None, 1.2),
        Case("resnet50", "ResNet50 (tutorial size)", ModelSpec("resnet50", 120, (3, 128, 128)),
             None, None, 12.0),
        Case("bigvocab", "Big vocabulary", ExampleSpec("bigvocab-small", 32), None, None, 0.7),
    ]


def smoke_cases() -> list[Case]:
    return [Case("bigvocab", "Big vocabulary (tiny)", ExampleSpec("bigvocab-tiny", 8), None,
                 None, 0.02)]


# ------------------------------------------------------------------- inside the ranks


def _balance(text: str) -> tuple[int, int]:
    """``"5,1"`` → (5, 1): blocks per stage of a cut into 2 stages."""
    import argparse

    try:
        counts = tuple(int(x) for x in text.split(","))
    except ValueError:
        counts = ()
    if len(counts) != 2 or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"a cut into 2 stages, e.g. 5,1; got {text!r}")
    return counts  # type: ignore[return-value]


def check_balance(balance: Sequence[int], blocks: int, model: str) -> None:
    """``--balance`` against the model's block count (before anything is measured).

    Raises:
        InvalidInputError: the cut's blocks do not add up to the model's.
    """
    if sum(balance) != blocks:
        raise InvalidInputError(f"--balance {','.join(map(str, balance))} has {sum(balance)} "
                                f"blocks; {model} has {blocks}")


def given_plan(profile: Any, balance: Sequence[int], split_size: int, schedule: str) -> Plan:
    """The cut ``balance`` at micro-batch size ``split_size`` scored as the planner scores a
    hand split (:func:`autosplit.planner.plan_with_balance`); a cut that does not add up to the
    model's blocks, or a size not profiled, is an error naming them."""
    from autosplit.planner import plan_with_balance

    check_balance(balance, len(profile.blocks), profile.model)
    if split_size not in profile.microbatch_sizes:
        raise InvalidInputError(f"--split-size {split_size} was not profiled "
                                f"(sizes {', '.join(map(str, profile.microbatch_sizes))})")
    return plan_with_balance(profile, list(balance), split_size,
                             options=PlanOptions(schedule=schedule))


def _recording(events: list[tuple[str, int, int, float, float]]) -> None:
    """Wrap torch's pipeline runtime so that every action, loss, posting and wait is appended
    to ``events`` as (kind, stage or -1, micro-batch or -1, start, end) on
    ``time.perf_counter`` (CLOCK_MONOTONIC on Linux: one clock for every process of the
    machine)."""
    from torch.distributed.pipelining import schedules, stage

    def wrap(owner: Any, name: str, kind: str, stage_arg: int | None) -> None:
        inner = getattr(owner, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                on = args[stage_arg] if stage_arg is not None else None
                if kind != "loss" or on.is_last:  # the loss: where there is one
                    index = -1 if on is None else on.stage_index
                    chunk = args[1] if kind in KINDS else -1  # (self, chunk id, …)
                    what = "I" if kind == "B" and not kwargs.get("full_backward", True) else kind
                    events.append((what, index, int(chunk), start, time.perf_counter()))

        setattr(owner, name, timed)

    base = stage._PipelineStageBase
    wrap(base, "forward_one_chunk", "F", 0)
    wrap(base, "backward_one_chunk", "B", 0)
    wrap(base, "backward_weight_one_chunk", "W", 0)
    wrap(schedules._PipelineSchedule, "_maybe_compute_loss", "loss", 1)  # (self, stage, …)
    wrap(schedules, "_batch_p2p", "post", None)  # (what _sorted_batch_p2p calls per peer)
    wrap(schedules, "_wait_batch_p2p", "wait", None)


def _rank(spec: Any, plan: Plan, steps: int, warmup: int, loss: str,
          repeats: int) -> list[Any] | None:
    """Train ``plan`` for ``warmup`` + ``steps`` steps, recording each timed step's events;
    then time this rank's stages as verification does (:func:`_in_rank`). Rank 0 returns
    every rank's ([(step start, step end, events), …], in-rank stage times)."""
    import torch
    import torch.distributed as dist

    from autosplit import distributed

    events: list[tuple[str, int, int, float, float]] = []
    _recording(events)
    torch.manual_seed(0)
    model, inputs = spec.build(), spec.make_inputs()
    targets = distributed.tutorial_targets(model, inputs)
    trainer = distributed.Trainer(model, plan, distributed.tutorial_loss,
                                  lambda params: torch.optim.SGD(params, lr=0.001))
    mine = []
    warm = 0  # ``warmup`` steps, then more while a step faults in fresh memory on a rank
    while len(mine) < steps:
        dist.barrier()
        events.clear()
        faults = page_faults()
        start = time.perf_counter()
        trainer.step(inputs if trainer.holds_first else None,
                     targets if trainer.holds_last else None)
        end = time.perf_counter()
        # the same decision on every rank: the same counts, and a gathered verdict
        if warm < warmup or (not mine and warm < MAX_WARMUP
                             and not _all_settled(page_faults() - faults)):
            warm += 1
            continue
        mine.append((start, end, list(events)))
    timed = _in_rank(model, inputs, plan, loss, repeats)
    timed |= _by_hand(trainer, model, inputs, targets, plan, repeats)
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (mine, timed, warm))
    return gathered if dist.get_rank() == 0 else None


def _all_settled(faults: int) -> bool:
    """Whether no rank faulted in fresh memory in its step (this rank's ``faults`` pages;
    :func:`harness.settled`). Collective."""
    import torch.distributed as dist

    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, faults)
    return settled(gathered)


def _in_rank(model: Any, inputs: Any, plan: Plan, loss: str, repeats: int
             ) -> dict[str, dict[str, list[float]]]:
    """This rank's stages timed in the rank as verification times them
    (:func:`autosplit.verify.stage_timing.time_stages`: the stage's blocks together, its schedule's
    micro-batches in flight, here in this process), ``repeats`` times each way, interleaved:
    ``"alone"`` while the other ranks wait at a barrier, ``"together"`` while they time
    theirs. Per way, ``{"F<s>": [ms, …], "B<s>": [ms, …]}``."""
    import os

    import torch.distributed as dist

    from autosplit.distributed import stage_ranks
    from autosplit.measure import timing_process
    from autosplit.schedules.placement import V_SCHEDULES
    from autosplit.stages import block_ranges
    from autosplit.verify import timed_runs
    from autosplit.verify.stage_timing import time_stages

    os.environ[timing_process.IN_PROCESS] = "1"  # in this rank, not in a fresh process
    rank, world = dist.get_rank(), dist.get_world_size()
    graph = autosplit.trace(model, example_inputs=inputs)
    place = stage_ranks(len(plan.stages), world, plan.schedule in V_SCHEDULES)
    depths = timed_runs.depths(plan)  # the depth in flight verification gives each stage
    runs = {s: (first, end, plan.split_size)
            for s, (first, end) in enumerate(block_ranges(plan.balance)) if place[s] == rank}
    out: dict[str, dict[str, list[float]]] = {"alone": {}, "together": {}}

    def time_mine(way: str) -> None:
        got = time_stages(graph, inputs, list(runs.values()),
                          depths={r: depths[s] for s,
                                  r in runs.items()}, options=TimingOptions(loss=loss, warmup=1,
                                                                            rounds=2, max_rounds=2, budget_s=None))
        for s, r in runs.items():
            out[way].setdefault(f"F{s}", []).append(got[r].forward_ms)
            out[way].setdefault(f"B{s}", []).append(got[r].per_step(plan.microbatches).backward_ms)

    _alone_and_together(time_mine, "alone", "together", repeats)
    return out


def _alone_and_together(run: Any, alone: str, together: str, repeats: int) -> None:
    """``repeats`` times ``run(alone)`` on each rank in turn (the others waiting at a barrier)
    and ``run(together)`` on every rank at once, interleaved A B, B A, …; collective."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    for k in range(repeats):
        for way in (alone, together)[:: 1 if k % 2 == 0 else -1]:
            if way == together:
                dist.barrier()
                run(way)
                continue
            for who in range(world):
                dist.barrier()
                if who == rank:
                    run(way)
    dist.barrier()


def _by_hand(trainer: Any, model: Any, inputs: Any, targets: Any, plan: Plan,
             repeats: int) -> dict[str, dict[str, list[float]]]:
    """This rank's stage modules, the very ones torch's runtime ran (``trainer.modules``), run
    by a plain loop in the rank: the step's m forwards (the last stage's with the loss), then
    their m backwards, no messages (each stage's inputs made beforehand); ``repeats`` times
    each way, interleaved, ``"by hand, alone"`` and ``"by hand, together"`` as
    :func:`_in_rank`. Per way, ``{"F<s>": [ms, …], "B<s>": [ms, …]}`` (means over the m)."""
    import torch

    from autosplit import distributed

    every = distributed.stage_modules(model, plan)  # to make the inputs of a later stage
    b, m = plan.split_size, plan.microbatches
    batches = [tuple(x[i * b:(i + 1) * b] for x in inputs) for i in range(m)]
    wanted = [tuple(t[i * b:(i + 1) * b] for t in targets) for i in range(m)]
    fed: dict[int, list[tuple[Any, ...]]] = {}
    with torch.no_grad():
        for module in trainer.modules:
            values = batches
            for earlier in every[:module.index]:
                values = [tuple(_leaves(earlier(*v))) for v in values]
            fed[module.index] = values
    out: dict[str, dict[str, list[float]]] = {"by hand, alone": {}, "by hand, together": {}}

    def run(way: str) -> None:
        for module in trainer.modules:
            s = module.index
            outs, fwd, bwd = [], [], []
            for i in range(m):
                received = tuple(v.detach().requires_grad_(s > 0 and v.is_floating_point())
                                 for v in fed[s][i])
                start = time.perf_counter()
                y = module(*received)
                if module.is_last:
                    y = distributed.tutorial_loss(module.unflatten_output(y), wanted[i])
                fwd.append(1000.0 * (time.perf_counter() - start))
                outs.append(y)
            for y in outs:
                leaves = [t for t in _leaves(y) if t.requires_grad]
                start = time.perf_counter()
                torch.autograd.backward(leaves, [torch.ones_like(t) for t in leaves])
                bwd.append(1000.0 * (time.perf_counter() - start))
            out[way].setdefault(f"F{s}", []).append(statistics.fmean(fwd))
            out[way].setdefault(f"B{s}", []).append(statistics.fmean(bwd))
        model.zero_grad(set_to_none=True)

    run("by hand, alone")  # a warm-up, not kept
    out["by hand, alone"].clear()
    _alone_and_together(run, "by hand, alone", "by hand, together", repeats)
    return out


def _leaves(value: Any) -> tuple[Any, ...]:
    """A stage's output as a tuple of tensors."""
    return (value,) if not isinstance(value, (tuple, list)) else tuple(value)


# ------------------------------------------------------------------------- the analysis


def _mean(values: Sequence[float]) -> float | None:
    return statistics.fmean(values) if values else None


def _median(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


def _quartiles(values: Sequence[float]) -> tuple[float, float]:
    if len(values) < 2:
        return values[0], values[0]
    q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, q3


def analyse(plan: Plan, ranks: list[list[Any]]) -> dict[str, Any]:
    """Steps, per-stage action medians, the replay with them, each rank's breakdown and the
    delays of the actions whose input comes from the other rank."""
    steps = len(ranks[0])
    measured = [1000.0 * (max(r[k][1] for r in ranks) - min(r[k][0] for r in ranks))
                for k in range(steps)]
    durations: dict[tuple[str, int], list[float]] = {}
    loss: list[float] = []
    per_step: list[tuple[dict[tuple[str, int], list[float]], list[float]]] = [
        ({}, []) for _ in range(steps)]  # each step's own action times and losses
    breakdown = []
    for rank in ranks:
        parts: dict[str, list[float]] = {name: [] for name in (
            "actions", "loss", "posting", "waiting", "rest", "after its step")}
        for k, (start, end, events) in enumerate(rank):
            total = {"actions": 0.0, "loss": 0.0, "posting": 0.0, "waiting": 0.0}
            for kind, stage, _, a, b in events:
                ms = 1000.0 * (b - a)
                if kind in KINDS:
                    durations.setdefault((kind, stage), []).append(ms)
                    per_step[k][0].setdefault((kind, stage), []).append(ms)
                    total["actions"] += ms
                elif kind == "loss":
                    loss.append(ms)
                    per_step[k][1].append(ms)
                    total["loss"] += ms
                else:
                    total["posting" if kind == "post" else "waiting"] += ms
            own = 1000.0 * (end - start)
            for name, ms in total.items():
                parts[name].append(ms)
            parts["rest"].append(own - sum(total.values()))
            parts["after its step"].append(measured[k] - own)
        breakdown.append({name: statistics.fmean(v) for name, v in parts.items()})
    order = sorted(durations, key=lambda key: (key[1], KINDS.index(key[0])))
    runtime = {f"{kind}{stage}": statistics.median(durations[kind, stage])
               for kind, stage in order}
    q1, q3 = _quartiles(measured)
    return {
        "measured_ms": measured, "measured_median_ms": statistics.median(measured),
        "measured_iqr_ms": [q1, q3],
        "predicted_ms": plan.predicted_step_ms,
        "replay_ms": _replay(plan, durations, _median(loss) or 0.0),
        "replay_mean_ms": _replay(plan, durations, _mean(loss) or 0.0, statistics.fmean),
        "replay_steps_ms": statistics.median(
            _replay(plan, own, _mean(lost) or 0.0, statistics.fmean) for own, lost in per_step),
        "verified": stage_actions(plan),
        "runtime": runtime,
        "loss_ms": _median(loss),
        "per_rank": breakdown,
        "input_delays": _input_delays(plan, ranks),
    }


def stage_actions(plan: Plan) -> dict[str, float]:
    """A verified plan's time per micro-batch of each stage's actions as the runtime names them
    (ms): ``F<s>``; ``B<s>`` the whole backward; where the schedule splits it, its input pass
    ``I<s>`` and weight pass ``W<s>`` (and ``B<s>`` the one pass, where the plan has it:
    DualPipeV)."""
    split = plan.schedule in SPLIT_BACKWARD
    out = {}
    for s in plan.stages:
        backward = s.compute_ms - s.forward_ms
        out[f"F{s.index}"] = s.forward_ms
        if not split:
            out[f"B{s.index}"] = backward
            continue
        out[f"I{s.index}"] = backward - s.weight_grad_ms
        out[f"W{s.index}"] = s.weight_grad_ms
        if s.whole_backward_ms is not None:
            out[f"B{s.index}"] = s.whole_backward_ms
    return out


def _input_delays(plan: Plan, ranks: list[list[Any]]) -> dict[str, Any]:
    """For every forward or backward whose input comes from a stage on the other rank: how
    long after both its input could have arrived (the end of the action after which the
    sender posts the send — the producing action's, or where torch's order posts it,
    ``ScheduleOrder.sends`` — plus the link time of the plan's cut) and its rank was free (the
    end of the rank's previous action or loss) it started (ms). The replay starts it at the
    later of the two, plus the cost per action; what is beyond is the runtime's (posting,
    stalled receives)."""
    where = {e[1]: r for r, rank in enumerate(ranks) for _, _, events in rank for e in events
             if e[0] in KINDS}
    v = plan.stages_per_rank
    sent = {(what, s, i): after for row in torch_order(plan.schedule, len(plan.stages) // v, v,
                                                       plan.microbatches).sends
            for what, s, i, after in row}
    delays: list[float] = []
    per_step = [0.0] * len(ranks)
    for k in range(len(ranks[0])):
        ends = {(e[0], e[1], e[2]): e[4] for rank in ranks for e in rank[k][2] if e[0] in KINDS}
        done = [[e[4] for e in sorted(rank[k][2], key=lambda e: e[3]) if e[0] in KINDS]
                for rank in ranks]  # each rank's actions' ends, in order
        for r, rank in enumerate(ranks):
            previous = rank[k][0]
            for kind, stage, chunk, a, b in sorted(rank[k][2], key=lambda e: e[3]):
                if kind not in ("F", "B", "I"):
                    previous = b if kind == "loss" else previous
                    continue
                source = stage - 1 if kind == "F" else stage + 1
                cut = min(stage, source)
                produced = ends.get((kind, source, chunk)) if kind == "F" else (
                    ends.get(("B", source, chunk)) or ends.get(("I", source, chunk)))
                after = sent.get(("F" if kind == "F" else "G", source, chunk), 0)
                if produced is not None and after and where.get(source) is not None:
                    produced = max(produced, done[where[source]][after - 1])
                if produced is not None and where.get(source) != r:
                    hop = plan.stages[cut].send_ms / 2 / 1000.0
                    delay = 1000.0 * (a - max(produced + hop, previous))
                    delays.append(delay)
                    per_step[r] += delay / len(ranks[0])
                previous = b
    slow = [d for d in delays if d > SLOW_RECEIVE_MS]
    return {"count": len(delays), "median_ms": _median(delays),
            "mean_ms": statistics.fmean(delays) if delays else None,
            "slow": len(slow), "slow_mean_ms": statistics.fmean(slow) if slow else None,
            "per_step_ms": per_step}


def _replay(plan: Plan, durations: dict[tuple[str, int], list[float]], loss_ms: float,
            stat: Any = statistics.median) -> float:
    """The plan's schedule simulation (its cost per action, link and all-reduces after the
    step as planned) with each stage's forward, backward whole (B), input pass (I) and weight
    pass (W) as timed inside the runtime (``stat`` of its timings: the median, or the mean);
    the last stage's forward with the loss, as verification times it. The transfers only
    delay their receivers here: the actions' own times include the copies the ranks' cores
    made while they ran."""
    stages = []
    last = len(plan.stages) - 1
    for s in plan.stages:
        f, b, i, w = (durations.get((kind, s.index)) for kind in "FBIW")
        if not f or not (b or i or w):
            return float("nan")
        forward = stat(f) + (loss_ms if s.index == last else 0.0)
        whole = stat(b) if b else None
        weight = stat(w) if w else 0.0 if whole is not None and not i else s.weight_grad_ms
        backward = (stat(i) if i else 0.0) + weight if (i or w) else whole
        stages.append(dataclasses.replace(
            s, forward_ms=forward, compute_ms=forward + backward,  # type: ignore[operator]
            weight_grad_ms=min(weight, backward),  # type: ignore[type-var]
            whole_backward_ms=whole if (i or w) else None))
    replayed = dataclasses.replace(plan, stages=tuple(stages))
    return simulate_plan(replayed, transfers_on_cores=False).step_ms + plan.sync_after_ms


# ------------------------------------------------------------------------------ the run


def run(args: Any, cases: Sequence[Case]) -> dict[str, Any]:
    from autosplit.distributed import launch

    started = time.perf_counter()
    models = []
    for case in cases:
        print(f"{case.label} ({case.spec.describe}): profile, plan, verify …", flush=True)
        model, inputs = case.spec.build(), case.spec.make_inputs()
        graph = autosplit.trace(model, example_inputs=inputs)
        if args.balance is not None:  # before the profile: a wrong cut ends the run at once
            check_balance(args.balance, len(graph.blocks), graph.model_name)
        given = [args.split_size] if args.split_size is not None else []
        options = ProfileOptions(microbatch_sizes=args.sizes, include=given,
                                 budget_s=args.profile_budget)
        profile = autosplit.profile(model, inputs, options=options)
        if not args.smoke:  # the runtime's cost per action and the link, as `autosplit plan`
            profile = dataclasses.replace(profile, **action_costs(schedules=(args.schedule,)),
                                          link_bytes_per_s=measure_link_bandwidth())
        if args.balance is None:
            planned = autosplit.plan(profile, 2, options=PlanOptions(schedule=args.schedule))
        else:  # a given cut, scored as the planner scores it
            planned = given_plan(profile, args.balance, args.split_size, args.schedule)
        timing = (graph, inputs, profile, {"plan": planned})
        plan = verify_plans(*timing, one_device=False,
                            options=TimingOptions(budget_s=args.verify_budget))["plan"]
        print(f"  training {args.steps} steps with the runtime's actions timed …", flush=True)
        got = launch(_rank, 2, case.spec, plan, args.steps, WARMUP, profile.loss, args.in_rank,
                     timeout_s=args.timeout)[0]
        ranks = [steps for steps, _, _ in got]
        in_rank = {way: {name: statistics.median(values) for _, timed, _ in got
                         for name, values in timed[way].items()}
                   for way in ("alone", "together", "by hand, alone", "by hand, together")}
        print("  timing the stages again …", flush=True)
        again = verify_plans(*timing, one_device=False,
                             options=TimingOptions(budget_s=args.verify_budget))["plan"]
        found = analyse(plan, ranks)
        found["in_rank"] = in_rank
        found["warmup_steps"] = got[0][2]
        found["again_ms"] = again.predicted_step_ms
        found["verified_again"] = stage_actions(again)
        models.append({"model": case.label, "key": case.name, "input": case.spec.describe,
                       "schedule": plan.schedule, "v": plan.stages_per_rank,
                       "split_size": plan.split_size, "microbatches": plan.microbatches,
                       "balance": list(plan.balance), "given": args.balance is not None,
                       "action_ms": plan.action_ms,
                       "link_bytes_per_s": profile.link_bytes_per_s, **found})
    return {
        "settings": {"machine": machine(), "command": args.command, "steps": args.steps,
                     "min_warmup_steps": WARMUP, "max_warmup_steps": MAX_WARMUP,
                     "schedule": args.schedule,
                     "profile_budget_s": args.profile_budget,
                     "verify_budget_s": args.verify_budget, "slow_receive_ms": SLOW_RECEIVE_MS},
        "models": models, "seconds": time.perf_counter() - started,
    }


def _warmup_words(settings: dict[str, Any]) -> str:
    """The warm-up rule in words (results written before it: a fixed count)."""
    if "min_warmup_steps" not in settings:
        return f"{settings['warmup_steps']} warm-up steps"
    return (f"{settings['min_warmup_steps']} warm-up steps or more, until a step faulted in no "
            f"more than 1 MiB of fresh memory on either rank (at most "
            f"{settings['max_warmup_steps']})")


def _pct(value: float, base: float) -> str:
    return f"{(value - base) / base:+.1%}" if base > 0 else "–"


def markdown(data: dict[str, Any]) -> str:
    s = data["settings"]
    lines = [
        "# Where a pipeline step's time goes: prediction against torch's runtime", "",
        f"Machine: {describe(s['machine'])}.  ", f"Command: `{s['command']}`.  ",
        (f"2 CPU workers of 1 thread (gloo ranks); {s['steps']} steps back to back after "
         f"{_warmup_words(s)}, each after a barrier; every action timed inside "
         f"torch's runtime. Total {data['seconds']:.0f} s."), "",
    ]
    for m in data["models"]:
        measured = m["measured_median_ms"]
        q1, q3 = m["measured_iqr_ms"]
        lines += [
            f"## {m['model']} ({m['input']})", "",
            (f"{m['schedule']}{'' if m['v'] == 1 else ' v=' + str(m['v'])}, balance "
             f"{m['balance']}, b = {m['split_size']}, m = {m['microbatches']}"
             f"{GIVEN if m.get('given') else ''}; cost per action {m['action_ms']:.2f} ms"
             + (f"; {m['warmup_steps']} warm-up steps." if "warmup_steps" in m else ".")), "",
            "| | step ms | against measured |", "|---|---|---|",
            f"| measured (median; IQR {q1:.0f}–{q3:.0f}) | {measured:.1f} | |",
        ]
        for name, ms in (("predicted (verified stages)", m["predicted_ms"]),
                         ("predicted, the stages timed again after the training", m["again_ms"]),
                         ("replay of the runtime's own action times", m["replay_ms"]),
                         ("the same, their means", m.get("replay_mean_ms")),
                         ("each step replayed with its own action times (median)",
                          m.get("replay_steps_ms"))):
            if ms is not None:  # (older results: the medians' replay only)
                lines.append(f"| {name} | {ms:.1f} | {_pct(ms, measured)} |")
        lines += [
            "",
            ("Each stage's forward and backward per micro-batch (ms): verified (a fresh "
             "process, the other core idle), verified again after the training, timed the same "
             "way inside the ranks with the other rank waiting (alone) and timing its own stage "
             "(together), the runtime's own stage modules run by a plain loop in the ranks "
             "(by hand: the step's forwards, then its backwards, no messages; alone and "
             "together), and inside torch's runtime."
             + (" Where the schedule splits the backward, I is its input pass, W its weight "
                "pass and B a backward run whole (DualPipeV runs both kinds); the four in-rank "
                "columns run every backward whole."
                if m["schedule"] in SPLIT_BACKWARD else "")), "",
            ("| action | verified | again after | in the rank, alone | in the rank, together | "
             "by hand, alone | by hand, together | in the runtime | runtime / verified |"),
            "|---|---|---|---|---|---|---|---|---|",
        ]

        def cell(value: float | None) -> str:
            return "–" if value is None else f"{value:.2f}"

        for name, ms in m["runtime"].items():
            ver = m["verified"].get(name)
            lines.append(
                f"| {name} | {cell(ver)} | {cell(m['verified_again'].get(name))} | "
                + " | ".join(cell(m["in_rank"].get(way, {}).get(name)) for way in (
                    "alone", "together", "by hand, alone", "by hand, together"))
                + f" | {ms:.2f} | {'' if ver is None else _pct(ms, ver)} |")
        if m["loss_ms"] is not None:
            lines.append(f"| loss | (in the last F) | | | | | | {m['loss_ms']:.2f} | |")
        lines += ["", ("Each rank's step, ms (mean): its actions, the loss, posting sends and "
                       "receives, waiting for them, the rest of its own step, and after it until "
                       "the slower rank ends."), "",
                  "| rank | actions | loss | posting | waiting | rest | after its step |",
                  "|---|---|---|---|---|---|---|"]
        for r, parts in enumerate(m["per_rank"]):
            lines.append(f"| {r} | {parts['actions']:.1f} | {parts['loss']:.1f} | "
                         f"{parts['posting']:.1f} | {parts['waiting']:.1f} | {parts['rest']:.1f} | "
                         f"{parts['after its step']:.1f} |")
        d = m["input_delays"]
        if d["count"]:
            lines += ["", (f"Actions whose input comes from the other rank: {d['count']}; each "
                           "started after both its input could have arrived (from where the "
                           "sender posts its send) and its rank was "
                           f"free by {d['median_ms']:.2f} ms at the median, {d['mean_ms']:.2f} ms "
                           f"on average; {d['slow']} by over {s['slow_receive_ms']:g} ms"
                           + (f" (mean {d['slow_mean_ms']:.1f} ms)" if d["slow"] else "")
                           + "; per step, rank by rank: "
                           + ", ".join(f"{x:.1f}" for x in d["per_step_ms"]) + " ms.")]
        lines.append("")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    parser = benchmark_parser(__doc__, [c.name for c in every_case()], DEFAULT)
    parser.add_argument("--schedule", default="gpipe", choices=KNOWN_SCHEDULES,
                        help="the schedule to plan and run (default gpipe)")
    parser.add_argument("--steps", type=int, default=12, help="timed steps (default 12)")
    parser.add_argument("--balance", type=_balance, default=None, metavar="N,N",
                        help="run this cut instead of autosplit's plan: blocks per stage, e.g. "
                             "5,1 (with --split-size; GPipe or 1F1B)")
    parser.add_argument("--split-size", type=int, default=None, dest="split_size",
                        help="the micro-batch size of --balance's cut")
    parser.add_argument("--in-rank", type=int, default=3, dest="in_rank",
                        help="times each rank's stages are timed in the rank, alone and "
                             "together, after the training (default 3)")
    args = parser.parse_args(argv)
    cases = chosen_cases(parser, args, argv, "runtime_gap.py", every_case, smoke_cases)
    if args.steps < 1:
        parser.error("--steps must be positive")
    if (args.balance is None) != (args.split_size is None):
        parser.error("--balance and --split-size go together")
    if args.split_size is not None and args.split_size < 1:
        parser.error("--split-size must be positive")
    if args.smoke:
        args.steps, args.in_rank = 2, 1
    try:
        data = run(args, cases)
    except AutosplitError as exc:  # a --balance or --split-size that does not fit the model
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    write_and_show(args, "runtime_gap.py", data, markdown(data))


if __name__ == "__main__":
    main()
