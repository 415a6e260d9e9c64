"""What torch's pipeline runtime costs per action, beyond the stages' own compute (ms).

Between two actions of a rank, torch.distributed.pipelining posts and waits for its sends and
receives, looks up the micro-batch's cached values and, for the last stage, computes the loss
outside the stage's module; a receive also waits for the message's latency. Measured on 2 CPU
workers (gloo) with the stages' actions timed inside the runtime, these gaps were 0.3–1.4 ms
per action: next to GPT small's 6–25 ms actions, 5–9 % of the step, which a replay of the
stage times alone does not see.

:func:`measure_action_ms` runs every schedule the planner searches (or those asked for: a plan
of one schedule needs that one's cost only) on 2 local ranks with stages that compute
(:data:`LAYERS` linear layers of width :data:`WIDTH` and a tanh, micro-batches of :data:`ROWS`
rows: a forward of about 7 ms on one thread of the development machines' CPUs), times each
rank's stages in a plain loop in the rank (:data:`PLAIN_RUNS` runs, the medians; each rank's
alone, the other waiting, then both ranks at once; a zero-bubble schedule's backward in its two
passes and, where it runs some whole (DualPipeV), in one pass too), interleaved with the
steps, and fits, per schedule, the cost ``o`` that one action must have for the replay of
torch's own order (:mod:`autosplit.schedules`) with those stage times, weighed between
alone and together as a verified prediction weighs them, to last the measured step
(:func:`fit_weighed_action_ms`). The planner adds ``o`` to every action of that schedule
(``Profile.action_ms``, ``Plan.action_ms``), the median over the rounds; the fits' spread
over the rounds (``Profile.action_spread``) widens a verified plan's predicted step
(:func:`autosplit.verify.plans.predict_verified`). Measured once per process (and forgotten:
:func:`forget_measurements`).

A plan of one stage with data-parallel replicas runs on the same runtime, one stage per
rank: :func:`measure_one_stage_action_ms` fits its cost per action the same way, on 2 ranks
each running a one-stage ``ScheduleGPipe`` of a measuring stage at once, as replicas do (their
gradient synchronisation is DDP's, costed apart: :func:`autosplit.measure.collectives.measure_allreduce`):
on 2 CPU workers 0.26–0.37 ms per action.

Stages that compute, not stages that cost nothing: on 2 CPU workers (AMD EPYC, one day's fits),
stages of one 16 × 16 layer gave GPipe 0.36–0.60 ms per action and stages that compute (192 to
1024 wide) 0.5–1.5 ms: the runtime's per-action work costs more while the ranks compute.

Steady stage times, not one run's: ``o`` is fitted on medians over rounds, as a verified
prediction times its stages (:mod:`autosplit.verify.stage_timing`); fitted on one plain run per round
(the first run after other work is the slowest), it came out 30–100 % lower.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from typing import Any

from autosplit import checks
from autosplit.measure.runtime_fit import fit_action_ms, fit_weighed_action_ms
from autosplit.measure.spread import half_iqr
from autosplit.schedules import SEARCHED, StageCosts, torch_class_name, torch_order

__all__ = ["LAYERS", "MEASURED", "PLAIN_RUNS", "ROUNDS", "ROWS", "WARMUP_ROUNDS", "WIDTH",
           "action_costs", "forget_measurements",
           "measure_action_ms", "measure_action_spread", "measure_one_stage_action_ms",
           "one_stage_fits", "one_stage_rounds"]

MEASURED = SEARCHED
"""The (schedule, stages per rank) pairs measured: those ``schedule="auto"`` searches."""

_MICROBATCHES = 8
WIDTH = 768
"""Width of the measuring stages' linear layers."""
LAYERS = 16
"""Linear layers (each followed by a tanh) in one measuring stage. The cost grows with the
actions' length: a receive posted while the peer computes waits until the peer's
communication thread gets its core (3–8 ms inside ``_batch_p2p`` beside 23–45 ms actions,
0.1–3 ms beside 2–5 ms ones). GPipe's fits with 4, 8, 16, 32 and 64 layers (actions of 4, 8,
17, 33 and 67 ms; Intel Xeon, one run): 4.2, 5.0, 7.6, 8.1 and 14.3 ms; GPT small's pipelines
(actions of 20–45 ms) measured 8–13 % above a prediction with 4 layers' 2.0–2.3 ms."""
ONE_STAGE_LAYERS = 4  # the one-stage runtime's measuring stage (it sends nothing)
ROWS = 32
"""Rows of one micro-batch of the measuring stages."""
PLAIN_RUNS = 3
"""Plain runs of the measuring stages per round, alone and together: each figure's median."""
ROUNDS = 10
"""Timed rounds per schedule, their fits' median taken (one round's fit is noisy: GPipe's
spread over 1.4–8.1 ms in 16 rounds on 16 layers; Intel Xeon)."""
WARMUP_ROUNDS = 3
"""Untimed rounds first: a process's first rounds fitted up to twice the later ones."""
_CACHE: dict[str, dict[str, list[float]]] = {}
_Runs = dict[int, tuple[float, float, float, float]]
"""Per stage of a rank: (forward, input pass, weight pass, backward in one pass) ms of its plain
runs."""
_ONE_STAGE = "one stage"  # the one-stage runtime's fits, in _CACHE beside the schedules'


