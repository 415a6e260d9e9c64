"""What torch's pipeline runtime costs per action, beyond the stages' own compute (ms).

Between two actions of a rank, torch.distributed.pipelining posts and waits for its sends and
receives, looks up the micro-batch's cached values and, for the last stage, computes the loss
outside the stage's module; a receive also waits for the message's latency. Measured on 2 CPU
workers (gloo) with the stages' actions timed inside the runtime, these gaps were 0.3–1.4 ms
per action: next to GPT small's 6–25 ms actions, 5–9 % of the step, which a replay of the
stage times alone does not see.

:func:`measure_action_ms` runs every schedule the planner searches on 2 local ranks with
stages that cost next to nothing (a 16 × 16 linear layer, 8 micro-batches) and fits, per
schedule, the cost ``o`` that one action must have for the replay of torch's own order
(:mod:`autosplit.schedules`) to last the measured step (:func:`fit_action_ms`). The planner
adds ``o`` to every action of that schedule (``Profile.action_ms``, ``Plan.action_ms``).
"""

from __future__ import annotations

import statistics
import time
from typing import Any

from autosplit import checks
from autosplit.planner.schedules import SEARCHED
from autosplit.schedules import StageCosts, simulate_schedule, torch_class_name

__all__ = ["MEASURED", "fit_action_ms", "measure_action_ms"]

MEASURED = SEARCHED
"""The (schedule, stages per rank) pairs measured: those ``schedule="auto"`` searches."""

_MICROBATCHES = 8
_WIDTH = 16
_CACHE: dict[str, tuple[tuple[str, float], ...]] = {}


def fit_action_ms(schedule: str, v: int, m: int, step_ms: float, p: int = 2) -> float:
    """The cost of one action (ms) for which the replay of ``schedule``'s order (p ranks, v
    stages per rank, m micro-batches; nothing else costing time) lasts ``step_ms``.

    Every action costs the same ``o``, so the replayed step is ``o`` times the step of actions
    that cost nothing but one unit each: ``o = step_ms / units`` (a DualPipeV full backward,
    ``B`` beside its split ``I`` and ``W``, is one action too).

    Raises:
        ArgumentTypeError, InvalidInputError: a count that is not a positive integer, a step
            that is not a finite number ≥ 0.
        ScheduleUnavailableError: torch's class cannot run (p, v, m).
    """
    checks.non_negative_finite("step_ms", step_ms, "ms")
    n = checks.positive_int("p", p) * checks.positive_int("v", v)
    zero = (0.0,) * n
    units = simulate_schedule(schedule, p, v, checks.positive_int("m", m),
                              StageCosts(zero, zero, zero, action_ms=1.0)).step_ms
    return step_ms / units


def measure_action_ms(backend: str = "gloo", timeout_s: float = 120.0
                      ) -> tuple[tuple[str, float], ...]:
    """Per schedule of :data:`MEASURED`, torch's runtime cost per action on 2 local ranks of
    ``backend`` (ms; see the module docstring): ``((schedule, ms), …)``. Kept for the
    process's lifetime: asking again measures nothing."""
    checks.one_of("backend", backend, ("gloo",))
    if backend not in _CACHE:
        from autosplit.distributed import launch

        steps = launch(_rank, 2, backend=backend, timeout_s=timeout_s)[0]
        _CACHE[backend] = tuple(
            (schedule, fit_action_ms(schedule, v, _MICROBATCHES, steps[schedule]))
            for schedule, v in MEASURED)
    return _CACHE[backend]


def _rank(repeats: int = 7, warmup: int = 2) -> dict[str, float] | None:
    """Time every schedule of :data:`MEASURED` on stages that cost next to nothing; rank 0
    returns each one's median step (ms), the slower rank's."""
    import torch
    import torch.distributed as dist
    from torch.distributed import pipelining

    from autosplit.distributed import stage_indices
    from autosplit.distributed.stage_module import V_SCHEDULES

    rank = dist.get_rank()
    device = torch.device("cpu")
    out: dict[str, float] = {}
    for schedule, v in MEASURED:
        n = 2 * v
        mine = stage_indices(n, rank, 2, v_shape=schedule in V_SCHEDULES)
        torch.manual_seed(0)
        layers = [torch.nn.Linear(_WIDTH, _WIDTH) for _ in range(n)]
        stages = [pipelining.PipelineStage(layers[i], i, n, device) for i in mine]
        runner = getattr(pipelining, torch_class_name(schedule, v))(
            stages if v > 1 else stages[0], n_microbatches=_MICROBATCHES,
            loss_fn=lambda y, t: ((y - t) ** 2).mean())
        x = torch.randn(_MICROBATCHES * 4, _WIDTH)
        target = torch.randn(_MICROBATCHES * 4, _WIDTH)
        holds_last = (n - 1) in mine
        times = []
        for i in range(warmup + repeats):
            dist.barrier()
            start = time.perf_counter()
            args = (x,) if 0 in mine else ()
            runner.step(*args, **({"target": target} if holds_last else {}))
            if i >= warmup:
                times.append((time.perf_counter() - start) * 1000.0)
        out[schedule] = _slowest(statistics.median(times))
    return out if rank == 0 else None


def _slowest(value: float) -> float:
    """The largest of every rank's ``value`` (collective)."""
    import torch.distributed as dist

    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, value)
    return max(float(x) for x in gathered)

