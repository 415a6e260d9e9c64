"""The profiler's measurement loop: timed forward and backward runs of one block, interleaved.

:func:`measure_interleaved` times every block at every micro-batch size, round after round with
the order of the sizes rotating, until each figure's interquartile range is within
:data:`SPREAD_TOLERANCE` of its median (or the repeat cap or the time budget is reached);
:func:`timed_run` times one segment's forward and backward (ms, CUDA events on CUDA).
:mod:`autosplit.verify.plans` times whole stages with the same functions.
"""

from __future__ import annotations

import contextlib
import copy
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from autosplit.graph import BlockGraph, Segment
from autosplit.measure import steal_time
from autosplit.measure.block_memory import split_held_bytes, working_bytes
from autosplit.measure.budget import Deadline, spread_settled
from autosplit.measure.tensor_trees import backward_from, fresh_leaves, nbytes, tensor_leaves

__all__ = [
    "Interleaved",
    "Progress",
    "Loss",
    "RoundOptions",
    "SizeResult",
    "SizeState",
    "measure_interleaved",
    "private_copy",
    "segment_args",
    "stage_inputs",
    "timed_run",
    "timed_split_backward",
    "timed_split_run",
    "warm_up",
]

Progress = Callable[[int, int, str], None]
"""``progress(done, total, what)``: called after each block measurement."""



class SizeResult:
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
        self.input_bytes = [0] * n
        self.input_grad_ms: list[float] | None = None  # measured at this size, else None
        self.weight_grad_ms: list[float] | None = None
        self.split_held_bytes: list[int] | None = None  # with input_grad_ms


class SizeState:
    """What the measurement of one micro-batch size carries from block to block: the values
    later blocks read, and the storages already saved for backward (kept alive, so that no
    address is reused while it may still be compared)."""

    def __init__(self, graph: BlockGraph, inputs: Sequence[torch.Tensor], b: int,
                 dev: torch.device) -> None:
        mb = tuple(x[:b].to(dev).clone() for x in inputs)  # own storage: exact byte counts
        self.b = b
        self.env: dict[str, Any] = dict(zip(graph.inputs, mb))
        self.result = SizeResult(len(graph.blocks), len(graph.cuts))
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


def stage_inputs(graph: BlockGraph, inputs: Sequence[torch.Tensor], b: int,
                 runs: Sequence[tuple[int, int, int]], dev: torch.device) -> dict[str, Any]:
    """The values every stage run ``(first, end, size)`` of ``runs`` with size b reads, made by
    running the blocks before it on the first b samples of ``inputs`` (no gradients)."""
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


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def private_copy(graph: BlockGraph, dev: torch.device) -> BlockGraph:
    """A BlockGraph over a deep copy of the traced module, on ``dev``, in training mode."""
    module = copy.deepcopy(graph.module).to(dev)
    module.train(graph.module.training)
    for p in module.parameters():
        p.grad = None
    return graph.with_module(module)


def _wall(dev: torch.device) -> float:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    return time.perf_counter()


Loss = Callable[[Any], torch.Tensor]
"""``loss(outputs) -> scalar``, run after the last block (:func:`autosplit.measure.losses.timing_loss`)."""


def timed_forward(seg: Segment, args: Sequence[Any], dev: torch.device, hooks: Any = None,
                  loss: Loss | None = None) -> tuple[Any, torch.Tensor | None, bool, float]:
    """The forward of one block: (outputs, the loss's value or ``None``, whether the outputs
    need a gradient, forward ms). With ``loss`` (the last block), the time includes the loss's
    forward."""
    with hooks or contextlib.nullcontext():  # the loss's own saved tensors are not the block's
        t0 = clock(dev)
        outputs = seg.module(*args)
    needs_grad = any(t.requires_grad for t in tensor_leaves(outputs))
    value = loss(outputs) if loss is not None and needs_grad else None
    return outputs, value, needs_grad, elapsed_ms(t0, clock(dev), dev)


def timed_backward(outputs: Any, value: torch.Tensor | None, needs_grad: bool,
                   dev: torch.device) -> float:
    """The backward of a :func:`timed_forward` (ms): from the loss's value when there is one,
    else from the outputs; 0 when nothing needs a gradient."""
    t0 = clock(dev)
    if value is not None:
        value.backward()
    else:
        backward_from(outputs, None)
    return elapsed_ms(t0, clock(dev), dev) if needs_grad else 0.0


def timed_run(seg: Segment, args: Sequence[Any], dev: torch.device,
              hooks: Any = None, loss: Loss | None = None) -> tuple[Any, float, float]:
    """Forward and backward of one block: (outputs, forward ms, backward ms).

    With ``loss`` (the last block), the forward time includes the loss's forward and the
    backward starts from the loss, as in training."""
    outputs, value, needs_grad, f_ms = timed_forward(seg, args, dev, hooks, loss)
    return outputs, f_ms, timed_backward(outputs, value, needs_grad, dev)


