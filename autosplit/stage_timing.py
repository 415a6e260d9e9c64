"""Time stages as they run: each stage's contiguous blocks together, forward and backward, at
its micro-batch size, with as many micro-batches in flight as its schedule keeps.

A stage run ``(first, end, b)`` is blocks ``first … end-1`` extracted from the traced model
(:meth:`~autosplit.graph.BlockGraph.extract`) and run on a micro-batch of b samples. The runs
take turns (A B A B …, round after round) so that drift hits all of them alike, and rounds go
on while a run's interquartile range exceeds 5 % of its median, up to a cap and a time budget.
Every other round a run starts without gradients, as a step's first micro-batch does (its
backward makes them), the others add into them, as the step's later micro-batches do.

In flight: a run given a depth d runs d forwards, then their d backwards in the same order, as a
GPipe stage runs its micro-batches (d = m), instead of one forward and its backward. With m
micro-batches' activations held, a stage runs slower than one micro-batch at a time: measured
on GPT small's second stage (b = 8, 8 in flight), 6.6 % (b = 16, 4 in flight: 1.3 %); on
ResNet50's stages at b = 12 (64×64, 4 in flight) within 0.5 % — under the allocator setting the
ranks run with (:mod:`autosplit.allocator`). Times are per micro-batch, averaged over the d.

Spreads are relative: half the interquartile range over the median (a fraction).
"""

from __future__ import annotations

import contextlib
import dataclasses
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from autosplit import checks, fresh_process, measurement
from autosplit.devices import resolve_device
from autosplit.graph import BlockGraph, Segment
from autosplit.losses import timing_loss
from autosplit.profiler import check_inputs, check_microbatch_sizes

__all__ = ["StageRun", "StageTime", "time_stages"]

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
    depths: Mapping[StageRun, int] | None = None,
) -> dict[StageRun, StageTime]:
    """Time each stage run ``(first, end, b)``, taking turns round after round.

    ``depths[run]``: how many micro-batches the run keeps in flight (d forwards, then their d
    backwards; 1, one forward and its backward, when not given); its times are per micro-batch.

    A run that ends with the model's last block is timed with ``loss`` after it
    (:mod:`autosplit.losses`), as the profile it checks was.

    Works on a private copy of the model (the model is left as it was); on a CPU, in a fresh
    process, as the ranks run (:mod:`autosplit.fresh_process`). ``rounds`` timed rounds at
    least (2 at least: every other round starts without gradients, see
    :meth:`StageTime.per_step`), after ``warmup`` untimed ones; more, up to ``max_rounds``,
    while a run's IQR exceeds 5 % of its median and ``budget_s`` seconds are not spent.

    Raises:
        InvalidInputError: a block range outside the model, a b above the example batch, a
            depth that is not a positive integer.
    """
    inputs = check_inputs(example_inputs)
    runs = list(dict.fromkeys(runs))
    depth = {r: checks.positive_int(f"depths[{r}]", (depths or {}).get(r, 1)) for r in runs}
    checks.positive_int("rounds", rounds)
    checks.non_negative_int("warmup", warmup)
    batch = int(inputs[0].shape[0])
    for first, end, b in runs:
        graph.extract(first, end)  # checks the range
        check_microbatch_sizes([b], batch, "b")
    timing_loss(loss)  # checks the name
    options = dict(device=device, threads=threads, warmup=warmup, rounds=rounds,
                   max_rounds=max_rounds, budget_s=budget_s, loss=loss, depths=depth)
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
    depths: Mapping[StageRun, int],
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
                    f_ms, b_ms = _in_flight(seg, args, dev, last, depths[r])
                    if k >= warmup:
                        fwd[r].append(statistics.fmean(f_ms))
                        if fresh:  # the first backward makes the gradients, the others add
                            first[r].append(b_ms[0])
                        if b_ms[fresh:]:
                            bwd[r].append(statistics.fmean(b_ms[fresh:]))
                        sums[r, fresh].append(statistics.fmean(f_ms) + statistics.fmean(b_ms))
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


def _in_flight(seg: Segment, args: Sequence[Any], dev: torch.device, loss: Any,
               depth: int) -> tuple[list[float], list[float]]:
    """``depth`` forwards of ``seg`` on ``args``, then their backwards in the same order, as a
    GPipe stage runs its micro-batches: each one's forward and backward time (ms)."""
    if depth == 1:
        _, f_ms, b_ms = measurement.timed_run(seg, args, dev, loss=loss)
        return [f_ms], [b_ms]
    held = [measurement.timed_forward(seg, args, dev, loss=loss) for _ in range(depth)]
    backwards = [measurement.timed_backward(outputs, value, needs, dev)
                 for outputs, value, needs, _ in held]
    return [f_ms for *_, f_ms in held], backwards
