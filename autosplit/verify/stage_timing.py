"""Time stages as they run: each stage's contiguous blocks together, forward and backward, at
its micro-batch size, with as many micro-batches in flight as its schedule keeps.

A stage run ``(first, end, b)`` is blocks ``first … end-1`` extracted from the traced model
(:meth:`~autosplit.graph.BlockGraph.extract`) and run on a micro-batch of b samples. The runs
take turns (A B A B …, round after round) so that drift hits all of them alike, and rounds go
on while a run's interquartile range exceeds 5 % of its median, up to a cap and a time budget.
A run during which the hypervisor took more than its share of the CPUs is set aside
(:mod:`autosplit.measure.steal_time`).
Every other round a run starts without gradients, as a step's first micro-batch does (its
backward makes them), the others add into them, as the step's later micro-batches do.

Beside: on a CPU, a plan's workers share the machine and slow each other down, so a stage of a
plan with several workers is timed while another process runs the neighbouring worker's stage
on another core (:mod:`autosplit.measure.contention`); one device is timed with the other cores idle.

In flight: a run given a depth d runs d forwards, then their d backwards in the same order, as a
GPipe stage runs its micro-batches (d = m), instead of one forward and its backward. With m
micro-batches' activations held, a stage runs slower than one micro-batch at a time: measured
on GPT small's second stage (b = 8, 8 in flight), 6.6 % (b = 16, 4 in flight: 1.3 %); on
ResNet50's stages at b = 12 (64×64, 4 in flight) within 0.5 % — under the allocator setting the
ranks run with (:mod:`autosplit.measure.allocator`). Times are per micro-batch, averaged over the d.

Split backward: a run wrapped in :class:`SplitBackward` runs each backward in two passes, as
torch's zero-bubble stages do (the input gradient, then the weight gradient:
:func:`~autosplit.measure.block_timing.timed_split_backward`); its backward time is the two passes
together and :attr:`StageTime.weight_share` the weight pass's share of it.

Checkpointed: a run wrapped in :class:`Checkpointed` runs under activation checkpointing, as a
checkpointed stage does (:mod:`autosplit.checkpointing`): its forward keeps only its inputs, its
backward runs the forward again first, and its backward time includes that recomputation.

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

from autosplit import checks
from autosplit.checkpointing import checkpointed
from autosplit.devices import resolve_device
from autosplit.errors import InvalidInputError
from autosplit.graph import BlockGraph, Segment
from autosplit.measure import block_timing, steal_time, timing_process
from autosplit.measure.budget import spread_settled
from autosplit.measure.contention import Neighbour
from autosplit.measure.contention import enabled as neighbour_enabled
from autosplit.measure.losses import timing_loss
from autosplit.measure.profiler import check_inputs, check_microbatch_sizes
from autosplit.measure.spread import relative_spread
from autosplit.verify.options import TimingOptions

__all__ = ["Beside", "Checkpointed", "Item", "SplitBackward", "StageRun", "StageTime", "as_beside",
           "time_stages", "wrapped"]

StageRun = tuple[int, int, int]
"""``(first, end, b)``: blocks ``first … end-1`` run together on a micro-batch of b."""

Beside = tuple[StageRun, "StageRun | None"]
"""A stage run and the run the neighbouring worker runs meanwhile (``None``: the other cores
idle); see :mod:`autosplit.measure.contention`."""


@dataclass(frozen=True, slots=True)
class SplitBackward:
    """A stage run (a bare :data:`StageRun` or a :data:`Beside`) timed with its backward in two
    passes, input gradient then weight gradient, as torch's zero-bubble schedules run it; a
    key of its own, apart from the same run timed with its backward whole."""

    item: StageRun | Beside


@dataclass(frozen=True, slots=True)
class Checkpointed:
    """A stage run (a bare :data:`StageRun`, a :data:`Beside` or a :class:`SplitBackward`)
    timed under activation checkpointing, as a checkpointed stage runs: its backward runs the
    forward again first; a key of its own, apart from the same run timed plainly."""

    item: StageRun | Beside | SplitBackward


Item = StageRun | Beside | SplitBackward | Checkpointed
"""What :func:`time_stages` times: a run, alone or beside another, maybe wrapped."""


def as_beside(item: Item) -> Beside:
    """``item`` as ``(run, beside)``: a bare run is timed alone."""
    if isinstance(item, SplitBackward | Checkpointed):
        return as_beside(item.item)
    if isinstance(item[0], tuple):
        return item  # type: ignore[return-value]
    return item, None  # type: ignore[return-value]


def wrapped(item: Item, kind: type) -> bool:
    """Whether ``item`` is wrapped in ``kind`` (:class:`SplitBackward`, :class:`Checkpointed`)."""
    while isinstance(item, SplitBackward | Checkpointed):
        if isinstance(item, kind):
            return True
        item = item.item
    return False


class _Recomputed(torch.nn.Module):
    """A stage module run under activation checkpointing (:func:`~autosplit.checkpointing.
    checkpointed`); its parameters are the module's own."""

    def __init__(self, module: torch.nn.Module) -> None:
        super().__init__()
        self.inner = module
        self.run = checkpointed(module, module)

    def forward(self, *args: Any) -> Any:
        return self.run(*args)


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
        beside: whether another process ran the neighbouring worker's run meanwhile
            (:data:`Beside`).
        set_aside: timed runs set aside because the hypervisor took more than its share of
            the CPUs meanwhile (:mod:`autosplit.measure.steal_time`; counted only where no other was left).
        weight_share: for a run timed with its backward split (:class:`SplitBackward`), the
            median share of the weight-gradient pass in the backward (fraction); ``None``:
            the backward ran whole.
    """

    forward_ms: float
    backward_ms: float
    spread: float
    rounds: int
    first_backward_ms: float | None = None
    beside: bool = False
    set_aside: int = 0
    weight_share: float | None = None

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

    def blend(self, beside: StageTime, share: float) -> StageTime:
        """This stage timed alone, with ``share`` (0 … 1) of its work run as timed ``beside``
        a neighbour instead: every time and the spread interpolated linearly."""
        share = min(max(share, 0.0), 1.0)

        def mix(a: float, b: float) -> float:
            return a + share * (b - a)

        first = (None if self.first_backward_ms is None or beside.first_backward_ms is None
                 else mix(self.first_backward_ms, beside.first_backward_ms))
        weight = (None if self.weight_share is None or beside.weight_share is None
                  else mix(self.weight_share, beside.weight_share))
        return StageTime(mix(self.forward_ms, beside.forward_ms),
                         mix(self.backward_ms, beside.backward_ms),
                         mix(self.spread, beside.spread), min(self.rounds, beside.rounds),
                         first, beside=beside.beside and share > 0,
                         set_aside=self.set_aside + beside.set_aside, weight_share=weight)


def time_stages(
    graph: BlockGraph,
    example_inputs: Any,
    runs: Sequence[Item],
    *,
    options: TimingOptions = TimingOptions(),
    progress: Callable[[int, int, str], None] | None = None,
    depths: Mapping[Any, int] | None = None,
    neighbour: Neighbour | None = None,
) -> dict[Any, StageTime]:
    """Time each stage run ``(first, end, b)``, taking turns round after round; the result is
    keyed by the items of ``runs``.

    An item ``(run, other)`` (:data:`Beside`) is timed while another process runs ``other``
    on another core (:class:`~autosplit.measure.contention.Neighbour`; on a CPU, unless
    ``AUTOSPLIT_TIME_ALONE=1``), as a plan's neighbouring worker does; a bare run, or
    ``(run, None)``, with the other cores idle. An item wrapped in :class:`SplitBackward` runs
    its backward in two passes, as zero-bubble schedules do, one wrapped in
    :class:`Checkpointed` under activation checkpointing (the neighbour's plainly).

    ``depths[item]``: how many micro-batches the run keeps in flight (d forwards, then their d
    backwards; 1, one forward and its backward, when not given); its times are per micro-batch.

    A run that ends with the model's last block is timed with ``options.loss`` after it
    (:mod:`autosplit.measure.losses`; ``None``: none), as the profile it checks was.

    ``neighbour``: a running :class:`~autosplit.measure.contention.Neighbour` of this process, started
    for every ``other`` of ``runs``, to time beside instead of starting one (several sessions
    then share one process: it is left idle, and the caller closes it); the stages are then
    timed in this process.

    Works on a private copy of the model (the model is left as it was); on a CPU, in a fresh
    process, as the ranks run (:mod:`autosplit.measure.timing_process`). The device, threads,
    rounds and budget are ``options`` (:class:`~autosplit.verify.options.TimingOptions`); every
    other round starts without gradients (see :meth:`StageTime.per_step`).

    Raises:
        InvalidInputError: a block range outside the model, a b above the example batch, a
            depth that is not a positive integer, a ``neighbour`` not started for every
            ``other`` run.
    """
    inputs = check_inputs(example_inputs)
    checks.instance_of("options", options, TimingOptions, "an autosplit TimingOptions")
    runs = list(dict.fromkeys(runs))
    depth = {r: checks.positive_int(f"depths[{r}]", (depths or {}).get(r, 1)) for r in runs}
    batch = int(inputs[0].shape[0])
    for item in runs:
        for first, end, b in filter(None, as_beside(item)):
            graph.extract(first, end)  # checks the range
            check_microbatch_sizes([b], batch, "b")
    if options.loss is None:
        options = dataclasses.replace(options, loss="none")
    if neighbour is not None:
        missing = {o for _, o in map(as_beside, runs) if o is not None} - set(neighbour.runs)
        if missing:
            raise InvalidInputError(f"neighbour: not started for the runs {sorted(missing)}")
        return _time_here(graph, inputs, runs, options, depth, progress=progress,
                          neighbour=neighbour)
    if resolve_device(options.device).type == "cpu" and timing_process.enabled():
        return timing_process.run_fresh(_time_here, graph, inputs, runs, options, depth,
                                       progress=progress)
    return _time_here(graph, inputs, runs, options, depth, progress=progress)


def _time_here(
    graph: BlockGraph,
    inputs: tuple[torch.Tensor, ...],
    runs: list[Item],
    options: TimingOptions,
    depths: Mapping[Any, int],
    *,
    progress: Callable[[int, int, str], None] | None,
    neighbour: Neighbour | None = None,
) -> dict[Any, StageTime]:
    """:func:`time_stages` in this process, on checked arguments (``neighbour``: a shared
    one, left idle at the end, else one started here for this session)."""
    loss, threads, warmup = options.loss, options.threads, options.warmup
    rounds, max_rounds, budget_s = options.rounds, options.max_rounds, options.budget_s
    assert loss is not None  # time_stages chose it
    loss_fn = timing_loss(loss)
    dev = resolve_device(options.device)
    start = time.perf_counter()
    old_threads = torch.get_num_threads()
    rng = [dev.index or 0] if dev.type == "cuda" else []
    jobs = {item: as_beside(item) for item in runs}
    own = list(dict.fromkeys(run for run, _ in jobs.values()))
    others = list(dict.fromkeys(o for _, o in jobs.values() if o is not None))
    fwd: dict[Any, list[float]] = {r: [] for r in runs}
    bwd: dict[Any, list[float]] = {r: [] for r in runs}
    first: dict[Any, list[float]] = {r: [] for r in runs}  # backwards into no gradient
    weight: dict[Any, list[float]] = {r: [] for r in runs}  # split: the weight pass's share
    sums: dict[tuple[Any, bool], list[float]] = {(r, new): [] for r in runs
                                                 for new in (True, False)}
    # per run: forward, backward, first backward, and the sums after an added and a new start
    timings = {r: (fwd[r], bwd[r], first[r], sums[r, False], sums[r, True]) for r in runs}
    spare: dict[Any, tuple[list[float], ...]] = {r: ([], [], [], [], []) for r in runs}
    set_aside = dict.fromkeys(runs, 0)  # timings the hypervisor disturbed (autosplit.measure.steal_time)
    alone: set[Any] = set()  # items meant to be timed beside another run, but not
    rounds = max(rounds, 2)  # both kinds of backward
    try:
        if dev.type == "cpu":
            torch.set_num_threads(threads)
        on_device = torch.cuda.device(dev) if dev.type == "cuda" else contextlib.nullcontext()
        with contextlib.ExitStack() as stack:
            stack.enter_context(torch.random.fork_rng(devices=rng))
            stack.enter_context(on_device)
            if neighbour is not None:  # shared: rests after this session
                stack.callback(neighbour.beside, None)
            else:
                neighbour = stack.enter_context(
                    Neighbour(graph, inputs, others, loss, threads)
                    if others and dev.type == "cpu" and neighbour_enabled()
                    else contextlib.nullcontext())  # type: ignore[arg-type]
            work = block_timing.private_copy(graph, dev)
            envs = {b: block_timing.stage_inputs(work, inputs, b, own, dev) for b in {r[2] for r in own}}
            segments = {r: work.extract(r[0], r[1]) for r in own}
            recomputed = {run: dataclasses.replace(segments[run], module=_Recomputed(
                segments[run].module)) for r, (run, _) in jobs.items()
                if wrapped(r, Checkpointed)}
            total = warmup + max(rounds, max_rounds)
            for k in range(total):
                if k >= warmup + rounds:
                    settled = all(spread_settled(x) for x in sums.values())
                    elapsed = time.perf_counter() - start
                    per_round = elapsed / k
                    if settled or (budget_s is not None and elapsed + per_round > budget_s):
                        break
                for j, r in enumerate(runs):  # A B A B …: every run once per round
                    run, other = jobs[r]
                    if neighbour is not None:
                        neighbour.beside(other)
                    if other is not None and (neighbour is None or not neighbour.running):
                        alone.add(r)  # (then timed with the other cores idle, at least once)
                    seg: Segment = segments[run]
                    fresh = (k + j) % 2 == 0  # every other round, the gradients start anew
                    for param in seg.module.parameters():
                        if fresh:
                            param.grad = None
                        elif param.grad is None:  # (another run's fresh start took it)
                            param.grad = torch.zeros_like(param)
                    args = block_timing.segment_args(work, envs[run[2]], seg)
                    last = loss_fn if run[1] == len(work.blocks) else None
                    window = steal_time.Window()
                    f_ms, b_ms, w_ms = _in_flight(
                        recomputed[run] if wrapped(r, Checkpointed) else seg, args, dev, last,
                        depths[r], wrapped(r, SplitBackward))
                    if k >= warmup:
                        kept = not window.disturbed()
                        if kept and w_ms and sum(b_ms) > 0:
                            weight[r].append(sum(w_ms) / sum(b_ms))
                        to = timings[r] if kept else spare[r]
                        set_aside[r] += not kept
                        to[0].append(statistics.fmean(f_ms))
                        if fresh:  # the first backward makes the gradients, the others add
                            to[2].append(b_ms[0])
                        if b_ms[fresh:]:
                            to[1].append(statistics.fmean(b_ms[fresh:]))
                        to[3 + fresh].append(statistics.fmean(f_ms) + statistics.fmean(b_ms))
                    if progress is not None:
                        progress(k * len(runs) + j + 1, total * len(runs), f"round {k + 1}")
    finally:
        torch.set_num_threads(old_threads)
    for r in runs:  # every timing set aside: those, rather than none
        if not fwd[r]:
            for kept, put_aside in zip(timings[r], spare[r]):
                kept.extend(put_aside)
    return {
        r: StageTime(statistics.median(fwd[r]), statistics.median(bwd[r] or first[r]),
                     max(relative_spread(sums[r, True]), relative_spread(sums[r, False])),
                     len(fwd[r]),
                     statistics.median(first[r] or bwd[r]),
                     beside=jobs[r][1] is not None and r not in alone,
                     set_aside=set_aside[r],
                     weight_share=statistics.median(weight[r]) if weight[r] else None)
        for r in runs
    }


def _in_flight(seg: Segment, args: Sequence[Any], dev: torch.device, loss: Any,
               depth: int, split: bool = False) -> tuple[list[float], list[float], list[float]]:
    """``depth`` forwards of ``seg`` on ``args``, then their backwards in the same order, as a
    GPipe stage runs its micro-batches: each one's forward and backward time, and with
    ``split`` (each backward in two passes: input gradient, then weight gradient) each one's
    weight pass, a part of its backward (ms; no weight times without ``split``)."""
    if depth == 1 and not split:
        _, f_ms, b_ms = block_timing.timed_run(seg, args, dev, loss=loss)
        return [f_ms], [b_ms], []
    held = [block_timing.timed_forward(seg, args, dev, loss=loss) for _ in range(depth)]
    if not split:
        return ([f_ms for *_, f_ms in held],
                [block_timing.timed_backward(outputs, value, needs, dev)
                 for outputs, value, needs, _ in held], [])
    passes = [block_timing.timed_split_backward(outputs, value, args, seg.module.parameters(), dev)
              if needs else (0.0, 0.0) for outputs, value, needs, _ in held]
    return [f_ms for *_, f_ms in held], [i + w for i, w in passes], [w for _, w in passes]