def timed_split_run(seg: Segment, args: Sequence[Any], dev: torch.device) -> tuple[float, float]:
    """One block's :func:`timed_split_backward` after an untimed forward (ms, ms)."""
    return timed_split_backward(seg.module(*args), None, args, seg.module.parameters(), dev)


def timed_split_backward(outputs: Any, value: torch.Tensor | None, args: Sequence[Any],
                         weights: Any, dev: torch.device) -> tuple[float, float]:
    """A forward's backward in two passes, as torch's zero-bubble stages run it: (input
    gradient ms, weight gradient ms); from the loss's ``value`` if given (the last stage), else
    from a gradient of ones on every output needing one; (0, 0) if none needs one.

    The passes are ``torch.distributed.pipelining``'s ``stage_backward_input`` (keeping the
    intermediate gradients the weights need) and ``stage_backward_weight``. Where none of
    ``args`` needs a gradient (the model's first stage) torch runs no input pass: the whole
    backward is weight work.
    """
    from torch.distributed.pipelining._backward import (
        stage_backward_input,
        stage_backward_weight,
    )

    if value is not None:
        roots, grads = [value], None
    else:  # torch detaches the outputs in place: no views
        roots = [t.clone() if t._is_view() else t for t in tensor_leaves(outputs) if t.requires_grad]
        grads = [torch.ones_like(t) for t in roots]
    if not roots:
        return 0.0, 0.0
    weights = list(weights)
    t0 = clock(dev)
    if not any(isinstance(a, torch.Tensor) and a.requires_grad for a in args):
        torch.autograd.backward(roots, grads)
        return 0.0, elapsed_ms(t0, clock(dev), dev)
    _, groups = stage_backward_input(roots, grads, list(args), iter(weights))
    t1 = clock(dev)
    stage_backward_weight(iter(weights), groups)
    return elapsed_ms(t0, t1, dev), elapsed_ms(t1, clock(dev), dev)


def warm_up(graph: BlockGraph, segments: Sequence[Segment], state: SizeState,
            dev: torch.device, loss: Loss | None = None) -> list[float]:
    """Run the whole model once, block by block, untimed (so that no size measured later is
    the first to touch weights, allocator and kernels); returns each block's rough wall time
    (ms, forward + backward) at this size, for the budget."""
    env = dict(state.env)
    estimate = []
    for seg in segments:
        args = segment_args(graph, env, seg)
        t0 = _wall(dev)
        outputs = seg.module(*args)
        backward_from(outputs, loss if seg is segments[-1] else None)
        estimate.append((_wall(dev) - t0) * 1000.0)
        env.update(zip(seg.outputs, (o.detach() if isinstance(o, torch.Tensor) else o
                                     for o in outputs)))
    for p in graph.module.parameters():
        p.grad = None
    return estimate


def _iqr(values: Sequence[float]) -> float:
    if len(values) < 2:
        return 0.0
    q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q3 - q1


@dataclass(frozen=True, slots=True)
class RoundOptions:
    """How :func:`measure_interleaved` times a block's sizes.

    Attributes:
        warmup: untimed rounds first.
        repeats: timed rounds at least; more while a figure's spread is not settled.
        cap: timed rounds at most.
        explicit: the user named the sizes: the first size the model fails on ends it all.
        split_at: the size whose backward is also timed in its two passes, or ``None``.
    """

    warmup: int
    repeats: int
    cap: int
    explicit: bool = False
    split_at: int | None = None


@dataclass(frozen=True, slots=True)
class Interleaved:
    """What :func:`measure_interleaved` counted.

    Attributes:
        measured: each size that ran every block, with its results.
        failures: ``(size, exception)`` for each size the model failed on.
        set_aside: a block's index for each timed round the hypervisor disturbed.
    """

    measured: dict[int, SizeResult]
    failures: tuple[tuple[int, Exception], ...]
    set_aside: tuple[int, ...]


