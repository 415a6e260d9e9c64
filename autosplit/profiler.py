"""Measure each block of a model on one device: the numbers the planner works from.

For every micro-batch size b the profiler runs the model block by block on a private copy of
the model (so the caller's parameters, buffers, gradients, training flag and RNG state are left
exactly as they were) and records, per block: forward and backward time (median of ``repeats``
runs after ``warmup`` untimed runs), bytes kept for backward, output bytes and, on CUDA, peak
memory; per cut: the bytes of every tensor crossing it.

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
        warmup: untimed runs per block and size.
        repeats: timed runs per block and size; the median is kept.
        threads: intra-op threads of the CPU worker during measurement.
        budget_s: seconds after which no further default size is started (the first size is
            always measured; explicitly given sizes are all measured). ``None``: no limit.
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
    graph = trace(model, granularity=granularity, leaf_modules=leaf_modules, example_inputs=inputs)
    return profile_graph(
        graph,
        inputs,
        device=device,
        microbatch_sizes=microbatch_sizes,
        stages=stages,
        warmup=warmup,
        repeats=repeats,
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
    try:
        if dev.type == "cpu":
            torch.set_num_threads(threads)
        on_device = torch.cuda.device(dev) if dev.type == "cuda" else contextlib.nullcontext()
        with torch.random.fork_rng(devices=rng_devices), on_device:
            work = _private_copy(graph, dev)
            segments = [work.extract(i, i + 1) for i in range(len(work.blocks))]
            total = len(sizes) * len(segments)
            for k, b in enumerate(sizes):
                elapsed = time.perf_counter() - start
                if not explicit and k >= max(len(first), 1) and budget_s is not None and measured:
                    per_sample = elapsed / sum(measured)  # seconds per sample measured so far
                    if elapsed + per_sample * b > budget_s:
                        break
                mb = tuple(x[:b].to(dev).clone() for x in inputs)  # own storage: exact byte counts
                try:
                    measured[b] = _measure_size(
                        work, segments, mb, dev, warmup, repeats,
                        lambda i, b=b, k=k: progress and progress(
                            k * len(segments) + i + 1, total, f"{work.blocks[i].name} @ b={b}"
                        ),
                    )
                except Exception as exc:  # the user's model failed on this input
                    failures.append((b, exc))
                    if explicit:
                        break
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


class _SizeResult:
    def __init__(self, n: int, cuts: int) -> None:
        self.fwd_ms = [0.0] * n
        self.bwd_ms = [0.0] * n
        self.saved_bytes = [0] * n
        self.shared_bytes = [0] * n
        self.output_bytes = [0] * n
        self.peak_bytes = [0] * n
        self.cut_bytes = [0] * cuts


def _private_copy(graph: BlockGraph, dev: torch.device) -> BlockGraph:
    """A BlockGraph over a deep copy of the traced module, on ``dev``, in training mode."""
    module = copy.deepcopy(graph.module).to(dev)
    module.train(graph.module.training)
    for p in module.parameters():
        p.grad = None
    return BlockGraph(module, graph.blocks, graph.model_name, graph.traced)










def _measure_size(
    graph: BlockGraph,
    segments: Sequence[Segment],
    inputs: Sequence[torch.Tensor],
    dev: torch.device,
    warmup: int,
    repeats: int,
    done: Callable[[int], Any],
) -> _SizeResult:
    result = _SizeResult(len(segments), len(graph.cuts))
    env: dict[str, Any] = dict(zip(graph.inputs, inputs))
    cuda = dev.type == "cuda"
    param_storages = {
        p.untyped_storage().data_ptr() for p in graph.module.parameters()
    }
    saved_before: set[int] = set()  # storages saved by earlier blocks, recorded on run 0
    alive: list[torch.Tensor] = []  # keeps those storages alive so no address is reused
    for i, seg in enumerate(segments):
        fwd, bwd = [], []
        peak = 0
        storages: dict[int, int] = {}
        kept: tuple[Any, ...] = ()

        def pack(t: torch.Tensor) -> torch.Tensor:
            ptr = t.untyped_storage().data_ptr()
            if ptr not in param_storages:
                storages[ptr] = t.untyped_storage().nbytes()
                alive.append(t)
            return t

        for run in range(warmup + repeats):
            args = fresh_leaves(
                [env[name] for name in seg.inputs], [name not in graph.inputs for name in seg.inputs]
            )
            if cuda:
                torch.cuda.synchronize(dev)
                base = torch.cuda.memory_allocated(dev)
                torch.cuda.reset_peak_memory_stats(dev)
            # run 0 counts the tensors saved for backward; its outputs feed the next block, so
            # storages shared across blocks are recognised by address while they are alive
            hooks = (
                torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
                if run == 0 else contextlib.nullcontext()
            )
            with hooks:
                t0 = _clock(dev)
                outputs = seg.module(*args)
                t1 = _clock(dev)
            if run == 0:
                kept = outputs
            grads_for = [t for t in tensor_leaves(outputs) if t.requires_grad]
            t2 = _clock(dev)
            if grads_for:
                torch.autograd.backward(grads_for, [torch.ones_like(t) for t in grads_for])
            t3 = _clock(dev)
            if cuda:
                peak = max(peak, torch.cuda.max_memory_allocated(dev) - base)
            if run >= warmup:
                fwd.append(_elapsed_ms(t0, t1, dev))
                bwd.append(_elapsed_ms(t2, t3, dev) if grads_for else 0.0)
        inputs_here = {
            v.untyped_storage().data_ptr()
            for v in (env[name] for name in seg.inputs) if isinstance(v, torch.Tensor)
        }
        shared = sum(n for ptr, n in storages.items() if ptr in inputs_here and ptr in saved_before)
        saved_before.update(storages)
        result.fwd_ms[i] = statistics.median(fwd)
        result.bwd_ms[i] = statistics.median(bwd)
        result.saved_bytes[i] = sum(storages.values()) - shared
        result.shared_bytes[i] = shared
        result.output_bytes[i] = nbytes(kept)
        result.peak_bytes[i] = int(peak)
        for name, value in zip(seg.outputs, kept):
            env[name] = value.detach() if isinstance(value, torch.Tensor) else value
        done(i)
    for cut in graph.cuts:
        result.cut_bytes[cut.index] = sum(nbytes(env[name]) for name in cut.tensors)
    return result


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