def _pairs(schedules: Sequence[str] | None) -> tuple[tuple[str, int], ...]:
    """The (schedule, v) pairs of :data:`MEASURED` for ``schedules`` (``None``: all of them).

    Raises:
        InvalidInputError: a name that is not one of :data:`MEASURED`'s schedules.
    """
    if schedules is None:
        return MEASURED
    if isinstance(schedules, str):
        schedules = (schedules,)
    known = dict(MEASURED)
    for name in schedules:
        checks.one_of("schedules", name, tuple(known))
    return tuple((name, known[name]) for name in dict.fromkeys(schedules))


def _fits(backend: str, timeout_s: float, schedules: Sequence[str] | None
          ) -> dict[str, list[float]]:
    """Per schedule asked for (``None``: every one of :data:`MEASURED`), the cost per action
    fitted in each round (ms), measured once per process and backend: the schedules not
    measured yet are measured together, on one pair of ranks."""
    checks.one_of("backend", backend, ("gloo",))
    pairs = _pairs(schedules)
    known = _CACHE.setdefault(backend, {})
    missing = tuple((name, v) for name, v in pairs if name not in known)
    if missing:
        from autosplit.launch import launch

        rounds = launch(_rank, 2, missing, ROUNDS, WARMUP_ROUNDS, LAYERS, backend=backend,
                        timeout_s=timeout_s)[0]
        known.update({
            schedule: [fit_weighed_action_ms(schedule, v, _MICROBATCHES, step, alone, together)
                       for step, alone, together in rounds[schedule]]
            for schedule, v in missing})
    return {name: known[name] for name, _ in pairs}


def measure_action_ms(backend: str = "gloo", timeout_s: float = 120.0,
                      schedules: Sequence[str] | None = None
                      ) -> tuple[tuple[str, float], ...]:
    """Per schedule of ``schedules`` (``None``: all of :data:`MEASURED`), torch's runtime cost
    per action on 2 local ranks of ``backend`` (ms; see the module docstring):
    ``((schedule, ms), …)``, the median of the rounds' fits. Kept for the process's lifetime:
    asking again for a schedule measured already measures nothing.

    Raises:
        InvalidInputError: a backend other than gloo, a schedule not in :data:`MEASURED`.
    """
    return tuple((schedule, statistics.median(fits))
                 for schedule, fits in _fits(backend, timeout_s, schedules).items())


def measure_action_spread(backend: str = "gloo", timeout_s: float = 120.0,
                          schedules: Sequence[str] | None = None
                          ) -> tuple[tuple[str, float], ...]:
    """Per schedule, the spread of :func:`measure_action_ms`'s cost over the rounds: half
    the interquartile range of the rounds' fits (ms, not relative: a cost whose median is 0 can
    still spread), ``((schedule, ms), …)``. From the same measurement (measured once per
    process)."""
    return tuple((schedule, half_iqr(fits))
                 for schedule, fits in _fits(backend, timeout_s, schedules).items())


def action_costs(backend: str = "gloo", timeout_s: float = 120.0,
                 schedules: Sequence[str] | None = None
                 ) -> dict[str, tuple[tuple[str, float], ...]]:
    """The profile fields of the runtime's cost per action, measured for ``schedules``
    (``None``: every schedule the planner searches):
    ``dataclasses.replace(profile, **action_costs())`` sets ``action_ms`` and
    ``action_spread``. A profile measured for some schedules only gives the others the largest
    cost it has (:meth:`~autosplit.records.Profile.action_ms_of`)."""
    return {"action_ms": measure_action_ms(backend, timeout_s, schedules),
            "action_spread": measure_action_spread(backend, timeout_s, schedules)}


def forget_measurements() -> None:
    """Forget the costs this process measured: the next call measures them again (profiles
    meant to be independent, taken in one process, each take their own)."""
    _CACHE.clear()


