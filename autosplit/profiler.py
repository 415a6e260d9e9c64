"""Measure each block of a model on one device: the numbers the planner works from.

The profiler runs the model block by block on a private copy of the model (so the caller's
parameters, buffers, gradients, training flag and RNG state are left exactly as they were) and
records, per block and micro-batch size b: forward and backward time (median of the timed runs
after ``warmup`` untimed ones, with its interquartile range), bytes kept for backward, output
bytes and, on CUDA, peak memory; per cut: the bytes of every tensor crossing it.

Against drift, the sizes of a block are measured interleaved: round after round, each size
runs once per round (the order rotating), so a machine that slows down meanwhile slows every
size alike. Before any timed run the whole model runs once, untimed, so that no size is the
first to touch the weights, the allocator and the kernels. Rounds go on past ``repeats`` while
a figure's interquartile range exceeds 5 % of its median, up to ``max_repeats`` and within the
time budget.

On CUDA the timings use CUDA events. On CPU a device is one worker with
``torch.set_num_threads(threads)`` (1 by default), and the Profile says so.
"""

from __future__ import annotations

import contextlib
import copy
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from autosplit.devices import describe_device, resolve_device
from autosplit import checks
from autosplit.errors import ArgumentTypeError, InvalidInputError
from autosplit.graph import BlockGraph, Granularity, Segment, trace
from autosplit.records import BlockProfile, CutProfile, Profile
from autosplit.tensors import fresh_leaves, nbytes, tensor_leaves

__all__ = [
    "profile",
    "profile_graph",
    "default_microbatch_sizes",
    "check_microbatch_sizes",
    "check_inputs",
    "Progress",
]

Progress = Callable[[int, int, str], None]
"""``progress(done, total, what)``: called after each block measurement."""


def check_inputs(example_inputs: Any) -> tuple[torch.Tensor, ...]:
    """Normalise example inputs to a non-empty tuple of tensors sharing dimension 0 (the batch).

    Raises:
        ArgumentTypeError: an input is not a tensor.
        InvalidInputError: no input, an input is 0-dimensional, or batch sizes differ.
    """
    if isinstance(example_inputs, torch.Tensor):
        example_inputs = (example_inputs,)
    if not isinstance(example_inputs, (tuple, list)):
        raise ArgumentTypeError(
            "example_inputs must be a tensor or a non-empty tuple of tensors, got "
            f"{type(example_inputs).__name__}"
        )
    if not example_inputs:
        raise InvalidInputError(
            "example_inputs is empty: give a tensor or a non-empty tuple of tensors"
        )
    for i, x in enumerate(example_inputs):
        if not isinstance(x, torch.Tensor):
            raise ArgumentTypeError(
                f"example input {i} is a {type(x).__name__}, not a tensor: pass tensors only "
                "(bind other arguments with functools.partial or a wrapper module)"
            )
        if x.dim() == 0:
            raise InvalidInputError(
                f"example input {i} is a 0-dimensional tensor; inputs need a batch dimension 0"
            )
    sizes = [int(x.shape[0]) for x in example_inputs]
    if len(set(sizes)) != 1:
        raise InvalidInputError(
            f"example inputs disagree on the batch size (dimension 0): {sizes}; "
            "every input must be split along the same batch"
        )
    if sizes[0] < 1:
        raise InvalidInputError("example inputs have an empty batch (dimension 0 is 0)")
    return tuple(example_inputs)


def check_microbatch_sizes(
    sizes: Sequence[int], batch: int, name: str = "microbatch_sizes", allow_empty: bool = False
) -> list[int]:
    """Micro-batch sizes as a list, each an integer in 1 … B and none repeated.

    Raises:
        ArgumentTypeError: ``sizes`` is not a list of ints.
        InvalidInputError: naming the bad size and the batch size.
    """
    sizes = list(checks.sequence_of(name, sizes, checks.integer, allow_empty=allow_empty))
    for b in sizes:
        if not 1 <= b <= batch:
            raise InvalidInputError(
                f"{name}: micro-batch size {b!r} must be an integer between 1 and the batch "
                f"size {batch}"
            )
    if len(set(sizes)) != len(sizes):
        raise InvalidInputError(f"micro-batch sizes repeat: {sizes}")
    return sizes