def measure_interleaved(
    graph: BlockGraph,
    segments: Sequence[Segment],
    states: dict[int, SizeState],
    dev: torch.device,
    rounds: RoundOptions,
    deadline: Deadline,
    progress: Progress | None = None,
    loss: Loss | None = None,
) -> Interleaved:
    """Measure every block at every size, block after block; within a block the sizes take
    turns, round after round (the order rotates each round), so that a machine slowing down
    or speeding up meanwhile shifts every size alike instead of one size against another.
    The last block is timed with ``loss`` after it (see :func:`timed_run`).

    At size ``split_at`` the backward is also timed in its two passes (:func:`timed_split_run`)
    right after that size's run, in the first ``repeats`` timed rounds only (to keep the
    overhead to about one more run of one size); a block whose backward torch cannot split
    counts as input-gradient work only (W = 0).

    A timed round during which the hypervisor took more than its share of the CPUs
    (:class:`autosplit.measure.steal_time.Window`) is set aside: its timings count only for a block that has
    no other round, and the block's index goes into ``set_aside`` (one entry per round)."""
    warmup, repeats, cap, split_at = rounds.warmup, rounds.repeats, rounds.cap, rounds.split_at
    failures: list[tuple[int, Exception]] = []
    set_aside: list[int] = []
    params = {_storage(p) for p in graph.module.parameters()}
    total = len(states) * len(segments)
    for i, seg in enumerate(segments):
        fwd: dict[int, list[float]] = {b: [] for b in states}
        bwd: dict[int, list[float]] = {b: [] for b in states}
        split_ms: list[tuple[float, float]] = []
        spare_f: dict[int, list[float]] = {b: [] for b in states}  # rounds set aside
        spare_b: dict[int, list[float]] = {b: [] for b in states}
        spare_split: list[tuple[float, float]] = []
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
            window = steal_time.Window()
            round_f: dict[int, float] = {}
            round_b: dict[int, float] = {}
            round_split: list[tuple[float, float]] = []
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
                    outputs, f_ms, b_ms = timed_run(seg, state.args(graph, seg), dev, hooks,
                                                     loss if seg is segments[-1] else None)
                except Exception as exc:  # noqa: BLE001 - the user's model failed on this input
                    failures.append((b, exc))
                    del states[b]
                    if rounds.explicit:
                        return Interleaved({}, tuple(failures), tuple(set_aside))
                    continue
                if run == 0:
                    kept[b] = outputs
                if run >= warmup:
                    round_f[b], round_b[b] = f_ms, b_ms
                if b == split_at and run < warmup + repeats:
                    try:
                        input_ms, weight_ms = timed_split_run(seg, state.args(graph, seg), dev)
                    except Exception:  # noqa: BLE001  torch cannot split it: one piece
                        input_ms, weight_ms = b_ms, 0.0
                    if run >= warmup:
                        round_split.append((input_ms, weight_ms))
            round_s = time.perf_counter() - round_start
            if run >= warmup:
                kept_round = not window.disturbed()
                if not kept_round:
                    set_aside.append(i)
                to_f, to_b = (fwd, bwd) if kept_round else (spare_f, spare_b)
                for b, f_ms in round_f.items():
                    to_f[b].append(f_ms)
                    to_b[b].append(round_b[b])
                (split_ms if kept_round else spare_split).extend(round_split)
            run += 1
        for b in states:  # every round set aside: those timings, rather than none
            fwd[b], bwd[b] = (fwd[b], bwd[b]) if fwd[b] else (spare_f[b], spare_b[b])
        split_ms = split_ms or spare_split
        held_between = None
        for b, state in states.items():
            peak[b] = working_bytes(seg, state.args(graph, seg), dev,
                                    loss if seg is segments[-1] else None)
            if b == split_at and split_ms:
                held_between = split_held_bytes(seg, state.args(graph, seg), dev)
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
            res.input_bytes[i] = sum(
                {_storage(v): v.untyped_storage().nbytes() for v in
                 (state.env[n] for n in seg.inputs) if isinstance(v, torch.Tensor)}.values())
            if b == split_at and split_ms:
                if res.input_grad_ms is None or res.weight_grad_ms is None:
                    res.input_grad_ms = [0.0] * len(segments)
                    res.weight_grad_ms = [0.0] * len(segments)
                res.input_grad_ms[i] = statistics.median(x for x, _ in split_ms)
                res.weight_grad_ms[i] = statistics.median(w for _, w in split_ms)
                if res.split_held_bytes is None:
                    res.split_held_bytes = [0] * len(segments)
                # the block's inputs it saves (not in held_between: allocated before it ran)
                inputs_saved = sum(n for ptr, n in storages.items() if ptr in inputs_here) - shared
                res.split_held_bytes[i] = (res.saved_bytes[i] if held_between is None
                                           else held_between + inputs_saved)
            state.advance(graph, seg, kept[b])
            if progress is not None:
                progress(i * len(states) + k + 1, total,
                         f"{graph.blocks[i].name} @ b={b}")
    return Interleaved({b: state.result for b, state in states.items()}, tuple(failures),
                       tuple(set_aside))


def clock(dev: torch.device) -> Any:
    if dev.type == "cuda":
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event
    return time.perf_counter()


def elapsed_ms(start: Any, end: Any, dev: torch.device) -> float:
    if dev.type == "cuda":
        end.synchronize()
        return float(start.elapsed_time(end))
    return (end - start) * 1000.0