def measure_one_stage_action_ms(backend: str = "gloo", timeout_s: float = 120.0
                                ) -> tuple[float, float]:
    """torch's runtime cost per action of a one-stage pipeline, as a plan's data-parallel
    replicas run it (``ScheduleGPipe`` over one stage on each of 2 local ranks at once; ms):
    ``(median, spread)`` of the rounds' fits, the spread half their interquartile range (ms).
    Kept for the process's lifetime, as :func:`measure_action_ms`.

    Raises:
        InvalidInputError: a backend other than gloo.
    """
    checks.one_of("backend", backend, ("gloo",))
    known = _CACHE.setdefault(backend, {})
    if _ONE_STAGE not in known:
        from autosplit.launch import launch

        known[_ONE_STAGE] = one_stage_fits(
            launch(one_stage_rounds, 2, backend=backend, timeout_s=timeout_s)[0])
    fits = known[_ONE_STAGE]
    return statistics.median(fits), half_iqr(fits)


def one_stage_fits(rounds: Sequence[tuple[float, StageCosts]]) -> list[float]:
    """The one-stage runtime's cost per action fitted to each timed round of
    :func:`one_stage_rounds` (ms)."""
    return [fit_action_ms("gpipe", 1, _MICROBATCHES, step, p=1, costs=costs)
            for step, costs in rounds]


def one_stage_rounds(repeats: int = 9, warmup: int = 2
                    ) -> list[tuple[float, StageCosts]] | None:
    """Time a one-stage ``ScheduleGPipe`` of a measuring stage on each rank at once, each step
    right after a plain run of the stage (both ranks at once); rank 0 returns every rank's
    timed rounds: (its step, ms; its stage's costs in that round)."""
    import torch
    import torch.distributed as dist
    from torch.distributed import pipelining

    rank, world = dist.get_rank(), dist.get_world_size()
    alone = [dist.new_group([r]) for r in range(world)][rank]  # every rank makes every group
    torch.manual_seed(rank)
    module = _stage_module(ONE_STAGE_LAYERS)
    stage = pipelining.PipelineStage(module, 0, 1, torch.device("cpu"), group=alone)
    runner = pipelining.ScheduleGPipe(stage, n_microbatches=_MICROBATCHES, loss_fn=_loss)
    x = torch.randn(_MICROBATCHES * ROWS, WIDTH)
    target = torch.randn(_MICROBATCHES * ROWS, WIDTH)
    mine: list[tuple[float, StageCosts]] = []
    for i in range(warmup + repeats):
        dist.barrier()
        (fwd, bwd, _, _), = _plain_times({0: module}, 0, False).values()
        dist.barrier()
        start = time.perf_counter()
        runner.step(x, target=target)
        step = (time.perf_counter() - start) * 1000.0
        for q in module.parameters():
            q.grad = None
        if i >= warmup:
            mine.append((step, StageCosts((fwd,), (bwd,))))
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, mine)
    return [r for ranks in gathered for r in ranks] if rank == 0 else None


def _stage_module(count: int | None = None) -> Any:
    """One measuring stage: ``count`` (default :data:`LAYERS`) × (linear of :data:`WIDTH`,
    tanh)."""
    import torch

    layers: list[Any] = []
    for _ in range(LAYERS if count is None else count):
        layers += [torch.nn.Linear(WIDTH, WIDTH), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers)


def _loss(y: Any, target: Any) -> Any:
    return ((y - target) ** 2).mean()


def _plain_times(modules: dict[int, Any], last: int, split: bool, runs: int = PLAIN_RUNS,
                 whole: bool = False) -> _Runs:
    """This rank's stages run ``runs`` times in a plain loop, as the runtime runs them: per
    stage, the medians of (forward, input pass, weight pass, backward in one pass) ms; a
    backward not split is all input pass. The last stage's forward includes the loss; the
    first stage's input needs no gradient (its backward is all weight work when split, as
    torch runs it). With ``split`` and ``whole`` (a schedule that runs some backwards in one
    pass, DualPipeV), a split stage's one pass is timed too, after a forward of its own; else
    it is taken as the two passes."""
    import torch
    from torch.distributed.pipelining._backward import (
        stage_backward_input,
        stage_backward_weight,
    )

    timed: dict[int, list[tuple[float, float, float]]] = {s: [] for s in modules}
    for _ in range(runs):
        for s, module in modules.items():
            x = torch.randn(ROWS, WIDTH, requires_grad=s > 0)
            t0 = time.perf_counter()
            y = module(x)
            if s == last:
                y = _loss(y, torch.zeros_like(y))
            t1 = time.perf_counter()
            grad = torch.ones_like(y)
            if split and s > 0:  # torch's two passes
                _, groups = stage_backward_input([y], [grad], [x], module.parameters())
                t2 = time.perf_counter()
                stage_backward_weight(module.parameters(), groups)
                input_ms, weight_ms = t2 - t1, time.perf_counter() - t2
                one_ms = input_ms + weight_ms
                if whole:
                    y = module(x)
                    y = _loss(y, torch.zeros_like(y)) if s == last else y
                    t3 = time.perf_counter()
                    y.backward(grad)
                    one_ms = time.perf_counter() - t3
            else:  # whole: as the input pass, or, split on the first stage, as the weight pass
                y.backward(grad)
                one_ms = time.perf_counter() - t1
                input_ms, weight_ms = (0.0, one_ms) if split else (one_ms, 0.0)
            for q in module.parameters():
                q.grad = None
            timed[s].append(((t1 - t0) * 1000.0, input_ms * 1000.0, weight_ms * 1000.0,
                             one_ms * 1000.0))
    return {s: tuple(statistics.median(x) for x in zip(*rows))  # type: ignore[misc]
            for s, rows in timed.items()}