def default_microbatch_sizes(batch_size: int, stages: int = 2, max_count: int = 8) -> list[int]:
    """The micro-batch sizes worth measuring for a batch of B on p stages, most useful first.

    Sizes b that split B into m whole micro-batches, for m from 1 up to
    ``max(max_count, 4·p)``, ordered by how near m is to 3·p (enough micro-batches to hide the
    pipeline bubble, not so many that each is small and slow). The profiler measures them in
    this order until its time budget is spent.
    """
    batch_size = checks.positive_int("batch_size", batch_size)
    stages = checks.positive_int("stages", stages)
    max_count = checks.positive_int("max_count", max_count)
    top = max(max_count, 4 * stages)
    ms = [m for m in range(1, min(top, batch_size) + 1) if batch_size % m == 0]
    ms.sort(key=lambda m: (abs(m - 3 * stages), -m))
    return [batch_size // m for m in ms]


def _check_options(
    stages: int, warmup: int, repeats: int, threads: int, budget_s: float | None,
    progress: Progress | None,
) -> None:
    checks.positive_int("stages", stages)
    checks.non_negative_int("warmup", warmup)
    checks.positive_int("repeats", repeats)
    checks.positive_int("threads", threads)
    checks.optional(checks.non_negative_finite, "budget_s", budget_s, "s")
    if progress is not None and not callable(progress):
        raise ArgumentTypeError(f"progress must be a function or None, got {checks.show(progress)}")


def profile(
    model: nn.Module,
    example_inputs: Any,
    *,
    device: str | torch.device | None = None,
    microbatch_sizes: Sequence[int] | None = None,
    stages: int = 2,
    warmup: int = 1,
    repeats: int = 3,
    max_repeats: int | None = None,
    threads: int = 1,
    budget_s: float | None = 40.0,
    include: Sequence[int] = (),
    granularity: Granularity = "block",
    leaf_modules: Sequence[type[nn.Module] | str] = (),
    progress: Progress | None = None,
) -> Profile:
    """Profile ``model`` block by block; the model itself is left untouched.

    Args:
        model: the model (its parameters, buffers, ``.grad`` and training flag are kept).
        example_inputs: a tensor or tuple of tensors; dimension 0 is the batch (B).
        device: where to measure; default the first CUDA device, else the CPU.
        microbatch_sizes: sizes b to measure; default :func:`default_microbatch_sizes`.
        stages: the number of stages planned for (only used to choose default sizes).
        warmup: untimed runs per block and size (after one untimed run of the whole model).
        repeats: the least number of timed runs per block and size; the median is kept.
        max_repeats: the most (default ``3 * repeats``): rounds go on while a figure's
            interquartile range is above 5 % of its median and the budget allows.
        threads: intra-op threads of the CPU worker during measurement.
        budget_s: time budget (s): default sizes are kept, in order, while their measurement
            (estimated from the untimed run of the whole model) fits in it, and extra rounds
            past ``repeats`` stop when it is spent. The first size is always measured;
            explicitly given sizes are all measured. ``None``: no limit.
        include: sizes to measure first, whatever the budget (e.g. a hand-written split's).
        granularity: see :func:`autosplit.graph.trace`.
        leaf_modules: see :func:`autosplit.graph.trace`.
        progress: ``progress(done, total, what)`` after each measurement.

    Raises:
        ArgumentTypeError: an argument of the wrong type (a model that is not an ``nn.Module``,
            an input that is not a tensor, ``repeats=2.0``, ``device=0``, …).
        InvalidInputError: a bad value (``repeats=0``, ``budget_s=nan``, a micro-batch size
            above the batch, an unknown device), or the model fails on a micro-batch.
        TraceError: the model cannot be traced.
    """
    inputs = check_inputs(example_inputs)
    _check_options(stages, warmup, repeats, threads, budget_s, progress)
    checks.optional(checks.positive_int, "max_repeats", max_repeats)
    graph = trace(model, granularity=granularity, leaf_modules=leaf_modules, example_inputs=inputs)
    return profile_graph(
        graph,
        inputs,
        device=device,
        microbatch_sizes=microbatch_sizes,
        stages=stages,
        warmup=warmup,
        repeats=repeats,
        max_repeats=max_repeats,
        threads=threads,
        budget_s=budget_s,
        include=include,
        progress=progress,
    )


def profile_graph(
    graph: BlockGraph,
    example_inputs: Sequence[torch.Tensor],
    *,
    device: str | torch.device | None = None,
    microbatch_sizes: Sequence[int] | None = None,
    stages: int = 2,
    warmup: int = 1,
    repeats: int = 3,
    max_repeats: int | None = None,
    threads: int = 1,
    budget_s: float | None = 40.0,
    include: Sequence[int] = (),
    progress: Progress | None = None,
) -> Profile:
    """Profile an already traced model (see :func:`profile` for the arguments)."""
    checks.instance_of("graph", graph, BlockGraph, "a BlockGraph (autosplit.trace(model))")
    inputs = check_inputs(example_inputs)
    batch = int(inputs[0].shape[0])
    _check_options(stages, warmup, repeats, threads, budget_s, progress)
    checks.optional(checks.positive_int, "max_repeats", max_repeats)
    explicit = microbatch_sizes is not None
    if explicit:
        sizes = check_microbatch_sizes(microbatch_sizes, batch)
    else:
        sizes = default_microbatch_sizes(batch, stages)
    first = check_microbatch_sizes(include, batch, "include", allow_empty=True)
    sizes = list(dict.fromkeys([*first, *sizes]))

    dev = resolve_device(device)
    start = time.perf_counter()
    old_threads = torch.get_num_threads()
    rng_devices = [dev.index or 0] if dev.type == "cuda" else []
    measured: dict[int, _SizeResult] = {}
    failures: list[tuple[int, Exception]] = []
    cap = max(max_repeats if max_repeats is not None else 3 * repeats, repeats)
    try:
        if dev.type == "cpu":
            torch.set_num_threads(threads)
        on_device = torch.cuda.device(dev) if dev.type == "cuda" else contextlib.nullcontext()
        with torch.random.fork_rng(devices=rng_devices), on_device:
            work = private_copy(graph, dev)
            segments = [work.extract(i, i + 1) for i in range(len(work.blocks))]
            states: dict[int, _SizeState] = {}
            for b in sizes:  # the model runs once, untimed, at the first size that works
                try:
                    states[b] = _SizeState(work, inputs, b, dev)
                    estimate_ms = _warm_up(work, segments, states[b], dev)
                    break
                except Exception as exc:  # the user's model failed on this input
                    states.pop(b, None)
                    failures.append((b, exc))
                    if explicit:
                        break
            if states:
                b0 = next(iter(states))
                chosen = _within_budget(
                    [b for b in sizes if b not in dict(failures)], b0, estimate_ms,
                    warmup + repeats, time.perf_counter() - start,
                    None if explicit else budget_s, max(len(first), 1),
                )
                states = {b: states.get(b) or _SizeState(work, inputs, b, dev) for b in chosen}
                measured = _measure_interleaved(
                    work, segments, states, dev, warmup, repeats, cap, failures, explicit,
                    _Deadline(start, budget_s, estimate_ms, {b: b / b0 for b in chosen},
                              warmup + repeats),
                    progress,
                )
    finally:
        torch.set_num_threads(old_threads)
    if failures and (explicit or not measured):
        b, error = failures[0]
        shapes = ", ".join(str(tuple(x.shape)) for x in inputs)
        message = str(error).strip().splitlines()[0] if str(error).strip() else ""
        raise InvalidInputError(
            f"{graph.model_name} fails on a micro-batch of {b} cut from example inputs of shape "
            f"{shapes}: {type(error).__name__}: {message}. Check the example inputs' shapes and "
            "dtypes, and the micro-batch sizes"
        ) from error

    order = sorted(measured)
    blocks = []
    for i, block in enumerate(graph.blocks):
        params = {name for name, _ in block.params}
        module_params = dict(graph.module.named_parameters())
        buffers = graph.buffer_bytes(i)
        blocks.append(
            BlockProfile(
                name=block.name,
                param_bytes=sum(
                    module_params[p].numel() * module_params[p].element_size()
                    for p in params if p in module_params
                ),
                buffer_bytes=buffers,
                fwd_ms=tuple(measured[b].fwd_ms[i] for b in order),
                bwd_ms=tuple(measured[b].bwd_ms[i] for b in order),
                saved_bytes=tuple(measured[b].saved_bytes[i] for b in order),
                saved_shared_bytes=tuple(measured[b].shared_bytes[i] for b in order),
                output_bytes=tuple(measured[b].output_bytes[i] for b in order),
                peak_bytes=tuple(measured[b].peak_bytes[i] for b in order)
                if dev.type == "cuda" else None,
                fwd_iqr_ms=tuple(measured[b].fwd_iqr_ms[i] for b in order),
                bwd_iqr_ms=tuple(measured[b].bwd_iqr_ms[i] for b in order),
            )
        )
    cuts = tuple(
        CutProfile(cut.index, cut.tensors, tuple(measured[b].cut_bytes[cut.index] for b in order))
        for cut in graph.cuts
    )
    return Profile(
        model=graph.model_name,
        fingerprint=graph.fingerprint,
        blocks=tuple(blocks),
        cuts=cuts,
        microbatch_sizes=tuple(order),
        batch_size=batch,
        input_shapes=tuple(tuple(x.shape) for x in inputs),
        input_dtypes=tuple(str(x.dtype) for x in inputs),
        device=describe_device(dev, threads),
        torch_version=torch.__version__,
        source="measured",
        warmup=warmup,
        repeats=repeats,
        seconds=round(time.perf_counter() - start, 3),
        shared=graph.shared_params,
    )


# ----------------------------------------------------------------------------------- internals


SPREAD_TOLERANCE = 0.05
"""Repeats go on (up to the cap) while a figure's interquartile range exceeds this share of its
median (or 0.01 ms, for tiny blocks)."""


class _SizeResult:
    def __init__(self, n: int, cuts: int) -> None:
        self.fwd_ms = [0.0] * n
        self.bwd_ms = [0.0] * n
        self.fwd_iqr_ms = [0.0] * n
        self.bwd_iqr_ms = [0.0] * n
        self.saved_bytes = [0] * n
        self.shared_bytes = [0] * n
        self.output_bytes = [0] * n
        self.peak_bytes = [0] * n
        self.cut_bytes = [0] * cuts


class _SizeState:
    """What the measurement of one micro-batch size carries from block to block: the values
    later blocks read, and the storages already saved for backward (kept alive, so that no
    address is reused while it may still be compared)."""

    def __init__(self, graph: BlockGraph, inputs: Sequence[torch.Tensor], b: int,
                 dev: torch.device) -> None:
        mb = tuple(x[:b].to(dev).clone() for x in inputs)  # own storage: exact byte counts
        self.b = b
        self.env: dict[str, Any] = dict(zip(graph.inputs, mb))
        self.result = _SizeResult(len(graph.blocks), len(graph.cuts))
        self.saved_before: dict[int, torch.Tensor] = {}

    def args(self, graph: BlockGraph, seg: Segment) -> list[Any]:
        return segment_args(graph, self.env, seg)

    def advance(self, graph: BlockGraph, seg: Segment, outputs: Any) -> None:
        """Keep block ``seg``'s outputs and forget what no later block reads."""
        for name, value in zip(seg.outputs, outputs):
            self.env[name] = value.detach() if isinstance(value, torch.Tensor) else value
        i = seg.first
        if i < len(graph.cuts):
            keep = set(graph.cuts[i].tensors) | set(graph.inputs)
            self.result.cut_bytes[i] = sum(nbytes(self.env[n]) for n in graph.cuts[i].tensors)
            self.env = {k: v for k, v in self.env.items() if k in keep}
            live = {_storage(v) for v in self.env.values() if isinstance(v, torch.Tensor)}
            self.saved_before = {k: t for k, t in self.saved_before.items() if k in live}


def segment_args(graph: BlockGraph, env: dict[str, Any], seg: Segment) -> list[Any]:
    """The inputs of ``seg`` from ``env`` as fresh leaves: received activations require grad,
    the model's own inputs do not."""
    return fresh_leaves(
        [env[name] for name in seg.inputs], [name not in graph.inputs for name in seg.inputs]
    )


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def private_copy(graph: BlockGraph, dev: torch.device) -> BlockGraph:
    """A BlockGraph over a deep copy of the traced module, on ``dev``, in training mode."""
    module = copy.deepcopy(graph.module).to(dev)
    module.train(graph.module.training)
    for p in module.parameters():
        p.grad = None
    return BlockGraph(module, graph.blocks, graph.model_name, graph.traced)


def _wall(dev: torch.device) -> float:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    return time.perf_counter()


def timed_run(seg: Segment, args: Sequence[Any], dev: torch.device,
         hooks: Any = None) -> tuple[Any, float, float]:
    """Forward and backward of one block: (outputs, forward ms, backward ms)."""
    with hooks or contextlib.nullcontext():
        t0 = _clock(dev)
        outputs = seg.module(*args)
        t1 = _clock(dev)
    grads_for = [t for t in tensor_leaves(outputs) if t.requires_grad]
    t2 = _clock(dev)
    if grads_for:
        torch.autograd.backward(grads_for, [torch.ones_like(t) for t in grads_for])
    t3 = _clock(dev)
    return outputs, _elapsed_ms(t0, t1, dev), _elapsed_ms(t2, t3, dev) if grads_for else 0.0


def _warm_up(graph: BlockGraph, segments: Sequence[Segment], state: _SizeState,
             dev: torch.device) -> list[float]:
    """Run the whole model once, block by block, untimed (so that no size measured later is
    the first to touch weights, allocator and kernels); returns each block's rough wall time
    (ms, forward + backward) at this size, for the budget."""
    env = dict(state.env)
    estimate = []
    for seg in segments:
        args = segment_args(graph, env, seg)
        t0 = _wall(dev)
        outputs = seg.module(*args)
        grads_for = [t for t in tensor_leaves(outputs) if t.requires_grad]
        if grads_for:
            torch.autograd.backward(grads_for, [torch.ones_like(t) for t in grads_for])
        estimate.append((_wall(dev) - t0) * 1000.0)
        env.update(zip(seg.outputs, (o.detach() if isinstance(o, torch.Tensor) else o
                                     for o in outputs)))
    for p in graph.module.parameters():
        p.grad = None
    return estimate


def _within_budget(sizes: Sequence[int], b0: int, estimate_ms: Sequence[float], runs: int,
                   elapsed_s: float, budget_s: float | None, always: int) -> list[int]:
    """The sizes, in order of preference, whose estimated measurement fits the budget (the
    first ``always`` are kept whatever it costs). Cost scales with b from the warm-up's."""
    if budget_s is None:
        return list(sizes)
    per_sample_s = sum(estimate_ms) / 1000.0 / b0 * runs
    chosen, total = [], elapsed_s
    for k, b in enumerate(sizes):
        if k >= always and total + per_sample_s * b > budget_s:
            break
        chosen.append(b)
        total += per_sample_s * b
    return chosen


class _Deadline:
    """Whether one more round of repeats still fits the time budget, leaving the estimated
    time of the blocks not yet measured."""

    def __init__(self, start: float, budget_s: float | None, estimate_ms: Sequence[float],
                 scale: dict[int, float], runs: int) -> None:
        self.start, self.budget_s = start, budget_s
        per_block = [e / 1000.0 * sum(scale.values()) * runs for e in estimate_ms]
        self.rest_s = [sum(per_block[i + 1:]) for i in range(len(per_block))]

    def allows(self, block: int, round_s: float) -> bool:
        if self.budget_s is None:
            return True
        elapsed = time.perf_counter() - self.start
        return elapsed + round_s + self.rest_s[block] <= self.budget_s


def spread_settled(values: Sequence[float]) -> bool:
    """At least 3 values whose interquartile range is within :data:`SPREAD_TOLERANCE` of
    their median (or 0.01 ms)."""
    if len(values) < 3:
        return False
    q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q3 - q1 <= max(SPREAD_TOLERANCE * statistics.median(values), 0.01)


def _iqr(values: Sequence[float]) -> float:
    if len(values) < 2:
        return 0.0
    q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q3 - q1


def _measure_interleaved(
    graph: BlockGraph,
    segments: Sequence[Segment],
    states: dict[int, _SizeState],
    dev: torch.device,
    warmup: int,
    repeats: int,
    cap: int,
    failures: list[tuple[int, Exception]],
    explicit: bool,
    deadline: _Deadline,
    progress: Progress | None,
) -> dict[int, _SizeResult]:
    """Measure every block at every size, block after block; within a block the sizes take
    turns, round after round (the order rotates each round), so that a machine slowing down
    or speeding up meanwhile shifts every size alike instead of one size against another."""
    cuda = dev.type == "cuda"
    params = {_storage(p) for p in graph.module.parameters()}
    total = len(states) * len(segments)
    for i, seg in enumerate(segments):
        fwd: dict[int, list[float]] = {b: [] for b in states}
        bwd: dict[int, list[float]] = {b: [] for b in states}
        saved: dict[int, dict[int, torch.Tensor]] = {b: {} for b in states}
        kept: dict[int, Any] = {}
        peak = dict.fromkeys(states, 0)
        run, round_s = 0, 0.0
        while states:
            if run >= warmup + repeats:
                done = all(spread_settled(fwd[b]) and spread_settled(bwd[b]) for b in states)
                if done or run >= warmup + cap or not deadline.allows(i, round_s):
                    break
            round_start = time.perf_counter()
            order = list(states)
            order = order[run % len(order):] + order[:run % len(order)]
            for b in order:
                state = states[b]
                store = saved[b]

                def pack(t: torch.Tensor, store: dict[int, torch.Tensor] = store) -> torch.Tensor:
                    if _storage(t) not in params:
                        store[_storage(t)] = t
                    return t

                hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t) \
                    if run == 0 else None
                try:
                    if cuda:
                        torch.cuda.synchronize(dev)
                        base = torch.cuda.memory_allocated(dev)
                        torch.cuda.reset_peak_memory_stats(dev)
                    outputs, f_ms, b_ms = timed_run(seg, state.args(graph, seg), dev, hooks)
                except Exception as exc:  # the user's model failed on this input
                    failures.append((b, exc))
                    del states[b]
                    if explicit:
                        return {}
                    continue
                if cuda:
                    peak[b] = max(peak[b], torch.cuda.max_memory_allocated(dev) - base)
                if run == 0:
                    kept[b] = outputs
                if run >= warmup:
                    fwd[b].append(f_ms)
                    bwd[b].append(b_ms)
            round_s = time.perf_counter() - round_start
            run += 1
        for k, (b, state) in enumerate(states.items()):
            res = state.result
            inputs_here = {
                _storage(v) for v in (state.env[n] for n in seg.inputs)
                if isinstance(v, torch.Tensor)
            }
            storages = {ptr: t.untyped_storage().nbytes() for ptr, t in saved[b].items()}
            shared = sum(n for ptr, n in storages.items()
                         if ptr in inputs_here and ptr in state.saved_before)
            state.saved_before.update(saved[b])
            res.fwd_ms[i] = statistics.median(fwd[b])
            res.bwd_ms[i] = statistics.median(bwd[b])
            res.fwd_iqr_ms[i] = _iqr(fwd[b])
            res.bwd_iqr_ms[i] = _iqr(bwd[b])
            res.saved_bytes[i] = sum(storages.values()) - shared
            res.shared_bytes[i] = shared
            res.output_bytes[i] = nbytes(kept[b])
            res.peak_bytes[i] = int(peak[b])
            state.advance(graph, seg, kept[b])
            if progress is not None:
                progress(i * len(states) + k + 1, total,
                         f"{graph.blocks[i].name} @ b={b}")
    return {b: state.result for b, state in states.items()}


def _clock(dev: torch.device) -> Any:
    if dev.type == "cuda":
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event
    return time.perf_counter()


def _elapsed_ms(start: Any, end: Any, dev: torch.device) -> float:
    if dev.type == "cuda":
        end.synchronize()
        return float(start.elapsed_time(end))
    return (end - start) * 1000.0
