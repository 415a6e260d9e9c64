"""Measure each block of a model on one device: the numbers the planner works from.

The profiler runs the model block by block on a private copy of the model (so the caller's
parameters, buffers, gradients, training flag and RNG state are left exactly as they were) and
records, per block and micro-batch size b: forward and backward time (median of the timed runs
after ``warmup`` untimed ones, with its interquartile range), bytes kept for backward, output
bytes and the peak of memory while it runs (with its gradients held); per cut: the bytes of
every tensor crossing it.

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
import dataclasses
import time
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from autosplit import checks
from autosplit.capture.signature import call_arguments
from autosplit.capture.trace import trace
from autosplit.devices import describe_device, resolve_device
from autosplit.errors import ArgumentTypeError, InvalidInputError
from autosplit.fsdp_units import shardable
from autosplit.graph import BlockGraph, Granularity
from autosplit.measure import timing_process
from autosplit.measure.block_timing import (
    Progress,
    RoundOptions,
    SizeResult,
    SizeState,
    measure_interleaved,
    private_copy,
    warm_up,
)
from autosplit.measure.budget import (
    Deadline,
    bracketing_count,
    default_microbatch_sizes,
    within_budget,
)
from autosplit.measure.losses import default_loss, timing_loss
from autosplit.measure.options import ProfileOptions
from autosplit.measure.update_timing import time_updates
from autosplit.records import BlockProfile, CutProfile, Profile

__all__ = [
    "profile",
    "profile_graph",
    "default_microbatch_sizes",
    "check_microbatch_sizes",
    "check_inputs",
    "Progress",
    "ProfileOptions",
]


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


def profile(
    model: nn.Module,
    example_inputs: Any,
    example_kwargs: dict[str, Any] | None = None,
    *,
    device: str | torch.device | None = None,
    options: ProfileOptions = ProfileOptions(),
    granularity: Granularity = "block",
    leaf_modules: Sequence[type[nn.Module] | str] = (),
    progress: Progress | None = None,
) -> Profile:
    """Profile ``model`` block by block; the model itself is left untouched.

    Args:
        model: the model (its parameters, buffers, ``.grad`` and training flag are kept).
        example_inputs: a tensor or tuple of tensors; dimension 0 is the batch (B).
        example_kwargs: keyword inputs of the example call (``{"labels": ids}``).
        device: where to measure; default the first CUDA device, else the CPU.
        options: the sizes, rounds, threads, budget and loss (:class:`ProfileOptions`).
        granularity: see :func:`autosplit.capture.trace.trace`.
        leaf_modules: see :func:`autosplit.capture.trace.trace`.
        progress: ``progress(done, total, what)`` after each measurement.

    Raises:
        ArgumentTypeError: an argument of the wrong type (a model that is not an ``nn.Module``,
            an input that is not a tensor, ``repeats=2.0``, ``device=0``, …).
        InvalidInputError: a bad value (``repeats=0``, ``budget_s=nan``, a micro-batch size
            above the batch, an unknown device), or the model fails on a micro-batch.
        TraceError: the model cannot be traced.
    """
    args, kwargs = call_arguments(example_inputs, example_kwargs)
    if not kwargs:
        args = check_inputs(args)
    _check_record(options, progress)
    graph = trace(model, granularity=granularity, leaf_modules=leaf_modules, example_inputs=args,
                  example_kwargs=kwargs)
    return profile_graph(
        graph,
        check_inputs(graph.signature.flatten(args, kwargs, graph.model_name)),
        device=device,
        options=options,
        progress=progress,
    )


def profile_graph(
    graph: BlockGraph,
    example_inputs: Sequence[torch.Tensor],
    *,
    device: str | torch.device | None = None,
    options: ProfileOptions = ProfileOptions(),
    progress: Progress | None = None,
) -> Profile:
    """Profile an already traced model (see :func:`profile` for the arguments).

    On a CPU the blocks are timed in a fresh process, as the ranks run
    (:mod:`autosplit.measure.timing_process`)."""
    checks.instance_of("graph", graph, BlockGraph, "a BlockGraph (autosplit.trace(model))")
    inputs = check_inputs(example_inputs)
    _check_record(options, progress)
    batch = int(inputs[0].shape[0])  # the cheap checks here, before a process starts
    loss = options.loss if options.loss is not None else default_loss(graph.returns_loss)
    if loss == "model" and not graph.returns_loss:
        raise InvalidInputError(
            f"loss='model', but {graph.model_name} returns no loss (a 0-dimensional floating "
            "tensor): give it its labels (a Hugging Face model computes its loss when called "
            "with labels=), or loss='mse'")
    if options.microbatch_sizes is not None:
        check_microbatch_sizes(options.microbatch_sizes, batch)
    check_microbatch_sizes(options.include, batch, "include", allow_empty=True)
    options = dataclasses.replace(options, loss=loss)
    if resolve_device(device).type == "cpu" and timing_process.enabled():
        return timing_process.run_fresh(_profile_here, graph, inputs, device, options,
                                       progress=progress)
    return _profile_here(graph, inputs, device, options, progress=progress)


def _check_record(options: ProfileOptions, progress: Progress | None) -> None:
    checks.instance_of("options", options, ProfileOptions, "an autosplit.ProfileOptions")
    if progress is not None and not callable(progress):
        raise ArgumentTypeError(f"progress must be a function or None, got {checks.show(progress)}")


def _profile_here(
    graph: BlockGraph,
    inputs: tuple[torch.Tensor, ...],
    device: str | torch.device | None,
    options: ProfileOptions,
    *,
    progress: Progress | None,
) -> Profile:
    """:func:`profile_graph` in this process, on checked arguments."""
    batch = int(inputs[0].shape[0])
    loss = options.loss
    assert loss is not None  # profile_graph chose it
    warmup, repeats, threads, budget_s = (options.warmup, options.repeats, options.threads,
                                          options.budget_s)
    loss_fn = timing_loss(loss)
    explicit = options.microbatch_sizes is not None
    if options.microbatch_sizes is not None:
        sizes = check_microbatch_sizes(options.microbatch_sizes, batch)
    else:
        sizes = default_microbatch_sizes(batch, options.stages)
    first = check_microbatch_sizes(options.include, batch, "include", allow_empty=True)
    sizes = list(dict.fromkeys([*first, *sizes]))

    dev = resolve_device(device)
    start = time.perf_counter()
    old_threads = torch.get_num_threads()
    rng_devices = [dev.index or 0] if dev.type == "cuda" else []
    measured: dict[int, SizeResult] = {}
    updates: tuple[tuple[tuple[str, float], ...], ...] = ()
    failures: list[tuple[int, Exception]] = []
    set_aside: list[int] = []  # a block's index per timed round the hypervisor disturbed
    cap = options.most_repeats
    try:
        if dev.type == "cpu":
            torch.set_num_threads(threads)
        on_device = torch.cuda.device(dev) if dev.type == "cuda" else contextlib.nullcontext()
        with torch.random.fork_rng(devices=rng_devices), on_device:
            work = private_copy(graph, dev)
            segments = [work.extract(i, i + 1) for i in range(len(work.blocks))]
            states: dict[int, SizeState] = {}
            for b in sizes:  # the model runs once, untimed, at the first size that works
                try:
                    states[b] = SizeState(work, inputs, b, dev)
                    estimate_ms = warm_up(work, segments, states[b], dev, loss_fn)
                    break
                except Exception as exc:  # noqa: BLE001 - the user's model failed on this input
                    states.pop(b, None)
                    failures.append((b, exc))
                    if explicit:
                        break
            if states:
                b0 = next(iter(states))
                chosen = within_budget(
                    [b for b in sizes if b not in dict(failures)], b0, estimate_ms,
                    warmup + repeats, time.perf_counter() - start,
                    None if explicit else budget_s,
                    max(len(first), bracketing_count(sizes, batch, options.stages)),
                )
                states = {b: states.get(b) or SizeState(work, inputs, b, dev) for b in chosen}
                counted = measure_interleaved(
                    work, segments, states, dev,
                    RoundOptions(warmup, repeats, cap, explicit,
                                 split_at=b0 if b0 in chosen else chosen[0]),
                    Deadline(start, budget_s, estimate_ms, {b: b / b0 for b in chosen},
                             warmup + repeats),
                    progress, loss=loss_fn,
                )
                measured, set_aside = counted.measured, list(counted.set_aside)
                failures += counted.failures
                own = dict(work.module.named_parameters())
                updates = time_updates(
                    [[own[name] for name, _ in block.params if name in own]
                     for block in work.blocks], dev)
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
    split_sizes = [b for b in order if measured[b].input_grad_ms is not None]
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
                peak_bytes=tuple(measured[b].peak_bytes[i] for b in order),
                fwd_iqr_ms=tuple(measured[b].fwd_iqr_ms[i] for b in order),
                bwd_iqr_ms=tuple(measured[b].bwd_iqr_ms[i] for b in order),
                **_backward_split(measured, order, split_sizes, i),
                recompute_ms=tuple(measured[b].fwd_ms[i] for b in order),
                checkpoint_saved_bytes=tuple(measured[b].input_bytes[i] for b in order),
                update_ms=updates[i],
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
        loss=loss,
        backward_split=f"measured at b={', '.join(map(str, split_sizes))}" if split_sizes
        else "",
        set_aside=len(set_aside),
        fsdp_units=shardable(graph.module, graph.block_names),
    )


def _backward_split(measured: dict[int, SizeResult], order: Sequence[int],
                    split_sizes: Sequence[int], i: int) -> dict[str, Any]:
    """Block ``i``'s ``input_grad_ms``, ``weight_grad_ms`` and ``split_held_bytes`` at every
    size in ``order``: as measured at ``split_sizes``; elsewhere those of the nearest measured
    size scaled by the ratio of the block's ``bwd_ms`` (times) or ``saved_bytes`` (bytes; the
    sizes' ratio where it saves nothing) at the two sizes (none when nothing was measured)."""
    if not split_sizes:
        return {}
    rows: dict[str, list[Any]] = {"input_grad_ms": [], "weight_grad_ms": [],
                                  "split_held_bytes": []}
    for b in order:
        s = min(split_sizes, key=lambda s: (abs(s - b), s))
        near = measured[s]
        assert near.input_grad_ms is not None and near.weight_grad_ms is not None
        assert near.split_held_bytes is not None
        base = near.bwd_ms[i]
        scale = measured[b].bwd_ms[i] / base if base > 0 else 0.0
        saved = near.saved_bytes[i]
        grow = measured[b].saved_bytes[i] / saved if saved > 0 else b / s
        rows["input_grad_ms"].append(near.input_grad_ms[i] * (1.0 if b == s else scale))
        rows["weight_grad_ms"].append(near.weight_grad_ms[i] * (1.0 if b == s else scale))
        rows["split_held_bytes"].append(
            near.split_held_bytes[i] if b == s else round(near.split_held_bytes[i] * grow))
    return {k: tuple(v) for k, v in rows.items()}