def _rank(pairs: Sequence[tuple[str, int]] = MEASURED, repeats: int = ROUNDS,
          warmup: int = WARMUP_ROUNDS, layers: int = LAYERS
          ) -> dict[str, list[tuple[float, StageCosts, StageCosts]]] | None:
    """Time every (schedule, v) of ``pairs`` on the measuring stages, each step right after
    plain runs of every stage, each rank's alone (the other ranks waiting), then every rank's
    at once; rank 0 returns, per schedule and timed round, the step (ms, the slower rank's)
    and the stages' costs in that round alone and together (a cost fitted per round and the
    median taken: the machine's drift between rounds cancels)."""
    import torch
    import torch.distributed as dist
    from torch.distributed import pipelining

    from autosplit.schedules import SPLIT_BACKWARD
    from autosplit.schedules.placement import V_SCHEDULES, stage_indices

    rank = dist.get_rank()
    device = torch.device("cpu")
    out: dict[str, list[tuple[float, StageCosts]]] = {}
    for schedule, v in pairs:
        n = 2 * v
        split = schedule in SPLIT_BACKWARD
        whole = split and any(a.kind == "B" for row in torch_order(
            schedule, 2, v, _MICROBATCHES).actions for a in row)
        mine = stage_indices(n, rank, 2, v_shape=schedule in V_SCHEDULES)
        torch.manual_seed(0)
        modules = {i: _stage_module(layers) for i in mine}
        stages = [pipelining.PipelineStage(modules[i], i, n, device) for i in mine]
        runner = getattr(pipelining, torch_class_name(schedule, v))(
            stages if v > 1 else stages[0], n_microbatches=_MICROBATCHES, loss_fn=_loss)
        x = torch.randn(_MICROBATCHES * ROWS, WIDTH)
        target = torch.randn(_MICROBATCHES * ROWS, WIDTH)
        holds_last = (n - 1) in mine
        timed: list[tuple[float, _Runs, _Runs]] = []
        for i in range(warmup + repeats):
            alone: _Runs = {}
            for turn in range(dist.get_world_size()):  # each rank's stages, the others idle
                dist.barrier()
                if rank == turn:
                    alone = _plain_times(modules, n - 1, split, whole=whole)
            dist.barrier()
            together = _plain_times(modules, n - 1, split, whole=whole)
            dist.barrier()
            start = time.perf_counter()
            args = (x,) if 0 in mine else ()
            runner.step(*args, **({"target": target} if holds_last else {}))
            if i >= warmup:
                timed.append(((time.perf_counter() - start) * 1000.0, alone, together))
        out[schedule] = [_round(n, step, alone, together) for step, alone, together in timed]
    return out if rank == 0 else None


def _round(n: int, step: float, alone: _Runs, together: _Runs
           ) -> tuple[float, StageCosts, StageCosts]:
    """One timed round of every rank (collective): the slowest rank's step and the n stages'
    (forward, input pass, weight pass) ms as StageCosts, alone and together."""
    import torch.distributed as dist

    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (step, alone, together))

    def costs(k: int) -> StageCosts:
        every: _Runs = {}
        for ranks in gathered:
            every.update(ranks[k])
        per = [every[s] for s in range(n)]
        return StageCosts(tuple(c[0] for c in per), tuple(c[1] for c in per),
                          tuple(c[2] for c in per), bwd_whole_ms=tuple(c[3] for c in per))

    return max(float(t) for t, _, _ in gathered), costs(1), costs(2)
